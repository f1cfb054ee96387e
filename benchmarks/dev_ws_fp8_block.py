"""fp8_block prefill GEMM experiment: moe_ops.kernels.ws_gemm (the warp-specialized Gluon
kernel) beside grouped_gemm's Triton kernels, on the same dispatch-ordered rows.

The problem is one GEMM of a model's experts at T tokens (random uniform routing): GEMM1's
shape and GEMM2's, both in GEMM2's form (rows read in dispatch order, one output row per
routed pair times a routing weight of 1), so every kernel computes the same thing. --model
deepseek_v3 (default): fp8_block, 256 experts, top_k 8, GEMM1 N = 4096, K = 7168, GEMM2
N = 7168, K = 2048; A_sorted [M_pad, K] e4m3 with scales [M_pad, K/128] fp32, W [E, N, K] e4m3
with scales [E, N/128, K/128]. --model mixtral_8x7b: fp8 per tensor, 8 experts, top_k 2,
GEMM1 N = 28672, K = 4096, GEMM2 N = 4096, K = 14336; one scale per row and per weight row;
--model qwen3_30b_a3b: fp8 per tensor, 128 experts, top_k 8, GEMM1 N = 1536, K = 2048, GEMM2
N = 2048, K = 768.
Each expert's rows padded to 128. Variants: "ours persistent" / "ours tile" (grouped_gemm's
kernels with the tables' prefill config for the model), "package rows" / "package cols"
(ws_gemm's two tile forms), the same with the epilogue's stores from the MMA layout
("mma-store"), the 128-row tiles with the padding-half skip (ws_gemm.SKIP_PADDING), the
staggered consumers ("stagger n/s": a ring of n slots, consumer 1 s K steps behind;
ws_gemm.STAGGER), and for fp8_block the 128 x 256 tiles ("package wide").

Every run: output poisoned with NaN, compared with an fp32 torch reference (relative Frobenius
error over the real rows; a NaN left means an unwritten row); timing by triton.testing.do_bench,
median; TFLOP/s over the real pairs (2 * T * 8 * N * K). Note that fp8 MMA throughput follows
the data (the clocks follow its power draw): compare variants within one run, not with a run
on other data.

The kernel's first form (a bare kernel written in this script: slot-row output, 4-6 stages, an
in-warpgroup pipelined promotion) was measured at commit 4b37548 with this script there
(results/h200_ws_fp8_block_first.json).

Usage (an H200):
    python benchmarks/dev_ws_fp8_block.py --out benchmarks/results
    python benchmarks/dev_ws_fp8_block.py --variants package --tokens 16384
    python benchmarks/dev_ws_fp8_block.py --model mixtral_8x7b --out benchmarks/results
    python benchmarks/dev_ws_fp8_block.py --model qwen3_30b_a3b --probe --out benchmarks/results
Without a GPU (the package kernel's sm_90 builds: registers, shared memory, SASS):
    python benchmarks/dev_ws_fp8_block.py --aot
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK_M = 128   # the dispatch alignment here (both tile forms divide it)


def aot():
    """Build each tile form and epilogue for sm_90 and print what the build holds."""
    from aot_sm90 import main_loop, resource_usage
    from moe_ops.kernels import ws_gemm
    for tile in ws_gemm.TILES:
        for gemm, activation in ((1, "swiglu"), (2, "none")):
            kernel = ws_gemm.compile_sm90(tile=tile, gemm=gemm, activation=activation)
            sass = main_loop(kernel)
            ops = collections.Counter(i.split()[0].split(".")[0] for i in sass)
            print(f"{tile} gemm{gemm} {activation}: {resource_usage(kernel)}, shared "
                  f"{kernel.metadata.shared} B, longest loop {len(sass)} SASS instructions "
                  f"({dict(ops.most_common(6))})", flush=True)


# ---------------------------------------------------------------------------------------------
# The GPU run: correctness against an fp32 reference, then timing beside our Triton kernel.
# ---------------------------------------------------------------------------------------------

# model -> (quant, experts, top_k, (GEMM1 N, K), (GEMM2 N, K), our Triton kernel's prefill
# config from the shipped tables: block m, n, k, group_m, warps)
MODELS = {
    "deepseek_v3": ("fp8_block", 256, 8, (4096, 7168), (7168, 2048), (64, 128, 128, 16, 4)),
    "mixtral_8x7b": ("fp8", 8, 2, (28672, 4096), (4096, 14336), (128, 128, 256, 8, 8)),
    # (the Triton config: a prefill tile of the kind the tables hold, for the probe's shapes)
    "qwen3_30b_a3b": ("fp8", 128, 8, (1536, 2048), (2048, 768), (128, 128, 128, 8, 8)),
}


def probe(args):
    """Where a GEMM2's time goes (--probe): the package's tile forms on the model's GEMM2
    shape, checked against the reference, then timed only: with every pair's row stored into
    one row of the output (stride 0: the same instructions and store count, no DRAM writes),
    with K doubled (the K loop's share: t(2K) - t(K) is K's steps, 2 t(K) - t(2K) what a tile
    costs besides them: epilogue, ring ramp), and with fewer ring slots; each of those with
    ws_gemm's OVERLAP ("overlap") and EARLY_EPILOGUE ("early") off and on, not on "wide", and
    with other tile orders (--group-m: how many SMs read one weight tile or one row block at
    once)."""
    from triton.testing import do_bench
    from bench import check_and_time
    from moe_ops.kernels import ws_gemm
    dev = torch.device("cuda")
    quant, E, top_k, _, (N, K), _ = MODELS[args.model]
    tiles = args.tiles or (["rows", "cols"] + (["wide"] if quant == "fp8_block" else []))
    rows = []
    for T in args.tokens:
        for k_mult in args.k_mults:
            pb = make_problem(T, top_k, E, N, K * k_mult, dev, seed=T + N, quant=quant)
            flops = 2.0 * pb["pairs"] * N * K * k_mult
            out_pairs = torch.empty((pb["pairs"], N), dtype=torch.bfloat16, device=dev)
            one_row = torch.empty(N, dtype=torch.bfloat16, device=dev).as_strided(
                (pb["pairs"], N), (0, 1))
            ref_rows = reference(pb)[pb["real_slots"]] if k_mult == 1 else None
            for tile in tiles:
                # ("rows": both ring depths named, so that K and 2K run the same ring)
                forms = [(0, 0, "rows"), (0, 0, "one row")]
                if tile != "wide":
                    forms += [(1, 0, "rows"), (1, 1, "rows"), (0, 1, "rows")]
                if args.forms:
                    forms = [f for f in forms if f"{f[0]}{f[1]}" in args.forms]
                for group_m, stages, (overlap, early, store) in itertools.product(
                        args.group_m, ([6, 4] if tile == "rows" else [None]) * args.repeat,
                        forms):
                    name = (f"{tile} K x{k_mult} {store}"
                            + (f" {stages} slots" if stages else "")
                            + (" overlap" if overlap else "") + (" early" if early else "")
                            + (f" group {group_m}" if group_m else ""))
                    saved = ws_gemm.RING_STAGES
                    saved_group_m = ws_gemm.GROUP_M
                    ws_gemm.RING_STAGES = stages or saved
                    ws_gemm.GROUP_M = group_m or saved_group_m
                    out = out_pairs if store == "rows" else one_row
                    fn = (lambda: run_package(pb, out, tile, overlap=bool(overlap),
                                              early=bool(early)))
                    try:
                        if ref_rows is not None and store == "rows":
                            got = check_and_time(fn, out_pairs, ref_rows, warmup=5, rep=60)
                        else:
                            got = dict(ms=do_bench(fn, warmup=5, rep=60), rel_err=0.0,
                                       unwritten=False)
                        rows.append(dict(T=T, variant=name, ms=got["ms"],
                                         rel_err=got["rel_err"], unwritten=got["unwritten"],
                                         tflops=flops / got["ms"] / 1e9))
                    except Exception as exc:  # noqa: BLE001 - record and go on
                        rows.append(dict(T=T, variant=name, error=repr(exc)[:400]))
                    finally:
                        ws_gemm.RING_STAGES = saved
                        ws_gemm.GROUP_M = saved_group_m
                    print(rows[-1], flush=True)
            del ref_rows, out_pairs, pb
            torch.cuda.empty_cache()
    report(args, f"ws_probe_{args.model}.json", quant, rows, [("T", ">6"), ("variant", "28")])


def report(args, name, quant, rows, name_columns):
    """The records into --out/name (if given), then the closing table."""
    from bench import print_variant_table
    if args.out:
        import bench
        bench.write_records(os.path.join(args.out, name),
                            [dict(r, model=args.model, quant=quant) for r in rows])
    print_variant_table(rows, name_columns, [("ms", "8.3f"), ("tflops", "8.1f")])


def make_problem(tokens, top_k, E, N, K, device, seed=0, quant="fp8_block"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pairs = tokens * top_k
    experts = torch.randint(0, E, (pairs, ), generator=g)
    counts = torch.bincount(experts, minlength=E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    m_pad = int(padded.sum())
    # rows of each expert in a run of its padded length; padding rows get random data too
    a32 = torch.randn(m_pad, K, generator=g)
    w32 = torch.randn(E, N, K, generator=g)
    if quant == "fp8_block":
        a_scale = torch.rand(m_pad, K // 128, generator=g) * 0.02 + 0.001
        w_scale = torch.rand(E, N // 128, K // 128, generator=g) * 0.02 + 0.001
    else:  # fp8 per tensor: one scale per row, one per weight row
        a_scale = torch.rand(m_pad, generator=g) * 0.02 + 0.001
        w_scale = torch.rand(E, N, generator=g) * 0.02 + 0.001
    block_expert = torch.repeat_interleave(torch.arange(E, dtype=torch.int32),
                                           (padded // BLOCK_M))
    # slot -> pair id (our dispatch's sorted_pair_ids): each expert's real pairs first, then
    # padding slots holding `pairs` (masked by the kernels)
    sorted_pair_ids = torch.full((m_pad, ), pairs, dtype=torch.int32)
    real_slots = torch.cat([torch.arange(int(s), int(s) + int(c)) for s, c in
                            zip(torch.cumsum(padded, 0) - padded, counts)])
    sorted_pair_ids[real_slots] = torch.arange(pairs, dtype=torch.int32)
    topk_ids = torch.empty(pairs, dtype=torch.int32)
    slot_experts = block_expert.repeat_interleave(BLOCK_M)
    topk_ids[sorted_pair_ids[real_slots].long()] = slot_experts[real_slots]
    a = a32.clamp(-448, 448).to(torch.float8_e4m3fn)
    w = w32.clamp(-448, 448).to(torch.float8_e4m3fn)
    return dict(a=a.to(device), a_scale=a_scale.to(device), w=w.to(device),
                w_scale=w_scale.to(device), block_expert_ids=block_expert.to(device),
                num_padded=torch.tensor([m_pad], dtype=torch.int32, device=device),
                sorted_pair_ids=sorted_pair_ids.to(device), topk_ids=topk_ids.to(device),
                real_slots=real_slots.to(device), m_pad=m_pad, pairs=pairs, padded=padded,
                quant=quant, top_k=top_k)


def reference(pb):
    """fp32 C = (A * a_scale) @ (W[e] * w_scale)^T, expert by expert."""
    a = pb["a"].float()
    block = pb["quant"] == "fp8_block"
    a_s = pb["a_scale"].repeat_interleave(128, dim=1) if block else pb["a_scale"][:, None]
    out = torch.empty(pb["m_pad"], pb["w"].shape[1], device=a.device)
    start = 0
    for e, n_rows in enumerate(pb["padded"].tolist()):
        if n_rows == 0:
            continue
        if block:
            w_s = pb["w_scale"][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        else:
            w_s = pb["w_scale"][e][:, None]
        w = pb["w"][e].float() * w_s
        out[start:start + n_rows] = (a[start:start + n_rows] * a_s[start:start + n_rows]) @ w.T
        start += n_rows
    return out


def run_ours(pb, out_pairs, config):
    """moe_ops' Triton kernel on the same rows (GEMM2's form: reads the rows in dispatch order,
    writes one row per pair times a routing weight of 1) with `config`."""
    from moe_ops.kernels import grouped_gemm as gg
    routing = gg.Routing(topk_ids=pb["topk_ids"], topk_weights=torch.ones(
        pb["pairs"], device=pb["a"].device), top_k=pb["top_k"], num_experts=pb["w"].shape[0],
        local_expert_offset=0, sorted_pair_ids=pb["sorted_pair_ids"],
        block_expert_ids=pb["block_expert_ids"], align_block_m=BLOCK_M,
        num_padded=pb["num_padded"])
    gg.gemm2(pb["a"], pb["a_scale"], pb["w"], pb["w_scale"], None, out_pairs, routing, config,
             quant=pb["quant"], atomic_out=False)


def run_package(pb, out_pairs, tile, coalesced=True, skip_padding=False, stagger=None,
                overlap=None, early=None):
    """moe_ops.kernels.ws_gemm (this kernel as the package runs it: GEMM2's epilogue, one row
    per pair times a routing weight of 1) on the same rows. stagger: (ring slots, steps) of
    the staggered consumers (ws_gemm.STAGGER); overlap, early: ws_gemm.gemm's."""
    from moe_ops.kernels import grouped_gemm as gg, ws_gemm
    routing = gg.Routing(topk_ids=pb["topk_ids"], topk_weights=torch.ones(
        pb["pairs"], device=pb["a"].device), top_k=pb["top_k"], num_experts=pb["w"].shape[0],
        local_expert_offset=0, sorted_pair_ids=pb["sorted_pair_ids"],
        block_expert_ids=pb["block_expert_ids"], align_block_m=BLOCK_M,
        num_padded=pb["num_padded"])
    saved = (ws_gemm.COALESCED_STORE, ws_gemm.SKIP_PADDING, ws_gemm.RING_STAGES,
             ws_gemm.STAGGER)
    ws_gemm.COALESCED_STORE, ws_gemm.SKIP_PADDING = coalesced, "1" if skip_padding else "0"
    if stagger is not None:
        ws_gemm.RING_STAGES, ws_gemm.STAGGER = stagger
    try:
        ws_gemm.gemm(pb["a"], pb["a_scale"], pb["w"], pb["w_scale"], None, out_pairs, routing,
                     gemm=2, activation="none", tile=tile, quant=pb["quant"],
                     overlap=overlap, early=early)
    finally:
        (ws_gemm.COALESCED_STORE, ws_gemm.SKIP_PADDING, ws_gemm.RING_STAGES,
         ws_gemm.STAGGER) = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--model", choices=sorted(MODELS), default="deepseek_v3",
                    help="deepseek_v3: fp8_block; mixtral_8x7b, qwen3_30b_a3b: fp8 per tensor")
    ap.add_argument("--probe", action="store_true",
                    help="where GEMM2's time goes: stores, K steps, ring slots (see probe)")
    ap.add_argument("--k-mults", type=int, nargs="+", default=[1, 2],
                    help="--probe: K multiples run (the reference checks K x1 only)")
    ap.add_argument("--tiles", nargs="+", default=None, help="--probe: the tile forms run")
    ap.add_argument("--forms", nargs="+", default=None,
                    help="--probe: the (overlap, early) pairs run, as 00 / 10 / 11 / 01")
    ap.add_argument("--group-m", type=int, nargs="+", default=[0],
                    help="--probe: ws_gemm.GROUP_M values run (the row blocks that walk the "
                         "column blocks together; 0: the module's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--probe: each ring depth's variants run this many times in turn")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="subset of: ours, package (default both)")
    args = ap.parse_args()
    if args.aot:
        aot()
        return
    if args.probe:
        probe(args)
        return
    from bench import check_and_time
    dev = torch.device("cuda")
    rows = []
    from moe_ops.kernels.grouped_gemm import GemmConfig
    quant, E, top_k, shape1, shape2, (bm, bn, bk, group_m, warps) = MODELS[args.model]
    for T in args.tokens:
        for gemm, (N, K) in (("gemm1", shape1), ("gemm2", shape2)):
            pb = make_problem(T, top_k, E, N, K, dev, seed=T + N, quant=quant)
            flops = 2.0 * pb["pairs"] * N * K
            # the reference's real rows in pair order (pair ids were given in slot order)
            ref_rows = reference(pb)[pb["real_slots"]]
            variants = [("ours persistent", True, None), ("ours tile", False, None),
                        ("package rows", None, "rows"), ("package cols", None, "cols"),
                        ("package rows mma-store", None, "rows/mma"),
                        ("package cols mma-store", None, "cols/mma"),
                        ("package rows skip-padding", None, "rows/skip"),
                        ("package rows stagger 6/3", None, "rows/6/3"),
                        ("package rows stagger 6/5", None, "rows/6/5"),
                        ("package cols stagger 5/3", None, "cols/5/3")]
            if quant == "fp8_block":
                # 128 x 256 tiles (ws_gemm.WIDE_BUILDS: fp8_block's GEMM2 form builds without
                # spilling; fp8 per tensor's does not)
                variants.append(("package wide", None, "wide"))
            if args.variants:
                variants = [v for v in variants if v[0].split()[0] in args.variants]
            out_pairs = torch.empty((pb["pairs"], N), dtype=torch.bfloat16, device=dev)
            for name, persistent, pipe in variants:
                try:
                    if pipe is not None:
                        parts = pipe.split("/")
                        stagger = ((int(parts[1]), int(parts[2])) if len(parts) == 3
                                   else None)
                        fn = (lambda: run_package(pb, out_pairs, parts[0],
                                                  not pipe.endswith("/mma"),
                                                  pipe.endswith("/skip"), stagger))
                    else:
                        config = GemmConfig(bm, bn, bk, group_m, warps, 3 if persistent else 4,
                                            persistent=persistent)
                        fn = (lambda: run_ours(pb, out_pairs, config))
                    got = check_and_time(fn, out_pairs, ref_rows, warmup=5, rep=60)
                    rows.append(dict(T=T, gemm=gemm, variant=name, ms=got["ms"],
                                     rel_err=got["rel_err"], unwritten=got["unwritten"],
                                     tflops=flops / got["ms"] / 1e9))
                except Exception as exc:  # noqa: BLE001 - record and go on
                    rows.append(dict(T=T, gemm=gemm, variant=name, error=repr(exc)[:400]))
                print(rows[-1], flush=True)
            del ref_rows, out_pairs, pb
            torch.cuda.empty_cache()
    report(args, f"ws_{quant}.json", quant, rows,
           [("T", ">6"), ("gemm", "6"), ("variant", "24")])


if __name__ == "__main__":
    main()
