#!/usr/bin/env python3
"""Prints one run's kernel measurements as a Markdown table: a row per mask (and length), a column
per kernel, each cell forward / backward median TFLOP/s. `–` is a direction the kernel does not
run (its record says why), `✗` a figure whose correctness check failed, `oom` out of memory, `°` a
cell that started on an idle GPU (its clocks boost above what sustained work holds under the
power cap, so the figure can read high).

    scripts/kernel-table.py [CACHE_DIR] [RUN_ID] [--kernels a,b,...]
    (defaults: $ATTNBENCH_CACHE or ./artifacts, the latest run, every kernel in the run's order)
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record import artifact, load_run  # noqa: E402


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
    figure += "°" if started_idle(m) else ""
    return figure if (m.get("correctness") or {}).get("passed", True) else figure + " ✗"


def started_idle(m):
    before = ((m.get("gpu") or {}).get("clocks_before") or {}).get("throttle_reasons") or []
    return "gpu_idle" in before


def row_of(node, nodes, m):
    """(mask, length, the other settings of the cell) from the cell's and its mask node's matrix
    values: kernel and direction are columns; the rest tells rows apart (block size, density, heads)."""
    matrix = {}
    for source in [nodes[i] for i in node.get("inputs", []) if nodes[i].get("uses") == "masks/generate"] + [node]:
        matrix.update(re.findall(r"(\w+)=([^,\]]+)", source["id"]))
    mask = matrix.pop("mask", None) or m.get("pattern") or (m.get("mask") or {}).get("pattern", "?")
    seqlen = matrix.pop("seqlen", str(m["shape"].get("seqlen", "")))
    rest = " ".join(f"{k}={v}" for k, v in matrix.items() if k not in ("kernel", "direction"))
    return mask, seqlen, rest


def main():
    record, args = arguments()
    nodes = {n["id"]: n for n in record["nodes"]}
    found, kernels, rows = {}, [], []
    for node in record["nodes"]:
        folder = artifact(args.cache, node)
        path = folder and os.path.join(folder, "measurement.json")
        if not path or not os.path.exists(path):
            continue
        m = json.load(open(path))
        if "kernel" not in m:
            continue
        row = row_of(node, nodes, m)
        kernel = m["kernel"]
        found[(row, kernel, m["direction"])] = m
        kernels += [kernel] if kernel not in kernels else []
        rows += [row] if row not in rows else []
    columns = args.kernels.split(",") if args.kernels else kernels
    settings = any(row[2] for row in rows)
    print("| mask | S | " + ("settings | " if settings else "") + " | ".join(columns) + " |")
    print("|---|---|" + ("---|" if settings else "") + "---|" * len(columns))
    for row in rows:
        cells = [f"{cell(found.get((row, k, 'fwd')))} / {cell(found.get((row, k, 'bwd')))}" for k in columns]
        cells = ["" if c == " / " else c for c in cells]
        print(f"| {row[0]} | {row[1]} | " + (f"{row[2]} | " if settings else "") + " | ".join(cells) + " |")
    if any(started_idle(m) for m in found.values()):
        print("\n°: started on an idle GPU; boost clocks can make it read high (the record's `gpu.clocks_before`).")


if __name__ == "__main__":
    main()
