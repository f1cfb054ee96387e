"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source page.

    ncu -k regex:_ws_fp4 -c 1 --section SourceCounters --section WarpStateStats -o prof \
        python benchmarks/dev_gluon_fp4_decode.py --once --cases decode \
        --variants "gluon 2 consumers"
    ncu -i prof.ncu-rep --page source --print-source sass --csv > prof.csv
    python benchmarks/ncu_sass_stalls.py prof.csv [--top 30]

Reads the CSV of the source page (one row per SASS instruction, with its PC-sampling counts)
and prints: the share of the samples each opcode takes, then the instructions holding the most
samples with the stall reasons sampled there. The column names are matched loosely (they vary
between Nsight Compute versions); the header found is printed first so a mismatch shows.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import re
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: str):
    """The CSV's header and rows; ncu may print lines before the header (progress, ==PROF==)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith('"') and ("Source" in line or "Address" in line)), None)
    if start is None:
        raise SystemExit(f"{path}: no CSV header with a Source or Address column")
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    return table[0], [row for row in table[1:] if len(row) == len(table[0])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=30, help="instructions listed")
    args = ap.parse_args(argv)
    header, rows = read_rows(args.csv)
    print("columns:", " | ".join(header))
    source = next(i for i, name in enumerate(header) if name in ("Source", "Address"))
    text = next((i for i, name in enumerate(header) if name == "Source"), source)
    samples = next((i for i, name in enumerate(header)
                    if re.search(r"Warp Stall Sampling \(All", name)), None)
    if samples is None:   # other versions' name of the same count
        samples = next((i for i, name in enumerate(header)
                        if name.strip() in ("# Samples", "Samples")), None)
    if samples is None:
        raise SystemExit("no 'Warp Stall Sampling (All Samples)' column: collect with "
                         "--section SourceCounters (or --set source)")
    # per-reason sample columns, where this version prints them (stall_* / *pcsamp*), not the
    # totals
    reasons = [i for i, name in enumerate(header)
               if re.search(r"stall_|pcsamp", name, re.IGNORECASE) and i != samples
               and not re.search(r"Warp Stall Sampling|Samples", name)]
    total = sum(number(row[samples]) for row in rows) or 1.0
    by_opcode = collections.Counter()
    for row in rows:
        instruction = row[text].strip()
        opcode = (instruction.split()[1] if instruction.startswith("@") and
                  len(instruction.split()) > 1 else instruction.split()[0] if instruction else "?")
        by_opcode[opcode.split(".")[0]] += number(row[samples])
    print(f"\n{len(rows)} instructions, {total:.0f} samples; by opcode:")
    for opcode, count in by_opcode.most_common(20):
        print(f"  {opcode:12} {count / total:6.1%}")
    print(f"\nthe {args.top} instructions holding the most samples:")
    ranked = sorted(rows, key=lambda row: -number(row[samples]))[:args.top]
    for row in ranked:
        detail = ", ".join(f"{header[i].split('(')[0].strip()[-28:]} {number(row[i]):.0f}"
                           for i in reasons if number(row[i]) > 0.05 * number(row[samples]))
        print(f"  {number(row[samples]) / total:6.1%}  {row[text].strip()[:70]:70}  {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
