"""Which adapter runs a request, what a refusal becomes, and the probes behind `backends`."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Optional

from .checks import base_environment
from .cudnn import cudnn_adapter
from .flash import flash_adapter
from .flashinfer import flashinfer_adapter
from .flashmask import flashmask_adapter
from .harness import device_bytes, first_calls, is_oom, make_rep, native_inputs, ready_kernel, release_memory, run_torch, timed_step
from .numpy_kernel import numpy_attention, run_numpy
from .problem import KERNELS, Problem, parse_problem
from .sdpa_flex import SDPA_BACKENDS, flex_adapter, sdpa_adapter, sdpa_backend
from .support import OutOfMemory, Unavailable, Unsupported, _np, _package_version, first_line, log, need
from .user_module import run_module


@contextlib.contextmanager
def harness_rep(p: Problem) -> Any:
    """The harness's timed repetition of p's torch kernel, after its first calls, unchecked: for
    timing it side by side with another loop in one process (scripts/peer-plain.py)."""
    torch = need("torch")
    device, kernel = ready_kernel(p, torch, torch_adapter(p))
    with kernel.context():
        native = native_inputs(p, torch, device, kernel)
        out, _, _ = first_calls(p, torch, device, kernel, native["q"], native["k"], native["v"], native.get("do"))
        yield make_rep(torch, device, kernel, timed_step(p, kernel, native, out))


TORCH_ADAPTERS = {"sdpa-math": sdpa_adapter, "sdpa-flash": sdpa_adapter, "sdpa-efficient": sdpa_adapter,
                  "sdpa-cudnn": sdpa_adapter, "flex": flex_adapter, "fa2": flash_adapter,
                  "fa3": flash_adapter, "fa4": flash_adapter, "cudnn": cudnn_adapter,
                  "flashinfer": flashinfer_adapter,
                  "flashmask": flashmask_adapter}


# Kernels whose adapters build one head dim into their calls (cuDNN's graph dims, FlashInfer's
# plans, FA2/FA3's fixed instantiations, FlashMask's paddle call); the others take V's from the
# tensors, and a library that refuses is recorded unsupported with its own reason.
ONE_HEAD_DIM = ("fa2", "fa3", "cudnn", "flashinfer", "flashmask")


def torch_adapter(p: Problem) -> Callable:
    """The adapter of p's torch kernel, once its package is known to import: "flash_attn not
    importable" says more than the "no CUDA" the adapter might find first."""
    probe(p.kernel)
    return TORCH_ADAPTERS[p.kernel]


def outcome(status: str, reason: str, p: Problem, scope: Optional[str] = None) -> dict:
    env = base_environment()
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return {"status": status, "reason": reason, "scope": scope, "samples": [], "rel_ci": None, "stopped": None,
            "memory": None, "correctness": None, "phases": {}, "environment": env}


def benchmark(params: Any) -> dict:
    p = parse_problem(params)
    log(f"benchmark {p.kernel} {p.direction} {p.dtype} {p.pattern} "
        f"hq={p.heads_q} hkv={p.heads_kv} s={p.seqlen} d={p.head_dim}/{p.value_dim} on {p.device}")
    result, held_before = None, device_bytes()
    try:
        if p.gqa == "expand" and p.group > 1 and p.kernel not in SDPA_BACKENDS:
            raise Unsupported(f"gqa: expand applies to the SDPA kernels; {p.kernel} takes grouped K and V as they are")
        if p.value_dim != p.head_dim and p.kernel in ONE_HEAD_DIM:
            raise Unsupported(f"the bridge hands {p.kernel} one head dim for Q, K and V; head_dim_v {p.value_dim} "
                              f"differs from head_dim {p.head_dim}")
        if p.kernel == "numpy":
            result = run_numpy(p, numpy_attention(p))
        elif p.kernel == "module":
            result = run_module(p)
        else:
            result = run_torch(p, torch_adapter(p))
    except Unavailable as error:
        result = outcome("unsupported", str(error), p, scope="machine")
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
            raise Unavailable("the cudnn module has no pygraph (nvidia-cudnn-frontend provides it)")
        return _package_version(cudnn, "nvidia-cudnn-frontend")
    if kernel == "flashinfer":
        return _package_version(need("flashinfer"), "flashinfer-python", "flashinfer")
    if kernel == "flashmask":
        paddle = need("paddle")
        if not hasattr(paddle.nn.functional, "flashmask_attention"):
            raise Unavailable(f"paddle {paddle.__version__} has no nn.functional.flashmask_attention")
        return paddle.__version__
    if kernel == "fa2":
        flash_attn = need("flash_attn")
        if not hasattr(flash_attn, "flash_attn_func"):
            raise Unavailable("flash_attn has no flash_attn_func (an FA2 install provides it)")
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
