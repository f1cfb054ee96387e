"""fp8_block prefill GEMM experiment: a warp-specialized persistent kernel written in Gluon.

Why: our Triton fp8_block kernels apply the 128x128 block scales inside the K loop
(`acc += dot(a, w) * a_s * w_s`), so every K step waits for its MMAs before the promotion and
the tensor cores idle during it: DeepSeek-V3's experts call reaches 474-539 TFLOP/s at
T = 4096-16384 against a 1000 target. Triton 3.6 cannot express the fix (its automatic warp
specialization does not apply to this loop on sm_90, see dev_prefill_ws.py); Gluon, Triton's
lower-level dialect shipped in the same wheel, can: explicit partitions, mbarriers, TMA and
asynchronous wgmma.

The kernel (DeepGEMM's structure): one program per SM walks the output tiles
[BLOCK_M = 128, BLOCK_N = 128] in grouped order. Three partitions:
  producer   1 warp: TMA loads of the A tile [128, 128] and the W tile [128, 128] of each K
             step into a ring of STAGES shared-memory buffers (ready / empty mbarriers)
  consumers  2 warpgroups, each owning 64 rows of the tile: wgmma of its rows against the
             stage into a fresh fp32 partial, wait, release the stage, then
             acc += partial * a_scale[row] * w_scale[col]. The two warpgroups run the same
             sequence independently, so while one promotes, the other's wgmma keeps the
             tensor cores busy.
The epilogue stores bf16 rows straight from registers (masked to the live rows).

The problem is the GEMM of dispatch-ordered rows (as the persistent kernel of grouped_gemm
gets them): A_sorted [M_pad, K] e4m3 with scales [M_pad, K/128] fp32, W [E, N, K] e4m3 with
scales [E, N/128, K/128], block_expert_ids [M_pad/128], num_padded [1] on the device.
C_sorted [M_pad, N] bf16 (no activation here: it is the GEMM's throughput in question).

Usage (an H200):
    python benchmarks/dev_ws_fp8_block.py --out benchmarks/results
Without a GPU (compiles for sm_90 with the wheel's ptxas, prints registers and the SASS size):
    python benchmarks/dev_ws_fp8_block.py --aot
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@gluon.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size, (tile % per_group) // size


@gluon.jit
def _producer(p, GROUP_M: gl.constexpr, ALIGN_M: gl.constexpr, PIPE: gl.constexpr):
    (a_desc, w_desc, a_bufs, w_bufs, ready, empty, a_scale_ptr, w_scale_ptr, out_ptr,
     block_expert_ptr, num_padded_ptr, N, K, stride_as, stride_wse, stride_wsn, stride_om) = p
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_m = gl.load(num_padded_ptr) // BM
    num_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    index = 0
    phase = 1  # the empty barriers start "released": wait on the phase before their first
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m * BM // ALIGN_M)
        w_row = expert * N + pid_n * BN
        for kb in range(k_steps):
            mbarrier.wait(empty.index(index), phase)
            bar = ready.index(index)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kb * BK], bar,
                                            a_bufs.index(index))
            tma.async_copy_global_to_shared(w_desc, [w_row, kb * BK], bar,
                                            w_bufs.index(index))
            index += 1
            if index == STAGES:
                index = 0
                phase ^= 1


@gluon.jit
def _consumer(p, GROUP_M: gl.constexpr, ALIGN_M: gl.constexpr, PIPE: gl.constexpr,
              HALF: gl.constexpr):
    (a_desc, w_desc, a_bufs, w_bufs, ready, empty, a_scale_ptr, w_scale_ptr, out_ptr,
     block_expert_ptr, num_padded_ptr, N, K, stride_as, stride_wse, stride_wsn, stride_om) = p
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    num_m = gl.load(num_padded_ptr) // BM
    num_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    index = 0
    phase = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m * BM // ALIGN_M)
        rows = pid_m * BM + HALF * ROWS + gl.arange(0, ROWS, layout=row_l)
        cols = pid_n * BN + gl.arange(0, BN, layout=col_l)
        a_scale_rows = a_scale_ptr + rows * stride_as
        w_scale_base = w_scale_ptr + expert * stride_wse + (pid_n * BN // 128) * stride_wsn
        acc = gl.zeros([ROWS, BN], gl.float32, mma)
        if PIPE:
            # The next step's wgmma is issued before this step's promotion: the tensor cores
            # get it while this warpgroup does its FMAs (three fp32 tiles live: acc and two
            # partials).
            s_cur = gl.load(a_scale_rows) * gl.load(w_scale_base)
            mbarrier.wait(ready.index(index), phase)
            part = warpgroup_mma(a_bufs.index(index).slice(HALF * ROWS, ROWS, dim=0),
                                 w_bufs.index(index).permute((1, 0)), acc, use_acc=False,
                                 is_async=True)
            for kb in range(1, k_steps):
                nxt_index = index + 1
                nxt_phase = phase
                if nxt_index == STAGES:
                    nxt_index = 0
                    nxt_phase = phase ^ 1
                s_nxt = gl.load(a_scale_rows + kb) * gl.load(w_scale_base + kb)
                mbarrier.wait(ready.index(nxt_index), nxt_phase)
                nxt = warpgroup_mma(a_bufs.index(nxt_index).slice(HALF * ROWS, ROWS, dim=0),
                                    w_bufs.index(nxt_index).permute((1, 0)), acc,
                                    use_acc=False, is_async=True)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
                mbarrier.arrive(empty.index(index), count=1)
                acc += done * s_cur[:, None]
                part = nxt
                s_cur = s_nxt
                index = nxt_index
                phase = nxt_phase
            done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(index), count=1)
            acc += done * s_cur[:, None]
            index += 1
            if index == STAGES:
                index = 0
                phase ^= 1
        else:
            for kb in range(k_steps):
                a_s = gl.load(a_scale_rows + kb)
                w_s = gl.load(w_scale_base + kb)
                mbarrier.wait(ready.index(index), phase)
                a_tile = a_bufs.index(index).slice(HALF * ROWS, ROWS, dim=0)
                w_tile = w_bufs.index(index).permute((1, 0))
                part = warpgroup_mma(a_tile, w_tile, acc, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                mbarrier.arrive(empty.index(index), count=1)
                acc += part * (a_s * w_s)[:, None]
                index += 1
                if index == STAGES:
                    index = 0
                    phase ^= 1
        out = out_ptr + rows[:, None].to(gl.int64) * stride_om + cols[None, :]
        gl.store(out, acc.to(gl.bfloat16), mask=(cols < N)[None, :])


@gluon.jit
def _consumer_hi(p, GROUP_M: gl.constexpr, ALIGN_M: gl.constexpr, PIPE: gl.constexpr):
    _consumer(p, GROUP_M, ALIGN_M, PIPE, 1)


@gluon.jit
def ws_fp8_block_kernel(a_desc, w_desc, a_scale_ptr, w_scale_ptr, out_ptr, block_expert_ptr,
                        num_padded_ptr, N, K, stride_as, stride_wse, stride_wsn, stride_om,
                        GROUP_M: gl.constexpr, ALIGN_M: gl.constexpr, STAGES: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        PIPE: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)   # one arrive from each consumer warpgroup
    p = (a_desc, w_desc, a_bufs, w_bufs, ready, empty, a_scale_ptr, w_scale_ptr, out_ptr,
         block_expert_ptr, num_padded_ptr, N, K, stride_as, stride_wse, stride_wsn, stride_om)
    gl.warp_specialize([
        (_consumer, (p, GROUP_M, ALIGN_M, PIPE, 0)),
        (_consumer_hi, (p, GROUP_M, ALIGN_M, PIPE)),
        (_producer, (p, GROUP_M, ALIGN_M, PIPE)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128


def launch(a, a_scale, w, w_scale, out, block_expert_ids, num_padded, *, stages=5, group_m=8,
           programs=None, consumer_regs=232, producer_regs=40, maxnreg=None, pipe=False):
    E, N, K = w.shape
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [BLOCK_M, BLOCK_K], a_layout)
    w2d = w.view(E * N, K)
    w_desc = TensorDescriptor(w2d, [E * N, K], [K, 1], [BLOCK_N, BLOCK_K], w_layout)
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    ws_fp8_block_kernel[(programs, )](
        a_desc, w_desc, a_scale, w_scale, out, block_expert_ids, num_padded,
        N, K, a_scale.stride(0), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        GROUP_M=group_m, ALIGN_M=BLOCK_M, STAGES=stages, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, PIPE=pipe, num_warps=4, maxnreg=maxnreg)


def aot(stages=5, consumer_regs=232, producer_regs=40, maxnreg=168, pipe=False):
    """Compile for sm_90 without a GPU; print registers, spills and what the K loop holds."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    signature = {
        "a_desc": f"tensordesc<fp8e4nv[{BLOCK_M}, {BLOCK_K}],{a_layout!r}>",
        "w_desc": f"tensordesc<fp8e4nv[{BLOCK_N}, {BLOCK_K}],{w_layout!r}>",
        "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "out_ptr": "*bf16",
        "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
        "N": "i32", "K": "i32", "stride_as": "i32", "stride_wse": "i32", "stride_wsn": "i32",
        "stride_om": "i32",
        "GROUP_M": "constexpr", "ALIGN_M": "constexpr", "STAGES": "constexpr",
        "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr", "PIPE": "constexpr"}
    consts = {"GROUP_M": 8, "ALIGN_M": BLOCK_M, "STAGES": stages,
              "CONSUMER_REGS": consumer_regs, "PRODUCER_REGS": producer_regs, "PIPE": pipe}
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if name.endswith("_ptr") or name in ("N", "K", "stride_om", "stride_wse")}
    src = GluonASTSource(fn=ws_fp8_block_kernel, signature=signature, constexprs=consts,
                         attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4, maxnreg=maxnreg))
    return kernel


