#!/usr/bin/env python3
"""attnbench's Python bridge: benchmarks attention kernels that live in Python packages.

The attnbench host starts this file as ``python3 -u attnbench_bridge.py`` and keeps it running.
It speaks JSON lines: one request per line on stdin, one response per line on stdout.

Protocol (version 1)
--------------------
* On start: ``{"type":"hello","protocol":1,"python":"3.11.7","executable":...,"pid":N}``.
* ``{"id":N,"op":"backends"}`` -> for every kernel name, ``{"available","version","reason"}``.
* ``{"id":N,"op":"benchmark","params":{...}}`` -> ``{"id":N,"ok":true,"result":{...}}``; an
  unexpected exception gives ``{"id":N,"ok":false,"error":"<one sentence>","traceback":"..."}``
  and the bridge keeps serving.
* ``{"id":N,"op":"shutdown"}`` -> ``{"id":N,"ok":true,"result":null}``, then exit 0; EOF -> exit 0.
* A line that is not a JSON object, or an unknown op -> ``ok:false`` (``id`` null when unknown).

Only the protocol goes to the real stdout: fd 1 and ``sys.stdout`` are pointed at stderr before
anything else runs, so prints from libraries and kernels cannot corrupt the stream. Non-finite
floats (an infinite error, an undefined rel_ci) are sent as ``null``, as serde_json does.

A benchmark's ``result`` has ``status`` (ok, unsupported, oom), ``reason``, ``samples`` (seconds),
``rel_ci``, ``stopped``, ``memory``, ``correctness`` (null when the host gave ``inputs_dir``: it
checks the written outputs itself), ``phases`` and ``environment``, whose ``notes`` list, when
present, says what a reader of the numbers should know (rows fixed up to the empty-row
convention, an output not written). Correctness errors use
the host's metric (reference/mod.rs): largest |actual - reference| over largest |reference|. A
library kernel that refuses a problem on its first call (SDPA's "No available kernel", an assert
in a FlashAttention build) is reported unsupported with the error's first line; an exception from
a user module is a failure.

Conventions: tensors are batch 1; Q, O, dO, dQ are [heads_q][seqlen][head_dim], K, V, dK, dV
[heads_kv][seqlen][head_dim], LSE [heads_q][seqlen] (natural log of the scaled scores); scale is
1/sqrt(head_dim); query head h reads KV head h // (heads_q / heads_kv). A row with no allowed key
has O = 0 and LSE = -inf and contributes nothing to the gradients.

Third-party kernels
-------------------
``"kernel": "module"`` with ``"module": "/abs/path/user_kernel.py"`` benchmarks a file of your own.
The file is loaded afresh for every request (so edits are picked up) and must define::

    def attention(q, k, v, mask, scale):
        return out            # or (out, lse)

* By default ``q`` is a torch tensor [1, heads_q, S, D] and ``k``, ``v`` are [1, heads_kv, S, D],
  on the requested device and in the requested dtype. ``out`` has q's shape; ``lse``, when given,
  is [1, heads_q, S] or [heads_q, S] (natural log). Backward goes through torch autograd: the
  output must carry a graph back to q, k and v.
* With the module attribute ``BACKEND = "numpy"``, q, k, v are float32 numpy arrays [heads, S, D]
  (values rounded to the dtype) and the call runs on the CPU. Backward then needs
  ``attention_backward(q, k, v, out, lse, dout, mask, scale) -> (dq, dk, dv)``; without it a
  backward request is unsupported.
* ``mask`` is a dict: ``"dense"``: a boolean [S, S] tensor (numpy array for numpy modules), True
  where a key is allowed, built for masks shared by all heads up to S = 32768 (set
  ``DENSE_MASK = False`` to skip it), else None; ``"slices"``: the shared mask's slices as
  ``(q0, q1, k0, k1, kind)`` tuples, None when heads have different masks; ``"set"``: the raw
  mask set (``scope``, ``masks``, ...).
* Optional ``SUPPORTS(mask_set) -> None | str``: return a reason to report the problem as
  unsupported without running it.
* An exception raised while loading or running the module makes the request fail (``ok:false``),
  except ImportError at load time, which reports the kernel as unsupported.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

PROTOCOL = 1
KERNELS = ("numpy", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex",
           "fa2", "fa3", "fa4", "cudnn", "flashinfer", "flashmask", "module")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
LAYOUTS = ("bshd", "bhsd")  # how inputs are stored; see to_layout
GQA_MODES = ("native", "expand")  # how SDPA gets grouped K and V; see sdpa_adapter
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "f32": 4}
SLICE_KINDS = ("full", "causal", "inv_causal", "bi_causal")
HARNESS_DEFAULTS = {"warmup_reps": 3, "warmup_s": 0.1, "min_reps": 10, "max_reps": 200,
                    "max_time_s": 5.0, "target_rel_ci": 0.01}
DENSE_FOR_MODULES_MAX_SEQLEN = 32768
NUMPY_MASK_CACHE_BYTES = 1 << 30
GIB = float(1 << 30)


class Unsupported(Exception):
    """The kernel cannot run this problem; the message is the one-sentence reason."""


class OutOfMemory(Exception):
    """The problem does not fit in device memory; the message says by how much."""


class BadRequest(Exception):
    """The request itself is wrong (missing or inconsistent parameters)."""


def log(message: str) -> None:
    print(f"attnbench_bridge: {message}", file=sys.stderr, flush=True)


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:400]


def need(module: str, label: Optional[str] = None) -> Any:
    """Imports `module`, or reports the kernel as unsupported with the import's error."""
    try:
        return importlib.import_module(module)
    except Exception as error:  # broken installs raise OSError, RuntimeError, ... as well
        raise Unsupported(f"{label or module} not importable: {first_line(error)}") from None


def _np() -> Any:
    return need("numpy")


# ---------------------------------------------------------------------------------------------
# The request

@dataclass
class Problem:
    kernel: str
    direction: str
    heads_q: int
    heads_kv: int
    seqlen: int
    head_dim: int
    dtype: str
    mask_set: dict
    seed: int
    inputs_dir: Optional[str]
    outputs_dir: Optional[str]
    check_rows: int
    harness: dict
    device: str
    module: Optional[str]
    layout: str = "bshd"
    gqa: str = "native"
    _intervals: dict = field(default_factory=dict, repr=False)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def backward(self) -> bool:
        return self.direction != "fwd"

    @property
    def pattern(self) -> str:
        return str(self.mask_set.get("pattern", "this mask"))

    @property
    def masks(self) -> List[dict]:
        return self.mask_set["masks"]

    def mask_index(self, head: int) -> int:
        scope = self.mask_set["scope"]
        index = 0 if scope == "shared" else head // self.group if scope == "per_kv_group" else head
        return min(index, len(self.masks) - 1)

    def shared_mask(self) -> Optional[dict]:
        """The one mask every head uses, when there is one (identical masks count as one)."""
        first = self.masks[0]
        if self.mask_set["scope"] == "shared" or all(m == first for m in self.masks[1:]):
            return first
        return None

    def intervals(self, index: int) -> Tuple[Any, Any, Any]:
        if index not in self._intervals:
            self._intervals[index] = row_intervals(self.masks[index])
        return self._intervals[index]

    def empty_rows(self) -> Any:
        """[heads_q, S] booleans: rows with no allowed key."""
        np = _np()
        return np.stack([self.intervals(self.mask_index(h))[2] == 0 for h in range(self.heads_q)])


