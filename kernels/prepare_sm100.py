"""gdn_prepare for Blackwell (sm_100a): everything about a chunk that does not depend on the state.

Same algorithm, grid and outputs as prepare_sm90.py (steps 1-3 of docs/gdn-math.md); one program per
(chunk, value head), 4 warps:
    gam = cumsum(g)                                      (fp32, registers; common.chunk_cumsum)
    A   = beta_i (k_i . k_j) exp(gam_i - gam_j), i > j   (tcgen05 kind::f16, bf16/fp16 -> fp32 in TMEM)
    Tc  = (I + A)^-1 = (I + N)(I + N^2)...(I + N^32),  N = -A
                                                         (ten 64x64x64 tcgen05 kind::tf32 products, as the
                                                          sm_90a wgmma tf32 squaring: on the H200 the whole
                                                          prepare was 1.9x faster with it than with an fp32
                                                          substitution on the CUDA cores)
    w   = (Tc diag(beta e^gam)) k,   u = (Tc diag(beta)) v   (tcgen05 kind::f16, both operands in shared memory)
With flags & PREPARE_L2NORM the k rows are normalised before anything else (the TMA'd k tile goes through
registers once and back into shared memory), and the inverse norms of the q and k rows go to rq, rk for
gdn_scan, which folds them into its row scalings (q by masked register loads: only its norms are needed).
What Blackwell changes:
  * every product is a single-thread-issued tcgen05_mma (M = 64) from NVMMA-swizzled shared memory into a
    tensor-memory accumulator, completed by tcgen05_commit on an mbarrier that all warps wait on; results come
    back to registers with tcgen05.ld (get_tmem_reg_layout);
  * k and v arrive by TMA (UTMALDG) through per-chunk device-side descriptors whose row bound is the chunk's
    valid row count, so rows of the neighbouring sequence read as zero; w and u leave by TMA store (UTMASTG)
    through the same descriptors, which clips the rows past the chunk (no masked stores).
  * the strict causal decay mask is built from 16-wide bitmasks (common.causal_decay_bitmask).
TMEM: one [BT, K] fp32 accumulator for w and one [BT, V] for u; kkt and every tf32 product of the inverse run
in the first BT columns of the u accumulator (they are finished before u is computed). Two M = 64 [BT, 128]
accumulators: Triton packs them into 128 TMEM columns (tmem_size 128).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory,
                                                                  fence_async_shared, get_tmem_reg_layout,
                                                                  mbarrier, tcgen05_commit, tcgen05_mma, tma)

from .common import (PREPARE_L2NORM, causal_decay_bitmask, chunk_cumsum, inverse_row_norms, load_rows,
                     row_load_layout, sequence_of_chunk_slot, squaring_rounds)


@gluon.jit
def _chunk_desc(base, row_stride, n_rows, BT: gl.constexpr, COLS: gl.constexpr):
    """TMA descriptor over the chunk's [n_rows, COLS] rows of one head of a token-major tensor."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, COLS], base.dtype.element_ty)
    return tma.make_tensor_descriptor(base, [n_rows, COLS], [row_stride, 1], [BT, COLS], layout)


@gluon.jit
def _mma_sync(a_smem, b_smem, acc_tmem, bar, phase, use_acc: gl.constexpr):
    """acc (+)= a @ b on the tensor cores and wait for it; returns the barrier's next phase.

    All warps wrote the operands: fence (generic -> async proxy) then a CTA barrier, so the issuing thread sees
    every warp's stores before the MMA reads them.
    """
    fence_async_shared()
    gl.thread_barrier()
    tcgen05_mma(a_smem, b_smem, acc_tmem, use_acc=use_acc)
    tcgen05_commit(bar)
    mbarrier.wait(bar, phase)
    return phase ^ 1


@gluon.jit
def _tf32_matmul(a, b, a_smem, bt_smem, acc_tmem, reg_layout: gl.constexpr, bar, phase):
    """a @ b for fp32 [BT, BT] register tiles, in tf32 on the tensor cores (tcgen05 kind::tf32).

    b is stored transposed and handed over as a permuted view, i.e. K-major, exactly as on sm_90a. (tcgen05,
    unlike wgmma, also accepts MN-major tf32 operands; K-major is kept because it is the canonical form.)
    """
    gl.thread_barrier()  # every warp is done reading the previous product out of TMEM and the operand buffers
    a_smem.store(a)
    bt_smem.store(gl.permute(b, [1, 0]))
    phase = _mma_sync(a_smem, bt_smem.permute((1, 0)), acc_tmem, bar, phase, use_acc=False)
    return acc_tmem.load(reg_layout), phase


