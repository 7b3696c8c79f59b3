"""(I + A)^-1 of a chunk on Blackwell's tensor cores (sm_100a, sm_103a): the blocked tf32 inverse of sm_100a's
gdn_prepare kernels (prepare_sm100.py, prepare_sm100_ws.py) and of gdn_fused's aux partition (fused_sm100.py).

The operands pass through two fp32 NVMMA shared-memory tiles into one [BT, BT] fp32 TMEM accumulator, one
tcgen05 kind::tf32 MMA at a time, each issued by one thread after a CTA (partition) barrier and waited on through
tcgen05_commit on an mbarrier; the caller owns the tiles, the accumulator and the barrier.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (fence_async_shared, mbarrier, tcgen05_commit,
                                                                  tcgen05_mma)

from .common import diagonal_block_inverses


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
def unit_lower_inverse(A, a_smem, bt_smem, acc_tmem, reg_layout: gl.constexpr, bar, phase):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] (BT = 64), blocked by 16, as on sm_90a:
    (I + A)^-1 = (I - N)(I + N^2) D^-1 with D = I + (A's diagonal 16 x 16 blocks), N = D^-1 L (L: A's strictly
    block-lower part, so N^4 = 0). D^-1 on warp-level MMAs (common.diagonal_block_inverses), then four
    tcgen05 kind::tf32 products instead of the ten of squaring the whole matrix. The running terms stay in
    registers (sums as register adds), so no TMEM store has to be ordered before an MMA.
    """
    BT: gl.constexpr = A.shape[0]
    BLOCK: gl.constexpr = 16
    i = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, reg_layout)), 1)
    j = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, reg_layout)), 0)
    d_inv = diagonal_block_inverses(A, BLOCK)
    n, phase = _tf32_matmul(d_inv, gl.where((i // BLOCK) > (j // BLOCK), A, 0.0), a_smem, bt_smem, acc_tmem,
                            reg_layout, bar, phase)
    n2, phase = _tf32_matmul(n, n, a_smem, bt_smem, acc_tmem, reg_layout, bar, phase)
    one_minus_n = gl.where(i == j, 1.0, 0.0) - n
    prod, phase = _tf32_matmul(one_minus_n, n2, a_smem, bt_smem, acc_tmem, reg_layout, bar, phase)
    return _tf32_matmul(one_minus_n + prod, d_inv, a_smem, bt_smem, acc_tmem, reg_layout, bar, phase)
