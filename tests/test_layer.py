"""FusedMoE's API (SPEC §2): constructor surface, repr, kernel_weights, state_dict round trips,
dtype casts, expert-parallel construction, and the functional API against the layer.

Numerics against an independent float64 evaluation live in test_reference.py; here the promise
is that the layer, `moe_ops.fused_moe` on `prepare_weights` tensors and `moe_ops.route` agree
with each other and with the routing oracle, and that the layer's surface behaves as documented.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import moe_ops
from moe_ops import quant as q
from moe_ops import layout
from moe_ops.routing import route_reference

E, H, I, K = 6, 64, 32, 2


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def ckpt(gen, e=E, gated=True, bias=False):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    out = dict(w1=rnd(e, I, H), w2=rnd(e, H, I))
    if gated:
        out["w3"] = rnd(e, I, H)
    if bias:
        out.update(b1=rnd(e, I), b2=rnd(e, H))
        if gated:
            out["b3"] = rnd(e, I)
    return out


def inputs(gen, t=7, dtype=torch.bfloat16, e=E):
    return (torch.randn(t, H, generator=gen).to(dtype),
            torch.randn(t, e, generator=gen).to(dtype))


def loaded_layer(gen, **kwargs):
    layer = moe_ops.FusedMoE(kwargs.pop("num_experts", E), H, I, kwargs.pop("top_k", K), **kwargs)
    weights = ckpt(gen, e=layer.num_local_experts, gated=layer.activation != "relu2",
                   bias=layer.bias)
    layer.load_weights(**weights)
    return layer, weights


# ---------------------------------------------------------------------------------------------
# Surface
# ---------------------------------------------------------------------------------------------
def test_constructor_signature_matches_spec():
    params = inspect.signature(moe_ops.FusedMoE.__init__).parameters
    assert list(params)[1:5] == ["num_experts", "hidden_size", "intermediate_size", "top_k"]
    expected_defaults = dict(
        routing="renormalize", n_group=None, topk_group=None, routed_scaling_factor=1.0,
        activation="swiglu", quant="none", bias=False, swiglu_alpha=1.702, swiglu_limit=7.0,
        local_expert_offset=0, num_local_experts=None, dtype=torch.bfloat16, device=None,
        backend="auto")
    for name, default in expected_defaults.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == default, name


def test_load_weights_signature_matches_spec():
    params = inspect.signature(moe_ops.FusedMoE.load_weights).parameters
    assert list(params)[1:4] == ["w1", "w2", "w3"]
    assert params["w3"].default is None
    keyword_only = ["w1_scale", "w2_scale", "w3_scale", "w1_global_scale", "w2_global_scale",
                    "w3_global_scale", "b1", "b2", "b3", "routing_bias"]
    for name in keyword_only:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is None, name


def test_public_names():
    for name in ("FusedMoE", "MoEArgumentError", "fused_moe", "prepare_weights", "route",
                 "ROUTING_METHODS", "ACTIVATIONS", "QUANT_MODES", "BACKENDS"):
        assert hasattr(moe_ops, name), name
    assert set(moe_ops.ROUTING_METHODS) == {"default", "renormalize", "renormalize_naive",
                                            "deepseek_v3", "llama4", "sigmoid_renorm", "topk"}
    assert set(moe_ops.ACTIVATIONS) == {"swiglu", "geglu", "swiglu_oai", "relu2"}
    assert set(moe_ops.QUANT_MODES) == {"none", "fp8", "fp8_block", "nvfp4", "mxfp4"}
    assert {"auto", "reference", "triton", "cpu"} <= set(moe_ops.BACKENDS)


def test_extra_repr_names_the_configuration():
    layer = moe_ops.FusedMoE(8, H, I, 2, routing="deepseek_v3", n_group=4, topk_group=2,
                             activation="geglu", quant="fp8", local_expert_offset=4,
                             num_local_experts=2, backend="reference")
    text = repr(layer)
    assert text.startswith("FusedMoE(")
    for part in ("num_experts=8", "hidden_size=64", "intermediate_size=32", "top_k=2",
                 "routing='deepseek_v3'", "activation='geglu'", "quant='fp8'",
                 "local_experts=4..5", "backend='reference'"):
        assert part in text, (part, text)


@pytest.mark.parametrize("quant,activation,bias,roles", [
    ("none", "swiglu", False, {"w13", "w2"}),
    ("none", "relu2", True, {"w13", "w2", "b13", "b2"}),
    ("fp8", "swiglu", False, {"w13", "w2", "w13_scale", "w2_scale"}),
    ("fp8_block", "geglu", False, {"w13", "w2", "w13_scale", "w2_scale"}),
    ("nvfp4", "swiglu", False, {"w13", "w2", "w13_scale", "w2_scale", "w13_global_scale",
                                "w2_global_scale"}),
    ("mxfp4", "swiglu_oai", True, {"w13", "w2", "w13_scale", "w2_scale", "w13_global_scale",
                                    "w2_global_scale", "b13", "b2"}),
])
def test_kernel_weights_are_the_layer_parameters(gen, quant, activation, bias, roles):
    layer, _ = loaded_layer(gen, quant=quant, activation=activation, bias=bias)
    weights = layer.kernel_weights()
    assert set(weights) == roles
    params = dict(layer.named_parameters())
    for role, tensor in weights.items():
        assert tensor is params[role], role  # the live parameters, not copies
        assert tensor.shape[0] == E, role
        assert not tensor.requires_grad, role
    gated = activation != "relu2"
    fp4 = quant in ("nvfp4", "mxfp4")
    # 4-bit rows are packed in the kernel order, padded (moe_ops.quant.fp4_padded_k)
    assert weights["w13"].shape == (E, (2 if gated else 1) * I, q.fp4_padded_k(H) // 2 if fp4 else H)
    assert weights["w2"].shape == (E, H, q.fp4_padded_k(I) // 2 if fp4 else I)


def test_state_dict_holds_parameters_not_permutations(gen):
    layer, _ = loaded_layer(gen, quant="fp8", num_experts=8, routing="deepseek_v3", n_group=2,
                            topk_group=1)
    keys = set(layer.state_dict())
    assert keys == {"w13", "w2", "w13_scale", "w2_scale", "routing_bias"}
    buffers = {name for name, _ in layer.named_buffers()}
    assert {f"{r}_permutation" for r in ("w13", "w2", "w13_scale", "w2_scale")} <= buffers


# ---------------------------------------------------------------------------------------------
# Loaded state
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_load_state_dict_marks_the_layer_loaded(gen, quant):
    source, _ = loaded_layer(gen, quant=quant)
    target = moe_ops.FusedMoE(E, H, I, K, quant=quant)
    x, logits = inputs(gen)
    with pytest.raises(moe_ops.MoEArgumentError, match="^weights: "):
        target(x, logits)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target(x, logits), source(x, logits))


def test_partial_load_state_dict_does_not_mark_the_layer_loaded(gen):
    source, _ = loaded_layer(gen)
    target = moe_ops.FusedMoE(E, H, I, K)
    state = source.state_dict()
    del state["w2"]
    target.load_state_dict(state, strict=False)
    with pytest.raises(moe_ops.MoEArgumentError, match="^weights: "):
        target(*inputs(gen))


def test_reload_writes_in_place_and_changes_the_output(gen):
    """An RL weight sync: same parameter storage, new values, output of the new weights."""
    layer, _ = loaded_layer(gen, quant="fp8")
    pointers = {role: t.data_ptr() for role, t in layer.kernel_weights().items()}
    x, logits = inputs(gen)
    before = layer(x, logits)
    computations = layout.permutation_computations
    new = ckpt(gen)
    layer.load_weights(**new)
    assert layout.permutation_computations == computations
    assert {role: t.data_ptr() for role, t in layer.kernel_weights().items()} == pointers
    after = layer(x, logits)
    assert not torch.equal(after, before)
    fresh = moe_ops.FusedMoE(E, H, I, K, quant="fp8")
    fresh.load_weights(**new)
    assert torch.equal(after, fresh(x, logits))


def test_to_same_dtype_keeps_results(gen):
    layer, _ = loaded_layer(gen, dtype=torch.bfloat16)
    x, logits = inputs(gen)
    expected = layer(x, logits)
    assert layer.to(torch.bfloat16) is layer
    assert torch.equal(layer(x, logits), expected)


@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_to_another_dtype_is_refused_loudly_at_forward(gen, quant):
    """Decision (documented by this test): `.to(dtype)` / `.half()` is nn.Module's plain cast
    of every floating parameter; the layer keeps its construction dtype and does not re-plan
    its kernel layout, so the next forward raises MoEArgumentError naming the tensor whose
    dtype no longer matches, whatever the input dtype. Never a silently wrong result (a
    float8 weight cast to float16 would otherwise be read without its scale). Build the layer
    in the wanted dtype instead."""
    layer, _ = loaded_layer(gen, quant=quant, dtype=torch.bfloat16)
    layer.to(torch.float16)
    x, logits = inputs(gen)
    with pytest.raises(moe_ops.MoEArgumentError, match="^w13: expected dtype"):
        layer(x, logits)
    with pytest.raises(moe_ops.MoEArgumentError, match="^hidden_states: expected dtype"):
        layer(x.half(), logits)


# ---------------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------------
def test_expert_parallel_defaults():
    full = moe_ops.FusedMoE(8, H, I, 2)
    assert (full.local_expert_offset, full.num_local_experts) == (0, 8)
    tail = moe_ops.FusedMoE(8, H, I, 2, local_expert_offset=5)
    assert (tail.local_expert_offset, tail.num_local_experts) == (5, 3)
    assert tail.kernel_weights()["w13"].shape[0] == 3
    assert "local_experts=5..7" in repr(tail)


def test_expert_parallel_shards_sum_to_the_full_layer(gen):
    """Each shard loads only its experts, routes over all of them, returns its partial sum."""
    dtype = torch.float32
    full, weights = loaded_layer(gen, dtype=dtype, quant="none", routing="sigmoid_renorm",
                                 top_k=3)
    x, logits = inputs(gen, t=11, dtype=dtype)
    expected = full(x, logits)
    total = torch.zeros_like(expected)
    for offset, count in ((0, 2), (2, 3), (5, 1)):
        shard = moe_ops.FusedMoE(E, H, I, 3, routing="sigmoid_renorm", dtype=dtype,
                                 local_expert_offset=offset, num_local_experts=count)
        shard.load_weights(**{n: t[offset:offset + count] for n, t in weights.items()})
        partial = shard(x, logits)
        assert partial.abs().sum() > 0
        total += partial
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_expert_parallel_shard_pre_routed_ignores_other_shards_ids(gen):
    dtype = torch.float32
    full, weights = loaded_layer(gen, dtype=dtype)
    shard = moe_ops.FusedMoE(E, H, I, K, dtype=dtype, local_expert_offset=4, num_local_experts=2)
    shard.load_weights(**{n: t[4:6] for n, t in weights.items()})
    x, _ = inputs(gen, t=9, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(9)]).to(torch.int32)
    w = torch.rand(9, K, generator=gen)
    local_only = torch.where(ids >= 4, w, torch.zeros_like(w))
    torch.testing.assert_close(shard(x, topk_ids=ids, topk_weights=w),
                               full(x, topk_ids=ids, topk_weights=local_only),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# moe_ops.fused_moe + prepare_weights == the layer; moe_ops.route == the routing oracle
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant,activation,bias,dtype,routing", [
    ("none", "swiglu", False, torch.bfloat16, "renormalize"),
    ("none", "relu2", False, torch.float32, "topk"),
    ("fp8", "geglu", False, torch.float16, "default"),
    ("fp8_block", "swiglu", False, torch.bfloat16, "renormalize_naive"),
    ("nvfp4", "swiglu", False, torch.bfloat16, "sigmoid_renorm"),
    ("mxfp4", "swiglu_oai", True, torch.bfloat16, "renormalize"),
], ids=lambda v: str(v).removeprefix("torch."))
def test_fused_moe_on_prepared_weights_equals_the_layer(gen, quant, activation, bias, dtype,
                                                        routing):
    layer, weights = loaded_layer(gen, quant=quant, activation=activation, bias=bias,
                                  dtype=dtype, routing=routing, swiglu_alpha=1.5,
                                  swiglu_limit=5.0)
    prepared = moe_ops.prepare_weights(quant=quant, activation=activation, dtype=dtype, **weights)
    assert set(prepared) == set(layer.kernel_weights())
    for role, tensor in prepared.items():
        expected = layer.kernel_weights()[role]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, role
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), role
    x, logits = inputs(gen, dtype=dtype)
    got = moe_ops.fused_moe(x, logits, **prepared, top_k=K, routing=routing,
                            activation=activation, quant=quant, swiglu_alpha=1.5,
                            swiglu_limit=5.0)
    assert torch.equal(got, layer(x, logits))
    ids, w = moe_ops.route(logits, K, routing=routing)
    pre_routed = moe_ops.fused_moe(x, topk_ids=ids, topk_weights=w, **prepared,
                                   activation=activation, quant=quant, swiglu_alpha=1.5,
                                   swiglu_limit=5.0)
    assert torch.equal(pre_routed, got)
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), got)


def test_fused_moe_deepseek_with_routing_bias_equals_the_layer(gen):
    layer, weights = loaded_layer(gen, num_experts=8, top_k=3, routing="deepseek_v3", n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5)
    bias = torch.randn(8, generator=gen)
    layer.load_weights(**weights, routing_bias=bias)
    assert torch.equal(layer.routing_bias, bias)
    prepared = moe_ops.prepare_weights(**weights)
    x, logits = inputs(gen, e=8)
    got = moe_ops.fused_moe(x, logits, **prepared, top_k=3, routing="deepseek_v3",
                            routing_bias=bias, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5)
    assert torch.equal(got, layer(x, logits))
    without_bias = moe_ops.fused_moe(x, logits, **prepared, top_k=3, routing="deepseek_v3",
                                     n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert not torch.equal(without_bias, got)  # the bias is really used


@pytest.mark.parametrize("method,top_k,n_group,topk_group", [
    ("default", 3, None, None), ("renormalize", 2, None, None),
    ("renormalize_naive", 4, None, None), ("sigmoid_renorm", 2, None, None),
    ("topk", 3, None, None), ("llama4", 1, None, None), ("deepseek_v3", 3, 4, 2),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_route_matches_route_reference(gen, method, top_k, n_group, topk_group, dtype):
    logits = torch.randn(13, 8, generator=gen).to(dtype)
    bias = torch.randn(8, generator=gen) if method == "deepseek_v3" else None
    ids, weights = moe_ops.route(logits, top_k, routing=method, routing_bias=bias,
                                 n_group=n_group, topk_group=topk_group,
                                 routed_scaling_factor=1.7)
    ref_ids, ref_weights = route_reference(logits, method, top_k, bias, n_group, topk_group, 1.7)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (13, top_k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    # Distinct experts per token.
    assert all(len(set(row)) == top_k for row in ids.tolist())


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_state_dict_of_the_natural_fp4_format_is_converted(gen, quant):
    """A state_dict saved before the kernel order (format version 1: natural packing, unpadded
    scales) loads into the same weights as the current one, never silently misread."""
    layer, _ = loaded_layer(gen, quant=quant, activation="swiglu", bias=False)
    current = layer.state_dict()
    old = dict(current)
    for role, k in (("w13", layer.hidden_size), ("w2", layer.intermediate_size)):
        old[role] = q.fp4_from_kernel_order(current[role], k)
        old[role + "_scale"] = current[role + "_scale"][..., :k // q.fp4_scale_block(quant)]
        if quant == "mxfp4":  # (row scales came with format version 4)
            del old[role + "_global_scale"]
    old = type(current)(old)
    old._metadata = {"": {"version": 1}}
    fresh = moe_ops.FusedMoE(layer.num_experts, layer.hidden_size, layer.intermediate_size,
                             layer.top_k, quant=quant, backend="reference")
    fresh.load_state_dict(old)
    for name, tensor in current.items():
        assert torch.equal(fresh.state_dict()[name].view(torch.uint8) if tensor.dtype != torch.float32
                           else fresh.state_dict()[name], tensor.view(torch.uint8)
                           if tensor.dtype != torch.float32 else tensor), name


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_state_dict_of_the_byte_order_format_is_converted(gen, quant):
    """A state_dict saved before the word permutation of the kernel order (format version 2:
    the byte order alone) loads into the same weights as the current one."""
    layer, _ = loaded_layer(gen, quant=quant, activation="swiglu", bias=False)
    current = layer.state_dict()
    old = type(current)((name, q.fp4_permute_word_bits(t, inverse=True)
                         if name in ("w13", "w2") else t) for name, t in current.items()
                        if quant == "nvfp4" or not name.endswith("_global_scale"))
    assert not torch.equal(old["w13"], current["w13"])
    old._metadata = {"": {"version": 2}}
    fresh = moe_ops.FusedMoE(layer.num_experts, layer.hidden_size, layer.intermediate_size,
                             layer.top_k, quant=quant, backend="reference")
    fresh.load_state_dict(old)
    assert torch.equal(fresh.w13, current["w13"]) and torch.equal(fresh.w2, current["w2"])


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_unpadded_natural_fp4_state_dict_is_not_misread(quant):
    """With K a multiple of 256 the natural and the kernel-order tensors have the same shape:
    only the format version tells them apart, and the load converts by it."""
    from moe_ops import synthetic
    layer = moe_ops.FusedMoE(4, 256, 256, 2, quant=quant, backend="reference")
    layer.load_weights(**synthetic.random_checkpoint(4, 256, 256, quant=quant, seed=1))
    current = layer.state_dict()
    old = type(current)((name, q.fp4_from_kernel_order(t, 256) if name in ("w13", "w2") else t)
                        for name, t in current.items()
                        if quant == "nvfp4" or not name.endswith("_global_scale"))
    assert old["w13"].shape == current["w13"].shape and not torch.equal(old["w13"], current["w13"])
    old._metadata = {"": {"version": 1}}
    fresh = moe_ops.FusedMoE(4, 256, 256, 2, quant=quant, backend="reference")
    fresh.load_state_dict(old)
    assert torch.equal(fresh.w13, current["w13"]) and torch.equal(fresh.w2, current["w2"])


def test_state_dict_of_unfolded_mxfp4_scales_is_converted(gen):
    """A version-3 mxfp4 state_dict (block scales as the checkpoint gave them, no row scales)
    with bytes past 128 loads into the layer's folded scales and row scales, and computes what
    a layer loaded from the checkpoint computes."""
    from float64_moe import quantize_checkpoint, random_checkpoint
    ckpt = random_checkpoint(gen, 4, 64, 64, activation="swiglu")
    ckpt["w2"][1] *= 2.0 ** 30
    ckpt = quantize_checkpoint(ckpt, "mxfp4")
    layer = moe_ops.FusedMoE(4, 64, 64, 2, quant="mxfp4", backend="reference")
    layer.load_weights(**ckpt)
    current = layer.state_dict()
    assert float(current["w2_global_scale"].max()) > 1.0
    old = type(current)((name, t) for name, t in current.items()
                        if not name.endswith("_global_scale"))
    # version 3's bytes: the checkpoint's, padded (w13's have no row past 128: the same)
    old["w2_scale"] = q.fp4_pad_scales(ckpt["w2_scale"], 64, "mxfp4")
    assert int(old["w2_scale"].max()) > q.MXFP4_FOLD_MAX
    old._metadata = {"": {"version": 3}}
    fresh = moe_ops.FusedMoE(4, 64, 64, 2, quant="mxfp4", backend="reference")
    fresh.load_state_dict(old)
    for name, tensor in current.items():
        assert torch.equal(getattr(fresh, name), tensor), name
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    logits = torch.randn(5, 4, generator=gen)
    assert torch.equal(fresh(x, logits), layer(x, logits))
