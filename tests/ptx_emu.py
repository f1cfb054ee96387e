"""A reference interpreter for the small PTX subset of the kernels' inline assembly (bit moves
and bf16x2 multiplies), vectorized over numpy uint32 arrays, so the CPU tests can check the
GPU-only decode paths bit for bit (the Triton interpreter cannot run inline PTX).

Supported: .reg declarations, mov.b32, prmt.b32 (default mode), shl.b32, shr.b32 (logical),
shf.r.wrap.b32 (funnel shift right, the amount mod 32), and.b32, or.b32, mul.rn.bf16x2. Operands: $n (the asm's operands), named registers, and
decimal or hex immediates. Anything else raises, so a new instruction cannot pass unchecked.
"""
from __future__ import annotations

import re
from typing import Dict, List

import numpy as np

_U32 = np.uint32


def _bf16_to_f32(half: np.ndarray) -> np.ndarray:
    return (half.astype(_U32) << _U32(16)).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits, to nearest even (subnormals and overflow included; no NaN
    input arises in the decode)."""
    bits = x.astype(np.float32).view(_U32)
    rounded = bits + _U32(0x7FFF) + ((bits >> _U32(16)) & _U32(1))
    return (rounded >> _U32(16)).astype(_U32)


def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mul.rn.bf16x2: each 16-bit half multiplied and rounded once. The product of two bf16
    values is exact in float32 (8 + 8 significant bits) wherever it is a float32 normal, as every
    product the decode forms is; float32 -> bf16 is then the only rounding."""
    out = np.zeros_like(a)
    for shift in (0, 16):
        x = _bf16_to_f32((a >> _U32(shift)) & _U32(0xFFFF))
        y = _bf16_to_f32((b >> _U32(shift)) & _U32(0xFFFF))
        with np.errstate(over="ignore", under="ignore"):
            out |= _f32_to_bf16(x * y) << _U32(shift)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """prmt.b32 d, a, b, c: result byte i is byte (c >> 4i) & 7 of the 8 bytes {b:a}, or its
    sign replicated when bit 3 of that selector nibble is set."""
    pool = [(a >> _U32(8 * i)) & _U32(0xFF) for i in range(4)]
    pool += [(b >> _U32(8 * i)) & _U32(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (selector >> _U32(4 * i)) & _U32(0xF)
        picked = np.choose((nibble & _U32(7)).astype(np.int64), pool).astype(_U32)
        replicated = np.where(picked & _U32(0x80), _U32(0xFF), _U32(0))
        byte = np.where(nibble & _U32(8), replicated, picked)
        out |= byte.astype(_U32) << _U32(8 * i)
    return out


def run(asm: str, operands: Dict[int, np.ndarray], outputs: List[int]) -> Dict[int, np.ndarray]:
    """Execute asm with the input operands {n: uint32 array} and return {n: array} for the
    output operand numbers (all arrays of one shape)."""
    shape = next(iter(operands.values())).shape
    regs: Dict[str, np.ndarray] = {f"${n}": np.asarray(v, dtype=_U32) for n, v in operands.items()}

    def value(token: str) -> np.ndarray:
        token = token.strip()
        if token in regs:
            return regs[token]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", token):
            return np.full(shape, int(token, 0) & 0xFFFFFFFF, dtype=_U32)
        raise ValueError(f"ptx_emu: unknown operand {token!r}")

    for raw in asm.replace(";", "\n").splitlines():
        line = raw.strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        args = [t.strip() for t in rest.split(",")]
        dst, srcs = args[0], [value(t) for t in args[1:]]
        if op == "mov.b32":
            result = srcs[0].copy()
        elif op == "prmt.b32":
            result = _prmt(*srcs)
        elif op == "shl.b32":
            result = (srcs[0].astype(np.uint64) << srcs[1].astype(np.uint64)).astype(_U32)
        elif op == "shr.b32":
            result = srcs[0] >> srcs[1]
        elif op == "shf.r.wrap.b32":
            # d = the low 32 bits of {b:a} >> (n mod 32); a == b: a rotation
            pair = (srcs[1].astype(np.uint64) << np.uint64(32)) | srcs[0].astype(np.uint64)
            result = (pair >> (srcs[2].astype(np.uint64) & np.uint64(31))).astype(_U32)
        elif op == "and.b32":
            result = srcs[0] & srcs[1]
        elif op == "or.b32":
            result = srcs[0] | srcs[1]
        elif op == "mul.rn.bf16x2":
            result = _mul_bf16x2(*srcs)
        else:
            raise ValueError(f"ptx_emu: unsupported instruction {line!r}")
        regs[dst] = result.astype(_U32)
    return {n: regs[f"${n}"] for n in outputs}
