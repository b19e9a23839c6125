"""A run's record from an attnbench cache, for the scripts beside it: `run.json` of the run asked
for, or of the latest one; a missing cache or run ends the script with one line saying which."""
import json
import os
import sys


def load_run(cache, run=None):
    runs = os.path.join(cache, "runs")
    try:
        run = run or open(os.path.join(runs, "latest")).read().strip()
        return json.load(open(os.path.join(runs, run, "run.json")))
    except (OSError, ValueError) as error:
        which = f"run {run!r}" if run else "its latest run"
        sys.exit(f"{sys.argv[0]}: no record of {which} in the cache {cache!r} ({error}); "
                 "give the cache folder (ATTNBENCH_CACHE) and a run id from its runs/ folder")


def artifact(cache, node):
    """The folder of a node's cached files: where the record says, or, for a cache copied from
    another machine (the record holds that machine's absolute paths), the same entry under `cache`."""
    recorded = node.get("artifact")
    if not recorded or os.path.isdir(recorded):
        return recorded
    key = node.get("key") or ""
    # The cache's entry layout (core/runtime/src/cache.rs): cache/<first two of the key>/<key>/files.
    moved = os.path.join(cache, "cache", key[:2], key, "files")
    return moved if key and os.path.isdir(moved) else recorded
