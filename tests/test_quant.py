"""moe_ops.quant: the formats of SPEC §1 (e2m1 codes and their packing, fp8 per token / group /
tensor / block, nvfp4, mxfp4), against decoders and encoders written here from the SPEC text."""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from float64_moe import e2m1_decode64, e4m3_decode, e8m0_decode, quantize_activation64, unpack_nibbles
from moe_ops import quant as q

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# SPEC §1: "e2m1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bit 3 is the sign)".
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
FP8_MAX = 448.0


def expected_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code, saturating at 6), by brute force."""
    v = v.double()
    magnitude = v.abs().clamp(max=6.0)
    distance = (magnitude[..., None] - GRID).abs()
    candidates = distance == distance.min(dim=-1, keepdim=True).values
    first = candidates.to(torch.int64).argmax(dim=-1)  # the lower of the (at most two) candidates
    tie = candidates.sum(dim=-1) == 2
    code = torch.where(tie & (first % 2 == 1), first + 1, first)
    return torch.where((v < 0) & (code != 0), code | 8, code)


def same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Code equality, with -0 (code 8) and +0 (code 0) the same value."""
    a, b = a.long(), b.long()
    return torch.equal(torch.where(a == 8, 0, a), torch.where(b == 8, 0, b))


def random_rows(gen, m, k, dtype, spread=3.0):
    """Rows of very different magnitudes (10^-spread .. 10^spread), some signs flipped."""
    scale = torch.pow(10.0, (torch.rand(m, 1, generator=gen) * 2 - 1) * spread)
    return (torch.randn(m, k, generator=gen) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# e2m1
# ---------------------------------------------------------------------------------------------
def test_e2m1_decode_is_the_spec_table():
    codes = torch.arange(16, dtype=torch.uint8)
    values = q.e2m1_decode(codes).double()
    assert torch.equal(values[:8], GRID) and torch.equal(values[8:], -GRID)
    assert torch.equal(values, e2m1_decode64(codes))


def test_e2m1_round_trip_on_the_whole_grid():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode64(codes)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        encoded = q.e2m1_encode(values.to(dtype))
        assert encoded.dtype == torch.uint8
        assert same_codes(encoded, codes), dtype
        assert torch.equal(e2m1_decode64(encoded), values)


def test_e2m1_midpoints_round_to_even():
    midpoints = (GRID[:-1] + GRID[1:]) / 2  # 0.25, 0.75, ..., 5
    for sign in (1.0, -1.0):
        v = sign * midpoints
        got = q.e2m1_encode(v.float())
        assert same_codes(got, expected_e2m1_codes(v))
        # The even code of each pair: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2,
        # 3.5 -> 4, 5 -> 4.
        assert (e2m1_decode64(got).abs() == torch.tensor([0, 1, 1, 2, 2, 4, 4.0], dtype=torch.float64)).all()
        above = torch.nextafter(v.float(), torch.full_like(v.float(), sign * math.inf))
        below = torch.nextafter(v.float(), torch.zeros_like(v.float()))
        assert (e2m1_decode64(q.e2m1_encode(above)).abs() == GRID[1:]).all()
        assert (e2m1_decode64(q.e2m1_encode(below)).abs() == GRID[:-1]).all()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
       scale=st.sampled_from((0.3, 1.0, 3.0, 10.0)))
def test_e2m1_encode_is_nearest_ties_to_even(seed, dtype, scale):
    gen = torch.Generator().manual_seed(seed)
    v = (torch.randn(4096, generator=gen) * scale).to(dtype)
    # Exact grid values and midpoints mixed in.
    special = torch.cat((GRID, -GRID, (GRID[:-1] + GRID[1:]) / 2, -(GRID[:-1] + GRID[1:]) / 2))
    v[:special.numel()] = special.to(dtype)
    assert same_codes(q.e2m1_encode(v), expected_e2m1_codes(v))
    assert (e2m1_decode64(q.e2m1_encode(v * 100)).abs() <= 6).all()  # saturates, no wrap


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0, 8, 7]], dtype=torch.uint8)
    assert q.pack_e2m1(codes).tolist() == [[0x21, 0x0F, 0x78]]
    assert q.unpack_e2m1(torch.tensor([0x21, 0x0F, 0x78], dtype=torch.uint8)).tolist() == [1, 2, 15, 0, 8, 7]


