"""Prefill grouped GEMM experiment: can a persistent Triton kernel with TMA tensor descriptors
(and, where Triton 3.6 does it on Hopper, warp specialization) beat our non-persistent
pointer-load kernel (moe_ops.kernels.grouped_gemm) at large token counts?

Measured before this script (H200, Mixtral T=16384, E=8, H=4096, I=14336, top_k=2): our kernel
reaches about 586 TFLOP/s bf16 and 818 TFLOP/s fp8 per-tensor; targets 650 and 1100.

The problem (one file, own kernels, nothing else in the package changes):
  A_sorted [M_pad, K]   activations already in expert-sorted order, each expert's rows padded to
                        a multiple of BLOCK_M (what moe_align gives); padding rows hold NaN here,
                        as the real intermediate's never-written padding slots may; rows past
                        the live blocks hold 1s (a stray write there would show).
  W [E, N, K]           K-major weights (our kernel layout: w13 is [E, 2I, H], w2 [E, H, I])
  block_expert_ids      expert of each BLOCK_M block, -1 past the live blocks
  num_padded [1]        live rows (on the device: no host sync, CUDA-graph safe)
  C_sorted [M_pad, N]   bf16 output, one row per slot
  fp8 per-tensor: e4m3 operands, a per-row activation scale [M_pad] and a per-expert weight
  scale [E] applied in the epilogue; the fp8 MMA's partial sum is promoted into an fp32
  accumulator every FP8_PROMOTE_K = 256 columns of K (Hopper's fp8 MMA accumulates with few
  bits; relative error against fp32 must stay < 1e-2).
Shapes: gemm1 = Mixtral's w13 (N = 2I = 28672, K = H = 4096), gemm2 = w2 (N = H = 4096,
K = I = 14336), both with T*top_k = 32768 real rows spread by a random uniform routing.

Variants (each config compiled and run in its own try/except; errors are recorded):
  ours     moe_ops' _grouped_gemm_kernel through grouped_gemm.gemm2 (the GEMM2 form reads A
           in sorted order, no gather; it writes one row per pair, times a routing weight of 1)
  ptr      a plain non-persistent tile kernel with pointer loads, written here (our kernel's
           structure without its gather/activation/bias features)
  tma      persistent (grid = #SMs, tiles walked in grouped order so the SMs working at one time
           share A and W tiles in L2), TMA tensor descriptors for A and W made in the kernel
           (tl.make_tensor_descriptor; triton.set_allocator gives them their global scratch),
           masked tl.store epilogue; the tile loop is flattened into the K loop (flatten=True)
           so the software pipeliner prefetches the next tile's first K steps during the
           epilogue. "-nf" in the config name: not flattened.
  tma_st   tma with a TMA-store epilogue (whole tile, or two [BM, BN/2] halves: "-split")
  ws       tma with warp_specialize=True on the tile loop. Triton 3.6's Hopper path (Meta's
           "autoWS" pass, NVGPUWarpSpecialization, run for sm_90 in make_ttgir) only does it
           for num_warps=4 and an unflattened loop: the kernel then runs 12 warps, one producer
           warpgroup issuing the TMA loads and two consumer warpgroups each computing
           BLOCK_M/2 rows (setmaxnreg gives the consumers the registers); each consumer waits
           for its wgmma group after every K step (wait_group 0), the overlap comes from the
           two consumers and the producer. With num_warps=8, flatten=True, or an `if` in the K
           loop (the two-accumulator fp8 promotion) the flag is silently ignored (no
           ttg.warp_specialize op in the TTGIR): see AOT_ONLY and --aot.
  ws_st    ws with the TMA-store epilogue (the split epilogue crashes the WS pass: AOT_ONLY)
fp8 promotion: with BLOCK_K equal to the promotion length (256, or 128 for "-p128" configs:
more accurate) the promotion happens inside each dot (max_num_imprecise_acc = BLOCK_K, as our
kernel does when PROMOTE_STEPS == 1); a smaller BLOCK_K chains promotion/BLOCK_K dots into a
second accumulator and adds it into the fp32 one every promotion length (our PROMOTE_STEPS>1).
Only the in-dot form is warp-specialized by Triton 3.6.

Every run: output poisoned with NaN first, then compared with an fp32 torch reference of the
same math (random data, never zeros): rel_err = ||out - ref||_F / ||ref||_F over the real
rows (the SPEC metric, bound 1e-2), max_err = max|out - ref| / max|ref|, plus a check that no
row past num_padded was written. Timing: triton.testing.do_bench (L2 flushed before every
call; the operands, 0.3-1.9 GB, are far larger than L2 anyway), median; TFLOP/s counts only
real rows: 2 * T * top_k * N * K.

Run on one H200 (about 3 minutes; --deadline-s skips what is left after that many seconds):
    python benchmarks/dev_prefill_ws.py --out benchmarks/results
    python benchmarks/dev_prefill_ws.py --shapes gemm1 --dtypes fp8 --variants ours ws
Without a GPU:
    python benchmarks/dev_prefill_ws.py --interpret-selftest   # every kernel on the CPU
                                                               # interpreter, tiny shapes
    python benchmarks/dev_prefill_ws.py --aot                  # compile every variant for
                                                               # sm_90 (ptxas from the triton
                                                               # wheel), report regs/spills/WS
Writes prefill_ws.json (or prefill_ws_aot.json / prefill_ws_selftest.json) to --out and prints
a table of the best config per variant last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

# Triton decides at decoration time whether kernels run in its CPU interpreter: set it before
# triton (and moe_ops, which snapshots the flag) is imported.
if "--interpret-selftest" in sys.argv or "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from moe_ops.kernels import grouped_gemm as gg  # noqa: E402
from moe_ops.kernels.grouped_gemm import _tile_coords  # noqa: E402  (the shipped tile order)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Columns of K between two promotions of the fp8 partial sum (moe_ops' FP8_PROMOTE_K: 256 keeps
# the whole layer under 1e-2 with margin, see grouped_gemm.py).
FP8_PROMOTE_K = gg.FP8_PROMOTE_K
# Shared memory a block may use on sm_90 (227 KiB opt-in); configs above it are not tried.
SMEM_LIMIT = 227 * 1024
START = time.time()
RESULTS: list = []


def log(*args):
    print(f"[{time.time() - START:6.1f}s]", *args, flush=True)


# ============================================================================ kernels

@triton.jit
def _dot(a, w, acc, PROMOTE_IN_DOT: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ w. PROMOTE_IN_DOT (fp8 promoting every K step): max_num_imprecise_acc =
    BLOCK_K makes the MMAs of this one dot chain into a zeroed partial sum that is then added
    into the fp32 acc (Triton's sm_90 default never promotes: what the `part` chains of longer
    promotion runs use). UPCAST (the interpreter, whose bf16 dot is wrong) runs the same code
    on fp32 copies of the operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    elif PROMOTE_IN_DOT:
        return tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        return tl.dot(a, w, acc)


@triton.jit
def _promoted_dot(a, w, acc, part, kb, QUANT: tl.constexpr, PROMOTE_STEPS: tl.constexpr,
                  BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """One K step into (acc, part): fp8 with PROMOTE_STEPS > 1 chains the MMAs through `part`
    and promotes it into acc every PROMOTE_STEPS steps; otherwise _dot into acc (fp8: promoting
    inside the dot; `part` unused and returned as it came)."""
    if QUANT == "fp8" and PROMOTE_STEPS > 1:
        part = _dot(a, w, part, False, BLOCK_K, UPCAST)
        if kb % PROMOTE_STEPS == PROMOTE_STEPS - 1:
            acc += part
            part = tl.zeros_like(part)
    else:
        acc = _dot(a, w, acc, QUANT == "fp8", BLOCK_K, UPCAST)
    return acc, part


@triton.jit
def _ptr_gemm_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    num_m_blocks, N, K, num_pairs,
    QUANT: tl.constexpr,            # "none" | "fp8"
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE_STEPS: tl.constexpr,    # fp8: K steps between promotions (1: inside each dot)
    UPCAST: tl.constexpr,           # interpreter: its bf16 tl.dot is wrong, use fp32 copies
):
    """Baseline: one program per [BLOCK_M, BLOCK_N] tile, pointer loads, like our kernel.
    K must be a multiple of BLOCK_K (host-checked): no K masks."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the live ones
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.load(sorted_pair_ids_ptr + rows) < num_pairs
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past N wrap (results dropped at the store): unmasked, vectorized weight loads
    w_rows = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * K + offs_k[None, :]                        # [BM, BK]
    w_ptrs = w_ptr + expert * N * K + w_rows[None, :] * K + offs_k[:, None]       # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if QUANT == "fp8" and PROMOTE_STEPS > 1:
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        part = acc  # unused (see _promoted_dot)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc, part = _promoted_dot(a, w, acc, part, kb, QUANT, PROMOTE_STEPS, BLOCK_K, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if QUANT == "fp8" and PROMOTE_STEPS > 1:
        acc += part
    if QUANT == "fp8":
        a_s = tl.load(a_scale_ptr + rows)
        acc = acc * a_s[:, None] * tl.load(w_scale_ptr + expert)
    tl.store(c_ptr + rows64[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _tma_persistent_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    num_padded_ptr,
    M_pad, N, K, num_experts, num_pairs,
    QUANT: tl.constexpr,            # "none" | "fp8"
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,          # programs launched; each walks tiles pid, pid + NUM_SMS, ...
    PROMOTE_STEPS: tl.constexpr,    # fp8: K steps between promotions (1: inside each dot)
    TMA_STORE: tl.constexpr,        # epilogue through a TMA store descriptor (else tl.store)
    EPI_SPLIT: tl.constexpr,        # TMA store in two [BM, BN/2] halves (half the staging smem)
    WARP_SPEC: tl.constexpr,        # warp_specialize=True on the tile loop
    FLATTEN: tl.constexpr,          # flatten the tile and K loops into one pipelined loop
    UPCAST: tl.constexpr,           # interpreter: its bf16 tl.dot is wrong, use fp32 copies
):
    # Descriptors built on the device: no host-side descriptor objects to cache or rebuild per
    # call, the price is a global scratch per program (triton.set_allocator) and a fence.
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M_pad, K], strides=[K, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    # W as [E*N, K]: an expert's tile is rows expert*N + off_n. A tile straddling N (N not a
    # multiple of BLOCK_N) reads the next expert's rows (or TMA's zero fill past the end); those
    # columns are never stored.
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * N, K], strides=[K, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    if TMA_STORE:
        STORE_N: tl.constexpr = BLOCK_N // 2 if EPI_SPLIT else BLOCK_N
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M_pad, N], strides=[N, 1],
                                           block_shape=[BLOCK_M, STORE_N])
    # Only the live blocks are walked (num_padded is on the device): no dead-tile checks in the
    # loop, nothing sized on the host from data.
    num_m_blocks = tl.load(num_padded_ptr) // BLOCK_M
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m_blocks * num_n_blocks, NUM_SMS,
                         flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        expert = tl.load(block_expert_ids_ptr + pid_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        w_row = expert * N + off_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if QUANT == "fp8" and PROMOTE_STEPS > 1:
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            part = acc  # unused (see _promoted_dot)
        for kb in range(0, k_steps):
            a = a_desc.load([off_m, kb * BLOCK_K])
            # [BN, BK] with K contiguous: its transpose is the K-major B operand (which the fp8
            # wgmma requires; no data moves, the MMA reads shared memory transposed)
            w = w_desc.load([w_row, kb * BLOCK_K]).T
            acc, part = _promoted_dot(a, w, acc, part, kb, QUANT, PROMOTE_STEPS, BLOCK_K,
                                      UPCAST)
        if QUANT == "fp8" and PROMOTE_STEPS > 1:
            acc += part  # K not a multiple of PROMOTE_K: the last partial run
        if QUANT == "fp8":
            a_s = tl.load(a_scale_ptr + off_m + tl.arange(0, BLOCK_M))
            acc = acc * a_s[:, None] * tl.load(w_scale_ptr + expert)
        out = acc.to(c_ptr.dtype.element_ty)
        if TMA_STORE:
            # Writes the tile's padding rows too (their values are junk: never read downstream,
            # as the intermediate's padding slots); TMA clips columns past N.
            if EPI_SPLIT:
                halves = tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2))
                left, right = tl.split(tl.permute(halves, (0, 2, 1)))
                c_desc.store([off_m, off_n], left)
                c_desc.store([off_m, off_n + BLOCK_N // 2], right)
            else:
                c_desc.store([off_m, off_n], out)
        else:
            # padding rows masked, as our kernel does (64-bit rows: M_pad * N passes 2^31)
            rows = off_m + tl.arange(0, BLOCK_M)
            row_ok = tl.load(sorted_pair_ids_ptr + rows) < num_pairs
            cols = off_n + tl.arange(0, BLOCK_N)
            tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out,
                     mask=row_ok[:, None] & (cols < N)[None, :])


# ============================================================================ configs

@dataclass(frozen=True)
class Cfg:
    bm: int
    bn: int
    bk: int
    group_m: int
    warps: int
    stages: int
    flatten: bool = True      # persistent kernels without WS
    split: bool = False       # TMA-store epilogue in halves
    promote_k: int = 0        # fp8: columns between promotions (0: FP8_PROMOTE_K); shorter is
                              # more accurate; == bk promotes inside each dot

    @property
    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}g{self.group_m}w{self.warps}s{self.stages}"
                + ("" if self.flatten else "-nf") + ("-split" if self.split else "")
                + (f"-p{self.promote_k}" if self.promote_k else ""))


