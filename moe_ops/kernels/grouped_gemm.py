"""The grouped expert GEMM: one Triton kernel family for both GEMMs of the experts.

Each program computes a [block_m, block_n] tile of one expert's output: the block_m rows are
(token, slot) pairs of that expert, taken from the dispatch (align.py) or, in "direct" mode for
the smallest batches, one pair per block read straight from topk_ids (no dispatch launch).

GEMM1  h = x[pair // top_k] @ w13[e]^T (+ b13) -> act -> intermediate[slot]   (x.dtype)
       The token rows are gathered inside the loads (no permuted copy of x). w13 interleaves gate
       and up rows (2i, 2i+1), so one tile holds gate and up of the same intermediate columns and
       the activation runs in the epilogue: the [BM, BN] accumulator is split into two
       [BM, BN/2] halves.
GEMM2  y = intermediate[slot] @ w2[e]^T (+ b2), times topk_weights[pair], then either
       written as one row per pair (combine="rows", then `combine_pair_rows` sums the k rows of a
       token in a fixed order: deterministic) or added atomically into an fp32 [T, H] output
       (combine="atomic": no [T*k, H] buffer, but the summation order varies run to run).

The intermediate is indexed by the pair's slot in the dispatch (its sorted position), so GEMM2
reads it contiguously; padding slots are never written and always masked.

Quantization (tl.constexpr QUANT): "none" (x.dtype operands), "fp8" (e4m3 operands, one scale
per token row and one per weight row, applied in the epilogue), "fp8_block" (one scale per
token per 128 columns of K and per 128x128 weight block, applied inside the K loop, so
block_k must divide 128). Both fp8 modes add each BLOCK_K partial product into the fp32
accumulator: Hopper's fp8 MMA does not accumulate in full fp32.

Config: every launch takes a `GemmConfig` (tiles, warps, stages, swap-AB). `config_space`,
`config_problems` and `default_config` describe the choices for a `GemmProblem`; GEMM1 and GEMM2
are separate problems with separate configs. Split-K is not implemented: the decode points
measured (Mixtral T=1: 2 experts x 64 N-tiles in GEMM2, under one program per SM) already
stream weights at 88-96% of the byte floor without it.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import List, Optional

import torch
import triton
import triton.language as tl

from moe_ops.kernels.common import (
    FP8_BLOCK, apply_activation, cdiv, next_power_of_2, round_to_dtype,
)

# Shared memory per block on sm_90 (227 KiB opt-in), less a margin for the epilogue's
# layout conversions (the gate/up split goes through shared memory).
_SMEM_LIMIT_BYTES = 227 * 1024 - 16 * 1024


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Compute w @ a^T so the weight tile fills the MMA's M side (>= 64 for wgmma) when there
    # are few rows per expert.
    swap_ab: bool = False


@dataclass(frozen=True)
class GemmProblem:
    """What a config is chosen for. n, k: the GEMM's output and reduction sizes."""
    gemm: int                  # 1 or 2
    num_experts: int
    n: int                     # GEMM1: N13 (2I gated, I relu2); GEMM2: H
    k: int                     # GEMM1: H; GEMM2: I
    tokens_per_expert: float   # T * top_k / E, the expected rows per expert
    dtype: torch.dtype         # activation dtype (x.dtype)
    quant: str = "none"
    gated: bool = True

    @property
    def operand_bytes(self) -> int:
        return 1 if self.quant != "none" else self.dtype.itemsize


def config_problems(problem: GemmProblem, config: GemmConfig) -> List[str]:
    """Why a config cannot run this problem (empty list: valid)."""
    why = []
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            why.append(f"{name}={value}: must be a power of two >= 16 (tl.dot minimum, tl.arange)")
    if problem.quant != "none" and config.block_k < 32:
        why.append("fp8 dots need block_k >= 32 (the e4m3 MMA's K)")
    if problem.quant == "fp8_block" and config.block_k > FP8_BLOCK:
        why.append(f"fp8_block scales change every {FP8_BLOCK} columns: block_k must divide it")
    if problem.gemm == 1 and problem.gated and config.block_n < 32:
        why.append("gated GEMM1 splits block_n into gate/up halves: block_n >= 32")
    if config.num_warps not in (1, 2, 4, 8, 16):
        why.append(f"num_warps={config.num_warps}")
    if not 1 <= config.num_stages <= 8:
        why.append(f"num_stages={config.num_stages}")
    if config.group_m < 1:
        why.append("group_m >= 1")
    smem = config.num_stages * (config.block_m + config.block_n) * config.block_k
    smem *= 4 if problem.dtype == torch.float32 and problem.quant == "none" else problem.operand_bytes
    if smem > _SMEM_LIMIT_BYTES:
        why.append(f"{smem} bytes of pipelined tiles exceed the shared memory of sm_90")
    return why


