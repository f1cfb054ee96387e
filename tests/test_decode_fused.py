"""The one-launch decode (kernels/decode_fused.py) against the float64 oracle: every activation,
16- and 32-bit activations and fp8, biases, pairs routed to no local expert, an expert-parallel
shard, several tokens; outputs and the intermediate NaN-poisoned (poisoned_empty), so an element
left unwritten shows. The interpreter runs a grid's programs one after another, so its first
program takes every item and no GEMM2 item ever waits there: the hand-off between programs is
checked by the counters' final values (here), by the sm_90 build's synchronisation
instructions, and on a GPU by bitwise repeatability across grid sizes. Also the experts call's
switch (experts.FUSED_DECODE)."""
import pytest
import torch

from moe_ops.kernels import decode_fused, experts as experts_mod
from moe_ops.kernels.common import cdiv
from test_kernels_experts import DEVICE, FP8_TOL, TOL, experts_f64, make_problem, rel_err
from test_ws_gemm import sm90_script_rows


def check_fused(T, H, I, E, k, *, activation="swiglu", dtype=torch.bfloat16, bias=False,
                seed=0, programs=None, quant="none", **problem):
    tensors, kwargs = make_problem(T, H, I, E, k, activation=activation, dtype=dtype,
                                   bias=bias, seed=seed, quant=quant, **problem)
    x, ids, weights, w13, w2, w13_scale, w2_scale, b13, b2 = tensors
    out = decode_fused.fused_decode(
        x, ids, weights, w13, w2, b13, b2, w13_scale=w13_scale, w2_scale=w2_scale, quant=quant,
        activation=activation,
        alpha=kwargs.get("alpha", 1.702), limit=kwargs.get("limit", 7.0),
        local_expert_offset=kwargs.get("local_expert_offset", 0), programs=programs)
    ref = experts_f64(*tensors, **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    err, tol = rel_err(out, ref), FP8_TOL if quant == "fp8" else TOL[dtype]
    assert err <= tol, f"relative Frobenius error {err:.3e} > {tol}"
    return out


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_decode_matches_oracle(activation, dtype, poisoned_empty):
    # (H, I not multiples of the blocks: partial row and K blocks)
    check_fused(3, 200, 72, 6, 2, activation=activation, dtype=dtype,
                bias=activation in ("geglu", "swiglu_oai"), seed=len(activation), programs=3)


@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "relu2"])
def test_fused_decode_fp8_matches_oracle(activation, quant, poisoned_empty):
    """fp8 per tensor / fp8_block: x and each pair's intermediate quantized a row / a
    128-column group at a time inside the items (act_quant's rule), e4m3 products scaled by
    the row (group) and weight (block) scales; I = 136: a partial last group and block."""
    check_fused(3, 256, 136, 6, 2, activation=activation, quant=quant,
                bias=activation == "swiglu_oai", seed=11 + len(activation), programs=3)


def test_fused_decode_counts_every_item(monkeypatch):
    """After a call each token's counter holds exactly what its GEMM2 items wait for (TOP_K x
    GEMM1 row blocks, pairs routed outside the shard included), and the queue handed out every
    item and then one index past the end to each program."""
    made, real_zeros = [], torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: made.append(real_zeros(*a, **kw))
                        or made[-1])
    T, H, I, k, programs = 4, 200, 72, 3, 5
    check_fused(T, H, I, 4, k, bias=True, local_expert_offset=4, num_global_experts=12,
                invalid_ids=True, seed=5, programs=programs)
    counters = [t for t in made if t.dtype == torch.int32 and t.shape == (T + 1, )][-1]
    blocks1 = cdiv(2 * I, decode_fused.BLOCK_N1)
    items = T * k * blocks1 + T * cdiv(H, decode_fused.BLOCK_N2)
    assert counters[1:].tolist() == [k * blocks1] * T
    assert counters[0].item() == items + programs


def test_fused_decode_invalid_ids_and_shard(poisoned_empty):
    """Pairs routed outside the local experts (id -1, ids past every shard, another shard's)
    add nothing; the shard's ids are offset."""
    check_fused(4, 128, 64, 4, 3, bias=True, local_expert_offset=4, num_global_experts=12,
                invalid_ids=True, seed=5)


def test_fused_decode_one_token_fp16(poisoned_empty):
    check_fused(1, 96, 40, 8, 4, dtype=torch.float16, seed=7)


def test_fused_decode_refuses_what_it_does_not_run():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(2, 64, 32, dtype=torch.bfloat16)
    ids, weights = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    assert not decode_fused.applies(x, "fp8", "swiglu", w13, w2)     # (16-bit weights)
    assert not decode_fused.applies(x, "nvfp4", "swiglu", w13, w2)
    with pytest.raises(ValueError, match="fused_decode"):
        decode_fused.fused_decode(x, ids, weights, w13.float(), w2, activation="swiglu")
    with pytest.raises(ValueError, match="w13"):
        decode_fused.fused_decode(x, ids, weights, w13, w2[:, :32], activation="swiglu")
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="w13_scale"):
        decode_fused.fused_decode(x, ids, weights, w13.to(e4m3), w2.to(e4m3), quant="fp8",
                                  w13_scale=torch.ones(2, 64), activation="swiglu")


