"""The quantized formats of SPEC §1: quantize, dequantize, pack, and their constants.

Everything here is plain torch and runs on any device; the GPU kernels quantize activations with
their own Triton code (kernels/act_quant.py) following exactly the rules written here.

Formats
- fp8       float8_e4m3fn weights, one float32 scale per expert per tensor; activations
            quantized per token: s_t = amax(row) / 448.
- fp8_block float8_e4m3fn weights, one float32 scale per 128x128 block; activations per token
            per 128-column group.
- nvfp4     e2m1 values packed two per uint8 (element 2i in the low nibble), an e4m3 scale per
            16 elements along K, and a float32 global scale per expert.
- mxfp4     e2m1 packed the same way, an e8m0 scale (2^(s-127)) per 32 elements along K (in
            the kernel layout folded to at most 2 with a per-row power of two: mxfp4_fold_scales).
"""
from __future__ import annotations

import torch

from moe_ops.errors import check

QUANT_MODES = ("none", "fp8", "fp8_block", "nvfp4", "mxfp4")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # DeepSeek-V3's weight block and activation group size
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E2M1_MAX = 6.0
E8M0_BIAS = 127

# e2m1 code (low 3 bits) -> magnitude; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a value exactly on the midpoint rounds
# up (to the code with an even mantissa: round-to-nearest-even on the e2m1 grid).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def fp4_scale_block(quant: str) -> int:
    return NVFP4_BLOCK if quant == "nvfp4" else MXFP4_BLOCK


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------
def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # Casting a value past 448 to e4m3fn gives NaN (the format has no inf): clamp first. The
    # division by amax/448 can land a hair above 448 after float32 rounding.
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor correctly rounded on every device. torch on CUDA divides by a Python scalar as
    a multiplication by its rounded reciprocal (one ulp off now and then); a tensor divisor
    takes the true division everywhere, so scales are the same bytes on CPU and GPU."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def _inverse_scale(amax: torch.Tensor) -> torch.Tensor:
    """448 / amax, and 0 where amax is 0: a zero block quantizes to zeros, never to NaN."""
    return torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))


def _divide_by_scale(xf: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x / s with s = amax / 448 (SPEC §1), computed as (x * 448) / amax, and 0 where amax is 0.

    Not x * (448 / amax): the rounded reciprocal moves values that sit exactly on an e4m3
    midpoint off it, so they round by the reciprocal's rounding error instead of to even. Such
    ties are common for bf16/fp16 activations (about 1e-3 of the elements), enough to cost ~1%
    relative error against x / s. x * 448 is exact for bf16/fp16 values and the division is
    correctly rounded, so an exact midpoint stays exact and the e4m3 cast rounds it to even.
    """
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    return torch.where(amax > 0, xf * FP8_MAX / safe, torch.zeros_like(xf))


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8 [M, K], scale float32 [M]) with x ~= q * scale[:, None]."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    q = _to_fp8(_divide_by_scale(xf, amax[:, None]))
    return q, _exact_div(amax, FP8_MAX)


def quantize_fp8_per_token_group(
    x: torch.Tensor, group: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8 [M, K], scale float32 [M, ceil(K/group)]), one scale per group."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = xf.abs().amax(dim=-1)
    q = _to_fp8(_divide_by_scale(xf, amax[:, :, None])).view(m, groups * group)[:, :k]
    return q.contiguous(), _exact_div(amax, FP8_MAX)


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (q float8 [E, N, K], scale float32 [E]): one scale per expert."""
    wf = w.float()
    amax = wf.abs().amax(dim=(1, 2))
    q = _to_fp8(wf * _inverse_scale(amax)[:, None, None])
    return q, _exact_div(amax, FP8_MAX)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (q float8 [E, N, K], scale float32 [E, ceil(N/b), ceil(K/b)])."""
    e, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    blocks = padded.view(e, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(2, 4))
    q = _to_fp8(blocks * _inverse_scale(amax)[:, :, None, :, None])
    q = q.view(e, nb * block, kb * block)[:, :n, :k].contiguous()
    return q, _exact_div(amax, FP8_MAX)


def expand_block_scales(scale: torch.Tensor, n: int, k: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """Block scales [..., ceil(N/b), ceil(K/b)] -> one scale per element [..., N, K]."""
    return scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]


# ---------------------------------------------------------------------------------------------
# e2m1 (fp4) values, packed two per byte
# ---------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float values to the nearest e2m1 code (ties to even, saturating at 6): uint8 in 0..15."""
    xf = x.float()
    magnitude = xf.abs()
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_ROUNDS_UP):
        above = magnitude >= midpoint if tie_up else magnitude > midpoint
        code += above.to(torch.uint8)
    sign = (xf < 0).to(torch.uint8) << 3
    # -0 keeps code 0: a negative value that rounds to zero is stored as +0.
    return torch.where(code == 0, code, code | sign)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=code.device)
    magnitude = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (K even) -> uint8 [..., K/2], element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# The kernel order of packed e2m1 rows (what the W4A16 GEMMs stream)
