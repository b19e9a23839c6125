"""cuDNN's own fused attention through nvidia-cudnn-frontend's graph API."""

from __future__ import annotations

import time
import traceback
from typing import Any, Dict, List, Tuple

from .flash import flash_plan
from .harness import Kernel, require_cuda, require_half
from .problem import Problem
from .support import Unsupported, _package_version, first_line, log, need


CUDNN_IO = {"bf16": "BFLOAT16", "fp16": "HALF"}


def cudnn_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    """cuDNN's own fused attention through its frontend's graph API, as cuDNN's samples build it:
    documents as THD ragged tensors (ragged offsets plus per-document lengths and the padding
    mask), windows as the diagonal band, one forward graph and one backward graph built before
    timing and executed on torch's stream."""
    cudnn = need("cudnn", "cudnn (nvidia-cudnn-frontend)")
    require_cuda(p, device)
    require_half(p)
    plan = flash_plan(p, "full, causal, diagonal-band (window) and THD ragged document masks")
    left, right, cu = plan["left"], plan["right"], plan["cu_seqlens"]
    documents, longest, s = len(cu) - 1, plan["max_seqlen"], p.seqlen
    ragged = documents > 1
    # The band in cuDNN's terms: key j is seen by query i when i - j < left_bound and j - i <= right_bound.
    mask: Dict[str, Any] = {}
    if left < 0 and right == 0:
        mask["use_causal_mask"] = True
    else:
        if left >= 0:
            mask["diagonal_band_left_bound"] = left + 1
        if right >= 0:
            mask["diagonal_band_right_bound"] = right
        if mask:
            mask["diagonal_alignment"] = cudnn.diagonal_alignment.TOP_LEFT
    io = getattr(cudnn.data_type, CUDNN_IO[p.dtype])
    f32 = cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    state: Dict[str, Any] = {}
    d = p.head_dim

    def dims(heads: int) -> Tuple[List[int], List[int]]:  # bshd storage seen as b, h, s, d
        batch, rows = (documents, longest) if ragged else (1, s)
        return [batch, heads, rows, d], [rows * heads * d, d, heads * d, 1]

    def graph() -> Any:
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensors(g: Any, binds: Dict[Any, Any], names: Dict[str, int]) -> Dict[str, Any]:
        made = {}
        for name, heads in names.items():
            dim, stride = dims(heads)
            made[name] = g.tensor(name=name, dim=dim, stride=stride, data_type=io)
            if ragged:
                made[name].set_ragged_offset(offset(g, binds, heads))
        return made

    def offset(g: Any, binds: Dict[Any, Any], heads: int) -> Any:
        """The graph's ragged-offset tensor for tensors of `heads` heads (elements, not tokens)."""
        key = ("offset", heads)
        if key not in binds:
            binds[key] = g.tensor(name=f"offset_{heads}", dim=[documents + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                  data_type=cudnn.data_type.INT64)
            binds[binds[key]] = state["offsets"][heads]
        return binds[key]

    def lengths(g: Any, binds: Dict[Any, Any]) -> Dict[str, Any]:
        if not ragged:
            return {}
        t = g.tensor(name="seq_len", dim=[documents, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        binds[t] = state["lengths"]
        return {"use_padding_mask": True, "seq_len_q": t, "seq_len_kv": t}

    def build(g: Any, what: str) -> Any:
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as error:
            log(f"cudnn refused the {what} graph:\n{traceback.format_exc()}")
            raise Unsupported(f"cudnn {cudnn.backend_version_string()} refused the {what} graph for "
                              f"{p.pattern}: {type(error).__name__}: {first_line(error)}") from None
        return torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=device)

    def setup(native: Dict[str, Any]) -> None:
        start = time.perf_counter()
        bounds = torch.tensor(cu, dtype=torch.int64, device=device)
        state["lengths"] = (bounds[1:] - bounds[:-1]).to(torch.int32).reshape(-1, 1, 1, 1)
        state["offsets"] = {h: (bounds * h * d).reshape(-1, 1, 1, 1) for h in {p.heads_q, p.heads_kv}}
        fwd, binds = graph(), {}
        t = tensors(fwd, binds, {"q": p.heads_q, "k": p.heads_kv, "v": p.heads_kv})
        o, stats = fwd.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                            attn_scale=p.scale, **mask, **lengths(fwd, binds))
        o_dim, o_stride = dims(p.heads_q)
        o.set_output(True).set_dim(o_dim).set_stride(o_stride)
        if ragged:
            o.set_ragged_offset(offset(fwd, binds, p.heads_q))
        stats.set_output(True).set_data_type(f32)
        state["fwd"] = (fwd, t, o, stats, build(fwd, "forward"), binds)
        batch, rows = o_dim[0], o_dim[2]
        state["stats"] = torch.empty(batch, p.heads_q, rows, 1, dtype=torch.float32, device=device)
        if ragged:  # token t of document b is row t - cu[b] of batch b
            doc = torch.repeat_interleave(torch.arange(documents, device=device), state["lengths"].flatten())
            state["gather"] = (doc, torch.arange(s, device=device) - bounds[:-1][doc])
        if p.backward:
            bwd, binds = graph(), {}
            t = tensors(bwd, binds, {"q": p.heads_q, "k": p.heads_kv, "v": p.heads_kv, "o": p.heads_q, "dO": p.heads_q})
            stats_in = bwd.tensor(name="stats", dim=list(state["stats"].shape),
                                  stride=list(state["stats"].stride()), data_type=f32)
            extra = {"max_total_seq_len_q": s, "max_total_seq_len_kv": s} if ragged else {}
            dq, dk, dv = bwd.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"],
                                           dO=t["dO"], stats=stats_in, attn_scale=p.scale,
                                           **mask, **lengths(bwd, binds), **extra)
            for grad, heads in ((dq, p.heads_q), (dk, p.heads_kv), (dv, p.heads_kv)):
                dim, stride = dims(heads)
                grad.set_output(True).set_dim(dim).set_stride(stride)
                if ragged:
                    grad.set_ragged_offset(offset(bwd, binds, heads))
            state["bwd"] = (bwd, t, stats_in, (dq, dk, dv), build(bwd, "backward"), binds)
        kernel.phases["mask_build_s"] = time.perf_counter() - start

    def execute(g: Any, pack: Dict[Any, Any], workspace: Any, binds: Dict[Any, Any]) -> None:
        pack.update((t, x) for t, x in binds.items() if not isinstance(t, tuple))
        g.execute(pack, workspace, handle=handle)

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        g, t, o, stats, workspace, binds = state["fwd"]
        out = torch.empty_like(q)
        execute(g, {t["q"]: q, t["k"]: k, t["v"]: v, o: out, stats: state["stats"]}, workspace, binds)
        return out, state["stats"]

    def grad(out: Any, q: Any, k: Any, v: Any, do: Any) -> Tuple[Any, Any, Any]:
        g, t, stats_in, outputs, workspace, binds = state["bwd"]
        grads = [torch.empty_like(x) for x in (q, k, v)]
        pack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: out, t["dO"]: do, stats_in: state["stats"]}
        pack.update(zip(outputs, grads))
        execute(g, pack, workspace, binds)
        return tuple(grads)

    def heads(stats: Any) -> Any:  # [batch, H, rows, 1] -> [H, S]
        if not ragged:
            return stats[0, :, :, 0]
        doc, row = state["gather"]
        return stats[doc, :, row, 0].t()

    kernel = Kernel(call=call, grad=grad, setup=setup, layout="bshd", lse_to_heads=heads,
                    refusal_is_unsupported=True, extra_bytes=4 * p.heads_q * documents * longest,
                    env={"backend": "cudnn.pygraph sdpa" + (" / sdpa_backward" if p.backward else ""),
                         "package_version": _package_version(cudnn, "nvidia-cudnn-frontend"),
                         "cudnn_backend": cudnn.backend_version_string()})
    kernel.phases["mask_mode"] = (f"{documents} documents (THD ragged, padding mask), " if ragged else "") + \
        ("causal" if mask.get("use_causal_mask") else
         f"band left {mask.get('diagonal_band_left_bound')} right {mask.get('diagonal_band_right_bound')}"
         if "diagonal_alignment" in mask else "full")
    return kernel
