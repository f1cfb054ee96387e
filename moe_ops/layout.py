"""Checkpoint layout -> kernel layout, through cached row-permutation indices (SPEC §5).

The checkpoint gives gate `w1 [E, I, H]`, up `w3 [E, I, H]` and down `w2 [E, H, I]`, each with
its own scales. The kernels want gate and up rows *interleaved* in one tensor
`w13 [E, 2I, H]` (row 2i = gate i, row 2i+1 = up i), so that one GEMM1 output tile holds gate and
up of the same intermediate columns and the activation runs in the GEMM's epilogue with no
second pass. Every per-row companion of w13 (its scales, nvfp4's global scale expanded per row,
mxfp4's row scale from the fold of its block scales, its bias) follows the same row order;
fp8_block's scales have one row per 128 weight rows and interleave at that granularity.

Each kernel-layout tensor (a *role*: "w13", "w13_scale", ...) is filled by one `index_copy_` per
source along the row axis, driven by an int64 index `destination_rows` that says where each
source row lands. The index depends only on the `LayoutKey` (role, shapes, dtype/packing,
interleave granularity, scale block, layout version, device) and is computed once per key and
cached. A FusedMoE holds the indices it used as non-persistent buffers, so reloading weights
(an RL weight sync) is one device-side copy per tensor and never recomputes an index.

Quantize-on-load (high-precision checkpoint into a quantized mode) happens here too: the kernel
layout is always what the kernels (and the reference) read. The quantization is deferred to
`load_into` (a `Quantized` source) so that on the GPU it runs fused with the permutation
(kernels/prepare.py: one read of the checkpoint, one write of the layout, no temporary the size
of a weight; a per-expert scale (fp8, nvfp4's global scale) needs the expert's amax first, a
second read, by a launch of its own; see `_device_parts`); elsewhere, and as the
oracle, moe_ops.quant's reference functions run on bounded expert chunks and `index_copy_`
places the rows. Both give the same bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from moe_ops import quant as q
from moe_ops.errors import check

# Bump when the meaning of a LayoutKey's index changes: cached indices then never match.
# 2: packed fp4 rows in quant.py's kernel order, padded to a multiple of FP4_K_ALIGN columns.
LAYOUT_VERSION = 2

# Gate and up rows alternate one by one: the fused GEMM1 epilogue splits an accumulator tile
# [BM, BN] into [BM, BN/2, 2] whatever BN is, so the layout needs no tile size.
GATE_UP_INTERLEAVE_ROWS = 1

ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai", "relu2")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_gated(activation: str) -> bool:
    return activation != "relu2"


@dataclass(frozen=True)
class LayoutKey:
    """Every input of one row-permutation index. Two different layouts never share an entry."""

    role: str  # kernel-layout tensor: "w13", "w13_scale", "w13_global_scale", "b13", "w2", ...
    source_rows: tuple[int, ...]  # rows of each source along the permuted axis (gate, up)
    row_shape: tuple[int, ...]  # shape of one row (elements after packing), () for scalars
    dtype: str  # storage dtype of the kernel-layout tensor
    packing: str  # "e2m1x2-kernel": fp4 pairs in quant.py's kernel order; "padded" (fp4
    # block scales, rows padded like their weight's); "none" otherwise
    interleave_rows: int  # gate/up alternate every this many rows; 0 = sources concatenated
    rows_per_entry: int  # weight rows one row of this tensor stands for (128 for block scales)
    layout_version: int
    device: str


_PERMUTATION_CACHE: dict[LayoutKey, torch.Tensor] = {}
# Counts index computations (not cache hits): tests use it to prove reloads recompute nothing.
permutation_computations = 0


def _compute_destination_rows(key: LayoutKey) -> torch.Tensor:
    """int64 [sum(source_rows)]: the kernel-layout row each source row (in source order) lands on."""
    global permutation_computations
    permutation_computations += 1
    if key.interleave_rows == 0 or len(key.source_rows) == 1:
        return torch.arange(sum(key.source_rows), dtype=torch.int64, device=key.device)
    gate_rows, up_rows = key.source_rows
    check(gate_rows == up_rows, "w3", f"as many rows as w1 ({gate_rows})", up_rows)
    g = key.interleave_rows
    row = torch.arange(gate_rows, dtype=torch.int64)
    chunk, offset = row // g, row % g
    # A chunk holds g gate rows then g up rows; the last chunk may be shorter.
    chunk_len = torch.clamp(gate_rows - chunk * g, max=g)
    gate_dst = chunk * 2 * g + offset
    up_dst = gate_dst + chunk_len
    return torch.cat((gate_dst, up_dst)).to(key.device)


def row_permutation(key: LayoutKey) -> torch.Tensor:
    """The cached destination-row index of `key` (computed on first use)."""
    index = _PERMUTATION_CACHE.get(key)
    if index is None:
        index = _compute_destination_rows(key)
        _PERMUTATION_CACHE[key] = index
    return index


def clear_permutation_cache() -> None:
    _PERMUTATION_CACHE.clear()


# Temporaries of the preparation are bounded by working on expert chunks of about this many
# bytes: a checkpoint tensor that must change device or dtype first, and the float32 copies the
# reference quantization makes.
CHUNK_BYTES = 256 << 20


def expert_chunks(num_experts: int, per_expert: int, budget: int = CHUNK_BYTES):
    """(start, end) ranges of whole experts of about `budget` (in the unit of `per_expert`:
    bytes, elements) each, at least one expert: bounds the temporaries of per-expert work."""
    step = max(1, budget // max(per_expert, 1))
    for start in range(0, num_experts, step):
        yield start, min(num_experts, start + step)


def device_kernels_available(device: torch.device) -> bool:
    """Whether `load_into` can use the device preparation kernels for tensors on `device`:
    CUDA, triton importable, and not inside a torch.compile trace (the plain-torch path traces)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    try:
        import moe_ops.kernels.prepare  # noqa: F401
    except ImportError:
        return False
    return True


