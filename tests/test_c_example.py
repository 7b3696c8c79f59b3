"""examples/c/run_gdn.c compiles (-Wall -Werror) against each arch's generated header and launcher library alone."""
from __future__ import annotations

import subprocess

import pytest

from gdn_aot.build.toolchain import cc, cuda_include

from conftest import ARCHES, REPO

EXAMPLE = REPO / "examples" / "c" / "run_gdn.c"


def compile_example(build, arch, tmp_path):
    launcher = build.out / arch / "launcher"
    exe = tmp_path / f"run_gdn_{arch}"
    cmd = [cc(), "-O2", "-Wall", "-Werror", f"-I{launcher}", f"-I{cuda_include()}", str(EXAMPLE),
           f"-L{launcher}", "-lgdn_aot_launch", f"-Wl,-rpath,{launcher}", "-lm", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return exe


@pytest.mark.parametrize("arch", ARCHES)
def test_c_example_compiles_and_links(tiny_build, arch, tmp_path):
    tiny_build.require(arch, "gdn_l2norm")
    exe = compile_example(tiny_build, arch, tmp_path)
    nm = subprocess.run(["nm", "-D", "--undefined-only", str(exe)], capture_output=True, text=True).stdout
    assert "gdn_aot_launch_gdn_l2norm" in nm and " cu" not in nm  # the driver only through the launcher


def test_launcher_header_compiles_as_cxx(tiny_build, tmp_path):
    """The header is usable from C++ too (extern "C")."""
    src = tmp_path / "t.cc"
    src.write_text('#include "gdn_aot_launch.h"\nint main() { return gdn_aot_abi_version() == 0; }\n')
    launcher = tiny_build.out / "sm_90a" / "launcher"
    r = subprocess.run(["c++", "-Wall", "-Werror", "-fsyntax-only", f"-I{launcher}", f"-I{cuda_include()}",
                        str(src)], capture_output=True, text=True)
    if r.returncode and "not found" in r.stderr + r.stdout and "c++" in r.stderr:
        pytest.skip("no C++ compiler")
    assert r.returncode == 0, r.stderr


@pytest.mark.gpu
def test_c_example_runs_on_gpu(tiny_build, tmp_path):
    import torch

    arch = {(9, 0): "sm_90a", (10, 0): "sm_100a"}[torch.cuda.get_device_capability(0)]
    exe = compile_example(tiny_build, arch, tmp_path)
    r = subprocess.run([str(exe), str(tiny_build.out / arch)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout
