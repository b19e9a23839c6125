#!/usr/bin/env python3
"""Each Python peer called the way its own documentation writes it, beside attnbench's harness.

    scripts/peer-plain.py [CACHE_DIR] [RUN_ID] [--reps N] [--rounds R] [--kernels flex,fa4,cudnn,flashinfer]
        [--seqlen S] [--masks causal,...] [--direction fwd|bwd] [--match REGEX] [--storage bhsd|bshd]
        [--harness-storage auto|bshd|bhsd] [--lse] [--flex-block 128|64|32|16] [--flex-form mask_mod|kv_blocks]
    (defaults: $ATTNBENCH_CACHE or ./artifacts, the latest run, 20 reps, 6 rounds, every kernel, mask and direction)

For every measurement of those kernels in the run whose mask has a closed form here (for flex,
all 12 static masks: document ids and index arithmetic; for the other peers, full, causal, the
document masks and the sliding windows; and the block-sparse tables,
read from the IR's rectangles: flex through a table lookup as LongCA-bench's adapter writes it,
FA4's block-sparsity tensors where the blocks are whole tiles, FlashInfer's BSR and variable
block-sparse wrappers), this builds the mask from the
pattern's own parameters and documents (not from attnbench's encodings) and calls the peer the
way its documentation does: flex with `create_block_mask` and a `mask_mod` (checked against the
mask on sampled rows); FA4 with `causal` / `window_size` and `flash_attn_varlen_func` for
documents; cuDNN with a graph of its frontend (THD ragged documents, the diagonal band);
FlashInfer with `single_prefill_with_kv_cache` or a ragged batch for documents.

Beside it, in the same process, runs the harness's own repetition of the cell (the bridge's
adapter, as the python plugin calls it, with the mask encodings the node kept in its
encodings.json), and the two alternate in rounds: R rounds of N
repetitions each, a flush of twice the L2 before every timed call, CUDA events. A difference
that survives the alternation is the adapter's; one between the run's figure and both of these
is the machine's state between two runs (the record's clocks say which). The backward is
`autograd.grad` of the forward's output, timed alone (cuDNN: its backward graph). A difference
past 3% is a finding to explain before the harness's figure is published.
"""
import argparse
import json
import math
import os
import re
import sys

import numpy as np
import torch
import torch._dynamo
import torch._functorch.config
from torch.nn.attention import flex_attention as flex

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plugins", "python", "bridge"))
import attnbench_bridge as bridge  # noqa: E402  (the harness's own repetition, and the IR's rows)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record import artifact, load_run  # noqa: E402
from plain_timing import clock_range, side_by_side  # noqa: E402

torch._functorch.config.donated_buffer = False  # a repeated backward on one graph
PEERS = ("flex", "fa4", "cudnn", "flashinfer")


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", nargs="?", default=os.environ.get("ATTNBENCH_CACHE", "artifacts"))
    parser.add_argument("run", nargs="?", help="run id (default: the latest)")
    parser.add_argument("--reps", type=int, default=20, help="repetitions per round and side")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating the harness and the plain loop (and which goes first)")
    parser.add_argument("--kernels", default=",".join(PEERS), help="comma-separated, of " + ", ".join(PEERS))
    parser.add_argument("--seqlen", type=int, action="append", help="only the cells of this length (repeatable)")
    parser.add_argument("--storage", choices=("bhsd", "bshd"), default="bhsd",
                        help="flex: contiguous [1, H, S, D] (its documentation's) or a view of [1, S, H, D]")
    parser.add_argument("--harness-storage", choices=("auto", "bshd", "bhsd"), default="auto",
                        help="the harness's `layout` (auto: each kernel's documented one, contiguous [1, H, S, D] for flex "
                             "and FlashInfer's variable block-sparse wrapper)")
    parser.add_argument("--masks", help="comma-separated patterns: only these cells")
    parser.add_argument("--direction", choices=("fwd", "bwd"), help="only the cells of this direction")
    parser.add_argument("--match", help="only the cells whose node id matches this regular expression")
    parser.add_argument("--lse", action="store_true", help="flex: also return the LSE, as attnbench's harness asks")
    parser.add_argument("--flex-block", type=int, default=128, choices=(16, 32, 64, 128),
                        help="flex on block-sparse cells: the BlockMask's block size (below 128 with tiles of that size)")
    parser.add_argument("--flex-form", choices=("mask_mod", "kv_blocks"), default="mask_mod",
                        help="flex on block-sparse cells: create_block_mask over a table-lookup mask_mod (LongCA-bench's "
                             "form), or BlockMask.from_kv_blocks listing the kept blocks as full, with no mask_mod "
                             "(blocks on --flex-block only)")
    args = parser.parse_args()
    unknown = set(args.kernels.split(",")) - set(PEERS)
    if unknown:
        parser.error(f"--kernels: {', '.join(sorted(unknown))} is not one of {', '.join(PEERS)}")
    return load_run(args.cache, args.run), args


