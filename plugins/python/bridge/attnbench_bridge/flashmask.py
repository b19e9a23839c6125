"""Paddle's FlashMask: masks with at most two masked row intervals per key."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

from .harness import Kernel, lse_to_heads, require_cuda, require_half, split_result
from .problem import Problem
from .support import Unsupported, _np, need, parameters_of


def flashmask_adapter(p: Problem, torch: Any, device: Any) -> Kernel:
    paddle = need("paddle")
    function = getattr(paddle.nn.functional, "flashmask_attention", None)
    if function is None:
        raise Unsupported(f"paddle {paddle.__version__} has no nn.functional.flashmask_attention")
    require_cuda(p, device)
    require_half(p)
    if p.backward:
        raise Unsupported("the bridge runs flashmask forward only (its backward lives in paddle's autograd)")
    shared = p.shared_mask()
    if shared is None:
        raise Unsupported(f"flashmask runs one mask for every head here; {p.pattern} has masks that differ")
    columns, why = p.flashmask()
    if columns is None:
        raise Unsupported(f"flashmask takes column bounds; {p.pattern} is not expressible that way ({why})")
    np, dlpack = _np(), importlib.import_module("torch.utils.dlpack")
    to_paddle = lambda t: paddle.utils.dlpack.from_dlpack(dlpack.to_dlpack(t))  # noqa: E731
    to_torch = lambda t: dlpack.from_dlpack(paddle.utils.dlpack.to_dlpack(t))  # noqa: E731
    options: Dict[str, Any] = {"causal": columns["causal"]}
    if "return_softmax_lse" in parameters_of(function):
        options["return_softmax_lse"] = True
    state: Dict[str, Any] = {}

    def setup(native: Dict[str, Any]) -> None:
        bounds = np.stack(columns["columns"], axis=-1)[None, None].astype(np.int32)  # [1, 1, S, 2 or 4]
        state["inputs"] = [to_paddle(native[n]) for n in ("q", "k", "v")]
        options["startend_row_indices"] = to_paddle(torch.from_numpy(bounds).to(device))

    def call(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        return split_result(function(*state["inputs"], **options))

    def heads(lse: Any) -> Any:
        return None if lse is None else lse_to_heads(p, to_torch(lse))

    return Kernel(call=call, layout="bshd", setup=setup, lse_to_heads=heads, out_to_torch=to_torch,
                  refusal_is_unsupported=True, sync=paddle.device.synchronize, torch_memory=False,
                  env={"backend": "paddle.nn.functional.flashmask_attention", "paddle": paddle.__version__},
                  phases={"mask_mode": f"{'causal + ' if columns['causal'] else ''}{len(columns['columns'])} column bounds"})
