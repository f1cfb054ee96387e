"""The GPU-only inline PTX of the 4-bit decode (kernels/fp4_decode.py, _E2M1_BF16_ASM*), run
on the CPU by tests/ptx_emu.py, bit for bit against the formats' values: every code byte, nvfp4 block-scale
multipliers from every finite e4m3 scale, mxfp4 multipliers from every e8m0 byte the kernel
layout holds (0-128, quant.mxfp4_fold_scales). The
Triton interpreter cannot run inline assembly, so without this the fast decode would be tested
on a GPU only.

Operand layout (inline_asm_elementwise with pack=4): $4 holds the 4 packed code bytes of
elements 0-3 (element i in byte i) as the kernel order stores them, the word's bits permuted
(quant.FP4_WORD_BITS), $5 / $6 the bf16 multipliers of elements 0-1 / 2-3; the
outputs $0 / $1 are the low nibbles' values of elements 0-1 / 2-3, $2 / $3 the high nibbles'.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moe_ops import quant as q
from moe_ops.kernels import INTERPRET
from moe_ops.kernels.fp4_decode import (
    MXFP4_FAST_BIAS, NVFP4_FAST_EPILOGUE, _dequant_fp4_tile_bf16_asm,
)
from moe_ops.kernels.grouped_gemm import _E2M1_BF16_ASM, _E4M3_TO_BF16_P117
from ptx_emu import run

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
N = 4096


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Exact float values -> bf16 bit patterns (asserting they are exact in bf16)."""
    t = torch.from_numpy(np.asarray(values, dtype=np.float64))
    b = t.to(torch.bfloat16)
    assert bool(((b.double() == t) | t.isinf()).all())
    return b.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def codes_and_factors(gen: np.random.Generator, factor_values: np.ndarray):
    codes = gen.integers(0, 256, size=(N, 4), dtype=np.uint32)
    codes[:256, 0] = np.arange(256)              # every byte in element 0
    codes[256:512, 3] = np.arange(256)           # and in element 3
    factors = gen.choice(factor_values, size=(N, 4))
    return codes, factors


def decode(asm: str, codes: np.ndarray, factors: np.ndarray):
    fbits = bf16_bits(factors)
    word = torch.from_numpy(codes.astype(np.uint8))             # byte i = element i's codes
    word = q.fp4_permute_word_bits(word).view(torch.int32).numpy().view(np.uint32)[:, 0]
    operands = {4: word,
                5: fbits[:, 0] | fbits[:, 1] << 16, 6: fbits[:, 2] | fbits[:, 3] << 16}
    out = run(asm, operands, [0, 1, 2, 3])
    low = np.stack([out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16], axis=1)
    high = np.stack([out[2] & 0xFFFF, out[2] >> 16, out[3] & 0xFFFF, out[3] >> 16], axis=1)
    return low, high


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_fast_decode_ptx_exact(quant):
    gen = np.random.default_rng(0)
    if quant == "nvfp4":
        # the multiplier is the e4m3 block scale * 2^117 (NVFP4_FAST_EPILOGUE takes the
        # remaining 2^9): every finite e4m3 byte, both signs
        byte = torch.arange(256, dtype=torch.uint8)
        e4m3 = byte.view(torch.float8_e4m3fn).double()
        factor_values = (e4m3[~e4m3.isnan()] * 2.0 ** 117).numpy()
    else:
        # 2^(s - 1) (the bf16 bits (s + MXFP4_FAST_BIAS) << 7) for every byte s of the layout
        s = np.arange(q.MXFP4_FOLD_MAX + 1)
        factor_values = torch.from_numpy(((s + MXFP4_FAST_BIAS.value) << 7).astype(np.int16)).view(
            torch.bfloat16).double().numpy()
        assert np.array_equal(factor_values, 2.0 ** (s - 1.0))
    unit = 2.0 ** -126   # the code's 2^-126 stays in the product
    codes, factors = codes_and_factors(gen, factor_values)
    low, high = decode(_E2M1_BF16_ASM.value, codes, factors)
    assert np.array_equal(low, bf16_bits(E2M1[codes & 15] * factors * unit))
    assert np.array_equal(high, bf16_bits(E2M1[codes >> 4] * factors * unit))


