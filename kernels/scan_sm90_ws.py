"""gdn_scan for Hopper (sm_90a), warp-specialised: the state recurrence and the chunk outputs on separate warps.

Same program, grid, arguments and math as scan_sm90.py (steps 4-5 of docs/algorithm.md); one program per
(sequence, value head, V tile) walks the chunks in order. What a single warpgroup did in sequence is split
between partitions that meet at mbarriers over two-slot shared-memory rings:
  * state (the default partition, 4 warps): h -> w h -> v_new = u - w h -> h = e^gam_last h + k^T v_dec.
    Only this chain is serial from chunk to chunk, and nothing else issues from its warps (~290 instructions
    a chunk, against ~1,050 for the single-warpgroup scan);
  * output (two partitions of 4 warps, even and odd chunks): q k^T masked by the decay, q h from the h slot the
    state partition published, then o = scale e^gam (q h) + P v_new, out by TMA. One output partition takes
    about twice the state chain's time a chunk (docs/performance.md: the masked exponentials), so two
    alternate and chunk c's output overlaps the state steps of c + 1 and c + 2;
  * load (1 warp): TMA of q, k, w, u, two chunks ahead of their consumers.
Each warp scheduler interleaves warps of all three instead of exposing every instruction's latency of one warp.
One program an SM (144 KB at BV 32, 189 KB at BV 64): meant for batches whose grid fits one wave.
Rings (slot c % 2, phase (c // 2) & 1): q/k (released by the state and the chunk's output partition: count
2), w, u (state), h (written by state, read by both), v_new (written by state, read by output). v_dec and the
o staging tiles are private.
Registers: the kernel is compiled at 128 a thread (16 warps, a full register file); setmaxnreg gives each
output partition OUTPUT_REGS, the load warp 24 and the state partition the rest (168).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .common import causal_decay, chunk_row_scalings, chunk_rows, mbarriers, wgmma_layout

NUM_SLOTS = gl.constexpr(2)
OUTPUT_REGS = gl.constexpr(160)


@gluon.jit
def _ring_barriers(count: gl.constexpr):
    """One mbarrier per ring slot, each completing a phase after `count` arrivals."""
    return mbarriers(NUM_SLOTS, count)


@gluon.jit
def _publish(bar):
    """Every warp of the partition has written its share (and fenced it for the async proxy): then one arrive."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _load_partition(parity, q_desc, k_desc, w_desc, u_desc, n_chunks, q_ring, k_ring, w_ring, u_ring, bars,
                    h_ring, v_new_ring, o_stage, o_desc, gam_head, qg_head, kg_head, seq_len, HV, scale):
    # (the worker partitions share one signature)
    qk_ready, qk_empty, w_ready, w_empty, u_ready, u_empty = bars[0], bars[1], bars[2], bars[3], bars[4], bars[5]
    BT: gl.constexpr = q_desc.block_type.shape[0]
    for c in range(n_chunks):
        s = c % NUM_SLOTS
        free_phase = ((c // NUM_SLOTS) & 1) ^ 1  # a fresh barrier counts as released once: the first waits pass
        mbarrier.wait(qk_empty.index(s), free_phase)
        mbarrier.expect(qk_ready.index(s), q_desc.block_type.nbytes + k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [c * BT, 0], qk_ready.index(s), q_ring.index(s))
        tma.async_copy_global_to_shared(k_desc, [c * BT, 0], qk_ready.index(s), k_ring.index(s))
        mbarrier.wait(w_empty.index(s), free_phase)
        mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [c * BT, 0], w_ready.index(s), w_ring.index(s))
        mbarrier.wait(u_empty.index(s), free_phase)
        mbarrier.expect(u_ready.index(s), u_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(u_desc, [c * BT, 0], u_ready.index(s), u_ring.index(s))


@gluon.jit
def _output_partition(parity, q_desc, k_desc, w_desc, u_desc, n_chunks, q_ring, k_ring, w_ring, u_ring, bars,
                      h_ring, v_new_ring, o_stage, o_desc, gam_head, qg_head, kg_head, seq_len, HV, scale):
    """Outputs of the chunks c = parity, parity + 2, ...: two of these partitions take turns."""
    qk_ready, qk_empty = bars[0], bars[1]
    h_ready, h_empty, v_new_ready, v_new_empty = bars[6], bars[7], bars[8], bars[9]
    BT: gl.constexpr = q_desc.block_type.shape[0]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    dtype: gl.constexpr = o_stage.dtype
    acc_tv: gl.constexpr = wgmma_layout(BT, BV, 4)
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    o_smem = o_stage.index(parity)
    for c in range(parity, n_chunks, 2):
        s = c % NUM_SLOTS
        phase = (c // NUM_SLOTS) & 1
        qg_r, kg_r, kg_c, gam_last = chunk_rows(gam_head, qg_head, kg_head, c, seq_len, HV, BT,
                                                gl.SliceLayout(1, acc_tv), gl.SliceLayout(0, acc_tt))
        o_scale, _, decay_rows, _ = chunk_row_scalings(qg_r, kg_r, gam_last, scale, gl.SliceLayout(1, acc_tt))
        q_s = q_ring.index(s)
        mbarrier.wait(qk_ready.index(s), phase)
        scores = warpgroup_mma(q_s, k_ring.index(s).permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt),
                               use_acc=False, is_async=True)
        decay = causal_decay(decay_rows, kg_c, seq_len - c * BT, STRICT=False)
        mbarrier.wait(h_ready.index(s), phase)
        q_h = warpgroup_mma(q_s, h_ring.index(s), gl.zeros([BT, BV], gl.float32, acc_tv), use_acc=False,
                            is_async=True)
        scores, q_h = warpgroup_mma_wait(0, deps=[scores, q_h])
        mbarrier.arrive(h_empty.index(s), count=1)
        mbarrier.arrive(qk_empty.index(s), count=1)
        p = (scores * decay).to(dtype)
        mbarrier.wait(v_new_ready.index(s), phase)
        o = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(0, acc_tv, 2)), v_new_ring.index(s),
                          q_h * gl.expand_dims(o_scale, 1))
        mbarrier.arrive(v_new_empty.index(s), count=1)
        tma.store_wait(0)  # the previous chunk's o has left o_smem (the issuing thread waits, then all)
        gl.thread_barrier()
        o_smem.store(o.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_smem)
    tma.store_wait(0)