# ---------------------------------------------------------------------------------------------
# Hopper's MMA takes the (dequantized) weight tile from registers in a fixed fragment layout:
# in each 16-wide slice c of K, thread t of a group of four holds elements 16c + 2t + q and
# 16c + 2t + q + 8 (q = 0, 1). The kernel order puts exactly those codes in one byte and all of
# a thread's bytes of a row next to each other, so a K step is one wide load a thread and the
# e2m1 decode needs no byte shuffles (2.2x faster decode GEMMs than the natural order on an
# H200, benchmarks/results/h200_fp4_layout.json). A row of K codes, padded with zero codes to
# Kp = K rounded up to FP4_K_ALIGN (so every K step of up to 256 columns reads whole runs,
# unmasked), is 4 runs of Kp/8 bytes:
#     byte t * Kp/8 + 2c + q  =  code(16c + 2t + q)  |  code(16c + 2t + q + 8) << 4
# and then each little-endian 32-bit word of it (bytes (c, 0), (c, 1), (c + 1, 0), (c + 1, 1)
# of a run, c even: the 8 codes one decode step turns into four bf16 pairs) has its bits
# permuted (FP4_WORD_BITS), so that the decode is 9 integer operations for 8 values instead of
# ~16. The decode wants each bf16 pair's two codes with their signs at bits 15 / 31 and their
# magnitudes at bits 8-6 / 24-22 (P = 0x81C081C0: the bf16 bits of value * 2^-126); in the
# permuted word the pair of the bytes' low nibbles of (c, 0), (c, 1) sits at P, that of slice
# c + 1 at P rotated left by 4, the high nibbles of slice c at P rotated by 10, and those of
# slice c + 1 in two parts rotated by 14 (the magnitudes' lowest bits) and 6 (the rest): four
# rotations of P cannot tile the 32 bits (the differences of {6, 7, 8, 15} mod 16 leave no
# fourth translate), hence the split. The decode: an and, three rotate-and pairs, then a
# rotate, an and and an or (10 PTX instructions, 9 in SASS: fp4_decode._E2M1_BF16_ASM_HEAD;
# ws_fp4's K loop 3.30 -> 2.43 SASS instructions a weight value on sm_90).
# Block scales keep their natural order, padded with zeros to Kp / block (value 0 * 0 = 0).
FP4_K_ALIGN = 256


