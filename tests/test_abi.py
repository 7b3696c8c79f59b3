"""The launcher ABI: the manifest's params match the compiled kernel (PTX .entry, the cubin's param table), and the
forward entry gdn_aot_forward matches the loader (struct layout, plan, checks), all on the CPU."""
from __future__ import annotations

import ctypes
import dataclasses
import subprocess

import pytest

import gdn_aot.kernels as kernels
from gdn_aot.build import abi, launcher, toolchain
from gdn_aot.kernels import KERNELS, PREPARE_L2NORM
from gdn_aot.loader import Artifacts, DriverError, Launcher
from gdn_aot.loader.runtime import FORWARD_ARG_FIELDS, FORWARD_ARGS, KernelStruct

from conftest import ARCHES

CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_HANDLE = 1, 400

PTX_WIDTH = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4, "f64": 8, "u8": 1, "b16": 2}


@pytest.mark.parametrize("arch", ARCHES)
def test_manifest_params_match_ptx_entry(tiny_build, arch):
    entries = tiny_build.entries(arch)
    assert entries
    for key, e in entries.items():
        ptx = (tiny_build.out / arch / e["ptx"]["path"]).read_text()
        name, got = abi.ptx_entry_params(ptx, e["entry"])
        assert name == e["entry"]
        want = e["params"]
        assert len(got) == len(want), f"{key}: {len(got)} PTX params vs {len(want)} in the manifest"
        for i, (w, g) in enumerate(zip(want, got)):
            assert PTX_WIDTH[g["ptx"]] == w["bytes"], f"{key}: param {i} {w['name']}: .{g['ptx']} vs {w['type']}"
            assert g["ptx"].startswith("f") == (w["ptx"] == "f32"), f"{key}: param {i} {w['name']} class"
            assert g["ptr"] == (w["kind"] != "scalar"), f"{key}: param {i} {w['name']} pointer-ness"
        assert [w["kind"] for w in want[-2:]] == ["global_scratch", "profile_scratch"]


@pytest.mark.parametrize("arch", ARCHES)
def test_manifest_params_match_cubin_param_table(tiny_build, arch):
    for key, e in tiny_build.entries(arch).items():
        rows = abi.cubin_params(tiny_build.out / arch / e["cubin"]["path"])
        assert [r["bytes"] for r in rows] == [p["bytes"] for p in e["params"]], key
        assert [r["ordinal"] for r in rows] == list(range(len(e["params"]))), key


def test_family_params_are_dtype_independent():
    for kd in KERNELS.values():
        assert [p["ctype"] for p in abi.family_params(kd)] == [
            "CUdeviceptr" if t.startswith("*") else abi.SCALARS[t][0] for _, t in kd.params]


def test_ptx_mismatch_is_detected():
    ptx = """.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3
)"""
    ok = [abi.param("x", "*bf16"), abi.param("n", "i32"), *abi.scratch_params()]
    abi.check_against_ptx(ok, ptx, "k")
    with pytest.raises(abi.AbiError, match="param 1"):
        abi.check_against_ptx([abi.param("x", "*bf16"), abi.param("n", "fp32"), *abi.scratch_params()], ptx, "k")
    with pytest.raises(abi.AbiError, match="5 params|4 params"):
        abi.check_against_ptx([*ok, abi.param("extra", "i32")], ptx, "k")


def test_tensordesc_params_are_refused():
    with pytest.raises(abi.AbiError, match="tensor descriptor"):
        abi.param("desc", "tensordesc<bf16[64, 64],NVMMASharedLayout(swizzle_byte_width=128)>")


# gdn_aot_forward: the whole forward in one call (loader/runtime.py FORWARD_ARGS, build/templates). These tests
# generate and compile the launcher here (no kernel build, no driver) or use the tiny build's.

