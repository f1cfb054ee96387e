"""The 4-bit decode on a bit-permuted packed layout, measured before any layout change.

Why: the Gluon 4-bit kernel's decode (grouped_gemm's _E2M1_BF16_ASM_*) turns a 32-bit word of
8 e2m1 codes into four bf16x2 registers with 2 byte moves (prmt) and about 14 shifts and masks:
each register needs its two codes' sign at bits 15 / 31 and magnitude at bits 8-6 / 24-22
(P = 0x81C081C0), and in the kernel order they sit elsewhere. If weight preparation permuted
each word's bits once, so that register 0's bits already sit at P, register 1's at P rotated
by 4, register 2's at P rotated by 10, and register 3's in two parts rotated by 14 and 6 (the
four sets tile the 32 bits; no three rotations and one more can, see NOTES.md), the decode
becomes and / rotate + and / rotate + and / two rotates + and + or: 9 integer operations for 8
values instead of ~16. ws_fp4's sm_90 K loop: 423 -> 311 SASS instructions a K step of a
thread (3.30 -> 2.43 a weight value; the integer pipe is what bounds the decode).

    python benchmarks/dev_fp4_bitperm.py --check       # CPU: the permuted decode equals the
                                                       # current one bit for bit (PTX emulator)
    python benchmarks/dev_fp4_bitperm.py --aot         # CPU: ws_fp4's K loop, permuted decode
    python benchmarks/dev_fp4_bitperm.py --layout current  [--out DIR]     # GPU: the GEMMs
    python benchmarks/dev_fp4_bitperm.py --layout permuted [--out DIR]     # alone, timed

The GPU runs take dev_gluon_fp4_decode.py's DeepSeek-V3 nvfp4 cases (decode: 16 slots, 2
consumers; prefill: the 128-slot form), permute the packed weights in memory for "permuted"
and patch ws_fp4's decode before its first build (one layout a process: Triton refuses a global
that changes after a build), and check each output against the float32 reference. Nothing in
the package reads the permuted layout yet: adopting it means weight preparation (quantize,
lay out, reload) writing it and every decoder (ws_fp4, grouped_gemm's fast and portable paths)
reading it.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

P = 0x81C081C0              # bf16x2: sign bits 15 / 31, magnitude bits 8-6 / 24-22
SPLIT_LOW = 0x00400040      # register 3's bits rotated by 14 (bit 6 / 22) ...
SPLIT_HIGH = 0x81808180     # ... and by 6 (the rest of P)
# The registers' rotations (right) in the permuted word: lo0 0, lo1 4, hi0 10, hi1 14 and 6
PERMUTED_HEAD = (
    ".reg .b32 lo0, lo1, hi0, hi1, m, t;\n"
    f"and.b32 lo0, $4, {P:#x};\n"
    "shf.r.wrap.b32 lo1, $4, $4, 4;\n"
    f"and.b32 lo1, lo1, {P:#x};\n"
    "shf.r.wrap.b32 hi0, $4, $4, 10;\n"
    f"and.b32 hi0, hi0, {P:#x};\n"
    "shf.r.wrap.b32 t, $4, $4, 14;\n"
    f"and.b32 t, t, {SPLIT_LOW:#x};\n"
    "shf.r.wrap.b32 hi1, $4, $4, 6;\n"
    f"and.b32 hi1, hi1, {SPLIT_HIGH:#x};\n"
    "or.b32 hi1, hi1, t;\n")


def permuted_asm(quant: str) -> str:
    """The decode asm of `quant` on the permuted layout: the current asm with its field
    extraction (grouped_gemm._E2M1_BF16_ASM_HEAD) replaced; the multiplies unchanged."""
    from moe_ops.kernels import grouped_gemm as gg
    current = (gg._E2M1_BF16_ASM_NVFP4 if quant == "nvfp4" else gg._E2M1_BF16_ASM_MXFP4).value
    prefix = "{\n" + gg._E2M1_BF16_ASM_HEAD
    assert current.startswith(prefix), "the decode asm no longer starts with its field head"
    return "{\n" + PERMUTED_HEAD + current[len(prefix):]


def _rotl(x: np.ndarray, n: int) -> np.ndarray:
    x = x.astype(np.uint32)
    return ((x << np.uint32(n)) | (x >> np.uint32(32 - n))).astype(np.uint32)


def bit_map() -> list[int]:
    """dst[i]: where bit i of a kernel-order word goes in the permuted word, from the current
    decode's own fields (emulated with unit factors: a bit set alone decodes exactly)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import ptx_emu
    from moe_ops.kernels import grouped_gemm as gg
    words = np.array([1 << i for i in range(32)], dtype=np.uint32)
    one = np.full(32, 0x3F803F80, dtype=np.uint32)
    lo0, lo1, hi0, hi1 = (ptx_emu.run(gg._E2M1_BF16_ASM_NVFP4.value, {4: words, 5: one, 6: one},
                                      [0, 1, 2, 3])[i] for i in range(4))
    permuted = (lo0 | _rotl(lo1, 4) | _rotl(hi0, 10) | _rotl(hi1 & np.uint32(SPLIT_LOW), 14)
                | _rotl(hi1 & np.uint32(SPLIT_HIGH), 6))
    dst = [int(v).bit_length() - 1 for v in permuted]
    assert all(int(v) == 1 << d for v, d in zip(permuted, dst)), "not one bit each"
    assert sorted(dst) == list(range(32)), "not a permutation"
    return dst


