"""gdn_scan for Hopper (sm_90a): the state recurrence fused with the output of every chunk.

One program per (sequence, value head, V tile) walks the sequence's chunks in order (steps 4-5 of
docs/algorithm.md) with the state h [K, BV] in fp32 registers (the wgmma accumulator layout):
    v_new = u - w h
    o     = scale (e^gam * (q h) + ((q k^T) . M) v_new)        M_ij = e^(gam_i - gam_j), i >= j
    h     = e^gam_last h + k^T (e^(gam_last - gam) v_new)
(with use_qk_l2norm_in_kernel, q_i -> rq_i q_i and k_j -> rk_j k_j enter through gdn_prepare's qg, kg.)
Units:
  * TMA brings q and k of chunk c + 2 into a two-stage ring as soon as chunk c is done with it, w of chunk c + 1
    into a single buffer as soon as chunk c's w h is done, and u of chunk c + 1 into the v_dec buffer (free
    between chunks) at the end of chunk c; completion on mbarriers. The TMA descriptors are built on the device
    per sequence with the sequence's length as row bound: the last chunk's loads are zero-filled past the end
    and its output store is clipped, so no chunk touches a neighbouring sequence's rows.
  * wgmma, asynchronous: w h goes out with q k^T, then k^T v_dec with q h; only w h and the state update are on
    the recurrence's critical path (h -> w h -> v_new -> k^T v_dec -> h), the others complete beside them.
  * o leaves by TMA store through the v_new buffer once the output MMA has read it.
Shared memory at BV = 64: q, k rings 64 KB, w 16 KB, h 16 KB, v_new / o and v_dec 16 KB = 112 KB, so two
programs share an SM and each hides the other's latencies.
Neither the per-chunk states nor v_new ever reach HBM.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .common import (SCAN_HAS_H0, SCAN_STORE_HT, SCAN_USE_INDICES, Checkpoints, causal_decay, chunk_row_scalings,
                     load_state_tile, mbarriers, row_tile_desc, sequence_bounds, store_state_tile, wgmma_layout)
from .scan_sm90_ws import RowData, scan_chunks_warp_specialized


@gluon.jit
def _load_tile(bar, row, desc, buf):
    """TMA load of the tile at `row` of a row-tile descriptor, completing on `bar`."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bar, buf)


@gluon.jit
def _load_tiles(bar, row, desc_a, buf_a, desc_b, buf_b):
    """TMA loads of the [BT, K] tiles at `row` of two descriptors, completing on `bar`."""
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_a, [row, 0], bar, buf_a)
    tma.async_copy_global_to_shared(desc_b, [row, 0], bar, buf_b)


