#!/usr/bin/env python3
"""Prints one run's kernel measurements as a Markdown table: a row per mask (and length), a column
per kernel, each cell forward / backward median TFLOP/s. `–` is a direction the kernel does not
run (its record says why), `✗` a figure whose correctness check failed, `oom` out of memory.

    scripts/kernel-table.py [CACHE_DIR] [RUN_ID] [--kernels a,b,...]
    (defaults: $ATTNBENCH_CACHE or ./artifacts, the latest run, every kernel in the run's order)
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record import load_run  # noqa: E402


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", nargs="?", default=os.environ.get("ATTNBENCH_CACHE", "artifacts"))
    parser.add_argument("run", nargs="?", help="run id (default: the latest)")
    parser.add_argument("--kernels", help="comma-separated columns, in this order")
    args = parser.parse_args()
    return load_run(args.cache, args.run), args


def cell(m):
    if m is None:
        return ""
    if m.get("status") == "oom":
        return "oom"
    if m.get("status") != "ok":
        return "–"
    value = m["tflops"]["p50"]
    figure = f"{value:.0f}" if value >= 10 else f"{value:.3g}"
    return figure if (m.get("correctness") or {}).get("passed", True) else figure + " ✗"


def main():
    record, args = arguments()
    found, kernels, rows, documents = {}, [], [], {}
    for node in record["nodes"]:
        path = node.get("artifact") and os.path.join(node["artifact"], "measurement.json")
        if not path or not os.path.exists(path):
            continue
        m = json.load(open(path))
        if "kernel" not in m:
            continue
        matrix = dict(re.findall(r"(\w+)=([^,\]]+)", node["id"]))
        row = (matrix.get("mask") or m.get("pattern", "?"), matrix.get("seqlen", str(m["shape"].get("seqlen", ""))))
        kernel = m["kernel"]
        found[(row, kernel, m["direction"])] = m
        kernels += [kernel] if kernel not in kernels else []
        rows += [row] if row not in rows else []
        count = (m.get("mask") or {}).get("documents")
        if count:
            documents[row] = count
    columns = args.kernels.split(",") if args.kernels else kernels
    print("| mask | S | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{cell(found.get((row, k, 'fwd')))} / {cell(found.get((row, k, 'bwd')))}" for k in columns]
        cells = ["" if c == " / " else c for c in cells]
        print(f"| {row[0]} | {row[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
