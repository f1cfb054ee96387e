"""The tuning driver (python -m moe_ops.tune) on CPU: synthetic inputs, the per-bucket flow
(GEMM1 then GEMM2, outputs checked, head-to-head against the defaults), the cache file it writes
and that the layer's own calls look those entries up; the candidate short lists; the model table.
Timings on CPU mean nothing: fake timers decide where the test needs a winner."""
import dataclasses
import json
import warnings
import time
from pathlib import Path

import pytest
import torch

import moe_ops
from moe_ops import synthetic, tune, tuning
from moe_ops import quant as q
from moe_ops.kernels.grouped_gemm import (
    GemmConfig, GemmProblem, default_config, is_valid_config, tuning_candidates,
)
from moe_ops.models import MODELS, MoEShape
from moe_ops.tuning import Tuner, token_buckets

ROOT = Path(__file__).resolve().parents[1]
TINY = MoEShape("tiny", 4, 64, 32, 2, quant=("none",))
# the Triton backend runs on the GPU where there is one, else on the interpreter (conftest)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def tuner(monkeypatch):
    """A fresh process-wide tuner (the layer's calls consult get_tuner())."""
    fresh = Tuner(shipped_dir=None)
    monkeypatch.setattr(tuning, "_TUNER", fresh)
    return fresh


@pytest.fixture
def fake_clock(monkeypatch):
    """time.perf_counter() of tune and tuning reads clock[0] (starts at 100 s); advance it."""
    clock = [100.0]

    class FakeTime:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def perf_counter():
            return clock[0]

    monkeypatch.setattr(tune, "time", FakeTime())
    monkeypatch.setattr(tuning, "time", FakeTime())
    return clock


def test_models_match_benchmark_shapes():
    shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())["models"]
    assert set(shapes) == set(MODELS)
    for name, entry in shapes.items():
        assert MoEShape.from_json(name, entry) == MODELS[name]


@pytest.mark.parametrize("quant", q.QUANT_MODES)
def test_random_checkpoint_loads_with_valid_scales(quant):
    shape = MoEShape("t", 4, 64, 64, 2, bias=True)
    ckpt = synthetic.random_checkpoint(4, 64, 64, quant=quant, bias=True, seed=3)
    layer = moe_ops.FusedMoE(4, 64, 64, 2, quant=quant, bias=True, backend="reference")
    layer.load_weights(**ckpt)
    x = synthetic.hidden_states(5, 64, seed=1)
    logits = synthetic.router_logits(5, 4, seed=2)
    out = layer(x, logits)
    assert torch.isfinite(out.float()).all() and out.float().abs().max() > 0
    # the dequantized weights have the spread of a trained layer, N(0, 1/fan_in)
    from moe_ops.reference import dequantize_weight
    weights = layer.kernel_weights()
    w2 = dequantize_weight(weights["w2"][0], weights.get("w2_scale", [None])[0]
                           if "w2_scale" in weights else None,
                           weights["w2_global_scale"][0] if "w2_global_scale" in weights else None,
                           quant, k=64)
    std = float(w2.float().std())
    assert 0.5 / 64 ** 0.5 < std < 2.0 / 64 ** 0.5, (quant, std)


