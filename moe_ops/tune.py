"""Tune the Triton experts kernels for a model's MoE layer over every token bucket (SPEC §6).

    python -m moe_ops.tune --model deepseek_v3 --quant fp8_block              # -> tuning.json
    python -m moe_ops.tune --model mixtral_8x7b --quant fp8 --cache my.json
    python -m moe_ops.tune --model qwen3_30b_a3b --quant none --ship          # package tables
    python -m moe_ops.tune --experts 64 --hidden 2048 --intermediate 1408 --top-k 6 --quant none

For each bucket B (1, 2, 4, ... tune_max_num_tokens) the layer runs on synthetic inputs of B
tokens (moe_ops.synthetic: weights in the served format with valid scales, two routings:
balanced and Zipf-skewed, timed together so neither decides alone). GEMM1's candidates are
profiled with GEMM2 at its default, then GEMM2's with GEMM1 at its winner (the dispatch tile,
max(block_m) of the two, is shared: tuning GEMM2 second sees it). Each candidate's output must
match the default config's; timing replays CUDA graphs with L2 flushed before every call
(tuning.graph_timer). Last, the tuned pair is timed head to head with the default pair,
interleaved, and kept only if it is faster: a shipped table never makes a bucket slower. Where
the layer already had configs for the bucket (a shipped table, the --cache file: the "current"
pair), they join that head to head and stay unless the new pair beats them there by more than
REPLACE_MARGIN: a re-tune replaces an entry only on a measured win in one interleaved
comparison, not on the spread between two runs' candidate timings.

The candidate kernels of every bucket are compiled first, all in one parallel batch (Triton's
AsyncCompileMode on a thread pool), which is most of the wall time of a cold run. The profiling
that follows has a time budget (--budget-s, 55 s by default: PERFORMANCE.md allows 60 s of GPU
time a pair; the compile runs on the host and does not count), shared out among the buckets as
they come (bucket_share); candidates a bucket has no time left for are skipped and counted in
the report, the defaults always being timed. (Compiling bucket by bucket let the early buckets' compiles and profiling take the time
the last ones needed: Llama 4 bf16's four largest buckets once ran their defaults only.)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from moe_ops import synthetic
from moe_ops.models import MODELS, MoEShape
from moe_ops.tuning import (
    SHIPPED_DIR, ProblemKey, Timer, Tuner, autotune, default_timer, experts_keys, force_config,
    get_tuner, gpu_name, outputs_match, token_buckets,
)

DEFAULT_CACHE = "tuning.json"
# PERFORMANCE.md allows 60 s of GPU time to tune a (model, quant) pair; the budget leaves room
# for the last bucket's head to head and the process around it.
DEFAULT_BUDGET_S = 55.0
# How the profiling time is shared out (bucket_share): a bucket may take up to this many times
# an equal share of the time left, as long as that leaves BUCKET_RESERVE_S for each bucket after
# it (its defaults' timing and the head to head: 0.1-0.7 s on the H200, the kernels compiled
# before). An equal share cut runs that fit (DeepSeek fp8_block's 49 s by 2.5 s, replayed on the
# 2026-12-01 tuning reports). The reserve was 2.5 s while each bucket compiled its own
# candidates; with the compile up front that starved the first buckets (Llama 4 bf16's buckets 1
# and 2 profiled nothing: 28 s left for 14 buckets, less than 13 reserves).
BUCKET_SHARE_FACTOR = 2.0
BUCKET_RESERVE_S = 1.0   # (with a current pair the head to head times three pairs, not two)
# A re-tune replaces the layer's current configs of a bucket only when its pair beats them head
# to head by more than this fraction: near-equal pairs (most decode buckets' top few) would
# otherwise trade places on the spread of one run to the next.
REPLACE_MARGIN = 0.01


def bucket_share(now: float, deadline: float, buckets_left: int) -> float:
    """The time the next bucket may take (>= 0), given the run's deadline and the buckets left,
    this one included (see BUCKET_SHARE_FACTOR)."""
    left = max(0.0, deadline - now)
    return max(0.0, min(BUCKET_SHARE_FACTOR * left / buckets_left,
                        left - BUCKET_RESERVE_S * (buckets_left - 1)))


# ---------------------------------------------------------------------------------------------
# Profiling one bucket
# ---------------------------------------------------------------------------------------------

@dataclass
class InputSet:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class LayerRunner:
    """The tuner's Runner for one GEMM of a layer at one bucket: runs the whole layer on every
    input set with the GEMM under test at `config` and the other GEMM at `other`."""

    def __init__(self, layer, inputs: Sequence[InputSet], tuner: Tuner, gemm: int,
                 other, candidates: Callable, default: Callable):
        self.layer, self.inputs, self.tuner, self.gemm = layer, inputs, tuner, gemm
        self.other, self._candidates, self._default = other, candidates, default

    def configs(self, config):
        return (config, self.other) if self.gemm == 1 else (self.other, config)

    def candidates(self, key: ProblemKey):
        return self._candidates(key.problem())

    def default(self, key: ProblemKey):
        return self._default(key.problem())

    def run(self, key: ProblemKey, config) -> torch.Tensor:
        return run_layer(self.layer, self.inputs, self.tuner, *self.configs(config))


def run_layer(layer, inputs: Sequence[InputSet], tuner: Tuner, config1, config2) -> torch.Tensor:
    with force_config(config1, config2, tuner=tuner):
        outs = [layer(s.x, topk_ids=s.topk_ids, topk_weights=s.topk_weights) for s in inputs]
    return torch.cat(outs)


def make_inputs(layer, shape: MoEShape, tokens: int, *, seed: int) -> List[InputSet]:
    """Two input sets of `tokens` tokens: balanced and skewed routing (the layer's own router)."""
    import moe_ops

    sets = []
    for skew in (False, True):
        s = seed + 2 * int(skew)
        x = synthetic.hidden_states(tokens, shape.hidden_size, dtype=layer.dtype,
                                    device=layer.w13.device, seed=s)
        logits = synthetic.router_logits(tokens, shape.num_experts, skew=skew, device=x.device,
                                         seed=s + 1)
        ids, weights = moe_ops.route(logits, shape.top_k, routing=shape.routing,
                                     routing_bias=layer.routing_bias, n_group=shape.n_group,
                                     topk_group=shape.topk_group,
                                     routed_scaling_factor=shape.routed_scaling_factor)
        sets.append(InputSet(x, ids, weights))
    return sets


def build_layer(shape: MoEShape, quant: str, *, dtype: torch.dtype, device: torch.device,
                seed: int = 0):
    """A FusedMoE on the Triton backend with random weights in the quant mode's format."""
    import moe_ops

    layer = moe_ops.FusedMoE(shape.num_experts, shape.hidden_size, shape.intermediate_size,
                             shape.top_k, quant=quant, dtype=dtype, device=device,
                             backend="triton", **shape.layer_kwargs())
    ckpt = synthetic.random_checkpoint(shape.num_experts, shape.hidden_size,
                                       shape.intermediate_size, quant=quant, gated=shape.gated,
                                       bias=shape.bias, dtype=dtype, device=device, seed=seed)
    routing_bias = (synthetic.routing_bias(shape.num_experts, device=device, seed=seed + 7)
                    if shape.routing == "deepseek_v3" else None)
    layer.load_weights(**ckpt, routing_bias=routing_bias)
    del ckpt
    return layer


def bucket_keys(layer, shape: MoEShape, quant: str, inputs: Sequence[InputSet], bucket: int,
                tuner: Tuner):
    """The two ProblemKeys (and GemmProblems) triton_experts looks up for this bucket."""
    from moe_ops.kernels.experts import gemm_problems

    x = inputs[0].x
    problem1, problem2 = gemm_problems(x, shape.top_k, layer.w13, layer.w2, shape.activation, quant)
    key1, key2 = experts_keys(problem1, problem2, num_tokens=bucket, top_k=shape.top_k,
                              activation=shape.activation, device=x.device,
                              max_num_tokens=tuner.max_num_tokens)
    return (key1, problem1), (key2, problem2)


def precompile(jobs: Sequence[Callable[[], Any]], workers: Optional[int] = None,
               stats: Optional[Dict[str, int]] = None) -> float:
    """Compile the grouped-GEMM kernels that `jobs` would launch, in parallel, without running
    them. Returns the seconds spent; stats (if given) gets "kernels": the compiles submitted
    (kernels already compiled in this process and duplicates are not). A job that fails here
    fails again (and is rejected) when profiled."""
    from moe_ops.kernels.grouped_gemm import compile_only

    start = time.perf_counter()
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older triton: compiled one by one when first run
        return 0.0
    workers = workers or min(32, os.cpu_count() or 4)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        with AsyncCompileMode(pool, ignore_errors=True) as mode, compile_only():
            for job in jobs:
                with contextlib.suppress(Exception):
                    job()
            if stats is not None:
                stats["kernels"] = stats.get("kernels", 0) + len(mode.future_kernels)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def compiles(layer) -> bool:
    """Whether the layer's kernels are compiled (on a GPU) rather than interpreted."""
    return layer.w13.is_cuda


def _per_call(timer: Timer, calls: int) -> Timer:
    return lambda fn: timer(fn) / calls


def head_to_head(timer: Timer, *runs: Callable[[], Any], rounds: int = 3) -> tuple:
    """Median times of the runs measured in turn (a, b, [c,] a, b, ...): drift hits them all."""
    times: List[List[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, measured in zip(runs, times):
            measured.append(timer(run))
    return tuple(sorted(measured)[len(measured) // 2] for measured in times)


@dataclass
class BucketResult:
    bucket: int
    default_us: float
    tuned_us: float
    gemm1: Dict[str, Any]
    gemm2: Dict[str, Any]
    kept: bool            # a pair other than the defaults beat them head to head
    candidates: int
    rejected: int
    compile_s: float
    seconds: float
    skipped: int = 0      # candidates left unprofiled when the bucket's time ran out
    current_us: Optional[float] = None   # the layer's configs before this run, head to head
    current_kept: bool = False           # ... and they stayed (the new pair did not beat them)

    @property
    def speedup(self) -> float:
        return self.default_us / self.tuned_us if self.tuned_us > 0 else float("nan")


@dataclass
class BucketPlan:
    """What tuning one bucket runs: its inputs, the two GEMMs' keys, defaults and candidates."""
    bucket: int
    inputs: List[InputSet]
    key1: ProblemKey
    key2: ProblemKey
    default1: Any
    default2: Any
    cands1: List[Any]
    cands2: List[Any]
    current: Optional[tuple] = None   # the layer's (config1, config2) before this run, if not
                                      # the defaults (a shipped table's, a loaded cache's)

    def compile_jobs(self, layer, tuner: Tuner) -> List[Callable[[], Any]]:
        """One layer call per candidate, for precompile: GEMM2's candidates are compiled beside
        GEMM1's default; a GEMM1 winner with a larger block_m changes the dispatch tile, and
        those few variants compile when first profiled. The current pair too."""
        inputs, default1, default2 = self.inputs[:1], self.default1, self.default2
        jobs = [lambda c=c: run_layer(layer, inputs, tuner, c, default2) for c in self.cands1]
        jobs += [lambda c=c: run_layer(layer, inputs, tuner, default1, c) for c in self.cands2]
        if self.current is not None:
            jobs.append(lambda: run_layer(layer, inputs, tuner, *self.current))
        return jobs


def plan_bucket(layer, shape: MoEShape, quant: str, bucket: int, tuner: Tuner, *,
                seed: int = 0, max_candidates: Optional[int] = None) -> BucketPlan:
    """The bucket's inputs, keys, defaults, candidates and current pair (what the layer's calls
    would launch before this run: this process's earlier result, a loaded cache's or a shipped
    table's entries); forgets what this process had tuned for its keys (a re-tune)."""
    from moe_ops.kernels.grouped_gemm import default_config, is_valid_config
    from moe_ops import tuning

    inputs = make_inputs(layer, shape, bucket, seed=seed + bucket)
    (key1, _), (key2, _) = bucket_keys(layer, shape, quant, inputs, bucket, tuner)
    defaults = (default_config(key1.problem()), default_config(key2.problem()))
    current = []
    for key, default in zip((key1, key2), defaults):
        tuner._resolved.pop(key, None)
        config = tuner.lookup(key)
        current.append(config if config is not None and is_valid_config(key.problem(), config)
                       else default)
        tuner.memory.pop(key, None)
        tuner.records.pop(key, None)
        tuner._resolved.pop(key, None)
    return BucketPlan(bucket, inputs, key1, key2, *defaults,
                      tuning.experts_candidates(key1.problem())[:max_candidates],
                      tuning.experts_candidates(key2.problem())[:max_candidates],
                      current=None if tuple(current) == defaults else tuple(current))


def tune_bucket(layer, shape: MoEShape, quant: str, bucket: int, tuner: Tuner, *,
                timer: Timer, seed: int = 0, compile_workers: Optional[int] = None,
                max_candidates: Optional[int] = None,
                progress: Optional[Callable[[str], None]] = None,
                deadline: Optional[float] = None,
                plan: Optional[BucketPlan] = None) -> BucketResult:
    """Tune one bucket (see the module docstring). deadline (time.perf_counter()): when the
    bucket should be done; GEMM1's candidates get the first 40% of the time left after
    compiling, GEMM2's up to 80%, the head to head the rest. Candidates a GEMM's share leaves
    unprofiled are skipped (its default is always timed). plan: from plan_bucket, its
    candidates already compiled (tune_model compiles every bucket's in one batch); without it
    the bucket plans and compiles its own."""
    from moe_ops.kernels.grouped_gemm import default_config

    # The layer's calls consult the process-wide tuner: force_config on another one would not
    # reach them, and every "candidate" would silently run the defaults.
    if tuner is not get_tuner():
        raise ValueError("tuner: must be the process-wide moe_ops.tuning.get_tuner(), which the "
                         "layer's calls consult")
    if not tuner.may_profile():
        raise RuntimeError("tune_bucket runs inside moe_ops.tuning.autotune(tuner=...), not "
                           "while capturing or compiling")

    start = time.perf_counter()
    compile_s = 0.0
    if plan is None:
        plan = plan_bucket(layer, shape, quant, bucket, tuner, seed=seed,
                           max_candidates=max_candidates)
        if deadline is None or time.perf_counter() < deadline:  # else only the defaults run
            jobs = plan.compile_jobs(layer, tuner)
            compile_s = precompile(jobs, compile_workers) if jobs and compiles(layer) else 0.0
    elif plan.bucket != bucket:
        raise ValueError(f"plan: made for bucket {plan.bucket}, not {bucket}")
    inputs, key1, key2 = plan.inputs, plan.key1, plan.key2
    default1, default2 = plan.default1, plan.default2
    # the runs time every input set: report (and store) the time of one layer call
    timer = _per_call(timer, len(inputs))

    # the plan's lists: what was compiled is what is profiled (each runner asks for its key's)
    experts_candidates = {key1.problem(): plan.cands1, key2.problem(): plan.cands2}.__getitem__

    def report(stage: str):
        if progress is None:
            return None
        return lambda done, total: progress(f"{stage} {done}/{total}")

    def share(fraction: float) -> Optional[float]:
        if deadline is None:
            return None
        now = time.perf_counter()
        return now + fraction * max(0.0, deadline - now)

    runner1 = LayerRunner(layer, inputs, tuner, 1, default2, experts_candidates, default_config)
    best1 = tuner.tune(key1, runner1, timer, progress=report("gemm1"), deadline=share(0.4))
    runner2 = LayerRunner(layer, inputs, tuner, 2, best1, experts_candidates, default_config)
    best2 = tuner.tune(key2, runner2, timer, progress=report("gemm2"),
                       deadline=share(2 / 3))  # to 80% of the bucket's time if GEMM1 took 40%
    record1, record2 = tuner.records[key1], tuner.records[key2]

    runs = [lambda: run_layer(layer, inputs, tuner, default1, default2),
            lambda: run_layer(layer, inputs, tuner, best1, best2)]
    current = plan.current if plan.current not in (None, (best1, best2)) else None
    same_as_current = plan.current is not None and current is None
    if current is not None:
        # (checked as every candidate is: against the defaults' output; a pair that fails to
        # run or differs has no say)
        try:
            if not outputs_match(run_layer(layer, inputs, tuner, *current),
                                 run_layer(layer, inputs, tuner, default1, default2)):
                current = None
        except Exception:
            current = None
    if current is not None:
        runs.append(lambda: run_layer(layer, inputs, tuner, *current))
    default_s, tuned_s, *current_s = head_to_head(timer, *runs)
    current_s = current_s[0] if current_s else (tuned_s if same_as_current else None)
    same = (best1, best2) == (default1, default2)
    kept = tuned_s < default_s and not same
    stored = None
    if same:
        # the defaults won every stage: the two timings are of the same configs (their gap is
        # run-to-run spread), so the tuned time is the default's
        tuned_s = default_s
    elif not kept:
        # not faster than the defaults head to head: store the defaults (a tuned table never
        # makes a bucket slower)
        best1, best2, tuned_s = default1, default2, default_s
        stored = default_s
    current_kept = (current is not None and current_s is not None
                    and current_s <= tuned_s * (1 + REPLACE_MARGIN))
    if current_kept:
        # the configs the layer had beat this run's pair head to head: they stay
        (best1, best2), tuned_s, kept = current, current_s, True
        stored = current_s
    if stored is not None:
        for key, config, record in ((key1, best1, record1), (key2, best2, record2)):
            tuner.memory[key] = config
            tuner._resolved.pop(key, None)
            record["config"] = dataclasses.asdict(config)
            record["us"] = stored * 1e6
    for record in (record1, record2):
        record["layer_default_us"] = default_s * 1e6
        record["layer_tuned_us"] = tuned_s * 1e6
        if current_s is not None:
            record["layer_current_us"] = current_s * 1e6
    return BucketResult(bucket, default_s * 1e6, tuned_s * 1e6, dataclasses.asdict(best1),
                        dataclasses.asdict(best2), kept,
                        record1["candidates"] + record2["candidates"],
                        record1["rejected"] + record2["rejected"], compile_s,
                        time.perf_counter() - start, record1["skipped"] + record2["skipped"],
                        None if current_s is None else current_s * 1e6, current_kept)


class Progress:
    """One status line on stderr, rewritten in place on a terminal, else one line per update."""

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream, self.done = total, label, stream, 0
        self.start = time.perf_counter()
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def update(self, detail: str = "", advance: int = 0) -> None:
        self.done += advance
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = (f"{self.label} [{bar}] {self.done}/{self.total} buckets "
                f"{time.perf_counter() - self.start:6.1f}s {detail}")
        if self.tty:
            self.stream.write("\r" + line.ljust(110))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()


def tune_model(shape: MoEShape, quant: str, *, buckets: Optional[Sequence[int]] = None,
               tuner: Optional[Tuner] = None, dtype: torch.dtype = torch.bfloat16,
               device: Optional[torch.device] = None, timer: Optional[Timer] = None,
               seed: int = 0, compile_workers: Optional[int] = None,
               max_candidates: Optional[int] = None, show_progress: bool = True,
               budget_s: Optional[float] = None) -> Dict[str, Any]:
    """Tune every bucket of one (layer shape, quant); the tuned entries stay in tuner.memory /
    tuner.records (save them with tuner.save or write_cache_file). Returns a report. The tuner
    must be the one the layer's calls consult (the process-wide get_tuner(), the default).

    budget_s: the profiling time allowed (PERFORMANCE.md: 60 s of GPU time a pair), counted
    from the end of the compile batch: every bucket's candidates are compiled first, in one
    batch on the host; then each bucket gets a share of the budget left when it starts
    (bucket_share), so time a bucket does not use goes to the next; within it the candidates
    past its share are skipped (the report counts them). None or <= 0: no limit."""
    tuner = get_tuner() if tuner is None else tuner
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    timer = default_timer() if timer is None else timer
    buckets = list(token_buckets(tuner.max_num_tokens) if buckets is None else buckets)
    start = time.perf_counter()
    layer = build_layer(shape, quant, dtype=dtype, device=device, seed=seed)
    setup_s = time.perf_counter() - start
    bar = Progress(len(buckets), f"{shape.name} {quant}") if show_progress else None
    results: List[BucketResult] = []
    deadline = None
    with autotune(tuner=tuner):
        plans = [plan_bucket(layer, shape, quant, bucket, tuner, seed=seed,
                             max_candidates=max_candidates) for bucket in buckets]
        if bar is not None:
            bar.update(f"compiling the candidates of {len(buckets)} buckets")
        jobs = [job for plan in plans for job in plan.compile_jobs(layer, tuner)]
        stats: Dict[str, int] = {}
        compile_s = precompile(jobs, compile_workers, stats) if jobs and compiles(layer) else 0.0
        del jobs  # they hold every bucket's inputs
        # The budget is GPU time (PERFORMANCE.md): it starts after the compile batch, which
        # runs on the host (a cold run compiled for 37-46 s of a 55 s budget on the H200's
        # host and profiled nothing; benchmarks/NOTES.md, twenty-first session).
        if budget_s is not None and budget_s > 0:
            deadline = time.perf_counter() + budget_s
        for index, plan in enumerate(plans):
            bucket = plan.bucket
            if bar is not None:
                bar.update(f"bucket {bucket}")
            show = (lambda detail, b=bucket: bar.update(f"bucket {b} {detail}")) if bar else None
            bucket_deadline = None
            if deadline is not None:
                now = time.perf_counter()
                bucket_deadline = now + bucket_share(now, deadline, len(plans) - index)
            results.append(tune_bucket(layer, shape, quant, bucket, tuner, timer=timer,
                                       seed=seed, compile_workers=compile_workers,
                                       max_candidates=max_candidates, progress=show,
                                       deadline=bucket_deadline, plan=plan))
            plan.inputs = []  # no longer needed
            if bar is not None:
                r = results[-1]
                bar.update(f"bucket {bucket}: {r.default_us:.1f} -> {r.tuned_us:.1f} us", advance=1)
    if bar is not None:
        bar.close()
    del layer
    return {
        "model": shape.name, "quant": quant, "dtype": str(dtype).replace("torch.", ""),
        "gpu": gpu_name(device), "setup_s": setup_s,
        "tuning_s": time.perf_counter() - start - setup_s,
        "compile_s": compile_s + sum(r.compile_s for r in results), "budget_s": budget_s,
        "compiled_kernels": stats.get("kernels"),
        "skipped": sum(r.skipped for r in results),
        "buckets": [dict(dataclasses.asdict(r), speedup=r.speedup) for r in results],
    }


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------

def shipped_path(gpu: str, model: str, quant: str, directory: Path = SHIPPED_DIR) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    return directory / f"{slug}__{model}__{quant}.json"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m moe_ops.tune",
        description="Tune the Triton fused-MoE kernels of one layer shape over all token buckets "
                    "and write the configs to a cache file (used by moe_ops.autotune(cache=...) "
                    "and moe_ops.tuning.load_cache) or to the package's shipped tables.")
    p.add_argument("--model", choices=sorted(MODELS), help="a known layer shape")
    p.add_argument("--quant", default=None,
                   help="quant mode (default: every mode the model is served in)")
    p.add_argument("--experts", type=int, help="custom shape: number of (local) experts")
    p.add_argument("--hidden", type=int, help="custom shape: hidden size H")
    p.add_argument("--intermediate", type=int, help="custom shape: intermediate size I")
    p.add_argument("--top-k", type=int, help="custom shape: experts per token")
    p.add_argument("--activation", default="swiglu", help="custom shape: activation")
    p.add_argument("--routing", default="renormalize", help="custom shape: routing method")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--max-tokens", type=int, default=None,
                   help="largest bucket (default tune_max_num_tokens = 8192)")
    p.add_argument("--buckets", default=None,
                   help="comma-separated token buckets to tune (default: all)")
    p.add_argument("--cache", default=None,
                   help=f"cache file to merge the results into (default {DEFAULT_CACHE}); its "
                        "entries, read first, are the current configs a re-tune must beat")
    p.add_argument("--ship", action="store_true",
                   help="write the package's shipped table for this GPU instead of --cache "
                        "(replaced whole; with --buckets, only those buckets' entries)")
    p.add_argument("--report", default=None,
                   help="also write a JSON report (per bucket: default vs tuned us, configs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-workers", type=int, default=None)
    p.add_argument("--max-candidates", type=int, default=None,
                   help="profile at most this many configs per GEMM (default: the whole short "
                        "list, 6 to 19 for the shapes of shapes.json)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="profiling (GPU) time allowed per quant mode, counted after the "
                        "candidates' compile: the candidates a bucket's share leaves are "
                        "skipped (default "
                        f"{DEFAULT_BUDGET_S:g}; 0 = no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    custom = (args.experts, args.hidden, args.intermediate, args.top_k)
    if args.model is None and None in custom:
        p.error("give --model, or --experts, --hidden, --intermediate and --top-k")
    if args.model is not None and any(v is not None for v in custom):
        p.error("--model and a custom shape (--experts ...) exclude each other")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.model is not None:
        shape = MODELS[args.model]
    else:
        shape = MoEShape("custom", args.experts, args.hidden, args.intermediate, args.top_k,
                         routing=args.routing, activation=args.activation,
                         quant=(args.quant or "none",))
    quants = [args.quant] if args.quant else list(shape.quant)
    from moe_ops.quant import QUANT_MODES
    for quant in quants:
        if quant not in QUANT_MODES:
            print(f"--quant: {quant!r} is not one of {QUANT_MODES}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        from moe_ops import kernels
        if not kernels.INTERPRET:
            print("moe_ops.tune needs a CUDA GPU (or TRITON_INTERPRET=1 for a functional run "
                  "on CPU)", file=sys.stderr)
            return 2
    dtype = getattr(torch, args.dtype)
    tuner = get_tuner()
    if args.max_tokens is not None:
        tuner.max_num_tokens = args.max_tokens
    if not args.ship and Path(args.cache or DEFAULT_CACHE).exists():
        # its entries are the current pairs this run's must beat (the shipped tables' are
        # looked up anyway)
        tuner.load(Path(args.cache or DEFAULT_CACHE))
    buckets = None
    if args.buckets is not None:
        # Only the buckets themselves: another count would be profiled at that count but stored
        # under the bucket it rounds up to (bucket_of), overwriting or misrepresenting it.
        valid = token_buckets(tuner.max_num_tokens)
        try:
            buckets = [int(b) for b in args.buckets.split(",")]
        except ValueError:
            buckets = []
        if not buckets or any(b not in valid for b in buckets):
            print(f"--buckets: {args.buckets!r}; each must be one of {valid}", file=sys.stderr)
            return 2
    reports = []
    for quant in quants:
        tuner.records.clear()
        tuner.memory.clear()
        report = tune_model(shape, quant, buckets=buckets, tuner=tuner, dtype=dtype,
                            seed=args.seed, compile_workers=args.compile_workers,
                            max_candidates=args.max_candidates, show_progress=not args.quiet,
                            budget_s=args.budget_s)
        if args.ship:
            path = shipped_path(report["gpu"], shape.name, quant)
            if path.exists() and buckets is None:
                path.unlink()  # a shipped table is replaced whole, not merged ...
            # ... unless --buckets names some: theirs are replaced, the other buckets kept
        else:
            path = Path(args.cache or DEFAULT_CACHE)
        tuner.save(path)
        if args.ship:
            Path(f"{path}.lock").unlink(missing_ok=True)  # the writers' lock is not package data
        report["written_to"] = str(path)
        reports.append(report)
        print(format_report(report))
    if args.report:
        payload = {"command": "python -m moe_ops.tune " + " ".join(
                       sys.argv[1:] if argv is None else argv),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "torch": torch.__version__, "reports": reports}
        try:
            import triton
            payload["triton"] = triton.__version__
        except ImportError:
            pass
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(payload, indent=1))
    return 0


def format_report(report: Dict[str, Any]) -> str:
    lines = [f"{report['model']} {report['quant']} on {report['gpu']}: tuned "
             f"{len(report['buckets'])} buckets in {report['tuning_s']:.1f} s "
             f"(compiling {report['compile_s']:.1f} s"
             f"{' (%d kernels)' % report['compiled_kernels'] if report.get('compiled_kernels') else ''}"
             f", setup {report['setup_s']:.1f} s"
             f"{', %d candidates skipped for the budget' % report['skipped'] if report.get('skipped') else ''}) "
             f"-> {report.get('written_to', '')}",
             f"{'bucket':>7} {'default us':>11} {'tuned us':>10} {'speedup':>8}  gemm1 / gemm2"
             "  (P: persistent kernel; 'current kept': the layer's configs before the run "
             "won the head to head)"]
    for b in report["buckets"]:
        c1, c2 = b["gemm1"], b["gemm2"]
        short = lambda c: (f"{c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']} "
                           f"s{c['num_stages']}{' swap' if c['swap_ab'] else ''}"
                           f"{' split%d' % c['split_k'] if c.get('split_k', 1) > 1 else ''}"
                           f"{' P' if c.get('persistent') else ''}")
        note = ""
        if b.get("current_us") is not None:
            note = (f"  current {b['current_us']:.1f} us"
                    f"{', current kept' if b.get('current_kept') else ''}")
        lines.append(f"{b['bucket']:>7} {b['default_us']:>11.1f} {b['tuned_us']:>10.1f} "
                     f"{b['speedup']:>7.2f}x  {short(c1)} / {short(c2)}{note}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
