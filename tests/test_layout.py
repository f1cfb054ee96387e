"""moe_ops.layout (SPEC §5): the permutation cache and its key, the permutation buffers of a
FusedMoE, in-place weight reloads that recompute nothing, prepare_weights, state_dict."""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import random

import pytest
import torch

import moe_ops
from float64_moe import QUANTS, allowed_dtypes, quantize_checkpoint, random_checkpoint
from moe_ops import layout
from moe_ops import quant as q

BASE_KEY = layout.LayoutKey(role="w13", source_rows=(8, 8), row_shape=(16,), dtype="bfloat16",
                            packing="none", interleave_rows=1, rows_per_entry=1,
                            layout_version=layout.LAYOUT_VERSION, device="cpu")

# One changed value per LayoutKey component; the test fails if a component is added without one.
VARIANTS = {
    "role": ["w2", "w13_scale"],
    "source_rows": [(12, 12), (8,)],
    "row_shape": [(32,), ()],
    "dtype": ["float8_e4m3fn", "uint8"],
    "packing": ["e2m1x2-kernel", "padded"],
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
                dtype=torch.bfloat16, boost=None):
    """boost: expert 0's weights times it (mxfp4: 2^20 gives e8m0 bytes past 128, which the
    layout folds into its row scales)."""
    ckpt = random_checkpoint(gen, e, h, i, activation=activation, bias=bias, dtype=dtype)
    if boost is not None:
        for name in ("w1", "w2", "w3"):
            if ckpt.get(name) is not None:
                ckpt[name][0] *= boost
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

    # (mxfp4: the second checkpoint's expert 0 has scales past 2, so its row scales change)
    new = _checkpoint(gen, quant, activation, True, prequantized=prequantized,
                      boost=2.0 ** 20 if quant == "mxfp4" else None)
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


