"""`moe_ops.fused_moe`: the whole layer as a function over kernel-layout tensors.

For callers that keep their own weights: build them once with `moe_ops.prepare_weights(...)`
(checkpoint layout in, kernel layout out) and pass the resulting dict as keywords:

    weights = moe_ops.prepare_weights(w1=w1, w2=w2, w3=w3, quant="fp8", dtype=torch.bfloat16)
    out = moe_ops.fused_moe(x, router_logits, **weights, top_k=8, quant="fp8")
    out = moe_ops.fused_moe(x, topk_ids=ids, topk_weights=w, **weights, quant="fp8")  # pre-routed
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_ops import ops  # noqa: F401  (defines torch.ops.moe_ops.*)
from moe_ops.errors import check


def fused_moe(
    hidden_states: torch.Tensor,
    router_logits: Optional[torch.Tensor] = None,
    *,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w13_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    routing: str = "renormalize",
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    topk_ids: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    quant: str = "none",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    local_expert_offset: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """SPEC §1 on `hidden_states [T, H]`: route by `router_logits [T, num_experts]` (global
    experts) or take `topk_ids`/`topk_weights`, then run the local experts held in the kernel
    layout (what `prepare_weights` makes; for nvfp4 and mxfp4 `w13_global_scale` /
    `w2_global_scale` are the layout's per-row scales, and mxfp4's block-scale bytes are at
    most 128: quant.mxfp4_fold_scales). Returns [T, H] in the dtype of hidden_states: the
    partial sum of the local experts."""
    weights = (w13, w2, w13_scale, w2_scale, w13_global_scale, w2_global_scale, b13, b2)
    expert_args = (activation, quant, float(swiglu_alpha), float(swiglu_limit),
                   int(local_expert_offset), backend)
    if router_logits is None:
        check(topk_ids is not None and topk_weights is not None, "topk_ids",
              "topk_ids and topk_weights when router_logits is None", "neither")
        return torch.ops.moe_ops.fused_experts(hidden_states, topk_ids, topk_weights, *weights,
                                               *expert_args)
    check(topk_ids is None and topk_weights is None, "topk_ids",
          "None when router_logits is given (route, or pass pre-routed ids, not both)", "a tensor")
    check(top_k is not None, "top_k", "the number of experts per token", None)
    return torch.ops.moe_ops.fused_moe(hidden_states, router_logits, *weights, routing, int(top_k),
                                       routing_bias, n_group or 0, topk_group or 0,
                                       float(routed_scaling_factor), *expert_args)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    routing: str = "renormalize",
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing alone: (topk_ids int32 [T, k], topk_weights float32 [T, k])."""
    return torch.ops.moe_ops.route(router_logits, routing, int(top_k), routing_bias, n_group or 0,
                                   topk_group or 0, float(routed_scaling_factor), backend)
