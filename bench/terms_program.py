"""gdn_fused with terms programs (a prototype), checked bit for bit against gdn_fused and timed beside it.

Each (sequence, value head) gets, beside its two 64-row state programs, programs that compute every chunk's
state-independent terms once and hand them to both through global memory, instead of each state program computing
them itself (docs/design.md, "A terms program").

The kernel is a diff applied to a temporary copy of kernels/fused_sm90.py (never to the checkout; `git apply
bench/terms_program.diff` makes the same change there): bench/terms_program.diff has one terms program a
(sequence, head) (measured, docs/performance.md), bench/terms_program_two.diff two, each taking every other chunk
(compiled, not yet run). Needs a Hopper GPU and triton 3.6.0 (JIT, like bench/fused_ablate.py, whose copy and
launch it shares). Run from the repository root:
    python3 bench/terms_program.py [--diff bench/terms_program.diff] [--cases 1x2048,1x8192,1x65536]
It compares the prototype with gdn_fused at BV = 64 bit for bit (o and the final state) on single sequences of
1, 63, 65, 200 and 4096 tokens, against the float64 token recurrence, then times gdn_fused at BV = 64 and 128 and
the prototype in alternation (CUDA events, median of --reps; the prototype's time includes zeroing its counters).
Only batches whose programs all fit on the GPU at once: the prototype launches without clusters, so nothing yet
guarantees that a state program's terms programs are resident (a state program waiting for one that never starts
would hang).
"""
import argparse
import dataclasses
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
import fused_ablate  # noqa: E402  (bench/, put on the path above)
from timing import timed_alternating  # noqa: E402

DIFF = os.path.join(HERE, "terms_program.diff")
HUNK = re.compile(r"^@@ [^@]* @@", re.MULTILINE)


def constant(source, name, default):
    """The value of `NAME = gl.constexpr(N)` in the edited kernel source, else default."""
    m = re.search(rf"^{name} = gl.constexpr\((\d+)\)", source, re.MULTILINE)
    return int(m.group(1)) if m else default


def hunks(diff_text):
    """(old, new) text of each hunk of a unified diff: its context and '-' lines, its context and '+' lines."""
    out = []
    for block in HUNK.split(diff_text)[1:]:
        old, new = [], []
        for line in block.split("\n")[1:]:
            if line.startswith("-"):
                old.append(line[1:])
            elif line.startswith("+"):
                new.append(line[1:])
            elif line.startswith(" ") or line == "":
                old.append(line[1:])
                new.append(line[1:])
        out.append(("\n".join(old), "\n".join(new)))
    return out


def apply(kernel_text, diff_text):
    """kernel_text with every hunk of the diff applied; each hunk's old text must occur exactly once."""
    for old, new in hunks(diff_text):
        if kernel_text.count(old) != 1:
            raise ValueError(f"the diff no longer applies: a hunk's text occurs {kernel_text.count(old)} "
                             f"times in kernels/fused_sm90.py:\n{old[:300]}")
        kernel_text = kernel_text.replace(old, new)
    return kernel_text


@dataclasses.dataclass(frozen=True)
class Prototype:
    """The edited kernel source and the shape of its hand-over: terms programs a (sequence, head) (TERMS_PROGRAMS,
    1 where the diff has none), chunk slots a ring (EXCHANGE_SLOTS)."""
    source: str

    @property
    def programs(self):
        return constant(self.source, "TERMS_PROGRAMS", 1)

    @property
    def slots(self):
        return constant(self.source, "EXCHANGE_SLOTS", 0)

    def exchange(self, pairs):
        """The global rings of `pairs` (sequence, head) pairs, one a terms program: tiles, scalings, counters
        (zeroed before each launch)."""
        slots = pairs * self.programs * self.slots
        return (torch.empty(slots * 2 * 64 * 64, dtype=torch.bfloat16, device="cuda"),
                torch.empty(slots * 8 * 64, dtype=torch.float32, device="cuda"),
                torch.zeros(slots * 2, dtype=torch.int32, device="cuda"))


def launch(kernel, programs, q, k, v, g, beta, cu, h0, o, ht, ring):
    """The prototype on a (num_seqs, HV, 2 + programs) grid: V tiles 0 and 1 are the state programs, the rest the
    terms programs; its counters zeroed first."""
    ring[2].zero_()
    fused_ablate.launch(kernel, q, k, v, g, beta, cu, h0, o, ht, 64, extra_programs=programs, extra_args=ring,
                        TERMS_PROGRAM=True)


def check(base, terms, proto):
    from reference import reference_outputs, rel_max_err

    for lens in ([1], [63], [65], [200], [4096]):
        q, k, v, g, beta, cu, h0 = fused_ablate.inputs(lens)
        o, ht = torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))
        o64, ht64 = torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))
        ring = proto.exchange(len(lens) * v.shape[2])
        launch(terms, proto.programs, q, k, v, g, beta, cu, h0, o, ht, ring)
        fused_ablate.launch(base, q, k, v, g, beta, cu, h0, o64, ht64, 64)
        ro, rh = reference_outputs(q, k, v, g, beta, cu.tolist(), h0, True)
        print(f"  {str(lens):8s} o {rel_max_err(o[0].float().cpu(), ro):.2e}  ht {rel_max_err(ht.cpu(), rh):.2e}  "
              f"bitwise gdn_fused BV 64: o {torch.equal(o, o64)}, ht {torch.equal(ht, ht64)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1x2048,1x8192,1x65536", help="comma-separated: 1xT (one sequence, HV 32)")
    ap.add_argument("--reps", type=int, default=40, help="timed launches of each kernel a case")
    ap.add_argument("--diff", default=DIFF, help="the prototype's diff against kernels/fused_sm90.py")
    args = ap.parse_args()
    import triton

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    base = fused_ablate.load("fused", fused_ablate.VARIANTS["fused"])
    with open(args.diff) as f:
        diff_text = f.read()
    with open(os.path.join(REPO, "kernels", "fused_sm90.py")) as f:
        proto = Prototype(apply(f.read(), diff_text))
    terms = fused_ablate.load("terms_program", lambda _: proto.source)
    check(base, terms, proto)
    print(f"{'case':10s}{'BV 64':>9s}{'BV 128':>9s}{'terms':>9s}  ms, CUDA events, median", flush=True)
    for case in args.cases.split(","):
        lens, HV = [int(case.split("x")[1])], 32
        q, k, v, g, beta, cu, h0 = fused_ablate.inputs(lens, HV)
        o, ht, o2, ht2 = torch.empty_like(v), torch.empty_like(h0), torch.empty_like(v), torch.empty_like(h0)
        ring = proto.exchange(len(lens) * HV)
        fused_ablate.launch(base, q, k, v, g, beta, cu, h0, o, ht, 64)
        launch(terms, proto.programs, q, k, v, g, beta, cu, h0, o2, ht2, ring)
        same = torch.equal(o, o2) and torch.equal(ht, ht2)
        row = timed_alternating([lambda: fused_ablate.launch(base, q, k, v, g, beta, cu, h0, o, ht, 64),
                                 lambda: fused_ablate.launch(base, q, k, v, g, beta, cu, h0, o, ht, 128),
                                 lambda: launch(terms, proto.programs, q, k, v, g, beta, cu, h0, o2, ht2, ring)],
                                args.reps)
        print(f"{case:10s}" + "".join(f"{t:9.3f}" for t in row) + f"  bitwise {same}", flush=True)


if __name__ == "__main__":
    main()
