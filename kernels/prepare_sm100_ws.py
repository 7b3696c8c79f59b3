"""gdn_prepare for Blackwell (sm_100a), warp-specialised and persistent: prepare_sm90_ws.py's design on tcgen05.

Same grid, arguments, outputs, item stream, rings, partition roles and rounding points as prepare_sm90_ws.py
(which has the design), with Blackwell's tensor-core side. The first SM-count programs of the grid (%nsmid) each
stride over its (chunk slot, key head) pairs and the rest end at once; an SM streams items (chunk, value head)
through three partitions that meet at mbarriers over two-slot rings (the rings, the load partition and the item
bookkeeping are prepare_sm90_ws.py's), so that the inverse of one item overlaps the loads of the next and the
products and stores of the one before:
  * aux (4 warps, AUX_REGS): k k^T, rk off its diagonal, the decayed A and Tc = (I + A)^-1 by the blocked tf32
    inverse of sm_100a's other kernels (inverse_sm100.py: the diagonal 16 x 16 blocks on warp-level mma.sync,
    one block a warp, hence 4 warps, then four tcgen05 kind::tf32 products); publishes Tw = Tc diag(beta e^gam rk)
    and Tu = Tc diag(beta), each rounded once to the input dtype, and rk;
  * writer (the default partition, 8 warps): gam (the gate ring's), qg = gam + ln rq (rq from the q tile) and
    kg = gam - ln rk; w = Tw k and u = Tu v on tcgen05 (every operand in shared memory) into TMEM, read back by
    both warpgroups (each takes half of every row's columns); a whole chunk leaves by TMA store through staging
    tiles, a sequence's partial last chunk by masked stores (the rows after it are the next sequence's);
  * load (4 warps at LOAD_REGS): prepare_sm90_ws.py's, TMA of the item's q, k and v tiles into the input ring
    through descriptors over the whole batch, and its gates into the gate ring.
Why the tf32 inverse and not prepare_sm90_ws.py's fp16 one: tcgen05 takes no register A operand, on which the fp16
inverse keeps its running terms, so it would be new code that no GPU here could run; the tf32 one is sm_100a's,
already compiled into gdn_prepare's and gdn_fused's sm_100a kernels, and gives this kernel's Tc the rounding of
the 4-warp sm_100a prepare (prepare_sm90_ws.py's fp16 inverse rounds differently from prepare_sm90.py's tf32 one).
Units: TMA (UTMALDG) fills the input ring, TMA store (UTMASTG) writes whole chunks of w and u; the tensor cores run
k k^T, the inverse's four products, w and u (UTCHMMA, M = 64) into TMEM, read back with tcgen05.ld (LDTM), and
the inverse's diagonal blocks (HMMA); every tcgen05 MMA is issued by one thread of its partition after a partition
barrier (its operands, and the reads of the accumulator it overwrites, are done in every warp) and completes
through tcgen05_commit on mbarriers: the partition's own, which it waits on, and the empty barrier of every ring
slot the MMA reads, so the slot goes back to its producer when the tensor cores are done with it.
Registers (setmaxnreg; the kernel is compiled for the 8 writer warps at 128 a thread, a full register file):
aux AUX_REGS = 224, load LOAD_REGS = 32, the writer the rest, (2048 - 4 * 224 - 4 * 32) / 8 = 128 (multiples of
8; 65536 registers over the 16 warps). The aux holds [BT, BT] fp32 tiles of 32 registers a thread through the
inverse (as gdn_fused's aux partition) and, at 192 to 216, ptxas spilled the item stream's first pair and
reloaded it once an item; the load partition spilled at 24 in the fixed-length variants (ptxas-blackwell; the
sm_90a build of the same code does not); the writer needs 32 + 32 a thread for w and u and no more than 128.
TMEM (256 columns allocated of the 512): the aux's [BT, BT] fp32 k k^T, then the inverse's accumulator, and the
writer's [BT, K] and [BT, V] fp32 accumulators of w and u. An M = 64 accumulator takes half of the lanes of its
columns, so Triton packs two on the same columns: k k^T (columns 0-63) and u (64-191) in one half of the lanes,
w (0-127) in the other; 192 columns, rounded up to a power of two.
Shared memory (bf16 / fp16, K = V = 128; 203,640 bytes of the 227 KB a CTA may have, one program an SM): inputs
2 x 48 KB, terms 2 x 16.3 KB (Tw, Tu, rk), gates 2 KB, the inverse's two fp32 operand tiles 32 KB, w and u
staging 32 KB, and the partitions' layout-conversion scratch.
Compiled and checked in SASS only (no Blackwell GPU here): never run.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory,
                                                                  fence_async_shared, get_tmem_reg_layout,
                                                                  mbarrier, tcgen05_commit, tcgen05_mma, tma)

from .common import loop_variant, mbarriers
from .fused_sm90 import NUM_SLOTS, chunk_decay, publish_key_norms
from .inverse_sm100 import unit_lower_inverse
from .prepare_sm90_ws import (L2NORM, LOAD_WARPS, _load_partition, batch_descs, item_outputs, item_rings, item_rows,
                              program_items)

AUX_REGS = gl.constexpr(224)
LOAD_REGS = gl.constexpr(32)


@gluon.jit
def _aux_partition(items, inputs, gates, bounds, terms, kk_tmem, a_smem, bt_smem, bar, flags):
    """The terms of each item into the terms ring (see the module docstring). kk_tmem: k k^T, then the inverse's
    accumulator; a_smem, bt_smem: the inverse's operand tiles; bar: the partition's MMA barrier."""
    BT: gl.constexpr = inputs.k.shape[1]
    dtype: gl.constexpr = inputs.k.dtype
    reg_tt: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, BT], kk_tmem.type.layout, gl.num_warps())
    rows: gl.constexpr = gl.SliceLayout(1, reg_tt)
    cols: gl.constexpr = gl.SliceLayout(0, reg_tt)
    for c in range(items.n_items):
        slot = c % NUM_SLOTS
        # the row and column indices as values of this item (hoisted out of the loop, they would be held across it)
        i = gl.expand_dims(gl.arange(0, BT, rows), 1) + loop_variant(0, c)
        j = gl.expand_dims(gl.arange(0, BT, cols), 0) + loop_variant(0, c)
        phase = c & 1  # bar completes five times an item: k k^T, then the inverse's four products
        # --- k k^T on the tensor cores; the input slot goes back to the load partition once it has read k (the
        # previous item's last read of kk_tmem is behind the barrier of its terms.bars.publish)
        inputs.bars.wait_ready(c)
        _, n_rows = bounds.get(c)
        k_s = inputs.k.index(slot)
        tcgen05_mma(k_s, k_s.permute((1, 0)), kk_tmem, use_acc=False)
        tcgen05_commit(bar)
        tcgen05_commit(inputs.bars.empty.index(slot))
        gates.bars.wait_ready(c)
        mbarrier.wait(bar, phase)
        publish_key_norms(gates, c, kk_tmem.load(reg_tt), (flags & L2NORM) != 0)

        # --- A = beta_t rk_t rk_s (k k^T)_ts e^(gam_t - gam_s), s < t; k k^T read again from TMEM (its registers
        # are free while the decay is built)
        gam_r = gates.gam.index(slot).load(rows)
        a_rows = gates.beta.index(slot).load(rows) * gates.rk.index(slot).load(rows)
        decay = chunk_decay(gates, c, gam_r, i >= j, n_rows, cols)
        a = gl.where(i > j, kk_tmem.load(reg_tt) * decay * gl.expand_dims(a_rows, 1), 0.0)
        # --- Tc = (I + A)^-1; kk_tmem is its accumulator (every warp has read k k^T: its first product starts
        # with a barrier)
        tc, _ = unit_lower_inverse(a, a_smem, bt_smem, kk_tmem, reg_tt, bar, phase ^ 1)

        # --- Tw and Tu: their column scalings are read only now (held across the inverse as column vectors, they
        # would pin 64 registers a thread); beta = 0 past the chunk's rows, so are those columns
        beta_cols = gates.beta.index(slot).load(cols)
        w_cols = beta_cols * gl.exp2(gates.gam.index(slot).load(cols)) * gates.rk.index(slot).load(cols)
        terms.bars.wait_empty(c)
        terms.tw.index(slot).store((tc * gl.expand_dims(w_cols, 0)).to(dtype))
        terms.tu.index(slot).store((tc * gl.expand_dims(beta_cols, 0)).to(dtype))
        terms.rk.index(slot).store(gates.rk.index(slot).load(rows))
        gates.bars.release(c)
        fence_async_shared()  # Tw and Tu are the writer's MMA operands
        terms.bars.publish(c)


@gluon.jit
def _writer_partition(items, inputs, gates, bounds, terms, w_tmem, u_tmem, bar, out, flags):
    """gam, qg, kg, w and u of each item (see the module docstring); bar: the partition's MMA barrier."""
    BT: gl.constexpr = inputs.k.shape[1]
    K: gl.constexpr = inputs.k.shape[2]
    V: gl.constexpr = inputs.v.shape[2]
    dtype: gl.constexpr = inputs.k.dtype
    reg_tk: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, K], w_tmem.type.layout, gl.num_warps())
    reg_tv: gl.constexpr = get_tmem_reg_layout(gl.float32, [BT, V], u_tmem.type.layout, gl.num_warps())
    rows_l: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [gl.num_warps()], [0])
    for c in range(items.n_items):
        slot = c % NUM_SLOTS
        start, n_rows, i_hv, rows = item_rows(items, c, inputs, gates, bounds, flags, rows_l)
        terms.bars.wait_ready(c)
        rk = terms.rk.index(slot).load(rows_l)
        # every warp is done with the q tile and rk, whose slots the commits below release, and has read the
        # previous item's w and u out of the TMEM these MMAs overwrite
        gl.thread_barrier()
        tcgen05_mma(terms.tw.index(slot), inputs.k.index(slot), w_tmem, use_acc=False)
        tcgen05_mma(terms.tu.index(slot), inputs.v.index(slot), u_tmem, use_acc=False)
        tcgen05_commit(bar)
        tcgen05_commit(inputs.bars.empty.index(slot))
        tcgen05_commit(terms.bars.empty.index(slot))
        out.store_gam_qg(rows)
        out.store_kg(rows, rk)
        mbarrier.wait(bar, c & 1)  # bar completes once an item
        out.store_tiles(w_tmem.load(reg_tk).to(dtype), u_tmem.load(reg_tv).to(dtype), start, n_rows, i_hv)
    tma.store_wait(0)


