"""Benchmark of moe_ops.FusedMoE against its floors and the torch baseline (PERFORMANCE.md).

    python benchmarks/bench.py                      # every model of shapes.json, its listed quant modes
    python benchmarks/bench.py --models qwen3_30b_a3b mixtral_8x7b deepseek_v3 \\
        --quant none fp8 fp8_block --tokens 1 16 64 256 1024 4096 16384 \\
        --out benchmarks/results/h200.json --plot benchmarks/results/h200.png
    python benchmarks/bench.py --quick              # smoke run: two models, four token counts

For each (model, quant, T) it times the whole layer (routing to output) replayed from a CUDA
graph and eagerly, times the peers in the same run (--peers: the torch baseline of
benchmarks/baseline.py, and transformers' own "grouped_mm" / "batched_mm" experts
implementations, see benchmarks/hf_peers.py; each eagerly and as CUDA-graph replays), and
reports the larger of the two floors (bytes of the experts actually hit / 4.55 TB/s; flops /
the matmul ceiling of the dtype doing the math) over the measured time. Once per (model, quant)
it checks the layer against backend="reference" (and the baseline against the same) at a small T.

Quant modes: without --quant each model runs the modes shapes.json lists for it; with --quant
every model runs every mode given (--listed-only keeps only those shapes.json lists). Modes the
backend cannot run (probed with a tiny layer, not assumed) are skipped with a note in the output.
The 4-bit modes (nvfp4 on deepseek_v3, mxfp4 on gpt_oss_120b) are also timed against our own bf16
path on the same weights dequantized to bf16 ("bf16-g us", "x bf16"; --no-bf16-peer skips it).

Timing: S rotating input sets (hidden states + router logits, random normal: never zeros); a
sample is S back-to-back calls (eager) or one replay of a CUDA graph holding those S calls;
per-call time = sample time / S; the median over samples is reported. Samples per measurement
are capped by --budget-ms. The weights of the experts hit exceed the 50 MB L2 for every shape.

Writes JSON (records + metadata) and a PNG (fraction of floor vs T); prints a table last;
progress goes to stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)



import torch  # noqa: E402

import moe_ops  # noqa: E402
from moe_ops.models import MoEShape  # noqa: E402
from moe_ops import synthetic  # noqa: E402
from moe_ops.quant import FP8_BLOCK  # noqa: E402
from moe_ops.synthetic import expert_chunks, generator  # noqa: E402
from baseline import BaselineWeights, TorchBaseline, probe_capabilities  # noqa: E402
import hf_peers  # noqa: E402  (imports transformers only when peers are built)

DEFAULT_SHAPES = BENCH_DIR / "shapes.json"
# Random weights in the served formats come from moe_ops.synthetic (shared with the tuner).
BF16_MATH_QUANTS = ("none", "nvfp4", "mxfp4")  # W4A16: the math is bf16


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------
# A layer shape of shapes.json (the package's own table of known models, moe_ops.models).
ModelConfig = MoEShape


@dataclass
class Shapes:
    models: dict[str, ModelConfig]
    tokens: list[int]
    ceilings: dict[str, float]


def load_shapes(path: Path | str = DEFAULT_SHAPES) -> Shapes:
    data = json.loads(Path(path).read_text())
    models = {name: ModelConfig.from_json(name, entry) for name, entry in data["models"].items()}
    return Shapes(models, [int(t) for t in data["tokens"]], dict(data["ceilings_h200"]))


# ---------------------------------------------------------------------------------------------
# Floors
# ---------------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expert_weight_bytes(cfg: ModelConfig, quant: str, dtype_bytes: int = 2) -> int:
    """Bytes one expert's weights and scales take in the quant format (checkpoint-minimal:
    fp8 per-tensor scales count 4 bytes per matrix, not the per-row copy a kernel may keep)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    matrices = 3 if cfg.gated else 2
    elements = cfg.n13 * h + h * i
    if quant == "none":
        total = elements * dtype_bytes
    elif quant == "fp8":
        total = elements + 4 * matrices
    elif quant == "fp8_block":
        total = elements + 4 * matrices * _cdiv(i, FP8_BLOCK) * _cdiv(h, FP8_BLOCK)
    elif quant == "nvfp4":
        total = elements // 2 + elements // 16 + 4 * matrices
    elif quant == "mxfp4":
        total = elements // 2 + elements // 32
    else:
        raise ValueError(f"quant: unknown {quant!r}")
    if cfg.bias:
        total += 4 * (cfg.n13 + h)  # float32 biases, as the layer reads them
    return total


