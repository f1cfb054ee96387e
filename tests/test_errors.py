"""SPEC §3: wrong input is rejected with an exception naming the argument, before any kernel.

Every rejection is a moe_ops.MoEArgumentError (a ValueError) whose message starts with the
name of the offending argument ("<argument>: expected ..., got ..."). One test per rejection.
Also: T = 0 returns an empty [0, H] tensor, and a rejected load_weights changes nothing.
"""
from __future__ import annotations

import re

import pytest
import torch

import moe_ops
from moe_ops import quant as q

E, H, I, K = 4, 64, 32, 2
DTYPE = torch.bfloat16


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def rnd(gen, *shape, dtype=torch.float32, scale=0.2):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def ckpt(gen, e=E, h=H, i=I, gated=True, bias=False):
    out = dict(w1=rnd(gen, e, i, h), w2=rnd(gen, e, h, i))
    if gated:
        out["w3"] = rnd(gen, e, i, h)
    if bias:
        out.update(b1=rnd(gen, e, i), b2=rnd(gen, e, h))
        if gated:
            out["b3"] = rnd(gen, e, i)
    return out


def make_layer(gen, load=True, **kwargs):
    config = dict(dtype=DTYPE)
    config.update(kwargs)
    layer = moe_ops.FusedMoE(config.pop("num_experts", E), H, I, config.pop("top_k", K), **config)
    if load:
        kw = ckpt(gen, e=layer.num_local_experts, gated=layer.activation != "relu2",
                  bias=layer.bias)
        layer.load_weights(**kw)
    return layer


def rejects(argument: str):
    """pytest.raises for a MoEArgumentError whose message names `argument` first."""
    return pytest.raises(moe_ops.MoEArgumentError, match=rf"^{re.escape(argument)}: expected ")


def tokens(gen, t=5, h=H, dtype=DTYPE):
    return rnd(gen, t, h, dtype=dtype, scale=1.0)


def logits(gen, t=5, e=E, dtype=torch.float32):
    return rnd(gen, t, e, dtype=dtype, scale=1.0)


def topk(gen, t=5, k=K, e=E):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    return ids, torch.rand(t, k, generator=gen)


def test_error_type_is_a_value_error():
    assert issubclass(moe_ops.MoEArgumentError, ValueError)


# ---------------------------------------------------------------------------------------------
# Routing configuration (constructor, and moe_ops.route on its own)
# ---------------------------------------------------------------------------------------------
def test_top_k_above_num_experts(gen):
    with rejects("top_k"):
        moe_ops.FusedMoE(E, H, I, E + 1, dtype=DTYPE)


def test_top_k_above_num_experts_in_route(gen):
    with rejects("top_k"):
        moe_ops.route(logits(gen), E + 1)


def test_top_k_zero(gen):
    with rejects("top_k"):
        moe_ops.FusedMoE(E, H, I, 0, dtype=DTYPE)


def test_llama4_with_k_not_one(gen):
    with rejects("top_k"):
        moe_ops.FusedMoE(E, H, I, 2, routing="llama4", dtype=DTYPE)


def test_llama4_with_k_not_one_in_route(gen):
    with rejects("top_k"):
        moe_ops.route(logits(gen), 2, routing="llama4")


def test_deepseek_n_group_not_dividing_experts(gen):
    with rejects("n_group"):
        moe_ops.FusedMoE(8, H, I, 2, routing="deepseek_v3", n_group=3, topk_group=1, dtype=DTYPE)


def test_deepseek_missing_n_group(gen):
    with rejects("n_group"):
        moe_ops.FusedMoE(8, H, I, 2, routing="deepseek_v3", dtype=DTYPE)


def test_deepseek_topk_group_above_n_group(gen):
    with rejects("topk_group"):
        moe_ops.FusedMoE(8, H, I, 2, routing="deepseek_v3", n_group=2, topk_group=3, dtype=DTYPE)


def test_deepseek_k_above_topk_group_times_group_size(gen):
    # 8 experts in 4 groups of 2, 1 group kept: at most 2 experts can be chosen.
    with rejects("top_k"):
        moe_ops.FusedMoE(8, H, I, 3, routing="deepseek_v3", n_group=4, topk_group=1, dtype=DTYPE)


