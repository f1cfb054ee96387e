"""The Triton experts kernels with 4-bit weights (nvfp4, mxfp4: W4A16), against two oracles.

Checkpoints are drawn directly in the packed format (random bytes: every e2m1 code, -0
included; random block scales; random nvfp4 global scales), put into the kernel layout by
moe_ops.prepare_weights, and run through the Triton kernels (the Triton interpreter on CPU).
The output is compared with tests/float64_moe.py (float64, from the checkpoint layout, decoding
the formats from their bits) and with moe_ops.reference (the same kernel-layout tensors).
torch.empty is poisoned with NaN so unwritten output elements show.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

import moe_ops
from moe_ops import quant as q
from float64_moe import moe64, rel_frobenius
from moe_ops.kernels import experts as experts_mod
from moe_ops.kernels.experts import triton_experts
from moe_ops.kernels.grouped_gemm import (
    NVFP4_FAST_EPILOGUE, GemmConfig, GemmProblem, _dequant_fp4_tile, _dequant_fp4_tile_bf16_asm,
    config_problems, config_space, default_config,
)
from moe_ops.reference import fused_experts_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP4 = ("nvfp4", "mxfp4")
E2M1_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)  # all 16 codes equally likely
TOL = 1e-2  # SPEC §4, bf16/fp16 outputs


def fp4_checkpoint(gen, quant, E, H, I, *, activation="swiglu", bias=False):
    """A checkpoint in the packed format, dequantized weights ~ N(0, 1/fan_in)."""
    gated = activation != "relu2"
    block = 16 if quant == "nvfp4" else 32
    ckpt = {}

    def matrix(name, rows, cols):
        ckpt[name] = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, generator=gen)
        std = 1.0 / math.sqrt(cols)
        if quant == "nvfp4":
            block_scale = torch.rand(E, rows, cols // block, generator=gen) + 0.5
            ckpt[name + "_scale"] = block_scale.to(torch.float8_e4m3fn)
            ckpt[name + "_global_scale"] = (torch.rand(E, generator=gen) + 0.5) * std / E2M1_RMS
        else:
            center = 127 + round(math.log2(std / E2M1_RMS))
            ckpt[name + "_scale"] = (center + torch.randint(-1, 2, (E, rows, cols // block),
                                                            generator=gen)).to(torch.uint8)

    matrix("w1", I, H)
    matrix("w2", H, I)
    if gated:
        matrix("w3", I, H)
    if bias:
        for name, n in (("b1", I), ("b2", H)) + ((("b3", I),) if gated else ()):
            ckpt[name] = torch.randn(E, n, generator=gen) * 0.5
    return ckpt


def make_case(quant, T, H, I, E, k, *, activation="swiglu", bias=False, dtype=torch.bfloat16,
              seed=0, offset=0, num_global=None, invalid_ids=False):
    gen = torch.Generator().manual_seed(seed)
    ckpt = fp4_checkpoint(gen, quant, E, H, I, activation=activation, bias=bias)
    num_global = num_global or E + offset
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_global, generator=gen)[:k] for _ in range(T)])
    if invalid_ids:
        ids[0, 0] = -1
        ids[-1, -1] = num_global + 3
    ids = ids.to(torch.int32 if seed % 2 else torch.int64)
    weights = torch.rand(T, k, generator=gen) + 0.1
    kernel = moe_ops.prepare_weights(quant=quant, activation=activation, dtype=dtype,
                                     device=DEVICE, **ckpt)
    return ckpt, kernel, x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)


def run_and_check(quant, ckpt, kernel, x, ids, weights, *, activation="swiglu", offset=0,
                  gemm1_config=None, gemm2_config=None):
    out = triton_experts(
        x, ids, weights, kernel["w13"], kernel["w2"], kernel["w13_scale"], kernel["w2_scale"],
        kernel.get("b13"), kernel.get("b2"), activation=activation, quant=quant,
        local_expert_offset=offset, gemm1_config=gemm1_config, gemm2_config=gemm2_config,
        w13_global_scale=kernel.get("w13_global_scale"),
        w2_global_scale=kernel.get("w2_global_scale"))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    expected = moe64(x.cpu(), ids.cpu(), weights.cpu(), activation=activation, quant=quant,
                     local_expert_offset=offset, **ckpt)
    err = rel_frobenius(out, expected)
    assert err <= TOL, f"vs float64: relative Frobenius error {err:.3e} > {TOL}"
    reference = fused_experts_reference(
        x, ids, weights, kernel["w13"], kernel["w2"], kernel["w13_scale"], kernel["w2_scale"],
        kernel.get("b13"), kernel.get("b2"), activation=activation, quant=quant,
        local_expert_offset=offset, w13_global_scale=kernel.get("w13_global_scale"),
        w2_global_scale=kernel.get("w2_global_scale"))
    err_ref = rel_frobenius(out, reference)
    assert err_ref <= TOL, f"vs moe_ops.reference: relative Frobenius error {err_ref:.3e} > {TOL}"
    return out


def force_dispatch(monkeypatch, path):
    if path == "direct":
        monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS", 1 << 20)
        monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS_PER_EXPERT", 1e9)
    else:
        monkeypatch.setattr(experts_mod, "DIRECT_MAX_PAIRS", 0)


# Small configs (interpreter time grows with the tile): swap-AB or not, block_k 32 / 64.
SWAP = (GemmConfig(16, 32, 64, 1, 4, 2, swap_ab=True), GemmConfig(16, 32, 32, 1, 4, 2, swap_ab=True))
NO_SWAP = (GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 32, 64, 8, 4, 2))


# Every activation x format x dispatch path x swap-AB, with K not a multiple of 64 in both
# GEMMs (H = 96: GEMM1's K; I = 32 or 160: GEMM2's K), so the K tail reads the zero padding of
# the packed rows and scales (the activations masked); nvfp4's 16-wide groups meet the 32-wide
# K steps.
CASES = [
    # quant, activation, bias, path, swap, dtype, (H, I)
    ("nvfp4", "swiglu", False, "direct", True, torch.bfloat16, (96, 32)),
    ("nvfp4", "geglu", False, "aligned", False, torch.float16, (96, 160)),
    ("nvfp4", "swiglu_oai", True, "aligned", True, torch.bfloat16, (96, 32)),
    ("nvfp4", "relu2", False, "direct", False, torch.bfloat16, (96, 32)),
    ("mxfp4", "swiglu", False, "aligned", False, torch.bfloat16, (96, 32)),
    ("mxfp4", "geglu", False, "direct", True, torch.bfloat16, (96, 32)),
    ("mxfp4", "swiglu_oai", True, "direct", False, torch.bfloat16, (96, 160)),
    ("mxfp4", "swiglu_oai", True, "aligned", True, torch.float16, (96, 32)),
    ("mxfp4", "relu2", False, "aligned", True, torch.bfloat16, (96, 32)),
]


@pytest.mark.parametrize("quant,activation,bias,path,swap,dtype,dims", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}-{'swap' if c[4] else 'noswap'}-"
                              f"{str(c[5])[6:]}-H{c[6][0]}I{c[6][1]}" for c in CASES])
def test_fp4_experts(quant, activation, bias, path, swap, dtype, dims, monkeypatch,
                     poisoned_empty):
    force_dispatch(monkeypatch, path)
    H, I = dims
    seed = CASES.index((quant, activation, bias, path, swap, dtype, dims))
    case = make_case(quant, 5, H, I, 4, 2, activation=activation, bias=bias, dtype=dtype,
                     seed=seed)
    c1, c2 = SWAP if swap else NO_SWAP
    run_and_check(quant, *case, activation=activation, gemm1_config=c1, gemm2_config=c2)


@pytest.mark.parametrize("quant,swap", [("nvfp4", True), ("mxfp4", False)])
def test_fp4_split_k_gemm2(quant, swap, monkeypatch, poisoned_empty):
    """GEMM2's reduction (I = 160: 5 steps of 32, split 4 ways, one split empty) with the
    biases (added once) and nvfp4's global scale applied per split."""
    force_dispatch(monkeypatch, "aligned")
    case = make_case(quant, 5, 96, 160, 4, 2, activation="swiglu_oai", bias=True, seed=21)
    config2 = GemmConfig(16, 32, 32, 1, 4, 2, swap_ab=swap, split_k=4)
    run_and_check(quant, *case, activation="swiglu_oai", gemm1_config=SWAP[0],
                  gemm2_config=config2)


