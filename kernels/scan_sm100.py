"""gdn_scan for Blackwell (sm_100a): the state recurrence fused with the output of every chunk.

Same algorithm, grid, flags and state handling as scan_sm90.py (steps 4-5 of docs/algorithm.md). One program
per (sequence, value head, V tile), 4 warps, walks the sequence's chunks in order:
    v_new = u - w h
    o     = scale (e^gam * (q h) + ((q k^T) . M) v_new)        M_ij = e^(gam_i - gam_j), i >= j
    h     = e^gam_last h + k^T (e^(gam_last - gam) v_new)
(with use_qk_l2norm_in_kernel, q_i -> rq_i q_i and k_j -> rk_j k_j enter through gdn_prepare's qg = gam + ln rq
and kg = gam - ln rk, as on sm_90a: e^qg scales the rows of q h, e^(gam_last - kg) those of v_dec, and the
scores' decay is e^((qg_i + ln scale) - kg_j).) The per-row data (qg, kg, gam_last) of chunk c + 1 is loaded
during chunk c, straight in the slice layouts of the TMEM register tiles that use it (common.chunk_rows), once
the scores are masked (their registers are free then; the loads complete during the output epilogue).
Units:
  * TMA (UTMALDG) brings q, k, w, u of chunk c + 1 into the other half of a two-stage shared-memory ring
    (completion on an mbarrier) while chunk c computes; the descriptors are built on the device per sequence with
    the sequence length as row bound, so the last chunk's loads are zero-filled past the end.
  * tcgen05_mma (issued by one thread, operands in NVMMA shared memory, accumulators in tensor memory),
    completion by tcgen05_commit on mbarriers:
        w h        -> acc_a  [BT, BV]   (then reused for the intra-chunk output)
        q k^T      -> s_tmem [BT, BT]
        q h        -> inter  [BT, BV]   (inter-chunk output: its own accumulator)
        P v_new    -> acc_a  [BT, BV]   (intra-chunk output, P = masked decayed scores)
        k^T v_dec  -> h_tmem [K, BV]    (use_acc=True: the state update accumulates in place)
    The causal mask comes from 16-wide bitmasks (common.causal_decay_bitmask, gl.map_elementwise).
  * o leaves by TMA: full chunks with a plain TMA store (UTMASTG) through the per-sequence descriptor; the last,
    partial chunk of a sequence with tma.async_scatter (SASS UTMASTG.2D.SCATTER4) over a descriptor of
    the whole packed o, rows past the sequence end given the offset 0x7FFFFFFF, which the TMA unit skips.
  * an fp32 final state leaves by TMA through a shared-memory staging tile ([V, K]: the [K, BV/2] register tile
    stored into a permuted view of a [BV/2, K] tile); a narrower one from registers (common.store_tmem_state).
The state h [K, BV] fp32 lives in TMEM as the accumulator of the k^T v_dec update. Why TMEM and not registers:
every chunk needs h as a 16-bit MMA operand in shared memory anyway (tcgen05.ld, cvt, st.shared), and the
decay e^gam_last is applied in the same pass (tcgen05.st back), done in [K, 64] column slices, so at most 64
fp32 values of h a thread are live in registers, and only during that pass, instead of across the whole loop
body (BV = 128 would pin 128 fp32 registers a thread, as the wgmma accumulator does on sm_90a); the update
itself is then a single accumulating MMA, and the final state is read back in two [K, BV/2] column slices.
The ordering this needs (tcgen05.st before the MMA that accumulates into it) is given by tcgen05.wait::st
(emitted with the store) + fence + CTA barrier before the single-thread issue.
TMEM columns: h BV + inter BV + acc_a BV + scores BT (M = 64 accumulators may share columns, see tmem_size).
With WARP_SPECIALIZE (16 warps, BV 64) the chunk loop is scan_sm100_ws.py's instead: the same state in TMEM, the
same loads of the initial state and stores of the final one here, the recurrence and the outputs on separate
partitions.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory,
                                                                  get_tmem_reg_layout, mbarrier, tcgen05_commit,
                                                                  tcgen05_mma, tma)

from .common import (SCAN_HAS_H0, SCAN_STORE_HT, SCAN_USE_INDICES, Checkpoints, causal_decay_bitmask,
                     chunk_row_scalings, issue_chunk_loads, load_state_tile, mbarriers, row_tile_desc,
                     sequence_bounds, store_tmem_state)
from .scan_sm90_ws import RowData
from .scan_sm100_ws import operands_ready, scan_chunks_warp_specialized, store_chunk_output



@gluon.jit
def _store_state(ht, h_tmem, stage, slot, i_hv, i_v, HV, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                 TRANSPOSE_STATE: gl.constexpr, num_warps: gl.constexpr):
    """Final state tile [K, BV] fp32 from TMEM to ht[slot, i_hv] by TMA, in two [K, BV/2] column halves.

    `stage` is K * BV * 2 bytes of shared memory (the bf16 h operand buffer, free after the loop): exactly one
    fp32 half tile. Transposed state ([V, K] in HBM): the half tile is staged as [BV/2, K] and written through
    its permuted view, so the TMA store writes rows of K contiguous floats.
    """
    HB: gl.constexpr = BV // 2
    tm_half: gl.constexpr = TensorMemoryLayout(block=(K, HB), col_stride=1)
    reg_half: gl.constexpr = get_tmem_reg_layout(gl.float32, [K, HB], tm_half, num_warps)
    base = ht + (slot.to(gl.int64) * HV + i_hv) * (K * V)
    if TRANSPOSE_STATE:
        st_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HB, K], gl.float32)
        st_smem = stage._reinterpret(gl.float32, [HB, K], st_layout)
        desc = tma.make_tensor_descriptor(base, [V, K], [K, 1], [HB, K], st_layout)
    else:
        st_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, HB], gl.float32)
        st_smem = stage._reinterpret(gl.float32, [K, HB], st_layout)
        desc = tma.make_tensor_descriptor(base, [K, V], [V, 1], [K, HB], st_layout)
    for half in gl.static_range(2):
        h_half = h_tmem.slice(half * HB, HB).load(reg_half)
        tma.store_wait(0)  # the previous half has left the staging tile
        gl.thread_barrier()
        if TRANSPOSE_STATE:
            st_smem.permute((1, 0)).store(h_half)
        else:
            st_smem.store(h_half)
        operands_ready()
        if TRANSPOSE_STATE:
            tma.async_copy_shared_to_global(desc, [i_v * BV + half * HB, 0], st_smem)
        else:
            tma.async_copy_shared_to_global(desc, [0, i_v * BV + half * HB], st_smem)
    tma.store_wait(0)


@gluon.jit
def _store_checkpoint(checkpoints, h_tmem, c, seq_len, i_v, HS: gl.constexpr, reg_hs: gl.constexpr):
    """The state after chunk c, from TMEM, when c ends on a checkpoint: in the [K, HS] column slices that the h
    pass moves through registers, each stored from its tcgen05.ld layout (a K row a thread): no staging tile in
    shared memory, which the loop has none of to spare at BV = 128, and no wait for a TMA store to free one."""
    if checkpoints.CHECKPOINTS:
        n = checkpoints.count_after(c, seq_len)
        if n > 0:
            SLICES: gl.constexpr = h_tmem.shape[1] // HS
            for j in gl.static_range(SLICES):
                checkpoints.store(h_tmem.slice(j * HS, HS).load(reg_hs), n, i_v * SLICES + j)


@gluon.jit
def _scan_chunks(h_tmem, h_smem, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, o_all_desc, bos, o_col, row_data,
                 scale, checkpoints, i_v):
    """The chunk loop on the state in h_tmem, in one partition (h_smem: h's 16-bit copy, the B operand of w h and
    q h)."""
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    seq_len = row_data.seq_len
    num_warps: gl.constexpr = gl.num_warps()
    tm_tv: gl.constexpr = TensorMemoryLayout(block=(BT, BV), col_stride=1)
    tm_tt: gl.constexpr = TensorMemoryLayout(block=(BT, BT), col_stride=1)
    reg_tv: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BV], tm_tv, num_warps)
    reg_tt: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BT], tm_tt, num_warps)
    HS: gl.constexpr = 64 if BV > 64 else BV  # width of the state column slices that pass through registers
    tm_hs: gl.constexpr = TensorMemoryLayout(block=(K, HS), col_stride=1)
    reg_hs: gl.constexpr = get_tmem_reg_layout(gl.float32, [K, HS], tm_hs, num_warps)
    inter_tmem = allocate_tensor_memory(gl.float32, [BT, BV], tm_tv)  # q h
    acc_a = allocate_tensor_memory(gl.float32, [BT, BV], tm_tv)  # w h, then (q k^T . M) v_new
    s_tmem = allocate_tensor_memory(gl.float32, [BT, BT], tm_tt)  # q k^T

    # --- shared memory: a two-stage ring for the chunk inputs, single buffers for what the MMAs exchange.
    q_ring = gl.allocate_shared_memory(dtype, [2, BT, K], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    w_ring = gl.allocate_shared_memory(dtype, [2, BT, K], w_desc.layout)
    u_ring = gl.allocate_shared_memory(dtype, [2, BT, BV], u_desc.layout)
    v_new_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    v_dec_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BT, BT], gl.NVMMASharedLayout.get_default_for([BT, BT], dtype))
    o_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)
    # barriers: 0, 1 TMA ring stages; 2 w h; 3 q k^T + q h; 4 intra output; 5 state update
    bars = mbarriers(6, 1)
    bar_wh = bars.index(2)
    bar_sq = bars.index(3)
    bar_o = bars.index(4)
    bar_h = bars.index(5)

    # per-row chunk data (qg, kg over the output rows, kg over the score columns, gam of the last row): loaded one
    # chunk ahead (common.chunk_rows, as on sm_90a) straight in the slice layouts of the TMEM register tiles
    rows_tv: gl.constexpr = gl.SliceLayout(1, reg_tv)
    cols_tt: gl.constexpr = gl.SliceLayout(0, reg_tt)
    qg_r, kg_r, kg_c, gam_last = row_data.chunk(0, BT, rows_tv, cols_tt)

    if n_chunks > 0:
        issue_chunk_loads(q_desc, k_desc, w_desc, u_desc, 0, bars.index(0),
                          q_ring.index(0), k_ring.index(0), w_ring.index(0), u_ring.index(0))
    for c in range(n_chunks):
        s = c % 2
        phase = c & 1
        if c + 1 < n_chunks:
            # the other stage was last read by chunk c - 1's MMAs (all waited on) and register loads
            gl.thread_barrier()
            issue_chunk_loads(q_desc, k_desc, w_desc, u_desc, (c + 1) * BT, bars.index(1 - s),
                              q_ring.index(1 - s), k_ring.index(1 - s), w_ring.index(1 - s), u_ring.index(1 - s))

        # row scalings of the chunk (the q/k norms of use_qk_l2norm_in_kernel are folded into qg, kg)
        n_rows = seq_len - c * BT
        o_scale, v_dec_scale, decay_rows, h_decay = chunk_row_scalings(qg_r, kg_r, gam_last, scale,
                                                                       gl.SliceLayout(1, reg_tt))

        # the checkpoint chunk c - 1 ended on, if any (here rather than at the end of chunk c - 1, where ptxas
        # spills at BV = 128)
        _store_checkpoint(checkpoints, h_tmem, c - 1, seq_len, i_v, HS, reg_hs)
        # h: TMEM -> registers once: the bf16 operand for w h and q h, and e^gam_last h back into TMEM, where
        # the k^T v_dec MMA of this chunk accumulates onto it
        # (in [K, HS] column slices, HS bf16 = one 128-byte swizzle span of h_smem, to bound register use)
        for j in gl.static_range(BV // HS):
            h_part = h_tmem.slice(j * HS, HS).load(reg_hs)
            h_smem.slice(j * HS, HS, dim=1).store(h_part.to(dtype))
            h_tmem.slice(j * HS, HS).store(h_part * h_decay)

        mbarrier.wait(bars.index(s), (c // 2) & 1)
        q_s = q_ring.index(s)
        k_s = k_ring.index(s)
        operands_ready()
        tcgen05_mma(w_ring.index(s), h_smem, acc_a, use_acc=False)
        tcgen05_commit(bar_wh)
        tcgen05_mma(q_s, k_s.permute((1, 0)), s_tmem, use_acc=False)
        tcgen05_mma(q_s, h_smem, inter_tmem, use_acc=False)
        tcgen05_commit(bar_sq)

        # v_new = u - w h, parked in shared memory (operand of the intra-chunk MMA), and its decayed copy
        mbarrier.wait(bar_wh, phase)
        v_new = u_ring.index(s).load(reg_tv).to(gl.float32) - acc_a.load(reg_tv)
        v_new_smem.store(v_new.to(dtype))
        v_dec_smem.store((v_new * gl.expand_dims(v_dec_scale, 1)).to(dtype))

        # intra-chunk scores, causally masked (16-wide bitmasks) with the decay; the 16-bit A operand of P v_new
        mbarrier.wait(bar_sq, phase)
        scores = s_tmem.load(reg_tt) * causal_decay_bitmask(decay_rows, kg_c, n_rows, STRICT=False)
        p_smem.store(scores.to(dtype))
        operands_ready()
        tcgen05_mma(p_smem, v_new_smem, acc_a, use_acc=False)
        tcgen05_commit(bar_o)
        # h = e^gam_last h + k^T v_dec, accumulated in TMEM; overlaps the output epilogue below
        tcgen05_mma(k_s.permute((1, 0)), v_dec_smem, h_tmem, use_acc=True)
        tcgen05_commit(bar_h)
        # the next chunk's row data: the scores' registers are free, and the loads complete during the epilogue
        qg_r, kg_r, kg_c, gam_last = row_data.chunk(c + 1, BT, rows_tv, cols_tt)

        # o = scale e^gam (q h) + P v_new, from the two accumulators
        mbarrier.wait(bar_o, phase)
        o_acc = inter_tmem.load(reg_tv) * gl.expand_dims(o_scale, 1) + acc_a.load(reg_tv)
        store_chunk_output(o_acc, o_smem, o_desc, o_all_desc, c, n_rows, bos, o_col)
        mbarrier.wait(bar_h, phase)
    tma.store_wait(0)
    gl.thread_barrier()
    for b in gl.static_range(6):
        mbarrier.invalidate(bars.index(b))


@gluon.jit
def scan_kernel(q, k, w, u, gam, qg, kg, cu_seqlens, h0, ht, state_indices, o, scale, T, H, HV, flags,
                state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens, K: gl.constexpr,
                V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, IS_VARLEN: gl.constexpr,
                TRANSPOSE_STATE: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, CHECKPOINTS: gl.constexpr,
                num_warps: gl.constexpr):
    gl.static_assert(BT == 64, "tcgen05 M = 64 for the chunk-row products")
    gl.static_assert(K == 128, "the state update k^T v_dec is one M = 128 tcgen05 MMA")
    dtype: gl.constexpr = q.dtype.element_ty
    i_n = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_v = gl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN)
    n_chunks = gl.cdiv(seq_len, BT)

    # --- the state h [K, BV] fp32 in tensor memory (the chunk loops' accumulators are their own)
    tm_kv: gl.constexpr = TensorMemoryLayout(block=(K, BV), col_stride=1)
    HS: gl.constexpr = 64 if BV > 64 else BV  # width of the state column slices that pass through registers
    tm_hs: gl.constexpr = TensorMemoryLayout(block=(K, HS), col_stride=1)
    reg_hs: gl.constexpr = get_tmem_reg_layout(gl.float32, [K, HS], tm_hs, num_warps)
    h_tmem = allocate_tensor_memory(gl.float32, [K, BV], tm_kv)

    # --- the state: slot i_n, or the caller's pool slot; a negative slot starts from zero and is not written.
    slot = i_n
    if flags & SCAN_USE_INDICES:
        slot = gl.load(state_indices + i_n)
    # loaded in [K, HS] column slices into TMEM (a whole [K, 128] tile of int64 offsets would not fit in
    # registers): slice j of V tile i_v is V tile i_v * (BV // HS) + j of width HS. common.load_state_tile reads
    # each slice coalesced (16-byte vectors, a warp along the HBM-contiguous dimension) and convert_layouts it to
    # the tcgen05.st layout: reading straight in reg_hs (one K row a thread) put a warp's 32 lanes on 32 rows
    # 4*V bytes apart in the [K, V] layout (only the transposed [V, K] layout was coalesced that way).
    # An fp32 final state needs no such helper: it leaves by TMA (_store_state).
    for j in gl.static_range(BV // HS):
        h_tmem.slice(j * HS, HS).store(load_state_tile(h0, slot, i_hv, i_v * (BV // HS) + j, HV,
                                                       ((flags & SCAN_HAS_H0) != 0) & (slot >= 0), K, V, HS,
                                                       TRANSPOSE_STATE, reg_hs))

    # --- per-sequence TMA descriptors (row bound = seq_len), and one over the whole packed o for the scatter.
    row0 = bos.to(gl.int64)
    q_desc = row_tile_desc(q + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    k_desc = row_tile_desc(k + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    w_desc = row_tile_desc(w + row0 * HV * K + i_hv * K, HV * K, seq_len, BT, K)
    u_desc = row_tile_desc(u + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    o_desc = row_tile_desc(o + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    if IS_VARLEN:
        total_rows = gl.load(cu_seqlens + gl.num_programs(0))
    else:
        total_rows = gl.num_programs(0) * T
    o_all_desc = tma.make_tensor_descriptor(o, [gl.maximum(total_rows, 1), HV * V], [HV * V, 1], [1, BV],
                                            o_desc.layout)

    row_data = RowData.of_value_head(gam, qg, kg, i_hv, row0, seq_len, T, IS_VARLEN)
    checkpoints = Checkpoints(state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens, HV,
                              BT, V, TRANSPOSE_STATE, CHECKPOINTS, HEAD_MAJOR=False)
    # h's 16-bit copy, the B operand of w h and q h: a ring of two in the warp-specialised loop; after the loop,
    # the staging tile of an fp32 final state
    h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dtype)
    h_smem = gl.allocate_shared_memory(dtype, [2 if WARP_SPECIALIZE else 1, K, BV], h_layout)
    o_col = i_hv * V + i_v * BV
    if WARP_SPECIALIZE:
        scan_chunks_warp_specialized(h_tmem, h_smem, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, o_all_desc,
                                     bos, o_col, row_data, scale, checkpoints, i_v)
    else:
        _scan_chunks(h_tmem, h_smem.index(0), n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, o_all_desc, bos,
                     o_col, row_data, scale, checkpoints, i_v)
    _store_checkpoint(checkpoints, h_tmem, n_chunks - 1, seq_len, i_v, HS, reg_hs)  # the last chunk's

    if ((flags & SCAN_STORE_HT) != 0) & (slot >= 0):
        if ht.dtype.element_ty == gl.float32:
            _store_state(ht, h_tmem, h_smem.index(0), slot, i_hv, i_v, HV, K, V, BV, TRANSPOSE_STATE, num_warps)
        else:  # stored narrower: from registers, converted by common.store_state_tile as in every other kernel
            store_tmem_state(ht, h_tmem, slot, i_hv, i_v, HV, K, V, BV, HS, TRANSPOSE_STATE, reg_hs)
