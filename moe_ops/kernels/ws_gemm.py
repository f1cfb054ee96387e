"""The fp8 grouped GEMMs for prefill on Hopper, warp-specialized (Gluon): fp8_block, and fp8
per tensor (experts.WS_FP8).

Why a second GEMM kernel: fp8_block scales each 128-column partial product before it joins the
fp32 accumulator (`acc += (a @ w) * a_scale * w_scale`, every K step). In grouped_gemm's Triton
kernels each step therefore waits for its MMAs, and the tensor cores idle while the warps
promote; Triton 3.6 cannot overlap the two for this loop (its automatic warp specialization
does not apply on sm_90, see benchmarks/dev_prefill_ws.py). Gluon, the lower-level dialect in
the same Triton wheel, states the schedule explicitly, as DeepGEMM does in CUDA:

  producer   1 warp: TMA loads of each K step's activation tile [BLOCK_M, 128] and weight tile
             [BLOCK_N, 128] into a ring of STAGES shared-memory slots (ready / empty mbarriers)
  consumers  2 warpgroups, each owning half the output tile (TILE "rows": 64 of 128 rows;
             "cols": 128 of 256 columns; "wide": 64 of 128 rows by 256 columns, its two
             128-column halves in turn): per K step, an asynchronous wgmma of its half into a
             fresh fp32 partial, wait, release the slot, then the promotion
             acc += partial * a_scale[row] * w_scale. The two warpgroups run independently, so
             one's promotion overlaps the other's wgmma.
Both walk the output tiles persistently (one program per SM, grouped order as in
grouped_gemm), over the live row blocks of the dispatch (their count is on the device).

Measured on an H200 (benchmarks/dev_ws_fp8_block.py, DeepSeek-V3's GEMMs on dispatch-ordered
rows, T = 16384): the kernel bare (its first form) 792 / 693 TFLOP/s for GEMM1 / GEMM2 against
520-550 / 539-569 for grouped_gemm's kernels; as the package runs it (GEMM2's epilogue: rows per
pair, stores through a row-contiguous layout) 829 / 772. In DeepSeek-V3's experts call the two
GEMMs took 16.0 ms against 17.5 (T = 16384, before the row-contiguous stores;
results/h200_ws_profile_*.json).

Same contract as grouped_gemm's persistent kernel: activation rows in dispatch order (GEMM1's
gathered by align.gather_rows; with GATHER by its own producer, from the token rows), one
scale per row per 128 columns ([slots, K/128]),
weights [E, N, K] e4m3 with [E, N/128, K/128] scales (w13's gate/up rows interleaved, their
scale rows too); fp8 per tensor (BLOCK_SCALES 0): the partial sums still promoted every K
step (every other with FP8_PROMOTE_STEPS 2), a scale per row ([slots]) and per weight row
([E, N]) applied in the epilogue. GEMM1
applies the activation (and bias) and writes intermediate[slot], GEMM2 multiplies by the
routing weight and writes out[pair] (then combine_pair_rows). Padding slots are never written;
with SKIP_PADDING a warpgroup whose rows are all padding skips its MMAs. Gluon has no
interpreter: on a CPU the tests compile it for sm_90 (ptxas from the Triton wheel); the GPU
tests compare it with the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_ops.kernels.common import (
    FP8_BLOCK, apply_activation, device_properties, round_to_dtype)
from moe_ops.kernels.env import env_choice, env_int
from moe_ops.kernels.grouped_gemm import _launcher

# Each consumer warpgroup's share of a tile: 64 rows x 128 columns (one m64n128k32 wgmma per 32
# columns of K; its fp32 accumulator and partial take 2 x 64 registers a thread).
WG_ROWS, WG_COLS = 64, 128
# TILE -> (BLOCK_M, BLOCK_N): the warpgroups split a 128-row tile ("rows") or a 256-column one
# ("cols": 64-row blocks, the dispatch alignment the tables' fp8_block configs use); "wide":
# a 128 x 256 tile, each warpgroup 64 rows and both 128-column halves in turn (two fp32
# accumulators and one partial: 3 x 64 registers), so each K step's operands, 48 KB, feed twice
# the MMA work of "rows"' 32 KB: a tile loads 1.5 bytes a K column per output column where
# "rows" loads 2.
TILES = {"rows": (2 * WG_ROWS, WG_COLS), "cols": (WG_ROWS, 2 * WG_COLS),
         "wide": (2 * WG_ROWS, 2 * WG_COLS)}
# the kernel's FORM constexpr a tile form builds with: how the warpgroups share the tile
FORMS = {"rows": 0, "cols": 1, "wide": 2}
# "wide" holds 3 x 64 accumulator registers of a consumer's 232: the builds whose K loops (both
# consumers') keep them (sm_90 SASS, tests/test_ws_gemm.py), (quant, activation, bias):
# fp8_block's GEMM2 and its swiglu GEMM1 without bias (DeepSeek-V3's), fp8 per tensor's GEMM1
# of every activation and its GEMM2 with a bias; at most one register exchanged through local
# memory around a wgmma issue (4 accesses a K step: fp8_block's swiglu, fp8's relu2 without
# bias), the others none. The builds left out spill 84-100 local accesses a step
# (ptxas's choice at this register count moves with small changes of the code: the test pins
# the list); a GEMM the form does not admit runs the rule's form.
WIDE_BUILDS = (("fp8_block", "none", False), ("fp8_block", "none", True),
               ("fp8_block", "swiglu", False), ("fp8", "none", True)) + tuple(
    ("fp8", activation, bias) for activation in ("swiglu", "geglu", "swiglu_oai", "relu2")
    for bias in (False, True))


# fp8 per tensor's GEMM2 without a bias (Mixtral's, Llama 4's, Qwen3's): its "wide" K loops keep
# their registers only with NATIVE_CAST's shorter epilogue (sm_90: 2 local accesses a step, 84+
# with round_to_dtype; tests/test_ws_gemm.py). Admitted with NATIVE_CAST when
# MOE_OPS_WS_WIDE_FP8_GEMM2=1. Measured on an H200 (`bash benchmarks/h200_run.sh native4`,
# results/h200_ab_wide_fp8_gemm2_*_twentyseventh.*, 2026-12-03; its GPU tests passed, memcheck
# clean), graph replays, two alternated passes, 0 / 1: Mixtral fp8 T = 16384 10882 / 10977 ->
# 11242 / 11161 us, Llama 4 fp8 4155 / 4179 -> 4250 / 4243, Qwen3 fp8 1744 / 1711 -> 1732 /
# 1727, the T = 4096 points within their spread. So off.
WIDE_NATIVE_BUILDS = (("fp8", "none", False),)
WIDE_FP8_GEMM2 = env_choice("MOE_OPS_WS_WIDE_FP8_GEMM2", "0", ("0", "1")) == "1"


def wide_admits(quant: str, activation: str, has_bias: bool,
                native_cast: Optional[bool] = None) -> bool:
    """Whether "wide" is built for this GEMM (WIDE_BUILDS; WIDE_NATIVE_BUILDS with
    WIDE_FP8_GEMM2 and the native cast, by default NATIVE_CAST)."""
    build = (quant, activation, has_bias)
    native = NATIVE_CAST if native_cast is None else native_cast
    return build in WIDE_BUILDS or (WIDE_FP8_GEMM2 and native and build in WIDE_NATIVE_BUILDS)


ACTIVATIONS = ("none", "swiglu", "geglu", "swiglu_oai", "relu2")
# fp8_block: scales per 128 columns of K applied every K step; fp8 (per tensor): the partial
# sums promoted every K step, one scale per row and per weight row in the epilogue.
QUANTS = ("fp8_block", "fp8")
STAGES = 4          # 4 x 32 KB of operand slots ("rows"), 4 x 40 KB ("cols"), 4 x 48 KB ("wide")
# The most slots each form's shared memory holds (227 KB a block, the epilogue's ~20 KB with them)
MAX_STAGES = {"rows": 6, "cols": 5, "wide": 4}
# Row blocks a group of the persistent tile order holds (they walk the column blocks together:
# a weight tile is read once a group while a group's activation rows stay in the L2). A model
# of the order's DRAM reads (benchmarks/dev_l2_order.py: the rounds of 132 tiles through an LRU
# L2, within 5% of Nsight Compute's bytes for DeepSeek-V3's GEMMs at T = 4096) has the
# experts of Mixtral / Llama 4 (117 / 84 MB of fp8 weights in GEMM1) read once a group:
# GEMM1's weights 2.0x / 1.2x at T = 4096 and 5.0x / 2.0x at 16384 with 8, 1.25x / 1.0x and
# 2.0x / 1.25x with 32 and the groups cut at the experts' boundaries (fixed windows of 32
# re-read activations instead); Mixtral's GEMM2 (K
# = 14336: 1.8 MB of activations a row block) reads fewest with 16 (results/
# model_l2_order_*_twentyeighth.*). Measured on an H200 (`bash benchmarks/h200_run.sh groupm`,
# results/h200_*groupm*_twentyninth.*, 2026-12-03): Nsight Compute on Mixtral fp8 T = 16384,
# GEMM1 with 32 read 2.77 GB from DRAM against 4.87 with 8 (the model: 2.1 / 4.8) but ran 6.82
# against 6.85 ms (its tensor pipe 78% busy, DRAM 11-18%: not what it waits on); GEMM2 with 16
# 3.76 against 3.78 GB (the model's saving not there), 3.08 ms both; the layers (Mixtral,
# Llama 4 fp8, DeepSeek-V3 fp8_block at T = 4096 / 16384; 8 / 16 / 16 with 32 for GEMM1 / 32)
# all within the runs' spread (Mixtral T = 16384 10.8-11.1 ms every arm). So 8 stays.
# MOE_OPS_WS_GROUP_M=n sets both GEMMs' (GROUP_M), MOE_OPS_WS_GROUP_M_GEMM1=n GEMM1's
# alone (0: GROUP_M's); powers of two (the expert groups' window is a register vector).
def _group_m_checked(name: str, value: int, zero_ok: bool = False) -> int:
    """value, refused (naming `name`) unless a power of two (or, zero_ok, 0)."""
    if value & (value - 1) or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


GROUP_M = _group_m_checked("MOE_OPS_WS_GROUP_M", env_int("MOE_OPS_WS_GROUP_M", 8))
GROUP_M_GEMM1 = _group_m_checked("MOE_OPS_WS_GROUP_M_GEMM1",
                                 env_int("MOE_OPS_WS_GROUP_M_GEMM1", 0), zero_ok=True)


def group_size(gemm: int) -> int:
    """Row blocks a group of GEMM `gemm`'s tile order holds (GROUP_M, GROUP_M_GEMM1)."""
    return GROUP_M_GEMM1 if gemm == 1 and GROUP_M_GEMM1 else GROUP_M


# Tile groups cut at the experts' boundaries (EXPERT_GROUPS): with fixed windows of GROUP_M row
# blocks an expert whose blocks straddle two windows has its weight tiles read by the first
# window's blocks and again by the second's a whole window of tiles later, by when they have
# left the L2 if the window's weights pass its 50 MB. Nsight Compute on DeepSeek-V3 fp8_block
# at T = 4096 ("cols": 2-3 blocks of 64 rows an expert, 8 a window; 16 column blocks, so one
# window is about one wave of 132 programs): GEMM1 read 9.49 GB from DRAM for 7.5 GB of
# weights, GEMM2 4.48 for 3.76, the L2 at 80% / 76% of its throughput, DRAM at 64% / 60%
# (results/h200_ncu_layer_deepseek_v3_fp8_block_4096_l2_twentyeighth.csv). Cut there, an
# expert's two pieces are at most its own tiles apart. The tiles and their results are the same
# (the order alone changes); each tile reads its window's GROUP_M block experts once (one
# thread holds them all: no reduction across warps), ~150-230 SASS instructions a tile in each
# warpgroup. Measured on an H200 with it on every launch (`bash benchmarks/h200_run.sh
# expertgroups`, results/h200_*expertgroups*_twentyeighth.*, 2026-12-03): DeepSeek-V3's GEMMs at
# T = 4096 read 9.49 -> 8.38 GB (GEMM1) and 4.48 -> 3.84 GB (GEMM2) from DRAM, 3.11 -> 3.09 and
# 1.71 -> 1.62 ms under the profiler; the layers as graph replays, two alternated passes:
# DeepSeek-V3 fp8_block T = 4096 5214 / 5195 -> 5073 / 5012 us, T = 16384 15206 / 16301 ->
# 14252 / 15101, T = 1024 equal; Qwen3-30B-A3B fp8 slower (T = 16384 1718 / 1617 -> 1797 /
# 1758: its 3 MB experts' weights stay in the L2 anyway, and its GEMM2's 6-step tiles pay the
# coordinates' instructions), Mixtral fp8 within 1% (its experts span whole windows from T =
# 4096 on). So by rule ("auto", expert_groups_apply): where an expert's weights pass
# EXPERT_GROUPS_MIN_BYTES and its rows are fewer than a window's blocks. The rule against 0
# (`bash benchmarks/h200_run.sh expertrule`, results/h200_ab_expertrule_*_twentyeighth.*), two
# alternated passes: DeepSeek-V3 fp8_block T = 16384 15769 / 16590 -> 14757 / 16075 us, 4096
# 5365 / 5121 -> 5225 / 5215, 2048 4534 / 4550 -> 4588 / 4588; Llama 4 fp8 T = 4096 1364 /
# 1358 -> 1302 / 1352, 2048 768 / 798 -> 781 / 755; Mixtral fp8 T = 2048 1580 / 1602 -> 1550 /
# 1568; the points it leaves off (Llama 4 T = 16384, Mixtral 4096 / 16384) moved 1-2% either
# way between the arms. MOE_OPS_WS_EXPERT_GROUPS 0 / 1: never / always.
EXPERT_GROUPS = env_choice("MOE_OPS_WS_EXPERT_GROUPS", "auto", ("0", "auto", "1"))
EXPERT_GROUPS_MIN_BYTES = 8 << 20