def test_skewed_routing_is_skewed_and_balanced_is_not():
    def top_share(skew):
        logits = synthetic.router_logits(4096, 64, skew=skew, seed=5)
        ids = logits.topk(4, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=64).float()
        return float(counts.max() / counts.mean())
    assert top_share(False) < 1.5
    assert top_share(True) > 4.0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_candidates_short_valid_default_first(name):
    shape = MODELS[name]
    n13 = 2 * shape.intermediate_size if shape.gated else shape.intermediate_size
    for quant in q.QUANT_MODES:
        for bucket in token_buckets():
            m = bucket * shape.top_k / shape.num_experts
            for problem in (GemmProblem(1, shape.num_experts, n13, shape.hidden_size, m,
                                        torch.bfloat16, quant, shape.gated),
                            GemmProblem(2, shape.num_experts, shape.hidden_size,
                                        shape.intermediate_size, m, torch.bfloat16, quant,
                                        shape.gated)):
                configs = tuning_candidates(problem)
                assert configs[0] == default_config(problem)
                # at most 19: 4-bit GEMM2 at decode has its own default, the decode list, the
                # split-K ones and the persistent kernel's decode tiles
                assert len(set(configs)) == len(configs) and 3 <= len(configs) <= 19
                assert all(is_valid_config(problem, c) for c in configs)
                if quant == "fp8":
                    # GEMM1 unswapped (its requantized output amplifies the swapped fp8
                    # wgmma's error); GEMM2's decode list offers swapped tiles on both kernels
                    swapped = [c for c in configs if c.swap_ab]
                    if problem.gemm == 1:
                        assert not swapped, configs
                    elif m <= 16:
                        assert any(c.persistent for c in swapped), configs
                        assert any(not c.persistent for c in swapped), configs


def test_tune_model_writes_entries_the_layer_looks_up(tuner, tmp_path):
    """Every bucket gets both GEMMs' entries, with their timings; a layer call at a token count
    of that bucket launches the tuned configs."""
    def timer(fn):  # every config equally fast: the defaults stay (ties never win)
        fn()
        return 1.0

    report = tune.tune_model(TINY, "none", buckets=[1, 2], tuner=tuner, timer=timer,
                             max_candidates=2, show_progress=False, device=DEVICE)
    assert [b["bucket"] for b in report["buckets"]] == [1, 2]
    assert len(tuner.records) == 4
    for record in tuner.records.values():
        assert record["candidates"] == 1 and "layer_tuned_us" in record
    path = tmp_path / "cache.json"
    tuner.save(path)
    fresh = Tuner(shipped_dir=None)
    assert fresh.load(path) == 4
    for key, config in tuner.memory.items():
        assert fresh.lookup(key) == config
    # the layer's own calls (outside autotune) look up exactly those keys
    layer = tune.build_layer(TINY, "none", dtype=torch.bfloat16, device=DEVICE)
    looked_up = []
    real_lookup = tuner.lookup
    tuner.lookup = lambda key: looked_up.append(key) or real_lookup(key)
    for tokens in (1, 2):
        (inputs,) = tune.make_inputs(layer, TINY, tokens, seed=0)[:1]
        layer(inputs.x, topk_ids=inputs.topk_ids, topk_weights=inputs.topk_weights)
    assert set(looked_up) == set(tuner.memory)


def test_budget_shares_time_out_and_skips_what_it_cannot_fit(tuner):
    """With (next to) no time every bucket keeps its defaults and the report counts the skipped
    candidates; with a budget it does not need, nothing is skipped."""
    def timer(fn):
        fn()
        return 1.0

    report = tune.tune_model(TINY, "none", buckets=[1, 2], tuner=tuner, timer=timer,
                             max_candidates=2, show_progress=False, device=DEVICE, budget_s=1e-9)
    assert report["budget_s"] == 1e-9 and report["skipped"] == 4
    assert [b["skipped"] for b in report["buckets"]] == [2, 2]
    for key, record in tuner.records.items():
        assert record["candidates"] == 0
        assert tuner.memory[key] == default_config(key.problem())
    assert "4 candidates skipped for the budget" in tune.format_report(report)
    tuner.records.clear()
    tuner.memory.clear()
    report = tune.tune_model(TINY, "none", buckets=[1], tuner=tuner, timer=timer,
                             max_candidates=2, show_progress=False, device=DEVICE, budget_s=3600)
    assert report["skipped"] == 0 and report["buckets"][0]["candidates"] == 2


