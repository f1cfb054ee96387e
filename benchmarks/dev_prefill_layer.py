"""Prefill experts call with GEMM2 on the tile kernel (fp32 atomics) or on the persistent TMA
kernel (one row per pair + the combine pass), on one GPU: time of the whole experts call
(CUDA-graph replay, median) per GEMM2 config, and a per-kernel breakdown of one call.

    python benchmarks/dev_prefill_layer.py --out benchmarks/results/h200_prefill_layer.json
    python benchmarks/dev_prefill_layer.py --cases mixtral_8x7b:none:16384 --no-profile
    # the PDL threshold's A/B with the shipped configs: PDL on every launch vs at decode only
    python benchmarks/dev_prefill_layer.py --variants tuned --pdl-max-pairs 1000000000 512 \
        --cases deepseek_v3:fp8_block:16384 mixtral_8x7b:fp8:4096 --no-profile

GEMM1 runs its default config (the persistent kernel at these sizes; passed explicitly, so the
tuned tables play no part) in every variant but "tuned", so the variants differ by GEMM2 (and
the combine it implies) alone; for fp8_block both GEMMs take the variant's config. "tuned" runs
what ships (the tables, else the defaults), for any quant mode. --pdl-max-pairs times each
variant once per value of experts.PDL_MAX_PAIRS (the experts calls that launch with the PDL
attribute). Each variant's output is checked against the first variant's (relative Frobenius
error; the two combine orders differ in rounding only). TFLOP/s counts the routed pairs' GEMM
flops (2 * T * k * (N13 * H + H * I)).
Writes JSON (command, GPU, date, records) and prints a table last.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from moe_ops.kernels import experts as experts_mod  # noqa: E402
from moe_ops.kernels.experts import gemm_problems, triton_experts  # noqa: E402
from moe_ops.kernels.grouped_gemm import GemmConfig, default_config, is_valid_config  # noqa: E402

DEFAULT_CASES = ("mixtral_8x7b:none:4096", "mixtral_8x7b:none:16384", "mixtral_8x7b:fp8:16384",
                 "llama4_scout:none:16384", "llama4_scout:fp8:16384",
                 "qwen3_30b_a3b:none:16384", "qwen3_30b_a3b:fp8:16384")
# GEMM2 variants: name -> config per quant family. "tile" is the tile kernel's prefill config
# of the previous tables (fp32 atomics at these sizes); the others the persistent kernel.
VARIANTS = {
    "tuned": None,
    "tile": {"none": GemmConfig(128, 256, 64, 16, 8, 3), "fp8": GemmConfig(128, 128, 128, 16, 8, 3),
             "fp8_block": GemmConfig(64, 128, 128, 8, 4, 3)},
    "pers_a": {"none": GemmConfig(128, 256, 64, 16, 8, 3, persistent=True),
               "fp8": GemmConfig(128, 128, 256, 8, 8, 3, persistent=True),
               "fp8_block": GemmConfig(64, 128, 128, 8, 4, 4, persistent=True)},
    "pers_b": {"none": GemmConfig(128, 128, 64, 8, 8, 5, persistent=True),
               "fp8": GemmConfig(128, 128, 128, 8, 8, 4, persistent=True),
               "fp8_block": GemmConfig(64, 128, 128, 16, 4, 3, persistent=True)},
    "pers_c": {"none": GemmConfig(128, 256, 64, 8, 8, 3, persistent=True),
               "fp8": GemmConfig(128, 128, 64, 8, 8, 5, persistent=True),
               "fp8_block": GemmConfig(128, 64, 128, 8, 8, 4, persistent=True)},
    "pers_d": {"fp8_block": GemmConfig(64, 128, 128, 16, 4, 4, persistent=True)},
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def kernel_breakdown(fn) -> dict:
    """CUDA kernel time (us) by kernel name over 3 calls, divided by 3."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / 3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="model:quant:T")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--pdl-max-pairs", nargs="+", type=int,
                        default=[experts_mod.PDL_MAX_PAIRS],
                        help="values of experts.PDL_MAX_PAIRS to time each variant with")
    parser.add_argument("--out", type=Path, default=Path("prefill_layer.json"))
    args = parser.parse_args()
    shapes = bench.load_shapes()
    records, rows = [], []
    for case in args.cases:
        quant, tokens, layer = bench.case_layer(shapes, case)
        x, ids, weights = bench.routed_inputs(
            layer, tokens, torch.Generator(device="cuda").manual_seed(0))
        kw = layer.kernel_weights()
        p1, p2 = gemm_problems(x, ids.shape[1], kw["w13"], kw["w2"], layer.activation, quant)
        flops = 2.0 * ids.numel() * (p1.n * p1.k + p2.n * p2.k)
        reference = None
        for variant, pdl_max_pairs in itertools.product(args.variants, args.pdl_max_pairs):
            experts_mod.PDL_MAX_PAIRS = pdl_max_pairs
            if variant == "tuned":
                c1 = c2 = None
            elif quant not in VARIANTS[variant]:
                records.append(dict(case=case, variant=variant, skipped=f"no {quant} variant"))
                continue
            elif quant in ("none", "fp8"):
                c1, c2 = default_config(p1), VARIANTS[variant][quant]
            else:
                c1 = c2 = VARIANTS[variant][quant]  # fp8_block: both GEMMs take the variant's
            record = dict(case=case, variant=variant, pdl_max_pairs=pdl_max_pairs,
                          gemm1=str(c1), gemm2=str(c2))
            if c2 is not None and not (is_valid_config(p2, c2)
                                       and (c1 is None or is_valid_config(p1, c1))):
                record["skipped"] = "invalid config"
                records.append(record)
                continue

            def call():
                return triton_experts(x, ids, weights, kw["w13"], kw["w2"], kw.get("w13_scale"),
                                      kw.get("w2_scale"), kw.get("b13"), kw.get("b2"),
                                      activation=layer.activation, quant=quant,
                                      alpha=layer.swiglu_alpha, limit=layer.swiglu_limit,
                                      local_expert_offset=layer.local_expert_offset,
                                      gemm1_config=c1, gemm2_config=c2,
                                      w13_global_scale=kw.get("w13_global_scale"),
                                      w2_global_scale=kw.get("w2_global_scale"))
            try:
                out = call()
                torch.cuda.synchronize()
                if reference is None:
                    reference = out
                record["err_vs_first"] = rel_err(out, reference)
                record["finite"] = bool(torch.isfinite(out).all())
                us = triton.testing.do_bench_cudagraph(call, rep=60, return_mode="median") * 1e3
                record.update(us=us, tflops=flops / us / 1e6)
                if not args.no_profile and variant in ("tile", "pers_a", "tuned"):
                    record["kernels_us"] = kernel_breakdown(call)
            except Exception as exc:  # a config the compiler or the GPU rejects: record it
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            records.append(record)
            rows.append(record)
            print(f"{case:28} {variant:7} pdl<={pdl_max_pairs:<10} " + (f"{record['us']:9.1f} us {record['tflops']:6.1f} "
                  f"TFLOP/s err {record['err_vs_first']:.1e}" if "us" in record
                  else record.get("error", "")), flush=True)
            for kname, kus in list(record.get("kernels_us", {}).items())[:8]:
                print(f"      {kus:9.1f} us  {kname[:90]}", flush=True)
        del layer, kw
        torch.cuda.empty_cache()
    bench.write_records(args.out, records)
    print(f"\n{'case':28} {'variant':7} {'pdl<=':>10} {'us':>9} {'TFLOP/s':>8}  gemm2")
    for r in rows:
        if "us" in r:
            print(f"{r['case']:28} {r['variant']:7} {r['pdl_max_pairs']:>10} {r['us']:9.1f} "
                  f"{r['tflops']:8.1f}  {r['gemm2']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
