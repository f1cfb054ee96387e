"""The warp-specialized fp8_block GEMM (moe_ops.kernels.ws_gemm, Gluon).

Gluon has no interpreter: on a CPU these tests build the kernel for sm_90 (ptxas from the
Triton wheel) and check the experts stage leaves it alone; on an H200 they run it inside the
experts call against the float64 oracle of test_kernels_experts, and against grouped_gemm's
persistent Triton kernel on the same dispatch, outputs poisoned with NaN first.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels import grouped_gemm as gg
from moe_ops.kernels import ws_gemm
from moe_ops.kernels.act_quant import act_quant
from moe_ops.kernels.align import moe_align
from moe_ops.kernels.grouped_gemm import GemmConfig

from test_kernels_experts import FP8_TOL, check_experts, make_problem

def sm90_ptx(module: str, arguments: str, **environment) -> str:
    """The PTX of moe_ops.kernels.<module>.compile_sm90(<arguments>), built in a fresh process
    (with `environment` set): under TRITON_INTERPRET, set for the whole CPU test run, the
    Triton helpers the Gluon kernels call are interpreter objects, which Gluon cannot compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(environment)
    code = (f"import json, sys; from moe_ops.kernels import {module}; "
            f"json.dump({module}.compile_sm90({arguments}).asm['ptx'], sys.stdout)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def sm90_script_rows(code: str):
    """Runs `code` (sm_90 builds and their SASS) in a fresh process without TRITON_INTERPRET,
    from the repository root; returns its output lines split into words, and the process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=900, cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split() for line in done.stdout.splitlines()], done


@pytest.fixture
def ws_gemm_calls(gemm_calls):
    """The `gemm` argument (1 or 2) of each ws_gemm.gemm call, in order."""
    return gemm_calls(ws_gemm, "gemm")


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[:2] == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel runs on sm_90 only")


@pytest.mark.parametrize("tile,gemm,activation,bias,store,quant,skip", [
    ("cols", 1, "swiglu", False, "coalesced", "fp8_block", "0"),
    ("cols", 2, "none", True, "coalesced", "fp8_block", "0"),
    ("rows", 1, "swiglu_oai", True, "coalesced", "fp8_block", "0"),
    ("rows", 1, "relu2", False, "coalesced", "fp8_block", "0"),
    ("rows", 2, "none", False, "mma", "fp8_block", "0"),
    ("rows", 1, "swiglu", True, "coalesced", "fp8", "0"),
    ("cols", 1, "geglu", False, "coalesced", "fp8", "0"),
    ("rows", 1, "swiglu", False, "coalesced", "fp8_block", "1"),
    ("rows", 2, "none", False, "coalesced", "fp8", "1"),
    ("rows", 2, "none", False, "coalesced", "fp8_block", "gemm2"),
    ("wide", 2, "none", True, "coalesced", "fp8_block", "gemm2")])
def test_builds_for_sm90(tile, gemm, activation, bias, store, quant, skip):
    """Every epilogue form compiles for sm_90 with the schedule it is written for: two consumer
    warpgroups on e4m3 m64n128k32 wgmmas, register budgets moved by setmaxnreg, mbarrier
    waits; the coalesced stores through shared memory, each consumer in its own region."""
    ptx = sm90_ptx("ws_gemm", f"tile={tile!r}, gemm={gemm}, activation={activation!r}, "
                              f"has_bias={bias}, quant={quant!r}",
                   MOE_OPS_WS_STORE=store, MOE_OPS_WS_SKIP_PADDING=skip)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{ws_gemm.CONSUMER_REGS}" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{ws_gemm.PRODUCER_REGS}" in ptx
    assert "mbarrier.try_wait.parity" in ptx and "cp.async.bulk.tensor" in ptx
    # the epilogue's shared-memory staging past the operand ring, a region per consumer
    # warpgroup (they store at the same time: 8 KB rounds, regions at least that far apart);
    # none in the MMA-layout form
    staged = [int(o) for o in re.findall(r"st\.shared\.v4\.b32 \t\[%r\d+\+(\d+)\]", ptx)]
    if store == "mma":
        assert staged == []
    else:
        bm, bn = ws_gemm.TILES[tile]
        assert min(staged) >= ws_gemm.ring_stages(tile) * (bm + bn) * 128, staged
        assert max(staged) - min(staged) >= 8192, staged


K_LOOP_OPCODES = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_gemm
kernel = ws_gemm.compile_sm90(tile="rows", gemm=1, activation="swiglu", quant="fp8_block")
body = min((b for b in loops(kernel) if any("QGMMA" in i for i in b)), key=len)
print(" ".join((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in body))
"""


@pytest.mark.parametrize("scale_loads", ["before", "after"])
def test_block_scale_loads_placement(scale_loads):
    """fp8_block's K loop in sm_90 SASS: with the scales loaded after the wgmmas' issue the
    step's four wgmmas issue back to back and the scale products follow them; loaded before
    (the default, the form measured on the GPU), ptxas puts some of the products between the
    first and second wgmma."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MOE_OPS_WS_SCALE_LOADS=scale_loads, MOE_OPS_WS_SKIP_PADDING="0")
    done = subprocess.run([sys.executable, "-c", K_LOOP_OPCODES], env=env, capture_output=True,
                          text=True, timeout=600,
                          cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert done.returncode == 0, done.stderr[-3000:]
    ops = done.stdout.split()
    wgmmas = [i for i, op in enumerate(ops) if op == "QGMMA"]
    products = [i for i, op in enumerate(ops) if op == "FMUL"]
    assert len(wgmmas) == 4 and products, ops
    if scale_loads == "after":
        assert min(products) > max(wgmmas), ops
    else:
        assert any(wgmmas[0] < i < wgmmas[1] for i in products), ops


def test_bad_settings_are_refused(monkeypatch):
    """A mistyped switch names itself instead of being read as a default; GEMM1 without an
    activation (it would run GEMM2's epilogue) is refused before anything launches."""
    monkeypatch.setenv("MOE_OPS_WS_STORE", "coalesce")
    with pytest.raises(ValueError, match="MOE_OPS_WS_STORE"):
        ws_gemm.env_choice("MOE_OPS_WS_STORE", "coalesced", ("coalesced", "mma"))
    monkeypatch.setenv("MOE_OPS_WS_GEMM", "off")
    with pytest.raises(ValueError, match="MOE_OPS_WS_GEMM"):
        ws_gemm.env_choice("MOE_OPS_WS_GEMM", "1", ("0", "1"))
    monkeypatch.setenv("MOE_OPS_WS_MIN_ROWS", "64 rows")
    with pytest.raises(ValueError, match="MOE_OPS_WS_MIN_ROWS"):
        ws_gemm.env_int("MOE_OPS_WS_MIN_ROWS", 0)
    monkeypatch.setenv("MOE_OPS_WS_MIN_ROWS", "64")
    assert ws_gemm.env_int("MOE_OPS_WS_MIN_ROWS", 0) == 64
    monkeypatch.delenv("MOE_OPS_WS_MIN_ROWS")
    assert ws_gemm.env_int("MOE_OPS_WS_MIN_ROWS", 0) == 0
    with pytest.raises(ValueError, match="gemm=1 needs an activation"):
        ws_gemm.gemm(None, None, None, None, None, None, None, gemm=1, activation="none")
    with pytest.raises(ValueError, match="quant"):
        ws_gemm.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                     quant="nvfp4")


def test_not_used_off_hopper(monkeypatch, poisoned_empty):
    """Without an sm_90 GPU (here: the interpreter) fp8_block's persistent configs run
    grouped_gemm's kernels: the kernel is never called, the results hold."""
    if HOPPER:
        pytest.skip("the kernel applies on this GPU")
    calls = []
    monkeypatch.setattr(ws_gemm, "gemm", lambda *a, **k: calls.append(1))
    tensors, kwargs = make_problem(40, 256, 128, 4, 2, quant="fp8_block", seed=3)
    assert not ws_gemm.applies("fp8_block", "swiglu", 256, 256, tensors[0], tensors[3], "cols",
                               activations_quantized=False)
    config = GemmConfig(64, 64, 32, 2, 4, 2, persistent=True)
    check_experts(tensors, kwargs, FP8_TOL, gemm1_config=config, gemm2_config=config)
    assert calls == []


def on_ws_gemm(monkeypatch, tile, **settings):
    """The experts call's fp8 and fp8_block GEMMs on this kernel in form `tile`, with the
    module settings of ws_gemm given (e.g. EARLY_EPILOGUE=True); GEMM1 on rows copied by
    align.gather_rows unless GATHER is given (the tests' problems are narrow enough for the
    gathering rule)."""
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", tile)
    monkeypatch.setattr(experts_mod, "WS_FP8", True)
    settings.setdefault("GATHER", "0")
    for name, value in settings.items():
        monkeypatch.setattr(ws_gemm, name, value)


def check_skewed_experts(quant, activation, bias, seed):
    """The experts call with persistent configs on a problem with several weight scale blocks
    along N and K (gated: N13 = 768, 3 column tiles of 256, 6 gate/up scale rows; H = 512,
    I = 384), expert-parallel ids, ids of no local expert, and tokens all but 50 on one expert
    (row blocks well past the SM count's share), against the oracle."""
    I = 384 if activation != "relu2" else 512
    tensors, kwargs = make_problem(300, 512, I, 4, 2, activation=activation,
                                   quant=quant, bias=bias, local_expert_offset=2,
                                   num_global_experts=8, invalid_ids=True, seed=seed)
    tensors[1][:250, 0] = 3
    config = GemmConfig(64, 128, 128, 8, 4, 3, persistent=True)
    check_experts(tensors, kwargs, FP8_TOL, gemm1_config=config, gemm2_config=config)


@needs_hopper
@pytest.mark.parametrize("tile", ["cols", "rows"])
@pytest.mark.parametrize("quant,activation,bias", [
    ("fp8_block", "swiglu", False), ("fp8_block", "geglu", True),
    ("fp8_block", "swiglu_oai", True), ("fp8_block", "relu2", False),
    ("fp8", "swiglu", True), ("fp8", "relu2", False)])
def test_experts_on_ws_gemm(tile, quant, activation, bias, monkeypatch, ws_gemm_calls,
                            poisoned_empty):
    """The experts call with persistent configs runs both GEMMs on the kernel (tile form
    `tile`; fp8 per tensor with WS_FP8 on): several weight scale blocks along N and K,
    expert-parallel ids, ids of no local expert, tokens all but one on one expert (many row
    blocks for one expert)."""
    on_ws_gemm(monkeypatch, tile)
    check_skewed_experts(quant, activation, bias, seed=41)
    assert ws_gemm_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("min_rows,expected", [(0, []), (64, [1, 2])])
def test_min_rows_widens_the_rule(min_rows, expected, monkeypatch, ws_gemm_calls,
                                  poisoned_empty):
    """Without explicit configs the default (not persistent) configs keep the Triton kernels;
    MOE_OPS_WS_MIN_ROWS puts both GEMMs on this kernel from that many routed rows an expert
    (here 150), the results the same."""
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", "auto")
    monkeypatch.setattr(experts_mod, "WS_MIN_ROWS", min_rows)
    tensors, kwargs = make_problem(300, 512, 384, 4, 2, quant="fp8", seed=45)
    check_experts(tensors, kwargs, FP8_TOL)
    assert ws_gemm_calls == expected


@needs_hopper
@pytest.mark.parametrize("tile", ["cols", "rows"])
@pytest.mark.parametrize("activation,bias,skip", [("swiglu", True, "gemm2"),
                                                  ("relu2", False, "1")])
def test_experts_with_scale_loads_after(tile, activation, bias, skip, monkeypatch,
                                        ws_gemm_calls, poisoned_empty):
    """The forms not yet default: fp8_block's scales loaded after the wgmmas' issue
    (MOE_OPS_WS_SCALE_LOADS=after), with the padding skip decided once a tile, on both GEMMs,
    against the oracle."""
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", tile)
    monkeypatch.setattr(ws_gemm, "SCALES_AFTER_MMA", True)
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", skip)
    check_skewed_experts("fp8_block", activation, bias, seed=49)
    assert ws_gemm_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("quant,activation,bias", [
    ("fp8_block", "swiglu", False), ("fp8_block", "swiglu", True), ("fp8_block", "relu2", False),
    ("fp8", "swiglu", False), ("fp8", "relu2", True), ("fp8", "swiglu_oai", True)])
def test_experts_on_wide_tiles(quant, activation, bias, monkeypatch, gemm_calls,
                               poisoned_empty):
    """MOE_OPS_WS_FP8_BLOCK_TILE=wide: the GEMMs the form admits (ws_gemm.WIDE_BUILDS) on
    128 x 256 tiles, each warpgroup both column halves of its 64 rows in turn (fp8_block's
    GEMM2 and DeepSeek's swiglu GEMM1, fp8 per tensor's GEMM1 and its GEMM2 with a bias); the
    others on the rule's form of the same kernel, one 128-aligned dispatch for both. Several
    weight scale blocks along N and K, expert-parallel ids, one expert with most rows."""
    on_ws_gemm(monkeypatch, "wide")
    tiles = gemm_calls(ws_gemm, "gemm", record="tile")
    check_skewed_experts(quant, activation, bias, seed=47)
    rule = experts_mod.ws_tile_rule(300 * 2, 4)
    assert tiles == ["wide" if ws_gemm.wide_admits(quant, activation, bias) else rule,
                     "wide" if ws_gemm.wide_admits(quant, "none", bias) else rule], tiles


@needs_hopper
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_experts_on_wide_fp8_gemm2(activation, monkeypatch, gemm_calls, poisoned_empty):
    """MOE_OPS_WS_WIDE_FP8_GEMM2 (with the native cast): fp8 per tensor's GEMM2 without a bias
    on the 128 x 256 tiles too, the experts call against the oracle."""
    on_ws_gemm(monkeypatch, "wide", WIDE_FP8_GEMM2=True, NATIVE_CAST=True)
    tiles = gemm_calls(ws_gemm, "gemm", record="tile")
    check_skewed_experts("fp8", activation, False, seed=53)
    assert tiles == ["wide", "wide"], tiles


WIDE_K_LOOP = """
import collections, sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_gemm
# (the admitted builds with the default cast; fp8's GEMM2 without a bias with and without
# the native cast, last)
builds = [b + (None, ) for b in ws_gemm.WIDE_BUILDS] + [("fp8", "none", False, True),
                                                        ("fp8", "none", False, False)]
for quant, activation, bias, native in builds:
    gemm = 2 if activation == "none" else 1
    kernel = ws_gemm.compile_sm90(tile="wide", gemm=gemm, activation=activation,
                                  has_bias=bias, quant=quant, native_cast=native)
    # each consumer's K loop (the two consumers are separate code): the two shortest loops
    # holding one step's 8 wgmmas (the tile loops around them hold them and more)
    k_loops = sorted((b for b in loops(kernel) if sum("QGMMA" in i for i in b) == 8),
                     key=len)[:2]
    local = [sum(i.split()[0].startswith(("LDL", "STL")) for i in b) for b in k_loops]
    print(quant, activation, bias, len(k_loops), max(local))
"""


def test_wide_builds_do_not_spill_in_their_k_loop():
    """The "wide" builds ws_gemm admits (WIDE_BUILDS) keep their three 64-register tiles in
    registers through both consumers' K loops (sm_90 SASS: at most one register exchanged
    through local memory around a wgmma issue, 4 accesses a step); so does fp8 per tensor's
    GEMM2 without a bias with the native cast (WIDE_NATIVE_BUILDS), which spills with
    round_to_dtype's (if that changes, the form may admit it)."""
    rows, done = sm90_script_rows(WIDE_K_LOOP)
    assert len(rows) == len(ws_gemm.WIDE_BUILDS) + 2, done.stdout
    assert all(row[3] == "2" for row in rows), done.stdout
    assert all(int(row[4]) <= 4 for row in rows[:-1]), done.stdout
    assert int(rows[-1][4]) > 16, done.stdout


FAST_SIGMOID_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops, sass
from moe_ops.kernels import ws_gemm
assert ws_gemm.FAST_SIGMOID    # on by default: the builds below name it either way
for tile, quant, activation, bias in (("wide", "fp8", "swiglu", False),
                                      ("wide", "fp8_block", "swiglu", False),
                                      ("rows", "fp8", "swiglu_oai", True),
                                      ("cols", "fp8_block", "geglu", False)):
    for fast in (False, True):
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=1, activation=activation, has_bias=bias,
                                      quant=quant, fast_sigmoid=fast)
        code = sass(kernel)
        mufu = {op: sum(("MUFU." + op) in i.split()[:2] for i in code)
                for op in ("EX2", "RCP", "TANH")}
        # each consumer's K loop: the two shortest loops holding wgmmas (the tile loops
        # around them hold them and more)
        k_loops = sorted((b for b in loops(kernel) if any("GMMA" in i for i in b)), key=len)[:2]
        local = max(sum(i.split()[0].startswith(("LDL", "STL")) for i in b) for b in k_loops)
        print(tile, quant, activation, int(fast), len(code), mufu["EX2"], mufu["RCP"],
              mufu["TANH"], local)
