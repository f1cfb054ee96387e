"""Fake (meta) implementations of every moe_ops op: shape, dtype and stride rules only.

Installed as `moe_ops.meta` and registered when `moe_ops.ops` is imported. Each fake runs the
same metadata checks as the real op, so a bad call fails at trace time with the same message,
and returns tensors whose shape, dtype and strides equal the real op's (tests check this for
drawn shapes). No fake reads data or launches device code, so token counts stay symbolic under
torch.compile(dynamic=True).
"""
from __future__ import annotations

import torch

from moe_ops import dispatch, experts, routing
from moe_ops.ops import NAMESPACE, _optional_int


@torch.library.register_fake(f"{NAMESPACE}::route")
def route_fake(router_logits, routing_method, top_k, routing_bias, n_group, topk_group,
               routed_scaling_factor, backend):
    routing.validate_route_call(router_logits, routing_method, top_k, routing_bias,
                                _optional_int(n_group), _optional_int(topk_group))
    experts.resolve_backend(backend, router_logits.device)
    num_tokens = router_logits.shape[0]
    return (router_logits.new_empty((num_tokens, top_k), dtype=torch.int32),
            router_logits.new_empty((num_tokens, top_k), dtype=torch.float32))


@torch.library.register_fake(f"{NAMESPACE}::align_tokens")
def align_tokens_fake(topk_ids, num_local_experts, local_expert_offset, block_m, backend):
    dispatch.validate_align_args(topk_ids, num_local_experts, block_m)
    experts.resolve_backend(backend, topk_ids.device)
    max_padded = dispatch.max_padded_pairs(topk_ids.numel(), num_local_experts, block_m)
    return (topk_ids.new_empty((max_padded,), dtype=torch.int32),
            topk_ids.new_empty((max_padded // block_m,), dtype=torch.int32),
            topk_ids.new_empty((1,), dtype=torch.int32))


@torch.library.register_fake(f"{NAMESPACE}::fused_experts")
def fused_experts_fake(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                       w13_global_scale, w2_global_scale, b13, b2, activation, quant, alpha,
                       limit, local_expert_offset, backend):
    optional = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_global_scale=w13_global_scale,
                    w2_global_scale=w2_global_scale, b13=b13, b2=b2)
    experts.validate_experts_args(hidden_states, topk_ids, topk_weights, w13, w2, optional,
                                  activation, quant)
    experts.resolve_backend(backend, hidden_states.device, quant)
    return hidden_states.new_empty(hidden_states.shape)


@torch.library.register_fake(f"{NAMESPACE}::fused_moe")
def fused_moe_fake(hidden_states, router_logits, w13, w2, w13_scale, w2_scale, w13_global_scale,
                   w2_global_scale, b13, b2, routing_method, top_k, routing_bias, n_group,
                   topk_group, routed_scaling_factor, activation, quant, alpha, limit,
                   local_expert_offset, backend):
    routing.validate_logits_match(router_logits, hidden_states)
    topk_ids, topk_weights = route_fake(router_logits, routing_method, top_k, routing_bias,
                                        n_group, topk_group, routed_scaling_factor, backend)
    return fused_experts_fake(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                              w13_global_scale, w2_global_scale, b13, b2, activation, quant,
                              alpha, limit, local_expert_offset, backend)
