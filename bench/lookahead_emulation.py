"""CPU emulation of gdn_scan's chunk chain in two algebraically equal forms, with the kernels' roundings (bf16
operands of every product: w, u, h, v_new, v_dec, P, M; fp32 accumulation), against the fp64 token recurrence:
  * today's: v_new_c = u_c - w_c h_c, then h_{c+1} = e^{gl_c} h_c + k_c^T v_dec_c;
  * a one-chunk lookahead: v_new_{c+1} = u_{c+1} - e^{gl_c} (w_{c+1} h_c) - (w_{c+1} k_c^T) v_dec_c, whose v_dec
    chain is one product a chunk (the state path beside it is not: docs/performance.md, "A lookahead").
One sequence, q and k L2-normed, scale K^-1/2. Usage, from the repository root (no GPU):
    python3 bench/lookahead_emulation.py [--tokens 4096] [--g-scale 0.1] [--value-heads 4]
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from reference import chunk_w_u, l2norm_torch, recurrence_fp64, rel_max_err  # noqa: E402


def bf16(x):
    return x.to(torch.bfloat16).float()


def prepared_chunks(q, k, v, g, beta, BT=64):
    """Per chunk: q, k (bf16, L2-normed, one per value head), w, u (bf16, as gdn_prepare stores them), gam."""
    q, k = l2norm_torch(q), l2norm_torch(k)
    HV = v.shape[1]
    q, k = (x.repeat_interleave(HV // x.shape[1], 1) for x in (q, k))
    chunks = []
    for c0 in range(0, v.shape[0], BT):
        qc, kc, vc = (x[c0:c0 + BT].transpose(0, 1) for x in (q, k, v))
        gam = torch.cumsum(g[c0:c0 + BT].T, -1)
        w, u = chunk_w_u(kc, vc, beta[c0:c0 + BT].T, gam)
        chunks.append((bf16(qc), bf16(kc), bf16(w), bf16(u), gam))
    return chunks


def chunk_output(qc, kc, h, v_new, gam, scale):
    n = qc.shape[1]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    decay = torch.exp((gam[:, :, None] - gam[:, None, :]).masked_fill(~causal, 0))
    p = bf16(torch.where(causal, (qc @ kc.transpose(1, 2)) * decay, 0))
    return scale * (torch.exp(gam)[..., None] * (qc @ bf16(h)) + p @ bf16(v_new))


def decayed(v_new, gam):
    return bf16(torch.exp(gam[:, -1:] - gam)[..., None] * v_new)


def scan_today(chunks, h, scale):
    o = []
    for qc, kc, w, u, gam in chunks:
        v_new = u - w @ bf16(h)
        o.append(chunk_output(qc, kc, h, v_new, gam, scale))
        h = torch.exp(gam[:, -1])[:, None, None] * h + kc.transpose(1, 2) @ decayed(v_new, gam)
    return torch.cat(o, 1), h


def scan_lookahead(chunks, h, scale):
    """The chain carries v_dec; the state follows a chunk behind it."""
    o, prev = [], None
    for qc, kc, w, u, gam in chunks:
        if prev is None:
            v_new = u - w @ bf16(h)
        else:
            k_prev, v_dec_prev, decay_prev = prev
            x = w @ bf16(h)  # w_{c+1} h_c: the state of a chunk earlier
            m = bf16(w @ k_prev.transpose(1, 2))  # w_{c+1} k_c^T: no state in it
            v_new = u - decay_prev[:, None, None] * x - m @ v_dec_prev
            h = decay_prev[:, None, None] * h + k_prev.transpose(1, 2) @ v_dec_prev
        o.append(chunk_output(qc, kc, h, v_new, gam, scale))
        prev = kc, decayed(v_new, gam), torch.exp(gam[:, -1])
    k_prev, v_dec_prev, decay_prev = prev
    return torch.cat(o, 1), decay_prev[:, None, None] * h + k_prev.transpose(1, 2) @ v_dec_prev


def errors(tokens=4096, g_scale=0.1, value_heads=4, key_heads=2, K=128, V=128, seed=0):
    """{form: (o, final state) errors against the fp64 recurrence}, and the forms' largest difference in o."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (bf16(torch.randn(tokens, key_heads, K, generator=gen)) for _ in range(2))
    v = bf16(torch.randn(tokens, value_heads, V, generator=gen))
    g = -g_scale * torch.nn.functional.softplus(torch.randn(tokens, value_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(tokens, value_heads, generator=gen))
    scale = K ** -0.5
    o_ref, h_ref = recurrence_fp64(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy(), np.array([0, tokens]),
                                   scale=scale, l2norm=True)
    chunks = prepared_chunks(q, k, v, g, beta)
    out = {}
    for name, scan in (("today", scan_today), ("lookahead", scan_lookahead)):
        o, h = scan(chunks, torch.zeros(value_heads, K, V), scale)
        o = bf16(o).transpose(0, 1)
        out[name] = (rel_max_err(o.numpy(), o_ref), rel_max_err(h[None].numpy(), h_ref), o)
    diff = rel_max_err(out["lookahead"][2].numpy(), out["today"][2].numpy())
    return {name: e[:2] for name, e in out.items()}, diff


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--g-scale", type=float, default=0.1, help="g = -scale * softplus(N(0, 1))")
    p.add_argument("--value-heads", type=int, default=4)
    args = p.parse_args()
    errs, diff = errors(args.tokens, args.g_scale, args.value_heads)
    for name, (eo, eh) in errs.items():
        print(f"{name:10s} o {eo:.2e}  final state {eh:.2e}")
    print(f"largest difference in o between the forms: {diff:.1e} of the largest value")


if __name__ == "__main__":
    main()
