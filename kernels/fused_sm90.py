"""gdn_fused for Hopper (sm_90a): the whole forward in one warp-specialised kernel (a preview: correct, not yet
faster than gdn_prepare + gdn_scan; docs/performance.md has the measurements and what holds it back).

One program per (sequence, value head) walks the sequence's 64-token chunks in order. q, k, v, g and beta are
read once, o and the final state written once; A, its inverse, v_new and the state never leave the SM
(docs/algorithm.md, "The fused forward"). The state is held transposed, S = h^T [V, K] fp32, in the registers
of two warpgroups (64 value rows each), so every product with it takes it as wgmma's register A operand and the
state is never copied to shared memory. With rq, rk the inverse L2 norms of the q and k rows (1 without
FUSED_L2NORM), gam = cumsum(g) and gl = gam of the chunk's last row:
    A      = beta_t rk_t rk_s (k k^T)_ts e^(gam_t - gam_s),  s < t                     (aux)
    Tc     = (I + A)^-1;  Tv = Tc diag(beta),  Tk = -Tc diag(beta e^gam rk)            (aux)
    P      = scale rq_t rk_s (q k^T)_ts e^(gam_t - gam_s),   s <= t                    (aux)
    kh     = S k^T                                       [V, BT]    (state, critical path)
    v_new  = v^T Tv^T + kh Tk^T                          [V, BT]    (state, critical path)
    o      = (S q^T) diag(scale rq e^gam) + v_new P^T    [V, BT] = o^T   (state, beside the path)
    S      = e^gl S + v_new diag(e^(gl - gam) rk) k      [V, K]     (state, critical path)
The column scalings of v_new ride in the two copies of Tc, and v^T goes from its TMA tile straight into the
tensor cores, so the state partition holds no per-column vectors while its products are in flight.
Partitions, 16 warps (registers a thread by setmaxnreg; the kernel is compiled at 128, a full register file):
  * state, the default partition: 2 warpgroups, (2048 - 4 * AUX_REGS - 4 * LOAD_REGS) / 8 = 192 registers: S
    alone is 64 a thread, its bf16 copy (the A operand of S k^T and S q^T) 32, each [V, BT] accumulator 32.
    With fewer (an aux budget above 104), ptxas serialises every wgmma of the kernel (C7512), and it does the
    same when S q^T is still in flight while v_new's products are issued: S k^T and S q^T are waited on together;
  * aux, 4 warps (one diagonal 16 x 16 block of the inverse a warp), AUX_REGS: what a chunk needs that does not
    depend on the state: k k^T and q k^T on wgmma, the decay matrix, P, the row scalings, Tc by the blocked tf32
    inverse with its operands in three fp32 shared-memory tiles, up to NUM_SLOTS chunks ahead of the state;
  * load, LOAD_WARPS warps at 24 registers: TMA of the q, k, v tiles through per-sequence descriptors whose row
    bound is the sequence's length (a chunk's tail is zero-filled and never reads the next sequence), then, an
    iteration later, the chunk's gates (gam = cumsum(g) by a warp scan) and the row norms of its q and k.
Rings (InputRing, GateRing, TermRing below; each slot a ready and an empty mbarrier, SlotBarriers): the inputs
(load -> aux and state), the gates (load -> aux) and the chunk terms (aux -> state).
Shared memory (226 KB of the 227 KB a CTA may have): inputs 2 x 48 KB, terms 2 x 25 KB, the inverse's tiles
48 KB, o staging 16 KB; one program an SM.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from . import FUSED_HAS_H0 as _HAS_H0, FUSED_L2NORM as _L2NORM, FUSED_STORE_HT as _STORE_HT
from . import FUSED_USE_INDICES as _USE_INDICES
from .common import (diagonal_block_inverses, load_state_tile, loop_variant, row_tile_desc, sequence_bounds,
                     state_io_layout, store_state_tile, wgmma_layout)

L2NORM = gl.constexpr(_L2NORM)
HAS_H0 = gl.constexpr(_HAS_H0)
STORE_HT = gl.constexpr(_STORE_HT)
USE_INDICES = gl.constexpr(_USE_INDICES)

NUM_SLOTS = gl.constexpr(2)
AUX_REGS = gl.constexpr(104)
LOAD_REGS = gl.constexpr(24)
LOAD_WARPS = gl.constexpr(4)
LOG2E = gl.constexpr(1.4426950408889634)
STATE_WARPS = gl.constexpr(8)
# rows of a chunk-terms slot's scaling tile: beta and the column scalings of kh (beta e^gam rk), of v_new before
# the state update and of S q^T, and the state's decay
BETA = gl.constexpr(0)
K_SCALE = gl.constexpr(1)
V_SCALE = gl.constexpr(2)
O_SCALE = gl.constexpr(3)
STATE_SCALE = gl.constexpr(4)  # e^gl in every entry
SCALINGS = gl.constexpr(5)


@aggregate
class SlotBarriers:
    """The ready and empty mbarriers of a ring of NUM_SLOTS chunk slots.

    Chunk c lives in slot c % NUM_SLOTS. Its producer waits for the slot's empty barrier, fills it and completes
    ready; each consumer waits for ready and arrives on empty when done. Both barriers flip phase once per pass
    over the ring, so chunk c waits for phase (c // NUM_SLOTS) & 1 of ready and for the other phase of empty
    (a fresh barrier counts as released once, so the first pass does not wait).
    """
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, ready, empty):
        self.ready = ready
        self.empty = empty

    @gluon.jit
    def make(producers: gl.constexpr, consumers: gl.constexpr):
        """`producers` arrivals (or one arrive with the TMA byte count) fill a slot, `consumers` empty it."""
        ready = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_SLOTS):
            mbarrier.init(ready.index(s), count=producers)
            mbarrier.init(empty.index(s), count=consumers)
        return SlotBarriers(ready, empty)

    @gluon.jit
    def ready_bar(self, chunk):
        return self.ready.index(chunk % NUM_SLOTS)

    @gluon.jit
    def wait_ready(self, chunk):
        mbarrier.wait(self.ready.index(chunk % NUM_SLOTS), (chunk // NUM_SLOTS) & 1)

    @gluon.jit
    def wait_empty(self, chunk):
        mbarrier.wait(self.empty.index(chunk % NUM_SLOTS), ((chunk // NUM_SLOTS) & 1) ^ 1)

    @gluon.jit
    def publish(self, chunk):
        """Every warp of the producing partition has written (and fenced) its share: one arrive on ready."""
        gl.thread_barrier()
        mbarrier.arrive(self.ready.index(chunk % NUM_SLOTS), count=1)

    @gluon.jit
    def release(self, chunk):
        """Every warp of the consuming partition is done with the slot: one arrive on empty."""
        gl.thread_barrier()
        mbarrier.arrive(self.empty.index(chunk % NUM_SLOTS), count=1)


@aggregate
class InputRing:
    """q, k, v tiles [NUM_SLOTS, BT, K|V] by TMA (load -> aux reads q, k; state reads q, k, v)."""
    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, q, k, v, bars):
        self.q = q
        self.k = k
        self.v = v
        self.bars = bars


@aggregate
class GateRing:
    """Per-row vectors of a chunk, [NUM_SLOTS, BT] fp32 each (load -> aux): gam = cumsum(g) in log2 units, beta,
    gam of the chunk's last row (in every entry), and the inverse L2 norms rq, rk of the q and k rows (1 without
    FUSED_L2NORM)."""
    gam: gl.shared_memory_descriptor
    beta: gl.shared_memory_descriptor
    gam_last: gl.shared_memory_descriptor
    rq: gl.shared_memory_descriptor
    rk: gl.shared_memory_descriptor
    bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, gam, beta, gam_last, rq, rk, bars):
        self.gam = gam
        self.beta = beta
        self.gam_last = gam_last
        self.rq = rq
        self.rk = rk
        self.bars = bars


@aggregate
class TermRing:
    """What the state partition takes from the aux partition for a chunk (aux -> state): Tc diag(beta),
    -Tc diag(beta e^gam rk) and P [NUM_SLOTS, BT, BT] in the input dtype, and the SCALINGS row scalings
    [NUM_SLOTS * SCALINGS, BT] fp32."""
    tc_v: gl.shared_memory_descriptor
    tc_k: gl.shared_memory_descriptor
    p: gl.shared_memory_descriptor
    scalings: gl.shared_memory_descriptor
    bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, tc_v, tc_k, p, scalings, bars):
        self.tc_v = tc_v
        self.tc_k = tc_k
        self.p = p
        self.scalings = scalings
        self.bars = bars

    @gluon.jit
    def scaling(self, chunk, row):
        """Row `row` of chunk `chunk`'s scalings ([BT] fp32)."""
        return self.scalings.index((chunk % NUM_SLOTS) * SCALINGS + row)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _inverse_row_norms(tile, out, L2: gl.constexpr):
    """out = 1 / sqrt(sum(x^2) + 1e-6) of each row of the [BT, K] shared tile (fla's l2norm), or 1 without L2;
    a few rows at a time, so that the load partition's few registers suffice."""
    BT: gl.constexpr = tile.shape[0]
    ROWS: gl.constexpr = 8  # the row period of the tile's 128-byte swizzle: a slice may not split it
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    for r in gl.static_range(BT // ROWS):
        if L2:
            x = tile.slice(r * ROWS, ROWS).load(layout).to(gl.float32)
            norms = 1.0 / gl.sqrt(gl.sum(x * x, axis=1) + 1e-6)
        else:
            norms = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, layout))
        out.slice(r * ROWS, ROWS).store(norms)


