"""CUDA graphs and torch.compile(mode="reduce-overhead") with the Triton backend (SPEC §7, on a
GPU only): a FusedMoE forward captured at every bucket size up to 512 replays with fresh inputs
to the eager result; capturing inside moe_ops.autotune never profiles; a compiled model with
CUDA graphs matches eager."""
import pytest
import torch

import moe_ops
from moe_ops import synthetic, tuning
from moe_ops.models import MoEShape
from moe_ops.tune import build_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Qwen3-like proportions at a quarter of the size: enough experts for the dispatch to sort,
# fast to compile and run.
SHAPE = MoEShape("capture", 32, 1024, 512, 4, routing="renormalize_naive")
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@pytest.fixture(scope="module", params=["none", "fp8", "fp8_block"])
def layer(request):
    return build_layer(SHAPE, request.param, dtype=torch.bfloat16, device=torch.device("cuda"))


def inputs(tokens, seed):
    x = synthetic.hidden_states(tokens, SHAPE.hidden_size, device="cuda", seed=seed)
    logits = synthetic.router_logits(tokens, SHAPE.num_experts, skew=seed % 2 == 1,
                                     device="cuda", seed=seed + 1)
    return x, logits


@pytest.mark.parametrize("tokens", BUCKETS)
def test_graph_replay_matches_eager(layer, tokens):
    x, logits = inputs(tokens, 0)
    layer(x, logits)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    for seed in (10, 11, 12):
        fresh_x, fresh_logits = inputs(tokens, seed)
        x.copy_(fresh_x)
        logits.copy_(fresh_logits)
        out.fill_(float("nan"))  # poisoned: every element must be rewritten by the replay
        graph.replay()
        expected = layer(fresh_x, fresh_logits)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert torch.equal(out, expected), (layer.quant, tokens, seed)


def test_capture_inside_autotune_does_not_profile(layer, monkeypatch):
    tuner = tuning.Tuner(shipped_dir=None)
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    x, logits = inputs(48, 3)   # bucket 64, untuned in this fresh tuner
    layer(x, logits)   # outside autotune: compile bucket 64's default kernels before capturing
    with tuning.autotune(tuner=tuner):
        graph = torch.cuda.CUDAGraph()
        layer(x[:1], logits[:1])   # bucket 1 is profiled here, eagerly: allowed
        profiled = tuner.profile_count
        assert profiled == 2       # GEMM1 and GEMM2 of bucket 1
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        assert tuner.profile_count == profiled   # lookups only while capturing
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer(x, logits))


def test_reduce_overhead_matches_eager(layer):
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x, logits):
            return self.moe(x, logits) * 1.0 + x

    block = Block(layer)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for tokens in (1, 7, 64, 300):
        for seed in (20, 21):
            x, logits = inputs(tokens, seed)
            got = compiled(x, logits).clone()
            torch.cuda.synchronize()
            expected = block(x, logits)
            assert torch.allclose(got.float(), expected.float(), rtol=0, atol=0), (tokens, seed)
