"""Sweep the grouped-GEMM configs of one layer call against the default heuristic.

For each case (model, quant, T) it builds the layer (random weights, as bench.py does), routes
one input, then times `triton_experts` (CUDA-graph replay, median) with the default configs and
with each candidate config for GEMM1 (GEMM2 at its default), then each candidate for GEMM2 (GEMM1
at the best found). Candidates come from the kernel's own config space, a small grid around the default (candidates()).
Prints the best per case against the default; JSON with every timing goes to --out.
--against tables starts from the configs the shipped tables pick for the call instead (and
times them again after the sweep: the spread of one config's timings); --warps adds warp
counts to the decode grid (2 warps: a 16-row tile's shared activation fragments converted by
half as many warps; benchmarks/NOTES.md, eighteenth session); --deadline-s stops the sweep of
a GEMM's candidates when passed (the rest recorded as skipped); --persistent sweeps decode's
row tiles on the persistent TMA kernel (GemmConfig.persistent with block_m 16 / 32); --skew
routes with the tuner's skewed logits instead of uniform ones; --gemms sweeps one GEMM alone.
Every candidate's output is compared with the starting pair's (MAX_ERR); one off by more is
reported and never best.

    python benchmarks/sweep_configs.py --cases qwen3_30b_a3b:none:1 mixtral_8x7b:fp8:1 \
        --out sweep.json
    python benchmarks/sweep_configs.py --cases mixtral_8x7b:fp8:4 --against tables \
        --warps 2 4 --stages 3 4 --deadline-s 100 --out sweep_warps.json
    python benchmarks/sweep_configs.py --cases qwen3_30b_a3b:none:16 --against tables \
        --persistent --stages 4 6 --out sweep_persistent.json
    python benchmarks/sweep_configs.py --cases llama4_scout:fp8:16 --against tables \
        --persistent --gemms 2 --stages 3 4 --out sweep_persistent_gemm2.json
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
from moe_ops import synthetic  # noqa: E402
from moe_ops.kernels.experts import gemm_problems, triton_experts  # noqa: E402
from moe_ops.kernels.grouped_gemm import (  # noqa: E402
    GemmConfig, default_config, fp8_swap_ok, is_valid_config)
from moe_ops.tuning import experts_configs  # noqa: E402

DEFAULT_CASES = ("qwen3_30b_a3b:none:1", "qwen3_30b_a3b:fp8:1", "mixtral_8x7b:fp8:1",
                 "deepseek_v3:fp8_block:1", "mixtral_8x7b:none:64", "mixtral_8x7b:fp8:64")


def candidates(problem, decode: bool, warps=(4,), stages=(3, 4, 5),
               persistent=False) -> list[GemmConfig]:
    """A small grid around the default: narrow swap-AB tiles for decode (fp8 per tensor
    unswapped where the experts call runs them so, grouped_gemm.fp8_swap_ok), 32/64-row tiles
    else. persistent: decode's row tiles on the persistent kernel instead (16 rows, and 32 where
    experts get more than 12; swapped and not, fp8's GEMM1 unswapped alone)."""
    if persistent:
        rows = (16, 32) if problem.tokens_per_expert > 12 else (16,)
        grid = itertools.product(rows, (64, 128), (128, 256), warps, stages, (True, False))
        configs = [GemmConfig(bm, bn, bk, 8, w, st, swap, persistent=True)
                   for bm, bn, bk, w, st, swap in grid]
        return [c for c in configs if is_valid_config(problem, c) and not (
            problem.quant == "fp8" and c.swap_ab and not fp8_swap_ok(problem.gemm))]
    if decode:
        swap = problem.quant != "fp8" or fp8_swap_ok(problem.gemm)
        grid = itertools.product((16,), (32, 64, 128), (128, 256), warps, stages, (swap,))
    else:
        grid = itertools.product((32, 64), (64, 128), (64, 128), (4,), (3, 4), (False,))
    configs = [GemmConfig(bm, bn, bk, 8, w, st, swap) for bm, bn, bk, w, st, swap in grid]
    return [c for c in configs if is_valid_config(problem, c)]


# A candidate's output against the starting pair's: the same quantized operands, only the
# summation order differs.
MAX_ERR = 1e-2