@gluon.jit
def _gate_rows(g_head, beta_head, c, seq_len, HV, BT: gl.constexpr, layout: gl.constexpr):
    """g (in log2 units) and beta of chunk c's rows; 0 past the sequence's end, so gam stays flat there."""
    r = gl.arange(0, BT, layout)
    live = r < seq_len - c * BT
    offs = (c * BT + r).to(gl.int64) * HV
    return gl.load(g_head + offs, mask=live, other=0.0) * LOG2E, gl.load(beta_head + offs, mask=live, other=0.0)


@gluon.jit
def _publish_gates(inputs, gates, c, g, beta, flags):
    """gam = cumsum(g), beta, gam_last and the row norms of chunk c's q and k (once its tiles have landed)."""
    slot = c % NUM_SLOTS
    gates.bars.wait_empty(c)
    gates.gam.index(slot).store(gl.associative_scan(g, 0, _add))
    gates.beta.index(slot).store(beta)
    gates.gam_last.index(slot).store(gl.zeros_like(g) + gl.sum(g, axis=0))
    if flags & L2NORM:
        inputs.bars.wait_ready(c)
        _inverse_row_norms(inputs.q.index(slot), gates.rq.index(slot), True)
        _inverse_row_norms(inputs.k.index(slot), gates.rk.index(slot), True)
    else:
        _inverse_row_norms(inputs.q.index(slot), gates.rq.index(slot), False)
        _inverse_row_norms(inputs.k.index(slot), gates.rk.index(slot), False)
    gates.bars.publish(c)


