"""The torch baseline every benchmark runs beside ours (PERFORMANCE.md, "The baseline").

A plain torch pipeline over checkpoint-layout weights, with nothing of moe_ops in the hot path:

    route (torch.topk / softmax / sigmoid)  ->  argsort of the flat expert ids
    -> gather the token rows -> grouped GEMM1 (`torch._grouped_mm`, bf16; or
       `torch._scaled_grouped_mm`, fp8 with per-token activation scales and per-output-channel
       weight scales: "rowwise") -> silu(gate) * up -> grouped GEMM2 -> * routing weight
    -> index_add into a float32 [T, H] accumulator -> the layer dtype.

The grouped GEMMs take `offs`, the int32 cumulative row counts per expert, computed on the
device (scatter_add + cumsum: no host sync, so the pipeline can be captured in a CUDA graph).
Where `torch._grouped_mm` / `torch._scaled_grouped_mm` are missing or fail on the device (they
need sm_90+ on CUDA; `_scaled_grouped_mm` has no CPU kernel), a per-expert loop of `torch.mm`
is used instead (it syncs to read the counts) and `Capabilities.notes` says so. The fp8 loop
emulates the scaled GEMM in float32 (dequantized fp8 operands, exact products).

Quant modes:
- none      bf16 weights, `_grouped_mm`.
- fp8       fp8 weights with their per-tensor scale expanded per output channel,
            `_scaled_grouped_mm` (rowwise): numerically the SPEC's fp8 mode.
- fp8_block the same fp8 weight bytes, but rowwise scaled: one scale per output channel (the
            mean of that row's 128x128 block scales) and per-token (not per-128-group)
            activation scales. `_scaled_grouped_mm` has no block-scaled recipe on sm_90, so the
            baseline's *time* is that of an fp8 grouped GEMM reading the same bytes; its
            *values* differ from the block-scaled layer by design.
- nvfp4 / mxfp4: the weights dequantized to bf16 once, then as `none` (W4A16 has no torch
            grouped kernel); the baseline reads 4x the bytes of the 4-bit layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from moe_ops.quant import FP8_DTYPE, FP8_MAX
from moe_ops.reference import gated_activation
from moe_ops.routing import DEEPSEEK_DENOMINATOR_EPS


# ---------------------------------------------------------------------------------------------
# What this torch can do on this device
# ---------------------------------------------------------------------------------------------
@dataclass
class Capabilities:
    grouped_mm: bool  # torch._grouped_mm (bf16) works on the device
    scaled_grouped_mm: bool  # torch._scaled_grouped_mm (fp8 rowwise) works on the device
    notes: list[str] = field(default_factory=list)
    scaled_mm: bool = False  # torch._scaled_mm (fp8 rowwise, any M): the fp8 loop's GEMM


_CAPABILITIES: dict[str, Capabilities] = {}


def _schema(name: str) -> Optional[str]:
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except Exception:  # noqa: BLE001 - private API: absence is an answer too
        return None
    return str(schemas[0]) if schemas else None


def probe_capabilities(device: torch.device | str) -> Capabilities:
    """Check that the grouped GEMMs exist with the signatures used here, and that they give the
    right numbers on `device` (a tiny problem against a float32 loop). Cached per device."""
    device = torch.device(device)
    key = str(device)
    if key in _CAPABILITIES:
        return _CAPABILITIES[key]
    notes: list[str] = []
    gen = torch.Generator(device="cpu").manual_seed(1234)
    # 48 rows in three groups of 5, 0 and 43 rows (unaligned, an empty group); K, N multiples of 16.
    m, k, n, groups = 48, 64, 32, 3
    a32 = torch.randn(m, k, generator=gen)
    w32 = torch.randn(groups, n, k, generator=gen) / 8
    offs = torch.tensor([5, 5, 48], dtype=torch.int32)
    bounds = [(0, 5), (5, 5), (5, 48)]

    def loop_reference(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([a[s:e] @ w[g].T for g, (s, e) in enumerate(bounds)])

    grouped = False
    if hasattr(torch, "_grouped_mm"):
        try:
            a, w = a32.to(torch.bfloat16), w32.to(torch.bfloat16)
            out = torch._grouped_mm(a.to(device), w.to(device).transpose(-2, -1), offs=offs.to(device))
            expected = loop_reference(a.float(), w.float())
            err = (out.float().cpu() - expected).norm() / expected.norm()
            grouped = bool(err < 1e-2)
            if not grouped:
                notes.append(f"torch._grouped_mm gave a wrong result on {device} (rel err {err:.3g}): "
                             "baseline uses a per-expert torch.mm loop for bf16")
        except Exception as exc:  # noqa: BLE001 - any failure means: use the loop
            notes.append(f"torch._grouped_mm unusable on {device} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120]}): baseline uses a per-expert torch.mm loop for bf16")
    else:
        notes.append(f"torch {torch.__version__} has no torch._grouped_mm: baseline uses a per-expert "
                     "torch.mm loop for bf16")

    scaled = False
    if hasattr(torch, "_scaled_grouped_mm"):
        try:
            aq, sa = quantize_rowwise(a32)
            wq = (w32 * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            sw = torch.full((groups, n), 1 / 64)
            out = torch._scaled_grouped_mm(aq.to(device), wq.to(device).transpose(-2, -1),
                                           sa.to(device), sw.to(device), offs=offs.to(device),
                                           out_dtype=torch.bfloat16)
            expected = loop_reference(aq.float() * sa[:, None], wq.float() / 64)
            err = (out.float().cpu() - expected).norm() / expected.norm()
            scaled = bool(err < 1e-2)
            if not scaled:
                notes.append(f"torch._scaled_grouped_mm gave a wrong result on {device} (rel err "
                             f"{err:.3g}): baseline fp8 uses a per-expert float32 loop")
        except Exception as exc:  # noqa: BLE001
            notes.append(f"torch._scaled_grouped_mm unusable on {device} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120]}): baseline fp8 uses a per-expert "
                         "float32 emulation loop (slow; not a fair fp8 baseline)")
    else:
        notes.append(f"torch {torch.__version__} has no torch._scaled_grouped_mm: baseline fp8 uses "
                     "a per-expert float32 emulation loop")
    scaled_mm = False
    if not scaled and device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        try:
            aq, sa = quantize_rowwise(a32[:5])
            wq = (w32[0] * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out = torch._scaled_mm(aq.to(device), wq.to(device).T, sa[:, None].to(device),
                                   torch.full((1, n), 1 / 64, device=device), out_dtype=torch.bfloat16)
            expected = (aq.float() * sa[:, None]) @ (wq.float() / 64).T
            scaled_mm = bool((out.float().cpu() - expected).norm() / expected.norm() < 1e-2)
        except Exception:  # noqa: BLE001
            scaled_mm = False
        if scaled_mm:
            notes.append("baseline fp8 falls back to a per-expert torch._scaled_mm (rowwise) loop")
    if grouped:
        notes.append(f"bf16 grouped GEMM: {_schema('_grouped_mm')}")
    if scaled:
        notes.append(f"fp8 grouped GEMM: {_schema('_scaled_grouped_mm')}")
    caps = Capabilities(grouped, scaled, notes, scaled_mm)
    _CAPABILITIES[key] = caps
    return caps


# ---------------------------------------------------------------------------------------------
# The pieces of the pipeline
# ---------------------------------------------------------------------------------------------
def torch_route(
    router_logits: torch.Tensor,
    method: str,
    top_k: int,
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing as a torch user writes it (topk, not a stable sort). (ids int64, weights f32)."""
    logits = router_logits.float()
    if method == "renormalize":
        values, ids = logits.topk(top_k, dim=-1)
        return ids, torch.softmax(values, dim=-1)
    if method in ("default", "renormalize_naive"):
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        if method == "renormalize_naive":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
    if method == "sigmoid_renorm":
        weights, ids = torch.sigmoid(logits).topk(top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)
    if method == "topk":
        weights, ids = logits.topk(top_k, dim=-1)
        return ids, weights
    if method == "llama4":
        values, ids = logits.topk(1, dim=-1)
        return ids, torch.sigmoid(values)
    if method == "deepseek_v3":
        num_tokens, num_experts = logits.shape
        scores = torch.sigmoid(logits)
        biased = scores if routing_bias is None else scores + routing_bias.float()
        grouped = biased.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        masked = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(num_tokens, num_experts)
        ids = masked.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + DEEPSEEK_DENOMINATOR_EPS)
        return ids, weights * routed_scaling_factor
    raise ValueError(f"routing: the baseline does not know {method!r}")


