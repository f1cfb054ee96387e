"""An independent float64 evaluation of SPEC §1, written from the checkpoint layout.

The tests compare moe_ops against this module. It shares no math with the package: routing
(every method, ties to the lower index), activations, fp8/fp4 decoding and the per-expert loop
are written here again, from the SPEC text, in float64 (numpy for routing, torch float64 for
the GEMMs). It takes the checkpoint layout (w1 gate [E, I, H], w3 up [E, I, H], w2 down
[E, H, I] with their scales) and never the package's kernel layout.

Operand rules (SPEC §1 and §4: "a float64 evaluation on the same (de)quantized operands"):
- weights are dequantized exactly (value x block scale (x global scale)); with quant="none"
  the weights are first cast to the layer dtype, which is what the layer stores;
- fp8 modes quantize the activation operand of each GEMM: per token (fp8) or per token per
  128-column group (fp8_block), s = amax / 448 in float64, x / s rounded to e4m3 through
  torch's float8_e4m3fn cast of the float32 value; a zero row/group gives zeros;
- the intermediate between the GEMMs is rounded to the layer dtype (x.dtype) before it is
  quantized or used; nvfp4/mxfp4 use activations as they are (W4A16).

The second half of the file makes random inputs (checkpoints, logits) for the tests; it may use
moe_ops.quant, but only to produce quantized *inputs*, never for the oracle's math.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

FP8_MAX = 448.0
FP8_BLOCK = 128
DEEPSEEK_EPS = 1e-20


# ---------------------------------------------------------------------------------------------
# Routing (float64, numpy)
# ---------------------------------------------------------------------------------------------
def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row; equal scores in index order (lower wins)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        ez = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + ez), ez / (1.0 + ez))


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def route64(
    router_logits: torch.Tensor,
    method: str,
    top_k: int,
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k], weights float64 [T, k]) by the table of SPEC §1."""
    z = router_logits.detach().cpu().to(torch.float64).numpy()
    num_tokens, num_experts = z.shape
    take = lambda values, ids: np.take_along_axis(values, ids, axis=1)  # noqa: E731
    if method == "default":
        p = _softmax(z)
        ids = _topk(p, top_k)
        w = take(p, ids)
    elif method == "renormalize":
        ids = _topk(z, top_k)
        w = _softmax(take(z, ids))
    elif method == "renormalize_naive":
        p = _softmax(z)
        ids = _topk(p, top_k)
        w = take(p, ids)
        w = w / w.sum(axis=1, keepdims=True)
    elif method == "sigmoid_renorm":
        s = _sigmoid(z)
        ids = _topk(s, top_k)
        w = take(s, ids)
        w = w / w.sum(axis=1, keepdims=True)
    elif method == "topk":
        ids = _topk(z, top_k)
        w = take(z, ids)
    elif method == "llama4":
        assert top_k == 1
        ids = _topk(z, 1)
        w = _sigmoid(take(z, ids))
    elif method == "deepseek_v3":
        s = _sigmoid(z)
        b = s if routing_bias is None else s + routing_bias.detach().cpu().double().numpy()[None]
        per_group = num_experts // n_group
        grouped = b.reshape(num_tokens, n_group, per_group)
        top2 = -np.sort(-grouped, axis=2)[:, :, :2]
        group_score = top2.sum(axis=2)
        kept = _topk(group_score, topk_group)
        keep = np.zeros((num_tokens, n_group), dtype=bool)
        np.put_along_axis(keep, kept, True, axis=1)
        masked = np.where(np.repeat(keep, per_group, axis=1), b, -np.inf)
        ids = _topk(masked, top_k)
        w = take(s, ids)
        w = w / (w.sum(axis=1, keepdims=True) + DEEPSEEK_EPS) * routed_scaling_factor
    else:
        raise ValueError(method)
    return torch.from_numpy(np.ascontiguousarray(ids)).long(), torch.from_numpy(np.ascontiguousarray(w))