def expert_groups_apply(tile: str, num_pairs: int, num_experts: int, n: int, k: int,
                        expert_groups: Optional[bool] = None, gemm: int = 2) -> bool:
    """Whether a launch cuts its tile groups at the experts' boundaries: expert_groups when
    given, else EXPERT_GROUPS, whose "auto" takes them where an expert's e4m3 weights (n x k
    bytes) are at least EXPERT_GROUPS_MIN_BYTES (a window of them passes the L2) and its
    routed rows, on average, fill fewer than group_size(gemm) of the tile's row blocks (so
    windows hold several experts and cut some)."""
    if expert_groups is not None:
        return bool(expert_groups)
    if EXPERT_GROUPS != "auto":
        return EXPERT_GROUPS == "1"
    return (n * k >= EXPERT_GROUPS_MIN_BYTES
            and num_pairs < group_size(gemm) * TILES[tile][0] * num_experts)


# Registers a thread: consumers 232 (two fp32 tiles and the addressing), the producer 40 (the
# minimum that holds its loop); the launch's budget of 168 x 12 warps fits one program an SM.
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168


# Staggered consumers (measured slower, so off): both warpgroups of a tile finish it together,
# so their epilogues leave the tensor cores idle at once. With MOE_OPS_WS_STAGGER=s, consumer 1
# starts its first tile once consumer 0 has released s K steps' slots; the ring then keeps it
# about s steps behind, and each one's epilogue runs beside the other's MMAs. s < the ring's
# slots (MOE_OPS_WS_STAGES=n, up to MAX_STAGES of the form; default: ring_stages); off where the
# padding skip is on (a skipped half would not release in step) and for "wide" (its K loop
# spills with the check in it: 104 local accesses a step). The check costs 7-9 instructions a
# K step in "rows" / "cols" (no spill; tests/test_ws_gemm.py). Measured on an H200
# (results/h200_ab_stagger_*.json, 2026-12-01): the GEMMs alone at T = 16384, "rows" / stagger
# 3 of 6 slots / 5 of 6: DeepSeek fp8_block GEMM1 812 / 765 / 775 TFLOP/s, GEMM2 728 / 719 /
# 777 (wide 796); Mixtral fp8 GEMM1 937 / 865 / 860, GEMM2 1098 / 957 / 935; the layers with 6
# slots and stagger 3 against the default 4 / 0, graph replays: Mixtral fp8 T = 16384 12285 ->
# 13589 us, DeepSeek fp8_block 16389 -> 16505, Qwen3 fp8 equal. So 0 (and STAGES slots).
STAGGER = env_int("MOE_OPS_WS_STAGGER", 0)
# MOE_OPS_WS_STAGES=n: n slots for every form (at most what it holds); unset (0): STAGES, but
# the "rows" form's whole ring (6) for GEMMs of at most SHORT_K_MAX_K columns of K
# (MOE_OPS_WS_SHORT_K_MAX_K, 1024; 0: never). Why: such a tile is a few K steps (Qwen3-30B-A3B's
# GEMM2, K = 768: 6), so with 4 slots the producer can fetch only part of the next tile while
# the consumers run this one's steps and epilogue. Measured on an H200
# (results/h200_ab_stages_*_twentythird.json, 2026-12-03, graph replays, two alternated passes,
# 6 slots against 4 on every form): Qwen3 fp8 T = 4096 675 -> 661 us, T = 16384 2152 -> 2089
# (its GEMM2 the only launch that changes there), every pass faster; the long-K layers
# (Mixtral, Llama 4 fp8, DeepSeek-V3 fp8_block at T = 4096 / 16384) -0.7% to +4% (geometric
# mean of the eight points 1.000), so they keep 4. The rule by K, with GEMM1 gathering its
# rows (results/h200_ab_shortk_gather_*_twentyfourth.json, 0 -> 1024): Qwen3 fp8 T = 4096
# 684-687 -> 660-673 us, T = 16384 2019-2040 -> 1987-2012, T = 2048 389-391 -> 394-395 (1.4%
# slower there, below the prefill sizes the targets name); its GPU tests (17 passed) and
# gpu_check of Qwen3 fp8 (8 passed) with it (results/h200_console_twentyfourth.log).
RING_STAGES = env_int("MOE_OPS_WS_STAGES", 0)
SHORT_K_MAX_K = env_int("MOE_OPS_WS_SHORT_K_MAX_K", 1024)


def ring_stages(tile: str, k: int = 0) -> int:
    """Slots of the operand ring for a tile form and a GEMM's K (0: not known, STAGES):
    RING_STAGES where set, at most what the form holds; else the rule above."""
    if RING_STAGES:
        return max(2, min(RING_STAGES, MAX_STAGES[tile]))
    if tile == "rows" and 0 < k <= SHORT_K_MAX_K:
        return MAX_STAGES["rows"]
    return min(STAGES, MAX_STAGES[tile])


def stagger_steps(tile: str, gemm: int) -> int:
    """The K steps consumer 1 starts behind consumer 0 (STAGGER), less than the ring's slots;
    0 with the padding skip and for "wide"."""
    if skip_padding(gemm) or tile == "wide":
        return 0
    return min(STAGGER, ring_stages(tile) - 1)


# The slots' epilogue operands (pair ids, GEMM2's routing weights: two dependent global loads;
# fp8 per tensor's row scales) loaded before a tile's K loop instead of after it, so their
# latency hides under the loop rather than idling the warpgroup at every tile's end (the
# columns' scales and bias stay after it: 32 registers each a thread). Why: the epilogue is a
# visible share of the short-K GEMMs (DeepSeek's GEMM2, K = 2048: 16 steps; Qwen3's, K = 768:
# 6). Measured on an H200 (results/h200_ab_fp8_early_*.json, 2026-12-01, arms alternated
# twice), graph replays, off / on: Mixtral fp8 T = 4096 3107-3150 / 3249-3259 us, T = 16384
# 11925-11930 / 12446-12455; DeepSeek fp8_block and Qwen3 fp8 within the spread. So off
# (MOE_OPS_WS_EARLY_EPILOGUE=1: on).
EARLY_EPILOGUE = env_choice("MOE_OPS_WS_EARLY_EPILOGUE", "0", ("0", "1")) == "1"


# Where the rule of experts.ws_tile gives "wide": "all" (every build WIDE_BUILDS admits) or
# "gemm2" (fp8_block's GEMM2 only); the measurements beside experts.WS_WIDE_MIN_ROWS.
WIDE = env_choice("MOE_OPS_WS_WIDE", "all", ("gemm2", "all"))


def wide_by_rule(quant: str, activation: str) -> bool:
    """Whether the tile rule may pick "wide" for a build WIDE_BUILDS admits (WIDE)."""
    return WIDE == "all" or (quant == "fp8_block" and activation == "none")


# The epilogue's stores through a row-contiguous layout (_store_rows); MOE_OPS_WS_STORE=mma
# stores from the MMA's layout directly (for A/B).
COALESCED_STORE = env_choice("MOE_OPS_WS_STORE", "coalesced", ("coalesced", "mma")) == "coalesced"
# A consumer warpgroup whose rows are all padding skips its MMAs. Measured on an H200 with
# 128-row tiles (results/h200_ws_fp8_block_skip.json, h200_ws_fp8_mixtral.json, 2026-12-01),
# the test inside the K loop: GEMM2's shapes gain (DeepSeek-V3 fp8_block T = 16384 726 -> 737
# TFLOP/s, Mixtral-8x7B fp8 1028 -> 1065) but GEMM1's lose (817 -> 690, 932 -> 862). The test is
# now made once a tile (_consumer); tested on the GPU and measured there at T = 16384
# (results/h200_ab_scale_loads_*.json, 2026-12-01): DeepSeek-V3 GEMM1's shape 9.25 -> 9.07 ms,
# GEMM2's 5.12 -> 5.16, Mixtral's 8.11 -> 8.33 and 3.58 -> 3.67: within the run-to-run spread
# or worse, so off; MOE_OPS_WS_SKIP_PADDING=gemm2: GEMM2 only, 1: both GEMMs.
SKIP_PADDING = env_choice("MOE_OPS_WS_SKIP_PADDING", "0", ("0", "gemm2", "1"))


# fp8_block: each K step's block scales loaded before its wgmmas ("before", the default: ptxas
# then places their products between the step's first and second wgmma, whose issue waits for
# the loads; the form measured and tested on the GPU) or after their issue ("after": the four
# wgmmas issued back to back, the products after them, the loads' latency overlapping the
# MMAs). Both tested on the GPU; measured there (results/h200_ab_scale_loads_*_fp8_block.json,
# 2026-12-01, DeepSeek-V3 T = 16384, GEMM alone, before -> after): "rows" GEMM1's shape 9.25 ->
# 10.22 ms, GEMM2's 5.12 -> 5.56; "cols" 13.10 -> 10.88 and 5.63 -> 5.23; "wide" 8.51 -> 8.38
# and 4.56 -> 4.39. No form gains beyond the spread on the tiles that run, so "before".
# "cols" loads them after on the "cols" form alone: that form gained there (GEMM1's shape
# 13.10 -> 10.88 ms) but ran at none of the points measured (T = 16384: the 128-row forms);
# it is the form of DeepSeek-V3 at T <= 4096 (below WS_ROWS_TILE_MIN_ROWS rows an expert).
# Measured there (`bash benchmarks/h200_run.sh scalecols`, results/h200_ab_scalecols_*,
# 2026-12-03), the layer as graph replays, two alternated passes, before / cols: T = 1024 3016
# / 3071 -> 3081 / 3064 us, 2048 4277 / 4255 -> 4246 / 4276, 4096 5023 / 5689 -> 4931 / 5767:
# within the passes' spread, so "before" stays.
SCALE_LOADS = env_choice("MOE_OPS_WS_SCALE_LOADS", "before", ("before", "after", "cols"))
SCALES_AFTER_MMA = SCALE_LOADS == "after"


def scales_after(tile: str) -> bool:
    """Whether a launch of this form loads fp8_block's step scales after its wgmmas' issue."""
    return SCALES_AFTER_MMA or (SCALE_LOADS == "cols" and tile == "cols")


def skip_padding(gemm: int) -> bool:
    return SKIP_PADDING == "1" or (SKIP_PADDING == "gemm2" and gemm == 2)


# fp8 per tensor: K steps (of 128 columns) whose wgmmas chain into one fp32 partial before it
# joins the accumulator. 1 promotes every step (as fp8_block must, its scales changing every
# step); 2 (the default) halves the promotions (the accumulator's adds, between a consumer's
# wgmmas) at grouped_gemm.FP8_PROMOTE_K's interval, 256 columns (measured there: 5.9e-3 against
# the reference at T = 4096, 4.8e-3 at 128). Its sm_90 K loop (two steps, 8 wgmmas): 144-154
# SASS instructions against 105-120 a step promoted singly, no local memory; the "rows" and
# "cols" forms only (promote_pairs). Measured on the H200 (`bash benchmarks/h200_run.sh
# wspair`, Qwen3 / Mixtral / Llama 4 fp8 at T = 2048-16384, two alternated passes): the layer
# 0.3-4.5% faster at every point, 1.7% in the geometric mean; MOE_OPS_WS_FP8_PROMOTE_STEPS=1
# restores single steps.
FP8_PROMOTE_STEPS = int(env_choice("MOE_OPS_WS_FP8_PROMOTE_STEPS", "2", ("1", "2")))