def quantize_rowwise(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K] -> (fp8 [M, K], float32 scale [M]): s = amax(row)/448, a zero row -> zeros."""
    af = a.float()
    amax = af.abs().amax(dim=-1)
    inverse = torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))
    return (af * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), amax / FP8_MAX


def activation_fn(h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0,
                  gated: bool = True) -> torch.Tensor:
    """GEMM1 output [M, 2I] (gate columns, then up columns: checkpoint order) -> [M, I]."""
    if activation == "relu2":
        return torch.relu(h).square()
    inter = h.shape[-1] // 2
    return gated_activation(h[:, :inter], h[:, inter:], activation, alpha, limit)


@dataclass
class BaselineWeights:
    """Checkpoint-layout weights of all experts, gate and up concatenated (not interleaved)."""

    w13: torch.Tensor  # [E, 2I, H] (gate rows then up rows), or [E, I, H] for relu2; bf16 or fp8
    w2: torch.Tensor  # [E, H, I]
    w13_scale: Optional[torch.Tensor] = None  # float32 [E, 2I]: per output channel (fp8 only)
    w2_scale: Optional[torch.Tensor] = None  # float32 [E, H]
    b13: Optional[torch.Tensor] = None  # float32 [E, 2I]
    b2: Optional[torch.Tensor] = None  # float32 [E, H]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in dataclasses.astuple(self)
                   if isinstance(t, torch.Tensor))


class TorchBaseline:
    """The baseline layer: `baseline(x, router_logits)` or `baseline.experts(x, ids, weights)`.

    `impl`: "auto" (grouped GEMMs where they work on the device, else the loop), "grouped" or
    "loop" (per-expert torch.mm; syncs on the expert counts).
    """

    def __init__(self, weights: BaselineWeights, *, top_k: int, routing: str = "renormalize",
                 routing_bias: Optional[torch.Tensor] = None, n_group: Optional[int] = None,
                 topk_group: Optional[int] = None, routed_scaling_factor: float = 1.0,
                 activation: str = "swiglu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, impl: str = "auto") -> None:
        if impl not in ("auto", "grouped", "loop"):
            raise ValueError(f"impl: expected auto, grouped or loop, got {impl!r}")
        self.weights = weights
        self.fp8 = weights.w13.dtype == FP8_DTYPE
        if self.fp8 and (weights.w13_scale is None or weights.w2_scale is None):
            raise ValueError("w13_scale and w2_scale: expected per-channel float32 scales for fp8 weights")
        self.top_k, self.routing, self.routing_bias = top_k, routing, routing_bias
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.activation, self.alpha, self.limit = activation, float(swiglu_alpha), float(swiglu_limit)
        self.num_experts = weights.w13.shape[0]
        caps = probe_capabilities(weights.w13.device)
        usable = caps.scaled_grouped_mm if self.fp8 else caps.grouped_mm
        if impl == "auto":
            impl = "grouped" if usable else "loop"
        self.impl = impl
        self.loop_scaled_mm = self.fp8 and caps.scaled_mm
        kind = "fp8 rowwise torch._scaled_grouped_mm" if self.fp8 else "bf16 torch._grouped_mm"
        loop = ("torch._scaled_mm (rowwise)" if self.loop_scaled_mm else
                "float32 emulation of fp8" if self.fp8 else "torch.mm")
        self.description = (kind if impl == "grouped" else
                            f"per-expert loop of {loop} ({kind} {'not used' if usable else 'unavailable'})")
        self.notes = list(caps.notes)

    # A CUDA graph can hold the grouped path only: the loop reads the counts on the host.
    @property
    def graph_safe(self) -> bool:
        return self.impl == "grouped"

    def __call__(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        ids, weights = torch_route(router_logits, self.routing, self.top_k, self.routing_bias,
                                   self.n_group, self.topk_group, self.routed_scaling_factor)
        return self.experts(hidden_states, ids, weights)

    def _gemm(self, a: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
              offs: torch.Tensor) -> torch.Tensor:
        """Rows of `a` grouped by expert (`offs`) times each expert's weight^T -> bf16/x dtype."""
        if self.fp8:
            aq, a_scale = quantize_rowwise(a)
            if self.impl == "grouped":
                return torch._scaled_grouped_mm(aq, weight.transpose(-2, -1), a_scale, scale,
                                                offs=offs, out_dtype=torch.bfloat16)
            out = torch.empty(a.shape[0], weight.shape[1], dtype=torch.bfloat16, device=a.device)
            start = 0
            for expert, end in enumerate(offs.tolist()):
                if end > start and self.loop_scaled_mm:
                    out[start:end] = torch._scaled_mm(aq[start:end], weight[expert].T,
                                                      a_scale[start:end, None].contiguous(),
                                                      scale[expert][None, :].contiguous(),
                                                      out_dtype=torch.bfloat16)
                elif end > start:
                    product = aq[start:end].float() @ weight[expert].float().T
                    out[start:end] = (product * a_scale[start:end, None] * scale[expert][None, :]).to(out.dtype)
                start = end
            return out
        a = a.to(weight.dtype)
        if self.impl == "grouped":
            return torch._grouped_mm(a, weight.transpose(-2, -1), offs=offs)
        out = torch.empty(a.shape[0], weight.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for expert, end in enumerate(offs.tolist()):
            if end > start:
                torch.mm(a[start:end], weight[expert].T, out=out[start:end])
            start = end
        return out

    def experts(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        w = self.weights
        num_tokens, hidden = hidden_states.shape
        flat_ids = topk_ids.reshape(-1).long()
        order = torch.argsort(flat_ids)
        token_of_row = order // topk_ids.shape[1]
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat_ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        offs = counts.cumsum(0).to(torch.int32)
        rows = hidden_states[token_of_row]
        h = self._gemm(rows, w.w13, w.w13_scale, offs)
        if w.b13 is not None:
            h = h.float() + w.b13[flat_ids[order]]
        a = activation_fn(h, self.activation, self.alpha, self.limit).to(hidden_states.dtype)
        y = self._gemm(a, w.w2, w.w2_scale, offs)
        if w.b2 is not None:
            y = y.float() + w.b2[flat_ids[order]]
        routed = y.float() * topk_weights.reshape(-1).float()[order, None]
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
        out.index_add_(0, token_of_row, routed)
        return out.to(hidden_states.dtype)