@gluon.jit
def _load_partition(inputs, gates, terms, inverse_tiles, q_desc, k_desc, v_desc, g_head, beta_head, seq_len, HV,
                    scale, flags):
    """TMA of the q, k, v tiles; the gates of each chunk and the row norms of its q and k, into the gate ring.
    Software-pipelined: chunk c's tiles are requested before chunk c - 1's gates are worked out, and the gate
    rows are read from HBM an iteration before they are used, so neither latency is in series with the other."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    nbytes: gl.constexpr = q_desc.block_type.nbytes + k_desc.block_type.nbytes + v_desc.block_type.nbytes
    # every warp holds all BT rows, so the cumsum is a warp-level scan
    rows: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [gl.num_warps()], [0])
    n_chunks = gl.cdiv(seq_len, BT)
    g, beta = _gate_rows(g_head, beta_head, 0, seq_len, HV, BT, rows)
    for c in range(n_chunks + 1):
        if c < n_chunks:
            slot = c % NUM_SLOTS
            inputs.bars.wait_empty(c)
            ready = inputs.bars.ready_bar(c)
            mbarrier.expect(ready, nbytes)
            tma.async_copy_global_to_shared(q_desc, [c * BT, 0], ready, inputs.q.index(slot))
            tma.async_copy_global_to_shared(k_desc, [c * BT, 0], ready, inputs.k.index(slot))
            tma.async_copy_global_to_shared(v_desc, [c * BT, 0], ready, inputs.v.index(slot))
        if c > 0:
            _publish_gates(inputs, gates, c - 1, g, beta, flags)
            g, beta = _gate_rows(g_head, beta_head, c, seq_len, HV, BT, rows)


@gluon.jit
def publish_row_scalings(terms, gates, c, gam_r, seq_len, scale, rows: gl.constexpr):
    """Chunk c's SCALINGS rows into the terms ring, from the gate ring (gam_r: gam in the `rows` layout); returns
    the row factors of P and of A, scale rq and beta rk (both arches' aux partitions)."""
    BT: gl.constexpr = gam_r.shape[0]
    slot = c % NUM_SLOTS
    beta = gates.beta.index(slot).load(rows)
    rq = gates.rq.index(slot).load(rows)
    rk = gates.rk.index(slot).load(rows)
    gam_last = gates.gam_last.index(slot).load(rows)
    e_gam = gl.exp2(gam_r)
    terms.scaling(c, BETA).store(beta)
    terms.scaling(c, K_SCALE).store(beta * e_gam * rk)
    # rows past the sequence's end get v_dec = 0, so they never reach the state
    terms.scaling(c, V_SCALE).store(gl.where(gl.arange(0, BT, rows) < seq_len - c * BT,
                                             gl.exp2(gam_last - gam_r) * rk, 0.0))
    terms.scaling(c, O_SCALE).store(scale * rq * e_gam)
    terms.scaling(c, STATE_SCALE).store(gl.exp2(gam_last))
    return scale * rq, beta * rk


@gluon.jit
def chunk_decay(gates, c, gam_r, i, j, n_rows, cols: gl.constexpr):
    """e^(gam_t - gam_s) rk_s of chunk c on the causal triangle of its live rows (t >= s, t < n_rows), else 0;
    gam_r and the row indices i in the rows layout, the column indices j in `cols`. The exponent is -inf off the
    triangle, so exp is never taken of a positive gam_t - gam_s (s > t), which can overflow."""
    slot = c % NUM_SLOTS
    causal = (i >= j) & (i < n_rows)
    exponent = gl.expand_dims(gam_r, 1) - gl.expand_dims(gates.gam.index(slot).load(cols), 0)
    return gl.exp2(gl.where(causal, exponent, -float("inf"))) * gl.expand_dims(gates.rk.index(slot).load(cols), 0)


@gluon.jit
def publish_inverse(terms, c, tc, dtype: gl.constexpr):
    """Tv = Tc diag(beta) and Tk = -Tc diag(beta e^gam rk) of chunk c into the terms ring (the column scalings
    from the chunk's BETA and K_SCALE rows, which publish_row_scalings wrote)."""
    slot = c % NUM_SLOTS
    cols: gl.constexpr = gl.SliceLayout(0, tc.type.layout)
    terms.tc_v.index(slot).store((tc * gl.expand_dims(terms.scaling(c, BETA).load(cols), 0)).to(dtype))
    terms.tc_k.index(slot).store((tc * gl.expand_dims(-terms.scaling(c, K_SCALE).load(cols), 0)).to(dtype))


@gluon.jit
def _tf32_product(a_tile, b_t_tile, acc, use_acc: gl.constexpr):
    """acc (+)= a b in tf32 on the tensor cores, both operands from shared memory: a row-major, b stored as its
    transpose (tf32 wgmma reads both operands K-major). The tiles were written by every warp of the partition:
    fence them for the tensor cores' (async) proxy, then wait for all warps."""
    fence_async_shared()
    gl.thread_barrier()
    return warpgroup_mma(a_tile, b_t_tile.permute((1, 0)), acc, use_acc=use_acc)


@gluon.jit
def _unit_lower_inverse(A, t0, t1, t2):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] (BT = 64), in the tf32 wgmma accumulator layout, blocked
    by 16: I + A = D (I + N), D = I + A's diagonal 16 x 16 blocks, N = D^-1 L with L A's strictly block-lower
    part; N^4 = 0, so (I + A)^-1 = (I - N)(I + N^2) D^-1 (docs/algorithm.md). D^-1 on warp-level tf32 MMAs
    (common.diagonal_block_inverses), then four 64x64x64 tf32 wgmma whose operands all sit in the fp32 tiles
    t0, t1, t2: nothing but one accumulator is live in registers (register operands would need layout shuffles
    and registers this partition does not have)."""
    BT: gl.constexpr = A.shape[0]
    BLOCK: gl.constexpr = 16
    layout: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps(), 32)  # the tf32 accumulator (instruction K = 8)
    A = gl.convert_layout(A, layout)
    i = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, layout)), 1)
    j = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, layout)), 0)
    t1.store(gl.permute(gl.where((i // BLOCK) > (j // BLOCK), A, 0.0), [1, 0]))
    t0.store(diagonal_block_inverses(A, BLOCK))
    n = _tf32_product(t0, t1, gl.zeros([BT, BT], gl.float32, layout), use_acc=False)  # N = D^-1 L
    gl.thread_barrier()
    t2.store(n)
    t1.store(gl.permute(n, [1, 0]))
    n2 = _tf32_product(t2, t1, gl.zeros([BT, BT], gl.float32, layout), use_acc=False)  # N^2
    gl.thread_barrier()
    one_minus_n = gl.where(i == j, 1.0, 0.0) - n
    t2.store(one_minus_n)
    t1.store(gl.permute(n2, [1, 0]))
    series = _tf32_product(t2, t1, one_minus_n, use_acc=True)  # (I - N)(I + N^2)
    gl.thread_barrier()
    t2.store(series)
    t1.store(t0.permute((1, 0)).load(layout))  # D^-1, transposed
    return _tf32_product(t2, t1, gl.zeros([BT, BT], gl.float32, layout), use_acc=False)


@gluon.jit
def _aux_partition(inputs, gates, terms, inverse_tiles, q_desc, k_desc, v_desc, g_head, beta_head, seq_len, HV,
                   scale, flags):
    """The state-independent terms of every chunk (see the module docstring), into the terms ring."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.block_type.element_ty
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    rows: gl.constexpr = gl.SliceLayout(1, acc_tt)
    cols: gl.constexpr = gl.SliceLayout(0, acc_tt)
    for c in range(gl.cdiv(seq_len, BT)):
        slot = c % NUM_SLOTS
        inputs.bars.wait_ready(c)
        q_s = inputs.q.index(slot)
        k_s = inputs.k.index(slot)
        # --- k k^T and q k^T on the tensor cores while the decay matrix is computed
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt), use_acc=False,
                           is_async=True)
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt), use_acc=False,
                           is_async=True)
        gates.bars.wait_ready(c)
        gam_r = gates.gam.index(slot).load(rows)
        i = gl.expand_dims(gl.arange(0, BT, rows), 1)
        j = gl.expand_dims(gl.arange(0, BT, cols), 0)
        decay = chunk_decay(gates, c, gam_r, i, j, seq_len - c * BT, cols)
        kk, qk = warpgroup_mma_wait(0, deps=[kk, qk])
        inputs.bars.release(c)

        # --- the row scalings and P go out first, so that only A is live through the inverse
        terms.bars.wait_empty(c)
        p_rows, a_rows = publish_row_scalings(terms, gates, c, gam_r, seq_len, scale, rows)
        terms.p.index(slot).store((qk * decay * gl.expand_dims(p_rows, 1)).to(dtype))
        a = gl.where(i > j, kk * decay * gl.expand_dims(a_rows, 1), 0.0)
        gates.bars.release(c)
        # the fp32 operand tiles are picked by opaque indices: constant addresses would let the compiler hoist
        # every wgmma descriptor of the inverse out of the loop (registers)
        tc = _unit_lower_inverse(a, inverse_tiles.index(loop_variant(0, c)), inverse_tiles.index(loop_variant(1, c)),
                                 inverse_tiles.index(loop_variant(2, c)))
        publish_inverse(terms, c, tc, dtype)
        fence_async_shared()
        terms.bars.publish(c)


