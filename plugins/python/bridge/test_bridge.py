#!/usr/bin/env python3
"""Stand-alone checks of the attnbench_bridge package over its JSON-lines protocol.

    python3 test_bridge.py [--python /path/to/python] [--quick]

Starts the bridge with the given interpreter (default: this one), drives it like the host does,
and compares its outputs with a float64 reference written here from the slice definitions with
plain loops. Needs numpy in this interpreter; torch paths (sdpa-math, flex on the CPU, torch user
modules) are exercised when the bridge's interpreter has torch.
"""

import argparse
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BRIDGE = os.path.join(HERE, "serve_bridge.py")
# Repetitions this host asks for after one warm-up. The stopping rule itself is attnbench's
# (its harness answers the bridge's reports); this stand-in host only counts.
QUICK_REPS = 4
OUTPUTS = ("out", "lse", "dq", "dk", "dv")

results = {"pass": 0, "fail": 0, "skip": 0}
scratch = []  # temporary folders and files, removed at the end


def temporary_dir(prefix):
    path = tempfile.mkdtemp(prefix=prefix)
    scratch.append(path)
    return path


def check(name, condition, detail=""):
    if condition:
        results["pass"] += 1
        print(f"PASS {name}")
    else:
        results["fail"] += 1
        print(f"FAIL {name}: {detail}")
    return condition


