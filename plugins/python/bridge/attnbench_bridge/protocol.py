"""The JSON-lines protocol on stdin and stdout (see the package's docstring)."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import traceback
from typing import Any, Callable, Optional, Tuple

from .decode import decode
from .dispatch import CELL_OPS, Cell, backends, close
from .harness import release_memory, reporting_to
from .support import BadRequest, first_line, log


PROTOCOL = 3


OPS = {"backends": backends, "decode": decode, **CELL_OPS}


def plain(value: Any) -> Any:
    """JSON-ready copy: numpy scalars to Python, non-finite floats to null."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


Report = Callable[[float], Optional[dict]]


def handle(line: str, report_for: Callable[[Any], Report]) -> Tuple[dict, bool]:
    """The response to one request line, and whether to stop afterwards. `report_for(id)` is how
    the request's timed repetitions reach the host."""
    try:
        request = json.loads(line)
    except ValueError as error:
        return {"id": None, "ok": False, "error": f"malformed request: the line is not JSON ({error})"}, False
    if not isinstance(request, dict):
        return {"id": None, "ok": False, "error": "malformed request: expected a JSON object with id and op"}, False
    rid, op = request.get("id"), request.get("op")
    if op == "shutdown":
        return {"id": rid, "ok": True, "result": None}, True
    if op not in OPS:
        return {"id": rid, "ok": False,
                "error": f"unknown op {op!r}; the bridge knows {', '.join(OPS)} and shutdown"}, False
    params = request.get("params") or {}
    try:
        with reporting_to(report_for(rid)):
            return {"id": rid, "ok": True, "result": OPS[op](params)}, False
    except BadRequest as error:
        reply = {"id": rid, "ok": False, "error": f"bad {op} request: {error}", "kind": "params"}
    except (Exception, SystemExit) as error:
        trace = traceback.format_exc()
        log(trace)
        who = params.get("kernel") if isinstance(params, dict) else None
        who = who or (Cell.session.p.kernel if Cell.session is not None else op)
        reply = {"id": rid, "ok": False, "error": f"{who} raised {type(error).__name__}: {first_line(error)}",
                 "traceback": trace}
    close()  # a failed request ends the open cell
    release_memory()
    return reply, False


def serve() -> int:
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything written to fd 1 from now on (C libraries included) lands on stderr
    sys.stdout = sys.stderr
    # Likewise stdin: the host answers repetition reports mid-request, and a library or child
    # process reading fd 0 must not swallow an answer.
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)
    os.close(quiet)
    sys.stdin = open(os.devnull, encoding="utf-8")

    def send(message: dict) -> None:
        protocol.write(json.dumps(plain(message), allow_nan=False, separators=(",", ":")) + "\n")
        protocol.flush()

    send({"type": "hello", "protocol": PROTOCOL, "python": platform.python_version(),
          "executable": sys.executable, "pid": os.getpid()})

    def report_for(rid: Any) -> Report:
        def report(seconds: float) -> Optional[dict]:
            send({"id": rid, "type": "rep", "seconds": seconds})
            line = requests.readline()
            if not line:
                raise RuntimeError("the host closed stdin while a repetition's report was waiting for its answer")
            answer = json.loads(line)
            if not isinstance(answer, dict) or answer.get("id") != rid or "error" in answer:
                raise RuntimeError(f"the host answered a repetition's report with {line.strip()[:200]}")
            return answer.get("timing")
        return report

    while True:
        line = requests.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        reply, stop = handle(line, report_for)
        send(reply)
        if stop:
            return 0
