"""bench/partition_profile.py's report half (the record half needs a GPU and ncu): samples summed per chunk loop
of an ncu source-page export, the loops found from its SASS."""
import csv
import importlib.util
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("partition_profile", REPO / "bench" / "partition_profile.py")
partition_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(partition_profile)

BASE = 0x7F0000001000
# (offset, SASS as ncu prints it, samples, long_sb, barrier): a chunk loop 0x10-0x50 with an mbarrier wait whose
# retry path sits after the kernel (a self-loop of two instructions, and an unconditional jump back, which is not
# a loop)
PAGE = [
    (0x00, "MOV R1, R2", 5, 0, 0),
    (0x10, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5+0x100], R6", 1, 0, 0),
    (0x20, f"@!P0  BRA {BASE + 0x100:#x}", 60, 60, 0),
    (0x30, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR4], RZ, !UPT, gsb0", 10, 0, 0),
    (0x40, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 20, 0, 20),
    (0x50, f"@P1   BRA {BASE + 0x10:#x}", 4, 0, 0),
    (0x60, "EXIT", 0, 0, 0),
    (0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5+0x100], R6", 7, 7, 0),
    (0x110, f"@!P0  BRA {BASE + 0x100:#x}", 3, 3, 0),
    (0x120, f"BRA {BASE + 0x20:#x}", 0, 0, 0),
]


def _write_page(path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "fused_kernel"])
        w.writerow(header)
        for off, text, n, long_sb, barrier in PAGE:
            w.writerow([f"{BASE + off:#x}", "      " + text, n, n, barrier, long_sb, barrier, long_sb])


def test_read_source_page(tmp_path):
    _write_page(tmp_path / "source.csv")
    base, insns = partition_profile.read_source_page(tmp_path / "source.csv")
    assert base == BASE
    assert [off for off, *_ in insns] == [p[0] for p in PAGE]
    off, text, n, why = insns[2]
    assert (off, n, why) == (0x20, 60, {"barrier": 0, "long_sb": 60}) and text.startswith("@!P0")


def test_report_sums_samples_per_chunk_loop(tmp_path):
    _write_page(tmp_path / "source.csv")
    report = partition_profile.partition_report(tmp_path / "source.csv", min_insns=3, top=2)
    # the kernel's 110 samples; the loop 0x10-0x50 holds 95 of them; the retry self-loop is below min_insns
    assert report.splitlines()[0].startswith("110 samples in the kernel")
    assert "loop 0x10-0x50, other: 5 instructions (HGMMA 1, FFMA 0), 95 samples (86.4 % of the kernel)" in report
    assert "loop 0x100" not in report
    assert "long_sb 63.2 %, barrier 21.1 %" in report
    # the top instruction is the wait's branch, named by the try-wait before it
    top = [line for line in report.splitlines() if line.startswith("  0x")]
    assert top[0].split()[:3] == ["0x00020", "60", "63.2"] and "after: SYNCS.PHASECHK" in top[0]
    assert top[1].split()[:2] == ["0x00040", "20"] and "after: HGMMA" in top[1]


def test_phases_cut_a_loop_at_its_waits_and_barriers(tmp_path):
    """The try-wait's retry branch, where its warps wait, stays in the wait's phase; the wgmma wait ends the next."""
    _write_page(tmp_path / "source.csv")
    _, insns = partition_profile.read_source_page(tmp_path / "source.csv")
    loop = [x for x in insns if 0x10 <= x[0] <= 0x50]
    assert [p[:4] for p in partition_profile.phases(loop)] == [(0x10, 0x20, 2, 61), (0x30, 0x40, 2, 30),
                                                                (0x50, 0x50, 1, 4)]
    report = partition_profile.partition_report(tmp_path / "source.csv", min_insns=3, top=1, with_phases=True)
    assert "  0x00010-0x00020    2 instructions  64.2 %  ends: @!P0  BRA" in report
    assert "  0x00030-0x00040    2 instructions  31.6 %  ends: WARPGROUP.DEPBAR" in report


