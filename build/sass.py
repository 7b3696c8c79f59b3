"""SASS facts about a cubin, from the pinned nvdisasm (toolchain.nvdisasm) and the cuobjdump bundled with triton.

`summary()` counts the instruction families that prove which hardware path a kernel takes:
sm_90a HGMMA (wgmma), UTMALDG/UTMASTG (TMA), LDGSTS (cp.async), SYNCS (mbarrier), WARPGROUP; sm_100a
UTCHMMA/UTCQMMA (tcgen05 mma), LDTM/STTM (TMEM load/store), UTCBAR (tcgen05 commit); the slow path HMMA/FFMA;
LDL/STL (local memory = spills), and LDL_in_loop/STL_in_loop: those inside a loop body (between a backward
branch and its target), where a spill costs on every iteration.
`resource_usage()` reads REG/STACK/SHARED/LOCAL from `cuobjdump -res-usage`; `ptxas_report()` re-assembles a PTX
file with `ptxas -v` for the notes the cubin does not keep (wgmma serialised for lack of registers).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from .toolchain import nvdisasm, nvidia_bin, ptxas_for

FAMILIES = ("HGMMA", "UTMALDG", "UTMASTG", "LDGSTS", "SYNCS", "WARPGROUP", "UTCHMMA", "UTCQMMA", "LDTM", "STTM",
            "UTCBAR", "HMMA", "FFMA", "LDL", "STL")
# an instruction's address, opcode, modifiers (".64x64x16.F32.BF16") and operands (the rest of the line up to ';')
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]*)?([^;\n]*)")


def disassemble(cubin: Path, arch: str) -> str:
    r = subprocess.run([str(nvdisasm(arch)), "-c", str(cubin)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvdisasm failed on {cubin}: {r.stderr.strip()}")
    return r.stdout


def instruction_fields(sass_text: str) -> list[tuple[int, str, str, str]]:
    """(address, opcode, modifiers with their dots or '', operands) of every instruction, in order."""
    return [(int(m.group(1), 16), m.group(2), m.group(3) or "", m.group(4).strip()) for m in _INSN.finditer(sass_text)]


def instructions(sass_text: str) -> list[tuple[int, str]]:
    """(address, opcode without modifiers) of every instruction, in order."""
    return [(at, op) for at, op, _, _ in instruction_fields(sass_text)]


def opcode_counts(sass_text: str) -> Counter:
    return Counter(op for _, op in instructions(sass_text))


def loop_ranges(sass_text: str) -> list[tuple[int, int]]:
    """[target, branch] address ranges of the predicated backward branches (loop back edges): `@P BRA target`, or
    `BRA.U UP, target` where the branch tests a uniform predicate (sm_100a writes some loops so). Unconditional
    backward branches are left out: ptxas places the retry paths of mbarrier waits after the kernel's end and
    jumps back from there into the loop, which is not a loop; a branch to itself (the final trap) neither."""
    labels = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"\.L_x_(\d+):\s*\n\s*/\*([0-9a-f]+)\*/", sass_text)}
    out = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+BRA(?:\.\w+)*|BRA(?:\.\w+)*\s+!?UP\w+,)\s+"
                         r"(?:`\(\.L_x_(\d+)\)|0x([0-9a-f]+))", sass_text):
        at = int(m.group(1), 16)
        target = labels.get(m.group(2)) if m.group(2) else int(m.group(3), 16)
        if target is not None and target < at:
            out.append((target, at))
    return out


def summary(cubin: Path, arch: str, sass_text: str | None = None) -> dict:
    text = disassemble(cubin, arch) if sass_text is None else sass_text
    insns = instructions(text)
    counts = Counter(op for _, op in insns)
    out = {fam: counts.get(fam, 0) for fam in FAMILIES}
    out["total"] = len(insns)
    loops = loop_ranges(text)
    for fam in ("LDL", "STL"):
        out[f"{fam}_in_loop"] = sum(1 for at, op in insns if op == fam and any(a <= at <= b for a, b in loops))
    return out


def ptxas_report(ptx: Path, arch: str) -> str:
    """What `ptxas -v` says when it assembles the PTX for the arch (resources, and the performance notes, such as
    wgmma serialised for lack of registers, that the cubin alone does not show)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([str(ptxas_for(arch)), f"-arch={arch}", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed on {ptx}: {r.stderr.strip()}")
    return r.stdout + r.stderr


def resource_usage(cubin: Path) -> dict:
    r = subprocess.run([str(nvidia_bin("cuobjdump")), "-res-usage", str(cubin)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"cuobjdump -res-usage failed on {cubin}: {r.stderr.strip()}")
    m = re.search(r"Function\s+\S+:\s*\n\s*(.*)", r.stdout)
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", m.group(1))) if m else {}
    return {"registers": int(fields.get("REG", 0)), "stack": int(fields.get("STACK", 0)),
            "static_shared": int(fields.get("SHARED", 0)), "local": int(fields.get("LOCAL", 0))}


def analyse(cubin: Path, arch: str) -> dict:
    """Everything the manifest records about the binary: resources + instruction families + spills."""
    fam = summary(cubin, arch)
    res = resource_usage(cubin)
    res["spill_stores"] = fam["STL"]
    res["spill_loads"] = fam["LDL"]
    return {"resources": res, "sass": fam}
