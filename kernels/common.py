"""Arch-independent pieces shared by the sm_90a and sm_100a kernel families.

Sequence bookkeeping (which tokens a program owns), the gate algebra of one chunk, and layout choices. The only
tensor-core code here is diagonal_block_inverses' warp-level mma.sync, which both arches execute alike; the rest
runs on the CUDA cores. Both families call the same code, so what the H200 proves about it holds for Blackwell too.
"""
from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # mma.sync: sm_90a and sm_100a both have it
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # blackwell re-exports these
from triton.language.core import _aggregate as aggregate

from . import PREPARE_L2NORM as _PREPARE_L2NORM, SCAN_HAS_H0 as _SCAN_HAS_H0
from . import SCAN_STORE_HT as _SCAN_STORE_HT, SCAN_USE_INDICES as _SCAN_USE_INDICES
from . import PREPARE_GATE_IN_KERNEL as _PREPARE_GATE_IN_KERNEL

# the flag bits defined in kernels/__init__.py (the launcher ABI), as constexprs the kernels can read
PREPARE_L2NORM = gl.constexpr(_PREPARE_L2NORM)
PREPARE_GATE_IN_KERNEL = gl.constexpr(_PREPARE_GATE_IN_KERNEL)
GATE_MODE = gl.constexpr(1)  # GateSource.mode bits, the same for every family
BIAS_MODE = gl.constexpr(2)
SIGMOID_MODE = gl.constexpr(4)
NEG_EIGVAL_MODE = gl.constexpr(8)
SCAN_HAS_H0 = gl.constexpr(_SCAN_HAS_H0)
SCAN_STORE_HT = gl.constexpr(_SCAN_STORE_HT)
SCAN_USE_INDICES = gl.constexpr(_SCAN_USE_INDICES)
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)  # 1 / LOG2E: log2 units back to natural ones