def test_nvfp4_scale_multiplier_ptx_exact():
    """_E4M3_TO_BF16_P117 (pack=4: $2 the 4 scale bytes, $0 / $1 the bf16 multipliers of
    elements 0-1 / 2-3) gives bf16(scale * 2^117) for every e4m3 byte but the two NaNs."""
    gen = np.random.default_rng(1)
    scales = gen.integers(0, 256, size=(N, 4), dtype=np.uint32)
    scales[:256, 0] = np.arange(256)
    scales[256:512, 2] = np.arange(256)
    scales[(scales & 0x7F) == 0x7F] = 0x38  # NaN bytes: no checkpoint holds one
    out = run(_E4M3_TO_BF16_P117.value,
              {2: scales[:, 0] | scales[:, 1] << 8 | scales[:, 2] << 16 | scales[:, 3] << 24},
              [0, 1])
    got = np.stack([out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16], axis=1)
    values = torch.from_numpy(scales.astype(np.uint8)).view(torch.float8_e4m3fn).double()
    assert np.array_equal(got, bf16_bits(values.numpy() * 2.0 ** 117))


def test_emulator_rejects_what_it_does_not_know():
    with pytest.raises(ValueError, match="unsupported"):
        run("cvt.rn.f16x2.e4m3x2 $0, $1;", {1: np.zeros(1, np.uint32)}, [0])


def test_word_bits_are_a_rotation_of_the_decode_fields():
    """quant.FP4_WORD_BITS puts each bf16 pair's fields (P = 0x81C081C0: signs at 15 / 31,
    magnitudes at 8-6 / 24-22) at the rotations the decode head undoes: a single set bit of a
    byte-ordered word decodes (unit multipliers) to exactly one bit of one output."""
    words = np.array([1 << i for i in range(32)], dtype=np.uint32)
    packed = torch.from_numpy(words.view(np.uint8).copy()).view(32, 4)
    permuted = q.fp4_permute_word_bits(packed).view(torch.int32).numpy().view(np.uint32)[:, 0]
    assert sorted(int(v).bit_length() - 1 for v in permuted) == list(range(32))
    one = np.full(32, 0x3F803F80, dtype=np.uint32)
    out = run(_E2M1_BF16_ASM.value, {4: permuted, 5: one, 6: one}, [0, 1, 2, 3])
    for i in range(32):
        j, nibble, b = i // 8, (i // 4) % 2, i % 4
        register = 2 * nibble + j // 2             # lo0, lo1, hi0, hi1
        field = 16 * (j % 2) + (15 if b == 3 else 6 + b)
        got = [int(out[r][i]) for r in range(4)]
        # (the multiply by one keeps a lone magnitude bit; a lone sign bit is -0)
        assert got == [1 << field if r == register else 0 for r in range(4)], i