# ---------------------------------------------------------------------------------------------
# Number formats, decoded from their bit fields
# ---------------------------------------------------------------------------------------------
def e4m3_decode(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its bytes as uint8) -> float64, from the bits: s eeee mmm, bias 7."""
    bits = (t.view(torch.uint8) if t.dtype != torch.uint8 else t).long()
    sign = torch.where((bits >> 7) == 1, -1.0, 1.0).double()
    exponent = (bits >> 3) & 0xF
    mantissa = ((bits & 0x7).double()) / 8.0
    normal = (1.0 + mantissa) * torch.pow(2.0, (exponent - 7).double())
    subnormal = mantissa * 2.0**-6
    value = sign * torch.where(exponent == 0, subnormal, normal)
    return torch.where((exponent == 15) & ((bits & 7) == 7), torch.full_like(value, math.nan), value)


def e2m1_decode64(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> float64 from the bits: s ee m, bias 1, subnormal at e=0."""
    c = codes.long()
    sign = torch.where((c & 8) != 0, -1.0, 1.0).double()
    exponent = (c >> 1) & 3
    mantissa = (c & 1).double()
    normal = (1.0 + mantissa / 2.0) * torch.pow(2.0, (exponent - 1).double())
    subnormal = mantissa * 0.5
    return sign * torch.where(exponent == 0, subnormal, normal)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K]: element 2i is the low nibble of byte i."""
    p = packed.long()
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.long)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = (p >> 4) & 0xF
    return out


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.long().double() - 127.0)


def dequantize_weight64(
    w: torch.Tensor,
    scale: Optional[torch.Tensor],
    global_scale: Optional[torch.Tensor],
    quant: str,
    layer_dtype: torch.dtype,
) -> torch.Tensor:
    """Checkpoint-layout weight [E, N, K] (or packed [E, N, K/2]) -> float64 [E, N, K]."""
    if quant == "none":
        return w.to(layer_dtype).double()
    if quant == "fp8":
        return e4m3_decode(w) * scale.double()[:, None, None]
    if quant == "fp8_block":
        _, n, k = w.shape
        s = scale.double().repeat_interleave(FP8_BLOCK, 1)[:, :n].repeat_interleave(FP8_BLOCK, 2)[:, :, :k]
        return e4m3_decode(w) * s
    values = e2m1_decode64(unpack_nibbles(w))
    k = values.shape[-1]
    if quant == "nvfp4":
        block = k // scale.shape[-1]
        assert block == 16
        s = e4m3_decode(scale).repeat_interleave(block, -1) * global_scale.double()[:, None, None]
    elif quant == "mxfp4":
        block = k // scale.shape[-1]
        assert block == 32
        s = e8m0_decode(scale).repeat_interleave(block, -1)
    else:
        raise ValueError(quant)
    return values * s


# The e4m3 rounding of an operand that lies within this relative distance of a rounding
# midpoint depends on the last bits of how it was computed (float32 in the package, float64
# here): both roundings are the SPEC's operand. e4m3_near_ties(+1 / -1) rounds those values up /
# down in magnitude (MoECase.matches_oracle tries both when the nominal rounding misses).
E4M3_TIE_WIDTH = 2.0 ** -18
_E4M3_TIE_SIDE = 0


@contextmanager
def e4m3_near_ties(side: int):
    global _E4M3_TIE_SIDE
    previous, _E4M3_TIE_SIDE = _E4M3_TIE_SIDE, side
    try:
        yield
    finally:
        _E4M3_TIE_SIDE = previous


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 values in [-448, 448] -> nearest e4m3 (torch's cast of the float32 value)."""
    if _E4M3_TIE_SIDE:
        v = v * (1.0 + _E4M3_TIE_SIDE * E4M3_TIE_WIDTH)
    return e4m3_decode(v.clamp(-FP8_MAX, FP8_MAX).to(torch.float32).to(torch.float8_e4m3fn))


