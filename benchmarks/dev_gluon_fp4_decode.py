"""nvfp4 GEMM experiment: moe_ops.kernels.ws_fp4 (warp-specialized Gluon, the packed weights
decoded straight into wgmma's register operand) beside grouped_gemm's Triton kernel.

The problem (one GEMM of a decode step, GEMM2's form so both kernels compute the same thing):
E experts, `tokens` rows each in a dispatch of 16-slot blocks (rows bf16, the unused slots
zero; prefill's cases: 256 or 1024 rows an expert in 128-row blocks, the kernel's 64-slot
form "gluon prefill" and 128-slot form "gluon prefill 128", TFLOP/s beside TB/s), nvfp4 weights W_e [N, K] (kernel-order packed
bytes, e4m3 block scales per 16 columns, a global scale per row); out[pair] = x[slot] . W_e (routing weight 1). Variants: "gluon 2
consumers" / "gluon 3 consumers" / "gluon 4 consumers" (ws_fp4 with 2, 3 or 4 consumer
warpgroups; "pipelined": each
decoding step k + 1 while its wgmma of step k runs, ws_fp4.PIPELINE; "early": the epilogue's
operands loaded before each tile's K loop, ws_fp4.EARLY_EPILOGUE), "ours"
(grouped_gemm.gemm2 with the default 4-bit config for the rows an expert: decode's 16-row
tiles, prefill's 128 x 128). Each is compared with a float32
reference (dequantized weights) on random data, outputs NaN-poisoned first; times by
triton.testing.do_bench (median); TB/s over the packed weights and their scales.

Its sm_90 builds (--aot): the K loop is 423 SASS instructions a thread for 128 weight values,
3.3 a value (the Triton loop: 5.1), 2 warpgroup fences a K step.

    python benchmarks/dev_gluon_fp4_decode.py --out benchmarks/results      # an H200
    python benchmarks/dev_gluon_fp4_decode.py --aot                         # no GPU
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SLOTS = 16   # dispatch block (ws_fp4.BLOCK_M)


def k_loop(kernel):
    """The SASS instructions of the kernel's K loop: the shortest loop holding wgmmas and no
    epilogue arithmetic (ptxas may lay a tile loop's peeled steps and epilogue out as a shorter
    loop of their own)."""
    from aot_sm90 import loops
    return min((body for body in loops(kernel) if any("GMMA" in i for i in body)
                and not any(i.split()[0].startswith(("FADD", "FMUL", "FFMA")) for i in body)),
               key=len)


def aot():
    from aot_sm90 import resource_usage
    from moe_ops.kernels import ws_fp4
    for consumers, pipeline, quant, slots in (
            (2, False, "nvfp4", 16), (3, False, "nvfp4", 16), (4, False, "nvfp4", 16),
            (2, True, "nvfp4", 16),
            (4, True, "nvfp4", 16), (2, False, "mxfp4", 16), (3, False, "mxfp4", 16),
            (2, True, "mxfp4", 16),
            (2, False, "nvfp4", 64), (2, True, "nvfp4", 64), (2, False, "mxfp4", 64),
            (2, False, "nvfp4", 128), (2, False, "mxfp4", 128),
            (2, False, "fp8", 16), (3, False, "fp8", 16)):
        kernel = ws_fp4.compile_sm90(gemm=2, activation="none", consumers=consumers,
                                     pipeline=pipeline, quant=quant, slots=slots)
        loop = k_loop(kernel)
        ops = collections.Counter(
            (i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in loop)
        # weight values a thread a K step, times the steps the loop body holds (16 wgmmas of
        # k = 16 a step; the pipelined form and mxfp4's run two steps an iteration)
        # local-memory (spill) traffic inside the K loop itself; a tile loop's spills run once
        # a tile
        local = sum(i.split()[0].startswith(("LDL", "STL")) for i in loop)
        step = ws_fp4.FP8_BLOCK_K if quant == "fp8" else ws_fp4.BLOCK_K
        steps = ops["HGMMA"] // (step // 16)
        values = steps * step * ws_fp4.ROWS // 128
        print(f"{quant}, {slots} slots, {consumers} consumers"
              f"{', pipelined' if pipeline else ''}: "
              f"{resource_usage(kernel)}, shared "
              f"{kernel.metadata.shared} B; K loop {len(loop)} SASS instructions ({local} "
              f"local) for {values} "
              f"weight values a thread ({len(loop) / values:.2f} a value): "
              f"{dict(ops.most_common(8))}", flush=True)


def make_problem(E, N, K, tokens, device, seed=0, slots=SLOTS):
    """`slots` rows an expert in the dispatch (a multiple of its alignment), `tokens` of them
    routed."""
    from moe_ops.quant import fp4_to_kernel_order, quantize_nvfp4
    # (generated and quantized on the device: the prefill cases hold up to 470 M weights)
    g = torch.Generator(device).manual_seed(seed)
    w = torch.randn(E, N, K, generator=g, device=device) * 0.05
    packed, block_scale, global_scale = quantize_nvfp4(w)
    del w
    x = torch.zeros(E * slots, K, device=device)
    for e in range(E):
        x[e * slots:e * slots + tokens] = torch.randn(tokens, K, generator=g, device=device)
    return dict(w_packed=fp4_to_kernel_order(packed).to(device),
                w_packed_natural=packed, w_scale=block_scale.to(device),
                gscale=global_scale[:, None].expand(E, N).contiguous().to(device),
                x=x.to(torch.bfloat16).to(device), tokens=tokens, slots=slots)


def reference(pb):
    """float32 out [E * tokens, N] of the dequantized weights, pair p = expert * tokens + m."""
    from moe_ops.quant import dequantize_fp4
    w = dequantize_fp4(pb["w_packed_natural"].to(pb["x"].device), pb["w_scale"], "nvfp4",
                       pb["gscale"])                                   # [E, N, K] fp32
    E, tokens = w.shape[0], pb["tokens"]
    x = pb["x"].float().view(E, pb["slots"], -1)[:, :tokens]
    return torch.bmm(x, w.transpose(1, 2)).reshape(E * tokens, -1)


def routing_of(pb, align=SLOTS):
    """A dispatch of pb["slots"] slots an expert in blocks of `align`, its `tokens` first (pair
    expert * tokens + m)."""
    from moe_ops.kernels import grouped_gemm as gg
    E = pb["w_packed"].shape[0]
    dev = pb["x"].device
    tokens, slots = pb["tokens"], pb["slots"]
    pairs = E * tokens
    slot = torch.arange(E * slots, device=dev)
    m = slot % slots
    sorted_ids = torch.where(m < tokens, (slot // slots) * tokens + m, pairs).to(torch.int32)
    return gg.Routing(
        topk_ids=torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(tokens),
        topk_weights=torch.ones(pairs, device=dev), top_k=1, num_experts=E,
        local_expert_offset=0, sorted_pair_ids=sorted_ids,
        block_expert_ids=torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(
            slots // align), align_block_m=align,
        num_padded=torch.tensor([E * slots], dtype=torch.int32, device=dev))


def run_ours(pb, routing, out_pairs):
    """grouped_gemm's Triton W4A16 kernel with the default 4-bit decode config."""
    from moe_ops.kernels import grouped_gemm as gg
    E, N, half_k = pb["w_packed"].shape
    problem = gg.GemmProblem(2, E, N, half_k * 2, pb["tokens"], torch.bfloat16, "nvfp4", False)
    gg.gemm2(pb["x"], None, pb["w_packed"], pb["w_scale"], None, out_pairs, routing,
             gg.default_config(problem), quant="nvfp4", atomic_out=False,
             interpret_upcast=pb["x"].device.type == "cpu",  # the interpreter's bf16 dots
             w2_global_scale=pb["gscale"])


