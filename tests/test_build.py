"""The real build of specs/tiny.yaml: outcome, artifacts, incremental rebuild, reproducibility, failure reports."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess

import pytest
from click.testing import CliRunner

from gdn_aot.build import cli, compile as compile_mod, toolchain
from gdn_aot.build.manifest import TSV_COLUMNS
from gdn_aot.build.spec import load_spec
from gdn_aot.kernels import KERNELS
from gdn_aot.kernels.registry import KernelDef
from gdn_aot.loader.artifacts import LAUNCHER_ABI_VERSION, MANIFEST_SCHEMA_VERSION

from conftest import ARCHES, REPO, build_spec, source_exists, source_module

KERNEL_ARCH = [(k, a) for a in ARCHES for k in ("gdn_prepare", "gdn_scan", "gdn_fused")]


def test_no_unexpected_failures(tiny_build):
    """Only variants whose kernel source is not written yet may fail; the build then exits 1 naming them."""
    assert tiny_build.unexpected_failures() == [], tiny_build.report["stderr"]
    failed = [v for v in tiny_build.report["variants"] if v["status"] == "failed"]
    assert tiny_build.report["rc"] == (1 if failed else 0)
    for v in failed:
        assert (tiny_build.out / v["log"]).is_file()
        assert "does not exist" in v["error"] and source_module(v["key"].split(".")[0], v["arch"]) in v["error"]


@pytest.mark.parametrize("kernel, arch", KERNEL_ARCH)
def test_every_written_kernel_built(tiny_build, kernel, arch):
    entries = tiny_build.require(arch, kernel)
    # tiny.yaml: both state layouts of gdn_scan, each also warp-specialised, one bf16-state scan, and with
    # checkpoints (the warp-specialised ones and, on sm_90a, one 4-warp scan, on sm_100a both 4-warp ones); gdn_fused
    # in both layouts and with checkpoints in one, on sm_90a also at BV 64; on sm_90a and sm_100a
    # gdn_prepare also warp-specialised; sm_103a one variant per kernel, and the warp-specialised scan
    expected = {"sm_90a": {"gdn_prepare": 2, "gdn_scan": 4 + 1 + 3, "gdn_fused": 3 + 1},
                "sm_100a": {"gdn_prepare": 2, "gdn_scan": 4 + 1 + 4, "gdn_fused": 3},
                "sm_103a": {"gdn_scan": 2}}[arch].get(kernel, 1)
    assert len(entries) == expected


@pytest.mark.parametrize("arch", ARCHES)
def test_manifest_contents(tiny_build, arch):
    m = tiny_build.manifest(arch)
    assert m["schema_version"] == MANIFEST_SCHEMA_VERSION and m["arch"] == arch
    assert m["launcher"]["abi_version"] == LAUNCHER_ABI_VERSION
    assert m["triton_version"] == "3.6.0"
    assert m["ptxas_version"].startswith("12.8" if arch == "sm_90a" else "12.9")
    assert m["ptxas"] == ("ptxas" if arch == "sm_90a" else "ptxas-blackwell")
    assert m["nvdisasm_version"] == toolchain.NVDISASM_PIN
    assert len(m["spec"]["sha256"]) == 64 and m["spec"]["path"].endswith("tiny.yaml")
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    assert m["dispatch"]["spec"] == spec.dispatch.get(arch, {})
    # the table: per state layout, without and with checkpoints, the warp-specialised scan for single-wave batches,
    # then the default (classes the spec gives gdn_fused, once it is built, route there); the bf16 state, built for
    # [V, K] without checkpoints or a warp-specialised scan, gets the default class only
    classes = ["single_wave", "default"]
    fused = {c for c in spec.dispatch.get(arch, {}).get("gdn_fused", {}).get("classes", [])
             if any(e["kernel"] == "gdn_fused" for e in m["variants"].values())}
    configs = [(False, "fp32", False, classes), (False, "fp32", True, classes), (True, "bf16", False, ["default"]),
               (True, "fp32", False, classes), (True, "fp32", True, classes)]
    if arch == "sm_103a":  # built for [K, V] fp32 states without checkpoints only
        configs = configs[:1]
    assert [(r["transpose"], r["state_dtype"], r["checkpoints"], r["class"], r["route"])
            for r in m["dispatch"]["table"]] == [(tr, sd, ck, c, "fused" if c in fused else "prepare_scan")
                                                 for tr, sd, ck, cs in configs for c in cs]
    for r in m["dispatch"]["table"]:
        assert set(r["kernels"]) == ({"gdn_fused"} if r["route"] == "fused" else {"gdn_prepare", "gdn_scan"})
        assert set(r["kernels"].values()) <= set(m["variants"])
    assert set(m["kernels"]) == {v.kernel for v in spec.for_arch(arch)} and set(m["kernels"]) <= set(KERNELS)
    assert m["launcher"]["forward"]["routes"][0] == "prepare_scan"
    for name, fam in m["kernels"].items():  # the family's launcher params are the registry's, in order
        assert [p["name"] for p in fam["params"]] == [n for n, _ in KERNELS[name].params]
        assert fam["launch_function"] == f"gdn_aot_launch_{name}"
    for key, e in m["variants"].items():
        kd = KERNELS[e["kernel"]]
        assert e["key"] == key and e["axes"]["arch"] == arch and e["grid"] == kd.grid
        path = tiny_build.out / arch / e["cubin"]["path"]
        assert path.name == f"{e['cubin']['sha256']}.cubin" and path.stat().st_size == e["cubin"]["size"]
        assert e["num_warps"] == e["axes"]["num_warps"] and e["num_stages"] == e["axes"]["num_stages"]
        assert [p["name"] for p in e["params"]] == [n for n, _ in kd.params] + ["global_scratch", "profile_scratch"]
        assert e["profile_scratch_size"] == 0
        assert e["global_scratch_size"] == 0 or e["global_scratch_align"] <= 128
        assert e["resources"]["registers"] > 0 and len(e["input_hash"]) == 64
        assert e["sass"]["total"] > 0
    launcher = tiny_build.out / arch / "launcher"
    soname = f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}"
    assert {p.name for p in launcher.iterdir()} == {"gdn_aot_launch.h", "gdn_aot_launch.c", soname,
                                                    "libgdn_aot_launch.so"}
    assert m["launcher"]["library"] == f"launcher/{soname}" and m["launcher"]["soname"] == soname
    assert set(m["launcher"]["files"]) == {"gdn_aot_launch.h", "gdn_aot_launch.c", soname}
    # the unversioned name is the development symlink (for -lgdn_aot_launch), pointing at the versioned file
    assert (launcher / "libgdn_aot_launch.so").is_symlink()
    assert os.readlink(launcher / "libgdn_aot_launch.so") == soname
    readelf = subprocess.run(["readelf", "-d", str(launcher / soname)], capture_output=True, text=True)
    if readelf.returncode == 0:
        assert f"Library soname: [{soname}]" in readelf.stdout
        needed = re.findall(r"Shared library: \[([^\]]+)\]", readelf.stdout)
        assert not any("cuda" in n for n in needed), needed  # libcuda is dlopen'ed, never linked
    header = (launcher / "gdn_aot_launch.h").read_text()
    assert f"#define GDN_AOT_LAUNCHER_ABI_VERSION {LAUNCHER_ABI_VERSION}" in header
    assert "gdn_l2norm" not in header  # the family is gone (fused into gdn_prepare / gdn_scan)
    for name in m["kernels"]:  # one function per family of the spec, with the registry's params in order
        kd = KERNELS[name]
        decl = re.search(rf"CUresult gdn_aot_launch_{name}\(const gdn_aot_kernel_t \*kern, CUstream stream, "
                         rf"unsigned gx, unsigned gy, unsigned gz,(.*?)\);", header, re.S)
        assert decl, name
        names = re.findall(r"(?:CUdeviceptr|int32_t|uint32_t|int64_t|uint64_t|float|double) (\w+),?", decl.group(1))
        assert names == [n for n, _ in kd.params] + ["global_scratch"], (name, names)


@pytest.mark.parametrize("arch", ARCHES)
def test_kernels_tsv(tiny_build, arch):
    lines = (tiny_build.out / arch / "kernels.tsv").read_text().splitlines()
    assert lines[0] == "#" + "\t".join(TSV_COLUMNS)
    m = tiny_build.manifest(arch)
    rows = [ln.split("\t") for ln in lines[1:]]
    assert sorted(r[0] for r in rows) == sorted(m["variants"])
    for r in rows:
        e = m["variants"][r[0]]
        assert len(r) == len(TSV_COLUMNS)
        assert r[1:9] == [e["kernel"], e["entry"], e["cubin"]["path"], str(e["num_warps"]), str(e["shared"]),
                          str(e["global_scratch_size"]), str(e["global_scratch_align"]), e["grid"]]
        a = e["axes"]
        assert r[9:] == [a["dtype"], str(a["K"]), str(a["V"]), str(a["BT"]), str(a["BK"]), str(a["BV"]),
                         str(int(a["varlen"])), str(int(a["transpose"])), a["state_dtype"], str(int(a["gating"])),
                         str(int(a["checkpoints"]))]


def test_incremental_rebuild_reuses_everything(tiny_build):
    before = {a: tiny_build.manifest(a) for a in ARCHES}
    report = build_spec(REPO / "specs" / "tiny.yaml", tiny_build.out)
    built = sum(len(m["variants"]) for m in before.values())
    assert report["compiled"] == 0 and report["up_to_date"] == built
    assert report["launchers_compiled"] == []
    assert report["wall_s"] < 30
    for a in ARCHES:
        assert tiny_build.manifest(a)["variants"] == before[a]["variants"]


def test_reproducible(tiny_build, tmp_path):
    """Same inputs, fresh output dir and private triton cache -> byte-identical cubins and launcher."""
    report = build_spec(REPO / "specs" / "tiny.yaml", tmp_path / "again")
    assert report["up_to_date"] == 0
    for a in ARCHES:
        first = tiny_build.manifest(a)
        second = json.loads((tmp_path / "again" / a / "manifest.json").read_text())
        assert {k: e["cubin"]["sha256"] for k, e in second["variants"].items()} == \
               {k: e["cubin"]["sha256"] for k, e in first["variants"].items()}
        assert second["launcher"]["files"] == first["launcher"]["files"]


def test_failed_variant_is_reported_and_the_rest_builds(tmp_path, monkeypatch):
    """A broken variant gets a log, is left out of the manifest, and the CLI exits 1 naming it."""
    base = KERNELS["gdn_prepare"]
    monkeypatch.setitem(KERNELS, "gdn_broken", KernelDef(
        name="gdn_broken", params=base.params, constexprs=base.constexprs,
        sources={"sm90": ".no_such_module:k"}, grid="(1, 1, 1)", uses_axes=base.uses_axes))
    spec = tmp_path / "s.yaml"
    spec.write_text("K: 128\nV: 128\narches: [sm_90a]\nkernels:\n  gdn_prepare: {dtype: bf16, varlen: true}\n"
                    "  gdn_broken: {dtype: bf16, varlen: true}\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(cli.main, ["build", str(spec), "--out", str(out), "-j", "2"])
    assert r.exit_code == 1, r.output
    assert "FAILED" in r.output and "gdn_broken.sm_90a" in r.output and "1 compiled" in r.output
    m = json.loads((out / "sm_90a" / "manifest.json").read_text())
    assert [e["kernel"] for e in m["variants"].values()] == ["gdn_prepare"]
    (key, log), = m["failed"].items()
    assert key.startswith("gdn_broken.") and "no_such_module" in (out / "sm_90a" / log).read_text()
    assert "gdn_aot_launch_gdn_broken" in (out / "sm_90a" / "launcher" / "gdn_aot_launch.h").read_text()


def test_worker_crash_is_contained(tmp_path, monkeypatch):
    """A worker that dies (as LLVM aborts do) fails its variant only, with the output as its log."""
    from gdn_aot.build.spec import parse_spec

    spec = parse_spec({"K": 128, "V": 128, "arches": ["sm_90a"],
                       "kernels": {"gdn_prepare": {"dtype": ["bf16", "fp16"], "varlen": True}}})
    real_run = compile_mod.subprocess.run

    def run(cmd, **kw):
        if '"fp16"' in kw.get("input", ""):
            cmd = [cmd[0], "-c", "import os, sys; print('LLVM ERROR: boom', file=sys.stderr); os.abort()"]
        return real_run(cmd, **kw)

    monkeypatch.setattr(compile_mod.subprocess, "run", run)
    rep = compile_mod.build(spec, ("sm_90a",), tmp_path / "out", jobs=2)
    status = {r.variant.dtype: r for r in rep.results}
    assert status["bf16"].status == "compiled" and status["fp16"].status == "failed"
    assert "signal" in status["fp16"].error
    assert "LLVM ERROR: boom" in (tmp_path / "out" / status["fp16"].log).read_text()


def test_spec_with_gdn_fused_whose_source_is_missing(tmp_path, monkeypatch):
    """A spec naming gdn_fused builds while its source is missing: the fused variants are the expected failures,
    the launcher still has the family's launch function and the fused route (refused until a variant is built),
    and the dispatch table routes every class to gdn_prepare + gdn_scan."""
    from gdn_aot.loader import Launcher

    fused = KERNELS["gdn_fused"]
    monkeypatch.setitem(KERNELS, "gdn_fused", dataclasses.replace(fused, sources={"sm90": ".no_such_fused:k"}))
    spec = tmp_path / "s.yaml"
    spec.write_text("K: 128\nV: 128\narches: [sm_90a]\nkernels:\n  gdn_prepare: {dtype: bf16, varlen: true}\n"
                    "  gdn_scan: {dtype: bf16, varlen: true, BV: 64}\n"
                    "  gdn_fused: {dtype: bf16, varlen: true, launch: {sm_90a: {num_warps: 16}}}\n"
                    "dispatch:\n  sm_90a:\n    gdn_fused: {above_factor: 0.5}\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(cli.main, ["build", str(spec), "--out", str(out), "-j", "2"])
    assert r.exit_code == 1 and "gdn_fused.sm_90a" in r.output and "2 compiled" in r.output, r.output
    m = json.loads((out / "sm_90a" / "manifest.json").read_text())
    assert [k.split(".")[0] for k in m["failed"]] == ["gdn_fused"]
    assert [(row["class"], row["route"]) for row in m["dispatch"]["table"]] == [("default", "prepare_scan")]
    assert m["launcher"]["forward"]["routes"] == ["prepare_scan", "fused"]
    header = (out / "sm_90a" / "launcher" / "gdn_aot_launch.h").read_text()
    assert "CUresult gdn_aot_launch_gdn_fused(" in header and "#define GDN_AOT_ROUTE_FUSED 1" in header
    lib = Launcher(out / "sm_90a" / "launcher" / f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}")
    assert lib.select(("bf16", 128, 128, True, False, "fp32", False, False), 4, 132)["scan"] == m["dispatch"]["table"][0]["kernels"]["gdn_scan"]


def test_nvdisasm_pin():
    """Cubins are disassembled by the pinned nvdisasm wheel (triton's 12.8 cannot decode sm_103a), pinned alike
    in build/toolchain.py, pyproject's build extra and the Makefile."""
    pin = f"{toolchain.NVDISASM_DIST}=={toolchain.NVDISASM_PIN}"
    assert f'"{pin}"' in (REPO / "pyproject.toml").read_text()
    assert f"NVDISASM_DEP := {pin}" in (REPO / "Makefile").read_text()
    assert toolchain.nvdisasm_version("sm_103a") == toolchain.NVDISASM_PIN


def test_without_the_nvdisasm_wheel_only_sm_103a_needs_it(monkeypatch):
    """An offline host with the card's packages only (no nvdisasm wheel): triton's own nvdisasm serves sm_90a and
    sm_100a; an sm_103a build stops with the pip command."""
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(toolchain.importlib.metadata, "distribution", missing)
    toolchain.nvdisasm.cache_clear()
    try:
        for arch in ("sm_90a", "sm_100a"):
            assert toolchain.nvdisasm(arch) == toolchain.nvidia_bin("nvdisasm")
        with pytest.raises(toolchain.ToolchainError, match=r"sm_103a.*pip install 'nvidia-cuda-nvdisasm=="):
            toolchain.nvdisasm("sm_103a")
    finally:
        toolchain.nvdisasm.cache_clear()