def test_bucket_share_lets_a_bucket_run_long_only_while_the_rest_fit():
    # plenty left: twice an equal share
    assert tune.bucket_share(0.0, 55.0, 14) == pytest.approx(2 * 55.0 / 14)
    # little left: what keeps BUCKET_RESERVE_S for each later bucket
    assert tune.bucket_share(0.0, 6.0, 5) == pytest.approx(6.0 - 4 * tune.BUCKET_RESERVE_S)
    # after an up-front compile that left 28 s for 14 buckets, the first ones still profile
    assert tune.bucket_share(0.0, 28.0, 14) == pytest.approx(4.0)
    # the last bucket takes what is left; past the deadline, nothing
    assert tune.bucket_share(50.0, 55.0, 1) == pytest.approx(5.0)
    assert tune.bucket_share(60.0, 55.0, 3) == 0.0


def test_bucket_deadline_gives_gemm1_40_and_gemm2_80_percent(tuner, fake_clock):
    """On a fake clock where each timing takes 1 s and the bucket has 10 s: GEMM1 profiles
    until 4 s (its default and 3 candidates), GEMM2 until 8 s (the same), the rest skipped."""
    clock = fake_clock

    def timer(fn):
        fn()
        clock[0] += 1.0
        return 1.0

    layer = tune.build_layer(TINY, "none", dtype=torch.bfloat16, device=DEVICE)
    with tuning.autotune(tuner=tuner):
        result = tune.tune_bucket(layer, TINY, "none", 1, tuner, timer=timer, max_candidates=6,
                                  deadline=clock[0] + 10.0)
    records = list(tuner.records.values())
    assert all(len(tuning.experts_candidates(k.problem())[:6]) >= 5 for k in tuner.records)
    assert [r["candidates"] for r in records] == [3, 3]
    assert result.skipped == sum(r["skipped"] for r in records) > 0


def test_tune_model_compiles_every_bucket_first_then_shares_the_rest(tuner, fake_clock,
                                                                   monkeypatch):
    """One compile batch holds every bucket's candidates and runs before any profiling; the
    budget (GPU time) starts after it, and the buckets share it (fake clock: the compile takes
    30 s, the budget is 12 s, each timing 1 s)."""
    clock = fake_clock
    batches = []

    def fake_precompile(jobs, workers=None, stats=None):
        batches.append((len(jobs), len(tuner.records)))
        clock[0] += 30.0
        if stats is not None:
            stats["kernels"] = 7
        return 30.0

    monkeypatch.setattr(tune, "precompile", fake_precompile)
    monkeypatch.setattr(tune, "compiles", lambda layer: True)

    def timer(fn):
        fn()
        clock[0] += 1.0
        return 1.0

    report = tune.tune_model(TINY, "none", buckets=[1, 2, 4], tuner=tuner, timer=timer,
                             max_candidates=3, show_progress=False, device=DEVICE, budget_s=12.0)
    per_bucket = sum(len(tuning.experts_candidates(k.problem())[:3]) for k in tuner.records) // 3
    assert batches == [(3 * per_bucket, 0)]  # every bucket's jobs, before anything was profiled
    assert report["compile_s"] == 30.0 and all(b["compile_s"] == 0.0 for b in report["buckets"])
    assert report["compiled_kernels"] == 7 and "(7 kernels)" in tune.format_report(report)
    # the 12 s after the compile: each bucket timed its defaults (and the head to head), the
    # first one candidates as well, and the rest were skipped
    assert report["buckets"][0]["candidates"] > 0
    assert report["skipped"] > 0


