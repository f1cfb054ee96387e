"""Dynamic fp8 quantization of the activations that enter each grouped GEMM.

quant="fp8":       one scale per row,            s = amax(|row|) / 448
quant="fp8_block": one scale per row per 128 columns along K, s[r, g] = amax(|x[r, 128g:128g+128]|) / 448
q = round-to-e4m3(x * 448/amax), and a zero row (or group) gives s = 0, q = 0, never NaN.

The token rows of x are quantized once per token (not once per routed pair): GEMM1 gathers
the quantized rows by token. For GEMM2's input (the intermediate, one row per sorted position)
padding rows are skipped by reading sorted_pair_ids: those rows are masked out by GEMM2 anyway,
and at decode sizes they are most of the buffer.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from moe_ops.kernels.common import (
    FP8_BLOCK, cdiv, fp8_quantize, next_power_of_2, pdl_launch_options, pdl_prologue, use_pdl,
)
from moe_ops.kernels.env import env_choice, env_int


# fp8_quantize divides (v * 448) by amax: rows (or groups) with an amax below 2^-96 are first
# scaled by 2^64, with their amax (exact, and the quotient is the same), so that v * 448 is
# never a rounded float32 subnormal. Unscaled, amax >= 2^-96 keeps every value that can round to
# a non-zero e4m3 code (quotient >= 2^-10, so v * 448 >= 2^-106) normal; scaled, so does
# amax < 2^-96.
_TINY_AMAX = tl.constexpr(1.262177448353619e-29)  # 2^-96
_TINY_SCALE = tl.constexpr(1.8446744073709552e+19)  # 2^64


@triton.jit
def amax_factor(amax):
    """What a row's (or group's) values and amax are scaled by before fp8_quantize: 2^64 below
    an amax of 2^-96, else 1 (see _TINY_AMAX)."""
    return tl.where(amax < _TINY_AMAX, _TINY_SCALE, 1.0)


@triton.jit
def group_scale(amax):
    """A row's (or group's) scale from its amax: amax / 448 correctly rounded, as quant.py
    divides (Triton's `/` is approximate on the GPU)."""
    return tl.div_rn(amax, 448.0)


@triton.jit
def _quant_groups(x_row, q_row, s_row, k0, K, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8_block: columns [k0, k0 + BLOCK_K) of a row, one scale per GROUP_K of them."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    offs = tl.arange(0, BLOCK_K)
    mask = k0 + offs < K
    x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.reshape(x, (GROUPS, GROUP_K))
    amax = tl.max(tl.abs(x2), axis=1)
    factor = amax_factor(amax)[:, None]
    q, scale = fp8_quantize(x2 * factor, amax[:, None] * factor)
    tl.store(q_row + k0 + offs, tl.reshape(q, (BLOCK_K,)), mask=mask)
    g = k0 // GROUP_K + tl.arange(0, GROUPS)
    # the unscaled amax's scale (the quantized values are the same either way)
    tl.store(s_row + g, group_scale(amax), mask=g * GROUP_K < K)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, sorted_pair_ids_ptr,
    num_pairs, K,
    stride_xm, stride_qm, stride_sm,
    GROUP_K: tl.constexpr,      # 0: one scale per row; 128: one per 128 columns
    BLOCK_K: tl.constexpr,      # columns per step; a multiple of GROUP_K when grouped
    SPLIT_K: tl.constexpr,      # the columns spread over the grid's 2nd axis, one step each
    SKIP_PAD_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOAD_FIRST: tl.constexpr = False,
    SLICE_K: tl.constexpr = 0,  # fp8 SPLIT_K: > 0, program (row, s) quantizes columns of slice s
):
    """One row a program (grid (M,)), stepping over its columns; with SPLIT_K (few rows: the
    steps' load latencies add up, 1 us or so each) one step a program (grid (M, K / BLOCK_K)):
    fp8_block's groups are independent, and fp8's row takes BLOCK_K >= K (the whole row read
    once, its amax from registers). LOAD_FIRST (fp8's whole rows, SHORT_ROW_K): the row's load
    issued before its pair id is known, so the two latencies overlap (a padding row is read
    for nothing). SLICE_K (fp8, SPLIT_K): each of a row's cdiv(K, SLICE_K) programs reads the
    whole row for its amax and quantizes one slice of SLICE_K columns (the divisions of a long
    row spread over SMs; the same codes)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    if SKIP_PAD_ROWS and not LOAD_FIRST:
        # A sentinel (pair id == num_pairs) marks a padding row of the sorted layout.
        if tl.load(sorted_pair_ids_ptr + row) >= num_pairs:
            return
    row64 = row.to(tl.int64)
    x_row = x_ptr + row64 * stride_xm
    q_row = q_ptr + row64 * stride_qm
    s_row = scale_ptr + row64 * stride_sm
    offs = tl.arange(0, BLOCK_K)
    if GROUP_K == 0:
        if SPLIT_K:
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if SKIP_PAD_ROWS and LOAD_FIRST:
                if tl.load(sorted_pair_ids_ptr + row) >= num_pairs:
                    return
            row_amax = tl.max(tl.abs(x), axis=0)
            factor = amax_factor(row_amax)
            if SLICE_K > 0:
                cols = tl.program_id(1) * SLICE_K + tl.arange(0, SLICE_K)
                x_slice = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                q, scale = fp8_quantize(x_slice * factor, row_amax * factor)
                tl.store(q_row + cols, q, mask=cols < K)
            else:
                q, scale = fp8_quantize(x * factor, row_amax * factor)
                tl.store(q_row + offs, q, mask=mask)
        else:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            row_amax = tl.max(amax, axis=0)
            # two loops, so the common one carries no scaling multiply (the form measured)
            if row_amax >= _TINY_AMAX:
                for k0 in range(0, K, BLOCK_K):
                    mask = k0 + offs < K
                    x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                    q, scale = fp8_quantize(x, row_amax)
                    tl.store(q_row + k0 + offs, q, mask=mask)
            else:
                for k0 in range(0, K, BLOCK_K):
                    mask = k0 + offs < K
                    x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                    q, scale = fp8_quantize(x * _TINY_SCALE, row_amax * _TINY_SCALE)
                    tl.store(q_row + k0 + offs, q, mask=mask)
        # correctly rounded, as quant.py divides (Triton's `/` is approximate on the GPU)
        if SLICE_K == 0 or tl.program_id(1) == 0:
            tl.store(s_row, tl.div_rn(row_amax, 448.0))
    else:
        if SPLIT_K:
            _quant_groups(x_row, q_row, s_row, tl.program_id(1) * BLOCK_K, K, GROUP_K, BLOCK_K)
        else:
            for k0 in range(0, K, BLOCK_K):
                _quant_groups(x_row, q_row, s_row, k0, K, GROUP_K, BLOCK_K)


# Rows at or below which the columns are spread over programs (SPLIT_K), per quant mode: the
# looped form's load latencies, a microsecond or so per step, add up where too few rows fill the
# GPU (Mixtral's 2-row decode intermediate, 14336 wide: 8.3 us in
# results/h200_profile_layer.json). Measured (results/h200_act_quant_decode.json, CUDA-graph
# replays): fp8_block faster split up to the 512 rows tried (DeepSeek's x 7.4 -> 2.2 us at 1
# row, 10.9 -> 7.3 at 512); fp8 faster split up to 256 rows of 14336 (11.9 -> 10.3 us), slower
# at 512 (15.8 -> 17.9: one program a row then runs the whole row's divisions on one SM).
SPLIT_K_MAX_ROWS = {"fp8": 256, "fp8_block": 512}
# fp8 (one scale per row) reads a split row whole: at most this many columns.
WHOLE_ROW_MAX_K = 16384
# fp8 rows of at most SHORT_ROW_K columns read whole, one a program, whatever the row count,
# the row's load issued beside its pair id's (LOAD_FIRST), instead of the looped form's two
# passes after the pair id. Why: the looped form moves 1.1-1.2 TB/s on Qwen3-30B-A3B's
# 768-wide intermediate at T = 16384 (273 us of a 2166 us call, results/
# h200_profile_layer_issue3.json; h200_act_quant.json), as if each program waited out its
# dependent loads (pair id, the row, the row again) with little in flight; packing several
# rows to a program measured slower (h200_act_quant_rows_ab.json). Measured on an H200
# (results/h200_act_quant_short_*.json, h200_ab_aqshort_*.json, 2026-12-02): that intermediate
# 249 -> 216 us (1.21 -> 1.40 TB/s), the Qwen3 fp8 layer at T = 16384 2220-2230 -> 2182-2188 us
# in graph replays (two alternated passes), Mixtral's 4096- and 14336-wide rows untouched. So
# up to 2048 columns (Qwen3's hidden rows too); MOE_OPS_ACT_QUANT_SHORT_ROW_K=0: off.
SHORT_ROW_K = env_int("MOE_OPS_ACT_QUANT_SHORT_ROW_K", 2048)
# Warps of a short row's program (0: the whole-row rule below, 4 for rows of up to 4096
# columns). The short-row form moves 1.3-1.4 TB/s on Qwen3's intermediate, and at 4 warps an
# SM holds 16 of its programs (the 2048 threads); the sm_90 builds of its 1024-column block
# take 32 / 48 / 80 registers at 4 / 2 / 1 warps (no stack), so 21 programs an SM at 2 warps
# and 25 at 1. The codes and scales are the same at any count. Measured on an H200 (`bash
# benchmarks/h200_run.sh aqwarps`, results/h200_act_quant_warps_*_twentyfourth.log,
# h200_ab_aqwarps_*_twentyfourth.json): that intermediate at T = 16384 215 / 249 / 313 us at
# 4 / 1 / 2 warps, the Qwen3 fp8 layer 1-5% slower with either: more resident programs do not
# move more bytes. So 0 (the rule's 4).
SHORT_ROW_WARPS = int(env_choice("MOE_OPS_ACT_QUANT_SHORT_WARPS", "0",
                                  ("0", "1", "2", "4", "8", "16")))
# fp8 rows read whole (SPLIT_K) wider than SLICE_K columns, at most SLICE_MAX_ROWS live rows:
# each row's columns quantized by cdiv(K, SLICE_K) programs, each reading the whole row for its
# amax. Why: one program a row runs all of the row's correctly rounded divisions on one SM
# (Llama 4 Scout's 5120-wide x: 5.6 us for one row, Mixtral's 14336-wide intermediate 6.1 us
# for two; results/h200_act_quant_decode.log), against ~2 us for a short row. The rows' extra
# reads come from the L2, hence the row bound. Measured on an H200 (results/
# h200_ab_aqslice_*.json, 2026-12-02, graph replays, two alternated passes, 0 -> 2048): Mixtral
# fp8 T = 1 104.0 -> 99.4 us, T = 4 238.2 -> 234.8, T = 16 347 -> 344; Llama 4 fp8 T = 1 49.6
# -> 46.2, T = 4 132.3 -> 128.6, T = 16 316.2 -> 313.0; bit for bit the one-program form.
# MOE_OPS_ACT_QUANT_SLICE_K=0: off.
SLICE_K = env_int("MOE_OPS_ACT_QUANT_SLICE_K", 2048)
if SLICE_K and (SLICE_K < 16 or SLICE_K & (SLICE_K - 1)):
    raise ValueError(f"MOE_OPS_ACT_QUANT_SLICE_K must be 0 or a power of two >= 16, "
                     f"got {SLICE_K}")
SLICE_MAX_ROWS = 64


def act_quant(
    x: torch.Tensor,
    quant: str,
    sorted_pair_ids: Optional[torch.Tensor] = None,
    num_pairs: int = 0,
    split_k: Optional[bool] = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of x [M, K] to (q float8_e4m3fn [M, K], scales float32).

    scales: [M] for quant="fp8", [M, ceil(K/128)] for "fp8_block". With sorted_pair_ids given,
    rows whose pair id is the sentinel (>= num_pairs) are skipped and left unwritten. split_k:
    the kernel's form (None: SPLIT_K for at most SPLIT_K_MAX_ROWS[quant] live rows: num_pairs
    with sorted_pair_ids, whose padded buffer is mostly sentinels at decode sizes, else M; and
    fp8 rows of at most SHORT_ROW_K columns); the same bytes either way. out_dtype float16: q
    holds the same e4m3 values as f16 (exact; the fp8 decode kernel multiplies them as f16,
    ws_fp4's fp8 form).
    """
    if out_dtype not in (torch.float8_e4m3fn, torch.float16):
        raise ValueError(f"out_dtype: float8_e4m3fn or float16, got {out_dtype}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    load_first = False
    live_rows = min(M, num_pairs) if sorted_pair_ids is not None else M
    if split_k is None:
        split_k = live_rows <= SPLIT_K_MAX_ROWS[quant]
        if not split_k and quant == "fp8" and K <= SHORT_ROW_K:
            split_k = load_first = True
    if quant == "fp8":
        scales = torch.empty((M,), dtype=torch.float32, device=x.device)
        split_k = split_k and K <= WHOLE_ROW_MAX_K
        group_k, stride_sm = 0, 1
        block_k = next_power_of_2(K) if split_k else min(next_power_of_2(K), 2048)
        # the whole row: about 32 values a thread
        num_warps = (min(16, max(4, block_k // 1024)) if split_k
                     else 4 if block_k >= 512 else 1)
        if load_first and SHORT_ROW_WARPS:
            num_warps = SHORT_ROW_WARPS
        slice_k = (SLICE_K if split_k and not load_first and 0 < SLICE_K < K
                   and live_rows <= SLICE_MAX_ROWS else 0)
    else:
        scales = torch.empty((M, cdiv(K, FP8_BLOCK)), dtype=torch.float32, device=x.device)
        group_k = FP8_BLOCK
        block_k = FP8_BLOCK * min(next_power_of_2(cdiv(K, FP8_BLOCK)), 8)
        stride_sm = scales.stride(0)
        num_warps = 4 if block_k >= 512 else 1
        slice_k = 0
    if M == 0:
        return q, scales
    skip = sorted_pair_ids is not None
    grid = (M, cdiv(K, slice_k or block_k)) if split_k else (M,)
    _act_quant_kernel[grid](
        x, q, scales, sorted_pair_ids if skip else x,
        num_pairs, K,
        x.stride(0), q.stride(0), stride_sm,
        GROUP_K=group_k, BLOCK_K=block_k, SPLIT_K=split_k, SKIP_PAD_ROWS=skip,
        num_warps=num_warps, LOAD_FIRST=load_first, SLICE_K=slice_k,
        USE_PDL=use_pdl(x.device), **pdl_launch_options(x.device),
    )
    return q, scales
