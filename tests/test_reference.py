"""The reference backend (moe_ops.reference through FusedMoE and moe_ops.fused_moe) against the
independent float64 evaluation of SPEC §1 in tests/float64_moe.py (SPEC §4 bounds)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_ops
from moe_ops import quant as q
from float64_moe import (
    ACTIVATIONS,
    FP4,
    QUANTS,
    ROUTINGS,
    MoECase,
    allowed_dtypes,
    e4m3_near_ties,
    moe_configs,
    quantize_checkpoint,
    random_checkpoint,
    random_logits,
    rel_frobenius,
    route64,
    routing_shape,
)

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_matches_oracle(out: torch.Tensor, ref: torch.Tensor, case: MoECase, what: str = "",
                          oracle=None) -> None:
    """out against the oracle's ref within SPEC's tolerance. fp8 modes, given `oracle` (a
    callable re-evaluating ref): where the nominal rounding misses, each token's row may match
    the oracle with its activation operands' near-tie e4m3 roundings taken up or down instead
    (float64_moe.e4m3_near_ties: a value within 2^-18 of a rounding midpoint rounds either way
    depending on float32 against float64 arithmetic before it; one such flip in a 40-wide
    intermediate moved a token by 5%)."""
    c = case.cfg
    assert out.shape == (ref.shape[0], c["hidden"]), (out.shape, ref.shape)
    assert out.dtype == c["dtype"]
    assert torch.isfinite(out).all(), f"non-finite output {what} {c}"
    err = rel_frobenius(out, ref)
    if err > case.tolerance() and oracle is not None and c["quant"] in ("fp8", "fp8_block"):
        got, nominal = out.detach().cpu().double(), ref.detach().cpu().double()
        rows = (got - nominal).norm(dim=-1)
        for side in (1, -1):
            with e4m3_near_ties(side):
                rows = torch.minimum(rows, (got - oracle().cpu().double()).norm(dim=-1))
        err = float(rows.norm() / nominal.norm().clamp_min(1e-300))
    assert err <= case.tolerance(), f"{what} relative error {err:.3g} > {case.tolerance()} for {c}"


# ---------------------------------------------------------------------------------------------
# Routed by logits: layer and function, drawn configurations
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(cfg=moe_configs(), entry=st.sampled_from(("layer", "function")))
def test_routed_matches_float64(cfg, entry):
    case = MoECase(cfg)
    if entry == "layer":
        out = case.layer()(case.x, case.logits)
    else:
        out = case.function(case.x, case.logits)
    assert_matches_oracle(out, case.oracle(case.x, case.logits), case, entry,
                          oracle=lambda: case.oracle(case.x, case.logits))


def _sweep_cases():
    for routing, activation, quant in itertools.product(ROUTINGS, ACTIVATIONS, QUANTS):
        yield pytest.param(routing, activation, quant, id=f"{routing}-{activation}-{quant}")


@pytest.mark.parametrize("routing, activation, quant", list(_sweep_cases()))
def test_every_routing_activation_quant(routing, activation, quant):
    """Every routing method x activation x quant mode SPEC allows, quantize-on-load and
    pre-quantized, on fresh random inputs (the seed is in the failure message)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    dtype = rng.choice(allowed_dtypes(quant))
    if routing == "deepseek_v3":
        shape = dict(num_experts=8, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    else:
        shape = dict(num_experts=8, top_k=1 if routing == "llama4" else 3, n_group=None,
                     topk_group=None, routed_scaling_factor=1.0)
    hidden, inter = (160, 136) if quant == "fp8_block" else (64, 96) if quant in FP4 else (48, 40)
    for prequantized in ((False, True) if quant != "none" else (False,)):
        cfg = dict(quant=quant, routing=routing, activation=activation, dtype=dtype, **shape,
                   hidden=hidden, inter=inter, num_tokens=rng.randint(1, 24),
                   skew=rng.choice(("none", "few", "one")), prequantized=prequantized,
                   bias=activation in ("swiglu_oai", "geglu"), gate_scale=4.0,
                   logit_dtype=rng.choice((torch.float32, torch.bfloat16)), seed=seed,
                   alpha=1.702, limit=7.0, offset=0, num_local=8)
        case = MoECase(cfg)
        out = case.layer()(case.x, case.logits)
        assert_matches_oracle(out, case.oracle(case.x, case.logits), case, f"seed={seed}",
                              oracle=lambda: case.oracle(case.x, case.logits))


def test_swiglu_oai_clamps_against_float64():
    """gpt-oss shape: biases, gate outputs well past the limit (both clamps active)."""
    seed = random.randrange(2**31)
    cfg = dict(quant="none", routing="renormalize", activation="swiglu_oai", dtype=torch.float32,
               num_experts=4, top_k=2, n_group=None, topk_group=None, routed_scaling_factor=1.0,
               hidden=32, inter=32, num_tokens=16, skew="none", prequantized=False, bias=True,
               gate_scale=20.0, logit_dtype=torch.float32, seed=seed, alpha=1.702, limit=7.0,
               offset=0, num_local=4)
    case = MoECase(cfg)
    # Make the up projection large too, so u is clamped on both sides.
    case.given["w3"] = case.given["w3"] * 20
    case.operands = case.given
    layer = case.layer()
    g = case.x.double() @ case.given["w1"][0].double().T
    assert (g > 7).any() and (g < -7).any(), "the gate never reaches the clamp"
    out = layer(case.x, case.logits)
    assert_matches_oracle(out, case.oracle(case.x, case.logits), case, f"seed={seed}",
                          oracle=lambda: case.oracle(case.x, case.logits))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gate_scale", (1.0, 4.0))
def test_fp32_activations_against_float64(activation, gate_scale):
    """fp32 with quant none is held to 1e-4: enough to tell erf gelu from its tanh approximation
    (about 2e-4 here) or a misplaced clamp, where bf16 rounding would hide them."""
    seed = random.randrange(2**31)
    cfg = dict(quant="none", routing="renormalize", activation=activation, dtype=torch.float32,
               num_experts=4, top_k=2, n_group=None, topk_group=None, routed_scaling_factor=1.0,
               hidden=64, inter=64, num_tokens=32, skew="none", prequantized=False,
               bias=activation != "swiglu", gate_scale=gate_scale, logit_dtype=torch.float32,
               seed=seed, alpha=1.702, limit=7.0, offset=0, num_local=4)
    case = MoECase(cfg)
    for entry in (case.layer(), case.function):
        out = entry(case.x, case.logits)
        assert_matches_oracle(out, case.oracle(case.x, case.logits), case, f"seed={seed}",
                              oracle=lambda: case.oracle(case.x, case.logits))


# ---------------------------------------------------------------------------------------------
# Pre-routed calls: -1 and out-of-range ids contribute nothing; int32 and int64 ids
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(cfg=moe_configs(), data=st.data())
def test_prerouted_matches_float64(cfg, data):
    case = MoECase(cfg)
    t, k, e = cfg["num_tokens"], cfg["top_k"], cfg["num_experts"]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    # ids over [-3, E + 3): valid, -1 padding, other negatives and ids past the last expert.
    ids = torch.randint(-3, e + 3, (t, k), generator=gen)
    pad = torch.rand(t, k, generator=gen) < 0.2
    ids = torch.where(pad, torch.full_like(ids, -1), ids)
    weights = torch.rand(t, k, generator=gen) + 0.1
    weights = weights.to(data.draw(st.sampled_from((torch.float32, torch.bfloat16, cfg["dtype"]))))
    layer = case.layer()
    ref = case.oracle(case.x, topk_ids=ids, topk_weights=weights)
    out64 = layer(case.x, topk_ids=ids.long(), topk_weights=weights)
    out32 = layer(case.x, topk_ids=ids.int(), topk_weights=weights)
    assert torch.equal(out64, out32), "int32 and int64 ids disagree"
    assert_matches_oracle(out64, ref, case, "pre-routed")
    function_out = case.function(case.x, topk_ids=ids.int(), topk_weights=weights)
    assert torch.equal(function_out, out64), "fused_moe and FusedMoE disagree"

    # Replacing every invalid id by another invalid one changes nothing, bit for bit.
    local = (ids >= cfg["offset"]) & (ids < cfg["offset"] + cfg["num_local"])
    other_invalid = torch.where(local, ids, torch.full_like(ids, e + 1000))
    assert torch.equal(layer(case.x, topk_ids=other_invalid, topk_weights=weights), out64)


def test_all_ids_invalid_gives_zeros():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ckpt = random_checkpoint(gen, 4, 32, 32)
    layer = moe_ops.FusedMoE(6, 32, 32, 2, local_expert_offset=1, num_local_experts=4,
                             backend="reference")
    layer.load_weights(**ckpt)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[-1, 0], [5, -1], [0, 5], [-7, 6], [2**31 - 1, -(2**31)]], dtype=torch.int32)
    out = layer(x, topk_ids=ids, topk_weights=torch.rand(5, 2, generator=gen))
    assert torch.equal(out, torch.zeros_like(out))
    # One valid pair among them: exactly that expert's contribution.
    ids[2, 0] = 3
    out = layer(x, topk_ids=ids, topk_weights=torch.full((5, 2), 0.5))
    assert torch.equal(out[[0, 1, 3, 4]], torch.zeros(4, 32, dtype=torch.bfloat16))
    assert out[2].abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Pre-quantized checkpoints are taken bit for bit
