"""The torch.library ops of moe_ops (torch.ops.moe_ops.*): schemas, fakes, opcheck.

- `torch.library.opcheck` with all its default checks (test_schema, test_autograd_registration,
  test_faketensor, test_aot_dispatch_dynamic) on every op, for several quant modes, activations
  and routing methods, with non-contiguous inputs and T = 0 and T = 1.
- Fake vs real: for drawn shapes and configs, every output of every op has the same shape,
  dtype, stride and device under FakeTensorMode as when run for real.
- Every op of SCHEMAS has a fake, and the namespace holds no op outside SCHEMAS.

No module-level import here may import triton (torch._dynamo and torch.testing's optests do):
Triton must be imported after the kernel tests set TRITON_INTERPRET=1, and pytest imports every
test module before running any test. torch.library.opcheck imports optests lazily.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._library import simple_registry
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

import moe_ops
from moe_ops.ops import SCHEMAS

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_ROLES = ("w13", "w2", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale",
                "b13", "b2")
ALL_OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                     "test_aot_dispatch_dynamic")


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------
def make_weights(gen, *, quant="none", activation="swiglu", bias=False, dtype=torch.bfloat16,
                 num_experts=4, hidden=64, intermediate=32):
    """Random checkpoint weights -> the kernel-layout tuple the ops take (8 entries)."""
    e, h, i = num_experts, hidden, intermediate

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    ckpt = dict(w1=rnd(e, i, h), w2=rnd(e, h, i))
    if activation != "relu2":
        ckpt["w3"] = rnd(e, i, h)
    if bias:
        ckpt.update(b1=rnd(e, i), b2=rnd(e, h))
        if activation != "relu2":
            ckpt["b3"] = rnd(e, i)
    prepared = moe_ops.prepare_weights(quant=quant, activation=activation, dtype=dtype, **ckpt)
    return tuple(prepared.get(role) for role in WEIGHT_ROLES)


def make_hidden(gen, tokens, hidden, dtype, layout="contiguous"):
    """hidden_states [T, H] in one of three memory layouts (always fresh random values)."""
    if layout == "column_slice":  # a column slice of a wider tensor: row stride H + 5
        return (torch.randn(tokens, hidden + 5, generator=gen).to(dtype))[:, 3:3 + hidden]
    if layout == "transposed":  # a transposed-contiguous view: strides (1, T)
        return torch.randn(hidden, tokens, generator=gen).to(dtype).t()
    return torch.randn(tokens, hidden, generator=gen).to(dtype)


def make_logits(gen, tokens, num_experts, dtype, layout="contiguous"):
    if layout == "transposed":
        return torch.randn(num_experts, tokens, generator=gen).to(dtype).t()
    if layout == "strided":  # every other column of a [T, 2E] tensor
        return torch.randn(tokens, 2 * num_experts, generator=gen).to(dtype)[:, ::2]
    return torch.randn(tokens, num_experts, generator=gen).to(dtype)


def make_topk(gen, tokens, top_k, num_experts, id_dtype, layout="contiguous", invalid=True):
    """Distinct ids per token (plus -1 and out-of-range ids when `invalid`) and float32 weights."""
    ids = torch.stack([torch.randperm(num_experts + 2, generator=gen)[:top_k]
                       for _ in range(tokens)]) if tokens else torch.empty(0, top_k, dtype=torch.long)
    if invalid:  # num_experts -> -1 (padding), num_experts + 1 stays out of range
        ids = torch.where(ids == num_experts, torch.full_like(ids, -1), ids)
    else:
        ids = ids % num_experts
    ids = ids.to(id_dtype)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    if layout == "transposed":
        ids, weights = ids.t().contiguous().t(), weights.t().contiguous().t()
    elif layout == "strided":
        ids = torch.stack((ids, torch.zeros_like(ids)), dim=-1)[..., 0]  # stride (2k, 2)
        weights = torch.stack((weights, torch.zeros_like(weights)), dim=-1)[..., 0]
    return ids, weights


def route_args(logits, method, top_k, routing_bias=None, n_group=0, topk_group=0, scale=1.0,
               backend="auto"):
    return (logits, method, top_k, routing_bias, n_group, topk_group, scale, backend)


def experts_args(x, ids, weights, w, activation="swiglu", quant="none", offset=0,
                 backend="auto"):
    return (x, ids, weights, *w, activation, quant, 1.702, 7.0, offset, backend)


def moe_args(x, logits, w, method="renormalize", top_k=2, routing_bias=None, n_group=0,
             topk_group=0, scale=1.0, activation="swiglu", quant="none", offset=0,
             backend="auto"):
    return (x, logits, *w, method, top_k, routing_bias, n_group, topk_group, scale, activation,
            quant, 1.702, 7.0, offset, backend)


def _fp8_aware_allclose(original):
    """torch.allclose that compares float8 tensors bit for bit (it has no float8 kernel on CPU).

    opcheck's test_schema compares every input before and after the call with torch.allclose
    to detect undeclared mutation, which raises NotImplementedError on float8 tensors. Comparing
    their bytes is the stricter check of the same promise."""
    def allclose(lhs, rhs, *args, **kwargs):
        if isinstance(lhs, torch.Tensor) and lhs.dtype in FP8_DTYPES:
            return torch.equal(lhs.contiguous().view(torch.uint8), rhs.contiguous().view(torch.uint8))
        return original(lhs, rhs, *args, **kwargs)
    return allclose


def run_opcheck(op, args, monkeypatch):
    monkeypatch.setattr(torch, "allclose", _fp8_aware_allclose(torch.allclose))
    result = torch.library.opcheck(op, args)  # default test_utils: all four checks
    assert set(result) == set(ALL_OPCHECK_UTILS)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.fixture
def gen(request):
    # A per-test seed that is stable across runs (str hash is salted per process).
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------
def test_namespace_holds_exactly_the_ops_of_schemas():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("moe_ops::")}
    assert registered == set(SCHEMAS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_op_has_a_fake_registered(name):
    entry = simple_registry.singleton.find(f"moe_ops::{name}")
    assert entry.fake_impl.kernel is not None, f"moe_ops::{name} has no fake implementation"
    # And it is what FakeTensorMode runs: a Meta-device call goes through the same machinery.
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_ops::{name}", "Meta")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_matches_the_registered_op(name):
    schema = getattr(torch.ops.moe_ops, name).default._schema
    assert str(schema) == f"moe_ops::{SCHEMAS[name]}"


# ---------------------------------------------------------------------------------------------
# opcheck: route
# ---------------------------------------------------------------------------------------------
ROUTE_CASES = [
    # (method, top_k, n_group, topk_group, logits dtype, layout, tokens)
    ("renormalize", 2, 0, 0, torch.float32, "contiguous", 9),
    ("default", 3, 0, 0, torch.bfloat16, "transposed", 9),
    ("renormalize_naive", 2, 0, 0, torch.float16, "strided", 9),
    ("sigmoid_renorm", 2, 0, 0, torch.bfloat16, "contiguous", 9),
    ("topk", 4, 0, 0, torch.float32, "transposed", 9),
    ("llama4", 1, 0, 0, torch.bfloat16, "strided", 9),
    ("deepseek_v3", 3, 4, 2, torch.float32, "transposed", 9),
    ("renormalize", 2, 0, 0, torch.bfloat16, "contiguous", 1),
    ("deepseek_v3", 2, 2, 1, torch.bfloat16, "contiguous", 1),
    ("renormalize", 2, 0, 0, torch.float32, "contiguous", 0),
    ("deepseek_v3", 2, 4, 2, torch.float32, "transposed", 0),
]


@pytest.mark.parametrize("method,top_k,n_group,topk_group,dtype,layout,tokens", ROUTE_CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_opcheck_route(gen, monkeypatch, method, top_k, n_group, topk_group, dtype, layout, tokens):
    num_experts = 8
    logits = make_logits(gen, tokens, num_experts, dtype, layout)
    bias = torch.randn(num_experts, generator=gen) if method == "deepseek_v3" else None
    run_opcheck(torch.ops.moe_ops.route.default,
                route_args(logits, method, top_k, bias, n_group, topk_group, 2.5), monkeypatch)


# ---------------------------------------------------------------------------------------------
# opcheck: align_tokens
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("id_dtype,layout,tokens,offset,block_m", [
    (torch.int32, "contiguous", 11, 0, 4),
    (torch.int64, "transposed", 11, 2, 16),
    (torch.int32, "strided", 11, 1, 1),
    (torch.int64, "contiguous", 1, 0, 64),
    (torch.int32, "strided", 0, 0, 16),
], ids=lambda v: str(v).removeprefix("torch."))
def test_opcheck_align_tokens(gen, monkeypatch, id_dtype, layout, tokens, offset, block_m):
    ids, _ = make_topk(gen, tokens, 3, 6, id_dtype, layout)
    run_opcheck(torch.ops.moe_ops.align_tokens.default, (ids, 4, offset, block_m, "auto"),
                monkeypatch)


# ---------------------------------------------------------------------------------------------
# opcheck: fused_experts and fused_moe
# ---------------------------------------------------------------------------------------------
EXPERTS_CASES = [
    # (quant, activation, bias, dtype, hidden layout, topk layout, id dtype, tokens)
    ("none", "swiglu", False, torch.bfloat16, "column_slice", "transposed", torch.int32, 7),
    ("none", "relu2", False, torch.float32, "transposed", "strided", torch.int64, 7),
    ("none", "swiglu_oai", True, torch.float16, "contiguous", "contiguous", torch.int32, 7),
    ("fp8", "swiglu", False, torch.bfloat16, "transposed", "strided", torch.int64, 7),
    ("fp8_block", "geglu", False, torch.float16, "column_slice", "contiguous", torch.int32, 7),
    ("nvfp4", "swiglu", False, torch.bfloat16, "contiguous", "transposed", torch.int32, 7),
    ("mxfp4", "swiglu_oai", True, torch.bfloat16, "column_slice", "contiguous", torch.int64, 7),
    ("fp8", "relu2", False, torch.float32, "contiguous", "contiguous", torch.int32, 1),
    ("none", "swiglu", False, torch.bfloat16, "column_slice", "strided", torch.int32, 1),
    ("none", "swiglu", False, torch.bfloat16, "contiguous", "contiguous", torch.int32, 0),
    ("mxfp4", "swiglu", False, torch.bfloat16, "column_slice", "contiguous", torch.int64, 0),
]


@pytest.mark.parametrize("quant,activation,bias,dtype,x_layout,topk_layout,id_dtype,tokens",
                         EXPERTS_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_opcheck_fused_experts(gen, monkeypatch, quant, activation, bias, dtype, x_layout,
                               topk_layout, id_dtype, tokens):
    w = make_weights(gen, quant=quant, activation=activation, bias=bias, dtype=dtype)
    x = make_hidden(gen, tokens, 64, dtype, x_layout)
    ids, weights = make_topk(gen, tokens, 2, 4, id_dtype, topk_layout)
    run_opcheck(torch.ops.moe_ops.fused_experts.default,
                experts_args(x, ids, weights, w, activation, quant), monkeypatch)


MOE_CASES = [
    # (quant, activation, method, top_k, n_group, topk_group, dtype, x layout, logits layout, T)
    ("none", "swiglu", "renormalize", 2, 0, 0, torch.bfloat16, "transposed", "strided", 6),
    ("fp8", "geglu", "deepseek_v3", 2, 2, 1, torch.bfloat16, "column_slice", "transposed", 6),
    ("fp8_block", "swiglu", "default", 3, 0, 0, torch.float32, "contiguous", "contiguous", 6),
    ("nvfp4", "relu2", "sigmoid_renorm", 2, 0, 0, torch.float16, "column_slice", "strided", 6),
    ("mxfp4", "swiglu", "llama4", 1, 0, 0, torch.bfloat16, "transposed", "contiguous", 6),
    ("none", "swiglu_oai", "topk", 2, 0, 0, torch.float32, "column_slice", "contiguous", 1),
    ("none", "swiglu", "renormalize_naive", 2, 0, 0, torch.bfloat16, "contiguous", "transposed", 0),
]


@pytest.mark.parametrize("quant,activation,method,top_k,n_group,topk_group,dtype,x_layout,"
                         "logits_layout,tokens", MOE_CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_opcheck_fused_moe(gen, monkeypatch, quant, activation, method, top_k, n_group,
                           topk_group, dtype, x_layout, logits_layout, tokens):
    w = make_weights(gen, quant=quant, activation=activation, bias=activation == "swiglu_oai",
                     dtype=dtype)
    x = make_hidden(gen, tokens, 64, dtype, x_layout)
    logits = make_logits(gen, tokens, 4, torch.bfloat16, logits_layout)
    bias = torch.randn(4, generator=gen) if method == "deepseek_v3" else None
    run_opcheck(torch.ops.moe_ops.fused_moe.default,
                moe_args(x, logits, w, method, top_k, bias, n_group, topk_group, 1.5, activation,
                         quant), monkeypatch)


def test_opcheck_fused_moe_expert_parallel_shard(gen, monkeypatch):
    """A shard holding experts 2..3 of 6: routing runs over all 6, the op over the local 2."""
    w = make_weights(gen, num_experts=2)
    x = make_hidden(gen, 5, 64, torch.bfloat16, "column_slice")
    logits = make_logits(gen, 5, 6, torch.float32, "transposed")
    run_opcheck(torch.ops.moe_ops.fused_moe.default, moe_args(x, logits, w, top_k=3, offset=2),
                monkeypatch)


def test_opcheck_autograd_registration_with_inputs_requiring_grad(gen):
    """opcheck's test_autograd_registration only runs when an input requires grad."""
    w = make_weights(gen, dtype=torch.float32)
    x = make_hidden(gen, 5, 64, torch.float32).requires_grad_()
    logits = make_logits(gen, 5, 4, torch.float32).requires_grad_()
    result = torch.library.opcheck(torch.ops.moe_ops.fused_moe.default, moe_args(x, logits, w),
                                   test_utils="test_autograd_registration",
                                   raise_exception=False)
    assert result["test_autograd_registration"] == "SUCCESS", result