@gluon.jit
def prepare_chunks_warp_specialized(q, k, v, g, beta, cu_seqlens, w, u, gam, qg, kg, T, num_seqs, H, HV, flags,
                                    K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The program's items (called by prepare_sm100.prepare_kernel with 8 warps, the writer partition's)."""
    gl.static_assert(gl.num_warps() == 8, "the writer partition is two warpgroups")
    items = program_items(cu_seqlens, T, num_seqs, H, HV, BT, IS_VARLEN)
    if items.active():
        q_desc, k_desc, v_desc, w_desc, u_desc = batch_descs(q, k, v, w, u, T, num_seqs, H, HV, K, V, BT,
                                                             IS_VARLEN)
        inputs, bounds, gates, terms = item_rings(q_desc, k_desc, v_desc)
        out = item_outputs(w_desc, u_desc, w, u, gam, qg, kg, HV)
        # the aux's inverse operand tiles and TMEM, the writer's accumulators; one MMA barrier a partition
        f32_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        a_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        bt_smem = gl.allocate_shared_memory(gl.float32, [BT, BT], f32_tt)
        kk_tmem = allocate_tensor_memory(gl.float32, [BT, BT], TensorMemoryLayout(block=(BT, BT), col_stride=1))
        w_tmem = allocate_tensor_memory(gl.float32, [BT, K], TensorMemoryLayout(block=(BT, K), col_stride=1))
        u_tmem = allocate_tensor_memory(gl.float32, [BT, V], TensorMemoryLayout(block=(BT, V), col_stride=1))
        mma_bars = mbarriers(2, 1)
        gl.warp_specialize([
            (_writer_partition, (items, inputs, gates, bounds, terms, w_tmem, u_tmem, mma_bars.index(0), out, flags)),
            (_aux_partition, (items, inputs, gates, bounds, terms, kk_tmem, a_smem, bt_smem, mma_bars.index(1),
                              flags)),
            (_load_partition, (items, inputs, gates, bounds, q_desc, k_desc, v_desc, g, beta, HV)),
        ], [4, LOAD_WARPS], [AUX_REGS, LOAD_REGS])
