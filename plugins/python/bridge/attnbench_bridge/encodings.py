"""The mask IR's slices turned into what kernels take: row intervals, dense masks, documents with a
window (varlen), block grids, FlashMask columns.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .support import _np


# A mask is the union of its slices; every encoding a kernel takes is derived here from them.

def _local_bounds(np: Any, kind: str, i: Any, lk: int, d: int) -> Tuple[Any, Any]:
    """Allowed local keys [lo, hi) of local rows `i` of one slice (lo not yet clipped at 0)."""
    if kind == "full":
        return np.zeros_like(i), np.full_like(i, lk)
    if kind == "causal":
        return np.zeros_like(i), np.minimum(i + d + 1, lk)
    if kind == "inv_causal":
        return i.copy(), np.full_like(i, lk)
    return i.copy(), np.minimum(i + d + 1, lk)  # bi_causal


def slice_bounds(sl: dict) -> Tuple[Any, Any, Any]:
    """(rows, lo, hi) in absolute positions for the rows of a slice that allow at least one key."""
    np = _np()
    (q0, q1), (k0, k1) = sl["q"], sl["k"]
    lq, lk = q1 - q0, k1 - k0
    i = np.arange(lq, dtype=np.int64)
    lo, hi = _local_bounds(np, sl["kind"], i, lk, lk - lq)
    keep = (hi > lo) & (lo < lk) & (hi > 0)
    return q0 + i[keep], k0 + np.maximum(lo[keep], 0), k0 + hi[keep]


def merged_intervals(mask: dict) -> Tuple[Any, Any, Any]:
    """The allowed keys as disjoint intervals [lo, hi), one array each of (row, lo, hi), sorted by
    row and then by lo: the union of the slices' intervals, touching ones merged."""
    np = _np()
    sk = mask["seqlen_k"]
    parts = [slice_bounds(sl) for sl in mask["slices"]]
    if not parts or sum(len(r) for r, _, _ in parts) == 0:
        return (np.zeros(0, np.int64),) * 3
    rows, lo, hi = (np.concatenate([part[j] for part in parts]) for j in range(3))
    order = np.lexsort((lo, rows))
    rows, lo, hi = rows[order], lo[order], hi[order]
    # Running maximum of `hi` within each row: rows are sorted and hi <= sk, so offsetting by
    # row * (sk + 1) keeps one cumulative maximum from leaking into the next row.
    reach = np.maximum.accumulate(rows * (sk + 1) + hi) - rows * (sk + 1)
    previous = np.full(len(rows), -1, np.int64)
    previous[1:] = np.where(rows[1:] == rows[:-1], reach[:-1], -1)
    starts = lo > previous
    ends = np.append(starts[1:], True)  # the last piece of each merged interval
    return rows[starts], lo[starts], reach[ends]


def row_intervals(mask: dict) -> Tuple[Any, Any, Any]:
    """Per row: (lo, hi) hull of the allowed keys and how many disjoint intervals the union has."""
    np = _np()
    sq = mask["seqlen_q"]
    rows, lo, hi = merged_intervals(mask)
    lo_rows, hi_rows = np.zeros(sq, np.int64), np.zeros(sq, np.int64)
    first = np.append(True, rows[1:] != rows[:-1]) if len(rows) else np.zeros(0, bool)
    last = np.append(first[1:], True) if len(rows) else first
    lo_rows[rows[first]], hi_rows[rows[last]] = lo[first], hi[last]
    return lo_rows, hi_rows, np.bincount(rows, minlength=sq)


def row_interval_list(mask: dict, most: int) -> Optional[Any]:
    """Per row, its allowed keys as `most` intervals: [2·most, S] int64 of lo0, hi0, lo1, hi1, …
    (an unused interval is [0, 0)), or None when some row has more than `most`."""
    np = _np()
    rows, lo, hi = merged_intervals(mask)
    count = np.bincount(rows, minlength=mask["seqlen_q"])
    if (count > most).any():
        return None
    table = np.zeros((2 * most, mask["seqlen_q"]), np.int64)
    rank = np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")  # the interval's place in its row
    table[2 * rank, rows], table[2 * rank + 1, rows] = lo, hi
    return table


