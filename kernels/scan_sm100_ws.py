"""gdn_scan for Blackwell (sm_100a), warp-specialised: the state recurrence and the chunk outputs on separate warps.

The sm_100a counterpart of scan_sm90_ws.py: same program, grid, arguments and math as scan_sm100.py (steps 4-5
of docs/algorithm.md), one program per (sequence, value head, V tile) walking the chunks in order, meant for
batches whose grid fits one wave. What the single-partition kernel does in sequence is split between partitions
that meet at mbarriers over two-slot rings (scan_sm90_ws.TileRing; slot c % 2, phase (c // 2) & 1):
  * state (the default partition, 4 warps): the serial chain h -> w h -> v_new = u - w h -> h = e^gam_last h +
    k^T v_dec and nothing else. h [K, BV] fp32 stays in tensor memory (TMEM, K rows on the 128 lanes) as the
    accumulator of the k^T v_dec update, as in scan_sm100.py; once a chunk it passes through registers in [K, 64]
    column slices, which write its 16-bit copy into the h ring (the B operand of w h here and of q h in the output
    partition) and put e^gam_last h back, so the update is one accumulating MMA;
  * output (two partitions of 4 warps, even and odd chunks): q k^T and q h into their own TMEM accumulators, the
    scores masked by the decay (common.causal_decay_bitmask) into a 16-bit P tile, P v_new, then
    o = scale e^gam (q h) + P v_new out by TMA (a sequence's partial last chunk by tma.async_scatter, rows past
    the end skipped). One output partition needs about two state steps a chunk (the masked exponentials), so two
    alternate and chunk c's output overlaps the state steps of c + 1 and c + 2;
  * load (1 warp): TMA (UTMALDG) of q, k, w, u up to two chunks ahead of their consumers.
Units: the tensor cores run every product as a tcgen05 MMA (UTCHMMA) issued by one thread of its partition after
a partition barrier, from NVMMA shared memory into TMEM; tcgen05_commit signals completion on an mbarrier, and on
the empty barriers of the ring slots the MMA read, so a slot goes back to its producer when the tensor cores are
done with it (not when the issuing warps are). Results come back with tcgen05.ld (LDTM).
Rings: q/k (load -> state's update and output's q k^T, q h: two consumers), w and u (load -> state), h (state ->
state's w h and output's q h: two consumers), v_new (state -> output). v_dec is private to the state partition
(its update MMA is waited on before the next chunk writes it); each output partition has its own P and o tiles.
BV = 64 only (sm_100a's scan runs BV >= 64, and one wave wants the smallest). TMEM: h [K, 64] fp32 (64 columns,
K on the 128 lanes); w h and, per output partition, q h and q k^T (then P v_new, in the same columns: the scores
are in registers by then), M = 64 tiles that Triton packs two to a 64-column block: 256 of the 512 columns.
Shared memory: q, k, w rings 3 x 32 KB, u and v_new rings 2 x 16 KB, the h ring 32 KB (the caller's), v_dec 8 KB,
P and o tiles 2 x 2 x 8 KB: 201 KB, one program an SM.
Registers: compiled at 128 a thread (16 warps, a full register file); setmaxnreg gives each output partition
OUTPUT_REGS, the load warp LOAD_REGS and the state partition the rest (184).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory,
                                                                  fence_async_shared, get_tmem_reg_layout,
                                                                  mbarrier, tcgen05_commit, tcgen05_mma, tma)

from .common import causal_decay_bitmask, chunk_row_scalings, exp_ftz, mbarriers
from .fused_sm90 import NUM_SLOTS, SlotBarriers
from .scan_sm90_ws import ScanRings, TileRing, load_partition

OUTPUT_REGS = gl.constexpr(152)
LOAD_REGS = gl.constexpr(24)
ROW_SKIP = gl.constexpr(0x7FFFFFFF)  # async_scatter row offset that the TMA unit skips (out of range)


@gluon.jit
def release_when_read(ring, c):
    """The slot of chunk c goes back to its producer once the MMAs issued so far have completed."""
    tcgen05_commit(ring.bars.empty.index(c % NUM_SLOTS))


@gluon.jit
def operands_ready():
    """Every warp (of the partition) has written its shared memory (fenced for the async proxy) and TMEM
    (tcgen05.st, completed by the tcgen05.wait::st emitted with it) before one thread issues an MMA or a TMA store
    on them."""
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def store_chunk_output(o, o_smem, o_desc, o_all_desc, c, n_rows, bos, o_col):
    """o [BT, BV] of chunk c out by TMA through o_smem, once the previous chunk's has left it: a whole chunk through
    the sequence's descriptor, the sequence's partial last one by tma.async_scatter over the packed o (row offsets
    from the sequence's first row bos, rows past its end skipped), at column o_col."""
    BT: gl.constexpr = o_desc.block_type.shape[0]
    tma.store_wait(0)  # (the issuing thread waits, then all)
    gl.thread_barrier()
    o_smem.store(o.to(o_smem.dtype))
    operands_ready()
    if n_rows >= BT:
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_smem)
    else:
        rows = gl.arange(0, BT, gl.SliceLayout(0, gl.BlockedLayout([1, 4], [32, 1], [1, gl.num_warps()], [1, 0])))
        tma.async_scatter(o_all_desc, gl.where(rows < n_rows, bos + c * BT + rows, ROW_SKIP), o_col, o_smem)


