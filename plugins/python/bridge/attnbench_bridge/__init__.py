"""attnbench's Python bridge: benchmarks attention kernels that live in Python packages.

The attnbench host writes this package and its launcher ``serve_bridge.py`` into a private folder,
starts ``python3 -u serve_bridge.py`` and keeps it running.
It speaks JSON lines: one request per line on stdin, one response per line on stdout.

Protocol (version 3)
--------------------
* On start: ``{"type":"hello","protocol":3,"python":"3.11.7","executable":...,"pid":N}``.
* ``{"id":N,"op":"backends"}`` -> for every kernel name, ``{"available","version","reason"}``.
* A benchmark cell is a sequence of requests, the steps of attnbench's kernel-benchmark protocol
  (the SDK's ``bench::run``); each answers ``{"id":N,"ok":true,"result":{"status":...}}``:

  - ``open`` with the problem (``kernel``, ``direction``, ``shape``, ``dtype``, ``mask``,
    ``encodings``, ``device``, ``layout``, ``gqa``, ``module``) -> ``budget``
    (``{"needed_bytes","free_bytes"}`` on a CUDA device, else null) and ``environment``;
  - ``prepare`` with ``inputs_dir``: the host's inputs, ``q.<dtype>``, ``k``, ``v`` (and ``do``)
    as little-endian bits of the dtype, [heads][seqlen][head_dim];
  - ``forward``, ``backward``: one call each (the first ones compile, and a library's refusal
    becomes the reason);
  - ``outputs`` with ``dir``: writes ``out.f32``, ``lse.f32`` (when the kernel has one) and the
    gradients, f32 in the conventions below -> ``written``, ``notes``;
  - ``time``: the timed repetitions -> ``samples``, ``rel_ci``, ``stopped``, ``memory``,
    ``phases``, ``environment`` (its ``notes`` say what a reader of the numbers should know);
  - ``close``: the cell's memory given back (``open`` closes any open cell too).

  A step that finds the cell unsupported or out of memory answers ``status`` ``unsupported``
  (``scope`` ``machine`` when a package or device is missing here) or ``oom`` with a ``reason``,
  and closes the cell. The host checks the outputs against its f64 reference.
* ``encodings`` carries the mask IR's encodings of the shared mask (``varlen`` and, for
  flashmask, ``flashmask``, each ``{"encoding":...}`` or ``{"refused":why}``; null when heads'
  masks differ).
* While ``time`` runs, each repetition is reported as ``{"id":N,"type":"rep","seconds":S}`` and
  waits for the host's answer, ``{"id":N,"timing":null}`` for another repetition or
  ``{"id":N,"timing":{"samples","rel_ci","stopped"}}`` when its harness stops the run: warm-up,
  stopping rule and caps are the host's, so every measurement follows one. A repetition that
  timed nothing finite (sent as ``null``) gets an error answer and fails the request.
* An unexpected exception gives ``{"id":N,"ok":false,"error":"<one sentence>","traceback":"..."}``
  (``"kind":"params"`` for a bad request), closes the open cell, and the bridge keeps serving.
* ``{"id":N,"op":"shutdown"}`` -> ``{"id":N,"ok":true,"result":null}``, then exit 0; EOF -> exit 0.
* A line that is not a JSON object, or an unknown op -> ``ok:false`` (``id`` null when unknown).

Only the protocol goes to the real stdout: fd 1 and ``sys.stdout`` are pointed at stderr before
anything else runs, so prints from libraries and kernels cannot corrupt the stream. Non-finite
floats (an undefined rel_ci) are sent as ``null``, as serde_json does.

A library kernel that refuses a problem on its first call (SDPA's "No available kernel", an assert
in a FlashAttention build) is reported unsupported with the error's first line; an exception from
a user module is a failure.

Conventions: tensors are batch 1; Q, O, dO, dQ are [heads_q][seqlen][head_dim], K, V, dK, dV
[heads_kv][seqlen][head_dim], LSE [heads_q][seqlen] (natural log of the scaled scores); scale is
1/sqrt(head_dim); query head h reads KV head h // (heads_q / heads_kv). A row with no allowed key
has O = 0 and LSE = -inf and contributes nothing to the gradients.

Third-party kernels
-------------------
``"kernel": "module"`` with ``"module": "/abs/path/user_kernel.py"`` benchmarks a file of your own.
The file is loaded afresh for every request (so edits are picked up) and must define::

    def attention(q, k, v, mask, scale):
        return out            # or (out, lse)

* By default ``q`` is a torch tensor [1, heads_q, S, D] and ``k``, ``v`` are [1, heads_kv, S, D],
  on the requested device and in the requested dtype. ``out`` has q's shape; ``lse``, when given,
  is [1, heads_q, S] or [heads_q, S] (natural log). Backward goes through torch autograd: the
  output must carry a graph back to q, k and v.
* With the module attribute ``BACKEND = "numpy"``, q, k, v are float32 numpy arrays [heads, S, D]
  (values rounded to the dtype) and the call runs on the CPU. Backward then needs
  ``attention_backward(q, k, v, out, lse, dout, mask, scale) -> (dq, dk, dv)``; without it a
  backward request is unsupported.
* ``mask`` is a dict: ``"dense"``: a boolean [S, S] tensor (numpy array for numpy modules), True
  where a key is allowed, built for masks shared by all heads up to S = 32768 (set
  ``DENSE_MASK = False`` to skip it), else None; ``"slices"``: the shared mask's slices as
  ``(q0, q1, k0, k1, kind)`` tuples, None when heads have different masks; ``"set"``: the raw
  mask set (``scope``, ``masks``, ...).
* Optional ``SUPPORTS(mask_set) -> None | str``: return a reason to report the problem as
  unsupported without running it.
* An exception raised while loading or running the module makes the request fail (``ok:false``),
  except ImportError at load time, which reports the kernel as unsupported.
"""

from .dispatch import harness_rep
from .encodings import (block_grid_of, blocks_of, dense_mask, grid_tile_kinds, most_intervals, row_groups_of,
                        row_interval_list, row_interval_pairs, row_intervals, row_keys, uniform_grid)
from .flash import FA4_TILE, block_lookup, tile_kinds
from .flex_forms import form_differs, pattern_mask_mod
from .harness import event_rep
from .problem import parse_problem
from .protocol import serve

__all__ = ["FA4_TILE", "block_grid_of", "block_lookup", "blocks_of", "dense_mask", "event_rep",
           "form_differs", "grid_tile_kinds", "harness_rep", "most_intervals", "parse_problem", "pattern_mask_mod",
           "row_groups_of", "row_interval_list", "row_interval_pairs", "row_intervals", "row_keys", "serve",
           "tile_kinds", "uniform_grid"]