def test_units_report_ranks_the_shared_units(tmp_path):
    names = ["ID", "Kernel Name", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
             "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
             "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
             "smsp__issue_active.avg.pct_of_peak_sustained_active",
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "dram__bytes.sum"]
    with open(tmp_path / "raw.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        w.writerow(["", "", "%", "%", "%", "%", "ratio", "ratio", "byte"])
        w.writerow(["0", "fused_kernel", "41.5", "12.25", "38.0", "40.1", "0.8", "2.5", "1,234,567"])
    raw = partition_profile.read_raw_page(tmp_path / "raw.csv")
    assert raw["dram__bytes.sum"] == (1234567.0, "byte") and "Kernel Name" not in raw
    lines = partition_profile.units_report(tmp_path / "raw.csv").splitlines()
    assert lines[0] == "pipes, % of peak while active:"
    # the busiest pipe first; metrics outside UNIT_METRICS (dram bytes) are left out
    assert lines[1].split() == ["41.50", "%", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"]
    assert lines[2].split()[0] == "12.25" and lines[3] == "shared memory:"
    assert lines[4].split() == ["38.00", "%", names[4]]  # ncu names this one .sum, not .avg
    stalls = lines[lines.index("stalls, warps per issued instruction:") + 1:]
    assert [s.split()[0] for s in stalls] == ["2.50", "0.80"]
    assert not any("dram" in line for line in lines)


def test_report_counts_shared_memory_wavefronts_a_warp_an_iteration(tmp_path):
    """With the export's wavefront and execution columns, each loop gets its shared-memory traffic by opcode: the
    wavefronts of its instructions over the executions of its backward branch (here 10 iterations)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "L1 Wavefronts Shared", "stall_long_sb"]
    executed = {0x10: 12, 0x20: 40, 0x30: 10, 0x40: 10, 0x50: 10}  # the try-wait's retries run more often
    waves = {0x30: 320, 0x40: 0}  # the HGMMA reads its operands from shared memory: 32 wavefronts an iteration
    with open(tmp_path / "source.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "fused_kernel"])
        w.writerow(header)
        for off, text, n, long_sb, _ in PAGE:
            w.writerow([f"{BASE + off:#x}", text, n, executed.get(off, 1), waves.get(off, 0), long_sb])
    assert partition_profile.read_shared_wavefronts(tmp_path / "source.csv")[0x30] == (10.0, 320.0)
    report = partition_profile.partition_report(tmp_path / "source.csv", min_insns=3)
    assert "  shared-memory wavefronts a warp an iteration: 32 (HGMMA 32)" in report.splitlines()
    _write_page(tmp_path / "plain.csv")  # no such columns: no such line
    assert "wavefronts" not in partition_profile.partition_report(tmp_path / "plain.csv", min_insns=3)


def test_static_report_estimates_shared_memory_wavefronts_from_sass():
    """static: each load, store, ldmatrix / stmatrix and wgmma step of a loop costs the wavefronts ncu counted a
    warp-level execution (128 bytes each; wgmma its B tile's N / 16 and 4 more with A in shared memory)."""
    sass = "\n".join(f"        /*{off:04x}*/ {text} ;" for off, text in [
        (0x00, "MOV R1, R2"),
        (0x10, "LDS R4, [R2+0x100]"),
        (0x20, "LDS.64 R4, [R2+0x100]"),
        (0x30, "LDS.128 R4, [R2+0x100]"),
        (0x40, "STSM.16.M88.4 [R3+0x200], R8"),
        (0x50, "LDSM.16.MT88.4 R8, [R3+0x200]"),
        (0x60, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR44], RZ, !UPT"),  # A and B in shared memory: 4 + 4
        (0x70, "HGMMA.64x128x16.F32.BF16 R88, R144, gdesc[UR12], R88, gsb0"),  # A in registers: 8
        (0x80, "@P1 BRA 0x10"),
        (0x90, "EXIT"),
    ])
    report = partition_profile.static_report(sass, min_insns=3)
    assert report == ("loop 0x10-0x80, other: 8 instructions, shared-memory wavefronts a warp an iteration 31 "
                      "(HGMMA 16, LDS 7, STSM 4, LDSM 4)")
    assert partition_profile.static_report(sass, min_insns=10) == ""


def test_loop_role_names_gdn_fused_partitions_by_their_opcodes():
    """Each partition by what only it issues (opcode counts of the H100 profile's loops): the state's TMA store of
    o, the aux's mma.sync, the load's TMA loads, the norms' shared loads and MUFU; anything else is "other"."""
    role = partition_profile.loop_role
    state = Counter(HGMMA=28, LDS=65, LDSM=16, STSM=16, SYNCS=4, UTMASTG=1, UTMACMDFLUSH=1)
    aux = Counter(HGMMA=32, HMMA=2, LDS=34, MUFU=39, SHFL=45, STSM=24, STS=8, SYNCS=4)
    load = Counter(SHFL=9, STS=6, SYNCS=3, UTMALDG=3)
    norms = Counter(LDS=16, MUFU=2, STSM=1, SYNCS=2, FFMA=112)
    assert [role(x) for x in (state, aux, load, norms)] == ["state", "aux", "load", "norms"]
    assert role(Counter(HGMMA=1)) == "other"
    # gdn_fused_terms: a terms program's aux loop also stores by TMA; an importer spins, then copies by TMA; the
    # terms program's load loop spins too, and scans its gates
    assert role(aux + Counter(UTMASTG=3)) == "aux"
    assert role(Counter(LDG=1, CCTL=1, NANOSLEEP=1, UTMALDG=3, SYNCS=2, BAR=4, ELECT=3)) == "import"
    assert role(Counter(LDG=5, CCTL=1, NANOSLEEP=1, UTMALDG=2, SHFL=9, SYNCS=3)) == "load"
