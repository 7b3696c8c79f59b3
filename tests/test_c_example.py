"""The C and C++ consumers of the launcher ABI, on the CPU: examples/c/run_gdn.c (one gdn_prepare launch) and
examples/cpp/gdn_forward.cpp (a whole forward, gdn_aot_forward.hpp) compile with -Wall -Werror against each
arch's generated header and versioned launcher library alone, reach the driver only through the launcher, and
the C++ program picks, from the launcher's dispatch table, the variants, grids and workspace the Python API uses
(--dry-run needs no GPU).
Running them on a GPU: test_c_example_runs_on_gpu below and tests/test_gpu_cpp.py."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gdn_aot.build.toolchain import cc, cuda_include
from gdn_aot.loader import Artifacts, Routes, dispatch
from gdn_aot.loader.artifacts import LAUNCHER_ABI_VERSION

from conftest import ARCHES, REPO

EXAMPLE = REPO / "examples" / "c" / "run_gdn.c"
CPP_DIR = REPO / "examples" / "cpp"
CPP_EXAMPLE = CPP_DIR / "gdn_forward.cpp"
CXXFLAGS = ("-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic")


def compile_example(build, arch, tmp_path):
    launcher = build.out / arch / "launcher"
    exe = tmp_path / f"run_gdn_{arch}"
    cmd = [cc(), "-O2", "-Wall", "-Werror", f"-I{launcher}", f"-I{cuda_include()}", str(EXAMPLE),
           f"-L{launcher}", "-lgdn_aot_launch", f"-Wl,-rpath,{launcher}", "-lm", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return exe


def cxx() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.skip("no C++ compiler (g++)")


_CPP_BUILT: dict[tuple[str, str], object] = {}  # (artifact root, arch) -> executable: compile once per session


def compile_cpp_example(build, arch, tmp_path):
    """examples/cpp/gdn_forward.cpp linked against the arch's launcher only (no -lcuda)."""
    hit = _CPP_BUILT.get((str(build.out), arch))
    if hit is not None and hit.is_file():
        return hit
    launcher = build.out / arch / "launcher"
    exe = tmp_path / f"gdn_forward_{arch}"
    cmd = [cxx(), *CXXFLAGS, f"-I{launcher}", f"-I{cuda_include()}", f"-I{CPP_DIR}", str(CPP_EXAMPLE),
           f"-L{launcher}", "-lgdn_aot_launch", f"-Wl,-rpath,{launcher}", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    _CPP_BUILT[(str(build.out), arch)] = exe
    return exe


def undefined_symbols(exe) -> str:
    return subprocess.run(["nm", "-D", "--undefined-only", str(exe)], capture_output=True, text=True).stdout


def needed_libraries(exe) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    return [ln.split("[")[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]


@pytest.mark.parametrize("arch", ARCHES)
def test_c_example_compiles_and_links(tiny_build, arch, tmp_path):
    tiny_build.require(arch, "gdn_prepare")
    exe = compile_example(tiny_build, arch, tmp_path)
    nm = undefined_symbols(exe)
    assert "gdn_aot_launch_gdn_prepare" in nm and " cu" not in nm  # the driver only through the launcher
    # linked against the versioned soname, so a launcher of another ABI is refused by the dynamic loader
    assert f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}" in needed_libraries(exe)


def test_launcher_header_compiles_as_cxx(tiny_build, tmp_path):
    """The header is usable from C++ too (extern "C")."""
    src = tmp_path / "t.cc"
    src.write_text('#include "gdn_aot_launch.h"\nint main() { return gdn_aot_abi_version() == 0; }\n')
    launcher = tiny_build.out / "sm_90a" / "launcher"
    r = subprocess.run([cxx(), *CXXFLAGS, "-fsyntax-only", f"-I{launcher}", f"-I{cuda_include()}", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("arch", ARCHES)
def test_cpp_example_compiles_and_links(tiny_build, arch, tmp_path):
    tiny_build.require(arch, "gdn_prepare")
    tiny_build.require(arch, "gdn_scan")
    exe = compile_cpp_example(tiny_build, arch, tmp_path)
    nm = undefined_symbols(exe)
    assert "gdn_aot_forward" in nm and "gdn_aot_forward_plan" in nm and "gdn_aot_driver" in nm
    assert " cu" not in nm and not any("cuda" in lib for lib in needed_libraries(exe))  # libcuda only via dlopen
    assert f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}" in needed_libraries(exe)


def _dry_run(exe, arch_dir, *args) -> dict:
    r = subprocess.run([str(exe), str(arch_dir), "--dry-run", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)


# (sequence lengths, H, HV, SMs): the tiny build's tables put N * HV <= SMs / 2 in the single-wave class
CPP_SHAPES = [([100, 1, 0, 300], 2, 4, 132), ([64] * 18, 2, 4, 132), ([5] * 33, 1, 2, 132), ([5] * 33, 1, 2, 100),
              ([7000], 16, 32, 132), ([1] * 40, 16, 32, 132), ([3], 1, 1, 1)]


@pytest.mark.parametrize("arch, cap", [("sm_90a", (9, 0)), ("sm_100a", (10, 0))])
@pytest.mark.parametrize("transpose, l2norm, checkpoints", [(False, True, False), (True, False, False),
                                                            (False, True, True), (True, True, True)])
def test_cpp_example_picks_what_the_python_api_picks(tiny_build, tmp_path, arch, cap, transpose, l2norm,
                                                     checkpoints):
    """--dry-run for a set of shapes: the C++ helper's dispatch row (gdn_aot_select), variants, grids and workspace
    size against the Python loader's route for the batch (the manifest's table) and the layout of the workspace
    the Python API allocates (w, u bf16; gam, qg, kg fp32; scratch); with --checkpoint-every, the configuration with
    checkpoints (its gdn_scan variants write them)."""
    tiny_build.require(arch, "gdn_prepare")
    tiny_build.require(arch, "gdn_scan")
    exe = compile_cpp_example(tiny_build, arch, tmp_path)
    s = Artifacts.for_device(0, capability=cap, root=tiny_build.out)
    classes = set()
    for lens, H, HV, sms in CPP_SHAPES:
        extra = ["--lens", ",".join(map(str, lens)), "--heads", f"{H},{HV}", "--sms", str(sms)]
        got = _dry_run(exe, tiny_build.out / arch, *extra, *(["--transpose"] if transpose else []),
                       *([] if l2norm else ["--no-l2norm"]), *(["--checkpoint-every", "128"] if checkpoints else []))
        rows, n = sum(lens), len(lens)
        rows_of_config = dispatch.config_rows(s.table, ("bf16", 128, 128, True, transpose, "fp32", False, checkpoints))
        route = Routes(rows_of_config, s.kernel, s.manifest, 0, sms).select(n * HV)  # the API's choice
        classes.add(route.row["class"])
        assert got["class"] == route.row["class"] and int(got["route"]) == route.id, (lens, H, HV, sms)
        prep, scan = route.kernels["gdn_prepare"], route.kernels["gdn_scan"]
        assert (got["prepare"], got["scan"]) == (prep.key, scan.key), (lens, H, HV, sms)
        assert (".checkpoints." in scan.key) == checkpoints
        pgrid, sgrid = (rows // 64 + n, H, 1), (n, HV, 128 // scan.BV)
        assert got["prepare_grid"] == " ".join(map(str, pgrid)) and got["scan_grid"] == " ".join(map(str, sgrid))
        a = lambda b: -(-b // 256) * 256  # noqa: E731  (each region 256-byte aligned)
        want = (a(rows * HV * 128 * 2) * 2 + 3 * a(rows * HV * 4)
                + a(max(prep.scratch_bytes(pgrid), scan.scratch_bytes(sgrid))))
        assert int(got["workspace_bytes"]) == want
        assert want <= route.workspace_bytes(1, rows, n, H, HV) <= want + 6 * 255  # the Python API's allocation
    assert classes == {"single_wave", "default"}


def test_cpp_example_errors_are_clear(tiny_build, tmp_path):
    tiny_build.require("sm_90a", "gdn_scan")
    exe = compile_cpp_example(tiny_build, "sm_90a", tmp_path)
    r = subprocess.run([str(exe), str(tiny_build.out / "sm_90a"), "--dry-run", "--sms", "132", "--dims", "64,64"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no dispatch row serves dtype=bf16 K=64 V=64" in r.stderr, r.stderr
    assert "K=128 V=128" in r.stderr and "gdn-aot build" in r.stderr
    r = subprocess.run([str(exe), str(tiny_build.out / "sm_90a"), "--dry-run"], capture_output=True, text=True)
    assert r.returncode == 1 and "--dry-run needs --sms" in r.stderr
    r = subprocess.run([str(exe), str(tiny_build.out / "sm_90a"), "--checkpoint-every", "100"], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "--checkpoint-every: a multiple of 64" in r.stderr
    r = subprocess.run([str(exe), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert r.returncode == 1 and "kernels.tsv" in r.stderr and "gdn-aot build" in r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 1 and "usage: gdn_forward ARTIFACT_DIR" in r.stderr
    if not os.path.exists("/dev/nvidiactl"):  # no driver: a clear message, not a crash
        r = subprocess.run([str(exe), str(tiny_build.out / "sm_90a")], capture_output=True, text=True)
        assert r.returncode == 1 and "gdn_aot_init" in r.stderr and "libcuda.so.1" in r.stderr


@pytest.mark.gpu
def test_c_example_runs_on_gpu(device_build, tmp_path):
    build, arch = device_build
    exe = compile_example(build, arch, tmp_path)
    r = subprocess.run([str(exe), str(build.out / arch)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout
