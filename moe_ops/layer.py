"""FusedMoE: the layer. Parameters in the kernel layout, permutation buffers, load_weights, forward.

Parameters (persistent: `state_dict` carries them) are the kernel-layout tensors planned by
moe_ops.layout for the configuration (w13, w2, their scales, biases) plus `routing_bias` for
DeepSeek-V3. The row-permutation indices that turn checkpoint tensors into that layout are
registered as non-persistent buffers `<role>_permutation`: `.to(device)` moves them,
`state_dict` leaves them out, and `load_weights` on a live layer (an RL weight sync) writes
the new weights in place through them, with no index recomputed and no parameter reallocated,
so CUDA graphs captured earlier stay valid.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_ops import layout
from moe_ops import quant as q
from moe_ops.errors import check
from moe_ops.experts import BACKENDS
from moe_ops.functional import fused_moe
from moe_ops.routing import validate_routing


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        *,
        routing: str = "renormalize",
        n_group: Optional[int] = None,
        topk_group: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
        activation: str = "swiglu",
        quant: str = "none",
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        local_expert_offset: int = 0,
        num_local_experts: Optional[int] = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            check(isinstance(value, int) and value >= 1, name, "a positive int", value)
        validate_routing(routing, num_experts, top_k, n_group, topk_group)
        check(activation in layout.ACTIVATIONS, "activation", f"one of {layout.ACTIVATIONS}",
              repr(activation))
        check(quant in q.QUANT_MODES, "quant", f"one of {q.QUANT_MODES}", repr(quant))
        check(dtype in layout.FLOAT_DTYPES, "dtype", "bfloat16, float16 or float32", dtype)
        if quant in ("nvfp4", "mxfp4"):
            check(dtype != torch.float32, "dtype", f"bfloat16 or float16 for quant={quant!r} "
                  "(W4A16)", dtype)
        check(backend in BACKENDS, "backend", f"one of {BACKENDS}", repr(backend))
        if num_local_experts is None:
            num_local_experts = num_experts - local_expert_offset
        check(0 <= local_expert_offset < num_experts, "local_expert_offset",
              f"in [0, num_experts={num_experts})", local_expert_offset)
        check(1 <= num_local_experts <= num_experts - local_expert_offset, "num_local_experts",
              f"in [1, num_experts - local_expert_offset = {num_experts - local_expert_offset}]",
              num_local_experts)

        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.top_k, self.routing, self.n_group, self.topk_group = top_k, routing, n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.activation, self.quant, self.bias = activation, quant, bias
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.local_expert_offset, self.num_local_experts = local_expert_offset, num_local_experts
        self.dtype, self.backend = dtype, backend
        device = torch.device(device) if device is not None else torch.get_default_device()

        self._layout_config = dict(quant=quant, activation=activation,
                                   num_local_experts=num_local_experts, hidden_size=hidden_size,
                                   intermediate_size=intermediate_size, bias=bias)
        specs = layout.plan_layout(**self._layout_config, dtype=dtype, device=device)
        self._roles = tuple(specs)
        for role, tensor in layout.allocate(specs, device).items():
            self.register_parameter(role, nn.Parameter(tensor, requires_grad=False))
        for role, spec in specs.items():
            self.register_buffer(f"{role}_permutation", layout.row_permutation(spec.key),
                                 persistent=False)
        if routing == "deepseek_v3":
            self.register_buffer("routing_bias", torch.zeros(num_experts, dtype=torch.float32,
                                                             device=device))
        else:
            self.routing_bias = None
        self._weights_loaded = False
        self.register_load_state_dict_post_hook(FusedMoE._mark_loaded)

    # state_dict format: 4 = mxfp4's block scales folded to at most 2 with a per-row scale
    # (quant.mxfp4_fold_scales; w13/w2_global_scale); 3 = packed fp4 rows in quant.py's kernel
    # order (padded, each word's bits permuted). Older dicts are converted on load (version 3's
    # mxfp4 scales folded, version 2's byte order permuted, version 1's natural packing put in
    # kernel order), so a saved layer is never misread.
    _version = 4

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        version = local_metadata.get("version", 1)
        self._convert_fp4_rows(state_dict, prefix, version)
        if self.quant == "mxfp4" and version < 4:
            for role in ("w13", "w2"):
                key, row_key = prefix + role + "_scale", prefix + role + "_global_scale"
                if key in state_dict:
                    state_dict[key], factor = q.mxfp4_fold_scales(state_dict[key])
                    # (a row scale the dict somehow holds already keeps its meaning)
                    state_dict[row_key] = (state_dict[row_key].float() * factor
                                           if row_key in state_dict else factor)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _convert_fp4_rows(self, state_dict, prefix, version) -> None:
        """Packed fp4 rows (and block scales) of a version-1 or -2 dict into version 3's form."""
        if self.quant in ("nvfp4", "mxfp4") and version < 3:
            for role, k in (("w13", self.hidden_size), ("w2", self.intermediate_size)):
                key = prefix + role
                if version < 2:
                    if key in state_dict and state_dict[key].shape[-1] == k // 2:
                        state_dict[key] = q.fp4_to_kernel_order(state_dict[key])
                    key = prefix + role + "_scale"
                    if key in state_dict:
                        state_dict[key] = q.fp4_pad_scales(state_dict[key], k, self.quant)
                elif key in state_dict and state_dict[key].shape[-1] == q.fp4_padded_k(k) // 2:
                    state_dict[key] = q.fp4_permute_word_bits(state_dict[key])

    @staticmethod
    def _mark_loaded(module: "FusedMoE", incompatible_keys) -> None:
        if not incompatible_keys.missing_keys:
            module._weights_loaded = True

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, top_k={self.top_k}, "
                f"routing={self.routing!r}, activation={self.activation!r}, quant={self.quant!r}, "
                f"local_experts={self.local_expert_offset}..{self.local_expert_offset + self.num_local_experts - 1}, "
                f"backend={self.backend!r}")

    @torch.no_grad()
    def load_weights(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: Optional[torch.Tensor] = None,
        *,
        w1_scale: Optional[torch.Tensor] = None,
        w2_scale: Optional[torch.Tensor] = None,
        w3_scale: Optional[torch.Tensor] = None,
        w1_global_scale: Optional[torch.Tensor] = None,
        w2_global_scale: Optional[torch.Tensor] = None,
        w3_global_scale: Optional[torch.Tensor] = None,
        b1: Optional[torch.Tensor] = None,
        b2: Optional[torch.Tensor] = None,
        b3: Optional[torch.Tensor] = None,
        routing_bias: Optional[torch.Tensor] = None,
    ) -> None:
        """Load the local experts' checkpoint tensors (SPEC §1 layout) into the kernel layout.

        Everything is validated before anything is written, so a rejected call leaves the
        layer as it was. On CUDA the writes (and any quantize-on-load) are the fused device
        kernels of moe_ops.kernels.prepare: nothing the size of a weight is allocated.
        """
        ckpt = layout.Checkpoint(w1, w2, w3, w1_scale, w2_scale, w3_scale, w1_global_scale,
                                 w2_global_scale, w3_global_scale, b1, b2, b3)
        sources = layout.checkpoint_sources(ckpt, **self._layout_config)
        if routing_bias is not None:
            check(self.routing == "deepseek_v3", "routing_bias",
                  "None unless routing='deepseek_v3'", "a tensor")
            check(tuple(routing_bias.shape) == (self.num_experts,), "routing_bias",
                  f"shape [{self.num_experts}] (all experts, not only the local ones)",
                  list(routing_bias.shape))
        destination = {role: getattr(self, role) for role in self._roles}
        permutations = {role: getattr(self, f"{role}_permutation") for role in self._roles}
        layout.load_into(destination, sources, permutations)
        if routing_bias is not None:
            self.routing_bias.copy_(routing_bias.float())
        self._weights_loaded = True

    def kernel_weights(self) -> dict[str, torch.Tensor]:
        """The kernel-layout tensors, as `moe_ops.fused_moe` takes them."""
        return {role: getattr(self, role) for role in self._roles}

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: Optional[torch.Tensor] = None,
        *,
        topk_ids: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        check(self._weights_loaded, "weights", "load_weights(...) (or load_state_dict) before "
              "the first forward", "a layer with no weights loaded")
        check(hidden_states.dtype == self.dtype, "hidden_states", f"dtype {self.dtype} (the "
              "layer's dtype)", hidden_states.dtype)
        if router_logits is not None:
            # The ops see only the local experts: a wrong expert count would route to experts
            # that do not exist (silently dropped), so the layer checks it against its own.
            check(router_logits.dim() == 2 and router_logits.shape[-1] == self.num_experts,
                  "router_logits", f"a 2-D tensor [num_tokens, num_experts={self.num_experts}]",
                  list(router_logits.shape))
        return fused_moe(
            hidden_states, router_logits, **self.kernel_weights(), top_k=self.top_k,
            routing=self.routing, routing_bias=self.routing_bias, n_group=self.n_group,
            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
            topk_ids=topk_ids, topk_weights=topk_weights, activation=self.activation,
            quant=self.quant, swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit,
            local_expert_offset=self.local_expert_offset, backend=self.backend)
