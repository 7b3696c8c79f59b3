"""gdn_fused for Hopper (sm_90a): the whole forward in one warp-specialised kernel (docs/performance.md has its
times, and where the two-kernel route is still faster).

One program per (sequence, value head, V tile of BV rows) walks the sequence's 64-token chunks in order. q, k, v,
g and beta are read once (q, k and the gates once a V tile), o and the final state written once; A, its inverse,
v_new and the state never leave the SM (docs/algorithm.md, "The fused forward"). The state is held transposed,
S = h^T [BV, K] fp32, in the registers of BV / 64 warpgroups (64 value rows each), so every product with it takes
it as wgmma's register A operand and the state is never copied to shared memory. Every product with S, and every
update of it, is row by row: a value row's bits depend on that row and the chunk's terms only, so BV = 64 (two
programs a value head, for batches of few sequences) computes bitwise what BV = 128 does. With rq, rk the inverse
L2 norms of the q and k rows (1 without FUSED_L2NORM), gam = cumsum(g) and gl = gam of the chunk's last row:
    A      = beta_t rk_t rk_s (k k^T)_ts e^(gam_t - gam_s),  s < t                     (aux)
    Tc     = (I + A)^-1;  Tv = Tc diag(beta)                                            (aux)
    P      = rk_s (q k^T)_ts e^(gam_t - gam_s),              s <= t                    (aux)
    kh     = S k^T                                       [V, BT]    (state, critical path)
    v_new  = (v^T - kh diag(e^gam rk)) Tv^T              [V, BT]    (state, critical path)
    o      = ((S q^T) diag(e^gam) + v_new P^T) diag(scale rq)        [V, BT] = o^T   (state, beside the path)
    S      = e^gl S + v_new diag(e^(gl - gam) rk) k      [V, K]     (state, critical path)
v_new is one product: v^T (ldmatrix from its TMA tile) and the scaled kh are summed in registers and enter the
tensor cores once, so the critical path S -> kh -> v_new -> S has three products, not four. The attention
scale rides on rq (the norms partition's one multiply a row) rather than on P (the aux partition's one an entry).
Partitions, 16 warps (registers a thread by setmaxnreg; the kernel is compiled at 128, a full register file):
  * state, the default partition: BV / 64 warpgroups; at BV = 128 (2048 - 4 * AUX_REGS - 4 * LOAD_REGS) / 8 = 192
    registers (at BV = 64, 216, beside two aux partitions), a thread's share the same at either BV: S alone is 64 a
    thread, its bf16 copy (the A operand of S k^T and S q^T) 32, each [V, BT] accumulator 32.
    With fewer (an aux budget above 104), ptxas serialises every wgmma of the kernel (C7512), and it does the
    same when S q^T is still in flight while v_new's product is issued: S k^T and S q^T are waited on together;
  * aux, 128 / BV warpgroups at AUX_REGS (AUX_PAIR_REGS for two): what a chunk needs that does not depend on the
    state, up to a ring's slots ahead of it: k k^T and q k^T on wgmma (rk is the diagonal of k k^T), the decay
    matrix, P, the row scalings, and Tc by the blocked inverse: the diagonal 16 x 16 blocks in the registers that
    hold them (their diagonal 8 x 8 quarters by forward substitution in fp32 with warp shuffles, the third quarter
    by two fp16 mma.sync), then fp16 wgmma in three round trips whose A operands are registers (the accumulator's
    own, converted in place) or a staged tile, their B operands staged fp16 tiles. Two products are in flight at
    once only where all their operands are in shared memory: with a register A operand, the second accumulator needs
    more registers than the partition has, and ptxas then serialises every wgmma of the kernel (C7512). A chunk's
    terms are a latency chain (about 2.8 us on an H100, the state's chunk 1.3-1.5 us at BV = 64) and independent of
    every other chunk's, so at BV = 64, where half the state's registers are free, two aux partitions take every
    other chunk each, two chains in flight (at BV = 128 the state's 8 x 192 registers leave room for one);
  * load, LOAD_WARPS warps at LOAD_REGS (LOAD_PAIR_REGS at BV = 64): TMA of the q, k, v tiles through
    per-sequence descriptors whose row bound is the sequence's length (a chunk's tail is zero-filled and never reads
    the next sequence) and the chunk's gates (gam = cumsum(g) by a warp scan), a chunk ahead of the tiles;
  * norms, NORMS_WARPS warps with the load's registers (the two make one warpgroup): scale rq into the terms ring (on
    barriers of its own), a row a thread, as soon as the q tile lands. rq only scales the columns of o^T, which the
    state partition computes last, so it is needed late and the aux partition has one Gram matrix less to reduce. A
    partition of its own, because in the load loop it waited behind the input slot's wait, which follows the state's
    pace. (rk here as well, published first on barriers of its own, was 0.2-1.5 % slower than rk off the diagonal of
    the aux's k k^T: the aux then waited for it.)
Rings (InputRing, GateRing, TermRing below; each slot a ready and an empty mbarrier, SlotBarriers): the inputs
(load -> aux, state and norms), the gates (load -> aux; the aux partition adds rk) and the chunk terms (aux ->
state, and rq, norms -> state). Few partitions free what they read, because Triton's barrier analysis puts a
partition barrier between an arrive and the partition's next shared-memory access (chunk_rings): the aux partition
arrives only on the terms' ready barrier, and the sm_90a state partition once a chunk, on the input slot's empty
barrier, which stands for its terms and rq too.
The 64-row programs (BV = 64) have three slots in every ring (SLOTS_64), and o leaves through its chunk's Tv tile
(read by v_new's product by then), whose terms slot the state frees early in the next chunk, once the TMA store
has read it: the input slot is then free at the end of its chunk, so the load partition requests chunk c + 2's
tiles as soon as the state is done with chunk c - 1, and its gate slot once the terms of chunk c - 1 are out.
With two slots and o apart, both requests waited for the terms of chunk c, which the aux partition that takes
chunk c + 2 publishes: that partition's next chunk waited for its own last one and a TMA round trip, the aux
partitions 38 % of their time (ncu, H100, 1 x 65536), and deeper rings alone did not change it.
Shared memory at BV = 128 (175 KB of the 227 KB a CTA may have): inputs 2 x 48 KB, terms 2 x 18 KB, the inverse's
three fp16 tiles 24 KB (an aux partition's), o staging 16 KB; at BV = 64, 226 KB: inputs 3 x 40 KB, terms
3 x 18 KB, gates 3 KB, two aux partitions' inverse tiles; one program an SM.
Terms programs (TERMS_PROGRAM, the gdn_fused_terms family; docs/design.md "Terms programs"): both 64-row programs of a
value head compute the same chunk terms, and where few (sequence, head) pairs leave SMs idle the aux role bounds their
chunk. With TERMS_PROGRAM a (sequence, head) has, beside its two state programs (grid z 0 and 1), TERMS_PROGRAMS terms
programs (z 2 and 3; the launcher starts all four at once, cooperatively or as a cluster): terms program i computes
the terms of chunks i, i + 2, ... in three aux partitions (the default partition's warpgroup is the third) and hands
them over through its ring of EXCHANGE_SLOTS chunk slots in global memory (TermExchange: TMA stores, ready and
consumed counters); the state programs' two aux partitions become importers (chunks 0, 2, .. from ring 0 and 1, 3, ..
from ring 1), their load partition loads q, k and v only, and their norms and state partitions are gdn_fused's. The
terms are computed by the same functions from the same tiles, and the gates' product by log2 e is rounded on its own
in both (log2_units), so o and the state are gdn_fused's bits (measured bitwise on an H100; docs/design.md, "Terms
programs").
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from . import FUSED_HAS_H0 as _HAS_H0, FUSED_L2NORM as _L2NORM, FUSED_STORE_HT as _STORE_HT
from . import FUSED_GATE_IN_KERNEL as _GATE_IN_KERNEL, FUSED_USE_INDICES as _USE_INDICES
from . import EXCHANGE_SCALINGS as _EXCHANGE_SCALINGS, EXCHANGE_SLOTS as _EXCHANGE_SLOTS
from . import TERMS_PROGRAMS as _TERMS_PROGRAMS
from .common import (Checkpoints, GateSource, inverse_norm, load_state_tile, log2_units, loop_variant,
                     row_tile_desc, sequence_and_head, sequence_bounds, state_io_layout, store_state_tile,
                     wgmma_layout)

L2NORM = gl.constexpr(_L2NORM)
HAS_H0 = gl.constexpr(_HAS_H0)
STORE_HT = gl.constexpr(_STORE_HT)
USE_INDICES = gl.constexpr(_USE_INDICES)
GATE_IN_KERNEL = gl.constexpr(_GATE_IN_KERNEL)

NUM_SLOTS = gl.constexpr(2)
SLOTS_64 = gl.constexpr(3)  # every ring of the 64-row programs (module docstring)
AUX_REGS = gl.constexpr(104)
# at BV = 64 each of the two aux partitions: 4 * 216 (the 64-row state) + 8 * 128 + 4 * 40 = 2048, a full register
# file (at 104, as one aux partition beside the 128-row state, they reloaded 0-7 spilled values a chunk; at 128 none;
# at 136, the state at 200, they were no faster; at 144 the state spills and its wgmma are serialised)
AUX_PAIR_REGS = gl.constexpr(128)
LOAD_REGS = gl.constexpr(24)
# at BV = 64 the load and norms warps (one warpgroup, so one count) take 16 of the state's registers: at 24 ptxas
# kept one of a norms thread's 16 row loads in flight, each waited on shared memory busy with the wgmma of three
# partitions, and a chunk's rq took about as long as the whole chunk (ncu, H100, 1 x 65536: the state waited for
# it); at 32 or 40 two or three loads are in flight (40 was 0.5 % faster than 32)
LOAD_PAIR_REGS = gl.constexpr(40)
LOAD_WARPS = gl.constexpr(2)
NORMS_WARPS = gl.constexpr(2)
# programs numbered head-major (common.sequence_and_head): the kernel's own ids and its checkpoints' agree
HEAD_MAJOR = gl.constexpr(True)
# rows of a chunk-terms slot's scaling tile: beta and the column scalings of kh (-e^gam rk), of v_new before the
# state update and of S q^T (e^gam), and the state's decay
BETA = gl.constexpr(0)
K_SCALE = gl.constexpr(1)
V_SCALE = gl.constexpr(2)
O_SCALE = gl.constexpr(3)
STATE_SCALE = gl.constexpr(4)  # e^gl in every entry
# a power of two, so that a slot's rows are one tensor (the last three are unused); the exchange's slots have as many
SCALINGS = gl.constexpr(_EXCHANGE_SCALINGS)
# fp32 rows as TMA copies them to and from the scalings, whose shared layout is plain rows (no swizzle)
PLAIN_ROWS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
BLOCK = gl.constexpr(16)  # the inverse's diagonal blocks


@aggregate
class SlotBarriers:
    """The ready and empty mbarriers of a ring of n chunk slots (NUM_SLOTS unless made with more).

    Chunk c lives in slot c % n. Its producer waits for the slot's empty barrier, fills it and completes ready;
    each consumer waits for ready and arrives on empty when done. Both barriers flip phase once per pass over the
    ring, so chunk c waits for phase (c // n) & 1 of ready and for the other phase of empty (a fresh barrier counts
    as released once, so the first pass does not wait).
    """
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, ready, empty):
        self.ready = ready
        self.empty = empty

    @gluon.jit
    def make(producers: gl.constexpr, consumers: gl.constexpr, slots: gl.constexpr = NUM_SLOTS):
        """`producers` arrivals (or one arrive with the TMA byte count) fill a slot, `consumers` empty it."""
        ready = gl.allocate_shared_memory(gl.int64, [slots, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [slots, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(slots):
            mbarrier.init(ready.index(s), count=producers)
            mbarrier.init(empty.index(s), count=consumers)
        return SlotBarriers(ready, empty)

    @gluon.jit
    def slot(self, chunk):
        """Chunk `chunk`'s slot, in this ring and in the tiles of the ring that owns these barriers."""
        return chunk % self.ready.shape[0]

    @gluon.jit
    def pass_parity(self, chunk):
        """The parity of chunk `chunk`'s pass over the ring (the phase its ready barrier completes)."""
        return (chunk // self.ready.shape[0]) & 1

    @gluon.jit
    def ready_bar(self, chunk):
        return self.ready.index(self.slot(chunk))

    @gluon.jit
    def wait_ready(self, chunk):
        mbarrier.wait(self.ready.index(self.slot(chunk)), self.pass_parity(chunk))

    @gluon.jit
    def wait_empty(self, chunk):
        mbarrier.wait(self.empty.index(self.slot(chunk)), self.pass_parity(chunk) ^ 1)

    @gluon.jit
    def publish(self, chunk):
        """Every warp of the producing partition has written (and fenced) its share: one arrive on ready."""
        gl.thread_barrier()
        mbarrier.arrive(self.ready.index(self.slot(chunk)), count=1)

    @gluon.jit
    def release(self, chunk):
        """Every warp of the consuming partition is done with the slot: one arrive on empty."""
        gl.thread_barrier()
        mbarrier.arrive(self.empty.index(self.slot(chunk)), count=1)


@aggregate
class InputRing:
    """q, k, v tiles [n, BT, K|V] by TMA (load -> aux reads q, k; state reads q, k, v)."""
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

    @gluon.jit
    def slot(self, chunk):
        return self.bars.slot(chunk)


@aggregate
class GateRing:
    """Per-row vectors of a chunk, [n, BT] fp32 each (load -> aux): gam = cumsum(g) in log2 units, beta,
    gam of the chunk's last row (in every entry), and rk, the inverse L2 norms of the k rows (1 without
    FUSED_L2NORM), which the aux partition adds (publish_key_norms)."""
    gam: gl.shared_memory_descriptor
    beta: gl.shared_memory_descriptor
    gam_last: gl.shared_memory_descriptor
    rk: gl.shared_memory_descriptor
    bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, gam, beta, gam_last, rk, bars):
        self.gam = gam
        self.beta = beta
        self.gam_last = gam_last
        self.rk = rk
        self.bars = bars

    @gluon.jit
    def slot(self, chunk):
        return self.bars.slot(chunk)