"""


def test_fast_sigmoid_takes_one_mufu_op_a_sigmoid():
    """FAST_SIGMOID (on by default): GEMM1's swiglu and swiglu_oai epilogues compute each
    sigmoid with one tanh.approx (sm_90 SASS: MUFU.TANH) instead of tl.sigmoid's exp2 and
    reciprocal, in fewer instructions, their K loops no more local memory accesses than
    tl.sigmoid's build; geglu (no sigmoid) builds the same either way."""
    rows, done = sm90_script_rows(FAST_SIGMOID_BUILDS)
    assert len(rows) == 8, done.stdout
    for exact, fast in zip(rows[0::2], rows[1::2]):
        tile, quant, activation = exact[:3]
        n, ex2, rcp, tanh, local = map(int, exact[4:])
        n_f, ex2_f, rcp_f, tanh_f, local_f = map(int, fast[4:])
        assert local_f <= local, done.stdout
        if activation == "geglu":
            assert (n_f, ex2_f, rcp_f, tanh_f) == (n, ex2, rcp, tanh), done.stdout
            continue
        sigmoids = ex2
        assert tanh == 0 and sigmoids >= 64 and rcp >= sigmoids, done.stdout
        assert tanh_f == sigmoids and ex2_f == 0 and rcp_f <= rcp - sigmoids, done.stdout
        assert n_f < 0.85 * n, done.stdout


def assert_near_exact_sigmoid(exact, fast):
    """A GEMM1 output with FAST_SIGMOID (`fast`) against tl.sigmoid's (`exact`), bf16, padding
    rows NaN in both: the same rows written, some, each value within the bf16 rounding plus the
    tanh's error (|sigmoid error| < 2.5e-4, times |gate * up|, bounded here by 1e-3 of the
    largest value), not all equal."""
    assert torch.equal(exact.isnan(), fast.isnan()), "written rows differ"
    assert not exact.isnan().all(), "no row written"
    exact, fast = exact.nan_to_num(0.0).float(), fast.nan_to_num(0.0).float()
    assert not torch.equal(exact, fast), "the switch changed nothing"
    bound = 2.0 ** -7 * exact.abs() + 1e-3 * exact.abs().max()
    assert ((fast - exact).abs() <= bound).all(), (fast - exact).abs().max().item()


@needs_hopper
@pytest.mark.parametrize("tile_rule", ["auto", "rows"])
def test_only_gemm1_on_ws_gemm(tile_rule, monkeypatch, ws_gemm_calls, poisoned_empty):
    """I = 192 (not whole 128-column K steps for GEMM2): GEMM1 runs on the kernel, GEMM2 on
    grouped_gemm's (the dispatch aligned to the kernel's rows serves both); the tile rule's own
    choice too."""
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", tile_rule)
    tensors, kwargs = make_problem(600, 512, 192, 4, 2, quant="fp8_block", seed=43)
    config = GemmConfig(64, 128, 128, 8, 4, 3, persistent=True)
    check_experts(tensors, kwargs, FP8_TOL, gemm1_config=config, gemm2_config=config)
    assert ws_gemm_calls == [1]


def random_dispatch(tile, E, T, k, seed, skew=False):
    """Random routing of T tokens to k of E experts (skew: the first 50 tokens kept off the last
    expert) on one dispatch aligned to the tile's rows (the torch seed set first). Returns the
    Routing."""
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    topk_ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)]).to(torch.int32)
    if skew:
        topk_ids[:50] = topk_ids[:50].clamp(max=E - 2)
    weights = torch.rand(T, k, device=dev)
    align = ws_gemm.block_m(tile)
    dispatch = moe_align(topk_ids, E, align, 0)
    return gg.Routing(topk_ids.reshape(-1), weights.reshape(-1), k, E, 0,
                      dispatch.sorted_pair_ids, dispatch.block_expert_ids, align,
                      dispatch.num_padded)


