"""Deployment (docs/deploy.md): `gdn-aot package` (a runtime-only copy, or a wheel carrying the artifacts as
package data), and the loader in a fresh virtual environment that has NO triton at all.

The triton-free venv (torch + pyyaml/click/jinja2/numpy) is created once under .venv-notriton (git-ignored,
about a minute, torch comes from pip's configured wheel sources) and reused while its requirements are unchanged;
the project wheel is reinstalled into it only when the wheel's hash changes. GDN_AOT_SKIP_NOTRITON_VENV=1 skips
that test (for machines that cannot install torch).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from gdn_aot.build.package import PackageError, add_to_wheel, copy_runtime, platform_tag
from gdn_aot.loader import Artifacts, Manifest
from gdn_aot.loader.artifacts import LAUNCHER_ABI_VERSION

from conftest import ARCHES, REPO, run_cli

SONAME = f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}"
VENV = REPO / ".venv-notriton"
VENV_REQUIREMENTS = ("torch==2.13.0", "pyyaml", "click", "jinja2", "numpy")


def _require_all(build):
    for arch in ARCHES:
        for kernel in ("gdn_prepare", "gdn_scan"):
            build.require(arch, kernel)


def test_package_into_copies_the_runtime_subset(tiny_build, tmp_path, monkeypatch):
    _require_all(tiny_build)
    dst = tmp_path / "deploy"
    r = run_cli("package", tiny_build.out, "--into", dst, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert sorted(report["arches"]) == sorted(ARCHES)
    for arch in ARCHES:
        m = Manifest(dst, arch)
        files = {p.relative_to(dst / arch).as_posix() for p in (dst / arch).rglob("*") if not p.is_dir()}
        want = {"manifest.json", "kernels.tsv", "launcher/gdn_aot_launch.h", "launcher/gdn_aot_launch.c",
                f"launcher/{SONAME}", "launcher/libgdn_aot_launch.so"}
        want |= {e["cubin"]["path"] for e in m.variants.values()}
        assert files == want  # no PTX, no logs
        assert report["arches"][arch]["files"] == len(want) - 1  # the symlink is not counted
        assert os.readlink(dst / arch / "launcher" / "libgdn_aot_launch.so") == SONAME
        assert (dst / arch / "manifest.json").read_bytes() == (tiny_build.out / arch / "manifest.json").read_bytes()
    r = run_cli("verify", dst)  # a runtime-only copy verifies (PTX was not shipped, so it is not asked for)
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("GDN_AOT_ARTIFACTS", str(dst))
    Artifacts.clear()
    try:
        s = Artifacts.for_device(0, capability=(9, 0))
        assert s.manifest.root == dst
        k = s.pick("gdn_prepare", dtype="bf16", K=128, V=128, varlen=True)
        assert s.manifest.read_cubin(k.key)  # sha256-checked
    finally:
        Artifacts.clear()
    for word, arch in (("sm_100", "sm_100a"), ("sm_103", "sm_103a")):
        r = run_cli("package", tiny_build.out, "--arch", word, "--into", tmp_path / word)
        assert r.returncode == 0, r.stderr
        assert [p.name for p in (tmp_path / word).iterdir()] == [arch]


def test_package_refuses_damaged_artifacts(tiny_copy, tmp_path):
    _require_all(tiny_copy)
    m = Manifest(tiny_copy.out, "sm_90a")
    cubin = m.cubin_path(next(iter(m.variants)))
    cubin.write_bytes(cubin.read_bytes()[:-1])
    with pytest.raises(PackageError, match="damaged"):
        copy_runtime(tiny_copy.out, tmp_path / "x")
    r = run_cli("package", tiny_copy.out, "--into", tmp_path / "x")
    assert r.returncode == 1 and cubin.name in r.stderr and "gdn-aot build" in r.stderr
    r = run_cli("package", tiny_copy.out)
    assert r.returncode == 2 and "exactly one of --into DIR and --wheel WHEEL" in r.stderr
    r = run_cli("package", tiny_copy.out, "--arch", "sm_80", "--into", tmp_path / "y")
    assert r.returncode == 2 and "sm_80" in r.stderr


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def artifact_wheel(tiny_build, project_wheel, tmp_path_factory) -> Path:
    _require_all(tiny_build)
    out = tmp_path_factory.mktemp("dist")
    r = run_cli("package", tiny_build.out, "--wheel", project_wheel, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    return Path(json.loads(r.stdout)["wheel"])


def test_wheel_with_artifacts(artifact_wheel, project_wheel, tiny_build, tmp_path):
    whl = artifact_wheel
    assert whl.name == project_wheel.name.replace("-py3-none-any.whl", f"-py3-none-{platform_tag()}.whl")
    z = zipfile.ZipFile(whl)
    names = z.namelist()
    base = set(zipfile.ZipFile(project_wheel).namelist())
    assert base <= set(names)  # everything of the pure wheel, plus the artifacts
    for arch in ARCHES:
        m = Manifest(tiny_build.out, arch)
        for e in m.variants.values():
            assert z.read(f"gdn_aot/artifacts/{arch}/{e['cubin']['path']}") == m.cubin_path(e["key"]).read_bytes()
        so = z.getinfo(f"gdn_aot/artifacts/{arch}/launcher/{SONAME}")
        assert (so.external_attr >> 16) & 0o111  # executable, as a shared library should be
        assert f"gdn_aot/artifacts/{arch}/manifest.json" in names and f"gdn_aot/artifacts/{arch}/kernels.tsv" in names
    assert not any("/ptx/" in n or "/logs/" in n or n.endswith("libgdn_aot_launch.so") for n in names)
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL"))
    wheel_meta = z.read(f"{info}/WHEEL").decode()
    assert f"Tag: py3-none-{platform_tag()}" in wheel_meta and "Root-Is-Purelib: false" in wheel_meta
    assert "py3-none-any" not in wheel_meta
    record = [ln.split(",") for ln in z.read(f"{info}/RECORD").decode().splitlines()]
    assert sorted(r[0] for r in record) == sorted(names)
    for path, digest, size in record:
        if path.endswith("RECORD"):
            assert digest == size == ""
            continue
        data = z.read(path)
        assert digest == _record_hash(data) and int(size) == len(data), path
    again = add_to_wheel(project_wheel, tiny_build.out, tmp_path)  # reproducible: same inputs, same bytes
    assert again.read_bytes() == whl.read_bytes()
    with pytest.raises(PackageError, match="already carries"):
        add_to_wheel(whl, tiny_build.out, tmp_path / "twice")


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _notriton_venv() -> Path:
    """.venv-notriton with VENV_REQUIREMENTS (and no triton), made once and reused while the key matches."""
    key = json.dumps({"python": sys.version.split()[0], "requirements": VENV_REQUIREMENTS})
    stamp = VENV / ".stamp-requirements"
    if stamp.is_file() and stamp.read_text() == key and _venv_python().is_file():
        return VENV
    shutil.rmtree(VENV, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "venv", str(VENV)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(_venv_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *VENV_REQUIREMENTS], capture_output=True, text=True, timeout=900)
    if r.returncode:
        shutil.rmtree(VENV, ignore_errors=True)
        pytest.fail(f"could not create the triton-free venv ({' '.join(VENV_REQUIREMENTS)}):\n{r.stderr[-3000:]}")
    stamp.write_text(key)  # last: an interrupted set-up is redone next time
    return VENV


def _install_wheel(whl: Path) -> None:
    """(Re)install the project wheel with --no-deps, unless the installed one has the same sha256."""
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    stamp = VENV / ".stamp-wheel"
    if stamp.is_file() and stamp.read_text() == digest:
        return
    r = subprocess.run([str(_venv_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--no-index", "--force-reinstall", str(whl)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    stamp.write_text(digest)


NO_TRITON_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys
    from pathlib import Path
    assert importlib.util.find_spec("triton") is None, "triton is installed in the runtime venv"
    import gdn_aot
    import gdn_aot.loader
    from gdn_aot.loader import Artifacts, Launcher, find_root
    import gdn_aot.loader.api, gdn_aot.loader.fla_compat, gdn_aot.loader.torch_op  # the runtime entry points
    out = {"package": str(Path(gdn_aot.__file__).parent), "roots": {}, "picked": {}}
    out["roots"]["default"] = str(find_root())  # package data: the wheel's gdn_aot/artifacts
    for cap in ((9, 0), (10, 0), (10, 3)):
        s = Artifacts.for_device(0, capability=cap)
        prep = s.pick("gdn_prepare", dtype="bf16", K=128, V=128, varlen=True)
        scan = s.routes("bf16", 128, 128, True, False, sm_count=132).select(8).kernels["gdn_scan"]
        s.manifest.read_cubin(prep.key), s.manifest.read_cubin(scan.key)  # sha256-checked
        lib = Launcher.open(s.manifest.verify_launcher())  # dlopen the launcher .so
        out["picked"][s.arch] = [prep.key, scan.key, lib.lib.gdn_aot_abi_version(), lib.path.name]
    os.environ["GDN_AOT_ARTIFACTS"] = sys.argv[1]
    out["roots"]["env"] = str(find_root())
    out["triton_imported"] = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
    out["build_imported"] = sorted(m for m in sys.modules if m.startswith("gdn_aot.build") or  # Gluon sources:
                                   (m.startswith("gdn_aot.kernels.") and m != "gdn_aot.kernels.registry"))
    print(json.dumps(out))
""")


