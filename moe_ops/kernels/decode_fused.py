"""A small decode call in one launch: GEMM1, the activation, GEMM2 and the combine.

Why: at T = 1-4 a layer's call is three launches (bf16: GEMM1, GEMM2, the combine) or five to
six (fp8 modes: act_quant of x and of the intermediate too), each with its start, its last
partial wave and its drain; for a small layer those are most of the call (Qwen3-30B-A3B T = 1:
bf16 ~27 us of graph time for ~17 us of weight bytes, fp8 ~24 for ~8; results/
h200_profile_layer_issue3.json). Here one persistent grid takes work items from one atomic
queue, in order:

  GEMM1 items, token-major: (pair, block of BLOCK_N1 rows of w13): the token's row against the
      expert's rows (a GEMV on the tensor cores: _expert_rows), the bias, the activation,
      rounded to x's dtype into h[pair] (as the intermediate of the other path is); then the
      token's counter is incremented (release);
  GEMM2 items: (token, block of BLOCK_N2 output columns): wait for the token's counter to
      count all its GEMM1 items (acquire), then for each of its k pairs h[pair] against the
      expert's w2 rows, the bias, times the routing weight, summed in fp32 in slot order and
      rounded once into out[token].

The fp8 modes quantize x and h[pair] inside the items as act_quant would (QUANT: 0 none, 1 fp8
per tensor, 2 fp8_block). Because items are taken in queue order, an item waited on was taken
earlier by a running program, which will finish it: no deadlock whatever the grid's residency,
and the interpreter's programs, run one after another, take every item in the first program
(GEMM1's before GEMM2's). The counters (one a token and the queue's) are zeroed each call (a
fill before the launch). Pairs routed to no local expert add nothing.

Off by default until measured on a GPU (experts.FUSED_DECODE).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moe_ops.kernels.common import (
    apply_activation, cdiv, device_properties, fp8_quantize, is_gated, pdl_launch_options,
    pdl_prologue, round_to_dtype, upcast_dots, use_pdl,
)
from moe_ops.kernels.act_quant import amax_factor, group_scale

ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai", "relu2")
QUANTS = ("none", "fp8", "fp8_block")     # the kernel's QUANT switch, 0 / 1 / 2
# w13 rows an item (gated: half as many intermediate columns), w2 rows an item (16: a token's
# GEMM2 is then H / 16 items, enough to spread over the SMs at T = 1), the K step of both GEMVs
# and their pipeline depth: an item streams BLOCK_N x BLOCK_K 16-bit weights a step (8 KB at
# 32 x 128), NUM_STAGES of them in flight. First choices, not tuned.
BLOCK_N1, BLOCK_N2, BLOCK_K, NUM_STAGES = 32, 16, 128, 4
# Programs an SM (4 warps each): with the stages above 36 KB of shared memory a program (bf16;
# fp8 14 KB, fp32 72 KB).
PROGRAMS_PER_SM = 4
# h's rows padded to this many values (128 bytes of 16-bit values): a cache line never holds
# two pairs' rows, so GEMM2's cached reads of a finished row cannot have seen it unfinished.
H_ROW_ALIGN = 64


@triton.jit
def _row_amax(v_ptr, K, BLOCK_K: tl.constexpr):
    """max |v[k]| over k < K (fp32)."""
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(v_ptr + cols, mask=cols < K, other=0.0)
                                       .to(tl.float32)))
    return tl.max(amax, axis=0)


@triton.jit
def _expert_rows(w_ptr, v_ptr, w_scale_ptr, stride_wss, bias_ptr, rows, row_ok, K, stride_wn,
                 QUANT: tl.constexpr, GATED_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 [R]: an expert's rows `rows` times the vector v [K], plus bias[rows]. On the tensor
    cores as the swap-AB decode tiles do it: the weight rows [R, BLOCK_K] times a [BLOCK_K, 16]
    tile whose column 0 is v (the others masked off, never read), so that the weight loads are
    the pipelined operand of a dot (NUM_STAGES deep). v is quantized as act_quant quantizes
    its row (act_quant's rounding and tiny-amax guard: the same e4m3 codes and scales) for
    QUANT 1 (fp8 per tensor: one amax a row, the product scaled at the end by v's scale and
    the rows' weight scales w_scale[rows]) and QUANT 2 (fp8_block: one amax a 128-column group,
    BLOCK_K = 128, each step's product scaled by the group's scale and the rows' block scales
    w_scale[scale row, step], scale rows stride_wss apart: rows // 128, or for w13's
    interleaved gate / up rows (GATED_ROWS) 2 * (rows // 2 // 128) + rows % 2). PRECISE: fp32
    products of 16-bit values (fp32 activations, and the interpreter, whose 16-bit dot is
    wrong)."""
    R: tl.constexpr = rows.shape[0]
    lanes = tl.arange(0, 16)
    tl.static_assert(QUANT != 2 or BLOCK_K == 128)
    if QUANT == 1:
        amax = _row_amax(v_ptr, K, BLOCK_K)
        factor = amax_factor(amax)
    if QUANT == 2:
        if GATED_ROWS:
            scale_rows = 2 * (rows // 2 // 128) + rows % 2
        else:
            scale_rows = rows // 128
    acc = tl.zeros([R, 16], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if QUANT != 0:
            # (the values quantized once, then placed in column 0 of the tile: exact)
            v = tl.load(v_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            if QUANT == 2:
                amax = tl.max(tl.abs(v), axis=0)
                factor = amax_factor(amax)
            q, _ = fp8_quantize(v * factor, amax * factor)
            q = tl.where(lanes[None, :] == 0, q[:, None],
                         tl.zeros([BLOCK_K, 16], dtype=tl.float8e4nv))
            if QUANT == 1:
                acc = tl.dot(w, q, acc)
            else:
                step_scales = group_scale(amax) * tl.load(
                    w_scale_ptr + scale_rows * stride_wss + k0 // 128, mask=row_ok, other=0.0)
                acc += tl.dot(w, q) * step_scales[:, None]
        else:
            v = tl.load(v_ptr + cols[:, None] + lanes[None, :] * 0,
                        mask=col_ok[:, None] & (lanes[None, :] == 0), other=0.0)
            if PRECISE:
                acc = tl.dot(w.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, v, acc)
    out = tl.sum(tl.where(lanes[None, :] == 0, acc, 0.0), axis=1)
    if QUANT == 1:
        out *= group_scale(amax) * tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return out


@triton.jit
def _fused_decode_kernel(
    x_ptr, topk_ids_ptr, topk_weights_ptr, w13_ptr, w2_ptr, w13_scale_ptr, w2_scale_ptr,
    b13_ptr, b2_ptr, h_ptr, out_ptr, counters_ptr,
    T, H, I, num_experts, local_expert_offset, alpha, limit,
    stride_xt, stride_w13e, stride_w13n, stride_w2e, stride_w2n, stride_w13se, stride_w13ss,
    stride_w2se, stride_w2ss, stride_b13e, stride_b2e, stride_hp, stride_ot,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr, QUANT: tl.constexpr,
    HAS_B13: tl.constexpr, HAS_B2: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    N13 = 2 * I if GATED else I
    blocks1 = tl.cdiv(N13, BLOCK_N1)
    blocks2 = tl.cdiv(H, BLOCK_N2)
    items1 = T * TOP_K * blocks1
    total = items1 + T * blocks2
    H_COLS: tl.constexpr = BLOCK_N1 // 2 if GATED else BLOCK_N1
    # (the queue's index carries no data: relaxed)
    item = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    while item < total:
        if item < items1:
            pair = (item // blocks1).to(tl.int64)
            block = item % blocks1
            token = pair // TOP_K
            expert = tl.load(topk_ids_ptr + pair) - local_expert_offset
            if (expert >= 0) & (expert < num_experts):
                rows = block * BLOCK_N1 + tl.arange(0, BLOCK_N1)
                row_ok = rows < N13
                acc = _expert_rows(
                    w13_ptr + expert.to(tl.int64) * stride_w13e, x_ptr + token * stride_xt,
                    w13_scale_ptr + expert * stride_w13se, stride_w13ss,
                    b13_ptr + expert * stride_b13e, rows, row_ok, H, stride_w13n, QUANT, GATED,
                    HAS_B13, BLOCK_K, NUM_STAGES, PRECISE)
                if GATED:
                    # (w13's gate and up rows alternate: row 2c gate, 2c + 1 up of column c)
                    gate, up = tl.split(tl.reshape(acc, [H_COLS, 2]))
                    h = apply_activation(gate, up, alpha, limit, ACTIVATION)
                else:
                    h = apply_activation(acc, acc, alpha, limit, ACTIVATION)
                cols = block * H_COLS + tl.arange(0, H_COLS)
                tl.store(h_ptr + pair * stride_hp + cols,
                         round_to_dtype(h, h_ptr.dtype.element_ty), mask=cols < I)
            # every thread's stores issued before the release that publishes them
            tl.debug_barrier()
            tl.atomic_add(counters_ptr + 1 + token, 1, sem="release")
        else:
            token = ((item - items1) // blocks2).to(tl.int64)
            block = (item - items1) % blocks2
            needed = TOP_K * blocks1
            # (acquire polls, then the barrier that orders every thread's reads of h after
            # the one that saw the count; an acquire after relaxed polls would be a read whose
            # result is unused, which the compiler drops)
            done = tl.atomic_add(counters_ptr + 1 + token, 0, sem="acquire")
            while done < needed:
                done = tl.atomic_add(counters_ptr + 1 + token, 0, sem="acquire")
            tl.debug_barrier()
            rows = block * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            row_ok = rows < H
            out = tl.zeros([BLOCK_N2], dtype=tl.float32)
            for j in range(TOP_K):
                pair = token * TOP_K + j
                expert = tl.load(topk_ids_ptr + pair) - local_expert_offset
                if (expert >= 0) & (expert < num_experts):
                    acc = _expert_rows(
                        w2_ptr + expert.to(tl.int64) * stride_w2e, h_ptr + pair * stride_hp,
                        w2_scale_ptr + expert * stride_w2se, stride_w2ss,
                        b2_ptr + expert * stride_b2e, rows, row_ok, I, stride_w2n, QUANT, False,
                        HAS_B2, BLOCK_K, NUM_STAGES, PRECISE)
                    out += tl.load(topk_weights_ptr + pair).to(tl.float32) * acc
            tl.store(out_ptr + token * stride_ot + rows,
                     round_to_dtype(out, out_ptr.dtype.element_ty), mask=row_ok)
        item = tl.atomic_add(counters_ptr, 1, sem="relaxed")


def applies(x: torch.Tensor, quant: str, activation: str, w13: torch.Tensor,
            w2: torch.Tensor) -> bool:
    """Whether a call can run here: quant none with 16- or 32-bit activations of the weights'
    dtype, or fp8 / fp8_block with e4m3 weights and 16-bit activations; the weights' rows
    contiguous."""
    if quant == "none":
        weights_ok = (x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                      and w13.dtype == x.dtype and w2.dtype == x.dtype)
    else:
        weights_ok = (quant in QUANTS and x.dtype in (torch.bfloat16, torch.float16)
                      and w13.dtype == w2.dtype == torch.float8_e4m3fn)
    return (weights_ok and activation in ACTIVATIONS and w13.stride(-1) == 1
            and w2.stride(-1) == 1)


def fused_decode(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None, *, w13_scale: Optional[torch.Tensor] = None,
                 w2_scale: Optional[torch.Tensor] = None, quant: str = "none",
                 activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0,
                 local_expert_offset: int = 0, programs: Optional[int] = None) -> torch.Tensor:
    """out [T, H] (x.dtype) = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t) in one
    launch (see the module docstring). Weights in kernel layout as experts.triton_experts
    takes them (w13 [E, N13, H], gate/up rows interleaved when gated; w2 [E, H, I]; fp8: e4m3
    weights and their row scales w13_scale [E, N13], w2_scale [E, H]; fp8_block: their 128 x 128
    block scales w13_scale [E, N13 / 128, H / 128] (gated: rows 2b / 2b + 1 the gate / up rows
    of intermediate block b), w2_scale [E, H / 128, I / 128]; x and the intermediate quantized
    a row, or a 128-column group, at a time as act_quant does). programs: the persistent grid
    (default: PROGRAMS_PER_SM an SM, at most one an item)."""
    if not applies(x, quant, activation, w13, w2):
        raise ValueError(f"fused_decode: quant none (x, w13, w2 of one 16/32-bit dtype) or "
                         f"fp8 / fp8_block (e4m3 weights, 16-bit x), activation in "
                         f"{ACTIVATIONS}, contiguous weight rows; got quant={quant!r}, activation={activation!r}, x "
                         f"{x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    T, H = x.shape
    E, N13 = w13.shape[0], w13.shape[1]
    gated = is_gated(activation)
    I = N13 // 2 if gated else N13
    top_k = topk_ids.shape[1]
    if w13.shape[2] != H or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w13 [E, N13, {H}] and w2 [E, {H}, I]: got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    fp8 = quant != "none"
    if quant == "fp8":
        shapes = ((E, N13), (E, H))
    else:
        shapes = ((E, (2 if gated else 1) * cdiv(I, 128), cdiv(H, 128)),
                  (E, cdiv(H, 128), cdiv(I, 128)))
    if fp8 and (w13_scale is None or w2_scale is None or tuple(w13_scale.shape) != shapes[0]
                or tuple(w2_scale.shape) != shapes[1] or w13_scale.stride(-1) != 1
                or w2_scale.stride(-1) != 1):
        raise ValueError(f"w13_scale / w2_scale: {quant} needs {list(shapes[0])} and "
                         f"{list(shapes[1])} with contiguous rows, got "
                         f"{None if w13_scale is None else tuple(w13_scale.shape)} and "
                         f"{None if w2_scale is None else tuple(w2_scale.shape)}")
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    h = torch.empty((T * top_k, cdiv(I, H_ROW_ALIGN) * H_ROW_ALIGN), dtype=x.dtype,
                    device=x.device)
    counters = torch.zeros((T + 1, ), dtype=torch.int32, device=x.device)
    items = T * top_k * cdiv(N13, BLOCK_N1) + T * cdiv(H, BLOCK_N2)
    if programs is None:    # (the interpreter runs its programs one after another: a few)
        programs = (device_properties(x.device).multi_processor_count * PROGRAMS_PER_SM
                    if x.device.type == "cuda" else 4)
    programs = max(1, min(programs, items))
    dummy = weights
    _fused_decode_kernel[(programs, )](
        x, ids, weights, w13, w2, w13_scale if fp8 else dummy, w2_scale if fp8 else dummy,
        b13 if b13 is not None else dummy, b2 if b2 is not None else dummy, h, out, counters,
        T, H, I, E, local_expert_offset, alpha, limit,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
        w13_scale.stride(0) if fp8 else 0, w13_scale.stride(1) if fp8 else 0,
        w2_scale.stride(0) if fp8 else 0, w2_scale.stride(1) if fp8 else 0,
        b13.stride(0) if b13 is not None else 0, b2.stride(0) if b2 is not None else 0,
        h.stride(0), out.stride(0),
        TOP_K=top_k, ACTIVATION=activation, GATED=gated, QUANT=QUANTS.index(quant),
        HAS_B13=b13 is not None,
        HAS_B2=b2 is not None,
        BLOCK_N1=BLOCK_N1, BLOCK_N2=BLOCK_N2, BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES,
        PRECISE=x.dtype == torch.float32 or upcast_dots(x.dtype), USE_PDL=use_pdl(x.device),
        num_warps=4, **pdl_launch_options(x.device))
    return out


def compile_sm90(*, activation: str = "swiglu", dtype: str = "bf16", bias: bool = False,
                 top_k: int = 8, quant: str = "none"):
    """Build the kernel for sm_90 without a GPU (ptxas from the Triton wheel), with the
    launcher's constexprs and, approximately, its specializations (16-byte aligned pointers,
    strides and H / I multiples of 16): what the CPU tests compile, the interpreter not
    catching what only the GPU's compiler rejects. Returns triton's CompiledKernel."""
    import inspect
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    consts = dict(TOP_K=top_k, ACTIVATION=activation, GATED=is_gated(activation),
                  QUANT=QUANTS.index(quant),
                  HAS_B13=bias, HAS_B2=bias, BLOCK_N1=BLOCK_N1, BLOCK_N2=BLOCK_N2,
                  BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, PRECISE=dtype == "fp32",
                  USE_PDL=True)
    types = {"topk_ids_ptr": "*i32", "topk_weights_ptr": "*fp32", "b13_ptr": "*fp32",
             "b2_ptr": "*fp32", "counters_ptr": "*i32", "alpha": "fp32", "limit": "fp32",
             "w13_scale_ptr": "*fp32", "w2_scale_ptr": "*fp32"}
    if quant != "none":
        types.update(w13_ptr="*fp8e4nv", w2_ptr="*fp8e4nv")
    signature = {}
    for name in inspect.signature(_fused_decode_kernel.fn).parameters:
        if name in consts:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "i32"
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name] != "constexpr"
             and (name.endswith("_ptr") or name.startswith("stride") or name in ("H", "I"))}
    return triton.compile(ASTSource(fn=_fused_decode_kernel, signature=signature,
                                    constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=4, num_stages=NUM_STAGES))
