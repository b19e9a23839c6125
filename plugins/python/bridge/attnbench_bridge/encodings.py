"""The mask IR's table encodings, as the host computes them (`Problem.row_groups`,
`Problem.block_grid`), expanded into what kernels take: row intervals, interval lists, dense
masks, tile kinds. Documents with a window (varlen), full and causal, and FlashMask's columns
come from the host too (`Problem.varlen`, `Problem.flashmask`); nothing here reads the slices.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

from .support import _np


class RowGroups(NamedTuple):
    """The allowed keys as disjoint intervals over groups of consecutive rows that share them:
    group g is rows [start[g], end[g]); interval j is [lo[j], hi[j]) of group[j], sorted by group
    and then by lo. Every row is in exactly one group."""
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

    def first_interval(self) -> Any:
        """[groups + 1]: group g's intervals are [first[g], first[g + 1])."""
        np = _np()
        return np.searchsorted(self.group, np.arange(len(self.start) + 1))


def row_groups_of(runs: dict) -> RowGroups:
    """The host's row runs (the IR's `RowRuns`: runs of rows whose intervals move by 0 or 1 a row)
    as RowGroups: a run whose intervals stand still is one group, a run with a moving end is a
    group a row. So a block table costs its bands, not its rows, and a causal slice still gets
    its exact diagonal."""
    np = _np()
    rows = np.asarray(runs["rows"], np.int64)
    offsets = np.asarray(runs["offsets"], np.int64)
    iv = np.asarray(runs["intervals"], np.int64).reshape(-1, 4)
    length = np.diff(rows)
    run_of = np.repeat(np.arange(len(length)), np.diff(offsets))
    moving = np.zeros(len(length), bool)
    moving[run_of[(iv[:, 1] | iv[:, 3]) != 0]] = True
    groups = np.where(moving, length, 1)
    first_group = groups.cumsum() - groups
    run_of_group = np.repeat(np.arange(len(length)), groups)
    step = np.arange(groups.sum()) - first_group[run_of_group]
    start = rows[run_of_group] + step
    end = np.where(moving[run_of_group], start + 1, rows[run_of_group + 1])
    # Each interval once a group of its run, moved by the group's step.
    copies = groups[run_of]
    which = np.repeat(np.arange(len(iv)), copies)
    k = np.arange(copies.sum()) - np.repeat(copies.cumsum() - copies, copies)
    group = first_group[run_of[which]] + k
    lo, hi = iv[which, 0] + iv[which, 1] * k, iv[which, 2] + iv[which, 3] * k
    order = np.lexsort((lo, group))
    return RowGroups(start, end, group[order], lo[order], hi[order])


def block_grid_of(encoding: dict, masks: Optional[List[int]] = None) -> Tuple[Any, Any, Any]:
    """The host's block grid (the IR's `BlockGrid`) as (row edges, column edges, kept[mask, row
    block, column block]), for the masks of these indices (all by default)."""
    np = _np()
    rows, cols = np.asarray(encoding["rows"], np.int64), np.asarray(encoding["cols"], np.int64)
    picked = range(len(encoding["kept"])) if masks is None else masks
    # Each kept run [row, c0, c1) as +1 at c0 and -1 at c1: a row's prefix sums mark its blocks.
    marks = np.zeros((len(picked), len(rows) - 1, len(cols)), np.int8)
    for m, index in enumerate(picked):
        runs = np.asarray(encoding["kept"][index], np.int64).reshape(-1, 3)
        marks[m, runs[:, 0], runs[:, 1]] += 1
        np.add.at(marks[m], (runs[:, 0], runs[:, 2]), -1)
    return rows, cols, marks.cumsum(2, dtype=np.int8)[:, :, :-1] > 0


def row_intervals(groups: RowGroups) -> Tuple[Any, Any, Any]:
    """Per row: (lo, hi) hull of the allowed keys and how many disjoint intervals the union has."""
    np = _np()
    g = groups
    count = g.counts()
    lo, hi = np.zeros(len(g.start), np.int64), np.zeros(len(g.start), np.int64)
    if len(g.group):
        first = np.append(True, g.group[1:] != g.group[:-1])
        last = np.append(first[1:], True)
        lo[g.group[first]], hi[g.group[last]] = g.lo[first], g.hi[last]
    return g.per_row(lo), g.per_row(hi), g.per_row(count)


def row_interval_list(groups: RowGroups, most: int) -> Optional[Any]:
    """Per row, its allowed keys as `most` intervals: [2·most, S] int64 of lo0, hi0, lo1, hi1, …
    (an unused interval is [0, 0)), or None when some row has more than `most`."""
    np = _np()
    g = groups
    if (g.counts() > most).any():
        return None
    table = np.zeros((2 * most, len(g.start)), np.int64)
    rank = np.arange(len(g.group)) - np.searchsorted(g.group, g.group, side="left")  # place in its group
    table[2 * rank, g.group], table[2 * rank + 1, g.group] = g.lo, g.hi
    return g.per_row(table)


def row_interval_pairs(groups: RowGroups) -> Optional[Any]:
    """Per row, its allowed keys as two intervals ([4, S], as `row_interval_list`), or None when
    some row has more. Every static mask of the paper has at most two a row (share_question: the
    question and the own answer; a global window: the global tokens and the window), so a
    mask_mod reading these is exact for all."""
    return row_interval_list(groups, 2)


def most_intervals(groups: RowGroups) -> int:
    """The largest number of disjoint key intervals of any row."""
    counts = groups.counts()
    return int(counts.max()) if len(counts) else 0


def row_keys(groups: RowGroups, q: int) -> List[Tuple[int, int]]:
    """Allowed keys of row `q` as sorted disjoint intervals."""
    np = _np()
    g = int(np.searchsorted(groups.end, q, side="right"))
    a, b = np.searchsorted(groups.group, [g, g + 1])
    return [(int(lo), int(hi)) for lo, hi in zip(groups.lo[a:b], groups.hi[a:b])]


def dense_mask(groups: RowGroups, seqlen_k: int, torch: Any = None, device: Any = None) -> Any:
    """Boolean [S_q, S_k], True where a key is allowed: numpy, or a torch tensor on `device`.
    Groups of one row are filled a batch at a time (a causal mask has one a row); a group of many
    rows is one row broadcast over them."""
    np = _np()
    g = groups
    sq = int(g.end[-1]) if len(g.end) else 0
    if torch is None:
        dense, as_array = np.zeros((sq, seqlen_k), bool), (lambda a: a)
    else:
        dense = torch.zeros((sq, seqlen_k), dtype=torch.bool, device=device)
        as_array = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    first = g.first_interval()
    batch = max(1, (1 << 24) // max(seqlen_k, 1))  # bounds the temporaries to ~16M cells
    single = (g.end - g.start) == 1
    a = 0
    while a < len(g.start):
        # Groups [a, b): one group of many rows, or up to `batch` groups of one row.
        b = a + 1
        if single[a]:
            stop = np.flatnonzero(~single[a:a + batch])
            b = a + (int(stop[0]) if len(stop) else min(batch, len(g.start) - a))
        marks = np.zeros((b - a, seqlen_k + 1), np.int8)
        i0, i1 = first[a], first[b]
        marks[g.group[i0:i1] - a, g.lo[i0:i1]] += 1
        np.add.at(marks, (g.group[i0:i1] - a, g.hi[i0:i1]), -1)
        rows = as_array(marks.cumsum(1, dtype=np.int8)[:, :-1] > 0)
        dense[g.start[a]:g.end[b - 1]] = rows
        a = b
    return dense


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
