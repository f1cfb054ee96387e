"""The Triton experts kernels (moe_ops.kernels): dispatch, grouped GEMMs, activation quant.

On a machine without CUDA the kernels run in the Triton interpreter on CPU tensors: the flag
must be set before torch/triton are imported, which tests/conftest.py does. Results are compared with
a float64 evaluation written here from the same kernel-layout tensors (gate/up interleave
decoded, scale rules applied, activations quantized as specified), and with
moe_ops.reference.fused_experts_reference once that module exists.
"""
import dataclasses
import math

import pytest
import torch

from moe_ops.quant import quantize_fp8_per_token, quantize_fp8_per_token_group

from moe_ops.kernels import align as align_mod
from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels.act_quant import act_quant
from moe_ops.kernels.align import moe_align
from moe_ops.kernels.common import next_power_of_2
from moe_ops.kernels.experts import triton_experts
from moe_ops.kernels.grouped_gemm import (
    GemmConfig, GemmProblem, config_problems, config_space, default_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# The fp8 modes requantize GEMM1's output to e4m3 before GEMM2. The kernel computes GEMM1 in
# float32 (tensor-core order on the GPU), the oracle in float64: an element near an e4m3
# rounding boundary can land one step apart (6-12% of that element). On these tiny problems
# (tens of outputs) one such element is worth ~1e-2 of relative error (1.04e-2 seen on an H200,
# 2026-11-30); real layer sizes average it out and the GPU check holds SPEC's 1e-2 there
# (benchmarks/gpu_check.py). A wrong scale or row is off by far more than this bound.
FP8_TOL = 1.5e-2


# ---------------------------------------------------------------- float64 evaluation (oracle)

def _quant_rows(a: torch.Tensor, group: int = 0) -> torch.Tensor:
    """Dynamic e4m3 quantization of rows by the package's rule (SPEC: q = e4m3(x / s),
    s = amax/448 per row or per `group` columns), returned dequantized in float64."""
    if group:
        q, s = quantize_fp8_per_token_group(a, group)
        return q.double() * s.double().repeat_interleave(group, dim=1)[:, : a.shape[1]]
    q, s = quantize_fp8_per_token(a)
    return q.double() * s.double()[:, None]


def _dequant_weight(w, scale, quant, gated_w13):
    if quant == "none":
        return w.double()
    if quant == "fp8":
        return w.double() * scale.double()[:, :, None]
    rows = torch.arange(w.shape[1], device=w.device)
    scale_rows = 2 * ((rows // 2) // 128) + rows % 2 if gated_w13 else rows // 128
    cols = torch.arange(w.shape[2], device=w.device) // 128
    return w.double() * scale.double()[:, scale_rows][:, :, cols]


def _act64(h, activation, alpha, limit):
    if activation == "relu2":
        return torch.relu(h) ** 2
    gate, up = h[:, 0::2], h[:, 1::2]  # w13 row 2i = gate i, 2i+1 = up i
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    if activation == "geglu":
        return torch.nn.functional.gelu(gate) * up
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return (u + 1) * g * torch.sigmoid(alpha * g)


def experts_f64(x, topk_ids, topk_weights, w13, w2, w13_scale=None, w2_scale=None, b13=None,
                b2=None, *, activation="swiglu", quant="none", alpha=1.702, limit=7.0,
                local_expert_offset=0):
    T, H = x.shape
    E = w13.shape[0]
    gated = activation != "relu2"
    group = 128 if quant == "fp8_block" else 0
    W13 = _dequant_weight(w13, w13_scale, quant, gated)
    W2 = _dequant_weight(w2, w2_scale, quant, False)
    xa = x.double() if quant == "none" else _quant_rows(x, group)
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    local = topk_ids.long() - local_expert_offset
    for e in range(E):
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xa[tok] @ W13[e].T
        if b13 is not None:
            h = h + b13[e].double()
        a = _act64(h, activation, alpha, limit).to(x.dtype)  # the kernels store a in x.dtype
        a = a.double() if quant == "none" else _quant_rows(a, group)
        y = a @ W2[e].T
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, tok, topk_weights[tok, slot].double()[:, None] * y)
    return out


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- problem generation

def make_problem(T, H, I, E, k, *, activation="swiglu", quant="none", dtype=torch.bfloat16,
                 bias=False, local_expert_offset=0, num_global_experts=None, seed=0,
                 all_to_one=False, invalid_ids=False):
    g = torch.Generator().manual_seed(seed)
    gated = activation != "relu2"
    N13 = 2 * I if gated else I
    num_global = num_global_experts or (E + local_expert_offset)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    x = randn(T, H).to(dtype)
    if all_to_one:
        ids = torch.full((T, k), local_expert_offset, dtype=torch.int64)
        ids[:, 1:] = local_expert_offset + 1 + torch.arange(k - 1)
        ids[:, 0] = local_expert_offset  # every token hits the same expert
    else:
        ids = torch.stack([torch.randperm(num_global, generator=g)[:k] for _ in range(T)]
                          ) if T else torch.zeros(0, k, dtype=torch.int64)
    if invalid_ids and T > 0:
        ids[0, 0] = -1
        ids[-1, -1] = num_global + 3  # beyond every local range
        if T > 2:
            ids[1, :] = -1           # a token with no valid pair at all
    ids = ids.to(torch.int32 if seed % 2 else torch.int64)
    weights = torch.rand(T, k, generator=g) + 0.1
    w_scale13 = 1.0 / math.sqrt(H)
    w_scale2 = 1.0 / math.sqrt(I)
    w13_scale = w2_scale = None
    if quant == "none":
        w13 = randn(E, N13, H, scale=w_scale13).to(dtype)
        w2 = randn(E, H, I, scale=w_scale2).to(dtype)
    else:
        w13 = randn(E, N13, H).clamp(-6, 6).to(FP8)
        w2 = randn(E, H, I).clamp(-6, 6).to(FP8)
        if quant == "fp8":
            w13_scale = (torch.rand(E, N13, generator=g) + 0.5) * w_scale13
            w2_scale = (torch.rand(E, H, generator=g) + 0.5) * w_scale2
        else:
            nb_i, nb_h = math.ceil(I / 128), math.ceil(H / 128)
            w13_scale = (torch.rand(E, (2 if gated else 1) * nb_i, nb_h, generator=g) + 0.5) * w_scale13
            w2_scale = (torch.rand(E, nb_h, nb_i, generator=g) + 0.5) * w_scale2
    b13 = randn(E, N13, scale=0.5) if bias else None
    b2 = randn(E, H, scale=0.5) if bias else None
    tensors = [x, ids, weights, w13, w2, w13_scale, w2_scale, b13, b2]
    tensors = [t.to(DEVICE) if t is not None else None for t in tensors]
    return tensors, dict(activation=activation, quant=quant, local_expert_offset=local_expert_offset)


def check_experts(tensors, kwargs, tol, **call_kwargs):
    out = triton_experts(*tensors, **kwargs, **call_kwargs)
    ref = experts_f64(*tensors, **kwargs)
    x = tensors[0]
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    err = rel_err(out, ref)
    assert err <= tol, f"relative Frobenius error {err:.3e} > {tol}"
    try:
        from moe_ops.reference import fused_experts_reference
    except ImportError:
        return out
    ref2 = fused_experts_reference(*tensors, **kwargs)
    err2 = rel_err(out, ref2.double())
    assert err2 <= tol, f"vs moe_ops.reference: relative Frobenius error {err2:.3e} > {tol}"
    return out


# ---------------------------------------------------------------- dispatch

def check_dispatch(topk_ids, num_experts, block_m, offset, dispatch):
    ids = topk_ids.reshape(-1).long().cpu()
    num_pairs = ids.numel()
    sorted_ids = dispatch.sorted_pair_ids.cpu().long()
    blocks = dispatch.block_expert_ids.cpu().long()
    num_padded = int(dispatch.num_padded.cpu()[0])
    assert sorted_ids.numel() == blocks.numel() * block_m
    local = ids - offset
    valid = (local >= 0) & (local < num_experts)
    live = sorted_ids[sorted_ids < num_pairs]
    # every valid pair exactly once, no invalid pair, everything else the sentinel
    assert torch.equal(live.sort().values, torch.nonzero(valid).flatten())
    assert ((sorted_ids == num_pairs) | (sorted_ids < num_pairs)).all()
    assert (sorted_ids[num_padded:] == num_pairs).all()
    counts = torch.bincount(local[valid], minlength=num_experts)
    assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert num_padded % block_m == 0
    live_blocks = num_padded // block_m
    assert (blocks[live_blocks:] == -1).all()
    assert (blocks[:live_blocks] >= 0).all() and (blocks[:live_blocks] < num_experts).all()
    assert (blocks[:live_blocks].diff() >= 0).all()  # runs in expert order
    for b in range(live_blocks):
        chunk = sorted_ids[b * block_m:(b + 1) * block_m]
        real = chunk[chunk < num_pairs]
        assert (local[real] == blocks[b]).all()
        # inside a block: pairs first, then padding
        n = real.numel()
        assert (chunk[:n] < num_pairs).all() and (chunk[n:] == num_pairs).all()


@pytest.mark.parametrize("path", ["small", "large"])
@pytest.mark.parametrize("T,k,E,block_m,offset,case", [
    (1, 2, 8, 16, 0, "random"),
    (37, 4, 8, 16, 0, "random"),
    (37, 4, 8, 64, 3, "invalid"),
    (100, 8, 128, 16, 0, "random"),
    (50, 2, 6, 32, 0, "one_expert"),
    (300, 4, 16, 64, 16, "invalid"),
])
def test_dispatch(path, T, k, E, block_m, offset, case, poisoned_empty):
    tensors, _ = make_problem(T, 16, 16, E, k, local_expert_offset=offset,
                              num_global_experts=E + 2 * offset + 1,
                              all_to_one=case == "one_expert", invalid_ids=case == "invalid",
                              seed=T)
    ids = tensors[1]
    small_max = 1 << 20 if path == "small" else 0
    dispatch = moe_align(ids, E, block_m, offset, small_path_max_pairs=small_max, chunk_pairs=64)
    check_dispatch(ids, E, block_m, offset, dispatch)


@pytest.mark.parametrize("T,k,E,block_m,offset,H", [
    (1, 8, 256, 16, 0, 7168),     # DeepSeek-V3 decode: 8 pairs, 256 columns a program
    (3, 4, 128, 16, 0, 2880),     # gpt-oss: H not a power of two, a partial last program
    (37, 4, 8, 64, 3, 100),       # another shard's experts and invalid ids dropped
    (128, 8, 16, 128, 0, 48),     # 1024 pairs: the single-launch path's limit, 16 columns
    (0, 2, 4, 16, 0, 32),         # no tokens
])
def test_align_gather(T, k, E, block_m, offset, H, poisoned_empty):
    """moe_align_gather: the dispatch moe_align makes (bit for bit), and in the same launch the
    token rows of x in dispatch order at every live slot (rows[s] = x[pair // k]); padding
    slots are left unwritten (the NaN poison stays: no GEMM row reads another's)."""
    tensors, _ = make_problem(max(T, 1), 16, 16, E, k, local_expert_offset=offset,
                              num_global_experts=E + 2 * offset + 1, invalid_ids=offset > 0,
                              seed=T + 1)
    ids = tensors[1][:T]
    g = torch.Generator().manual_seed(H)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE)
    expected = moe_align(ids, E, block_m, offset)
    aligned, rows = align_mod.moe_align_gather(ids, E, block_m, offset, x)
    for name, a, b in zip(("sorted_pair_ids", "block_expert_ids", "num_padded"), expected,
                          aligned):
        assert torch.equal(a, b), name
    assert rows.shape == (aligned.sorted_pair_ids.numel(), H) and rows.dtype == x.dtype
    live = int(aligned.num_padded)
    slots = aligned.sorted_pair_ids[:live].long()
    routed = slots < T * k
    assert torch.equal(rows[:live][routed], x[slots[routed] // k])
    assert torch.isnan(rows[:live][~routed].float()).all(), "a padding slot was written"


def test_align_gather_refuses_bad_calls():
    ids = torch.zeros(129, 8, dtype=torch.int32, device=DEVICE)     # 1032 pairs
    with pytest.raises(ValueError, match="more than the single-launch path's"):
        align_mod.moe_align_gather(ids, 8, 16, 0, torch.zeros(129, 64, device=DEVICE))
    with pytest.raises(ValueError, match="x must be"):
        align_mod.moe_align_gather(ids[:4], 8, 16, 0, torch.zeros(5, 64, device=DEVICE))
    with pytest.raises(ValueError, match="x must be"):
        align_mod.moe_align_gather(ids[:4], 8, 16, 0, torch.zeros(64, 4, device=DEVICE).t())


# ---------------------------------------------------------------- activation quant

@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("quant,K", [("fp8", 40), ("fp8", 3000), ("fp8", 14336), ("fp8", 17000),
                                     ("fp8_block", 192), ("fp8_block", 1100),
                                     ("fp8_block", 16500)])
def test_act_quant(quant, K, split_k):
    """Rows of any length (one step, several, K = 17000 / 16500 in steps of 2048 / 1024) equal
    round-to-nearest-even e4m3 of x / s, including rows far from 1 in size; in both of the
    kernel's forms (split_k: the columns over the grid, fp8's row read whole up to 16384
    columns, 14336 at 16 warps as Mixtral's intermediate; fp8 17000 falls back to the looped
    form, so its two cases are one)."""
    g = torch.Generator().manual_seed(K)
    x = (torch.randn(7, K, generator=g) * torch.exp(torch.randn(7, 1, generator=g))).to(torch.bfloat16)
    # rows 5 and 6 in the short division's range (on a GPU: act_quant.fp8_quantize_short), row
    # 6 of half-integers up to 448 with 448 in every 128 columns: its quotients x * 448 / amax
    # are x, e4m3 midpoints (ties to even) as often as not
    x[6] = (torch.randint(-896, 897, (K,), generator=g).float() / 2).to(torch.bfloat16)
    x[6, ::128] = 448.0
    x[2] = 0  # a zero row: scale 0, q 0, never NaN
    # Rows far from 1: large ones (v * 448 overflows past 2^119, as in quant.py), tiny ones
    # (act_quant scales rows with amax < 2^-96 by 2^64, keeping v * 448 a float32 normal),
    # one just under 1e-30 and one far below it
    x[0] *= 2.0 ** 110 / x[0].abs().max()
    x[1] *= 9e-31 / x[1].abs().max()
    x[3] *= 2.0 ** -105
    x[4] *= 2.0 ** 119 / x[4].abs().max()
    if quant == "fp8_block":
        x[3, 128:256] = 0
    x = x.to(DEVICE)
    q, s = act_quant(x, quant, split_k=split_k)
    group = 128 if quant == "fp8_block" else 0
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    deq = q.double() * (s.double()[:, None] if not group
                        else s.double().repeat_interleave(128, 1)[:, :K])
    ref = _quant_rows(x, group)
    if not torch.equal(deq, ref):
        bad = (deq != ref).nonzero()
        r, c = bad[0].tolist()
        ref_q, ref_s = (quantize_fp8_per_token_group(x, group) if group
                        else quantize_fp8_per_token(x))
        col_s = (r, c // group) if group else (r,)
        pytest.fail(f"kernel quantization differs from round-to-nearest-even e4m3 at {len(bad)} "
                    f"elements, first [{r}, {c}]: x={x[r, c].item()!r} q={q[r, c].item()!r} vs "
                    f"{ref_q[r, c].item()!r}, scale={s[col_s].item()!r} vs {ref_s[col_s].item()!r}")
    assert (q[2].float() == 0).all()


@pytest.fixture
def act_quant_grids(monkeypatch):
    """The grid of each act_quant launch from here on, in order (one axis: the looped form,
    two: SPLIT_K)."""
    from moe_ops.kernels import act_quant as aq
    grids = []
    real = aq._act_quant_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(aq, "_act_quant_kernel", Recorder())
    return grids


def test_act_quant_splits_by_live_rows(monkeypatch, act_quant_grids):
    """The form act_quant picks: SPLIT_K up to SPLIT_K_MAX_ROWS live rows, counted as num_pairs
    when sentinel rows are skipped (a decode intermediate's padded buffer is mostly
    sentinels), and for fp8 only rows of at most WHOLE_ROW_MAX_K columns; fp8 rows wider than
    WIDE_ROW_K read whole at any row count, bit for bit the looped form's codes."""
    from moe_ops.kernels import act_quant as aq
    grids = act_quant_grids
    monkeypatch.setattr(aq, "SPLIT_K_MAX_ROWS", {"fp8": 4, "fp8_block": 4})
    monkeypatch.setattr(aq, "WIDE_ROW_K", 128)
    x = torch.randn(12, 256).to(torch.bfloat16).to(DEVICE)
    ids = torch.full((12,), 3, dtype=torch.int32)
    ids[:3] = torch.arange(3)
    aq.act_quant(x, "fp8_block")                       # 12 rows > 4: looped
    aq.act_quant(x, "fp8_block", ids.to(DEVICE), 3)   # 3 live rows: split
    aq.act_quant(x[:4], "fp8")                         # 4 rows: split, the row whole
    monkeypatch.setattr(aq, "SHORT_ROW_K", 64)
    aq.act_quant(x, "fp8")                             # 12 rows, 256 > WIDE_ROW_K: split
    q, s = aq.act_quant(x, "fp8")
    q_ref, s_ref = act_quant(x, "fp8", split_k=False)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    aq.act_quant(x.float(), "fp8")                     # float32 rows (no short division): looped
    monkeypatch.setattr(aq, "WIDE_ROW_K", 256)
    aq.act_quant(x, "fp8")                             # 256 columns, not wider: looped
    monkeypatch.setattr(aq, "WHOLE_ROW_MAX_K", 128)
    aq.act_quant(x[:4], "fp8")                         # too wide to read whole: looped
    # short rows (SHORT_ROW_K) too wide to read whole: looped, not the packed short rows' form
    # (which reads one BLOCK_K of columns)
    monkeypatch.setattr(aq, "SHORT_ROW_K", 512)
    q, s = aq.act_quant(x, "fp8")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert [len(g) for g in grids] == [1, 2, 2, 2, 2, 1, 1, 1, 1, 1], grids
    assert grids[-1] == (12,), grids                  # one row a program


@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_act_quant_skips_padding_rows(quant, split_k, poisoned_empty):
    """With sorted_pair_ids, rows whose pair id is the sentinel (>= num_pairs) are left as they
    were (GEMM2 masks them), live rows equal the unskipped quantization, bit for bit."""
    num_pairs = 20
    x, ids = rows_with_padding(7, 37, 300, num_pairs, 15)
    q, s = act_quant(x, quant, ids, num_pairs, split_k=split_k)
    assert_live_rows_equal(q, s, *act_quant(x, quant, split_k=not split_k), ids, num_pairs)


def rows_with_padding(seed, M, K, num_pairs, padding):
    """Random bf16 rows x [M, K] and their pair ids, `padding` of them the sentinel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = torch.randint(0, num_pairs, (M,), generator=g)
    ids[torch.randperm(M, generator=g)[:padding]] = num_pairs  # padding rows
    return x, ids.to(torch.int32).to(DEVICE)


def assert_live_rows_equal(q, s, q_ref, s_ref, ids, num_pairs):
    """act_quant's live rows equal the reference's bit for bit; its sentinel rows left as
    poisoned_empty made them (NaN): never written."""
    live = ids < num_pairs
    assert torch.equal(q[live].view(torch.uint8), q_ref[live].view(torch.uint8))
    assert torch.equal(s[live], s_ref[live])
    assert torch.isnan(s[~live]).all() and torch.isnan(q[~live].float()).all()


@pytest.mark.parametrize("K,slice_k", [(3000, 1024), (14336, 2048), (300, 128)])
def test_act_quant_sliced_rows(monkeypatch, poisoned_empty, act_quant_grids, K, slice_k):
    """SLICE_K: a few fp8 rows wider than SLICE_K columns, each quantized by cdiv(K, SLICE_K)
    programs that read the whole row for its amax: bit for bit the one-program form (scales
    included, written once), sentinel rows left unwritten; past SLICE_MAX_ROWS live rows, one
    program a row again."""
    from moe_ops.kernels import act_quant as aq
    num_pairs = 6
    x, ids = rows_with_padding(K, 9, K, num_pairs, 3)
    tiny = int((ids < num_pairs).nonzero()[0])
    x[tiny] *= 2.0 ** -118 / x[tiny].abs().max()   # a tiny row: the 2^64 rescale matters
    monkeypatch.setattr(aq, "SLICE_K", 0)
    q_ref, s_ref = act_quant(x, "fp8", ids, num_pairs, split_k=True)
    del act_quant_grids[:]
    monkeypatch.setattr(aq, "SLICE_K", slice_k)
    q, s = aq.act_quant(x, "fp8", ids, num_pairs)
    assert_live_rows_equal(q, s, q_ref, s_ref, ids, num_pairs)
    q, s = aq.act_quant(x, "fp8")
    assert torch.equal(q.view(torch.uint8),
                       act_quant(x, "fp8", split_k=False)[0].view(torch.uint8))
    monkeypatch.setattr(aq, "SLICE_MAX_ROWS", 4)
    aq.act_quant(x, "fp8", ids, num_pairs)                       # 6 live rows > 4
    slices = -(-K // slice_k)
    # (the third: the looped reference)
    assert act_quant_grids == [(9, slices), (9, slices), (9,), (9, 1)], act_quant_grids


def test_act_quant_short_rows_read_whole(monkeypatch, poisoned_empty, act_quant_grids):
    """SHORT_ROW_K: fp8 rows of at most that many columns are read whole, one a program
    (SHORT_ROWS 1; several: test_act_quant_short_rows_several_a_program), however many rows (the row's load beside its pair id's: LOAD_FIRST), bit for bit the
    looped form's, sentinel rows left unwritten; wider rows and fp8_block keep their forms."""
    from moe_ops.kernels import act_quant as aq
    num_pairs = 30
    x, ids = rows_with_padding(11, 37, 300, num_pairs, 9)
    q_ref, s_ref = act_quant(x, "fp8", ids, num_pairs, split_k=False)
    del act_quant_grids[:]
    monkeypatch.setattr(aq, "SPLIT_K_MAX_ROWS", {"fp8": 4, "fp8_block": 4})
    monkeypatch.setattr(aq, "SHORT_ROWS", 1)                  # one a program: its grid
    monkeypatch.setattr(aq, "SHORT_ROW_K", 512)
    q, s = aq.act_quant(x, "fp8", ids, num_pairs)
    assert_live_rows_equal(q, s, q_ref, s_ref, ids, num_pairs)
    aq.act_quant(x, "fp8_block", ids, num_pairs)         # fp8_block: looped
    monkeypatch.setattr(aq, "SHORT_ROW_K", 256)
    aq.act_quant(x, "fp8", ids, num_pairs)               # 300 > 256: looped
    assert [len(grid) for grid in act_quant_grids] == [2, 1, 1], act_quant_grids


@pytest.mark.parametrize("warps", [1, 2])
def test_act_quant_short_rows_at_fewer_warps(warps, monkeypatch, poisoned_empty):
    """SHORT_ROW_WARPS: the short rows' programs at 1 or 2 warps (more of them resident an SM)
    write the same codes and scales as the rule's 4, sentinel rows unwritten; the other forms
    keep their warps."""
    from moe_ops.kernels import act_quant as aq
    num_pairs = 30
    x, ids = rows_with_padding(11, 37, 768, num_pairs, 9)
    q_ref, s_ref = act_quant(x, "fp8", ids, num_pairs, split_k=False)
    launches = []
    real = aq._act_quant_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((len(grid), kwargs["num_warps"], kwargs["LOAD_FIRST"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(aq, "_act_quant_kernel", Recorder())
    monkeypatch.setattr(aq, "SPLIT_K_MAX_ROWS", {"fp8": 4, "fp8_block": 4})
    monkeypatch.setattr(aq, "SHORT_ROW_WARPS", warps)
    monkeypatch.setattr(aq, "SHORT_ROWS", 1)
    q, s = aq.act_quant(x, "fp8", ids, num_pairs)
    assert_live_rows_equal(q, s, q_ref, s_ref, ids, num_pairs)
    aq.act_quant(x, "fp8", ids, num_pairs, split_k=False)      # the looped form: its own warps
    assert launches == [(2, warps, True), (1, 4, False)], launches


@pytest.mark.parametrize("rows", [2, 8])
def test_act_quant_short_rows_several_a_program(rows, monkeypatch, poisoned_empty,
                                                 act_quant_grids):
    """SHORT_ROWS: the short rows `rows` a program (37 rows: a last program of fewer) write the
    same codes and scales as one a program, sentinel rows unwritten, also where a tile holds
    a zero row and a tiny one beside ordinary ones."""
    from moe_ops.kernels import act_quant as aq
    num_pairs = 30
    x, ids = rows_with_padding(11, 37, 768, num_pairs, 9)
    live = (ids < num_pairs).nonzero().flatten()
    x[live[1]] = 0
    x[live[2]] *= 2.0 ** -110
    q_ref, s_ref = act_quant(x, "fp8", ids, num_pairs, split_k=False)
    q_all, s_all = act_quant(x, "fp8", split_k=False)
    del act_quant_grids[:]
    monkeypatch.setattr(aq, "SPLIT_K_MAX_ROWS", {"fp8": 4, "fp8_block": 4})
    monkeypatch.setattr(aq, "SHORT_ROWS", rows)
    q, s = aq.act_quant(x, "fp8", ids, num_pairs)
    assert_live_rows_equal(q, s, q_ref, s_ref, ids, num_pairs)
    q, s = aq.act_quant(x, "fp8")                              # every row live
    q_ref, s_ref = q_all, s_all
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert act_quant_grids == [(-(-37 // rows),)] * 2, act_quant_grids


# ---------------------------------------------------------------- experts: every mode

ACTIVATIONS = ["swiglu", "geglu", "swiglu_oai", "relu2"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("quant,dtype", [("none", torch.bfloat16), ("none", torch.float32),
                                         ("fp8", torch.bfloat16), ("fp8_block", torch.bfloat16)])
def test_experts_modes(activation, quant, dtype, poisoned_empty):
    bias = activation in ("swiglu_oai", "geglu")
    if quant == "fp8_block":
        T, H, I, E, k = 6, 256, 192, 4, 2
    else:
        T, H, I, E, k = 12, 48, 40, 6, 2
    tensors, kwargs = make_problem(T, H, I, E, k, activation=activation, quant=quant,
                                   dtype=dtype, bias=bias, seed=ACTIVATIONS.index(activation) + 4 * len(quant))
    tol = FP8_TOL if quant != "none" else TOL[dtype]
    check_experts(tensors, kwargs, tol)


@pytest.mark.parametrize("quant", ["none", "fp8", "fp8_block"])
def test_experts_invalid_ids_offset_bias(quant, poisoned_empty):
    H, I = (256, 192) if quant == "fp8_block" else (48, 40)
    tensors, kwargs = make_problem(9, H, I, 4, 3, quant=quant, bias=True, local_expert_offset=4,
                                   num_global_experts=12, invalid_ids=True, seed=5)
    out = check_experts(tensors, kwargs, FP8_TOL if quant != "none" else 1e-2)
    ids = tensors[1]
    local = ids.long() - 4
    no_local = ~((local >= 0) & (local < 4)).any(1)
    assert no_local.any() and (out[no_local] == 0).all()


@pytest.mark.parametrize("dispatch_path", ["direct", "small", "large"])
def test_experts_dispatch_paths(dispatch_path, monkeypatch, poisoned_empty):
    # direct: no dispatch; small: one-program dispatch; large: count/offsets/scatter
    if dispatch_path == "direct":
        monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS", 1 << 20)
        monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS_PER_EXPERT", 1e9)
    else:
        monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS", 0)
    if dispatch_path == "large":
        monkeypatch.setattr(align_mod, "SMALL_PATH_MAX_PAIRS", 0)
        monkeypatch.setattr(align_mod, "CHUNK_PAIRS", 16)
    tensors, kwargs = make_problem(10, 48, 40, 5, 3, local_expert_offset=2,
                                   num_global_experts=9, invalid_ids=True, seed=11)
    check_experts(tensors, kwargs, 1e-2)


def test_experts_all_tokens_one_expert(poisoned_empty):
    tensors, kwargs = make_problem(40, 48, 40, 4, 2, all_to_one=True, seed=3)
    check_experts(tensors, kwargs, 1e-2, gemm1_config=GemmConfig(16, 32, 32, 8, 4, 2),
                  gemm2_config=GemmConfig(16, 32, 16, 1, 4, 2))


def test_experts_single_token(poisoned_empty):
    tensors, kwargs = make_problem(1, 48, 40, 8, 4, activation="swiglu_oai", bias=True, seed=1)
    check_experts(tensors, kwargs, 1e-2)


def test_experts_no_tokens():
    tensors, kwargs = make_problem(0, 48, 40, 4, 2)
    out = triton_experts(*tensors, **kwargs)
    assert out.shape == (0, 48) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_experts_swap_ab_and_mixed_block_m(quant, poisoned_empty):
    # GEMM1 and GEMM2 with different block_m (the dispatch takes the larger), swap-AB on one
    H, I = (256, 192) if quant == "fp8_block" else (48, 40)
    tensors, kwargs = make_problem(20, H, I, 3, 2, quant=quant, seed=7)
    tol = FP8_TOL if quant != "none" else 1e-2
    check_experts(tensors, kwargs, tol,
                  gemm1_config=GemmConfig(32, 64, 32, 1, 4, 2, swap_ab=True),
                  gemm2_config=GemmConfig(16, 32, 64, 8, 4, 2))


def test_experts_fp8_long_k_decode_config(poisoned_empty):
    """The deep-K decode config of fp8 (256-wide K steps) on a reduction that is not a multiple
    of 256, so the masked last step is exercised."""
    tensors, kwargs = make_problem(3, 48, 320, 4, 2, quant="fp8", seed=5)
    check_experts(tensors, kwargs, FP8_TOL,
                  gemm2_config=GemmConfig(16, 64, 256, 8, 4, 5, swap_ab=True))


@pytest.mark.parametrize("quant,I,split_k,swap", [
    ("none", 40, 2, True), ("none", 200, 4, False), ("fp8", 320, 4, True),
    ("fp8_block", 384, 2, True), ("fp8_block", 320, 4, False)])
def test_experts_split_k_gemm2(quant, I, split_k, swap, poisoned_empty):
    """GEMM2 with its reduction split over programs that add into the fp32 output: uneven
    splits (K steps not a multiple of split_k, a masked last step, splits left empty), the bias
    added once, invalid ids."""
    H = 256 if quant == "fp8_block" else 48
    tensors, kwargs = make_problem(6, H, I, 4, 2, quant=quant, bias=True, invalid_ids=True,
                                   seed=13)
    check_experts(tensors, kwargs, FP8_TOL if quant != "none" else 1e-2,
                  gemm2_config=GemmConfig(16, 32, 64, 8, 4, 2, swap_ab=swap, split_k=split_k))


@pytest.mark.parametrize("promote_k,split_k", [(128, 1), (256, 1), (512, 2)])
def test_experts_fp8_deferred_promotion(promote_k, split_k, monkeypatch, poisoned_empty):
    """fp8 partial sums promoted every promote_k columns (K steps of 64: every 2 or 8 steps,
    the last promotion after the loop; with split-K per split)."""
    import moe_ops.kernels.grouped_gemm as gg
    monkeypatch.setattr(gg, "FP8_PROMOTE_K", promote_k)
    tensors, kwargs = make_problem(5, 200, 320, 4, 2, quant="fp8", bias=True, seed=17)
    check_experts(tensors, kwargs, FP8_TOL,
                  gemm1_config=GemmConfig(16, 64, 64, 8, 4, 2),
                  gemm2_config=GemmConfig(16, 32, 64, 8, 4, 2, swap_ab=True, split_k=split_k))


def test_split_k_only_for_gemm2():
    from moe_ops.kernels.grouped_gemm import config_problems
    p1 = GemmProblem(1, 8, 256, 128, 1.0, torch.bfloat16)
    p2 = GemmProblem(2, 8, 128, 128, 1.0, torch.bfloat16)
    assert config_problems(p1, GemmConfig(split_k=2))
    assert not config_problems(p2, GemmConfig(split_k=2))
    assert config_problems(p2, GemmConfig(split_k=3))


@pytest.mark.parametrize("combine,dtype", [("atomic", torch.float32), ("atomic", torch.bfloat16),
                                           ("rows", torch.float32)])
def test_experts_combine_modes(combine, dtype, monkeypatch, poisoned_empty):
    monkeypatch.setattr(experts_mod, "COMBINE", combine)
    tensors, kwargs = make_problem(8, 48, 40, 4, 2, dtype=dtype, bias=True,
                                   invalid_ids=True, seed=2)
    check_experts(tensors, kwargs, TOL[dtype])


@pytest.mark.parametrize("quant,activation,bias,combine,promote_k", [
    ("none", "swiglu", False, "auto", 256), ("none", "swiglu_oai", True, "atomic", 256),
    ("none", "relu2", True, "rows", 256), ("fp8", "swiglu", True, "auto", 256),
    ("fp8", "relu2", False, "atomic", 32), ("fp8_block", "swiglu", True, "auto", 256),
    ("fp8_block", "relu2", False, "rows", 256)])
def test_experts_persistent_tma(quant, activation, bias, combine, promote_k, monkeypatch,
                                gemm_calls, poisoned_empty):
    """The persistent TMA kernel (GemmConfig.persistent) on both GEMMs, GEMM1's rows gathered
    into dispatch order first: K not a multiple of block_k (TMA's zero fill), N not a multiple
    of block_n (tiles straddling two experts' weights), more tiles than programs, expert-
    parallel ids and ids of no local expert; fp8 with the partial sum promoted every 8 K steps
    and (promote_k = block_k) inside each dot; fp8_block over several scale groups. GEMM2 on it writes rows: "auto" picks them even
    where it would pick atomics for the tile kernel (threshold 0 here), and a forced "atomic"
    runs GEMM2 on the tile kernel."""
    import moe_ops.kernels.grouped_gemm as gg
    monkeypatch.setattr(experts_mod, "COMBINE", combine)
    monkeypatch.setattr(experts_mod, "ATOMIC_COMBINE_MIN_BYTES", 0)
    monkeypatch.setattr(gg, "FP8_PROMOTE_K", promote_k)
    persistent_gemms = gemm_calls(gg, "_launch_persistent")
    # fp8_block: several 128-column scale groups along both K (H = 272, I = 160) and weight
    # blocks along N, so a wrong scale index shows
    H, I = (272, 160) if quant == "fp8_block" else (80, 48)
    tensors, kwargs = make_problem(40, H, I, 4, 2, activation=activation, quant=quant,
                                   bias=bias, local_expert_offset=2, num_global_experts=8,
                                   invalid_ids=True, seed=23)
    config = GemmConfig(64, 64, 32, 2, 4, 2, persistent=True)
    a1 = tensors[0].to(tensors[3].dtype)  # GEMM1's operand (fp8 modes: the quantized x)
    assert gg.use_persistent(config, gg.Routing(tensors[1], tensors[2], 2, 4, 2,
                                                tensors[1], tensors[1]), a1, tensors[3])
    check_experts(tensors, kwargs, FP8_TOL if quant != "none" else 1e-2,
                  gemm1_config=config, gemm2_config=config)
    assert persistent_gemms == ([1] if combine == "atomic" else [1, 2])


@pytest.mark.parametrize("quant,activation,bias,swap,block_m", [
    ("none", "swiglu", True, True, 16), ("none", "relu2", False, False, 32),
    ("fp8", "swiglu", True, False, 16), ("fp8", "relu2", False, "gemm2", 32),
    ("fp8_block", "swiglu", False, True, 16), ("fp8_block", "geglu", True, False, 32)])
def test_experts_persistent_decode_tiles(quant, activation, bias, swap, block_m, monkeypatch,
                                         gemm_calls, poisoned_empty):
    """Decode's row tiles (block_m 16 / 32) on the persistent kernel, swapped (the weight tile on
    the MMA's M side) or not: GEMM1 reads its token rows by pointer (no gather_rows launch), K
    not a multiple of block_k (the rows' masked tail, TMA's zero fill for the weights), N not a
    multiple of block_n, more tiles than programs, padding slots, expert-parallel ids and ids
    of no local expert; fp8_block over several scale groups of K and N; fp8 per tensor with GEMM2
    alone swapped (grouped_gemm.fp8_swap_ok). One program an SM (four
    programs in the interpreter), so every program walks several tiles. (The mask of the rows'
    K tail only keeps the last row's loads in bounds: its values meet TMA's zero fill, so no
    result here depends on it; compute-sanitizer runs these tests on the GPU.)"""
    import moe_ops.kernels.grouped_gemm as gg
    monkeypatch.setattr(gg, "PERSISTENT_DECODE_PROGRAMS", 1)
    persistent_gemms = gemm_calls(gg, "_launch_persistent")
    gathers = gemm_calls(gg, "gather_rows", record="x", default="called")
    H, I = (272, 160) if quant == "fp8_block" else (80, 48)
    tensors, kwargs = make_problem(12, H, I, 4, 2, activation=activation, quant=quant,
                                   bias=bias, local_expert_offset=2, num_global_experts=8,
                                   invalid_ids=True, seed=31)
    config = GemmConfig(block_m, 64, 32, 2, 4, 2, swap_ab=swap is True, persistent=True)
    config2 = dataclasses.replace(config, swap_ab=bool(swap))
    assert gg.is_decode_persistent(config)
    assert not gg.config_problems(GemmProblem(1, 4, 2 * I, H, 6.0, torch.bfloat16, quant,
                                              activation != "relu2"), config)
    swaps = _record_swap_ab(monkeypatch, "_launch_persistent")
    check_experts(tensors, kwargs, FP8_TOL if quant != "none" else 1e-2,
                  gemm1_config=config, gemm2_config=config2)
    assert persistent_gemms == [1, 2]
    assert swaps == [swap is True, bool(swap)]
    assert gathers == []


def test_persistent_decode_programs_fit_shared_memory(monkeypatch):
    """A persistent launch never asks for more programs an SM than can be resident (one that
    cannot would wait for another's whole tile list): decode tiles up to
    PERSISTENT_DECODE_PROGRAMS, fewer for deep wide pipelines; prefill configs as before."""
    import moe_ops.kernels.grouped_gemm as gg
    monkeypatch.setattr(gg, "PERSISTENT_DECODE_PROGRAMS", 4)
    assert gg.persistent_programs_per_sm(GemmConfig(16, 64, 128, 8, 4, 4, persistent=True), 1) == 4
    wide = GemmConfig(16, 128, 128, 8, 4, 5, swap_ab=True, persistent=True)   # 184 KB at bf16
    assert gg.persistent_programs_per_sm(wide, 2) == 1
    assert gg.persistent_programs_per_sm(GemmConfig(64, 128, 128, 16, 4, 3, persistent=True), 1) == 2
    assert gg.persistent_programs_per_sm(GemmConfig(128, 256, 64, 16, 8, 3, persistent=True), 2) == 1
    monkeypatch.setattr(gg, "PERSISTENT_DECODE_PROGRAMS", 16)   # threads: 8 warps, 8 an SM
    assert gg.persistent_programs_per_sm(GemmConfig(16, 32, 32, 8, 8, 2, persistent=True), 1) == 8


def test_resident_programs_of_a_build(monkeypatch):
    """The launch's program count an SM from a compiled build: registers (allocated a warp in
    units of 256), shared memory (plus the driver's 1 KB a block) and threads, whichever is
    least (the figures of an fp8_block GEMM2 decode build on sm_90: 186 registers, two an SM);
    None where the build says nothing (the interpreter, an asynchronous compile)."""
    import types
    import moe_ops.kernels.grouped_gemm as gg
    props = types.SimpleNamespace(shared_memory_per_multiprocessor=233472,
                                  max_threads_per_multi_processor=2048)
    monkeypatch.setattr(gg, "device_properties", lambda device: props)

    def build(regs, shared):
        return types.SimpleNamespace(run=None, n_regs=regs,
                                     metadata=types.SimpleNamespace(shared=shared))
    cuda = torch.device("cuda", 0)
    assert gg._resident_programs(build(186, 45000), 4, cuda) == 2
    assert gg._resident_programs(build(98, 45000), 8, cuda) == 2
    assert gg._resident_programs(build(64, 45000), 4, cuda) == 5      # shared memory
    assert gg._resident_programs(build(32, 1000), 4, cuda) == 16      # threads
    assert gg._resident_programs(build(0, 1000), 4, cuda) is None
    assert gg._resident_programs(object(), 4, cuda) is None


@pytest.mark.parametrize("quant,dtype", [("nvfp4", torch.bfloat16), ("none", torch.float32)])
def test_explicit_persistent_config_is_refused_where_it_cannot_compute(quant, dtype):
    """The persistent kernel computes none / fp8 / fp8_block with 16-bit activations only: an
    explicit persistent config for another mode or dtype is refused, naming the argument, before any
    launch (use_persistent would quietly run it on the tile kernel)."""
    tensors, kwargs = make_problem(40, 128, 128, 4, 2, quant=quant, dtype=dtype, seed=43)
    config = GemmConfig(64, 64, 64, 2, 4, 2, persistent=True)
    with pytest.raises(ValueError, match="gemm2_config: persistent"):
        triton_experts(*tensors, **kwargs, gemm2_config=config)


@pytest.mark.parametrize("tokens,early", [(4, True), (256, True), (257, False), (1000, False)])
def test_pdl_early_launch_at_decode_sizes_only(tokens, early, monkeypatch, poisoned_empty):
    """Every launch of an experts call carries the PDL attribute iff the call routes at most
    PDL_MAX_PAIRS pairs (here top_k = 2: 256 tokens); outside a call the default (on) is back,
    and the kernels are the same either way (USE_PDL does not follow the scope)."""
    from moe_ops.kernels import common
    import moe_ops.kernels.grouped_gemm as gg
    assert experts_mod.PDL_MAX_PAIRS == 512
    monkeypatch.setattr(common, "_PDL_DISABLED", False)
    monkeypatch.setattr(common, "capability_at_least", lambda device, capability: True)
    seen = []
    options = common.pdl_launch_options

    def recording_options(device):
        got = options(device)
        seen.append(got.get("launch_pdl", False))
        return {}  # the interpreter's launcher takes no PDL attribute

    import moe_ops.kernels.act_quant as act_quant_mod
    import moe_ops.kernels.combine as combine_mod
    for module in (gg, align_mod, act_quant_mod, combine_mod):  # every launcher of the call
        monkeypatch.setattr(module, "pdl_launch_options", recording_options)
        monkeypatch.setattr(module, "use_pdl", lambda device: False)  # no PTX in the interpreter
    tensors, kwargs = make_problem(tokens, 32, 16, 4, 2, seed=41)
    check_experts(tensors, kwargs, 1e-2)
    assert seen and all(flag == early for flag in seen), seen
    assert options(torch.device(DEVICE)) == {"launch_pdl": True}


def _record_swap_ab(monkeypatch, launcher: str) -> list:
    """Wrap grouped_gemm's `launcher` (_launch or _launch_persistent) so that each launch
    appends its config's swap_ab to the returned list."""
    import moe_ops.kernels.grouped_gemm as gg
    launched = []
    launch = getattr(gg, launcher)

    def recording(*args, **kwargs):
        launched.append(args[7].swap_ab)
        return launch(*args, **kwargs)

    monkeypatch.setattr(gg, launcher, recording)
    return launched


@pytest.mark.parametrize("swap_allowed, split2", [(False, 1), (True, 1), (False, 2)])
def test_fp8_runs_swap_ab_tiles_unswapped(swap_allowed, split2, monkeypatch, poisoned_empty):
    """fp8 (per tensor): GEMM1's swap-AB config (explicit here; tuned ones alike) runs as its
    unswapped twin unless experts.FP8_SWAP_AB (its output's requantization amplifies the
    swapped fp8 wgmma's accumulation error); GEMM2's runs swapped; the result is right either
    way."""
    monkeypatch.setattr(experts_mod, "FP8_SWAP_AB", swap_allowed)
    launched = _record_swap_ab(monkeypatch, "_launch")
    tensors, kwargs = make_problem(5, 64, 48, 4, 2, quant="fp8", seed=47)
    config = GemmConfig(16, 64, 32, 8, 4, 2, swap_ab=True)
    config2 = dataclasses.replace(config, split_k=split2)   # (split: GEMM2's atomic form)
    check_experts(tensors, kwargs, FP8_TOL, gemm1_config=config, gemm2_config=config2)
    assert launched == [swap_allowed, True]
    # the same on the persistent kernel's decode tiles
    seen = _record_swap_ab(monkeypatch, "_launch_persistent")
    persistent = dataclasses.replace(config, persistent=True)
    check_experts(tensors, kwargs, FP8_TOL, gemm1_config=persistent, gemm2_config=persistent)
    assert seen == [swap_allowed, True]


def test_pdl_early_launch_scopes_nest(monkeypatch):
    """An outer pdl_early_launch(False) (a caller that wants no early launch anywhere) holds
    through an experts call's own pdl_early_launch(True); leaving each scope restores the one
    outside it."""
    from moe_ops.kernels import common
    monkeypatch.setattr(common, "_PDL_DISABLED", False)
    monkeypatch.setattr(common, "capability_at_least", lambda device, capability: True)
    device = torch.device("cuda")  # not touched: capability_at_least is replaced
    assert common.pdl_launch_options(device) == {"launch_pdl": True}
    with common.pdl_early_launch(False):
        with common.pdl_early_launch(True):
            assert common.pdl_launch_options(device) == {}
        assert common.pdl_launch_options(device) == {}
    with common.pdl_early_launch(True):
        assert common.pdl_launch_options(device) == {"launch_pdl": True}
        with common.pdl_early_launch(False):
            assert common.pdl_launch_options(device) == {}
        assert common.pdl_launch_options(device) == {"launch_pdl": True}


@pytest.mark.parametrize("rows_per_program", [1, 4, 32])
@pytest.mark.parametrize("quant", ["none", "fp8", "fp8_block"])
def test_gather_rows_puts_token_rows_in_dispatch_order(quant, rows_per_program, monkeypatch,
                                                       poisoned_empty):
    """gather_rows (GEMM1's rows for the persistent kernel): slot s of the live ones gets
    x[pair // top_k] (and its fp8 scale), padding slots zeros; slots past the live ones are never
    read, and left as they are. rows_per_program: align.GATHER_ROWS (32: a program's slots
    past the live count, its column steps narrower than a row)."""
    import moe_ops.kernels.grouped_gemm as gg
    from moe_ops.kernels import align
    monkeypatch.setattr(align, "GATHER_ROWS", rows_per_program)
    monkeypatch.setattr(align, "GATHER_STEP_ELEMENTS", 512)
    T, H, E, k = 37, 48 if quant != "fp8_block" else 272, 5, 3  # fp8_block: 3 scale groups
    g = torch.Generator().manual_seed(31)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE)
    ids = torch.randint(-1, E + 1, (T, k), generator=g).to(DEVICE)  # -1 / E: no local expert
    aligned = moe_align(ids, E, 16, 0)
    routing = gg.Routing(ids.reshape(-1), torch.ones(T * k, device=DEVICE), k, E, 0,
                         aligned.sorted_pair_ids, aligned.block_expert_ids, 16, aligned.num_padded)
    a, a_scale = (x, None) if quant == "none" else act_quant(x, quant)
    rows, scales = align.gather_rows(a, a_scale, routing)
    live = int(aligned.num_padded[0])
    assert rows.shape[0] > live and torch.isnan(rows[live:].float()).all()
    pairs = aligned.sorted_pair_ids[:live].long().cpu()
    valid = pairs < T * k
    tokens = (pairs // k).clamp(max=T - 1)
    want = torch.where(valid[:, None], a.cpu().float()[tokens], 0.0)
    assert torch.equal(rows[:live].cpu().float(), want)
    if quant != "none":
        want_scales = a_scale.cpu()[tokens]
        mask = valid if want_scales.dim() == 1 else valid[:, None]
        assert torch.equal(scales[:live].cpu(), torch.where(mask, want_scales, 0.0))
        assert torch.isnan(scales[live:]).all()


def test_persistent_config_falls_back_where_it_cannot_run(poisoned_empty):
    """A persistent config on a batch without dispatch (direct mode) or with rows TMA cannot
    address runs the tile kernel with the same tiles; the validity rules name what it needs."""
    tensors, kwargs = make_problem(1, 48, 40, 8, 4, seed=29)
    config = GemmConfig(64, 64, 32, 2, 4, 2, persistent=True)
    check_experts(tensors, kwargs, 1e-2, gemm1_config=config, gemm2_config=config)
    from moe_ops.kernels.grouped_gemm import config_problems
    nvfp4 = GemmProblem(1, 8, 256, 128, 300.0, torch.bfloat16, "nvfp4")
    assert any("persistent" in why for why in config_problems(nvfp4, config))
    odd_k = GemmProblem(2, 8, 256, 40, 300.0, torch.bfloat16, "fp8")  # 40 bytes a row
    assert any("TMA" in why for why in config_problems(odd_k, config))
    prefill = GemmProblem(1, 8, 256, 128, 300.0, torch.bfloat16)
    assert any("swap_ab" in why for why in config_problems(prefill, GemmConfig(
        64, 64, 32, 2, 4, 2, swap_ab=True, persistent=True)))
    # fp8's decode tiles, swapped or not (a swapped GEMM1 runs unswapped: experts.FP8_SWAP_AB)
    fp8 = GemmProblem(2, 8, 256, 128, 1.0, torch.bfloat16, "fp8")
    for swap in (False, True):
        assert not config_problems(fp8, GemmConfig(16, 64, 32, 2, 4, 2, swap_ab=swap,
                                                   persistent=True))


# ---------------------------------------------------------------- configs

def test_config_space_and_defaults():
    for quant in ("none", "fp8", "fp8_block"):
        for rows in (0.03, 1, 20, 100, 1000):
            for gemm, (n, k) in ((1, (2 * 768, 2048)), (2, (2048, 768))):
                problem = GemmProblem(gemm, 128, n, k, rows, torch.bfloat16, quant)
                default = default_config(problem)
                assert config_problems(problem, default) == []
                space = config_space(problem)
                assert space and all(config_problems(problem, c) == [] for c in space)
                if quant == "fp8_block":
                    assert all(128 % c.block_k == 0 for c in space)
    bad = GemmConfig(block_k=256)
    assert config_problems(GemmProblem(1, 8, 64, 256, 1, torch.bfloat16, "fp8_block"), bad)
    assert next_power_of_2(1) == 1 and next_power_of_2(17) == 32
