"""The routing launch that also quantizes x for the fp8 modes and writes the dispatch
(kernels/routing.py, triton_route's `quantize` and `align`; launched by the experts call,
kernels/experts.py RouteCall): the same ids and weights as the routing alone, the same codes
and scales as act_quant in every act_quant form, the same dispatch as moe_align, bit for bit;
the layer's output the separate launches', bit for bit; every argument checked before the
first launch.

Runs in the Triton interpreter on CPU (tests/conftest.py) and on the GPU alike."""
import pytest
import torch

import moe_ops
from moe_ops.kernels import act_quant as aq
from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels import routing as routing_mod
from moe_ops.kernels.act_quant import act_quant
from moe_ops.kernels.align import moe_align
from moe_ops.kernels.routing import routes_in_one_program, triton_route

from test_triton_layer import _layers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("quant,T,H,form", [
    ("fp8", 1, 300, "split"),            # the row whole, a masked tail
    ("fp8", 3, 4096, "sliced"),          # rows in slices of SLICE_K columns
    ("fp8", 70, 256, "split"),           # rows whole, one a program
    ("fp8", 256, 64, "split"),           # the most tokens the merged launch takes
    ("fp8_block", 1, 384, "split"),      # one program a row and 8 groups
    ("fp8_block", 5, 200, "split"),      # a partial group
    ("fp8_block", 256, 256, "split"),
])
@pytest.mark.parametrize("method,E,k", [("renormalize", 8, 2), ("deepseek_v3", 16, 4)])
def test_same_ids_weights_codes_and_scales(quant, T, H, form, method, E, k, monkeypatch):
    if form == "sliced":
        monkeypatch.setattr(aq, "SLICE_K", 1024)
    g = torch.Generator().manual_seed(T + H)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    x[0, :7] = 0.0
    if T > 2:
        x[2] = 0.0                       # a zero row: zero codes and scale, never NaN
    extra = dict(n_group=4, topk_group=2) if method == "deepseek_v3" else {}
    ids, weights = triton_route(logits, method, k, **extra)
    ids2, weights2, q, s = triton_route(logits, method, k, **extra, quantize=(x, quant))
    q_ref, s_ref = act_quant(x, quant)
    # (bit for bit on the GPU too: the launches run at the same warps, routing.FIXED_WARPS)
    assert torch.equal(ids, ids2) and torch.equal(weights, weights2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    _, _, launch = aq.plan(x, quant)
    # (act_quant's other forms, short rows and looped, start past 256 rows: beyond
    # routing.FIXED_WARPS_MAX_TOKENS, where the launches stay apart)
    expected = {"split": lambda c: c["SPLIT_K"] and not c["SLICE_K"] and c["ROWS"] == 1,
                "sliced": lambda c: c["SLICE_K"] > 0}[form]
    assert expected(launch.constexprs), launch


@pytest.mark.parametrize("T,E,k,block_m,offset,local,quantize", [
    (1, 8, 2, 16, 0, 8, None), (16, 64, 4, 16, 8, 32, "fp8"), (7, 16, 1, 64, 0, 16, "fp8_block"),
    (64, 8, 2, 32, 2, 4, None)])
def test_same_dispatch_as_moe_align(T, E, k, block_m, offset, local, quantize):
    """The routing's single program writing the dispatch (align): the bytes of moe_align's
    single-program path on the same ids, with an expert-parallel shard (ids outside it get no
    slot), beside act_quant's programs or not."""
    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    x = torch.randn(T, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    assert routes_in_one_program(T, k, E, "renormalize", None, local)
    out = triton_route(logits, "renormalize", k, quantize=(x, quantize) if quantize else None,
                       align=(local, block_m, offset))
    ids, weights, aligned = out[0], out[1], out[-1]
    ids_ref, weights_ref = triton_route(logits, "renormalize", k)
    assert torch.equal(ids, ids_ref) and torch.equal(weights, weights_ref)
    expected = moe_align(ids, local, block_m, offset)
    live = int(expected.num_padded[0])
    assert torch.equal(aligned.num_padded, expected.num_padded)
    assert torch.equal(aligned.sorted_pair_ids, expected.sorted_pair_ids)
    assert torch.equal(aligned.block_expert_ids, expected.block_expert_ids)
    assert live > 0 and (aligned.sorted_pair_ids[live:] == T * k).all()
    if quantize:
        q_ref, s_ref = act_quant(x, quantize)
        assert torch.equal(out[2].view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(out[3], s_ref)


def test_align_needs_one_routing_program():
    assert routes_in_one_program(16, 8, 128, "renormalize", None, 128)  # 2048 / 128 tokens
    assert not routes_in_one_program(17, 8, 128, "renormalize", None, 128)
    assert routes_in_one_program(64, 2, 8, "renormalize", None, 8)      # at most 64 tokens
    assert not routes_in_one_program(65, 2, 8, "renormalize", None, 8)
    assert not routes_in_one_program(0, 2, 8, "renormalize", None, 8)
    # the dispatch's tile past the routing's warps (its 8-warp form)
    assert not routes_in_one_program(8, 64, 512, "renormalize", None, 512)
    logits = torch.randn(17, 128).to(DEVICE)
    with pytest.raises(ValueError, match="one program"):
        triton_route(logits, "renormalize", 8, align=(128, 16, 0))
    with pytest.raises(ValueError, match="at most 256 tokens"):
        triton_route(torch.randn(257, 8).to(DEVICE), "renormalize", 2,
                     quantize=(torch.randn(257, 64).to(DEVICE), "fp8"))


@pytest.mark.parametrize("quant,routing,align", [
    ("fp8", "renormalize", True), ("fp8_block", "deepseek_v3", False),
    ("fp8", "llama4", True), ("none", "renormalize", True)])
def test_layer_matches_the_separate_launches(quant, routing, align, monkeypatch):
    """The layer with x quantized in the routing launch (fp8 modes) and, with ROUTE_ALIGN, the
    dispatch written there too, gives the separate launches' output bit for bit, and its
    experts call launches no act_quant of x and no moe_align."""
    _, layer, gen = _layers(routing, quant, "swiglu", seed=3)
    quant_calls, align_calls = [], []
    real_quant, real_align = experts_mod.act_quant, experts_mod.moe_align
    monkeypatch.setattr(experts_mod, "act_quant",
                        lambda *a, **kw: quant_calls.append(1) or real_quant(*a, **kw))
    monkeypatch.setattr(experts_mod, "moe_align",
                        lambda *a, **kw: align_calls.append(1) or real_align(*a, **kw))
    monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS", 0)    # a dispatch at every T
    limit = experts_mod.ROUTE_QUANTIZE_MAX_TOKENS
    fp8 = quant != "none"
    for T in (1, 5):
        x = torch.randn(T, layer.hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
        logits = torch.randn(T, layer.num_experts, generator=gen).to(DEVICE)
        monkeypatch.setattr(experts_mod, "ROUTE_ALIGN", align)
        quant_calls.clear(), align_calls.clear()
        fused = layer(x, logits)
        assert (len(quant_calls), len(align_calls)) == (int(fp8), 0 if align else 1)
        monkeypatch.setattr(experts_mod, "ROUTE_QUANTIZE_MAX_TOKENS", 0)
        monkeypatch.setattr(experts_mod, "ROUTE_ALIGN", False)
        quant_calls.clear(), align_calls.clear()
        separate = layer(x, logits)
        assert (len(quant_calls), len(align_calls)) == (2 * int(fp8), 1)
        monkeypatch.setattr(experts_mod, "ROUTE_QUANTIZE_MAX_TOKENS", limit)
        assert torch.isfinite(fused).all() and torch.equal(fused, separate)


def test_bad_expert_arguments_raise_before_the_routing_launch(monkeypatch):
    """With x quantized in the routing launch, a wrong expert argument is still reported
    before any launch (the routing kernel is never called)."""
    _, layer, gen = _layers("renormalize", "fp8", "swiglu", seed=5)
    launched = []
    monkeypatch.setattr(routing_mod, "_route_kernel", _Recorder(launched))
    x = torch.randn(2, layer.hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(2, layer.num_experts, generator=gen).to(DEVICE)
    weights = dict(layer.kernel_weights())
    weights["w2"] = weights["w2"][:, :-1]
    with pytest.raises(ValueError, match="w2"):
        moe_ops.fused_moe(x, logits, **weights, top_k=layer.top_k, quant="fp8",
                          backend="triton")
    assert launched == []


class _Recorder:
    def __init__(self, launched):
        self.launched = launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        raise AssertionError("the routing kernel launched")


@pytest.mark.parametrize("change,name", [
    (dict(backend="cpu", top_k=0), "top_k"),            # the routing's checks first
    (dict(backend="triton", quant="bogus"), "quant"),   # then the experts', then the backend
    (dict(backend="bogus", routing="bogus"), "routing"),
])
def test_errors_in_the_separate_ops_order(change, name):
    """The layer call names the first wrong argument in the order the routing op and the
    experts op (and the fakes) check them, whichever backend would have run."""
    _, layer, gen = _layers("renormalize", "fp8", "swiglu", seed=7)
    x = torch.randn(2, layer.hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(2, layer.num_experts, generator=gen).to(DEVICE)
    kwargs = dict(top_k=layer.top_k, quant="fp8", backend="triton", routing="renormalize")
    kwargs.update(change)
    with pytest.raises(ValueError, match=f"^{name}"):
        moe_ops.fused_moe(x, logits, **layer.kernel_weights(), **kwargs)
