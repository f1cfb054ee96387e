"""The activations' fp8 quantization (kernels/act_quant.py) on one GPU, alone: bit-exactness
against quant.py's reference on the layers' largest inputs (random rows, and rows built to sit on
e4m3 rounding midpoints, where a wrongly rounded division shows): codes by value, scales by
bits, zeros whose sign alone differs counted apart; and its time and bandwidth (bytes read +
written over the median time). The exit status is 1 if any value differs.

    python benchmarks/dev_act_quant.py --out benchmarks/results/h200_act_quant.json
    # A/B against another version of the module (a file with the same act_quant function)
    python benchmarks/dev_act_quant.py --baseline /path/to/old_act_quant.py
    # decode sizes (rows = T * k at T = 1 ... 256), the kernel's two forms (split_k off / on),
    # timed as CUDA-graph replays with L2 flushed (launch overhead out, as served)
    python benchmarks/dev_act_quant.py --decode
    # only some cases (by a word of their name)
    python benchmarks/dev_act_quant.py --cases qwen3
    # the prefill cases in each of the kernel's forms: the launcher's pick, split_k on (a row
    # read whole or its 128-column groups a program each) and off (looped)
    python benchmarks/dev_act_quant.py --forms

Writes JSON (command, GPU, date, records) and prints a table last.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository root on sys.path)
from moe_ops.kernels.act_quant import act_quant  # noqa: E402
from moe_ops.quant import quantize_fp8_per_token, quantize_fp8_per_token_group  # noqa: E402

# (name, quant, rows, K): GEMM1's x and GEMM2's intermediate at T = 16384 (rows = T * k).
CASES = (("mixtral x", "fp8", 16384, 4096), ("mixtral intermediate", "fp8", 32768, 14336),
         ("llama4 x", "fp8", 16384, 5120), ("llama4 intermediate", "fp8", 16384, 8192),
         ("qwen3 intermediate", "fp8", 131072, 768),
         ("deepseek x", "fp8_block", 16384, 7168),
         ("deepseek intermediate", "fp8_block", 131072, 2048))
# --decode: GEMM1's x (rows = T) and GEMM2's intermediate (rows = T * k) at decode sizes
DECODE_CASES = tuple(
    (f"{model} {what} T={t}", quant, t * (k if what == "intermediate" else 1), width)
    for model, quant, k, h, i in (("mixtral", "fp8", 2, 4096, 14336), ("llama4", "fp8", 1, 5120, 8192),
                                  ("qwen3", "fp8", 8, 2048, 768),
                                  ("deepseek", "fp8_block", 8, 7168, 2048))
    for t in (1, 16, 64) for what, width in (("x", h), ("intermediate", i)))
DECODE_CASES += (("mixtral intermediate T=128", "fp8", 256, 14336),
                 ("mixtral intermediate T=256", "fp8", 512, 14336),
                 ("deepseek x T=256", "fp8_block", 256, 7168),
                 ("deepseek x T=512", "fp8_block", 512, 7168))


def inputs(rows: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        x = torch.randn(rows, k, generator=gen, device="cuda")
        return (x * torch.exp(torch.randn(rows, 1, generator=gen, device="cuda"))).bfloat16()
    # Half-integers up to 448 with 448 in every 128-column group: x * 448 / amax = x, so the
    # quotients are exact e4m3 midpoints (ties to even) far more often than in real data.
    x = torch.randint(-896, 897, (rows, k), generator=gen, device="cuda").float() / 2
    x[:, ::128] = 448.0
    return x.bfloat16()


def mismatches(x: torch.Tensor, quant: str, fn) -> tuple[int, int]:
    """(values that differ: codes by value and scales by bits, zeros that differ in sign only).
    The kernel writes +0 where a tiny negative value rounds to zero and torch's cast -0 (on the
    H200: the same value, so the same GEMM results); counted apart."""
    q, s = fn(x, quant)
    ref_q, ref_s = (quantize_fp8_per_token(x) if quant == "fp8"
                    else quantize_fp8_per_token_group(x))
    bytes_differ = q.view(torch.uint8) != ref_q.view(torch.uint8)
    values_differ = q.float() != ref_q.float()
    return (int(values_differ.sum() + (s.view(torch.int32) != ref_s.view(torch.int32)).sum()),
            int((bytes_differ & ~values_differ).sum()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another act_quant module, timed beside")
    parser.add_argument("--out", type=Path, default=Path("act_quant.json"))
    parser.add_argument("--decode", action="store_true",
                        help="decode sizes, split_k off and on, as CUDA-graph replays")
    parser.add_argument("--forms", action="store_true",
                        help="the launcher's form beside split_k on and off (prefill cases)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="only the cases whose name holds one of these words")
    args = parser.parse_args()
    variants = {"act_quant": act_quant}
    cases = CASES
    time_one = lambda fn: triton.testing.do_bench(fn, rep=100, return_mode="median") * 1e3
    if args.decode:
        from moe_ops.tuning import graph_timer
        cases = DECODE_CASES
        variants = {"act_quant": lambda x, quant: act_quant(x, quant, split_k=True),
                    "looped": lambda x, quant: act_quant(x, quant, split_k=False)}
        time_one = lambda fn: graph_timer(fn) * 1e6
    elif args.forms:
        variants.update(split=lambda x, quant: act_quant(x, quant, split_k=True),
                        looped=lambda x, quant: act_quant(x, quant, split_k=False))
    if args.cases:
        cases = tuple(c for c in cases if any(word in c[0] for word in args.cases))
        if not cases:
            parser.error(f"--cases: no case's name holds any of {args.cases}")
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_act_quant", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        variants["baseline"] = module.act_quant
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for name, quant, rows, k in cases:
        for kind in ("random", "midpoints"):
            x = inputs(rows, k, kind, gen)
            for variant, fn in variants.items():
                values, zero_signs = mismatches(x, quant, fn)
                record = dict(case=name, quant=quant, rows=rows, k=k, inputs=kind,
                              variant=variant, mismatches=values, zero_sign_only=zero_signs)
                if kind == "random":
                    us = time_one(lambda: fn(x, quant))
                    scale_bytes = rows * 4 * (1 if quant == "fp8" else -(-k // 128))
                    moved = rows * k * 3 + scale_bytes  # bf16 in, e4m3 out, fp32 scales
                    record.update(us=us, tb_s=moved / us / 1e6)
                records.append(record)
                print(f"{name:22} {kind:9} {variant:9} mismatches {values:>6} "
                      f"(+{zero_signs} signed zeros) "
                      + (f"{record['us']:8.1f} us {record['tb_s']:5.2f} TB/s" if "us" in record
                         else ""), flush=True)
            del x
    bench.write_records(args.out, records)
    print(f"\n{'case':22} {'variant':9} {'us':>8} {'TB/s':>5}  value mismatches (random / midpoints)")
    for r in records:
        if "us" in r:
            other = next(o for o in records if o["case"] == r["case"]
                         and o["variant"] == r["variant"] and o["inputs"] == "midpoints")
            print(f"{r['case']:22} {r['variant']:9} {r['us']:8.1f} {r['tb_s']:5.2f}  "
                  f"{r['mismatches']} / {other['mismatches']}")
    return 0 if all(r["mismatches"] == 0 for r in records if r["variant"] == "act_quant") else 1


if __name__ == "__main__":
    sys.exit(main())
