"""Dynamic fp8 quantization of the activations that enter each grouped GEMM.

quant="fp8":       one scale per row,            s = amax(|row|) / 448
quant="fp8_block": one scale per row per 128 columns along K, s[r, g] = amax(|x[r, 128g:128g+128]|) / 448
q = round-to-e4m3(x * 448/amax), and a zero row (or group) gives s = 0, q = 0, never NaN.

The token rows of x are quantized once per token (not once per routed pair): GEMM1 gathers
the quantized rows by token. For GEMM2's input (the intermediate, one row per sorted position)
padding rows are skipped by reading sorted_pair_ids: those rows are masked out by GEMM2 anyway,
and at decode sizes they are most of the buffer.

The quotient x * 448 / amax is float32's correctly rounded one, as quant.py's: on a GPU with its
own e4m3 cast, for bf16 / fp16 rows, by one reciprocal a row and an fma correction a value
(fp8_quantize_short), elsewhere by a correctly rounded division a value (fp8_quantize).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from moe_ops.kernels import INTERPRET
from moe_ops.kernels.common import (
    FP8_BLOCK, capability_at_least, cdiv, fp8_quantize, next_power_of_2, pdl_launch_options,
    pdl_prologue, use_pdl,
)
from moe_ops.kernels.env import env_choice, env_int


# fp8_quantize divides (v * 448) by amax: rows (or groups) with an amax below 2^-96 are first
# scaled by 2^64, with their amax (exact, and the quotient is the same), so that v * 448 is
# never a rounded float32 subnormal. Unscaled, amax >= 2^-96 keeps every value that can round to
# a non-zero e4m3 code (quotient >= 2^-10, so v * 448 >= 2^-106) normal; scaled, so does
# amax < 2^-96.
_TINY_AMAX = tl.constexpr(1.262177448353619e-29)  # 2^-96
_TINY_SCALE = tl.constexpr(1.8446744073709552e+19)  # 2^64
# fp8_quantize_short's amax range ends here: v * 448 stays finite (past 2^119 it overflows to inf,
# as in quant.py, and fp8_quantize gives that inf's 448).
_HUGE_AMAX = tl.constexpr(1.2676506002282294e+30)  # 2^100


def hw_e4m3(device: torch.device) -> bool:
    """Whether the GPU converts float32 -> e4m3 itself (cvt.rn.satfinite.e4m3x2.f32, sm_89+);
    never in the interpreter (whose float8 cast rounds wrongly: round_to_e4m3_grid)."""
    return capability_at_least(device, (8, 9))


@triton.jit
def fp8_quantize_short(v, amax, inv):
    """fp8_quantize's codes, for bf16 / fp16 values v of a row (or group) whose amax lies in
    [2^-96, 2^100), with inv = tl.div_rn(1.0, amax) taken once a row; on a GPU that converts to
    e4m3 itself (hw_e4m3) only.

    Why: the correctly rounded division of every value was most of act_quant's instructions
    (~43 a value on an sm_90 build, the kernel issue-bound below half the DRAM rate). Here
    (v * 448) / amax is rounded correctly by one quotient and one correction step (Markstein):
    y0 = a * inv, r = a - y0 * amax (exact, by fma), y = y0 + r * inv (fma), a = v * 448 exact.
    That y is float32's correct rounding of a / amax is checked over every pair of significands
    of bf16 and fp16 (tests/test_act_quant_division.py; the quotient's rounding only depends on
    them away from float32's overflow and underflow: the amax range keeps overflow out, and
    quotients below 2^-10 round to an e4m3 zero whatever y0 and r are; r may be a float32
    subnormal for an amax near 2^-96, exact still, a multiple of 2^-140, as long as
    subnormals are kept: the build has no .ftz, which the test checks), not for float32
    values, which take fp8_quantize. The hardware cast rounds to nearest even and saturates
    to +-448, fp8_quantize's clamp and grid rounding; the codes are fp8_quantize's for finite
    values (a NaN value gives a NaN code here, -448 there; neither is quant.py's NaN row)."""
    a = v * 448.0
    y0 = a * inv
    r = tl.fma(y0, -amax, a)
    return tl.fma(r, inv, y0).to(tl.float8e4nv)


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
def short_division_admits(amax_min, amax_max, FAST_DIV: tl.constexpr):
    """Whether values whose row (or group) amaxes lie in [amax_min, amax_max] may take
    fp8_quantize_short: FAST_DIV (bf16 / fp16 values on a GPU converting to e4m3 itself) and the
    amaxes in its range (a zero row or group, a tiny or a huge one: fp8_quantize)."""
    if FAST_DIV:
        return (amax_min >= _TINY_AMAX) & (amax_max < _HUGE_AMAX)
    else:
        return False


@triton.jit
def quantize_any(v, amax):
    """fp8_quantize's codes for any amax (broadcast against v): rows or groups of an amax below
    2^-96 scaled by 2^64 first (see _TINY_AMAX)."""
    factor = amax_factor(amax)
    q, _ = fp8_quantize(v * factor, amax * factor)
    return q


@triton.jit
def store_codes(ptrs, mask, v, amax, amax_min, amax_max, FAST_DIV: tl.constexpr):
    """Store the e4m3 codes of v (amax: its rows' or groups', broadcast against it):
    fp8_quantize_short where short_division_admits(amax_min, amax_max), else quantize_any.
    Each branch stores its own codes: float8 values yielded out of a branch came out wrong,
    one of each thread's 8, on an H200 with Triton 3.6."""
    if short_division_admits(amax_min, amax_max, FAST_DIV):
        tl.store(ptrs, fp8_quantize_short(v, amax, tl.div_rn(1.0, amax)), mask=mask)
    else:
        tl.store(ptrs, quantize_any(v, amax), mask=mask)


@triton.jit
def _quant_groups(x_row, q_row, s_row, k0, K, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  FAST_DIV: tl.constexpr):
    """fp8_block: columns [k0, k0 + BLOCK_K) of a row, one scale per GROUP_K of them."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    # A 2-d tile, not a reshaped row: Triton then lays each thread's values along one group
    # (16-byte loads, a group's amax and reciprocal from few threads); the reshaped row gave
    # every thread one value of each group, loaded 2 bytes at a time.
    offs = k0 + tl.arange(0, GROUPS)[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    mask = offs < K
    x2 = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x2), axis=1)
    # (columns past K load as zeros: a whole group of them has a zero amax, which sends the
    # step to quantize_any; a K that is a multiple of BLOCK_K, DeepSeek's 7168 and 2048, has
    # none)
    store_codes(q_row + offs, mask, x2, amax[:, None], tl.min(amax, axis=0),
                tl.max(amax, axis=0), FAST_DIV)
    g = k0 // GROUP_K + tl.arange(0, GROUPS)
    # the unscaled amax's scale (the quantized values are the same either way)
    tl.store(s_row + g, group_scale(amax), mask=g * GROUP_K < K)


@triton.jit
def _quant_short_rows(program, x_ptr, q_ptr, scale_ptr, sorted_pair_ids_ptr, num_pairs, M, K,
                      stride_xm, stride_qm, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                      SKIP_PAD_ROWS: tl.constexpr, FAST_DIV: tl.constexpr):
    """fp8: rows [ROWS * program, + ROWS), each read whole (K <= BLOCK_K), loaded together and
    before their pair ids are known (padding rows are read for nothing, written not)."""
    rows = program * ROWS + tl.arange(0, ROWS)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :],
                mask=(rows < M)[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
    live = rows < M
    if SKIP_PAD_ROWS:
        live = live & (tl.load(sorted_pair_ids_ptr + rows, mask=rows < M, other=num_pairs)
                       < num_pairs)
    amax = tl.max(tl.abs(x), axis=1)
    # a padding row's amax (unwritten memory) does not send the live ones to quantize_any
    live_amax = tl.where(live, amax, 1.0)
    store_codes(q_ptr + rows64[:, None] * stride_qm + cols[None, :],
                live[:, None] & (cols < K)[None, :], x, amax[:, None],
                tl.min(live_amax, axis=0), tl.max(live_amax, axis=0), FAST_DIV)
    tl.store(scale_ptr + rows64, tl.div_rn(amax, 448.0), mask=live)


@triton.jit
def quantize_rows_program(
    program, part, x_ptr, q_ptr, scale_ptr, sorted_pair_ids_ptr, num_pairs, M, K,
    stride_xm, stride_qm, stride_sm,
    GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SKIP_PAD_ROWS: tl.constexpr, LOAD_FIRST: tl.constexpr, SLICE_K: tl.constexpr,
    FAST_DIV: tl.constexpr, ROWS: tl.constexpr,
):
    """One program of act_quant's grid, (program, part) its ids on the grid's two axes (a
    function of its own so that another launch can run these programs beside its own: the
    routing kernel quantizes x so at decode, kernels/routing.py).

    One row a program (grid (M,)), stepping over its columns; with SPLIT_K (few rows: the
    steps' load latencies add up, 1 us or so each) one step a program (grid (M, K / BLOCK_K)):
    fp8_block's groups are independent, and fp8's row takes BLOCK_K >= K (the whole row read
    once, its amax from registers). LOAD_FIRST (fp8's whole rows, SHORT_ROW_K): the row's load
    issued before its pair id is known, so the two latencies overlap (a padding row is read
    for nothing). SLICE_K (fp8, SPLIT_K): each of a row's cdiv(K, SLICE_K) programs reads the
    whole row for its amax and quantizes one slice of SLICE_K columns (the divisions of a long
    row spread over SMs; the same codes). ROWS (fp8's short rows, LOAD_FIRST): ROWS rows a
    program, loaded together (_quant_short_rows). FAST_DIV: bf16 / fp16 values on a GPU that
    converts to e4m3 itself, whose rows (groups) in range take fp8_quantize_short."""
    if ROWS > 1:
        _quant_short_rows(program, x_ptr, q_ptr, scale_ptr, sorted_pair_ids_ptr, num_pairs, M,
                          K, stride_xm, stride_qm, ROWS, BLOCK_K, SKIP_PAD_ROWS, FAST_DIV)
        return
    row = program
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
            if SLICE_K > 0:
                cols = part * SLICE_K + tl.arange(0, SLICE_K)
                x_slice = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                store_codes(q_row + cols, cols < K, x_slice, row_amax, row_amax, row_amax,
                            FAST_DIV)
            else:
                store_codes(q_row + offs, mask, x, row_amax, row_amax, row_amax, FAST_DIV)
        else:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            row_amax = tl.max(amax, axis=0)
            # three loops, so the common ones carry no scaling multiply (the form measured)
            if short_division_admits(row_amax, row_amax, FAST_DIV):
                inv = tl.div_rn(1.0, row_amax)
                for k0 in range(0, K, BLOCK_K):
                    mask = k0 + offs < K
                    x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                    tl.store(q_row + k0 + offs, fp8_quantize_short(x, row_amax, inv), mask=mask)
            elif row_amax >= _TINY_AMAX:
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
        if SLICE_K == 0 or part == 0:
            tl.store(s_row, tl.div_rn(row_amax, 448.0))
    else:
        if SPLIT_K:
            _quant_groups(x_row, q_row, s_row, part * BLOCK_K, K, GROUP_K, BLOCK_K,
                          FAST_DIV)
        else:
            for k0 in range(0, K, BLOCK_K):
                _quant_groups(x_row, q_row, s_row, k0, K, GROUP_K, BLOCK_K, FAST_DIV)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, sorted_pair_ids_ptr,
    num_pairs, M, K,
    stride_xm, stride_qm, stride_sm,
    GROUP_K: tl.constexpr,      # 0: one scale per row; 128: one per 128 columns
    BLOCK_K: tl.constexpr,      # columns per step; a multiple of GROUP_K when grouped
    SPLIT_K: tl.constexpr,      # the columns spread over the grid's 2nd axis, one step each
    SKIP_PAD_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOAD_FIRST: tl.constexpr = False,
    SLICE_K: tl.constexpr = 0,  # fp8 SPLIT_K: > 0, program (row, s) quantizes columns of slice s
    FAST_DIV: tl.constexpr = False,  # fp8_quantize_short where the amax admits it
    ROWS: tl.constexpr = 1,  # fp8 LOAD_FIRST: > 1, rows a program (grid (cdiv(M, ROWS),))
):
    """The launch of act_quant's grid: quantize_rows_program at this program's ids."""
    pdl_prologue(USE_PDL)
    quantize_rows_program(tl.program_id(0), tl.program_id(1), x_ptr, q_ptr, scale_ptr,
                          sorted_pair_ids_ptr, num_pairs, M, K, stride_xm, stride_qm, stride_sm,
                          GROUP_K, BLOCK_K, SPLIT_K, SKIP_PAD_ROWS, LOAD_FIRST, SLICE_K,
                          FAST_DIV, ROWS)


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
# bf16 / fp16 rows quantized by fp8_quantize_short (one correction step on a quotient by the
# row's reciprocal) instead of a correctly rounded division a value; the same codes (see its
# doc; the sm_90 build of the short-row form: ~43 instructions a value before, most of them
# the division's). Measured on an H200 (`bash benchmarks/h200_run.sh aqdiv`, results/
# h200_act_quant_div*_twentyfifth.*, h200_ab_aqdiv_*_twentyfifth.json; one row a program):
# every input of dev_act_quant.py bit for bit, random and midpoint rows; Qwen3's intermediate
# 215 -> 162 us, DeepSeek-V3's x 144 -> 115 and intermediate 332 -> 253, Mixtral's x 84 -> 56
# and intermediate 561 -> 516, decode sizes up to 6 us faster; the fp8 / fp8_block layers 1.1%
# faster in the geometric mean of 16 points (Qwen3 fp8 T = 1 7%, T = 16384 2.5%; the runs'
# spread is 2-3%; an A/B on which the tuner's tables did not apply, so relative figures).
# MOE_OPS_ACT_QUANT_SHORT_DIVISION=0: off.
SHORT_DIVISION = env_choice("MOE_OPS_ACT_QUANT_SHORT_DIVISION", "1", ("0", "1")) == "1"
# fp8 rows wider than WIDE_ROW_K columns (and at most WHOLE_ROW_MAX_K) read whole (SPLIT_K, 16
# warps a row) at any row count, not only up to SPLIT_K_MAX_ROWS: its one-program rows were
# slower than the looped form's two passes at 512 rows while each value took a correctly
# rounded division; with the short division (dev_act_quant.py --forms / --decode on an H200,
# results/h200_act_quant_forms_twentyfifth.log, h200_act_quant_div_decode_twentyfifth.log)
# Mixtral's 14336-wide intermediate at T = 16384 (32768 rows) 516 -> 351 us, at 512 rows
# 10.0 -> 8.9 us, bit for bit; 4096-wide rows (Mixtral's x) stay faster looped (56 against
# 63 us). Llama 4's 8192-wide intermediate, not measured, stays looped; the layers with the
# rule not yet measured. Where the short division applies only (act_quant: short_forms).
# MOE_OPS_ACT_QUANT_WIDE_ROW_K=0: off.
WIDE_ROW_K = env_int("MOE_OPS_ACT_QUANT_WIDE_ROW_K", 8192)
# Short rows (SHORT_ROW_K) a program, loaded together. Why: with one 768-wide row a program an
# SM holds 16 programs' loads, ~24 KB, in flight, and the kernel moved 1.9 TB/s (Qwen3-30B-A3B's
# intermediate at T = 16384, with the short division): latency-bound. Packing rows measured
# slower when the divisions bound the kernel (results/h200_act_quant_rows_ab.json); without
# them, on an H200 (`bash benchmarks/h200_run.sh aqdiv`, results/h200_act_quant_rows_*_
# twentyfifth.log, h200_ab_aqrows_*_twentyfifth.json): that intermediate 162 -> 90 / 85.5 /
# 90.5 us at 2 / 4 / 8 rows (3.4-3.5 TB/s, bit for bit), the Qwen3 fp8 layer at T = 1024 / 4096
# / 16384 2.7 / 2-3 / 3-3.4% faster at 2 (4: about the same, 0.4% slower at 16384), T = 64
# equal (an A/B on which the tuner's tables did not apply: relative figures). So 2, where the
# short division applies (act_quant: short_forms); MOE_OPS_ACT_QUANT_SHORT_ROWS=1: one a
# program. SHORT_ROW_WARPS then does not apply (its 1 or 2 warps would hold up to 8 rows).
SHORT_ROWS = int(env_choice("MOE_OPS_ACT_QUANT_SHORT_ROWS", "2", ("1", "2", "4", "8")))


def _block(quant: str, k: int, split_k: bool) -> Tuple[int, int]:
    """(GROUP_K, BLOCK_K) of a launch on rows of k columns: fp8 a whole row (split_k) or steps
    of at most 2048 columns; fp8_block up to 8 groups of 128 a step."""
    if quant == "fp8":
        return 0, next_power_of_2(k) if split_k else min(next_power_of_2(k), 2048)
    return FP8_BLOCK, FP8_BLOCK * min(next_power_of_2(cdiv(k, FP8_BLOCK)), 8)


@dataclasses.dataclass(frozen=True)
class QuantLaunch:
    """act_quant's kernel launch for one input: its grid, warps and constexprs (the same codes
    whichever kernel runs the programs: _act_quant_kernel, or the routing kernel beside its
    own programs)."""
    grid: tuple
    num_warps: int
    stride_sm: int
    constexprs: dict

    @property
    def programs(self) -> int:
        return self.grid[0] * (self.grid[1] if len(self.grid) > 1 else 1)


def plan(
    x: torch.Tensor,
    quant: str,
    sorted_pair_ids: Optional[torch.Tensor] = None,
    num_pairs: int = 0,
    split_k: Optional[bool] = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
) -> Tuple[torch.Tensor, torch.Tensor, QuantLaunch]:
    """act_quant's outputs (allocated, not yet written) and the launch that writes them."""
    if out_dtype not in (torch.float8_e4m3fn, torch.float16):
        raise ValueError(f"out_dtype: float8_e4m3fn or float16, got {out_dtype}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    load_first = False
    live_rows = min(M, num_pairs) if sorted_pair_ids is not None else M
    fast_div = (SHORT_DIVISION and x.dtype in (torch.bfloat16, torch.float16)
                and hw_e4m3(x.device))
    # The forms measured faster with the short division only (packed short rows, wide rows
    # whole): with a division a value they were slower. The interpreter, which has no short
    # division, runs them for bf16 / fp16 rows as the GPU does, to test them.
    short_forms = fast_div or (INTERPRET and SHORT_DIVISION
                               and x.dtype in (torch.bfloat16, torch.float16))
    if split_k is None:
        split_k = live_rows <= SPLIT_K_MAX_ROWS[quant]
        if not split_k and quant == "fp8" and K <= SHORT_ROW_K:
            split_k = load_first = True
        elif not split_k and quant == "fp8" and short_forms and 0 < WIDE_ROW_K < K:
            split_k = True
    if quant == "fp8":
        scales = torch.empty((M,), dtype=torch.float32, device=x.device)
        split_k = split_k and K <= WHOLE_ROW_MAX_K
        load_first = load_first and split_k
        group_k, block_k = _block(quant, K, split_k)
        stride_sm = 1
        # the whole row: about 32 values a thread
        num_warps = (min(16, max(4, block_k // 1024)) if split_k
                     else 4 if block_k >= 512 else 1)
        if load_first and SHORT_ROW_WARPS and not (short_forms and SHORT_ROWS > 1):
            num_warps = SHORT_ROW_WARPS
        slice_k = (SLICE_K if split_k and not load_first and 0 < SLICE_K < K
                   and live_rows <= SLICE_MAX_ROWS else 0)
    else:
        scales = torch.empty((M, cdiv(K, FP8_BLOCK)), dtype=torch.float32, device=x.device)
        group_k, block_k = _block(quant, K, split_k)
        stride_sm = scales.stride(0)
        num_warps = 4 if block_k >= 512 else 1
        slice_k = 0
    rows = SHORT_ROWS if load_first and short_forms else 1
    grid = ((cdiv(M, rows),) if rows > 1 else (M, cdiv(K, slice_k or block_k)) if split_k
            else (M,))
    constexprs = dict(GROUP_K=group_k, BLOCK_K=block_k, SPLIT_K=split_k,
                      SKIP_PAD_ROWS=sorted_pair_ids is not None, LOAD_FIRST=load_first,
                      SLICE_K=slice_k, FAST_DIV=fast_div, ROWS=rows)
    return q, scales, QuantLaunch(grid, num_warps, stride_sm, constexprs)


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
    q, scales, launch = plan(x, quant, sorted_pair_ids, num_pairs, split_k, out_dtype)
    M, K = x.shape
    if M == 0:
        return q, scales
    _act_quant_kernel[launch.grid](
        x, q, scales, sorted_pair_ids if sorted_pair_ids is not None else x,
        num_pairs, M, K,
        x.stride(0), q.stride(0), launch.stride_sm,
        **launch.constexprs, num_warps=launch.num_warps,
        USE_PDL=use_pdl(x.device), **pdl_launch_options(x.device),
    )
    return q, scales


def compile_sm90(*, quant: str = "fp8", k: int = 768, split_k: bool = True,
                 load_first: bool = False, slice_k: int = 0, fast_div: bool = True,
                 rows: int = 1, num_warps: int = 4):
    """Build the kernel for sm_90 without a GPU (ptxas from the Triton wheel; not under
    TRITON_INTERPRET): bf16 rows of k columns with sorted pair ids, the block act_quant takes for
    them. Returns triton's CompiledKernel."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    group_k, block_k = _block(quant, k, split_k)
    consts = dict(GROUP_K=group_k, BLOCK_K=block_k, SPLIT_K=split_k, SKIP_PAD_ROWS=True,
                  USE_PDL=True, LOAD_FIRST=load_first, SLICE_K=slice_k, FAST_DIV=fast_div,
                  ROWS=rows)
    types = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", sorted_pair_ids_ptr="*i32")
    signature = {name: "constexpr" if name in consts else types.get(name, "i32")
                 for name in inspect.signature(_act_quant_kernel.fn).parameters}
    # the launcher's specialization: 16-byte aligned pointers, strides and K multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name] != "constexpr"
             and (name.endswith("_ptr") or name.startswith("stride") or name == "K")}
    return triton.compile(ASTSource(fn=_act_quant_kernel, signature=signature, constexprs=consts,
                                    attrs=attrs),
                          target=GPUTarget("cuda", 90, 128), options=dict(num_warps=num_warps))