@gluon.jit
def _output_partition(parity, rings, tmem, bars, p_smem, o_smem, o_desc, o_all_desc, row_data, bos, o_col,
                      n_chunks, scale):
    """Outputs of the chunks c = parity, parity + 2, ...: two of these partitions take turns. tmem: q h and
    q k^T (then P v_new) [BT, BV] fp32; bars: q k^T with q h, then P v_new, each once a chunk of this partition."""
    BT: gl.constexpr = o_desc.block_type.shape[0]
    dtype: gl.constexpr = o_desc.block_type.element_ty
    qh_tmem = tmem.index(0)
    s_tmem = tmem.index(1)
    reg_tt: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BT], s_tmem.type.layout, gl.num_warps())
    rows_tt: gl.constexpr = gl.SliceLayout(1, reg_tt)
    for c in range(parity, n_chunks, 2):
        phase = (c // 2) & 1
        n_rows = row_data.seq_len - c * BT
        qg_r, kg_r, kg_c, gam_last = row_data.chunk(c, BT, rows_tt, gl.SliceLayout(0, reg_tt))
        o_scale, _, decay_rows, _ = chunk_row_scalings(qg_r, kg_r, gam_last, scale, rows_tt)
        q_s = rings.q.slot(c)
        rings.q.bars.wait_ready(c)
        tcgen05_mma(q_s, rings.k.index(c % NUM_SLOTS).permute((1, 0)), s_tmem, use_acc=False)
        rings.h.bars.wait_ready(c)
        tcgen05_mma(q_s, rings.h.slot(c), qh_tmem, use_acc=False)
        tcgen05_commit(bars.index(0))
        release_when_read(rings.q, c)
        release_when_read(rings.h, c)
        decay = causal_decay_bitmask(decay_rows, kg_c, n_rows, STRICT=False)
        mbarrier.wait(bars.index(0), phase)
        p_smem.store((s_tmem.load(reg_tt) * decay).to(dtype))
        operands_ready()  # (also: every warp has read the scores before P v_new overwrites them)
        rings.v_new.bars.wait_ready(c)
        tcgen05_mma(p_smem, rings.v_new.slot(c), s_tmem, use_acc=False)
        tcgen05_commit(bars.index(1))
        release_when_read(rings.v_new, c)
        mbarrier.wait(bars.index(1), phase)
        o = qh_tmem.load(reg_tt) * gl.expand_dims(o_scale, 1) + s_tmem.load(reg_tt)
        store_chunk_output(o, o_smem, o_desc, o_all_desc, c, n_rows, bos, o_col)
    tma.store_wait(0)


@gluon.jit
def _state_partition(h_tmem, wh_tmem, bars, rings, v_dec_smem, row_data, n_chunks, checkpoints, i_v):
    """The recurrence on h_tmem; bars: w h, then the update, each once a chunk. The checkpoint chunk c - 1 ended
    on is written from the registers that copy h into the h ring at the start of chunk c (the last chunk's is the
    caller's)."""
    K: gl.constexpr = h_tmem.shape[0]
    BV: gl.constexpr = h_tmem.shape[1]
    BT: gl.constexpr = wh_tmem.shape[0]
    dtype: gl.constexpr = v_dec_smem.dtype
    reg_tv: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BV], wh_tmem.type.layout, gl.num_warps())
    reg_kv: gl.constexpr = get_tmem_reg_layout(gl.float32, [K, BV], h_tmem.type.layout, gl.num_warps())
    rows_tv: gl.constexpr = gl.SliceLayout(1, reg_tv)
    for c in range(n_chunks):
        phase = c & 1
        _, kg_r, _, gam_last = row_data.chunk(c, BT, rows_tv, gl.SliceLayout(0, reg_tv))
        v_dec_scale = exp_ftz(gam_last - kg_r)
        # h_c into the h ring (for w h here and q h there); e^gam_last h_c back into TMEM, where the update of
        # this chunk accumulates onto it
        rings.h.bars.wait_empty(c)
        h = h_tmem.load(reg_kv)
        checkpoints.store_after(h, c - 1, row_data.seq_len, i_v)
        rings.h.slot(c).store(h.to(dtype))
        h_tmem.store(h * exp_ftz(gam_last))
        operands_ready()
        mbarrier.arrive(rings.h.bars.ready_bar(c), count=1)
        rings.w.bars.wait_ready(c)
        tcgen05_mma(rings.w.slot(c), rings.h.slot(c), wh_tmem, use_acc=False)
        tcgen05_commit(bars.index(0))
        release_when_read(rings.w, c)
        release_when_read(rings.h, c)
        # v_new = u - w h for the output partition; v_dec = e^(gam_last - kg) v_new for the update
        rings.u.bars.wait_ready(c)
        u = rings.u.slot(c).load(reg_tv).to(gl.float32)
        mbarrier.wait(bars.index(0), phase)
        v_new = u - wh_tmem.load(reg_tv)
        rings.v_new.bars.wait_empty(c)
        rings.v_new.slot(c).store(v_new.to(dtype))
        v_dec_smem.store((v_new * gl.expand_dims(v_dec_scale, 1)).to(dtype))
        operands_ready()  # also orders every warp's read of u before the TMA that refills its slot
        mbarrier.arrive(rings.v_new.bars.ready_bar(c), count=1)
        rings.u.done_with(c)
        rings.q.bars.wait_ready(c)
        tcgen05_mma(rings.k.index(c % NUM_SLOTS).permute((1, 0)), v_dec_smem, h_tmem, use_acc=True)
        tcgen05_commit(bars.index(1))
        release_when_read(rings.q, c)
        mbarrier.wait(bars.index(1), phase)