def fp8_weights(quant, E, N, K):
    """e4m3 weights [E, N, K] and their scales (fp8_block: per 128 x 128 block, fp8: per row)."""
    dev = torch.device("cuda")
    w = (torch.randn(E, N, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
    if quant == "fp8_block":
        w_scale = torch.rand(E, N // 128, K // 128, device=dev) * 0.01 + 1e-3
    else:
        w_scale = torch.rand(E, N, device=dev) * 0.01 + 1e-3
    return w, w_scale


def gemm2_problem(tile, quant, E, N, K, T, k, seed):
    """GEMM2 on one dispatch aligned to the tile's rows: random routing of T tokens to k of E
    experts, activation rows quantized as the package does, e4m3 weights [E, N, K] with their
    scales. Returns (a, a_scale, w, w_scale, routing)."""
    routing = random_dispatch(tile, E, T, k, seed)
    rows = torch.randn(routing.sorted_pair_ids.numel(), K, device="cuda", dtype=torch.bfloat16)
    a, a_scale = act_quant(rows, quant)
    return (a, a_scale) + fp8_weights(quant, E, N, K) + (routing, )


ATOMIC_BUILDS = """
import re, sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import resource_usage
from moe_ops.kernels import ws_gemm
for tile, quant, early, short_k in (("rows", "fp8", False, 0), ("cols", "fp8_block", False, 0),
                                    ("rows", "fp8_block", True, 0), ("wide", "fp8_block", False, 0),
                                    ("rows", "fp8", False, 1024)):
    ws_gemm.SHORT_K_MAX_K = short_k     # (1024: the 6-slot ring, K = 768)
    kernel = ws_gemm.compile_sm90(tile=tile, gemm=2, activation="none", out_dtype="fp32",
                                  quant=quant, early=early, atomic_top_k=8, k=768)
    ptx = kernel.asm["ptx"]
    atomics = set(re.findall(r"\\b(?:red|atom)\\.global[a-z0-9.]*", ptx))
    stores = len(re.findall(r"\\bst\\.global", ptx))
    print(tile, quant, ",".join(sorted(atomics)), stores, resource_usage(kernel).split()[-2],
          kernel.metadata.shared)
"""


def test_atomic_gemm2_builds():
    """GEMM2's atomic form (ws_gemm.ATOMIC): its sm_90 builds add the rows with 8-byte float32
    vector atomics from the MMA's layout and store nothing, within the shared memory (227 KB:
    no float32 tile staged beside the wide form's ring or the 6-slot ring), "rows" and "cols"
    without spilling ("wide" fp8_block's stack 32 B, 8 B without the atomics); the launcher
    refuses it for GEMM1 and for an output that is not float32 [num_pairs / top_k, N], before
    any launch."""
    rows, done = sm90_script_rows(ATOMIC_BUILDS)
    assert len(rows) == 5, done.stdout
    for tile, quant, atomics, stores, stack, shared in rows:
        assert atomics == "atom.global.gpu.relaxed.add.v2.f32", done.stdout
        assert stores == "0" and int(shared) <= 227 * 1024, done.stdout
        assert int(stack) <= (32 if tile == "wide" else 0), done.stdout
    routing = gg.Routing(torch.zeros(12, dtype=torch.int32), torch.ones(12), 4, 2, 0,
                         torch.zeros(128, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                         128, torch.full((1,), 128, dtype=torch.int32))
    for gemm, out in ((1, torch.zeros(3, 256)), (2, torch.zeros(4, 256)),
                      (2, torch.zeros(3, 256, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match="atomic=True"):
            ws_gemm.gemm(None, None, None, None, None, out, routing, gemm=gemm,
                         activation="swiglu" if gemm == 1 else "none", tile="rows",
                         quant="fp8", atomic=True)


@needs_hopper
@pytest.mark.parametrize("tile,quant,early", [
    ("rows", "fp8", False), ("cols", "fp8", True), ("rows", "fp8_block", True),
    ("wide", "fp8_block", False), ("wide", "fp8_block", True)])
def test_atomic_gemm2_sums_the_pair_rows(tile, quant, early):
    """GEMM2's atomic form (early: the slots' weights loaded before the K loop) adds each
    routed pair's weighted row into its token's float32 row: equal, up to the pair rows' bf16
    rounding and the sums' order, to the pair rows (written by the same kernel, NaN-poisoned
    first) summed per token; the rows of tokens no pair of the dispatch reaches (their ids
    given to no expert here: the dispatch is rebuilt without them) stay 0."""
    E, N, K, T, k = 8, 512, 1024, 300, 4
    dev = torch.device("cuda")
    a, a_scale, w, w_scale, routing = gemm2_problem(tile, quant, E, N, K, T, k, seed=13)
    # tokens 0-9 routed to no local expert (ids -1): out of the dispatch
    topk_ids = routing.topk_ids.view(T, k).clone()
    topk_ids[:10] = -1
    dispatch = moe_align(topk_ids, E, ws_gemm.block_m(tile), 0)
    routing = gg.Routing(topk_ids.reshape(-1), routing.topk_weights, k, E, 0,
                         dispatch.sorted_pair_ids, dispatch.block_expert_ids,
                         ws_gemm.block_m(tile), dispatch.num_padded)
    pair_rows = torch.full((T * k, N), float("nan"), device=dev, dtype=torch.bfloat16)
    ws_gemm.gemm(a, a_scale, w, w_scale, None, pair_rows, routing, gemm=2, activation="none",
                 tile=tile, quant=quant, early=early)
    routed = pair_rows[k * 10:].float()
    assert torch.isfinite(routed).all(), "a routed pair's row was not written"
    out = torch.full((T, N), 0.0, device=dev, dtype=torch.float32)
    ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=2, activation="none",
                 tile=tile, quant=quant, early=early, atomic=True)
    assert torch.equal(out[:10], torch.zeros_like(out[:10]))
    expected = routed.view(T - 10, k, N).sum(1)
    err = ((out[10:] - expected).norm() / expected.norm()).item()
    assert err < 4e-3, err


@needs_hopper
@pytest.mark.parametrize("tile", ["cols", "rows"])
@pytest.mark.parametrize("quant,activation,bias", [("fp8", "swiglu", True),
                                                   ("fp8_block", "swiglu", False)])
def test_experts_with_the_atomic_gemm2(tile, quant, activation, bias, monkeypatch,
                                       ws_gemm_calls, poisoned_empty):
    """MOE_OPS_WS_ATOMIC: the experts call with GEMM2's atomic form (expert-parallel ids, ids of
    no local expert, skewed routing) against the oracle, on each narrow form."""
    on_ws_gemm(monkeypatch, tile, ATOMIC=True)
    check_skewed_experts(quant, activation, bias, seed=61)
    assert ws_gemm_calls == [1, 2]


PAIRS_K_LOOP = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_gemm
ws_gemm.SKIP_PADDING = "0"
for tile in ("rows", "cols"):
    for gemm, activation in ((1, "swiglu"), (2, "none")):
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation, quant="fp8",
                                      pairs=True)
        blocks = loops(kernel)
        # each consumer's pair loop (two steps' 8 wgmmas) and its odd last step's loop (4)
        for n in (8, 4):
            k_loops = sorted((b for b in blocks if sum("QGMMA" in i for i in b) == n),
                             key=len)[:2]
            local = max(sum(i.split()[0].startswith(("LDL", "STL")) for i in b)
                        for b in k_loops)
            print(tile, gemm, n, len(k_loops), max(len(b) for b in k_loops), local)
"""


def test_paired_promotion_k_loops():
    """fp8 per tensor with two K steps a promotion (ws_gemm.FP8_PROMOTE_STEPS 2): each
    consumer's K loop of the "rows" and "cols" forms, GEMM1 and GEMM2, holds two steps' 8
    wgmmas in fewer instructions than two single steps (the singles: 105-120 a step) and no
    local memory; the odd last step keeps a loop of its own."""
    rows, done = sm90_script_rows(PAIRS_K_LOOP)
    assert len(rows) == 8, done.stdout
    for tile, gemm, wgmmas, count, longest, local in rows:
        assert local == "0", done.stdout
        if wgmmas == "8":
            assert count == "2" and int(longest) < 200, done.stdout


def test_pairs_only_for_fp8_on_narrow_tiles(monkeypatch):
    """Paired promotion is fp8 per tensor's, on by default (off with FP8_PROMOTE_STEPS 1), and
    never on the wide tiles (their three accumulator tiles spill with it); asking for it
    elsewhere is refused before any launch."""
    monkeypatch.setattr(ws_gemm, "FP8_PROMOTE_STEPS", 1)
    assert not ws_gemm.promote_pairs("fp8", "rows", 2)
    monkeypatch.setattr(ws_gemm, "FP8_PROMOTE_STEPS", 2)
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "0")
    assert ws_gemm.promote_pairs("fp8", "rows", 1) and ws_gemm.promote_pairs("fp8", "cols", 2)
    assert not ws_gemm.promote_pairs("fp8", "wide", 1)
    assert not ws_gemm.promote_pairs("fp8_block", "rows", 1)
    for quant, tile in (("fp8_block", "rows"), ("fp8", "wide")):
        with pytest.raises(ValueError, match="pairs=True"):
            ws_gemm.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                         tile=tile, quant=quant, pairs=True)
    # the staggered consumers' K loop holds the `go` arrive the pair loop has not
    monkeypatch.setattr(ws_gemm, "STAGGER", 2)
    assert not ws_gemm.promote_pairs("fp8", "rows", 2)
    with pytest.raises(ValueError, match="stagger 2"):
        ws_gemm.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                     tile="rows", quant="fp8", pairs=True)
    monkeypatch.setenv("MOE_OPS_WS_FP8_PROMOTE_STEPS", "4")
    with pytest.raises(ValueError, match="MOE_OPS_WS_FP8_PROMOTE_STEPS"):
        ws_gemm.env_choice("MOE_OPS_WS_FP8_PROMOTE_STEPS", "2", ("1", "2"))


@needs_hopper
@pytest.mark.parametrize("tile", ["cols", "rows"])
@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("relu2", False)])
def test_experts_with_paired_promotion(tile, activation, bias, monkeypatch, ws_gemm_calls,
                                       poisoned_empty):
    """The experts call of fp8 per tensor on the kernel with two K steps a promotion
    (MOE_OPS_WS_FP8_PROMOTE_STEPS=2): GEMM1 over 4 steps, GEMM2 over 3 (swiglu: I = 384, an odd
    last step) or 4 (relu2: I = 512), both against the oracle."""
    on_ws_gemm(monkeypatch, tile, FP8_PROMOTE_STEPS=2)
    check_skewed_experts("fp8", activation, bias, seed=53)
    assert ws_gemm_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("quant,activation,bias", [("fp8", "swiglu", True),
                                                   ("fp8_block", "swiglu", False),
                                                   ("fp8", "relu2", False)])
def test_experts_with_the_short_k_ring(quant, activation, bias, monkeypatch, ws_gemm_calls,
                                       poisoned_empty):
    """MOE_OPS_WS_SHORT_K_MAX_K: the "rows" form's launches of K <= 1024 (here both GEMMs:
    4 and 3 or 4 K steps, fewer than the ring's 6 slots) on the whole ring, the experts call
    against the oracle."""
    on_ws_gemm(monkeypatch, "rows", RING_STAGES=0, SHORT_K_MAX_K=1024)
    assert ws_gemm.ring_stages("rows", 512) == 6
    check_skewed_experts(quant, activation, bias, seed=59)
    assert ws_gemm_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("tile", ["cols", "rows", "wide"])
@pytest.mark.parametrize("programs,quant,K,pairs", [
    (3, "fp8_block", 1024, False), (132, "fp8_block", 1024, False), (5, "fp8", 1024, False),
    (5, "fp8", 1024, True), (132, "fp8", 384, True), (7, "fp8", 128, True)])
def test_gemm2_matches_the_triton_persistent_kernel(tile, programs, quant, K, pairs):
    """GEMM2 on one dispatch, by this kernel (few programs: many tiles each, the stage ring
    wrapping across tiles) and by grouped_gemm's persistent kernel: the same rows, every pair's
    row written (the output is NaN-poisoned first). "wide" runs the same k32 wgmmas, promotions
    and epilogue as "rows" on each 128 columns: their results are equal bit for bit. pairs: fp8
    per tensor with two K steps a promotion (K = 384: an odd last step; 128: one step, no
    pair), as the persistent kernel promotes: equal but for the order of a promotion's adds."""
    if tile == "wide" and quant == "fp8":
        pytest.skip("fp8 per tensor's GEMM2 without a bias spills in the wide form "
                    "(ws_gemm.WIDE_BUILDS), and pairs never run there")
    E, N, T, k = 8, 512, 700, 4
    dev = torch.device("cuda")
    a, a_scale, w, w_scale, routing = gemm2_problem(tile, quant, E, N, K, T, k, seed=5)
    outs = []
    for use_ws in (True, False):
        out = torch.full((T * k, N), float("nan"), device=dev, dtype=torch.bfloat16)
        if use_ws:
            ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=2, activation="none",
                         tile=tile, quant=quant, programs=programs, pairs=pairs)
        else:
            gg.gemm2(a, a_scale, w, w_scale, None, out, routing,
                     GemmConfig(64, 128, 128, 8, 4, 3, persistent=True), quant=quant,
                     atomic_out=False)
        outs.append(out.float())
    assert torch.isfinite(outs[0]).all(), "a pair's row was not written"
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    # fp8 per tensor: the two kernels promote the fp8 MMA's partial sums at different
    # intervals (128 and 256 columns) unless pairs, each losing a few bits the other keeps
    assert err < (2e-3 if quant == "fp8_block" else 1e-3 if pairs else 5e-3), err
    if tile == "wide":
        rows_out = torch.full((T * k, N), float("nan"), device=dev, dtype=torch.bfloat16)
        ws_gemm.gemm(a, a_scale, w, w_scale, None, rows_out, routing, gemm=2,
                     activation="none", tile="rows", quant=quant, programs=programs)
        assert torch.equal(rows_out.float(), outs[0])


@needs_hopper
@pytest.mark.parametrize("tile,stages,stagger", [("rows", 6, 3), ("rows", 6, 5), ("cols", 5, 3)])
@pytest.mark.parametrize("programs,K", [(3, 1024), (132, 256), (700, 1024)])
def test_staggered_consumers(tile, stages, stagger, programs, K, monkeypatch):
    """MOE_OPS_WS_STAGGER / MOE_OPS_WS_STAGES: consumer 1 starting s K steps behind consumer 0
    changes when each computes, not what: GEMM2's rows equal the unstaggered kernel's bit for
    bit, with few programs (many tiles each), tiles of fewer K steps than the stagger (K = 256:
    2 steps) and more programs than tiles (a consumer 1 with no tile never waits)."""
    E, N, T, k = 8, 512, 300, 4
    dev = torch.device("cuda")
    a, a_scale, w, w_scale, routing = gemm2_problem(tile, "fp8_block", E, N, K, T, k, seed=7)
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "0")
    outs = []
    for ring, steps in ((4, 0), (stages, stagger)):
        monkeypatch.setattr(ws_gemm, "RING_STAGES", ring)
        monkeypatch.setattr(ws_gemm, "STAGGER", steps)
        assert ws_gemm.stagger_steps(tile, 2) == steps
        out = torch.full((T * k, N), float("nan"), device=dev, dtype=torch.bfloat16)
        ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=2, activation="none",
                     tile=tile, quant="fp8_block", programs=programs)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.isfinite(outs[1].float()).all(), "a pair's row was not written"
    assert torch.equal(outs[0], outs[1])


@needs_hopper
@pytest.mark.parametrize("quant,activation,bias", [("fp8_block", "swiglu", False),
                                                   ("fp8", "geglu", True)])
def test_experts_with_staggered_consumers(quant, activation, bias, monkeypatch, ws_gemm_calls,
                                          poisoned_empty):
    """Both GEMMs (GEMM1's activation epilogue too) with consumer 1 three K steps behind, on
    the skewed experts problem, against the oracle."""
    on_ws_gemm(monkeypatch, "rows", RING_STAGES=6, STAGGER=3, SKIP_PADDING="0")
    assert ws_gemm.stagger_steps("rows", 1) == ws_gemm.stagger_steps("rows", 2) == 3
    check_skewed_experts(quant, activation, bias, seed=53)
    assert ws_gemm_calls == [1, 2]


@needs_hopper
@pytest.mark.parametrize("tile,quant,bias", [("rows", "fp8_block", False), ("cols", "fp8", False),
                                             ("wide", "fp8_block", True), ("wide", "fp8", True),
                                             ("rows", "fp8", True)])
@pytest.mark.parametrize("programs", [3, 132])
def test_early_epilogue_is_bit_equal(tile, quant, bias, programs):
    """MOE_OPS_WS_EARLY_EPILOGUE: the slots' pair ids, routing weights and row scales loaded
    before each tile's K loop feed the same float32 operations as the late epilogue: GEMM2's
    rows equal bit for bit (few programs: many tiles each; more than the tiles), each form,
    fp8 per tensor's row scales and the bias too, every pair's row written."""
    E, N, T, k, K = 8, 512, 300, 4, 1024
    dev = torch.device("cuda")
    a, a_scale, w, w_scale, routing = gemm2_problem(tile, quant, E, N, K, T, k, seed=11)
    b = torch.randn(E, N, device=dev) if bias else None
    outs = []
    for early in (False, True):
        out = torch.full((T * k, N), float("nan"), device=dev, dtype=torch.bfloat16)
        ws_gemm.gemm(a, a_scale, w, w_scale, b, out, routing, gemm=2, activation="none",
                     tile=tile, quant=quant, programs=programs, early=early)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.isfinite(outs[1].float()).all(), "a pair's row was not written"
    assert torch.equal(outs[0], outs[1])


@needs_hopper
@pytest.mark.parametrize("tile", ["rows", "cols"])
@pytest.mark.parametrize("quant,activation,bias", [("fp8_block", "swiglu", False),
                                                   ("fp8", "geglu", True)])
def test_experts_with_early_epilogue(tile, quant, activation, bias, monkeypatch, ws_gemm_calls,
                                     poisoned_empty):
    """Both GEMMs (GEMM1's activation epilogue too) with the early epilogue, on the skewed
    experts problem, against the oracle."""
    on_ws_gemm(monkeypatch, tile, EARLY_EPILOGUE=True)
    check_skewed_experts(quant, activation, bias, seed=59)
    assert ws_gemm_calls == [1, 2]


EARLY_K_LOOP = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_gemm
for tile, quant, activation, bias in (("rows", "fp8_block", "swiglu", False),
                                      ("cols", "fp8_block", "none", True),
                                      ("rows", "fp8", "swiglu_oai", True),
                                      ("wide", "fp8_block", "none", False),
                                      ("wide", "fp8", "swiglu", False)):
    gemm = 2 if activation == "none" else 1
    local = []
    for early in (False, True):
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation,
                                      has_bias=bias, quant=quant, early=early)
        per_step = 8 if tile == "wide" else 4
        k_loops = sorted((b for b in loops(kernel)
                          if sum("QGMMA" in i for i in b) == per_step), key=len)[:2]
        local.append(max(sum(i.split()[0].startswith(("LDL", "STL")) for i in b)
                         for b in k_loops))
    print(tile, quant, activation, *local)
