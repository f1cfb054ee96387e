"""The warp-specialized nvfp4 decode GEMM (moe_ops.kernels.ws_fp4, Gluon; off unless
experts.WS_FP4).

On a CPU: its sm_90 builds (Gluon has no interpreter) and that the experts stage leaves it
alone; on an H200: the experts call with it against the float64 oracle and the reference of
test_kernels_fp4, outputs NaN-poisoned first.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels import ws_fp4

from test_kernels_fp4 import make_case, run_and_check
from test_ws_gemm import assert_near_exact_sigmoid, sm90_ptx, sm90_script_rows

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[:2] == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel runs on sm_90 only")


@pytest.fixture
def ws_fp4_calls(gemm_calls):
    """The `gemm` argument (1 or 2) of each ws_fp4.gemm call, in order."""
    return gemm_calls(ws_fp4, "gemm")


@pytest.mark.parametrize("gemm,activation,bias,consumers,pipeline,quant", [
    (1, "swiglu", False, 2, False, "nvfp4"), (2, "none", True, 2, False, "nvfp4"),
    (1, "swiglu_oai", True, 2, False, "nvfp4"), (1, "relu2", False, 2, False, "nvfp4"),
    (2, "none", False, 4, False, "nvfp4"), (1, "swiglu", True, 2, True, "nvfp4"),
    (2, "none", False, 4, True, "nvfp4"), (1, "swiglu_oai", True, 2, False, "mxfp4"),
    (2, "none", False, 2, True, "mxfp4"), (1, "swiglu_oai", True, 3, False, "nvfp4"),
    (2, "none", False, 3, True, "mxfp4")])
def test_builds_for_sm90(gemm, activation, bias, consumers, pipeline, quant):
    """Every epilogue form builds for sm_90 (in a fresh process without TRITON_INTERPRET:
    the Triton helpers it calls are interpreter objects under it): bf16 wgmmas with a register
    operand, no spill, the layout conversions into that operand asserted trivial; the pipelined
    consumer (PIPELINE) too."""
    ptx = sm90_ptx("ws_fp4", f"gemm={gemm}, activation={activation!r}, has_bias={bias}, "
                             f"consumers={consumers}, pipeline={pipeline}, quant={quant!r}")
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{ws_fp4.REGISTERS[consumers][0]}" in ptx
    assert "cp.async.bulk.tensor.3d" in ptx and "mul.rn.bf16x2" in ptx
    # three consumers: their 192 rows in 64-row boxes, weights (3-d) and scales (2-d), in one
    # static branch for each count of boxes before N (1 + 2 + 3 copies of each); the
    # activations' box is 2-d too (4 messages)
    boxes = (ptx.count("cp.async.bulk.tensor.3d"), ptx.count("cp.async.bulk.tensor.2d"))
    assert boxes == ((6, 10) if consumers == 3 else (1, 5)), boxes
    if consumers == 3:
        expected = {n * (64 * 128 + 64 * 16) + 16 * 256 * 2 for n in (1, 2, 3)}
        assert {int(b) for b in re.findall(r"expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);",
                                           ptx)} == expected


EARLY_BUILDS = """
import collections, sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import sass
from dev_gluon_fp4_decode import k_loop
from moe_ops.kernels import ws_fp4
for slots in (16, 64, 128):
    for j, (gemm, act, bias, quant) in enumerate((
            (1, "swiglu_oai", True, "mxfp4"), (2, "none", False, "nvfp4"),
            (1, "swiglu", False, "nvfp4"), (2, "none", True, "mxfp4"))):
        kernel = ws_fp4.compile_sm90(gemm=gemm, activation=act, has_bias=bias, quant=quant,
                                     slots=slots, early=True)
        ops = collections.Counter(i.split()[0].split(".")[0] for i in k_loop(kernel))
        # the late twin of the form's first build only (CI's time: each build is seconds)
        differs = -1
        if j == 0:
            late = ws_fp4.compile_sm90(gemm=gemm, activation=act, has_bias=bias, quant=quant,
                                       slots=slots, early=False)
            differs = int(sass(kernel) != sass(late))
        print(slots, gemm, quant, ops["LDL"] + ops["STL"], kernel.metadata.shared, differs)