def test_backward_raises_on_every_backend_path(gen):
    """The ops are inference-only: a backward through them says so instead of returning
    gradients on one backend and none on another."""
    w = make_weights(gen, dtype=torch.float32)
    x = make_hidden(gen, 5, 64, torch.float32).requires_grad_()
    logits = make_logits(gen, 5, 4, torch.float32)
    out = torch.ops.moe_ops.fused_moe(*moe_args(x, logits, w))
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="inference-only"):
        out.sum().backward()
    with torch.inference_mode():
        assert not torch.ops.moe_ops.fused_moe(*moe_args(x.detach(), logits, w)).requires_grad


# ---------------------------------------------------------------------------------------------
# Fake vs real, for drawn shapes and configurations
# ---------------------------------------------------------------------------------------------
def run_fake_and_real(op, args):
    real = op(*args)
    mode = FakeTensorMode()
    fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode:
        fake = op(*fake_args)
    real_flat, fake_flat = pytree.tree_leaves(real), pytree.tree_leaves(fake)
    assert len(real_flat) == len(fake_flat)
    for index, (r, f) in enumerate(zip(real_flat, fake_flat)):
        where = f"{op}: output {index}"
        assert tuple(f.shape) == tuple(r.shape), where
        assert f.dtype == r.dtype, where
        assert f.stride() == r.stride(), f"{where}: fake stride {f.stride()} != real {r.stride()}"
        assert f.device == r.device, where
    return real


