"""The launcher ABI: the manifest's params match the compiled kernel (PTX .entry, the cubin's param table); the
generated launcher matches the declarations of loader/abi.py (struct layouts, flag and option macros, the plan's
grids and workspace layout, the refusals of gdn_aot_forward); and the loader's workspace bound covers the plan.
All on the CPU."""
from __future__ import annotations

import ctypes
import dataclasses
import subprocess

import pytest

import gdn_aot.kernels as kernels
from gdn_aot.build import launcher, toolchain
from gdn_aot.build import params as abi
from gdn_aot.kernels import KERNELS
from gdn_aot.loader import Artifacts, DriverError, Launcher
from gdn_aot.loader import abi as decl
from gdn_aot.loader.abi import FORWARD_ARG_FIELDS, FORWARD_ARGS, KernelStruct

from conftest import ARCHES

CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_NOT_SUPPORTED = 1, 400, 801

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
            "CUdeviceptr" if t.startswith("*") else decl.SCALAR_TYPES[t][0] for _, t in kd.params]


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


def test_every_kernel_param_is_declared_with_a_source():
    """The registry's params are the ABI's, and gdn_aot_forward has a C expression for each (loader/abi.py)."""
    for name, fam in decl.FAMILIES.items():
        assert KERNELS[name].params == fam.kernel_params, name
        for p in fam.params:
            assert launcher.param_expr(name, p), (name, p)
        assert all(q in decl.GRID_QUANTITIES or isinstance(q, int) for q in fam.grid), name
    assert all(getattr(kernels, n) == bit and n in kernels.__all__ for n, bit in decl.FLAGS.items())
    assert [r.families for r in decl.ROUTES.values()] == [("gdn_prepare", "gdn_scan"), ("gdn_fused",),
                                                          ("gdn_fused_terms",)]


# gdn_aot_forward: a dispatch row's forward in one call (loader/abi.py declares it, build/templates render it).
# These tests generate and compile the launcher here (no kernel build, no driver) or use the tiny build's.

@pytest.fixture(scope="module")
def forward_launcher(tmp_path_factory):
    """The launcher of every kernel family (both routes), rendered and compiled into a temporary directory."""
    out = tmp_path_factory.mktemp("launcher")
    for name, text in launcher.render("sm_90a", list(KERNELS)).items():
        (out / name).write_text(text)
    launcher.compile_so(out, out / launcher.LIBRARY)
    return out


def forward_args(prepare_struct=None, scan_struct=None, fused_struct=None, terms_struct=None, **over):
    """Packed FORWARD_ARGS for gdn_aot_kernel_t mirrors (KernelStruct); defaults: the prepare_scan route (the fused
    route when only fused_struct is given, fused_terms at BV 64 when only terms_struct is), 1 x 200 tokens in 3
    sequences, varlen, 8 MiB of workspace."""
    address = lambda s: 0 if s is None else ctypes.addressof(s)  # noqa: E731
    route = ("prepare_scan" if prepare_struct is not None else "fused" if fused_struct is not None
             else "fused_terms" if terms_struct is not None else "prepare_scan")
    values = dict(route=decl.ROUTES[route].id, prepare=address(prepare_struct), scan=address(scan_struct),
                  fused=address(fused_struct), fused_terms=address(terms_struct), K=128, V=128, BT=64,
                  BV=128 if route == "fused" else 64,
                  elt=2, stream=0, q=1 << 20, k=2 << 20, v=3 << 20, g=4 << 20, beta=5 << 20, A_log=0, dt_bias=0,
                  cu_seqlens=6 << 20, h0=0,
                  ht=0, state_indices=0, o=7 << 20, state_checkpoints=0, checkpoint_rows=0, checkpoint_cu_starts=0,
                  checkpoint_every_n_tokens=0, workspace=1 << 30, workspace_bytes=8 << 20, B=1, T=200, num_seqs=3,
                  H=2, HV=4, options=decl.OPTION_BITS["L2NORM"], scale=128 ** -0.5)
    values.update(over)
    assert list(values) == [f.name for f in FORWARD_ARG_FIELDS]
    return FORWARD_ARGS.pack(*values.values())


