"""The launcher ABI recorded in the manifest matches the compiled kernel: PTX .entry and the cubin's param table."""
from __future__ import annotations

import pytest

from gdn_aot.build import abi
from gdn_aot.kernels import KERNELS

from conftest import ARCHES

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
