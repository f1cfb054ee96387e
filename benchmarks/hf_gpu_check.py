"""transformers models on the GPU with experts_implementation="moe_ops" (the Triton backend).

For three families (Mixtral, Qwen3-MoE, gpt-oss), a small random model on CUDA: bf16 logits with
"moe_ops" and with "eager", each against the float32 eager model (so moe_ops must be no less
accurate than transformers' own bf16 path), greedy generate() with both, and generate() with a
static cache under torch.compile(mode="reduce-overhead") (CUDA graphs), which must run and agree
with the uncompiled moe_ops tokens. Prints one line per check; exits non-zero on any failure.

    python benchmarks/hf_gpu_check.py
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import transformers  # noqa: E402

import moe_ops.integrations.transformers as moe_hf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of this script
# One decoder layer: the router then sees the same bf16 hidden states under both
# implementations, so the logits compare the experts alone (with two layers, a bf16 difference
# in layer 1 can flip a top-k choice in layer 2 and swamp the comparison).
COMMON = dict(hidden_size=512, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
              vocab_size=1024, max_position_embeddings=256)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
                       num_experts_per_tok=4, head_dim=64, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(COMMON, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2,
                     head_dim=64, layer_types=["full_attention"])),
}


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


def main() -> int:
    moe_hf.register()
    failures = 0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}")
    for name in FAMILIES:
        try:
            ids = torch.randint(0, 1024, (2, 48), device=DEVICE)
            truth = logits(build(name, torch.float32), "eager", ids)
            model = build(name)
            eager, ours = logits(model, "eager", ids), logits(model, "moe_ops", ids)
            err_eager = ((eager - truth).norm() / truth.norm()).item()
            err_ours = ((ours - truth).norm() / truth.norm()).item()
            ok = err_ours <= 1.25 * err_eager + 1e-3 and torch.isfinite(ours).all().item()
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name:<10} bf16 logits vs the fp32 model: moe_ops "
                  f"{err_ours:.2e}, transformers eager {err_eager:.2e}")

            prompt = ids[:1, :16]
            gen = dict(max_new_tokens=12, do_sample=False)
            model.set_experts_implementation("eager")
            tokens_eager = model.generate(prompt, **gen)
            model.set_experts_implementation("moe_ops")
            tokens_ours = model.generate(prompt, **gen)
            same = (tokens_eager == tokens_ours).float().mean().item()
            print(f"INFO {name:<10} greedy generate: {same:.0%} of tokens equal to eager (bf16)")

            moe_hf.prepare(model)
            model.forward = torch.compile(model.forward, mode="reduce-overhead")
            start = time.perf_counter()
            tokens_graph = model.generate(prompt, cache_implementation="static", **gen)
            tokens_graph = model.generate(prompt, cache_implementation="static", **gen)
            elapsed = time.perf_counter() - start
            same_graph = (tokens_graph == tokens_ours).float().mean().item()
            ok = tokens_graph.shape == tokens_ours.shape
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name:<10} generate, static cache, "
                  f"compile(reduce-overhead) ran: {same_graph:.0%} of tokens equal to uncompiled "
                  f"moe_ops, bf16 ({elapsed:.1f} s incl. compile)")
        except Exception:  # one family's failure must not hide the others'
            failures += 1
            print(f"FAIL {name:<10} {traceback.format_exc(limit=3)}")
        finally:
            torch._dynamo.reset()
    print(f"{3 - min(failures, 3)} families clean, {failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