def window_of(mask_set):
    """(documents, left, right) of the closed forms the flash-style peers take: within a document,
    q sees kv when q - kv <= left and kv - q <= right (-1: unbounded); None when there is none."""
    pattern, params, s = mask_set["pattern"], mask_set["params"], mask_set["seqlen"]
    window = int(params.get("window", 0))
    forms = {"full": (-1, -1), "causal": (-1, 0), "full_document": (-1, -1), "causal_document": (-1, 0),
             "sliding_window_causal": (window, 0), "sliding_window": (window, window)}
    if pattern not in forms:
        return None
    documents = mask_set.get("documents") if pattern.endswith("document") else None
    return (documents or [s],) + forms[pattern]


def mask_mod_of(mask_set, device):
    """(mask_mod or None for no mask, description) written from the pattern's parameters and
    documents as a flex user writes it (the bridge's closed forms); (None, None) when there is none."""
    form = bridge.pattern_mask_mod(mask_set, torch, device)
    return (None, None) if form is None else (form[0], f"{mask_set['pattern']}: {form[2]}")


def event_rep(call):
    """One repetition (ms) as the harness times it: the harness's own timer (flush, CUDA events)."""
    rep = bridge.event_rep(torch, torch.device("cuda"), call)
    return lambda: rep() * 1e3


def torch_dtype(shape):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[shape["dtype"]]


def make_inputs(m, layout, s):
    """Random q, k, v as the peer takes them: "bhsd" [1, H, S, D], "bshd" [1, S, H, D] or "thd" [S, H, D],
    drawn as the harness draws its own (uniform in [-1, 1)): the same distribution, so that a
    difference is not the data's (a GPU's clocks under its power limit, and any kernel that skips
    work by value, see the values)."""
    shape = m["shape"]
    dtype = torch_dtype(shape)

    def one(heads):
        dims = {"bhsd": (1, heads, s), "bshd": (1, s, heads), "thd": (s, heads)}[layout]
        x = torch.rand(*dims, shape["head_dim"], device="cuda").mul_(2).sub_(1).to(dtype)
        return x.requires_grad_(m["direction"] != "fwd")
    return one(shape["heads_q"]), one(shape["heads_kv"]), one(shape["heads_kv"])


