"""What the fp8 modes' activation quantization launches cost a decode call, at most.

For each case (model:quant:T) it times the experts call as CUDA-graph replays three ways, arms
alternated: as it ships; with act_quant's launches taken out of the graph (the call is handed
the quantized operands computed once before capture: GEMM2 then reads a stale intermediate,
so the output is wrong and only the time counts); and with only the intermediate's act_quant
taken out; and with the combine's launch taken out (the pair rows' sum). The differences are
the most that quantizing inside the GEMMs' loads, or combining inside GEMM2, could save (those
would still do the arithmetic). Needs a GPU.

    python benchmarks/dev_act_quant_bound.py --cases qwen3_30b_a3b:fp8:1 deepseek_v3:fp8_block:1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from moe_ops.kernels import experts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["qwen3_30b_a3b:fp8:1"])
    parser.add_argument("--budget-s", type=float, default=0.4, help="timing budget an arm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shapes = bench.load_shapes()
    device = torch.device("cuda")
    real_act_quant = experts.act_quant
    real_combine = experts.combine_pair_rows
    rows = []
    for case in args.cases:
        _, layer, call = bench.case_experts_call(shapes, case)
        # the quantized operands of one real call, by the act_quant call's position
        cached: list = []

        def recording(*a, **k):
            result = real_act_quant(*a, **k)
            cached.append(tuple(t.clone() for t in result))
            return result

        experts.act_quant = recording
        call()
        torch.cuda.synchronize()
        experts.act_quant = real_act_quant

        def stubbed(which):
            calls = [0]   # act_quant calls so far (capture_graph runs the call twice)

            def act_quant(*a, **k):
                i = calls[0] % len(cached)
                calls[0] += 1
                return cached[i] if i in which else real_act_quant(*a, **k)
            return act_quant

        graphs = {}
        arms = {"shipped": None, "no act_quant": set(range(len(cached))),
                "no 2nd act_quant": {len(cached) - 1}, "no combine": None}
        for name, which in arms.items():
            experts.act_quant = stubbed(which) if which is not None else real_act_quant
            if name == "no combine":
                experts.combine_pair_rows = lambda *a, **k: None
            try:
                graphs[name] = bench.capture_graph(call, device)[0]
            finally:
                experts.act_quant = real_act_quant
                experts.combine_pair_rows = real_combine
        times = bench.time_graphs_alternated(graphs, args.rounds, args.budget_s, device)
        best = {name: min(v) for name, v in times.items()}
        rows.append((case, len(cached), best))
        print(case, {name: [round(t, 1) for t in v] for name, v in times.items()}, flush=True)
        del graphs, layer, call
        torch.cuda.empty_cache()
    print("best replay of each arm, us (act_quant launches in the call; saved: without them)")
    print(f"{'case':28s} {'aq':>3s} {'shipped':>9s} {'no aq':>9s} {'no 2nd aq':>9s} "
          f"{'saved':>6s} {'no combine':>10s}")
    for case, n, best in rows:
        saved = 1 - best["no act_quant"] / best["shipped"]
        print(f"{case:28s} {n:3d} {best['shipped']:9.1f} {best['no act_quant']:9.1f} "
              f"{best['no 2nd act_quant']:9.1f} {saved:6.1%} {best['no combine']:10.1f}")


if __name__ == "__main__":
    main()