@pytest.mark.parametrize("quant", FP4)
def test_fp4_default_configs_offset_invalid_ids(quant, monkeypatch, poisoned_empty):
    """The default configs (the decode default streams 256-wide K steps: the whole K of these
    shapes is one masked step), an expert-parallel shard and ids outside it."""
    force_dispatch(monkeypatch, "aligned")
    case = make_case(quant, 6, 160, 64, 3, 3, bias=True, seed=11, offset=2, num_global=8,
                     invalid_ids=True)
    run_and_check(quant, *case, activation="swiglu", offset=2)


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_mxfp4_rows_past_scale_two(activation, poisoned_empty):
    """mxfp4 block scales past 2 (e8m0 bytes above 128) in some rows of some experts: the
    layout folds each such row's excess into its row scale (quant.mxfp4_fold_scales), which
    the kernels apply to the accumulator; the result is the checkpoint's, against float64.
    (bf16: the boosted outputs pass fp16's range.)"""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(23)
    E, H, I, T, k = 4, 96, 64, 9, 2
    ckpt = fp4_checkpoint(gen, "mxfp4", E, H, I, activation=activation,
                          bias=activation == "swiglu_oai")
    ckpt["w1_scale"][1] += 12                       # a whole expert's gate rows
    ckpt["w3_scale"][2, 5:9] += 9                   # a few up rows
    ckpt["w2_scale"][1, :, 0] += 14                 # one block of every row of an expert
    kernel = moe_ops.prepare_weights(quant="mxfp4", activation=activation, dtype=dtype,
                                     device=DEVICE, **ckpt)
    assert float(kernel["w13_global_scale"].max()) > 1 and float(kernel["w2_global_scale"].max()) > 1
    assert int(kernel["w13_scale"].max()) <= 128 and int(kernel["w2_scale"].max()) <= 128
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    ids[0] = torch.tensor([1, 2], dtype=torch.int32)
    weights = torch.rand(T, k, generator=gen) + 0.1
    run_and_check("mxfp4", ckpt, kernel, x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE),
                  activation=activation)


