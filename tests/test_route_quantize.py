"""The routing launch that also quantizes x for the fp8 modes (kernels/routing.py, triton_route's
`quantize`; experts.quantize_in_routing): the same ids and weights as the routing alone, the
same codes and scales as act_quant, bit for bit, in every act_quant form; the layer's output
the two-launch path's (bit for bit where the routing weights are); the experts' arguments
checked before that launch.

Runs in the Triton interpreter on CPU (tests/conftest.py) and on the GPU alike."""
import pytest
import torch

import moe_ops
from moe_ops import experts as experts_api
from moe_ops.kernels import act_quant as aq
from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels import routing as routing_mod
from moe_ops.kernels.act_quant import act_quant
from moe_ops.kernels.routing import triton_route

from test_triton_layer import _layers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("quant,T,H,form", [
    ("fp8", 1, 300, "split"),            # the row whole, a masked tail
    ("fp8", 3, 4096, "sliced"),          # rows in slices of SLICE_K columns
    ("fp8", 70, 256, "split"),           # rows whole, one a program
    ("fp8", 300, 64, "short rows"),      # more rows than SPLIT_K_MAX_ROWS: short rows whole
    ("fp8_block", 1, 384, "split"),      # one program a row and 8 groups
    ("fp8_block", 5, 200, "split"),      # a partial group
    ("fp8_block", 600, 256, "looped"),   # more rows than SPLIT_K_MAX_ROWS
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
    # (the launch runs at act_quant's warp count when that is the larger: on the GPU the
    # weights' reductions may then round their last bit differently; the ids are the same)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(weights2, weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    _, _, launch = aq.plan(x, quant)
    expected = {"split": lambda c: c["SPLIT_K"] and not c["SLICE_K"] and c["ROWS"] == 1,
                "sliced": lambda c: c["SLICE_K"] > 0,
                "short rows": lambda c: c["ROWS"] > 1 or c["LOAD_FIRST"],
                "looped": lambda c: not c["SPLIT_K"]}[form]
    assert expected(launch.constexprs), launch


@pytest.mark.parametrize("quant,routing", [("fp8", "renormalize"), ("fp8_block", "deepseek_v3"),
                                           ("fp8", "llama4")])
def test_layer_bit_for_bit_the_two_launch_path(quant, routing, monkeypatch):
    """The layer with x quantized in the routing launch gives the two-launch path's output bit
    for bit, and its experts call launches no act_quant of x (one act_quant: the
    intermediate's)."""
    _, layer, gen = _layers(routing, quant, "swiglu", seed=3)
    calls = []
    real = experts_mod.act_quant
    monkeypatch.setattr(experts_mod, "act_quant",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    limit = experts_api.QUANTIZE_IN_ROUTING_MAX_TOKENS
    for T in (1, 5):
        x = torch.randn(T, layer.hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
        logits = torch.randn(T, layer.num_experts, generator=gen).to(DEVICE)
        calls.clear()
        fused = layer(x, logits)
        assert len(calls) == 1, calls
        monkeypatch.setattr(experts_api, "QUANTIZE_IN_ROUTING_MAX_TOKENS", 0)
        calls.clear()
        separate = layer(x, logits)
        assert len(calls) == 2, calls
        monkeypatch.setattr(experts_api, "QUANTIZE_IN_ROUTING_MAX_TOKENS", limit)
        assert torch.isfinite(fused).all()
        if DEVICE == "cpu":
            assert torch.equal(fused, separate)
        else:   # (a routing weight's last bit, see above)
            err = ((fused.float() - separate.float()).norm() / separate.float().norm()).item()
            assert err < 1e-3, err


def test_only_where_it_applies():
    x = torch.zeros(4, 8)
    assert experts_api.quantize_in_routing(x, "fp8", "triton")
    assert experts_api.quantize_in_routing(x, "fp8_block", "triton")
    assert not experts_api.quantize_in_routing(x, "none", "triton")
    assert not experts_api.quantize_in_routing(x, "nvfp4", "triton")
    assert not experts_api.quantize_in_routing(x, "fp8", "reference")
    assert not experts_api.quantize_in_routing(x[:0], "fp8", "triton")
    big = torch.zeros(experts_api.QUANTIZE_IN_ROUTING_MAX_TOKENS + 1, 8)
    assert not experts_api.quantize_in_routing(big, "fp8", "triton")
    with pytest.raises(ValueError, match="quantize"):
        moe_ops.routing.route(torch.zeros(2, 4), "renormalize", 2, backend="reference",
                              quantize=(torch.zeros(2, 8), "fp8"))


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