"""


def test_early_epilogue_k_loops():
    """The early epilogue's operands held across the K loop (4 registers a thread) add no local
    access to either consumer's K loop, in each form, GEMM1 and GEMM2, fp8 and fp8_block."""
    rows, done = sm90_script_rows(EARLY_K_LOOP)
    assert len(rows) == 5, done.stdout
    for tile, quant, activation, late, early in rows:
        assert int(early) <= int(late), (tile, quant, activation, late, early)


STAGGER_K_LOOP = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_gemm
ws_gemm.SKIP_PADDING = "0"
for tile, gemm, activation, quant in (("rows", 1, "swiglu", "fp8_block"),
                                      ("cols", 2, "none", "fp8_block"),
                                      ("rows", 1, "swiglu", "fp8")):
    inits = []
    for stages, stagger in ((4, 0), (6, 3)):
        ws_gemm.RING_STAGES, ws_gemm.STAGGER = stages, stagger
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation, quant=quant)
        inits.append(kernel.asm["ptx"].count("mbarrier.init"))
    k_loops = sorted((b for b in loops(kernel) if sum("QGMMA" in i for i in b) == 4), key=len)[:2]
    local = max(sum(i.split()[0].startswith(("LDL", "STL")) for i in b) for b in k_loops)
    # the staggered build's barrier inits: the ring's two per slot and `go`
    print(tile, ws_gemm.ring_stages(tile), ws_gemm.stagger_steps(tile, gemm), len(k_loops), local,
          kernel.metadata.shared, inits[0], inits[1])
"""


def test_staggered_builds_fit():
    """The staggered consumers' builds (6 ring slots for "rows", 5 for "cols", 3 steps behind):
    no local memory in either consumer's K loop, shared memory within the 227 KB a block may
    take, one mbarrier more than the ring's (`go`: the stagger reached the kernel); "wide"
    never staggers (its loop spills with the check)."""
    assert ws_gemm.MAX_STAGES == {"rows": 6, "cols": 5, "wide": 4}
    rows, done = sm90_script_rows(STAGGER_K_LOOP)
    assert [row[:3] for row in rows] == [["rows", "6", "3"], ["cols", "5", "3"],
                                         ["rows", "6", "3"]], done.stdout
    assert all(row[3] == "2" and row[4] == "0" and int(row[5]) <= 227 * 1024
               for row in rows), done.stdout
    # the stagger reaches the kernel: its `go` barrier beside the ring's 2 x slots (4 -> 6 or 5)
    assert all(int(row[7]) == int(row[6]) + 2 * (int(row[1]) - 4) + 1 for row in rows), \
        done.stdout


def test_stagger_limits(monkeypatch):
    """The stagger stays below the ring's slots, off with the padding skip and for "wide"."""
    monkeypatch.setattr(ws_gemm, "RING_STAGES", 8)
    monkeypatch.setattr(ws_gemm, "STAGGER", 7)
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "0")
    assert [ws_gemm.ring_stages(t) for t in ("rows", "cols", "wide")] == [6, 5, 4]
    assert [ws_gemm.stagger_steps(t, 2) for t in ("rows", "cols", "wide")] == [5, 4, 0]
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "gemm2")
    assert ws_gemm.stagger_steps("rows", 2) == 0 and ws_gemm.stagger_steps("rows", 1) == 5
    monkeypatch.setattr(ws_gemm, "STAGGER", 0)
    assert ws_gemm.stagger_steps("rows", 1) == 0