def plain_rep(m, forward, backward=None):
    """A repetition (ms) of the cell's direction: the forward alone, or the backward of one forward."""
    if m["direction"] == "fwd":
        rep = event_rep(forward)

        def without_graph():
            with torch.no_grad():
                return rep()
        return without_graph
    out = forward()
    grad = torch.rand_like(out).mul_(2).sub_(1)
    if backward is None:
        inputs = forward.inputs
        return event_rep(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
    return event_rep(lambda: backward(out, grad))


def with_inputs(call, inputs):
    forward = lambda: call(*inputs)  # noqa: E731
    forward.inputs = inputs
    return forward


SPARSE = ("block_sparse_uniform", "block_sparse_variable")


def kept_blocks(mask_set):
    """(row edges, column edges, [patterns, rows, cols] table of kept blocks) of a block-sparse
    pattern, read straight from the IR's rectangles (not from attnbench's encodings): uniform
    blocks on their own grid, variable ones on the edges the rectangles start and end at."""
    s, masks = mask_set["seqlen"], mask_set["masks"]
    if mask_set["pattern"] == "block_sparse_uniform":
        block = int(mask_set["params"]["sparse_block"])
        rows = cols = np.minimum(np.arange(0, s + block, block), s)
    else:
        rows = np.unique([0, s] + [b for mask in masks for sl in mask["slices"] for b in sl["q"]])
        cols = np.unique([0, s] + [b for mask in masks for sl in mask["slices"] for b in sl["k"]])
    table = np.zeros((len(masks), len(rows) - 1, len(cols) - 1), dtype=bool)
    for index, mask in enumerate(masks):
        for sl in mask["slices"]:
            (q0, q1), (k0, k1) = np.searchsorted(rows, sl["q"]), np.searchsorted(cols, sl["k"])
            table[index, q0:q1, k0:k1] = True
    return rows, cols, table


def per_query_head(table, heads_q):
    """The patterns' table indexed by query head (one pattern: one table for every head)."""
    return table if len(table) == 1 else table[np.arange(heads_q) // (heads_q // len(table))]


def sparse_mismatch(forward, layout, grid, m, rows=16, tolerance=2e-2):
    """Why the plain call's output differs, on sampled query rows, from attention computed here in
    f32 over the kept-block table `grid` (kept_blocks; None when it agrees): a plain form that
    indexes its blocks wrongly must not be timed as the peer."""
    shape = m["shape"]

    def heads_first(x):  # [H, S, D] of a [1, H, S, D] / [H, S, D] (bhsd) or [1, S, H, D] / [S, H, D] tensor
        x = x[0] if x.dim() == 4 else x
        return x if layout == "bhsd" else x.transpose(0, 1)
    with torch.no_grad():
        out = heads_first(forward()).float()
    q, k, v = (heads_first(x).float() for x in forward.inputs)
    row_edges, col_edges, table = grid
    s = int(row_edges[-1])
    table = per_query_head(table, shape["heads_q"])
    picked = np.unique(np.random.default_rng(1).integers(0, s, rows))
    row_block, col_block = bridge.blocks_of(row_edges, picked), bridge.blocks_of(col_edges, np.arange(s))
    group = shape["heads_q"] // shape["heads_kv"]
    for h in range(shape["heads_q"]):
        allowed = torch.from_numpy(table[h % len(table)][row_block][:, col_block]).cuda()
        scores = (q[h, picked] @ k[h // group].T / math.sqrt(shape["head_dim"])).masked_fill(~allowed, -math.inf)
        want = torch.nan_to_num(torch.softmax(scores, -1)) @ v[h // group]
        error = (want - out[h, picked]).abs().max().item()
        if not error <= tolerance:
            return f"the plain call's output is off the kept-block table by {error:.3g} (head {h}): not timed"
    return None


def checked(forward, layout, grid, m, what):
    """The plain form of a block-sparse cell as peer-plain returns it, or its mismatch."""
    why = sparse_mismatch(forward, layout, grid, m)
    return (None, why) if why else (forward, None, what)


def block_table_mod(grid, mask_set, device):
    """(mask_mod, description) of a block-sparse pattern as LongCA-bench's flex adapter writes it:
    each element's bit in a [heads, rows, cols] table of kept blocks (`grid`, kept_blocks), its
    block found through a token → block vector."""
    rows, cols, table = grid
    s = mask_set["seqlen"]
    if mask_set["pattern"] == "block_sparse_uniform":
        block = int(rows[1])
        row_of = col_of = lambda x: x // block  # noqa: E731
    else:
        row_table, col_table = (torch.from_numpy(bridge.blocks_of(edges, np.arange(s))).to(device) for edges in (rows, cols))
        row_of, col_of = (lambda q: row_table[q]), (lambda kv: col_table[kv])
    table = torch.from_numpy(per_query_head(table, mask_set["params"]["heads_q"])).to(device)
    if len(table) == 1:
        table0 = table[0]
        mask_mod = lambda b, h, q, kv: table0[row_of(q), col_of(kv)]  # noqa: E731
    else:
        mask_mod = lambda b, h, q, kv: table[h, row_of(q), col_of(kv)]  # noqa: E731
    return mask_mod, f"block table of {len(rows) - 1}×{len(cols) - 1} blocks, {len(mask_set['masks'])} patterns"


def plain_flex(m, mask_set, rows, args, cache):
    shape, s = m["shape"], mask_set["seqlen"]
    sparse = mask_set["pattern"] in SPARSE
    grid = kept_blocks(mask_set) if sparse else None
    mask_mod, what = block_table_mod(grid, mask_set, torch.device("cuda")) if sparse else \
        mask_mod_of(mask_set, torch.device("cuda"))
    if what is None:
        return None, f"no closed form here for {mask_set['pattern']}"
    if mask_mod is not None and not sparse:
        why = bridge.form_differs(mask_mod, rows, torch, torch.device("cuda"))
        if why:
            return None, f"the closed form is not this mask: {why}"
    # A block mask as fine as the sparse blocks needs flex's tiles no larger (its documented
    # kernel_options); the default keeps flex's own 128 and its tuned tiles.
    block = args.flex_block if mask_set["pattern"] == "block_sparse_uniform" else 128
    options = {} if block >= 128 else {name: block for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1",
                                                                "BLOCK_M2", "BLOCK_N2")}
    if sparse:
        what += f", BlockMask of {block}" + (f", kernel_options {options}" if options else "")
    heads = None if not sparse or len(mask_set["masks"]) == 1 else shape["heads_q"]
    kv_blocks = sparse and args.flex_form == "kv_blocks"
    if kv_blocks:
        listed = full_kv_blocks(grid, mask_set, block)
        if listed is None:
            return None, f"blocks off {block}-token tiles: no from_kv_blocks form"
        what = f"{len(grid[2])} patterns, kept blocks listed as full (BlockMask.from_kv_blocks, no mask_mod)"
    key = (mask_set["pattern"], s, json.dumps(mask_set.get("documents")), json.dumps(mask_set["params"]), block,
           args.flex_form)
    if key not in cache:
        # Past 16K the mask is evaluated in compiled chunks, as flex's documentation advises for
        # long sequences (evaluated eagerly, 4 heads at 48K need 72 GiB).
        cache[key] = listed if kv_blocks else flex.create_block_mask(
            mask_mod, None, heads, s, s, device="cuda", BLOCK_SIZE=block, _compile=s > 16384) if mask_mod else None
    block_mask = cache[key]
    # One compile per cell, as a fresh process would have: past dynamo's recompile limit flex
    # falls back to its unfused eager path (and its S × S scores).
    torch._dynamo.reset()
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    extra = {"return_aux": flex.AuxRequest(lse=True)} if args.lse else {}

    def call(q, k, v):
        result = compiled(q, k, v, block_mask=block_mask, scale=1 / math.sqrt(shape["head_dim"]),
                          enable_gqa=shape["heads_q"] != shape["heads_kv"], kernel_options=options or None, **extra)
        return result[0] if args.lse else result
    inputs = make_inputs(m, "bhsd", s) if args.storage == "bhsd" else \
        tuple(x.transpose(1, 2) for x in make_inputs(m, "bshd", s))  # as the harness's bshd storage
    forward, what = with_inputs(call, inputs), what + f", {args.storage} storage"
    return checked(forward, "bhsd", grid, m, what) if sparse else (forward, None, what)


def full_kv_blocks(grid, mask_set, block):
    """A BlockMask listing every kept block of `block` tokens as full (no mask_mod), or None when
    the pattern's blocks do not fall on `block`."""
    rows, cols, table = grid
    s = mask_set["seqlen"]
    if s % block or any((edges % block).any() for edges in (rows, cols)):
        return None
    starts = np.arange(0, s, block)
    chosen = per_query_head(table, mask_set["params"]["heads_q"]) if len(table) > 1 else table
    chosen = chosen[:, bridge.blocks_of(rows, starts)][:, :, bridge.blocks_of(cols, starts)]
    order = torch.from_numpy(np.argsort(~chosen, axis=-1, kind="stable")[None].astype(np.int32)).cuda()
    count = torch.from_numpy(chosen.sum(-1)[None].astype(np.int32)).cuda()
    return flex.BlockMask.from_kv_blocks(torch.zeros_like(count), torch.zeros_like(order), count, order,
                                         BLOCK_SIZE=block, seq_lengths=(s, s))


FA4_TILE = bridge.FA4_TILE  # FA4's tile on Hopper at d <= 128, and the block size of its block-sparse tensors


def plain_fa4_sparse(m, mask_set):
    """FA4's block sparsity as its `block_sparsity` module takes it: per row of 128-token tiles the
    count and the indices of its kept tiles, all whole when the blocks are multiples of the tile."""
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    grid = kept_blocks(mask_set)
    rows, _, table = grid
    block = int(rows[1]) if mask_set["pattern"] == "block_sparse_uniform" else 0
    if block % FA4_TILE or not block:
        return None, f"blocks off FA4's {FA4_TILE}-token tiles need a CuTe mask_mod on the cut tiles: no plain form here"
    r, tiles = block // FA4_TILE, -(-mask_set["seqlen"] // FA4_TILE)
    table = per_query_head(table, m["shape"]["heads_q"]).repeat(r, axis=1).repeat(r, axis=2)[:, :tiles, :tiles]

    def lists(kept):
        kept = torch.from_numpy(np.ascontiguousarray(kept)).cuda()[None]
        count = kept.sum(-1, dtype=torch.int32)
        index = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
        return BlockSparseTensorsTorch(mask_block_cnt=torch.zeros_like(count), mask_block_idx=torch.zeros_like(index),
                                       full_block_cnt=count, full_block_idx=index.contiguous(),
                                       block_size=(FA4_TILE, FA4_TILE))
    options = {"block_sparse_tensors": lists(table)}
    if m["direction"] != "fwd":
        options["block_sparse_tensors_bwd"] = lists(table.swapaxes(1, 2))
    what = f"{int(table.sum())} whole {FA4_TILE}-token tiles of {table.size}, {len(table)} tables, no mask_mod"
    forward = with_inputs(lambda q, k, v: flash_attn_func(q, k, v, **options)[0], make_inputs(m, "bshd", mask_set["seqlen"]))
    return checked(forward, "bshd", grid, m, what)


def plain_fa4(m, mask_set, rows, args, cache):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    if mask_set["pattern"] in SPARSE:
        return plain_fa4_sparse(m, mask_set)
    form = window_of(mask_set)
    if form is None:
        return None, f"no closed form here for {mask_set['pattern']}"
    documents, left, right = form
    options = {"causal": True} if (left, right) == (-1, 0) else \
        {"window_size": (left if left >= 0 else None, right if right >= 0 else None)}
    what = f"{len(documents)} documents, {options}"
    if len(documents) == 1:
        return with_inputs(lambda q, k, v: flash_attn_func(q, k, v, **options)[0], make_inputs(m, "bshd", mask_set["seqlen"])), None, what
    cu = torch.tensor(np.concatenate([[0], np.cumsum(documents)]), dtype=torch.int32, device="cuda")
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(documents), max_seqlen_k=max(documents))
    return with_inputs(lambda q, k, v: flash_attn_varlen_func(q, k, v, **varlen, **options)[0],
                       make_inputs(m, "thd", mask_set["seqlen"])), None, what


def plain_flashinfer_sparse(m, mask_set):
    """FlashInfer's block-sparse wrappers as its documentation writes them: one pattern on a uniform
    grid as a BSR matrix (BlockSparseAttentionWrapper, R = C = the block), otherwise a pattern per
    KV head (VariableBlockSparseAttentionWrapper: block_mask_map and the blocks' sizes)."""
    import flashinfer
    shape, s = m["shape"], mask_set["seqlen"]
    dtype = torch_dtype(shape)
    grid = kept_blocks(mask_set)
    rows, cols, table = grid
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    heads = (shape["heads_q"], shape["heads_kv"], shape["head_dim"])
    if len(table) == 1 and mask_set["pattern"] == "block_sparse_uniform" and s % int(rows[1]) == 0:
        block, kept = int(rows[1]), torch.from_numpy(table[0]).cuda()
        indptr = torch.cat([kept.new_zeros(1, dtype=torch.int64), kept.sum(-1).cumsum(0)]).to(torch.int32)
        indices = kept.nonzero()[:, 1].to(torch.int32).contiguous()  # row-major: each row's columns ascending
        wrapper = flashinfer.BlockSparseAttentionWrapper(workspace)
        wrapper.plan(indptr, indices, s, s, block, block, *heads, q_data_type=dtype, o_data_type=dtype)
        return checked(with_inputs(wrapper.run, make_inputs(m, "thd", s)), "thd", grid, m,
                       f"BSR of {block}×{block} blocks, {int(kept.sum())} kept, BlockSparseAttentionWrapper")
    if len(table) != shape["heads_kv"]:
        return None, f"{len(table)} patterns for {shape['heads_kv']} KV heads: FlashInfer takes one per KV head"
    sizes = lambda edges: torch.from_numpy(np.diff(edges).astype(np.int32)).cuda()[None].repeat(len(table), 1)  # noqa: E731
    wrapper = flashinfer.VariableBlockSparseAttentionWrapper(workspace)
    wrapper.plan(torch.from_numpy(table).cuda(), sizes(rows), sizes(cols), *heads, q_data_type=dtype)
    return checked(with_inputs(lambda q, k, v: wrapper.run(q[0], k[0], v[0]), make_inputs(m, "bhsd", s)), "bhsd",
                   grid, m, f"{table.shape[1]}×{table.shape[2]} blocks a KV head, VariableBlockSparseAttentionWrapper")


def plain_flashinfer(m, mask_set, rows, args, cache):
    import flashinfer
    if mask_set["pattern"] in SPARSE:
        return plain_flashinfer_sparse(m, mask_set)
    form = window_of(mask_set)
    if form is None or form[2] > 0:
        return None, f"no FlashInfer form here for {mask_set['pattern']}"
    documents, left, right = form
    options = {"causal": right == 0, "window_left": left}
    what = f"{len(documents)} documents, {options}"
    if len(documents) == 1:
        return with_inputs(lambda q, k, v: flashinfer.single_prefill_with_kv_cache(q, k, v, **options),
                           make_inputs(m, "thd", mask_set["seqlen"])), None, what
    shape = m["shape"]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(documents)]), dtype=torch.int32, device="cuda")
    batch = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    batch.plan(indptr, indptr, shape["heads_q"], shape["heads_kv"], shape["head_dim"],
               q_data_type=torch_dtype(shape), **options)
    return with_inputs(batch.run, make_inputs(m, "thd", mask_set["seqlen"])), None, what


