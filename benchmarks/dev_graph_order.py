"""Whether the sweep's eager-before-graph order favours eager at power-limited points.

bench.py times a point's eager calls first and its graph replays right after, each for
--budget-ms. At prefill the H200 runs at its 700 W limit and lowers its SM clock after a
fraction of a second of load, so whichever mode goes second may run on a lower clock. This
script times one layer in both orders after an idle gap, with nvidia-smi sampling the SM clock
and power, and prints each phase's median us, mean MHz and W:

    python benchmarks/dev_graph_order.py --model deepseek_v3 --quant fp8_block --tokens 4096

CUDA only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402


def clock_samples(path: Path) -> list[tuple[float, float, float]]:
    """(unix time, SM MHz, W) rows of an nvidia-smi log written with -lms."""
    rows = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            rows.append((stamp, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek_v3")
    parser.add_argument("--quant", default="fp8_block")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget-ms", type=float, default=100.0,
                        help="each phase's timing budget (bench.py's default)")
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle gap before each order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dev_graph_order.py needs a CUDA device")
    device = torch.device("cuda")
    shapes = bench.load_shapes()
    cfg = shapes.models[args.model]
    layer, _ = bench.build_layer(cfg, args.quant, backend="triton", device=device,
                                 with_baseline=False)
    sets = bench.default_input_sets(args.tokens)
    inputs = bench.make_inputs(cfg, args.tokens, sets, device, layer.dtype, 0)

    def run() -> torch.Tensor:
        out = None
        for x, logits in inputs:
            out = layer(x, logits)
        return out

    graph, _ = bench.capture_graph(run, device)
    modes = {"eager": run, "graph": graph.replay}
    log_file = Path(tempfile.mkstemp(suffix=".csv")[1])
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
         "--format=csv,noheader,nounits", "-lms", "20"],
        stdout=log_file.open("w"), stderr=subprocess.DEVNULL)
    phases = []
    try:
        for rnd in range(args.rounds):
            order = ("eager", "graph") if rnd % 2 == 0 else ("graph", "eager")
            time.sleep(args.idle_s)
            for position, mode in enumerate(order):
                torch.cuda.synchronize()
                start = time.time()
                timing = bench.measure(modes[mode], sets, args.budget_ms / 1e3, device=device)
                phases.append(dict(round=rnd, position=position, mode=mode, start=start,
                                   end=time.time(), **timing))
        time.sleep(0.2)
    finally:
        smi.terminate()
        smi.wait()
    samples = clock_samples(log_file)
    print(f"{cfg.name} {args.quant} T={args.tokens}, {args.budget_ms:.0f} ms a phase after "
          f"{args.idle_s:.1f} s idle")
    print(f"{'round':>5} {'pos':>3} {'mode':>6} {'median us':>10} {'min us':>9} {'MHz':>6} "
          f"{'W':>5}")
    for phase in phases:
        inside = [s for s in samples if phase["start"] <= s[0] <= phase["end"]]
        phase["mhz"] = statistics.mean(s[1] for s in inside) if inside else None
        phase["watts"] = statistics.mean(s[2] for s in inside) if inside else None
        mhz = f"{phase['mhz']:.0f}" if phase["mhz"] else "-"
        watts = f"{phase['watts']:.0f}" if phase["watts"] else "-"
        print(f"{phase['round']:>5} {phase['position']:>3} {phase['mode']:>6} "
              f"{phase['median_us']:>10.1f} {phase['min_us']:>9.1f} {mhz:>6} {watts:>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            command=" ".join(["python", "benchmarks/dev_graph_order.py"] + sys.argv[1:]),
            gpu=torch.cuda.get_device_name(device), date=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                        time.gmtime()),
            phases=phases, samples=samples), indent=1))


if __name__ == "__main__":
    main()
