"""transformers' own experts implementations as benchmark peers (bench.py --peers).

transformers >= 5 runs the routed experts of every model whose experts class uses
`@use_experts_implementation` through a registry of functions with the signature
`fn(experts_module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`; two of them
are plain torch and ship with transformers:

- "grouped_mm": sort the (token, slot) pairs by expert, `torch.nn.functional.grouped_mm` (or
  `torch._grouped_mm`) for both projections with offsets from `histc` (no host sync), the
  module's `_apply_gate`, weights applied, pairs summed back per token;
- "batched_mm": gather each pair's expert weights (`gate_up_proj[expert_ids]`: S x 2I x H
  elements, S = T*k) and run `torch.bmm`; no sort, but its memory grows with T*k.

A peer calls that function directly, as the model would, on an experts module in transformers'
layout built from the same random weights as our layer (the torch baseline's checkpoint-order
tensors, shared, not copied, where the layouts agree):

- gated swiglu/geglu experts: `gate_up_proj [E, 2I, H]` (gate rows, then up rows),
  `down_proj [E, H, I]` (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE ...);
- swiglu_oai (gpt-oss): transposed `[E, H, 2I]` with gate and up interleaved column by column,
  `down_proj [E, I, H]`, bf16 biases `[E, 2I]`, `[E, H]`, and gpt-oss's clamped gate (copies);
- relu2 (gate-less, Nemotron-H): `up_proj [E, I, H]`;
- other biased experts: bf16 `gate_up_proj_bias` / `down_proj_bias`.
(llama4 holds its experts in a class of its own, outside this registry: its peer uses the
first layout.)

Routing is not part of the experts function: a model's router produces (top_k_index,
top_k_weights). So that every line computes the same thing, the peer routes with moe_ops.route
(the same routing method, backend and routing bias as our layer; int32 ids, float32 weights)
and then calls the transformers function: the peer's time is that routing call plus the experts
function, as our layer's time is its routing plus its experts. `route_us` in the records is the
routing call alone, for readers who want the experts-only difference.

FP8: transformers' fine-grained FP8 experts (FP8ExpertsInterface "grouped_mm"/"batched_mm") run
their GEMMs on a hub kernel (kernels-community/finegrained-fp8, or DeepGEMM) that the `kernels`
package downloads at run time; `fp8_path_status()` says whether that can load here. The peers
are timed for quant="none" only; other modes get a note.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

PEER_NAMES = ("grouped_mm", "batched_mm")
# batched_mm gathers S = T*k expert weight matrices: skip a point whose gathered weights would
# take more than this fraction of the free device memory (it would fail or thrash the allocator).
BATCHED_MM_MEMORY_FRACTION = 0.25
CPU_BATCHED_MM_BYTES = 2 << 30


def transformers_status() -> tuple[Optional[str], Optional[str]]:
    """(transformers version, None) when its experts registry is importable, else (None, why)."""
    try:
        import transformers
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, too old, or a broken install
        return None, f"transformers' experts registry is not importable ({type(exc).__name__}: {exc})"
    return transformers.__version__, None


def experts_function(name: str) -> Callable:
    """transformers' registered experts implementation `name` ("grouped_mm", "batched_mm")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    return ALL_EXPERTS_FUNCTIONS[name]


def fp8_path_status() -> str:
    """Why transformers' fine-grained FP8 experts are not timed as peers (a note)."""
    try:
        from transformers.integrations import finegrained_fp8
    except Exception as exc:  # noqa: BLE001
        return f"transformers has no fine-grained FP8 experts here ({type(exc).__name__})"
    if not hasattr(finegrained_fp8, "FP8ExpertsInterface"):
        return "this transformers has no FP8ExpertsInterface"
    try:
        from transformers.utils.import_utils import is_kernels_available
        kernels = is_kernels_available()
    except Exception:  # noqa: BLE001
        kernels = False
    where = ("the `kernels` package is installed, but the kernel is fetched from the hub at run "
             "time" if kernels else "the `kernels` package is not installed")
    return ("transformers' fine-grained FP8 experts (FP8ExpertsInterface grouped_mm/batched_mm) "
            "run on the hub kernel kernels-community/finegrained-fp8 or DeepGEMM, loaded by the "
            f"`kernels` package ({where}); transformers ships no plain-torch FP8 experts path to "
            "time offline")