VARIANTS = ("ours", "ptr", "tma", "tma_st", "ws", "ws_st")
C = Cfg
# Ordered by expected value: with the deadline, the tail is what gets skipped. Every tile is
# BLOCK_M = 128 (the dispatch's row padding); the shared-memory filter drops the rest.
CONFIGS = {
    # ours: its defaults first (default_config: 128x256x64 g16 bf16, 128x128x128 g16 fp8)
    ("ours", "bf16"): [C(128, 256, 64, 16, 8, 3), C(128, 128, 64, 8, 8, 4),
                       C(128, 256, 64, 8, 8, 4)],
    ("ours", "fp8"): [C(128, 128, 128, 16, 8, 3), C(128, 256, 128, 16, 8, 3),
                      C(128, 128, 128, 16, 8, 4)],
    ("ptr", "bf16"): [C(128, 256, 64, 16, 8, 3)],
    ("ptr", "fp8"): [C(128, 128, 128, 16, 8, 3)],
    ("tma", "bf16"): [C(128, 256, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 4), C(128, 128, 64, 8, 8, 5),
                      C(128, 128, 128, 8, 8, 3), C(128, 256, 64, 16, 8, 3),
                      C(128, 256, 64, 8, 8, 3, flatten=False), C(128, 128, 64, 8, 4, 4)],
    # fp8: 128x128x256 promotes inside each dot (every 256 columns, like the two-accumulator
    # chains at BLOCK_K 64/128), "-p128" every 128 columns inside each dot (more accurate)
    ("tma", "fp8"): [C(128, 256, 128, 8, 8, 3), C(128, 128, 256, 8, 8, 3),
                     C(128, 128, 128, 8, 8, 4),
                     C(128, 256, 128, 8, 8, 4), C(128, 128, 128, 8, 8, 5), C(128, 256, 64, 8, 8, 5),
                     C(128, 128, 128, 8, 8, 4, promote_k=128),
                     C(128, 256, 128, 8, 8, 3, flatten=False), C(128, 128, 128, 8, 4, 4)],
    ("tma_st", "bf16"): [C(128, 256, 64, 8, 8, 3, split=True), C(128, 256, 64, 8, 8, 3),
                         C(128, 128, 64, 8, 8, 4)],
    ("tma_st", "fp8"): [C(128, 256, 128, 8, 8, 3, split=True), C(128, 128, 256, 8, 8, 3),
                        C(128, 128, 128, 8, 8, 4), C(128, 256, 128, 8, 8, 3)],
    # ws: num_warps=4 is the one count Triton 3.6's Hopper WS acts on (12 warps run). fp8 only
    # with the promotion inside the dot: an `if` promoting a second accumulator in the K loop
    # makes the WS pass give up silently (AOT_ONLY shows it).
    ("ws", "bf16"): [C(128, 256, 64, 8, 4, 3, False), C(128, 256, 64, 8, 4, 4, False),
                     C(128, 128, 64, 8, 4, 4, False), C(128, 128, 64, 8, 4, 5, False),
                     C(128, 128, 128, 8, 4, 3, False)],
    ("ws", "fp8"): [C(128, 128, 256, 8, 4, 3, False),
                    C(128, 128, 128, 8, 4, 4, False, promote_k=128),
                    C(128, 256, 128, 8, 4, 3, False, promote_k=128),
                    C(128, 128, 256, 8, 4, 2, False),
                    C(128, 128, 128, 8, 4, 5, False, promote_k=128),
                    C(128, 256, 128, 8, 4, 4, False, promote_k=128)],
    ("ws_st", "bf16"): [C(128, 256, 64, 8, 4, 3, False), C(128, 128, 64, 8, 4, 4, False)],
    ("ws_st", "fp8"): [C(128, 128, 256, 8, 4, 3, False),
                       C(128, 128, 128, 8, 4, 4, False, promote_k=128),
                       C(128, 256, 128, 8, 4, 3, False, promote_k=128)],
}

