"""Helpers shared by the Triton kernels of moe_ops: small host-side arithmetic, and the device
functions (activations, fp8 rounding) used by more than one kernel. The interpreter flag is
moe_ops.kernels.INTERPRET; the format constants are moe_ops.quant's.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import triton
import triton.language as tl

from moe_ops.kernels import INTERPRET  # noqa: F401  (re-exported for the launchers)
from moe_ops.kernels.env import env_choice
from moe_ops.layout import is_gated  # noqa: F401  (re-exported for the launchers)
from moe_ops.quant import FP8_BLOCK  # noqa: F401  (re-exported for the launchers)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): tl.arange sizes must be powers of two."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def upcast_dots(dtype: torch.dtype) -> bool:
    """The interpreter's tl.dot gives wrong results on 16-bit floats: feed it fp32 instead.

    fp8 dots are right in the interpreter (it widens e4m3 to fp16, exactly), so they keep their
    operands. On the GPU nothing is upcast.
    """
    return INTERPRET and dtype in (torch.bfloat16, torch.float16)


_DEVICE_PROPERTIES: dict = {}


def device_properties(device: torch.device):
    """torch.cuda.get_device_properties of a CUDA device, looked up once per device: launchers
    ask for the capability and the SM count on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = _DEVICE_PROPERTIES.get(index)
    if props is None:
        props = _DEVICE_PROPERTIES[index] = torch.cuda.get_device_properties(index)
    return props


