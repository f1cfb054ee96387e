"""Developer check of the 4-bit (W4A16) Triton experts path on one GPU: correctness against
moe_ops.reference, then CUDA-graph timings of a handful of configs per token count.

    python benchmarks/dev_fp4_gpu.py                 # both models, T in 1 16 64 1024 4096 16384
    python benchmarks/dev_fp4_gpu.py --models gpt_oss_120b --tokens 1 64 --deadline-s 60
    TRITON_INTERPRET=1 python benchmarks/dev_fp4_gpu.py --tiny   # CPU smoke test of this script

Models: deepseek_v3 nvfp4 (E=256, H=7168, I=2048, k=8, swiglu) and gpt_oss_120b mxfp4
(E=128, H=I=2880, k=4, swiglu_oai with biases). Weights are random packed bytes (every e2m1
code) with random block scales, drawn directly in the kernel layout; routing is random (k
distinct experts a token), four input sets rotated so L2 does not keep the weights of the
experts hit. Times the experts call (dispatch, both GEMMs, combine) replayed from a CUDA graph.

Columns: us per call; byte floor = (weights and scales of the distinct experts hit + activations
in and out) / 4.55 TB/s; frac = byte floor / us (decode target >= 0.75); TFLOP/s of
2*T*k*3*H*I (prefill target >= 500). "portable" rows force the portable e2m1 decode
(FP4_FAST_DEQUANT = False) instead of the inline-PTX one, to show what the latter buys;
"dynk" rows pass the K-step count at run time (FP4_STATIC_K_STEPS = False).
Writes fp4_results.json to $MOE_OPS_RESULTS_DIR (default ./out). Meant to finish in < 3 min.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from moe_ops import quant as q  # noqa: E402
from moe_ops.tune import precompile  # noqa: E402
from moe_ops.kernels import grouped_gemm as gg  # noqa: E402
from moe_ops.kernels.experts import gemm_problems, triton_experts  # noqa: E402
from moe_ops.kernels.grouped_gemm import GemmConfig, default_config  # noqa: E402
from moe_ops.reference import fused_experts_reference  # noqa: E402

READ_TBPS = 4.55
from moe_ops.synthetic import E2M1_RMS  # noqa: E402
MODELS = {
    "deepseek_v3": dict(E=256, H=7168, I=2048, k=8, quant="nvfp4", activation="swiglu", bias=False),
    "gpt_oss_120b": dict(E=128, H=2880, I=2880, k=4, quant="mxfp4", activation="swiglu_oai",
                         bias=True),
}
TOKENS = (1, 16, 64, 1024, 4096, 16384)
CHECK_TOKENS = (7, 300)
INPUT_SETS = 4
TINY = "--tiny" in sys.argv
LABELS = None  # --labels: the candidates timed (None: all)
DEVICE = "cpu" if TINY else "cuda"
if TINY:
    MODELS = {
        "deepseek_v3": dict(E=8, H=128, I=64, k=2, quant="nvfp4", activation="swiglu", bias=False),
        "gpt_oss_120b": dict(E=8, H=96, I=96, k=2, quant="mxfp4", activation="swiglu_oai",
                             bias=True),
    }
    TOKENS = (1, 16, 64)
    CHECK_TOKENS = (5,)
    INPUT_SETS = 1

C = GemmConfig
# Candidates per regime (applied to both GEMMs). (label, config, variant: "" | "portable" |
# "dynk", see the module doc)
DECODE = [
    ("dflt", None, ""),
    ("dflt-dynk", None, "dynk"),
    ("16x64x128s4", C(16, 64, 128, 8, 4, 4, True), ""),
    ("16x128x128s3", C(16, 128, 128, 8, 4, 3, True), ""),
    ("16x64x64s6", C(16, 64, 64, 8, 4, 6, True), ""),
    # two warpgroups a CTA (each its own 64 weight rows, one activation tile), and narrower
    # tiles (more CTAs: fewer waves' tails)
    ("16x128x256w8s3", C(16, 128, 256, 8, 8, 3, True), ""),
    ("16x128x128w8s4", C(16, 128, 128, 8, 8, 4, True), ""),
    ("16x256x128w8s3", C(16, 256, 128, 8, 8, 3, True), ""),
    ("16x32x256s4", C(16, 32, 256, 8, 4, 4, True), ""),
    ("dflt-portable", None, "portable"),
]
MID = [
    ("dflt", None, ""),
    ("dflt-dynk", None, "dynk"),
    ("32x64x128s4", C(32, 64, 128, 8, 4, 4, True), ""),
    ("64x128x64s4", C(64, 128, 64, 8, 4, 4, True), ""),
]
PREFILL = [
    ("dflt", None, ""),
    ("dflt-dynk", None, "dynk"),
    ("128x256x64w8", C(128, 256, 64, 16, 8, 3, True), ""),
    ("256x128x64w8", C(256, 128, 64, 16, 8, 3, True), ""),
    ("128x128x128w8", C(128, 128, 128, 16, 8, 3, True), ""),
]
if TINY:
    DECODE, MID, PREFILL = DECODE[:2] + DECODE[-1:], MID[:1], PREFILL[:1]

START = time.time()
RESULTS: list[dict] = []


def log(*args):
    print(f"[{time.time() - START:6.1f}s]", *args, flush=True)


def candidates(model: str, T: int):
    m = MODELS[model]
    rows = T * m["k"] / m["E"]
    table = DECODE if rows <= 16 else MID if rows <= 128 else PREFILL
    return [c for c in table if LABELS is None or c[0] in LABELS]


# ------------------------------------------------------------------ weights and inputs

def make_weights(model: str, seed: int = 0) -> dict:
    """Kernel-layout tensors (as moe_ops.prepare_weights makes them), random, on DEVICE."""
    m = MODELS[model]
    E, H, I, quant = m["E"], m["H"], m["I"], m["quant"]
    group = 16 if quant == "nvfp4" else 32
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = {}
    for name, rows, cols in (("w13", 2 * I, H), ("w2", H, I)):
        # random natural bytes, then the kernel order and padded scales (quant.py)
        natural = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, device=DEVICE,
                                generator=g)
        out[name] = q.fp4_to_kernel_order(natural)
        std = 1.0 / math.sqrt(cols)
        if quant == "nvfp4":
            block = torch.rand(E, rows, cols // group, device=DEVICE, generator=g) * 64 + 32
            out[name + "_scale"] = q.fp4_pad_scales(block.to(torch.float8_e4m3fn), cols, quant)
            glob = (torch.rand(E, device=DEVICE, generator=g) + 0.5) * std / (E2M1_RMS * 64)
            out[name + "_global_scale"] = glob[:, None].expand(E, rows).contiguous()
        else:
            center = 127 + round(math.log2(std / E2M1_RMS))
            scale = (center + torch.randint(-1, 2, (E, rows, cols // group), device=DEVICE,
                                            generator=g)).to(torch.uint8)
            out[name + "_scale"] = q.fp4_pad_scales(scale, cols, quant)
            # the layout's fold of bytes past 128 (none here: row scales 1)
            out[name + "_scale"], out[name + "_global_scale"] = q.mxfp4_fold_scales(
                out[name + "_scale"])
    if m["bias"]:
        out["b13"] = torch.randn(E, 2 * I, device=DEVICE, generator=g) * 0.1
        out["b2"] = torch.randn(E, H, device=DEVICE, generator=g) * 0.1
    return out


def make_inputs(model: str, T: int, seed: int):
    m = MODELS[model]
    g = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
    x = torch.randn(T, m["H"], device=DEVICE, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, m["E"], device=DEVICE, generator=g).argsort(dim=1)[:, :m["k"]]
    w = torch.rand(T, m["k"], device=DEVICE, generator=g) + 0.1
    return x, ids.to(torch.int32).contiguous(), w / w.sum(1, keepdim=True)


@contextlib.contextmanager
def kernel_variant(variant):
    """variant "portable": the portable e2m1 decode; "dynk": a run-time K-step count."""
    saved = gg.FP4_FAST_DEQUANT, gg.FP4_STATIC_K_STEPS
    gg.FP4_FAST_DEQUANT = variant != "portable"
    gg.FP4_STATIC_K_STEPS = variant != "dynk"
    try:
        yield
    finally:
        gg.FP4_FAST_DEQUANT, gg.FP4_STATIC_K_STEPS = saved


def call(model: str, weights: dict, x, ids, w, config=None, variant=""):
    m = MODELS[model]
    with kernel_variant(variant):
        return triton_experts(
            x, ids, w, weights["w13"], weights["w2"], weights["w13_scale"], weights["w2_scale"],
            weights.get("b13"), weights.get("b2"), activation=m["activation"], quant=m["quant"],
            gemm1_config=config, gemm2_config=config,
            w13_global_scale=weights.get("w13_global_scale"),
            w2_global_scale=weights.get("w2_global_scale"))


def reference(model: str, weights: dict, x, ids, w):
    m = MODELS[model]
    return fused_experts_reference(
        x, ids, w, weights["w13"], weights["w2"], weights["w13_scale"], weights["w2_scale"],
        weights.get("b13"), weights.get("b2"), activation=m["activation"], quant=m["quant"],
        w13_global_scale=weights.get("w13_global_scale"),
        w2_global_scale=weights.get("w2_global_scale"))


def rel_err(out, ref) -> float:
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ floors and timing

def expert_bytes(model: str) -> int:
    m = MODELS[model]
    H, I = m["H"], m["I"]
    elements = 3 * H * I
    group = 16 if m["quant"] == "nvfp4" else 32
    total = elements // 2 + elements // group + (12 if m["quant"] == "nvfp4" else 0)
    if m["bias"]:
        total += 4 * (2 * I + H)
    return total


def floors(model: str, T: int, ids_sets) -> tuple[float, float]:
    m = MODELS[model]
    distinct = sum(int(torch.unique(ids).numel()) for ids in ids_sets) / len(ids_sets)
    bytes_ = distinct * expert_bytes(model) + T * m["H"] * 2 * 2
    flops = 2 * T * m["k"] * 3 * m["H"] * m["I"]
    return bytes_, flops


def time_graph(fns) -> float:
    """Median us per call of fns (one call each) replayed from one CUDA graph."""
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=2, rep=25, return_mode="median")
    del graph
    return ms * 1e3 / len(fns)


# ------------------------------------------------------------------ the run

def check(model: str, weights: dict, deadline: float) -> None:
    """Default, swap/no-swap, fast/portable decode against moe_ops.reference (SPEC bound 1e-2)."""
    m = MODELS[model]
    for T in CHECK_TOKENS:
        x, ids, w = make_inputs(model, T, seed=T)
        if T > 1:
            ids[: T // 4] = ids[0, 0]  # skew: a quarter of the tokens share their first expert
        ref = reference(model, weights, x, ids, w)
        rows = T * m["k"] / m["E"]
        swap = C(16, 64, 128, 8, 4, 3, True) if rows <= 16 else C(64, 128, 64, 8, 4, 3, True)
        # (4-bit configs without swap-AB are interpreter-only: grouped_gemm.config_problems)
        for label, config, variant in (("dflt", None, ""), ("dflt-portable", None, "portable"),
                                       ("dflt-dynk", None, "dynk"), ("swap", swap, "")):
            if time.time() > deadline:
                return
            row = dict(kind="check", model=model, quant=m["quant"], T=T, config=label)
            try:
                err = rel_err(call(model, weights, x, ids, w, config, variant), ref)
                row.update(err=err, ok=err <= 1e-2)
            except Exception as exc:  # noqa: BLE001
                row.update(err=None, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc()
            RESULTS.append(row)
            log(f"check {model} {m['quant']} T={T} {label}: err {row['err']} "
                f"{'ok' if row['ok'] else 'FAIL'}")


def bench(model: str, weights: dict, tokens, deadline: float) -> None:
    m = MODELS[model]
    points = []
    for T in tokens:
        sets = [make_inputs(model, T, seed=T * 10 + s) for s in range(INPUT_SETS)]
        points.append((T, sets))
    jobs = [(lambda T=T, s=sets[0], c=c, p=p: call(model, weights, *s, c, p))
            for T, sets in points for _, c, p in candidates(model, T)]
    if not TINY:
        log(f"{model}: precompiled {len(jobs)} calls in {precompile(jobs):.1f} s")
    for T, sets in points:
        bytes_, flops = floors(model, T, [ids for _, ids, _ in sets])
        floor_us = bytes_ / (READ_TBPS * 1e6)
        x0, i0, w0 = sets[0]
        problem1, problem2 = gemm_problems(x0, m["k"], weights["w13"], weights["w2"],
                                           m["activation"], m["quant"])
        for label, config, variant in candidates(model, T):
            if time.time() > deadline:
                RESULTS.append(dict(kind="time", model=model, T=T, config=label, skipped="deadline"))
                continue
            used = config or default_config(problem1)
            row = dict(kind="time", model=model, quant=m["quant"], T=T, config=label,
                       gemm1=used.__dict__, gemm2=(config or default_config(problem2)).__dict__,
                       variant=variant or "", floor_bytes_us=floor_us, bytes=bytes_, flops=flops)
            try:
                if TINY:
                    us = None
                    call(model, weights, *sets[0], config, variant)
                else:
                    us = time_graph([lambda s=s: call(model, weights, *s, config, variant)
                                     for s in sets])
                row.update(us=us)
                if us:
                    row.update(frac_bytes=floor_us / us, TBps=bytes_ / us / 1e6,
                               TFLOPs=flops / us / 1e6)
            except Exception as exc:  # noqa: BLE001
                row.update(us=None, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc()
            RESULTS.append(row)
            log(f"{model} T={T:5d} {label:18s} " + (
                f"{row['us']:9.1f} us  frac {row['frac_bytes']:.2f}  {row['TBps']:.2f} TB/s  "
                f"{row['TFLOPs']:6.1f} TFLOP/s" if row.get("us") else str(row.get("error", "-"))))


def save(out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "fp4_results.json")
    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                torch=torch.__version__, elapsed_s=time.time() - START)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=RESULTS), f, indent=1)
    return path


def print_table() -> None:
    print(f"\n{'model':13} {'T':>6} {'config':18} {'us':>9} {'floor us':>9} {'frac':>5} "
          f"{'TB/s':>5} {'TFLOP/s':>7}")
    for r in RESULTS:
        if r["kind"] != "time" or not r.get("us"):
            continue
        print(f"{r['model']:13} {r['T']:6d} {r['config']:18} {r['us']:9.1f} "
              f"{r['floor_bytes_us']:9.1f} {r['frac_bytes']:5.2f} {r['TBps']:5.2f} "
              f"{r['TFLOPs']:7.1f}")
    bad = [r for r in RESULTS if r["kind"] == "check" and not r["ok"]]
    print(f"\nchecks: {sum(r['kind'] == 'check' for r in RESULTS) - len(bad)} ok, {len(bad)} failed"
          + "".join(f"\n  FAIL {r['model']} T={r['T']} {r['config']}: {r.get('err')} "
                    f"{r.get('error', '')}" for r in bad))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--deadline-s", type=float, default=165.0,
                    help="skip the measurements left after this many seconds (default 165)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--labels", nargs="+", help="time only these candidates (e.g. dflt)")
    ap.add_argument("--out", default=os.environ.get("MOE_OPS_RESULTS_DIR") or "out")
    ap.add_argument("--tiny", action="store_true", help="interpreter smoke test (CPU)")
    args = ap.parse_args()
    global LABELS
    LABELS = set(args.labels) if args.labels else None
    known = {label for table in (DECODE, MID, PREFILL) for label, _, _ in table}
    if LABELS is not None and LABELS - known:
        ap.error(f"--labels: unknown {sorted(LABELS - known)}; known: {sorted(known)}")
    deadline = START + args.deadline_s
    if not TINY and not torch.cuda.is_available():
        print("dev_fp4_gpu: no CUDA device (--tiny runs the script on the CPU interpreter)")
        return 1
    for model in args.models:
        log(f"{model}: building weights")
        weights = make_weights(model)
        if not args.no_check:
            check(model, weights, deadline)
        bench(model, weights, [t for t in args.tokens if not TINY or t <= 64], deadline)
        del weights
        if not TINY:
            torch.cuda.empty_cache()
        log(f"wrote {save(args.out)}")
    print_table()
    return 0 if all(r.get("ok", True) for r in RESULTS if r["kind"] == "check") else 1


if __name__ == "__main__":
    sys.exit(main())
