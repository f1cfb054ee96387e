"""The plain-torch implementation of SPEC §1 over the kernel layout: the oracle.

It reads exactly the prepared tensors the kernels read (interleaved w13, kernel-layout scales),
dequantizes weights to float32, quantizes activations by the rules of moe_ops.quant, and
accumulates in float32. The test suite checks it against an independent float64 evaluation
written from the checkpoint layout, so layout and reference are tested together.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_ops import quant as q
from moe_ops.dispatch import align_tokens_reference, expert_counts
from moe_ops.layout import GATE_UP_INTERLEAVE_ROWS, is_gated, w13_scale_rows


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float,
                     limit: float) -> torch.Tensor:
    """a(g, u) of SPEC §1 for the gated activations, elementwise."""
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    if activation == "geglu":
        return torch.nn.functional.gelu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    raise ValueError(f"activation: unknown {activation!r}")


def apply_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """GEMM1 output in kernel layout (float32 [n, N13], gate/up interleaved) -> [n, I]."""
    if activation == "relu2":
        return torch.relu(h).square()
    assert GATE_UP_INTERLEAVE_ROWS == 1
    return gated_activation(h[:, 0::2], h[:, 1::2], activation, alpha, limit)


def dequantize_weight(
    weight: torch.Tensor,
    scale: Optional[torch.Tensor],
    global_scale: Optional[torch.Tensor],
    quant: str,
    scale_rows: Optional[torch.Tensor] = None,
    k: Optional[int] = None,
) -> torch.Tensor:
    """One expert's kernel-layout weight [N, K] (fp4: [N, Kp/2] in quant.py's kernel order)
    -> float32 [N, K].

    `scale_rows` maps each weight row to its fp8_block scale row (gate/up interleave of w13).
    `k`: the reduction size, needed for the 4-bit modes (their rows are padded).
    """
    if quant == "none":
        return weight.float()
    if quant == "fp8":
        return weight.float() * scale[:, None]
    if quant == "fp8_block":
        n, k = weight.shape
        if scale_rows is None:
            return weight.float() * q.expand_block_scales(scale, n, k)
        return weight.float() * scale[scale_rows].repeat_interleave(q.FP8_BLOCK, dim=1)[:, :k]
    if k is None:
        raise ValueError(f"dequantize_weight: quant={quant!r} needs k (its rows are padded)")
    natural = q.fp4_from_kernel_order(weight, k)
    return q.dequantize_fp4(natural, scale[..., :k // q.fp4_scale_block(quant)], quant, global_scale)


def quantize_activation(a: torch.Tensor, quant: str) -> torch.Tensor:
    """The activation operand of a GEMM as the kernels see it, dequantized to float32."""
    if quant == "fp8":
        values, scale = q.quantize_fp8_per_token(a)
        return values.float() * scale[:, None]
    if quant == "fp8_block":
        values, scale = q.quantize_fp8_per_token_group(a)
        return values.float() * scale.repeat_interleave(q.FP8_BLOCK, dim=1)[:, : a.shape[1]]
    return a.float()  # none, and the 4-bit modes (W4A16: activations as they are)


def fused_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    *,
    activation: str = "swiglu",
    quant: str = "none",
    alpha: float = 1.702,
    limit: float = 7.0,
    local_expert_offset: int = 0,
    w13_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """SPEC §1 for pre-routed pairs: [T, H] in x.dtype (partial sum over the local experts)."""
    num_tokens, hidden = x.shape
    num_experts, n13 = w13.shape[0], w13.shape[1]
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    aligned = align_tokens_reference(topk_ids, num_experts, local_expert_offset, block_m=1)
    scale_rows = None
    if quant == "fp8_block":
        scale_rows = w13_scale_rows(n13, is_gated(activation), q.FP8_BLOCK).to(x.device)
    pair_weights = topk_weights.reshape(-1).float()
    start = 0
    # The oracle may sync: it walks the experts with their counts on the host.
    for expert, count in enumerate(expert_counts(topk_ids, num_experts, local_expert_offset).tolist()):
        if count == 0:
            continue
        pairs = aligned.sorted_pair_ids[start:start + count].long()
        start += count
        tokens = pairs // top_k

        def expert_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[expert]

        w13_e = dequantize_weight(w13[expert], expert_tensor(w13_scale), expert_tensor(w13_global_scale),
                                  quant, scale_rows, k=hidden)
        h = quantize_activation(x[tokens], quant) @ w13_e.T
        if b13 is not None:
            h = h + b13[expert]
        # The intermediate is stored in the layer dtype between the two GEMMs.
        a = apply_activation(h, activation, alpha, limit).to(x.dtype)
        w2_e = dequantize_weight(w2[expert], expert_tensor(w2_scale), expert_tensor(w2_global_scale), quant,
                                 k=a.shape[1])
        y = quantize_activation(a, quant) @ w2_e.T
        if b2 is not None:
            y = y + b2[expert]
        out.index_add_(0, tokens, y * pair_weights[pairs, None])
    return out.to(x.dtype)