def test_runtime_venv_without_triton(artifact_wheel, tiny_build, tmp_path):
    """The deployment promise: pip install the wheel with artifacts next to torch, no triton, and the loader
    finds the artifacts (package data, or $GDN_AOT_ARTIFACTS), picks variants and dlopens the launcher."""
    if os.environ.get("GDN_AOT_SKIP_NOTRITON_VENV") == "1":
        pytest.skip("GDN_AOT_SKIP_NOTRITON_VENV=1")
    _notriton_venv()
    _install_wheel(artifact_wheel)
    copy = tmp_path / "copied"
    copy_runtime(tiny_build.out, copy)
    env = {k: v for k, v in os.environ.items() if k not in ("GDN_AOT_ARTIFACTS", "PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([str(_venv_python()), "-c", NO_TRITON_SCRIPT, str(copy)], capture_output=True, text=True,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["package"].startswith(str(VENV)), out["package"]  # the installed wheel, not this checkout
    assert out["roots"]["default"] == str(Path(out["package"]) / "artifacts")
    assert out["roots"]["env"] == str(copy)
    for arch, cap in (("sm_90a", (9, 0)), ("sm_100a", (10, 0)), ("sm_103a", (10, 3))):
        prep, scan, abi, lib = out["picked"][arch]
        s = Artifacts.for_device(0, capability=cap, root=tiny_build.out)
        assert prep == s.pick("gdn_prepare", dtype="bf16", K=128, V=128, varlen=True).key
        assert scan.startswith(f"gdn_scan.{arch}.bf16.") and ".varlen.kv." in scan
        assert abi == LAUNCHER_ABI_VERSION and lib == SONAME
    assert out["triton_imported"] == [] and out["build_imported"] == []
    # the CLI's read-only commands work there too; building says what to install
    cli = VENV / "bin" / "gdn-aot"
    r = subprocess.run([str(cli), "verify", out["roots"]["default"]], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(cli), "build", "tiny", "--out", str(tmp_path / "b")], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "triton is not installed" in r.stderr and "gdn-aot[build]" in r.stderr