def test_deepseek_rules_also_checked_in_route(gen):
    with rejects("n_group"):
        moe_ops.route(logits(gen, e=8), 2, routing="deepseek_v3", n_group=3, topk_group=1)


def test_unknown_routing_method(gen):
    with rejects("routing"):
        moe_ops.FusedMoE(E, H, I, K, routing="softmax_topk", dtype=DTYPE)


def test_unknown_activation(gen):
    with rejects("activation"):
        moe_ops.FusedMoE(E, H, I, K, activation="gelu", dtype=DTYPE)


def test_unknown_quant(gen):
    with rejects("quant"):
        moe_ops.FusedMoE(E, H, I, K, quant="int4", dtype=DTYPE)


def test_bad_backend_name_in_constructor(gen):
    with rejects("backend"):
        moe_ops.FusedMoE(E, H, I, K, backend="cuda", dtype=DTYPE)


def test_bad_backend_name_in_fused_moe(gen):
    layer = make_layer(gen)
    with rejects("backend"):
        moe_ops.fused_moe(tokens(gen), logits(gen), **layer.kernel_weights(), top_k=K,
                          backend="fast")


def test_bad_backend_name_in_route(gen):
    with rejects("backend"):
        moe_ops.route(logits(gen), K, backend="fast")


def test_triton_backend_on_cpu_without_interpreter(gen, monkeypatch):
    # The flag is read once at import (moe_ops.kernels.INTERPRET): patch that reading.
    monkeypatch.setattr(moe_ops.kernels, "INTERPRET", False)
    layer = make_layer(gen, backend="triton")
    with rejects("backend"):
        layer(tokens(gen), logits(gen))


def test_triton_backend_runs_4bit(kernel_device):
    """nvfp4/mxfp4 run on the Triton kernels (W4A16): asked for explicitly they are accepted,
    and backend='auto' on CUDA picks triton for them as for every other mode."""
    from moe_ops.experts import resolve_backend

    assert resolve_backend("triton", kernel_device, "nvfp4") == "triton"
    for quant in ("mxfp4", "nvfp4", "fp8"):
        assert resolve_backend("auto", torch.device("cuda"), quant) == "triton"


def test_local_expert_offset_out_of_range(gen):
    with rejects("local_expert_offset"):
        moe_ops.FusedMoE(E, H, I, K, local_expert_offset=E, dtype=DTYPE)


def test_num_local_experts_past_the_end(gen):
    with rejects("num_local_experts"):
        moe_ops.FusedMoE(E, H, I, K, local_expert_offset=2, num_local_experts=3, dtype=DTYPE)


# ---------------------------------------------------------------------------------------------
# dtype not supported for the quant mode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_float32_layer_with_4bit_quant(quant):
    with rejects("dtype"):
        moe_ops.FusedMoE(E, H, I, K, quant=quant, dtype=torch.float32)


def test_unsupported_layer_dtype():
    with rejects("dtype"):
        moe_ops.FusedMoE(E, H, I, K, dtype=torch.float64)


def test_float32_hidden_states_with_nvfp4_weights(gen):
    weights = moe_ops.prepare_weights(quant="nvfp4", dtype=torch.bfloat16, **ckpt(gen))
    with rejects("hidden_states"):
        moe_ops.fused_moe(tokens(gen, dtype=torch.float32), logits(gen), **weights, top_k=K,
                          quant="nvfp4")


def test_integer_router_logits(gen):
    layer = make_layer(gen)
    with rejects("router_logits"):
        layer(tokens(gen), torch.randint(-3, 3, (5, E), generator=gen, dtype=torch.int32))


def test_float64_router_logits(gen):
    with rejects("router_logits"):
        moe_ops.route(logits(gen).double(), K)


def test_fp8_checkpoint_into_quant_none_layer(gen):
    layer = make_layer(gen, load=False)
    kw = ckpt(gen)
    kw = {name: t.to(torch.float8_e4m3fn) for name, t in kw.items()}
    with rejects("w1"):
        layer.load_weights(**kw)


def test_fp8_kernel_weights_with_quant_none(gen):
    weights = moe_ops.prepare_weights(quant="fp8", dtype=DTYPE, **ckpt(gen))
    with rejects("w13"):
        moe_ops.fused_moe(tokens(gen), logits(gen), w13=weights["w13"], w2=weights["w2"],
                          top_k=K, quant="none")