@aggregate
class TermRing:
    """What the state partition takes for a chunk, n slots of it: from the aux partition Tc diag(beta) and P [n, BT,
    BT] in the input dtype and the SCALINGS row scalings [n * SCALINGS, BT] fp32 (bars); from the norms partition
    scale rq [n, BT] fp32, the column scaling of o^T, which the state needs last (rq_bars: its own barriers, so the
    state never waits for it to start a chunk)."""
    tc_v: gl.shared_memory_descriptor
    p: gl.shared_memory_descriptor
    scalings: gl.shared_memory_descriptor
    bars: SlotBarriers
    rq: gl.shared_memory_descriptor
    rq_bars: SlotBarriers

    @gluon.constexpr_function
    def __init__(self, tc_v, p, scalings, bars, rq, rq_bars):
        self.tc_v = tc_v
        self.p = p
        self.scalings = scalings
        self.bars = bars
        self.rq = rq
        self.rq_bars = rq_bars

    @gluon.jit
    def slot(self, chunk):
        return self.bars.slot(chunk)

    @gluon.jit
    def scaling(self, chunk, row):
        """Row `row` of chunk `chunk`'s scalings ([BT] fp32)."""
        return self.scalings.index(self.slot(chunk) * SCALINGS + row)

    @gluon.jit
    def state_decay(self, chunk):
        """e^gl of chunk `chunk`, a scalar: one entry of its STATE_SCALE row, loaded by every thread (a reduction
        of the row would cross lanes)."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        return gl.max(self.scaling(chunk, STATE_SCALE).slice(0, 1).load(one), axis=0)

    @gluon.jit
    def slot_scalings(self, chunk):
        """All SCALINGS rows of chunk `chunk`'s scalings ([SCALINGS, BT] fp32)."""
        BT: gl.constexpr = self.scalings.shape[1]
        slots = self.scalings._reinterpret(gl.float32, [self.p.shape[0], SCALINGS, BT],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        return slots.index(self.slot(chunk))

    @gluon.jit
    def tma_scalings(self, chunk):
        """Chunk `chunk`'s scalings as the TMA writes and reads them (the exchange's scalings_desc)."""
        BT: gl.constexpr = self.scalings.shape[1]
        return self.slot_scalings(chunk)._reinterpret(gl.float32, [SCALINGS, BT], PLAIN_ROWS)


EXCHANGE_SLOTS = gl.constexpr(_EXCHANGE_SLOTS)  # chunks a terms program may run ahead of its state programs
TERMS_PROGRAMS = gl.constexpr(_TERMS_PROGRAMS)  # a (sequence, head)'s terms programs, each taking every other chunk


def _spin_ptx(label):
    return ("{ .reg .pred p; .reg .b32 v; " + label + ": ld.acquire.gpu.global.b32 v, [$1]; "
            "setp.lt.s32 p, v, $2; @p nanosleep.u32 20; @p bra " + label + "; mov.b32 $0, v; }")


SPIN_READY = gl.constexpr(_spin_ptx("SPIN_READY"))
SPIN_FREE = gl.constexpr(_spin_ptx("SPIN_FREE"))
# the thread that issued the partition's TMA stores waits for their writes (not only their reads)
WRITES_COMPLETE = gl.constexpr("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, $1;")
# orders the TMA (async proxy) after the generic-proxy synchronisation before it
PROXY_FENCE = gl.constexpr("fence.proxy.async.global; mov.b32 $0, $1;")
# one thread (index 0) of the partition, after the partition's barrier: a counter set
RELEASE_STORE = gl.constexpr("{ .reg .pred p; setp.eq.s32 p, $2, 0; @p st.release.gpu.global.b32 [$1], $3; "
                             "mov.b32 $0, 0; }")
# one thread (index 0) of the partition, after its wait for the imports it counts: one import done
RELEASE_ADD = gl.constexpr("{ .reg .pred p; setp.eq.s32 p, $2, 0; @p red.release.gpu.global.add.s32 [$1], 1; "
                           "mov.b32 $0, 0; }")


@gluon.jit
def _each_lane():
    """The partition's thread indices, one a thread: the operand that runs TermExchange's inline asm once a thread."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.arange(0, 32 * gl.num_warps(), layout)


@aggregate
class TermExchange:
    """A (sequence, value head)'s chunk terms in global memory, from its terms program to its state programs: a ring
    of EXCHANGE_SLOTS slots (Tc diag(beta) and P [2, BT, BT] in the input dtype, by TMA through tiles; the scalings
    [SCALINGS, BT] fp32 through scalings) and two int32 counters a slot: ready (chunk + 1 of the chunk last exported
    into it) and consumed (imports of it by the state programs, two a chunk). Zero at launch."""
    tiles: gl.tensor
    scalings: gl.tensor
    counters: gl.tensor
    tiles_desc: tma.tensor_descriptor
    scalings_desc: tma.tensor_descriptor
    first_chunk: gl.tensor

    @gluon.constexpr_function
    def __init__(self, tiles, scalings, counters, tiles_desc, scalings_desc, first_chunk):
        self.tiles = tiles
        self.scalings = scalings
        self.counters = counters
        self.tiles_desc = tiles_desc
        self.scalings_desc = scalings_desc
        self.first_chunk = first_chunk

    @gluon.jit
    def chunk(self, j):
        """The sequence's chunk that is this ring's j-th."""
        return self.first_chunk + TERMS_PROGRAMS * j

    @gluon.jit
    def local_chunks(self, n_chunks):
        """How many of a sequence's n_chunks chunks go through this ring."""
        return gl.maximum(n_chunks - self.first_chunk + TERMS_PROGRAMS - 1, 0) // TERMS_PROGRAMS

    @gluon.jit
    def of_ring(tiles, scalings, counters, ring, first_chunk, BT: gl.constexpr):
        p = ring.to(gl.int64) * EXCHANGE_SLOTS
        tiles = tiles + p * 2 * BT * BT
        scalings = scalings + p * SCALINGS * BT
        tiles_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], tiles.dtype.element_ty)
        tiles_desc = tma.make_tensor_descriptor(tiles, [EXCHANGE_SLOTS * 2 * BT, BT], [BT, 1], [BT, BT], tiles_layout)
        scalings_desc = tma.make_tensor_descriptor(scalings, [EXCHANGE_SLOTS * SCALINGS, BT], [BT, 1], [SCALINGS, BT],
                                                   PLAIN_ROWS)
        return TermExchange(tiles, scalings, counters + p * 2, tiles_desc, scalings_desc, first_chunk)

    @gluon.jit
    def _one_a_thread(self, ptr, value, asm: gl.constexpr):
        lane = _each_lane()
        gl.inline_asm_elementwise(asm, "=r,l,r,r", [ptr + lane * 0, lane, lane * 0 + value], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _spin(self, ptr, target, asm: gl.constexpr):
        lane = _each_lane()
        gl.inline_asm_elementwise(asm, "=r,l,r", [ptr + lane * 0, lane * 0 + target], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def wait_free(self, c):
        """Until both state programs have imported the chunk EXCHANGE_SLOTS before chunk c (chunk c's ring slot)."""
        s = c % EXCHANGE_SLOTS
        self._spin(self.counters + s * 2 + 1, 2 * (c // EXCHANGE_SLOTS), SPIN_FREE)

    @gluon.jit
    def store(self, terms, c):
        """Chunk c's terms, fenced in its terms slot, into its ring slot by TMA (the writes complete later). The
        slot's last readers were the state programs' TMA copies, ordered before this (their landing, which the
        importers' consumed counter releases, the load partition's acquire of it, the input slot's mbarrier): the
        proxy fence orders the TMA's writes after that generic chain."""
        BT: gl.constexpr = terms.p.shape[1]
        s = c % EXCHANGE_SLOTS
        slot = terms.slot(c)
        self._each_thread(PROXY_FENCE)
        tma.async_copy_shared_to_global(self.tiles_desc, [s * 2 * BT, 0], terms.tc_v.index(slot))
        tma.async_copy_shared_to_global(self.tiles_desc, [s * 2 * BT + BT, 0], terms.p.index(slot))
        tma.async_copy_shared_to_global(self.scalings_desc, [s * SCALINGS, 0], terms.tma_scalings(c))

    @gluon.jit
    def _each_thread(self, asm: gl.constexpr):
        """asm (one output, one input, both unused) once in every thread of the partition."""
        gl.inline_asm_elementwise(asm, "=r,r", [_each_lane() * 0], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def complete(self, c):
        """Once the partition's TMA stores (chunk c's) have written global memory and read their terms slot: chunk
        c's ready counter."""
        self._each_thread(WRITES_COMPLETE)
        gl.thread_barrier()
        self._one_a_thread(self.counters + (c % EXCHANGE_SLOTS) * 2, c + 1, RELEASE_STORE)

    @gluon.jit
    def import_into(self, terms, c, j):
        """A state program: chunk c's terms, the ring's j-th, once exported, from the ring into its terms slot (which
        the caller knows to be free) by TMA, whose bytes complete the slot's ready barrier. Every thread acquires the
        export's release (given after its TMA writes landed, fenced); the proxy fence orders the TMA's reads after
        that acquire."""
        BT: gl.constexpr = terms.p.shape[1]
        nbytes: gl.constexpr = 2 * self.tiles_desc.block_type.nbytes + self.scalings_desc.block_type.nbytes
        s = j % EXCHANGE_SLOTS
        self._spin(self.counters + s * 2, j + 1, SPIN_READY)
        self._each_thread(PROXY_FENCE)
        slot = terms.slot(c)
        ready = terms.bars.ready_bar(c)
        mbarrier.expect(ready, nbytes)
        tma.async_copy_global_to_shared(self.tiles_desc, [s * 2 * BT, 0], ready, terms.tc_v.index(slot))
        tma.async_copy_global_to_shared(self.tiles_desc, [s * 2 * BT + BT, 0], ready, terms.p.index(slot))
        tma.async_copy_global_to_shared(self.scalings_desc, [s * SCALINGS, 0], ready, terms.tma_scalings(c))

    @gluon.jit
    def mark_consumed(self, c):
        """Once the copy of the ring's chunk c has landed (the caller knows): one import of it done (its slot's
        consumed counter)."""
        self._one_a_thread(self.counters + (c % EXCHANGE_SLOTS) * 2 + 1, 0, RELEASE_ADD)


@aggregate
class InverseScratch:
    """The aux partition's fp16 operand tiles for the inverse (_unit_lower_inverse): -L (then W, staged once N',
    the one product that reads -L, is over), N' and D^-1, [1, BT, BT] each, each an allocation of its own. Triton
    puts a partition barrier between two accesses to one allocation that may touch the same bytes (a store after
    the tensor cores' reads, two stores in one stage), and it cannot tell the tiles of one allocation apart: with
    N', W and D^-1 in one, the aux loop had two barriers more. W shares -L's allocation because a stage, and its
    barrier, lies between N' and W: no barrier is added, and the 8 KB make room for the 64-row programs' third slots."""
    minus_l: gl.shared_memory_descriptor
    n: gl.shared_memory_descriptor
    d: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, minus_l, n, d):
        self.minus_l = minus_l
        self.n = n
        self.d = d

    @gluon.jit
    def make(BT: gl.constexpr):
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float16)
        return InverseScratch(gl.allocate_shared_memory(gl.float16, [1, BT, BT], layout),
                              gl.allocate_shared_memory(gl.float16, [1, BT, BT], layout),
                              gl.allocate_shared_memory(gl.float16, [1, BT, BT], layout))

    @gluon.jit
    def stage(self, neg_a, c):
        """-A of chunk c without its diagonal blocks, -L, as the fp16 operand tile of N' (A's diagonal is never
        read); returns the inverses of its diagonal blocks (_invert_diagonal_blocks). stage_diagonal's fence and
        barrier make the tile visible."""
        _of_chunk(self.minus_l, c).store(_off_diagonal_blocks(neg_a).to(gl.float16))
        return _invert_diagonal_blocks(neg_a)

    @gluon.jit
    def stage_diagonal(self, c, d_blocks, like):
        """D^-1 of chunk c (its blocks d_blocks) as the fp16 operand tile of N' and W, in the layout of `like` (the
        wgmma accumulator's). Its fence and barrier make every shared store of the partition before it visible
        to the tensor cores: the -L tile's (stage), and any the caller adds (gdn_fused's P)."""
        _stage(_of_chunk(self.d, c), _block_diagonal(d_blocks, like))

    @gluon.jit
    def invert(self, c, d_blocks, zero):
        """Tc = (I + A)^-1 of chunk c from its staged -L and D^-1 (stage, stage_diagonal) and D^-1's blocks
        (_unit_lower_inverse)."""
        return _unit_lower_inverse(d_blocks, _of_chunk(self.minus_l, c), _of_chunk(self.n, c), _of_chunk(self.d, c),
                                   zero)


@gluon.jit
def _of_chunk(tile, c):
    """The one tile of a [1, BT, BT] allocation, its index a value of chunk c: with a constant index the compiler
    hoists the descriptors out of the loop, and spills them."""
    return tile.index(loop_variant(0, c))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _inverse_row_norms(tile, out, factor, L2: gl.constexpr):
    """out = factor * inverse_norm (fla's l2norm) of each row of the [BT, K] shared tile, or factor without L2.
    A thread a row (the partition has BT threads), 8 values, one 16-byte load, at a time: the sum never leaves the
    thread. (Eight lanes a row, with three shuffle steps a row, took 538 instructions a chunk instead of 399, and
    their shuffles queued beside the aux partition's: the kernel was 0.8-2.5 % slower.)"""
    BT: gl.constexpr = tile.shape[0]
    K: gl.constexpr = tile.shape[1]
    gl.static_assert(BT == 32 * gl.num_warps(), "a thread a row")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [gl.num_warps(), 1], [1, 0])
    if L2:
        squares = gl.zeros([BT], gl.float32, gl.SliceLayout(1, layout))
        for j in gl.static_range(K // 8):
            x = tile.slice(8 * j, 8, dim=1).load(layout).to(gl.float32)
            squares += gl.sum(x * x, axis=1)
        out.store(inverse_norm(squares) * factor)
    else:
        out.store(gl.full([BT], factor, gl.float32, gl.SliceLayout(1, layout)))


@gluon.jit
def _norms_partition(inputs, terms, q_desc, seq_len, scale, flags, rq_freed_with_inputs: gl.constexpr):
    """For each chunk c, once its q tile has landed: scale rq into the terms ring (only the state partition uses it,
    as the column scaling of o^T, at the end of the chunk); then the chunk's input slot is released. The rq slot is
    free when the state partition has released it, or, with rq_freed_with_inputs, as soon as the chunk's inputs
    have landed: the state then reads rq before it frees the input slot."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    for c in range(gl.cdiv(seq_len, BT)):
        # in the loop, not hoisted: at 24 registers the slots' addresses of a three-slot ring were spilled
        slot = loop_variant(inputs.slot(c), c)
        if not rq_freed_with_inputs:
            terms.rq_bars.wait_empty(c)
        inputs.bars.wait_ready(c)
        if flags & L2NORM:
            _inverse_row_norms(inputs.q.index(slot), terms.rq.index(slot), scale, True)
        else:
            _inverse_row_norms(inputs.q.index(slot), terms.rq.index(slot), scale, False)
        terms.rq_bars.publish(c)
        inputs.bars.release(c)


@gluon.jit
def _gate_rows(gate_source, c, seq_len, HV, BT: gl.constexpr, layout: gl.constexpr):
    """g (in log2 units) and beta of chunk c's rows (gate_source: the program's head); 0 past the sequence's
    end, so gam stays flat there."""
    r = gl.arange(0, BT, layout)
    live = r < seq_len - c * BT
    offs = (c * BT + r).to(gl.int64) * HV
    return log2_units(gate_source.log_decay(offs, live)), gate_source.betas(offs, live)


@gluon.jit
def _publish_gates(gates, c, g, beta):
    """gam = cumsum(g), beta and gam_last of chunk c into its gate slot, which the caller knows to be free."""
    slot = gates.slot(c)
    gates.gam.index(slot).store(gl.associative_scan(g, 0, _add))
    gates.beta.index(slot).store(beta)
    gates.gam_last.index(slot).store(gl.zeros_like(g) + gl.sum(g, axis=0))
    gates.bars.publish(c)


@gluon.jit
def _request_inputs(inputs, q_desc, k_desc, v_desc, c, row_chunk=None):
    """TMA of the q, k and (unless v_desc is None) v tiles of the sequence's chunk row_chunk (default c) into chunk
    c's input slot, once the slot is free."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    nbytes: gl.constexpr = q_desc.block_type.nbytes + k_desc.block_type.nbytes + (
        0 if v_desc is None else v_desc.block_type.nbytes)
    row = c * BT if row_chunk is None else row_chunk * BT
    slot = inputs.slot(c)
    inputs.bars.wait_empty(c)
    ready = inputs.bars.ready_bar(c)
    mbarrier.expect(ready, nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, 0], ready, inputs.q.index(slot))
    tma.async_copy_global_to_shared(k_desc, [row, 0], ready, inputs.k.index(slot))
    if v_desc is not None:
        tma.async_copy_global_to_shared(v_desc, [row, 0], ready, inputs.v.index(slot))


