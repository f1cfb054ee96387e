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
       written as one row per pair (combine="rows", then combine.py's `combine_pair_rows` sums
       the k rows of a token in a fixed order: deterministic) or added atomically into an fp32
       [T, H] output (combine="atomic": no [T*k, H] buffer, but the summation order varies run
       to run).

The intermediate is indexed by the pair's slot in the dispatch (its sorted position), so GEMM2
reads it contiguously; padding slots are never written and always masked.

Quantization (tl.constexpr QUANT): "none" (x.dtype operands), "fp8" (e4m3 operands, one scale
per token row and one per weight row, applied in the epilogue), "fp8_block" (one scale per
token per 128 columns of K and per 128x128 weight block, applied inside the K loop, so
block_k must divide 128). Both fp8 modes add each BLOCK_K partial product into the fp32
accumulator: Hopper's fp8 MMA does not accumulate in full fp32.
"nvfp4" / "mxfp4" are W4A16: the weight is streamed packed (two e2m1 codes a byte) in the kernel
order of quant.py (rows zero-padded to a multiple of 256 columns; each thread group's bytes of
a K step in one run, the codes of a byte the pair the MMA's register fragment wants), with its
block scales ([N, Kp/16] e4m3 / [N, Kp/32] e8m0), and dequantized in registers to the
activations' dtype (bf16/fp16) for an ordinary tensor-core dot with fp32 accumulation (see
`_dequant_fp4_tile`). The layout's per-row scale (nvfp4's global scale, one per expert
expanded per row; mxfp4's fold of each row's block exponents, quant.mxfp4_fold_scales)
multiplies the accumulator's columns in the epilogue: one multiply per output instead of one
per weight element.

Two kernels run these tiles. `_grouped_gemm_kernel` (one program per output tile, loads by
pointer, so GEMM1 gathers its token rows inside the loads) serves every mode and size.
`_grouped_gemm_persistent_kernel` (GemmConfig.persistent; quant none / fp8 / fp8_block, sm_90+)
runs one program per SM (two for 4-warp configs) over the tiles with both operands read
through TMA descriptors: its activation rows must be in dispatch order (GEMM1's are copied
there first by `align.gather_rows`), and its GEMM2 writes one row per pair (then
`combine_pair_rows`), never the fp32 atomics, whose conversion through shared memory does not
fit beside its pipeline. With decode's row tiles
(block_m < 64) it runs up to PERSISTENT_DECODE_PROGRAMS programs an SM, optionally swap-AB, and
GEMM1 reads its token rows by pointer instead (no gather launch).

Config: every launch takes a `GemmConfig` (tiles, warps, stages, swap-AB, split-K, persistent).
`config_space`, `config_problems` and `default_config` describe the choices for a
`GemmProblem`; GEMM1 and GEMM2 are separate problems with separate configs. Split-K (GEMM2 with
the atomic output only) splits the reduction over several programs per output tile, for decode
steps whose tiles are fewer than the SMs.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch
import triton
import triton.language as tl

from moe_ops.kernels.common import (
    FP8_BLOCK, apply_activation, capability_at_least, cdiv, device_properties, next_power_of_2,
    pdl_launch_options, pdl_prologue, round_to_dtype, use_pdl,
)
from moe_ops.kernels import INTERPRET
from moe_ops.kernels.align import gather_rows
from moe_ops.kernels.env import env_int
from moe_ops.kernels.fp4_decode import (  # noqa: F401  (the 4-bit decode's names, re-exported)
    MXFP4_FAST_BIAS, NVFP4_FAST_EPILOGUE, _E2M1_BF16_ASM, _E2M1_BF16_ASM_HEAD,
    _E4M3_TO_BF16_P117, _dequant_fp4_tile, _dequant_fp4_tile_bf16_asm,
)
from moe_ops.quant import FP4_K_ALIGN, fp4_scale_block

FP4_QUANTS = ("nvfp4", "mxfp4")
# Quant modes the persistent TMA kernel computes (GemmConfig.persistent).
PERSISTENT_QUANTS = ("none", "fp8", "fp8_block")
# Decode tiles on the persistent kernel (block_m < 64): at most this many programs an SM
# (persistent_programs_per_sm), fewer where their pipelines do not fit side by side.
PERSISTENT_DECODE_PROGRAMS = env_int("MOE_OPS_PERSISTENT_DECODE_PROGRAMS", 4) or 1
# fp8 (per-tensor weights): columns of K accumulated by the MMA between two promotions of the
# partial sum into fp32 (see the kernel's K loop). Hopper's fp8 MMA accumulates with too few
# bits, so the error grows with this length. Measured on one H200 (benchmarks/dev_fp8_promote.py,
# results/h200_fp8_promote.json), whole layer against the reference at T=4096, Mixtral / Qwen3:
# 128 -> 5.0e-3 / 4.8e-3, 256 -> 5.9e-3 / 5.9e-3, 512 -> 7.3e-3 / 7.4e-3, 1024 -> 9.3e-3 /
# 9.5e-3 (SPEC bound 1e-2); Mixtral T=16384 at 128x128x128: 757 -> 818 -> 868 -> 877 TFLOP/s.
# 512 then failed the bound on a small layer (gpu_check --sanitize, fp8 H=512 with -1 padding
# at T=16: 1.11e-2, against 4.8e-3 promoting every step): 256 keeps the margin.
FP8_PROMOTE_K = 256
# bf16 4-bit weights decode with inline PTX on the GPU (_dequant_fp4_tile_bf16_asm); False
# forces the portable bit arithmetic everywhere (the interpreter and fp16 always use it).
FP4_FAST_DEQUANT = True
# 4-bit launches without split-K pass their K-step count as a compile-time constant
# (NUM_K_STEPS; K is fixed per layer, so this costs no extra builds in practice). With a
# run-time count, the software pipeliner lays out the loop's zero-trip path before the last
# wgmma wait, and ptxas serializes every wgmma of the 4-bit builds (advisory C7515 in
# `benchmarks/aot_sm90.py`): the register-operand MMAs then wait for each other. A known trip
# count >= 1 removes that path. False keeps the run-time count (for A/B measurements).
FP4_STATIC_K_STEPS = True

# Shared memory per block on sm_90 (227 KiB opt-in), less a margin for the epilogue's
# layout conversions (the gate/up split goes through shared memory).
_SMEM_HW_BYTES = 227 * 1024
_SMEM_LIMIT_BYTES = _SMEM_HW_BYTES - 16 * 1024


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
    # GEMM2 only: split the reduction over this many programs per output tile, which add their
    # partial products atomically into the fp32 output (decode: a long K streamed by few
    # programs, e.g. Mixtral's down projection, 128 tiles of K = 14336 on 132 SMs).
    split_k: int = 1
    # The persistent TMA kernel (_grouped_gemm_persistent_kernel; quant none / fp8 / fp8_block,
    # sm_90+). At prefill GEMM1's token rows are then gathered into dispatch order first
    # (gather_rows; decode's row tiles, block_m < 64, read them by pointer instead); GEMM2 then
    # writes one row per pair and the combine pass sums them (no fp32 atomics).
    persistent: bool = False


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
        """Bytes of one activation element as the K loop loads it (fp8 modes quantize them;
        the 4-bit modes are W4A16: activations as they are)."""
        return 1 if self.quant in ("fp8", "fp8_block") else self.dtype.itemsize

    @property
    def fp4(self) -> bool:
        return self.quant in FP4_QUANTS


