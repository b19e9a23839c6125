#!/usr/bin/env python3
"""Each decode peer called the way its own documentation writes it, beside attnbench's harness.

    scripts/decode-plain.py [CACHE_DIR] [RUN_ID] [--kernels fa4,flashinfer] [--reps N] [--rounds R]
        [--match REGEX] [--max-kv TOKENS]
    (defaults: $ATTNBENCH_CACHE or ./artifacts, the latest run, both peers, 20 reps, 6 rounds,
    caches up to 64K tokens)

For every measured decode step of those peers in the run, this draws new inputs of the step's shape
(uniform in [-1, 1), as the harness draws its own), builds the peer's call from its documentation —
FlashInfer: a `BatchDecodeWithPagedKVCacheWrapper` (one new token; tensor cores where the group is
4 or more, as its docs advise for large GQA groups) or a causal `BatchPrefillWithPagedKVCacheWrapper`
(several), planned once, run on one `[pages, 2, page_size, heads_kv, d]` cache tensor; FA4:
`flash_attn_varlen_func` with `cu_seqlens` or, for a paged cache, `page_table` and `seqused_k`,
causal, with its defaults — and times it beside the bridge's own runner of the same step (the python
plugin's adapter, with its LSE and its cache layout), alternating in rounds in one process. Both
sides use one page table: a random order of the pool's pages, as a serving engine's pool ends up.
A difference past 3% is the adapter's and is a finding to explain before the harness's figure is
published; one between the run's figure and both of these is the machine's state between runs.
"""
import argparse
import json
import os
import re
import sys

import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "plugins", "python", "bridge"))
from attnbench_bridge import decode as bridge_decode  # noqa: E402  (the harness's own runners)
from attnbench_bridge.harness import event_rep  # noqa: E402
sys.path.insert(0, here)
from plain_timing import clock_range, side_by_side  # noqa: E402
from run_record import artifact, load_run  # noqa: E402

PEERS = ("fa4", "flashinfer")


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", nargs="?", default=os.environ.get("ATTNBENCH_CACHE", "artifacts"))
    parser.add_argument("run", nargs="?", help="run id (default: the latest)")
    parser.add_argument("--kernels", default=",".join(PEERS), help="comma-separated, of " + ", ".join(PEERS))
    parser.add_argument("--reps", type=int, default=20, help="repetitions per round and side")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating the two sides (and which goes first)")
    parser.add_argument("--match", help="only the steps whose node id matches this regular expression")
    parser.add_argument("--max-kv", type=int, default=65536,
                        help="skip steps whose longest cache is longer (the harness's side holds f32 copies on the host)")
    args = parser.parse_args()
    unknown = set(args.kernels.split(",")) - set(PEERS)
    if unknown:
        parser.error(f"--kernels: {', '.join(sorted(unknown))} is not one of {', '.join(PEERS)}")
    return load_run(args.cache, args.run), args


def steps(record, args):
    """(node id, decode.json) of the run's measured steps of the wanted peers."""
    wanted = set(args.kernels.split(","))
    for node in record["nodes"]:
        folder = artifact(args.cache, node)
        path = folder and os.path.join(folder, "decode.json")
        if not path or not os.path.exists(path) or (args.match and not re.search(args.match, node["id"])):
            continue
        step = json.load(open(path))
        if step.get("kernel") in wanted and step.get("status") == "ok" and max(step["kv_lens"]) <= args.max_kv:
            yield node["id"], step


