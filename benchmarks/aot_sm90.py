"""Compile the tile GEMM kernel for sm_90 without a GPU: every tile-kernel config of the shipped
tables (moe_ops/tuned/) for the given modes, or the configs given, with the constexprs the
launcher passes (fp8 per tensor: GEMM1's swap-AB configs unswapped, as experts.FP8_SWAP_AB =
False runs them; bf16 4-bit weights: the inline-PTX decode) and, approximately, the argument
specializations Triton's launcher makes at run time (pointers, strides, N and K taken as
multiples of 16; without them the build can be another program: byte loads and twice the
instructions for the nvfp4 decode loop; see compile_config for what is not modelled). Prints,
per build, the MMA it uses (wgmma / mma.sync), its shared memory, registers a thread and stack
(spills; cuobjdump, shipped with Triton) and ptxas' performance advisories (C7515: the wgmma
instructions serialized); a build that fails (ptxas
included) is listed as FAIL and the exit status is 1. With --loop, also the main
K loop's SASS (nvdisasm, shipped with Triton): its instructions a K step of one thread, per
weight value, and the most frequent opcodes, the measure of the decode cost of quantized
weights when the loop is bound by instruction issue (the 4-bit decode is: NOTES.md). It proves
nothing about speed or results by itself.

    python benchmarks/aot_sm90.py --quant fp8
    python benchmarks/aot_sm90.py --quant none fp8 fp8_block --direct both
    python benchmarks/aot_sm90.py --quant nvfp4 --configs 16x64x256:4:3:swap --loop
    python benchmarks/aot_sm90.py --prepare nvfp4 mxfp4    # the fp4 preparation kernel instead
    python benchmarks/aot_sm90.py --quant none fp8 fp8_block --digest   # each build's SASS hash

--prepare builds the quantizing fp4 preparation kernel (kernels/prepare.py `_fp4_kernel`,
bf16 source, the tile `_fp4_tiles` picks for DeepSeek-V3's 7168-wide rows) and prints its SASS
instructions a weight value (the kernel has no loop: its instructions up to the EXIT, divided by
the values a thread quantizes), registers and the most frequent opcodes; for nvfp4 also the
build that reduces the next matrix's amax beside its work (`quantize_scatter`'s next_weight).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
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

QUANTS = ("none", "fp8", "fp8_block", "nvfp4", "mxfp4")
POINTER_TYPES = dict(a_scale_ptr="*fp32", w_scale_ptr="*fp32", bias_ptr="*fp32",
                     w_global_scale_ptr="*fp32", sorted_pair_ids_ptr="*i32",
                     block_expert_ids_ptr="*i32", topk_ids_ptr="*i32", topk_weights_ptr="*fp32")
# K of the GEMMs a --configs build assumes (DeepSeek-V3's GEMM1 / gpt-oss' padded one: EVEN_K)
DEFAULT_K = {"none": 4096, "fp8": 4096, "fp8_block": 7168, "nvfp4": 7168, "mxfp4": 3072}


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


def parse_config(text: str) -> GemmConfig:
    """BMxBNxBK:warps:stages[:swap][:splitN], e.g. 16x64x256:4:3:swap."""
    tiles, warps, stages, *flags = text.split(":")
    bm, bn, bk = (int(v) for v in tiles.split("x"))
    split = next((int(f[5:]) for f in flags if f.startswith("split")), 1)
    return GemmConfig(bm, bn, bk, 8, int(warps), int(stages), "swap" in flags, split)


def compile_config(quant: str, gemm: int, k: int, config: GemmConfig, direct: bool):
    atomic = config.split_k > 1
    fp4 = quant in gg.FP4_QUANTS
    consts = dict(
        ALIGN_BLOCK_M=config.block_m, DIRECT=direct, GATHER_A=gemm == 1, ATOMIC_OUT=atomic,
        QUANT=quant, ACTIVATION="swiglu" if gemm == 1 else "none", HAS_BIAS=False,
        MUL_ROUTED_WEIGHT=gemm == 2, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, SWAP_AB=config.swap_ab, UPCAST=False,
        DOT_PRECISION="tf32", EVEN_K=k % config.block_k == 0,
        FAST_FP4=fp4 and config.swap_ab and gg.FP4_FAST_DEQUANT,
        SPLIT_K=config.split_k, NUM_K_STEPS=gg.static_k_steps(quant, k, config),
        USE_PDL=True, **gg.fp8_dot_options(quant, config))
    operand = "*bf16" if quant == "none" or fp4 else "*fp8e4nv"
    signature = {}
    for name in inspect.signature(gg._grouped_gemm_kernel.fn).parameters:
        if name in consts:
            signature[name] = "constexpr"
        elif name == "a_ptr":
            signature[name] = operand
        elif name == "w_ptr":
            signature[name] = "*u8" if fp4 else operand
        elif name == "w_scale_ptr" and fp4:
            signature[name] = "*u8"
        elif name == "out_ptr":
            signature[name] = "*fp32" if atomic else "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES[name]
        elif name in ("alpha", "limit"):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if name == "stride_we" else "i32"
    # The launcher's specialization, approximately: 16-byte aligned pointers, and strides, N
    # and K as multiples of 16 (the 4-bit layout's and bf16 rows' are). Not modelled: strides
    # of 1 (fp8 per tensor's scale strides) become constants, some scale strides are not
    # multiples of 16 (fp8_block's K/128), and counts such as num_experts get the same hint
    # when they are multiples of 16; none of these changed the K loop of the builds compared.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name] != "constexpr"
             and (name.endswith("_ptr") or name.startswith("stride") or name in ("N", "K"))}
    return triton.compile(ASTSource(fn=gg._grouped_gemm_kernel, signature=signature,
                                    constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


def nvidia_tool(name: str, kernel, asm: str, *args: str, check: bool = True) -> str:
    """Output (stdout and stderr) of one of the CUDA tools shipped with Triton (nvdisasm,
    cuobjdump, ptxas) run on the build's `asm` ("cubin" or "ptx") written to a file; `args`
    before the file name, "{out}" in them naming a scratch output path."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"kernel.{asm}"
        data = kernel.asm[asm]
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
        command = [str(tool)] + [a.replace("{out}", str(Path(folder) / "out")) for a in args]
        result = subprocess.run(command + [str(path)], capture_output=True, text=True,
                                check=check)
    return result.stdout + result.stderr


