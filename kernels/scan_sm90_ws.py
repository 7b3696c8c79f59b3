"""gdn_scan for Hopper (sm_90a), warp-specialised: the state recurrence and the chunk outputs on separate warps.

Same program, grid, arguments and math as scan_sm90.py (steps 4-5 of docs/algorithm.md); one program per
(sequence, value head, V tile) walks the chunks in order. What a single warpgroup did in sequence is split
between partitions that meet at mbarriers over two-slot shared-memory rings (TileRing below; chunk c in slot
c % 2, phase (c // 2) & 1):
  * state (the default partition, 4 warps): h -> w h -> v_new = u - w h -> h = e^gam_last h + k^T v_dec.
    Only this chain is serial from chunk to chunk, and nothing else issues from its warps (~290 instructions
    a chunk, against ~1,050 for the single-warpgroup scan);
  * output (two partitions of 4 warps, even and odd chunks): q k^T masked by the decay, q h from the h slot the
    state partition published, then o = scale e^gam (q h) + P v_new, out by TMA. One output partition takes
    about twice the state chain's time a chunk (docs/performance.md: the masked exponentials), so two
    alternate and chunk c's output overlaps the state steps of c + 1 and c + 2;
  * load (1 warp): TMA of q, k, w, u, two chunks ahead of their consumers.
Each warp scheduler interleaves warps of all three instead of exposing every instruction's latency of one warp.
One program an SM (144 KB at BV 32, 189 KB at BV 64): meant for batches whose grid fits one wave.
Rings: q/k (released by the state and the chunk's output partition: two consumers), w, u (state), h (written
by state, read by both, released by output), v_new (written by state, read by output). v_dec and the o staging
tiles are private.
Registers: the kernel is compiled at 128 a thread (16 warps, a full register file); setmaxnreg gives each
output partition OUTPUT_REGS, the load warp 24 and the state partition the rest (168).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from .common import (causal_decay, chunk_row_scalings, chunk_rows, exp_ftz, row_data_rows, row_data_start,
                     wgmma_layout)
from .fused_sm90 import NUM_SLOTS, SlotBarriers

OUTPUT_REGS = gl.constexpr(160)
LOAD_REGS = gl.constexpr(24)


@aggregate
class TileRing:
    """A ring of NUM_SLOTS tiles [NUM_SLOTS, ...] and its ready / empty barriers."""
    tiles: gl.shared_memory_descriptor
    bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, tiles, bars):
        self.tiles = tiles
        self.bars = bars

    @gluon.jit
    def of_tiles(desc, consumers: gl.constexpr):
        """A ring of the TMA descriptor's tiles (in its layout), filled by one producer."""
        BR: gl.constexpr = desc.block_type.shape[0]
        BC: gl.constexpr = desc.block_type.shape[1]
        return TileRing(gl.allocate_shared_memory(desc.block_type.element_ty, [NUM_SLOTS, BR, BC], desc.layout),
                        SlotBarriers.make(1, consumers))

    @gluon.jit
    def slot(self, c):
        return self.tiles.index(c % NUM_SLOTS)

    @gluon.jit
    def done_with(self, c):
        """One arrive on the empty barrier of chunk c's slot: its consumer (one thread for the partition, once
        every warp's read of the slot is done: after the wgmma that read it, or a partition barrier) is done with
        it."""
        mbarrier.arrive(self.bars.empty.index(c % NUM_SLOTS), count=1)


@aggregate
class ScanRings:
    """The rings between the partitions (module docstring); k's [NUM_SLOTS, BT, K] tiles land with q's, on the
    q ring's barriers."""
    q: TileRing
    k: gl.shared_memory_descriptor
    w: TileRing
    u: TileRing
    h: TileRing
    v_new: TileRing

    @gluon.constexpr_function
    def __init__(self, q, k, w, u, h, v_new):
        self.q = q
        self.k = k
        self.w = w
        self.u = u
        self.h = h
        self.v_new = v_new


