"""The prefix-cache state checkpoints on a GPU (the H200 runs the sm_90a artifacts built on the CPU machine).

chunk_gated_delta_rule(..., state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens=N) writes each
sequence's state after every N of its tokens (FlashInfer's prefill convention); every case checks, against the fp64
token recurrence's states after every N tokens (tests/reference.py; the fp32 chunked reference for the long case):
- every checkpoint row, in the state's layout (both layouts), within the forward's tolerance, and every row written
  (the buffer is poisoned with NaN first);
- the last checkpoint of a sequence whose length is a multiple of N is its final state, bit for bit;
- o and the final state are bitwise those of the same call without checkpoints (other variants, same math);
- sequences shorter than N, exact multiples of N, empty ones; N = 64, 128, 192; an initial state, a state pool
  (slot -1 included: checkpoints follow the sequences, not the slots); int32 and int64 checkpoint_cu_starts;
  validate=True; every dispatch row of the configuration (so every gdn_scan variant with checkpoints); malformed
  starts write nothing outside the buffer; CUDA-graph capture.
Both routes: the default artifacts run gdn_prepare + gdn_scan; with GDN_AOT_ARTIFACTS pointing at a build of
specs/fused-preview.yaml the same tests run gdn_fused.
"""
from __future__ import annotations

import pytest
import torch

from reference import reference_outputs, rel_max_err
from test_gpu_forward import K, TOL, V, make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# lengths around N = 64, 128, 192: shorter, equal, one more, multiples, empty sequences
LENS = [0, 1, 63, 64, 65, 128, 191, 192, 193, 384, 500, 0]


def checkpoint_starts(lens, every_n, dtype=torch.int64):
    """checkpoint_cu_starts: sequence i's checkpoints start at the sum of the earlier sequences' len // N."""
    counts = [n // every_n for n in lens]
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device="cuda", dtype=dtype)


def checkpoint_buffer(rows, HV, transpose):
    """The buffer in the state's layout, poisoned with NaN so that an unwritten row fails."""
    shape = (rows, HV, V, K) if transpose else (rows, HV, K, V)
    return torch.full(shape, float("nan"), device="cuda")


def as_kv(x, transpose):
    """States [.., V, K] (transpose_state) as [.., K, V], the reference's layout."""
    return x.transpose(-1, -2) if transpose else x


def check_checkpoints(name, buffer, transpose, ref_ckpt):
    assert torch.isfinite(buffer).all(), f"{name}: a checkpoint row was not written (NaN left)"
    assert buffer.shape[0] == ref_ckpt.shape[0], name
    if buffer.shape[0]:
        err = rel_max_err(as_kv(buffer, transpose).cpu(), ref_ckpt)
        assert err <= TOL[torch.bfloat16], f"{name}: checkpoint error {err:.3e}"


def run_case(name, lens, every_n, H=2, HV=4, transpose=False, with_h0=True, starts_dtype=torch.int64,
             validate=False, seed=0):
    """A varlen forward with checkpoints, against the reference and against the same call without them."""
    import gdn_aot

    q, k, v, g, beta, cu = make_inputs(lens, H, HV, torch.bfloat16, seed=seed)
    starts = checkpoint_starts(lens, every_n, starts_dtype)
    buffer = checkpoint_buffer(int(starts[-1]), HV, transpose)
    h0 = torch.randn(len(lens), HV, K, V, device="cuda") if with_h0 else None
    kw = dict(initial_state=None if h0 is None else as_kv(h0, transpose).contiguous(), output_final_state=True,
              cu_seqlens=cu, use_qk_l2norm_in_kernel=True, transpose_state=transpose)
    starts_before = starts.clone()
    o, ht = gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, **kw, state_checkpoints=buffer,
                                           checkpoint_cu_starts=starts, checkpoint_every_n_tokens=every_n,
                                           validate=validate)
    o_plain, ht_plain = gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    torch.cuda.synchronize()
    assert torch.equal(starts, starts_before), f"{name}: checkpoint_cu_starts was modified"
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain), f"{name}: o / ht differ from the call without"
    ref_o, ref_ht, ref_ckpt = reference_outputs(q, k, v, g, beta, cu.tolist(), h0, True, checkpoint_every=every_n)
    check_checkpoints(name, buffer, transpose, ref_ckpt)
    assert rel_max_err(o.float().reshape(ref_o.shape).cpu(), ref_o) <= TOL[torch.bfloat16], name
    for i, n in enumerate(lens):
        if n and n % every_n == 0:
            assert torch.equal(buffer[int(starts[i + 1]) - 1], ht[i]), f"{name}: sequence {i}'s last checkpoint"