def _quantize_groups(a: torch.Tensor) -> torch.Tensor:
    """a [M, G, g] float64: each [g] group to e4m3 with s = amax/448, dequantized."""
    amax = a.abs().amax(dim=-1, keepdim=True)
    s = amax / FP8_MAX
    safe = torch.where(amax > 0, s, torch.ones_like(s))
    q = _round_e4m3(a / safe)
    return torch.where(amax > 0, q * s, torch.zeros_like(a))


def quantize_activation64(a: torch.Tensor, quant: str) -> torch.Tensor:
    """The activation operand of a GEMM (float64 [M, K]) as SPEC §1 says the kernels see it."""
    if quant == "fp8":
        return _quantize_groups(a[:, None, :])[:, 0, :]
    if quant == "fp8_block":
        m, k = a.shape
        groups = -(-k // FP8_BLOCK)
        padded = torch.zeros(m, groups * FP8_BLOCK, dtype=a.dtype)
        padded[:, :k] = a
        return _quantize_groups(padded.view(m, groups, FP8_BLOCK)).view(m, -1)[:, :k]
    return a


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------
def activation64(g: torch.Tensor, u: Optional[torch.Tensor], activation: str, alpha: float,
                 limit: float) -> torch.Tensor:
    sig = lambda v: 1.0 / (1.0 + torch.exp(-v))  # noqa: E731
    if activation == "swiglu":
        return g * sig(g) * u
    if activation == "geglu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0))) * u
    if activation == "swiglu_oai":
        gc = torch.minimum(g, torch.full_like(g, limit))
        uc = torch.maximum(torch.minimum(u, torch.full_like(u, limit)), torch.full_like(u, -limit))
        return (uc + 1.0) * gc * sig(alpha * gc)
    if activation == "relu2":
        r = torch.where(g > 0, g, torch.zeros_like(g))
        return r * r
    raise ValueError(activation)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------
def moe64(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: Optional[torch.Tensor] = None,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w3_scale: Optional[torch.Tensor] = None,
    w1_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    w3_global_scale: Optional[torch.Tensor] = None,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    b3: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    quant: str = "none",
    alpha: float = 1.702,
    limit: float = 7.0,
    local_expert_offset: int = 0,
) -> torch.Tensor:
    """SPEC §1 for the local experts w*[0..E_local) = global ids offset..offset+E_local-1.

    Pre-routed pairs with an id outside that range contribute nothing. Returns float64 [T, H].
    """
    layer_dtype = x.dtype
    gated = activation != "relu2"
    W1 = dequantize_weight64(w1, w1_scale, w1_global_scale, quant, layer_dtype)
    W2 = dequantize_weight64(w2, w2_scale, w2_global_scale, quant, layer_dtype)
    W3 = dequantize_weight64(w3, w3_scale, w3_global_scale, quant, layer_dtype) if gated else None
    num_local = W1.shape[0]
    x64 = x.detach().cpu().double()
    ids = topk_ids.detach().cpu().long()
    wts = topk_weights.detach().cpu().double()
    out = torch.zeros(x64.shape[0], W2.shape[1], dtype=torch.float64)
    for e in range(num_local):
        tokens, slots = (ids == local_expert_offset + e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        xa = quantize_activation64(x64[tokens], quant)
        g = xa @ W1[e].T
        if b1 is not None:
            g = g + b1[e].double()
        u = None
        if gated:
            u = xa @ W3[e].T
            if b3 is not None:
                u = u + b3[e].double()
        a = activation64(g, u, activation, alpha, limit).to(layer_dtype).double()
        y = quantize_activation64(a, quant) @ W2[e].T
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, tokens, y * wts[tokens, slots, None])
    return out


def moe64_routed(x: torch.Tensor, router_logits: torch.Tensor, *, top_k: int,
                 routing: str = "renormalize", routing_bias=None, n_group=None, topk_group=None,
                 routed_scaling_factor: float = 1.0, **weights) -> torch.Tensor:
    ids, w = route64(router_logits, routing, top_k, routing_bias, n_group, topk_group,
                     routed_scaling_factor)
    return moe64(x, ids, w, **weights)


def rel_frobenius(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64 (0 when both are empty or both exactly zero)."""
    diff = (out.detach().cpu().double() - ref.detach().cpu().double()).norm().item()
    norm = ref.detach().cpu().double().norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


# ---------------------------------------------------------------------------------------------
# Random inputs for the tests (moe_ops.quant is used here only to make quantized inputs)
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    """Checkpoint tensors as given to load_weights (`given`), and the operands the oracle
    uses (`operands`: the quantized form when the layer quantizes on load)."""

    given: dict
    operands: dict
    extra: dict = field(default_factory=dict)


def random_checkpoint(gen: torch.Generator, num_experts: int, hidden: int, inter: int, *,
                      activation: str = "swiglu", dtype=torch.bfloat16, bias: bool = False,
                      gate_scale: float = 1.0) -> dict:
    """High-precision checkpoint tensors in the layer dtype; GEMM outputs of order 1 (gate
    outputs of order `gate_scale`, to reach swiglu_oai's clamp)."""
    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).to(dtype)

    ckpt = {"w1": randn(num_experts, inter, hidden, std=gate_scale / math.sqrt(hidden)),
            "w2": randn(num_experts, hidden, inter, std=1.0 / math.sqrt(inter))}
    if activation != "relu2":
        ckpt["w3"] = randn(num_experts, inter, hidden, std=1.0 / math.sqrt(hidden))
    if bias:
        ckpt["b1"] = randn(num_experts, inter, std=0.5)
        ckpt["b2"] = randn(num_experts, hidden, std=0.5)
        if activation != "relu2":
            ckpt["b3"] = randn(num_experts, inter, std=0.5)
    return ckpt


def quantize_checkpoint(ckpt: dict, quant: str) -> dict:
    """High-precision checkpoint -> the same checkpoint pre-quantized in `quant`'s format."""
    from moe_ops import quant as q

    out = {k: v for k, v in ckpt.items() if k.startswith("b")}
    for name in ("w1", "w2", "w3"):
        if name not in ckpt:
            continue
        w = ckpt[name]
        if quant == "none":
            out[name] = w
        elif quant == "fp8":
            out[name], out[name + "_scale"] = q.quantize_fp8_per_tensor(w)
        elif quant == "fp8_block":
            out[name], out[name + "_scale"] = q.quantize_fp8_block(w)
        elif quant == "nvfp4":
            out[name], out[name + "_scale"], out[name + "_global_scale"] = q.quantize_nvfp4(w)
        elif quant == "mxfp4":
            out[name], out[name + "_scale"] = q.quantize_mxfp4(w)
        else:
            raise ValueError(quant)
    return out


def random_logits(gen: torch.Generator, num_tokens: int, num_experts: int, *, skew: str = "none",
                  dtype=torch.float32, std: float = 1.5) -> torch.Tensor:
    """Router logits; `skew` "few" pushes every token toward 2 experts, "one" toward one.

    The package routes in float32, the oracle in float64; they may only disagree where float32
    cannot tell two scores apart. So the logits lie on a 2^-10 grid (14+ significant bits: not
    bf16-representable, so a cast-down still shows) within [-8, 8]: two different logits then
    differ by at least 2^-10, which float32 softmax and sigmoid (slope >= 3.3e-4 up to |z| = 8,
    against a float32 spacing of 6e-8 near 1) always resolve. Exact ties are frequent and go to
    the lower index in both.
    """
    logits = torch.randn(num_tokens, num_experts, generator=gen) * std
    if skew == "few":
        favoured = torch.randperm(num_experts, generator=gen)[:2]
        logits[:, favoured] += 3.0
    elif skew == "one":
        favoured = torch.randint(num_experts, (1,), generator=gen)
        logits[:, favoured] += 6.0
    logits = torch.round(logits.clamp(-8.0, 8.0) * 1024) / 1024
    return logits.to(dtype)


# ---------------------------------------------------------------------------------------------
# Drawn layer configurations (hypothesis) and the tensors of one case
# ---------------------------------------------------------------------------------------------
ROUTINGS = ("default", "renormalize", "renormalize_naive", "deepseek_v3", "llama4",
            "sigmoid_renorm", "topk")
ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai", "relu2")
QUANTS = ("none", "fp8", "fp8_block", "nvfp4", "mxfp4")
FP4 = ("nvfp4", "mxfp4")


def allowed_dtypes(quant: str) -> tuple:
    """SPEC §1: fp4 modes are W4A16 (bf16/fp16 activations only)."""
    if quant in FP4:
        return (torch.bfloat16, torch.float16)
    return (torch.bfloat16, torch.float16, torch.float32)


def size_multiple(quant: str) -> int:
    return {"nvfp4": 16, "mxfp4": 32}.get(quant, 1)


def routing_shape(draw, st, routing: str, max_experts: int = 12, max_k: int = 6) -> dict:
    """E, k and the deepseek_v3 group parameters, drawn within what SPEC §3 accepts."""
    if routing == "deepseek_v3":
        n_group = draw(st.sampled_from((1, 2, 4)))
        per_group = draw(st.integers(2, 4))
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, min(topk_group * per_group, max_k)))
        return dict(num_experts=n_group * per_group, top_k=top_k, n_group=n_group,
                    topk_group=topk_group,
                    routed_scaling_factor=draw(st.sampled_from((1.0, 2.5))))
    num_experts = draw(st.integers(1, max_experts))
    top_k = 1 if routing == "llama4" else draw(st.integers(1, min(num_experts, max_k)))
    return dict(num_experts=num_experts, top_k=top_k, n_group=None, topk_group=None,
                routed_scaling_factor=1.0)