def capability_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether `device` is a CUDA GPU of at least this compute capability (never in the
    interpreter)."""
    if INTERPRET or device.type != "cuda":
        return False
    props = device_properties(device)
    return (props.major, props.minor) >= capability


# ---------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL, sm_90+). A layer call is a chain of small launches (route,
# [quant], [dispatch], GEMM1, [quant], GEMM2, combine); at decode each lasts a few microseconds,
# so the gap between two (launch latency, block scheduling, the tail of the previous grid) is a
# large part of the layer. With PDL a kernel may be scheduled while its predecessor still runs:
# every kernel here starts with `pdl_prologue`, which waits for the predecessor grid to have
# completed with its memory visible (griddepcontrol.wait: nothing is read or written before it)
# and then lets the successor be scheduled (griddepcontrol.launch_dependents). CUDA graphs keep
# these as programmatic edges. Off in the interpreter (no inline PTX there), on pre-Hopper GPUs,
# and when MOE_OPS_PDL=0 (read at import: a launch pays no environment lookup).
# ---------------------------------------------------------------------------------------------
# Early launch pays at decode only: at prefill (long kernels, many programs) the dependent's
# programs, resident early, take SM slots and shared memory from their still running predecessor:
# Mixtral T=16384 on one H200, whole experts call, 643 -> 675 TFLOP/s (bf16) and 836 -> 881
# (fp8) without it (benchmarks/results/h200_pdl_prefill.json). `pdl_early_launch(False)` scopes
# launches without the attribute; the kernel source stays the same (griddepcontrol.wait returns
# at once in a kernel launched normally), but `launch_pdl` is part of Triton's compile key, so a
# kernel launched on both sides of the scope is compiled (and cached) once for each.
_PDL_DISABLED = env_choice("MOE_OPS_PDL", "1", ("0", "1")) == "0"
_PDL_EARLY_LAUNCH = contextvars.ContextVar("moe_ops_pdl_early_launch", default=True)


def use_pdl(device: torch.device) -> bool:
    return not _PDL_DISABLED and capability_at_least(device, (9, 0))


@contextlib.contextmanager
def pdl_early_launch(enabled: bool) -> Iterator[None]:
    """Inside: kernels are launched with the PDL attribute only if `enabled` and every enclosing
    scope allows it (an outer pdl_early_launch(False) holds through inner ones)."""
    token = _PDL_EARLY_LAUNCH.set(enabled and _PDL_EARLY_LAUNCH.get())
    try:
        yield
    finally:
        _PDL_EARLY_LAUNCH.reset(token)


def pdl_launch_options(device: torch.device) -> dict:
    """Launch keywords of a kernel that begins with pdl_prologue(USE_PDL=use_pdl(device))."""
    return {"launch_pdl": True} if use_pdl(device) and _PDL_EARLY_LAUNCH.get() else {}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First statement of every kernel: see use_pdl."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def apply_activation(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """act(gate, up) in fp32. For "relu2" (not gated) `up` is ignored and gate is h."""
    if ACTIVATION == "swiglu":
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == "geglu":
        # exact gelu: 0.5 * g * (1 + erf(g / sqrt(2)))
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "swiglu_oai":
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    else:  # relu2
        r = tl.maximum(gate, 0.0)
        out = r * r
    return out


@triton.jit
def round_to_e4m3_grid(v):
    """Round fp32 values (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, in fp32.

    Why not just `.to(tl.float8e4nv)`: the Triton 3.6 interpreter's float->fp8 conversion drops
    the carry when the mantissa rounds up (126.1 -> 64 instead of 128) and rounds ties up, so
    interpreter runs would not match the GPU. Rounding here makes the final cast exact on both.
    Trick: adding 2^23 * ulp forces fp32's round-to-nearest-even to drop every bit below ulp,
    and subtracting it back is exact. ulp = 2^(e-3) for |v| in [2^e, 2^(e+1)), e >= -6;
    below 2^-6 e4m3 is subnormal with the fixed step 2^-9.
    """
    bits = v.to(tl.int32, bitcast=True)
    biased_exp = tl.maximum((bits >> 23) & 0xFF, 121)  # 121 = 127 - 6: smallest normal e4m3
    magic = ((biased_exp + 20) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3 + 23)
    mag = tl.abs(v)
    rounded = (mag + magic) - magic
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def fp8_quantize(v, amax):
    """Quantize fp32 values with a per-row (or per-group) amax to e4m3; returns (q, scale).

    scale = amax / 448; a zero row gets scale 0 and q 0 (never 0 * inf = NaN).
    """
    # 448 is moe_ops.quant.FP8_MAX (device code takes literals). (v * 448) / amax, not
    # v * (448 / amax): v * 448 is exact for bf16/fp16 inputs and the division is correctly
    # rounded, so a value exactly on an e4m3 midpoint stays there and rounds to even, as x / s
    # does in SPEC; a rounded reciprocal would break such ties (about one element in a
    # thousand of bf16 activations) the wrong way. The scale divides correctly rounded too
    # (Triton's `/` is an approximate division on the GPU), as quant.py's does.
    scaled = tl.where(amax > 0, tl.div_rn(v * 448.0, tl.where(amax > 0, amax, 1.0)), 0.0)
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    q = round_to_e4m3_grid(scaled).to(tl.float8e4nv)
    return q, tl.div_rn(amax, 448.0)


@triton.jit
def round_to_dtype(v, DTYPE: tl.constexpr):
    """Cast fp32 -> DTYPE (float32, bfloat16 or float16) rounding to nearest even.

    The Triton 3.6 interpreter truncates fp32 -> bf16/fp16 casts (up to 2^-7 relative error,
    always toward zero), and its round-to-nearest mode drops the mantissa carry; rounding onto
    the target grid in fp32 first (same trick as round_to_e4m3_grid) makes the cast exact on
    the interpreter and on the GPU alike. Inf and NaN pass through unchanged.
    """
    if DTYPE == tl.float32:
        return v
    else:
        if DTYPE == tl.bfloat16:
            MANTISSA: tl.constexpr = 7
            MIN_BIASED_EXP: tl.constexpr = 1      # bf16 shares fp32's exponent range
        else:
            MANTISSA: tl.constexpr = 10
            MIN_BIASED_EXP: tl.constexpr = 113    # 2^-14: below it fp16 steps by 2^-24
        bits = v.to(tl.int32, bitcast=True)
        biased_exp = (bits >> 23) & 0xFF
        grid_exp = tl.minimum(tl.maximum(biased_exp, MIN_BIASED_EXP), 254 - (23 - MANTISSA))
        magic = ((grid_exp + (23 - MANTISSA)) << 23).to(tl.float32, bitcast=True)
        mag = tl.abs(v)
        rounded = (mag + magic) - magic
        rounded = tl.where(v < 0, -rounded, rounded)
        return tl.where(biased_exp == 255, v, rounded).to(DTYPE)
