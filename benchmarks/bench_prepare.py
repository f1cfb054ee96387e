"""Weight preparation (checkpoint -> kernel layout) against its floor (PERFORMANCE.md).

    python benchmarks/bench_prepare.py            # on the GPU: deepseek_v3 and gpt_oss_120b
    python benchmarks/bench_prepare.py --tiny     # tiny shapes, any device (CPU: the torch path)

Cases: deepseek_v3 (E=256, H=7168, I=2048) bf16 -> fp8_block and bf16 -> nvfp4, pre-quantized
fp8_block and nvfp4 -> layout; gpt_oss_120b (E=128, H=I=2880, biases) bf16 -> mxfp4 and
pre-quantized mxfp4 -> layout. For each:
- prepare: `moe_ops.prepare_weights` (allocates the kernel-layout tensors, quantizes, permutes);
- kernel only (w1), bf16 sources on the GPU: the fused quantize-and-scatter kernel alone on w1
  (nvfp4 also its first pass, the per-expert amax, as `amax only`, and the kernel as prepare
  runs it, reducing w3's amax beside its work, as `kernel + w3 amax`: floor w1 and w3 read);
- reload: `FusedMoE.load_weights` on a live layer (permutation indices already on the device, as
  in an RL weight sync): its time, the bytes it allocated beyond what was allocated before
  (max_memory_allocated - memory_allocated, after reset_peak_memory_stats), whether any
  parameter moved (data_ptr), and whether anything stayed allocated after it.
Time = median of --repeats runs, each between CUDA events after a warm-up run (wall clock on
CPU). Floor = (bytes of the checkpoint tensors read + bytes of the kernel layout written) / the
device-to-device copy bandwidth measured in the same run (a large `copy_`, read + write bytes);
ratio = time / floor (PERFORMANCE.md's target: <= 2 for deepseek_v3 bf16 -> fp8_block).
Every case also checks the prepared bytes against the plain-torch reference path (moe_ops.quant
+ index_copy_) on a few experts, and the layer's parameters against prepare_weights' output.
`--torch-path` (on by default for deepseek_v3 bf16 -> fp8_block) also times that reference
path for the whole layer once: what preparation cost before the fused kernels.
`--nvfp4-variants` adds, for deepseek_v3 bf16 -> nvfp4, the whole w1 quantization by each nvfp4
path of kernels/prepare.py, timed and floored as `kernel only (w1)`: `w1 two launches` (the amax
pass, the factors in torch, the quantizing kernel: NVFP4_FUSED_AMAX off) and the one-launch
kernel in each program order (`w1 fused sequential`, `w1 fused interleaved`), whose bytes and
global scales are checked against the two-launch path's (`exact`). On CPU they run only in the
Triton interpreter (TRITON_INTERPRET=1), as a check that the option works.

Random weights (normal, std 0.02); pre-quantized checkpoints are quantized from them with the
reference functions, chunk by chunk. Peak memory on the GPU is about 45 GB (the deepseek_v3
bf16 checkpoint is 22.5 GB). Writes JSON (command line, GPU, date, versions, records) to
$MOE_OPS_RESULTS_DIR (default benchmarks/results/), prints a table last, progress to stderr.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import moe_ops  # noqa: E402
from bench import git_commit, write_json  # noqa: E402
from moe_ops import layout  # noqa: E402
from moe_ops import quant as q  # noqa: E402

SHAPES_FILE = BENCH_DIR / "shapes.json"
# (model, quant, pre-quantized checkpoint)
CASES = (("deepseek_v3", "fp8_block", False), ("deepseek_v3", "nvfp4", False),
         ("deepseek_v3", "fp8_block", True), ("deepseek_v3", "nvfp4", True),
         ("gpt_oss_120b", "mxfp4", False), ("gpt_oss_120b", "mxfp4", True))
# --tiny: the same cases at sizes that run anywhere in seconds; fp8_block blocks stay partial
# where the real shape has them (2880 = 22.5 x 128), fp4 sizes stay multiples of 32.
TINY_SIZES = {"deepseek_v3": (4, 256, 128), "gpt_oss_120b": (4, 96, 96)}
TARGET = ("deepseek_v3", "fp8_block", False, "prepare")  # PERFORMANCE.md: ratio <= 2
NVFP4_VARIANTS_CASE = ("deepseek_v3", "nvfp4", False)  # --nvfp4-variants
TARGET_RATIO = 2.0
CHECK_EXPERTS = 2  # experts compared byte for byte against the reference path


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_configs(tiny: bool) -> dict[str, dict[str, Any]]:
    models = json.loads(SHAPES_FILE.read_text())["models"]
    out = {}
    for name in TINY_SIZES:
        entry = models[name]
        e, h, i = ((entry["num_experts"], entry["hidden_size"], entry["intermediate_size"])
                   if not tiny else TINY_SIZES[name])
        out[name] = dict(num_experts=e, hidden_size=h, intermediate_size=i, top_k=min(entry["top_k"], e),
                         activation=entry.get("activation", "swiglu"), bias=bool(entry.get("bias", False)))
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def bf16_checkpoint(cfg: dict[str, Any], device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        for start, end in layout.expert_chunks(shape[0], out[0].numel(), 1 << 27):
            out[start:end].normal_(0.0, 0.02, generator=gen)
        return out

    ckpt = {"w1": randn(e, i, h), "w2": randn(e, h, i)}
    if cfg["activation"] != "relu2":
        ckpt["w3"] = randn(e, i, h)
    if cfg["bias"]:
        ckpt.update(b1=randn(e, i), b2=randn(e, h))
        if cfg["activation"] != "relu2":
            ckpt["b3"] = randn(e, i)
    return ckpt


def prequantize(ckpt: dict[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    """The checkpoint in `quant`'s format, by moe_ops.quant's reference functions, in chunks."""
    out = {k: v for k, v in ckpt.items() if k.startswith("b")}
    for name in ("w1", "w2", "w3"):
        if name not in ckpt:
            continue
        w = ckpt[name]
        parts: dict[str, list[torch.Tensor]] = {}
        for start, end in layout.expert_chunks(w.shape[0], w[0].numel(), 1 << 25):
            chunk = w[start:end]
            if quant == "fp8_block":
                pieces = dict(zip(("", "_scale"), q.quantize_fp8_block(chunk)))
            elif quant == "nvfp4":
                pieces = dict(zip(("", "_scale", "_global_scale"), q.quantize_nvfp4(chunk)))
            else:
                pieces = dict(zip(("", "_scale"), q.quantize_mxfp4(chunk)))
            for suffix, tensor in pieces.items():
                parts.setdefault(suffix, []).append(tensor)
        for suffix, tensors in parts.items():
            out[name + suffix] = torch.cat(tensors)
            del tensors[:]
    return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(fn: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `repeats` runs (after the caller's warm-up), one at a time."""
    times = []
    for _ in range(repeats):
        _sync(device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return times


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    """Device-to-device copy bandwidth, bytes read + written per second (median of runs)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = time_runs(lambda: dst.copy_(src), repeats, device)
    median = statistics.median(times)
    return dict(bytes=nbytes, times_ms=times, median_ms=median,
                bytes_per_s=2 * nbytes / (median * 1e-3))


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _reference_prepare(ckpt: dict[str, torch.Tensor], quant: str, activation: str,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """prepare_weights through the plain-torch path (moe_ops.quant + index_copy_)."""
    e, i, h = ckpt["w1"].shape
    if quant in ("nvfp4", "mxfp4") and ckpt["w1"].dtype == torch.uint8:
        h *= 2
    config = dict(quant=quant, activation=activation, num_local_experts=e, hidden_size=h,
                  intermediate_size=i, bias=ckpt.get("b1") is not None)
    device = ckpt["w1"].device
    specs = layout.plan_layout(**config, dtype=dtype, device=device)
    sources = layout.checkpoint_sources(layout.Checkpoint(**ckpt), **config)
    out = layout.allocate(specs, device)
    layout.load_into(out, sources, {r: layout.row_permutation(s.key) for r, s in specs.items()},
                     kernels=False)
    return out


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def run_case(model: str, cfg: dict[str, Any], quant: str, ckpt: dict[str, torch.Tensor],
             prequantized: bool, args: argparse.Namespace, device: torch.device,
             bandwidth: float) -> list[dict[str, Any]]:
    dtype = torch.bfloat16
    activation = cfg["activation"]
    source = f"{quant} (pre-quantized)" if prequantized else "bf16"
    label = f"{model} {source} -> {quant}"
    read = tensor_bytes(ckpt.values())
    records = []

    def record(op: str, times: list[float], written: int, read: int = read,
               **extra: Any) -> dict[str, Any]:
        median = statistics.median(times)
        floor_ms = (read + written) / bandwidth * 1e3
        rec = dict(model=model, quant=quant, source=source, prequantized=prequantized, op=op,
                   time_ms=median, times_ms=times, bytes_read=read, bytes_written=written,
                   floor_ms=floor_ms, ratio=median / floor_ms, **extra)
        log(f"[prepare] {label} {op}: {median:.3f} ms (floor {floor_ms:.3f} ms, "
            f"ratio {median / floor_ms:.2f})")
        records.append(rec)
        return rec

    def prepare() -> dict[str, torch.Tensor]:
        return moe_ops.prepare_weights(quant=quant, activation=activation, dtype=dtype, **ckpt)

    # prepare_weights: warm-up (compiles the kernels, caches the indices), then timed runs.
    prepared = prepare()
    written = tensor_bytes(prepared.values())
    sub = {k: v[:CHECK_EXPERTS] for k, v in ckpt.items()}
    exact = same_bytes({k: v[:CHECK_EXPERTS] for k, v in prepared.items()},
                       _reference_prepare(sub, quant, activation, dtype))
    if not exact:
        log(f"[prepare] {label}: MISMATCH against the reference path")

    def prepare_and_drop() -> None:
        prepare()  # the outputs are freed at once: the allocator hands the same blocks back

    # The reload first (it needs the prepared tensors for its check), then prepare's timing.
    layer = moe_ops.FusedMoE(cfg["num_experts"], cfg["hidden_size"], cfg["intermediate_size"],
                             cfg["top_k"], activation=activation, quant=quant, bias=cfg["bias"],
                             dtype=dtype, device=device)
    layer.load_weights(**ckpt)
    layer_matches = same_bytes(layer.kernel_weights(), prepared)
    del prepared
    pointers = {n: p.data_ptr() for n, p in layer.named_parameters()}
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.empty_cache()
        allocated_before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    reload_times = time_runs(lambda: layer.load_weights(**ckpt), args.repeats, device)
    extra: dict[str, Any] = dict(parameters_moved=[n for n, p in layer.named_parameters()
                                                   if p.data_ptr() != pointers[n]],
                                 matches_prepare=layer_matches)
    if cuda:
        extra.update(allocated_bytes=torch.cuda.max_memory_allocated(device) - allocated_before,
                     retained_bytes=torch.cuda.memory_allocated(device) - allocated_before)
    else:
        extra.update(allocated_bytes=None, retained_bytes=None)
    layer_bytes = tensor_bytes(layer.kernel_weights().values())
    del layer
    prepare_and_drop()
    record("prepare", time_runs(prepare_and_drop, args.repeats, device), written, bit_exact=exact)
    record("reload", reload_times, layer_bytes, bit_exact=exact, **extra)

    if not prequantized and layout.device_kernels_available(device):
        # The fused kernel alone on w1 (into a preallocated w13, through its index): how close
        # the kernel itself comes to the copy bandwidth, apart from the host-side work. nvfp4
        # also shows its first pass (the per-expert amax, a pure read) on its own.
        from moe_ops.kernels import prepare as prep_kernels

        specs = layout.plan_layout(quant=quant, activation=activation,
                                   num_local_experts=cfg["num_experts"],
                                   hidden_size=cfg["hidden_size"],
                                   intermediate_size=cfg["intermediate_size"], bias=cfg["bias"],
                                   dtype=dtype, device=device)
        w1 = ckpt["w1"]
        rows = w1.shape[1]
        w13 = torch.empty(specs["w13"].shape, dtype=specs["w13"].dtype, device=device)
        w13_scale = torch.empty(specs["w13_scale"].shape, dtype=specs["w13_scale"].dtype,
                                device=device)
        index = layout.row_permutation(specs["w13"].key)[:rows]
        scale_rows = w13_scale.shape[1] // 2
        scale_index = layout.row_permutation(specs["w13_scale"].key)[:scale_rows]
        factors: tuple = ()
        if quant == "nvfp4":
            factors = q.nvfp4_global_scale(prep_kernels.amax_per_expert(w1))
            amax_only = lambda: prep_kernels.amax_per_expert(w1)  # noqa: E731
            record("amax only (w1)", time_runs(amax_only, args.repeats, device), 0,
                   read=tensor_bytes([w1]), bit_exact=None)

        def kernel_only() -> None:
            prep_kernels.quantize_scatter(w1, quant, w13, index, w13_scale, scale_index, *factors)

        kernel_only()
        # w1's half of w13 and of its scales (`written` stays the whole layout's, for below)
        written_w1 = (w13.numel() // 2 + w13_scale.numel() // 2 * w13_scale.element_size())
        record("kernel only (w1)", time_runs(kernel_only, args.repeats, device), written_w1,
               read=tensor_bytes([w1]), bit_exact=None)
        if quant == "nvfp4" and ckpt.get("w3") is not None:
            # what prepare runs for w1: its quantization with w3's amax reduced beside it
            def kernel_and_next() -> None:
                prep_kernels.quantize_scatter(w1, quant, w13, index, w13_scale, scale_index,
                                              *factors, next_weight=ckpt["w3"])

            record("kernel + w3 amax (w1)", time_runs(kernel_and_next, args.repeats, device),
                   written_w1, read=tensor_bytes([w1, ckpt["w3"]]), bit_exact=None)
        del w13, w13_scale
    if (args.nvfp4_variants and (model, quant, prequantized) == NVFP4_VARIANTS_CASE
            and _nvfp4_variants_runnable(device)):
        nvfp4_variants(cfg, ckpt["w1"], activation, dtype, device, args, record)
    if (model, quant, prequantized) == TARGET[:3] and args.torch_path:
        # The plain-torch path (what preparation was before the fused kernels), once.
        times = time_runs(lambda: _reference_prepare(ckpt, quant, activation, dtype), 1, device)
        record("prepare, torch path", times, written, bit_exact=None)
    _sync(device)
    if cuda:
        torch.cuda.empty_cache()
    return records


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _nvfp4_variants_runnable(device: torch.device) -> bool:
    """The device kernels on the GPU, or the Triton interpreter on CPU (a check, not timing)."""
    if layout.device_kernels_available(device):
        return True
    if device.type == "cpu" and _interpreting():
        return True
    log("[prepare] --nvfp4-variants: no device kernels here (on CPU: TRITON_INTERPRET=1)")
    return False


def nvfp4_variants(cfg: dict[str, Any], w1: torch.Tensor, activation: str, dtype: torch.dtype,
                   device: torch.device, args: argparse.Namespace, record: Callable) -> None:
    """w1 bf16 -> nvfp4 into a preallocated w13 (through its index) by each nvfp4 path, whole:
    the two-launch path (amax_per_expert, the factors in torch, quantize_scatter) and the fused
    one-launch kernel in each schedule. Floor as `kernel only (w1)`: w1 read once, w1's half of
    w13 and its scales written. The fused runs write the same buffers as the two-launch run,
    whose bytes (all of them: the rows w1 does not write are the same memory) and global scales
    they must reproduce."""
    from moe_ops.kernels import prepare as prep_kernels

    specs = layout.plan_layout(quant="nvfp4", activation=activation,
                               num_local_experts=cfg["num_experts"],
                               hidden_size=cfg["hidden_size"],
                               intermediate_size=cfg["intermediate_size"], bias=cfg["bias"],
                               dtype=dtype, device=device)
    w13 = torch.zeros(specs["w13"].shape, dtype=specs["w13"].dtype, device=device)
    w13_scale = torch.zeros(specs["w13_scale"].shape, dtype=specs["w13_scale"].dtype,
                            device=device)
    rows = w1.shape[1]
    index = layout.row_permutation(specs["w13"].key)[:rows]
    scale_index = layout.row_permutation(specs["w13_scale"].key)[:rows]
    written = w13.numel() // 2 + w13_scale.numel() // 2 * w13_scale.element_size()
    read = tensor_bytes([w1])

    def two_launches() -> torch.Tensor:
        factors = q.nvfp4_global_scale(prep_kernels.amax_per_expert(w1))
        prep_kernels.quantize_scatter(w1, "nvfp4", w13, index, w13_scale, scale_index, *factors)
        return factors[0]

    want_global = two_launches()
    want = (w13.clone(), w13_scale.view(torch.uint8).clone())
    record("w1 two launches", time_runs(two_launches, args.repeats, device), written, read=read,
           bit_exact=None, variant="two launches")
    for schedule in prep_kernels.NVFP4_SCHEDULES:
        def fused(schedule: str = schedule) -> torch.Tensor:
            return prep_kernels.quantize_scatter_nvfp4(w1, w13, index, w13_scale, scale_index,
                                                       schedule)

        w13.zero_()
        w13_scale.view(torch.uint8).zero_()
        exact = (torch.equal(fused(), want_global) and torch.equal(w13, want[0])
                 and torch.equal(w13_scale.view(torch.uint8), want[1]))
        if not exact:
            log(f"[prepare] w1 fused {schedule}: MISMATCH against the two-launch path")
        record(f"w1 fused {schedule}", time_runs(fused, args.repeats, device), written,
               read=read, bit_exact=exact, variant=f"fused {schedule}")
    del w13, w13_scale, want


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_table(records: list[dict[str, Any]], bandwidth: float) -> str:
    header = (f"{'model':<13} {'source':<26} {'quant':<9} {'op':<20} {'ms':>9} {'floor ms':>9} "
              f"{'ratio':>6} {'alloc MiB':>9}  exact")
    lines = [f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", header]
    for r in records:
        exact = {True: "yes", False: "NO", None: "-"}[r.get("bit_exact")]
        if r.get("parameters_moved"):
            exact += " (moved!)"
        lines.append(f"{r['model']:<13} {r['source']:<26} {r['quant']:<9} {r['op']:<20} "
                     f"{r['time_ms']:>9.3f} {r['floor_ms']:>9.3f} {r['ratio']:>6.2f} "
                     f"{_mib(r.get('allocated_bytes')):>9}  {exact}")
    return "\n".join(lines)


def default_out_path(device: torch.device, tiny: bool) -> Path:
    results = Path(os.environ.get("MOE_OPS_RESULTS_DIR") or BENCH_DIR / "results")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
        slug = "_".join("".join(c if c.isalnum() else " " for c in name).split()) or "gpu"
    else:
        slug = device.type
    return results / f"prepare_{slug}{'_tiny' if tiny else ''}.json"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (seconds, any device)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (5; --tiny 2)")
    p.add_argument("--cases", nargs="*", default=None,
                   help="subset, as model:quant or model:quant:pre (e.g. deepseek_v3:fp8_block)")
    p.add_argument("--copy-bytes", type=int, default=None,
                   help="size of the copy that measures bandwidth (4 GiB; --tiny 64 MiB)")
    p.add_argument("--torch-path", dest="torch_path", action="store_true", default=True,
                   help="also time the plain-torch path for deepseek_v3 bf16 -> fp8_block (default)")
    p.add_argument("--no-torch-path", dest="torch_path", action="store_false")
    p.add_argument("--nvfp4-variants", action="store_true",
                   help="also time w1 bf16 -> nvfp4 by each nvfp4 path (two launches, fused "
                        "sequential / interleaved) for deepseek_v3")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default $MOE_OPS_RESULTS_DIR or benchmarks/results/, "
                        "prepare_<gpu>.json)")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.tiny else 5
    if args.copy_bytes is None:
        args.copy_bytes = (64 << 20) if args.tiny else (4 << 30)
    return args


def selected_cases(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    if not args.cases:
        return list(CASES)
    wanted = []
    for spec in args.cases:
        parts = spec.split(":")
        model, quant, pre = parts[0], parts[1], len(parts) > 2 and parts[2] == "pre"
        if (model, quant, pre) not in CASES:
            raise SystemExit(f"unknown case {spec!r}; cases: "
                             + ", ".join(f"{m}:{qq}{':pre' if p else ''}" for m, qq, p in CASES))
        wanted.append((model, quant, pre))
    return wanted


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        log(f"[prepare] no CUDA device: {device} with wall-clock timing and the plain-torch path "
            "(numbers are not GPU numbers)")
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional
        triton_version = None
    started = time.perf_counter()
    script = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    meta = dict(command=shlex.join(["python", script] + argv),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                device=str(device), torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton_version, moe_ops=moe_ops.__version__, python=sys.version.split()[0],
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                git=git_commit(), tiny=args.tiny, repeats=args.repeats,
                device_kernels=layout.device_kernels_available(device),
                target=dict(case="deepseek_v3 bf16 -> fp8_block, prepare", max_ratio=TARGET_RATIO))
    out_path = args.out or default_out_path(device, args.tiny)
    configs = model_configs(args.tiny)
    cases = selected_cases(args)

    bw = copy_bandwidth(device, args.copy_bytes, args.repeats)
    bandwidth = bw["bytes_per_s"]
    log(f"[prepare] {meta['gpu'] or device}: copy {bandwidth / 1e12:.3f} TB/s (read + write), "
        f"device kernels {'on' if meta['device_kernels'] else 'off'}")
    records: list[dict[str, Any]] = []
    failures: list[str] = []

    def payload() -> dict[str, Any]:
        return dict(metadata=dict(meta, elapsed_s=time.perf_counter() - started,
                                  copy_bandwidth=bw, failures=failures), records=records)

    for model in dict.fromkeys(m for m, _, _ in cases):
        cfg = configs[model]
        ckpt = bf16_checkpoint(cfg, device)
        model_cases = [(qq, pre) for m, qq, pre in cases if m == model]
        prequantized = {qq: prequantize(ckpt, qq) for qq, pre in model_cases if pre}
        for quant, pre in model_cases:
            if pre:
                continue
            try:
                records += run_case(model, cfg, quant, ckpt, False, args, device, bandwidth)
            except Exception as exc:  # noqa: BLE001 - report, go on with the next case
                failures.append(f"{model} bf16 -> {quant}: {type(exc).__name__}: {exc}")
                log(f"[prepare] FAILED {failures[-1]}")
            write_json(out_path, payload())
        del ckpt
        for quant in list(prequantized):
            try:
                records += run_case(model, cfg, quant, prequantized.pop(quant), True, args,
                                    device, bandwidth)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{model} pre-quantized {quant}: {type(exc).__name__}: {exc}")
                log(f"[prepare] FAILED {failures[-1]}")
            write_json(out_path, payload())
        if device.type == "cuda":
            torch.cuda.empty_cache()

    write_json(out_path, payload())
    log(f"[prepare {time.perf_counter() - started:.1f}s] wrote {out_path}")
    target = [r for r in records if (r["model"], r["quant"], r["prequantized"], r["op"]) == TARGET]
    for failure in failures:
        print(f"failed: {failure}")
    if target and device.type == "cuda" and not args.tiny:
        ratio = target[0]["ratio"]
        print(f"target (deepseek_v3 bf16 -> fp8_block prepare <= {TARGET_RATIO:g}x floor): "
              f"{ratio:.2f}x: {'met' if ratio <= TARGET_RATIO else 'NOT met'}")
    print(format_table(records, bandwidth))
    bad = failures or any(r.get("bit_exact") is False or r.get("parameters_moved")
                          or r.get("matches_prepare") is False for r in records)
    return 1 if bad or not records else 0


if __name__ == "__main__":
    sys.exit(main())
