"""Where gdn_fused's partitions wait: the warp-state samples of one ncu-profiled launch, summed per chunk loop.

Each warp-specialised partition runs a chunk loop of its own, so the samples inside one loop are that
partition's time, and the instruction its warps sit at says what they wait for: the branch after an mbarrier
try-wait (SYNCS.PHASECHK) is a ring slot not yet filled or freed, WARPGROUP.DEPBAR a wgmma result, BAR.SYNC the
partition's other warps. Two steps, from the repository root:
    python3 bench/partition_profile.py record --case 32x8192 --out DIR    # GPU host with ncu: DIR/source.csv
                                                       # (--bv 64: the 64-row programs, two aux partitions)
    python3 bench/partition_profile.py report DIR/source.csv              # anywhere gdn_aot's build module imports
    python3 bench/partition_profile.py units DIR/raw.csv                  # anywhere: how busy each unit was
record JIT-compiles the checkout's kernels/fused_sm90.py (bench/fused_ablate.py's copy and launch), runs it twice,
profiles the third launch under ncu (--set full, --clock-control none) and exports its SASS source page with the
stall-reason columns; with --row N it profiles the installed gdn_aot's dispatch row N instead (bench/rows.py's
numbering, on a bench.py case: `record --row 0 --case 1x8192` is the terms route of a specs/qwen35.yaml build,
cooperative launch and all), which needs no triton.
report finds the loops from the predicated backward branches of that SASS and prints, for
each loop of at least --min-insns instructions: the partition it is (state, aux, load or norms, and import in
gdn_fused_terms, told apart by opcodes only that partition has: loop_role), its samples and
share of the kernel's, the leading stall reasons, and the instructions with the most samples, each with the one
before it (which names the barrier or product); where the export has the columns, also the loop's shared-memory
wavefronts a warp an iteration, by opcode.
With --phases, each loop also in phases: its body cut after every partition barrier, wgmma wait, mbarrier wait
(with its retry branch) or arrive, and async-proxy fence, each phase with its instructions and share of the loop's
samples (docs/performance.md groups them into named steps).
record also exports the launch's metrics (DIR/raw.csv), and units prints from them what the partitions share: the
utilisation of each pipe (the tensor cores' wgmma pipe among them), of shared memory and of the issue slots, and the
stall reasons per issued instruction, the busiest first.
static needs no GPU: from a sm_90a cubin's SASS (a build's, e.g. `gdn-aot build specs/tiny.yaml --arch sm_90`) it
names each loop's partition as report does and estimates its shared-memory wavefronts a warp an iteration, by
opcode, from the cost of each access that ncu measured on gdn_fused (shared_wavefronts): on that kernel it gives
ncu's counts to within 2 wavefronts a loop (aux 402 for 404, state 225 for 225), so a change's shared-memory traffic
can be read before it runs:
    python3 bench/partition_profile.py static OUT/sm_90a/cubins/<sha>.cubin
"""
import argparse
import csv
import os
import re
import subprocess
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = "Warp Stall Sampling (All Samples)"
WAVEFRONTS, EXECUTED = "L1 Wavefronts Shared", "Instructions Executed"
_TARGET = re.compile(r"\b(BRA(?:\.\w+)*\s+(?:!?UP\w+,\s*)?)0x([0-9a-f]+)")  # with sm_100a's uniform-predicate operand


def _source_table(path):
    """(header, instruction rows, base address) of ncu's `--page source --csv --print-source sass` export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    at = next(i for i, r in enumerate(rows) if "Address" in r and SAMPLES in r)
    header = rows[at]
    addr = header.index("Address")
    body = [r for r in rows[at + 1:] if len(r) == len(header) and r[addr].startswith("0x")]
    return header, body, int(body[0][addr], 16)


def read_source_page(path):
    """(base address, [(offset, sass, samples, {reason: samples})]) from the source page export; offsets from the
    kernel's first instruction."""
    header, body, base = _source_table(path)
    addr, src, total = header.index("Address"), header.index("Source"), header.index(SAMPLES)
    reasons = {h: i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h}
    return base, [(int(r[addr], 16) - base, r[src].strip(), int(r[total] or 0),
                   {h[len("stall_"):]: int(r[i] or 0) for h, i in reasons.items()}) for r in body]


def read_shared_wavefronts(path):
    """{offset: (warp-level executions, shared-memory wavefronts)} from the same export, or {} where it has no
    such columns (wgmma's operand reads from shared memory count as wavefronts too)."""
    header, body, base = _source_table(path)
    if WAVEFRONTS not in header or EXECUTED not in header:
        return {}
    addr, waves, executed = header.index("Address"), header.index(WAVEFRONTS), header.index(EXECUTED)
    number = lambda x: float(x.replace(",", "") or 0)  # noqa: E731
    return {int(r[addr], 16) - base: (number(r[executed]), number(r[waves])) for r in body}


