"""Experts: the two grouped GEMMs (gather + GEMM1 + activation, GEMM2 + routing weight + combine).

This stage checks its arguments against the kernel layout (moe_ops.layout.plan_layout says what
each quant mode and activation needs) and hands the work to a backend: the plain-torch oracle
(reference.py) or the Triton kernels (kernels/experts.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_ops import kernels
from moe_ops import quant as q
from moe_ops.errors import check
from moe_ops.layout import ACTIVATIONS, FLOAT_DTYPES, is_gated, plan_layout

BACKENDS = ("auto", "reference", "triton", "cpu")
TOPK_ID_DTYPES = (torch.int32, torch.int64)


# Quant modes the Triton experts kernels cover: all of them (nvfp4/mxfp4 as W4A16, the packed
# weights dequantized in the GEMM's registers).
TRITON_QUANTS = ("none", "fp8", "fp8_block", "nvfp4", "mxfp4")


def resolve_backend(backend: str, device: torch.device, quant: Optional[str] = None) -> str:
    """`auto` -> the best backend for the device (and, for the experts, the quant mode); checks
    that the asked one can run there. Called by the ops and their fakes alike, so a backend
    that cannot run a call is rejected at trace time too, before any launch."""
    check(backend in BACKENDS, "backend", f"one of {BACKENDS}", repr(backend))
    triton_runs = device.type == "cuda" or kernels.INTERPRET
    if backend == "auto":
        return "triton" if device.type == "cuda" and quant in (None, *TRITON_QUANTS) else "reference"
    if backend == "triton":
        check(triton_runs, "backend", "'triton' on CUDA tensors, or on CPU tensors with "
              "TRITON_INTERPRET=1 set before import (the Triton interpreter)",
              f"'triton' with tensors on {device}")
        check(quant in (None, *TRITON_QUANTS), "backend",
              f"'reference' or 'auto' for quant={quant!r}: the Triton kernels cover "
              f"{TRITON_QUANTS}", "'triton'")
    if backend == "cpu":
        check(False, "backend", "'auto', 'reference' or 'triton': the C++ CPU kernels are not "
              "built in this version", "'cpu'")
    return backend


def validate_experts_args(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    optional: dict[str, Optional[torch.Tensor]],
    activation: str,
    quant: str,
) -> None:
    """Everything SPEC §3 asks of an experts call, from metadata only (no device sync)."""
    check(activation in ACTIVATIONS, "activation", f"one of {ACTIVATIONS}", repr(activation))
    check(quant in q.QUANT_MODES, "quant", f"one of {q.QUANT_MODES}", repr(quant))
    x = hidden_states
    check(x.dim() == 2, "hidden_states", "a 2-D tensor [num_tokens, hidden_size]", list(x.shape))
    check(x.dtype in FLOAT_DTYPES, "hidden_states", "dtype bfloat16, float16 or float32", x.dtype)
    if quant in ("nvfp4", "mxfp4"):
        check(x.dtype != torch.float32, "hidden_states",
              f"bfloat16 or float16 for quant={quant!r} (W4A16)", x.dtype)
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], "topk_ids",
          f"a 2-D tensor [num_tokens={x.shape[0]}, top_k]", list(topk_ids.shape))
    check(topk_ids.dtype in TOPK_ID_DTYPES, "topk_ids", "dtype int32 or int64", topk_ids.dtype)
    check(tuple(topk_weights.shape) == tuple(topk_ids.shape), "topk_weights",
          f"the shape of topk_ids {list(topk_ids.shape)}", list(topk_weights.shape))
    check(topk_weights.dtype in FLOAT_DTYPES, "topk_weights", "a float dtype", topk_weights.dtype)
    check(w13.dim() == 3, "w13", "a 3-D kernel-layout tensor [E, N13, H]", list(w13.shape))
    check(w2.dim() == 3, "w2", "a 3-D kernel-layout tensor [E, H, I]", list(w2.shape))
    fp4 = quant in ("nvfp4", "mxfp4")
    num_experts, hidden = w13.shape[0], x.shape[1]
    if fp4:
        # Packed rows in quant.py's kernel order are padded: the sizes come from the rows of
        # w13 and from hidden_states, the widths are then checked against the layout below.
        intermediate = w13.shape[1] // 2 if is_gated(activation) else w13.shape[1]
        check(w13.shape[2] == q.fp4_padded_k(hidden) // 2, "hidden_states",
              f"a hidden_size whose packed, padded rows are w13's {w13.shape[2]} bytes "
              f"(w13 {list(w13.shape)})", list(x.shape))
    else:
        intermediate = w2.shape[2]
        check(hidden == w13.shape[2], "hidden_states", f"{w13.shape[2]} columns (hidden_size, "
              f"from w13 {list(w13.shape)})", list(x.shape))
    check(w2.shape[0] == num_experts, "w2", f"{num_experts} experts like w13", w2.shape[0])
    check(w2.shape[1] == hidden, "w2", f"{hidden} rows (hidden_size of hidden_states)", w2.shape[1])
    specs = plan_layout(quant=quant, activation=activation, num_local_experts=num_experts,
                        hidden_size=hidden, intermediate_size=intermediate,
                        bias=optional.get("b13") is not None, dtype=x.dtype, device=x.device)
    given = {"w13": w13, "w2": w2, **optional}
    for role, tensor in given.items():
        spec = specs.get(role)
        if spec is None:
            check(tensor is None, role, f"None for quant={quant!r}, activation={activation!r}",
                  "a tensor")
            continue
        check(tensor is not None, role, f"a tensor for quant={quant!r}", None)
        check(tuple(tensor.shape) == spec.shape, role, f"shape {list(spec.shape)} "
              f"(kernel layout, gated={is_gated(activation)})", list(tensor.shape))
        check(tensor.dtype == spec.dtype, role, f"dtype {spec.dtype}", tensor.dtype)
        # The kernels address kernel-layout tensors as dense row-major arrays.
        check(tensor.is_contiguous(), role, "a contiguous kernel-layout tensor",
              f"strides {tensor.stride()}")
        check(tensor.device == x.device, role, f"device {x.device} (that of hidden_states)",
              tensor.device)
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        check(tensor.device == x.device, name, f"device {x.device} (that of hidden_states)",
              tensor.device)


# Signatures (shapes, dtypes, devices, modes) that passed validate_experts_args. Validation reads
# metadata only, so a signature that passed once passes again: a decode step then pays a tuple
# build and a set lookup (about 3 us) instead of the full checks (about 30 us, measured on the CI
# machine: the checks format their messages eagerly).
_VALIDATED_SIGNATURES: set = set()
_MAX_VALIDATED_SIGNATURES = 4096


def _signature(tensors: tuple, activation: str, quant: str) -> tuple:
    # Contiguity is part of it: the validation requires contiguous kernel-layout tensors, and a
    # strided view of the same shape must not slip past on an earlier call's pass.
    return (activation, quant) + tuple(
        None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors)


def check_experts_call(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                       w13_global_scale, w2_global_scale, b13, b2, activation: str,
                       quant: str) -> None:
    """validate_experts_args, once per signature (metadata only: no launch, no sync)."""
    signature = _signature((hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                            w13_global_scale, w2_global_scale, b13, b2), activation, quant)
    if signature not in _VALIDATED_SIGNATURES:
        optional = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_global_scale=w13_global_scale,
                        w2_global_scale=w2_global_scale, b13=b13, b2=b2)
        validate_experts_args(hidden_states, topk_ids, topk_weights, w13, w2, optional,
                              activation, quant)
        if len(_VALIDATED_SIGNATURES) >= _MAX_VALIDATED_SIGNATURES:
            _VALIDATED_SIGNATURES.clear()
        _VALIDATED_SIGNATURES.add(signature)


def fused_experts(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: Optional[torch.Tensor],
    w2_scale: Optional[torch.Tensor],
    w13_global_scale: Optional[torch.Tensor],
    w2_global_scale: Optional[torch.Tensor],
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    activation: str,
    quant: str,
    alpha: float,
    limit: float,
    local_expert_offset: int,
    backend: str,
    route=None,
) -> torch.Tensor:
    """Validated experts computation on the resolved backend. Returns [T, H] in x.dtype.

    route: a layer call's routing (kernels.experts.RouteCall; Triton backend, at least one
    token), launched by the experts call itself into topk_ids / topk_weights (allocated,
    unwritten): after every argument is checked, and in one launch with x's quantization and
    the dispatch where those apply (kernels/experts.py)."""
    check_experts_call(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                       w13_global_scale, w2_global_scale, b13, b2, activation, quant)
    backend = resolve_backend(backend, hidden_states.device, quant)
    if route is not None:
        # (the routing launch writes its ids and weights by offset, as int32 and float32)
        check(backend == "triton" and hidden_states.shape[0] > 0, "backend",
              "'triton' and at least one token with route", f"{backend!r}, "
              f"{hidden_states.shape[0]} tokens")
        check(topk_ids.dtype == torch.int32 and topk_ids.is_contiguous()
              and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(),
              "topk_ids", "contiguous int32 ids and float32 weights with route",
              f"{topk_ids.dtype} / {topk_weights.dtype}")
    if hidden_states.shape[0] == 0:
        return hidden_states.new_empty((0, hidden_states.shape[1]))
    topk_weights = topk_weights.float()
    if backend == "triton":
        from moe_ops.kernels.experts import triton_experts

        return triton_experts(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale,
                              b13, b2, activation=activation, quant=quant, alpha=alpha,
                              limit=limit, local_expert_offset=local_expert_offset,
                              w13_global_scale=w13_global_scale, w2_global_scale=w2_global_scale,
                              route=route)
    from moe_ops.reference import fused_experts_reference

    return fused_experts_reference(
        hidden_states, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, b13, b2,
        activation=activation, quant=quant, alpha=alpha, limit=limit,
        local_expert_offset=local_expert_offset, w13_global_scale=w13_global_scale,
        w2_global_scale=w2_global_scale)