@pytest.fixture(scope="module")
def forward_launcher(tmp_path_factory):
    """The launcher of both kernel families, rendered and compiled into a temporary directory."""
    out = tmp_path_factory.mktemp("launcher")
    for name, text in launcher.render("sm_90a", list(KERNELS)).items():
        (out / name).write_text(text)
    launcher.compile_so(out, out / launcher.LIBRARY)
    return out


def forward_args(prepare_struct, scan_struct, **over):
    """Packed FORWARD_ARGS for two gdn_aot_kernel_t (KernelStruct); defaults: 1 x 200 tokens, varlen, 8 MiB."""
    values = dict(prepare=ctypes.addressof(prepare_struct), scan=ctypes.addressof(scan_struct), stream=0,
                  q=1 << 20, k=2 << 20, v=3 << 20, g=4 << 20, beta=5 << 20, cu_seqlens=6 << 20, h0=0, ht=0,
                  state_indices=0, o=7 << 20, workspace=1 << 30, workspace_bytes=8 << 20, B=1, T=200, num_seqs=3,
                  H=2, HV=4, K=128, V=128, BT=64, BV=64, elt=2, prepare_flags=PREPARE_L2NORM, scan_flags=0, scale=128 ** -0.5)
    values.update(over)
    assert list(values) == [f[0] for f in FORWARD_ARG_FIELDS]
    return FORWARD_ARGS.pack(*values.values())