"""


def test_early_epilogue_builds():
    """The early epilogue (EARLY_EPILOGUE) builds for sm_90 on every form, GEMM1 with bias and
    activation and GEMM2, nvfp4 and mxfp4, as code other than the late epilogue's (compared on
    each form's first build): its operands held across the K loop leave the loop without a local
    access (ptxas may spill them once a tile, outside it), shared memory within the 227 KB a
    block may take."""
    rows, done = sm90_script_rows(EARLY_BUILDS)
    assert len(rows) == 12, done.stdout
    for slots, gemm, quant, local, shared, differs in rows:
        assert local == "0", (slots, gemm, quant)
        assert int(shared) <= 227 * 1024, (slots, gemm, quant, shared)
        assert differs in ("1", "-1"), (slots, gemm, quant)
    assert [row[-1] for row in rows].count("1") == 3, rows


def test_default_and_off_hopper(monkeypatch, ws_fp4_calls, poisoned_empty):
    """Both GEMMs by default; still never used without an sm_90 GPU."""
    assert experts_mod.WS_FP4 == os.environ.get("MOE_OPS_WS_FP4", "1")
    if HOPPER:
        pytest.skip("the kernel applies on this GPU")
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    ckpt, kernel, x, ids, weights = make_case("nvfp4", 8, 256, 192, 8, 2, seed=4)
    run_and_check("nvfp4", ckpt, kernel, x, ids, weights)
    assert ws_fp4_calls == []


@needs_hopper
@pytest.mark.parametrize("tokens,slots", [(32, 16), (33, 64), (255, 64), (256, 128)])
def test_rows_an_expert_thresholds(tokens, slots, gemm_calls, poisoned_empty):
    """The defaults (8 experts, top 2): up to WS_FP4_MAX_ROWS = 8 routed rows an expert on
    average both GEMMs on the 16-slot decode form; one pair more, the 64-slot prefill form
    (WS_FP4_PREFILL_MIN_ROWS = 8); from WS_FP4_WIDE_MIN_ROWS = 64 the 128-slot form, against
    the oracle."""
    assert (experts_mod.WS_FP4_MAX_ROWS, experts_mod.WS_FP4_PREFILL_MIN_ROWS,
            experts_mod.WS_FP4_WIDE_MIN_ROWS) == (8, 8, 64)
    calls = gemm_calls(ws_fp4, "gemm", record="slots")
    ckpt, kernel, x, ids, weights = make_case("nvfp4", tokens, 512, 256, 8, 2, seed=5)
    run_and_check("nvfp4", ckpt, kernel, x, ids, weights)
    assert calls == [slots] * 2, calls


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="gemm=1 needs an activation"):
        ws_fp4.gemm(None, None, None, None, None, None, None, gemm=1, activation="none")
    with pytest.raises(ValueError, match="slots must be one of"):
        ws_fp4.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                    slots=32)
    with pytest.raises(ValueError, match="consumers: the 64-slot form runs 2"):
        ws_fp4.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                    slots=64, consumers=4)
    with pytest.raises(ValueError, match="consumers: 2, 3 or 4"):
        ws_fp4.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                    consumers=5)
    with pytest.raises(ValueError, match="pipeline: the 128-slot form has serial consumers"):
        ws_fp4.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                    slots=128, pipeline=True)
    w = torch.zeros(2, 160, 128, dtype=torch.uint8)     # N = 160: not whole 64-row halves
    with pytest.raises(ValueError, match="N a multiple of 64"):
        ws_fp4.gemm(None, w, None, None, None, None, None, gemm=2, activation="none",
                    consumers=2)
    with pytest.raises(ValueError, match="quant"):
        ws_fp4.gemm(None, w, None, None, None, None, None, gemm=2, activation="none",
                    quant="fp8_block")
    # mxfp4 with Kp = 256: 8 scale bytes a row, under the 16 its loads need
    w = torch.zeros(2, 128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole 16 bytes"):
        ws_fp4.gemm(None, w, torch.zeros(2, 128, 8, dtype=torch.uint8), None, None, None, None,
                    gemm=2, activation="none", consumers=2, quant="mxfp4")
    w = torch.zeros(2, 128, 256, dtype=torch.uint8)
    # both formats need the layout's row scale (nvfp4's global scale, mxfp4's fold), [E, N]
    with pytest.raises(ValueError, match="w_global_scale"):
        ws_fp4.gemm(None, w, torch.zeros(2, 128, 16, dtype=torch.uint8), None,
                    None, None, None, gemm=2, activation="none", consumers=2, quant="mxfp4")
    with pytest.raises(ValueError, match="w_global_scale"):
        ws_fp4.gemm(None, w, torch.zeros(2, 128, 16, dtype=torch.uint8), torch.ones(2, 64),
                    None, None, None, gemm=2, activation="none", consumers=2, quant="mxfp4")
    with pytest.raises(ValueError, match="w_global_scale"):
        ws_fp4.gemm(None, w, torch.zeros(2, 128, 32, dtype=torch.uint8), None, None, None,
                    None, gemm=2, activation="none", consumers=2, quant="nvfp4")


@pytest.mark.parametrize("consumers", sorted(ws_fp4.REGISTERS))
def test_register_budget_fits_a_block(consumers):
    """maxnreg for every warp of the launch (the producer's warp padded to a warpgroup) within
    the 65536 registers of a block, in the 8-register steps Hopper allocates; the workers'
    setmaxnreg budgets within it."""
    consumer_regs, producer_regs, maxnreg = ws_fp4.REGISTERS[consumers]
    warps = 4 * consumers + 4
    assert maxnreg % 8 == 0 and consumer_regs % 8 == 0 and producer_regs % 8 == 0
    assert maxnreg * 32 * warps <= 65536
    workers = 128 * (consumer_regs * (consumers - 1) + producer_regs)
    default_regs = (maxnreg * 32 * warps - workers) // 128
    assert default_regs >= consumer_regs - 8, default_regs


@needs_hopper
@pytest.mark.parametrize("activation,bias,I,tokens,consumers,which", [
    ("swiglu", False, 192, 20, 2, "1"), ("swiglu_oai", True, 192, 40, 2, "1"),
    ("relu2", False, 256, 20, 2, "1"), ("geglu", False, 320, 1, 2, "1"),
    ("swiglu", True, 256, 30, 4, "1"), ("swiglu", True, 256, 30, 3, "1"),
    ("swiglu", False, 256, 20, 2, "gemm1"),
    ("swiglu_oai", True, 192, 1, 2, "gemm1")])
def test_experts_on_ws_fp4(activation, bias, I, tokens, consumers, which, monkeypatch,
                           ws_fp4_calls, poisoned_empty):
    """Decode-sized calls (up to 16 routed rows an expert; T = 1 forced off direct mode) run
    both GEMMs on the kernel (MOE_OPS_WS_FP4=1), or GEMM1 on it and GEMM2 on grouped_gemm's on
    the same dispatch (the default): expert-parallel ids, ids of no local expert, several K
    steps (H = 768: three 256-column steps); four consumer warpgroups with N a multiple of 256;
    three, whose 192-row tiles leave GEMM1's N = 512 a partial last tile (128 of 192 rows)."""
    monkeypatch.setattr(experts_mod, "WS_FP4", which)
    monkeypatch.setattr(experts_mod, "WS_FP4_MAX_ROWS", 16)     # full 16-row blocks too
    monkeypatch.setattr(ws_fp4, "CONSUMERS", consumers)
    ckpt, kernel, x, ids, weights = make_case("nvfp4", tokens, 768, I, 8, 2,
                                              activation=activation, bias=bias, seed=11,
                                              offset=2, num_global=12, invalid_ids=tokens > 1)
    run_and_check("nvfp4", ckpt, kernel, x, ids, weights, activation=activation, offset=2)
    assert ws_fp4_calls == ([1, 2] if which == "1" else [1])


def test_decode_benchmark_builds():
    """benchmarks/dev_gluon_fp4_decode.py --aot (the kernel's sm_90 K loop, 2, 3 and 4
    consumers (mxfp4: 2 and 3), serial and pipelined, nvfp4 and mxfp4, decode's 16-slot and
    prefill's 64- and 128-slot forms, the default epilogue; fp8's decode form, 2 and 3
    consumers) runs without a GPU; no local-memory access in any K
    loop; no stack at all but in the pipelined four-consumer form (two decoded operands in 112
    registers) and mxfp4's 128-slot form (its tile loop spills a few values once a tile: 120
    bytes of stack with the early epilogue and half blocks, measured faster than without them
    all the same); every build's shared memory within the 227 KB a block may take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "dev_gluon_fp4_decode.py")
    done = subprocess.run([sys.executable, script, "--aot"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [line for line in done.stdout.splitlines() if "consumers" in line]
    assert len(builds) == 15, done.stdout
    assert all("(0 local)" in line for line in builds), done.stdout
    assert all("stack 0 B" in line for line in builds
               if "4 consumers, pipe" not in line and "mxfp4, 128 slots" not in line), done.stdout
    shared = [int(line.split("shared ")[1].split()[0]) for line in builds]
    assert max(shared) <= 227 * 1024, shared


WGMMA_RATE_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
import dev_wgmma_rate
for n, rs, alu in ((128, True, 0), (256, False, 0), (128, True, 2), (128, False, 2)):
    kernel = dev_wgmma_rate.compile_sm90(n, rs, 0, alu)
    loop = min((b for b in loops(kernel) if any("HGMMA" in i for i in b)), key=len)
    print(n, rs, alu, sum(f"HGMMA.64x{n}x16" in i for i in loop),
          sum(i.split()[0].startswith(("LDL", "STL")) for i in loop),
          sum(i.split()[0].startswith(("IMAD", "LOP3", "SHF")) for i in loop) >= 60 * 3 * alu)
"""


def test_wgmma_rate_benchmark_builds():
    """benchmarks/dev_wgmma_rate.py's kernel builds for sm_90 without a GPU: its K step of 16
    m64nNk16 wgmmas (A from registers or shared memory) and nothing but loop control beside
    them (no local memory); with ALU rounds, the integer work inside the same loop (at least 3
    instructions a value a round)."""
    rows, done = sm90_script_rows(WGMMA_RATE_BUILDS)
    assert rows == [["128", "True", "0", "16", "0", "True"],
                    ["256", "False", "0", "16", "0", "True"],
                    ["128", "True", "2", "16", "0", "True"],
                    ["128", "False", "2", "16", "0", "True"]], done.stdout


@needs_hopper
@pytest.mark.parametrize("tokens,early", [(3, True), (3, False), (40, True)])
def test_mxfp4_rows_past_scale_two_on_ws_fp4(tokens, early, monkeypatch, ws_fp4_calls,
                                             poisoned_empty):
    """mxfp4 rows whose block scales pass 2 on the kernel (both GEMMs; decode and, at 40
    tokens an expert on average, prefill's 64-slot form; both epilogues): the layout's fold
    puts each such row's excess in its row scale, which the epilogue applies."""
    import moe_ops
    from test_kernels_fp4 import DEVICE, fp4_checkpoint
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    monkeypatch.setattr(ws_fp4, "EARLY_EPILOGUE", early)
    gen = torch.Generator().manual_seed(29)
    E, H, I, k = 4, 512, 512, 2
    ckpt = fp4_checkpoint(gen, "mxfp4", E, H, I, activation="swiglu_oai", bias=True)
    ckpt["w1_scale"][1] += 12
    ckpt["w3_scale"][2, 5:9] += 9
    ckpt["w2_scale"][1, :, 0] += 14
    kernel = moe_ops.prepare_weights(quant="mxfp4", activation="swiglu_oai",
                                     dtype=torch.bfloat16, device=DEVICE, **ckpt)
    assert float(kernel["w13_global_scale"].max()) > 1 and float(kernel["w2_global_scale"].max()) > 1
    T = tokens * E // k
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, k, generator=gen) + 0.1
    run_and_check("mxfp4", ckpt, kernel, x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE),
                  activation="swiglu_oai")
    assert ws_fp4_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("activation,bias,H,I,tokens,pipeline,which", [
    ("swiglu_oai", True, 512, 512, 20, False, "1"), ("swiglu", False, 1024, 512, 1, False, "1"),
    ("geglu", True, 1536, 512, 30, True, "1"), ("swiglu_oai", True, 1024, 512, 12, False, "gemm1"),
    ("swiglu_oai", True, 2880, 2880, 8, False, "1")])
def test_experts_on_ws_fp4_mxfp4(activation, bias, H, I, tokens, pipeline, which, monkeypatch,
                                 ws_fp4_calls, poisoned_empty):
    """mxfp4 on the kernel (MOE_OPS_WS_MXFP4=1): e8m0 scales loaded 16 bytes a row from a
    16-byte-aligned column (K steps 2j and 2j + 1's), each step its half, the fold's row scales;
    gpt-oss's swiglu_oai with biases; K of 2-6 steps (H = 512-1536), the pipelined consumer,
    GEMM1 alone; gpt-oss's own sizes (H = I = 2880: K padded to 3072, the last step's
    activation box partly past the end; GEMM2's N = 2880, 22.5 tiles of 128 rows: the last
    tile's second half idles)."""
    monkeypatch.setattr(experts_mod, "WS_FP4", which)
    monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    monkeypatch.setattr(experts_mod, "WS_FP4_MAX_ROWS", 16)
    monkeypatch.setattr(ws_fp4, "PIPELINE", pipeline)
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", True)
    ckpt, kernel, x, ids, weights = make_case("mxfp4", tokens, H, I, 8, 2,
                                              activation=activation, bias=bias, seed=17,
                                              offset=1, num_global=10, invalid_ids=tokens > 1)
    run_and_check("mxfp4", ckpt, kernel, x, ids, weights, activation=activation, offset=1)
    assert ws_fp4_calls == ([1, 2] if which == "1" else [1])