def _fp4_word_bits() -> tuple[int, ...]:
    """FP4_WORD_BITS[i]: where bit i of a byte-ordered word goes in the kernel-order word.
    Bit i is bit b (3: the sign) of the nibble n (0: low) of byte j (i = 8j + 4n + b); the
    byte's pair is j // 2 (slice c or c + 1), its half of the bf16 pair j % 2."""
    rotation = {(0, 0): (0, 0), (0, 1): (4, 4), (1, 0): (10, 10), (1, 1): (14, 6)}
    bits = []
    for j in range(4):
        for n in range(2):
            low_rotation, rotation_rest = rotation[(n, j // 2)]
            half = 16 * (j % 2)
            for b in range(4):
                field = half + (15 if b == 3 else 6 + b)          # P's bit in its half
                bits.append((field + (low_rotation if b == 0 else rotation_rest)) % 32)
    assert sorted(bits) == list(range(32))
    return tuple(bits)


FP4_WORD_BITS = _fp4_word_bits()


def _rotation_groups(bits: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A bit permutation as (left rotation, mask of the source bits it moves) pairs."""
    groups: dict[int, int] = {}
    for i, d in enumerate(bits):
        groups[(d - i) % 32] = groups.get((d - i) % 32, 0) | 1 << i
    return tuple(sorted(groups.items()))


def fp4_permute_word_bits(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Byte-ordered packed rows uint8 [..., Kp/2] -> the kernel order (FP4_WORD_BITS applied to
    each little-endian 32-bit word), or back with inverse=True. Any device."""
    bits = FP4_WORD_BITS
    if inverse:
        back = [0] * 32
        for i, d in enumerate(bits):
            back[d] = i
        bits = tuple(back)
    groups = _rotation_groups(bits)
    words = rows.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    # in chunks: the int64 temporaries of a whole checkpoint tensor would be ~10x its bytes
    for start in range(0, words.numel(), _PERMUTE_CHUNK):
        chunk = words[start:start + _PERMUTE_CHUNK].to(torch.int64) & 0xFFFFFFFF
        permuted = torch.zeros_like(chunk)
        for rotation, mask in groups:
            moved = chunk & mask
            permuted |= ((moved << rotation) | (moved >> (32 - rotation))) & 0xFFFFFFFF
        out[start:start + _PERMUTE_CHUNK] = permuted.to(torch.int32)
    return out.view(torch.uint8).view(rows.shape)


_PERMUTE_CHUNK = 1 << 22     # words (16 MiB of packed bytes)


def fp4_padded_k(k: int) -> int:
    """K of a kernel-order row: K rounded up to FP4_K_ALIGN."""
    return -(-k // FP4_K_ALIGN) * FP4_K_ALIGN


def fp4_to_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Natural packed rows uint8 [..., K/2] -> kernel order [..., Kp/2] (see FP4_K_ALIGN)."""
    k = packed.shape[-1] * 2
    kp = fp4_padded_k(k)
    codes = unpack_e2m1(packed)
    if kp != k:
        codes = torch.nn.functional.pad(codes, (0, kp - k))
    codes = codes.unflatten(-1, (kp // 16, 2, 4, 2))            # [..., c, h, t, q]
    byte = codes.select(-3, 0) | (codes.select(-3, 1) << 4)     # [..., c, t, q]
    return fp4_permute_word_bits(byte.transpose(-3, -2).flatten(-3))   # [..., t, c, q]


def fp4_from_kernel_order(kernel: torch.Tensor, k: int) -> torch.Tensor:
    """Kernel-order rows uint8 [..., Kp/2] -> natural packed [..., K/2] (the inverse)."""
    kp = kernel.shape[-1] * 2
    check(kp == fp4_padded_k(k), "kernel-order fp4 rows", f"{fp4_padded_k(k) // 2} bytes for K={k}", kp // 2)
    byte = fp4_permute_word_bits(kernel, inverse=True)
    byte = byte.unflatten(-1, (4, kp // 16, 2)).transpose(-3, -2)    # [..., c, t, q]
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-3)             # [..., c, h, t, q]
    return pack_e2m1(codes.flatten(-4)[..., :k])


def fp4_pad_scales(scale: torch.Tensor, k: int, quant: str) -> torch.Tensor:
    """Block scales [..., K/block] -> [..., Kp/block], zero-padded (any dtype, by its bytes)."""
    block = fp4_scale_block(quant)
    extra = (fp4_padded_k(k) - k) // block
    if extra == 0:
        return scale
    raw = scale.view(torch.uint8)
    return torch.nn.functional.pad(raw, (0, extra)).view(scale.dtype)


# ---------------------------------------------------------------------------------------------
# nvfp4 and mxfp4
# ---------------------------------------------------------------------------------------------
def nvfp4_global_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert amax -> (global scale, its inverse or 0 for a zero expert), float32.

    Shared with the device preparation (kernels/prepare.py), so both give the same bits: the
    division is the correctly rounded one on every device (_exact_div; the fused preparation
    kernel computes it in-kernel as such), the inverse a reciprocal (correctly rounded too).
    """
    global_scale = _exact_div(amax, FP8_MAX * E2M1_MAX)
    inv_global = torch.where(global_scale > 0, 1.0 / global_scale, torch.zeros_like(global_scale))
    return global_scale, inv_global


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (packed uint8 [E, N, K/2], block scale e4m3 [E, N, K/16], global f32 [E]).

    The global scale maps the tensor's amax to the largest block scale times the largest e2m1
    value (448 * 6), so block scales use e4m3's whole range.
    """
    e, n, k = w.shape
    wf = w.float()
    global_scale, inv_global = nvfp4_global_scale(wf.abs().amax(dim=(1, 2)))
    blocks = wf.view(e, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = _to_fp8(_exact_div(block_amax, E2M1_MAX) * inv_global[:, None, None])
    full_scale = block_scale.float() * global_scale[:, None, None]
    inv_full = torch.where(full_scale > 0, 1.0 / full_scale, torch.zeros_like(full_scale))
    codes = e2m1_encode(blocks * inv_full[..., None]).view(e, n, k)
    return pack_e2m1(codes), block_scale, global_scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (packed uint8 [E, N, K/2], e8m0 scale uint8 [E, N, K/32]).

    The block exponent is ceil(log2(amax / 6)), so the largest element maps to at most 6 and
    nothing saturates (OCP's floor(log2(amax)) - 2 can clip up to a third of the largest value).
    It is computed exactly, from frexp (y = m * 2^x with m in [0.5, 1): ceil(log2 y) is x, or
    x - 1 when m is exactly 0.5), not through a float log2: a rounded log2 of a y a few ulps
    above a power of two can land on the integer and give one less (float32 inputs only), and
    the result would then depend on the device's log2. Weights are finite.
    """
    e, n, k = w.shape
    blocks = w.float().view(e, n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    mantissa, power = torch.frexp(_exact_div(amax, E2M1_MAX))
    exponent = (power - (mantissa == 0.5).to(power.dtype)).float()
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_encode(blocks * torch.exp2(-exponent)[..., None]).view(e, n, k)
    return pack_e2m1(codes), (exponent + E8M0_BIAS).to(torch.uint8)


# mxfp4's kernel layout keeps every block-scale byte at most MXFP4_FOLD_MAX (scale <= 2), with
# the rest of a row's exponent in a per-row power of two (the layout's w13/w2_global_scale,
# applied to the accumulator like nvfp4's global scale): then the GPU decode's multiplier
# 2^(s - 1) (the e2m1 field's 2^-126 and the scale in one bf16 multiply, half the multiplies of
# taking 2^126 first) is a normal bf16 for every byte. Checkpoints hold s <= 128 in practice
# (weights below 12): their bytes pass unchanged and the row scale is 1.
MXFP4_FOLD_MAX = 128


def mxfp4_fold_scales(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e8m0 block scales uint8 [..., N, G] -> (the kernel layout's bytes [..., N, G], the row
    scale float32 [..., N]): a row whose largest byte m passes MXFP4_FOLD_MAX gives up
    c = m - MXFP4_FOLD_MAX of every byte to its row scale 2^c. Exact for every byte >= c; a byte
    below c (a block under 2^-127 of its row's largest, far below bf16's resolution of the
    row's dot products) is clamped to 0 (2^c * 2^-127). The device preparation's fold
    (kernels/prepare.py) gives the same bytes."""
    top = scale.amax(dim=-1).to(torch.int32) if scale.shape[-1] else torch.zeros(
        scale.shape[:-1], dtype=torch.int32, device=scale.device)
    excess = (top - MXFP4_FOLD_MAX).clamp(min=0)
    folded = (scale.to(torch.int32) - excess[..., None]).clamp(min=0).to(torch.uint8)
    # 2^excess by its float32 bits (exact on every device; excess <= 126)
    return folded, ((excess + 127) << 23).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scale.float() - E8M0_BIAS)


def dequantize_fp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    quant: str,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] with its block scales -> float32 [..., N, K].

    `row_scale` [..., N] is the kernel layout's per-row scale: nvfp4's global scale expanded per
    row, mxfp4's fold (mxfp4_fold_scales).
    """
    values = e2m1_decode(unpack_e2m1(packed))
    block = fp4_scale_block(quant)
    scale = block_scale.float() if quant == "nvfp4" else e8m0_to_float(block_scale)
    values = values * scale.repeat_interleave(block, dim=-1)
    if row_scale is not None:
        values = values * row_scale[..., None].float()
    return values