# Compiled by --aot only, to document what Triton 3.6 does with them on sm_90 (not worth GPU
# time): WS at num_warps=8 and WS with the two-accumulator fp8 promotion are silently not
# applied; WS with the split TMA-store epilogue fails in NVGPUWarpSpecialization.
AOT_ONLY = {
    ("ws", "bf16"): [C(128, 256, 64, 8, 8, 3, False)],
    ("ws", "fp8"): [C(128, 128, 128, 8, 4, 4, False), C(128, 128, 64, 8, 4, 4, False)],
    ("ws_st", "bf16"): [C(128, 256, 64, 8, 4, 3, False, split=True)],
    ("ws_st", "fp8"): [C(128, 128, 256, 8, 4, 3, False, split=True)],
}

SHAPES = {  # Mixtral 8x7B, T = 16384 tokens, top_k = 2
    "gemm1": dict(E=8, N=2 * 14336, K=4096, T=16384, top_k=2),
    "gemm2": dict(E=8, N=4096, K=14336, T=16384, top_k=2),
}
TINY_SHAPES = {  # interpreter: N not a multiple of BLOCK_N, several promotions, an empty expert
    "gemm1": dict(E=4, N=192, K=512, T=90, top_k=2),
    "gemm2": dict(E=3, N=128, K=768, T=70, top_k=2),
}
# tiles as on the GPU (BLOCK_M = 128), each code path once, few enough for the interpreter
TINY_CONFIGS = {
    ("ours", "bf16"): [C(128, 128, 64, 8, 4, 3)],
    ("ours", "fp8"): [C(128, 128, 128, 8, 4, 3), C(128, 128, 64, 8, 4, 3)],
    ("ptr", "bf16"): [C(128, 128, 64, 2, 4, 3)],
    ("ptr", "fp8"): [C(128, 128, 64, 2, 4, 3), C(128, 128, 256, 2, 4, 3)],
    ("tma", "bf16"): [C(128, 128, 64, 2, 8, 3), C(128, 256, 64, 1, 8, 3, flatten=False)],
    ("tma", "fp8"): [C(128, 128, 64, 2, 8, 3), C(128, 128, 256, 2, 8, 3),
                     C(128, 128, 128, 2, 8, 3, promote_k=128)],
    ("tma_st", "bf16"): [C(128, 128, 64, 2, 8, 3, split=True), C(128, 256, 64, 2, 8, 3)],
    ("tma_st", "fp8"): [C(128, 128, 128, 2, 8, 3)],
    ("ws", "bf16"): [C(128, 128, 64, 2, 4, 3, False)],
    ("ws", "fp8"): [C(128, 128, 128, 2, 4, 3, False, promote_k=128),
                    C(128, 128, 256, 2, 4, 3, False)],
    ("ws_st", "bf16"): [C(128, 128, 64, 2, 4, 3, False)],
    ("ws_st", "fp8"): [C(128, 128, 256, 2, 4, 3, False)],
}


