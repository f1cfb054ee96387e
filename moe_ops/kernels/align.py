"""Dispatch: topk_ids -> (token, slot) pairs grouped by local expert, padded to block_m.

Outputs, all on the device and sized from shapes only (no host sync: CUDA-graph safe):
  sorted_pair_ids  int32 [max_padded]  flat pair index t*k+j, grouped by local expert (ascending;
                                       inside an expert, ascending pair index), each expert's run
                                       padded to a multiple of block_m with the sentinel T*k
  block_expert_ids int32 [max_blocks]  local expert of each block_m block, -1 past the live ones
  num_padded       int32 [1]           live length of sorted_pair_ids (sum of padded runs)

At most min(E, T*k) experts are non-empty, each wasting < block_m slots, so
max_padded = ceil((T*k + min(E, T*k) * (block_m - 1)) / block_m) * block_m bounds num_padded;
every slot past num_padded holds the sentinel, so a GEMM block can tell it is dead from its
first pair id alone. Pairs whose local expert is outside [0, E) (id -1, other shards) get no
slot: they contribute nothing downstream.

Two paths, both deterministic (a per-chunk sort, no atomics, so the order inside an expert
never depends on timing):
- small (T*k <= SMALL_PATH_MAX_PAIRS, i.e. decode and small prefill): one program does
  everything in registers: one launch.
- large: count (per-chunk histograms) -> offsets (one program: prefix sums over chunks and
  experts, block ids) -> scatter (per-chunk sort and store). Three launches, all parallel over
  chunks except the scan, whose loop is over chunk tiles, not pairs.
For the smallest batches (T*k small next to E) the GEMMs can skip dispatch altogether: see
`grouped_gemm.py` ("direct" mode, one pair per block).

The small path can also gather the routed token rows in dispatch order (`moe_align_gather`:
what the warp-specialized GEMMs read through TMA, which cannot gather): the grid
then spans x's columns, every program sorts the pairs (the same registers-only work, side by
side) and copies its columns of the live rows; program 0 alone writes the dispatch. One launch
instead of the dispatch's and gather_rows' (below) two at decode, where each costs more in
latency than in work.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from moe_ops.dispatch import AlignedPairs, max_padded_pairs
from moe_ops.kernels.common import cdiv, next_power_of_2, pdl_launch_options, pdl_prologue, use_pdl
from moe_ops.kernels.env import env_int

# Up to this many (token, slot) pairs the single-program path holds them all in registers.
SMALL_PATH_MAX_PAIRS = 1024
# Pairs per program in the large path: one in-register sort per chunk.
CHUNK_PAIRS = 1024
# The small path's gathered rows (moe_align_gather): [pairs, columns] elements a program copies,
# so the register tile stays this size whatever the pair count (the grid grows instead; at
# least 16 columns a program). sm_90 builds at 4 warps: 30-168 registers, no stack, up to 1024
# pairs of 256 experts.
GATHER_TILE = 4096




@triton.jit
def _fill(ptr, value, start, stop, FILL: tl.constexpr):
    offs = tl.arange(0, FILL)
    for p0 in range(start, stop, FILL):
        tl.store(ptr + p0 + offs, value, mask=p0 + offs < stop)


@triton.jit
def _local_experts(topk_ids_ptr, offs, num_pairs, num_experts, local_expert_offset):
    """(local expert as int32 with invalid -> 0, validity) of the pairs at offs."""
    in_range = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
    # Subtract in the ids' own width: an int64 id far outside int32 must not wrap into range.
    local = ids - local_expert_offset
    valid = in_range & (local >= 0) & (local < num_experts)
    return tl.where(valid, local, 0).to(tl.int32), valid


@triton.jit
def _align_single_program_kernel(
    topk_ids_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_pairs, num_experts, local_expert_offset, max_padded, max_blocks,
    x_ptr, rows_ptr, top_k, H, stride_x, stride_rows,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr,
    GATHER_H: tl.constexpr,     # 0: dispatch only (one program); > 0: columns a program gathers
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    align_pairs(tl.program_id(0), topk_ids_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
                num_padded_ptr, num_pairs, num_experts, local_expert_offset, max_padded,
                max_blocks, x_ptr, rows_ptr, top_k, H, stride_x, stride_rows, BLOCK_M, PAIRS,
                EXPERTS, FILL, GATHER_H)


@triton.jit
def align_pairs(
    program, topk_ids_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_pairs, num_experts, local_expert_offset, max_padded, max_blocks,
    x_ptr, rows_ptr, top_k, H, stride_x, stride_rows,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr,
    GATHER_H: tl.constexpr,
):
    """The small path's work for one program of its grid (program 0 writes the dispatch; with
    GATHER_H > 0 each also copies its columns of the rows): a function of its own so that the
    routing kernel's single program can run it after routing (kernels/routing.py)."""
    first = program == 0
    if first:
        # Sentinels first; the barrier orders them before this program's own stores below
        # (bar.sync makes a CTA's global writes visible to all its threads).
        _fill(sorted_pair_ids_ptr, num_pairs, 0, max_padded, FILL)
        _fill(block_expert_ids_ptr, -1, 0, max_blocks, FILL)
        tl.debug_barrier()

    offs = tl.arange(0, PAIRS)
    expert, valid = _local_experts(topk_ids_ptr, offs, num_pairs, num_experts,
                                   local_expert_offset)
    counts = tl.histogram(expert, EXPERTS, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    expert_ends = tl.cumsum(padded, 0)
    expert_starts = expert_ends - padded
    pairs_before = tl.cumsum(counts, 0) - counts  # valid pairs of lower experts

    # Sort (expert, pair) keys; invalid pairs get expert EXPERTS and sort last. The rank of a
    # pair inside its expert's run is its sorted position minus pairs_before[expert].
    key = tl.where(valid, expert, EXPERTS) * PAIRS + offs
    key = tl.sort(key, 0)
    expert_s = key // PAIRS
    valid_s = expert_s < EXPERTS
    dest = tl.gather(expert_starts - pairs_before, tl.minimum(expert_s, EXPERTS - 1), 0) + offs
    if first:
        tl.store(sorted_pair_ids_ptr + dest, key % PAIRS, mask=valid_s)
        expert_idx = tl.arange(0, EXPERTS)
        first_block = expert_starts // BLOCK_M
        num_blocks = padded // BLOCK_M
        for j in range(0, tl.max(num_blocks, 0)):
            tl.store(block_expert_ids_ptr + first_block + j, expert_idx, mask=j < num_blocks)
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    if GATHER_H > 0:
        # rows[slot] = x[pair // top_k], this program's columns; padding slots are not written
        # (each slot is its own row of the GEMMs that read them, its results dropped)
        token = ((key % PAIRS) // top_k).to(tl.int64)
        cols = program * GATHER_H + tl.arange(0, GATHER_H)
        mask = valid_s[:, None] & (cols < H)[None, :]
        values = tl.load(x_ptr + token[:, None] * stride_x + cols[None, :], mask=mask)
        tl.store(rows_ptr + dest.to(tl.int64)[:, None] * stride_rows + cols[None, :], values,
                 mask=mask)


@triton.jit
def _align_count_kernel(
    topk_ids_ptr, chunk_counts_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    num_pairs, num_experts, local_expert_offset, max_padded, max_blocks,
    fill_per_program, blocks_per_program,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    chunk = tl.program_id(0)
    # Every slot starts as the sentinel and every block as -1; the scatter kernel (a later
    # launch) overwrites the live slots, the offsets kernel the live blocks.
    p0 = chunk * fill_per_program
    _fill(sorted_pair_ids_ptr, num_pairs, p0,
                      tl.minimum(p0 + fill_per_program, max_padded), FILL)
    b0 = chunk * blocks_per_program
    _fill(block_expert_ids_ptr, -1, b0,
                      tl.minimum(b0 + blocks_per_program, max_blocks), FILL)

    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert, valid = _local_experts(topk_ids_ptr, offs, num_pairs, num_experts,
                                   local_expert_offset)
    counts = tl.histogram(expert, EXPERTS, mask=valid)
    tl.store(chunk_counts_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS), counts)


@triton.jit
def _align_offsets_kernel(
    chunk_counts_ptr, chunk_base_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_chunks,
    BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK_TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    expert_idx = tl.arange(0, EXPERTS)
    chunk_idx = tl.arange(0, CHUNK_TILE)
    totals = tl.zeros([EXPERTS], dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        rows = c0 + chunk_idx
        tile = tl.load(chunk_counts_ptr + rows[:, None] * EXPERTS + expert_idx[None, :],
                       mask=(rows < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    expert_ends = tl.cumsum(padded, 0)
    expert_starts = expert_ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, 0))

    first_block = expert_starts // BLOCK_M
    num_blocks = padded // BLOCK_M
    for j in range(0, tl.max(num_blocks, 0)):
        tl.store(block_expert_ids_ptr + first_block + j, expert_idx, mask=j < num_blocks)

    # chunk_base[c, e] = where chunk c's first pair of expert e lands, minus the number of
    # chunk c's valid pairs of lower experts (the scatter adds the pair's sorted position).
    carry = tl.zeros([EXPERTS], dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        rows = c0 + chunk_idx
        row_ok = (rows < num_chunks)[:, None]
        tile = tl.load(chunk_counts_ptr + rows[:, None] * EXPERTS + expert_idx[None, :],
                       mask=row_ok, other=0)
        before_in_expert = tl.cumsum(tile, 0) - tile + carry[None, :]
        lower_in_chunk = tl.cumsum(tile, 1) - tile
        base = expert_starts[None, :] + before_in_expert - lower_in_chunk
        tl.store(chunk_base_ptr + rows[:, None] * EXPERTS + expert_idx[None, :], base,
                 mask=row_ok)
        carry += tl.sum(tile, 0)


@triton.jit
def _align_scatter_kernel(
    topk_ids_ptr, chunk_base_ptr, sorted_pair_ids_ptr,
    num_pairs, num_experts, local_expert_offset,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    chunk = tl.program_id(0)
    local_idx = tl.arange(0, CHUNK)
    expert, valid = _local_experts(topk_ids_ptr, chunk * CHUNK + local_idx, num_pairs,
                                   num_experts, local_expert_offset)
    key = tl.where(valid, expert, EXPERTS) * CHUNK + local_idx
    key = tl.sort(key, 0)
    expert_s = key // CHUNK
    valid_s = expert_s < EXPERTS
    base = tl.load(chunk_base_ptr + chunk * EXPERTS + expert_s, mask=valid_s, other=0)
    tl.store(sorted_pair_ids_ptr + base + local_idx, chunk * CHUNK + key % CHUNK, mask=valid_s)


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    local_expert_offset: int = 0,
    small_path_max_pairs: Optional[int] = None,
    chunk_pairs: Optional[int] = None,
) -> AlignedPairs:
    """Group the pairs of topk_ids [T, k] (global ids) by local expert, padded to block_m."""
    aligned, _ = _align(topk_ids, num_experts, block_m, local_expert_offset,
                        small_path_max_pairs, chunk_pairs, None)
    return aligned


def moe_align_gather(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     local_expert_offset: int, x: torch.Tensor
                     ) -> Tuple[AlignedPairs, torch.Tensor]:
    """moe_align, and in the same launch the token rows of x [T, H] in dispatch order: rows
    [max_padded, H] with rows[s] = x[sorted_pair_ids[s] // k] for every live slot s (padding
    slots and those past num_padded unwritten). For at most SMALL_PATH_MAX_PAIRS pairs."""
    num_pairs = topk_ids.numel()
    if num_pairs > SMALL_PATH_MAX_PAIRS:
        raise ValueError(f"moe_align_gather: topk_ids holds {num_pairs} pairs, more than the "
                         f"single-launch path's {SMALL_PATH_MAX_PAIRS}")
    if x.dim() != 2 or x.shape[0] != topk_ids.shape[0] or x.stride(1) != 1:
        raise ValueError(f"moe_align_gather: x must be [num_tokens = {topk_ids.shape[0]}, H] "
                         f"with unit column stride, got shape {tuple(x.shape)}, strides "
                         f"{tuple(x.stride())}")
    aligned, rows = _align(topk_ids, num_experts, block_m, local_expert_offset, None, None, x)
    return aligned, rows


def small_path_plan(num_pairs: int, num_experts: int, block_m: int, device: torch.device):
    """The dispatch's outputs (allocated, unwritten) and the single-program path's constexprs and
    warps for num_pairs pairs (at most SMALL_PATH_MAX_PAIRS), without the gather: what
    _align_single_program_kernel, or the routing kernel running align_pairs, takes."""
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    aligned = AlignedPairs(torch.empty((max_padded,), dtype=torch.int32, device=device),
                           torch.empty((max_padded // block_m,), dtype=torch.int32,
                                       device=device),
                           torch.empty((1,), dtype=torch.int32, device=device))
    pairs_p2 = next_power_of_2(max(num_pairs, 1))
    experts_p2 = next_power_of_2(num_experts)
    constexprs = dict(BLOCK_M=block_m, PAIRS=pairs_p2, EXPERTS=experts_p2, FILL=1024)
    return aligned, constexprs, small_path_warps(num_pairs, num_experts)


def small_path_warps(num_pairs: int, num_experts: int) -> int:
    """Warps of the single-program path (without the gather): 8 for its largest tiles."""
    return 4 if next_power_of_2(max(num_pairs, 1)) * next_power_of_2(num_experts) <= 1 << 16 else 8


def _align(topk_ids, num_experts, block_m, local_expert_offset, small_path_max_pairs,
           chunk_pairs, gather):
    if small_path_max_pairs is None:
        small_path_max_pairs = SMALL_PATH_MAX_PAIRS
    if chunk_pairs is None:
        chunk_pairs = CHUNK_PAIRS
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    pdl, launch = use_pdl(device), pdl_launch_options(device)
    if num_pairs <= small_path_max_pairs and gather is None:
        aligned, constexprs, num_warps = small_path_plan(num_pairs, num_experts, block_m, device)
        sorted_pair_ids = aligned.sorted_pair_ids
        _align_single_program_kernel[(1,)](
            ids, sorted_pair_ids, aligned.block_expert_ids, aligned.num_padded,
            num_pairs, num_experts, local_expert_offset, sorted_pair_ids.numel(),
            aligned.block_expert_ids.numel(), ids, sorted_pair_ids, 1, 0, 0,
            sorted_pair_ids.stride(0), **constexprs, GATHER_H=0, num_warps=num_warps,
            USE_PDL=pdl, **launch)
        return aligned, None
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    max_blocks = max_padded // block_m
    sorted_pair_ids = torch.empty((max_padded,), dtype=torch.int32, device=device)
    block_expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)
    experts_p2 = next_power_of_2(num_experts)
    if num_pairs <= small_path_max_pairs:
        # the small path with the gather: grid over x's columns
        pairs_p2 = next_power_of_2(max(num_pairs, 1))
        h = gather.shape[1]
        top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
        rows = torch.empty((max_padded, h), dtype=gather.dtype, device=device)
        gather_h = max(16, min(GATHER_TILE // pairs_p2, next_power_of_2(max(h, 1)), 256))
        _align_single_program_kernel[(max(1, cdiv(h, gather_h)),)](
            ids, sorted_pair_ids, block_expert_ids, num_padded,
            num_pairs, num_experts, local_expert_offset, max_padded, max_blocks,
            gather, rows, top_k, h, gather.stride(0), rows.stride(0),
            BLOCK_M=block_m, PAIRS=pairs_p2, EXPERTS=experts_p2, FILL=1024, GATHER_H=gather_h,
            # (at 4 warps: at 8 the build is held to 64 registers and spills)
            num_warps=4, USE_PDL=pdl, **launch,
        )
        return AlignedPairs(sorted_pair_ids, block_expert_ids, num_padded), rows

    num_chunks = cdiv(num_pairs, chunk_pairs)
    chunk_counts = torch.empty((num_chunks, experts_p2), dtype=torch.int32, device=device)
    chunk_base = torch.empty((num_chunks, experts_p2), dtype=torch.int32, device=device)
    _align_count_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_pair_ids, block_expert_ids,
        num_pairs, num_experts, local_expert_offset, max_padded, max_blocks,
        cdiv(max_padded, num_chunks), cdiv(max_blocks, num_chunks),
        CHUNK=chunk_pairs, EXPERTS=experts_p2, FILL=1024, num_warps=4, USE_PDL=pdl, **launch,
    )
    _align_offsets_kernel[(1,)](
        chunk_counts, chunk_base, block_expert_ids, num_padded, num_chunks,
        BLOCK_M=block_m, EXPERTS=experts_p2,
        CHUNK_TILE=max(1, min(next_power_of_2(num_chunks), 4096 // experts_p2)),
        num_warps=8, USE_PDL=pdl, **launch,
    )
    _align_scatter_kernel[(num_chunks,)](
        ids, chunk_base, sorted_pair_ids,
        num_pairs, num_experts, local_expert_offset,
        CHUNK=chunk_pairs, EXPERTS=experts_p2, num_warps=4, USE_PDL=pdl, **launch,
    )
    return AlignedPairs(sorted_pair_ids, block_expert_ids, num_padded), None


# ---------------------------------------------------------------- the routed rows, gathered

# Slots a gather_rows program copies (MOE_OPS_GATHER_ROWS, a power of two; 1 by default). With
# one slot a program, each program waits out its dependent loads (the live count, the pair id,
# the row) for one row (Qwen3-30B-A3B's 2 KB of e4m3 at T = 16384: 131072 programs, 178 us for
# 268 MB written, 1.5 TB/s; results/h200_profile_layer_prefill_twentythird.log); several slots
# a program load their pair ids as one vector and their rows side by side. Measured on an H200
# (`bash benchmarks/h200_run.sh gatherrows`, results/h200_ab_gatherrows_*_twentyfourth.json,
# graph replays, two alternated passes, 1 / 4 / 8): Qwen3 fp8 T = 16384 2124-2150 / 2082-2102 /
# 2094-2106 us (that layer's GEMM1 now gathers its rows itself: ws_gemm.GATHER), T = 4096
# within 1%; DeepSeek-V3 fp8_block within its passes' spread (T = 16384: 16965-17086 /
# 16371-18623 / 16201-16934); Qwen3 bf16 T = 4096 763-789 / 794-829 / 807-855 (slower). So 1.
GATHER_ROWS = env_int("MOE_OPS_GATHER_ROWS", 1)
if GATHER_ROWS < 1 or GATHER_ROWS & (GATHER_ROWS - 1):
    raise ValueError(f"MOE_OPS_GATHER_ROWS must be a power of two >= 1, got {GATHER_ROWS}")
# elements of one program's rows a step (ROWS x BLOCK_K) with several slots a program
GATHER_STEP_ELEMENTS = 8192


@triton.jit
def _gather_rows_kernel(src_ptr, src_scale_ptr, dst_ptr, dst_scale_ptr, sorted_pair_ids_ptr,
                        num_padded_ptr, num_pairs, top_k, K, stride_s, stride_d, scale_cols,
                        stride_ss, HAS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
                        SCALE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr, ROWS: tl.constexpr = 1):
    """dst[slot] = src[pair // top_k] (and its row of scale_cols scales: one for fp8, one per 128
    columns for fp8_block) for the live slots; padding slots get zeros, slots past num_padded are
    left alone (the persistent kernels never read them). ROWS slots a program (GATHER_ROWS)."""
    pdl_prologue(USE_PDL)
    if ROWS == 1:
        # (the default; the vector form below measured no faster: see GATHER_ROWS)
        slot = tl.program_id(0)
        if slot >= tl.load(num_padded_ptr):
            return
        pair = tl.load(sorted_pair_ids_ptr + slot)
        valid = pair < num_pairs
        row = (pair // top_k).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            values = tl.load(src_ptr + row * stride_s + cols, mask=(cols < K) & valid, other=0.0)
            tl.store(dst_ptr + slot.to(tl.int64) * stride_d + cols, values, mask=cols < K)
        if HAS_SCALE:
            offs_s = tl.arange(0, SCALE_BLOCK)
            scale = tl.load(src_scale_ptr + row * stride_ss + offs_s,
                            mask=(offs_s < scale_cols) & valid, other=0.0)
            tl.store(dst_scale_ptr + slot.to(tl.int64) * scale_cols + offs_s, scale,
                     mask=offs_s < scale_cols)
    else:
        slots = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = slots < tl.load(num_padded_ptr)
        pairs = tl.load(sorted_pair_ids_ptr + slots, mask=live, other=num_pairs)
        valid = (pairs < num_pairs)[:, None]
        rows = (pairs // top_k).to(tl.int64)[:, None]
        dst_rows = slots.to(tl.int64)[:, None]
        offs = tl.arange(0, BLOCK_K)[None, :]
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            values = tl.load(src_ptr + rows * stride_s + cols, mask=(cols < K) & valid,
                             other=0.0)
            tl.store(dst_ptr + dst_rows * stride_d + cols, values,
                     mask=(cols < K) & live[:, None])
        if HAS_SCALE:
            offs_s = tl.arange(0, SCALE_BLOCK)[None, :]
            scale = tl.load(src_scale_ptr + rows * stride_ss + offs_s,
                            mask=(offs_s < scale_cols) & valid, other=0.0)
            tl.store(dst_scale_ptr + dst_rows * scale_cols + offs_s, scale,
                     mask=(offs_s < scale_cols) & live[:, None])


def gather_rows(a: torch.Tensor, a_scale: Optional[torch.Tensor], routing):
    """GEMM1's token rows (and their fp8 scales: [T] per token, or [T, K/128] per token and
    128-column group) in dispatch order, [slots, K], for a grouped_gemm.Routing: the persistent
    kernels read their activation tiles through TMA, which cannot gather. One read and one write
    of the routed rows (at prefill a few percent of the GEMM's time)."""
    slots = routing.num_slots
    rows = torch.empty((slots, a.shape[1]), dtype=a.dtype, device=a.device)
    scales, scale_cols, stride_ss = None, 0, 0
    if a_scale is not None:
        scales = torch.empty((slots,) + tuple(a_scale.shape[1:]), dtype=a_scale.dtype,
                             device=a.device)
        scale_cols = 1 if a_scale.dim() == 1 else a_scale.shape[1]
        stride_ss = a_scale.stride(0)
    per_program = GATHER_ROWS
    block_k = min(next_power_of_2(a.shape[1]), 2048 if per_program == 1
                  else max(16, GATHER_STEP_ELEMENTS // per_program))
    _gather_rows_kernel[(cdiv(slots, per_program),)](
        a, a_scale if a_scale is not None else a, rows, scales if scales is not None else rows,
        routing.sorted_pair_ids, routing.num_padded, routing.num_pairs, routing.top_k,
        a.shape[1], a.stride(0), rows.stride(0), scale_cols, stride_ss,
        HAS_SCALE=a_scale is not None, BLOCK_K=block_k,
        SCALE_BLOCK=max(1, next_power_of_2(scale_cols)), USE_PDL=use_pdl(a.device),
        ROWS=per_program, num_warps=4, **pdl_launch_options(a.device))
    return rows, scales
