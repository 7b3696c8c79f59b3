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
    shape class of the configuration (specs/qwen35.yaml: gdn_fused and gdn_fused_terms on sm_90a; not a spec with
    gdn_fused's above_factor, which sends small batches to the two-kernel route)."""
    from gdn_aot.loader.artifact_sets import Artifacts

    routes = Artifacts.for_device(torch.cuda.current_device()).routes("bf16", K, V, varlen=True, transpose=False)
    if not routes.batch_invariant:
        pytest.skip("these artifacts route shape classes to different routes (the spec's dispatch): no batch "
                    "invariance is promised")


def _inputs(T, n_states, gen):
    """q, k, v [T, heads, 128] bf16, g, beta [T, HV] and n_states initial states [HV, K, V], drawn from `gen`."""
    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    return {"q": randn(T, H, K).bfloat16(), "k": randn(T, H, K).bfloat16(), "v": randn(T, HV, V).bfloat16(),
            "g": -torch.nn.functional.softplus(randn(T, HV)), "beta": torch.rand(T, HV, device="cuda", generator=gen),
            "h0": randn(n_states, HV, K, V)}


def _forward(x, cu_seqlens=None):
    """(o, final states) of the inputs `x` (_inputs' names, batched)."""
    import gdn_aot

    o, ht = gdn_aot.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                           output_final_state=True, cu_seqlens=cu_seqlens,
                                           use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    return o, ht


def _run(lens, target, seed=0):
    """(o rows of sequence `target`, its final state) for a varlen batch of `lens`; the target's inputs are the
    same in every batch (drawn from their own seed), the others' are drawn per batch."""
    x = _inputs(sum(lens), len(lens), torch.Generator(device="cuda").manual_seed(1000 + len(lens)))
    own = _inputs(lens[target], 1, torch.Generator(device="cuda").manual_seed(seed))
    start = sum(lens[:target])
    rows = slice(start, start + lens[target])
    for name in ("q", "k", "v", "g", "beta"):
        x[name][rows] = own[name]
        x[name] = x[name][None]
    x["h0"][target] = own["h0"][0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    o, ht = _forward(x, cu)
    return o[0, rows].clone(), ht[target].clone()


def _run_fixed(batch, target, T=2000, seed=0):
    """(o of sequence `target`, its final state) for a fixed-length batch [batch, T] whose target row has the same
    inputs in every batch."""
    gen = torch.Generator(device="cuda").manual_seed(2000 + batch)
    own = torch.Generator(device="cuda").manual_seed(seed)
    rows = [_inputs(T, 1, own if b == target else gen) for b in range(batch)]
    x = {name: (torch.cat if name == "h0" else torch.stack)([r[name] for r in rows]) for name in rows[0]}
    o, ht = _forward(x)
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
    """With specs/qwen35.yaml's varlen bf16 variants on 132 SMs the batches take three different routes: alone
    gdn_fused_terms (32 (sequence, head)s of four programs), beside one other gdn_fused at BV 64 (128 programs),
    among three or 64 gdn_fused at BV 128."""
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
