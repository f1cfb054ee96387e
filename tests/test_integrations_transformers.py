"""moe_ops as a Hugging Face transformers experts implementation (SPEC §2, last bullet).

Small random models built from config classes (nothing is downloaded): logits with
experts_implementation="moe_ops" equal "eager" for every experts variant transformers declares
(concatenated / interleaved gate-up, transposed weights, biases, no gate), weight updates after
the first forward are picked up, and what moe_ops cannot compute is refused by name.
"""
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moe_ops.integrations.transformers as moe_hf  # noqa: E402

moe_hf.register()

VOCAB = 128
SMALL = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB)


def _classes(module: str, config: str, model: str):
    try:
        package = importlib.import_module(f"transformers.models.{module}")
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        return getattr(package, config), getattr(modeling, model)
    except (ImportError, AttributeError):
        return None


# name -> (module, config class, model class, config kwargs); models missing from the installed
# transformers are skipped.
MODELS = {
    # concatenated gate/up [E, 2I, H], silu
    "mixtral": ("mixtral", "MixtralConfig", "MixtralForCausalLM",
                dict(SMALL, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    # concatenated, exact gelu -> geglu
    "mixtral_gelu": ("mixtral", "MixtralConfig", "MixtralForCausalLM",
                     dict(SMALL, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                          hidden_act="gelu")),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(SMALL, intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                       num_experts_per_tok=3, head_dim=16, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(SMALL, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         routed_scaling_factor=2.5)),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
              dict(SMALL, intermediate_size=48, num_experts=4, num_experts_per_tok=2)),
    # interleaved gate/up, transposed [E, H, 2I], biases, clamped swiglu (alpha/limit)
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
                dict(SMALL, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                     head_dim=16, layer_types=["full_attention"])),
    # concatenated, transposed, biases, clamped swiglu
    "privacy_filter": ("openai_privacy_filter", "OpenAIPrivacyFilterConfig",
                       "OpenAIPrivacyFilterForTokenClassification",
                       dict(SMALL, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                            head_dim=16, num_labels=5, pad_token_id=0,
                            eos_token_id=1)),
    # transposed [E, H, 2I] / [E, I, H] without biases (transformers >= 5.2x declares it)
    "aria_text": ("aria", "AriaTextConfig", "AriaTextForCausalLM",
                  dict(SMALL, intermediate_size=48, moe_num_experts=4, moe_topk=2,
                       moe_num_shared_experts=1, pad_token_id=0, eos_token_id=1)),
    # no gate: up_proj [E, I, H], relu2
    "nemotron_h": ("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM",
                   dict(hidden_size=64, vocab_size=VOCAB, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16,
                        layers_block_type=["full_attention", "moe"],
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1,
                        use_mamba_kernels=False)),
}


def _experts_modules(model):
    return [m for m in model.modules()
            if hasattr(m, "down_proj") and isinstance(getattr(m, "down_proj"), torch.nn.Parameter)]