def permute_words_np(words: np.ndarray, dst: list[int]) -> np.ndarray:
    out = np.zeros_like(words, dtype=np.uint32)
    for i, d in enumerate(dst):
        out |= ((words >> np.uint32(i)) & np.uint32(1)) << np.uint32(d)
    return out


def permute_packed(packed, dst: list[int]):
    """The kernel-order packed bytes [..., Kp/2] (uint8, a multiple of 4 a row) with each
    little-endian 32-bit word's bits permuted (torch, on the tensor's device)."""
    import torch
    words = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for i, d in enumerate(dst):
        out |= ((words >> i) & 1) << d
    return out.to(torch.int32).view(torch.uint8).view(packed.shape)


def check(samples: int = 200000) -> None:
    """The permuted decode of permuted words equals the current decode of the words, for both
    formats, every byte pattern in every position and random words with random factors."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import ptx_emu
    from moe_ops.kernels import grouped_gemm as gg
    dst = bit_map()
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 32, size=samples, dtype=np.uint64).astype(np.uint32)
    every_byte = np.arange(256, dtype=np.uint32)
    words = np.concatenate([words] + [every_byte << np.uint32(8 * k) for k in range(4)])
    for quant in ("nvfp4", "mxfp4"):
        # finite bf16x2 factors of either sign: nvfp4's scale * 2^117, mxfp4's 2^(s - 127)
        factors = [rng.integers(0, 1 << 32, size=words.size, dtype=np.uint64).astype(np.uint32)
                   & np.uint32(0xBF7FBF7F) for _ in range(2)]
        current = (gg._E2M1_BF16_ASM_NVFP4 if quant == "nvfp4" else gg._E2M1_BF16_ASM_MXFP4)
        want = ptx_emu.run(current.value, {4: words, 5: factors[0], 6: factors[1]}, [0, 1, 2, 3])
        got = ptx_emu.run(permuted_asm(quant), {4: permute_words_np(words, dst),
                                                5: factors[0], 6: factors[1]}, [0, 1, 2, 3])
        for n in range(4):
            assert np.array_equal(got[n], want[n]), (quant, n)
        print(f"{quant}: the permuted decode equals the current one on {words.size} words")


def patch_ws_fp4() -> None:
    """ws_fp4's decode on the permuted layout (before the kernel's first build)."""
    import triton.language as tl
    from moe_ops.kernels import ws_fp4
    ws_fp4._E2M1_BF16_ASM_NVFP4 = tl.constexpr(permuted_asm("nvfp4"))
    ws_fp4._E2M1_BF16_ASM_MXFP4 = tl.constexpr(permuted_asm("mxfp4"))


def aot() -> None:
    from dev_gluon_fp4_decode import k_loop
    from moe_ops.kernels import ws_fp4
    from aot_sm90 import resource_usage
    patch_ws_fp4()
    for quant in ("nvfp4", "mxfp4"):
        for slots in (16, 64, 128):
            kernel = ws_fp4.compile_sm90(gemm=2, activation="none", quant=quant, slots=slots)
            loop = k_loop(kernel)
            ops = collections.Counter(
                (i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in loop)
            steps = ops["HGMMA"] // (ws_fp4.BLOCK_K // 16)
            values = steps * ws_fp4.BLOCK_K * ws_fp4.ROWS // 128
            print(f"permuted {quant}, {slots} slots: {resource_usage(kernel)}; K loop "
                  f"{len(loop)} SASS instructions for {values} weight values a thread "
                  f"({len(loop) / values:.2f} a value): {dict(ops.most_common(8))}", flush=True)


def gpu(layout: str, out_dir) -> None:
    import torch
    from bench import check_and_time, print_variant_table
    from dev_gluon_fp4_decode import make_problem, reference, routing_of, run_gluon
    if layout == "permuted":
        patch_ws_fp4()
    dst = bit_map()
    dev = torch.device("cuda")
    rows = []
    cases = (("gemm1 1/expert", 8, 4096, 7168, 1, 16), ("gemm1 16/expert", 8, 4096, 7168, 16, 16),
             ("gemm2 1/expert", 8, 7168, 2048, 1, 16), ("gemm1 256/expert", 16, 4096, 7168, 256, 128),
             ("gemm2 256/expert", 16, 7168, 2048, 256, 128))
    for name, E, N, K, tokens, slots in cases:
        prefill = slots > 16
        pb = make_problem(E, N, K, tokens, dev, slots=tokens if prefill else 16)
        ref = reference(pb)
        if layout == "permuted":
            pb["w_packed"] = permute_packed(pb["w_packed"], dst)
        routing = routing_of(pb, align=128 if prefill else 16)
        out_pairs = torch.empty((E * tokens, N), dtype=torch.bfloat16, device=dev)
        weight_bytes = E * N * K // 2 + E * N * K // 16
        flops = 2.0 * E * tokens * N * K
        got = check_and_time(lambda: run_gluon(pb, routing, out_pairs, 2, slots=slots),
                             out_pairs, ref)
        rows.append(dict(case=name, variant=layout, us=got["ms"] * 1e3, rel_err=got["rel_err"],
                         unwritten=got["unwritten"], tb_s=weight_bytes / got["ms"] / 1e9,
                         tflops=flops / got["ms"] / 1e9))
        print(rows[-1], flush=True)
    if out_dir:
        import bench
        bench.write_records(os.path.join(out_dir, f"fp4_bitperm_{layout}.json"), rows)
    print_variant_table(rows, [("case", "18"), ("variant", "10")],
                        [("us", "9.1f"), ("tb_s", "6.2f"), ("tflops", "7.1f")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU: emulated decode, bit for bit")
    ap.add_argument("--aot", action="store_true", help="CPU: ws_fp4's sm_90 K loop, permuted")
    ap.add_argument("--layout", choices=("current", "permuted"), default=None,
                    help="GPU: time the GEMMs alone on this layout")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not (args.check or args.aot or args.layout):
        ap.error("give --check, --aot or --layout")
    if args.check:
        check()
    if args.aot:
        aot()
    if args.layout:
        gpu(args.layout, args.out)


if __name__ == "__main__":
    main()
