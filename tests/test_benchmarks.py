"""The CPU-runnable parts of the benchmark scripts (benchmarks/bench.py, baseline.py,
gpu_check.py, dev_l2_order.py): the floors, the torch baseline against the reference
backend, the weight generator, JSON/plot writing, the CLI end to end on a tiny shapes file,
and the tile order's DRAM model."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import baseline  # noqa: E402
import bench  # noqa: E402
import dev_graph_order  # noqa: E402
import dev_l2_order  # noqa: E402
import gpu_check  # noqa: E402

SHAPES = bench.load_shapes(BENCH_DIR / "shapes.json")
CEILINGS = SHAPES.ceilings
TINY_SHAPES = {
    "ceilings_h200": CEILINGS,
    "tokens": [1, 5],
    "models": {
        "tiny": {"num_experts": 8, "hidden_size": 64, "intermediate_size": 32, "top_k": 2,
                 "routing": "renormalize", "activation": "swiglu", "quant": ["none", "fp8"]},
        "tiny_ds": {"num_experts": 8, "hidden_size": 128, "intermediate_size": 128, "top_k": 2,
                    "routing": "deepseek_v3", "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 2.5, "quant": ["fp8_block", "nvfp4"]},
    },
}


def tiny(routing="renormalize", activation="swiglu", bias=False, **kw):
    fields = dict(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2)
    fields.update(kw)
    return bench.ModelConfig("tiny", routing=routing, activation=activation, bias=bias, **fields)


# ---------------------------------------------------------------------------------------------
# Floors
# ---------------------------------------------------------------------------------------------
def test_byte_floor_qwen3_t1_matches_performance_md():
    cfg = SHAPES.models["qwen3_30b_a3b"]
    floors = bench.compute_floors(cfg, "none", 1, 8, CEILINGS)
    weights = 8 * 3 * 2048 * 768 * 2  # 75.5 MB: "Qwen3 at T=1: 75 MB"
    assert floors["weight_bytes"] == weights
    assert floors["activation_bytes"] == 2 * 2048 * 2 + 128 * 4
    assert floors["bytes"] == weights + floors["activation_bytes"]
    assert floors["bound"] == "bytes"
    assert floors["byte_floor_us"] == pytest.approx(floors["bytes"] / 4.55e12 * 1e6)
    assert 16.0 < floors["floor_us"] < 17.5  # "the floor for qwen3 bf16 is about 17 us"


def test_flop_floor_and_rates_deepseek_prefill():
    cfg = SHAPES.models["deepseek_v3"]
    tokens = 16384
    floors = bench.compute_floors(cfg, "fp8_block", tokens, 256, CEILINGS)
    flops = 2 * tokens * 8 * (7168 * 2 * 2048 + 2048 * 7168)
    assert floors["flops"] == flops
    assert floors["flop_floor_us"] == pytest.approx(flops / 1274e12 * 1e6)
    assert floors["bound"] == "flops"
    rates = bench.rate_metrics(floors, 2 * floors["floor_us"])
    assert rates["fraction"] == pytest.approx(0.5)
    assert rates["tflops"] == pytest.approx(1274 / 2)
    assert rates["tbps"] == pytest.approx(floors["bytes"] / (2 * floors["floor_us"] * 1e-6) / 1e12)
    assert bench.rate_metrics(floors, None) == dict(fraction=None, tbps=None, tflops=None)
    # bf16 math for none and the W4A16 modes
    assert bench.matmul_ceiling("none", CEILINGS) == 695e12
    assert bench.matmul_ceiling("mxfp4", CEILINGS) == 695e12
    assert bench.matmul_ceiling("fp8", CEILINGS) == 1274e12


def test_relu2_flops_and_weight_bytes_per_format():
    cfg = tiny(activation="relu2", hidden_size=256, intermediate_size=384)
    assert bench.layer_flops(cfg, 3) == 2 * 3 * 2 * (256 * 384 + 384 * 256)
    gated = tiny(hidden_size=256, intermediate_size=384)
    elements = 3 * 256 * 384
    assert bench.expert_weight_bytes(gated, "none") == 2 * elements
    assert bench.expert_weight_bytes(gated, "fp8") == elements + 12
    assert bench.expert_weight_bytes(gated, "fp8_block") == elements + 4 * 3 * 3 * 2
    assert bench.expert_weight_bytes(gated, "nvfp4") == elements // 2 + elements // 16 + 12
    assert bench.expert_weight_bytes(gated, "mxfp4") == elements // 2 + elements // 32
    with_bias = tiny(bias=True, hidden_size=256, intermediate_size=384)
    assert bench.expert_weight_bytes(with_bias, "none") == 2 * elements + 4 * (768 + 256)


def test_tolerances_per_quant_mode():
    args = bench.parse_args([])
    assert bench.ours_tolerance("none", args) == 1e-2
    assert bench.ours_tolerance("fp8", args) == bench.ours_tolerance("fp8_block", args) == 1e-2
    strict = bench.parse_args(["--fp8-tolerance", "1e-2"])
    assert bench.ours_tolerance("fp8_block", strict) == 1e-2
    assert bench.baseline_tolerance("none", 1e-2) == 1e-2
    assert bench.baseline_tolerance("fp8", 1e-2) == bench.BASELINE_FP8_TOLERANCE
    assert bench.baseline_tolerance("fp8_block", 1e-2) is None  # rowwise stand-in: informational


def test_distinct_experts_counts_local_ids_only():
    ids = torch.tensor([[0, 3], [3, 5], [7, -1]])
    assert bench.count_local_experts_hit(ids, 0, 8) == 4
    assert bench.count_local_experts_hit(ids, 2, 4) == 2  # experts 3 and 5 of 2..5


# ---------------------------------------------------------------------------------------------
# The baseline against the reference backend
# ---------------------------------------------------------------------------------------------
def _check_baseline(cfg, quant, impl, tolerance, tokens=9):
    layer, base = bench.build_layer(cfg, quant, backend="reference", device="cpu",
                                    baseline_impl=impl)
    x, logits = bench.make_inputs(cfg, tokens, 1, torch.device("cpu"), torch.bfloat16, 1)[0]
    expected = bench.reference_forward(layer, x, logits)
    error = bench.relative_error(base(x, logits), expected)
    assert error <= tolerance, (quant, impl, error)
    return base


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_baseline_bf16_matches_reference(impl):
    if impl == "grouped" and not baseline.probe_capabilities("cpu").grouped_mm:
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    base = _check_baseline(tiny(), "none", impl, 1e-2)
    assert base.impl == impl


def test_baseline_fp8_rowwise_matches_reference_with_loop_fallback():
    base = _check_baseline(tiny(), "fp8", "auto", bench.BASELINE_FP8_TOLERANCE)
    # No CPU kernel for torch._scaled_grouped_mm: the auto choice falls back and says so.
    if not baseline.probe_capabilities("cpu").scaled_grouped_mm:
        assert base.impl == "loop" and "loop" in base.description
        assert any("_scaled_grouped_mm" in note for note in base.notes)


@pytest.mark.parametrize("activation,bias", [("swiglu_oai", True), ("relu2", False), ("geglu", False)])
def test_baseline_activations_and_biases(activation, bias):
    _check_baseline(tiny(activation=activation, bias=bias), "none", "loop", 1e-2)


def test_baseline_deepseek_routing_matches_reference():
    cfg = tiny(routing="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    _check_baseline(cfg, "none", "loop", 1e-2, tokens=12)
    logits = torch.randn(40, 8)
    bias = torch.randn(8) * 0.1
    ids, weights = baseline.torch_route(logits, "deepseek_v3", 2, bias, 4, 2, 2.5)
    ref_ids, ref_weights = bench.moe_ops.route(logits, 2, routing="deepseek_v3", routing_bias=bias,
                                               n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                               backend="reference")
    assert gpu_check.compare_routing(ids, weights, ref_ids, ref_weights) == (0, pytest.approx(0, abs=1e-6))


def test_baseline_4bit_uses_dequantized_bf16_weights():
    cfg = tiny(hidden_size=64, intermediate_size=64)
    _check_baseline(cfg, "nvfp4", "loop", 1e-2)
    _check_baseline(tiny(activation="swiglu_oai", bias=True, hidden_size=64, intermediate_size=64),
                    "mxfp4", "loop", 1e-2)


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["none", "fp8", "fp8_block", "nvfp4", "mxfp4"])
def test_make_weights_formats_and_spread(quant):
    cfg = tiny(hidden_size=256, intermediate_size=128)
    weights = bench.make_weights(cfg, quant, device="cpu", chunk_elements=40_000)
    ckpt = weights.checkpoint
    fp4 = quant in ("nvfp4", "mxfp4")
    assert set(ckpt) >= {"w1", "w2", "w3"}
    assert tuple(ckpt["w1"].shape) == (8, 128, 128 if fp4 else 256)
    assert tuple(ckpt["w2"].shape) == (8, 256, 64 if fp4 else 128)
    if quant == "fp8":
        assert ckpt["w1"].dtype == torch.float8_e4m3fn and tuple(ckpt["w1_scale"].shape) == (8,)
    if quant == "fp8_block":
        assert tuple(ckpt["w1_scale"].shape) == (8, 1, 2) and tuple(ckpt["w2_scale"].shape) == (8, 2, 1)
    base = weights.baseline
    w13 = base.w13.float() if base.w13_scale is None else base.w13.float() * base.w13_scale[:, :, None]
    assert torch.isfinite(w13).all() and (w13 != 0).float().mean() > 0.5
    # Dequantized spread ~ 1/sqrt(fan_in), whatever the format (fp8_block's baseline rows use
    # the mean block scale, a looser spread).
    std = w13.std().item() * math.sqrt(256)
    assert (0.6 < std < 1.6) if quant != "fp8_block" else (0.6 < std < 2.5), std
    layer = bench.moe_ops.FusedMoE(8, 256, 128, 2, quant=quant, backend="reference")
    layer.load_weights(**ckpt)  # accepted as given (pre-quantized formats bit for bit)


def test_make_weights_prequantized_fp8_loads_bit_for_bit():
    cfg = tiny(hidden_size=128, intermediate_size=128)
    weights = bench.make_weights(cfg, "fp8", device="cpu")
    layer = bench.moe_ops.FusedMoE(8, 128, 128, 2, quant="fp8", backend="reference")
    layer.load_weights(**weights.checkpoint)
    # Interleaved kernel layout: row 2i is gate row i, 2i+1 up row i.
    gate = layer.w13.view(torch.uint8)[:, 0::2]
    assert torch.equal(gate, weights.checkpoint["w1"].contiguous().view(torch.uint8))


def test_ep_shard_layer_and_routing_bias():
    cfg = tiny(routing="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    layer, base = bench.build_layer(cfg, "none", backend="reference", device="cpu",
                                    local_expert_offset=2, num_local_experts=4)
    assert base is None  # the baseline runs whole layers only
    assert layer.w13.shape[0] == 4 and layer.routing_bias.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Output: JSON, plot, table, CLI
# ---------------------------------------------------------------------------------------------
def test_write_json_is_strict_and_atomic(tmp_path):
    path = tmp_path / "deep" / "out.json"
    payload = dict(records=[dict(x=float("nan"), y=float("inf"), z=1.5, t=(1, 2),
                                 dtype=torch.bfloat16, tensor=torch.tensor([1, 2]))])
    bench.write_json(path, payload)
    loaded = json.loads(path.read_text())
    assert loaded == dict(records=[dict(x=None, y=None, z=1.5, t=[1, 2], dtype="torch.bfloat16",
                                        tensor=[1, 2])])
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_plan_listed_modes_cross_product_and_listed_only():
    args = bench.parse_args(["--models", "qwen3_30b_a3b", "deepseek_v3"])
    assert [(c.name, q) for c, q in bench.plan(args, SHAPES)] == [
        ("qwen3_30b_a3b", "none"), ("qwen3_30b_a3b", "fp8"), ("deepseek_v3", "fp8_block"),
        ("deepseek_v3", "nvfp4")]
    args = bench.parse_args(["--models", "deepseek_v3", "--quant", "none", "fp8_block"])
    assert [q for _, q in bench.plan(args, SHAPES)] == ["none", "fp8_block"]
    args = bench.parse_args(["--models", "deepseek_v3", "--quant", "none", "fp8_block", "--listed-only"])
    assert [q for _, q in bench.plan(args, SHAPES)] == ["fp8_block"]
    quick = bench.parse_args(["--quick"])
    assert quick.models == list(bench.QUICK_MODELS) and quick.budget_ms < 100


def test_backend_support_probe(kernel_device):
    # the Triton kernels run the 4-bit modes (on the GPU, or in the interpreter on CPU); a
    # backend that cannot run a mode is reported with its reason, not crashed on
    assert bench.backend_support("triton", "nvfp4", kernel_device, torch.bfloat16, {}) is None
    reason = bench.backend_support("cpu", "mxfp4", torch.device("cpu"), torch.bfloat16, {})
    assert isinstance(reason, str) and reason


def test_bf16_peer_computes_the_4bit_layer_exactly():
    """The bf16 peer of a 4-bit layer holds its weights dequantized and computes what the 4-bit
    layer computes: exactly for mxfp4; nvfp4's float32 global scale rounds to bf16."""
    cfg = bench.ModelConfig("tiny_oss", num_experts=4, hidden_size=64, intermediate_size=32,
                            top_k=2, routing="renormalize", activation="swiglu_oai", bias=True,
                            quant=("mxfp4",))
    for quant in ("mxfp4", "nvfp4"):
        layer, _ = bench.build_layer(cfg, quant, backend="reference", device="cpu",
                                     with_baseline=False)
        peer = bench.build_bf16_peer(cfg, quant, layer, backend="reference")
        x, logits = bench.make_inputs(cfg, 5, 1, torch.device("cpu"), torch.bfloat16, 1)[0]
        bound = 1e-6 if quant == "mxfp4" else 1e-2
        assert bench.relative_error(peer(x, logits), layer(x, logits)) < bound, quant


