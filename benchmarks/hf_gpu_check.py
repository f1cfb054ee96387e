"""transformers models with experts_implementation="moe_ops", end to end (GPU: the Triton backend).

For four families (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3), a small random bf16 model built
from its config class (nothing is downloaded), one decoder layer wide enough to exercise the
kernels (H=512, up to 16 experts):

1. logits: bf16 "moe_ops" and bf16 "eager", each against the float32 eager model; moe_ops must
   be no less accurate than transformers' own bf16 path (with one layer the router sees the same
   bf16 hidden states under both, so the comparison is of the experts alone);
2. greedy generate() with "eager" and with "moe_ops" (token agreement, informational: bf16
   ties can flip a greedy choice);
3. fine-grained FP8 (Mixtral, Qwen3-MoE, DeepSeek-V3): the experts swapped for transformers'
   FP8Experts holding the same weights quantized per 128x128 block, as a fine-grained FP8
   checkpoint loads; "moe_ops" (its FP8 registry entry, the fp8_block kernels) against
   transformers' FP8Experts loop with a plain-torch dynamic-FP8 linear (transformers' own FP8
   kernels come from the hub at run time);
4. generate() with a static cache compiled the way transformers supports it: generate compiles
   the decoding forward itself when the cache is static (`cache_implementation="static"`, with
   `compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")`: CUDA graphs; if
   fullgraph fails, that is a failure and the run is retried with graph breaks allowed, to see
   further), and runs the prefill
   uncompiled, which allocates the static cache outside any graph and marks its tensors as
   static addresses. (Wrapping `model.forward` in torch.compile by hand on top of that put the
   prefill, and the cache's lazy allocation, inside a CUDA graph: its tensors were then graph
   outputs overwritten by the next replay, "accessing tensor output of CUDAGraphs that has been
   overwritten".) The compiled run must record no cudagraph skips, and its per-step logits
   (`output_logits`, copies made by generate) must match the uncompiled moe_ops generate at
   every step whose inputs are still identical (up to and including the first step whose
   greedy token differs); tokens are reported.

Without CUDA it runs a tiny CPU smoke version (H=128, backend "aot_eager", no CUDA graphs).
Prints one line per check; exits non-zero on any failure. About 2-3 minutes on an H200.

    python benchmarks/hf_gpu_check.py                       # all families
    python benchmarks/hf_gpu_check.py --families mixtral --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import transformers  # noqa: E402

import moe_ops.integrations.transformers as moe_hf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
VOCAB = 1024 if GPU else 256
HIDDEN = 512 if GPU else 128
COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
              vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
              bos_token_id=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, intermediate_size=2 * HIDDEN, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
                       num_experts=16, num_experts_per_tok=4, head_dim=HIDDEN // 8,
                       norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(COMMON, intermediate_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2,
                     head_dim=HIDDEN // 8, layer_types=["full_attention"])),
    # MLA attention (no key/value head sharing: a static cache sizes itself by
    # num_key_value_heads, so it equals the head count) with equal key and value head dims,
    # group-limited routing, a shared expert; first_k_dense_replace=0: the one layer is MoE.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(COMMON, num_key_value_heads=8, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
                         n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                         topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5,
                         kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32,
                         qk_nope_head_dim=32, v_head_dim=64)),
}
# Tolerance on the per-step logits of compiled vs uncompiled moe_ops generate (bf16; inductor
# fuses the attention and norms differently from eager).
GENERATE_LOGITS_TOLERANCE = 3e-2


def build(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    config_name, model_name, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs))
    with torch.no_grad():  # make the experts matter: HF's init leaves them tiny
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                if pname in ("gate_up_proj", "down_proj"):
                    p.copy_(torch.randn_like(p) * 0.05)
    return model.to(DEVICE, dtype).eval()


def logits(model, implementation: str, ids: torch.Tensor) -> torch.Tensor:
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def generate(model, prompt: torch.Tensor, new_tokens: int, **kwargs):
    """Greedy generate: (sequences [B, P+N], per-step logits float32 [B, N, V])."""
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack([step.float() for step in out.logits], dim=1)


def compare_generations(tokens_a, logits_a, tokens_b, logits_b, prompt_len: int):
    """Relative logits error over the steps whose inputs were identical in both runs (up to and
    including the first step whose greedy token differs), those steps, token agreement."""
    new_a, new_b = tokens_a[:, prompt_len:], tokens_b[:, prompt_len:]
    differ = (new_a != new_b).any(dim=0).nonzero()
    steps = int(differ[0]) + 1 if differ.numel() else new_a.shape[1]
    a, b = logits_a[:, :steps], logits_b[:, :steps]
    error = ((a - b).norm() / b.norm()).item()
    return error, steps, (new_a == new_b).float().mean().item()


def compile_config(fullgraph: bool = True):
    config = transformers.CompileConfig(fullgraph=fullgraph, mode="reduce-overhead")
    if not GPU:  # a CPU smoke run: no CUDA graphs, no C++ toolchain needed
        config = transformers.CompileConfig(fullgraph=fullgraph, backend="aot_eager", mode=None)
        config._compile_all_devices = True  # generate compiles only on accelerators otherwise
    return config


def check_family(name: str, args, report) -> None:
    ids = torch.randint(3, VOCAB, (2, 48), device=DEVICE,
                        generator=torch.Generator(DEVICE).manual_seed(1))
    truth = logits(build(name, torch.float32), "eager", ids)
    model = build(name)
    eager, ours = logits(model, "eager", ids), logits(model, "moe_ops", ids)
    err_eager = ((eager - truth).norm() / truth.norm()).item()
    err_ours = ((ours - truth).norm() / truth.norm()).item()
    ok = err_ours <= 1.25 * err_eager + 1e-3 and bool(torch.isfinite(ours).all())
    report(ok, name, f"bf16 logits vs the fp32 model: moe_ops {err_ours:.2e}, transformers "
                     f"eager {err_eager:.2e}")

    prompt = ids[:1, :16]
    n = args.max_new_tokens
    model.set_experts_implementation("eager")
    tokens_eager, logits_eager = generate(model, prompt, n)
    model.set_experts_implementation("moe_ops")
    tokens_ours, logits_ours = generate(model, prompt, n)
    error, steps, same = compare_generations(tokens_ours, logits_ours, tokens_eager, logits_eager,
                                             prompt.shape[1])
    report(None, name, f"greedy generate: {same:.0%} of tokens equal to eager; logits over the "
                       f"{steps} comparable steps {error:.2e} (bf16)")
    if name in FP8_FAMILIES and not args.no_fp8:
        check_fp8(name, ids, report)

    if args.no_compile:
        return
    if args.deadline_s and time.perf_counter() - args.started > args.deadline_s:
        report("skip", name, f"compiled generate skipped: past --deadline-s {args.deadline_s:.0f}")
        return
    moe_hf.prepare(model)  # fill the kernel-layout buffers eagerly: fullgraph traces read them
    mode = "reduce-overhead (CUDA graphs)" if GPU else "aot_eager (CPU smoke)"
    for fullgraph in (True, False):
        try:
            result = compiled_generate(model, prompt, n, fullgraph)
        except Exception as exc:  # noqa: BLE001
            torch._dynamo.reset()
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            report(False, name, f"generate, static cache, compiled by generate ({mode}, "
                                f"fullgraph={fullgraph}) raised {type(exc).__name__}: {first}")
            if fullgraph:
                continue  # still exercise CUDA graphs with graph breaks allowed, to see further
            return
        tokens_graph, logits_graph, warm, elapsed, skips, compiled = result
        error, steps, same = compare_generations(tokens_graph, logits_graph, tokens_ours,
                                                 logits_ours, prompt.shape[1])
        ok = (compiled and skips == 0 and tokens_graph.shape == tokens_ours.shape
              and error <= GENERATE_LOGITS_TOLERANCE)
        report(ok, name, f"generate, static cache, compiled by generate ({mode}, fullgraph="
                         f"{fullgraph}): logits vs uncompiled moe_ops {error:.2e} over {steps} "
                         f"steps, {same:.0%} of tokens equal, {skips or 'no'} cudagraph skips"
                         + ("" if compiled else ", generate did NOT compile")
                         + f" ({warm:.1f} s incl. compile, then {elapsed:.2f} s)")
        return


# Families whose experts transformers' fine-grained FP8 path takes (no biases) with I and H
# multiples of 128 at these sizes.
FP8_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
# Both sides requantize the bf16 intermediate between the GEMMs, rounded at different points
# (bf16 there, float32 until stored here), which moves a few elements by one e4m3 step: ~2e-2
# on the logits (1.75e-2 for mixtral on CPU). A wrong scale or a swapped gate/up half is O(1).
FP8_TOLERANCE = 5e-2


def _dynamic_fp8_linear(self, x, weight, scale_inv, activation_scale=None):
    """transformers' fine-grained FP8 linear (activations quantized per token per 128 columns,
    128x128 block-scaled weights) in plain torch: its own kernels come from the hub at run
    time, which an offline machine cannot fetch."""
    from moe_ops import quant as q
    n, k = weight.shape
    w = weight.float() * q.expand_block_scales(scale_inv.float(), n, k)
    xq, xs = q.quantize_fp8_per_token_group(x.reshape(-1, k))
    xd = xq.float() * xs.repeat_interleave(q.FP8_BLOCK, dim=1)[:, :k]
    return torch.nn.functional.linear(xd, w).to(x.dtype).view(*x.shape[:-1], n)


def to_fine_grained_fp8(model) -> int:
    """Swap every experts module for transformers' FP8Experts (as its replace_with_fp8_linear
    does for a fine-grained FP8 checkpoint, weight_block_size 128x128), holding the module's
    weights quantized per 128x128 block; "eager" then runs the plain-torch emulation above."""
    import types
    from transformers.integrations import finegrained_fp8 as fp8
    from transformers.integrations.moe import use_experts_implementation
    from moe_ops import quant as q
    swapped = 0
    for module_name, sub in list(model.named_modules()):
        if not (module_name.endswith(".experts") and hasattr(type(sub).forward, "__wrapped__")):
            continue
        cls = use_experts_implementation(experts_class=fp8.FP8Experts,
                                         experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS,
                                         has_bias=False, has_gate=True)
        new = cls(config=sub.config, block_size=(q.FP8_BLOCK, q.FP8_BLOCK),
                  activation_scheme="dynamic", scale_fmt="float", has_bias=False, has_gate=True)
        with torch.no_grad():
            for pname in ("gate_up_proj", "down_proj"):
                values, scale = q.quantize_fp8_block(getattr(sub, pname).float())
                setattr(new, pname, torch.nn.Parameter(values, requires_grad=False))
                setattr(new, pname + "_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
        new.linear = types.MethodType(_dynamic_fp8_linear, new)
        model.set_submodule(module_name, new)
        swapped += 1
    return swapped


def check_fp8(name: str, ids: torch.Tensor, report) -> None:
    """A fine-grained FP8 model: experts_implementation="moe_ops" (registered in transformers'
    FP8 experts registry, run on the fp8_block kernels) against transformers' FP8Experts loop
    with the plain-torch dynamic-FP8 linear, both bf16."""
    try:
        from transformers.integrations import finegrained_fp8
    except Exception as exc:  # noqa: BLE001
        report("skip", name, f"fine-grained FP8: not in this transformers ({type(exc).__name__})")
        return
    if not hasattr(finegrained_fp8, "FP8ExpertsInterface"):
        report("skip", name, "fine-grained FP8: no FP8ExpertsInterface in this transformers")
        return
    model = build(name)
    sizes = {(m.down_proj.shape[1], m.down_proj.shape[2]) for m in model.modules()
             if hasattr(type(m).forward, "__wrapped__") and hasattr(m, "down_proj")}
    if any(h % 128 or i % 128 for h, i in sizes):  # the CPU smoke sizes: moe_ops would fall back
        report("skip", name, f"fine-grained FP8: experts (H, I) {sorted(sizes)} are not multiples "
                             "of 128 here")
        return
    count = to_fine_grained_fp8(model)
    expected = logits(model, "eager", ids)
    ours = logits(model, "moe_ops", ids)
    specs = [m.__dict__.get(moe_hf._SPEC_ATTR) for m in model.modules()
             if isinstance(m, finegrained_fp8.FP8Experts)]
    on_kernels = all(getattr(spec, "quant", None) == "fp8_block" for spec in specs)
    error = ((ours - expected).norm() / expected.norm()).item()
    ok = on_kernels and error <= FP8_TOLERANCE and bool(torch.isfinite(ours).all())
    report(ok, name, f"fine-grained FP8 ({count} FP8Experts, 128x128 blocks): moe_ops fp8_block "
                     f"logits vs transformers' dynamic-FP8 path (plain-torch linear) {error:.2e}"
                     + ("" if on_kernels else ", NOT run on moe_ops (fell back)"))


def compiled_generate(model, prompt: torch.Tensor, n: int, fullgraph: bool):
    """Two static-cache generates compiled by generate itself (the first compiles and records
    the CUDA graphs), the second returned with timings, cudagraph skips, whether it compiled."""
    from torch._dynamo.utils import counters
    skips_before = counters["inductor"]["cudagraph_skips"]
    config = compile_config(fullgraph)
    start = time.perf_counter()
    generate(model, prompt, n, cache_implementation="static", compile_config=config)
    warm = time.perf_counter() - start
    start = time.perf_counter()
    tokens, step_logits = generate(model, prompt, n, cache_implementation="static",
                                   compile_config=config)
    elapsed = time.perf_counter() - start
    skips = counters["inductor"]["cudagraph_skips"] - skips_before
    compiled = getattr(model, "_compiled_call", None) is not None
    return tokens, step_logits, warm, elapsed, skips, compiled


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled generate")
    parser.add_argument("--no-fp8", action="store_true",
                        help="skip the fine-grained FP8 check (FP8Experts -> fp8_block)")
    parser.add_argument("--deadline-s", type=float, default=210.0,
                        help="skip the compiled generates left after this many seconds (0: none)")
    args = parser.parse_args(argv)
    args.started = time.perf_counter()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    moe_hf.register()
    failures = 0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if GPU else 'CPU (smoke run)'}", flush=True)

    def report(ok, name: str, text: str) -> None:
        nonlocal failures
        status = {True: "PASS", False: "FAIL", None: "INFO", "skip": "SKIP"}[ok]
        failures += ok is False
        print(f"{status} {name:<11} {text}", flush=True)

    for name in args.families:
        try:
            check_family(name, args, report)
        except Exception:  # one family's failure must not hide the others'
            report(False, name, traceback.format_exc(limit=4))
        finally:
            torch._dynamo.reset()
    print(f"{failures} failed checks, {time.perf_counter() - args.started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
