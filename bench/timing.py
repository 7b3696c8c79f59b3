"""Device time of calls, CUDA events around each, each call waited for (shared by the bench scripts that time
kernels one at a time; bench.py times back-to-back calls and graph replays itself)."""
import statistics

import torch


def _call_ms(fn):
    """ms of one call of fn, between CUDA events, waited for."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def timed(fn, reps, warmup=1):
    """(median, min) ms of `reps` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = [_call_ms(fn) for _ in range(reps)]
    return statistics.median(times), min(times)


def timed_alternating(fns, reps, warmup=2):
    """Median ms of each of fns, timed as `timed` does but in alternation: round r calls every fn once, in forward
    order on even rounds and backward on odd ones, so that clock and thermal drift over the run reach every fn
    alike. (Timing one fn's calls, then the next's, gave whichever came first in a row a lead of ~3 % at 32x8192
    on the H200: as much as the changes being compared.)"""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for r in range(reps):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            times[i].append(_call_ms(fns[i]))
    return [statistics.median(t) for t in times]
