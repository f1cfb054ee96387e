"""The combine stage: a token's output is the sum of its k expert rows.

GEMM2 in its "rows" form writes one row per (token, slot) pair, already multiplied by the
routing weight; `combine_pair_rows` sums the k rows of each token in slot order, in fp32, and
rounds once to the output's dtype: deterministic, unlike the fp32 atomics of GEMM2's "atomic"
form. It is a pure stream (k rows read, one written), so the kernel is laid out for bandwidth:
each thread owns 16 bytes of columns in every one of the token's rows, adds them in registers in
slot order (no reduction across threads, no shared memory) and stores 16 bytes; the k row loads
of a thread are independent, so they are in flight together. (Its own module, apart from
grouped_gemm.py, whose source hash the shipped tuning tables must match.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ops.kernels.common import (
    cdiv, next_power_of_2, pdl_launch_options, pdl_prologue, round_to_dtype, use_pdl,
)

# Columns a program sums: 8 bf16 (16 bytes) a thread at 4 warps.
_BLOCK_H = 1024


@triton.jit
def _combine_pair_rows_kernel(
    pair_out_ptr, topk_ids_ptr, out_ptr,
    H, num_experts, local_expert_offset,
    stride_pm, stride_om, stride_split,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
    SPLITS: tl.constexpr = 1,
):
    """out[token, cols] = sum over slots j < TOP_K (and parts p < SPLITS, rows
    p * stride_split apart) of pair_out[token * TOP_K + j, cols] (rows of pairs routed to no
    local expert are never written, so never read: they count as 0)."""
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        local = tl.load(topk_ids_ptr + pair) - local_expert_offset
        valid = (local >= 0) & (local < num_experts)
        for p in tl.static_range(SPLITS):
            row = tl.load(pair_out_ptr + p * stride_split.to(tl.int64) + pair * stride_pm + offs_h,
                          mask=h_ok & valid, other=0.0)
            acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_h,
             round_to_dtype(acc, out_ptr.dtype.element_ty), mask=h_ok)


def combine_pair_rows(pair_out: torch.Tensor, routing, out: torch.Tensor,
                      splits: int = 1) -> None:
    """out[t] = sum over valid slots j of pair_out[t*k + j] (already routing-weighted), in fp32
    and slot order. routing: grouped_gemm.Routing (its topk_ids, top_k and local experts).
    splits: pair_out holds that many parts of each pair row (a split GEMM2's K, ws_fp4.SPLIT_K),
    part p's rows from row p * num_pairs, summed in part order within each slot."""
    T, H = out.shape
    if T == 0 or H == 0:
        return
    num_pairs = T * routing.top_k
    if pair_out.shape[0] < splits * num_pairs:
        raise ValueError(f"pair_out: {splits} parts of {num_pairs} pair rows, got "
                         f"{pair_out.shape[0]} rows")
    block_h = min(_BLOCK_H, max(16, next_power_of_2(H)))
    _combine_pair_rows_kernel[(T, cdiv(H, block_h))](
        pair_out, routing.topk_ids, out,
        H, routing.num_experts, routing.local_expert_offset,
        pair_out.stride(0), out.stride(0), num_pairs * pair_out.stride(0),
        TOP_K=routing.top_k, BLOCK_H=block_h, SPLITS=splits, num_warps=max(1, min(4, block_h // 256)),
        USE_PDL=use_pdl(out.device), **pdl_launch_options(out.device),
    )