@needs_hopper
@pytest.mark.parametrize("consumers,pipeline,slots,early", [
    (2, False, 16, False), (4, False, 16, False), (2, True, 16, False), (2, False, 64, False),
    (2, False, 128, False), (4, True, 16, True), (2, False, 128, True), (3, False, 16, True),
    (3, True, 16, False)])
def test_partial_last_tile(consumers, pipeline, slots, early, monkeypatch, gemm_calls,
                           poisoned_empty):
    """N a multiple of 64 but not of the tile (H = 704: GEMM2's last tile 64 of 128 rows, 128
    of 192 with three consumers (whose producer loads only the live 64-row boxes), or 192 of
    256 with four): the consumers whose rows lie past N idle through the ring and write
    nothing; both GEMMs against the oracle (the poisoned output shows a missed column), the
    prefill forms too; with the early epilogue (EARLY_EPILOGUE) as well, on four pipelined
    consumers and on the 128-slot form."""
    monkeypatch.setattr(ws_fp4, "EARLY_EPILOGUE", early)
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_MAX_ROWS", 16)
    monkeypatch.setattr(ws_fp4, "CONSUMERS", consumers)
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", True)
    if slots == 128:
        monkeypatch.setattr(experts_mod, "WS_FP4_WIDE_MIN_ROWS", 32)
    elif slots == 64:
        monkeypatch.setattr(experts_mod, "WS_FP4_PREFILL_MIN_ROWS", 32)
        monkeypatch.setattr(experts_mod, "WS_FP4_WIDE_MIN_ROWS", 0)
        monkeypatch.setattr(ws_fp4, "PREFILL_PIPELINE", pipeline)
    else:
        monkeypatch.setattr(ws_fp4, "PIPELINE", pipeline)
    calls = gemm_calls(ws_fp4, "gemm", record="slots")
    tokens = 300 if slots > 16 else 20
    ckpt, kernel, x, ids, weights = make_case("nvfp4", tokens, 704, 256, 8, 2, seed=23,
                                              offset=1, num_global=10, invalid_ids=True)
    run_and_check("nvfp4", ckpt, kernel, x, ids, weights, offset=1)
    assert calls == [slots, slots], calls


@needs_hopper
@pytest.mark.parametrize("quant,activation,bias,H,I,tokens,pipeline,slots", [
    ("nvfp4", "swiglu", False, 768, 256, 300, False, 64),
    ("nvfp4", "swiglu_oai", True, 512, 384, 200, True, 64),
    ("mxfp4", "swiglu_oai", True, 1024, 512, 300, False, 64),
    ("nvfp4", "swiglu", False, 768, 256, 600, False, 128),
    ("mxfp4", "swiglu_oai", True, 1024, 512, 300, False, 128)])
def test_experts_on_ws_fp4_prefill(quant, activation, bias, H, I, tokens, pipeline, slots,
                                   monkeypatch, gemm_calls, poisoned_empty):
    """Prefill-sized calls (MOE_OPS_WS_FP4_PREFILL_MIN_ROWS=32; here 50-150 routed rows an
    expert, one or more blocks each, the last part padding) run both GEMMs on the kernel's
    64-slot form, serial and pipelined consumers, or on its 128-slot form
    (MOE_OPS_WS_FP4_WIDE_MIN_ROWS), nvfp4 and mxfp4, against the oracle."""
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_PREFILL_MIN_ROWS", 32)
    monkeypatch.setattr(experts_mod, "WS_FP4_WIDE_MIN_ROWS", 32 if slots == 128 else 0)
    if quant == "mxfp4":
        monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    monkeypatch.setattr(ws_fp4, "PREFILL_PIPELINE", pipeline)
    calls = gemm_calls(ws_fp4, "gemm", record="slots")
    ckpt, kernel, x, ids, weights = make_case(quant, tokens, H, I, 8, 2, activation=activation,
                                              bias=bias, seed=19, offset=1, num_global=10,
                                              invalid_ids=True)
    run_and_check(quant, ckpt, kernel, x, ids, weights, activation=activation, offset=1)
    assert calls == [slots] * 2, calls


def test_fp4_defaults():
    """The measured defaults (the figures beside them in experts.py and ws_fp4.py): mxfp4 on
    the kernel (MOE_OPS_WS_MXFP4=0: nvfp4 only), decode's 16-slot form up to 8 rows an
    expert, prefill's 64-slot form from 8 and its 128-slot form from 64 with half blocks, the
    early epilogue, N a multiple of 64, the prefill form's consumers not pipelined; each switch
    read from the environment."""
    env = os.environ.get
    assert experts_mod.WS_FP4_QUANTS == (
        ("nvfp4", ) if env("MOE_OPS_WS_MXFP4") == "0" else ("nvfp4", "mxfp4"))
    assert experts_mod.WS_FP4_MAX_ROWS == int(env("MOE_OPS_WS_FP4_MAX_ROWS", "8"))
    assert experts_mod.WS_FP4_PREFILL_MIN_ROWS == int(env("MOE_OPS_WS_FP4_PREFILL_MIN_ROWS", "8"))
    assert experts_mod.WS_FP4_WIDE_MIN_ROWS == int(env("MOE_OPS_WS_FP4_WIDE_MIN_ROWS", "64"))
    assert ws_fp4.EARLY_EPILOGUE == (env("MOE_OPS_WS_FP4_EARLY_EPILOGUE", "1") == "1")
    assert ws_fp4.HALF_BLOCKS == (env("MOE_OPS_WS_FP4_HALF_BLOCKS", "1") == "1")
    assert ws_fp4.PARTIAL_N_OK == (env("MOE_OPS_WS_FP4_PARTIAL_N", "1") == "1")
    assert ws_fp4.PREFILL_PIPELINE == (env("MOE_OPS_WS_FP4_PREFILL_PIPELINE", "0") == "1")
    assert ws_fp4.CONSUMERS == env("MOE_OPS_WS_FP4_CONSUMERS", "auto")
    assert experts_mod.ALIGN_GATHER_MAX_PAIRS == min(
        int(env("MOE_OPS_ALIGN_GATHER_MAX_PAIRS", "128")), 1024)


def test_consumers_rule(monkeypatch):
    """ws_fp4.consumers_for: "auto" runs three consumer warpgroups for 4-bit decode from
    THREE_CONSUMERS_MIN_PAIRS routed pairs where partial last tiles are allowed (four for nvfp4
    from FOUR_CONSUMERS_MIN_PAIRS), two otherwise (fewer pairs, the prefill forms); a forced
    count applies to decode only."""
    monkeypatch.setattr(ws_fp4, "CONSUMERS", "auto")
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", True)
    least = ws_fp4.THREE_CONSUMERS_MIN_PAIRS
    decode = ws_fp4.BLOCK_M
    assert ws_fp4.consumers_for(decode, "nvfp4", least) == 3
    assert ws_fp4.consumers_for(decode, "nvfp4", least - 1) == 2
    four = ws_fp4.FOUR_CONSUMERS_MIN_PAIRS["nvfp4"]
    assert ws_fp4.consumers_for(decode, "nvfp4", four) == 4
    assert ws_fp4.consumers_for(decode, "nvfp4", four - 1) == 3
    assert ws_fp4.consumers_for(decode, "mxfp4", 10 * four) == 3
    assert ws_fp4.consumers_for(ws_fp4.PREFILL_SLOTS, "nvfp4", 10 * four) == 2
    assert ws_fp4.consumers_for(decode, "mxfp4", least) == 3
    assert ws_fp4.consumers_for(decode, "mxfp4", least - 1) == 2
    assert ws_fp4.consumers_for(ws_fp4.PREFILL_SLOTS, "nvfp4", 10 * least) == 2
    assert ws_fp4.consumers_for(ws_fp4.WIDE_SLOTS, "nvfp4", 10 * least) == 2
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", False)
    assert ws_fp4.consumers_for(decode, "nvfp4", 10 * least) == 2
    monkeypatch.setattr(ws_fp4, "CONSUMERS", "4")
    assert ws_fp4.consumers_for(decode, "mxfp4", 1) == 4
    assert ws_fp4.consumers_for(ws_fp4.PREFILL_SLOTS, "nvfp4", 1) == 2
    # below THREE_CONSUMERS_MIN_PAIRS: three where 192-row tiles take fewer rows of waves
    # (gpt-oss-120b T = 1, 4 experts on 132 SMs: GEMM1's 5760 rows, not GEMM2's 2880; DeepSeek-V3
    # T = 1: neither; no counts known: two)
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", True)
    monkeypatch.setattr(ws_fp4, "CONSUMERS", "auto")
    assert ws_fp4.consumers_for(decode, "mxfp4", 4, 1, 5760, 128, 132) == 3
    assert ws_fp4.consumers_for(decode, "mxfp4", 4, 2, 2880, 128, 132) == 2
    assert ws_fp4.consumers_for(decode, "mxfp4", 16, 1, 5760, 128, 132) == 2   # equal
    assert ws_fp4.consumers_for(decode, "nvfp4", 8, 1, 4096, 256, 132) == 2
    assert ws_fp4.consumers_for(decode, "nvfp4", 8, 2, 7168, 256, 132) == 2
    assert ws_fp4.consumers_for(decode, "mxfp4", 4) == 2
    assert ws_fp4.consumers_for(ws_fp4.PREFILL_SLOTS, "mxfp4", 4, 1, 5760, 128, 132) == 2
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", False)
    assert ws_fp4.consumers_for(decode, "mxfp4", 4, 1, 5760, 128, 132) == 2
    monkeypatch.setattr(ws_fp4, "CONSUMERS", 3)   # (tests patch in a count as an int)
    assert ws_fp4.consumers_for(decode, "nvfp4", 1, gemm=2) == 3
    monkeypatch.setattr(ws_fp4, "CONSUMERS", "3,2")  # one count a GEMM
    assert ws_fp4.consumers_for(decode, "mxfp4", 1, gemm=1) == 3
    assert ws_fp4.consumers_for(decode, "mxfp4", 1, gemm=2) == 2
    assert ws_fp4.consumers_for(ws_fp4.PREFILL_SLOTS, "nvfp4", 1, gemm=1) == 2


