"""The files a benchmark cell exchanges with the host: the inputs it drew (in the cell's element
type) and the outputs it checks (f32, canonical layouts).
"""

from __future__ import annotations

import math
import os
import platform
import sys
from typing import Any, Dict, List, Tuple

from .problem import Problem
from .support import BadRequest, _np


# How the host stores an input of each dtype: its bits, little-endian (bf16 read as uint16).
STORAGE = {"bf16": "<u2", "fp16": "<f2", "f32": "<f4"}


def _tensor_shapes(p: Problem) -> Dict[str, Tuple[int, int, int]]:
    return {"q": (p.heads_q, p.seqlen, p.head_dim), "k": (p.heads_kv, p.seqlen, p.head_dim),
            "v": (p.heads_kv, p.seqlen, p.value_dim), "do": (p.heads_q, p.seqlen, p.value_dim)}


def _wanted(p: Problem) -> List[str]:
    return ["q", "k", "v"] + (["do"] if p.backward else [])


def read_inputs(p: Problem, inputs_dir: str) -> Dict[str, Any]:
    """The host's inputs as [H, S, D] arrays in their storage type (`q.bf16`, ...)."""
    np = _np()
    arrays = {}
    for name in _wanted(p):
        shape = _tensor_shapes(p)[name]
        path = os.path.join(inputs_dir, f"{name}.{p.dtype}")
        if not os.path.isfile(path):
            raise BadRequest(f"inputs_dir has no {name}.{p.dtype}")
        data = np.fromfile(path, dtype=STORAGE[p.dtype])
        if data.size != math.prod(shape):
            raise BadRequest(f"{path} holds {data.size} values; the shape needs {math.prod(shape)}")
        arrays[name] = data.reshape(shape)
    return arrays


def to_numpy(x: Any) -> Any:
    """float32 numpy copy of a canonical [H, S, ...] tensor or array (a copy: rows are fixed up
    in place)."""
    np = _np()
    if isinstance(x, np.ndarray):
        return np.array(x, np.float32)
    return x.detach().float().cpu().numpy()


def fix_empty_rows(empty: Any, out: Any, lse: Any, dq: Any) -> int:
    """Applies the empty-row convention (O = 0, LSE = -inf, dQ = 0) to rows with no allowed key
    whose values differ (NaN, say); returns how many rows it changed. Arrays are [H, S, ...]."""
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


def base_environment() -> dict:
    env = {"python": platform.python_version()}
    numpy = sys.modules.get("numpy")
    env["numpy"] = getattr(numpy, "__version__", None)
    return env
