"""Helpers every part of the bridge uses: its exceptions, the log, optional imports."""

from __future__ import annotations

import importlib
import inspect
import linecache
import os
import sys
from typing import Any, Callable, Optional


ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "f32": 4}
GIB = float(1 << 30)


def keep_sources(folder: str) -> None:
    """Keeps the lines of every module imported from `folder` in linecache (as a loader's, which
    checkcache never drops), so that `inspect.getsource` still finds them once the folder is
    removed: FA4's CuTe DSL compiles a mask_mod from its source."""
    root = os.path.join(os.path.abspath(folder), "")
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not os.path.abspath(path).startswith(root):
            continue
        with open(path, encoding="utf-8") as source:
            lines = source.readlines()
        for name in {path, os.path.abspath(path)}:
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)


class Unsupported(Exception):
    """The kernel cannot run this problem; the message is the one-sentence reason."""


class Unavailable(Unsupported):
    """Not this problem but this machine: a package, library or device the kernel needs is missing
    or broken here. The record says so (scope `machine`), so a check elsewhere is not failed by it."""


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
    """Imports `module`, or reports the kernel as unavailable here with the import's error."""
    try:
        return importlib.import_module(module)
    except Exception as error:  # broken installs raise OSError, RuntimeError, ... as well
        raise Unavailable(f"{label or module} not importable: {first_line(error)}") from None


def _np() -> Any:
    return need("numpy")


def parameters_of(function: Callable) -> set:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


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