def _emulated_inline_asm(self, asm, constraints, values, types, is_pure, pack):
    """Triton's interpreter cannot run inline PTX: run it on ptx_emu instead. Operands are
    packed `pack` elements at a time in element order (32 / width of them a register), the
    outputs unpacked the same way."""
    from triton.runtime import interpreter
    words = {8: np.uint8, 16: np.uint16, 32: np.uint32}
    outputs = sum(c.startswith("=") for c in constraints.split(","))
    shape = values[0].data.shape
    groups = int(np.prod(shape)) // pack
    operands, number = {}, outputs
    for value in values:
        data = np.broadcast_to(value.data, shape).reshape(-1)
        bits = data.dtype.itemsize * 8
        elements = data.view(words[bits]).astype(np.uint32).reshape(groups, pack)
        per = 32 // bits
        for r in range(max(1, pack // per)):
            register = np.zeros(groups, np.uint32)
            for j in range(min(per, pack - r * per)):
                register |= elements[:, r * per + j] << np.uint32(bits * j)
            operands[number] = register
            number += 1
    out = run(asm, operands, list(range(outputs)))

    class Call:
        def __init__(self, results):
            self.results = results

        def get_result(self, i):
            return self.results[i]

    results, o = [], 0
    for ty in types:
        element = ty.element_ty if hasattr(ty, "element_ty") else ty
        bits = element.primitive_bitwidth
        per = 32 // bits
        elements = np.zeros((groups, pack), np.uint32)
        registers = max(1, pack // per)
        for r in range(registers):
            for j in range(min(per, pack - r * per)):
                elements[:, r * per + j] = (out[o + r] >> np.uint32(bits * j)) & np.uint32(
                    (1 << bits) - 1)
        o += registers
        data = elements.reshape(shape).astype(words[bits]).view(interpreter._get_np_dtype(element))
        results.append(interpreter.TensorHandle(data, element))
    return Call(results)


@triton.jit
def _fast_decode_kernel(packed_ptr, scale_ptr, out_ptr, K0, KP: tl.constexpr,
                        QUANT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        G: tl.constexpr):
    """One K step (BK columns from K0) of kernel-order rows of KP columns through the fast
    decode."""
    rows = tl.arange(0, BN)
    runs = tl.arange(0, 4)[:, None] * (KP // 8) + K0 // 8 + tl.arange(0, BK // 8)[None, :]
    packed = tl.load(packed_ptr + rows[:, None, None] * (KP // 2) + runs[None])
    scale = tl.load(scale_ptr + rows[:, None] * (KP // G) + K0 // G
                    + tl.arange(0, BK // G)[None, :])
    tl.store(out_ptr + rows[:, None] * BK + tl.arange(0, BK)[None, :],
             _dequant_fp4_tile_bf16_asm(packed, scale, QUANT, BN, BK))



def test_fast_decode_tile_wiring_on_the_emulator(monkeypatch):
    """_dequant_fp4_tile_bf16_asm (the Triton kernels' GPU decode) in the interpreter with its
    inline PTX emulated: the words it forms, which multiplier goes with which slice, and the
    order of its bf16 pairs give the dequantized weight exactly, for every K-step width and
    offset of a padded row. (Which bytes the GPU's register layout would pack together, the
    interpreter cannot show: the GPU tests do.)"""
    if not INTERPRET:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    from triton.runtime import interpreter
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _emulated_inline_asm)

    gen = torch.Generator().manual_seed(3)
    kp, bn = 512, 16
    for quant, group in (("nvfp4", 16), ("mxfp4", 32)):
        natural = torch.randint(0, 256, (bn, kp // 2), dtype=torch.uint8, generator=gen)
        if quant == "nvfp4":
            scale = (torch.rand(bn, kp // group, generator=gen) * 300 + 2 ** -9).to(
                torch.float8_e4m3fn)
        else:
            # the layout's bytes (at most quant.MXFP4_FOLD_MAX), 0 included
            scale = torch.randint(0, q.MXFP4_FOLD_MAX + 1, (bn, kp // group), dtype=torch.uint8,
                                  generator=gen)
        want = q.dequantize_fp4(natural, scale, quant)
        if quant == "nvfp4":
            want = want / NVFP4_FAST_EPILOGUE
        packed = q.fp4_to_kernel_order(natural)
        for bk in (32, 64, 128, 256):
            for k0 in range(0, kp, bk):
                out = torch.full((bn, bk), float("nan"), dtype=torch.bfloat16)
                _fast_decode_kernel[(1,)](packed, scale.view(torch.uint8), out, k0, kp, quant,
                                          bn, bk, group)
                assert torch.equal(out.float(), want[:, k0:k0 + bk]), (quant, bk, k0)