def time_call(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                        help="model:quant:T entries")
    parser.add_argument("--out", default="sweep_configs.json")
    parser.add_argument("--against", choices=("default", "tables"), default="default",
                        help="the starting pair: default_config's or the shipped tables'")
    parser.add_argument("--warps", type=int, nargs="+", default=[4],
                        help="warp counts of the decode grid")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5],
                        help="pipeline depths of the decode grid")
    parser.add_argument("--skew", action="store_true",
                        help="route with Zipf-skewed logits (the tuner's second input set)")
    parser.add_argument("--persistent", action="store_true",
                        help="candidates: decode's row tiles on the persistent TMA kernel")
    parser.add_argument("--gemms", type=int, nargs="+", choices=(1, 2), default=[1, 2],
                        help="the GEMMs whose candidates are swept (the other stays at the "
                             "starting pair's)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="per GEMM of a case: stop timing candidates after this long "
                             "(0: no limit)")
    args = parser.parse_args()
    shapes = bench.load_shapes()
    results, summary = [], []
    for case in args.cases:
        quant, tokens, layer = bench.case_layer(shapes, case)
        x, ids, weights = bench.routed_inputs(layer, tokens)
        if args.skew:
            # the tuner's second input set (tune.make_inputs): Zipf-skewed expert popularity
            logits = synthetic.router_logits(tokens, layer.num_experts, skew=True,
                                             device=x.device, seed=1)
            ids = bench.route_ids(layer, logits)
            weights = torch.rand(ids.shape, device=x.device)
        kw = layer.kernel_weights()
        problem1, problem2 = gemm_problems(x, ids.shape[1], kw["w13"], kw["w2"], layer.activation,
                                           quant)

        def call(c1=None, c2=None):
            return lambda: triton_experts(x, ids, weights, kw["w13"], kw["w2"],
                                          kw.get("w13_scale"), kw.get("w2_scale"),
                                          activation=layer.activation, quant=quant,
                                          gemm1_config=c1, gemm2_config=c2)

        start = time.perf_counter()
        if args.against == "tables":
            base1, base2 = experts_configs(problem1, problem2, num_tokens=tokens,
                                           top_k=ids.shape[1], activation=layer.activation,
                                           device=x.device)
        else:
            base1, base2 = default_config(problem1), default_config(problem2)
        reference = call(base1, base2)()   # every candidate's output is checked against it
        default_us = time_call(call(base1, base2))
        best1, best1_us = base1, default_us
        decode = problem1.tokens_per_expert <= 16

        def sweep(gemm, problem, run):
            best, best_us, began = None, float("inf"), time.perf_counter()
            for config in candidates(problem, decode, tuple(args.warps), tuple(args.stages),
                                     args.persistent):
                if args.deadline_s and time.perf_counter() - began > args.deadline_s:
                    results.append(dict(case=case, gemm=gemm, config=str(config), skipped=True))
                    continue
                try:
                    err = bench.relative_error(run(config)(), reference)
                    us = time_call(run(config))
                except Exception as exc:  # a config the compiler rejects: record, go on
                    results.append(dict(case=case, gemm=gemm, config=str(config),
                                        error=str(exc)[:200]))
                    continue
                results.append(dict(case=case, gemm=gemm, config=str(config), us=us, err=err))
                if not err <= MAX_ERR:   # (NaN too)
                    print(f"  {case} gemm{gemm} {config}: output off by {err:.2e}", flush=True)
                    continue
                if us < best_us:
                    best, best_us = config, us
            return best, best_us

        if 1 in args.gemms:
            found1, found1_us = sweep(1, problem1, lambda c: call(c1=c, c2=base2))
            if found1_us < best1_us:
                best1, best1_us = found1, found1_us
        best2, best2_us = base2, time_call(call(best1, base2))
        found2, found2_us = (sweep(2, problem2, lambda c: call(c1=best1, c2=c))
                             if 2 in args.gemms else (None, float("inf")))
        if found2_us < best2_us:
            best2, best2_us = found2, found2_us
        again_us = time_call(call(base1, base2))
        summary.append(dict(case=case, against=args.against, skew=args.skew,
                            default_us=default_us,
                            default_again_us=again_us, best_us=best2_us,
                            gemm1=str(best1), gemm2=str(best2),
                            default1=str(base1), default2=str(base2),
                            sweep_s=time.perf_counter() - start))
        print(f"{case}: {args.against} {default_us:.1f} us (again {again_us:.1f}) -> best "
              f"{best2_us:.1f} us ({time.perf_counter() - start:.0f} s)\n  gemm1 {best1}\n  "
              f"gemm2 {best2}", flush=True)
        del layer, kw
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(summary=summary, results=results), indent=1))


if __name__ == "__main__":
    main()