@gluon.jit
def _wait_gate_slot(gates, terms, c):
    """Until chunk c's gate slot is free: its last user, the aux partition, has published the terms of chunk
    c - n (n the gate ring's slots). That ready barrier stands for the gate ring's empty one (chunk_rings)."""
    n: gl.constexpr = gates.gam.shape[0]
    if c >= n:
        terms.bars.wait_ready(c - n)


@gluon.jit
def _load_partition(inputs, gates, terms, q_desc, k_desc, v_desc, gate_source, seq_len, HV):
    """For each chunk c: chunk c + 1's gates into the gate ring (they wait only for their slot, which the aux
    partition frees at the end of chunk c - 1), then the TMA of chunk c + 1's q, k, v tiles (as soon as their slot
    is free: the state partition frees it at the end of chunk c - 1). The gates go a chunk ahead of the tiles
    because the input slot's wait ties this loop to the state's pace: published after it, they made the aux
    partition wait for them (a fifth of its time, in an ncu profile). Their rows are read from HBM at the end of
    the loop, a chunk before they are published."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    # every warp holds all BT rows, so the cumsum is a warp-level scan
    rows: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [gl.num_warps()], [0])
    n_chunks = gl.cdiv(seq_len, BT)
    g, beta = _gate_rows(gate_source, 0, seq_len, HV, BT, rows)
    if n_chunks > 0:
        _publish_gates(gates, 0, g, beta)
        _request_inputs(inputs, q_desc, k_desc, v_desc, 0)
    g, beta = _gate_rows(gate_source, 1, seq_len, HV, BT, rows)
    for c in range(n_chunks):
        if c + 1 < n_chunks:
            _wait_gate_slot(gates, terms, c + 1)
            _publish_gates(gates, c + 1, g, beta)
            _request_inputs(inputs, q_desc, k_desc, v_desc, c + 1)
        g, beta = _gate_rows(gate_source, c + 2, seq_len, HV, BT, rows)


@gluon.jit
def _terms_load_partition(inputs, gates, q_desc, k_desc, gate_source, seq_len, HV, exchange):
    """A terms program's loads: for each of its ring's chunks, once the ring slot is free (both state programs
    imported the chunk EXCHANGE_SLOTS before it), the gates and the TMA of q and k (no v) into the local slot j,
    which the aux partition frees right after q k^T."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    rows: gl.constexpr = gl.BlockedLayout([BT // 32], [32], [gl.num_warps()], [0])
    for j in range(exchange.local_chunks(gl.cdiv(seq_len, BT))):
        c = exchange.chunk(j)
        g, beta = _gate_rows(gate_source, c, seq_len, HV, BT, rows)
        gates.bars.wait_empty(j)
        exchange.wait_free(j)
        _publish_gates(gates, j, g, beta)
        _request_inputs(inputs, q_desc, k_desc, None, j, c)


