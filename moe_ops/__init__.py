"""moe_ops: fused Mixture-of-Experts kernels as PyTorch ops.

    layer = moe_ops.FusedMoE(num_experts, hidden_size, intermediate_size, top_k, ...)
    layer.load_weights(w1=..., w2=..., w3=...)
    out = layer(hidden_states, router_logits)

A call flows one way: FusedMoE.forward -> ops (torch.ops.moe_ops.*) -> routing -> dispatch ->
experts -> output; `layout` turns checkpoint weights into the kernel layout at load time.
"""
from moe_ops import ops  # noqa: F401  (registers torch.ops.moe_ops.* and their fakes)
from moe_ops.errors import MoEArgumentError
from moe_ops.experts import BACKENDS
from moe_ops.functional import fused_moe, route
from moe_ops.layer import FusedMoE
from moe_ops.layout import ACTIVATIONS, prepare_weights
from moe_ops.quant import QUANT_MODES
from moe_ops.routing import ROUTING_METHODS

__version__ = "0.1.0"


def autotune(*args, **kwargs):
    """`with moe_ops.autotune(cache="tuning.json"):` (SPEC §6), see moe_ops.tuning.autotune.

    A function, not an import, so that `import moe_ops` does not import triton (an optional
    dependency: the reference backend runs without it)."""
    from moe_ops.tuning import autotune as _autotune

    return _autotune(*args, **kwargs)


__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "FusedMoE",
    "MoEArgumentError",
    "QUANT_MODES",
    "ROUTING_METHODS",
    "autotune",
    "fused_moe",
    "prepare_weights",
    "route",
]
