"""The main job (`make run`): a real MoE layer, every quant mode, every available backend.

Builds a moe_ops.FusedMoE for one model of benchmarks/shapes.json, loads random weights in every
quant mode (quantized on load), runs each available backend over a few token counts, checks each
against the reference backend on the same prepared weights, and prints a table.

On a CUDA machine it runs the full shapes on the GPU (backends: triton, reference). On a CPU
machine it scales the model down so the job takes about a minute, and runs the Triton kernels in
the Triton interpreter (TRITON_INTERPRET=1, set here before anything imports triton) beside the
reference, so the table shows the real kernel code running.

    python benchmarks/run_layer.py [--model qwen3_30b_a3b] [--tokens 1 16 64] [--full]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = Path(__file__).with_name("shapes.json")


def _cuda_available() -> bool:
    # Importing torch is fine here; only triton must not be imported before TRITON_INTERPRET.
    import torch

    return torch.cuda.is_available()


def parse_args() -> argparse.Namespace:
    models = json.loads(SHAPES.read_text())["models"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_30b_a3b", choices=sorted(models))
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="token counts (default: 1 16 256 4096 on GPU, 1 8 64 on CPU)")
    parser.add_argument("--full", action="store_true", help="full shapes even on CPU (slow)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def scaled_config(model: dict, on_gpu: bool, full: bool) -> dict:
    """The model's layer, scaled down on CPU: fewer experts, hidden and intermediate / 8."""
    config = dict(num_experts=model["num_experts"], hidden_size=model["hidden_size"],
                  intermediate_size=model["intermediate_size"], top_k=model["top_k"],
                  routing=model["routing"], activation=model.get("activation", "swiglu"),
                  bias=model.get("bias", False))
    for key in ("n_group", "topk_group", "routed_scaling_factor"):
        if key in model:
            config[key] = model[key]
    if on_gpu or full:
        return config
    # Multiples of 32 keep every quant mode valid (mxfp4 scales one per 32 along K).
    config["hidden_size"] = max(64, config["hidden_size"] // 8 // 32 * 32)
    config["intermediate_size"] = max(64, config["intermediate_size"] // 8 // 32 * 32)
    if config["num_experts"] > 16:
        groups = config.get("n_group")
        config["num_experts"] = 16
        if groups:
            config["n_group"] = min(groups, 4)
            config["topk_group"] = min(config["topk_group"], config["n_group"])
    per_group = config["num_experts"] // config.get("n_group", 1)
    limit = config.get("topk_group", 1) * per_group if config.get("n_group") else config["num_experts"]
    config["top_k"] = min(config["top_k"], limit, 4)
    return config


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.done, self.width, self.start = total, 0, width, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.1f}s {label:<40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def main() -> int:
    args = parse_args()
    on_gpu = _cuda_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before moe_ops (and triton) import
    import torch

    import moe_ops

    device = torch.device("cuda" if on_gpu else "cpu")
    model = json.loads(SHAPES.read_text())["models"][args.model]
    config = scaled_config(model, on_gpu, args.full)
    tokens = args.tokens or ([1, 16, 256, 4096] if on_gpu else [1, 8, 64])
    repeats = args.repeats or (20 if on_gpu else 1)
    triton_ok = on_gpu or os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import moe_ops.kernels.experts  # noqa: F401
    except ImportError:
        triton_ok = False
    from moe_ops.experts import TRITON_QUANTS as triton_quants  # every mode the kernels cover
    dtype = torch.bfloat16
    torch.manual_seed(args.seed)

    plan = [(quant, backend, t) for quant in moe_ops.QUANT_MODES for t in tokens
            for backend in ("reference", "triton")
            if backend == "reference" or (triton_ok and quant in triton_quants)]
    print(f"moe_ops {moe_ops.__version__} on {torch.cuda.get_device_name() if on_gpu else 'CPU'}; "
          f"model {args.model}: " + ", ".join(f"{k}={v}" for k, v in config.items())
          + ("" if on_gpu or args.full else "  (scaled down for CPU)"))
    e, h, i = config["num_experts"], config["hidden_size"], config["intermediate_size"]
    gated = config["activation"] != "relu2"

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) / shape[-1] ** 0.5

    checkpoint = dict(w1=weight(e, i, h), w2=weight(e, h, i), w3=weight(e, i, h) if gated else None)
    if config["bias"]:
        checkpoint.update(b1=weight(e, i), b2=weight(e, h), b3=weight(e, i) if gated else None)

    progress = Progress(len(plan))
    rows = []
    for quant in moe_ops.QUANT_MODES:
        layers = {backend: moe_ops.FusedMoE(**config, quant=quant, dtype=dtype, device=device,
                                            backend=backend) for backend in ("reference", "triton")}
        extra = {"routing_bias": torch.randn(e, device=device) * 0.1} if config["routing"] == "deepseek_v3" else {}
        layers["reference"].load_weights(**checkpoint, **extra)
        # The same prepared bytes for every backend: the state_dict is the kernel layout.
        layers["triton"].load_state_dict(layers["reference"].state_dict())
        for t in tokens:
            x = torch.randn(t, h, device=device, dtype=dtype)
            logits = torch.randn(t, e, device=device, dtype=torch.float32)
            reference_out = None
            for backend in ("reference", "triton"):
                if (quant, backend, t) not in plan:
                    continue
                layer = layers[backend]
                out = layer(x, logits)  # warm-up (compiles kernels)
                times = []
                # The reference is the slow yardstick (a Python loop over experts): time it less.
                for _ in range(repeats if backend == "triton" else min(repeats, 3)):
                    if on_gpu:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = layer(x, logits)
                    if on_gpu:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                if backend == "reference":
                    reference_out = out.float()
                err = ((out.float() - reference_out).norm() / reference_out.norm().clamp_min(1e-30)).item()
                finite = bool(torch.isfinite(out).all())
                rows.append((quant, backend + (" (interpreter)" if backend == "triton" and not on_gpu else ""),
                             t, statistics.median(times) * 1e6, err, finite))
                progress.step(f"{quant} {backend} T={t}")

    print(f"\n{'quant':<10} {'backend':<22} {'tokens':>6} {'time (us)':>12} {'rel err vs ref':>15}  ok")
    failures = 0
    for quant, backend, t, micros, err, finite in rows:
        ok = finite and err <= 1e-2
        failures += not ok
        # The reference is the yardstick: its own row shows only that it ran and is finite.
        shown = "-" if backend == "reference" else f"{err:.2e}"
        print(f"{quant:<10} {backend:<22} {t:>6} {micros:>12.1f} {shown:>15}  {'yes' if ok else 'NO'}")
    print(f"{len(rows) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