@gluon.jit
def publish_row_scalings(terms, gates, c, seq_len, rows: gl.constexpr):
    """Chunk c's aux rows of the scalings into the terms ring, from the gate ring, as one [SCALINGS, BT] tensor (a
    thread a column) and one store: row by row, into one allocation, Triton ordered each store after the one
    before by a partition barrier. Returns beta rk in the `rows` layout, the row factor of A (both arches' aux
    partitions)."""
    BT: gl.constexpr = gates.gam.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([SCALINGS // 2, 1], [2, 16], [1, gl.num_warps()], [0, 1])
    cols: gl.constexpr = gl.SliceLayout(0, layout)
    slot = gates.slot(c)
    gam = gates.gam.index(slot).load(cols)
    rk = gates.rk.index(slot).load(cols)
    gam_last = gates.gam_last.index(slot).load(cols)
    e_gam = gl.exp2(gam)
    # rows past the sequence's end get v_dec = 0, so they never reach the state
    v_scale = gl.where(gl.arange(0, BT, cols) < seq_len - c * BT, gl.exp2(gam_last - gam) * rk, 0.0)
    row = gl.expand_dims(gl.arange(0, SCALINGS, gl.SliceLayout(1, layout)), 1)
    scalings = gl.where(row == BETA, gl.expand_dims(gates.beta.index(slot).load(cols), 0),
                        gl.where(row == K_SCALE, gl.expand_dims(-e_gam * rk, 0),
                                 gl.where(row == V_SCALE, gl.expand_dims(v_scale, 0),
                                          gl.where(row == O_SCALE, gl.expand_dims(e_gam, 0),
                                                   gl.expand_dims(gl.exp2(gam_last), 0)))))
    terms.slot_scalings(c).store(scalings)
    return gates.beta.index(slot).load(rows) * gates.rk.index(slot).load(rows)


@gluon.jit
def chunk_decay(gates, c, gam_r, causal, n_rows, cols: gl.constexpr):
    """e^(gam_t - gam_s) rk_s of chunk c on the causal triangle of its live rows (t >= s, t < n_rows), else 0;
    gam_r in the rows layout, `causal` the mask t >= s (causal_mask, or a compare of row and column indices). The
    exponent is -inf off the triangle, so exp is never taken of a positive gam_t - gam_s (s > t), which can
    overflow; the live-row bound goes into the rows' exponents (gam_t = -inf for t >= n_rows: two values a thread),
    so the tile takes one masked pass, the causal one."""
    slot = gates.slot(c)
    r = gl.arange(0, gam_r.shape[0], gam_r.type.layout)
    gam_t = gl.where(r < n_rows, gam_r, -float("inf"))
    exponent = gl.expand_dims(gam_t, 1) - gl.expand_dims(gates.gam.index(slot).load(cols), 0)
    return gl.exp2(gl.where(causal, exponent, -float("inf"))) * gl.expand_dims(gates.rk.index(slot).load(cols), 0)


@gluon.jit
def causal_mask(like, c):
    """t >= s (row t, column s) over a [BT, BT] tile in the layout of `like` (the wgmma accumulator's), for chunk c.
    Viewed as [NB, BLOCK, NB, BLOCK] blocks, it is a compare of block indices or, in a diagonal block, of in-block
    indices: a thread compares its block row (a warp's) with each of its block columns and its in-block rows with
    its in-block columns, the same in every block, instead of every pair of indices (from those, ptxas rebuilt
    the column indices from the lane id over and over: the sm_90a gdn_fused aux loop had 40 instructions more).
    The block row is a value of the chunk: hoisted out of the loop, its compares were spilled as booleans in the
    fixed-length and gating variants (up to 7 local loads and stores a chunk instead of 1-3)."""
    BT: gl.constexpr = like.shape[0]
    NB: gl.constexpr = BT // BLOCK
    like4 = gl.reshape(like, [NB, BLOCK, NB, BLOCK])
    l4: gl.constexpr = like4.type.layout
    block_row, block_col = _block_indices(like4)
    block_row = block_row + loop_variant(0, c)
    row = gl.arange(0, BLOCK, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
    col = gl.arange(0, BLOCK, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, l4))))
    row = gl.expand_dims(gl.expand_dims(gl.expand_dims(row, 0), 2), 3)
    col = gl.expand_dims(gl.expand_dims(gl.expand_dims(col, 0), 1), 2)
    keep = (block_row > block_col) | ((block_row == block_col) & (row >= col))
    return gl.convert_layout(gl.reshape(keep, [BT, BT]), like.type.layout)


@gluon.jit
def publish_inverse(terms, c, tc, dtype: gl.constexpr):
    """Tv = Tc diag(beta) of chunk c into the terms ring (beta from the chunk's BETA row, which
    publish_row_scalings wrote)."""
    cols: gl.constexpr = gl.SliceLayout(0, tc.type.layout)
    terms.tc_v.index(terms.slot(c)).store((tc * gl.expand_dims(terms.scaling(c, BETA).load(cols), 0)).to(dtype))


@gluon.jit
def _stage(tile, x):
    """x -> the fp16 shared tile the next products read as their B operand; fenced for the tensor cores' (async)
    proxy, then every warp of the partition waits for the others' stores."""
    tile.store(x.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _product(a, b_tile, acc, use_acc: gl.constexpr):
    """acc (+)= a b on the tensor cores, issued asynchronously: a fp32 in the accumulator layout, passed as the fp16
    register A operand (the same registers, no shuffle), b the staged fp16 tile [K, N]."""
    a_op: gl.constexpr = gl.DotOperandLayout(0, a.type.layout, 2)  # acc may be a product still in flight
    return warpgroup_mma(gl.convert_layout(a.to(gl.float16), a_op), b_tile, acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _block_indices(x4):
    """Block row and block column indices, [NB, 1, 1, 1] and [1, 1, NB, 1], of x4, a [NB, BLOCK, NB, BLOCK] view of
    a [BT, BT] tile."""
    NB: gl.constexpr = x4.shape[0]
    l4: gl.constexpr = x4.type.layout
    rows = gl.arange(0, NB, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
    cols = gl.arange(0, NB, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, l4))))
    return (gl.expand_dims(gl.expand_dims(gl.expand_dims(rows, 1), 2), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(cols, 0), 1), 3))


