"""Device time of calls, CUDA events around each, each call waited for (shared by the bench scripts that time
kernels one at a time; bench.py times back-to-back calls and graph replays itself)."""
import os
import statistics
import time

import torch

HANG_S = 30.0  # a first launch here takes milliseconds (a module load at most): one still running is stuck


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


def finish_or_exit(what, limit_s=HANG_S):
    """Wait for the work queued so far; if it is still running after limit_s, say so (naming `what`) and end the
    process: a kernel whose mbarrier never completes a phase waits forever, and so would every later synchronize,
    until the device host's time limit ends the whole call with nothing said. Ending the process tears down its
    CUDA context, which stops the kernel."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + limit_s
    while not done.query():
        if time.monotonic() > deadline:
            print(f"{what}: still running after {limit_s:.0f} s, taken for a hang (an mbarrier whose arrivals "
                  "never complete a phase?); stopping", flush=True)
            os._exit(3)
        time.sleep(0.01)
