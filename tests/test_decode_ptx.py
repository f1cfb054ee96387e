"""The GPU-only inline PTX of the 4-bit decode (grouped_gemm._E2M1_BF16_ASM_*), run on the CPU
by tests/ptx_emu.py, bit for bit against the formats' values: every code byte, nvfp4 block-scale
multipliers from every finite e4m3 scale, mxfp4 exponents over the range bf16 holds. The
Triton interpreter cannot run inline assembly, so without this the fast decode would be tested
on a GPU only.

Operand layout (inline_asm_elementwise with pack=4): $4 holds the 4 packed code bytes of
elements 0-3 (element i in byte i), $5 / $6 the bf16 multipliers of elements 0-1 / 2-3; the
outputs $0 / $1 are the low nibbles' values of elements 0-1 / 2-3, $2 / $3 the high nibbles'.
"""
import numpy as np
import pytest
import torch

from moe_ops.kernels.grouped_gemm import (
    _E2M1_BF16_ASM_MXFP4, _E2M1_BF16_ASM_NVFP4, _E4M3_TO_BF16_P117,
)
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
    operands = {4: codes[:, 0] | codes[:, 1] << 8 | codes[:, 2] << 16 | codes[:, 3] << 24,
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
        asm, unit = _E2M1_BF16_ASM_NVFP4.value, 2.0 ** -126   # the code's 2^-126 stays
    else:
        # e8m0 exponents whose products stay finite in bf16 (6 * 2^125 the largest)
        factor_values = 2.0 ** (np.arange(2, 253) - 127.0)
        asm, unit = _E2M1_BF16_ASM_MXFP4.value, 1.0
    codes, factors = codes_and_factors(gen, factor_values)
    low, high = decode(asm, codes, factors)
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


def test_bit_permuted_layout_decodes_the_same(capsys):
    """benchmarks/dev_fp4_bitperm.py (the decode on a bit-permuted packed layout, measured
    before adoption): its bit map is a permutation of the 32 bits, and the permuted decode of
    permuted words equals the current decode of the words for both formats (every byte in
    every position, random words and factors); a word's permutation in torch equals numpy's."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import dev_fp4_bitperm as bp
    bp.check(samples=20000)
    assert capsys.readouterr().out.count("equals the current one") == 2
    dst = bp.bit_map()
    words = np.random.default_rng(1).integers(0, 1 << 32, size=64, dtype=np.uint64).astype(
        np.uint32)
    packed = torch.from_numpy(words.view(np.uint8).copy()).view(4, 64)
    permuted = bp.permute_packed(packed, dst).contiguous().view(torch.int32).numpy().view(
        np.uint32).reshape(-1)
    assert np.array_equal(permuted, bp.permute_words_np(words, dst))
    assert not np.array_equal(permuted, words)
    # the permuted decode is the current one with only its field extraction replaced
    for quant in ("nvfp4", "mxfp4"):
        asm = bp.permuted_asm(quant)
        assert "prmt" not in asm and asm.count("shf.r.wrap.b32") == 4