@gluon.jit
def scan_chunks_warp_specialized(h_tmem, h_ring_tiles, n_chunks, q_desc, k_desc, w_desc, u_desc, o_desc,
                                 o_all_desc, bos, o_col, row_data, scale, checkpoints, i_v):
    """The chunk loop of gdn_scan split over the partitions above (called by scan_sm100.scan_kernel with 4 warps,
    the state partition's) on the state in h_tmem; h_ring_tiles: the h ring's [NUM_SLOTS, K, BV] tiles (the
    caller's, which stages the final state in them afterwards). The state partition returns once the last chunk's
    update has completed; the chunk the sequence ends on writes its checkpoint through the caller."""
    gl.static_assert(gl.num_warps() == 4, "the state partition is one warpgroup")
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    BV: gl.constexpr = o_desc.block_type.shape[1]
    gl.static_assert(BV == BT, "P v_new reuses the scores' TMEM columns")
    tm_tv: gl.constexpr = TensorMemoryLayout(block=(BT, BV), col_stride=1)
    wh_tmem = allocate_tensor_memory(gl.float32, [BT, BV], tm_tv)
    out0_tmem = allocate_tensor_memory(gl.float32, [2, BT, BV], tm_tv)  # q h, q k^T (then P v_new)
    out1_tmem = allocate_tensor_memory(gl.float32, [2, BT, BV], tm_tv)
    rings = ScanRings(TileRing.of_tiles(q_desc, 2),
                      gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, K], k_desc.layout),
                      TileRing.of_tiles(w_desc, 1),
                      TileRing.of_tiles(u_desc, 1),
                      TileRing(h_ring_tiles, SlotBarriers.make(1, 2)),
                      TileRing.of_tiles(o_desc, 1))  # v_new: [BT, BV] tiles as o's
    v_dec_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)
    p_tiles = gl.allocate_shared_memory(dtype, [2, BT, BT], gl.NVMMASharedLayout.get_default_for([BT, BT], dtype))
    o_tiles = gl.allocate_shared_memory(dtype, [2, BT, BV], o_desc.layout)  # P and o: one tile per output partition
    gl.warp_specialize([
        (_state_partition, (h_tmem, wh_tmem, mbarriers(2, 1), rings, v_dec_smem, row_data, n_chunks, checkpoints,
                            i_v)),
        (_output_partition, (0, rings, out0_tmem, mbarriers(2, 1), p_tiles.index(0), o_tiles.index(0), o_desc,
                             o_all_desc, row_data, bos, o_col, n_chunks, scale)),
        (_output_partition, (1, rings, out1_tmem, mbarriers(2, 1), p_tiles.index(1), o_tiles.index(1), o_desc,
                             o_all_desc, row_data, bos, o_col, n_chunks, scale)),
        (load_partition, (rings, q_desc, k_desc, w_desc, u_desc, n_chunks)),
    ], [4, 4, 1], [OUTPUT_REGS, OUTPUT_REGS, LOAD_REGS])