@gluon.jit
def _same_block(x4):
    """[NB, 1, NB, 1] mask of the diagonal blocks of x4, a [NB, BLOCK, NB, BLOCK] view of a [BT, BT] tile."""
    block_row, block_col = _block_indices(x4)
    return block_row == block_col


@gluon.jit
def _in_block_indices(layout: gl.constexpr):
    """Row and column indices within a block, [1, BLOCK, 1] and [1, 1, BLOCK], of a [NB, BLOCK, BLOCK] batch of
    blocks in `layout`."""
    rows = gl.arange(0, BLOCK, gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    cols = gl.arange(0, BLOCK, gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    return gl.expand_dims(gl.expand_dims(rows, 0), 2), gl.expand_dims(gl.expand_dims(cols, 0), 1)


@gluon.constexpr_function
def _rows_hold_every_column(layout):
    """Whether a thread holding an entry of a [BT, BT] tile in `layout` holds its whole row: the sm_90a wgmma
    accumulator with every warp along the rows (sm_100a's tensor-memory loads of a 64-row tile split a row's columns
    between warps)."""
    return isinstance(layout, gl.NVMMADistributedLayout) and layout.warps_per_cta[1] == 1


@gluon.jit
def _diagonal_blocks(x):
    """The diagonal [BLOCK, BLOCK] blocks of a [BT, BT] x, [BT / BLOCK, BLOCK, BLOCK]. In the wgmma accumulator
    layout a thread's rows (one block row, its warp's) hold every column block in registers, so picking the
    diagonal one is three selects an entry on the block row; as a masked sum over the column blocks (four selects
    and three adds an entry, what other layouts take) the sm_90a gdn_fused aux loop had 53 instructions more and the
    kernel was 1 % slower."""
    NB: gl.constexpr = x.shape[0] // BLOCK
    if _rows_hold_every_column(x.type.layout):
        gl.static_assert(NB == 4, "four column blocks: two register bits of the column index")
        # column block 2 a + b as two size-2 dimensions, moved last, so that split takes them apart in registers
        x5 = gl.permute(gl.reshape(x, [NB, BLOCK, 2, 2, BLOCK]), [0, 1, 4, 2, 3])
        b0, b1 = gl.split(x5)
        x0, x2 = gl.split(b0)
        x1, x3 = gl.split(b1)
        block_row = gl.arange(0, NB, gl.SliceLayout(1, gl.SliceLayout(2, x0.type.layout)))
        block_row = gl.expand_dims(gl.expand_dims(block_row, 1), 2)
        return gl.where(block_row == 0, x0, gl.where(block_row == 1, x1, gl.where(block_row == 2, x2, x3)))
    else:
        x4 = gl.reshape(x, [NB, BLOCK, NB, BLOCK])
        return gl.sum(gl.where(_same_block(x4), x4, 0.0), axis=2)


@gluon.jit
def _off_diagonal_blocks(x):
    """x [BT, BT] with its diagonal [BLOCK, BLOCK] blocks zeroed (the block index of a column is a register's,
    that of a row a warp's, so the mask is a few compares, not one an element). x must be finite: the mask is a
    product, because as a select ptxas applies it to the packed fp16 halves of the staged tile (40 instructions
    more a chunk)."""
    BT: gl.constexpr = x.shape[0]
    x4 = gl.reshape(x, [BT // BLOCK, BLOCK, BT // BLOCK, BLOCK])
    return gl.reshape(x4 * (1.0 - _same_block(x4).to(gl.float32)), [BT, BT])


def _forward_substitution_ptx():
    """PTX of _invert_diagonal_blocks for one thread's 8 entries of its warp's block: outputs $0-$7 X, inputs
    $8-$15 Nb (strictly lower), $16-$23 the identity, $24-$31 the thread's lane l (8 copies), each in
    BLOCK_REGISTERS' order.

    In 8 x 8 quarters the block is I - Nb = [[I - N11, 0], [-N21, I - N22]], and X = [[X11, 0], [X22 N21 X11, X22]]
    with X11, X22 the inverses of the diagonal quarters. Lane l holds rows l // 4 and l // 4 + 8 (register row
    halves) in columns 2 (l % 4) + {0, 1} and + 8 (column halves): X11 is row half 0 in column half 0, X22 row
    half 1 in column half 1, so one forward substitution solves both. Step s adds Nb[t, s] X[s, :] to every row t
    of each quarter (row s is final by then, and Nb[t, s] = 0 for t <= s): lane 4 s + l % 4 holds row s of both
    quarters in lane l's columns, lane 4 (l // 4) + s // 2 column s of lane l's rows. 7 dependent steps of 4
    shuffles of X, 2 of Nb (off the chain) and 4 FMA. The lower-left quarter then takes two 8 x 8 x 8 tensor-core
    products (mma.sync m16n8k8, fp16 operands, fp32 accumulation, rows 8-15 of its 16 the quarter): Y = N21 X11,
    then X22 Y. A quarter in these registers is the m16n8k8 A operand as it is (two fp16 a register) and, through
    one movmatrix (transpose), its B operand. (The 16-row substitution took 15 steps and 67 shuffles, and blocked
    by 8 with shuffles only, 9 steps and 90 shuffles made the kernel 4 % slower: the shuffles share the
    shared-memory pipe with both partitions' loads and stores.)"""
    def reg(row_half, col_half, col_bit):
        return col_bit + 2 * row_half + 4 * col_half

    def pack(dst, hi, lo):  # two fp32 as the fp16 pair of one register, the lower column in the low half
        return f"cvt.rn.f16x2.f32 {dst}, {hi}, {lo};"
    mma = "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32"
    lines = ["{", ".reg .u32 pair, quad, xsrc, nsrc;", ".reg .f32 x<8>, xs<4>, ns<2>, y<4>, z<4>, zero;",
             ".reg .b32 upper, n21, x11, x11t, y21, y21t, x22;",
             "and.b32 pair, $24, 3;", "and.b32 quad, $24, 28;", "mov.b32 zero, 0f00000000;", "mov.b32 upper, 0;"]
    lines += [f"mov.b32 x{r}, ${16 + r};" for r in range(8)]
    for s in range(BLOCK.value // 2 - 1):
        lines += [f"or.b32 xsrc, pair, {4 * s};", f"or.b32 nsrc, quad, {s // 2};"]
        lines += [f"shfl.sync.idx.b32 xs{2 * h + cb}, x{reg(h, h, cb)}, xsrc, 31, -1;" for h in (0, 1) for cb in (0, 1)]
        lines += [f"shfl.sync.idx.b32 ns{h}, ${8 + reg(h, h, s % 2)}, nsrc, 31, -1;" for h in (0, 1)]
        lines += [f"fma.rn.f32 x{reg(h, h, cb)}, ns{h}, xs{2 * h + cb}, x{reg(h, h, cb)};"
                  for h in (0, 1) for cb in (0, 1)]
    # the A operands' rows 0-7 ("upper") are zero: only rows 8-15 of each product are used
    lines += [pack("n21", f"${8 + reg(1, 0, 1)}", f"${8 + reg(1, 0, 0)}"),
              pack("x11", f"x{reg(0, 0, 1)}", f"x{reg(0, 0, 0)}"),
              "movmatrix.sync.aligned.m8n8.trans.b16 x11t, x11;",
              f"{mma} {{y0, y1, y2, y3}}, {{upper, n21}}, {{x11t}}, {{zero, zero, zero, zero}};",
              pack("y21", "y3", "y2"),
              "movmatrix.sync.aligned.m8n8.trans.b16 y21t, y21;",
              pack("x22", f"x{reg(1, 1, 1)}", f"x{reg(1, 1, 0)}"),
              f"{mma} {{z0, z1, z2, z3}}, {{upper, x22}}, {{y21t}}, {{zero, zero, zero, zero}};",
              f"mov.b32 x{reg(1, 0, 0)}, z2;", f"mov.b32 x{reg(1, 0, 1)}, z3;"]
    lines += [f"mov.b32 ${r}, x{r};" for r in range(8)]
    return "\n".join(lines + ["}"])


FORWARD_SUBSTITUTION = gl.constexpr(_forward_substitution_ptx())
FORWARD_SUBSTITUTION_OPERANDS = gl.constexpr(",".join(["=f"] * 8 + ["f"] * 16 + ["r"] * 8))
# a warp's diagonal block of a [BT, BT] wgmma accumulator, [BT / BLOCK, BLOCK, BLOCK] (block, row, column): lane l
# holds rows l // 4 + {0, 8} and columns 2 (l % 4) + {0, 1, 8, 9} of it, its registers ordered by column bit 0, row
# bit 3, column bit 3 (the layout of _diagonal_blocks' result, named so that the PTX can rely on it)
BLOCK_REGISTERS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8]], lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, BLOCK, BLOCK]))


@gluon.jit
def _invert_diagonal_blocks(neg_a):
    """D^-1 = (I - Nb)^-1 for Nb the diagonal 16 x 16 blocks of -A (neg_a, [BT, BT] in the wgmma accumulator
    layout), [BT / BLOCK, BLOCK, BLOCK] in BLOCK_REGISTERS: its two diagonal 8 x 8 quarters by forward substitution
    in fp32 on the CUDA cores, the third by two fp16 tensor-core products (FORWARD_SUBSTITUTION).

    Warp b holds block b of the accumulator already (two rows and four columns a thread), so the inverse is taken
    where the block is: 7 dependent steps of warp shuffles and FMA, then the two products (PTX, because Gluon has
    neither a lane shuffle nor a warp-level MMA on registers), no shared memory and no barrier. Staged for a
    thread a column and brought back to the accumulator layout, as before, it cost 4 % more of the kernel's time.
    The lane comes in as an operand: read in the loop (S2R), it waited behind the partition's shared-memory stores
    (1 %)."""
    blocks = gl.convert_layout(_diagonal_blocks(neg_a), BLOCK_REGISTERS)
    t, col = _in_block_indices(BLOCK_REGISTERS)
    eye = gl.where(t == col, 1.0, 0.0) + gl.zeros_like(blocks)
    lane = 4 * (t % 8) + (col % 8) // 2
    return gl.inline_asm_elementwise(FORWARD_SUBSTITUTION, FORWARD_SUBSTITUTION_OPERANDS,
                                     [gl.where(t > col, blocks, 0.0), eye, lane], dtype=gl.float32, is_pure=True,
                                     pack=8)