# Pipelined pairs (PIPE_PAIRS, with paired promotion): each consumer issues the next pair's
# wgmmas into a second partial before it waits for the previous pair's and promotes it, so its
# wgmmas never drain while it adds (the paired loop above waits for each pair's last wgmma, and
# both consumers of a "rows" / "cols" tile consume the same slots, so they tend to promote at
# once while the tensor cores idle). The promotions' order is unchanged: the same values bit
# for bit. A consumer then holds up to four slots, so the ring takes the form's most slots
# (MAX_STAGES: one pair of lookahead beside the two held); not with the producer's gather or
# OVERLAP (their slot accounting assumes two held). Measured on an H200 (`bash
# benchmarks/h200_run.sh pipepairs`, results/h200_*pipe*_twentyeighth.*, 2026-12-03): its GPU
# tests bit for bit with the serial pairs, compute-sanitizer clean; Mixtral's GEMM2 alone at T =
# 16384 3.02-3.12 ms either way; the layers as graph replays, two alternated passes, 0 / 1:
# Mixtral fp8 T = 4096 2783 / 2629 -> 2805 / 2731 us, 16384 10603 / 10768 -> 10639 / 10649,
# Llama 4 fp8 1311 / 1330 -> 1316 / 1298, 4034 / 4110 -> 4086 / 4087, Qwen3 fp8 552 / 546 ->
# 572 / 572, 1728 / 1730 -> 1709 / 1628: no gain beyond the spread (Qwen3 T = 4096 4% slower),
# so off; MOE_OPS_WS_PIPE_PAIRS=1 turns it on.
PIPE_PAIRS = env_choice("MOE_OPS_WS_PIPE_PAIRS", "0", ("0", "1")) == "1"


def pipelines_pairs(pairs: bool, gather_top_k: int, overlap: bool,
                    pipe_pairs: Optional[bool] = None) -> bool:
    """Whether a launch with paired promotion pipelines its pairs (pipe_pairs, by default
    PIPE_PAIRS; never with a gather or OVERLAP)."""
    wanted = PIPE_PAIRS if pipe_pairs is None else pipe_pairs
    return bool(wanted and pairs and gather_top_k == 0 and not overlap)


def pairs_fit(quant: str, tile: str, gemm: int) -> bool:
    """Whether a launch can promote every other K step: fp8 per tensor on the "rows" and "cols"
    forms ("wide" holds three accumulator tiles: see _mma_steps_wide), not staggered (the pair
    loop has no `go` arrive; STAGGER is off by default)."""
    return quant == "fp8" and tile != "wide" and stagger_steps(tile, gemm) == 0


def promote_pairs(quant: str, tile: str, gemm: int) -> bool:
    """Whether a launch's K loop promotes every other step (FP8_PROMOTE_STEPS 2, where it fits)."""
    return FP8_PROMOTE_STEPS == 2 and pairs_fit(quant, tile, gemm)


# GEMM2 adding each pair's row into its token's float32 output row (MOE_OPS_WS_ATOMIC=1;
# 8-byte vector atomics from the MMA's layout, reduced at the L2) instead of writing pair rows
# that a second pass sums. Measured slower, so off (results/h200_ab_wsatomic_*_twentyfourth.json,
# graph replays, two alternated passes: Qwen3 fp8 T = 16384 1992-1999 -> 2198-2228 us, Mixtral
# fp8 T = 16384 +4.7%, Llama 4 fp8 +2-3% at every size, DeepSeek-V3 fp8_block +0.3-1.4%, the
# geometric mean of twelve points +2.2%; its GPU tests passed). Why it was tried:
# Qwen3-30B-A3B's fp8 GEMM2 at T = 16384 writes 537 MB of pair rows (131072 x 2048 bf16) and the combine reads them back
# (143 us, 7% of the call; results/h200_profile_layer_prefill_twentythird.log); the Triton
# tile kernels' atomic form measured faster there at T = 4096 (experts.COMBINE). Against it: a
# zero fill and a cast of [T, H] float32, 4 bytes a value reduced per pair, and, past the L2
# (T = 16384: 134 MB), the output's lines fetched again for the reductions; its sums' order
# varies run to run. Its sm_90 builds: no stores, no stack in "rows" / "cols", the "wide"
# fp8_block build's stack 8 -> 32 B. `bash benchmarks/h200_run.sh wsatomic` measures it again.
ATOMIC = env_choice("MOE_OPS_WS_ATOMIC", "0", ("0", "1")) == "1"
# GEMM1 gathering its token rows itself (GATHER): the producer is a warpgroup that copies each
# K step's activation rows from the per-token quantized x [T, K] by cp.async (16-byte vectors,
# one row per slot: token = pair id // top_k, padding slots zero-filled) while one of its
# threads issues the weight tile's TMA load, instead of GEMM1 reading rows that
# align.gather_rows copied into dispatch order first (a launch that writes, and GEMM1 reads
# back, one row per pair: Qwen3-30B-A3B fp8 at T = 16384 268 MB, 178 us, 8.6% of the call;
# results/h200_profile_layer_prefill_twentythird.log); gathered in the loads, a token's row
# comes from the L2. The cp.async writes reach the ring through the generic proxy, so the
# producer waits for a step's copies GATHER_LAG steps later (cp.async.wait_group), each thread
# fences its own for the wgmmas' async proxy, the warpgroup syncs, and one thread arrives on
# the slot's ready barrier (which then counts the TMA's arrival and this one). The lag is
# bounded so that the ring cannot stall on an arrive not yet made (gather_lag).
# Measured on an H200 (results/h200_ab_wsgather*_twentyfourth.json, 2026-12-03, graph replays,
# two alternated passes, off / on): Qwen3 fp8 (GEMM1's N = 1536) T = 2048 390-394 -> 389-394
# us, T = 4096 677-689 -> 665-682, T = 16384 2121-2152 -> 2000-2047 (5-6% faster in all four
# passes); DeepSeek-V3 fp8_block (N = 4096) T = 4096 1-2% slower, T = 16384 -5% to +2%;
# Mixtral fp8 (N = 28672) 1-11% slower at T = 2048 and 16384. The copy it saves is a pass of
# H bytes a pair, against GEMM work of H x N a pair: the narrower GEMM1, the larger its share,
# while the cp.async producer costs the wide GEMMs a little of their rate. So "auto" gathers
# for GEMM1s of N <= GATHER_MAX_N (2048: Qwen3's); MOE_OPS_WS_GATHER=0: never, 1: always.
GATHER = env_choice("MOE_OPS_WS_GATHER", "auto", ("0", "auto", "1"))
GATHER_MAX_N = env_int("MOE_OPS_WS_GATHER_MAX_N", 2048)
GATHER_LAG = env_int("MOE_OPS_WS_GATHER_LAG", 2)
# the gathering producer's warps (a warpgroup: its 128 threads' copies, 8 vectors each for a
# 128 x 128 tile)
GATHER_WARPS = gl.constexpr(4)


def gather_lag(stages: int, pairs: bool, stagger: int) -> int:
    """Steps between a gathered step's issue and its arrival (GATHER): GATHER_LAG, bounded so
    that no consumer waits on a step whose arrival needs a slot it holds: below the ring's
    slots (the producer issues step s + lag only into a released slot), less one with paired
    promotion (its K loop holds two slots before releasing either), and at most slots -
    stagger (consumer 1 starts only after consumer 0 has released step stagger - 1). 0 where
    no lag fits (a 2-slot ring with pairs): the launcher refuses such a gather."""
    return max(0, min(GATHER_LAG, stages - 1 - int(pairs), stages - stagger))


def gathers(quant: str, tile: str, k: int, n: int) -> bool:
    """Whether the experts call's GEMM1 ([N = n, K = k] weights an expert) gathers its rows
    itself: GATHER "1", or "auto" and n <= GATHER_MAX_N, and a lag that fits its ring
    (gather_lag)."""
    wanted = GATHER == "1" or (GATHER == "auto" and n <= GATHER_MAX_N)
    return wanted and gather_lag(ring_stages(tile, k), promote_pairs(quant, tile, 1),
                                 stagger_steps(tile, 1)) >= 1


# Each consumer issuing a tile's first K step (its first two with paired promotion) before the
# previous tile's epilogue (OVERLAP): the two warpgroups of a tile finish it together, so
# without it both run their epilogues (the routing weights' dependent loads, the scales, the
# stores) while the tensor cores idle. Why: Qwen3-30B-A3B's fp8 GEMM2 (K = 768, 6 K steps a
# tile) spends about half its time outside its K steps: on an H200 (`python
# benchmarks/dev_ws_fp8_block.py --model qwen3_30b_a3b --probe`,
# results/h200_ws_probe_qwen3_30b_a3b_twentysixth.json, 2026-12-03) the "rows" form at T = 16384
# took 0.628 ms for K = 768 and 0.931 ms for K = 1536 (so 0.30 ms for 6 K steps a tile and
# 0.33 ms for what a tile costs besides them), and 0.622 ms with every pair's row stored into
# one output row (the DRAM writes are not it). The ring's order is unchanged (the producer does
# not know), the held slots are the issued steps'. "rows" / "cols" forms only, without the
# stagger or the padding skip (static_assert). MOE_OPS_WS_OVERLAP: "0" off, "short" for GEMMs
# of at most SHORT_K_MAX_K columns of K, "1" every launch the forms allow.
# Measured slower where it was meant to help, so off (`bash benchmarks/h200_run.sh overlap`,
# results/h200_ws_probe_*_overlap_twentysixth.json, h200_ab_overlap_*_twentysixth.json,
# 2026-12-03): Qwen3's GEMM2 at T = 16384 0.628 -> 0.660 ms (0.656 with the early epilogue
# too), T = 4096 0.190 -> 0.213, and its cost besides the K steps (2 t(K) - t(2K)) unchanged
# (0.29 -> 0.30 ms): the epilogue is not what a tile waits for, or the step issued ahead does
# not run under it. "cols" 10-17% slower. Mixtral's GEMM2 (K = 14336) 3.23 -> 3.19 ms, 2.97
# with the early epilogue (one sample each, in a run whose repeated points spread by up to
# 20%). The Qwen3 fp8 layer with "short" (its GEMM2 the only launch it changes) T = 16384
# 1793-1902 -> 1916-1921 us, T = 4096 611-656 -> 646-672. Its GPU tests: bit for bit against
# the serial tiles (GEMM2, every form, quant and K tried), the experts call against the oracle.
OVERLAP = env_choice("MOE_OPS_WS_OVERLAP", "0", ("0", "short", "1"))


def overlap_fits(tile: str, gemm: int) -> bool:
    """Whether a launch can take OVERLAP's form: "rows" / "cols" tiles, without the padding skip
    or a stagger (the kernel's static_assert)."""
    return tile != "wide" and not skip_padding(gemm) and not stagger_steps(tile, gemm)


def overlaps(tile: str, gemm: int, k: int) -> bool:
    """Whether a launch issues each tile's first steps before the previous epilogue (OVERLAP)."""
    if OVERLAP == "0" or not overlap_fits(tile, gemm):
        return False
    return OVERLAP == "1" or 0 < k <= SHORT_K_MAX_K


# The epilogue's float32 -> bf16 / fp16 rounding by the GPU's conversion (NATIVE_CAST, see to_out)
# instead of common.round_to_dtype's float32 grid rounding (written for the Triton interpreter,
# which this kernel never runs on). Why: round_to_dtype is ~12 instructions a value, so about half
# of a 64 x 128 tile's epilogue (sm_90 build of the "rows" fp8 GEMM2: ~1240 instructions a thread
# between its K loops), and Qwen3-30B-A3B's GEMM2 spent half its time outside its K steps
# (OVERLAP above). The same values for every finite output below 2^112 (an exact -0.0 keeps its
# sign, which round_to_dtype drops). Measured on an H200 (`bash benchmarks/h200_run.sh native`,
# 2026-12-03; results/h200_pytest_native_*, h200_ws_probe_native_*, h200_ab_native_*,
# twentyseventh): its GPU tests bit for bit against round_to_dtype (every form, both GEMMs) and
# compute-sanitizer clean; Qwen3's GEMM2 alone at T = 16384 0.615 -> 0.510 ms (4096: 0.189 ->
# 0.160); the layers, graph replays, two alternated passes: Qwen3 fp8 T = 16384 1850 / 1840 ->
# 1613 / 1750 us, Llama 4 fp8 4369 / 4198 -> 4202 / 4104, the T = 4096 points 1-6% faster, Mixtral
# fp8 and DeepSeek-V3 fp8_block T = 16384 within their passes' spread (8%). So on; ws_fp4's
# epilogue takes the same switch. MOE_OPS_WS_NATIVE_CAST=0: round_to_dtype.
NATIVE_CAST = env_choice("MOE_OPS_WS_NATIVE_CAST", "1", ("0", "1")) == "1"
# GEMM1's gated activations (swiglu, swiglu_oai) with the sigmoid as (1 + tanh(x / 2)) / 2 on
# the GPU's tanh.approx.f32: one MUFU op and three others a value instead of tl.sigmoid's
# exp2 with its range checks and a division (two MUFU ops, ~12 instructions). Why: the sm_90
# build of the wide fp8 GEMM1 spends ~1670 instructions a consumer thread in a tile's
# epilogue against 184-188 a K step, 1544 of the build's 4560 in the sigmoid; both
# warpgroups run it at once, the tensor cores idle meanwhile, and Mixtral fp8's GEMM1 keeps
# its tensor pipe busy 78% of the time against GEMM2's 89% (no activation). With it: 3432.
# The error: tanh.approx's (at most 2^-10.987 relative) gives the sigmoid an absolute error
# under 2.5e-4, below the bf16 output's rounding wherever the sigmoid exceeds 0.12; the
# intermediate is then quantized to fp8 (3 mantissa bits). Measured on an H200 (`bash
# benchmarks/h200_run.sh fastsig`, then `fastsigab`; 2026-12-03): its GPU tests passed,
# compute-sanitizer clean, gpu_check's errors within 1.3% of tl.sigmoid's at every case; the
# fp8 / fp8_block layers at T = 1024-16384, two alternated passes, 0.995 of the time in the
# geometric mean (Mixtral T = 4096 0.955 / 1.000, Qwen3 T = 16384 0.972 / 1.005): within the
# spread, never slower in the mean, so on. The epilogue is not where the wide GEMM1 waits:
# Nsight Compute's samples put its consumers on their own wgmmas' completion and the producer
# on free slots. ws_fp4's epilogues share write_rows and take their own switch (off there:
# ws_fp4.FAST_SIGMOID). MOE_OPS_WS_FAST_SIGMOID=0: tl.sigmoid.
FAST_SIGMOID = env_choice("MOE_OPS_WS_FAST_SIGMOID", "1", ("0", "1")) == "1"