ROUTING_CONFIGS = st.sampled_from([
    ("renormalize", None), ("default", None), ("renormalize_naive", None),
    ("sigmoid_renorm", None), ("topk", None), ("llama4", None), ("deepseek_v3", None)])
LAYOUTS_X = st.sampled_from(["contiguous", "column_slice", "transposed"])
LAYOUTS_2D = st.sampled_from(["contiguous", "transposed", "strided"])
FLOATS = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
FAKE_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routing_config(draw, num_experts):
    method = draw(st.sampled_from(moe_ops.ROUTING_METHODS))
    n_group = topk_group = 0
    if method == "llama4":
        top_k = 1
    elif method == "deepseek_v3":
        n_group = draw(st.sampled_from([g for g in (1, 2, 4) if num_experts % g == 0
                                        and num_experts // g >= 2]))
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, topk_group * (num_experts // n_group)))
    else:
        top_k = draw(st.integers(1, num_experts))
    return method, top_k, n_group, topk_group


@FAKE_SETTINGS
@given(data=st.data(), tokens=st.integers(0, 40), num_experts=st.sampled_from([2, 4, 6, 8]),
       dtype=FLOATS, layout=LAYOUTS_2D, seed=st.integers(0, 2**16))
def test_fake_matches_real_route(data, tokens, num_experts, dtype, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    method, top_k, n_group, topk_group = data.draw(routing_config(num_experts))
    logits = make_logits(gen, tokens, num_experts, dtype, layout)
    bias = (torch.randn(num_experts, generator=gen)
            if method == "deepseek_v3" and data.draw(st.booleans()) else None)
    run_fake_and_real(torch.ops.moe_ops.route.default,
                      route_args(logits, method, top_k, bias, n_group, topk_group, 1.0))


@FAKE_SETTINGS
@given(tokens=st.integers(0, 40), top_k=st.integers(1, 4), num_local=st.integers(1, 6),
       offset=st.integers(0, 3), block_m=st.sampled_from([1, 2, 16, 64]),
       id_dtype=st.sampled_from([torch.int32, torch.int64]), layout=LAYOUTS_2D,
       seed=st.integers(0, 2**16))
def test_fake_matches_real_align_tokens(tokens, top_k, num_local, offset, block_m, id_dtype,
                                        layout, seed):
    gen = torch.Generator().manual_seed(seed)
    ids, _ = make_topk(gen, tokens, top_k, num_local + offset + 2, id_dtype, layout)
    run_fake_and_real(torch.ops.moe_ops.align_tokens.default,
                      (ids, num_local, offset, block_m, "auto"))


@st.composite
def expert_config(draw):
    quant = draw(st.sampled_from(moe_ops.QUANT_MODES))
    activation = draw(st.sampled_from(moe_ops.ACTIVATIONS))
    fp4 = quant in ("nvfp4", "mxfp4")
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16] if fp4 else
                                 [torch.bfloat16, torch.float16, torch.float32]))
    hidden = draw(st.sampled_from([32, 64] if fp4 else [8, 24, 64, 136]))
    intermediate = draw(st.sampled_from([32, 64] if fp4 else [8, 16, 40]))
    bias = draw(st.booleans())
    return quant, activation, dtype, hidden, intermediate, bias


@FAKE_SETTINGS
@given(config=expert_config(), tokens=st.integers(0, 33), num_experts=st.integers(1, 5),
       x_layout=LAYOUTS_X, topk_layout=LAYOUTS_2D,
       id_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**16),
       data=st.data())
def test_fake_matches_real_fused_experts(config, tokens, num_experts, x_layout, topk_layout,
                                         id_dtype, seed, data):
    quant, activation, dtype, hidden, intermediate, bias = config
    gen = torch.Generator().manual_seed(seed)
    top_k = data.draw(st.integers(1, num_experts + 2))
    w = make_weights(gen, quant=quant, activation=activation, bias=bias, dtype=dtype,
                     num_experts=num_experts, hidden=hidden, intermediate=intermediate)
    x = make_hidden(gen, tokens, hidden, dtype, x_layout)
    ids, weights = make_topk(gen, tokens, top_k, num_experts, id_dtype, topk_layout)
    out = run_fake_and_real(torch.ops.moe_ops.fused_experts.default,
                            experts_args(x, ids, weights, w, activation, quant))
    assert out.shape == (tokens, hidden) and out.dtype == dtype


@FAKE_SETTINGS
@given(config=expert_config(), tokens=st.integers(0, 33), num_experts=st.sampled_from([2, 4, 6]),
       x_layout=LAYOUTS_X, logits_layout=LAYOUTS_2D, logits_dtype=FLOATS,
       seed=st.integers(0, 2**16), data=st.data())
def test_fake_matches_real_fused_moe(config, tokens, num_experts, x_layout, logits_layout,
                                     logits_dtype, seed, data):
    quant, activation, dtype, hidden, intermediate, bias = config
    gen = torch.Generator().manual_seed(seed)
    method, top_k, n_group, topk_group = data.draw(routing_config(num_experts))
    num_local = data.draw(st.integers(1, num_experts))
    offset = data.draw(st.integers(0, num_experts - num_local))
    w = make_weights(gen, quant=quant, activation=activation, bias=bias, dtype=dtype,
                     num_experts=num_local, hidden=hidden, intermediate=intermediate)
    x = make_hidden(gen, tokens, hidden, dtype, x_layout)
    logits = make_logits(gen, tokens, num_experts, logits_dtype, logits_layout)
    routing_bias = torch.randn(num_experts, generator=gen) if method == "deepseek_v3" else None
    out = run_fake_and_real(torch.ops.moe_ops.fused_moe.default,
                            moe_args(x, logits, w, method, top_k, routing_bias, n_group,
                                     topk_group, 1.0, activation, quant, offset))
    assert out.shape == (tokens, hidden) and out.dtype == dtype


def test_fake_checks_arguments_like_the_real_op(gen):
    """A bad call fails at trace time with the same error as the real op (no silent fake)."""
    w = make_weights(gen)
    x = make_hidden(gen, 3, 64, torch.bfloat16)
    logits = make_logits(gen, 3, 4, torch.float32)
    args = moe_args(x, logits, w, top_k=5)  # top_k > num_experts
    with pytest.raises(moe_ops.MoEArgumentError, match="top_k") as real:
        torch.ops.moe_ops.fused_moe(*args)
    mode = FakeTensorMode()
    fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode, pytest.raises(moe_ops.MoEArgumentError, match="top_k") as fake:
        torch.ops.moe_ops.fused_moe(*fake_args)
    assert str(fake.value) == str(real.value)


# ---------------------------------------------------------------------------------------------
# Fake vs real on the Triton backend (the kernels, in the Triton interpreter on CPU)
# ---------------------------------------------------------------------------------------------
TRITON_FAKE_SCRIPT = textwrap.dedent("""
    import json, os, sys, traceback
    import torch
    import moe_ops
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import _pytree as pytree

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    E, H, I = 4, 64, 32
    problems = {"route": [], "align_tokens": [], "fused_experts": []}

    def check(name, args):
        args = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), args)
        try:
            real = getattr(torch.ops.moe_ops, name).default(*args)
            mode = FakeTensorMode()
            fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
            with mode:
                fake = getattr(torch.ops.moe_ops, name).default(*fake_args)
            for i, (r, f) in enumerate(zip(pytree.tree_leaves(real), pytree.tree_leaves(fake))):
                got = (tuple(f.shape), str(f.dtype), f.stride())
                want = (tuple(r.shape), str(r.dtype), r.stride())
                if got != want:
                    problems[name].append(f"output {i}: fake {got} != real {want}")
        except Exception:
            problems[name].append(traceback.format_exc(limit=3))

    for tokens in (0, 1, 5, 33):
        for layout in ("contiguous", "transposed"):
            if layout == "contiguous":
                logits = torch.randn(tokens, E, generator=gen)
            else:
                logits = torch.randn(E, tokens, generator=gen).t()
            for method, k, n_group, topk_group in (("renormalize", 2, 0, 0),
                                                   ("deepseek_v3", 2, 2, 1),
                                                   ("llama4", 1, 0, 0)):
                bias = torch.randn(E, generator=gen) if method == "deepseek_v3" else None
                check("route", (logits.bfloat16(), method, k, bias, n_group, topk_group, 1.0,
                                "triton"))
            ids, weights = moe_ops.route(logits.to(device), 2)
            ids, weights = ids.cpu(), weights.cpu()
            check("align_tokens", (ids.t().contiguous().t(), E, 0, 16, "triton"))
            for quant, activation in (("none", "swiglu"), ("fp8", "relu2"), ("fp8_block", "swiglu")):
                ckpt = dict(w1=torch.randn(E, I, H, generator=gen) * 0.2,
                            w2=torch.randn(E, H, I, generator=gen) * 0.2)
                if activation != "relu2":
                    ckpt["w3"] = torch.randn(E, I, H, generator=gen) * 0.2
                w = moe_ops.prepare_weights(quant=quant, activation=activation,
                                            dtype=torch.bfloat16, **ckpt)
                roles = ("w13", "w2", "w13_scale", "w2_scale", "w13_global_scale",
                         "w2_global_scale", "b13", "b2")
                x = torch.randn(tokens, H + 3, generator=gen).bfloat16()[:, :H]
                check("fused_experts", (x, ids, weights, *[w.get(r) for r in roles],
                                        activation, quant, 1.702, 7.0, 0, "triton"))
    print("RESULT " + json.dumps(problems))
""")


@pytest.fixture(scope="module")
def triton_fake_problems(tmp_path_factory):
    """Runs the checks in a fresh process: TRITON_INTERPRET must be set before triton is
    imported, which this pytest process cannot guarantee."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET")
    script = tmp_path_factory.mktemp("triton_fake") / "check.py"
    script.write_text(TRITON_FAKE_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("name", [
    "route",
    "fused_experts",
    "align_tokens",
])
def test_fake_matches_real_on_triton_backend(triton_fake_problems, name):
    assert not triton_fake_problems[name], "\n".join(triton_fake_problems[name])
