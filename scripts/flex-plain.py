#!/usr/bin/env python3
"""FlexAttention called the way its documentation writes it, beside attnbench's flex cells of one run.

    scripts/flex-plain.py [CACHE_DIR] [RUN_ID] [--reps N]   (defaults: $ATTNBENCH_CACHE or ./artifacts, latest, 30)

For every `flex` measurement of the run whose mask has a closed form here (full, causal, the
document masks, the sliding windows, the prefix LMs), this builds that mask's `mask_mod` from the
pattern's own parameters and documents (not from attnbench's encodings), checks it against the
mask on sampled rows, and times `torch.compile(flex_attention)` with `create_block_mask` on the
same shape: a flush of twice the L2 before every timed call, CUDA events, the median of N; the
backward is `autograd.grad` of the forward's output, timed alone. It prints both figures and
their difference; a difference past 3% is a finding to explain before the harness's figure is
published.
"""
import argparse
import json
import math
import os
import statistics
import sys

import numpy as np
import torch
import torch._dynamo
import torch._functorch.config
from torch.nn.attention import flex_attention as flex

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plugins", "python", "bridge"))
from attnbench_bridge import row_intervals  # noqa: E402  (the IR's rows, to check the mask_mod against)

torch._functorch.config.donated_buffer = False  # a repeated backward on one graph


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", nargs="?", default=os.environ.get("ATTNBENCH_CACHE", "artifacts"))
    parser.add_argument("run", nargs="?", help="run id (default: the latest)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--lse", action="store_true", help="also return the LSE, as attnbench's harness asks")
    args = parser.parse_args()
    runs = os.path.join(args.cache, "runs")
    run = args.run or open(os.path.join(runs, "latest")).read().strip()
    return json.load(open(os.path.join(runs, run, "run.json"))), args.reps, args.lse


def mask_mod_of(mask_set, device):
    """(mask_mod or None for no mask, description), from the pattern's parameters."""
    pattern, params, s = mask_set["pattern"], mask_set["params"], mask_set["seqlen"]
    documents = mask_set.get("documents") or [s]
    doc = torch.repeat_interleave(torch.arange(len(documents), device=device, dtype=torch.int32),
                                  torch.tensor(documents, device=device))
    window = int(params.get("window", 0))
    prefix = int(params.get("prefix", mask_set.get("prefix", -1)))
    same = lambda q, kv: doc[q] == doc[kv]  # noqa: E731
    forms = {
        "full": None,
        "causal": lambda b, h, q, kv: q >= kv,
        "full_document": lambda b, h, q, kv: same(q, kv),
        "causal_document": lambda b, h, q, kv: same(q, kv) & (q >= kv),
        "sliding_window_causal": lambda b, h, q, kv: (q >= kv) & (q - kv <= window),
        "sliding_window": lambda b, h, q, kv: (q - kv <= window) & (kv - q <= window),
        "prefix_lm_causal": lambda b, h, q, kv: (kv < prefix) | (q >= kv),
    }
    if pattern not in forms or (pattern.startswith("prefix") and prefix < 0):
        return None, None
    return forms[pattern], f"{pattern}: {len(documents)} documents, window {window}, prefix {prefix}"


def matches(mask_mod, mask, device, rows=64):
    """The mask_mod against the IR's rows (sampled): each row one interval [lo, hi)."""
    lo, hi, count = row_intervals(mask)
    s = mask["seqlen_q"]
    picked = np.unique(np.random.default_rng(0).integers(0, s, rows))
    kv = torch.arange(s, device=device)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    for q in picked:
        if count[q] > 1:
            return f"row {q} has {count[q]} intervals"
        allowed = mask_mod(zero, zero, torch.full((s,), int(q), device=device), kv).cpu().numpy()
        want = (np.arange(s) >= lo[q]) & (np.arange(s) < hi[q])
        if (allowed != want).any():
            return f"row {q} differs from the mask"
    return None


def median_ms(call, reps, flush, start, end):
    times = []
    for _ in range(reps + 3):
        flush.zero_()
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def plain(m, mask_set, reps, cache, lse=False):
    device = torch.device("cuda")
    shape, s = m["shape"], mask_set["seqlen"]
    mask_mod, what = mask_mod_of(mask_set, device)
    if what is None:
        return None, f"no closed form here for {mask_set['pattern']}"
    if mask_mod is not None:
        why = matches(mask_mod, mask_set["masks"][0], device)
        if why:
            return None, f"the closed form is not this mask: {why}"
    key = (mask_set["pattern"], s, json.dumps(mask_set.get("documents")))
    if key not in cache:
        cache[key] = flex.create_block_mask(mask_mod, None, None, s, s, device=device) if mask_mod else None
    block_mask = cache[key]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape["dtype"]]
    make = lambda h: torch.randn(1, h, s, shape["head_dim"], device=device, dtype=dtype,  # noqa: E731
                                 requires_grad=m["direction"] != "fwd")
    q, k, v = make(shape["heads_q"]), make(shape["heads_kv"]), make(shape["heads_kv"])
    # One compile per cell, as a fresh process would have: past dynamo's recompile limit flex
    # falls back to its unfused eager path (and its S × S scores).
    torch._dynamo.reset()
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    extra = {"return_aux": flex.AuxRequest(lse=True)} if lse else {}

    def run():
        result = compiled(q, k, v, block_mask=block_mask, scale=1 / math.sqrt(shape["head_dim"]),
                          enable_gqa=shape["heads_q"] != shape["heads_kv"], **extra)
        return result[0] if lse else result
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if m["direction"] == "fwd":
        with torch.no_grad():
            ms = median_ms(run, reps, flush, start, end)
    else:
        out = run()
        grad = torch.randn_like(out)
        ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), reps, flush, start, end)
        del out, grad
    del q, k, v, flush
    torch.cuda.empty_cache()
    return m["flops"] / (ms / 1e3) / 1e12, what


def main():
    record, reps, lse = arguments()
    nodes = {n["id"]: n for n in record["nodes"]}
    cache = {}
    print("cell\tattnbench TFLOP/s\tplain flex TFLOP/s\tdifference\tmask_mode (attnbench)\tplain form")
    for node in record["nodes"]:
        path = node.get("artifact") and os.path.join(node["artifact"], "measurement.json")
        if not path or not os.path.exists(path):
            continue
        m = json.load(open(path))
        if m.get("kernel") != "flex" or m.get("status") != "ok":
            continue
        masks = [nodes[i] for i in node["inputs"] if nodes[i]["uses"] == "masks/generate"]
        mask_set = json.load(open(os.path.join(masks[0]["artifact"], "mask.json")))
        ours = m["tflops"]["p50"]
        theirs, what = plain(m, mask_set, reps, cache, lse)
        mode = ((m.get("environment") or {}).get("phases") or {}).get("mask_mode", "")
        if theirs is None:
            print(f"{node['id']}\t{ours:.1f}\t\t\t{mode}\t{what}")
            continue
        print(f"{node['id']}\t{ours:.1f}\t{theirs:.1f}\t{(ours - theirs) / theirs:+.1%}\t{mode}\t{what}")


if __name__ == "__main__":
    main()
