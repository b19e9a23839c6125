"""One benchmark request as the bridge reads it: the kernel, direction, shape and mask set (the
timing harness is the host's: see `harness.run_harness`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from .encodings import RowGroups, block_grid_of, dense_mask, row_groups_of, row_intervals
from .support import ELEMENT_BYTES, BadRequest, _np


KERNELS = ("numpy", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex",
           "fa2", "fa3", "fa4", "cudnn", "flashinfer", "flashmask", "module")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
LAYOUTS = ("auto", "bshd", "bhsd")  # how inputs are stored; see to_layout and documented_layout
GQA_MODES = ("native", "expand")  # how SDPA gets grouped K and V; see sdpa_adapter


class Heads:
    """What a problem's heads give: query heads per KV head, and the softmax scale 1/√d. Mixed
    into the dataclasses that hold these three fields (a prefill `Problem`, a decode `Step`)."""
    heads_q: int
    heads_kv: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def value_dim(self) -> int:
        """V's and O's head dim: head_dim_v where the problem has one, else head_dim."""
        return getattr(self, "head_dim_v", None) or self.head_dim


@dataclass
class Problem(Heads):
    kernel: str
    direction: str
    heads_q: int
    heads_kv: int
    seqlen: int
    head_dim: int
    dtype: str
    mask_set: dict
    seed: int                               # for inputs drawn here (scripts/peer-plain.py); a cell reads the host's
    device: str
    module: Optional[str]
    layout: str = "bshd"
    gqa: str = "native"
    head_dim_v: Optional[int] = None        # V's (and O's) head dim where it differs from Q's and K's
    encodings: Optional[dict] = None        # the host's encodings of the masks (see `row_groups`, `varlen`)
    _groups: dict = field(default_factory=dict, repr=False)
    _intervals: dict = field(default_factory=dict, repr=False)

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

    def _encoding(self, name: str) -> dict:
        """The host's `name` encoding of the shared mask: {"encoding": ...} or {"refused": why}."""
        found = (self.encodings or {}).get(name)
        if not isinstance(found, dict):
            raise BadRequest(f"params.encodings.{name} is missing: the host sends the mask IR's encodings "
                             "with every request")
        return found

    def varlen(self) -> Tuple[Optional[dict], str]:
        """The shared mask as documents with one window inside each, as FlashAttention's varlen
        entry points take it (the IR's `Mask::varlen`): within a document, q sees k when
        q - k <= left and k - q <= right (-1 = unbounded). (encoding, "") or (None, why not)."""
        found = self._encoding("varlen")
        return found.get("encoding"), found.get("refused") or ""

    def form(self) -> Optional[str]:
        """'full' or 'causal' when the shared mask is exactly that: one document, no left bound,
        and no right bound (full) or none past the diagonal (causal)."""
        encoding = self.varlen()[0] if self.shared_mask() is not None else None
        if encoding is None or encoding["cu_seqlens"] != [0, self.seqlen] or encoding["left"] != -1:
            return None
        return {-1: "full", 0: "causal"}.get(encoding["right"])

    def flashmask(self) -> Tuple[Optional[dict], str]:
        """The shared mask as FlashMask's column bounds (the IR's `Mask::flashmask`): per key,
        masked rows [LTS, LTE) and, without the causal flag, [UTS, UTE) too. ({"causal",
        "columns"}, "") or (None, why not)."""
        found = self._encoding("flashmask")
        encoding = found.get("encoding")
        if encoding is None:
            return None, found.get("refused") or ""
        names = ("lts", "lte") if encoding["causal"] else ("lts", "lte", "uts", "ute")
        np = _np()
        return {"causal": encoding["causal"], "columns": [np.asarray(encoding[n], np.int32) for n in names]}, ""

    def row_groups(self, index: int) -> RowGroups:
        """Mask `index`'s allowed keys by groups of rows, from the host's row runs."""
        if index not in self._groups:
            self._groups[index] = row_groups_of(self.encodings["rows"][index])
        return self._groups[index]

    def intervals(self, index: int) -> Tuple[Any, Any, Any]:
        """Mask `index`'s per-row hulls and interval counts (`row_intervals`)."""
        if index not in self._intervals:
            self._intervals[index] = row_intervals(self.row_groups(index))
        return self._intervals[index]

    def dense(self, index: int, torch: Any = None, device: Any = None) -> Any:
        """Mask `index` as a dense boolean [S, S] (`dense_mask`)."""
        return dense_mask(self.row_groups(index), self.seqlen, torch, device)

    def block_grid(self, masks: Optional[List[int]] = None) -> Tuple[Optional[Tuple[Any, Any, Any]], str]:
        """The masks of these indices (all by default) on the host's shared grid of blocks, as
        block-sparse kernels take them: ((row edges, column edges, kept[mask, row block, column
        block]), "") or (None, why not)."""
        found = self._encoding("grid")
        if found.get("encoding") is None:
            return None, found.get("refused") or ""
        return block_grid_of(found["encoding"], masks), ""

    def empty_rows(self) -> Any:
        """[heads_q, S] booleans: rows with no allowed key."""
        np = _np()
        return np.stack([self.intervals(self.mask_index(h))[2] == 0 for h in range(self.heads_q)])


def _int(params: dict, key: str, where: str = "params") -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadRequest(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def documented_layout(kernel: str) -> str:
    """The storage `layout: auto` picks: FlexAttention's documentation passes contiguous
    [B, H, S, D] tensors, and its backward is slower on transposed views of [B, S, H, D];
    FlashInfer's variable block-sparse wrapper takes contiguous [H, S, D]. Every other kernel gets
    [1, S, H, D] storage, as a model's projections produce it (the kernels that take [S, H, D] or
    [1, S, H, D], FlashInfer's other paths among them, get it contiguous either way)."""
    return "bhsd" if kernel in ("flex", "flashinfer") else "bshd"


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
    head_dim_v = _int(shape, "head_dim_v", "shape") if shape.get("head_dim_v") is not None else None
    device = "cpu" if kernel == "numpy" else params.get("device") or "cuda"
    if device not in ("cuda", "cpu"):
        raise BadRequest(f"device must be cuda or cpu, got {device!r}")
    layout = params.get("layout") or "auto"
    if layout not in LAYOUTS:
        raise BadRequest(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "auto":
        layout = documented_layout(kernel)
    gqa = params.get("gqa") or "native"
    if gqa not in GQA_MODES:
        raise BadRequest(f"gqa must be one of {', '.join(GQA_MODES)}, got {gqa!r}")
    if kernel == "module" and not params.get("module"):
        raise BadRequest("kernel module needs params.module, the path of the kernel's .py file")
    problem = Problem(kernel, direction, hq, hkv, seqlen, head_dim, dtype, params.get("mask"),
                      int(params.get("seed") if params.get("seed") is not None else 42),
                      device, params.get("module"), layout, gqa, head_dim_v, params.get("encodings"))
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
    rows = (p.encodings or {}).get("rows")
    if not isinstance(rows, list) or len(rows) != expected:
        raise BadRequest(f"params.encodings.rows must list the row runs of each of the {expected} masks: "
                         "the host sends the mask IR's encodings with every request")
