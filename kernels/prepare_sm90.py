"""gdn_prepare for Hopper (sm_90a): everything about a chunk that does not depend on the state.

One program per (chunk, key head), 4 warps = one warpgroup issuing wgmma. The key head's k (and q, for its
norms) are read and normalised once, then the HV / H value heads that share them are served in turn (steps 1-3
of docs/algorithm.md for each):
    gam = cumsum(g)                                      (fp32, registers)
    A   = beta_i (k_i . k_j) exp(gam_i - gam_j), i > j   (k k^T: wgmma bf16 -> fp32 from the shared k tile)
    Tc  = (I + A)^-1 = (I - N)(I + N^2) D^-1             (blocked by 16 (_unit_lower_inverse): D = I + A's
                                                          diagonal blocks, inverted on warp-level tf32 MMAs;
                                                          N = D^-1 L with L A's strictly block-lower part, so
                                                          N^4 = 0: four 64x64x64 tf32 wgmma, A operand in
                                                          registers, where squaring the whole matrix took ten)
    w   = (Tc diag(beta e^gam)) k,   u = (Tc diag(beta)) v     (wgmma bf16 -> fp32, A operand in registers)
    qg  = gam + ln rq,  kg = gam - ln rk                 (the log row scalings gdn_scan applies to q and k rows;
                                                          rq, rk = inverse L2 norms, or 1 without PREPARE_L2NORM)
Units: the value head's v tile goes global -> shared by cp.async (zero-filled past the chunk's last row) while
the tensor cores run the inverse; k and q are masked register loads (their norms need them in registers).
A chunk never reads another sequence's rows. w, u, gam, qg, kg go to HBM for gdn_scan.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .common import (PREPARE_GATE_IN_KERNEL, PREPARE_L2NORM, GateSource,
                     causal_decay, chunk_gates, chunk_tile_ptrs, diagonal_block_inverses,
                     inverse_row_norms, load_rows, loop_variant, row_data_rows, row_load_layout, row_mask,
                     sequence_of_chunk_slot, store_rows, wgmma_layout)
from .prepare_sm90_ws import prepare_chunks_warp_specialized


@gluon.jit
def _tf32_matmul(a, bt_smem, acc, use_acc: gl.constexpr):
    """acc (+)= a @ b in tf32 on the tensor cores: a [64, 64] fp32 from registers (wgmma's A operand may live
    there; the accumulator -> operand layout change is warp shuffles), b from shared memory, stored transposed
    (tf32 wgmma reads B K-major only) and handed over as a permuted view."""
    a_op = gl.convert_layout(a, gl.DotOperandLayout(0, acc.type.layout, 1))
    return warpgroup_mma(a_op, bt_smem.permute((1, 0)), acc, use_acc=use_acc)  # fp32 operands: tf32 by default


@gluon.jit
def _store_transposed(bt_smem, x):
    """x^T into bt_smem, visible to the tensor cores; every warp is past the MMAs that read the old contents."""
    gl.thread_barrier()
    bt_smem.store(gl.permute(x, [1, 0]))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _unit_lower_inverse(A, bt_smem, d_inv_t_smem):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] (BT = 64), blocked by 16.

    I + A = D (I + N) with D = I + (A's diagonal 16 x 16 blocks) and N = D^-1 L, L = A's strictly block-lower
    part. N is strictly block-lower over 4 blocks, so N^4 = 0 and
        (I + A)^-1 = (I - N)(I + N^2) D^-1:
    D^-1 on warp-level MMAs (common.diagonal_block_inverses), then four 64x64x64 tf32 wgmma (N, N^2, (I - N)(I + N^2),
    the product with D^-1) where squaring the whole matrix took ten. D^-1 waits in d_inv_t_smem for the last
    product instead of in registers.
    """
    BT: gl.constexpr = A.shape[0]
    BLOCK: gl.constexpr = 16
    tf32_acc: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps(), 32)
    A = gl.convert_layout(A, tf32_acc)
    i = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, tf32_acc)), 1)
    j = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, tf32_acc)), 0)
    zeros = gl.zeros([BT, BT], gl.float32, tf32_acc)
    d_inv = diagonal_block_inverses(A, BLOCK)
    d_inv_t_smem.store(gl.permute(d_inv, [1, 0]))  # made visible by the next _store_transposed
    _store_transposed(bt_smem, gl.where((i // BLOCK) > (j // BLOCK), A, 0.0))
    n = _tf32_matmul(d_inv, bt_smem, zeros, use_acc=False)
    _store_transposed(bt_smem, n)
    n2 = _tf32_matmul(n, bt_smem, zeros, use_acc=False)
    _store_transposed(bt_smem, n2)
    one_minus_n = gl.where(i == j, 1.0, 0.0) - n
    series = _tf32_matmul(one_minus_n, bt_smem, one_minus_n, use_acc=True)  # (I - N)(I + N^2)
    return _tf32_matmul(series, d_inv_t_smem, zeros, use_acc=False)


@gluon.jit
def _serve_value_head(i_hv, k_smem, v, v_smem, tf32_smem, log_rq, log_rk, g, beta, A_log, dt_bias, flags, w, u, gam,
                      qg, kg, start, n_rows, HV, rows, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                      GATING: gl.constexpr):
    """Steps 1-3 of docs/algorithm.md for value head i_hv of the chunk, from the key head's k in k_smem."""
    dtype: gl.constexpr = v.dtype.element_ty
    num_warps: gl.constexpr = gl.num_warps()
    # layouts: wgmma accumulators for [BT, BT] and [BT, K|V] and their row/column slices; coalesced HBM tiles
    mma_tt: gl.constexpr = wgmma_layout(BT, BT, num_warps)
    mma_tk: gl.constexpr = wgmma_layout(BT, K, num_warps)
    mma_tv: gl.constexpr = wgmma_layout(BT, V, num_warps)
    load_k: gl.constexpr = row_load_layout(K, num_warps)
    load_v: gl.constexpr = row_load_layout(V, num_warps)
    c = gl.arange(0, BT, gl.SliceLayout(0, mma_tt))
    # v of this value head lands in shared memory while the inverse runs (the previous head's u
    # product has read v_smem: every warp must be past it)
    gl.thread_barrier()
    async_copy.async_copy_global_to_shared(v_smem, chunk_tile_ptrs(v + i_hv * V, start, HV * V, BT, V, load_v),
                                           mask=row_mask(n_rows, BT, load_v))
    async_copy.commit_group()

    # --- gates: gam = cumsum(g) and the log row scalings for gdn_scan; beta also as columns for Tw, Tu.
    gates = GateSource.make(g, beta, A_log, dt_bias, i_hv, flags, GATING, PREPARE_GATE_IN_KERNEL)
    gam_rows, gam_cols, beta_rows = chunk_gates(g, beta, gates, gam, qg, kg, i_hv, start, n_rows, HV, rows, log_rq,
                                                log_rk, gl.SliceLayout(0, mma_tt))
    beta_cols = gates.beta_of(gl.load(beta + (start + c).to(gl.int64) * HV + i_hv, mask=c < n_rows, other=0.0),
                              c < n_rows)

    # --- A = beta_i (k k^T)_ij exp(gam_i - gam_j), strictly lower; Tc = (I + A)^-1 in tf32.
    kkt = warpgroup_mma(k_smem, k_smem.permute((1, 0)), gl.zeros([BT, BT], gl.float32, mma_tt),
                        use_acc=False)  # recomputed per value head: cheaper than 32 registers a thread
    A = kkt * gl.expand_dims(beta_rows, 1) * causal_decay(gam_rows, gam_cols, n_rows, STRICT=True)
    # tf32_smem's two tiles picked by opaque indices: constant addresses let the compiler hoist every wgmma
    # descriptor of the inverse out of the loop over value heads (spilled registers)
    Tc = gl.convert_layout(_unit_lower_inverse(A, tf32_smem.index(loop_variant(0, i_hv)),
                                               tf32_smem.index(loop_variant(1, i_hv))), mma_tt)

    # --- w = Tc diag(beta e^gam) k and u = Tc diag(beta) v: the row scalings fold into Tc's columns.
    Tw = (Tc * gl.expand_dims(beta_cols * gl.exp(gam_cols), 0)).to(dtype)
    Tu = (Tc * gl.expand_dims(beta_cols, 0)).to(dtype)
    w_acc = warpgroup_mma(gl.convert_layout(Tw, gl.DotOperandLayout(0, mma_tk, 2)), k_smem,
                          gl.zeros([BT, K], gl.float32, mma_tk), use_acc=False)
    store_rows(w + i_hv * K, gl.convert_layout(w_acc.to(dtype), load_k), start, n_rows, HV * K)
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    u_acc = warpgroup_mma(gl.convert_layout(Tu, gl.DotOperandLayout(0, mma_tv, 2)), v_smem,
                          gl.zeros([BT, V], gl.float32, mma_tv), use_acc=False)
    store_rows(u + i_hv * V, gl.convert_layout(u_acc.to(dtype), load_v), start, n_rows, HV * V)


@gluon.jit
def prepare_kernel(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   GATING: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(BT == 64, "one warpgroup owns the 64 rows of a chunk")
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
    """The program's chunk slot and key head on one warpgroup."""
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = k.dtype.element_ty
    start, n_rows = sequence_of_chunk_slot(gl.program_id(0), cu_seqlens, T, num_seqs, BT, IS_VARLEN)
    i_h = gl.program_id(1)
    group = HV // H
    if n_rows > 0:
        # --- layouts: the row slice of the [BT, BT] wgmma accumulator (where A's rows live); coalesced k rows.
        rows_l: gl.constexpr = gl.SliceLayout(1, wgmma_layout(BT, BT, num_warps))
        load_k: gl.constexpr = row_load_layout(K, num_warps)

        # --- the key head: k (normalised if asked) into shared memory, k k^T, and the log row norms.
        k_tile = load_rows(k + i_h * K, start, n_rows, H * K, BT, K, load_k)
        log_rq = gl.zeros([BT], gl.float32, rows_l)
        log_rk = gl.zeros([BT], gl.float32, rows_l)
        if flags & PREPARE_L2NORM:
            rk_rows = inverse_row_norms(k_tile)
            k_tile = (k_tile.to(gl.float32) * gl.expand_dims(rk_rows, 1)).to(dtype)
            rq_rows = inverse_row_norms(load_rows(q + i_h * K, start, n_rows, H * K, BT, K, load_k))
            log_rq = gl.convert_layout(gl.log(rq_rows), rows_l)
            log_rk = gl.convert_layout(gl.log(rk_rows), rows_l)
        k_smem = gl.allocate_shared_memory(dtype, [BT, K], gl.NVMMASharedLayout.get_default_for([BT, K], dtype),
                                           k_tile)
        fence_async_shared()

        v_smem = gl.allocate_shared_memory(dtype, [BT, V], gl.NVMMASharedLayout.get_default_for([BT, V], dtype))
        f32_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        tf32_smem = gl.allocate_shared_memory(gl.float32, [2, BT, BT], f32_tt)
        rows = row_data_rows(T, num_seqs, IS_VARLEN)
        for j in range(group):
            _serve_value_head(i_h * group + j, k_smem, v, v_smem, tf32_smem, log_rq, log_rk, g, beta, A_log, dt_bias,
                              flags, w, u, gam, qg, kg, loop_variant(start, j), loop_variant(n_rows, j), HV, rows,
                              K, V, BT, GATING)
