"""Device time of the serving options against the plain call, on the same inputs (CUDA graphs, median of N).

    python3 bench/option_cost.py [--cases 1x8192,32x8192] [--reps 30]

H=16, HV=32, K=V=128, bf16, varlen, q/k l2norm in the kernel, an initial state and a final state. Options:
  fp32 state        the plain call: a new fp32 final state from an fp32 initial state
  bf16 pool         a bf16 state pool read and written in place (state_indices)
  gating in kernel  use_gate_in_kernel (raw a, A_log, dt_bias) and use_beta_sigmoid_in_kernel (raw b)
  checkpoints/1024  the state written every 1024 tokens of each sequence (fp32 buffer)
Each line prints the ratio to the plain call. Needs the artifacts of specs/qwen35.yaml (or GDN_AOT_ARTIFACTS).
"""
from __future__ import annotations

import argparse

import torch

import gdn_aot
from timing import timed

H, HV, K, V = 16, 32, 128, 128
CHECKPOINT_EVERY = 1024


def make_call(case: str, option: str):
    """The call of `case` ("NxT") with `option`, as a function of no arguments, its tensors bound."""
    n, t = (int(x) for x in case.split("x"))
    T, dev = n * t, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(1, T, H, K, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, HV, V, device=dev, generator=gen).to(torch.bfloat16)
    a = torch.randn(1, T, HV, device=dev, generator=gen)
    b = torch.randn(1, T, HV, device=dev, generator=gen)
    A_log, dt_bias = torch.randn(HV, device=dev, generator=gen) - 1, torch.randn(HV, device=dev, generator=gen)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    cu = torch.arange(0, T + 1, t, device=dev, dtype=torch.int32)
    h0 = torch.randn(n, HV, K, V, device=dev, generator=gen)
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    if option == "fp32 state":
        return lambda: gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      **kw)
    if option == "bf16 pool":
        pool, slots = h0.to(torch.bfloat16), torch.arange(n, device=dev, dtype=torch.int32)
        return lambda: gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=slots,
                                                      **kw)
    if option == "gating in kernel":
        return lambda: gdn_aot.chunk_gated_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True,
                                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                                      use_beta_sigmoid_in_kernel=True, **kw)
    per_seq = t // CHECKPOINT_EVERY
    buffer = torch.empty(n * per_seq, HV, K, V, device=dev)
    starts = torch.arange(0, n * per_seq + 1, per_seq, device=dev, dtype=torch.int64)
    return lambda: gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  state_checkpoints=buffer, checkpoint_cu_starts=starts,
                                                  checkpoint_every_n_tokens=CHECKPOINT_EVERY, **kw)


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call that loads the kernels); returns its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x8192,32x8192")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    options = ("fp32 state", "bf16 pool", "gating in kernel", f"checkpoints/{CHECKPOINT_EVERY}")
    for case in args.cases.split(","):
        base = None
        for option in options:
            ms = timed(graphed(make_call(case, option)), args.reps, warmup=3)[0]
            base = base or ms
            print(f"{case:>9}  {option:<18} {ms:8.3f} ms  x{ms / base:5.3f} of the plain call", flush=True)


if __name__ == "__main__":
    main()
