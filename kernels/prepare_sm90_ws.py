"""gdn_prepare for Hopper (sm_90a), warp-specialised: gdn_fused's chunk algebra on the chunk-parallel grid.

Same grid, arguments and outputs as prepare_sm90.py (steps 1-3 of docs/algorithm.md: w, u, gam, qg and kg for
gdn_scan), but persistent: the first SM-count programs of the grid (%nsmid) each stride over its
(chunk slot, key head) pairs and the rest end at once, so an SM sets up its rings and descriptors once and then
streams items (chunk, value head): for each pair, the HV / H value heads that share
the key head's k. The partitions meet at mbarriers over two-slot rings, so that the inverse of one item overlaps
the loads of the next and the products and stores of the one before:
  * aux (4 warps, AUX_REGS): k k^T (rk, the inverse norms of the k rows, is its diagonal), the decayed A and
    Tc = (I + A)^-1 by gdn_fused's blocked inverse (the diagonal 16 x 16 blocks in registers, then three fp16
    wgmma round trips); publishes Tw = Tc diag(beta e^gam rk) and Tu = Tc diag(beta), each
    rounded once to the input dtype, and rk;
  * writer (the default partition, 8 warps: w's and u's columns split over two warpgroups): gam (the gate
    ring's, back in natural log units, as gdn_scan reads it), qg = gam + ln rq (rq from the q tile) and
    kg = gam - ln rk;
    w = Tw k and u = Tu v on wgmma, every operand in shared memory; a whole chunk leaves by TMA store through
    staging tiles, a sequence's partial last chunk by masked stores (the rows after it are the next sequence's);
  * load (4 warps at LOAD_REGS): TMA of the item's q, k and v tiles into the input ring through descriptors over
    the whole batch (made once a program; rows past a sequence's end are zeroed by the algebra's masks, never
    stored), beside them the item's rows (ItemBounds), and its gates (log2 units, for the decay) into the gate
    ring. It is the only partition that reads cu_seqlens and g: the aux and writer partitions take the rows and
    gam from it (the writer waited on those loads when it made its own: docs/performance.md).
One program an SM (216 KB of shared memory): the single-warpgroup kernel runs two an SM and pays every
chunk's load latency and setup; here one chunk's inverse hides the next one's loads (docs/performance.md).
Gating variants (fla's use_gate_in_kernel, ...) are not built this way: their beta may reach 2, where the fp16
inverse overflows (the single-warpgroup kernel's inverse is tf32).
The item stream, the rings, the load partition and the writer's row terms and stores (ItemStream, item_rings,
ItemRows, ItemOutputs, _load_partition) are also sm_100a's (prepare_sm100_ws.py), which runs the same design on
Blackwell's tensor cores.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from . import PREPARE_L2NORM as _L2NORM
from .common import (LN2, LOG2E, inverse_row_norms, loop_variant, row_data_rows, row_data_start,
                     sequence_of_chunk_slot, store_rows, token_major_desc, wgmma_layout)
from .fused_sm90 import (NUM_SLOTS, InverseScratch, SlotBarriers, _publish_gates, chunk_decay, input_and_gate_rings,
                         publish_key_norms)

L2NORM = gl.constexpr(_L2NORM)
AUX_REGS = gl.constexpr(152)
LOAD_REGS = gl.constexpr(24)
LOAD_WARPS = gl.constexpr(4)


@aggregate
class ItemStream:
    """The program's items: its (chunk slot, key head) pairs q = first + i * stride, i < n_pairs, of the grid's
    n_slots x H (q = key head * n_slots + slot), each for the key head's `group` value heads; item c is pair
    c // group, value head c % group."""
    first: gl.tensor
    stride: gl.tensor
    n_items: gl.tensor
    n_slots: gl.tensor
    group: gl.tensor
    cu_seqlens: gl.tensor
    T: gl.tensor
    num_seqs: gl.tensor
    BT: gl.constexpr
    IS_VARLEN: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, first, stride, n_items, n_slots, group, cu_seqlens, T, num_seqs, BT, IS_VARLEN):
        self.first = first
        self.stride = stride
        self.n_items = n_items
        self.n_slots = n_slots
        self.group = group
        self.cu_seqlens = cu_seqlens
        self.T = T
        self.num_seqs = num_seqs
        self.BT = gl.constexpr(BT)
        self.IS_VARLEN = gl.constexpr(IS_VARLEN)

    @gluon.jit
    def item(self, c):
        """(first row, rows, key head, value head) of item c; rows <= 0: an idle slot (a varlen batch's spare
        ones). The rows come from cu_seqlens (dependent loads): the load partition looks them up, and passes them
        on through ItemBounds."""
        pair = self.pair(c)
        start, n_rows = sequence_of_chunk_slot(pair % self.n_slots, self.cu_seqlens, self.T, self.num_seqs, self.BT,
                                               self.IS_VARLEN)
        return start, n_rows, pair // self.n_slots, self.value_head(c)

    @gluon.jit
    def pair(self, c):
        """The (chunk slot, key head) pair of item c."""
        return self.first + (c // self.group) * self.stride

    @gluon.jit
    def value_head(self, c):
        """The value head of item c."""
        return (self.pair(c) // self.n_slots) * self.group + c % self.group

    @gluon.jit
    def active(self):
        """Whether this program is one of the first SM-count ones, which do all the work."""
        return self.first < self.stride


@aggregate
class ItemBounds:
    """Each item's first row and row count as the load partition found them, [2 * NUM_SLOTS, 32] int32 (every entry
    of a row the same value), on the input ring's barriers: the aux and writer partitions read them instead of
    repeating the cu_seqlens lookup, whose loads the writer waited on (docs/performance.md)."""
    rows: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, rows):
        self.rows = rows

    @gluon.jit
    def make():
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        return ItemBounds(gl.allocate_shared_memory(gl.int32, [2 * NUM_SLOTS, 32], plain))

    @gluon.jit
    def put(self, c, start, n_rows):
        """Item c's bounds into its slot, by every warp of the load partition before the arrive on the slot's ready
        barrier (the slot is free: its empty barrier was waited on)."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        zero = gl.zeros([32], gl.int32, lanes)
        self.rows.index(2 * (c % NUM_SLOTS)).store(zero + start)
        self.rows.index(2 * (c % NUM_SLOTS) + 1).store(zero + n_rows)
        gl.thread_barrier()

    @gluon.jit
    def get(self, c):
        """(first row, rows) of item c, once its input slot is ready and before it is released."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        return (gl.max(self.rows.index(2 * (c % NUM_SLOTS)).load(lanes), axis=0),
                gl.max(self.rows.index(2 * (c % NUM_SLOTS) + 1).load(lanes), axis=0))