# ---------------------------------------------------------------------------------------------
# The GPU run: correctness against an fp32 reference, then timing beside our Triton kernel.
# ---------------------------------------------------------------------------------------------

def make_problem(tokens, top_k, E, N, K, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pairs = tokens * top_k
    experts = torch.randint(0, E, (pairs, ), generator=g)
    counts = torch.bincount(experts, minlength=E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    m_pad = int(padded.sum())
    # rows of each expert in a run of its padded length; padding rows get random data too
    a32 = torch.randn(m_pad, K, generator=g)
    a_scale = torch.rand(m_pad, K // 128, generator=g) * 0.02 + 0.001
    w32 = torch.randn(E, N, K, generator=g)
    w_scale = torch.rand(E, N // 128, K // 128, generator=g) * 0.02 + 0.001
    block_expert = torch.repeat_interleave(torch.arange(E, dtype=torch.int32),
                                           (padded // BLOCK_M))
    # slot -> pair id (our dispatch's sorted_pair_ids): each expert's real pairs first, then
    # padding slots holding `pairs` (masked by the kernels)
    sorted_pair_ids = torch.full((m_pad, ), pairs, dtype=torch.int32)
    real_slots = torch.cat([torch.arange(int(s), int(s) + int(c)) for s, c in
                            zip(torch.cumsum(padded, 0) - padded, counts)])
    sorted_pair_ids[real_slots] = torch.arange(pairs, dtype=torch.int32)
    topk_ids = torch.empty(pairs, dtype=torch.int32)
    topk_ids[sorted_pair_ids[real_slots].long()] = block_expert.repeat_interleave(BLOCK_M)[real_slots]
    a = a32.clamp(-448, 448).to(torch.float8_e4m3fn)
    w = w32.clamp(-448, 448).to(torch.float8_e4m3fn)
    return dict(a=a.to(device), a_scale=a_scale.to(device), w=w.to(device),
                w_scale=w_scale.to(device), block_expert_ids=block_expert.to(device),
                num_padded=torch.tensor([m_pad], dtype=torch.int32, device=device),
                sorted_pair_ids=sorted_pair_ids.to(device), topk_ids=topk_ids.to(device),
                real_slots=real_slots.to(device), m_pad=m_pad, pairs=pairs, padded=padded)


def reference(pb, rows=None):
    """fp32 C = (A * a_scale) @ (W[e] * w_scale)^T per block, for the given row blocks."""
    a = pb["a"].float()
    a_s = pb["a_scale"].repeat_interleave(128, dim=1)
    out = torch.empty(pb["m_pad"], pb["w"].shape[1], device=a.device)
    start = 0
    for e, n_rows in enumerate(pb["padded"].tolist()):
        if n_rows == 0:
            continue
        w = pb["w"][e].float() * pb["w_scale"][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        out[start:start + n_rows] = (a[start:start + n_rows] * a_s[start:start + n_rows]) @ w.T
        start += n_rows
    return out


def run_ours(pb, out_pairs, persistent=True, stages=3):
    """moe_ops' Triton fp8_block kernel on the same rows (GEMM2's form: reads the rows in
    dispatch order, writes one row per pair times a routing weight of 1), with the tables'
    prefill config for DeepSeek-V3 fp8_block (64x128x128, 4 warps, group 16)."""
    from moe_ops.kernels import grouped_gemm as gg
    routing = gg.Routing(topk_ids=pb["topk_ids"], topk_weights=torch.ones(
        pb["pairs"], device=pb["a"].device), top_k=8, num_experts=pb["w"].shape[0],
        local_expert_offset=0, sorted_pair_ids=pb["sorted_pair_ids"],
        block_expert_ids=pb["block_expert_ids"], align_block_m=BLOCK_M,
        num_padded=pb["num_padded"])
    config = gg.GemmConfig(64, 128, 128, 16, 4, stages, persistent=persistent)
    gg.gemm2(pb["a"], pb["a_scale"], pb["w"], pb["w_scale"], None, out_pairs, routing, config,
             quant="fp8_block", atomic_out=False)


def run_package(pb, out_pairs, tile, coalesced=True):
    """moe_ops.kernels.ws_gemm (this kernel as the package runs it: GEMM2's epilogue, one row
    per pair times a routing weight of 1) on the same rows."""
    from moe_ops.kernels import grouped_gemm as gg, ws_gemm
    routing = gg.Routing(topk_ids=pb["topk_ids"], topk_weights=torch.ones(
        pb["pairs"], device=pb["a"].device), top_k=8, num_experts=pb["w"].shape[0],
        local_expert_offset=0, sorted_pair_ids=pb["sorted_pair_ids"],
        block_expert_ids=pb["block_expert_ids"], align_block_m=BLOCK_M,
        num_padded=pb["num_padded"])
    saved = ws_gemm.COALESCED_STORE
    ws_gemm.COALESCED_STORE = coalesced
    try:
        ws_gemm.gemm(pb["a"], pb["a_scale"], pb["w"], pb["w_scale"], None, out_pairs, routing,
                     gemm=2, activation="none", tile=tile)
    finally:
        ws_gemm.COALESCED_STORE = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--variants", nargs="+", default=None,
                    help="subset of: ws, ws-pipe, ours, package (default all)")
    args = ap.parse_args()
    if args.aot:
        for stages, pipe in ((4, False), (5, False), (4, True), (5, True)):
            k = aot(stages=stages, pipe=pipe)
            from aot_sm90 import main_loop, resource_usage
            sass = main_loop(k)
            print(f"stages {stages} pipe {pipe}: {resource_usage(k)}, shared {k.metadata.shared} B, "
                  f"longest loop {len(sass)} SASS instructions", flush=True)
            if stages == 5:
                with open(f"/tmp/ws_fp8_block_{pipe}.ptx", "w") as f:
                    f.write(k.asm["ptx"])
                with open(f"/tmp/ws_fp8_block_{pipe}.sass", "w") as f:
                    f.write("\n".join(sass))
        return
    from triton.testing import do_bench
    dev = torch.device("cuda")
    rows = []
    # DeepSeek-V3 (E 256, H 7168, I 2048, top_k 8): GEMM1 N = 2I = 4096, K = H; GEMM2 N = H, K = I
    for T in args.tokens:
        for gemm, N, K in (("gemm1", 4096, 7168), ("gemm2", 7168, 2048)):
            pb = make_problem(T, 8, 256, N, K, dev, seed=T + N)
            out = torch.full((pb["m_pad"], N), float("nan"), dtype=torch.bfloat16, device=dev)
            flops = 2.0 * pb["pairs"] * N * K
            ref = reference(pb)
            real = pb["real_slots"]
            variants = [(f"ws s{st}{' pipe' if pipe else ''}", st, pipe)
                        for pipe in (False, True) for st in (4, 5)]
            variants += [("ours persistent", 3, None), ("ours tile", 4, None),
                         ("package rows", 0, "rows"), ("package cols", 0, "cols"),
                         ("package rows mma-store", 0, "rows/mma"),
                         ("package cols mma-store", 0, "cols/mma")]
            wanted = args.variants
            if wanted:
                variants = [v for v in variants if
                            ("ws" in wanted and v[0].startswith("ws") and "pipe" not in v[0])
                            or ("ws-pipe" in wanted and "pipe" in v[0])
                            or ("ours" in wanted and v[0].startswith("ours"))
                            or ("package" in wanted and v[0].startswith("package"))]
            out_pairs = torch.empty((pb["pairs"], N), dtype=torch.bfloat16, device=dev)
            for name, stages, pipe in variants:
                try:
                    if isinstance(pipe, str):
                        fn = (lambda: run_package(pb, out_pairs, pipe.split("/")[0],
                                                  not pipe.endswith("/mma")))
                        result = lambda: out_pairs.float()
                        ref_rows = ref[real]
                        out_pairs.fill_(float("nan"))
                    elif pipe is None:
                        persistent = name.endswith("persistent")
                        fn = (lambda: run_ours(pb, out_pairs, persistent, stages))
                        result = lambda: out_pairs.float()
                        ref_rows = ref[real][torch.argsort(pb["sorted_pair_ids"][real])]
                        out_pairs.fill_(float("nan"))
                    else:
                        fn = (lambda: launch(pb["a"], pb["a_scale"], pb["w"], pb["w_scale"],
                                             out, pb["block_expert_ids"], pb["num_padded"],
                                             stages=stages, pipe=pipe))
                        result = lambda: out.float()
                        ref_rows = ref
                        out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    got = result()
                    err = ((got - ref_rows).norm() / ref_rows.norm()).item()
                    nan = bool(torch.isnan(got).any())
                    del got
                    ms = do_bench(fn, warmup=5, rep=60)
                    rows.append(dict(T=T, gemm=gemm, variant=name, ms=ms, rel_err=err,
                                     unwritten=nan, tflops=flops / ms / 1e9))
                except Exception as exc:  # noqa: BLE001 - record and go on
                    rows.append(dict(T=T, gemm=gemm, variant=name, error=repr(exc)[:400]))
                print(rows[-1], flush=True)
            del ref, out_pairs
            del pb, out
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ws_fp8_block.json"), "w") as f:
            json.dump(dict(command="python " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(),
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows),
                      f, indent=1)
    print(f"{'T':>6} {'gemm':6} {'variant':12} {'ms':>8} {'TFLOP/s':>8} {'rel_err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>6} {r['gemm']:6} {r['variant']:12} ERROR {r['error'][:90]}")
        else:
            print(f"{r['T']:>6} {r['gemm']:6} {r['variant']:12} {r['ms']:8.3f} "
                  f"{r['tflops']:8.1f} {r['rel_err']:9.2e}{' UNWRITTEN' if r['unwritten'] else ''}")


if __name__ == "__main__":
    main()
