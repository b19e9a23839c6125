"""One benchmark cell, a step per request, in the order of attnbench's kernel-benchmark protocol
(the SDK's `bench::run`): open (the kernel, whether it takes the cell, the memory it needs),
prepare (the host's inputs), forward, backward, outputs (written for the host's check), time (the
host's harness answering each repetition), close.

The host draws the inputs, checks the outputs against its f64 reference and stops the timing;
a session only runs the kernel as its library documents it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from .exchange import base_environment, fix_empty_rows, read_inputs, to_numpy
from .harness import (from_layout, input_bytes, is_oom, l2_flush_bytes, lse_to_heads, make_rep,
                      native_inputs, peak_memory, ready_kernel, run_harness, synchronize, timed_step,
                      torch_environment)
from .numpy_kernel import NumpyKernel
from .problem import Problem
from .support import OutOfMemory, Unsupported, _np, first_line, log, need


class Session:
    """What every kernel family does per step; `tensors` are the canonical outputs."""

    def __init__(self, p: Problem, env: dict, phases: dict, lse_note: Optional[str]) -> None:
        self.p, self.env, self.phases, self.lse_note = p, env, phases, lse_note
        self.notes: List[str] = []

    def budget(self) -> Optional[Tuple[int, int]]:
        """(bytes needed, bytes free) where memory is scarce (a CUDA device), else None."""
        return None

    def prepare(self, inputs_dir: str) -> None:
        raise NotImplementedError

    def forward(self) -> None:
        raise NotImplementedError

    def backward(self) -> None:
        raise NotImplementedError

    def tensors(self) -> Dict[str, Any]:
        raise NotImplementedError

    def time(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def outputs(self, directory: str) -> List[str]:
        """Writes the last run's outputs as little-endian f32 in the canonical layouts, with the
        empty-row convention applied (and noted); returns the files written."""
        arrays = {n: to_numpy(x) for n, x in self.tensors().items() if x is not None}
        fixed = fix_empty_rows(self.p.empty_rows(), arrays["out"], arrays.get("lse"), arrays.get("dq"))
        if fixed:
            self.notes.append(f"{fixed} rows with no allowed key were set to O=0, LSE=-inf, dQ=0 after "
                              "the kernel ran (outside the timed region)")
        if "lse" not in arrays:
            self.notes.append(f"LSE not checked: {self.lse_note or 'the kernel returned no LSE'}")
        os.makedirs(directory, exist_ok=True)
        written = []
        for name, array in arrays.items():
            path = os.path.join(directory, f"{name}.f32")
            array.astype("<f4").tofile(path + ".tmp")
            os.replace(path + ".tmp", path)
            written.append(f"{name}.f32")
        return written

    def environment(self) -> dict:
        env = dict(self.env)
        if self.notes:
            env["notes"] = list(self.notes)
        return env


class TorchSession(Session):
    """A torch kernel (an adapter's `Kernel`) on the CPU or a CUDA device."""

    def __init__(self, p: Problem, make_kernel: Callable) -> None:
        self.torch = need("torch")
        self.device, self.kernel = ready_kernel(p, self.torch, make_kernel)
        super().__init__(p, self.kernel.env, self.kernel.phases, self.kernel.lse_note)
        self.context = contextlib.ExitStack()
        self.native: Dict[str, Any] = {}
        self.out = self.lse = self.grads = None

    def budget(self) -> Optional[Tuple[int, int]]:
        if self.device.type != "cuda":
            return None
        free = self.torch.cuda.mem_get_info(self.device)[0]
        needed = input_bytes(self.p) + self.kernel.extra_bytes + l2_flush_bytes(self.torch, self.device)
        return needed, free

    def prepare(self, inputs_dir: str) -> None:
        self.context.enter_context(self.kernel.context())
        self.native = native_inputs(self.p, self.torch, self.device, self.kernel, inputs_dir)

    def _attempt(self, run: Callable, what: str, phase: str) -> Any:
        """A call with the library's refusals turned into reasons; the first one's seconds (with
        a JIT kernel's compile) are kept as `phase`."""
        p, kernel = self.p, self.kernel
        while True:
            try:
                synchronize(self.torch, self.device, kernel)
                start = time.perf_counter()
                result = run()
                synchronize(self.torch, self.device, kernel)
                kernel.phases.setdefault(phase, time.perf_counter() - start)
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

    def forward(self) -> None:
        n = self.native
        phase = "compile_s" if self.kernel.compiles else "first_call_s"
        self.out, self.lse = self._attempt(lambda: self.kernel.call(n["q"], n["k"], n["v"]), "forward", phase)

    def backward(self) -> None:
        n = self.native
        phase = "compile_bwd_s" if self.kernel.compiles else "first_backward_s"
        self.grads = self._attempt(lambda: self.kernel.grad(self.out, n["q"], n["k"], n["v"], n.get("do")),
                                   "backward", phase)

    def tensors(self) -> Dict[str, Any]:
        p, kernel = self.p, self.kernel
        canonical = lambda x: from_layout(x, kernel.layout).detach()  # noqa: E731
        out = canonical(kernel.out_to_torch(self.out) if kernel.out_to_torch else self.out)
        heads_lse = (kernel.lse_to_heads or (lambda x: lse_to_heads(p, x)))(self.lse)
        if self.lse is not None and heads_lse is None:
            self.notes.append(f"the kernel's LSE has an unexpected shape {tuple(self.lse.shape)}; not checked")
        tensors = {"out": out, "lse": heads_lse.float() if heads_lse is not None else None}
        if self.grads is not None:
            tensors.update(dq=canonical(self.grads[0]), dk=canonical(self.grads[1]), dv=canonical(self.grads[2]))
            if kernel.expand_kv:  # a KV head's gradient is the sum over the query heads it serves
                for n, d in (("dk", p.head_dim), ("dv", p.value_dim)):
                    tensors[n] = tensors[n].float().reshape(p.heads_kv, p.group, p.seqlen, d).sum(1)
        return tensors

    def time(self) -> dict:
        torch, device, kernel, p = self.torch, self.device, self.kernel, self.p
        step = timed_step(p, kernel, self.native, self.out)
        self.grads = None  # the check has them; the timed steps make their own
        cuda = device.type == "cuda"
        memory = peak_memory(torch, device, step) if cuda and kernel.torch_memory else None
        timing = run_harness(make_rep(torch, device, kernel, step))
        env = torch_environment(torch, device)
        env.update(kernel.env)
        view = kernel.layout == "bhsd" and p.layout == "bshd"
        env["inputs"] = f"bshd storage, {kernel.layout} view" if view else f"contiguous {kernel.layout}"
        if kernel.out_only:
            env["timed_forward"] = "without the LSE output (the LSE checked from the first call)"
        if cuda and not kernel.torch_memory:
            self.notes.append("memory not measured: the kernel allocates outside torch's allocator")
        self.env = env
        return dict(memory=memory, **timing)

    def close(self) -> None:
        self.native, self.out, self.lse, self.grads = {}, None, None, None
        self.context.close()


class NumpySession(Session):
    """A numpy kernel on the CPU: float32 arrays [H, S, D]."""

    def __init__(self, p: Problem, kernel: NumpyKernel) -> None:
        _np()  # unsupported, with the reason, when numpy is missing
        if p.backward and kernel.backward is None:
            raise Unsupported(kernel.no_backward or f"{p.kernel} has no backward")
        env = dict(base_environment(), device="cpu", device_name=platform.processor() or platform.machine())
        env.update(kernel.env)
        super().__init__(p, env, kernel.phases, kernel.lse_note)
        self.kernel = kernel
        self.inputs: Dict[str, Any] = {}
        self.out = self.lse = self.grads = None

    def prepare(self, inputs_dir: str) -> None:
        np = _np()
        start = time.perf_counter()
        self.inputs = {n: as_float32(a, self.p.dtype, np) for n, a in read_inputs(self.p, inputs_dir).items()}
        self.phases["load_inputs_s"] = time.perf_counter() - start
        if self.kernel.setup:
            self.kernel.setup()

    def forward(self) -> None:
        x = self.inputs
        self.out, self.lse = self.kernel.forward(x["q"], x["k"], x["v"])

    def backward(self) -> None:
        x = self.inputs
        self.grads = self.kernel.backward(x["q"], x["k"], x["v"], self.out, self.lse, x["do"])

    def tensors(self) -> Dict[str, Any]:
        dq, dk, dv = self.grads if self.grads is not None else (None, None, None)
        return {"out": self.out, "lse": self.lse, "dq": dq, "dk": dk, "dv": dv}

    def time(self) -> dict:
        import tracemalloc
        x, kernel, out, lse = self.inputs, self.kernel, self.out, self.lse
        q, k, v, do = x["q"], x["k"], x["v"], x.get("do")
        steps = {"fwd": lambda: kernel.forward(q, k, v),
                 "bwd": lambda: kernel.backward(q, k, v, out, lse, do),
                 "fwd_bwd": lambda: kernel.backward(q, k, v, *kernel.forward(q, k, v), do)}
        step = steps[self.p.direction]
        self.grads = None
        held = sum(a.nbytes for a in (q, k, v, do, out, lse) if a is not None)
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

        return dict(memory=memory, **run_harness(rep))

    def close(self) -> None:
        self.inputs, self.out, self.lse, self.grads = {}, None, None, None


def as_float32(array: Any, dtype: str, np: Any) -> Any:
    """float32 values of an input read in its storage type (bf16 arrives as its uint16 bits)."""
    if dtype == "bf16":
        return (array.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return array.astype(np.float32)
