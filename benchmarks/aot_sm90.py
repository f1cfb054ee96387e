"""Compile the tile GEMM kernel for sm_90 without a GPU: every tile-kernel config of the shipped
tables (moe_ops/tuned/) for the given modes, with the constexprs the launcher passes (fp8 per
tensor: swap-AB configs unswapped, as experts.FP8_SWAP_AB = False runs them). Prints, per config,
the MMA the build uses (wgmma / mma.sync) and its shared memory; a config that fails to compile
(ptxas included) is listed as FAIL and the exit status is 1. A check to run before a GPU session
after editing the kernel or the config rules; it proves nothing about speed or results.

    python benchmarks/aot_sm90.py --quant fp8
    python benchmarks/aot_sm90.py --quant none fp8 fp8_block --direct both
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from moe_ops.kernels import experts as experts_mod  # noqa: E402
from moe_ops.kernels import grouped_gemm as gg  # noqa: E402
from moe_ops.kernels.grouped_gemm import GemmConfig  # noqa: E402

POINTER_TYPES = dict(a_scale_ptr="*fp32", w_scale_ptr="*fp32", bias_ptr="*fp32",
                     w_global_scale_ptr="*fp32", sorted_pair_ids_ptr="*i32",
                     block_expert_ids_ptr="*i32", topk_ids_ptr="*i32", topk_weights_ptr="*fp32")


def table_configs(quants: list[str]) -> list[tuple[str, int, int, GemmConfig]]:
    """(quant, gemm, K, config) of every tile-kernel entry of the shipped tables."""
    found = []
    for path in sorted((ROOT / "moe_ops" / "tuned").glob("*.json")):
        for key, entry in json.loads(path.read_text())["entries"].items():
            fields = dict(part.split("=", 1) for part in key.split(";"))
            config = GemmConfig(**entry["config"])
            if fields["quant"] in quants and not config.persistent:
                found.append((fields["quant"], int(fields["gemm"]), int(fields["k"]), config))
    return found


def compile_config(quant: str, gemm: int, k: int, config: GemmConfig, direct: bool):
    atomic = config.split_k > 1
    operand = "*bf16" if quant == "none" else "*fp8e4nv"
    consts = dict(
        ALIGN_BLOCK_M=config.block_m, DIRECT=direct, GATHER_A=gemm == 1, ATOMIC_OUT=atomic,
        QUANT=quant, ACTIVATION="swiglu" if gemm == 1 else "none", HAS_BIAS=False,
        MUL_ROUTED_WEIGHT=gemm == 2, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, SWAP_AB=config.swap_ab, UPCAST=False,
        DOT_PRECISION="tf32", EVEN_K=k % config.block_k == 0, FAST_FP4=False,
        SPLIT_K=config.split_k,
        PROMOTE_STEPS=max(1, gg.FP8_PROMOTE_K // config.block_k) if quant == "fp8" else 1,
        USE_PDL=True)
    signature = {}
    for name in inspect.signature(gg._grouped_gemm_kernel.fn).parameters:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("a_ptr", "w_ptr"):
            signature[name] = operand
        elif name == "out_ptr":
            signature[name] = "*fp32" if atomic else "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES[name]
        elif name in ("alpha", "limit"):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if name == "stride_we" else "i32"
    return triton.compile(ASTSource(fn=gg._grouped_gemm_kernel, signature=signature,
                                    constexprs=consts),
                          target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", nargs="+", default=["fp8"], choices=["none", "fp8", "fp8_block"])
    parser.add_argument("--direct", choices=["no", "yes", "both"], default="both",
                        help="build the direct-dispatch (tiny batch) form, the sorted one, or both")
    args = parser.parse_args()
    directs = {"no": (False,), "yes": (True,), "both": (False, True)}[args.direct]
    seen, failures = set(), 0
    for quant, gemm, k, config in table_configs(args.quant):
        if quant == "fp8" and config.swap_ab and not experts_mod.FP8_SWAP_AB:
            config = dataclasses.replace(config, swap_ab=False)
        for direct in directs:
            key = (quant, gemm, k % config.block_k == 0, config, direct)
            if key in seen:
                continue
            seen.add(key)
            start = time.time()
            name = f"{quant:9} gemm{gemm} {config} direct={direct}"
            try:
                kernel = compile_config(quant, gemm, k, config, direct)
            except Exception as exc:  # noqa: BLE001 - report every failing build
                failures += 1
                print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            ptx = kernel.asm["ptx"]
            mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
            print(f"ok   {name}: {mma}, shared {kernel.metadata.shared} B "
                  f"({time.time() - start:.1f} s)", flush=True)
    print(f"{len(seen) - failures} built, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
