"""Closed-form mask_mods from a mask pattern's own parameters and documents, written as flex's
documentation writes masks: document ids, document starts and index arithmetic, no table of the
mask. The flex adapter takes them before any table; scripts/peer-plain.py calls flex with them.
Each form is checked against the mask IR's rows before it is used (`form_differs`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from .encodings import RowGroups, row_keys
from .support import _np

# The patterns with a form here, and the parameter each needs (None: only the documents).
NEEDS = {"full": None, "causal": None, "full_document": None, "causal_document": None,
         "sliding_window": "window", "sliding_window_causal": "window", "prefix_lm_causal": "prefix",
         "share_question": None, "causal_blockwise": None, "prefix_lm_document": "prefix",
         "global_sliding_window": "global_tokens", "block_causal_document": "block_size"}


def pattern_mask_mod(mask_set: dict, torch: Any, device: Any) -> Optional[Tuple[Optional[Callable[..., Any]], List[Any], str]]:
    """(mask_mod, the tensors it reads, a description) of the mask set's pattern, or None where the
    pattern has no form here (or lacks the parameter it needs). mask_mod is None for `full`."""
    pattern, params, s = mask_set.get("pattern"), mask_set.get("params", {}), mask_set["seqlen"]
    if pattern not in NEEDS or (NEEDS[pattern] is not None and NEEDS[pattern] not in params):
        return None
    documents = mask_set.get("documents") or [s]
    lengths = torch.tensor(documents, device=device)
    doc = torch.repeat_interleave(torch.arange(len(documents), device=device, dtype=torch.int32), lengths)
    start = (torch.cumsum(lengths, 0) - lengths).to(torch.int32)[doc.long()]  # each position's document start
    last = len(documents) - 1
    window, prefix = int(params.get("window", 0)), int(params.get("prefix", 0))
    g, w = int(params.get("global_tokens", 0)), int(params.get("global_window", 0))
    block = int(params.get("block_size", 1))
    same = lambda q, kv: doc[q] == doc[kv]  # noqa: E731
    forms = {
        "full": (None, "no mask"),
        "causal": (lambda b, h, q, kv: q >= kv, "q >= kv"),
        "full_document": (lambda b, h, q, kv: same(q, kv), "same document"),
        "causal_document": (lambda b, h, q, kv: same(q, kv) & (q >= kv), "same document and q >= kv"),
        "sliding_window": (lambda b, h, q, kv: (q - kv <= window) & (kv - q <= window), f"|q - kv| <= {window}"),
        "sliding_window_causal": (lambda b, h, q, kv: (q >= kv) & (q - kv <= window), f"0 <= q - kv <= {window}"),
        "prefix_lm_causal": (lambda b, h, q, kv: (kv < prefix) | (q >= kv), f"kv < {prefix} or q >= kv"),
        "share_question": (lambda b, h, q, kv: ((doc[kv] == 0) & (doc[q] != 0)) | (same(q, kv) & (q >= kv)),
                           "answers see the question (document 0); each document causal"),
        "causal_blockwise": (lambda b, h, q, kv: ((doc[q] == last) & (doc[kv] != last)) | (same(q, kv) & (q >= kv)),
                             "the last document sees every other; each document causal"),
        "prefix_lm_document": (lambda b, h, q, kv: same(q, kv) & ((kv - start[kv] < prefix) | (q >= kv)),
                               f"same document and (kv - its start < {prefix} or q >= kv)"),
        "global_sliding_window": (lambda b, h, q, kv: (kv < g) | (q < g) | ((q - kv <= w) & (kv - q <= w)),
                                  f"kv < {g} or q < {g} or |q - kv| <= {w}"),
        "block_causal_document": (lambda b, h, q, kv: same(q, kv) & (kv < (q // block + 1) * block),
                                  f"same document and kv < ({block}-token block of q + 1) · {block}"),
    }
    mask_mod, description = forms[pattern]
    reads = [doc, start] if len(documents) > 1 else []
    return mask_mod, reads, f"{description} ({len(documents)} documents)" if len(documents) > 1 else description


def form_differs(mask_mod: Callable[..., Any], groups: RowGroups, torch: Any, device: Any,
                 rows: int = 64) -> Optional[str]:
    """None when mask_mod allows exactly the IR's keys (the host's row groups) on sampled rows
    (the first and last included), else the first row that differs."""
    np = _np()
    s = int(groups.end[-1])
    picked = np.unique(np.concatenate([[0, s - 1], np.random.default_rng(0).integers(0, s, rows)]))
    kv = torch.arange(s, device=device)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    for q in picked:
        allowed = mask_mod(zero, zero, torch.full((s,), int(q), device=device), kv).cpu().numpy()
        want = np.zeros(s, dtype=bool)
        for lo, hi in row_keys(groups, int(q)):
            want[lo:hi] = True
        if (allowed != want).any():
            return f"row {q} differs from the mask"
    return None
