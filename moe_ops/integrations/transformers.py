"""Hugging Face transformers integration: "moe_ops" as an experts implementation.

    import moe_ops.integrations.transformers as moe_ops_hf
    moe_ops_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moe_ops")
    model.set_experts_implementation("moe_ops")          # or switch a loaded model

Any experts class decorated with transformers' `@use_experts_implementation` (Mixtral, Qwen2/3-MoE,
DeepSeek-V3, gpt-oss, OLMoE, Nemotron-H, ...) then runs its routed experts through
`moe_ops.fused_moe` with the router's pre-computed (top_k_index, top_k_weights).

How a module is read (once per experts module, then cached on it):

* Layout. Gated experts hold `gate_up_proj` `[E, 2I, H]` (`[E, H, 2I]` when transposed) with
  gate and up either concatenated (halves) or interleaved column by column (gpt-oss); gate-less
  experts hold `up_proj` `[E, I, H]`. `down_proj` is `[E, H, I]` (`[E, I, H]` when transposed).
  Optional `gate_up_proj_bias`/`up_proj_bias` and `down_proj_bias`. `is_transposed` (or the older
  `experts_are_transposed`) is read from the module, falling back on the weight shapes.
* Activation. What the module computes between its two projections is *measured*, not guessed
  from names: its `_apply_gate` (or `act_fn` for gate-less experts) is evaluated once on a probe
  tensor and compared with every activation moe_ops has — swiglu (silu), geglu (exact gelu),
  swiglu_oai (gpt-oss's clamped swiglu, with `alpha`/`limit` or `swiglu_alpha`/`swiglu_limit`
  read from the module), relu2 (gate-less) — in both gate/up orders (concatenated, interleaved).
  The one that matches is used; if none does (a tanh gelu, a clamped silu, a custom gate, a
  post-expert norm) a NotImplementedError names the module and its activation. A model is never
  silently run with a different function.

Fine-grained FP8 checkpoints: transformers' FP8Experts (float8_e4m3fn weights with
`*_scale_inv` per 128x128 block, dynamic activations) dispatch through their own registry
(FP8ExpertsInterface), where `register()` adds the same implementation; they run as
quant="fp8_block". FP8 experts moe_ops cannot map (other block sizes, I or H not multiples of
128, static activation scales, fp4-packed weights) run transformers' own FP8Experts forward
after a one-time warning naming the reason (FallbackToTransformers).

Kernel-layout weights are prepared once per module (`plan_layout` + `load_into` with the
`row_permutation` indices, layer dtype = hidden_states.dtype) into non-persistent buffers on the
module (`moe_ops_w13`, `moe_ops_w2`, `moe_ops_b13`, `moe_ops_b2`, and `<name>_permutation`):
`.to(...)` moves them, `state_dict` leaves them out, compiled graphs take them as inputs. They
are refilled, in place when shape/dtype/device still fit (addresses unchanged, so captured CUDA
graphs stay valid), whenever the key of every expert parameter (identity, data_ptr, `_version`,
shape, stride, dtype, device; O(number of parameters)) changed: an in-place update under no_grad
(`param.copy_`, `load_state_dict`), a replaced parameter, `.to(...)` or a dtype change. Writes
through `param.data` do not bump `_version`; call `invalidate(model)` after those. Compiled code
cannot read the key: call `prepare(model)` (or run an eager forward) before compiling, and
`refresh(model)` after a weight update.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_ops.experts import BACKENDS
from moe_ops.functional import fused_moe
from moe_ops.layout import (Checkpoint, checkpoint_sources, load_into, plan_layout,
                            prepare_weights, row_permutation)
from moe_ops.quant import FP8_BLOCK, FP8_DTYPE

IMPLEMENTATION_NAME = "moe_ops"

_SPEC_ATTR = "_moe_ops_experts_spec"
_CACHE_ATTR = "_moe_ops_weight_cache"
BUFFER_PREFIX = "moe_ops_"


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------
def register(name: str = IMPLEMENTATION_NAME, *, backend: str = "auto") -> None:
    """Add `name` ("moe_ops") to transformers' experts-implementation registry.

    Afterwards `from_pretrained(..., experts_implementation=name)`, `from_config(...)` with the
    same keyword, or `model.set_experts_implementation(name)` route every experts module that
    uses `@use_experts_implementation` through `moe_ops.fused_moe(..., backend=backend)`.
    Registering again (e.g. with another backend) replaces the entry.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "moe_ops.integrations.transformers.register() needs transformers with an experts "
            "implementation registry (transformers.integrations.moe.ExpertsInterface, "
            "transformers >= 5)") from exc
    forward = functools.partial(experts_forward, backend=backend)
    functools.update_wrapper(forward, experts_forward)
    ExpertsInterface.register(name, forward)
    # Fine-grained FP8 checkpoints (quantization_config quant_method="fp8") replace each experts
    # module with transformers' FP8Experts, which dispatches through a registry of its own
    # (FP8ExpertsInterface: a subclass of ExpertsInterface with its own class-wide mapping, so
    # the registration above does not reach it). The same function serves both: it maps
    # 128x128 block-scaled weights onto quant="fp8_block" and hands anything else back to
    # transformers' own FP8Experts forward with a one-time warning.
    fp8_interface = _fp8_experts_interface()
    if fp8_interface is not None:
        fp8_interface.register(name, forward)