def test_short_k_rows_take_the_whole_ring(monkeypatch):
    """Unset MOE_OPS_WS_STAGES: with SHORT_K_MAX_K (1024 by default; 0: never) the "rows" form
    of a GEMM of at most that many columns of K (Qwen3-30B-A3B's GEMM2, K = 768) takes its 6
    slots, everything else STAGES; its sm_90 builds fit the shared memory (227 KB) for both
    quant modes and GEMMs; a set MOE_OPS_WS_STAGES holds for every K."""
    monkeypatch.setattr(ws_gemm, "RING_STAGES", 0)
    assert ws_gemm.SHORT_K_MAX_K == int(os.environ.get("MOE_OPS_WS_SHORT_K_MAX_K", "1024"))
    monkeypatch.setattr(ws_gemm, "SHORT_K_MAX_K", 0)
    assert ws_gemm.ring_stages("rows", 768) == ws_gemm.STAGES
    monkeypatch.setattr(ws_gemm, "SHORT_K_MAX_K", 1024)
    assert ws_gemm.ring_stages("rows", 768) == ws_gemm.ring_stages("rows", 1024) == 6
    assert ws_gemm.ring_stages("rows", 1152) == ws_gemm.ring_stages("rows") == ws_gemm.STAGES
    assert ws_gemm.ring_stages("cols", 768) == ws_gemm.ring_stages("wide", 768) == ws_gemm.STAGES
    rows, done = sm90_script_rows(
        "from moe_ops.kernels import ws_gemm\n"
        "ws_gemm.SHORT_K_MAX_K = 1024\n"
        "for quant, gemm, act, bias in (('fp8', 2, 'none', False), ('fp8_block', 1, 'swiglu', True)):\n"
        "    print(ws_gemm.compile_sm90(tile='rows', gemm=gemm, activation=act, has_bias=bias,"
        " quant=quant, k=768).metadata.shared)\n")
    assert len(rows) == 2, done.stdout
    for (shared, ) in rows:
        assert 6 * 2 * 128 * 128 <= int(shared) <= 227 * 1024, done.stdout
    monkeypatch.setattr(ws_gemm, "RING_STAGES", 4)
    assert ws_gemm.ring_stages("rows", 768) == 4


def test_tile_rule(monkeypatch):
    """fp8_block calls with a dispatch take the 128-row tiles from 256 routed rows an expert on
    (128 x 256 for the GEMMs ws_gemm.WIDE_BUILDS admits) and the 256-column ones below; fp8
    per tensor likewise unless WS_FP8 is off (on by default); other modes, direct dispatch or
    the override "none" never take the kernel."""
    assert experts_mod.WS_FP8 is (os.environ.get("MOE_OPS_WS_FP8", "1") == "1")
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", "auto")
    monkeypatch.setattr(experts_mod, "WS_FP8", False)
    monkeypatch.setattr(ws_gemm, "WIDE", "gemm2")
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False, "swiglu") == "rows"
    assert experts_mod.ws_tile("fp8_block", 4096 * 8, 256, False) == "cols"
    # GEMM2 (activation "none") of fp8_block from 256 rows an expert: the 128 x 256 tiles
    assert experts_mod.WS_WIDE_MIN_ROWS == int(os.environ.get("MOE_OPS_WS_WIDE_MIN_ROWS", 256))
    monkeypatch.setattr(experts_mod, "WS_WIDE_MIN_ROWS", 256)
    assert experts_mod.ws_tile("fp8_block", 8192 * 8, 256, False) == "wide"
    assert experts_mod.ws_tile("fp8_block", 8191 * 8, 256, False) == "cols"
    # N no whole number of 256-column tiles: the rule's form
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False, n=7168) == "wide"
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False, n=7296) == "rows"
    # MOE_OPS_WS_WIDE=all: every build the form admits, GEMM1 and fp8 per tensor too
    monkeypatch.setattr(ws_gemm, "WIDE", "all")
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False, "swiglu") == "wide"
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False, "geglu") == "rows"
    monkeypatch.setattr(experts_mod, "WS_FP8", True)
    assert experts_mod.ws_tile("fp8", 16384 * 8, 256, False, "swiglu") == "wide"
    assert experts_mod.ws_tile("fp8", 16384 * 8, 256, False) == "rows"    # GEMM2 spills
    assert experts_mod.ws_tile("fp8", 16384 * 8, 256, False, "none", True) == "wide"
    monkeypatch.setattr(ws_gemm, "WIDE", "gemm2")
    monkeypatch.setattr(experts_mod, "WS_FP8", False)
    assert experts_mod.ws_tile("fp8_block", 4096 * 8, 256, True) is None
    assert experts_mod.ws_tile("fp8", 16384 * 8, 256, False) is None
    monkeypatch.setattr(experts_mod, "WS_FP8", True)
    assert experts_mod.ws_tile("fp8", 16384 * 8, 256, False) == "rows"    # no wide GEMM2
    assert experts_mod.ws_tile("none", 16384 * 8, 256, False) is None
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", "cols")
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False) == "cols"
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", "wide")
    assert experts_mod.ws_tile("fp8_block", 4096 * 8, 256, False) == "wide"
    # a GEMM the form does not admit (ws_gemm.WIDE_BUILDS) takes the rule's
    assert experts_mod.ws_tile("fp8_block", 4096 * 8, 256, False, "swiglu", True) == "cols"
    monkeypatch.setattr(experts_mod, "WS_FP8_BLOCK_TILE", "none")
    assert experts_mod.ws_tile("fp8_block", 16384 * 8, 256, False) is None


def counted_problem(quant, n, block_m, seed, counts=(130, 40, 200, 64, 1, 0, 128, 300), k=512):
    """One GEMM's operands on the GPU for top-1 routing with these pairs an expert (the last
    row blocks of some experts ending within their first 64 rows, one expert empty), shuffled:
    the routing and dispatch (aligned to block_m), the dispatched rows quantized for `quant`,
    random e4m3 weights [E, n, k] and their scales."""
    torch.manual_seed(seed)
    E, dev = len(counts), torch.device("cuda")
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    topk_ids = ids[torch.randperm(ids.numel())].to(torch.int32).to(dev)[:, None]
    T = topk_ids.shape[0]
    dispatch = moe_align(topk_ids, E, block_m, 0)
    routing = gg.Routing(topk_ids.reshape(-1), torch.rand(T, device=dev), 1, E, 0,
                         dispatch.sorted_pair_ids, dispatch.block_expert_ids, block_m,
                         dispatch.num_padded)
    rows = torch.randn(dispatch.sorted_pair_ids.numel(), k, device=dev, dtype=torch.bfloat16)
    a, a_scale = act_quant(rows, quant)
    w = (torch.randn(E, n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
    w_scale = (torch.rand(E, n // 128, k // 128, device=dev) if quant == "fp8_block"
               else torch.rand(E, n, device=dev)) * 0.01 + 1e-3
    return routing, dispatch, a, a_scale, w, w_scale


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8_block"), ("rows", "fp8"),
                                        ("wide", "fp8_block")])
def test_padding_halves_skip_their_mmas(tile, quant, monkeypatch):
    """Experts whose last 128-row block ends within its first 64 rows (130, 40, 64, 1 pairs)
    leave the second warpgroup only padding: it skips its MMAs (on "wide" both of its column
    halves), and the output is bit for bit the one computed with the skip off, every pair's row
    written."""
    N = 256
    routing, dispatch, a, a_scale, w, w_scale = counted_problem(quant, N, 128, seed=9)
    T, dev = routing.num_pairs, a.device
    outs = []
    for skip in (True, False):
        monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "1" if skip else "0")
        out = torch.full((T, N), float("nan"), device=dev, dtype=torch.bfloat16)
        ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=2, activation="none",
                     tile=tile, quant=quant, programs=7)
        outs.append(out)
    assert torch.isfinite(outs[0]).all(), "a pair's row was not written"
    assert torch.equal(outs[0], outs[1])


@needs_hopper
@pytest.mark.parametrize("tile,quant,activation,bias", [
    ("wide", "fp8", "swiglu", False), ("wide", "fp8_block", "swiglu", False),
    ("rows", "fp8", "swiglu_oai", True), ("cols", "fp8_block", "swiglu", False)])
@pytest.mark.parametrize("fast", [True, False])
def test_sigmoid_either_way_experts_match_the_oracle(tile, quant, activation, bias, fast,
                                                    monkeypatch, gemm_calls):
    """The experts call with GEMM1's sigmoid on tanh.approx (FAST_SIGMOID, the default) and as
    tl.sigmoid, against the oracle within the fp8 tolerance (skewed experts, expert-parallel
    ids)."""
    on_ws_gemm(monkeypatch, tile, FAST_SIGMOID=fast)
    tiles = gemm_calls(ws_gemm, "gemm", record="tile")
    check_skewed_experts(quant, activation, bias, seed=61)
    assert len(tiles) == 2 and tiles[0] == tile, tiles


@needs_hopper
@pytest.mark.parametrize("tile,quant,activation", [
    ("wide", "fp8", "swiglu"), ("rows", "fp8_block", "swiglu"), ("cols", "fp8", "swiglu_oai")])
def test_fast_sigmoid_stays_near_the_exact_one(tile, quant, activation):
    """GEMM1 with FAST_SIGMOID against the same launch with tl.sigmoid (NaN-poisoned outputs):
    every live slot written, padding slots not, close (assert_near_exact_sigmoid)."""
    I = 256
    routing, dispatch, a, a_scale, w, w_scale = counted_problem(quant, 2 * I,
                                                                ws_gemm.TILES[tile][0], seed=11)
    T, dev = routing.num_pairs, a.device
    E = w.shape[0]
    bias = torch.randn(E, 2 * I, device=dev) if activation == "swiglu_oai" else None
    outs = []
    for fast in (False, True):
        out = torch.full((a.shape[0], I), float("nan"), device=dev, dtype=torch.bfloat16)
        ws_gemm.gemm(a, a_scale, w, w_scale, bias, out, routing, gemm=1, activation=activation,
                     alpha=1.702, limit=7.0, tile=tile, quant=quant, programs=7,
                     fast_sigmoid=fast)
        outs.append(out)
    live = dispatch.sorted_pair_ids < T
    assert torch.isfinite(outs[0][live]).all(), "a live row not written"
    assert torch.isnan(outs[0][~live]).all(), "a padding row written"
    assert_near_exact_sigmoid(*outs)


GATHER_BUILDS = """
import re, sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops, resource_usage
from moe_ops.kernels import ws_gemm
for tile, quant in (("rows", "fp8"), ("cols", "fp8"), ("rows", "fp8_block"),
                    ("cols", "fp8_block"), ("wide", "fp8"), ("wide", "fp8_block")):
    kernel = ws_gemm.compile_sm90(tile=tile, gemm=1, activation="swiglu", quant=quant,
                                  gather_top_k=8)
    ptx = kernel.asm["ptx"]
    copies = len(re.findall(r"cp\\.async\\.cg\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], 0x10", ptx))
    activation_tma = len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx))
    # the producer's K loop: the loop of 16-byte copies and no wgmma
    producer = [b for b in loops(kernel)
                if any("LDGSTS" in i for i in b) and not any("QGMMA" in i for i in b)]
    local = min((sum(i.split()[0].startswith(("LDL", "STL")) for i in b) for b in producer),
                default=-1)
    print(tile, quant, copies, activation_tma, "fence.proxy.async.shared::cta" in ptx,
          len(producer) > 0, local, kernel.metadata.shared)
"""