@needs_hopper
@pytest.mark.parametrize("H", [512, 768, 1024, 1280])
@pytest.mark.parametrize("consumers", [2, 3, 4])
def test_pipelined_consumers(H, consumers, monkeypatch, ws_fp4_calls, poisoned_empty):
    """The pipelined consumer (two K steps an iteration, a tail step when the count is even,
    the last step after the loop) for GEMM1's K = H of 2, 3, 4 and 5 steps and GEMM2's single
    step (I = 256), against the oracle and the reference."""
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(ws_fp4, "PIPELINE", True)
    monkeypatch.setattr(ws_fp4, "CONSUMERS", consumers)
    ckpt, kernel, x, ids, weights = make_case("nvfp4", 12, H, 256, 8, 2, bias=True, seed=13,
                                              activation="swiglu")
    run_and_check("nvfp4", ckpt, kernel, x, ids, weights)
    assert ws_fp4_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("align,pipeline,large_path,slots", [
    (16, False, False, 16), (32, False, True, 16), (64, False, False, 16), (64, True, True, 16),
    (128, False, False, 16), (128, False, False, 64), (256, True, True, 64),
    (256, False, True, 128)])
def test_padding_blocks_are_skipped(align, pipeline, large_path, slots, monkeypatch):
    """GEMM2 on a dispatch aligned to more rows than the kernel's blocks (16 slots, or the
    prefill forms' 64 and 128: what a larger grouped_gemm block_m for the other GEMM gives, e.g.
    gpt-oss's GEMM2 on grouped_gemm at 128 rows): the blocks of padding only are skipped by
    every partition (a producer and consumers out of step would hang or mix tiles), every
    pair's row is written and matches grouped_gemm's kernel on the same dispatch, and no
    padding row is touched (the output has a poisoned row past the pairs). Two experts get
    17-40 pairs (live 16-slot blocks past a region's first), on both of moe_align's paths."""
    from moe_ops.kernels import grouped_gemm as gg
    from moe_ops.kernels.align import moe_align
    E, k, T, H, I = 8, 2, 24, 512, 256
    _, kernel, _, ids, weights = make_case("nvfp4", T, H, I, E, k, seed=9)
    dev = ids.device
    ids = ids.clone()
    ids[:20, 0] = 3        # expert 3: 20 pairs and more; expert 5: 17 and more
    ids[:17, 1] = 5
    ids[17:20, 1] = 6
    assert (ids[:, 0] != ids[:, 1]).all()
    dispatch = moe_align(ids.to(torch.int32), E, align, 0,
                         small_path_max_pairs=0 if large_path else None)
    routing = gg.Routing(ids.reshape(-1).to(torch.int32), weights.reshape(-1), k, E, 0,
                         dispatch.sorted_pair_ids, dispatch.block_expert_ids, align,
                         dispatch.num_padded)
    rows = torch.randn(dispatch.sorted_pair_ids.numel(), I, device=dev, dtype=torch.bfloat16)
    outs = []
    for use_ws in (True, False):
        out = torch.full((T * k + 1, H), float("nan"), device=dev, dtype=torch.bfloat16)
        if use_ws:
            ws_fp4.gemm(rows, kernel["w2"], kernel["w2_scale"], kernel["w2_global_scale"], None,
                        out, routing, gemm=2, activation="none", programs=5, slots=slots,
                        pipeline=pipeline)
        else:
            gg.gemm2(rows, None, kernel["w2"], kernel["w2_scale"], None, out, routing,
                     gg.GemmConfig(16, 64, 128, 1, 4, 3), quant="nvfp4", atomic_out=False,
                     w2_global_scale=kernel["w2_global_scale"])
        outs.append(out.float())
    assert torch.isfinite(outs[0][:T * k]).all(), "a pair's row was not written"
    assert torch.isnan(outs[0][T * k]).all(), "a row past the pairs was written"
    err = ((outs[0][:T * k] - outs[1][:T * k]).norm() / outs[1][:T * k].norm()).item()
    assert err < 2e-3, err


def gemms_both_ways(quant, T, slots, seed, variants, gemms=(1, 2), edit_dispatch=None,
                    H=512, I=512):
    """Both GEMMs of the kernel on one dispatch of `slots`-row blocks (random routing of T
    tokens to 2 of 8 experts, by default H = I = 512: mxfp4's K a multiple of 512 for GEMM2
    too; swiglu_oai with biases, 9 programs), once per keyword set of `variants`, on the same
    random rows; outputs NaN-poisoned first (GEMM2's with one row past the pairs).
    edit_dispatch(sorted_pair_ids) may change the dispatch first. Returns the routed ids and
    [(gemm, [output per variant])]."""
    from moe_ops.kernels import grouped_gemm as gg
    from moe_ops.kernels.align import moe_align
    E, k = 8, 2
    _, kernel, _, ids, weights = make_case(quant, T, H, I, E, k, activation="swiglu_oai",
                                           bias=True, seed=seed)
    dev = ids.device
    dispatch = moe_align(ids.to(torch.int32), E, slots, 0)
    if edit_dispatch is not None:
        edit_dispatch(dispatch.sorted_pair_ids)
    routing = gg.Routing(ids.reshape(-1).to(torch.int32), weights.reshape(-1), k, E, 0,
                         dispatch.sorted_pair_ids, dispatch.block_expert_ids, slots,
                         dispatch.num_padded)
    num_slots = dispatch.sorted_pair_ids.numel()
    gen = torch.Generator(device=dev).manual_seed(seed)
    runs = []
    for gemm in gemms:
        w, scale, gscale, bias = (
            (kernel["w13"], kernel["w13_scale"], kernel.get("w13_global_scale"), kernel["b13"])
            if gemm == 1 else
            (kernel["w2"], kernel["w2_scale"], kernel.get("w2_global_scale"), kernel["b2"]))
        rows = torch.randn(num_slots, H if gemm == 1 else I, device=dev, generator=gen).to(
            torch.bfloat16)
        outs = []
        for variant in variants:
            out = torch.full((num_slots, I) if gemm == 1 else (T * k + 1, H), float("nan"),
                             device=dev, dtype=torch.bfloat16)
            ws_fp4.gemm(rows, w, scale, gscale, bias, out, routing, gemm=gemm,
                        activation="swiglu_oai" if gemm == 1 else "none", alpha=1.702,
                        limit=7.0, programs=9, quant=quant, slots=slots, **variant)
            outs.append(out)
        runs.append((gemm, outs))
    return ids, runs


def assert_close_to_first(runs, T):
    """gemms_both_ways' two variants equal to bf16 rounding (the same k16 steps; narrower MMAs
    in the second), the same rows written (NaN-poisoned outputs), GEMM2 every pair's row (T
    tokens, k = 2) and not the one past them."""
    for gemm, (first, second) in runs:
        assert torch.equal(first.isnan(), second.isnan()), f"GEMM{gemm}: written rows differ"
        torch.testing.assert_close(second.nan_to_num(0.0).float(), first.nan_to_num(0.0).float(),
                                   rtol=1.6e-2, atol=1e-3)
        if gemm == 2:
            assert torch.isfinite(first[:T * 2]).all() and torch.isnan(first[T * 2]).all()