@aggregate
class RowData:
    """Where the sequence's per-row data (gdn_prepare's gam, qg, kg: common.row_data_start) of the program's value
    head start, and the sequence's length."""
    gam: gl.tensor
    qg: gl.tensor
    kg: gl.tensor
    seq_len: gl.tensor

    @gluon.constexpr_function
    def __init__(self, gam, qg, kg, seq_len):
        self.gam = gam
        self.qg = qg
        self.kg = kg
        self.seq_len = seq_len

    @gluon.jit
    def of_value_head(gam, qg, kg, i_hv, row0, seq_len, T, IS_VARLEN: gl.constexpr):
        """The row data of value head i_hv from the sequence's first row row0 on (gdn_scan's grid: a program's
        first axis counts the sequences, so a fixed-length batch has num_programs(0) of T rows)."""
        start = row_data_start(i_hv, row0, row_data_rows(T, gl.num_programs(0), IS_VARLEN))
        return RowData(gam + start, qg + start, kg + start, seq_len)

    @gluon.jit
    def chunk(self, c, BT: gl.constexpr, rows_layout: gl.constexpr, cols_layout: gl.constexpr):
        """Chunk c's (qg rows, kg rows, kg columns, gam_last); zeros from c = n_chunks on."""
        return chunk_rows(self.gam, self.qg, self.kg, c, self.seq_len, BT, rows_layout, cols_layout)