def is_valid_config(problem: GemmProblem, config: GemmConfig) -> bool:
    return not config_problems(problem, config)


def config_space(problem: GemmProblem, prune: bool = True) -> List[GemmConfig]:
    """Valid configs for a problem; with prune, only block_m near the rows per expert."""
    rows = max(1.0, problem.tokens_per_expert)
    block_ms = [16, 32, 64, 128, 256]
    if prune:
        largest = max(16, 2 * next_power_of_2(int(rows + 0.999)))
        block_ms = [m for m in block_ms if m <= largest]
    configs = []
    for bm, bn, bk, gm, warps, stages, swap in itertools.product(
            block_ms, (32, 64, 128, 256), (32, 64, 128, 256), (1, 8, 16), (4, 8), (2, 3, 4, 5),
            (False, True)):
        if swap and bm > 64:
            continue  # swap-AB only pays when the token side is narrow
        config = GemmConfig(bm, bn, bk, gm, warps, stages, swap)
        if is_valid_config(problem, config):
            configs.append(config)
    return configs


# Reduction length from which decode tiles stream deeper (see default_config).
LONG_K_DECODE = 8192


@functools.lru_cache(maxsize=4096)
def default_config(problem: GemmProblem) -> GemmConfig:
    """Heuristic from the expected rows per expert m = T*k/E; a starting point for tuning.

    Measured on one H200 (benchmarks/dev_experts_gpu.py, CUDA-graph replay, 2026 run):
    - m <= 16 (decode): weight streaming at 93-96% of the 4.55 TB/s floor with 16x64x128 tiles
      (Mixtral T=16, DeepSeek fp8_block T=16/256); swap-AB was 1-5% faster on both GEMMs.
    - m = 64 with 32-row blocks (Mixtral T=256) read each expert's weights twice: 41% of the
      floor. Hence 64-row blocks from m > 16 on.
    - m >= 256, bf16: 128x256x64 at 8 warps; group_m=16 took Mixtral T=4096 from 580 to about
      700 TFLOP/s (each GEMM ~440 us faster): a wave's weight and row tiles fit L2 together.
    - fp8 modes, m >= 128: 64x128x128 at 4 warps beat every 128-row tile tried (DeepSeek
      fp8_block T=4096: 6.7 ms vs 7.1-20 ms): the per-step fp32 promotion needs a second
      accumulator's worth of registers, and 128x256 spills.
    """
    m = problem.tokens_per_expert
    fp8 = problem.quant != "none"
    fp32 = problem.dtype == torch.float32 and not fp8
    wide_k = 64 if fp32 else 128
    if m <= 16:
        # Decode: a stream of the hit experts' weights; narrow N tiles give enough programs to
        # keep every SM's loads in flight, deep pipelining hides the latency. Swap-AB puts the
        # weight tile on the MMA's 64-row side (wgmma instead of mma.sync at 16 rows).
        config = GemmConfig(16, 64, wide_k, 8, 4, 4, swap_ab=True)
        if problem.quant == "fp8" and problem.k >= LONG_K_DECODE:
            # A long reduction streamed by few programs (Mixtral's down projection: K = 14336,
            # 64 N-tiles an expert) needs more bytes in flight per program: 256-wide K steps,
            # 5 deep. Mixtral fp8 T=1 on the H200, the experts call: 112 -> 100 us
            # (benchmarks/results/h200_sweep_configs.json). fp8_block keeps K steps within
            # one 128-wide scale block.
            config = GemmConfig(16, 64, 256, 8, 4, 5, swap_ab=True)
    elif fp8:
        config = GemmConfig(64, 128, 128, 8, 4, 3)
    elif m <= 128:
        config = GemmConfig(64, 128, 64, 8, 4, 4)
    elif fp32:
        config = GemmConfig(128, 128, 32, 8, 8, 3)
    else:
        config = GemmConfig(128, 256, 64, 16, 8, 3)
    if not is_valid_config(problem, config):
        # fp32 operands at large tiles overflow shared memory: shrink stages, then K.
        for stages in (2, 1):
            config = GemmConfig(config.block_m, config.block_n, config.block_k, config.group_m,
                                config.num_warps, stages, config.swap_ab)
            if is_valid_config(problem, config):
                break
        else:
            config = GemmConfig(config.block_m, min(config.block_n, 128), 32, config.group_m,
                                config.num_warps, 2, config.swap_ab)
    return config


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    sorted_pair_ids_ptr, block_expert_ids_ptr, topk_ids_ptr, topk_weights_ptr,
    N, K, num_pairs, top_k, num_experts, local_expert_offset, num_m_blocks,
    stride_am, stride_asm,
    stride_we, stride_wn,
    stride_wse, stride_wsn,
    stride_be, stride_om,
    alpha, limit,
    ALIGN_BLOCK_M: tl.constexpr,    # block_m of the dispatch (a multiple of BLOCK_M)
    DIRECT: tl.constexpr,           # one pair per block, read from topk_ids (no dispatch)
    GATHER_A: tl.constexpr,         # A row = pair // top_k (GEMM1) instead of the slot (GEMM2)
    ATOMIC_OUT: tl.constexpr,       # GEMM2: add into out[token] instead of storing out[pair]
    QUANT: tl.constexpr,            # "none" | "fp8" | "fp8_block"
    ACTIVATION: tl.constexpr,       # GEMM1: "swiglu" | "geglu" | "swiglu_oai" | "relu2"; GEMM2: "none"
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
    UPCAST: tl.constexpr,           # interpreter only: its 16-bit tl.dot is wrong, use fp32
    DOT_PRECISION: tl.constexpr,    # "ieee" for fp32 operands: no silent TF32
    EVEN_K: tl.constexpr,
):
    # Grouped ordering: GROUP_M consecutive row blocks walk the N tiles together, so a weight
    # tile read from HBM is reused from L2 by the other row blocks of the same expert.
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    blocks_per_group = GROUP_M * num_n_blocks
    first_m = (pid // blocks_per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % blocks_per_group) % group_size
    pid_n = (pid % blocks_per_group) // group_size

    offs_r = tl.arange(0, BLOCK_M)
    if DIRECT:
        expert = tl.load(topk_ids_ptr + pid_m).to(tl.int64) - local_expert_offset
        if (expert < 0) | (expert >= num_experts):
            return
        pair_ids = tl.where(offs_r == 0, pid_m, num_pairs)
        slots = pair_ids  # the intermediate has one row per pair
    else:
        # Every slot past the live ones, and every padding slot, holds the sentinel; pairs
        # come first in an expert's run, so a sentinel first row means a dead block.
        first_pair = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M)
        if first_pair >= num_pairs:
            return
        expert = tl.load(block_expert_ids_ptr + (pid_m * BLOCK_M) // ALIGN_BLOCK_M).to(tl.int64)
        slots = pid_m * BLOCK_M + offs_r
        pair_ids = tl.load(sorted_pair_ids_ptr + slots)
    row_ok = pair_ids < num_pairs
    # 64-bit row offsets: T * k * H passes 2^31 at large prefill.
    if GATHER_A:
        a_rows = (pair_ids // top_k).to(tl.int64)
    else:
        a_rows = slots.to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Weight rows past N wrap around instead of being masked (their results are dropped at
    # the store): unmasked loads along N keep the weight stream vectorized.
    w_rows = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    w_expert_ptr = w_ptr + expert * stride_we
    if SWAP_AB:
        a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None]       # [BK, BM]
        w_ptrs = w_expert_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]       # [BM, BK]
        w_ptrs = w_expert_ptr + w_rows[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if QUANT == "fp8_block":
        if ACTIVATION == "none" or ACTIVATION == "relu2":
            scale_rows = w_rows // 128
        else:
            # gated: w13 row r is (gate|up)[r // 2], block scales interleave the same way
            scale_rows = 2 * ((w_rows // 2) // 128) + w_rows % 2
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + scale_rows * stride_wsn
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm

    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        if SWAP_AB:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=row_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
                w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if QUANT == "fp8_block":
            # Scales change every 128 columns of K: scale each partial product before it
            # joins the fp32 accumulator (block_k divides 128, so one group per step).
            group = (kb * BLOCK_K) // 128
            a_s = tl.load(a_scale_ptrs + group, mask=row_ok, other=0.0)
            w_s = tl.load(w_scale_ptrs + group)
            if SWAP_AB:
                acc += tl.dot(w, a) * w_s[:, None] * a_s[None, :]
            else:
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        elif QUANT == "fp8":
            # Hopper's fp8 MMA keeps only about 14 bits while it accumulates (measured here:
            # 1.2e-2 relative error at K=2048 with Triton's sm_90 default of never promoting):
            # promote the partial sum into the fp32 accumulator every BLOCK_K, as DeepGEMM does
            # every 128 (and as the fp8_block branch does by construction).
            if SWAP_AB:
                acc = tl.dot(w, a, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            if SWAP_AB:
                acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if SWAP_AB:
        acc = tl.trans(acc)

    if QUANT == "fp8":
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)
        w_s = tl.load(w_scale_ptr + expert * stride_wse + w_rows * stride_wsn)
        acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + w_rows)[None, :]

    out_ty = out_ptr.dtype.element_ty
    if ACTIVATION == "none":
        if MUL_ROUTED_WEIGHT:
            routed_weight = tl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)
            acc = acc * routed_weight[:, None]
        mask = row_ok[:, None] & (offs_n < N)[None, :]
        if ATOMIC_OUT:
            tokens = (pair_ids // top_k).to(tl.int64)
            tl.atomic_add(out_ptr + tokens[:, None] * stride_om + offs_n[None, :], acc,
                          mask=mask, sem="relaxed")
        else:
            out_rows = pair_ids.to(tl.int64)
            tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :],
                     round_to_dtype(acc, out_ty), mask=mask)
    else:
        out_rows = slots.to(tl.int64)
        if ACTIVATION == "relu2":
            h = apply_activation(acc, acc, alpha, limit, ACTIVATION)
            cols = offs_n
            n_out = N
        else:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
            h = apply_activation(gate, up, alpha, limit, ACTIVATION)
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            n_out = N // 2
        tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], round_to_dtype(h, out_ty),
                 mask=row_ok[:, None] & (cols < n_out)[None, :])


