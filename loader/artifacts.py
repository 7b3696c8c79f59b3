"""Finding and validating built artifacts (pure file I/O: no driver, no torch, no triton).

Layout written by `gdn-aot build` (docs/artifacts.md):
    ROOT/<arch>/manifest.json           written last; the loader trusts nothing a manifest does not list
    ROOT/<arch>/cubins/<sha256>.cubin      content-addressed; ptx/<sha256>.ptx is the PTX it came from
    ROOT/<arch>/launcher/{gdn_aot_launch.h, gdn_aot_launch.c, libgdn_aot_launch.so.<ABI>,
                         libgdn_aot_launch.so -> libgdn_aot_launch.so.<ABI>}
    ROOT/<arch>/kernels.tsv
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .abi import LAUNCHER_ABI_VERSION, MANIFEST_SCHEMA_VERSION
from .errors import ArtifactsNotFound, CorruptArtifact, UnsupportedDevice, build_command

ENV_VAR = "GDN_AOT_ARTIFACTS"

# Triton targets arch-specific sm_90a / sm_100a / sm_103a: such cubins run on exactly that capability (an sm_100a
# cubin does not load on sm_103 or sm_120: a B300 needs the sm_103a build of the same sources), so this table is an
# exact match and nothing falls back.
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}


def arch_for_capability(capability) -> str:
    cap = tuple(int(x) for x in capability)
    arch = ARCH_BY_CAPABILITY.get(cap)
    if arch is None:
        supported = ", ".join(f"{a} (capability {c[0]}.{c[1]})" for c, a in ARCH_BY_CAPABILITY.items())
        raise UnsupportedDevice(
            f"compute capability {cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]}) has no gdn_aot build target; supported: "
            f"{supported}. Arch-specific cubins are not forward compatible, so there is no fallback.")
    return arch


def _has_manifest(root: Path) -> bool:
    return root.is_dir() and any((d / "manifest.json").is_file() for d in root.iterdir() if d.is_dir())


def candidate_roots(path=None) -> list[tuple[str, Path]]:
    out = []
    if path is not None:
        out.append(("argument", Path(path)))
    if os.environ.get(ENV_VAR):
        out.append((f"${ENV_VAR}", Path(os.environ[ENV_VAR])))
    out.append(("package data", Path(__file__).resolve().parent.parent / "artifacts"))
    out.append(("working directory", Path.cwd() / "artifacts"))
    return out


def find_root(path=None) -> Path:
    """Artifact root: explicit path > $GDN_AOT_ARTIFACTS > package data gdn_aot/artifacts > ./artifacts.

    An explicit path or the environment variable, when given, must hold artifacts (no silent fallthrough)."""
    return locate_root(path)[1]


def locate_root(path=None) -> tuple[str, Path]:
    """find_root's answer with where it came from: (origin as in candidate_roots, root)."""
    tried = []
    for origin, root in candidate_roots(path):
        if _has_manifest(root):
            return origin, root
        tried.append(f"{root} ({origin})")
        if origin in ("argument", f"${ENV_VAR}"):
            break
    raise ArtifactsNotFound(
        "no gdn_aot artifacts (a <arch>/manifest.json) found; looked in: " + "; ".join(tried)
        + f". Build them with {build_command()}, or point ${ENV_VAR} at a build output directory.")


def available_arches(root: Path) -> list[str]:
    return sorted(d.name for d in Path(root).iterdir() if (d / "manifest.json").is_file())


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Manifest:
    """One arch's manifest, validated. `variants` maps key -> entry (see docs/artifacts.md)."""

    def __init__(self, root, arch: str):
        self.root = Path(root)
        self.arch = arch
        self.dir = self.root / arch
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise ArtifactsNotFound(
                f"no {arch} artifacts in {self.root} (built arches: {available_arches(self.root) or 'none'}). "
                f"Build them with {build_command(arch, out=str(self.root))}.")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CorruptArtifact(f"{path} is not valid JSON ({e}); rebuild with {build_command(arch)}") from None
        if data.get("schema_version") != MANIFEST_SCHEMA_VERSION:
            raise CorruptArtifact(f"{path} has manifest schema {data.get('schema_version')!r}, this loader reads "
                                  f"{MANIFEST_SCHEMA_VERSION}; rebuild with {build_command(arch)}")
        if data.get("launcher", {}).get("abi_version") != LAUNCHER_ABI_VERSION:
            raise CorruptArtifact(f"{path}: launcher ABI {data.get('launcher', {}).get('abi_version')!r}, this "
                                  f"loader speaks {LAUNCHER_ABI_VERSION}; rebuild with {build_command(arch)}")
        if data.get("arch") != arch:
            raise CorruptArtifact(f"{path} says arch {data.get('arch')!r}, expected {arch}")
        self.path = path
        self.data = data
        self.variants: dict[str, dict] = data["variants"]
        self.failed: dict[str, str] = data.get("failed", {})
        self.dispatch: dict = data.get("dispatch", {})  # {"spec": the spec's preferences, "table": rows}
        self.spec_path: str | None = data.get("spec", {}).get("path")

    def build_command(self) -> str:
        return build_command(self.arch, self.spec_path and _shown_spec(self.spec_path), str(self.root))

    def cubin_path(self, key: str) -> Path:
        return self.dir / self.variants[key]["cubin"]["path"]

    def read_cubin(self, key: str) -> bytes:
        """The cubin's bytes, after checking them against the manifest's sha256 and size."""
        entry = self.variants[key]["cubin"]
        path = self.dir / entry["path"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CorruptArtifact(f"{key}: cubin {path} is missing ({e}); rebuild with {self.build_command()}") \
                from None
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CorruptArtifact(f"{key}: cubin {path} does not match its manifest sha256 {entry['sha256']}; "
                                  f"rebuild with {self.build_command()}")
        return data

    def launcher_path(self) -> Path:
        return self.dir / self.data["launcher"]["library"]

    def verify_launcher(self) -> Path:
        lib = self.launcher_path()
        want = self.data["launcher"]["files"][lib.name]
        if not lib.is_file() or sha256_file(lib) != want:
            raise CorruptArtifact(f"{lib} is missing or does not match its manifest sha256 {want}; "
                                  f"rebuild with {self.build_command()}")
        return lib


def _shown_spec(path: str) -> str:
    """The spec as the user would type it: relative to the cwd when inside it, else the file name."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd()))
    except ValueError:
        return f"specs/{p.name}" if p.parent.name == "specs" else str(p)
