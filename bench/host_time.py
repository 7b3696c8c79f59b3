"""Host time per call of a launch-bound forward: T = 64 tokens (one sequence, varlen API), H=16, HV=32, K=V=128,
bf16, use_qk_l2norm_in_kernel, initial state in and final state out; gdn_aot and, when importable, FlashInfer
and fla (each called as bench.py calls it).

    python3 bench/host_time.py [--calls 500] [--rounds 5] [--systems gdn_aot,flashinfer,fla] [--json out.json]

Prints, per library, the median and minimum host time of one call (us), measured two ways after 20 warm-up calls
(bench.py's host_time(), which bench.py's table uses too):
  call by call   each call timed alone, after a synchronize (the launch queue empty)
  back to back   `rounds` loops of `calls` calls with no synchronisation; loop time / calls
and the device-inclusive time per call of the back-to-back loops. gdn_aot's target: <= 20 us.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import SYSTEM_ORDER, host_time, load_systems, parse_systems  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500, help="timed calls per measurement (>= 200)")
    ap.add_argument("--rounds", type=int, default=5, help="back-to-back loops")
    ap.add_argument("--systems", default=",".join(SYSTEM_ORDER), help="libraries (gdn_aot always)")
    ap.add_argument("--json", help="write the results as JSON here")
    args = ap.parse_args()
    if args.calls < 200:
        ap.error("--calls must be at least 200")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.calls} calls per measurement", flush=True)
    results = {}
    print("| library | call by call: median / min us | back to back: median / min us | device-incl. us |")
    print("|---|---|---|---|")
    for lib, system in load_systems(parse_systems(args.systems)).items():
        h = results[lib] = host_time(system, calls=args.calls, rounds=args.rounds)
        print(f"| {lib} | {h['call_median_us']:.1f} / {h['call_min_us']:.1f} | {h['host_us']:.1f} / "
              f"{h['b2b_min_us']:.1f} | {h['device_incl_us']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
