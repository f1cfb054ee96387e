"""Weight preparation on the device: quantize a checkpoint matrix and write it straight into the
kernel layout through its cached row permutation (moe_ops.layout), in one pass.

Weight preparation is a pure streaming job (read the checkpoint once, write the kernel layout
once), so the kernels here read a tile of checkpoint rows, quantize it in registers and store
the quantized rows (and their scales) at the rows the permutation index names. Nothing the size
of a weight is ever materialized: the plain-torch route (moe_ops.quant's reference functions,
then `index_copy_`) makes several float32 copies of each tensor and is many times slower.
Packed 4-bit rows are written in the GEMMs' kernel order (moe_ops.quant, "The kernel order of
packed e2m1 rows"), from float weights (quantize_scatter: each code shifted straight to its bits
of a kernel-order word, _fp4_word) or from pre-quantized natural packed rows (scatter_fp4_rows:
the nibbles re-paired in each thread's registers, _kernel_order_runs, and each word's bits
permuted, _permute_fp4_word).

The quantization math is moe_ops.quant's, operation for operation, so the bytes are identical:
- every division the reference does is a correctly rounded one here (`tl.div_rn`; Triton's `/`
  on float32 is an approximate division on the GPU), and `scalar / tensor`, which torch computes
  as `tensor.reciprocal() * scalar`, is computed that way;
- float32 -> e4m3 is the GPU's own conversion (cvt.rn.satfinite: round to nearest even,
  saturating at 448, which is quant._to_fp8's clamp-then-cast), one instruction per two values;
  in the interpreter (whose float8 cast rounds wrongly, see common.round_to_e4m3_grid) and on
  GPUs without that instruction it is emulated bit for bit (`_e4m3_bits`);
- float32 -> e2m1 is quant.e2m1_encode's rounding, done by float fmas (`_e2m1_bits`);
- nvfp4's per-block inverse scale is looked up in a per-expert table of quant.quantize_nvfp4's
  own expressions (`_nvfp4_inverse_table`, or the same operations in _nvfp4_fused_kernel);
- fp8's per-expert factor (448/amax) is computed by the launcher with the reference's own torch
  expression, from an amax reduced here (a max is exact in any order); nvfp4's (global scale, its
  inverse and the inverse table) likewise, or, with NVFP4_FUSED_AMAX on (measured slower, off),
  in the quantizing launch itself (quantize_scatter_nvfp4: amax programs ahead of the quantize
  programs of each expert, the last one of an expert computing its factors with the reference's
  operations and releasing the expert's quantize programs through a flag);
- launches disable FMA contraction, so no multiply-add is fused into a differently rounded op
  (the explicit `tl.fma`s below are exact products plus one rounding, as intended).

Weights are finite (as moe_ops.quant assumes): NaN handling is not reproduced.

Where the time goes: these kernels must run at memory bandwidth, so the per-element work is kept
to a handful of instructions (hardware e4m3 conversion, e2m1 codes by float adds and mins rather
than comparisons and integer sums, bf16 pairs widened by a shift and a mask), the per-element
address math is 32-bit (64-bit only per row and per expert), and tiles that divide the matrix
evenly are loaded and stored without masks.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moe_ops import quant as q
from moe_ops.kernels import INTERPRET
from moe_ops.kernels.act_quant import hw_e4m3
from moe_ops.kernels.common import (
    capability_at_least, cdiv, next_power_of_2, round_to_e4m3_grid,
)

# ---------------------------------------------------------------------------------------------
# Tile shapes and warps. Every kernel here is a streaming kernel: what matters is enough bytes in
# flight per SM (a few tens of KiB) and few instructions per byte.
# ---------------------------------------------------------------------------------------------
# fp8_block: one program per 128 x 128 scale block (the block's amax needs all of it); 32 KiB of
# bf16 per program over 8 warps (about 90 registers on sm_90: two programs, 64 KiB in flight
# per SM).
_FP8_BLOCK_TILE = (q.FP8_BLOCK, q.FP8_BLOCK)
_FP8_BLOCK_WARPS = 8
# fp8 (per-expert scale): any tile works; 8 K elements (16 KiB of bf16) per program.
_FP8_TILE = (32, 256)
_FP8_WARPS = 4
# fp4 from float weights: a tile is _FP4_TILE_SLICES 16-column slices (16 KiB of bf16 read), up
# to _FP4_MAX_SLICES of them along a row (256 columns: a program reads whole cache lines of each
# row and writes 64 bytes of each of its 4 kernel-order runs). The tiles cover the padded row
# (Kp/16 slices, a multiple of 16), masking the loads past K (gpt_oss' 2880 = 180 slices of 192:
# 6 tiles of 32, the last one 20 data slices) rather than going narrow; the masks' granularity
# is the largest power of two of slices dividing the data.
_FP4_TILE_SLICES = 512
_FP4_MAX_SLICES = 32
_FP4_WARPS = 4
# amax: each program reduces _AMAX_ITERS tiles of _AMAX_TILE elements (64 KiB of bf16), so the
# partial maxima are few; a contiguous expert is read as rows of _AMAX_TILE[1] elements whatever
# its shape (full-width vector loads, no masks).
_AMAX_TILE = (8, 1024)
_AMAX_ITERS = 4
_AMAX_WARPS = 8
# nvfp4 from float weights in one launch (quantize_scatter_nvfp4): the amax programs share
# the quantize programs' kernel, and so their 4 warps; a tile is 16 KiB of a 16-bit source
# (8 rows of 512 int32 pairs: 8 16-byte loads per thread), _FUSED_AMAX_ITERS of them per
# program (64 KiB: an expert's two atomics per 64 KiB read).
_FUSED_AMAX_TILE = (8, 512)
_FUSED_AMAX_ITERS = 4
# Where the tiles do not divide the expert (masked loads: gpt_oss' 2880 x 2880), 2 per program:
# with 4 the sm_90 build holds all the masked loads at once, 146 registers instead of 96 (the
# quantize programs' need), 3 programs per SM instead of 5.
_FUSED_AMAX_MASKED_ITERS = 2
# Whole-tile programs of a bit copy: 16 KiB per program.
_COPY_TILE_BYTES = 16384
# Reordering packed fp4 rows into the kernel order: up to 64 16-column slices (512 source bytes,
# 128 bytes of each of the 4 runs) per row of a tile, _COPY_TILE_BYTES per program.
_FP4_ORDER_MAX_SLICES = 64

# nvfp4 from float weights: the amax pass, the factors in torch and quantize_scatter (two
# kernels), or one launch (quantize_scatter_nvfp4, the amax pass fused in). Off: the fused
# launch was slower on one H200 (deepseek_v3 w1, bf16 -> nvfp4, against (read + write) / copy
# bandwidth: two launches 2.12x, fused interleaved 2.45x, sequential 2.59x;
# results/h200_prepare_variants.json): the quantize programs wait on their expert's flag with
# SM slots held, and each acquire invalidates L1, while the overlap it buys is small. Kept,
# tested, to be re-measured (benchmarks/bench_prepare.py --nvfp4-variants). moe_ops.layout reads
# these at each call.
NVFP4_FUSED_AMAX = False
# The order of the fused launch's programs (see _nvfp4_schedule).
NVFP4_SCHEDULES = ("sequential", "interleaved")
NVFP4_SCHEDULE = "interleaved"


@triton.jit
def _e4m3_bits(v):
    """float32 (already clamped to +-448) -> the float8_e4m3fn byte of its nearest-even rounding.

    The sign bit is taken from v: a negative value that rounds to zero is -0 (0x80), as torch's
    cast gives it; the Triton interpreter's float8 cast drops the sign of zero.
    """
    # From the bits of the rounded value, integer operations only (no float8 conversion
    # instruction): a normal e4m3 value (>= 2^-6) takes float32's exponent rebiased by 120 and
    # its top three mantissa bits; a subnormal one is m * 2^-9, m = 0..7, exactly.
    grid = tl.abs(round_to_e4m3_grid(v))
    bits = grid.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    magnitude = tl.where(grid >= 0.015625, normal, (grid * 512.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (magnitude | sign).to(tl.uint8)


@triton.jit
def _e4m3_bits_nonneg(v):
    """float32 v >= 0 -> the float8_e4m3fn byte of min(v, 448) rounded to nearest even (what
    _to_e4m3 gives for such v), in about half of _e4m3_bits' instructions: a normal e4m3 value
    (>= 2^-6) is float32's bits with the exponent rebiased by 120 and the mantissa rounded to
    three bits by an integer add (RNE: 2^19 - 1 plus the lowest kept bit; a carry out of the
    mantissa moves to the exponent, as it should); a subnormal one is m * 2^-9 with
    m = round(v * 512), by one fma whose addend 2^23 makes float32's rounding the integer one
    (v * 512 is exact; m = 8 is 2^-6, whose normal code is 8 as well)."""
    v = tl.minimum(v, 448.0)
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + (0x7FFFF - (120 << 23)) + ((bits >> 20) & 1)) >> 20
    subnormal = tl.fma(v, 512.0, 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(v >= 0.015625, normal, subnormal).to(tl.uint8)


@triton.jit
def _to_e4m3(v, HW_E4M3: tl.constexpr):
    """float32 -> (float8_e4m3fn byte as uint8, its value as float32): quant._to_fp8, i.e. clamp
    to +-448 and round to nearest even (a negative value that rounds to zero is -0)."""
    if HW_E4M3:
        # cvt.rn.satfinite saturates finite values to +-448: the clamp is part of it.
        f8 = v.to(tl.float8e4nv)
        return f8.to(tl.uint8, bitcast=True), f8.to(tl.float32)
    else:
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        return _e4m3_bits(v), round_to_e4m3_grid(v)


@triton.jit
def _e2m1_bits(y, SATURATE: tl.constexpr):
    """float32 -> int32 whose low byte is the e2m1 magnitude code of y (the bits of 2^23 + code)
    as moe_ops.quant.e2m1_encode gives it.

    For m = |y| the code is the rounding, to nearest with ties to even, of the piecewise-linear
    c(m) = min(2m, m + 2, m/2 + 4): c maps the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 onto
    0..7 and is affine between neighbours, so the midpoints land on n + 1/2 and ties to the even
    code are ties to the even mantissa, exactly e2m1_encode's >= / > choice. Rounding is monotone
    and commutes with adding 2 or 4 (even shifts keep the tie parity), so each line is rounded on
    its own and the minimum taken after. Each rounding is one fma whose product is exact (m times
    a power of two) and whose addend 2^23 (ulp 1) makes float32's own rounding the rounding to an
    integer. Past 6 (only nvfp4 gets there, through a block scale rounded down) saturates at
    code 7. Five to six float instructions per value instead of seven comparisons, conversions
    and integer adds.
    """
    m = tl.abs(y)
    r = tl.minimum(tl.minimum(tl.fma(m, 2.0, 8388608.0), m + 8388610.0),
                   tl.fma(m, 0.5, 8388612.0))
    if SATURATE:
        r = tl.minimum(r, 8388615.0)
    return r.to(tl.int32, bitcast=True)


@triton.jit
def _kernel_order_runs(lo, hi):
    """The 8 natural packed bytes of one 16-column slice, as int32 halves lo (bytes 0-3) and hi
    (bytes 4-7) -> the slice's 2 bytes in each of the row's 4 runs of the kernel order before
    its words' bit permutation (moe_ops.quant, "The kernel order of packed e2m1 rows";
    _permute_fp4_word does that), as two int32: run t's 16 bits at
    bits 16t of `runs01` (t = 0, 1) and 16(t - 2) of `runs23` (t = 2, 3).

    Natural byte 4h + t of a slice holds columns 2t + 8h (low nibble) and + 1 (high nibble); the
    kernel-order byte (t, q = 0) packs columns 2t and 2t + 8, i.e. the low nibbles of bytes t and
    4 + t, and (t, q = 1) their high nibbles. So q0 below has byte t = kernel byte (t, 0), q1 byte
    t = (t, 1), and the runs interleave their bytes. Bit operations within one thread's
    registers: the codes are moved, never changed, and no data crosses threads.
    """
    q0 = (lo & 0x0F0F0F0F) | ((hi & 0x0F0F0F0F) << 4)
    q1 = ((lo >> 4) & 0x0F0F0F0F) | (hi & -252645136)                      # hi & 0xF0F0F0F0
    runs01 = (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q0 & 0xFF00) << 8) | ((q1 & 0xFF00) << 16)
    runs23 = (((q0 >> 16) & 0xFF) | ((q1 >> 8) & 0xFF00) | ((q0 >> 8) & 0xFF0000)
              | (q1 & -16777216))                                          # q1 & 0xFF000000
    return runs01, runs23


# The kernel order's word permutation (moe_ops.quant.FP4_WORD_BITS) as left rotations of
# masked bits, grouped by rotation: _permute_fp4_word's constants, checked against quant's.
_WORD_ROTATIONS = ((0, 0x60180000), (2, 0x07000000), (6, 0x80000007), (8, 0x18000000),
                   (12, 0x00000078), (14, 0x00000700), (18, 0x00000080), (20, 0x00007800),
                   (24, 0x00600000), (26, 0x00078000), (30, 0x00800000))
assert _WORD_ROTATIONS == q._rotation_groups(q.FP4_WORD_BITS)


@triton.jit
def _rotl32(x, n: tl.constexpr):
    """uint32 x rotated left by n (0 < n < 32): one funnel shift on the GPU."""
    return (x << n) | (x >> (32 - n))


@triton.jit
def _permute_fp4_word(w):
    """A byte-ordered word (uint32: bytes (c, 0), (c, 1), (c + 1, 0), (c + 1, 1) of a run)
    -> the kernel order's word (quant.FP4_WORD_BITS), by the 11 rotations of _WORD_ROTATIONS."""
    return ((w & 0x60180000) | _rotl32(w & 0x07000000, 2) | _rotl32(w & 0x80000007, 6)
            | _rotl32(w & 0x18000000, 8) | _rotl32(w & 0x00000078, 12)
            | _rotl32(w & 0x00000700, 14) | _rotl32(w & 0x00000080, 18)
            | _rotl32(w & 0x00007800, 20) | _rotl32(w & 0x00600000, 24)
            | _rotl32(w & 0x00078000, 26) | _rotl32(w & 0x00800000, 30))


