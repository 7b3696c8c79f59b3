"""Time each stage of the forward separately (CUDA events, median of N) from the AOT artifacts.

    python3 bench/profile_stages.py [--cases 1x8192,32x8192,1x65536] [--reps 20]

For every case it launches gdn_prepare (with the fused q/k L2 norms; grid (T // 64 + N, H, 1)) and each built
gdn_scan variant (every BV / num_warps) on the same inputs, so the table shows where the time goes and which scan
variant is fastest per shape class (the input for the spec's dispatch table). H=16, HV=32, K=V=128, bf16, varlen.
"""
from __future__ import annotations

import argparse

import torch

from gdn_aot.kernels import PREPARE_L2NORM, SCAN_HAS_H0, SCAN_STORE_HT
from gdn_aot.loader.runtime import Artifacts
from timing import timed

H, HV, K, V, BT = 16, 32, 128, 128, 64
FLOP_PER_TOKEN_HEAD = 183e3


def profile(case: str, reps: int):
    n, t = (int(x) for x in case.split("x"))
    T = n * t
    dev = torch.device("cuda")
    arts = Artifacts.for_device(dev)
    stream = torch.cuda.current_stream().cuda_stream
    q = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn_like(q), dim=-1)
    v = torch.randn(1, T, HV, V, device=dev, dtype=torch.bfloat16)
    g = -torch.nn.functional.softplus(torch.randn(1, T, HV, device=dev))
    beta = torch.rand(1, T, HV, device=dev)
    cu = torch.arange(0, T + 1, t, device=dev, dtype=torch.int32)
    w = torch.empty(T, HV, K, device=dev, dtype=torch.bfloat16)
    u = torch.empty(T, HV, V, device=dev, dtype=torch.bfloat16)
    gam, qg, kg = (torch.empty(T, HV, device=dev) for _ in range(3))
    o = torch.empty_like(v)
    h0 = torch.randn(n, HV, K, V, device=dev)
    ht = torch.empty_like(h0)
    rows = []
    prep = arts.pick("gdn_prepare", dtype="bf16", K=K, V=V, varlen=True)
    pgrid = (T // BT + n, H, 1)
    pscratch = torch.empty(prep.scratch_bytes(pgrid), device=dev, dtype=torch.uint8)
    rows.append(("prepare", timed(lambda: prep.launch(pgrid, stream, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                      g.data_ptr(), beta.data_ptr(), 0, 0,  # no A_log, dt_bias
                                                      cu.data_ptr(), w.data_ptr(),
                                                      u.data_ptr(), gam.data_ptr(), qg.data_ptr(), kg.data_ptr(),
                                                      T, n, H, HV, PREPARE_L2NORM,
                                                      scratch_ptr=pscratch.data_ptr() if pscratch.numel() else 0),
                                  reps)))
    for key, e in arts.manifest.variants.items():
        a = e["axes"]
        if (e["kernel"] != "gdn_scan" or a["dtype"] != "bf16" or not a["varlen"] or a["transpose"]
                or a["state_dtype"] != "fp32" or a["checkpoints"]):
            continue
        scan = arts.kernel(key)
        grid = (n, HV, V // a["BV"])
        scratch = torch.empty(scan.scratch_bytes(grid), device=dev, dtype=torch.uint8)
        rows.append((f"scan BV={a['BV']} w{e['num_warps']}", timed(
            lambda: scan.launch(grid, stream, q.data_ptr(), k.data_ptr(), w.data_ptr(), u.data_ptr(),
                                gam.data_ptr(), qg.data_ptr(), kg.data_ptr(), cu.data_ptr(), h0.data_ptr(),
                                ht.data_ptr(), 0, o.data_ptr(), K ** -0.5, T, H, HV, SCAN_HAS_H0 | SCAN_STORE_HT,
                                0, 0, 0, 0,  # no checkpoints
                                scratch_ptr=scratch.data_ptr()), reps)))
    flop = FLOP_PER_TOKEN_HEAD * T * HV
    for name, (med, mn) in rows:
        print(f"{case:>9}  {name:<18} median {med * 1e3:9.1f} us  min {mn * 1e3:9.1f} us  "
              f"({flop / (med * 1e-3) / 1e12:6.1f} TFLOP/s-equivalent of the whole forward)", flush=True)


def host_profile(calls: int = 200):
    """Where the host time of a launch-bound call (1 x 64 tokens) goes: bench.py's host_time() (what
    bench/host_time.py prints), then cProfile over `calls` forwards of the same call."""
    import cProfile
    import pstats

    from bench import GdnAot, cu_tensors, host_time, make_inputs

    run = GdnAot()
    h = host_time(run, calls=calls)
    print(f"host time per call at T=64: call by call median {h['call_median_us']:.1f} us (min {h['call_min_us']:.1f}), "
          f"back to back median {h['host_us']:.1f} us (min {h['b2b_min_us']:.1f})", flush=True)
    x = run.prepare(make_inputs([64], HV, 0, cu_tensors([64])))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        run(x)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x8192,4x2048,32x8192,1x65536")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--host", action="store_true", help="also profile the host time of a T=64 call")
    args = p.parse_args()
    for case in args.cases.split(","):
        profile(case, args.reps)
    if args.host:
        host_profile()


if __name__ == "__main__":
    main()
