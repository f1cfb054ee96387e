#!/usr/bin/env bash
# The GPU session in one script: correctness on the GPU (gpu_check, the kernel tests, one
# compute-sanitizer memcheck run per quant mode), then the benchmark sweep. Results land in
# ${MOE_OPS_RESULTS_DIR:-benchmarks/results}. Usage on an H200 from the repository root:
#     bash benchmarks/h200_run.sh [check|checkp|bench|tune|dram|sweepw|persd|resprog|aqslice|aqslice2|fp4|prep|ws|ws4|ab|ab8|ab4w|ab4e|ab4h|ncu4|ncu4s|prof4|ab4d|layout4|layout4p|tune4|tune16|ws4rest|fold4|fold4p|fold4c|c4ab|ncu4l|c4x|fp8d|splitk|tail4|tailc|clocks|wgmma|quartert|quartera|aqshort|tune8|wspair|prefill|shortk|aqwarps|wsatomic|gatherrows|wsgather|aqdiv|aqwide|overlap|ncugemm2|native|native4|record|tuneq3|tunepf|gridround|pipepairs|scalecols|expertgroups|expertrule|widedeep|groupm|widemin|widemin128|ncugemm1|fastsig|fastsigab|routequant|routealign|all]
# checkp: the test suite on the GPU (all of tests/ but the wheel build, which needs no GPU;
# or $CHECK_FILES), its tests dealt out over $CHECK_PROCS (8) pytest processes side by side
# (the kernel tests are mostly compile time, which the host's cores share out), each at most
# $CHECK_LIMIT_S (540) s, logs pytest_gpu_<i>.log.
# tune: re-tune the shipped tables of every (model, quant) of shapes.json (needed after any edit
# of kernels/grouped_gemm.py or kernels/common.py), reports in the results dir. Each pair: its
# candidates' compile (18-46 s, shorter on a warm Triton cache) and then up to 55 s of
# profiling (the budget counts GPU time only), so up to ~100 s a pair: run the pairs in groups
# (tune4, tune8, tune16) where one call must stay under 10 minutes.
# fp4: the 4-bit path alone (its kernel and layout tests on the GPU, gpu_check of the nvfp4 and
# mxfp4 models, compute-sanitizer on the small layers, dev_fp4_gpu timings, bench_prepare).
# prep: the fp4 weight preparation alone (its tests on the GPU, bench_prepare of the bf16 ->
# nvfp4 / mxfp4 layers; about 2 minutes).
# ws: the warp-specialized Gluon GEMMs' GPU tests (kernels/ws_gemm.py, ws_fp4.py) and the fp8
# GEMM A/Bs of dev_ws_fp8_block.py (DeepSeek-V3 fp8_block with the padding-half skip, Mixtral
# fp8 per tensor against the Triton kernels); about 6 minutes.
# ws4: the Gluon nvfp4 decode GEMM timed (dev_gluon_fp4_decode.py; DeepSeek-V3 nvfp4 decode
# with MOE_OPS_WS_FP4 off and on) and the fp8 experts call kernel by kernel with fp8 per tensor
# on the Gluon kernel and off; about 4 minutes.
# ab: the 4-bit Gluon kernel (kernels/ws_fp4.py): its GPU tests in three processes (mxfp4 with
# the scale loads fixed; the 64-slot prefill form; the rest), its GEMMs alone (dev_gluon_fp4_decode.py: decode and
# prefill cases), DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 prefill (T = 1024-16384) with
# MOE_OPS_WS_FP4_PREFILL_MIN_ROWS 0 and 32 (serial and pipelined consumers, mxfp4 on the kernel;
# the 128-slot form off),
# gpt-oss mxfp4 decode with MOE_OPS_WS_MXFP4 (and MOE_OPS_WS_FP4_PARTIAL_N) 0 and 1; about 8
# minutes.
# ab8: the fp8 Gluon kernel's new forms, not yet measured: the 128 x 256 "wide" tiles on every
# GEMM that admits them (ws_gemm.WIDE_BUILDS: GEMM1 of DeepSeek-V3 fp8_block and of fp8 per
# tensor) and the staggered consumers (ws_gemm.STAGGER): their GPU tests; the GEMMs alone with
# the stagger (dev_ws_fp8_block.py, DeepSeek and Mixtral, T = 16384); the layers (Mixtral fp8,
# DeepSeek fp8_block, Qwen3 fp8 at T = 1024-16384) with MOE_OPS_WS_STAGES=6
# MOE_OPS_WS_STAGGER=3 and without, then Mixtral and Llama 4 fp8, DeepSeek
# fp8_block at T = 2048-16384 with MOE_OPS_WS_WIDE gemm2 and all; about 9 minutes.
# ab4w: the 4-bit Gluon kernel's 128-slot prefill form (ws_fp4.WIDE_SLOTS): its GPU tests, the
# GEMMs alone (dev_gluon_fp4_decode.py --cases prefill: 64 and 128 slots beside Triton), then
# DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 4096 / 16384 with
# MOE_OPS_WS_FP4_WIDE_MIN_ROWS 0 and 256; about 2.5 minutes.
# ab4e: the Gluon kernels' early epilogues (ws_fp4.EARLY_EPILOGUE, ws_gemm.EARLY_EPILOGUE): their
# GPU tests, the 4-bit GEMMs alone (dev_gluon_fp4_decode.py: the "early" variants), then the
# 4-bit and fp8 layers (DeepSeek-V3 nvfp4 and fp8_block, gpt-oss-120b mxfp4, Qwen3 and Mixtral
# fp8 at T = 16, 256, 4096, 16384) with both switches 0 and 1; about 9 minutes.
# ab4h: the 128-slot 4-bit form's half blocks (ws_fp4.HALF_BLOCKS): their GPU tests, then
# DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 2048-16384 with MOE_OPS_WS_FP4_WIDE_MIN_ROWS
# 128 without and with them and 64 with them; then where decode's 16-slot form hands over to
# the 64-slot one (T = 128-768 with MOE_OPS_WS_FP4_MAX_ROWS / _PREFILL_MIN_ROWS 16 / 32, 16 /
# 16, 8 / 8, 4 / 4); about 8 minutes.
# ncu4: Nsight Compute on the 4-bit Gluon kernel, one launch of each GEMM harness case (decode
# on 2 consumers, prefill on the 128-slot form): speed of light, scheduler and warp-state
# statistics with each stall reason's share, memory workload, instruction mix; about 3 minutes.
# ncu4s: the same launches' stall samples instruction by instruction (ncu's SourceCounters,
# then its source page as CSV, summed by benchmarks/ncu_sass_stalls.py): which SASS lines of
# the decode and the wgmmas the consumers wait at; about 3 minutes.
# prof4: the decode points below their bars kernel by kernel on the current defaults
# (profile_layer.py: routing, moe_align, the row gather, act_quant, the GEMMs, the combine, and
# the gap between them): DeepSeek-V3 nvfp4 and fp8_block, gpt-oss-120b mxfp4, Mixtral-8x7B,
# Qwen3-30B-A3B and Llama 4 Scout fp8 at T = 1, 4, 16, 64, with PDL as shipped (MOE_OPS_PDL=1)
# and off; then the 4-bit layers at T = 1024, 4096, 16384 (where the 128-slot form's layer
# loses to its GEMMs' rates); about 6 minutes.
# ab4d: the 4-bit decode's two new forms: three consumer warpgroups (MOE_OPS_WS_FP4_CONSUMERS=3)
# and the row gather in the dispatch's launch (MOE_OPS_ALIGN_GATHER_MAX_PAIRS): their GPU tests,
# the GEMMs alone with 2 / 3 / 4 consumers (dev_gluon_fp4_decode.py --cases decode), then
# DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 1-64 in four arms (consumers 2 / 3 x gather
# 0 / 1024), each twice, alternated; about 9 minutes.
# layout4: the 4-bit kernel order with permuted word bits (quant.FP4_WORD_BITS) against the
# tree before it, unpacked at $AB_OLD (e.g. `git archive a95db5c | tar -x -C ab_old`): the
# 4-bit and preparation tests on the GPU, the GEMMs alone (dev_gluon_fp4_decode.py) and the
# 4-bit layers (bench.py, T = 1 ... 16384) on both trees, alternated; about 8 minutes.
# layout4p: the preparation of the 4-bit layers (bench_prepare.py, bf16 and pre-quantized
# checkpoints) on both trees; about 4 minutes.
# fold4: mxfp4's one-multiply decode (the layout's block scales folded to at most 2, the rest
# in a per-row scale: quant.mxfp4_fold_scales) against the tree before it at $AB_OLD: the 4-bit,
# preparation and mxfp4 ws_fp4 tests on the GPU, gpt-oss-120b mxfp4 at T = 1 ... 16384 on both
# trees alternated (and the new tree with three decode consumers for mxfp4,
# MOE_OPS_WS_FP4_CONSUMERS=3); about 8 minutes. fold4p: its preparation on both trees, then the
# tuner on gpt-oss-120b mxfp4 (SHIP=1); about 4 minutes.
# fold4c: the 4-bit path's correctness after the fold (the fp4, layout, preparation and quant
# tests, the ws_fp4 tests of mxfp4 and of the consumer counts, gpu_check of the 4-bit models,
# compute-sanitizer on the small layers) and the 4-bit decode layers kernel by kernel
# (profile_layer.py, T = 1-64); about 9 minutes.
# c4ab: the 4-bit decode's consumer warpgroups chosen per GEMM (MOE_OPS_WS_FP4_CONSUMERS=a,b:
# GEMM1 a, GEMM2 b): DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 1-64 with 2,2 / 3,3 /
# 3,2 / 2,3, two alternated passes; about 8 minutes.
# ncu4l: Nsight Compute on the 4-bit decode layers' two GEMMs (profile_layer.py's first call,
# T = 64) of gpt-oss-120b mxfp4 and DeepSeek-V3 nvfp4: speed of light, warp states, scheduler
# and memory statistics, the lines that tell them apart printed; about 2 minutes.
# NCU_CASES="model:quant:kernel-regex ..." and NCU_TOKENS=T profile other layers' GEMMs, e.g.
# NCU_CASES="mixtral_8x7b:fp8:grouped_gemm qwen3_30b_a3b:none:grouped_gemm" for issue 3's
# decode points; the tensor pipe's active cycles printed too (NCU_TOKENS=16384
# NCU_CASES="deepseek_v3:nvfp4:_ws_fp4" for the 4-bit prefill GEMMs: where their rate a clock
# goes, NOTES fourteenth session). The L2's bytes (lts__t_bytes) and DRAM's read / written bytes
# printed with them (NCU_TOKENS=4096 NCU_CASES="deepseek_v3:fp8_block:_ws_fp8_block": whether
# fp8_block's "cols" tiles at T = 4096 are bound by the L2, NOTES).
# c4x: four consumer warpgroups at 4-bit decode (MOE_OPS_WS_FP4_CONSUMERS=4: a tile of 256
# weight rows, 20 warps at 96-112 registers a thread, no spills at sm_90) against the default
# rule and the mixed counts 4,3 / 3,4, DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 1-64;
# then the bf16 / fp8 / fp8_block layers kernel by kernel (profile_layer.py, decode and prefill
# points) and Nsight Compute on gpt-oss-120b's T = 1 GEMMs (one wave of tiles: the fixed cost
# of a tile's start); about 5 minutes.
# fp8d: fp8 decode on ws_fp4's fp8 form (experts.WS_FP8_DECODE, written without a GPU): its
# GPU tests, then the fp8 layers at T = 1-64 with MOE_OPS_WS_FP8_DECODE 0 and 1 alternated (two
# passes; each arm's check against the reference), then the Mixtral and Qwen3 fp8 decode layers
# kernel by kernel with it on; about 7 minutes.
# splitk: GEMM2's K split over the combine's pair rows at decode (ws_fp4.SPLIT_K, written
# without a GPU): its GPU tests (4-bit and the fp8 form), then DeepSeek-V3 nvfp4 and
# gpt-oss-120b mxfp4 at T = 1 / 4 with MOE_OPS_WS_FP4_SPLIT_K 0 and auto alternated (two
# passes), and the fp8 form (MOE_OPS_WS_FP8_DECODE=1) on Mixtral / Llama 4 fp8 at T = 1 / 4 with
# 0 and auto; about 6 minutes.
# tail4: the last K step's padding skipped (ws_fp4.TAIL, written without a GPU): its GPU tests
# (bit for bit the whole step's result on each form; gpt-oss-120b's shape against the oracle),
# then gpt-oss-120b mxfp4 (K = 2880: 64 real columns in the layout's last step) at T = 1-64,
# 4096 and 16384 with MOE_OPS_WS_FP4_TAIL 0 and 1 alternated (two passes); about 6 minutes.
# tailc: TAIL's rule (on for launches of two consumers) against off on gpt-oss-120b as in tail4
# (two alternated passes), then the 4-bit correctness set on it: ws_fp4's mxfp4 / tail / prefill
# GPU tests, gpu_check's 4-bit cases, compute-sanitizer; about 9 minutes.
# clocks: the SM clock and power while the prefill layers run sustained (nvidia-smi every 100 ms
# beside bench.py sampling 3 s a point: DeepSeek-V3 nvfp4 T = 4096 / 16384, gpt-oss-120b mxfp4
# T = 16384, Mixtral bf16 T = 16384) and while a bf16 8192^3 torch matmul runs back to back for 10 s, its rate
# against PERFORMANCE.md's 695 TFLOP/s (a median of short do_bench runs); about 2 minutes.
# CLOCK_CASES="model:quant:T ..." other layers; CLOCK_MATMUL="bf16 fp8" (the fp8 one
# torch._scaled_mm on e4m3, against 1274 TFLOP/s) or 0 (none).
# wgmma: the tensor pipe's rate for ws_fp4's wgmma shapes alone (benchmarks/dev_wgmma_rate.py:
# A from registers or shared memory, N = 64 / 128 / 256, a wait every K step or one step in
# flight, two consumer warpgroups sharing the B tile; and at N = 128 with one or two rounds of
# integer work on other registers between a step's wait and the next issue, as the decode sits
# there), the SM clock logged beside it; about 1 minute.
# quartert: the 128-slot form's quarter blocks and 32-row activation boxes
# (ws_fp4.QUARTER_BLOCKS, SMALL_X_BOXES, written without a GPU): their GPU tests (against the
# whole blocks, the quarter path taken, the experts call against the oracle), compute-sanitizer
# on one of them; about 3 minutes.
# quartera: DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 2048 / 4096 / 8192 / 16384 with
# MOE_OPS_WS_FP4_QUARTER_BLOCKS / MOE_OPS_WS_FP4_SMALL_X_BOXES 0,0 / 1,0 / 1,1 (QUARTER_ARMS
# "q:s:pass ..." others), the off arm twice; about 7 minutes.
# aqshort: act_quant's whole-row form for short fp8 rows (act_quant.SHORT_ROW_K, on at 2048 since
# its run): benchmarks/dev_act_quant.py (bit-exactness against the reference, TB/s) with
# MOE_OPS_ACT_QUANT_SHORT_ROW_K 0 and 2048, then Qwen3-30B-A3B fp8 (its 768-wide
# intermediate) and Mixtral-8x7B fp8 at T = 4096 / 16384 with 0 / 2048, two alternated passes;
# about 4 minutes.
# dram: how fast the DRAM streams a weight matrix read in the decode GEMMs' order (tiles of
# BLOCK_N rows x BLOCK_K bytes a K step) beside a tile-ordered layout and a plain streaming read
# (dev_dram_pattern.py), then Nsight Compute on Qwen3-30B-A3B bf16 and fp8 at T = 1 and
# DeepSeek-V3 fp8_block at T = 4 (their two GEMMs); about 5 minutes.
# aqslice: act_quant's sliced whole rows (MOE_OPS_ACT_QUANT_SLICE_K): its tests on the GPU (bit
# for bit), then Mixtral-8x7B and Llama 4 Scout fp8 at T = 1 / 4 / 16 with
# MOE_OPS_ACT_QUANT_SLICE_K 0, 2048, 0, 2048; about 1.5 minutes.
# sweepw: the decode tiles at 2 warps beside 4 (sweep_configs.py --against tables --warps 2 4:
# every candidate of a small grid for GEMM1, then GEMM2, against the shipped tables' pair, each
# output checked against that pair's) at the fp8 points under their bars and Qwen3 bf16 T = 1;
# about 8.5 minutes (a GEMM's candidates stop after 45 s).
# resprog: the persistent decode tiles' program count from the compiled builds (the tests,
# compute-sanitizer, dev_resident_programs.py: what the launches settled on an SM, each call
# checked against the tables'; then the decode layers whose tables use the tiles); ~4 minutes.
# persd: decode's row tiles on the persistent TMA kernel (block_m 16 / 32, swapped and not,
# GEMM1's token rows by pointer): their GPU tests and compute-sanitizer, then sweep_configs.py
# --persistent against the shipped tables' pair at Qwen3 bf16 / fp8 T = 16, Mixtral fp8 T = 64
# and DeepSeek-V3 fp8_block T = 4 ($PERSD_CASES); about 9 minutes.
# aqslice2: act_quant's slice width at decode, the default 2048 against 1024 (twice as many
# programs a long row), Mixtral-8x7B and Llama 4 Scout fp8 at T = 1 / 4 / 16, arms alternated;
# about 2 minutes.
# tune4: the tuner on the 4-bit pairs of shapes.json only (SHIP=1: the package's tables).
# tune16: the tuner on the bf16 / fp8 / fp8_block pairs only (SHIP=1), the tables copied to the
# results dir's tuned/; about 6 minutes.
# tune8: the tuner on the fp8 / fp8_block pairs only (SHIP=1), the tables copied to the
# results dir's tuned/, then those layers at
# T = 1 / 4 / 16 / 64 (graph replays, no baseline) on the new tables; about 6 minutes.
# ws4rest: the ws_fp4 GPU tests the tenth session's runs did not reach on its tree (mxfp4,
# half blocks, early epilogue, pipelined and padding-block forms); about 4 minutes.
# wspair: fp8 per tensor's prefill GEMMs (kernels/ws_gemm.py) promoting every other K step
# (MOE_OPS_WS_FP8_PROMOTE_STEPS=2): its GPU tests and compute-sanitizer, then Qwen3, Mixtral
# and Llama 4 fp8 at T = 2048-16384 (graph replays, no baseline) with 1, 2 (the default since
# its run), and
# 2 without the wide tiles for fp8 per tensor's GEMM1 (MOE_OPS_WS_WIDE=gemm2: its "rows" form
# pairs), two alternated passes; about 8 minutes.
# prefill: the prefill layers kernel by kernel (profile_layer.py: Qwen3, Mixtral and Llama 4
# bf16 and fp8, DeepSeek-V3 fp8_block at T = 4096 / 16384; no PDL above 512 routed pairs, so
# each kernel's time is its own), then the warp-specialized kernel's ring of 4 slots (the
# default) against 6 (MOE_OPS_WS_STAGES; the "cols" form holds 5, "wide" 4) on the fp8 and
# fp8_block layers at T = 4096 / 16384, two alternated passes; about 5 minutes.
# shortk: the "rows" form's whole ring for GEMMs of K <= 1024 (MOE_OPS_WS_SHORT_K_MAX_K=1024,
# the default since the twenty-fourth session): its GPU tests (the experts call against the oracle, GEMM2 against the
# Triton persistent kernel), gpu_check of Qwen3 fp8 at T = 1000 / 4096 / 16384 with it, then
# Qwen3 fp8 at T = 2048-16384 with 0 and 1024, two alternated passes; about 3 minutes.
# aqwarps: act_quant's short rows at 1 / 2 / 4 warps a program (MOE_OPS_ACT_QUANT_SHORT_WARPS;
# 0, the rule, is 4 for them): its tests on the GPU, dev_act_quant.py on Qwen3's 768-wide
# intermediate with each (bit-exactness against the reference, TB/s), then Qwen3 fp8 at T =
# 2048-16384 with 0 / 1 / 2, two alternated passes; about 3 minutes.
# wsatomic: the warp-specialized GEMM2 adding its rows into the tokens' float32 output
# (MOE_OPS_WS_ATOMIC=1, off by default) instead of pair rows and a combine: its GPU tests, then
# Qwen3, Mixtral and Llama 4 fp8 and DeepSeek-V3 fp8_block at T = 2048 / 4096 / 16384 with 0 /
# 1, two alternated passes; about 4 minutes.
# gatherrows: GEMM1's row gather (align.gather_rows) at 1 / 4 / 8 slots a program
# (MOE_OPS_GATHER_ROWS): its tests on the GPU, then Qwen3 bf16 and fp8, DeepSeek-V3 fp8_block
# at T = 4096 / 16384 with each, two alternated passes; about 4 minutes.
# aqdiv: act_quant's short division (MOE_OPS_ACT_QUANT_SHORT_DIVISION: one correction step on
# a quotient by the row's reciprocal, 1, against a correctly rounded division a value, 0): its
# tests on the GPU, dev_act_quant.py (bit-exactness against the reference on random and
# midpoint rows, TB/s; beside the module file $AQ_BASELINE if set) at prefill and decode sizes,
# then the fp8 / fp8_block layers at T = 1 / 64 / 4096 / 16384 with 0 / 1, two alternated
# passes; then act_quant's short rows 2 / 4 / 8 a program (MOE_OPS_ACT_QUANT_SHORT_ROWS) on
# Qwen3's intermediate (dev_act_quant.py) and the Qwen3 fp8 layer with 1 / 2 / 4, two
# alternated passes; about 6 minutes.
# aqwide: fp8 rows read whole at any row count above MOE_OPS_ACT_QUANT_WIDE_ROW_K columns (0:
# never; 8192, the default: Mixtral's 14336-wide intermediate; 4096: Llama 4's 5120- and
# 8192-wide rows too): dev_act_quant.py --forms on Mixtral's and Llama 4's rows, then the two
# fp8 layers at T = 256-16384 with 0 / 8192 / 4096, two alternated passes; about 4 minutes.
# overlap: the warp-specialized kernel's consumers issuing each tile's first steps before the
# previous tile's epilogue (ws_gemm.OVERLAP): its GPU tests (bit for bit against the serial
# tiles; the experts call against the oracle) and compute-sanitizer on two of them, the GEMM2
# probe of dev_ws_fp8_block.py (Qwen3-30B-A3B at T = 4096 / 16384 with K and 2K, Mixtral at
# 16384: stores into one row, ring slots, overlap and the early epilogue off and on), then
# Qwen3, Mixtral and Llama 4 fp8 at T = 4096 / 16384 with MOE_OPS_WS_OVERLAP 0 / short (an
# arm "short early" adds MOE_OPS_WS_EARLY_EPILOGUE=1), two alternated passes; about 6 minutes.
# native: the warp-specialized kernel's epilogue rounding to bf16 / fp16 by the GPU's
# conversion (ws_gemm.NATIVE_CAST) instead of round_to_dtype's float32 grid rounding: its GPU
# tests (bit for bit against it, GEMM1 and GEMM2, every form; the experts call against the
# oracle) with OVERLAP's GEMM1 tests, compute-sanitizer on two of them, the GEMM2 probe of
# Qwen3 with MOE_OPS_WS_NATIVE_CAST 0 / 1, then the fp8 layers (Qwen3, Mixtral, Llama 4) and
# DeepSeek-V3 fp8_block at T = 4096 / 16384 with 0 / 1, two alternated passes; about 8
# minutes (run it alone in a call).
# native4: the 4-bit Gluon kernel's epilogue on the GPU's conversion (ws_fp4's native_cast,
# default ws_gemm.NATIVE_CAST): its GPU tests (bit for bit against round_to_dtype, each form)
# and compute-sanitizer on one, then DeepSeek-V3 nvfp4 and gpt-oss-120b mxfp4 at T = 4096 /
# 16384 with MOE_OPS_WS_NATIVE_CAST 0 / 1, two alternated passes; with it fp8 per tensor's
# GEMM2 on the "wide" tiles (MOE_OPS_WS_WIDE_FP8_GEMM2, admitted with the native cast): its
# GPU tests and compute-sanitizer on one, then Mixtral, Llama 4 and Qwen3 fp8 at T = 4096 /
# 16384 with 0 / 1, two alternated passes; about 6.5 minutes.
# record: the sweep of record (bench, $DEADLINE_S, 430 s), gpu_check (every case, at most
# $CHECK_S, 200 s), compute-sanitizer on gpu_check's small set; about 8 minutes.
# gridround (on a tree with benchmarks/experiments/triton_native_cast.patch applied: `git apply`
# it first): the Triton kernels' output rounding by the GPU's own cast (common.GRID_ROUNDING
# off): its GPU test (tests/test_round_to_dtype.py) with the kernels' GPU tests
# (test_kernels_experts.py), then the bf16 prefill experts calls of dev_grid_rounding.py with
# MOE_OPS_GRID_ROUNDING 1 / 0, two alternated passes (their outputs' digests must be equal);
# about 6 minutes.
# pipepairs: fp8 per tensor's pairs of K steps pipelined (ws_gemm.PIPE_PAIRS: the next pair's
# wgmmas issued before the previous pair's wait and promotion): its GPU tests (bit for bit
# with the serial pairs, 1-16 steps a tile, both GEMMs; the experts call against the oracle)
# and compute-sanitizer on one, Mixtral's GEMM2 probe at T = 16384 with MOE_OPS_WS_PIPE_PAIRS
# 0 / 1 (its "6 slots" rows compare at equal ring depth: the pipelined form takes the whole
# ring), then Mixtral, Llama 4 and Qwen3 fp8 at T = 4096 / 16384 with 0 / 1, two alternated
# passes; about 6.5 minutes.
# scalecols: fp8_block's step scales loaded after the wgmmas' issue on the "cols" form alone
# (MOE_OPS_WS_SCALE_LOADS=cols; the form DeepSeek-V3 runs at T <= 4096, where "after" was
# never measured): DeepSeek-V3 fp8_block at T = 1024 / 2048 / 4096 with before / cols, two
# alternated passes; about 3 minutes.
# expertgroups: ws_gemm's tile groups cut at the experts' boundaries (ws_gemm.EXPERT_GROUPS):
# its GPU tests (bit for bit with the fixed windows, both GEMMs, every form, the gathering
# GEMM1; the experts call against the oracle) and compute-sanitizer on one, Nsight Compute's
# DRAM and L2 bytes of DeepSeek-V3 fp8_block's GEMMs at T = 4096 with it (ncu4l's lines; the
# same without it: results/h200_ncu_layer_deepseek_v3_fp8_block_4096_l2_twentyeighth.csv),
# then DeepSeek-V3 fp8_block at T = 1024-16384, Qwen3 and Mixtral fp8 at T = 4096 / 16384 with
# MOE_OPS_WS_EXPERT_GROUPS 0 / 1, two alternated passes; about 5 minutes.
# expertrule: the same switch's rule (MOE_OPS_WS_EXPERT_GROUPS=auto, ws_gemm.expert_groups_apply)
# against 0: DeepSeek-V3 fp8_block, Llama 4 and Mixtral fp8 at T = 2048 / 4096 / 16384 (the
# rule on for DeepSeek-V3 throughout, Llama 4 to 4096, Mixtral at 2048), two alternated
# passes; about 2.5 minutes.
# widedeep: DeepSeek-V3 fp8_block at T = 2048-8192 on the 128-row tiles (the "cols" form's
# 64 x 256 tiles move 40 KB of operands through the L2 a 4.2 MFLOP step, the weights read once
# a 64-row block; "wide", 128 x 256, 48 KB for 8.4, each expert padded to 128 rows, whose
# padding halves the skip (MOE_OPS_WS_SKIP_PADDING=1) leaves without MMAs: the MMA work of the
# 64-row blocks with the weight traffic of the 128-row ones): the skip's GPU tests (bit for
# bit, "rows" and "wide") and compute-sanitizer on "wide", Nsight Compute's L2 and DRAM lines
# at T = 4096 on wide + skip, then the layer with tile:skip auto:0 / wide:0 / wide:1 / rows:1,
# two alternated passes; about 4 minutes.
# groupm: ws_gemm's tile groups of more row blocks (MOE_OPS_WS_GROUP_M for both GEMMs,
# MOE_OPS_WS_GROUP_M_GEMM1 for GEMM1; benchmarks/dev_l2_order.py's model has Mixtral's and
# Llama 4's experts read 2-5x from DRAM with 8): their GPU tests (bit for bit across sizes) and
# compute-sanitizer on one, Nsight Compute's DRAM and L2 lines of Mixtral fp8's GEMMs at T =
# 16384 with 8 and with 32 / 16 (the model: GEMM1 4.8 -> 2.1 GB), then Mixtral and Llama 4 fp8
# and DeepSeek-V3 fp8_block at T = 4096 / 16384 with GROUP_M:GROUP_M_GEMM1 8:0 / 16:0 / 16:32 /
# 32:0, two alternated passes; about 6 minutes.
# widemin: the "wide" tiles (128 x 256) from 256 routed rows an expert instead of 512
# (MOE_OPS_WS_WIDE_MIN_ROWS; widedeep had DeepSeek-V3 fp8_block at T = 8192, 256 rows, 8% faster
# eager on "wide" than on the rule's "rows"): the 256-row points of Mixtral (T = 1024), Llama 4,
# Qwen3 (T = 4096) fp8 and DeepSeek-V3 fp8_block (T = 8192) among their T = 1024 / 4096 / 8192,
# 512 against 256, two alternated passes; about 3 minutes.
# widemin128: the same threshold at 128 rows against 256: Mixtral T = 512, Llama 4 and Qwen3
# T = 2048 fp8, DeepSeek-V3 fp8_block T = 4096 among T = 512 / 2048 / 4096, two alternated
# passes; about 2 minutes.
# ncugemm1: where Mixtral fp8's GEMM1 ("wide", its tensor pipe 78% busy at T = 16384 against
# GEMM2's 89%) spends the rest: Nsight Compute's stall samples instruction by instruction
# (SourceCounters, WarpStateStats, SpeedOfLight) on the first warp-specialized launch of one
# eager layer call (profile_layer.py) at T = 4096 (NCU_TOKENS), summed by ncu_sass_stalls.py:
# the samples at the epilogue's instructions (the activation, the casts, the stores) against
# the K loop's waits; NCU_CASES="model:quant" picks other layers; about 2 minutes a case.
# fastsig: GEMM1's sigmoid on tanh.approx (ws_gemm.FAST_SIGMOID, both Gluon kernels: one MUFU
# op a value, the wide fp8 build 25% fewer instructions; on since the thirtieth session):
# its GPU tests in both kernels
# (against the oracle, and near tl.sigmoid's launch) and compute-sanitizer on one of each,
# gpu_check's fp8 / fp8_block / 4-bit cases with it on, Nsight Compute's lines of Mixtral
# fp8's GEMMs at T = 4096 with it on (ncu4l; the tensor pipe was 78% on GEMM1 without); about
# 5 minutes.
# fastsigab: the fp8 layers and DeepSeek-V3 fp8_block, then the 4-bit layers, at T = 1024 /
# 4096 / 16384 with MOE_OPS_WS_FAST_SIGMOID (MOE_OPS_WS_FP4_FAST_SIGMOID for the 4-bit ones; one
# switch for both kernels when this was run) 0 / 1, two alternated passes; about 8 minutes.
# routequant: the routing launch quantizing x for the fp8 modes (experts.quantize_in_routing,
# kernels/routing.py): its GPU tests (bit for bit act_quant's codes and the two-launch layer)
# and the routing / layer tests, gpu_check's fp8 / fp8_block cases at T = 1, 7, 64, then the
# fp8 / fp8_block layers at T = 1-1024 with MOE_OPS_ROUTE_QUANTIZE_MAX_TOKENS 0 / 1024, two
# alternated passes; about 7 minutes.
# routealign: the routing's single program writing the dispatch (MOE_OPS_ROUTE_ALIGN=1,
# kernels/experts.py ROUTE_ALIGN): its GPU tests (the same dispatch bytes as moe_align, the layer
# as the separate launches give it, bit for bit: routing.FIXED_WARPS) with the routing,
# dispatch and layer tests (test_layer's layer call against the pre-routed one), compute-sanitizer
# on its dispatch tests, gpu_check's bf16 / fp8 / fp8_block cases at T = 1, 7, 64 with it on,
# then the decode layers at T = 2-64 with it 0 / 1, two alternated passes; about 7 minutes.
# tunepf: tuneq3's steps for each model:quant of $TUNE_PAIRS (default Llama 4 and Mixtral fp8,
# DeepSeek-V3 fp8_block), the layer at T = 1024 / 4096 / 16384; about a minute a pair.
# tuneq3: Qwen3-30B-A3B fp8's prefill buckets (1024-8192) re-tuned against the shipped entries
# (the tuner's current-pair rule) with the kernels of now (the gathering GEMM1, the native
# cast: the tables' prefill entries predate both), into the tree's table, old and new tables
# copied to the results dir (retune_prefill); then the layer at T = 1024-16384 on the new
# table, the old and the new again; about a minute.
# ncugemm2: what Qwen3-30B-A3B's GEMM2 tiles wait on (the probe found half its time outside
# its K steps): OVERLAP's GEMM1 bit-equality tests (re-run with the written-rows comparison;
# with the gathering GEMM1 too),
# then Nsight Compute on one launch of the warp-specialized GEMM2 ("rows", 6 slots, T =
# 16384; dev_ws_fp8_block.py --probe): speed of light, warp states, and the stall samples
# instruction by instruction (ncu_sass_stalls.py): the consumers' ready waits against their
# epilogue, the producer's issue; then the probe with other tile orders (ws_gemm.GROUP_M 1 /
# 4 / 8 / 16 / 32: how many SMs read one weight tile or row block at once), K and 2K; about 4
# minutes.
# wsgather: GEMM1 of the warp-specialized kernel gathering its token rows by cp.async
# (MOE_OPS_WS_GATHER=1; the default "auto" does for GEMM1s of N <= 2048) against
# align.gather_rows' copy (0): its GPU tests (bit
# for bit against the copied rows; the experts call against the oracle) and compute-sanitizer
# on one of them, then Qwen3 fp8, Mixtral fp8 and DeepSeek-V3 fp8_block at T = 2048 / 4096 /
# 16384 with 0 / 1, two alternated passes; about 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${MOE_OPS_RESULTS_DIR:-benchmarks/results}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"   # absolute: the A/B modes run from another tree
what="${1:-all}"
status=0
# layer_arm NAME DEADLINE ROWS [VAR=value ...] -- BENCH_ARGS...: one arm of an A/B on this tree,
# our layer alone (graph replays and eager, no baseline) with the given environment, into
# $out/NAME.json / .log; its table's first ROWS rows printed
layer_arm() {
  local name=$1 deadline=$2 rows=$3 vars=()
  shift 3
  while [[ $# -gt 0 && $1 != -- ]]; do vars+=("$1"); shift; done
  shift
  env "${vars[@]}" timeout $((deadline + 10)) python3 benchmarks/bench.py --no-baseline \
    --no-bf16-peer --no-plot --peers torch --deadline-s "$deadline" --listed-only "$@" \
    --out "$out/$name.json" > "$out/$name.log" 2>&1 || status=1
  echo "$name ${vars[*]}"; grep -A"$rows" '^ *model' "$out/$name.log" | cut -c1-100
}
# ab_env_passes NAME DEADLINE ROWS "LABEL:VAR=V,VAR=V ..." -- BENCH_ARGS...: an A/B over arms
# of environment settings, two alternated passes of layer_arm, into
# $out/ab_NAME_<label>_<pass>.json
ab_env_passes() {
  local name=$1 deadline=$2 rows=$3 arms=$4 pass arm settings
  if [[ ${5:-} != -- ]]; then
    echo "ab_env_passes: '--' expected before the bench arguments" >&2
    return 1
  fi
  shift 5
  for pass in 1 2; do
    for arm in $arms; do
      IFS=, read -r -a settings <<< "${arm#*:}"
      layer_arm "ab_${name}_${arm%%:*}_$pass" "$deadline" "$rows" "${settings[@]}" -- "$@"
    done
  done
}
# ab_passes NAME DEADLINE ROWS VAR "ARM ..." -- BENCH_ARGS...: ab_env_passes over the values of
# one environment variable VAR, into $out/ab_NAME_<arm>_<pass>.json
ab_passes() {
  local name=$1 deadline=$2 rows=$3 var=$4 arms="" arm
  for arm in $5; do arms+=" $arm:$var=$arm"; done
  shift 5
  ab_env_passes "$name" "$deadline" "$rows" "$arms" "$@"
}
FP4_DECODE=(--models deepseek_v3 gpt_oss_120b --quant nvfp4 mxfp4)
# tests_then_sanitize NAME FILE SELECTION SANITIZED LIMIT: `pytest FILE -k SELECTION` (at most
# LIMIT seconds) into pytest_NAME.log, then compute-sanitizer memcheck on `-k SANITIZED` into
# sanitize_NAME.log
tests_then_sanitize() {
  timeout "$5" python3 -m pytest -q -p no:cacheprovider "$2" -k "$3" > "$out/pytest_$1.log" 2>&1 \
    || status=1
  echo "$2 -k \"$3\""; tail -n 1 "$out/pytest_$1.log"
  timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q \
    -p no:cacheprovider "$2" -k "$4" > "$out/sanitize_$1.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$out/sanitize_$1.log" | tail -n 2
}
# gpu_check's 4-bit cases; compute-sanitizer on gpu_check's small set (every quant mode)
fp4_check() {
  timeout 100 python3 benchmarks/gpu_check.py --models deepseek_v3 gpt_oss_120b \
    --quant nvfp4 mxfp4 --json "$out/gpu_check_fp4.json" > "$out/gpu_check_fp4.log" 2>&1 \
    || status=1
  tail -n 14 "$out/gpu_check_fp4.log"
}
sanitize() {
  timeout 100 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/gpu_check.py \
    --sanitize > "$out/sanitize.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$out/sanitize.log" | tail -n 3
}
if [[ "$what" == check || "$what" == all ]]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 benchmarks/gpu_check.py --json "$out/gpu_check.json" > "$out/gpu_check.log" 2>&1 || status=1
  tail -n 45 "$out/gpu_check.log"
  python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_routing.py \
    tests/test_kernels_experts.py tests/test_triton_layer.py tests/test_ws_gemm.py \
    tests/test_ws_fp4.py > "$out/pytest_gpu.log" 2>&1 || status=1
  tail -n 3 "$out/pytest_gpu.log"
  compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/gpu_check.py --sanitize \
    > "$out/sanitize.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|PASS|FAIL" "$out/sanitize.log" | tail -n 12
fi
if [[ "$what" == checkp ]]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  # shellcheck disable=SC2086
  python3 -m pytest -q --collect-only -p no:cacheprovider ${CHECK_FILES:-$(ls tests/test_*.py \
    | grep -v test_packaging)} 2>/dev/null | grep "::" > "$out/pytest_gpu_nodes.txt"
  procs=${CHECK_PROCS:-8}
  for i in $(seq 0 $((procs - 1))); do
    awk -v n="$procs" -v i="$i" 'NR % n == i' "$out/pytest_gpu_nodes.txt" > "$out/pytest_gpu_nodes_$i.txt"
    timeout "${CHECK_LIMIT_S:-540}" python3 -c 'import sys, pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider"] + open(sys.argv[1]).read().splitlines()))' \
      "$out/pytest_gpu_nodes_$i.txt" > "$out/pytest_gpu_$i.log" 2>&1 &
  done
  wait
  echo "$(wc -l < "$out/pytest_gpu_nodes.txt") tests in $procs processes:"
  for i in $(seq 0 $((procs - 1))); do
    echo "$i: $(tail -n 1 "$out/pytest_gpu_$i.log")"
    grep -q -E "^[=]* ?[0-9]+ passed" "$out/pytest_gpu_$i.log" \
      && ! grep -q -E "[0-9]+ (failed|error)" "$out/pytest_gpu_$i.log" || status=1
  done
fi
if [[ "$what" == bench || "$what" == all ]]; then
  python3 benchmarks/bench.py --out "$out/h200.json" --plot "$out/h200.png" --deadline-s "${DEADLINE_S:-420}" \
    2> "$out/bench.log" || status=1
fi
if [[ "$what" == fp4 ]]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_fp4.py tests/test_layout.py \
    tests/test_prepare_fp4_order.py tests/test_quant.py > "$out/pytest_fp4.log" 2>&1 || status=1
  tail -n 3 "$out/pytest_fp4.log"
  python3 benchmarks/gpu_check.py --models deepseek_v3 gpt_oss_120b --quant nvfp4 mxfp4 \
    --json "$out/gpu_check_fp4.json" > "$out/gpu_check_fp4.log" 2>&1 || status=1
  tail -n 14 "$out/gpu_check_fp4.log"
  compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/gpu_check.py --sanitize \
    > "$out/sanitize.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$out/sanitize.log" | tail -n 3
  python3 benchmarks/dev_fp4_gpu.py --deadline-s "${DEADLINE_S:-150}" --out "$out" > "$out/fp4_dev.log" 2>&1 || status=1
  tail -n 40 "$out/fp4_dev.log"
  python3 benchmarks/bench_prepare.py --out "$out/prepare.json" > "$out/prepare.log" 2>&1 || status=1
  tail -n 16 "$out/prepare.log"
fi
if [[ "$what" == prep ]]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/test_prepare_fp4_order.py tests/test_layout.py \
    > "$out/pytest_prep.log" 2>&1 || status=1
  tail -n 3 "$out/pytest_prep.log"
  python3 benchmarks/bench_prepare.py --cases deepseek_v3:nvfp4 gpt_oss_120b:mxfp4 --no-torch-path \
    --out "$out/prepare_fp4.json" > "$out/prepare_fp4.log" 2>&1 || status=1
  tail -n 12 "$out/prepare_fp4.log"
fi
if [[ "$what" == ws ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_ws_gemm.py tests/test_ws_fp4.py \
    > "$out/pytest_ws.log" 2>&1 || status=1
  tail -n 3 "$out/pytest_ws.log"
  python3 benchmarks/dev_ws_fp8_block.py --variants package --tokens 4096 16384 --out "$out" \
    > "$out/ws_fp8_block.log" 2>&1 || status=1
  tail -n 15 "$out/ws_fp8_block.log"
  python3 benchmarks/dev_ws_fp8_block.py --model mixtral_8x7b --variants ours package \
    --tokens 4096 16384 --out "$out" > "$out/ws_fp8.log" 2>&1 || status=1
  tail -n 19 "$out/ws_fp8.log"
fi
if [[ "$what" == ws4 ]]; then
  python3 benchmarks/dev_gluon_fp4_decode.py --out "$out" > "$out/gluon_fp4_decode.log" 2>&1 \
    || status=1
  tail -n 10 "$out/gluon_fp4_decode.log"
  for on in 0 1; do
    MOE_OPS_WS_FP4=$on python3 benchmarks/bench.py --models deepseek_v3 --quant nvfp4 \
      --tokens 1 4 16 64 --no-baseline --no-bf16-peer --no-plot --deadline-s 60 \
      --out "$out/bench_ws_fp4_$on.json" > "$out/bench_ws_fp4_$on.log" 2>&1 || status=1
    grep -A5 '^ *model' "$out/bench_ws_fp4_$on.log" | cut -c1-110
  done
  for on in 0 1; do
    MOE_OPS_PDL=0 MOE_OPS_WS_FP8=$on python3 benchmarks/profile_layer.py --models mixtral_8x7b \
      llama4_scout --quant fp8 --tokens 4096 16384 --out "$out/profile_ws_fp8_$on.json" \
      > "$out/profile_ws_fp8_$on.log" 2>&1 || status=1
    grep -A5 '^model' "$out/profile_ws_fp8_$on.log" | cut -c1-160
  done
fi
if [[ "$what" == ab ]]; then
  # (a kernel that hung would take the whole call: each group of tests gets a time limit,
  # verbose, so the log names the last one started; a fault kills its process's CUDA context,
  # so the forms new to the GPU run in processes of their own)
  for group in mxfp4 prefill "not mxfp4 and not prefill"; do
    log="$out/pytest_ws_fp4_${group// /_}.log"
    timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_ws_fp4.py -k "$group" \
      > "$log" 2>&1 || status=1
    echo "ws_fp4 tests -k \"$group\""; tail -n 1 "$log"
  done
  python3 benchmarks/dev_gluon_fp4_decode.py --out "$out" > "$out/gluon_fp4.log" 2>&1 \
    || status=1
  tail -n 22 "$out/gluon_fp4.log"
  ab="python3 benchmarks/bench.py --no-baseline --no-bf16-peer --no-plot --peers torch"
  for arm in 0:0:0 32:0:1 32:1:1; do
    IFS=: read -r rows pipe mx <<< "$arm"
    MOE_OPS_WS_FP4_PREFILL_MIN_ROWS=$rows MOE_OPS_WS_FP4_PREFILL_PIPELINE=$pipe \
      MOE_OPS_WS_MXFP4=$mx MOE_OPS_WS_FP4_PARTIAL_N=$mx MOE_OPS_WS_FP4_WIDE_MIN_ROWS=0 \
      $ab --deadline-s 90 --models deepseek_v3 gpt_oss_120b --quant nvfp4 mxfp4 --listed-only \
      --tokens 1024 4096 16384 --out "$out/ab_fp4_prefill_${rows}_${pipe}_$mx.json" \
      > "$out/ab_fp4_prefill_${rows}_${pipe}_$mx.log" 2>&1 || status=1
    echo "MOE_OPS_WS_FP4_PREFILL_MIN_ROWS=$rows MOE_OPS_WS_FP4_PREFILL_PIPELINE=$pipe MOE_OPS_WS_MXFP4=$mx"
    grep -A7 '^ *model' "$out/ab_fp4_prefill_${rows}_${pipe}_$mx.log" | cut -c1-100
  done
  for mx in 0 1; do
    MOE_OPS_WS_MXFP4=$mx MOE_OPS_WS_FP4_PARTIAL_N=$mx $ab --deadline-s 60 --models gpt_oss_120b \
      --quant mxfp4 \
      --tokens 1 4 16 64 128 --out "$out/ab_mxfp4_$mx.json" > "$out/ab_mxfp4_$mx.log" 2>&1 \
      || status=1
    echo "MOE_OPS_WS_MXFP4=$mx"; grep -A6 '^ *model' "$out/ab_mxfp4_$mx.log" | cut -c1-100
  done
fi
if [[ "$what" == ab8 ]]; then
  for group in wide stagger; do
    timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_ws_gemm.py -k "$group" \
      > "$out/pytest_ws_$group.log" 2>&1 || status=1
    echo "ws_gemm tests -k $group"; tail -n 1 "$out/pytest_ws_$group.log"
  done
  for model in deepseek_v3 mixtral_8x7b; do
    mkdir -p "$out/ab_stagger_$model"
    python3 benchmarks/dev_ws_fp8_block.py --model $model --variants package --tokens 16384 \
      --out "$out/ab_stagger_$model" > "$out/ab_stagger_$model.log" 2>&1 || status=1
    echo "$model"; tail -n 24 "$out/ab_stagger_$model.log"
  done
  ab="python3 benchmarks/bench.py --no-baseline --no-bf16-peer --no-plot --peers torch"
  for arm in 4:0 6:3; do
    MOE_OPS_WS_STAGES=${arm%:*} MOE_OPS_WS_STAGGER=${arm#*:} $ab --deadline-s 110 \
      --models mixtral_8x7b deepseek_v3 qwen3_30b_a3b --quant fp8 fp8_block --listed-only \
      --tokens 1024 4096 16384 \
      --out "$out/ab_stagger_${arm/:/_}.json" > "$out/ab_stagger_${arm/:/_}.log" 2>&1 || status=1
    echo "MOE_OPS_WS_STAGES=${arm%:*} MOE_OPS_WS_STAGGER=${arm#*:}"
    grep -A9 '^ *model' "$out/ab_stagger_${arm/:/_}.log" | cut -c1-100
  done
  for wide in gemm2 all; do
    MOE_OPS_WS_WIDE=$wide $ab --deadline-s 120 --models mixtral_8x7b llama4_scout deepseek_v3 \
      --quant fp8 fp8_block --listed-only --tokens 2048 4096 16384 \
      --out "$out/ab_wide_$wide.json" > "$out/ab_wide_$wide.log" 2>&1 || status=1
    echo "MOE_OPS_WS_WIDE=$wide"; grep -A10 '^ *model' "$out/ab_wide_$wide.log" | cut -c1-100
  done
fi
if [[ "$what" == ab4w ]]; then
  timeout 110 python3 -m pytest -v -p no:cacheprovider tests/test_ws_fp4.py -k "128" \
    > "$out/pytest_ws_fp4_128.log" 2>&1 || status=1
  echo "ws_fp4 tests -k 128"; tail -n 1 "$out/pytest_ws_fp4_128.log"
  timeout 80 python3 benchmarks/dev_gluon_fp4_decode.py --cases prefill --out "$out" \
    > "$out/gluon_fp4_prefill.log" 2>&1 || status=1
  tail -n 13 "$out/gluon_fp4_prefill.log"
  ab="python3 benchmarks/bench.py --no-baseline --no-bf16-peer --no-plot --peers torch"
  for rows in 0 256; do
    MOE_OPS_WS_FP4_WIDE_MIN_ROWS=$rows timeout 55 $ab --deadline-s 35 --models deepseek_v3 \
      gpt_oss_120b --quant nvfp4 mxfp4 --listed-only --tokens 4096 16384 \
      --out "$out/ab_fp4_wide_$rows.json" > "$out/ab_fp4_wide_$rows.log" 2>&1 || status=1
    echo "MOE_OPS_WS_FP4_WIDE_MIN_ROWS=$rows"; grep -A5 '^ *model' "$out/ab_fp4_wide_$rows.log" | cut -c1-100
  done
fi
if [[ "$what" == ab4e ]]; then
  for file in ws_fp4 ws_gemm; do
    timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_$file.py -k "early" \
      > "$out/pytest_${file}_early.log" 2>&1 || status=1
    echo "$file tests -k early"; tail -n 1 "$out/pytest_${file}_early.log"
  done
  timeout 100 python3 benchmarks/dev_gluon_fp4_decode.py --out "$out" \
    > "$out/gluon_fp4_early.log" 2>&1 || status=1
  tail -n 26 "$out/gluon_fp4_early.log"
  ab="python3 benchmarks/bench.py --no-baseline --no-bf16-peer --no-plot --peers torch"
  for early in 0 1; do
    MOE_OPS_WS_FP4_EARLY_EPILOGUE=$early MOE_OPS_WS_EARLY_EPILOGUE=$early timeout 100 $ab \
      --deadline-s 85 --models deepseek_v3 gpt_oss_120b qwen3_30b_a3b mixtral_8x7b \
      --quant nvfp4 mxfp4 fp8 fp8_block --listed-only --tokens 16 256 4096 16384 \
      --out "$out/ab_early_$early.json" > "$out/ab_early_$early.log" 2>&1 || status=1
    echo "MOE_OPS_WS_FP4_EARLY_EPILOGUE=$early MOE_OPS_WS_EARLY_EPILOGUE=$early"
    grep -A22 '^ *model' "$out/ab_early_$early.log" | cut -c1-100
  done
fi
if [[ "$what" == ab4h ]]; then
  timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ws_fp4.py -k "half" \
    > "$out/pytest_ws_fp4_half.log" 2>&1 || status=1
  echo "ws_fp4 tests -k half"; tail -n 1 "$out/pytest_ws_fp4_half.log"
  for arm in 128:0 128:1 64:1; do
    layer_arm "ab_half_${arm/:/_}" 45 9 MOE_OPS_WS_FP4_WIDE_MIN_ROWS=${arm%:*} \
      MOE_OPS_WS_FP4_HALF_BLOCKS=${arm#*:} -- "${FP4_DECODE[@]}" --tokens 2048 4096 8192 16384
  done
  # where decode's 16-slot form hands over to the 64-slot one (between 16 and 32 rows an
  # expert the Triton kernels run by default)
  for arm in 16:32 16:16 8:8 4:4; do
    layer_arm "ab_fp4_handover_${arm/:/_}" 40 9 MOE_OPS_WS_FP4_MAX_ROWS=${arm%:*} \
      MOE_OPS_WS_FP4_PREFILL_MIN_ROWS=${arm#*:} -- "${FP4_DECODE[@]}" --tokens 128 256 512 768
  done
fi
if [[ "$what" == ncu4 ]]; then
  sections="--section SpeedOfLight --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section InstructionStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  for arm in "decode:gluon 2 consumers" "prefill:gluon prefill 128"; do
    timeout 200 ncu -k regex:_ws_fp4 $sections python3 benchmarks/dev_gluon_fp4_decode.py \
      --once --cases "${arm%%:*}" --variants "${arm#*:}" > "$out/ncu_ws_fp4_${arm%%:*}.txt" 2>&1 \
      || status=1
    echo "${arm#*:}"
    grep -E "^  _ws|Compute \(SM\) Throughput|Memory Throughput|Issued Warp Per|Eligible Warps|Cycles Per Issued|issue_stalled.*ratio +[0-9.]+$" \
      "$out/ncu_ws_fp4_${arm%%:*}.txt" | awk '$NF+0 >= 0.1 || !/stalled/' | head -n 60
  done
fi
if [[ "$what" == ncu4s ]]; then
  for arm in "decode:gluon 2 consumers" "prefill:gluon prefill 128"; do
    case=${arm%%:*}
    timeout 200 ncu -k regex:_ws_fp4 -c 1 --section SourceCounters --section WarpStateStats \
      -f -o "$out/ncu_src_$case" python3 benchmarks/dev_gluon_fp4_decode.py --once \
      --cases "$case" --variants "${arm#*:}" > "$out/ncu_src_$case.log" 2>&1 || status=1
    ncu -i "$out/ncu_src_$case.ncu-rep" --page source --print-source sass --csv \
      > "$out/ncu_src_$case.csv" 2>> "$out/ncu_src_$case.log" || status=1
    python3 benchmarks/ncu_sass_stalls.py "$out/ncu_src_$case.csv" --top 25 \
      > "$out/ncu_src_$case.txt" 2>&1 || status=1
    echo "${arm#*:}"; cut -c1-150 "$out/ncu_src_$case.txt" | head -n 50
  done
fi
if [[ "$what" == prof4 ]]; then
  for pdl in 1 0; do
    MOE_OPS_PDL=$pdl timeout 150 python3 benchmarks/profile_layer.py --models deepseek_v3 \
      gpt_oss_120b mixtral_8x7b qwen3_30b_a3b llama4_scout --quant nvfp4 fp8_block mxfp4 fp8 \
      --tokens 1 4 16 64 --deadline-s 110 --out "$out/profile_decode_pdl_$pdl.json" \
      > "$out/profile_decode_pdl_$pdl.log" 2>&1 || status=1
    echo "MOE_OPS_PDL=$pdl"; tail -n 25 "$out/profile_decode_pdl_$pdl.log" | cut -c1-200
  done
  timeout 120 python3 benchmarks/profile_layer.py --models deepseek_v3 gpt_oss_120b \
    --quant nvfp4 mxfp4 --tokens 1024 4096 16384 --calls 5 --deadline-s 90 \
    --out "$out/profile_prefill_fp4.json" > "$out/profile_prefill_fp4.log" 2>&1 || status=1
  echo "4-bit prefill"; tail -n 7 "$out/profile_prefill_fp4.log" | cut -c1-240
fi
if [[ "$what" == ab4d ]]; then
  t=tests/test_ws_fp4.py
  timeout 240 python3 -m pytest -v -p no:cacheprovider tests/test_kernels_experts.py::test_align_gather \
    "$t::test_experts_on_ws_fp4[swiglu-True-256-30-3-1]" "$t::test_partial_last_tile[3-False-16-True]" \
    "$t::test_partial_last_tile[3-True-16-False]" "$t::test_pipelined_consumers[3-768]" \
    "$t::test_three_consumers" "$t::test_experts_with_rows_gathered_by_the_dispatch" \
    > "$out/pytest_ws_fp4_decode_forms.log" 2>&1 || status=1
  echo "ws_fp4 tests (3 consumers, gather in the dispatch)"; tail -n 1 "$out/pytest_ws_fp4_decode_forms.log"
  timeout 60 python3 benchmarks/dev_gluon_fp4_decode.py --cases decode --out "$out" \
    --variants "gluon 2 consumers,gluon 3 consumers,gluon 4 consumers,ours" \
    > "$out/gluon_fp4_consumers.log" 2>&1 || status=1
  tail -n 13 "$out/gluon_fp4_consumers.log"
  for arm in 2:0:a 3:0:a 2:1024:a 3:1024:a 3:1024:b 2:1024:b 3:0:b 2:0:b; do
    IFS=: read -r consumers gather rep <<< "$arm"
    name="ab_fp4_decode_c${consumers}_g${gather}_$rep"
    MOE_OPS_WS_FP4_CONSUMERS=$consumers MOE_OPS_ALIGN_GATHER_MAX_PAIRS=$gather timeout 50 \
      python3 benchmarks/bench.py --no-baseline --no-bf16-peer --no-plot --peers torch \
      --deadline-s 30 --models deepseek_v3 gpt_oss_120b --quant nvfp4 mxfp4 --listed-only \
      --tokens 1 4 16 64 --out "$out/$name.json" > "$out/$name.log" 2>&1 || status=1
    echo "consumers $consumers, gather up to $gather pairs ($rep)"
    grep -A9 '^ *model' "$out/$name.log" | cut -c1-64
  done
fi
if [[ "$what" == layout4 ]]; then
  old="${AB_OLD:-ab_old}"
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_fp4.py \
    tests/test_decode_ptx.py tests/test_prepare_fp4_order.py > "$out/pytest_fp4_layout.log" 2>&1 \
    || status=1
  echo "fp4 + preparation tests"; tail -n 1 "$out/pytest_fp4_layout.log"
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_ws_fp4.py \
    -k "experts_on_ws_fp4 or three_consumers or gathered or partial_last_tile or mxfp4" \
    > "$out/pytest_ws_fp4_layout.log" 2>&1 || status=1
  echo "ws_fp4 tests"; tail -n 1 "$out/pytest_ws_fp4_layout.log"
  for tree in new old; do
    dir=.; [[ $tree == old ]] && dir="$old"
    (cd "$dir" && PYTHONPATH="$PWD" timeout 60 python3 benchmarks/dev_gluon_fp4_decode.py \
      --cases prefill --variants "gluon prefill 128" --out "$out" > "$out/gluon_fp4_layout_$tree.log" 2>&1) \
      || status=1
    mv "$out/gluon_fp4_decode.json" "$out/gluon_fp4_layout_$tree.json" 2>/dev/null
    echo "GEMMs alone, $tree tree"; tail -n 3 "$out/gluon_fp4_layout_$tree.log"
  done
  for arm in old:a new:a new:b old:b; do
    tree=${arm%%:*}; dir=.; [[ $tree == old ]] && dir="$old"
    name="ab_fp4_layout_${tree}_${arm##*:}"
    (cd "$dir" && PYTHONPATH="$PWD" timeout 60 python3 benchmarks/bench.py --no-baseline \
      --no-bf16-peer --no-plot --peers torch --deadline-s 40 --models deepseek_v3 gpt_oss_120b \
      --quant nvfp4 mxfp4 --listed-only --tokens 1 4 16 64 1024 4096 16384 \
      --out "$out/$name.json" > "$out/$name.log" 2>&1) || status=1
    echo "$name"; grep -A15 '^ *model' "$out/$name.log" | cut -c1-80
  done
fi
if [[ "$what" == layout4p ]]; then
  old="${AB_OLD:-ab_old}"
  for tree in new old; do
    dir=.; [[ $tree == old ]] && dir="$old"
    (cd "$dir" && PYTHONPATH="$PWD" timeout 200 python3 benchmarks/bench_prepare.py --cases \
      deepseek_v3:nvfp4 deepseek_v3:nvfp4:pre gpt_oss_120b:mxfp4 gpt_oss_120b:mxfp4:pre \
      --no-torch-path --out "$out/prepare_fp4_layout_$tree.json" \
      > "$out/prepare_fp4_layout_$tree.log" 2>&1) || status=1
    echo "preparation, $tree tree"; tail -n 16 "$out/prepare_fp4_layout_$tree.log" | cut -c1-150
  done
fi
if [[ "$what" == ws4rest ]]; then
  timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_ws_fp4.py \
    -k "mxfp4 or half or early or pipelined or padding" > "$out/pytest_ws_fp4_rest.log" 2>&1 \
    || status=1
  echo "ws_fp4 tests (the rest)"; tail -n 3 "$out/pytest_ws_fp4_rest.log"
fi
if [[ "$what" == fold4 ]]; then
  old="${AB_OLD:-ab_old}"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_fp4.py \
    tests/test_prepare_fp4_order.py tests/test_layout.py -k "fp4 or device or reload" \
    > "$out/pytest_fold4_fp4.log" 2>&1 || status=1
  echo "fp4 + preparation tests"; tail -n 1 "$out/pytest_fold4_fp4.log"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_ws_fp4.py -k mxfp4 \
    > "$out/pytest_fold4_ws.log" 2>&1 || status=1
  echo "ws_fp4 mxfp4 tests"; tail -n 1 "$out/pytest_fold4_ws.log"
  for arm in old:a new:a c3:a new:b old:b c3:b; do
    tree=${arm%%:*}; dir=.; [[ $tree == old ]] && dir="$old"
    consumers=auto; [[ $tree == c3 ]] && consumers=3
    name="ab_fold4_${tree}_${arm##*:}"
    (cd "$dir" && PYTHONPATH="$PWD" MOE_OPS_WS_FP4_CONSUMERS=$consumers timeout 45 python3 \
      benchmarks/bench.py --no-baseline --no-bf16-peer --no-plot --peers torch --deadline-s 35 \
      --models gpt_oss_120b --quant mxfp4 --listed-only --tokens 1 4 16 64 1024 4096 16384 \
      --out "$out/$name.json" > "$out/$name.log" 2>&1) || status=1
    echo "$name"; grep -A9 '^ *model' "$out/$name.log" | cut -c1-80
  done
fi
if [[ "$what" == fold4p ]]; then
  old="${AB_OLD:-ab_old}"
  for tree in new old; do
    dir=.; [[ $tree == old ]] && dir="$old"
    (cd "$dir" && PYTHONPATH="$PWD" timeout 100 python3 benchmarks/bench_prepare.py --cases \
      gpt_oss_120b:mxfp4 gpt_oss_120b:mxfp4:pre --no-torch-path \
      --out "$out/prepare_fold4_$tree.json" > "$out/prepare_fold4_$tree.log" 2>&1) || status=1
    echo "preparation, $tree tree"; tail -n 8 "$out/prepare_fold4_$tree.log" | cut -c1-150
  done
  SHIP=1 SKIP_TESTS=1 MOE_OPS_RESULTS_DIR="$out" timeout 120 bash benchmarks/gpu_tune_check.sh \
    gpt_oss_120b:mxfp4 || status=1
  mkdir -p "$out/tuned" && cp moe_ops/tuned/*.json "$out/tuned/"
fi
if [[ "$what" == fold4c ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fp4.py \
    tests/test_layout.py tests/test_prepare_fp4_order.py tests/test_quant.py \
    > "$out/pytest_fold4c_fp4.log" 2>&1 || status=1
  echo "fp4 + layout + preparation + quant tests"; tail -n 1 "$out/pytest_fold4c_fp4.log"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_ws_fp4.py \
    -k "mxfp4 or consumers or three" > "$out/pytest_fold4c_ws.log" 2>&1 || status=1
  echo "ws_fp4 tests (mxfp4, consumers)"; tail -n 1 "$out/pytest_fold4c_ws.log"
  fp4_check
  timeout 60 python3 benchmarks/profile_layer.py --models deepseek_v3 gpt_oss_120b \
    --quant nvfp4 mxfp4 --tokens 1 4 16 64 --deadline-s 45 \
    --out "$out/profile_decode_fp4.json" > "$out/profile_decode_fp4.log" 2>&1 || status=1
  echo "4-bit decode"; tail -n 9 "$out/profile_decode_fp4.log" | cut -c1-240
  sanitize
fi
if [[ "$what" == c4ab ]]; then
  start=$SECONDS
  for arm in 2,2:a 3,3:a 3,2:a 2,3:a 2,3:b 3,2:b 3,3:b 2,2:b; do
    consumers=${arm%%:*}
    [[ ${arm##*:} == b && $((SECONDS - start)) -gt 290 ]] && break
    layer_arm "ab_consumers_${consumers/,/_}_${arm##*:}" 60 9 \
      MOE_OPS_WS_FP4_CONSUMERS=$consumers -- "${FP4_DECODE[@]}" --tokens 1 4 16 64
  done
fi
if [[ "$what" == ncu4l ]]; then
  ncu_metrics=sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum
  ncu_metrics+=,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum
  ncu_lines="sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active|lts__t_bytes.sum"
  ncu_lines+="|dram__bytes_read.sum|dram__bytes_write.sum|lts__t_sectors_srcunit_tex_op_read.sum"
  ncu_lines+="|L2 Cache Throughput|Duration|DRAM Throughput|Memory Throughput"
  ncu_lines+="|Executed Ipc Active|Issue Slots Busy|No Eligible|Active Warps Per Scheduler"
  ncu_lines+="|Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction|Grid Size"
  ncu_lines+="|Registers Per Thread|L2 Hit Rate|Mem Busy|Max Bandwidth"
  for case in ${NCU_CASES:-gpt_oss_120b:mxfp4:_ws_fp4 deepseek_v3:nvfp4:_ws_fp4}; do
    IFS=: read -r m q kernel <<< "$case"
    tokens=${NCU_TOKENS:-64}
    name="ncu_layer_$m"; [[ -n "${NCU_CASES:-}" ]] && name="ncu_layer_${m}_${q}_$tokens"
    name="$name${NCU_TAG:+_$NCU_TAG}"
    timeout 160 ncu -k "regex:$kernel" -c 2 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats \
      --metrics "$ncu_metrics" --csv \
      --page details python3 benchmarks/profile_layer.py --models "$m" --quant "$q" \
      --tokens "$tokens" --calls 1 > "$out/$name.csv" 2> "$out/$name.log" || status=1
    echo "$m $q T = $tokens"
    grep -E "\"($ncu_lines)\"" \
      "$out/$name.csv" | awk -F'","' '{print $5 " | " $(NF-2) " | " $NF}' | cut -c1-120
  done
fi
if [[ "$what" == c4x ]]; then
  for arm in auto:a 4:a 4,3:a 3,4:a 4:b auto:b; do
    consumers=${arm%%:*}
    layer_arm "ab_consumers4_${consumers/,/_}_${arm##*:}" 60 9 \
      MOE_OPS_WS_FP4_CONSUMERS=$consumers -- "${FP4_DECODE[@]}" --tokens 1 4 16 64
  done
  timeout 100 python3 benchmarks/profile_layer.py --models mixtral_8x7b qwen3_30b_a3b \
    deepseek_v3 llama4_scout --quant none fp8 fp8_block --tokens 1 16 64 4096 16384 \
    --calls 3 --deadline-s 80 --out "$out/profile_layer_issue3.json" \
    > "$out/profile_layer_issue3.log" 2>&1 || status=1
  grep -A40 '^model' "$out/profile_layer_issue3.log" | cut -c1-200
  NCU_TAG=t1 NCU_TOKENS=1 NCU_CASES="gpt_oss_120b:mxfp4:_ws_fp4" MOE_OPS_RESULTS_DIR="$out" \
    bash benchmarks/h200_run.sh ncu4l || status=1
fi
if [[ "$what" == fp8d ]]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_ws_fp8_decode.py \
    > "$out/pytest_fp8d.log" 2>&1 || status=1
  echo "fp8 decode form tests"; tail -n 3 "$out/pytest_fp8d.log" | cut -c1-300
  for arm in 1:a 0:a 0:b 1:b; do
    name="ab_fp8_decode_${arm%%:*}_${arm##*:}"
    layer_arm "$name" 50 13 MOE_OPS_WS_FP8_DECODE=${arm%%:*} -- \
      --models mixtral_8x7b qwen3_30b_a3b llama4_scout --quant fp8 --tokens 1 4 16 64
    grep -i "fail\|error" "$out/$name.log" | head -n 3
  done
  MOE_OPS_WS_FP8_DECODE=1 timeout 60 python3 benchmarks/profile_layer.py --models \
    mixtral_8x7b qwen3_30b_a3b --quant fp8 --tokens 1 16 64 --calls 3 --deadline-s 40 \
    --out "$out/profile_fp8_decode.json" > "$out/profile_fp8_decode.log" 2>&1 || status=1
  grep -A7 '^model' "$out/profile_fp8_decode.log" | cut -c1-240
fi
if [[ "$what" == splitk ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ws_fp4.py \
    tests/test_ws_fp8_decode.py -k "(split or combine) and not builds and not rule" \
    > "$out/pytest_splitk.log" 2>&1 || status=1
  echo "split-K tests"; tail -n 3 "$out/pytest_splitk.log" | cut -c1-300
  for arm in 0:a auto:a auto:b 0:b; do
    layer_arm "ab_splitk_${arm%%:*}_${arm##*:}" 35 5 MOE_OPS_WS_FP4_SPLIT_K=${arm%%:*} -- \
      "${FP4_DECODE[@]}" --tokens 1 4
  done
  for arm in 0:a auto:a; do
    layer_arm "ab_splitk_fp8_${arm%%:*}_${arm##*:}" 35 5 MOE_OPS_WS_FP8_DECODE=1 \
      MOE_OPS_WS_FP4_SPLIT_K=${arm%%:*} -- --models mixtral_8x7b llama4_scout --quant fp8 \
      --tokens 1 4
  done
fi
if [[ "$what" == tail4 ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_ws_fp4.py \
    -k "tail or three_consumers" > "$out/pytest_tail4.log" 2>&1 || status=1
  echo "tail tests"; tail -n 3 "$out/pytest_tail4.log" | cut -c1-300
  for arm in 0:a 1:a 1:b 0:b; do
    layer_arm "ab_tail_${arm%%:*}_${arm##*:}" 60 7 MOE_OPS_WS_FP4_TAIL=${arm%%:*} -- \
      --models gpt_oss_120b --quant mxfp4 --tokens 1 4 16 64 4096 16384
    grep -i "fail\|error" "$out/ab_tail_${arm%%:*}_${arm##*:}.log" | head -n 3
  done
fi
if [[ "$what" == tailc ]]; then
  for arm in auto:a 0:a 0:b auto:b; do
    layer_arm "ab_tailc_${arm%%:*}_${arm##*:}" 60 7 MOE_OPS_WS_FP4_TAIL=${arm%%:*} -- \
      --models gpt_oss_120b --quant mxfp4 --tokens 1 4 16 64 4096 16384
    grep -i "fail\|error" "$out/ab_tailc_${arm%%:*}_${arm##*:}.log" | head -n 3
  done
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_ws_fp4.py \
    -k "mxfp4 or tail or prefill" > "$out/pytest_tailc.log" 2>&1 || status=1
  echo "ws_fp4 tests (mxfp4, tail, prefill)"; tail -n 1 "$out/pytest_tailc.log"
  fp4_check
  sanitize
fi
# clocked NAME COMMAND...: COMMAND run with the GPU's SM clock and power logged every 100 ms
# into $out/clocks_NAME.csv; their medians over the busy samples (utilization >= 50%) printed
clocked() {
  local name=$1
  shift
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,temperature.gpu \
    --format=csv,noheader,nounits -lms 100 > "$out/clocks_$name.csv" &
  local smi=$!
  "$@" > "$out/clocks_$name.log" 2>&1 || status=1
  kill $smi
  python3 - "$out/clocks_$name.csv" "$name" <<'PY'
import statistics, sys
rows = [[f.strip() for f in line.split(",")] for line in open(sys.argv[1]) if line.count(",") == 4]
busy = [r for r in rows if r[3].isdigit() and int(r[3]) >= 50]
med = lambda i: statistics.median(float(r[i]) for r in busy) if busy else float("nan")
print(f"{sys.argv[2]:28s} busy samples {len(busy):4d}  SM clock {med(1):6.0f} MHz  "
      f"power {med(2):5.0f} W  temp {med(4):3.0f} C")
PY
  grep -E "graph [0-9.]+ us|TFLOP" "$out/clocks_$name.log" | cut -c1-110 | tail -n 2
}
if [[ "$what" == clocks ]]; then
  nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
  for kind in ${CLOCK_MATMUL:-bf16}; do
    [[ "$kind" == 0 ]] || clocked "matmul_$kind" python3 -c "
import sys, time, torch
kind = sys.argv[1]
a, b = (torch.randn(8192, 8192, device='cuda') for _ in range(2))
if kind == 'fp8':   # e4m3 operands, b column-major as _scaled_mm wants, bf16 out
    a, b, one = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t(), torch.ones((), device='cuda')
    mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
else:
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    mm = lambda: a @ b
for _ in range(20): mm()
torch.cuda.synchronize(); t, n = time.perf_counter(), 0
while time.perf_counter() - t < 10:
    for _ in range(20): mm()
    torch.cuda.synchronize(); n += 20
dt = time.perf_counter() - t
print(f'{kind} 8192^3 matmul sustained {2 * 8192 ** 3 * n / dt / 1e12:.0f} TFLOP/s over {dt:.1f} s')" "$kind"
  done
  for case in ${CLOCK_CASES:-deepseek_v3:nvfp4:4096 deepseek_v3:nvfp4:16384 \
      gpt_oss_120b:mxfp4:16384 mixtral_8x7b:none:16384}; do
    IFS=: read -r model quant tokens <<< "$case"
    clocked "${model}_${quant}_$tokens" timeout 100 python3 benchmarks/bench.py --no-baseline \
      --no-bf16-peer --no-plot --peers torch --deadline-s 40 --budget-ms 3000 --listed-only \
      --models "$model" \
      --quant "$quant" --tokens "$tokens" --out "$out/clocks_${model}_${quant}_$tokens.json"
  done
fi
if [[ "$what" == wgmma ]]; then
  clocked wgmma_rate timeout 300 python3 benchmarks/dev_wgmma_rate.py --out "$out/wgmma_rate.json"
  tail -n 20 "$out/clocks_wgmma_rate.log"
fi
if [[ "$what" == quartert ]]; then
  tests_then_sanitize quarter tests/test_ws_fp4.py quarter "quarter_blocks_match and mxfp4" 300
fi
if [[ "$what" == quartera ]]; then
  for arm in ${QUARTER_ARMS:-0:0:a 1:0:a 1:1:a 0:0:b 1:1:b}; do
    IFS=: read -r q sx pass <<< "$arm"
    layer_arm "ab_quarter_${q}${sx}_$pass" 80 9 MOE_OPS_WS_FP4_QUARTER_BLOCKS=$q \
      MOE_OPS_WS_FP4_SMALL_X_BOXES=$sx -- "${FP4_DECODE[@]}" --tokens 2048 4096 8192 16384
    grep -i "fail\|error" "$out/ab_quarter_${q}${sx}_$pass.log" | head -n 3
  done
fi
if [[ "$what" == aqshort ]]; then
  for k in 0 2048; do
    MOE_OPS_ACT_QUANT_SHORT_ROW_K=$k timeout 150 python3 benchmarks/dev_act_quant.py \
      --out "$out/act_quant_short_$k.json" > "$out/act_quant_short_$k.log" 2>&1 || status=1
    echo "MOE_OPS_ACT_QUANT_SHORT_ROW_K=$k"; tail -n 8 "$out/act_quant_short_$k.log" | cut -c1-150
  done
  for arm in 0:a 2048:a 0:b 2048:b; do
    layer_arm "ab_aqshort_${arm%%:*}_${arm#*:}" 50 5 MOE_OPS_ACT_QUANT_SHORT_ROW_K=${arm%%:*} \
      -- --models qwen3_30b_a3b mixtral_8x7b --quant fp8 --tokens 4096 16384
  done
fi
if [[ "$what" == dram ]]; then
  timeout 200 python3 benchmarks/dev_dram_pattern.py --out "$out/dram_pattern.json" \
    > "$out/dram_pattern.log" 2>&1 || status=1
  sed -n '/^best/,$p' "$out/dram_pattern.log"
  NCU_TOKENS=1 NCU_CASES="qwen3_30b_a3b:none:grouped_gemm qwen3_30b_a3b:fp8:grouped_gemm" \
    MOE_OPS_RESULTS_DIR="$out" bash benchmarks/h200_run.sh ncu4l || status=1
  NCU_TOKENS=4 NCU_CASES="deepseek_v3:fp8_block:grouped_gemm" MOE_OPS_RESULTS_DIR="$out" \
    bash benchmarks/h200_run.sh ncu4l || status=1
fi
if [[ "$what" == resprog ]]; then
  tests_then_sanitize resprog tests/test_kernels_experts.py "persistent or resident" \
    "persistent_decode_tiles and fp8_block" 200
  timeout 200 python3 benchmarks/dev_resident_programs.py --cases qwen3_30b_a3b:none:16 \
    deepseek_v3:fp8_block:4 mixtral_8x7b:fp8:64 --configs 16x64x128:4:4 16x64x128:8:4 \
    16x64x128:4:4:swap 32x128x128:4:4 > "$out/resident_programs.log" 2>&1 || status=1
  tail -n 20 "$out/resident_programs.log"
  layer_arm resprog_layers 60 12 -- --models qwen3_30b_a3b llama4_scout deepseek_v3 \
    --quant none fp8_block --tokens 4 16 64
fi
if [[ "$what" == persd ]]; then
  # (PERSD_CASES overrides the cases; PERSD_STAGES the pipeline depths; PERSD_ARGS adds
  # sweep_configs.py options, e.g. --skew)
  tests_then_sanitize persd tests/test_kernels_experts.py "persistent" \
    "persistent_decode_tiles and (fp8_block or relu2)" 240
  # shellcheck disable=SC2086
  timeout 420 python3 benchmarks/sweep_configs.py --cases ${PERSD_CASES:-qwen3_30b_a3b:none:16 \
    qwen3_30b_a3b:fp8:16 mixtral_8x7b:fp8:64 deepseek_v3:fp8_block:4} --against tables \
    --persistent --stages ${PERSD_STAGES:-4 6} --deadline-s 35 ${PERSD_ARGS:-} \
    --out "$out/sweep_persd.json" > "$out/sweep_persd.log" 2>&1 || status=1
  grep -v "^ *$" "$out/sweep_persd.log" | tail -n 24
fi
if [[ "$what" == sweepw ]]; then
  timeout 560 python3 benchmarks/sweep_configs.py --cases qwen3_30b_a3b:fp8:1 \
    mixtral_8x7b:fp8:4 llama4_scout:fp8:16 deepseek_v3:fp8_block:4 qwen3_30b_a3b:none:1 \
    --against tables --warps 2 4 --stages 3 4 --deadline-s 45 --out "$out/sweep_warps.json" \
    > "$out/sweep_warps.log" 2>&1 || status=1
  grep -v "^ *$" "$out/sweep_warps.log" | tail -n 20
fi
# aqslice_arms NAME WIDTH:PASS...: Mixtral-8x7B and Llama 4 Scout fp8 at T = 1 / 4 / 16 with
# MOE_OPS_ACT_QUANT_SLICE_K=WIDTH, one arm each, into NAME_WIDTH_PASS
aqslice_arms() {
  local name=$1 arm
  shift
  for arm in "$@"; do
    layer_arm "${name}_${arm%%:*}_${arm#*:}" 25 6 MOE_OPS_ACT_QUANT_SLICE_K=${arm%%:*} -- \
      --models mixtral_8x7b llama4_scout --quant fp8 --tokens 1 4 16
  done
}
if [[ "$what" == aqslice2 ]]; then
  aqslice_arms ab_aqslice2 2048:a 1024:a 2048:b 1024:b
fi
if [[ "$what" == aqslice ]]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_experts.py \
    -k "sliced or (test_act_quant and 14336)" > "$out/pytest_aqslice.log" 2>&1 || status=1
  tail -n 1 "$out/pytest_aqslice.log"
  aqslice_arms ab_aqslice 0:a 2048:a 0:b 2048:b
fi
# ship_tables MODEL:QUANT...: the tuner on those pairs into the package's tables (SHIP=1), the
# tables then copied to $out/tuned/ (they come back with the results)
ship_tables() {
  SHIP=1 SKIP_TESTS=1 MOE_OPS_RESULTS_DIR="$out" bash benchmarks/gpu_tune_check.sh "$@" \
    || status=1
  mkdir -p "$out/tuned" && cp moe_ops/tuned/*.json "$out/tuned/"
}
if [[ "$what" == tune4 ]]; then
  ship_tables deepseek_v3:nvfp4 gpt_oss_120b:mxfp4
fi
if [[ "$what" == tune8 ]]; then
  ship_tables qwen3_30b_a3b:fp8 mixtral_8x7b:fp8 llama4_scout:fp8 deepseek_v3:fp8_block
  layer_arm "tune8_after" 60 16 MOE_OPS_PDL=1 -- --models qwen3_30b_a3b mixtral_8x7b llama4_scout \
    deepseek_v3 --quant fp8 fp8_block --tokens 1 4 16 64
fi
if [[ "$what" == wspair ]]; then
  tests_then_sanitize wspair tests/test_ws_gemm.py "paired or pairs or gemm2_matches" \
    "gemm2_matches and 384" 150
  for pass in 1 2; do
    for arm in 1:all 2:all 2:gemm2; do
      layer_arm "ab_wspair_${arm/:/_}_$pass" 80 9 MOE_OPS_WS_FP8_PROMOTE_STEPS="${arm%%:*}" \
        MOE_OPS_WS_WIDE="${arm#*:}" -- --models qwen3_30b_a3b mixtral_8x7b llama4_scout \
        --quant fp8 --tokens 2048 4096 16384
    done
  done
fi
if [[ "$what" == prefill ]]; then
  timeout 150 python3 benchmarks/profile_layer.py --models qwen3_30b_a3b mixtral_8x7b \
    llama4_scout deepseek_v3 --quant none fp8 fp8_block --tokens 4096 16384 --calls 3 \
    --out "$out/profile_layer_prefill.json" > "$out/profile_layer_prefill.log" 2>&1 || status=1
  grep -A20 '^model' "$out/profile_layer_prefill.log" | cut -c1-240
  ab_passes stages 60 8 MOE_OPS_WS_STAGES "4 6" -- --models qwen3_30b_a3b mixtral_8x7b \
    llama4_scout deepseek_v3 --quant fp8 fp8_block --tokens 4096 16384
fi
if [[ "$what" == shortk ]]; then
  MOE_OPS_WS_SHORT_K_MAX_K=1024 timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/test_ws_gemm.py -k "short_k_ring or gemm2_matches" > "$out/pytest_shortk.log" 2>&1 || status=1
  tail -n 2 "$out/pytest_shortk.log"
  MOE_OPS_WS_SHORT_K_MAX_K=1024 timeout 120 python3 benchmarks/gpu_check.py --models \
    qwen3_30b_a3b --quant fp8 --tokens 1000 4096 16384 --no-large \
    --json "$out/gpu_check_shortk.json" > "$out/gpu_check_shortk.log" 2>&1 || status=1
  tail -n 3 "$out/gpu_check_shortk.log"
  ab_passes shortk 40 4 MOE_OPS_WS_SHORT_K_MAX_K "0 1024" -- --models qwen3_30b_a3b \
    --quant fp8 --tokens 2048 4096 16384
fi
if [[ "$what" == aqwarps ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_experts.py \
    -k "short_rows" > "$out/pytest_aqwarps.log" 2>&1 || status=1
  tail -n 1 "$out/pytest_aqwarps.log"
  for w in 0 1 2; do
    MOE_OPS_ACT_QUANT_SHORT_WARPS=$w timeout 60 python3 benchmarks/dev_act_quant.py --cases qwen3 \
      --out "$out/act_quant_warps_$w.json" > "$out/act_quant_warps_$w.log" 2>&1 || status=1
    echo "MOE_OPS_ACT_QUANT_SHORT_WARPS=$w"; tail -n 1 "$out/act_quant_warps_$w.log"
  done
  ab_passes aqwarps 40 4 MOE_OPS_ACT_QUANT_SHORT_WARPS "0 1 2" -- --models qwen3_30b_a3b \
    --quant fp8 --tokens 2048 4096 16384
fi
if [[ "$what" == wsatomic ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ws_gemm.py -k "atomic" \
    > "$out/pytest_wsatomic.log" 2>&1 || status=1
  tail -n 1 "$out/pytest_wsatomic.log"
  ab_passes wsatomic 60 12 MOE_OPS_WS_ATOMIC "0 1" -- --models qwen3_30b_a3b mixtral_8x7b \
    llama4_scout deepseek_v3 --quant fp8 fp8_block --tokens 2048 4096 16384
fi
if [[ "$what" == gatherrows ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_experts.py \
    -k "gather_rows" > "$out/pytest_gatherrows.log" 2>&1 || status=1
  tail -n 1 "$out/pytest_gatherrows.log"
  ab_passes gatherrows 60 6 MOE_OPS_GATHER_ROWS "1 4 8" -- --models qwen3_30b_a3b \
    deepseek_v3 --quant none fp8 fp8_block --tokens 4096 16384
fi
if [[ "$what" == wsgather ]]; then
  tests_then_sanitize wsgather tests/test_ws_gemm.py "gathering" \
    "gathering_gemm1_is_bit_equal and 7-2-0-1024-0-rows-fp8]" 170
  ab_passes wsgather 60 9 MOE_OPS_WS_GATHER "0 1" -- --models qwen3_30b_a3b mixtral_8x7b \
    deepseek_v3 --quant fp8 fp8_block --tokens 2048 4096 16384
fi
if [[ "$what" == aqdiv ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_act_quant_division.py \
    tests/test_kernels_experts.py -k "act_quant or division" > "$out/pytest_aqdiv.log" 2>&1 \
    || status=1
  grep -E "^FAILED" "$out/pytest_aqdiv.log"
  tail -n 1 "$out/pytest_aqdiv.log"
  baseline=(); [[ -n ${AQ_BASELINE:-} ]] && baseline=(--baseline "$AQ_BASELINE")
  for form in "" --decode; do
    timeout 120 python3 benchmarks/dev_act_quant.py $form "${baseline[@]}" \
      --out "$out/act_quant_div${form:+_decode}.json" > "$out/act_quant_div${form:+_decode}.log" 2>&1 \
      || status=1
    tail -n 30 "$out/act_quant_div${form:+_decode}.log" | cut -c1-140
  done
  for rows in 2 4 8; do
    MOE_OPS_ACT_QUANT_SHORT_ROWS=$rows timeout 60 python3 benchmarks/dev_act_quant.py \
      --cases qwen3 --out "$out/act_quant_rows_$rows.json" > "$out/act_quant_rows_$rows.log" 2>&1 \
      || status=1
    echo "MOE_OPS_ACT_QUANT_SHORT_ROWS=$rows"; tail -n 1 "$out/act_quant_rows_$rows.log"
  done
  ab_passes aqdiv 60 16 MOE_OPS_ACT_QUANT_SHORT_DIVISION "0 1" -- --models qwen3_30b_a3b \
    mixtral_8x7b llama4_scout deepseek_v3 --quant fp8 fp8_block --tokens 1 64 4096 16384
  ab_passes aqrows 40 4 MOE_OPS_ACT_QUANT_SHORT_ROWS "1 2 4" -- --models qwen3_30b_a3b \
    --quant fp8 --tokens 64 1024 4096 16384
fi
if [[ "$what" == aqwide ]]; then
  timeout 60 python3 benchmarks/dev_act_quant.py --forms --cases mixtral llama4 \
    --out "$out/act_quant_forms_wide.json" > "$out/act_quant_forms_wide.log" 2>&1 || status=1
  tail -n 13 "$out/act_quant_forms_wide.log"
  ab_passes aqwide 60 8 MOE_OPS_ACT_QUANT_WIDE_ROW_K "0 8192 4096" -- --models mixtral_8x7b \
    llama4_scout --quant fp8 --tokens 256 1024 4096 16384
fi
if [[ "$what" == overlap ]]; then
  tests_then_sanitize overlap tests/test_ws_gemm.py overlap \
    "overlap_is_bit_equal and (5-384-2-True-rows-fp8 or 7-768-1-False-cols-fp8_block)" 200
  for model in qwen3_30b_a3b mixtral_8x7b; do
    if [[ $model == qwen3_30b_a3b ]]; then sizes=(--tokens 4096 16384); else
      sizes=(--tokens 16384 --k-mults 1); fi
    timeout 150 python3 benchmarks/dev_ws_fp8_block.py --model $model --probe "${sizes[@]}" \
      --out "$out" > "$out/ws_probe_$model.log" 2>&1 || status=1
    grep -v "^{" "$out/ws_probe_$model.log" | tail -n 40
  done
  for pass in 1 2; do
    for arm in "0" "short"; do
      early=0; [[ $arm == *early ]] && early=1
      layer_arm "ab_overlap_${arm// /_}_$pass" 45 6 "MOE_OPS_WS_OVERLAP=${arm% early}" \
        "MOE_OPS_WS_EARLY_EPILOGUE=$early" -- --models qwen3_30b_a3b mixtral_8x7b \
        llama4_scout --quant fp8 --tokens 4096 16384
    done
  done
fi
if [[ "$what" == native ]]; then
  tests_then_sanitize native tests/test_ws_gemm.py \
    "native_cast or (overlap_is_bit_equal and -1-False-) or overlap_with_the_gathering" \
    "native_cast_is_bit_equal and (2-out_dtype0-rows-fp8 or 1-out_dtype2-wide-fp8_block)" 200
  for arm in 0 1; do
    MOE_OPS_WS_NATIVE_CAST=$arm timeout 100 python3 benchmarks/dev_ws_fp8_block.py \
      --model qwen3_30b_a3b --probe --tokens 4096 16384 --k-mults 1 --tiles rows --forms 00 \
      > "$out/ws_probe_native_$arm.log" 2>&1 || status=1
    echo "MOE_OPS_WS_NATIVE_CAST=$arm"; grep -v "^{" "$out/ws_probe_native_$arm.log" | tail -n 9
  done
  ab_passes native 60 8 MOE_OPS_WS_NATIVE_CAST "0 1" -- --models qwen3_30b_a3b mixtral_8x7b \
    llama4_scout deepseek_v3 --quant fp8 fp8_block --tokens 4096 16384
fi
if [[ "$what" == native4 ]]; then
  tests_then_sanitize native4 tests/test_ws_fp4.py "native_cast_is_bit_equal" \
    "native_cast_is_bit_equal and nvfp4-128" 150
  tests_then_sanitize wide_fp8_gemm2 tests/test_ws_gemm.py "wide_fp8_gemm2" \
    "wide_fp8_gemm2 and swiglu" 100
  ab_passes native4 40 4 MOE_OPS_WS_NATIVE_CAST "0 1" -- --models deepseek_v3 gpt_oss_120b \
    --quant nvfp4 mxfp4 --tokens 4096 16384
  ab_passes wide_fp8_gemm2 50 6 MOE_OPS_WS_WIDE_FP8_GEMM2 "0 1" -- --models mixtral_8x7b \
    llama4_scout qwen3_30b_a3b --quant fp8 --tokens 4096 16384
fi
if [[ "$what" == record ]]; then
  python3 benchmarks/bench.py --out "$out/h200.json" --plot "$out/h200.png" \
    --deadline-s "${DEADLINE_S:-430}" > "$out/bench_table.txt" 2> "$out/bench.log" || status=1
  timeout "${CHECK_S:-200}" python3 benchmarks/gpu_check.py --json "$out/gpu_check.json" \
    > "$out/gpu_check.log" 2>&1 || status=1
  tail -n 8 "$out/gpu_check.log"
  sanitize
fi
# retune_prefill MODEL QUANT TOKENS...: the pair's buckets 1024-8192 re-tuned into the tree's
# table (the old and new tables kept in the results dir), then the layer on new, old, new
retune_prefill() {
  local model=$1 quant=$2 table arm
  shift 2
  table=moe_ops/tuned/nvidia_h200__${model}__${quant}.json
  cp "$table" "$out/table_${model}_${quant}_old.json"
  timeout 200 python3 -m moe_ops.tune --model "$model" --quant "$quant" --ship \
    --buckets 1024,2048,4096,8192 --report "$out/tune_${model}_${quant}.json" --quiet \
    > "$out/tune_${model}_${quant}.log" 2>&1 || status=1
  tail -n 6 "$out/tune_${model}_${quant}.log"
  cp "$table" "$out/table_${model}_${quant}_new.json"
  for arm in new old new2; do
    cp "$out/table_${model}_${quant}_${arm%2}.json" "$table"
    layer_arm "tune_${model}_${quant}_$arm" 40 $# MOE_OPS_TABLE_ARM="$arm" -- --models "$model" \
      --quant "$quant" --tokens "$@"
  done
  cp "$out/table_${model}_${quant}_new.json" "$table"
}
if [[ "$what" == gridround ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_round_to_dtype.py \
    tests/test_kernels_experts.py > "$out/pytest_gridround.log" 2>&1 || status=1
  tail -n 2 "$out/pytest_gridround.log"
  for pass in 1 2; do
    for arm in 1 0; do
      MOE_OPS_GRID_ROUNDING=$arm timeout 120 python3 benchmarks/dev_grid_rounding.py \
        --out "$out/grid_rounding_${arm}_$pass.json" > "$out/grid_rounding_${arm}_$pass.log" 2>&1 \
        || status=1
      cat "$out/grid_rounding_${arm}_$pass.log"
    done
  done
fi
if [[ "$what" == pipepairs ]]; then
  tests_then_sanitize pipepairs tests/test_ws_gemm.py "pipelined_pairs" \
    "pipelined_pairs_are_bit_equal and 7-768-2-rows" 200
  for arm in 0 1; do
    MOE_OPS_WS_PIPE_PAIRS=$arm timeout 100 python3 benchmarks/dev_ws_fp8_block.py \
      --model mixtral_8x7b --probe --tokens 16384 --k-mults 1 --tiles rows --forms 00 \
      --repeat 2 > "$out/ws_probe_pipe_$arm.log" 2>&1 || status=1
    echo "mixtral_8x7b MOE_OPS_WS_PIPE_PAIRS=$arm"
    grep -v "^{" "$out/ws_probe_pipe_$arm.log" | tail -n 5
  done
  ab_passes pipepairs 50 6 MOE_OPS_WS_PIPE_PAIRS "0 1" -- --models mixtral_8x7b \
    llama4_scout qwen3_30b_a3b --quant fp8 --tokens 4096 16384
fi
if [[ "$what" == scalecols ]]; then
  ab_passes scalecols 50 4 MOE_OPS_WS_SCALE_LOADS "before cols" -- --models deepseek_v3 \
    --quant fp8_block --tokens 1024 2048 4096
fi
if [[ "$what" == expertgroups ]]; then
  tests_then_sanitize expertgroups tests/test_ws_gemm.py "expert_groups" \
    "expert_groups_are_bit_equal and cols-fp8_block and 8-132 and 1-" 200
  MOE_OPS_WS_EXPERT_GROUPS=1 NCU_TOKENS=4096 NCU_TAG=l2_groups \
    NCU_CASES="deepseek_v3:fp8_block:_ws_fp8_block" bash benchmarks/h200_run.sh ncu4l || status=1
  ab_passes expertgroups 60 9 MOE_OPS_WS_EXPERT_GROUPS "0 1" -- --models deepseek_v3 \
    qwen3_30b_a3b mixtral_8x7b --quant fp8_block fp8 --tokens 1024 4096 16384
fi
if [[ "$what" == expertrule ]]; then
  ab_passes expertrule 50 9 MOE_OPS_WS_EXPERT_GROUPS "0 auto" -- --models deepseek_v3 \
    llama4_scout mixtral_8x7b --quant fp8_block fp8 --tokens 2048 4096 16384
fi
if [[ "$what" == widedeep ]]; then
  tests_then_sanitize widedeep tests/test_ws_gemm.py "padding_halves_skip" \
    "padding_halves_skip and wide" 120
  MOE_OPS_WS_FP8_BLOCK_TILE=wide MOE_OPS_WS_SKIP_PADDING=1 NCU_TOKENS=4096 \
    NCU_TAG=l2_wide_skip NCU_CASES="deepseek_v3:fp8_block:_ws_fp8_block" \
    bash benchmarks/h200_run.sh ncu4l || status=1
  arms=""
  for arm in auto:0 wide:0 wide:1 rows:1; do
    arms+=" ${arm/:/_}:MOE_OPS_WS_FP8_BLOCK_TILE=${arm%%:*},MOE_OPS_WS_SKIP_PADDING=${arm##*:}"
  done
  ab_env_passes widedeep 50 3 "$arms" -- --models deepseek_v3 --quant fp8_block \
    --tokens 2048 4096 8192
fi
if [[ "$what" == groupm ]]; then
  tests_then_sanitize groupm tests/test_ws_gemm.py "group_sizes" \
    "group_sizes_are_bit_equal and True-1-rows" 150
  for arm in 8:0 16:32; do
    MOE_OPS_WS_GROUP_M=${arm%%:*} MOE_OPS_WS_GROUP_M_GEMM1=${arm##*:} NCU_TOKENS=16384 \
      NCU_TAG="l2_group_${arm/:/_}" NCU_CASES="mixtral_8x7b:fp8:_ws_fp8_block" \
      bash benchmarks/h200_run.sh ncu4l || status=1
  done
  arms=""
  for arm in 8:0 16:0 16:32 32:0; do
    arms+=" ${arm/:/_}:MOE_OPS_WS_GROUP_M=${arm%%:*},MOE_OPS_WS_GROUP_M_GEMM1=${arm##*:}"
  done
  ab_env_passes groupm 60 6 "$arms" -- --models mixtral_8x7b llama4_scout deepseek_v3 \
    --quant fp8 fp8_block --tokens 4096 16384
fi
if [[ "$what" == widemin ]]; then
  ab_passes widemin 70 12 MOE_OPS_WS_WIDE_MIN_ROWS "512 256" -- --models mixtral_8x7b \
    llama4_scout qwen3_30b_a3b deepseek_v3 --quant fp8 fp8_block --tokens 1024 4096 8192
fi
if [[ "$what" == widemin128 ]]; then
  ab_passes widemin128 60 12 MOE_OPS_WS_WIDE_MIN_ROWS "256 128" -- --models mixtral_8x7b \
    llama4_scout qwen3_30b_a3b deepseek_v3 --quant fp8 fp8_block --tokens 512 2048 4096
fi
if [[ "$what" == ncugemm1 ]]; then
  for case in ${NCU_CASES:-mixtral_8x7b:fp8}; do
    IFS=: read -r m q <<< "$case"
    rep="$out/ncu_gemm1_${m}_${q}_${NCU_TOKENS:-4096}"
    timeout 200 ncu -k regex:_ws_fp8_block -c 1 --section SourceCounters \
      --section WarpStateStats --section SpeedOfLight -f -o "$rep" python3 \
      benchmarks/profile_layer.py --models "$m" --quant "$q" --tokens "${NCU_TOKENS:-4096}" \
      --calls 1 > "$rep.log" 2>&1 || status=1
    ncu -i "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1 || status=1
    ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" \
      2>> "$rep.log" || status=1
    python3 benchmarks/ncu_sass_stalls.py "$rep.csv" --top 40 > "$rep.txt" 2>&1 || status=1
    echo "$m $q T = ${NCU_TOKENS:-4096}"
    grep -E "Duration|Throughput|Warp Cycles|Issued" "$rep.details.txt" | head -n 20
    cut -c1-150 "$rep.txt" | head -n 60
  done
fi
if [[ "$what" == fastsig ]]; then
  tests_then_sanitize fastsig tests/test_ws_gemm.py "fast_sigmoid or sigmoid_either_way" \
    "fast_sigmoid_stays_near and wide" 150
  tests_then_sanitize fastsig4 tests/test_ws_fp4.py "fast_sigmoid or FAST_SIGMOID" \
    "fast_sigmoid_stays_near and mxfp4-128" 150
  MOE_OPS_WS_FAST_SIGMOID=1 MOE_OPS_WS_FP4_FAST_SIGMOID=1 timeout 200 \
    python3 benchmarks/gpu_check.py \
    --quant fp8 fp8_block nvfp4 mxfp4 --no-large --json "$out/gpu_check_fastsig.json" \
    > "$out/gpu_check_fastsig.log" 2>&1 || status=1
  tail -n 3 "$out/gpu_check_fastsig.log"
  MOE_OPS_WS_FAST_SIGMOID=1 NCU_TOKENS=4096 NCU_TAG=fastsig \
    NCU_CASES="mixtral_8x7b:fp8:_ws_fp8_block" bash benchmarks/h200_run.sh ncu4l || status=1
fi
if [[ "$what" == fastsigab ]]; then
  ab_passes fastsig 50 12 MOE_OPS_WS_FAST_SIGMOID "0 1" -- --models mixtral_8x7b \
    llama4_scout qwen3_30b_a3b deepseek_v3 --quant fp8 fp8_block --tokens 1024 4096 16384
  ab_passes fastsig4 40 6 MOE_OPS_WS_FP4_FAST_SIGMOID "0 1" -- --models deepseek_v3 gpt_oss_120b \
    --quant nvfp4 mxfp4 --tokens 1024 4096 16384
fi
if [[ "$what" == routequant ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_route_quantize.py \
    tests/test_kernels_routing.py tests/test_triton_layer.py > "$out/pytest_routequant.log" 2>&1 \
    || status=1
  tail -n 2 "$out/pytest_routequant.log"
  timeout 150 python3 benchmarks/gpu_check.py --quant fp8 fp8_block --tokens 1 7 64 --no-large \
    --json "$out/gpu_check_routequant.json" > "$out/gpu_check_routequant.log" 2>&1 || status=1
  tail -n 3 "$out/gpu_check_routequant.log"
  ab_passes routequant 50 24 MOE_OPS_ROUTE_QUANTIZE_MAX_TOKENS "0 1024" -- \
    --models qwen3_30b_a3b mixtral_8x7b deepseek_v3 llama4_scout --quant fp8 fp8_block \
    --listed-only --tokens 1 4 16 64 256 1024
fi
if [[ "$what" == routealign ]]; then
  export MOE_OPS_ROUTE_ALIGN=1
  tests_then_sanitize routealign tests/test_route_quantize.py \
    "test or dispatch or routing or layer" "same_dispatch" 200
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_layer.py \
    tests/test_kernels_routing.py tests/test_dispatch.py tests/test_ops.py tests/test_layer.py \
    > "$out/pytest_routealign_layer.log" 2>&1 || status=1
  tail -n 2 "$out/pytest_routealign_layer.log"
  timeout 150 python3 benchmarks/gpu_check.py --quant none fp8 fp8_block --tokens 1 7 64 \
    --no-large --json "$out/gpu_check_routealign.json" > "$out/gpu_check_routealign.log" 2>&1 \
    || status=1
  tail -n 3 "$out/gpu_check_routealign.log"
  unset MOE_OPS_ROUTE_ALIGN
  ab_passes routealign 50 24 MOE_OPS_ROUTE_ALIGN "0 1" -- --models qwen3_30b_a3b \
    mixtral_8x7b deepseek_v3 llama4_scout --quant none fp8 fp8_block --listed-only \
    --tokens 2 4 8 16 64
fi
if [[ "$what" == tunepf ]]; then
  for pair in ${TUNE_PAIRS:-llama4_scout:fp8 mixtral_8x7b:fp8 deepseek_v3:fp8_block}; do
    retune_prefill "${pair%%:*}" "${pair##*:}" 1024 4096 16384
  done
fi
if [[ "$what" == tuneq3 ]]; then
  retune_prefill qwen3_30b_a3b fp8 1024 2048 4096 16384
fi
if [[ "$what" == ncugemm2 ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ws_gemm.py \
    -k "(overlap_is_bit_equal and -1-False-) or overlap_with_the_gathering" \
    > "$out/pytest_overlap_gemm1.log" 2>&1 || status=1
  tail -n 2 "$out/pytest_overlap_gemm1.log"
  rep="$out/ncu_qwen3_gemm2"
  timeout 200 ncu -k regex:_ws_fp8_block -c 1 --section SourceCounters --section WarpStateStats \
    --section SpeedOfLight -f -o "$rep" python3 benchmarks/dev_ws_fp8_block.py \
    --model qwen3_30b_a3b --probe --tokens 16384 --k-mults 1 --tiles rows --forms 00 \
    > "$rep.log" 2>&1 || status=1
  ncu -i "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1 || status=1
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2>> "$rep.log" \
    || status=1
  python3 benchmarks/ncu_sass_stalls.py "$rep.csv" --top 30 > "$rep.txt" 2>&1 || status=1
  grep -E "Duration|Throughput|Warp Cycles|Issued" "$rep.details.txt" | head -n 20
  cut -c1-150 "$rep.txt" | head -n 50
  timeout 150 python3 benchmarks/dev_ws_fp8_block.py --model qwen3_30b_a3b --probe \
    --tokens 16384 --tiles rows --forms 00 --group-m 1 4 8 16 32 --out "$out" \
    > "$out/ws_probe_group_m.log" 2>&1 || status=1
  grep -v "^{" "$out/ws_probe_group_m.log" | tail -n 42
fi
if [[ "$what" == tune16 ]]; then
  ship_tables qwen3_30b_a3b:none qwen3_30b_a3b:fp8 mixtral_8x7b:none mixtral_8x7b:fp8 \
    llama4_scout:none llama4_scout:fp8 deepseek_v3:fp8_block
fi
if [[ "$what" == tune ]]; then
  pairs=$(python3 -c "import json; m = json.load(open('benchmarks/shapes.json'))['models']; print(' '.join(f'{n}:{q}' for n, e in m.items() for q in e['quant']))")
  SHIP=1 SKIP_TESTS=1 MOE_OPS_RESULTS_DIR="$out" bash benchmarks/gpu_tune_check.sh $pairs || status=1
fi
exit $status