@constexpr_function
def wgmma_layout(M, N, num_warps, operand_bits=16):
    """Accumulator layout of an [M, N] wgmma result (sm_90a); the instruction K is 256 / operand bits.

    A warpgroup's atom is 4 warps x 16 rows along M; extra warps go along M while rows remain, then along N.
    The instruction N is the widest multiple of 8 dividing the columns each warp column owns.
    """
    along_m = min(num_warps, max(4, M // 16))
    warps_n = num_warps // along_m
    n = min(256, N // warps_n)
    while N % n != 0 or n % 8 != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[along_m, warps_n],
                                     instr_shape=[16, n, 256 // operand_bits])


@constexpr_function
def squaring_rounds(n):
    """Rounds of (I + N)(I + N^2)... needed until N^n = 0 for a strictly lower-triangular n x n matrix."""
    return n.bit_length() - 2


@constexpr_function
def row_load_layout(cols, num_warps):
    """Coalesced layout for [rows, cols] 16-bit tiles: 8 contiguous elements (16 bytes) per thread."""
    tpw_cols = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_cols, tpw_cols], [num_warps, 1], [1, 0])


@gluon.jit
def _clamped_bounds(cu_seqlens, i_n, T):
    """[bos, eos) of sequence i_n clamped to [0, T]: a malformed cu_seqlens that skipped host validation
    yields wrong rows, never an out-of-bounds access."""
    bos = gl.minimum(gl.maximum(gl.load(cu_seqlens + i_n), 0), T)
    eos = gl.minimum(gl.maximum(gl.load(cu_seqlens + i_n + 1), bos), T)
    return bos, eos


@gluon.jit
def sequence_of_chunk_slot(slot, cu_seqlens, T, num_seqs, BT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Map a chunk-parallel program to (first row of its chunk, rows in it); rows <= 0 means idle.

    Varlen: slot(s, c) = cu[s] // BT + s + c is injective and below T // BT + num_seqs, so a grid of that size
    covers every chunk with no host-side chunk table. The sequence is the largest s with cu[s] // BT + s <= slot
    (a strictly increasing function of s: binary search on cu_seqlens).
    """
    if IS_VARLEN:
        lo = 0
        hi = num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if gl.load(cu_seqlens + mid) // BT + mid <= slot:
                lo = mid
            else:
                hi = mid
        bos, eos = _clamped_bounds(cu_seqlens, lo, T)
        start = bos + (slot - bos // BT - lo) * BT
        eos = gl.where(start >= bos, eos, start)  # only a malformed cu_seqlens puts slot before cu[lo]
    else:
        n_chunks = gl.cdiv(T, BT)
        batch = slot // n_chunks
        eos = (batch + 1) * T
        start = batch * T + (slot % n_chunks) * BT
    return start, gl.minimum(eos - start, BT)


@gluon.jit
def sequence_and_head(HV, HEAD_MAJOR: gl.constexpr):
    """(sequence, value head) of this program of a (num_seqs, HV) grid. HEAD_MAJOR numbers the programs in the
    order the GPU starts them (x fastest) and gives consecutive ones the heads of one sequence, so that a
    sequence's programs start together: when there are more programs than SMs, a long sequence's heads are not
    left to a later wave behind the heads of short sequences (gdn_fused: 4-5 % on mixed-length batches)."""
    if HEAD_MAJOR:
        program = gl.program_id(0) + gl.num_programs(0) * gl.program_id(1)
        return program // HV, program % HV
    else:
        return gl.program_id(0), gl.program_id(1)


@gluon.jit
def sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN: gl.constexpr):
    """First row and length of sequence i_n (a batch row when fixed-length; T = total rows when varlen)."""
    if IS_VARLEN:
        bos, eos = _clamped_bounds(cu_seqlens, i_n, T)
        seq_len = eos - bos
    else:
        bos = i_n * T
        seq_len = T
    return bos, seq_len


@gluon.jit
def exp_ftz(x):
    """e^x as gl.exp computes it (x times log2 e rounded to fp32, then the MUFU's 2^x), except that a result
    below 2^-126 flushes to 0: gl.exp2 is ex2.approx.ftz, the MUFU instruction alone, where gl.exp's ex2.approx
    adds a compare and two scalings for subnormal results (in the warp-specialised scan's output loop, 90 of its
    700 instructions). Every other result has gl.exp's bits. Every exponential of every gdn_scan goes through
    here, so that all of them round alike (batch invariance across the scans)."""
    return gl.exp2(x * LOG2E)


@gluon.jit
def log2_units(x):
    """x times log2 e, rounded to fp32 on its own (mul.rn, which neither LLVM nor ptxas fuses into an add). Left to
    the compiler, the product of a gate row went into the first add of gam's cumsum as one FFMA where the gates are
    loaded and summed in one loop iteration, and was rounded first where they are loaded a chunk ahead: two kernels
    meant to give the same bits (gdn_fused and gdn_fused_terms) gave gam different last bits."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, gl.full_like(x, LOG2E)],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def causal_decay(gam_rows, gam_cols, n_rows, STRICT: gl.constexpr):
    """M_ij = exp(gam_i - gam_j) on the (strictly) lower triangle of valid rows, else 0.

    The exponent is masked before exp: above the diagonal gam_i - gam_j > 0 can overflow to inf, and inf * 0
    would be NaN.
    """
    i = gl.expand_dims(gl.arange(0, gam_rows.shape[0], gam_rows.type.layout), 1)
    j = gl.expand_dims(gl.arange(0, gam_cols.shape[0], gam_cols.type.layout), 0)
    if STRICT:
        keep = (i > j) & (i < n_rows)
    else:
        keep = (i >= j) & (i < n_rows)
    diff = gl.expand_dims(gam_rows, 1) - gl.expand_dims(gam_cols, 0)
    return gl.where(keep, exp_ftz(gl.where(keep, diff, 0.0)), 0.0)


@gluon.jit
def chunk_cumsum(g_rows, g_cols):
    """gam = inclusive cumsum of the chunk's log decays, returned in both the row and the column layout.

    A masked [BT, BT] reduction instead of a scan: it lands directly in the two slice layouts the decay
    matrix needs, and at BT = 64 it is 32 adds a thread.
    """
    i = gl.expand_dims(gl.arange(0, g_rows.shape[0], g_rows.type.layout), 1)
    j = gl.expand_dims(gl.arange(0, g_cols.shape[0], g_cols.type.layout), 0)
    gam_rows = gl.sum(gl.where(j <= i, gl.expand_dims(g_cols, 0), 0.0), axis=1)
    gam_cols = gl.sum(gl.where(i <= j, gl.expand_dims(g_rows, 1), 0.0), axis=0)
    return gam_rows, gam_cols


@aggregate
class GateSource:
    """Where a kernel reads the per-token gates g ([rows, HV] fp32, the log decay) and beta ([rows, HV] fp32) of
    one value head, and whether it computes them from raw inputs (fla's options, as fla defines them):
    use_gate_in_kernel: g holds the raw a, and g = -exp(A_log[h]) softplus(a + dt_bias[h]) (softplus(x) = x from
    x = 20 on; no dt_bias when not given); use_beta_sigmoid_in_kernel: beta holds the raw b, beta = sigmoid(b),
    or 2 sigmoid(b) with allow_neg_eigval (the transition I - beta k k^T may then have negative eigenvalues).
    Rows a mask leaves out read as 0 either way. The head's A_log and dt_bias are read where a chunk's g is
    (cached loads): held across the chunk loop they would take registers the fused kernel's load partition does
    not have. Only a GATING variant (the spec's `gating` axis) has the code of either option: the others read g
    and beta as they are, with nothing of the gating left in their SASS."""
    g: gl.tensor
    beta: gl.tensor
    A_log: gl.tensor  # the head's entry
    dt_bias: gl.tensor
    mode: gl.tensor  # GATE_MODE | BIAS_MODE | SIGMOID_MODE | NEG_EIGVAL_MODE bits
    GATING: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, g, beta, A_log, dt_bias, mode, GATING):
        self.g = g
        self.beta = beta
        self.A_log = A_log
        self.dt_bias = dt_bias
        self.mode = mode
        self.GATING = gl.constexpr(GATING)

    @gluon.jit
    def make(g, beta, A_log, dt_bias, i_hv, flags, GATING: gl.constexpr, GATE_IN_KERNEL: gl.constexpr):
        """Value head i_hv's source, from a kernel's pointers and its `flags`, whose gating bits are the four from
        GATE_IN_KERNEL up, in the modes' order (loader/abi.py _gate_flags; read only by a GATING variant)."""
        mode = (flags // GATE_IN_KERNEL) & (GATE_MODE | BIAS_MODE | SIGMOID_MODE | NEG_EIGVAL_MODE)
        return GateSource(g, beta, A_log + i_hv, dt_bias + i_hv, mode, GATING)

    @gluon.jit
    def rows(self, row0, HV):
        """The same head's source with element offsets that count rows from row0 (times HV)."""
        offset = row0.to(gl.int64) * HV
        return GateSource(self.g + offset, self.beta + offset, self.A_log, self.dt_bias, self.mode, self.GATING)

    @gluon.jit
    def log_decay(self, offs, live):
        """g at element offsets `offs`; 0 off `live`."""
        return self.decay_of(gl.load(self.g + offs, mask=live, other=0.0), live)

    @gluon.jit
    def decay_of(self, x, live):
        """The log decay g from x as loaded from self.g (0 off `live`)."""
        if self.GATING:
            if self.mode & GATE_MODE:
                if self.mode & BIAS_MODE:
                    x = x + gl.load(self.dt_bias)
                x = gl.where(live, -gl.exp(gl.load(self.A_log)) * gl.where(x < 20.0, gl.log(1.0 + gl.exp(x)), x),
                             0.0)
        return x

    @gluon.jit
    def betas(self, offs, live):
        """beta at element offsets `offs`; 0 off `live`."""
        return self.beta_of(gl.load(self.beta + offs, mask=live, other=0.0), live)

    @gluon.jit
    def beta_of(self, x, live):
        """beta from x as loaded from self.beta (0 off `live`)."""
        if self.GATING:
            if self.mode & SIGMOID_MODE:
                x = gl.where(live, 1.0 / (1.0 + gl.exp(-x)), 0.0)
                if self.mode & NEG_EIGVAL_MODE:
                    x = 2.0 * x
        return x


@gluon.jit
def chunk_gates(g, beta, gates, gam, qg, kg, i_hv, start, n_rows, HV, rows, log_rq, log_rk,
                cols_layout: gl.constexpr):
    """The gates of value head i_hv over the chunk's rows (gdn_prepare, both arches): loads g and beta (through the
    head's GateSource where the variant computes them), writes gam = cumsum(g) and the log row scalings
    qg = gam + ln rq, kg = gam - ln rk for gdn_scan (row data of `rows` rows: row_data_start), and returns gam in
    the row layout (log_rq's) and in cols_layout, and beta in the row layout. Rows past n_rows read as 0. (The
    loads add the head's column last: ptxas schedules the sm_90a gdn_prepare of the other association 23% slower,
    H200, 32 x 8192.)"""
    r = gl.arange(0, log_rq.shape[0], log_rq.type.layout)
    c = gl.arange(0, log_rq.shape[0], cols_layout)
    offs_r = (start + r).to(gl.int64) * HV + i_hv
    g_rows = gates.decay_of(gl.load(g + offs_r, mask=r < n_rows, other=0.0), r < n_rows)
    g_cols = gates.decay_of(gl.load(g + (start + c).to(gl.int64) * HV + i_hv, mask=c < n_rows, other=0.0), c < n_rows)
    beta_rows = gates.beta_of(gl.load(beta + offs_r, mask=r < n_rows, other=0.0), r < n_rows)
    gam_rows, gam_cols = chunk_cumsum(g_rows, g_cols)
    dest = row_data_start(i_hv, start, rows) + r
    gl.store(gam + dest, gam_rows, mask=r < n_rows)
    gl.store(qg + dest, gam_rows + log_rq, mask=r < n_rows)
    gl.store(kg + dest, gam_rows - log_rk, mask=r < n_rows)
    return gam_rows, gam_cols, beta_rows


@gluon.jit
def _tf32_split(x):
    """x = hi + lo, hi x's leading 19 bits (what a tf32 tensor-core operand keeps), lo the exact rest."""
    hi = (x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)
    return hi, x - hi


@gluon.jit
def _mma_tf32x3(a, b, acc):
    """acc + a @ b on warp-level tf32 MMAs to about fp32 accuracy: a_hi b_hi + a_hi b_lo + a_lo b_hi, the small
    products first (triton's tf32x3, which Gluon's mma_v2 does not offer)."""
    a_hi, a_lo = _tf32_split(gl.convert_layout(a, gl.DotOperandLayout(0, acc.type.layout, 1)))
    b_hi, b_lo = _tf32_split(gl.convert_layout(b, gl.DotOperandLayout(1, acc.type.layout, 1)))
    acc = mma_v2(a_lo, b_hi, acc, input_precision="tf32")
    acc = mma_v2(a_hi, b_lo, acc, input_precision="tf32")
    return mma_v2(a_hi, b_hi, acc, input_precision="tf32")


@gluon.jit
def diagonal_block_inverses(A, BLOCK: gl.constexpr):
    """(I + A_bb)^-1 for the BT / BLOCK diagonal [BLOCK, BLOCK] blocks of strictly lower-triangular A [BT, BT],
    returned as the block-diagonal [BT, BT] matrix in A's layout.

    The blocks go to a [BT / BLOCK, BLOCK, BLOCK] batch, one block a warp (the warp whose wgmma rows they are),
    and are inverted there by repeated squaring on warp-level tf32 MMAs (mma.sync m16n8k8): a quarter of the
    work of squaring the whole [BT, BT] matrix, and no CTA barrier. Each product is split into three tf32 ones
    (_mma_tf32x3): when the gates hardly decay and the keys are alike, the powers of a block grow to ~10 while
    the inverse's entries stay below 1, and one tf32 rounding of the powers left errors of ~4e-2 in the inverse.
    """
    BT: gl.constexpr = A.shape[0]
    NB: gl.constexpr = BT // BLOCK
    layout: gl.constexpr = A.type.layout
    gl.static_assert(NB == gl.num_warps(), "one diagonal block a warp")
    i = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, layout)), 1)
    j = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, layout)), 0)
    same_block = (i // BLOCK) == (j // BLOCK)
    blocks = gl.sum(gl.reshape(gl.where(same_block, A, 0.0), [NB, BLOCK, NB, BLOCK]), axis=2)

    batch_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NB, 1, 1],
                                                        instr_shape=[1, 16, 8])
    bi = gl.arange(0, BLOCK, gl.SliceLayout(0, gl.SliceLayout(2, batch_mma)))
    bj = gl.arange(0, BLOCK, gl.SliceLayout(0, gl.SliceLayout(1, batch_mma)))
    eye = gl.where(gl.expand_dims(gl.expand_dims(bi, 0), 2) == gl.expand_dims(gl.expand_dims(bj, 0), 1), 1.0, 0.0)
    power = -gl.convert_layout(blocks, batch_mma)
    inverse = eye + power
    for _ in gl.static_range(squaring_rounds(BLOCK)):
        power = _mma_tf32x3(power, power, gl.zeros_like(power))
        inverse = _mma_tf32x3(inverse, power, inverse)

    # back to [BT, BT]: every block repeated along its block row, then the off-diagonal copies masked out
    rows4: gl.constexpr = gl.BlockedLayout([1, 2, NB, 4], [1, 8, 1, 4], [NB, 1, 1, 1], [3, 2, 1, 0])
    spread = gl.expand_dims(gl.convert_layout(inverse, gl.SliceLayout(2, rows4)), 2) \
        + gl.zeros([NB, BLOCK, NB, BLOCK], gl.float32, rows4)
    return gl.where(same_block, gl.convert_layout(gl.reshape(spread, [BT, BT]), layout), 0.0)


