"""Batch invariance on the GPU: a sequence's output rows and final state are bitwise the same whatever it is
batched with (alone, in a small batch, among 64 sequences, beside 31 others of 8192 tokens). Serving engines need
this for reproducible results: nothing about how a sequence is processed may depend on the rest of the batch
(docs/design.md, "Batch invariance")."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, HV, K, V = 16, 32, 128, 128


@pytest.fixture(autouse=True, scope="module")
def _promised():
    """Only a build that promises batch invariance is held to it: one whose dispatch runs one route for every
    shape class of the configuration (specs/qwen35.yaml; not specs/qwen35-fastest.yaml)."""
    from gdn_aot.loader.artifact_sets import Artifacts

    routes = Artifacts.for_device(torch.cuda.current_device()).routes("bf16", K, V, varlen=True, transpose=False)
    if not routes.batch_invariant:
        pytest.skip("these artifacts route shape classes to different routes (the spec's dispatch): no batch "
                    "invariance is promised")


def _run(lens, target, seed=0):
    """(o rows of sequence `target`, its final state) for a varlen batch of `lens`; the target's inputs are the
    same in every batch (drawn from their own seed), the others' are drawn per batch."""
    import gdn_aot

    gen = torch.Generator(device="cuda").manual_seed(1000 + len(lens))
    T = sum(lens)
    q = torch.randn(1, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = -torch.nn.functional.softplus(torch.randn(1, T, HV, device="cuda", generator=gen))
    beta = torch.rand(1, T, HV, device="cuda", generator=gen)
    h0 = torch.randn(len(lens), HV, K, V, device="cuda", generator=gen)
    own = torch.Generator(device="cuda").manual_seed(seed)
    n = lens[target]
    start = sum(lens[:target])
    rows = slice(start, start + n)
    q[0, rows] = torch.randn(n, H, K, device="cuda", generator=own).to(torch.bfloat16)
    k[0, rows] = torch.randn(n, H, K, device="cuda", generator=own).to(torch.bfloat16)
    v[0, rows] = torch.randn(n, HV, V, device="cuda", generator=own).to(torch.bfloat16)
    g[0, rows] = -torch.nn.functional.softplus(torch.randn(n, HV, device="cuda", generator=own))
    beta[0, rows] = torch.rand(n, HV, device="cuda", generator=own)
    h0[target] = torch.randn(HV, K, V, device="cuda", generator=own)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    o, ht = gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    return o[0, rows].clone(), ht[target].clone()


def _run_fixed(batch, target, T=2000, seed=0):
    """(o of sequence `target`, its final state) for a fixed-length batch [batch, T] whose target row has the same
    inputs in every batch."""
    import gdn_aot

    gen = torch.Generator(device="cuda").manual_seed(2000 + batch)
    own = torch.Generator(device="cuda").manual_seed(seed)

    def draw(shape, g, kind):
        if kind == "gate":
            return -torch.nn.functional.softplus(torch.randn(shape, device="cuda", generator=g))
        if kind == "beta":
            return torch.rand(shape, device="cuda", generator=g)
        x = torch.randn(shape, device="cuda", generator=g)
        return x if kind == "state" else x.to(torch.bfloat16)

    shapes = {"q": ((T, H, K), "x"), "k": ((T, H, K), "x"), "v": ((T, HV, V), "x"), "g": ((T, HV), "gate"),
              "beta": ((T, HV), "beta"), "h0": ((HV, K, V), "state")}
    x = {name: torch.stack([draw(shape, own if b == target else gen, kind) for b in range(batch)])
         for name, (shape, kind) in shapes.items()}
    o, ht = gdn_aot.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    return o[target].clone(), ht[target].clone()


def _assert_bitwise(scenarios):
    (name0, (o0, h0)), *rest = scenarios
    assert torch.isfinite(o0).all() and torch.isfinite(h0).all()
    for name, (o, h) in rest:
        assert torch.equal(o, o0), f"o of the target differs between '{name0}' and '{name}': " \
                                   f"max |d| {(o.float() - o0.float()).abs().max().item():.3e}"
        assert torch.equal(h, h0), f"final state differs between '{name0}' and '{name}': " \
                                   f"max |d| {(h - h0).abs().max().item():.3e}"


def test_5000_alone_small_batch_64_sequences():
    """With specs/qwen35.yaml's varlen bf16 variants on 132 SMs the batches take three different scans: alone
    the warp-specialised one at BV 32 (128 programs), beside one other the warp-specialised one at BV 64 (128
    programs), among three or 64 the 8-warp BV 128 one."""
    others = [int(x) for x in torch.randint(100, 3000, (63,), generator=torch.Generator().manual_seed(3))]
    _assert_bitwise([
        ("alone", _run([5000], 0)),
        ("before 700", _run([5000, 700], 0)),
        ("after 3000, before 700", _run([3000, 5000, 700], 1)),
        ("17th of 64", _run(others[:17] + [5000] + others[17:], 17)),
    ])


def test_65536_alone_and_beside_31x8192():
    _assert_bitwise([
        ("alone", _run([65536], 0)),
        ("beside 31 x 8192", _run([8192] * 16 + [65536] + [8192] * 15, 16)),
    ])


def test_fixed_length_alone_and_in_a_batch():
    """Fixed-length batches [B, T] have no warp-specialised scan in specs/qwen35.yaml: alone (32 programs) the
    target takes the small-batch 4-warp BV 32 scan, among three (96) and eight (256) the 8-warp BV 128 one."""
    _assert_bitwise([
        ("alone", _run_fixed(1, 0)),
        ("second of three", _run_fixed(3, 1)),
        ("last of eight", _run_fixed(8, 7)),
    ])
