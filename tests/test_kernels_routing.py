"""The Triton routing kernel (moe_ops.kernels.routing.triton_route) against route_reference.

On a machine without CUDA the kernel runs in the Triton interpreter on CPU tensors: the flag
must be set before torch/triton are imported, which tests/conftest.py does. Every comparison is exact
on ids and float32-rounding close on weights; outputs are written into poisoned tensors so a
slot the kernel forgets to write shows up.
"""
import os
import zlib

import pytest
import torch

from moe_ops.kernels import routing as routing_kernels
from moe_ops.kernels.routing import triton_route
from moe_ops.routing import route_reference, validate_routing

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if _INTERPRET or not torch.cuda.is_available() else "cuda"
if DEVICE == "cpu" and not _INTERPRET:
    pytest.skip("a GPU is visible but torch cannot use it", allow_module_level=True)

# Inf and NaN rows make the interpreter's numpy arithmetic warn; those values are the point.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PLAIN_METHODS = ("default", "renormalize", "renormalize_naive", "sigmoid_renorm", "topk")
# (num_tokens, num_experts, top_k) for the methods without groups; k = E included on purpose.
PLAIN_SHAPES = ((1, 1, 1), (5, 6, 2), (5, 6, 6), (33, 16, 4), (33, 64, 8), (100, 64, 3))
# (num_tokens, num_experts, n_group, topk_group, top_k); group sizes and counts include
# non-powers of two, so both tile axes carry padding.
DEEPSEEK_SHAPES = ((33, 16, 4, 2, 4), (33, 64, 8, 4, 8), (5, 6, 3, 1, 2), (5, 12, 3, 2, 8),
                   (5, 16, 1, 1, 3), (33, 24, 4, 2, 5), (5, 6, 2, 1, 3))
ID_POISON = -12345
WEIGHT_POISON = 12345.0


