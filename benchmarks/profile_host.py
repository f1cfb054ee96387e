"""Where the host time of an eager decode call goes: one FusedMoE forward, profiled.

For decode sizes an eager call is host-bound (Python, op dispatch, Triton launches), so this
times eager against CUDA-graph replay of the same call and prints the functions that take the
host's time (cProfile, by own time). Run on a CUDA machine from the repository root:

    python benchmarks/profile_host.py [--model qwen3_30b_a3b] [--quant none fp8] [--tokens 1]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import moe_ops  # noqa: E402

SHAPES = Path(__file__).with_name("shapes.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_30b_a3b")
    parser.add_argument("--quant", nargs="+", default=["none", "fp8"])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    model = json.loads(SHAPES.read_text())["models"][args.model]
    e, h, i = model["num_experts"], model["hidden_size"], model["intermediate_size"]
    for quant in args.quant:
        layer = moe_ops.FusedMoE(e, h, i, model["top_k"], routing=model["routing"], quant=quant,
                                 device="cuda", dtype=torch.bfloat16)
        layer.load_weights(*(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02
                             for s in ((e, i, h), (e, h, i), (e, i, h))))
        x = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(args.tokens, e, device="cuda")
        for _ in range(20):
            layer(x, logits)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            layer(x, logits)
        host_us = (time.perf_counter() - start) / args.calls * 1e6  # launch-bound: host time
        torch.cuda.synchronize()
        eager_us = (time.perf_counter() - start) / args.calls * 1e6

        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x, logits)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            layer(x, logits)
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            graph.replay()
        torch.cuda.synchronize()
        graph_us = (time.perf_counter() - start) / args.calls * 1e6

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            layer(x, logits)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"=== {args.model} quant={quant} T={args.tokens}: eager {eager_us:.1f} us/call "
              f"(host issue {host_us:.1f} us), graph replay {graph_us:.1f} us/call")
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
