"""gdn_fused's sm_90a ring protocol (kernels/fused_sm90.py) as a model, run under random schedules.

Each partition is its list of operations in kernel order: mbarrier waits and arrives, and the reads and writes of
ring slots (the last read of a slot where a chunk reads it more than once). A run fails on a deadlock or on a read
that finds another chunk's data in its slot. Configurations: the 128-row programs (two slots a ring, one aux
partition, o through a staging tile of its own) and the 64-row ones (three slots a ring, two aux partitions, o
through its chunk's Tv tile, whose terms slot the state partition frees in the next chunk). A model written by hand
beside the kernel: change it with the kernel. No GPU:
    python3 bench/ring_model.py [--runs N]
mbarrier semantics: a wait on parity p passes while the barrier's current phase has the other parity (a fresh
barrier passes a wait on 1); a TMA load is its writes and the ready arrive at once.
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


def read(buf, c, n):
    return ("read", buf, c % n, c)


def load_ops(n_chunks, r):
    """Gates a chunk ahead of the tiles; a gate slot waits for the terms of the chunk that last used it
    (_wait_gate_slot)."""
    n = r.slots

    def request(c):
        return [wait_empty("in_empty", c, n), write("q", c, n), write("k", c, n), write("v", c, n),
                arrive("in_ready", c, n)]
    ops = [write("gates", 0, n), arrive("g_ready", 0, n)] + request(0) if n_chunks else []
    for c in range(1, n_chunks):
        if c >= n:
            ops.append(wait_ready("t_ready", c - n, n))
        ops += [write("gates", c, n), arrive("g_ready", c, n)] + request(c)
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
    counts = {"in_ready": 1, "in_empty": 2, "rq_ready": 1, "g_ready": 1, "t_ready": 1, "t_empty": 1}
    bars = {name: [Barrier(count) for _ in range(r.slots)] for name, count in counts.items()}
    slots = {buf: [None] * r.slots for buf in ("q", "k", "v", "rq", "gates", "terms")}
    aux = [aux_ops(n_chunks, r, 0, 2), aux_ops(n_chunks, r, 1, 2)] if r.two_aux else [aux_ops(n_chunks, r, 0, 1)]
    parts = [load_ops(n_chunks, r), norms_ops(n_chunks, r), state_ops(n_chunks, r)] + aux
    at = [0] * len(parts)
    while True:
        live = [i for i, ops in enumerate(parts) if at[i] < len(ops)]
        if not live:
            return True
        runnable = [i for i in live if parts[i][at[i]][0] != "wait"
                    or bars[parts[i][at[i]][1]][parts[i][at[i]][2]].passes(parts[i][at[i]][3])]
        if not runnable:
            return f"deadlock: {[parts[i][at[i]] for i in live]}"
        i = rng.choice(runnable)
        kind, name, slot, *value = parts[i][at[i]]
        at[i] += 1
        if kind == "arrive":
            bars[name][slot].arrive()
        elif kind == "write":
            slots[name][slot] = value[0]
        elif kind == "read" and slots[name][slot] != value[0]:
            return f"partition {i} read {name}[{slot}] = {slots[name][slot]!r}, wanted chunk {value[0]}"


CONFIGS = {"BV 128: two slots, one aux partition, o through a staging tile": Rings(2, False, False),
           "BV 64: three slots, two aux partitions, o through its chunk's Tv tile": Rings(3, True, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4000, help="random schedules a configuration (0-14 chunks each)")
    args = ap.parse_args()
    rng = random.Random(1)
    for label, rings in CONFIGS.items():
        failed = [r for r in (run(rng.randint(0, 14), rings, rng) for _ in range(args.runs)) if r is not True]
        print(f"{label}: {args.runs} runs, {len(failed)} failed" + (f"; first: {failed[0]}" if failed else ""))


if __name__ == "__main__":
    main()