@aggregate
class ItemTerms:
    """What the writer takes for an item from the aux partition: Tw = Tc diag(beta e^gam rk) and
    Tu = Tc diag(beta), [NUM_SLOTS, BT, BT] in the input dtype (w = Tw k, u = Tu v), and rk [NUM_SLOTS, BT]
    fp32 (kg's)."""
    tw: gl.shared_memory_descriptor
    tu: gl.shared_memory_descriptor
    rk: gl.shared_memory_descriptor
    bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, tw, tu, rk, bars):
        self.tw = tw
        self.tu = tu
        self.rk = rk
        self.bars = bars


@aggregate
class ItemRows:
    """The writer's row terms of an item, [BT] in a layout that holds every row in every warp (so the cumsum is a
    warp scan): the rows' element offsets in the row data (common.row_data_start), the mask of the item's own
    rows, gam = cumsum(g) (natural log units, as gdn_scan reads it) and ln rq."""
    dest: gl.tensor
    live: gl.tensor
    gam: gl.tensor
    log_rq: gl.tensor

    @gluon.constexpr_function
    def __init__(self, dest, live, gam, log_rq):
        self.dest = dest
        self.live = live
        self.gam = gam
        self.log_rq = log_rq


@aggregate
class ItemOutputs:
    """Where the writer partition puts an item: its w and u tiles (a whole chunk by TMA store through the staging
    tiles, a sequence's partial last chunk by masked stores at w, u: the rows after it are the next sequence's),
    and gam, qg, kg of its rows (the row data, [HV, rows] fp32)."""
    w_desc: tma.tensor_descriptor
    u_desc: tma.tensor_descriptor
    w_stage: gl.shared_memory_descriptor
    u_stage: gl.shared_memory_descriptor
    w: gl.tensor
    u: gl.tensor
    gam: gl.tensor
    qg: gl.tensor
    kg: gl.tensor
    HV: gl.tensor

    @gluon.constexpr_function
    def __init__(self, w_desc, u_desc, w_stage, u_stage, w, u, gam, qg, kg, HV):
        self.w_desc = w_desc
        self.u_desc = u_desc
        self.w_stage = w_stage
        self.u_stage = u_stage
        self.w = w
        self.u = u
        self.gam = gam
        self.qg = qg
        self.kg = kg
        self.HV = HV

    @gluon.jit
    def store_gam_qg(self, rows):
        """gam and qg = gam + ln rq of an item's rows (ItemRows)."""
        gl.store(self.gam + rows.dest, rows.gam, mask=rows.live)
        gl.store(self.qg + rows.dest, rows.gam + rows.log_rq, mask=rows.live)

    @gluon.jit
    def store_kg(self, rows, rk):
        """kg = gam - ln rk of an item's rows (rk in their layout)."""
        gl.store(self.kg + rows.dest, rows.gam - gl.log(rk), mask=rows.live)

    @gluon.jit
    def store_tiles(self, w_tile, u_tile, start, n_rows, i_hv):
        """The item's w and u, [BT, K] and [BT, V] register tiles in the input dtype (any layout)."""
        BT: gl.constexpr = self.w_stage.shape[0]
        K: gl.constexpr = self.w_stage.shape[1]
        V: gl.constexpr = self.u_stage.shape[1]
        if n_rows == BT:
            # a whole chunk: out by TMA through the staging tiles (the previous ones have left them)
            tma.store_wait(0)
            gl.thread_barrier()
            self.w_stage.store(w_tile)
            self.u_stage.store(u_tile)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(self.w_desc, [start, i_hv * K], self.w_stage)
            tma.async_copy_shared_to_global(self.u_desc, [start, i_hv * V], self.u_stage)
        else:
            # a sequence's last, partial chunk: the rows after it are the next sequence's, so masked stores
            store_rows(self.w + i_hv * K, w_tile, start, n_rows, self.HV * K)
            store_rows(self.u + i_hv * V, u_tile, start, n_rows, self.HV * V)


