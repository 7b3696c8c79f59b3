"""Row-wise L2 normalisation of q and k (``use_qk_l2norm_in_kernel``): y = x / sqrt(sum(x^2) + 1e-6).

A memory-bound elementwise pass with no tensor-core work, so one source serves sm_90a and sm_100a. Each
program normalises BLOCK_ROWS rows of D elements (one row = one token of one key head).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def l2norm_kernel(x, y, rows, D: gl.constexpr, BLOCK_ROWS: gl.constexpr, num_warps: gl.constexpr):
    # 8 contiguous bf16/fp16 per thread = one 16-byte load; a warp covers 2 rows of 128.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [num_warps, 1], [1, 0])
    row = gl.program_id(0) * BLOCK_ROWS + gl.arange(0, BLOCK_ROWS, gl.SliceLayout(1, layout))
    col = gl.arange(0, D, gl.SliceLayout(0, layout))
    offs = row.to(gl.int64)[:, None] * D + col[None, :]
    mask = (row < rows)[:, None]
    xf = gl.load(x + offs, mask=mask, other=0.0).to(gl.float32)
    inv_norm = 1.0 / gl.sqrt(gl.sum(xf * xf, axis=1) + 1e-6)
    gl.store(y + offs, (xf * inv_norm[:, None]).to(y.dtype.element_ty), mask=mask)
