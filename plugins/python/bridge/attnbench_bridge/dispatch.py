"""The cell the host has open and the requests on it, which adapter runs it, what a refusal
becomes, and the probes behind `backends`."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Optional

from .exchange import base_environment
from .cudnn import cudnn_adapter
from .flash import flash_adapter
from .flashinfer import flashinfer_adapter
from .flashmask import flashmask_adapter
from .harness import device_bytes, is_oom, make_rep, release_memory, timed_step
from .numpy_kernel import numpy_attention
from .problem import KERNELS, Problem, parse_problem
from .sdpa_flex import SDPA_BACKENDS, flex_adapter, sdpa_adapter, sdpa_backend
from .session import NumpySession, Session, TorchSession
from .support import BadRequest, OutOfMemory, Unavailable, Unsupported, _np, _package_version, first_line, log, need
from .user_module import module_session


@contextlib.contextmanager
def harness_rep(p: Problem) -> Any:
    """The harness's timed repetition of p's torch kernel, after its first calls, unchecked: for
    timing it side by side with another loop in one process (scripts/peer-plain.py). The inputs
    are drawn here from p's seed."""
    session = TorchSession(p, torch_adapter(p))
    try:
        session.prepare(None)
        session.forward()
        if p.backward:
            session.backward()
        step = timed_step(p, session.kernel, session.native, session.out)
        yield make_rep(session.torch, session.device, session.kernel, step)
    finally:
        session.close()


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


def make_session(p: Problem) -> Session:
    if p.gqa == "expand" and p.group > 1 and p.kernel not in SDPA_BACKENDS:
        raise Unsupported(f"gqa: expand applies to the SDPA kernels; {p.kernel} takes grouped K and V as they are")
    if p.value_dim != p.head_dim and p.kernel in ONE_HEAD_DIM:
        raise Unsupported(f"the bridge hands {p.kernel} one head dim for Q, K and V; head_dim_v {p.value_dim} "
                          f"differs from head_dim {p.head_dim}")
    if p.kernel == "numpy":
        return NumpySession(p, numpy_attention(p))
    if p.kernel == "module":
        return module_session(p)
    return TorchSession(p, torch_adapter(p))


class Cell:
    """The cell the host has open: its session, and the device memory held before it opened."""
    session: Optional[Session] = None
    held_before = 0


def close(_params: Any = None) -> None:
    """Ends the open cell, if any, and gives its device memory back."""
    session, Cell.session = Cell.session, None
    if session is not None:
        session.close()
        del session
        release_memory(Cell.held_before)


def refusal(status: str, reason: str, scope: Optional[str] = None) -> dict:
    """The reply to a step that found the cell unsupported or out of memory; the cell is closed."""
    close()
    env = base_environment()
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return {"status": status, "reason": reason, "scope": scope, "environment": env}


def step(run: Callable[[Session], Optional[dict]]) -> Callable[[Any], dict]:
    """A request on the open cell: `run`'s reply with status ok, or a refusal's status and reason."""
    def request(params: Any) -> dict:
        if Cell.session is None:
            raise BadRequest("no cell is open: send open first")
        p = Cell.session.p
        try:
            return dict(run(Cell.session, params) or {}, status="ok")
        except Unavailable as error:
            return refusal("unsupported", str(error), scope="machine")
        except Unsupported as error:
            return refusal("unsupported", str(error))
        except OutOfMemory as error:
            return refusal("oom", str(error))
        except Exception as error:
            if not is_oom(error):
                raise
            return refusal("oom", f"{p.kernel} ran out of device memory: {first_line(error)}")
    return request


def open_cell(params: Any) -> dict:
    """Opens a cell: the kernel's adapter for the problem, whether it takes it, the memory it needs."""
    close()
    p = parse_problem(params)
    log(f"open {p.kernel} {p.direction} {p.dtype} {p.pattern} "
        f"hq={p.heads_q} hkv={p.heads_kv} s={p.seqlen} d={p.head_dim}/{p.value_dim} on {p.device}")
    Cell.held_before = device_bytes()
    try:
        Cell.session = make_session(p)
    except Unavailable as error:
        return refusal("unsupported", str(error), scope="machine")
    except Unsupported as error:
        return refusal("unsupported", str(error))
    budget = Cell.session.budget()
    return {"status": "ok", "budget": None if budget is None else {"needed_bytes": budget[0], "free_bytes": budget[1]},
            "environment": Cell.session.environment()}


def _inputs_dir(params: Any) -> str:
    directory = params.get("inputs_dir") if isinstance(params, dict) else None
    if not isinstance(directory, str) or not directory:
        raise BadRequest("prepare needs params.inputs_dir, the folder of the host's inputs")
    return directory


def _outputs_dir(params: Any) -> str:
    directory = params.get("dir") if isinstance(params, dict) else None
    if not isinstance(directory, str) or not directory:
        raise BadRequest("outputs needs params.dir, the folder to write the outputs to")
    return directory


def _timing(session: Session, _params: Any) -> dict:
    timing = session.time()
    return dict(timing, phases=session.phases, environment=session.environment())


CELL_OPS = {
    "open": open_cell,
    "prepare": step(lambda s, params: s.prepare(_inputs_dir(params))),
    "forward": step(lambda s, _: s.forward()),
    "backward": step(lambda s, _: s.backward()),
    "outputs": step(lambda s, params: {"written": s.outputs(_outputs_dir(params)), "notes": list(s.notes)}),
    "time": step(_timing),
    "close": close,
}


def outcome(status: str, reason: str, p: Problem, scope: Optional[str] = None) -> dict:
    env = base_environment()
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return {"status": status, "reason": reason, "scope": scope, "samples": [], "rel_ci": None, "stopped": None,
            "memory": None, "correctness": None, "phases": {}, "environment": env}


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