@gluon.jit
def _sm_count():
    """The GPU's SM count (%nsmid)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %nsmid;", "=r,r", [gl.program_id(0)], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _load_partition(items, inputs, gates, bounds, q_desc, k_desc, v_desc, g, beta, HV):
    """Each item's gates into the gate ring, and its bounds and q, k, v tiles into the input ring."""
    BT: gl.constexpr = inputs.q.shape[1]
    K: gl.constexpr = inputs.q.shape[2]
    V: gl.constexpr = inputs.v.shape[2]
    nbytes: gl.constexpr = q_desc.block_type.nbytes + k_desc.block_type.nbytes + v_desc.block_type.nbytes
    # every warp holds all BT rows, so the cumsum is a warp-level scan
    rows: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [gl.num_warps()], [0])
    r = gl.arange(0, BT, rows)
    for c in range(items.n_items):
        start, n_rows, i_h, i_hv = items.item(c)
        offs = (start + r).to(gl.int64) * HV + i_hv
        gates.bars.wait_empty(c)
        _publish_gates(gates, c, gl.load(g + offs, mask=r < n_rows, other=0.0) * LOG2E,
                       gl.load(beta + offs, mask=r < n_rows, other=0.0))
        slot = c % NUM_SLOTS
        inputs.bars.wait_empty(c)
        bounds.put(c, start, n_rows)
        ready = inputs.bars.ready_bar(c)
        mbarrier.expect(ready, nbytes)
        tma.async_copy_global_to_shared(q_desc, [start, i_h * K], ready, inputs.q.index(slot))
        tma.async_copy_global_to_shared(k_desc, [start, i_h * K], ready, inputs.k.index(slot))
        tma.async_copy_global_to_shared(v_desc, [start, i_hv * V], ready, inputs.v.index(slot))