def shared_traffic(body, counts, opcodes):
    """A loop's shared-memory wavefronts a warp an iteration, in all and by opcode, the most first: each
    instruction's wavefronts over the executions of the loop's last instruction (its backward branch)."""
    iterations = counts.get(body[-1][0], (0, 0))[0] or 1
    by_op = Counter()
    for off, *_ in body:
        by_op[opcodes[off]] += counts.get(off, (0, 0))[1] / iterations
    shown = ", ".join(f"{op} {v:.0f}" for op, v in by_op.most_common() if v >= 0.5)
    return f"  shared-memory wavefronts a warp an iteration: {sum(by_op.values()):.0f} ({shown})"


def as_sass_text(insns, base):
    """The page as nvdisasm-style lines (relative branch targets), for gdn_aot's SASS helpers."""
    def rebased(m):
        return f"{m.group(1)}0x{int(m.group(2), 16) - base:x}"
    return "\n".join(f"        /*{off:04x}*/ " + _TARGET.sub(rebased, text) + " ;" for off, text, _, _ in insns)


def outer_loops(ranges):
    """The loops no other loop contains, by address."""
    return sorted((a, b) for a, b in set(ranges) if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in ranges))


# where a phase of a loop ends: the partition barrier, wgmma wait, mbarrier arrive and async-proxy fence themselves, and
# an mbarrier try-wait at the first branch after it (to its retry path, where the waiting warps' samples land)
_PHASE_ENDS = ("BAR.SYNC", "WARPGROUP.DEPBAR", "SYNCS.ARRIVE", "FENCE.VIEW.ASYNC")
_WAIT = "SYNCS.PHASECHK"


def phases(body):
    """A loop body [(offset, sass, samples, reasons)] cut into [(first, last, instructions, samples, end)]."""
    out, first, count, samples, wait = [], None, 0, 0, False
    for off, text, n, _ in body:
        first = off if first is None else first
        count, samples = count + 1, samples + n
        wait = wait or _WAIT in text
        if (wait and " BRA " in f" {text} ") or any(k in text for k in _PHASE_ENDS):
            out.append((first, off, count, samples, text))
            first, count, samples, wait = None, 0, 0, False
    if first is not None:
        out.append((first, body[-1][0], count, samples, body[-1][1]))
    return out


# what tells gdn_fused's (sm_90a) partitions apart in a loop's opcodes ("!" an opcode the loop lacks), checked in this
# order: the aux inverts the diagonal blocks on mma.sync, the state stores o by TMA, the load issues the TMA loads,
# the norms read q rows from shared memory and take their inverse square roots; and in gdn_fused_terms (whose terms
# programs' aux partitions also store by TMA, hence aux before state) the importers' acquire loads invalidate L1
# (CCTL) before their TMA copies, and they scan no gates (the terms programs' load loop spins too, and scans with
# shuffles)
ROLE_MARKS = (("aux", ("HMMA",)), ("state", ("UTMASTG",)), ("import", ("CCTL", "!SHFL")), ("load", ("UTMALDG",)),
              ("norms", ("LDS", "MUFU")))


def loop_role(opcodes):
    """The partition whose loop has these opcode counts (a Counter), or "other"."""
    def holds(mark):
        return opcodes[mark[1:]] == 0 if mark.startswith("!") else opcodes[mark] > 0
    return next((role for role, marks in ROLE_MARKS if all(holds(m) for m in marks)), "other")


def partition_report(path, min_insns=100, top=8, with_phases=False):
    from gdn_aot.build.sass import instructions, loop_ranges

    base, insns = read_source_page(path)
    sass_text = as_sass_text(insns, base)
    opcodes = dict(instructions(sass_text))
    prev = {off + 16: text for off, text, _, _ in insns}
    loops = [(a, b) for a, b in outer_loops(loop_ranges(sass_text))
             if sum(1 for off, *_ in insns if a <= off <= b) >= min_insns]
    counts = read_shared_wavefronts(path)
    kernel_total = sum(n for _, _, n, _ in insns) or 1
    lines = [f"{kernel_total} samples in the kernel; loops of at least {min_insns} instructions:"]
    for a, b in loops:
        body = [(off, text, n, why) for off, text, n, why in insns if a <= off <= b]
        n = sum(x[2] for x in body) or 1
        ops = Counter(opcodes[off] for off, _, _, _ in body)
        why = Counter()
        for x in body:
            why.update(x[3])
        lines.append(f"\nloop {a:#x}-{b:#x}, {loop_role(ops)}: {len(body)} instructions (HGMMA {ops['HGMMA']}, "
                     f"FFMA {ops['FFMA']}), "
                     f"{n} samples ({100 * n / kernel_total:.1f} % of the kernel)")
        lines.append("  " + ", ".join(f"{k} {100 * v / n:.1f} %" for k, v in why.most_common(6)))
        if counts:
            lines.append(shared_traffic(body, counts, opcodes))
        for off, text, m, w in sorted(body, key=lambda x: -x[2])[:top]:
            lead = ", ".join(f"{k} {v}" for k, v in Counter(w).most_common(2))
            before = prev.get(off, "")
            lines.append(f"  {off:#07x} {m:7d} {100 * m / n:5.1f} %  {text[:48]:48}  [{lead}]  after: {before[:56]}")
        if with_phases:
            lines.append("  phases:")
            for first, last, count, m, end in phases(body):
                lines.append(f"  {first:#07x}-{last:#07x} {count:4d} instructions {100 * m / n:5.1f} %  "
                             f"ends: {end[:56]}")
    return "\n".join(lines)