@triton.jit
def _store_words(dst, run, w0, w1, w2, w3, mask):
    """Store a slice pair's kernel-order word of each of the 4 runs (uint32) at dst (int32
    pointers: the pair's word in run 0), dst + run, + 2 run, + 3 run (run = Kp/32 int32)."""
    tl.store(dst, w0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(dst + run, w1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(dst + 2 * run, w2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(dst + 3 * run, w3.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _slice_word(nat):
    """Natural packed bytes [rows, pairs, 2, 4] (any integer type, values 0..255) -> int32
    [rows, pairs, 2], byte j of the word = element j (little-endian, as the bytes lie in
    memory). The 4-wide axis is 4 contiguous source elements, one vector load: the sum stays
    within one thread (and its terms have disjoint bits, so it is an or)."""
    j = tl.arange(0, 4)
    return tl.sum(nat.to(tl.int32) << (8 * j)[None, None, None, :], axis=3)


@triton.jit
def _tile(num_col_blocks, BLOCK_N: tl.constexpr):
    """The tile of a program of the preparation grids: (expert, row block, column block, the
    row block's rows). Grid: (row blocks x num_col_blocks, experts), column blocks innermost."""
    pid = tl.program_id(0)
    row_block = pid // num_col_blocks
    rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(1).to(tl.int64), row_block, pid % num_col_blocks, rows


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    """A load that is masked (0 where masked off) unless the tile is known to be in bounds."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _fp8_kernel(
    src_ptr, dst_ptr, dst_rows_ptr, scale_ptr, scale_rows_ptr, factor_ptr,
    N, K, num_col_blocks,
    stride_se, stride_sn, stride_sk,
    stride_de, stride_dn,
    stride_ce, stride_cn,
    QUANT: tl.constexpr,
    HW_E4M3: tl.constexpr,
    UNIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One tile [BLOCK_N, BLOCK_K] of src[e] -> e4m3 rows dst[e, dst_rows[r]] (+ its scale).

    QUANT "fp8":       factor = 448/amax of the expert (the scales are per expert, written by
                       the launcher).
    QUANT "fp8_block": BLOCK_N = BLOCK_K = 128, one block: values and its scale, written at
                       scale row scale_rows[row block], column = column block.
    UNIT_K: src's last dimension is contiguous (32-bit column offsets); EVEN: the tile grid
    divides [N, K] (no masks).
    """
    e, row_block, col_block, rows = _tile(num_col_blocks, BLOCK_N)
    cols = col_block * BLOCK_K + tl.arange(0, BLOCK_K)
    if UNIT_K:
        col_offsets = cols[None, :]
    else:
        col_offsets = cols.to(tl.int64)[None, :] * stride_sk
    src = src_ptr + e * stride_se + (rows.to(tl.int64) * stride_sn)[:, None] + col_offsets
    if EVEN:
        mask = None
        x = tl.load(src).to(tl.float32)
        dst_rows = tl.load(dst_rows_ptr + rows)
    else:
        row_mask = rows < N
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        dst_rows = tl.load(dst_rows_ptr + rows, mask=row_mask, other=0)
    dst = dst_ptr + e * stride_de + (dst_rows.to(tl.int64) * stride_dn)[:, None] + cols[None, :]

    if QUANT == "fp8":
        inv = tl.load(factor_ptr + e)
    else:
        # quant.quantize_fp8_block: amax of the block (padding counts as 0), 448/amax or 0.
        # torch evaluates `448 / tensor` as tensor.reciprocal() * 448: two roundings, kept.
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        inv = tl.where(amax > 0, tl.div_rn(1.0, tl.where(amax > 0, amax, 1.0)) * 448.0, 0.0)
        scale_row = tl.load(scale_rows_ptr + row_block).to(tl.int64)
        tl.store(scale_ptr + e * stride_ce + scale_row * stride_cn + col_block,
                 tl.div_rn(amax, 448.0))
    values, _ = _to_e4m3(x * inv, HW_E4M3)
    tl.store(dst, values, mask=mask)


@triton.jit
def _fp4_half_slices(src_rows, c, h, mask, stride_sk, SRC: tl.constexpr, EVEN: tl.constexpr):
    """Half h of each 16-column slice c of a tile: columns 16c + 8h + 2t (lo) and + 1 (hi) for
    t = 0..3, as float32 [rows, slices, 4]. Each (slice, half) is 4 pairs of contiguous columns
    (16 bytes of a 16-bit source: one vector load of 4 int32 pairs per thread)."""
    pairs = (8 * c + 4 * h)[None, :, None] + tl.arange(0, 4)[None, None, :]
    if SRC == "strided":
        src = src_rows[:, None, None] + pairs.to(tl.int64) * (2 * stride_sk)
        lo = _load(src, mask, EVEN).to(tl.float32)
        hi = _load(src + stride_sk, mask, EVEN).to(tl.float32)
    else:
        w = _load(src_rows[:, None, None] + pairs, mask, EVEN)
        if SRC == "bf16":
            # A bf16 is the top half of the float32 of the same value.
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _fp4_load(src_ptr, e, c, rows, N, slices, stride_se, stride_sn, stride_sk,
              SRC: tl.constexpr, EVEN: tl.constexpr, SLICES_ALIGN: tl.constexpr):
    """The source values of slices c of one fp4 tile (see _fp4_kernel) as float32 [rows,
    len(c), 4]: the low and high columns of each slice's two halves (lo0, hi0, lo1, hi1)."""
    src_rows = src_ptr + e * stride_se + rows.to(tl.int64) * stride_sn
    # Load masks constant over SLICES_ALIGN slices (bounds written as multiples of it); whole
    # scale blocks are in or out.
    slice_ok = c < (slices // SLICES_ALIGN) * SLICES_ALIGN
    mask = ((rows < N)[:, None] & slice_ok[None, :])[:, :, None]
    lo0, hi0 = _fp4_half_slices(src_rows, c, 0, mask, stride_sk, SRC, EVEN)
    lo1, hi1 = _fp4_half_slices(src_rows, c, 1, mask, stride_sk, SRC, EVEN)
    return lo0, hi0, lo1, hi1


@triton.jit
def _fp4_load_pairs(src_ptr, e, col_block, rows, N, slices, stride_se, stride_sn, stride_sk,
                    SRC: tl.constexpr, EVEN_N: tl.constexpr, SLICES_ALIGN: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """_fp4_load of a tile's even slices, then of its odd ones ([rows, BLOCK_S / 2, 4] each):
    a kernel-order word holds a slice pair's codes, so the thread that holds pair p holds
    both slices (each slice half still one 16-byte load of a 16-bit source)."""
    EVEN: tl.constexpr = EVEN_N and SLICES_ALIGN == BLOCK_S
    a = 2 * (col_block * (BLOCK_S // 2) + tl.arange(0, BLOCK_S // 2))
    a_lo0, a_hi0, a_lo1, a_hi1 = _fp4_load(src_ptr, e, a, rows, N, slices, stride_se,
                                           stride_sn, stride_sk, SRC, EVEN, SLICES_ALIGN)
    b_lo0, b_hi0, b_lo1, b_hi1 = _fp4_load(src_ptr, e, a + 1, rows, N, slices, stride_se,
                                           stride_sn, stride_sk, SRC, EVEN, SLICES_ALIGN)
    return a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1


# Where _fp4_word puts each code (the magnitude's bits, then the sign): quant.FP4_WORD_BITS,
# bit 8j + 4n + b being bit b of nibble n of byte j (bytes (c, 0), (c, 1), (c + 1, 0), (c + 1, 1)).
assert q.FP4_WORD_BITS == (6, 7, 8, 15, 16, 17, 18, 25, 22, 23, 24, 31, 0, 1, 2, 9,
                           10, 11, 12, 19, 20, 13, 14, 21, 26, 27, 28, 3, 4, 29, 30, 5)
# _e2m1_at leaves 0x4B000000 << MAG (the float32 bits of 2^23 that _e2m1_bits adds to the code)
# in the sum of a word's six whole fields: its negation mod 2^32, added once a word.
_E2M1_WORD_EXCESS = tl.constexpr(
    -sum(0x4B000000 << m for m in (6, 22, 16, 0, 10, 26)) % (1 << 32))


@triton.jit
def _e2m1_at(y, MAG: tl.constexpr, SIGN: tl.constexpr, SATURATE: tl.constexpr):
    """y's e2m1 code as uint32 bits: its magnitude at bits MAG..MAG+2 plus 0x4B000000 << MAG
    (see _E2M1_WORD_EXCESS: one shift-add a code instead of a mask more), its sign at SIGN
    (set only below -0.25: a value that rounds to zero is +0, as quant.e2m1_encode gives it)."""
    r = _e2m1_bits(y, SATURATE).to(tl.uint32, bitcast=True)
    return (r << MAG) + ((y < -0.25).to(tl.uint32) << SIGN)


@triton.jit
def _e2m1_split_at(y, MAG0: tl.constexpr, MAG12: tl.constexpr, SIGN: tl.constexpr,
                   SATURATE: tl.constexpr):
    """_e2m1_at for a code whose magnitude is split: bit 0 at MAG0, bits 1-2 at MAG12..+1;
    no excess."""
    r = _e2m1_bits(y, SATURATE).to(tl.uint32, bitcast=True)
    return (((r & 1) << MAG0) | ((r & 6) << (MAG12 - 1))
            | ((y < -0.25).to(tl.uint32) << SIGN))


@triton.jit
def _fp4_word(a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1, SATURATE: tl.constexpr):
    """The kernel-order word (uint32) of one run of a slice pair from the scaled values of
    columns 2t, 2t + 1, 2t + 8, 2t + 9 of slices a = c and b = c + 1 (_fp4_half_slices' lo0,
    hi0, lo1, hi1): byte (c, 0) holds columns 2t | 2t + 8, (c, 1) 2t + 1 | 2t + 9, and so on,
    each code's bits where quant.FP4_WORD_BITS puts them."""
    w = (_e2m1_at(a_lo0, 6, 15, SATURATE) + _e2m1_at(a_lo1, 16, 25, SATURATE)
         + _e2m1_at(a_hi0, 22, 31, SATURATE) + _e2m1_at(a_hi1, 0, 9, SATURATE)
         + _e2m1_at(b_lo0, 10, 19, SATURATE) + _e2m1_at(b_hi0, 26, 3, SATURATE)
         + _E2M1_WORD_EXCESS)
    return (w | _e2m1_split_at(b_lo1, 20, 13, 21, SATURATE)
            | _e2m1_split_at(b_hi1, 4, 29, 5, SATURATE))


@triton.jit
def _fp4_block_factors(amax, e, table_ptr, factor2_ptr, QUANT: tl.constexpr):
    """Block amax [rows, blocks] -> (the block-scale bytes, the factor that scales a block's
    values onto the e2m1 grid), as quant.quantize_nvfp4 / quantize_mxfp4 compute them."""
    if QUANT == "nvfp4":
        # quant.quantize_nvfp4: block scale = e4m3(amax / 6 * inv_global); the values are
        # divided by block scale * global scale through its (correctly rounded) inverse.
        # The inverse comes from the expert's table over the 128 non-negative e4m3 bytes (see
        # _nvfp4_inverse_table): one cached load per block instead of a division.
        inv_global = tl.load(factor2_ptr + e)
        # The e4m3 bits by integer operations, not the hardware conversion: with the kernel-
        # order store after it, the H200 build of this kernel gave wrong block-scale bytes from
        # cvt.rn.satfinite.e4m3x2 (an eighth of the groups; nvfp4 only, the interpreter right).
        # (block amax and the inverse global scale are >= 0, so the scale is.)
        block_scale = _e4m3_bits_nonneg(tl.div_rn(amax, 6.0) * inv_global)
        factor = tl.load(table_ptr + e * 128 + block_scale.to(tl.int32))
    else:
        # quant.quantize_mxfp4: exponent = ceil(log2(amax / 6)), exactly, from the bits of
        # y = amax / 6: for a normal y = 1.m * 2^E it is E, plus 1 unless m == 0; a
        # subnormal y lies in (0, 2^-126): -126 above 2^-127, else <= -127 (clamped).
        y = tl.div_rn(amax, 6.0)
        bits = y.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        exponent = tl.where(biased == 0, tl.where(mantissa > 0x400000, -126, -127),
                            biased - 127 + (mantissa != 0).to(tl.int32))
        exponent = tl.where(amax > 0, exponent, -127)
        exponent = tl.minimum(tl.maximum(exponent, -127), 127)
        # 2^-exponent, built exactly (2^-127 is subnormal: bit 22 alone).
        factor = tl.where(exponent == 127, tl.full(exponent.shape, 0x400000, tl.int32),
                          (127 - exponent) << 23).to(tl.float32, bitcast=True)
        block_scale = (exponent + 127).to(tl.uint8)
    return block_scale, factor


@triton.jit
def _slice_amax(lo0, hi0, lo1, hi1):
    """The amax of each slice of a tile loaded by _fp4_load: [rows, slices]."""
    return tl.maximum(tl.max(tl.maximum(tl.abs(lo0), tl.abs(hi0)), axis=2),
                      tl.max(tl.maximum(tl.abs(lo1), tl.abs(hi1)), axis=2))


@triton.jit
def _fp4_quantize_store(
    a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1,
    dst_ptr, dst_rows_ptr, scale_ptr, scale_rows_ptr, table_ptr,
    factor2_ptr, e, col_block, rows, N, run,
    stride_de, stride_dn, stride_ce, stride_cn,
    QUANT: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Quantize one fp4 tile loaded by _fp4_load, its even slices (a) and odd ones (b) apart,
    and store its kernel-order words and block scales (see _fp4_kernel). Shared by _fp4_kernel
    and _nvfp4_fused_kernel, whose nvfp4 factors (table, factor2) come from the amax pass of
    the same launch."""
    PAIRS: tl.constexpr = BLOCK_S // 2
    pairs = col_block * PAIRS + tl.arange(0, PAIRS)
    row_mask = rows < N
    store_mask = None if EVEN_N else row_mask[:, None]   # stores mask rows only
    amax_a = _slice_amax(a_lo0, a_hi0, a_lo1, a_hi1)                      # [rows, pairs]
    amax_b = _slice_amax(b_lo0, b_hi0, b_lo1, b_hi1)
    if QUANT == "nvfp4":
        # a 16-wide block a slice
        scale_a, fa = _fp4_block_factors(amax_a, e, table_ptr, factor2_ptr, QUANT)
        scale_b, fb = _fp4_block_factors(amax_b, e, table_ptr, factor2_ptr, QUANT)
    else:
        # a 32-wide block a slice pair
        block_scale, fa = _fp4_block_factors(tl.maximum(amax_a, amax_b), e, table_ptr,
                                             factor2_ptr, QUANT)
        fb = fa
    # The codes go straight to their place in the kernel order's words (moe_ops.quant, "The
    # kernel order of packed e2m1 rows"): run t of a slice pair is one 32-bit word of the 8
    # codes of columns 2t, 2t + 1, 2t + 8, 2t + 9 of both slices, i.e. index t of the loaded
    # halves (_fp4_half_slices), each code shifted to its bits (_fp4_word): no natural bytes,
    # no re-pairing across threads. mxfp4's scaled values never pass 6 (2^exponent >= amax /
    # 6): no saturation needed.
    fa = fa[:, :, None]
    fb = fb[:, :, None]
    SAT: tl.constexpr = QUANT == "nvfp4"
    words = _fp4_word(a_lo0 * fa, a_hi0 * fa, a_lo1 * fa, a_hi1 * fa,
                      b_lo0 * fb, b_hi0 * fb, b_lo1 * fb, b_hi1 * fb, SAT)

    dst_rows = _load(dst_rows_ptr + rows, row_mask, EVEN_N).to(tl.int64)
    dst = (dst_ptr + e * stride_de + dst_rows[:, None, None] * stride_dn + pairs[None, :, None]
           + (tl.arange(0, 4) * run)[None, None, :])                  # run t of the pair
    tl.store(dst, words.to(tl.int32, bitcast=True),
             mask=None if EVEN_N else row_mask[:, None, None])
    scale_rows = _load(scale_rows_ptr + rows, row_mask, EVEN_N).to(tl.int64)
    scale = scale_ptr + e * stride_ce + scale_rows * stride_cn
    if QUANT == "nvfp4":
        # slices 2p and 2p + 1 side by side ([rows, pairs, 2] -> [rows, slices])
        block_scale = tl.reshape(tl.join(scale_a, scale_b), (BLOCK_N, BLOCK_S))
        c = col_block * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(scale[:, None] + c[None, :], block_scale, mask=store_mask)
    else:
        tl.store(scale[:, None] + pairs[None, :], block_scale, mask=store_mask)


@triton.jit
def _fp4_kernel(
    src_ptr, dst_ptr, dst_rows_ptr, scale_ptr, scale_rows_ptr, table_ptr, factor2_ptr,
    N, slices, num_col_blocks, run,
    stride_se, stride_sn, stride_sk,
    stride_de, stride_dn,
    stride_ce, stride_cn,
    QUANT: tl.constexpr,
    SRC: tl.constexpr,
    HW_E4M3: tl.constexpr,
    EVEN_N: tl.constexpr,
    SLICES_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    # The next matrix's amax (AMAX_NEXT; see below): its source view (_next_amax_plan), and
    # next_amax (int32 [E], zeros): the float32 bits of each expert's amax.
    next_ptr=None, next_amax_ptr=None, next_rows=0, next_cols=0, next_col_blocks=1,
    next_tiles=1, next_stride_e=0, next_stride_n=0, next_stride_k=0,
    AMAX_NEXT: tl.constexpr = False,
    NEXT_SRC: tl.constexpr = "strided",
    NEXT_UNIT_K: tl.constexpr = True,
    NEXT_EVEN: tl.constexpr = True,
    NEXT_BLOCK_N: tl.constexpr = 1,
    NEXT_BLOCK_K: tl.constexpr = 1,
    NEXT_ITERS: tl.constexpr = 1,
    PAIR_MAX: tl.constexpr = False,
):
    """One tile of src[e] (BLOCK_N rows, BLOCK_S 16-column slices; a row is `slices` = K/16
    slices) -> packed e2m1 rows dst[e, dst_rows[r]] in kernel order, and their block scales at
    rows scale_rows[r] in natural order.

    AMAX_NEXT: each program also reduces one amax tile of expert e of the next matrix to be
    quantized (nvfp4's per-expert amax, which that matrix's quantization needs first; see
    quantize_scatter's next_weight), maxed into next_amax[e] by an atomic on its float32 bits
    (a non-negative float's bits order as the float does). The quantization here is
    bound by instruction issue and the amax pass by memory, so the two share the SMs instead of
    running one after the other. The tiles cover the next expert in at most as many tiles as
    this grid has programs per expert; programs past the last tile redo the last one (the
    same maximum, no branch, no mask).

    dst is the int32 view of the kernel-order rows: a row is 4 runs of `run` = Kp/32 words,
    the word of slices 2p and 2p + 1 in run t at t * run + p (moe_ops.quant, "The kernel order
    of packed e2m1 rows": each word's bits permuted, FP4_WORD_BITS). The grid covers the padded
    row (Kp/16 slices, BLOCK_S divides it): the padding past K is loaded as zeros and so written
    as zero codes and zero scales (what the GEMMs, which read it unmasked, need), in the same
    pass.

    Each thread holds whole slice pairs (four 16-byte loads of a 16-bit source), so the block
    amax and the codes, shifted straight to their bits of the kernel-order words (_fp4_word),
    stay in its registers. (An earlier version packed natural bytes first and re-paired them
    across threads: 2.8x the memory floor instead of ~1.5x.)

    QUANT "nvfp4": e4m3 block scales (16 along K = one slice); factor2 = the inverse of the
                   expert's global scale (0 for a zero expert), table = the inverse of each
                   block scale times the global scale, per expert and e4m3 byte.
    QUANT "mxfp4": e8m0 block scales (32 along K = two slices; SLICES_ALIGN is even).
    SRC "bf16" / "f16": src is the int32 view of a 16-bit source with contiguous rows: one load
                   gives a pair of values, element 2i in the low half, which is the pair one
                   output nibble pair packs; "strided": any float dtype and strides, even and odd
                   columns loaded apart.
    SLICES_ALIGN: a power of two <= BLOCK_S that divides `slices` (== BLOCK_S: the row has no
                   padding, no column masks).
    """
    e, row_block, col_block, rows = _tile(num_col_blocks, BLOCK_N)
    a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1 = _fp4_load_pairs(
        src_ptr, e, col_block, rows, N, slices, stride_se, stride_sn, stride_sk, SRC, EVEN_N,
        SLICES_ALIGN, BLOCK_S)
    _fp4_quantize_store(a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1,
                        dst_ptr, dst_rows_ptr, scale_ptr, scale_rows_ptr,
                        table_ptr, factor2_ptr, e, col_block, rows, N, run,
                        stride_de, stride_dn, stride_ce, stride_cn,
                        QUANT, EVEN_N, BLOCK_N, BLOCK_S)
    if AMAX_NEXT:
        pid = tl.program_id(0)
        m = _amax_tile(next_ptr, e, tl.minimum(pid, next_tiles - 1), next_rows, next_cols,
                       next_col_blocks, next_stride_e, next_stride_n, next_stride_k, NEXT_SRC,
                       NEXT_UNIT_K, NEXT_EVEN, NEXT_BLOCK_N, NEXT_BLOCK_K, NEXT_ITERS,
                       PAIR_MAX)
        tl.atomic_max(next_amax_ptr + e, m.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _amax_kernel(
    src_ptr, out_ptr, N, K, num_col_blocks, programs,
    stride_se, stride_sn, stride_sk,
    UNIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ITERS: tl.constexpr,
):
    """out[e, pid] = max |src[e]| over the program's tile (_amax_tile: ITERS row tiles of one
    column block, any float dtype); the launcher reduces over programs."""
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    m = _amax_tile(src_ptr, e, pid, N, K, num_col_blocks, stride_se, stride_sn, stride_sk,
                   "strided", UNIT_K, EVEN, BLOCK_N, BLOCK_K, ITERS)
    tl.store(out_ptr + e * programs + pid, m)


def _pair_max(device: torch.device) -> bool:
    """_amax_tile's PAIR_MAX: on GPUs with max.u16x2 (sm_90+), and in the interpreter (where
    _max_u16x2 is emulated), so that CI runs the same reduction."""
    return INTERPRET or capability_at_least(device, (9, 0))


_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def _max_u16x2(a, b):
    """Lane-wise max of the two 16-bit halves of int32 a and b, whose halves are below 0x8000
    (magnitude bits): PTX max.u16x2 on the GPU, two integer maxima in the interpreter."""
    if _INTERPRET:
        m = tl.maximum(a & 0x7FFF, b & 0x7FFF) | tl.maximum(a & 0x7FFF0000, b & 0x7FFF0000)
    else:
        m = tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return m


@triton.jit
def _amax_tile(src_ptr, e, tile, rows, cols, num_col_blocks, stride_se, stride_an, stride_ak,
               SRC: tl.constexpr, UNIT_K: tl.constexpr, EVEN: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr,
               PAIR_MAX: tl.constexpr = False):
    """max |x| over tile `tile` of expert e as float32, the expert seen as a [rows, cols] matrix
    (strides stride_an, stride_ak; a contiguous expert is given as full-width rows, see
    _rows_view): ITERS row tiles [BLOCK_N, BLOCK_K] of one column block, read with a running
    elementwise max, so their loads are independent and in flight together.

    SRC "bf16" / "f16": src is the int32 view (pairs of values). The magnitudes are maxed as
    integers, each half apart: a non-negative float's bits order as the float does, so
    `bits & 0x7FFF` (low value) and `bits & 0x7FFF0000` (high value, still a non-negative int32)
    are compared as they are, two operations per value and exact; with PAIR_MAX (sm_90+, see
    _pair_max) both halves at once (`bits & 0x7FFF7FFF`, then max.u16x2: one operation per
    value; emulated in the interpreter). "strided": any float dtype.
    """
    row_block = tile // num_col_blocks
    cols_k = (tile % num_col_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    if UNIT_K:
        col_offsets = cols_k[None, :]
    else:
        col_offsets = cols_k.to(tl.int64)[None, :] * stride_ak
    base = src_ptr + e * stride_se
    if SRC == "strided":
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    elif not PAIR_MAX:
        acc_lo = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
        acc_hi = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(ITERS):
        r = (row_block * ITERS + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        x = _load(base + (r.to(tl.int64) * stride_an)[:, None] + col_offsets,
                  (r < rows)[:, None] & (cols_k < cols)[None, :], EVEN)
        if SRC == "strided":
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        elif PAIR_MAX:
            if i == 0:                                    # both halves in acc_lo
                acc_lo = x & 0x7FFF7FFF
            else:
                acc_lo = _max_u16x2(acc_lo, x & 0x7FFF7FFF)
        else:
            acc_lo = tl.maximum(acc_lo, x & 0x7FFF)
            acc_hi = tl.maximum(acc_hi, x & 0x7FFF0000)
    # One return at the end: Triton's compiler does not stop at a return inside a constexpr if
    # (the interpreter does).
    if SRC == "strided":
        m = tl.max(tl.max(acc, axis=1), axis=0)
    else:
        if PAIR_MAX and not _INTERPRET:
            both = tl.reduce(tl.reshape(acc_lo, (BLOCK_N * BLOCK_K,)), 0, _max_u16x2)
            lo = both & 0x7FFF
            hi = both & 0x7FFF0000
        elif PAIR_MAX:  # (a reduction with a Python combine is slow in the interpreter)
            lo = tl.max(tl.max(acc_lo & 0x7FFF, axis=1), axis=0)
            hi = tl.max(tl.max(acc_lo & 0x7FFF0000, axis=1), axis=0)
        else:
            lo = tl.max(tl.max(acc_lo, axis=1), axis=0)
            hi = tl.max(tl.max(acc_hi, axis=1), axis=0)
        if SRC == "bf16":  # a bf16's bits are the top half of its float32's
            m = tl.maximum(lo << 16, hi).to(tl.float32, bitcast=True)
        else:
            m = tl.maximum(lo, hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return m


@triton.jit
def _nvfp4_schedule(E, amax_tiles, quant_tiles, SCHEDULE: tl.constexpr, WIDE: tl.constexpr):
    """This program's (expert, whether it is an amax tile, tile index) in _nvfp4_fused_kernel's
    grid of E * (amax_tiles + quant_tiles) programs. Every amax tile of an expert has a lower
    program id than every quantize tile of it (what the kernel's wait needs).

    "sequential":  [A_0][Q_0][A_1][Q_1]...: each expert's amax tiles, then its quantize tiles.
    "interleaved": [A_0][A_1 + Q_0][A_2 + Q_1]...[Q_{E-1}]: the amax tiles of expert s + 1 spread
                   evenly among the quantize tiles of expert s (amax tile j at position
                   floor(j * T / A) of the segment of T = A + Q programs), so the memory-bound
                   and the instruction-bound programs share the SMs all along.
    Quantize tiles go in reverse order (last row block first) in both: the amax pass reads an
    expert front to back, so its last tiles are the likeliest still in L2.

    Scalar work once per program, but the quantize programs are instruction-bound: 32-bit
    arithmetic and one division ("sequential") or two ("interleaved"); WIDE (the launcher's
    choice, where T * (A + 1) can pass 2^31) makes it 64-bit.
    """
    pid = tl.program_id(0)
    A = amax_tiles
    if WIDE:
        pid = pid.to(tl.int64)
        A = A.to(tl.int64)
    T = A + quant_tiles
    if SCHEDULE == "sequential":
        e = pid // T
        i = pid - e * T
        is_amax = i < A
        tile = tl.where(is_amax, i, T - 1 - i)  # quantize tile Q - 1 - (i - A)
    else:
        head = pid < A                           # A_0
        tail = pid >= A + (E - 1) * T            # Q_{E-1}
        body = tl.where(head | tail, 0, pid - A)
        s = body // T                            # segment A_{s+1} + Q_s
        i = body - s * T
        # Amax tile j sits at floor(j * T / A). j0 = ceil(i * A / T), how many lie before
        # position i, has j0 * T >= i * A; position i is j0's iff j0 * T < (i + 1) * A.
        j0 = (i * A + T - 1) // T
        mixed_amax = (j0 < A) & (j0 * T < (i + 1) * A)
        is_amax = tl.where(head, True, tl.where(tail, False, mixed_amax))
        e = tl.where(head, 0, tl.where(tail, E - 1, tl.where(mixed_amax, s + 1, s)))
        q_index = tl.where(tail, pid - A - (E - 1) * T, i - j0)
        tile = tl.where(head, pid, tl.where(is_amax, j0, quant_tiles - 1 - q_index))
    return e.to(tl.int64), is_amax, tile.to(tl.int32)  # tile counts fit 32 bits (the grid does)


@triton.jit
def _nvfp4_fused_kernel(
    src_ptr, dst_ptr, dst_rows_ptr, scale_ptr, scale_rows_ptr,
    sync_ptr, global_ptr, inv_global_ptr, table_ptr,
    E, N, slices, num_col_blocks, run, quant_tiles,
    amax_tiles, amax_rows, amax_cols, amax_col_blocks,
    stride_se, stride_sn, stride_sk,
    stride_de, stride_dn,
    stride_ce, stride_cn,
    stride_an, stride_ak,
    SCHEDULE: tl.constexpr,
    WIDE_SCHEDULE: tl.constexpr,
    SRC: tl.constexpr,
    EVEN_N: tl.constexpr,
    SLICES_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    AMAX_UNIT_K: tl.constexpr,
    AMAX_EVEN: tl.constexpr,
    AMAX_BLOCK_N: tl.constexpr,
    AMAX_BLOCK_K: tl.constexpr,
    AMAX_ITERS: tl.constexpr,
    PAIR_MAX: tl.constexpr = False,
):
    """nvfp4 quantize-and-scatter of src [E, N, K] in one launch, the per-expert amax included:
    _fp4_kernel's work (QUANT "nvfp4"; the same tiles, arguments and outputs) plus the pass that
    _amax_kernel and the launcher's torch expressions did before it, as two kinds of programs
    (_nvfp4_schedule). A memory-bound amax program and instruction-bound quantize programs then
    share the SMs, and the quantize pass re-reads an expert soon after the amax pass (in L2, in
    part), where two launches ran them one after the other.

    sync (int32 [3, E], zeros): the float32 bits of the expert's amax so far (amax >= 0, so
    the bits order as integers do: an integer atomic max), how many of its amax programs are
    done, and its "ready" flag. Outputs: global (float32 [E], quant.nvfp4_global_scale's
    global scale), inv_global ([E], its inverse, 0 for a zero expert), table ([E, 128],
    _nvfp4_inverse_table's).

    An amax program reduces its tile, maxes it into the expert's slot, and counts itself done
    (acq_rel: its max is visible before its count). The one that completes the count
    (atomic_add returns amax_tiles - 1) sees every max (acquire), computes the expert's
    factors, and publishes them with a release on the ready flag. A quantize program loads its
    tile (the weights do not depend on the amax pass), waits for its expert's flag (acquire),
    then reads the factors and does what _fp4_kernel does.

    No deadlock: a program only waits on programs of lower ids (every amax tile of an expert
    precedes its quantize tiles, _nvfp4_schedule), and NVIDIA GPUs dispatch the programs of a
    1-D grid in increasing id order, so those have all been started (they never wait) and will
    finish: the forward-progress assumption of decoupled look-back scans. The interpreter runs
    the programs one after another in id order: the flag is always set already.
    """
    e, is_amax, tile = _nvfp4_schedule(E, amax_tiles, quant_tiles, SCHEDULE, WIDE_SCHEDULE)
    amax_slot = sync_ptr + e
    done = sync_ptr + E + e
    ready = sync_ptr + 2 * E + e
    if is_amax:
        m = _amax_tile(src_ptr, e, tile, amax_rows, amax_cols, amax_col_blocks, stride_se,
                       stride_an, stride_ak, SRC, AMAX_UNIT_K, AMAX_EVEN, AMAX_BLOCK_N,
                       AMAX_BLOCK_K, AMAX_ITERS, PAIR_MAX)
        # Relaxed: the acq_rel count below (same thread: a scalar atomic is issued by one
        # thread of the program) orders it.
        tl.atomic_max(amax_slot, m.to(tl.int32, bitcast=True), sem="relaxed")
        if tl.atomic_add(done, 1, sem="acq_rel") == amax_tiles - 1:
            # The last amax program of the expert: every max is in the slot (read atomically,
            # from L2). quant.nvfp4_global_scale and _nvfp4_inverse_table, operation for
            # operation: amax / 2688 and 1 / x correctly rounded (torch's true division and
            # reciprocal), products of exact factors rounded once (no FMA contraction).
            amax = tl.atomic_add(amax_slot, 0, sem="relaxed").to(tl.float32, bitcast=True)
            g = tl.div_rn(amax, 2688.0)                       # quant.FP8_MAX * quant.E2M1_MAX
            tl.store(global_ptr + e, g)
            tl.store(inv_global_ptr + e, tl.where(g > 0, tl.div_rn(1.0, tl.where(g > 0, g, 1.0)),
                                                  0.0))
            # The e4m3 value of each byte b = 0..127 from its bits (exact; no float8
            # conversion, which needs sm_89 and which the interpreter gets wrong for 0x7F):
            # exponent 0 is subnormal, m * 2^-9; 0x7F is e4m3fn's NaN, whose inverse the
            # reference makes 0 (NaN > 0 is false; never looked up: block scales saturate at
            # 448 = 0x7E).
            b = tl.arange(0, 128)
            exponent = b >> 3
            mantissa = b & 7
            value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,
                             (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32,
                                                                               bitcast=True))
            full = value * g
            ok = (full > 0) & (b != 127)
            tl.store(table_ptr + e * 128 + b,
                     tl.where(ok, tl.div_rn(1.0, tl.where(ok, full, 1.0)), 0.0))
            # Every thread's stores before the one thread's release (CTA barrier, then the
            # release is cumulative over what the barrier ordered before it).
            tl.debug_barrier()
            tl.atomic_xchg(ready, 1, sem="release")
    else:
        row_block = tile // num_col_blocks
        col_block = tile % num_col_blocks
        rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
        # The weights first: their loads are in flight while the flag is checked.
        a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1 = _fp4_load_pairs(
            src_ptr, e, col_block, rows, N, slices, stride_se, stride_sn, stride_sk, SRC,
            EVEN_N, SLICES_ALIGN, BLOCK_S)
        # Acquire reads of the flag, so that the factors read below are those published before
        # it. Triton turns an atomic add of 0 into an atomic load (ld.acquire.gpu: no
        # read-modify-write contending on the flag's address); a spin on volatile loads followed
        # by one such read would not do: with its result unused that read is dropped.
        while tl.atomic_add(ready, 0, sem="acquire") == 0:
            pass
        _fp4_quantize_store(a_lo0, a_hi0, a_lo1, a_hi1, b_lo0, b_hi0, b_lo1, b_hi1,
                            dst_ptr, dst_rows_ptr, scale_ptr,
                            scale_rows_ptr, table_ptr, inv_global_ptr, e, col_block, rows, N,
                            run, stride_de, stride_dn, stride_ce, stride_cn,
                            "nvfp4", EVEN_N, BLOCK_N, BLOCK_S)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, dst_ptr, dst_rows_ptr, N, K, K_DST, num_col_blocks,
    stride_se, stride_sn, stride_sk,
    stride_de, stride_dn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dst[e, dst_rows[r], :K] = src[e, r, :] for one tile, bits as they are; the columns K..K_DST
    of the destination rows (fp4 scale rows' padding) are written as zeros."""
    e, row_block, col_block, rows = _tile(num_col_blocks, BLOCK_N)
    cols = col_block * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask = rows < N
    src = (src_ptr + e * stride_se + rows.to(tl.int64)[:, None] * stride_sn
           + cols.to(tl.int64)[None, :] * stride_sk)
    values = tl.load(src, mask=row_mask[:, None] & (cols < K)[None, :], other=0)
    dst_rows = tl.load(dst_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    tl.store(dst_ptr + e * stride_de + dst_rows[:, None] * stride_dn + cols[None, :], values,
             mask=row_mask[:, None] & (cols < K_DST)[None, :])


@triton.jit
def _fp4_order_rows_kernel(
    src_ptr, dst_ptr, dst_rows_ptr, N, slices, num_col_blocks, run,
    stride_se, stride_sn, stride_sk,
    stride_de, stride_dn,
    WORDS: tl.constexpr,
    EVEN_N: tl.constexpr,
    SLICES_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One tile of natural packed e2m1 rows src[e] (BLOCK_N rows, BLOCK_S 16-column slices; a
    row is `slices` = K/16 slices) -> the same rows in kernel order at dst[e, dst_rows[r]] (the
    int32 view, runs of `run` = Kp/32 words, see _fp4_kernel), bit for bit. The grid covers the
    padded row (Kp/16 slices, BLOCK_S divides it): the padding is written as zeros.

    WORDS: src is the int64 view of the rows (a slice's 8 bytes are one element; strides in
    them): a slice pair is one 16-byte load, the re-pairing within each thread. Otherwise src
    is bytes with any strides, each half of a slice loaded as 4 bytes.
    SLICES_ALIGN: a power of two <= BLOCK_S that divides `slices` (== BLOCK_S: the row has no
    padding, no column masks).
    """
    EVEN_K: tl.constexpr = SLICES_ALIGN == BLOCK_S
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    PAIRS: tl.constexpr = BLOCK_S // 2
    e, row_block, col_block, rows = _tile(num_col_blocks, BLOCK_N)
    pairs = col_block * PAIRS + tl.arange(0, PAIRS)
    row_mask = rows < N
    # Whole slices are loaded or read as zeros, SLICES_ALIGN of them at a time (bounds written
    # as multiples of it). Stores mask rows only.
    c = 2 * pairs[None, :, None] + tl.arange(0, 2)[None, None, :]           # [1, pairs, 2]
    mask = row_mask[:, None, None] & (c < (slices // SLICES_ALIGN) * SLICES_ALIGN)
    src_rows = src_ptr + e * stride_se + rows.to(tl.int64)[:, None, None] * stride_sn
    if WORDS:
        word = _load(src_rows + c, mask, EVEN)                           # [rows, pairs, 2]
        lo = word.to(tl.int32)
        hi = (word >> 32).to(tl.int32)
    else:
        j = tl.arange(0, 4)[None, None, None, :]
        src = src_rows[:, :, :, None] + ((8 * c)[:, :, :, None] + j).to(tl.int64) * stride_sk
        lo = _slice_word(_load(src, mask[:, :, :, None], EVEN))
        hi = _slice_word(_load(src + 4 * stride_sk, mask[:, :, :, None], EVEN))
    runs01, runs23 = _kernel_order_runs(lo, hi)
    a01, b01 = tl.split(runs01.to(tl.uint32, bitcast=True))                 # slices 2p, 2p + 1
    a23, b23 = tl.split(runs23.to(tl.uint32, bitcast=True))
    # a run's word: slice 2p's 2 bytes, then slice 2p + 1's
    w0 = _permute_fp4_word((a01 & 0xFFFF) | (b01 << 16))
    w1 = _permute_fp4_word((a01 >> 16) | (b01 & 0xFFFF0000))
    w2 = _permute_fp4_word((a23 & 0xFFFF) | (b23 << 16))
    w3 = _permute_fp4_word((a23 >> 16) | (b23 & 0xFFFF0000))
    dst_rows = _load(dst_rows_ptr + rows, row_mask, EVEN_N).to(tl.int64)
    dst = dst_ptr + e * stride_de + dst_rows[:, None] * stride_dn + pairs[None, :]
    _store_words(dst, run, w0, w1, w2, w3, None if EVEN_N else row_mask[:, None])


def _rows_view(w: torch.Tensor, width: int) -> Optional[torch.Tensor]:
    """w [E, N, K] with contiguous experts as [E, N*K/width, width] (same memory), or None."""
    e, n, k = w.shape
    if w.stride(2) != 1 or (n > 1 and w.stride(1) != k) or (n * k) % width:
        return None
    return w.as_strided((e, n * k // width, width), (w.stride(0), width, 1))


def amax_per_expert(w: torch.Tensor) -> torch.Tensor:
    """max |w[e]| as float32 [E] (== w.float().abs().amax(dim=(1, 2)) for finite w)."""
    e, n, k = w.shape
    if e == 0 or n == 0 or k == 0:
        return torch.zeros(e, dtype=torch.float32, device=w.device)
    block_n, block_k = _AMAX_TILE
    flat = _rows_view(w, block_k)
    if flat is not None:  # a max does not care about the shape: read full-width rows
        w = flat
        n, k = w.shape[1:]
    else:
        block_k = min(block_k, next_power_of_2(k))
        block_n = max(1, _AMAX_TILE[0] * _AMAX_TILE[1] // block_k)
    iters = max(1, min(_AMAX_ITERS, cdiv(n, block_n)))
    col_blocks = cdiv(k, block_k)
    programs = cdiv(n, block_n * iters) * col_blocks
    even = n % (block_n * iters) == 0 and k % block_k == 0
    partial = torch.empty((e, programs), dtype=torch.float32, device=w.device)
    _amax_kernel[(programs, e)](w, partial, n, k, col_blocks, programs, *w.stride(),
                                UNIT_K=w.stride(2) == 1, EVEN=even, BLOCK_N=block_n,
                                BLOCK_K=block_k, ITERS=iters, num_warps=_AMAX_WARPS)
    return partial.amax(dim=1)


def _nvfp4_inverse_table(global_scale: torch.Tensor) -> torch.Tensor:
    """[E, 128] float32: quant.quantize_nvfp4's inv_full for block scale byte b (0..127, every
    byte a non-negative e4m3 scale can be) of expert e, by the reference's own torch expressions
    (so on every device the same bits as the reference); 0 where the scale is not > 0."""
    values = torch.arange(128, dtype=torch.uint8, device=global_scale.device)
    full_scale = values.view(q.FP8_DTYPE).float()[None, :] * global_scale[:, None]
    return torch.where(full_scale > 0, 1.0 / full_scale, torch.zeros_like(full_scale))


def _fp4_source(w: torch.Tensor) -> tuple[torch.Tensor, str]:
    """w as the kernel reads it: the int32 view of a 16-bit source whose rows are contiguous
    (pairs of values), else w itself, read column by column."""
    if (w.dtype in (torch.bfloat16, torch.float16) and w.stride(2) == 1
            and w.shape[2] % 2 == 0 and w.stride(0) % 2 == 0 and w.stride(1) % 2 == 0
            and w.data_ptr() % 4 == 0):
        return w.view(torch.int32), "bf16" if w.dtype == torch.bfloat16 else "f16"
    return w, "strided"


def quantize_scatter(
    w: torch.Tensor,
    quant: str,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    scale_dst: Optional[torch.Tensor] = None,
    scale_rows: Optional[torch.Tensor] = None,
    factor: Optional[torch.Tensor] = None,
    factor2: Optional[torch.Tensor] = None,
    next_weight: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Quantize w [E, N, K] (any float dtype, any strides) into the kernel-layout tensors.

    dst gets row r of the quantized w at row dst_rows[r]; scale_dst gets the block scales at
    rows scale_rows[...] (fp8_block: one per 128 rows; fp4: one per row).
    factor / factor2: per-expert float32 [E] (see _fp8_kernel and _fp4_kernel).

    fp8 / fp8_block: dst [E, *, K] e4m3.
    nvfp4 / mxfp4: dst [E, *, Kp/2] uint8, the packed e2m1 rows in kernel order (moe_ops.quant,
    "The kernel order of packed e2m1 rows"; Kp = quant.fp4_padded_k(K)), and scale_dst
    [E, *, Kp/block] (e4m3 for nvfp4, e8m0 as uint8 for mxfp4), the block scales in natural
    order. Whole rows are written: the padding columns K..Kp get zero codes and zero scales.

    next_weight: the next matrix of an nvfp4 preparation, [E, *, *] float; returns its
    per-expert amax (amax_per_expert's), reduced by this launch's programs beside their
    quantization where both are fp4 and next_weight's experts are contiguous, else by
    amax_per_expert after it. None: returns None.
    """
    e, n, k = w.shape
    if e == 0 or n == 0 or k == 0:
        return None if next_weight is None else amax_per_expert(next_weight)
    # The kernel layout's rows are contiguous; rows are addressed through strides 0 and 1.
    assert dst.stride(-1) == 1 and (scale_dst is None or scale_dst.stride(-1) == 1)
    has_scale = scale_dst is not None
    # e4m3 bytes are stored as uint8 (see _to_e4m3).
    dst = dst.view(torch.uint8) if dst.dtype == q.FP8_DTYPE else dst
    if has_scale and scale_dst.dtype == q.FP8_DTYPE:
        scale_dst = scale_dst.view(torch.uint8)
    hw = hw_e4m3(w.device)
    scale_strides = (scale_dst.stride(0), scale_dst.stride(1)) if has_scale else (0, 0)
    scale_arg = scale_dst if has_scale else dst
    scale_rows_arg = scale_rows if scale_rows is not None else dst_rows

    if quant in ("fp8", "fp8_block"):
        block_n, block_k = _FP8_BLOCK_TILE if quant == "fp8_block" else _FP8_TILE
        col_blocks = cdiv(k, block_k)
        _fp8_kernel[(cdiv(n, block_n) * col_blocks, e)](
            w, dst, dst_rows, scale_arg, scale_rows_arg,
            factor if factor is not None else dst_rows,
            n, k, col_blocks, *w.stride(), dst.stride(0), dst.stride(1), *scale_strides,
            QUANT=quant, HW_E4M3=hw, UNIT_K=w.stride(2) == 1,
            EVEN=n % block_n == 0 and k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=_FP8_BLOCK_WARPS if quant == "fp8_block" else _FP8_WARPS,
            enable_fp_fusion=False,
        )
        return None if next_weight is None else amax_per_expert(next_weight)

    _check_fp4_destination(k, quant, dst, scale_dst)
    if quant == "nvfp4":
        table = _nvfp4_inverse_table(factor)
    slices, block_n, block_s, align, col_blocks = _fp4_tiles(n, k)
    src, kind = _fp4_source(w)
    runs = _int32_rows(dst)
    programs = cdiv(n, block_n) * col_blocks
    plan = (_next_amax_plan(next_weight, e, programs, w.device) if next_weight is not None
            else None)
    fused = {}
    if plan is not None:
        flat, next_kind, nb, nk, iters, even = plan
        rows = flat.shape[1]
        next_amax = torch.zeros(e, dtype=torch.int32, device=w.device)
        # the next expert as rows of nk contiguous elements: one column block
        fused = dict(next_ptr=flat, next_amax_ptr=next_amax, next_rows=rows, next_cols=nk,
                     next_col_blocks=1, next_tiles=cdiv(rows, nb * iters),
                     next_stride_e=flat.stride(0), next_stride_n=nk, next_stride_k=1,
                     AMAX_NEXT=True, NEXT_SRC=next_kind, NEXT_UNIT_K=True, NEXT_EVEN=even,
                     NEXT_BLOCK_N=nb, NEXT_BLOCK_K=nk, NEXT_ITERS=iters,
                     PAIR_MAX=_pair_max(w.device))
    _fp4_kernel[(programs, e)](
        src, runs, dst_rows, scale_arg, scale_rows_arg,
        table if quant == "nvfp4" else dst_rows, factor2 if factor2 is not None else dst_rows,
        n, slices, col_blocks, q.fp4_padded_k(k) // 32, *src.stride(), runs.stride(0),
        runs.stride(1), *scale_strides,
        QUANT=quant, SRC=kind, HW_E4M3=hw, EVEN_N=n % block_n == 0, SLICES_ALIGN=align,
        BLOCK_N=block_n, BLOCK_S=block_s, num_warps=_FP4_WARPS, enable_fp_fusion=False,
        **fused,
    )
    if next_weight is None:
        return None
    return next_amax.view(torch.float32) if plan is not None else amax_per_expert(next_weight)


def _check_fp4_destination(k: int, quant: str, dst: torch.Tensor,
                           scale_dst: Optional[torch.Tensor]) -> None:
    kp = q.fp4_padded_k(k)
    assert dst.shape[-1] == kp // 2, "fp4 rows are kernel-order rows of Kp/2 bytes"
    assert scale_dst is None or scale_dst.shape[-1] == kp // q.fp4_scale_block(quant)
    assert k % q.fp4_scale_block(quant) == 0, "fp4 rows are whole scale blocks"


def _fp4_tiles(n: int, k: int) -> tuple[int, int, int, int, int]:
    """The tiles of _fp4_kernel (and of _nvfp4_fused_kernel's quantize programs) for rows of
    K columns: (slices = K/16, BLOCK_N, BLOCK_S, SLICES_ALIGN, column blocks per row block)."""
    slices, padded_slices = k // 16, q.fp4_padded_k(k) // 16
    block_s, align = _fp4_column_tiles(slices, padded_slices, _FP4_MAX_SLICES)
    block_n = min(max(1, _FP4_TILE_SLICES // block_s), next_power_of_2(n))
    return slices, block_n, block_s, align, padded_slices // block_s


def _amax_view(src: torch.Tensor) -> tuple[tuple[int, int, int, int], int, int, int, bool]:
    """How _nvfp4_fused_kernel's amax programs read src (the kernel's source view, [E, N, K]
    elements or int32 pairs): ((rows, cols, row stride, column stride) of each expert seen as a
    matrix, BLOCK_N, BLOCK_K, ITERS, EVEN). A contiguous expert is read as full-width rows of
    _FUSED_AMAX_TILE[1] elements whatever its shape (a max does not care about it: vector loads,
    no masks); otherwise its own rows, in tiles of the same size."""
    block_n, block_k = _FUSED_AMAX_TILE
    flat = _rows_view(src, block_k)
    if flat is not None:
        rows, cols, stride_n, stride_k = flat.shape[1], block_k, block_k, 1
    else:
        rows, cols = src.shape[1:]
        stride_n, stride_k = src.stride(1), src.stride(2)
        block_k = min(block_k, next_power_of_2(cols))
        block_n = max(1, _FUSED_AMAX_TILE[0] * _FUSED_AMAX_TILE[1] // block_k)
    iters = max(1, min(_FUSED_AMAX_ITERS, cdiv(rows, block_n)))
    even = rows % (block_n * iters) == 0 and cols % block_k == 0
    if not even:
        iters = min(iters, _FUSED_AMAX_MASKED_ITERS)
        even = rows % (block_n * iters) == 0 and cols % block_k == 0
    return (rows, cols, stride_n, stride_k), block_n, block_k, iters, even


def _next_amax_plan(next_weight: torch.Tensor, experts: int, programs: int,
                    device: torch.device):
    """How _fp4_kernel's programs (`programs` an expert) reduce next_weight's per-expert amax
    (AMAX_NEXT): (the source as [E, rows, BLOCK_K] contiguous rows, its kind, BLOCK_N, BLOCK_K,
    ITERS, EVEN), or None where the launch cannot: another device or expert count, experts not
    contiguous, nothing to read, rows narrower than 16 elements (an expert whose size has no
    such power of two: scalar loads), or more than _FUSED_AMAX_ITERS tiles a program (a next
    matrix much larger than this one: each ITERS is a build of its own, unrolled, and holds
    registers). An expert is read as
    rows of _FUSED_AMAX_TILE[1] elements (_rows_view; fewer, a power of two, where that does not
    divide the expert) in tiles of _FUSED_AMAX_TILE's size, as many of them a program (ITERS)
    as it takes for the tiles to be no more than the programs."""
    e, n, k = next_weight.shape
    if e != experts or n == 0 or k == 0 or next_weight.device != device:
        return None
    view, kind = _fp4_source(next_weight)
    elements = view.shape[1] * view.shape[2]
    block_k = min(_FUSED_AMAX_TILE[1], elements & -elements)  # a power of two dividing it
    block_n = _FUSED_AMAX_TILE[0] * _FUSED_AMAX_TILE[1] // block_k
    flat = _rows_view(view, block_k)
    if flat is None or block_k < 16:
        return None
    rows = flat.shape[1]
    iters = cdiv(rows, block_n * programs)
    if iters > _FUSED_AMAX_ITERS:
        return None
    return flat, kind, block_n, block_k, iters, rows % (block_n * iters) == 0


def quantize_scatter_nvfp4(
    w: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    scale_dst: torch.Tensor,
    scale_rows: torch.Tensor,
    schedule: Optional[str] = None,
    return_factors: bool = False,
):
    """quantize_scatter(w, "nvfp4", ...) in one launch, its per-expert global scales included
    (_nvfp4_fused_kernel): returns them, float32 [E] (quant.nvfp4_global_scale of each expert's
    amax), written by the kernel (stream-ordered: no synchronization).

    schedule: the order of the amax and quantize programs ("sequential" or "interleaved", see
    _nvfp4_schedule); None = NVFP4_SCHEDULE.
    return_factors: return (global scale, its inverse, the [E, 128] inverse table) instead,
    what the kernel computed (tests compare them with the launcher-side expressions).
    """
    schedule = NVFP4_SCHEDULE if schedule is None else schedule
    assert schedule in NVFP4_SCHEDULES, schedule
    e, n, k = w.shape
    if e == 0 or n == 0 or k == 0:
        zeros = torch.zeros(e, dtype=torch.float32, device=w.device)
        return (zeros, zeros.clone(), zeros.new_zeros(e, 128)) if return_factors else zeros
    assert dst.stride(-1) == 1 and scale_dst.stride(-1) == 1
    _check_fp4_destination(k, "nvfp4", dst, scale_dst)
    if scale_dst.dtype == q.FP8_DTYPE:  # e4m3 bytes are stored as uint8
        scale_dst = scale_dst.view(torch.uint8)
    slices, block_n, block_s, align, col_blocks = _fp4_tiles(n, k)
    src, kind = _fp4_source(w)
    runs = _int32_rows(dst)
    (amax_rows, amax_cols, stride_an, stride_ak), amax_n, amax_k, iters, even = _amax_view(src)
    amax_tiles = cdiv(amax_rows, amax_n * iters) * cdiv(amax_cols, amax_k)
    quant_tiles = cdiv(n, block_n) * col_blocks
    device = w.device
    # Per call: a few bytes per expert (the reload path's temporaries stay small).
    sync = torch.zeros((3, e), dtype=torch.int32, device=device)
    global_scale = torch.empty(e, dtype=torch.float32, device=device)
    inv_global = torch.empty(e, dtype=torch.float32, device=device)
    table = torch.empty((e, 128), dtype=torch.float32, device=device)
    _nvfp4_fused_kernel[(e * (amax_tiles + quant_tiles),)](
        src, runs, dst_rows, scale_dst, scale_rows, sync, global_scale, inv_global, table,
        e, n, slices, col_blocks, q.fp4_padded_k(k) // 32, quant_tiles,
        amax_tiles, amax_rows, amax_cols, cdiv(amax_cols, amax_k),
        *src.stride(), runs.stride(0), runs.stride(1), scale_dst.stride(0), scale_dst.stride(1),
        stride_an, stride_ak,
        SCHEDULE=schedule, WIDE_SCHEDULE=(amax_tiles + quant_tiles) * (amax_tiles + 1) >= 2**31,
        SRC=kind, EVEN_N=n % block_n == 0, SLICES_ALIGN=align,
        BLOCK_N=block_n, BLOCK_S=block_s, AMAX_UNIT_K=stride_ak == 1, AMAX_EVEN=even,
        AMAX_BLOCK_N=amax_n, AMAX_BLOCK_K=amax_k, AMAX_ITERS=iters, PAIR_MAX=_pair_max(w.device),
        num_warps=_FP4_WARPS, enable_fp_fusion=False,
    )
    return (global_scale, inv_global, table) if return_factors else global_scale


def _fp4_column_tiles(slices: int, padded_slices: int, max_slices: int) -> tuple[int, int]:
    """Tile width (16-column slices) and load-mask granularity for kernel-order rows of `slices`
    data slices padded to `padded_slices` (a multiple of 16): the widest power of two up to
    max_slices that divides the padded row (the grid covers it, padding included), and the
    largest power of two up to that width dividing the data (== the width: no padding)."""
    block_s = max_slices
    while padded_slices % block_s:
        block_s //= 2
    return block_s, min(slices & -slices, block_s)


def _int32_rows(dst: torch.Tensor) -> torch.Tensor:
    """The int32 view of kernel-order rows uint8 [E, *, Kp/2] (contiguous rows, strides a
    multiple of 4): what the fp4 kernels store, one slice pair's word of a run at a time."""
    assert _rows_allow(dst, 4)
    return dst.view(torch.int32)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def scatter_rows(src: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[e, dst_rows[r], :K] = src[e, r] for src [E, N, K] of dst's dtype (any strides), bit for
    bit; where dst's rows are longer (fp4 block-scale rows padded to Kp/block), the rest of each
    written row is zeros."""
    e, n, k = src.shape
    if e == 0 or n == 0 or k == 0:
        return
    k_dst = dst.shape[-1]
    # Moved as integers: a copy must not touch the bits (NaN payloads; float8 has no arithmetic
    # here anyway), and as wide ones as the rows allow (a byte-wide scale row moves 8 at once).
    width = src.element_size()
    for wide in (8, 4, 2):
        if wide > width and _rows_allow(src, wide) and _rows_allow(dst, wide):
            width = wide
            break
    ratio = width // src.element_size()
    src_bits = src.view(torch.uint8 if width == 1 else src.dtype).view(_BITS[width])
    dst_bits = dst.view(torch.uint8 if width == 1 else dst.dtype).view(_BITS[width])
    k, k_dst = k // ratio, k_dst // ratio
    block_k = min(triton.next_power_of_2(k_dst), _COPY_TILE_BYTES // width // 4)
    block_n = max(1, _COPY_TILE_BYTES // width // block_k)
    col_blocks = cdiv(k_dst, block_k)
    grid = (cdiv(n, block_n) * col_blocks, e)
    _scatter_rows_kernel[grid](src_bits, dst_bits, dst_rows, n, k, k_dst, col_blocks,
                               *src_bits.stride(), dst_bits.stride(0), dst_bits.stride(1),
                               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def _rows_allow(t: torch.Tensor, width: int) -> bool:
    """Whether t [E, N, K] (contiguous along K) can be viewed as integers of `width` bytes."""
    size = t.element_size()
    return (t.stride(2) == 1 and (t.shape[2] * size) % width == 0
            and (t.stride(1) * size) % width == 0 and (t.stride(0) * size) % width == 0
            and t.data_ptr() % width == 0)


def scatter_fp4_rows(src: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[e, dst_rows[r]] = quant.fp4_to_kernel_order(src[e, r]), bit for bit.

    src: natural packed e2m1 rows (quant.pack_e2m1) uint8 [E, N, K/2], any strides, K a
    multiple of 16. dst: kernel-order rows uint8 [E, *, Kp/2] (moe_ops.quant, "The kernel order
    of packed e2m1 rows"; Kp = quant.fp4_padded_k(K)) with contiguous rows: whole rows are
    written, the padding past K as zeros.
    """
    e, n, row_bytes = src.shape
    if e == 0 or n == 0 or row_bytes == 0:
        return
    k = 2 * row_bytes
    assert k % 16 == 0, "fp4 rows are whole 16-column slices"
    assert src.element_size() == 1 and dst.element_size() == 1
    assert dst.shape[-1] == q.fp4_padded_k(k) // 2 and dst.stride(-1) == 1
    src, dst = src.view(torch.uint8), _int32_rows(dst.view(torch.uint8))
    slices = k // 16
    # Whole slices as int64 words where the rows allow it (contiguous, 8-byte aligned).
    words = _rows_allow(src, 8)
    if words:
        src = src.view(torch.int64)
    padded_slices = dst.shape[-1] // 2     # Kp/16 (rows of Kp/8 words)
    block_s, align = _fp4_column_tiles(slices, padded_slices, _FP4_ORDER_MAX_SLICES)
    block_n = min(max(1, _COPY_TILE_BYTES // (8 * block_s)), next_power_of_2(n))
    col_blocks = padded_slices // block_s
    _fp4_order_rows_kernel[(cdiv(n, block_n) * col_blocks, e)](
        src, dst, dst_rows, n, slices, col_blocks, dst.shape[-1] // 4, *src.stride(),
        dst.stride(0), dst.stride(1), WORDS=words, EVEN_N=n % block_n == 0,
        SLICES_ALIGN=align, BLOCK_N=block_n, BLOCK_S=block_s, num_warps=4,
    )


# mxfp4's fold (quant.mxfp4_fold_scales): a program reads _FOLD_TILE_BYTES of whole scale rows.
_FOLD_TILE_BYTES = 16384


@triton.jit
def _fold_mxfp4_kernel(scale_ptr, row_scale_ptr, R, G, FOLD_MAX: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """Rows r of scale [R, G] (uint8, contiguous): c = max(max_g scale[r] - FOLD_MAX, 0);
    row_scale[r] = 2^c; the bytes rewritten as max(scale - c, 0) in rows where c > 0 only."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_G)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < G)[None, :]
    ptrs = scale_ptr + rows[:, None] * G + cols[None, :]
    s = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    excess = tl.maximum(tl.max(s, axis=1) - FOLD_MAX, 0)
    tl.store(row_scale_ptr + rows, ((excess + 127) << 23).to(tl.float32, bitcast=True),
             mask=row_ok)
    folded = tl.maximum(s - excess[:, None], 0).to(tl.uint8)
    tl.store(ptrs, folded, mask=mask & (excess > 0)[:, None])


def fold_mxfp4_scales(scale: torch.Tensor, row_scale: torch.Tensor) -> None:
    """quant.mxfp4_fold_scales in place: scale uint8 [E, N, G] and row_scale float32 [E, N],
    both contiguous (kernel-layout tensors); one read of the scales, the rows that change
    rewritten."""
    assert scale.dtype == torch.uint8 and row_scale.dtype == torch.float32
    assert scale.is_contiguous() and row_scale.is_contiguous()
    assert tuple(row_scale.shape) == tuple(scale.shape[:-1])
    g = scale.shape[-1]
    r = row_scale.numel()
    if r == 0:
        return
    if g == 0:
        row_scale.fill_(1.0)
        return
    block_g = next_power_of_2(g)
    block_r = max(1, min(_FOLD_TILE_BYTES // block_g, next_power_of_2(r)))
    _fold_mxfp4_kernel[(cdiv(r, block_r),)](scale, row_scale, r, g, FOLD_MAX=q.MXFP4_FOLD_MAX,
                                            BLOCK_R=block_r, BLOCK_G=block_g, num_warps=4)
