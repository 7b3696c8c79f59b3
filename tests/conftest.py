"""Shared fixtures: one real build of specs/tiny.yaml (every arch) for the whole session, and the `gpu` marker.

Variants whose Gluon source module does not exist yet are expected build failures; tests that need them skip
(set GDN_AOT_REQUIRE_ALL_KERNELS=1 to turn those skips into failures once every kernel is written).
A variant whose source exists but failed to build is always a test failure.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# `python -m pytest` from the checkout puts it first on sys.path, where its top-level kernels/, loader/ and build/
# would shadow packages of those names that other libraries import (transformers probes for the hub's `kernels`).
# The tests import the installed gdn_aot, never the checkout's folders, so the checkout leaves the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
REQUIRE_ALL = os.environ.get("GDN_AOT_REQUIRE_ALL_KERNELS") == "1"
ARCHES = ("sm_90a", "sm_100a", "sm_103a")  # what specs/tiny.yaml builds


def gdn_aot_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "gdn-aot"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "gdn_aot.build.cli"]


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*gdn_aot_cmd(), *map(str, args)], capture_output=True, text=True, **kw)


def source_module(kernel: str, arch: str) -> str:
    from gdn_aot.kernels import KERNELS

    return KERNELS[kernel].module(arch)


def source_exists(kernel: str, arch: str) -> bool:
    return importlib.util.find_spec(source_module(kernel, arch)) is not None


def build_spec(spec, out: Path, *extra) -> dict:
    r = run_cli("build", spec, "--out", out, "--json", "-j", os.cpu_count() or 2, *extra)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"gdn-aot build printed no JSON report (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
    report["rc"] = r.returncode
    report["stderr"] = r.stderr
    return report


@dataclasses.dataclass
class Build:
    out: Path
    report: dict

    def manifest(self, arch: str) -> dict:
        return json.loads((self.out / arch / "manifest.json").read_text())

    def entries(self, arch: str, kernel: str | None = None) -> dict[str, dict]:
        return {k: e for k, e in self.manifest(arch)["variants"].items() if kernel is None or e["kernel"] == kernel}

    def require(self, arch: str, kernel: str) -> dict[str, dict]:
        """The built variants of kernel on arch; skips while its source is not written, fails if it broke."""
        if not source_exists(kernel, arch) and not REQUIRE_ALL:
            pytest.skip(f"{source_module(kernel, arch)} is not written yet")
        got = self.entries(arch, kernel)
        failed = self.manifest(arch)["failed"]
        assert got, f"{kernel} on {arch} did not build; logs: " + ", ".join(
            str(self.out / arch / log) for k, log in failed.items() if k.startswith(kernel + "."))
        return got

    def unexpected_failures(self) -> list[str]:
        return [v["key"] for v in self.report["variants"] if v["status"] == "failed"
                and (REQUIRE_ALL or source_exists(v["key"].split(".")[0], v["arch"]))]


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory) -> Build:
    out = tmp_path_factory.mktemp("tiny") / "artifacts"
    return Build(out, build_spec(REPO / "specs" / "tiny.yaml", out))


@pytest.fixture(scope="session")
def device_build(tmp_path_factory) -> tuple[Build, str]:
    """specs/tiny.yaml built for the GPU's arch alone, and that arch: what the GPU tests that need a build run.
    The whole tiny build also makes the other arches' cubins, and sm_103a's SASS checks need the pinned nvdisasm of
    the build extras, which a GPU host with the runtime wheel alone does not have."""
    import torch
    from gdn_aot.loader.artifacts import arch_for_capability

    arch = arch_for_capability(torch.cuda.get_device_capability(0))
    out = tmp_path_factory.mktemp("device") / "artifacts"
    return Build(out, build_spec(REPO / "specs" / "tiny.yaml", out, "--arch", arch.removesuffix("a"))), arch


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory) -> Path:
    """The pure gdn_aot wheel of this checkout (pip wheel --no-deps), built once per session."""
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("gdn_aot-*.whl")
    return whl


@pytest.fixture
def tiny_copy(tiny_build, tmp_path) -> Build:
    """A private copy of the tiny build, for tests that tamper with it."""
    dst = tmp_path / "artifacts"
    shutil.copytree(tiny_build.out, dst, symlinks=True)
    return Build(dst, tiny_build.report)


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
