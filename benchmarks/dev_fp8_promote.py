"""fp8 prefill: how often to promote the MMA's partial sum into fp32 (FP8_PROMOTE_K), timed and
checked against the reference backend on the Mixtral and Qwen3 fp8 layers. One H200 run:
    python benchmarks/dev_fp8_promote.py [--out DIR]
Prints a table (us, TFLOP/s, relative Frobenius error against the reference) and writes JSON."""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_ops  # noqa: E402
import moe_ops.kernels.grouped_gemm as gg  # noqa: E402
from moe_ops import synthetic, tuning  # noqa: E402
from moe_ops.kernels.grouped_gemm import GemmConfig  # noqa: E402
from moe_ops.models import MODELS  # noqa: E402
from moe_ops.tune import build_layer  # noqa: E402

CONFIGS = {"64x128x128w4": GemmConfig(64, 128, 128, 8, 4, 3),
           "128x128x128w8": GemmConfig(128, 128, 128, 16, 8, 3),
           "128x256x128w8": GemmConfig(128, 256, 128, 16, 8, 3)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("MOE_OPS_RESULTS_DIR", "out"))
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = p.parse_args()
    rows = []
    start = time.time()
    for name in ("mixtral_8x7b", "qwen3_30b_a3b"):
        shape = MODELS[name]
        layer = build_layer(shape, "fp8", dtype=torch.bfloat16, device=torch.device("cuda"))
        ref_layer = build_layer(shape, "fp8", dtype=torch.bfloat16, device=torch.device("cuda"))
        ref_layer.load_state_dict(layer.state_dict())
        ref_layer.backend = "reference"
        for T in args.tokens:
            x = synthetic.hidden_states(T, shape.hidden_size, device="cuda", seed=T)
            logits = synthetic.router_logits(T, shape.num_experts, device="cuda", seed=T + 1)
            ids, w = moe_ops.route(logits, shape.top_k, routing=shape.routing)
            expected = ref_layer(x, topk_ids=ids, topk_weights=w).float() if T <= 4096 else None
            flops = 2 * T * shape.top_k * 3 * shape.hidden_size * shape.intermediate_size
            for promote_k in (128, 256, 512, 1024):
                gg.FP8_PROMOTE_K = promote_k
                for cname, config in CONFIGS.items():
                    try:
                        with tuning.force_config(config, config):
                            run = lambda: layer(x, topk_ids=ids, topk_weights=w)
                            out = run().float()
                            seconds = tuning.graph_timer(run)
                        err = (float((out - expected).norm() / expected.norm())
                               if expected is not None else None)
                        rows.append(dict(model=name, T=T, promote_k=promote_k, config=cname,
                                         us=seconds * 1e6, tflops=flops / seconds / 1e12, err=err))
                    except Exception as exc:  # noqa: BLE001
                        rows.append(dict(model=name, T=T, promote_k=promote_k, config=cname,
                                         error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    r = rows[-1]
                    print(f"[{time.time() - start:6.1f}s] {name} T={T} promote_k={promote_k} {cname}: "
                          + (f"{r['us']:.1f} us {r['tflops']:.0f} TFLOP/s err {r['err']}"
                             if "us" in r else r["error"]), flush=True)
        del layer, ref_layer
        torch.cuda.empty_cache()
    gg.FP8_PROMOTE_K = 128
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "fp8_promote.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
