"""gdn_fused for Blackwell (sm_100a): the whole forward in one warp-specialised kernel.

Same algorithm, flags, rings and rounding points as fused_sm90.py (docs/algorithm.md has the derivation), and its
grid at BV = V, the only V tile here; the tensor-core side is Blackwell's. One program per (sequence, value head)
walks the sequence's 64-token chunks in order; q, k, v, g and beta are read once, o and the final state written
once. The state is held transposed,
S = h^T [V, K] fp32, in tensor memory (TMEM: its V = 128 rows are the 128 lanes), and the products that take it
read a 16-bit copy of it from TMEM as tcgen05's A operand, the counterpart of sm_90a's register A operand; the
other [V, BT] A operands (kh, v_new, v_dec) go the same way. With rq, rk the inverse L2 norms of the q and k rows
(1 without FUSED_L2NORM), gam = cumsum(g) and gl = gam of the chunk's last row:
    A      = beta_t rk_t rk_s (k k^T)_ts e^(gam_t - gam_s),  s < t                          (aux)
    Tc     = (I + A)^-1;  Tv = Tc diag(beta)                                                 (aux)
    P      = rk_s (q k^T)_ts e^(gam_t - gam_s),              s <= t                         (aux)
    kh     = S k^T                                       [V, BT]     (state, critical path)
    v_new  = v^T Tv^T - kh diag(e^gam rk) Tv^T           [V, BT]     (state, critical path)
    o      = ((S q^T) diag(e^gam) + v_new P^T) diag(scale rq)    [V, BT] = o^T   (state, beside the path)
    S      = e^gl S + v_new diag(e^(gl - gam) rk) k      [V, K]      (state, critical path)
S, kh diag(e^gam rk), v_new, v_dec = v_new diag(...), Tv and P enter the products in the input dtype, every product
accumulates in fp32, the inverse is tf32, S stays fp32.
Partitions, 16 warps. The kernel is compiled for the 8
default warps at 128 registers a thread, a full register file, and setmaxnreg moves them:
  * state, the default partition: 2 warpgroups, (2048 - 4 * AUX_REGS - 4 * 24) / 8 = 148, 144 registers
    (setmaxnreg takes multiples of 8). A warpgroup reaches all 128 TMEM lanes, so the second one halves the
    columns each thread moves through registers (32 of a [V, BT] tile, 64 of S): that register work between the
    MMAs of the serial chain S -> kh -> v_new -> S is what the recurrence waits on;
  * aux, 4 warps, AUX_REGS = 192 (at 184 it reloads two spilled values every chunk, at 176 six): all that
    does not depend on the state (k k^T and q k^T, the decay, the row scalings, P, gdn_prepare's blocked tf32
    inverse (inverse_sm100.py), one diagonal block a warp, hence 4 warps, and Tv), up to
    NUM_SLOTS chunks ahead of the state;
  * load and norms, 2 + 2 warps, 24 registers: fused_sm90.py's partitions as they are: TMA of the q, k, v tiles
    through per-sequence descriptors whose row bound is the sequence's length (a chunk's tail is zero-filled,
    never the next sequence's rows) and the gates into the gate ring; rq into the terms ring once the q tile
    lands (the aux partition reads rk off the diagonal of k k^T).
Units: TMA (UTMALDG) fills the input ring and o leaves by TMA store (UTMASTG) through a two-tile staging buffer;
the tensor cores run every product as tcgen05 MMAs (UTCHMMA: M = 128 on the state side, M = 64 for the aux's
[BT, BT] products; the diagonal blocks of the inverse are warp-level mma.sync, HMMA) from shared memory and TMEM
into TMEM; tcgen05_commit signals their completion on mbarriers (SYNCS). The state and the aux partition each
issue their own MMAs (one elected thread, after a partition barrier): every MMA here consumes what its partition
wrote just before and is waited on right after, so a separate MMA warp would add an mbarrier hop to each link of
the chain and take no work off it. The state's MMAs on one input slot are followed by a tcgen05_commit on that
slot's empty barrier, so the slot goes back to the load warp when the tensor cores are done reading it.
Rings (fused_sm90.py's InputRing, GateRing, TermRing): the inputs (q, k, v; ready when the TMA bytes land; empty
once the state's MMAs and the norms partition have read them: the aux's reads are over before it publishes the
chunk's terms, fused_sm90.chunk_rings), the gates (load -> aux, which adds rk) and the chunk terms (Tv, P, row
scalings; aux -> state).
TMEM, all 512 columns: S 128, its 16-bit copy 64 (whose columns then hold the 16-bit kh, then v_new, and v_dec),
S k^T then v_new P^T 64, S q^T 64, v_new 64; the aux's k k^T (then the inverse's accumulator) and q k^T 64 each.
Shared memory (203 KB): inputs 2 x 48 KB, terms 2 x 18 KB, gates 2.5 KB, the inverse's two fp32 operand tiles
32 KB, o staging 2 x 16 KB.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory,
                                                                  fence_async_shared, get_tmem_reg_layout,
                                                                  mbarrier, tcgen05_commit, tcgen05_mma,
                                                                  tensor_memory_descriptor, tma)
from triton.language.core import _aggregate as aggregate

from . import FUSED_HAS_H0 as _HAS_H0, FUSED_STORE_HT as _STORE_HT
from .common import (Checkpoints, GateSource, load_state_tile, loop_variant, mbarriers, sequence_and_head,
                     sequence_bounds, state_io_layout, store_state_tile)
from .fused_sm90 import (GATE_IN_KERNEL, HEAD_MAJOR, K_SCALE, L2NORM, LOAD_REGS, LOAD_WARPS, NORMS_WARPS, NUM_SLOTS,
                         O_SCALE, V_SCALE, _load_partition, _norms_partition, chunk_decay, chunk_rings, head_tiles,
                         publish_inverse, publish_key_norms, publish_row_scalings, state_slot)
from .inverse_sm100 import unit_lower_inverse

HAS_H0 = gl.constexpr(_HAS_H0)
STORE_HT = gl.constexpr(_STORE_HT)

AUX_REGS = gl.constexpr(192)
STATE_WARPS = gl.constexpr(8)


@aggregate
class StateTmem:
    """The state partition's tensor memory and MMA barriers; [V, *] tiles, one V row a TMEM lane.
    s: S fp32 [V, K]; s16: S in the input dtype [V, K], the A operand of S k^T and S q^T, whose columns then
    hold x16 (kh, then v_new) and vd16 (v_dec), [V, BT] A operands in the input dtype; kh: fp32 [V, BT], S k^T,
    then v_new P^T; qh: fp32 [V, BT], S q^T; vn: fp32 [V, BT], v_new. bars [4, 1]: completion of S k^T with
    S q^T (KQ_DONE), v_new (VN_DONE), v_new P^T (O_DONE), the state update (S_DONE), each once a chunk."""
    s: tensor_memory_descriptor
    s16: tensor_memory_descriptor
    x16: tensor_memory_descriptor
    vd16: tensor_memory_descriptor
    kh: tensor_memory_descriptor
    qh: tensor_memory_descriptor
    vn: tensor_memory_descriptor
    bars: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, s, s16, x16, vd16, kh, qh, vn, bars):
        self.s = s
        self.s16 = s16
        self.x16 = x16
        self.vd16 = vd16
        self.kh = kh
        self.qh = qh
        self.vn = vn
        self.bars = bars


# the StateTmem barriers
KQ_DONE = gl.constexpr(0)
VN_DONE = gl.constexpr(1)
O_DONE = gl.constexpr(2)
S_DONE = gl.constexpr(3)


@aggregate
class AuxScratch:
    """The aux partition's own: k k^T and q k^T [BT, BT] fp32 in TMEM (kk is then the accumulator of the
    inverse's products), the inverse's two fp32 operand tiles in shared memory, and the barrier of its MMAs."""
    kk: tensor_memory_descriptor
    qk: tensor_memory_descriptor
    a_smem: gl.shared_memory_descriptor
    bt_smem: gl.shared_memory_descriptor
    bar: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, kk, qk, a_smem, bt_smem, bar):
        self.kk = kk
        self.qk = qk
        self.a_smem = a_smem
        self.bt_smem = bt_smem
        self.bar = bar


@gluon.jit
def _tmem_operands_ready():
    """Every warp's tcgen05.st (completed by the tcgen05.wait::st Triton emits with it) precedes the MMA that one
    thread then issues on it. A barrier suffices: the state partition's MMA operands that it writes itself are
    all in TMEM, and what it reads from shared memory was fenced by its producer (TMA, or the aux partition)."""
    gl.thread_barrier()


@gluon.jit
def _aux_partition(inputs, gates, terms, scratch, q_desc, seq_len, flags):
    """The state-independent terms of every chunk (see the module docstring), into the terms ring."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.block_type.element_ty
    reg_tt: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BT], scratch.kk.type.layout, gl.num_warps())
    rows: gl.constexpr = gl.SliceLayout(1, reg_tt)
    cols: gl.constexpr = gl.SliceLayout(0, reg_tt)
    for c in range(gl.cdiv(seq_len, BT)):
        slot = c % NUM_SLOTS
        # the row and column indices, recomputed every chunk (an opaque 0 keeps the compiler from hoisting them
        # out of the loop: held across it, they are spilled and reloaded instead)
        i = gl.expand_dims(gl.arange(0, BT, rows), 1) + loop_variant(0, c)
        j = gl.expand_dims(gl.arange(0, BT, cols), 0) + loop_variant(0, c)
        phase = c & 1  # scratch.bar completes five times a chunk: k k^T with q k^T, then the inverse's four
        # --- k k^T and q k^T on the tensor cores; rk from the diagonal of k k^T, then the decay matrix
        # (the input and gate slots are freed by the terms' publication: fused_sm90.chunk_rings)
        inputs.bars.wait_ready(c)
        k_s = inputs.k.index(slot)
        tcgen05_mma(k_s, k_s.permute((1, 0)), scratch.kk, use_acc=False)
        tcgen05_mma(inputs.q.index(slot), k_s.permute((1, 0)), scratch.qk, use_acc=False)
        tcgen05_commit(scratch.bar)
        gates.bars.wait_ready(c)
        mbarrier.wait(scratch.bar, phase)
        publish_key_norms(gates, c, scratch.kk.load(reg_tt), (flags & L2NORM) != 0)
        gam_r = gates.gam.index(slot).load(rows)
        decay = chunk_decay(gates, c, gam_r, i >= j, seq_len - c * BT, cols)
        kk = scratch.kk.load(reg_tt)  # again: k k^T stays in TMEM, and its registers are free during the decay
        qk = scratch.qk.load(reg_tt)

        # --- the row scalings and P go out first, so that only A is live through the inverse
        terms.bars.wait_empty(c)
        a_rows = publish_row_scalings(terms, gates, c, seq_len, rows)
        terms.p.index(slot).store((qk * decay).to(dtype))
        a = gl.where(i > j, kk * decay * gl.expand_dims(a_rows, 1), 0.0)
        # kk's TMEM is the products' accumulator: every warp has read k k^T (the inverse starts with a barrier)
        tc, _ = unit_lower_inverse(a, scratch.a_smem, scratch.bt_smem, scratch.kk, reg_tt, scratch.bar, phase ^ 1)
        publish_inverse(terms, c, tc, dtype)
        fence_async_shared()
        terms.bars.publish(c)


