"""The division of act_quant's fp8_quantize_short, checked exhaustively on the CPU.

act_quant's GPU kernel quantizes a bf16 / fp16 value v of a row whose amax is b as the e4m3
rounding of y = fl((v * 448) / b), float32's correctly rounded quotient (SPEC; quant.py divides so).
fp8_quantize_short (kernels/act_quant.py) gets y without a division a value:

    inv = fl(1 / b)                once a row (a correctly rounded division)
    y0  = fl(a * inv)              a = v * 448, exact for 16-bit floats
    r   = fl(a - y0 * b)           one fma
    y   = fl(y0 + r * inv)         one fma

Whether y == fl(a / b) depends on the significands of v and b alone as long as no float32
overflow or underflow happens (act_quant keeps b in [2^-96, 2^100); a value too small for a
float32 normal quotient rounds to an e4m3 zero of its sign either way): scaling v or b by a power
of two scales a, inv, y0, r and y alike. So every pair of significands, with v in b's binade and
the one below it, covers every value of every row. The GPU runs the same four operations (its
SASS: tests here compile it for sm_90); the interpreter runs fp8_quantize instead.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest


def _round_f32(q: Fraction) -> Fraction:
    """float32's round-to-nearest-even of an exact rational (normal range)."""
    if q == 0:
        return Fraction(0)
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length() - 24
    while q / Fraction(2) ** e >= 2 ** 24:
        e += 1
    while q / Fraction(2) ** e < 2 ** 23:
        e -= 1
    m = q / Fraction(2) ** e
    n, rest = divmod(m.numerator, m.denominator)
    rest = Fraction(rest, m.denominator)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    return sign * n * Fraction(2) ** e


def _sum_f32(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """fl32(x + y) for float64 x (a float32) and y (exact in float64), correctly rounded: the
    float64 sum decides it unless it lands within float64's error of a float32 rounding
    boundary; those few are summed as exact rationals."""
    s = x + y
    out = s.astype(np.float32)
    lo = np.nextafter(out, np.float32(-np.inf)).astype(np.float64)
    hi = np.nextafter(out, np.float32(np.inf)).astype(np.float64)
    mid_lo, mid_hi = (lo + out) / 2, (hi + out) / 2  # exact in float64
    tol = np.abs(s) * 2.0 ** -50
    near = (np.abs(s - mid_lo) <= tol) | (np.abs(s - mid_hi) <= tol)
    for i in np.flatnonzero(near):
        exact = Fraction(float(x.flat[i])) + Fraction(float(y.flat[i]))
        out.flat[i] = np.float32(float(_round_f32(exact)))
    return out


def short_quotients(significand_bits: int, correct: bool = True):
    """(v, b, y, expected, pairs): fp8_quantize_short's quotient y of a = v * 448 by b and
    fl(a / b), over every significand of b in [1, 2) and of v in [1/2, 2), pairs marking v <= b,
    for a float format of `significand_bits` (leading one included: bf16 8, fp16 11).
    correct=False: y0 alone, the quotient without its correction."""
    one = 1 << (significand_bits - 1)
    b = (np.arange(one, 2 * one, dtype=np.float64) / one).astype(np.float32)[:, None]
    v = (np.arange(one, 4 * one, dtype=np.float64) / (2 * one)).astype(np.float32)[None, :]
    pairs = np.broadcast_to(v <= b, (b.size, v.size))
    a = v * np.float32(448.0)                                  # exact
    inv = np.float32(1.0) / b                                  # correctly rounded
    y0 = a * inv                                               # float32 product
    # a - y0 * b: y0 * b is exact in float64 (24 + 11 bits) and the difference of two close
    # numbers of at most 35 significant bits is too, so one rounding to float32: the fma's.
    r = (a.astype(np.float64) - y0.astype(np.float64) * b.astype(np.float64)).astype(np.float32)
    # y0 + r * inv: the product is exact in float64 (48 bits); the sum rounded once
    y = (_sum_f32(np.broadcast_to(y0.astype(np.float64), r.shape),
                  r.astype(np.float64) * inv.astype(np.float64)) if correct else y0)
    return v, b, y, a / b, pairs                               # a / b: correctly rounded


def mismatches(significand_bits: int, correct: bool = True) -> tuple[int, int]:
    """(pairs, pairs whose quotient differs from fl(a / b))."""
    _, _, y, expected, pairs = short_quotients(significand_bits, correct)
    return int(pairs.sum()), int(((y != expected) & pairs).sum())


@pytest.mark.parametrize("bits", [8, 11], ids=["bf16", "fp16"])
def test_short_division_is_correctly_rounded(bits):
    pairs, bad = mismatches(bits)
    assert pairs > (1 << (2 * bits - 2)) and bad == 0, f"{bad} of {pairs} quotients differ"


def test_the_check_sees_an_uncorrected_quotient():
    """Without its correction step the quotient is wrong for some pairs: the check can fail."""
    _, bad = mismatches(8, correct=False)
    assert bad > 0


def test_the_vector_check_agrees_with_exact_rationals():
    """The float64 emulation of the two fmas against exact rational arithmetic, for every bf16
    v of 16 values of b."""
    v, b, y, _, pairs = short_quotients(8)
    for i in range(0, b.size, 8):
        bi = Fraction(float(b[i, 0]))
        inv = _round_f32(1 / bi)
        for j in np.flatnonzero(pairs[i]):
            a = Fraction(float(v[0, j])) * 448
            y0 = _round_f32(a * inv)
            exact = _round_f32(y0 + _round_f32(a - y0 * bi) * inv)
            assert Fraction(float(y[i, j])) == exact, (float(bi), float(v[0, j]))


SHORT_DIVISION_BUILDS = """
import re, sys
sys.path.insert(0, "benchmarks")
from aot_sm90 import sass
from moe_ops.kernels import act_quant
for name, form in (("row", dict(k=768, load_first=True)), ("looped", dict(k=14336, split_k=False)),
                   ("sliced", dict(k=14336, slice_k=2048, num_warps=16)),
                   ("groups", dict(quant="fp8_block", k=7168)),
                   ("groups_looped", dict(quant="fp8_block", k=7168, split_k=False)),
                   ("rows", dict(k=768, load_first=True, rows=4))):
    kernel = act_quant.compile_sm90(**form)
    # r may be a float32 subnormal: exact only where subnormals are kept (no flush to zero)
    assert ".ftz" not in kernel.asm["ptx"], name
    code = sass(kernel)
    casts = sum(i.startswith("F2FP.SATFINITE.E4M3") for i in code)
    # the row form's fast branch: from the amax's range test to the branch past the general one
    start = next(n for n, i in enumerate(code) if re.match(r"@!?P\\d BRA", i))
    end = next(n for n in range(start + 1, len(code)) if code[n].startswith("BRA"))
    print(name, casts, sum(i.startswith("FCHK") for i in code[start:end]))
"""


def test_the_short_division_builds_for_sm90():
    """act_quant's kernel with FAST_DIV builds for sm_90 in each of its forms, converting by the
    hardware's e4m3 cast, without flushing float32 subnormals (its PTX has no .ftz); the row
    form's fast branch does one correctly rounded division (the reciprocal), not one a
    value."""
    from test_ws_gemm import sm90_script_rows

    rows, _ = sm90_script_rows(SHORT_DIVISION_BUILDS)
    assert [row[0] for row in rows] == ["row", "looped", "sliced", "groups", "groups_looped",
                                        "rows"]
    assert all(int(row[1]) > 0 for row in rows), rows
    assert rows[0][2] == "1", rows
