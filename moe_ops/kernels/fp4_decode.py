"""The 4-bit (nvfp4 / mxfp4) weight decode of the W4A16 GEMMs: kernel-order packed e2m1 words
and their block scales -> bf16 (or fp16) weight tiles.

Shared by grouped_gemm's Triton kernel (`_dequant_fp4_tile`, portable, and
`_dequant_fp4_tile_bf16_asm`, inline PTX on the GPU) and ws_fp4's Gluon kernel (the PTX
constants). Its own module so that the tuned tables of the other modes do not depend on it:
moe_ops.tuning hashes it into the kernel source of the 4-bit problems only. The layout it reads
is moe_ops.quant's kernel order ("The kernel order of packed e2m1 rows").
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1_to_fp32(code):
    """e2m1 codes (int32, bits 0-3; bit 3 the sign) -> their float32 values, exactly.

    Bit arithmetic instead of a table lookup (a per-element gather): the 3 magnitude bits em are
    e2m1's exponent (2 bits) and mantissa (1 bit). For em >= 2 (normal numbers, 2^(e-1)(1+m/2))
    they go into float32's low exponent bits and top mantissa bit, rebiased by 126; em = 1 is
    e2m1's one subnormal (0.5 = 126 << 23 in float32) and em = 0 is zero, hence em * (126 << 23)
    for those two. No float32 subnormal is ever formed, so nothing depends on flush-to-zero.
    """
    em = code & 7
    magnitude = tl.where(em >= 2, (em << 22) + (126 << 23), em * (126 << 23))
    return (magnitude | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_scale_per_code(scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Block scales [BLOCK_N, BLOCK_K / GROUP] -> broadcast over the kernel-order tile
    [BLOCK_N, 4 (t), BLOCK_K / 16 (c), 2 (q)]: codes of slice c share group c (16-wide groups)
    or c // 2 (32-wide)."""
    C: tl.constexpr = BLOCK_K // 16
    if GROUP == 16:
        per_code = tl.broadcast_to(scale[:, None, :, None], (BLOCK_N, 4, C, 2))
    else:
        per_code = tl.reshape(tl.broadcast_to(scale[:, None, :, None, None],
                                              (BLOCK_N, 4, C // 2, 2, 2)), (BLOCK_N, 4, C, 2))
    return per_code


@triton.jit
def _fp4_natural_k(low, high, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decoded low / high nibbles of a kernel-order tile [BLOCK_N, 4 (t), C (c), 2 (q)] ->
    [BLOCK_N, BLOCK_K] in natural K order: column 16c + 8h + 2t + q (quant.py's kernel order)."""
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 4, 1, 3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _dequant_fp4_tile(packed, scale, QUANT: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """One K step of a kernel-order packed weight -> [BLOCK_N, BLOCK_K] in DTYPE, K natural.

    packed: uint8 [BLOCK_N, 4, BLOCK_K / 8], thread-group t's run of the step (quant.py,
    "kernel order"); scale: uint8 [BLOCK_N, BLOCK_K / G], one per G-wide group along K (G = 16
    for nvfp4: e4m3 bits, 32 for mxfp4: e8m0). The launcher hands e4m3 scales over as their
    bytes. The product value * scale is formed in float32 and is exact there (2 + 4 significant
    bits for nvfp4, a power of two for mxfp4), so the final cast to bf16 (or fp16, within its
    range) is exact as well: the dot sees exactly the dequantized weight of SPEC section 1.
    """
    if QUANT == "nvfp4":
        s = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # e8m0: 2^(s - 127) is float32 with exponent field s; s = 0 (2^-127, a float32
        # subnormal) is spelled out.
        biased = scale.to(tl.int32)
        s = tl.where(biased == 0, 5.877471754111438e-39, (biased << 23).to(tl.float32, bitcast=True))
    s = _fp4_scale_per_code(s, BLOCK_N, BLOCK_K, 16 if QUANT == "nvfp4" else 32)
    low, high = _fp4_word_codes(packed, BLOCK_N, BLOCK_K)
    low = (_e2m1_to_fp32(low) * s).to(DTYPE)
    high = (_e2m1_to_fp32(high) * s).to(DTYPE)
    return _fp4_natural_k(low, high, BLOCK_N, BLOCK_K)


@triton.jit
def _rotr32(x, n: tl.constexpr):
    """uint32 x rotated right by n (0 < n < 32)."""
    return (x >> n) | (x << (32 - n))


@triton.jit
def _pair_codes(pair):
    """A bf16 pair's fields (sign at bits 15 / 31, magnitude at 8-6 / 24-22 of uint32, the
    rest zero) -> the two e2m1 codes (int32, bit 3 the sign)."""
    first = ((pair >> 12) & 8) | ((pair >> 6) & 7)
    second = ((pair >> 28) & 8) | ((pair >> 22) & 7)
    return first.to(tl.int32), second.to(tl.int32)


@triton.jit
def _fp4_words(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Kernel-order bytes [BLOCK_N, 4, BLOCK_K / 8] -> their little-endian 32-bit words,
    uint32 [BLOCK_N, 4, BLOCK_K / 32] (a word: slices 2p and 2p + 1 of a run)."""
    byte = tl.reshape(packed, (BLOCK_N, 4, BLOCK_K // 32, 4)).to(tl.uint32)
    return tl.sum(byte << (8 * tl.arange(0, 4)).to(tl.uint32)[None, None, None, :], axis=3)


@triton.jit
def _fp4_nibble_tile(pair0, pair1, BLOCK_N: tl.constexpr, C: tl.constexpr,
                     CODES: tl.constexpr):
    """The two bf16-pair registers of one nibble of the words, uint32 [BLOCK_N, 4, C / 2] each
    (pair0: bytes (2p, 0), (2p, 1); pair1: (2p + 1, 0), (2p + 1, 1)) -> [BLOCK_N, 4 (t), C (c),
    2 (q)]: their e2m1 codes (CODES: fields as the decode head leaves them) or their bf16
    values (the asm's products). (join stacks along a new last axis: [..., slice parity, q]
    from a c / b d.)"""
    if CODES:
        a, b = _pair_codes(pair0)
        c, d = _pair_codes(pair1)
    else:
        a, b = _bf16_pair(pair0)
        c, d = _bf16_pair(pair1)
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (BLOCK_N, 4, C, 2))


@triton.jit
def _fp4_word_codes(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Kernel-order bytes [BLOCK_N, 4, BLOCK_K / 8] -> the e2m1 codes of their low and high
    nibbles (as if the words' bits were not permuted), each [BLOCK_N, 4 (t), C (c), 2 (q)]:
    the fast path's field extraction (_E2M1_BF16_ASM_HEAD) in portable operations."""
    C: tl.constexpr = BLOCK_K // 16
    word = _fp4_words(packed, BLOCK_N, BLOCK_K)
    P: tl.constexpr = 0x81C081C0
    lo0 = word & P
    lo1 = _rotr32(word, 4) & P
    hi0 = _rotr32(word, 10) & P
    hi1 = (_rotr32(word, 14) & 0x00400040) | (_rotr32(word, 6) & 0x81808180)
    return (_fp4_nibble_tile(lo0, lo1, BLOCK_N, C, True),
            _fp4_nibble_tile(hi0, hi1, BLOCK_N, C, True))


# The GPU path of the e2m1 decode (bf16 dots), a kernel-order word (8 values) per asm block:
# 10 integer instructions (9 in SASS) and 4 bf16x2 multiplies for the 8,
# where the portable bit arithmetic above takes about 10 instructions a value (and the kernel
# order's bytes without the word permutation took 2 prmt and 16 shifts and masks). Why it
# matters: streaming 4-bit weights at 4.55 TB/s is 9.1e12 values/s, about 35 values per clock
# per SM of an H200, while its integer pipe does 64 lane-operations per clock per SM.
# The kernel order's words (moe_ops.quant, FP4_WORD_BITS) hold each bf16 pair's two codes with
# their signs at bits 15 / 31 and their magnitudes at bits 8-6 / 24-22 of some rotation of the
# word: masked with P = 0x81C081C0 the 3 magnitude bits sit in bf16's two lowest exponent bits
# and top mantissa bit, the bf16 bits of value * 2^-126 (em = 1, the e2m1 subnormal 0.5,
# becomes a bf16 subnormal; the bf16 FMA keeps subnormals). The multiplier $5/$6 brings the
# 2^-126 back together with the block scale in one multiply: nvfp4's is scale * 2^117 (the last
# 2^9 is applied to the accumulator with the global scale, so no bf16 ever overflows), mxfp4's
# 2^(s-1) for its e8m0 byte s, a normal bf16 because the kernel layout keeps s <= 128
# (quant.mxfp4_fold_scales: the rest of a row's exponent is its row scale, applied to the
# accumulator; before the fold mxfp4 took 2^126 first and the scale second, 8 multiplies a
# word instead of 4: 2.83 instructions a value in ws_fp4's K loop, nvfp4's 2.43). lo0 / lo1: the low nibbles of bytes 0-1 / 2-3 (slices c / c + 1), hi0 /
# hi1 the high nibbles: the word itself, rotated right by 4, by 10, and by 14 and 6 in part.
def _ptx_sign_and_field(dst: str, src: str, sign_shift: int, field_shift: int,
                        field_mask: str) -> str:
    """PTX lines for dst = ((src << sign_shift) & 0x80008000) | ((src >> field_shift) &
    field_mask), m being scratch (dst may be src): in each 16-bit half, a sign bit moved to
    bit 15 and a magnitude field moved into place, the rest cleared."""
    sign = (f"shl.b32 {dst}, {src}, {sign_shift};\nand.b32 {dst}, {dst}, 0x80008000;\n"
            if sign_shift else f"and.b32 {dst}, {src}, 0x80008000;\n")
    return (f"shr.b32 m, {src}, {field_shift};\nand.b32 m, m, {field_mask};\n" + sign
            + f"or.b32 {dst}, {dst}, m;\n")


_E2M1_P = 0x81C081C0
_E2M1_BF16_ASM_HEAD = (
    ".reg .b32 lo0, lo1, hi0, hi1, m, t;\n"
    f"and.b32 lo0, $4, {_E2M1_P:#x};\n"
    "shf.r.wrap.b32 lo1, $4, $4, 4;\n"
    f"and.b32 lo1, lo1, {_E2M1_P:#x};\n"
    "shf.r.wrap.b32 hi0, $4, $4, 10;\n"
    f"and.b32 hi0, hi0, {_E2M1_P:#x};\n"
    "shf.r.wrap.b32 t, $4, $4, 14;\n"
    "and.b32 t, t, 0x00400040;\n"
    "shf.r.wrap.b32 hi1, $4, $4, 6;\n"
    "and.b32 hi1, hi1, 0x81808180;\n"
    "or.b32 hi1, hi1, t;\n")
_E2M1_BF16_ASM = tl.constexpr("{\n" + _E2M1_BF16_ASM_HEAD + """
mul.rn.bf16x2 $0, lo0, $5;
mul.rn.bf16x2 $1, lo1, $6;
mul.rn.bf16x2 $2, hi0, $5;
mul.rn.bf16x2 $3, hi1, $6;
}
""")
# e4m3 block scales (4 a register) -> bf16 scale * 2^117 (two bf16x2): each byte to the high
# byte of a 16-bit half, its sign kept at bit 15 and its 7 magnitude bits moved to bits 10-4:
# the bf16 bits of scale * 2^-120, exactly (an e4m3 subnormal becomes a bf16 subnormal); then
# * 2^127 * 2^110 (two steps: 2^237 is no bf16). e4m3's NaN (0x7f) comes out finite (no valid
# checkpoint has one; the portable decode keeps it NaN). The conversion chain it replaced
# (e4m3 -> f16 -> f32, * 2^117, -> bf16) took about 4 instructions a scale against 2.5: the
# DeepSeek-V3 decode loop 702 -> 650 instructions a K step of a thread, the experts call 4-6%
# faster at T = 1-64 (results/h200_fp4_scale_asm.log).
_E4M3_TO_BF16_P117 = tl.constexpr(
    "{\n.reg .b32 t0, t1, m, z;\nmov.b32 z, 0;\n"
    "prmt.b32 t0, $2, z, 0x1404;\nprmt.b32 t1, $2, z, 0x3424;\n"
    + _ptx_sign_and_field("t0", "t0", 0, 4, "0x07F007F0")
    + _ptx_sign_and_field("t1", "t1", 0, 4, "0x07F007F0")
    + "mov.b32 m, 0x7F007F00;\nmul.rn.bf16x2 t0, t0, m;\nmul.rn.bf16x2 t1, t1, m;\n"
    "mov.b32 m, 0x76807680;\nmul.rn.bf16x2 $0, t0, m;\nmul.rn.bf16x2 $1, t1, m;\n}")
# nvfp4's block-scale multiplier in the bf16 fast path is scale * 2^117 (not 2^126: 448 * 2^126
# overflows bf16); the accumulator takes the remaining 2^9.
NVFP4_FAST_EPILOGUE = 512.0
# mxfp4's: 2^(s - 1), i.e. the bf16 bits (s + MXFP4_FAST_BIAS) << 7 (s <= 128 in the layout).
MXFP4_FAST_BIAS = tl.constexpr(126)


@triton.jit
def _bf16_pair(bits):
    """uint32 [...] -> its two bf16 halves (low, high) as tensors of the same shape."""
    return ((bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True),
            (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _doubled_bf16(factor):
    """bf16 [...] -> uint32 [...] holding it in both halves (a bf16x2 multiplier)."""
    bits = factor.to(tl.uint16, bitcast=True).to(tl.uint32)
    return bits | (bits << 16)


@triton.jit
def _dequant_fp4_tile_bf16_asm(packed, scale, QUANT: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    """_dequant_fp4_tile for bf16 on the GPU (inline PTX; see _E2M1_BF16_ASM_HEAD). nvfp4's
    result is the dequantized weight / 512 (NVFP4_FAST_EPILOGUE), exactly.

    The asm takes one kernel-order word (formed explicitly, _fp4_words: a pack of 4 bytes
    would follow the register order of whatever layout the compiler gives the operands, not
    the memory's words) and the bf16x2 multipliers of its two slices, and gives the four bf16
    pairs of the MMA's register fragment (low nibbles of slice c, of c + 1, high nibbles of c,
    of c + 1)."""
    C: tl.constexpr = BLOCK_K // 16
    word = _fp4_words(packed, BLOCK_N, BLOCK_K)                             # [BN, 4, C/2]
    if QUANT == "nvfp4":
        # scale * 2^117 by bit moves (_E4M3_TO_BF16_P117): bit for bit what the conversion
        # chain e4m3 -> f16 -> f32, * 2^117, -> bf16 gives (NaN bytes aside), in fewer
        # instructions (each byte converted on its own: any packing of the bytes is right)
        factor = tl.inline_asm_elementwise(_E4M3_TO_BF16_P117, "=r,=r,r", [scale],
                                           dtype=tl.bfloat16, is_pure=True, pack=4)
        fa, fb = tl.split(tl.reshape(_doubled_bf16(factor), (BLOCK_N, C // 2, 2)))
    else:
        fa = _doubled_bf16(((scale.to(tl.int16) + MXFP4_FAST_BIAS) << 7).to(
            tl.bfloat16, bitcast=True))  # 2^(s - 1): the code's 2^-126 and 2^(s - 127)
        fb = fa
    lo0, lo1, hi0, hi1 = tl.inline_asm_elementwise(
        _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r",
        [word, tl.broadcast_to(fa[:, None, :], word.shape),
         tl.broadcast_to(fb[:, None, :], word.shape)],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    return _fp4_natural_k(_fp4_nibble_tile(lo0, lo1, BLOCK_N, C, False),
                          _fp4_nibble_tile(hi0, hi1, BLOCK_N, C, False), BLOCK_N, BLOCK_K)