def assert_bit_equal(runs, T):
    """gemms_both_ways' two variants equal bit for bit, the same rows written (NaN-poisoned
    outputs), GEMM2 every pair's row (T tokens, k = 2) and not the one past them."""
    for gemm, (first, second) in runs:
        assert torch.equal(first.isnan(), second.isnan()), f"GEMM{gemm}: written rows differ"
        assert torch.equal(first.nan_to_num(0.0), second.nan_to_num(0.0)), f"GEMM{gemm}"
        if gemm == 2:
            assert torch.isfinite(first[:T * 2]).all() and torch.isnan(first[T * 2]).all()


@needs_hopper
@pytest.mark.parametrize("quant,slots", [("nvfp4", 16), ("nvfp4", 64), ("nvfp4", 128),
                                         ("mxfp4", 16), ("mxfp4", 128)])
def test_early_epilogue_is_bit_equal(quant, slots):
    """MOE_OPS_WS_FP4_EARLY_EPILOGUE: the epilogue's operands loaded before each tile's K loop
    and GEMM2's tile stored through one layout exchange compute the same float32 operations
    as the late epilogue: both GEMMs (GEMM1 with swiglu_oai and its bias, nvfp4's global
    scales) equal bit for bit on each form, every pair's row written and no padding row (the
    outputs NaN-poisoned, one row past the pairs)."""
    T = 300 if slots > 16 else 24
    _, runs = gemms_both_ways(quant, T, slots, 13, [dict(early=False), dict(early=True)])
    assert_bit_equal(runs, T)


@needs_hopper
@pytest.mark.parametrize("quant,slots,early", [("nvfp4", 16, True), ("nvfp4", 64, True),
                                               ("nvfp4", 128, False), ("mxfp4", 16, False),
                                               ("mxfp4", 64, True), ("mxfp4", 128, True)])
def test_native_cast_is_bit_equal(quant, slots, early):
    """native_cast (ws_gemm.NATIVE_CAST: the epilogue's float32 -> bf16 rounding by the GPU's
    conversion) writes what round_to_dtype's grid rounding does: both GEMMs on each form, early
    and late epilogues, equal bit for bit, the same rows written."""
    T = 300 if slots > 16 else 24
    _, runs = gemms_both_ways(quant, T, slots, 17, [dict(early=early, native_cast=False),
                                                    dict(early=early, native_cast=True)])
    assert_bit_equal(runs, T)


NATIVE_CAST_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import sass
from moe_ops.kernels import ws_fp4
for slots, gemm, act, bias, quant, early in ((16, 2, "none", False, "nvfp4", True),
                                             (64, 1, "swiglu_oai", True, "mxfp4", True),
                                             (128, 2, "none", False, "nvfp4", False)):
    sizes, local = [], []
    for native in (False, True):
        code = sass(ws_fp4.compile_sm90(gemm=gemm, activation=act, has_bias=bias, quant=quant,
                                        slots=slots, early=early, native_cast=native))
        sizes.append(len(code))
        local.append(sum(i.split()[0].startswith(("LDL", "STL")) for i in code))
    print(slots, gemm, quant, *sizes, *local)