def apply_permutation(
    destination: torch.Tensor, sources: list[torch.Tensor], destination_rows: torch.Tensor,
    *, kernels: bool = False,
) -> None:
    """Write `sources` (concatenated along dim 1) into `destination` in place, row i of the
    concatenation to row destination_rows[i]. In place, so parameters keep their addresses
    (CUDA graphs captured before a weight sync stay valid).

    A source on another device or of another dtype is converted one expert chunk at a time, so
    the temporary stays bounded. With `kernels`, 3-D sources are moved by the device scatter
    kernel (bit for bit, any strides); otherwise by `index_copy_`.
    """
    start = 0
    for source in sources:
        rows = source.shape[1]
        index = destination_rows[start:start + rows]
        start += rows
        fp4 = isinstance(source, NaturalFp4)
        if fp4:
            source = source.packed
        same = source.device == destination.device and source.dtype == destination.dtype
        per_expert = source[0].numel() * destination.element_size() if source.shape[0] else 0
        chunks = ([(0, source.shape[0])] if same and not (fp4 and not kernels)
                  else expert_chunks(source.shape[0], per_expert))
        for e0, e1 in chunks:
            chunk = source[e0:e1].to(device=destination.device, dtype=destination.dtype)
            target = destination[e0:e1]
            if kernels and chunk.dim() == 3:
                from moe_ops.kernels import prepare

                # Whole rows, padding included (fp4 rows padded to Kp columns: zeros).
                if fp4:
                    prepare.scatter_fp4_rows(chunk, target, index)
                else:
                    prepare.scatter_rows(chunk, target, index)
                continue
            if fp4:
                chunk = q.fp4_to_kernel_order(chunk)
            if destination.dtype == q.FP8_DTYPE:
                # index_copy_ has no float8 kernel; the bytes are what we move, bit for bit.
                target, chunk = target.view(torch.uint8), chunk.contiguous().view(torch.uint8)
            if chunk.dim() == 3 and chunk.shape[-1] < target.shape[-1]:
                # fp4 block scales of a padded row: the padding is zero
                chunk = torch.nn.functional.pad(chunk, (0, target.shape[-1] - chunk.shape[-1]))
            target.index_copy_(1, index, chunk)