@gluon.jit
def state_tile_offsets(slot, i_hv, i_v, HV, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                       TRANSPOSE_STATE: gl.constexpr, layout: gl.constexpr):
    """Offsets of the [K, BV] state tile (value head i_hv, V tile i_v) of state slot `slot`.

    The state is [slots, HV, K, V], or [slots, HV, V, K] with TRANSPOSE_STATE (the layout decode kernels read);
    either way the tile is held as [K, BV] on chip, so the transposed layout costs no extra kernel.
    """
    kk = gl.expand_dims(gl.arange(0, K, gl.SliceLayout(1, layout)), 1)
    vv = gl.expand_dims(i_v * BV + gl.arange(0, BV, gl.SliceLayout(0, layout)), 0)
    base = (slot.to(gl.int64) * HV + i_hv) * (K * V)
    if TRANSPOSE_STATE:
        return base + vv * K + kk
    else:
        return base + kk * V + vv


@gluon.jit
def row_data_rows(T, num_seqs, IS_VARLEN: gl.constexpr):
    """The rows of gdn_prepare's row data for gdn_scan (gam, qg, kg): T of a varlen batch, num_seqs * T of a
    fixed-length one."""
    rows = T.to(gl.int64)
    if not IS_VARLEN:
        rows = rows * num_seqs
    return rows


