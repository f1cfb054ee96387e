"""moe_ops.layout (SPEC §5): the permutation cache and its key, the permutation buffers of a
FusedMoE, in-place weight reloads that recompute nothing, prepare_weights, state_dict."""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import moe_ops
from float64_moe import QUANTS, allowed_dtypes, quantize_checkpoint, random_checkpoint
from moe_ops import layout

BASE_KEY = layout.LayoutKey(role="w13", source_rows=(8, 8), row_shape=(16,), dtype="bfloat16",
                            packing="none", interleave_rows=1, rows_per_entry=1,
                            layout_version=layout.LAYOUT_VERSION, device="cpu")

# One changed value per LayoutKey component; the test fails if a component is added without one.
VARIANTS = {
    "role": ["w2", "w13_scale"],
    "source_rows": [(12, 12), (8,)],
    "row_shape": [(32,), ()],
    "dtype": ["float8_e4m3fn", "uint8"],
    "packing": ["e2m1x2"],
    "interleave_rows": [0, 2, 3],
    "rows_per_entry": [128],
    "layout_version": [layout.LAYOUT_VERSION + 1],
    "device": ["meta"],
}


def _expected_destination(source_rows: tuple, interleave: int) -> list[int]:
    """Where each source row lands, written out row by row (chunks of `interleave` gate rows
    followed by as many up rows; concatenation when interleave is 0 or there is one source)."""
    if interleave == 0 or len(source_rows) == 1:
        return list(range(sum(source_rows)))
    gate, up = source_rows
    assert gate == up
    layout_rows = []  # (source, row) in kernel order
    for start in range(0, gate, interleave):
        stop = min(start + interleave, gate)
        layout_rows += [(0, r) for r in range(start, stop)] + [(1, r) for r in range(start, stop)]
    where = {src_row: i for i, src_row in enumerate(layout_rows)}
    return [where[(0, r)] for r in range(gate)] + [where[(1, r)] for r in range(up)]


def test_every_key_component_gives_its_own_cache_entry():
    assert set(VARIANTS) == {f.name for f in dataclasses.fields(layout.LayoutKey)}
    layout.clear_permutation_cache()
    base = layout.row_permutation(BASE_KEY)
    for name, values in VARIANTS.items():
        for value in values:
            key = dataclasses.replace(BASE_KEY, **{name: value})
            assert key != BASE_KEY
            before = layout.permutation_computations
            index = layout.row_permutation(key)
            assert layout.permutation_computations == before + 1, f"{name}={value!r} hit the cache"
            assert layout.row_permutation(key) is index  # and is cached itself
            assert layout.permutation_computations == before + 1
            assert index.dtype == torch.int64 and index.device == torch.device(key.device)
            if key.device != "meta":
                expected = _expected_destination(key.source_rows, key.interleave_rows)
                assert index.tolist() == expected, f"{name}={value!r}"
                if name in ("interleave_rows", "source_rows"):  # the index depends on these
                    assert index.tolist() != base.tolist(), f"{name}={value!r}"
    assert layout.row_permutation(BASE_KEY) is base


@pytest.mark.parametrize("rows, interleave", [(7, 1), (8, 2), (9, 4), (130, 128), (5, 8)])
def test_destination_rows_are_the_interleave(rows, interleave):
    key = dataclasses.replace(BASE_KEY, source_rows=(rows, rows), interleave_rows=interleave)
    index = layout.row_permutation(key)
    assert index.tolist() == _expected_destination((rows, rows), interleave)
    assert sorted(index.tolist()) == list(range(2 * rows))


def _all_configs():
    for quant, activation, bias in itertools.product(QUANTS, ("swiglu", "relu2"), (False, True)):
        yield quant, activation, bias


def test_plan_layout_keys_separate_configs():
    """Across configurations, a role whose layout differs never shares a key; a key holds the
    device, and within one plan every role has its own key."""
    seen: dict = {}
    for (quant, activation, bias), (h, i), device in itertools.product(
            _all_configs(), ((64, 96), (96, 64), (256, 256)), ("cpu", "meta")):
        for dtype in allowed_dtypes(quant):
            specs = layout.plan_layout(quant=quant, activation=activation, num_local_experts=3,
                                       hidden_size=h, intermediate_size=i, bias=bias, dtype=dtype,
                                       device=device)
            assert len({s.key for s in specs.values()}) == len(specs)
            for role, spec in specs.items():
                assert spec.key.role == role and spec.key.device == device
                # Everything that decides the tensor's layout is in its key.
                layout_facts = (role, spec.shape[1:], spec.dtype, spec.key.interleave_rows)
                previous = seen.setdefault(spec.key, layout_facts)
                assert previous == layout_facts, (spec.key, previous, layout_facts)


# ---------------------------------------------------------------------------------------------
# The layer's buffers
# ---------------------------------------------------------------------------------------------
def _layer(quant="none", activation="swiglu", bias=False, routing="renormalize", e=4, h=64, i=64,
           dtype=torch.bfloat16, **kwargs):
    extra = dict(n_group=2, topk_group=1) if routing == "deepseek_v3" else {}
    return moe_ops.FusedMoE(e, h, i, 2, routing=routing, activation=activation, quant=quant,
                            bias=bias, dtype=dtype, backend="reference", **extra, **kwargs)


