"""The device preparation kernels (moe_ops.kernels.prepare) write 4-bit weights in the kernel
order of moe_ops.quant ("The kernel order of packed e2m1 rows"): quantize_scatter quantizes
float weights straight into it (nvfp4 also in one launch with its per-expert amax pass,
quantize_scatter_nvfp4), scatter_fp4_rows reorders pre-quantized natural packed rows.
Both must give, bit for bit, moe_ops.quant's reference (quantize_nvfp4 / quantize_mxfp4, then
fp4_to_kernel_order and fp4_pad_scales) at the permuted rows, whole rows written (the padding
columns K..Kp as zeros: the destinations start poisoned), and leave the rows no source row goes
to untouched.

Without a CUDA device the kernels run in the Triton interpreter on CPU tensors, so the shapes
are small; they still cover the tile shapes that matter (rows that do and do not fill a tile,
row widths with and without padding, narrow and masked column tiles).
"""
import os
import subprocess
import zlib


def _has_cuda() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


# tests/conftest.py sets the flag for the whole session, before anything imports triton; the
# same decision here keeps the file runnable on its own (--noconftest). Never on a CUDA machine:
# triton and moe_ops read it once, at import, for every test module.
if "TRITON_INTERPRET" not in os.environ and not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_ops import quant as q  # noqa: E402

prepare = pytest.importorskip("moe_ops.kernels.prepare", reason="the kernels need triton")

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if _INTERPRET or not torch.cuda.is_available() else "cuda"
# Destination bytes before a kernel runs: anything left unwritten (or a padding not zeroed) shows.
POISON = 0xA5
if DEVICE == "cpu" and not _INTERPRET:
    pytest.skip("a GPU is visible but torch cannot use it", allow_module_level=True)


def _padding(k: int) -> torch.Tensor:
    """bool [Kp/2]: the bytes of a kernel-order row that hold only padding columns (>= K)."""
    full = torch.full((k // 2,), 0xFF, dtype=torch.uint8)
    return q.fp4_to_kernel_order(full) == 0


def _generator(*what) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(what).encode()))


def _targets(gen: torch.Generator, n: int, extra: int = 3) -> torch.Tensor:
    """A permutation of n rows into a destination of n + extra rows (rows left out stay zero)."""
    return torch.randperm(n + extra, generator=gen)[:n].to(DEVICE)


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    a, b = got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if not torch.equal(a, b):
        where = (a != b).nonzero()[:4].tolist()
        pytest.fail(f"{what}: {int((a != b).sum())} bytes differ, first at {where}")