def layer_flops(cfg: ModelConfig, tokens: int) -> int:
    """2 * T * k * (H * 2I + I * H) for gated activations, 2 * T * k * (H * I + I * H) for relu2."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return 2 * tokens * cfg.top_k * (h * cfg.n13 + i * h)


def matmul_ceiling(quant: str, ceilings: dict[str, float]) -> float:
    """FLOP/s of the dtype that does the math: bf16 for none and the W4A16 modes, else fp8."""
    key = "bf16_TFLOPs" if quant in BF16_MATH_QUANTS else "fp8_TFLOPs"
    return float(ceilings[key]) * 1e12


def compute_floors(cfg: ModelConfig, quant: str, tokens: int, distinct_experts: float,
                   ceilings: dict[str, float], *, dtype_bytes: int = 2,
                   logits_bytes: int = 4) -> dict[str, Any]:
    """The two floors of PERFORMANCE.md for one point.

    bytes = weights (and scales) of the distinct experts hit + activations in (hidden states,
    router logits) and out; time = bytes / the streaming-read ceiling. flops / matmul ceiling.
    """
    weight_bytes = distinct_experts * expert_weight_bytes(cfg, quant, dtype_bytes)
    activation_bytes = tokens * (2 * cfg.hidden_size * dtype_bytes + cfg.num_experts * logits_bytes)
    total_bytes = weight_bytes + activation_bytes
    flops = layer_flops(cfg, tokens)
    byte_floor_s = total_bytes / (float(ceilings["read_TBps"]) * 1e12)
    flop_floor_s = flops / matmul_ceiling(quant, ceilings)
    return dict(distinct_experts=distinct_experts, weight_bytes=weight_bytes,
                activation_bytes=activation_bytes, bytes=total_bytes, flops=flops,
                byte_floor_us=byte_floor_s * 1e6, flop_floor_us=flop_floor_s * 1e6,
                floor_us=max(byte_floor_s, flop_floor_s) * 1e6,
                bound="bytes" if byte_floor_s >= flop_floor_s else "flops")


def rate_metrics(floors: dict[str, Any], time_us: Optional[float]) -> dict[str, Optional[float]]:
    """fraction of the floor (larger floor / measured), TB/s of needed bytes, TFLOP/s."""
    if time_us is None or not time_us > 0:
        return dict(fraction=None, tbps=None, tflops=None)
    seconds = time_us * 1e-6
    return dict(fraction=floors["floor_us"] / time_us, tbps=floors["bytes"] / seconds / 1e12,
                tflops=floors["flops"] / seconds / 1e12)


# ---------------------------------------------------------------------------------------------
# Random weights, generated in the quantized format directly (chunked: no full-size bf16 copy)
# ---------------------------------------------------------------------------------------------
@dataclass
class LayerWeights:
    checkpoint: dict[str, torch.Tensor]  # the keywords of FusedMoE.load_weights
    routing_bias: Optional[torch.Tensor]  # [num_experts] for deepseek_v3
    baseline: Optional[BaselineWeights]


_generator, _chunks = generator, expert_chunks  # local names


def _dequantize_fp4_chunked(packed: torch.Tensor, scale: torch.Tensor, quant: str,
                            row_scale: Optional[torch.Tensor], dtype: torch.dtype,
                            chunk_elements: int, kernel_order_k: Optional[int] = None) -> torch.Tensor:
    """Packed e2m1 [E, N, K/2] + block scales (+ nvfp4's global scale per row [E, N]) -> dtype.
    With `kernel_order_k` = K: the packed rows are the kernel layout's (quant.py's kernel order,
    padded), the scales padded the same way."""
    from moe_ops import quant as q

    e, n, half_k = packed.shape
    k = kernel_order_k if kernel_order_k is not None else 2 * half_k
    out = torch.empty(e, n, k, dtype=dtype, device=packed.device)
    for start, end in _chunks(e, n * k, max(1, chunk_elements // 8)):
        rows = None if row_scale is None else row_scale[start:end]
        part, part_scale = packed[start:end], scale[start:end]
        if kernel_order_k is not None:
            part = q.fp4_from_kernel_order(part, k)
            part_scale = part_scale[..., :k // q.fp4_scale_block(quant)]
        out[start:end] = q.dequantize_fp4(part, part_scale, quant, rows).to(dtype)
    return out


def make_weights(cfg: ModelConfig, quant: str, *, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 num_local_experts: Optional[int] = None, prequantized: bool = True,
                 with_baseline: bool = True, chunk_elements: int = 1 << 28) -> LayerWeights:
    """Random weights for `num_local_experts` experts (default all), never zeros.

    High-precision values are N(0, 1/fan_in). With `prequantized` the fp8/fp4 modes are drawn
    in their format directly (values + random scales whose dequantized values have that same
    spread), which `load_weights` takes bit for bit; otherwise bf16 weights are drawn and the
    layer quantizes them on load. `with_baseline` also returns the checkpoint-order weights the
    torch baseline reads (sharing storage with the checkpoint tensors where it can).
    """
    device = torch.device(device)
    e = num_local_experts or cfg.num_experts
    h, i = cfg.hidden_size, cfg.intermediate_size
    drawn = quant if prequantized else "none"
    w = synthetic.random_weights(e, h, i, quant=drawn, gated=cfg.gated, bias=cfg.bias,
                                 dtype=dtype, device=device, seed=seed,
                                 chunk_elements=chunk_elements)
    # The checkpoint's w1 / w3 are views of the stacked tensors, which the baseline reads.
    ckpt = synthetic.checkpoint_views(w, cfg.gated)
    base: dict[str, Optional[torch.Tensor]] = dict(w13=None, w13_scale=None, w2_scale=None,
                                                   b13=w.get("b13"), b2=w.get("b2"))
    if drawn == "none":
        if quant == "none":
            base.update(w13=w["w13"], w2=w["w2"])
        elif with_baseline:
            base.update(_baseline_from_high_precision(w["w13"], w["w2"], quant, cfg, dtype))
    elif quant == "fp8":
        base.update(w13=w["w13"], w2=w["w2"],
                    w13_scale=w["w13_scale"].repeat_interleave(i, dim=1),
                    w2_scale=w["w2_scale"][:, None].expand(e, h).contiguous())
    elif quant == "fp8_block":
        # Rowwise stand-in for the baseline: the mean block scale along K, per row.
        def rows(scale: torch.Tensor, n: int) -> torch.Tensor:
            return scale.mean(dim=-1).repeat_interleave(FP8_BLOCK, dim=1)[:, :n]
        parts13 = w["w13_scale"].split(_cdiv(i, FP8_BLOCK), dim=1)
        base.update(w13=w["w13"], w2=w["w2"],
                    w13_scale=torch.cat([rows(s13, i) for s13 in parts13], dim=1).contiguous(),
                    w2_scale=rows(w["w2_scale"], h).contiguous())
    elif with_baseline:  # nvfp4 / mxfp4: the baseline reads the dequantized weights
        rows13 = rows2 = None
        if quant == "nvfp4":
            rows13 = w["w13_global_scale"].repeat_interleave(i, dim=1)
            rows2 = w["w2_global_scale"][:, None].expand(e, h)
        base.update(w13=_dequantize_fp4_chunked(w["w13"], w["w13_scale"], quant, rows13, dtype,
                                                chunk_elements),
                    w2=_dequantize_fp4_chunked(w["w2"], w["w2_scale"], quant, rows2, dtype,
                                               chunk_elements))
    routing_bias = None
    if cfg.routing == "deepseek_v3":
        routing_bias = synthetic.routing_bias(cfg.num_experts, device=device, seed=seed + 7)
    baseline = BaselineWeights(**base) if with_baseline and base["w13"] is not None else None
    return LayerWeights(ckpt, routing_bias, baseline)


def _baseline_from_high_precision(w13: torch.Tensor, w2: torch.Tensor, quant: str,
                                  cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Baseline weights for a layer that quantizes bf16 weights on load (small layers only)."""
    from moe_ops import quant as q

    i = cfg.intermediate_size
    parts = [w13[:, :i], w13[:, i:]] if cfg.gated else [w13]
    if quant == "fp8":
        quantized = [q.quantize_fp8_per_tensor(p) for p in parts]
        v2, s2 = q.quantize_fp8_per_tensor(w2)
        return dict(w13=torch.cat([v for v, _ in quantized], 1),
                    w13_scale=torch.cat([s[:, None].expand(-1, p.shape[1]) for (_, s), p in zip(quantized, parts)], 1).contiguous(),
                    w2=v2, w2_scale=s2[:, None].expand(-1, w2.shape[1]).contiguous())
    if quant == "fp8_block":
        quantized = [q.quantize_fp8_block(p) for p in parts]
        v2, s2 = q.quantize_fp8_block(w2)
        rows = [s.mean(-1).repeat_interleave(FP8_BLOCK, 1)[:, :p.shape[1]] for (_, s), p in zip(quantized, parts)]
        return dict(w13=torch.cat([v for v, _ in quantized], 1), w13_scale=torch.cat(rows, 1).contiguous(),
                    w2=v2, w2_scale=s2.mean(-1).repeat_interleave(FP8_BLOCK, 1)[:, :w2.shape[1]].contiguous())
    # 4-bit: the baseline reads the high-precision weights (W4A16 has no torch grouped kernel).
    return dict(w13=w13.to(dtype), w2=w2.to(dtype))


def build_layer(cfg: ModelConfig, quant: str, *, backend: str, device: torch.device | str,
                dtype: torch.dtype = torch.bfloat16, seed: int = 0, prequantized: bool = True,
                with_baseline: bool = True, local_expert_offset: int = 0,
                num_local_experts: Optional[int] = None,
                baseline_impl: str = "auto") -> tuple[moe_ops.FusedMoE, Optional[TorchBaseline]]:
    """A FusedMoE with random weights loaded (and the baseline over the same weights)."""
    layer = moe_ops.FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k,
                             **cfg.layer_kwargs(), quant=quant, dtype=dtype, device=device,
                             backend=backend, local_expert_offset=local_expert_offset,
                             num_local_experts=num_local_experts)
    weights = make_weights(cfg, quant, device=device, dtype=dtype, seed=seed,
                           num_local_experts=num_local_experts, prequantized=prequantized,
                           with_baseline=with_baseline and local_expert_offset == 0
                           and num_local_experts in (None, cfg.num_experts))
    extra = {} if weights.routing_bias is None else {"routing_bias": weights.routing_bias}
    layer.load_weights(**weights.checkpoint, **extra)
    baseline = None
    if weights.baseline is not None:
        baseline = TorchBaseline(weights.baseline, top_k=cfg.top_k, routing=cfg.routing,
                                 routing_bias=weights.routing_bias, n_group=cfg.n_group,
                                 topk_group=cfg.topk_group,
                                 routed_scaling_factor=cfg.routed_scaling_factor,
                                 activation=cfg.activation, impl=baseline_impl)
    del weights
    return layer, baseline