@gluon.jit
def _state_partition(state, inputs, terms, o_desc, o_stage, seq_len):
    """The recurrence and the outputs (see the module docstring); returns the final state S = h^T."""
    BT: gl.constexpr = o_desc.block_type.shape[0]
    V: gl.constexpr = state.shape[0]
    dtype: gl.constexpr = o_desc.block_type.element_ty
    acc_vk: gl.constexpr = state.type.layout
    acc_vt: gl.constexpr = wgmma_layout(V, BT, STATE_WARPS)
    op_vt: gl.constexpr = gl.DotOperandLayout(0, acc_vt, 2)  # register A operand of the [V, BT] products
    op_vk: gl.constexpr = gl.DotOperandLayout(0, acc_vk, 2)  # and of the state update
    cols_vt: gl.constexpr = gl.SliceLayout(0, acc_vt)
    for c in range(gl.cdiv(seq_len, BT)):
        slot = c % NUM_SLOTS
        inputs.bars.wait_ready(c)
        q_s = inputs.q.index(slot)
        k_s = inputs.k.index(slot)
        # kh = S k^T (critical path) and S q^T (beside it) from the state in registers
        s_op = gl.convert_layout(state.to(dtype), op_vt)
        kh = warpgroup_mma(s_op, k_s.permute((1, 0)), gl.zeros([V, BT], gl.float32, acc_vt), use_acc=False,
                           is_async=True)
        qh = warpgroup_mma(s_op, q_s.permute((1, 0)), gl.zeros([V, BT], gl.float32, acc_vt), use_acc=False,
                           is_async=True)
        terms.bars.wait_ready(c)
        kh, qh = warpgroup_mma_wait(0, deps=[kh, qh])

        # v_new = v^T (Tc diag(beta))^T + kh (-Tc diag(beta e^gam rk))^T: the column scalings ride in the two
        # copies of Tc, and v^T is read by the tensor cores straight from its TMA tile
        v_new = warpgroup_mma(inputs.v.index(slot).permute((1, 0)), terms.tc_v.index(slot).permute((1, 0)),
                              gl.zeros([V, BT], gl.float32, acc_vt), use_acc=False, is_async=True)
        v_new = warpgroup_mma(gl.convert_layout(kh.to(dtype), op_vt), terms.tc_k.index(slot).permute((1, 0)), v_new,
                              is_async=True)
        o = qh * gl.expand_dims(terms.scaling(c, O_SCALE).load(cols_vt), 0)
        v_scale = terms.scaling(c, V_SCALE).load(cols_vt)
        state_decay = gl.max(terms.scaling(c, STATE_SCALE).load(cols_vt), axis=0)
        v_new = warpgroup_mma_wait(0, deps=[v_new])

        # S = e^gl S + v_new diag(e^(gl - gam) rk) k, and o = o + v_new P^T
        v_dec = gl.convert_layout((v_new * gl.expand_dims(v_scale, 0)).to(dtype), op_vk)
        state = warpgroup_mma(v_dec, k_s, state * state_decay, is_async=True)
        o = warpgroup_mma(gl.convert_layout(v_new.to(dtype), op_vt), terms.p.index(slot).permute((1, 0)), o,
                          is_async=True)
        state, o = warpgroup_mma_wait(0, deps=[state, o])
        inputs.bars.release(c)
        terms.bars.release(c)

        # o^T -> [BT, V] staging tile -> HBM (the store of chunk c - 1 left the tile a chunk ago)
        tma.store_wait(0)
        gl.thread_barrier()
        o_stage.store(gl.permute(o.to(dtype), [1, 0]))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_stage)
    tma.store_wait(0)
    return (state, )