# MOE_OPS_WS_GEMM=0 turns the kernel off (every launch then runs grouped_gemm's kernels).
ENABLED = env_choice("MOE_OPS_WS_GEMM", "1", ("0", "1")) == "1"


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr, READY: gl.constexpr = 1):
    """The mbarriers of a STAGES-slot operand ring: ready[s] completes when the producer's
    expected TMA bytes have landed (and, with READY 2, its gathered rows' arrive: see GATHER),
    empty[s] when each of the CONSUMERS warpgroups has released the slot (one arrive each)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def ring_next(index, phase, STAGES: gl.constexpr):
    """The next slot of a STAGES-slot ring and the mbarrier phase to wait for there (it flips
    each time the ring wraps)."""
    index += 1
    if index == STAGES:
        index = 0
        phase ^= 1
    return index, phase


@gluon.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr,
                 block_expert_ptr, BM: gl.constexpr, ALIGN_M: gl.constexpr):
    """A tile's (row block, column block). As grouped_gemm._tile_coords: a group of GROUP_M
    row blocks walks the column blocks together, so a weight tile is read by the group's row
    blocks of its expert at about the same time. With EXPERT_GROUPS the groups are also cut at
    the experts' boundaries (see EXPERT_GROUPS)."""
    if EXPERT_GROUPS:
        # Every group holds size * num_n consecutive tiles from its first row block * num_n
        # on, whatever the sizes, so tile // num_n is a row block of the tile's own group: the
        # group is that block's GROUP_M-aligned window cut to its expert's run (an expert's
        # blocks are contiguous). The window's experts in one thread each (no reduction
        # across warps), 8 at a time (32 at once spill the producer's 40 registers).
        CHUNK: gl.constexpr = 8 if GROUP_M > 8 else GROUP_M
        window_l: gl.constexpr = gl.BlockedLayout([CHUNK], [32], [gl.num_warps()], [0])
        block = tile // num_n
        expert = gl.load(block_expert_ptr + block * BM // ALIGN_M)
        window = (block // GROUP_M) * GROUP_M + gl.arange(0, CHUNK, layout=window_l)
        first_m = num_m
        end_m = 0
        for chunk in gl.static_range(GROUP_M // CHUNK):
            blocks = window + chunk * CHUNK
            same = gl.load(block_expert_ptr + blocks * BM // ALIGN_M, mask=blocks < num_m,
                           other=-2) == expert
            first_m = gl.minimum(first_m, gl.min(gl.where(same, blocks, num_m), axis=0))
            end_m = gl.maximum(end_m, gl.max(gl.where(same, blocks + 1, 0), axis=0))
        size = end_m - first_m
        in_group = tile - first_m * num_n
    else:
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size = gl.minimum(num_m - first_m, GROUP_M)
        in_group = tile % per_group
    return first_m + in_group % size, in_group // size


@gluon.jit
def _producer(descs, smem, ptrs, sizes, strides, GROUP_M: gl.constexpr,
              EXPERT_GROUPS: gl.constexpr,
              ALIGN_M: gl.constexpr, FORM: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_BIAS: gl.constexpr, COALESCED: gl.constexpr,
              BLOCK_SCALES: gl.constexpr, SKIP_PADDING: gl.constexpr,
              GATHER_TOP_K: gl.constexpr, GATHER_LAG: gl.constexpr):
    """Each K step's weight tile by TMA into the next free slot (one thread; the slot's ready
    barrier expects its bytes), and its activation tile: by TMA too (one warp), or with
    GATHER_TOP_K (a warpgroup, GATHER) its rows by cp.async from the token rows of a [T, K] (a
    padding slot's row zero-filled), a step's copies waited for GATHER_LAG steps later, fenced
    for the async proxy and arrived on its ready barrier (the second of its two arrivals), so
    the wgmmas never read a row before it has landed."""
    a_desc, w_desc = descs
    a_bufs, w_bufs, ready, empty, go = smem
    sorted_pair_ids_ptr = ptrs[4]
    block_expert_ptr = ptrs[5]
    num_padded_ptr = ptrs[6]
    N, K, num_pairs = sizes[0], sizes[1], sizes[2]
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    GATHER: gl.constexpr = GATHER_TOP_K > 0
    if GATHER:
        gl.static_assert(GATHER_LAG >= 1 and GATHER_LAG <= STAGES - 1)
        a_ptr = ptrs[8]
        stride_am = strides[5]
        # 16 bytes (e4m3 values) a thread a row, 8 threads a 128-column row, 16 rows a pass of
        # the warpgroup's 128 threads
        rows_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        rows_in = gl.arange(0, BM, layout=gl.SliceLayout(1, rows_l))
        cols_in = gl.arange(0, BK, layout=gl.SliceLayout(0, rows_l))
        expected: gl.constexpr = w_desc.block_type.nbytes
    else:
        expected: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    num_m = gl.load(num_padded_ptr) // BM
    num_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    index = 0
    phase = 1  # a fresh mbarrier counts as having completed the phase before its first
    late = 0   # GATHER: the slot of the oldest step whose rows are not yet arrived for
    issued = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M, EXPERT_GROUPS,
                                    block_expert_ptr, BM, ALIGN_M)
        expert = gl.load(block_expert_ptr + pid_m * BM // ALIGN_M)
        w_row = expert * N + pid_n * BN
        if GATHER:
            pair_ids = gl.load(sorted_pair_ids_ptr + pid_m * BM + rows_in)
            live = pair_ids < num_pairs
            tokens = gl.where(live, pair_ids // GATHER_TOP_K, 0)
            row_ptrs = a_ptr + tokens.to(gl.int64) * stride_am
        for kb in range(k_steps):
            mbarrier.wait(empty.index(index), phase)
            bar = ready.index(index)
            mbarrier.expect(bar, expected)
            if not GATHER:
                tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kb * BK], bar,
                                                a_bufs.index(index))
            tma.async_copy_global_to_shared(w_desc, [w_row, kb * BK], bar, w_bufs.index(index))
            if GATHER:
                async_copy.async_copy_global_to_shared(
                    a_bufs.index(index), row_ptrs[:, None] + (kb * BK + cols_in)[None, :],
                    mask=live[:, None])
                async_copy.commit_group()
            index, phase = ring_next(index, phase, STAGES)
            if GATHER:
                issued += 1
                if issued > GATHER_LAG:
                    async_copy.wait_group(GATHER_LAG)
                    # every thread's copies fenced before the one arrive that publishes them all
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(ready.index(late), count=1)
                    late = (late + 1) % STAGES
    if GATHER:
        # the last steps' rows
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        for i in range(gl.minimum(issued, GATHER_LAG)):
            mbarrier.arrive(ready.index(late), count=1)
            late = (late + 1) % STAGES


@gluon.jit
def _scale_rows(w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED: gl.constexpr):
    """fp8_block: the weight scale rows of the 128 columns from col0: with gate/up interleaved
    (2i, 2i+1), 64 gate rows of gate block col0 // 256 and 64 up rows of the matching up block,
    whose scale rows are interleaved the same way (a 256-column span shares them); otherwise one
    128-row block, and the next one's (the "wide" form's high half)."""
    if GATED:
        first = w_scale_ptr + expert * stride_wse + (2 * (col0 // 256)) * stride_wsn
    else:
        first = w_scale_ptr + expert * stride_wse + (col0 // 128) * stride_wsn
    return first, first + stride_wsn


@gluon.jit
def _step_scales(a_scale_rows, kb, w_scale_a, w_scale_b, TWO: gl.constexpr):
    """K step kb's row scales times its weight scales: (gate, up) or (low half, high half) with
    TWO, else one (returned twice)."""
    a_s = gl.load(a_scale_rows + kb)
    s_a = a_s * gl.load(w_scale_a + kb)
    if TWO:
        s_b = a_s * gl.load(w_scale_b + kb)
    else:
        s_b = s_a
    return s_a, s_b


@gluon.jit
def _promote(acc, part, s_a, s_b, GATED: gl.constexpr, SECOND: gl.constexpr):
    """fp8_block: a K step's partial product into the fp32 accumulator times the step's scales:
    gated, even columns are gate rows (s_a), odd ones up rows (s_b); otherwise s_a, or s_b for
    the "wide" form's high half (SECOND)."""
    if GATED:
        COLS: gl.constexpr = acc.type.shape[1]
        col_l: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
        cols_in = gl.arange(0, COLS, layout=col_l)
        scale = gl.where((cols_in % 2 == 0)[None, :], s_a[:, None], s_b[:, None])
        return acc + part * scale
    elif SECOND:
        return acc + part * s_b[:, None]
    else:
        return acc + part * s_a[:, None]


@gluon.jit
def _issue_pair(acc, a_bufs, w_bufs, ready, index, phase, FORM: gl.constexpr,
                ROW0: gl.constexpr, COL0: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """The wgmmas of two K steps (ring slots index and the next) chained into a new partial,
    issued and left running. Returns the partial, the two slots and the ring position after
    them."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    index1, phase1 = ring_next(index, phase, STAGES)
    mbarrier.wait(ready.index(index), phase)
    a0, w0 = _half_tiles(a_bufs, w_bufs, index, FORM, ROW0, COL0, ROWS, COLS)
    part = warpgroup_mma(a0, w0.permute((1, 0)), acc, use_acc=False, is_async=True)
    mbarrier.wait(ready.index(index1), phase1)
    a1, w1 = _half_tiles(a_bufs, w_bufs, index1, FORM, ROW0, COL0, ROWS, COLS)
    part = warpgroup_mma(a1, w1.permute((1, 0)), part, is_async=True)
    index2, phase2 = ring_next(index1, phase1, STAGES)
    return part, index, index1, index2, phase2


@gluon.jit
def _retire_pair(acc, part, slot0, slot1, empty, OUTSTANDING: gl.constexpr):
    """Wait until at most OUTSTANDING wgmmas run (the pair's two done), release its two slots,
    promote its partial."""
    part = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(part, ))
    mbarrier.arrive(empty.index(slot0), count=1)
    mbarrier.arrive(empty.index(slot1), count=1)
    return acc + part


@gluon.jit
def _pipelined_pairs(acc, a_bufs, w_bufs, ready, empty, index, phase, pairs,
                     FORM: gl.constexpr, ROW0: gl.constexpr, COL0: gl.constexpr,
                     ROWS: gl.constexpr, COLS: gl.constexpr):
    """`pairs` pairs of K steps, each issued before the one before it is waited for and
    promoted (PIPE_PAIRS): two partials in turn, A for the even pairs and B for the odd, so a
    running wgmma's registers are never copied (the loop carries A, running, as Triton's own
    pipelined dots carry their accumulator). The promotions in pair order, as the serial
    loop's. Returns the accumulator and the ring position after the pairs."""
    if pairs > 0:
        part_a, a0, a1, index, phase = _issue_pair(acc, a_bufs, w_bufs, ready, index, phase,
                                                   FORM, ROW0, COL0, ROWS, COLS)
        for q in range(1, pairs - 1, 2):
            part_b, b0, b1, index, phase = _issue_pair(acc, a_bufs, w_bufs, ready, index,
                                                       phase, FORM, ROW0, COL0, ROWS, COLS)
            acc = _retire_pair(acc, part_a, a0, a1, empty, 2)
            part_a, a0, a1, index, phase = _issue_pair(acc, a_bufs, w_bufs, ready, index,
                                                       phase, FORM, ROW0, COL0, ROWS, COLS)
            acc = _retire_pair(acc, part_b, b0, b1, empty, 2)
        if pairs % 2 == 0:
            # (the last pair, odd: issued before the one running is retired)
            part_b, b0, b1, index, phase = _issue_pair(acc, a_bufs, w_bufs, ready, index,
                                                       phase, FORM, ROW0, COL0, ROWS, COLS)
            acc = _retire_pair(acc, part_a, a0, a1, empty, 2)
            acc = _retire_pair(acc, part_b, b0, b1, empty, 0)
        else:
            acc = _retire_pair(acc, part_a, a0, a1, empty, 0)
    return acc, index, phase


@gluon.jit
def _half_tiles(a_bufs, w_bufs, index, FORM: gl.constexpr, ROW0: gl.constexpr,
                COL0: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Ring slot `index`'s operands of this warpgroup's half of the tile: its 128 weight rows
    ("cols") or its 64 activation rows (the other forms)."""
    a_tile = a_bufs.index(index)
    w_tile = w_bufs.index(index)
    if FORM == 1:
        w_tile = w_tile.slice(COL0, COLS, dim=0)
    else:
        a_tile = a_tile.slice(ROW0, ROWS, dim=0)
    return a_tile, w_tile


@gluon.jit
def _mma_steps(acc, a_bufs, w_bufs, ready, empty, index, phase, k_steps, a_scale_rows,
               w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED: gl.constexpr,
               BLOCK_SCALES: gl.constexpr, FORM: gl.constexpr, ROW0: gl.constexpr,
               COL0: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
               SCALES_AFTER_MMA: gl.constexpr, go, arrive_at, STAGGER: gl.constexpr,
               PAIRS: gl.constexpr, kb0=0, CARRIED: gl.constexpr = False):
    """A consumer's K loop over one tile, from step kb0 (CARRIED, OVERLAP: the steps before
    it were issued ahead, see _first_steps): each step waits for its ring slot, multiplies its
    half of the tile (use_acc False: the step's partial product alone), releases the slot and
    promotes the partial product into the fp32 accumulator (fp8_block: times the step's row and
    weight block scales). Returns the accumulator and the ring position after the tile.
    STAGGER: after step arrive_at's release (-1: none) the `go` barrier gets its arrive.
    PAIRS (fp8 per tensor, FP8_PROMOTE_STEPS 2): two steps' wgmmas chain into the partial, each
    slot released as its wgmma completes, then one promotion; an odd last step alone (kb0 is
    then even). PAIRS 2 (PIPE_PAIRS): the next pair issued into a second partial before the
    previous one's wait and promotion (_pipelined_pairs)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    w_scale_a, w_scale_b = _scale_rows(w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED)
    first = kb0
    if PAIRS:
        gl.static_assert(BLOCK_SCALES == 0 and STAGGER == 0)
        first = k_steps - k_steps % 2
        if CARRIED:
            # (a one-step tile's step 0 was issued ahead: no pair, and no single step again)
            first = gl.maximum(first, kb0)
    if PAIRS == 2:
        acc, index, phase = _pipelined_pairs(acc, a_bufs, w_bufs, ready, empty, index, phase,
                                             (first - kb0) // 2, FORM, ROW0, COL0, ROWS, COLS)
    elif PAIRS:
        for kp in range(kb0, first, 2):
            part, slot0, slot1, index, phase = _issue_pair(acc, a_bufs, w_bufs, ready, index,
                                                           phase, FORM, ROW0, COL0, ROWS, COLS)
            part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
            mbarrier.arrive(empty.index(slot0), count=1)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(slot1), count=1)
            acc += part
    for kb in range(first, k_steps):
        if BLOCK_SCALES and not SCALES_AFTER_MMA:
            s_a, s_b = _step_scales(a_scale_rows, kb, w_scale_a, w_scale_b, GATED)
        mbarrier.wait(ready.index(index), phase)
        a_tile, w_tile = _half_tiles(a_bufs, w_bufs, index, FORM, ROW0, COL0, ROWS, COLS)
        part = warpgroup_mma(a_tile, w_tile.permute((1, 0)), acc, use_acc=False,
                             is_async=True)
        # SCALES_AFTER_MMA: the step's scales are loaded while its MMAs run. (Loaded before
        # them, ptxas puts their products between the step's first and second wgmma, whose
        # issue then waits for the loads.)
        if BLOCK_SCALES and SCALES_AFTER_MMA:
            s_a, s_b = _step_scales(a_scale_rows, kb, w_scale_a, w_scale_b, GATED)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        mbarrier.arrive(empty.index(index), count=1)
        if STAGGER > 0:
            if kb == arrive_at:
                mbarrier.arrive(go, count=1)
        if BLOCK_SCALES:
            acc = _promote(acc, part, s_a, s_b, GATED, False)
        else:
            # fp8 per tensor: the partial sum still joins an fp32 accumulator every K step
            # (Hopper's fp8 MMA accumulates with few bits); the scales wait for the epilogue
            acc += part
        index, phase = ring_next(index, phase, STAGES)
    if STAGGER > 0:
        if arrive_at >= k_steps:    # fewer steps in the tile than the stagger
            mbarrier.arrive(go, count=1)
    return acc, index, phase


@gluon.jit
def _tile_rows(tile, num_m, num_n, ptrs, num_pairs, stride_as, BM: gl.constexpr,
               BN: gl.constexpr, GROUP_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr,
               ALIGN_M: gl.constexpr,
               ROW0: gl.constexpr, COL0: gl.constexpr, ROWS: gl.constexpr, row_l: gl.constexpr,
               GATHER_TOP_K: gl.constexpr):
    """A tile's expert, this warpgroup's slots (along the MMA's rows), its first output column,
    its rows' activation scale pointers (GATHER: the tokens', a padding slot token 0's) and its
    first slot."""
    (a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr,
     num_padded_ptr, topk_weights_ptr, a_ptr) = ptrs
    pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M, EXPERT_GROUPS, block_expert_ptr,
                                BM, ALIGN_M)
    expert = gl.load(block_expert_ptr + pid_m * BM // ALIGN_M)
    slots = pid_m * BM + ROW0 + gl.arange(0, ROWS, layout=row_l)
    col0 = pid_n * BN + COL0          # first weight row (output column) of this half
    if GATHER_TOP_K > 0:
        slot_pairs = gl.load(sorted_pair_ids_ptr + slots)
        a_scale_rows = a_scale_ptr + gl.where(slot_pairs < num_pairs,
                                              slot_pairs // GATHER_TOP_K, 0) * stride_as
    else:
        a_scale_rows = a_scale_ptr + slots * stride_as
    return expert, slots, col0, a_scale_rows, pid_m * BM + ROW0


@gluon.jit
def _first_steps(template, a_bufs, w_bufs, ready, index, phase, k_steps, a_scale_rows,
                 w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED: gl.constexpr,
                 BLOCK_SCALES: gl.constexpr, FORM: gl.constexpr, ROW0: gl.constexpr,
                 COL0: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                 PAIRS: gl.constexpr):
    """OVERLAP: a tile's first K step (its first two with PAIRS, where the tile has two) issued
    as asynchronous wgmmas into a fresh partial, not waited for: the caller runs the previous
    tile's epilogue while they run, then _first_done. Returns the partial, the slots it holds
    (the second -1 when one step), the ring position after them, the next step's number and
    fp8_block's step scales."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    first_index = index
    mbarrier.wait(ready.index(index), phase)
    a0, w0 = _half_tiles(a_bufs, w_bufs, index, FORM, ROW0, COL0, ROWS, COLS)
    part = warpgroup_mma(a0, w0.permute((1, 0)), template, use_acc=False, is_async=True)
    index, phase = ring_next(index, phase, STAGES)
    second_index = -1
    kb0 = 1
    if PAIRS:
        if k_steps >= 2:
            second_index = index
            mbarrier.wait(ready.index(index), phase)
            a1, w1 = _half_tiles(a_bufs, w_bufs, index, FORM, ROW0, COL0, ROWS, COLS)
            part = warpgroup_mma(a1, w1.permute((1, 0)), part, is_async=True)
            index, phase = ring_next(index, phase, STAGES)
            kb0 = 2
    row_l: gl.constexpr = a_scale_rows.type.layout
    s_a = gl.zeros([ROWS], gl.float32, row_l)
    s_b = s_a
    if BLOCK_SCALES:
        w_scale_a, w_scale_b = _scale_rows(w_scale_ptr, expert, col0, stride_wse, stride_wsn,
                                           GATED)
        s_a, s_b = _step_scales(a_scale_rows, 0, w_scale_a, w_scale_b, GATED)
    return part, first_index, second_index, index, phase, kb0, s_a, s_b


@gluon.jit
def _first_done(part, empty, first_index, second_index, s_a, s_b, GATED: gl.constexpr,
                BLOCK_SCALES: gl.constexpr):
    """OVERLAP: waits for _first_steps' wgmmas, releases their slots and returns the tile's
    accumulator so far (fp8_block: the step's partial times its scales)."""
    part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
    mbarrier.arrive(empty.index(first_index), count=1)
    if second_index >= 0:
        mbarrier.arrive(empty.index(second_index), count=1)
    if BLOCK_SCALES:
        part = _promote(gl.zeros_like(part), part, s_a, s_b, GATED, False)
    return part


@gluon.jit
def _overlapped_tiles(smem, ptrs, sizes, strides, grid, GROUP_M: gl.constexpr,
                      EXPERT_GROUPS: gl.constexpr,
                      ALIGN_M: gl.constexpr, FORM: gl.constexpr, ACTIVATION: gl.constexpr,
                      HAS_BIAS: gl.constexpr, COALESCED: gl.constexpr,
                      BLOCK_SCALES: gl.constexpr, SCALES_AFTER_MMA: gl.constexpr,
                      EARLY: gl.constexpr, PAIRS: gl.constexpr, ATOMIC_TOP_K: gl.constexpr,
                      GATHER_TOP_K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      ROW0: gl.constexpr, COL0: gl.constexpr, ROWS: gl.constexpr,
                      COLS: gl.constexpr, MMA: gl.constexpr, NATIVE_CAST: gl.constexpr,
                      FAST_SIGMOID: gl.constexpr):
    """The consumer's tiles with OVERLAP: each tile's first step(s) are issued before the
    previous tile's epilogue, which then runs beside them (and beside the other warpgroup's
    MMAs) instead of leaving the tensor cores to the other warpgroup alone; the last tile's
    epilogue after the loop. The ring is taken in the same order as without it."""
    a_bufs, w_bufs, ready, empty, go = smem
    (a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr,
     num_padded_ptr, topk_weights_ptr, a_ptr) = ptrs
    num_pairs = sizes[2]
    stride_as, stride_wse, stride_wsn = strides[0], strides[1], strides[2]
    num_m, num_n, k_steps = grid
    GATED: gl.constexpr = ACTIVATION >= 1 and ACTIVATION <= 3
    row_l: gl.constexpr = gl.SliceLayout(1, MMA)
    first_tile = gl.program_id(0)
    index = 0
    phase = 0
    # the previous tile: its accumulator and what its epilogue needs
    acc_prev = gl.zeros([ROWS, COLS], gl.float32, MMA)
    slots_prev = gl.arange(0, ROWS, layout=row_l)
    a_scale_rows_prev = a_scale_ptr + slots_prev * stride_as
    expert_prev = 0
    col0_prev = 0
    # EARLY: the previous tile's epilogue operands (_epilogue_terms), carried one by one
    pair_ids_prev = slots_prev
    row_ok_prev = slots_prev < 0
    weights_prev = gl.zeros([ROWS], gl.float32, row_l)
    row_scales_prev = weights_prev
    for tile in range(first_tile, num_m * num_n, gl.num_programs(0)):
        expert, slots, col0, a_scale_rows, _ = _tile_rows(
            tile, num_m, num_n, ptrs, num_pairs, stride_as, BM, BN, GROUP_M, EXPERT_GROUPS,
            ALIGN_M, ROW0, COL0, ROWS, row_l, GATHER_TOP_K)
        if EARLY:
            pair_ids, row_ok, weights, row_scales = _epilogue_terms(
                slots, a_scale_rows, sorted_pair_ids_ptr, topk_weights_ptr, num_pairs,
                ACTIVATION, BLOCK_SCALES)
            terms_prev = (pair_ids_prev, row_ok_prev, weights_prev, row_scales_prev)
        else:
            terms_prev: gl.constexpr = None
        part, first_index, second_index, index, phase, kb0, s_a, s_b = _first_steps(
            acc_prev, a_bufs, w_bufs, ready, index, phase, k_steps, a_scale_rows, w_scale_ptr,
            expert, col0, stride_wse, stride_wsn, GATED, BLOCK_SCALES, FORM, ROW0, COL0, ROWS,
            COLS, PAIRS)
        if tile != first_tile:
            _epilogue(acc_prev, slots_prev, col0_prev, expert_prev, a_scale_rows_prev, ptrs,
                      sizes, strides, ACTIVATION, HAS_BIAS, COALESCED, BLOCK_SCALES,
                      terms_prev, EARLY, ATOMIC_TOP_K, NATIVE_CAST, FAST_SIGMOID)
        acc = _first_done(part, empty, first_index, second_index, s_a, s_b, GATED,
                          BLOCK_SCALES)
        acc, index, phase = _mma_steps(
            acc, a_bufs, w_bufs, ready, empty, index, phase, k_steps, a_scale_rows,
            w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED, BLOCK_SCALES, FORM, ROW0,
            COL0, ROWS, COLS, SCALES_AFTER_MMA, go, -1, 0, PAIRS, kb0, True)
        acc_prev = acc
        slots_prev = slots
        a_scale_rows_prev = a_scale_rows
        expert_prev = expert
        col0_prev = col0
        if EARLY:
            pair_ids_prev = pair_ids
            row_ok_prev = row_ok
            weights_prev = weights
            row_scales_prev = row_scales
    if EARLY:
        terms_prev = (pair_ids_prev, row_ok_prev, weights_prev, row_scales_prev)
    else:
        terms_prev: gl.constexpr = None
    if first_tile < num_m * num_n:
        _epilogue(acc_prev, slots_prev, col0_prev, expert_prev, a_scale_rows_prev, ptrs, sizes,
                  strides, ACTIVATION, HAS_BIAS, COALESCED, BLOCK_SCALES, terms_prev, EARLY,
                  ATOMIC_TOP_K, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _consumer(descs, smem, ptrs, sizes, strides, GROUP_M: gl.constexpr,
              EXPERT_GROUPS: gl.constexpr,
              ALIGN_M: gl.constexpr, FORM: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_BIAS: gl.constexpr, COALESCED: gl.constexpr,
              BLOCK_SCALES: gl.constexpr, SKIP_PADDING: gl.constexpr,
              SCALES_AFTER_MMA: gl.constexpr, STAGGER: gl.constexpr, EARLY: gl.constexpr,
              PAIRS: gl.constexpr, ATOMIC_TOP_K: gl.constexpr, GATHER_TOP_K: gl.constexpr,
              HALF: gl.constexpr, OVERLAP: gl.constexpr, NATIVE_CAST: gl.constexpr,
              FAST_SIGMOID: gl.constexpr):
    """A consumer warpgroup (HALF 0 or 1 of each tile): its tiles one after another, or with
    OVERLAP each tile's first steps issued before the previous one's epilogue."""
    a_desc, w_desc = descs
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    # (the live row blocks, the column blocks, the K steps)
    grid = (gl.load(ptrs[6]) // BM, gl.cdiv(sizes[0], BN), gl.cdiv(sizes[1], BK))
    ROWS: gl.constexpr = 64
    COLS: gl.constexpr = 128
    # this warpgroup's share of the tile (FORM 0 "rows" and 2 "wide": its 64 rows; 1 "cols": its
    # 128 columns; "wide" takes both 128-column halves of its rows in turn)
    ROW0: gl.constexpr = HALF * ROWS * (1 - FORM % 2)
    COL0: gl.constexpr = HALF * COLS * (FORM % 2)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, COLS, 32])
    if OVERLAP:
        gl.static_assert(FORM != 2 and STAGGER == 0 and SKIP_PADDING == 0)
        _overlapped_tiles(smem, ptrs, sizes, strides, grid, GROUP_M, EXPERT_GROUPS, ALIGN_M,
                          FORM, ACTIVATION, HAS_BIAS, COALESCED, BLOCK_SCALES, SCALES_AFTER_MMA,
                          EARLY, PAIRS, ATOMIC_TOP_K, GATHER_TOP_K, BM, BN, ROW0, COL0, ROWS,
                          COLS, MMA, NATIVE_CAST, FAST_SIGMOID)
    else:
        _serial_tiles(smem, ptrs, sizes, strides, grid, GROUP_M, EXPERT_GROUPS, ALIGN_M, FORM,
                      ACTIVATION,
                      HAS_BIAS, COALESCED, BLOCK_SCALES, SKIP_PADDING, SCALES_AFTER_MMA,
                      STAGGER, EARLY, PAIRS, ATOMIC_TOP_K, GATHER_TOP_K, HALF, BM, BN, ROW0,
                      COL0, ROWS, COLS, MMA, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _serial_tiles(smem, ptrs, sizes, strides, grid, GROUP_M: gl.constexpr,
                  EXPERT_GROUPS: gl.constexpr,
                  ALIGN_M: gl.constexpr, FORM: gl.constexpr, ACTIVATION: gl.constexpr,
                  HAS_BIAS: gl.constexpr, COALESCED: gl.constexpr,
                  BLOCK_SCALES: gl.constexpr, SKIP_PADDING: gl.constexpr,
                  SCALES_AFTER_MMA: gl.constexpr, STAGGER: gl.constexpr, EARLY: gl.constexpr,
                  PAIRS: gl.constexpr, ATOMIC_TOP_K: gl.constexpr, GATHER_TOP_K: gl.constexpr,
                  HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, ROW0: gl.constexpr,
                  COL0: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                  MMA: gl.constexpr, NATIVE_CAST: gl.constexpr,
                  FAST_SIGMOID: gl.constexpr):
    """The consumer's tiles one after another: K loop, then epilogue."""
    a_bufs, w_bufs, ready, empty, go = smem
    (a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr,
     num_padded_ptr, topk_weights_ptr, a_ptr) = ptrs
    num_pairs = sizes[2]
    stride_as, stride_wse, stride_wsn = strides[0], strides[1], strides[2]
    num_m, num_n, k_steps = grid
    # ACTIVATION is an index into ACTIVATIONS (a string cannot ride in warp_specialize's
    # argument tuples): 0 none, 1 swiglu, 2 geglu, 3 swiglu_oai, 4 relu2
    GATED: gl.constexpr = ACTIVATION >= 1 and ACTIVATION <= 3
    row_l: gl.constexpr = gl.SliceLayout(1, MMA)
    index = 0
    phase = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        # STAGGER: consumer 0 signals `go` after its first tile's step STAGGER - 1, consumer 1
        # waits for it before its first tile (its other arguments: no signal)
        arrive_at = -1
        if STAGGER > 0:
            if tile == gl.program_id(0):
                if HALF == 0:
                    arrive_at = STAGGER - 1
                else:
                    mbarrier.wait(go, 0)
        expert, slots, col0, a_scale_rows, first_slot = _tile_rows(
            tile, num_m, num_n, ptrs, num_pairs, stride_as, BM, BN, GROUP_M, EXPERT_GROUPS,
            ALIGN_M, ROW0, COL0, ROWS, row_l, GATHER_TOP_K)
        if EARLY:
            # (see EARLY_EPILOGUE: issued now, used after the K loop)
            terms = _epilogue_terms(slots, a_scale_rows, sorted_pair_ids_ptr, topk_weights_ptr,
                                    num_pairs, ACTIVATION, BLOCK_SCALES)
        else:
            terms: gl.constexpr = None
        live = True     # (a tensor to Triton, but folded: no branch is left without the skip)
        if SKIP_PADDING:
            # A warpgroup whose 64 rows are all padding (its first slot holds no pair: each
            # expert's padding comes after its pairs) issues no MMAs: the other's run alone,
            # and the 128-row tiles waste half as much on padding (SKIP_PADDING 0: compute
            # them anyway). The test is made once a tile, so the K loop of a live half is the
            # loop without it.
            live = gl.load(sorted_pair_ids_ptr + first_slot) < num_pairs
        if FORM == 2:
            acc = gl.zeros([ROWS, COLS], gl.float32, MMA)
            acc_hi = gl.zeros([ROWS, COLS], gl.float32, MMA)
            if live:
                acc, acc_hi, index, phase = _mma_steps_wide(
                    acc, acc_hi, a_bufs, w_bufs, ready, empty, index, phase, k_steps,
                    a_scale_rows, w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED,
                    BLOCK_SCALES, ROW0, ROWS, COLS)
            else:
                index, phase = release_steps(ready, empty, index, phase, k_steps)
            _epilogue(acc, slots, col0, expert, a_scale_rows, ptrs, sizes, strides,
                      ACTIVATION, HAS_BIAS, COALESCED, BLOCK_SCALES, terms, EARLY, ATOMIC_TOP_K,
                      NATIVE_CAST, FAST_SIGMOID)
            _epilogue(acc_hi, slots, col0 + COLS, expert, a_scale_rows, ptrs, sizes, strides,
                      ACTIVATION, HAS_BIAS, COALESCED, BLOCK_SCALES, terms, EARLY, ATOMIC_TOP_K,
                      NATIVE_CAST, FAST_SIGMOID)
        else:
            acc = gl.zeros([ROWS, COLS], gl.float32, MMA)
            if live:
                acc, index, phase = _mma_steps(
                    acc, a_bufs, w_bufs, ready, empty, index, phase, k_steps, a_scale_rows,
                    w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED, BLOCK_SCALES,
                    FORM, ROW0, COL0, ROWS, COLS, SCALES_AFTER_MMA, go, arrive_at, STAGGER,
                    PAIRS)
            else:
                index, phase = release_steps(ready, empty, index, phase, k_steps)
            _epilogue(acc, slots, col0, expert, a_scale_rows, ptrs, sizes, strides,
                      ACTIVATION, HAS_BIAS, COALESCED, BLOCK_SCALES, terms, EARLY, ATOMIC_TOP_K,
                      NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def release_steps(ready, empty, index, phase, k_steps):
    """A warpgroup with nothing to compute in a tile (its rows all padding) still takes part in
    the ring: each slot's loads are waited for before it is released (an early arrive would
    count toward the slot's current phase and free it under the other warpgroup)."""
    STAGES: gl.constexpr = ready.type.shape[0]
    for kb in range(k_steps):
        mbarrier.wait(ready.index(index), phase)
        mbarrier.arrive(empty.index(index), count=1)
        index, phase = ring_next(index, phase, STAGES)
    return index, phase


@gluon.jit
def _epilogue_terms(slots, a_scale_rows, sorted_pair_ids_ptr, topk_weights_ptr, num_pairs,
                    ACTIVATION: gl.constexpr, BLOCK_SCALES: gl.constexpr):
    """The slots' epilogue operands (EARLY_EPILOGUE): pair ids, whether each is a routed pair,
    GEMM2's routing weights (0 for padding; GEMM1: unused) and fp8 per tensor's row scales
    (fp8_block: unused), along the rows' layout."""
    layout: gl.constexpr = slots.type.layout
    ROWS: gl.constexpr = slots.shape[0]
    pair_ids = gl.load(sorted_pair_ids_ptr + slots)
    row_ok = pair_ids < num_pairs
    weights = gl.zeros([ROWS], gl.float32, layout)
    if ACTIVATION == 0:
        weights = gl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)
    row_scales = gl.zeros([ROWS], gl.float32, layout)
    if not BLOCK_SCALES:
        row_scales = gl.load(a_scale_rows)
    return pair_ids, row_ok, weights, row_scales


@gluon.jit
def _epilogue(acc, slots, col0, expert, a_scale_rows, ptrs, sizes, strides,
              ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, COALESCED: gl.constexpr,
              BLOCK_SCALES: gl.constexpr, terms, EARLY: gl.constexpr,
              ATOMIC_TOP_K: gl.constexpr, NATIVE_CAST: gl.constexpr = False,
              FAST_SIGMOID: gl.constexpr = False):
    """A warpgroup's finished [64, 128] share of a tile at output column col0: fp8 per tensor's
    row and column scales, the bias, then GEMM1's activation into intermediate[slot] or GEMM2's
    routing weight into out[pair]; padding slots (pair id >= num_pairs) are not written.
    EARLY: the slots' operands are `terms` (_epilogue_terms, loaded before the K loop).
    ATOMIC_TOP_K > 0 (GEMM2, ATOMIC): added in float32 into out[pair // top_k], a token's row."""
    (a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr,
     num_padded_ptr, topk_weights_ptr, a_ptr) = ptrs
    N, K, num_pairs, alpha, limit = sizes
    stride_as, stride_wse, stride_wsn, stride_be, stride_om, stride_am = strides
    COLS: gl.constexpr = acc.type.shape[1]
    col_l: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
    if EARLY:
        pair_ids, row_ok, weights, row_scales = terms
    else:
        pair_ids = gl.load(sorted_pair_ids_ptr + slots)
        row_ok = pair_ids < num_pairs
    cols = col0 + gl.arange(0, COLS, layout=col_l)
    if not BLOCK_SCALES:
        # fp8 per tensor: one scale per token row and one per weight row (output column)
        if not EARLY:
            row_scales = gl.load(a_scale_rows)
        acc = (acc * row_scales[:, None]
               * gl.load(w_scale_ptr + expert * stride_wse + cols * stride_wsn)[None, :])
    if HAS_BIAS:
        acc += gl.load(bias_ptr + expert * stride_be + cols)[None, :]
    if ATOMIC_TOP_K > 0:
        if not EARLY:
            weights = gl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)
        _store_rows(out_ptr, acc * weights[:, None], (pair_ids // ATOMIC_TOP_K).to(gl.int64),
                    row_ok, col0, stride_om, COALESCED, True)
    elif EARLY and ACTIVATION == 0:
        # (the same float32 operations as write_rows', the weights already loaded)
        _store_rows(out_ptr, to_out(acc * weights[:, None], out_ptr.dtype.element_ty,
                                    NATIVE_CAST),
                    pair_ids.to(gl.int64), row_ok, col0, stride_om, COALESCED)
    else:
        write_rows(acc, slots, pair_ids, row_ok, col0, topk_weights_ptr, out_ptr, stride_om,
                   alpha, limit, ACTIVATION, COALESCED, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _mma_steps_wide(acc, acc_hi, a_bufs, w_bufs, ready, empty, index, phase, k_steps,
                    a_scale_rows, w_scale_ptr, expert, col0, stride_wse, stride_wsn,
                    GATED: gl.constexpr, BLOCK_SCALES: gl.constexpr, ROW0: gl.constexpr,
                    ROWS: gl.constexpr, COLS: gl.constexpr):
    """_mma_steps for the "wide" form: each K step multiplies this warpgroup's 64 rows by both
    128-column halves of the slot's 256 weight rows in turn into one partial, promoted into
    acc (columns col0..) and acc_hi (col0 + 128..) before the next (two partials would not fit
    the registers). The slot is released after the second. (No PAIRS form: two steps' halves
    chained, both slots held, spill its swiglu build's K loop: 86 local accesses a step.)"""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    # gated: both halves of a 256-column span share the gate and up scale rows; otherwise the
    # low half's block and the high half's
    w_scale_a, w_scale_b = _scale_rows(w_scale_ptr, expert, col0, stride_wse, stride_wsn, GATED)
    for kb in range(k_steps):
        mbarrier.wait(ready.index(index), phase)
        a_tile = a_bufs.index(index).slice(ROW0, ROWS, dim=0)
        w_tile = w_bufs.index(index)
        # the step's scales: GEMM2 (not gated) after the first wgmma's issue, the measured
        # form; gated GEMM1 before it, where ptxas then keeps the three tiles in registers
        # but for one exchanged around the issue (after it: 36 local accesses a step)
        if BLOCK_SCALES and GATED:
            s_a, s_b = _step_scales(a_scale_rows, kb, w_scale_a, w_scale_b, True)
        part = warpgroup_mma(a_tile, w_tile.slice(0, COLS, dim=0).permute((1, 0)), acc,
                             use_acc=False, is_async=True)
        if BLOCK_SCALES and not GATED:
            s_a, s_b = _step_scales(a_scale_rows, kb, w_scale_a, w_scale_b, True)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        if BLOCK_SCALES:
            acc = _promote(acc, part, s_a, s_b, GATED, False)
        else:
            acc += part
        part = warpgroup_mma(a_tile, w_tile.slice(COLS, COLS, dim=0).permute((1, 0)), acc_hi,
                             use_acc=False, is_async=True)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        mbarrier.arrive(empty.index(index), count=1)
        if BLOCK_SCALES:
            acc_hi = _promote(acc_hi, part, s_a, s_b, GATED, True)
        else:
            acc_hi += part
        index, phase = ring_next(index, phase, STAGES)
    return acc, acc_hi, index, phase


@gluon.jit
def to_out(values, out_ty: gl.constexpr, NATIVE_CAST: gl.constexpr):
    """float32 -> the output dtype, rounding to nearest even: NATIVE_CAST, the GPU's own
    conversion (cvt.rn: one instruction for two values); otherwise common.round_to_dtype,
    which rounds onto the target grid in float32 first (a workaround for the Triton
    interpreter's truncating casts, which this Gluon kernel never runs on: ~12 instructions a
    value). The two agree for every finite value below 2^112 (beyond it round_to_dtype rounds
    twice), but for the sign of an exact zero (round_to_dtype writes -0.0 as +0.0)."""
    if NATIVE_CAST:
        return values.to(out_ty)
    else:
        return round_to_dtype(values, out_ty)


@gluon.jit
def fast_sigmoid(x):
    """sigmoid(x) as (1 + tanh(x / 2)) / 2 on tanh.approx.f32 (FAST_SIGMOID): one MUFU op."""
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5],
                                  dtype=gl.float32, is_pure=True, pack=1)
    return 0.5 + 0.5 * t


@gluon.jit
def write_rows(values, slots, pair_ids, row_ok, first_col, topk_weights_ptr, out_ptr, stride_om,
               alpha, limit, ACTIVATION: gl.constexpr, COALESCED: gl.constexpr,
               NATIVE_CAST: gl.constexpr = False, FAST_SIGMOID: gl.constexpr = False):
    """A finished tile [slots, C] (fp32, scales and bias applied; slots, pair_ids, row_ok along
    its rows) -> GEMM2 (ACTIVATION 0): times each pair's routing weight into out[pair]; GEMM1:
    act(gate, up) of the interleaved gate/up columns (or relu2 of all) into out[slot], from
    column first_col (halved when gated). Rows with row_ok False are not written. NATIVE_CAST:
    see to_out; FAST_SIGMOID: swiglu's and swiglu_oai's sigmoid on tanh.approx (FAST_SIGMOID)."""
    out_ty: gl.constexpr = out_ptr.dtype.element_ty
    if ACTIVATION == 0:
        values = values * gl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)[:, None]
        _store_rows(out_ptr, to_out(values, out_ty, NATIVE_CAST), pair_ids.to(gl.int64),
                    row_ok, first_col, stride_om, COALESCED)
    else:
        C: gl.constexpr = values.type.shape[1]
        if ACTIVATION >= 1 and ACTIVATION <= 3:
            gate, up = gl.split(gl.reshape(values, [values.type.shape[0], C // 2, 2]))
            if ACTIVATION == 1:
                if FAST_SIGMOID:
                    h = gate * fast_sigmoid(gate) * up
                else:
                    h = apply_activation(gate, up, alpha, limit, "swiglu")
            elif ACTIVATION == 2:
                h = apply_activation(gate, up, alpha, limit, "geglu")
            else:
                if FAST_SIGMOID:
                    # (common.apply_activation's swiglu_oai with this sigmoid)
                    g = gl.minimum(gate, limit)
                    u = gl.minimum(gl.maximum(up, -limit), limit)
                    h = (u + 1.0) * g * fast_sigmoid(alpha * g)
                else:
                    h = apply_activation(gate, up, alpha, limit, "swiglu_oai")
        else:
            h = apply_activation(values, values, alpha, limit, "relu2")
        H_COLS: gl.constexpr = h.type.shape[1]
        _store_rows(out_ptr, to_out(h, out_ty, NATIVE_CAST), slots.to(gl.int64), row_ok,
                    first_col // (C // H_COLS), stride_om, COALESCED)


@gluon.jit
def _store_rows(out_ptr, values, rows, row_ok, first_col, stride_om, COALESCED: gl.constexpr,
                ADD: gl.constexpr = False):
    """out[rows[i], first_col:first_col + C] = values[i] where row_ok[i]; ADD: += instead, as
    float32 atomic adds whose value is not returned (reductions at the L2), from the MMA's
    layout (2 columns a thread: 8-byte vector atomics; a float32 tile staged through shared
    memory would not fit beside the "wide" form's ring or a 6-slot "rows" ring). COALESCED
    (stores): through a layout where each thread holds 8 consecutive columns of a row (16-byte
    stores, a warp writing whole rows' segments; the conversion goes through shared memory),
    not the MMA's (2 columns a thread, 8 rows a warp store)."""
    C: gl.constexpr = values.type.shape[1]
    if COALESCED and not ADD:
        values = gl.convert_layout(
            values, gl.BlockedLayout([1, 8], [32 // (C // 8), C // 8], [4, 1], [1, 0]))
    layout: gl.constexpr = values.type.layout
    rows = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    row_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, layout))
    cols = first_col + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if ADD:
        gl.atomic_add(ptrs, values, mask=row_ok[:, None], sem="relaxed")
    else:
        gl.store(ptrs, values, mask=row_ok[:, None])


@gluon.jit
def _ws_fp8_block_kernel(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr,
    block_expert_ptr, num_padded_ptr, topk_weights_ptr, a_ptr,
    N, K, num_pairs, stride_as, stride_wse, stride_wsn, stride_be, stride_om, stride_am, alpha,
    limit,
    ALIGN_M: gl.constexpr, GROUP_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr,
    STAGES: gl.constexpr, FORM: gl.constexpr,
    ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, COALESCED: gl.constexpr,
    BLOCK_SCALES: gl.constexpr, SKIP_PADDING: gl.constexpr, SCALES_AFTER_MMA: gl.constexpr,
    STAGGER: gl.constexpr, EARLY: gl.constexpr, PAIRS: gl.constexpr,
    ATOMIC_TOP_K: gl.constexpr = 0, GATHER_TOP_K: gl.constexpr = 0, GATHER_LAG: gl.constexpr = 2,
    OVERLAP: gl.constexpr = 0, NATIVE_CAST: gl.constexpr = 0, FAST_SIGMOID: gl.constexpr = 0,
):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    ready, empty = ring_barriers(STAGES, 2, 2 if GATHER_TOP_K > 0 else 1)
    # (a skipped half would never arrive on `go`, and the wide K loop has no arrive: the host
    # never builds those with a stagger, see stagger_steps)
    gl.static_assert(STAGGER == 0 or (SKIP_PADDING == 0 and FORM != 2))
    # (see gather_lag)
    gl.static_assert(GATHER_TOP_K == 0 or (GATHER_LAG >= 1 and GATHER_LAG + PAIRS < STAGES
                                           and GATHER_LAG + STAGGER <= STAGES))
    # (PAIRS 2, pipelined pairs: see PIPE_PAIRS)
    gl.static_assert(PAIRS < 2 or (GATHER_TOP_K == 0 and OVERLAP == 0 and STAGES >= 4))
    if STAGGER > 0:
        go = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(go, count=1)
    else:
        go = ready      # (unused)
    descs = (a_desc, w_desc)
    smem = (a_bufs, w_bufs, ready, empty, go)
    # (a_ptr: GATHER's token rows [T, K]; otherwise a_desc's rows, unused)
    ptrs = (a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr,
            num_padded_ptr, topk_weights_ptr, a_ptr)
    sizes = (N, K, num_pairs, alpha, limit)
    strides = (stride_as, stride_wse, stride_wsn, stride_be, stride_om, stride_am)
    # (the constexprs are spelled out in each tuple: a tuple held in a variable would turn them
    # into tensors)
    gl.warp_specialize([
        (_consumer, (descs, smem, ptrs, sizes, strides, GROUP_M, EXPERT_GROUPS, ALIGN_M, FORM,
                     ACTIVATION,
                     HAS_BIAS, COALESCED, BLOCK_SCALES, SKIP_PADDING, SCALES_AFTER_MMA,
                     STAGGER, EARLY, PAIRS, ATOMIC_TOP_K, GATHER_TOP_K, 0, OVERLAP,
                     NATIVE_CAST, FAST_SIGMOID)),
        (_consumer, (descs, smem, ptrs, sizes, strides, GROUP_M, EXPERT_GROUPS, ALIGN_M, FORM,
                     ACTIVATION,
                     HAS_BIAS, COALESCED, BLOCK_SCALES, SKIP_PADDING, SCALES_AFTER_MMA,
                     STAGGER, EARLY, PAIRS, ATOMIC_TOP_K, GATHER_TOP_K, 1, OVERLAP,
                     NATIVE_CAST, FAST_SIGMOID)),
        (_producer, (descs, smem, ptrs, sizes, strides, GROUP_M, EXPERT_GROUPS, ALIGN_M, FORM,
                     ACTIVATION,
                     HAS_BIAS, COALESCED, BLOCK_SCALES, SKIP_PADDING, GATHER_TOP_K, GATHER_LAG)),
    ], [4, GATHER_WARPS if GATHER_TOP_K > 0 else 1], [CONSUMER_REGS, PRODUCER_REGS])


def available(device: torch.device) -> bool:
    """Gluon's wgmma path: sm_90 (Hopper) only; off with MOE_OPS_WS_GEMM=0."""
    if not ENABLED or device.type != "cuda":
        return False
    props = device_properties(device)
    return (props.major, props.minor) == (9, 0)


def applies(quant: str, activation: str, n: int, k: int, a: torch.Tensor, w: torch.Tensor,
            tile: str, activations_quantized: bool = True, has_bias: bool = False) -> bool:
    """Whether this kernel can run a launch: fp8_block or fp8 (per tensor) on a Hopper GPU,
    whole tiles of N (for fp8_block each warpgroup's 128 columns one scale block) and whole
    128-column steps of K, e4m3 weights contiguous (one TMA descriptor over [E * N, K]). `a`:
    the activation rows, e4m3 in dispatch order (activations_quantized=False: the 16-bit rows
    they will be quantized from; the quantized copies are contiguous, [rows, K],
    TMA-addressable when K is a multiple of 16)."""
    bm, bn = TILES[tile]
    if activations_quantized and (a.dtype != torch.float8_e4m3fn or a.stride(-1) != 1
                                  or (a.stride(0) * a.element_size()) % 16
                                  or a.data_ptr() % 16):
        return False
    return (quant in QUANTS and activation in ACTIVATIONS and available(a.device)
            and (tile != "wide" or wide_admits(quant, activation, has_bias))
            and n % bn == 0 and k % FP8_BLOCK == 0 and w.is_contiguous()
            and w.data_ptr() % 16 == 0 and w.dtype == torch.float8_e4m3fn)


def block_m(tile: str) -> int:
    """Rows of a tile: the dispatch must align each expert's rows to a multiple of it."""
    return TILES[tile][0]


def _descriptors(a: torch.Tensor, w: torch.Tensor, tile: str):
    bm, bn = TILES[tile]
    E, N, K = w.shape
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, FP8_BLOCK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, FP8_BLOCK], gl.float8e4nv)
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [bm, FP8_BLOCK], a_layout)
    w_desc = TensorDescriptor(w.view(E * N, K), [E * N, K], [K, 1], [bn, FP8_BLOCK], w_layout)
    return a_desc, w_desc


def _constants(tile: str, gemm: int, activation: str, has_bias: bool, quant: str, k: int,
               early: Optional[bool], pairs: Optional[bool], atomic_top_k: int,
               gather_top_k: int, overlap: Optional[bool] = None,
               native_cast: Optional[bool] = None, pipe_pairs: Optional[bool] = None,
               expert_groups: Optional[bool] = None, group_m: Optional[int] = None,
               fast_sigmoid: Optional[bool] = None) -> dict:
    """The kernel's constexprs for a launch (but ALIGN_M, the dispatch's): the module settings
    and rules above for this form, GEMM and K. GATHER_LAG 0 where no lag fits (gather_lag);
    the launcher refuses a gather then."""
    stagger = stagger_steps(tile, gemm)
    pairs = promote_pairs(quant, tile, gemm) if pairs is None else pairs
    overlap = overlaps(tile, gemm, k) if overlap is None else overlap
    pipelined = pipelines_pairs(pairs, gather_top_k, overlap, pipe_pairs)
    stages = MAX_STAGES[tile] if pipelined else ring_stages(tile, k)
    return dict(GROUP_M=group_size(gemm) if group_m is None else group_m,
                EXPERT_GROUPS=int(EXPERT_GROUPS == "1" if expert_groups is None
                                  else expert_groups),
                STAGES=stages, FORM=FORMS[tile],
                ACTIVATION=ACTIVATIONS.index(activation) if gemm == 1 else 0,
                HAS_BIAS=has_bias, CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS, COALESCED=COALESCED_STORE,
                BLOCK_SCALES=int(quant == "fp8_block"), SKIP_PADDING=int(skip_padding(gemm)),
                SCALES_AFTER_MMA=int(scales_after(tile)), STAGGER=stagger,
                EARLY=int(EARLY_EPILOGUE if early is None else early),
                PAIRS=2 if pipelined else int(pairs),
                ATOMIC_TOP_K=atomic_top_k, GATHER_TOP_K=gather_top_k,
                GATHER_LAG=gather_lag(stages, pairs, stagger) if gather_top_k else 1,
                OVERLAP=int(overlap),
                NATIVE_CAST=int(NATIVE_CAST if native_cast is None else native_cast),
                FAST_SIGMOID=int(FAST_SIGMOID if fast_sigmoid is None else fast_sigmoid))


def gemm(a, a_scale, w, w_scale, bias, out, routing, *, gemm: int, activation: str,
         alpha: float = 0.0, limit: float = 0.0, tile: str = "cols", quant: str = "fp8_block",
         programs: Optional[int] = None, early: Optional[bool] = None,
         pairs: Optional[bool] = None, atomic: bool = False, gather_top_k: int = 0,
         overlap: Optional[bool] = None, native_cast: Optional[bool] = None,
         pipe_pairs: Optional[bool] = None, expert_groups: Optional[bool] = None,
         group_m: Optional[int] = None, fast_sigmoid: Optional[bool] = None) -> None:
    """One GEMM over the dispatch's live slots (see the module docstring).

    a [slots, K] e4m3 in dispatch order; fp8_block: a_scale [slots, K/128] fp32, w_scale
    [E, N/128, K/128]; fp8: a_scale [slots], w_scale [E, N]. w [E, N, K] e4m3; bias [E, N] or
    None. GEMM1 (gemm=1): out = intermediate [slots, N/2 gated, N otherwise],
    act(a @ w^T + bias); GEMM2: out [pairs, N] = topk_weight * (a @ w^T + bias). early: the
    slots' epilogue operands loaded before each tile's K loop (default: EARLY_EPILOGUE).
    pairs: fp8 per tensor's promotion every other K step (default: promote_pairs). atomic
    (GEMM2, see ATOMIC): out is float32 [tokens, N], zeroed by the caller, and each pair's row
    is added into its token's (pair // top_k) instead of written. gather_top_k (GEMM1, see
    GATHER): the routing's top_k, and a / a_scale are the token rows [T, K] / their scales,
    gathered by the kernel's producer, instead of rows in dispatch order. overlap: each tile's
    first steps issued before the previous tile's epilogue (default: overlaps). native_cast:
    the output's rounding by the GPU's conversion (default: NATIVE_CAST; see to_out).
    pipe_pairs: the pairs pipelined, where pairs apply (default: PIPE_PAIRS). expert_groups:
    the tile groups cut at the experts' boundaries (default: expert_groups_apply's rule).
    group_m: the row blocks a group of the tile order holds, a power of two (default:
    group_size). fast_sigmoid: GEMM1's swiglu / swiglu_oai sigmoid on tanh.approx (default:
    FAST_SIGMOID)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if group_m is not None:
        _group_m_checked("group_m", group_m)
    if pairs and not pairs_fit(quant, tile, gemm):
        raise ValueError(f"pairs=True is for quant 'fp8' (fp8_block's scales change every K "
                         f"step) on the 'rows' / 'cols' tiles without a stagger, got "
                         f"{quant!r}, {tile!r}, stagger {stagger_steps(tile, gemm)}")
    if gemm == 1 and activation == "none":
        raise ValueError("gemm=1 needs an activation (GEMM1's epilogue applies it)")
    if atomic and (gemm != 2 or out.dtype != torch.float32
                   or out.shape[0] * routing.top_k != routing.num_pairs):
        raise ValueError(f"atomic=True is GEMM2's, into a float32 out of num_pairs / top_k = "
                         f"{routing.num_pairs // routing.top_k} token rows; got gemm={gemm}, "
                         f"out {out.dtype} {list(out.shape)}")
    if gather_top_k and (gemm != 1 or gather_top_k != routing.top_k):
        raise ValueError(f"gather_top_k is GEMM1's, the routing's top_k {routing.top_k}; got "
                         f"gemm={gemm}, gather_top_k={gather_top_k}")
    if overlap and not overlap_fits(tile, gemm):
        raise ValueError(f"overlap=True is for the 'rows' / 'cols' tiles without the padding "
                         f"skip or a stagger, got {tile!r}, skip {skip_padding(gemm)}, "
                         f"stagger {stagger_steps(tile, gemm)}")
    bm, bn = TILES[tile]
    if tile == "wide" and not wide_admits(quant, activation if gemm == 1 else "none",
                                          bias is not None, native_cast):
        raise ValueError(f"tile='wide' is built for {WIDE_BUILDS} (quant, activation, bias) "
                         f"only (and {WIDE_NATIVE_BUILDS} with WIDE_FP8_GEMM2 and the native "
                         f"cast; the others spill in their K loop), got "
                         f"{(quant, activation if gemm == 1 else 'none', bias is not None)}")
    if routing.direct or routing.align_block_m % bm:
        raise ValueError(f"the warp-specialized GEMM needs a dispatch aligned to {bm} rows")
    E, N, K = w.shape
    a_desc, w_desc = _descriptors(a, w, tile)
    if programs is None:
        programs = device_properties(a.device).multi_processor_count
    dummy = routing.topk_weights
    consts = _constants(tile, gemm, activation, bias is not None, quant, K, early, pairs,
                        routing.top_k if atomic else 0, gather_top_k, overlap, native_cast,
                        pipe_pairs, expert_groups_apply(tile, routing.num_pairs,
                                                        routing.num_experts, N, K,
                                                        expert_groups, gemm), group_m,
                        fast_sigmoid)
    if consts["GATHER_LAG"] < 1:
        raise ValueError(f"gather_top_k: no gather lag fits a ring of {consts['STAGES']} slots "
                         f"with pairs={bool(consts['PAIRS'])}, stagger {consts['STAGGER']} "
                         f"(MOE_OPS_WS_STAGES)")
    # grouped_gemm's launcher: inside its compile_only() (the tuner's parallel precompile) this
    # compiles the kernel without running it
    _launcher((programs, ), _ws_fp8_block_kernel)(
        a_desc, w_desc, a_scale, w_scale, bias if bias is not None else dummy, out,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        routing.topk_weights, a, N, K, routing.num_pairs, a_scale.stride(0), w_scale.stride(0),
        w_scale.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        a.stride(0), alpha, limit, ALIGN_M=routing.align_block_m, **consts, num_warps=4,
        maxnreg=MAXNREG)


def compile_sm90(*, tile: str = "cols", gemm: int = 1, activation: str = "swiglu",
                 has_bias: bool = False, out_dtype: str = "bf16", quant: str = "fp8_block",
                 early: Optional[bool] = None, pairs: Optional[bool] = None, k: int = 0,
                 atomic_top_k: int = 0, gather_top_k: int = 0,
                 overlap: Optional[bool] = None, native_cast: Optional[bool] = None,
                 pipe_pairs: Optional[bool] = None, expert_groups: Optional[bool] = None,
                 group_m: Optional[int] = None, fast_sigmoid: Optional[bool] = None):
    """Build the kernel for sm_90 without a GPU (ptxas from the Triton wheel): what the CPU tests
    run, Gluon having no interpreter. k: the GEMM's K where the ring's slots depend on it
    (ring_stages); atomic_top_k: GEMM2's atomic form for that top_k (out_dtype "fp32");
    gather_top_k: GEMM1 gathering its rows for that top_k (GATHER); overlap: OVERLAP's form;
    native_cast: NATIVE_CAST's; pipe_pairs: PIPE_PAIRS'; expert_groups: EXPERT_GROUPS' (by
    default on only with MOE_OPS_WS_EXPERT_GROUPS=1: its rule needs the routing); group_m:
    GROUP_M's (default: group_size); fast_sigmoid: FAST_SIGMOID's.
    Returns triton's CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    bm, bn = TILES[tile]
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, FP8_BLOCK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, FP8_BLOCK], gl.float8e4nv)
    signature = {
        "a_desc": f"tensordesc<fp8e4nv[{bm}, {FP8_BLOCK}],{a_layout!r}>",
        "w_desc": f"tensordesc<fp8e4nv[{bn}, {FP8_BLOCK}],{w_layout!r}>",
        "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*fp32",
        "out_ptr": f"*{out_dtype}", "sorted_pair_ids_ptr": "*i32", "block_expert_ptr": "*i32",
        "num_padded_ptr": "*i32", "topk_weights_ptr": "*fp32", "a_ptr": "*fp8e4nv",
        "N": "i32", "K": "i32", "num_pairs": "i32", "stride_as": "i32", "stride_wse": "i32",
        "stride_wsn": "i32", "stride_be": "i32", "stride_om": "i32", "stride_am": "i32",
        "alpha": "fp32", "limit": "fp32"}
    consts = dict(ALIGN_M=bm, **_constants(tile, gemm, activation, has_bias, quant, k, early,
                                           pairs, atomic_top_k, gather_top_k, overlap,
                                           native_cast, pipe_pairs, expert_groups, group_m,
                                           fast_sigmoid))
    signature.update({name: "constexpr" for name in consts})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if name.endswith("_ptr") or name in ("N", "K", "stride_om", "stride_am")}
    source = GluonASTSource(fn=_ws_fp8_block_kernel, signature=signature, constexprs=consts,
                            attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=MAXNREG))
