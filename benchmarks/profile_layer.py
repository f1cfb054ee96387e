"""Where a layer call's GPU time goes, kernel by kernel.

    python benchmarks/profile_layer.py                       # every model / quant of shapes.json
    python benchmarks/profile_layer.py --models qwen3_30b_a3b --quant fp8 --tokens 1 1024

For each (model, quant, T): the layer (moe_ops.tune.build_layer: random weights in the quant
mode's format, the shapes of shapes.json, the shipped tuning tables) on random routing; the call
timed as CUDA-graph replays with L2 flushed before each (moe_ops.tuning.graph_timer, as the
tuner and the sweep's "graph us" time it); then --calls eager calls under torch.profiler, each
after an L2 flush, and the call's kernels in launch order with their GPU time (the median over
the calls). "gap" = graph time - the sum of the kernels: the launch latency and ramp between
dependent kernels, which decides the small-T points. With PDL on (calls of few routed pairs) a
kernel starts before its predecessor ends and waits inside it, so its time includes that wait
and the gap can come out below zero: MOE_OPS_PDL=0 gives each kernel's own time. Prints a table
last (progress on stderr) and writes JSON to --out (default $MOE_OPS_RESULTS_DIR or
benchmarks/results/).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from moe_ops import tune, tuning  # noqa: E402
from moe_ops.models import MODELS  # noqa: E402

SHAPES = json.loads((Path(__file__).with_name("shapes.json")).read_text())["models"]
FLUSH_BYTES = 256 << 20  # > the H200's 50 MB L2


def log(msg: str) -> None:
    print(f"[profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kernels_per_call(fn, flush, calls: int):
    """[(kernel name, GPU us)] of one call of fn, in launch order, medians over `calls` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush()
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    runs, current = [], None
    for e in events:
        if is_flush(e.name):  # the flush (no layer kernel is one): a call starts after it
            current = []
            runs.append(current)
        elif current is not None:
            current.append((e.name, e.time_range.end - e.time_range.start))
    shapes = {tuple(name for name, _ in run) for run in runs}
    if len(runs) != calls:
        raise RuntimeError(f"found {len(runs)} flush kernels for {calls} calls among "
                           f"{sorted({short(e.name) for e in events})[:8]}")
    if len(shapes) != 1:
        raise RuntimeError(f"the profiled calls differ in their kernels ({len(shapes)} sequences)")
    names = list(next(iter(shapes)))
    return [(short(name), statistics.median(run[i][1] for run in runs))
            for i, name in enumerate(names)]


def is_flush(name: str) -> bool:
    """The flush's kernel: torch names it after its functor (BitwiseXorFunctor), or after the
    op (bitwise_xor) in other builds."""
    return "bitwisexor" in name.lower().replace("_", "")


def short(name: str) -> str:
    """A readable kernel name (Triton kernels keep theirs; torch's lose their templates)."""
    return name.split("<")[0].split("(")[0].strip()[:48]


def profile_case(layer, model: str, quant: str, tokens: int, calls: int) -> dict:
    inputs = tune.make_inputs(layer, MODELS[model], tokens, seed=1)[0]

    def call():
        return layer(inputs.x, topk_ids=inputs.topk_ids, topk_weights=inputs.topk_weights)

    graph_us = tuning.graph_timer(call) * 1e6
    scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    kernels = kernels_per_call(call, lambda: scratch.bitwise_xor_(0x5A), calls)
    kernel_us = sum(us for _, us in kernels)
    return dict(model=model, quant=quant, tokens=tokens, graph_us=graph_us,
                kernel_sum_us=kernel_us, gap_us=graph_us - kernel_us,
                kernels=[dict(name=n, us=us) for n, us in kernels])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--quant", nargs="+", default=None,
                   help="quant modes (default: each model's of shapes.json)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 256, 1024])
    p.add_argument("--calls", type=int, default=10, help="profiled eager calls per case")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="start no case after this many seconds (0: no limit)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    listed = {q for m in args.models for q in SHAPES[m]["quant"]}
    if args.quant and set(args.quant) - listed:
        p.error(f"--quant: {sorted(set(args.quant) - listed)} not listed for these models "
                f"in shapes.json ({sorted(listed)})")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    start = time.time()
    records = []
    for model in args.models:
        for quant in args.quant or SHAPES[model]["quant"]:
            if quant not in SHAPES[model]["quant"]:
                continue
            if args.deadline_s and time.time() - start > args.deadline_s:
                log(f"deadline: {model} {quant} left out")
                continue
            layer = tune.build_layer(MODELS[model], quant, dtype=torch.bfloat16,
                                     device=torch.device("cuda"))
            for tokens in args.tokens:
                try:
                    r = profile_case(layer, model, quant, tokens, args.calls)
                except Exception as e:  # noqa: BLE001 (reported, the other cases go on)
                    log(f"{model} {quant} T={tokens}: FAILED {type(e).__name__}: {e}")
                    continue
                records.append(r)
                log(f"{model} {quant} T={tokens}: graph {r['graph_us']:.1f} us, kernels "
                    f"{r['kernel_sum_us']:.1f}: " + ", ".join(
                        f"{k['name']} {k['us']:.1f}" for k in r["kernels"]))
            del layer
            torch.cuda.empty_cache()
    out = args.out or Path(os.environ.get("MOE_OPS_RESULTS_DIR") or ROOT / "benchmarks/results")
    path = out if out.suffix == ".json" else out / "profile_layer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(
        command="python " + " ".join([sys.argv[0]] + sys.argv[1:]),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__,
        pdl=os.environ.get("MOE_OPS_PDL", "default"), records=records), indent=1))
    log(f"wrote {path}")
    print(f"{'model':14} {'quant':9} {'T':>5} {'graph us':>9} {'kernels':>8} {'gap':>6}  "
          "kernels in launch order: us (share of the graph time)")
    for r in records:
        parts = ", ".join(f"{k['name'].lstrip('_')} {k['us']:.1f} ({k['us'] / r['graph_us']:.0%})"
                          for k in r["kernels"])
        print(f"{r['model'][:14]:14} {r['quant']:9} {r['tokens']:5d} {r['graph_us']:9.1f} "
              f"{r['kernel_sum_us']:8.1f} {r['gap_us']:6.1f}  {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
