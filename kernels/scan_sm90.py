"""gdn_scan for Hopper (sm_90a): the state recurrence fused with the output of every chunk.

One program per (sequence, value head, V tile) walks the sequence's chunks in order (steps 4-5 of
docs/gdn-math.md) with the state h [K, BV] in fp32 registers (the wgmma accumulator layout):
    v_new = u - w h
    o     = scale (e^gam * (q h) + ((q k^T) . M) v_new)        M_ij = e^(gam_i - gam_j), i >= j
    h     = e^gam_last h + k^T (e^(gam_last - gam) v_new)
Units: TMA brings q, k, w, u of chunk c + 1 into the other half of a two-stage shared-memory ring (completion on
an mbarrier) while the warpgroup's wgmma work on chunk c; o leaves through a TMA store. The TMA descriptors are
built on the device per sequence with the sequence's length as their row bound, so the last chunk's loads are
zero-filled past the end and its store is clipped: no chunk ever touches a neighbouring sequence's rows.
Because o is produced here, neither the per-chunk states nor v_new ever reach HBM.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .common import (SCAN_HAS_H0, SCAN_L2NORM, SCAN_STORE_HT, SCAN_USE_INDICES, causal_decay, chunk_row_scalings,
                     chunk_rows, issue_chunk_loads, load_state_tile, row_tile_desc, sequence_bounds,
                     store_state_tile, wgmma_layout)


@gluon.jit
def scan_kernel(q, k, w, u, gam, rq, rk, cu_seqlens, h0, ht, state_indices, o, scale, T, H, HV, flags,
                K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, IS_VARLEN: gl.constexpr,
                TRANSPOSE_STATE: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q.dtype.element_ty
    i_n = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_v = gl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN)
    n_chunks = gl.cdiv(seq_len, BT)

    # --- wgmma accumulator layouts: o and v_new [BT, BV], the intra-chunk scores [BT, BT], the state [K, BV].
    acc_tv: gl.constexpr = wgmma_layout(BT, BV, num_warps)
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, num_warps)
    acc_kv: gl.constexpr = wgmma_layout(K, BV, num_warps)

    # --- the state: slot i_n, or the caller's pool slot; a negative slot starts from zero and is not written.
    slot = i_n
    if flags & SCAN_USE_INDICES:
        slot = gl.load(state_indices + i_n)
    h = load_state_tile(h0, slot, i_hv, i_v, HV, ((flags & SCAN_HAS_H0) != 0) & (slot >= 0), K, V, BV,
                        TRANSPOSE_STATE, acc_kv)

    # --- per-sequence TMA descriptors (row bound = seq_len).
    row0 = bos.to(gl.int64)
    q_desc = row_tile_desc(q + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    k_desc = row_tile_desc(k + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    w_desc = row_tile_desc(w + row0 * HV * K + i_hv * K, HV * K, seq_len, BT, K)
    u_desc = row_tile_desc(u + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    o_desc = row_tile_desc(o + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)

    # --- shared memory: a two-stage ring for the chunk inputs, single buffers for what the MMAs exchange.
    q_ring = gl.allocate_shared_memory(dtype, [2, BT, K], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    w_ring = gl.allocate_shared_memory(dtype, [2, BT, K], w_desc.layout)
    u_ring = gl.allocate_shared_memory(dtype, [2, BT, BV], u_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(2):
        mbarrier.init(ready.index(stage), count=1)
    h_smem = gl.allocate_shared_memory(dtype, [K, BV], gl.NVMMASharedLayout.get_default_for([K, BV], dtype))
    v_new_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    v_dec_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)

    # per-row chunk data (gam, and the inverse q/k norms of use_qk_l2norm_in_kernel): loaded one chunk ahead,
    # one element a thread, then converted to the row/column slices of the MMA layouts that use it
    rows = gl.arange(0, BT, gl.BlockedLayout([1], [32], [num_warps], [0]))
    gam_head = gam + row0 * HV + i_hv
    rq_head = rq + row0 * HV + i_hv
    rk_head = rk + row0 * HV + i_hv
    l2norm = (flags & SCAN_L2NORM) != 0
    gam_v, gam_last, rq_v, rk_v = chunk_rows(gam_head, rq_head, rk_head, 0, seq_len, rows, HV, l2norm, BT)

    if n_chunks > 0:
        issue_chunk_loads(q_desc, k_desc, w_desc, u_desc, 0, ready.index(0),
                          q_ring.index(0), k_ring.index(0), w_ring.index(0), u_ring.index(0))
    for c in range(n_chunks):
        s = c % 2
        if c + 1 < n_chunks:
            # the other stage was last read in chunk c - 1; every warp must be past it before TMA overwrites it
            gl.thread_barrier()
            issue_chunk_loads(q_desc, k_desc, w_desc, u_desc, (c + 1) * BT, ready.index(1 - s),
                              q_ring.index(1 - s), k_ring.index(1 - s), w_ring.index(1 - s), u_ring.index(1 - s))
        gam_n, last_n, rq_n, rk_n = chunk_rows(gam_head, rq_head, rk_head, c + 1, seq_len, rows, HV, l2norm, BT)

        # row scalings of the chunk: q_i -> rq_i q_i and k_j -> rk_j k_j (use_qk_l2norm_in_kernel) fold in here
        n_rows = seq_len - c * BT
        o_scale, v_dec_scale, decay_rows, decay_cols, h_decay = chunk_row_scalings(
            gam_v, gam_last, rq_v, rk_v, scale, gl.SliceLayout(1, acc_tv), gl.SliceLayout(1, acc_tt),
            gl.SliceLayout(0, acc_tt))

        mbarrier.wait(ready.index(s), (c // 2) & 1)
        q_s = q_ring.index(s)
        k_s = k_ring.index(s)

        # v_new = u - w h, parked in shared memory right away (the next two MMAs read it from there)
        h_smem.store(h.to(dtype))
        fence_async_shared()
        w_h = warpgroup_mma(w_ring.index(s), h_smem, gl.zeros([BT, BV], gl.float32, acc_tv), use_acc=False)
        v_new = u_ring.index(s).load(acc_tv).to(gl.float32) - w_h
        v_new_smem.store(v_new.to(dtype))
        v_dec_smem.store((v_new * gl.expand_dims(v_dec_scale, 1)).to(dtype))

        # intra-chunk scores, causally masked with the decay; kept as the bf16 A operand of the next MMA
        scores = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt), use_acc=False)
        scores = scores * causal_decay(decay_rows, decay_cols, n_rows, STRICT=False)
        scores = gl.convert_layout(scores.to(dtype), gl.DotOperandLayout(0, acc_tv, 2))
        fence_async_shared()

        # o = scale e^gam (q h) + scores v_new
        q_h = warpgroup_mma(q_s, h_smem, gl.zeros([BT, BV], gl.float32, acc_tv), use_acc=False)
        o_acc = warpgroup_mma(scores, v_new_smem, q_h * gl.expand_dims(o_scale, 1))
        tma.store_wait(0)  # the previous chunk's output has left o_smem
        gl.thread_barrier()
        o_smem.store(o_acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_smem)

        # h = e^gam_last h + k^T (e^(gam_last - gam) v_new)
        h = warpgroup_mma(k_s.permute((1, 0)), v_dec_smem, h * h_decay)
        gam_v, gam_last, rq_v, rk_v = gam_n, last_n, rq_n, rk_n
    tma.store_wait(0)
    for stage in gl.static_range(2):
        mbarrier.invalidate(ready.index(stage))

    store_state_tile(ht, h, slot, i_hv, i_v, HV, ((flags & SCAN_STORE_HT) != 0) & (slot >= 0), K, V, BV,
                     TRANSPOSE_STATE)
