"""Packaging: one `gdn_aot` namespace in the wheel, a cheap `import gdn_aot`, the console script."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ARCHES, run_cli


def test_wheel_layout(project_wheel):
    whl = project_wheel
    assert whl.name.endswith("-py3-none-any.whl")  # pure: no artifacts, no native code
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gdn_aot"}, tops  # nothing else top-level
    for need in ("gdn_aot/__init__.py", "gdn_aot/kernels/__init__.py", "gdn_aot/kernels/registry.py",
                 "gdn_aot/kernels/common.py", "gdn_aot/kernels/prepare_sm90.py", "gdn_aot/kernels/prepare_sm100.py",
                 "gdn_aot/kernels/scan_sm90.py", "gdn_aot/kernels/scan_sm100.py", "gdn_aot/build/cli.py",
                 "gdn_aot/build/package.py", "gdn_aot/build/templates/gdn_aot_launch.h.j2",
                 "gdn_aot/build/templates/gdn_aot_launch.c.j2", "gdn_aot/loader/runtime.py",
                 "gdn_aot/loader/abi.py", "gdn_aot/loader/dispatch.py", "gdn_aot/build/params.py",
                 "gdn_aot/specs/qwen35.yaml", "gdn_aot/specs/tiny.yaml"):
        assert need in names, need
    assert not any("_root.py" in n or "__pycache__" in n or n.startswith("gdn_aot/artifacts/") for n in names)
    assert "gdn_aot/kernels/l2norm.py" not in names  # fused into gdn_prepare / gdn_scan
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "gdn-aot = gdn_aot.build.cli:main" in meta


def test_import_is_cheap(tmp_path):
    script = ("import json, sys, gdn_aot; print(json.dumps([m for m in sys.modules "
              "if m.split('.')[0] in ('torch', 'triton', 'numpy', 'yaml', 'jinja2')]))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    r = subprocess.run([sys.executable, "-c", "import gdn_aot; print(gdn_aot.__all__)"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert "chunk_gated_delta_rule" in r.stdout


def test_the_checkout_does_not_shadow_other_packages():
    """Run as `python -m pytest` from the checkout, its top-level kernels/ would be found as the `kernels` package
    that transformers probes for (a GPU host with transformers failed to collect its test): conftest takes the
    checkout off sys.path, and the tests import the installed gdn_aot."""
    from conftest import REPO

    assert all(Path(p or ".").resolve() != REPO for p in sys.path)
    spec = importlib.util.find_spec("kernels")
    assert spec is None or REPO not in Path(spec.origin).parents


def test_cli_help():
    for args in (["--help"], ["build", "--help"], ["list", "--help"], ["verify", "--help"], ["inspect", "--help"],
                 ["package", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "Example" in r.stdout, (args, r.stdout, r.stderr)
        if args != ["--help"]:
            assert "--json" in r.stdout, args
    r = run_cli("--version")
    assert r.returncode == 0 and "0.1.0" in r.stdout


def test_cli_list_and_inspect(tiny_build):
    r = run_cli("list", tiny_build.out, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    built = [row for row in rows if row["status"] == "ok"]
    assert {row["arch"] for row in built} == set(ARCHES)
    assert all({"BT", "BV", "dtype", "warps", "shared", "regs", "spills", "cubin_bytes"} <= set(row) for row in built)
    assert run_cli("list", tiny_build.out).returncode == 0
    key = built[0]["key"]
    r = run_cli("inspect", tiny_build.out, key)
    assert r.returncode == 0 and key in r.stdout and "gdn_aot_launch_" in r.stdout and "SASS:" in r.stdout
    r = run_cli("inspect", tiny_build.out, key, "--json")
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)
    assert entry["key"] == key and entry["arch"] == built[0]["arch"] and entry["launch_function"].startswith(
        "gdn_aot_launch_") and [p["name"] for p in entry["params"]][-2:] == ["global_scratch", "profile_scratch"]
    r = run_cli("inspect", tiny_build.out, "no-such-variant")
    assert r.returncode == 1 and "no variant matches" in r.stderr
    r = run_cli("verify", tiny_build.out, "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert v["ok"] is True and v["problems"] == [] and v["variants"] == len(built)
    assert sorted(v["arches"]) == sorted(ARCHES)
    r = run_cli("list", tiny_build.out)
    assert f"{len(built)} variants built" in r.stdout
    # the dispatch classes that take each variant: tiny.yaml also builds variants for the SASS checks only
    unused = [row["key"] for row in built if not row["classes"]]
    assert f"{len(unused)} taken by no dispatch row" in r.stdout and any(k.startswith("gdn_fused.") for k in unused)
    sm90 = {row["key"]: row["classes"] for row in built if row["arch"] == "sm_90a"}
    assert sm90["gdn_scan.sm_90a.bf16.k128v128.bt64bk128bv64.varlen.kv.w16s1"] == ["single_wave"]
    assert sm90["gdn_scan.sm_90a.bf16.k128v128.bt64bk128bv32.varlen.kv.w4s1"] == ["default"]


def test_cli_spec_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("K: 128\nV: 128\narches: [sm_90a]\nkernels:\n  gdn_scan: {dtype: bf16, BT: 48}\n")
    r = run_cli("build", bad, "--out", tmp_path / "o")
    assert r.returncode == 2 and "kernels.gdn_scan.BT" in r.stderr and "48" in r.stderr and str(bad) in r.stderr