def test_cli_end_to_end_on_cpu(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(TINY_SHAPES))
    out = tmp_path / "results" / "cpu.json"
    argv = ["--shapes", str(shapes), "--device", "cpu", "--backend", "reference", "--models", "tiny",
            "--budget-ms", "1", "--check-tokens", "4", "--out", str(out), "--deadline-s", "0"]
    plot = pytest.importorskip("matplotlib") and tmp_path / "results" / "cpu.png"
    assert bench.main(argv + ["--plot", str(plot)]) == 0
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["command"].endswith(" ".join(argv + ["--plot", str(plot)]))
    assert {"gpu", "torch", "triton", "date", "git", "ceilings", "notes"} <= set(meta)
    assert [(r["quant"], r["tokens"]) for r in data["records"]] == [
        ("none", 1), ("none", 5), ("fp8", 1), ("fp8", 5)]
    for record in data["records"]:
        assert record["ours_eager_us"] > 0 and record["baseline_us"] > 0
        assert record["ours_graph_us"] is None  # no graphs on CPU, said in errors
        assert record["fraction"] == pytest.approx(record["floor_us"] / record["ours_eager_us"])
        assert 1 <= record["distinct_experts"] <= 8
    assert [c["ok_ours"] for c in data["checks"]] == [True, True]
    assert all(c["ok_baseline"] for c in data["checks"])
    assert plot.stat().st_size > 1000
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-5].split()[:3] == ["model", "quant", "T"]
    assert table[-1].split()[:3] == ["tiny", "fp8", "5"]