def _checkpoint(gen, quant, activation, bias, e=4, h=64, i=64, prequantized=False,
                dtype=torch.bfloat16):
    ckpt = random_checkpoint(gen, e, h, i, activation=activation, bias=bias, dtype=dtype)
    return quantize_checkpoint(ckpt, quant) if prequantized else ckpt


@pytest.mark.parametrize("quant", QUANTS)
def test_permutations_are_non_persistent_buffers(quant):
    layer = _layer(quant, bias=True)
    buffers = dict(layer.named_buffers())
    params = dict(layer.named_parameters())
    state = layer.state_dict()
    assert set(params) >= {"w13", "w2"}
    for role in params:
        name = f"{role}_permutation"
        assert name in buffers, name
        assert buffers[name].dtype == torch.int64
        assert buffers[name].numel() == params[role].shape[1]
        assert name not in state
        assert role in state
    assert not [k for k in state if k.endswith("_permutation")]
    layer.to("meta")
    assert all(b.device.type == "meta" for b in layer.buffers())
    assert all(p.device.type == "meta" for p in layer.parameters())


@pytest.mark.parametrize("quant, prequantized",
                         [(q, p) for q in QUANTS for p in (False, True) if q != "none" or not p])
@pytest.mark.parametrize("activation", ("swiglu", "relu2"))
def test_reload_is_in_place_and_computes_no_index(quant, activation, prequantized):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    layer = _layer(quant, activation, bias=True)
    layer.load_weights(**_checkpoint(gen, quant, activation, True, prequantized=prequantized))
    addresses = {n: p.data_ptr() for n, p in layer.named_parameters()}
    old = {n: p.detach().clone() for n, p in layer.named_parameters()}
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    logits = torch.randn(9, 4, generator=gen)

    new = _checkpoint(gen, quant, activation, True, prequantized=prequantized)
    before = layout.permutation_computations
    layer.load_weights(**new)
    assert layout.permutation_computations == before, "load_weights recomputed an index"
    for name, p in layer.named_parameters():
        assert p.data_ptr() == addresses[name], f"{name} was reallocated"
        assert not torch.equal(p.view(torch.uint8), old[name].view(torch.uint8)), f"{name} unchanged"
    # The new values are exactly those of a fresh preparation and of a fresh layer.
    prepared = moe_ops.prepare_weights(quant=quant, activation=activation, **new)
    for role, tensor in prepared.items():
        assert torch.equal(tensor.view(torch.uint8), getattr(layer, role).view(torch.uint8)), role
    fresh = _layer(quant, activation, bias=True)
    fresh.load_weights(**new)
    assert torch.equal(layer(x, logits), fresh(x, logits))


def test_second_layer_of_same_config_hits_the_cache():
    layout.clear_permutation_cache()
    before = layout.permutation_computations
    first = _layer("fp8_block", bias=True, h=200, i=136)
    computed = layout.permutation_computations - before
    assert computed == len(list(first.parameters()))  # one index per role (none cached yet)
    second = _layer("fp8_block", bias=True, h=200, i=136)
    assert layout.permutation_computations == before + computed
    for name, buffer in first.named_buffers():
        assert torch.equal(buffer, dict(second.named_buffers())[name])
    # A different shape is a different entry.
    _layer("fp8_block", bias=True, h=200, i=264)
    assert layout.permutation_computations > before + computed


@pytest.mark.parametrize("quant, activation, bias", list(_all_configs()))
def test_prepare_weights_equals_layer_parameters(quant, activation, bias):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    dtype = random.choice(allowed_dtypes(quant))
    for prequantized in (False, True):
        ckpt = _checkpoint(gen, quant, activation, bias, h=160, i=96, dtype=dtype,
                           prequantized=prequantized)
        layer = _layer(quant, activation, bias, h=160, i=96, dtype=dtype)
        layer.load_weights(**ckpt)
        prepared = moe_ops.prepare_weights(quant=quant, activation=activation, dtype=dtype, **ckpt)
        assert set(prepared) == set(dict(layer.named_parameters())) == set(layer.kernel_weights())
        for role, tensor in prepared.items():
            p = getattr(layer, role)
            assert tensor.shape == p.shape and tensor.dtype == p.dtype, role
            assert torch.equal(tensor.view(torch.uint8), p.view(torch.uint8)), role


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("routing", ("renormalize", "deepseek_v3"))
def test_state_dict_round_trip(quant, routing):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    layer = _layer(quant, "swiglu_oai", bias=True, routing=routing)
    extra = {"routing_bias": torch.randn(4, generator=gen)} if routing == "deepseek_v3" else {}
    layer.load_weights(**_checkpoint(gen, quant, "swiglu_oai", True), **extra)
    fresh = _layer(quant, "swiglu_oai", bias=True, routing=routing)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(17, 64, generator=gen).to(torch.bfloat16)
    logits = torch.randn(17, 4, generator=gen)
    out = layer(x, logits)
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    assert torch.equal(fresh(x, logits), out)
    for name, p in layer.named_parameters():
        assert torch.equal(p.view(torch.uint8), getattr(fresh, name).view(torch.uint8)), name
    if routing == "deepseek_v3":
        assert torch.equal(fresh.routing_bias, extra["routing_bias"])