def run_gluon(pb, routing, out_pairs, consumers, pipeline=False, slots=SLOTS, early=False):
    from moe_ops.kernels import ws_fp4
    ws_fp4.gemm(pb["x"], pb["w_packed"], pb["w_scale"], pb["gscale"], None, out_pairs,
                routing, gemm=2, activation="none", consumers=consumers, slots=slots,
                pipeline=pipeline, early=early)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", choices=("all", "decode", "prefill"), default="all")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variant names to run (default: all)")
    ap.add_argument("--once", action="store_true",
                    help="run each variant once, unchecked and untimed (for a profiler: "
                         "ncu -k regex:_ws_fp4 python benchmarks/dev_gluon_fp4_decode.py --once)")
    args = ap.parse_args()
    if args.aot:
        aot()
        return
    from bench import check_and_time, print_variant_table
    dev = torch.device("cuda")
    rows = []
    # DeepSeek-V3's GEMM1 (8 experts hit at T = 1, N = 2I = 4096, K = H = 7168) with 1 and 16
    # tokens an expert, and its GEMM2 (N = 7168, K = 2048); prefill: 256 and 1024 tokens an
    # expert (DeepSeek-V3 at T = 8192 and 32768) in 128-row blocks, on the 64-slot form
    decode_cases = (("gemm1 1/expert", 8, 4096, 7168, 1), ("gemm1 16/expert", 8, 4096, 7168, 16),
                    ("gemm2 1/expert", 8, 7168, 2048, 1))
    prefill_cases = (("gemm1 256/expert", 16, 4096, 7168, 256),
                     ("gemm2 256/expert", 16, 7168, 2048, 256),
                     ("gemm1 1024/expert", 8, 4096, 7168, 1024))
    cases = ((decode_cases if args.cases != "prefill" else ())
             + (prefill_cases if args.cases != "decode" else ()))
    for name, E, N, K, tokens in cases:
        prefill = tokens > SLOTS
        pb = make_problem(E, N, K, tokens, dev, slots=tokens if prefill else SLOTS)
        ref = reference(pb)
        routing = routing_of(pb, align=128 if prefill else SLOTS)
        weight_bytes = E * N * K // 2 + E * N * K // 16
        flops = 2.0 * E * tokens * N * K
        out_pairs = torch.empty((E * tokens, N), dtype=torch.bfloat16, device=dev)
        if prefill:
            variants = (
                ("gluon prefill", lambda: run_gluon(pb, routing, out_pairs, 2, slots=64)),
                ("gluon prefill pipelined",
                 lambda: run_gluon(pb, routing, out_pairs, 2, True, slots=64)),
                ("gluon prefill 128", lambda: run_gluon(pb, routing, out_pairs, 2, slots=128)),
                ("gluon prefill 128 early",
                 lambda: run_gluon(pb, routing, out_pairs, 2, slots=128, early=True)),
                ("ours", lambda: run_ours(pb, routing, out_pairs)))
        else:
            variants = (
                ("gluon 2 consumers", lambda: run_gluon(pb, routing, out_pairs, 2)),
                ("gluon 2 early", lambda: run_gluon(pb, routing, out_pairs, 2, early=True)),
                ("gluon 3 consumers", lambda: run_gluon(pb, routing, out_pairs, 3)),
                ("gluon 4 consumers", lambda: run_gluon(pb, routing, out_pairs, 4)),
                ("gluon 2 pipelined", lambda: run_gluon(pb, routing, out_pairs, 2, True)),
                ("gluon 4 pipelined", lambda: run_gluon(pb, routing, out_pairs, 4, True)),
                ("ours", lambda: run_ours(pb, routing, out_pairs)))
        if args.variants:
            wanted = args.variants.split(",")
            variants = tuple(v for v in variants if v[0] in wanted)
        for variant, fn in variants:
            if args.once:
                fn()
                torch.cuda.synchronize()
                print(f"{name}: {variant} ran once", flush=True)
                continue
            try:
                got = check_and_time(fn, out_pairs, ref)
                rows.append(dict(case=name, variant=variant, us=got["ms"] * 1e3,
                                 rel_err=got["rel_err"], unwritten=got["unwritten"],
                                 tb_s=weight_bytes / got["ms"] / 1e9,
                                 tflops=flops / got["ms"] / 1e9))
            except Exception as exc:  # noqa: BLE001 - record and go on
                rows.append(dict(case=name, variant=variant, error=repr(exc)[:600]))
            print(rows[-1], flush=True)
    if args.once:
        return
    if args.out:
        import bench
        bench.write_records(os.path.join(args.out, "gluon_fp4_decode.json"), rows)
    print_variant_table(rows, [("case", "18"), ("variant", "23")],
                        [("us", "9.1f"), ("tb_s", "6.2f"), ("tflops", "7.1f")])


if __name__ == "__main__":
    main()