def pipeline_smem_bytes(config: GemmConfig, operand_bytes: int) -> int:
    """Shared memory of a 16-bit / fp8 K loop's pipeline: num_stages activation and weight
    tiles."""
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * operand_bytes


def config_problems(problem: GemmProblem, config: GemmConfig) -> List[str]:
    """Why a config cannot run this problem (empty list: valid)."""
    why = []
    if config.split_k < 1 or config.split_k & (config.split_k - 1):
        why.append(f"split_k={config.split_k}: a power of two >= 1")
    elif config.split_k > 1 and problem.gemm != 2:
        why.append("split_k > 1 only for GEMM2 (GEMM1's activation needs the whole reduction)")
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            why.append(f"{name}={value}: must be a power of two >= 16 (tl.dot minimum, tl.arange)")
    if problem.quant in ("fp8", "fp8_block") and config.block_k < 32:
        why.append("fp8 dots need block_k >= 32 (the e4m3 MMA's K)")
    if problem.fp4:
        group = fp4_scale_block(problem.quant)
        if config.block_k < max(32, group):
            # A K step holds whole scale groups (one scale load per row and group), and the
            # packed tile is [block_n, block_k / 2] bytes: 16 bytes a row at least.
            why.append(f"{problem.quant} needs block_k >= {max(32, group)} (whole {group}-wide "
                       "scale groups, 16 packed bytes a row)")
        if problem.k % group:
            why.append(f"{problem.quant}: K={problem.k} must be a multiple of its scale group {group}")
        if config.block_k > FP4_K_ALIGN:
            why.append(f"{problem.quant}: block_k <= {FP4_K_ALIGN} (the rows' padding: whole "
                       "K steps read unmasked)")
        if not config.swap_ab:
            # The dequantized tile must be the MMA's register operand: staged through shared
            # memory instead, Triton 3.6 aborts compiling it for sm_90 ("Illegal shared layout"
            # in TritonGPUOptimizeDotOperands). The interpreter runs that path (tests do).
            why.append(f"{problem.quant} needs swap_ab=True (the decoded weight tile is the "
                       "MMA's register operand)")
    if config.persistent:
        if problem.quant not in PERSISTENT_QUANTS or problem.dtype not in (torch.bfloat16,
                                                                          torch.float16):
            why.append("persistent: quant none, fp8 or fp8_block with bf16/fp16 activations")
        if config.split_k > 1:
            why.append("persistent: no split_k")
        if config.swap_ab and config.block_m >= 64:
            why.append("persistent: swap_ab only for decode's row tiles (block_m < 64)")
        if (problem.k * problem.operand_bytes) % 16:
            why.append("persistent: rows of K elements must be whole 16-byte units (TMA)")
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
    if problem.fp4:
        # Per stage: the activation tile, the packed weight bytes and their scales; plus one
        # dequantized [block_n, block_k] weight tile, which the MMA reads from shared memory
        # unless swap-AB makes it the register operand.
        group = fp4_scale_block(problem.quant)
        per_stage = (config.block_m * config.block_k * problem.operand_bytes
                     + config.block_n * config.block_k // 2
                     + config.block_n * max(1, config.block_k // group))
        smem = config.num_stages * per_stage
        if not config.swap_ab:
            smem += config.block_n * config.block_k * problem.operand_bytes
    else:
        smem = pipeline_smem_bytes(config, problem.operand_bytes)
    if config.persistent:
        # The flattened tile loop keeps the pipeline's buffers live through the epilogue, so
        # the epilogue's layout conversion comes on top (sm_90 builds: 2 bytes a tile element
        # for the 16-bit rows it stores, 1 for a gated GEMM1's half-width tile; GEMM2's fp32
        # atomics, 4 bytes, are never used here); the limit is then the hardware's.
        per_element = 1 if problem.gemm == 1 and problem.gated else 2
        if config.swap_ab:
            per_element = 4  # the fp32 tile's transpose
        smem += config.block_m * config.block_n * per_element
        if smem > _SMEM_HW_BYTES:
            why.append(f"{smem} bytes of pipelined tiles and epilogue exceed the shared memory "
                       "of sm_90")
    elif smem > _SMEM_LIMIT_BYTES:
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
        if swap and bm > (256 if problem.fp4 else 64):
            # swap-AB only pays when the token side is narrow; with 4-bit weights it also
            # keeps the dequantized tile in registers as the MMA's A operand (no shared-memory
            # round trip), which can pay at wider row tiles too.
            continue
        config = GemmConfig(bm, bn, bk, gm, warps, stages, swap)
        if is_valid_config(problem, config):
            configs.append(config)
    return configs


# The short list the autotuner profiles (SPEC §6: all buckets of a model in seconds), per
# regime of m = expected rows per expert; each list holds the default's neighbours along the
# axes measured to matter there (benchmarks/NOTES.md): for decode the N width, the K step and the
# pipeline depth of the weight stream (swap-AB); in between, the row tile against the rows per
# expert; for prefill the output tile, warps, depth and L2 grouping. Entries invalid for a
# problem (shared memory, the quant mode's K rules) are dropped, the default is always first.
_DECODE_CANDIDATES = [  # (block_m, block_n, block_k, group_m, warps, stages, swap_ab)
    (16, 32, 128, 8, 4, 4, True), (16, 64, 128, 8, 4, 4, True), (16, 128, 128, 8, 4, 3, True),
    (16, 64, 256, 8, 4, 3, True), (16, 64, 256, 8, 4, 5, True), (16, 32, 256, 8, 4, 4, True),
    (16, 64, 128, 8, 4, 6, True), (16, 128, 64, 8, 4, 5, True), (32, 64, 128, 8, 4, 4, True),
]
# Decode's row tiles on the persistent kernel (last field; fp8 per tensor's GEMM1 unswapped,
# see tuning_candidates): an SM's weight stream runs on through its tiles. Against the shipped
# tables' tile-kernel pair on an H200 (benchmarks/sweep_configs.py --persistent, one routed
# batch, graph replays): Mixtral fp8 T = 64 424 -> 388 us (32-row tiles), T = 4 192 -> 179,
# Llama 4 fp8 T = 4 / 16 148 -> 139 / 300 -> 286, Qwen3 bf16 T = 4 / 16 81.4 -> 78.0 /
# 188 -> 184; Qwen3 fp8 and DeepSeek-V3 fp8_block within 0.3% (results/h200_sweep_persd*).
_DECODE_PERSISTENT_CANDIDATES = [
    (16, 64, 128, 8, 4, 4, True, 1, True), (16, 64, 128, 8, 4, 3, True, 1, True),
    (16, 64, 256, 8, 4, 3, True, 1, True), (16, 128, 128, 8, 4, 4, True, 1, True),
    (32, 128, 128, 8, 4, 4, True, 1, True), (32, 128, 256, 8, 4, 4, True, 1, True),
]
_MID_CANDIDATES = [
    (32, 64, 128, 8, 4, 4, True), (32, 128, 128, 8, 4, 3, False), (64, 64, 128, 8, 4, 3, False),
    (64, 128, 64, 8, 4, 4, False), (64, 128, 128, 8, 4, 3, False), (32, 64, 128, 8, 4, 4, False),
    (64, 256, 64, 8, 8, 3, False), (64, 128, 128, 16, 4, 4, False),
]
# From 48 rows per expert (e.g. Qwen3 at T=512-1024) the 128-row tiles of prefill, whose
# 8 warps share each weight tile between two warpgroups, come within reach: the mid list gains
# them there (the tile kernel's, and the persistent kernel's widest).
_MID_WIDE_CANDIDATES = [
    (128, 128, 64, 8, 8, 4, False), (128, 128, 128, 8, 8, 3, False),
    (128, 256, 64, 16, 8, 3, False, 1, True),
]
_MID_WIDE_ROWS = 48
# GEMM2 at decode: split the reduction when the tiles are fewer than the SMs (dropped for GEMM1
# by the validity rules).
_SPLIT_K_CANDIDATES = [
    (16, 64, 128, 8, 4, 4, True, 2), (16, 64, 128, 8, 4, 4, True, 4), (16, 64, 256, 8, 4, 4, True, 2),
]
# 4-bit weights decode fastest on the swap-AB path (the dequantized tile is the MMA's register
# operand): their mid and prefill lists are swap-AB throughout.
_FP4_MID_CANDIDATES = [
    (32, 64, 128, 8, 4, 4, True), (64, 64, 128, 8, 4, 3, True), (64, 128, 64, 8, 4, 4, True),
    (64, 128, 128, 8, 4, 3, True), (32, 128, 128, 8, 4, 3, True), (64, 64, 256, 8, 4, 3, True),
]
_FP4_MID_WIDE_CANDIDATES = [(128, 128, 128, 16, 8, 3, True), (128, 128, 64, 16, 8, 3, True)]
_FP4_LARGE_CANDIDATES = [
    (128, 128, 64, 16, 8, 3, True), (128, 64, 128, 16, 8, 3, True), (64, 256, 64, 8, 8, 3, True),
    (128, 128, 128, 16, 8, 3, True), (64, 128, 128, 8, 4, 3, True), (128, 256, 64, 16, 8, 3, True),
    (256, 128, 64, 16, 8, 3, True),
    # fewer decode instructions a flop (sm_90 builds, benchmarks/aot_sm90.py --loop: 7.2 a
    # weight value for 256 rows, 5.3 for 128; neither spills) at 2 stages
    (256, 128, 128, 16, 8, 2, True), (128, 256, 128, 16, 8, 2, True),
    (128, 128, 128, 16, 8, 4, True),
]
# Prefill, quant none / fp8 / fp8_block: the tile kernel's tiles, then the persistent TMA
# kernel's (last field): 128-row tiles at 8 warps for none / fp8; for fp8_block, whose per-step
# scaling keeps a second fp32 tile live, 64-row tiles at 4 warps (two programs an SM): its
# 128-row persistent builds spill on sm_90.
_LARGE_CANDIDATES = [
    (128, 256, 64, 16, 8, 3, False), (128, 128, 64, 8, 8, 4, False), (128, 256, 64, 8, 8, 4, False),
    (128, 128, 128, 16, 8, 3, False), (64, 256, 128, 8, 8, 3, False),
    (64, 128, 128, 8, 4, 3, False), (64, 128, 128, 16, 4, 4, False),
]
_PERSISTENT_CANDIDATES = [
    (128, 256, 64, 16, 8, 3, False, 1, True), (128, 128, 256, 8, 8, 3, False, 1, True),
    (128, 128, 128, 8, 8, 4, False, 1, True), (128, 128, 64, 8, 8, 5, False, 1, True),
    (128, 256, 64, 8, 8, 3, False, 1, True),
]
_FP8_BLOCK_PERSISTENT_CANDIDATES = [
    (64, 128, 128, 8, 4, 4, False, 1, True), (64, 128, 128, 16, 4, 3, False, 1, True),
]


def tuning_candidates(problem: GemmProblem) -> List[GemmConfig]:
    """The configs the autotuner profiles for a problem: the default first, then the regime's
    short list (valid ones only, no duplicates). config_space is the full space."""
    m = problem.tokens_per_expert
    fp4 = problem.quant in FP4_QUANTS
    if m <= 16:
        table = _DECODE_CANDIDATES + _SPLIT_K_CANDIDATES + _DECODE_PERSISTENT_CANDIDATES
    elif m < 128 or (m == 128 and problem.quant != "fp8_block"):
        # (fp8_block's persistent default starts at 128 rows: its neighbours come with it)
        table = _FP4_MID_CANDIDATES if fp4 else _MID_CANDIDATES
        if not fp4 and m < 64:
            table = table + [e for e in _DECODE_PERSISTENT_CANDIDATES if e[0] == 32]
        if m >= _MID_WIDE_ROWS and problem.quant != "fp8_block":
            table = table + (_FP4_MID_WIDE_CANDIDATES if fp4 else _MID_WIDE_CANDIDATES)
    else:
        persistent = (_FP8_BLOCK_PERSISTENT_CANDIDATES if problem.quant == "fp8_block"
                      else _PERSISTENT_CANDIDATES)
        table = (_FP4_LARGE_CANDIDATES if fp4
                 else _LARGE_CANDIDATES + persistent + _MID_CANDIDATES[3:5])
    configs = [default_config(problem)]
    for entry in table:
        config = GemmConfig(*entry)
        if problem.quant == "fp8" and config.swap_ab and not fp8_swap_ok(problem.gemm):
            config = dataclasses.replace(config, swap_ab=False)  # see default_config's decode
        if config not in configs and is_valid_config(problem, config):
            configs.append(config)
    return configs


# Reduction length from which decode tiles stream deeper (see default_config).
LONG_K_DECODE = 8192


def _default_fp4_config(problem: GemmProblem) -> GemmConfig:
    """nvfp4/mxfp4 (W4A16). Swap-AB everywhere: the decoded weight tile is then the MMA's
    register operand (no shared-memory round trip, and the inline-PTX decode applies, see
    use_fast_fp4). A K step of 4-bit weights is half the bytes of bf16's, so decode streams
    256-wide K steps (128 bytes a row, as bf16's 64)."""
    m = problem.tokens_per_expert
    if m <= 16:
        # 64x256 tiles at 3 stages streamed a DeepSeek decode step fastest of 24 configs
        # (benchmarks/dev_fp4_layout.py, results/h200_fp4_layout.json)
        config = GemmConfig(16, 64, 256, 8, 4, 3, swap_ab=True)
    elif m <= 128:
        config = GemmConfig(64, 128, 128, 8, 4, 3, swap_ab=True)
    else:
        # Prefill: the decode cost is shared by the tile's rows, so 128-row tiles at 8 warps
        # (two warpgroups of 64 weight rows each) and 128-wide K steps: both GEMMs at 128x128x128
        # ran the experts call at 314 (DeepSeek-V3 nvfp4) / 307 (gpt-oss mxfp4) TFLOP/s at
        # T=16384, against 240-247 for 256x128x64 and 170-185 for 128x256x64
        # (results/h200_fp4_dev.log); the tuner's default pair of then, 128x128x64, was 1.57x
        # slower than its pick at bucket 8192 (results/h200_tune_deepseek_v3_nvfp4.json).
        config = GemmConfig(128, 128, 128, 16, 8, 3, swap_ab=True)
    if not is_valid_config(problem, config):
        config = GemmConfig(config.block_m, min(config.block_n, 128), 64, config.group_m,
                            config.num_warps, 2, config.swap_ab)
    return config


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
    if problem.fp4:
        return _default_fp4_config(problem)
    fp8 = problem.quant != "none"
    fp32 = problem.dtype == torch.float32 and not fp8
    wide_k = 64 if fp32 else 128
    if m <= 16:
        # Decode: a stream of the hit experts' weights; narrow N tiles give enough programs to
        # keep every SM's loads in flight, deep pipelining hides the latency. Swap-AB puts the
        # weight tile on the MMA's 64-row side (wgmma instead of mma.sync at 16 rows).
        # fp8 (per tensor) unswapped: GEMM1 swapped passed the 1e-2 bound (its output's
        # requantization amplifies the fp8 wgmma's small accumulation error, see
        # experts.FP8_SWAP_AB); GEMM2 may swap, which the tuner's candidates offer.
        swap = problem.quant != "fp8"
        config = GemmConfig(16, 64, wide_k, 8, 4, 4, swap_ab=swap)
        if problem.quant == "fp8" and problem.k >= LONG_K_DECODE:
            # A long reduction streamed by few programs (Mixtral's down projection: K = 14336,
            # 64 N-tiles an expert) needs more bytes in flight per program: 256-wide K steps,
            # 5 deep. Mixtral fp8 T=1 on the H200, the experts call: 112 -> 100 us
            # (benchmarks/results/h200_sweep_configs.json). fp8_block keeps K steps within
            # one 128-wide scale block.
            config = GemmConfig(16, 64, 256, 8, 4, 5, swap_ab=swap)
    elif problem.quant == "fp8" and m >= 512:
        # with promotions every 512 columns: Mixtral T=16384 868 TFLOP/s against 737 at
        # 64x128x128 (Qwen3 at m=256 kept 64x128x128: 441 against 381); every 256 (now):
        # 818 at 128x128x128. The persistent TMA kernel, 256-wide K steps (one promotion
        # each, inside the dot): 984 / 997 TFLOP/s for Mixtral's GEMM1 / GEMM2 at T=16384 on
        # sorted rows, against 828 / 878 for the tile kernel (results/h200_prefill_ws.json).
        config = GemmConfig(128, 128, 256, 8, 8, 3, persistent=True)
    elif problem.quant == "fp8_block" and m >= 128:
        # The persistent TMA kernel with both scale sets inside its K loop, 64-row tiles (as
        # above: 128-row builds spill), two programs an SM: DeepSeek-V3's whole experts call,
        # both GEMMs on it, 523 -> 591 TFLOP/s at T=16384 and 427 -> 473 at T=4096 against the
        # tile kernel's 64x128x128 (results/h200_fp8_block_persistent.json).
        config = GemmConfig(64, 128, 128, 16, 4, 3, persistent=True)
    elif fp8:
        config = GemmConfig(64, 128, 128, 8, 4, 3)
    elif m <= 128:
        config = GemmConfig(64, 128, 64, 8, 4, 4)
    elif fp32:
        config = GemmConfig(128, 128, 32, 8, 8, 3)
    else:
        # The persistent TMA kernel: 678 / 693 TFLOP/s for GEMM1 / GEMM2 alone (sorted rows,
        # as above) against 566 / 587 for the tile kernel; the whole experts call (gather, both
        # GEMMs, combine) with the tuned tables of kernel hash 16a23bbda81f0be3 (their GEMM1 at
        # group_m 8) 657 at Mixtral T=16384 (results/h200_pdl_shipped_ab.json).
        config = GemmConfig(128, 256, 64, 16, 8, 3, persistent=True)
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
def _tile_coords(tile, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Output tile number -> (row block, column block) in grouped order: GROUP_M consecutive row
    blocks walk the N tiles together, so a weight tile read from HBM is reused from L2 by the
    other row blocks of the same expert."""
    blocks_per_group = GROUP_M * num_n_blocks
    first_m = (tile // blocks_per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (tile % blocks_per_group) % group_size
    pid_n = (tile % blocks_per_group) // group_size
    return pid_m, pid_n


def fp8_swap_ok(gemm: int) -> bool:
    """Whether an fp8 (per tensor) swap-AB config of GEMM `gemm` runs swapped: GEMM2 only (on
    both kernels).
    GEMM1's requantized output amplifies the swapped e4m3 wgmma's ~1e-4 error past SPEC's bound
    (experts.FP8_SWAP_AB)."""
    return gemm == 2


def fp8_dot_options(quant: str, config: "GemmConfig") -> dict:
    """The fp8 K loop's constexpr of a launch (both kernels): PROMOTE_STEPS, K steps between
    promotions of the partial sum (1 where the dot needs none)."""
    if quant != "fp8":
        return dict(PROMOTE_STEPS=1)
    return dict(PROMOTE_STEPS=max(1, FP8_PROMOTE_K // config.block_k))


@triton.jit
def _fp8_dot(x, y, acc, part, step, PROMOTE_STEPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc (+ part) += x @ y for e4m3 operands, with the partial sum promoted into the fp32
    accumulator: Hopper's fp8 MMA keeps only about 14 bits while it accumulates (measured here:
    1.2e-2 relative error at K=2048 with Triton's sm_90 default of never promoting).
    PROMOTE_STEPS == 1: every K step, inside the dot (each step then waits for its MMAs; `part`
    is unused and returned as it came); > 1: the MMAs chain asynchronously through `part` for
    that many steps (step counts from 0), then one promotion. Returns (acc, part)."""
    if PROMOTE_STEPS == 1:
        acc = tl.dot(x, y, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        part = tl.dot(x, y, part)
        if step % PROMOTE_STEPS == PROMOTE_STEPS - 1:
            acc += part
            part = tl.zeros_like(part)
    return acc, part


@triton.jit
def _epilogue(acc, expert, pair_ids, row_ok, slots, a_rows, offs_n, w_rows, pid_n, add_bias,
              a_scale_ptr, stride_asm, w_scale_ptr, stride_wse, stride_wsn,
              w_global_scale_ptr, stride_wge, bias_ptr, stride_be, topk_weights_ptr,
              out_ptr, stride_om, N, top_k, alpha, limit,
              QUANT: tl.constexpr, FAST_FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
              ACTIVATION: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ATOMIC_OUT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A finished [BLOCK_M, BLOCK_N] fp32 tile (rows: the block's slots, columns offs_n) ->
    scales, bias, then GEMM1: the activation, stored at intermediate[slot]; GEMM2: times the
    routing weight, stored at out[pair] or added into out[token] (ATOMIC_OUT). Shared by the
    tile kernel and the persistent one."""
    if QUANT == "fp8":
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)
        w_s = tl.load(w_scale_ptr + expert * stride_wse + w_rows * stride_wsn)
        acc = acc * a_s[:, None] * w_s[None, :]
    if QUANT == "nvfp4" or QUANT == "mxfp4":
        global_scale = tl.load(w_global_scale_ptr + expert * stride_wge + w_rows)
        if FAST_FP4 and QUANT == "nvfp4":
            global_scale = global_scale * 512.0  # NVFP4_FAST_EPILOGUE
        acc = acc * global_scale[None, :]
    if HAS_BIAS:
        if add_bias:  # with split-K, the bias is added once
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


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    w_global_scale_ptr,             # fp4: float32 [E, N], the layout's scale per weight row
    sorted_pair_ids_ptr, block_expert_ids_ptr, topk_ids_ptr, topk_weights_ptr,
    N, K, num_pairs, top_k, num_experts, local_expert_offset, num_m_blocks,
    stride_am, stride_asm,
    stride_we, stride_wn, stride_wt,  # stride_wt: fp4 only, bytes between thread-group runs
    stride_wse, stride_wsn,
    stride_be, stride_om, stride_wge,
    alpha, limit,
    ALIGN_BLOCK_M: tl.constexpr,    # block_m of the dispatch (a multiple of BLOCK_M)
    DIRECT: tl.constexpr,           # one pair per block, read from topk_ids (no dispatch)
    GATHER_A: tl.constexpr,         # A row = pair // top_k (GEMM1) instead of the slot (GEMM2)
    ATOMIC_OUT: tl.constexpr,       # GEMM2: add into out[token] instead of storing out[pair]
    QUANT: tl.constexpr,            # "none" | "fp8" | "fp8_block" | "nvfp4" | "mxfp4"
    ACTIVATION: tl.constexpr,       # GEMM1: "swiglu" | "geglu" | "swiglu_oai" | "relu2"; GEMM2: "none"
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
    UPCAST: tl.constexpr,           # interpreter only: its 16-bit tl.dot is wrong, use fp32
    DOT_PRECISION: tl.constexpr,    # "ieee" for fp32 operands: no silent TF32
    EVEN_K: tl.constexpr,
    FAST_FP4: tl.constexpr = False,  # GPU, bf16: decode e2m1 with inline PTX (not interpretable)
    SPLIT_K: tl.constexpr = 1,      # programs sharing one output tile's reduction (ATOMIC_OUT)
    PROMOTE_STEPS: tl.constexpr = 1,  # fp8: K steps between promotions of the partial sum
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (common.pdl_prologue)
    NUM_K_STEPS: tl.constexpr = 0,  # > 0: cdiv(K, BLOCK_K) known at compile time (static_k_steps)
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if SPLIT_K > 1:
        # neighbouring programs take neighbouring K chunks of the same tile
        split = pid % SPLIT_K
        pid = pid // SPLIT_K
    else:
        split = 0
    pid_m, pid_n = _tile_coords(pid, num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)

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
    FP4: tl.constexpr = QUANT == "nvfp4" or QUANT == "mxfp4"
    if SWAP_AB:
        a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None]       # [BK, BM]
        w_ptrs = w_expert_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]       # [BM, BK]
        w_ptrs = w_expert_ptr + w_rows[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP4:
        # Kernel-order packed rows (quant.py): 4 runs of Kp/8 bytes, K zero-padded to a
        # multiple of 256, so a K step is one run of BK/8 bytes per thread group t, read
        # unmasked, and its [BN, BK/G] scales (rows padded the same way).
        SCALE_GROUP: tl.constexpr = 16 if QUANT == "nvfp4" else 32
        offs_g = tl.arange(0, BLOCK_K // SCALE_GROUP)
        runs = tl.arange(0, 4)[:, None] * stride_wt + tl.arange(0, BLOCK_K // 8)[None, :]
        w_ptrs = w_expert_ptr + w_rows[:, None, None] * stride_wn + runs[None, :, :]  # [BN, 4, BK/8]
        w_scale_ptrs = (w_scale_ptr + expert * stride_wse + w_rows[:, None] * stride_wsn
                        + offs_g[None, :])                                      # [BN, BK/G]

    if QUANT == "fp8_block":
        if ACTIVATION == "none" or ACTIVATION == "relu2":
            scale_rows = w_rows // 128
        else:
            # gated: w13 row r is (gate|up)[r // 2], block scales interleave the same way
            scale_rows = 2 * ((w_rows // 2) // 128) + w_rows % 2
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + scale_rows * stride_wsn
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm

    if NUM_K_STEPS > 0:
        num_k_steps = NUM_K_STEPS
    else:
        num_k_steps = tl.cdiv(K, BLOCK_K)
    kb_start = 0
    kb_end = num_k_steps
    if SPLIT_K > 1:
        steps_per_split = tl.cdiv(num_k_steps, SPLIT_K)
        kb_start = split * steps_per_split
        kb_end = tl.minimum(kb_start + steps_per_split, num_k_steps)
        a_ptrs += kb_start * BLOCK_K
        if FP4:
            w_ptrs += kb_start * (BLOCK_K // 8)
            w_scale_ptrs += kb_start * (BLOCK_K // SCALE_GROUP)
        else:
            w_ptrs += kb_start * BLOCK_K
    if QUANT == "fp8" and PROMOTE_STEPS > 1:
        part = tl.zeros_like(acc)
    else:
        part = acc  # unused (see _fp8_dot)
    for kb in range(kb_start, kb_end):
        k_left = K - kb * BLOCK_K
        if FP4:
            if SWAP_AB:
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
            else:
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            # Padded rows: the weight and its scales never need a mask (the activations
            # past K are masked to zero above; the padding decodes to zero).
            packed = tl.load(w_ptrs)
            w_s = tl.load(w_scale_ptrs)
            if FAST_FP4:
                w = _dequant_fp4_tile_bf16_asm(packed, w_s, QUANT, BLOCK_N, BLOCK_K)
            else:
                w = _dequant_fp4_tile(packed, w_s, QUANT, BLOCK_N, BLOCK_K, a_ptr.dtype.element_ty)
            if not SWAP_AB:
                w = tl.trans(w)                                                 # [BK, BN]
        elif SWAP_AB:
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
            if SWAP_AB:
                acc, part = _fp8_dot(w, a, acc, part, kb - kb_start, PROMOTE_STEPS, BLOCK_K)
            else:
                acc, part = _fp8_dot(a, w, acc, part, kb - kb_start, PROMOTE_STEPS, BLOCK_K)
        else:
            if SWAP_AB:
                acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if FP4:
            w_ptrs += BLOCK_K // 8
            w_scale_ptrs += BLOCK_K // SCALE_GROUP
        else:
            w_ptrs += BLOCK_K

    if QUANT == "fp8" and PROMOTE_STEPS > 1:
        acc += part
    if SWAP_AB:
        acc = tl.trans(acc)

    _epilogue(acc, expert, pair_ids, row_ok, slots, a_rows, offs_n, w_rows, pid_n, split == 0,
              a_scale_ptr, stride_asm, w_scale_ptr, stride_wse, stride_wsn,
              w_global_scale_ptr, stride_wge, bias_ptr, stride_be, topk_weights_ptr,
              out_ptr, stride_om, N, top_k, alpha, limit,
              QUANT, FAST_FP4, HAS_BIAS, ACTIVATION, MUL_ROUTED_WEIGHT, ATOMIC_OUT,
              BLOCK_M, BLOCK_N)


@triton.jit
def _grouped_gemm_persistent_kernel(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, bias_ptr, out_ptr,
    sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr, topk_weights_ptr,
    N, num_pairs, top_k, num_k_steps,
    stride_asm, stride_wse, stride_wsn, stride_be, stride_om,
    alpha, limit,
    K, stride_am,                   # GATHER_A only: the token rows' length and stride
    ALIGN_BLOCK_M: tl.constexpr,
    QUANT: tl.constexpr,            # "none" | "fp8" | "fp8_block"
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,     # programs (persistent_programs_per_sm); tiles pid, pid + P, ...
    UPCAST: tl.constexpr,
    PROMOTE_STEPS: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,  # w @ a^T: the weight tile on the MMA's M side (decode)
    GATHER_A: tl.constexpr = False,  # GEMM1 decode: a_desc is x itself, rows read by pointer
):
    """Persistent form of _grouped_gemm_kernel (GemmConfig.persistent): NUM_PROGRAMS programs
    (at prefill one per SM, two for 4-warp configs) walk the output tiles in grouped order, both
    operands through TMA descriptors, the tile loop flattened into the K loop so the next tile's
    first loads are in flight during an epilogue.

    The activation rows are in dispatch order already (a_desc over [slots, K]: GEMM2's
    intermediate, or GEMM1's x gathered by gather_rows): TMA cannot gather rows (GATHER_A, the
    decode form below, reads GEMM1's rows by pointer instead). GEMM2 stores
    one row per pair (combine="rows"): the fp32 atomics' layout conversion needs 4 bytes of
    shared memory a tile element, which the deep pipelines here leave no room for. w_desc covers
    the weights as [E * N, K]; a tile straddling an expert's last row reads the next expert's
    (or TMA's zero fill), columns never stored. Only the live row blocks are walked (their
    count, num_padded, is on the device); padding rows are masked at the store as in the tile
    kernel. Measured on one H200 (benchmarks/dev_prefill_ws.py, Mixtral T=16384, activations
    in sorted order): 1.13-1.26x the tile kernel's TFLOP/s, bf16 and fp8.

    Decode form (block_m < 64): the same walk over 16- or 32-slot row blocks, so that an SM's
    weight stream runs on through its tiles instead of filling and draining a pipeline per
    tile; with SWAP_AB the weight tile is the MMA's M side (wgmma for 16-bit and fp8_block
    operands); GATHER_A reads GEMM1's few token rows by pointer (pair // top_k), masked, beside
    the TMA weight loads, instead of a gather_rows launch.
    """
    pdl_prologue(USE_PDL)
    num_m_blocks = tl.load(num_padded_ptr) // BLOCK_M
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m_blocks * num_n_blocks, NUM_PROGRAMS,
                         flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        off_m = pid_m * BLOCK_M
        expert = tl.load(block_expert_ids_ptr + off_m // ALIGN_BLOCK_M).to(tl.int64)
        w_row = (expert * N + pid_n * BLOCK_N).to(tl.int32)
        slots = off_m + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = offs_n % N
        if GATHER_A:
            pair_ids = tl.load(sorted_pair_ids_ptr + slots)
            row_ok = pair_ids < num_pairs
            token_rows = pair_ids // top_k      # (padding slots: masked at every use)
            offs_k = tl.arange(0, BLOCK_K)
        if QUANT == "fp8_block":
            # As the tile kernel: one scale per token per 128 columns (gathered with the rows)
            # and per 128x128 weight block, gate/up rows interleaved when gated.
            if ACTIVATION == "none" or ACTIVATION == "relu2":
                scale_rows = w_rows // 128
            else:
                scale_rows = 2 * ((w_rows // 2) // 128) + w_rows % 2
            # 32-bit offsets (the scale tensors are small): 64-bit pointers per row and column
            # would be live through the K loop beside two fp32 tiles (sm_90 builds spilled).
            if GATHER_A:
                a_scale_rows = token_rows * stride_asm
            else:
                a_scale_rows = slots * stride_asm
            w_scale_rows = expert.to(tl.int32) * stride_wse + scale_rows * stride_wsn
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if QUANT == "fp8" and PROMOTE_STEPS > 1:
            part = tl.zeros_like(acc)
        else:
            part = acc  # unused (see _fp8_dot)
        for kb in range(0, num_k_steps):
            if GATHER_A:
                cols = kb * BLOCK_K + offs_k
                a = tl.load(a_desc + token_rows.to(tl.int64)[:, None] * stride_am
                            + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                            other=0.0)
            else:
                a = a_desc.load([off_m, kb * BLOCK_K])
            if SWAP_AB:
                # [BN, BK] @ [BK, BM]: the activation tile's transpose is K-major as fp8's
                # wgmma needs (the MMA reads shared memory transposed; nothing moves)
                x_op = w_desc.load([w_row, kb * BLOCK_K])
                y_op = a.T
            else:
                # [BN, BK], K contiguous: its transpose is the K-major B operand (fp8's wgmma
                # needs it; nothing moves, the MMA reads shared memory transposed)
                x_op = a
                y_op = w_desc.load([w_row, kb * BLOCK_K]).T
            if QUANT == "fp8_block":
                # each partial product scaled before it joins the fp32 accumulator (BLOCK_K
                # divides 128: one scale group per step)
                group = (kb * BLOCK_K) // 128
                if GATHER_A:
                    a_s = tl.load(a_scale_ptr + (a_scale_rows + group), mask=row_ok, other=0.0)
                else:
                    a_s = tl.load(a_scale_ptr + (a_scale_rows + group))
                w_s = tl.load(w_scale_ptr + (w_scale_rows + group))
                if UPCAST:
                    step = tl.dot(x_op.to(tl.float32), y_op.to(tl.float32),
                                  input_precision="ieee")
                else:
                    step = tl.dot(x_op, y_op)
                if SWAP_AB:
                    acc += step * w_s[:, None] * a_s[None, :]
                else:
                    acc += step * a_s[:, None] * w_s[None, :]
            elif UPCAST:
                acc = tl.dot(x_op.to(tl.float32), y_op.to(tl.float32), acc,
                             input_precision="ieee")
            elif QUANT == "fp8":
                acc, part = _fp8_dot(x_op, y_op, acc, part, kb, PROMOTE_STEPS, BLOCK_K)
            else:
                acc = tl.dot(x_op, y_op, acc)
        if QUANT == "fp8" and PROMOTE_STEPS > 1:
            acc += part
        if SWAP_AB:
            acc = tl.trans(acc)

        if GATHER_A:
            # (fp8: the per-token scales are x's, [T], read at the token rows)
            a_rows = token_rows.to(tl.int64)
        else:
            pair_ids = tl.load(sorted_pair_ids_ptr + slots)
            row_ok = pair_ids < num_pairs
            a_rows = slots.to(tl.int64)
        _epilogue(acc, expert, pair_ids, row_ok, slots, a_rows, offs_n, w_rows,
                  pid_n, True,
                  a_scale_ptr, 1, w_scale_ptr, stride_wse, 1,
                  w_scale_ptr, 0, bias_ptr, stride_be, topk_weights_ptr,
                  out_ptr, stride_om, N, top_k, alpha, limit,
                  QUANT, False, HAS_BIAS, ACTIVATION, MUL_ROUTED_WEIGHT, False,
                  BLOCK_M, BLOCK_N)


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
    num_padded: Optional[torch.Tensor] = None         # int32 [1]: live slots (dispatch)

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


# Compile-only mode (the autotuner's parallel precompilation): launches become Triton warmups,
# which compile (asynchronously inside triton's AsyncCompileMode) without running anything.
_COMPILE_ONLY = contextvars.ContextVar("moe_ops_grouped_gemm_compile_only", default=False)


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Inside: grouped-GEMM launches compile their kernel and return without running it (their
    outputs are left unwritten). Used to compile many candidate configs in parallel."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def _launcher(grid, kernel=_grouped_gemm_kernel):
    if _COMPILE_ONLY.get():
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D view [rows, K] of t can be a TMA descriptor: K contiguous, 16-byte aligned
    base and row stride."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.shape[-1] * size) % 16 == 0
            and (t.stride(-2) * size) % 16 == 0)


def use_persistent(config: GemmConfig, routing: "Routing", a: torch.Tensor,
                   w: torch.Tensor, atomic_out: bool = False) -> bool:
    """Whether a launch with `config` runs the persistent TMA kernel: the config asks for it,
    there is a dispatch (the kernel walks its slots), the output is rows (not GEMM2's fp32
    atomics, see the kernel), the operands are 16-bit or e4m3 alike, the GPU has TMA (sm_90+;
    the interpreter runs it too), and the operands are TMA-addressable (the weights as one
    [E * N, K] matrix). Otherwise the tile kernel runs the same tiles."""
    return (config.persistent and not routing.direct and not atomic_out
            and a.dtype == w.dtype  # not 4-bit weights (no decode in that kernel)
            and a.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
            and (INTERPRET or capability_at_least(a.device, (9, 0)))
            and _tma_ready(a) and w.is_contiguous() and _tma_ready(w))


def is_decode_persistent(config: GemmConfig) -> bool:
    """A persistent config of decode's row tiles (under a warpgroup's 64 MMA rows): GEMM1 then
    reads its few token rows by pointer (GATHER_A) instead of gathering them first."""
    return config.persistent and config.block_m < 64


# Programs an SM of a decode-tile persistent build, from its compiled registers and shared
# memory (_resident_programs), by launch signature; filled at a launch's first run on a GPU.
_RESIDENT_PROGRAMS: dict = {}


def _resident_programs(compiled, num_warps: int, device: torch.device) -> Optional[int]:
    """How many programs of a compiled build fit on one SM at once (registers, shared memory,
    threads), or None where the build does not say (the interpreter, an asynchronous
    compile)."""
    try:
        compiled.run  # loads the binary: its register count is known from then on
        regs, shared = compiled.n_regs, compiled.metadata.shared
    except Exception:  # (an interpreter or compile-only object)
        return None
    if not regs:
        return None
    props = device_properties(device)
    regs_per_warp = -(-regs * 32 // 256) * 256   # allocated a warp in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    # (the driver reserves 1 KB of shared memory a resident block)
    by_smem = props.shared_memory_per_multiprocessor // (shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads))


def persistent_programs_per_sm(config: GemmConfig, operand_bytes: int) -> int:
    """Programs a persistent launch runs on each SM. Prefill: a 4-warp config (one warpgroup a
    program, any quant mode; fp8_block's 64-row tiles are the ones tuned) runs two, so that one's
    MMAs overlap the other's loads and epilogue (fp8_block's fit: about 200 registers a thread
    and half the shared memory each in sm_90 builds); 8 warps one. Decode tiles: up to
    PERSISTENT_DECODE_PROGRAMS, as many as their pipelines fit in shared memory side by side
    and as their warps fit in an SM's 2048 threads (a program that cannot be resident would
    wait for another to finish all its tiles). An estimate before the build exists: the launch
    lowers it to what the compiled build's registers and shared memory allow
    (_resident_programs) from its first run on."""
    if not is_decode_persistent(config):
        return 2 if config.num_warps == 4 else 1
    # (the epilogue's conversion at its largest: the swapped fp32 tile's transpose)
    smem = pipeline_smem_bytes(config, operand_bytes) + config.block_m * config.block_n * 4
    by_threads = 2048 // (32 * config.num_warps)
    return max(1, min(PERSISTENT_DECODE_PROGRAMS, _SMEM_HW_BYTES // smem, by_threads))


def _programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (a few in the interpreter, which runs them
    one after the other anyway)."""
    if device.type != "cuda":
        return 4
    return device_properties(device).multi_processor_count


def _launch_persistent(a, a_scale, w, w_scale, bias, out, routing: "Routing",
                       config: GemmConfig, *, n: int, k: int, gemm: int, quant: str,
                       activation: str, alpha: float, limit: float,
                       interpret_upcast: bool, gather_a: bool = False):
    """a: activation rows in dispatch order (GEMM2's intermediate; GEMM1's gathered rows), or
    with gather_a GEMM1's x itself (read by pointer at the pairs' token rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if gather_a:
        a_desc = a
    else:
        a_desc = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1],
                                  [config.block_m, config.block_k])
    w_desc = TensorDescriptor(w, [w.shape[0] * n, k], [k, 1], [config.block_n, config.block_k])
    per_sm = persistent_programs_per_sm(config, a.element_size())
    resident_key = None
    if is_decode_persistent(config) and a.is_cuda and not INTERPRET:
        resident_key = (config, quant, activation, gemm, bias is not None, gather_a, a.dtype,
                        out.dtype, a.device.index)
        per_sm = min(per_sm, _RESIDENT_PROGRAMS.get(resident_key, per_sm))
    programs = _programs(a.device) * per_sm
    dummy = routing.topk_weights
    args = (
        a_desc, a_scale if a_scale is not None else dummy, w_desc,
        w_scale if w_scale is not None else dummy, bias if bias is not None else dummy, out,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        routing.topk_weights, n, routing.num_pairs, routing.top_k, cdiv(k, config.block_k),
        a_scale.stride(0) if quant == "fp8_block" else 1,
        w_scale.stride(0) if w_scale is not None else 0,
        w_scale.stride(1) if quant == "fp8_block" else 1,
        bias.stride(0) if bias is not None else 0, out.stride(0), alpha, limit,
        k, a.stride(0),
    )
    kwargs = dict(
        ALIGN_BLOCK_M=routing.align_block_m, QUANT=quant,
        ACTIVATION=activation if gemm == 1 else "none", HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=gemm == 2, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, NUM_PROGRAMS=programs,
        UPCAST=interpret_upcast,
        **fp8_dot_options(quant, config),
        USE_PDL=use_pdl(a.device), SWAP_AB=config.swap_ab, GATHER_A=gather_a,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch_options(a.device),
    )
    if resident_key is not None and resident_key not in _RESIDENT_PROGRAMS \
            and not _COMPILE_ONLY.get():
        # First run of this build: compile it (no launch) and lower the program count to what
        # fits on an SM at once; the build for that count is then the one launched.
        compiled = _grouped_gemm_persistent_kernel.warmup(*args, grid=(programs,), **kwargs)
        resident = _resident_programs(compiled, config.num_warps, a.device)
        _RESIDENT_PROGRAMS[resident_key] = min(per_sm, resident or per_sm)
        if _RESIDENT_PROGRAMS[resident_key] < per_sm:
            per_sm = _RESIDENT_PROGRAMS[resident_key]
            programs = _programs(a.device) * per_sm
            kwargs["NUM_PROGRAMS"] = programs
    _launcher((programs,), _grouped_gemm_persistent_kernel)(*args, **kwargs)


def use_fast_fp4(quant: str, dtype: torch.dtype, config: GemmConfig) -> bool:
    """Whether a launch decodes 4-bit weights with inline PTX (_dequant_fp4_tile_bf16_asm).

    Only with swap-AB: there the decoded tile is the MMA's register operand. Without it (valid
    in the interpreter only, see config_problems) the portable decode."""
    return (quant in FP4_QUANTS and FP4_FAST_DEQUANT and not INTERPRET
            and dtype == torch.bfloat16 and config.swap_ab)


def static_k_steps(quant: str, k: int, config: GemmConfig) -> int:
    """The kernel's NUM_K_STEPS: cdiv(k, block_k) for 4-bit launches without split-K (see
    FP4_STATIC_K_STEPS), else 0 (a run-time count)."""
    if FP4_STATIC_K_STEPS and quant in FP4_QUANTS and config.split_k == 1:
        return cdiv(k, config.block_k)
    return 0


def _launch(a, a_scale, w, w_scale, bias, out, routing: Routing, config: GemmConfig, *,
            n: int, k: int, gemm: int, quant: str, activation: str, alpha: float, limit: float,
            atomic_out: bool, interpret_upcast: bool, global_scale=None):
    if not routing.direct and routing.align_block_m % config.block_m:
        raise ValueError(f"block_m={config.block_m} must divide the dispatch block_m="
                         f"{routing.align_block_m}")
    if quant == "fp8_block" and FP8_BLOCK % config.block_k:
        # the one config error that would not fail to compile but give wrong sums
        raise ValueError(f"fp8_block needs block_k dividing {FP8_BLOCK}, got {config.block_k}")
    if config.persistent:
        if use_persistent(config, routing, a, w, atomic_out):
            gather_a = gemm == 1 and is_decode_persistent(config)
            if gemm == 1 and not gather_a:
                a, a_scale = gather_rows(a, a_scale, routing)
            _launch_persistent(a, a_scale, w, w_scale, bias, out, routing, config, n=n, k=k,
                               gemm=gemm, quant=quant, activation=activation, alpha=alpha,
                               limit=limit, interpret_upcast=interpret_upcast,
                               gather_a=gather_a)
            return
        config = dataclasses.replace(config, persistent=False)
    if routing.direct:
        num_m_blocks = routing.num_pairs
    else:
        num_m_blocks = routing.sorted_pair_ids.numel() // config.block_m
    if quant in FP4_QUANTS and (global_scale is None or global_scale.shape != w.shape[:2]):
        raise ValueError(f"global_scale: {quant} needs the layout's per-row scale "
                         f"{list(w.shape[:2])}, got "
                         f"{None if global_scale is None else list(global_scale.shape)}")
    if quant in FP4_QUANTS and config.block_k < max(32, fp4_scale_block(quant)):
        raise ValueError(f"{quant} needs block_k >= {max(32, fp4_scale_block(quant))}, "
                         f"got {config.block_k}")
    if config.split_k > 1 and not atomic_out:
        raise ValueError(f"split_k={config.split_k} needs the atomic output (GEMM2, combine='atomic')")
    grid = (num_m_blocks * cdiv(n, config.block_n) * config.split_k,)
    if quant == "fp8_block" or quant in FP4_QUANTS:
        stride_asm = a_scale.stride(0) if a_scale is not None else 0
        stride_wse, stride_wsn = w_scale.stride(0), w_scale.stride(1)
        if w_scale.dtype == torch.float8_e4m3fn:
            w_scale = w_scale.view(torch.uint8)  # nvfp4: the kernel decodes the e4m3 bits
    elif quant == "fp8":
        stride_asm, stride_wse, stride_wsn = 1, w_scale.stride(0), 1
    else:
        stride_asm = stride_wse = stride_wsn = 0
    operands_fp32 = interpret_upcast or (quant == "none" and a.dtype == torch.float32)
    dummy = routing.topk_weights
    _launcher(grid)(
        a, a_scale if a_scale is not None else dummy, w,
        w_scale if w_scale is not None else dummy,
        bias if bias is not None else dummy, out,
        global_scale if global_scale is not None else dummy,
        routing.sorted_pair_ids if not routing.direct else routing.topk_ids,
        routing.block_expert_ids if not routing.direct else routing.topk_ids,
        routing.topk_ids, routing.topk_weights,
        n, k, routing.num_pairs, routing.top_k, routing.num_experts,
        routing.local_expert_offset, num_m_blocks,
        a.stride(0), stride_asm,
        w.stride(0), w.stride(1), w.shape[2] // 4 if quant in FP4_QUANTS else 0,
        stride_wse, stride_wsn,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        global_scale.stride(0) if global_scale is not None else 0,
        alpha, limit,
        ALIGN_BLOCK_M=routing.align_block_m, DIRECT=routing.direct, GATHER_A=gemm == 1,
        ATOMIC_OUT=atomic_out, QUANT=quant, ACTIVATION=activation if gemm == 1 else "none",
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=gemm == 2,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, SWAP_AB=config.swap_ab,
        UPCAST=interpret_upcast, DOT_PRECISION="ieee" if operands_fp32 else "tf32",
        EVEN_K=k % config.block_k == 0,
        FAST_FP4=use_fast_fp4(quant, a.dtype, config),
        SPLIT_K=config.split_k, USE_PDL=use_pdl(a.device),
        NUM_K_STEPS=static_k_steps(quant, k, config),
        **fp8_dot_options(quant, config),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_options(a.device),
    )


def gemm1(a, a_scale, w13, w13_scale, b13, intermediate, routing: Routing, config: GemmConfig,
          *, quant: str, activation: str, alpha: float, limit: float,
          interpret_upcast: bool = False, w13_global_scale=None) -> None:
    """intermediate[slot] = act(x[token] @ w13[e]^T (scaled) + b13[e]) for every routed pair."""
    _launch(a, a_scale, w13, w13_scale, b13, intermediate, routing, config,
            n=w13.shape[1], k=a.shape[1], gemm=1, quant=quant,
            activation=activation, alpha=alpha, limit=limit, atomic_out=False,
            interpret_upcast=interpret_upcast, global_scale=w13_global_scale)


def gemm2(a, a_scale, w2, w2_scale, b2, out, routing: Routing, config: GemmConfig, *,
          quant: str, atomic_out: bool, interpret_upcast: bool = False,
          w2_global_scale=None) -> None:
    """out[pair] (or += into out[token]) = w * (intermediate[slot] @ w2[e]^T (scaled) + b2[e])."""
    _launch(a, a_scale, w2, w2_scale, b2, out, routing, config,
            n=w2.shape[1], k=a.shape[1], gemm=2, quant=quant, activation="none",
            alpha=0.0, limit=0.0, atomic_out=atomic_out, interpret_upcast=interpret_upcast,
            global_scale=w2_global_scale)
