"""Developer experiment: where a W4A16 decode tile's time goes, and what a pre-shuffled packed
layout buys (the experiment behind moe_ops.quant's kernel order of packed e2m1 rows).
Standalone kernels (not the package's), one weight matrix of R rows x K (the experts hit by a
decode step laid end to end), M <= 16 activation rows, swap-AB tiles.

    python benchmarks/dev_fp4_layout.py      # on an H200: table + $MOE_OPS_RESULTS_DIR/fp4_layout.json

Variants:
  cur       the natural packed order [N, K/2] (the package's layout before the kernel order):
            3-D load, inline-PTX decode, join + reshape; the compiler gathers each thread's
            bytes for the MMA's register fragment with single-byte shared loads and permutes
            (it calls the package's decode, which since reads kernel-order words: its timing
            stands for the natural order's loads, its err column no longer means anything)
  p1        the kernel order with one chunk per K step: per row and BK chunk, byte (t, c, q)
            holds codes 16c+2t+q (low nibble) and 16c+2t+q+8 (high nibble), t < 4, c < BK/16,
            q < 2; a thread's bytes of a step are one run of BK/8 bytes
  c32, c64  the same with fixed 32- / 64-column chunks (runs of 4 / 8 bytes a step): the run
            length, i.e. the width of the asynchronous copies, is what decides
  nodecode  p1's loads and dot with the bytes converted as integers (no e2m1 decode)
  bf16      the same tile loop over bf16 weights (4x the bytes)
Results: results/h200_fp4_layout.json (this variant list), results/h200_fp4_layout_first.json
(an earlier list: cur, p1, nodecode over 64/128 x 128/256 tiles and 3/5 stages, where p1 was
first measured, and an earlier p1 whose loads were too narrow to be pipelined).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moe_ops.kernels import fp4_decode  # noqa: E402
from moe_ops.kernels.fp4_decode import _dequant_fp4_tile_bf16_asm  # noqa: E402

# The byte-order decode this experiment measured (before the kernel order permuted each word's
# bits; see moe_ops.quant): each byte to the high byte of a 16-bit half (prmt), its sign and
# magnitude moved into place; the package's multiplies after it. The p1 / c32 / c64 variants
# hand it 4 bytes with pack=4, which is right for this head whatever bytes the compiler packs.
_BYTE_ORDER_HEAD = (
    ".reg .b32 t0, t1, lo0, lo1, hi0, hi1, m, z;\nmov.b32 z, 0;\n"
    "prmt.b32 t0, $4, z, 0x1404;\nprmt.b32 t1, $4, z, 0x3424;\n"
    + fp4_decode._ptx_sign_and_field("lo0", "t0", 4, 2, "0x01C001C0")
    + fp4_decode._ptx_sign_and_field("lo1", "t1", 4, 2, "0x01C001C0")
    + fp4_decode._ptx_sign_and_field("hi0", "t0", 0, 6, "0x01C001C0")
    + fp4_decode._ptx_sign_and_field("hi1", "t1", 0, 6, "0x01C001C0"))
_E2M1_BF16_ASM_NVFP4 = tl.constexpr(fp4_decode._E2M1_BF16_ASM_NVFP4.value.replace(
    fp4_decode._E2M1_BF16_ASM_HEAD, _BYTE_ORDER_HEAD))
_E2M1_BF16_ASM_MXFP4 = tl.constexpr(fp4_decode._E2M1_BF16_ASM_MXFP4.value.replace(
    fp4_decode._E2M1_BF16_ASM_HEAD, _BYTE_ORDER_HEAD))

READ_TBPS = 4.55
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def shuffle_p1(packed: torch.Tensor, bk: int) -> torch.Tensor:
    n, kb = packed.shape
    k = kb * 2
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(n, k // bk, bk // 16, 2, 4, 2)
    byte = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).permute(0, 1, 3, 2, 4)
    return byte.reshape(n, kb).contiguous()


@triton.jit
def fp4_tile_kernel(w_ptr, s_ptr, a_ptr, out_ptr, K, stride_wn, stride_sn, stride_am, stride_om,
                    QUANT: tl.constexpr, VAR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    BM: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = (pid * BN + tl.arange(0, BN)).to(tl.int64)
    offs_m = tl.arange(0, BM)
    G: tl.constexpr = 16 if QUANT == "nvfp4" else 32
    C: tl.constexpr = BK // 16
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    a_ptrs = a_ptr + offs_m[None, :] * stride_am + tl.arange(0, BK)[:, None]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn + tl.arange(0, BK // G)[None, :]
    if VAR == "cur":
        offs_g = tl.arange(0, BK // G)
        step_bytes = offs_g[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
        w_ptrs = w_ptr + offs_n[:, None, None] * stride_wn + step_bytes[None, :, :]
    elif VAR == "bf16":
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + tl.arange(0, BK)[None, :]
    elif VAR == "c32" or VAR == "c64":
        L: tl.constexpr = 32 if VAR == "c32" else 64
        byte_off = (tl.arange(0, BK // L)[:, None, None] * (L // 2)
                    + tl.arange(0, 4)[None, :, None] * (L // 8) + tl.arange(0, L // 8)[None, None, :])
        w_ptrs = w_ptr + offs_n[:, None, None, None] * stride_wn + byte_off[None, :, :, :]
    else:
        # [BN, 4, BK/8]: each t's bytes of a row are contiguous, so the load is wide enough
        # (>= 4 bytes a thread) for the asynchronous copies of the software pipeline
        byte_off = tl.arange(0, 4)[:, None] * (BK // 8) + tl.arange(0, BK // 8)[None, :]
        w_ptrs = w_ptr + offs_n[:, None, None] * stride_wn + byte_off[None, :, :]
    for kb in range(0, tl.cdiv(K, BK)):
        a = tl.load(a_ptrs)
        if VAR == "cur":
            packed = tl.load(w_ptrs)
            sc = tl.load(s_ptrs)
            w = _dequant_fp4_tile_bf16_asm(packed, sc, QUANT, BN, BK)
        elif VAR == "bf16":
            w = tl.load(w_ptrs)
        elif VAR == "c32" or VAR == "c64":
            LC: tl.constexpr = 32 if VAR == "c32" else 64
            CL: tl.constexpr = LC // 16
            NJ: tl.constexpr = BK // LC
            packed = tl.reshape(tl.load(w_ptrs), (BN, NJ, 4, CL, 2))
            sc = tl.load(s_ptrs)
            if QUANT == "nvfp4":
                factor = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                          * 1.661534994731145e+35).to(tl.bfloat16)          # [BN, BK/16]
                f = tl.reshape(factor, (BN, NJ, 1, CL, 1))
                f = tl.broadcast_to(f, (BN, NJ, 4, CL, 2))
                lo, hi = tl.inline_asm_elementwise(
                    _E2M1_BF16_ASM_NVFP4, "=r,=r,=r,=r,r,r,r", [packed, f],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                factor = (sc.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # [BN, BK/32]
                if LC == 32:
                    f = tl.broadcast_to(tl.reshape(factor, (BN, NJ, 1, 1, 1)), (BN, NJ, 4, CL, 2))
                else:
                    f = tl.reshape(tl.broadcast_to(tl.reshape(factor, (BN, NJ, 1, CL // 2, 1, 1)),
                                                   (BN, NJ, 4, CL // 2, 2, 2)), (BN, NJ, 4, CL, 2))
                lo, hi = tl.inline_asm_elementwise(
                    _E2M1_BF16_ASM_MXFP4, "=r,=r,=r,=r,r,r,r", [packed, f],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 5, 2, 4)), (BN, BK))
        else:
            packed = tl.reshape(tl.load(w_ptrs), (BN, 4, C, 2))
            sc = tl.load(s_ptrs)
            if VAR == "nodecode":
                lo = packed.to(tl.bfloat16)
                hi = (packed >> 4).to(tl.bfloat16)
            elif QUANT == "nvfp4":
                factor = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                          * 1.661534994731145e+35).to(tl.bfloat16)
                f4 = tl.broadcast_to(factor[:, None, :, None], (BN, 4, C, 2))
                lo, hi = tl.inline_asm_elementwise(
                    _E2M1_BF16_ASM_NVFP4, "=r,=r,=r,=r,r,r,r", [packed, f4],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                factor = (sc.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
                f4 = tl.reshape(tl.broadcast_to(factor[:, None, :, None, None], (BN, 4, C // 2, 2, 2)),
                                (BN, 4, C, 2))
                lo, hi = tl.inline_asm_elementwise(
                    _E2M1_BF16_ASM_MXFP4, "=r,=r,=r,=r,r,r,r", [packed, f4],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 4, 1, 3)), (BN, BK))
        acc = tl.dot(w, a, acc)
        a_ptrs += BK
        if VAR == "bf16":
            w_ptrs += BK
        else:
            w_ptrs += BK // 2
            s_ptrs += BK // G
    if QUANT == "nvfp4" and VAR != "bf16" and VAR != "nodecode":
        acc = acc * 512.0
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc)


def time_graph(fn, calls=10) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record(); g.replay(); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def main() -> int:
    out_dir = os.environ.get("MOE_OPS_RESULTS_DIR", "out")
    os.makedirs(out_dir, exist_ok=True)
    dev = "cuda"
    torch.manual_seed(0)
    problems = {  # name: (R rows, K, quant)
        "deepseek_gemm1_T1": (8 * 4096, 7168, "nvfp4"),
        "deepseek_gemm2_T1": (8 * 7168, 2048, "nvfp4"),
        "gpt_oss_gemm1_T1": (4 * 5760, 2816, "mxfp4"),   # K rounded down to a multiple of 256
    }
    rows = []
    table = torch.tensor(E2M1, device=dev)
    for pname, (R, K, quant) in problems.items():
        G = 16 if quant == "nvfp4" else 32
        packed = torch.randint(0, 256, (R, K // 2), device=dev, dtype=torch.uint8)
        if quant == "nvfp4":
            scales = (torch.rand(R, K // G, device=dev) * 2 + 0.5).to(torch.float8_e4m3fn)
            s_f = scales.float()
            s_u8 = scales.view(torch.uint8)
        else:
            s_u8 = torch.randint(120, 132, (R, K // G), device=dev, dtype=torch.uint8)
            s_f = torch.exp2(s_u8.float() - 127)
        codes = torch.stack([packed & 15, packed >> 4], -1).reshape(R, K).long()
        w_deq = table[codes] * s_f.repeat_interleave(G, 1)
        w_bf16 = w_deq.to(torch.bfloat16)
        a = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
        ref = (w_deq @ a.float().t()).t()
        fp4_bytes = packed.numel() + s_u8.numel()
        shuffled = {}
        variants = [(var, bn, bk, 4, stages) for bn in (64, 128) for bk in (128, 256)
                    for stages in (3, 4) for var in ("p1", "c32", "c64")]
        variants += [(var, 128, 128, 8, 4) for var in ("p1", "c32", "c64")]
        variants += [("cur", 64, 128, 4, 3), ("cur", 128, 128, 4, 3)]
        variants += [("bf16", 64, 128, 4, 4), ("bf16", 64, 64, 4, 5), ("bf16", 128, 64, 4, 4)]
        for var, bn, bk, warps, stages in variants:
            if K % bk:
                continue
            if var in ("p1", "nodecode", "c32", "c64"):
                chunk = {"c32": 32, "c64": 64}.get(var, bk)
                if chunk not in shuffled:
                    shuffled[chunk] = shuffle_p1(packed, chunk)
                w = shuffled[chunk]
            elif var == "bf16":
                w = w_bf16
            else:
                w = packed
            out = torch.full((16, R), float("nan"), device=dev)
            grid = (R // bn,)

            def fn():
                return fp4_tile_kernel[grid](w, s_u8, a, out, K, w.stride(0), s_u8.stride(0), a.stride(0),
                                      out.stride(0), QUANT=quant, VAR=var, BN=bn, BK=bk, BM=16,
                                      num_warps=warps, num_stages=stages)
            try:
                kernel = fn(); torch.cuda.synchronize()
                regs = getattr(kernel, "n_regs", -1)
                err = float((out - ref).norm() / ref.norm()) if var != "nodecode" else float("nan")
                us = time_graph(fn)
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(problem=pname, var=var, bn=bn, bk=bk, warps=warps, stages=stages,
                                 error=repr(exc)[:300]))
                print(pname, var, bn, bk, warps, stages, "ERROR", repr(exc)[:200], flush=True)
                continue
            nbytes = w.numel() * w.element_size() + (0 if var == "bf16" else s_u8.numel())
            floor = fp4_bytes / (READ_TBPS * 1e6)
            rows.append(dict(problem=pname, var=var, bn=bn, bk=bk, warps=warps, stages=stages,
                             us=us, err=err, tbps=nbytes / us / 1e6, frac_fp4_floor=floor / us,
                             regs=regs))
            print(f"{pname:20s} {var:9s} {bn:4d} {bk:4d} w{warps} s{stages} {us:9.1f} us "
                  f"{nbytes / us / 1e6:5.2f} TB/s  frac {floor / us:.2f}  err {err:.1e} regs {regs}", flush=True)
    json.dump(dict(command="python benchmarks/dev_fp4_layout.py", gpu=torch.cuda.get_device_name(),
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                   triton=triton.__version__, rows=rows), open(f"{out_dir}/fp4_layout.json", "w"), indent=1)
    print("\nbest per problem and variant:")
    for pname in problems:
        for var in ("cur", "p1", "c32", "c64", "nodecode", "bf16"):
            cand = [r for r in rows if r["problem"] == pname and r["var"] == var and "us" in r]
            if cand:
                b = min(cand, key=lambda r: r["us"])
                print(f"{pname:20s} {var:9s} {b['us']:8.1f} us  frac {b['frac_fp4_floor']:.2f}  "
                      f"bn{b['bn']} bk{b['bk']} w{b['warps']} s{b['stages']} err {b['err']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
