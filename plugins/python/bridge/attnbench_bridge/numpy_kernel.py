"""The numpy backend: attention on the CPU, forward and backward, any mask."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from .problem import Problem
from .support import _np


NUMPY_MASK_CACHE_BYTES = 1 << 30


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
                blocked[index] = ~p.dense(index)
        kernel.phases["mask_build_s"] = time.perf_counter() - start
        kernel.phases["mask_bytes"] = sum(b.nbytes for b in blocked.values())

    def blocked_of(h: int) -> Any:
        index = p.mask_index(h)
        return blocked[index] if index in blocked else ~p.dense(index)

    def scores(q: Any, k: Any, h: int) -> Tuple[Any, Any]:
        s = q[h] @ k[h // p.group].T
        s *= np.float32(p.scale)
        mask = blocked_of(h)
        s[mask] = -np.inf
        return s, mask

    def forward(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        out = np.zeros(q.shape[:2] + v.shape[2:], np.float32)
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
