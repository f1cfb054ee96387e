"""Would decode's persistent row tiles help at T = 1, where direct mode keeps them out?

Direct mode (experts.use_direct_dispatch: one routed pair a GEMM block, no dispatch launch)
serves the smallest batches, and the persistent kernel needs a dispatch. For each case
(model:quant:T) this times the experts call as CUDA-graph replays, arms alternated: as shipped
(direct mode, the tables' tiles); with direct mode off (a dispatch launch, the tables' tiles);
and with direct mode off and each given persistent decode config for both GEMMs. Each arm's
output is checked against the shipped call's (the same operands: summation order only).
Needs a GPU.

    python benchmarks/dev_direct_persistent.py --cases qwen3_30b_a3b:none:1 \
        --configs 16x64x128:4:4:swap 16x128x128:4:4:swap
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from dev_resident_programs import parse_config  # noqa: E402
from moe_ops.kernels import experts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["qwen3_30b_a3b:none:1"])
    parser.add_argument("--configs", nargs="*", type=parse_config,
                        default=[parse_config("16x64x128:4:4:swap")])
    parser.add_argument("--budget-s", type=float, default=0.3, help="timing budget an arm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shapes = bench.load_shapes()
    device = torch.device("cuda")
    shipped_direct_max = experts.DIRECT_MAX_PAIRS
    table = []
    for case in args.cases:
        quant, layer, run = bench.case_experts_call(shapes, case)

        def call(config=None):
            return run(gemm1_config=config, gemm2_config=config)

        arms = [("shipped", True, None), ("no direct", False, None)]
        arms += [(f"no direct {c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages}"
                  f"{' swap' if c.swap_ab else ''}", False, c) for c in args.configs
                 if not (quant == "fp8" and c.swap_ab)]
        graphs, errors = {}, {}
        reference = None
        for name, direct, config in arms:
            experts.DIRECT_MAX_PAIRS = shipped_direct_max if direct else 0
            try:
                graph, out = bench.capture_graph(lambda c=config: call(c), device)
                graph.replay()
                torch.cuda.synchronize()
                if reference is None:
                    reference = out.clone()
                errors[name] = bench.relative_error(out, reference)
                graphs[name] = graph
            except Exception as exc:  # (a config this case cannot take)
                print(f"{case} {name}: {bench._short(exc)}", flush=True)
            finally:
                experts.DIRECT_MAX_PAIRS = shipped_direct_max
        times = bench.time_graphs_alternated(graphs, args.rounds, args.budget_s, device)
        for name in graphs:
            table.append((case, name, min(times[name]), errors[name]))
            print(case, name, [round(t, 1) for t in times[name]], f"err {errors[name]:.1e}",
                  flush=True)
        del graphs, layer, run, call, reference
        torch.cuda.empty_cache()
    print("best replay of each arm, us (err: output against the shipped call's)")
    for case, name, us, err in table:
        print(f"{case:26s} {name:34s} {us:8.1f}  {err:.1e}")


if __name__ == "__main__":
    main()