# ---------------------------------------------------------------------------------------------
# gpu_check's comparison logic (the GPU parts run on the GPU only)
# ---------------------------------------------------------------------------------------------
def test_compare_catches_one_stale_row_that_frobenius_hides():
    expected = torch.randn(40000, 64)
    actual = expected + 1e-3 * torch.randn_like(expected)
    error, worst = gpu_check.compare(actual, expected, chunk_rows=8192)
    assert error < 2e-3 and worst < 1e-2
    actual[12345] = torch.randn(64)  # a stale row
    error, worst = gpu_check.compare(actual, expected, chunk_rows=8192)
    assert error < 1e-2 < 0.1 < worst
    actual[7] = float("nan")
    assert all(math.isnan(v) for v in gpu_check.compare(actual, expected))
    # rows the reference leaves at zero (no local expert) must stay zero
    expected[10] = 0
    actual = expected.clone()
    assert gpu_check.compare(actual, expected) == (0.0, 0.0)
    actual[10] = 0.5
    assert gpu_check.compare(actual, expected)[1] > 1


def test_compare_routing_ignores_slot_order():
    ids = torch.tensor([[1, 2], [3, 4]])
    weights = torch.tensor([[0.6, 0.4], [0.3, 0.7]])
    assert gpu_check.compare_routing(ids.flip(1), weights.flip(1), ids, weights) == (0, 0.0)
    other = torch.tensor([[1, 2], [3, 5]])
    assert gpu_check.compare_routing(other, weights, ids, weights)[0] == 1


