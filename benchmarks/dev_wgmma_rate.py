"""The tensor pipe's rate for the wgmma shapes the 4-bit kernels issue, alone: bf16
m64nNk16 wgmmas with the A operand from registers (as ws_fp4's consumers give their decoded
weights) or from shared memory (as a dense GEMM does), on operands resident in shared memory and
registers (no loads, no decode), each warpgroup waiting for its wgmmas after every K step of
256 columns (as ws_fp4's consumers do) or keeping one step in flight.

Why: sustained, the 4-bit prefill GEMMs run at ~0.67 of the dense bf16 matmul's rate a clock
(benchmarks/NOTES.md, fourteenth session), and neither halving the decode a flop nor n256
wgmmas changed it; this separates the wgmma's own rate (register A operand, waits a step) from
the rest of the kernel; its ALU variants add integer work on other registers where the decode
sits (between a step's wait and the next issue), register or shared-memory A alike: whether a
register-operand wgmma slows while the other warpgroup works on the register file (NOTES,
fifteenth session). Run it sustained, with the SM clock logged beside it
(`bash benchmarks/h200_run.sh clocks` does the same for the layers):

    python benchmarks/dev_wgmma_rate.py --out benchmarks/results/h200_wgmma_rate.json

Writes JSON (command, GPU, date, records) and prints a table last: TFLOP/s of each variant over
about --seconds of back-to-back launches (one program an SM, two consumer warpgroups sharing the
B tile, as ws_fp4's 128-slot form).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

K_STEP = 256            # columns a K step (ws_fp4.BLOCK_K)
ROWS = 64               # a warpgroup's wgmma M
_K_STEP = gl.constexpr(K_STEP)     # (the same, for the kernel's code)
_ROWS = gl.constexpr(ROWS)


@gluon.jit
def _alu_work(work, ROUNDS: gl.constexpr):
    """ROUNDS rounds of integer work on a warpgroup's [64, 128] int32 registers (a shift, an
    xor and a multiply-add a value: ~3 instructions, as the decode's LOP3 / SHF / HMUL2)."""
    for _ in gl.static_range(ROUNDS):
        work = (work ^ (work >> 7)) * 1103515245 + 12345
    return work


@gluon.jit
def _consumer(a_ptr, a_smem, b_smem, out_ptr, steps, N: gl.constexpr, RS: gl.constexpr,
              IN_FLIGHT: gl.constexpr, ALU: gl.constexpr, WHICH: gl.constexpr):
    """One warpgroup: steps K steps of [64, 256] x [256, N] wgmmas into one fp32 accumulator; A
    from registers (RS) or shared memory, B (shared by both warpgroups, as ws_fp4's activation
    slot) from shared memory; a wait after each step (IN_FLIGHT 0) or with one step's wgmmas
    left in flight (1, shared-memory A only: a register operand must stay intact until its wgmma
    has read it). ALU: rounds of integer work on other registers between a step's wait and the
    next issue (as ws_fp4's consumers decode there), ~190 instructions a thread a round."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, N, 16])
    dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros([_ROWS, N], gl.float32, mma)
    # (distinct values, so that the work is done a value, not folded into one)
    work_rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, blocked))
    work_cols = gl.arange(0, _K_STEP // 2, layout=gl.SliceLayout(0, blocked))
    work = work_rows[:, None] * (_K_STEP // 2) + work_cols[None, :] + WHICH
    if RS:
        rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, _K_STEP, layout=gl.SliceLayout(0, blocked))
        a_reg = gl.convert_layout(gl.load(a_ptr + rows[:, None] * _K_STEP + cols[None, :]), dot)
        for _ in range(steps):
            work = _alu_work(work, ALU)
            acc = warpgroup_mma(a_reg, b_smem.permute((1, 0)), acc, is_async=True)
            acc, a_reg = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_reg))
    else:
        for _ in range(steps):
            work = _alu_work(work, ALU)
            acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(acc, ))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    total = gl.sum(gl.sum(acc, axis=1), axis=0)
    if ALU > 0:
        # (the work's result kept live)
        total += gl.sum(gl.sum(work, axis=1), axis=0).to(gl.float32)
    gl.store(out_ptr + gl.program_id(0) * 2 + WHICH, total)


@gluon.jit
def _wgmma_rate_kernel(a_ptr, b_ptr, out_ptr, steps, N: gl.constexpr, RS: gl.constexpr,
                       IN_FLIGHT: gl.constexpr, ALU: gl.constexpr, REGS: gl.constexpr):
    """Two consumer warpgroups (warp-specialized, as ws_fp4's 128-slot form) on one B tile."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    cols = gl.arange(0, _K_STEP, layout=gl.SliceLayout(0, blocked))
    b_rows = gl.arange(0, N, layout=gl.SliceLayout(1, blocked))
    b = gl.load(b_ptr + b_rows[:, None] * _K_STEP + cols[None, :])
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [N, _K_STEP],
                                       gl.NVMMASharedLayout.get_default_for([N, _K_STEP],
                                                                            gl.bfloat16), b)
    rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, blocked))
    a = gl.load(a_ptr + rows[:, None] * _K_STEP + cols[None, :])
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, _K_STEP],
                                       gl.NVMMASharedLayout.get_default_for([_ROWS, _K_STEP],
                                                                            gl.bfloat16), a)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (a_ptr, a_smem, b_smem, out_ptr, steps, N, RS, IN_FLIGHT, ALU, 0)),
        (_consumer, (a_ptr, a_smem, b_smem, out_ptr, steps, N, RS, IN_FLIGHT, ALU, 1)),
    ], [4], [REGS])