def _int(params: dict, key: str, where: str = "params") -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadRequest(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def parse_problem(params: Any) -> Problem:
    if not isinstance(params, dict):
        raise BadRequest("params must be a JSON object")
    kernel = params.get("kernel")
    if kernel not in KERNELS:
        raise BadRequest(f"unknown kernel {kernel!r}; known kernels: {', '.join(KERNELS)}")
    direction = params.get("direction", "fwd")
    if direction not in DIRECTIONS:
        raise BadRequest(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    dtype = params.get("dtype", "bf16")
    if dtype not in ELEMENT_BYTES:
        raise BadRequest(f"dtype must be bf16, fp16 or f32, got {dtype!r}")
    shape = params.get("shape")
    if not isinstance(shape, dict):
        raise BadRequest("params.shape must be an object with heads_q, heads_kv, seqlen, head_dim")
    hq, hkv = _int(shape, "heads_q", "shape"), _int(shape, "heads_kv", "shape")
    seqlen, head_dim = _int(shape, "seqlen", "shape"), _int(shape, "head_dim", "shape")
    if hq % hkv:
        raise BadRequest(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv})")
    harness = dict(HARNESS_DEFAULTS)
    harness.update({k: v for k, v in (params.get("harness") or {}).items() if k in HARNESS_DEFAULTS})
    harness["min_reps"] = max(1, int(harness["min_reps"]))
    harness["max_reps"] = max(int(harness["max_reps"]), harness["min_reps"])
    device = "cpu" if kernel == "numpy" else params.get("device") or "cuda"
    if device not in ("cuda", "cpu"):
        raise BadRequest(f"device must be cuda or cpu, got {device!r}")
    layout = params.get("layout") or "bshd"
    if layout not in LAYOUTS:
        raise BadRequest(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    gqa = params.get("gqa") or "native"
    if gqa not in GQA_MODES:
        raise BadRequest(f"gqa must be one of {', '.join(GQA_MODES)}, got {gqa!r}")
    if kernel == "module" and not params.get("module"):
        raise BadRequest("kernel module needs params.module, the path of the kernel's .py file")
    problem = Problem(kernel, direction, hq, hkv, seqlen, head_dim, dtype, params.get("mask"),
                      int(params.get("seed") if params.get("seed") is not None else 42),
                      params.get("inputs_dir"), params.get("outputs_dir"),
                      int(params.get("check_rows") or 64), harness,
                      device, params.get("module"), layout, gqa)
    validate_mask_set(problem)
    return problem


def validate_mask_set(p: Problem) -> None:
    mask_set = p.mask_set
    if not isinstance(mask_set, dict) or not isinstance(mask_set.get("masks"), list):
        raise BadRequest("params.mask must be a mask set object with a masks list")
    expected = {"shared": 1, "per_kv_group": p.heads_kv, "per_head": p.heads_q}.get(mask_set.get("scope"))
    if expected is None:
        raise BadRequest(f"mask scope must be shared, per_kv_group or per_head, got {mask_set.get('scope')!r}")
    if len(mask_set["masks"]) != expected:
        raise BadRequest(f"the mask set has {len(mask_set['masks'])} masks ({mask_set['scope']}) "
                         f"but {p.heads_q} heads_q / {p.heads_kv} heads_kv need {expected}")
    for index, mask in enumerate(mask_set["masks"]):
        if mask.get("seqlen_q") != p.seqlen or mask.get("seqlen_k") != p.seqlen:
            raise BadRequest(f"mask {index} is {mask.get('seqlen_q')}x{mask.get('seqlen_k')} "
                             f"but the shape's seqlen is {p.seqlen}")
        for sl in mask.get("slices", []):
            (q0, q1), (k0, k1) = sl["q"], sl["k"]
            if sl.get("kind") not in SLICE_KINDS or not (0 <= q0 <= q1 <= p.seqlen and 0 <= k0 <= k1 <= p.seqlen):
                raise BadRequest(f"mask {index} has an invalid slice {sl!r}")


# ---------------------------------------------------------------------------------------------
# The mask IR: a mask is the union of slices; every encoding a kernel takes is derived here.

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


def row_interval_pairs(mask: dict) -> Optional[Any]:
    """Per row, its allowed keys as two intervals: [4, S] int64 of lo0, hi0, lo1, hi1 (an unused
    interval is [0, 0)), or None when some row has more than two. Every static mask of the
    paper has at most two a row (share_question: the question and the own answer; a global
    window: the global tokens and the window), so a mask_mod reading these is exact for all."""
    np = _np()
    rows, lo, hi = merged_intervals(mask)
    count = np.bincount(rows, minlength=mask["seqlen_q"])
    if (count > 2).any():
        return None
    pairs = np.zeros((4, mask["seqlen_q"]), np.int64)
    first = np.append(True, rows[1:] != rows[:-1]) if len(rows) else np.zeros(0, bool)
    pairs[0, rows[first]], pairs[1, rows[first]] = lo[first], hi[first]
    pairs[2, rows[~first]], pairs[3, rows[~first]] = lo[~first], hi[~first]
    return pairs


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


# ---------------------------------------------------------------------------------------------
# Statistics, the timing protocol, the error metric

def median_rel_ci(samples: List[float]) -> float:
    """Half-width of the median's distribution-free 95% CI, relative to the median."""
    n = len(samples)
    if n < 3:
        return math.inf
    ordered = sorted(samples)
    half = 0.98 * math.sqrt(n)
    low = max(math.floor(n / 2 - half), 0)
    high = min(math.ceil(n / 2 + half), n - 1)
    position = (n - 1) * 0.5
    a, b = math.floor(position), math.ceil(position)
    median = ordered[a] + (ordered[b] - ordered[a]) * (position - a)
    if median <= 0:
        return math.inf
    return (ordered[high] - ordered[low]) / 2 / median


def run_harness(rep: Callable[[], float], h: dict) -> dict:
    """Warm-up, then repetitions until the median is stable, the time cap, or max_reps."""
    warmup_start, warmups = time.perf_counter(), 0
    while warmups < h["warmup_reps"] or time.perf_counter() - warmup_start < h["warmup_s"]:
        rep()
        warmups += 1
        if warmups >= h["max_reps"]:
            break
    start, samples = time.perf_counter(), []
    while True:
        samples.append(rep())
        rel_ci, n = median_rel_ci(samples), len(samples)
        if n >= h["min_reps"] and rel_ci <= h["target_rel_ci"]:
            stopped = "stable"
        elif n >= h["max_reps"]:
            stopped = "max reps"
        elif n >= min(h["min_reps"], 3) and time.perf_counter() - start >= h["max_time_s"]:
            stopped = "time cap"
        else:
            continue
        return {"samples": samples, "rel_ci": rel_ci, "stopped": stopped}


def relative_error(actual: Any, reference: Any) -> float:
    """The host's metric: largest |a - r| over largest |r| (absolute when r is all zero), in
    float64. Infinities must match exactly (LSE of empty rows); any NaN gives inf."""
    np = _np()
    a = np.asarray(actual, np.float64).ravel()
    r = np.asarray(reference, np.float32).astype(np.float64).ravel()  # the host keeps f32 references
    if a.shape != r.shape or np.isnan(a).any() or np.isnan(r).any():
        return math.inf
    infinite = np.isinf(a) | np.isinf(r)
    if (a[infinite] != r[infinite]).any():
        return math.inf
    a, r = a[~infinite], r[~infinite]
    if a.size == 0:
        return 0.0
    worst, largest = float(np.abs(a - r).max()), float(np.abs(r).max())
    return worst if largest == 0 else worst / largest


# ---------------------------------------------------------------------------------------------
# Inputs, outputs and the correctness check

def _tensor_shapes(p: Problem) -> Dict[str, Tuple[int, int, int]]:
    return {"q": (p.heads_q, p.seqlen, p.head_dim), "k": (p.heads_kv, p.seqlen, p.head_dim),
            "v": (p.heads_kv, p.seqlen, p.head_dim), "do": (p.heads_q, p.seqlen, p.head_dim)}


def _wanted(p: Problem) -> List[str]:
    return ["q", "k", "v"] + (["do"] if p.backward else [])


def read_inputs(p: Problem) -> Dict[str, Any]:
    np = _np()
    arrays = {}
    for name in _wanted(p):
        shape = _tensor_shapes(p)[name]
        path = os.path.join(p.inputs_dir, f"{name}.f32")
        if not os.path.isfile(path):
            raise BadRequest(f"inputs_dir has no {name}.f32")
        data = np.fromfile(path, dtype="<f4")
        if data.size != math.prod(shape):
            raise BadRequest(f"{path} holds {data.size} values; the shape needs {math.prod(shape)}")
        arrays[name] = data.astype(np.float32).reshape(shape)
    return arrays


def round_to_dtype(x: Any, dtype: str) -> Any:
    """Rounds float32 values to bf16/fp16 (nearest, ties to even) and back to float32."""
    np = _np()
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        bits = x.astype(np.float32).view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return bits.view(np.float32)
    return x.astype(np.float32)


def numpy_inputs(p: Problem) -> Dict[str, Any]:
    if p.inputs_dir:
        return read_inputs(p)
    np = _np()
    rng = np.random.default_rng(p.seed)
    arrays = {}
    for name in ("q", "k", "v", "do"):
        values = rng.uniform(-1.0, 1.0, size=_tensor_shapes(p)[name]).astype(np.float32)
        arrays[name] = round_to_dtype(values, p.dtype)
    return {name: arrays[name] for name in _wanted(p)}


def to_numpy(x: Any, rows: Optional[List[int]] = None) -> Any:
    """float32 numpy copy of a canonical [H, S, ...] tensor or array, optionally only `rows`."""
    np = _np()
    if isinstance(x, np.ndarray):  # always a copy: callers fix rows up in place
        return np.array(x if rows is None else x[:, rows], np.float32)
    x = x.detach()
    if rows is not None:
        import torch  # only reached with torch tensors
        x = x.index_select(1, torch.as_tensor(rows, device=x.device))
    return x.float().cpu().numpy()


def sample_rows(seqlen: int, count: int) -> List[int]:
    """Evenly spread rows, always including the first and the last (as the host samples)."""
    if seqlen <= count:
        return list(range(seqlen))
    if count <= 1:
        return [0]
    return [i * (seqlen - 1) // (count - 1) for i in range(count)]


def fix_empty_rows(empty: Any, out: Any, lse: Any, dq: Any) -> int:
    """Applies the empty-row convention (O = 0, LSE = -inf, dQ = 0) to rows with no allowed key
    whose values differ (NaN, say); returns how many rows it changed. Arrays are [H, R, ...]."""
    np = _np()
    changed = np.zeros(empty.shape, bool)
    for array, value in ((out, 0.0), (dq, 0.0)):
        if array is not None:
            differs = empty & ~(array == value).all(axis=-1)
            array[differs] = value
            changed |= differs
    if lse is not None:
        differs = empty & (lse != -np.inf)
        lse[differs] = -np.inf
        changed |= differs
    return int(changed.sum())


def reference_rows(p: Problem, rows: List[int], q: Any, do: Optional[Any],
                   kv_head: Callable[[int], Tuple[Any, Any]]) -> Tuple[Any, Any, Optional[Any]]:
    """O, LSE (and dQ) of `rows` of every head in float64, straight from the mask's slices.
    q, do: [heads_q, rows, D]; kv_head(i) -> (K_i, V_i) as [S, D]."""
    np = _np()
    n, s = len(rows), p.seqlen
    out = np.zeros((p.heads_q, n, p.head_dim))
    lse = np.full((p.heads_q, n), -np.inf)
    dq = np.zeros_like(out) if do is not None else None
    allowed_of: Dict[int, Any] = {}
    for kvh in range(p.heads_kv):
        k, v = (x.astype(np.float64) for x in kv_head(kvh))
        for h in range(kvh * p.group, (kvh + 1) * p.group):
            index = p.mask_index(h)
            if index not in allowed_of:
                allowed = np.zeros((n, s), bool)
                for j, row in enumerate(rows):
                    for a, b in row_keys(p.masks[index], row):
                        allowed[j, a:b] = True
                allowed_of[index] = allowed
            allowed = allowed_of[index]
            scores = np.where(allowed, (q[h].astype(np.float64) @ k.T) * p.scale, -np.inf)
            top = scores.max(axis=1)
            top = np.where(np.isfinite(top), top, 0.0)
            weights = np.where(allowed, np.exp(scores - top[:, None]), 0.0)
            total = weights.sum(axis=1)
            probs = weights / np.where(total > 0, total, 1.0)[:, None]
            out[h] = probs @ v
            lse[h] = np.where(total > 0, top + np.log(np.where(total > 0, total, 1.0)), -np.inf)
            if dq is not None:
                dout = do[h].astype(np.float64)
                dp = dout @ v.T
                delta = (dout * out[h]).sum(axis=1)
                dq[h] = (probs * (dp - delta[:, None])) @ k * p.scale
    return out, lse, dq


def check_or_write(p: Problem, t: Dict[str, Any], lse_note: Optional[str], notes: List[str]) -> Optional[dict]:
    """With outputs_dir: writes the outputs (f32, canonical layouts). Without inputs_dir: checks
    sampled rows against the float64 reference. `t` maps names to canonical tensors/arrays."""
    grads = t.get("dq") is not None
    if p.outputs_dir:
        arrays = {name: to_numpy(t[name]) for name in ("out", "lse", "dq", "dk", "dv") if t.get(name) is not None}
        fixed = fix_empty_rows(p.empty_rows(), arrays["out"], arrays.get("lse"), arrays.get("dq"))
        if fixed:
            notes.append(f"{fixed} rows with no allowed key were set to O=0, LSE=-inf, dQ=0 after "
                         "the kernel ran (outside the timed region)")
        if "lse" not in arrays:
            notes.append(f"lse.f32 not written: {lse_note or 'the kernel returned no LSE'}")
        os.makedirs(p.outputs_dir, exist_ok=True)
        for name, array in arrays.items():
            path = os.path.join(p.outputs_dir, f"{name}.f32")
            array.astype("<f4").tofile(path + ".tmp")
            os.replace(path + ".tmp", path)
    if p.inputs_dir:
        return None
    rows = sample_rows(p.seqlen, max(1, p.check_rows))
    out = to_numpy(t["out"], rows)
    lse = to_numpy(t["lse"], rows) if t.get("lse") is not None else None
    dq = to_numpy(t["dq"], rows) if grads else None
    fixed = fix_empty_rows(p.empty_rows()[:, rows], out, lse, dq)
    q, do = to_numpy(t["q"], rows), to_numpy(t["do"], rows) if grads else None
    kv_head = lambda i: (to_numpy(t["k"][i:i + 1])[0], to_numpy(t["v"][i:i + 1])[0])  # noqa: E731
    ref_out, ref_lse, ref_dq = reference_rows(p, rows, q, do, kv_head)
    errors = {"out": relative_error(out, ref_out)}
    if lse is not None:
        errors["lse"] = relative_error(lse, ref_lse)
    if grads:
        errors["dq"] = relative_error(dq, ref_dq)
    checked = ", ".join(["O"] + (["LSE"] if lse is not None else []) + (["dQ"] if grads else []))
    checked += f": {len(rows)} rows of every head"
    if lse is None:
        checked += f"; no LSE ({lse_note or 'the kernel returned none'})"
    if fixed:
        checked += f"; {fixed} sampled rows with no allowed key set to O=0, LSE=-inf after the run"
    return {"reference": "per-row f64 reference from the mask's slices", "checked": checked,
            "errors": errors}


def base_environment() -> dict:
    env = {"python": platform.python_version()}
    numpy = sys.modules.get("numpy")
    env["numpy"] = getattr(numpy, "__version__", None)
    return env


# ---------------------------------------------------------------------------------------------
# The numpy CPU backend and the runner for numpy kernels

@dataclass
class NumpyKernel:
    forward: Callable              # (q, k, v) -> (out, lse or None); arrays [H, S, D] float32
    backward: Optional[Callable]   # (q, k, v, out, lse, do) -> (dq, dk, dv)
    no_backward: str = ""
    setup: Optional[Callable] = None
    lse_note: Optional[str] = None
    env: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)


def numpy_attention(p: Problem) -> NumpyKernel:
    """Plain numpy attention, one head's S x S scores at a time, float32 accumulation."""
    np = _np()
    blocked: Dict[int, Any] = {}
    distinct = sorted({p.mask_index(h) for h in range(p.heads_q)})
    cache = len(distinct) * p.seqlen * p.seqlen <= NUMPY_MASK_CACHE_BYTES
    kernel = NumpyKernel(forward=None, backward=None,
                         env={"backend": "numpy (float32, one head's scores at a time)"})

    def setup() -> None:
        start = time.perf_counter()
        if cache:
            for index in distinct:
                blocked[index] = ~dense_mask(p.masks[index])
        kernel.phases["mask_build_s"] = time.perf_counter() - start
        kernel.phases["mask_bytes"] = sum(b.nbytes for b in blocked.values())

    def blocked_of(h: int) -> Any:
        index = p.mask_index(h)
        return blocked[index] if index in blocked else ~dense_mask(p.masks[index])

    def scores(q: Any, k: Any, h: int) -> Tuple[Any, Any]:
        s = q[h] @ k[h // p.group].T
        s *= np.float32(p.scale)
        mask = blocked_of(h)
        s[mask] = -np.inf
        return s, mask

    def forward(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        out = np.zeros_like(q)
        lse = np.empty(q.shape[:2], np.float32)
        for h in range(p.heads_q):
            s, _ = scores(q, k, h)
            top = s.max(axis=1)
            top = np.where(np.isfinite(top), top, np.float32(0))
            s -= top[:, None]
            np.exp(s, out=s)
            total = s.sum(axis=1)
            safe = np.where(total > 0, total, np.float32(1))
            out[h] = (s @ v[h // p.group]) / safe[:, None]
            with np.errstate(divide="ignore"):
                lse[h] = np.where(total > 0, top + np.log(safe), -np.inf)
        return out, lse

    def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, do: Any) -> Tuple[Any, Any, Any]:
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for h in range(p.heads_q):
            g = h // p.group
            s, _ = scores(q, k, h)
            s -= np.where(np.isfinite(lse[h]), lse[h], np.float32(0))[:, None]
            probs = np.exp(s, out=s)  # blocked cells were -inf: exactly 0
            dv[g] += probs.T @ do[h]
            delta = (do[h] * out[h]).sum(axis=1)
            ds = probs * ((do[h] @ v[g].T) - delta[:, None])
            ds *= np.float32(p.scale)
            dq[h] = ds @ k[g]
            dk[g] += ds.T @ q[h]
        return dq, dk, dv

    kernel.forward, kernel.backward, kernel.setup = forward, backward, setup
    return kernel


def run_numpy(p: Problem, kernel: NumpyKernel) -> dict:
    import tracemalloc
    _np()  # unsupported, with the reason, when numpy is missing
    if p.backward and kernel.backward is None:
        raise Unsupported(kernel.no_backward or f"{p.kernel} has no backward")
    phases, notes = kernel.phases, []
    start = time.perf_counter()
    inputs = numpy_inputs(p)
    phases["inputs_s"] = time.perf_counter() - start
    if kernel.setup:
        kernel.setup()
    q, k, v, do = inputs["q"], inputs["k"], inputs["v"], inputs.get("do")
    start = time.perf_counter()
    out, lse = kernel.forward(q, k, v)
    phases["first_call_s"] = time.perf_counter() - start
    grads = kernel.backward(q, k, v, out, lse, do) if p.backward else (None, None, None)
    tensors = dict(inputs, out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    correctness = check_or_write(p, tensors, kernel.lse_note, notes)
    del tensors, grads
    steps = {"fwd": lambda: kernel.forward(q, k, v),
             "bwd": lambda: kernel.backward(q, k, v, out, lse, do),
             "fwd_bwd": lambda: kernel.backward(q, k, v, *kernel.forward(q, k, v), do)}
    step = steps[p.direction]
    held = sum(x.nbytes for x in (q, k, v, do, out, lse) if x is not None)
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    memory = {"peak_bytes": held + peak, "above_inputs_bytes": peak,
              "method": "tracemalloc peak around one call (numpy's allocations), plus the inputs "
                        "and saved outputs it was given"}

    def rep() -> float:
        begin = time.perf_counter()
        step()
        return time.perf_counter() - begin

    timing = run_harness(rep, p.harness)
    env = dict(base_environment(), device="cpu", device_name=platform.processor() or platform.machine())
    env.update(kernel.env)
    if notes:
        env["notes"] = notes
    return dict(status="ok", reason=None, memory=memory, correctness=correctness, phases=phases,
                environment=env, **timing)


# ---------------------------------------------------------------------------------------------
# The runner for torch kernels

@dataclass
class Kernel:
    """A torch kernel ready to run: `call(q, k, v) -> (out, lse or None)` on tensors in `layout`
    ("bhsd": [1, H, S, D], "bshd": [1, S, H, D]); out must have q's layout and shape."""
    call: Callable
    layout: str = "bhsd"
    setup: Optional[Callable] = None        # (native inputs) -> None; builds masks, untimed
    grad: Optional[Callable] = None         # (out, q, k, v, do) -> (dq, dk, dv); autograd by default
    out_only: Optional[Callable] = None     # (q, k, v) -> out: the forward without the LSE, as a model
                                            # calls it; timed in place of `call` (see timed_step)
    retry: Optional[Callable] = None        # (error) -> True if it adapted and the call may be retried
    lse_to_heads: Optional[Callable] = None
    out_to_torch: Optional[Callable] = None  # converts a foreign output to a torch tensor
    no_backward: Optional[str] = None       # the reason, when there is no backward
    refusal_is_unsupported: bool = False    # a library refusing on the first call -> unsupported
    extra_bytes: int = 0                    # device memory beyond inputs and outputs (estimate)
    context: Callable = contextlib.nullcontext
    sync: Optional[Callable] = None         # a non-torch stream's synchronize: times by wall clock
    torch_memory: bool = True               # whether torch's allocator sees the kernel's buffers
    compiles: bool = False                  # the first call compiles (JIT): report it as compile_s
    expand_kv: bool = False                 # K and V repeated to every query head before timing
    lse_note: Optional[str] = None
    env: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)


def torch_dtype(torch: Any, name: str) -> Any:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "f32": torch.float32}[name]


def torch_device(p: Problem, torch: Any) -> Any:
    if p.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unsupported(f"CUDA is not available to torch {torch.__version__} (device cuda was asked for)")
    return torch.device("cuda", torch.cuda.current_device())


def require_cuda(p: Problem, device: Any) -> None:
    if device.type != "cuda":
        raise Unsupported(f"{p.kernel} runs on cuda only")


def require_half(p: Problem) -> None:
    if p.dtype == "f32":
        raise Unsupported(f"{p.kernel} runs bf16 and fp16 only")


def make_torch_inputs(p: Problem, torch: Any, device: Any) -> Dict[str, Any]:
    """Canonical [1, H, S, D] inputs in the dtype: read from inputs_dir, or seeded uniform [-1, 1)."""
    dtype = torch_dtype(torch, p.dtype)
    if p.inputs_dir:
        return {n: torch.from_numpy(a)[None].to(device=device, dtype=dtype) for n, a in read_inputs(p).items()}
    generator = torch.Generator(device=device)
    generator.manual_seed(p.seed)
    tensors = {}
    for name in ("q", "k", "v", "do"):
        if name in _wanted(p):
            x = torch.rand((1,) + _tensor_shapes(p)[name], generator=generator, device=device, dtype=torch.float32)
            tensors[name] = x.mul_(2).sub_(1).to(dtype)
    return tensors


def to_layout(x: Any, layout: str, storage: str) -> Any:
    """A canonical [1, H, S, D] tensor as the kernel takes it (`layout`), stored as the stage asks
    (`storage`): a bhsd kernel on bshd storage gets a transposed view, as a model would pass it."""
    if layout == "bshd":
        return x.transpose(1, 2).contiguous()
    if layout == "thd":  # the packed tokens of varlen kernels: [S, H, D], its own leaf for autograd
        return x[0].transpose(0, 1).contiguous()
    return x if storage == "bhsd" else x.transpose(1, 2).contiguous().transpose(1, 2)


def from_layout(x: Any, layout: str) -> Any:
    """Canonical [H, S, D] view of a native [1, ...] tensor."""
    if layout == "thd":
        return x.transpose(0, 1)
    return x[0] if layout == "bhsd" else x[0].transpose(0, 1)


def split_result(result: Any) -> Tuple[Any, Any]:
    """(out, lse or None) from whatever a kernel returns: out, (out, lse, ...), or (out, aux)."""
    if isinstance(result, (tuple, list)):
        out = result[0]
        second = result[1] if len(result) > 1 else None
        return out, getattr(second, "lse", second)
    return result, None


def lse_to_heads(p: Problem, lse: Any) -> Any:
    """LSE as [heads_q, S] from the layouts kernels use, or None when it is something else."""
    if lse is None or not hasattr(lse, "dim"):
        return None
    x = lse.detach()
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if tuple(x.shape) == (p.heads_q, p.seqlen):
        return x
    if tuple(x.shape) == (p.seqlen, p.heads_q):
        return x.t()
    if x.dim() == 2 and x.shape[0] == p.heads_q and x.shape[1] > p.seqlen:
        return x[:, :p.seqlen]  # padded to a block multiple
    return None


def input_bytes(p: Problem) -> int:
    e, qo, kv = ELEMENT_BYTES[p.dtype], p.heads_q * p.seqlen * p.head_dim, p.heads_kv * p.seqlen * p.head_dim
    total = e * (2 * qo + 2 * kv) + 4 * p.heads_q * p.seqlen + 4 * qo  # q, k, v, out, lse, f32 staging
    if p.backward:
        total += e * (2 * qo + 2 * kv)  # dO, dQ, dK, dV
    return total


def l2_flush_bytes(torch: Any, device: Any) -> int:
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (128 << 20)
    return 2 * int(size)


def check_fits(p: Problem, torch: Any, device: Any, kernel: Kernel) -> None:
    free = torch.cuda.mem_get_info(device)[0]
    needed = input_bytes(p) + kernel.extra_bytes + l2_flush_bytes(torch, device)
    if needed > free:
        raise OutOfMemory(f"{p.kernel} needs about {needed / GIB:.2f} GiB ({needed} bytes) for this "
                          f"problem but {free / GIB:.2f} GiB ({free} bytes) is free on {device}")


def torch_environment(torch: Any, device: Any) -> dict:
    env = dict(base_environment(), torch=torch.__version__, device=str(device),
               cuda=getattr(torch.version, "cuda", None))
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        env["cudnn"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        triton = sys.modules.get("triton")
        env["triton"] = getattr(triton, "__version__", None)
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def synchronize(torch: Any, device: Any, kernel: Kernel) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if kernel.sync is not None:
        kernel.sync()


def first_calls(p: Problem, torch: Any, device: Any, kernel: Kernel, q: Any, k: Any, v: Any,
                do: Any) -> Tuple[Any, Any, Any]:
    """The untimed first forward (and backward): compile time, and refusals turned into reasons."""
    def attempt(run: Callable, what: str, phase: str) -> Any:
        while True:
            try:
                synchronize(torch, device, kernel)
                start = time.perf_counter()
                result = run()
                synchronize(torch, device, kernel)
                kernel.phases[phase] = time.perf_counter() - start
                return result
            except (Unsupported, OutOfMemory):
                raise
            except Exception as error:
                if is_oom(error):
                    raise
                if what == "forward" and kernel.retry is not None and kernel.retry(error):
                    continue
                if not kernel.refusal_is_unsupported:
                    raise
                log(f"{p.kernel} refused the {what}:\n{traceback.format_exc()}")
                raise Unsupported(f"{p.kernel} refused the {what}: {type(error).__name__}: {first_line(error)}") from None

    out, lse = attempt(lambda: kernel.call(q, k, v), "forward", "first_call_s")
    grads = None
    if p.backward:
        grads = attempt(lambda: kernel.grad(out, q, k, v, do), "backward", "first_backward_s")
    return out, lse, grads


def ready_kernel(p: Problem, torch: Any, make_kernel: Callable) -> Tuple[Any, Kernel]:
    """The device and p's kernel from its adapter, with autograd as the default backward."""
    if p.kernel in TORCH_ADAPTERS:
        probe(p.kernel)  # "flash_attn not importable" says more than "no CUDA" would
    device = torch_device(p, torch)
    kernel = make_kernel(p, torch, device)
    if p.backward and kernel.no_backward:
        raise Unsupported(kernel.no_backward)
    if kernel.grad is None:
        kernel.grad = lambda out, q, k, v, do: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    if device.type == "cuda":
        check_fits(p, torch, device, kernel)
    return device, kernel


def run_torch(p: Problem, make_kernel: Callable) -> dict:
    torch = need("torch")
    device, kernel = ready_kernel(p, torch, make_kernel)
    with kernel.context():
        return measure_torch(p, torch, device, kernel)


@contextlib.contextmanager
def harness_rep(p: Problem) -> Any:
    """The harness's timed repetition of p's torch kernel, after its first calls, unchecked: for
    timing it side by side with another loop in one process (scripts/peer-plain.py)."""
    torch = need("torch")
    device, kernel = ready_kernel(p, torch, TORCH_ADAPTERS[p.kernel])
    with kernel.context():
        native = native_inputs(p, torch, device, kernel)
        out, _, _ = first_calls(p, torch, device, kernel, native["q"], native["k"], native["v"], native.get("do"))
        yield make_rep(torch, device, kernel, timed_step(p, kernel, native, out if p.direction == "bwd" else None))


def native_inputs(p: Problem, torch: Any, device: Any, kernel: Kernel) -> Dict[str, Any]:
    """The inputs in the kernel's layout, its setup run, q, k and v taking gradients for a backward."""
    start = time.perf_counter()
    inputs = make_torch_inputs(p, torch, device)
    if kernel.expand_kv:  # the model keeps K and V per query head: repeated once, untimed
        inputs.update({n: inputs[n].repeat_interleave(p.group, dim=1) for n in ("k", "v")})
    native = {n: to_layout(x, kernel.layout, p.layout) for n, x in inputs.items()}
    del inputs
    synchronize(torch, device, kernel)
    kernel.phases["inputs_s"] = time.perf_counter() - start
    if kernel.setup:
        kernel.setup(native)
    if p.backward:
        for name in ("q", "k", "v"):
            native[name].requires_grad_(True)
    return native


def timed_step(p: Problem, kernel: Kernel, native: Dict[str, Any], first_out: Any) -> Callable[[], None]:
    """What one timed repetition runs: the forward, the backward of one forward, or both. The
    forward is the one a model calls, without the LSE where the kernel has that (`out_only`): a
    graph with the LSE as an output hands its backward a zero LSE gradient, which FA4 and flex then
    process, up to 13% of a document backward. The LSE is checked from the first call."""
    q, k, v, do = native["q"], native["k"], native["v"], native.get("do")
    forward = kernel.out_only or (lambda q, k, v: kernel.call(q, k, v)[0])
    if p.direction == "fwd":
        return lambda: forward(q, k, v)
    if p.direction == "bwd":
        out = forward(q, k, v) if kernel.out_only else first_out
        return lambda: kernel.grad(out, q, k, v, do)
    return lambda: kernel.grad(forward(q, k, v), q, k, v, do)


def measure_torch(p: Problem, torch: Any, device: Any, kernel: Kernel) -> dict:
    phases, notes, cuda = kernel.phases, [], device.type == "cuda"
    native = native_inputs(p, torch, device, kernel)
    q, k, v, do = native["q"], native["k"], native["v"], native.get("do")
    out, lse, grads = first_calls(p, torch, device, kernel, q, k, v, do)
    if kernel.compiles:
        phases["compile_s"] = phases["first_call_s"]
        if "first_backward_s" in phases:
            phases["compile_bwd_s"] = phases["first_backward_s"]

    canonical = lambda x: from_layout(x, kernel.layout).detach()  # noqa: E731
    tensors = {name: canonical(native[name]) for name in native}
    if kernel.expand_kv:
        tensors.update(k=tensors["k"][::p.group], v=tensors["v"][::p.group])
    tensors["out"] = canonical(kernel.out_to_torch(out) if kernel.out_to_torch else out)
    heads_lse = (kernel.lse_to_heads or (lambda x: lse_to_heads(p, x)))(lse)
    tensors["lse"] = heads_lse.float() if heads_lse is not None else None
    if lse is not None and heads_lse is None:
        notes.append(f"the kernel's LSE has an unexpected shape {tuple(lse.shape)}; not checked")
    if grads is not None:
        tensors.update(dq=canonical(grads[0]), dk=canonical(grads[1]), dv=canonical(grads[2]))
        if kernel.expand_kv:  # a KV head's gradient is the sum over the query heads it serves
            for n in ("dk", "dv"):
                tensors[n] = tensors[n].float().reshape(p.heads_kv, p.group, p.seqlen, p.head_dim).sum(1)
    correctness = check_or_write(p, tensors, kernel.lse_note, notes)
    del tensors, lse, grads, heads_lse
    # only the backward-alone step reuses the first forward's graph
    step = timed_step(p, kernel, native, out if p.direction == "bwd" else None)
    del out

    memory = None
    if cuda and kernel.torch_memory:
        memory = peak_memory(torch, device, step)
    timing = run_harness(make_rep(torch, device, kernel, step), p.harness)
    env = torch_environment(torch, device)
    env.update(kernel.env)
    view = kernel.layout == "bhsd" and p.layout == "bshd"
    env["inputs"] = f"bshd storage, {kernel.layout} view" if view else f"contiguous {kernel.layout}"
    if kernel.out_only:
        env["timed_forward"] = "without the LSE output (the LSE checked from the first call)"
    if cuda and not kernel.torch_memory:
        notes.append("memory not measured: the kernel allocates outside torch's allocator")
    if notes:
        env["notes"] = notes
    return dict(status="ok", reason=None, memory=memory, correctness=correctness, phases=phases,
                environment=env, **timing)


def peak_memory(torch: Any, device: Any, step: Callable) -> dict:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_bytes": int(peak), "above_inputs_bytes": int(peak - base),
            "method": "torch.cuda.max_memory_allocated around one call"}


def make_rep(torch: Any, device: Any, kernel: Kernel, step: Callable) -> Callable[[], float]:
    if device.type != "cuda":
        def cpu_rep() -> float:
            begin = time.perf_counter()
            step()
            return time.perf_counter() - begin
        return cpu_rep
    flush = torch.empty(l2_flush_bytes(torch, device), dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def event_rep() -> float:
        flush.zero_()  # evicts the inputs from L2, outside the timed region
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3

    def wall_rep() -> float:  # for kernels on another framework's stream
        flush.zero_()
        synchronize(torch, device, kernel)
        begin = time.perf_counter()
        step()
        synchronize(torch, device, kernel)
        return time.perf_counter() - begin

    return event_rep if kernel.sync is None else wall_rep


def is_oom(error: BaseException) -> bool:
    names = {cls.__name__ for cls in type(error).__mro__}
    return "OutOfMemoryError" in names or "out of memory" in str(error).lower()


def device_bytes() -> int:
    """Bytes torch holds on the device now (0 without CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return torch.cuda.memory_allocated()


def release_memory(held_before: Optional[int] = None) -> None:
    """Returns the device memory of a finished request, so the next one starts from the same free
    memory. A full garbage collection costs 0.1 s and more once torch and compiled graphs are
    loaded: it runs only when tensors outlived the request (held in reference cycles, as an
    exception's frames hold them), or when the caller cannot tell (`held_before` None)."""
    if held_before is None or device_bytes() > held_before:
        gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Adapters: torch SDPA, FlexAttention, FlashAttention 2/3/4, FlashInfer, FlashMask, user modules

SDPA_BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}


def sdpa_backend(torch: Any, kernel: str) -> Tuple[Any, Any]:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as error:
        raise Unsupported(f"torch.nn.attention.sdpa_kernel not importable: {first_line(error)}") from None
    backend = getattr(SDPBackend, SDPA_BACKENDS[kernel], None)
    if backend is None:
        raise Unsupported(f"torch {torch.__version__} has no SDPBackend.{SDPA_BACKENDS[kernel]}")
    return backend, sdpa_kernel


def sdpa_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    backend, select = sdpa_backend(torch, p.kernel)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    shared = p.shared_mask()
    form = classify(shared) if shared is not None else None
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
        kernel.extra_bytes += 2 * p.heads_q * s * p.head_dim * e * grad_factor

    def setup(native: Dict[str, Any]) -> None:
        if not mask_heads:
            return
        start = time.perf_counter()
        if shared is not None:
            dense = dense_mask(shared, torch, device)
        else:
            distinct = [dense_mask(m, torch, device) for m in p.masks]
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
        raise Unsupported(f"torch.nn.attention.flex_attention not importable: {first_line(error)}") from None
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
    masks = [shared] if shared is not None else p.masks
    indices = [0] if shared is not None else list(range(len(p.masks)))
    single = all((p.intervals(i)[2] <= 1).all() for i in range(len(p.masks)))
    pairs = None if single else [row_interval_pairs(m) for m in masks]
    two = pairs is not None and all(x is not None for x in pairs)
    form = classify(shared) if shared is not None else None
    # Full blocks on flex's block sizes need no mask_mod at all: preferred to any table.
    grid, _ = block_grid(masks) if form is None else (None, "")
    block = next((b for b in FLEX_BLOCKS if grid is not None and all(
        (edges % b == 0).all() for edges in grid[:2])), None)
    # Documents and windows have a closed form, the one flex's documentation writes (a
    # document-id vector and index arithmetic): preferred to any table where no block form is exact.
    closed = varlen_encoding(shared)[0] if shared is not None and form is None and not block else None
    mode = {"full": "none", "causal": "causal"}.get(
        form, "blocks" if block else "documents" if closed is not None else "block table" if grid is not None
        else "row intervals" if single else "two row intervals" if two else "dense")
    s, count = p.seqlen, len(masks)
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
                                  "blocks": f"full {block}-token blocks from the masks' block grid (no mask_mod)",
                                  "block table": f"{FLEX_TILE}-token tiles from the masks' block grid: full inside kept "
                                                 "blocks, mask_mod reading a per-block table where tiles cut blocks",
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
            block_mask, tables = flex_block_table(p, torch, device, flex, grid, head_of)
        elif mode == "causal":
            mask_mod = lambda b, h, q, kv: q >= kv  # noqa: E731
        elif mode == "documents":
            mask_mod, tables = closed_form_mask_mod(closed, torch, device)
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
            bits = torch.stack([pack_bits(torch, dense_mask(m, torch, device)) for m in masks])
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
    """The mask_mod of documents with one window inside each (varlen_encoding's form): a
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
                     head_of: Callable[[Any], Any]) -> Tuple[Any, List[Any]]:
    """A BlockMask over flex's own tiles for a block grid whose edges do not fall on them (blocks
    of 64 tokens, variable blocks), and the tables its mask_mod reads: a tile inside kept blocks
    whole is full (no mask_mod), a tile that cuts blocks is partial and looks each position's
    block up in a per-block table — bytes per block and per position, where a bit table costs
    S²/8 and create_block_mask evaluates S × S."""
    np = _np()
    rows, cols, kept = grid
    s, tile = p.seqlen, FLEX_TILE
    n = -(-s // tile)
    edges = np.minimum(np.arange(n + 1) * tile, s)
    # Each tile's range of grid cells: [first, end) by rows and by columns.
    r0, r1 = np.searchsorted(rows, edges[:-1], side="right") - 1, np.searchsorted(rows, edges[1:], side="left")
    c0, c1 = np.searchsorted(cols, edges[:-1], side="right") - 1, np.searchsorted(cols, edges[1:], side="left")
    # Kept cells per tile from 2-D prefix sums, against the cells it touches.
    prefix = np.zeros((kept.shape[0], kept.shape[1] + 1, kept.shape[2] + 1), np.int64)
    prefix[:, 1:, 1:] = kept.cumsum(1).cumsum(2)
    i0, i1, j0, j1 = r0[:, None], r1[:, None], c0[None, :], c1[None, :]
    count = prefix[:, i1, j1] - prefix[:, i0, j1] - prefix[:, i1, j0] + prefix[:, i0, j0]
    full = count == (i1 - i0) * (j1 - j0)
    partial = (count > 0) & ~full
    heads = [p.mask_index(h) for h in range(p.heads_q)] if len(kept) > 1 else [0]

    def as_lists(chosen: Any) -> Tuple[Any, Any]:
        order = np.argsort(~chosen[heads], axis=-1, kind="stable")  # chosen kv tiles first, in order
        return (torch.from_numpy(chosen[heads].sum(-1)[None].astype(np.int32)).to(device),
                torch.from_numpy(order[None].astype(np.int32)).to(device))

    (counts, indices), (full_counts, full_indices) = as_lists(partial), as_lists(full)
    # Positions past the sequence (the last tile's padding) map to the last cell: flex masks them.
    positions = np.arange(n * tile)
    row_cell = torch.from_numpy((np.searchsorted(rows, positions, side="right") - 1).clip(0, len(rows) - 2)
                                .astype(np.int32)).to(device)
    col_cell = torch.from_numpy((np.searchsorted(cols, positions, side="right") - 1).clip(0, len(cols) - 2)
                                .astype(np.int32)).to(device)
    table = torch.from_numpy(kept).to(device)
    if len(kept) == 1:
        table0 = table[0]
        mask_mod = lambda b, h, q, kv: table0[row_cell[q], col_cell[kv]]  # noqa: E731
    else:
        mask_mod = lambda b, h, q, kv: table[head_of(h), row_cell[q], col_cell[kv]]  # noqa: E731
    block_mask = flex.BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=tile,
                                               mask_mod=mask_mod, seq_lengths=(s, s))
    return block_mask, [row_cell, col_cell, table]


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
    row_cell = np.searchsorted(rows, np.arange(n) * block, side="right") - 1
    col_cell = np.searchsorted(cols, np.arange(n) * block, side="right") - 1
    per_block = kept[:, row_cell][:, :, col_cell]  # [mask, q block, kv block]
    # One pattern for every head (H = 1 broadcasts), or each query head's own.
    heads = [p.mask_index(h) for h in range(p.heads_q)] if len(kept) > 1 else [0]
    chosen = per_block[heads]  # [H, q block, kv block]
    order = np.argsort(~chosen, axis=-1, kind="stable")  # kept kv blocks first, in order
    full_indices = torch.from_numpy(order[None].astype(np.int32)).to(device)
    full_counts = torch.from_numpy(chosen.sum(-1)[None].astype(np.int32)).to(device)
    return flex.BlockMask.from_kv_blocks(torch.zeros_like(full_counts), torch.zeros_like(full_indices),
                                         full_counts, full_indices, BLOCK_SIZE=block, seq_lengths=(p.seqlen, p.seqlen))


FLASH_MODULES = {"fa2": "flash_attn", "fa3": "flash_attn_interface", "fa4": "flash_attn.cute"}


def parameters_of(function: Callable) -> set:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


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
    encoding, why = varlen_encoding(shared)
    if encoding is None:
        raise Unsupported(f"{p.kernel} runs {supports}; {p.pattern} is not expressible that way ({why})")
    return encoding


def flash_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    name = FLASH_MODULES[p.kernel]
    module = need(name)
    dense_call, varlen_call = getattr(module, "flash_attn_func", None), getattr(module, "flash_attn_varlen_func", None)
    if dense_call is None:
        raise Unsupported(f"{name} has no flash_attn_func")
    require_cuda(p, device)
    require_half(p)
    supports = "full, causal, sliding-window and document (varlen) masks"
    if p.kernel == "fa4":
        try:
            plan = flash_plan(p, supports)
        except Unsupported as why:
            grid, _ = block_grid(p.masks)
            if grid is not None and fa4_on_tile_grid(p, grid):
                return fa4_block_sparse(p, torch, device, module, grid)
            return fa4_intervals(p, torch, device, module, str(why))
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


def fa4_on_tile_grid(p: Problem, grid: Tuple[Any, Any, Any]) -> bool:
    """Whether every block edge of the table is on FA4's tile grid (whole tiles need no mask_mod)."""
    np = _np()
    return all(int(e) % FA4_TILE == 0 or int(e) == p.seqlen for e in np.concatenate(grid[:2]))


def fa4_block_lists(p: Problem, torch: Any, device: Any, full: Any, partial: Any) -> Any:
    """FA4's block-sparse tensors from [H, rows, cols] tables of whole and cut tiles (H = 1: one
    table for every head): per row of tiles, the columns of each kind, packed left."""
    np, sparsity = _np(), need("flash_attn.cute.block_sparsity")

    def packed(table: Any) -> Tuple[Any, Any]:
        order = np.argsort(~table, axis=-1, kind="stable").astype(np.int32)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)[None]).to(device)  # noqa: E731
        return to(table.sum(-1).astype(np.int32)), to(order)
    (mask_cnt, mask_idx), (full_cnt, full_idx) = packed(partial), packed(full)
    return sparsity.BlockSparseTensorsTorch(mask_block_cnt=mask_cnt, mask_block_idx=mask_idx,
                                            full_block_cnt=full_cnt, full_block_idx=full_idx,
                                            block_size=(FA4_TILE, FA4_TILE))


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


def fa4_block_sparse(p: Problem, torch: Any, device: Any, module: Any, grid: Tuple[Any, Any, Any]) -> Kernel:
    """FA4 on a block-sparse table of whole tiles: every kept tile is whole (full_block_idx), so
    no mask_mod."""
    np = _np()
    rows, cols, kept = grid
    starts = np.arange(-(-p.seqlen // FA4_TILE)) * FA4_TILE  # the uniform grid, in the table's blocks
    r, c = np.searchsorted(rows, starts, side="right") - 1, np.searchsorted(cols, starts, side="right") - 1
    shared = p.shared_mask() is not None
    per_head = [0] if shared else [p.mask_index(h) for h in range(p.heads_q)]
    dense = kept[per_head][:, r][:, :, c]  # [H or 1, q tiles, kv tiles] on the uniform grid
    none = np.zeros_like(dense)
    options = {"block_sparse_tensors": fa4_block_lists(p, torch, device, dense, none)}
    if p.backward:
        flipped = np.swapaxes(dense, 1, 2)
        options["block_sparse_tensors_bwd"] = fa4_block_lists(p, torch, device, flipped, np.zeros_like(flipped))
    return fa4_kernel(p, module, options, "block_sparse_tensors",
                      f"{int(dense.sum())} of {dense.size} {FA4_TILE}-token tiles, "
                      f"{'one table for every head' if shared else 'a table per query head'}")


def tile_kinds(pairs: Any, s: int) -> Tuple[Any, Any]:
    """[q tiles, kv tiles] booleans (whole, cut) of a mask given as two key intervals a row: a tile
    is whole when every row of it sees all of its keys, cut when some row sees some but not all."""
    np = _np()
    tiles = -(-s // FA4_TILE)
    edges = np.minimum(np.arange(tiles + 1) * FA4_TILE, s)
    seen = np.zeros((s, tiles), np.int64)
    for lo, hi in ((pairs[0], pairs[1]), (pairs[2], pairs[3])):
        seen += np.clip(np.minimum(hi[:, None], edges[1:]) - np.maximum(lo[:, None], edges[:-1]), 0, None)
    pad = tiles * FA4_TILE - s  # rows past the end: neither stop a tile from being whole nor cut it
    whole = np.vstack([seen == edges[1:] - edges[:-1], np.ones((pad, tiles), bool)])
    some = np.vstack([seen > 0, np.zeros((pad, tiles), bool)])
    whole = whole.reshape(tiles, FA4_TILE, tiles).all(1)
    return whole, some.reshape(tiles, FA4_TILE, tiles).any(1) & ~whole


_FA4_MASK_MOD: List[Any] = []


def fa4_interval_mask_mod() -> Any:
    """A CuTe mask_mod keeping the keys in two intervals of the row, read from aux tensors
    [1, H, S] (lo0, hi0, lo1, hi1), as FA4's document-mask example reads document ids. One
    function object per process: FA4 keys its compile cache on the function."""
    if not _FA4_MASK_MOD:
        cutlass, cute = need("cutlass"), need("cutlass.cute")
        to_ssa = need("flash_attn.cute.utils").scalar_to_ssa

        @cute.jit
        def within_two_intervals(batch: Any, head: Any, q_idx: Any, kv_idx: Any, seqlen_info: Any,
                                 aux_tensors: Any) -> Any:
            lo0 = to_ssa(aux_tensors[0][batch[0], head[0], q_idx[0]], cutlass.Int32)
            hi0 = to_ssa(aux_tensors[1][batch[0], head[0], q_idx[0]], cutlass.Int32)
            lo1 = to_ssa(aux_tensors[2][batch[0], head[0], q_idx[0]], cutlass.Int32)
            hi1 = to_ssa(aux_tensors[3][batch[0], head[0], q_idx[0]], cutlass.Int32)
            return ((kv_idx >= lo0) & (kv_idx < hi0)) | ((kv_idx >= lo1) & (kv_idx < hi1))
        _FA4_MASK_MOD.append(within_two_intervals)
    return _FA4_MASK_MOD[0]


def fa4_intervals(p: Problem, torch: Any, device: Any, module: Any, not_varlen: str) -> Kernel:
    """FA4 on any mask of at most two key intervals a row (every static mask of the paper) through
    its mask_mod, with block-sparse tensors from the same intervals: FA4 skips the empty tiles,
    runs whole ones without the mask_mod and applies it only on the tiles the mask cuts."""
    np = _np()
    per_head = [p.mask_index(h) for h in range(p.heads_q)]
    pairs = {i: row_interval_pairs(p.masks[i]) for i in sorted(set(per_head))}
    if any(x is None for x in pairs.values()):
        raise Unsupported(f"{not_varlen}; nor does the mask keep at most two key intervals a row, which the "
                          "bridge's mask_mod for FA4 reads (nor is it a table of whole 128-token blocks)")
    shared = len(pairs) == 1
    # The aux tensors are per query head (FA4 passes the query head's index), [1, H, S] each.
    aux_np = np.stack([pairs[i] for i in per_head], axis=1)[:, None]
    aux = []
    for bound in torch.from_numpy(aux_np.astype(np.int32)).to(device):
        bound = bound.contiguous()
        bound.__leading_dim__ = 2
        aux.append(bound)
    kinds = {i: tile_kinds(x, p.seqlen) for i, x in pairs.items()}
    order = list(pairs) if shared else per_head
    whole, cut = (np.stack([kinds[i][j] for i in order]) for j in (0, 1))
    options = {"mask_mod": fa4_interval_mask_mod(), "aux_tensors": aux,
               "block_sparse_tensors": fa4_block_lists(p, torch, device, whole, cut)}
    if p.backward:
        options["block_sparse_tensors_bwd"] = fa4_block_lists(p, torch, device, np.swapaxes(whole, 1, 2),
                                                              np.swapaxes(cut, 1, 2))
    return fa4_kernel(p, module, options, "mask_mod, aux_tensors, block_sparse_tensors",
                      f"mask_mod reading two key intervals a row; of {whole.size} {FA4_TILE}-token tiles "
                      f"{int(whole.sum())} whole, {int(cut.sum())} cut, "
                      f"{'one table for every head' if shared else 'a table per query head'}")


CUDNN_IO = {"bf16": "BFLOAT16", "fp16": "HALF"}


def cudnn_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    """cuDNN's own fused attention through its frontend's graph API, as cuDNN's samples build it:
    documents as THD ragged tensors (ragged offsets plus per-document lengths and the padding
    mask), windows as the diagonal band, one forward graph and one backward graph built before
    timing and executed on torch's stream."""
    cudnn = need("cudnn", "cudnn (nvidia-cudnn-frontend)")
    require_cuda(p, device)
    require_half(p)
    plan = flash_plan(p, "full, causal, diagonal-band (window) and THD ragged document masks")
    left, right, cu = plan["left"], plan["right"], plan["cu_seqlens"]
    documents, longest, s = len(cu) - 1, plan["max_seqlen"], p.seqlen
    ragged = documents > 1
    # The band in cuDNN's terms: key j is seen by query i when i - j < left_bound and j - i <= right_bound.
    mask: Dict[str, Any] = {}
    if left < 0 and right == 0:
        mask["use_causal_mask"] = True
    else:
        if left >= 0:
            mask["diagonal_band_left_bound"] = left + 1
        if right >= 0:
            mask["diagonal_band_right_bound"] = right
        if mask:
            mask["diagonal_alignment"] = cudnn.diagonal_alignment.TOP_LEFT
    io = getattr(cudnn.data_type, CUDNN_IO[p.dtype])
    f32 = cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    state: Dict[str, Any] = {}
    d = p.head_dim

    def dims(heads: int) -> Tuple[List[int], List[int]]:  # bshd storage seen as b, h, s, d
        batch, rows = (documents, longest) if ragged else (1, s)
        return [batch, heads, rows, d], [rows * heads * d, d, heads * d, 1]

    def graph() -> Any:
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensors(g: Any, binds: Dict[Any, Any], names: Dict[str, int]) -> Dict[str, Any]:
        made = {}
        for name, heads in names.items():
            dim, stride = dims(heads)
            made[name] = g.tensor(name=name, dim=dim, stride=stride, data_type=io)
            if ragged:
                made[name].set_ragged_offset(offset(g, binds, heads))
        return made

    def offset(g: Any, binds: Dict[Any, Any], heads: int) -> Any:
        """The graph's ragged-offset tensor for tensors of `heads` heads (elements, not tokens)."""
        key = ("offset", heads)
        if key not in binds:
            binds[key] = g.tensor(name=f"offset_{heads}", dim=[documents + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                  data_type=cudnn.data_type.INT64)
            binds[binds[key]] = state["offsets"][heads]
        return binds[key]

    def lengths(g: Any, binds: Dict[Any, Any]) -> Dict[str, Any]:
        if not ragged:
            return {}
        t = g.tensor(name="seq_len", dim=[documents, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        binds[t] = state["lengths"]
        return {"use_padding_mask": True, "seq_len_q": t, "seq_len_kv": t}

    def build(g: Any, what: str) -> Any:
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as error:
            log(f"cudnn refused the {what} graph:\n{traceback.format_exc()}")
            raise Unsupported(f"cudnn {cudnn.backend_version_string()} refused the {what} graph for "
                              f"{p.pattern}: {type(error).__name__}: {first_line(error)}") from None
        return torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=device)

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        bounds = torch.tensor(cu, dtype=torch.int64, device=device)
        state["lengths"] = (bounds[1:] - bounds[:-1]).to(torch.int32).reshape(-1, 1, 1, 1)
        state["offsets"] = {h: (bounds * h * d).reshape(-1, 1, 1, 1) for h in {p.heads_q, p.heads_kv}}
        fwd, binds = graph(), {}
        t = tensors(fwd, binds, {"q": p.heads_q, "k": p.heads_kv, "v": p.heads_kv})
        o, stats = fwd.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                            attn_scale=p.scale, **mask, **lengths(fwd, binds))
        o_dim, o_stride = dims(p.heads_q)
        o.set_output(True).set_dim(o_dim).set_stride(o_stride)
        if ragged:
            o.set_ragged_offset(offset(fwd, binds, p.heads_q))
        stats.set_output(True).set_data_type(f32)
        state["fwd"] = (fwd, t, o, stats, build(fwd, "forward"), binds)
        batch, rows = o_dim[0], o_dim[2]
        state["stats"] = torch.empty(batch, p.heads_q, rows, 1, dtype=torch.float32, device=device)
        if ragged:  # token t of document b is row t - cu[b] of batch b
            doc = torch.repeat_interleave(torch.arange(documents, device=device), state["lengths"].flatten())
            state["gather"] = (doc, torch.arange(s, device=device) - bounds[:-1][doc])
        if p.backward:
            bwd, binds = graph(), {}
            t = tensors(bwd, binds, {"q": p.heads_q, "k": p.heads_kv, "v": p.heads_kv, "o": p.heads_q, "dO": p.heads_q})
            stats_in = bwd.tensor(name="stats", dim=list(state["stats"].shape),
                                  stride=list(state["stats"].stride()), data_type=f32)
            extra = {"max_total_seq_len_q": s, "max_total_seq_len_kv": s} if ragged else {}
            dq, dk, dv = bwd.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"],
                                           dO=t["dO"], stats=stats_in, attn_scale=p.scale,
                                           **mask, **lengths(bwd, binds), **extra)
            for grad, heads in ((dq, p.heads_q), (dk, p.heads_kv), (dv, p.heads_kv)):
                dim, stride = dims(heads)
                grad.set_output(True).set_dim(dim).set_stride(stride)
                if ragged:
                    grad.set_ragged_offset(offset(bwd, binds, heads))
            state["bwd"] = (bwd, t, stats_in, (dq, dk, dv), build(bwd, "backward"), binds)
        kernel.phases["mask_build_s"] = time.perf_counter() - start

    def execute(g: Any, pack: Dict[Any, Any], workspace: Any, binds: Dict[Any, Any]) -> None:
        pack.update((t, x) for t, x in binds.items() if not isinstance(t, tuple))
        g.execute(pack, workspace, handle=handle)

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        g, t, o, stats, workspace, binds = state["fwd"]
        out = torch.empty_like(q)
        execute(g, {t["q"]: q, t["k"]: k, t["v"]: v, o: out, stats: state["stats"]}, workspace, binds)
        return out, state["stats"]

    def grad(out: Any, q: Any, k: Any, v: Any, do: Any) -> Tuple[Any, Any, Any]:
        g, t, stats_in, outputs, workspace, binds = state["bwd"]
        grads = [torch.empty_like(x) for x in (q, k, v)]
        pack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: out, t["dO"]: do, stats_in: state["stats"]}
        pack.update(zip(outputs, grads))
        execute(g, pack, workspace, binds)
        return tuple(grads)

    def heads(stats: Any) -> Any:  # [batch, H, rows, 1] -> [H, S]
        if not ragged:
            return stats[0, :, :, 0]
        doc, row = state["gather"]
        return stats[doc, :, row, 0].t()

    kernel = Kernel(call=call, grad=grad, setup=setup, layout="bshd", lse_to_heads=heads,
                    refusal_is_unsupported=True, extra_bytes=4 * p.heads_q * documents * longest,
                    env={"backend": "cudnn.pygraph sdpa" + (" / sdpa_backward" if p.backward else ""),
                         "package_version": _package_version(cudnn, "nvidia-cudnn-frontend"),
                         "cudnn_backend": cudnn.backend_version_string()})
    kernel.phases["mask_mode"] = (f"{documents} documents (THD ragged, padding mask), " if ragged else "") + \
        ("causal" if mask.get("use_causal_mask") else
         f"band left {mask.get('diagonal_band_left_bound')} right {mask.get('diagonal_band_right_bound')}"
         if "diagonal_alignment" in mask else "full")
    return kernel


def flashinfer_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    flashinfer = need("flashinfer")
    require_cuda(p, device)
    require_half(p)
    if p.backward:
        raise Unsupported("flashinfer has no backward (its prefill kernels are forward only)")
    supports = "full, causal and causal sliding-window masks, on one sequence or on documents"
    try:
        plan = flash_plan(p, supports)
        left, right = plan["left"], plan["right"]
        dense = right == 0 or (left < 0 and right < 0)
    except Unsupported:
        dense = False
    if not dense:
        grid, why = block_grid(p.masks)
        if grid is None:
            raise Unsupported(f"flashinfer runs {supports} (single_prefill_with_kv_cache, "
                              f"BatchPrefillWithRaggedKVCacheWrapper) and block-sparse masks "
                              f"(VariableBlockSparseAttentionWrapper); {p.pattern} is neither: {why}")
        return flashinfer_block_sparse(p, torch, device, flashinfer, grid)
    if len(plan["cu_seqlens"]) > 2:
        return flashinfer_documents(p, torch, device, flashinfer, plan)
    function = flashinfer.single_prefill_with_kv_cache
    options: Dict[str, Any] = {"causal": right == 0, "kv_layout": "NHD", "sm_scale": p.scale}
    if left >= 0:
        options["window_left"] = left
    if "return_lse" in parameters_of(function):
        options["return_lse"] = True
    elif hasattr(flashinfer, "single_prefill_with_kv_cache_return_lse"):
        function = flashinfer.single_prefill_with_kv_cache_return_lse

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        out, lse = split_result(function(q[0], k[0], v[0], **options))
        return out.unsqueeze(0), lse

    def heads(lse: Any) -> Any:  # [S, H] in log base 2 -> [H, S] natural log
        return None if lse is None else lse.detach().float().t() * math.log(2.0)

    without_lse = {key: value for key, value in options.items() if key != "return_lse"}

    def out_only(q: Any, k: Any, v: Any) -> Any:
        return flashinfer.single_prefill_with_kv_cache(q[0], k[0], v[0], **without_lse).unsqueeze(0)

    return Kernel(call=call, out_only=out_only, layout="bshd", lse_to_heads=heads, refusal_is_unsupported=True, compiles=True,
                  env={"backend": f"flashinfer.{function.__name__}", "package_version": flashinfer.__version__},
                  phases={"mask_mode": ("causal" if right == 0 else "full") + (f", window_left {left}" if left >= 0 else ""),
                          "lse": "converted from log2"})


def flashinfer_wrapper_calls(state: Dict[str, Any]) -> Tuple[Callable, Callable]:
    """(call, out_only) of a planned FlashInfer wrapper in state["wrapper"], on bshd inputs."""
    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        out, lse = state["wrapper"].run(q[0], k[0], v[0], return_lse=True)
        return out.unsqueeze(0), lse

    def out_only(q: Any, k: Any, v: Any) -> Any:
        return state["wrapper"].run(q[0], k[0], v[0]).unsqueeze(0)
    return call, out_only


def flashinfer_documents(p: Problem, torch: Any, device: Any, flashinfer: Any, plan: dict) -> Kernel:
    """Documents as FlashInfer batches them: one ragged batch, a request per document
    (qo_indptr = kv_indptr = the document bounds), planned once before timing."""
    wrapper_class = getattr(flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", None)
    if wrapper_class is None:
        raise Unsupported(f"flashinfer {flashinfer.__version__} has no BatchPrefillWithRaggedKVCacheWrapper")
    left, right, documents = plan["left"], plan["right"], len(plan["cu_seqlens"]) - 1
    state = {}

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        bounds = torch.tensor(plan["cu_seqlens"], dtype=torch.int32, device=device)
        state["wrapper"] = wrapper = wrapper_class(torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD")
        wrapper.plan(bounds, bounds, p.heads_q, p.heads_kv, p.head_dim, causal=right == 0, window_left=left,
                     sm_scale=p.scale, q_data_type=torch_dtype(torch, p.dtype))
        synchronize(torch, device, kernel)
        kernel.phases["mask_build_s"] = time.perf_counter() - start


    call, out_only = flashinfer_wrapper_calls(state)
    kernel = Kernel(call=call, out_only=out_only, setup=setup, layout="bshd", refusal_is_unsupported=True,
                    compiles=True, lse_to_heads=lambda lse: lse.detach().float().t() * math.log(2.0),
                    env={"backend": "flashinfer.BatchPrefillWithRaggedKVCacheWrapper",
                         "package_version": flashinfer.__version__},
                    phases={"mask_mode": f"{documents} documents (indptr), " +
                            ("causal" if right == 0 else "full") + (f", window_left {left}" if left >= 0 else ""),
                            "lse": "converted from log2"})
    return kernel


def flashinfer_block_sparse(p: Problem, torch: Any, device: Any, flashinfer: Any, grid: Tuple[Any, Any, Any]) -> Kernel:
    """FlashInfer's variable block-sparse prefill on the masks' block grid: one pattern per KV
    head, so the query heads of a group must share their mask."""
    wrapper_class = getattr(flashinfer, "VariableBlockSparseAttentionWrapper", None)
    if wrapper_class is None:
        raise Unsupported(f"flashinfer {flashinfer.__version__} has no VariableBlockSparseAttentionWrapper")
    np = _np()
    rows, cols, kept = grid
    of_kv = [p.mask_index(kv * p.group) for kv in range(p.heads_kv)]
    if any(p.mask_index(h) != of_kv[h // p.group] for h in range(p.heads_q)):
        raise Unsupported("flashinfer's block-sparse wrapper takes one pattern per KV head; "
                          f"{p.pattern} gives the query heads of a group different masks")
    state = {}

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        as_int = lambda edges: torch.tensor(np.diff(edges), dtype=torch.int32, device=device)  # noqa: E731
        state["wrapper"] = wrapper = wrapper_class(torch.empty(128 << 20, dtype=torch.uint8, device=device))
        wrapper.plan(torch.from_numpy(kept[of_kv]).to(device),
                     as_int(rows)[None].repeat(p.heads_kv, 1), as_int(cols)[None].repeat(p.heads_kv, 1),
                     p.heads_q, p.heads_kv, p.head_dim, causal=False, sm_scale=p.scale,
                     q_data_type=torch_dtype(torch, p.dtype))
        synchronize(torch, device, kernel)
        kernel.phases.update(mask_build_s=time.perf_counter() - start, blocks=[len(rows) - 1, len(cols) - 1],
                             kept_blocks=int(kept[of_kv].sum()))


    call, out_only = flashinfer_wrapper_calls(state)
    kernel = Kernel(call=call, out_only=out_only, setup=setup, refusal_is_unsupported=True, compiles=True,
                    lse_to_heads=lambda lse: lse.detach().float() * math.log(2.0),
                    env={"backend": "flashinfer.VariableBlockSparseAttentionWrapper",
                         "package_version": flashinfer.__version__},
                    phases={"mask_mode": "block grid from the slices", "lse": "converted from log2"})
    return kernel


def flashmask_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    paddle = need("paddle")
    function = getattr(paddle.nn.functional, "flashmask_attention", None)
    if function is None:
        raise Unsupported(f"paddle {paddle.__version__} has no nn.functional.flashmask_attention")
    require_cuda(p, device)
    require_half(p)
    if p.backward:
        raise Unsupported("the bridge runs flashmask forward only (its backward lives in paddle's autograd)")
    shared = p.shared_mask()
    if shared is None:
        raise Unsupported(f"flashmask runs one mask for every head here; {p.pattern} has masks that differ")
    columns, why = flashmask_columns(shared)
    if columns is None:
        raise Unsupported(f"flashmask takes column bounds; {p.pattern} is not expressible that way ({why})")
    np, dlpack = _np(), importlib.import_module("torch.utils.dlpack")
    to_paddle = lambda t: paddle.utils.dlpack.from_dlpack(dlpack.to_dlpack(t))  # noqa: E731
    to_torch = lambda t: dlpack.from_dlpack(paddle.utils.dlpack.to_dlpack(t))  # noqa: E731
    options: Dict[str, Any] = {"causal": columns["causal"]}
    if "return_softmax_lse" in parameters_of(function):
        options["return_softmax_lse"] = True
    state: Dict[str, Any] = {}

    def setup(native: Dict[str, Any]) -> None:
        bounds = np.stack(columns["columns"], axis=-1)[None, None].astype(np.int32)  # [1, 1, S, 2 or 4]
        state["inputs"] = [to_paddle(native[n]) for n in ("q", "k", "v")]
        options["startend_row_indices"] = to_paddle(torch.from_numpy(bounds).to(device))

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        return split_result(function(*state["inputs"], **options))

    def heads(lse: Any) -> Any:
        return None if lse is None else lse_to_heads(p, to_torch(lse))

    return Kernel(call=call, layout="bshd", setup=setup, lse_to_heads=heads, out_to_torch=to_torch,
                  refusal_is_unsupported=True, sync=paddle.device.synchronize, torch_memory=False,
                  env={"backend": "paddle.nn.functional.flashmask_attention", "paddle": paddle.__version__},
                  phases={"mask_mode": f"{'causal + ' if columns['causal'] else ''}{len(columns['columns'])} column bounds"})


def load_user_module(path: str) -> Any:
    if not os.path.isfile(path):
        raise BadRequest(f"module {path!r} is not a file")
    name = f"attnbench_user_kernel_{abs(hash((path, time.time())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadRequest(f"module {path!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise Unsupported(f"{os.path.basename(path)} not importable: {first_line(error)}") from None
    finally:
        sys.modules.pop(name, None)
    if not callable(getattr(module, "attention", None)):
        raise BadRequest(f"{path} defines no attention(q, k, v, mask, scale) function")
    return module


def user_mask(p: Problem, module: Any, build: Callable) -> dict:
    shared = p.shared_mask()
    slices = None if shared is None else [(sl["q"][0], sl["q"][1], sl["k"][0], sl["k"][1], sl["kind"])
                                          for sl in shared["slices"]]
    dense = None
    if shared is not None and p.seqlen <= DENSE_FOR_MODULES_MAX_SEQLEN and getattr(module, "DENSE_MASK", True):
        dense = build(shared)
    return {"dense": dense, "slices": slices, "set": p.mask_set}


def run_module(p: Problem) -> dict:
    module = load_user_module(p.module)
    supports = getattr(module, "SUPPORTS", None)
    if callable(supports):
        reason = supports(p.mask_set)
        if reason:
            raise Unsupported(str(reason))
    label = {"backend": f"module {os.path.basename(p.module)}", "module": p.module}
    if getattr(module, "BACKEND", "torch") == "numpy":
        return run_numpy(p, numpy_module_kernel(p, module, label))
    return run_torch(p, lambda p, torch, device: torch_module_kernel(p, torch, device, module, label))


def numpy_module_kernel(p: Problem, module: Any, label: dict) -> NumpyKernel:
    kernel = NumpyKernel(forward=None, backward=None, env=label,
                         no_backward=f"{os.path.basename(p.module)} defines no attention_backward")
    mask: Dict[str, Any] = {}

    def setup() -> None:
        start = time.perf_counter()
        mask.update(user_mask(p, module, dense_mask))
        kernel.phases["mask_build_s"] = time.perf_counter() - start

    kernel.setup = setup
    kernel.forward = lambda q, k, v: split_result(module.attention(q, k, v, mask, p.scale))
    backward = getattr(module, "attention_backward", None)
    if callable(backward):
        kernel.backward = lambda q, k, v, out, lse, do: tuple(backward(q, k, v, out, lse, do, mask, p.scale))
    return kernel


def torch_module_kernel(p: Problem, torch: Any, device: Any, module: Any, label: dict) -> Kernel:
    mask: Dict[str, Any] = {}
    kernel = Kernel(call=lambda q, k, v: split_result(module.attention(q, k, v, mask, p.scale)), env=label)

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        mask.update(user_mask(p, module, lambda m: dense_mask(m, torch, device)))
        synchronize(torch, device, kernel)
        kernel.phases["mask_build_s"] = time.perf_counter() - start

    def grad(out: Any, q: Any, k: Any, v: Any, do: Any) -> Any:
        if not getattr(out, "requires_grad", False):
            raise Unsupported(f"{os.path.basename(p.module)}'s output carries no autograd graph, so it has no backward")
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    kernel.setup, kernel.grad = setup, grad
    return kernel


TORCH_ADAPTERS = {"sdpa-math": sdpa_adapter, "sdpa-flash": sdpa_adapter, "sdpa-efficient": sdpa_adapter,
                  "sdpa-cudnn": sdpa_adapter, "flex": flex_adapter, "fa2": flash_adapter,
                  "fa3": flash_adapter, "fa4": flash_adapter, "cudnn": cudnn_adapter,
                  "flashinfer": flashinfer_adapter,
                  "flashmask": flashmask_adapter}


# ---------------------------------------------------------------------------------------------
# Operations

def outcome(status: str, reason: str, p: Problem) -> dict:
    env = base_environment()
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return {"status": status, "reason": reason, "samples": [], "rel_ci": None, "stopped": None,
            "memory": None, "correctness": None, "phases": {}, "environment": env}


def benchmark(params: Any) -> dict:
    p = parse_problem(params)
    log(f"benchmark {p.kernel} {p.direction} {p.dtype} {p.pattern} "
        f"hq={p.heads_q} hkv={p.heads_kv} s={p.seqlen} d={p.head_dim} on {p.device}")
    result, held_before = None, device_bytes()
    try:
        if p.gqa == "expand" and p.group > 1 and p.kernel not in SDPA_BACKENDS:
            raise Unsupported(f"gqa: expand applies to the SDPA kernels; {p.kernel} takes grouped K and V as they are")
        if p.kernel == "numpy":
            result = run_numpy(p, numpy_attention(p))
        elif p.kernel == "module":
            result = run_module(p)
        else:
            result = run_torch(p, TORCH_ADAPTERS[p.kernel])
    except Unsupported as error:
        result = outcome("unsupported", str(error), p)
    except OutOfMemory as error:
        result = outcome("oom", str(error), p)
    except Exception as error:
        if not is_oom(error):
            raise
        result = outcome("oom", f"{p.kernel} ran out of device memory: {first_line(error)}", p)
    release_memory(held_before)  # the exception (and the tensors its frames held) is gone by now
    return result


def _package_version(module: Any, *distributions: str) -> Optional[str]:
    """The module's version, from its installed distribution where its `__version__` is missing
    or a placeholder (`flash_attn.cute` says 0.0.0 in flash-attn-4 4.0.0b36)."""
    version = getattr(module, "__version__", None)
    if version is None or str(version) == "0.0.0":
        from importlib import metadata
        for dist in distributions:
            try:
                return metadata.version(dist)
            except Exception:
                continue
    return None if version is None else str(version)


def probe(kernel: str) -> Optional[str]:
    """The version of what runs `kernel`; raises Unsupported with the reason when it cannot run."""
    if kernel == "numpy":
        return _np().__version__
    if kernel == "module":
        return None
    if kernel == "fa3":
        return _package_version(need("flash_attn_interface"), "flash_attn_3", "flash-attn-3")
    if kernel == "fa4":
        return _package_version(need("flash_attn.cute"), "flash-attn-4", "fa4")
    if kernel == "cudnn":
        cudnn = need("cudnn", "cudnn (nvidia-cudnn-frontend)")
        if not hasattr(cudnn, "pygraph"):
            raise Unsupported("the cudnn module has no pygraph (nvidia-cudnn-frontend provides it)")
        return _package_version(cudnn, "nvidia-cudnn-frontend")
    if kernel == "flashinfer":
        return _package_version(need("flashinfer"), "flashinfer-python", "flashinfer")
    if kernel == "flashmask":
        paddle = need("paddle")
        if not hasattr(paddle.nn.functional, "flashmask_attention"):
            raise Unsupported(f"paddle {paddle.__version__} has no nn.functional.flashmask_attention")
        return paddle.__version__
    if kernel == "fa2":
        flash_attn = need("flash_attn")
        if not hasattr(flash_attn, "flash_attn_func"):
            raise Unsupported("flash_attn has no flash_attn_func (an FA2 install provides it)")
        return _package_version(flash_attn, "flash_attn", "flash-attn")
    torch = need("torch")
    if kernel == "flex":
        need("torch.nn.attention.flex_attention")
    else:
        sdpa_backend(torch, kernel)
    return torch.__version__


def backends(params: Any) -> dict:
    report = {}
    for kernel in KERNELS:
        try:
            report[kernel] = {"available": True, "version": probe(kernel), "reason": None}
        except Unsupported as error:
            report[kernel] = {"available": False, "version": None, "reason": str(error)}
    return report


OPS = {"backends": backends, "benchmark": benchmark}


def plain(value: Any) -> Any:
    """JSON-ready copy: numpy scalars to Python, non-finite floats to null."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def handle(line: str) -> Tuple[dict, bool]:
    """The response to one request line, and whether to stop afterwards."""
    try:
        request = json.loads(line)
    except ValueError as error:
        return {"id": None, "ok": False, "error": f"malformed request: the line is not JSON ({error})"}, False
    if not isinstance(request, dict):
        return {"id": None, "ok": False, "error": "malformed request: expected a JSON object with id and op"}, False
    rid, op = request.get("id"), request.get("op")
    if op == "shutdown":
        return {"id": rid, "ok": True, "result": None}, True
    if op not in OPS:
        return {"id": rid, "ok": False,
                "error": f"unknown op {op!r}; the bridge knows backends, benchmark and shutdown"}, False
    params = request.get("params") or {}
    try:
        return {"id": rid, "ok": True, "result": OPS[op](params)}, False
    except BadRequest as error:
        reply = {"id": rid, "ok": False, "error": f"bad {op} request: {error}"}
    except (Exception, SystemExit) as error:
        trace = traceback.format_exc()
        log(trace)
        who = params.get("kernel", op) if isinstance(params, dict) else op
        reply = {"id": rid, "ok": False, "error": f"{who} raised {type(error).__name__}: {first_line(error)}",
                 "traceback": trace}
    release_memory()
    return reply, False


def serve() -> int:
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything written to fd 1 from now on (C libraries included) lands on stderr
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(plain(message), allow_nan=False, separators=(",", ":")) + "\n")
        protocol.flush()

    send({"type": "hello", "protocol": PROTOCOL, "python": platform.python_version(),
          "executable": sys.executable, "pid": os.getpid()})
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        reply, stop = handle(line)
        send(reply)
        if stop:
            return 0


if __name__ == "__main__":
    sys.exit(serve())
