"""Inputs and correctness: the host's inputs and outputs, the f64 reference on sampled rows, the
host's error metric.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .encodings import row_keys
from .problem import Problem
from .support import BadRequest, _np


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


def _tensor_shapes(p: Problem) -> Dict[str, Tuple[int, int, int]]:
    return {"q": (p.heads_q, p.seqlen, p.head_dim), "k": (p.heads_kv, p.seqlen, p.head_dim),
            "v": (p.heads_kv, p.seqlen, p.value_dim), "do": (p.heads_q, p.seqlen, p.value_dim)}


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
    out = np.zeros((p.heads_q, n, p.value_dim))
    lse = np.full((p.heads_q, n), -np.inf)
    dq = np.zeros((p.heads_q, n, p.head_dim)) if do is not None else None
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
