"""The experts stage on Triton: dispatch -> GEMM1 (+ activation) -> GEMM2 (+ routing weight)
-> combine, for x [T, H] already routed to (topk_ids, topk_weights).

Launch sequence (no host sync, every buffer sized from shapes: CUDA-graph safe):
  [layer call] route                            the routing (a RouteCall), launched here:
              with the fp8 modes' act_quant(x) up to ROUTE_QUANTIZE_MAX_TOKENS tokens, and
              with ROUTE_ALIGN the small dispatch where the routing is one program
  [fp8 modes] act_quant(x)                       per token (per 128-group for fp8_block)
              (nvfp4/mxfp4 are W4A16: no activation quantization, the GEMMs dequantize the
              packed weights in registers)
  dispatch    moe_align (or nothing in direct mode, for tiny batches)
  GEMM1       gathered token rows, activation in the epilogue -> intermediate [slots, I]
              (a persistent config at prefill first copies the rows into dispatch order,
              align.gather_rows: its TMA loads cannot gather; where ws_gemm.gathers, the
              warp-specialized GEMM1 gathers them itself by cp.async; one of decode's
              row tiles, block_m < 64, reads them by pointer; fp8_block's other persistent
              launches run ws_gemm's warp-specialized kernel on Hopper; the 4-bit ones ws_fp4's,
              whose rows the dispatch's launch can gather itself up to
              ALIGN_GATHER_MAX_PAIRS pairs)
  [fp8 modes] act_quant(intermediate)            padding slots skipped
  GEMM2       routing weight in the epilogue -> one row per pair
  combine     sum of each token's k rows in fp32; for large batches on the tile kernel instead
              fp32 atomics in GEMM2's epilogue + a cast (COMBINE, measured choice; summation
              order then varies); a persistent GEMM2 always writes rows
The caller (the package's op layer) has validated every argument; nothing is re-checked here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from moe_ops.kernels.act_quant import act_quant
from moe_ops.kernels.routing import (
    FIXED_WARPS_MAX_TOKENS, routes_in_one_program, triton_route,
)
from moe_ops.kernels.align import SMALL_PATH_MAX_PAIRS, gather_rows, moe_align, moe_align_gather
from moe_ops.kernels import ws_fp4, ws_gemm
from moe_ops.kernels.combine import combine_pair_rows
from moe_ops.kernels.env import env_choice, env_int
from moe_ops.kernels.common import device_properties, is_gated, pdl_early_launch, upcast_dots
from moe_ops.quant import FP4_K_ALIGN
from moe_ops.kernels.grouped_gemm import (
    FP4_QUANTS, PERSISTENT_QUANTS, GemmConfig, GemmProblem, Routing, fp8_swap_ok, gemm1, gemm2,
    is_decode_persistent, use_persistent,
)
from moe_ops.tuning import experts_configs

# Direct mode (no dispatch, one pair per GEMM block) when pairs are few next to the experts:
# then almost every pair has an expert to itself, so nothing is gained by grouping and the
# dispatch launch is saved. With T = 1 the routing gives k distinct experts by construction.
DIRECT_MAX_PAIRS = 64
DIRECT_MAX_PAIRS_PER_EXPERT = 0.125
# A layer call's routing (fused_moe with router logits on this backend) is launched by the
# experts call (RouteCall), so that one launch can do more than route: act_quant(x) of the fp8
# modes needs nothing of the routing, and its programs run beside the routing's (the same
# codes) up to ROUTE_QUANTIZE_MAX_TOKENS tokens. Measured on an H200 (results/
# h200_ab_routequant_*_thirtyfirst.json, 2026-12-04, graph replays, two alternated passes, 0 ->
# 1024): about 1 us off every fp8 / fp8_block layer call at T = 1-256 (Qwen3 fp8 T = 1 / 4 21.9
# / 52.1 -> 21.1 / 49.5 us, Llama 4 fp8 T = 1 42.1 -> 41.2, Mixtral fp8 T = 1 96.3 -> 95.2,
# DeepSeek-V3 fp8_block T = 4 333.4 -> 330.4; all 20 points faster), mixed at T = 1024 (Llama 4
# 579 -> 586, Qwen3 equal). So up to 256; MOE_OPS_ROUTE_QUANTIZE_MAX_TOKENS=0: off.
ROUTE_QUANTIZE_MAX_TOKENS = env_int("MOE_OPS_ROUTE_QUANTIZE_MAX_TOKENS", 256)
# MOE_OPS_ROUTE_ALIGN=1: where the routing is one program (routing.routes_in_one_program: up to
# 2048 / experts tokens, at most 64) and the dispatch takes its single-program path without the
# row gather, that program writes the dispatch after routing (align.align_pairs), in place of
# moe_align's launch. Written in the thirty-first session, after its device time: off until
# measured (`bash benchmarks/h200_run.sh routealign`).
ROUTE_ALIGN = env_choice("MOE_OPS_ROUTE_ALIGN", "0", ("0", "1")) == "1"


@dataclasses.dataclass(frozen=True)
class RouteCall:
    """A layer call's routing (SPEC §1's methods, validated), for triton_experts to launch."""
    router_logits: torch.Tensor
    method: str
    routing_bias: Optional[torch.Tensor]
    n_group: Optional[int]
    topk_group: Optional[int]
    routed_scaling_factor: float


# "rows": GEMM2 writes one row per pair, a second pass sums them (deterministic).
# "atomic": GEMM2 adds into an fp32 [T, H] buffer (then cast unless x is fp32).
# "auto": rows when GEMM2 runs the persistent kernel (it has no atomic epilogue: see
# grouped_gemm), else atomic once the per-pair buffer would reach ATOMIC_COMBINE_MIN_BYTES.
# The per-pair buffer [T*k, H] (x.dtype) is then the size of the [slots, H] copy of the routed
# rows a persistent GEMM1 held and freed before GEMM2 (16-bit x; twice fp8's 1-byte rows), and
# larger than the atomic mode's fp32 [T, H] for top_k > 2 (Qwen3 T=16384: 512 against 128 MiB)
# where GEMM1 ran the tile kernel (no copy). Measured on one
# H200 at T=4096 (graph replay): atomic 918.7 vs rows 974.9 us (Qwen3 bf16), 4573 vs 4981
# (Mixtral bf16), 6127 vs 6725 (DeepSeek fp8_block), 623.5 vs 663.2 (Qwen3 fp8). At decode
# sizes rows needs two launches where atomic needs three (zero fill, GEMM2, cast).
COMBINE = "auto"
ATOMIC_COMBINE_MIN_BYTES = 64 << 20
# Programmatic dependent launch (common.pdl_early_launch) for calls of at most this many routed
# pairs: it takes about 2 us off each decode call (results/h200_pdl_on.json); at prefill the
# next kernel's early-resident programs hold SM slots their predecessor still needs. This scope
# keeps the prologue and drops only the launch attribute. Measured as it ships, same tables,
# against the attribute on every launch (results/h200_pdl_shipped_ab.json): Mixtral bf16
# T=16384 631 -> 657 TFLOP/s, T=4096 590 -> 613, fp8 and Llama 4 1-2% faster, Qwen3 and
# DeepSeek unchanged.
PDL_MAX_PAIRS = 512
# fp8 (per tensor) runs GEMM1's swap-AB tiles unswapped. Swapped, the weight tile sits on the
# 64-row side of Hopper's fp8 wgmma, whose own accumulation errs ~1e-4 of the dot
# (benchmarks/dev_fp8_wgmma_precision.py, results/h200_fp8_wgmma_precision_twentyfirst.log;
# mma.sync at 16 rows: 1e-7). GEMM1's output is requantized per token (act_quant of the
# intermediate), and a difference that small moves a row's amax or an element across an e4m3
# rounding boundary: the row's quantization noise then no longer matches the reference's, and
# the experts call erred up to 1.37e-2 against it over 24 random batches (Mixtral T=7; SPEC's
# bound is 1e-2) whatever the K step and promotion interval, while the same tile unswapped
# erred 2.9e-3 at most (results/h200_fp8_decode_precision.txt). GEMM2's output is not
# requantized: with GEMM2 alone swapped the call errs as the unswapped one (2.9e-3 at most at
# Mixtral T = 7 / 16 / 64, Qwen3 3.5e-3, Llama 4 1.7e-3) and runs faster (Mixtral T = 64 414
# -> 390 us, Llama 4 T = 4 156 -> 143; results/h200_fp8_decode_precision_gemm2_twentyfirst.log),
# so GEMM2 may swap, on both kernels (the tuner's fp8 GEMM2 decode candidates are swapped
# tiles; on the persistent kernel's decode tiles swapped beat unswapped by 1-8% at Mixtral,
# Llama 4 and Qwen3 T = 4-64, results/h200_sweep_persd_swap2_twentysecond.log), and GEMM1's
# swap-AB configs (explicit ones, a user's cache) run as their unswapped twins unless
# FP8_SWAP_AB (for measurements). GEMM1 swapped on f16 operands (e4m3 -> f16 is exact, so the
# sums are as exact as mma.sync's) errs like the unswapped tile and ran 9-51% slower than the
# shipped pair (Mixtral T = 7 / 64, Llama 4 T = 4 / 16, Qwen3 T = 16 / 64;
# results/h200_fp8_swap_f16_precision_twentysecond.log): removed (commit dc6985a has it as
# grouped_gemm.FP8_SWAP_F16).
FP8_SWAP_AB = False
# fp8_block launches whose config is persistent (the tables' choice at prefill; not decode's
# row tiles, block_m < 64, which run grouped_gemm's persistent kernel) run the
# warp-specialized Gluon kernel on Hopper (ws_gemm: the block-scale promotion off the tensor
# cores' critical path). Its tile form by routed rows per expert: "rows" (128-row tiles) from
# WS_ROWS_TILE_MIN_ROWS on, "cols" (64-row tiles, 256 columns) below; the tuner times a
# persistent candidate on this kernel, with this rule's form, so the tables choose between it
# and the Triton tile kernel (the fp8 tables re-tuned so, 2026-12-01). Measured on an H200,
# DeepSeek-V3's experts call, kernels without PDL (results/h200_ws_profile_*.json): T = 16384
# (512 rows an expert) 18.9 -> 17.2 ms with "rows" (17.7 "cols"), T = 4096 (128 rows) 5.78 ->
# 5.40 ms with "cols" (5.71 "rows").
# "wide" (128 x 256 tiles) from WS_WIDE_MIN_ROWS for the launches ws_gemm.WIDE_BUILDS admits
# (fp8_block's GEMM2): measured on an H200 (2026-12-01), DeepSeek-V3's
# GEMM2 shape alone at T = 16384 (512 rows an expert) 5.12 -> 4.56 ms (751 -> 844 TFLOP/s; with
# the scale loads after the wgmmas 5.56 -> 4.39; results/h200_ab_scale_loads_*_fp8_block.json),
# the layer 16.54 -> 16.23 ms eager, but at T = 4096 (128 rows) the layer 5.36 -> 5.78 ms (half
# as many tiles to spread over the SMs; results/h200_ab_tile_*.json).
# For every build WIDE_BUILDS admits (GEMM1, fp8 per tensor; ws_gemm.WIDE "all") measured on an
# H200 (results/h200_ab_wide_*.json, 2026-12-01), graph replays, GEMM2 only / all: Mixtral fp8
# T = 2048 / 4096 / 16384 (512 / 1024 / 4096 rows an expert) 1746 / 3065 / 12907 -> 1633 /
# 3119 / 12192 us, DeepSeek fp8_block T = 16384 17015 -> 15950, Llama 4 fp8 T = 16384 4677 ->
# 4691 (the points under 512 rows an expert, which it does not change, within 1% but Llama 4
# T = 2048's graph replay: the run's spread); DeepSeek's GEMM1 shape alone 812 -> 875 TFLOP/s
# (h200_ab_stagger_deepseek_v3.json). So all (MOE_OPS_WS_WIDE=gemm2: fp8_block's GEMM2 only).
# The threshold, 512 rows then, is 256 since: measured on an H200
# (results/h200_ab_widemin*_twentyninth.json, 2026-12-03, two alternated passes, graph replays)
# at the points of 256 rows an expert, 512 -> 256: Mixtral fp8 T = 1024 913 / 905 -> 846 / 895
# us, Llama 4 fp8 T = 4096 1302 / 1336 -> 1272 / 1280, Qwen3 fp8 T = 4096 592 / 561 -> 526 /
# 524, DeepSeek-V3 fp8_block T = 8192 9036 / 9373 -> 8309 / 8759 (those 128 x 256 tiles are
# still 1536-8192 a GEMM, enough for 132 SMs); at 128 rows (Mixtral T = 512, Llama 4 and Qwen3
# T = 2048) 128 ran 1-6% slower than 256.
# MOE_OPS_WS_FP8_BLOCK_TILE=rows|cols|wide|none overrides the
# rule ("none": never this kernel; "wide" at any size for the launches it admits, the others on
# the rule's form).
# (It governs the fp8-per-tensor launches of WS_FP8 alike.) While tuning, the tuner times what
# runs: a persistent fp8_block candidate on Hopper is timed on this kernel.
WS_FP8_BLOCK_TILE: Optional[str] = env_choice(
    "MOE_OPS_WS_FP8_BLOCK_TILE", "auto", ("auto", "rows", "cols", "wide", "none"))
WS_ROWS_TILE_MIN_ROWS = 256
# MOE_OPS_WS_WIDE_MIN_ROWS=n moves the "wide" threshold (routed rows an expert; for A/B).
# With it at WS_ROWS_TILE_MIN_ROWS (both 256) the GEMMs "wide" admits take "cols" below it and
# "wide" from it; "rows" remains for the others (fp8 per tensor's GEMM2 without a bias, an N
# no whole number of 256 columns).
WS_WIDE_MIN_ROWS = env_int("MOE_OPS_WS_WIDE_MIN_ROWS", 256)
# The kernel applies where the tuned config is persistent (the tables' prefill choice; not
# decode's persistent row tiles).
# MOE_OPS_WS_MIN_ROWS=n applies it also from n routed rows an expert whatever the config (unset:
# persistent only). Measured on an H200 with the tables of then (results/h200_ab_ws_min_rows_*,
# 2026-12-01), 32: Qwen3-30B-A3B fp8 T = 16384 2670 -> 2285 us, T = 1024 280 -> 301; DeepSeek-V3
# fp8_block T = 2048 4402 -> 3664, T = 4096 5156 -> 5318 eager: no one threshold wins, and the
# re-tuned tables (the persistent candidates timed on this kernel) take it where it wins (Qwen3
# fp8 T = 16384 2293 us in results/h200.json); so unset.
WS_MIN_ROWS = env_int("MOE_OPS_WS_MIN_ROWS", 0)
# fp8 per tensor on the same kernel (its partial sums promoted every other K step since the
# twenty-third session, ws_gemm.FP8_PROMOTE_STEPS; every step when this was measured; the
# scales in the epilogue). Measured on an H200 (results/h200_ws_fp8_profile_*.json,
# 2026-12-01), the experts call's kernels without PDL: Mixtral-8x7B T = 4096 / 16384 3.04 ->
# 2.79 / 12.34 -> 11.10 ms, Llama 4 Scout 1.34 -> 1.28 / 4.39 -> 4.16 ms; so on
# (MOE_OPS_WS_FP8=0: the Triton kernels).
WS_FP8 = env_choice("MOE_OPS_WS_FP8", "1", ("0", "1")) == "1"
# nvfp4 decode (up to WS_FP4_MAX_ROWS routed rows an expert on average) on the warp-specialized
# Gluon kernel of ws_fp4 (the packed weights decoded straight into wgmma's register operand).
# Measured on an H200 (results/h200_ws_fp4_layer_*.json, 2026-12-01), DeepSeek-V3 nvfp4 layer,
# CUDA-graph replays, Triton / GEMM1 on Gluon / both: T = 64 2012 / 1843 / 1803 us, T = 128
# (4 rows an expert) 2587 / 2360 / 2211. With the kernel skipping 16-row blocks of padding only
# and the dispatch aligned to the kernels that run (results/h200_ab_fp4_rows_*.json,
# 2026-12-01), up to 16 rows an expert against up to 4: T = 16-128 equal (885 / 1760 / 2130 us),
# T = 256 3353 -> 2634, T = 512 4063 -> 3804 us; up to 16 then. With the prefill form below
# taking over from 8 instead of 32 (results/h200_ab_fp4_handover_*.json, 2026-12-01), up to 16
# / from 32 against up to 8 / from 8: DeepSeek-V3 nvfp4 T = 128 / 256 (4 / 8 rows an expert)
# 2118 / 2625 -> 2169 / 2663 us (the same kernels: noise), T = 512 / 768 3850 / 4749 -> 3332 /
# 3660; gpt-oss-120b mxfp4 T = 512 / 768 1159 / 1309 -> 1075 / 1107 (up to 4 / from 4: T = 256
# 2625 -> 3029). So up to 8. MOE_OPS_WS_FP4=gemm1: GEMM1 only,
# 0: never. Calls it takes need a dispatch (16-row blocks), so never use direct mode.
WS_FP4 = env_choice("MOE_OPS_WS_FP4", "1", ("0", "gemm1", "1"))
# mxfp4 on the same kernel (its e8m0 scales decoded by a shift; gpt-oss-120b's GEMM2, N = 2880,
# 22.5 tiles, through ws_fp4.PARTIAL_N_OK). Its first GPU run stopped on an illegal instruction
# (scale loads at 8-byte TMA coordinates; fixed). Measured on an H200 with the fix
# (results/h200_ab_mxfp4_rerun_*.json, 2026-12-01), gpt-oss-120b mxfp4 decode, graph replays,
# Triton / this kernel: T = 1 57.5 / 55.0 us, 4 120.0 / 130.6, 16 352.5 / 353.5, 64 744.3 /
# 729.7, 128 848.7 / 817.8; with the prefill form below, T = 1024-16384 1335 / 3319 / 11218 ->
# 1155 / 2841 / 10735 us. So on (MOE_OPS_WS_MXFP4=0: nvfp4 only).
WS_FP4_QUANTS = ("nvfp4", "mxfp4") if env_choice(
    "MOE_OPS_WS_MXFP4", "1", ("0", "1")) == "1" else ("nvfp4", )
WS_FP4_MAX_ROWS = env_int("MOE_OPS_WS_FP4_MAX_ROWS", 8)
# 4-bit prefill on the same kernel's 64-slot form (ws_fp4.PREFILL_SLOTS) from this many routed
# rows an expert on average. Measured on an H200 (results/h200_ab_fp4_prefill_*.json,
# 2026-12-01), graph replays, Triton W4A16 / this form: DeepSeek-V3 nvfp4 T = 1024 5204 ->
# 3954 us, 4096 11557 -> 9199, 16384 34304 -> 31237; gpt-oss-120b mxfp4 T = 1024 1335 -> 1155,
# 4096 3319 -> 2841, 16384 11218 -> 10735 (its pipelined consumers 3-10% slower: off). GEMM1's
# shape alone at 1024 rows an expert 401 -> 444 TFLOP/s (h200_gluon_fp4_decode_prefill.json).
# From 32 then; from 8 since the decode form hands over at 8 (WS_FP4_MAX_ROWS above: the
# 16-32 rows an expert that ran on Triton now run here). MOE_OPS_WS_FP4_PREFILL_MIN_ROWS=0:
# never.
WS_FP4_PREFILL_MIN_ROWS = env_int("MOE_OPS_WS_FP4_PREFILL_MIN_ROWS", 8)
# ... and its 128-slot wide form (ws_fp4.WIDE_SLOTS: twice the MMA work a decoded weight tile,
# the dispatch padded to 128 rows an expert) from this many. Measured on an H200
# (results/h200_ab_fp4_wide_*.json, 2026-12-01), graph replays, 64-slot / 128-slot form:
# DeepSeek-V3 nvfp4 T = 1024 / 2048 (32 / 64 rows an expert) 3823 / 5560 -> 4920 / 5790 us (the
# padding), T = 4096 / 8192 / 16384 (128 / 256 / 512) 9091 / 16646 / 30880 -> 8376 / 14485 /
# 26129; gpt-oss-120b mxfp4 T = 1024 / 2048 1105 / 1613 -> 1613 / 1670, T = 4096 / 8192 /
# 16384 2788 / 5038 / 9542 -> 2394 / 4205 / 7513; the GEMMs alone at 256 rows an expert 446 ->
# 548 TFLOP/s (GEMM1's shape), 385 -> 495 (GEMM2's; h200_gluon_fp4_prefill_128.json). From
# 128 then; from 64 with its half blocks (ws_fp4.HALF_BLOCKS: T = 2048 5694 -> 5231 us,
# gpt-oss 1632 -> 1571). MOE_OPS_WS_FP4_WIDE_MIN_ROWS=0: never.
WS_FP4_WIDE_MIN_ROWS = env_int("MOE_OPS_WS_FP4_WIDE_MIN_ROWS", 64)
# Up to this many routed pairs the 4-bit Gluon GEMM1's gathered token rows come from the
# dispatch's launch (align.moe_align_gather) instead of a launch of their own
# (align.gather_rows). Measured on an H200, the decode layers as graph replays in two
# alternated runs (results/h200_ab_fp4_decode_c*_g*.json, 2026-12-01): DeepSeek-V3 nvfp4 T = 1
# / 16 (8 / 128 pairs) 106.3, 106.4 -> 103.9, 104.2 us / 868 -> 861; T = 4 and gpt-oss within
# 1 us; T = 64 (512 pairs) 1721 -> 1727. So up to 128 pairs; MOE_OPS_ALIGN_GATHER_MAX_PAIRS=0:
# never (at most align.SMALL_PATH_MAX_PAIRS).
# fp8 (per tensor) decode on ws_fp4's fp8 form (up to WS_FP8_DECODE_MAX_ROWS routed rows an
# expert on average): the e4m3 weights streamed by TMA and converted to f16 in registers (one
# cvt a pair), the activations quantized by act_quant as SPEC says and multiplied as f16 (the
# W8A8 products exact, fp32 accumulation: 2.7-2.9e-3 against the reference), instead of
# grouped_gemm's mma.sync tiles. Its K loop is 1.7 SASS instructions a weight value (python
# benchmarks/dev_gluon_fp4_decode.py --aot). Measured on an H200 (results/
# h200_ab_fp8_decode_*.json, h200_profile_fp8_decode.json, 2026-12-02, graph replays, two
# alternated passes, off / on): Mixtral-8x7B T = 1 / 4 / 16 / 64 103.9 / 238.3 / 348.1 /
# 396-418 -> 118.1 / 266.4 / 351.7 / 484.8 us, Qwen3-30B-A3B 24.3 / 54.8 / 118.0 / 166.4 ->
# 30.9 / 60.6 / 123.4 / 183.4, Llama 4 Scout 49.7 / 132.3 / 316.6 / 480.6 -> 63.4 / 135.7 /
# 324.8 / 487.7: slower at every point. An SM streams as fast as on the Triton tiles (Mixtral
# T = 1 GEMM1: 448 tiles of 128 rows, 28 GB/s an SM against 26.5), but its whole 128-row tiles
# quantize into waves (3.4 tiles an SM run as 4), a few experts' GEMM2 leaves SMs idle (Mixtral
# T = 1: 64 tiles for 132 SMs, 41.5 against 31.4 us) and past 16 rows an expert the 16-slot
# blocks read an expert's weights once a block (Mixtral T = 64). So off (MOE_OPS_WS_FP8_DECODE=1
# turns it on). GEMM2's split of K over the combine's pair rows (ws_fp4.SPLIT_K) narrows the gap
# at T = 1 but does not close it (results/h200_ab_splitk_fp8_*.json: Mixtral 119.3 -> 108.6 us,
# Llama 4 64.9 -> 53.9); what is left: GEMM1's 128-row tiles in waves (a split of its K with the
# activation moved into act_quant of the intermediate), a 32- or 64-slot block past 16 rows.
WS_FP8_DECODE = env_choice("MOE_OPS_WS_FP8_DECODE", "0", ("0", "1")) == "1"
WS_FP8_DECODE_MAX_ROWS = env_int("MOE_OPS_WS_FP8_DECODE_MAX_ROWS", 16)
ALIGN_GATHER_MAX_PAIRS = min(env_int("MOE_OPS_ALIGN_GATHER_MAX_PAIRS", 128),
                             SMALL_PATH_MAX_PAIRS)


def ws_tile(quant: str, num_pairs: int, num_experts: int, direct: bool,
            activation: str = "none", has_bias: bool = False,
            n: Optional[int] = None) -> Optional[str]:
    """The warp-specialized kernel's tile form for one GEMM (activation "none": GEMM2) of an
    fp8_block (or, with WS_FP8, fp8) call; None: not this kernel. num_pairs counts every routed
    pair, num_experts the local experts: with expert parallelism the rows an expert gets are
    overestimated (the rule then picks the 128-row tiles early; a speed matter, the results are
    the same). An override to "wide" holds for the builds ws_gemm admits it for; the others
    take the rule's form, as do GEMMs whose N (output columns, when given) is no whole number
    of the wide tile's 256."""
    wide_fits = (ws_gemm.wide_admits(quant, activation, has_bias)
                 and (n is None or n % ws_gemm.TILES["wide"][1] == 0))
    if quant not in (("fp8_block", "fp8") if WS_FP8 else ("fp8_block",)):
        return None
    if direct or WS_FP8_BLOCK_TILE == "none":
        return None
    if WS_FP8_BLOCK_TILE != "auto" and (WS_FP8_BLOCK_TILE != "wide" or wide_fits):
        return WS_FP8_BLOCK_TILE
    if (num_pairs >= WS_WIDE_MIN_ROWS * num_experts and wide_fits
            and ws_gemm.wide_by_rule(quant, activation)):
        return "wide"
    return ws_tile_rule(num_pairs, num_experts)