# ---------------------------------------------------------------------------------------------
# The kernel layout of one layer configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """One kernel-layout tensor: its shape, dtype and the key of its row permutation."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    key: LayoutKey

    def new_tensor(self, device: torch.device | str) -> torch.Tensor:
        """An uninitialized tensor of this spec. Every load writes whole rows, the zero padding
        of fp4 rows included (the GEMMs read it unmasked), so nothing is written here."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_layout(
    *,
    quant: str,
    activation: str,
    num_local_experts: int,
    hidden_size: int,
    intermediate_size: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, TensorSpec]:
    """The kernel-layout tensors (role -> spec) for one layer configuration."""
    e, h, i = num_local_experts, hidden_size, intermediate_size
    gated = is_gated(activation)
    device = str(torch.device(device))
    specs: dict[str, TensorSpec] = {}

    def add(role: str, rows: int, row_shape: tuple[int, ...], dtype_: torch.dtype,
            interleaved: bool, packing: str = "none", rows_per_entry: int = 1) -> None:
        sources = (rows, rows) if interleaved else (rows,)
        key = LayoutKey(role, sources, row_shape, _dtype_name(dtype_), packing,
                        GATE_UP_INTERLEAVE_ROWS if interleaved else 0, rows_per_entry,
                        LAYOUT_VERSION, device)
        specs[role] = TensorSpec((e, sum(sources)) + row_shape, dtype_, key)

    fp4 = quant in ("nvfp4", "mxfp4")
    if fp4:
        block = q.fp4_scale_block(quant)
        check(h % block == 0, "hidden_size", f"a multiple of {block} for quant={quant!r}", h)
        check(i % block == 0, "intermediate_size", f"a multiple of {block} for quant={quant!r}", i)
    weight_dtype = {"none": dtype, "fp8": q.FP8_DTYPE, "fp8_block": q.FP8_DTYPE}.get(quant, torch.uint8)
    if fp4:
        # quant.py's kernel order: rows of K codes padded to Kp = fp4_padded_k(K)
        hp, ip = q.fp4_padded_k(h), q.fp4_padded_k(i)
        add("w13", i, (hp // 2,), weight_dtype, gated, "e2m1x2-kernel")
        add("w2", h, (ip // 2,), weight_dtype, False, "e2m1x2-kernel")
    else:
        add("w13", i, (h,), weight_dtype, gated)
        add("w2", h, (i,), weight_dtype, False)
    if quant == "fp8":
        # Per-tensor scales expanded to one per row: the kernel reads a per-channel vector.
        add("w13_scale", i, (), torch.float32, gated)
        add("w2_scale", h, (), torch.float32, False)
    elif quant == "fp8_block":
        b = q.FP8_BLOCK
        add("w13_scale", -(-i // b), (-(-h // b),), torch.float32, gated, rows_per_entry=b)
        add("w2_scale", -(-h // b), (-(-i // b),), torch.float32, False, rows_per_entry=b)
    elif fp4:
        b = q.fp4_scale_block(quant)
        scale_dtype = q.FP8_DTYPE if quant == "nvfp4" else torch.uint8
        add("w13_scale", i, (hp // b,), scale_dtype, gated, "padded")
        add("w2_scale", h, (ip // b,), scale_dtype, False, "padded")
        # nvfp4: the checkpoint's global scale, per row; mxfp4: the fold of each row's block
        # scales (quant.mxfp4_fold_scales), written by load_into after the scales
        add("w13_global_scale", i, (), torch.float32, gated)
        add("w2_global_scale", h, (), torch.float32, False)
    if bias:
        add("b13", i, (), torch.float32, gated)
        add("b2", h, (), torch.float32, False)
    return specs


def allocate(specs: dict[str, TensorSpec], device: torch.device | str) -> dict[str, torch.Tensor]:
    return {role: spec.new_tensor(device) for role, spec in specs.items()}


# ---------------------------------------------------------------------------------------------
# Checkpoint tensors -> per-role sources (validated; quantized when given in high precision)
# ---------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """What `load_weights` takes, in the checkpoint layout of SPEC §1."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: Optional[torch.Tensor] = None
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w3_scale: Optional[torch.Tensor] = None
    w1_global_scale: Optional[torch.Tensor] = None
    w2_global_scale: Optional[torch.Tensor] = None
    w3_global_scale: Optional[torch.Tensor] = None
    b1: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    b3: Optional[torch.Tensor] = None


