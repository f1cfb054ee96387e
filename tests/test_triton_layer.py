"""FusedMoE(backend="triton") against FusedMoE(backend="reference") on the same prepared weights.

The whole Triton path (routing kernel, dispatch, act quant, both GEMMs, combine) as a layer
call, for every routing method and every quant mode the Triton backend covers, each activation
met at least once, with biases, and an expert-parallel shard. On a CPU machine it runs in the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay small.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import moe_ops

ROUTINGS = {
    "default": {}, "renormalize": {}, "renormalize_naive": {}, "sigmoid_renorm": {}, "topk": {},
    "llama4": {"top_k": 1}, "deepseek_v3": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
}
QUANTS = ("none", "fp8", "fp8_block")
ACTIVATIONS = moe_ops.ACTIVATIONS
CASES = [(routing, quant, ACTIVATIONS[n % len(ACTIVATIONS)])
         for n, (routing, quant) in enumerate(itertools.product(ROUTINGS, QUANTS))]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _layers(routing: str, quant: str, activation: str, seed: int, *, num_experts=8, hidden=128,
            intermediate=96, offset=0, local=None):
    gen = torch.Generator().manual_seed(seed)
    config = dict(num_experts=num_experts, hidden_size=hidden, intermediate_size=intermediate,
                  top_k=ROUTINGS[routing].get("top_k", 3), routing=routing, activation=activation,
                  quant=quant, bias=activation == "swiglu_oai", local_expert_offset=offset,
                  num_local_experts=local, device=_device(),
                  **{k: v for k, v in ROUTINGS[routing].items() if k != "top_k"})
    reference = moe_ops.FusedMoE(**config, backend="reference")
    e = reference.num_local_experts
    gated = activation != "relu2"

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(_device())

    weights = dict(w1=rand(e, intermediate, hidden), w2=rand(e, hidden, intermediate),
                   w3=rand(e, intermediate, hidden) if gated else None)
    if config["bias"]:
        weights.update(b1=rand(e, intermediate), b2=rand(e, hidden),
                       b3=rand(e, intermediate) if gated else None)
    if routing == "deepseek_v3":
        weights["routing_bias"] = rand(num_experts)
    reference.load_weights(**weights)
    triton = moe_ops.FusedMoE(**config, backend="triton")
    triton.load_state_dict(reference.state_dict())
    return reference, triton, gen


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("routing,quant,activation", CASES)
def test_triton_layer_matches_reference(routing, quant, activation):
    reference, triton, gen = _layers(routing, quant, activation, seed=len(routing) * 31 + len(quant))
    for num_tokens in (1, 9):
        x = torch.randn(num_tokens, reference.hidden_size, generator=gen).to(_device(), torch.bfloat16)
        logits = torch.randn(num_tokens, reference.num_experts, generator=gen).to(_device())
        ids, _ = moe_ops.route(logits, reference.top_k, routing=routing, backend="reference",
                               routing_bias=reference.routing_bias, n_group=reference.n_group,
                               topk_group=reference.topk_group,
                               routed_scaling_factor=reference.routed_scaling_factor)
        ids_triton, _ = moe_ops.route(logits, reference.top_k, routing=routing, backend="triton",
                                      routing_bias=reference.routing_bias,
                                      n_group=reference.n_group, topk_group=reference.topk_group,
                                      routed_scaling_factor=reference.routed_scaling_factor)
        assert torch.equal(ids, ids_triton)
        out, ref = triton(x, logits), reference(x, logits)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.isfinite(out).all()
        assert _relative_error(out, ref) <= 1e-2, (routing, quant, activation, num_tokens)


def test_triton_shard_and_prerouted_padding():
    """An expert-parallel shard, pre-routed with -1 padding and other shards' ids."""
    reference, triton, gen = _layers("renormalize", "fp8", "swiglu", seed=7, num_experts=12,
                                     offset=4, local=5)
    x = torch.randn(6, reference.hidden_size, generator=gen).to(_device(), torch.bfloat16)
    ids = torch.randint(-1, 12, (6, 3), generator=gen).to(_device())
    ids[0] = 5  # a token entirely on one local expert
    weights = torch.rand(6, 3, generator=gen).to(_device())
    out = triton(x, topk_ids=ids, topk_weights=weights)
    ref = reference(x, topk_ids=ids, topk_weights=weights)
    assert _relative_error(out, ref) <= 1e-2
    no_local = ((ids < 4) | (ids >= 9)).all(dim=1)
    assert (out[no_local] == 0).all()
