"""The torch.library ops of moe_ops: the one place that lists every op and its schema.

Ops are defined with `torch.library.Library` (DEF) and implemented for CPU and CUDA by plain
Python functions of the stage modules; their fake (meta) implementations live in the top-level
`meta/` folder, installed as `moe_ops.meta`. This path costs about 2 µs a call on the host,
against about 11 µs for `torch.library.custom_op` (measured on this project's CPU CI machine),
which matters for decode-sized calls run eagerly.

Optional ints are passed as 0 (n_group, topk_group) since the schema keeps them plain ints.
"""
from __future__ import annotations

import torch

from moe_ops import dispatch, experts, routing

NAMESPACE = "moe_ops"

_WEIGHTS = ("Tensor w13, Tensor w2, Tensor? w13_scale, Tensor? w2_scale, Tensor? w13_global_scale, "
            "Tensor? w2_global_scale, Tensor? b13, Tensor? b2")
_EXPERT_ARGS = ("str activation, str quant, float alpha, float limit, int local_expert_offset, "
                "str backend")
_ROUTING_ARGS = ("str routing, int top_k, Tensor? routing_bias, int n_group, int topk_group, "
                 "float routed_scaling_factor")

SCHEMAS = {
    "route": "route(Tensor router_logits, " + _ROUTING_ARGS + ", str backend) -> (Tensor, Tensor)",
    "align_tokens": ("align_tokens(Tensor topk_ids, int num_local_experts, int local_expert_offset, "
                     "int block_m, str backend) -> (Tensor, Tensor, Tensor)"),
    "fused_experts": ("fused_experts(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, "
                      + _WEIGHTS + ", " + _EXPERT_ARGS + ") -> Tensor"),
    "fused_moe": ("fused_moe(Tensor hidden_states, Tensor router_logits, " + _WEIGHTS + ", "
                  + _ROUTING_ARGS + ", " + _EXPERT_ARGS + ") -> Tensor"),
}


def _optional_int(value: int):
    """The schema's 0 stands for None; any other value goes on to validation as it is."""
    return None if value == 0 else value


def route_impl(router_logits, routing_method, top_k, routing_bias, n_group, topk_group,
               routed_scaling_factor, backend):
    n_group, topk_group = _optional_int(n_group), _optional_int(topk_group)
    routing.validate_route_call(router_logits, routing_method, top_k, routing_bias, n_group,
                                topk_group)
    backend = experts.resolve_backend(backend, router_logits.device)
    return routing.route(router_logits, routing_method, top_k, routing_bias, n_group, topk_group,
                         routed_scaling_factor, backend)


def align_tokens_impl(topk_ids, num_local_experts, local_expert_offset, block_m, backend):
    dispatch.validate_align_args(topk_ids, num_local_experts, block_m)
    backend = experts.resolve_backend(backend, topk_ids.device)
    return tuple(dispatch.align_tokens(topk_ids, num_local_experts, local_expert_offset, block_m,
                                       backend))


def fused_experts_impl(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                       w13_global_scale, w2_global_scale, b13, b2, activation, quant, alpha,
                       limit, local_expert_offset, backend):
    return experts.fused_experts(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale,
                                 w2_scale, w13_global_scale, w2_global_scale, b13, b2, activation,
                                 quant, alpha, limit, local_expert_offset, backend)


def fused_moe_impl(hidden_states, router_logits, w13, w2, w13_scale, w2_scale, w13_global_scale,
                   w2_global_scale, b13, b2, routing_method, top_k, routing_bias, n_group,
                   topk_group, routed_scaling_factor, activation, quant, alpha, limit,
                   local_expert_offset, backend):
    routing.validate_logits_match(router_logits, hidden_states)
    # Every argument is checked before any launch (SPEC §3), in the order of the fake and of the
    # separate ops: the routing's (route_impl's checks), then the experts', with the ids and
    # weights the routing will write (allocated, not written).
    group_args = _optional_int(n_group), _optional_int(topk_group)
    routing.validate_route_call(router_logits, routing_method, top_k, routing_bias, *group_args)
    experts.resolve_backend(backend, router_logits.device)
    tokens, device = hidden_states.shape[0], hidden_states.device
    if tokens > 0:
        routed = (torch.empty((tokens, top_k), dtype=torch.int32, device=device),
                  torch.empty((tokens, top_k), dtype=torch.float32, device=device))
        experts.check_experts_call(hidden_states, *routed, w13, w2, w13_scale, w2_scale,
                                   w13_global_scale, w2_global_scale, b13, b2, activation, quant)
        if experts.resolve_backend(backend, device, quant) == "triton":
            # The Triton experts call launches the routing itself (kernels/experts.py,
            # RouteCall), where its dispatch needs the ids, so that one launch can also
            # quantize x and write the dispatch.
            from moe_ops.kernels.experts import RouteCall

            route = RouteCall(router_logits, routing_method,
                              routing_bias if routing_method == "deepseek_v3" else None,
                              *group_args, routed_scaling_factor)
            return experts.fused_experts(
                hidden_states, *routed, w13, w2, w13_scale, w2_scale, w13_global_scale,
                w2_global_scale, b13, b2, activation, quant, alpha, limit, local_expert_offset,
                backend, route=route)
    topk_ids, topk_weights = route_impl(router_logits, routing_method, top_k, routing_bias,
                                        n_group, topk_group, routed_scaling_factor, backend)
    return fused_experts_impl(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                              w13_global_scale, w2_global_scale, b13, b2, activation, quant,
                              alpha, limit, local_expert_offset, backend)


IMPLEMENTATIONS = {
    "route": route_impl,
    "align_tokens": align_tokens_impl,
    "fused_experts": fused_experts_impl,
    "fused_moe": fused_moe_impl,
}

def _no_backward(ctx, *grads):
    raise NotImplementedError(
        "moe_ops ops are inference-only: they have no backward. Run them under torch.no_grad() "
        "or torch.inference_mode(), or detach their inputs.")


_library = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _library.define(_schema)
    for _device in ("CPU", "CUDA"):
        _library.impl(_name, IMPLEMENTATIONS[_name], _device)
    # An explicit autograd kernel: with inputs that require grad, outputs carry a grad_fn whose
    # backward raises, the same on every backend (without it the reference path would record
    # its inner torch ops and return gradients while the Triton path returned none). It costs a
    # few us per call in grad mode, nothing under inference_mode.
    torch.library.register_autograd(f"{NAMESPACE}::{_name}", _no_backward)



def _register_fakes() -> None:
    """Import moe_ops.meta, which registers the fake of every op above.

    Installed, `moe_ops.meta` is the top-level meta/ folder mapped into the package. In a source
    checkout used without installing (PYTHONPATH=.), meta/ sits beside moe_ops/ and is loaded
    from there under the same name.
    """
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    try:
        importlib.import_module("moe_ops.meta")
        return
    except ModuleNotFoundError as error:
        if error.name != "moe_ops.meta":
            raise
    source = Path(__file__).resolve().parent.parent / "meta" / "__init__.py"
    spec = importlib.util.spec_from_file_location("moe_ops.meta", source,
                                                  submodule_search_locations=[str(source.parent)])
    if spec is None or not source.is_file():
        raise ImportError("moe_ops.meta (the fake implementations) is missing: reinstall moe_ops")
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_ops.meta"] = module
    spec.loader.exec_module(module)
    sys.modules["moe_ops"].meta = module


_register_fakes()
