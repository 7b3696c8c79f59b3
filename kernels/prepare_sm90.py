"""gdn_prepare for Hopper (sm_90a): everything about a chunk that does not depend on the state.

One program per (chunk, value head), 4 warps = one warpgroup issuing wgmma. Steps 1-3 of docs/gdn-math.md:
    gam = cumsum(g)                                      (fp32, registers)
    A   = beta_i (k_i . k_j) exp(gam_i - gam_j), i > j   (wgmma bf16 -> fp32)
    Tc  = (I + A)^-1 = (I + N)(I + N^2)(I + N^4)(I + N^8)(I + N^16)(I + N^32),  N = -A
                                                         (N^64 = 0 for strictly lower-triangular N: ten
                                                          64x64x64 wgmma in tf32, no serial substitution;
                                                          measured 1.9x faster on the H200 than an fp32
                                                          substitution on the CUDA cores)
    w   = (Tc diag(beta e^gam)) k,   u = (Tc diag(beta)) v      (wgmma bf16 -> fp32, A operand in registers)
With flags & PREPARE_L2NORM the k rows are normalised in registers before anything else, and the inverse
norms of the q and k rows go to rq, rk for gdn_scan, which folds them into its row scalings.
Loads are masked register loads (a chunk never reads the next sequence's rows); w, u, gam go to HBM for
gdn_scan.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .common import (PREPARE_L2NORM, causal_decay, chunk_cumsum, inverse_row_norms, load_rows, row_load_layout,
                     sequence_of_chunk_slot, squaring_rounds, wgmma_layout)


@gluon.jit
def _tf32_matmul(a, b, a_smem, bt_smem, acc, use_acc: gl.constexpr):
    """acc (+)= a @ b for fp32 [64, 64] register tiles, through shared memory in tf32.

    tf32 wgmma reads B K-major only, so b is stored transposed and handed over as a permuted view.
    """
    a_smem.store(a)
    bt_smem.store(gl.permute(b, [1, 0]))
    fence_async_shared()
    return warpgroup_mma(a_smem, bt_smem.permute((1, 0)), acc, use_acc=use_acc)  # fp32 operands: tf32 by default


@gluon.jit
def _unit_lower_inverse(A, a_smem, bt_smem):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] by repeated squaring (BT <= 64: 5 rounds)."""
    BT: gl.constexpr = A.shape[0]
    tf32_acc: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps(), 32)
    i = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, tf32_acc)), 1)
    j = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, tf32_acc)), 0)
    power = -gl.convert_layout(A, tf32_acc)
    inverse = gl.where(i == j, 1.0, 0.0) + power
    for _ in gl.static_range(squaring_rounds(BT)):
        power = _tf32_matmul(power, power, a_smem, bt_smem, power, use_acc=False)
        inverse = _tf32_matmul(inverse, power, a_smem, bt_smem, inverse, use_acc=True)
    return inverse


@gluon.jit
def _store_rows(ptr, x, row0, n_rows, row_stride, layout: gl.constexpr):
    BT: gl.constexpr = x.shape[0]
    COLS: gl.constexpr = x.shape[1]
    x = gl.convert_layout(x, layout)
    rows = gl.arange(0, BT, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    offs = (row0 + rows).to(gl.int64)[:, None] * row_stride + cols[None, :]
    gl.store(ptr + offs, x, mask=(rows < n_rows)[:, None])


@gluon.jit
def prepare_kernel(q, k, v, g, beta, cu_seqlens, w, u, gam, rq, rk, T, num_seqs, H, HV, flags,
                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   num_warps: gl.constexpr):
    gl.static_assert(BT == 64, "one warpgroup owns the 64 rows of a chunk")
    dtype: gl.constexpr = k.dtype.element_ty
    start, n_rows = sequence_of_chunk_slot(gl.program_id(0), cu_seqlens, T, num_seqs, BT, IS_VARLEN)
    i_hv = gl.program_id(1)
    i_h = i_hv // (HV // H)
    if n_rows > 0:
        # --- layouts: wgmma accumulators for [BT, BT] and [BT, K|V]; a coalesced layout for HBM tiles.
        mma_tt: gl.constexpr = wgmma_layout(BT, BT, num_warps)
        mma_tk: gl.constexpr = wgmma_layout(BT, K, num_warps)
        mma_tv: gl.constexpr = wgmma_layout(BT, V, num_warps)
        rows_l: gl.constexpr = gl.SliceLayout(1, mma_tt)
        cols_l: gl.constexpr = gl.SliceLayout(0, mma_tt)
        load_k: gl.constexpr = row_load_layout(K, num_warps)

        # --- gates of the chunk: g and beta per row, cumsum in fp32.
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

        # --- k (normalised if asked) and v tiles into shared memory, the wgmma operand home.
        k_tile = load_rows(k + i_h * K, start, n_rows, H * K, BT, K, load_k)
        if flags & PREPARE_L2NORM:
            rk_rows = inverse_row_norms(k_tile)
            k_tile = (k_tile.to(gl.float32) * gl.expand_dims(rk_rows, 1)).to(dtype)
            rq_rows = inverse_row_norms(load_rows(q + i_h * K, start, n_rows, H * K, BT, K, load_k))
            rl = gl.arange(0, BT, gl.SliceLayout(1, load_k))
            norm_offs = (start + rl).to(gl.int64) * HV + i_hv
            gl.store(rk + norm_offs, rk_rows, mask=rl < n_rows)
            gl.store(rq + norm_offs, rq_rows, mask=rl < n_rows)
        k_smem = gl.allocate_shared_memory(dtype, [BT, K], gl.NVMMASharedLayout.get_default_for([BT, K], dtype),
                                           k_tile)
        v_smem = gl.allocate_shared_memory(dtype, [BT, V], gl.NVMMASharedLayout.get_default_for([BT, V], dtype),
                                           load_rows(v + i_hv * V, start, n_rows, HV * V, BT, V,
                                                     row_load_layout(V, num_warps)))
        fence_async_shared()

        # --- A = beta_i (k k^T)_ij exp(gam_i - gam_j), strictly lower; Tc = (I + A)^-1 in tf32 (tensor cores).
        kkt = warpgroup_mma(k_smem, k_smem.permute((1, 0)), gl.zeros([BT, BT], gl.float32, mma_tt), use_acc=False)
        A = kkt * gl.expand_dims(beta_rows, 1) * causal_decay(gam_rows, gam_cols, n_rows, STRICT=True)
        f32_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        a_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        bt_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        Tc = gl.convert_layout(_unit_lower_inverse(A, a_smem, bt_smem), mma_tt)

        # --- w = Tc diag(beta e^gam) k and u = Tc diag(beta) v: the row scalings fold into Tc's columns.
        Tw = (Tc * gl.expand_dims(beta_cols * gl.exp(gam_cols), 0)).to(dtype)
        Tu = (Tc * gl.expand_dims(beta_cols, 0)).to(dtype)
        w_acc = warpgroup_mma(gl.convert_layout(Tw, gl.DotOperandLayout(0, mma_tk, 2)), k_smem,
                              gl.zeros([BT, K], gl.float32, mma_tk), use_acc=False)
        _store_rows(w + i_hv * K, w_acc.to(dtype), start, n_rows, HV * K, load_k)
        u_acc = warpgroup_mma(gl.convert_layout(Tu, gl.DotOperandLayout(0, mma_tv, 2)), v_smem,
                              gl.zeros([BT, V], gl.float32, mma_tv), use_acc=False)
        _store_rows(u + i_hv * V, u_acc.to(dtype), start, n_rows, HV * V, row_load_layout(V, num_warps))
