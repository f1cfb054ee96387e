"""fp8 (per tensor) decode on ws_fp4's fp8 form (experts.WS_FP8_DECODE, off by default): e4m3
weights converted to f16 in registers, the activations act_quant's e4m3 values as f16.

On a CPU: its sm_90 builds, act_quant's f16 output (the interpreter), the launcher's checks,
and that the experts stage leaves it alone by default and off Hopper; on an H200: the experts
call on it against the float64 oracle and the reference, outputs NaN-poisoned first.
"""
import re

import pytest
import torch

from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels import ws_fp4
from moe_ops.kernels.act_quant import act_quant

from test_kernels_experts import DEVICE, FP8_TOL, check_experts, make_problem
from test_ws_gemm import sm90_ptx

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[:2] == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma kernel runs on sm_90 only")
# f16 products of e4m3 values are exact and accumulate in fp32: the error is the bf16 roundings
# of the intermediate and the output (grouped_gemm's mma.sync path: 2.8e-3 median; swap-AB on
# fp8 wgmma reached 1.37e-2, experts.FP8_SWAP_AB)
TOL = 6e-3


@pytest.mark.parametrize("gemm,activation,bias,consumers,partial", [
    (1, "swiglu", False, 2, False), (2, "none", True, 2, False),
    (1, "swiglu_oai", True, 3, True), (2, "none", False, 3, True), (2, "none", True, 4, True)])
