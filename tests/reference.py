"""Reference implementations of the GDN forward (docs/algorithm.md), for tests and benchmarks only.

- recurrence_fp64: the token recurrence in float64 numpy: the ground truth.
- chunked_fp64: the chunked equations in float64 numpy (tests check it equals the recurrence to 1e-12).
- chunked_torch: the chunked equations in torch at fp32 (fast enough for 64K-token GPU checks), same math.
- reference_outputs: for torch inputs [B, T, ...], the one of the two that fits the problem's size (the GPU tests,
  bench/fused_ablate.py).
The others take packed varlen inputs (B = 1 folded away): q, k [T, H, K], v [T, HV, V], g, beta [T, HV],
cu_seqlens [N + 1], h0 [N, HV, K, V] or None; return o [T, HV, V], ht [N, HV, K, V]. With checkpoint_every = C > 0,
recurrence_fp64, chunked_torch and reference_outputs also return the state checkpoints [rows, HV, K, V]: each
sequence's state after every C of its tokens, in sequence order (FlashInfer's prefill convention).
"""
from __future__ import annotations

import numpy as np


def _expand_heads(x, hv):
    return np.repeat(x, hv // x.shape[1], axis=1)


def l2norm_np(x, eps=1e-6):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def l2norm_torch(x, eps=1e-6):
    """l2norm_np for torch tensors (any device), in x's dtype."""
    return x / ((x * x).sum(-1, keepdim=True) + eps).sqrt()


def _setup_fp64(q, k, v, g, beta, cu_seqlens, scale, l2norm):
    """float64 inputs (q, k normalised if asked, expanded to the value heads), the scale, zeroed o and ht."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    if l2norm:
        q, k = l2norm_np(q), l2norm_np(k)
    T, HV, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    o, ht = np.zeros((T, HV, V)), np.zeros((len(cu_seqlens) - 1, HV, K, V))
    return _expand_heads(q, HV), _expand_heads(k, HV), v, g, beta, scale, o, ht


def recurrence_fp64(q, k, v, g, beta, cu_seqlens, h0=None, scale=None, l2norm=False, checkpoint_every=0):
    q, k, v, g, beta, scale, o, ht = _setup_fp64(q, k, v, g, beta, cu_seqlens, scale, l2norm)
    n, HV, K, V = ht.shape
    checkpoints = []
    for s in range(n):
        S = np.zeros((HV, K, V)) if h0 is None else np.array(h0[s], dtype=np.float64)
        bos = int(cu_seqlens[s])
        for t in range(bos, int(cu_seqlens[s + 1])):
            S = S * np.exp(g[t])[:, None, None]
            v_new = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
            S = S + np.einsum("hk,hv->hkv", k[t], v_new)
            o[t] = np.einsum("hkv,hk->hv", S, q[t] * scale)
            if checkpoint_every and (t + 1 - bos) % checkpoint_every == 0:
                checkpoints.append(S)
        ht[s] = S
    if checkpoint_every:
        return o, ht, np.array(checkpoints).reshape(-1, HV, K, V)
    return o, ht


def chunked_fp64(q, k, v, g, beta, cu_seqlens, h0=None, scale=None, l2norm=False, BT=64):
    """The seven lines of the chunked form, one chunk at a time, in float64."""
    q, k, v, g, beta, scale, o, ht = _setup_fp64(q, k, v, g, beta, cu_seqlens, scale, l2norm)
    n, HV, K, V = ht.shape
    for s in range(n):
        for hv in range(HV):
            h = np.zeros((K, V)) if h0 is None else np.array(h0[s, hv], dtype=np.float64)
            for c0 in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1]), BT):
                sl = slice(c0, min(c0 + BT, int(cu_seqlens[s + 1])))
                qc, kc, vc, bc = q[sl, hv], k[sl, hv], v[sl, hv], beta[sl, hv]
                gam = np.cumsum(g[sl, hv])
                diff = gam[:, None] - gam[None, :]
                lower = np.tril(np.ones_like(diff), -1) > 0
                A = np.where(lower, bc[:, None] * (kc @ kc.T) * np.exp(np.where(lower, diff, 0)), 0)
                Tc = np.linalg.inv(np.eye(len(gam)) + A)
                u = Tc @ (bc[:, None] * vc)
                w = Tc @ (bc[:, None] * np.exp(gam)[:, None] * kc)
                v_new = u - w @ h
                causal = np.tril(np.ones_like(diff)) > 0
                M = np.where(causal, np.exp(np.where(causal, diff, 0)), 0)
                o[sl, hv] = scale * ((qc * np.exp(gam)[:, None]) @ h + ((qc @ kc.T) * M) @ v_new)
                h = np.exp(gam[-1]) * h + kc.T @ (np.exp(gam[-1] - gam)[:, None] * v_new)
            ht[s, hv] = h
    return o, ht


def chunk_w_u(kc, vc, bc, gam):
    """w and u of one chunk in torch, value heads batched (kc [HV, n, K], vc [HV, n, V], beta bc and gam =
    cumsum(g) [HV, n]): A = beta_t (k k^T)_ts e^(gam_t - gam_s) below the diagonal, Tc = (I + A)^-1,
    w = Tc diag(beta e^gam) k, u = Tc diag(beta) v."""
    import torch

    n = kc.shape[1]
    eye = torch.eye(n, device=kc.device)
    lower = torch.tril(torch.ones(n, n, device=kc.device, dtype=torch.bool), -1)
    decay = torch.exp((gam[:, :, None] - gam[:, None, :]).masked_fill(~lower, 0))
    A = torch.where(lower, bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay, 0)
    Tc = torch.linalg.solve_triangular(eye + A, eye.expand(kc.shape[0], n, n), upper=False, unitriangular=True)
    return Tc @ ((bc * torch.exp(gam))[..., None] * kc), Tc @ (bc[..., None] * vc)


def chunked_torch(q, k, v, g, beta, cu_seqlens, h0=None, scale=None, l2norm=False, BT=64, checkpoint_every=0):
    """chunked_fp64 in torch fp32 (any device), vectorised over value heads; for large GPU cases (checkpoint_every:
    a multiple of BT)."""
    import torch

    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if l2norm:
        q, k = l2norm_torch(q), l2norm_torch(k)
    T, HV, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q = q.repeat_interleave(HV // q.shape[1], dim=1)
    k = k.repeat_interleave(HV // k.shape[1], dim=1)
    cu = [int(x) for x in cu_seqlens]
    o = torch.zeros(T, HV, V, device=v.device)
    ht = torch.zeros(len(cu) - 1, HV, K, V, device=v.device)
    checkpoints = []
    for s in range(len(cu) - 1):
        h = torch.zeros(HV, K, V, device=v.device) if h0 is None else h0[s].float().clone()
        for c0 in range(cu[s], cu[s + 1], BT):
            c1 = min(c0 + BT, cu[s + 1])
            n = c1 - c0
            qc, kc, vc = q[c0:c1].transpose(0, 1), k[c0:c1].transpose(0, 1), v[c0:c1].transpose(0, 1)
            bc, gam = beta[c0:c1].T, torch.cumsum(g[c0:c1].T, dim=-1)  # [HV, n]
            diff = gam[:, :, None] - gam[:, None, :]
            causal = torch.tril(torch.ones(n, n, device=v.device, dtype=torch.bool))
            w, u = chunk_w_u(kc, vc, bc, gam)
            v_new = u - w @ h
            M = torch.where(causal, torch.exp(diff.masked_fill(~causal, 0)), 0)
            o[c0:c1] = (scale * ((qc * torch.exp(gam)[..., None]) @ h + ((qc @ kc.transpose(1, 2)) * M) @ v_new)).transpose(0, 1)
            h = torch.exp(gam[:, -1])[:, None, None] * h + kc.transpose(1, 2) @ (torch.exp(gam[:, -1:] - gam)[..., None] * v_new)
            if checkpoint_every and (c1 - cu[s]) % checkpoint_every == 0:
                checkpoints.append(h)
        ht[s] = h
    if checkpoint_every:
        return o, ht, (torch.stack(checkpoints) if checkpoints else torch.zeros(0, HV, K, V, device=v.device))
    return o, ht


def reference_outputs(q, k, v, g, beta, cu_list, h0, l2norm, checkpoint_every=0, scale=None):
    """(o, final state), and the checkpoints with checkpoint_every, on the CPU for torch inputs [B, T, ...] (B folded
    into T): recurrence_fp64 for small problems, chunked_torch on the inputs' device for large ones."""
    import torch

    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta)]
    if flat[0].shape[0] * v.shape[2] <= 8192:
        args = [x.double().cpu().numpy() for x in flat]
        out = recurrence_fp64(*args, cu_list, None if h0 is None else h0.double().cpu().numpy(), scale=scale,
                              l2norm=l2norm, checkpoint_every=checkpoint_every)
        return tuple(torch.from_numpy(x) for x in out)
    return tuple(x.cpu() for x in chunked_torch(*flat, cu_list, h0, scale=scale, l2norm=l2norm,
                                                checkpoint_every=checkpoint_every))


def rel_max_err(x, ref):
    """max |x - ref| / max |ref| (the tolerance measure of docs/algorithm.md)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))
