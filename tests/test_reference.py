"""The references agree with the token recurrence (the ground truth), on the CPU."""
import numpy as np
import pytest
import torch

from reference import chunked_fp64, chunked_torch, recurrence_fp64, rel_max_err


def _inputs(lens, H=2, HV=4, Kd=16, Vd=8, seed=0):
    rng = np.random.default_rng(seed)
    T = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)])
    q, k = rng.standard_normal((T, H, Kd)), rng.standard_normal((T, H, Kd))
    v = rng.standard_normal((T, HV, Vd))
    g, beta = -rng.uniform(0, 2, (T, HV)), rng.uniform(0, 1, (T, HV))
    h0 = rng.standard_normal((len(lens), HV, Kd, Vd))
    return q, k, v, g, beta, cu, h0


@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [0, 130, 0, 7], [200]])
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_equations_match_recurrence(lens, l2norm):
    q, k, v, g, beta, cu, h0 = _inputs(lens)
    if not l2norm:
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    ref_o, ref_h = recurrence_fp64(q, k, v, g, beta, cu, h0, l2norm=l2norm)
    o, h = chunked_fp64(q, k, v, g, beta, cu, h0, l2norm=l2norm)
    assert rel_max_err(o, ref_o) < 1e-12 and rel_max_err(h, ref_h) < 1e-12
    to, th = chunked_torch(*(torch.tensor(x) for x in (q, k, v, g, beta)), cu, torch.tensor(h0), l2norm=l2norm)
    assert rel_max_err(to.numpy(), ref_o) < 1e-5 and rel_max_err(th.numpy(), ref_h) < 1e-5


def test_recurrence_by_hand():
    """One token, one head: S = e^g S0 + k (beta (v - (e^g S0)^T k))^T; o = S^T (scale q)."""
    q, k, v = np.array([[[1.0, 2.0]]]), np.array([[[0.6, 0.8]]]), np.array([[[3.0]]])
    g, beta, S0 = np.array([[-0.5]]), np.array([[0.25]]), np.array([[[[1.0], [-1.0]]]])
    o, h = recurrence_fp64(q, k, v, g, beta, [0, 1], S0, scale=0.5)
    S = np.exp(-0.5) * S0[0, 0]
    S = S + np.outer(k[0, 0], 0.25 * (v[0, 0] - S.T @ k[0, 0]))
    assert np.allclose(h[0, 0], S) and np.allclose(o[0, 0], S.T @ (0.5 * q[0, 0]))


@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints_are_the_states_of_prefixes(every):
    """Checkpoint j of a sequence is its final state after (j + 1) * every tokens (FlashInfer's convention): the
    recurrence's match the final states of the truncated sequences, seq_len // every of them a sequence, in
    sequence order; chunked_torch records the same."""
    lens = [0, 130, 64, 63, 256]
    q, k, v, g, beta, cu, h0 = _inputs(lens)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    _, ht, ckpt = recurrence_fp64(q, k, v, g, beta, cu, h0, checkpoint_every=every)
    want = []
    for s, n in enumerate(lens):
        for j in range(n // every):
            bos, end = cu[s], cu[s] + (j + 1) * every
            sl = slice(bos, end)
            _, h = recurrence_fp64(q[sl], k[sl], v[sl], g[sl], beta[sl], [0, end - bos], h0[s:s + 1])
            want.append(h[0])
        if n and n % every == 0:
            assert np.array_equal(want[-1], ht[s])  # a length that is a multiple: the last one is the final state
    assert ckpt.shape == (sum(n // every for n in lens), 4, 16, 8)
    assert np.allclose(ckpt, np.array(want), rtol=0, atol=1e-12)
    _, _, tc = chunked_torch(*(torch.tensor(x) for x in (q, k, v, g, beta)), cu, torch.tensor(h0),
                             checkpoint_every=every)
    assert rel_max_err(tc.numpy(), ckpt) < 1e-5