# ---------------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _deinterleave(kernel: torch.Tensor, permutation: torch.Tensor, sources: int) -> list[torch.Tensor]:
    """Undo the layer's row permutation: the rows of each checkpoint source, in source order."""
    rows = kernel.shape[1]
    assert torch.equal(permutation.sort().values, torch.arange(rows)), "not a permutation"
    per_source = rows // sources
    return [kernel[:, permutation[i * per_source:(i + 1) * per_source]] for i in range(sources)]


@pytest.mark.parametrize("quant", ("fp8", "fp8_block", "nvfp4", "mxfp4"))
@pytest.mark.parametrize("activation", ("swiglu", "relu2"))
def test_prequantized_taken_bit_for_bit(quant, activation):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    e, h, i = 3, 160 if quant != "mxfp4" else 96, 136 if quant == "fp8_block" else 64
    ckpt = random_checkpoint(gen, e, h, i, activation=activation, bias=True)
    given = quantize_checkpoint(ckpt, quant)
    layer = moe_ops.FusedMoE(e, h, i, 2, activation=activation, quant=quant, bias=True,
                             backend="reference")
    layer.load_weights(**given)
    gated = activation != "relu2"
    names = ("w1", "w3") if gated else ("w1",)
    # Weights.
    for role, checkpoint_names in (("w13", names), ("w2", ("w2",))):
        parts = _deinterleave(getattr(layer, role), getattr(layer, f"{role}_permutation"),
                              len(checkpoint_names))
        for part, name in zip(parts, checkpoint_names):
            assert part.dtype == given[name].dtype
            if quant in ("nvfp4", "mxfp4"):
                # packed rows are stored in the kernel order, padded: undo it
                part = q.fp4_from_kernel_order(part, given[name].shape[-1] * 2)
            assert torch.equal(_bytes(part), _bytes(given[name])), f"{role} != {name} (seed={seed})"
    # Scales (fp8's per-tensor scale is stored once per row) and nvfp4's global scales.
    suffixes = ("_scale", "_global_scale") if quant == "nvfp4" else ("_scale",)
    for suffix in suffixes:
        for role, checkpoint_names in (("w13", names), ("w2", ("w2",))):
            kernel = getattr(layer, role + suffix)
            parts = _deinterleave(kernel, getattr(layer, f"{role}{suffix}_permutation"),
                                  len(checkpoint_names))
            for part, name in zip(parts, checkpoint_names):
                expected = given[name + suffix]
                if expected.dim() == 1:  # one per expert, stored per row
                    expected = expected[:, None].expand(part.shape)
                elif quant in ("nvfp4", "mxfp4"):  # block scales: rows padded with zeros
                    assert not _bytes(part[..., expected.shape[-1]:]).any()
                    part = part[..., :expected.shape[-1]]
                assert part.dtype == expected.dtype
                assert torch.equal(_bytes(part), _bytes(expected)), f"{role}{suffix} (seed={seed})"
    # prepare_weights gives the same bytes, and both compute SPEC §1 on those operands.
    prepared = moe_ops.prepare_weights(quant=quant, activation=activation, **given)
    for role, tensor in prepared.items():
        assert torch.equal(_bytes(tensor), _bytes(getattr(layer, role))), role
    cfg = dict(quant=quant, routing="renormalize", activation=activation, dtype=torch.bfloat16,
               num_experts=e, top_k=2, n_group=None, topk_group=None, routed_scaling_factor=1.0,
               hidden=h, inter=i, num_tokens=12, skew="none", prequantized=True, bias=True,
               gate_scale=1.0, logit_dtype=torch.float32, seed=seed, alpha=1.702, limit=7.0,
               offset=0, num_local=e)
    case = MoECase(cfg)
    case.given = case.operands = given
    assert_matches_oracle(layer(case.x, case.logits), case.oracle(case.x, case.logits), case)


