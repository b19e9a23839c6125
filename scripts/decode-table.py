#!/usr/bin/env python3
"""Prints a run's decode steps as a Markdown table, one row per cache shape and one column per
kernel: median latency (µs), the bandwidth reached and its fraction of the device's copy bandwidth.

    scripts/decode-table.py [CACHE_DIR] [RUN_ID]    (defaults: $ATTNBENCH_CACHE or ./artifacts, latest)

A cell that failed its check shows `FAILED`; cells not measured are listed after the tables with
their status and reason. A second table gives attnbench's split counts and every kernel's check.
"""
import json
import os
import sys

cache = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ATTNBENCH_CACHE", "artifacts")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record import artifact, load_run  # noqa: E402


# Parameters every column shares unless a cell says otherwise (decode.yaml's).
DEFAULTS = {"splits": 0, "items_per_warp": 0, "dtype": "bf16", "heads_q": 64, "heads_kv": 8, "head_dim": 128}


def tokens(n):
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


record = load_run(cache, sys.argv[2] if len(sys.argv) > 2 else None)
cells, kernels, unmeasured = {}, [], []
for node in record["nodes"]:
    folder = artifact(cache, node)
    path = folder and os.path.join(folder, "decode.json")
    if not path or not os.path.exists(path):
        if node.get("status") not in ("ok", "cached") and node.get("uses", "").endswith("/decode"):
            unmeasured.append(f"- {node['id']}: {node.get('status')}: {(node.get('error') or '')[:160]}")
        continue
    step = json.load(open(path))
    kernel = step.get("kernel", "?")
    if "kv_lens" not in step:  # not measured: the record has the status and reason only
        unmeasured.append(f"- {node['id']}: {step.get('status')}: {step.get('reason', '')}")
        continue
    shape = (max(step["kv_lens"]), step["queries"], step.get("page_size") or 0, len(step["kv_lens"]))
    # A sweep (splits, dtype, heads) gives one shape several cells: the kernel's column takes each.
    setting = " ".join(f"{k}={node['params'][k]}" for k in ("splits", "items_per_warp", "dtype", "heads_q",
                                                             "heads_kv", "head_dim")
                       if k in node.get("params", {}) and node["params"][k] != DEFAULTS.get(k))
    column = f"{kernel} {setting}".strip()
    if column not in kernels:
        kernels.append(column)
    cells.setdefault(shape, {})[column] = step

print("| KV (longest) | new tokens | cache | batch | " + " | ".join(kernels) + " |")
print("|---" * (4 + len(kernels)) + "|")
for shape in sorted(cells):
    kv, queries, page, batch = shape
    row = [tokens(kv), str(queries), f"paged {page}" if page else "packed", str(batch)]
    for kernel in kernels:
        step = cells[shape].get(kernel)
        if step is None:
            row.append("")
        elif not (step.get("correctness") or {}).get("passed", True):
            row.append("FAILED")
        else:
            row.append(f"{step['latency_us']:.1f} µs, {step['bandwidth_gbs']:.0f} GB/s "
                       f"({100 * step['of_copy_bandwidth']:.0f}%)")
    print("| " + " | ".join(row) + " |")

print()
print("| KV | new | cache | kernel | splits | max error | checked |")
print("|---|---|---|---|---|---|---|")
for shape in sorted(cells):
    kv, queries, page, _ = shape
    for kernel, step in cells[shape].items():
        check = step.get("correctness") or {}
        error = check.get("max_error")
        print(f"| {tokens(kv)} | {queries} | {f'paged {page}' if page else 'packed'} | {kernel} | {step.get('splits', '')} | "
              f"{'' if error is None else f'{error:.1e}'} | {check.get('checked', '')} |")

if unmeasured:
    print()
    print("Not measured:")
    print("\n".join(unmeasured))