@gluon.jit
def _state_partition(st, inputs, terms, o_desc, o_stage, seq_len, checkpoints):
    """The recurrence and the outputs (see the module docstring); the state stays in st.s. The checkpoint a chunk
    ends on is written at the start of the next chunk, from the registers that copy S to s16 (written later, or
    after the chunk's products are issued, ptxas spills in the 24-register load partition); the last chunk's with
    the final state."""
    BT: gl.constexpr = o_desc.block_type.shape[0]
    V: gl.constexpr = st.s.shape[0]
    K: gl.constexpr = st.s.shape[1]
    dtype: gl.constexpr = o_desc.block_type.element_ty
    reg_vk: gl.constexpr = get_tmem_reg_layout(gl.float32, [V, K], st.s.type.layout, STATE_WARPS)
    reg_vt: gl.constexpr = get_tmem_reg_layout(gl.float32, [V, BT], st.kh.type.layout, STATE_WARPS)
    cols: gl.constexpr = gl.SliceLayout(0, reg_vt)
    # (the 16-bit TMEM tiles' tcgen05.st layouts are reg_vk's and reg_vt's: the fp32 values convert in place)
    for c in range(gl.cdiv(seq_len, BT)):
        slot = c % NUM_SLOTS
        phase = c & 1  # each of st.bars completes once a chunk
        inputs.bars.wait_ready(c)
        q_s = inputs.q.index(slot)
        k_s = inputs.k.index(slot)
        # --- kh = S k^T (critical path) and S q^T (beside it), from S's 16-bit copy in TMEM
        s = st.s.load(reg_vk)
        st.s16.store(s.to(dtype))
        checkpoints.store_after(gl.permute(s, [1, 0]), c - 1, seq_len, 0)  # S after chunk c - 1, as h
        _tmem_operands_ready()
        tcgen05_mma(st.s16, k_s.permute((1, 0)), st.kh, use_acc=False)
        tcgen05_mma(st.s16, q_s.permute((1, 0)), st.qh, use_acc=False)
        tcgen05_commit(st.bars.index(KQ_DONE))

        # --- v_new = v^T Tv^T + (kh diag(-e^gam rk)) Tv^T: the first product reads v^T straight from its TMA tile
        # and runs while kh does; kh's column scaling rides in its copy to 16 bits
        terms.bars.wait_ready(c)
        tcgen05_mma(inputs.v.index(slot).permute((1, 0)), terms.tc_v.index(slot).permute((1, 0)), st.vn,
                    use_acc=False)
        mbarrier.wait(st.bars.index(KQ_DONE), phase)
        k_scale = terms.scaling(c, K_SCALE).load(cols)
        st.x16.store((st.kh.load(reg_vt) * gl.expand_dims(k_scale, 0)).to(dtype))
        _tmem_operands_ready()
        tcgen05_mma(st.x16, terms.tc_v.index(slot).permute((1, 0)), st.vn, use_acc=True)
        tcgen05_commit(st.bars.index(VN_DONE))
        # e^gl S while the tensor cores compute v_new (no MMA in flight touches st.s)
        state_decay = terms.state_decay(c)
        st.s.store(st.s.load(reg_vk) * state_decay)
        v_scale = terms.scaling(c, V_SCALE).load(cols)
        mbarrier.wait(st.bars.index(VN_DONE), phase)

        # --- v_new P^T, and S = e^gl S + v_new diag(e^(gl - gam) rk) k accumulated onto the decayed S; the
        # state update is the last reader of the input slot
        v_new = st.vn.load(reg_vt)
        st.x16.store(v_new.to(dtype))
        st.vd16.store((v_new * gl.expand_dims(v_scale, 0)).to(dtype))
        _tmem_operands_ready()
        tcgen05_mma(st.x16, terms.p.index(slot).permute((1, 0)), st.kh, use_acc=False)
        tcgen05_commit(st.bars.index(O_DONE))
        tcgen05_mma(st.vd16, k_s, st.s, use_acc=True)
        tcgen05_commit(st.bars.index(S_DONE))
        tcgen05_commit(inputs.bars.empty.index(slot))

        # --- o = ((S q^T) diag(e^gam) + v_new P^T) diag(scale rq) while the state updates; o^T -> [BT, V] staging
        # tile -> HBM, two tiles, so the store of chunk c - 1 may still be in flight
        o_scale = terms.scaling(c, O_SCALE).load(cols)
        mbarrier.wait(st.bars.index(O_DONE), phase)
        o = st.qh.load(reg_vt) * gl.expand_dims(o_scale, 0) + st.kh.load(reg_vt)
        terms.bars.release(c)
        terms.rq_bars.wait_ready(c)
        o = o * gl.expand_dims(terms.rq.index(slot).load(cols), 0)
        terms.rq_bars.release(c)
        o_smem = o_stage.index(c % 2)
        tma.store_wait(1)
        gl.thread_barrier()
        o_smem.permute((1, 0)).store(o.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_smem)
        mbarrier.wait(st.bars.index(S_DONE), phase)
    tma.store_wait(0)