def ws_tile_rule(num_pairs: int, num_experts: int) -> str:
    """The tile form by routed rows an expert for any build: 128-row tiles from
    WS_ROWS_TILE_MIN_ROWS ("wide" from WS_WIDE_MIN_ROWS is ws_tile's, for the builds that
    admit it)."""
    return "rows" if num_pairs >= WS_ROWS_TILE_MIN_ROWS * num_experts else "cols"


def _persistent_prefill(config: GemmConfig) -> bool:
    """A persistent config of prefill's tiles: the ones ws_gemm takes over (decode's persistent
    row tiles, block_m < 64, run grouped_gemm's persistent kernel)."""
    return config.persistent and not is_decode_persistent(config)


def use_direct_dispatch(num_tokens: int, top_k: int, num_experts: int) -> bool:
    num_pairs = num_tokens * top_k
    return num_pairs <= DIRECT_MAX_PAIRS and (
        num_tokens == 1 or num_pairs <= DIRECT_MAX_PAIRS_PER_EXPERT * num_experts)


def gemm_problems(x: torch.Tensor, top_k: int, w13: torch.Tensor, w2: torch.Tensor,
                  activation: str, quant: str):
    T, H = x.shape
    E, N13 = w13.shape[0], w13.shape[1]
    rows = T * top_k / E
    gated = is_gated(activation)
    return (GemmProblem(1, E, N13, H, rows, x.dtype, quant, gated),
            GemmProblem(2, E, H, N13 // 2 if gated else N13, rows, x.dtype, quant, gated))


def _early_launch_at_decode(experts):
    """The experts call's launches are early-launched (PDL) at decode sizes only
    (PDL_MAX_PAIRS routed pairs)."""
    @functools.wraps(experts)
    def call(x: torch.Tensor, topk_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with pdl_early_launch(topk_ids.numel() <= PDL_MAX_PAIRS):
            return experts(x, topk_ids, *args, **kwargs)
    return call


@_early_launch_at_decode
def triton_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    *,
    activation: str = "swiglu",
    quant: str = "none",
    alpha: float = 1.702,
    limit: float = 7.0,
    local_expert_offset: int = 0,
    gemm1_config: Optional[GemmConfig] = None,
    gemm2_config: Optional[GemmConfig] = None,
    w13_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    route: Optional["RouteCall"] = None,
) -> torch.Tensor:
    """out [T, H] (x.dtype) = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t).

    route: the layer call's routing (a RouteCall), launched by this call where its dispatch
    needs the ids, into topk_ids / topk_weights (then allocated and unwritten): the same launch
    quantizes x for the fp8 modes (up to ROUTE_QUANTIZE_MAX_TOKENS) and, with ROUTE_ALIGN,
    writes the dispatch where the routing is one program.

    Weights in kernel layout: w13 [E, N13, H] (gate/up rows interleaved when gated), w2
    [E, H, I] (4-bit: packed bytes in quant.py's kernel order, [E, N13, Hp/2], [E, H, Ip/2]
    with Hp, Ip padded to multiples of 256); scales, the 4-bit layouts' per-row scales
    (nvfp4's global scale, mxfp4's fold; both required) and biases as described in
    grouped_gemm.py. Ids are global; ids outside
    [local_expert_offset, local_expert_offset + E) contribute nothing.
    """
    T, H = x.shape
    if T == 0:
        return x.new_empty((0, H))
    top_k = topk_ids.shape[1]
    E = w13.shape[0]
    fp4 = quant in FP4_QUANTS
    problem1, problem2 = gemm_problems(x, top_k, w13, w2, activation, quant)
    I = problem2.k
    config1, config2 = gemm1_config, gemm2_config
    if config1 is None or config2 is None:
        # Tuned configs (SPEC §6), else default_config(problem): see tuning.py.
        # Inside moe_ops.tuning.autotune, untuned keys are profiled with this call's inputs.
        tuned1, tuned2 = experts_configs(
            problem1, problem2, num_tokens=T, top_k=top_k, activation=activation,
            device=x.device, profile=lambda c1, c2: triton_experts(
                x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, b13, b2,
                activation=activation, quant=quant, alpha=alpha, limit=limit,
                local_expert_offset=local_expert_offset, gemm1_config=c1, gemm2_config=c2,
                w13_global_scale=w13_global_scale, w2_global_scale=w2_global_scale,
                route=route))
        config1, config2 = config1 or tuned1, config2 or tuned2
    for name, config in (("gemm1_config", gemm1_config), ("gemm2_config", gemm2_config)):
        # Explicit configs skip config_problems (tuned and default ones pass it). The rules whose
        # break would not fail a launch but read out of bounds, sum wrongly or silently run
        # another kernel are checked here, before any launch: 4-bit weight rows are padded to
        # FP4_K_ALIGN columns (the K step must not pass it), and the persistent kernel has no
        # 4-bit decode or fp32 dots (use_persistent would run such a config on the tile kernel).
        if config is None:
            continue
        if fp4 and config.block_k > FP4_K_ALIGN:
            raise ValueError(f"{quant} needs block_k <= {FP4_K_ALIGN} (its rows are padded "
                             f"to a multiple of {FP4_K_ALIGN}), got {config.block_k}")
        if config.persistent and (
                quant not in PERSISTENT_QUANTS or x.dtype not in (torch.bfloat16, torch.float16)):
            raise ValueError(f"{name}: persistent=True needs quant in {PERSISTENT_QUANTS} and "
                             f"bf16/fp16 activations, got quant={quant!r}, dtype {x.dtype}")

    if quant == "fp8" and not FP8_SWAP_AB:
        config1, config2 = (
            dataclasses.replace(c, swap_ab=False) if c.swap_ab and not fp8_swap_ok(gemm)
            else c for gemm, c in ((1, config1), (2, config2)))

    x = x.contiguous()
    direct = use_direct_dispatch(T, top_k, E)
    # (explicit configs, the tuner's candidates among them, run what they name)
    fp4_slots = (ws_fp4.BLOCK_M if T * top_k <= WS_FP4_MAX_ROWS * E else
                 ws_fp4.WIDE_SLOTS if 0 < WS_FP4_WIDE_MIN_ROWS * E <= T * top_k else
                 ws_fp4.PREFILL_SLOTS if 0 < WS_FP4_PREFILL_MIN_ROWS * E <= T * top_k else None)
    fp4_ws = (WS_FP4 != "0" and quant in WS_FP4_QUANTS and fp4_slots is not None
              and gemm1_config is None and gemm2_config is None
              and w13_global_scale is not None and w2_global_scale is not None)
    sms = device_properties(x.device).multi_processor_count if fp4_ws and x.is_cuda else None
    fp4_consumers = ((ws_fp4.consumers_for(fp4_slots, quant, T * top_k, 1, w13.shape[1], E, sms),
                      ws_fp4.consumers_for(fp4_slots, quant, T * top_k, 2, H, E, sms))
                     if fp4_ws else (None, None))
    ws_fp4_1 = fp4_ws and ws_fp4.applies(quant, activation, w13.shape[1], x, w13, w13_scale,
                                         fp4_slots, consumers=fp4_consumers[0])
    # (GEMM2 reads the intermediate's rows of I values)
    ws_fp4_2 = fp4_ws and WS_FP4 == "1" and ws_fp4.applies(quant, "none", H, x, w2, w2_scale,
                                                           fp4_slots, k=I,
                                                           consumers=fp4_consumers[1])
    # fp8 decode on ws_fp4's fp8 form: both GEMMs or neither (WS_FP8_DECODE)
    fp8_ws = (WS_FP8_DECODE and quant == "fp8" and T * top_k <= WS_FP8_DECODE_MAX_ROWS * E
              and gemm1_config is None and gemm2_config is None
              and ws_fp4.applies("fp8", activation, w13.shape[1], x, w13, w13_scale)
              and ws_fp4.applies("fp8", "none", H, x, w2, w2_scale, k=I))
    # GEMM2 on ws_fp4's decode form (4-bit or fp8): its consumers, and its K split over the
    # combine's pair rows (ws_fp4.SPLIT_K; serial consumers and the early epilogue only)
    consumers2 = (fp4_consumers[1] if ws_fp4_2
                  else ws_fp4.consumers_for(ws_fp4.BLOCK_M, "fp8") if fp8_ws else None)
    split2 = 1
    if ((ws_fp4_2 and fp4_slots == ws_fp4.BLOCK_M) or fp8_ws) and ws_fp4.SPLIT_K != "0" \
            and not ws_fp4.PIPELINE and ws_fp4.EARLY_EPILOGUE:
        kp2 = w2.shape[-1] * (1 if fp8_ws else 2)       # (4-bit: packed bytes)
        consumers2, split2 = ws_fp4.split_for(
            quant, T * top_k, H, kp2, E, device_properties(x.device).multi_processor_count,
            consumers2)
    if ws_fp4_1 or ws_fp4_2 or fp8_ws:
        direct = False
    tile1 = ws_tile(quant, T * top_k, E, direct or fp8_ws, activation, b13 is not None,
                    w13.shape[1])
    tile2 = ws_tile(quant, T * top_k, E, direct or fp8_ws, "none", b2 is not None, H)
    # x quantized is [T, H] e4m3 like the intermediate's [slots, I]: the same checks hold
    rows_ok = (WS_MIN_ROWS > 0 and T * top_k >= WS_MIN_ROWS * E
               and gemm1_config is None and gemm2_config is None)
    ws1 = tile1 is not None and (_persistent_prefill(config1) or rows_ok) and ws_gemm.applies(
        quant, activation, w13.shape[1], H, x, w13, tile1, activations_quantized=False,
        has_bias=b13 is not None)
    ws2 = tile2 is not None and (_persistent_prefill(config2) or rows_ok) and ws_gemm.applies(
        quant, "none", H, I, x, w2, tile2, activations_quantized=False,
        has_bias=b2 is not None)
    gathered = None  # GEMM1's gathered token rows, when the dispatch launch made them
    flat_ids = topk_ids.reshape(-1).contiguous()
    flat_weights = topk_weights.reshape(-1).contiguous()
    routing = Routing(flat_ids, flat_weights, top_k, E, local_expert_offset)
    if not direct:
        # One dispatch serves both GEMMs: its block_m is the larger of the two kernels' that
        # run, the other's divides it (powers of two), so no GEMM block straddles two experts.
        # (A config's block_m counts only where its Triton kernel runs: a larger one would pad
        # every expert's rows further, decode's 16-row blocks to 32 or 64.)
        align_block_m = ws_fp4.BLOCK_M if fp8_ws else max(
            ws_gemm.block_m(tile1) if ws1 else fp4_slots if ws_fp4_1 else config1.block_m,
            ws_gemm.block_m(tile2) if ws2 else fp4_slots if ws_fp4_2 else config2.block_m)
    # GEMM1's token rows gathered in the dispatch's own launch (align.moe_align_gather)
    align_gathers = not direct and (ws_fp4_1 or fp8_ws) and T * top_k <= ALIGN_GATHER_MAX_PAIRS
    aligned = x_quantized = None
    if route is not None:
        # The layer call's routing, launched here (RouteCall): with x's quantization for the
        # fp8 modes and, where its routing is one program, the dispatch of its ids
        quantize = (quant in ("fp8", "fp8_block") and not fp8_ws
                    and T <= min(ROUTE_QUANTIZE_MAX_TOKENS, FIXED_WARPS_MAX_TOKENS))
        align = (ROUTE_ALIGN and not direct and not align_gathers
                 and routes_in_one_program(T, top_k, route.router_logits.shape[1],
                                           route.method, route.n_group, E))
        routed = triton_route(route.router_logits, route.method, top_k, route.routing_bias,
                              route.n_group, route.topk_group, route.routed_scaling_factor,
                              out=(topk_ids, topk_weights),
                              quantize=(x, quant) if quantize else None,
                              align=(E, align_block_m, local_expert_offset) if align else None)
        x_quantized = tuple(routed[2:4]) if quantize else None
        aligned = routed[-1] if align else None
    if not direct:
        if aligned is None and align_gathers:
            aligned, gathered = moe_align_gather(topk_ids, E, align_block_m,
                                                 local_expert_offset, x)
        elif aligned is None:
            aligned = moe_align(topk_ids, E, align_block_m, local_expert_offset)
        routing.sorted_pair_ids = aligned.sorted_pair_ids
        routing.block_expert_ids = aligned.block_expert_ids
        routing.num_padded = aligned.num_padded
        routing.align_block_m = align_block_m

    # The 4-bit modes dot x.dtype operands (the dequantized weight) like quant="none".
    upcast = upcast_dots(x.dtype) and (quant == "none" or fp4)
    if quant == "none" or fp4 or fp8_ws:
        a1, a1_scale = x, None
    elif x_quantized is not None:
        a1, a1_scale = x_quantized
    else:
        a1, a1_scale = act_quant(x, quant)
    intermediate = torch.empty((routing.num_slots, I), dtype=x.dtype, device=x.device)
    if fp8_ws:
        # the token rows in dispatch order, quantized there (padding slots skipped) as f16
        # e4m3 values, one scale a slot
        rows = gathered if gathered is not None else gather_rows(x, None, routing)[0]
        del gathered
        a1, a1_scale = act_quant(rows, quant, routing.sorted_pair_ids, routing.num_pairs,
                                 out_dtype=torch.float16)
        del rows
        ws_fp4.gemm(a1, w13, w13_scale, None, b13, intermediate, routing, gemm=1,
                    activation=activation, alpha=alpha, limit=limit, quant=quant,
                    a_scale=a1_scale)
    elif ws_fp4_1:
        rows = gathered if gathered is not None else gather_rows(x, None, routing)[0]
        del gathered
        ws_fp4.gemm(rows, w13, w13_scale, w13_global_scale, b13, intermediate, routing, gemm=1,
                    activation=activation, alpha=alpha, limit=limit, quant=quant,
                    slots=fp4_slots, consumers=fp4_consumers[0])
        del rows
    elif ws1 and ws_gemm.gathers(quant, tile1, H, w13.shape[1]):
        # (its producer gathers the quantized token rows: see ws_gemm.GATHER)
        ws_gemm.gemm(a1, a1_scale, w13, w13_scale, b13, intermediate, routing, gemm=1,
                     activation=activation, alpha=alpha, limit=limit, tile=tile1, quant=quant,
                     gather_top_k=top_k)
    elif ws1:
        rows, row_scales = gather_rows(a1, a1_scale, routing)
        ws_gemm.gemm(rows, row_scales, w13, w13_scale, b13, intermediate, routing, gemm=1,
                     activation=activation, alpha=alpha, limit=limit, tile=tile1, quant=quant)
        del rows, row_scales
    else:
        gemm1(a1, a1_scale, w13, w13_scale, b13, intermediate, routing, config1,
              quant=quant, activation=activation, alpha=alpha, limit=limit,
              interpret_upcast=upcast, w13_global_scale=w13_global_scale)

    if quant == "none" or fp4:
        a2, a2_scale = intermediate, None
    else:
        a2, a2_scale = act_quant(intermediate, quant, routing.sorted_pair_ids, routing.num_pairs,
                                 out_dtype=torch.float16 if fp8_ws else torch.float8_e4m3fn)

    combine = COMBINE
    if ws2 and ws_gemm.ATOMIC:
        combine = "atomic"  # (its atomic form, measured slower: see ws_gemm.ATOMIC)
    elif ws2 or ws_fp4_2 or fp8_ws:
        combine = "rows"    # the warp-specialized kernels write one row per pair
    elif config2.split_k > 1:
        combine = "atomic"  # split-K partial products meet in the fp32 output
    elif combine == "auto":
        pair_rows_bytes = routing.num_pairs * H * x.element_size()
        if use_persistent(config2, routing, a2, w2):
            combine = "rows"
        else:
            combine = "atomic" if pair_rows_bytes >= ATOMIC_COMBINE_MIN_BYTES else "rows"
    if combine == "atomic":
        out32 = torch.zeros((T, H), dtype=torch.float32, device=x.device)
        if ws2:
            ws_gemm.gemm(a2, a2_scale, w2, w2_scale, b2, out32, routing, gemm=2,
                         activation="none", tile=tile2, quant=quant, atomic=True)
        else:
            gemm2(a2, a2_scale, w2, w2_scale, b2, out32, routing, config2, quant=quant,
                  atomic_out=True, interpret_upcast=upcast, w2_global_scale=w2_global_scale)
        return out32 if x.dtype == torch.float32 else out32.to(x.dtype)
    # (a split GEMM2: split2 parts of every pair row, fp32 so that only the combine rounds)
    pair_out = torch.empty((split2 * routing.num_pairs, H),
                           dtype=torch.float32 if split2 > 1 else x.dtype, device=x.device)
    if fp8_ws:
        ws_fp4.gemm(a2, w2, w2_scale, None, b2, pair_out, routing, gemm=2, activation="none",
                    quant=quant, a_scale=a2_scale, consumers=consumers2, split=split2)
    elif ws_fp4_2:
        ws_fp4.gemm(a2, w2, w2_scale, w2_global_scale, b2, pair_out, routing, gemm=2,
                    activation="none", quant=quant, slots=fp4_slots,
                    consumers=consumers2, split=split2)
    elif ws2:
        ws_gemm.gemm(a2, a2_scale, w2, w2_scale, b2, pair_out, routing, gemm=2,
                     activation="none", tile=tile2, quant=quant)
    else:
        gemm2(a2, a2_scale, w2, w2_scale, b2, pair_out, routing, config2, quant=quant,
              atomic_out=False, interpret_upcast=upcast, w2_global_scale=w2_global_scale)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    combine_pair_rows(pair_out, routing, out, splits=split2)
    return out