@pytest.mark.parametrize("every_n", [64, 128, 192])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_checkpoints_against_the_recurrence(every_n, transpose, with_h0):
    run_case(f"N={every_n} transpose={transpose} h0={with_h0}", LENS, every_n, transpose=transpose, with_h0=with_h0)


@pytest.mark.parametrize("starts_dtype", [torch.int32, torch.int64])
def test_starts_of_either_index_dtype_and_validated(starts_dtype):
    run_case(f"{starts_dtype} starts, validate", LENS, 64, starts_dtype=starts_dtype, validate=True)


def test_no_sequence_reaches_a_checkpoint():
    """Every sequence shorter than N: no rows at all (an empty buffer), nothing else changes."""
    run_case("no rows", [1, 63, 0, 100], 128)


def test_long_sequences_qwen_heads():
    """Qwen3.5's heads (H = 16, HV = 32) over thousands of tokens, against the fp32 chunked reference."""
    run_case("H=16 HV=32 5000+3072+1000, N=1024", [5000, 3072, 1000], 1024, H=16, HV=32)


@pytest.mark.parametrize("transpose", [False, True])
def test_every_dispatch_row(transpose, monkeypatch):
    """Each row of the configuration with checkpoints (specs/qwen35.yaml's sm_90a artifacts: the warp-specialised
    scan at BV 32 and 64, the 8-warp BV 128 one), forced on one batch: every variant writes the same checkpoints."""
    from gdn_aot.loader import Artifacts

    arts = Artifacts.for_device(torch.cuda.current_device())
    routes = arts.routes("bf16", K, V, True, transpose, "fp32", False, True)
    plain = arts.routes("bf16", K, V, True, transpose, "fp32", False, False)  # the call run_case compares with
    routes.load()
    plain.load()
    for route in routes.routes:
        monkeypatch.setattr(routes, "tiers", ((float("inf"), route),))
        # the same route without checkpoints (its rows round alike; a build may route the classes differently)
        monkeypatch.setattr(plain, "tiers", ((float("inf"), next(r for r in plain.routes if r.name == route.name)),))
        run_case(f"{route.row['class']} row ({route}) transpose={transpose}", LENS, 64, transpose=transpose)


def test_checkpoints_with_a_state_pool():
    """state_indices: the pool is read and written in place; the checkpoints still follow the sequences (rows
    checkpoint_cu_starts[i] ...), whatever their slots, slot -1 (zero state, nothing written back) included."""
    import gdn_aot

    lens, idx, every_n, HV = [130, 64, 0, 200, 63], [3, -1, 0, 5, 2], 64, 4
    q, k, v, g, beta, cu = make_inputs(lens, 2, HV, torch.bfloat16, seed=3)
    pool = torch.randn(6, HV, K, V, device="cuda")
    before = pool.clone()
    starts = checkpoint_starts(lens, every_n)
    buffer = checkpoint_buffer(int(starts[-1]), HV, False)
    gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                   state_indices=torch.tensor(idx, device="cuda", dtype=torch.int32),
                                   state_checkpoints=buffer, checkpoint_cu_starts=starts,
                                   checkpoint_every_n_tokens=every_n)
    torch.cuda.synchronize()
    h0 = torch.stack([before[i] if i >= 0 else torch.zeros_like(before[0]) for i in idx])
    _, ref_ht, ref_ckpt = reference_outputs(q, k, v, g, beta, cu.tolist(), h0, True, checkpoint_every=every_n)
    check_checkpoints("pool", buffer, False, ref_ckpt)
    # sequence 1 (64 tokens, slot -1): its one checkpoint, row 2, is its final state, which is nowhere else
    assert rel_max_err(buffer[2].cpu(), ref_ht[1]) <= TOL[torch.bfloat16]
    for seq, slot in ((0, 3), (2, 0), (3, 5), (4, 2)):  # the final states in their slots (sequence 2 is empty)
        assert rel_max_err(pool[slot].cpu(), ref_ht[seq]) <= TOL[torch.bfloat16], (seq, slot)
    assert torch.equal(pool[[1, 4]], before[[1, 4]])  # slots no sequence names