@gluon.jit
def _aux_partition(items, inputs, gates, bounds, terms, inverse, flags):
    """The terms of each item into the terms ring (see the module docstring)."""
    BT: gl.constexpr = inputs.k.shape[1]
    dtype: gl.constexpr = inputs.k.dtype
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    rows: gl.constexpr = gl.SliceLayout(1, acc_tt)
    cols: gl.constexpr = gl.SliceLayout(0, acc_tt)
    i0 = gl.expand_dims(gl.arange(0, BT, rows), 1)
    j0 = gl.expand_dims(gl.arange(0, BT, cols), 0)
    zero = gl.zeros([BT, BT], gl.float32, acc_tt)
    for c in range(items.n_items):
        slot = c % NUM_SLOTS
        i = loop_variant(i0, c)
        inputs.bars.wait_ready(c)
        _, n_rows = bounds.get(c)
        k_s = inputs.k.index(slot)
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        gates.bars.wait_ready(c)
        kk = warpgroup_mma_wait(0, deps=[kk])
        inputs.bars.release(c)
        publish_key_norms(gates, c, kk, (flags & L2NORM) != 0)
        gam_r = gates.gam.index(slot).load(rows)
        rk_r = gates.rk.index(slot).load(rows)
        a_rows = gates.beta.index(slot).load(rows) * rk_r
        beta_cols = gates.beta.index(slot).load(cols)
        w_cols = beta_cols * gl.exp2(gates.gam.index(slot).load(cols)) * gates.rk.index(slot).load(cols)
        decay = chunk_decay(gates, c, gam_r, i >= j0, n_rows, cols)
        gates.bars.release(c)
        # -A: the inverse's tiles hold the negated blocks (fused_sm90._unit_lower_inverse)
        d_blocks = inverse.stage(kk * decay * gl.expand_dims(-a_rows, 1), c)
        inverse.stage_diagonal(c, d_blocks, zero)
        t = inverse.invert(c, d_blocks, zero)
        terms.bars.wait_empty(c)
        terms.tw.index(slot).store((t * gl.expand_dims(w_cols, 0)).to(dtype))
        terms.tu.index(slot).store((t * gl.expand_dims(beta_cols, 0)).to(dtype))
        terms.rk.index(slot).store(rk_r)
        fence_async_shared()
        terms.bars.publish(c)


@gluon.jit
def _log_row_norms(tile, flags, layout: gl.constexpr):
    """ln of the inverse L2 norms of the [BT, K] shared tile's rows with PREPARE_L2NORM (0 without), in
    `layout`."""
    BT: gl.constexpr = tile.shape[0]
    log_r = gl.zeros([BT], gl.float32, layout)
    if flags & L2NORM:
        x = tile.load(gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0]))
        log_r = gl.convert_layout(gl.log(inverse_row_norms(x)), layout)
    return log_r


@gluon.jit
def item_rows(items, c, inputs, gates, bounds, flags, layout: gl.constexpr):
    """Item c's first row, rows, value head and ItemRows in `layout`: gam from the gate ring (whose slot it then
    releases), the bounds and ln rq once the input slot is ready."""
    r = gl.arange(0, inputs.q.shape[1], layout)
    gates.bars.wait_ready(c)
    gam_r = gates.gam.index(c % NUM_SLOTS).load(layout) * LN2
    gates.bars.release(c)
    inputs.bars.wait_ready(c)
    start, n_rows = bounds.get(c)
    i_hv = items.value_head(c)
    log_rq = _log_row_norms(inputs.q.index(c % NUM_SLOTS), flags, layout)
    dest = row_data_start(i_hv, start, row_data_rows(items.T, items.num_seqs, items.IS_VARLEN)) + r
    return start, n_rows, i_hv, ItemRows(dest, r < n_rows, gam_r, log_rq)


@gluon.jit
def _writer_partition(items, inputs, gates, bounds, terms, out, flags):
    """gam, qg, kg, w and u of each item (see the module docstring)."""
    BT: gl.constexpr = inputs.k.shape[1]
    K: gl.constexpr = inputs.k.shape[2]
    V: gl.constexpr = inputs.v.shape[2]
    dtype: gl.constexpr = inputs.k.dtype
    acc_tk: gl.constexpr = wgmma_layout(BT, K, gl.num_warps())
    acc_tv: gl.constexpr = wgmma_layout(BT, V, gl.num_warps())
    rows_l: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [gl.num_warps()], [0])
    for c in range(items.n_items):
        slot = c % NUM_SLOTS
        start, n_rows, i_hv, rows = item_rows(items, c, inputs, gates, bounds, flags, rows_l)
        terms.bars.wait_ready(c)
        w_acc = warpgroup_mma(terms.tw.index(slot), inputs.k.index(slot), gl.zeros([BT, K], gl.float32, acc_tk),
                              use_acc=False, is_async=True)
        u_acc = warpgroup_mma(terms.tu.index(slot), inputs.v.index(slot), gl.zeros([BT, V], gl.float32, acc_tv),
                              use_acc=False, is_async=True)
        out.store_gam_qg(rows)
        out.store_kg(rows, terms.rk.index(slot).load(rows_l))
        w_acc, u_acc = warpgroup_mma_wait(0, deps=[w_acc, u_acc])
        terms.bars.release(c)
        inputs.bars.release(c)
        out.store_tiles(w_acc.to(dtype), u_acc.to(dtype), start, n_rows, i_hv)
    tma.store_wait(0)