@gluon.jit
def row_data_start(i_hv, row0, rows):
    """Element offset of row row0 of value head i_hv in the row data, [HV, rows] fp32: head-major, so that a
    chunk's rows of one value head are one contiguous 256-byte run. (Token-major, [rows, HV], each row of a
    chunk is a 32-byte sector of its own, which the value heads fill piece by piece from different SMs: without
    those stores the warp-specialised prepare ran 1.3x faster, H100.)"""
    return i_hv.to(gl.int64) * rows + row0


@gluon.jit
def chunk_rows(gam_head, qg_head, kg_head, c, seq_len, BT: gl.constexpr, rows_layout: gl.constexpr,
               cols_layout: gl.constexpr):
    """Row data of chunk c from gdn_prepare, loaded straight into the layouts that use it: qg and kg
    (gam plus the log q/k row scalings) over the output rows, kg over the score columns, and gam of the
    chunk's last row. Rows past the sequence read as 0 (c may be n_chunks: both scan kernels load one chunk
    ahead, so the loads' latency is off the critical path). Loading in the MMA slice layouts (a few redundant
    L1 hits) instead of one element a thread saves a convert_layout (a CTA barrier) per vector per chunk."""
    n_rows = seq_len - c * BT
    r = gl.arange(0, BT, rows_layout)
    j = gl.arange(0, BT, cols_layout)
    qg_rows = gl.load(qg_head + c * BT + r, mask=r < n_rows, other=0.0)
    kg_rows = gl.load(kg_head + c * BT + r, mask=r < n_rows, other=0.0)
    kg_cols = gl.load(kg_head + c * BT + j, mask=j < n_rows, other=0.0)
    last = gl.maximum(c * BT + gl.minimum(n_rows, BT) - 1, 0)
    gam_last = gl.load(gam_head + last, mask=n_rows > 0, other=0.0)
    return qg_rows, kg_rows, kg_cols, gam_last


