"""Properties of the whole layer (SPEC §1, §2, §4) on the reference backend: token permutation
equivariance, expert-parallel shards summing to the whole layer, token isolation under NaN and
inf, routing weights that sum to one in float32, and every pair computed under any imbalance."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_ops
from float64_moe import (
    QUANTS,
    MoECase,
    moe_configs,
    random_checkpoint,
    random_logits,
    rel_frobenius,
    route64,
    routing_shape,
)

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# Permuting tokens permutes outputs
# ---------------------------------------------------------------------------------------------
# Rounding-level differences a changed row position can cause: the CPU GEMM (MKL sgemm) rounds a
# row differently depending on where it sits in the batch (seen on 21 of 200 random fp32 shapes),
# so the reference backend is permutation-equivariant to a few ulps, not bit for bit. Mixing up
# tokens would be off by O(1).
ULP_TOLERANCE = {torch.bfloat16: dict(rtol=2**-6, atol=1e-3), torch.float16: dict(rtol=2**-8, atol=1e-3),
                 torch.float32: dict(rtol=1e-4, atol=1e-5)}


def assert_close_to_ulps(actual, expected, dtype):
    """actual == expected to a few ulps of the layer dtype at the outputs' scale: a GEMM's
    rounding differences follow the size of the terms it sums, not of each (possibly cancelled)
    output element, so the absolute bound grows with the largest output (fp16, relu2 with a
    4x gate: outputs up to 62, one element's 0.0034 drift at 0.15 when another token changed
    expert). Mixing up tokens would still be off by the outputs' own size."""
    tol = ULP_TOLERANCE[dtype]
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"],
                               atol=max(tol["atol"], tol["rtol"] * scale))


@SETTINGS
@given(cfg=moe_configs(min_tokens=1), prerouted=st.booleans())
def test_token_permutation_permutes_outputs(cfg, prerouted):
    case = MoECase(cfg)
    layer = case.layer()
    perm = torch.randperm(cfg["num_tokens"], generator=case.gen)
    if prerouted:
        ids, weights = case.route(case.logits)
        ids, weights = ids.int(), weights.float()
        out = layer(case.x, topk_ids=ids, topk_weights=weights)
        permuted = layer(case.x[perm], topk_ids=ids[perm], topk_weights=weights[perm])
    else:
        out = layer(case.x, case.logits)
        permuted = layer(case.x[perm], case.logits[perm])
    assert torch.isfinite(out).all()
    assert_close_to_ulps(permuted, out[perm], cfg["dtype"])


@SETTINGS
@given(cfg=moe_configs(min_tokens=1, expert_parallel=False))
def test_token_permutation_is_exact_with_one_token_per_expert(cfg):
    """Each expert sees one token (a GEMM of one row), so no row moves inside a GEMM and the
    permuted output must be the same bits: the gather and the combine alone are tested."""
    case = MoECase(cfg)
    t, e = cfg["num_tokens"], cfg["num_experts"]
    t = min(t, e)
    x = case.x[:t]
    ids = torch.randperm(e, generator=case.gen)[:t, None].int()
    weights = torch.rand(t, 1, generator=case.gen)
    layer = case.layer()
    out = layer(x, topk_ids=ids, topk_weights=weights)
    perm = torch.randperm(t, generator=case.gen)
    permuted = layer(x[perm], topk_ids=ids[perm], topk_weights=weights[perm])
    assert torch.isfinite(out).all()
    assert torch.equal(permuted, out[perm])


# ---------------------------------------------------------------------------------------------
# Expert parallelism: the shards' partial sums add up to the whole layer
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(cfg=moe_configs(expert_parallel=False, min_tokens=1), data=st.data())
def test_expert_parallel_shards_sum_to_whole_layer(cfg, data):
    e = cfg["num_experts"]
    if e < 2:
        cfg = dict(cfg, num_experts=2, num_local=2, top_k=1 if cfg["routing"] == "llama4" else cfg["top_k"])
    e = cfg["num_experts"]
    shards = data.draw(st.integers(2, min(3, e)))
    cuts = sorted(data.draw(st.lists(st.integers(1, e - 1), min_size=shards - 1,
                                     max_size=shards - 1, unique=True)))
    bounds = list(zip([0] + cuts, cuts + [e]))
    case = MoECase(cfg)
    whole = case.layer()
    out = whole(case.x, case.logits).double()
    total = torch.zeros_like(out)
    for start, stop in bounds:
        shard_case = MoECase(dict(cfg, offset=start, num_local=stop - start))
        shard_case.routing_bias = case.routing_bias
        # Every checkpoint tensor (weights, scales, biases) has the expert first.
        shard = shard_case.layer({name: t[start:stop] for name, t in case.given.items()})
        partial = shard(case.x, case.logits)
        assert partial.shape == out.shape and partial.dtype == cfg["dtype"]
        total += partial.double()
    # fp32 with an fp32 reduction: tight. Otherwise each partial is rounded to the layer dtype.
    tight = cfg["dtype"] == torch.float32
    bound = 1e-5 if tight else 1e-2
    assert rel_frobenius(total, out) <= bound, (bounds, cfg)


