"""nvfp4 and mxfp4 (W4A16) GEMMs on Hopper, warp-specialized (Gluon), and an fp8 decode form of the
same schedule (FMT 2: e4m3 weights converted to f16 in registers; off by default, measured
slower than grouped_gemm's tiles: experts.WS_FP8_DECODE). Run for both GEMMs of
4-bit decode calls up to 8 routed rows an expert (experts.WS_FP4, WS_FP4_MAX_ROWS) and of
prefill calls, in a 64-slot form from 8 rows an expert (experts.WS_FP4_PREFILL_MIN_ROWS) and a
128-slot form from 64 (WS_FP4_WIDE_MIN_ROWS, with HALF_BLOCKS, and for nvfp4 below 128 rows
an expert QUARTER_BLOCKS and SMALL_X_BOXES: DeepSeek-V3 T = 2048 5-8% faster): measured on an
H200, DeepSeek-V3's nvfp4 layer 8-15% faster than on grouped_gemm's Triton kernels at T = 4-128,
21% / 6% at T = 256 / 512 with up to 16 rows an expert against up to 4 (and 512 13% faster
again with the 64-slot form from 8 rows), 24% at T = 1024 with the 64-slot form and 27-24%
at T = 4096-16384 with the 128-slot one (a further 6-8% with the early epilogue and half
blocks; gpt-oss 1-2%); gpt-oss-120b's mxfp4 layer up to 4% at decode, 14-33% at prefill (the figures
beside experts.WS_FP4_QUANTS, WS_FP4_MAX_ROWS, WS_FP4_PREFILL_MIN_ROWS, WS_FP4_WIDE_MIN_ROWS
and this module's EARLY_EPILOGUE and HALF_BLOCKS).

Why: grouped_gemm's Triton W4A16 decode loop spends 5.1 SASS instructions a weight value, of
which the e2m1 decode itself is about 3; the rest is what Triton wraps around it (per-wgmma
fences, layout bookkeeping, address arithmetic), and one warpgroup both streams and decodes.
Here the schedule is explicit:
  producer   1 warp: TMA loads of each K step (256 columns) of 128 weight rows' packed bytes
             (quant.py's kernel order, a 3-D box over [rows, 4 runs, Kp/8]), 16 bytes a row of
             their block scales (nvfp4: the step's 16 e4m3; mxfp4: 8 e8m0 a step, under TMA's
             16-byte minimum box and coordinate alignment, so an even step's and the next's,
             each consumer taking its step's half) and the 16 activation rows (slots)
             of the tile, into a ring of STAGES slots
  consumers  2 (or 3, 4) warpgroups, 64 weight rows each: the packed tile is read from shared
             memory in the layout of wgmma's A fragment (each thread its two rows' runs),
             decoded with fp4_decode's inline PTX and given to `warpgroup_mma` as its
             register operand; the layout conversions are proved trivial at compile time
             (assert_trivial). The four threads sharing a row pair convert a quarter of its
             block scales each and exchange them. PIPELINE: each decodes step k + 1 while its
             wgmma of step k runs. TAIL: a last K step whose real columns fit in its first
             quarter or half (the layout pads K to whole steps) is decoded and multiplied that
             far only.
Swap-AB: the weight rows are the MMA's M side, the dispatch's 16-slot blocks its N side (decode:
up to 8 routed rows an expert; prefill's forms: 64- and 128-slot blocks, PREFILL_SLOTS and
WIDE_SLOTS). N need only be a multiple of 64: a consumer whose rows of the last tile lie past
N idles through the ring.
Its sm_90 K loop: 2.43 instructions a weight value for nvfp4 (benchmarks/dev_gluon_fp4_decode.py
--aot), against the Triton loop's 5.1; mxfp4 took 2.83 while its decode multiplied twice
(2^126, then the scale), one multiply since the layout folds its block scales to at most 2
(quant.mxfp4_fold_scales; see fp4_decode's _E2M1_BF16_ASM); 3.30 and 3.70 before the kernel order permuted each word's bits
for the decode (quant.FP4_WORD_BITS: DeepSeek-V3 nvfp4 T = 1 / 16 / 64 103.6 / 785 / 1579 ->
89.8 / 706 / 1421 us, gpt-oss-120b mxfp4 53.2 / 339 / 703 -> 46.0 / 275 / 568, the prefill
GEMMs 5-6% faster; results/h200_ab_fp4_layout_*.json).

Contract (grouped_gemm's, dispatch mode only): activation rows [slots, K] in dispatch order
(GEMM1's gathered by align.gather_rows, or by the dispatch's own launch,
align.moe_align_gather, whose padding rows hold anything, NaN included: a slot is its own
column of the MMA, its results dropped), bf16; weights [E, N, Kp/2] kernel-order packed
with e4m3 scales [E, N, Kp/16] (nvfp4) or e8m0 scales [E, N, Kp/32] at most 128 (mxfp4, Kp a
multiple of 512), and the layout's scale per row [E, N] (nvfp4's global scale, mxfp4's fold);
bias [E, N] or None. GEMM1 writes act(.) into
intermediate[slot] (gate/up rows interleaved), GEMM2 writes topk_weight * (.) into out[pair]
(split into parts of K, SPLIT_K: part p's partial rows into out[p * num_pairs + pair], the bias
with part 0's, summed by combine_pair_rows); padding slots are never written.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_ops.kernels.common import device_properties
from moe_ops.kernels.fp4_decode import MXFP4_FAST_BIAS, _E2M1_BF16_ASM, _E4M3_TO_BF16_P117
from moe_ops.kernels.grouped_gemm import _launcher
from moe_ops.kernels.ws_gemm import (
    ACTIVATIONS, NATIVE_CAST, release_steps, available, ring_barriers, ring_next, to_out,
    write_rows)
from moe_ops.kernels.env import env_choice

QUANTS = ("nvfp4", "mxfp4", "fp8")
FMT = {"nvfp4": 0, "mxfp4": 1, "fp8": 2}    # the kernel's weight format switch
GROUP = {"nvfp4": 16, "mxfp4": 32}      # columns a block scale
ROWS = 64                  # weight rows a consumer warpgroup (the MMA's M)
BLOCK_M = 16               # dispatch slots a tile (the MMA's N) at decode
# Prefill's form: 64 slots a tile, so each decoded weight tile feeds 4 times the MMA work
# (m64n64k16 wgmmas): the decode's integer work, ~0.45 us a K step on an SM against the
# MMA's ~0.8 us at bf16's rate, can hide behind the other consumer's MMA. Two consumers only
# (112 registers a thread of four hold neither the [64, 64] fp32 tile nor the operand beside
# the decode), 3 ring slots of 50 KB (the epilogue's layout exchange takes 16 KB a consumer
# more: 4 slots would pass the 227 KB a block). Measured and turned on: the figures beside
# experts.WS_FP4_PREFILL_MIN_ROWS.
PREFILL_SLOTS = 64
# Prefill's wide form: 128 slots a tile (m64n128k16 wgmmas), each decoded weight tile feeding 8
# times decode's MMA work, so the decode's share of a consumer's K step halves again. Two ring
# slots of 82 KB (a K step's [128, 256] bf16 activations are 64 KB), and the epilogue's layout
# exchange in two 64-slot pieces (16 KB a consumer: the whole [128, 64] fp32 tile's 32 KB would
# pass the 227 KB a block beside the ring); serial consumers only (two decoded operands and the
# 64-register accumulator would pass the 232 registers a thread). From 128 rows an expert, where
# the dispatch's padding to 128 rows is a small enough share: experts.WS_FP4_WIDE_MIN_ROWS.
WIDE_SLOTS = 128
SLOTS = (BLOCK_M, PREFILL_SLOTS, WIDE_SLOTS)
BLOCK_K = 256              # columns a K step: 4 runs of 32 bytes a row
STAGES = {BLOCK_M: 4, PREFILL_SLOTS: 3, WIDE_SLOTS: 2}     # ring slots by the form's slots a tile
# fp8 (per tensor, decode's 16-slot form only): e4m3 weights [E, N, K] as they are in the kernel
# layout, a K step of 128 columns (one 128-byte swizzled TMA box a row), each consumer reading
# its [64, 128] bytes in wgmma's A-operand layout and converting them to f16 two at a time
# (one cvt a pair: no integer decode, so the K loop is loads, converts and wgmmas); the
# activations f16 holding act_quant's e4m3 values (exact in f16, so f16 x f16 products into
# fp32 give the W8A8 result without fp8 wgmma's truncated accumulation, see
# experts.FP8_SWAP_AB), one scale a slot, applied to the accumulator's columns with the row
# scale (the layout's per-row weight scale) and bias after the loop. Ring slots: a step is
# 16 KB of weights a 128-row tile and 4 KB of activations.
FP8_BLOCK_K = 128
FP8_STAGES = {2: 8, 3: 5, 4: 5}
# (consumers: "auto" two, 128-row tiles, or what split_for picks for a split GEMM2)
FP8_CONSUMERS = env_choice("MOE_OPS_WS_FP8_DECODE_CONSUMERS", "auto", ("auto", "2", "3", "4"))
# consumer warpgroups -> registers a worker consumer thread, a producer thread, the launch's
# maxnreg (the default partition, consumer 0, gets what is left). The launch holds maxnreg a
# thread for all its warps, the producer's padded to a warpgroup: 12 warps x 168 = 64512 and
# 20 x 96 = 61440 of the 65536 registers a block, multiples of 8 (registers are allocated 256
# a warp: a budget over 65536 fails the launch, and setmaxnreg could not balance). Four
# consumers (a tile of 256 weight rows) give the schedulers more warps to hide the decode's
# dependent integer chains, with fewer registers each; MOE_OPS_WS_FP4_CONSUMERS=4 picks four.
# Three (a tile of 192 rows; 16 warps x 128 at launch, then 160 a worker consumer thread, 24 a
# producer one and the 168 left to consumer 0: 2 x 128 x 160 + 128 x 24 + 128 x 168 = 65536;
# the producer loads only the 64-row boxes before N) put a third decoding warp on each
# scheduler where two leave it idle half the time (results/h200_ncu_ws_fp4_decode.txt: 0.5
# instructions issued a cycle, the consumers' stalls mostly dependency latency); N then runs
# in tiles of 192 with the last one partial (PARTIAL_N). Measured on an H200, the decode layers
# as graph replays in two alternated runs (results/h200_ab_fp4_decode_c*.json, 2026-12-01):
# DeepSeek-V3 nvfp4 T = 4 / 16 / 64 336 / 868 / 1722 -> 302 / 780 / 1600 us, but T = 1 (8
# experts, fewer and longer tiles) 106 -> 126; gpt-oss mxfp4 then slower at every T (T = 16
# 340 -> 458: its decode's second multiplies wanted the registers). With mxfp4's decode at one
# multiply (quant.mxfp4_fold_scales) three win there too, by less (results/h200_ab_fold4_*.json,
# 2026-12-02: gpt-oss-120b T = 16 / 64 263.7 / 548.5 and 539.9 -> 259.4 / 530.0 and 526.3 us,
# T = 1 / 4 equal). So "auto" (the default): three from THREE_CONSUMERS_MIN_PAIRS routed pairs,
# below that three for a GEMM whose 192-row tiles take fewer rows of waves (see _row_waves),
# else two. Four for nvfp4 from FOUR_CONSUMERS_MIN_PAIRS (256-row tiles, 20 warps at 96-112
# registers a thread, no spills at sm_90): measured on an H200 (results/h200_ab_consumers4_*.json,
# 2026-12-02, graph replays, two alternated passes, the rule then against four): DeepSeek-V3
# nvfp4 T = 16 (128 pairs) 708.7, 708.8 -> 690.8, 693.1 us, T = 64 1420.0, 1422.6 -> 1407.1,
# 1383.2, but T = 4 (32 pairs) 269.3 -> 274.5 and T = 1 equal; gpt-oss-120b mxfp4 slower at
# every T (T = 16 258.8 -> 302.0: its decode keeps more values live). MOE_OPS_WS_FP4_CONSUMERS=
# 2|3|4 forces a count for both GEMMs of a call, "a,b" one for each (GEMM1 a, GEMM2 b).
REGISTERS = {2: (232, 40, 168), 3: (160, 24, 128), 4: (112, 24, 96)}
CONSUMERS = env_choice("MOE_OPS_WS_FP4_CONSUMERS", "auto", ("auto", "2", "3", "4") + tuple(
    f"{a},{b}" for a in REGISTERS for b in REGISTERS))
THREE_CONSUMERS_MIN_PAIRS = 32
FOUR_CONSUMERS_MIN_PAIRS = {"nvfp4": 128}
# GEMM2's K steps split over SPLIT work items a tile at decode (the 16-slot form, serial
# consumers, the early epilogue), part p writing its partial rows into out[p * num_pairs +
# pair] (the bias with part 0's) and combine_pair_rows summing a token's k x SPLIT rows in
# fp32: few experts' GEMM2 is a wave of tiles or less (gpt-oss-120b T = 1: 92 tiles of 128 rows
# or 60 of 192 on 132 SMs; the fp8 form's Mixtral T = 1: 64), and a tile's time is its K
# steps. "auto" picks the consumers and SPLIT (1-4) that give an SM the fewest weight rows x K
# steps (split_for: gpt-oss T = 1's GEMM2 three consumers, two parts); 2 / 3 / 4 force a count
# where the steps allow it. The parts' rows are fp32 (one rounding, in the combine). Measured on
# an H200 (results/h200_ab_splitk_*.json, 2026-12-02, graph replays, 0 / auto alternated twice):
# no gain on the 4-bit layers (DeepSeek-V3 nvfp4 T = 1 / 4 91.7, 91.9 / 273.0, 273.6 -> 93.6,
# 94.7 / 284.1, 283.8 us; gpt-oss-120b mxfp4 T = 1 42.3, 41.7 -> 41.6, 41.6, T = 4 equal); the
# fp8 form gains (Mixtral T = 1 119.3 -> 108.6 us, Llama 4 64.9 -> 53.9) but stays behind
# grouped_gemm's fp8 tiles (103.9 and 49.7 us). So off ("0").
SPLIT_K = env_choice("MOE_OPS_WS_FP4_SPLIT_K", "0", ("0", "auto", "2", "3", "4"))
SPLITS = (1, 2, 3, 4)
SPLIT_ITEM_STEPS = 1
# The last K step's padding: the kernel layout pads K to whole steps (mxfp4: pairs of steps),
# and a step past the activations' columns multiplies zeros (TMA fills the activation box past
# K with zeros, the layout's padding codes are zeros). With TAIL on, the plain consumers decode
# and multiply only the first quarter or half of a last step whose real columns fit there
# (tail_slices: 4 or 8 of its 16 slices; the result is the same, the skipped products being
# zeros). Why: gpt-oss-120b's K = 2880 is 11 steps and 64 columns, its layout 12 steps
# (3072), so 6.25% of each tile's decode, the 4-bit GEMMs' bound at decode, was padding.
# Measured on an H200 (results/h200_ab_tail_*.json, 2026-12-02, graph replays, two alternated
# passes, gpt-oss-120b mxfp4, off -> on everywhere): T = 4 (two consumers) 103.6, 103.1 ->
# 101.9, 101.9 us and T = 16384 (the prefill forms: two) 6703, 6685 -> 6571, 6618, T = 1 and
# 4096 equal, but T = 16 / 64 (three consumers) 264.6, 264.5 / 541.7, 540.8 -> 277.9, 277.7 /
# 560.6, 560.8 (the same with the tail as a branch in the K loop instead of a peeled last pair,
# ~11% more code a consumer instead of ~40%: results/h200_ab_tailx_*.json, code at the tag
# exp/ws-fp4-tail-branch; so not the instruction caches; the K loop's SASS is the same with and
# without, and the tail step adds two shared-memory exchanges of its block scales a consumer;
# the cause of the ~0.5 us a tile is not known). Then on the final rule (results/h200_ab_tailc_*.json): T = 4
# 102.1 -> 100.1-100.7, T = 4096 / 16384 2134-2168 / 6795-6869 -> 2051-2107 / 6699-6733. So
# "auto" (the default): on for launches of two consumers; "1" always, "0" never.
TAIL = env_choice("MOE_OPS_WS_FP4_TAIL", "auto", ("auto", "0", "1"))
# A consumer's decode of K step k + 1 while its wgmma of step k runs (a second register operand)
# instead of decode, MMA, wait in turn. Measured on an H200 (results/h200_ab_fp4_rows_16_*.json,
# h200_gluon_fp4_decode_pipelined.json, 2026-12-01): DeepSeek-V3 nvfp4 decode T = 16-512 6-7%
# slower (T = 16 884 -> 938 us); so off unless MOE_OPS_WS_FP4_PIPELINE=1 (at decode the wgmma
# of N = 16 is short; prefill's 64-slot form may gain: PREFILL_PIPELINE below).
PIPELINE = env_choice("MOE_OPS_WS_FP4_PIPELINE", "0", ("0", "1")) == "1"
# N a multiple of 64 but not of the tile (the last tile's consumers past N idle; see the module
# docstring): its GPU tests passed (results/h200_pytest_ws_fp4_*.log, 2026-12-01), and it runs
# gpt-oss-120b's GEMM2 (N = 2880) in the figures beside experts.WS_FP4_QUANTS; so on
# (MOE_OPS_WS_FP4_PARTIAL_N=0: such launches on grouped_gemm's kernels).
PARTIAL_N_OK = env_choice("MOE_OPS_WS_FP4_PARTIAL_N", "1", ("0", "1")) == "1"
# The same for the 64-slot prefill form (its wgmmas 4 times longer): measured on an H200
# (results/h200_ab_fp4_prefill_32_1_1.json, h200_gluon_fp4_decode_prefill.json, 2026-12-01)
# 3-10% slower than the plain consumers (DeepSeek-V3 nvfp4 T = 4096 9199 -> 9807 us; GEMM1's
# shape alone 444 -> 425 TFLOP/s); so off unless MOE_OPS_WS_FP4_PREFILL_PIPELINE=1.
PREFILL_PIPELINE = env_choice("MOE_OPS_WS_FP4_PREFILL_PIPELINE", "0", ("0", "1")) == "1"
# The epilogue's operands (the rows' global scales and bias, the slots' pair ids and GEMM2's
# routing weights, two dependent global loads) loaded before a tile's K loop instead of after
# it, so their latency hides under the loop instead of idling both consumers at every tile's
# end; and GEMM2's tile goes to its coalesced store layout in one exchange instead of two.
# Why: at the 128-slot form's rates (results/h200_gluon_fp4_prefill_128.json) GEMM2's shape
# (8 K steps a tile) runs at 495 TFLOP/s against GEMM1's (28) 548-573, as if each tile cost
# ~2 K steps more than its loop. Measured on an H200 (results/h200_ab_early_*.json,
# h200_gluon_fp4_early.json, 2026-12-01, with and without): GEMM2's shape at 256 rows an expert
# 492 -> 522 TFLOP/s, GEMM1's at 1024 572 -> 581; DeepSeek-V3 nvfp4 T = 16384 26905 -> 24426 us
# (eager 24576 -> 24260), gpt-oss-120b mxfp4 7591 -> 7415; decode equal. So on
# (MOE_OPS_WS_FP4_EARLY_EPILOGUE=0: after the loop).
EARLY_EPILOGUE = env_choice("MOE_OPS_WS_FP4_EARLY_EPILOGUE", "1", ("0", "1")) == "1"
# The 128-slot form's half blocks: a block whose second 64 slots are padding (an expert's last
# block holding 64 routed rows or fewer; each expert's padding follows its pairs) runs its
# wgmmas on the first 64 only (m64n64k16: half the MMA work for the same decode). Why: at 128
# rows an expert on average about a third of the blocks are such (DeepSeek-V3 T = 4096), at
# 512 about a tenth. Measured on an H200 (results/h200_ab_half_*.json, 2026-12-01, early
# epilogue on), graph replays, 128-slot form from 128 rows an expert without them / with them
# from 64: DeepSeek-V3 nvfp4 T = 2048 / 4096 / 8192 / 16384 5694 / 8339 / 13888 / 24409 ->
# 5231 / 7898 / 13299 / 23932 us; gpt-oss-120b mxfp4 1632 / 2489 / 4176 / 7659 -> 1571 / 2341 /
# 4033 / 7568. So on, and the form taken from 64 rows (experts.WS_FP4_WIDE_MIN_ROWS;
# MOE_OPS_WS_FP4_HALF_BLOCKS=0: whole blocks always).
HALF_BLOCKS = env_choice("MOE_OPS_WS_FP4_HALF_BLOCKS", "1", ("0", "1")) == "1"
# ... and quarter blocks: a block whose slots from 32 on are padding (an expert's last block of
# 32 routed rows or fewer) runs m64n32k16 wgmmas on its first 32 (the kernel's HALF_BLOCKS
# level 2); and the activation rows those blocks read only (SMALL_X_BOXES): the 128-slot form's
# activations loaded in four 32-row TMA boxes a K step, of which a half block takes two and a
# quarter block one (the kernel's X_BOXES 4), instead of one 128-row box whatever the block's
# live rows (64 KB a step). Why: the 4-bit prefill GEMMs run at the board's power limit (NOTES,
# fourteenth session), so MMA work and L2 traffic on padding slots cost time; at DeepSeek-V3
# T = 2048 (64 +- 8 rows an expert) every expert's only block is at most half live, and about
# half the experts at T = 4096 end in a block of 1-20 rows. Measured on an H200 (results/
# h200_ab_quarter_*.json, h200_ab_wpipe_*.json, 2026-12-02, graph replays, four passes of the
# plain form against quarter blocks with small boxes, two against quarter blocks alone):
# DeepSeek-V3 nvfp4 T = 2048 4830-5124 -> 4545-4717 us (quarter blocks alone 4994), T = 4096
# 7349-7656 -> 7318-7531, T = 8192 / 16384 within the spread or up to 2% slower; gpt-oss-120b
# mxfp4 slower at every T (T = 2048 1367-1432 -> 1454-1487, 16384 6674-7068 -> 7227-7472; its
# quarter builds are larger, mxfp4's tail step runs whole there). So "auto": both for nvfp4
# launches of fewer than NARROW_BLOCKS_MAX_ROWS routed rows an expert (a 128-slot form from 64,
# experts.WS_FP4_WIDE_MIN_ROWS); "1" always, "0" never (both with HALF_BLOCKS).
QUARTER_BLOCKS = env_choice("MOE_OPS_WS_FP4_QUARTER_BLOCKS", "auto", ("auto", "0", "1"))
SMALL_X_BOXES = env_choice("MOE_OPS_WS_FP4_SMALL_X_BOXES", "auto", ("auto", "0", "1"))
NARROW_BLOCKS_MAX_ROWS = 128
X_BOX_ROWS = 32
# GEMM1's swiglu / swiglu_oai sigmoid on tanh.approx (ws_gemm.write_rows' FAST_SIGMOID, on by
# default in ws_gemm). Off here: the 4-bit layers measured no faster with it (results/
# h200_ab_fastsig4_*_thirtieth.json, DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 1024-16384,
# two alternated passes: 1.000 of the time in the geometric mean; their K loops' weight decode,
# not the epilogue, is where these GEMMs spend their issue), and the 128-slot mxfp4 GEMM1's
# quarter-block build spills in its K loop with it (25 local accesses; test_quarter_blocks_build).
# MOE_OPS_WS_FP4_FAST_SIGMOID=1: on.
FAST_SIGMOID = env_choice("MOE_OPS_WS_FP4_FAST_SIGMOID", "0", ("0", "1")) == "1"
# [slots, 64 columns] layouts of the epilogue: gate/up pairs in one thread (GEMM1's
# activation), and 8 consecutive columns a thread (16-byte stores of GEMM2's rows)
PAIRS_LAYOUT = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])
STORE_LAYOUT = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

# One K step's packed bytes of a warpgroup's 64 rows, [64, 128] (byte j = 32t + 2c + q of a row:
# run t, slice c, pair q; 4 of them a kernel-order word, whose bits are permuted, so each
# thread's 4 consecutive bytes stay a memory word): each thread holds its two rows' (r, r + 8) run t, the bytes wgmma's A
# fragment needs (rows 16w + l/4 and + 8, columns 16c + 2t + q and + 8). The same for the
# first C slices of a step only (a tail step, see TAIL): bytes 2c + q < 2C of each run, [64, 8C]
# with j = 2Ct + 2c + q; as [row, t, byte] (the shared memory's shape), and as [row, t, c, q].
@gluon.constexpr_function
def packed_layout(slices):
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range((2 * slices).bit_length() - 1)] + [[8, 0]],
        lane_bases=[[0, 2 * slices], [0, 4 * slices], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, 8 * slices])


@gluon.constexpr_function
def packed_layout_3d(slices):
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range((2 * slices).bit_length() - 1)] + [[8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[ROWS, 4, 2 * slices])


@gluon.constexpr_function
def packed_layout_4d(slices):
    return gl.DistributedLinearLayout(
        reg_bases=([[0, 0, 0, 1]] + [[0, 0, 1 << i, 0] for i in range(slices.bit_length() - 1)]
                   + [[8, 0, 0, 0]]),
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[ROWS, 4, slices, 2])


# A K step's scale bytes [64 rows, 16 slices], a quarter of each row pair's per thread
SCALES_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]],
    lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, 16])
# mxfp4: a K step's 8 scale bytes [64 rows, 8 groups], a quarter of each row pair's per thread
MX_SCALES_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, 8])


@gluon.jit
def decode_step(packed, scales, C: gl.constexpr, DOT: gl.constexpr, FMT: gl.constexpr):
    """Packed bytes [64, 8C] (packed_layout(C)) and the step's scale bytes -> the first 16C
    columns of the weight tile [64, 16C] in wgmma's A-operand layout (DOT), bf16 (C = 16: the
    whole step; 4 or 8: a tail step, see TAIL). nvfp4 (FMT 0): e4m3 scales [64, 16]
    (SCALES_LAYOUT), one per 16-column slice c, the tile's values / 512 (NVFP4_FAST_EPILOGUE).
    mxfp4 (FMT 1): e8m0 scales [64, 8] (MX_SCALES_LAYOUT), one per 32 columns (slices 2g and
    2g + 1), the tile's values / their row's scale (the layout's fold)."""
    P2: gl.constexpr = packed_layout(C)
    P4: gl.constexpr = packed_layout_4d(C)
    if FMT == 1:
        # 2^(s - 1) (the code's 2^-126 and 2^(s - 127), s <= 128): s + 126 is bf16's exponent
        # field; slice c takes group c // 2
        g = ((scales.to(gl.int16) + MXFP4_FAST_BIAS) << 7).to(gl.bfloat16, bitcast=True)
        factor = gl.reshape(gl.join(g, g), [64, 16])
    else:
        # block scales * 2^117 by bit moves, four a register
        factor = gl.inline_asm_elementwise(_E4M3_TO_BF16_P117, "=r,=r,r", [scales],
                                           dtype=gl.bfloat16, is_pure=True, pack=4)
    # every thread of a row pair gets all 16 (a warp-local exchange)
    factor = gl.convert_layout(factor, gl.SliceLayout(2, gl.SliceLayout(1, packed_layout_4d(16))))
    if C < 16:
        factor = gl.convert_layout(_first_slices(factor, C), gl.SliceLayout(2, gl.SliceLayout(1, P4)))
    # each code's factor: [row, c] -> [row, t, c, q] -> the packed bytes' positions
    factor = gl.expand_dims(gl.expand_dims(factor, 2), 1)
    factor = gl.broadcast(factor, gl.full([64, 4, C, 2], 0.0, gl.bfloat16, P4))[0]
    factor = gl.convert_layout(gl.reshape(factor, [64, 8 * C]), P2, assert_trivial=True)
    low, high = gl.inline_asm_elementwise(
        _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [packed, factor],
        dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    # element j = 2Ct + 2c + q (its word's byte j % 4, bits permuted) decodes to columns
    # 16c + 2t + q (low) and + 8 (high)
    values = gl.reshape(gl.join(low, high), [64, 4, C, 2, 2])              # [row, t, c, q, h]
    values = gl.reshape(gl.permute(values, [0, 2, 4, 1, 3]), [64, 16 * C])  # k = 16c+8h+2t+q
    return gl.convert_layout(values, DOT, assert_trivial=True)


@gluon.jit
def _first_slices(factor, C: gl.constexpr):
    """A K step's factors [64, 16 slices], each thread holding all 16 of its rows -> those of
    the first C slices (4 or 8) [64, C], by splits along register bits (no data moves)."""
    if C == 8:
        first, _ = gl.split(gl.permute(gl.reshape(factor, [64, 2, 8]), [0, 2, 1]))
    else:
        first, _ = gl.split(gl.permute(gl.reshape(factor, [64, 2, 2, 4]), [0, 3, 2, 1]))
        first, _ = gl.split(first)
    return first


@gluon.jit
def live_block(sorted_pair_ids_ptr, pid_m, num_pairs, BM: gl.constexpr):
    """Whether dispatch block pid_m (BM slots) holds a routed pair: each expert's padding comes
    after its pairs, so a block whose first slot holds none is padding throughout. Such blocks
    arise when the dispatch is aligned to more than BM rows (grouped_gemm's config for the other
    GEMM): the producer loads nothing for them and the consumers compute and write nothing,
    each partition reading the same slot, so their rings stay in step."""
    return gl.load(sorted_pair_ids_ptr + pid_m * BM) < num_pairs


@gluon.jit
def split_range(item, k_steps, SPLIT: gl.constexpr, FMT: gl.constexpr):
    """A work item of the persistent loop -> (tile, part, first K step, end K step): with
    SPLIT > 1 (GEMM2's split of K, see SPLIT_K) each tile's K steps in SPLIT parts as equal as
    whole units divide them (mxfp4: units of 2 steps, its scale loads' pairs)."""
    if SPLIT == 1:
        tile = item
        part = 0
        kb0 = 0
        kb1 = k_steps
    else:
        UNIT: gl.constexpr = 2 if FMT == 1 else 1
        tile = item // SPLIT
        part = item % SPLIT
        units = k_steps // UNIT
        kb0 = (part * units // SPLIT) * UNIT
        kb1 = ((part + 1) * units // SPLIT) * UNIT
    return tile, part, kb0, kb1


@gluon.jit
def _load_rows(w_desc, s_desc, row, kb, bar, w_buf, s_buf, FMT: gl.constexpr):
    """One TMA box of weight rows (from `row`) of K step kb into w_buf, and for the 4-bit
    formats their block scales into s_buf; completion counted on `bar`."""
    if FMT == 2:
        # fp8: [rows, 128] e4m3 bytes, no block scales
        tma.async_copy_global_to_shared(w_desc, [row, kb * w_desc.block_type.shape[1]], bar,
                                        w_buf)
    else:
        tma.async_copy_global_to_shared(w_desc, [row, 0, kb * 32], bar, w_buf)
        # 16 scale bytes a row: a step's (nvfp4), two steps' (mxfp4: 8 a step; a TMA box is 16
        # bytes or more and its innermost coordinate 16-byte aligned, so steps 2j and 2j + 1
        # both load those of both, each consumer reading its half)
        tma.async_copy_global_to_shared(s_desc, [row, (kb >> FMT) * 16], bar, s_buf)


@gluon.jit
def _producer(descs, smem, ptrs, sizes, strides, ALIGN_M: gl.constexpr,
              ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, FMT: gl.constexpr,
              PARTIAL_N: gl.constexpr, TILE_N: gl.constexpr, SPLIT: gl.constexpr,
              HALF_BLOCKS: gl.constexpr = 0):
    w_desc, s_desc, x_desc = descs
    w_bufs, s_bufs, x_bufs, ready, empty = smem
    sorted_pair_ids_ptr = ptrs[3]
    block_expert_ptr = ptrs[5]
    num_padded_ptr = ptrs[6]
    N, KP, num_pairs = sizes[0], sizes[1], sizes[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BN: gl.constexpr = TILE_N
    BM: gl.constexpr = x_bufs.type.shape[1]
    BOX: gl.constexpr = w_desc.block_type.shape[0]
    BOXES: gl.constexpr = BN // BOX
    STEP: gl.constexpr = x_desc.block_type.shape[1]     # K columns a step (fp8 128, 4-bit 256)
    X_BOX: gl.constexpr = x_desc.block_type.shape[0]    # (SMALL_X_BOXES: 32 of BM's 128)
    X_BYTES: gl.constexpr = x_desc.block_type.nbytes
    # (small boxes: the 128-slot form's one weight box a tile and its half / quarter blocks)
    gl.static_assert(X_BOX == BM or (BN == BOX and HALF_BLOCKS > 0))
    # a box's bytes: its weight rows and (4-bit) their block scales
    BOX_BYTES: gl.constexpr = (w_desc.block_type.nbytes if FMT == 2
                               else w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    num_m = gl.load(num_padded_ptr) // BM
    num_n = N // BN
    if PARTIAL_N:
        num_n = gl.cdiv(N, BN)
    k_steps = KP // STEP
    index = 0
    phase = 1  # a fresh mbarrier counts as having completed the phase before its first
    for item in range(gl.program_id(0), num_m * num_n * SPLIT, gl.num_programs(0)):
        tile, part, kb0, kb1 = split_range(item, k_steps, SPLIT, FMT)
        pid_m = tile // num_n
        # blocks of padding only are skipped by every partition alike (see live_block)
        if live_block(sorted_pair_ids_ptr, pid_m, num_pairs, BM):
            expert = gl.load(block_expert_ptr + pid_m * BM // ALIGN_M)
            row0 = expert * N + (tile % num_n) * BN
            # (BOXES > 1: the tile's boxes holding rows before N; N is a multiple of BOX)
            boxes_live = gl.minimum((N - (tile % num_n) * BN) // BOX, BOXES)
            if X_BOX < BM:
                # (SMALL_X_BOXES) the activation boxes the consumers' path reads: 4 for a whole
                # block, 2 for a half one, 1 for a quarter one (HALF_BLOCKS 2; each expert's
                # padding follows its pairs)
                whole = live_block(sorted_pair_ids_ptr, pid_m * 2 + 1, num_pairs, 64)
                if HALF_BLOCKS == 2:
                    past_quarter = live_block(sorted_pair_ids_ptr, pid_m * 4 + 1, num_pairs, 32)
                    x_live = 1 + past_quarter.to(gl.int32) + 2 * whole.to(gl.int32)
                else:
                    x_live = 2 + 2 * whole.to(gl.int32)
            for kb in range(kb0, kb1):
                mbarrier.wait(empty.index(index), phase)
                bar = ready.index(index)
                if X_BOX < BM:
                    # (SMALL_X_BOXES: the 128-slot form, one weight box) x_live activation
                    # boxes, one static branch a count (the expected bytes a constant)
                    for i in gl.static_range(3):
                        if x_live == (1 << i):
                            mbarrier.expect(bar, BOX_BYTES + (1 << i) * X_BYTES)
                            _load_rows(w_desc, s_desc, row0, kb, bar, w_bufs.index(index),
                                       s_bufs.index(index), FMT)
                            for b in gl.static_range(1 << i):
                                tma.async_copy_global_to_shared(
                                    x_desc, [pid_m * BM + b * X_BOX, kb * STEP], bar,
                                    x_bufs.index(index).slice(b * X_BOX, X_BOX, dim=0))
                elif BOXES == 1:
                    # the tile's one box, whole (a partial last tile's rows past N belong to
                    # the next expert, or lie past the end, where TMA fills zeros and still
                    # counts the box's bytes; their consumers never read them)
                    mbarrier.expect(bar, BOX_BYTES + x_desc.block_type.nbytes)
                    _load_rows(w_desc, s_desc, row0, kb, bar, w_bufs.index(index),
                               s_bufs.index(index), FMT)
                else:
                    # the boxes of rows before N only (a partial last tile's others belong to
                    # the next expert, or lie past the end; their consumers never read them):
                    # one static branch a count, the expected bytes a compile-time constant
                    for live in gl.static_range(1, BOXES + 1):
                        if boxes_live == live:
                            mbarrier.expect(bar, live * BOX_BYTES + x_desc.block_type.nbytes)
                            for b in gl.static_range(live):
                                _load_rows(w_desc, s_desc, row0 + b * BOX, kb, bar,
                                           w_bufs.index(index).slice(b * BOX, BOX, dim=0),
                                           s_bufs.index(index).slice(b * BOX, BOX, dim=0), FMT)
                if X_BOX == BM:
                    tma.async_copy_global_to_shared(x_desc, [pid_m * BM, kb * STEP], bar,
                                                    x_bufs.index(index))
                index, phase = ring_next(index, phase, STAGES)


@gluon.jit
def _decoded(w_bufs, s_bufs, ready, index, phase, HALF: gl.constexpr, DOT: gl.constexpr,
             FMT: gl.constexpr, ODD: gl.constexpr, C: gl.constexpr = 16):
    """Ring slot `index`'s weight tile for consumer HALF, decoded into wgmma's A operand, once
    its loads have landed (mxfp4: ODD, whether the slot holds an odd K step); its first C
    16-column slices only (C < 16: a tail step, see TAIL)."""
    BN: gl.constexpr = w_bufs.type.shape[1]
    SCALES: gl.constexpr = SCALES_LAYOUT
    mbarrier.wait(ready.index(index), phase)
    if FMT == 2:
        # fp8: the step's [64, 128] e4m3 bytes read in the operand's layout (2 consecutive
        # columns a register pair), converted two at a time (cvt.rn.f16x2.e4m3x2)
        weights = w_bufs.index(index).slice(HALF * 64, 64, dim=0).load(DOT).to(gl.float16)
    else:
        if C == 16:
            packed = w_bufs.index(index).reshape([BN, 128]).slice(HALF * 64, 64, dim=0).load(
                packed_layout(16))
        else:
            # each run's first 2C bytes: [64, 4, 2C] as [64, 8C]
            packed = w_bufs.index(index).slice(HALF * 64, 64, dim=0).slice(0, 2 * C, dim=2).load(
                packed_layout_3d(C))
            packed = gl.convert_layout(gl.reshape(packed, [64, 8 * C]), packed_layout(C),
                                       assert_trivial=True)
        if FMT == 1:
            # the row's 16 loaded bytes are two K steps' scales: this step's half
            scales = s_bufs.index(index).slice(HALF * 64, 64, dim=0).slice(
                8 * ODD, 8, dim=1).load(MX_SCALES_LAYOUT)
        else:
            scales = s_bufs.index(index).slice(HALF * 64, 64, dim=0).load(SCALES)
        weights = decode_step(packed, scales, C, DOT, FMT)
    return weights


@gluon.jit
def _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index, phase, HALF: gl.constexpr,
              DOT: gl.constexpr, FMT: gl.constexpr, ODD: gl.constexpr, C: gl.constexpr = 16):
    """One K step of the plain consumer: decode, wgmma, wait (the register operand stays live
    until the MMA has read it), the slot released; the wgmma takes the slot's first
    acc.shape[1] slots (HALF_BLOCKS: 64 of 128) and its first 16C columns (C < 16: a tail
    step, see TAIL). Returns the accumulator and next slot."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    USED: gl.constexpr = acc.shape[1]
    weights = _decoded(w_bufs, s_bufs, ready, index, phase, HALF, DOT, FMT, ODD, C)
    x = x_bufs.index(index)
    if USED < x_bufs.type.shape[1]:
        x = x.slice(0, USED, dim=0)
    if C < 16:
        x = x.slice(0, 16 * C, dim=1)
    acc = warpgroup_mma(weights, x.permute((1, 0)), acc, is_async=True)
    acc, weights = warpgroup_mma_wait(num_outstanding=0, deps=(acc, weights))
    mbarrier.arrive(empty.index(index), count=1)
    index, phase = ring_next(index, phase, STAGES)
    return acc, index, phase


@gluon.jit
def _plain_k_loop(acc, w_bufs, s_bufs, x_bufs, ready, empty, index, phase, k_steps,
                  HALF: gl.constexpr, DOT: gl.constexpr, FMT: gl.constexpr,
                  TAIL: gl.constexpr = 16):
    """A tile's K steps on the plain consumer (_mma_step); mxfp4: two steps an iteration (its
    count is even), each its half of the scale bytes loaded for both. TAIL < 16: the last
    step's first TAIL slices only (the rest is the layout's padding of K, see TAIL)."""
    if FMT == 1:
        for kb in range(k_steps // 2 - (TAIL < 16)):
            acc, index, phase = _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index,
                                          phase, HALF, DOT, FMT, 0)
            acc, index, phase = _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index,
                                          phase, HALF, DOT, FMT, 1)
        if TAIL < 16:
            acc, index, phase = _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index,
                                          phase, HALF, DOT, FMT, 0)
            acc, index, phase = _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index,
                                          phase, HALF, DOT, FMT, 1, TAIL)
    else:
        for kb in range(k_steps - (TAIL < 16)):
            acc, index, phase = _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index,
                                          phase, HALF, DOT, FMT, 0)
        if TAIL < 16:
            acc, index, phase = _mma_step(acc, w_bufs, s_bufs, x_bufs, ready, empty, index,
                                          phase, HALF, DOT, FMT, 0, TAIL)
    return acc, index, phase


@gluon.jit
def _mma_then_decode_next(acc, weights, w_bufs, s_bufs, x_bufs, ready, empty, index, phase,
                          HALF: gl.constexpr, DOT: gl.constexpr, FMT: gl.constexpr,
                          NEXT_ODD: gl.constexpr):
    """One K step of the pipelined consumer: its wgmma issued on `weights`, the next slot's
    tile decoded meanwhile (NEXT_ODD: whether that is an odd K step), then the wait (the
    register operand stays live until the MMA has read it) and the slot released. Returns the
    accumulator, the next step's operand and slot."""
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    acc = warpgroup_mma(weights, x_bufs.index(index).permute((1, 0)), acc, is_async=True)
    nxt, nxt_phase = ring_next(index, phase, STAGES)
    upcoming = _decoded(w_bufs, s_bufs, ready, nxt, nxt_phase, HALF, DOT, FMT, NEXT_ODD)
    acc, weights = warpgroup_mma_wait(num_outstanding=0, deps=(acc, weights))
    mbarrier.arrive(empty.index(index), count=1)
    return acc, upcoming, nxt, nxt_phase


@gluon.jit
def _consumer(descs, smem, ptrs, sizes, strides, ALIGN_M: gl.constexpr,
              ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, HALF: gl.constexpr,
              PIPELINE: gl.constexpr, FMT: gl.constexpr, PARTIAL_N: gl.constexpr,
              EARLY: gl.constexpr, HALF_BLOCKS: gl.constexpr, TILE_N: gl.constexpr,
              SPLIT: gl.constexpr, TAIL: gl.constexpr, NATIVE_CAST: gl.constexpr,
              FAST_SIGMOID: gl.constexpr):
    w_desc, s_desc, x_desc = descs
    w_bufs, s_bufs, x_bufs, ready, empty = smem
    (gscale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, topk_weights_ptr, block_expert_ptr,
     num_padded_ptr, a_scale_ptr) = ptrs
    N, KP, num_pairs, alpha, limit = sizes
    stride_ge, stride_be, stride_om = strides
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BN: gl.constexpr = TILE_N
    BM: gl.constexpr = x_bufs.type.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # HALF_BLOCKS' half blocks: the first 64 slots of the 128
    mma_half: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    DOT_HALF: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_half, k_width=2)
    # (HALF_BLOCKS 2) quarter blocks: the first 32 slots
    mma_quarter: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, 32, 16])
    DOT_QUARTER: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_quarter,
                                                    k_width=2)
    gl.static_assert(HALF_BLOCKS == 0 or (BM == 128 and PIPELINE == 0))
    gl.static_assert(FMT != 2 or (BM == 16 and PIPELINE == 0))    # fp8: decode's serial form
    # SPLIT_K: GEMM2's decode form, serial consumers, the early epilogue
    gl.static_assert(SPLIT == 1 or (ACTIVATION == 0 and BM == 16 and PIPELINE == 0 and EARLY == 1))
    # TAIL: the plain consumers of 4-bit tiles whose K runs whole (no split)
    gl.static_assert(TAIL == 16 or (FMT != 2 and PIPELINE == 0 and SPLIT == 1))
    # ACTIVATION: an index into ws_gemm.ACTIVATIONS (0 none: GEMM2)
    num_m = gl.load(num_padded_ptr) // BM
    num_n = N // BN
    if PARTIAL_N:
        num_n = gl.cdiv(N, BN)
    k_steps = KP // x_bufs.type.shape[2]
    index = 0
    phase = 0
    for item in range(gl.program_id(0), num_m * num_n * SPLIT, gl.num_programs(0)):
        tile, part, kb0, kb1 = split_range(item, k_steps, SPLIT, FMT)
        steps = kb1 - kb0
        pid_m = tile // num_n
        if live_block(sorted_pair_ids_ptr, pid_m, num_pairs, BM):
            expert = gl.load(block_expert_ptr + pid_m * BM // ALIGN_M)
            n0 = (tile % num_n) * BN + HALF * 64
            # PARTIAL_N (N a multiple of 64, not of the tile): a half past N computes and
            # writes nothing, its part of the ring taken all the same
            past_n = False
            if PARTIAL_N:
                past_n = n0 >= N
            if past_n:
                index, phase = release_steps(ready, empty, index, phase, steps)
            else:
                if FMT == 2:
                    # fp8: the activation rows' scales (act_quant's, one a slot; a padding
                    # slot's is never written: its column is dropped), applied to the
                    # accumulator before the row scale and bias
                    slot_scale = gl.load(a_scale_ptr + pid_m * BM
                                         + gl.arange(0, BM, layout=gl.SliceLayout(0, mma)))
                if EARLY:
                    # (see EARLY_EPILOGUE: issued now, used after the K loop)
                    scale, shift = _row_terms(gscale_ptr, bias_ptr, expert, n0, stride_ge,
                                              stride_be, mma, FMT, HAS_BIAS)
                    terms0 = _slot_terms(pid_m * BM, BM, sorted_pair_ids_ptr, topk_weights_ptr,
                                         num_pairs, ACTIVATION)
                    terms1 = terms0     # (the second 64 slots' of a 128-slot tile)
                    if BM > 64:
                        terms1 = _slot_terms(pid_m * BM + 64, BM, sorted_pair_ids_ptr,
                                             topk_weights_ptr, num_pairs, ACTIVATION)
                if HALF_BLOCKS:
                    # (see HALF_BLOCKS) slot 64 padding: so are the rest
                    whole = live_block(sorted_pair_ids_ptr, pid_m * 2 + 1, num_pairs, 64)
                else:
                    whole: gl.constexpr = True    # (a static branch: no half path built)
                if whole:
                    acc = gl.zeros([64, BM], gl.float32, mma)
                    if PIPELINE:
                        # Step k + 1's decode runs while step k's wgmma does, into a second
                        # register operand: the warpgroup's integer work no longer waits for
                        # its own MMA. Two steps an iteration, so the two operands keep their
                        # registers (one step an iteration would copy the decoded tile back
                        # every step). (steps decoded here: 0, then 2j + 1 and 2j + 2, then
                        # the odd last of an even count, as mxfp4's always is)
                        w0 = _decoded(w_bufs, s_bufs, ready, index, phase, HALF, DOT, FMT, 0)
                        for kb in range((steps - 1) // 2):
                            acc, w1, index, phase = _mma_then_decode_next(
                                acc, w0, w_bufs, s_bufs, x_bufs, ready, empty, index, phase,
                                HALF, DOT, FMT, 1)
                            acc, w0, index, phase = _mma_then_decode_next(
                                acc, w1, w_bufs, s_bufs, x_bufs, ready, empty, index, phase,
                                HALF, DOT, FMT, 0)
                        if (steps - 1) % 2 == 1:
                            acc, w0, index, phase = _mma_then_decode_next(
                                acc, w0, w_bufs, s_bufs, x_bufs, ready, empty, index, phase,
                                HALF, DOT, FMT, 1)
                        acc = warpgroup_mma(w0, x_bufs.index(index).permute((1, 0)), acc,
                                            is_async=True)
                        acc, w0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w0))
                        mbarrier.arrive(empty.index(index), count=1)
                        index, phase = ring_next(index, phase, STAGES)
                    else:
                        acc, index, phase = _plain_k_loop(acc, w_bufs, s_bufs, x_bufs, ready,
                                                          empty, index, phase, steps, HALF,
                                                          DOT, FMT, TAIL)
                    if FMT == 2:
                        acc = acc * slot_scale[None, :]

                    # Epilogue: acc [weight rows, slots] * the row scale (nvfp4: * 512)
                    # (+ bias), transposed to [slots, columns] in pieces of up to 64 slots
                    # (the wide form's two: see WIDE_SLOTS); GEMM1's activation into
                    # intermediate[slot], GEMM2's routing weight into out[pair]; padding
                    # slots (pair id >= num_pairs) are not written.
                    if SPLIT > 1:
                        # (see SPLIT_K) part p's rows into out[p * num_pairs + pair]; the bias
                        # once, with part 0's
                        part_ptrs = (gscale_ptr, bias_ptr,
                                     out_ptr + part.to(gl.int64) * num_pairs * stride_om,
                                     sorted_pair_ids_ptr, topk_weights_ptr, block_expert_ptr,
                                     num_padded_ptr, a_scale_ptr)
                        _epilogue_early(acc, scale, shift * (part == 0).to(gl.float32), terms0,
                                        terms1, n0, part_ptrs, strides, alpha, limit,
                                        ACTIVATION, HAS_BIAS, FMT, NATIVE_CAST, FAST_SIGMOID)
                    elif EARLY:
                        _epilogue_early(acc, scale, shift, terms0, terms1, n0, ptrs, strides,
                                        alpha, limit, ACTIVATION, HAS_BIAS, FMT, NATIVE_CAST,
                                        FAST_SIGMOID)
                    else:
                        _epilogue_late(acc, expert, pid_m * BM, n0, ptrs, sizes, strides, mma,
                                       ACTIVATION, HAS_BIAS, FMT, NATIVE_CAST, FAST_SIGMOID)
                else:
                    if HALF_BLOCKS == 2:
                        # (see QUARTER_BLOCKS) slot 32 padding: a quarter block
                        past_quarter = live_block(sorted_pair_ids_ptr, pid_m * 4 + 1, num_pairs,
                                                  32)
                    else:
                        past_quarter: gl.constexpr = True    # (no quarter path built)
                    if past_quarter:
                        # a half block: the first 64 slots' wgmmas only, their piece written
                        # (its own names: a variable both branches assign must keep its type)
                        half_acc = gl.zeros([64, 64], gl.float32, mma_half)
                        half_acc, index, phase = _plain_k_loop(
                            half_acc, w_bufs, s_bufs, x_bufs, ready, empty, index, phase, steps,
                            HALF, DOT_HALF, FMT, TAIL)
                        if EARLY:
                            _epilogue_early(half_acc, scale, shift, terms0, terms1, n0, ptrs,
                                            strides, alpha, limit, ACTIVATION, HAS_BIAS, FMT,
                                            NATIVE_CAST, FAST_SIGMOID)
                        else:
                            _epilogue_late(half_acc, expert, pid_m * BM, n0, ptrs, sizes,
                                           strides, mma_half, ACTIVATION, HAS_BIAS, FMT,
                                           NATIVE_CAST, FAST_SIGMOID)
                    else:
                        quarter_acc = gl.zeros([64, 32], gl.float32, mma_quarter)
                        if EARLY:
                            # (the first 32 slots' terms: the 64-slot ones' loads go unused)
                            quarter_terms = _slot_terms(pid_m * BM, 32, sorted_pair_ids_ptr,
                                                        topk_weights_ptr, num_pairs, ACTIVATION)
                        # (the whole last step: with mxfp4's tail step one consumer's quarter
                        # loop spilled at sm_90)
                        quarter_acc, index, phase = _plain_k_loop(
                            quarter_acc, w_bufs, s_bufs, x_bufs, ready, empty, index, phase,
                            steps, HALF, DOT_QUARTER, FMT)
                        if EARLY:
                            _epilogue_early(quarter_acc, scale, shift, quarter_terms,
                                            quarter_terms, n0, ptrs, strides, alpha, limit,
                                            ACTIVATION, HAS_BIAS, FMT, NATIVE_CAST, FAST_SIGMOID)
                        else:
                            _epilogue_late(quarter_acc, expert, pid_m * BM, n0, ptrs, sizes,
                                           strides, mma_quarter, ACTIVATION, HAS_BIAS, FMT,
                                           NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _epilogue_late(acc, expert, slot0, n0, ptrs, sizes, strides, mma: gl.constexpr,
                   ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, FMT: gl.constexpr,
                   NATIVE_CAST: gl.constexpr, FAST_SIGMOID: gl.constexpr):
    """The epilogue with its operands loaded after the K loop (EARLY_EPILOGUE off): acc
    [64 weight rows, slots slot0...] (128 slots: two pieces of 64)."""
    (gscale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, topk_weights_ptr, block_expert_ptr,
     num_padded_ptr, a_scale_ptr) = ptrs
    N, KP, num_pairs, alpha, limit = sizes
    stride_ge, stride_be, stride_om = strides
    w_rows = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    # the layout's row scale (nvfp4's global scale, * 512; mxfp4's fold)
    scale = gl.load(gscale_ptr + expert * stride_ge + w_rows)
    if FMT == 0:
        scale = scale * 512.0
    acc = acc * scale[:, None]
    if HAS_BIAS:
        acc += gl.load(bias_ptr + expert * stride_be + w_rows).to(gl.float32)[:, None]
    if acc.shape[1] > 64:
        first, second = _slot_halves(acc)
        _store_slots(first, slot0, n0, sorted_pair_ids_ptr, topk_weights_ptr, out_ptr,
                     num_pairs, stride_om, alpha, limit, ACTIVATION, NATIVE_CAST, FAST_SIGMOID)
        _store_slots(second, slot0 + 64, n0, sorted_pair_ids_ptr, topk_weights_ptr,
                     out_ptr, num_pairs, stride_om, alpha, limit, ACTIVATION, NATIVE_CAST,
                     FAST_SIGMOID)
    else:
        _store_slots(acc, slot0, n0, sorted_pair_ids_ptr, topk_weights_ptr, out_ptr,
                     num_pairs, stride_om, alpha, limit, ACTIVATION, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _slot_halves(acc):
    """A [64, 128] accumulator's two 64-slot pieces: slot 64h + j -> [64, j, h], h a register
    bit of the MMA layout, so the split moves no data."""
    return gl.split(gl.permute(gl.reshape(acc, [64, 2, 64]), [0, 2, 1]))


@gluon.jit
def _epilogue_early(acc, scale, shift, terms0, terms1, n0, ptrs, strides, alpha, limit,
                    ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, FMT: gl.constexpr,
                    NATIVE_CAST: gl.constexpr, FAST_SIGMOID: gl.constexpr):
    """The epilogue with its operands loaded before the K loop (EARLY_EPILOGUE): the rows'
    factor and bias (_row_terms) on acc [64 weight rows, 64 or 128 slots], then each 64-slot
    piece written with its slots' terms (_slot_terms; terms1 for a 128-slot tile's second)."""
    out_ptr = ptrs[2]
    topk_weights_ptr = ptrs[4]
    stride_om = strides[2]
    rows_l: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    acc = acc * gl.convert_layout(scale, rows_l)[:, None]
    if HAS_BIAS:
        acc += gl.convert_layout(shift, rows_l)[:, None]
    if acc.shape[1] > 64:
        first, second = _slot_halves(acc)
        _store_early(first, terms0, n0, topk_weights_ptr, out_ptr, stride_om, alpha, limit,
                     ACTIVATION, NATIVE_CAST, FAST_SIGMOID)
        _store_early(second, terms1, n0, topk_weights_ptr, out_ptr, stride_om, alpha, limit,
                     ACTIVATION, NATIVE_CAST, FAST_SIGMOID)
    else:
        _store_early(acc, terms0, n0, topk_weights_ptr, out_ptr, stride_om, alpha, limit,
                     ACTIVATION, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _row_terms(gscale_ptr, bias_ptr, expert, n0, stride_ge, stride_be, mma: gl.constexpr,
               FMT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The tile's 64 weight rows' factor (the layout's row scale; nvfp4's * 512) and bias
    (zeros without), along the MMA layout's rows."""
    w_rows = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    scale = gl.load(gscale_ptr + expert * stride_ge + w_rows)
    if FMT == 0:
        scale = scale * 512.0
    shift = gl.zeros([64], gl.float32, gl.SliceLayout(1, mma))
    if HAS_BIAS:
        shift = gl.load(bias_ptr + expert * stride_be + w_rows).to(gl.float32)
    return scale, shift


@gluon.jit
def _slot_terms(slot0, BM: gl.constexpr, sorted_pair_ids_ptr, topk_weights_ptr, num_pairs,
                ACTIVATION: gl.constexpr):
    """A piece's slots slot0.. (up to 64 of a BM-slot tile), their pair ids, whether each is a
    routed pair and (GEMM2) its routing weight (0 for padding), along the rows of the layout
    the piece is written from (GEMM1: PAIRS_LAYOUT, GEMM2: STORE_LAYOUT)."""
    PIECE: gl.constexpr = 64 if BM > 64 else BM
    layout: gl.constexpr = STORE_LAYOUT if ACTIVATION == 0 else PAIRS_LAYOUT
    slots = slot0 + gl.arange(0, PIECE, layout=gl.SliceLayout(1, layout))
    pair_ids = gl.load(sorted_pair_ids_ptr + slots)
    row_ok = pair_ids < num_pairs
    weights = gl.zeros([PIECE], gl.float32, gl.SliceLayout(1, layout))
    if ACTIVATION == 0:
        weights = gl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)
    return slots, pair_ids, row_ok, weights


@gluon.jit
def _store_early(acc, terms, n0, topk_weights_ptr, out_ptr, stride_om, alpha, limit,
                 ACTIVATION: gl.constexpr, NATIVE_CAST: gl.constexpr,
                 FAST_SIGMOID: gl.constexpr):
    """_store_slots with the slots' terms loaded before the K loop (_slot_terms): GEMM2's
    piece goes to its store layout in one exchange, times the routing weights, into
    out[pair]; GEMM1's through PAIRS_LAYOUT and its activation (write_rows)."""
    slots, pair_ids, row_ok, weights = terms
    if ACTIVATION == 0:
        vals = gl.convert_layout(gl.permute(acc, [1, 0]), STORE_LAYOUT) * weights[:, None]
        cols = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, STORE_LAYOUT))
        gl.store(out_ptr + pair_ids.to(gl.int64)[:, None] * stride_om + cols[None, :],
                 to_out(vals, out_ptr.dtype.element_ty, NATIVE_CAST), mask=row_ok[:, None])
    else:
        vals = gl.convert_layout(gl.permute(acc, [1, 0]), PAIRS_LAYOUT)
        write_rows(vals, slots, pair_ids, row_ok, n0, topk_weights_ptr, out_ptr, stride_om,
                   alpha, limit, ACTIVATION, True, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _store_slots(acc, slot0, n0, sorted_pair_ids_ptr, topk_weights_ptr, out_ptr, num_pairs,
                 stride_om, alpha, limit, ACTIVATION: gl.constexpr, NATIVE_CAST: gl.constexpr,
                 FAST_SIGMOID: gl.constexpr):
    """A piece of the accumulator [64 weight rows, slots slot0...] written as its slots' rows
    (columns n0...), slots along the rows and two adjacent columns (gate/up) in one thread;
    padding slots not written."""
    PIECE: gl.constexpr = acc.shape[1]
    vals = gl.convert_layout(gl.permute(acc, [1, 0]), PAIRS_LAYOUT)
    slots = slot0 + gl.arange(0, PIECE, layout=gl.SliceLayout(1, vals.type.layout))
    pair_ids = gl.load(sorted_pair_ids_ptr + slots)
    row_ok = pair_ids < num_pairs
    write_rows(vals, slots, pair_ids, row_ok, n0, topk_weights_ptr, out_ptr, stride_om, alpha,
               limit, ACTIVATION, True, NATIVE_CAST, FAST_SIGMOID)


@gluon.jit
def _ws_fp4_kernel(w_desc, s_desc, x_desc, gscale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr,
                   topk_weights_ptr, block_expert_ptr, num_padded_ptr, a_scale_ptr,
                   N, KP, num_pairs, stride_ge, stride_be, stride_om, alpha, limit,
                   ALIGN_M: gl.constexpr, STAGES: gl.constexpr, ACTIVATION: gl.constexpr,
                   HAS_BIAS: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, PIPELINE: gl.constexpr, FMT: gl.constexpr,
                   PARTIAL_N: gl.constexpr, EARLY: gl.constexpr, HALF_BLOCKS: gl.constexpr,
                   SPLIT: gl.constexpr = 1, TAIL: gl.constexpr = 16, X_BOXES: gl.constexpr = 1,
                   NATIVE_CAST: gl.constexpr = 0,
                   FAST_SIGMOID: gl.constexpr = 0):
    # a ring slot holds the tile's TILE_N = CONSUMERS x 64 weight rows (in a buffer of the next
    # power of two: three consumers' 192 rows take 256), loaded in boxes of the descriptors'
    # rows (the whole tile's but for three consumers: a TMA box is a power of two)
    TILE_N: gl.constexpr = CONSUMERS * 64
    BUF_N: gl.constexpr = 256 if CONSUMERS == 3 else TILE_N
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BUF_N] + w_desc.block_type.shape[1:],
                                       w_desc.layout)
    if FMT == 2:
        s_bufs = w_bufs     # (fp8 has no block scales: never read)
    else:
        s_bufs = gl.allocate_shared_memory(s_desc.dtype,
                                           [STAGES, BUF_N] + s_desc.block_type.shape[1:],
                                           s_desc.layout)
    # (SMALL_X_BOXES: X_BOXES activation boxes a ring slot)
    x_bufs = gl.allocate_shared_memory(
        x_desc.dtype, [STAGES, X_BOXES * x_desc.block_type.shape[0], x_desc.block_type.shape[1]],
        x_desc.layout)
    ready, empty = ring_barriers(STAGES, CONSUMERS)
    descs = (w_desc, s_desc, x_desc)
    smem = (w_bufs, s_bufs, x_bufs, ready, empty)
    ptrs = (gscale_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, topk_weights_ptr,
            block_expert_ptr, num_padded_ptr, a_scale_ptr)
    sizes = (N, KP, num_pairs, alpha, limit)
    strides = (stride_ge, stride_be, stride_om)
    # (the constexprs spelled out in each tuple: a tuple held in a variable would turn them into
    # tensors, and a comprehension over the consumers passes Triton 3.6's warp_specialize a
    # plain int it cannot flatten: one literal list per consumer count)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 0,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 1,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_producer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS,
                         FMT, PARTIAL_N, TILE_N, SPLIT, HALF_BLOCKS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 0,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 1,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 2,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_producer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS,
                         FMT, PARTIAL_N, TILE_N, SPLIT, HALF_BLOCKS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 0,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 1,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 2,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_consumer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS, 3,
                           PIPELINE, FMT, PARTIAL_N, EARLY, HALF_BLOCKS, TILE_N, SPLIT,
                           TAIL, NATIVE_CAST, FAST_SIGMOID)),
            (_producer, (descs, smem, ptrs, sizes, strides, ALIGN_M, ACTIVATION, HAS_BIAS,
                         FMT, PARTIAL_N, TILE_N, SPLIT, HALF_BLOCKS)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def _layouts(slots: int = BLOCK_M, quant: str = "nvfp4", box: int = ROWS,
             x_rows: Optional[int] = None):
    if quant == "fp8":
        w_layout = gl.NVMMASharedLayout.get_default_for([box, FP8_BLOCK_K], gl.float8e4nv)
        x_layout = gl.NVMMASharedLayout.get_default_for([slots, FP8_BLOCK_K], gl.float16)
        return w_layout, w_layout, x_layout
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    x_layout = gl.NVMMASharedLayout.get_default_for([x_rows or slots, BLOCK_K], gl.bfloat16)
    return w_layout, s_layout, x_layout


def x_box_rows(slots: int, half_blocks: Optional[bool], small_x_boxes: bool) -> int:
    """Rows of a 4-bit form's activation TMA box: the tile's slots, or X_BOX_ROWS for the
    128-slot form with half blocks and small boxes."""
    if small_x_boxes and _half_blocks_level(slots, half_blocks, False) > 0:
        return X_BOX_ROWS
    return slots


def _stages(quant: str, slots: int, consumers: int) -> int:
    return FP8_STAGES[consumers] if quant == "fp8" else STAGES[slots]


def block_n(consumers: int) -> int:
    """Weight rows a tile."""
    return consumers * ROWS


def tma_box_rows(consumers: int) -> int:
    """Weight rows a TMA box: the tile's, or one warpgroup's 64 where the tile's are no power
    of two (three consumers: the producer loads three boxes a ring slot)."""
    rows = block_n(consumers)
    return rows if rows & (rows - 1) == 0 else ROWS


def consumers_for(slots: int, quant: str = "nvfp4", num_pairs: int = 0,
                  gemm: Optional[int] = None, n: Optional[int] = None,
                  experts: Optional[int] = None, programs: Optional[int] = None) -> int:
    """Consumer warpgroups of a launch: the prefill forms' 2; decode's CONSUMERS when forced
    (for GEMM `gemm`, 1 or 2, where it names one a GEMM), else, where partial last tiles are
    allowed, four for nvfp4 calls of FOUR_CONSUMERS_MIN_PAIRS routed pairs or more, three for
    calls of THREE_CONSUMERS_MIN_PAIRS or more (see CONSUMERS) and, below that, three where the GEMM's tiles (n weight rows of each of at most
    min(experts, num_pairs) experts, on `programs` SMs) then take fewer rows of waves
    (_row_waves), else two. (gemm() counts the routing's pairs; applies() without `consumers`
    knows none: experts.py passes the same counts to both.)"""
    if slots != BLOCK_M:
        # (three consumers on the 128-slot form were measured slower: DeepSeek-V3 nvfp4 2-8%,
        # gpt-oss mxfp4 ~20%; benchmarks/NOTES.md, sixteenth session)
        return 2
    if quant == "fp8":
        return 2 if FP8_CONSUMERS == "auto" else int(FP8_CONSUMERS)
    if CONSUMERS != "auto":
        forced = str(CONSUMERS).split(",")   # (a count, or one a GEMM)
        return int(forced[min(len(forced), gemm or 1) - 1])
    # (192-row tiles leave DeepSeek's N = 4096 and 7168 a partial last tile: PARTIAL_N_OK)
    if not PARTIAL_N_OK:
        return 2
    if num_pairs >= FOUR_CONSUMERS_MIN_PAIRS.get(quant, num_pairs + 1):
        return 4
    if num_pairs >= THREE_CONSUMERS_MIN_PAIRS:
        return 3
    if n is None or experts is None or programs is None:
        return 2
    active = min(experts, num_pairs)
    return 3 if _row_waves(3, n, active, programs) < _row_waves(2, n, active, programs) else 2


# Below THREE_CONSUMERS_MIN_PAIRS a decode GEMM is a wave or a few of tiles, and a tile's time
# grows with its rows: three consumers pay where their 192-row tiles take fewer rows of waves
# than 128-row ones. gpt-oss-120b at T = 1 (4 experts): GEMM1's 5760 rows are 180 tiles of 128
# (2 waves on 132 SMs, 256 rows) or 120 of 192 (1 wave, 192 rows); its GEMM2's 2880 rows 92 or
# 60 tiles (1 wave either way: 128 rows beat 192). Measured on an H200 (results/
# h200_ab_consumers_*.json, 2026-12-02, graph replays, two alternated passes): gpt-oss-120b
# mxfp4 T = 1 with 2,2 / 3,3 / 3,2 / 2,3 consumers (GEMM1, GEMM2) 45.5 / 45.1 / 42.0 / 48.3 us
# (41.2 for 3,2 in the second pass); at T = 4 (equal row waves) 2,2 best (100.4 against 101.3-
# 103.0); DeepSeek-V3 nvfp4 T = 1 2,2 best (89.7 against 90.5-106.6), T = 4-64 3,3 best (271 /
# 716 / 1438 us against 279-289 / 725-750 / 1490-1537), as gpt-oss at T = 16 / 64 (259 / 527-543).
def _row_waves(consumers: int, n: int, experts: int, programs: int) -> int:
    """Weight rows an SM runs through for a GEMM of `experts` experts' n rows in tiles of
    `consumers` warpgroups, the tiles spread over `programs` SMs in waves."""
    rows = block_n(consumers)
    tiles = experts * -(-n // rows)
    return -(-tiles // programs) * rows


def k_units(quant: str, k: int) -> int:
    """Units a tile's K steps split in (split_range): mxfp4's pairs of 256-column steps, fp8's
    128-column steps, nvfp4's 256-column steps; k: the activation's columns (packed 4-bit rows
    padded to whole steps)."""
    step = FP8_BLOCK_K if quant == "fp8" else BLOCK_K
    steps = -(-k // step)
    return steps // 2 if quant == "mxfp4" else steps


def split_for(quant: str, num_pairs: int, n: int, k: int, experts: int, programs: int,
              consumers: int) -> tuple:
    """(consumers, SPLIT) of a decode GEMM2 launch by SPLIT_K: "0" the given consumers and no
    split; a count: that split where the K units allow it; "auto": among splits 1-4 and, where
    the consumer count is not forced (MOE_OPS_WS_FP4_CONSUMERS / _FP8_DECODE_CONSUMERS "auto"),
    2 or 3 consumers beside the given ones (those whose tiles N allows: PARTIAL_N_OK or whole
    tiles), the fewest weight rows x K steps an SM runs through (tiles of at most
    min(experts, num_pairs) experts in waves over `programs` SMs), each work item charged
    SPLIT_ITEM_STEPS more for its start and epilogue; ties to the given consumers, then the
    smaller split."""
    units = k_units(quant, k)
    if SPLIT_K == "0" or units < 2:
        return consumers, 1
    if SPLIT_K != "auto":
        return consumers, min(int(SPLIT_K), units)
    active = min(experts, num_pairs)
    unit_steps = 2 if quant == "mxfp4" else 1
    vary = (FP8_CONSUMERS if quant == "fp8" else CONSUMERS) == "auto"
    counts = {consumers} | ({c for c in (2, 3) if PARTIAL_N_OK or n % block_n(c) == 0}
                            if vary else set())

    def cost(c, split):
        tiles = active * -(-n // block_n(c))
        return (-(-(tiles * split) // programs) * block_n(c)
                * (-(-units // split) * unit_steps + SPLIT_ITEM_STEPS))
    choices = [(c, split) for c in sorted(counts) for split in SPLITS if split <= units]
    return min(choices, key=lambda cs: (cost(*cs), cs[0] != consumers, cs[1]))


def tail_slices(k: int, kp: int) -> int:
    """The 16-column slices of the last of kp / BLOCK_K K steps that the kernel takes (TAIL)
    for activations of k columns: 4 or 8 where the step's real columns fit in its first quarter
    or half, else 16 (the whole step; also when whole steps are padding: those run as they
    are)."""
    real = k - (kp - BLOCK_K)
    if real <= 0 or real > BLOCK_K // 2:
        return 16
    return 4 if real <= BLOCK_K // 4 else 8


def default_pipeline(slots: int, quant: str = "nvfp4") -> bool:
    """Whether a form's consumers are pipelined by default (PIPELINE, PREFILL_PIPELINE; the
    wide form's and the fp8 form's never)."""
    if quant == "fp8":
        return False
    return PIPELINE if slots == BLOCK_M else PREFILL_PIPELINE if slots == PREFILL_SLOTS else False


def _constants(*, gemm: int, activation: str, has_bias: bool, consumers: int, quant: str,
               slots: int, align_m: int, pipelined: bool, partial_n: bool,
               early: Optional[bool], half_blocks: Optional[bool], split: int,
               tail: int, quarter_blocks: bool, x_rows: Optional[int] = None,
               native_cast: Optional[bool] = None,
               fast_sigmoid: Optional[bool] = None) -> dict:
    """The kernel's compile-time arguments of a launch (gemm() and compile_sm90 alike); x_rows:
    the activation TMA box's rows (x_box_rows; default the tile's slots); native_cast: the
    epilogue's rounding by the GPU's conversion (default ws_gemm.NATIVE_CAST, one switch for
    both Gluon kernels; see ws_gemm.to_out); fast_sigmoid: GEMM1's swiglu / swiglu_oai sigmoid
    on tanh.approx (default FAST_SIGMOID, this module's)."""
    consumer_regs, producer_regs, _ = REGISTERS[consumers]
    return dict(ALIGN_M=align_m, STAGES=_stages(quant, slots, consumers),
                ACTIVATION=ACTIVATIONS.index(activation) if gemm == 1 else 0,
                HAS_BIAS=has_bias, CONSUMERS=consumers, CONSUMER_REGS=consumer_regs,
                PRODUCER_REGS=producer_regs, PIPELINE=int(pipelined), FMT=FMT[quant],
                PARTIAL_N=int(partial_n),
                EARLY=int(EARLY_EPILOGUE if early is None else early),
                HALF_BLOCKS=_half_blocks_level(slots, half_blocks, quarter_blocks), SPLIT=split,
                TAIL=tail, X_BOXES=slots // (x_rows or slots),
                NATIVE_CAST=int(NATIVE_CAST if native_cast is None else native_cast),
                FAST_SIGMOID=int(FAST_SIGMOID if fast_sigmoid is None else fast_sigmoid))


def narrow_blocks(setting: str, quant: str, num_pairs: int, num_experts: int) -> bool:
    """QUARTER_BLOCKS' or SMALL_X_BOXES' choice for a launch: "auto" takes them for nvfp4
    launches of fewer than NARROW_BLOCKS_MAX_ROWS routed rows an expert on average (num_pairs
    counts every routed pair, num_experts the local experts)."""
    if setting != "auto":
        return setting == "1"
    return quant == "nvfp4" and num_pairs < NARROW_BLOCKS_MAX_ROWS * num_experts


def _half_blocks_level(slots: int, half_blocks: Optional[bool], quarter_blocks: bool) -> int:
    """The kernel's HALF_BLOCKS: 0 whole blocks always, 1 half blocks (HALF_BLOCKS), 2 half and
    quarter blocks (with the half ones); the 128-slot form only."""
    half = HALF_BLOCKS if half_blocks is None else half_blocks
    if slots != WIDE_SLOTS or not half:
        return 0
    return 2 if quarter_blocks else 1


def applies(quant: str, activation: str, n: int, a: torch.Tensor, w: torch.Tensor,
            w_scale: torch.Tensor, slots: int = BLOCK_M, k: Optional[int] = None,
            consumers: Optional[int] = None) -> bool:
    """Whether this kernel can run a launch (what gemm() would otherwise refuse, or TMA
    fault on): bf16 activations on a Hopper GPU, whole tiles of N (with PARTIAL_N_OK a multiple
    of 64: the last tile's consumers past N idle), weights and scales contiguous and 16-byte
    aligned, the activation rows (`k` values each, a's by default: GEMM2 reads the
    intermediate's I) 16-byte aligned; nvfp4 / mxfp4: packed rows of whole 256-column steps
    (TMA over [E * N, 4, Kp/8] and the scales' [E * N, Kp/16 or Kp/32], whose rows must be whole
    16 bytes: mxfp4 needs Kp a multiple of 512); fp8: decode's form, e4m3 weights of whole
    128-column steps with the layout's per-row scale [E, N] (the activations are quantized to
    f16 e4m3 values on the way)."""
    k = a.shape[1] if k is None else k
    common = (quant in QUANTS and activation in ACTIVATIONS and available(a.device)
              and a.dtype == torch.bfloat16
              and n % (ROWS if PARTIAL_N_OK
                       else block_n(consumers or consumers_for(slots, quant))) == 0
              and w.is_contiguous() and w.data_ptr() % 16 == 0
              and w_scale.is_contiguous() and w_scale.data_ptr() % 16 == 0
              and (k * 2) % 16 == 0)
    if quant == "fp8":
        K = w.shape[-1]
        return (common and slots == BLOCK_M and w.dtype == torch.float8_e4m3fn
                and K > 0 and K % FP8_BLOCK_K == 0 and w_scale.shape == w.shape[:2])
    kp = w.shape[-1] * 2
    return (common and kp > 0 and kp % BLOCK_K == 0 and (kp // GROUP[quant]) % 16 == 0)


def gemm(a, w, w_scale, w_global_scale, bias, out, routing, *, gemm: int, activation: str,
         alpha: float = 0.0, limit: float = 0.0, programs: Optional[int] = None,
         consumers: Optional[int] = None, quant: str = "nvfp4", slots: int = BLOCK_M,
         pipeline: Optional[bool] = None, early: Optional[bool] = None,
         half_blocks: Optional[bool] = None, a_scale: Optional[torch.Tensor] = None,
         split: int = 1, tail: Optional[bool] = None,
         quarter_blocks: Optional[bool] = None, small_x_boxes: Optional[bool] = None,
         native_cast: Optional[bool] = None, fast_sigmoid: Optional[bool] = None) -> None:
    """One nvfp4 / mxfp4 / fp8 GEMM over the dispatch's live blocks of `slots` rows (16:
    decode's form, PREFILL_SLOTS or WIDE_SLOTS: prefill's, two consumers, 4-bit only; see the
    module docstring). 4-bit: a bf16 rows; w_global_scale the layout's row scale [E, N]
    (nvfp4's global scale, mxfp4's fold). fp8: a [slots, K] f16 holding e4m3 values
    (act_quant's, out_dtype=float16) with a_scale [slots] fp32, w [E, N, K] e4m3 with w_scale
    the layout's per-row scale [E, N] (w_global_scale unused). pipeline: the pipelined
    consumers (default: PIPELINE, or PREFILL_PIPELINE for the 64-slot form; never the wide
    form's). early: the epilogue's operands loaded before each tile's K loop (default:
    EARLY_EPILOGUE). half_blocks: the 128-slot form's half blocks (default: HALF_BLOCKS; other
    forms never); quarter_blocks: with them its quarter blocks (default: QUARTER_BLOCKS's
    choice, narrow_blocks); small_x_boxes: with them the activations in 32-row boxes (default:
    SMALL_X_BOXES's). split: GEMM2's K steps in `split` parts (SPLIT_K; decode's form, serial
    consumers, the early epilogue), out [split * num_pairs, N] then holds part p's rows from row
    p * num_pairs (combine_pair_rows(..., splits=split) sums them). tail: the last K step's
    padding skipped where it can be (default: TAIL's rule; the 4-bit formats' plain consumers
    without a split only). native_cast: the epilogue's rounding by the GPU's conversion
    (default: ws_gemm.NATIVE_CAST). fast_sigmoid: GEMM1's swiglu / swiglu_oai sigmoid on
    tanh.approx (default: FAST_SIGMOID, off)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if slots not in SLOTS:
        raise ValueError(f"slots must be one of {SLOTS}, got {slots}")
    if gemm == 1 and activation == "none":
        raise ValueError("gemm=1 needs an activation (GEMM1's epilogue applies it)")
    if slots == WIDE_SLOTS and pipeline:
        raise ValueError(f"pipeline: the {slots}-slot form has serial consumers only")
    fp8 = quant == "fp8"
    pipelined = default_pipeline(slots, quant) if pipeline is None else pipeline
    if fp8 and (slots != BLOCK_M or pipelined):
        raise ValueError(f"slots / pipeline: fp8 runs decode's {BLOCK_M}-slot form with serial "
                         f"consumers, got slots={slots}, pipeline={pipelined}")
    if consumers is None:
        if programs is None:
            programs = device_properties(a.device).multi_processor_count
        consumers = consumers_for(slots, quant, routing.num_pairs, gemm, w.shape[1], w.shape[0],
                                  programs)
    if consumers not in REGISTERS:
        raise ValueError(f"consumers: {', '.join(map(str, sorted(REGISTERS)[:-1]))} or "
                         f"{max(REGISTERS)} warpgroups, got {consumers}")
    if slots != BLOCK_M and consumers != 2:
        raise ValueError(f"consumers: the {slots}-slot form runs 2, got {consumers}")
    bn = block_n(consumers)
    early = EARLY_EPILOGUE if early is None else early
    if split not in SPLITS:
        raise ValueError(f"split: one of {SPLITS}, got {split}")
    if split > 1 and (gemm != 2 or slots != BLOCK_M or pipelined or not early):
        raise ValueError(f"split: GEMM2's decode form with serial consumers and the early "
                         f"epilogue only, got gemm={gemm}, slots={slots}, pipeline={pipelined}, "
                         f"early={early}")
    if fp8:
        E, N, K = w.shape
        if w.dtype != torch.float8_e4m3fn or N % ROWS or K % FP8_BLOCK_K or K == 0:
            raise ValueError(f"w: fp8 needs e4m3 weights [E, N, K] with N a multiple of {ROWS} "
                             f"and K of {FP8_BLOCK_K}, got {w.dtype} {tuple(w.shape)}")
        if w_scale is None or w_scale.shape != (E, N) or w_scale.dtype != torch.float32:
            raise ValueError(f"w_scale: fp8's per-row weight scale [E, N] = {(E, N)} float32, "
                             f"got {None if w_scale is None else (w_scale.dtype, tuple(w_scale.shape))}")
        if a.dtype != torch.float16 or a.shape[1] != K:
            raise ValueError(f"a: fp8 needs f16 rows of act_quant's e4m3 values [slots, {K}], "
                             f"got {a.dtype} {tuple(a.shape)}")
        if a_scale is None or a_scale.shape != (a.shape[0], ) or a_scale.dtype != torch.float32:
            raise ValueError(f"a_scale: one float32 scale a row of a, [{a.shape[0]}], got "
                             f"{None if a_scale is None else (a_scale.dtype, tuple(a_scale.shape))}")
        kp, row_scale = K, w_scale
    else:
        E, N, half_kp = w.shape
        kp = half_kp * 2
        if N % ROWS or kp % BLOCK_K or kp == 0:
            raise ValueError(f"w: the kernel needs N a multiple of {ROWS} and packed rows of a "
                             f"multiple of {BLOCK_K} columns, got N={N}, {kp} columns")
        group = GROUP[quant]
        if w_scale.shape != (E, N, kp // group):
            raise ValueError(f"w_scale: expected [E, N, Kp/{group}] = {(E, N, kp // group)}, "
                             f"got {tuple(w_scale.shape)}")
        if (kp // group) % 16:
            raise ValueError(f"w_scale: rows of {kp // group} bytes, the kernel's scale loads "
                             f"need whole 16 bytes (Kp a multiple of {16 * group})")
        if w_global_scale is None or w_global_scale.shape != (E, N):
            raise ValueError(f"w_global_scale: the layout's row scale [E, N] = {(E, N)}, got "
                             f"{None if w_global_scale is None else tuple(w_global_scale.shape)}")
        row_scale = w_global_scale
    if split > 1 and k_units(quant, kp) < split:
        raise ValueError(f"split: {split} parts, more than the {k_units(quant, kp)} units of K "
                         f"steps a part takes whole ({'pairs of ' if quant == 'mxfp4' else ''}"
                         f"{FP8_BLOCK_K if fp8 else BLOCK_K}-column steps)")
    if split > 1 and out.shape[0] < split * routing.num_pairs:
        raise ValueError(f"out: {split} parts need {split} x {routing.num_pairs} pair rows, got "
                         f"{out.shape[0]}")
    if routing.direct or routing.align_block_m % slots:
        raise ValueError(f"routing: the {quant} kernel's {slots}-slot form needs a dispatch "
                         f"aligned to {slots} rows, got "
                         f"{'direct' if routing.direct else routing.align_block_m}")
    a = a.contiguous() if a.stride(-1) != 1 else a
    box = tma_box_rows(consumers)
    if quarter_blocks is None:
        quarter_blocks = narrow_blocks(QUARTER_BLOCKS, quant, routing.num_pairs, w.shape[0])
    if small_x_boxes is None:
        small_x_boxes = narrow_blocks(SMALL_X_BOXES, quant, routing.num_pairs, w.shape[0])
    x_rows = x_box_rows(slots, half_blocks, small_x_boxes)    # (fp8's 16-slot form: slots)
    w_layout, s_layout, x_layout = _layouts(slots, quant, box, x_rows)
    if fp8:
        w_desc = TensorDescriptor(w.view(E * N, K), [E * N, K], [K, 1], [box, FP8_BLOCK_K],
                                  w_layout)
        s_desc = w_desc     # (no block scales)
        x_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [slots, FP8_BLOCK_K],
                                  x_layout)
    else:
        w_desc = TensorDescriptor(w.view(E * N, 4, kp // 8), [E * N, 4, kp // 8],
                                  [4 * (kp // 8), kp // 8, 1], [box, 4, 32], w_layout)
        scales = w_scale.view(torch.uint8).view(E * N, kp // group)
        s_desc = TensorDescriptor(scales, [E * N, kp // group], [kp // group, 1], [box, 16],
                                  s_layout)
        x_desc = TensorDescriptor(a, [a.shape[0], a.shape[1]], [a.stride(0), 1],
                                  [x_rows, BLOCK_K], x_layout)
    if programs is None:    # (after the checks: the refusals come before any device query)
        programs = device_properties(a.device).multi_processor_count
    if tail is None:
        tail = TAIL == "1" or (TAIL == "auto" and consumers == 2)
    slices = (tail_slices(a.shape[1], kp) if tail and not fp8 and not pipelined and split == 1
              else 16)
    dummy = routing.topk_weights
    _launcher((programs, ), _ws_fp4_kernel)(
        w_desc, s_desc, x_desc, row_scale, bias if bias is not None else dummy, out,
        routing.sorted_pair_ids, routing.topk_weights, routing.block_expert_ids,
        routing.num_padded, a_scale if fp8 else dummy, N, kp, routing.num_pairs,
        row_scale.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0), alpha,
        limit,
        **_constants(gemm=gemm, activation=activation, has_bias=bias is not None,
                     consumers=consumers, quant=quant, slots=slots,
                     align_m=routing.align_block_m, pipelined=pipelined,
                     partial_n=N % bn != 0, early=early, half_blocks=half_blocks,
                     quarter_blocks=quarter_blocks, x_rows=x_rows, split=split,
                     tail=slices, native_cast=native_cast, fast_sigmoid=fast_sigmoid),
        num_warps=4, maxnreg=REGISTERS[consumers][2])


def compile_sm90(*, gemm: int = 1, activation: str = "swiglu", has_bias: bool = False,
                 consumers: int = 2, pipeline: Optional[bool] = None, quant: str = "nvfp4",
                 slots: int = BLOCK_M, partial_n: bool = False, early: Optional[bool] = None,
                 half_blocks: Optional[bool] = None, split: int = 1, tail: int = 16,
                 quarter_blocks: Optional[bool] = None, small_x_boxes: Optional[bool] = None,
                 native_cast: Optional[bool] = None, fast_sigmoid: Optional[bool] = None):
    """Build the kernel for sm_90 without a GPU (the CPU tests; Gluon has no interpreter).
    tail: the last K step's slices (16, or 4 / 8: see TAIL). quarter_blocks / small_x_boxes
    default to QUARTER_BLOCKS / SMALL_X_BOXES forced on ("auto" decides per launch, and a
    build has none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    if quarter_blocks is None:
        quarter_blocks = QUARTER_BLOCKS == "1"
    if small_x_boxes is None:
        small_x_boxes = SMALL_X_BOXES == "1"
    box = tma_box_rows(consumers)
    x_rows = x_box_rows(slots, half_blocks, small_x_boxes)
    w_layout, s_layout, x_layout = _layouts(slots, quant, box, x_rows)
    if quant == "fp8":
        w_type = s_type = f"tensordesc<fp8e4nv[{box}, {FP8_BLOCK_K}],{w_layout!r}>"
        x_type = f"tensordesc<fp16[{slots}, {FP8_BLOCK_K}],{x_layout!r}>"
    else:
        w_type = f"tensordesc<u8[{box}, 4, 32],{w_layout!r}>"
        s_type = f"tensordesc<u8[{box}, 16],{s_layout!r}>"
        x_type = f"tensordesc<bf16[{x_rows}, {BLOCK_K}],{x_layout!r}>"
    signature = {
        "w_desc": w_type, "s_desc": s_type, "x_desc": x_type,
        "gscale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "sorted_pair_ids_ptr": "*i32", "topk_weights_ptr": "*fp32", "block_expert_ptr": "*i32",
        "num_padded_ptr": "*i32", "a_scale_ptr": "*fp32", "N": "i32", "KP": "i32",
        "num_pairs": "i32",
        "stride_ge": "i32", "stride_be": "i32", "stride_om": "i32", "alpha": "fp32",
        "limit": "fp32"}
    consts = _constants(gemm=gemm, activation=activation, has_bias=has_bias,
                        consumers=consumers, quant=quant, slots=slots, align_m=slots,
                        pipelined=(default_pipeline(slots, quant) if pipeline is None
                                   else pipeline),
                        partial_n=partial_n, early=early, half_blocks=half_blocks,
                        quarter_blocks=quarter_blocks, x_rows=x_rows, split=split,
                        tail=tail, native_cast=native_cast, fast_sigmoid=fast_sigmoid)
    signature.update({name: "constexpr" for name in consts})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if name.endswith("_ptr") or name in ("N", "KP")}
    return triton.compile(GluonASTSource(fn=_ws_fp4_kernel, signature=signature,
                                         constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=REGISTERS[consumers][2]))
