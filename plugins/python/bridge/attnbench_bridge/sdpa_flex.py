"""PyTorch's kernels: SDPA's backends and FlexAttention, with masks in the forms their
documentation uses.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .encodings import blocks_of, grid_tile_kinds, row_interval_pairs, uniform_grid
from .flex_forms import form_differs, pattern_mask_mod
from .harness import Kernel, split_result, synchronize
from .problem import Problem
from .support import ELEMENT_BYTES, GIB, Unavailable, Unsupported, _np, first_line, log, parameters_of


SDPA_BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}


def sdpa_backend(torch: Any, kernel: str) -> Tuple[Any, Any]:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as error:
        raise Unavailable(f"torch.nn.attention.sdpa_kernel not importable: {first_line(error)}") from None
    backend = getattr(SDPBackend, SDPA_BACKENDS[kernel], None)
    if backend is None:
        raise Unavailable(f"torch {torch.__version__} has no SDPBackend.{SDPA_BACKENDS[kernel]}")
    return backend, sdpa_kernel


def sdpa_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    backend, select = sdpa_backend(torch, p.kernel)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    shared = p.shared_mask()
    form = p.form()
    gqa = p.heads_q != p.heads_kv
    s, e = p.seqlen, ELEMENT_BYTES[p.dtype]
    state = {"mask": None, "expand": False}  # expand: K and V repeated inside the timed call
    kernel = Kernel(call=None, refusal_is_unsupported=True, context=lambda: select(backend),
                    lse_note=f"{p.kernel} returns none (scaled_dot_product_attention does not expose it)",
                    env={"backend": f"torch.nn.functional.scaled_dot_product_attention, SDPBackend.{SDPA_BACKENDS[p.kernel]}",
                         "gqa": ("K and V expanded before the timed region" if p.gqa == "expand" else "enable_gqa")
                         if gqa else "none"},
                    expand_kv=gqa and p.gqa == "expand")
    mask_heads = 0
    if form is None:
        if p.kernel == "sdpa-flash":
            raise Unsupported(f"sdpa-flash takes no arbitrary mask; {p.pattern} needs a dense mask "
                              "(it runs full and causal masks only)")
        mask_heads = 1 if shared is not None else p.heads_q
        if mask_heads > 1 and device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            if mask_heads * s * s > free // 2:
                raise Unsupported(f"{p.kernel} would need per-head dense masks [1, {p.heads_q}, {s}, {s}] "
                                  f"({mask_heads * s * s / GIB:.1f} GiB) and only {free / GIB:.1f} GiB is free")
    kernel.phases["mask_mode"] = {"full": "no mask", "causal": "is_causal=True"}.get(
        form, f"dense boolean attn_mask [1, {p.heads_q}, S, S]" if mask_heads > 1 else "dense boolean attn_mask [S, S]")
    scores = p.heads_q * s * s * 4
    grad_factor = 2 if p.backward else 1
    kernel.extra_bytes = mask_heads * s * s + 4 * p.heads_q * s * 4
    if p.kernel == "sdpa-math":
        kernel.extra_bytes += 2 * scores * grad_factor + (s * s * 4 * max(mask_heads, 1) if mask_heads else 0)
    elif mask_heads:
        kernel.extra_bytes += mask_heads * s * (s + 16) * max(e, 4)  # the mask as an additive bias
    if gqa:
        kernel.extra_bytes += p.heads_q * s * (p.head_dim + p.value_dim) * e * grad_factor

    def setup(native: Dict[str, Any]) -> None:
        if not mask_heads:
            return
        start = time.perf_counter()
        if shared is not None:
            dense = p.dense(0, torch, device)
        else:
            distinct = [p.dense(i, torch, device) for i in range(len(p.masks))]
            dense = torch.stack([distinct[p.mask_index(h)] for h in range(p.heads_q)])[None]
            del distinct
        synchronize(torch, device, kernel)
        state["mask"] = dense
        kernel.phases.update(mask_build_s=time.perf_counter() - start, mask_bytes=dense.numel())

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, None]:
        options = {"attn_mask": state["mask"], "is_causal": form == "causal", "scale": p.scale}
        if state["expand"]:
            k, v = k.repeat_interleave(p.group, dim=1), v.repeat_interleave(p.group, dim=1)
        elif gqa and not kernel.expand_kv:
            options["enable_gqa"] = True
        return sdpa(q, k, v, **options), None

    def retry(error: BaseException) -> bool:
        if gqa and not state["expand"] and not kernel.expand_kv:
            log(f"{p.kernel} refused enable_gqa ({first_line(error)}); expanding K and V instead")
            state["expand"] = True
            kernel.env["gqa"] = "expanded (K and V repeat_interleave'd inside the timed call)"
            return True
        return False

    kernel.call, kernel.setup, kernel.retry = call, setup, retry
    return kernel


def flex_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    try:
        flex = importlib.import_module("torch.nn.attention.flex_attention")
    except Exception as error:
        raise Unavailable(f"torch.nn.attention.flex_attention not importable: {first_line(error)}") from None
    np = _np()
    cpu = device.type != "cuda"
    if cpu and p.backward:
        raise Unsupported("flex runs forward only on cpu (torch.compile's cpu FlexAttention supports inference only)")
    dynamo = importlib.import_module("torch._dynamo")
    dynamo.reset()  # one compile per request: compile_s stays meaningful, no recompile limit hit
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), 1024))
    functorch_config = importlib.import_module("torch._functorch.config")
    if p.backward and hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    lse_options: Dict[str, Any] = {}
    if not cpu:  # cpu flex cannot return the LSE
        if hasattr(flex, "AuxRequest") and "return_aux" in parameters_of(flex.flex_attention):
            lse_options["return_aux"] = flex.AuxRequest(lse=True)
        else:
            lse_options["return_lse"] = True
    shared = p.shared_mask()
    indices = [0] if shared is not None else list(range(len(p.masks)))
    single = all((p.intervals(i)[2] <= 1).all() for i in range(len(p.masks)))
    pairs = None if single else [row_interval_pairs(p.row_groups(i)) for i in indices]
    two = pairs is not None and all(x is not None for x in pairs)
    form = p.form()
    # Full blocks on flex's block sizes need no mask_mod at all: preferred to any table.
    grid, _ = p.block_grid(indices) if form is None else (None, "")
    grid, uniform = uniform_grid(grid, p.seqlen) if grid is not None else (None, None)
    block = next((b for b in FLEX_BLOCKS if grid is not None and all(
        (edges % b == 0).all() for edges in grid[:2])), None)
    # Documents and windows have a closed form, the one flex's documentation writes (a
    # document-id vector and index arithmetic): preferred to any table where no block form is exact.
    closed = p.varlen()[0] if shared is not None and form is None and not block else None
    # Other patterns with a closed form (prefixes, a shared question, blockwise, global windows):
    # the pattern's own parameters and documents, checked against the mask's rows before use.
    pattern = pattern_mask_mod(p.mask_set, torch, device) if shared is not None and form is None and not block \
        and closed is None else None
    if pattern is not None and (pattern[0] is None or form_differs(pattern[0], p.row_groups(0), torch, device)):
        pattern = None
    mode = {"full": "none", "causal": "causal"}.get(
        form, "blocks" if block else "documents" if closed is not None else "pattern" if pattern is not None
        else "block table" if grid is not None else "row intervals" if single else "two row intervals" if two
        else "dense")
    s, count = p.seqlen, len(indices)
    if mode == "dense" and count * s * -(-s // 8) >= 1 << 31:
        raise Unsupported(f"flex would read a {count}×{s}×{s} bit table in mask_mod, past the 2³¹ elements its "
                          "32-bit index arithmetic can address; the mask has no exact block or interval form")
    per_group = shared is None and p.mask_set["scope"] == "per_kv_group"
    state: Dict[str, Any] = {"block_mask": None}
    kernel = Kernel(call=None, refusal_is_unsupported=cpu, compiles=True,
                    lse_note="flex on cpu cannot return it" if cpu else None,
                    env={"backend": "torch.compile(flex_attention, dynamic=False) with create_block_mask"})
    kernel.phases["mask_mode"] = {"none": "no block mask (full)", "causal": "mask_mod q >= kv",
                                  "row intervals": "mask_mod reads per-row key intervals",
                                  "two row intervals": "mask_mod reads two key intervals a row",
                                  "documents": "closed-form mask_mod: " + closed_form_description(closed),
                                  "pattern": "closed-form mask_mod: " + (pattern[2] if pattern else ""),
                                  "blocks": f"full {block}-token blocks from the masks' block grid (no mask_mod)",
                                  "block table": f"{FLEX_TILE}-token tiles from the masks' block grid: full inside kept "
                                                 "blocks, mask_mod reading a per-block table where tiles cut blocks"
                                                 + (f" (block = position // {uniform})" if uniform else
                                                    " (each position's block looked up)"),
                                  "dense": "mask_mod reads a bit-packed dense mask"}[mode]
    cells = grid[2].size if grid is not None else 0
    table_bytes = {"row intervals": count * s * 16, "two row intervals": count * s * 16, "dense": count * s * -(-s // 8),
                   "block table": 2 * 4 * -(-s // FLEX_TILE) * FLEX_TILE + cells}.get(mode, 0)
    # create_block_mask evaluates the mask over S × S; a block grid needs none of that.
    kernel.extra_bytes = table_bytes + (2 * count * s * s if mode not in ("none", "blocks", "block table") else 0)

    def head_of(h: Any) -> Any:
        return h // p.group if per_group else h

    def setup(native: Dict[str, Any]) -> None:
        if mode == "none":
            return
        start = time.perf_counter()
        tables: List[Any] = []
        if mode == "blocks":
            block_mask = flex_block_mask(p, torch, device, flex, grid, block)
        elif mode == "block table":
            block_mask, tables = flex_block_table(p, torch, device, flex, grid, uniform, head_of)
        elif mode == "causal":
            mask_mod = lambda b, h, q, kv: q >= kv  # noqa: E731
        elif mode == "documents":
            mask_mod, tables = closed_form_mask_mod(closed, torch, device)
        elif mode == "pattern":
            mask_mod, tables, _ = pattern
        elif mode == "row intervals":
            lo = torch.from_numpy(np.stack([p.intervals(i)[0] for i in indices])).to(device, torch.int32)
            hi = torch.from_numpy(np.stack([p.intervals(i)[1] for i in indices])).to(device, torch.int32)
            tables = [lo, hi]
            if count == 1:
                lo0, hi0 = lo[0], hi[0]
                mask_mod = lambda b, h, q, kv: (kv >= lo0[q]) & (kv < hi0[q])  # noqa: E731
            else:
                mask_mod = lambda b, h, q, kv: (kv >= lo[head_of(h), q]) & (kv < hi[head_of(h), q])  # noqa: E731
        elif mode == "two row intervals":
            bounds = torch.from_numpy(np.stack(pairs)).to(device, torch.int32)  # [masks, 4, S]
            tables = [bounds]

            def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
                i = 0 if count == 1 else head_of(h)
                return (((kv >= bounds[i, 0, q]) & (kv < bounds[i, 1, q]))
                        | ((kv >= bounds[i, 2, q]) & (kv < bounds[i, 3, q])))
        else:
            # Bits, not bytes: 8× less memory, and 8× further before flex's 32-bit indexing ends.
            bits = torch.stack([pack_bits(torch, p.dense(i, torch, device)) for i in indices])
            tables = [bits]
            if count == 1:
                bits0 = bits[0]
                mask_mod = lambda b, h, q, kv: ((bits0[q, kv // 8].int() >> (kv % 8)) & 1) == 1  # noqa: E731
            else:
                mask_mod = lambda b, h, q, kv: ((bits[head_of(h), q, kv // 8].int() >> (kv % 8)) & 1) == 1  # noqa: E731
        if mode not in ("blocks", "block table"):
            block_mask = flex.create_block_mask(mask_mod, None, None if count == 1 else p.heads_q, s, s, device=device)
        synchronize(torch, device, kernel)
        parts = [getattr(block_mask, n, None) for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                         "full_kv_indices", "q_num_blocks", "q_indices",
                                                         "full_q_num_blocks", "full_q_indices")]
        kernel.phases.update(
            mask_build_s=time.perf_counter() - start,
            mask_bytes=sum(t.numel() * t.element_size() for t in tables + parts if hasattr(t, "numel")),
            block_size=list(getattr(block_mask, "BLOCK_SIZE", ())) or None)
        state["block_mask"] = block_mask

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        return split_result(compiled(q, k, v, block_mask=state["block_mask"], scale=p.scale,
                                     enable_gqa=p.heads_q != p.heads_kv, **lse_options))

    def out_only(q: Any, k: Any, v: Any) -> Any:
        return compiled(q, k, v, block_mask=state["block_mask"], scale=p.scale, enable_gqa=p.heads_q != p.heads_kv)

    kernel.call, kernel.setup, kernel.out_only = call, setup, out_only
    return kernel


def closed_form_description(encoding: Optional[dict]) -> str:
    if encoding is None:
        return ""
    documents = len(encoding["cu_seqlens"]) - 1
    parts = [f"document ids ({documents} documents)"] if documents > 1 else []
    if encoding["left"] >= 0:
        parts.append(f"q - kv <= {encoding['left']}")
    if encoding["right"] == 0:
        parts.append("q >= kv")
    elif encoding["right"] > 0:
        parts.append(f"kv - q <= {encoding['right']}")
    return " and ".join(parts)


def closed_form_mask_mod(encoding: dict, torch: Any, device: Any) -> Tuple[Callable[..., Any], List[Any]]:
    """The mask_mod of documents with one window inside each (`Problem.varlen`'s form): a
    document-id vector where there are several documents, index arithmetic for the window."""
    cu = encoding["cu_seqlens"]
    left, right = encoding["left"], encoding["right"]
    tables: List[Any] = []
    if len(cu) > 2:
        lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32), lengths)
        tables = [doc]
    else:
        doc = None

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        allowed = (doc[q] == doc[kv]) if doc is not None else (q >= 0)
        if right == 0:
            allowed = allowed & (q >= kv)
        elif right > 0:
            allowed = allowed & (kv - q <= right)
        if left >= 0:
            allowed = allowed & (q - kv <= left)
        return allowed

    return mask_mod, tables


# flex's own block size: its kernels' tiles divide it under their default settings (smaller sparse
# blocks need tuned tile sizes).
FLEX_TILE = 128
# Block sizes of a BlockMask of full blocks built from a block grid; a grid whose blocks do not
# fall on them gets FLEX_TILE tiles with a per-block table (flex_block_table).
FLEX_BLOCKS = (FLEX_TILE,)


def flex_block_table(p: Problem, torch: Any, device: Any, flex: Any, grid: Tuple[Any, Any, Any],
                     uniform: Optional[int], head_of: Callable[[Any], Any]) -> Tuple[Any, List[Any]]:
    """A BlockMask over flex's own tiles for a block grid whose edges do not fall on them (blocks
    of 64 tokens, variable blocks), and the tables its mask_mod reads: a tile inside kept blocks
    whole is full (no mask_mod), a tile that cuts blocks is partial and reads a per-block table —
    bytes per block, where a bit table costs S²/8 and create_block_mask evaluates S × S. Blocks
    of one size (`uniform`) are found by division, as flex's documentation writes a block
    table's mask_mod; variable ones through a table of each position's block, which costs two
    more loads per element (most felt in the backward, which evaluates the mask_mod twice)."""
    np = _np()
    rows, cols, kept = grid
    s, tile = p.seqlen, FLEX_TILE
    n = -(-s // tile)
    full, partial = grid_tile_kinds(grid, s, tile)
    heads = [p.mask_index(h) for h in range(p.heads_q)] if len(kept) > 1 else [0]

    def as_lists(chosen: Any) -> Tuple[Any, Any]:
        order = np.argsort(~chosen[heads], axis=-1, kind="stable")  # chosen kv tiles first, in order
        return (torch.from_numpy(chosen[heads].sum(-1)[None].astype(np.int32)).to(device),
                torch.from_numpy(order[None].astype(np.int32)).to(device))

    (counts, indices), (full_counts, full_indices) = as_lists(partial), as_lists(full)
    # The table padded to powers of two, cells past the grid never read (the last tile's padding
    # reads cells past the sequence, which flex masks): its shape is part of what flex compiles,
    # and on the H200 a flex cell's first call took 2.1-2.3 s on variable blocks, each mask another
    # shape, against 0.3 s on uniform ones, whose shapes repeat.
    reach = -(-n * tile // uniform) if uniform else 0
    padded = np.zeros((len(kept),) + tuple(1 << max(0, int(max(size, reach) - 1).bit_length())
                                          for size in kept.shape[1:]), bool)
    padded[:, :kept.shape[1], :kept.shape[2]] = kept
    table = torch.from_numpy(padded).to(device)
    tables = [table]
    if uniform:
        row_cell = col_cell = lambda x: x // uniform  # noqa: E731
    else:
        positions = np.arange(n * tile)  # past the sequence: the last cell
        row_table, col_table = (torch.from_numpy(blocks_of(edges, positions).astype(np.int32)).to(device)
                                for edges in (rows, cols))
        tables += [row_table, col_table]
        row_cell, col_cell = (lambda q: row_table[q]), (lambda kv: col_table[kv])
    if len(kept) == 1:
        table0 = table[0]
        mask_mod = lambda b, h, q, kv: table0[row_cell(q), col_cell(kv)]  # noqa: E731
    else:
        mask_mod = lambda b, h, q, kv: table[head_of(h), row_cell(q), col_cell(kv)]  # noqa: E731
    block_mask = flex.BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=tile,
                                               mask_mod=mask_mod, seq_lengths=(s, s))
    return block_mask, tables


def pack_bits(torch: Any, dense: Any) -> Any:
    """[S, S] booleans as [S, ceil(S/8)] bytes, key k in bit k % 8 of byte k // 8."""
    rows, cols = dense.shape
    padded = torch.zeros((rows, -(-cols // 8) * 8), dtype=torch.uint8, device=dense.device)
    padded[:, :cols] = dense
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=dense.device)
    return (padded.view(rows, -1, 8) * weights).sum(-1, dtype=torch.uint8)


def flex_block_mask(p: Problem, torch: Any, device: Any, flex: Any, grid: Tuple[Any, Any, Any], block: int) -> Any:
    """A BlockMask listing the kept blocks of a block grid whose edges fall on `block`: every kept
    block is full, so flex never evaluates a mask_mod and nothing of size S × S exists."""
    np = _np()
    rows, cols, kept = grid
    n = p.seqlen // block
    row_cell, col_cell = blocks_of(rows, np.arange(n) * block), blocks_of(cols, np.arange(n) * block)
    per_block = kept[:, row_cell][:, :, col_cell]  # [mask, q block, kv block]
    # One pattern for every head (H = 1 broadcasts), or each query head's own.
    heads = [p.mask_index(h) for h in range(p.heads_q)] if len(kept) > 1 else [0]
    chosen = per_block[heads]  # [H, q block, kv block]
    order = np.argsort(~chosen, axis=-1, kind="stable")  # kept kv blocks first, in order
    full_indices = torch.from_numpy(order[None].astype(np.int32)).to(device)
    full_counts = torch.from_numpy(chosen.sum(-1)[None].astype(np.int32)).to(device)
    return flex.BlockMask.from_kv_blocks(torch.zeros_like(full_counts), torch.zeros_like(full_indices),
                                         full_counts, full_indices, BLOCK_SIZE=block, seq_lengths=(p.seqlen, p.seqlen))
