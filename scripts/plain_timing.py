"""The alternation that compares the harness's repetition of a cell with a peer's own plain loop,
for scripts/peer-plain.py (prefill) and scripts/decode-plain.py (decoding)."""
import statistics

import torch


def median_of(rep, reps, warmup=3):
    for _ in range(warmup):
        rep()
    return statistics.median(rep() for _ in range(reps))


def sm_clock():
    try:
        return torch.cuda.clock_rate()  # MHz, through NVML
    except Exception:
        return None


def side_by_side(harness, plain, reps, rounds):
    """The harness's repetition and the plain loop's, alternating in rounds in one process on the
    same GPU: a difference that survives this is the adapter's, not the machine's state between two
    runs. The side that goes first alternates too: under a power cap the clock falls while a
    round runs, and a fixed order would hand one side the cooler start every time. Returns (median
    of the harness's round medians, the plain loop's, (low, high) of their ratio over the rounds,
    SM clocks seen)."""
    ours, theirs, clocks = [], [], []
    for round_index in range(rounds):
        if round_index % 2 == 0:
            ours.append(median_of(lambda: harness() * 1e3, reps))
            theirs.append(median_of(plain, reps))
        else:
            theirs.append(median_of(plain, reps))
            ours.append(median_of(lambda: harness() * 1e3, reps))
        clocks.append(sm_clock())
    ratios = [b / a for a, b in zip(ours, theirs)]  # the harness's speed over the plain loop's
    return statistics.median(ours), statistics.median(theirs), (min(ratios), max(ratios)), clocks


def clock_range(clocks):
    """The SM clocks side_by_side saw, as `low–high` MHz (empty when NVML gave none)."""
    seen = [c for c in clocks if c]
    return f"{min(seen)}–{max(seen)}" if seen else ""