def _generator(request) -> torch.Generator:
    """Fresh data per test, but reproducible: the seed is the test's own id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _random_logits(gen, num_tokens, num_experts, dtype, scale=3.0):
    logits = torch.randn(num_tokens, num_experts, generator=gen) * scale
    return logits.to(dtype).to(DEVICE)


def _route(logits, method, top_k, **kwargs):
    """triton_route into poisoned outputs, so a slot left unwritten fails the comparison."""
    num_tokens = logits.shape[0]
    ids = torch.full((num_tokens, top_k), ID_POISON, dtype=torch.int32, device=DEVICE)
    weights = torch.full((num_tokens, top_k), WEIGHT_POISON, dtype=torch.float32, device=DEVICE)
    args = (kwargs.get("routing_bias"), kwargs.get("n_group"), kwargs.get("topk_group"),
            kwargs.get("routed_scaling_factor", 1.0))
    validate_routing(method, logits.shape[1], top_k, args[1], args[2])
    out_ids, out_weights = triton_route(logits, method, top_k, *args, out=(ids, weights))
    assert out_ids is ids and out_weights is weights
    ref_ids, ref_weights = route_reference(logits.cpu(), method, top_k,
                                           None if args[0] is None else args[0].cpu(), *args[1:])
    return ids.cpu(), weights.cpu(), ref_ids, ref_weights


def _assert_matches(ids, weights, ref_ids, ref_weights, nan_rows=()):
    """Exact ids, close weights; rows in nan_rows only need valid, distinct ids."""
    checked = torch.ones(ids.shape[0], dtype=torch.bool)
    for row in nan_rows:
        checked[row] = False
        row_ids = ids[row].tolist()
        assert min(row_ids) >= 0 and len(set(row_ids)) == len(row_ids), row_ids
    assert torch.equal(ids[checked], ref_ids[checked]), (ids[checked], ref_ids[checked])
    torch.testing.assert_close(weights[checked], ref_weights[checked], rtol=1e-5, atol=1e-6,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PLAIN_SHAPES, ids=str)
@pytest.mark.parametrize("method", PLAIN_METHODS)
def test_plain_methods_random(request, method, shape, dtype):
    num_tokens, num_experts, top_k = shape
    logits = _random_logits(_generator(request), num_tokens, num_experts, dtype)
    _assert_matches(*_route(logits, method, top_k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_experts", (1, 6, 16, 64))
def test_llama4_random(request, num_experts, dtype):
    logits = _random_logits(_generator(request), 33, num_experts, dtype)
    _assert_matches(*_route(logits, "llama4", 1))


@pytest.mark.parametrize("with_bias", (False, True), ids=("no_bias", "bias"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", DEEPSEEK_SHAPES, ids=str)
def test_deepseek_v3_random(request, shape, dtype, with_bias):
    num_tokens, num_experts, n_group, topk_group, top_k = shape
    gen = _generator(request)
    logits = _random_logits(gen, num_tokens, num_experts, dtype)
    bias = (torch.randn(num_experts, generator=gen) * 0.5).to(DEVICE) if with_bias else None
    _assert_matches(*_route(logits, "deepseek_v3", top_k, routing_bias=bias, n_group=n_group,
                            topk_group=topk_group, routed_scaling_factor=2.5))


def _tie_logits(gen, num_tokens, num_experts, dtype):
    """Small integers: many equal scores per row, exactly representable in every dtype."""
    logits = torch.randint(-3, 4, (num_tokens, num_experts), generator=gen).float()
    return logits.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", PLAIN_METHODS + ("llama4",))
def test_ties_go_to_lower_index(request, method, dtype):
    gen = _generator(request)
    for num_experts, top_k in ((16, 5), (64, 12), (7, 7)):
        logits = _tie_logits(gen, 33, num_experts, dtype)
        _assert_matches(*_route(logits, method, 1 if method == "llama4" else top_k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deepseek_v3_ties(request, dtype):
    gen = _generator(request)
    # Integer logits give equal group scores too: the group choice must break ties by index.
    # Non-negative ones only: sigmoid(x) + sigmoid(-x) = 1 makes sums of *different* scores
    # equal in exact arithmetic, and then float rounding (the GPU's fast exp against torch's)
    # picks the winner, not the tie rule.
    for num_experts, n_group, topk_group, top_k in ((16, 4, 2, 4), (64, 8, 4, 8), (12, 6, 3, 5)):
        logits = _tie_logits(gen, 33, num_experts, dtype).abs()
        _assert_matches(*_route(logits, "deepseek_v3", top_k, n_group=n_group,
                                topk_group=topk_group))
        bias = torch.randint(-1, 2, (num_experts,), generator=gen).float().to(DEVICE) * 0.25
        _assert_matches(*_route(logits, "deepseek_v3", top_k, routing_bias=bias,
                                n_group=n_group, topk_group=topk_group,
                                routed_scaling_factor=1.5))


def _special_rows(gen, num_experts, dtype):
    """Rows holding inf, -inf, NaN and signed zeros, plus one plain row they must not touch.

    Returns (logits, rows whose ids need only be valid and distinct). NaN ranks as -inf for
    selection, so a row with some NaN still has exact expected ids: only the all-NaN row is
    left loose.
    """
    inf, nan = float("inf"), float("nan")
    logits = torch.randn(8, num_experts, generator=gen) * 3
    logits[0, ::3] = -inf
    logits[0, 1] = inf
    logits[1, :] = -inf
    logits[2, :] = inf
    logits[3, 2] = nan
    logits[4, :] = nan
    # -0.0 and +0.0 are equal scores: the tie goes to the lower index whatever the sign bit.
    logits[5, :] = 0.0
    logits[5, ::2] = -0.0
    # One finite score per group of 4: every DeepSeek group scores -inf, and filling k slots
    # must take -inf experts by index across all groups, kept or not, as the reference does.
    logits[6, :] = nan
    logits[6, 3::4] = torch.randn(num_experts // 4, generator=gen)
    return logits.to(dtype).to(DEVICE), (4,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", PLAIN_METHODS + ("llama4", "deepseek_v3"))
def test_nan_and_inf_rows(request, method, dtype):
    gen = _generator(request)
    logits, loose_rows = _special_rows(gen, 16, dtype)
    if method == "deepseek_v3":
        result = _route(logits, method, 6, n_group=4, topk_group=2,
                        routing_bias=(torch.randn(16, generator=gen) * 0.1).to(DEVICE))
    else:
        result = _route(logits, method, 1 if method == "llama4" else 6)
    _assert_matches(*result, nan_rows=loose_rows)
    ids = result[0]
    assert ((ids >= 0) & (ids < 16)).all()


@pytest.mark.parametrize("method", PLAIN_METHODS)
def test_odd_expert_counts_and_large_k(request, method):
    gen = _generator(request)
    for num_experts, top_k in ((3, 2), (100, 17), (511, 9), (40, 40)):
        logits = _random_logits(gen, 9, num_experts, torch.bfloat16)
        _assert_matches(*_route(logits, method, top_k))


def test_non_contiguous_logits(request):
    gen = _generator(request)
    wide = _random_logits(gen, 21, 40, torch.float16)
    # A column slice (row stride 40, not 24) and a transposed view (expert stride != 1).
    sliced = wide[:, 8:32]
    transposed = _random_logits(gen, 24, 21, torch.float16).t()
    for logits in (sliced, transposed):
        _assert_matches(*_route(logits, "renormalize", 4))
        _assert_matches(*_route(logits, "deepseek_v3", 4, n_group=4, topk_group=2))


def test_many_programs(request):
    # Several programs plus a partial last block (BLOCK_T does not divide num_tokens).
    logits = _random_logits(_generator(request), 301, 8, torch.float32)
    _assert_matches(*_route(logits, "default", 2))


def test_no_tokens_returns_empty_without_launch(monkeypatch):
    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a kernel for zero tokens")

    monkeypatch.setattr(routing_kernels, "_route_kernel", _NoLaunch())
    logits = torch.empty(0, 16, dtype=torch.bfloat16, device=DEVICE)
    ids, weights = triton_route(logits, "deepseek_v3", 4, None, 4, 2, 1.0)
    assert ids.shape == (0, 4) and ids.dtype == torch.int32
    assert weights.shape == (0, 4) and weights.dtype == torch.float32
