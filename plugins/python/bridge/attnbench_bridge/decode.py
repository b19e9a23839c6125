"""Decode steps: each sequence's new tokens against its KV cache, through numpy (the CPU), SDPA,
FlashAttention-4 or FlashInfer, on the host's inputs; the host checks the outputs written here.

Inputs (f32 files in inputs_dir): q [heads_q][rows][d] with rows = queries * batch (sequence b's
token i at row b * queries + i), k and v [heads_kv][keys][d] packed by sequence. A paged cache
comes with `pages` (sequence b's logical page p in pool page pages[b][p]) and each peer reads it
through its own page table. Sequence b's token i sees keys 0 ..= kv_len - queries + i. Outputs:
out.f32 [heads_q][rows][d] and, where the peer gives one, lse.f32 [heads_q][rows] (natural log).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .exchange import base_environment
from .problem import Heads
from .harness import device_bytes, event_rep, is_oom, l2_flush_bytes, release_memory, run_harness, torch_dtype
from .support import BadRequest, OutOfMemory, Unavailable, Unsupported, _np, _package_version, first_line, log, need

# A contiguous cache handed to a peer that takes pages only (FlashInfer) is cut into pages of this
# many tokens, in order.
IN_ORDER_PAGE = 16
# The copy that measures the device's bandwidth moves at least the step's bytes, within these
# bounds: bandwidth saturates far below the upper one, which keeps the copy's buffers small beside
# a long cache.
COPY_BYTES = (64 << 20, 1 << 30)


@dataclass
class Step(Heads):
    kernel: str
    dtype: str
    device: str
    bytes: int  # what the step must move, in the inputs' type (the host's DecodeProblem::bytes)
    kv_lens: List[int]
    queries: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: Optional[int]
    pages: Optional[List[List[int]]]
    inputs_dir: str
    outputs_dir: str

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def rows(self) -> int:
        return self.queries * self.batch

    def offsets(self) -> List[int]:
        starts = [0]
        for length in self.kv_lens:
            starts.append(starts[-1] + length)
        return starts


def parse_step(params: Any) -> Step:
    if not isinstance(params, dict):
        raise BadRequest("decode params must be an object")
    try:
        problem = params["problem"]  # the SDK's DecodeProblem as it serialises
        step = Step(kernel=params["kernel"], dtype=params["dtype"], device=params["device"],
                    bytes=int(params["bytes"]),
                    kv_lens=[int(x) for x in problem["kv_lens"]], queries=int(problem["queries"]),
                    heads_q=int(problem["heads_q"]), heads_kv=int(problem["heads_kv"]),
                    head_dim=int(problem["head_dim"]), page_size=problem.get("page_size"),
                    pages=params.get("pages"), inputs_dir=params["inputs_dir"],
                    outputs_dir=params["outputs_dir"])
    except (KeyError, TypeError, ValueError) as error:
        raise BadRequest(f"decode params: {error!r} missing or malformed") from error
    if step.kernel not in RUNNERS:
        raise BadRequest(f"unknown decode kernel {step.kernel!r}; the bridge has {', '.join(RUNNERS)}")
    if not step.kv_lens or step.heads_kv < 1 or step.heads_q % step.heads_kv or min(step.kv_lens) < step.queries:
        raise BadRequest("decode params: a batch, heads_q a multiple of heads_kv, and caches of at least `queries` keys")
    if (step.page_size is None) != (step.pages is None):
        raise BadRequest("decode params: page_size and pages come together")
    return step


def read_inputs(step: Step) -> Dict[str, Any]:
    np = _np()
    d, keys = step.head_dim, sum(step.kv_lens)
    shapes = {"q": (step.heads_q, step.rows, d), "k": (step.heads_kv, keys, d), "v": (step.heads_kv, keys, d)}
    arrays = {}
    for name, shape in shapes.items():
        path = os.path.join(step.inputs_dir, f"{name}.f32")
        data = np.fromfile(path, dtype="<f4")
        if data.size != math.prod(shape):
            raise BadRequest(f"{path} holds {data.size} values; the step needs {math.prod(shape)}")
        arrays[name] = data.reshape(shape)
    return arrays


def pool_slots(step: Step, page_size: int, pages: List[List[int]]) -> List[Any]:
    """Each sequence's tokens' slots in the pool: page * page_size + token % page_size."""
    np = _np()
    slots = []
    for b, length in enumerate(step.kv_lens):
        token = np.arange(length)
        slots.append(np.asarray(pages[b], dtype=np.int64)[token // page_size] * page_size + token % page_size)
    return slots


def to_pool(step: Step, packed: Any, page_size: int, pages: List[List[int]]) -> Any:
    """A packed [heads_kv][keys][d] tensor in a pool [pool pages][page_size][heads_kv][d]; unused
    slots hold zeros (finite, as FA4 needs of rows past a sequence's end in its last page)."""
    np = _np()
    count = 1 + max(max(p) for p in pages)
    pool = np.zeros((count * page_size, step.heads_kv, step.head_dim), dtype=np.float32)
    starts = step.offsets()
    for b, slots in enumerate(pool_slots(step, page_size, pages)):
        pool[slots] = packed[:, starts[b]:starts[b + 1]].transpose(1, 0, 2)
    return pool.reshape(count, page_size, step.heads_kv, step.head_dim)


def in_order_pages(step: Step, page_size: int) -> List[List[int]]:
    pages, next_page = [], 0
    for length in step.kv_lens:
        count = -(-length // page_size)
        pages.append(list(range(next_page, next_page + count)))
        next_page += count
    return pages


@dataclass
class Runner:
    """A peer made ready: `call()` gives (out [heads_q][rows][d], lse [heads_q][rows] or None) as
    numpy f32, `rep()` one timed repetition in seconds, `copy(bytes)` the device's copy bandwidth
    (bytes read plus written per second) and what it counted."""
    call: Callable[[], Tuple[Any, Optional[Any]]]
    rep: Callable[[], float]
    copy: Callable[[int], Tuple[float, str]]
    details: dict


def numpy_runner(step: Step, arrays: Dict[str, Any]) -> Runner:
    np = _np()
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    starts, group, queries = step.offsets(), step.group, step.queries
    if step.pages is not None:
        pool_k, pool_v = (to_pool(step, x, step.page_size, step.pages).reshape(-1, step.heads_kv, step.head_dim)
                          for x in (k, v))
        slots = pool_slots(step, step.page_size, step.pages)
        keys = lambda b, g: (pool_k[slots[b], g], pool_v[slots[b], g])  # noqa: E731
    else:
        keys = lambda b, g: (k[g, starts[b]:starts[b + 1]], v[g, starts[b]:starts[b + 1]])  # noqa: E731

    def compute() -> Tuple[Any, Any]:
        out = np.zeros(q.shape, dtype=np.float32)
        lse = np.full(q.shape[:2], -np.inf, dtype=np.float32)
        for b, length in enumerate(step.kv_lens):
            rows = slice(b * queries, (b + 1) * queries)
            for g in range(step.heads_kv):
                kb, vb = keys(b, g)
                heads = slice(g * group, (g + 1) * group)
                scores = q[heads, rows] @ kb.T * np.float32(step.scale)  # [group, queries, length]
                for i in range(queries - 1):  # new token i sees keys up to length - queries + i
                    scores[:, i, length - queries + i + 1:] = -np.inf
                high = scores.max(axis=-1, keepdims=True)
                weights = np.exp(scores - high)
                total = weights.sum(axis=-1, keepdims=True)
                out[heads, rows] = (weights @ vb) / total
                lse[heads, rows] = (high + np.log(total))[..., 0]
        return out, lse

    def rep() -> float:
        begin = time.perf_counter()
        compute()
        return time.perf_counter() - begin

    def copy(count: int) -> Tuple[float, str]:
        source = np.ones(min(max(count, COPY_BYTES[0]), COPY_BYTES[1]) // 4, dtype=np.float32)
        target = np.empty_like(source)

        def one() -> float:
            begin = time.perf_counter()
            np.copyto(target, source)
            return time.perf_counter() - begin
        median = sorted(run_harness(one)["samples"])
        return 2 * source.nbytes / median[len(median) // 2], "numpy.copyto of the step's bytes (64 MiB to 1 GiB), one thread"
    return Runner(call=compute, rep=rep, copy=copy,
                  details={"backend": "numpy", "numpy": np.__version__, "cache": "paged" if step.pages else "packed"})


def torch_copy(step: Step, torch: Any, device: Any) -> Callable[[int], Tuple[float, str]]:
    def copy(count: int) -> Tuple[float, str]:
        count = max(min(count, COPY_BYTES[1]), COPY_BYTES[0], 2 * l2_flush_bytes(torch, device))
        source = torch.ones(count, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        samples = sorted(run_harness(event_rep(torch, device, lambda: target.copy_(source)))["samples"])
        return 2 * count / samples[len(samples) // 2], "torch copy_ between device tensors of the step's bytes (at least twice the L2 and 64 MiB, at most 1 GiB)"
    return copy


def int32(torch: Any, device: Any, values: List[int]) -> Any:
    return torch.tensor(values, dtype=torch.int32, device=device)


def cuda_device(step: Step) -> Tuple[Any, Any]:
    if step.device != "cuda":
        raise Unsupported(f"{step.kernel} runs on a CUDA device here; this node asked for device {step.device}")
    torch = need("torch")
    if not torch.cuda.is_available():
        raise Unavailable(f"{step.kernel} needs a CUDA device; torch {torch.__version__} sees none")
    if step.dtype not in ("bf16", "fp16"):
        raise Unsupported(f"{step.kernel} runs bf16 or fp16, not {step.dtype}")
    return torch, torch.device("cuda")


def sdpa_runner(step: Step, arrays: Dict[str, Any]) -> Runner:
    torch, device = cuda_device(step)
    if step.pages is not None:
        raise Unsupported("SDPA reads contiguous K and V; a paged cache would need a gather outside the kernel")
    np, dtype = _np(), torch_dtype(torch, step.dtype)
    longest, starts, batch = max(step.kv_lens), step.offsets(), step.batch
    q = torch.from_numpy(arrays["q"].reshape(step.heads_q, batch, step.queries, step.head_dim)).to(device, dtype)
    q = q.permute(1, 0, 2, 3).contiguous()  # [batch, heads_q, queries, d]
    padded = np.zeros((2, batch, step.heads_kv, longest, step.head_dim), dtype=np.float32)
    allowed = np.zeros((batch, 1, step.queries, longest), dtype=bool)
    for b, length in enumerate(step.kv_lens):
        padded[0, b, :, :length] = arrays["k"][:, starts[b]:starts[b + 1]]
        padded[1, b, :, :length] = arrays["v"][:, starts[b]:starts[b + 1]]
        for i in range(step.queries):
            allowed[b, 0, i, :length - step.queries + i + 1] = True
    k, v = (torch.from_numpy(padded[n]).to(device, dtype) for n in (0, 1))
    mask = torch.from_numpy(allowed).to(device)
    attention = torch.nn.functional.scaled_dot_product_attention

    def forward() -> Any:
        return attention(q, k, v, attn_mask=mask, scale=step.scale, enable_gqa=True)

    def call() -> Tuple[Any, Optional[Any]]:
        out = forward().permute(1, 0, 2, 3).reshape(step.heads_q, step.rows, step.head_dim)
        return out.float().cpu().numpy(), None
    return Runner(call=call, rep=event_rep(torch, device, forward), copy=torch_copy(step, torch, device),
                  details={"backend": "torch.nn.functional.scaled_dot_product_attention", "torch": torch.__version__,
                           "cache": f"padded to the longest cache ({longest} keys) with a boolean mask; enable_gqa",
                           "backend_choice": "PyTorch's, for a boolean mask with grouped K and V (the math backend where no fused one takes both)"})


def fa4_runner(step: Step, arrays: Dict[str, Any]) -> Runner:
    torch, device = cuda_device(step)
    cute = need("flash_attn.cute", "flash_attn.cute (flash-attn-4)")
    varlen = getattr(cute, "flash_attn_varlen_func", None)
    if varlen is None:
        raise Unavailable("flash_attn.cute has no flash_attn_varlen_func")
    dtype, batch, queries = torch_dtype(torch, step.dtype), step.batch, step.queries
    q = torch.from_numpy(arrays["q"]).to(device, dtype).permute(1, 0, 2).contiguous()  # [rows, heads_q, d]
    index = lambda values: int32(torch, device, values)  # noqa: E731
    # FA4 splits the keys on sm_100 but not on Hopper ("SplitKV not supported on SM 9.0"); its own
    # heuristic (num_splits < 1) would pick splits there and fail, so Hopper gets one.
    splits = 1 if torch.cuda.get_device_capability(device)[0] == 9 else 0
    options = {"causal": True, "softmax_scale": step.scale, "num_splits": splits, "return_lse": True}
    if step.pages is None:
        k, v = (torch.from_numpy(arrays[n]).to(device, dtype).permute(1, 0, 2).contiguous() for n in ("k", "v"))
        bounds = {"cu_seqlens_q": index([b * queries for b in range(batch + 1)]), "cu_seqlens_k": index(step.offsets()),
                  "max_seqlen_q": queries, "max_seqlen_k": max(step.kv_lens)}

        def forward() -> Any:
            return varlen(q, k, v, **bounds, **options)

        def heads(out: Any, lse: Any) -> Tuple[Any, Any]:  # [rows, H, d], [H, rows]
            return out.permute(1, 0, 2), lse
        how = "flash_attn_varlen_func with cu_seqlens_q/k, causal (bottom-right)"
    else:
        k, v = (torch.from_numpy(to_pool(step, arrays[n], step.page_size, step.pages)).to(device, dtype)
                for n in ("k", "v"))
        widest = max(len(p) for p in step.pages)
        table = index([p + [0] * (widest - len(p)) for p in step.pages])
        q = q.reshape(batch, queries, step.heads_q, step.head_dim)
        bounds = {"page_table": table, "seqused_k": index(step.kv_lens)}

        def forward() -> Any:
            return varlen(q, k, v, **bounds, **options)

        def heads(out: Any, lse: Any) -> Tuple[Any, Any]:  # [B, Q, H, d], [B, H, Q]
            out = out.reshape(step.rows, step.heads_q, step.head_dim).permute(1, 0, 2)
            return out, lse.permute(1, 0, 2).reshape(step.heads_q, step.rows)
        how = f"flash_attn_varlen_func with page_table ({step.page_size}-token pages) and seqused_k, causal"

    def call() -> Tuple[Any, Optional[Any]]:
        out, lse = heads(*forward())
        return out.float().cpu().numpy(), lse.float().cpu().numpy()
    return Runner(call=call, rep=event_rep(torch, device, forward), copy=torch_copy(step, torch, device),
                  details={"backend": how, "num_splits": "FA4's heuristic" if splits == 0 else splits,
                           "flash_attn_cute": _package_version(cute, "flash-attn-4", "flash_attn")})


def flashinfer_runner(step: Step, arrays: Dict[str, Any]) -> Runner:
    torch, device = cuda_device(step)
    flashinfer = need("flashinfer")
    dtype, batch, queries = torch_dtype(torch, step.dtype), step.batch, step.queries
    page_size = step.page_size or IN_ORDER_PAGE
    pages = step.pages or in_order_pages(step, page_size)
    k, v = (torch.from_numpy(to_pool(step, arrays[n], page_size, pages)).to(device, dtype) for n in ("k", "v"))
    index = lambda values: int32(torch, device, values)  # noqa: E731
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + len(p))
    layout = (index(indptr), index([page for p in pages for page in p]),
              index([length - (len(p) - 1) * page_size for length, p in zip(step.kv_lens, pages)]))
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    q = torch.from_numpy(arrays["q"]).to(device, dtype).permute(1, 0, 2).contiguous()  # [rows, heads_q, d]
    if queries == 1:
        # FlashInfer's docs: tensor cores are "faster for large group size in grouped query
        # attention"; its CUDA-core decode kernel reads each key once per group but scores it
        # with scalar FMAs (54% of the copy bandwidth at GQA 8 on an H100, against 93% for the
        # tensor-core path on 4 new tokens).
        tensor_cores = step.group >= 4
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(*layout, step.heads_q, step.heads_kv, step.head_dim, page_size, pos_encoding_mode="NONE",
                     q_data_type=dtype, kv_data_type=dtype, sm_scale=step.scale)
        how = f"BatchDecodeWithPagedKVCacheWrapper (use_tensor_cores={tensor_cores})"
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(index([b * queries for b in range(batch + 1)]), *layout, step.heads_q, step.heads_kv,
                     step.head_dim, page_size, causal=True, sm_scale=step.scale, q_data_type=dtype,
                     kv_data_type=dtype)
        how = "BatchPrefillWithPagedKVCacheWrapper, causal (bottom-right)"

    def forward() -> Any:
        return wrapper.run(q, (k, v), return_lse=True)

    def call() -> Tuple[Any, Optional[Any]]:
        out, lse = forward()  # [rows, H, d]; [rows, H] in log base 2
        out = out.permute(1, 0, 2).float().cpu().numpy()
        return out, (lse.t().float() * math.log(2.0)).cpu().numpy()
    cache = f"{step.page_size}-token pages" if step.pages else f"contiguous, as in-order {page_size}-token pages"
    return Runner(call=call, rep=event_rep(torch, device, forward), copy=torch_copy(step, torch, device),
                  details={"backend": f"flashinfer.{how}", "cache": cache, "lse": "converted from log2",
                           "flashinfer": _package_version(flashinfer, "flashinfer-python", "flashinfer")})


RUNNERS = {"numpy": numpy_runner, "sdpa": sdpa_runner, "fa4": fa4_runner, "flashinfer": flashinfer_runner}


def first_output(step: Step, runner_of: Callable[[], Runner]) -> Tuple[Runner, Any, Optional[Any]]:
    """The peer made ready and its first call. A library that refuses the configuration (FA4 and
    FlashInfer assert, or raise NotImplementedError) is `unsupported` with its words."""
    runner = runner_of()
    try:
        out, lse = runner.call()
    except (AssertionError, NotImplementedError) as error:
        raise Unsupported(f"{step.kernel} refused the step: {type(error).__name__}: {first_line(error)}") from None
    return runner, out, lse


def decode(params: Any) -> dict:
    step = parse_step(params)
    log(f"decode {step.kernel} {step.dtype} batch={step.batch} longest={max(step.kv_lens)} "
        f"queries={step.queries} hq={step.heads_q} hkv={step.heads_kv} d={step.head_dim} pages={step.page_size}")
    held_before = device_bytes()
    try:
        return measure(step)
    except Unavailable as error:
        return {"status": "unsupported", "reason": str(error), "scope": "machine"}
    except Unsupported as error:
        return {"status": "unsupported", "reason": str(error), "scope": "case"}
    except OutOfMemory as error:
        return {"status": "oom", "reason": str(error)}
    except Exception as error:
        if not is_oom(error):
            raise
        return {"status": "oom", "reason": f"{step.kernel} ran out of device memory: {first_line(error)}"}
    finally:
        release_memory(held_before)


def measure(step: Step) -> dict:
    arrays = read_inputs(step)
    runner, out, lse = first_output(step, lambda: RUNNERS[step.kernel](step, arrays))
    out.astype("<f4").tofile(os.path.join(step.outputs_dir, "out.f32"))
    if lse is not None:
        lse.astype("<f4").tofile(os.path.join(step.outputs_dir, "lse.f32"))
    timing = run_harness(runner.rep)
    rate, counted = runner.copy(step.bytes)
    return {"status": "ok", "lse": lse is not None, **timing, "copy_bytes_per_s": rate, "copy_counted": counted,
            "details": runner.details, "environment": base_environment()}