def test_head_to_head_keeps_defaults_when_tuned_is_slower(tuner):
    calls = {"n": 0}

    def timer(fn):
        # per-candidate timings say "non-default wins", the head to head says the opposite
        calls["n"] += 1
        fn()
        return 1.0 / calls["n"] if calls["n"] <= 6 else (2.0 if calls["n"] % 2 == 0 else 1.0)

    layer = tune.build_layer(TINY, "none", dtype=torch.bfloat16, device=DEVICE)
    with tuning.autotune(tuner=tuner):
        result = tune.tune_bucket(layer, TINY, "none", 1, tuner, timer=timer, max_candidates=2)
    assert calls["n"] == 10  # each GEMM: its default and one candidate; then 3 rounds of 2
    assert not result.kept
    assert result.tuned_us == result.default_us
    assert len(tuner.memory) == 2
    for key, config in tuner.memory.items():
        assert config == default_config(key.problem())
        assert tuner.lookup(key) == config


def pair_timer(monkeypatch, times: dict, other: float = 2.0):
    """A fake timer by the (GEMM1, GEMM2) configs each timed layer call runs: times[pair], else
    `other`."""
    last = {}
    run_layer = tune.run_layer

    def recording(layer, inputs, tuner, config1, config2):
        last["pair"] = (config1, config2)
        return run_layer(layer, inputs, tuner, config1, config2)

    monkeypatch.setattr(tune, "run_layer", recording)

    def timer(fn):
        fn()
        return times.get(last["pair"], other)
    return timer


@pytest.mark.parametrize("current_s,kept", [(1.0, True), (2.5, False), (2.01, True)])
def test_current_configs_stay_unless_beaten_head_to_head(tuner, monkeypatch, current_s, kept):
    """A re-tune of a bucket the layer already has configs for (here this process's memory; a
    shipped table or a loaded cache alike) times them in the last head to head beside the
    defaults and the new pair: they stay unless the new pair is faster there by more than
    tune.REPLACE_MARGIN (2.01 against 2.0: within it)."""
    layer = tune.build_layer(TINY, "none", dtype=torch.bfloat16, device=DEVICE)
    plan = tune.plan_bucket(layer, TINY, "none", 1, tuner, max_candidates=3)
    assert plan.current is None  # nothing tuned yet: the defaults are what the layer runs
    current = (plan.cands1[2], plan.cands2[2])
    tuner.memory[plan.key1], tuner.memory[plan.key2] = current
    defaults = (plan.default1, plan.default2)
    timer = pair_timer(monkeypatch, {defaults: 3.0, current: current_s})
    with tuning.autotune(tuner=tuner):
        result = tune.tune_bucket(layer, TINY, "none", 1, tuner, timer=timer, max_candidates=3)
    # GEMM1: its first non-default candidate (2.0 against the default's 3.0; ties never win);
    # GEMM2 (beside it, every candidate 2.0): its default
    new = (plan.cands1[1], plan.default2)
    stored = (tuner.memory[plan.key1], tuner.memory[plan.key2])
    assert result.kept and result.current_kept == kept
    assert stored == (current if kept else new)
    assert (dataclasses.asdict(stored[0]), dataclasses.asdict(stored[1])) == (result.gemm1,
                                                                              result.gemm2)
    calls = len(plan.inputs)  # (a timing covers every input set; results are per call)
    assert result.current_us == pytest.approx(current_s / calls * 1e6)
    assert result.tuned_us == pytest.approx((current_s if kept else 2.0) / calls * 1e6)
    assert tuner.records[plan.key1]["layer_current_us"] == result.current_us
    line = tune.format_report(dict(
        model="tiny", quant="none", gpu="cpu", tuning_s=1.0, compile_s=0.0, setup_s=0.0,
        buckets=[dict(dataclasses.asdict(result), speedup=result.speedup)])).splitlines()[-1]
    assert "current" in line and ("current kept" in line) == kept