def test_gpu_check_plans():
    supported = {q: None for q in ("none", "fp8", "fp8_block")}
    supported.update(nvfp4="no 4-bit kernels", mxfp4="no 4-bit kernels")
    args = gpu_check.parse_args([])
    cases, skipped = gpu_check.build_plan(args, SHAPES, supported, torch.device("cpu"))
    kinds = {(c.cfg.name, c.quant, c.kind, c.tokens) for c in cases}
    for t in (1, 7, 64, 1000, 16384):
        assert ("mixtral_8x7b", "fp8", "routed", t) in kinds
    assert ("deepseek_v3", "fp8_block", "skew", 16384) in kinds
    assert ("qwen3_30b_a3b", "none", "pad", 64) in kinds
    large = [c for c in cases if c.kind == "large"]
    assert {c.quant for c in large} == {"none", "fp8_block"}
    assert cases[:len(large)] == large  # first: a deadline never drops the 2^31 check
    assert all(c.tokens * c.cfg.top_k * c.cfg.hidden_size > 2**31 for c in large)
    assert {r.quant for r in skipped} == {"nvfp4", "mxfp4"} and all(r.status == "SKIP" for r in skipped)
    quick, _ = gpu_check.build_plan(gpu_check.parse_args(["--quick"]), SHAPES, supported, torch.device("cpu"))
    assert max(c.tokens for c in quick if c.kind != "large") <= 1000
    sanitize, _ = gpu_check.build_plan(gpu_check.parse_args(["--sanitize"]), SHAPES, supported,
                                       torch.device("cpu"))
    assert {c.quant for c in sanitize} == {"none", "fp8", "fp8_block"}
    assert max(c.tokens for c in sanitize) <= 64 and not any(c.kind == "large" for c in sanitize)


