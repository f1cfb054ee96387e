"""Dispatch: routed (token, slot) pairs -> pairs sorted per local expert, padded to the tile size.

The GEMM kernels walk `sorted_pair_ids` in blocks of `block_m` rows, each block belonging to one
expert (`block_expert_ids`). A pair is the flat index t*k + j of `topk_ids`; the token is
pair // k. Pairs whose expert is not local (another shard's, or -1 padding) are dropped here,
so they contribute nothing downstream. Padding slots hold the sentinel T*k.

Every output is sized from shapes alone (an upper bound on the padded length), and the live
length `num_padded` stays on the device: no host sync, nothing sized by data, so the whole
forward can be captured in a CUDA graph. `align_tokens_reference` is the plain-torch version
(used by the reference backend and as the oracle of the Triton kernel in kernels/align.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedPairs(NamedTuple):
    sorted_pair_ids: torch.Tensor  # int32 [max_padded]: pair ids, expert-major, sentinel T*k
    block_expert_ids: torch.Tensor  # int32 [max_padded / block_m]: local expert, -1 unused
    num_padded: torch.Tensor  # int32 [1]: live length of sorted_pair_ids


def max_padded_pairs(num_pairs, num_local_experts: int, block_m: int):
    """Upper bound of the padded length, from shapes alone: each expert that can receive a pair
    (at most min(E, T*k) of them) may waste block_m - 1 slots. SymInt-safe for the fakes."""
    live_experts = torch.sym_min(num_local_experts, num_pairs)
    bound = num_pairs + live_experts * (block_m - 1)
    return (bound + block_m - 1) // block_m * block_m


def local_expert_of_pairs(topk_ids: torch.Tensor, num_local_experts: int,
                          local_expert_offset: int) -> torch.Tensor:
    """int64 [T*k]: the local expert of each pair, num_local_experts where it is not local."""
    local = topk_ids.reshape(-1).long() - local_expert_offset
    valid = (local >= 0) & (local < num_local_experts)
    return torch.where(valid, local, torch.full_like(local, num_local_experts))


def expert_counts(topk_ids: torch.Tensor, num_local_experts: int,
                  local_expert_offset: int) -> torch.Tensor:
    """int64 [E]: the pairs routed to each local expert."""
    expert = local_expert_of_pairs(topk_ids, num_local_experts, local_expert_offset)
    # scatter_add, not bincount: bincount's output size depends on the data (a host sync).
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=topk_ids.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    return counts[:num_local_experts]


def align_tokens_reference(
    topk_ids: torch.Tensor, num_local_experts: int, local_expert_offset: int, block_m: int
) -> AlignedPairs:
    num_pairs = topk_ids.numel()
    e = num_local_experts
    device = topk_ids.device
    expert = local_expert_of_pairs(topk_ids, e, local_expert_offset)
    counts = expert_counts(topk_ids, e, local_expert_offset)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    starts = torch.cumsum(counts, 0) - counts

    order = torch.argsort(expert, stable=True)  # pair ids expert-major, in pair order within
    sorted_expert = expert[order]
    is_local = sorted_expert < e
    safe_expert = sorted_expert.clamp(max=e - 1)
    rank = torch.arange(num_pairs, device=device) - starts[safe_expert]
    max_padded = max_padded_pairs(num_pairs, e, block_m)
    # Dropped pairs are written to one extra slot past the end, then cut off.
    destination = torch.where(is_local, padded_starts[safe_expert] + rank,
                              torch.full_like(rank, max_padded))
    sorted_pair_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destination, order.to(torch.int32))
    sorted_pair_ids = sorted_pair_ids[:max_padded]

    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_start, right=True)
    num_padded = padded_ends[-1:] if e > 0 else torch.zeros(1, dtype=torch.int64, device=device)
    block_expert = torch.where(block_start < num_padded, block_expert, torch.full_like(block_expert, -1))
    return AlignedPairs(sorted_pair_ids, block_expert.to(torch.int32), num_padded.to(torch.int32))


def validate_align_args(topk_ids: torch.Tensor, num_local_experts: int, block_m: int) -> None:
    from moe_ops.errors import check

    check(topk_ids.dim() == 2, "topk_ids", "a 2-D tensor [num_tokens, top_k]", list(topk_ids.shape))
    check(topk_ids.dtype in (torch.int32, torch.int64), "topk_ids", "dtype int32 or int64",
          topk_ids.dtype)
    check(num_local_experts >= 1, "num_local_experts", "at least 1", num_local_experts)
    check(block_m >= 1, "block_m", "at least 1", block_m)


def align_tokens(
    topk_ids: torch.Tensor, num_local_experts: int, local_expert_offset: int, block_m: int,
    backend: str = "reference",
) -> AlignedPairs:
    """Align pairs per expert with the implementation of `backend` (already resolved)."""
    if backend == "triton" and topk_ids.numel() > 0:
        from moe_ops.kernels.align import moe_align

        return moe_align(topk_ids, num_local_experts, block_m, local_expert_offset)
    return align_tokens_reference(topk_ids, num_local_experts, local_expert_offset, block_m)