class _Experts(torch.nn.Module):
    """The attributes transformers' experts functions read, as `@use_experts_implementation`
    and the model's experts class set them (set by hand: the decorator modifies a class in
    place and its set of attributes differs between transformers versions)."""

    def __init__(self, num_experts: int, *, gated: bool, transposed: bool, concatenated: bool,
                 has_bias: bool, gate: Callable[[torch.Tensor], torch.Tensor],
                 act_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.has_gate, self.has_bias = gated, has_bias
        self.is_transposed, self.is_concatenated = transposed, concatenated
        self.has_post_expert_norm = False
        self._is_expert_parallel = False
        self._gate = gate
        self.act_fn = act_fn

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self._gate(gate_up_out)


def _gate_function(activation: str, concatenated: bool, alpha: float,
                   limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's `_apply_gate` computes (transformers' default: act(gate) * up on the
    halves; gpt-oss's: the clamped swiglu on interleaved columns), in the GEMM output dtype."""
    def split(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h.chunk(2, dim=-1) if concatenated else (h[..., ::2], h[..., 1::2])

    if activation == "swiglu":
        return lambda h: (lambda g, u: F.silu(g) * u)(*split(h))
    if activation == "geglu":
        return lambda h: (lambda g, u: F.gelu(g) * u)(*split(h))
    if activation == "swiglu_oai":
        def oai(h: torch.Tensor) -> torch.Tensor:
            gate, up = split(h)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        return oai
    raise ValueError(f"activation: no transformers gate for {activation!r}")


def build_experts_module(weights: Any, activation: str, *, dtype: torch.dtype,
                         swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> _Experts:
    """An experts module in transformers' layout over `weights` (benchmarks/baseline.py's
    BaselineWeights: w13 [E, 2I, H] gate-then-up, w2 [E, H, I], optional float32 b13/b2)."""
    w13, w2 = weights.w13, weights.w2
    if not w13.is_floating_point() or w13.element_size() == 1:
        raise ValueError(f"transformers peers take high-precision weights, got {w13.dtype}")
    num_experts = w13.shape[0]
    has_bias = weights.b13 is not None
    gated = activation != "relu2"
    if not gated:
        module = _Experts(num_experts, gated=False, transposed=False, concatenated=True,
                          has_bias=has_bias, gate=lambda h: h,
                          act_fn=lambda h: torch.relu(h).square())
        module.up_proj, module.down_proj = w13, w2
        if has_bias:
            module.up_proj_bias, module.down_proj_bias = weights.b13.to(dtype), weights.b2.to(dtype)
        return module
    if activation == "swiglu_oai":  # gpt-oss: transposed, interleaved, biased
        intermediate = w13.shape[1] // 2
        interleaved = torch.stack((w13[:, :intermediate], w13[:, intermediate:]), dim=2)
        module = _Experts(num_experts, gated=True, transposed=True, concatenated=False,
                          has_bias=True, gate=_gate_function(activation, False, swiglu_alpha,
                                                             swiglu_limit))
        module.gate_up_proj = interleaved.flatten(1, 2).transpose(1, 2).contiguous()
        module.down_proj = w2.transpose(1, 2).contiguous()
        del interleaved
        if has_bias:
            b13 = weights.b13
            module.gate_up_proj_bias = torch.stack(
                (b13[:, :intermediate], b13[:, intermediate:]), dim=2).flatten(1, 2).to(dtype)
            module.down_proj_bias = weights.b2.to(dtype)
        else:
            module.gate_up_proj_bias = torch.zeros(num_experts, 2 * intermediate, dtype=dtype,
                                                   device=w13.device)
            module.down_proj_bias = torch.zeros(num_experts, w2.shape[1], dtype=dtype,
                                                device=w13.device)
        return module
    module = _Experts(num_experts, gated=True, transposed=False, concatenated=True,
                      has_bias=has_bias, gate=_gate_function(activation, True, swiglu_alpha,
                                                             swiglu_limit))
    module.gate_up_proj, module.down_proj = w13, w2
    if has_bias:
        module.gate_up_proj_bias, module.down_proj_bias = weights.b13.to(dtype), weights.b2.to(dtype)
    return module


@dataclass
class Peer:
    """One transformers implementation over one layer's weights: `peer(x, logits)` routes with
    `route` and runs the experts function; `peer.experts(x, ids, weights)` skips routing."""

    name: str
    module: _Experts
    function: Callable
    route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def experts(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.function(self.module, hidden_states, topk_ids, topk_weights)

    def __call__(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(router_logits)
        return self.experts(hidden_states, ids, weights)

    def skip_reason(self, tokens: int, top_k: int, device: torch.device) -> Optional[str]:
        """Why this peer is not run at T=tokens (None: run it)."""
        if self.name != "batched_mm":
            return None
        up = self.module.gate_up_proj if self.module.has_gate else self.module.up_proj
        per_pair = (up[0].numel() + self.module.down_proj[0].numel()) * up.element_size()
        needed = tokens * top_k * per_pair
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            limit = BATCHED_MM_MEMORY_FRACTION * free
        else:
            limit = CPU_BATCHED_MM_BYTES
        if needed > limit:
            return (f"skipped: batched_mm would gather {needed / 1e9:.1f} GB of expert weights "
                    f"(T*k={tokens * top_k} pairs), over {limit / 1e9:.1f} GB")
        return None


def build_peers(names: list[str], weights: Any, activation: str, route: Callable, *,
                dtype: torch.dtype, swiglu_alpha: float = 1.702,
                swiglu_limit: float = 7.0) -> list[Peer]:
    """One Peer per name, all sharing one transformers-layout experts module."""
    if not names:
        return []
    module = build_experts_module(weights, activation, dtype=dtype, swiglu_alpha=swiglu_alpha,
                                  swiglu_limit=swiglu_limit)
    return [Peer(name, module, experts_function(name), route) for name in names]