# ---------------------------------------------------------------------------------------------
# Situations where a cache keyed too coarsely hands out a wrong layout (FlashInfer keyed its
# permutation cache by shape alone). Each builds layers and checks every kernel-layout tensor
# against the layout written out by hand from the checkpoint, so a shared entry that carries
# another layout's index is caught by value, and checks that the entries are distinct.
# ---------------------------------------------------------------------------------------------
def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, R, ...] gate and up -> [E, 2R, ...] with row 2r = gate r, 2r+1 = up r (by hand)."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _fp4_kernel_order_by_hand(packed: torch.Tensor) -> torch.Tensor:
    """Natural packed rows [..., K/2] -> the kernel order, from its definition (quant.py):
    K padded with zero codes to Kp (a multiple of 256); byte t*Kp/8 + 2c + q holds codes
    16c + 2t + q (low nibble) and 16c + 2t + q + 8 (high nibble); then bit i of each
    little-endian 32-bit word moves to bit quant.FP4_WORD_BITS[i]."""
    k = packed.shape[-1] * 2
    kp = -(-k // 256) * 256
    codes = torch.zeros(*packed.shape[:-1], kp, dtype=torch.uint8)
    codes[..., 0:k:2] = packed & 15
    codes[..., 1:k:2] = packed >> 4
    t = torch.arange(4)[:, None, None]
    c = torch.arange(kp // 16)[None, :, None]
    q_ = torch.arange(2)[None, None, :]
    position = (t * (kp // 8) + 2 * c + q_).flatten()
    low = (16 * c + 2 * t + q_).flatten()
    out = torch.full((*packed.shape[:-1], kp // 2), 255, dtype=torch.uint8)
    out[..., position] = codes[..., low] | (codes[..., low + 8] << 4)
    words = out.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    permuted = torch.zeros_like(words)
    for i, bit in enumerate(q.FP4_WORD_BITS):
        permuted |= ((words >> i) & 1) << bit
    return permuted.to(torch.int32).view(torch.uint8).view(out.shape)


def _fp4_padded_scales_by_hand(scale: torch.Tensor, block: int) -> torch.Tensor:
    k = scale.shape[-1] * block
    kp = -(-k // 256) * 256
    raw = torch.zeros(*scale.shape[:-1], kp // block, dtype=torch.uint8)
    raw[..., :scale.shape[-1]] = scale.view(torch.uint8)
    return raw.view(scale.dtype)


def _layout_by_hand(ckpt: dict, quant: str, gated: bool, dtype=torch.bfloat16) -> dict:
    """The kernel layout of a pre-quantized (or quant='none') checkpoint, written out directly."""
    def per_row(name, rows):  # per-expert scalars the layout repeats on every row
        return ckpt[name][:, None].expand(-1, rows).float()

    def pair(name, fn=lambda n: ckpt[n]):
        return _interleave(fn(name + "1"), fn(name + "3")) if gated else fn(name + "1")

    rows_13, rows_2 = ckpt["w1"].shape[1], ckpt["w2"].shape[1]
    out = {"w13": pair("w"), "w2": ckpt["w2"]}
    if quant == "none":
        out = {k: v.to(dtype) for k, v in out.items()}
    if quant in ("fp8", "nvfp4"):
        key = "_scale" if quant == "fp8" else "_global_scale"
        out["w13" + key] = pair("w", lambda n: per_row(n + key, rows_13))
        out["w2" + key] = per_row("w2" + key, rows_2)
    if quant in ("fp8_block", "nvfp4", "mxfp4"):
        out["w13_scale"] = pair("w", lambda n: ckpt[n + "_scale"])
        out["w2_scale"] = ckpt["w2_scale"]
    if quant in ("nvfp4", "mxfp4"):
        block = 16 if quant == "nvfp4" else 32
        out["w13"], out["w2"] = (_fp4_kernel_order_by_hand(out[r]) for r in ("w13", "w2"))
        out["w13_scale"], out["w2_scale"] = (_fp4_padded_scales_by_hand(out[r], block)
                                             for r in ("w13_scale", "w2_scale"))
    if quant == "mxfp4":
        # each row's bytes past 128 folded into a row scale 2^excess
        for r in ("w13", "w2"):
            s = out[r + "_scale"].long()
            excess = (s.max(dim=-1).values - 128).clamp(min=0)
            out[r + "_scale"] = (s - excess[..., None]).clamp(min=0).to(torch.uint8)
            out[r + "_global_scale"] = (2.0 ** excess).float()
    if "b1" in ckpt:
        out["b13"] = pair("b", lambda n: ckpt[n].float())
        out["b2"] = ckpt["b2"].float()
    return out


def _assert_layout(tensors: dict, ckpt: dict, quant: str, gated: bool, what: str = "") -> None:
    expected = _layout_by_hand(ckpt, quant, gated)
    assert set(tensors) == set(expected), what
    for role, tensor in tensors.items():
        want = expected[role]
        assert tensor.shape == want.shape and tensor.dtype == want.dtype, (what, role)
        assert torch.equal(tensor.view(torch.uint8), want.contiguous().view(torch.uint8)), (what, role)


def _prequantized(gen, quant, activation, e, h, i, bias=False):
    # (mxfp4: expert 0's scales past 2, folded by the layout)
    return _checkpoint(gen, quant, activation, bias, e=e, h=h, i=i, prequantized=quant != "none",
                       boost=2.0 ** 20 if quant == "mxfp4" else None)


def _check_same_shaped_w13_and_w2(quant: str, gen: torch.Generator) -> None:
    """H == I: w1 [E, I, H] and w2 [E, H, I] have the same shape; non-gated, the kernel-layout
    w13 and w2 too. Each keeps its own layout, whichever is built first."""
    for activation in ("swiglu", "relu2"):
        for order in (0, 1):
            layout.clear_permutation_cache()
            ckpt = _prequantized(gen, quant, activation, 3, 64, 64, bias=True)
            layer = _layer(quant, activation, bias=True, e=3, h=64, i=64)
            specs = layout.plan_layout(quant=quant, activation=activation, num_local_experts=3,
                                       hidden_size=64, intermediate_size=64, bias=True,
                                       dtype=torch.bfloat16, device="cpu")
            roles = sorted(specs, reverse=bool(order))
            for role in roles:  # fill the cache in this order, then build
                layout.row_permutation(specs[role].key)
            layer.load_weights(**ckpt)
            _assert_layout(layer.kernel_weights(), ckpt, quant, activation != "relu2",
                           f"{quant} {activation} order {order}")
            assert len(layout._PERMUTATION_CACHE) == len(specs)


def _check_gated_and_not_gated_same_w13_shape(quant: str, gen: torch.Generator) -> None:
    """Gated with I and non-gated with 2I have the same w13 shape [E, 2I, H] (and the same
    w13_scale shape): interleaved in one, concatenated (identity) in the other."""
    for first in ("swiglu", "relu2"):
        layout.clear_permutation_cache()
        for activation in (first, "relu2" if first == "swiglu" else "swiglu"):
            i = 64 if activation == "swiglu" else 128
            ckpt = _prequantized(gen, quant, activation, 2, 256, i)
            layer = _layer(quant, activation, e=2, h=256, i=i)
            assert layer.w13.shape[1] == 128
            layer.load_weights(**ckpt)
            _assert_layout(layer.kernel_weights(), ckpt, quant, activation == "swiglu",
                           f"{quant} {activation} after {first}")


def _check_payload_scale_and_block_sizes(gen: torch.Generator) -> None:
    """Payload and scale tensors of one layer, and the block-scale tensor of one layer against
    the payload of another whose row count is the scale's: fp8_block I = 128m has m scale rows
    per source, a quant='none' layer with I = m has m payload rows; nvfp4/mxfp4 payload and
    scale tensors have the same rows (only the row shape and dtype differ)."""
    layout.clear_permutation_cache()
    block = _layer("fp8_block", e=2, h=384, i=256)
    small = _layer("none", e=2, h=256, i=2)  # w13 has 2 + 2 rows, as fp8_block's w13_scale
    assert block.w13_scale.shape[1] == small.w13.shape[1] == 4
    for layer, quant, h, i in ((block, "fp8_block", 384, 256), (small, "none", 256, 2)):
        ckpt = _prequantized(gen, quant, "swiglu", 2, h, i)
        layer.load_weights(**ckpt)
        _assert_layout(layer.kernel_weights(), ckpt, quant, True, quant)
    for quant in ("nvfp4", "mxfp4", "fp8_block", "fp8"):
        layer = _layer(quant, e=2, h=128, i=128)
        ckpt = _prequantized(gen, quant, "swiglu", 2, 128, 128)
        layer.load_weights(**ckpt)
        _assert_layout(layer.kernel_weights(), ckpt, quant, True, quant)
        keys = [getattr(layout.plan_layout(quant=quant, activation="swiglu", num_local_experts=2,
                                           hidden_size=128, intermediate_size=128, bias=False,
                                           dtype=torch.bfloat16, device="cpu")[r], "key")
                for r in ("w13", "w13_scale")]
        assert keys[0] != keys[1]
        assert layout.row_permutation(keys[0]) is not layout.row_permutation(keys[1]), quant


def _check_sizes_with_the_same_row_shape(gen: torch.Generator) -> None:
    """Layers that differ only in I: w13 rows have the same shape [H], their counts differ."""
    layout.clear_permutation_cache()
    for i in (64, 128, 32):
        ckpt = _prequantized(gen, "none", "swiglu", 2, 64, i)
        layer = _layer("none", e=2, h=64, i=i)
        layer.load_weights(**ckpt)
        _assert_layout(layer.kernel_weights(), ckpt, "none", True, f"I={i}")


def _check_interleave_granularity(monkeypatch) -> None:
    """Another gate/up interleave granularity (what a different GEMM1 tile would ask for) is
    another index, even for the same tensor shapes."""
    layout.clear_permutation_cache()
    for rows in (1, 4, 2, 1):
        monkeypatch.setattr(layout, "GATE_UP_INTERLEAVE_ROWS", rows)
        key = layout.plan_layout(quant="none", activation="swiglu", num_local_experts=2,
                                 hidden_size=64, intermediate_size=24, bias=False,
                                 dtype=torch.bfloat16, device="cpu")["w13"].key
        assert layout.row_permutation(key).tolist() == _expected_destination((24, 24), rows)


def test_sizes_and_interleave_granularity_get_their_own_entries(monkeypatch):
    _check_sizes_with_the_same_row_shape(torch.Generator().manual_seed(9))
    _check_interleave_granularity(monkeypatch)


@pytest.mark.parametrize("quant", ["none", "fp8_block", "nvfp4", "mxfp4"])
def test_same_shaped_w13_and_w2_keep_their_own_layouts(quant):
    _check_same_shaped_w13_and_w2(quant, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("quant", ["none", "fp8", "fp8_block", "mxfp4"])
def test_gated_and_not_gated_layers_with_the_same_w13_shape(quant):
    _check_gated_and_not_gated_same_w13_shape(quant, torch.Generator().manual_seed(2))


def test_payload_scale_and_scale_block_entries():
    _check_payload_scale_and_block_sizes(torch.Generator().manual_seed(3))


class _CoarseCache(dict):
    """A permutation cache whose key ignores one LayoutKey field (what a too-coarse key does)."""

    def __init__(self, dropped: str):
        super().__init__()
        self.dropped = dropped

    def _coarse(self, key):
        return dataclasses.replace(key, **{self.dropped: BASE_KEY_DEFAULTS[self.dropped]})

    def get(self, key, default=None):
        return super().get(self._coarse(key), default)

    def __setitem__(self, key, value):
        super().__setitem__(self._coarse(key), value)


# A value for every field that no real key has, so that replacing it merges keys.
BASE_KEY_DEFAULTS = dict(role="?", source_rows=(0,), row_shape=(-1,), dtype="?", packing="?",
                         interleave_rows=-1, rows_per_entry=-1, layout_version=-1, device="cpu")


@pytest.mark.parametrize("dropped", [f.name for f in dataclasses.fields(layout.LayoutKey)])
def test_a_key_that_drops_any_field_is_caught(monkeypatch, dropped):
    """The checks above fail if the cache key loses any one of its fields: fields the index
    values depend on (source_rows, interleave_rows, device) give wrong layouts or devices, the
    others merge entries that the distinct-entry assertions catch."""
    assert set(BASE_KEY_DEFAULTS) == {f.name for f in dataclasses.fields(layout.LayoutKey)}
    monkeypatch.setattr(layout, "_PERMUTATION_CACHE", _CoarseCache(dropped))
    gen = torch.Generator().manual_seed(4)
    checks = [test_every_key_component_gives_its_own_cache_entry,
              lambda: _check_same_shaped_w13_and_w2("fp8_block", gen),
              lambda: _check_gated_and_not_gated_same_w13_shape("fp8_block", gen),
              lambda: _check_payload_scale_and_block_sizes(gen)]
    checks += [lambda: _check_sizes_with_the_same_row_shape(gen),
               lambda: _check_interleave_granularity(monkeypatch)]
    failures = 0
    for check in checks:
        try:
            check()
        except AssertionError:
            failures += 1
        except (RuntimeError, IndexError):  # index_copy_ with an index of another length
            failures += 1
    assert failures >= 1, f"no check noticed a cache key without {dropped!r}"
    # Fields the index values depend on: merged entries hand out another layout's index (or
    # one on another device), which the by-hand layouts and index checks catch as such.
    value_check = {"source_rows": checks[4], "interleave_rows": checks[5],
                   "device": checks[0]}.get(dropped)
    if value_check is not None:
        with pytest.raises((AssertionError, RuntimeError, IndexError)):
            value_check()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_indices_stay_right_after_memory_is_released_and_reused(device):
    """The cache holds index tensors, never raw addresses: freeing a layer and allocating other
    data (at the same address, where the allocator hands it out again) leaves every later
    index right, whether the cache was cleared in between or kept."""
    e, h, i = 2, 256, 192
    specs = layout.plan_layout(quant="fp8_block", activation="swiglu", num_local_experts=e,
                               hidden_size=h, intermediate_size=i, bias=False,
                               dtype=torch.bfloat16, device=device)
    expected = {role: _expected_destination(s.key.source_rows, s.key.interleave_rows)
                for role, s in specs.items()}
    gen = torch.Generator().manual_seed(5)
    ckpt = {k: v.to(device) for k, v in _prequantized(gen, "fp8_block", "swiglu", e, h, i).items()}
    for clear in (True, False):
        layout.clear_permutation_cache()
        layer = moe_ops.FusedMoE(e, h, i, 2, quant="fp8_block", device=device, backend="reference")
        freed = {role: layer.get_buffer(f"{role}_permutation").data_ptr() for role in specs}
        del layer
        if clear:
            layout.clear_permutation_cache()
        # Reuse the memory: same-sized allocations, filled with indices of the wrong layout.
        garbage = [torch.full((len(expected[r]),), 3, dtype=torch.int64, device=device)
                   for r in specs for _ in range(4)]
        reused = {g.data_ptr() for g in garbage} & set(freed.values())
        if not clear:
            assert not reused, "a cached index was freed while the cache held it"
        layer = moe_ops.FusedMoE(e, h, i, 2, quant="fp8_block", device=device, backend="reference")
        for role in specs:
            assert layer.get_buffer(f"{role}_permutation").tolist() == expected[role], (clear, role)
        layer.load_weights(**ckpt)
        _assert_layout({k: v.cpu() for k, v in layer.kernel_weights().items()},
                       {k: v.cpu() for k, v in ckpt.items()}, "fp8_block", True, f"clear={clear}")
        del garbage


def test_a_live_layer_reloads_through_its_own_buffers_after_the_cache_is_cleared():
    gen = torch.Generator().manual_seed(6)
    layer = _layer("fp8_block", e=2, h=256, i=192)
    layout.clear_permutation_cache()
    before = layout.permutation_computations
    ckpt = _prequantized(gen, "fp8_block", "swiglu", 2, 256, 192)
    layer.load_weights(**ckpt)
    assert layout.permutation_computations == before
    _assert_layout(layer.kernel_weights(), ckpt, "fp8_block", True)


# ---------------------------------------------------------------------------------------------
# The device preparation kernels (kernels/prepare.py): the same bytes as the reference path.
# On CPU they run in the Triton interpreter (TRITON_INTERPRET=1, set by conftest).
# ---------------------------------------------------------------------------------------------
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(ckpt: dict, quant: str, activation: str, kernels: bool, dtype=torch.bfloat16,
             device=_DEVICE) -> dict:
    """prepare_weights with the path chosen; the outputs start as garbage so that an element
    left unwritten shows."""
    e, i, h = ckpt["w1"].shape
    if quant in ("nvfp4", "mxfp4") and ckpt["w1"].dtype == torch.uint8:
        h *= 2
    config = dict(quant=quant, activation=activation, num_local_experts=e, hidden_size=h,
                  intermediate_size=i, bias=ckpt.get("b1") is not None)
    specs = layout.plan_layout(**config, dtype=dtype, device=device)
    sources = layout.checkpoint_sources(layout.Checkpoint(**ckpt), **config)
    out = layout.allocate(specs, device)
    for tensor in out.values():
        # fp4 padding included: the loads must zero it (the GEMMs read it unmasked)
        tensor.view(torch.uint8).fill_(0xA5)
    layout.load_into(out, sources, {r: layout.row_permutation(s.key) for r, s in specs.items()},
                     kernels=kernels)
    return out


def _assert_same_bytes(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for role in want:
        a, b = got[role].view(torch.uint8), want[role].view(torch.uint8)
        if not torch.equal(a, b):
            where = (a != b).nonzero()[:4].tolist()
            pytest.fail(f"{what} {role}: {int((a != b).sum())} bytes differ, first at {where}")


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the preparation kernels need triton")


@needs_triton
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("prequantized", [False, True])
def test_device_preparation_gives_the_reference_bytes(quant, activation, prequantized):
    if quant == "none" and prequantized:
        pytest.skip("quant='none' has nothing to quantize")
    gen = torch.Generator().manual_seed(QUANTS.index(quant) * 4 + 2 * prequantized
                                        + (activation == "relu2"))
    # Partial fp8 blocks on both axes (160 = 128 + 32, 96 < 128) and two 128-row blocks (w2).
    h, i = 160, 96
    dtype = torch.float16 if quant in ("nvfp4", "mxfp4") else torch.float32
    ckpt = random_checkpoint(gen, 3, h, i, activation=activation, bias=True, dtype=torch.bfloat16)
    ckpt["w1"][0].zero_()  # a zero expert (and zero blocks): scales 0, values 0, never NaN
    if quant == "mxfp4":
        ckpt["w2"][1] *= 2.0 ** 20  # scales past 2: rows the layout folds
    if prequantized:
        ckpt = quantize_checkpoint(ckpt, quant)
    ckpt = {k: v.to(_DEVICE) for k, v in ckpt.items()}
    reference = _prepare(ckpt, quant, activation, kernels=False, dtype=dtype)
    _assert_same_bytes(_prepare(ckpt, quant, activation, kernels=True, dtype=dtype), reference,
                       f"{quant} {activation} prequantized={prequantized}")


@needs_triton
@pytest.mark.parametrize("fused, schedule", [(False, None), (True, "sequential"),
                                             (True, "interleaved")])
def test_nvfp4_device_preparation_paths(monkeypatch, fused, schedule):
    """bf16 -> nvfp4 through `_device_parts` by each of its paths (moe_ops.kernels.prepare's
    NVFP4_FUSED_AMAX, NVFP4_SCHEDULE): the reference's bytes in every role, the per-row global
    scales (taken from the fused kernel's output) included. A zero expert, rows that do not fill
    a tile (96 = 64 + 32), rows padded to 256 columns (160, 96); destinations poisoned."""
    from moe_ops.kernels import prepare

    monkeypatch.setattr(prepare, "NVFP4_FUSED_AMAX", fused)
    if schedule is not None:
        monkeypatch.setattr(prepare, "NVFP4_SCHEDULE", schedule)
    gen = torch.Generator().manual_seed(11)
    ckpt = random_checkpoint(gen, 3, 160, 96, activation="swiglu", bias=False,
                             dtype=torch.bfloat16)
    ckpt["w3"][2].zero_()
    ckpt = {k: v.to(_DEVICE) for k, v in ckpt.items()}
    reference = _prepare(ckpt, "nvfp4", "swiglu", kernels=False)
    calls = {"quantize_scatter_nvfp4": [], "amax_per_expert": []}
    for name, seen in calls.items():
        def counting(*args, _launch=getattr(prepare, name), _seen=seen, **kwargs):
            _seen.append(1)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(prepare, name, counting)
    fused_calls, amax_passes = calls["quantize_scatter_nvfp4"], calls["amax_per_expert"]
    _assert_same_bytes(_prepare(ckpt, "nvfp4", "swiglu", kernels=True), reference,
                       f"fused={fused} {schedule}")
    assert bool(fused_calls) == fused  # the path asked for is the one that ran
    # Two launches: only the first matrix (w1) has an amax pass of its own; w3's and w2's are
    # reduced by the quantizing launch before theirs (_nvfp4_chain).
    assert len(amax_passes) == (0 if fused else 1)


def _edge_weights(e: int, n: int, k: int) -> torch.Tensor:
    """float32 weights with the values where rounding decisions are made: exact powers of two
    times 6 and values an ulp or a few above them (mxfp4's exponent), e2m1/e4m3 midpoints
    (ties), tiny negatives (-0), subnormals, values far apart within one block (clamping), a
    zero block."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(e, n, k, generator=gen) * torch.logspace(-8, 2, n)[None, :, None]
    edges = []
    for power in range(-20, 20, 3):
        base = 6.0 * 2.0 ** power
        edges += [base, -base, base * (1 + 2 ** -23), base * (1 + 3 * 2 ** -23),
                  base * (1 - 2 ** -24), base * 0.75 / 6 * 4]
    edges += [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -1e-30, -3e-39, 1e-45, 448.0 * 1.0001]
    edges = torch.tensor(edges, dtype=torch.float32)
    flat = w.view(-1)
    positions = torch.randperm(flat.numel(), generator=gen)[:4 * len(edges)]
    flat[positions] = edges.repeat(4)
    w[-1, :, : min(k, 32)] = 0.0
    return w


@needs_triton
@pytest.mark.parametrize("quant", ["fp8", "fp8_block", "nvfp4", "mxfp4"])
def test_device_quantization_of_edge_values(quant):
    w = _edge_weights(3, 64, 160 if quant != "mxfp4" else 192).to(_DEVICE)
    ckpt = {"w1": w, "w2": _edge_weights(3, w.shape[2], 64).to(_DEVICE)}
    dtype = torch.float16 if quant in ("nvfp4", "mxfp4") else torch.bfloat16
    reference = _prepare(ckpt, quant, "relu2", kernels=False, dtype=dtype)
    _assert_same_bytes(_prepare(ckpt, quant, "relu2", kernels=True, dtype=dtype), reference, quant)


@needs_triton
@pytest.mark.parametrize("quant", ["none", "fp8_block", "mxfp4"])
def test_device_preparation_of_strided_and_host_sources_in_chunks(monkeypatch, quant):
    """Checkpoint views (transposed, sliced), tensors on another device or of another dtype:
    the same bytes, also when the expert chunks that bound the temporaries are small."""
    gen = torch.Generator().manual_seed(8)
    e, h, i = 4, 128, 64
    w1t = torch.randn(e, h, 2 * i, generator=gen).to(torch.bfloat16) * 0.1
    ckpt = {"w1": w1t.transpose(1, 2)[:, ::2],  # [E, I, H], strides of a transposed slice
            "w3": w1t.transpose(1, 2)[:, 1::2],
            "w2": (torch.randn(e, h, i, generator=gen) * 0.1).to(torch.float32)}
    if quant != "none":  # with "none", float32 into a bf16 layer: converted chunk by chunk
        ckpt["w2"] = ckpt["w2"].to(torch.bfloat16)
    reference = _prepare(ckpt, quant, "swiglu", kernels=False)
    monkeypatch.setattr(layout, "CHUNK_BYTES", 3 * h * i)  # about one expert per chunk
    _assert_same_bytes(_prepare(ckpt, quant, "swiglu", kernels=False), reference, "chunked")
    _assert_same_bytes(_prepare(ckpt, quant, "swiglu", kernels=True), reference, "kernels")


def test_mxfp4_exponent_is_exactly_ceil_log2():
    """quant.quantize_mxfp4's block exponent is ceil(log2(amax / 6)) exactly, also for float32
    amax a few ulps above 6 * 2^k (where a rounded float log2 lands on k)."""
    from fractions import Fraction

    from moe_ops import quant as q

    values = []
    for power in range(-60, 60, 7):
        for ulps in (0, 1, 2, 5, 40):
            values.append(float(torch.tensor(6.0 * 2.0 ** power * (1 + ulps * 2 ** -23),
                                             dtype=torch.float32)))
    w = torch.zeros(1, len(values), 32)
    w[0, :, 0] = torch.tensor(values)
    _, scale = q.quantize_mxfp4(w)
    for value, s in zip(values, scale[0, :, 0].tolist()):
        y = Fraction(torch.tensor(value, dtype=torch.float32).item()) / 6
        e = math.ceil(math.log2(y))  # refined exactly below
        while Fraction(2) ** (e - 1) >= y:
            e -= 1
        while Fraction(2) ** e < y:
            e += 1
        assert s - 127 == max(-127, min(127, e)), value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA allocator statistics")
@pytest.mark.parametrize("quant, prequantized",
                         [(q, p) for q in QUANTS for p in (False, True) if q != "none" or not p])
def test_cuda_reload_writes_in_place_with_bounded_temporaries(quant, prequantized):
    """An RL weight sync on the GPU: no parameter moves, nothing stays allocated, and what is
    allocated meanwhile (per-expert amax partials, per-row scale vectors) is a sliver of the
    layer; the bytes are those of the reference path."""
    e, h, i = 8, 1024, 512
    gen = torch.Generator().manual_seed(10)
    layer = moe_ops.FusedMoE(e, h, i, 2, quant=quant, activation="swiglu_oai", bias=True,
                             device="cuda")
    first = {k: v.cuda() for k, v in _checkpoint(gen, quant, "swiglu_oai", True, e=e, h=h, i=i,
                                                 prequantized=prequantized).items()}
    layer.load_weights(**first)  # compiles the kernels
    new = {k: v.cuda() for k, v in _checkpoint(gen, quant, "swiglu_oai", True, e=e, h=h, i=i,
                                               prequantized=prequantized).items()}
    pointers = {n: p.data_ptr() for n, p in layer.named_parameters()}
    buffers = {n: b.data_ptr() for n, b in layer.named_buffers()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.load_weights(**new)
    torch.cuda.synchronize()
    temporaries = torch.cuda.max_memory_allocated() - before
    assert torch.cuda.memory_allocated() == before
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert temporaries <= (1 << 20) + layer_bytes // 64, (temporaries, layer_bytes)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == pointers
    assert {n: b.data_ptr() for n, b in layer.named_buffers()} == buffers
    _assert_same_bytes(layer.kernel_weights(), _prepare(new, quant, "swiglu_oai", kernels=False),
                       f"{quant} prequantized={prequantized}")


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("kernels", [False, True])
def test_fp4_padding_is_written_by_every_load(quant, kernels):
    """Allocation writes nothing (no memset, padded rows or not); each load path, the device
    kernels and the plain-torch one, writes whole rows: the padding of fp4 rows (K = 96 -> 256
    columns) comes out zero from a destination poisoned everywhere, from bf16 and pre-quantized
    checkpoints alike. (The GEMMs read the padding unmasked: a NaN scale byte there would poison
    the dot.)"""
    h, i = 96, 160
    specs = layout.plan_layout(quant=quant, activation="swiglu", num_local_experts=2,
                               hidden_size=h, intermediate_size=i, bias=False,
                               dtype=torch.bfloat16, device="cpu")
    real_empty = torch.empty
    for spec in specs.values():
        def poisoned(*args, **kwargs):
            return real_empty(*args, **kwargs).view(torch.uint8).fill_(0xA5).view(spec.dtype)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "empty", poisoned)
            raw = spec.new_tensor("cpu").view(torch.uint8)
        assert (raw == 0xA5).all()  # nothing written at allocation

    gen = torch.Generator().manual_seed(7)
    ckpt = {n: torch.randn(2, *s, generator=gen).to(torch.bfloat16)
            for n, s in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))}
    prequantized = {}
    for n, w in ckpt.items():
        if quant == "nvfp4":
            prequantized[n], prequantized[n + "_scale"], prequantized[n + "_global_scale"] = (
                q.quantize_nvfp4(w))
        else:
            prequantized[n], prequantized[n + "_scale"] = q.quantize_mxfp4(w)
    for source in (ckpt, prequantized):
        out = _prepare(source, quant, "swiglu", kernels=kernels)  # poisoned
        for role in ("w13", "w2", "w13_scale", "w2_scale"):
            k = h if role.startswith("w13") else i
            raw = out[role].view(torch.uint8)
            if role in ("w13", "w2"):
                padding = raw.view(*raw.shape[:-1], 4, -1)[..., k // 8:]
            else:
                padding = raw[..., k // q.fp4_scale_block(quant):]
            assert padding.numel() > 0
            assert not padding.any(), (role, source is ckpt)