def promote_k(cfg: Cfg) -> int:
    return cfg.promote_k or FP8_PROMOTE_K


def promote_steps(dtype: str, cfg: Cfg) -> int:
    return max(1, promote_k(cfg) // cfg.bk) if dtype == "fp8" else 1


def smem_estimate(variant: str, dtype: str, cfg: Cfg) -> int:
    """Pipelined A and W tiles, plus the TMA store's staging tile: a lower bound of what the
    compiler allocates (layout-conversion scratch comes on top)."""
    elem = 1 if dtype == "fp8" else 2
    smem = cfg.stages * (cfg.bm + cfg.bn) * cfg.bk * elem
    if variant.endswith("_st"):
        smem += cfg.bm * (cfg.bn // 2 if cfg.split else cfg.bn) * 2
    return smem


def config_problem(variant: str, dtype: str, cfg: Cfg, K: int) -> Optional[str]:
    if K % cfg.bk:
        return f"K={K} not a multiple of BLOCK_K={cfg.bk}"
    if dtype == "fp8" and promote_k(cfg) > FP8_PROMOTE_K:
        return f"fp8: promotions every {promote_k(cfg)} > FP8_PROMOTE_K={FP8_PROMOTE_K} columns"
    if dtype == "fp8" and (cfg.bk > promote_k(cfg) or promote_k(cfg) % cfg.bk):
        return f"fp8: BLOCK_K={cfg.bk} must divide the promotion length {promote_k(cfg)}"
    smem = smem_estimate(variant, dtype, cfg)
    if smem > SMEM_LIMIT:
        return f"{smem} B of shared memory > {SMEM_LIMIT}"
    return None


# ============================================================================ problem data

@dataclass
class Problem:
    shape: str
    dtype: str                       # "bf16" | "fp8"
    E: int
    N: int
    K: int
    num_pairs: int
    a: torch.Tensor                  # [M_alloc, K] bf16 / e4m3; padding rows NaN, dead rows 1
    w: torch.Tensor                  # [E, N, K]
    a_scale: Optional[torch.Tensor]  # [M_alloc] fp32 (fp8)
    w_scale: Optional[torch.Tensor]  # [E] fp32 (fp8)
    sorted_pair_ids: torch.Tensor    # [M_alloc] int32, sentinel num_pairs at padding
    block_expert_ids: torch.Tensor   # [M_alloc / 128] int32, -1 past the live blocks
    num_padded: torch.Tensor         # [1] int32
    live_rows: int                   # host copy of num_padded (tests only)
    real_slots: torch.Tensor         # [num_pairs] int64: slot of pair p (pairs in slot order)
    ref: torch.Tensor                # [num_pairs, N] fp32, row p = output of pair p

    @property
    def flops(self) -> float:
        return 2.0 * self.num_pairs * self.N * self.K


ALIGN_M = 128  # the dispatch's block_m: every BLOCK_M here is 128


def make_problem(shape_name: str, shape: dict, dtype: str, device, seed: int = 0,
                 skew: bool = False) -> Problem:
    E, N, K = shape["E"], shape["N"], shape["K"]
    P = shape["T"] * shape["top_k"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Rows per expert from a random routing (uniform: about P/E each); skew for the tiny tests:
    # one expert gets none, one gets most.
    probs = torch.ones(E)
    if skew:
        probs = torch.linspace(0.0, 1.0, E) ** 2
    expert_of_pair = torch.multinomial(probs, P, replacement=True, generator=g).sort().values
    counts = torch.bincount(expert_of_pair, minlength=E)
    padded = (counts + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    live = int(padded.sum())
    # the bound moe_align sizes its buffers with (from shapes alone)
    m_alloc = -(-(P + min(E, P) * (ALIGN_M - 1)) // ALIGN_M) * ALIGN_M
    starts = torch.cumsum(padded, 0) - padded
    rank = torch.arange(P) - (torch.cumsum(counts, 0) - counts)[expert_of_pair]
    real_slots = starts[expert_of_pair] + rank
    sorted_pair_ids = torch.full((m_alloc,), P, dtype=torch.int32)
    sorted_pair_ids[real_slots] = torch.arange(P, dtype=torch.int32)
    block_expert_ids = torch.full((m_alloc // ALIGN_M,), -1, dtype=torch.int32)
    block_expert_ids[: live // ALIGN_M] = torch.repeat_interleave(
        torch.arange(E, dtype=torch.int32), padded // ALIGN_M)

    gd = torch.Generator(device=device).manual_seed(seed + 1)
    # rows of different magnitudes (per-row fp8 scales then differ)
    x = torch.randn(P, K, device=device, generator=gd)
    x *= 1 + torch.rand(P, 1, device=device, generator=gd)
    w32 = torch.randn(E, N, K, device=device, generator=gd) / math.sqrt(K)
    real = real_slots.to(device)
    # Padding rows inside live blocks hold NaN (as never-written intermediate slots may); rows
    # past the live blocks hold ones, so a kernel that wrongly walked a dead block would write
    # finite values over the NaN-poisoned output there (the dead_rows_untouched check).
    if dtype == "bf16":
        a = torch.full((m_alloc, K), float("nan"), dtype=torch.bfloat16, device=device)
        a[live:] = 1.0
        a[real] = x.to(torch.bfloat16)
        w = w32.to(torch.bfloat16)
        del w32
        a_scale = w_scale = None
    else:
        a_scale = torch.ones(m_alloc, dtype=torch.float32, device=device)
        s = x.abs().amax(1).clamp_min(1e-12) / 448.0
        a_scale[real] = s
        # fp8 rows are written through uint8 views: indexing kernels for float8 dtypes are not
        # available everywhere
        a = torch.empty((m_alloc, K), dtype=torch.float8_e4m3fn, device=device)
        a_bytes = a.view(torch.uint8)
        a_bytes.fill_(0x7F)  # e4m3 NaN
        a_bytes[live:] = 0x38  # e4m3 1.0
        a_bytes[real] = (x / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        w_scale = w32.abs().amax((1, 2)).clamp_min(1e-12) / 448.0
        w = (w32 / w_scale[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        del w32
    del x
    ref = torch.empty((P, N), dtype=torch.float32, device=device)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference
    try:
        first = 0
        for e in range(E):
            c = int(counts[e])
            if c == 0:
                continue
            rows = real[first:first + c]
            ae = a.view(torch.uint8)[rows].view(a.dtype).float()
            if dtype == "fp8":
                ae = ae * a_scale[rows][:, None]
            we = w[e].float()
            if dtype == "fp8":
                we = we * w_scale[e]
            ref[first:first + c] = ae @ we.T
            first += c
            del ae, we
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return Problem(shape_name, dtype, E, N, K, P, a, w, a_scale, w_scale,
                   sorted_pair_ids.to(device), block_expert_ids.to(device),
                   torch.tensor([live], dtype=torch.int32, device=device), live, real, ref)


def compare(out_rows, ref) -> dict:
    """out_rows(i, j) -> the output rows of pairs i..j; errors over all real rows, chunked so
    no full-size fp64 temporary is made."""
    P = ref.shape[0]
    diff2 = ref2 = 0.0
    max_diff = max_ref = 0.0
    finite = True
    for i in range(0, P, 4096):
        j = min(P, i + 4096)
        o = out_rows(i, j).double()
        r = ref[i:j].double()
        if not bool(torch.isfinite(o).all()):
            finite = False
            break
        d = o - r
        diff2 += float((d * d).sum())
        ref2 += float((r * r).sum())
        max_diff = max(max_diff, float(d.abs().max()))
        max_ref = max(max_ref, float(r.abs().max()))
    if not finite:
        return dict(rel_err=float("nan"), max_err=float("nan"), finite=False)
    return dict(rel_err=math.sqrt(diff2 / max(ref2, 1e-300)),
                max_err=max_diff / max(max_ref, 1e-300), finite=True)


# ============================================================================ launchers

def _alloc_scratch(size: int, alignment: int, stream):
    """triton.set_allocator: the global scratch of tl.make_tensor_descriptor (one TMA
    descriptor of 128 bytes per descriptor and program)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def num_sms(device) -> int:
    if INTERPRET:
        return 3  # few "SMs" so each interpreted program walks several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def make_runner(variant: str, prob: Problem, cfg: Cfg):
    """(run, out_rows): run() launches once into a fixed output buffer and returns the compiled
    kernel (None for ours); out_rows(i, j) reads the rows of pairs i..j from that buffer."""
    dtype, E, N, K, P = prob.dtype, prob.E, prob.N, prob.K, prob.num_pairs
    device = prob.a.device
    quant = "fp8" if dtype == "fp8" else "none"
    steps = promote_steps(dtype, cfg)
    dummy = prob.a_scale if prob.a_scale is not None else torch.zeros(1, device=device)
    w_scale = prob.w_scale if prob.w_scale is not None else dummy
    # the interpreter's bf16 dot is wrong (fp32 copies instead); its fp8 dot widens e4m3
    # exactly and is right, so fp8 runs its own dtypes there
    upcast = INTERPRET and dtype == "bf16"

    if variant == "ours":
        # GEMM2 form of our kernel: A read in slot order, out[pair] = 1.0 * (A @ W[e]^T).
        expert_of_pair = prob.block_expert_ids.long().repeat_interleave(ALIGN_M)[prob.real_slots]
        routing = gg.Routing(
            topk_ids=expert_of_pair.to(torch.int32), topk_weights=torch.ones(P, device=device),
            top_k=2, num_experts=E, local_expert_offset=0,
            sorted_pair_ids=prob.sorted_pair_ids, block_expert_ids=prob.block_expert_ids,
            align_block_m=ALIGN_M)
        # per-row weight scales [E, N] (our fp8 layout), the same per-expert value on each row
        w_scale_rows = (prob.w_scale[:, None].expand(E, N).contiguous()
                        if dtype == "fp8" else None)
        out = torch.empty((P, N), dtype=torch.bfloat16, device=device)
        config = gg.GemmConfig(cfg.bm, cfg.bn, cfg.bk, cfg.group_m, cfg.warps, cfg.stages)

        def run():
            saved = gg.FP8_PROMOTE_K  # read by the launcher
            gg.FP8_PROMOTE_K = promote_k(cfg)
            try:
                gg.gemm2(prob.a, prob.a_scale, prob.w, w_scale_rows, None, out, routing, config,
                         quant=quant, atomic_out=False,
                         interpret_upcast=INTERPRET and dtype == "bf16")
            finally:
                gg.FP8_PROMOTE_K = saved
            return None
        return run, (lambda i, j: out[i:j]), out

    out = torch.empty((prob.a.shape[0], N), dtype=torch.bfloat16, device=device)
    if variant == "ptr":
        num_m_blocks = prob.a.shape[0] // cfg.bm
        grid = (num_m_blocks * triton.cdiv(N, cfg.bn),)

        def run():
            return _ptr_gemm_kernel[grid](
                prob.a, prob.w, out, dummy, w_scale, prob.sorted_pair_ids, prob.block_expert_ids,
                num_m_blocks, N, K, P,
                QUANT=quant, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.group_m,
                PROMOTE_STEPS=steps, UPCAST=upcast, num_warps=cfg.warps, num_stages=cfg.stages)
    else:
        sms = num_sms(device)
        ws = variant.startswith("ws")

        def run():
            return _tma_persistent_kernel[(sms,)](
                prob.a, prob.w, out, dummy, w_scale, prob.sorted_pair_ids, prob.block_expert_ids,
                prob.num_padded, prob.a.shape[0], N, K, E, P,
                QUANT=quant, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.group_m,
                NUM_SMS=sms, PROMOTE_STEPS=steps, TMA_STORE=variant.endswith("_st"),
                EPI_SPLIT=cfg.split, WARP_SPEC=ws, FLATTEN=cfg.flatten and not ws,
                UPCAST=upcast, num_warps=cfg.warps, num_stages=cfg.stages)
    return run, (lambda i, j: out[prob.real_slots[i:j]]), out


def kernel_info(kernel) -> dict:
    """Registers, spills, shared memory and warps of a compiled kernel (GPU runs)."""
    if kernel is None or INTERPRET:
        return {}
    info = {}
    for key in ("n_regs", "n_spills"):
        if hasattr(kernel, key):
            info[key] = getattr(kernel, key)
    md = getattr(kernel, "metadata", None)
    if md is not None:
        info["shared"] = getattr(md, "shared", None)
        info["warps_run"] = getattr(md, "num_warps", None)  # 12 when Hopper WS took effect
    asm = getattr(kernel, "asm", {}) or {}
    if "ttgir" in asm:
        info["ws_applied"] = "ttg.warp_specialize" in asm["ttgir"]
    return info


class CapturedStderr:
    """Redirects file descriptor 2 into a temporary file while active: MLIR pass failures print
    their diagnostics (and a long reproducer) there, while the Python exception only says
    "PassManager::run failed". `errors()` keeps the diagnostic lines for the JSON record."""

    def __enter__(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()
        return False

    def errors(self, limit: int = 6) -> str:
        lines = [ln.strip() for ln in self.text.splitlines()
                 if re.search(r"error:|Assertion|Pipeline failed|LLVM ERROR", ln)]
        return " | ".join(lines[:limit])[:800]


# ============================================================================ the GPU run

def run_one(variant: str, prob: Problem, cfg: Cfg, deadline: float, time_it: bool) -> dict:
    row = dict(kind="run", shape=prob.shape, dtype=prob.dtype, variant=variant, config=cfg.name,
               cfg=asdict(cfg), promote_k=promote_k(cfg) if prob.dtype == "fp8" else None,
               M_real=prob.num_pairs, N=prob.N, K=prob.K, E=prob.E)
    why = config_problem(variant, prob.dtype, cfg, prob.K)
    if why:
        row.update(skipped=why)
        return row
    if time.time() > deadline:
        row.update(skipped="deadline")
        return row
    out = None
    try:
        t0 = time.time()
        run, out_rows, out = make_runner(variant, prob, cfg)
        out.fill_(float("nan"))  # poison: a row the kernel fails to write shows up
        captured = CapturedStderr()
        try:
            with captured:  # the first call compiles
                kernel = run()
                if not INTERPRET:
                    torch.cuda.synchronize()
        except Exception as exc:
            raise RuntimeError(f"{type(exc).__name__}: {str(exc)[:300]} "
                               f"[{captured.errors()}]") from None
        row.update(first_call_s=round(time.time() - t0, 2), **kernel_info(kernel))
        row.update(compare(out_rows, prob.ref))
        if variant != "ours":
            # rows past num_padded belong to no block: nothing may write them
            row["dead_rows_untouched"] = bool(torch.isnan(out[prob.live_rows:].float()).all())
        row["ok"] = (row["finite"] and row["rel_err"] < 1e-2
                     and row.get("dead_rows_untouched", True))
        if time_it:
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            row.update(us=ms * 1e3, tflops=prob.flops / (ms * 1e-3) / 1e12)
    except Exception as exc:  # noqa: BLE001  (a compile failure must not end the run)
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:600]}")
        traceback.print_exc(limit=3)
    finally:
        del out
    return row


def fmt_row(r: dict) -> str:
    head = f"{r['shape']} {r['dtype']:4} {r['variant']:6} {r['config']:24}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:160]}"
    t = f"{r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s " if "us" in r else ""
    extra = "".join(f" {k}={r[k]}" for k in ("n_regs", "n_spills", "shared", "warps_run",
                                              "ws_applied") if k in r)
    return (f"{head} {t}rel_err {r['rel_err']:.2e} max_err {r['max_err']:.2e} "
            f"{'ok' if r['ok'] else 'FAIL'}{extra}")


def bench(args) -> int:
    if not torch.cuda.is_available():
        print("dev_prefill_ws: no CUDA device (--interpret-selftest / --aot run without one)")
        return 1
    triton.set_allocator(_alloc_scratch)
    device = torch.device("cuda")
    deadline = START + args.deadline_s
    blocks = [(shape_name, dtype) for shape_name in args.shapes for dtype in args.dtypes]
    for index, (shape_name, dtype) in enumerate(blocks):
        # each (shape, dtype) block gets an equal share of the time left, so a slow first
        # block cannot starve the others
        block_deadline = time.time() + (deadline - time.time()) / (len(blocks) - index)
        if time.time() > deadline:
            log(f"deadline: {shape_name} {dtype} skipped")
            RESULTS.append(dict(kind="run", shape=shape_name, dtype=dtype, skipped="deadline"))
            continue
        t0 = time.time()
        prob = make_problem(shape_name, SHAPES[shape_name], dtype, device, seed=1)
        torch.cuda.synchronize()
        log(f"{shape_name} {dtype}: M_real={prob.num_pairs} live rows={prob.live_rows} "
            f"N={prob.N} K={prob.K}, data + fp32 reference in {time.time() - t0:.1f} s")
        # Round-robin over the variants (each one's configs in priority order): if the
        # deadline hits, every variant has had its best guesses measured.
        queues = [[(v, c) for c in CONFIGS[(v, dtype)]] for v in args.variants]
        order = []
        while any(queues):
            for q in queues:
                if q:
                    order.append(q.pop(0))
        for variant, cfg in order:
            row = run_one(variant, prob, cfg, block_deadline, time_it=True)
            RESULTS.append(row)
            log(fmt_row(row))
        del prob
        torch.cuda.empty_cache()
        save(args.out, "prefill_ws.json")
    path = save(args.out, "prefill_ws.json")
    log(f"wrote {path}")
    print_table()
    return 0 if all(r.get("ok", True) for r in RESULTS if "error" not in r) else 1


# ============================================================================ CPU modes

def selftest(args) -> int:
    """Every variant on the interpreter, tiny shapes (BLOCK_M = 128 tiles as on the GPU),
    skewed routing, against the fp32 reference."""
    device = torch.device("cpu")
    for shape_name, shape in TINY_SHAPES.items():
        for dtype in ("bf16", "fp8"):
            prob = make_problem(shape_name, shape, dtype, device, seed=7, skew=True)
            log(f"{shape_name} {dtype}: pairs={prob.num_pairs} live rows={prob.live_rows} "
                f"alloc rows={prob.a.shape[0]} N={prob.N} K={prob.K}")
            for variant in args.variants:
                for cfg in TINY_CONFIGS[(variant, dtype)]:
                    row = run_one(variant, prob, cfg, float("inf"), time_it=False)
                    row["kind"] = "selftest"
                    RESULTS.append(row)
                    log(fmt_row(row))
    path = save(args.out, "prefill_ws_selftest.json")
    bad = [r for r in RESULTS if not r.get("ok")]
    print(f"\nselftest: {len(RESULTS) - len(bad)} ok, {len(bad)} failed -> {path}")
    for r in bad:
        print("  FAIL", fmt_row(r))
    return 1 if bad else 0


def _ptxas_usage(ptx: str) -> dict:
    """Registers and spills from the wheel's ptxas (-v) for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.o")],
            capture_output=True, text=True)
    log_text = proc.stdout + proc.stderr
    info = {}
    m = re.search(r"Used (\d+) registers", log_text)
    if m:
        info["n_regs"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log_text)
    if m:
        info["spill_stores"], info["spill_loads"] = int(m.group(1)), int(m.group(2))
    return info


# integer kernel arguments that are multiples of 16 on the GPU shapes (N, K, strides, M_pad)
_DIV16_INTS = {"N", "K", "M_pad", "stride_am", "stride_we", "stride_wn", "stride_om", "stride_wse"}


def _ours_aot_args(dtype: str, cfg: Cfg):
    """Signature and constexprs of moe_ops' _grouped_gemm_kernel as make_runner's "ours"
    launches it (gemm2 form, no bias, per-row fp8 weight scales, PDL on)."""
    fn = gg._grouped_gemm_kernel
    ptr = "*fp8e4nv" if dtype == "fp8" else "*bf16"
    sig = dict(a_ptr=ptr, a_scale_ptr="*fp32", w_ptr=ptr, w_scale_ptr="*fp32", bias_ptr="*fp32",
               out_ptr="*bf16", w_global_scale_ptr="*fp32", sorted_pair_ids_ptr="*i32",
               block_expert_ids_ptr="*i32", topk_ids_ptr="*i32", topk_weights_ptr="*fp32",
               alpha="fp32", limit="fp32")
    for name in ("N", "K", "num_pairs", "top_k", "num_experts", "local_expert_offset",
                 "num_m_blocks", "stride_am", "stride_asm", "stride_we", "stride_wn",
                 "stride_wt", "stride_wse", "stride_wsn", "stride_be", "stride_om", "stride_wge"):
        sig[name] = "i32"
    constexprs = dict(ALIGN_BLOCK_M=ALIGN_M, DIRECT=False, GATHER_A=False, ATOMIC_OUT=False,
                      QUANT="fp8" if dtype == "fp8" else "none", ACTIVATION="none",
                      HAS_BIAS=False, MUL_ROUTED_WEIGHT=True, BLOCK_M=cfg.bm, BLOCK_N=cfg.bn,
                      BLOCK_K=cfg.bk, GROUP_M=cfg.group_m, SWAP_AB=False, UPCAST=False,
                      DOT_PRECISION="tf32", EVEN_K=True, FAST_FP4=False, SPLIT_K=1,
                      PROMOTE_STEPS=promote_steps(dtype, cfg), USE_PDL=True)
    # launch-time specialization of the arguments equal to 1 (stride of contiguous scales)
    if dtype == "fp8":
        for name in ("stride_asm", "stride_wsn"):
            sig.pop(name)
            constexprs[name] = 1
    return fn, sig, constexprs


def aot(args) -> int:
    """Compile every variant x config x dtype for sm_90 without a GPU, with the specialization
    a launch on the gemm1 shape would get (16-byte aligned pointers, strides multiple of 16)."""
    from triton.backends.compiler import GPUTarget
    target = GPUTarget("cuda", 90, 32)
    dtypes = {"bf16": "*bf16", "fp8": "*fp8e4nv"}
    for variant in args.variants:
        for dtype in args.dtypes:
            for cfg in CONFIGS[(variant, dtype)] + AOT_ONLY.get((variant, dtype), []):
                row = dict(kind="aot", variant=variant, dtype=dtype, config=cfg.name,
                           aot_only=cfg in AOT_ONLY.get((variant, dtype), []))
                why = config_problem(variant, dtype, cfg, 4096)
                if why:
                    row.update(skipped=why)
                    RESULTS.append(row)
                    log(f"{variant:6} {dtype:4} {cfg.name:24} skipped: {why}")
                    continue
                ptr_a = dtypes[dtype]
                common = dict(QUANT="fp8" if dtype == "fp8" else "none", BLOCK_M=cfg.bm,
                              BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.group_m,
                              PROMOTE_STEPS=promote_steps(dtype, cfg), UPCAST=False)
                if variant == "ours":
                    fn, sig, constexprs = _ours_aot_args(dtype, cfg)
                elif variant == "ptr":
                    fn = _ptr_gemm_kernel
                    sig = dict(a_ptr=ptr_a, w_ptr=ptr_a, c_ptr="*bf16", a_scale_ptr="*fp32",
                               w_scale_ptr="*fp32", sorted_pair_ids_ptr="*i32",
                               block_expert_ids_ptr="*i32", num_m_blocks="i32", N="i32", K="i32",
                               num_pairs="i32")
                    constexprs = common
                else:
                    fn = _tma_persistent_kernel
                    ws = variant.startswith("ws")
                    sig = dict(a_ptr=ptr_a, w_ptr=ptr_a, c_ptr="*bf16", a_scale_ptr="*fp32",
                               w_scale_ptr="*fp32", sorted_pair_ids_ptr="*i32",
                               block_expert_ids_ptr="*i32", num_padded_ptr="*i32", M_pad="i32",
                               N="i32", K="i32", num_experts="i32", num_pairs="i32")
                    constexprs = dict(common, NUM_SMS=132, TMA_STORE=variant.endswith("_st"),
                                      EPI_SPLIT=cfg.split, WARP_SPEC=ws,
                                      FLATTEN=cfg.flatten and not ws)
                sig.update({k: "constexpr" for k in constexprs})
                sig = {name: sig[name] for name in fn.arg_names}  # the kernel's order
                # what a launch specializes on: 16-byte aligned pointers (torch allocations),
                # integer arguments divisible by 16 (the strides and sizes here are). Without
                # the integer hints the stores are not vectorized and 128x256 tiles spill.
                attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
                         if v.startswith("*") or (v == "i32" and k in _DIV16_INTS)}
                t0 = time.time()
                captured = CapturedStderr()
                try:
                    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                                    attrs=attrs)
                    with captured:
                        compiled = triton.compile(src, target=target, options=dict(
                            num_warps=cfg.warps, num_stages=cfg.stages))
                    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
                    row.update(ok=True, compile_s=round(time.time() - t0, 1),
                               shared=compiled.metadata.shared,
                               warps_run=compiled.metadata.num_warps,
                               ws_applied="ttg.warp_specialize" in ttgir,
                               tma_loads=ptx.count("cp.async.bulk.tensor") > 0,
                               wgmma=bool(re.search(r"wgmma\.mma_async", ptx)),
                               wgmma_wait0_sites=ptx.count("wgmma.wait_group.sync.aligned 0"),
                               **_ptxas_usage(ptx))
                    if compiled.metadata.shared > SMEM_LIMIT:
                        row.update(ok=False,
                                   error=f"shared {compiled.metadata.shared} > {SMEM_LIMIT}")
                except Exception as exc:  # noqa: BLE001
                    msg = str(exc).strip().splitlines()
                    row.update(ok=False, error=f"{type(exc).__name__}: {' | '.join(msg[-3:])[:300]}"
                               f" [{captured.errors()}]")
                RESULTS.append(row)
                log(f"{variant:6} {dtype:4} {cfg.name:24} " + (
                    "ok  " + " ".join(f"{k}={row[k]}" for k in (
                        "shared", "warps_run", "ws_applied", "n_regs", "spill_stores",
                        "compile_s") if k in row)
                    if row.get("ok") else f"FAIL {row.get('error')}"))
    path = save(args.out, "prefill_ws_aot.json")
    bad = [r for r in RESULTS if r.get("ok") is False]
    unexpected = [r for r in bad if not r.get("aot_only")]
    print(f"\naot sm_90: {sum(bool(r.get('ok')) for r in RESULTS)} compiled, {len(bad)} failed "
          f"({len(bad) - len(unexpected)} of them AOT_ONLY demonstrations), "
          f"{sum('skipped' in r for r in RESULTS)} skipped -> {path}")
    return 1 if unexpected else 0


# ============================================================================ output

def save(out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    meta = dict(torch=torch.__version__, triton=triton.__version__, argv=sys.argv,
                elapsed_s=round(time.time() - START, 1), fp8_promote_k=FP8_PROMOTE_K,
                interpret=INTERPRET,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                shapes=SHAPES, targets_tflops=dict(bf16=650, fp8=1100))
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=RESULTS), f, indent=1)
    return path


def print_table() -> None:
    """Best config per (shape, dtype, variant), with the speedup over ours' best."""
    best = {}
    for r in RESULTS:
        if r.get("kind") != "run" or "us" not in r or not r.get("ok"):
            continue
        key = (r["shape"], r["dtype"], r["variant"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    failed = {}
    for r in RESULTS:
        if r.get("kind") == "run" and "variant" in r and ("error" in r or r.get("ok") is False):
            failed.setdefault((r["shape"], r["dtype"], r["variant"]), 0)
            failed[(r["shape"], r["dtype"], r["variant"])] += 1
    print(f"\n{'shape':6} {'dtype':5} {'variant':7} {'best config':24} {'us':>9} {'TFLOP/s':>8} "
          f"{'vs ours':>7} {'rel_err':>8} {'fail':>4}")
    for shape in SHAPES:
        for dtype in ("bf16", "fp8"):
            ours = best.get((shape, dtype, "ours"))
            for variant in VARIANTS:
                r = best.get((shape, dtype, variant))
                nfail = failed.get((shape, dtype, variant), 0)
                if r is None:
                    if nfail:
                        print(f"{shape:6} {dtype:5} {variant:7} {'(all failed)':24} {'':>9} "
                              f"{'':>8} {'':>7} {'':>8} {nfail:4d}")
                    continue
                vs = f"{ours['us'] / r['us']:.3f}" if ours else "-"
                print(f"{shape:6} {dtype:5} {variant:7} {r['config']:24} {r['us']:9.1f} "
                      f"{r['tflops']:8.1f} {vs:>7} {r['rel_err']:8.1e} {nfail:4d}")
    print("targets (gemm1, T=16384): bf16 650 TFLOP/s, fp8 1100 TFLOP/s; "
          "errors per config in the JSON")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("MOE_OPS_RESULTS_DIR") or "out")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--deadline-s", type=float, default=170.0,
                    help="skip the runs left after this many seconds (default 170)")
    ap.add_argument("--interpret-selftest", "--tiny", dest="selftest", action="store_true",
                    help="run every kernel in the CPU interpreter on tiny shapes")
    ap.add_argument("--aot", action="store_true",
                    help="compile every variant for sm_90 ahead of time (no GPU needed)")
    args = ap.parse_args()
    if args.selftest:
        return selftest(args)
    if args.aot:
        return aot(args)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