def reference_forward(layer: moe_ops.FusedMoE, hidden_states: torch.Tensor,
                      router_logits: Optional[torch.Tensor] = None, *,
                      topk_ids: Optional[torch.Tensor] = None,
                      topk_weights: Optional[torch.Tensor] = None,
                      backend: str = "reference") -> torch.Tensor:
    """The same layer (same kernel-layout tensors, no copy) run on another backend."""
    common = dict(activation=layer.activation, quant=layer.quant, swiglu_alpha=layer.swiglu_alpha,
                  swiglu_limit=layer.swiglu_limit, local_expert_offset=layer.local_expert_offset,
                  backend=backend)
    if router_logits is None:
        return moe_ops.fused_moe(hidden_states, topk_ids=topk_ids, topk_weights=topk_weights,
                                 **layer.kernel_weights(), **common)
    return moe_ops.fused_moe(hidden_states, router_logits, **layer.kernel_weights(),
                             top_k=layer.top_k, routing=layer.routing,
                             routing_bias=layer.routing_bias, n_group=layer.n_group,
                             topk_group=layer.topk_group,
                             routed_scaling_factor=layer.routed_scaling_factor, **common)


def route_ids(layer: moe_ops.FusedMoE, router_logits: torch.Tensor) -> torch.Tensor:
    ids, _ = moe_ops.route(router_logits, layer.top_k, routing=layer.routing,
                           routing_bias=layer.routing_bias, n_group=layer.n_group,
                           topk_group=layer.topk_group,
                           routed_scaling_factor=layer.routed_scaling_factor, backend="reference")
    return ids


def case_layer(shapes: Shapes, case: str,
               device: str = "cuda") -> tuple[str, int, moe_ops.FusedMoE]:
    """A "model:quant:T" case of the developer scripts -> (quant, T, its layer on the Triton
    backend with random weights, no baseline)."""
    name, quant, tokens = case.split(":")
    layer, _ = build_layer(shapes.models[name], quant, backend="triton", device=device,
                           with_baseline=False)
    return quant, int(tokens), layer


def case_experts_call(shapes: Shapes, case: str) -> tuple[str, moe_ops.FusedMoE, Callable]:
    """A "model:quant:T" case of the developer scripts -> (quant, layer, call): call(**kwargs)
    runs the layer's experts stage (kernels.experts.triton_experts, looked up at each call so a
    script's patches of that module apply) on one routed batch of T tokens (routed_inputs),
    kwargs going to triton_experts (gemm1_config, gemm2_config, ...)."""
    from moe_ops.kernels import experts
    quant, tokens, layer = case_layer(shapes, case)
    x, ids, weights = routed_inputs(layer, tokens)
    kw = layer.kernel_weights()

    def call(**kwargs):
        return experts.triton_experts(
            x, ids, weights, kw["w13"], kw["w2"], kw.get("w13_scale"), kw.get("w2_scale"),
            activation=layer.activation, quant=quant, **kwargs)
    return quant, layer, call


def routed_inputs(layer: moe_ops.FusedMoE, tokens: int,
                  generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, ...]:
    """Random (x [T, H] bf16, topk_ids, topk_weights in [0, 1)) for the layer's experts call on
    its device: ids routed from random logits by the layer's own routing."""
    device = layer.w13.device
    x = torch.randn(tokens, layer.hidden_size, device=device, dtype=torch.bfloat16,
                    generator=generator)
    logits = torch.randn(tokens, layer.num_experts, device=device, generator=generator)
    ids = route_ids(layer, logits)
    return x, ids, torch.rand(ids.shape, device=device, generator=generator)


def count_local_experts_hit(ids: torch.Tensor, local_expert_offset: int, num_local: int) -> int:
    local = ids.reshape(-1).long() - local_expert_offset
    local = local[(local >= 0) & (local < num_local)]
    return int(torch.unique(local).numel())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_F / ||expected||_F in float64 (NaN if anything is not finite)."""
    a, b = actual.double(), expected.double()
    if not bool(torch.isfinite(a).all()):
        return float("nan")
    denominator = b.norm().item()
    difference = (a - b).norm().item()
    return difference / denominator if denominator > 0 else difference


def check_and_time(run: Callable[[], None], out: torch.Tensor, expected: torch.Tensor, *,
                   warmup: int = 10, rep: int = 100) -> dict[str, Any]:
    """A kernel harness's variant (the dev_*.py scripts): `run` writes `out`, which is poisoned
    with NaN first; once run, compared with `expected` (rel_err; unwritten: a NaN left), then
    timed by triton.testing.do_bench (ms, median)."""
    from triton.testing import do_bench
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    got = out.float()
    result = dict(rel_err=relative_error(got, expected),
                  unwritten=bool(torch.isnan(got).any()))
    del got
    result["ms"] = do_bench(run, warmup=warmup, rep=rep)
    return result


def print_variant_table(rows: list[dict[str, Any]], names: list[tuple[str, str]],
                        figures: list[tuple[str, str]]) -> None:
    """The dev harnesses' closing table, one line a record: `names` [(key, format)] name the
    variant, `figures` [(key, format)] its results, then rel_err; a failed variant shows its
    error, an output with a NaN left is flagged UNWRITTEN."""
    def cells(r, columns):
        return " ".join(format(r[key], spec) for key, spec in columns)
    # headers: a name column's own format, a figure's width right-aligned
    print(cells({key: key for key, _ in names}, names),
          " ".join(f"{key:>{spec.split('.')[0]}}" for key, spec in figures), f"{'rel_err':>9}")
    for r in rows:
        if "error" in r:
            print(cells(r, names), "ERROR", r["error"][:90])
        else:
            print(cells(r, names), cells(r, figures), f"{r['rel_err']:9.2e}",
                  "UNWRITTEN" if r["unwritten"] else "")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def measure(run_sample: Callable[[], None], calls_per_sample: int, budget_s: float, *,
            device: torch.device, min_samples: int = 3, max_samples: int = 500) -> dict[str, Any]:
    """Median per-call time of `run_sample` (which issues `calls_per_sample` calls).

    Warm-up, then one timed sample to size the loop so it takes about `budget_s`; samples are
    enqueued back to back and timed with CUDA events (wall clock on CPU).
    """
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run_sample()
    sync()
    start = time.perf_counter()
    run_sample()
    sync()
    estimate = time.perf_counter() - start
    samples = int(min(max_samples, max(min_samples, budget_s / max(estimate, 1e-7))))
    times_ms: list[float] = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(samples)]
        for begin, end in events:
            begin.record()
            run_sample()
            end.record()
        torch.cuda.synchronize()
        times_ms = [begin.elapsed_time(end) for begin, end in events]
    else:
        for _ in range(samples):
            begin = time.perf_counter()
            run_sample()
            times_ms.append((time.perf_counter() - begin) * 1e3)
    per_call_us = sorted(t * 1e3 / calls_per_sample for t in times_ms)
    return dict(median_us=statistics.median(per_call_us), min_us=per_call_us[0],
                max_us=per_call_us[-1], samples=samples, calls_per_sample=calls_per_sample)


def capture_graph(calls: Callable[[], Any], device: torch.device) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `calls()` (after a warm-up on a side stream, as torch recommends)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = calls()
    torch.cuda.synchronize(device)
    return graph, result


def time_graphs_alternated(graphs: dict[str, Any], rounds: int, budget_s: float,
                           device: torch.device, replays: int = 20) -> dict[str, list[float]]:
    """Median us a replay of each captured graph, `rounds` times with the arms alternated
    (each round times every arm once, so a drift of the GPU's clocks spreads over all)."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(measure(lambda g=graph: [g.replay() for _ in range(replays)],
                                       replays, budget_s, device=device)["median_us"])
    return times


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