@gluon.jit
def _scan_chunks(h, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, row_data, scale, checkpoints, i_v):
    """The chunk loop on one warpgroup (or two at BV = 128); returns the final state (and writes the checkpoints
    of V tile i_v on the way)."""
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    num_warps: gl.constexpr = gl.num_warps()
    # --- wgmma accumulator layouts: o and v_new [BT, BV], the intra-chunk scores [BT, BT].
    acc_tv: gl.constexpr = wgmma_layout(BT, BV, num_warps)
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, num_warps)
    rows_tv: gl.constexpr = gl.SliceLayout(1, acc_tv)

    # --- shared memory: q, k rings of two chunks; single buffers for w and for what the MMAs exchange.
    q_ring = gl.allocate_shared_memory(dtype, [2, BT, K], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [BT, K], w_desc.layout)
    h_smem = gl.allocate_shared_memory(dtype, [K, BV], gl.NVMMASharedLayout.get_default_for([K, BV], dtype))
    v_new_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)  # v_new, then the chunk's o
    v_dec_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)  # u, then v_dec
    bars = mbarriers(4, 1)  # q/k stage 0, 1; w; u
    w_ready = bars.index(2)
    u_ready = bars.index(3)

    # per-row chunk data, loaded during the chunk before (off the critical path), straight in the layouts of
    # the MMA results that use them
    qg_r, kg_r, kg_c, gam_last = row_data.chunk(0, BT, rows_tv, gl.SliceLayout(0, acc_tt))

    if n_chunks > 0:
        _load_tiles(bars.index(0), 0, q_desc, q_ring.index(0), k_desc, k_ring.index(0))
        _load_tile(w_ready, 0, w_desc, w_smem)
        _load_tile(u_ready, 0, u_desc, v_dec_smem)
    if n_chunks > 1:
        _load_tiles(bars.index(1), BT, q_desc, q_ring.index(1), k_desc, k_ring.index(1))
    for c in range(n_chunks):
        s = c % 2
        q_s = q_ring.index(s)
        k_s = k_ring.index(s)
        n_rows = row_data.seq_len - c * BT
        o_scale, v_dec_scale, decay_rows, h_decay = chunk_row_scalings(qg_r, kg_r, gam_last, scale,
                                                                       gl.SliceLayout(1, acc_tt))

        # w h (the recurrence's critical path) and q k^T (independent of h) go out together
        h_smem.store(h.to(dtype))
        fence_async_shared()
        mbarrier.wait(w_ready, c & 1)
        mbarrier.wait(bars.index(s), (c // 2) & 1)
        w_h = warpgroup_mma(w_smem, h_smem, gl.zeros([BT, BV], gl.float32, acc_tv), use_acc=False, is_async=True)
        scores = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt), use_acc=False,
                               is_async=True)
        w_h = warpgroup_mma_wait(1, deps=[w_h])
        mbarrier.wait(u_ready, c & 1)
        u_c = v_dec_smem.load(acc_tv)

        # w is free: the next chunk's w comes in now; u has been read and the previous chunk's o has left
        # v_new_smem, so both buffers can be written
        tma.store_wait(0)
        gl.thread_barrier()
        if c + 1 < n_chunks:
            _load_tile(w_ready, (c + 1) * BT, w_desc, w_smem)

        # v_new = u - w h; h = e^gam_last h + k^T (e^(gam_last - gam) v_new), then q h (h_smem still holds
        # the chunk's starting state), both in flight while the scores are masked
        v_new = u_c.to(gl.float32) - w_h
        v_new_smem.store(v_new.to(dtype))
        v_dec_smem.store((v_new * gl.expand_dims(v_dec_scale, 1)).to(dtype))
        fence_async_shared()
        decay = causal_decay(decay_rows, kg_c, n_rows, STRICT=False)  # before h and q h are in flight: registers
        h = warpgroup_mma(k_s.permute((1, 0)), v_dec_smem, h * h_decay, is_async=True)
        q_h = warpgroup_mma(q_s, h_smem, gl.zeros([BT, BV], gl.float32, acc_tv), use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(2, deps=[scores])
        p = (scores * decay).to(dtype)
        qg_r, kg_r, kg_c, gam_last = row_data.chunk(c + 1, BT, rows_tv, gl.SliceLayout(0, acc_tt))
        h, q_h = warpgroup_mma_wait(0, deps=[h, q_h])

        # o = scale e^gam (q h) + (scores . decay) v_new
        o_acc = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(0, acc_tv, 2)), v_new_smem,
                              q_h * gl.expand_dims(o_scale, 1))

        # every warp is done with this stage's q, k, with v_dec and v_new: chunk c + 2's q, k and chunk
        # c + 1's u come in, o goes out
        gl.thread_barrier()
        if c + 2 < n_chunks:
            _load_tiles(bars.index(s), (c + 2) * BT, q_desc, q_s, k_desc, k_s)
        if c + 1 < n_chunks:
            _load_tile(u_ready, (c + 1) * BT, u_desc, v_dec_smem)
        v_new_smem.store(o_acc.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], v_new_smem)
        # last in the chunk, predicated rather than behind a branch: at 4 warps a branch here (any store in it)
        # makes ptxas spill in the loop
        if checkpoints.CHECKPOINTS:
            checkpoints.store(h, checkpoints.count_after(c, row_data.seq_len), i_v)
    tma.store_wait(0)
    for b in gl.static_range(4):
        mbarrier.invalidate(bars.index(b))
    return h


@gluon.jit
def scan_kernel(q, k, w, u, gam, qg, kg, cu_seqlens, h0, ht, state_indices, o, scale, T, H, HV, flags,
                state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens, K: gl.constexpr,
                V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, IS_VARLEN: gl.constexpr,
                TRANSPOSE_STATE: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, CHECKPOINTS: gl.constexpr,
                num_warps: gl.constexpr):
    i_n = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_v = gl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN)
    n_chunks = gl.cdiv(seq_len, BT)

    # --- the state [K, BV] in the wgmma accumulator layout: slot i_n, or the caller's pool slot; a negative
    # slot starts from zero and is not written.
    acc_kv: gl.constexpr = wgmma_layout(K, BV, num_warps)
    slot = i_n
    if flags & SCAN_USE_INDICES:
        slot = gl.load(state_indices + i_n)
    h = load_state_tile(h0, slot, i_hv, i_v, HV, ((flags & SCAN_HAS_H0) != 0) & (slot >= 0), K, V, BV,
                        TRANSPOSE_STATE, acc_kv)

    # --- per-sequence TMA descriptors (row bound = seq_len) and the sequence's per-row data of this value head.
    row0 = bos.to(gl.int64)
    q_desc = row_tile_desc(q + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    k_desc = row_tile_desc(k + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    w_desc = row_tile_desc(w + row0 * HV * K + i_hv * K, HV * K, seq_len, BT, K)
    u_desc = row_tile_desc(u + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    o_desc = row_tile_desc(o + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    row_data = RowData.of_value_head(gam, qg, kg, i_hv, row0, seq_len, T, IS_VARLEN)
    checkpoints = Checkpoints(state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens, HV,
                              BT, V, TRANSPOSE_STATE, CHECKPOINTS, HEAD_MAJOR=False)

    if WARP_SPECIALIZE:
        h = scan_chunks_warp_specialized(h, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, row_data, scale,
                                         checkpoints, i_v)
    else:
        h = _scan_chunks(h, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, row_data, scale, checkpoints, i_v)
    store_state_tile(ht, h, slot, i_hv, i_v, HV, ((flags & SCAN_STORE_HT) != 0) & (slot >= 0), K, V, BV,
                     TRANSPOSE_STATE)