@gluon.jit
def _block_diagonal(blocks, like):
    """[BT, BT] in the layout of `like` (the wgmma accumulator layout) with `blocks` [BT / BLOCK, BLOCK, BLOCK] on
    its diagonal and zeros elsewhere: each block repeated along its block row, the off-diagonal copies zero, all
    in the registers that hold them."""
    NB: gl.constexpr = blocks.shape[0]
    view = gl.reshape(like, [NB, BLOCK, NB, BLOCK])
    blocks = gl.convert_layout(blocks, gl.SliceLayout(2, view.type.layout))
    spread = gl.where(_same_block(view), gl.expand_dims(blocks, 2), 0.0)
    return gl.convert_layout(gl.reshape(spread, [NB * BLOCK, NB * BLOCK]), like.type.layout)


@gluon.jit
def _unit_lower_inverse(d_blocks, l_tile, n_tile, d_tile, zero):
    """(I + A)^-1 for strictly lower-triangular A [BT, BT] (BT = 64), blocked by 16 (docs/algorithm.md): I + A =
    D (I + N) with D = I + Lb, Lb the diagonal 16 x 16 blocks of A and L the rest, N = D^-1 L, N^4 = 0.
    d_blocks holds D^-1's blocks (_invert_diagonal_blocks), l_tile -L and d_tile D^-1 (fp16, staged by
    InverseScratch.stage and stage_diagonal). Then fp16 wgmma (fp16 has tf32's 10-bit mantissa), accumulation in
    fp32, in three round trips:
        N' = D^-1 (-L) = -N;  then N'^2 and W = (I + N') D^-1 together;  Tc = W + N'^2 W
    W's accumulation starts from D^-1. N'^2 and W take every operand from shared memory, so that their two
    accumulators are the only registers they hold (one round trip fewer: 0.5-1 % of the kernel). N' with D^-1 as
    its register A operand either spills (14 values) or makes ptxas serialise every wgmma (C7512). A tile is
    rewritten at least two stages after its last read, so the barrier of the stage in between orders every warp's
    wgmma wait before the store; W is staged in l_tile, whose one read, N', is a stage before it. The
    warp-specialised gdn_prepare shares this inverse (InverseScratch)."""
    n = warpgroup_mma(d_tile, l_tile, zero, use_acc=False, is_async=True)  # N' = -N
    n = warpgroup_mma_wait(0, deps=[n])
    _stage(n_tile, n)
    n2 = warpgroup_mma(n_tile, n_tile, zero, use_acc=False, is_async=True)
    w = warpgroup_mma(n_tile, d_tile, _block_diagonal(d_blocks, zero), use_acc=True, is_async=True)  # D^-1 + N' D^-1
    n2, w = warpgroup_mma_wait(0, deps=[n2, w])
    _stage(l_tile, w)
    tc = _product(n2, l_tile, w, use_acc=True)
    return warpgroup_mma_wait(0, deps=[tc])