@gluon.jit
def _unit_lower_inverse(A, a_smem, bt_smem, acc_tmem, reg_layout: gl.constexpr, bar, phase):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] by repeated squaring (BT = 64: 5 rounds).

    The running product stays in registers (acc += as a register add) so no TMEM store has to be ordered before
    an MMA; TMEM only receives the products.
    """
    BT: gl.constexpr = A.shape[0]
    i = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, reg_layout)), 1)
    j = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, reg_layout)), 0)
    power = -A
    inverse = gl.where(i == j, 1.0, 0.0) + power
    for _ in gl.static_range(squaring_rounds(BT)):
        power, phase = _tf32_matmul(power, power, a_smem, bt_smem, acc_tmem, reg_layout, bar, phase)
        prod, phase = _tf32_matmul(inverse, power, a_smem, bt_smem, acc_tmem, reg_layout, bar, phase)
        inverse = inverse + prod
    return inverse, phase


@gluon.jit
def prepare_kernel(q, k, v, g, beta, cu_seqlens, w, u, gam, rq, rk, T, num_seqs, H, HV, flags,
                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   num_warps: gl.constexpr):
    gl.static_assert(BT == 64, "one CTA owns the 64 rows of a chunk (tcgen05 M = 64)")
    dtype: gl.constexpr = k.dtype.element_ty
    start, n_rows = sequence_of_chunk_slot(gl.program_id(0), cu_seqlens, T, num_seqs, BT, IS_VARLEN)
    i_hv = gl.program_id(1)
    i_h = i_hv // (HV // H)
    if n_rows > 0:
        # --- tensor memory: accumulators [BT, K] (w) and [BT, V] (u); k k^T uses u's first columns.
        tm_tt: gl.constexpr = TensorMemoryLayout(block=(BT, BT), col_stride=1)
        tm_tk: gl.constexpr = TensorMemoryLayout(block=(BT, K), col_stride=1)
        tm_tv: gl.constexpr = TensorMemoryLayout(block=(BT, V), col_stride=1)
        reg_tt: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BT], tm_tt, num_warps)
        reg_tk: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, K], tm_tk, num_warps)
        reg_tv: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, V], tm_tv, num_warps)
        w_tmem = allocate_tensor_memory(gl.float32, [BT, K], tm_tk)
        u_tmem = allocate_tensor_memory(gl.float32, [BT, V], tm_tv)
        tt_tmem = u_tmem.slice(0, BT)

        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        load_bar = bars.index(0)
        mma_bar = bars.index(1)
        mbarrier.init(load_bar, count=1)
        mbarrier.init(mma_bar, count=1)

        # --- k and v tiles by TMA (rows past the chunk read as zero), overlapping the gate arithmetic.
        row0 = start.to(gl.int64)
        k_desc = _chunk_desc(k + row0 * H * K + i_h * K, H * K, n_rows, BT, K)
        v_desc = _chunk_desc(v + row0 * HV * V + i_hv * V, HV * V, n_rows, BT, V)
        w_desc = _chunk_desc(w + row0 * HV * K + i_hv * K, HV * K, n_rows, BT, K)
        u_desc = _chunk_desc(u + row0 * HV * V + i_hv * V, HV * V, n_rows, BT, V)
        k_smem = gl.allocate_shared_memory(dtype, [BT, K], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BT, V], v_desc.layout)
        mbarrier.expect(load_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [0, 0], load_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [0, 0], load_bar, v_smem)

        # --- gates of the chunk: g and beta per row, cumsum in fp32 (layouts of the TMEM register tiles).
        rows_l: gl.constexpr = gl.SliceLayout(1, reg_tt)
        cols_l: gl.constexpr = gl.SliceLayout(0, reg_tt)
        r = gl.arange(0, BT, rows_l)
        c = gl.arange(0, BT, cols_l)
        gate_offs_r = (start + r).to(gl.int64) * HV + i_hv
        gate_offs_c = (start + c).to(gl.int64) * HV + i_hv
        g_rows = gl.load(g + gate_offs_r, mask=r < n_rows, other=0.0)
        g_cols = gl.load(g + gate_offs_c, mask=c < n_rows, other=0.0)
        beta_rows = gl.load(beta + gate_offs_r, mask=r < n_rows, other=0.0)
        beta_cols = gl.load(beta + gate_offs_c, mask=c < n_rows, other=0.0)
        gam_rows, gam_cols = chunk_cumsum(g_rows, g_cols)
        gl.store(gam + gate_offs_r, gam_rows, mask=r < n_rows)
        decay = causal_decay_bitmask(gam_rows, gam_cols, n_rows, STRICT=True)

        # --- use_qk_l2norm_in_kernel: inverse row norms of q (masked register loads, overlapping the TMA) and
        # of k; the k tile is normalised in place (shared -> registers -> shared, same layout both ways, so each
        # thread rewrites only what it read), rounded back to the input dtype as fla's l2norm output is.
        l2norm = (flags & PREPARE_L2NORM) != 0
        load_k: gl.constexpr = row_load_layout(K, num_warps)
        rl = gl.arange(0, BT, gl.SliceLayout(1, load_k))
        norm_offs = (start + rl).to(gl.int64) * HV + i_hv
        if l2norm:
            rq_rows = inverse_row_norms(load_rows(q + i_h * K, start, n_rows, H * K, BT, K, load_k))
            gl.store(rq + norm_offs, rq_rows, mask=rl < n_rows)
        mbarrier.wait(load_bar, 0)
        if l2norm:
            k_tile = k_smem.load(load_k)
            rk_rows = inverse_row_norms(k_tile)
            k_smem.store((k_tile.to(gl.float32) * gl.expand_dims(rk_rows, 1)).to(dtype))
            gl.store(rk + norm_offs, rk_rows, mask=rl < n_rows)

        # --- A = beta_i (k k^T)_ij exp(gam_i - gam_j), strictly lower.
        fence_async_shared()  # the normalised k (generic-proxy stores) is visible to the MMA's async proxy
        gl.thread_barrier()
        phase = 0
        tcgen05_mma(k_smem, k_smem.permute((1, 0)), tt_tmem, use_acc=False)
        tcgen05_commit(mma_bar)
        mbarrier.wait(mma_bar, phase)
        phase ^= 1
        A = tt_tmem.load(reg_tt) * gl.expand_dims(beta_rows, 1) * decay

        # --- Tc = (I + A)^-1 in tf32 on the tensor cores (products in tt_tmem, after A's tcgen05.ld everywhere:
        # _tf32_matmul starts with a CTA barrier).
        f32_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        a_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        bt_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        Tc, phase = _unit_lower_inverse(A, a_smem, bt_smem, tt_tmem, reg_tt, mma_bar, phase)

        # --- w = Tc diag(beta e^gam) k and u = Tc diag(beta) v: the row scalings fold into Tc's columns.
        # Both A operands go to shared memory (16-bit, NVMMA layout); the two MMAs share one commit.
        op_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dtype)
        tw_smem = gl.allocate_shared_memory(dtype, [BT, BT], op_tt)
        tu_smem = gl.allocate_shared_memory(dtype, [BT, BT], op_tt)
        gl.thread_barrier()  # the last tcgen05.ld of tt_tmem (u's columns) is done in every warp
        tw_smem.store((Tc * gl.expand_dims(beta_cols * gl.exp(gam_cols), 0)).to(dtype))
        tu_smem.store((Tc * gl.expand_dims(beta_cols, 0)).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tcgen05_mma(tw_smem, k_smem, w_tmem, use_acc=False)
        tcgen05_mma(tu_smem, v_smem, u_tmem, use_acc=False)
        tcgen05_commit(mma_bar)
        mbarrier.wait(mma_bar, phase)

        # --- results back through the (now free) k and v tiles, out by TMA; rows past the chunk are clipped.
        k_smem.store(w_tmem.load(reg_tk).to(dtype))
        v_smem.store(u_tmem.load(reg_tv).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(w_desc, [0, 0], k_smem)
        tma.async_copy_shared_to_global(u_desc, [0, 0], v_smem)
        tma.store_wait(0)
        mbarrier.invalidate(load_bar)
        mbarrier.invalidate(mma_bar)
