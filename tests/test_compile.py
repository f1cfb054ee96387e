"""torch.compile over a model that uses moe_ops.FusedMoE (SPEC §2: fakes for every op, so
fullgraph tracing works with the token count dynamic).

A small block (linear router -> FusedMoE -> residual add) is compiled with fullgraph=True,
dynamic=True on the aot_eager backend and swept over token counts 1 ... 256: no graph break, at
most two graphs (T = 1 is specialized by dynamo, every other T shares one), and the same result
as eager for each T. One inductor smoke test runs the real code generator once.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_ops

# torch._dynamo is imported inside the tests, never at module level: it imports triton, and
# Triton must be imported after the kernel tests set TRITON_INTERPRET=1 (pytest imports every
# test module before running any test), or the interpreter breaks for the whole process.


def counters():
    from torch._dynamo.utils import counters as dynamo_counters

    return dynamo_counters

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 4, 2
TOKEN_SWEEP = [1, 2, 3, 7, 16, 33, 64, 100, 255, 256]


class MoEBlock(nn.Module):
    """x -> x + FusedMoE(x, router(x)); or pre-routed with the block's own softmax top-k."""

    def __init__(self, quant: str, dtype: torch.dtype, gen: torch.Generator,
                 pre_routed: bool = False, activation: str = "swiglu", bias: bool = False):
        super().__init__()
        self.pre_routed = pre_routed
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=dtype)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen))
        self.moe = moe_ops.FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, quant=quant,
                                    activation=activation, bias=bias, dtype=dtype)
        ckpt = dict(w1=torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.2,
                    w2=torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2,
                    w3=torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.2)
        if bias:
            ckpt.update(b1=torch.randn(EXPERTS, INTERMEDIATE, generator=gen),
                        b2=torch.randn(EXPERTS, HIDDEN, generator=gen),
                        b3=torch.randn(EXPERTS, INTERMEDIATE, generator=gen))
        self.moe.load_weights(**ckpt)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.pre_routed:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, TOP_K, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return x + self.moe(x, topk_ids=ids, topk_weights=weights)
        return x + self.moe(x, logits)


class CountingBackend:
    """aot_eager, recording every graph dynamo hands over that contains a moe_ops op."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        self.graphs.append(ops)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    def moe_ops_calls(self):
        return [[str(t) for t in ops if str(t).startswith("moe_ops.")] for ops in self.graphs]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters().clear()
    yield
    torch._dynamo.reset()


def sweep(model: MoEBlock, backend, dtype: torch.dtype, gen: torch.Generator, tokens=TOKEN_SWEEP,
          exact=True):
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    for t in tokens:
        x = torch.randn(t, HIDDEN, generator=gen).to(dtype)
        with torch.no_grad():
            expected = model(x)
            got = compiled(x)
        assert got.shape == (t, HIDDEN) and got.dtype == dtype
        if exact:  # aot_eager runs the very same kernels: bit-identical
            assert torch.equal(got, expected), f"T={t}: compiled != eager"
        else:
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2, msg=f"T={t}")


def assert_no_graph_break_and_at_most_two_graphs():
    assert not counters()["graph_break"], dict(counters()["graph_break"])
    # T = 1 is specialized (dynamo's 0/1 specialization); all of 2 ... 256 share one graph.
    assert 1 <= counters()["stats"]["unique_graphs"] <= 2, dict(counters()["stats"])


@pytest.mark.parametrize("quant,dtype,activation,bias", [
    ("none", torch.bfloat16, "swiglu", False),
    ("fp8", torch.bfloat16, "swiglu", False),
    ("mxfp4", torch.float16, "swiglu_oai", True),
], ids=["none-bf16", "fp8-bf16", "mxfp4-fp16-swiglu_oai-bias"])
def test_compiled_block_sweeps_token_counts_without_recompiling(quant, dtype, activation, bias):
    gen = torch.Generator().manual_seed(1)
    model = MoEBlock(quant, dtype, gen, activation=activation, bias=bias)
    backend = CountingBackend()
    sweep(model, backend, dtype, gen)
    assert_no_graph_break_and_at_most_two_graphs()
    # The MoE went into the graph as the one fused op, not as a traced-through decomposition.
    assert backend.graphs and all(calls == ["moe_ops.fused_moe.default"] or
                                  calls == ["moe_ops.fused_moe"]
                                  for calls in backend.moe_ops_calls()), backend.moe_ops_calls()


def test_compiled_pre_routed_block_sweeps_token_counts_without_recompiling():
    gen = torch.Generator().manual_seed(2)
    model = MoEBlock("fp8_block", torch.bfloat16, gen, pre_routed=True)
    backend = CountingBackend()
    sweep(model, backend, torch.bfloat16, gen)
    assert_no_graph_break_and_at_most_two_graphs()
    assert backend.graphs and all(calls and set(calls) <= {"moe_ops.fused_experts.default",
                                                           "moe_ops.fused_experts"}
                                  for calls in backend.moe_ops_calls()), backend.moe_ops_calls()


def test_compiled_moe_ops_route_and_fused_moe_functions():
    """The functional API (route + pre-routed fused_moe on kernel tensors) traces fullgraph."""
    gen = torch.Generator().manual_seed(3)
    ckpt = dict(w1=torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.2,
                w2=torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2,
                w3=torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) * 0.2)
    weights = moe_ops.prepare_weights(quant="fp8", dtype=torch.bfloat16, **ckpt)

    def fn(x, logits):
        ids, w = moe_ops.route(logits, TOP_K, routing="sigmoid_renorm")
        return moe_ops.fused_moe(x, topk_ids=ids, topk_weights=w, quant="fp8", **weights)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=CountingBackend())
    for t in (5, 31, 130):
        x = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
        logits = torch.randn(t, EXPERTS, generator=gen).to(torch.bfloat16)
        assert torch.equal(compiled(x, logits), fn(x, logits)), f"T={t}"
    assert not counters()["graph_break"], dict(counters()["graph_break"])
    assert counters()["stats"]["unique_graphs"] == 1, dict(counters()["stats"])


def test_compiled_block_with_zero_tokens_returns_empty():
    gen = torch.Generator().manual_seed(4)
    model = MoEBlock("none", torch.bfloat16, gen)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(torch.randn(0, HIDDEN, generator=gen).to(torch.bfloat16))
    assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16
    assert not counters()["graph_break"], dict(counters()["graph_break"])


def test_inductor_smoke():
    """One real inductor compile (C++ code generation on CPU): runs and matches eager."""
    gen = torch.Generator().manual_seed(5)
    model = MoEBlock("fp8", torch.float32, gen)
    sweep(model, "inductor", torch.float32, gen, tokens=[3, 17, 40], exact=False)
    assert not counters()["graph_break"], dict(counters()["graph_break"])
    assert counters()["stats"]["unique_graphs"] == 1, dict(counters()["stats"])