def test_pack_unpack_round_trip():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    codes = torch.randint(0, 16, (3, 5, 64), generator=gen, dtype=torch.uint8)
    packed = q.pack_e2m1(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes.long())
    assert torch.equal(q.unpack_e2m1(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(q.pack_e2m1(q.unpack_e2m1(every_byte)), every_byte)


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------
def check_fp8_group(x: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """x, q8: [..., g] one group per leading index; scale [...]. SPEC: s = amax/448, x/s to e4m3."""
    assert q8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    x = x.double()
    amax = x.abs().amax(dim=-1)
    torch.testing.assert_close(scale.double(), amax / FP8_MAX, rtol=2**-23, atol=0, msg=what)
    values = e4m3_decode(q8)
    assert not values.isnan().any(), what
    dequant = values * scale.double()[..., None]
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormals (below 2^-6) are
    # spaced 2^-9 apart in the scaled domain.
    bound = torch.maximum(x.abs() * 2**-4, scale.double()[..., None] * 2**-10) * (1 + 1e-6)
    assert ((dequant - x).abs() <= bound).all(), what
    # The largest magnitude of each group maps to 448 exactly; zero groups to zeros.
    top = values.abs().amax(dim=-1)
    assert torch.equal(top[amax > 0], torch.full_like(top[amax > 0], FP8_MAX)), what
    assert (values[amax == 0] == 0).all() and (scale[amax == 0] == 0).all(), what


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 40), k=st.integers(1, 300),
       dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_fp8_per_token(seed, m, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = random_rows(gen, m, k, dtype, spread=2.0 if dtype == torch.float16 else 3.0)
    x[torch.rand(m, generator=gen) < 0.2] = 0  # zero rows
    q8, scale = q.quantize_fp8_per_token(x)
    assert q8.shape == (m, k) and scale.shape == (m,)
    check_fp8_group(x, q8, scale, "per token")
    # Exactly SPEC's x / s rounded to e4m3 (ties to even), as the float64 oracle does it.
    mismatched = e4m3_decode(q8) != _e4m3_of_quotient(x)
    if dtype == torch.float32:  # x * 448 is not exact in float32: a rare double rounding
        assert mismatched.double().mean() < 1e-3
    else:
        assert not mismatched.any()
        torch.testing.assert_close(e4m3_decode(q8) * scale.double()[:, None],
                                   quantize_activation64(x.double(), "fp8"), rtol=2**-22, atol=0)


def _e4m3_of_quotient(x: torch.Tensor) -> torch.Tensor:
    """e4m3(x / (amax / 448)) computed in float64, the float32 value cast by torch."""
    x = x.double()
    amax = x.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return e4m3_decode((x / safe).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn))


def test_fp8_exact_midpoints_round_to_even():
    """bf16 activations often land exactly on an e4m3 midpoint: x / s must round to even
    (e.g. amax 3.0625: -1.2578125 / s = -184, between 176 and 192 -> 192)."""
    x = torch.tensor([[3.0625, -1.2578125, 0.73828125, -0.052978515625]], dtype=torch.bfloat16)
    q8, scale = q.quantize_fp8_per_token(x)
    quotient = x.double() / (3.0625 / FP8_MAX)
    assert quotient[0, 1:].tolist() == [-184.0, 108.0, -7.75]  # exact midpoints
    assert e4m3_decode(q8)[0].tolist() == [448.0, -192.0, 112.0, -8.0]
    q8g, _ = q.quantize_fp8_per_token_group(x)
    assert e4m3_decode(q8g)[0].tolist() == [448.0, -192.0, 112.0, -8.0]


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 12),
       k=st.sampled_from((1, 100, 127, 128, 129, 256, 300)),
       dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_fp8_per_token_group(seed, m, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = random_rows(gen, m, k, dtype, spread=2.0)
    groups = -(-k // 128)
    # Groups of very different scale inside one row, and a zero group.
    x = (x.double() * torch.pow(10.0, torch.randint(-2, 3, (m, groups), generator=gen).double())
         .repeat_interleave(128, 1)[:, :k]).to(dtype)
    x[0, :min(k, 128)] = 0
    q8, scale = q.quantize_fp8_per_token_group(x)
    assert q8.shape == (m, k) and scale.shape == (m, groups)
    padded = torch.zeros(m, groups * 128, dtype=torch.float64)
    padded[:, :k] = x.double()
    qpad = torch.zeros(m, groups * 128, dtype=torch.float8_e4m3fn)
    qpad[:, :k] = q8
    check_fp8_group(padded.view(m, groups, 128), qpad.view(m, groups, 128), scale, "per group")
    if dtype != torch.float32:
        expected = quantize_activation64(x.double(), "fp8_block")
        dequant = e4m3_decode(q8) * scale.double().repeat_interleave(128, 1)[:, :k]
        torch.testing.assert_close(dequant, expected, rtol=2**-22, atol=0)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(1, 4), n=st.integers(1, 40), k=st.integers(1, 40),
       dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_fp8_per_tensor(seed, e, n, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=gen)
         * torch.pow(10.0, torch.randint(-2, 3, (e, 1, 1), generator=gen).float())).to(dtype)
    if e > 1:
        w[1] = 0
    q8, scale = q.quantize_fp8_per_tensor(w)
    assert q8.shape == w.shape and scale.shape == (e,)
    check_fp8_group(w.reshape(e, n * k), q8.reshape(e, n * k), scale, "per tensor")


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(1, 3), n=st.sampled_from((1, 128, 200, 300)),
       k=st.sampled_from((5, 128, 136, 257)), dtype=st.sampled_from((torch.bfloat16, torch.float32)))
def test_fp8_block(seed, e, n, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    nb, kb = -(-n // 128), -(-k // 128)
    magnitude = torch.pow(10.0, torch.randint(-2, 3, (e, nb, kb), generator=gen).double())
    w = (torch.randn(e, n, k, generator=gen, dtype=torch.float64)
         * magnitude.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]).to(dtype)
    w[0, :min(n, 128), :min(k, 128)] = 0  # a zero block
    q8, scale = q.quantize_fp8_block(w)
    assert q8.shape == w.shape and q8.dtype == torch.float8_e4m3fn and scale.shape == (e, nb, kb)
    padded = torch.zeros(e, nb * 128, kb * 128, dtype=torch.float64)
    padded[:, :n, :k] = w.double()
    qpad = torch.zeros(e, nb * 128, kb * 128, dtype=torch.float8_e4m3fn)
    qpad[:, :n, :k] = q8
    blocks = lambda t: t.view(e, nb, 128, kb, 128).transpose(2, 3).reshape(e, nb, kb, 128 * 128)  # noqa: E731
    check_fp8_group(blocks(padded), blocks(qpad.view(torch.uint8)).view(torch.float8_e4m3fn), scale,
                    "block")
    expanded = q.expand_block_scales(scale, n, k)
    assert expanded.shape == (e, n, k)
    rows, cols = torch.arange(n) // 128, torch.arange(k) // 128
    assert torch.equal(expanded, scale[:, rows][:, :, cols])


# ---------------------------------------------------------------------------------------------
# nvfp4 and mxfp4
# ---------------------------------------------------------------------------------------------
def _nearest_distance(v: torch.Tensor) -> torch.Tensor:
    return (v.abs().clamp(max=6.0)[..., None] - GRID).abs().min(dim=-1).values + (v.abs() - 6).clamp(min=0)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(1, 3), n=st.integers(1, 24),
       k=st.sampled_from((16, 32, 48, 128)), dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_nvfp4_quantize_dequantize(seed, e, n, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) * torch.pow(10.0, torch.randint(-2, 2, (e, 1, 1), generator=gen).float())
    w = w * torch.pow(2.0, torch.randint(-3, 4, (e, n, k // 16, 1), generator=gen).float()).repeat_interleave(16, -1).view(e, n, k)
    w[0, 0, :16] = 0  # a zero block
    w = w.to(dtype)
    packed, block_scale, global_scale = q.quantize_nvfp4(w)
    assert packed.shape == (e, n, k // 2) and packed.dtype == torch.uint8
    assert block_scale.shape == (e, n, k // 16) and block_scale.dtype == torch.float8_e4m3fn
    assert global_scale.shape == (e,) and global_scale.dtype == torch.float32
    wd = w.double()
    # The tensor's amax maps to the largest block scale times the largest e2m1 value.
    torch.testing.assert_close(global_scale.double(), wd.abs().amax(dim=(1, 2)) / (448 * 6),
                               rtol=2**-23, atol=0)
    # Each block scale is e4m3(block amax / 6 / global).
    block_amax = wd.view(e, n, k // 16, 16).abs().amax(-1)
    g = global_scale.double()[:, None, None]
    target = torch.where(g > 0, block_amax / 6 / torch.where(g > 0, g, 1.0), 0.0)
    bs = e4m3_decode(block_scale)
    assert ((bs - target).abs() <= torch.maximum(target * 2**-4, torch.full_like(target, 2**-10)) * 1.001).all()
    # Each element is a nearest e2m1 value of w / S (S = block scale x global scale).
    full = (bs * global_scale.double()[:, None, None]).repeat_interleave(16, -1)
    values = e2m1_decode64(unpack_nibbles(packed))
    ratio = torch.where(full > 0, wd / torch.where(full > 0, full, 1.0), torch.zeros_like(wd))
    err = (ratio - values).abs()
    assert (err <= _nearest_distance(ratio) + 1e-5 * ratio.abs() + 1e-12).all()
    # Dequantization (the package's, and the one written here) and its error.
    dequant = q.dequantize_fp4(packed, block_scale, "nvfp4", global_scale[:, None].expand(e, n))
    assert torch.equal(dequant.double(), (values * full).float().double())
    assert not dequant.isnan().any() and (dequant[0, 0, :16] == 0).all()
    # e2m1's largest half-spacing is 1 (between 4 and 6): |error| <= S, and e4m3 rounding of the
    # block scale may push the largest element up to 6.4 S before saturating at 6 S.
    assert ((dequant.double() - wd).abs() <= full * 1.0 * (1 + 1e-5) + 1e-30).all()


def _correctly_rounded(got: float, exact) -> bool:
    """got (a float32) is the float32 nearest the exact rational `exact` (no ties here)."""
    import numpy as np
    from fractions import Fraction

    g = np.float32(got)
    neighbours = (np.nextafter(g, np.float32(np.inf)), np.nextafter(g, np.float32(-np.inf)))
    distance = abs(Fraction(float(g)) - exact)
    return all(not np.isfinite(n) or distance <= abs(Fraction(float(n)) - exact)
               for n in neighbours)


def test_nvfp4_global_scale_is_correctly_rounded():
    """nvfp4_global_scale = amax / 2688 and its inverse 1 / global, each the correctly rounded
    float32 (a true division on every device, as the fused preparation kernel computes them in
    its own launch), 0 and 0 for a zero expert; float32 subnormals included."""
    from fractions import Fraction

    gen = torch.Generator().manual_seed(3)
    amax = torch.cat((torch.tensor([0.0, 1e-45, 1e-40, 3e-38, 1.0, 2688.0, 448.0, 3.4e38]),
                      torch.rand(200, generator=gen) * torch.logspace(-30, 30, 200)))
    global_scale, inv_global = q.nvfp4_global_scale(amax)
    assert global_scale.dtype == inv_global.dtype == torch.float32
    for a, g, inv in zip(amax.tolist(), global_scale.tolist(), inv_global.tolist()):
        assert _correctly_rounded(g, Fraction(a) / 2688), a
        if g == 0:
            assert inv == 0, a
        elif math.isfinite(inv):
            assert _correctly_rounded(inv, 1 / Fraction(g)), a
        else:  # 1/g past float32's range: rounds to infinity
            assert 1 / Fraction(g) >= Fraction(float(torch.finfo(torch.float32).max)), a


def test_nvfp4_all_zero_tensor():
    packed, block_scale, global_scale = q.quantize_nvfp4(torch.zeros(2, 4, 32))
    dequant = q.dequantize_fp4(packed, block_scale, "nvfp4", global_scale[:, None].expand(2, 4))
    assert torch.equal(dequant, torch.zeros(2, 4, 32))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), e=st.integers(1, 3), n=st.integers(1, 24),
       k=st.sampled_from((32, 64, 160)), dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_mxfp4_quantize_dequantize(seed, e, n, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen)
    w = w * torch.pow(2.0, torch.randint(-8, 8, (e, n, k // 32, 1), generator=gen).float()).repeat_interleave(32, -1).view(e, n, k)
    w[0, 0, :32] = 0  # a zero block
    w = w.to(dtype)
    packed, scale = q.quantize_mxfp4(w)
    assert packed.shape == (e, n, k // 2) and packed.dtype == torch.uint8
    assert scale.shape == (e, n, k // 32) and scale.dtype == torch.uint8
    wd = w.double()
    block_amax = wd.view(e, n, k // 32, 32).abs().amax(-1)
    nonzero = block_amax > 0
    # The block exponent is ceil(log2(amax / 6)): the largest element lands in (3, 6].
    exponent = torch.ceil(torch.log2(block_amax[nonzero] / 6))
    assert torch.equal(scale[nonzero].double() - 127, exponent)
    s = e8m0_decode(scale).repeat_interleave(32, -1)
    values = e2m1_decode64(unpack_nibbles(packed))
    # A power-of-two scale divides exactly: the codes are exactly the nearest-even rounding.
    expected = expected_e2m1_codes(wd / s)
    zero_block = (~nonzero).repeat_interleave(32, -1)
    assert same_codes(unpack_nibbles(packed)[~zero_block], expected[~zero_block])
    assert ((wd / s).abs()[~zero_block] <= 6).all()
    dequant = q.dequantize_fp4(packed, scale, "mxfp4")
    assert torch.equal(dequant.double(), values * s)
    assert (dequant[zero_block] == 0).all() and not dequant.isnan().any()
    assert ((dequant.double() - wd).abs() <= s * 1.0).all()


def test_dequantize_fp4_matches_independent_decode():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    packed = torch.randint(0, 256, (2, 3, 16), generator=gen, dtype=torch.uint8)
    nv_scale = (torch.rand(2, 3, 2, generator=gen) * 4).to(torch.float8_e4m3fn)
    row = torch.rand(2, 3, generator=gen)
    got = q.dequantize_fp4(packed, nv_scale, "nvfp4", row)
    want = e2m1_decode64(unpack_nibbles(packed)) * e4m3_decode(nv_scale).repeat_interleave(16, -1) * row.double()[..., None]
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    mx_scale = torch.randint(120, 135, (2, 3, 1), generator=gen, dtype=torch.uint8)
    got = q.dequantize_fp4(packed, mx_scale, "mxfp4")
    want = e2m1_decode64(unpack_nibbles(packed)) * e8m0_decode(mx_scale).repeat_interleave(32, -1)
    assert torch.equal(got.double(), want)


@pytest.mark.parametrize("k", [16, 32, 96, 256, 2880])
def test_fp4_kernel_order_round_trip_and_padding(k):
    """quant.fp4_to_kernel_order / fp4_from_kernel_order are inverse; the padding is code 0;
    every code lands in the byte and nibble its definition gives (before the words' bit
    permutation, which tests/test_decode_ptx.py checks against the decode)."""
    gen = torch.Generator().manual_seed(k)
    packed = torch.randint(0, 256, (3, 5, k // 2), dtype=torch.uint8, generator=gen)
    kernel = q.fp4_to_kernel_order(packed)
    kp = q.fp4_padded_k(k)
    assert kp % q.FP4_K_ALIGN == 0 and k <= kp < k + q.FP4_K_ALIGN
    assert kernel.shape == (3, 5, kp // 2) and kernel.dtype == torch.uint8
    assert torch.equal(q.fp4_from_kernel_order(kernel, k), packed)
    codes = q.unpack_e2m1(packed)
    byte_order = q.fp4_permute_word_bits(kernel, inverse=True)
    assert not torch.equal(byte_order, kernel)
    for col in (0, 1, 7, 8, 9, 15, k - 1):
        c, r = divmod(col, 16)
        h, r = divmod(r, 8)
        t, qq = divmod(r, 2)
        byte = byte_order[..., t * (kp // 8) + 2 * c + qq]
        assert torch.equal((byte >> 4) if h else (byte & 15), codes[..., col]), col
    padding = q.unpack_e2m1(q.fp4_permute_word_bits(
        q.fp4_to_kernel_order(torch.zeros_like(packed) + 0x77), inverse=True))
    assert int((padding == 7).sum()) == 3 * 5 * k  # padded codes are 0
    scale = torch.randint(1, 255, (3, 5, k // 16), dtype=torch.uint8, generator=gen)
    padded = q.fp4_pad_scales(scale.view(torch.float8_e4m3fn), k, "nvfp4")
    assert padded.dtype == torch.float8_e4m3fn and padded.shape[-1] == kp // 16
    assert torch.equal(padded.view(torch.uint8)[..., :k // 16], scale)
    assert not padded.view(torch.uint8)[..., k // 16:].any()


def test_mxfp4_fold_keeps_every_scale_bf16_can_matter_for():
    """quant.mxfp4_fold_scales: bytes at most 128 after it; rows already there unchanged with
    row scale 1; every block scale 2^(s - 127) equal to 2^(folded - 127) * row scale where
    s >= the row's excess, and the clamped ones (under 2^-127 of their row's largest) at
    2^-127 * row scale. The device fold (kernels/prepare.py; the interpreter on the CPU) gives
    the same bytes in place."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    scale = torch.randint(0, 255, (3, 40, 12), dtype=torch.uint8, generator=gen)
    scale[0] = torch.randint(0, 129, (40, 12), dtype=torch.uint8, generator=gen)
    scale[1, 5] = 254                                   # the largest e8m0 a finite value has
    scale[1, 6] = torch.tensor([254] + [0] * 11)        # a span past 2^254: some bytes clamped
    folded, row = q.mxfp4_fold_scales(scale)
    assert folded.dtype == torch.uint8 and row.dtype == torch.float32
    assert int(folded.max()) <= q.MXFP4_FOLD_MAX
    assert torch.equal(folded[0], scale[0]) and bool((row[0] == 1).all())
    excess = (scale.long().amax(dim=-1) - 128).clamp(min=0)
    assert torch.equal(row.double(), 2.0 ** excess.double())
    want = 2.0 ** (scale.double() - 127)
    got = 2.0 ** (folded.double() - 127) * row.double()[..., None]
    kept = scale.long() >= excess[..., None]
    assert torch.equal(got[kept], want[kept])
    assert bool((~kept).any())
    assert torch.equal(got[~kept], (2.0 ** -127 * row.double()[..., None]).expand_as(got)[~kept])
    try:
        from moe_ops.kernels import INTERPRET, prepare
    except ImportError:
        return
    if not INTERPRET:
        return
    device_scale, device_row = scale.clone(), torch.full(row.shape, float("nan"))
    prepare.fold_mxfp4_scales(device_scale, device_row)
    assert torch.equal(device_scale, folded) and torch.equal(device_row, row)
