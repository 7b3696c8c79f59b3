"""The kernel parameter list as the launcher passes it, and its check against the compiled kernel.

The list is the family's runtime parameters (loader/abi.py FAMILIES, with the types it maps to C, PTX and
ctypes), then the global_scratch and profile_scratch pointers Triton appends to every kernel. The build checks
each variant's list against the PTX `.entry` (count, width, int/float class, pointer-ness, order) and against the
cubin's EIATTR_KPARAM_INFO table (docs/artifacts.md), so the launcher packs exactly what the kernel reads.
"""
from __future__ import annotations

import re

from ..loader.abi import param_abi


class AbiError(ValueError):
    pass


def param(name: str, ty: str) -> dict:
    if ty.startswith("tensordesc"):
        # The kernels build their TMA descriptors on device (per sequence, so varlen bounds are exact), so no
        # host-side CUtensorMap is ever passed. Supporting one would mean a 128-byte by-value param + shape/stride
        # params (1 + 2r in all) and a cuTensorMapEncodeTiled per call on the host: refused until a kernel needs it.
        raise AbiError(f"parameter {name!r} is a tensor descriptor ({ty}); the generated launcher does not "
                       "support host-built tensor descriptors (kernels make theirs on device)")
    try:
        return param_abi(name, ty)
    except ValueError as e:
        raise AbiError(str(e)) from None


def scratch_params() -> list[dict]:
    return [dict(param("global_scratch", "*i8"), kind="global_scratch"),
            dict(param("profile_scratch", "*i8"), kind="profile_scratch")]


def family_params(kd) -> list[dict]:
    """Runtime params of a kernel family (pointee dtype left symbolic: all variants share this list)."""
    return [param(n, t) for n, t in kd.params]


def variant_params(kd, variant) -> list[dict]:
    """The full list the ABI sees for one variant: runtime params with dtypes, then the two scratch pointers."""
    sig = kd.signature(variant)
    return [param(n, sig[n]) for n, _ in kd.params] + scratch_params()


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(\.ptr[^\n,]*?\s+)?(\w+)(?:\[(\d+)\])?\s*(?:,|$)")


def ptx_entry_params(ptx: str, entry: str | None = None) -> tuple[str, list[dict]]:
    """(entry name, [{ptx, bytes, ptr}]) from the PTX `.entry` declaration."""
    for m in _ENTRY.finditer(ptx):
        if entry is None or m.group(1) == entry:
            out = []
            for p in _PARAM.finditer(m.group(2)):
                ty = p.group(2)
                bits = int(re.sub(r"\D", "", ty) or 8)
                n = int(p.group(5) or 1)
                out.append({"ptx": ty, "bytes": bits // 8 * n, "ptr": bool(p.group(3)), "name": p.group(4)})
            return m.group(1), out
    raise AbiError(f"no .entry {entry or ''} in the PTX")


def _cls(ptx_type: str) -> str:
    return "f" if ptx_type.startswith("f") else "i"


def check_against_ptx(params: list[dict], ptx: str, entry: str) -> None:
    """Raise AbiError unless the PTX entry's params match `params` in count, width, int/float class, order."""
    _, got = ptx_entry_params(ptx, entry)
    if len(got) != len(params):
        raise AbiError(f"{entry}: PTX has {len(got)} params, the ABI list has {len(params)} "
                       f"({[p['name'] for p in params]})")
    for i, (want, have) in enumerate(zip(params, got)):
        if want["bytes"] != have["bytes"] or _cls(want["ptx"]) != _cls(have["ptx"]):
            raise AbiError(f"{entry}: param {i} ({want['name']}) is {want['ptx']}/{want['bytes']}B in the ABI "
                           f"but .{have['ptx']}/{have['bytes']}B in the PTX")
        if want["kind"] != "scalar" and not have["ptr"]:
            raise AbiError(f"{entry}: param {i} ({want['name']}) is a pointer in the ABI but not in the PTX")


_KPARAM = re.compile(r"EIATTR_KPARAM_INFO.*?Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*(0x[0-9a-f]+)\s+Size\s*:\s*(0x[0-9a-f]+)",
                     re.S)


def cubin_params(cubin) -> list[dict]:
    """[{ordinal, offset, bytes}] from the cubin's EIATTR_KPARAM_INFO table (cuobjdump -elf), by ordinal."""
    import subprocess

    from .toolchain import nvidia_bin

    r = subprocess.run([str(nvidia_bin("cuobjdump")), "-elf", str(cubin)], capture_output=True, text=True)
    if r.returncode:
        raise AbiError(f"cuobjdump -elf failed on {cubin}: {r.stderr.strip()}")
    rows = [{"ordinal": int(o, 16), "offset": int(off, 16), "bytes": int(sz, 16)}
            for o, off, sz in _KPARAM.findall(r.stdout)]
    return sorted(rows, key=lambda x: x["ordinal"])


def check_against_cubin(params: list[dict], cubin) -> None:
    """Raise AbiError unless the cubin's param table has the ABI list's count and sizes, in order."""
    got = cubin_params(cubin)
    if [g["ordinal"] for g in got] != list(range(len(params))):
        raise AbiError(f"{cubin}: param table has ordinals {[g['ordinal'] for g in got]}, expected "
                       f"0..{len(params) - 1}")
    for want, have in zip(params, got):
        if want["bytes"] != have["bytes"]:
            raise AbiError(f"{cubin}: param {have['ordinal']} ({want['name']}) is {have['bytes']} bytes in the "
                           f"cubin, {want['bytes']} in the ABI")
    offs = [g["offset"] for g in got]
    if offs != sorted(offs):
        raise AbiError(f"{cubin}: param offsets are not increasing with the ordinal: {offs}")
