"""Routing: router logits -> (topk_ids, topk_weights), every method of SPEC §1.

All routing math is float32 whatever the logits dtype; logits are upcast, never cast down.
Ties go to the lower expert index. A NaN score is treated as -inf when *selecting* experts
(so a token with NaN logits still gets valid, distinct ids), while its weights are computed
from the real values, so the NaN stays inside that token's own output.

`route_reference` is the plain-torch oracle; `route` picks the implementation for a backend.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_ops.errors import check

ROUTING_METHODS = (
    "default",
    "renormalize",
    "renormalize_naive",
    "deepseek_v3",
    "llama4",
    "sigmoid_renorm",
    "topk",
)

# Added to the denominator of DeepSeek-V3's renormalization (SPEC §1).
DEEPSEEK_DENOMINATOR_EPS = 1e-20


def validate_routing(
    method: str,
    num_experts: int,
    top_k: int,
    n_group: Optional[int],
    topk_group: Optional[int],
) -> None:
    """Raise ValueError naming the argument for any routing configuration SPEC §3 rejects."""
    check(method in ROUTING_METHODS, "routing", f"one of {ROUTING_METHODS}", repr(method))
    check(num_experts >= 1, "num_experts", "a positive number of experts", num_experts)
    check(1 <= top_k <= num_experts, "top_k", f"between 1 and num_experts={num_experts}", top_k)
    if method == "llama4":
        check(top_k == 1, "top_k", "1 for routing='llama4'", top_k)
    if method == "deepseek_v3":
        check(n_group is not None and n_group >= 1, "n_group",
              "a positive group count for routing='deepseek_v3'", n_group)
        check(num_experts % n_group == 0, "n_group",
              f"a divisor of num_experts={num_experts}", n_group)
        check(topk_group is not None and 1 <= topk_group <= n_group, "topk_group",
              f"between 1 and n_group={n_group}", topk_group)
        experts_per_group = num_experts // n_group
        check(experts_per_group >= 2, "n_group",
              "groups of at least 2 experts (group score = sum of the top-2)", n_group)
        check(top_k <= topk_group * experts_per_group, "top_k",
              f"at most topk_group * num_experts / n_group = {topk_group * experts_per_group}",
              top_k)


def validate_logits(router_logits: torch.Tensor, num_experts: int) -> None:
    check(router_logits.dim() == 2, "router_logits", "a 2-D tensor [num_tokens, num_experts]",
          list(router_logits.shape))
    check(router_logits.shape[1] == num_experts, "router_logits",
          f"{num_experts} columns (num_experts)", tuple(router_logits.shape))
    check(router_logits.dtype in (torch.float32, torch.float16, torch.bfloat16), "router_logits",
          "dtype float32, float16 or bfloat16", router_logits.dtype)


def validate_route_call(
    router_logits: torch.Tensor,
    method: str,
    top_k: int,
    routing_bias: Optional[torch.Tensor],
    n_group: Optional[int],
    topk_group: Optional[int],
) -> None:
    """All checks of one routing call, from metadata only."""
    check(router_logits.dim() == 2, "router_logits", "a 2-D tensor [num_tokens, num_experts]",
          list(router_logits.shape))
    num_experts = router_logits.shape[1]
    validate_routing(method, num_experts, top_k, n_group, topk_group)
    validate_logits(router_logits, num_experts)
    if routing_bias is not None:
        check(method == "deepseek_v3", "routing_bias", "None unless routing='deepseek_v3'",
              "a tensor")
        check(tuple(routing_bias.shape) == (num_experts,), "routing_bias",
              f"shape [{num_experts}] (num_experts)", list(routing_bias.shape))
        check(routing_bias.dtype in (torch.float32, torch.float16, torch.bfloat16), "routing_bias",
              "a float dtype", routing_bias.dtype)
        check(routing_bias.device == router_logits.device, "routing_bias",
              f"device {router_logits.device} (that of router_logits)", routing_bias.device)


def validate_logits_match(router_logits: torch.Tensor, hidden_states: torch.Tensor) -> None:
    """The logits of a layer call belong to its tokens: one row per token, same device."""
    check(hidden_states.dim() == 2, "hidden_states", "a 2-D tensor [num_tokens, hidden_size]",
          list(hidden_states.shape))
    check(router_logits.dim() == 2 and router_logits.shape[0] == hidden_states.shape[0],
          "router_logits", f"a 2-D tensor with {hidden_states.shape[0]} rows (num_tokens)",
          list(router_logits.shape))
    check(router_logits.device == hidden_states.device, "router_logits",
          f"device {hidden_states.device} (that of hidden_states)", router_logits.device)


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties to the lower index, NaN as -inf."""
    scores = torch.nan_to_num(scores, nan=float("-inf"))
    # A stable descending sort keeps equal scores in index order: ties go to the lower index.
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def route_reference(
    router_logits: torch.Tensor,
    method: str,
    top_k: int,
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch routing. Returns (topk_ids int32 [T, k], topk_weights float32 [T, k])."""
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    if method == "default":
        probs = torch.softmax(logits, dim=-1)
        ids = _stable_topk(probs, top_k)
        weights = probs.gather(1, ids)
    elif method == "renormalize":
        ids = _stable_topk(logits, top_k)
        weights = torch.softmax(logits.gather(1, ids), dim=-1)
    elif method == "renormalize_naive":
        probs = torch.softmax(logits, dim=-1)
        ids = _stable_topk(probs, top_k)
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    elif method == "sigmoid_renorm":
        scores = torch.sigmoid(logits)
        ids = _stable_topk(scores, top_k)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    elif method == "topk":
        ids = _stable_topk(logits, top_k)
        weights = logits.gather(1, ids)
    elif method == "llama4":
        ids = _stable_topk(logits, 1)
        weights = torch.sigmoid(logits.gather(1, ids))
    elif method == "deepseek_v3":
        scores = torch.sigmoid(logits)
        biased = scores if routing_bias is None else scores + routing_bias.float()
        grouped = torch.nan_to_num(biased, nan=float("-inf")).view(num_tokens, n_group,
                                                                 num_experts // n_group)
        # Group score: the sum of the two best biased scores of the group. A sorted top-2 is
        # enough here: equal values give equal sums whichever index wins the tie.
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept_groups = _stable_topk(group_scores, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        masked = grouped.masked_fill(~group_mask[:, :, None], float("-inf"))
        ids = _stable_topk(masked.view(num_tokens, num_experts), top_k)
        # A kept group can hold fewer than k finite scores only if a token's scores are -inf or
        # NaN; ids stay valid indices regardless.
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + DEEPSEEK_DENOMINATOR_EPS)
        weights = weights * routed_scaling_factor
    else:  # validate_routing rejects this before we get here
        raise ValueError(f"routing: unknown method {method!r}")
    # Row-major outputs whatever the logits' layout (a transposed logits tensor makes sort and
    # gather return column-major results): the fake promises (T, k) strides (k, 1).
    return (ids.to(torch.int32, memory_format=torch.contiguous_format),
            weights.clone(memory_format=torch.contiguous_format))


def route(
    router_logits: torch.Tensor,
    method: str,
    top_k: int,
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route with the implementation of `backend` (already resolved: reference, triton or cpu)."""
    if backend == "triton" and router_logits.shape[0] > 0:
        from moe_ops.kernels.routing import triton_route

        return triton_route(router_logits, method, top_k, routing_bias, n_group, topk_group,
                            routed_scaling_factor)
    return route_reference(router_logits, method, top_k, routing_bias, n_group, topk_group,
                           routed_scaling_factor)