# registers a thread: two warpgroups of 232 (ws_fp4's consumers), within a block's 65536
REGS = 232
VARIANTS = [dict(n=n, rs=rs, in_flight=f, alu=0) for n, rs, f in itertools.product(
    (64, 128, 256), (True, False), (0, 1)) if not (rs and f)]
# ... and with integer work between the steps (N = 128, waits every step): does a register
# operand's wgmma slow down when the other warpgroup works on the register file meanwhile
# (ws_fp4's consumers: one decodes while the other's wgmmas run)? Against the same work beside
# shared-memory-operand wgmmas.
VARIANTS += [dict(n=128, rs=rs, in_flight=0, alu=alu) for alu in (1, 2) for rs in (True, False)]


def compile_sm90(n: int, rs: bool, in_flight: int, alu: int = 0):
    """Build one variant for sm_90 without a GPU (the CPU test)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "steps": "i32",
                 "N": "constexpr", "RS": "constexpr", "IN_FLIGHT": "constexpr",
                 "ALU": "constexpr", "REGS": "constexpr"}
    consts = {"N": n, "RS": int(rs), "IN_FLIGHT": in_flight, "ALU": alu, "REGS": REGS}
    return triton.compile(GluonASTSource(fn=_wgmma_rate_kernel, signature=signature,
                                         constexprs=consts),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=REGS))


def measure(variant: dict, steps: int, seconds: float) -> dict:
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    n = variant["n"]
    a = torch.randn(ROWS, K_STEP, device="cuda").bfloat16()
    b = torch.randn(n, K_STEP, device="cuda").bfloat16()
    out = torch.empty(2 * programs, device="cuda")

    def launch():
        _wgmma_rate_kernel[(programs, )](a, b, out, steps, N=n, RS=int(variant["rs"]),
                                         IN_FLIGHT=variant["in_flight"], ALU=variant["alu"],
                                         REGS=REGS,
                                         num_warps=4, maxnreg=REGS)
    launch()
    torch.cuda.synchronize()
    start, launches = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            launch()
        torch.cuda.synchronize()
        launches += 10
    elapsed = time.perf_counter() - start
    flops = 2.0 * ROWS * n * K_STEP * steps * 2 * programs * launches
    return dict(variant, steps=steps, seconds=elapsed, tflops=flops / elapsed / 1e12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=2000, help="K steps a program")
    parser.add_argument("--seconds", type=float, default=3.0, help="time a variant")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    records = [measure(v, args.steps, args.seconds) for v in VARIANTS]
    result = dict(command="python " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(0),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), records=records)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{'N':>4} {'A from':>9} {'in flight':>9} {'ALU':>4} {'TFLOP/s':>8}")
    for r in records:
        print(f"{r['n']:>4} {'registers' if r['rs'] else 'shared':>9} {r['in_flight']:>9} "
              f"{r['alu']:>4} {r['tflops']:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
