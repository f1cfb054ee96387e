"""fp8 (per-tensor) decode precision on one GPU: the experts call's relative error against the
reference backend over 24 random routed batches, per decode tile config (swap-AB or not, K step)
and promotion interval (grouped_gemm.FP8_PROMOTE_K), with the time of one call (CUDA-graph
replay, median).

    python benchmarks/dev_fp8_decode_precision.py > benchmarks/results/h200_fp8_decode_precision.txt
    python benchmarks/dev_fp8_decode_precision.py qwen3_30b_a3b:fp8:16 llama4_scout:fp8:16  # cases
    (--all: also the first run's variants; --gemm2: GEMM2 alone swapped; --shipped: the tables
    alone)

Why: swap-AB decode tiles (the fp8 MMA with the weight tile on its 64-row side) err about twice
as much as 16-row tiles that are not swapped, and their worst batch passed the 1e-2 bound, when
GEMM1 is swapped (its requantized output amplifies the MMA's small error); so fp8 runs GEMM1's
unswapped (experts.FP8_SWAP_AB, set here per variant) and GEMM2's may swap.
The "exact" variants run the same tiles with the GEMMs' operands converted to fp32 and fp32
FMA dots (the kernels' interpreter path, slow): exact products and sums, so what error remains
is not the MMA's.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from moe_ops.kernels import experts as experts_mod  # noqa: E402
from moe_ops.kernels import grouped_gemm as gg  # noqa: E402
from moe_ops.kernels.grouped_gemm import GemmConfig  # noqa: E402

CASES = tuple(a for a in sys.argv[1:] if not a.startswith("--")) or (
    "mixtral_8x7b:fp8:1", "mixtral_8x7b:fp8:7", "qwen3_30b_a3b:fp8:7", "mixtral_8x7b:fp8:64")


def swapped(block_k: int, stages: int) -> GemmConfig:
    return GemmConfig(16, 64, block_k, 8, 4, stages, swap_ab=True)


# (name, config of both GEMMs (None: the shipped tables; ("gemm2", config): GEMM1 from the
# tables), FP8_PROMOTE_K, exact dots, experts.FP8_SWAP_AB: whether GEMM1's swap-AB configs run
# swapped). "shipped" is what a call runs. (Variants of knobs removed once refuted: the
# twenty-first session's "swap k128 i32" / "i64", grouped_gemm.FP8_IMPRECISE_K, at commit
# 57f664e; the twenty-second's --f16, swapped tiles on f16 operands, FP8_SWAP_F16, at dc6985a.)
VARIANTS = (("shipped", None, 256, False, False),
            ("swap k128 p128", swapped(128, 4), 128, False, True),
            ("swap k256 p256", swapped(256, 4), 256, False, True),
            ("swap 128x128", GemmConfig(16, 128, 128, 8, 4, 4, swap_ab=True), 256, False, True),
            ("noswap k128", GemmConfig(16, 64, 128, 8, 4, 4), 256, False, True),
            ("swap k128 exact", swapped(128, 4), 256, True, True))
# GEMM2 alone swapped (GEMM1 on the tables' unswapped tiles): its output is not requantized,
# so the e4m3 wgmma's small accumulation error (benchmarks/dev_fp8_wgmma_precision.py) is not
# amplified by the intermediate's per-token fp8 rounding as GEMM1's is.
if "--gemm2" in sys.argv:
    VARIANTS = (VARIANTS[0],
                ("swap2 k128", ("gemm2", swapped(128, 4)), 256, False, True),
                ("swap2 128x128", ("gemm2", GemmConfig(16, 128, 128, 8, 4, 4, swap_ab=True)),
                 256, False, True),
                ("swap2 k256", ("gemm2", swapped(256, 4)), 256, False, True),
                ("swap2 k256 s3", ("gemm2", swapped(256, 3)), 256, False, True),
                ("swap both k128", swapped(128, 4), 256, False, True))
if "--shipped" in sys.argv:   # what a call runs, alone (e.g. after a re-tune)
    VARIANTS = VARIANTS[:1]
if "--all" in sys.argv:   # the first run's variants too
    VARIANTS += (("swap k128 p256", swapped(128, 4), 256, False, True),
                 ("swap k64 p64", swapped(64, 6), 64, False, True),
                 ("noswap k128 exact", GemmConfig(16, 64, 128, 8, 4, 4), 256, True, True))


def exact_dots(gemm):
    """gemm1 / gemm2 with fp32 operands and FMA dots (the interpreter's upcast path)."""
    def run(*args, **kwargs):
        kwargs["interpret_upcast"] = True
        return gemm(*args, **kwargs)
    return run


def main() -> int:
    shapes = bench.load_shapes()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"git {(bench.git_commit() or {}).get('commit', 'unknown')}")
    for case in CASES:
        quant, tokens, layer = bench.case_layer(shapes, case)
        kw = layer.kernel_weights()
        batches = [bench.routed_inputs(layer, tokens, torch.Generator(device="cuda").manual_seed(s))
                   for s in range(24)]
        refs = [bench.reference_forward(layer, x, topk_ids=ids, topk_weights=w).float()
                for x, ids, w in batches]

        def call(x, ids, w, config):
            config1 = config2 = config
            if isinstance(config, tuple):   # ("gemm2", config): GEMM1 from the tables
                config1, config2 = None, config[1]
            return experts_mod.triton_experts(
                x, ids, w, kw["w13"], kw["w2"], kw.get("w13_scale"), kw.get("w2_scale"), None,
                None, activation=layer.activation, quant=quant, gemm1_config=config1,
                gemm2_config=config2)

        for name, config, promote_k, exact, swap_ab in VARIANTS:
            gg.FP8_PROMOTE_K = promote_k
            experts_mod.FP8_SWAP_AB = swap_ab
            experts_mod.gemm1 = exact_dots(gg.gemm1) if exact else gg.gemm1
            experts_mod.gemm2 = exact_dots(gg.gemm2) if exact else gg.gemm2
            errors = [float((call(x, ids, w, config).float() - ref).norm() / ref.norm())
                      for (x, ids, w), ref in zip(batches, refs)]
            x, ids, w = batches[0]
            us = triton.testing.do_bench_cudagraph(lambda: call(x, ids, w, config), rep=30,
                                                   return_mode="median") * 1e3
            print(f"{case:22} {name:16} median {statistics.median(errors):.2e} "
                  f"max {max(errors):.2e} {us:8.1f} us", flush=True)
        gg.FP8_PROMOTE_K = 256
        experts_mod.FP8_SWAP_AB = False
        experts_mod.gemm1, experts_mod.gemm2 = gg.gemm1, gg.gemm2
        del layer, kw
    return 0


if __name__ == "__main__":
    sys.exit(main())
