"""Writing artifacts atomically: files via tempfile + os.replace, the manifest last.

An interrupted build leaves either the previous manifest (whose cubins are content-addressed and so never
overwritten) or the new one, never a half-written file the loader would accept.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..loader.abi import MANIFEST_SCHEMA_VERSION

MANIFEST = "manifest.json"
TSV = "kernels.tsv"
TSV_COLUMNS = ("key", "kernel", "entry", "cubin", "num_warps", "shared", "global_scratch_size",
               "global_scratch_align", "grid", "dtype", "K", "V", "BT", "BK", "BV", "varlen", "transpose",
               "state_dtype", "gating", "checkpoints")
TSV_AXES = TSV_COLUMNS[9:]  # booleans as 0/1


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def dumps(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def read_previous(arch_dir: Path) -> dict:
    """The manifest of a previous build, or {} when there is none or it is unreadable/outdated."""
    try:
        data = json.loads((arch_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if data.get("schema_version") == MANIFEST_SCHEMA_VERSION else {}


def tsv(variants: dict) -> bytes:
    """kernels.tsv for C consumers: one line per variant, columns TSV_COLUMNS, '#' header (read columns by
    name: new ones are only ever appended). The variant's axes close the line, booleans as 0/1."""
    lines = ["#" + "\t".join(TSV_COLUMNS)]
    for key in sorted(variants):
        v = variants[key]
        axes = [int(v["axes"][a]) if isinstance(v["axes"][a], bool) else v["axes"][a] for a in TSV_AXES]
        lines.append("\t".join(str(x) for x in (
            key, v["kernel"], v["entry"], v["cubin"]["path"], v["num_warps"], v["shared"],
            v["global_scratch_size"], v["global_scratch_align"], v["grid"], *axes)))
    return ("\n".join(lines) + "\n").encode()


def write(arch_dir: Path, manifest: dict) -> None:
    """kernels.tsv, then manifest.json (last), then drop cubins/PTX the manifest no longer references."""
    atomic_write(arch_dir / TSV, tsv(manifest["variants"]))
    atomic_write(arch_dir / MANIFEST, dumps(manifest))
    keep = {v[kind]["path"] for v in manifest["variants"].values() for kind in ("cubin", "ptx")}
    for f in [*arch_dir.glob("cubins/*.cubin"), *arch_dir.glob("ptx/*.ptx")]:
        if f"{f.parent.name}/{f.name}" not in keep:
            f.unlink()
