"""gdn_fused's sm_90a ring protocol (kernels/fused_sm90.py) as a model, run under random schedules.

Each partition is its list of operations in kernel order: mbarrier waits and arrives, and the reads and writes of
ring slots (the last read of a slot where a chunk reads it more than once). A run fails on a deadlock or on a read
that finds another chunk's data in its slot. Configurations: the 128-row programs (two slots a ring, one aux
partition, o through a staging tile of its own) and the 64-row ones (three slots a ring, two aux partitions, o
through its chunk's Tv tile, whose terms slot the state partition frees in the next chunk); and gdn_fused_terms
(TERMS_PROGRAM in kernels/fused_sm90.py: terms programs handing each chunk's terms to two 64-row state programs through
rings in global memory with ready and consumed counters, the terms leaving by TMA stores and arriving by TMA loads
that complete some steps later: terms_run). A model written by hand beside the kernel: change it with the kernel.
No GPU:
    python3 bench/ring_model.py [--runs N]
mbarrier semantics: a wait on parity p passes while the barrier's current phase has the other parity (a fresh
barrier passes a wait on 1); a TMA load of input tiles is its writes and the ready arrive at once (its source is
never rewritten); the importers' copies of the terms are modelled as TMA copies that land later.
"""
import argparse
import dataclasses
import random


@dataclasses.dataclass
class Barrier:
    count: int
    pending: int = 0
    phase: int = 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.phase, self.pending = self.phase + 1, 0

    def passes(self, parity):
        return (self.phase & 1) != parity


@dataclasses.dataclass(frozen=True)
class Rings:
    """Slots of every ring (inputs with rq, gates, terms); two_aux: two aux partitions take every other chunk;
    o_in_terms: o leaves through its chunk's Tv tile (the 64-row programs)."""
    slots: int
    two_aux: bool
    o_in_terms: bool