def test_cli_cache_entries_are_the_current_configs(tuner, tmp_path, monkeypatch, capsys):
    """--cache is read first: its entries are the current configs the run must beat (here they
    win the head to head and stay in the file)."""
    layer = tune.build_layer(TINY, "none", dtype=torch.bfloat16, device=DEVICE)
    plan = tune.plan_bucket(layer, TINY, "none", 1, tuner, max_candidates=3)
    current = (plan.cands1[2], plan.cands2[2])
    cache = tmp_path / "t.json"
    tuning.write_cache_file(cache, {plan.key1: {"config": dataclasses.asdict(current[0])},
                                    plan.key2: {"config": dataclasses.asdict(current[1])}})
    timer = pair_timer(monkeypatch, {(plan.default1, plan.default2): 3.0, current: 1.0})
    monkeypatch.setattr(tune, "default_timer", lambda: timer)
    assert tune.main(["--experts", "4", "--hidden", "64", "--intermediate", "32", "--top-k", "2",
                      "--buckets", "1", "--max-candidates", "3", "--cache", str(cache),
                      "--quiet"]) == 0
    assert "current kept" in capsys.readouterr().out
    stored = tuning.read_cache_file(cache)
    assert (stored[plan.key1], stored[plan.key2]) == current


def test_current_configs_with_other_outputs_have_no_say(tuner, monkeypatch):
    layer = tune.build_layer(TINY, "none", dtype=torch.bfloat16, device=DEVICE)
    plan = tune.plan_bucket(layer, TINY, "none", 1, tuner, max_candidates=3)
    current = (plan.cands1[2], plan.cands2[2])
    tuner.memory[plan.key1], tuner.memory[plan.key2] = current
    timer = pair_timer(monkeypatch, {(plan.default1, plan.default2): 3.0, current: 1.0})
    monkeypatch.setattr(tune, "outputs_match", lambda out, ref: False)
    with tuning.autotune(tuner=tuner):
        result = tune.tune_bucket(layer, TINY, "none", 1, tuner, timer=timer, max_candidates=3)
    assert result.current_us is None and not result.current_kept
    assert (tuner.memory[plan.key1], tuner.memory[plan.key2]) == (plan.cands1[1],
                                                                  plan.default2)


def test_cli_on_the_interpreter(tuner, tmp_path, capsys):
    cache, report = tmp_path / "t.json", tmp_path / "r.json"
    rc = tune.main(["--experts", "4", "--hidden", "64", "--intermediate", "32", "--top-k", "2",
                    "--buckets", "1", "--max-candidates", "2", "--cache", str(cache),
                    "--report", str(report), "--quiet"])
    assert rc == 0
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 2 and all("gemm=" in k and "bucket=1" in k for k in entries)
    data = json.loads(report.read_text())
    assert data["command"].startswith("python -m moe_ops.tune")
    (bucket,) = data["reports"][0]["buckets"]
    assert bucket["default_us"] > 0 and bucket["tuned_us"] > 0
    assert "speedup" in capsys.readouterr().out


def test_cli_ship_with_buckets_replaces_only_those(tuner, tmp_path, monkeypatch):
    """--ship --buckets re-tunes some buckets of a shipped table: their entries are replaced,
    the other buckets' kept (a table is replaced whole only when every bucket is tuned)."""
    monkeypatch.setattr(tune, "shipped_path", lambda gpu, model, quant: tmp_path / "table.json")
    argv = ["--experts", "4", "--hidden", "64", "--intermediate", "32", "--top-k", "2",
            "--max-candidates", "1", "--ship", "--quiet"]

    def buckets():
        entries = json.loads((tmp_path / "table.json").read_text())["entries"]
        return sorted(k.rsplit("bucket=", 1)[1] for k in entries)

    assert tune.main(argv + ["--buckets", "2"]) == 0
    assert buckets() == ["2", "2"]
    assert tune.main(argv + ["--buckets", "1"]) == 0
    assert buckets() == ["1", "1", "2", "2"]


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--experts", "4"])
    assert tune.main(["--model", "mixtral_8x7b", "--quant", "int3"]) == 2
    # a count that is not a bucket would be stored under the bucket it rounds up to
    for buckets in ("3", "1,2,x", "16384"):
        assert tune.main(["--model", "mixtral_8x7b", "--quant", "none",
                          "--buckets", buckets]) == 2
    assert "--buckets" in capsys.readouterr().err