def test_malformed_starts_write_nothing_outside_the_buffer():
    """Without validate, checkpoint_cu_starts is trusted as cu_seqlens is: rows it puts outside the buffer (past
    its end, or negative) are not written, so the memory around the buffer is untouched and nothing faults."""
    import gdn_aot

    lens, every_n, HV = [256, 128], 64, 4
    q, k, v, g, beta, cu = make_inputs(lens, 2, HV, torch.bfloat16, seed=4)
    rows = 6
    arena = torch.full((rows + 8, HV, K, V), float("nan"), device="cuda")
    for shift in (rows, -100):
        starts = checkpoint_starts(lens, every_n) + shift
        gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                       state_checkpoints=arena[4:4 + rows], checkpoint_cu_starts=starts,
                                       checkpoint_every_n_tokens=every_n)
        torch.cuda.synchronize()
        assert torch.isnan(arena).all(), f"shift {shift}: a row outside the buffer was written"
    with pytest.raises(ValueError, match="checkpoint_cu_starts must start at 0"):
        gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, state_checkpoints=arena[4:4 + rows],
                                       checkpoint_cu_starts=starts, checkpoint_every_n_tokens=every_n, validate=True)


def test_fixed_length_batch():
    """A fixed-length batch [B, T] (checkpoint_cu_starts [B + 1], T // N rows each), where a spec builds it;
    specs/qwen35.yaml and fused-preview.yaml build checkpoints for varlen batches only, and the call then says so."""
    import gdn_aot
    from gdn_aot.loader import VariantNotBuilt

    B, T, HV, every_n = 3, 200, 4, 64
    q, k, v, g, beta, _ = make_inputs([T], 2, HV, torch.bfloat16, batch=B, seed=5)
    starts = checkpoint_starts([T] * B, every_n)
    buffer = checkpoint_buffer(int(starts[-1]), HV, False)
    try:
        gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, state_checkpoints=buffer,
                                       checkpoint_cu_starts=starts, checkpoint_every_n_tokens=every_n)
    except VariantNotBuilt as e:
        assert "varlen=False" in str(e) and "checkpoints=True" in str(e)
        pytest.skip("no fixed-length variant with checkpoints is built")
    torch.cuda.synchronize()
    _, _, ref_ckpt = reference_outputs(q, k, v, g, beta, [i * T for i in range(B + 1)], None, True,
                                       checkpoint_every=every_n)
    check_checkpoints("fixed", buffer, False, ref_ckpt)


def test_cuda_graph_capture_and_replay():
    """The call with checkpoints captures into a CUDA graph (no host synchronisation) and a replay with new inputs
    in the same tensors writes the new checkpoints."""
    import gdn_aot

    lens, every_n, HV = [300, 64, 5], 64, 4
    q, k, v, g, beta, cu = make_inputs(lens, 2, HV, torch.bfloat16, seed=6)
    starts = checkpoint_starts(lens, every_n)
    buffer = checkpoint_buffer(int(starts[-1]), HV, False)
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_checkpoints=buffer, checkpoint_cu_starts=starts,
              checkpoint_every_n_tokens=every_n)
    gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, **kw)  # warm-up: loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    q2, k2, v2, g2, beta2, _ = make_inputs(lens, 2, HV, torch.bfloat16, seed=7)
    for dst, src in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2)):
        dst.copy_(src)
    buffer.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _, _, ref_ckpt = reference_outputs(q, k, v, g, beta, cu.tolist(), None, True, checkpoint_every=every_n)
    check_checkpoints("graph replay", buffer, False, ref_ckpt)
