"""gdn_prepare for Blackwell (sm_100a): everything about a chunk that does not depend on the state.

Same algorithm, grid and outputs as prepare_sm90.py (steps 1-3 of docs/algorithm.md). One program per
(chunk, key head), 4 warps: the key head's k is read (and, with flags & PREPARE_L2NORM, normalised, with the
log inverse norms of its q and k rows kept in shared memory) once, then the HV / H value heads that share it
are served in turn:
    gam = cumsum(g)                                      (fp32, registers; common.chunk_gates)
    A   = beta_i (k_i . k_j) exp(gam_i - gam_j), i > j   (tcgen05 kind::f16, bf16/fp16 -> fp32 in TMEM; k k^T is
                                                          recomputed per value head: one MMA, where keeping it
                                                          would cost TMEM columns or 16 KB of shared memory)
    Tc  = (I + A)^-1 = (I - N)(I + N^2) D^-1             (blocked by 16, as on sm_90a: D^-1 of the diagonal
                                                          blocks on warp-level tf32 MMAs (mma.sync), then four
                                                          64x64x64 tcgen05 kind::tf32 products)
    w   = (Tc diag(beta e^gam)) k,   u = (Tc diag(beta)) v   (tcgen05 kind::f16, both operands in shared memory)
    qg  = gam + ln rq,  kg = gam - ln rk                 (the log row scalings gdn_scan applies to q and k rows;
                                                          rq, rk = inverse L2 norms, or 1 without PREPARE_L2NORM)
With PREPARE_L2NORM the TMA'd k tile goes through registers once and back into shared memory normalised; q is
read by masked register loads (only its norms are needed).
What Blackwell changes:
  * every product is a single-thread-issued tcgen05_mma (M = 64) from NVMMA-swizzled shared memory into a
    tensor-memory accumulator, completed by tcgen05_commit on an mbarrier that all warps wait on; results come
    back to registers with tcgen05.ld (get_tmem_reg_layout);
  * k (once) and v (per value head, issued first so that it lands while the inverse runs) arrive by TMA
    (UTMALDG); w and u leave by TMA store (UTMASTG). The descriptors are built on the device once per program
    over the chunk's rows of the key head's group of value heads ([n_rows, G * V], value head j at column
    j * V), with the chunk's valid row count as row bound: rows of the neighbouring sequence read as zero and
    are clipped from the stores;
  * the strict causal decay mask is built from 16-wide bitmasks (common.causal_decay_bitmask).
The chunk's row bounds enter the loop over value heads through common.loop_variant, as on sm_90a (otherwise
the addresses and masks derived from them are hoisted out of the loop and pinned in registers); Tw's and Tu's
column scalings wait in shared memory while the inverse runs, not in registers.
Shared memory (66 KB): k, v, and two fp32 [BT, BT] tf32 operand tiles, which then hold the 16-bit Tw and Tu
operands and after that stage w and u for their TMA stores; four [BT] fp32 row vectors (log q/k norms of the
key head, the value head's column scalings).
TMEM: one [BT, K] fp32 accumulator for w and one [BT, V] for u; kkt and every tf32 product of the inverse run
in the first BT columns of the u accumulator (they are finished before u is computed). Two M = 64 [BT, 128]
accumulators: Triton packs them into 128 TMEM columns (tmem_size 128).
A variant with WARP_SPECIALIZE (PREPARE_WS_WARPS warps, no gating) runs prepare_sm100_ws.py instead: warp-specialised
and persistent, as on sm_90a.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory,
                                                                  fence_async_shared, get_tmem_reg_layout,
                                                                  mbarrier, tcgen05_commit, tcgen05_mma, tma)

from .common import (PREPARE_GATE_IN_KERNEL, PREPARE_L2NORM, GateSource,
                     causal_decay_bitmask, chunk_gates, inverse_row_norms,
                     load_rows, loop_variant, mbarriers, row_data_rows, row_load_layout, sequence_of_chunk_slot,
                     token_major_desc)
from .inverse_sm100 import unit_lower_inverse
from .prepare_sm100_ws import prepare_chunks_warp_specialized


@gluon.jit
def _serve_value_head(i_hv, j, v_phase, k_smem, v_smem, a_smem, bt_smem, row_vecs, v_bar, mma_bar, w_tmem, u_tmem,
                      v_desc, w_desc, u_desc, gates, gam, qg, kg, start, n_rows, HV, rows,
                      K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr):
    """Steps 1-3 of docs/algorithm.md for value head i_hv (j-th of its key head's group) of the chunk, from the
    key head's k in k_smem (row_vecs: the key head's log q/k row norms in rows 0, 1; rows 2, 3 are this
    call's scratch). Every call commits mma_bar an even number of times (k k^T, the 4 products of the
    inverse, w and u), so each starts at phase 0. w and u are still being stored by TMA from a_smem / bt_smem
    when it returns: the next call (before the inverse) and the kernel (before exiting) wait for them."""
    dtype: gl.constexpr = k_smem.dtype
    num_warps: gl.constexpr = gl.num_warps()
    tm_tt: gl.constexpr = TensorMemoryLayout(block=(BT, BT), col_stride=1)
    reg_tt: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BT], tm_tt, num_warps)
    reg_tk: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, K], w_tmem.type.layout, num_warps)
    reg_tv: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, V], u_tmem.type.layout, num_warps)
    tt_tmem = u_tmem.slice(0, BT)

    # --- v of this value head by TMA (its last reader, the previous head's u MMA, has completed), and k k^T
    # on the tensor cores while the gates are computed. k k^T overwrites u's first columns: every warp's
    # tcgen05.ld of the previous u, and the normalised k stores (fenced), are behind a CTA barrier the caller
    # or the previous call passed last.
    mbarrier.expect(v_bar, v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [0, j * V], v_bar, v_smem)
    tcgen05_mma(k_smem, k_smem.permute((1, 0)), tt_tmem, use_acc=False)
    tcgen05_commit(mma_bar)

    # --- gates: gam = cumsum(g) and the log row scalings for gdn_scan (layouts of the TMEM register tiles).
    rows_l: gl.constexpr = gl.SliceLayout(1, reg_tt)
    cols_l: gl.constexpr = gl.SliceLayout(0, reg_tt)
    gam_rows, gam_cols, beta_rows = chunk_gates(gates.g, gates.beta, gates, gam, qg, kg, i_hv, start, n_rows, HV,
                                                rows, row_vecs.index(0).load(rows_l),
                                                row_vecs.index(1).load(rows_l), cols_l)
    decay = causal_decay_bitmask(gam_rows, gam_cols, n_rows, STRICT=True)
    # the column scalings of Tw and Tu wait in shared memory, not in registers, while the inverse runs (as
    # column vectors they would pin 64 registers a thread across it); past the chunk they are 0 (beta = 0)
    row_vecs.index(2).store(beta_rows * gl.exp(gam_rows))
    row_vecs.index(3).store(beta_rows)

    # --- A = beta_i (k k^T)_ij exp(gam_i - gam_j), strictly lower.
    mbarrier.wait(mma_bar, 0)
    A = tt_tmem.load(reg_tt) * gl.expand_dims(beta_rows, 1) * decay

    # --- Tc = (I + A)^-1 in tf32 on the tensor cores; the previous head's w and u TMA stores must have left
    # a_smem / bt_smem first (the inverse's products start with a CTA barrier, after the issuing thread's wait).
    tma.store_wait(0)
    Tc, phase = unit_lower_inverse(A, a_smem, bt_smem, tt_tmem, reg_tt, mma_bar, 1)

    # --- w = Tc diag(beta e^gam) k and u = Tc diag(beta) v: the row scalings fold into Tc's columns.
    # Both 16-bit A operands go to the (now free) tf32 operand tiles; the two MMAs share one commit.
    op_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dtype)
    tw_smem = a_smem._reinterpret(dtype, [BT, BT], op_tt)
    tu_smem = bt_smem._reinterpret(dtype, [BT, BT], op_tt)
    gl.thread_barrier()  # the last tcgen05.ld of tt_tmem (u's columns) is done in every warp
    tw_smem.store((Tc * gl.expand_dims(row_vecs.index(2).load(cols_l), 0)).to(dtype))
    tu_smem.store((Tc * gl.expand_dims(row_vecs.index(3).load(cols_l), 0)).to(dtype))
    mbarrier.wait(v_bar, v_phase)
    fence_async_shared()
    gl.thread_barrier()
    tcgen05_mma(tw_smem, k_smem, w_tmem, use_acc=False)
    tcgen05_mma(tu_smem, v_smem, u_tmem, use_acc=False)
    tcgen05_commit(mma_bar)
    mbarrier.wait(mma_bar, phase)

    # --- w and u staged in the operand tiles (their MMAs are complete), out by TMA; rows past the chunk clipped.
    w_stage = a_smem._reinterpret(dtype, [BT, K], w_desc.layout)
    u_stage = bt_smem._reinterpret(dtype, [BT, V], u_desc.layout)
    w_stage.store(w_tmem.load(reg_tk).to(dtype))
    u_stage.store(u_tmem.load(reg_tv).to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(w_desc, [0, j * K], w_stage)
    tma.async_copy_shared_to_global(u_desc, [0, j * V], u_stage)


@gluon.jit
def prepare_kernel(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   GATING: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(BT == 64, "one CTA owns the 64 rows of a chunk (tcgen05 M = 64)")
    gl.static_assert(not (GATING and WARP_SPECIALIZE), "the warp-specialised gdn_prepare has no gating variant")
    if WARP_SPECIALIZE:
        prepare_chunks_warp_specialized(q, k, v, g, beta, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                                        K, V, BT, IS_VARLEN)
    else:
        _prepare_chunk(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                       K, V, BT, IS_VARLEN, GATING)


@gluon.jit
def _prepare_chunk(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   GATING: gl.constexpr):
    """The program's chunk slot and key head in one CTA."""
    gl.static_assert((K <= 2 * BT) & (V <= 2 * BT), "w and u are staged in the fp32 [BT, BT] operand tiles")
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = k.dtype.element_ty
    start, n_rows = sequence_of_chunk_slot(gl.program_id(0), cu_seqlens, T, num_seqs, BT, IS_VARLEN)
    i_h = gl.program_id(1)
    group = HV // H
    if n_rows > 0:
        # --- tensor memory: accumulators [BT, K] (w) and [BT, V] (u); k k^T uses u's first columns.
        tm_tk: gl.constexpr = TensorMemoryLayout(block=(BT, K), col_stride=1)
        tm_tv: gl.constexpr = TensorMemoryLayout(block=(BT, V), col_stride=1)
        w_tmem = allocate_tensor_memory(gl.float32, [BT, K], tm_tk)
        u_tmem = allocate_tensor_memory(gl.float32, [BT, V], tm_tv)

        # barriers: 0 the k tile, 1 each value head's v tile, 2 the MMAs
        bars = mbarriers(3, 1)

        # --- descriptors over the chunk's rows: the key head's k, its value heads' v, w, u side by side.
        row0 = start.to(gl.int64)
        k_desc = token_major_desc(k + row0 * H * K + i_h * K, H * K, n_rows, K, BT, K)
        v_desc = token_major_desc(v + row0 * HV * V + i_h * group * V, HV * V, n_rows, group * V, BT, V)
        w_desc = token_major_desc(w + row0 * HV * K + i_h * group * K, HV * K, n_rows, group * K, BT, K)
        u_desc = token_major_desc(u + row0 * HV * V + i_h * group * V, HV * V, n_rows, group * V, BT, V)
        k_smem = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)
        f32_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        a_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        bt_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        row_vecs = gl.allocate_shared_memory(gl.float32, [4, BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        mbarrier.expect(bars.index(0), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [0, 0], bars.index(0), k_smem)

        # --- use_qk_l2norm_in_kernel: log inverse row norms of q (masked register loads, overlapping the TMA)
        # and of k; the k tile is normalised in place (shared -> registers -> shared, same layout both ways, so
        # each thread rewrites only what it read), rounded back to the input dtype as fla's l2norm output is.
        load_k: gl.constexpr = row_load_layout(K, num_warps)
        log_rq = gl.zeros([BT], gl.float32, gl.SliceLayout(1, load_k))
        log_rk = gl.zeros([BT], gl.float32, gl.SliceLayout(1, load_k))
        if flags & PREPARE_L2NORM:
            log_rq = gl.log(inverse_row_norms(load_rows(q + i_h * K, start, n_rows, H * K, BT, K, load_k)))
        mbarrier.wait(bars.index(0), 0)
        if flags & PREPARE_L2NORM:
            k_tile = k_smem.load(load_k)
            rk_rows = inverse_row_norms(k_tile)
            k_smem.store((k_tile.to(gl.float32) * gl.expand_dims(rk_rows, 1)).to(dtype))
            log_rk = gl.log(rk_rows)
        row_vecs.index(0).store(log_rq)
        row_vecs.index(1).store(log_rk)
        fence_async_shared()  # the normalised k is visible to the tensor cores' async proxy
        gl.thread_barrier()  # ... and the log norms to every warp

        rows = row_data_rows(T, num_seqs, IS_VARLEN)
        for j in range(group):
            i_hv = i_h * group + j
            gates = GateSource.make(g, beta, A_log, dt_bias, i_hv, flags, GATING, PREPARE_GATE_IN_KERNEL)
            _serve_value_head(i_hv, j, j & 1, k_smem, v_smem, a_smem, bt_smem, row_vecs,
                              bars.index(1), bars.index(2), w_tmem, u_tmem, v_desc, w_desc, u_desc,
                              gates, gam, qg, kg, loop_variant(start, j), loop_variant(n_rows, j), HV, rows, K, V,
                              BT)
        tma.store_wait(0)
        gl.thread_barrier()
        for b in gl.static_range(3):
            mbarrier.invalidate(bars.index(b))