# ---------------------------------------------------------------------------------------------
# One (model, quant): check, then the sweep over T
# ---------------------------------------------------------------------------------------------
@dataclass
class RunState:
    args: argparse.Namespace
    shapes: Shapes
    device: torch.device
    started: float
    records: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    baseline_graph_broken: Optional[str] = None
    peer_graph_broken: dict[str, str] = field(default_factory=dict)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_deadline(self) -> bool:
        return self.args.deadline_s is not None and self.elapsed() > self.args.deadline_s


def make_inputs(cfg: ModelConfig, tokens: int, sets: int, device: torch.device,
                dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = _generator(device, seed)
    return [(torch.empty(tokens, cfg.hidden_size, dtype=dtype, device=device).normal_(generator=gen),
             torch.empty(tokens, cfg.num_experts, dtype=torch.float32, device=device).normal_(generator=gen))
            for _ in range(sets)]


def check_config(state: RunState, cfg: ModelConfig, quant: str, layer: moe_ops.FusedMoE,
                 baseline: Optional[TorchBaseline]) -> dict[str, Any]:
    """Ours and the baseline against backend='reference' of the same layer, at one small T."""
    tokens = state.args.check_tokens
    x, logits = make_inputs(cfg, tokens, 1, state.device, layer.dtype, state.args.seed + 7)[0]
    result: dict[str, Any] = dict(model=cfg.name, quant=quant, tokens=tokens, backend=layer.backend)
    expected = reference_forward(layer, x, logits)
    try:
        result["err_ours"] = relative_error(layer(x, logits), expected)
    except Exception as exc:  # noqa: BLE001 - a failing backend is a result, not a crash
        result["err_ours"], result["error_ours"] = None, _short(exc)
    result["tolerance"] = ours_tolerance(quant, state.args)
    result["ok_ours"] = result["err_ours"] is not None and result["err_ours"] <= result["tolerance"]
    if baseline is not None:
        tolerance = baseline_tolerance(quant, state.args.tolerance)
        result["baseline_tolerance"] = tolerance
        try:
            result["err_baseline"] = relative_error(baseline(x, logits), expected)
        except Exception as exc:  # noqa: BLE001
            result["err_baseline"], result["error_baseline"] = None, _short(exc)
        if tolerance is not None:
            result["ok_baseline"] = (result["err_baseline"] is not None
                                     and result["err_baseline"] <= tolerance)
        else:
            result["ok_baseline"] = None
            result["baseline_note"] = ("informational: the baseline computes a different "
                                       "quantization (rowwise fp8 or bf16 weights) by design")
    return result


def ours_tolerance(quant: str, args: argparse.Namespace) -> float:
    """Max relative Frobenius error of the backend vs the reference: --tolerance for bf16
    math, --fp8-tolerance for the fp8 modes; both default to SPEC's 1e-2.

    The fp8 modes requantize the intermediate between the GEMMs, so a difference in how the two
    sides quantize moves whole e4m3 steps (6-12%). Both sides store the intermediate in the
    layer dtype and quantize by (x*448)/amax, so such flips are rare; the separate flag exists
    to study them. Stale or garbage rows are caught by gpu_check.py's per-row check."""
    return args.tolerance if quant in BF16_MATH_QUANTS else args.fp8_tolerance


# The fp8 baseline rounds GEMM1's output to bf16 (the only output dtype of
# torch._scaled_grouped_mm) and runs silu * up in bf16 before requantizing, where the reference
# keeps float32 until the intermediate is stored: about 1 element in 10 of the fp8 intermediate
# then lands one e4m3 step away, which is ~2% of relative error (measured 1.5-2.0e-2 on
# qwen-sized experts), not a bug. bf16 (none) matches to ~5e-3.
BASELINE_FP8_TOLERANCE = 5e-2


def baseline_tolerance(quant: str, tolerance: float) -> Optional[float]:
    """Max error of the baseline vs the reference, None where it differs by design."""
    if quant == "none":
        return tolerance
    if quant == "fp8":
        return max(tolerance, BASELINE_FP8_TOLERANCE)
    return None


def default_input_sets(tokens: int) -> int:
    """Rotating input sets a point times by default (--input-sets unset): 8 up to 1024 tokens,
    4 above (their activations stay within a few hundred MB)."""
    return 8 if tokens <= 1024 else 4


def bench_point(state: RunState, cfg: ModelConfig, quant: str, tokens: int,
                layer: moe_ops.FusedMoE, baseline: Optional[TorchBaseline],
                peers: tuple = (), bf16_layer: Optional[moe_ops.FusedMoE] = None) -> dict[str, Any]:
    args, device = state.args, state.device
    sets = args.input_sets or default_input_sets(tokens)
    inputs = make_inputs(cfg, tokens, sets, device, layer.dtype, args.seed + tokens)
    distinct = [count_local_experts_hit(route_ids(layer, logits), 0, cfg.num_experts)
                for _, logits in inputs]
    floors = compute_floors(cfg, quant, tokens, statistics.mean(distinct), state.shapes.ceilings,
                            dtype_bytes=torch.finfo(layer.dtype).bits // 8)
    record: dict[str, Any] = dict(model=cfg.name, quant=quant, tokens=tokens,
                                  backend=layer.backend, input_sets=sets,
                                  distinct_experts_min=min(distinct),
                                  distinct_experts_max=max(distinct), **floors, errors={})
    budget = args.budget_ms / 1e3

    def run_ours() -> Any:
        out = None
        for x, logits in inputs:
            out = layer(x, logits)
        return out

    def run_baseline() -> Any:
        out = None
        for x, logits in inputs:
            out = baseline(x, logits)
        return out

    timings: dict[str, Optional[dict[str, Any]]] = {}

    def timed(name: str, fn: Callable[[], None]) -> None:
        try:
            timings[name] = measure(fn, sets, budget, device=device)
        except Exception as exc:  # noqa: BLE001
            timings[name] = None
            record["errors"][name] = _short(exc)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def timed_graph(name: str, calls: Callable[[], Any]) -> Optional[torch.Tensor]:
        if device.type != "cuda":
            timings[name] = None
            record["errors"][name] = "no CUDA graphs on this device"
            return None
        try:
            graph, last = capture_graph(calls, device)
        except Exception as exc:  # noqa: BLE001
            timings[name] = None
            record["errors"][name] = "capture failed: " + _short(exc)
            torch.cuda.synchronize(device)
            return None
        try:
            timings[name] = measure(graph.replay, sets, budget, device=device)
        except Exception as exc:  # noqa: BLE001
            timings[name] = None
            record["errors"][name] = _short(exc)
        finally:
            del graph
        return last

    timed("ours_eager", run_ours)
    graph_last = timed_graph("ours_graph", run_ours)
    if graph_last is not None:
        # Replays must match eager (SPEC §7): the last call of the last replay vs an eager call.
        try:
            record["graph_vs_eager_err"] = relative_error(graph_last, layer(*inputs[-1]))
        except Exception as exc:  # noqa: BLE001
            record["errors"]["graph_vs_eager"] = _short(exc)
    del graph_last
    if baseline is not None and not args.no_baseline:
        timed("baseline", run_baseline)
        if args.no_baseline_graph or not baseline.graph_safe:
            record["errors"]["baseline_graph"] = ("skipped: --no-baseline-graph" if args.no_baseline_graph
                                                  else "skipped: the loop fallback syncs")
        elif state.baseline_graph_broken:
            record["errors"]["baseline_graph"] = "skipped: " + state.baseline_graph_broken
        else:
            timed_graph("baseline_graph", run_baseline)
            error = record["errors"].get("baseline_graph", "")
            if error.startswith("capture failed"):
                state.baseline_graph_broken = "an earlier capture failed (" + error + ")"
    peer_series = time_peers(state, record, peers, inputs, tokens, cfg.top_k, timed, timed_graph)
    bf16_series = ()
    if bf16_layer is not None:
        # 4-bit modes: our own bf16 path on the dequantized weights, the bar 4-bit must beat.
        def run_bf16() -> Any:
            out = None
            for x, logits in inputs:
                out = bf16_layer(x, logits)
            return out

        timed("ours_bf16", run_bf16)
        timed_graph("ours_bf16_graph", run_bf16)
        bf16_series = ("ours_bf16", "ours_bf16_graph")
    for name in ("ours_graph", "ours_eager", "baseline", "baseline_graph") + peer_series + bf16_series:
        timing = timings.get(name)
        record[f"{name}_us"] = None if timing is None else timing["median_us"]
        record[f"{name}_timing"] = timing
        metrics = rate_metrics(floors, record[f"{name}_us"])
        record[f"fraction_{name}"] = metrics["fraction"]
        record[f"tbps_{name}"] = metrics["tbps"]
        record[f"tflops_{name}"] = metrics["tflops"]
    # The headline numbers: graph replay, else eager.
    headline = "ours_graph" if record["ours_graph_us"] is not None else "ours_eager"
    record["headline"] = headline
    record["fraction"] = record[f"fraction_{headline}"]
    record["tbps"] = record[f"tbps_{headline}"]
    record["tflops"] = record[f"tflops_{headline}"]
    if record["baseline_us"] and record[f"{headline}_us"]:
        record["speedup_vs_baseline"] = record["baseline_us"] / record[f"{headline}_us"]
    for peer in peers:  # like for like: graph against graph, eager against eager
        theirs = record.get(f"{peer.name}_graph_us" if headline == "ours_graph" else f"{peer.name}_us")
        if theirs and record[f"{headline}_us"]:
            record[f"speedup_vs_{peer.name}"] = theirs / record[f"{headline}_us"]
    if bf16_series:
        theirs = record.get("ours_bf16_graph_us" if headline == "ours_graph" else "ours_bf16_us")
        if theirs and record[f"{headline}_us"]:
            record["speedup_vs_ours_bf16"] = theirs / record[f"{headline}_us"]
    del inputs
    return record


def time_peers(state: RunState, record: dict[str, Any], peers: tuple, inputs: list,
               tokens: int, top_k: int, timed: Callable, timed_graph: Callable) -> tuple[str, ...]:
    """Time transformers' experts implementations (and the routing they are given) on the
    point's inputs, eagerly and as CUDA-graph replays; failures are recorded per point.
    Returns the timing names it filled."""
    if not peers:
        return ()
    route = peers[0].route

    def run_route() -> Any:
        out = None
        for _, logits in inputs:
            out = route(logits)
        return out

    timed("route", run_route)
    timed_graph("route_graph", run_route)
    names = ["route", "route_graph"]
    for peer in peers:
        names += [peer.name, f"{peer.name}_graph"]
        reason = peer.skip_reason(tokens, top_k, state.device)
        if reason is not None:
            record["errors"][peer.name] = record["errors"][f"{peer.name}_graph"] = reason
            continue

        def run_peer(peer=peer) -> Any:
            out = None
            for x, logits in inputs:
                out = peer(x, logits)
            return out

        timed(peer.name, run_peer)
        broken = state.peer_graph_broken.get(peer.name)
        if broken:
            record["errors"][f"{peer.name}_graph"] = "skipped: " + broken
        else:
            last = timed_graph(f"{peer.name}_graph", run_peer)
            error = record["errors"].get(f"{peer.name}_graph", "")
            if error.startswith("capture failed"):
                state.peer_graph_broken[peer.name] = "an earlier capture failed (" + error + ")"
            elif last is not None:  # replays compute what an eager call does
                try:
                    record[f"{peer.name}_graph_vs_eager_err"] = relative_error(last, peer(*inputs[-1]))
                except Exception as exc:  # noqa: BLE001
                    record["errors"][f"{peer.name}_graph_vs_eager"] = _short(exc)
            del last
        if state.device.type == "cuda":
            torch.cuda.empty_cache()  # batched_mm's gathers are large
    return tuple(names)


def check_peers(state: RunState, cfg: ModelConfig, quant: str, layer: moe_ops.FusedMoE,
                peers: list) -> dict[str, Any]:
    """Each transformers peer against backend='reference' of the same layer (same inputs as
    check_config): they must compute the same thing to be compared."""
    tokens = state.args.check_tokens
    x, logits = make_inputs(cfg, tokens, 1, state.device, layer.dtype, state.args.seed + 7)[0]
    expected = reference_forward(layer, x, logits)
    results: dict[str, Any] = {}
    for peer in peers:
        try:
            error = relative_error(peer(x, logits), expected)
            results[peer.name] = dict(err=error, ok=error <= state.args.tolerance)
        except Exception as exc:  # noqa: BLE001
            results[peer.name] = dict(err=None, ok=False, error=_short(exc))
    return results


def build_bf16_peer(cfg: ModelConfig, quant: str, layer: moe_ops.FusedMoE, *, backend: str,
                    chunk_elements: int = 1 << 28) -> moe_ops.FusedMoE:
    """A quant='none' layer holding the 4-bit layer's weights dequantized to bf16 (exactly for
    mxfp4; nvfp4's float32 global scale rounds to bf16), on the same backend: what the 4-bit
    path must beat, since it reads about 3.6x fewer weight bytes for the same math."""
    weights = layer.kernel_weights()
    dense = {}
    for name, k in (("w13", cfg.hidden_size), ("w2", cfg.intermediate_size)):
        dense[name] = _dequantize_fp4_chunked(
            weights[name], weights[name + "_scale"], quant, weights.get(name + "_global_scale"),
            layer.dtype, chunk_elements, kernel_order_k=k)
    bf16 = moe_ops.FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k,
                            **cfg.layer_kwargs(), quant="none", dtype=layer.dtype,
                            device=dense["w13"].device, backend=backend)
    ckpt: dict[str, Any] = {"w2": dense.pop("w2")}
    w13 = dense.pop("w13")
    # The kernel layout interleaves gate and up rows (moe_ops.layout: row 2i gate, 2i+1 up).
    ckpt.update({"w1": w13[:, 0::2], "w3": w13[:, 1::2]} if cfg.gated else {"w1": w13})
    if cfg.bias:
        b13 = weights["b13"]
        ckpt.update({"b1": b13[:, 0::2], "b3": b13[:, 1::2]} if cfg.gated else {"b1": b13})
        ckpt["b2"] = weights["b2"]
    if layer.routing_bias is not None:
        ckpt["routing_bias"] = layer.routing_bias
    bf16.load_weights(**ckpt)
    return bf16


def backend_support(backend: str, quant: str, device: torch.device, dtype: torch.dtype,
                    cache: dict) -> Optional[str]:
    """None when `backend` runs `quant` (a tiny layer, one forward), else the reason it does not."""
    key = (backend, quant)
    if key not in cache:
        tiny = ModelConfig("probe", num_experts=4, hidden_size=256, intermediate_size=256,
                           top_k=2, routing="renormalize", quant=(quant,))
        try:
            layer, _ = build_layer(tiny, quant, backend=backend, device=device, dtype=dtype,
                                   with_baseline=False)
            gen = _generator(device, 3)
            x = torch.empty(3, 256, dtype=dtype, device=device).normal_(generator=gen)
            logits = torch.empty(3, 4, device=device).normal_(generator=gen)
            layer(x, logits)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            cache[key] = None
        except Exception as exc:  # noqa: BLE001
            cache[key] = _short(exc)
    return cache[key]


def plan(args: argparse.Namespace, shapes: Shapes) -> list[tuple[ModelConfig, str]]:
    """(model, quant) pairs to run, in order: listed modes by default, else the cross product."""
    pairs = []
    for name in args.models:
        if name not in shapes.models:
            raise SystemExit(f"--models: unknown model {name!r}; shapes.json has {sorted(shapes.models)}")
        cfg = shapes.models[name]
        if args.quant is None:
            modes = list(cfg.quant)
        elif args.listed_only:
            modes = [m for m in args.quant if m in cfg.quant]
        else:
            modes = list(args.quant)
        pairs.extend((cfg, mode) for mode in modes)
    return pairs


def run_config(state: RunState, cfg: ModelConfig, quant: str, tokens_list: list[int]) -> None:
    args, device = state.args, state.device
    dtype = torch.bfloat16
    log(f"[bench {state.elapsed():6.1f}s] {cfg.name} {quant}: building the layer "
        f"({cfg.num_experts} experts x {expert_weight_bytes(cfg, quant) / 1e6:.1f} MB)")
    build_start = time.perf_counter()
    hf_wanted = list(args.hf_peers) if quant == "none" else []
    layer, baseline = build_layer(cfg, quant, backend=args.backend, device=device, dtype=dtype,
                                  seed=args.seed,
                                  with_baseline=not args.no_baseline or bool(hf_wanted),
                                  baseline_impl=args.baseline_impl)
    peers = make_peers(state, cfg, quant, layer, baseline, hf_wanted)
    if args.no_baseline:  # built only for the transformers peers' weights
        baseline = None
    bf16_layer = None
    if quant in ("nvfp4", "mxfp4") and not args.no_bf16_peer:
        try:
            bf16_layer = build_bf16_peer(cfg, quant, layer, backend=args.backend)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: time the rest
            note = f"{cfg.name} {quant}: no bf16 peer ({_short(exc)})"
            state.notes.append(note)
            log(f"[bench] {note}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - build_start
    if baseline is not None:
        for note in [f"baseline {quant}: {baseline.description}"]:
            if note not in state.notes:
                state.notes.append(note)
    if not args.no_check:
        check = check_config(state, cfg, quant, layer, baseline)
        check["build_s"] = build_s
        state.checks.append(check)
        ours = "n/a" if check["err_ours"] is None else f"{check['err_ours']:.2e}"
        base = ("-" if baseline is None else "n/a" if check.get("err_baseline") is None
                else f"{check['err_baseline']:.2e}")
        log(f"[bench {state.elapsed():6.1f}s] {cfg.name} {quant}: check T={check['tokens']}: "
            f"ours vs reference {ours} ({'ok' if check['ok_ours'] else 'FAIL'}), "
            f"baseline vs reference {base}" + (f" [{check.get('error_ours')}]" if check.get("error_ours") else ""))
        if peers:
            check["peers"] = check_peers(state, cfg, quant, layer, peers)
            log(f"[bench {state.elapsed():6.1f}s] {cfg.name} {quant}: check transformers peers vs "
                "reference: " + ", ".join(f"{n} {_fmt(r['err'], '.2e')}" + ("" if r["ok"] else " FAIL")
                                          for n, r in check["peers"].items()))
    for tokens in tokens_list:
        if state.over_deadline():
            state.skipped.append(dict(model=cfg.name, quant=quant, tokens=tokens,
                                      reason=f"deadline ({args.deadline_s:.0f} s) passed"))
            continue
        point_start = time.perf_counter()
        try:
            record = bench_point(state, cfg, quant, tokens, layer, baseline, tuple(peers),
                                 bf16_layer=bf16_layer)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at one T: keep going
            record = dict(model=cfg.name, quant=quant, tokens=tokens, backend=layer.backend,
                          errors={"point": _short(exc)})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
        record["wall_s"] = time.perf_counter() - point_start
        state.records.append(record)
        log(f"[bench {state.elapsed():6.1f}s] {cfg.name} {quant} T={tokens}: " + _point_summary(record))
    del layer, baseline, peers, bf16_layer
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_peers(state: RunState, cfg: ModelConfig, quant: str, layer: moe_ops.FusedMoE,
               baseline: Optional[TorchBaseline], names: list[str]) -> list:
    """transformers' experts implementations over the layer's weights (hf_peers.py), routed by
    moe_ops.route exactly as the layer routes. [] when none are wanted or they cannot be built
    (said in the notes)."""
    if quant != "none" and state.args.hf_peers:
        note = (f"transformers peers: quant={quant!r} not timed (" +
                (hf_peers.fp8_path_status() if quant in ("fp8", "fp8_block") else
                 "no plain-torch transformers experts path for this format") + ")")
        if note not in state.notes:
            state.notes.append(note)
    if not names or baseline is None:
        return []

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moe_ops.route(logits, layer.top_k, routing=layer.routing,
                             routing_bias=layer.routing_bias, n_group=layer.n_group,
                             topk_group=layer.topk_group,
                             routed_scaling_factor=layer.routed_scaling_factor,
                             backend=layer.backend)

    try:
        return hf_peers.build_peers(names, baseline.weights, cfg.activation, route,
                                    dtype=layer.dtype, swiglu_alpha=layer.swiglu_alpha,
                                    swiglu_limit=layer.swiglu_limit)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory for gpt-oss's transposed copy
        state.skipped.append(dict(model=cfg.name, quant=quant, tokens=None,
                                  reason=f"transformers peers not built: {_short(exc)}"))
        return []


def _fmt(value: Optional[float], spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _point_summary(record: dict[str, Any]) -> str:
    if "floor_us" not in record:
        return "ERROR " + "; ".join(f"{k}: {v}" for k, v in record.get("errors", {}).items())
    text = (f"graph {_fmt(record.get('ours_graph_us'))} us, eager {_fmt(record.get('ours_eager_us'))} us, "
            f"baseline {_fmt(record.get('baseline_us'))} us, floor {_fmt(record['floor_us'])} us "
            f"({record['bound']}), fraction {_fmt(record.get('fraction'), '.2f')}")
    for name in hf_peers.PEER_NAMES:
        if f"{name}_us" in record:
            text += (f", {name} {_fmt(record.get(f'{name}_graph_us'))} us graph / "
                     f"{_fmt(record.get(f'{name}_us'))} us eager")
    if record.get("errors"):
        text += " [" + "; ".join(f"{k}: {v}" for k, v in record["errors"].items()) + "]"
    return text


# ---------------------------------------------------------------------------------------------
# Output: JSON, plot, table
# ---------------------------------------------------------------------------------------------
def _json_safe(value: Any) -> Any:
    """NaN/inf -> None (strict JSON), tuples -> lists, tensors/dtypes -> plain values."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _json_safe(value.tolist())
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _json_safe(dataclasses.asdict(value))
    return value


def write_json(path: Path | str, payload: dict[str, Any]) -> Path:
    """Strict JSON, written atomically (a killed run leaves the previous file whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(payload), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def write_records(path: Path | str, records: list[dict[str, Any]]) -> Path:
    """A developer script's records with the command line, GPU, date, torch and commit."""
    return write_json(path, dict(
        command="python " + " ".join(map(shlex.quote, sys.argv)),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__, git=git_commit(), records=records))


def git_commit() -> Optional[dict[str, Any]]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
        return dict(commit=commit, dirty=bool(dirty))
    except Exception:  # noqa: BLE001 - not a git checkout (e.g. a copied tree on the GPU machine)
        commit = os.environ.get("MOE_OPS_GIT_COMMIT")  # the caller may pass it along
        return dict(commit=commit, dirty=None) if commit else None


def metadata(argv: list[str], device: torch.device, shapes: Shapes) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    script = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    return dict(command=shlex.join(["python", script] + argv), gpu=gpu, device=str(device),
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton_version,
                moe_ops=getattr(moe_ops, "__version__", None), python=sys.version.split()[0],
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                git=git_commit(), ceilings=shapes.ceilings)


def build_payload(state: RunState, meta: dict[str, Any]) -> dict[str, Any]:
    return dict(metadata=dict(meta, elapsed_s=state.elapsed(), notes=state.notes,
                              settings=dict(budget_ms=state.args.budget_ms,
                                            input_sets=state.args.input_sets or "8 (T<=1024) / 4",
                                            check_tokens=state.args.check_tokens,
                                            tolerance=state.args.tolerance,
                                            fp8_tolerance=state.args.fp8_tolerance,
                                            backend=state.args.backend,
                                            peers=state.args.peers)),
                checks=state.checks, skipped=state.skipped, records=state.records)


PLOT_SERIES = (("ours_graph", "ours (CUDA graph)", "-", "o"),
               ("ours_eager", "ours (eager)", "--", "s"),
               ("baseline", "torch baseline (eager)", "-", "^"),
               ("baseline_graph", "torch baseline (CUDA graph)", ":", "v"),
               ("grouped_mm", "transformers grouped_mm (eager)", "--", "D"),
               ("grouped_mm_graph", "transformers grouped_mm (CUDA graph)", "-.", "D"),
               ("batched_mm", "transformers batched_mm (eager)", "--", "x"),
               ("batched_mm_graph", "transformers batched_mm (CUDA graph)", "-.", "x"))


def plot_results(records: list[dict[str, Any]], path: Path | str, title: str = "") -> Optional[Path]:
    """Fraction of the floor vs T (log-log), one subplot per (model, quant)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (used as matplotlib.ticker below)

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        if "floor_us" in record:
            groups.setdefault((record["model"], record["quant"]), []).append(record)
    if not groups:
        return None
    columns = min(3, len(groups))
    rows = _cdiv(len(groups), columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, ((model, quant), group) in zip(axes.flat, groups.items()):
        group = sorted(group, key=lambda r: r["tokens"])
        for key, label, style, marker in PLOT_SERIES:
            points = [(r["tokens"], r.get(f"fraction_{key}")) for r in group]
            points = [(t, f) for t, f in points if f]
            if points:
                ax.plot(*zip(*points), linestyle=style, marker=marker, label=label, markersize=4)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.axhline(0.9, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["tokens"] for r in group})
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_ylim(top=1.3)
        ax.set_title(f"{model} / {quant}", fontsize=10)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("fraction of floor")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


TABLE_COLUMNS = (("model", "model", 14, "s"), ("quant", "quant", 9, "s"), ("T", "tokens", 6, "d"),
                 ("graph us", "ours_graph_us", 9, ".1f"), ("eager us", "ours_eager_us", 9, ".1f"),
                 ("base us", "baseline_us", 9, ".1f"), ("base-g us", "baseline_graph_us", 9, ".1f"),
                 ("floor us", "floor_us", 9, ".1f"), ("bound", "bound", 5, "s"),
                 ("frac", "fraction", 5, ".2f"), ("TB/s", "tbps", 5, ".2f"),
                 ("TFLOP/s", "tflops", 7, ".0f"), ("x base", "speedup_vs_baseline", 6, ".1f"),
                 ("gmm-g us", "grouped_mm_graph_us", 9, ".1f"), ("bmm-g us", "batched_mm_graph_us", 9, ".1f"),
                 ("x gmm", "speedup_vs_grouped_mm", 6, ".1f"),
                 ("bf16-g us", "ours_bf16_graph_us", 9, ".1f"), ("x bf16", "speedup_vs_ours_bf16", 6, ".2f"))


def format_table(records: list[dict[str, Any]]) -> str:
    lines = ["  ".join(f"{name:>{width}}" for name, _, width, _ in TABLE_COLUMNS)]
    for record in records:
        cells = []
        for _, key, width, spec in TABLE_COLUMNS:
            value = record.get(key)
            text = "-" if value is None else format(value, spec)
            cells.append(f"{text[:width] if spec == 's' else text:>{width}}")
        line = "  ".join(cells)
        if "floor_us" not in record:
            line += "  ERROR " + "; ".join(f"{k}: {v}" for k, v in record.get("errors", {}).items())
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
QUICK_MODELS = ("qwen3_30b_a3b", "deepseek_v3")
PEERS = ("torch",) + hf_peers.PEER_NAMES
QUICK_TOKENS = (1, 16, 256, 4096)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=Path, default=DEFAULT_SHAPES, help="shapes.json to read")
    parser.add_argument("--models", nargs="+", help="models of shapes.json (default: all)")
    parser.add_argument("--quant", nargs="+", choices=moe_ops.QUANT_MODES,
                        help="quant modes, run for every model (default: each model's listed modes)")
    parser.add_argument("--listed-only", action="store_true",
                        help="with --quant: keep only the modes shapes.json lists for each model")
    parser.add_argument("--tokens", nargs="+", type=int, help="token counts (default: shapes.json's)")
    parser.add_argument("--backend", default="triton", help="moe_ops backend to time (default triton)")
    parser.add_argument("--device", default=None, help="default cuda (cpu: wall-clock timing, no graphs)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/<gpu>.json)")
    parser.add_argument("--plot", type=Path, help="PNG path (default: the JSON path with .png)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--budget-ms", type=float, default=100.0,
                        help="time spent sampling one measurement (default 100 ms)")
    parser.add_argument("--input-sets", type=int, default=0,
                        help="rotating input sets (default 8 for T<=1024, else 4)")
    parser.add_argument("--check-tokens", type=int, default=16,
                        help="T of the check against backend='reference' (default 16)")
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="max relative Frobenius error vs the reference, bf16 math (default 1e-2)")
    parser.add_argument("--fp8-tolerance", type=float, default=1e-2,
                        help="the same for fp8 and fp8_block (default 1e-2: see ours_tolerance)")
    parser.add_argument("--no-check", action="store_true", help="skip the reference checks")
    parser.add_argument("--no-baseline", action="store_true", help="do not run the torch baseline")
    parser.add_argument("--no-bf16-peer", action="store_true",
                        help="4-bit modes: do not time our bf16 path on the dequantized weights")
    parser.add_argument("--no-baseline-graph", action="store_true",
                        help="time the baseline eagerly only")
    parser.add_argument("--baseline-impl", choices=("auto", "grouped", "loop"), default="auto")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated peers timed beside ours: torch (the baseline), "
                             "grouped_mm, batched_mm (transformers' experts implementations, "
                             "quant=none; skipped with a note without transformers). "
                             f"Default {','.join(PEERS)}")
    parser.add_argument("--deadline-s", type=float, default=450.0,
                        help="skip the points left after this many seconds (default 450; 0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: models {' '.join(QUICK_MODELS)}, T {QUICK_TOKENS}, "
                             "30 ms per measurement")
    args = parser.parse_args(argv)
    args.peers = [p for p in (part.strip() for part in args.peers.split(",")) if p]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        parser.error(f"--peers: unknown {unknown}; choose from {','.join(PEERS)}")
    if args.no_baseline:
        args.peers = [p for p in args.peers if p != "torch"]
    args.no_baseline = "torch" not in args.peers
    args.hf_peers = [p for p in args.peers if p in hf_peers.PEER_NAMES]
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.tokens = args.tokens or list(QUICK_TOKENS)
        if args.budget_ms == parser.get_default("budget_ms"):
            args.budget_ms = 30.0
        if args.deadline_s == parser.get_default("deadline_s"):
            args.deadline_s = 120.0
    if args.deadline_s is not None and args.deadline_s <= 0:
        args.deadline_s = None
    return args


def default_out_path(device: torch.device, quick: bool = False) -> Path:
    """benchmarks/results/<gpu>.json (h200.json on an H200); <gpu>_quick.json for --quick."""
    if device.type != "cuda":
        slug = device.type
    else:
        name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
        slug = "_".join("".join(c if c.isalnum() else " " for c in name).split()) or "gpu"
    return BENCH_DIR / "results" / f"{slug}{'_quick' if quick else ''}.json"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shapes = load_shapes(args.shapes)
    args.models = args.models or list(shapes.models)
    tokens_list = args.tokens or shapes.tokens
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        log(f"[bench] no CUDA device: running on {device} with wall-clock timing and no graphs "
            "(numbers are not GPU numbers)")
    out_path = args.out or default_out_path(device, args.quick)
    plot_path = None if args.no_plot else (args.plot or out_path.with_suffix(".png"))
    state = RunState(args, shapes, device, time.perf_counter())
    meta = metadata(argv, device, shapes)
    log(f"[bench] {meta['gpu'] or device}, torch {meta['torch']}, triton {meta['triton']}, "
        f"backend {args.backend}")

    caps = probe_capabilities(device)
    state.notes.extend(caps.notes)
    state.notes.append("fp8_block baseline: rowwise-scaled fp8 (per-token activations, one scale per "
                       "weight row = the mean of its 128x128 block scales) on the same fp8 "
                       "bytes; torch has no block-scaled grouped GEMM on sm_90")
    state.notes.append("nvfp4/mxfp4 baseline (when run): bf16 grouped GEMM on dequantized weights")
    for note in caps.notes:
        log(f"[bench] {note}")
    if args.hf_peers:
        version, why = hf_peers.transformers_status()
        note = (f"transformers {version} peers {','.join(args.hf_peers)}: moe_ops.route (our "
                "router, same method and backend) + transformers' registered experts function on "
                "transformers-layout weights built from the same random weights; route_us is "
                "the routing alone" if version else f"transformers peers skipped: {why}")
        if not version:
            args.hf_peers = []
        meta["transformers"] = version
        state.notes.append(note)
        log(f"[bench] {note}")

    support_cache: dict = {}
    pairs = []
    for cfg, quant in plan(args, shapes):
        reason = backend_support(args.backend, quant, device, torch.bfloat16, support_cache)
        if reason is not None:
            note = f"{cfg.name} {quant}: skipped, backend {args.backend!r} does not run it ({reason})"
            state.skipped.append(dict(model=cfg.name, quant=quant, tokens=None, reason=note))
            log(f"[bench] {note}")
            continue
        pairs.append((cfg, quant))

    for cfg, quant in pairs:
        if state.over_deadline():
            state.skipped.extend(dict(model=cfg.name, quant=quant, tokens=t,
                                      reason=f"deadline ({args.deadline_s:.0f} s) passed")
                                 for t in tokens_list)
            continue
        try:
            run_config(state, cfg, quant, tokens_list)
        except Exception as exc:  # noqa: BLE001 - e.g. the layer cannot be built: next config
            state.skipped.append(dict(model=cfg.name, quant=quant, tokens=None,
                                      reason="failed: " + _short(exc)))
            log(f"[bench] {cfg.name} {quant}: failed: {_short(exc)}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
        write_json(out_path, build_payload(state, meta))  # partial results survive a kill

    write_json(out_path, build_payload(state, meta))
    log(f"[bench {state.elapsed():6.1f}s] wrote {out_path}")
    if plot_path is not None:
        try:
            title = f"moe_ops {args.backend} on {meta['gpu'] or device} ({meta['date'][:10]})"
            written = plot_results(state.records, plot_path, title)
            log(f"[bench] wrote {written}" if written else "[bench] nothing to plot")
        except Exception as exc:  # noqa: BLE001 - a plot failure must not lose the table
            log(f"[bench] plot failed: {_short(exc)}")

    for check in state.checks:
        print(f"check {check['model']} {check['quant']} T={check['tokens']}: ours vs reference "
              f"{_fmt(check.get('err_ours'), '.2e')} ({'ok' if check['ok_ours'] else 'FAIL'}"
              f"{', ' + check['error_ours'] if check.get('error_ours') else ''}); baseline vs "
              f"reference {_fmt(check.get('err_baseline'), '.2e')}"
              + ("" if check.get("ok_baseline") is not False else " (FAIL)")
              + "".join(f"; {name} vs reference {_fmt(r['err'], '.2e')}" + ("" if r["ok"] else " (FAIL)")
                        for name, r in check.get("peers", {}).items()))
    for skip in state.skipped:
        if skip["tokens"] is None:
            print(f"skipped: {skip['reason']}")
    deadline_skips = [s for s in state.skipped if s["tokens"] is not None]
    if deadline_skips:
        print(f"skipped {len(deadline_skips)} points: {deadline_skips[0]['reason']}")
    for note in state.notes:
        print(f"note: {note}")
    print(format_table(state.records))
    failed = any(not c["ok_ours"] or c.get("ok_baseline") is False for c in state.checks)
    nothing = not any(r.get("ours_eager_us") or r.get("ours_graph_us") for r in state.records)
    return 1 if failed or nothing else 0


if __name__ == "__main__":
    sys.exit(main())
