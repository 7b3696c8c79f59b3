"""Every dispatch row of a configuration, forced on the same batches: device times in alternation and whether the
rows compute the same bits. What a dispatch bound is chosen from (which row is fastest for which batch), and a
check that rows mixed in one table stay batch invariant.

    python3 bench/rows.py [--cases 1x2048,1x8192,1x65536,4096+4096] [--reps 40] [--transpose] [--state-dtype bf16]

Runs the installed gdn_aot (its artifacts, GDN_AOT_ARTIFACTS or the wheel's) through the public API, bf16 varlen,
the state stored in fp32 (or --state-dtype), H = 16, K = V = 128, q and k L2-normed in the kernel; cases as
bench.py's (NxL, L1+L2+.., @HV).
Each row is forced as tests/test_gpu_forward.py forces one (Routes.tiers), including rows whose bound the batch
exceeds (the terms route then launches in clusters, wave by wave). Per case: each row's median ms (CUDA events
around each call, timing.timed_alternating) and whether its o and final state equal the first row's bit for bit
(True, else the largest |difference| of o / of the state).
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import STATE_DTYPES, make_inputs, cu_tensors, parse_cases  # noqa: E402  (bench/, put on the path above)
from timing import timed_alternating  # noqa: E402


def forced_forward(routes, route, x, transpose):
    """A forward of inputs x with every batch sent to `route`: (o, final state)."""
    import gdn_aot

    routes.tiers = ((float("inf"), route),)
    h0 = x["h0"].transpose(-1, -2).contiguous() if transpose else x["h0"]
    # the call's state dtype is output_state's (a new final state would be fp32 whatever h0's dtype)
    return gdn_aot.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                          output_state=torch.empty_like(h0), cu_seqlens=x["cu"]["int32"],
                                          use_qk_l2norm_in_kernel=True, transpose_state=transpose)


def bitwise_or_distance(out, ref):
    """Returns "True" if (o, final state) equals ref bit for bit, else the largest |difference| of each: "o/state"."""
    if all(torch.equal(a, b) for a, b in zip(out, ref)):
        return "True"
    return "/".join(f"{(a.float() - b.float()).abs().max().item():.1e}" for a, b in zip(out, ref))


def installed_routes(transpose, state_dtype):
    """The installed gdn_aot's loaded dispatch rows for bf16 varlen, K = V = 128, the [K, V] (or with transpose the
    [V, K]) state stored in state_dtype: the rows this script numbers."""
    from gdn_aot.loader import Artifacts

    routes = Artifacts.for_device(torch.cuda.current_device()).routes("bf16", 128, 128, True, transpose, state_dtype)
    routes.load()
    return routes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1x2048,1x8192,1x65536,4096+4096")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--transpose", action="store_true", help="the [V, K] state layout")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32", help="the state's storage dtype")
    args = ap.parse_args()
    routes = installed_routes(args.transpose, args.state_dtype)
    rows = routes.routes
    print(f"{torch.cuda.get_device_name()}; rows: " + ", ".join(f"{i}: {r}" for i, r in enumerate(rows)), flush=True)
    print(f"{'case':14s}" + "".join(f"{'row ' + str(i):>10s}" for i in range(len(rows))) + "  ms; bitwise row 0")
    for case in parse_cases(args.cases):
        x = make_inputs(case.lens, case.HV, 0, cu_tensors(case.lens))
        x["h0"] = x["h0"].to(STATE_DTYPES[args.state_dtype])
        outs = [forced_forward(routes, r, x, args.transpose) for r in rows]
        same = [bitwise_or_distance(o, outs[0]) for o in outs]
        times = timed_alternating([lambda r=r: forced_forward(routes, r, x, args.transpose) for r in rows],
                                  args.reps)
        print(f"{case.id:14s}" + "".join(f"{t:10.3f}" for t in times) + "  " + " ".join(same), flush=True)


if __name__ == "__main__":
    main()
