"""Sweep the grouped-GEMM configs of one layer call against the default heuristic.

For each case (model, quant, T) it builds the layer (random weights, as bench.py does), routes
one input, then times `triton_experts` (CUDA-graph replay, median) with the default configs and
with each candidate config for GEMM1 (GEMM2 at its default), then each candidate for GEMM2 (GEMM1
at the best found). Candidates come from the kernel's own config space, a small grid around the default (candidates()).
Prints the best per case against the default; JSON with every timing goes to --out.

    python benchmarks/sweep_configs.py --cases qwen3_30b_a3b:none:1 mixtral_8x7b:fp8:1 \
        --out sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from moe_ops.kernels.experts import gemm_problems, triton_experts  # noqa: E402
from moe_ops.kernels.grouped_gemm import GemmConfig, default_config, is_valid_config  # noqa: E402

DEFAULT_CASES = ("qwen3_30b_a3b:none:1", "qwen3_30b_a3b:fp8:1", "mixtral_8x7b:fp8:1",
                 "deepseek_v3:fp8_block:1", "mixtral_8x7b:none:64", "mixtral_8x7b:fp8:64")


def candidates(problem, decode: bool) -> list[GemmConfig]:
    """A small grid around the default: narrow swap-AB tiles for decode, 32/64-row tiles else."""
    if decode:
        grid = itertools.product((16,), (32, 64, 128), (128, 256), (3, 4, 5), (True,))
    else:
        grid = itertools.product((32, 64), (64, 128), (64, 128), (3, 4), (False,))
    configs = [GemmConfig(bm, bn, bk, 8, 4, stages, swap) for bm, bn, bk, stages, swap in grid]
    return [c for c in configs if is_valid_config(problem, c)]


def time_call(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                        help="model:quant:T entries")
    parser.add_argument("--out", default="sweep_configs.json")
    args = parser.parse_args()
    shapes = bench.load_shapes()
    results, summary = [], []
    for case in args.cases:
        quant, tokens, layer = bench.case_layer(shapes, case)
        x, ids, weights = bench.routed_inputs(layer, tokens)
        kw = layer.kernel_weights()
        problem1, problem2 = gemm_problems(x, ids.shape[1], kw["w13"], kw["w2"], layer.activation,
                                           quant)

        def call(c1=None, c2=None):
            return lambda: triton_experts(x, ids, weights, kw["w13"], kw["w2"],
                                          kw.get("w13_scale"), kw.get("w2_scale"),
                                          activation=layer.activation, quant=quant,
                                          gemm1_config=c1, gemm2_config=c2)

        start = time.perf_counter()
        default_us = time_call(call())
        best1, best1_us = default_config(problem1), default_us
        decode = problem1.tokens_per_expert <= 16
        for config in candidates(problem1, decode):
            try:
                us = time_call(call(c1=config))
            except Exception as exc:  # a config the compiler rejects: record, go on
                results.append(dict(case=case, gemm=1, config=str(config), error=str(exc)[:200]))
                continue
            results.append(dict(case=case, gemm=1, config=str(config), us=us))
            if us < best1_us:
                best1, best1_us = config, us
        best2, best2_us = default_config(problem2), best1_us
        for config in candidates(problem2, decode):
            try:
                us = time_call(call(c1=best1, c2=config))
            except Exception as exc:
                results.append(dict(case=case, gemm=2, config=str(config), error=str(exc)[:200]))
                continue
            results.append(dict(case=case, gemm=2, config=str(config), us=us))
            if us < best2_us:
                best2, best2_us = config, us
        summary.append(dict(case=case, default_us=default_us, best_us=best2_us,
                            gemm1=str(best1), gemm2=str(best2),
                            default1=str(default_config(problem1)),
                            default2=str(default_config(problem2)),
                            sweep_s=time.perf_counter() - start))
        print(f"{case}: default {default_us:.1f} us -> best {best2_us:.1f} us "
              f"({time.perf_counter() - start:.0f} s)\n  gemm1 {best1}\n  gemm2 {best2}",
              flush=True)
        del layer, kw
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(summary=summary, results=results), indent=1))


if __name__ == "__main__":
    main()
