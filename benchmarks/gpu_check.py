"""GPU correctness of the Triton backend: FusedMoE(backend="triton") against backend="reference"
of the same layer (the same kernel-layout tensors), case by case.

    python benchmarks/gpu_check.py                  # every shape of shapes.json, its listed modes
    python benchmarks/gpu_check.py --quick          # smoke subset (a couple of minutes)
    compute-sanitizer --tool memcheck python benchmarks/gpu_check.py --sanitize

    python benchmarks/gpu_check.py --models deepseek_v3 gpt_oss_120b --quant nvfp4 mxfp4
                                                    # the 4-bit modes (W4A16) only

Cases, for each model of shapes.json and each of its listed quant modes the backend runs
(every mode is probed with a tiny layer first; one the backend cannot run is reported SKIP):
deepseek_v3 lists nvfp4 (E=256, H=7168, I=2048, k=8) and gpt_oss_120b mxfp4 (swiglu_oai with
biases, E=128, H=I=2880: K not a multiple of 64 or 128, so the masked K tail runs):
- routed   T in {1, 7, 64, 1000, 16384}: router logits -> layer
- skew     T in {1000, 16384}: pre-routed, every slot of every token on one expert
- pad      T = 64: pre-routed with -1 ids (some tokens entirely), which must contribute nothing
- ep       T in {64, 1000}: an expert-parallel shard (the middle half of the experts); tokens
           routed to no local expert must come out exactly as the reference says (zeros)
- large    T = 70000, H = 7168, a DeepSeek-like layer with 32 experts: T*k*H = 4.0e9 > 2^31
           (run first, so that --deadline-s never leaves it out)
Every case runs two calls with different inputs (A then B) on an allocator poisoned with NaN
before each call (a large and many small NaN blocks are allocated, filled and freed, so the
next allocations reuse poisoned memory): a stale or unwritten row shows up as NaN or as a wrong
row. A case passes when both outputs are finite, the relative Frobenius error is <= 1e-2 (SPEC §4;
--fp8-tolerance sets the fp8 modes' bound apart: see bench.ours_tolerance) and no
single row is off by more than --row-tolerance (a Frobenius norm over 16384 rows would hide
one bad row). For calls with router logits, the reference experts run on the Triton routing's
ids and weights (a float near-tie may legitimately pick another expert on the other backend,
which would fail that token's row), and the routing is compared on its own: expert sets equal
for all but T/1000 tokens, weights within --routing-tolerance.

Exit status: 0 all ran and passed; 1 any failure; 2 no failure but cases left out by --deadline-s.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

import bench  # noqa: E402  (puts the repository root on sys.path too)
import moe_ops  # noqa: E402
from bench import ModelConfig, _generator, _short, build_layer, reference_forward  # noqa: E402

from moe_ops.experts import TRITON_QUANTS  # noqa: E402
FULL_TOKENS = (1, 7, 64, 1000, 16384)
QUICK_TOKENS = (1, 7, 64, 1000)
QUICK_PLAN = {"qwen3_30b_a3b": ("none", "fp8"), "deepseek_v3": ("fp8_block",)}
LARGE = ModelConfig("deepseek_like_e32", num_experts=32, hidden_size=7168, intermediate_size=2048,
                    top_k=8, routing="deepseek_v3", n_group=8, topk_group=4,
                    routed_scaling_factor=2.5, quant=("none", "fp8_block"))
SANITIZE_LAYERS = (
    ModelConfig("small", num_experts=8, hidden_size=512, intermediate_size=256, top_k=2,
                routing="renormalize", quant=TRITON_QUANTS),
    ModelConfig("small_deepseek", num_experts=16, hidden_size=256, intermediate_size=128, top_k=4,
                routing="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                quant=("fp8_block",)),
    # gpt-oss-like: swiglu_oai with biases, H = I = 2880 / 10 (K a multiple of 32, not of 64)
    ModelConfig("small_gpt_oss", num_experts=8, hidden_size=288, intermediate_size=288, top_k=4,
                routing="renormalize", activation="swiglu_oai", bias=True, quant=("mxfp4",)),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Case:
    cfg: ModelConfig
    quant: str
    kind: str  # routed | skew | pad | ep | large
    tokens: int
    local_expert_offset: int = 0
    num_local_experts: Optional[int] = None
    prequantized: bool = True
    note: str = ""

    @property
    def layer_key(self) -> tuple:
        return (self.cfg.name, self.quant, self.local_expert_offset, self.num_local_experts,
                self.prequantized)

    @property
    def name(self) -> str:
        return f"{self.cfg.name}/{self.quant}/{self.kind}/T={self.tokens}"


@dataclass
class Result:
    name: str
    model: str
    quant: str
    kind: str
    tokens: int
    status: str  # PASS | FAIL | SKIP
    errors: list[Optional[float]] = field(default_factory=list)
    worst_row: Optional[float] = None
    seconds: float = 0.0
    message: str = ""


# ---------------------------------------------------------------------------------------------
# Poison and compare
# ---------------------------------------------------------------------------------------------
def poison_allocator(device: torch.device, max_bytes: int) -> None:
    """Leave the caching allocator's free blocks full of NaN: one large block (split for later
    large allocations) and many small ones (the < 1 MB pool has its own segments)."""
    if device.type != "cuda":
        return  # the CPU allocator does not cache: nothing to poison
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = min(max_bytes, int(free * 0.5)) // 16 * 16
    if nbytes >= 1 << 20:
        big = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        big.fill_(float("nan"))
        del big
    small = [torch.full((1 << shift,), float("nan"), dtype=torch.float32, device=device)
             for shift in range(6, 18) for _ in range(8)]
    del small


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(actual: torch.Tensor, expected: torch.Tensor, chunk_rows: int = 8192) -> tuple[float, float]:
    """(relative Frobenius error, worst row error), float64 sums over row chunks; NaN if any
    output is not finite. A row's error is ||a - e|| / max(||e||, 1e-2 * median row norm): rows
    the reference leaves at zero must be (nearly) zero too."""
    if actual.shape != expected.shape:
        return float("nan"), float("nan")
    diff_sq = ref_sq = 0.0
    row_diff, row_ref = [], []
    for start in range(0, actual.shape[0], chunk_rows):
        a = actual[start:start + chunk_rows].double()
        e = expected[start:start + chunk_rows].double()
        if not bool(torch.isfinite(a).all()):
            return float("nan"), float("nan")
        d = (a - e).square().sum(dim=1)
        r = e.square().sum(dim=1)
        diff_sq += d.sum().item()
        ref_sq += r.sum().item()
        row_diff.append(d.sqrt())
        row_ref.append(r.sqrt())
    if not row_diff:
        return 0.0, 0.0
    diff_rows, ref_rows = torch.cat(row_diff), torch.cat(row_ref)
    floor = max(1e-2 * ref_rows.median().item(), 1e-30)
    worst = (diff_rows / ref_rows.clamp(min=floor)).max().item()
    relative = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq > 0 else math.sqrt(diff_sq)
    return relative, worst


# ---------------------------------------------------------------------------------------------
# Inputs of one call
# ---------------------------------------------------------------------------------------------
def make_call(case: Case, layer, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    cfg, tokens = case.cfg, case.tokens
    gen = _generator(device, seed)
    x = torch.empty(tokens, cfg.hidden_size, dtype=layer.dtype, device=device).normal_(generator=gen)
    logits = torch.empty(tokens, cfg.num_experts, dtype=torch.float32, device=device).normal_(generator=gen)
    if case.kind in ("routed", "ep", "large"):
        return dict(hidden_states=x, router_logits=logits)
    if case.kind == "skew":
        # Every slot of every token on one expert (not 0, to catch offset mistakes).
        expert = (cfg.num_experts // 2 + 1) % cfg.num_experts
        ids = torch.full((tokens, cfg.top_k), expert, dtype=torch.int32, device=device)
        weights = torch.softmax(torch.empty(tokens, cfg.top_k, device=device).normal_(generator=gen), dim=-1)
        return dict(hidden_states=x, topk_ids=ids, topk_weights=weights)
    if case.kind == "pad":
        ids, weights = moe_ops.route(logits, cfg.top_k, routing=cfg.routing,
                                           routing_bias=layer.routing_bias, n_group=cfg.n_group,
                                           topk_group=cfg.topk_group,
                                           routed_scaling_factor=cfg.routed_scaling_factor,
                                           backend="reference")
        drop = torch.rand(ids.shape, device=device, generator=gen) < 0.25
        drop[::3] = True  # every third token has no expert at all: its row must be zero
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
        return dict(hidden_states=x, topk_ids=ids, topk_weights=weights)
    raise ValueError(f"unknown case kind {case.kind!r}")


def route_both(layer, logits: torch.Tensor, backend: str) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(ids, weights) of the layer's routing on `backend` and on the reference backend."""
    kwargs = dict(routing=layer.routing, routing_bias=layer.routing_bias, n_group=layer.n_group,
                  topk_group=layer.topk_group, routed_scaling_factor=layer.routed_scaling_factor)
    return tuple(moe_ops.route(logits, layer.top_k, **kwargs, backend=backend)
                 for backend in (backend, "reference"))