@gluon.jit
def _state_partition(h, n_chunks, k_ring, w_ring, u_ring, h_ring, v_new_ring, v_dec_smem, bars,
                     gam_head, qg_head, kg_head, seq_len, HV, checkpoints, i_v):
    """The recurrence; returns the final state and writes the checkpoints of V tile i_v (the only fp32 copy of
    the state is this partition's)."""
    qk_ready, qk_empty, w_ready, w_empty, u_ready, u_empty = bars[0], bars[1], bars[2], bars[3], bars[4], bars[5]
    h_ready, h_empty, v_new_ready, v_new_empty = bars[6], bars[7], bars[8], bars[9]
    BT: gl.constexpr = w_ring.shape[1]
    BV: gl.constexpr = v_dec_smem.shape[1]
    dtype: gl.constexpr = v_dec_smem.dtype
    acc_tv: gl.constexpr = wgmma_layout(BT, BV, 4)
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    for c in range(n_chunks):
        s = c % NUM_SLOTS
        phase = (c // NUM_SLOTS) & 1
        _, kg_r, _, gam_last = chunk_rows(gam_head, qg_head, kg_head, c, seq_len, HV, BT,
                                          gl.SliceLayout(1, acc_tv), gl.SliceLayout(0, acc_tt))
        # publish h_c: read by w h here and by q h in the output partition
        mbarrier.wait(h_empty.index(s), phase ^ 1)
        h_ring.index(s).store(h.to(dtype))
        fence_async_shared()
        _publish(h_ready.index(s))
        mbarrier.wait(w_ready.index(s), phase)
        w_h = warpgroup_mma(w_ring.index(s), h_ring.index(s), gl.zeros([BT, BV], gl.float32, acc_tv),
                            use_acc=False)
        mbarrier.arrive(w_empty.index(s), count=1)
        mbarrier.wait(u_ready.index(s), phase)
        v_new = u_ring.index(s).load(acc_tv).to(gl.float32) - w_h
        fence_async_shared()  # the load of u is ordered before the TMA that refills the slot
        mbarrier.arrive(u_empty.index(s), count=1)
        # v_new for the output partition, v_dec = e^(gam_last - kg) v_new for the state update
        mbarrier.wait(v_new_empty.index(s), phase ^ 1)
        v_new_ring.index(s).store(v_new.to(dtype))
        v_dec_smem.store((v_new * gl.expand_dims(gl.exp(gam_last - kg_r), 1)).to(dtype))
        fence_async_shared()
        _publish(v_new_ready.index(s))
        mbarrier.wait(qk_ready.index(s), phase)
        h = warpgroup_mma(k_ring.index(s).permute((1, 0)), v_dec_smem, h * gl.exp(gam_last))
        mbarrier.arrive(qk_empty.index(s), count=1)
        checkpoints.store_after(h, c, seq_len, i_v)
    return (h, )


@gluon.jit
def scan_chunks_warp_specialized(h, n_chunks, seq_len, q_desc, k_desc, w_desc, u_desc, o_desc, gam_head, qg_head,
                                 kg_head, HV, scale, checkpoints, i_v):
    """The chunk loop of gdn_scan split over the partitions above (called by scan_sm90.scan_kernel with 4 warps,
    the state partition's); returns the final state (and writes the checkpoints of V tile i_v)."""
    gl.static_assert(gl.num_warps() == 4, "the state partition is one warpgroup")
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    q_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], k_desc.layout)
    w_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], w_desc.layout)
    u_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BV], u_desc.layout)
    h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dtype)
    h_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, K, BV], h_layout)
    v_new_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BV], o_desc.layout)
    v_dec_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)
    o_stage = gl.allocate_shared_memory(dtype, [2, BT, BV], o_desc.layout)  # one per output partition
    # ready/empty barrier pairs of the rings: (q/k ready, q/k empty, w ready, w empty, u ready, u empty,
    # h ready, h empty, v_new ready, v_new empty)
    bars = (_ring_barriers(1), _ring_barriers(2), _ring_barriers(1), _ring_barriers(1), _ring_barriers(1),
            _ring_barriers(1), _ring_barriers(1), _ring_barriers(1), _ring_barriers(1), _ring_barriers(1))
    worker_args = (q_desc, k_desc, w_desc, u_desc, n_chunks, q_ring, k_ring, w_ring, u_ring, bars, h_ring,
                   v_new_ring, o_stage, o_desc, gam_head, qg_head, kg_head, seq_len, HV, scale)
    h_final = gl.warp_specialize([
        (_state_partition, (h, n_chunks, k_ring, w_ring, u_ring, h_ring, v_new_ring, v_dec_smem, bars,
                            gam_head, qg_head, kg_head, seq_len, HV, checkpoints, i_v)),
        (_output_partition, (0, ) + worker_args),
        (_output_partition, (1, ) + worker_args),
        (_load_partition, (0, ) + worker_args),
    ], [4, 4, 1], [OUTPUT_REGS, OUTPUT_REGS, 24])
    return h_final[0]
