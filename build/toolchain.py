"""The tools the build uses, found without importing triton.

ptxas 12.8 (sm_90a) and ptxas-blackwell 12.9 (sm_100a, sm_103a), cuobjdump 12.8 and cuda.h live under
triton/backends/nvidia/{bin,include}. The nvdisasm bundled there (12.8) cannot decode sm_103a ("Cannot decode
architecture"), so cubins are disassembled by the nvdisasm of the pinned build dependency NVDISASM_DIST (a pip
wheel of nvdisasm alone; on the sm_90a and sm_100a cubins of specs/tiny.yaml its instruction counts equal 12.8's);
where that wheel is not installed (an offline host with the card's packages only), triton's serves the arches it
decodes and an sm_103a build stops with the pip command. The versions of ptxas and nvdisasm go into the input hash
and the manifest.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from ..kernels.registry import arch_capability

# the wheel of the nvdisasm the SASS analysis runs, pinned (the manifest's and the tests' SASS counts are this
# version's): also pyproject's `build` extra and the Makefile's NVDISASM_DEP
NVDISASM_DIST = "nvidia-cuda-nvdisasm"
NVDISASM_PIN = "13.5.37"
BUNDLED_NVDISASM_ARCHES = ("sm_90a", "sm_100a")  # what triton's own nvdisasm (12.8) decodes


class ToolchainError(RuntimeError):
    pass


@functools.lru_cache(None)
def triton_dir() -> Path:
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError("triton is not installed; the build needs it: pip install 'gdn-aot[build]' "
                             "(or triton==3.6.0)")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(None)
def triton_version() -> str:
    triton_dir()  # a clear ToolchainError when triton is missing
    return importlib.metadata.version("triton")


def nvidia_bin(name: str) -> Path:
    p = triton_dir() / "backends" / "nvidia" / "bin" / name
    if not p.is_file():
        raise ToolchainError(f"{p} is missing from the triton wheel")
    return p


def cuda_include() -> Path:
    return triton_dir() / "backends" / "nvidia" / "include"


def ptxas_for(arch: str) -> Path:
    """The ptxas triton itself picks for the arch (triton.backends.nvidia.compiler.get_ptxas: capability >= 100)."""
    return nvidia_bin("ptxas-blackwell" if arch_capability(arch) >= 100 else "ptxas")


@functools.lru_cache(None)
def nvdisasm(arch: str) -> Path:
    """The nvdisasm for `arch`'s cubins: bin/nvdisasm of the installed NVDISASM_DIST wheel, which must be the pinned
    version; without the wheel, triton's own for the arches it decodes (BUNDLED_NVDISASM_ARCHES)."""
    install = f"pip install '{NVDISASM_DIST}=={NVDISASM_PIN}' (or 'gdn-aot[build]')"
    try:
        dist = importlib.metadata.distribution(NVDISASM_DIST)
    except importlib.metadata.PackageNotFoundError:
        if arch in BUNDLED_NVDISASM_ARCHES:
            return nvidia_bin("nvdisasm")
        raise ToolchainError(f"{NVDISASM_DIST} is not installed; {arch} cubins need its nvdisasm (triton's cannot "
                             f"decode {arch}): {install}") from None
    if dist.version != NVDISASM_PIN:
        raise ToolchainError(f"{NVDISASM_DIST} {dist.version} is installed, the build is pinned to {NVDISASM_PIN}: "
                             f"{install}")
    exe = [f for f in dist.files or () if f.name == "nvdisasm"]
    if not exe:
        raise ToolchainError(f"{NVDISASM_DIST} {dist.version} holds no bin/nvdisasm; reinstall it: {install}")
    return Path(dist.locate_file(exe[0]))


@functools.lru_cache(None)
def tool_version(path: Path) -> str:
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


def ptxas_version(arch: str) -> str:
    return tool_version(ptxas_for(arch))


def nvdisasm_version(arch: str) -> str:
    return tool_version(nvdisasm(arch))


@functools.lru_cache(None)
def cc() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise ToolchainError("no C compiler found (set CC); the launcher .so is compiled at build time")


@functools.lru_cache(None)
def cc_version() -> str:
    out = subprocess.run([cc(), "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else "unknown"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sanitized_env(triton_home: Path) -> dict:
    """Environment for a compile worker: nothing from the user's TRITON_*/MLIR debug knobs leaks in, the
    cache and home are private (results are never served from ~/.triton), and every compile is real."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRITON_", "MLIR_", "LLVM_", "NVPTX_", "USE_IR_LOC"))}
    env.update({
        "TRITON_HOME": str(triton_home),
        "TRITON_CACHE_DIR": str(triton_home / "cache"),
        "TRITON_DUMP_DIR": str(triton_home / "dump"),
        "TRITON_OVERRIDE_DIR": str(triton_home / "override"),
        "TRITON_ALWAYS_COMPILE": "1",
        "PYTHONHASHSEED": "0",
    })
    return env
