"""The mask IR's slices turned into the tables kernels take: row intervals, dense masks, block
grids. Documents with a window (varlen), full and causal, and FlashMask's columns come from the
host with the request (`Problem.varlen`, `Problem.flashmask`), computed by the IR itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, NamedTuple, Optional, Tuple

from .support import _np


# A mask is the union of its slices; the tables are derived here from them.
SLICE_KINDS = ("full", "causal", "inv_causal", "bi_causal")
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = range(len(SLICE_KINDS))


def _local_bounds(np: Any, kind: Any, i: Any, lq: Any, lk: Any) -> Tuple[Any, Any]:
    """Allowed local keys [lo, hi) of local rows `i` of slices of `kind` (an index of SLICE_KINDS;
    scalars or arrays alike); lo is not yet clipped at 0."""
    lo = np.where((kind == INV_CAUSAL) | (kind == BI_CAUSAL), i, 0)
    hi = np.where((kind == CAUSAL) | (kind == BI_CAUSAL), np.minimum(i + lk - lq + 1, lk), lk)
    return lo, hi


def slice_table(mask: dict) -> Tuple[Any, Any, Any, Any, Any]:
    """The mask's slices as int64 columns: q0, q1, k0, k1 and the kind's index in SLICE_KINDS."""
    np = _np()
    slices = mask["slices"]
    bounds = np.array([sl["q"] + sl["k"] for sl in slices], np.int64).reshape(len(slices), 4)
    kind = np.array([SLICE_KINDS.index(sl["kind"]) for sl in slices], np.int64)
    return bounds[:, 0], bounds[:, 1], bounds[:, 2], bounds[:, 3], kind


class RowGroups(NamedTuple):
    """The allowed keys as disjoint intervals over groups of consecutive rows that share them:
    group g is rows [start[g], end[g]); interval j is [lo[j], hi[j]) of group[j], sorted by group
    and then by lo, touching ones merged. Every row is in exactly one group."""
    start: Any
    end: Any
    group: Any
    lo: Any
    hi: Any

    def counts(self) -> Any:
        """How many intervals each group has."""
        return _np().bincount(self.group, minlength=len(self.start))

    def per_row(self, values: Any) -> Any:
        """Values of the groups (the last axis) repeated to the rows."""
        return _np().repeat(values, self.end - self.start, axis=-1)


# The row groups of the masks seen last, by identity: one problem's encodings (row intervals,
# interval lists, the most intervals a row has) all start from them, and a 48K block table's
# take a tenth of a second each. The mask is kept beside its groups, so an id is never reused
# while cached.
_ROW_GROUPS: "OrderedDict[int, Tuple[dict, RowGroups]]" = OrderedDict()
_ROW_GROUPS_KEPT = 16


def row_groups(mask: dict) -> RowGroups:
    """row_groups_of(mask), computed once for the masks seen last (a mask is not changed after
    it is parsed)."""
    cached = _ROW_GROUPS.get(id(mask))
    if cached is not None and cached[0] is mask:
        _ROW_GROUPS.move_to_end(id(mask))
        return cached[1]
    groups = row_groups_of(mask)
    _ROW_GROUPS[id(mask)] = (mask, groups)
    while len(_ROW_GROUPS) > _ROW_GROUPS_KEPT:
        _ROW_GROUPS.popitem(last=False)
    return groups


def row_groups_of(mask: dict) -> RowGroups:
    """The mask's rows in groups (RowGroups). Between two consecutive slice edges lies a band of
    rows; where only full slices cross a band its rows see the same keys and the band is one group,
    elsewhere each row is its own. So a block table costs its blocks, not its rows (a 48K table of
    64-token blocks has hundreds of thousands of slices and would otherwise expand to tens of
    millions of row intervals), while a causal slice still gets its exact diagonal."""
    np = _np()
    sq, sk = mask["seqlen_q"], mask["seqlen_k"]
    q0, q1, k0, k1, kind = slice_table(mask)
    live = (q1 > q0) & (k1 > k0)
    q0, q1, k0, k1, kind = (x[live] for x in (q0, q1, k0, k1, kind))
    edges = np.unique(np.concatenate([[0, sq], q0, q1]))
    b0, b1 = np.searchsorted(edges, q0), np.searchsorted(edges, q1)  # a slice spans bands [b0, b1)
    crossed = np.zeros(len(edges), np.int64)  # how many partial slices cross each band
    partial = kind != FULL
    np.add.at(crossed, b0[partial], 1)
    np.add.at(crossed, b1[partial], -1)
    by_row = crossed.cumsum()[:-1] > 0
    band_rows = np.diff(edges)
    groups_of_band = np.where(by_row, band_rows, 1)
    first_group = groups_of_band.cumsum() - groups_of_band
    band_of_group = np.repeat(np.arange(len(band_rows)), groups_of_band)
    start = edges[band_of_group] + np.arange(len(band_of_group)) - first_group[band_of_group]
    end = np.where(by_row[band_of_group], start + 1, edges[band_of_group + 1])
    # Every (slice, band) pair; on a band of one group a slice is its full key range.
    spans = b1 - b0
    pair_slice = np.repeat(np.arange(len(q0)), spans)
    pair_band = b0[pair_slice] + np.arange(spans.sum()) - np.repeat(spans.cumsum() - spans, spans)
    whole = ~by_row[pair_band]
    parts = [(first_group[pair_band[whole]], k0[pair_slice[whole]], k1[pair_slice[whole]])]
    # On the other bands, each row of each crossing slice, from the slice's kind.
    split_slice, split_band = pair_slice[~whole], pair_band[~whole]
    rows = band_rows[split_band]
    w = np.repeat(split_slice, rows)
    offset = np.arange(rows.sum()) - np.repeat(rows.cumsum() - rows, rows)
    group = np.repeat(first_group[split_band], rows) + offset
    lq, lk = q1[w] - q0[w], k1[w] - k0[w]
    lo, hi = _local_bounds(np, kind[w], start[group] - q0[w], lq, lk)
    keep = (hi > lo) & (lo < lk) & (hi > 0)
    parts.append((group[keep], k0[w][keep] + np.maximum(lo[keep], 0), k0[w][keep] + hi[keep]))
    group, lo, hi = (np.concatenate([part[j] for part in parts]) for j in range(3))
    order = np.lexsort((lo, group))
    group, lo, hi = group[order], lo[order], hi[order]
    if not len(group):
        return RowGroups(start, end, group, lo, hi)
    # Running maximum of `hi` within each group: groups are sorted and hi <= sk, so offsetting by
    # group * (sk + 1) keeps one cumulative maximum from leaking into the next group.
    reach = np.maximum.accumulate(group * (sk + 1) + hi) - group * (sk + 1)
    previous = np.full(len(group), -1, np.int64)
    previous[1:] = np.where(group[1:] == group[:-1], reach[:-1], -1)
    starts = lo > previous
    ends = np.append(starts[1:], True)  # the last piece of each merged interval
    return RowGroups(start, end, group[starts], lo[starts], reach[ends])


def row_intervals(mask: dict) -> Tuple[Any, Any, Any]:
    """Per row: (lo, hi) hull of the allowed keys and how many disjoint intervals the union has."""
    np = _np()
    g = row_groups(mask)
    count = g.counts()
    lo, hi = np.zeros(len(g.start), np.int64), np.zeros(len(g.start), np.int64)
    if len(g.group):
        first = np.append(True, g.group[1:] != g.group[:-1])
        last = np.append(first[1:], True)
        lo[g.group[first]], hi[g.group[last]] = g.lo[first], g.hi[last]
    return g.per_row(lo), g.per_row(hi), g.per_row(count)


def row_interval_list(mask: dict, most: int) -> Optional[Any]:
    """Per row, its allowed keys as `most` intervals: [2·most, S] int64 of lo0, hi0, lo1, hi1, …
    (an unused interval is [0, 0)), or None when some row has more than `most`."""
    np = _np()
    g = row_groups(mask)
    if (g.counts() > most).any():
        return None
    table = np.zeros((2 * most, len(g.start)), np.int64)
    rank = np.arange(len(g.group)) - np.searchsorted(g.group, g.group, side="left")  # place in its group
    table[2 * rank, g.group], table[2 * rank + 1, g.group] = g.lo, g.hi
    return g.per_row(table)


def row_interval_pairs(mask: dict) -> Optional[Any]:
    """Per row, its allowed keys as two intervals ([4, S], as `row_interval_list`), or None when
    some row has more. Every static mask of the paper has at most two a row (share_question: the
    question and the own answer; a global window: the global tokens and the window), so a
    mask_mod reading these is exact for all."""
    return row_interval_list(mask, 2)


def most_intervals(mask: dict) -> int:
    """The largest number of disjoint key intervals of any row."""
    counts = row_groups(mask).counts()
    return int(counts.max()) if len(counts) else 0


def row_keys(mask: dict, q: int) -> List[Tuple[int, int]]:
    """Allowed keys of row `q` as sorted disjoint intervals, one slice at a time (no arrays)."""
    spans = []
    for sl in mask["slices"]:
        (q0, q1), (k0, k1) = sl["q"], sl["k"]
        if not q0 <= q < q1:
            continue
        lq, lk, i = q1 - q0, k1 - k0, q - q0
        d, kind = lk - lq, sl["kind"]
        lo = i if kind in ("inv_causal", "bi_causal") else 0
        hi = min(i + d + 1, lk) if kind in ("causal", "bi_causal") else lk
        if hi > lo and lo < lk and hi > 0:
            spans.append((k0 + max(lo, 0), k0 + hi))
    merged: List[Tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def dense_mask(mask: dict, torch: Any = None, device: Any = None) -> Any:
    """Boolean [S_q, S_k], True where a key is allowed: numpy, or a torch tensor on `device`."""
    np = _np()
    sq, sk = mask["seqlen_q"], mask["seqlen_k"]
    if torch is None:
        dense, as_array = np.zeros((sq, sk), bool), (lambda a: a)
    else:
        dense = torch.zeros((sq, sk), dtype=torch.bool, device=device)
        as_array = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    for sl in mask["slices"]:
        (q0, q1), (k0, k1) = sl["q"], sl["k"]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        lo, hi = _local_bounds(np, SLICE_KINDS.index(sl["kind"]), np.arange(lq, dtype=np.int64), lq, lk)
        lo = np.maximum(lo, 0)
        keys = as_array(np.arange(lk, dtype=np.int64))[None, :]
        step = max(1, (1 << 24) // lk)  # bounds the temporaries to ~16M cells
        for r in range(0, lq, step):
            a, b = as_array(lo[r:r + step])[:, None], as_array(hi[r:r + step])[:, None]
            dense[q0 + r:q0 + min(r + step, lq), k0:k1] |= (keys >= a) & (keys < b)
    return dense


def block_grid(masks: List[dict]) -> Tuple[Optional[Tuple[Any, Any, Any]], str]:
    """The masks on one grid of blocks, as block-sparse kernels take them: (row edges, column
    edges, kept[mask, row block, column block]), or (None, why not). The edges are every slice
    end of every mask, so each mask is exact on the shared grid: blocks of any sizes, uniform or
    variable, per head or shared."""
    np = _np()
    tables = [slice_table(m) for m in masks]
    kind = np.concatenate([t[4] for t in tables])
    if (kind != FULL).any():
        partial = ", ".join(SLICE_KINDS[k] for k in np.unique(kind[kind != FULL]))
        return None, f"it has {partial} slices, not only full blocks"
    sq, sk = masks[0]["seqlen_q"], masks[0]["seqlen_k"]
    which = np.repeat(np.arange(len(masks)), [len(t[4]) for t in tables])
    q = np.stack([np.concatenate([t[j] for t in tables]) for j in (0, 1)], axis=1)
    k = np.stack([np.concatenate([t[j] for t in tables]) for j in (2, 3)], axis=1)
    rows = np.unique(np.concatenate([[0, sq], q.ravel()]))
    cols = np.unique(np.concatenate([[0, sk], k.ravel()]))
    r, c = np.searchsorted(rows, q), np.searchsorted(cols, k)
    # Each rectangle as four corners of a 2-D difference array: its prefix sums count coverage.
    coverage = np.zeros((len(masks), len(rows), len(cols)), np.int64)
    for (ri, ci), sign in (((0, 0), 1), ((0, 1), -1), ((1, 0), -1), ((1, 1), 1)):
        np.add.at(coverage, (which, r[:, ri], c[:, ci]), sign)
    kept = coverage.cumsum(1).cumsum(2)[:, :-1, :-1] > 0
    return (rows, cols, kept), ""


# The smallest block a grid is made uniform at: a coarser grid is what block-sparse kernels'
# uniform paths take; below it, a grid of variable blocks is the smaller table.
MIN_UNIFORM_BLOCK = 64


def uniform_grid(grid: Tuple[Any, Any, Any], s: int) -> Tuple[Tuple[Any, Any, Any], Optional[int]]:
    """(grid, block): a block grid made uniform when every edge falls on a common block of at
    least MIN_UNIFORM_BLOCK tokens (the largest such; the last block may be shorter), else
    (grid, None). A uniform block-sparse pattern comes back on its own grid even where the IR
    merged neighbouring blocks into larger rectangles, so kernels get the pattern's blocks, index
    them with arithmetic instead of a lookup, and take their uniform (BSR) paths."""
    np = _np()
    rows, cols, kept = grid
    inner = np.concatenate([rows[1:-1], cols[1:-1]]).astype(np.int64)
    block = int(np.gcd.reduce(inner)) if len(inner) else s
    if block < MIN_UNIFORM_BLOCK:
        return grid, None
    edges = np.minimum(np.arange(-(-s // block) + 1, dtype=np.int64) * block, s)
    r, c = blocks_of(rows, edges[:-1]), blocks_of(cols, edges[:-1])
    return (edges, edges, kept[:, r][:, :, c]), block


def blocks_of(edges: Any, positions: Any) -> Any:
    """The block of each position on a grid with these edges; positions past the end map to
    the last block (the padding of a last tile, which the kernels mask)."""
    np = _np()
    return (np.searchsorted(edges, positions, side="right") - 1).clip(0, len(edges) - 2)


def grid_tile_kinds(grid: Tuple[Any, Any, Any], s: int, tile: int) -> Tuple[Any, Any]:
    """[mask, q tiles, kv tiles] booleans (whole, cut) of block tables on any grid (kept blocks of
    any sizes) seen by a kernel's `tile`-token tiles: a tile is whole when every block it overlaps
    is kept, cut when some are. Counted on the tables' prefix sums, so a 48K table costs no more
    than its tiles."""
    np = _np()
    rows, cols, kept = grid
    edges = np.minimum(np.arange(-(-s // tile) + 1) * tile, s)
    # The blocks tile i overlaps are r0[i] .. r1[i] - 1 (likewise for columns).
    r0, r1 = np.searchsorted(rows, edges[:-1], side="right") - 1, np.searchsorted(rows, edges[1:], side="left")
    c0, c1 = np.searchsorted(cols, edges[:-1], side="right") - 1, np.searchsorted(cols, edges[1:], side="left")
    prefix = np.zeros((kept.shape[0], kept.shape[1] + 1, kept.shape[2] + 1), np.int64)
    prefix[:, 1:, 1:] = kept.cumsum(1).cumsum(2)
    i0, i1, j0, j1 = r0[:, None], r1[:, None], c0[None, :], c1[None, :]
    count = prefix[:, i1, j1] - prefix[:, i0, j1] - prefix[:, i1, j0] + prefix[:, i0, j0]
    whole = count == (i1 - i0) * (j1 - j0)
    return whole, (count > 0) & ~whole
