"""How many bytes a persistent grouped GEMM's tile order reads from DRAM: a model, no GPU.

The persistent kernels (ws_gemm, grouped_gemm's persistent kernel) hand tile t to program
t % P, so the tiles of one round (P consecutive tiles) run side by side. Each tile reads its
activation rows (BM x BK a K step) and its expert's weight rows (BN x BK) for every K step; a
chunk already read by a tile of the same or a recent round may still be in the L2. This
script replays that order through an LRU cache of the L2's size (rounds in lockstep, the K
steps of a round interleaved across its tiles) and counts the bytes that miss: a model of
DRAM reads against the weights' own bytes, to tell which (model, T, tile, order) re-reads
weights before spending GPU time on it. Calibrated against Nsight Compute on the H200
(results/h200_ncu_layer_deepseek_v3_fp8_block_4096_l2*_twentyeighth.csv: DeepSeek-V3 fp8_block
T = 4096, "cols" tiles, GEMM1 9.49 GB from DRAM with the fixed windows of 8 row blocks, 8.38
with the windows cut at the experts' boundaries; GEMM2 4.48 / 3.84 GB).

Orders: "windows" (GROUP_M row blocks walk the column blocks together: ws_gemm and
grouped_gemm), "experts" (the windows cut at the experts' boundaries: ws_gemm.EXPERT_GROUPS),
"rows" (row-major: each row block walks every column block, ws_fp4's order).

    python benchmarks/dev_l2_order.py                       # the calibration cases
    python benchmarks/dev_l2_order.py --cases mixtral_8x7b:none:4096:1:128:256:64:2
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np

PROGRAMS = 132

# model: (experts, top_k, hidden, intermediate)
MODELS = {"deepseek_v3": (256, 8, 7168, 2048), "mixtral_8x7b": (8, 2, 4096, 14336),
          "qwen3_30b_a3b": (128, 8, 2048, 768), "llama4_scout": (16, 1, 5120, 8192),
          "gpt_oss_120b": (128, 4, 2880, 2880)}
# bytes a weight value: quant -> (weights, activations)
BYTES = {"none": (2, 2), "fp8": (1, 1), "fp8_block": (1, 1), "nvfp4": (0.5, 2),
         "mxfp4": (0.5, 2)}
# model:quant:T:gemm:BM:BN:BK, the tiles of the warp-specialized kernel there: the measured cases
CALIBRATION = ["deepseek_v3:fp8_block:4096:1:64:256:128", "deepseek_v3:fp8_block:4096:2:64:256:128"]


def expert_rows(num_experts: int, top_k: int, tokens: int, seed: int) -> np.ndarray:
    """Routed rows of each expert for uniform random routing (k distinct experts a token)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(num_experts, dtype=np.int64)
    for start in range(0, tokens, 4096):
        n = min(4096, tokens - start)
        picks = np.argpartition(rng.random((n, num_experts)), top_k, axis=1)[:, :top_k]
        counts += np.bincount(picks.ravel(), minlength=num_experts)
    return counts


def block_experts(rows: np.ndarray, bm: int) -> np.ndarray:
    """The expert of each BM-row block of the dispatch (each expert's rows padded to BM)."""
    return np.repeat(np.arange(len(rows)), (rows + bm - 1) // bm)


def tile_order(experts_of_blocks: np.ndarray, num_n: int, order: str, group_m: int):
    """(row block, column block) of each tile index, as the kernels' _tile_coords: groups of
    group_m row blocks ("experts": cut at the experts' boundaries), each walking the column
    blocks with its row blocks side by side; "rows": row-major."""
    num_m = len(experts_of_blocks)
    tiles = []
    if order == "rows":
        return [(m, n) for m in range(num_m) for n in range(num_n)]
    first = 0
    while first < num_m:
        size = min(group_m, num_m - first)
        if order == "experts":
            window_end = min((first // group_m + 1) * group_m, num_m)
            size = 1
            while (first + size < window_end
                   and experts_of_blocks[first + size] == experts_of_blocks[first]):
                size += 1
        tiles.extend((first + i % size, i // size) for i in range(size * num_n))
        first += size
    return tiles


def dram_bytes(tiles, experts_of_blocks, k_steps, a_chunk, w_chunk, cache_bytes, programs):
    """Bytes missing an LRU cache of cache_bytes when the tiles run in rounds of `programs`,
    each round's K steps interleaved across its tiles. Returns (activation, weight) bytes."""
    cache = collections.OrderedDict()
    held = 0
    missed = [0, 0]

    def touch(key, size, kind):
        nonlocal held
        if key in cache:
            cache.move_to_end(key)
            return
        missed[kind] += size
        cache[key] = size
        held += size
        while held > cache_bytes:
            _, gone = cache.popitem(last=False)
            held -= gone

    for start in range(0, len(tiles), programs):
        round_tiles = tiles[start:start + programs]
        for step in range(k_steps):
            for m, n in round_tiles:
                touch(("a", m, step), a_chunk, 0)
                touch(("w", int(experts_of_blocks[m]), n, step), w_chunk, 1)
    return missed


def run_case(text: str, orders, group_m: int, cache_bytes: int, seed: int,
             programs: int = PROGRAMS) -> list[dict]:
    model, quant, tokens, gemm, bm, bn, bk = text.split(":")
    tokens, gemm, bm, bn, bk = int(tokens), int(gemm), int(bm), int(bn), int(bk)
    num_experts, top_k, hidden, inter = MODELS[model]
    n, k = (2 * inter, hidden) if gemm == 1 else (hidden, inter)
    w_value, a_value = BYTES[quant]
    rows = expert_rows(num_experts, top_k, tokens, seed)
    blocks = block_experts(rows, bm)
    num_n, k_steps = -(-n // bn), -(-k // bk)
    weights = float(np.count_nonzero(rows)) * n * k * w_value
    out = []
    for order in orders:
        tiles = tile_order(blocks, num_n, order, group_m)
        a_bytes, w_bytes = dram_bytes(tiles, blocks, k_steps, bm * bk * a_value,
                                      bn * bk * w_value, cache_bytes, programs)
        out.append(dict(case=text, order=order, tiles=len(tiles), row_blocks=len(blocks),
                        weights_gb=weights / 1e9, weight_reads_gb=w_bytes / 1e9,
                        activation_reads_gb=a_bytes / 1e9,
                        weight_factor=w_bytes / weights))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=CALIBRATION,
                    help="model:quant:T:gemm:BM:BN:BK")
    ap.add_argument("--orders", nargs="+", default=["windows", "experts", "rows"],
                    choices=["windows", "experts", "rows"])
    ap.add_argument("--group-m", type=int, default=8)
    ap.add_argument("--l2-mb", type=float, nargs="+", default=[50.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--programs", type=int, default=PROGRAMS,
                    help="tiles side by side (the persistent kernels: one program an SM; the "
                         "tile kernels: their resident blocks)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    print(f"{'case':44} {'order':8} {'L2 MB':>6} {'weights GB':>10} {'W read GB':>10} "
          f"{'x':>5} {'A read GB':>10}")
    for case in args.cases:
        for l2_mb in args.l2_mb:
            for row in run_case(case, args.orders, args.group_m, int(l2_mb * (1 << 20)),
                                args.seed, args.programs):
                row["l2_mb"] = l2_mb
                results.append(row)
                print(f"{case:44} {row['order']:8} {l2_mb:6.0f} {row['weights_gb']:10.2f} "
                      f"{row['weight_reads_gb']:10.2f} {row['weight_factor']:5.2f} "
                      f"{row['activation_reads_gb']:10.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(["python"] + sys.argv), results=results), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
