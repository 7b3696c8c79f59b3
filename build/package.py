"""Shipping built artifacts: a verified runtime-only copy, and a wheel that carries them as package data.

    gdn-aot package artifacts --into /opt/gdn-aot/artifacts      # then GDN_AOT_ARTIFACTS=/opt/gdn-aot/artifacts
    gdn-aot package artifacts --wheel .whl/gdn_aot-0.1.0-py3-none-any.whl --out dist
        -> dist/gdn_aot-0.1.0-py3-none-linux_x86_64.whl with gdn_aot/artifacts/<arch>/... inside

The runtime subset of an arch directory is what the loader and a C consumer read: manifest.json, kernels.tsv,
the cubins the manifest lists, and the launcher (header, source, libgdn_aot_launch.so.<ABI>); PTX only with
with_ptx, build logs never. Every file is checked against the manifest's sha256 before it is copied. In a
wheel the development symlink libgdn_aot_launch.so is left out (zip has no symlinks; the loader opens the
versioned file the manifest names), and the wheel is retagged for this platform, since the launcher is a
native shared library: `py3-none-any` becomes `py3-none-linux_x86_64` (a local-deployment tag: run
auditwheel, or rename to a manylinux tag yourself, before publishing to an index).
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sysconfig
import zipfile
from pathlib import Path

from .manifest import TSV, tsv
from ..loader.artifacts import Manifest, available_arches, sha256_file

PACKAGE_DATA = "gdn_aot/artifacts"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed zip timestamps: the same inputs give the same wheel bytes


class PackageError(RuntimeError):
    pass


def runtime_files(root: Path, arch: str, with_ptx: bool = False) -> list[tuple[str, str | None]]:
    """[(path relative to the arch dir, expected sha256 or None)] of what a deployment needs, verified present."""
    m = Manifest(root, arch)
    out: list[tuple[str, str | None]] = [("manifest.json", None), ("kernels.tsv", None)]
    for e in m.variants.values():
        out.append((e["cubin"]["path"], e["cubin"]["sha256"]))
        if with_ptx:
            out.append((e["ptx"]["path"], e["ptx"]["sha256"]))
    for name, digest in m.data["launcher"]["files"].items():
        out.append((f"launcher/{name}", digest))
    problems = []
    if (m.dir / TSV).is_file() and (m.dir / TSV).read_bytes() != tsv(m.variants):
        problems.append(f"{m.dir / TSV} does not match the manifest")
    for rel, digest in out:
        p = m.dir / rel
        if not p.is_file():
            problems.append(f"{p} is missing")
        elif digest and sha256_file(p) != digest:
            problems.append(f"{p} does not match its manifest sha256 {digest}")
    if problems:
        raise PackageError(f"{m.dir}: refusing to package damaged artifacts ({'; '.join(problems)}); rebuild with "
                           f"{m.build_command()}")
    return sorted(set(out))


def _arches(root: Path, arches) -> list[str]:
    built = available_arches(root) if Path(root).is_dir() else []
    if not built:
        raise PackageError(f"{root}: no <arch>/manifest.json here (build with `gdn-aot build SPEC --out {root}`)")
    want = list(arches or built)
    missing = [a for a in want if a not in built]
    if missing:
        raise PackageError(f"{root}: no {', '.join(missing)} artifacts; built: {', '.join(built)}")
    return want


def copy_runtime(root: Path, into: Path, arches=None, with_ptx: bool = False) -> dict:
    """Copy the runtime subset of root's arches into `into` (replacing each arch directory there whole)."""
    root, into = Path(root), Path(into)
    report = {"into": str(into), "arches": {}}
    for arch in _arches(root, arches):
        files = runtime_files(root, arch, with_ptx)
        dst = into / arch
        tmp = into / f".{arch}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, _ in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / arch / rel, tmp / rel)
        m = Manifest(root, arch)
        link = m.data["launcher"].get("link_name")
        if link:  # the -lgdn_aot_launch development symlink, for C/C++ consumers that link against the copy
            os.symlink(Path(m.data["launcher"]["library"]).name, tmp / link)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
        report["arches"][arch] = {"files": len(files), "bytes": sum((dst / r).stat().st_size for r, _ in files)}
    return report


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _zinfo(name: str, mode: int) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name, date_time=_EPOCH)
    zi.external_attr = (0o100000 | mode) << 16
    zi.compress_type = zipfile.ZIP_DEFLATED
    return zi


def add_to_wheel(wheel: Path, root: Path, out_dir: Path, arches=None, with_ptx: bool = False,
                 plat: str | None = None) -> Path:
    """A copy of `wheel` (the pure gdn_aot wheel) with root's artifacts under gdn_aot/artifacts/<arch>/,
    retagged py3-none-<plat>; returns its path in out_dir."""
    wheel, root, out_dir = Path(wheel), Path(root), Path(out_dir)
    parts = wheel.name[:-len(".whl")].split("-")
    if len(parts) != 5 or parts[0] != "gdn_aot":
        raise PackageError(f"{wheel.name} is not a gdn_aot wheel (name-version-python-abi-platform.whl)")
    dist, version = parts[0], parts[1]
    plat = plat or platform_tag()
    tag = f"py3-none-{plat}"
    info = f"{dist}-{version}.dist-info"
    entries: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(wheel) as zin:
        names = zin.namelist()
        if any(n.startswith(PACKAGE_DATA + "/") for n in names):
            raise PackageError(f"{wheel.name} already carries {PACKAGE_DATA}/")
        for n in names:
            if n in (f"{info}/RECORD",):
                continue
            data = zin.read(n)
            if n == f"{info}/WHEEL":
                lines = [ln for ln in data.decode().splitlines() if not ln.startswith(("Tag:", "Root-Is-Purelib:"))]
                lines += ["Root-Is-Purelib: false", f"Tag: {tag}"]
                data = ("\n".join(lines) + "\n").encode()
            src = zin.getinfo(n)
            entries.append((_zinfo(n, (src.external_attr >> 16) & 0o777 or 0o644), data))
    for arch in _arches(root, arches):
        for rel, _ in runtime_files(root, arch, with_ptx):
            p = root / arch / rel
            mode = 0o755 if rel.startswith("launcher/lib") else 0o644
            entries.append((_zinfo(f"{PACKAGE_DATA}/{arch}/{rel}", mode), p.read_bytes()))
    record = "".join(f"{zi.filename},{_record_hash(d)},{len(d)}\n" for zi, d in entries)
    record += f"{info}/RECORD,,\n"
    entries.append((_zinfo(f"{info}/RECORD", 0o644), record.encode()))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{dist}-{version}-{tag}.whl"
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w") as zout:
        for zi, data in entries:
            zout.writestr(zi, data)
    os.replace(tmp, out)
    return out
