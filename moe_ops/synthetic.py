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
from typing import Dict, Iterator, Tuple

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


def random_checkpoint(num_experts: int, hidden_size: int, intermediate_size: int, *,
                      quant: str = "none", gated: bool = True, bias: bool = False,
                      dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                      seed: int = 0, chunk_elements: int = 1 << 28) -> Dict[str, torch.Tensor]:
    """Keyword arguments for FusedMoE.load_weights (SPEC §1 checkpoint layout), random, in the
    quant mode's own format (quant "none": `dtype`)."""
    device = torch.device(device)
    gen = generator(device, seed)
    e, h, i = num_experts, hidden_size, intermediate_size
    std13, std2 = 1.0 / math.sqrt(h), 1.0 / math.sqrt(i)
    names13 = ("w1", "w3") if gated else ("w1",)
    ckpt: Dict[str, torch.Tensor] = {}
    if quant == "none":
        for name in names13:
            ckpt[name] = torch.empty(e, i, h, dtype=dtype, device=device).normal_(0, std13, generator=gen)
        ckpt["w2"] = torch.empty(e, h, i, dtype=dtype, device=device).normal_(0, std2, generator=gen)
    elif quant in ("fp8", "fp8_block"):
        for name, (n, k, std) in [(nm, (i, h, std13)) for nm in names13] + [("w2", (h, i, std2))]:
            ckpt[name] = random_fp8((e, n, k), device, gen, chunk_elements)
            if quant == "fp8":
                scale_shape = (e,)
                low, high = 0.75, 1.25
            else:
                scale_shape = (e, -(-n // q.FP8_BLOCK), -(-k // q.FP8_BLOCK))
                low, high = 0.5, 1.5
            ckpt[f"{name}_scale"] = uniform(scale_shape, low, high, device, gen) * (std / FP8_VALUE_STD)
    elif quant in ("nvfp4", "mxfp4"):
        block = q.fp4_scale_block(quant)
        for name, (n, k, std) in [(nm, (i, h, std13)) for nm in names13] + [("w2", (h, i, std2))]:
            # every byte is two valid e2m1 codes (the format has no NaN)
            ckpt[name] = torch.empty(e, n, k // 2, dtype=torch.uint8, device=device).random_(
                0, 256, generator=gen)
            if quant == "nvfp4":
                ckpt[f"{name}_scale"] = (uniform((e, n, k // block), 0.5, 1.5, device, gen)
                                         * NVFP4_BLOCK_SCALE).to(q.FP8_DTYPE)
                ckpt[f"{name}_global_scale"] = uniform((e,), 0.75, 1.25, device, gen) * (
                    std / (E2M1_RMS * NVFP4_BLOCK_SCALE))
            else:
                center = q.E8M0_BIAS + round(math.log2(std / E2M1_RMS))
                offset = torch.empty((e, n, k // block), dtype=torch.int32, device=device).random_(
                    -1, 2, generator=gen)
                ckpt[f"{name}_scale"] = (offset + center).clamp(0, 254).to(torch.uint8)
    else:
        raise ValueError(f"quant: unknown mode {quant!r}")
    if bias:
        for name in names13:
            ckpt[name.replace("w", "b")] = torch.empty(e, i, dtype=torch.float32, device=device).normal_(
                0, 0.1, generator=gen)
        ckpt["b2"] = torch.empty(e, h, dtype=torch.float32, device=device).normal_(0, 0.1, generator=gen)
    return ckpt


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
