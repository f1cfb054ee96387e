"""4-bit (nvfp4) decode GEMM experiment: a warp-specialized Gluon kernel that decodes the packed
weights straight into wgmma's register operand, beside grouped_gemm's Triton kernel.

Why: the Triton W4A16 decode loop spends 5.1 SASS instructions a weight value (NOTES.md), of
which the e2m1 decode itself is about 3; the rest is what Triton wraps around it (per-wgmma
fences, layout bookkeeping, address arithmetic), and one warpgroup both streams and decodes.
Here the schedule is explicit:
  producer   1 warp: TMA loads of each K step (256 columns) of 128 weight rows' packed bytes
             (quant.py's kernel order, a 3-D box over [rows, 4 runs, Kp/8]), their e4m3 block
             scales and the 16 token rows of x, into a ring of STAGES slots
  consumers  2 or 4 warpgroups, 64 weight rows each: the packed tile is read from shared
             memory in the layout of wgmma's A fragment (each thread its two rows' runs),
             decoded with grouped_gemm's inline PTX, and given to `warpgroup_mma` as a register
             operand; the layout conversions are proved trivial at compile time
             (assert_trivial). Four warpgroups (112 registers a thread) give the schedulers
             more warps to hide the decode's dependent integer chains.
Swap-AB: the weight rows are the MMA's M side (64 a warpgroup), the tokens its N side (16).

The problem (one GEMM of a decode step, GEMM2's form): E experts, each with up to 16 token rows
x_e [16, K] bf16 (pre-gathered; unused rows zero), nvfp4 weights W_e [N, K] (kernel-order packed
bytes, e4m3 block scales per 16 columns, a global scale per row); out[e*16 + m, n] =
x_e[m] . W_e[n]. Variants: "gluon 2 consumers" / "gluon 4 consumers" (this kernel), "ours"
(grouped_gemm.gemm2 with the default 4-bit decode config on a dispatch of the same rows). Each
is compared with a float32 reference (dequantized weights) on random data, outputs
NaN-poisoned first; times by triton.testing.do_bench; TB/s over the packed weights and scales.

Its sm_90 build (--aot): the K loop is 423 SASS instructions a thread for 128 weight values,
3.3 a value (the Triton loop: 5.1; 481 with each thread converting all its rows' scales itself,
split_scales=False), 2 warpgroup fences a K step; not yet run on a GPU.

    python benchmarks/dev_gluon_fp4_decode.py --out benchmarks/results      # an H200
    python benchmarks/dev_gluon_fp4_decode.py --aot                         # no GPU: sm_90 build
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_ops.kernels.grouped_gemm import (  # noqa: E402
    NVFP4_FAST_EPILOGUE, _E2M1_BF16_ASM_NVFP4, _E4M3_TO_BF16_P117)

ROWS = 64        # weight rows a consumer warpgroup (the MMA's M)
# consumer warpgroups -> (registers a consumer thread, the launch's maxnreg)
CONSUMER_CONFIGS = {2: (232, 168), 4: (112, 102)}
BLOCK_K = 256    # columns a K step: 4 runs of 32 bytes a row
TOKENS = 16      # token rows an expert (the MMA's N)
STAGES = 4

# One K step's packed bytes of a warpgroup's 64 rows, [64, 128] (byte j = 32t + 2c + q of a row:
# run t, slice c, pair q): each thread holds its two rows' (r, r + 8) run t, the bytes wgmma's A
# fragment needs (rows 16w + l/4 and + 8, columns 16c + 2t + q and + 8).
PACKED_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, 128])
# the same positions as [row, t, c, q]
PACKED_LAYOUT_4D = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0], [0, 0, 8, 0],
               [8, 0, 0, 0]],
    lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[ROWS, 4, 16, 2])
# A K step's e4m3 scale bytes [64 rows, 16 slices] split over the four threads that share a row
# pair: each converts 4 slices of its 2 rows (the conversion is not repeated four times over),
# then the factors are exchanged within the warp (convert_layout) to the layout every thread
# of the row needs (all 16 slices: SliceLayout(2, SliceLayout(1, PACKED_LAYOUT_4D))).
SCALES_SPLIT_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]],
    lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, 16])


@gluon.constexpr_function
def _scales_layout(split):
    return SCALES_SPLIT_LAYOUT if split else gl.SliceLayout(2, gl.SliceLayout(1, PACKED_LAYOUT_4D))


@gluon.jit
def _decode_step(packed, scales, P2: gl.constexpr, P4: gl.constexpr, DOT: gl.constexpr):
    """Packed bytes [64, 128] (P2) and e4m3 scale bytes [64, 16] (SCALES_SPLIT_LAYOUT, or a
    slice of P4) -> the weight tile [64, 256] bf16 / 512 in wgmma's A-operand layout (DOT), K
    natural."""
    # block scales * 2^117 by bit moves, four a register
    factor = gl.inline_asm_elementwise(_E4M3_TO_BF16_P117, "=r,=r,r", [scales],
                                       dtype=gl.bfloat16, is_pure=True, pack=4)
    factor = gl.convert_layout(factor, gl.SliceLayout(2, gl.SliceLayout(1, P4)))
    # each code's factor: [row, c] -> [row, t, c, q] -> the packed bytes' positions
    factor = gl.expand_dims(gl.expand_dims(factor, 2), 1)
    factor = gl.broadcast(factor, gl.full([64, 4, 16, 2], 0.0, gl.bfloat16, P4))[0]
    factor = gl.convert_layout(gl.reshape(factor, [64, 128]), P2, assert_trivial=True)
    low, high = gl.inline_asm_elementwise(
        _E2M1_BF16_ASM_NVFP4, "=r,=r,=r,=r,r,r,r", [packed, factor],
        dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    # byte j = 32t + 2c + q holds columns 16c + 2t + q (low nibble) and + 8 (high)
    values = gl.reshape(gl.join(low, high), [64, 4, 16, 2, 2])     # [row, t, c, q, h]
    values = gl.reshape(gl.permute(values, [0, 2, 4, 1, 3]), [64, 256])  # k = 16c+8h+2t+q
    return gl.convert_layout(values, DOT, assert_trivial=True)


@gluon.jit
def _producer(descs, smem, sizes, HALF: gl.constexpr):
    w_desc, s_desc, x_desc = descs
    w_bufs, s_bufs, x_bufs, ready, empty = smem
    N, K, num_experts = sizes
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BN: gl.constexpr = w_bufs.type.shape[1]
    num_n = N // BN
    k_steps = K // 256
    index = 0
    phase = 1
    for tile in range(gl.program_id(0), num_experts * num_n, gl.num_programs(0)):
        expert = tile // num_n
        row0 = expert * N + (tile % num_n) * BN
        for kb in range(k_steps):
            mbarrier.wait(empty.index(index), phase)
            bar = ready.index(index)
            mbarrier.expect(bar, w_desc.block_type.nbytes + s_desc.block_type.nbytes
                            + x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [row0, 0, kb * 32], bar, w_bufs.index(index))
            tma.async_copy_global_to_shared(s_desc, [row0, kb * 16], bar, s_bufs.index(index))
            tma.async_copy_global_to_shared(x_desc, [expert * 16, kb * 256], bar,
                                            x_bufs.index(index))
            index += 1
            if index == STAGES:
                index = 0
                phase ^= 1


@gluon.jit
def _consumer(descs, smem, sizes, HALF: gl.constexpr, out_ptr, gscale_ptr, stride_om,
              SPLIT: gl.constexpr):
    w_desc, s_desc, x_desc = descs
    w_bufs, s_bufs, x_bufs, ready, empty = smem
    N, K, num_experts = sizes
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BN: gl.constexpr = w_bufs.type.shape[1]
    P2: gl.constexpr = PACKED_LAYOUT
    P4: gl.constexpr = PACKED_LAYOUT_4D
    SCALES: gl.constexpr = _scales_layout(SPLIT)   # [row, c]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 16, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    num_n = N // BN
    k_steps = K // 256
    index = 0
    phase = 0
    for tile in range(gl.program_id(0), num_experts * num_n, gl.num_programs(0)):
        expert = tile // num_n
        n0 = (tile % num_n) * BN + HALF * 64
        acc = gl.zeros([64, 16], gl.float32, mma)
        for kb in range(k_steps):
            mbarrier.wait(ready.index(index), phase)
            packed = w_bufs.index(index).reshape([BN, 128]).slice(HALF * 64, 64, dim=0).load(P2)
            scales = s_bufs.index(index).slice(HALF * 64, 64, dim=0).load(SCALES)
            weights = _decode_step(packed, scales, P2, P4, DOT)
            acc = warpgroup_mma(weights, x_bufs.index(index).permute((1, 0)), acc,
                                is_async=True)
            # the register operand stays live until the MMA has read it
            acc, weights = warpgroup_mma_wait(num_outstanding=0, deps=(acc, weights))
            mbarrier.arrive(empty.index(index), count=1)
            index += 1
            if index == STAGES:
                index = 0
                phase ^= 1
        # out[expert * 16 + m, n] = acc[n, m] * global scale[n] * 512
        rows_n = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        toks = expert * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
        gscale = gl.load(gscale_ptr + expert * N + rows_n) * 512.0
        values = (acc * gscale[:, None]).to(gl.bfloat16)
        gl.store(out_ptr + toks[None, :].to(gl.int64) * stride_om + rows_n[:, None], values)


@gluon.jit
def _consumer_1(descs, smem, sizes, HALF: gl.constexpr, out_ptr, gscale_ptr, stride_om,
              SPLIT: gl.constexpr):
    _consumer(descs, smem, sizes, 1, out_ptr, gscale_ptr, stride_om, SPLIT)


@gluon.jit
def _consumer_2(descs, smem, sizes, HALF: gl.constexpr, out_ptr, gscale_ptr, stride_om,
              SPLIT: gl.constexpr):
    _consumer(descs, smem, sizes, 2, out_ptr, gscale_ptr, stride_om, SPLIT)


@gluon.jit
def _consumer_3(descs, smem, sizes, HALF: gl.constexpr, out_ptr, gscale_ptr, stride_om,
              SPLIT: gl.constexpr):
    _consumer(descs, smem, sizes, 3, out_ptr, gscale_ptr, stride_om, SPLIT)


@gluon.jit
def _producer_entry(descs, smem, sizes, HALF: gl.constexpr, out_ptr, gscale_ptr, stride_om,
              SPLIT: gl.constexpr):
    _producer(descs, smem, sizes, HALF)


@gluon.jit
def fp4_decode_kernel(w_desc, s_desc, x_desc, out_ptr, gscale_ptr, N, K, num_experts,
                      stride_om, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, SPLIT: gl.constexpr):
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape,
                                       s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape,
                                       x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    descs = (w_desc, s_desc, x_desc)
    smem = (w_bufs, s_bufs, x_bufs, ready, empty)
    sizes = (N, K, num_experts)
    # consumer warpgroups: 2 (232 registers a thread) or 4 (fewer, more warps to hide the
    # decode's dependent integer chains); each owns 64 of the tile's CONSUMERS * 64 rows
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
            (_consumer_1, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
            (_producer_entry, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
        ], [4, 1], [CONSUMER_REGS, 40])
    else:
        gl.warp_specialize([
            (_consumer, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
            (_consumer_1, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
            (_consumer_2, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
            (_consumer_3, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
            (_producer_entry, (descs, smem, sizes, 0, out_ptr, gscale_ptr, stride_om, SPLIT)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, 24])


def _layouts():
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    x_layout = gl.NVMMASharedLayout.get_default_for([TOKENS, BLOCK_K], gl.bfloat16)
    return w_layout, s_layout, x_layout


def launch(w_packed, w_scale, x, out, gscale, programs=None, consumers=2, split_scales=True):
    """w_packed [E, N, Kp/2] uint8 (kernel order), w_scale [E, N, Kp/16] e4m3, x [E*16, Kp]
    bf16, gscale [E, N] fp32 -> out [E*16, N] bf16."""
    E, N, half_k = w_packed.shape
    K = half_k * 2
    block_n = consumers * ROWS
    consumer_regs, maxnreg = CONSUMER_CONFIGS[consumers]
    w_layout, s_layout, x_layout = _layouts()
    w3 = w_packed.view(E * N, 4, K // 8)
    w_desc = TensorDescriptor(w3, [E * N, 4, K // 8], [4 * (K // 8), K // 8, 1],
                              [block_n, 4, 32], w_layout)
    s2 = w_scale.view(torch.uint8).view(E * N, K // 16)
    s_desc = TensorDescriptor(s2, [E * N, K // 16], [K // 16, 1], [block_n, 16], s_layout)
    x_desc = TensorDescriptor(x, [x.shape[0], K], [x.stride(0), 1], [TOKENS, BLOCK_K], x_layout)
    if programs is None:
        programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count,
                       E * (N // block_n))
    fp4_decode_kernel[(programs, )](w_desc, s_desc, x_desc, out, gscale, N, K, E, out.stride(0),
                                    STAGES=STAGES, CONSUMERS=consumers,
                                    CONSUMER_REGS=consumer_regs, SPLIT=split_scales, num_warps=4,
                                    maxnreg=maxnreg)


def aot(consumers=2, split_scales=True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from aot_sm90 import main_loop, resource_usage
    w_layout, s_layout, x_layout = _layouts()
    block_n = consumers * ROWS
    consumer_regs, maxnreg = CONSUMER_CONFIGS[consumers]
    signature = {
        "w_desc": f"tensordesc<u8[{block_n}, 4, 32],{w_layout!r}>",
        "s_desc": f"tensordesc<u8[{block_n}, 16],{s_layout!r}>",
        "x_desc": f"tensordesc<bf16[{TOKENS}, {BLOCK_K}],{x_layout!r}>",
        "out_ptr": "*bf16", "gscale_ptr": "*fp32", "N": "i32", "K": "i32",
        "num_experts": "i32", "stride_om": "i32", "STAGES": "constexpr",
        "CONSUMERS": "constexpr", "CONSUMER_REGS": "constexpr", "SPLIT": "constexpr"}
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if name.endswith("_ptr") or name in ("N", "K", "stride_om")}
    consts = {"STAGES": STAGES, "CONSUMERS": consumers, "CONSUMER_REGS": consumer_regs,
              "SPLIT": split_scales}
    kernel = triton.compile(GluonASTSource(fn=fp4_decode_kernel, signature=signature,
                                           constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4, maxnreg=maxnreg))
    loop = main_loop(kernel)
    print(f"{consumers} consumers, split scales {split_scales}: {resource_usage(kernel)}, "
          f"shared {kernel.metadata.shared} B; longest loop "
          f"{len(loop)} SASS instructions for {BLOCK_K * ROWS // 128} weight values a thread "
          f"a K step ({len(loop) / (BLOCK_K * ROWS / 128):.2f} a value, the tile loop included)")
    return kernel


def make_problem(E, N, K, tokens, device, seed=0):
    from moe_ops.quant import fp4_to_kernel_order, quantize_nvfp4
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * 0.05
    packed, block_scale, global_scale = quantize_nvfp4(w)
    x = torch.zeros(E * TOKENS, K)
    for e in range(E):
        x[e * TOKENS:e * TOKENS + tokens] = torch.randn(tokens, K, generator=g)
    return dict(w_packed=fp4_to_kernel_order(packed).to(device),
                w_packed_natural=packed, w_scale=block_scale.to(device),
                gscale=global_scale[:, None].expand(E, N).contiguous().to(device),
                x=x.to(torch.bfloat16).to(device), tokens=tokens)


def reference(pb):
    from moe_ops.quant import dequantize_fp4
    w = dequantize_fp4(pb["w_packed_natural"].to(pb["x"].device), pb["w_scale"], "nvfp4",
                       pb["gscale"])                                   # [E, N, K] fp32
    E = w.shape[0]
    x = pb["x"].float().view(E, TOKENS, -1)
    return torch.bmm(x, w.transpose(1, 2)).reshape(E * TOKENS, -1)


def run_ours(pb, out_pairs):
    """grouped_gemm's Triton W4A16 kernel, GEMM2's form, on the same rows: a dispatch of 16
    slots an expert (its `tokens` first), the default 4-bit decode config; out_pairs [E *
    tokens, N] (pair p = expert * tokens + m)."""
    from moe_ops.kernels import grouped_gemm as gg
    E, N, half_k = pb["w_packed"].shape
    dev = pb["x"].device
    tokens = pb["tokens"]
    pairs = E * tokens
    slot = torch.arange(E * TOKENS, device=dev)
    m = slot % TOKENS
    sorted_ids = torch.where(m < tokens, (slot // TOKENS) * tokens + m, pairs).to(torch.int32)
    routing = gg.Routing(
        topk_ids=torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(tokens),
        topk_weights=torch.ones(pairs, device=dev), top_k=1, num_experts=E,
        local_expert_offset=0, sorted_pair_ids=sorted_ids,
        block_expert_ids=torch.arange(E, device=dev, dtype=torch.int32), align_block_m=TOKENS,
        num_padded=torch.tensor([E * TOKENS], dtype=torch.int32, device=dev))
    problem = gg.GemmProblem(2, E, N, half_k * 2, tokens, torch.bfloat16, "nvfp4", False)
    gg.gemm2(pb["x"], None, pb["w_packed"], pb["w_scale"], None, out_pairs, routing,
             gg.default_config(problem), quant="nvfp4", atomic_out=False,
             interpret_upcast=dev.type == "cpu",  # the interpreter's bf16 dots are wrong
             w2_global_scale=pb["gscale"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.aot:
        for consumers in CONSUMER_CONFIGS:
            for split in (True, False):
                aot(consumers, split)
        return
    from triton.testing import do_bench
    dev = torch.device("cuda")
    rows = []
    # DeepSeek-V3 GEMM1 at T = 1 (8 experts hit, N = 2I = 4096, K = H = 7168) and 16 tokens an
    # expert; GEMM2 (N = 7168, K = 2048)
    for name, E, N, K, tokens in (("gemm1 T=1", 8, 4096, 7168, 1),
                                  ("gemm1 16/expert", 8, 4096, 7168, 16),
                                  ("gemm2 T=1", 8, 7168, 2048, 1)):
        pb = make_problem(E, N, K, tokens, dev)
        ref = reference(pb)
        live = (torch.arange(E * TOKENS, device=dev) % TOKENS) < tokens
        weight_bytes = E * N * K // 2 + E * N * K // 16
        out = torch.full((E * TOKENS, N), float("nan"), dtype=torch.bfloat16, device=dev)
        out_pairs = torch.full((E * tokens, N), float("nan"), dtype=torch.bfloat16, device=dev)
        variants = (
            ("gluon 2 consumers", lambda: launch(pb["w_packed"], pb["w_scale"], pb["x"], out,
                                                 pb["gscale"], consumers=2),
             lambda: out.float()[live]),
            ("gluon 4 consumers", lambda: launch(pb["w_packed"], pb["w_scale"], pb["x"], out,
                                                 pb["gscale"], consumers=4),
             lambda: out.float()[live]),
            ("gluon 2 consumers unsplit scales",
             lambda: launch(pb["w_packed"], pb["w_scale"], pb["x"], out, pb["gscale"],
                            consumers=2, split_scales=False), lambda: out.float()[live]),
            ("ours", lambda: run_ours(pb, out_pairs), lambda: out_pairs.float()))
        for variant, fn, result in variants:
            try:
                out.fill_(float("nan"))
                out_pairs.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                got = result()
                err = ((got - ref[live]).norm() / ref[live].norm()).item()
                ms = do_bench(fn, warmup=10, rep=100)
                rows.append(dict(case=name, variant=variant, us=ms * 1e3, rel_err=err,
                                 unwritten=bool(torch.isnan(got).any()),
                                 tb_s=weight_bytes / ms / 1e9))
            except Exception as exc:  # noqa: BLE001 - record and go on
                rows.append(dict(case=name, variant=variant, error=repr(exc)[:600]))
            print(rows[-1], flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_fp4_decode.json"), "w") as f:
            json.dump(dict(command="python " + " ".join(sys.argv),
                           gpu=torch.cuda.get_device_name(),
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows),
                      f, indent=1)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