"""


def test_native_cast_builds():
    """native_cast's sm_90 builds of the 4-bit kernel: shorter by at least 150 SASS
    instructions (the grid rounding's ~11 a value gone from every epilogue path; 1528 -> 1352
    for the 16-slot GEMM2, 5504 -> 3384 for the 128-slot one) and no more local memory
    accesses."""
    rows, done = sm90_script_rows(NATIVE_CAST_BUILDS)
    assert len(rows) == 3, done.stdout
    for slots, gemm, quant, size, size_native, local, local_native in rows:
        assert int(size) - int(size_native) >= 150, done.stdout
        assert int(local_native) <= int(local), done.stdout


@needs_hopper
@pytest.mark.parametrize("quant,slots,early", [("nvfp4", 16, True), ("nvfp4", 64, True),
                                               ("mxfp4", 64, False), ("mxfp4", 128, True)])
def test_fast_sigmoid_stays_near_tl_sigmoid(quant, slots, early):
    """fast_sigmoid (FAST_SIGMOID: GEMM1's swiglu_oai sigmoid on tanh.approx) against
    tl.sigmoid's launch (test_ws_gemm.assert_near_exact_sigmoid)."""
    T = 300 if slots > 16 else 24
    _, runs = gemms_both_ways(quant, T, slots, 19, [dict(early=early, fast_sigmoid=False),
                                                    dict(early=early, fast_sigmoid=True)],
                              gemms=(1, ))
    (_, (exact, fast)), = runs
    assert_near_exact_sigmoid(exact, fast)


FAST_SIGMOID_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import sass
from moe_ops.kernels import ws_fp4
for slots, act, bias, quant in ((16, "swiglu", False, "nvfp4"), (64, "swiglu_oai", True, "mxfp4"),
                                (128, "swiglu_oai", True, "mxfp4")):
    row = []
    for fast in (False, True):
        code = sass(ws_fp4.compile_sm90(gemm=1, activation=act, has_bias=bias, quant=quant,
                                        slots=slots, fast_sigmoid=fast))
        row += [len(code), sum("MUFU.EX2" in i.split()[:2] for i in code),
                sum("MUFU.TANH" in i.split()[:2] for i in code),
                sum(i.split()[0].startswith(("LDL", "STL")) for i in code)]
    print(slots, quant, *row)
"""


def test_fast_sigmoid_builds():
    """fast_sigmoid's sm_90 builds of the 4-bit kernel's GEMM1: one MUFU.TANH a sigmoid where
    the default build has tl.sigmoid's MUFU.EX2, fewer instructions, no more local memory
    accesses."""
    rows, done = sm90_script_rows(FAST_SIGMOID_BUILDS)
    assert len(rows) == 3, done.stdout
    for slots, quant, n, ex2, tanh, local, n_f, ex2_f, tanh_f, local_f in rows:
        assert int(tanh) == 0 and int(ex2) > 0, done.stdout
        assert int(tanh_f) == int(ex2) and int(ex2_f) == 0, done.stdout
        assert int(n_f) < int(n) and int(local_f) <= int(local), done.stdout


@needs_hopper
@pytest.mark.parametrize("switch,quant,tokens,activation,bias", [
    ("EARLY_EPILOGUE", "nvfp4", 20, "swiglu_oai", True),
    ("EARLY_EPILOGUE", "nvfp4", 300, "swiglu", False),
    ("EARLY_EPILOGUE", "nvfp4", 700, "swiglu_oai", True),
    ("EARLY_EPILOGUE", "mxfp4", 700, "swiglu_oai", True),
    ("HALF_BLOCKS", "nvfp4", 800, "swiglu_oai", True),
    ("HALF_BLOCKS", "mxfp4", 1000, "swiglu_oai", True),
    ("FAST_SIGMOID", "nvfp4", 300, "swiglu", False),
    ("FAST_SIGMOID", "mxfp4", 700, "swiglu_oai", True)])
def test_experts_with_switch(switch, quant, tokens, activation, bias, monkeypatch, gemm_calls,
                             poisoned_empty):
    """The experts call with the early epilogue on each form (16 slots at 2.5 routed rows an
    expert, 64 at 75, 128 at 175; with and without biases), with the 128-slot form's half
    blocks (200 and 250 rows an expert, some experts' last blocks half empty, some fuller) or
    with GEMM1's sigmoid on tanh.approx (FAST_SIGMOID) against the oracle."""
    monkeypatch.setattr(ws_fp4, switch, True)
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    monkeypatch.setattr(experts_mod, "WS_FP4_MAX_ROWS", 16)
    monkeypatch.setattr(experts_mod, "WS_FP4_PREFILL_MIN_ROWS", 32)
    monkeypatch.setattr(experts_mod, "WS_FP4_WIDE_MIN_ROWS", 128)
    calls = gemm_calls(ws_fp4, "gemm", record="slots")
    ckpt, kernel, x, ids, weights = make_case(quant, tokens, 512, 512, 8, 2,
                                              activation=activation, bias=bias, seed=29,
                                              invalid_ids=True)
    if switch == "HALF_BLOCKS":
        rest = torch.bincount(ids.reshape(-1).clamp(0, 7).long(), minlength=8) % 128
        assert ((rest > 0) & (rest <= 64)).any() and (rest > 64).any(), rest
    run_and_check(quant, ckpt, kernel, x, ids, weights, activation=activation)
    expected = 16 if tokens * 2 <= 16 * 8 else 128 if tokens * 2 >= 128 * 8 else 64
    assert calls == [expected] * 2, calls


HALF_BUILDS = """
import collections, sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_fp4
for early in (False, True):
    for gemm, act, bias, quant in ((1, "swiglu_oai", True, "mxfp4"), (2, "none", False, "nvfp4"),
                                   (1, "swiglu", False, "nvfp4"), (2, "none", True, "mxfp4")):
        kernel = ws_fp4.compile_sm90(gemm=gemm, activation=act, has_bias=bias, quant=quant,
                                     slots=128, early=early, half_blocks=True)
        # each consumer's whole-block and half-block K loops: the shortest two holding each
        # wgmma shape (the tile loops around them hold them and the epilogues)
        found = []
        for shape in ("64x128x16", "64x64x16"):
            with_shape = [b for b in loops(kernel) if any("HGMMA." + shape in i for i in b)]
            found += sorted(with_shape, key=len)[:2]
            print(shape, len(with_shape), end=" ")
        local = max(sum(i.split()[0].startswith(("LDL", "STL")) for i in b) for b in found)
        print(early, gemm, quant, local, kernel.metadata.shared)
"""


def test_half_blocks_build():
    """HALF_BLOCKS builds for sm_90 with the early epilogue and without, both GEMMs, nvfp4 and
    mxfp4: each consumer gets its whole-block and its half-block K loop (m64n64k16), none with
    a local access but mxfp4's GEMM2 (since the native cast, ws_gemm.NATIVE_CAST: ptxas keeps
    a few values of its half-block loop in local memory, 16 accesses a step with the early
    epilogue, 3 with the late one; the whole-block loops none; gpt-oss-120b's mxfp4 layer
    measured no slower with it, results/h200_ab_native4_*), shared memory as the 128-slot
    form's."""
    rows, done = sm90_script_rows(HALF_BUILDS)
    assert len(rows) == 8, done.stdout
    for _, whole, _, half, early, gemm, quant, local, shared in rows:
        assert int(whole) >= 2 and int(half) >= 2, (early, gemm, quant, whole, half)
        assert int(local) <= (16 if (gemm, quant) == ("2", "mxfp4") else 0), (
            early, gemm, quant, local)
        assert int(shared) <= 227 * 1024, (early, gemm, quant, shared)


QUARTER_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_fp4
for early, gemm, act, bias, quant, tail, small in (
        (True, 1, "swiglu_oai", True, "mxfp4", 4, True),
        (False, 2, "none", False, "nvfp4", 16, False)):
    kernel = ws_fp4.compile_sm90(gemm=gemm, activation=act, has_bias=bias, quant=quant,
                                 slots=128, early=early, half_blocks=True, quarter_blocks=True,
                                 tail=tail, small_x_boxes=small)
    found = []
    for shape in ("64x128x16", "64x64x16", "64x32x16"):
        with_shape = [b for b in loops(kernel) if any("HGMMA." + shape in i for i in b)]
        found += sorted(with_shape, key=len)[:2]
        print(len(with_shape), end=" ")
    local = max(sum(i.split()[0].startswith(("LDL", "STL")) for i in b) for b in found)
    print(early, gemm, quant, local, kernel.metadata.shared)
"""


def test_quarter_blocks_build():
    """QUARTER_BLOCKS builds for sm_90 (the early epilogue and the late one, both GEMMs, nvfp4
    and mxfp4, the latter with gpt-oss-120b's tail step and SMALL_X_BOXES): each consumer gets
    its whole-block, half-block and quarter-block K loops (m64n128k16, m64n64k16, m64n32k16),
    none with a local access, within a block's shared memory."""
    rows, done = sm90_script_rows(QUARTER_BUILDS)
    assert len(rows) == 2, done.stdout
    for whole, half, quarter, early, gemm, quant, local, shared in rows:
        assert min(int(whole), int(half), int(quarter)) >= 2, (early, gemm, quant, rows)
        assert local == "0", (early, gemm, quant)
        assert int(shared) <= 227 * 1024, (early, gemm, quant, shared)


def assert_narrow_blocks(ids, T):
    """gemms_both_ways' routing (8 experts, k = 2) ends some expert in a block of up to 32 rows
    and some in one of 33-64."""
    last = torch.bincount(ids.reshape(-1).long(), minlength=8) % 128
    assert ((last > 0) & (last <= 32)).any() and ((last > 32) & (last <= 64)).any(), last


@needs_hopper
@pytest.mark.parametrize("quant,early,quarter,small,H,seed", [
    ("nvfp4", True, True, False, 512, 43), ("mxfp4", False, True, True, 512, 40),
    ("nvfp4", False, False, True, 512, 43), ("nvfp4", True, True, True, 320, 43)])
def test_quarter_blocks_match_whole_blocks(quant, early, quarter, small, H, seed):
    """MOE_OPS_WS_FP4_QUARTER_BLOCKS: a 128-slot block whose slots from 32 on are padding runs
    m64n32k16 wgmmas on its first 32 slots; MOE_OPS_WS_FP4_SMALL_X_BOXES: the activations come
    in 32-row boxes, those of the rows the block's path reads only (4 / 2 / 1 for whole / half /
    quarter blocks). Both GEMMs (GEMM1 with swiglu_oai and its bias) agree with the whole-block
    kernel to bf16 rounding and write the same rows (NaN-poisoned outputs, one row past the
    pairs) on a dispatch whose experts end in blocks of up to 32 rows and of 33-64 (random
    routing of 576 tokens: 144 rows an expert on average); H = 320 runs GEMM1 with the tail step
    (K = 320 in the layout's 512) and GEMM2 with a partial last tile (N = 320)."""
    T = 576
    ids, runs = gemms_both_ways(quant, T, 128, seed, [
        dict(early=early, half_blocks=False),
        dict(early=early, half_blocks=True, quarter_blocks=quarter, small_x_boxes=small)], H=H)
    assert_narrow_blocks(ids, T)
    assert_close_to_first(runs, T)


@needs_hopper
def test_quarter_blocks_do_take_the_quarter_path():
    """The quarter path runs where slot 32 of a block is padding: a dispatch edited so that such
    a block's slot 33 holds a pair (which moe_align never does) gets GEMM1's row 33 written by
    the half-block kernel and left unwritten by the quarter-block one."""
    assert_narrow_path_taken(576, 43, 32, dict(half_blocks=True, quarter_blocks=False),
                             dict(half_blocks=True, quarter_blocks=True))


def test_narrow_blocks_rule():
    """QUARTER_BLOCKS / SMALL_X_BOXES "auto": nvfp4 launches of fewer than 128 routed rows an
    expert (DeepSeek-V3's T = 2048: 64 an expert), never mxfp4 (measured slower); "1" / "0"
    whatever the launch."""
    rule = ws_fp4.narrow_blocks
    assert rule("auto", "nvfp4", 2048 * 8, 256) and not rule("auto", "nvfp4", 4096 * 8, 256)
    assert not rule("auto", "mxfp4", 2048 * 4, 128)
    assert rule("1", "mxfp4", 16384 * 4, 128) and not rule("0", "nvfp4", 2048 * 8, 256)


@needs_hopper
@pytest.mark.parametrize("quant,activation,bias,H,I,small", [
    ("nvfp4", "swiglu", False, 768, 256, False), ("mxfp4", "swiglu_oai", True, 1024, 512, True)])
def test_experts_with_quarter_blocks(quant, activation, bias, H, I, small, monkeypatch,
                                     gemm_calls, poisoned_empty):
    """The experts call on the 128-slot form with quarter blocks on (720 tokens routed to 2 of
    10 experts, 8 of them local: ~144 rows an expert, every local expert ending in a block of up
    to 32 rows), and with the 32-row activation boxes (SMALL_X_BOXES), against the oracle."""
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_WIDE_MIN_ROWS", 32)
    monkeypatch.setattr(ws_fp4, "HALF_BLOCKS", True)
    monkeypatch.setattr(ws_fp4, "QUARTER_BLOCKS", "1")
    monkeypatch.setattr(ws_fp4, "SMALL_X_BOXES", "1" if small else "0")
    if quant == "mxfp4":
        monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    calls = gemm_calls(ws_fp4, "gemm", record="slots")
    ckpt, kernel, x, ids, weights = make_case(quant, 720, H, I, 8, 2, activation=activation,
                                              bias=bias, seed=47, offset=1, num_global=10,
                                              invalid_ids=True)
    local = ids.reshape(-1).long().cpu() - 1
    last = torch.bincount(local[(local >= 0) & (local < 8)], minlength=8) % 128
    assert ((last > 0) & (last <= 32)).any(), last
    run_and_check(quant, ckpt, kernel, x, ids, weights, activation=activation, offset=1)
    assert calls == [128] * 2, calls


@needs_hopper
@pytest.mark.parametrize("quant,early", [("nvfp4", False), ("mxfp4", False), ("nvfp4", True)])
def test_half_blocks_match_whole_blocks(quant, early):
    """MOE_OPS_WS_FP4_HALF_BLOCKS: a 128-slot block whose second half is padding runs
    m64n64k16 wgmmas on its first 64 slots: both GEMMs (GEMM1 with swiglu_oai and its bias)
    agree with the whole-block kernel to bf16 rounding (the same k16 steps, a narrower MMA),
    write the same rows (NaN-poisoned outputs, one row past the pairs) on a dispatch whose
    experts end in half-empty and in fuller blocks (random routing of 700 tokens: 175 rows an
    expert on average)."""
    T = 700
    ids, runs = gemms_both_ways(quant, T, 128, 31, [dict(early=early, half_blocks=False),
                                                    dict(early=early, half_blocks=True)])
    counts = torch.bincount(ids.reshape(-1).long(), minlength=8)
    assert ((counts % 128 > 0) & (counts % 128 <= 64)).any() and (counts % 128 > 64).any()
    assert_close_to_first(runs, T)


def assert_narrow_path_taken(T, seed, width, wider, narrower):
    """A dispatch of T tokens (nvfp4, the 128-slot form) edited so that a live block whose slot
    `width` is padding holds a pair at slot width + 1 (which moe_align never does): GEMM1 with
    the `wider` keywords writes that row, with the `narrower` ones (whose path takes the block's
    first `width` slots) leaves it unwritten (NaN-poisoned)."""
    edited = []

    def put_a_pair_past_padding(sorted_pair_ids):
        blocks = sorted_pair_ids[:sorted_pair_ids.numel() // 128 * 128].view(-1, 128)
        # a live block (slot 0 a pair: the kernel runs it) whose slot `width` is padding
        narrow = (blocks[:, 0] < 2 * T) & (blocks[:, width] >= 2 * T)
        block = int(narrow.nonzero()[0, 0])
        sorted_pair_ids[block * 128 + width + 1] = 0
        edited.append(block * 128 + width + 1)

    _, runs = gemms_both_ways("nvfp4", T, 128, seed, [wider, narrower], gemms=(1, ),
                              edit_dispatch=put_a_pair_past_padding)
    (_, (wide, narrow)), = runs
    slot = edited[0]
    assert torch.isfinite(wide[slot].float()).all(), "the wider kernel skipped the slot"
    assert torch.isnan(narrow[slot].float()).all(), "the narrower path did not run"


@needs_hopper
def test_half_blocks_do_take_the_half_path():
    """The half path runs where slot 64 of a block is padding: a dispatch edited so that such a
    block's slot 65 holds a pair (which moe_align never does) gets GEMM1's row 65 written by the
    whole-block kernel and left unwritten by the half-block one."""
    assert_narrow_path_taken(700, 31, 64, dict(half_blocks=False),
                             dict(half_blocks=True, quarter_blocks=False))


@needs_hopper
@pytest.mark.parametrize("quant,tokens,activation,bias,slots", [
    ("nvfp4", 1, "swiglu", False, 16), ("mxfp4", 20, "swiglu_oai", True, 16),
    ("nvfp4", 150, "swiglu", True, 64), ("mxfp4", 500, "swiglu_oai", True, 128)])
def test_experts_with_rows_gathered_by_the_dispatch(quant, tokens, activation, bias, slots,
                                                    monkeypatch, gemm_calls, poisoned_empty):
    """experts.ALIGN_GATHER_MAX_PAIRS: GEMM1's token rows come from the dispatch's launch
    (moe_align_gather; its padding slots unwritten, NaN-poisoned here) instead of
    grouped_gemm.gather_rows, on each form of the kernel, against the oracle."""
    monkeypatch.setattr(experts_mod, "ALIGN_GATHER_MAX_PAIRS", 1024)
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    monkeypatch.setattr(experts_mod, "WS_FP4_MAX_ROWS", 8)
    monkeypatch.setattr(experts_mod, "WS_FP4_PREFILL_MIN_ROWS", 8)
    monkeypatch.setattr(experts_mod, "WS_FP4_WIDE_MIN_ROWS", 64)

    def no_gather(*args, **kwargs):
        raise AssertionError("grouped_gemm.gather_rows ran: the dispatch should have gathered")

    monkeypatch.setattr(experts_mod, "gather_rows", no_gather)
    calls = gemm_calls(ws_fp4, "gemm", record="slots")
    # (mxfp4's GEMM2 needs K = I a multiple of 512: its scale rows are whole 16 bytes)
    ckpt, kernel, x, ids, weights = make_case(quant, tokens, 512,
                                              512 if quant == "mxfp4" else 256, 8, 2,
                                              activation=activation, bias=bias, seed=41,
                                              invalid_ids=tokens > 1)
    run_and_check(quant, ckpt, kernel, x, ids, weights, activation=activation)
    assert calls == [slots] * 2, calls


@needs_hopper
@pytest.mark.parametrize("quant,H,I,tokens", [("mxfp4", 2880, 2880, 8), ("nvfp4", 1024, 704, 20)])
def test_three_consumers(quant, H, I, tokens, monkeypatch, ws_fp4_calls, poisoned_empty):
    """MOE_OPS_WS_FP4_CONSUMERS=3 (192-row tiles, three 64-row TMA boxes a ring slot): gpt-oss's
    own sizes (GEMM1's N = 5760 and GEMM2's 2880, whole tiles) and N of partial last tiles
    (GEMM1's 1408 = 7 x 192 + 64: one live box of three; GEMM2's 1024 = 5 x 192 + 64), both
    GEMMs against the oracle."""
    monkeypatch.setattr(experts_mod, "WS_FP4", "1")
    monkeypatch.setattr(experts_mod, "WS_FP4_QUANTS", ("nvfp4", "mxfp4"))
    monkeypatch.setattr(experts_mod, "WS_FP4_MAX_ROWS", 16)
    monkeypatch.setattr(ws_fp4, "CONSUMERS", 3)
    monkeypatch.setattr(ws_fp4, "PARTIAL_N_OK", True)
    ckpt, kernel, x, ids, weights = make_case(quant, tokens, H, I, 8, 2, activation="swiglu_oai",
                                              bias=True, seed=43, invalid_ids=True)
    run_and_check(quant, ckpt, kernel, x, ids, weights, activation="swiglu_oai")
    assert ws_fp4_calls == [1, 2]


# ---------------------------------------------------------------- GEMM2's split of K (SPLIT_K)

def test_combine_sums_split_parts():
    """combine_pair_rows(splits=S): each token's k x S rows (part p from row p * num_pairs), in
    fp32, rows of pairs routed to no local expert never read (NaN there stays out)."""
    from moe_ops.kernels.combine import combine_pair_rows
    from moe_ops.kernels.grouped_gemm import Routing
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    T, k, H, S, E = 5, 3, 96, 3, 6
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[1, 2] = E + 4     # no local expert: its rows stay NaN and are never read
    rows = torch.randn(S * T * k, H, generator=g).to(torch.bfloat16)
    for p in range(S):
        rows[p * T * k + 1 * k + 2] = float("nan")
    routing = Routing(ids.reshape(-1).to(device), torch.ones(T * k, device=device), k, E, 0)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    combine_pair_rows(rows.to(device), routing, out, splits=S)
    parts = rows.float().view(S, T, k, H)
    parts[:, 1, 2] = 0
    expected = parts.sum(dim=0).sum(dim=1)
    assert torch.allclose(out.float().cpu(), expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="pair_out"):
        combine_pair_rows(rows[:T * k].to(device), routing, out, splits=2)


def test_split_rule(monkeypatch):
    """ws_fp4.split_for: off ("0") the given consumers unsplit; a forced count where the K
    units allow it; "auto" the fewest weight rows x K units an SM runs through: gpt-oss-120b
    T = 1's GEMM2 (4 experts, N = 2880, Kp = 3072: 6 mxfp4 units) three consumers, two parts;
    DeepSeek-V3 T = 1's (8 experts, N = 7168, K = 2048: 8 nvfp4 units, 448 tiles of 128 rows)
    two parts; a GEMM of many tiles stays whole."""
    monkeypatch.setattr(ws_fp4, "SPLIT_K", "0")
    assert ws_fp4.split_for("mxfp4", 4, 2880, 3072, 128, 132, 2) == (2, 1)
    monkeypatch.setattr(ws_fp4, "SPLIT_K", "4")
    assert ws_fp4.split_for("mxfp4", 4, 2880, 3072, 128, 132, 2) == (2, 4)
    assert ws_fp4.split_for("mxfp4", 4, 2880, 512, 128, 132, 2) == (2, 1)   # one unit
    assert ws_fp4.split_for("nvfp4", 4, 2880, 768, 128, 132, 2) == (2, 3)   # three units
    assert ws_fp4.k_units("fp8", 14336) == 112 and ws_fp4.k_units("mxfp4", 3072) == 6
    monkeypatch.setattr(ws_fp4, "SPLIT_K", "auto")
    assert ws_fp4.split_for("mxfp4", 4, 2880, 3072, 128, 132, 2) == (3, 2)
    assert ws_fp4.split_for("nvfp4", 8, 7168, 2048, 256, 132, 2) == (2, 2)
    assert ws_fp4.split_for("nvfp4", 512, 7168, 2048, 256, 132, 4)[1] == 1
    assert ws_fp4.split_for("fp8", 2, 4096, 14336, 8, 132, 2) == (2, 2)


@pytest.mark.parametrize("quant,consumers,partial", [
    ("nvfp4", 2, False), ("mxfp4", 3, True), ("fp8", 2, False)])
def test_split_builds_for_sm90(quant, consumers, partial):
    """GEMM2 with its K split in three builds for sm_90 (the work items' division by 3 only
    there), no local memory."""
    args = (f"gemm=2, activation='none', has_bias=True, consumers={consumers}, "
            f"quant={quant!r}, partial_n={partial}")
    ptx = sm90_ptx("ws_fp4", args + ", split=3")
    whole = sm90_ptx("ws_fp4", args)
    assert "ld.local" not in ptx and "st.local" not in ptx
    # item // 3 and item % 3 (a multiply by the reciprocal), in the producer and each consumer
    assert ptx.count("mul.hi") > whole.count("mul.hi"), (ptx.count("mul.hi"),
                                                        whole.count("mul.hi"))


def test_bad_splits_are_refused():
    w = torch.zeros(2, 128, 256, dtype=torch.uint8)
    for kwargs, match in ((dict(gemm=2, split=5), "split: one of"),
                          (dict(gemm=1, activation="swiglu", split=2), "split: GEMM2's"),
                          (dict(gemm=2, slots=64, split=2), "split: GEMM2's"),
                          (dict(gemm=2, pipeline=True, split=2), "split: GEMM2's"),
                          (dict(gemm=2, early=False, split=2), "split: GEMM2's")):
        kwargs = {"activation": "none", **kwargs}
        with pytest.raises(ValueError, match=match):
            ws_fp4.gemm(None, w, None, None, None, None, None, consumers=2, **kwargs)
    # Kp = 512: two nvfp4 steps, so at most two parts
    with pytest.raises(ValueError, match="split: 4 parts, more than the 2 units"):
        ws_fp4.gemm(None, w, torch.zeros(2, 128, 32, dtype=torch.uint8), torch.ones(2, 128),
                    None, None, None, gemm=2, activation="none", consumers=2, split=4)


@needs_hopper
@pytest.mark.parametrize("quant,split,T,bias,activation", [
    ("nvfp4", "2", 3, True, "swiglu"), ("nvfp4", "3", 20, False, "swiglu"),
    ("mxfp4", "2", 1, True, "swiglu_oai"), ("mxfp4", "auto", 4, True, "swiglu_oai"),
    ("nvfp4", "4", 30, True, "relu2"), ("nvfp4", "auto", 1, False, "swiglu")])
def test_experts_with_split_gemm2(quant, split, T, bias, activation, monkeypatch, gemm_calls,
                                  poisoned_empty):
    """MOE_OPS_WS_FP4_SPLIT_K: GEMM2's K steps in parts summed by the combine, against the
    oracle: the bias added once, expert-parallel ids, ids of no local expert, mxfp4's K in
    whole pairs of steps (I = 1536: 6 steps, 3 units); T = 30 (7.5 rows an expert) still
    decode's form; "auto" splits these small grids (a few dozen tiles on the SMs)."""
    monkeypatch.setattr(ws_fp4, "SPLIT_K", split)
    calls = gemm_calls(ws_fp4, "gemm", record="split", default=1)
    H, I = 512, 1536
    ckpt, kernel, x, ids, weights = make_case(quant, T, H, I, 8, 2, activation=activation,
                                              bias=bias, seed=31 + T, offset=2, num_global=12,
                                              invalid_ids=T > 1)
    run_and_check(quant, ckpt, kernel, x, ids, weights, activation=activation, offset=2)
    assert len(calls) == 2 and calls[0] == 1 and calls[1] > 1, calls


def test_tail_slices():
    """TAIL's rule: the last K step's real columns in its first quarter / half -> 4 / 8 of its
    16 slices; a fuller last step, whole steps, or whole steps of padding (mxfp4's K padded to
    512) -> 16."""
    assert ws_fp4.tail_slices(2880, 3072) == 4      # gpt-oss-120b: 11 steps and 64 columns
    assert ws_fp4.tail_slices(320, 512) == 4
    assert ws_fp4.tail_slices(384, 512) == 8
    assert ws_fp4.tail_slices(896, 1024) == 8
    assert ws_fp4.tail_slices(448, 512) == 16
    assert ws_fp4.tail_slices(7168, 7168) == 16
    assert ws_fp4.tail_slices(640, 1024) == 16      # step 3 all padding: run as it is


def test_tail_rule(monkeypatch):
    """TAIL "auto": the tail step for launches of two consumers only (three or four copies of
    the peeled steps outgrow the instruction caches); "1" every plain launch, "0" none; never a
    split or pipelined launch. The slices reach the kernel as its TAIL."""
    from moe_ops.kernels import grouped_gemm as gg
    seen = []
    monkeypatch.setattr(ws_fp4, "_launcher",
                        lambda grid, kernel: lambda *a, **kw: seen.append(kw["TAIL"]))
    E, N, K = 2, 192, 320
    w = torch.zeros(E, N, 256, dtype=torch.uint8)
    scale = torch.zeros(E, N, 32, dtype=torch.uint8)
    routing = gg.Routing(torch.zeros(2, dtype=torch.int32), torch.ones(2), 1, E, 0,
                         torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                         16, torch.full((1, ), 16, dtype=torch.int32))
    a = torch.zeros(16, K, dtype=torch.bfloat16)
    out = torch.zeros(4, N, dtype=torch.bfloat16)     # (room for a split's two parts)
    for mode, kwargs, want in (("auto", dict(consumers=2), 4), ("auto", dict(consumers=3), 16),
                               ("1", dict(consumers=3), 4), ("0", dict(consumers=2), 16),
                               ("1", dict(consumers=2, pipeline=True), 16),
                               ("1", dict(consumers=2, split=2), 16)):
        monkeypatch.setattr(ws_fp4, "TAIL", mode)
        seen.clear()
        ws_fp4.gemm(a, w, scale, torch.ones(E, N), None, out, routing, gemm=2,
                    activation="none", programs=4, **kwargs)
        assert seen == [want], (mode, kwargs, seen)


@pytest.mark.parametrize("quant,tail", [("nvfp4", 8), ("mxfp4", 4)])
def test_tail_builds_for_sm90(quant, tail):
    """The tail step's build for sm_90: no local memory, and the loop's last step (mxfp4: last
    pair of steps) peeled off, its wgmmas (one a 16-column slice) `tail` instead of 16, in each
    of the two consumers."""
    args = f"gemm=2, activation='none', has_bias=True, consumers=2, quant={quant!r}"
    ptx = sm90_ptx("ws_fp4", args + f", tail={tail}")
    whole = sm90_ptx("ws_fp4", args)
    assert "ld.local" not in ptx and "st.local" not in ptx
    mmas, whole_mmas = ptx.count("wgmma.mma_async"), whole.count("wgmma.mma_async")
    peeled = tail + (16 if quant == "mxfp4" else 0)
    assert mmas == whole_mmas + 2 * peeled, (mmas, whole_mmas)


@needs_hopper
@pytest.mark.parametrize("quant,slots,H,I", [
    ("nvfp4", 16, 320, 384), ("nvfp4", 64, 320, 384), ("nvfp4", 128, 384, 320),
    ("mxfp4", 16, 320, 896), ("mxfp4", 128, 320, 896)])
def test_tail_step_is_bit_equal(quant, slots, H, I):
    """MOE_OPS_WS_FP4_TAIL: a last K step decoded and multiplied over its first quarter or
    half only (the rest is the layout's padding of K, zeros times the activations' zero fill)
    gives both GEMMs bit for bit what the whole step does, on each form (GEMM1 with swiglu_oai
    and its bias), every pair's row written and no padding row (NaN-poisoned outputs, one row
    past the pairs). The shapes take the tail: K = 320 (a quarter of the last step), 384 and
    896 (a half)."""
    from moe_ops import quant as q
    kp = {"nvfp4": lambda k: -(-k // 256) * 256, "mxfp4": lambda k: -(-k // 512) * 512}[quant]
    assert {ws_fp4.tail_slices(H, kp(H)), ws_fp4.tail_slices(I, kp(I))} <= {4, 8}, (H, I)
    T = 300 if slots > 16 else 24
    _, runs = gemms_both_ways(quant, T, slots, 17, [dict(tail=False), dict(tail=True)], H=H, I=I)
    assert_bit_equal(runs, T)


@needs_hopper
@pytest.mark.parametrize("T", [5, 300])
def test_experts_with_tail_on_gpt_oss_shape(T, monkeypatch, ws_fp4_calls, poisoned_empty):
    """The experts call with TAIL on, on gpt-oss-120b's H = I = 2880 (its layout's last K step
    holds 64 real columns) against the oracle: decode's form (T = 5) and a prefill form
    (T = 300 on 8 experts)."""
    monkeypatch.setattr(ws_fp4, "TAIL", "1")
    H = I = 2880
    ckpt, kernel, x, ids, weights = make_case("mxfp4", T, H, I, 8, 2, activation="swiglu_oai",
                                              bias=True, seed=41 + T)
    run_and_check("mxfp4", ckpt, kernel, x, ids, weights, activation="swiglu_oai")
    assert len(ws_fp4_calls) == 2, ws_fp4_calls
