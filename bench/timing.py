"""Device time of one call, CUDA events around it, each call waited for (shared by the bench scripts that time
kernels one at a time; bench.py times back-to-back calls and graph replays itself)."""
import statistics

import torch


def timed(fn, reps, warmup=1):
    """(median, min) ms of `reps` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times)