def shuffled_pages(kv_lens, page_size, rng):
    """Each sequence's pages, drawn without replacement from one pool in random order."""
    counts = [-(-length // page_size) for length in kv_lens]
    order = rng.permutation(sum(counts)).tolist()
    pages, at = [], 0
    for count in counts:
        pages.append(order[at:at + count])
        at += count
    return pages


def harness_runner(record, kernel, page_size, pages, rng):
    """The bridge's runner of this step (the harness's side), on fresh uniform inputs."""
    rows, keys, d = record["queries"] * len(record["kv_lens"]), sum(record["kv_lens"]), record["head_dim"]
    uniform = lambda *shape: (rng.random(shape, dtype=np.float32) * 2 - 1)  # noqa: E731
    arrays = {"q": uniform(record["heads_q"], rows, d), "k": uniform(record["heads_kv"], keys, d),
              "v": uniform(record["heads_kv"], keys, d)}
    step = bridge_decode.Step(kernel=kernel, dtype=record["dtype"], device="cuda", bytes=record["bytes"],
                              kv_lens=list(record["kv_lens"]), queries=record["queries"], heads_q=record["heads_q"],
                              heads_kv=record["heads_kv"], head_dim=d, page_size=page_size, pages=pages,
                              inputs_dir="", outputs_dir="")
    return bridge_decode.RUNNERS[kernel](step, arrays)


def uniform(*shape, dtype):
    return torch.rand(*shape, device="cuda").mul_(2).sub_(1).to(dtype)


def plain_flashinfer(record, page_size, pages, dtype):
    import flashinfer
    lens, queries = record["kv_lens"], record["queries"]
    hq, hkv, d = record["heads_q"], record["heads_kv"], record["head_dim"]
    index = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
    indptr = index(np.cumsum([0] + [len(p) for p in pages]).tolist())
    indices = index([page for p in pages for page in p])
    last = index([length - (len(p) - 1) * page_size for length, p in zip(lens, pages)])
    cache = uniform(sum(len(p) for p in pages), 2, page_size, hkv, d, dtype=dtype)
    q = uniform(queries * len(lens), hq, d, dtype=dtype)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    if queries == 1:
        tensor_cores = hq // hkv >= 4
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(indptr, indices, last, hq, hkv, d, page_size, pos_encoding_mode="NONE",
                     q_data_type=dtype, kv_data_type=dtype)
        what = f"BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores={tensor_cores}), one kv tensor"
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(index([b * queries for b in range(len(lens) + 1)]), indptr, indices, last, hq, hkv, d,
                     page_size, causal=True, q_data_type=dtype, kv_data_type=dtype)
        what = "BatchPrefillWithPagedKVCacheWrapper(causal=True), one kv tensor"
    return (lambda: wrapper.run(q, cache)), what


def plain_fa4(record, page_size, pages, dtype):
    from flash_attn.cute import flash_attn_varlen_func
    lens, queries = record["kv_lens"], record["queries"]
    hq, hkv, d = record["heads_q"], record["heads_kv"], record["head_dim"]
    index = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
    if page_size is None:
        q = uniform(queries * len(lens), hq, d, dtype=dtype)
        k, v = (uniform(sum(lens), hkv, d, dtype=dtype) for _ in range(2))
        bounds = dict(cu_seqlens_q=index([b * queries for b in range(len(lens) + 1)]),
                      cu_seqlens_k=index(np.cumsum([0] + list(lens)).tolist()),
                      max_seqlen_q=queries, max_seqlen_k=max(lens))
        what = "flash_attn_varlen_func(cu_seqlens, causal=True)"
    else:
        q = uniform(len(lens), queries, hq, d, dtype=dtype)
        k, v = (uniform(sum(len(p) for p in pages), page_size, hkv, d, dtype=dtype) for _ in range(2))
        widest = max(len(p) for p in pages)
        bounds = dict(page_table=index([p + [0] * (widest - len(p)) for p in pages]), seqused_k=index(list(lens)))
        what = "flash_attn_varlen_func(page_table, seqused_k, causal=True)"
    return (lambda: flash_attn_varlen_func(q, k, v, causal=True, **bounds)), what


PLAIN = {"fa4": plain_fa4, "flashinfer": plain_flashinfer}


def main():
    record, args = arguments()
    rng = np.random.default_rng(0)
    print("step\tattnbench µs\tharness here µs\tplain here µs\tharness over plain (time)\tratio over rounds\tSM MHz\tplain form")
    for cell, step in steps(record, args):
        kernel, dtype = step["kernel"], {"bf16": torch.bfloat16, "fp16": torch.float16}[step["dtype"]]
        # FlashInfer takes pages only: a packed cache reaches it as in-order pages, on both sides.
        if step.get("page_size"):
            page_size, pages = step["page_size"], shuffled_pages(step["kv_lens"], step["page_size"], rng)
        elif kernel == "flashinfer":
            page_size = bridge_decode.IN_ORDER_PAGE
            pages, at = [], 0
            for length in step["kv_lens"]:
                count = -(-length // page_size)
                pages, at = pages + [list(range(at, at + count))], at + count
        else:
            page_size, pages = None, None
        try:
            paged = step.get("page_size") is not None
            runner = harness_runner(step, kernel, step.get("page_size"), pages if paged else None, rng)
            forward, what = PLAIN[kernel](step, page_size, pages, dtype)
            device = torch.device("cuda")
            harness, plain = runner.rep, event_rep(torch, device, forward)
            with torch.no_grad():
                ours, theirs, (low, high), clocks = side_by_side(harness, lambda: plain() * 1e3, args.reps, args.rounds)
        except Exception as error:  # a peer refusing its own documented call is a finding too
            print(f"{cell}\t{step['latency_us']:.1f}\t\t\t\t\t\tfailed: {type(error).__name__}: {error}")
            continue
        finally:
            torch.cuda.empty_cache()
        mhz = clock_range(clocks)
        # side_by_side's ratio is the harness's speed over the plain loop's: theirs / ours in time.
        print(f"{cell}\t{step['latency_us']:.1f}\t{ours * 1e3:.1f}\t{theirs * 1e3:.1f}\t{ours / theirs - 1:+.1%}"
              f"\t{low:.3f}–{high:.3f}\t{mhz}\t{what}")


if __name__ == "__main__":
    main()