def test_expert_parallel_fp32_shards_tight():
    """fp32, quant none, 3 shards of 11 experts, against the whole layer and the oracle."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    e, h, i, k = 11, 40, 24, 3
    ckpt = random_checkpoint(gen, e, h, i, dtype=torch.float32, bias=True)
    x = torch.randn(30, h, generator=gen)
    logits = random_logits(gen, 30, e)
    whole = moe_ops.FusedMoE(e, h, i, k, bias=True, dtype=torch.float32, backend="reference")
    whole.load_weights(**ckpt)
    total = torch.zeros(30, h, dtype=torch.float64)
    for start, stop in ((0, 4), (4, 5), (5, 11)):
        shard = moe_ops.FusedMoE(e, h, i, k, bias=True, dtype=torch.float32, backend="reference",
                                 local_expert_offset=start, num_local_experts=stop - start)
        shard.load_weights(**{n: t[start:stop] for n, t in ckpt.items()})
        total += shard(x, logits).double()
    assert rel_frobenius(total, whole(x, logits)) <= 1e-6, seed


# ---------------------------------------------------------------------------------------------
# Token isolation: NaN / inf in one token never reaches another token's output
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(cfg=moe_configs(min_tokens=2), where=st.sampled_from(("hidden", "logits")),
       poison=st.sampled_from((float("nan"), float("inf"), float("-inf"))),
       whole_row=st.booleans(), data=st.data())
def test_poisoned_token_stays_in_its_row(cfg, where, poison, whole_row, data):
    case = MoECase(cfg)
    layer = case.layer()
    t = data.draw(st.integers(0, cfg["num_tokens"] - 1))
    clean = layer(case.x, case.logits)
    assert torch.isfinite(clean).all()
    x, logits = case.x.clone(), case.logits.clone()
    target = x if where == "hidden" else logits
    if whole_row:
        target[t] = poison
    else:
        target[t, data.draw(st.integers(0, target.shape[1] - 1))] = poison
    out = layer(x, logits)
    others = torch.arange(cfg["num_tokens"]) != t
    assert torch.isfinite(out[others]).all()
    if where == "hidden":
        # Same routing, same per-expert batches: the other rows are bit for bit the same.
        assert torch.equal(out[others], clean[others])
    else:
        # The poisoned token may change expert, which changes the other rows' GEMM batch sizes;
        # the CPU GEMM's blocking may then round differently (seen: 4e-4 relative in fp16,
        # 7e-6 in fp32), a few ulps of the layer dtype at the outputs' scale.
        assert_close_to_ulps(out[others], clean[others], cfg["dtype"])


# ---------------------------------------------------------------------------------------------
# Routing weights: float32 math, normalized where the method says so
# ---------------------------------------------------------------------------------------------
NORMALIZING = ("renormalize", "renormalize_naive", "sigmoid_renorm", "deepseek_v3")


@SETTINGS
@given(data=st.data(), routing=st.sampled_from(NORMALIZING),
       logit_dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)),
       num_tokens=st.integers(1, 64), skew=st.sampled_from(("none", "few", "one")),
       std=st.sampled_from((0.5, 1.5, 4.0)))
def test_normalized_weights_sum_to_one(data, routing, logit_dtype, num_tokens, skew, std):
    shape = routing_shape(data.draw, st, routing, max_experts=64, max_k=8)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    logits = random_logits(gen, num_tokens, shape["num_experts"], skew=skew, dtype=logit_dtype,
                           std=std)
    bias = None
    if routing == "deepseek_v3" and data.draw(st.booleans()):
        bias = torch.randn(shape["num_experts"], generator=gen) * 0.3
    ids, weights = moe_ops.route(logits, shape["top_k"], routing=routing, routing_bias=bias,
                                 n_group=shape["n_group"], topk_group=shape["topk_group"],
                                 routed_scaling_factor=shape["routed_scaling_factor"])
    assert weights.dtype == torch.float32
    target = shape["routed_scaling_factor"] if routing == "deepseek_v3" else 1.0
    sums = weights.double().sum(dim=1)
    # float32 math: the sum of k float32 weights is 1 to a few float32 ulps (bf16 math: ~4e-3).
    torch.testing.assert_close(sums, torch.full_like(sums, target), rtol=1e-6, atol=0)
    # And the weights are those of the float64 math on the *given* logits (not cast down).
    _, ref_weights = route64(logits, routing, shape["top_k"], bias, shape["n_group"],
                             shape["topk_group"], shape["routed_scaling_factor"])
    ref_ids, _ = route64(logits, routing, shape["top_k"], bias, shape["n_group"],
                         shape["topk_group"], shape["routed_scaling_factor"])
    assert torch.equal(ids.long().sort(1).values, ref_ids.sort(1).values)
    torch.testing.assert_close(weights.double().sort(1).values, ref_weights.sort(1).values,
                               rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("routing", ("default", "renormalize", "renormalize_naive", "deepseek_v3",
                                     "llama4", "sigmoid_renorm", "topk"))
@pytest.mark.parametrize("logit_dtype", (torch.float32, torch.float16))
def test_logits_are_never_cast_down(routing, logit_dtype):
    """Two experts closer than the logits' next narrower dtype can tell apart: the larger one
    wins (expert 5 over 2), and its weight is that of the exact logit."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    # On bf16's grid, so that base + tiny (under half a bf16 ulp) rounds back to it.
    base = 1.0 + torch.randint(128, (), generator=gen).item() / 128
    tiny = 2e-4 if logit_dtype == torch.float32 else 2.0**-9
    logits = torch.randn(4, 8, generator=gen) * 0.1 - 2.0
    logits[:, 2] = base
    logits[:, 5] = base + tiny
    logits = logits.to(logit_dtype)
    assert logits[0, 5] > logits[0, 2]
    assert logits[0, 5].to(torch.bfloat16) == logits[0, 2].to(torch.bfloat16)  # tie if cast down
    kwargs = dict(n_group=1, topk_group=1) if routing == "deepseek_v3" else {}
    ids, weights = moe_ops.route(logits, 1, routing=routing, **kwargs)
    assert ids[:, 0].tolist() == [5] * 4, routing
    _, ref_weights = route64(logits, routing, 1, None, kwargs.get("n_group"),
                             kwargs.get("topk_group"))
    torch.testing.assert_close(weights.double(), ref_weights, rtol=2e-6, atol=0)