@gluon.jit
def program_items(cu_seqlens, T, num_seqs, H, HV, BT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """This program's items: as many programs as SMs (the first ones the GPU starts) each stride over the
    (chunk slot, key head) pairs; the rest are not active (ItemStream.active) and end at once."""
    n_slots = gl.num_programs(0)
    pairs = n_slots * H
    p = gl.program_id(1) * n_slots + gl.program_id(0)  # in the order the GPU starts the programs
    group = HV // H
    n_programs = gl.minimum(pairs, _sm_count())
    return ItemStream(p, n_programs, gl.cdiv(pairs - p, n_programs) * group, n_slots, group, cu_seqlens, T,
                      num_seqs, BT, IS_VARLEN)


@gluon.jit
def batch_descs(q, k, v, w, u, T, num_seqs, H, HV, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                IS_VARLEN: gl.constexpr):
    """TMA descriptors over the whole batch's q, k, v, w and u (made once a program), [BT, K | V] tiles: one head's
    columns."""
    rows = T
    if not IS_VARLEN:
        rows = T * num_seqs
    return (token_major_desc(q, H * K, rows, H * K, BT, K), token_major_desc(k, H * K, rows, H * K, BT, K),
            token_major_desc(v, HV * V, rows, HV * V, BT, V), token_major_desc(w, HV * K, rows, HV * K, BT, K),
            token_major_desc(u, HV * V, rows, HV * V, BT, V))


@gluon.jit
def item_rings(q_desc, k_desc, v_desc):
    """The input ring and its item bounds, the gate ring (their slots emptied by the aux and the writer
    partitions) and the terms ring."""
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    tile_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dtype)
    inputs, gates = input_and_gate_rings(q_desc, k_desc, v_desc, 2, 2)
    terms = ItemTerms(gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BT], tile_tt),
                      gl.allocate_shared_memory(dtype, [NUM_SLOTS, BT, BT], tile_tt),
                      gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, BT], gl.SwizzledSharedLayout(1, 1, 1, [0])),
                      SlotBarriers.make(1, 1))
    return inputs, ItemBounds.make(), gates, terms


@gluon.jit
def item_outputs(w_desc, u_desc, w, u, gam, qg, kg, HV):
    """The writer's ItemOutputs, with staging tiles of its own."""
    w_stage = gl.allocate_shared_memory(w_desc.block_type.element_ty, w_desc.block_type.shape, w_desc.layout)
    u_stage = gl.allocate_shared_memory(u_desc.block_type.element_ty, u_desc.block_type.shape, u_desc.layout)
    return ItemOutputs(w_desc, u_desc, w_stage, u_stage, w, u, gam, qg, kg, HV)


@gluon.jit
def prepare_chunks_warp_specialized(q, k, v, g, beta, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                                    K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The program's items (called by prepare_sm90.prepare_kernel with 8 warps, the writer partition's)."""
    gl.static_assert(gl.num_warps() == 8, "the writer partition is two warpgroups")
    items = program_items(cu_seqlens, T, num_seqs, H, HV, BT, IS_VARLEN)
    if items.active():
        q_desc, k_desc, v_desc, w_desc, u_desc = batch_descs(q, k, v, w, u, T, num_seqs, H, HV, K, V, BT,
                                                             IS_VARLEN)
        inputs, bounds, gates, terms = item_rings(q_desc, k_desc, v_desc)
        inverse = InverseScratch.make(BT)
        out = item_outputs(w_desc, u_desc, w, u, gam, qg, kg, HV)
        gl.warp_specialize([
            (_writer_partition, (items, inputs, gates, bounds, terms, out, flags)),
            (_aux_partition, (items, inputs, gates, bounds, terms, inverse, flags)),
            (_load_partition, (items, inputs, gates, bounds, q_desc, k_desc, v_desc, g, beta, HV)),
        ], [4, LOAD_WARPS], [AUX_REGS, LOAD_REGS])