def moe_configs(*, quants=QUANTS, routings=ROUTINGS, activations=ACTIVATIONS, min_tokens=0,
                max_tokens=40, expert_parallel=True, dtypes=None):
    """A hypothesis strategy of layer configurations (dicts) that SPEC accepts."""
    from hypothesis import strategies as st

    @st.composite
    def configs(draw):
        quant = draw(st.sampled_from(quants))
        routing = draw(st.sampled_from(routings))
        activation = draw(st.sampled_from(activations))
        choices = tuple(d for d in allowed_dtypes(quant) if dtypes is None or d in dtypes)
        cfg = dict(quant=quant, routing=routing, activation=activation,
                   dtype=draw(st.sampled_from(choices)))
        cfg.update(routing_shape(draw, st, routing))
        m = size_multiple(quant)
        if quant == "fp8_block":  # partial and several 128-blocks
            sizes = st.sampled_from((16, 48, 128, 136, 200, 264))
        elif m > 1:
            sizes = st.integers(1, 128 // m).map(lambda n: n * m)
        else:
            sizes = st.integers(4, 96)
        cfg.update(hidden=draw(sizes), inter=draw(sizes),
                   num_tokens=draw(st.integers(min_tokens, max_tokens)),
                   skew=draw(st.sampled_from(("none", "few", "one"))),
                   prequantized=quant != "none" and draw(st.booleans()),
                   bias=activation == "swiglu_oai" or draw(st.booleans()),
                   gate_scale=draw(st.sampled_from((1.0, 4.0))),
                   logit_dtype=draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16))),
                   seed=draw(st.integers(0, 2**31 - 1)))
        if activation == "swiglu_oai":
            cfg.update(alpha=draw(st.sampled_from((1.702, 1.0))),
                       limit=draw(st.sampled_from((7.0, 2.5))))
        else:
            cfg.update(alpha=1.702, limit=7.0)
        e = cfg["num_experts"]
        if expert_parallel and draw(st.booleans()):
            offset = draw(st.integers(0, e - 1))
            cfg.update(offset=offset, num_local=draw(st.integers(1, e - offset)))
        else:
            cfg.update(offset=0, num_local=e)
        return cfg

    return configs()


