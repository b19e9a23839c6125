"""Third-party kernels: a user's Python file defining attention(q, k, v, mask, scale)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from typing import Any, Callable, Dict

from .harness import Kernel, split_result, synchronize
from .numpy_kernel import NumpyKernel
from .problem import Problem
from .support import BadRequest, Unavailable, Unsupported, first_line


DENSE_FOR_MODULES_MAX_SEQLEN = 32768


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
        raise Unavailable(f"{os.path.basename(path)} not importable: {first_line(error)}") from None
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
        dense = build(0)
    return {"dense": dense, "slices": slices, "set": p.mask_set}


def module_session(p: Problem) -> Any:
    """The session of a user's module: numpy arrays on the CPU (`BACKEND = "numpy"`) or torch."""
    from .session import NumpySession, TorchSession
    module = load_user_module(p.module)
    supports = getattr(module, "SUPPORTS", None)
    if callable(supports):
        reason = supports(p.mask_set)
        if reason:
            raise Unsupported(str(reason))
    label = {"backend": f"module {os.path.basename(p.module)}", "module": p.module}
    if getattr(module, "BACKEND", "torch") == "numpy":
        return NumpySession(p, numpy_module_kernel(p, module, label))
    return TorchSession(p, lambda p, torch, device: torch_module_kernel(p, torch, device, module, label))


def numpy_module_kernel(p: Problem, module: Any, label: dict) -> NumpyKernel:
    kernel = NumpyKernel(forward=None, backward=None, env=label,
                         no_backward=f"{os.path.basename(p.module)} defines no attention_backward")
    mask: Dict[str, Any] = {}

    def setup() -> None:
        start = time.perf_counter()
        mask.update(user_mask(p, module, p.dense))
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
        mask.update(user_mask(p, module, lambda index: p.dense(index, torch, device)))
        synchronize(torch, device, kernel)
        kernel.phases["mask_build_s"] = time.perf_counter() - start

    def grad(out: Any, q: Any, k: Any, v: Any, do: Any) -> Any:
        if not getattr(out, "requires_grad", False):
            raise Unsupported(f"{os.path.basename(p.module)}'s output carries no autograd graph, so it has no backward")
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    kernel.setup, kernel.grad = setup, grad
    return kernel
