#!/usr/bin/env python3
"""Prints the measurements of a run as a tab-separated table: node, status, median TFLOP/s, median
time, peak memory, correctness, and the reason of anything not measured.

    scripts/run-table.py [CACHE_DIR] [RUN_ID]     (defaults: $ATTNBENCH_CACHE or ./artifacts, latest)
"""
import json
import os
import sys

cache = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ATTNBENCH_CACHE", "artifacts")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record import artifact, load_run  # noqa: E402

record = load_run(cache, sys.argv[2] if len(sys.argv) > 2 else None)
print("node\tstatus\ttflops_p50\ttime_ms_p50\tpeak_gib\tcorrect\tmax_error\tnote")
for node in record["nodes"]:
    folder = artifact(cache, node)
    path = folder and os.path.join(folder, "measurement.json")
    if not path or not os.path.exists(path):
        if node.get("status") not in ("ok", "cached"):
            print(f"{node['id']}\t{node.get('status')}\t\t\t\t\t\t{(node.get('error') or '')[:160]}")
        continue
    m = json.load(open(path))
    tflops = (m.get("tflops") or {}).get("p50")
    time_s = (m.get("time_s") or {}).get("p50")
    peak = (m.get("memory") or {}).get("peak_bytes")
    check = m.get("correctness") or {}
    errors = [e for e in (check.get("errors") or {}).values() if isinstance(e, (int, float))]
    phases = m.get("phases") or (m.get("environment") or {}).get("phases") or {}  # version 2, then 1
    note = m.get("reason") or ""
    if not note and phases.get("compile_s") is not None:
        note = f"compile {phases['compile_s']:.1f} s"
    cells = [
        node["id"],
        m.get("status", ""),
        f"{tflops:.4g}" if tflops else "",
        f"{time_s * 1e3:.3f}" if time_s else "",
        f"{peak / 2**30:.2f}" if peak else "",
        "" if not check else ("yes" if check.get("passed") else "NO"),
        f"{max(errors):.2e}" if errors else "",
        note[:160],
    ]
    print("\t".join(cells))