def _fp8_experts_interface():
    """transformers' FP8 experts registry class, or None where this transformers has none."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except Exception:  # noqa: BLE001 - absent (older transformers) or failing optional imports
        return None
    return FP8ExpertsInterface


def invalidate(module: torch.nn.Module) -> None:
    """Mark the kernel-layout buffers of every experts module under `module` stale (and forget
    its measured layout/activation): the next eager forward, or `refresh`, re-prepares them
    (in place where shapes allow). Needed only after writes that bypass autograd's version
    counter (`param.data.copy_(...)`)."""
    for sub in module.modules():
        entry = sub.__dict__.get(_CACHE_ATTR)
        if entry is not None:  # keep what refresh() needs; a key that never matches
            sub.__dict__[_CACHE_ATTR] = {**entry, "key": (None,) + entry["key"][1:3]}
        sub.__dict__.pop(_SPEC_ATTR, None)


# ---------------------------------------------------------------------------------------------
# What an experts module computes
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """How one transformers experts module maps onto moe_ops."""

    gated: bool  # gate_up_proj (gate and up) or only up_proj
    concatenated: bool  # gate/up as halves of the 2I axis (True) or interleaved (False)
    transposed: bool  # weights stored [E, in, out] instead of [E, out, in]
    has_bias: bool
    activation: str  # a moe_ops activation
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quant: str = "none"  # "fp8_block" for transformers' fine-grained FP8Experts


class FallbackToTransformers(NotImplementedError):
    """A quantized experts module moe_ops does not map onto its kernels (e.g. fine-grained FP8
    with blocks other than 128x128): the module runs transformers' own forward instead, after a
    one-time warning that names the reason."""


_GATED_ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai")


def _config_value(config, key: str):
    """A config attribute, or None (heterogeneous configs raise on per-layer attributes)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - e.g. transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _tensor_attr(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _activation_name(module: torch.nn.Module) -> str:
    """A readable name of what the module applies, for error messages."""
    parts = []
    act = getattr(module, "act_fn", None)
    if act is not None:
        parts.append(f"act_fn={getattr(act, '__name__', type(act).__name__)}")
    config = getattr(module, "config", None)
    for key in ("hidden_act", "hidden_activation", "mlp_hidden_act", "activation_function"):
        value = _config_value(config, key)
        if isinstance(value, str):
            parts.append(f"config.{key}={value!r}")
            break
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        parts.append(f"custom {type(module).__name__}._apply_gate")
    return ", ".join(parts) or "unknown activation"


def _oai_parameters(module: torch.nn.Module) -> list[tuple[float, float]]:
    """(alpha, limit) pairs the module declares (gpt-oss: alpha/limit; others: swiglu_*)."""
    pairs = []
    config = getattr(module, "config", None)
    for owner, a_name, l_name in ((module, "alpha", "limit"),
                                  (module, "swiglu_alpha", "swiglu_limit"),
                                  (config, "swiglu_alpha", "swiglu_limit")):
        alpha, limit = _config_value(owner, a_name), _config_value(owner, l_name)
        if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
            pair = (float(alpha), float(limit))
            if pair not in pairs:
                pairs.append(pair)
    return pairs


def _declared_limits(module: torch.nn.Module) -> list[float]:
    """Every numeric clamp-like attribute of the module, so the probe reaches past it."""
    values = []
    for name in ("limit", "swiglu_limit", "clamp_limit", "activation_limit"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and math.isfinite(value):
            values.append(abs(float(value)))
    return values


def _probe(module: torch.nn.Module, width: int) -> torch.Tensor:
    """float32 [rows, width], rows spanning magnitudes 0.05 .. past any declared clamp."""
    reach = min(max([16.0] + [4.0 * v for v in _declared_limits(module)]), 1e4)
    generator = torch.Generator().manual_seed(0)
    rows = 64
    scales = torch.logspace(math.log10(0.05), math.log10(reach), rows, dtype=torch.float64)
    return (torch.randn(rows, width, generator=generator, dtype=torch.float64)
            * scales[:, None]).float()


def _evaluate(fn: Callable[[torch.Tensor], torch.Tensor], module: torch.nn.Module,
              probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        try:
            return fn(probe).float().cpu()
        except RuntimeError:
            # A gate that touches a tensor on the module's device: probe there.
            device = next((p.device for p in module.parameters()), probe.device)
            return fn(probe.to(device)).float().cpu()


def _matches(candidate: torch.Tensor, reference: torch.Tensor) -> bool:
    return (candidate.shape == reference.shape
            and torch.allclose(candidate, reference, rtol=1e-5, atol=1e-6, equal_nan=True))


def _gated_candidates(module: torch.nn.Module):
    yield "swiglu", {}, lambda g, u: F.silu(g) * u
    yield "geglu", {}, lambda g, u: F.gelu(g) * u
    for alpha, limit in _oai_parameters(module):
        def oai(g, u, alpha=alpha, limit=limit):
            g = g.clamp(max=limit)
            u = u.clamp(min=-limit, max=limit)
            return (u + 1) * g * torch.sigmoid(alpha * g)
        yield "swiglu_oai", {"swiglu_alpha": alpha, "swiglu_limit": limit}, oai


def _is_transposed(module: torch.nn.Module, up: torch.Tensor, down: torch.Tensor,
                   hidden_size: Optional[int]) -> bool:
    for name in ("is_transposed", "experts_are_transposed"):
        flag = getattr(module, name, None)
        if isinstance(flag, bool):
            return flag
    # Older transformers without the flag: the hidden size tells [E, H, I] from [E, I, H].
    if hidden_size is not None and down.dim() == 3:
        if down.shape[1] == hidden_size and down.shape[2] != hidden_size:
            return False
        if down.shape[2] == hidden_size and down.shape[1] != hidden_size:
            return True
    return False


def describe_experts(module: torch.nn.Module, hidden_size: Optional[int] = None) -> ExpertsSpec:
    """Read (and measure) how `module` computes its experts. Raises NotImplementedError for what
    moe_ops cannot compute, naming the module and the activation."""
    cls = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"moe_ops: {cls} applies a norm after each expert (has_post_expert_norm=True), "
            "which moe_ops.fused_moe does not compute; use another experts_implementation "
            "(e.g. 'grouped_mm' or 'eager') for this model")
    gate_up = _tensor_attr(module, "gate_up_proj")
    up_only = _tensor_attr(module, "up_proj")
    down = _tensor_attr(module, "down_proj")
    has_gate = getattr(module, "has_gate", None)
    gated = gate_up is not None if has_gate is None else bool(has_gate)
    up = gate_up if gated else up_only
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        raise NotImplementedError(
            f"moe_ops: {cls} does not hold its experts as 3-D tensors "
            f"{'gate_up_proj' if gated else 'up_proj'} and down_proj (got "
            f"{None if up is None else list(up.shape)}, {None if down is None else list(down.shape)}); "
            "quantized or otherwise packed experts are not supported by this integration")
    if _tensor_attr(module, "down_proj_scale_inv") is not None:  # transformers' FP8Experts
        return _describe_fp8(module, gated, up, down, hidden_size)
    if not (up.is_floating_point() and down.is_floating_point()) or {up.dtype, down.dtype} - {
            torch.float32, torch.bfloat16, torch.float16}:
        raise NotImplementedError(
            f"moe_ops: {cls} holds quantized experts ({up.dtype}, {down.dtype}); this integration "
            "takes bfloat16/float16/float32 expert weights only (quant='none')")
    transposed = _is_transposed(module, up, down, hidden_size)
    intermediate = down.shape[1] if transposed else down.shape[2]
    bias_names = ("gate_up_proj_bias" if gated else "up_proj_bias", "down_proj_bias")
    has_bias = any(_tensor_attr(module, n) is not None for n in bias_names)
    if getattr(module, "has_bias", False) and not has_bias:
        raise NotImplementedError(f"moe_ops: {cls} declares has_bias=True but holds no "
                                  f"{' or '.join(bias_names)} tensor")
    return _measured_spec(module, gated, transposed, has_bias, intermediate)


def _measured_spec(module: torch.nn.Module, gated: bool, transposed: bool, has_bias: bool,
                   intermediate: int, quant: str = "none") -> ExpertsSpec:
    """The spec of `module` with its activation measured on a probe (see the module doc)."""
    cls = type(module).__name__
    if not gated:
        act = getattr(module, "act_fn", None)
        if act is None:
            raise NotImplementedError(f"moe_ops: gate-less {cls} has no act_fn to measure")
        probe = _probe(module, max(intermediate, 2))
        reference = _evaluate(act, module, probe)
        if _matches(F.relu(probe) ** 2, reference):
            return ExpertsSpec(False, True, transposed, has_bias, "relu2", quant=quant)
        raise NotImplementedError(
            f"moe_ops: gate-less {cls} applies {_activation_name(module)}; moe_ops computes "
            "gate-less experts only with relu2 (relu(x)^2). Use another experts_implementation "
            "(e.g. 'grouped_mm' or 'eager') for this model")

    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:  # transformers without a default _apply_gate: act(gate) * up, halves
        act = module.act_fn

        def apply_gate(x):
            gate, up_ = x.chunk(2, dim=-1)
            return act(gate) * up_
    probe = _probe(module, 2 * max(intermediate, 2))
    reference = _evaluate(apply_gate, module, probe)
    declared = getattr(module, "is_concatenated", None)
    orders = (True, False) if declared is not False else (False, True)
    for concatenated in orders:
        g, u = probe.chunk(2, dim=-1) if concatenated else (probe[:, 0::2], probe[:, 1::2])
        for activation, extra, fn in _gated_candidates(module):
            if _matches(fn(g, u), reference):
                return ExpertsSpec(True, concatenated, transposed, has_bias, activation,
                                   quant=quant, **extra)
    oai = _oai_parameters(module)
    raise NotImplementedError(
        f"moe_ops: {cls} applies a gated activation moe_ops does not compute "
        f"({_activation_name(module)}): it matches none of swiglu (silu), geglu (exact erf gelu), "
        f"swiglu_oai (gpt-oss clamped swiglu{', alpha/limit ' + str(oai) if oai else ', no alpha/limit attributes found'}) "
        "with gate/up concatenated or interleaved. Use another experts_implementation "
        "(e.g. 'grouped_mm' or 'eager') for this model")


def _fp8_fallback(module: torch.nn.Module, why: str) -> FallbackToTransformers:
    return FallbackToTransformers(
        f"moe_ops: {type(module).__name__} runs transformers' own FP8 experts forward instead of "
        f"moe_ops: {why}")


def _describe_fp8(module: torch.nn.Module, gated: bool, up: torch.Tensor, down: torch.Tensor,
                  hidden_size: Optional[int]) -> ExpertsSpec:
    """transformers' fine-grained FP8Experts -> quant="fp8_block", or FallbackToTransformers.

    FP8Experts holds `gate_up_proj` float8_e4m3fn [E, 2I, H] (gate rows, then up rows) with
    `gate_up_proj_scale_inv` [E, 2I/bn, H/bk] and `down_proj` [E, H, I] with
    `down_proj_scale_inv` [E, H/bn, I/bk]; dequantized weight = value x scale_inv of its block,
    which is moe_ops' fp8_block scale exactly when the block is 128x128. Activations are
    quantized dynamically per token per 128 columns on both sides (activation_scheme
    "dynamic"). Everything else falls back, naming why."""
    up_name = "gate_up_proj" if gated else "up_proj"
    if up.dtype != FP8_DTYPE or down.dtype != FP8_DTYPE:
        raise _fp8_fallback(module, f"{up_name}/down_proj are {up.dtype}/{down.dtype} (moe_ops "
                            "maps float8_e4m3fn expert weights with block scales only, not "
                            "fp4-packed or cast ones)")
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _fp8_fallback(module, f"activation_scheme={scheme!r} (moe_ops quantizes "
                            "activations dynamically, per token per 128 columns)")
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        raise _fp8_fallback(module, f"weight_block_size={block} (moe_ops' fp8_block kernels "
                            f"take {FP8_BLOCK}x{FP8_BLOCK} weight blocks)")
    if getattr(module, "is_transposed", False) or getattr(module, "experts_are_transposed", False):
        raise _fp8_fallback(module, "transposed FP8 expert weights")
    if getattr(module, "has_bias", False) or _tensor_attr(module, "down_proj_bias") is not None:
        raise _fp8_fallback(module, "FP8 experts with biases")
    experts, rows, hidden = up.shape
    intermediate = rows // 2 if gated else rows
    if hidden_size is not None and hidden != hidden_size:
        raise ValueError(f"moe_ops: {type(module).__name__} {up_name} {list(up.shape)} does not "
                         f"match hidden_states (hidden size {hidden_size})")
    if intermediate % FP8_BLOCK or hidden % FP8_BLOCK:
        raise _fp8_fallback(
            module, f"intermediate size {intermediate} and hidden size {hidden} must both be "
            f"multiples of {FP8_BLOCK}: otherwise a {FP8_BLOCK}-row scale block of "
            f"{up_name}_scale_inv straddles the gate and up halves (and the last activation "
            "group is partial)")
    scales = {name: _tensor_attr(module, name) for name in (up_name + "_scale_inv", "down_proj_scale_inv")}
    expected = {up_name + "_scale_inv": (experts, rows // FP8_BLOCK, hidden // FP8_BLOCK),
                "down_proj_scale_inv": (experts, hidden // FP8_BLOCK, intermediate // FP8_BLOCK)}
    for name, scale in scales.items():
        if scale is None or tuple(scale.shape) != expected[name]:
            raise _fp8_fallback(module, f"{name} is {None if scale is None else list(scale.shape)}, "
                                f"expected {list(expected[name])} (one scale per 128x128 block)")
        if scale.dtype not in (torch.float32, getattr(torch, "float8_e8m0fnu", torch.float32)):
            raise _fp8_fallback(module, f"{name} has dtype {scale.dtype} (float32 or e8m0 scales only)")
    if tuple(down.shape) != (experts, hidden, intermediate):
        raise _fp8_fallback(module, f"down_proj is {list(down.shape)}, expected "
                            f"{[experts, hidden, intermediate]}")
    try:
        spec = _measured_spec(module, gated, False, False, intermediate, quant="fp8_block")
    except NotImplementedError as exc:
        raise _fp8_fallback(module, str(exc).removeprefix("moe_ops: ")) from None
    if not spec.concatenated:
        raise _fp8_fallback(module, "its gate/up columns are interleaved, so 128-row scale "
                            "blocks mix gate and up rows")
    return spec


_WARNED_FALLBACKS: set[tuple[str, str]] = set()


def _warn_fallback(module: torch.nn.Module, exc: FallbackToTransformers) -> None:
    """One warning per (class, reason), not one per layer."""
    key = (type(module).__name__, str(exc))
    if key not in _WARNED_FALLBACKS:
        _WARNED_FALLBACKS.add(key)
        warnings.warn(str(exc), stacklevel=3)


def _spec_or_fallback(module: torch.nn.Module, hidden_size: int):
    """The module's cached ExpertsSpec, or the cached FallbackToTransformers (returned, not
    raised: the forward branches on it without an exception, also under torch.compile)."""
    spec = getattr(module, _SPEC_ATTR, None)
    if spec is None:
        try:
            spec = describe_experts(module, hidden_size)
        except FallbackToTransformers as exc:
            _warn_fallback(module, exc)
            spec = exc
        module.__dict__[_SPEC_ATTR] = spec
    return spec


def _spec(module: torch.nn.Module, hidden_size: int) -> ExpertsSpec:
    spec = _spec_or_fallback(module, hidden_size)
    if isinstance(spec, FallbackToTransformers):
        raise FallbackToTransformers(str(spec))  # a fresh one: a re-raised one grows its traceback
    return spec


# ---------------------------------------------------------------------------------------------
# Weights: module parameters -> checkpoint layout (SPEC §1) -> kernel layout (cached)
# ---------------------------------------------------------------------------------------------
def _source_names(spec: ExpertsSpec) -> tuple[str, ...]:
    names = ("gate_up_proj" if spec.gated else "up_proj", "down_proj")
    if spec.has_bias:
        names += ("gate_up_proj_bias" if spec.gated else "up_proj_bias", "down_proj_bias")
    if spec.quant == "fp8_block":
        names += ("gate_up_proj_scale_inv" if spec.gated else "up_proj_scale_inv",
                  "down_proj_scale_inv")
    return names


def checkpoint_weights(module: torch.nn.Module, spec: ExpertsSpec,
                       hidden_size: int) -> dict[str, torch.Tensor]:
    """The module's experts in the checkpoint layout `moe_ops.prepare_weights` takes: w1 gate
    [E, I, H], w3 up [E, I, H] (gated only), w2 down [E, H, I], biases b1/b3 [E, I], b2 [E, H],
    and for fine-grained FP8 experts the block scales w1_scale/w3_scale [E, I/128, H/128] and
    w2_scale [E, H/128, I/128] (float32). Views of the parameters where possible (no copies;
    e8m0 scales are converted to float32, exactly)."""
    cls = type(module).__name__
    up = _tensor_attr(module, "gate_up_proj" if spec.gated else "up_proj")
    down = _tensor_attr(module, "down_proj")
    if spec.transposed:
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    experts, rows, hidden = up.shape
    intermediate = rows // 2 if spec.gated else rows
    if (hidden != hidden_size or (spec.gated and rows % 2)
            or tuple(down.shape) != (experts, hidden_size, intermediate)):
        raise ValueError(
            f"moe_ops: {cls} weights do not match hidden_states (hidden size {hidden_size}): "
            f"{'gate_up_proj' if spec.gated else 'up_proj'} {list(getattr(module, 'gate_up_proj' if spec.gated else 'up_proj').shape)}, "
            f"down_proj {list(module.down_proj.shape)}, is_transposed={spec.transposed}")

    def split(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if spec.concatenated:
            return t.narrow(dim, 0, intermediate), t.narrow(dim, intermediate, intermediate)
        index = [slice(None)] * t.dim()
        gate_index, up_index = list(index), list(index)
        gate_index[dim], up_index[dim] = slice(0, None, 2), slice(1, None, 2)
        return t[tuple(gate_index)], t[tuple(up_index)]

    weights: dict[str, torch.Tensor] = {"w2": down}
    if spec.quant == "fp8_block":
        # _describe_fp8 checked: concatenated, not transposed, I and H multiples of 128, so the
        # first I/128 scale rows of gate_up_proj_scale_inv are the gate's, the rest the up's.
        up_scale = _tensor_attr(module, "gate_up_proj_scale_inv" if spec.gated else "up_proj_scale_inv")
        down_scale = _tensor_attr(module, "down_proj_scale_inv")
        up_scale, down_scale = up_scale.float(), down_scale.float()  # no-op for float32 scales
        weights["w2_scale"] = down_scale
        if spec.gated:
            blocks = intermediate // FP8_BLOCK
            weights["w1_scale"] = up_scale.narrow(1, 0, blocks)
            weights["w3_scale"] = up_scale.narrow(1, blocks, blocks)
        else:
            weights["w1_scale"] = up_scale
    if spec.gated:
        weights["w1"], weights["w3"] = split(up, 1)
    else:
        weights["w1"] = up
    if spec.has_bias:
        up_bias = _tensor_attr(module, "gate_up_proj_bias" if spec.gated else "up_proj_bias")
        down_bias = _tensor_attr(module, "down_proj_bias")
        if up_bias is None:
            up_bias = torch.zeros(experts, rows, dtype=up.dtype, device=up.device)
        if down_bias is None:
            down_bias = torch.zeros(experts, hidden, dtype=up.dtype, device=up.device)
        weights["b2"] = down_bias
        if spec.gated:
            weights["b1"], weights["b3"] = split(up_bias, 1)
        else:
            weights["b1"] = up_bias
    return weights


def _cache_key(module: torch.nn.Module, spec: ExpertsSpec, dtype: torch.dtype,
               device: torch.device) -> tuple:
    """O(number of parameters): metadata only, never the weights' values."""
    key: list = [spec, dtype, device]
    for name in _source_names(spec):
        tensor = _tensor_attr(module, name)
        if tensor is None:
            key.append((name, None))
            continue
        key.append((name, tensor.data_ptr(), tensor._version, tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype, tensor.device))
    return tuple(key)


def _cache_valid(entry: dict, module: torch.nn.Module, key: tuple) -> bool:
    if entry["key"] != key:
        return False
    # The same object, not a new parameter that happens to reuse the address of a freed one.
    if not all(ref() is _tensor_attr(module, name) for name, ref in entry["refs"].items()):
        return False
    # The prepared buffers are still there (and the key's version of them: `.to()` moves them).
    return all(module._buffers.get(buffer_name(role)) is not None for role in entry["roles"])


def buffer_name(role: str) -> str:
    """Name of the non-persistent buffer holding kernel-layout tensor `role` on the experts
    module ("w13" -> "moe_ops_w13"); its permutation index is `<name>_permutation`."""
    return BUFFER_PREFIX + role


def _roles(spec: ExpertsSpec) -> tuple[str, ...]:
    scales = ("w13_scale", "w2_scale") if spec.quant == "fp8_block" else ()
    return ("w13", "w2") + scales + (("b13", "b2") if spec.has_bias else ())


def _set_buffer(module: torch.nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
    module.register_buffer(name, tensor, persistent=False)


def _prepare_into_buffers(module: torch.nn.Module, spec: ExpertsSpec, dtype: torch.dtype,
                          device: torch.device, hidden_size: int) -> dict[str, torch.Tensor]:
    """Fill (or create) the module's kernel-layout buffers from its parameters. Buffers whose
    shape, dtype and device are still right are written in place (their addresses stay, so
    CUDA graphs captured on them stay valid); the others are replaced."""
    checkpoint = checkpoint_weights(module, spec, hidden_size)
    experts, intermediate, hidden = checkpoint["w1"].shape
    config = dict(quant=spec.quant, activation=spec.activation, num_local_experts=experts,
                  hidden_size=hidden, intermediate_size=intermediate, bias=spec.has_bias)
    specs = plan_layout(**config, dtype=dtype, device=device)
    sources = checkpoint_sources(Checkpoint(**checkpoint), **config)
    destination, permutations = {}, {}
    for role, tensor_spec in specs.items():
        name, perm_name = buffer_name(role), buffer_name(role) + "_permutation"
        current = module._buffers.get(name)
        if (current is None or tuple(current.shape) != tensor_spec.shape
                or current.dtype != tensor_spec.dtype or current.device != device):
            if current is not None:
                _set_buffer(module, name, None)  # free the stale copy before allocating
            _set_buffer(module, name, tensor_spec.new_tensor(device))
        permutation = module._buffers.get(perm_name)
        rows = sum(tensor_spec.key.source_rows)
        if permutation is None or permutation.device != device or permutation.shape != (rows,):
            permutation = row_permutation(tensor_spec.key)
            _set_buffer(module, perm_name, permutation)
        destination[role], permutations[role] = module._buffers[name], permutation
    for name in list(module._buffers):  # roles a previous layout had and this one has not
        if name.startswith(BUFFER_PREFIX) and name.removeprefix(BUFFER_PREFIX).removesuffix(
                "_permutation") not in specs:
            del module._buffers[name]
    load_into(destination, sources, permutations)
    return destination


def kernel_weights(module: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                   hidden_size: int) -> dict[str, torch.Tensor]:
    """The module's experts in moe_ops' kernel layout (what `moe_ops.fused_moe` takes): the
    module's non-persistent `moe_ops_*` buffers, filled on first use and refilled in place
    whenever a parameter changed since."""
    spec = _spec(module, hidden_size)
    roles = _roles(spec)
    if spec.quant != "none":
        # Quantized weights keep their format whatever the activations' dtype: one layout
        # serves every layer dtype (and the cache key does not depend on it).
        dtype = None
    if torch.compiler.is_compiling():
        # Traced graphs cannot read data_ptr/_version: use the buffers an eager call prepared
        # (graph inputs, so their fixed addresses are what CUDA graphs capture).
        tensors = {role: getattr(module, buffer_name(role), None) for role in roles}
        w13 = tensors["w13"]
        if all(t is not None for t in tensors.values()) \
                and w13.dtype == (dtype if spec.quant == "none" else FP8_DTYPE) \
                and w13.device == device:
            return tensors
        # Nothing prepared for this dtype/device: prepare inside the graph (correct, slower).
        return prepare_weights(**checkpoint_weights(module, spec, hidden_size),
                               activation=spec.activation, quant=spec.quant, dtype=dtype,
                               device=device)
    key = _cache_key(module, spec, dtype, device)
    entry = module.__dict__.get(_CACHE_ATTR)
    if entry is not None and _cache_valid(entry, module, key):
        return {role: module._buffers[buffer_name(role)] for role in roles}
    module.__dict__.pop(_CACHE_ATTR, None)
    with torch.no_grad():
        weights = _prepare_into_buffers(module, spec, dtype, device, hidden_size)
    refs = {name: weakref.ref(t) for name in _source_names(spec)
            if (t := _tensor_attr(module, name)) is not None}
    module.__dict__[_CACHE_ATTR] = {"key": _cache_key(module, spec, dtype, device),
                                    "refs": refs, "roles": roles, "hidden_size": hidden_size}
    return weights


def _is_experts_module(module: torch.nn.Module) -> bool:
    """An experts class decorated with transformers' @use_experts_implementation."""
    down = _tensor_attr(module, "down_proj")
    return (down is not None and down.dim() == 3
            and hasattr(type(module).forward, "__wrapped__"))


def prepare(module: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> int:
    """Measure and prepare, now and eagerly, every experts module under `module`, as its first
    forward would (layer dtype `dtype`, default the experts' own dtype; their device). Lets
    `torch.compile(fullgraph=True)` or CUDA-graph capture start without an eager forward, and
    raises at once for experts moe_ops cannot compute. FP8 experts that fall back to
    transformers' own forward (see FallbackToTransformers) are skipped, with the one-time
    warning. Returns how many modules it prepared."""
    count = 0
    for sub in module.modules():
        if not _is_experts_module(sub):
            continue
        down = sub.down_proj
        hidden_size = _config_value(getattr(sub, "config", None), "hidden_size")
        if isinstance(hidden_size, int):
            spec = _spec_or_fallback(sub, hidden_size)
        else:
            try:
                spec = describe_experts(sub)
            except FallbackToTransformers as exc:
                _warn_fallback(sub, exc)
                spec = exc
            if not isinstance(spec, FallbackToTransformers):
                hidden_size = down.shape[2] if spec.transposed else down.shape[1]
        if isinstance(spec, FallbackToTransformers):
            continue
        kernel_weights(sub, dtype or down.dtype, down.device, hidden_size)
        count += 1
    return count


def refresh(module: torch.nn.Module) -> int:
    """Re-prepare, now and eagerly, the kernel-layout buffers of every experts module under
    `module` that a forward prepared before and whose parameters changed since (same dtype and
    device as that forward; in place where shapes allow). For compiled models and captured
    CUDA graphs, which cannot check the parameters themselves: call it after a weight update
    (after `invalidate` too, for writes through `param.data`). Returns how many were redone."""
    redone = 0
    for sub in module.modules():
        entry = sub.__dict__.get(_CACHE_ATTR)
        if entry is None:
            continue
        _, dtype, device = entry["key"][:3]
        kernel_weights(sub, dtype, device, entry["hidden_size"])
        redone += sub.__dict__.get(_CACHE_ATTR) is not entry
    return redone


# ---------------------------------------------------------------------------------------------
# The implementation transformers calls
# ---------------------------------------------------------------------------------------------
class _InferenceOnly(torch.autograd.Function):
    """Passes the experts output through; its backward raises (moe_ops ops have no backward)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "moe_ops experts implementation is inference-only (its ops have no backward); "
            "use experts_implementation='grouped_mm' or 'eager' to train")


def _undecorated_forward(cls: type) -> Optional[Callable]:
    """The experts class's own forward under every @use_experts_implementation wrapper.

    transformers' replace_with_fp8_linear decorates FP8Experts once per experts layer, in place,
    so its forward is a stack of dispatching wrappers: the first `__wrapped__` would dispatch
    to this implementation again. A wrapper is recognized by its closure (`experts_interface`)."""
    fn = cls.forward
    while hasattr(fn, "__wrapped__") and "experts_interface" in getattr(
            getattr(fn, "__code__", None), "co_freevars", ()):
        fn = fn.__wrapped__
    return None if fn is cls.forward else fn


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """transformers' experts-implementation signature: `self` is the experts module,
    `hidden_states [..., H]`, `top_k_index [..., k]` (expert ids; ids >= num_experts, the
    expert-parallel sentinels, contribute nothing) and `top_k_weights [..., k]` (or the dense
    `[..., num_experts]` router weights of older DeepSeek-V2 code). Returns `[..., H]` in the
    dtype of hidden_states.

    Fine-grained FP8 experts (transformers' FP8Experts) run as quant="fp8_block" when their
    blocks are 128x128 and I, H are multiples of 128; otherwise this returns what transformers'
    own (eager) FP8Experts forward computes, after a one-time warning naming the reason."""
    hidden_size = hidden_states.shape[-1]
    spec = _spec_or_fallback(self, hidden_size)
    if isinstance(spec, FallbackToTransformers):
        original = _undecorated_forward(type(self))
        if original is None:
            raise FallbackToTransformers(str(spec))
        return original(self, hidden_states, top_k_index, top_k_weights)
    x = hidden_states.reshape(-1, hidden_size)
    top_k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1, top_k)
    weights = top_k_weights.reshape(ids.shape[0], top_k_weights.shape[-1])
    if weights.shape[1] != top_k:
        # Dense per-expert weights [T, num_experts]: pick each slot's expert.
        weights = weights.gather(1, ids.long().clamp(0, weights.shape[1] - 1))
    kernel = kernel_weights(self, x.dtype, x.device, hidden_size)
    with torch.no_grad():
        out = fused_moe(x, topk_ids=ids, topk_weights=weights, **kernel,
                        activation=spec.activation, swiglu_alpha=spec.swiglu_alpha,
                        swiglu_limit=spec.swiglu_limit, quant=spec.quant, backend=backend)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
        out = _InferenceOnly.apply(out, hidden_states, top_k_weights)
    return out.reshape(hidden_states.shape)