def test_shipped_path_is_per_gpu_model_quant(tmp_path):
    path = tune.shipped_path("NVIDIA H200", "deepseek_v3", "fp8_block", tmp_path)
    assert path.name == "nvidia_h200__deepseek_v3__fp8_block.json"


def test_shipped_tables_cover_every_model_and_quant_on_the_h200():
    """Every (model, quant) of shapes.json has an H200 table with both GEMMs of every bucket,
    tuned on this kernel source (else the tables are ignored there: re-run
    `python -m moe_ops.tune --model M --quant Q --ship` on an H200 after a kernel change)."""
    expected = tuning.current_metadata(gpu="NVIDIA H200")
    for name, shape in MODELS.items():
        for quant in shape.quant:
            path = tune.shipped_path("NVIDIA H200", name, quant)
            assert path.exists(), f"no shipped table {path.name}"
            with warnings.catch_warnings():
                warnings.simplefilter("error")   # stale entries warn: tuned on another source
                entries = tuning.read_cache_file(path, expected=expected,
                                                 fields=tuning._SHIPPED_FIELDS)
            got = {(k.gemm, k.bucket) for k in entries if k.quant == quant}
            assert got == {(g, b) for g in (1, 2) for b in token_buckets()}, (
                f"{path.name}: re-tune on an H200 after a kernel change "
                "(`bash benchmarks/h200_run.sh tune`)")
            assert not Path(f"{path}.lock").exists()


def test_shipped_tables_hold_the_keys_the_layer_looks_up():
    """The keys triton_experts computes for a real layer of each model (shapes only: meta
    tensors in the kernel layout) are the shipped tables' keys, at every bucket."""
    from moe_ops import layout
    from moe_ops.kernels.experts import gemm_problems
    expected = tuning.current_metadata(gpu="NVIDIA H200")
    for name, shape in MODELS.items():
        for quant in shape.quant:
            specs = layout.plan_layout(quant=quant, activation=shape.activation,
                                       num_local_experts=shape.num_experts,
                                       hidden_size=shape.hidden_size,
                                       intermediate_size=shape.intermediate_size,
                                       bias=shape.bias, dtype=torch.bfloat16, device="meta")
            w13 = torch.empty(specs["w13"].shape, dtype=specs["w13"].dtype, device="meta")
            w2 = torch.empty(specs["w2"].shape, dtype=specs["w2"].dtype, device="meta")
            table = tuning.read_cache_file(tune.shipped_path("NVIDIA H200", name, quant),
                                           expected=expected, fields=tuning._SHIPPED_FIELDS)
            for bucket in token_buckets():
                x = torch.empty(bucket, shape.hidden_size, dtype=torch.bfloat16, device="meta")
                p1, p2 = gemm_problems(x, shape.top_k, w13, w2, shape.activation, quant)
                for key in tuning.experts_keys(p1, p2, num_tokens=bucket, top_k=shape.top_k,
                                               activation=shape.activation):
                    key = dataclasses.replace(key, gpu="NVIDIA H200")
                    assert key in table, (name, quant, bucket, key.gemm)


def test_mid_list_gains_128_row_tiles_from_48_rows():
    """From 48 expected rows per expert (and below 128) the mid regime's candidates include the
    128-row tiles (tile kernel, persistent, 4-bit swap-AB); not below, nor for fp8_block."""
    def has_128_rows(m, quant):
        problem = GemmProblem(1, 128, 1536, 2048, m, torch.bfloat16, quant, True)
        return any(c.block_m == 128 for c in tuning_candidates(problem))

    for quant in ("none", "fp8", "nvfp4", "mxfp4"):
        assert not has_128_rows(32, quant) and has_128_rows(64, quant), quant
    assert not has_128_rows(64, "fp8_block")