def wait_ready(bar, c, n):
    return ("wait", bar, c % n, (c // n) & 1)


def wait_empty(bar, c, n):
    return ("wait", bar, c % n, ((c // n) & 1) ^ 1)


def arrive(bar, c, n):
    return ("arrive", bar, c % n)


def write(buf, c, n, value=None):
    return ("write", buf, c % n, c if value is None else value)


def read(buf, c, n, value=None):
    return ("read", buf, c % n, c if value is None else value)


def request_ops(c, n):
    """The TMA of chunk c's q, k and v tiles into its input slot, once the slot is free (_request_inputs)."""
    return [wait_empty("in_empty", c, n), write("q", c, n), write("k", c, n), write("v", c, n),
            arrive("in_ready", c, n)]


def load_ops(n_chunks, r):
    """Gates a chunk ahead of the tiles; a gate slot waits for the terms of the chunk that last used it
    (_wait_gate_slot)."""
    n = r.slots
    ops = [write("gates", 0, n), arrive("g_ready", 0, n)] + request_ops(0, n) if n_chunks else []
    for c in range(1, n_chunks):
        if c >= n:
            ops.append(wait_ready("t_ready", c - n, n))
        ops += [write("gates", c, n), arrive("g_ready", c, n)] + request_ops(c, n)
    return ops


def aux_ops(n_chunks, r, first, stride):
    """The terms slot: its own empty barrier where o leaves through it, else the input slot's."""
    n = r.slots
    ops = []
    for c in range(first, n_chunks, stride):
        ops += [wait_ready("in_ready", c, n), wait_ready("g_ready", c, n),
                wait_empty("t_empty" if r.o_in_terms else "in_empty", c, n), write("terms", c, n),
                read("q", c, n), read("k", c, n), read("gates", c, n), arrive("t_ready", c, n)]
    return ops


def norms_ops(n_chunks, r):
    n = r.slots
    ops = []
    for c in range(n_chunks):
        ops += [wait_ready("in_ready", c, n), read("q", c, n), write("rq", c, n), arrive("rq_ready", c, n),
                arrive("in_empty", c, n)]
    return ops


def state_ops(n_chunks, r):
    n = r.slots
    ops = []
    for c in range(n_chunks):
        ops.append(wait_ready("in_ready", c, n))
        if r.o_in_terms and c > 0:  # _release_previous_terms
            ops.append(arrive("t_empty", c - 1, n))
        ops += [wait_ready("t_ready", c, n), read("terms", c, n), read("v", c, n), read("q", c, n),
                read("k", c, n), wait_ready("rq_ready", c, n), read("rq", c, n), arrive("in_empty", c, n)]
        if r.o_in_terms:
            ops.append(write("terms", c, n, ("o", c)))
    return ops


def run(n_chunks, r, rng):
    """True, or what went wrong, for one random schedule of a sequence of n_chunks chunks."""
    aux = [aux_ops(n_chunks, r, 0, 2), aux_ops(n_chunks, r, 1, 2)] if r.two_aux else [aux_ops(n_chunks, r, 0, 1)]
    parts = [load_ops(n_chunks, r), norms_ops(n_chunks, r), state_ops(n_chunks, r)] + aux
    return execute(parts, barriers(r.slots), buffers(r.slots), {}, rng)


# a program's mbarriers, each with the arrivals that complete a phase (g_empty: only the terms programs use it),
# and its shared-memory buffers
BARRIER_COUNTS = {"in_ready": 1, "in_empty": 2, "rq_ready": 1, "g_ready": 1, "t_ready": 1, "t_empty": 1, "g_empty": 1}
BUFFERS = ("q", "k", "v", "rq", "gates", "terms")


def barriers(slots, prefix=""):
    return {prefix + name: [Barrier(count) for _ in range(slots)] for name, count in BARRIER_COUNTS.items()}


def buffers(slots, prefix=""):
    return {prefix + buf: [None] * slots for buf in BUFFERS}


# how often a pending TMA copy is the step taken while partitions can run: seldom, so that a slow copy's window
# (its source still to be read, its destination still to be written) stays open across many other steps
ENGINE_PACE = 0.05


def execute(parts, bars, slots, counters, rng):
    """Runs the partitions' operations in a random interleaving: True, or the deadlock or stale read it met.
    Besides mbarrier waits and arrives and slot reads and writes: waits for a global counter to reach a value, its
    adds and sets, and TMA copies, each issued into its engine's queue (("issue", engine, from, slot, value, to,
    slot[, barrier])), which reads its source slot and writes its destination slot at some later step (a load then
    arrives on the destination slot's barrier), and a wait for an engine's queue to empty ("complete":
    cp.async.bulk.wait_group 0)."""
    engines = {}
    at = [0] * len(parts)

    def ready(i):
        kind, name, *rest = parts[i][at[i]]
        if kind == "wait":
            return bars[name][rest[0]].passes(rest[1])
        if kind == "wait_ge":
            return counters[name][rest[0]] >= rest[1]
        if kind == "complete":
            return not engines.get(name)
        return True
    while True:
        live = [i for i, ops in enumerate(parts) if at[i] < len(ops)]
        busy = [e for e, queue in engines.items() if queue]
        if not live and not busy:
            return True
        runnable = [("part", i) for i in live if ready(i)]
        if busy and (not runnable or rng.random() < ENGINE_PACE):
            runnable = [("engine", e) for e in busy]
        if not runnable:
            return f"deadlock: {[parts[i][at[i]] for i in live]}"
        who, i = rng.choice(runnable)
        if who == "engine":
            src, src_slot, value, dst, dst_slot, *landed = engines[i].pop(0)
            if slots[src][src_slot] != value:
                return f"a TMA copy read {src}[{src_slot}] = {slots[src][src_slot]!r}, wanted {value!r}"
            slots[dst][dst_slot] = value
            for bar in landed:
                bars[bar][dst_slot].arrive()
            continue
        kind, name, slot, *value = parts[i][at[i]]
        at[i] += 1
        if kind == "arrive":
            bars[name][slot].arrive()
        elif kind == "write":
            slots[name][slot] = value[0]
        elif kind == "read" and slots[name][slot] != value[0]:
            return f"partition {i} read {name}[{slot}] = {slots[name][slot]!r}, wanted chunk {value[0]}"
        elif kind == "add":
            counters[name][slot] += value[0]
        elif kind == "set":
            counters[name][slot] = value[0]
        elif kind == "issue":
            engines.setdefault(name, []).append((slot, *value))


# --- terms programs beside the 64-row state programs (gdn_fused_terms): chunk c's terms come from
# terms program c % programs, its j-th chunk (j = c // programs), through ring slot j % EXCHANGE_SLOTS in global
# memory, whose ready counter the terms program sets to j + 1 once its TMA store is complete and whose consumed
# counter each of the two state programs' importers raises by one once its copy of the slot has landed
EXCHANGE_SLOTS = 8
# an importer's own chunks between a copy and its consumed count: a state program's terms slots (3) over its two
# importers, rounded up (fused_sm90._import_partition's lag)
IMPORT_LAG = 2
TERMS_AUX = 3  # aux partitions of a terms program, every third of its chunks each


def own(*op):
    """An operation on the program's own barriers or buffers (see in_program)."""
    return ("own",) + op


def in_program(prefix, ops):
    """ops with the names of `own` ones put in program `prefix`'s namespace (the rest are global or engines)."""
    return [(op[1], f"{prefix}.{op[2]}", *op[3:]) if op[0] == "own" else op for op in ops]


def terms_load_ops(t, chunks, n):
    """A terms program's loads of its j-th chunk (chunk chunks[j]): gate and input slots once its aux partitions
    freed them, and only once both state programs imported the chunk EXCHANGE_SLOTS before it."""
    ops = []
    for j, c in enumerate(chunks):
        ops += [own(*wait_empty("g_empty", j, n)),
                ("wait_ge", f"consumed{t}", j % EXCHANGE_SLOTS, 2 * (j // EXCHANGE_SLOTS)),
                own(*write("gates", j, n, c)), own(*arrive("g_ready", j, n)),
                own(*wait_empty("in_empty", j, n)), own(*write("q", j, n, c)), own(*write("k", j, n, c)),
                own(*arrive("in_ready", j, n))]
    return ops


def terms_aux_ops(t, chunks, n, a):
    """Aux partition a of a terms program: its chunks' terms in its own terms slot (slot a), out by TMA; the previous
    chunk's store completed (and its ready counter set) before the slot is rewritten; its input and gate slots freed
    after q k^T (the rk it writes into the gate slot comes first)."""
    engine = f"t{t}.aux{a}"

    def complete(j):
        return [("complete", engine, None), ("set", f"ready{t}", j % EXCHANGE_SLOTS, j + 1)]
    mine, ops = list(range(a, len(chunks), TERMS_AUX)), []
    for j in mine:
        c = chunks[j]
        ops += [own(*wait_ready("in_ready", j, n)), own(*read("k", j, n, c)),
                own(*wait_ready("g_ready", j, n)), own(*write("gates", j, n, c))]
        if j != mine[0]:
            ops += complete(j - TERMS_AUX)
        ops += [own("write", "terms", a, c), own(*read("gates", j, n, c)), own(*read("q", j, n, c)),
                own(*read("k", j, n, c)), own(*arrive("in_empty", j, n)), own(*arrive("in_empty", j, n)),
                own(*arrive("g_empty", j, n)), own("write", "terms", a, c),
                ("issue", engine, f"t{t}.terms", a, c, f"ring{t}", j % EXCHANGE_SLOTS)]
    return ops + (complete(mine[-1]) if mine else [])


def input_load_ops(n_chunks, n):
    """A state program's loads beside terms programs: its inputs only (no gates: its importers need none)."""
    return [own(*op) for c in range(n_chunks) for op in request_ops(c, n)]


def importer_ops(n_chunks, programs, i, n, prefix):
    """State program `prefix`'s importer i: chunks i, i + 2, ..., each copied by TMA from its terms program's ring
    into the program's terms slot (the copy's landing completes the slot's ready barrier), once the state freed the
    slot and the ring slot is ready; its consumed count IMPORT_LAG of its own chunks later, when the state's release
    of a later chunk's slot says the copy has landed."""
    mine, ops = list(range(i, n_chunks, 2)), []
    for k, c in enumerate(mine):
        t, j = c % programs, c // programs
        s = j % EXCHANGE_SLOTS
        ops.append(own(*wait_empty("t_empty", c, n)))
        if k >= IMPORT_LAG:
            landed = mine[k - IMPORT_LAG]
            ops.append(("add", f"consumed{landed % programs}", landed // programs % EXCHANGE_SLOTS, 1))
        ops += [("wait_ge", f"ready{t}", s, j + 1),
                ("issue", f"{prefix}.import{i}", f"ring{t}", s, c, f"{prefix}.terms", c % n, f"{prefix}.t_ready")]
    return ops


def terms_run(n_chunks, programs, rng):
    """One random schedule of a sequence of n_chunks chunks: `programs` terms programs and two state programs
    (the 64-row configuration, their aux partitions importing)."""
    r = Rings(3, True, True)
    n = r.slots
    bars, slots, counters, parts = {}, {}, {}, []
    for prog in ["s0", "s1"] + [f"t{t}" for t in range(programs)]:
        bars.update(barriers(n, f"{prog}."))
        slots.update(buffers(n, f"{prog}."))
    for t in range(programs):
        slots[f"ring{t}"] = [None] * EXCHANGE_SLOTS
        counters[f"ready{t}"], counters[f"consumed{t}"] = [0] * EXCHANGE_SLOTS, [0] * EXCHANGE_SLOTS
        chunks = list(range(t, n_chunks, programs))
        parts.append(in_program(f"t{t}", terms_load_ops(t, chunks, n)))
        parts += [in_program(f"t{t}", terms_aux_ops(t, chunks, n, a)) for a in range(TERMS_AUX)]
    for p in ("s0", "s1"):
        parts += [in_program(p, input_load_ops(n_chunks, n))]
        parts += [in_program(p, [own(*op) for op in ops]) for ops in (norms_ops(n_chunks, r), state_ops(n_chunks, r))]
        parts += [in_program(p, importer_ops(n_chunks, programs, i, n, p)) for i in range(2)]
    return execute(parts, bars, slots, counters, rng)


CONFIGS = {"BV 128: two slots, one aux partition, o through a staging tile": Rings(2, False, False),
           "BV 64: three slots, two aux partitions, o through its chunk's Tv tile": Rings(3, True, True)}


# terms programs a (sequence, head): gdn_fused_terms has two (TERMS_PROGRAMS); one is how it was first prototyped
TERMS_CONFIGS = {"terms program beside the 64-row state programs": 1, "two terms programs, every other chunk": 2}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4000, help="random schedules a configuration (0-14 chunks each; "
                    "0-30 with terms programs, so that their rings wrap)")
    args = ap.parse_args()
    rng = random.Random(1)
    runs = {label: (lambda rings=rings: run(rng.randint(0, 14), rings, rng)) for label, rings in CONFIGS.items()}
    runs.update({label: (lambda k=k: terms_run(rng.randint(0, 30), k, rng)) for label, k in TERMS_CONFIGS.items()})
    for label, one in runs.items():
        failed = [r for r in (one() for _ in range(args.runs)) if r is not True]
        print(f"{label}: {args.runs} runs, {len(failed)} failed" + (f"; first: {failed[0]}" if failed else ""))


if __name__ == "__main__":
    main()