@gluon.jit
def chunk_row_scalings(qg_rows, kg_rows, gam_last, scale, rows_tt: gl.constexpr):
    """The chunk's per-row factors (gdn_scan, both arches), with qg = gam + ln rq and kg = gam - ln rk:
    o_scale = scale e^gam rq = scale e^qg (rows of q h), v_dec_scale = e^(gam_last - gam) rk = e^(gam_last - kg)
    (rows of v_dec), the row exponents of the score decay e^(gam_i - gam_j) scale rq_i rk_j
    = e^((qg_i + ln scale) - kg_j) (the columns are kg itself), and e^gam_last for the state."""
    o_scale = scale * exp_ftz(qg_rows)
    v_dec_scale = exp_ftz(gam_last - kg_rows)
    decay_rows = gl.convert_layout(qg_rows + gl.log(scale), rows_tt)
    return o_scale, v_dec_scale, decay_rows, exp_ftz(gam_last)


@gluon.jit
def loop_variant(x, j):
    """x, as a value the compiler cannot prove invariant in a loop over j, nor equal to x (store_tmem_state).

    gdn_prepare passes the chunk's row bounds through this once per value head: otherwise every address and mask
    derived from them is hoisted out of the loop over value heads and pinned in registers (255 registers a
    thread and spills). A non-inlined function would do the same, but on the H200 the sm_90a kernel with its
    per-head body as a called function produced NaN w and u (wgmma in a called function), so neither family
    uses one."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [x, j], dtype=gl.int32, is_pure=True, pack=1)


@constexpr_function
def state_io_layout(K, BV, TRANSPOSE_STATE, num_warps):
    """Coalesced layout for moving a [K, BV] state tile to or from HBM: 4 consecutive elements of the
    HBM-contiguous dimension (V, or K when transposed) per thread, a warp along that dimension (any state dtype)."""
    if TRANSPOSE_STATE:
        tpw = min(32, K // 4)
        return gl.BlockedLayout([4, 1], [tpw, 32 // tpw], [1, num_warps], [0, 1])
    tpw = min(32, BV // 4)
    return gl.BlockedLayout([1, 4], [32 // tpw, tpw], [num_warps, 1], [1, 0])


@gluon.jit
def load_state_tile(h0, slot, i_hv, i_v, HV, mask, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                    TRANSPOSE_STATE: gl.constexpr, layout: gl.constexpr):
    """The [K, BV] tile of state slot `slot` in `layout` (zeros where mask is false), read coalesced and widened
    to fp32 (exact) from h0's storage dtype as it lands, so the rest is an fp32 state's code."""
    io: gl.constexpr = state_io_layout(K, BV, TRANSPOSE_STATE, gl.num_warps())
    offs = state_tile_offsets(slot, i_hv, i_v, HV, K, V, BV, TRANSPOSE_STATE, io)
    return gl.convert_layout(gl.load(h0 + offs, mask=mask, other=0.0).to(gl.float32), layout)


@gluon.jit
def store_state_tile(ht, h, slot, i_hv, i_v, HV, mask, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     TRANSPOSE_STATE: gl.constexpr):
    """Write the [K, BV] fp32 tile h of state slot `slot` (if mask), coalesced, rounded to nearest even to ht's
    storage dtype just before the store (fp8: saturated at the largest finite value), after an fp32 state's code.
    (Rounding before the layout change instead left the sm_90a fp8 scan at BV = 128 with 32 more spilled bytes.)"""
    io: gl.constexpr = state_io_layout(K, BV, TRANSPOSE_STATE, gl.num_warps())
    offs = state_tile_offsets(slot, i_hv, i_v, HV, K, V, BV, TRANSPOSE_STATE, io)
    gl.store(ht + offs, gl.convert_layout(h, io).to(ht.dtype.element_ty), mask=mask)


@gluon.jit
def chunk_tile_ptrs(ptr, row0, row_stride, BT: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    """Pointers to the [BT, COLS] row tile starting at row row0 of a token-major tensor: the row base in 64-bit
    scalar arithmetic, the in-tile offsets in 32-bit (so a loop over heads keeps few address registers live)."""
    rows = gl.arange(0, BT, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    return ptr + row0.to(gl.int64) * row_stride + (rows[:, None] * row_stride + cols[None, :])


@gluon.jit
def row_mask(n_rows, BT: gl.constexpr, layout: gl.constexpr):
    """[BT, 1] mask of the tile rows below n_rows."""
    return (gl.arange(0, BT, gl.SliceLayout(1, layout)) < n_rows)[:, None]


@gluon.jit
def load_rows(ptr, row0, n_rows, row_stride, BT: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    """Masked register load of a [BT, COLS] row tile of a token-major tensor; rows past n_rows read as 0."""
    return gl.load(chunk_tile_ptrs(ptr, row0, row_stride, BT, COLS, layout), mask=row_mask(n_rows, BT, layout),
                   other=0.0)


@gluon.jit
def store_rows(ptr, x, row0, n_rows, row_stride):
    """Masked store of the [BT, COLS] register tile x, from its own layout, to rows row0 .. row0 + n_rows - 1 of a
    token-major tensor (the rows after them are another sequence's)."""
    layout: gl.constexpr = x.type.layout
    gl.store(chunk_tile_ptrs(ptr, row0, row_stride, x.shape[0], x.shape[1], layout), x,
             mask=row_mask(n_rows, x.shape[0], layout))


@gluon.jit
def inverse_norm(squares):
    """1 / sqrt(squares + 1e-6): a row's inverse L2 norm from its sum of squares (fla's l2norm)."""
    return 1.0 / gl.sqrt(squares + 1e-6)


@gluon.jit
def inverse_row_norms(x):
    """inverse_norm of each row of x, in fp32."""
    xf = x.to(gl.float32)
    return inverse_norm(gl.sum(xf * xf, axis=1))


@gluon.jit
def mbarriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers in shared memory ([n, 1]; .index(i) is one), each completing a phase after `count` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def token_major_desc(base, row_stride, n_rows, n_cols, BT: gl.constexpr, COLS: gl.constexpr):
    """TMA descriptor over an [n_rows, n_cols] block of a token-major tensor whose rows are row_stride elements
    apart, in [BT, COLS] tiles (the default NVMMA layout)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, COLS], base.dtype.element_ty)
    return tma.make_tensor_descriptor(base, [n_rows, n_cols], [row_stride, 1], [BT, COLS], layout)


@gluon.jit
def row_tile_desc(base, row_stride, seq_len, BT: gl.constexpr, COLS: gl.constexpr):
    """TMA descriptor over one head's [seq_len, COLS] rows of a token-major tensor."""
    return token_major_desc(base, row_stride, gl.maximum(seq_len, 1), COLS, BT, COLS)


@gluon.jit
def store_state_tile_direct(ht, h, slot, i_hv, i_v, HV, mask, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                            TRANSPOSE_STATE: gl.constexpr):
    """store_state_tile from the layout h is held in, for a store inside a chunk loop: no round trip through
    shared memory (which the loops have none of to spare) and no CTA barrier. A wgmma accumulator's element pairs
    still fill whole 32-byte sectors in either state layout, and a TMEM register tile (a row a thread) whole rows.
    gl.store converts h to the buffer's element type, as store_state_tile does."""
    layout: gl.constexpr = h.type.layout
    gl.store(ht + state_tile_offsets(slot, i_hv, i_v, HV, K, V, BV, TRANSPOSE_STATE, layout), h, mask=mask)


@aggregate
class Checkpoints:
    """Where a program writes its sequence's state checkpoints (a serving engine's prefix cache reads them): the
    state after every checkpoint_every_n_tokens = N tokens (a multiple of BT; 0: none) of the sequence, checkpoint j
    (the state after (j + 1) N tokens) into row checkpoint_cu_starts[sequence] + j of the buffer, in the state's
    layout and dtype; a row outside the buffer's `rows` is not written (as every bound derived from cu_seqlens is
    clamped: malformed starts give wrong rows, never an illegal access). The sequence's last, partial chunk ends on
    none; a state pool's slots play no part. Only a CHECKPOINTS variant (the spec's `checkpoints` axis) reads these
    parameters or has any of this code.
    It holds the kernel's parameters only, so that nothing of it lives in registers across the chunk loops (they
    run at their register limit): the program's sequence and head (sequence_and_head, HEAD_MAJOR as the kernel
    numbers its programs) and the sequence's first row are read where a checkpoint is written."""
    buffer: gl.tensor
    rows: gl.tensor
    cu_starts: gl.tensor
    every_n: gl.tensor
    HV: gl.tensor
    BT: gl.constexpr
    V: gl.constexpr
    TRANSPOSE_STATE: gl.constexpr
    CHECKPOINTS: gl.constexpr
    HEAD_MAJOR: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, buffer, rows, cu_starts, every_n, HV, BT, V, TRANSPOSE_STATE, CHECKPOINTS, HEAD_MAJOR):
        self.buffer = buffer
        self.rows = rows
        self.cu_starts = cu_starts
        self.every_n = every_n
        self.HV = HV
        self.BT = gl.constexpr(BT)
        self.V = gl.constexpr(V)
        self.TRANSPOSE_STATE = gl.constexpr(TRANSPOSE_STATE)
        self.CHECKPOINTS = gl.constexpr(CHECKPOINTS)
        self.HEAD_MAJOR = gl.constexpr(HEAD_MAJOR)

    @gluon.jit
    def count_after(self, c, seq_len):
        """n > 0 when chunk c of the program's sequence ends on its n-th checkpoint, else 0."""
        done = c + 1
        period = gl.maximum(self.every_n // self.BT, 1)
        n = done // period
        return gl.where((self.every_n > 0) & (n * period == done) & (done * self.BT <= seq_len), n, 0)

    @gluon.jit
    def store(self, h, n, i_v):
        """h, the [K, BV] tile i_v of the state of the program's value head, as the n-th checkpoint of its
        sequence (nothing where n = 0), from the layout it is held in: predicated stores."""
        i_n, i_hv = sequence_and_head(self.HV, self.HEAD_MAJOR)
        row = gl.load(self.cu_starts + i_n, mask=n > 0, other=0) + (n - 1)
        store_state_tile_direct(self.buffer, h, row, i_hv, i_v, self.HV,
                                (n > 0) & (row >= 0) & (row < self.rows), h.shape[0], self.V, h.shape[1],
                                self.TRANSPOSE_STATE)

    @gluon.jit
    def store_after(self, h, c, seq_len, i_v):
        """h: the [K, BV] tile i_v of the state after chunk c, written when c ends on a checkpoint, behind a branch
        (nothing in a variant without checkpoints)."""
        if self.CHECKPOINTS:
            n = self.count_after(c, seq_len)
            if n > 0:
                self.store(h, n, i_v)


# --- used by the sm_100a family only ------------------------------------------------------------------------


@gluon.jit
def _bitmask_keep_scalar(diff, limit, group_start, bit):
    """One element of the 16-wide bitmask causal mask: keep column j of a row iff j < limit.

    Columns go in groups of 16 (group_start = j & ~15, bit = j & 15). For the row, the group's mask word is
    -1 << clamp(limit - group_start, 0, 16): bit b is set iff column group_start + b is masked out. The shift is
    clamped to 16 (bit <= 15, so that is exact) because a shift by >= 32 is undefined in LLVM IR.
    A masked element becomes -inf, so exp() of it is exactly 0 and never overflows (exp(gam_i - gam_j) for
    i < j can be huge).
    """
    shift = gl.minimum(gl.maximum(limit - group_start, 0), 16)
    word = (-1) << shift
    masked = ((word >> bit) & 1) != 0
    return gl.where(masked, -float("inf"), diff)


@gluon.jit
def causal_decay_bitmask(gam_rows, gam_cols, n_rows, STRICT: gl.constexpr):
    """Same result as causal_decay (M_ij = exp(gam_i - gam_j) on the (strictly) lower triangle of valid rows,
    else 0), with the mask built per element from 16-wide bitmasks through gl.map_elementwise.

    Row i keeps columns j < limit_i, limit_i = i (STRICT) or i + 1, and 0 for rows past n_rows. Masked exponents
    are -inf before exp, so nothing overflows and masked entries are exactly 0.
    """
    i = gl.arange(0, gam_rows.shape[0], gam_rows.type.layout)
    j = gl.expand_dims(gl.arange(0, gam_cols.shape[0], gam_cols.type.layout), 0)
    if STRICT:
        limit = i
    else:
        limit = i + 1
    limit = gl.expand_dims(gl.where(i < n_rows, limit, 0), 1)
    diff = gl.expand_dims(gam_rows, 1) - gl.expand_dims(gam_cols, 0)
    masked = gl.map_elementwise(_bitmask_keep_scalar, diff, limit, (j >> 4) << 4, j & 15)
    return exp_ftz(masked)


@gluon.jit
def issue_chunk_loads(q_desc, k_desc, w_desc, u_desc, row, bar, q_buf, k_buf, w_buf, u_buf):
    """TMA loads of one chunk's q, k, w, u tiles, completing on `bar`."""
    mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes + w_desc.block_type.nbytes
                    + u_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_buf)
    tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_buf)
    tma.async_copy_global_to_shared(w_desc, [row, 0], bar, w_buf)
    tma.async_copy_global_to_shared(u_desc, [row, 0], bar, u_buf)


@gluon.jit
def store_tmem_state(ht, h_tmem, slot, i_hv, i_v, HV, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     HS: gl.constexpr, TRANSPOSE_STATE: gl.constexpr, reg_hs: gl.constexpr):
    """Write the [K, BV] fp32 state tile h_tmem (tensor memory) to ht's slot `slot` through registers, in [K, HS]
    column slices (reg_hs: their tcgen05.ld layout), each converted and written by store_state_tile (gdn_scan's
    state stored narrower than fp32; an fp32 one leaves by TMA). The slot passes through loop_variant first: given
    the slot itself, the compiler reuses the element offsets of the initial state's loads, and keeps them across
    the chunk loop (at BV = 128: 29 values parked in 120 bytes of local memory)."""
    slot = loop_variant(slot, i_v)
    for j in gl.static_range(BV // HS):
        store_state_tile(ht, h_tmem.slice(j * HS, HS).load(reg_hs), slot, i_hv, i_v * (BV // HS) + j, HV, True, K,
                         V, HS, TRANSPOSE_STATE)
