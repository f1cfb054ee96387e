"""moe_ops.dispatch: align_tokens_reference (and the align_tokens op on the reference backend)
against a pair-by-pair account of what the aligned layout must hold."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_ops  # noqa: F401  (registers torch.ops.moe_ops.*)
from moe_ops.dispatch import align_tokens, align_tokens_reference, expert_counts, max_padded_pairs

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_aligned(aligned, topk_ids: torch.Tensor, num_local: int, offset: int, block_m: int) -> None:
    sorted_pair_ids, block_expert_ids, num_padded = (t.cpu() for t in aligned)
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    sentinel = num_pairs
    flat = topk_ids.reshape(-1).tolist()
    local_of = {p: e - offset for p, e in enumerate(flat) if offset <= e < offset + num_local}
    expected_counts = [sum(1 for e in local_of.values() if e == x) for x in range(num_local)]
    padded = [-(-c // block_m) * block_m for c in expected_counts]

    # Shapes come from the shapes alone (the upper bound), dtypes int32.
    max_padded = max_padded_pairs(num_pairs, num_local, block_m)
    assert max_padded >= sum(padded) and max_padded % block_m == 0
    assert sorted_pair_ids.shape == (max_padded,) and sorted_pair_ids.dtype == torch.int32
    assert block_expert_ids.shape == (max_padded // block_m,) and block_expert_ids.dtype == torch.int32
    assert num_padded.shape == (1,) and num_padded.dtype == torch.int32

    assert num_padded.item() == sum(padded)
    ids = sorted_pair_ids.tolist()
    start = 0
    for expert in range(num_local):
        run = ids[start:start + padded[expert]]
        real, pad = run[:expected_counts[expert]], run[expected_counts[expert]:]
        # Its pairs, each once, then sentinels up to a multiple of block_m.
        assert sorted(real) == sorted(p for p, e in local_of.items() if e == expert), expert
        assert all(p == sentinel for p in pad), expert
        first_block, last_block = start // block_m, (start + padded[expert]) // block_m
        assert all(b == expert for b in block_expert_ids[first_block:last_block].tolist())
        start += padded[expert]
    # Past the live length: sentinels and unused blocks.
    assert all(p == sentinel for p in ids[start:])
    assert all(b == -1 for b in block_expert_ids[start // block_m:].tolist())
    # Every valid pair exactly once overall; dropped pairs (-1, other shards) never.
    live = [p for p in ids if p != sentinel]
    assert sorted(live) == sorted(local_of)


@st.composite
def align_inputs(draw):
    num_tokens = draw(st.integers(0, 60))
    k = draw(st.integers(1, 6))
    num_local = draw(st.integers(1, 12))
    offset = draw(st.integers(0, 5))
    block_m = draw(st.sampled_from((1, 2, 3, 4, 16, 64)))
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    seed = draw(st.integers(0, 2**31 - 1))
    skew = draw(st.sampled_from(("uniform", "one", "invalid-heavy")))
    gen = torch.Generator().manual_seed(seed)
    high = offset + num_local + 3
    ids = torch.randint(-2, high, (num_tokens, k), generator=gen)
    if skew == "one":
        ids[:] = offset + draw(st.integers(0, num_local - 1))
    elif skew == "invalid-heavy":
        ids = torch.where(torch.rand(num_tokens, k, generator=gen) < 0.6, torch.full_like(ids, -1), ids)
    return ids.to(dtype), num_local, offset, block_m


@SETTINGS
@given(args=align_inputs())
def test_align_tokens_reference(args):
    ids, num_local, offset, block_m = args
    check_aligned(align_tokens_reference(ids, num_local, offset, block_m), ids, num_local, offset, block_m)


@SETTINGS
@given(args=align_inputs())
def test_align_tokens_op_reference_backend(args):
    ids, num_local, offset, block_m = args
    out = torch.ops.moe_ops.align_tokens(ids, num_local, offset, block_m, "reference")
    check_aligned(out, ids, num_local, offset, block_m)
    again = align_tokens(ids, num_local, offset, block_m, backend="reference")
    for a, b in zip(out, again):
        assert torch.equal(a, b)


def test_int32_and_int64_ids_align_the_same():
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ()).item()))
    ids = torch.randint(-1, 9, (37, 3), generator=gen)
    a = align_tokens_reference(ids.int(), 8, 0, 4)
    b = align_tokens_reference(ids.long(), 8, 0, 4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("block_m", (1, 16))
def test_extreme_ids_are_dropped(block_m):
    ids = torch.tensor([[2**31 - 1, -(2**31)], [3, -1], [0, 4]], dtype=torch.int32)
    aligned = align_tokens_reference(ids, 4, 0, block_m)
    check_aligned(aligned, ids, 4, 0, block_m)
    assert expert_counts(ids, 4, 0).tolist() == [1, 0, 0, 1]
    ids64 = torch.tensor([[2**40, -(2**40)], [3, -1], [0, 4]], dtype=torch.int64)
    check_aligned(align_tokens_reference(ids64, 4, 0, block_m), ids64, 4, 0, block_m)


def test_shard_offset_selects_its_experts():
    ids = torch.tensor([[0, 5], [6, 7], [5, 5], [9, 2]])
    aligned = align_tokens_reference(ids, 3, 5, 2)  # local experts are global 5, 6, 7
    check_aligned(aligned, ids, 3, 5, 2)
    assert expert_counts(ids, 3, 5).tolist() == [3, 1, 1]
    assert aligned.num_padded.item() == 4 + 2 + 2
    laid_out = aligned.sorted_pair_ids.tolist()
    assert sorted(laid_out[:3]) == [1, 4, 5] and laid_out[3:] == [8, 2, 8, 3, 8] + [8] * 4
    assert aligned.block_expert_ids.tolist() == [0, 0, 1, 2, -1, -1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=align_inputs())
def test_align_tokens_op_triton_backend(kernel_device, args):
    """The Triton dispatch (on the GPU, or in the interpreter on CPU) keeps the same contract.
    Pairs within an expert's run may come in another order, which check_aligned allows."""
    ids, num_local, offset, block_m = args
    if block_m == 3:
        block_m = 4  # the kernels tile by powers of two
    out = torch.ops.moe_ops.align_tokens(ids.to(kernel_device), num_local, offset, block_m,
                                         "triton")
    check_aligned(out, ids, num_local, offset, block_m)