def plain_cudnn(m, mask_set, rows, args, cache):
    """A forward and a backward graph of cuDNN's frontend, as its SDPA samples write them."""
    import cudnn
    form = window_of(mask_set)
    if form is None:
        return None, f"no closed form here for {mask_set['pattern']}"
    documents, left, right = form
    shape = m["shape"]
    hq, hkv, d, s = shape["heads_q"], shape["heads_kv"], shape["head_dim"], mask_set["seqlen"]
    b, rows = len(documents), max(documents)
    io = {"bf16": cudnn.data_type.BFLOAT16, "fp16": cudnn.data_type.HALF}[shape["dtype"]]
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    starts = torch.tensor(np.concatenate([[0], np.cumsum(documents)]), dtype=torch.int64, device="cuda")
    seq = torch.tensor(documents, dtype=torch.int32, device="cuda").view(b, 1, 1, 1)
    band = {"use_causal_mask": True} if (left, right) == (-1, 0) else {
        k: v for k, v in (("diagonal_band_left_bound", left + 1 if left >= 0 else None),
                          ("diagonal_band_right_bound", right if right >= 0 else None)) if v is not None}
    ragged = b > 1

    def new_graph():
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        extra, pack = {}, {}
        if ragged:
            seq_t = g.tensor(name="seq", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
            extra, pack = {"use_padding_mask": True, "seq_len_q": seq_t, "seq_len_kv": seq_t}, {seq_t: seq}
        return g, extra, pack

    def offset(g, pack, name, heads):  # a ragged offset counts elements, not tokens
        off = g.tensor(name=name + "_offset", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
        pack[off] = (starts * heads * d).view(-1, 1, 1, 1)
        return off

    def declare(g, pack, name, heads):
        t = g.tensor(name=name, dim=[b, heads, rows, d], stride=[rows * heads * d, d, heads * d, 1], data_type=io)
        if ragged:
            t.set_ragged_offset(offset(g, pack, name, heads))
        return t

    def finish(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")

    q, k, v = (x.detach() for x in make_inputs(m, "bshd", mask_set["seqlen"]))
    out, stats = torch.empty_like(q), torch.empty(b, hq, rows, 1, dtype=torch.float32, device="cuda")
    g, extra, pack = new_graph()
    tq, tk, tv = declare(g, pack, "q", hq), declare(g, pack, "k", hkv), declare(g, pack, "v", hkv)
    to, tstats = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, generate_stats=True, attn_scale=1 / math.sqrt(d),
                        **band, **extra)
    to.set_output(True).set_dim([b, hq, rows, d]).set_stride([rows * hq * d, d, hq * d, 1])
    if ragged:
        to.set_ragged_offset(offset(g, pack, "out", hq))
    tstats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    workspace = finish(g)
    pack.update({tq: q, tk: k, tv: v, to: out, tstats: stats})

    def forward():
        g.execute(pack, workspace, handle=handle)
        return out
    what = f"{b} documents{' (THD ragged)' if ragged else ''}, {band}"
    if m["direction"] == "fwd":
        return forward, None, what
    gb, extra, bpack = new_graph()
    names = {"q": hq, "k": hkv, "v": hkv, "o": hq, "dO": hq}
    t = {n: declare(gb, bpack, n, h) for n, h in names.items()}
    tstats_in = gb.tensor(name="stats", dim=[b, hq, rows, 1], stride=list(stats.stride()), data_type=cudnn.data_type.FLOAT)
    grads = gb.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=tstats_in,
                             attn_scale=1 / math.sqrt(d), **band, **extra,
                             **({"max_total_seq_len_q": s, "max_total_seq_len_kv": s} if ragged else {}))
    buffers = [torch.empty_like(x) for x in (q, k, v)]
    for grad, name, buffer in zip(grads, "qkv", buffers):
        grad.set_output(True).set_dim([b, names[name], rows, d]).set_stride([rows * names[name] * d, d, names[name] * d, 1])
        if ragged:
            grad.set_ragged_offset(offset(gb, bpack, "d" + name, names[name]))
    bworkspace = finish(gb)
    bpack.update({t["q"]: q, t["k"]: k, t["v"]: v, tstats_in: stats, **dict(zip(grads, buffers))})

    def backward(o, do):
        bpack.update({t["o"]: o, t["dO"]: do})
        gb.execute(bpack, bworkspace, handle=handle)
    return forward, backward, what


PLAIN = {"flex": plain_flex, "fa4": plain_fa4, "cudnn": plain_cudnn, "flashinfer": plain_flashinfer}


def harness_problem(m, mask_set, encodings, storage):
    """The cell's problem as the python plugin hands it to the bridge (seeded inputs, no check),
    with the mask encodings it sent (the node's encodings.json)."""
    shape = m["shape"]
    return bridge.parse_problem({
        "kernel": m["kernel"], "direction": m["direction"], "dtype": shape["dtype"], "mask": mask_set,
        "encodings": encodings, "layout": storage,
        "shape": {"heads_q": shape["heads_q"], "heads_kv": shape["heads_kv"], "seqlen": mask_set["seqlen"],
                  "head_dim": shape["head_dim"]}, "device": "cuda"})


def cells(record, wanted, args):
    """(node id, measurement, mask set, encodings) of the run's ok measurements of the wanted
    kernels (and lengths, patterns, direction); encodings None where the node kept none."""
    patterns = set(args.masks.split(",")) if args.masks else None
    nodes = {n["id"]: n for n in record["nodes"]}
    for node in record["nodes"]:
        folder = artifact(args.cache, node)
        path = folder and os.path.join(folder, "measurement.json")
        if not path or not os.path.exists(path):
            continue
        m = json.load(open(path))
        m["shape"].setdefault("dtype", m.get("dtype"))  # version 2 records keep it beside the shape
        if m.get("kernel") not in wanted or m.get("status") != "ok" or \
                (args.direction and m["direction"] != args.direction) or \
                (args.match and not re.search(args.match, node["id"])):
            continue
        masks = [nodes[i] for i in node["inputs"] if nodes[i]["uses"] == "masks/generate"]
        mask_set = json.load(open(os.path.join(artifact(args.cache, masks[0]), "mask.json")))
        if (not args.seqlen or mask_set["seqlen"] in args.seqlen) and \
                (patterns is None or mask_set["pattern"] in patterns):
            kept = os.path.join(folder, "encodings.json")
            yield node["id"], m, mask_set, json.load(open(kept)) if os.path.exists(kept) else None


def main():
    record, args = arguments()
    cache = {}
    print("cell\tattnbench TFLOP/s\tharness here\tplain here\tdifference here\tratio over rounds"
          "\tSM MHz\tmask_mode (attnbench)\tplain form")
    for cell, m, mask_set, encodings in cells(record, set(args.kernels.split(",")), args):
        ours = m["tflops"]["p50"]
        phases = m.get("phases") or (m.get("environment") or {}).get("phases") or {}  # version 2, then 1
        mode = phases.get("mask_mode", "")
        tflops = lambda ms: m["flops"] / (ms / 1e3) / 1e12  # noqa: E731
        if encodings is None or "rows" not in encodings:
            print(f"{cell}\t{ours:.1f}\t\t\t\t\t\t{mode}\tskipped: the node kept no encodings.json with "
                  "row runs (it ran before nodes kept them); run it again")
            continue
        try:
            rows = bridge.row_groups_of(encodings["rows"][0])  # the IR's rows of the first mask
            built = PLAIN[m["kernel"]](m, mask_set, rows, args, cache)
            if built[0] is None:
                print(f"{cell}\t{ours:.1f}\t\t\t\t\t\t{mode}\t{built[1]}")
                continue
            forward, backward, what = built
            plain = plain_rep(m, forward, backward)
            with bridge.harness_rep(harness_problem(m, mask_set, encodings, args.harness_storage)) as harness:
                here, theirs, (low, high), clocks = side_by_side(harness, plain, args.reps, args.rounds)
        except Exception as error:  # a peer refusing its own plain call is a finding too
            print(f"{cell}\t{ours:.1f}\t\t\t\t\t\t{mode}\tfailed: {type(error).__name__}: {error}")
            continue
        finally:
            torch.cuda.empty_cache()
        mhz = clock_range(clocks)
        print(f"{cell}\t{ours:.1f}\t{tflops(here):.1f}\t{tflops(theirs):.1f}\t{theirs / here - 1:+.1%}"
              f"\t{low:.3f}–{high:.3f}\t{mhz}\t{mode}\t{what}")


if __name__ == "__main__":
    main()