# ---------------------------------------------------------------------------------------------
# Routing of the reference backend against the float64 routing
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data(), routing=st.sampled_from(ROUTINGS),
       logit_dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
       skew=st.sampled_from(("none", "few", "one")), num_tokens=st.integers(0, 64))
def test_routing_matches_float64(data, routing, logit_dtype, skew, num_tokens):
    shape = routing_shape(data.draw, st, routing, max_experts=40, max_k=8)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    logits = random_logits(gen, num_tokens, shape["num_experts"], skew=skew, dtype=logit_dtype)
    bias = None
    if routing == "deepseek_v3" and data.draw(st.booleans()):
        bias = torch.randn(shape["num_experts"], generator=gen) * 0.3
    ids, weights = moe_ops.route(logits, shape["top_k"], routing=routing, routing_bias=bias,
                                 n_group=shape["n_group"], topk_group=shape["topk_group"],
                                 routed_scaling_factor=shape["routed_scaling_factor"],
                                 backend="reference")
    ref_ids, ref_weights = route64(logits, routing, shape["top_k"], bias, shape["n_group"],
                                   shape["topk_group"], shape["routed_scaling_factor"])
    assert ids.shape == weights.shape == (num_tokens, shape["top_k"])
    assert ids.dtype in (torch.int32, torch.int64) and weights.dtype == torch.float32
    # The order of the k slots is not part of the contract: compare per token, sorted by id.
    ids_sorted, order = ids.long().sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    assert torch.equal(ids_sorted, ref_sorted), f"{routing}: selection differs"
    torch.testing.assert_close(weights.gather(1, order).double(), ref_weights.gather(1, ref_order),
                               rtol=2e-6, atol=1e-7)