@gluon.jit
def state_slot(i_n, state_indices, flags):
    """Sequence i_n's state slot: i_n, or the caller's pool slot (a negative one starts from zero and is not
    written)."""
    slot = i_n
    if flags & USE_INDICES:
        slot = gl.load(state_indices + i_n)
    return slot


@gluon.jit
def head_tiles(q, k, v, o, g, beta, bos, seq_len, i_h, i_hv, H, HV, K: gl.constexpr, V: gl.constexpr,
               BT: gl.constexpr):
    """The program's TMA descriptors over its sequence's q, k (key head i_h), v and o (value head i_hv) rows, with
    the sequence's length as row bound (a chunk's tail is zero-filled on load and clipped on store, never the next
    sequence's rows), and its g and beta columns."""
    row0 = bos.to(gl.int64)
    q_desc = row_tile_desc(q + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    k_desc = row_tile_desc(k + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    v_desc = row_tile_desc(v + row0 * HV * V + i_hv * V, HV * V, seq_len, BT, V)
    o_desc = row_tile_desc(o + row0 * HV * V + i_hv * V, HV * V, seq_len, BT, V)
    return q_desc, k_desc, v_desc, o_desc, g + row0 * HV + i_hv, beta + row0 * HV + i_hv


@gluon.jit
def chunk_rings(q_desc, k_desc, v_desc):
    """The inputs ring (emptied by the aux and the state partition), the gate ring and the terms ring."""
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    tile_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dtype)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # rows of [BT] vectors
    inputs = InputRing(gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], q_desc.layout),
                       gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], k_desc.layout),
                       gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, V], v_desc.layout), SlotBarriers.make(1, 2))
    gates = GateRing(gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, BT], plain), SlotBarriers.make(1, 1))
    terms = TermRing(gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BT], tile_tt),
                     gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BT], tile_tt),
                     gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BT], tile_tt),
                     gl.allocate_shared_memory(gl.float32, [NUM_SLOTS * SCALINGS, BT], plain), SlotBarriers.make(1, 1))
    return inputs, gates, terms


