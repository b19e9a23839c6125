"""The FlashAttention family: FA2 and FA3 (documents and windows), FA4 (also block-sparse tensors
and a mask_mod on the tiles a mask cuts).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Tuple

from .encodings import blocks_of, grid_tile_kinds, most_intervals, row_interval_list
from .harness import Kernel, require_cuda, require_half, split_result
from .problem import Problem
from .support import Unavailable, Unsupported, _np, _package_version, need, parameters_of


FLASH_MODULES = {"fa2": "flash_attn", "fa3": "flash_attn_interface", "fa4": "flash_attn.cute"}


def lse_options_of(function: Callable) -> Dict[str, bool]:
    """The keyword that makes a FlashAttention-style function also return the LSE."""
    parameters = parameters_of(function)
    for name in ("return_lse", "return_softmax_lse", "return_attn_probs"):
        if name in parameters:
            return {name: True}
    return {}


def flash_plan(p: Problem, supports: str) -> dict:
    """The varlen + window encoding of the (shared) mask, or unsupported with the reason."""
    shared = p.shared_mask()
    if shared is None:
        raise Unsupported(f"{p.kernel} runs one mask for every head; {p.pattern} has "
                          f"{p.mask_set['scope']} masks that differ")
    encoding, why = p.varlen()
    if encoding is None:
        raise Unsupported(f"{p.kernel} runs {supports}; {p.pattern} is not expressible that way ({why})")
    return encoding


def flash_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    name = FLASH_MODULES[p.kernel]
    module = need(name)
    dense_call, varlen_call = getattr(module, "flash_attn_func", None), getattr(module, "flash_attn_varlen_func", None)
    if dense_call is None:
        raise Unavailable(f"{name} has no flash_attn_func")
    require_cuda(p, device)
    require_half(p)
    supports = "full, causal, sliding-window and document (varlen) masks"
    if p.kernel == "fa4":
        try:
            plan = flash_plan(p, supports)
        except Unsupported as why:
            return fa4_masked(p, torch, device, module, str(why))
    else:
        plan = flash_plan(p, supports)
    unbounded = None if p.kernel == "fa4" else -1  # FA4 writes an open window side as None
    left, right = plan["left"], plan["right"]
    options: Dict[str, Any] = {"softmax_scale": p.scale}
    if left < 0 and right == 0:
        options["causal"] = True
    elif left >= 0 or right >= 0:
        options["window_size"] = (left if left >= 0 else unbounded, right if right >= 0 else unbounded)
    documents = len(plan["cu_seqlens"]) - 1
    if documents == 1:
        with_lse = lse_options_of(dense_call)

        def forward(q: Any, k: Any, v: Any, extra: Dict[str, Any]) -> Tuple[Any, Any]:
            return split_result(dense_call(q, k, v, **options, **extra))
        entry = "flash_attn_func"
    else:
        if varlen_call is None:
            raise Unsupported(f"{name} has no flash_attn_varlen_func for {p.pattern}'s {documents} documents")
        with_lse = lse_options_of(varlen_call)
        cu = torch.tensor(plan["cu_seqlens"], dtype=torch.int32, device=device)
        options.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=plan["max_seqlen"], max_seqlen_k=plan["max_seqlen"])

        def forward(q: Any, k: Any, v: Any, extra: Dict[str, Any]) -> Tuple[Any, Any]:
            return split_result(varlen_call(q, k, v, **options, **extra))
        entry = "flash_attn_varlen_func"
    version = getattr(module, "__version__", None) or getattr(sys.modules.get(name.split(".")[0]), "__version__", None)
    # Varlen takes the packed tokens [S, H, D] as its leaves: a [1, S, H, D] leaf indexed per call
    # would add a zero-filled gradient copy of q, k and v to every timed backward.
    kernel = Kernel(call=lambda q, k, v: forward(q, k, v, with_lse), out_only=lambda q, k, v: forward(q, k, v, {})[0],
                    layout="bshd" if documents == 1 else "thd", refusal_is_unsupported=True, compiles=p.kernel == "fa4",
                    extra_bytes=16 * p.heads_q * p.seqlen * 4,
                    env={"backend": f"{name}.{entry}", "package_version": version})
    kernel.phases["mask_mode"] = (f"{documents} documents (cu_seqlens), " if documents > 1 else "") + \
        ("causal" if options.get("causal") else f"window {options['window_size']}" if "window_size" in options else "full")
    return kernel


FA4_TILE = 128  # FA4's tile on Hopper at d <= 128, and the block size of its block-sparse tensors


def fa4_block_lists(torch: Any, device: Any, whole: Any, cut: Any) -> Any:
    """FA4's block-sparse tensors from [H, rows, cols] tables of whole and cut tiles (H = 1: one
    table for every head): per row of tiles, the columns of each kind, packed left."""
    np, sparsity = _np(), need("flash_attn.cute.block_sparsity")

    def packed(table: Any) -> Tuple[Any, Any]:
        order = np.argsort(~table, axis=-1, kind="stable").astype(np.int32)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)[None]).to(device)  # noqa: E731
        return to(table.sum(-1).astype(np.int32)), to(order)
    (mask_cnt, mask_idx), (full_cnt, full_idx) = packed(cut), packed(whole)
    return sparsity.BlockSparseTensorsTorch(mask_block_cnt=mask_cnt, mask_block_idx=mask_idx,
                                            full_block_cnt=full_cnt, full_block_idx=full_idx,
                                            block_size=(FA4_TILE, FA4_TILE))


def fa4_sparsity_options(p: Problem, torch: Any, device: Any, whole: Any, cut: Any) -> Dict[str, Any]:
    """The forward's block lists and, for a backward, the transposed ones (per key tile, its query
    tiles) that FA4 asks for as block_sparse_tensors_bwd."""
    np = _np()
    options = {"block_sparse_tensors": fa4_block_lists(torch, device, whole, cut)}
    if p.backward:
        options["block_sparse_tensors_bwd"] = fa4_block_lists(torch, device, np.swapaxes(whole, 1, 2),
                                                              np.swapaxes(cut, 1, 2))
    return options


def fa4_kernel(p: Problem, module: Any, options: Dict[str, Any], entry: str, mask_mode: str) -> Kernel:
    """FA4's flash_attn_func with `options`: `call` returns the LSE (checked), `out_only` does not
    (timed); the backward gets the transposed block lists (block_sparse_tensors_bwd) where the
    options have them."""
    options = dict(options, softmax_scale=p.scale)

    def forward(q: Any, k: Any, v: Any, return_lse: bool) -> Tuple[Any, Any]:
        return split_result(module.flash_attn_func(q, k, v, return_lse=return_lse, **options))
    return Kernel(call=lambda q, k, v: forward(q, k, v, True), out_only=lambda q, k, v: forward(q, k, v, False)[0],
                  layout="bshd", refusal_is_unsupported=True, compiles=True,
                  extra_bytes=16 * p.heads_q * p.seqlen * 4,
                  env={"backend": f"flash_attn.cute.flash_attn_func ({entry})",
                       "package_version": _package_version(module, "flash-attn-4", "fa4")},
                  phases={"mask_mode": mask_mode})


def tile_kinds(intervals: Any, s: int) -> Tuple[Any, Any]:
    """[q tiles, kv tiles] booleans (whole, cut) of a mask given as key intervals a row ([2·n, S],
    as `row_interval_list`): a tile is whole when every row of it sees all of its keys, cut when
    some row sees some but not all."""
    np = _np()
    tiles = -(-s // FA4_TILE)
    edges = np.minimum(np.arange(tiles + 1) * FA4_TILE, s)
    seen = np.zeros((s, tiles), np.int64)
    for lo, hi in zip(intervals[0::2], intervals[1::2]):
        seen += np.clip(np.minimum(hi[:, None], edges[1:]) - np.maximum(lo[:, None], edges[:-1]), 0, None)
    pad = tiles * FA4_TILE - s  # rows past the end: neither stop a tile from being whole nor cut it
    whole = np.vstack([seen == edges[1:] - edges[:-1], np.ones((pad, tiles), bool)])
    some = np.vstack([seen > 0, np.zeros((pad, tiles), bool)])
    whole = whole.reshape(tiles, FA4_TILE, tiles).all(1)
    return whole, some.reshape(tiles, FA4_TILE, tiles).any(1) & ~whole


# Masks that are not block tables reach FA4's cut tiles as key intervals a row; rows of more than
# this make the mask_mod's per-element loop too long to be FA4 at its best (`unsupported`). Block
# tables are looked up instead, whatever their number of intervals. Measured on the H200
# (2026-12-02, 48K, variable blocks of 512 tokens on average): 32 intervals ran at 47–395 TFLOP/s
# forward; the 64-interval kernel of density 0.5 had not finished its first measurement after six
# minutes.
FA4_MOST_INTERVALS = 32
_FA4_MASK_MODS: Dict[int, Any] = {}


def fa4_interval_mask_mod(count: int) -> Any:
    """A CuTe mask_mod keeping the keys in `count` intervals of the row, read from aux tensors as
    FA4's document-mask example reads document ids: for two, four tensors [1, H, S] (lo0, hi0, lo1,
    hi1); for more, one [1, H, S, 2·count]. One function object per count and process: FA4 keys
    its compile cache on the function."""
    if count not in _FA4_MASK_MODS:
        cutlass, cute = need("cutlass"), need("cutlass.cute")
        to_ssa = need("flash_attn.cute.utils").scalar_to_ssa
        if count == 2:
            @cute.jit
            def within_intervals(batch: Any, head: Any, q_idx: Any, kv_idx: Any, seqlen_info: Any,
                                 aux_tensors: Any) -> Any:
                lo0 = to_ssa(aux_tensors[0][batch[0], head[0], q_idx[0]], cutlass.Int32)
                hi0 = to_ssa(aux_tensors[1][batch[0], head[0], q_idx[0]], cutlass.Int32)
                lo1 = to_ssa(aux_tensors[2][batch[0], head[0], q_idx[0]], cutlass.Int32)
                hi1 = to_ssa(aux_tensors[3][batch[0], head[0], q_idx[0]], cutlass.Int32)
                return ((kv_idx >= lo0) & (kv_idx < hi0)) | ((kv_idx >= lo1) & (kv_idx < hi1))
        else:
            @cute.jit
            def within_intervals(batch: Any, head: Any, q_idx: Any, kv_idx: Any, seqlen_info: Any,
                                 aux_tensors: Any) -> Any:
                bounds = aux_tensors[0]
                lo = to_ssa(bounds[batch[0], head[0], q_idx[0], 0], cutlass.Int32)
                hi = to_ssa(bounds[batch[0], head[0], q_idx[0], 1], cutlass.Int32)
                keep = (kv_idx >= lo) & (kv_idx < hi)
                for j in cutlass.range_constexpr(1, count):
                    lo = to_ssa(bounds[batch[0], head[0], q_idx[0], 2 * j], cutlass.Int32)
                    hi = to_ssa(bounds[batch[0], head[0], q_idx[0], 2 * j + 1], cutlass.Int32)
                    keep = keep | ((kv_idx >= lo) & (kv_idx < hi))
                return keep
        _FA4_MASK_MODS[count] = within_intervals
    return _FA4_MASK_MODS[count]


def fa4_interval_options(torch: Any, device: Any, per_head: List[Any], count: int) -> Dict[str, Any]:
    """The mask_mod of `count` intervals a row and its aux tensors, from each query head's interval
    table ([2·count, S]; FA4 passes the query head's index)."""
    np = _np()
    bounds = np.stack(per_head).astype(np.int32)  # [H, 2·count, S]
    if count == 2:
        tensors = [torch.from_numpy(np.ascontiguousarray(bounds[:, j])[None]).to(device) for j in range(4)]
        leading = 2
    else:
        tensors = [torch.from_numpy(np.ascontiguousarray(bounds.transpose(0, 2, 1))[None]).to(device)]
        leading = 3
    for tensor in tensors:
        tensor.__leading_dim__ = leading
    return {"mask_mod": fa4_interval_mask_mod(count), "aux_tensors": tensors}


_FA4_BLOCK_MASK_MOD: List[Any] = []


def fa4_block_mask_mod() -> Any:
    """A CuTe mask_mod for block tables: each element's row and column block from one [2, S]
    position-to-block map, then that block's bit in the [1, H, row blocks, column blocks] table.
    Two loads an element whatever the number of blocks a row keeps, where intervals would need
    a loop over them, and one compiled kernel for every table (FA4 keys its cache on the
    function object, so there is one per process)."""
    if not _FA4_BLOCK_MASK_MOD:
        cutlass, cute = need("cutlass"), need("cutlass.cute")
        to_ssa = need("flash_attn.cute.utils").scalar_to_ssa

        @cute.jit
        def within_kept_block(batch: Any, head: Any, q_idx: Any, kv_idx: Any, seqlen_info: Any,
                              aux_tensors: Any) -> Any:
            kept, block_of = aux_tensors[0], aux_tensors[1]
            row = to_ssa(block_of[0, q_idx[0]], cutlass.Int32)
            col = to_ssa(block_of[1, kv_idx[0]], cutlass.Int32)
            return to_ssa(kept[batch[0], head[0], row[0], col[0]], cutlass.Int32) != 0
        _FA4_BLOCK_MASK_MOD.append(within_kept_block)
    return _FA4_BLOCK_MASK_MOD[0]


def block_lookup(grid: Tuple[Any, Any, Any], per_head: List[int], s: int) -> Tuple[Any, Any]:
    """Block tables as the mask_mod reads them: int32 [heads, row blocks, column blocks] (kept
    is 1) and [2, S], the row block and the column block of each position."""
    np = _np()
    rows, cols, kept = grid
    positions = np.arange(s)
    block_of = np.stack([blocks_of(rows, positions), blocks_of(cols, positions)]).astype(np.int32)
    return np.ascontiguousarray(kept[per_head].astype(np.int32)), block_of


def fa4_block_options(torch: Any, device: Any, grid: Tuple[Any, Any, Any], per_head: List[int],
                      s: int) -> Dict[str, Any]:
    """The block-table mask_mod and its aux tensors: the table of each query head (`per_head`
    indexes the grid's masks) and the position-to-block map of rows and columns."""
    table, block_of = block_lookup(grid, per_head, s)
    tensors = [torch.from_numpy(table[None]).to(device), torch.from_numpy(block_of).to(device)]
    tensors[0].__leading_dim__, tensors[1].__leading_dim__ = 3, 1
    return {"mask_mod": fa4_block_mask_mod(), "aux_tensors": tensors}


def fa4_masked(p: Problem, torch: Any, device: Any, module: Any, not_varlen: str) -> Kernel:
    """FA4 on any other mask: block-sparse tensors of whole and cut 128-token tiles (FA4 skips the
    empty ones and runs whole ones as they are), and on the cut tiles, where there are any, a
    mask_mod: block tables (variable blocks, 64-token blocks, off FA4's tile grid) look each
    element's block up, other masks read each row's key intervals (every static mask of the paper
    has at most two a row)."""
    np = _np()
    per_head = [p.mask_index(h) for h in range(p.heads_q)]
    distinct = sorted(set(per_head))
    grid, _ = p.block_grid(distinct)
    if grid is not None:
        whole, cut = grid_tile_kinds(grid, p.seqlen, FA4_TILE)
    else:
        most = max(most_intervals(p.row_groups(i)) for i in distinct)
        count = 2 if most <= 2 else 1 << (most - 1).bit_length()  # one compiled kernel per power of two
        if count > FA4_MOST_INTERVALS:
            raise Unsupported(f"{not_varlen}; nor is it a table of blocks, and rows have up to {most} key "
                              f"intervals, more than the {FA4_MOST_INTERVALS} the bridge's mask_mod for FA4 reads")
        tables = {i: row_interval_list(p.row_groups(i), count) for i in distinct}
        kinds = [tile_kinds(tables[i], p.seqlen) for i in distinct]
        whole, cut = (np.stack([k[j] for k in kinds]) for j in (0, 1))
    order = [distinct.index(i) for i in per_head]  # each query head's index among the distinct masks
    if len(distinct) > 1:  # a table per query head
        whole, cut = whole[order], cut[order]
    options = fa4_sparsity_options(p, torch, device, whole, cut)
    if cut.any() and grid is not None:
        options.update(fa4_block_options(torch, device, grid, order, p.seqlen))
        cut_by = "mask_mod looking up each element's block in the table on the cut tiles; "
    elif cut.any():
        options.update(fa4_interval_options(torch, device, [tables[i] for i in per_head], count))
        cut_by = f"mask_mod reading {count} key intervals a row on the cut tiles; "
    else:
        cut_by = "no mask_mod; "
    entry = "mask_mod, aux_tensors, block_sparse_tensors" if cut.any() else "block_sparse_tensors"
    return fa4_kernel(p, module, options, entry,
                      f"{cut_by}of {whole.size} {FA4_TILE}-token tiles {int(whole.sum())} whole, {int(cut.sum())} cut, "
                      f"{'one table for every head' if len(distinct) == 1 else 'a table per query head'}")