def test_gathering_gemm1_builds():
    """GEMM1 gathering its token rows (ws_gemm.GATHER): every form and fp8 mode builds for
    sm_90 with a warpgroup producer whose K step copies the tile's rows by 16-byte cp.async
    (8 a thread for 128 rows, 4 for "cols"' 64), the weights still by TMA (one tensor copy in
    the code), the rows fenced for the wgmmas' async proxy, no local memory in its loop, within
    the shared memory; the launcher refuses it for GEMM2 and for another top_k, before any
    launch."""
    rows, done = sm90_script_rows(GATHER_BUILDS)
    assert len(rows) == 6, done.stdout
    for tile, quant, copies, tma_copies, fenced, found, local, shared in rows:
        assert copies == ("4" if tile == "cols" else "8"), done.stdout
        assert tma_copies == "1" and fenced == "True" and found == "True", done.stdout
        assert local == "0" and int(shared) <= 227 * 1024, done.stdout
    routing = gg.Routing(torch.zeros(12, dtype=torch.int32), torch.ones(12), 4, 2, 0,
                         torch.zeros(128, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                         128, torch.full((1,), 128, dtype=torch.int32))
    for gemm, top_k in ((2, 4), (1, 2)):
        with pytest.raises(ValueError, match="gather_top_k"):
            ws_gemm.gemm(None, None, None, None, None, None, routing, gemm=gemm,
                         activation="swiglu" if gemm == 1 else "none", tile="rows",
                         quant="fp8", gather_top_k=top_k)
    # the lag: below the ring's slots, one less with pairs, at most slots - stagger; none fits
    # a 2-slot ring with pairs, and the launcher says so before any launch
    lag = ws_gemm.GATHER_LAG
    assert ws_gemm.gather_lag(4, True, 0) == min(lag, 2)
    assert ws_gemm.gather_lag(4, False, 0) == min(lag, 3)
    assert ws_gemm.gather_lag(6, True, 5) == 1 and ws_gemm.gather_lag(3, True, 0) == 1
    assert ws_gemm.gather_lag(2, True, 0) == 0


def test_gathering_rule(monkeypatch):
    """"auto" (the default) gathers for GEMM1s of at most GATHER_MAX_N weight rows (Qwen3's
    1536; not DeepSeek-V3's 4096 nor Mixtral's 28672), "1" for any, "0" for none; never where
    no lag fits the ring (2 slots with pairs)."""
    assert ws_gemm.GATHER == os.environ.get("MOE_OPS_WS_GATHER", "auto")
    monkeypatch.setattr(ws_gemm, "GATHER", "auto")
    monkeypatch.setattr(ws_gemm, "GATHER_MAX_N", 2048)
    monkeypatch.setattr(ws_gemm, "RING_STAGES", 0)
    monkeypatch.setattr(ws_gemm, "STAGGER", 0)
    assert ws_gemm.gathers("fp8", "wide", 2048, 1536)
    assert not ws_gemm.gathers("fp8_block", "wide", 7168, 4096)
    assert not ws_gemm.gathers("fp8", "wide", 4096, 28672)
    monkeypatch.setattr(ws_gemm, "GATHER", "1")
    assert ws_gemm.gathers("fp8", "wide", 4096, 28672)
    monkeypatch.setattr(ws_gemm, "RING_STAGES", 2)
    assert not ws_gemm.gathers("fp8", "rows", 4096, 1536)
    monkeypatch.setattr(ws_gemm, "GATHER", "0")
    monkeypatch.setattr(ws_gemm, "RING_STAGES", 0)
    assert not ws_gemm.gathers("fp8", "rows", 2048, 1536)


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8"), ("wide", "fp8"),
                                        ("rows", "fp8_block"), ("cols", "fp8_block"),
                                        ("wide", "fp8_block")])
@pytest.mark.parametrize("programs,lag,stages,K,skip", [
    (7, 2, 0, 1024, "0"), (132, 2, 0, 1024, "0"), (132, 1, 0, 1024, "0"), (7, 2, 0, 128, "0"),
    (7, 3, 0, 256, "1"), (7, 4, 6, 384, "0"), (7, 2, 3, 1024, "0")])
def test_gathering_gemm1_is_bit_equal(tile, quant, programs, lag, stages, K, skip, monkeypatch):
    """GEMM1 gathering the quantized token rows itself (GATHER; few programs: the ring wraps
    across many tiles) against GEMM1 on the rows align.gather_rows copied into dispatch order:
    the same operands, products and order, so every live slot's row is equal bit for bit;
    padding slots are written by neither (NaN-poisoned, left so), and T = 700 tokens with
    k = 4 of E = 8 leave part-padded 128-row blocks. Tiles of fewer K steps than the lag (the
    late arrivals cross into the next tile), 3- and 6-slot rings (stages; 0: the default) and
    the padding halves' skip are among the cases."""
    from moe_ops.kernels.align import gather_rows
    monkeypatch.setattr(ws_gemm, "GATHER_LAG", lag)
    monkeypatch.setattr(ws_gemm, "RING_STAGES", stages)
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", skip)
    a, a_scale, w, w_scale, routing = gathering_problem(tile, quant, K, seed=17)
    N, T, k = w.shape[1], 700, 4
    dev = torch.device("cuda")
    slots = routing.sorted_pair_ids.numel()
    outs = []
    for gather in (True, False):
        out = torch.full((slots, N // 2), float("nan"), device=dev, dtype=torch.bfloat16)
        if gather:
            ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=1,
                         activation="swiglu", tile=tile, quant=quant, programs=programs,
                         gather_top_k=k)
        else:
            rows, row_scales = gather_rows(a, a_scale, routing)
            ws_gemm.gemm(rows, row_scales, w, w_scale, None, out, routing, gemm=1,
                         activation="swiglu", tile=tile, quant=quant, programs=programs)
        outs.append(out)
    assert_same_slot_rows(outs[0], outs[1], routing, T * k)


def gathering_problem(tile, quant, K, seed):
    """GEMM1 on token rows: T = 700 tokens routed to k = 4 of E = 8 experts (skewed) on one
    dispatch aligned to the tile's rows, the rows [T, K] quantized as the package does, e4m3
    weights [E, N = 512, K]. Returns (a, a_scale, w, w_scale, routing)."""
    routing = random_dispatch(tile, 8, 700, 4, seed=seed, skew=True)
    a, a_scale = act_quant(torch.randn(700, K, device="cuda", dtype=torch.bfloat16), quant)
    return (a, a_scale) + fp8_weights(quant, 8, 512, K) + (routing, )


def assert_same_slot_rows(checked, other, routing, num_pairs):
    """Two GEMM1 outputs [slots, N / 2] (NaN-poisoned): `checked` wrote every routed slot's row
    and no padding slot's, and the routed rows equal `other`'s bit for bit (the padding rows,
    NaN in both, compared nowhere)."""
    live = routing.sorted_pair_ids < num_pairs
    assert torch.isfinite(checked[live].float()).all(), "a routed slot's row was not written"
    assert torch.isnan(checked[~live].float()).all(), "a padding slot's row was written"
    assert torch.equal(checked[live], other[live])


@needs_hopper
@pytest.mark.parametrize("tile", ["cols", "rows"])
@pytest.mark.parametrize("quant,activation,bias", [("fp8", "swiglu", True),
                                                   ("fp8_block", "swiglu", False),
                                                   ("fp8", "relu2", False)])
def test_experts_with_the_gathering_gemm1(tile, quant, activation, bias, monkeypatch,
                                          gemm_calls, poisoned_empty):
    """MOE_OPS_WS_GATHER: the experts call with GEMM1 gathering its rows (expert-parallel ids,
    ids of no local expert, skewed routing) against the oracle."""
    on_ws_gemm(monkeypatch, tile, GATHER="1")
    gathered = gemm_calls(ws_gemm, "gemm", record="gather_top_k", default=0)
    check_skewed_experts(quant, activation, bias, seed=67)
    assert gathered == [2, 0]       # (GEMM1 gathers for top_k 2; GEMM2 reads its own rows)


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8"), ("rows", "fp8_block"),
                                        ("cols", "fp8_block")])
@pytest.mark.parametrize("gemm,early", [(2, False), (2, True), (1, False)])
@pytest.mark.parametrize("programs,K", [(3, 1024), (132, 1024), (5, 128), (5, 384), (7, 768)])
def test_overlap_is_bit_equal(tile, quant, gemm, early, programs, K):
    """OVERLAP (each tile's first steps issued before the previous tile's epilogue) computes
    the same float32 operations in the same order: GEMM2's pair rows and GEMM1's activation rows
    equal bit for bit with and without it; every routed row written, no padding slot's row
    (GEMM1) written. Few programs walk many tiles (the carried epilogue of each tile and the
    last one after the loop), 132 more programs than tiles; K of 1 step (no second of a pair),
    3 steps (an odd last one) and 6 (Qwen3-30B-A3B's GEMM2)."""
    problem = gemm2_problem(tile, quant, 8, 512, K, 300, 4, seed=23)
    assert_arms_equal(problem, tile, quant, gemm, [dict(overlap=False), dict(overlap=True)],
                      programs=programs, early=early)


def assert_arms_equal(problem, tile, quant, gemm, arms, out_dtype=torch.bfloat16, **common):
    """Runs GEMM `gemm` (2: pair rows times the routing weights; 1: swiglu rows) of `problem`
    (gemm2_problem's, N = 512, T = 300, k = 4) once per arm (ws_gemm.gemm's keyword arguments,
    with `common`), outputs NaN-poisoned, and checks the arms write the same bits: GEMM2 every
    pair's row, GEMM1 every routed slot's row (its padding slots left unwritten)."""
    a, a_scale, w, w_scale, routing = problem
    N, T, k = w.shape[1], 300, 4
    dev = torch.device("cuda")
    slots = routing.sorted_pair_ids.numel()
    outs = []
    for arm in arms:
        rows, cols = (T * k, N) if gemm == 2 else (slots, N // 2)
        out = torch.full((rows, cols), float("nan"), device=dev, dtype=out_dtype)
        ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=gemm,
                     activation="none" if gemm == 2 else "swiglu", tile=tile, quant=quant,
                     **common, **arm)
        torch.cuda.synchronize()
        outs.append(out)
    if gemm == 2:
        assert torch.isfinite(outs[1].float()).all(), "a pair's row was not written"
        assert torch.equal(outs[0], outs[1])
    else:
        assert_same_slot_rows(outs[1], outs[0], routing, T * k)


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8"), ("rows", "fp8_block"),
                                        ("cols", "fp8_block")])