# the metrics `units` prints: the pipes', shared memory's and the schedulers' utilisation, and the stall reasons
UNIT_METRICS = re.compile(r"^(sm__pipe_\w+_cycles_active\.avg\.pct_of_peak_sustained_active"
                          r"|sm__inst_executed_pipe_\w+\.avg\.pct_of_peak_sustained_active"
                          r"|l1tex__data_pipe_lsu_wavefronts_mem_shared\w*\.(?:avg|sum)\.pct_of_peak_sustained_elapsed"
                          r"|l1tex__data_bank_conflicts_pipe_lsu_mem_shared\w*\.sum"
                          r"|smsp__issue_active\.avg\.pct_of_peak_sustained_active"
                          r"|smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio)$")


def read_raw_page(path):
    """{metric: (value, unit)} of the first kernel in ncu's `--page raw --csv` export (a row of names, one of
    units, then a row a profiled kernel); values that are not numbers are left out."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    at = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, units, values = rows[at], rows[at + 1], rows[at + 2]
    out = {}
    for name, unit, value in zip(names, units, values):
        try:
            out[name] = (float(value.replace(",", "")), unit)
        except ValueError:
            pass
    return out


def units_report(path, top=40):
    """The UNIT_METRICS of the raw export, the largest first within each kind (pipes, shared memory, issue, stalls)."""
    metrics = {k: v for k, v in read_raw_page(path).items() if UNIT_METRICS.match(k)}
    lines = []
    for title, prefix in (("pipes, % of peak while active", "sm__"), ("shared memory", "l1tex__"),
                          ("issue slots", "smsp__issue"), ("stalls, warps per issued instruction", "smsp__average")):
        group = sorted(((v, u, k) for k, (v, u) in metrics.items() if k.startswith(prefix)), reverse=True)[:top]
        lines.append(f"{title}:")
        lines += [f"  {v:10.2f} {u:8s} {k}" for v, u, k in group if v > 0]
    return "\n".join(lines)


def shared_wavefronts(opcode, modifiers, operands):
    """The shared-memory wavefronts of one warp-level execution, as ncu counted them on gdn_fused (H100): a load or
    store moves 128 bytes a wavefront whatever its addresses (a 64-bit one goes by half-warps, a 128-bit one by
    quarter-warps; ldmatrix / stmatrix one wavefront a matrix), and a wgmma step reads its B tile (N / 16) and, with
    A in shared memory (a descriptor, not registers), A's 4 more."""
    mods = modifiers.split(".")[1:]
    if opcode == "HGMMA":
        mma = re.fullmatch(r"64x(\d+)x16", mods[0]) if mods else None
        if mma:
            return int(mma.group(1)) // 16 + (4 if operands.split(",")[1].strip().startswith("gdesc") else 0)
    if opcode in ("LDS", "STS"):
        return {"64": 2, "128": 4}.get(mods[-1] if mods else "", 1)
    if opcode in ("LDSM", "STSM"):
        return int(mods[-1]) if mods and mods[-1].isdigit() else 1
    return 0


def static_report(sass_text, min_insns=100):
    """Each outer loop of at least min_insns instructions of the SASS, with its estimated shared-memory wavefronts
    a warp an iteration (shared_wavefronts), in all and by opcode."""
    from gdn_aot.build.sass import instruction_fields, loop_ranges

    insns = instruction_fields(sass_text)
    lines = []
    for a, b in outer_loops(loop_ranges(sass_text)):
        body = [fields for at, *fields in insns if a <= at <= b]
        if len(body) < min_insns:
            continue
        by_opcode = Counter()
        for op, modifiers, operands in body:
            by_opcode[op] += shared_wavefronts(op, modifiers, operands)
        shown = ", ".join(f"{k} {v}" for k, v in by_opcode.most_common() if v)
        role = loop_role(Counter(op for op, _, _ in body))
        lines.append(f"loop {a:#x}-{b:#x}, {role}: {len(body)} instructions, shared-memory wavefronts a warp an "
                     f"iteration {sum(by_opcode.values())} ({shown})")
    return "\n".join(lines)


