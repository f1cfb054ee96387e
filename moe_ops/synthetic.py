"""Random MoE layers and inputs that look like the real thing: for the autotuner's profiling
(SPEC §6), the benchmarks and the GPU checks.

- Weights are drawn in their served format (pre-quantized checkpoint tensors, SPEC §1 layout)
  with valid scales, so that every quant mode's dequantized weights have the spread of a trained
  layer, N(0, 1/fan_in): never zeros, never NaN codes, no saturated scales.
- Router logits come balanced (every expert equally likely) or skewed (a long-tailed expert
  popularity, Zipf-like, as trained routers show), so a config is not picked on a routing that
  favours it alone (balanced rows per expert are the best case of every tile size).
Everything is generated on the target device, in expert chunks (no layer-sized fp32 temporary).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from moe_ops import quant as q
from moe_ops.layout import expert_chunks

# fp8 values are drawn N(0, 64) (well inside e4m3's +-448 and above its subnormals) and the
# scale brings them to the layer's spread.
FP8_VALUE_STD = 64.0
# RMS of the e2m1 magnitudes drawn uniformly (random bytes): the scale brings them to spread.
E2M1_RMS = math.sqrt(sum(v * v for v in q.E2M1_MAGNITUDES) / 8)
NVFP4_BLOCK_SCALE = 64.0   # a typical e4m3 block scale; the global scale carries the rest
ZIPF_EXPONENT = 1.1        # skewed routing: popularity of the r-th expert ~ r^-1.1


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def uniform(shape, low: float, high: float, device, gen) -> torch.Tensor:
    """float32 uniform in [low, high): scales that are never zero."""
    return torch.empty(shape, dtype=torch.float32, device=device).uniform_(low, high, generator=gen)


def random_fp8(shape: Tuple[int, ...], device, gen, chunk_elements: int = 1 << 28) -> torch.Tensor:
    out = torch.empty(shape, dtype=q.FP8_DTYPE, device=device)
    per_expert = math.prod(shape[1:])
    for start, end in expert_chunks(shape[0], per_expert, chunk_elements):
        values = torch.empty((end - start,) + tuple(shape[1:]), dtype=torch.bfloat16, device=device)
        values.normal_(0.0, FP8_VALUE_STD, generator=gen).clamp_(-q.FP8_MAX, q.FP8_MAX)
        out[start:end] = values.to(q.FP8_DTYPE)
    return out


def random_weights(num_experts: int, hidden_size: int, intermediate_size: int, *,
                   quant: str = "none", gated: bool = True, bias: bool = False,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                   seed: int = 0, chunk_elements: int = 1 << 28) -> Dict[str, torch.Tensor]:
    """Random expert weights in the quant mode's own format (quant "none": `dtype`), gate and up
    stacked as in a fused checkpoint: "w13" [E, parts * I, H (/2 packed)] (the gate's rows, then
    the up's; parts = 2 gated, 1 not), "w2" [E, H, I (/2)], and as the mode has them "w13_scale"
    / "w2_scale" (fp8: per expert, [E, parts] / [E]; fp8_block: [E, parts * ceil(I/128),
    ceil(H/128)] / [E, ceil(H/128), ceil(I/128)]; fp4: per row and group), nvfp4's
    "w13_global_scale" [E, parts] / "w2_global_scale" [E], and "b13" / "b2" (float32).
    checkpoint_views splits them into SPEC §1's w1 / w3 without copies."""
    device = torch.device(device)
    gen = generator(device, seed)
    e, h, i = num_experts, hidden_size, intermediate_size
    parts = 2 if gated else 1
    std13, std2 = 1.0 / math.sqrt(h), 1.0 / math.sqrt(i)
    shapes = {"w13": (parts * i, h, std13), "w2": (h, i, std2)}   # rows, K, spread
    w: Dict[str, torch.Tensor] = {}
    if quant == "none":
        for name, (n, k, std) in shapes.items():
            w[name] = torch.empty(e, n, k, dtype=dtype, device=device).normal_(0, std, generator=gen)
    elif quant in ("fp8", "fp8_block"):
        for name, (n, k, std) in shapes.items():
            w[name] = random_fp8((e, n, k), device, gen, chunk_elements)
        for name, (n, k, std) in shapes.items():
            per = parts if name == "w13" else 1
            if quant == "fp8":
                scale = uniform((e, per), 0.75, 1.25, device, gen)
            else:
                nb = -(-(n // per) // q.FP8_BLOCK)
                scale = uniform((e, per * nb, -(-k // q.FP8_BLOCK)), 0.5, 1.5, device, gen)
            scale = scale * (std / FP8_VALUE_STD)
            w[f"{name}_scale"] = scale if name == "w13" or quant == "fp8_block" else scale[:, 0]
    elif quant in ("nvfp4", "mxfp4"):
        block = q.fp4_scale_block(quant)
        for name, (n, k, std) in shapes.items():
            # every byte is two valid e2m1 codes (the format has no NaN)
            w[name] = torch.empty(e, n, k // 2, dtype=torch.uint8, device=device).random_(
                0, 256, generator=gen)
        for name, (n, k, std) in shapes.items():
            if quant == "nvfp4":
                w[f"{name}_scale"] = (uniform((e, n, k // block), 0.5, 1.5, device, gen)
                                      * NVFP4_BLOCK_SCALE).to(q.FP8_DTYPE)
            else:
                center = q.E8M0_BIAS + round(math.log2(std / E2M1_RMS))
                offset = torch.empty((e, n, k // block), dtype=torch.int32, device=device).random_(
                    -1, 2, generator=gen)
                w[f"{name}_scale"] = (offset + center).clamp(0, 254).to(torch.uint8)
        if quant == "nvfp4":
            for name, (n, k, std) in shapes.items():
                g = uniform((e, parts if name == "w13" else 1), 0.75, 1.25, device, gen) * (
                    std / (E2M1_RMS * NVFP4_BLOCK_SCALE))
                w[f"{name}_global_scale"] = g if name == "w13" else g[:, 0]
    else:
        raise ValueError(f"quant: unknown mode {quant!r}")
    if bias:
        w["b13"] = torch.empty(e, parts * i, dtype=torch.float32, device=device).normal_(
            0, 0.1, generator=gen)
        w["b2"] = torch.empty(e, h, dtype=torch.float32, device=device).normal_(0, 0.1, generator=gen)
    return w


def checkpoint_views(weights: Dict[str, torch.Tensor], gated: bool = True) -> Dict[str, torch.Tensor]:
    """random_weights' stacked tensors as FusedMoE.load_weights keywords: w1 (gate) and w3 (up)
    are views of the w13 tensors' halves (per-expert scales: their columns); w2's pass as they
    are."""
    parts = 2 if gated else 1
    ckpt: Dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if not name.startswith(("w13", "b13")):
            ckpt[name] = t
            continue
        for p, index in zip(range(parts), (1, 3)):
            key = name.replace("13", str(index), 1)
            if t.dim() == 2 and not name.startswith("b"):   # one scale per expert and part
                ckpt[key] = t[:, p].contiguous()
            else:
                rows = t.shape[1] // parts
                ckpt[key] = t.narrow(1, p * rows, rows)
    return ckpt


def random_checkpoint(num_experts: int, hidden_size: int, intermediate_size: int, *,
                      quant: str = "none", gated: bool = True, bias: bool = False,
                      dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                      seed: int = 0, chunk_elements: int = 1 << 28) -> Dict[str, torch.Tensor]:
    """Keyword arguments for FusedMoE.load_weights (SPEC §1 checkpoint layout), random, in the
    quant mode's own format (quant "none": `dtype`)."""
    return checkpoint_views(random_weights(
        num_experts, hidden_size, intermediate_size, quant=quant, gated=gated, bias=bias,
        dtype=dtype, device=device, seed=seed, chunk_elements=chunk_elements), gated)


def router_logits(num_tokens: int, num_experts: int, *, skew: bool = False,
                  device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """float32 [T, E] router logits. skew: expert r (in a random order) gets a bias of
    -ZIPF_EXPONENT * log(r + 1), so top-k picks it about r^-ZIPF_EXPONENT as often as the most
    popular one; otherwise all experts are equally likely."""
    device = torch.device(device)
    gen = generator(device, seed)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    logits.normal_(0.0, 1.0, generator=gen)
    if skew:
        order = torch.randperm(num_experts, generator=gen, device=device)
        ranks = torch.empty_like(order)
        ranks[order] = torch.arange(num_experts, device=device)
        logits -= ZIPF_EXPONENT * torch.log1p(ranks.float())[None, :]
    return logits


def hidden_states(num_tokens: int, hidden_size: int, *, dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    gen = generator(device, seed)
    return torch.empty(num_tokens, hidden_size, dtype=dtype, device=device).normal_(0, 1, generator=gen)


def routing_bias(num_experts: int, *, device: torch.device | str = "cpu",
                 seed: int = 0) -> torch.Tensor:
    """DeepSeek-V3's score-correction bias: small, random."""
    gen = generator(device, seed)
    return torch.empty(num_experts, dtype=torch.float32, device=device).normal_(0, 0.05, generator=gen)