def test_experts_call_takes_the_fused_launch(monkeypatch, poisoned_empty):
    """experts.FUSED_DECODE: a quant none, fp8 or fp8_block call of a few pairs runs the one
    launch (and matches the oracle): one token, or at most one pair for two experts; calls past
    FUSED_DECODE_MAX_PAIRS keep the usual launches."""
    calls = []
    real = decode_fused.fused_decode
    monkeypatch.setattr(decode_fused, "fused_decode",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(experts_mod, "FUSED_DECODE", True)
    monkeypatch.setattr(experts_mod, "FUSED_DECODE_MAX_PAIRS", 8)
    for T, quant in ((1, "none"), (3, "none"), (1, "fp8"), (1, "fp8_block"), (6, "none")):
        tensors, kwargs = make_problem(T, 256, 128, 16, 2, quant=quant, seed=T)
        out = experts_mod.triton_experts(*tensors, **kwargs)
        ref = experts_f64(*tensors, **kwargs)
        assert torch.isfinite(out).all() and rel_err(out, ref) <= 1.5e-2
    assert calls == [1, 3, 1, 1], calls


SM90_BUILDS = """
import sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import sass
from moe_ops.kernels import decode_fused
for kw in (dict(), dict(activation="swiglu_oai", bias=True), dict(quant="fp8"),
           dict(quant="fp8_block"), dict(activation="relu2", dtype="fp32")):
    kernel = decode_fused.compile_sm90(**kw)
    ops = [i.split()[0] for i in sass(kernel)]
    local = sum(op.startswith(("LDL", "STL")) for op in ops)
    mma = sum(op.startswith(("HMMA", "QMMA", "HGMMA", "QGMMA")) for op in ops)
    ptx = [line.strip() for line in kernel.asm["ptx"].splitlines()]
    releases = [i for i, line in enumerate(ptx) if "atom.global.gpu.release" in line]
    # (the release's barrier: the last bar.sync before it, with no global store between)
    last_bar = max(i for i in range(releases[0]) if ptx[i].startswith("bar.sync"))
    stores = sum(ptx[i].startswith(("st.global", "@")) and "st.global" in ptx[i]
                 for i in range(last_bar, releases[0]))
    acquires = sum("ld.global.gpu.acquire" in line or "atom.global.gpu.acquire" in line
                   for line in ptx)
    print(len(kw), local, mma, kernel.metadata.shared, len(releases), stores, acquires)
"""


def test_fused_decode_builds_for_sm90():
    """The kernel builds for sm_90 (what the interpreter cannot check): its 16-bit and fp8
    builds on the tensor cores, none with local memory, within a block's shared memory; the
    hand-off's instructions there (a barrier then one release increment, acquire polls)."""
    rows, done = sm90_script_rows(SM90_BUILDS)
    rows = [row for row in rows if row]
    assert len(rows) == 5, done.stdout
    for i, (_, local, mma, shared, releases, stores, acquires) in enumerate(rows):
        assert local == "0" and int(shared) <= 227 * 1024, done.stdout
        assert (int(mma) > 0) == (i < 4), done.stdout
        # one release increment after a barrier, the GEMM2 items' acquire polls
        assert releases == "1" and stores == "0" and int(acquires) >= 1, done.stdout


@pytest.mark.skipif(DEVICE != "cuda", reason="the hand-off between programs runs on a GPU")
@pytest.mark.parametrize("quant", ["none", "fp8", "fp8_block"])
def test_fused_decode_repeats_bit_for_bit_across_grids(quant):
    """On a GPU GEMM2 items do wait for other programs' GEMM1 items: the output of a call of
    Qwen3's shapes (32 experts; random ids, -1 among them) is the same bit for bit over many
    calls and grid sizes (one program, one a SM, 4 and 8 an SM; the summation order is fixed, so
    a read of a row before it was finished would show), and matches the oracle."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for T in (1, 4):
        tensors, kwargs = make_problem(T, 2048, 768, 32, 8, quant=quant, seed=T,
                                       invalid_ids=True)
        x, ids, weights, w13, w2, w13_scale, w2_scale, b13, b2 = tensors
        runs = []
        for programs in (1, sms, 4 * sms, 8 * sms):
            for _ in range(50):
                runs.append(decode_fused.fused_decode(
                    x, ids, weights, w13, w2, b13, b2, w13_scale=w13_scale,
                    w2_scale=w2_scale, quant=quant, programs=programs))
        assert all(torch.equal(run, runs[0]) for run in runs)
        ref = experts_f64(*tensors, **kwargs)
        assert rel_err(runs[0], ref) <= (FP8_TOL if quant == "fp8" else TOL[x.dtype])