def record(case, out, bv=128, row=None):
    """Profile one launch of the checkout's gdn_fused on `case` (a fused_ablate.py case) at V tile `bv`, or, given
    `row`, of the installed gdn_aot's dispatch row `row` on `case` (a bench.py case), into out/source.csv and
    out/raw.csv."""
    os.makedirs(out, exist_ok=True)
    report = os.path.join(out, "profile")
    what = ["--bv", str(bv)] if row is None else ["--row", str(row)]
    subprocess.run(["ncu", "--clock-control", "none", "-k", "regex:fused_kernel", "--launch-skip", "2",
                    "--launch-count", "1", "--set", "full", "--import-source", "no", "-f", "-o", report,
                    sys.executable, os.path.abspath(__file__), "launch", "--case", case] + what, check=True)
    with open(os.path.join(out, "source.csv"), "w") as f:
        subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                       stdout=f, check=True)
    with open(os.path.join(out, "raw.csv"), "w") as f:
        subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "raw", "--csv"], stdout=f, check=True)
    print(f"wrote {os.path.join(out, 'source.csv')} and raw.csv")


def launch_row(case, row):
    """Three forwards of the installed gdn_aot with every batch sent to its dispatch row `row` (bench/rows.py's
    numbering: bf16 varlen, K = V = 128, the [K, V] state) on the bench.py case `case`."""
    import torch

    sys.path.insert(0, HERE)
    from bench import cu_tensors, make_inputs, parse_cases
    from rows import forced_forward, installed_routes

    routes = installed_routes(False, "fp32")
    (c,) = parse_cases(case)
    x = make_inputs(c.lens, c.HV, 0, cu_tensors(c.lens))
    for _ in range(3):
        forced_forward(routes, routes.routes[row], x, False)
    torch.cuda.synchronize()


def launch(case, bv=128):
    """Three launches of the JIT-compiled kernel at V tile `bv` (the third is the one `record` profiles)."""
    import torch
    import triton

    sys.path.insert(0, HERE)
    import fused_ablate

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    kernel = fused_ablate.load("fused", lambda s: s)
    lens, HV = fused_ablate.CASES[case]
    q, k, v, g, beta, cu, h0 = fused_ablate.inputs(lens, HV)
    o, ht = torch.empty_like(v), torch.empty_like(h0)
    for _ in range(3):
        fused_ablate.launch(kernel, q, k, v, g, beta, cu, h0, o, ht, bv)
    torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("record", help="profile one launch under ncu (GPU host)")
    r.add_argument("--case", default="32x8192", help="a bench/fused_ablate.py case")
    r.add_argument("--out", required=True, help="folder for profile.ncu-rep, source.csv and raw.csv")
    la = sub.add_parser("launch", help="(what record runs under ncu)")
    la.add_argument("--case", default="32x8192")
    for sp in (r, la):
        sp.add_argument("--bv", type=int, choices=(64, 128), default=128, help="value rows of a program's state")
        sp.add_argument("--row", type=int, help="the installed gdn_aot's dispatch row instead (bench/rows.py's "
                        "numbering; --case then a bench.py case, e.g. 1x8192)")
    p = sub.add_parser("report", help="samples per chunk loop from source.csv")
    p.add_argument("csv")
    p.add_argument("--min-insns", type=int, default=100, help="smaller loops (mbarrier retries) are left out")
    p.add_argument("--top", type=int, default=8, help="instructions listed a loop")
    p.add_argument("--phases", action="store_true", help="each loop also cut at its barriers, waits and fences")
    u = sub.add_parser("units", help="pipe, shared-memory and issue utilisation and stall reasons from raw.csv")
    u.add_argument("csv")
    st = sub.add_parser("static", help="shared-memory wavefronts per loop estimated from a sm_90a cubin (no GPU)")
    st.add_argument("cubin")
    st.add_argument("--min-insns", type=int, default=100, help="smaller loops (mbarrier retries) are left out")
    args = ap.parse_args(argv)
    if args.step == "record":
        record(args.case, args.out, args.bv, args.row)
    elif args.step == "launch":
        if args.row is None:
            launch(args.case, args.bv)
        else:
            launch_row(args.case, args.row)
    elif args.step == "units":
        print(units_report(args.csv))
    elif args.step == "static":
        from pathlib import Path
        from gdn_aot.build.sass import disassemble
        print(static_report(disassemble(Path(args.cubin), "sm_90a"), args.min_insns))
    else:
        print(partition_report(args.csv, args.min_insns, args.top, args.phases))


if __name__ == "__main__":
    main()
