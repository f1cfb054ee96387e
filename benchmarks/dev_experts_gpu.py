"""Developer check of moe_ops.kernels.triton_experts on one GPU: correctness against a float64
evaluation, timings (eager and CUDA-graph replay, median of triton.testing.do_bench) against a
plain torch baseline, per-kernel breakdown, a few config alternatives.

    python benchmarks/dev_experts_gpu.py [--quick] [--budget SECONDS] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/dev_experts_gpu.py --tiny   # CPU smoke test of this script

Prints one line per measurement as it goes and a table last; writes results.json to --out.
Sizes: Mixtral (E=8, H=4096, I=14336, k=2), Qwen3-30B-A3B (E=128, H=2048, I=768, k=8),
DeepSeek-V3 (E=256, H=7168, I=2048, k=8, fp8_block) at T in {1, 16, 256, 4096}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from moe_ops.kernels import experts as experts_mod  # noqa: E402
from moe_ops.kernels.act_quant import act_quant  # noqa: E402
from moe_ops.kernels.align import moe_align  # noqa: E402
from moe_ops.kernels.experts import gemm_problems, triton_experts, use_direct_dispatch  # noqa: E402
from moe_ops.kernels.combine import combine_pair_rows  # noqa: E402
from moe_ops.kernels.grouped_gemm import (  # noqa: E402
    GemmConfig, Routing, default_config, gemm1, gemm2, is_valid_config,
)

READ_TBPS = 4.55
PEAK_TFLOPS = {"none": 695.0, "fp8": 1274.0, "fp8_block": 1274.0}
FP8 = torch.float8_e4m3fn
MODELS = {
    "mixtral": dict(E=8, H=4096, I=14336, k=2),
    "qwen3": dict(E=128, H=2048, I=768, k=8),
    "deepseek": dict(E=256, H=7168, I=2048, k=8),
}
TOKENS = (1, 16, 256, 4096)
DEVICE = "cuda"
TINY = "--tiny" in sys.argv
if TINY:  # interpreter smoke test of this script's code paths, no timings
    MODELS = {
        "mixtral": dict(E=4, H=256, I=256, k=2),
        "qwen3": dict(E=16, H=128, I=128, k=4),
        "deepseek": dict(E=16, H=256, I=128, k=4),
    }
    TOKENS = (1, 16, 64, 200)
    DEVICE = "cpu"
START = time.time()
RESULTS = []


def log(*args):
    print(f"[{time.time() - START:6.1f}s]", *args, flush=True)


# ------------------------------------------------------------------ problems

def make_weights(model, quant, dtype=torch.bfloat16, seed=0):
    m = MODELS[model]
    E, H, I = m["E"], m["H"], m["I"]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    N13 = 2 * I
    if quant == "none":
        w13 = torch.empty(E, N13, H, dtype=dtype, device=DEVICE)
        w2 = torch.empty(E, H, I, dtype=dtype, device=DEVICE)
        for e in range(E):  # per expert: no fp32 copy of a whole layer
            w13[e] = torch.randn(N13, H, generator=g, device=DEVICE) / math.sqrt(H)
            w2[e] = torch.randn(H, I, generator=g, device=DEVICE) / math.sqrt(I)
        return w13, w2, None, None
    w13 = torch.empty(E, N13, H, dtype=FP8, device=DEVICE)
    w2 = torch.empty(E, H, I, dtype=FP8, device=DEVICE)
    for e in range(E):
        w13[e] = torch.randn(N13, H, generator=g, device=DEVICE).clamp(-6, 6).to(FP8)
        w2[e] = torch.randn(H, I, generator=g, device=DEVICE).clamp(-6, 6).to(FP8)
    if quant == "fp8":
        s13 = (torch.rand(E, N13, generator=g, device=DEVICE) + 0.5) / math.sqrt(H)
        s2 = (torch.rand(E, H, generator=g, device=DEVICE) + 0.5) / math.sqrt(I)
    else:
        s13 = (torch.rand(E, 2 * math.ceil(I / 128), math.ceil(H / 128), generator=g,
                          device=DEVICE) + 0.5) / math.sqrt(H)
        s2 = (torch.rand(E, math.ceil(H / 128), math.ceil(I / 128), generator=g,
                         device=DEVICE) + 0.5) / math.sqrt(I)
    return w13, w2, s13, s2


def make_inputs(model, T, seed, dtype=torch.bfloat16):
    m = MODELS[model]
    g = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
    x = torch.randn(T, m["H"], generator=g, device=DEVICE).to(dtype)
    ids = torch.rand(T, m["E"], generator=g, device=DEVICE).argsort(dim=1)[:, :m["k"]]
    ids = ids.to(torch.int32).contiguous()
    w = torch.rand(T, m["k"], generator=g, device=DEVICE) + 0.1
    w = w / w.sum(1, keepdim=True)
    return x, ids, w


# ------------------------------------------------------------------ float64 evaluation

def quant_rows64(a, group):
    a = a.float()
    M, K = a.shape
    if group:
        G = math.ceil(K / group)
        p = torch.zeros(M, G * group, device=a.device)
        p[:, :K] = a
        a = p.view(M, G, group)
    amax = a.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax.clamp_min(1e-30),
                      torch.zeros_like(amax))
    deq = (a * inv).clamp(-448, 448).to(FP8).double() * (amax / 448.0).double()
    return deq.reshape(M, -1)[:, :K]


def dequant64(w, s, quant, gated_w13):
    if quant == "none":
        return w.double()
    if quant == "fp8":
        return w.double() * s.double()[:, None]
    rows = torch.arange(w.shape[0], device=w.device)
    srow = 2 * ((rows // 2) // 128) + rows % 2 if gated_w13 else rows // 128
    cols = torch.arange(w.shape[1], device=w.device) // 128
    return w.double() * s.double()[srow][:, cols]


def experts64(x, ids, w, w13, w2, s13, s2, quant, dtype):
    T, H = x.shape
    group = 128 if quant == "fp8_block" else 0
    xa = x.double() if quant == "none" else quant_rows64(x, group)
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        W13 = dequant64(w13[e], s13[e] if s13 is not None else None, quant, True)
        h = xa[tok] @ W13.T
        del W13
        a = (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]).to(dtype)
        a = a.double() if quant == "none" else quant_rows64(a, group)
        W2 = dequant64(w2[e], s2[e] if s2 is not None else None, quant, False)
        out.index_add_(0, tok, w[tok, slot].double()[:, None] * (a @ W2.T))
        del W2
    return out


# ------------------------------------------------------------------ torch baseline

def torch_baseline(x, ids, w, w13_bf16, w2_bf16):
    """argsort by expert + torch._grouped_mm + silu*mul + index_add (bf16 weights)."""
    T, H = x.shape
    k = ids.shape[1]
    E = w13_bf16.shape[0]
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w13_bf16.transpose(1, 2), offs=offs)
    a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
    y = torch._grouped_mm(a.contiguous(), w2_bf16.transpose(1, 2), offs=offs)
    y = y.float() * w.reshape(-1)[order, None]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y)
    return out.to(x.dtype)


# ------------------------------------------------------------------ timing

def bench_eager(fn):
    if TINY:
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def bench_graph(fns):
    """Median µs per call of fns (one call each) replayed from one CUDA graph."""
    if TINY:
        for f in fns:
            f()
        return 1.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    ms = triton.testing.do_bench(graph.replay, warmup=3, rep=40, return_mode="median")
    return ms * 1e3 / len(fns)


def floors(model, quant, T, ids_sets):
    m = MODELS[model]
    E, H, I, k = m["E"], m["H"], m["I"], m["k"]
    wbytes = 1 if quant != "none" else 2
    per_expert = 3 * H * I * wbytes
    hit = sum(torch.unique(ids).numel() for ids in ids_sets) / len(ids_sets)
    bytes_ = hit * per_expert + 2 * T * H * 2
    flops = 2 * T * k * (H * 2 * I + I * H)
    return bytes_ / (READ_TBPS * 1e12) * 1e6, flops / (PEAK_TFLOPS[quant] * 1e12) * 1e6, bytes_, flops


# ------------------------------------------------------------------ sections

def check_act_quant():
    rows, cols = (8, 512) if TINY else (512, 7168)
    x = (torch.randn(rows, cols, device=DEVICE) * torch.exp(torch.randn(rows, 1, device=DEVICE)))
    x = x.to(torch.bfloat16)
    x[3] = 0
    for quant, group in (("fp8", 0), ("fp8_block", 128)):
        q, s = act_quant(x, quant)
        deq = q.double() * (s.double()[:, None] if not group else s.double().repeat_interleave(128, 1))
        ref = quant_rows64(x, group)
        mism = (deq != ref).sum().item()
        log(f"act_quant {quant}: {mism} of {x.numel()} elements differ from torch RNE")
        RESULTS.append(dict(kind="act_quant", quant=quant, mismatches=mism))


def check_align():
    sizes = ((1, 256, 8, 16), (100, 128, 8, 16), (4096, 128, 8, 64), (70000, 256, 8, 128))
    for T, E, k, bm in sizes[:3] if TINY else sizes:
        ids = torch.rand(T, E, device=DEVICE).argsort(1)[:, :k].to(torch.int32)
        ids[0, 0] = -1
        d = moe_align(ids, E, bm)
        if not TINY:
            torch.cuda.synchronize()
        sp = d.sorted_pair_ids.long()
        n = ids.numel()
        live = sp[sp < n]
        flat = ids.reshape(-1).long()
        ok = torch.equal(live.sort().values, torch.nonzero(flat >= 0).flatten())
        blocks = d.block_expert_ids.long()
        nb = int(d.num_padded.item()) // bm
        ok &= bool((blocks[nb:] == -1).all()) and bool((blocks[:nb] >= 0).all())
        chunks = sp[:nb * bm].view(nb, bm)
        valid = chunks < n
        ok &= bool((flat[chunks.clamp(max=n - 1)] == blocks[:nb, None])[valid].all())
        us = bench_eager(lambda: moe_align(ids, E, bm))
        log(f"align T={T} E={E} k={k} block_m={bm}: correct={ok} {us:.1f} us")
        RESULTS.append(dict(kind="align", T=T, E=E, k=k, block_m=bm, ok=ok, us=us))


def run_point(model, quant, T, weights, baseline_weights, check=True, breakdown=False,
              combine_modes=False, sweeps=()):
    m = MODELS[model]
    w13, w2, s13, s2 = weights
    sets = [make_inputs(model, T, s) for s in range(4 if T <= 64 else 1)]
    x, ids, w = sets[0]
    row = dict(kind="point", model=model, quant=quant, T=T)
    p1, p2 = gemm_problems(x, m["k"], w13, w2, "swiglu", quant)
    call = lambda x, ids, w, **kw: triton_experts(x, ids, w, w13, w2, s13, s2, quant=quant, **kw)  # noqa: E731
    if check:
        out = call(x, ids, w)
        ref = experts64(x, ids, w, w13, w2, s13, s2, quant, x.dtype)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        row["rel_err"] = err
        row["finite"] = bool(torch.isfinite(out).all())
    fb_us, ff_us, bytes_, flops = floors(model, quant, T, [s[1] for s in sets])
    eager = bench_eager(lambda: call(x, ids, w))
    graph = bench_graph([lambda s=s: call(*s) for s in sets])
    row.update(eager_us=eager, graph_us=graph, floor_bytes_us=fb_us, floor_flops_us=ff_us,
               frac_floor=max(fb_us, ff_us) / graph, TBps=bytes_ / graph / 1e6,
               TFLOPs=flops / graph / 1e6)
    if baseline_weights is not None:
        try:
            row["baseline_us"] = bench_eager(lambda: torch_baseline(x, ids, w, *baseline_weights))
        except Exception as exc:  # noqa: BLE001
            row["baseline_us"] = None
            log("baseline failed:", repr(exc)[:200])
    row["config1"] = str(default_config(p1))
    row["config2"] = str(default_config(p2))
    if breakdown:
        row["breakdown"] = kernel_breakdown(x, ids, w, weights, quant)
    if combine_modes:
        try:
            for mode in ("rows", "atomic"):
                experts_mod.COMBINE = mode
                row[f"{mode}_graph_us"] = bench_graph([lambda s=s: call(*s) for s in sets])
        finally:
            experts_mod.COMBINE = "auto"
    for which, configs in sweeps:
        res = []
        for cfg in configs:
            if not is_valid_config(p1 if which == 1 else p2, cfg):
                continue
            kw = {"gemm1_config": cfg} if which == 1 else {"gemm2_config": cfg}
            try:
                if check:
                    o = call(x, ids, w, **kw)
                    e = ((o.double() - ref).norm() / ref.norm()).item()
                else:
                    e = None
                us = bench_graph([lambda s=s: call(*s, **kw) for s in sets])
                res.append((str(cfg), us, e))
                log(f"   sweep gemm{which} {cfg}: {us:.1f} us err={e}")
            except Exception as exc:  # noqa: BLE001
                res.append((str(cfg), None, repr(exc)[:200]))
                log(f"   sweep gemm{which} {cfg}: FAILED {repr(exc)[:200]}")
        row[f"sweep{which}"] = res
    log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                    if k not in ("sweep1", "sweep2")}))
    RESULTS.append(row)
    save_results()


def save_results():
    out = os.environ.get("MOE_OPS_RESULTS_DIR") or "."
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def kernel_breakdown(x, ids, w, weights, quant):
    """µs of each launch of triton_experts, timed one by one (eager do_bench)."""
    w13, w2, s13, s2 = weights
    T, H = x.shape
    k = ids.shape[1]
    E, I = w13.shape[0], w2.shape[2]
    p1, p2 = gemm_problems(x, k, w13, w2, "swiglu", quant)
    c1, c2 = default_config(p1), default_config(p2)
    routing = Routing(ids.reshape(-1), w.reshape(-1), k, E, 0)
    out = {}
    if not use_direct_dispatch(T, k, E):
        bm = max(c1.block_m, c2.block_m)
        out["align"] = bench_eager(lambda: moe_align(ids, E, bm))
        d = moe_align(ids, E, bm)
        routing.sorted_pair_ids, routing.block_expert_ids, routing.align_block_m = (
            d.sorted_pair_ids, d.block_expert_ids, bm)
    a1, a1s = (x, None) if quant == "none" else act_quant(x, quant)
    if quant != "none":
        out["quant_x"] = bench_eager(lambda: act_quant(x, quant))
    inter = torch.empty(routing.num_slots, I, dtype=x.dtype, device=x.device)
    g1 = lambda: gemm1(a1, a1s, w13, s13, None, inter, routing, c1, quant=quant,  # noqa: E731
                       activation="swiglu", alpha=1.702, limit=7.0)
    out["gemm1"] = bench_eager(g1)
    g1()
    a2, a2s = (inter, None) if quant == "none" else act_quant(inter, quant, routing.sorted_pair_ids,
                                                              routing.num_pairs)
    if quant != "none":
        out["quant_inter"] = bench_eager(lambda: act_quant(inter, quant, routing.sorted_pair_ids,
                                                           routing.num_pairs))
    pair_out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    out["gemm2"] = bench_eager(lambda: gemm2(a2, a2s, w2, s2, None, pair_out, routing, c2,
                                             quant=quant, atomic_out=False))
    res = torch.empty(T, H, dtype=x.dtype, device=x.device)
    out["combine"] = bench_eager(lambda: combine_pair_rows(pair_out, routing, res))
    log("   breakdown us:", {k: round(v, 1) for k, v in out.items()})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget", type=float, default=240.0, help="stop starting sections after")
    ap.add_argument("--out", default=os.environ.get("MOE_OPS_RESULTS_DIR", "."))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    log(torch.__version__, triton.__version__, torch.cuda.get_device_name() if not TINY else "cpu")

    def over():
        return time.time() - START > args.budget

    plan = [
        ("qwen3", "none"), ("mixtral", "none"), ("deepseek", "fp8_block"), ("qwen3", "fp8"),
    ]
    decode_sweep = [GemmConfig(16, 64, 128, 1, 4, 4, True), GemmConfig(16, 128, 128, 1, 4, 4),
                    GemmConfig(16, 32, 128, 1, 4, 5), GemmConfig(16, 64, 256, 1, 4, 3)]
    prefill_sweep_bf16 = [GemmConfig(128, 128, 64, 8, 4, 4), GemmConfig(128, 128, 64, 8, 8, 4),
                          GemmConfig(64, 256, 64, 8, 8, 3), GemmConfig(128, 256, 64, 16, 8, 3)]
    prefill_sweep_fp8 = [GemmConfig(128, 128, 128, 8, 4, 4), GemmConfig(64, 128, 128, 8, 4, 4),
                         GemmConfig(128, 128, 64, 8, 8, 5), GemmConfig(128, 128, 128, 16, 8, 3)]
    try:
        check_act_quant()
        check_align()
    except Exception:  # noqa: BLE001
        log("FAILED section", traceback.format_exc())
    for model, quant in plan:
        if over():
            log("budget reached, skipping", model, quant)
            continue
        try:
            weights = make_weights(model, quant)
            baseline = None
            if quant == "none":
                baseline = (weights[0], weights[1])
            elif model != "deepseek":  # a 22 GB bf16 copy of DeepSeek is not worth the time
                baseline = (dequant_layer(weights[0], weights[2]), dequant_layer(weights[1], weights[3]))
            for T in TOKENS:
                if over():
                    break
                sweeps = ()
                if not args.quick and T == TOKENS[1] and model in ("mixtral", "deepseek"):
                    sweeps = ((1, decode_sweep), (2, decode_sweep))
                if not args.quick and T == TOKENS[3] and model in ("mixtral", "deepseek") and quant != "fp8":
                    sw = prefill_sweep_fp8 if quant != "none" else prefill_sweep_bf16
                    sweeps = ((1, sw), (2, sw))
                run_point(model, quant, T, weights, baseline, check=True,
                          breakdown=T in (1, TOKENS[3]), combine_modes=T == TOKENS[3], sweeps=sweeps)
            del weights, baseline
            if not TINY:
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            log("FAILED", model, quant, traceback.format_exc())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print_table()


def dequant_layer(wq, s):
    out = torch.empty(wq.shape, dtype=torch.bfloat16, device=wq.device)
    for e in range(wq.shape[0]):
        out[e] = (wq[e].float() * s[e][:, None]).to(torch.bfloat16)
    return out


def print_table():
    print("\nmodel     quant      T     err       eager_us  graph_us  base_us  floor_us  frac   TB/s   "
          "TFLOP/s  rows_us  atomic_us")
    for r in RESULTS:
        if r.get("kind") != "point":
            continue
        fl = max(r["floor_bytes_us"], r["floor_flops_us"])
        print(f"{r['model']:9s} {r['quant']:9s} {r['T']:5d}  {r.get('rel_err', float('nan')):.2e}  "
              f"{r['eager_us']:8.1f}  {r['graph_us']:8.1f}  {r.get('baseline_us') or float('nan'):7.1f}  "
              f"{fl:8.1f}  {r['frac_floor']:.2f}  {r['TBps']:5.2f}  {r['TFLOPs']:7.1f}  "
              f"{r.get('rows_graph_us', float('nan')):8.1f} {r.get('atomic_graph_us', float('nan')):8.1f}")


if __name__ == "__main__":
    main()
