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