def cuda_available(bridge):
    """Whether torch in the bridge's interpreter sees a GPU."""
    probe = subprocess.run([bridge.hello["executable"], "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def skip(name, why):
    results["skip"] += 1
    print(f"SKIP {name}: {why}")


# ---------------------------------------------------------------------------------------------
# The bridge as a subprocess

class Bridge:
    def __init__(self, python, timeout=300.0, flags=(), script=BRIDGE, args=()):
        self.stderr = tempfile.NamedTemporaryFile("w+", prefix="bridge-stderr-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, *flags, "-B", "-u", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)
        self.lines = queue.Queue()
        self.timeout = timeout
        self.next_id = 0
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self.read()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self):
        line = self.lines.get(timeout=self.timeout)
        if line is None:
            raise RuntimeError(f"the bridge closed stdout; stderr tail:\n{self.stderr_tail()}")
        try:
            return json.loads(line)
        except ValueError:
            raise RuntimeError(f"the bridge wrote a non-JSON line on stdout: {line!r}") from None

    def send_raw(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.read()

    def request(self, op, params=None, reps=QUICK_REPS):
        """Sends a request and answers its repetition reports: one warm-up, then `reps` timed
        repetitions a run."""
        self.next_id += 1
        message = {"id": self.next_id, "op": op}
        if params is not None:
            message["params"] = params
        reply, seen = self.send_raw(json.dumps(message)), []
        while reply.get("type") == "rep" and reply.get("id") == self.next_id:
            seen.append(reply["seconds"])
            timing = None
            if len(seen) == reps + 1:
                timing, seen = {"samples": seen[1:], "rel_ci": None, "stopped": "max reps"}, []
            reply = self.send_raw(json.dumps({"id": self.next_id, "timing": timing}))
        if reply.get("id") != self.next_id:
            raise RuntimeError(f"reply id {reply.get('id')} != request id {self.next_id}")
        return reply

    def cell(self, params, reps=QUICK_REPS):
        """Takes a cell through the protocol's steps as the host does (open, prepare, forward,
        backward, outputs, time, close); returns the reply of the step that ended it, with the
        results of the steps before merged into its result."""
        problem = {k: v for k, v in params.items() if k not in ("inputs_dir", "outputs_dir")}
        steps = [("open", problem), ("prepare", {"inputs_dir": params.get("inputs_dir")}), ("forward", None)]
        if params.get("direction", "fwd") != "fwd":
            steps.append(("backward", None))
        steps += [("outputs", {"dir": params.get("outputs_dir")}), ("time", None)]
        merged = {}
        for op, step_params in steps:
            reply = self.request(op, step_params, reps)
            result = reply.get("result") or {}
            if not reply.get("ok") or result.get("status") != "ok":
                return reply
            merged.update(result)
        self.request("close")
        return dict(reply, result=merged)

    def stderr_tail(self, n=3000):
        self.stderr.flush()
        with open(self.stderr.name) as f:
            return f.read()[-n:]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------
# Masks and the independent reference

def sl(q0, q1, k0, k1, kind):
    return {"q": [q0, q1], "k": [k0, k1], "kind": kind}


def mask_set(pattern, s, slice_lists, scope="shared", varlen=None):
    """A mask set; `varlen`, its documents-with-a-window encoding where the test built it as one."""
    masks = [{"seqlen_q": s, "seqlen_k": s, "slices": slices} for slices in slice_lists]
    mset = {"pattern": pattern, "seqlen": s, "params": {}, "documents": [], "scope": scope, "masks": masks}
    if varlen is not None:
        mset["_varlen"] = varlen
    return mset


def varlen(lengths, left=-1, right=-1):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return {"cu_seqlens": cu, "max_seqlen": max(lengths), "left": left, "right": right}


def slice_keys(mask, q):
    """Allowed keys of row `q` as sorted, merged intervals, from the slice definitions."""
    spans = []
    for x in mask["slices"]:
        (q0, q1), (k0, k1) = x["q"], x["k"]
        if not q0 <= q < q1:
            continue
        lq, lk, i = q1 - q0, k1 - k0, q - q0
        lo = i if x["kind"] in ("inv_causal", "bi_causal") else 0
        hi = min(i + lk - lq + 1, lk) if x["kind"] in ("causal", "bi_causal") else lk
        if hi > max(lo, 0) and lo < lk:
            spans.append([k0 + max(lo, 0), k0 + hi])
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def host_rows(mask):
    """The row runs the host sends (the IR's RowRuns), built here from the slices: a run goes on
    while every interval's ends move by the same 0 or 1 a row."""
    rows, offsets, intervals = [], [0], []
    run = None  # (first row, its intervals, steps or None)
    for q in range(mask["seqlen_q"]):
        keys = slice_keys(mask, q)
        if run is not None and len(keys) == len(run[1]):
            first, base, steps = run
            moved = [(a - lo, b - hi) for (a, b), (lo, hi) in zip(keys, base)]
            if steps is None and all(d in (0, 1) for m in moved for d in m):
                run = (first, base, moved)
                continue
            if steps is not None and all(m == (sa * (q - first), sb * (q - first))
                                         for m, (sa, sb) in zip(moved, steps)):
                continue
        if run is not None:
            close_run(run, rows, offsets, intervals)
        run = (q, keys, None)
    if run is not None:
        close_run(run, rows, offsets, intervals)
    return {"rows": rows + [mask["seqlen_q"]], "offsets": offsets, "intervals": intervals}


def close_run(run, rows, offsets, intervals):
    first, base, steps = run
    rows.append(first)
    for (lo, hi), (a, b) in zip(base, steps or [(0, 0)] * len(base)):
        intervals.append([lo, a, hi, b])
    offsets.append(len(intervals))


def host_grid(masks):
    """The block grid the host sends (the IR's BlockGrid), or its refusal."""
    if any(x["kind"] != "full" for m in masks for x in m["slices"]):
        return {"refused": "it has partial slices, not only full blocks"}
    s = masks[0]["seqlen_q"]
    rows = sorted({0, s} | {e for m in masks for x in m["slices"] for e in x["q"]})
    cols = sorted({0, s} | {e for m in masks for x in m["slices"] for e in x["k"]})
    kept = []
    for m in masks:
        table = np.zeros((len(rows) - 1, len(cols) - 1), bool)
        for x in m["slices"]:
            table[rows.index(x["q"][0]):rows.index(x["q"][1]), cols.index(x["k"][0]):cols.index(x["k"][1])] = True
        runs = []
        for r, line in enumerate(table):
            edges = np.flatnonzero(np.diff(np.concatenate([[0], line.astype(int), [0]])))
            runs += [[r, int(a), int(b)] for a, b in zip(edges[0::2], edges[1::2])]
        kept.append(runs)
    return {"encoding": {"rows": rows, "cols": cols, "kept": kept}}


def request_mask(mset):
    """The mask set and the encodings the host sends with it (the IR computes them there; here
    from the slices, and documents and columns as the test built them)."""
    mask = {k: v for k, v in mset.items() if not k.startswith("_")}
    encodings = {"rows": [host_rows(m) for m in mset["masks"]], "grid": host_grid(mset["masks"]),
                 "varlen": None, "flashmask": None}
    if all(m == mset["masks"][0] for m in mset["masks"][1:]):
        found, columns = mset.get("_varlen"), mset.get("_flashmask")
        encodings["varlen"] = {"encoding": found} if found else {"refused": "not documents with one window"}
        encodings["flashmask"] = {"encoding": columns} if columns else {"refused": "not built as columns"}
    return mask, encodings


def causal(s):
    return [sl(0, s, 0, s, "causal")]


def window(s, w):
    return [sl(0, w, 0, w, "causal"), sl(w, s, 0, s, "bi_causal")]


def documents(lengths, kind):
    slices, start = [], 0
    for n in lengths:
        slices.append(sl(start, start + n, start, start + n, kind))
        start += n
    return slices


def mask_sets(s):
    half, quarter = s // 2, s // 4
    thirds = [s // 3, s // 2, s - s // 3 - s // 2]
    return {
        "causal": mask_set("causal", s, [causal(s)], varlen=varlen([s], right=0)),
        "full": mask_set("full", s, [[sl(0, s, 0, s, "full")]], varlen=varlen([s])),
        "causal_document": mask_set("causal_document", s, [documents(thirds, "causal")], varlen=varlen(thirds, right=0)),
        "full_document": mask_set("full_document", s, [documents([quarter, s - quarter], "full")],
                                  varlen=varlen([quarter, s - quarter])),
        "sliding_window": mask_set("sliding_window_causal", s, [window(s, 16)], varlen=varlen([s], left=16, right=0)),
        # overlapping slices, rows [3s/4, s) with no key, and a slice with no cell at all
        "empty_rows": mask_set("prefix_with_gaps", s, [[sl(0, half, 0, s, "full"),
                                                         sl(quarter, s, half, s, "inv_causal"),
                                                         sl(0, s, 0, half, "bi_causal")]]),
        # two key intervals per row (global tokens + window): dense-only for most kernels
        "global_window": mask_set("global_window", s, [window(s, 8) + [sl(0, s, 0, 4, "full")]]),
        "per_kv_group": mask_set("per_group", s, [causal(s), window(s, 12)], scope="per_kv_group"),
        "per_head": mask_set("per_head", s, [causal(s), window(s, 5), documents([half, s - half], "full"),
                                            [sl(0, half, 0, s, "full")]], scope="per_head"),
    }


def cell_allowed(slice_, q, k):
    (q0, q1), (k0, k1) = slice_["q"], slice_["k"]
    if not (q0 <= q < q1 and k0 <= k < k1):
        return False
    i, j, d = q - q0, k - k0, (k1 - k0) - (q1 - q0)
    kind = slice_["kind"]
    if kind == "full":
        return True
    if kind == "causal":
        return j <= i + d
    if kind == "inv_causal":
        return j >= i
    return i <= j <= i + d  # bi_causal


def dense_reference(mask):
    s = mask["seqlen_q"]
    return np.array([[any(cell_allowed(x, q, k) for x in mask["slices"]) for k in range(s)] for q in range(s)])


def head_masks(mset, hq, hkv):
    dense = [dense_reference(m) for m in mset["masks"]]
    scope = mset["scope"]
    return [dense[0 if scope == "shared" else h // (hq // hkv) if scope == "per_kv_group" else h] for h in range(hq)]


def reference(q, k, v, do, masks, group, scale):
    """Row-by-row float64 attention forward and backward."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    hq, s, _ = q.shape
    out, lse, dq = np.zeros_like(q), np.full((hq, s), -np.inf), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(hq):
        g = h // group
        for i in range(s):
            keys = np.nonzero(masks[h][i])[0]
            if keys.size == 0:
                continue
            scores = k[g][keys] @ q[h, i] * scale
            top = scores.max()
            weights = np.exp(scores - top)
            probs = weights / weights.sum()
            out[h, i] = probs @ v[g][keys]
            lse[h, i] = top + math.log(weights.sum())
            ds = probs * (v[g][keys] @ do[h, i] - do[h, i] @ out[h, i]) * scale
            dq[h, i] = ds @ k[g][keys]
            dk[g][keys] += np.outer(ds, q[h, i])
            dv[g][keys] += np.outer(probs, do[h, i])
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def rel_error(actual, expected):
    """Largest |a - r| over largest |r|; -inf must match -inf; NaN fails."""
    a, r = np.asarray(actual, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    if a.shape != r.shape or np.isnan(a).any():
        return math.inf
    inf = np.isinf(a) | np.isinf(r)
    if (a[inf] != r[inf]).any():
        return math.inf
    largest = np.abs(r[~inf]).max() if (~inf).any() else 0.0
    worst = np.abs(a[~inf] - r[~inf]).max() if (~inf).any() else 0.0
    return worst / largest if largest else worst


# ---------------------------------------------------------------------------------------------
# Scenarios

def round_bf16(x):
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


class Case:
    def __init__(self, hq=4, hkv=2, s=64, d=32, seed=7, bf16=False):
        self.hq, self.hkv, self.s, self.d = hq, hkv, s, d
        rng = np.random.default_rng(seed)
        shape_q, shape_kv = (hq, s, d), (hkv, s, d)
        self.inputs = {"q": rng.uniform(-1, 1, shape_q), "k": rng.uniform(-1, 1, shape_kv),
                       "v": rng.uniform(-1, 1, shape_kv), "do": rng.uniform(-1, 1, shape_q)}
        self.inputs = {n: (round_bf16 if bf16 else np.float32)(x.astype(np.float32)) for n, x in self.inputs.items()}
        self.dir = temporary_dir("bridge-case-")
        for name, x in self.inputs.items():  # as the host stores them: the dtype's bits
            x.astype("<f4").tofile(os.path.join(self.dir, f"{name}.f32"))
            (round_bf16(x).view(np.uint32) >> 16).astype("<u2").tofile(os.path.join(self.dir, f"{name}.bf16"))
            x.astype("<f2").tofile(os.path.join(self.dir, f"{name}.fp16"))
        self.expected = {}

    def shape(self):
        return {"heads_q": self.hq, "heads_kv": self.hkv, "seqlen": self.s, "head_dim": self.d}

    def params(self, kernel, mset, direction="fwd", dtype="f32", **extra):
        mask, encodings = request_mask(mset)
        params = {"kernel": kernel, "direction": direction, "shape": self.shape(), "dtype": dtype,
                  "mask": mask, "encodings": encodings, "inputs_dir": self.dir,
                  "outputs_dir": temporary_dir("bridge-out-"), "device": "cpu"}
        params.update(extra)
        return params

    def reference(self, name, mset):
        if name not in self.expected:
            masks = head_masks(mset, self.hq, self.hkv)
            x = self.inputs
            self.expected[name] = reference(x["q"], x["k"], x["v"], x["do"], masks, self.hq // self.hkv, 1 / math.sqrt(self.d))
        return self.expected[name]

    def compare(self, label, name, mset, params, result, tolerance, expect_lse=True):
        """Checks the written outputs against the reference."""
        want = self.reference(name, mset)
        names = ["out", "lse"] + (["dq", "dk", "dv"] if params["direction"] != "fwd" else [])
        worst = {}
        for n in names:
            path = os.path.join(params["outputs_dir"], f"{n}.f32")
            if n == "lse" and not expect_lse:
                check(f"{label}: no lse.f32 written", not os.path.exists(path))
                continue
            if not os.path.exists(path):
                check(f"{label}: {n}.f32 written", False, "missing")
                continue
            worst[n] = rel_error(np.fromfile(path, "<f4").reshape(want[n].shape), want[n])
        ok = all(e <= tolerance for e in worst.values())
        check(f"{label}: outputs match the float64 reference", ok,
              f"errors {worst} > {tolerance}; notes {result['environment'].get('notes')}")


def check_timing(label, result):
    """The timing is the host's: the repetitions it asked for, each timed, its verdict echoed."""
    samples = result["samples"]
    fine = len(samples) == QUICK_REPS and all(x > 0 for x in samples) and result["stopped"] == "max reps"
    check(f"{label}: timed the {QUICK_REPS} repetitions the host asked for", fine,
          json.dumps({k: result[k] for k in ("samples", "rel_ci", "stopped")}))


def run_ok(bridge, label, params):
    reply = bridge.cell(params)
    if not check(f"{label}: ok reply", reply.get("ok") and reply["result"]["status"] == "ok",
                 json.dumps(reply)[:1500]):
        return None
    return reply["result"]


def expect_unsupported(bridge, label, params, needles, scope=None):
    """`needles`: one of them is in the reason; `scope` "machine": what is missing is this
    machine's (a package, CUDA), not the case's."""
    reply = bridge.cell(params)
    result = reply.get("result") or {}
    reason = result.get("reason") or ""
    found = any(n.lower() in reason.lower() for n in ([needles] if isinstance(needles, str) else needles))
    check(f"{label}: unsupported ({reason})", reply.get("ok") and result.get("status") == "unsupported"
          and found and result.get("scope") == scope, json.dumps(reply)[:1500])


def test_protocol(bridge, python):
    hello = bridge.hello
    check("hello line", hello.get("type") == "hello" and hello.get("protocol") == 3
          and hello.get("pid") == bridge.proc.pid and hello.get("executable"), json.dumps(hello))
    reply = bridge.send_raw("this is not json")
    check("malformed line -> ok:false, id null", reply == {**reply, "id": None, "ok": False}
          and "not JSON" in reply.get("error", ""), json.dumps(reply))
    reply = bridge.send_raw("[1, 2]")
    check("non-object line -> ok:false", reply.get("ok") is False and reply.get("id") is None, json.dumps(reply))
    reply = bridge.request("dance")
    check("unknown op -> ok:false naming it", reply.get("ok") is False and "dance" in reply.get("error", ""), json.dumps(reply))
    case = Case()
    bad = case.params("numpy", mask_sets(case.s)["causal"])
    bad["shape"] = dict(bad["shape"], heads_q=6, heads_kv=4)
    reply = bridge.request("open", bad)
    check("bad heads -> ok:false", reply.get("ok") is False and "multiple" in reply.get("error", ""), json.dumps(reply))
    bad = case.params("no-such-kernel", mask_sets(case.s)["causal"])
    reply = bridge.request("open", bad)
    check("unknown kernel -> ok:false, a params failure", reply.get("ok") is False
          and "unknown kernel" in reply.get("error", "") and reply.get("kind") == "params", json.dumps(reply))
    bad = case.params("numpy", mask_sets(case.s)["per_kv_group"])
    bad["shape"] = dict(bad["shape"], heads_kv=4)
    reply = bridge.request("open", bad)
    check("mask count mismatch -> ok:false", reply.get("ok") is False and "masks" in reply.get("error", ""), json.dumps(reply))
    reply = bridge.request("open", case.params("numpy", mask_sets(case.s)["causal"], layout="hsd"))
    check("unknown layout -> ok:false naming the choices", reply.get("ok") is False
          and "layout must be one of auto, bshd, bhsd" in reply.get("error", ""), json.dumps(reply))
    reply = bridge.request("open", case.params("numpy", mask_sets(case.s)["causal"], gqa="repeat"))
    check("unknown gqa mode -> ok:false naming the choices", reply.get("ok") is False
          and "gqa must be one of native, expand" in reply.get("error", ""), json.dumps(reply))
    reply = bridge.request("forward")
    check("a step without an open cell -> ok:false, a params failure", reply.get("ok") is False
          and "no cell is open" in reply.get("error", "") and reply.get("kind") == "params", json.dumps(reply))
    params = case.params("numpy", mask_sets(case.s)["causal"])
    bridge.request("open", params)
    reply = bridge.request("prepare", {"inputs_dir": temporary_dir("bridge-empty-")})
    check("prepare without the inputs -> ok:false naming the file", reply.get("ok") is False
          and "q.f32" in reply.get("error", ""), json.dumps(reply))
    reply = bridge.request("forward")
    check("a failed step closes the cell", reply.get("ok") is False and "no cell is open" in reply.get("error", ""),
          json.dumps(reply))


def test_backends(bridge):
    reply = bridge.request("backends")
    report = reply.get("result") or {}
    kernels = ["numpy", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "fa2", "fa3",
               "fa4", "cudnn", "flashinfer", "flashmask", "module"]
    check("backends lists every kernel", reply.get("ok") and sorted(report) == sorted(kernels), json.dumps(reply))
    check("backends: numpy available", report.get("numpy", {}).get("available"), json.dumps(report.get("numpy")))
    for name, entry in report.items():
        if not entry["available"]:
            check(f"backends: {name} unavailable with a reason ({entry['reason']})",
                  bool(entry["reason"]) and entry["version"] is None, json.dumps(entry))
    return report


def test_numpy(bridge, quick):
    case = Case()
    sets = mask_sets(case.s)
    names = ["causal", "empty_rows", "per_head"] if quick else list(sets)
    for name in names:
        for direction in ("fwd", "fwd_bwd"):
            params = case.params("numpy", sets[name], direction)
            result = run_ok(bridge, f"numpy {name} {direction}", params)
            if result:
                case.compare(f"numpy {name} {direction}", name, sets[name], params, result, 1e-5)
                if name == "causal" and direction == "fwd_bwd":
                    check_timing("numpy causal fwd_bwd", result)
                    memory = result.get("memory") or {}
                    check("numpy memory via tracemalloc", "tracemalloc" in memory.get("method", "")
                          and memory.get("peak_bytes", 0) >= memory.get("above_inputs_bytes", -1) > 0, json.dumps(memory))
    # bwd alone, and the sampled self-check with generated inputs in every dtype
    params = case.params("numpy", sets["sliding_window"], "bwd")
    result = run_ok(bridge, "numpy sliding_window bwd", params)
    if result:
        case.compare("numpy sliding_window bwd", "sliding_window", sets["sliding_window"], params, result, 1e-5)
    # bf16 and fp16 inputs arrive as the dtype's bits: the numpy kernel computes on their values
    rounded = Case(bf16=True)
    for dtype in ("bf16", "fp16"):
        params = rounded.params("numpy", sets["empty_rows"], "fwd_bwd", dtype)
        result = run_ok(bridge, f"numpy {dtype} inputs", params)
        if result:
            rounded.compare(f"numpy {dtype} inputs", "empty_rows", sets["empty_rows"], params, result, 1e-5)


def write_module(text):
    handle = tempfile.NamedTemporaryFile("w", suffix=".py", prefix="user_kernel_", delete=False)
    handle.write(text)
    handle.close()
    scratch.append(handle.name)
    return handle.name


NUMPY_MODULE = '''
import numpy as np
BACKEND = "numpy"

def attention(q, k, v, mask, scale):
    print("a chatty kernel prints to stdout")   # must not reach the protocol
    import os; os.write(1, b"and writes to fd 1 directly\\n")
    group = q.shape[0] // k.shape[0]
    allowed = mask["dense"]
    out = np.zeros_like(q); lse = np.full(q.shape[:2], -np.inf, np.float32)
    for h in range(q.shape[0]):
        s = (q[h] @ k[h // group].T) * scale
        s = np.where(allowed, s, -np.inf)
        top = s.max(axis=1, keepdims=True); top = np.where(np.isfinite(top), top, 0)
        w = np.exp(s - top); total = w.sum(axis=1, keepdims=True)
        out[h] = (w @ v[h // group]) / np.where(total > 0, total, 1)
        with np.errstate(divide="ignore"):
            lse[h] = np.where(total[:, 0] > 0, top[:, 0] + np.log(np.where(total[:, 0] > 0, total[:, 0], 1)), -np.inf)
    return out, lse

def SUPPORTS(mask_set):
    if mask_set["scope"] != "shared":
        return "this kernel takes one shared mask only"
    return None
'''

TORCH_MODULE = '''
import torch

def attention(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1); v = v.repeat_interleave(group, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask["dense"], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return (p @ v.float()).to(q.dtype), lse
'''

RAISING_MODULE = '''
def attention(q, k, v, mask, scale):
    raise ValueError("kernel exploded on purpose")
BACKEND = "numpy"
'''


def test_modules(bridge, has_torch):
    case = Case()
    sets = mask_sets(case.s)
    path = write_module(NUMPY_MODULE)
    params = case.params("module", sets["causal_document"], "fwd", module=path)
    result = run_ok(bridge, "numpy module fwd (prints to stdout)", params)
    if result:
        case.compare("numpy module fwd", "causal_document", sets["causal_document"], params, result, 1e-5)
    expect_unsupported(bridge, "numpy module without attention_backward",
                       case.params("module", sets["causal"], "bwd", module=path), "attention_backward")
    expect_unsupported(bridge, "module SUPPORTS refusal",
                       case.params("module", sets["per_kv_group"], "fwd", module=path), "one shared mask")
    path = write_module(RAISING_MODULE)
    reply = bridge.cell(case.params("module", sets["causal"], "fwd", module=path))
    error = reply.get("error", "")
    check("raising kernel -> ok:false with one sentence", reply.get("ok") is False
          and "ValueError: kernel exploded on purpose" in error and "\n" not in error
          and "Traceback" in reply.get("traceback", ""), json.dumps(reply)[:800])
    check("bridge still serves after a raising kernel", bridge.request("backends").get("ok") is True)
    path = write_module("import a_package_that_does_not_exist_anywhere\n")
    expect_unsupported(bridge, "module with a missing import", case.params("module", sets["causal"], "fwd", module=path),
                       "not importable", scope="machine")
    path = write_module("def attention(:\n")
    reply = bridge.cell(case.params("module", sets["causal"], "fwd", module=path))
    check("module with a syntax error -> ok:false", reply.get("ok") is False and "SyntaxError" in reply.get("error", ""),
          json.dumps(reply)[:800])
    if not has_torch:
        skip("torch module", "the bridge's python has no torch")
        return
    path = write_module(TORCH_MODULE)
    for direction in ("fwd", "fwd_bwd"):
        params = case.params("module", sets["empty_rows"], direction, module=path)
        result = run_ok(bridge, f"torch module {direction}", params)
        if result:
            case.compare(f"torch module {direction}", "empty_rows", sets["empty_rows"], params, result, 1e-5)


def test_torch(bridge, report, quick):
    if not report.get("sdpa-math", {}).get("available"):
        skip("torch kernels", "the bridge's python has no torch")
        return
    case = Case()
    sets = mask_sets(case.s)
    names = ["causal", "empty_rows", "per_kv_group"] if quick else ["causal", "full", "causal_document", "empty_rows",
                                                                    "global_window", "per_kv_group", "per_head"]
    for name in names:
        params = case.params("sdpa-math", sets[name], "fwd_bwd")
        result = run_ok(bridge, f"sdpa-math {name} fwd_bwd", params)
        if result:
            case.compare(f"sdpa-math {name}", name, sets[name], params, result, 1e-5, expect_lse=False)
            mode = result["phases"].get("mask_mode")
            if name == "causal":
                check("sdpa-math recognises causal from the slices", mode == "is_causal=True", mode)
                check_timing("sdpa-math causal fwd_bwd", result)
                check("sdpa-math reports the environment", result["environment"].get("torch")
                      and result["environment"].get("backend", "").endswith("MATH"), json.dumps(result["environment"]))
    for layout, described in (("bshd", "bshd storage, bhsd view"), ("bhsd", "contiguous bhsd")):
        params = case.params("sdpa-math", sets["causal_document"], "fwd_bwd", layout=layout)
        result = run_ok(bridge, f"sdpa-math layout {layout}", params)
        if result:
            case.compare(f"sdpa-math layout {layout}", "causal_document", sets["causal_document"], params, result,
                         1e-5, expect_lse=False)
            check(f"sdpa-math layout {layout} is recorded", result["environment"].get("inputs") == described,
                  json.dumps(result["environment"]))
    params = case.params("sdpa-math", sets["causal_document"], "fwd_bwd", gqa="expand")
    result = run_ok(bridge, "sdpa-math gqa expand", params)
    if result:
        case.compare("sdpa-math gqa expand", "causal_document", sets["causal_document"], params, result, 1e-5,
                     expect_lse=False)
        check("sdpa-math gqa expand is recorded", "expanded" in result["environment"].get("gqa", ""),
              json.dumps(result["environment"]))
    expect_unsupported(bridge, "flex with gqa expand", case.params("flex", sets["causal"], gqa="expand"),
                       "applies to the SDPA kernels")
    params = case.params("sdpa-math", sets["sliding_window"], "bwd", dtype="bf16")
    result = run_ok(bridge, "sdpa-math bf16 bwd", params)
    if result:
        case.compare("sdpa-math bf16 bwd", "sliding_window", sets["sliding_window"], params, result, 2e-2,
                     expect_lse=False)
    expect_unsupported(bridge, "sdpa-flash with a document mask", case.params("sdpa-flash", sets["causal_document"]),
                       "takes no arbitrary mask")
    reply = bridge.cell(case.params("sdpa-efficient", sets["causal"]))
    result = reply.get("result") or {}
    check(f"sdpa-efficient on cpu: ok or unsupported with a reason ({result.get('reason')})", reply.get("ok")
          and (result.get("status") == "ok" or (result.get("status") == "unsupported" and result.get("reason"))),
          json.dumps(reply)[:800])
    if cuda_available(bridge):
        skip("sdpa-math on cuda without CUDA", "this machine has CUDA")
    else:
        expect_unsupported(bridge, "sdpa-math on cuda without CUDA",
                           dict(case.params("sdpa-math", sets["causal"]), device="cuda"), "CUDA is not available",
                           scope="machine")
    # FA4's wheel installs a `flash_attn` package without FA2's entry points.
    for kernel, needle in (("fa2", ("flash_attn not importable", "no flash_attn_func")), ("fa3", "flash_attn_interface not importable"),
                           ("fa4", "not importable"), ("flashinfer", "flashinfer not importable"),
                           ("flashmask", "paddle not importable")):
        if report.get(kernel, {}).get("available"):
            skip(kernel, "installed here")
        else:
            expect_unsupported(bridge, kernel, case.params(kernel, sets["causal"], device="cuda"), needle,
                               scope="machine")
    if not report.get("flex", {}).get("available"):
        skip("flex", "not importable")
        return
    flex_names = ["causal_document"] if quick else ["causal", "causal_document", "empty_rows", "global_window", "per_kv_group"]
    for name in flex_names:
        params = case.params("flex", sets[name], "fwd")
        reply = bridge.cell(params)
        result = reply.get("result") or {}
        if reply.get("ok") and result.get("status") == "unsupported":
            skip(f"flex {name} on cpu", result.get("reason"))
            continue
        if check(f"flex {name} fwd on cpu: ok", reply.get("ok") and result.get("status") == "ok", json.dumps(reply)[:1500]):
            case.compare(f"flex {name}", name, sets[name], params, result, 1e-5, expect_lse=False)
            check(f"flex {name}: compile and mask phases recorded", "compile_s" in result["phases"]
                  and "mask_build_s" in result["phases"], json.dumps(result["phases"]))
    expect_unsupported(bridge, "flex backward on cpu", case.params("flex", sets["causal"], "fwd_bwd"), "forward only")
    # Block-sparse masks become a BlockMask of full blocks (no mask_mod), or, on blocks that do not
    # fall on flex's tiles, of tiles reading a per-block table; two key intervals a row, a table of them.
    big, rng = Case(s=256), np.random.default_rng(3)

    def blocks(size):  # the diagonal block and about half of the others
        return [sl(a, a + size, c, c + size, "full") for a in range(0, 256, size) for c in range(0, 256, size)
                if a == c or rng.random() < 0.5]

    lower = [sl(0, 128, 0, 128, "full"), sl(128, 256, 0, 256, "full")]  # one key interval per row, on blocks
    for name, mset, mode in (("block_sparse_128", mask_set("block_sparse_128", 256, [lower]), "128-token blocks"),
                             ("block_sparse_128_per_group", mask_set("block_sparse_128", 256, [blocks(128), lower],
                                                                     scope="per_kv_group"), "128-token blocks"),
                             ("block_sparse_64", mask_set("block_sparse_64", 256, [blocks(64)]), "per-block table"),
                             ("block_sparse_64_per_group", mask_set("block_sparse_64", 256, [blocks(64), blocks(64)],
                                                                    scope="per_kv_group"), "per-block table"),
                             ("global_window", mask_set("global_window", 256, [window(256, 8) + [sl(0, 256, 0, 4, "full")]]),
                              "two key intervals a row")):
        params = big.params("flex", mset, "fwd")
        result = run_ok(bridge, f"flex {name} fwd on cpu", params)
        if result:
            big.compare(f"flex {name}", name, mset, params, result, 1e-5, expect_lse=False)
            check(f"flex {name}: {mode}", mode in result["phases"].get("mask_mode", ""), json.dumps(result["phases"]))
    # A pattern with a closed form of its own (its parameters and documents, as masks/generate
    # records them) runs it; a set whose slices are not its pattern's keeps the interval table.
    lengths, prefix = [40, 100, 116], 24
    starts = [0, 40, 140]
    share = mask_set("share_question", 256, [[sl(a, a + n, a, a + n, "causal") for a, n in zip(starts, lengths)]
                                             + [sl(40, 256, 0, 40, "full")]])
    share["documents"] = lengths
    prefixed = mask_set("prefix_lm_document", 256, [[sl(a, a + n, a, a + min(prefix, n), "full") for a, n in
                                                     zip(starts, lengths)] + documents(lengths, "causal")])
    prefixed["documents"], prefixed["params"] = lengths, {"prefix": prefix}
    mislabelled = json.loads(json.dumps(share))
    mislabelled["documents"] = [100, 40, 116]
    for name, mset, mode in (("share_question", share, "answers see the question"),
                             ("prefix_lm_document", prefixed, "kv - its start < 24"),
                             ("share_question with other documents", mislabelled, "two key intervals a row")):
        params = big.params("flex", mset, "fwd")
        result = run_ok(bridge, f"flex {name} fwd on cpu", params)
        if result:
            big.compare(f"flex {name}", name, mset, params, result, 1e-5, expect_lse=False)
            check(f"flex {name}: {mode}", mode in result["phases"].get("mask_mode", ""), json.dumps(result["phases"]))
    # Blocks of 40 over 200 tokens: tiles cut blocks, and the last tile runs past the sequence.
    odd = Case(s=200)
    mset = mask_set("block_sparse_40", 200, [[sl(a, min(a + 40, 200), c, min(c + 40, 200), "full")
                                              for a in range(0, 200, 40) for c in range(0, 200, 40)
                                              if a == c or rng.random() < 0.5]])
    params = odd.params("flex", mset, "fwd")
    result = run_ok(bridge, "flex block_sparse_40 fwd on cpu", params)
    if result:
        odd.compare("flex block_sparse_40", "block_sparse_40", mset, params, result, 1e-5, expect_lse=False)
        check("flex block_sparse_40: per-block table", "per-block table" in result["phases"].get("mask_mode", ""),
              json.dumps(result["phases"]))


# What a peer itself gets wrong, seen on an H100 (torch 2.11, cuDNN 9.19): a cell of it is
# recorded with its check failed, which is the peer's result, not the bridge's.
PEER_FINDINGS = {("sdpa-cudnn", "empty_rows"): "SDPA's cuDNN backward gives rows with no allowed key "
                                               "gradients (dK 8% off the reference)"}


def test_gpu(bridge, report):
    """CUDA kernels at bf16: outputs against the reference at a small size and a larger one, and
    the memory estimate of a problem that cannot fit."""
    case = Case(hq=8, hkv=2, s=256, d=64, bf16=True)
    sets = mask_sets(case.s)
    kernels = [k for k in ("sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "fa2", "fa3",
                           "fa4", "cudnn", "flashinfer", "flashmask") if report.get(k, {}).get("available")]
    for kernel in kernels:
        names = ("causal_document", "empty_rows", "per_kv_group") if kernel == "flex" else \
            ("causal", "causal_document", "sliding_window", "empty_rows", "per_kv_group")
        for name in names:  # flex compiles once per request: fewer masks keep the run short
            direction = "fwd" if kernel in ("flashinfer", "flashmask") else "fwd_bwd"
            params = case.params(kernel, sets[name], direction, dtype="bf16", device="cuda")
            reply = bridge.cell(params)
            result = reply.get("result") or {}
            label = f"cuda {kernel} {name}"
            if reply.get("ok") and result.get("status") == "unsupported" and result.get("reason"):
                print(f"INFO {label}: unsupported ({result['reason']})")
                continue
            if check(f"{label}: ok", reply.get("ok") and result.get("status") == "ok", json.dumps(reply)[:1500]):
                lse = os.path.exists(os.path.join(params["outputs_dir"], "lse.f32"))
                if (kernel, name) in PEER_FINDINGS:
                    print(f"INFO {label}: not compared: {PEER_FINDINGS[(kernel, name)]}")
                    continue
                case.compare(label, name, sets[name], params, result, 2e-2, expect_lse=lse)
                print(f"INFO {label}: lse {'written' if lse else 'absent'}, memory {result['memory']}, "
                      f"phases {result['phases']}, notes {result['environment'].get('notes')}")
    s = 2048
    big = Case(hq=8, hkv=2, s=s, d=128, bf16=True)
    lengths = [500, 1000, 548]
    mset = mask_set("causal_document", s, [documents(lengths, "causal")], varlen=varlen(lengths, right=0))
    # FlashMask's columns of causal documents: key k's rows from its document's end on are masked.
    ends = np.repeat(np.cumsum(lengths), lengths).tolist()
    mset["_flashmask"] = {"causal": True, "lts": ends, "lte": [s] * s, "uts": [0] * s, "ute": [0] * s}
    for kernel in kernels:
        direction = "fwd" if kernel in ("flashinfer", "flashmask") else "fwd_bwd"
        params = big.params(kernel, mset, direction, dtype="bf16", device="cuda")
        reply = bridge.cell(params, reps=10)
        result = reply.get("result") or {}
        label = f"cuda {kernel} 8x2 heads, 2k causal_document {direction}"
        if reply.get("ok") and result.get("status") == "unsupported":
            print(f"INFO {label}: unsupported ({result['reason']})")
            continue
        if check(f"{label}: ok", reply.get("ok") and result.get("status") == "ok", json.dumps(reply)[:1500]):
            lse = os.path.exists(os.path.join(params["outputs_dir"], "lse.f32"))
            big.compare(label, "causal_document", mset, params, result, 2e-2, expect_lse=lse)
            median = float(np.median(result["samples"]))
            print(f"INFO {label}: median {median * 1e3:.3f} ms over {len(result['samples'])} ({result['stopped']}), "
                  f"memory {result['memory']}, phases {result['phases']}, env {result['environment']}")
    huge = {"heads_q": 64, "heads_kv": 8, "seqlen": 1 << 18, "head_dim": 128}
    mask, encodings = request_mask(mask_set("causal", 1 << 18, [causal(1 << 18)], varlen=varlen([1 << 18], right=0)))
    params = {"kernel": "sdpa-math", "direction": "fwd", "shape": huge, "dtype": "bf16",
              "mask": mask, "encodings": encodings, "device": "cuda"}
    reply = bridge.request("open", params)
    budget = (reply.get("result") or {}).get("budget") or {}
    check(f"cuda sdpa-math at 256k tokens: open's budget exceeds the free memory ({budget})",
          reply.get("ok") and budget.get("needed_bytes", 0) > budget.get("free_bytes", 1 << 62), json.dumps(reply)[:800])
    bridge.request("close")


def test_encodings():
    """The bridge's expansions of the host's mask encodings (imported, no subprocess) against the
    slice definitions."""
    sys.path.insert(0, HERE)
    sys.dont_write_bytecode = True  # leave no __pycache__ beside the bridge
    import attnbench_bridge as bridge
    s = 64
    for name, mset in mask_sets(s).items():
        for index, mask in enumerate(mset["masks"]):
            label = f"{name}[{index}]"
            want = dense_reference(mask)
            groups = bridge.row_groups_of(host_rows(mask))
            check(f"encodings {label}: dense mask", (bridge.dense_mask(groups, s) == want).all())
            rows = np.zeros_like(want)
            for q in range(s):
                for a, b in bridge.row_keys(groups, q):
                    rows[q, a:b] = True
            check(f"encodings {label}: row keys", (rows == want).all())
            lo, hi, count = bridge.row_intervals(groups)
            runs = [(np.diff(np.concatenate([[0], r.astype(int), [0]])) == 1).sum() for r in want]
            check(f"encodings {label}: row intervals", list(count) == runs)
            pairs = bridge.row_interval_pairs(groups)
            if pairs is None:
                check(f"encodings {label}: two intervals a row refused only past two", max(runs) > 2)
            else:
                k = np.arange(s)[None, :]
                decoded = ((k >= pairs[0][:, None]) & (k < pairs[1][:, None])) | ((k >= pairs[2][:, None]) & (k < pairs[3][:, None]))
                check(f"encodings {label}: two intervals a row decode back", (decoded == want).all())
            most = bridge.most_intervals(groups)
            table = bridge.row_interval_list(groups, max(most, 1))
            k = np.arange(s)[None, :]
            decoded = np.zeros_like(want)
            for lo, hi in zip(table[0::2], table[1::2]):
                decoded |= (k >= lo[:, None]) & (k < hi[:, None])
            check(f"encodings {label}: {most} intervals a row decode back", most == max(runs) and (decoded == want).all())
            check(f"encodings {label}: fewer intervals a row refused", most == 0 or bridge.row_interval_list(groups, most - 1) is None)
            encoding = mset.get("_varlen") if mset["scope"] == "shared" else None
            if encoding is not None:  # the encodings this test sends as the host's decode back
                cu, left, right = encoding["cu_seqlens"], encoding["left"], encoding["right"]
                decoded = np.zeros_like(want)
                for start, end in zip(cu[:-1], cu[1:]):
                    for q in range(start, end):
                        for k in range(start, end):
                            decoded[q, k] = (left < 0 or q - k <= left) and (right < 0 or k - q <= right)
                check(f"encodings {label}: varlen {encoding} decodes back", (decoded == want).all())
    # Random unions of slices of every kind, overlapping, empty and crossing each other's bands:
    # the row groups of their runs (moving and standing) against the dense mask.
    rng = np.random.default_rng(3)
    kinds = ("full", "causal", "inv_causal", "bi_causal")
    for trial in range(40):
        slices = []
        for _ in range(int(rng.integers(1, 9))):
            q0, q1 = sorted(int(x) for x in rng.integers(0, s + 1, 2))
            k0, k1 = sorted(int(x) for x in rng.integers(0, s + 1, 2))
            slices.append(sl(q0, q1, k0, k1, kinds[int(rng.integers(0, 4)) if trial % 2 else 0]))
        mask = {"seqlen_q": s, "seqlen_k": s, "slices": slices}
        want = dense_reference(mask)
        runs = np.array([(np.diff(np.concatenate([[0], r.astype(int), [0]])) == 1).sum() for r in want])
        groups = bridge.row_groups_of(host_rows(mask))
        lo, hi, count = bridge.row_intervals(groups)
        nonempty = runs > 0
        hull = all(want[q, lo[q]] and want[q, hi[q] - 1] and not want[q, :lo[q]].any() and not want[q, hi[q]:].any()
                   for q in np.nonzero(nonempty)[0])
        most = bridge.most_intervals(groups)
        table = bridge.row_interval_list(groups, max(most, 1))
        decoded = np.zeros_like(want)
        for a, b in zip(table[0::2], table[1::2]):
            decoded |= (np.arange(s)[None, :] >= a[:, None]) & (np.arange(s)[None, :] < b[:, None])
        check(f"encodings: random slices {trial} ({len(slices)}): counts, hulls and intervals decode back",
              (count == runs).all() and hull and most == runs.max() and (decoded == want).all()
              and (bridge.dense_mask(groups, s) == want).all())
    def expand(grid, index):
        rows, cols, kept = grid
        dense = np.zeros((rows[-1], cols[-1]), bool)
        for i, j in zip(*np.nonzero(kept[index])):
            dense[rows[i]:rows[i + 1], cols[j]:cols[j + 1]] = True
        return dense

    rng = np.random.default_rng(5)
    variable = []
    for size in (8, 16):  # two heads' patterns on different block sizes: a shared finer grid
        edges = list(range(0, s + 1, size))
        variable.append({"seqlen_q": s, "seqlen_k": s, "slices": [
            {"q": [a, b], "k": [c, d], "kind": "full"}
            for a, b in zip(edges[:-1], edges[1:]) for c, d in zip(edges[:-1], edges[1:]) if rng.random() < 0.4]})
    grid = bridge.block_grid_of(host_grid(variable)["encoding"])
    check("encodings: block grid of two block sizes", grid is not None
          and all((expand(grid, i) == dense_reference(m)).all() for i, m in enumerate(variable)))
    check("encodings: a grid of 8- and 16-token blocks stays as it is",
          bridge.uniform_grid(grid, s)[1] is None and bridge.uniform_grid(grid, s)[0] is grid)
    for tail in (0, 40):  # a uniform pattern whose kept blocks the IR merged into larger rectangles
        n, block = 6, 64
        size = n * block + tail
        kept = rng.random((n + (tail > 0), n + (tail > 0))) < 0.5
        kept[1:3, 2:5] = True
        edges = [min(i * block, size) for i in range(len(kept) + 1)]
        merged = [{"q": [edges[1], edges[3]], "k": [edges[2], edges[5]], "kind": "full"}] + [
            {"q": [edges[i], edges[i + 1]], "k": [edges[j], edges[j + 1]], "kind": "full"}
            for i, j in zip(*np.nonzero(kept)) if not (1 <= i < 3 and 2 <= j < 5)]
        mask = {"seqlen_q": size, "seqlen_k": size, "slices": merged}
        uniform, found = bridge.uniform_grid(bridge.block_grid_of(host_grid([mask])["encoding"]), size)
        check(f"encodings: uniform grid of {block}-token blocks (tail {tail}) found under merged slices",
              found == block and list(uniform[0]) == edges and (uniform[2][0] == kept).all()
              and (expand(uniform, 0) == dense_reference(mask)).all())
    for name, mset in mask_sets(s).items():
        found = host_grid(mset["masks"])
        if "refused" in found:
            continue
        grid = bridge.block_grid_of(found["encoding"])
        check(f"encodings {name}: block grid decodes back", all(
                (expand(grid, i) == dense_reference(m)).all() for i, m in enumerate(mset["masks"])))
    test_tile_kinds(bridge)
    sets = mask_sets(s)
    shape = {"heads_q": 4, "heads_kv": 2, "seqlen": s, "head_dim": 8}
    forms = {}
    for name in ("causal", "full", "causal_document", "sliding_window", "per_head"):
        mask, encodings = request_mask(sets[name])
        forms[name] = bridge.parse_problem({"kernel": "numpy", "shape": shape, "mask": mask, "encodings": encodings}).form()
    check(f"encodings: full and causal read from the host's varlen ({forms})",
          forms == {"causal": "causal", "full": "full", "causal_document": None, "sliding_window": None, "per_head": None})
    mask, encodings = request_mask(sets["causal"])
    try:
        bridge.parse_problem({"kernel": "numpy", "shape": shape, "mask": mask})
        check("encodings: a request without the host's encodings is refused", False)
    except Exception as error:
        check("encodings: a request without the host's encodings is refused",
              "params.encodings.rows must list the row runs of each of the 1 masks" in str(error), str(error))
    try:
        bridge.parse_problem({"kernel": "flex", "shape": shape, "mask": mask,
                              "encodings": dict(encodings, grid=None)}).block_grid()
        check("encodings: a grid asked of a request without one is refused", False)
    except Exception as error:
        check("encodings: a grid asked of a request without one is refused",
              "params.encodings.grid is missing" in str(error), str(error))
    columns = {"causal": True, "lts": [s] * s, "lte": [s] * s, "uts": [0] * s, "ute": [0] * s}
    flash = bridge.parse_problem({"kernel": "numpy", "shape": shape, "mask": mask,
                                  "encodings": dict(encodings, varlen={"refused": "-"},
                                                    flashmask={"encoding": columns})}).flashmask()[0]
    check("encodings: the host's FlashMask columns become two int32 arrays with the causal flag",
          flash["causal"] and len(flash["columns"]) == 2 and all(c.dtype == np.int32 and len(c) == s for c in flash["columns"]))


def test_tile_kinds(bridge):
    """FA4's whole and cut tiles from key intervals and from block tables, against the dense mask,
    with a tail tile."""
    s = 2 * bridge.FA4_TILE + 44
    t = bridge.FA4_TILE

    def reference_kinds(dense):
        tiles = [[dense[i:i + t, j:j + t] for j in range(0, s, t)] for i in range(0, s, t)]
        return (np.array([[x.all() for x in r] for r in tiles]),
                np.array([[x.any() and not x.all() for x in r] for r in tiles]))
    rng = np.random.default_rng(11)
    tables = []
    for size in (48, 64, 200):  # off the tile grid, on it, and blocks larger than a tile
        edges = sorted(set(list(range(0, s, size)) + [s]))
        tables.append({"seqlen_q": s, "seqlen_k": s, "slices": [
            {"q": [a, b], "k": [c, d], "kind": "full"}
            for a, b in zip(edges[:-1], edges[1:]) for c, d in zip(edges[:-1], edges[1:]) if rng.random() < 0.5]})
    grid = bridge.block_grid_of(host_grid(tables)["encoding"])
    whole, cut = bridge.grid_tile_kinds(grid, s, t)
    for index, mask in enumerate(tables):
        want_whole, want_cut = reference_kinds(dense_reference(mask))
        check(f"tile kinds of block table {index}: whole and cut tiles",
              (whole[index] == want_whole).all() and (cut[index] == want_cut).all())
        table, block_of = bridge.block_lookup(grid, [index], s)
        looked_up = table[0][block_of[0][:, None], block_of[1][None, :]] == 1
        check(f"block table {index}: the mask_mod's lookup gives the mask",
              (looked_up == dense_reference(mask)).all())
        groups = bridge.row_groups_of(host_rows(mask))
        most = bridge.most_intervals(groups)
        w, c = bridge.tile_kinds(bridge.row_interval_list(groups, most), s)
        check(f"tile kinds of block table {index}: from its {most} intervals a row too",
              (w == want_whole).all() and (c == want_cut).all())
    for name, mset in mask_sets(s).items():
        mask = mset["masks"][0]
        pairs = bridge.row_interval_pairs(bridge.row_groups_of(host_rows(mask)))
        if pairs is None:
            continue
        whole, cut = bridge.tile_kinds(pairs, s)
        want_whole, want_cut = reference_kinds(dense_reference(mask))
        check(f"tile kinds {name}: whole tiles", (whole == want_whole).all())
        check(f"tile kinds {name}: cut tiles", (cut == want_cut).all())


def test_lifecycle(python):
    bridge = Bridge(python)
    bridge.proc.stdin.close()
    code = bridge.proc.wait(timeout=60)
    check("EOF on stdin -> exit 0", code == 0, f"exit code {code}")
    bridge = Bridge(python)
    reply = bridge.request("shutdown")
    code = bridge.proc.wait(timeout=60)
    check("shutdown -> reply then exit 0", reply == {"id": 1, "ok": True, "result": None} and code == 0,
          f"{reply} exit {code}")
    # The host's private copy goes once the package is imported; every module is loaded by then.
    copy = temporary_dir("bridge-copy-")
    shutil.copytree(os.path.join(HERE, "attnbench_bridge"), os.path.join(copy, "attnbench_bridge"))
    shutil.copy(BRIDGE, copy)
    own = Bridge(python, script=os.path.join(copy, "serve_bridge.py"), args=("--remove-own-folder",))
    check("--remove-own-folder: the folder is gone once the bridge greets", not os.path.exists(copy))
    case = Case()
    params = case.params("numpy", mask_sets(case.s)["causal_document"], "fwd_bwd")
    reply = own.cell(params)
    check("--remove-own-folder: a cell still runs", reply.get("ok") and reply["result"]["status"] == "ok",
          json.dumps(reply)[:600])
    own.request("shutdown")
    # What the worker does before removing its folder keeps the package's sources readable: FA4's
    # DSL compiles a mask_mod from its source (a nested function's, here).
    copy = temporary_dir("bridge-copy-")
    shutil.copytree(os.path.join(HERE, "attnbench_bridge"), os.path.join(copy, "attnbench_bridge"))
    probe = subprocess.run([python, "-B", "-c", (
        "import inspect, shutil, sys; sys.path.insert(0, sys.argv[1]); import attnbench_bridge.flash as f; "
        "from attnbench_bridge.support import keep_sources; keep_sources(sys.argv[1]); shutil.rmtree(sys.argv[1]); "
        "inner = [c for c in f.fa4_block_mask_mod.__code__.co_consts if inspect.iscode(c)]; "
        "print(len(inspect.getsourcelines(f.fa4_block_mask_mod)[0]) > 3, "
        "all(any('def ' in l for l in inspect.getsourcelines(c)[0][:3]) for c in inner) and len(inner) > 0)"), copy],
        capture_output=True, text=True)
    check("--remove-own-folder: the package's sources stay readable (a mask_mod's, for FA4's DSL)",
          probe.stdout.split() == ["True", "True"] and not os.path.exists(copy), probe.stdout + probe.stderr[-800:])
    # -S: no site-packages, so neither numpy nor torch; the bridge must still start and answer
    bare = Bridge(python, flags=("-S",))
    report = bare.request("backends").get("result") or {}
    check("without numpy: backends answers", report.get("numpy", {}).get("available") is False
          and "numpy not importable" in (report.get("numpy", {}).get("reason") or ""), json.dumps(report)[:600])
    case = Case()
    reply = bare.cell(case.params("numpy", mask_sets(case.s)["causal"]))
    check("without numpy: numpy kernel unsupported", reply.get("ok") and reply["result"]["status"] == "unsupported"
          and "numpy not importable" in reply["result"]["reason"] and reply["result"]["scope"] == "machine",
          json.dumps(reply)[:600])
    bare.request("shutdown")
    check("without numpy: shutdown exits 0", bare.proc.wait(timeout=60) == 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the bridge")
    parser.add_argument("--quick", action="store_true", help="fewer masks")
    parser.add_argument("--cuda", action="store_true", help="also run the CUDA kernels (needs a GPU)")
    args = parser.parse_args()
    bridge = Bridge(args.python)
    try:
        for step in (lambda: test_protocol(bridge, args.python),):
            step()
        report = test_backends(bridge)
        has_torch = bool(report.get("sdpa-math", {}).get("available"))
        test_numpy(bridge, args.quick)
        test_modules(bridge, has_torch)
        test_torch(bridge, report, args.quick)
        if args.cuda:
            test_gpu(bridge, report)
        test_encodings()
        test_lifecycle(args.python)
    except Exception:
        results["fail"] += 1
        print("FAIL the driver stopped:\n" + traceback.format_exc())
        print("bridge stderr tail:\n" + bridge.stderr_tail())
    finally:
        bridge.close()
        for path in scratch:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    print(f"\n{results['pass']} passed, {results['fail']} failed, {results['skip']} skipped "
          f"(bridge python: {args.python}; bridge stderr: {bridge.stderr.name})")
    return 1 if results["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