# ---------------------------------------------------------------------------------------------
# transformers' experts implementations as peers (hf_peers.py)
# ---------------------------------------------------------------------------------------------
import hf_peers  # noqa: E402


def _needs_transformers():
    version, why = hf_peers.transformers_status()
    if version is None:
        pytest.skip(why)


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("swiglu_oai", True),
                                             ("relu2", False), ("geglu", True)])
def test_hf_peers_compute_what_the_layer_computes(activation, bias):
    _needs_transformers()
    cfg = tiny(activation=activation, bias=bias)
    layer, base = bench.build_layer(cfg, "none", backend="reference", device="cpu")
    state = bench.RunState(bench.parse_args([]), SHAPES, torch.device("cpu"), 0.0)
    peers = bench.make_peers(state, cfg, "none", layer, base, ["grouped_mm", "batched_mm"])
    assert [p.name for p in peers] == ["grouped_mm", "batched_mm"]
    if activation == "swiglu_oai":  # gpt-oss's own layout: transposed, gate/up interleaved
        module = peers[0].module
        assert module.is_transposed and not module.is_concatenated
        assert module.gate_up_proj.shape == (8, 64, 64)
        torch.testing.assert_close(module.gate_up_proj[:, :, 1::2].transpose(1, 2),
                                   base.weights.w13[:, 32:])
    else:
        assert peers[0].module.down_proj is base.weights.w2  # shared, not copied
    x, logits = bench.make_inputs(cfg, 9, 1, torch.device("cpu"), torch.bfloat16, 3)[0]
    expected = bench.reference_forward(layer, x, logits)
    for peer in peers:
        out = peer(x, logits)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert bench.relative_error(out, expected) <= 1e-2, peer.name
    checks = bench.check_peers(state, cfg, "none", layer, peers)
    assert all(c["ok"] for c in checks.values())