class MoECase:
    """One drawn configuration made concrete: checkpoint, inputs, layer and oracle."""

    def __init__(self, cfg: dict, backend: str = "reference"):
        self.cfg = cfg
        self.backend = backend
        self.gen = torch.Generator().manual_seed(cfg["seed"])
        c = cfg
        ckpt = random_checkpoint(self.gen, c["num_local"], c["hidden"], c["inter"],
                                 activation=c["activation"], dtype=c["dtype"], bias=c["bias"],
                                 gate_scale=c["gate_scale"])
        self.operands = quantize_checkpoint(ckpt, c["quant"])
        self.given = self.operands if c["prequantized"] else ckpt
        self.routing_bias = None
        if c["routing"] == "deepseek_v3":
            self.routing_bias = torch.randn(c["num_experts"], generator=self.gen) * 0.3
        self.x = self.hidden_states(c["num_tokens"])
        self.logits = self.router_logits(c["num_tokens"])

    def hidden_states(self, num_tokens: int) -> torch.Tensor:
        return torch.randn(num_tokens, self.cfg["hidden"], generator=self.gen).to(self.cfg["dtype"])

    def router_logits(self, num_tokens: int) -> torch.Tensor:
        return random_logits(self.gen, num_tokens, self.cfg["num_experts"], skew=self.cfg["skew"],
                             dtype=self.cfg["logit_dtype"])

    def layer_kwargs(self) -> dict:
        c = self.cfg
        return dict(routing=c["routing"], n_group=c["n_group"], topk_group=c["topk_group"],
                    routed_scaling_factor=c["routed_scaling_factor"], activation=c["activation"],
                    quant=c["quant"], bias=c["bias"], swiglu_alpha=c["alpha"],
                    swiglu_limit=c["limit"], local_expert_offset=c["offset"],
                    num_local_experts=c["num_local"], dtype=c["dtype"], backend=self.backend)

    def layer(self, given: Optional[dict] = None):
        import moe_ops

        c = self.cfg
        layer = moe_ops.FusedMoE(c["num_experts"], c["hidden"], c["inter"], c["top_k"],
                                 **self.layer_kwargs())
        extra = {} if self.routing_bias is None else {"routing_bias": self.routing_bias}
        layer.load_weights(**(self.given if given is None else given), **extra)
        return layer

    def function(self, x, logits=None, *, topk_ids=None, topk_weights=None):
        """The same computation through moe_ops.prepare_weights + moe_ops.fused_moe."""
        import moe_ops

        c = self.cfg
        weights = moe_ops.prepare_weights(quant=c["quant"], activation=c["activation"],
                                          dtype=c["dtype"], **self.given)
        return moe_ops.fused_moe(
            x, logits, **weights, top_k=c["top_k"], routing=c["routing"],
            routing_bias=self.routing_bias, n_group=c["n_group"], topk_group=c["topk_group"],
            routed_scaling_factor=c["routed_scaling_factor"], topk_ids=topk_ids,
            topk_weights=topk_weights, activation=c["activation"], quant=c["quant"],
            swiglu_alpha=c["alpha"], swiglu_limit=c["limit"], local_expert_offset=c["offset"],
            backend=self.backend)

    def oracle_kwargs(self) -> dict:
        c = self.cfg
        return dict(self.operands, activation=c["activation"], quant=c["quant"], alpha=c["alpha"],
                    limit=c["limit"], local_expert_offset=c["offset"])

    def route(self, logits: torch.Tensor):
        c = self.cfg
        return route64(logits, c["routing"], c["top_k"], self.routing_bias, c["n_group"],
                       c["topk_group"], c["routed_scaling_factor"])

    def oracle(self, x, logits=None, *, topk_ids=None, topk_weights=None) -> torch.Tensor:
        if logits is not None:
            topk_ids, topk_weights = self.route(logits)
        return moe64(x, topk_ids, topk_weights, **self.oracle_kwargs())

    def tolerance(self) -> float:
        """SPEC §4: 1e-4 for fp32 with quant none, 1e-2 otherwise."""
        return 1e-4 if self.cfg["dtype"] == torch.float32 and self.cfg["quant"] == "none" else 1e-2