def _reference(w: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_ops.quant's packed rows (kernel order) and block scales (padded) of w [E, N, K]."""
    k = w.shape[2]
    w = w.contiguous()
    if quant == "nvfp4":
        packed, scale, _ = q.quantize_nvfp4(w)
    else:
        packed, scale = q.quantize_mxfp4(w)
    return q.fp4_to_kernel_order(packed), q.fp4_pad_scales(scale, k, quant)


# (E, N, K): K = 32 / 96 / 2880 pad to 256 / 256 / 3072 (2880 = 45 * 64: 32-pair column tiles),
# 256 does not; N = 8 fills its row tile, the others leave it part empty.
SHAPES = [(2, 5, 32), (2, 12, 96), (3, 8, 256), (1, 3, 2880)]


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_quantize_scatter_writes_the_reference_bytes_in_kernel_order(quant, dtype, shape):
    e, n, k = shape
    gen = _generator(quant, dtype, shape)
    # Experts of different magnitudes, and a zero expert (nvfp4's global scale 0: all zeros).
    w = torch.randn(e, n, k, generator=gen) * torch.logspace(-3, 2, e)[:, None, None]
    if e > 1:
        w[0].zero_()
    w = w.to(dtype).to(DEVICE)
    _check_quantize_scatter(w, quant, gen)


@pytest.mark.parametrize("k", [16, 80, 272])
def test_quantize_scatter_with_an_odd_slice_count(k):
    """nvfp4 rows of an odd number of 16-column slices: a kernel-order word holds a slice pair,
    so the last pair is one slice of data and one of padding (written as zero codes)."""
    gen = _generator("nvfp4", torch.bfloat16, (2, 6, k))
    w = (torch.randn(2, 6, k, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    _check_quantize_scatter(w, "nvfp4", gen)


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_quantize_scatter_of_a_strided_source(quant):
    """A transposed checkpoint (w stored [E, K, N]): the kernel's column-by-column source path."""
    gen = _generator(quant, "strided")
    w = torch.randn(2, 96, 6, generator=gen).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    _check_quantize_scatter(w, quant, gen)


def _check_quantize_scatter(w: torch.Tensor, quant: str, gen: torch.Generator,
                            nvfp4_path: str = "two launches") -> None:
    """quantize_scatter's bytes (nvfp4: by `nvfp4_path`, "two launches" = amax_per_expert, the
    factors in torch, quantize_scatter; or a schedule of the fused quantize_scatter_nvfp4)
    against the reference, into poisoned destinations."""
    e, n, k = w.shape
    kp, block = q.fp4_padded_k(k), q.fp4_scale_block(quant)
    rows, scale_rows = _targets(gen, n), _targets(gen, n)
    r = n + 3
    dst = torch.full((e, r, kp // 2), POISON, dtype=torch.uint8, device=DEVICE)
    scale_dtype = q.FP8_DTYPE if quant == "nvfp4" else torch.uint8
    scale_dst = torch.full((e, r, kp // block), POISON, dtype=torch.uint8,
                           device=DEVICE).view(scale_dtype)
    factor = factor2 = global_scale = None
    if quant == "nvfp4" and nvfp4_path != "two launches":
        global_scale = prepare.quantize_scatter_nvfp4(w, dst, rows, scale_dst, scale_rows,
                                                      nvfp4_path)
    else:
        if quant == "nvfp4":
            # As moe_ops.layout._device_parts computes them with NVFP4_FUSED_AMAX off.
            amax = prepare.amax_per_expert(w)
            factor, factor2 = q.nvfp4_global_scale(amax)
            global_scale = factor
        prepare.quantize_scatter(w, quant, dst, rows, scale_dst, scale_rows, factor, factor2)

    packed, scale = _reference(w, quant)
    want = torch.full_like(dst, POISON)
    want[:, rows] = packed.to(DEVICE)
    want_scale = torch.full_like(scale_dst.view(torch.uint8), POISON)
    want_scale[:, scale_rows] = scale.view(torch.uint8).to(DEVICE)
    _assert_bytes(dst, want, f"{quant} {tuple(w.shape)} {w.dtype} values")
    _assert_bytes(scale_dst, want_scale, f"{quant} {tuple(w.shape)} {w.dtype} scales")
    # Redundant with the comparison above, but the contract spelled out: the padding is zero.
    assert not dst[:, rows][..., _padding(k).to(DEVICE)].any()
    assert not scale_dst.view(torch.uint8)[:, scale_rows, k // block:].any()
    if quant == "nvfp4":
        _, _, want_global = q.quantize_nvfp4(w.contiguous())
        _assert_bytes(global_scale, want_global.to(DEVICE), f"{tuple(w.shape)} global scale")


# (rows of the matrix quantized, next matrix, whether the launch reduces the next amax itself):
# 12 rows are one program an expert (one amax tile covers the next expert), 256 rows 8 programs
# (a [64, 512] bf16 next expert is 4 tiles, programs 4-7 redo the last; [512, 512] is 8 tiles
# of ITERS 4; [24, 96] one tile of 128-wide rows); bf16 / f16 / float32; experts not contiguous,
# another expert count, or a next expert too large for the programs (64 tiles a program), fall
# back to amax_per_expert.
NEXT_CASES = [(12, (2, 24, 96), torch.bfloat16, "contiguous", True),
              (12, (2, 7, 160), torch.float16, "contiguous", True),
              (12, (2, 16, 64), torch.float32, "contiguous", True),
              (256, (2, 64, 512), torch.bfloat16, "contiguous", True),
              (256, (2, 512, 512), torch.bfloat16, "contiguous", True),
              (256, (2, 24, 96), torch.bfloat16, "contiguous", True),
              (12, (2, 40, 160), torch.bfloat16, "rows", False),
              (12, (3, 8, 96), torch.bfloat16, "contiguous", False),
              (12, (2, 1024, 512), torch.bfloat16, "contiguous", False)]


@pytest.mark.parametrize("quant, pair_max", [("nvfp4", True), ("mxfp4", True),
                                             ("nvfp4", False)])
@pytest.mark.parametrize("case", NEXT_CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-"
                         f"{str(c[2])[6:]}-{c[3]}")
def test_quantize_scatter_reduces_the_next_matrix_amax(monkeypatch, quant, pair_max, case):
    """quantize_scatter(next_weight=...): the next matrix's per-expert amax, exact, from the same
    launch where it can, and the launch's own bytes unchanged (compared with a launch without);
    the amax tiles' pair-wise max (sm_90+, emulated in the interpreter) and the two-max form."""
    monkeypatch.setattr(prepare, "_pair_max", lambda device: pair_max)
    n, (e, n_next, k_next), dtype, view, in_launch = case
    gen = _generator("next", quant, case)
    following = torch.randn(e, 2 * n_next if view == "rows" else n_next, k_next, generator=gen)
    following = following * torch.logspace(-2, 3, e)[:, None, None]
    following = following.to(dtype).to(DEVICE)
    if view == "rows":
        following = following[:, ::2]
    w = (torch.randn(2, n, 96, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    alone = _quantize_with_next(monkeypatch, quant, w, None)[1:]
    if view == "rows":  # (a clone would be contiguous)
        probes = [following]
    else:
        # The largest magnitude (negative in expert 0) in turn at 8 places spread over each
        # expert, so that each of up to 8 amax tiles (the flat expert in equal runs) is read.
        places = 8 if following[0].numel() >= 16384 else 1
        probes = []
        for place in range(places):
            probe = following.clone()
            # (odd places at odd columns: the high half of a 16-bit pair)
            at = (2 * place + 1) * probe[0].numel() // (2 * places) // 2 * 2 + place % 2
            probe.view(e, -1)[:, at] = torch.tensor([-5e3] + [7e3] * (e - 1), dtype=dtype)
            probes.append(probe)
    for probe in probes:
        amax, values, scales, passes = _quantize_with_next(monkeypatch, quant, w, probe)
        assert (passes == 0) == in_launch
        _assert_bytes(amax, probe.float().abs().amax(dim=(1, 2)), "next amax")
        _assert_bytes(values, alone[0], "values")
        _assert_bytes(scales, alone[1], "scales")


def _quantize_with_next(monkeypatch, quant, w, following):
    """quantize_scatter of w (rows in order) with next_weight=following: (its result, the
    values, the scales, how many amax passes of its own it launched)."""
    e, n, k = w.shape
    factors = (q.nvfp4_global_scale(prepare.amax_per_expert(w)) if quant == "nvfp4" else ())
    kp, block = q.fp4_padded_k(k), q.fp4_scale_block(quant)
    dst = torch.full((e, n, kp // 2), POISON, dtype=torch.uint8, device=DEVICE)
    scale_dst = torch.full((e, n, kp // block), POISON, dtype=torch.uint8, device=DEVICE)
    if quant == "nvfp4":
        scale_dst = scale_dst.view(q.FP8_DTYPE)
    rows = torch.arange(n, device=DEVICE)
    passes = []
    amax_pass = prepare.amax_per_expert
    monkeypatch.setattr(prepare, "amax_per_expert", lambda t: passes.append(1) or amax_pass(t))
    got = prepare.quantize_scatter(w, quant, dst, rows, scale_dst, rows, *factors,
                                   next_weight=following)
    monkeypatch.setattr(prepare, "amax_per_expert", amax_pass)
    return got, dst, scale_dst, len(passes)


# ---------------------------------------------------------------------------------------------
# nvfp4 in one launch (quantize_scatter_nvfp4): amax programs, then each expert's factors
# computed in the kernel, then its quantize programs, in either schedule; and the two-launch
# path it replaces (NVFP4_FUSED_AMAX off).
# ---------------------------------------------------------------------------------------------
NVFP4_PATHS = ["two launches", "sequential", "interleaved"]


def _nvfp4_weights(gen: torch.Generator, e: int, n: int, k: int, dtype: torch.dtype,
                   view: str) -> torch.Tensor:
    """Experts of different magnitudes with expert 1 all zeros (global scale 0: zero codes and
    scales, never NaN), as `view`: "contiguous"; "rows" (every other row of a bigger tensor:
    unit K stride, experts not contiguous); "transposed" (stored [E, K, N]: column loads)."""
    rows = 2 * n if view == "rows" else n
    w = torch.randn(e, rows, k, generator=gen) * torch.logspace(-3, 2, e)[:, None, None]
    w[1].zero_()
    if view == "transposed":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    elif view == "rows":
        w = w[:, ::2]
    return _same_view_on(w.to(dtype), DEVICE)


# (E, N, K, dtype, view): N = 12 / 5 / 40 leave the last row tile part empty, 8 fills it; K = 96
# / 160 pad to 256 (masked column tiles), 256 does not; bf16 and f16 read as int32 pairs
# (the amax programs' integer max of each half), float32 and the transposed view element by
# element; the "rows" view's experts are not contiguous (the amax programs' 2-D tiles).
NVFP4_CASES = [(3, 12, 96, torch.bfloat16, "contiguous"), (4, 5, 160, torch.float16, "contiguous"),
               (3, 8, 256, torch.float32, "contiguous"), (3, 40, 160, torch.bfloat16, "rows"),
               (3, 6, 96, torch.bfloat16, "transposed")]


@pytest.mark.parametrize("path, amax_tiles", [(p, t) for p in NVFP4_PATHS
                                               for t in ("default", "small")
                                               if p != "two launches" or t == "default"])
@pytest.mark.parametrize("case", NVFP4_CASES,
                         ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{str(c[3])[6:]}-{c[4]}")
def test_nvfp4_paths_write_the_reference_bytes(monkeypatch, case, path, amax_tiles):
    """Every nvfp4 path gives the reference's bytes and global scales. "small" amax tiles
    (2 x 16, 2 per program) make several amax programs per expert, masked ones included, so
    the last one to finish computes the factors and the interleaving has amax tiles to spread;
    with the default tile each expert here is one amax program."""
    e, n, k, dtype, view = case
    if amax_tiles == "small":  # the fused launch's amax tiles (the two-launch path has its own)
        monkeypatch.setattr(prepare, "_FUSED_AMAX_TILE", (2, 16))
        monkeypatch.setattr(prepare, "_FUSED_AMAX_ITERS", 2)
    gen = _generator("nvfp4", case, path)
    w = _nvfp4_weights(gen, e, n, k, dtype, view)
    _check_quantize_scatter(w, "nvfp4", gen, path)


# The tiniest amaxes make the inverse global scale overflow to inf, and the quantize programs
# compute 0 * inf (NaN) as the reference does: numpy warns in the interpreter.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("schedule", prepare.NVFP4_SCHEDULES)
def test_nvfp4_fused_factors_are_the_reference_expressions(schedule):
    """The kernel's global scale, its inverse and the [E, 128] inverse table are the bits of
    quant.nvfp4_global_scale and _nvfp4_inverse_table (the two-launch path's torch
    expressions), for amaxes from 0 and the float32 subnormals (a global scale that underflows,
    table entries that overflow) to the float32 maximum. One expert per amax, float32 weights
    (any amax is exact)."""
    amaxes = [0.0, 1e-45, 1e-40, 2688 * 2.0 ** -126, 3e-38, 2.0 ** -20, 0.02, 1.0, 3.0, 448.0,
              2688.0, 1e6, 1e30, 3.4028235e38]
    w = torch.zeros(len(amaxes), 2, 32)
    w[:, 1, 5] = -torch.tensor(amaxes)  # the amax a negative element: |w| is what counts
    w[:, 0, :] = torch.tensor(amaxes)[:, None] * 0.25
    w = w.to(DEVICE)
    k = w.shape[2]
    dst = torch.zeros((len(amaxes), 2, q.fp4_padded_k(k) // 2), dtype=torch.uint8, device=DEVICE)
    scale_dst = torch.zeros((len(amaxes), 2, q.fp4_padded_k(k) // 16), dtype=torch.uint8,
                            device=DEVICE).view(q.FP8_DTYPE)
    rows = torch.arange(2, device=DEVICE)
    got = prepare.quantize_scatter_nvfp4(w, dst, rows, scale_dst, rows, schedule,
                                         return_factors=True)
    amax = torch.tensor(amaxes, dtype=torch.float32, device=DEVICE)
    global_scale, inv_global = q.nvfp4_global_scale(amax)
    want = (global_scale, inv_global, prepare._nvfp4_inverse_table(global_scale))
    for name, a, b in zip(("global scale", "inverse", "table"), got, want):
        _assert_bytes(a, b, name)
    assert not any(t.isnan().any() for t in got)


def _schedule_probe():
    """A kernel that records _nvfp4_schedule's (expert, amax?, tile) of every program (defined
    lazily: triton.jit needs the function's source file, which pytest has)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(out_ptr, E, amax_tiles, quant_tiles, SCHEDULE: tl.constexpr, WIDE: tl.constexpr):
        e, is_amax, tile = prepare._nvfp4_schedule(E, amax_tiles, quant_tiles, SCHEDULE, WIDE)
        pid = tl.program_id(0)
        tl.store(out_ptr + 3 * pid, e.to(tl.int64))
        tl.store(out_ptr + 3 * pid + 1, is_amax.to(tl.int64))
        tl.store(out_ptr + 3 * pid + 2, tile.to(tl.int64))

    return probe


@pytest.mark.parametrize("schedule", prepare.NVFP4_SCHEDULES)
@pytest.mark.parametrize("e, a, qt", [(1, 1, 1), (1, 3, 5), (3, 1, 4), (4, 3, 7), (3, 5, 2),
                                      (2, 4, 4)])
def test_nvfp4_schedule_runs_each_tile_once_amax_first(schedule, e, a, qt):
    """The fused grid runs every (expert, kind, tile) exactly once; all amax tiles of an expert
    come before its quantize tiles (the in-kernel wait needs it); amax tiles in increasing
    order, quantize tiles in decreasing order; "sequential" is [A_0][Q_0][A_1][Q_1]...,
    "interleaved" [A_0][A_1 with Q_0]...[Q_{E-1}], each amax tile of expert s + 1 at
    position floor(j * T / A) of its segment. The 64-bit variant (WIDE) maps the same."""
    probe = _schedule_probe()
    got = {}
    for wide in (False, True):
        out = torch.full((e * (a + qt), 3), -1, dtype=torch.int64, device=DEVICE)
        probe[(e * (a + qt),)](out, e, a, qt, SCHEDULE=schedule, WIDE=wide)
        got[wide] = [tuple(r) for r in out.cpu().tolist()]
    assert got[False] == got[True]
    programs = got[False]
    assert sorted(programs) == sorted([(x, 1, t) for x in range(e) for t in range(a)]
                                      + [(x, 0, t) for x in range(e) for t in range(qt)])
    for x in range(e):
        amax = [t for (y, kind, t) in programs if y == x and kind == 1]
        quantize = [t for (y, kind, t) in programs if y == x and kind == 0]
        assert amax == list(range(a)) and quantize == list(range(qt))[::-1]
        last_amax = max(p for p, (y, kind, _) in enumerate(programs) if y == x and kind == 1)
        first_quantize = min(p for p, (y, kind, _) in enumerate(programs) if y == x and kind == 0)
        assert last_amax < first_quantize
    t = a + qt
    if schedule == "sequential":
        assert [(y, kind) for y, kind, _ in programs] == [
            (x, int(i < a)) for x in range(e) for i in range(t)]
    else:
        want = [(0, 1)] * a
        for s in range(e - 1):
            positions = {j * t // a for j in range(a)}
            want += [(s + 1, 1) if i in positions else (s, 0) for i in range(t)]
        want += [(e - 1, 0)] * qt
        assert [(y, kind) for y, kind, _ in programs] == want


# K = 16 (one slice: narrowest tile), 48 / 96 (3 / 6 slices: masked column tiles, 8- / 16-byte
# granularity), 256 (a whole tile, no padding), 2880 (180 slices: 6 column tiles, the last one
# masked), 7168 (448 slices: 14 full column tiles).
@pytest.mark.parametrize("k", [16, 48, 96, 256, 2880, 7168])
@pytest.mark.parametrize("view", ["contiguous", "strided_rows", "transposed"])
def test_scatter_fp4_rows_is_fp4_to_kernel_order(k, view):
    gen = _generator(k, view)
    e, n = 2, 5
    if view == "contiguous":
        src = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    elif view == "strided_rows":  # every other row of a bigger tensor: unit K stride, wide rows
        src = torch.randint(0, 256, (e, 2 * n, k // 2), generator=gen, dtype=torch.uint8)[:, ::2]
    else:  # a byte stride along K
        src = torch.randint(0, 256, (e, k // 2, n), generator=gen, dtype=torch.uint8)
        src = src.transpose(1, 2)
    src = src.to(DEVICE) if view == "contiguous" else _same_view_on(src, DEVICE)
    rows = _targets(gen, n)
    dst = torch.full((e, n + 3, q.fp4_padded_k(k) // 2), POISON, dtype=torch.uint8,
                     device=DEVICE)
    prepare.scatter_fp4_rows(src, dst, rows)
    want = torch.full_like(dst, POISON)
    want[:, rows] = q.fp4_to_kernel_order(src.cpu()).to(DEVICE)
    _assert_bytes(dst, want, f"K={k} {view}")
    assert not dst[:, rows][..., _padding(k).to(DEVICE)].any()
    assert torch.equal(q.fp4_from_kernel_order(dst[:, rows].cpu(), k), src.cpu())


@pytest.mark.parametrize("n", [1, 64, 100])
def test_scatter_fp4_rows_row_tiles(n):
    """K = 4096 (8 column tiles of 32 slices, tiles of up to 64 rows): one row, one full row
    tile, a full and a partial one."""
    gen = _generator(n, "rows")
    k = 4096
    src = torch.randint(0, 256, (3, n, k // 2), generator=gen, dtype=torch.uint8).to(DEVICE)
    rows = _targets(gen, n, extra=1)
    dst = torch.full((3, n + 1, k // 2), POISON, dtype=torch.uint8, device=DEVICE)
    prepare.scatter_fp4_rows(src, dst, rows)
    want = torch.full_like(dst, POISON)
    want[:, rows] = q.fp4_to_kernel_order(src.cpu()).to(DEVICE)
    _assert_bytes(dst, want, f"N={n}")


@pytest.mark.parametrize("shape", [(0, 4, 64), (2, 0, 64)])
def test_empty_sources_write_nothing(shape):
    e, n, k = shape
    dst = torch.full((max(e, 1), 4, q.fp4_padded_k(k) // 2), 0xA5, dtype=torch.uint8, device=DEVICE)
    rows = torch.arange(n, device=DEVICE)
    prepare.scatter_fp4_rows(torch.zeros(e, n, k // 2, dtype=torch.uint8, device=DEVICE),
                             dst[:e], rows)
    scale_dst = torch.full((max(e, 1), 4, q.fp4_padded_k(k) // 32), 0xA5, dtype=torch.uint8,
                           device=DEVICE)
    prepare.quantize_scatter(torch.zeros(e, n, k, device=DEVICE), "mxfp4", dst[:e], rows,
                             scale_dst[:e], rows)
    assert (dst == 0xA5).all() and (scale_dst == 0xA5).all()  # nothing written


# (source row width, destination row width, dtype, view): fp4 scale rows padded to Kp/block
# (gpt_oss' 90 -> 96 bytes: moved as int16; deepseek's 448: int64; 7 -> 16: bytes), float32
# fp8_block scale rows, a transposed source (element by element), an unaligned row start.
@pytest.mark.parametrize("k, k_dst, dtype, view", [
    (90, 96, torch.uint8, "contiguous"), (448, 448, torch.uint8, "contiguous"),
    (7, 16, torch.uint8, "contiguous"), (56, 56, torch.float32, "contiguous"),
    (6, 16, torch.uint8, "transposed"), (90, 96, torch.uint8, "offset")])
def test_scatter_rows_writes_whole_rows(k, k_dst, dtype, view):
    gen = _generator(k, k_dst, str(dtype), view)
    e, n = 2, 9
    bits = torch.randint(0, 256, (e, n, k * torch.finfo(dtype).bits // 8 if dtype.is_floating_point
                                  else k), generator=gen, dtype=torch.uint8)
    src = bits.view(dtype)
    if view == "transposed":
        src = src.transpose(1, 2).contiguous().transpose(1, 2)
    elif view == "offset":  # rows start one byte past an aligned address
        src = torch.randint(0, 256, (e * n * k + 1,), generator=gen, dtype=torch.uint8)[1:]
        src = src.view(e, n, k)
    src = _same_view_on(src, DEVICE)
    rows = _targets(gen, n)
    dst = torch.full((e, n + 3, k_dst * src.element_size()), POISON, dtype=torch.uint8,
                     device=DEVICE).view(dtype)
    prepare.scatter_rows(src, dst, rows)
    want = torch.full_like(dst.view(torch.uint8), POISON).view(dtype)
    want[:, rows] = torch.nn.functional.pad(src.cpu().view(torch.uint8),
                                            (0, (k_dst - k) * src.element_size())).view(dtype).to(DEVICE)
    _assert_bytes(dst, want, f"{k} -> {k_dst} {dtype} {view}")


def _same_view_on(t: torch.Tensor, device: str) -> torch.Tensor:
    """t's strides kept on `device` (moving a view with .to() would make it contiguous)."""
    if device == "cpu":
        return t
    base = t._base if t._base is not None else t
    moved = base.to(device)
    return moved.as_strided(t.shape, t.stride(), t.storage_offset())


def _e4m3_probe():
    """A kernel applying prepare._e4m3_bits_nonneg elementwise (defined lazily, as above)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, prepare._e4m3_bits_nonneg(v), mask=offs < n)

    return probe


def test_e4m3_bits_nonneg_is_the_clamped_cast_at_every_boundary():
    """nvfp4's block-scale byte: min(v, 448) cast to e4m3 (round to nearest even), for every
    non-negative e4m3 value, the midpoints between neighbours (the ties), one float32 ulp on
    either side of both, zero, float32 subnormals, values past 448, and random ones."""
    grid = torch.arange(0x7F, dtype=torch.uint8).view(q.FP8_DTYPE).float()     # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2                                           # exact in f32
    points = torch.cat([grid, mids, torch.tensor([448.5, 464.0, 480.0, 1e30, float("inf"),
                                                  1e-45, 1e-40, 2.0 ** -126])])
    ulp_up = torch.nextafter(points, torch.tensor(float("inf")))
    ulp_down = torch.nextafter(points, torch.tensor(0.0))
    gen = torch.Generator().manual_seed(5)
    random = torch.exp2(torch.rand(4096, generator=gen) * 24 - 14)             # 2^-14 .. 2^10
    v = torch.cat([points, ulp_up, ulp_down, random]).to(DEVICE)
    out = torch.empty(v.numel(), dtype=torch.uint8, device=DEVICE)
    block = 1024
    _e4m3_probe()[(-(-v.numel() // block),)](v, out, v.numel(), BLOCK=block)
    want = v.clamp(max=448.0).to(q.FP8_DTYPE).view(torch.uint8)
    bad = (out != want).nonzero().flatten()[:4].tolist()
    assert not bad, [(v[i].item(), out[i].item(), want[i].item()) for i in bad]