@pytest.mark.parametrize("programs,K", [(7, 1024), (7, 256), (132, 768)])
def test_overlap_with_the_gathering_gemm1(tile, quant, programs, K):
    """OVERLAP with GEMM1 gathering its rows (GATHER): a consumer holds the issued-ahead slots
    through the previous tile's epilogue while the gathered rows' arrivals lag behind their
    loads; the same rows bit for bit as the serial tiles gathering, padding slots unwritten."""
    assert_gathering_arms_equal(tile, quant, K, 29, programs, [dict(overlap=False),
                                                               dict(overlap=True)])


def assert_gathering_arms_equal(tile, quant, K, seed, programs, arms):
    """GEMM1 gathering its rows (gathering_problem's, T = 700, k = 4) once per arm (ws_gemm.gemm's
    keyword arguments), outputs NaN-poisoned: the second arm writes every routed slot's row and
    no padding slot's, the same bits as the first."""
    a, a_scale, w, w_scale, routing = gathering_problem(tile, quant, K, seed=seed)
    N, T, k = w.shape[1], 700, 4
    slots = routing.sorted_pair_ids.numel()
    outs = []
    for arm in arms:
        out = torch.full((slots, N // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws_gemm.gemm(a, a_scale, w, w_scale, None, out, routing, gemm=1, activation="swiglu",
                     tile=tile, quant=quant, programs=programs, gather_top_k=k, **arm)
        outs.append(out)
    assert_same_slot_rows(outs[1], outs[0], routing, T * k)


@needs_hopper
@pytest.mark.parametrize("tile", ["rows", "cols"])
@pytest.mark.parametrize("quant,activation,bias", [("fp8", "swiglu", True),
                                                   ("fp8_block", "swiglu", False),
                                                   ("fp8", "relu2", False)])
def test_experts_with_overlap(tile, quant, activation, bias, monkeypatch, ws_gemm_calls,
                              poisoned_empty):
    """Both GEMMs of the experts call with OVERLAP on every launch, on the skewed experts
    problem, against the oracle."""
    on_ws_gemm(monkeypatch, tile, OVERLAP="1", SKIP_PADDING="0")
    check_skewed_experts(quant, activation, bias, seed=61)
    assert ws_gemm_calls == [1, 2]


OVERLAP_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops
from moe_ops.kernels import ws_gemm
ws_gemm.SKIP_PADDING = "0"
for tile, gemm, activation, quant, bias, early in (
        ("rows", 2, "none", "fp8", False, False), ("rows", 1, "swiglu", "fp8", True, True),
        ("cols", 2, "none", "fp8_block", False, True),
        ("rows", 1, "swiglu", "fp8_block", False, False)):
    for overlap in (False, True):
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation, quant=quant,
                                      has_bias=bias, early=early, overlap=overlap, k=768)
        # the K loop's body: its shortest loop of a whole step's wgmmas (fp8: a pair's 8)
        per_step = 8 if quant == "fp8" else 4
        body = min((b for b in loops(kernel) if sum("QGMMA" in i for i in b) == per_step),
                   key=len)
        local = sum(i.split()[0].startswith(("LDL", "STL")) for i in body)
        print(tile, gemm, quant, int(overlap), len(body), local,
              kernel.asm["ptx"].count("wgmma.wait_group"))
"""


def test_overlap_builds():
    """OVERLAP's sm_90 builds: each consumer's K loop at most 6 instructions longer than
    without it (the carried accumulator costs no moves there; fp8's pair loop from a step known
    only at run time 144 -> 146-150 a pair of steps, fp8_block's swiglu GEMM1 131 -> 133 a step)
    and free of local memory, GEMM1 and GEMM2, fp8 (pairs) and fp8_block, with and without the
    early epilogue; one wgmma wait more in the PTX (the first steps', one a consumer). The odd
    last step of fp8's pairs and the epilogue are outside this check."""
    rows, done = sm90_script_rows(OVERLAP_BUILDS)
    assert len(rows) == 8, done.stdout
    for off, on in zip(rows[0::2], rows[1::2]):
        assert off[:3] == on[:3] and (off[3], on[3]) == ("0", "1"), done.stdout
        assert int(on[4]) <= int(off[4]) + 6 and on[5] == "0", done.stdout
        assert int(on[6]) > int(off[6]), done.stdout


def test_overlap_rule_and_refusals(monkeypatch):
    """OVERLAP "short" takes the launches of at most SHORT_K_MAX_K columns of K, "1" all, "0"
    none; never "wide", the padding skip or a stagger; asked for where it cannot run, the
    launcher says so before anything launches."""
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "0")
    monkeypatch.setattr(ws_gemm, "STAGGER", 0)
    monkeypatch.setattr(ws_gemm, "OVERLAP", "short")
    assert ws_gemm.overlaps("rows", 2, 768) and ws_gemm.overlaps("cols", 1, 1024)
    assert not ws_gemm.overlaps("rows", 2, 2048) and not ws_gemm.overlaps("wide", 2, 768)
    monkeypatch.setattr(ws_gemm, "OVERLAP", "1")
    assert ws_gemm.overlaps("rows", 2, 14336) and not ws_gemm.overlaps("wide", 1, 768)
    monkeypatch.setattr(ws_gemm, "SKIP_PADDING", "gemm2")
    assert ws_gemm.overlaps("rows", 1, 768) and not ws_gemm.overlaps("rows", 2, 768)
    monkeypatch.setattr(ws_gemm, "OVERLAP", "0")
    assert not ws_gemm.overlaps("rows", 1, 768)
    with pytest.raises(ValueError, match="overlap=True"):
        ws_gemm.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                     tile="wide", overlap=True)
    with pytest.raises(ValueError, match="overlap=True"):
        ws_gemm.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                     tile="rows", quant="fp8", overlap=True)


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8_block"), ("wide", "fp8"),
                                        ("wide", "fp8_block")])
@pytest.mark.parametrize("gemm,out_dtype", [(2, torch.bfloat16), (2, torch.float16),
                                            (1, torch.bfloat16)])
def test_native_cast_is_bit_equal(tile, quant, gemm, out_dtype):
    """NATIVE_CAST (the GPU's float32 -> bf16 / fp16 conversion in the epilogue) writes the
    same values as round_to_dtype's grid rounding (torch.equal: an exact zero's sign, which
    round_to_dtype drops, aside): GEMM2's pair rows (bf16 and fp16 outputs,
    values spread over many binades by the random scales) and GEMM1's activation rows, every
    routed row written, GEMM1's padding rows not."""
    if tile == "wide" and not ws_gemm.wide_admits(quant, "none" if gemm == 2 else "swiglu",
                                                  False):
        pytest.skip("no such wide build")
    problem = gemm2_problem(tile, quant, 8, 512, 1024, 300, 4, seed=31)
    assert_arms_equal(problem, tile, quant, gemm, [dict(native_cast=False),
                                                   dict(native_cast=True)],
                      out_dtype=out_dtype, programs=5)


@needs_hopper
@pytest.mark.parametrize("tile", ["rows", "wide"])
@pytest.mark.parametrize("quant,activation,bias", [("fp8", "swiglu", True),
                                                   ("fp8_block", "swiglu", False)])
def test_experts_with_native_cast(tile, quant, activation, bias, monkeypatch, ws_gemm_calls,
                                  poisoned_empty):
    """Both GEMMs of the experts call with NATIVE_CAST, on the skewed experts problem, against
    the oracle (the wide tile where its builds admit the launch, the rule's form otherwise)."""
    on_ws_gemm(monkeypatch, tile, NATIVE_CAST=True)
    check_skewed_experts(quant, activation, bias, seed=67)
    assert ws_gemm_calls == [1, 2]


NATIVE_CAST_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops, sass
from moe_ops.kernels import ws_gemm
for tile, gemm, activation, quant, k in (("rows", 2, "none", "fp8", 768),
                                         ("rows", 1, "swiglu", "fp8", 768),
                                         ("wide", 2, "none", "fp8_block", 2048),
                                         ("cols", 2, "none", "fp8_block", 768)):
    sizes, bodies, local = [], [], []
    for native in (False, True):
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation, quant=quant,
                                      k=k, native_cast=native)
        per_step = 8 if tile == "wide" else 4
        body = min((b for b in loops(kernel) if sum("QGMMA" in i for i in b) >= per_step),
                   key=len)
        sizes.append(len(sass(kernel)))
        bodies.append(len(body))
        local.append(sum(i.split()[0].startswith(("LDL", "STL")) for i in body))
    print(tile, gemm, quant, *sizes, *bodies, *local)
"""


def test_native_cast_builds():
    """NATIVE_CAST's sm_90 builds: at least 500 SASS instructions shorter a build (the
    epilogue's grid rounding gone: ~11 instructions a value, 64 values a thread, once per
    epilogue and consumer) with the same K loop and no more local memory in it."""
    rows, done = sm90_script_rows(NATIVE_CAST_BUILDS)
    assert len(rows) == 4, done.stdout
    for tile, gemm, quant, size, size_native, body, body_native, local, local_native in rows:
        assert int(size) - int(size_native) >= 500, done.stdout
        assert body == body_native and int(local_native) <= int(local), done.stdout


@needs_hopper
@pytest.mark.parametrize("tile", ["rows", "cols"])
@pytest.mark.parametrize("gemm", [2, 1])
@pytest.mark.parametrize("programs,K", [(5, 128), (5, 256), (5, 512), (7, 768), (7, 1024),
                                        (132, 1152), (3, 2048)])
def test_pipelined_pairs_are_bit_equal(tile, gemm, programs, K):
    """PIPE_PAIRS (each pair of K steps issued before the previous pair's wait and promotion,
    into a second partial) promotes in the serial pairs' order: both GEMMs equal bit for bit
    with and without it, every routed row written (GEMM1's padding rows not), for tiles of 1-16
    steps (no pair, one to eight pairs, odd and even counts, an odd last step) and 3-132
    programs."""
    problem = gemm2_problem(tile, "fp8", 8, 512, K, 300, 4, seed=37)
    assert_arms_equal(problem, tile, "fp8", gemm, [dict(pipe_pairs=False),
                                                   dict(pipe_pairs=True)], programs=programs)


@needs_hopper
@pytest.mark.parametrize("tile", ["rows", "cols"])
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("relu2", True)])
def test_experts_with_pipelined_pairs(tile, activation, bias, monkeypatch, ws_gemm_calls,
                                      poisoned_empty):
    """The experts call with PIPE_PAIRS on both GEMMs (GEMM1 on copied rows: the gather takes
    the serial pairs), on the skewed experts problem, against the oracle."""
    on_ws_gemm(monkeypatch, tile, PIPE_PAIRS=True)
    check_skewed_experts("fp8", activation, bias, seed=71)
    assert ws_gemm_calls == [1, 2]


PIPE_PAIRS_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops, sass
from moe_ops.kernels import ws_gemm
for tile, gemm, activation, k in (("rows", 2, "none", 14336), ("cols", 2, "none", 768),
                                  ("rows", 1, "swiglu", 4096)):
    kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation, quant="fp8",
                                  k=k, pipe_pairs=True)
    # the loop of two pairs: 16 wgmmas, a wait for at most two running steps between them
    body = min((b for b in loops(kernel) if sum("QGMMA" in i for i in b) == 16), key=len)
    local = sum(i.split()[0].startswith(("LDL", "STL")) for i in body)
    waits = sum("DEPBAR.LE gsb0, 0x2" in i for i in body)
    print(tile, gemm, len(body), local, waits, kernel.metadata.shared)
"""


def test_pipelined_pairs_build():
    """PIPE_PAIRS' sm_90 builds: each consumer's loop of two pairs keeps both partials in
    registers (no local access), waits for the older pair with the newer one's two steps still
    running, and the form's whole ring fits a block's shared memory."""
    rows, done = sm90_script_rows(PIPE_PAIRS_BUILDS)
    assert len(rows) == 3, done.stdout
    for tile, gemm, length, local, waits, shared in rows:
        assert local == "0" and int(waits) >= 2, done.stdout
        assert int(shared) <= 227 * 1024, done.stdout


def test_scale_loads_rule(monkeypatch):
    """MOE_OPS_WS_SCALE_LOADS: "before" (the default) everywhere, "after" everywhere, "cols"
    after on the "cols" form alone; the kernel's constexpr follows."""
    for setting, expected in (("before", (0, 0, 0)), ("after", (1, 1, 1)), ("cols", (0, 1, 0))):
        monkeypatch.setattr(ws_gemm, "SCALE_LOADS", setting)
        monkeypatch.setattr(ws_gemm, "SCALES_AFTER_MMA", setting == "after")
        got = tuple(ws_gemm._constants(tile, 2, "none", False, "fp8_block", 2048, None, None, 0,
                                       0)["SCALES_AFTER_MMA"] for tile in ("rows", "cols", "wide"))
        assert got == expected, (setting, got)


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8"), ("rows", "fp8_block"),
                                        ("cols", "fp8_block"), ("wide", "fp8_block")])
