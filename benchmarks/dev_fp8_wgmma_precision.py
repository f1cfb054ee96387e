"""How precisely the e4m3 dot of a decode tile accumulates, swapped (wgmma) and not (mma.sync).

One GEMM of decode's shape, out[t, n] = sum_k x[t, k] w[n, k] for 16 token rows and N weight
rows of K columns, both operands e4m3 (random normal values, the weights at a checkpoint's
scale, rounded to e4m3), on a tile kernel as grouped_gemm's fp8 decode tiles form it: the
weight tile [BLOCK_N, BLOCK_K] on the MMA's M side (swapped: Hopper's wgmma, M = 64 rows a
warpgroup) or the token tile on it (unswapped: 16 rows, mma.sync), the K loop accumulating
with `tl.dot(..., acc, max_num_imprecise_acc=IMPRECISE)` (Triton's promotion of the MMA's
partial sum into the fp32 accumulator every IMPRECISE columns; 0: Triton's default for the
shape) or, "fresh", each K step's product into a zeroed partial added to the accumulator by
hand. Against a float64 matmul of the same e4m3 values: the relative Frobenius error and the
largest error over the largest output. Needs a GPU.

    python benchmarks/dev_fp8_wgmma_precision.py
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_kernel(x_ptr, w_ptr, out_ptr, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SWAP: tl.constexpr, IMPRECISE: tl.constexpr, FRESH: tl.constexpr,
                F16: tl.constexpr = False):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=3):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :])
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :])
        if SWAP:   # the weight tile on the MMA's M side
            lhs, rhs = w, x.T
        else:
            lhs, rhs = x, w.T
        if F16:    # e4m3 -> f16 in registers (exact), an f16 MMA
            lhs, rhs = lhs.to(tl.float16), rhs.to(tl.float16)
        if FRESH:
            acc += tl.dot(lhs, rhs)
        elif IMPRECISE > 0:
            acc = tl.dot(lhs, rhs, acc, max_num_imprecise_acc=IMPRECISE)
        else:
            acc = tl.dot(lhs, rhs, acc)
    if SWAP:
        acc = tl.trans(acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


def run(x, w, swap, imprecise, fresh, block_n=64, block_k=128, f16=False):
    n, k = w.shape
    out = torch.full((x.shape[0], n), float("nan"), device=x.device)
    _dot_kernel[(n // block_n,)](x, w, out, n, k, BLOCK_M=x.shape[0], BLOCK_N=block_n,
                                 BLOCK_K=block_k, SWAP=swap, IMPRECISE=imprecise, FRESH=fresh,
                                 F16=f16, num_warps=4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x14336", "1536x2048"],
                        help="NxK weight shapes")
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = [("mma.sync (unswapped)", False, 0, False),
                ("wgmma imprecise 128", True, 128, False),
                ("wgmma imprecise 64", True, 64, False),
                ("wgmma imprecise 32", True, 32, False),
                ("wgmma default", True, 0, False),
                ("wgmma fresh partial", True, 0, True),
                ("wgmma f16 (converted)", True, 0, False, True)]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; 16 token rows, block 64 x 128, errors over {args.seeds} seeds")
    print(f"{'shape':12s} {'variant':22s} {'rel frob':>10s} {'max/max':>10s}")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        rows = {name: [[], []] for name, *_ in variants}
        for _ in range(args.seeds):
            x = torch.randn(16, k, device="cuda").to(torch.float8_e4m3fn)
            w = (torch.randn(n, k, device="cuda") * 8).to(torch.float8_e4m3fn)
            ref = x.double() @ w.double().T
            for name, swap, imprecise, fresh, *f16 in variants:
                out = run(x, w, swap, imprecise, fresh, f16=bool(f16 and f16[0])).double()
                assert not out.isnan().any(), name
                rows[name][0].append(float((out - ref).norm() / ref.norm()))
                rows[name][1].append(float((out - ref).abs().max() / ref.abs().max()))
        for name, (frob, worst) in rows.items():
            print(f"{shape:12s} {name:22s} {max(frob):10.2e} {max(worst):10.2e}", flush=True)


if __name__ == "__main__":
    main()