def loops(kernel) -> list[list[str]]:
    """The SASS instructions of each of the kernel's loops (a backward branch and what it
    jumps back over), from nvdisasm."""
    text = nvidia_tool("nvdisasm", kernel, "cubin", "-c")
    instructions, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if found:
            instructions.append(found.group(1).strip())
    found_loops = []
    for end, instruction in enumerate(instructions):
        branch = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", instruction)
        if branch and labels.get(branch.group(1), end + 1) <= end:
            found_loops.append(instructions[labels[branch.group(1)]:end + 1])
    return found_loops


def main_loop(kernel) -> list[str]:
    """The SASS instructions of the kernel's longest loop (the K loop), from nvdisasm."""
    found = loops(kernel)
    if not found:
        raise RuntimeError("no loop (backward branch) found in the kernel's SASS")
    return max(found, key=len)


def resource_usage(kernel) -> str:
    """Registers a thread and stack bytes (spills live there) of the build, from cuobjdump."""
    text = nvidia_tool("cuobjdump", kernel, "cubin", "--dump-resource-usage")
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    return f"{found.group(1)} registers, stack {found.group(2)} B" if found else "registers ?"


def ptxas_advisories(kernel) -> list[str]:
    """ptxas' performance advisories for the build's PTX (e.g. C7515: wgmma instructions
    serialized, each waited for before the next issues), from the ptxas shipped with Triton.
    Triton's own compile does not show them."""
    text = nvidia_tool("ptxas", kernel, "ptx", "-arch=sm_90a", "-v", "-o", "{out}",
                       check=False)
    return [re.sub(r"^ptxas info\s*:\s*", "", line).split(" in the function")[0]
            for line in text.splitlines() if "Performance Loss" in line]


def sass(kernel) -> list[str]:
    """Every SASS instruction of the build, from nvdisasm."""
    text = nvidia_tool("nvdisasm", kernel, "cubin", "-c")
    return [found.group(1).strip() for found in
            (re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line) for line in text.splitlines())
            if found]


def opcode_counts(instructions: list[str], most: int = 8) -> str:
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
                                  for i in instructions)
    return ", ".join(f"{op} {n}" for op, n in opcodes.most_common(most))


