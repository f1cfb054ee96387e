"""Triton routing: router logits -> (topk_ids, topk_weights) for every method of SPEC §1.

One kernel serves all methods; the method is a `tl.constexpr` string, so each method compiles to
its own specialised binary while the selection machinery is written once. Each program routes
BLOCK_T tokens held as a [BLOCK_T, G_PAD, GS_PAD] tile of experts: DeepSeek-V3's groups live on
the middle axis (n_group of them, each of num_experts / n_group experts), and every other method
is the same tile with a single group, so group-limited and plain routing share one code path.

Selection is k passes of "take the best remaining expert". Each expert's selection score is
packed into one int64 key, (order-preserving bits of the float score) << 32 | (2^31-1 - expert),
so a single max reduction per pass finds the best score *and* breaks ties toward the lower
expert index, and a taken expert is knocked out by overwriting its key with a sentinel that is
below every real key (even -inf's), which keeps ids valid and distinct for all -inf / NaN rows.
Padding experts (num_experts is padded to powers of two) hold the sentinel from the start.

Each pass writes its id straight to topk_ids; nothing else is gathered during the passes.
Afterwards the program reads its ids back in a [BLOCK_T, k] layout, reloads the k chosen logits
(cache-hot) and computes the weights from those real values, so NaN only affects selection
through its -inf stand-in while the weights carry the true NaN, as the reference does.

`moe_ops.routing.route_reference` is the oracle; every floating-point step here mirrors its
order of operations so that ids match exactly and weights to float32 rounding.

In a layer call of the fp8 modes (at decode sizes: kernels/experts.py ROUTE_QUANTIZE_MAX_TOKENS)
the same launch also runs act_quant's programs over x (act_quant.quantize_rows_program, in grid
slots after the routing's): the experts' first quantization needs nothing of the routing, so
it runs beside it instead of in a launch of its own after it. Where the routing is one program,
that program can also write the dispatch of the ids it routed (ALIGN: align.align_pairs, the
small path's code) in place of the dispatch's launch (kernels/experts.py ROUTE_ALIGN).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moe_ops.routing import DEEPSEEK_DENOMINATOR_EPS
from moe_ops.kernels.act_quant import plan as act_quant_plan, quantize_rows_program
from moe_ops.kernels.align import (
    SMALL_PATH_MAX_PAIRS, align_pairs, small_path_plan, small_path_warps,
)
from moe_ops.kernels.common import pdl_launch_options, pdl_prologue, use_pdl

# Below the key of any real score (the lowest is -inf's), so a taken or padding expert never wins.
_TAKEN = tl.constexpr(-(2**63 - 1))
# Low half of a key: _INDEX_BIAS - expert, so that a larger key means a lower expert index.
_INDEX_BIAS = tl.constexpr(2**31 - 1)
_DEEPSEEK_EPS = tl.constexpr(DEEPSEEK_DENOMINATOR_EPS)


@triton.jit
def _selection_key(score, index):
    """int64 key ordered by (score, -index); NaN ranks as -inf, -0.0 ties with +0.0."""
    score = tl.where(score != score, float("-inf"), score)
    # -0.0 and +0.0 have different bit patterns but compare equal: make them one tie.
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    # Flipping the magnitude bits of negative floats makes signed-int order match float order.
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) + (-index + _INDEX_BIAS).to(tl.int64)


@triton.jit
def _key_score(key):
    """The float score a key was built from (NaN already mapped to -inf)."""
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key):
    low = key - ((key >> 32) << 32)
    return (-low + _INDEX_BIAS).to(tl.int32)


@triton.jit
def _route_kernel(
    logits_ptr,
    routing_bias_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    num_tokens,
    stride_token,
    stride_expert,
    routed_scaling_factor,
    # act_quant's programs run beside the routing's (QUANTIZE; see triton_route's quantize)
    route_programs, quant_parts, x_ptr, q_ptr, scale_ptr, x_rows, x_cols,
    stride_xm, stride_qm, stride_sm,
    # the dispatch's outputs, written by the routing's single program after it routes (ALIGN)
    sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr, num_local_experts,
    local_expert_offset, max_padded, max_blocks,
    METHOD: tl.constexpr,
    TOP_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    G_PAD: tl.constexpr,
    GS_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    GROUP_K: tl.constexpr = 0, Q_BLOCK_K: tl.constexpr = 16, Q_SPLIT_K: tl.constexpr = False,
    LOAD_FIRST: tl.constexpr = False, SLICE_K: tl.constexpr = 0,
    FAST_DIV: tl.constexpr = False, ROWS: tl.constexpr = 1,
    ALIGN: tl.constexpr = False, A_BLOCK_M: tl.constexpr = 16, PAIRS: tl.constexpr = 1,
    EXPERTS: tl.constexpr = 1, FILL: tl.constexpr = 1024,
):
    """Programs [0, route_programs) route BLOCK_T tokens each; with QUANTIZE the rest are
    act_quant's programs over x (program q: act_quant's grid ids (q // quant_parts,
    q % quant_parts)), which do not depend on the routing and so run beside it. With ALIGN
    the routing is one program, which then writes the dispatch of its ids (align_pairs, the
    small path's work) in place of moe_align's launch."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if QUANTIZE:
        if pid >= route_programs:
            program = pid - route_programs
            quantize_rows_program(program // quant_parts, program % quant_parts, x_ptr, q_ptr,
                                  scale_ptr, x_ptr, 0, x_rows, x_cols, stride_xm, stride_qm,
                                  stride_sm, GROUP_K, Q_BLOCK_K, Q_SPLIT_K, False, LOAD_FIRST,
                                  SLICE_K, FAST_DIV, ROWS)
            return
    # int64 from the start: token * stride overflows int32 for large batches.
    tokens = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens

    groups = tl.arange(0, G_PAD)
    lanes = tl.arange(0, GS_PAD)
    expert = groups[:, None] * GROUP_SIZE + lanes[None, :]  # [G_PAD, GS_PAD]
    expert_mask = (groups[:, None] < N_GROUP) & (lanes[None, :] < GROUP_SIZE)
    expert3 = expert[None, :, :]
    expert_mask3 = expert_mask[None, :, :]

    x = tl.load(
        logits_ptr + tokens[:, None, None] * stride_token + expert3.to(tl.int64) * stride_expert,
        mask=token_mask[:, None, None] & expert_mask3,
        other=0.0,
    ).to(tl.float32)

    # ---- selection scores -------------------------------------------------------------------
    if METHOD == "default" or METHOD == "renormalize_naive":
        # Softmax as the reference computes it: x - rowmax, exp, / sum (an all -inf row gives NaN
        # like torch; selection then sees -inf everywhere and takes the lowest indices).
        x_real = tl.where(expert_mask3, x, float("-inf"))
        row_max = tl.max(tl.max(x_real, axis=2), axis=1)
        unnorm = tl.where(expert_mask3, tl.exp(x_real - row_max[:, None, None]), 0.0)
        row_sum = tl.sum(tl.sum(unnorm, axis=2), axis=1)
        score = unnorm / row_sum[:, None, None]
    elif METHOD == "sigmoid_renorm":
        score = tl.sigmoid(x)
    elif METHOD == "deepseek_v3":
        score = tl.sigmoid(x)
        if HAS_BIAS:
            bias = tl.load(routing_bias_ptr + expert, mask=expert_mask, other=0.0).to(tl.float32)
            score = score + bias[None, :, :]
        # Group score = sum of the group's two best biased scores. Keys are unique per lane, so
        # knocking out the top-1 key removes exactly one expert even among equal scores.
        lane_key = tl.where(expert_mask3, _selection_key(score, lanes[None, None, :]), _TAKEN)
        top1 = tl.max(lane_key, axis=2)
        top2 = tl.max(tl.where(lane_key == top1[:, :, None], _TAKEN, lane_key), axis=2)
        group_score = _key_score(top1) + _key_score(top2)
        group_key = tl.where(groups[None, :] < N_GROUP,
                             _selection_key(group_score, groups[None, :]), _TAKEN)
        for _ in range(TOPK_GROUP):
            best_group = tl.max(group_key, axis=1)
            group_key = tl.where(group_key == best_group[:, None], _TAKEN, group_key)
        # The kept groups are exactly the real groups whose keys were knocked out above.
        kept_group = (group_key == _TAKEN) & (groups[None, :] < N_GROUP)
        # Experts of dropped groups stay selectable at -inf, as in the reference: a token with
        # too few finite scores in its kept groups then falls back to the lowest indices.
        score = tl.where(kept_group[:, :, None], score, float("-inf"))
    else:  # renormalize, topk, llama4: select on the raw logits
        score = x

    # ---- top-k selection --------------------------------------------------------------------
    key = tl.where(expert_mask3, _selection_key(score, expert3), _TAKEN)
    for slot in range(TOP_K):
        best = tl.max(tl.max(key, axis=2), axis=1)
        key = tl.where(key == best[:, None, None], _TAKEN, key)
        # Each id goes straight to memory: accumulating a [BLOCK_T, K] tile here would inherit
        # the reduction's sliced layout, replicated in every thread of the expert axis (hundreds
        # of registers and spills at k >= 64 on sm_90).
        tl.store(topk_ids_ptr + tokens * TOP_K + slot, _key_index(best), mask=token_mask)

    # ---- weights from the real logits of the chosen experts ---------------------------------
    slots = tl.arange(0, K_PAD)
    slot_mask = slots[None, :] < TOP_K
    out_mask = token_mask[:, None] & slot_mask
    out_offsets = tokens[:, None] * TOP_K + slots[None, :]
    # The ids are read back by other threads of this program than those that wrote them; the
    # barrier orders the global stores before the loads (CTA-wide, like membar.cta).
    tl.debug_barrier()
    topk_ids = tl.load(topk_ids_ptr + out_offsets, mask=out_mask, other=0)
    chosen = tl.load(
        logits_ptr + tokens[:, None] * stride_token + topk_ids.to(tl.int64) * stride_expert,
        mask=out_mask,
        other=0.0,
    ).to(tl.float32)
    if METHOD == "default":
        weights = tl.exp(chosen - row_max[:, None]) / row_sum[:, None]
    elif METHOD == "renormalize_naive":
        probs = tl.where(slot_mask, tl.exp(chosen - row_max[:, None]) / row_sum[:, None], 0.0)
        weights = probs / tl.sum(probs, axis=1)[:, None]
    elif METHOD == "renormalize":
        chosen_real = tl.where(slot_mask, chosen, float("-inf"))
        chosen_max = tl.max(chosen_real, axis=1)
        unnorm = tl.where(slot_mask, tl.exp(chosen_real - chosen_max[:, None]), 0.0)
        weights = unnorm / tl.sum(unnorm, axis=1)[:, None]
    elif METHOD == "sigmoid_renorm":
        gates = tl.where(slot_mask, tl.sigmoid(chosen), 0.0)
        weights = gates / tl.sum(gates, axis=1)[:, None]
    elif METHOD == "deepseek_v3":
        # Unbiased sigmoid: the bias only steers selection (SPEC §1).
        gates = tl.where(slot_mask, tl.sigmoid(chosen), 0.0)
        weights = gates / (tl.sum(gates, axis=1)[:, None] + _DEEPSEEK_EPS)
        weights = weights * routed_scaling_factor
    elif METHOD == "llama4":
        weights = tl.sigmoid(chosen)
    else:  # topk
        weights = chosen

    tl.store(topk_weights_ptr + out_offsets, weights, mask=out_mask)

    if ALIGN:
        # Every id was written by this program's threads: the barrier orders those global
        # stores before the dispatch's loads by other threads (as the read back above).
        tl.debug_barrier()
        align_pairs(0, topk_ids_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
                    num_tokens * TOP_K, num_local_experts, local_expert_offset, max_padded,
                    max_blocks, topk_ids_ptr, sorted_pair_ids_ptr, 1, 0, 0, 1, A_BLOCK_M, PAIRS,
                    EXPERTS, FILL, 0)


# Target experts-per-program tile (BLOCK_T * G_PAD * GS_PAD elements): 2048 keeps the int64 key
# tile plus the float scores at ~16 elements per thread with 4 warps, well within registers,
# while packing several tokens per program so small-E routing is not launch/latency bound.
_TILE_ELEMENTS = 2048
# With tiny E the tile rule alone would give thousands of tokens per program and too few
# programs to fill the GPU for mid-size batches; 64 tokens still leaves ~1000 programs at 64K.
_MAX_BLOCK_T = 64


# Up to FIXED_WARPS_MAX_TOKENS tokens the routing launch runs at FIXED_WARPS warps whatever its
# tile, alone or with act_quant's programs or the dispatch beside it (those run at its warps
# then; their results are the same at any count): a launch's warps shape its reductions'
# order, so the weights would otherwise round their last bit differently in a layer call than
# in the routing op (seen on an H200 with the merged launch at act_quant's warp count).
FIXED_WARPS_MAX_TOKENS = 256
FIXED_WARPS = 4


def _route_tile(num_tokens: int, num_experts: int, method: str, n_group: Optional[int]):
    """(groups, group_size, G_PAD, GS_PAD, BLOCK_T, warps) of a launch routing num_tokens."""
    # Every method but DeepSeek-V3's is the one-group case of the same tile.
    groups = n_group if method == "deepseek_v3" else 1
    group_size = num_experts // groups
    g_pad = triton.next_power_of_2(groups)
    gs_pad = triton.next_power_of_2(group_size)
    expert_tile = g_pad * gs_pad
    block_t = max(1, min(_TILE_ELEMENTS // expert_tile, _MAX_BLOCK_T,
                         triton.next_power_of_2(num_tokens)))
    # About 16 key elements per thread; fewer warps for small tiles so threads are not idle
    # (but see FIXED_WARPS).
    num_warps = (FIXED_WARPS if num_tokens <= FIXED_WARPS_MAX_TOKENS
                 else max(1, min(4, block_t * expert_tile // 512)))
    return groups, group_size, g_pad, gs_pad, block_t, num_warps


def routes_in_one_program(num_tokens: int, top_k: int, num_experts: int, method: str,
                          n_group: Optional[int], num_local_experts: int) -> bool:
    """Whether triton_route's routing of num_tokens is one program, so that the same launch can
    write the dispatch of its ids over num_local_experts (`align`: within the single-program
    path's pair bound, at its warps)."""
    block_t = _route_tile(num_tokens, num_experts, method, n_group)[4]
    pairs = num_tokens * top_k
    return (0 < num_tokens <= min(block_t, FIXED_WARPS_MAX_TOKENS)
            and pairs <= SMALL_PATH_MAX_PAIRS
            and small_path_warps(pairs, num_local_experts) <= FIXED_WARPS)


def triton_route(
    router_logits: torch.Tensor,
    method: str,
    top_k: int,
    routing_bias: Optional[torch.Tensor] = None,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    quantize: Optional[tuple[torch.Tensor, str]] = None,
    align: Optional[tuple[int, int, int]] = None,
) -> tuple:
    """Route on the GPU in one launch. Returns (topk_ids int32 [T, k], topk_weights float32 [T, k]).

    Arguments are assumed already checked by moe_ops.routing.validate_route_call.
    `out`, if given, is a pair of contiguous (topk_ids int32, topk_weights float32) [T, k]
    tensors on the logits' device to write into (every element is overwritten).
    `quantize` = (x, quant), x a contiguous [M, K] tensor and quant "fp8" or "fp8_block": the
    same launch also quantizes x's rows as act_quant(x, quant) does (its programs, the same
    codes and scales), in programs of its grid beside the routing's; (q, scales) follow the ids
    and weights in the result then. Why: the fp8 modes' experts call starts with act_quant(x),
    which needs nothing of the routing, and at decode each launch costs more in latency than in
    work (kernels/experts.py ROUTE_QUANTIZE_MAX_TOKENS).
    `align` = (num_local_experts, block_m, local_expert_offset), where routes_in_one_program:
    the routing's program then also writes moe_align's dispatch of the ids (the same bytes as
    its single-program path), returned last (an AlignedPairs): the dispatch's launch saved.
    """
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    if out is None:
        topk_ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
        topk_weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    else:
        topk_ids, topk_weights = out
    result = [topk_ids, topk_weights]
    if (quantize is not None or align is not None) and num_tokens > FIXED_WARPS_MAX_TOKENS:
        raise ValueError(f"triton_route: quantize and align need at most "
                         f"{FIXED_WARPS_MAX_TOKENS} tokens, got {num_tokens}")
    if quantize is not None:
        x, quant = quantize
        q, scales, quant_launch = act_quant_plan(x, quant)
        result += [q, scales]
    if align is not None:
        num_local_experts, block_m, local_expert_offset = align
        if not routes_in_one_program(num_tokens, top_k, num_experts, method, n_group,
                                     num_local_experts):
            raise ValueError(f"triton_route: align needs the routing in one program, not "
                             f"{num_tokens} tokens of {num_experts} experts ({method})")
        aligned, align_constexprs, _ = small_path_plan(
            num_tokens * top_k, num_local_experts, block_m, device)
        result.append(aligned)
    if num_tokens == 0:
        return tuple(result)

    groups, group_size, g_pad, gs_pad, block_t, num_warps = _route_tile(
        num_tokens, num_experts, method, n_group)
    groups_kept = topk_group if method == "deepseek_v3" else 1
    has_bias = method == "deepseek_v3" and routing_bias is not None
    bias = routing_bias.contiguous() if has_bias else router_logits  # dummy pointer if unused

    route_programs = triton.cdiv(num_tokens, block_t)
    constexprs = {}
    if quantize is None:
        quant_args = (0, 1, router_logits, router_logits, router_logits, 0, 0, 0, 0, 0)
        quant_programs = 0
    else:
        quant_args = (route_programs, quant_launch.grid[1] if len(quant_launch.grid) > 1 else 1,
                      x, q, scales, x.shape[0], x.shape[1], x.stride(0), q.stride(0),
                      quant_launch.stride_sm)
        quant_programs = quant_launch.programs
        c = quant_launch.constexprs
        constexprs.update(QUANTIZE=True, GROUP_K=c["GROUP_K"], Q_BLOCK_K=c["BLOCK_K"],
                          Q_SPLIT_K=c["SPLIT_K"], LOAD_FIRST=c["LOAD_FIRST"],
                          SLICE_K=c["SLICE_K"], FAST_DIV=c["FAST_DIV"], ROWS=c["ROWS"])
        # (at the routing's FIXED_WARPS, not act_quant's rule: the same codes)
    if align is None:
        align_args = (topk_ids, topk_ids, topk_ids, 0, 0, 0, 0)
    else:
        align_args = (aligned.sorted_pair_ids, aligned.block_expert_ids, aligned.num_padded,
                      num_local_experts, local_expert_offset, aligned.sorted_pair_ids.numel(),
                      aligned.block_expert_ids.numel())
        constexprs.update(ALIGN=True, A_BLOCK_M=align_constexprs["BLOCK_M"],
                          PAIRS=align_constexprs["PAIRS"], EXPERTS=align_constexprs["EXPERTS"],
                          FILL=align_constexprs["FILL"])
    _route_kernel[(route_programs + quant_programs,)](
        router_logits,
        bias,
        topk_ids,
        topk_weights,
        num_tokens,
        router_logits.stride(0),
        router_logits.stride(1),
        float(routed_scaling_factor),
        *quant_args,
        *align_args,
        METHOD=method,
        TOP_K=top_k,
        N_GROUP=groups,
        GROUP_SIZE=group_size,
        TOPK_GROUP=groups_kept,
        HAS_BIAS=has_bias,
        BLOCK_T=block_t,
        G_PAD=g_pad,
        GS_PAD=gs_pad,
        K_PAD=triton.next_power_of_2(top_k),
        USE_PDL=use_pdl(device),
        num_warps=num_warps,
        **constexprs,
        **pdl_launch_options(device),
    )
    return tuple(result)