@gluon.jit
def fused_kernel(q, k, v, g, beta, cu_seqlens, h0, ht, state_indices, o, scale, T, H, HV, flags,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr,
                 TRANSPOSE_STATE: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(num_warps == STATE_WARPS, "the default partition is the two state warpgroups")
    gl.static_assert(BT == 64, "one warpgroup owns a chunk's 64 rows in the aux partition")
    dtype: gl.constexpr = q.dtype.element_ty
    i_n = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN)

    # --- the state S = h^T [V, K] in the wgmma accumulator layout of two warpgroups
    acc_vk: gl.constexpr = wgmma_layout(V, K, num_warps)
    io: gl.constexpr = state_io_layout(K, V, TRANSPOSE_STATE, num_warps)
    slot = state_slot(i_n, state_indices, flags)
    h = load_state_tile(h0, slot, i_hv, 0, HV, ((flags & HAS_H0) != 0) & (slot >= 0), K, V, V, TRANSPOSE_STATE, io)
    state = gl.convert_layout(gl.permute(h, [1, 0]), acc_vk)

    q_desc, k_desc, v_desc, o_desc, g_head, beta_head = head_tiles(q, k, v, o, g, beta, bos, seq_len, i_h, i_hv, H,
                                                                   HV, K, V, BT)
    # --- shared memory: the three rings, the inverse's fp32 operand tiles, the output staging tile
    inputs, gates, terms = chunk_rings(q_desc, k_desc, v_desc)
    inverse_tiles = gl.allocate_shared_memory(gl.float32, [3, BT, BT],
                                              gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32))
    o_stage = gl.allocate_shared_memory(dtype, [BT, V], o_desc.layout)

    worker_args = (inputs, gates, terms, inverse_tiles, q_desc, k_desc, v_desc, g_head, beta_head, seq_len, HV, scale,
                   flags)
    state = gl.warp_specialize([
        (_state_partition, (state, inputs, terms, o_desc, o_stage, seq_len)),
        (_aux_partition, worker_args),
        (_load_partition, worker_args),
    ], [4, LOAD_WARPS], [AUX_REGS, LOAD_REGS])[0]
    store_state_tile(ht, gl.permute(state, [1, 0]), slot, i_hv, 0, HV, ((flags & STORE_HT) != 0) & (slot >= 0),
                     K, V, V, TRANSPOSE_STATE)