def prepare_summary(quant: str, amax_next: bool = False, k: int = 7168) -> str:
    """The quantizing fp4 preparation kernel for sm_90 (see the module doc); amax_next: the
    build that also reduces the next matrix's amax (AMAX_NEXT, a bf16 matrix of the same
    size: one 8 x 512-pair tile a program)."""
    from moe_ops.kernels import prepare

    _, block_n, block_s, align, _ = prepare._fp4_tiles(2 * 2048, k)
    consts = dict(QUANT=quant, SRC="bf16", HW_E4M3=True, EVEN_N=True, SLICES_ALIGN=align,
                  BLOCK_N=block_n, BLOCK_S=block_s)
    if amax_next:
        tile_n, tile_k = prepare._FUSED_AMAX_TILE
        # (as the launcher passes them on an H200; next_col_blocks and next_stride_k are 1, which
        # Triton's launcher makes constants too)
        consts.update(AMAX_NEXT=True, NEXT_SRC="bf16", NEXT_UNIT_K=True, NEXT_EVEN=True,
                      NEXT_BLOCK_N=tile_n, NEXT_BLOCK_K=tile_k, NEXT_ITERS=1, next_stride_k=1,
                      next_col_blocks=1, PAIR_MAX=True)
    types = dict(src_ptr="*i32", dst_ptr="*i32", dst_rows_ptr="*i64", scale_rows_ptr="*i64",
                 scale_ptr="*u8", table_ptr="*fp32", factor2_ptr="*fp32", next_ptr="*i32",
                 next_amax_ptr="*i32")
    parameters = inspect.signature(prepare._fp4_kernel.fn).parameters
    # The optional arguments (the next matrix's amax, AMAX_NEXT) as a launch without them has
    # them: their defaults, constant.
    run_time = ({"next_ptr", "next_amax_ptr", "next_rows", "next_cols", "next_tiles",
                 "next_stride_e", "next_stride_n"} if amax_next else set())
    consts.update({name: p.default for name, p in parameters.items()
                   if p.default is not inspect.Parameter.empty
                   and name not in consts and name not in run_time})
    signature = {name: "constexpr" if name in consts else types.get(name, "i32")
                 for name in parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name] != "constexpr"
             and (name.endswith("_ptr") or "stride" in name
                  or name in ("N", "run", "next_cols"))}
    kernel = triton.compile(ASTSource(fn=prepare._fp4_kernel, signature=signature,
                                      constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 128),
                            options=dict(num_warps=prepare._FP4_WARPS, enable_fp_fusion=False))
    instructions = sass(kernel)
    # The kernel's own code ends at its last EXIT; what follows is out-of-line subroutines (the
    # correctly rounded division's slow path, taken for special operands only) and padding.
    end = max(i for i, instruction in enumerate(instructions) if instruction.startswith("EXIT"))
    body = instructions[:end + 1]
    values = block_n * block_s * 16 / (prepare._FP4_WARPS * 32)
    return (f"{quant} preparation{' + next amax' if amax_next else ''}, {block_n} rows x "
            f"{block_s} slices, {prepare._FP4_WARPS} "
            f"warps: {len(body)} instructions to the EXIT ({len(instructions)} in all), "
            f"{len(body) / values:.2f} a value, {resource_usage(kernel)}; "
            f"{opcode_counts(body, 10)}")


def loop_summary(kernel, config: GemmConfig) -> str:
    loop = main_loop(kernel)
    values = config.block_n * config.block_k / (config.num_warps * 32)
    return (f"    K loop: {len(loop)} instructions a step of one thread, "
            f"{len(loop) / values:.2f} a weight value; {opcode_counts(loop)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", nargs="+", default=["fp8"], choices=QUANTS)
    parser.add_argument("--direct", choices=["no", "yes", "both"], default="both",
                        help="build the direct-dispatch (tiny batch) form, the sorted one, or both")
    parser.add_argument("--configs", nargs="+", type=parse_config,
                        help="build these (BMxBNxBK:warps:stages[:swap][:splitN]) instead of "
                             "the tables' entries: for GEMM1, or GEMM2 with split-K (its "
                             "atomic output)")
    parser.add_argument("--loop", action="store_true",
                        help="print the K loop's SASS instruction counts (nvdisasm)")
    parser.add_argument("--dynamic-k", action="store_true",
                        help="4-bit: pass the K-step count at run time (FP4_STATIC_K_STEPS off)")
    parser.add_argument("--digest", action="store_true",
                        help="print each build's sha256 of its SASS (to compare two trees' "
                             "builds: a change that leaves them equal leaves the tables valid)")
    parser.add_argument("--prepare", nargs="+", choices=("nvfp4", "mxfp4"),
                        help="build the fp4 preparation kernel for these formats instead")
    args = parser.parse_args()
    if args.prepare:
        for quant in args.prepare:
            print(prepare_summary(quant), flush=True)
            if quant == "nvfp4":
                print(prepare_summary(quant, amax_next=True), flush=True)
        return 0
    if args.dynamic_k:
        gg.FP4_STATIC_K_STEPS = False
    directs = {"no": (False,), "yes": (True,), "both": (False, True)}[args.direct]
    if args.configs:
        builds = [(quant, 2 if config.split_k > 1 else 1, DEFAULT_K[quant], config)
                  for quant in args.quant for config in args.configs]
    else:
        builds = table_configs(args.quant)
    seen, failures = set(), 0
    for quant, gemm, k, config in builds:
        if (quant == "fp8" and config.swap_ab and not gg.fp8_swap_ok(gemm)
                and not experts_mod.FP8_SWAP_AB):
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
                print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
                continue
            ptx = kernel.asm["ptx"]
            mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
            print(f"ok   {name}: {mma}, shared {kernel.metadata.shared} B, "
                  f"{resource_usage(kernel)} ({time.time() - start:.1f} s)", flush=True)
            for advisory in ptxas_advisories(kernel):
                print(f"    ptxas: {advisory}", flush=True)
            if args.loop:
                print(loop_summary(kernel, config), flush=True)
            if args.digest:
                digest = hashlib.sha256("\n".join(sass(kernel)).encode()).hexdigest()[:16]
                print(f"    sass {digest}", flush=True)
    print(f"{len(seen) - failures} built, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