def test_builds_for_sm90(gemm, activation, bias, consumers, partial):
    """The fp8 form builds for sm_90: f16 wgmmas with the register operand, the weights
    converted by cvt e4m3x2 -> f16x2, weights and activations in 2-d TMA boxes of 128 columns
    (three consumers: 64-row boxes, one static branch for each count before N; two or four:
    the tile's one box, loaded whole even for a partial last tile, whose expected bytes are
    then still the box's), no local memory."""
    ptx = sm90_ptx("ws_fp4", f"gemm={gemm}, activation={activation!r}, has_bias={bias}, "
                             f"consumers={consumers}, quant='fp8', partial_n={partial}")
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cp.async.bulk.tensor.3d" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    box = ws_fp4.tma_box_rows(consumers)
    expected = {n * box * ws_fp4.FP8_BLOCK_K + 16 * ws_fp4.FP8_BLOCK_K * 2
                for n in range(1, consumers * 64 // box + 1)}
    assert {int(b) for b in re.findall(r"expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);",
                                       ptx)} == expected


@pytest.mark.parametrize("split", [True, False])
def test_act_quant_f16_holds_the_e4m3_values(split):
    """act_quant(out_dtype=float16): the same values and scales as its e4m3 output, padding
    rows of the sorted layout skipped alike."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 384, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    x[2] = 0
    x[4, :7] = 1e-3
    ids = torch.tensor([0, 1, 9, 2, 3, 9], dtype=torch.int32, device=DEVICE)
    for pair_ids, pairs in ((None, 0), (ids, 4)):
        q8, s8 = act_quant(x, "fp8", pair_ids, pairs, split_k=split)
        q16, s16 = act_quant(x, "fp8", pair_ids, pairs, split_k=split, out_dtype=torch.float16)
        live = torch.ones(6, dtype=torch.bool, device=DEVICE) if pair_ids is None else ids < 4
        assert q16.dtype == torch.float16
        assert torch.equal(q8[live].to(torch.float16), q16[live])
        assert torch.equal(s8[live], s16[live])
    with pytest.raises(ValueError, match="out_dtype"):
        act_quant(x, "fp8", out_dtype=torch.bfloat16)


def test_bad_calls_are_refused(monkeypatch):
    w = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
    a = torch.zeros(32, 256, dtype=torch.float16)

    class Dispatch:
        direct, align_block_m, num_pairs = False, 16, 4
    with pytest.raises(ValueError, match="slots / pipeline"):
        ws_fp4.gemm(a, w, None, None, None, None, Dispatch, gemm=2, activation="none",
                    quant="fp8", slots=64, consumers=2)
    with pytest.raises(ValueError, match="slots / pipeline"):
        ws_fp4.gemm(a, w, None, None, None, None, Dispatch, gemm=2, activation="none",
                    quant="fp8", pipeline=True, consumers=2)
    # MOE_OPS_WS_FP4_PIPELINE=1 is the 4-bit decode's: fp8 stays serial (the next check fails)
    monkeypatch.setattr(ws_fp4, "PIPELINE", True)
    with pytest.raises(ValueError, match="w: fp8 needs e4m3"):
        ws_fp4.gemm(a, w.view(torch.uint8), None, None, None, None, Dispatch, gemm=2,
                    activation="none", quant="fp8", consumers=2)
    with pytest.raises(ValueError, match="w_scale"):
        ws_fp4.gemm(a, w, torch.ones(2), None, None, None, Dispatch, gemm=2,
                    activation="none", quant="fp8", consumers=2)
    with pytest.raises(ValueError, match="a: fp8 needs f16"):
        ws_fp4.gemm(a.to(torch.bfloat16), w, torch.ones(2, 128), None, None, None, Dispatch,
                    gemm=2, activation="none", quant="fp8", consumers=2)
    with pytest.raises(ValueError, match="a_scale"):
        ws_fp4.gemm(a, w, torch.ones(2, 128), None, None, None, Dispatch, gemm=2,
                    activation="none", quant="fp8", consumers=2)


def test_off_by_default_and_off_hopper(monkeypatch, gemm_calls, poisoned_empty):
    """Off unless MOE_OPS_WS_FP8_DECODE=1; on, still never used without an sm_90 GPU."""
    assert experts_mod.WS_FP8_DECODE is False or HOPPER
    calls = gemm_calls(ws_fp4, "gemm", record="quant")
    tensors, kwargs = make_problem(3, 256, 128, 8, 2, quant="fp8", seed=2)
    check_experts(tensors, kwargs, 1.5e-2)
    assert calls == [] or HOPPER
    if not HOPPER:
        monkeypatch.setattr(experts_mod, "WS_FP8_DECODE", True)
        check_experts(tensors, kwargs, 1.5e-2)
        assert calls == []


@needs_hopper
@pytest.mark.parametrize("T,H,I,activation,bias,consumers", [
    (1, 512, 384, "swiglu", False, 2), (7, 512, 384, "geglu", True, 2),
    (40, 512, 384, "swiglu_oai", True, 2), (20, 768, 256, "relu2", False, 2),
    (60, 512, 384, "swiglu", False, 3), (9, 1024, 640, "swiglu", True, 3),
    (5, 640, 384, "swiglu", True, 4)])
def test_experts_on_the_fp8_form(T, H, I, activation, bias, consumers, monkeypatch, gemm_calls,
                                 poisoned_empty):
    """Decode-sized fp8 calls (up to 16 routed rows an expert; T = 1 taken off direct mode)
    run both GEMMs on the fp8 form: several K steps of 128 (H = 512: 4, I = 384: 3),
    expert-parallel ids, ids of no local expert, partial last tiles with three consumers
    (GEMM1's N = 768 = 4 x 192, GEMM2's 512 = 2 x 192 + 128; 1280 = 6 x 192 + 128) and with
    four (GEMM2's N = 640 = 2 x 256 + 128: its one box a tile loaded whole), against the
    float64 oracle within TOL (tighter than fp8's 1.5e-2: the products are exact)."""
    monkeypatch.setattr(experts_mod, "WS_FP8_DECODE", True)
    monkeypatch.setattr(ws_fp4, "FP8_CONSUMERS", str(consumers))
    calls = gemm_calls(ws_fp4, "gemm", record="quant")
    tensors, kwargs = make_problem(T, H, I, 8, 2, activation=activation, quant="fp8",
                                   bias=bias, local_expert_offset=2, num_global_experts=12,
                                   invalid_ids=T > 2, seed=17 + T)
    check_experts(tensors, kwargs, TOL)
    assert calls == ["fp8", "fp8"], calls


@needs_hopper
def test_rows_an_expert_threshold(monkeypatch, gemm_calls, poisoned_empty):
    """Up to WS_FP8_DECODE_MAX_ROWS routed rows an expert on average the fp8 form, past it
    grouped_gemm's kernels; one skewed call (most tokens on one expert: many 16-slot blocks of
    one expert) on the form."""
    monkeypatch.setattr(experts_mod, "WS_FP8_DECODE", True)
    calls = gemm_calls(ws_fp4, "gemm", record="quant")
    most = experts_mod.WS_FP8_DECODE_MAX_ROWS * 8 // 2
    # (past it grouped_gemm's mma.sync tiles: fp8's usual bound; 7.7e-3 on the H200)
    for T, expected, tol in ((most, ["fp8", "fp8"], TOL), (most + 1, [], FP8_TOL)):
        calls.clear()
        tensors, kwargs = make_problem(T, 512, 384, 8, 2, quant="fp8", seed=5)
        check_experts(tensors, kwargs, tol)
        assert calls == expected, (T, calls)
    calls.clear()
    tensors, kwargs = make_problem(most, 512, 384, 8, 2, quant="fp8", seed=6,
                                   all_to_one=True)
    check_experts(tensors, kwargs, TOL)
    assert calls == ["fp8", "fp8"]


@needs_hopper
@pytest.mark.parametrize("split,T,bias", [("2", 1, True), ("auto", 2, False), ("4", 20, True)])
def test_fp8_form_with_split_gemm2(split, T, bias, monkeypatch, gemm_calls, poisoned_empty):
    """The fp8 form's GEMM2 with its K split (ws_fp4.SPLIT_K; I = 640: 5 steps of 128), the
    parts summed by the combine, the bias once, against the float64 oracle."""
    monkeypatch.setattr(experts_mod, "WS_FP8_DECODE", True)
    monkeypatch.setattr(ws_fp4, "SPLIT_K", split)
    calls = gemm_calls(ws_fp4, "gemm", record="split", default=1)
    tensors, kwargs = make_problem(T, 512, 640, 8, 2, quant="fp8", bias=bias,
                                   local_expert_offset=2, num_global_experts=12, seed=23 + T)
    check_experts(tensors, kwargs, TOL)
    assert len(calls) == 2 and calls[0] == 1 and calls[1] > 1, calls