def test_peers_flag():
    assert bench.parse_args([]).peers == ["torch", "grouped_mm", "batched_mm"]
    args = bench.parse_args(["--peers", "grouped_mm"])
    assert args.hf_peers == ["grouped_mm"] and args.no_baseline
    args = bench.parse_args(["--peers", "torch,batched_mm", "--no-baseline"])
    assert args.peers == ["batched_mm"] and args.no_baseline
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "torch,vllm"])


def test_cli_with_peers_on_cpu(tmp_path, capsys, monkeypatch):
    _needs_transformers()
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(TINY_SHAPES))
    out = tmp_path / "peers.json"
    # batched_mm at T=5 would gather 5*2 expert weights: over this limit it is skipped, by name
    monkeypatch.setattr(hf_peers, "CPU_BATCHED_MM_BYTES", 3 * (64 * 64 + 64 * 32) * 2 * 2)
    argv = ["--shapes", str(shapes), "--device", "cpu", "--backend", "reference", "--models",
            "tiny", "--budget-ms", "1", "--check-tokens", "4", "--out", str(out), "--no-plot",
            "--deadline-s", "0", "--peers", "grouped_mm,batched_mm"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    none = [r for r in data["records"] if r["quant"] == "none"]
    assert [r["tokens"] for r in none] == [1, 5]
    for record in none:
        assert record["grouped_mm_us"] > 0 and record["route_us"] > 0
        assert record["baseline_us"] is None  # torch not asked for
        assert record["grouped_mm_graph_us"] is None and "grouped_mm_graph" in record["errors"]
        assert record["speedup_vs_grouped_mm"] > 0
    assert none[0]["batched_mm_us"] > 0
    assert none[1]["batched_mm_us"] is None
    assert none[1]["errors"]["batched_mm"].startswith("skipped: batched_mm would gather")
    fp8 = [r for r in data["records"] if r["quant"] == "fp8"]
    assert fp8 and not any("grouped_mm_us" in r for r in fp8)
    notes = data["metadata"]["notes"]
    assert any(n.startswith("transformers peers: quant='fp8' not timed") for n in notes)
    assert data["metadata"]["settings"]["peers"] == ["grouped_mm", "batched_mm"]
    assert data["checks"][0]["peers"]["grouped_mm"]["ok"]
    assert "gmm-g us" in capsys.readouterr().out


def test_cli_without_transformers_skips_peers_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_peers, "transformers_status", lambda: (None, "not installed"))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(dict(TINY_SHAPES, tokens=[3])))
    out = tmp_path / "none.json"
    argv = ["--shapes", str(shapes), "--device", "cpu", "--backend", "reference", "--models",
            "tiny", "--quant", "none", "--budget-ms", "1", "--out", str(out), "--no-plot",
            "--deadline-s", "0"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert "transformers peers skipped: not installed" in data["metadata"]["notes"]
    assert data["records"][0]["baseline_us"] > 0 and "grouped_mm_us" not in data["records"][0]


# ---------------------------------------------------------------------------------------------
# benchmarks/bench_prepare.py: weight preparation against its floor
# ---------------------------------------------------------------------------------------------
def test_bench_prepare_tiny_on_cpu(tmp_path, monkeypatch, capsys):
    import bench_prepare

    monkeypatch.setenv("MOE_OPS_RESULTS_DIR", str(tmp_path / "results"))
    argv = ["--tiny", "--device", "cpu", "--repeats", "1", "--copy-bytes", str(1 << 20)]
    assert bench_prepare.main(argv) == 0
    data = json.loads((tmp_path / "results" / "prepare_cpu_tiny.json").read_text())
    meta = data["metadata"]
    assert meta["command"].endswith(" ".join(argv))
    assert {"gpu", "date", "torch", "triton", "git", "copy_bandwidth"} <= set(meta)
    assert meta["copy_bandwidth"]["bytes_per_s"] > 0 and not meta["failures"]
    cases = {(r["model"], r["quant"], r["prequantized"], r["op"]) for r in data["records"]}
    for model, quant, pre in bench_prepare.CASES:
        assert {(model, quant, pre, "prepare"), (model, quant, pre, "reload")} <= cases
    assert bench_prepare.TARGET in cases
    assert ("deepseek_v3", "fp8_block", False, "prepare, torch path") in cases
    for r in data["records"]:
        assert r["time_ms"] > 0 and r["floor_ms"] > 0
        assert r["ratio"] == pytest.approx(r["time_ms"] / r["floor_ms"])
        assert r["bytes_read"] > 0 and r["bytes_written"] > 0
        if r["op"] == "reload":
            assert r["parameters_moved"] == [] and r["matches_prepare"] and r["bit_exact"]
    # The floor of deepseek_v3 bf16 -> fp8_block: bf16 w1, w2, w3 read; fp8 values + block
    # scales written (E=4, H=256, I=128 at --tiny).
    e, h, i = bench_prepare.TINY_SIZES["deepseek_v3"]
    first = data["records"][0]
    assert first["bytes_read"] == 3 * e * h * i * 2
    assert first["bytes_written"] == 3 * e * h * i + 4 * e * (2 * 1 * 2 + 2 * 1)
    table = capsys.readouterr().out.strip().splitlines()
    assert table[1].split()[:3] == ["model", "source", "quant"]
    assert table[-1].split()[0] == "gpt_oss_120b"


def test_hf_gpu_check_cpu_smoke(capsys):
    """hf_gpu_check.py's tiny CPU mode: logits, generate, fine-grained FP8 experts on moe_ops,
    and a static-cache generate that generate itself compiles (aot_eager here,
    reduce-overhead on the GPU)."""
    _needs_transformers()
    import hf_gpu_check
    assert hf_gpu_check.main(["--families", "mixtral", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS mixtral") == 3 and "FAIL" not in out
    assert "fine-grained FP8" in out and "compiled by generate" in out


def test_profile_layer_finds_its_flush_kernel_by_name():
    """The flush that separates profiled calls is found by its CUDA kernel's name, which torch
    takes from the functor (BitwiseXorFunctor); none of the layer's kernels may match."""
    import profile_layer

    cuda_name = ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor"
                 "<unsigned char, unsigned char, unsigned char, at::native::BitwiseXorFunctor"
                 "<unsigned char> >, std::array<char*, 2ul> >(int, ...)")
    assert profile_layer.is_flush(cuda_name) and profile_layer.is_flush("aten::bitwise_xor_")
    for name in ("_grouped_gemm_kernel", "_combine_pair_rows_kernel", "_act_quant_kernel",
                 "_route_kernel", "_align_kernel", "void at::native::bitwise_not_kernel_cuda"):
        assert not profile_layer.is_flush(name)


# benchmarks/ncu_sass_stalls.py: Nsight Compute's per-instruction stall samples, summed

def test_ncu_sass_stalls_ranks_instructions_and_opcodes(tmp_path, capsys):
    import ncu_sass_stalls
    report = tmp_path / "source.csv"
    report.write_text(
        "==PROF== Disconnected from process\n"
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_wait","stall_barrier",'
        '"stall_long_sb"\n'
        '"0x10","LOP3.LUT R1, R2, R3, R4, 0xfe, !PT","1,200","800","0","0"\n'
        '"0x20","@P0 BRA 0x10","50","0","0","0"\n'
        '"0x30","HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR4], R24","3000","100","2500","0"\n'
        '"0x40","LOP3.LUT R5, R6, R7, R8, 0x96, !PT","750","700","0","0"\n'
        '"0x50","LDS.128 R8, [R2]","0","0","0","0"\n')
    assert ncu_sass_stalls.main([str(report), "--top", "2"]) == 0
    out = capsys.readouterr().out
    opcodes = out.split("by opcode:")[1].split("the 2 instructions")[0].split()
    assert opcodes[:4] == ["HGMMA", "60.0%", "LOP3", "39.0%"] and "BRA" in opcodes
    ranked = out.split("the 2 instructions holding the most samples:")[1].strip().splitlines()
    assert len(ranked) == 2 and "HGMMA" in ranked[0] and "stall_barrier 2500" in ranked[0]
    assert "0xfe" in ranked[1] and "stall_wait 800" in ranked[1]
    # every stall_* column is a reason (stall_long_sb too), another version's "# Samples" total
    report.write_text('"Source","# Samples","stall_long_sb","stall_wait"\n'
                      '"LDG.E R2, [R4]","90","80","10"\n"IADD3 R1, R2, 1, RZ","10","0","10"\n')
    assert ncu_sass_stalls.main([str(report), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "stall_long_sb 80" in out.split("most samples:")[1] and "LDG" in out
    with pytest.raises(SystemExit, match="no CSV header"):
        empty = tmp_path / "empty.csv"
        empty.write_text("==PROF== nothing\n")
        ncu_sass_stalls.main([str(empty)])


# ---------------------------------------------------------------------------------------------
# The tile order's DRAM model (dev_l2_order.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group_m", [1, 8, 32])
def test_l2_model_orders_match_the_kernels_tile_coordinates(group_m):
    """Each order visits every (row block, column block) once; the "experts" order's groups
    never hold two experts, and tile t's coordinates follow from tile // num_n alone, the
    invariant ws_gemm._tile_coords' expert groups rest on (the block's group-aligned window cut
    to its expert's run); "windows" is grouped_gemm's fixed windows."""
    experts = dev_l2_order.block_experts(dev_l2_order.expert_rows(16, 2, 700, seed=3), 64)
    num_m, num_n = len(experts), 5
    every = sorted((m, n) for m in range(num_m) for n in range(num_n))
    for order in ("windows", "experts", "rows"):
        assert sorted(dev_l2_order.tile_order(experts, num_n, order, group_m)) == every
    tiles = dev_l2_order.tile_order(experts, num_n, "experts", group_m)
    for t, (m, n) in enumerate(tiles):
        block = t // num_n
        window = range(block // group_m * group_m, min(block // group_m * group_m + group_m,
                                                        num_m))
        run = [b for b in window if experts[b] == experts[block]]
        first, size = run[0], len(run)
        assert (m, n) == (first + (t - first * num_n) % size, (t - first * num_n) // size)
        assert experts[m] == experts[block]
    windows = dev_l2_order.tile_order(experts, num_n, "windows", group_m)
    for t, (m, n) in enumerate(windows):
        first = t // (group_m * num_n) * group_m
        size = min(group_m, num_m - first)
        i = t % (group_m * num_n)
        assert (m, n) == (first + i % size, i // size)


def test_l2_model_counts_rereads():
    """Weights read once when every chunk fits the cache; with a cache too small for a window's
    weights, the fixed windows re-read the experts that straddle them and the cut groups read
    fewer bytes; what misses is whole chunks."""
    case = "deepseek_v3:fp8_block:2048:2:64:256:128"
    big = {r["order"]: r for r in dev_l2_order.run_case(case, ["windows", "experts"], 8,
                                                        64 << 30, seed=1)}
    for row in big.values():
        assert row["weight_factor"] == pytest.approx(1.0)
    small = {r["order"]: r for r in dev_l2_order.run_case(case, ["windows", "experts"], 8,
                                                          4 << 20, seed=1)}
    assert small["windows"]["weight_factor"] > 1.03
    assert small["experts"]["weight_reads_gb"] < small["windows"]["weight_reads_gb"]
    chunk = 256 * 128
    assert round(small["windows"]["weight_reads_gb"] * 1e9) % chunk == 0


def test_graph_order_reads_nvidia_smi_samples(tmp_path):
    """dev_graph_order's clock log: nvidia-smi's `timestamp, MHz, W` lines with fractional
    seconds, in time order; lines it cannot read (a header, a blank) are skipped."""
    log = tmp_path / "smi.csv"
    log.write_text("timestamp, clocks.sm, power.draw\n"
                   "2026/12/03 22:08:22.120, 1980, 512.25\n\n"
                   "2026/12/03 22:08:22.140, 1500, 690.50\n")
    rows = dev_graph_order.clock_samples(log)
    assert [r[1:] for r in rows] == [(1980.0, 512.25), (1500.0, 690.5)]
    assert rows[1][0] - rows[0][0] == pytest.approx(0.02, abs=1e-6)


def test_graph_order_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["dev_graph_order.py"])
    with pytest.raises(SystemExit, match="CUDA"):
        dev_graph_order.main()
