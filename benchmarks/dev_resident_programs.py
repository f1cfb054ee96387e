"""How many programs an SM the persistent kernel's decode row tiles run, from their compiled builds.

For each case (model:quant:T) it runs the experts call once with the shipped tables, then with
each explicit persistent decode config given, and prints what the launch settled on an SM
(grouped_gemm._RESIDENT_PROGRAMS: the estimate from shared memory and threads, lowered to what
the compiled build's registers and shared memory allow) beside the estimate alone, and each
call's output against the tables' (the same quantized operands: only the summation order
differs). Needs a GPU.

    python benchmarks/dev_resident_programs.py --cases qwen3_30b_a3b:none:16 \
        deepseek_v3:fp8_block:4 --configs 16x64x128:4:4:swap 16x64x128:8:4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from moe_ops.kernels import grouped_gemm as gg  # noqa: E402


def parse_config(text: str) -> gg.GemmConfig:
    """BMxBNxBK:warps:stages[:swap] -> a persistent GemmConfig."""
    tile, warps, stages, *flags = text.split(":")
    bm, bn, bk = (int(v) for v in tile.split("x"))
    return gg.GemmConfig(bm, bn, bk, 8, int(warps), int(stages), swap_ab="swap" in flags,
                         persistent=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["qwen3_30b_a3b:none:16"])
    parser.add_argument("--configs", nargs="*", type=parse_config, default=[])
    args = parser.parse_args()
    shapes = bench.load_shapes()
    for case in args.cases:
        _, layer, run = bench.case_experts_call(shapes, case)

        def call(config=None):
            return run(gemm1_config=config, gemm2_config=config)
        reference = call()
        torch.cuda.synchronize()
        for config in [None] + args.configs:
            out = call(config) if config is not None else reference
            torch.cuda.synchronize()
            err = bench.relative_error(out, reference)
            print(f"{case} {config or 'tables'}: output vs tables {err:.2e}", flush=True)
        del layer, run, call
        torch.cuda.empty_cache()
    print("settled programs an SM (launch signature -> count; estimate from shared memory and "
          "threads):")
    for key, count in gg._RESIDENT_PROGRAMS.items():
        config, quant = key[0], key[1]
        estimate = gg.persistent_programs_per_sm(config, 1 if quant != "none" else 2)
        print(f"  {config} quant={quant} activation={key[2]} gemm={key[3]}: {count} "
              f"(estimate {estimate})")


if __name__ == "__main__":
    main()