def row_interval_pairs(mask: dict) -> Optional[Any]:
    """Per row, its allowed keys as two intervals ([4, S], as `row_interval_list`), or None when
    some row has more. Every static mask of the paper has at most two a row (share_question: the
    question and the own answer; a global window: the global tokens and the window), so a
    mask_mod reading these is exact for all."""
    return row_interval_list(mask, 2)


def most_intervals(mask: dict) -> int:
    """The largest number of disjoint key intervals of any row."""
    np = _np()
    rows, _, _ = merged_intervals(mask)
    return int(np.bincount(rows).max()) if len(rows) else 0


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
        lo, hi = _local_bounds(np, sl["kind"], np.arange(lq, dtype=np.int64), lk, lk - lq)
        lo = np.maximum(lo, 0)
        keys = as_array(np.arange(lk, dtype=np.int64))[None, :]
        step = max(1, (1 << 24) // lk)  # bounds the temporaries to ~16M cells
        for r in range(0, lq, step):
            a, b = as_array(lo[r:r + step])[:, None], as_array(hi[r:r + step])[:, None]
            dense[q0 + r:q0 + min(r + step, lq), k0:k1] |= (keys >= a) & (keys < b)
    return dense


def classify(mask: dict) -> Optional[str]:
    """'full' or 'causal' (top-left = bottom-right on a square) when the union is exactly that."""
    np = _np()
    if mask["seqlen_q"] != mask["seqlen_k"]:
        return None
    lo, hi, count = row_intervals(mask)
    s = mask["seqlen_q"]
    if not (count == 1).all() or not (lo == 0).all():
        return None
    if (hi == s).all():
        return "full"
    if (hi == np.arange(1, s + 1)).all():
        return "causal"
    return None


def varlen_encoding(mask: dict) -> Tuple[Optional[dict], str]:
    """Documents (cu_seqlens) with one sliding window inside each, as FlashAttention's varlen
    entry points take it: within a document, q sees k when q - k <= left and k - q <= right
    (-1 = unbounded). Returns (encoding, "") or (None, why not)."""
    np = _np()
    s = mask["seqlen_q"]
    if s != mask["seqlen_k"]:
        return None, "queries and keys have different lengths"
    lo, hi, count = row_intervals(mask)
    bad = np.nonzero(count != 1)[0]
    if bad.size:
        q = int(bad[0])
        return None, (f"row {q} has no allowed key" if count[q] == 0
                      else f"row {q} has {int(count[q])} separate key intervals")
    # Document boundaries: positions p that no row's interval crosses.
    p = np.arange(1, s)
    reach = np.maximum.accumulate(hi)[:-1]
    suffix_min = np.minimum.accumulate(lo[::-1])[::-1][1:]
    cuts = p[(reach <= p) & (suffix_min >= p)]
    cu = np.concatenate([[0], cuts, [s]]).astype(np.int64)
    lengths = np.diff(cu)
    start, end = np.repeat(cu[:-1], lengths), np.repeat(cu[1:], lengths)
    q = np.arange(s)
    clipped_left, clipped_right = lo > start, hi < end
    left = int((q - lo)[clipped_left].max()) if clipped_left.any() else -1
    right = int((hi - 1 - q)[clipped_right].max()) if clipped_right.any() else -1
    left, right = max(left, -1), max(right, -1)
    want_lo = start if left < 0 else np.maximum(start, q - left)
    want_hi = end if right < 0 else np.minimum(end, q + right + 1)
    wrong = np.nonzero((want_lo != lo) | (want_hi != hi))[0]
    if wrong.size:
        r = int(wrong[0])
        return None, f"row {r} allows keys [{int(lo[r])}, {int(hi[r])}), which no single window gives"
    return {"cu_seqlens": [int(c) for c in cu], "max_seqlen": int(lengths.max()),
            "left": left, "right": right}, ""


def block_grid(masks: List[dict]) -> Tuple[Optional[Tuple[Any, Any, Any]], str]:
    """The masks on one grid of blocks, as block-sparse kernels take them: (row edges, column
    edges, kept[mask, row block, column block]), or (None, why not). The edges are every slice
    end of every mask, so each mask is exact on the shared grid: blocks of any sizes, uniform or
    variable, per head or shared."""
    np = _np()
    slices = [(index, sl) for index, m in enumerate(masks) for sl in m["slices"]]
    partial = {sl["kind"] for _, sl in slices if sl["kind"] != "full"}
    if partial:
        return None, f"it has {', '.join(sorted(partial))} slices, not only full blocks"
    sq, sk = masks[0]["seqlen_q"], masks[0]["seqlen_k"]
    which = np.array([index for index, _ in slices], np.int64)
    q = np.array([sl["q"] for _, sl in slices], np.int64).reshape(-1, 2)
    k = np.array([sl["k"] for _, sl in slices], np.int64).reshape(-1, 2)
    rows = np.unique(np.concatenate([[0, sq], q.ravel()]))
    cols = np.unique(np.concatenate([[0, sk], k.ravel()]))
    r, c = np.searchsorted(rows, q), np.searchsorted(cols, k)
    # Each rectangle as four corners of a 2-D difference array: its prefix sums count coverage.
    coverage = np.zeros((len(masks), len(rows), len(cols)), np.int64)
    for (ri, ci), sign in (((0, 0), 1), ((0, 1), -1), ((1, 0), -1), ((1, 1), 1)):
        np.add.at(coverage, (which, r[:, ri], c[:, ci]), sign)
    kept = coverage.cumsum(1).cumsum(2)[:, :-1, :-1] > 0
    return (rows, cols, kept), ""


def flashmask_columns(mask: dict) -> Tuple[Optional[dict], str]:
    """FlashMask's column bounds: per key, masked rows [LTS, LTE) and (non-causal) [UTS, UTE)."""
    np = _np()
    s = mask["seqlen_q"]
    if s != mask["seqlen_k"]:
        return None, "queries and keys have different lengths"
    allowed = dense_mask(mask)
    causal = not np.triu(allowed, 1).any()
    masked = ~allowed
    if causal:
        masked &= np.tril(np.ones((s, s), bool))  # the causal flag already masks rows q < k
    del allowed
    above = np.zeros_like(masked)
    above[1:] = masked[:-1]
    below = np.zeros_like(masked)
    below[:-1] = masked[1:]
    starts, ends = masked & ~above, masked & ~below
    runs = starts.sum(axis=0)
    limit = 1 if causal else 2
    bad = np.nonzero(runs > limit)[0]
    if bad.size:
        k = int(bad[0])
        return None, f"key {k} has {int(runs[k])} masked row intervals; FlashMask allows {limit}"
    first_start, first_end = starts.argmax(axis=0), ends.argmax(axis=0) + 1
    last_start, last_end = s - 1 - starts[::-1].argmax(axis=0), s - ends[::-1].argmax(axis=0)
    lts, lte = np.full(s, s, np.int32), np.full(s, s, np.int32)
    uts, ute = np.zeros(s, np.int32), np.zeros(s, np.int32)
    one, two = runs == 1, runs == 2
    if causal:
        lts[one], lte[one] = first_start[one], first_end[one]
    else:
        uts[one | two], ute[one | two] = first_start[one | two], first_end[one | two]
        lts[two], lte[two] = last_start[two], last_end[two]
    return {"causal": causal, "columns": [lts, lte] if causal else [lts, lte, uts, ute]}, ""
