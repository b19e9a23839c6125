"""The torch side of a benchmark: a kernel as an adapter describes it, inputs in its layout, the
timed step and repetition, peak memory.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from .exchange import _tensor_shapes, _wanted, base_environment, read_inputs
from .problem import Problem
from .support import ELEMENT_BYTES, Unavailable, Unsupported


# How a timed repetition is reported to the host while a request runs: its seconds in, the host's
# timing (samples, rel_ci, stopped) out once its harness stops the run, None while another should
# follow. `protocol.serve` installs it per request (`reporting_to`).
_report: Optional[Callable[[float], Optional[dict]]] = None


@contextlib.contextmanager
def reporting_to(report: Callable[[float], Optional[dict]]) -> Iterator[None]:
    global _report
    previous, _report = _report, report
    try:
        yield
    finally:
        _report = previous


def run_harness(rep: Callable[[], float]) -> dict:
    """Repetitions of `rep` until the host says stop: warm-up, the stable median, the time cap and
    the repetition cap are the host's harness (attnbench's one rule), which answers each report."""
    if _report is None:
        raise RuntimeError("timing needs attnbench's harness: no host is taking this request's repetitions")
    while True:
        timing = _report(rep())
        if timing is not None:
            return timing


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
        raise Unavailable(f"CUDA is not available to torch {torch.__version__} (device cuda was asked for)")
    return torch.device("cuda", torch.cuda.current_device())


def require_cuda(p: Problem, device: Any) -> None:
    if device.type != "cuda":
        raise Unsupported(f"{p.kernel} runs on cuda only")


def require_half(p: Problem) -> None:
    if p.dtype == "f32":
        raise Unsupported(f"{p.kernel} runs bf16 and fp16 only")


def make_torch_inputs(p: Problem, torch: Any, device: Any, inputs_dir: Optional[str]) -> Dict[str, Any]:
    """Canonical [1, H, S, D] inputs in the dtype: the host's, read from `inputs_dir`, or (for a
    plain loop beside the harness, scripts/peer-plain.py) seeded uniform [-1, 1) drawn here."""
    dtype = torch_dtype(torch, p.dtype)
    if inputs_dir:
        tensors = {}
        for name, array in read_inputs(p, inputs_dir).items():
            x = torch.from_numpy(array.view("<i2") if p.dtype == "bf16" else array)
            tensors[name] = (x.view(dtype) if p.dtype == "bf16" else x)[None].to(device=device, dtype=dtype)
        return tensors
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
    e = ELEMENT_BYTES[p.dtype]
    q, o = p.heads_q * p.seqlen * p.head_dim, p.heads_q * p.seqlen * p.value_dim
    k, v = p.heads_kv * p.seqlen * p.head_dim, p.heads_kv * p.seqlen * p.value_dim
    total = e * (q + o + k + v) + 4 * p.heads_q * p.seqlen + 4 * o  # q, k, v, out, lse, f32 staging
    if p.backward:
        total += e * (o + q + k + v)  # dO, dQ, dK, dV
    return total


def l2_flush_bytes(torch: Any, device: Any) -> int:
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (128 << 20)
    return 2 * int(size)


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


def ready_kernel(p: Problem, torch: Any, make_kernel: Callable) -> Tuple[Any, Kernel]:
    """The device and p's kernel from its adapter, with autograd as the default backward."""
    device = torch_device(p, torch)
    kernel = make_kernel(p, torch, device)
    if p.backward and kernel.no_backward:
        raise Unsupported(kernel.no_backward)
    if kernel.grad is None:
        kernel.grad = lambda out, q, k, v, do: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return device, kernel


def native_inputs(p: Problem, torch: Any, device: Any, kernel: Kernel, inputs_dir: Optional[str]) -> Dict[str, Any]:
    """The inputs in the kernel's layout, its setup run, q, k and v taking gradients for a backward."""
    start = time.perf_counter()
    inputs = make_torch_inputs(p, torch, device, inputs_dir)
    if kernel.expand_kv:  # the model keeps K and V per query head: repeated once, untimed
        inputs.update({n: inputs[n].repeat_interleave(p.group, dim=1) for n in ("k", "v")})
    native = {n: to_layout(x, kernel.layout, p.layout) for n, x in inputs.items()}
    del inputs
    synchronize(torch, device, kernel)
    kernel.phases["load_inputs_s"] = time.perf_counter() - start
    if kernel.setup:
        kernel.setup(native)
    if p.backward:
        for name in ("q", "k", "v"):
            native[name].requires_grad_(True)
    return native


def timed_step(p: Problem, kernel: Kernel, native: Dict[str, Any], first_out: Any) -> Callable[[], None]:
    """What one timed repetition runs: the forward, the backward of one forward, or both. The
    forward is the one a model calls, without the LSE where the kernel has that (`out_only`); the
    LSE is checked from the first call. A kernel without `out_only` times its backward on the
    first call's graph (`first_out`)."""
    q, k, v, do = native["q"], native["k"], native["v"], native.get("do")
    forward = kernel.out_only or (lambda q, k, v: kernel.call(q, k, v)[0])
    if p.direction == "fwd":
        return lambda: forward(q, k, v)
    if p.direction == "bwd":
        out = forward(q, k, v) if kernel.out_only else first_out
        return lambda: kernel.grad(out, q, k, v, do)
    return lambda: kernel.grad(forward(q, k, v), q, k, v, do)


def peak_memory(torch: Any, device: Any, step: Callable) -> dict:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_bytes": int(peak), "above_inputs_bytes": int(peak - base),
            "method": "torch.cuda.max_memory_allocated around one call"}


# GPU clock cycles the device spins after the flush (about 1 ms at 2 GHz), so that the host has
# enqueued the whole step before the start event is reached.
HOST_LEAD_CYCLES = 2_000_000


def event_rep(torch: Any, device: Any, step: Callable) -> Callable[[], float]:
    """One timed repetition on a CUDA device (seconds): a flush of twice the L2, a spin that puts
    the GPU ahead of the host, then `step` between CUDA events. Without the spin the GPU idles
    from the start event until Python has launched the step: 50–150 µs for some peers, 5–12% of a
    1 ms kernel, and more or less of it depending on how busy the process is. A model's training
    loop runs ahead of its GPU, so the kernel's own time is what counts. scripts/peer-plain.py
    times the peers' plain loops with it too."""
    flush = torch.empty(l2_flush_bytes(torch, device), dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def rep() -> float:
        flush.zero_()  # evicts the inputs from L2, outside the timed region
        torch.cuda._sleep(HOST_LEAD_CYCLES)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    return rep


def make_rep(torch: Any, device: Any, kernel: Kernel, step: Callable) -> Callable[[], float]:
    if device.type != "cuda":
        def cpu_rep() -> float:
            begin = time.perf_counter()
            step()
            return time.perf_counter() - begin
        return cpu_rep
    if kernel.sync is None:
        return event_rep(torch, device, step)
    flush = torch.empty(l2_flush_bytes(torch, device), dtype=torch.uint8, device=device)

    def wall_rep() -> float:  # for kernels on another framework's stream
        flush.zero_()
        synchronize(torch, device, kernel)
        begin = time.perf_counter()
        step()
        synchronize(torch, device, kernel)
        return time.perf_counter() - begin
    return wall_rep


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