def test_default_weights_are_the_softmax():
    """default: probabilities not renormalized; with k = E they sum to one, with k < E less."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    logits = torch.randn(16, 6, generator=gen).to(torch.bfloat16)
    _, w_all = moe_ops.route(logits, 6, routing="default")
    torch.testing.assert_close(w_all.double().sum(1), torch.ones(16, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    _, w_two = moe_ops.route(logits, 2, routing="default")
    assert (w_two.sum(1) < 1 - 1e-3).all()
    torch.testing.assert_close(w_two.sort(1, descending=True).values,
                               w_all.sort(1, descending=True).values[:, :2])


# ---------------------------------------------------------------------------------------------
# Imbalance: all tokens to one expert, nothing dropped
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("top_k", (1, 3))
def test_all_tokens_to_one_expert(quant, top_k):
    seed = random.randrange(2**31)
    cfg = dict(quant=quant, routing="renormalize", activation="swiglu", dtype=torch.bfloat16,
               num_experts=8, top_k=top_k, n_group=None, topk_group=None, routed_scaling_factor=1.0,
               hidden=64, inter=32, num_tokens=600, skew="none", prequantized=False, bias=False,
               gate_scale=1.0, logit_dtype=torch.float32, seed=seed, alpha=1.702, limit=7.0,
               offset=0, num_local=8)
    case = MoECase(cfg)
    hot = seed % 8
    logits = case.logits.clone()
    logits[:, hot] += 20.0  # every token's first choice
    ids, _ = case.route(logits)
    assert (ids[:, 0] == hot).all()
    layer = case.layer()
    out = layer(case.x, logits)
    ref = case.oracle(case.x, logits)
    assert rel_frobenius(out, ref) <= case.tolerance(), seed
    # Every token got its hot expert's contribution: no capacity limit dropped any.
    row_err = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert (row_err < 0.05).all(), seed
    # Pre-routed, every slot of every token on the same expert (k duplicates per token).
    same = torch.full((600, top_k), hot, dtype=torch.int32)
    weights = torch.rand(600, top_k, generator=case.gen)
    out = layer(case.x, topk_ids=same, topk_weights=weights)
    ref = case.oracle(case.x, topk_ids=same, topk_weights=weights)
    assert rel_frobenius(out, ref) <= case.tolerance(), seed


def test_all_tokens_to_another_shard_give_zeros():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    layer = moe_ops.FusedMoE(8, 32, 32, 2, local_expert_offset=4, num_local_experts=4,
                             backend="reference")
    layer.load_weights(**random_checkpoint(gen, 4, 32, 32))
    logits = torch.randn(50, 8, generator=gen)
    logits[:, :4] += 20.0  # both choices of every token are experts 0..3, not local
    out = layer(torch.randn(50, 32, generator=gen).to(torch.bfloat16), logits)
    assert torch.equal(out, torch.zeros_like(out))