@dataclass
class Routing:
    """Where each GEMM block's rows come from: a dispatch (align.py) or direct mode."""
    topk_ids: torch.Tensor          # [T*k] flat, global ids
    topk_weights: torch.Tensor      # [T*k] flat float32
    top_k: int
    num_experts: int
    local_expert_offset: int
    sorted_pair_ids: Optional[torch.Tensor] = None   # None: direct mode
    block_expert_ids: Optional[torch.Tensor] = None
    align_block_m: int = 16

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()

    @property
    def direct(self) -> bool:
        return self.sorted_pair_ids is None

    @property
    def num_slots(self) -> int:
        """Rows of the intermediate: one per dispatch slot, or one per pair in direct mode."""
        return self.num_pairs if self.direct else self.sorted_pair_ids.numel()


def _launch(a, a_scale, w, w_scale, bias, out, routing: Routing, config: GemmConfig, *,
            n: int, k: int, gemm: int, quant: str, activation: str, alpha: float, limit: float,
            atomic_out: bool, interpret_upcast: bool):
    if routing.direct:
        num_m_blocks = routing.num_pairs
    else:
        if routing.align_block_m % config.block_m:
            raise ValueError(f"block_m={config.block_m} must divide the dispatch block_m="
                             f"{routing.align_block_m}")
        num_m_blocks = routing.sorted_pair_ids.numel() // config.block_m
    if quant == "fp8_block" and FP8_BLOCK % config.block_k:
        # the one config error that would not fail to compile but give wrong sums
        raise ValueError(f"fp8_block needs block_k dividing {FP8_BLOCK}, got {config.block_k}")
    grid = (num_m_blocks * cdiv(n, config.block_n),)
    if quant == "fp8_block":
        stride_asm, stride_wse, stride_wsn = a_scale.stride(0), w_scale.stride(0), w_scale.stride(1)
    elif quant == "fp8":
        stride_asm, stride_wse, stride_wsn = 1, w_scale.stride(0), 1
    else:
        stride_asm = stride_wse = stride_wsn = 0
    operands_fp32 = interpret_upcast or (quant == "none" and a.dtype == torch.float32)
    dummy = routing.topk_weights
    _grouped_gemm_kernel[grid](
        a, a_scale if a_scale is not None else dummy, w,
        w_scale if w_scale is not None else dummy,
        bias if bias is not None else dummy, out,
        routing.sorted_pair_ids if not routing.direct else routing.topk_ids,
        routing.block_expert_ids if not routing.direct else routing.topk_ids,
        routing.topk_ids, routing.topk_weights,
        n, k, routing.num_pairs, routing.top_k, routing.num_experts,
        routing.local_expert_offset, num_m_blocks,
        a.stride(0), stride_asm,
        w.stride(0), w.stride(1),
        stride_wse, stride_wsn,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        alpha, limit,
        ALIGN_BLOCK_M=routing.align_block_m, DIRECT=routing.direct, GATHER_A=gemm == 1,
        ATOMIC_OUT=atomic_out, QUANT=quant, ACTIVATION=activation if gemm == 1 else "none",
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=gemm == 2,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, SWAP_AB=config.swap_ab,
        UPCAST=interpret_upcast, DOT_PRECISION="ieee" if operands_fp32 else "tf32",
        EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def gemm1(a, a_scale, w13, w13_scale, b13, intermediate, routing: Routing, config: GemmConfig,
          *, quant: str, activation: str, alpha: float, limit: float,
          interpret_upcast: bool = False) -> None:
    """intermediate[slot] = act(x[token] @ w13[e]^T (scaled) + b13[e]) for every routed pair."""
    _launch(a, a_scale, w13, w13_scale, b13, intermediate, routing, config,
            n=w13.shape[1], k=w13.shape[2], gemm=1, quant=quant, activation=activation,
            alpha=alpha, limit=limit, atomic_out=False, interpret_upcast=interpret_upcast)


def gemm2(a, a_scale, w2, w2_scale, b2, out, routing: Routing, config: GemmConfig, *,
          quant: str, atomic_out: bool, interpret_upcast: bool = False) -> None:
    """out[pair] (or += into out[token]) = w * (intermediate[slot] @ w2[e]^T (scaled) + b2[e])."""
    _launch(a, a_scale, w2, w2_scale, b2, out, routing, config,
            n=w2.shape[1], k=w2.shape[2], gemm=2, quant=quant, activation="none",
            alpha=0.0, limit=0.0, atomic_out=atomic_out, interpret_upcast=interpret_upcast)


@triton.jit
def _combine_pair_rows_kernel(
    pair_out_ptr, topk_ids_ptr, out_ptr,
    H, top_k, num_experts, local_expert_offset,
    stride_pm, stride_om,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.arange(0, TOP_K)
    pairs = token * top_k + slot
    ids = tl.load(topk_ids_ptr + pairs, mask=slot < top_k, other=-1)
    local = ids - local_expert_offset
    # Rows of pairs with no local expert were never written: they must not be read.
    valid = (slot < top_k) & (local >= 0) & (local < num_experts)
    h_ok = offs_h < H
    rows = tl.load(pair_out_ptr + pairs[:, None] * stride_pm + offs_h[None, :],
                   mask=valid[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_h,
             round_to_dtype(tl.sum(rows, 0), out_ptr.dtype.element_ty), mask=h_ok)


def combine_pair_rows(pair_out: torch.Tensor, routing: Routing, out: torch.Tensor) -> None:
    """out[t] = sum over valid slots j of pair_out[t*k + j] (already routing-weighted), fp32."""
    T, H = out.shape
    top_k_p2 = next_power_of_2(routing.top_k)
    block_h = max(16, min(next_power_of_2(H), 4096 // top_k_p2, 1024))
    _combine_pair_rows_kernel[(T, cdiv(H, block_h))](
        pair_out, routing.topk_ids, out,
        H, routing.top_k, routing.num_experts, routing.local_expert_offset,
        pair_out.stride(0), out.stride(0),
        TOP_K=top_k_p2, BLOCK_H=block_h, num_warps=4,
    )
