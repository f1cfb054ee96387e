"""How fast the DRAM streams a weight matrix read the way the decode GEMMs read it.

A decode tile program of kernels/grouped_gemm.py reads BLOCK_N consecutive weight rows of K
bytes, one [BLOCK_N, BLOCK_K] slice a K step: BLOCK_N pieces of BLOCK_K bytes, K bytes apart.
This script times exactly that access (no math: each step's slice goes into a [16, BLOCK_K] x [BLOCK_K,
BLOCK_N] fp8 dot as in the GEMM) over a matrix far larger than the L2, beside two other orders of the same bytes:

- ``rows``: the GEMM's order (a row's BLOCK_K-byte piece, the next row's piece, ...);
- ``blocked``: the program's region read as consecutive BLOCK_N * BLOCK_K-byte chunks (what a
  weight layout stored tile by tile would give the same program);
- ``stream``: a plain streaming read, 8 programs an SM each reading contiguous 16 KB chunks
  (the PERFORMANCE ceiling's kernel shape).

If ``rows`` reaches ``stream``, the GEMMs' shortfall at T = 4-16 (0.91-0.92 of 4.55 TB/s) is not
their access order; if ``blocked`` is faster, a tile-ordered weight layout is worth its cost.

    python benchmarks/dev_dram_pattern.py [--gib 1] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_ops.tuning import cuda_event_timer  # noqa: E402


@triton.jit
def _read_kernel(w_ptr, x_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCKED: tl.constexpr, STAGES: tl.constexpr):
    """One program: BLOCK_N rows of K e4m3 bytes, in K steps of BLOCK_K bytes a row, each step
    a [16, BLOCK_K] x [BLOCK_K, BLOCK_N] dot as the GEMM's (so Triton pipelines the loads as
    it does there)."""
    pid = tl.program_id(0).to(tl.int64)
    base = w_ptr + pid * BLOCK_N * K
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + tl.arange(0, 16)[:, None] * BLOCK_K + cols[None, :])
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for step in tl.range(0, K // BLOCK_K, num_stages=STAGES):
        if BLOCKED:
            offs = step * (BLOCK_N * BLOCK_K) + rows[:, None] * BLOCK_K + cols[None, :]
        else:
            offs = rows[:, None] * K + step * BLOCK_K + cols[None, :]
        acc = tl.dot(x, tl.trans(tl.load(base + offs)), acc)
    tl.store(out_ptr + pid * 16 * BLOCK_N + tl.arange(0, 16)[:, None] * BLOCK_N + rows[None, :],
             acc)


@triton.jit
def _stream_kernel(w_ptr, out_ptr, chunks, CHUNK4: tl.constexpr, STAGES: tl.constexpr):
    """A grid-stride streaming read: program p reads chunks p, p + grid, ... of CHUNK4 words."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, CHUNK4)
    acc = tl.zeros((CHUNK4,), dtype=tl.int32)
    for c in tl.range(pid, chunks, grid, num_stages=STAGES):
        acc ^= tl.load(w_ptr + c * CHUNK4 + offs)   # < 2^31 words for <= 8 GiB
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def time_us(fn) -> float:
    """Median CUDA-event time of fn in us (tuning's timer; the matrix is far past the L2: no
    flush)."""
    return cuda_event_timer(fn, warmup=1, repeat=20) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="matrix size (GiB)")
    parser.add_argument("--ks", type=int, nargs="+", default=[7168, 4096, 2048],
                        help="row lengths in bytes (the GEMMs' K of 1-byte weights)")
    parser.add_argument("--out", default=None, help="JSON of every row")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nbytes = int(args.gib * 2**30) // (1 << 20) * (1 << 20)
    w = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev)
    out = torch.empty(1 << 26, dtype=torch.float32, device=dev)
    w8 = w.view(torch.float8_e4m3fn)
    x = torch.randn(16 * 1024, device=dev).to(torch.float8_e4m3fn)
    rows = []

    def record(kind, k, block_n, block_k, stages, us, used):
        rows.append(dict(kind=kind, k=k, block_n=block_n, block_k=block_k, stages=stages,
                         us=us, bytes=used, tbps=used / us / 1e6))
        print(f"{kind:>8} K={k:5d} tile {block_n:4d} x {block_k:5d} B stages {stages} "
              f"{us:9.1f} us {used / us / 1e6:6.2f} TB/s", flush=True)

    for stages in (3, 4):
        chunks = nbytes // 16384
        used = chunks * 16384
        us = time_us(lambda: _stream_kernel[(8 * sms,)](w, out, chunks, CHUNK4=4096,
                                                         STAGES=stages, num_warps=4))
        record("stream", 0, 0, 16384, stages, us, used)
    for k in args.ks:
        for block_n, block_k in ((128, 128), (128, 256), (64, 128), (64, 256), (32, 256),
                                 (32, 512), (16, 512), (16, 1024)):
            if k % block_k:
                continue
            programs = nbytes // (block_n * k)
            used = programs * block_n * k
            for stages in (3, 4, 6):
                if stages * block_n * block_k > 96 * 1024:
                    continue
                for blocked in (False, True):
                    us = time_us(lambda: _read_kernel[(programs,)](
                        w8, x, out, k, BLOCK_N=block_n, BLOCK_K=block_k,
                        BLOCKED=blocked, STAGES=stages, num_warps=4))
                    record("blocked" if blocked else "rows", k, block_n, block_k, stages, us,
                           used)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(dev), argv=sys.argv, rows=rows), f,
                      indent=1)
    best = {}
    for r in rows:
        key = (r["kind"], r["k"])
        if key not in best or r["tbps"] > best[key]["tbps"]:
            best[key] = r
    print("\nbest a (order, K):")
    for (kind, k), r in sorted(best.items()):
        print(f"  {kind:>8} K={k:5d}: {r['tbps']:.2f} TB/s (tile {r['block_n']} x "
              f"{r['block_k']} B, stages {r['stages']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