def _offsets(launcher_dir, tmp_path, struct: str, names) -> list[int]:
    """offsetof(struct, name) for each name, then sizeof(struct), from a C program compiled against the header."""
    prints = "".join(f'    printf("%zu\\n", offsetof({struct}, {n}));\n' for n in names)
    src = tmp_path / f"{struct}.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "gdn_aot_launch.h"\nint main(void) {\n'
                   f'{prints}    printf("%zu\\n", sizeof({struct}));\n    return 0;\n}}\n')
    exe = tmp_path / struct
    r = subprocess.run([toolchain.cc(), "-Wall", "-Werror", f"-I{launcher_dir}", f"-I{toolchain.cuda_include()}",
                        str(src), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]


@pytest.mark.parametrize("struct, mirror", [("gdn_aot_forward_args_t", None), ("gdn_aot_forward_plan_t", decl.ForwardPlan),
                                            ("gdn_aot_kernel_t", decl.KernelStruct),
                                            ("gdn_aot_dispatch_row_t", decl.DispatchRow)])
def test_c_structs_match_the_declarations(forward_launcher, tmp_path, struct, mirror):
    """Each C struct of the header has the declared fields at the offsets of the loader's mirror (the argument
    struct: 8 bytes a field, the struct module's packing)."""
    if mirror is None:
        fields = [f.name for f in FORWARD_ARG_FIELDS]
        assert _offsets(forward_launcher, tmp_path, struct, fields) == \
            [8 * i for i in range(len(fields))] + [FORWARD_ARGS.size]
        return
    fields = [n for n, _ in mirror._fields_]
    assert _offsets(forward_launcher, tmp_path, struct, fields) == \
        [getattr(mirror, n).offset for n in fields] + [ctypes.sizeof(mirror)]


def test_header_has_the_declared_macros_and_entry_points(forward_launcher):
    lib = Launcher(forward_launcher / launcher.LIBRARY)  # checks the struct sizes against the loader's
    assert lib.gdn_aot_forward is not None and lib.lib.gdn_aot_forward_args_size() == FORWARD_ARGS.size
    header = (forward_launcher / launcher.HEADER).read_text()
    for decl_line in ("CUresult gdn_aot_forward(const gdn_aot_forward_args_t *args);",
                      "const gdn_aot_dispatch_row_t *gdn_aot_select(const char *dtype, int64_t K, int64_t V, int "
                      "varlen, int transpose,", f"#define GDN_AOT_LAUNCHER_ABI_VERSION {decl.LAUNCHER_ABI_VERSION}\n",
                      f"#define GDN_AOT_WORKSPACE_ALIGN {decl.WORKSPACE_ALIGN}\n"):
        assert decl_line in header, decl_line
    for name, bit in decl.FLAGS.items():
        assert f"#define GDN_AOT_{name} {bit} " in header
    for o in decl.OPTIONS:
        assert f"#define GDN_AOT_FORWARD_{o.name} {o.bit} " in header
    for r in decl.ROUTES.values():
        assert f"#define GDN_AOT_ROUTE_{r.name.upper()} {r.id} " in header
    assert "SCAN_L2NORM" not in header


def test_terms_route_launches_cooperatively_or_in_clusters_after_zeroing_its_counters(forward_launcher):
    """gdn_fused_terms launches through cuLaunchKernelEx cooperatively where its grid fits the kernel's resident
    programs (gdn_aot_kernel_load counts them: occupancy times SMs), else with a (1, 1, gz) cluster (a (sequence,
    head)'s programs start together) and refuses more than 8 a cluster; gdn_aot_forward zeroes the exchange counters
    on the call's stream before that launch, and the other families launch plainly."""
    source = (forward_launcher / launcher.SOURCE).read_text()
    load = source[source.index("static CUresult resident_programs("):]
    for line in ("drv.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);",
                 "r = drv.OccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, (int)(32u * num_warps), shared);",
                 "if (r == CUDA_SUCCESS) *out = (unsigned)(per_sm * sms);",
                 "r = resident_programs(fn, num_warps, shared, &resident);", "out->resident = resident;"):
        assert line in load, line
    terms = source[source.index("CUresult gdn_aot_launch_gdn_fused_terms("):]
    terms = terms[:terms.index("\n}\n")]
    fits = terms.index("if ((uint64_t)gx * gy * gz <= kern->resident) {")
    cooperative = terms.index("together.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;")
    too_many = terms.index("if (gz > 8) return CUDA_ERROR_INVALID_VALUE;")
    clusters = terms.index("together.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;")
    assert fits < cooperative < terms.index("} else {") < too_many < clusters
    for line in ("together.value.clusterDim.z = gz;", "return drv.LaunchKernelEx(&config, kern->function"):
        assert line in terms, line
    fused = source[source.index("CUresult gdn_aot_launch_gdn_fused("):]
    assert "LaunchKernelEx" not in fused[:fused.index("\n}\n")]
    route = source[source.index("    case GDN_AOT_ROUTE_FUSED_TERMS:\n        /* loaded"):]
    memset, launch = route.index("drv.MemsetD32Async(ws + p.exchange_counters, 0"), route.index("gdn_aot_launch_")
    assert memset < launch


def test_forward_call_needs_a_value_for_every_kernel_param(monkeypatch):
    """A registry param the ABI does not declare, or a source naming nothing, fails the launcher generation."""
    kd = KERNELS["gdn_scan"]
    monkeypatch.setitem(KERNELS, "gdn_scan", dataclasses.replace(kd, params=kd.params + (("extra", "i32"),)))
    with pytest.raises(launcher.LauncherError, match=r"gdn_scan's params \['extra'\]"):
        launcher.render("sm_90a", list(KERNELS))
    with pytest.raises(launcher.LauncherError, match="names no forward argument"):
        launcher.param_expr("gdn_scan", decl.Param("x", "i32", "args.no_such_field"))
    assert launcher.forward_context(["gdn_prepare"], "sm_90a") is None  # no route's kernels: no gdn_aot_forward
    routes = launcher.forward_context(["gdn_fused"], "sm_90a")["routes"]
    assert [(r["name"], r["built"]) for r in routes] == [("prepare_scan", False), ("fused", True),
                                                         ("fused_terms", False)]
    # the sm_90a gdn_fused's fp16 inverse cannot take beta up to 2: refused there, not on sm_100a (tf32 inverse)
    assert "GDN_AOT_FORWARD_BETA_NEG_EIGVAL" in routes[1]["refused"]
    sm100 = launcher.forward_context(["gdn_fused"], "sm_100a")["routes"][1]["refused"]
    assert "NEG_EIGVAL" not in sm100


def test_forward_refuses_bad_calls_without_a_driver(forward_launcher):
    """Sizes, workspace size and alignment, a missing kernel of the route, an unknown route, and state_indices
    without h0 are refused with CUDA_ERROR_INVALID_VALUE before anything is launched; unloaded kernels with
    CUDA_ERROR_INVALID_HANDLE, before the driver is touched."""
    lib = Launcher(forward_launcher / launcher.LIBRARY)
    prep, scan, fused = KernelStruct(scratch_size=0), KernelStruct(scratch_size=128), KernelStruct(scratch_size=640)
    args = forward_args(prep, scan)
    need = lib.plan(args).workspace_bytes
    assert lib.workspace_bytes(args) == need
    for bad in (dict(HV=3), dict(BV=48), dict(B=2), dict(H=0), dict(T=-1), dict(cu_seqlens=0, num_seqs=2),
                dict(prepare=0), dict(T=1 << 31), dict(route=7), dict(route=decl.ROUTES["fused"].id)):
        a = forward_args(prep, scan, **bad)
        assert lib.workspace_bytes(a) == -1, bad
        assert lib.gdn_aot_forward(a) == CUDA_ERROR_INVALID_VALUE, bad
        with pytest.raises(DriverError, match="gdn_aot_forward_plan refused"):
            lib.plan(a)
    for bad in (dict(workspace_bytes=need - 1), dict(workspace=(1 << 30) + 128), dict(state_indices=8 << 20)):
        assert lib.gdn_aot_forward(forward_args(prep, scan, **bad)) == CUDA_ERROR_INVALID_VALUE, bad
    assert lib.gdn_aot_forward(forward_args(prep, scan, workspace_bytes=need)) == CUDA_ERROR_INVALID_HANDLE
    assert lib.gdn_aot_forward(forward_args(fused_struct=fused)) == CUDA_ERROR_INVALID_HANDLE
    # fused_terms zeroes its counters first: an unloaded kernel is refused before that
    assert lib.gdn_aot_forward(forward_args(terms_struct=fused)) == CUDA_ERROR_INVALID_HANDLE
    for bad in (dict(BV=0), dict(BV=48)):  # gdn_fused tiles V too
        assert lib.gdn_aot_forward(forward_args(fused_struct=fused, **bad)) == CUDA_ERROR_INVALID_VALUE, bad
    # the sm_90a fused route refuses allow_neg_eigval (its fp16 inverse); the two-kernel route takes it
    neg = decl.OPTION_BITS["L2NORM"] | decl.OPTION_BITS["BETA_SIGMOID"] | decl.OPTION_BITS["BETA_NEG_EIGVAL"]
    assert lib.gdn_aot_forward(forward_args(fused_struct=fused, options=neg)) == CUDA_ERROR_INVALID_VALUE
    assert lib.gdn_aot_forward(forward_args(prep, scan, options=neg)) == CUDA_ERROR_INVALID_HANDLE


def test_checkpoint_params_come_last_from_the_forward_arguments():
    """gdn_scan and gdn_fused take the checkpoint arguments as their last parameters after `flags` (so the other
    parameters keep their offsets in variants without checkpoints), gdn_fused (and gdn_fused_terms, its source)
    then the exchange regions; gdn_prepare takes neither."""
    want = [("state_checkpoints", "*{state}", "args.state_checkpoints"),
            ("checkpoint_rows", "i64", "args.checkpoint_rows"),
            ("checkpoint_cu_starts", "*i64", "args.checkpoint_cu_starts"),
            ("checkpoint_every_n_tokens", "i32", "args.checkpoint_every_n_tokens")]
    exchange = [(n, t, f"workspace.{n}") for n, t in (("exchange_tiles", "*{dtype}"), ("exchange_scalings", "*fp32"),
                                                      ("exchange_counters", "*i32"))]
    for name, after in (("gdn_scan", []), ("gdn_fused", exchange), ("gdn_fused_terms", exchange)):
        params = [(p.name, p.type, p.source) for p in decl.FAMILIES[name].params]
        assert params[-4 - len(after):] == want + after and params[-5 - len(after)][0] == "flags", name
    assert not any("checkpoint" in p.name or "exchange" in p.name for p in decl.FAMILIES["gdn_prepare"].params)


def test_forward_refuses_bad_checkpoints_without_a_driver(forward_launcher):
    """checkpoint_every_n_tokens: 0, or a multiple of BT up to INT32_MAX with checkpoint_cu_starts, and with
    state_checkpoints unless checkpoint_rows is 0; anything else is refused before a launch (unloaded kernels answer
    CUDA_ERROR_INVALID_HANDLE once the arguments pass)."""
    lib = Launcher(forward_launcher / launcher.LIBRARY)
    prep, scan = KernelStruct(scratch_size=0), KernelStruct(scratch_size=128)
    ok = dict(state_checkpoints=9 << 20, checkpoint_rows=5, checkpoint_cu_starts=10 << 20, checkpoint_every_n_tokens=64)
    for bad in (dict(checkpoint_every_n_tokens=32), dict(checkpoint_every_n_tokens=-64),
                dict(checkpoint_every_n_tokens=1 << 31), dict(checkpoint_cu_starts=0), dict(state_checkpoints=0),
                dict(checkpoint_rows=-1)):
        assert lib.gdn_aot_forward(forward_args(prep, scan, **{**ok, **bad})) == CUDA_ERROR_INVALID_VALUE, bad
    for good in (ok, dict(ok, state_checkpoints=0, checkpoint_rows=0), dict(ok, checkpoint_every_n_tokens=192),
                 dict(checkpoint_every_n_tokens=0)):
        assert lib.gdn_aot_forward(forward_args(prep, scan, **good)) == CUDA_ERROR_INVALID_HANDLE, good


def test_route_of_a_spec_without_its_kernels_is_not_supported(tmp_path):
    """A launcher built without gdn_fused answers the fused route with CUDA_ERROR_NOT_SUPPORTED."""
    for name, text in launcher.render("sm_90a", ["gdn_prepare", "gdn_scan"]).items():
        (tmp_path / name).write_text(text)
    launcher.compile_so(tmp_path, tmp_path / launcher.LIBRARY)
    lib = Launcher(tmp_path / launcher.LIBRARY)
    assert lib.lib.gdn_aot_forward_workspace_bytes(forward_args(fused_struct=KernelStruct())) == -1
    assert lib.gdn_aot_forward(forward_args(fused_struct=KernelStruct())) == CUDA_ERROR_NOT_SUPPORTED


SHAPES = [  # (B, T, num_seqs, H, HV, varlen)
    (1, 200, 3, 2, 4, True), (1, 64, 1, 16, 32, True), (1, 1, 1, 2, 2, True), (1, 0, 1, 1, 1, True),
    (1, 4097, 9, 4, 12, True), (3, 65, 3, 2, 4, False), (2, 1, 2, 16, 32, False), (4, 128, 4, 1, 3, False),
]


def expected_plan(route: str, scratch: dict, B, T, n, H, HV, varlen=True, BV=64, K=128, V=128) -> dict:
    """The documented plan (docs/artifacts.md), computed independently of loader/abi.py's declarations."""
    rows = B * T
    slots = rows // 64 + n if varlen else n * -(-T // 64)
    a = lambda x: -(-x // 256) * 256  # noqa: E731  (each region 256-byte aligned)
    if route == "prepare_scan":
        grids = {"prepare": [slots, H, 1], "scan": [n, HV, V // BV]}
        sizes = [rows * HV * K * 2, rows * HV * V * 2] + [rows * HV * 4] * 3 + [0] * 3
    elif route == "fused":
        grids, sizes = {"fused": [n, HV, V // BV]}, [0] * 8
    else:  # two terms programs a (sequence, head), each a ring of 8 chunk slots: two 64 x 64 bf16 tiles, 8 x 64 fp32
        # scalings and two int32 counters a slot
        grids = {"fused_terms": [n, HV, V // BV + 2]}
        sizes = [0] * 5 + [n * HV * 16 * 2 * 64 * 64 * 2, n * HV * 16 * 8 * 64 * 4, n * HV * 16 * 2 * 4]
    need = max(scratch[h] * g[0] * g[1] * g[2] for h, g in grids.items())
    offsets = [sum(a(x) for x in sizes[:i]) for i in range(9)]
    return {"grids": grids, "offsets": offsets, "scratch_bytes": need, "workspace_bytes": offsets[-1] + a(need)}


def _check_plan(p, want):
    for h in ("prepare", "scan", "fused", "fused_terms"):
        assert list(getattr(p, f"{h}_grid")) == want["grids"].get(h, [0, 0, 0]), h
    assert [p.w, p.u, p.gam, p.qg, p.kg, p.exchange_tiles, p.exchange_scalings, p.exchange_counters,
            p.scratch] == want["offsets"]
    assert p.scratch_bytes == want["scratch_bytes"] and p.workspace_bytes == want["workspace_bytes"]


@pytest.mark.parametrize("BV", [64, 128])
@pytest.mark.parametrize("B, T, n, H, HV", [s[:5] for s in SHAPES if s[5]])
def test_fused_route_plan(forward_launcher, B, T, n, H, HV, BV):
    """The fused route: grid (N, HV, V / BV), no workspace regions, the kernel's global scratch only."""
    lib = Launcher(forward_launcher / launcher.LIBRARY)
    p = lib.plan(forward_args(fused_struct=KernelStruct(scratch_size=640), B=B, T=T, num_seqs=n, H=H, HV=HV, BV=BV))
    _check_plan(p, expected_plan("fused", {"fused": 640}, B, T, n, H, HV, BV=BV))
    assert p.T_arg == B * T


@pytest.mark.parametrize("B, T, n, H, HV", [s[:5] for s in SHAPES if s[5]])
def test_fused_terms_route_plan(forward_launcher, B, T, n, H, HV):
    """The fused_terms route: grid (N, HV, V / 64 + 2), the exchange rings per (sequence, head), the scratch."""
    lib = Launcher(forward_launcher / launcher.LIBRARY)
    p = lib.plan(forward_args(terms_struct=KernelStruct(scratch_size=640), B=B, T=T, num_seqs=n, H=H, HV=HV))
    _check_plan(p, expected_plan("fused_terms", {"fused_terms": 640}, B, T, n, H, HV, BV=64))
    assert p.T_arg == B * T


@pytest.mark.parametrize("arch, cap", [("sm_90a", (9, 0)), ("sm_100a", (10, 0))])
def test_forward_plan_matches_the_loader(tiny_build, arch, cap):
    """For every route of the tiny build's dispatch table: the C plan has the documented grids and layout, and the
    workspace the Python API allocates (routes.Route.workspace_bytes) covers it with at most 255 bytes for each of
    the route's regions and the scratch to spare."""
    tiny_build.require(arch, "gdn_prepare")
    tiny_build.require(arch, "gdn_scan")
    arts = Artifacts.for_device(0, capability=cap, root=tiny_build.out)
    lib = Launcher.open(arts.manifest.verify_launcher())
    for transpose in (False, True):
        for route in arts.routes("bf16", 128, 128, True, transpose, sm_count=132).routes:
            structs = {f: KernelStruct(scratch_size=k.scratch_size) for f, k in route.kernels.items()}
            handles = {f"{decl.FAMILIES[f].handle}_struct": s for f, s in structs.items()}
            scratch = {decl.FAMILIES[f].handle: s.scratch_size for f, s in structs.items()}
            for B, T, n, H, HV, varlen in SHAPES:
                args = forward_args(**handles, B=B, T=T, num_seqs=n, H=H, HV=HV, BV=route.BV,
                                    cu_seqlens=6 << 20 if varlen else 0)
                p = lib.plan(args)
                want = expected_plan(route.name, scratch, B, T, n, H, HV, varlen=varlen, BV=route.BV)
                _check_plan(p, want)
                assert p.T_arg == (B * T if varlen else T)
                bound = route.workspace_bytes(B, T, n, H, HV)
                if varlen:
                    regions = sum(route.name in r.routes for r in decl.REGIONS)
                    assert p.workspace_bytes <= bound <= p.workspace_bytes + (regions + 1) * 255