@gluon.jit
def fused_kernel(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, h0, ht, state_indices, o, scale, T, H, HV, flags,
                 state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens,
                 exchange_tiles, exchange_scalings, exchange_counters,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, IS_VARLEN: gl.constexpr,
                 TRANSPOSE_STATE: gl.constexpr, GATING: gl.constexpr, CHECKPOINTS: gl.constexpr,
                 TERMS_PROGRAM: gl.constexpr, num_warps: gl.constexpr):
    # the exchange parameters are gdn_fused_terms' (the launcher ABI's gdn_fused parameters), sm_90a only
    gl.static_assert(not TERMS_PROGRAM, "no terms programs on sm_100a: its one program a value head computes the terms")
    gl.static_assert(num_warps == STATE_WARPS, "the default partition is the two state warpgroups")
    gl.static_assert(BV == V, "no V tiles: the state's V rows fill the 128 TMEM lanes of one tcgen05 M = 128")
    gl.static_assert(BT == 64, "one warpgroup owns a chunk's 64 rows in the aux partition (tcgen05 M = 64)")
    gl.static_assert(V == 128, "S's V rows are the 128 TMEM lanes (tcgen05 M = 128)")
    dtype: gl.constexpr = q.dtype.element_ty
    i_n, i_hv = sequence_and_head(HV, HEAD_MAJOR)  # a sequence's heads start together
    i_h = i_hv // (HV // H)
    bos, seq_len = sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN)

    # --- tensor memory (module docstring); [V, *] tiles put one V row in each lane
    tm_vk: gl.constexpr = TensorMemoryLayout(block=(V, K), col_stride=1)
    tm_vt: gl.constexpr = TensorMemoryLayout(block=(V, BT), col_stride=1)
    tm_tt: gl.constexpr = TensorMemoryLayout(block=(BT, BT), col_stride=1)
    state_bars = mbarriers(4, 1)
    s16 = allocate_tensor_memory(dtype, [V, K], tm_vk)
    st = StateTmem(allocate_tensor_memory(gl.float32, [V, K], tm_vk), s16, s16.slice(0, BT), s16.slice(BT, BT),
                   allocate_tensor_memory(gl.float32, [V, BT], tm_vt),
                   allocate_tensor_memory(gl.float32, [V, BT], tm_vt),
                   allocate_tensor_memory(gl.float32, [V, BT], tm_vt), state_bars)

    # --- the state S = h^T [V, K] into TMEM
    reg_vk: gl.constexpr = get_tmem_reg_layout(gl.float32, [V, K], tm_vk, num_warps)
    io: gl.constexpr = state_io_layout(K, V, TRANSPOSE_STATE, num_warps)
    slot = state_slot(i_n, state_indices, flags)
    h = load_state_tile(h0, slot, i_hv, 0, HV, ((flags & HAS_H0) != 0) & (slot >= 0), K, V, V, TRANSPOSE_STATE, io)
    st.s.store(gl.convert_layout(gl.permute(h, [1, 0]), reg_vk))

    gate_source = GateSource.make(g + i_hv, beta + i_hv, A_log, dt_bias, i_hv, flags, GATING, GATE_IN_KERNEL)
    q_desc, k_desc, v_desc, o_desc, gate_source = head_tiles(q, k, v, o, gate_source, bos, seq_len, i_h, i_hv, 0, H,
                                                             HV, K, V, V, BT)
    # --- shared memory: the rings (the state's MMAs empty an input slot), the aux's scratch, the output staging
    inputs, gates, terms = chunk_rings(q_desc, k_desc, v_desc)
    f32_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
    aux_bar = mbarriers(1, 1)
    scratch = AuxScratch(allocate_tensor_memory(gl.float32, [BT, BT], tm_tt),
                         allocate_tensor_memory(gl.float32, [BT, BT], tm_tt),
                         gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt),
                         gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt), aux_bar.index(0))
    o_stage = gl.allocate_shared_memory(dtype, [2, BT, V], o_desc.layout)
    checkpoints = Checkpoints(state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens, HV,
                              BT, V, TRANSPOSE_STATE, CHECKPOINTS, HEAD_MAJOR)

    gl.warp_specialize([
        (_state_partition, (st, inputs, terms, o_desc, o_stage, seq_len, checkpoints)),
        (_aux_partition, (inputs, gates, terms, scratch, q_desc, seq_len, flags)),
        (_load_partition, (inputs, gates, terms, q_desc, k_desc, v_desc, gate_source, seq_len, HV)),
        (_norms_partition, (inputs, terms, q_desc, seq_len, scale, flags, False)),
    ], [4, LOAD_WARPS, NORMS_WARPS], [AUX_REGS, LOAD_REGS, LOAD_REGS])
    # the last state update has completed (the state partition waited for it)
    h_final = gl.permute(st.s.load(reg_vk), [1, 0])
    store_state_tile(ht, h_final, slot, i_hv, 0, HV, ((flags & STORE_HT) != 0) & (slot >= 0), K, V, V,
                     TRANSPOSE_STATE)
    checkpoints.store_after(h_final, gl.cdiv(seq_len, BT) - 1, seq_len, 0)