def test_routing_ties_go_to_lower_index():
    """Equal scores: the lower expert index wins, for every method."""
    for routing in ROUTINGS:
        k = 1 if routing == "llama4" else 2
        # Experts 1, 3, 5 tie for the top; 4 and 6 tie below them.
        row = torch.tensor([0.0, 2.0, -1.0, 2.0, 1.0, 2.0, 1.0, -3.0])
        kwargs = {}
        if routing == "deepseek_v3":
            kwargs = dict(n_group=1, topk_group=1)
        ids, _ = moe_ops.route(row[None].repeat(3, 1), k, routing=routing, backend="reference", **kwargs)
        expected = [1, 3][:k]
        assert sorted(ids[0].tolist()) == expected, routing


# ---------------------------------------------------------------------------------------------
# Edge cases of shape
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", QUANTS)
def test_zero_tokens(quant):
    seed = random.randrange(2**31)
    cfg = dict(quant=quant, routing="renormalize", activation="swiglu", dtype=torch.bfloat16,
               num_experts=4, top_k=2, n_group=None, topk_group=None, routed_scaling_factor=1.0,
               hidden=64, inter=64, num_tokens=0, skew="none", prequantized=False, bias=False,
               gate_scale=1.0, logit_dtype=torch.float32, seed=seed, alpha=1.702, limit=7.0,
               offset=0, num_local=4)
    case = MoECase(cfg)
    layer = case.layer()
    for out in (layer(case.x, case.logits), case.function(case.x, case.logits),
                layer(case.x, topk_ids=torch.zeros(0, 2, dtype=torch.int32),
                      topk_weights=torch.zeros(0, 2))):
        assert out.shape == (0, 64) and out.dtype == torch.bfloat16
