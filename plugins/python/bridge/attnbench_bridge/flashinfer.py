"""FlashInfer's prefill kernels: one sequence, documents as a ragged batch, block-sparse grids;
forward only.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Tuple

from .encodings import uniform_grid
from .flash import flash_plan
from .harness import Kernel, require_cuda, require_half, split_result, synchronize, torch_dtype
from .problem import Problem
from .support import Unsupported, _np, need, parameters_of


def flashinfer_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    flashinfer = need("flashinfer")
    require_cuda(p, device)
    require_half(p)
    if p.backward:
        raise Unsupported("flashinfer has no backward (its prefill kernels are forward only)")
    supports = "full, causal and causal sliding-window masks, on one sequence or on documents"
    try:
        plan = flash_plan(p, supports)
        left, right = plan["left"], plan["right"]
        dense = right == 0 or (left < 0 and right < 0)
    except Unsupported:
        dense = False
    if not dense:
        grid, why = p.block_grid()
        if grid is None:
            raise Unsupported(f"flashinfer runs {supports} (single_prefill_with_kv_cache, "
                              f"BatchPrefillWithRaggedKVCacheWrapper) and block-sparse masks "
                              f"(BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper); {p.pattern} is neither: {why}")
        return flashinfer_block_sparse(p, torch, device, flashinfer, grid)
    if len(plan["cu_seqlens"]) > 2:
        return flashinfer_documents(p, torch, device, flashinfer, plan)
    function = flashinfer.single_prefill_with_kv_cache
    options: Dict[str, Any] = {"causal": right == 0, "kv_layout": "NHD", "sm_scale": p.scale}
    if left >= 0:
        options["window_left"] = left
    if "return_lse" in parameters_of(function):
        options["return_lse"] = True
    elif hasattr(flashinfer, "single_prefill_with_kv_cache_return_lse"):
        function = flashinfer.single_prefill_with_kv_cache_return_lse

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        out, lse = split_result(function(q[0], k[0], v[0], **options))
        return out.unsqueeze(0), lse

    def heads(lse: Any) -> Any:  # [S, H] in log base 2 -> [H, S] natural log
        return None if lse is None else lse.detach().float().t() * math.log(2.0)

    without_lse = {key: value for key, value in options.items() if key != "return_lse"}

    def out_only(q: Any, k: Any, v: Any) -> Any:
        return flashinfer.single_prefill_with_kv_cache(q[0], k[0], v[0], **without_lse).unsqueeze(0)

    return Kernel(call=call, out_only=out_only, layout="bshd", lse_to_heads=heads, refusal_is_unsupported=True, compiles=True,
                  env={"backend": f"flashinfer.{function.__name__}", "package_version": flashinfer.__version__},
                  phases={"mask_mode": ("causal" if right == 0 else "full") + (f", window_left {left}" if left >= 0 else ""),
                          "lse": "converted from log2"})


def flashinfer_wrapper_calls(state: Dict[str, Any]) -> Tuple[Callable, Callable]:
    """(call, out_only) of a planned FlashInfer wrapper in state["wrapper"], on bshd inputs."""
    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        out, lse = state["wrapper"].run(q[0], k[0], v[0], return_lse=True)
        return out.unsqueeze(0), lse

    def out_only(q: Any, k: Any, v: Any) -> Any:
        return state["wrapper"].run(q[0], k[0], v[0]).unsqueeze(0)
    return call, out_only


def flashinfer_documents(p: Problem, torch: Any, device: Any, flashinfer: Any, plan: dict) -> Kernel:
    """Documents as FlashInfer batches them: one ragged batch, a request per document
    (qo_indptr = kv_indptr = the document bounds), planned once before timing."""
    wrapper_class = getattr(flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", None)
    if wrapper_class is None:
        raise Unsupported(f"flashinfer {flashinfer.__version__} has no BatchPrefillWithRaggedKVCacheWrapper")
    left, right, documents = plan["left"], plan["right"], len(plan["cu_seqlens"]) - 1
    state = {}

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        bounds = torch.tensor(plan["cu_seqlens"], dtype=torch.int32, device=device)
        state["wrapper"] = wrapper = wrapper_class(torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD")
        wrapper.plan(bounds, bounds, p.heads_q, p.heads_kv, p.head_dim, causal=right == 0, window_left=left,
                     sm_scale=p.scale, q_data_type=torch_dtype(torch, p.dtype))
        synchronize(torch, device, kernel)
        kernel.phases["mask_build_s"] = time.perf_counter() - start


    call, out_only = flashinfer_wrapper_calls(state)
    kernel = Kernel(call=call, out_only=out_only, setup=setup, layout="bshd", refusal_is_unsupported=True,
                    compiles=True, lse_to_heads=lambda lse: lse.detach().float().t() * math.log(2.0),
                    env={"backend": "flashinfer.BatchPrefillWithRaggedKVCacheWrapper",
                         "package_version": flashinfer.__version__},
                    phases={"mask_mode": f"{documents} documents (indptr), " +
                            ("causal" if right == 0 else "full") + (f", window_left {left}" if left >= 0 else ""),
                            "lse": "converted from log2"})
    return kernel


def flashinfer_block_sparse(p: Problem, torch: Any, device: Any, flashinfer: Any, grid: Tuple[Any, Any, Any]) -> Kernel:
    """FlashInfer's block-sparse prefill as its documentation writes it: one pattern for every head
    on uniform blocks as a BSR matrix (BlockSparseAttentionWrapper, [S, H, D] inputs), otherwise a
    pattern per KV head on the masks' block grid (VariableBlockSparseAttentionWrapper, contiguous
    [H, S, D] inputs), so the query heads of a group must share their mask."""
    np = _np()
    grid, block = uniform_grid(grid, p.seqlen)
    rows, cols, kept = grid
    of_kv = [p.mask_index(kv * p.group) for kv in range(p.heads_kv)]
    if any(p.mask_index(h) != of_kv[h // p.group] for h in range(p.heads_q)):
        raise Unsupported("flashinfer's block-sparse wrappers take one pattern per KV head; "
                          f"{p.pattern} gives the query heads of a group different masks")
    one_pattern = p.shared_mask() is not None
    if one_pattern and block and p.seqlen % block == 0:
        return flashinfer_bsr(p, torch, device, flashinfer, kept[0], block)
    wrapper_class = getattr(flashinfer, "VariableBlockSparseAttentionWrapper", None)
    if wrapper_class is None:
        raise Unsupported(f"flashinfer {flashinfer.__version__} has no VariableBlockSparseAttentionWrapper")
    state = {}

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        as_int = lambda edges: torch.tensor(np.diff(edges), dtype=torch.int32, device=device)  # noqa: E731
        state["wrapper"] = wrapper = wrapper_class(torch.empty(128 << 20, dtype=torch.uint8, device=device))
        wrapper.plan(torch.from_numpy(kept[of_kv]).to(device),
                     as_int(rows)[None].repeat(p.heads_kv, 1), as_int(cols)[None].repeat(p.heads_kv, 1),
                     p.heads_q, p.heads_kv, p.head_dim, causal=False, sm_scale=p.scale,
                     q_data_type=torch_dtype(torch, p.dtype))
        synchronize(torch, device, kernel)
        kernel.phases.update(mask_build_s=time.perf_counter() - start, blocks=[len(rows) - 1, len(cols) - 1],
                             kept_blocks=int(kept[of_kv].sum()))

    call, out_only = flashinfer_wrapper_calls(state)
    grid_form = f"uniform {block}-token blocks" if block else "the masks' block grid"
    kernel = Kernel(call=call, out_only=out_only, setup=setup, refusal_is_unsupported=True, compiles=True,
                    lse_to_heads=lambda lse: lse.detach().float() * math.log(2.0),
                    env={"backend": "flashinfer.VariableBlockSparseAttentionWrapper",
                         "package_version": flashinfer.__version__},
                    phases={"mask_mode": f"a pattern per KV head on {grid_form}", "lse": "converted from log2"})
    return kernel


def flashinfer_bsr(p: Problem, torch: Any, device: Any, flashinfer: Any, kept: Any, block: int) -> Kernel:
    """One block pattern for every head, `kept` [row blocks, column blocks] of `block` tokens, as a
    BSR matrix of block × block blocks."""
    wrapper_class = getattr(flashinfer, "BlockSparseAttentionWrapper", None)
    if wrapper_class is None:
        raise Unsupported(f"flashinfer {flashinfer.__version__} has no BlockSparseAttentionWrapper")
    np = _np()
    state = {}

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        indptr = np.concatenate([[0], np.cumsum(kept.sum(-1))])
        indices = np.nonzero(kept)[1]  # row-major: each block row's kept columns, ascending
        as_int = lambda values: torch.from_numpy(np.ascontiguousarray(values, np.int32)).to(device)  # noqa: E731
        state["wrapper"] = wrapper = wrapper_class(torch.empty(128 << 20, dtype=torch.uint8, device=device))
        wrapper.plan(as_int(indptr), as_int(indices), p.seqlen, p.seqlen, block, block,
                     p.heads_q, p.heads_kv, p.head_dim, sm_scale=p.scale, q_data_type=torch_dtype(torch, p.dtype),
                     o_data_type=torch_dtype(torch, p.dtype))
        synchronize(torch, device, kernel)
        kernel.phases.update(mask_build_s=time.perf_counter() - start, blocks=list(kept.shape),
                             kept_blocks=int(kept.sum()))

    call, out_only = flashinfer_wrapper_calls(state)
    kernel = Kernel(call=call, out_only=out_only, setup=setup, layout="bshd", refusal_is_unsupported=True,
                    compiles=True, lse_to_heads=lambda lse: lse.detach().float().t() * math.log(2.0),
                    env={"backend": "flashinfer.BlockSparseAttentionWrapper", "package_version": flashinfer.__version__},
                    phases={"mask_mode": f"one pattern for every head: BSR of {block}×{block} blocks",
                            "lse": "converted from log2"})
    return kernel