def compare_routing(ids: torch.Tensor, weights: torch.Tensor, ref_ids: torch.Tensor,
                    ref_weights: torch.Tensor) -> tuple[int, float]:
    """(tokens whose expert sets differ, max |weight difference| / max |weight| over the others).

    Slot order is free: both are sorted by expert id first."""
    ids_sorted, order = ids.long().sort(dim=1)
    ref_sorted, ref_order = ref_ids.long().sort(dim=1)
    same = (ids_sorted == ref_sorted).all(dim=1)
    mismatched = int((~same).sum().item())
    if not bool(same.any()):
        return mismatched, 0.0
    diff = (weights.float().gather(1, order) - ref_weights.float().gather(1, ref_order)).abs()[same]
    scale = max(ref_weights.float().abs().max().item(), 1e-30)
    return mismatched, diff.max().item() / scale


def run_case(case: Case, layer, args: argparse.Namespace, device: torch.device) -> tuple[Result, bool]:
    """One case: two calls (A, B) on poisoned memory, each against the reference. For routed
    calls the reference experts run on the triton routing (so that a float near-tie, where the
    two backends may legitimately pick different experts, cannot fail the experts check) and
    the routing is compared on its own: at most T/1000 tokens (ties) may pick other experts.
    Returns (result, whether the CUDA context is lost)."""
    result = Result(case.name, case.cfg.name, case.quant, case.kind, case.tokens, "FAIL",
                    message=case.note)
    notes = [case.note] if case.note else []
    start = time.perf_counter()
    calls = 1 if case.kind == "large" else 2
    fatal = False
    try:
        inputs = [make_call(case, layer, args.seed + 1000 * n + case.tokens, device) for n in range(calls)]
        outputs = []
        for call in inputs:
            poison_allocator(device, args.poison_bytes)
            outputs.append(layer(**call))
        synchronize(device)
        worst, routing_ok, mismatched_total = 0.0, True, 0
        for call, out in zip(inputs, outputs):
            if "router_logits" in call:
                (ids, weights), (ref_ids, ref_weights) = route_both(layer, call["router_logits"], args.backend)
                mismatched, weight_error = compare_routing(ids, weights, ref_ids, ref_weights)
                mismatched_total += mismatched
                if mismatched > max(1, case.tokens // 1000) or weight_error > args.routing_tolerance:
                    routing_ok = False
                    notes.append(f"routing: {mismatched} tokens on other experts, weight err {weight_error:.1e}")
                expected = reference_forward(layer, call["hidden_states"], topk_ids=ids, topk_weights=weights)
            else:
                expected = reference_forward(layer, **call)
            error, row = compare(out, expected)
            result.errors.append(error)
            worst = row if math.isnan(row) else max(worst, row)
            del expected
        result.worst_row = worst
        if mismatched_total and routing_ok:
            notes.append(f"routing: {mismatched_total} near-tie tokens on other experts (allowed)")
        ok = all(e <= bench.ours_tolerance(case.quant, args) for e in result.errors)
        ok = ok and routing_ok and not math.isnan(worst) and worst <= args.row_tolerance
        result.status = "PASS" if ok else "FAIL"
        if any(math.isnan(e) for e in result.errors):
            notes.append("non-finite output")
    except Exception as exc:  # noqa: BLE001 - an exception is a failed case, not a crash
        result.status = "FAIL"
        notes.append(_short(exc))
        try:
            synchronize(device)
        except Exception as sync_exc:  # noqa: BLE001 - a sticky CUDA error: nothing else can run
            notes.append(f"CUDA context lost ({_short(sync_exc)})")
            fatal = True
    result.message = "; ".join(notes)
    result.seconds = time.perf_counter() - start
    return result, fatal


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
def fit_tokens(cfg: ModelConfig, tokens: int, device: torch.device) -> tuple[int, str]:
    """Scale T down (halving, not below 1000) if the case would not fit in free memory; say so."""
    if device.type != "cuda":
        return tokens, ""
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def need(t: int) -> int:
        pairs = t * cfg.top_k
        # Gathered rows and GEMM1 output in float32 (reference, per expert at worst all pairs),
        # plus both inputs, outputs and references.
        return pairs * (cfg.hidden_size + cfg.n13) * 4 * 2 + t * cfg.hidden_size * 2 * 8

    original = tokens
    while tokens > 1000 and need(tokens) > 0.8 * free:
        tokens //= 2
    if tokens != original:
        return tokens, f"T scaled down from {original} to {tokens}: not enough free GPU memory"
    return tokens, ""


def build_plan(args: argparse.Namespace, shapes: bench.Shapes, supported: dict[str, Optional[str]],
               device: torch.device) -> tuple[list[Case], list[Result]]:
    cases: list[Case] = []
    skipped: list[Result] = []
    if args.sanitize:
        for cfg in SANITIZE_LAYERS:
            for quant in cfg.quant:
                if supported.get(quant):
                    continue
                kinds = (("routed", 1), ("routed", 37), ("skew", 37), ("pad", 16)) if cfg.name == "small" else (("routed", 37),)
                cases.extend(Case(cfg, quant, kind, t, prequantized=False) for kind, t in kinds)
        return cases, skipped
    models = args.models or (list(QUICK_PLAN) if args.quick else list(shapes.models))
    tokens = args.tokens or list(QUICK_TOKENS if args.quick else FULL_TOKENS)
    skew_tokens = [t for t in (1000, 16384) if not args.quick or t <= 1000]
    for name in models:
        cfg = shapes.models[name]
        modes = [m for m in cfg.quant if not args.quick or name not in QUICK_PLAN or m in QUICK_PLAN[name]]
        if args.quant:
            modes = [m for m in modes if m in args.quant]
        for quant in modes:
            if supported.get(quant, "not probed") is not None:
                reason = supported.get(quant) or "not probed"
                skipped.append(Result(f"{name}/{quant}", name, quant, "-", 0, "SKIP",
                                      message=f"backend {args.backend!r} does not run {quant}: {reason}"))
                continue
            for kind, kind_tokens in (("routed", tokens), ("skew", skew_tokens), ("pad", [64])):
                for t in kind_tokens:
                    t = min(t, args.max_tokens)
                    cases.append(Case(cfg, quant, kind, t))
            if not args.quick or name == "qwen3_30b_a3b":
                local = max(1, cfg.num_experts // 2)
                offset = cfg.num_experts // 4
                for t in (64, 1000):
                    cases.append(Case(cfg, quant, "ep", min(t, args.max_tokens), local_expert_offset=offset,
                                      num_local_experts=local,
                                      note=f"experts {offset}..{offset + local - 1} of {cfg.num_experts}"))
    if not args.no_large and args.large_tokens > 0:
        # First in the plan: the offsets past 2^31 are the check a --deadline-s must not drop
        # (they are also the slowest cases to compile and run).
        modes = ("fp8_block",) if args.quick else LARGE.quant
        large = []
        for quant in modes:
            if supported.get(quant) is None:
                product = args.large_tokens * LARGE.top_k * LARGE.hidden_size
                large.append(Case(LARGE, quant, "large", args.large_tokens,
                                  note=f"T*k*H = {product:.3g} ({'>' if product > 2**31 else '<='} 2^31)"))
        cases = large + cases
    # Deduplicate (min(t, max_tokens) can repeat a T) keeping order.
    seen, unique = set(), []
    for case in cases:
        key = (case.layer_key, case.kind, case.tokens)
        if key not in seen:
            seen.add(key)
            unique.append(case)
    return unique, skipped


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else "nan" if math.isnan(value) else f"{value:.2e}"


def summary_table(results: list[Result]) -> str:
    header = f"{'status':6}  {'model':18}  {'quant':9}  {'kind':6}  {'T':>6}  {'err A':>9}  {'err B':>9}  {'worst row':>9}  {'s':>6}  note"
    lines = [header]
    for r in results:
        errors = (r.errors + [None, None])[:2]
        lines.append(f"{r.status:6}  {r.model[:18]:18}  {r.quant:9}  {r.kind:6}  {r.tokens:>6}  "
                     f"{_fmt(errors[0]):>9}  {_fmt(errors[1]):>9}  {_fmt(r.worst_row):>9}  "
                     f"{r.seconds:6.1f}  {r.message}")
    return "\n".join(lines)


def _finish(results: list[Result], args: argparse.Namespace, fatal: bool = False) -> int:
    print()
    print(summary_table(results))
    failed = [r for r in results if r.status == "FAIL"]
    left_out = [r for r in results if r.status == "SKIP" and r.message.startswith("deadline")]
    passed = sum(r.status == "PASS" for r in results)
    print(f"\n{passed} passed, {len(failed)} failed, "
          f"{sum(r.status == 'SKIP' for r in results)} skipped"
          + (" (stopped: CUDA context lost)" if fatal else ""))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(command=" ".join(["python", "benchmarks/gpu_check.py"] + args.argv),
                       gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                       torch=torch.__version__, results=[asdict(r) for r in results])
        path.write_text(json.dumps(bench._json_safe(payload), indent=1, allow_nan=False) + "\n")
    if failed or fatal:
        return 1
    return 2 if left_out else 0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=Path, default=bench.DEFAULT_SHAPES)
    parser.add_argument("--models", nargs="+", help="models of shapes.json (default: all)")
    parser.add_argument("--tokens", nargs="+", type=int, help=f"routed T (default {FULL_TOKENS})")
    parser.add_argument("--quant", nargs="+", choices=moe_ops.QUANT_MODES,
                        help="keep only these of each model's listed modes (default: all listed)")
    parser.add_argument("--max-tokens", type=int, default=16384,
                        help="cap on every T but the large case's (default 16384)")
    parser.add_argument("--large-tokens", type=int, default=70000,
                        help="T of the large case (H=7168, 32 experts; 0 = none)")
    parser.add_argument("--no-large", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="max relative Frobenius error vs the reference, bf16 math (default 1e-2)")
    parser.add_argument("--fp8-tolerance", type=float, default=1e-2,
                        help="the same for fp8 and fp8_block (default 1e-2; bench.ours_tolerance)")
    parser.add_argument("--row-tolerance", type=float, default=0.1,
                        help="max error of any single row (default 0.1; a stale row is ~1)")
    parser.add_argument("--routing-tolerance", type=float, default=1e-4,
                        help="max routing-weight difference, relative to the largest weight")
    parser.add_argument("--poison-bytes", type=int, default=16 << 30,
                        help="size of the large NaN block (default 16 GiB, at most half the free memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke subset: qwen3 none/fp8 + deepseek fp8_block, T<=1000, large fp8_block")
    parser.add_argument("--sanitize", action="store_true",
                        help="one small representative layer per quant mode (for compute-sanitizer)")
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="leave out the cases not started after this many seconds (0 = none)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--backend", default="triton",
                        help="backend under test (default triton; 'reference' dry-runs the script)")
    parser.add_argument("--device", default=None, help="default cuda")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick and args.deadline_s == 0:
        args.deadline_s = 120.0
    if args.sanitize and args.poison_bytes == parser.get_default("poison_bytes"):
        args.poison_bytes = 64 << 20  # memcheck is slow on big fills
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or "cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; this script checks the Triton backend on the GPU "
                  "(--device cpu --backend reference only dry-runs the script itself)", file=sys.stderr)
            return 1
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    shapes = bench.load_shapes(args.shapes)
    started = time.perf_counter()
    log(f"[gpu_check] {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, "
        f"torch {torch.__version__}, backend {args.backend}")
    support_cache: dict = {}
    supported = {quant: bench.backend_support(args.backend, quant, device, torch.bfloat16, support_cache)
                 for quant in moe_ops.QUANT_MODES}
    for quant, reason in supported.items():
        log(f"[gpu_check] {args.backend} {quant}: {'runs' if reason is None else 'unsupported: ' + reason}")
    cases, results = build_plan(args, shapes, supported, device)
    log(f"[gpu_check] {len(cases)} cases")

    layer, layer_key = None, None
    for index, case in enumerate(cases):
        if args.deadline_s and time.perf_counter() - started > args.deadline_s:
            results.append(Result(case.name, case.cfg.name, case.quant, case.kind, case.tokens,
                                  "SKIP", message=f"deadline ({args.deadline_s:.0f} s) passed"))
            continue
        if case.layer_key != layer_key:
            layer = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                layer = build_layer(case.cfg, case.quant, backend=args.backend, device=device,
                                    seed=args.seed, prequantized=case.prequantized,
                                    with_baseline=False,
                                    local_expert_offset=case.local_expert_offset,
                                    num_local_experts=case.num_local_experts)[0]
                layer_key = case.layer_key
            except Exception as exc:  # noqa: BLE001
                layer_key = None
                results.append(Result(case.name, case.cfg.name, case.quant, case.kind, case.tokens,
                                      "FAIL", message="layer build failed: " + _short(exc)))
                continue
        if case.kind != "large":
            tokens, note = fit_tokens(case.cfg, case.tokens, device)
            if note:
                case.tokens, case.note = tokens, "; ".join(filter(None, (case.note, note)))
                log(f"[gpu_check] {note}")
        result, fatal = run_case(case, layer, args, device)
        results.append(result)
        print(f"{result.status} {result.name}: err {', '.join(_fmt(e) for e in result.errors)}, "
              f"worst row {_fmt(result.worst_row)} ({result.seconds:.1f} s)"
              + (f" [{result.message}]" if result.message else ""), flush=True)
        log(f"[gpu_check {time.perf_counter() - started:6.1f}s] {index + 1}/{len(cases)} done")
        if fatal:
            return _finish(results, args, fatal=True)
    layer = None
    return _finish(results, args)


if __name__ == "__main__":
    sys.exit(main())