@gluon.jit
def load_partition(rings, q_desc, k_desc, w_desc, u_desc, n_chunks):
    """q, k, w, u of every chunk into their rings (the load warp of both arches' warp-specialised scans)."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    for c in range(n_chunks):
        row = c * BT
        rings.q.bars.wait_empty(c)
        qk_ready = rings.q.bars.ready_bar(c)
        mbarrier.expect(qk_ready, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], qk_ready, rings.q.slot(c))
        tma.async_copy_global_to_shared(k_desc, [row, 0], qk_ready, rings.k.index(c % NUM_SLOTS))
        rings.w.bars.wait_empty(c)
        mbarrier.expect(rings.w.bars.ready_bar(c), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row, 0], rings.w.bars.ready_bar(c), rings.w.slot(c))
        rings.u.bars.wait_empty(c)
        mbarrier.expect(rings.u.bars.ready_bar(c), u_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(u_desc, [row, 0], rings.u.bars.ready_bar(c), rings.u.slot(c))


@gluon.jit
def _output_partition(parity, rings, o_smem, o_desc, row_data, n_chunks, scale):
    """Outputs of the chunks c = parity, parity + 2, ...: two of these partitions take turns."""
    BT: gl.constexpr = o_desc.block_type.shape[0]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    dtype: gl.constexpr = o_desc.block_type.element_ty
    acc_tv: gl.constexpr = wgmma_layout(BT, BV, 4)
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    rows_tv: gl.constexpr = gl.SliceLayout(1, acc_tv)
    cols_tt: gl.constexpr = gl.SliceLayout(0, acc_tt)
    for c in range(parity, n_chunks, 2):
        qg_r, kg_r, kg_c, gam_last = row_data.chunk(c, BT, rows_tv, cols_tt)
        o_scale, _, decay_rows, _ = chunk_row_scalings(qg_r, kg_r, gam_last, scale, gl.SliceLayout(1, acc_tt))
        q_s = rings.q.slot(c)
        rings.q.bars.wait_ready(c)
        scores = warpgroup_mma(q_s, rings.k.index(c % NUM_SLOTS).permute((1, 0)),
                               gl.zeros([BT, BT], gl.float32, acc_tt), use_acc=False, is_async=True)
        decay = causal_decay(decay_rows, kg_c, row_data.seq_len - c * BT, STRICT=False)
        rings.h.bars.wait_ready(c)
        q_h = warpgroup_mma(q_s, rings.h.slot(c), gl.zeros([BT, BV], gl.float32, acc_tv), use_acc=False,
                            is_async=True)
        scores, q_h = warpgroup_mma_wait(0, deps=[scores, q_h])
        rings.h.done_with(c)
        rings.q.done_with(c)
        p = (scores * decay).to(dtype)
        rings.v_new.bars.wait_ready(c)
        o = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(0, acc_tv, 2)), rings.v_new.slot(c),
                          q_h * gl.expand_dims(o_scale, 1))
        rings.v_new.done_with(c)
        tma.store_wait(0)  # the previous chunk's o has left o_smem (the issuing thread waits, then all)
        gl.thread_barrier()
        o_smem.store(o.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_smem)
    tma.store_wait(0)


@gluon.jit
def _state_partition(h, rings, v_dec_smem, row_data, n_chunks, checkpoints, i_v):
    """The recurrence; returns the final state and writes the checkpoints of V tile i_v (the only fp32 copy of
    the state is this partition's)."""
    BT: gl.constexpr = v_dec_smem.shape[0]
    BV: gl.constexpr = v_dec_smem.shape[1]
    dtype: gl.constexpr = v_dec_smem.dtype
    acc_tv: gl.constexpr = wgmma_layout(BT, BV, 4)
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    for c in range(n_chunks):
        _, kg_r, _, gam_last = row_data.chunk(c, BT, gl.SliceLayout(1, acc_tv), gl.SliceLayout(0, acc_tt))
        # publish h_c: read by w h here and by q h in the output partition
        rings.h.bars.wait_empty(c)
        rings.h.slot(c).store(h.to(dtype))
        fence_async_shared()
        rings.h.bars.publish(c)
        rings.w.bars.wait_ready(c)
        w_h = warpgroup_mma(rings.w.slot(c), rings.h.slot(c), gl.zeros([BT, BV], gl.float32, acc_tv),
                            use_acc=False)
        rings.w.done_with(c)
        rings.u.bars.wait_ready(c)
        v_new = rings.u.slot(c).load(acc_tv).to(gl.float32) - w_h
        fence_async_shared()  # the load of u is ordered before the TMA that refills the slot
        rings.u.done_with(c)
        # v_new for the output partition, v_dec = e^(gam_last - kg) v_new for the state update
        rings.v_new.bars.wait_empty(c)
        rings.v_new.slot(c).store(v_new.to(dtype))
        v_dec_smem.store((v_new * gl.expand_dims(exp_ftz(gam_last - kg_r), 1)).to(dtype))
        fence_async_shared()
        rings.v_new.bars.publish(c)
        rings.q.bars.wait_ready(c)
        h = warpgroup_mma(rings.k.index(c % NUM_SLOTS).permute((1, 0)), v_dec_smem, h * exp_ftz(gam_last))
        rings.q.done_with(c)
        checkpoints.store_after(h, c, row_data.seq_len, i_v)
    return (h, )


@gluon.jit
def scan_chunks_warp_specialized(h, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc, row_data, scale, checkpoints,
                                 i_v):
    """The chunk loop of gdn_scan split over the partitions above (called by scan_sm90.scan_kernel with 4 warps,
    the state partition's); returns the final state (and writes the checkpoints of V tile i_v)."""
    gl.static_assert(gl.num_warps() == 4, "the state partition is one warpgroup")
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dtype)
    rings = ScanRings(TileRing.of_tiles(q_desc, 2),
                      gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], k_desc.layout),
                      TileRing.of_tiles(w_desc, 1),
                      TileRing.of_tiles(u_desc, 1),
                      # h: the state's own w h is waited on before it moves on, so only the output partition
                      # of the chunk releases a slot
                      TileRing(gl.allocate_shared_memory(dtype, [NUM_SLOTS, K, BV], h_layout), SlotBarriers.make(1, 1)),
                      TileRing.of_tiles(o_desc, 1))  # v_new: [BT, BV] tiles as o's
    v_dec_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)
    o_tiles = gl.allocate_shared_memory(dtype, [2, BT, BV], o_desc.layout)  # one per output partition
    h_final = gl.warp_specialize([
        (_state_partition, (h, rings, v_dec_smem, row_data, n_chunks, checkpoints, i_v)),
        (_output_partition, (0, rings, o_tiles.index(0), o_desc, row_data, n_chunks, scale)),
        (_output_partition, (1, rings, o_tiles.index(1), o_desc, row_data, n_chunks, scale)),
        (load_partition, (rings, q_desc, k_desc, w_desc, u_desc, n_chunks)),
    ], [4, 4, 1], [OUTPUT_REGS, OUTPUT_REGS, LOAD_REGS])
    return h_final[0]