def test_integer_checkpoint_weights(gen):
    layer = make_layer(gen, load=False)
    kw = ckpt(gen)
    kw["w2"] = torch.randint(-3, 3, kw["w2"].shape, generator=gen, dtype=torch.int32)
    with rejects("w2"):
        layer.load_weights(**kw)


def test_hidden_states_dtype_other_than_the_layer(gen):
    layer = make_layer(gen)
    with rejects("hidden_states"):
        layer(tokens(gen, dtype=torch.float16), logits(gen))


def test_integer_hidden_states_in_fused_moe(gen):
    layer = make_layer(gen)
    x = torch.randint(-3, 3, (5, H), generator=gen, dtype=torch.int32)
    with rejects("hidden_states"):
        moe_ops.fused_moe(x, logits(gen), **layer.kernel_weights(), top_k=K)


# ---------------------------------------------------------------------------------------------
# Rank and shape of the call's tensors
# ---------------------------------------------------------------------------------------------
def test_hidden_states_rank(gen):
    layer = make_layer(gen)
    with rejects("hidden_states"):
        layer(tokens(gen)[None], logits(gen))


def test_hidden_states_rank_pre_routed(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("hidden_states"):
        layer(tokens(gen)[None], topk_ids=ids, topk_weights=w)


def test_hidden_states_width(gen):
    layer = make_layer(gen)
    with rejects("hidden_states"):
        layer(tokens(gen, h=H + 16), logits(gen))


def test_router_logits_rank(gen):
    layer = make_layer(gen)
    with rejects("router_logits"):
        layer(tokens(gen), logits(gen)[None])


def test_router_logits_wrong_number_of_experts(gen):
    """More columns than experts would route to experts that do not exist."""
    layer = make_layer(gen)
    with rejects("router_logits"):
        layer(tokens(gen), logits(gen, e=E + 1))


def test_router_logits_rows_differ_from_tokens(gen):
    layer = make_layer(gen)
    with rejects("router_logits"):
        layer(tokens(gen, t=5), logits(gen, t=4))


def test_topk_ids_rank(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("topk_ids"):
        layer(tokens(gen), topk_ids=ids.reshape(-1), topk_weights=w)


def test_topk_ids_rows_differ_from_tokens(gen):
    layer = make_layer(gen)
    ids, w = topk(gen, t=4)
    with rejects("topk_ids"):
        layer(tokens(gen, t=5), topk_ids=ids, topk_weights=w)


def test_topk_ids_float_dtype(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("topk_ids"):
        layer(tokens(gen), topk_ids=ids.float(), topk_weights=w)


def test_topk_weights_shape(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("topk_weights"):
        layer(tokens(gen), topk_ids=ids, topk_weights=w[:, :1])


def test_topk_weights_integer_dtype(gen):
    layer = make_layer(gen)
    ids, _ = topk(gen)
    with rejects("topk_weights"):
        layer(tokens(gen), topk_ids=ids, topk_weights=torch.ones_like(ids))


def test_topk_ids_without_topk_weights(gen):
    layer = make_layer(gen)
    ids, _ = topk(gen)
    with rejects("topk_ids"):
        layer(tokens(gen), topk_ids=ids)


def test_both_logits_and_topk_ids(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("topk_ids"):
        layer(tokens(gen), logits(gen), topk_ids=ids, topk_weights=w)


def test_fused_moe_routing_without_top_k(gen):
    layer = make_layer(gen)
    with rejects("top_k"):
        moe_ops.fused_moe(tokens(gen), logits(gen), **layer.kernel_weights())


def test_kernel_weight_rank(gen):
    weights = make_layer(gen).kernel_weights()
    with rejects("w13"):
        moe_ops.fused_moe(tokens(gen), logits(gen), w13=weights["w13"][0], w2=weights["w2"],
                          top_k=K)


def test_kernel_weight_shape(gen):
    weights = make_layer(gen).kernel_weights()
    with rejects("w2"):
        moe_ops.fused_moe(tokens(gen), logits(gen), w13=weights["w13"],
                          w2=weights["w2"][:, : H // 2], top_k=K)


def test_kernel_weights_of_a_different_expert_count(gen):
    weights = make_layer(gen).kernel_weights()
    with rejects("w2"):
        moe_ops.fused_moe(tokens(gen), logits(gen), w13=weights["w13"], w2=weights["w2"][:3],
                          top_k=K)


# ---------------------------------------------------------------------------------------------
# load_weights: checkpoint shapes, scales, biases
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,bad", [
    ("w1", lambda t: t[0]),  # rank 2
    ("w1", lambda t: t[:, :-1]),  # I - 1 rows
    ("w2", lambda t: t[..., :-1]),
    ("w3", lambda t: t.transpose(1, 2)),
    ("w1", lambda t: t[:-1]),  # one expert short
])
def test_load_weights_wrong_checkpoint_shape(gen, name, bad):
    layer = make_layer(gen, load=False)
    kw = ckpt(gen)
    kw[name] = bad(kw[name])
    with rejects(name):
        layer.load_weights(**kw)


def test_load_weights_missing_w3_for_gated_activation(gen):
    layer = make_layer(gen, load=False)
    kw = ckpt(gen)
    del kw["w3"]
    with rejects("w3"):
        layer.load_weights(**kw)


def test_load_weights_w3_with_relu2(gen):
    layer = make_layer(gen, load=False, activation="relu2")
    with rejects("w3"):
        layer.load_weights(**ckpt(gen, gated=True))


def test_load_weights_mix_of_quantized_and_high_precision(gen):
    layer = make_layer(gen, load=False, quant="fp8")
    kw = ckpt(gen)
    kw["w1"], w1_scale = q.quantize_fp8_per_tensor(kw["w1"])
    with rejects("w1, w2, w3"):
        layer.load_weights(**kw, w1_scale=w1_scale)


def prequantized_fp8(gen, block=False):
    kw = ckpt(gen)
    out = {}
    for name in ("w1", "w2", "w3"):
        if block:
            out[name], out[name + "_scale"] = q.quantize_fp8_block(kw[name])
        else:
            out[name], out[name + "_scale"] = q.quantize_fp8_per_tensor(kw[name])
    return out


def prequantized_fp4(gen, quant):
    kw = ckpt(gen)
    out = {}
    for name in ("w1", "w2", "w3"):
        if quant == "nvfp4":
            out[name], out[name + "_scale"], out[name + "_global_scale"] = q.quantize_nvfp4(kw[name])
        else:
            out[name], out[name + "_scale"] = q.quantize_mxfp4(kw[name])
    return out


def test_prequantized_checkpoints_load(gen):
    """The fixtures of the scale tests below are themselves valid (so a rejection is the
    scale's fault, not the fixture's)."""
    for quant, kw in (("fp8", prequantized_fp8(gen)), ("fp8_block", prequantized_fp8(gen, True)),
                      ("nvfp4", prequantized_fp4(gen, "nvfp4")),
                      ("mxfp4", prequantized_fp4(gen, "mxfp4"))):
        layer = make_layer(gen, load=False, quant=quant)
        layer.load_weights(**kw)
        out = layer(tokens(gen), logits(gen))
        assert out.shape == (5, H) and torch.isfinite(out).all()


@pytest.mark.parametrize("quant,missing", [
    ("fp8", "w1_scale"), ("fp8", "w2_scale"), ("fp8_block", "w3_scale"),
    ("nvfp4", "w2_scale"), ("nvfp4", "w1_global_scale"), ("mxfp4", "w3_scale"),
])
def test_load_weights_missing_scale_for_prequantized(gen, quant, missing):
    layer = make_layer(gen, load=False, quant=quant)
    kw = prequantized_fp8(gen, quant == "fp8_block") if quant.startswith("fp8") else prequantized_fp4(gen, quant)
    del kw[missing]
    with rejects(missing):
        layer.load_weights(**kw)


@pytest.mark.parametrize("quant,name,bad", [
    ("fp8", "w1_scale", lambda s: s[:-1]),  # one expert short
    ("fp8", "w2_scale", lambda s: s[:, None]),  # [E, 1] instead of [E]
    ("fp8_block", "w1_scale", lambda s: s[:, :, :1].expand(-1, -1, 2).clone()),  # extra column
    ("fp8_block", "w2_scale", lambda s: s.repeat(1, 2, 1)),  # two row blocks for 64 rows
    ("nvfp4", "w1_scale", lambda s: s[..., :-1]),
    ("nvfp4", "w3_global_scale", lambda s: s.repeat(2)),
    ("mxfp4", "w2_scale", lambda s: s[:, :-1]),
])
def test_load_weights_scale_shape_mismatch(gen, quant, name, bad):
    layer = make_layer(gen, load=False, quant=quant)
    kw = prequantized_fp8(gen, quant == "fp8_block") if quant.startswith("fp8") else prequantized_fp4(gen, quant)
    kw[name] = bad(kw[name])
    with rejects(name):
        layer.load_weights(**kw)


@pytest.mark.parametrize("quant,name,dtype", [
    ("fp8", "w1_scale", torch.bfloat16),
    ("nvfp4", "w2_scale", torch.float32),  # nvfp4 block scales are e4m3
    ("mxfp4", "w1_scale", torch.float8_e4m3fn),  # mxfp4 scales are e8m0 bytes
])
def test_load_weights_scale_dtype_mismatch(gen, quant, name, dtype):
    layer = make_layer(gen, load=False, quant=quant)
    kw = prequantized_fp8(gen) if quant == "fp8" else prequantized_fp4(gen, quant)
    kw[name] = kw[name].float().to(dtype)
    with rejects(name):
        layer.load_weights(**kw)


def test_load_weights_scale_with_high_precision_weights(gen):
    layer = make_layer(gen, load=False, quant="fp8")
    kw = ckpt(gen)
    with rejects("w1_scale"):
        layer.load_weights(**kw, w1_scale=torch.rand(E, generator=gen))


def test_bias_given_to_layer_without_bias(gen):
    layer = make_layer(gen, load=False)
    with rejects("b1"):
        layer.load_weights(**ckpt(gen, bias=True))


def test_bias_missing_for_layer_with_bias(gen):
    layer = make_layer(gen, load=False, bias=True, activation="swiglu_oai")
    kw = ckpt(gen, bias=True)
    del kw["b2"]
    with rejects("b2"):
        layer.load_weights(**kw)


def test_bias_wrong_shape(gen):
    layer = make_layer(gen, load=False, bias=True, activation="swiglu_oai")
    kw = ckpt(gen, bias=True)
    kw["b3"] = kw["b3"][:, :-1]
    with rejects("b3"):
        layer.load_weights(**kw)


def test_routing_bias_wrong_shape(gen):
    layer = make_layer(gen, load=False, num_experts=8, routing="deepseek_v3", n_group=2,
                       topk_group=1)
    with rejects("routing_bias"):
        layer.load_weights(**ckpt(gen, e=8), routing_bias=torch.randn(4, generator=gen))


def test_routing_bias_for_a_method_without_bias(gen):
    layer = make_layer(gen, load=False)
    with rejects("routing_bias"):
        layer.load_weights(**ckpt(gen), routing_bias=torch.randn(E, generator=gen))


def test_routing_bias_wrong_shape_in_route(gen):
    with rejects("routing_bias"):
        moe_ops.route(logits(gen, e=8), 2, routing="deepseek_v3", n_group=2, topk_group=1,
                      routing_bias=torch.randn(7, generator=gen))


def test_load_weights_checkpoint_for_wrong_expert_parallel_shard(gen):
    """A shard of 2 local experts takes 2 experts' tensors, not all of them."""
    layer = make_layer(gen, load=False, num_experts=8, local_expert_offset=4,
                       num_local_experts=2)
    with rejects("w1"):
        layer.load_weights(**ckpt(gen, e=8))


@pytest.mark.parametrize("case", ["routing_bias_shape", "w2_scale_shape", "b2_missing"])
def test_rejected_load_weights_leaves_the_layer_unchanged(gen, case):
    if case == "routing_bias_shape":  # the last check of load_weights
        layer = make_layer(gen, num_experts=8, routing="deepseek_v3", n_group=2, topk_group=1)
        layer.load_weights(**ckpt(gen, e=8), routing_bias=torch.randn(8, generator=gen))
        bad = dict(ckpt(gen, e=8), routing_bias=torch.randn(9, generator=gen))
    elif case == "w2_scale_shape":
        layer = make_layer(gen, load=False, quant="fp8")
        layer.load_weights(**prequantized_fp8(gen))
        bad = prequantized_fp8(gen)
        bad["w2_scale"] = bad["w2_scale"][:-1]
    else:
        layer = make_layer(gen, bias=True, activation="swiglu_oai")
        bad = ckpt(gen, bias=True)
        del bad["b2"]
    before = {name: t.clone() for name, t in layer.state_dict().items()}
    with pytest.raises(moe_ops.MoEArgumentError):
        layer.load_weights(**bad)
    after = layer.state_dict()
    assert set(after) == set(before)
    for name, t in after.items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name


# ---------------------------------------------------------------------------------------------
# Forward before load_weights; devices
# ---------------------------------------------------------------------------------------------
def test_forward_before_load_weights(gen):
    layer = make_layer(gen, load=False)
    with rejects("weights"):
        layer(tokens(gen), logits(gen))


def test_forward_pre_routed_before_load_weights(gen):
    layer = make_layer(gen, load=False)
    ids, w = topk(gen)
    with rejects("weights"):
        layer(tokens(gen), topk_ids=ids, topk_weights=w)


# Tensors on different devices: "meta" stands in for a second device (the checks read only
# metadata, so they run before anything touches data).
def test_router_logits_on_another_device(gen):
    layer = make_layer(gen)
    with rejects("router_logits"):
        layer(tokens(gen), logits(gen).to("meta"))


def test_hidden_states_on_another_device_than_the_weights(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    x = tokens(gen).to("meta")
    with rejects("w13"):
        layer(x, topk_ids=ids.to("meta"), topk_weights=w.to("meta"))


def test_topk_ids_on_another_device(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("topk_ids"):
        layer(tokens(gen), topk_ids=ids.to("meta"), topk_weights=w)


def test_topk_weights_on_another_device(gen):
    layer = make_layer(gen)
    ids, w = topk(gen)
    with rejects("topk_weights"):
        layer(tokens(gen), topk_ids=ids, topk_weights=w.to("meta"))


def test_routing_bias_on_another_device(gen):
    with rejects("routing_bias"):
        moe_ops.route(logits(gen, e=8), 2, routing="deepseek_v3", n_group=2, topk_group=1,
                      routing_bias=torch.randn(8, generator=gen).to("meta"))


def test_kernel_scale_on_another_device(gen):
    weights = moe_ops.prepare_weights(quant="fp8", dtype=DTYPE, **ckpt(gen))
    weights["w2_scale"] = weights["w2_scale"].to("meta")
    with rejects("w2_scale"):
        moe_ops.fused_moe(tokens(gen), logits(gen), **weights, top_k=K, quant="fp8")


# ---------------------------------------------------------------------------------------------
# Kernel-layout scales in the functional API
# ---------------------------------------------------------------------------------------------
def test_fused_moe_missing_kernel_scale(gen):
    weights = moe_ops.prepare_weights(quant="fp8_block", dtype=DTYPE, **ckpt(gen))
    del weights["w13_scale"]
    with rejects("w13_scale"):
        moe_ops.fused_moe(tokens(gen), logits(gen), **weights, top_k=K, quant="fp8_block")


def test_fused_moe_kernel_scale_shape(gen):
    weights = moe_ops.prepare_weights(quant="nvfp4", dtype=DTYPE, **ckpt(gen))
    weights["w2_global_scale"] = weights["w2_global_scale"][:, :1]
    with rejects("w2_global_scale"):
        moe_ops.fused_moe(tokens(gen), logits(gen), **weights, top_k=K, quant="nvfp4")


def test_fused_moe_scale_given_for_quant_none(gen):
    weights = make_layer(gen).kernel_weights()
    with rejects("w13_scale"):
        moe_ops.fused_moe(tokens(gen), logits(gen), **weights, top_k=K,
                          w13_scale=torch.ones(E, 2 * I))


# ---------------------------------------------------------------------------------------------
# Errors come before any work: the fake (trace time) rejects like the real op
# ---------------------------------------------------------------------------------------------
def test_rejected_under_fake_tensor_mode(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = make_layer(gen)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, rejects("router_logits"):
        layer(mode.from_tensor(tokens(gen, t=5)), mode.from_tensor(logits(gen, t=4)))


# ---------------------------------------------------------------------------------------------
# T = 0
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["none", "fp8", "mxfp4"])
def test_zero_tokens_with_routing(gen, quant):
    layer = make_layer(gen, quant=quant)
    out = layer(tokens(gen, t=0), logits(gen, t=0))
    assert out.shape == (0, H) and out.dtype == DTYPE


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_zero_tokens_pre_routed(gen, id_dtype):
    layer = make_layer(gen)
    out = layer(tokens(gen, t=0), topk_ids=torch.empty(0, K, dtype=id_dtype),
                topk_weights=torch.empty(0, K))
    assert out.shape == (0, H) and out.dtype == DTYPE


def test_zero_tokens_deepseek_routing(gen):
    layer = make_layer(gen, num_experts=8, routing="deepseek_v3", n_group=4, topk_group=2,
                       top_k=3)
    out = layer(tokens(gen, t=0), logits(gen, t=0, e=8))
    assert out.shape == (0, H) and out.dtype == DTYPE


def test_zero_tokens_still_checked(gen):
    """An empty call is not a way around the checks."""
    layer = make_layer(gen)
    with rejects("router_logits"):
        layer(tokens(gen, t=0), logits(gen, t=0, e=E + 1))


def test_non_contiguous_kernel_weights_are_rejected(gen):
    """The kernels address kernel-layout tensors as dense arrays: a strided view would be read
    wrong, so it is refused by name (the values here are the layer's own)."""
    layer = make_layer(gen)
    weights = layer.kernel_weights()
    ids, w = topk(gen)
    x = tokens(gen)
    # the same call with the contiguous tensors first: a passed validation is remembered per
    # signature, which must tell the strided view apart
    moe_ops.fused_moe(x, topk_ids=ids, topk_weights=w, **weights)
    wide = torch.cat([weights["w2"], weights["w2"]], dim=2)
    weights["w2"] = wide[:, :, : weights["w2"].shape[2]]
    with rejects("w2"):
        moe_ops.fused_moe(x, topk_ids=ids, topk_weights=w, **weights)


@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_prequantized_fp8_weight_of_wrong_shape_names_it_and_changes_nothing(gen, quant):
    layer = make_layer(gen, quant=quant)
    before = {name: p.clone() for name, p in layer.named_parameters()}
    kw = ckpt(gen, e=E, gated=True, bias=False)
    prepared = {}
    for name in ("w1", "w2", "w3"):
        values, scale = (q.quantize_fp8_per_tensor if quant == "fp8" else q.quantize_fp8_block)(kw[name])
        prepared[name], prepared[name + "_scale"] = values, scale
    prepared["w2"] = prepared["w2"][:, :-1]  # one hidden row short
    with rejects("w2"):
        layer.load_weights(**prepared)
    for name, p in layer.named_parameters():
        assert torch.equal(p.view(torch.uint8) if p.element_size() == 1 else p,
                           before[name].view(torch.uint8) if p.element_size() == 1 else before[name])


@pytest.mark.parametrize("name", ["b3", "w3_global_scale"])
def test_relu2_refuses_up_projection_tensors(gen, name):
    layer = make_layer(gen, load=False, activation="relu2", bias=True)
    kw = ckpt(gen, e=E, gated=False, bias=True)
    kw[name] = torch.ones(E, I) if name == "b3" else torch.ones(E)
    with rejects(name):
        layer.load_weights(**kw)


def test_global_scale_refused_where_the_format_has_none(gen):
    layer = make_layer(gen, load=False, quant="fp8")
    kw = ckpt(gen, e=E, gated=True, bias=False)
    with rejects("w1_global_scale"):
        layer.load_weights(**kw, w1_global_scale=torch.ones(E))


@pytest.mark.parametrize("name, value", [("MOE_OPS_PDL", "off"),
                                         ("MOE_OPS_ACT_QUANT_SLICE_K", "wide")])
def test_mistyped_kernel_switch_names_its_variable(name, value):
    """The kernels' environment switches are read at import and checked there: a mistyped value
    raises a ValueError naming the variable instead of silently meaning the default."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, **{name: value})
    result = subprocess.run([sys.executable, "-c", "import moe_ops.kernels.experts"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "ValueError" in result.stderr and name in result.stderr, result.stderr[-2000:]