def test_fp4_through_the_public_op(poisoned_empty):
    """moe_ops.fused_moe(backend='triton') hands nvfp4's global scales to the kernels."""
    ckpt, kernel, x, ids, weights = make_case("nvfp4", 3, 64, 32, 4, 2, seed=3)
    out = moe_ops.fused_moe(x, topk_ids=ids, topk_weights=weights, **kernel, quant="nvfp4",
                            backend="triton")
    expected = moe64(x.cpu(), ids.cpu(), weights.cpu(), quant="nvfp4", **ckpt)
    assert torch.isfinite(out).all()
    assert rel_frobenius(out, expected) <= TOL


@triton.jit
def _dequant_kernel(packed_ptr, scale_ptr, out_ptr, QUANT: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, G: tl.constexpr, DTYPE: tl.constexpr,
                    FAST: tl.constexpr = False):
    # one K step of kernel-order rows (K = BK): thread group t's run is bytes t*BK/8 ...
    rows = tl.arange(0, BN)
    runs = tl.arange(0, 4)[:, None] * (BK // 8) + tl.arange(0, BK // 8)[None, :]
    packed = tl.load(packed_ptr + rows[:, None, None] * (BK // 2) + runs[None, :, :])
    groups = tl.arange(0, BK // G)
    scale = tl.load(scale_ptr + rows[:, None] * (BK // G) + groups[None, :])
    if FAST:
        w = _dequant_fp4_tile_bf16_asm(packed, scale, QUANT, BN, BK)
    else:
        w = _dequant_fp4_tile(packed, scale, QUANT, BN, BK, DTYPE)
    tl.store(out_ptr + rows[:, None] * BK + tl.arange(0, BK)[None, :], w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequant_tile_exact(dtype):
    """_dequant_fp4_tile gives every (code, scale) product exactly, in the dot's dtype and in
    natural K order, from kernel-order bytes."""
    gen = torch.Generator().manual_seed(0)
    for quant, group in (("nvfp4", 16), ("mxfp4", 32)):
        bn, bk = 16, 256  # one padded row: K = 256
        natural = torch.randint(0, 256, (bn, bk // 2), dtype=torch.uint8, generator=gen)
        natural[:, :16] = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte
        if quant == "nvfp4":
            scale = (torch.rand(bn, bk // group, generator=gen) * 300 + 2 ** -9)
            scale = scale.to(torch.float8_e4m3fn)
        else:
            # fp16 holds 2^-14 .. 2^15: keep the dequantized values inside it
            scale = torch.randint(112, 138, (bn, bk // group), dtype=torch.uint8, generator=gen)
        out = torch.empty(bn, bk, dtype=dtype, device=DEVICE)
        _dequant_kernel[(1,)](q.fp4_to_kernel_order(natural).to(DEVICE),
                              scale.view(torch.uint8).to(DEVICE), out, quant,
                              bn, bk, group, tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
        expected = q.dequantize_fp4(natural, scale, quant)
        assert torch.equal(out.cpu().float(), expected), quant


@pytest.mark.skipif(DEVICE != "cuda", reason="the inline-PTX decode runs on the GPU only")
def test_fast_dequant_tile_exact_for_every_scale():
    """The GPU's bf16 decode (_dequant_fp4_tile_bf16_asm: e2m1 codes and nvfp4's e4m3 scales
    by bit moves) gives its (code, scale) products exactly (nvfp4: / NVFP4_FAST_EPILOGUE) for
    every code byte and every finite e4m3 scale byte (both signs, the subnormals), and for
    every e8m0 byte mxfp4's kernel layout holds (0-128, quant.mxfp4_fold_scales)."""
    gen = torch.Generator().manual_seed(1)
    for quant, group in (("nvfp4", 16), ("mxfp4", 32)):
        bn, bk = 16 * 16, 256
        natural = torch.arange(256, dtype=torch.uint8).repeat(bn * bk // 2 // 256).view(bn, bk // 2)
        natural = natural[torch.randperm(bn, generator=gen)]
        if quant == "nvfp4":
            scale = torch.arange(256, dtype=torch.uint8)
            scale[0x7F], scale[0xFF] = 0x7E, 0xFE  # e4m3's NaNs: no checkpoint holds one
            scale = scale.repeat(bn * bk // group // 256).view(bn, bk // group)
        else:
            scale = torch.arange(q.MXFP4_FOLD_MAX + 1, dtype=torch.uint8).repeat(
                -(-bn * bk // group // (q.MXFP4_FOLD_MAX + 1)))[:bn * bk // group]
            scale = scale[torch.randperm(scale.numel(), generator=gen)].view(bn, bk // group)
        out = torch.full((bn, bk), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        packed, scale_dev = q.fp4_to_kernel_order(natural).to(DEVICE), scale.to(DEVICE)
        for rows in range(0, bn, 16):  # a 16-row tile a launch
            _dequant_kernel[(1,)](packed[rows:rows + 16], scale_dev[rows:rows + 16],
                                  out[rows:rows + 16], quant, 16, bk, group, tl.bfloat16,
                                  FAST=True)
        expected = q.dequantize_fp4(natural, scale.view(torch.float8_e4m3fn)
                                    if quant == "nvfp4" else scale, quant)
        if quant == "nvfp4":
            expected = expected / NVFP4_FAST_EPILOGUE
        assert torch.equal(out.cpu().float(), expected), quant


def test_fp4_config_rules():
    for quant, group in (("nvfp4", 16), ("mxfp4", 32)):
        for rows in (0.03, 1, 20, 100, 1000):
            for gemm, (n, k) in ((1, (2 * 2880, 2880)), (2, (2880, 2880)),
                                 (1, (2 * 2048, 7168)), (2, (7168, 2048))):
                problem = GemmProblem(gemm, 128, n, k, rows, torch.bfloat16, quant)
                default = default_config(problem)
                assert config_problems(problem, default) == [], (problem, default)
                space = config_space(problem)
                assert space and default in config_space(problem, prune=False)
                assert all(c.block_k >= 32 and c.block_k % group == 0 for c in space)
        problem = GemmProblem(1, 8, 64, 256, 1, torch.bfloat16, quant)
        assert config_problems(problem, GemmConfig(block_k=16))
        # K must be whole scale groups
        assert config_problems(GemmProblem(1, 8, 64, 48, 1, torch.bfloat16, quant),
                               GemmConfig(block_k=32)) or group == 16


@pytest.mark.parametrize("quant,routing,activation", [
    ("nvfp4", "deepseek_v3", "swiglu"), ("mxfp4", "renormalize", "swiglu_oai")])
def test_fp4_layer_quantized_on_load(quant, routing, activation):
    """FusedMoE(backend='triton') quantizing bf16 weights on load, against backend='reference'
    on the same prepared tensors (routing through the layer, T = 1 direct and T = 9 aligned)."""
    gen = torch.Generator().manual_seed(5)
    extra = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5) if routing == "deepseek_v3" else {}
    config = dict(num_experts=8, hidden_size=128, intermediate_size=96, top_k=3, routing=routing,
                  activation=activation, quant=quant, bias=activation == "swiglu_oai",
                  device=DEVICE, **extra)
    reference = moe_ops.FusedMoE(**config, backend="reference")

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(DEVICE)

    weights = dict(w1=rand(8, 96, 128), w2=rand(8, 128, 96), w3=rand(8, 96, 128))
    if config["bias"]:
        weights.update(b1=rand(8, 96), b2=rand(8, 128), b3=rand(8, 96))
    if routing == "deepseek_v3":
        weights["routing_bias"] = rand(8)
    reference.load_weights(**weights)
    layer = moe_ops.FusedMoE(**config, backend="triton")
    layer.load_state_dict(reference.state_dict())
    for num_tokens in (1, 9):
        x = torch.randn(num_tokens, 128, generator=gen).to(DEVICE, torch.bfloat16)
        logits = torch.randn(num_tokens, 8, generator=gen).to(DEVICE)
        out, ref = layer(x, logits), reference(x, logits)
        assert torch.isfinite(out).all()
        assert rel_frobenius(out, ref) <= TOL, (quant, num_tokens)


def test_explicit_config_past_the_row_padding_is_refused():
    """A K step wider than the rows' padding (FP4_K_ALIGN) would read past them: an explicit
    config asking for it raises before any launch."""
    case = make_case("mxfp4", 3, 96, 32, 4, 2)
    ckpt, kernel, x, ids, weights = case
    with pytest.raises(ValueError, match="block_k <= 256"):
        run_and_check("mxfp4", ckpt, kernel, x, ids, weights,
                      gemm1_config=GemmConfig(16, 32, 512, 1, 4, 2, swap_ab=True))


@pytest.mark.parametrize("quant", FP4)
def test_fp4_k_step_count_at_compile_or_run_time(quant, monkeypatch, poisoned_empty):
    """4-bit launches without split-K take their K-step count as a constant (static_k_steps);
    the run-time count (FP4_STATIC_K_STEPS off, kept for A/B runs) computes the same bytes.
    Several K steps (H = 160: 5 steps of 32) in GEMM1, split-K GEMM2 on the run-time count."""
    import dataclasses
    from moe_ops.kernels import grouped_gemm as gg

    config = GemmConfig(16, 32, 32, 1, 4, 2, swap_ab=quant == "nvfp4")
    assert gg.static_k_steps(quant, 160, config) == 5
    assert gg.static_k_steps(quant, 160, dataclasses.replace(config, split_k=2)) == 0
    assert gg.static_k_steps("none", 160, config) == 0
    force_dispatch(monkeypatch, "aligned")
    case = make_case(quant, 5, 160, 96, 4, 2, seed=23)
    outs = []
    for static in (True, False):
        monkeypatch.setattr(gg, "FP4_STATIC_K_STEPS", static)
        assert gg.static_k_steps(quant, 160, config) == (5 if static else 0)
        outs.append(run_and_check(quant, *case, gemm1_config=config,
                                  gemm2_config=dataclasses.replace(config, split_k=2)))
    assert torch.equal(outs[0], outs[1])