def _randomize(model, seed=0):
    """HF init leaves the experts' contribution tiny; make it dominate the logits, and the
    routing diverse, so a wrong expert computation shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for experts in _experts_modules(model):
            for name, p in experts.named_parameters(recurse=False):
                std = 0.5 if name.endswith("bias") else 0.15
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, p in model.named_parameters():
            if ("router" in name or ".gate." in name) and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g))


def _build(name, dtype=torch.float32):
    module, config_name, model_name, kwargs = MODELS[name]
    classes = _classes(module, config_name, model_name)
    if classes is None:
        pytest.skip(f"{model_name} is not in this transformers")
    config_cls, model_cls = classes
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    experts = _experts_modules(model)
    if not experts or not hasattr(type(experts[0]).forward, "__wrapped__"):
        pytest.skip(f"{model_name} does not use @use_experts_implementation here")
    _randomize(model)
    for experts in _experts_modules(model):
        if hasattr(experts, "limit"):  # gpt-oss style: alpha/limit live on the module
            experts.alpha, experts.limit = 1.25, 1.5  # non-defaults, and a clamp that is reached
    return model.to(dtype)


def _logits(model, implementation, ids):
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_eager(name):
    model = _build(name)
    experts = _experts_modules(model)[0]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, "eager", ids)
    ours = _logits(model, "moe_ops", ids)
    assert _rel(ours, eager) <= 1e-4
    spec = experts.__dict__[moe_hf._SPEC_ATTR]
    expected = {"gpt_oss": ("swiglu_oai", False, True, True),
                "privacy_filter": ("swiglu_oai", True, True, True),
                "nemotron_h": ("relu2", True, False, False),
                "mixtral_gelu": ("geglu", True, False, False),
                "aria_text": ("swiglu", True, getattr(experts, "is_transposed", False), False),
                }.get(name, ("swiglu", True, False, False))
    assert (spec.activation, spec.concatenated, spec.transposed, spec.has_bias) == expected
    if spec.activation == "swiglu_oai":  # read from the module, not the defaults
        assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.25, 1.5)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_bf16_logits_match_eager(name):
    model = _build(name, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    assert _rel(_logits(model, "moe_ops", ids), _logits(model, "eager", ids)) <= 1e-2


def test_from_config_keyword():
    classes = _classes("mixtral", "MixtralConfig", "MixtralForCausalLM")
    config_cls, model_cls = classes
    model = model_cls._from_config(config_cls(**MODELS["mixtral"][3]), experts_implementation="moe_ops")
    assert model.config._experts_implementation == "moe_ops"
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids)
    assert moe_hf._CACHE_ATTR in _experts_modules(model)[0].__dict__


def test_weight_changes_are_picked_up():
    model = _build("gpt_oss")
    experts = _experts_modules(model)[0]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))

    def check():
        assert _rel(_logits(model, "moe_ops", ids), _logits(model, "eager", ids)) <= 1e-4

    check()
    entry = experts.__dict__[moe_hf._CACHE_ATTR]
    _logits(model, "moe_ops", ids)
    assert experts.__dict__[moe_hf._CACHE_ATTR] is entry  # cached, not redone
    with torch.no_grad():  # in place (an RL weight sync, load_state_dict): _version changes
        experts.down_proj.mul_(-1.5)
        experts.gate_up_proj_bias.add_(0.3)
    check()
    experts.gate_up_proj = torch.nn.Parameter(torch.randn_like(experts.gate_up_proj) * 0.15)
    check()  # a new parameter object
    model.load_state_dict({k: v * 0.5 if "experts" in k else v
                           for k, v in model.state_dict().items()})
    check()
    experts.down_proj.data.copy_(torch.randn_like(experts.down_proj) * 0.15)  # bypasses _version
    moe_hf.invalidate(model)
    check()


def test_token_shapes_are_flattened_and_restored():
    model = _build("qwen3_moe")
    experts = _experts_modules(model)[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 64, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(10)]).view(2, 5, 3)
    w = torch.rand(2, 5, 3, generator=g)
    experts.config._experts_implementation = "eager"
    expected = experts(x.view(10, 64), ids.view(10, 3), w.view(10, 3))
    out = moe_hf.experts_forward(experts, x, ids, w)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _rel(out.view(10, 64), expected) <= 1e-5
    empty = moe_hf.experts_forward(experts, x[:0], ids[:0], w[:0])
    assert empty.shape == (0, 5, 64)


def test_training_backward_raises():
    model = _build("mixtral")
    model.set_experts_implementation("moe_ops")
    ids = torch.randint(0, VOCAB, (1, 5))
    loss = model(input_ids=ids).logits.sum()
    with pytest.raises(NotImplementedError, match="inference-only"):
        loss.backward()


def _unsupported_experts(name, **config):
    """A lone experts module of the installed transformers (skip if it is not there)."""
    mixtral = _classes("mixtral", "MixtralConfig", "MixtralExperts")
    if name == "gelu_tanh" and mixtral:
        cfg = mixtral[0](**dict(MODELS["mixtral"][3], hidden_act="gelu_pytorch_tanh"))
        return mixtral[1](cfg), "gelu_pytorch_tanh"
    if name == "nemotron_silu":
        classes = _classes("nemotron_h", "NemotronHConfig", "NemotronHExperts")
        if classes:
            cfg = classes[0](**dict(MODELS["nemotron_h"][3], mlp_hidden_act="silu"))
            return classes[1](cfg), "mlp_hidden_act='silu'"
    if name == "clamped_silu":  # DeepSeek-V4 / HY-V4 style: silu(clamp(gate)) * clamp(up)
        class ClampedSilu(mixtral[1]):
            limit = 3.0

            def _apply_gate(self, gate_up):
                gate, up = gate_up.chunk(2, dim=-1)
                return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)
        return ClampedSilu(mixtral[0](**MODELS["mixtral"][3])), "ClampedSilu._apply_gate"
    pytest.skip(f"no {name} experts class here")


@pytest.mark.parametrize("name", ["gelu_tanh", "nemotron_silu", "clamped_silu"])
def test_unsupported_activation_is_refused_by_name(name):
    experts, named = _unsupported_experts(name)
    experts.config._experts_implementation = "moe_ops"
    x = torch.randn(4, 64)
    ids = torch.tensor([[0, 1]] * 4)
    with pytest.raises(NotImplementedError, match=named):
        experts(x, ids, torch.full((4, 2), 0.5))


def test_post_expert_norm_is_refused():
    classes = _classes("mixtral", "MixtralConfig", "MixtralExperts")
    experts = classes[1](classes[0](**MODELS["mixtral"][3]))
    experts.has_post_expert_norm = True
    with pytest.raises(NotImplementedError, match="post_expert_norm"):
        moe_hf.experts_forward(experts, torch.randn(2, 64), torch.tensor([[0, 1]] * 2),
                               torch.ones(2, 2))


def _prepared(experts):
    return {name: t for name, t in experts.named_buffers(recurse=False)
            if name.startswith(moe_hf.BUFFER_PREFIX)}


def test_prepared_weights_are_non_persistent_buffers_updated_in_place():
    model = _build("gpt_oss")
    experts = _experts_modules(model)[0]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    _logits(model, "moe_ops", ids)
    buffers = _prepared(experts)
    roles = {"w13", "w2", "b13", "b2"}
    assert set(buffers) == {moe_hf.buffer_name(r) for r in roles} | {
        moe_hf.buffer_name(r) + "_permutation" for r in roles}
    assert not any(moe_hf.BUFFER_PREFIX in k for k in model.state_dict())
    addresses = {n: t.data_ptr() for n, t in buffers.items()}
    w2_before = buffers[moe_hf.buffer_name("w2")].clone()
    with torch.no_grad():  # an in-place weight sync
        experts.down_proj.mul_(-1.5)
        experts.gate_up_proj.add_(0.01)
    assert _rel(_logits(model, "moe_ops", ids), _logits(model, "eager", ids)) <= 1e-4
    after = _prepared(experts)
    assert {n: t.data_ptr() for n, t in after.items()} == addresses  # refilled in place
    w2 = after[moe_hf.buffer_name("w2")]
    torch.testing.assert_close(w2, w2_before * -1.5)
    # .to() moves the buffers with the module (meta stands in for another device here)
    moved = experts.to("meta")
    assert all(t.device.type == "meta" for t in _prepared(moved).values())


def test_buffers_replaced_on_dtype_change():
    model = _build("mixtral")
    experts = _experts_modules(model)[0]
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    _logits(model, "moe_ops", ids)
    assert experts.moe_ops_w13.dtype == torch.float32
    model.to(torch.bfloat16)
    assert experts.moe_ops_w13.dtype == torch.bfloat16  # cast by .to(), then refilled
    assert _rel(_logits(model, "moe_ops", ids), _logits(model, "eager", ids)) <= 1e-2
    assert experts.moe_ops_w13.dtype == torch.bfloat16
    torch.testing.assert_close(
        experts.moe_ops_w13[:, 0::2], experts.gate_up_proj[:, :experts.moe_ops_w13.shape[1] // 2])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_generate_matches_eager(name):
    model = _build(name)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    tokens = {}
    for implementation in ("eager", "moe_ops"):
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            tokens[implementation] = model.generate(ids, **kwargs)
    assert tokens["moe_ops"].shape == (2, 11)
    assert torch.equal(tokens["moe_ops"], tokens["eager"])


def _compile(model):
    """torch.compile(fullgraph=True, backend="aot_eager"), keeping the Dynamo graphs."""
    from torch._dynamo.backends.registry import lookup_backend
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, inputs)
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend=backend), graphs


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_compile_fullgraph_matches_eager(name):
    model = _build(name)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(9))
    eager = _logits(model, "eager", ids)
    _logits(model, "moe_ops", ids)  # one eager forward prepares the kernel-layout buffers
    compiled, graphs = _compile(model)
    with torch.no_grad():
        ours = compiled(input_ids=ids).logits.float()
    assert _rel(ours, eager) <= 1e-4
    code = graphs[0].code  # the experts run on moe_ops, from the buffers (no re-layout)
    assert len(graphs) == 1 and "torch.ops.moe_ops.fused_experts" in code
    assert "moe_ops_w13" in code and "index_copy" not in code


def test_refresh_updates_compiled_model_in_place():
    model = _build("gpt_oss")
    experts = _experts_modules(model)[0]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(10))
    _logits(model, "moe_ops", ids)
    compiled, graphs = _compile(model)
    with torch.no_grad():
        compiled(input_ids=ids)
    addresses = {n: t.data_ptr() for n, t in _prepared(experts).items()}
    with torch.no_grad():  # an RL weight sync, then refresh: no forward needed, same addresses
        experts.down_proj.mul_(-1.5)
        experts.gate_up_proj_bias.add_(0.3)
    assert moe_hf.refresh(model) == 1 and moe_hf.refresh(model) == 0
    assert {n: t.data_ptr() for n, t in _prepared(experts).items()} == addresses
    with torch.no_grad():
        ours = compiled(input_ids=ids).logits.float()
    assert len(graphs) == 1  # no recompilation
    assert _rel(ours, _logits(model, "eager", ids)) <= 1e-4
    experts.down_proj.data.mul_(0.5)  # bypasses _version: invalidate, then refresh
    moe_hf.invalidate(model)
    assert moe_hf.refresh(model) == 1
    model.set_experts_implementation("moe_ops")
    with torch.no_grad():
        ours = compiled(input_ids=ids).logits.float()
    assert _rel(ours, _logits(model, "eager", ids)) <= 1e-4


def test_prepare_allows_fullgraph_without_an_eager_forward():
    model = _build("qwen3_moe")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(11))
    eager = _logits(model, "eager", ids)
    model.set_experts_implementation("moe_ops")
    assert moe_hf.prepare(model) == 1
    assert _prepared(_experts_modules(model)[0])
    compiled, graphs = _compile(model)
    with torch.no_grad():
        ours = compiled(input_ids=ids).logits.float()
    assert _rel(ours, eager) <= 1e-4 and "index_copy" not in graphs[0].code


# ---------------------------------------------------------------------------------------------
# Fine-grained FP8 experts (transformers' FP8Experts, 128x128 block scales) -> quant="fp8_block"
# ---------------------------------------------------------------------------------------------
def _fp8_api():
    try:
        from transformers.integrations import finegrained_fp8
        from transformers.integrations.moe import use_experts_implementation
    except Exception:  # noqa: BLE001
        pytest.skip("this transformers has no fine-grained FP8 experts registry")
    if not hasattr(finegrained_fp8, "FP8ExpertsInterface"):
        pytest.skip("this transformers has no FP8ExpertsInterface")
    return finegrained_fp8, use_experts_implementation


FP8_SMALL = dict(SMALL, hidden_size=128)
FP8_MODELS = {
    "mixtral": ("mixtral", "MixtralConfig", "MixtralForCausalLM",
                dict(FP8_SMALL, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(FP8_SMALL, intermediate_size=96, moe_intermediate_size=128, num_experts=6,
                       num_experts_per_tok=3, head_dim=32, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MODELS["deepseek_v3"][3], hidden_size=128, moe_intermediate_size=128)),
}


def _quantize_blocks(w, scale_fmt, block=(128, 128)):
    """Random weights -> (float8 values, block scales) as a fine-grained FP8 checkpoint holds
    them; ue8m0 scales are powers of two (DeepSeek-V3.1/V4 style)."""
    from moe_ops import quant as q
    values, scale = q.quantize_fp8_block(w, block[0]) if block[0] == block[1] else (None, None)
    if values is None:  # non-square blocks: per-block amax by hand
        e, n, k = w.shape
        blocks = w.float().view(e, n // block[0], block[0], k // block[1], block[1])
        scale = blocks.abs().amax(dim=(2, 4)) / 448
        values = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).view(e, n, k).to(q.FP8_DTYPE)
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        full = scale.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
        values = (w.float() / full).clamp(-448, 448).to(q.FP8_DTYPE)
        scale = scale.to(torch.float8_e8m0fnu)
    return values, scale


def _dynamic_fp8_linear(self, x, weight, scale_inv, activation_scale=None):
    """What transformers' fine-grained FP8 linear computes (dynamic activations quantized per
    token per 128 columns, block-scaled weights), in plain torch: its Triton/DeepGEMM kernels
    come from the hub and do not run on CPU."""
    from moe_ops import quant as q
    n, k = weight.shape
    bn, bk = self.block_size
    w = weight.float() * scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    rows = x.reshape(-1, k)
    xq, xs = q.quantize_fp8_per_token_group(rows, bk)
    xd = xq.float() * xs.repeat_interleave(bk, dim=1)[:, :k]
    return torch.nn.functional.linear(xd, w).to(x.dtype).view(*x.shape[:-1], n)


def _fp8_experts(config, *, block=(128, 128), scale_fmt="float", scheme="dynamic", seed=0):
    """An FP8Experts module built as transformers' replace_with_fp8_linear builds it, filled with
    quantized random weights, its linear replaced by the plain-torch emulation."""
    import types
    fp8, use_experts_implementation = _fp8_api()
    cls = use_experts_implementation(experts_class=fp8.FP8Experts,
                                     experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    experts = cls(config=config, block_size=block, activation_scheme=scheme, scale_fmt=scale_fmt,
                  has_bias=False, has_gate=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            values, scale = _quantize_blocks(torch.randn(weight.shape, generator=g) * 0.15,
                                             scale_fmt, block)
            weight.copy_(values)
            getattr(experts, name + "_scale_inv").copy_(scale)
    experts.linear = types.MethodType(_dynamic_fp8_linear, experts)
    return experts


def _build_fp8(name, dtype):
    module, config_name, model_name, kwargs = FP8_MODELS[name]
    classes = _classes(module, config_name, model_name)
    if classes is None:
        pytest.skip(f"{model_name} is not in this transformers")
    torch.manual_seed(0)
    model = classes[1](classes[0](**kwargs)).eval()
    _randomize(model)
    model = model.to(dtype)  # before the swap: .to(dtype) would cast the float8 weights too
    swapped = 0
    for module_name, sub in list(model.named_modules()):
        if module_name.endswith(".experts") and hasattr(type(sub).forward, "__wrapped__"):
            model.set_submodule(module_name, _fp8_experts(sub.config, seed=swapped))
            swapped += 1
    assert swapped
    return model


def test_register_adds_moe_ops_to_the_fp8_experts_registry():
    fp8, _ = _fp8_api()
    assert "moe_ops" in fp8.ALL_FP8_EXPERTS_FUNCTIONS


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_experts_match_transformers_dynamic_fp8(scale_fmt):
    config = transformers.MixtralConfig(**FP8_MODELS["mixtral"][3])
    experts = _fp8_experts(config, scale_fmt=scale_fmt)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(33, 128, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(33)])
    w = torch.rand(33, 2, generator=g)
    experts.config._experts_implementation = "eager"
    # float32 activations: both sides quantize the same float32 values, so they agree exactly
    expected = experts(x, ids, w)
    ours = moe_hf.experts_forward(experts, x, ids, w, backend="reference")
    assert _rel(ours, expected) <= 1e-5
    spec = experts.__dict__[moe_hf._SPEC_ATTR]
    assert (spec.quant, spec.activation, spec.concatenated) == ("fp8_block", "swiglu", True)
    buffers = _prepared(experts)
    assert buffers[moe_hf.buffer_name("w13")].dtype == torch.float8_e4m3fn
    assert buffers[moe_hf.buffer_name("w13_scale")].shape == (4, 2, 1)  # gate, up blocks interleaved
    # bf16 activations: the intermediate is rounded differently on the two sides (bf16 there,
    # float32 until stored here), which moves a few requantized e4m3 steps
    xb = x.bfloat16()
    assert _rel(moe_hf.experts_forward(experts, xb, ids, w, backend="reference").float(),
                experts(xb, ids, w).float()) <= 3e-2


@pytest.mark.parametrize("name", list(FP8_MODELS))
def test_fp8_model_logits_match_transformers_dynamic_fp8(name):
    model = _build_fp8(name, torch.float32)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(13))
    eager = _logits(model, "eager", ids)  # transformers' FP8Experts loop (emulated linear)
    ours = _logits(model, "moe_ops", ids)
    assert _rel(ours, eager) <= 1e-4
    experts = [m for m in model.modules() if moe_hf._SPEC_ATTR in m.__dict__]
    assert experts and all(m.__dict__[moe_hf._SPEC_ATTR].quant == "fp8_block" for m in experts)
    # and against the dequantized weights with unquantized activations: fp8 accuracy
    for m in experts:
        m.linear = lambda x, w, s, activation_scale=None, m=m: torch.nn.functional.linear(
            x, w.float() * s.float().repeat_interleave(128, 0).repeat_interleave(128, 1))
    assert _rel(ours, _logits(model, "eager", ids)) <= 0.1


def test_fp8_bf16_model_prepare_and_compile():
    model = _build_fp8("mixtral", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(14))
    eager = _logits(model, "eager", ids)
    model.set_experts_implementation("moe_ops")
    assert moe_hf.prepare(model) == 1
    compiled, graphs = _compile(model)
    with torch.no_grad():
        ours = compiled(input_ids=ids).logits.float()
    assert _rel(ours, eager) <= 3e-2
    assert "torch.ops.moe_ops.fused_experts" in graphs[0].code and "index_copy" not in graphs[0].code
    experts = next(m for m in model.modules() if moe_hf._SPEC_ATTR in m.__dict__)
    with torch.no_grad():  # a weight sync of the fp8 values and scales: refresh picks it up
        experts.down_proj_scale_inv.mul_(2)
    assert moe_hf.refresh(model) == 1
    with torch.no_grad():
        again = compiled(input_ids=ids).logits.float()
    assert _rel(again, _logits(model, "eager", ids)) <= 3e-2 and _rel(again, ours) > 1e-3


@pytest.mark.parametrize("case,why", [
    (dict(block=(64, 64)), "weight_block_size"),
    (dict(scheme="static"), "activation_scheme='static'"),
    (dict(intermediate=64), "multiples of 128"),
])
def test_fp8_experts_moe_ops_cannot_map_fall_back_with_one_warning(case, why):
    kwargs = dict(FP8_MODELS["mixtral"][3])
    if "intermediate" in case:
        kwargs["intermediate_size"] = case.pop("intermediate")
    config = transformers.MixtralConfig(**kwargs)
    first, second = _fp8_experts(config, seed=0, **case), _fp8_experts(config, seed=1, **case)
    moe_hf._WARNED_FALLBACKS.clear()
    g = torch.Generator().manual_seed(15)
    x = torch.randn(5, 128, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    with pytest.warns(UserWarning, match=why) as record:
        for experts in (first, second, first):
            experts.config._experts_implementation = "moe_ops"
            out = experts(x, ids, w)  # transformers' own FP8Experts forward
            experts.config._experts_implementation = "eager"
            torch.testing.assert_close(out, experts(x, ids, w))
    assert len([r for r in record if "moe_ops" in str(r.message)]) == 1
    assert moe_hf.prepare(first) == 0  # skipped, not raised