@gluon.jit
def publish_key_norms(gates, c, kk, l2norm):
    """rk of chunk c into its gate slot: inverse_norm(|k_t|^2) of each k row t (fla's l2norm), read off the
    diagonal of k k^T, which the tensor cores compute anyway (1 without l2norm, the caller's flag bit, which
    gdn_fused and gdn_prepare name differently): the diagonal of its diagonal blocks, a select over a thread's 8
    entries of them instead of its 32 of the tile. Every aux partition's (both arches, gdn_fused and the
    warp-specialised gdn_prepare); every warp of it has stored its rows on return."""
    blocks = _diagonal_blocks(kk)
    NB: gl.constexpr = blocks.shape[0]
    layout: gl.constexpr = blocks.type.layout
    t, s = _in_block_indices(layout)
    diagonal = gl.sum(gl.where(t == s, blocks, 0.0), axis=2)
    rk = gates.rk.index(gates.slot(c))._reinterpret(gl.float32, [NB, BLOCK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if l2norm:
        rk.store(inverse_norm(diagonal))
    else:
        rk.store(gl.full_like(diagonal, 1.0))
    gl.thread_barrier()


@gluon.jit
def _wait_terms_slot(inputs, terms, c, o_in_terms: gl.constexpr):
    """Until chunk c's terms slot is free: its own release where o leaves through it, else the input slot's, which
    the state partition frees with it (chunk_rings)."""
    if o_in_terms:
        terms.bars.wait_empty(c)
    else:
        inputs.bars.wait_empty(c)


@gluon.jit
def _aux_partition(inputs, gates, terms, inverse, q_desc, seq_len, flags, first: gl.constexpr,
                   stride: gl.constexpr, o_in_terms: gl.constexpr, exchange=None):
    """The state-independent terms of chunks first, first + stride, ... (see the module docstring), into the terms
    ring: every chunk with stride 1; at BV = 64 two of these partitions take every other chunk each, so that two
    chunks' latency chains overlap (a chunk's terms never depend on another chunk's). o_in_terms: the terms slots
    are freed apart from the input slots (chunk_rings)."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.block_type.element_ty
    acc_tt: gl.constexpr = wgmma_layout(BT, BT, 4)
    rows: gl.constexpr = gl.SliceLayout(1, acc_tt)
    cols: gl.constexpr = gl.SliceLayout(0, acc_tt)
    zero = gl.zeros([BT, BT], gl.float32, acc_tt)
    n_chunks = gl.cdiv(seq_len, BT)
    if exchange is not None:
        # c below counts the ring's chunks; seq_len - c * BT rows are left from the sequence's chunk
        # exchange.chunk(c) = first_chunk + TERMS_PROGRAMS c
        n_chunks = exchange.local_chunks(n_chunks)
        seq_len = seq_len - exchange.first_chunk * BT
    for c in range(first, n_chunks, stride):
        # the chunk as a value of the loop: where each chunk of this partition takes the same slot, the slot's
        # tiles' descriptors were hoisted out of the loop as constants and spilled (23 reloads a chunk), and with
        # three slots a lane's offset into the gate slot was (one a chunk)
        c = loop_variant(c, c)
        slot = inputs.slot(c)  # of every ring: they have as many slots
        inputs.bars.wait_ready(c)
        q_s = inputs.q.index(slot)
        k_s = inputs.k.index(slot)
        # --- k k^T, the gates, and rk off the diagonal of k k^T
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        gates.bars.wait_ready(c)
        kk = warpgroup_mma_wait(0, deps=[kk])
        publish_key_norms(gates, c, kk, (flags & L2NORM) != 0)

        # --- the row scalings, A and its two parts, then P: only the decay matrix is live beside one product
        _claim_terms_slot(inputs, terms, c, o_in_terms, exchange, first, stride)
        gam_r = gates.gam.index(slot).load(rows)
        seq_c = seq_len
        if exchange is not None:
            seq_c = seq_len - (TERMS_PROGRAMS - 1) * c * BT
        a_rows = publish_row_scalings(terms, gates, c, seq_c, rows)
        decay = chunk_decay(gates, c, gam_r, causal_mask(zero, c), seq_c - c * BT, cols)
        # -A: the inverse takes the negated blocks (_unit_lower_inverse)
        neg_a = kk * decay * gl.expand_dims(-a_rows, 1)
        # q k^T in flight while -L is staged (ptxas places its wait inside the diagonal blocks' inverse); the decay,
        # which P needs after it, is held as fp16 pairs meanwhile (at fp32 nine values spilled)
        decay = decay.to(gl.float16)
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        d_blocks = inverse.stage(neg_a, c)
        qk = warpgroup_mma_wait(0, deps=[qk])
        if exchange is not None:
            _free_inputs(inputs, gates, slot)
        terms.p.index(slot).store((qk * decay.to(gl.float32)).to(dtype))
        # one fence and barrier for the -L, P and D^-1 tiles (P's consumer, the state partition, needs no more)
        inverse.stage_diagonal(c, d_blocks, zero)
        # (the input and gate slots are freed by the terms' publication: chunk_rings)
        tc = inverse.invert(c, d_blocks, zero)
        publish_inverse(terms, c, tc, dtype)
        fence_async_shared()
        _hand_over_terms(terms, c, exchange)
    if exchange is not None:
        if n_chunks > first:
            exchange.complete(first + (n_chunks - 1 - first) // stride * stride)


@gluon.jit
def _claim_terms_slot(inputs, terms, c, o_in_terms: gl.constexpr, exchange, first: gl.constexpr,
                      stride: gl.constexpr):
    """Before chunk c's terms are written: gdn_fused's aux partition waits for the terms slot (_wait_terms_slot); a
    terms program's owns its slot, and completes its last chunk's hand-over out of it (TermExchange.complete)."""
    if exchange is None:
        _wait_terms_slot(inputs, terms, c, o_in_terms)
    elif c >= first + stride:
        exchange.complete(c - stride)


@gluon.jit
def _free_inputs(inputs, gates, slot):
    """A terms program's aux partition frees chunk c's input and gate slots once q k^T is done (the load partition
    then feeds three chains): for the input slot's two arrivals, its own and the absent state partition's."""
    gl.thread_barrier()
    mbarrier.arrive(inputs.bars.empty.index(slot), count=2)
    mbarrier.arrive(gates.bars.empty.index(slot), count=1)


@gluon.jit
def _hand_over_terms(terms, c, exchange):
    """Chunk c's terms, fenced in their slot: to the state partition (gdn_fused), or into the exchange ring."""
    if exchange is None:
        terms.bars.publish(c)
    else:
        gl.thread_barrier()
        exchange.store(terms, c)


@gluon.jit
def _release_previous_terms(terms, c):
    """Chunk c - 1's terms slot goes back in chunk c, once the TMA store of its o has read the slot's Tv tile."""
    if c > 0:
        tma.store_wait(0)
        terms.bars.release(c - 1)


@gluon.jit
def _state_partition(state, inputs, terms, o_desc, o_stage, seq_len, checkpoints, i_v, o_in_terms: gl.constexpr):
    """The recurrence and the outputs (see the module docstring); returns the final state S = h^T and writes the
    checkpoints of V tile i_v (S is in no other partition's reach). o leaves through the o_stage tile, or with
    o_in_terms through its chunk's Tv tile, whose terms slot then goes back in the next chunk (chunk_rings)."""
    BT: gl.constexpr = o_desc.block_type.shape[0]
    V: gl.constexpr = state.shape[0]  # the program's BV value rows
    dtype: gl.constexpr = o_desc.block_type.element_ty
    acc_vk: gl.constexpr = state.type.layout
    acc_vt: gl.constexpr = wgmma_layout(V, BT, gl.num_warps())
    op_vt: gl.constexpr = gl.DotOperandLayout(0, acc_vt, 2)  # register A operand of the [V, BT] products
    op_vk: gl.constexpr = gl.DotOperandLayout(0, acc_vk, 2)  # and of the state update
    cols_vt: gl.constexpr = gl.SliceLayout(0, acc_vt)
    for c in range(gl.cdiv(seq_len, BT)):
        slot = inputs.slot(c)  # of the input, terms and rq rings alike
        inputs.bars.wait_ready(c)
        q_s = inputs.q.index(slot)
        k_s = inputs.k.index(slot)
        # kh = S k^T (critical path) and S q^T (beside it) from the state in registers
        s_op = gl.convert_layout(state.to(dtype), op_vt)
        kh = warpgroup_mma(s_op, k_s.permute((1, 0)), gl.zeros([V, BT], gl.float32, acc_vt), use_acc=False,
                           is_async=True)
        qh = warpgroup_mma(s_op, q_s.permute((1, 0)), gl.zeros([V, BT], gl.float32, acc_vt), use_acc=False,
                           is_async=True)
        if o_in_terms:
            _release_previous_terms(terms, c)
        terms.bars.wait_ready(c)
        kh, qh = warpgroup_mma_wait(0, deps=[kh, qh])

        # v_new = (v^T - kh diag(e^gam rk)) (Tc diag(beta))^T in one product: v^T comes from its TMA tile by
        # transposing ldmatrix in the A operand layout, which is the accumulator's (the conversion is free)
        v_t = gl.convert_layout(inputs.v.index(slot).permute((1, 0)).load(op_vt), acc_vt)
        u = v_t.to(gl.float32) + kh * gl.expand_dims(terms.scaling(c, K_SCALE).load(cols_vt), 0)
        v_new = warpgroup_mma(gl.convert_layout(u.to(dtype), op_vt), terms.tc_v.index(slot).permute((1, 0)),
                              gl.zeros([V, BT], gl.float32, acc_vt), use_acc=False, is_async=True)
        o = qh * gl.expand_dims(terms.scaling(c, O_SCALE).load(cols_vt), 0)
        v_scale = terms.scaling(c, V_SCALE).load(cols_vt)
        state_decay = terms.state_decay(c)
        v_new = warpgroup_mma_wait(0, deps=[v_new])

        # S = e^gl S + v_new diag(e^(gl - gam) rk) k, and o = o + v_new P^T
        v_dec = gl.convert_layout((v_new * gl.expand_dims(v_scale, 0)).to(dtype), op_vk)
        state = warpgroup_mma(v_dec, k_s, state * state_decay, is_async=True)
        o = warpgroup_mma(gl.convert_layout(v_new.to(dtype), op_vt), terms.p.index(slot).permute((1, 0)), o,
                          is_async=True)
        state, o = warpgroup_mma_wait(0, deps=[state, o])
        terms.rq_bars.wait_ready(c)
        o = o * gl.expand_dims(terms.rq.index(slot).load(cols_vt), 0)
        # the chunk's input slot and rq go back, and its terms with them unless o leaves through them (chunk_rings)
        inputs.bars.release(c)

        # o^T -> [BT, V] staging tile -> HBM: the chunk's Tv tile, read by v_new's product above, or o_stage, which
        # the store of chunk c - 1 left a chunk ago
        if o_in_terms:
            o_tile = terms.tc_v.index(slot)
        else:
            tma.store_wait(0)
            o_tile = o_stage
        gl.thread_barrier()
        o_tile.store(gl.permute(o.to(dtype), [1, 0]))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [c * BT, 0], o_tile)
        # last in the chunk, with o's registers free: S = h^T, written as the [K, V] tile h
        checkpoints.store_after(gl.permute(state, [1, 0]), c, seq_len, i_v)
    tma.store_wait(0)
    return (state, )


@gluon.jit
def _import_partition(terms, exchange, seq_len, BT: gl.constexpr, first: gl.constexpr, stride: gl.constexpr):
    """A state program's terms of chunks first, first + stride, ...: from the exchange into the terms ring by TMA,
    once the slot is free (the state releases it in the next chunk, after o's store has read its Tv tile). The
    copies complete on their own; the state's release of chunk c's slot says that every chunk up to c - n (n the
    ring's slots) has landed, so the importer marks its copy of the chunk `lag` of its own before c consumed then,
    off the copy's path."""
    n: gl.constexpr = terms.p.shape[0]
    lag: gl.constexpr = (n + stride - 1) // stride
    gl.static_assert(lag < EXCHANGE_SLOTS, "an importer counts a ring slot consumed `lag` chunks late: fewer than "
                                           "the ring's slots, or terms programs and importers wait for each other")
    for c in range(first, gl.cdiv(seq_len, BT), stride):
        c = loop_variant(c, c)
        j = c // stride
        terms.bars.wait_empty(c)
        if j >= lag:
            exchange.mark_consumed(j - lag)
        exchange.import_into(terms, c, j)


@gluon.jit
def _state_or_export(is_terms, state, inputs, gates, terms, exchange, third, q_desc, o_desc, seq_len, checkpoints,
                     i_v, flags):
    """gdn_fused_terms' default partition: a state program's state, a terms program's third aux chain."""
    if is_terms:
        _aux_partition(inputs, gates, terms, third, q_desc, seq_len, flags, 2, 3, True, exchange)
    else:
        state = _state_partition(state, inputs, terms, o_desc, None, seq_len, checkpoints, i_v, True)[0]
    return (state, )


@gluon.jit
def _aux_or_import(is_terms, inputs, gates, terms, inverse, exchange, q_desc, seq_len, flags, first: gl.constexpr,
                   stride: gl.constexpr):
    """gdn_fused_terms' two 4-warp partitions: a terms program's first two aux chains (every third of its chunks
    each), a state program's importers (every other chunk each)."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    if is_terms:
        _aux_partition(inputs, gates, terms, inverse, q_desc, seq_len, flags, first, 3, True, exchange)
    else:
        _import_partition(terms, exchange, seq_len, BT, first, stride)


@gluon.jit
def _load_or_terms_load(is_terms, inputs, gates, terms, q_desc, k_desc, v_desc, gate_source, seq_len, HV, exchange):
    """gdn_fused_terms' load warps: q, k and the gates of a terms program's chunks, or q, k, v of a state program's."""
    if is_terms:
        _terms_load_partition(inputs, gates, q_desc, k_desc, gate_source, seq_len, HV, exchange)
    else:
        _input_load_partition(inputs, q_desc, k_desc, v_desc, seq_len)


@gluon.jit
def _input_load_partition(inputs, q_desc, k_desc, v_desc, seq_len):
    """A state program's loads when its terms come from terms programs: its q, k and v tiles only. Its gate ring
    is unused, and waiting there for the terms of chunk c - n (the gate slot's release in gdn_fused) could miss that
    phase: the importers, which need no gates, may publish chunk c + 1 into the same terms slot first (found by
    bench/ring_model.py)."""
    BT: gl.constexpr = q_desc.block_type.shape[0]
    for c in range(gl.cdiv(seq_len, BT)):
        _request_inputs(inputs, q_desc, k_desc, v_desc, c)


@gluon.jit
def _norms_unless_terms(is_terms, inputs, terms, q_desc, seq_len, scale, flags):
    """gdn_fused_terms' norms warps: a state program's rq (a terms program has no output to scale)."""
    if not is_terms:
        _norms_partition(inputs, terms, q_desc, seq_len, scale, flags, True)


@gluon.jit
def state_slot(i_n, state_indices, flags):
    """Sequence i_n's state slot: i_n, or the caller's pool slot (a negative one starts from zero and is not
    written)."""
    slot = i_n
    if flags & USE_INDICES:
        slot = gl.load(state_indices + i_n)
    return slot


@gluon.jit
def head_tiles(q, k, v, o, gate_source, bos, seq_len, i_h, i_hv, i_v, H, HV, K: gl.constexpr, V: gl.constexpr,
               BV: gl.constexpr, BT: gl.constexpr):
    """The program's TMA descriptors over its sequence's q, k (key head i_h), v and o (value head i_hv, columns of
    V tile i_v) rows, with the sequence's length as row bound (a chunk's tail is zero-filled on load and clipped on
    store, never the next sequence's rows), and the source of the head's gates with offsets from the sequence's
    first row."""
    row0 = bos.to(gl.int64)
    q_desc = row_tile_desc(q + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    k_desc = row_tile_desc(k + row0 * H * K + i_h * K, H * K, seq_len, BT, K)
    v_desc = row_tile_desc(v + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    o_desc = row_tile_desc(o + row0 * HV * V + i_hv * V + i_v * BV, HV * V, seq_len, BT, BV)
    return q_desc, k_desc, v_desc, o_desc, gate_source.rows(row0, HV)


@gluon.jit
def input_and_gate_rings(q_desc, k_desc, v_desc, consumers: gl.constexpr, gate_consumers: gl.constexpr,
                         slots: gl.constexpr = NUM_SLOTS):
    """The inputs ring and the gate ring (gdn_fused's, and the warp-specialised gdn_prepare's), `slots` slots
    each, emptied by `consumers` and `gate_consumers` partitions."""
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # rows of [BT] vectors
    inputs = InputRing(gl.allocate_shared_memory(dtype, [slots, BT, K], q_desc.layout),
                       gl.allocate_shared_memory(dtype, [slots, BT, K], k_desc.layout),
                       gl.allocate_shared_memory(dtype, [slots, BT, V], v_desc.layout),
                       SlotBarriers.make(1, consumers, slots))
    gates = GateRing(gl.allocate_shared_memory(gl.float32, [slots, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [slots, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [slots, BT], plain),
                     gl.allocate_shared_memory(gl.float32, [slots, BT], plain),
                     SlotBarriers.make(1, gate_consumers, slots))
    return inputs, gates


@gluon.jit
def chunk_rings(q_desc, k_desc, v_desc, slots: gl.constexpr = NUM_SLOTS):
    """The inputs ring (emptied by the state and the norms partition), the gate ring and the terms ring. Each
    arrive costs its partition a barrier (Triton's barrier analysis puts one between an arrive and the next
    shared-memory access), so the slots of a chunk are freed by as few arrives as their readers' order allows:
      * the aux partition's reads of an input and a gate slot are over before it publishes the chunk's terms:
        the state partition waits for those before it frees the input slot, and the load partition
        before it refills the gate slot (_wait_gate_slot);
      * on sm_90a the state partition frees a chunk's input slot after its last read of the chunk's terms and rq:
        the aux partition waits for that before it rewrites a terms slot (with o leaving through the terms, at
        BV = 64, for the terms slot's own release, in the next chunk: _release_previous_terms), and the norms
        partition writes rq only once the next inputs of the slot have landed (_norms_partition with
        rq_freed_with_inputs);
      * the sm_100a state partition frees the input slot from the tensor cores, before it reads O_SCALE and rq:
        there the terms and rq slots keep their empty barriers.
    The gate ring's empty barriers are unused, and so are rq's on sm_90a and the terms' at its BV = 128."""
    dtype: gl.constexpr = q_desc.block_type.element_ty
    BT: gl.constexpr = q_desc.block_type.shape[0]
    tile_tt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dtype)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # rows of [BT] vectors
    inputs, gates = input_and_gate_rings(q_desc, k_desc, v_desc, 2, 1, slots)
    terms = TermRing(gl.allocate_shared_memory(dtype, [slots, BT, BT], tile_tt),
                     gl.allocate_shared_memory(dtype, [slots, BT, BT], tile_tt),
                     gl.allocate_shared_memory(gl.float32, [slots * SCALINGS, BT], plain),
                     SlotBarriers.make(1, 1, slots),
                     gl.allocate_shared_memory(gl.float32, [slots, BT], plain), SlotBarriers.make(1, 1, slots))
    return inputs, gates, terms


@gluon.jit
def fused_kernel(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, h0, ht, state_indices, o, scale, T, H, HV, flags,
                 state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens,
                 exchange_tiles, exchange_scalings, exchange_counters,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, IS_VARLEN: gl.constexpr,
                 TRANSPOSE_STATE: gl.constexpr, GATING: gl.constexpr, CHECKPOINTS: gl.constexpr,
                 TERMS_PROGRAM: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(num_warps * 16 == BV, "the default partition is the state's BV / 64 warpgroups")
    gl.static_assert((BV == 64) | (BV == 128), "a V tile is one or two warpgroups' 64 rows")
    gl.static_assert(BT == 64, "one warpgroup owns a chunk's 64 rows in the aux partition")
    gl.static_assert((not TERMS_PROGRAM) | ((BV == 64) & (V == 128) & (TERMS_PROGRAMS == 2)),
                     "terms programs serve two 64-row state programs, one importer partition a terms program")
    dtype: gl.constexpr = q.dtype.element_ty
    i_n, i_hv = sequence_and_head(HV, HEAD_MAJOR)  # a sequence's heads start together
    i_h = i_hv // (HV // H)
    i_v = gl.program_id(2)
    if TERMS_PROGRAM:  # V tiles 0 .. V / BV - 1: state programs; then TERMS_PROGRAMS terms programs
        is_terms = i_v >= V // BV
        terms_index = gl.maximum(i_v - V // BV, 0)
        i_v = gl.minimum(i_v, V // BV - 1)
    else:
        is_terms = False
    bos, seq_len = sequence_bounds(i_n, cu_seqlens, T, IS_VARLEN)

    # --- the state tile S = h^T [BV, K] in the wgmma accumulator layout of the state warpgroups
    acc_vk: gl.constexpr = wgmma_layout(BV, K, num_warps)
    io: gl.constexpr = state_io_layout(K, BV, TRANSPOSE_STATE, num_warps)
    slot = state_slot(i_n, state_indices, flags)
    h = load_state_tile(h0, slot, i_hv, i_v, HV, ((flags & HAS_H0) != 0) & (slot >= 0) & (not is_terms), K, V, BV,
                        TRANSPOSE_STATE, io)
    state = gl.convert_layout(gl.permute(h, [1, 0]), acc_vk)

    gate_source = GateSource.make(g + i_hv, beta + i_hv, A_log, dt_bias, i_hv, flags, GATING, GATE_IN_KERNEL)
    q_desc, k_desc, v_desc, o_desc, gate_source = head_tiles(q, k, v, o, gate_source, bos, seq_len, i_h, i_hv, i_v,
                                                             H, HV, K, V, BV, BT)
    checkpoints = Checkpoints(state_checkpoints, checkpoint_rows, checkpoint_cu_starts, checkpoint_every_n_tokens, HV,
                              BT, V, TRANSPOSE_STATE, CHECKPOINTS, HEAD_MAJOR)
    # --- shared memory: the three rings, the inverse's fp16 operand tiles (one set an aux partition) and, at
    # BV = 128, the output staging tile
    if TERMS_PROGRAM:
        inputs, gates, terms = chunk_rings(q_desc, k_desc, v_desc, SLOTS_64)
        even, odd = InverseScratch.make(BT), InverseScratch.make(BT)
        # a terms program uses its own ring; a state program's importers one each (chunks 0, 2, .. and 1, 3, ..)
        ring = (i_n * HV + i_hv) * TERMS_PROGRAMS
        exchange = TermExchange.of_ring(exchange_tiles, exchange_scalings, exchange_counters,
                                        ring + gl.where(is_terms, terms_index, 0), terms_index, BT)
        exchange_odd = TermExchange.of_ring(exchange_tiles, exchange_scalings, exchange_counters,
                                            ring + gl.where(is_terms, terms_index, 1), terms_index, BT)
        # the terms program's third aux partition takes its inverse tiles from the v ring, which it does not load
        f16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float16)
        third = InverseScratch(inputs.v.index(0)._reinterpret(gl.float16, [1, BT, BT], f16),
                               inputs.v.index(1)._reinterpret(gl.float16, [1, BT, BT], f16),
                               inputs.v.index(2)._reinterpret(gl.float16, [1, BT, BT], f16))
        state = gl.warp_specialize([
            (_state_or_export, (is_terms, state, inputs, gates, terms, exchange, third, q_desc, o_desc, seq_len,
                                checkpoints, i_v, flags)),
            (_aux_or_import, (is_terms, inputs, gates, terms, even, exchange, q_desc, seq_len, flags, 0, 2)),
            (_aux_or_import, (is_terms, inputs, gates, terms, odd, exchange_odd, q_desc, seq_len, flags, 1, 2)),
            (_load_or_terms_load, (is_terms, inputs, gates, terms, q_desc, k_desc, v_desc, gate_source, seq_len, HV,
                                   exchange)),
            (_norms_unless_terms, (is_terms, inputs, terms, q_desc, seq_len, scale, flags)),
        ], [4, 4, LOAD_WARPS, NORMS_WARPS], [AUX_PAIR_REGS, AUX_PAIR_REGS, LOAD_PAIR_REGS, LOAD_PAIR_REGS])[0]
    elif BV == 64:  # the registers of a second state warpgroup hold a second aux partition (module docstring)
        inputs, gates, terms = chunk_rings(q_desc, k_desc, v_desc, SLOTS_64)
        even, odd = InverseScratch.make(BT), InverseScratch.make(BT)
        state = gl.warp_specialize([
            (_state_partition, (state, inputs, terms, o_desc, None, seq_len, checkpoints, i_v, True)),
            (_aux_partition, (inputs, gates, terms, even, q_desc, seq_len, flags, 0, 2, True)),
            (_aux_partition, (inputs, gates, terms, odd, q_desc, seq_len, flags, 1, 2, True)),
            (_load_partition, (inputs, gates, terms, q_desc, k_desc, v_desc, gate_source, seq_len, HV)),
            (_norms_partition, (inputs, terms, q_desc, seq_len, scale, flags, True)),
        ], [4, 4, LOAD_WARPS, NORMS_WARPS], [AUX_PAIR_REGS, AUX_PAIR_REGS, LOAD_PAIR_REGS, LOAD_PAIR_REGS])[0]
    else:
        inputs, gates, terms = chunk_rings(q_desc, k_desc, v_desc)
        o_stage = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)
        state = gl.warp_specialize([
            (_state_partition, (state, inputs, terms, o_desc, o_stage, seq_len, checkpoints, i_v, False)),
            (_aux_partition, (inputs, gates, terms, InverseScratch.make(BT), q_desc, seq_len, flags, 0, 1, False)),
            (_load_partition, (inputs, gates, terms, q_desc, k_desc, v_desc, gate_source, seq_len, HV)),
            (_norms_partition, (inputs, terms, q_desc, seq_len, scale, flags, True)),
        ], [4, LOAD_WARPS, NORMS_WARPS], [AUX_REGS, LOAD_REGS, LOAD_REGS])[0]
    store_state_tile(ht, gl.permute(state, [1, 0]), slot, i_hv, i_v, HV,
                     ((flags & STORE_HT) != 0) & (slot >= 0) & (not is_terms), K, V, BV, TRANSPOSE_STATE)