def test_forward_args_layout_matches_the_c_struct(forward_launcher, tmp_path):
    """The C struct has the loader's field order and offsets (8 bytes each) and the header the registry's flags."""
    fields = [f[0] for f in FORWARD_ARG_FIELDS]
    prints = "".join(f'    printf("%zu\\n", offsetof(gdn_aot_forward_args_t, {n}));\n' for n in fields)
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "gdn_aot_launch.h"\nint main(void) {\n'
                   f'{prints}    printf("%zu\\n", sizeof(gdn_aot_forward_args_t));\n    return 0;\n}}\n')
    exe = tmp_path / "layout"
    r = subprocess.run([toolchain.cc(), "-Wall", "-Werror", f"-I{forward_launcher}", f"-I{toolchain.cuda_include()}",
                        str(src), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [8 * i for i in range(len(fields))] + [FORWARD_ARGS.size]
    lib = Launcher(forward_launcher / launcher.LIBRARY)  # checks gdn_aot_forward_args_size() against FORWARD_ARGS
    assert lib.forward is not None and lib.lib.gdn_aot_forward_args_size() == FORWARD_ARGS.size
    header = (forward_launcher / launcher.HEADER).read_text()
    assert "CUresult gdn_aot_forward(const gdn_aot_forward_args_t *args);" in header
    for name in ("PREPARE_L2NORM", "SCAN_HAS_H0", "SCAN_STORE_HT", "SCAN_USE_INDICES"):
        assert f"#define GDN_AOT_{name} {getattr(kernels, name)}\n" in header
    assert "SCAN_L2NORM" not in header


def test_forward_call_needs_a_value_for_every_kernel_param(monkeypatch):
    """A registry param gdn_aot_forward does not know fails the launcher generation, naming it."""
    kd = KERNELS["gdn_scan"]
    monkeypatch.setitem(KERNELS, "gdn_scan", dataclasses.replace(kd, params=kd.params + (("extra", "i32"),)))
    with pytest.raises(launcher.LauncherError, match=r"gdn_scan's params \['extra'\]"):
        launcher.render("sm_90a", list(KERNELS))
    assert launcher.forward(["gdn_prepare"]) is None  # a spec without both families has no gdn_aot_forward


def test_forward_refuses_bad_calls_without_a_driver(forward_launcher):
    """Sizes, workspace size and alignment, and state_indices without h0 are refused with CUDA_ERROR_INVALID_VALUE
    before anything is launched; unloaded kernels with CUDA_ERROR_INVALID_HANDLE, before the driver is touched."""
    lib = Launcher(forward_launcher / launcher.LIBRARY)
    prep, scan = KernelStruct(scratch_size=0), KernelStruct(scratch_size=128)
    args = forward_args(prep, scan)
    need = lib.plan(args).workspace_bytes
    assert lib.workspace_bytes(args) == need
    for bad in (dict(HV=3), dict(BV=48), dict(B=2), dict(H=0), dict(T=-1), dict(cu_seqlens=0, num_seqs=2),
                dict(prepare=0), dict(T=1 << 31)):
        a = forward_args(prep, scan, **bad)
        assert lib.workspace_bytes(a) == -1, bad
        assert lib.forward(a) == CUDA_ERROR_INVALID_VALUE, bad
        with pytest.raises(DriverError, match="gdn_aot_forward_plan refused"):
            lib.plan(a)
    for bad in (dict(workspace_bytes=need - 1), dict(workspace=(1 << 30) + 128), dict(state_indices=8 << 20)):
        assert lib.forward(forward_args(prep, scan, **bad)) == CUDA_ERROR_INVALID_VALUE, bad
    assert lib.forward(forward_args(prep, scan, workspace_bytes=need)) == CUDA_ERROR_INVALID_HANDLE


SHAPES = [  # (B, T, num_seqs, H, HV, varlen)
    (1, 200, 3, 2, 4, True), (1, 64, 1, 16, 32, True), (1, 1, 1, 2, 2, True), (1, 0, 1, 1, 1, True),
    (1, 4097, 9, 4, 12, True), (3, 65, 3, 2, 4, False), (2, 1, 2, 16, 32, False), (4, 128, 4, 1, 3, False),
]


@pytest.mark.parametrize("arch, cap", [("sm_90a", (9, 0)), ("sm_100a", (10, 0))])
def test_forward_plan_matches_the_loader(tiny_build, arch, cap):
    """For the tiny build's variants: the C plan has the documented grids and layout, and the workspace the Python
    API allocates (runtime.Forward.workspace_bytes) covers it with at most 6 * 255 bytes to spare."""
    tiny_build.require(arch, "gdn_prepare")
    tiny_build.require(arch, "gdn_scan")
    arts = Artifacts.for_device(0, capability=cap, root=tiny_build.out)
    lib = Launcher.open(arts.manifest.verify_launcher())
    for transpose in (False, True):
        fwd = arts.forward("bf16", 128, 128, True, transpose, sm_count=132)
        for scan in set(fwd.scans):
            prep_s, scan_s = KernelStruct(scratch_size=fwd.prepare.scratch_size), KernelStruct(
                scratch_size=scan.scratch_size)
            for B, T, n, H, HV, varlen in SHAPES:
                args = forward_args(prep_s, scan_s, B=B, T=T, num_seqs=n, H=H, HV=HV, BV=scan.BV,
                                    cu_seqlens=6 << 20 if varlen else 0)
                p = lib.plan(args)
                rows = B * T
                slots = rows // 64 + n if varlen else n * -(-T // 64)
                assert list(p.prepare_grid) == [slots, H, 1] and list(p.scan_grid) == [n, HV, 128 // scan.BV]
                assert p.T_arg == (rows if varlen else T)
                a = lambda x: -(-x // 256) * 256  # noqa: E731
                sizes = [rows * HV * 128 * 2] * 2 + [rows * HV * 4] * 3
                scratch = max(prep_s.scratch_size * slots * H, scan_s.scratch_size * n * HV * (128 // scan.BV))
                offsets = [sum(a(x) for x in sizes[:i]) for i in range(6)]
                assert [p.w, p.u, p.gam, p.qg, p.kg, p.scratch] == offsets
                assert p.scratch_bytes == scratch and p.workspace_bytes == offsets[-1] + a(scratch)
                bound = fwd.workspace_bytes(scan, B, T, n, H, HV) if varlen else None
                if bound is not None:
                    assert p.workspace_bytes <= bound <= p.workspace_bytes + 6 * 255