def _check_tensor(value, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    check(isinstance(value, torch.Tensor), name, "a torch.Tensor", type(value).__name__)
    check(tuple(value.shape) == shape, name, f"shape {list(shape)}", list(value.shape))
    check(value.dtype in dtypes, name, "dtype " + " or ".join(_dtype_name(d) for d in dtypes),
          _dtype_name(value.dtype))


@dataclass(frozen=True, eq=False)
class Quantized:
    """One part ("value", "scale" or "global_scale") of a high-precision checkpoint matrix
    quantized to `quant`, a source whose quantization `load_into` performs on the way into the
    kernel layout (fused with the permutation on the GPU)."""

    weight: torch.Tensor  # [E, N, K] float, the checkpoint matrix
    quant: str
    part: str


@dataclass(frozen=True, eq=False)
class NaturalFp4:
    """A pre-quantized fp4 checkpoint matrix (natural packing, [E, N, K/2]): a source that
    `apply_permutation` re-orders into quant.py's kernel order on the way in."""

    packed: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.packed.shape


def _is_prequantized(weight: torch.Tensor, quant: str) -> bool:
    if quant in ("fp8", "fp8_block"):
        return weight.dtype == q.FP8_DTYPE
    if quant in ("nvfp4", "mxfp4"):
        return weight.dtype == torch.uint8
    return False


def _weight_sources(ckpt: Checkpoint, name: str, quant: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """One checkpoint matrix (w1, w2 or w3) -> its kernel-layout pieces, validated."""
    weight = getattr(ckpt, name)
    scale = getattr(ckpt, name + "_scale")
    global_scale = getattr(ckpt, name + "_global_scale")
    e = weight.shape[0]
    prequantized = _is_prequantized(weight, quant)
    if not prequantized:
        _check_tensor(weight, name, (e, rows, cols), FLOAT_DTYPES)
        check(scale is None, name + "_scale", f"None: {name} is given in high precision and is "
              "quantized on load", "a tensor")
        check(global_scale is None, name + "_global_scale", f"None: {name} is given in high "
              "precision and is quantized on load", "a tensor")
    if quant != "nvfp4":
        check(global_scale is None, name + "_global_scale",
              f"None: quant={quant!r} has no global scale", "a tensor")
    if quant == "none":
        check(scale is None, name + "_scale", "None for quant='none'", "a tensor")
        return {"value": weight}
    if not prequantized:
        parts = ("value", "scale") + (("global_scale",) if quant == "nvfp4" else ())
        return {part: Quantized(weight, quant, part) for part in parts}
    if quant == "fp8":
        _check_tensor(weight, name, (e, rows, cols), (q.FP8_DTYPE,))
        _check_tensor(scale, name + "_scale", (e,), (torch.float32,))
        return {"value": weight, "scale": scale[:, None].expand(e, rows)}
    if quant == "fp8_block":
        b = q.FP8_BLOCK
        _check_tensor(weight, name, (e, rows, cols), (q.FP8_DTYPE,))
        _check_tensor(scale, name + "_scale", (e, -(-rows // b), -(-cols // b)), (torch.float32,))
        return {"value": weight, "scale": scale}
    # nvfp4 / mxfp4
    block = q.fp4_scale_block(quant)
    _check_tensor(weight, name, (e, rows, cols // 2), (torch.uint8,))
    scale_dtype = q.FP8_DTYPE if quant == "nvfp4" else torch.uint8
    _check_tensor(scale, name + "_scale", (e, rows, cols // block), (scale_dtype,))
    pieces = {"value": NaturalFp4(weight), "scale": scale}
    if quant == "nvfp4":
        _check_tensor(global_scale, name + "_global_scale", (e,), (torch.float32,))
        pieces["global_scale"] = global_scale[:, None].expand(e, rows)
    return pieces


def checkpoint_sources(
    ckpt: Checkpoint,
    *,
    quant: str,
    activation: str,
    num_local_experts: int,
    hidden_size: int,
    intermediate_size: int,
    bias: bool,
) -> dict[str, list[torch.Tensor]]:
    """Validate a checkpoint and return, per kernel-layout role, its sources in row order."""
    e, h, i = num_local_experts, hidden_size, intermediate_size
    gated = is_gated(activation)
    for name, rows, cols in (("w1", i, h), ("w2", h, i)) + ((("w3", i, h),) if gated else ()):
        weight = getattr(ckpt, name)
        check(isinstance(weight, torch.Tensor), name, "a torch.Tensor", type(weight).__name__)
        check(weight.dim() == 3 and weight.shape[0] == e, name,
              f"a 3-D tensor with {e} experts (num_local_experts) first", list(weight.shape))
    if not gated:
        # Nothing given is dropped silently: a not-gated layer takes no up-projection tensor.
        for name in ("w3", "w3_scale", "w3_global_scale", "b3"):
            check(getattr(ckpt, name) is None, name, "None with activation='relu2' (not gated)",
                  "a tensor")
    prequantized = {_is_prequantized(getattr(ckpt, n), quant) for n in (("w1", "w2", "w3") if gated else ("w1", "w2"))}
    check(len(prequantized) == 1, "w1, w2, w3", "all quantized or all high precision", "a mix")

    pieces = {name: _weight_sources(ckpt, name, quant, rows, cols)
              for name, rows, cols in (("w1", i, h), ("w2", h, i)) + ((("w3", i, h),) if gated else ())}
    up = ("w1", "w3") if gated else ("w1",)
    sources: dict[str, list[torch.Tensor]] = {
        "w13": [pieces[n]["value"] for n in up],
        "w2": [pieces["w2"]["value"]],
    }
    if "scale" in pieces["w1"]:
        sources["w13_scale"] = [pieces[n]["scale"] for n in up]
        sources["w2_scale"] = [pieces["w2"]["scale"]]
    if "global_scale" in pieces["w1"]:
        sources["w13_global_scale"] = [pieces[n]["global_scale"] for n in up]
        sources["w2_global_scale"] = [pieces["w2"]["global_scale"]]
    elif quant == "mxfp4":
        # derived from the block scales, not read from the checkpoint (load_into's fold)
        sources["w13_global_scale"], sources["w2_global_scale"] = [], []
    biases = (("b1", (e, i)), ("b2", (e, h))) + ((("b3", (e, i)),) if gated else ())
    if bias:
        for name, shape in biases:
            _check_tensor(getattr(ckpt, name), name, shape, FLOAT_DTYPES)
        sources["b13"] = [getattr(ckpt, n) for n in (("b1", "b3") if gated else ("b1",))]
        sources["b2"] = [ckpt.b2]
    else:
        for name, _ in biases:
            check(getattr(ckpt, name) is None, name, "None: the layer was built with bias=False", "a tensor")
    return sources


def _scale_rows(quant: str, rows: int) -> int:
    """Rows of the scale tensor of a matrix with `rows` rows (fp8_block: one per 128)."""
    return -(-rows // q.FP8_BLOCK) if quant == "fp8_block" else rows


def _reference_parts(weight: torch.Tensor, quant: str) -> dict[str, torch.Tensor]:
    """moe_ops.quant's reference quantization of weight [E, N, K], per kernel-layout part (the
    per-expert scales of fp8 and nvfp4's global scale expanded to one per row)."""
    e, rows = weight.shape[:2]
    if quant == "fp8":
        value, scale = q.quantize_fp8_per_tensor(weight)
        return {"value": value, "scale": scale[:, None].expand(e, rows)}
    if quant == "fp8_block":
        value, scale = q.quantize_fp8_block(weight)
        return {"value": value, "scale": scale}
    k = weight.shape[2]
    if quant == "nvfp4":
        value, scale, global_scale = q.quantize_nvfp4(weight)
        return {"value": q.fp4_to_kernel_order(value), "scale": q.fp4_pad_scales(scale, k, quant),
                "global_scale": global_scale[:, None].expand(e, rows)}
    value, scale = q.quantize_mxfp4(weight)
    return {"value": q.fp4_to_kernel_order(value), "scale": q.fp4_pad_scales(scale, k, quant)}


def _nvfp4_chain(destination: dict[str, torch.Tensor], sources: dict[str, list]) -> dict:
    """The nvfp4 matrices load_into quantizes on the device, in its order: {id(matrix): the
    next one}. Each quantizing launch reduces the next matrix's amax beside its own work
    (prepare.quantize_scatter's next_weight), so only the first needs an amax pass of its own."""
    from moe_ops.kernels import prepare

    if prepare.NVFP4_FUSED_AMAX:
        return {}
    order = []
    for role, tensor in destination.items():
        for source in sources[role]:
            if (isinstance(source, Quantized) and source.part == "value"
                    and source.quant == "nvfp4" and source.weight.device == tensor.device):
                order.append(source.weight)
    return {id(a): b for a, b in zip(order, order[1:])}


def _device_parts(weight: torch.Tensor, quant: str, targets: dict[str, torch.Tensor],
                  indices: dict[str, torch.Tensor], amax: Optional[torch.Tensor] = None,
                  next_weight: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The fused device path: quantize weight [E, N, K] straight into the kernel layout, in one
    launch (fp8_block, mxfp4) or, for a per-expert scale computed on the host side, an amax
    launch first (fp8, nvfp4; with prepare.NVFP4_FUSED_AMAX on, measured slower and off by
    default, nvfp4's amax pass runs inside its quantizing launch). amax: weight's per-expert
    amax where an earlier launch reduced it; next_weight: the matrix whose amax this launch
    reduces beside its own work, returned (see _nvfp4_chain)."""
    from moe_ops.kernels import prepare

    e, rows = weight.shape[:2]
    if quant == "nvfp4" and prepare.NVFP4_FUSED_AMAX and "scale" in targets:
        # One launch: the per-expert amax, the global scale (the reference's expression,
        # quant.nvfp4_global_scale, computed in the kernel) and the quantization. The global
        # scales come back as a device tensor the kernel wrote: the copy below is stream-ordered
        # after it, no synchronization.
        global_scale = prepare.quantize_scatter_nvfp4(weight, targets["value"], indices["value"],
                                                      targets["scale"], indices["scale"])
        if "global_scale" in targets:
            targets["global_scale"].index_copy_(1, indices["global_scale"],
                                                global_scale[:, None].expand(e, rows))
        return None
    factor = factor2 = None
    if quant in ("fp8", "nvfp4"):
        # The per-expert factors by the reference's own expressions, from an exact amax (a
        # pass of its own before the quantization, unless the previous launch reduced it).
        if amax is None:
            amax = prepare.amax_per_expert(weight)
        if quant == "fp8":
            factor, per_row = q._inverse_scale(amax), q._exact_div(amax, q.FP8_MAX)
            role = "scale"
        else:
            factor, factor2 = q.nvfp4_global_scale(amax)
            per_row, role = factor, "global_scale"
        if role in targets:
            targets[role].index_copy_(1, indices[role], per_row[:, None].expand(e, rows))
    block_scales = quant != "fp8" and "scale" in targets
    return prepare.quantize_scatter(weight, quant, targets["value"], indices["value"],
                                    targets["scale"] if block_scales else None,
                                    indices["scale"] if block_scales else None, factor, factor2,
                                    next_weight=next_weight)


def _quantize_into(
    role: str,
    destination: dict[str, torch.Tensor],
    sources: dict[str, list],
    permutations: dict[str, torch.Tensor],
    kernels: bool,
    chain: Optional[dict] = None,
    amaxes: Optional[dict] = None,
) -> None:
    """Quantize the `Quantized` sources of value role `role` ("w13" or "w2") into it and into
    its companion roles (`<role>_scale`, `<role>_global_scale`), through their permutations.
    chain (_nvfp4_chain) and amaxes (by id of a matrix, the amaxes earlier launches reduced):
    the matrices whose amax a launch reduces for the next one."""
    chain = chain if chain is not None else {}
    amaxes = amaxes if amaxes is not None else {}
    roles = {"value": role}
    roles.update({part: f"{role}_{part}" for part in ("scale", "global_scale")
                  if f"{role}_{part}" in destination})
    starts = dict.fromkeys(roles, 0)
    value_dst = destination[role]
    for source in sources[role]:
        weight, quant = source.weight, source.quant
        e, rows = weight.shape[:2]
        counts = {part: _scale_rows(quant, rows) if part == "scale" else rows for part in roles}
        indices = {part: permutations[r][starts[part]:starts[part] + counts[part]]
                   for part, r in roles.items()}
        for part in roles:
            starts[part] += counts[part]
        same = weight.device == value_dst.device
        chunks = ([(0, e)] if kernels and same else
                  # float32 copies of the chunk: the reference makes several
                  expert_chunks(e, weight[0].numel() * (weight.element_size() if kernels else 4)))
        for e0, e1 in chunks:
            chunk = weight[e0:e1].to(value_dst.device)
            targets = {part: destination[r][e0:e1] for part, r in roles.items()}
            if kernels:  # whole rows, the fp4 padding included
                # (on the destination's device the matrix is one chunk: the chain's amaxes are
                # whole matrices, as _nvfp4_chain only takes those)
                following = chain.get(id(weight)) if same else None
                next_amax = _device_parts(chunk, quant, targets, indices,
                                          amaxes.pop(id(weight), None) if same else None,
                                          following)
                if following is not None:
                    amaxes[id(following)] = next_amax
                continue
            for part, tensor in _reference_parts(chunk, quant).items():
                if part in targets:
                    apply_permutation(targets[part], [tensor], indices[part])


def load_into(
    destination: dict[str, torch.Tensor],
    sources: dict[str, list],
    permutations: dict[str, torch.Tensor],
    *,
    kernels: Optional[bool] = None,
) -> None:
    """Fill every kernel-layout tensor from its sources through its permutation.

    `kernels`: use the device preparation kernels (kernels/prepare.py); None = where available
    (CUDA tensors, see `device_kernels_available`). True on CPU tensors runs them in the Triton
    interpreter (TRITON_INTERPRET=1), which is how their bytes are tested against the reference.
    """
    if kernels is None:
        devices = {t.device for t in destination.values()}
        kernels = len(devices) == 1 and device_kernels_available(devices.pop())
    chain, amaxes = (_nvfp4_chain(destination, sources) if kernels else {}), {}
    for role, tensor in destination.items():
        role_sources = sources[role]
        if role_sources and isinstance(role_sources[0], Quantized):
            if role_sources[0].part == "value":  # the other parts are written with it
                _quantize_into(role, destination, sources, permutations, kernels, chain, amaxes)
            continue
        apply_permutation(tensor, role_sources, permutations[role], kernels=kernels)
    for role in ("w13", "w2"):
        scale, row_scale = destination.get(f"{role}_scale"), destination.get(f"{role}_global_scale")
        if row_scale is not None and scale.dtype == torch.uint8:  # mxfp4
            fold_mxfp4_scales(scale, row_scale, kernels=kernels)


def fold_mxfp4_scales(scale: torch.Tensor, row_scale: torch.Tensor, *, kernels: bool) -> None:
    """mxfp4's kernel-layout block scales [E, N, G] folded in place to at most
    quant.MXFP4_FOLD_MAX, each row's excess written to row_scale [E, N] as a power of two
    (quant.mxfp4_fold_scales; for any real checkpoint the bytes stay and the row scales are 1).
    On the device one launch reads the scales (a sixteenth of the packed weights' bytes) and
    writes only rows that change."""
    if kernels:
        from moe_ops.kernels import prepare

        prepare.fold_mxfp4_scales(scale, row_scale)
        return
    for e0, e1 in expert_chunks(scale.shape[0], scale[0].numel() * 8):
        folded, factor = q.mxfp4_fold_scales(scale[e0:e1])
        scale[e0:e1].copy_(folded)
        row_scale[e0:e1].copy_(factor)


def prepare_weights(
    *,
    quant: str = "none",
    activation: str = "swiglu",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    **checkpoint: Optional[torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (the keywords of `load_weights`) -> the kernel-layout tensors that
    `moe_ops.fused_moe` takes, for callers that keep their own weights."""
    unknown = set(checkpoint) - {f.name for f in dataclasses.fields(Checkpoint)}
    check(not unknown, "prepare_weights", "checkpoint tensors named as in load_weights", sorted(unknown))
    ckpt = Checkpoint(**checkpoint)
    check(isinstance(ckpt.w1, torch.Tensor) and ckpt.w1.dim() == 3, "w1", "a 3-D tensor [E, I, H]",
          getattr(ckpt.w1, "shape", ckpt.w1))
    e, i, h = ckpt.w1.shape
    if quant in ("nvfp4", "mxfp4") and ckpt.w1.dtype == torch.uint8:
        h *= 2
    device = torch.device(device) if device is not None else ckpt.w1.device
    config = dict(quant=quant, activation=activation, num_local_experts=e, hidden_size=h,
                  intermediate_size=i, bias=ckpt.b1 is not None)
    specs = plan_layout(**config, dtype=dtype, device=device)
    sources = checkpoint_sources(ckpt, **config)
    destination = allocate(specs, device)
    load_into(destination, sources, {role: row_permutation(s.key) for role, s in specs.items()})
    return destination


def w13_scale_rows(num_rows: int, gated: bool, rows_per_entry: int) -> torch.Tensor:
    """For each w13 row of the kernel layout, the row of its block-scale tensor (fp8_block).

    Kernel row r is gate/up row r//2 (gated); block b of gate rows sits at scale row 2b, of up
    rows at 2b+1. Used by the reference to dequantize; the kernels compute the same inline.
    """
    row = torch.arange(num_rows)
    if not gated:
        return row // rows_per_entry
    return 2 * ((row // 2) // rows_per_entry) + row % 2