@pytest.mark.parametrize("gemm", [2, 1])
@pytest.mark.parametrize("experts,programs", [(8, 3), (8, 132), (64, 7)])
def test_expert_groups_are_bit_equal(tile, quant, gemm, experts, programs):
    """EXPERT_GROUPS (the tile groups cut at the experts' boundaries) changes the tiles' order
    alone: both GEMMs equal bit for bit with and without it, every routed row written (GEMM1's
    padding rows not), with 1-3 row blocks an expert straddling the 8-block windows (8 experts)
    and groups of one block (64 experts), on 3-132 programs."""
    if tile == "wide" and not ws_gemm.wide_admits(quant, "swiglu" if gemm == 1 else "none",
                                                  False):
        pytest.skip("no wide build")
    problem = gemm2_problem(tile, quant, experts, 512, 1024, 300, 4, seed=43)
    assert_arms_equal(problem, tile, quant, gemm, [dict(expert_groups=False),
                                                   dict(expert_groups=True)], programs=programs)


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8_block")])
def test_expert_groups_with_the_gathering_gemm1(tile, quant):
    """EXPERT_GROUPS with GEMM1 gathering its rows (the producer's tile order is the
    consumers'): the same rows bit for bit as without it, padding slots unwritten."""
    assert_gathering_arms_equal(tile, quant, 1024, 47, 11, [dict(expert_groups=False),
                                                            dict(expert_groups=True)])


@needs_hopper
@pytest.mark.parametrize("tile,quant,activation,bias,group_m", [
    ("rows", "fp8", "swiglu", True, 8), ("cols", "fp8_block", "swiglu", False, 8),
    ("cols", "fp8", "relu2", False, 32), ("rows", "fp8_block", "swiglu", True, 32)])
def test_experts_with_expert_groups(tile, quant, activation, bias, group_m, monkeypatch,
                                    ws_gemm_calls, poisoned_empty):
    """The experts call with EXPERT_GROUPS on both GEMMs, groups of 8 and 32 row blocks (the
    latter GEMM1's alone: GROUP_M_GEMM1), on the skewed experts problem, against the
    oracle."""
    on_ws_gemm(monkeypatch, tile, EXPERT_GROUPS="1", GROUP_M_GEMM1=group_m)
    check_skewed_experts(quant, activation, bias, seed=73)
    assert ws_gemm_calls == [1, 2]


EXPERT_GROUPS_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import loops, resource_usage
from moe_ops.kernels import ws_gemm
for tile, gemm, activation, quant in (("rows", 2, "none", "fp8"),
                                      ("cols", 1, "swiglu", "fp8_block")):
    sizes, local = [], 0
    for expert_groups, group_m in ((False, 8), (True, 8), (True, 32)):
        kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation, quant=quant,
                                      expert_groups=expert_groups, group_m=group_m)
        # the K loop: the innermost loop with wgmmas
        body = min((b for b in loops(kernel) if any("GMMA" in i for i in b)), key=len)
        local += sum(i.split()[0].startswith(("LDL", "STL")) for i in body)
        sizes.append(len(body))
        stack = resource_usage(kernel).split()[-2]
        print(tile, gemm, expert_groups, group_m, sizes[0], sizes[-1], local, stack)
"""


def test_expert_groups_build():
    """EXPERT_GROUPS' sm_90 builds, groups of 8 and 32 blocks: the K loop about the default
    build's (the change is in each tile's coordinates: registers move, no instructions join
    the loop), no local memory in it, no stack (the window's experts 8 at a time)."""
    rows, done = sm90_script_rows(EXPERT_GROUPS_BUILDS)
    assert len(rows) == 6, done.stdout
    for tile, gemm, expert_groups, group_m, size, size_grouped, local, stack in rows:
        assert int(size_grouped) <= int(size) + 4, done.stdout
        assert local == "0" and stack == "0", done.stdout


def test_expert_groups_rule(monkeypatch):
    """MOE_OPS_WS_EXPERT_GROUPS: "auto" cuts the groups where an expert's weights pass 8 MB and
    its rows fill fewer than GROUP_M row blocks (DeepSeek-V3's GEMMs to T = 16384, Llama 4's
    and Mixtral's at small T; never Qwen3-30B-A3B's 1.5-3 MB experts); 0 / 1 never / always;
    an explicit argument wins; compile_sm90's default build is the fixed windows'."""
    deepseek_gemm1 = dict(num_experts=256, n=4096, k=7168)
    qwen3_gemm2 = dict(num_experts=128, n=2048, k=768)
    mixtral_gemm1 = dict(num_experts=8, n=28672, k=4096)
    monkeypatch.setattr(ws_gemm, "EXPERT_GROUPS", "auto")
    assert ws_gemm.expert_groups_apply("cols", 4096 * 8, **deepseek_gemm1)
    assert ws_gemm.expert_groups_apply("rows", 16384 * 8, **deepseek_gemm1)
    assert not ws_gemm.expert_groups_apply("rows", 16384 * 8, **qwen3_gemm2)
    assert not ws_gemm.expert_groups_apply("rows", 1024 * 8, **qwen3_gemm2)
    assert ws_gemm.expert_groups_apply("rows", 2048 * 2, **mixtral_gemm1)
    assert not ws_gemm.expert_groups_apply("rows", 4096 * 2, **mixtral_gemm1)
    assert not ws_gemm.expert_groups_apply("rows", 4096 * 2, **deepseek_gemm1,
                                           expert_groups=False)
    assert ws_gemm._constants("rows", 2, "none", False, "fp8", 768, None, None, 0,
                              0)["EXPERT_GROUPS"] == 0
    for setting, expected in (("0", False), ("1", True)):
        monkeypatch.setattr(ws_gemm, "EXPERT_GROUPS", setting)
        assert ws_gemm.expert_groups_apply("cols", 4096 * 8, **deepseek_gemm1) == expected
        assert ws_gemm.expert_groups_apply("rows", 16384 * 8, **qwen3_gemm2) == expected
    assert ws_gemm._constants("rows", 2, "none", False, "fp8", 768, None, None, 0,
                              0)["EXPERT_GROUPS"] == 1


@needs_hopper
@pytest.mark.parametrize("tile,quant", [("rows", "fp8"), ("cols", "fp8_block"),
                                        ("wide", "fp8_block")])
@pytest.mark.parametrize("gemm", [2, 1])
@pytest.mark.parametrize("expert_groups", [False, True])
def test_group_sizes_are_bit_equal(tile, quant, gemm, expert_groups):
    """group_m (the row blocks a group of the tile order holds) changes the tiles' order alone:
    groups of 1, 16 and 32 blocks write the same bits as 8, with and without the groups cut at
    the experts' boundaries (8 experts of 1-3 blocks, 7 programs)."""
    if tile == "wide" and not ws_gemm.wide_admits(quant, "swiglu" if gemm == 1 else "none",
                                                  False):
        pytest.skip("no wide build")
    problem = gemm2_problem(tile, quant, 8, 512, 1024, 300, 4, seed=53)
    for size in (1, 16, 32):
        assert_arms_equal(problem, tile, quant, gemm,
                          [dict(expert_groups=expert_groups, group_m=8),
                           dict(expert_groups=expert_groups, group_m=size)], programs=7)


def test_group_sizes(monkeypatch):
    """MOE_OPS_WS_GROUP_M sets both GEMMs' group size, MOE_OPS_WS_GROUP_M_GEMM1 GEMM1's alone
    (0: the other's); the kernel's constexpr follows, an explicit group_m wins; a size that is
    not a power of two is refused naming its variable, before any launch."""
    assert (ws_gemm.group_size(1), ws_gemm.group_size(2)) == (8, 8)
    monkeypatch.setattr(ws_gemm, "GROUP_M_GEMM1", 32)
    monkeypatch.setattr(ws_gemm, "GROUP_M", 16)
    assert (ws_gemm.group_size(1), ws_gemm.group_size(2)) == (32, 16)
    constants = [ws_gemm._constants("rows", gemm, "swiglu" if gemm == 1 else "none", False,
                                    "fp8", 4096, None, None, 0, 0)["GROUP_M"] for gemm in (1, 2)]
    assert constants == [32, 16]
    assert ws_gemm._constants("rows", 1, "swiglu", False, "fp8", 4096, None, None, 0, 0,
                              group_m=4)["GROUP_M"] == 4
    with pytest.raises(ValueError, match="group_m must be a power of two"):
        ws_gemm.gemm(None, None, None, None, None, None, None, gemm=2, activation="none",
                     quant="fp8", group_m=12)
    for name in ("MOE_OPS_WS_GROUP_M", "MOE_OPS_WS_GROUP_M_GEMM1"):
        done = subprocess.run([sys.executable, "-c", "import moe_ops.kernels.ws_gemm"],
                              env=dict(os.environ, **{name: "12"}), capture_output=True,
                              text=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
        assert done.returncode != 0 and f"{name} must be a power of two" in done.stderr
