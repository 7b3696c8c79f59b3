"""The loader on a CPU machine: dispatch on faked capabilities, picking, typed errors, tamper detection, and
the launcher library opened without a driver. The loader never imports triton."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from gdn_aot.loader import (
    Artifacts, ArtifactsNotFound, CorruptArtifact, DriverError, Launcher, Manifest, UnsupportedDevice,
    VariantNotBuilt, arch_for_capability, find_root,
)
from gdn_aot.kernels import PREPARE_L2NORM
from gdn_aot.loader.routes import Routes
from gdn_aot.loader import dispatch
from gdn_aot.loader.abi import OPTION_BITS
from gdn_aot.loader.artifacts import LAUNCHER_ABI_VERSION

from conftest import ARCHES, run_cli


@pytest.fixture(autouse=True)
def _fresh_sets():
    Artifacts.clear()
    yield
    Artifacts.clear()


@pytest.mark.parametrize("cap, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a")])
def test_exact_capability_match(tiny_build, cap, arch):
    assert arch_for_capability(cap) == arch
    s = Artifacts.for_device("cuda:1", capability=cap, root=tiny_build.out)
    assert s.arch == arch and s.device_index == 1
    assert Artifacts.for_device(1, capability=cap, root=tiny_build.out) is s


@pytest.mark.parametrize("cap", [(10, 1), (12, 0), (8, 0), (9, 1), (11, 0)])
def test_other_capabilities_are_unsupported(tiny_build, cap):
    with pytest.raises(UnsupportedDevice) as ei:
        Artifacts.for_device(0, capability=cap, root=tiny_build.out)
    msg = str(ei.value)
    assert f"sm_{cap[0]}{cap[1]}" in msg and "no fallback" in msg
    assert all(arch in msg for arch in ("sm_90a (capability 9.0)", "sm_100a (capability 10.0)",
                                        "sm_103a (capability 10.3)"))


def test_pick(tiny_build):
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    tiny_build.require("sm_90a", "gdn_scan")
    # two gdn_prepare variants, 4 and 16 (warp-specialised) warps: a plain pick takes the fewest warps
    preps = tiny_build.require("sm_90a", "gdn_prepare")
    prep_key = min(preps, key=lambda key: preps[key]["num_warps"])
    default_bv = s.preferences("gdn_scan")["default_BV"]
    k = s.pick("gdn_scan", dtype="bf16", varlen=True, transpose=True)
    assert k.key.startswith("gdn_scan.sm_90a.bf16.") and ".vk." in k.key and k.axes["BV"] == default_bv
    assert s.pick("gdn_scan", dtype="bf16", varlen=True, transpose=True) is k  # cached per axes
    assert s.pick("gdn_scan", dtype="bf16", varlen=True, transpose=True, BV=128) is k  # BV 128 not built: default
    assert s.pick("gdn_scan", dtype="bf16", varlen=True, transpose=True, BV=default_bv) is k
    assert s.pick("gdn_scan", dtype="bf16", varlen=True, transpose=False, K=128, V=128).key.count(".kv.") == 1
    assert s.kernel(k.key) is k
    assert k.scratch_bytes((2, 3, 1)) == 6 * k.scratch_size
    assert k.params[-1]["name"] == "profile_scratch" and k.grid_rule == "(num_seqs, HV, V // BV)"
    # prepare ignores transpose and BV (not among its uses_axes): any value finds the same variant
    for transpose, bv in ((False, None), (True, 32), (True, 64)):
        assert s.pick("gdn_prepare", dtype="bf16", varlen=True, transpose=transpose, BV=bv).key == prep_key
    p = s.kernel(prep_key)
    assert [x["name"] for x in p.params][:8] == ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens"]
    assert p.grid_rule.startswith("varlen: (T // BT + num_seqs, H, 1)")
    with pytest.raises(VariantNotBuilt, match="gdn_prepare"):  # tiny.yaml builds no fixed-length prepare
        s.pick("gdn_prepare", dtype="bf16", varlen=False)


def test_single_wave_tier(tiny_build):
    """specs/tiny.yaml's rule (single_wave_warps: 16, BV 64 built): the warp-specialised variant takes the
    batches whose num_seqs * HV * V / BV programs fit one an SM, the default variant the rest; on sm_100a too, with
    the device's SM count."""
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    routes = s.routes("bf16", 128, 128, True, False, sm_count=132)
    ws = routes.select(1)
    assert [most for most, _ in routes.tiers] == [66, float("inf")]
    assert ws.kernels["gdn_scan"].axes["BV"] == 64 and ws.kernels["gdn_scan"].entry["num_warps"] == 16
    assert ".w16s1" in ws.kernels["gdn_scan"].key and ws.row["class"] == "single_wave"
    assert routes.select(66) is ws and routes.select(0) is ws
    default = routes.select(67)
    assert default.row["class"] == "default" and default.kernels["gdn_scan"].entry["num_warps"] == 4
    assert default.kernels["gdn_prepare"] is ws.kernels["gdn_prepare"]
    other = s.routes("bf16", 128, 128, True, True, sm_count=132)  # the other state layout: its own variants
    assert other.select(20).kernels["gdn_scan"] is not ws.kernels["gdn_scan"]
    assert s.routes("bf16", 128, 128, True, False, sm_count=16) is routes  # made once per configuration
    config = ("bf16", 128, 128, True, False, "fp32", False, False)
    assert dispatch.select(s.table, config, 9, 16)["class"] == "default"  # 9 * 2 > 16
    assert s.pick("gdn_scan", dtype="bf16", varlen=True).entry["num_warps"] == 4  # plain picks: fewest warps
    b = Artifacts.for_device(0, capability=(10, 0), root=tiny_build.out).routes("bf16", 128, 128, True, False,
                                                                             sm_count=148)
    assert [most for most, _ in b.tiers] == [74, float("inf")]
    assert b.select(74).kernels["gdn_scan"].entry["num_warps"] == 16 and b.select(74).row["class"] == "single_wave"
    assert b.select(75).kernels["gdn_scan"].entry["num_warps"] == 4
    assert routes.batch_invariant  # one route (gdn_prepare + gdn_scan) for every shape class


def test_a_configuration_with_two_routes_is_not_batch_invariant(tiny_build):
    """A spec that sends some batches to gdn_fused (dispatch: gdn_fused: {above_factor: f}) mixes routes whose
    results differ in their last bits: Routes says so (the GPU invariance tests skip such a build)."""
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    config = ("bf16", 128, 128, True, False, "fp32", False, False)
    rows = dispatch.config_rows(s.table, config)
    fused = s.pick("gdn_fused", dtype="bf16", varlen=True, transpose=False).key
    mixed = rows[:-1] + [{**rows[-1], "route": "fused", "kernels": {"gdn_fused": fused}}]
    assert Routes(rows, s.kernel, s.manifest, 0, 132).batch_invariant
    routes = Routes(mixed, s.kernel, s.manifest, 0, 132)
    assert not routes.batch_invariant
    # the sm_90a gdn_fused refuses allow_neg_eigval (fp16 inverse), naming the argument; the two-kernel route not
    fused_route, two_kernel = routes.select(1000), routes.select(1)
    neg = OPTION_BITS["BETA_SIGMOID"] | OPTION_BITS["BETA_NEG_EIGVAL"]
    assert fused_route.refused_options == OPTION_BITS["BETA_NEG_EIGVAL"] and not two_kernel.refused_options
    with pytest.raises(ValueError, match="allow_neg_eigval=True"):
        fused_route.refuse(neg)


def test_routes_of_an_unbuilt_configuration(tiny_build):
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    with pytest.raises(VariantNotBuilt, match="dtype=fp16.*no dispatch row"):
        s.routes("fp16", 128, 128, True, False, sm_count=132)
    assert s.head_dims == {(128, 128)}


def test_a_state_dtype_not_built_names_the_spec_that_builds_it(tiny_build):
    """specs/tiny.yaml stores states in fp32 and, for the [V, K] layout, bf16: an fp8 state names
    specs/state-dtypes.yaml and how to point the loader at its build; a bf16 [K, V] state gets the usual message."""
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    with pytest.raises(VariantNotBuilt) as ei:
        s.routes("bf16", 128, 128, True, True, "fp8e4m3", sm_count=132)
    msg = str(ei.value)
    assert "state_dtype=fp8e4m3" in msg and "stores the state in fp8e4m3" in msg and "['bf16', 'fp32']" in msg
    assert "gdn-aot build specs/state-dtypes.yaml --arch sm_90" in msg and "$GDN_AOT_ARTIFACTS" in msg
    with pytest.raises(VariantNotBuilt, match="state_dtype=bf16.*no dispatch row"):
        s.routes("bf16", 128, 128, True, False, "bf16", sm_count=132)
    routes = s.routes("bf16", 128, 128, True, True, "bf16", sm_count=132)
    assert [r.row["class"] for r in routes.routes] == ["default"]
    assert ".vk.state-bf16.w4s1" in routes.select(1).kernels["gdn_scan"].key


def test_variant_not_built_says_what_exists_and_how_to_build(tiny_build):
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    with pytest.raises(VariantNotBuilt) as ei:
        s.pick("gdn_scan", dtype="fp16", varlen=True)
    msg = str(ei.value)
    assert "dtype=fp16" in msg and "sm_90a" in msg
    assert "gdn-aot build" in msg and "--arch sm_90" in msg and "make build ARCH=sm_90" in msg
    assert any(k in msg for k in s.keys)
    with pytest.raises(VariantNotBuilt, match="not built"):
        s.kernel("gdn_scan.sm_90a.nope")


def test_artifacts_not_found(tmp_path, tiny_build, monkeypatch):
    monkeypatch.delenv("GDN_AOT_ARTIFACTS", raising=False)
    with pytest.raises(ArtifactsNotFound) as ei:
        find_root(tmp_path / "nothing")
    assert "gdn-aot build specs/qwen35.yaml" in str(ei.value) and "make build" in str(ei.value)
    # a root holding only sm_100a: asking for sm_90a names what is there and the command for sm_90
    only = tmp_path / "only100"
    only.mkdir()
    (only / "sm_100a").symlink_to(tiny_build.out / "sm_100a")
    with pytest.raises(ArtifactsNotFound) as ei:
        Manifest(only, "sm_90a")
    assert "sm_100a" in str(ei.value) and "--arch sm_90" in str(ei.value)


def test_root_precedence(tmp_path, tiny_build, monkeypatch):
    monkeypatch.delenv("GDN_AOT_ARTIFACTS", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactsNotFound):
        find_root()
    (tmp_path / "artifacts").symlink_to(tiny_build.out)
    assert find_root() == tmp_path / "artifacts"  # ./artifacts, last resort
    other = tmp_path / "other"
    other.symlink_to(tiny_build.out)
    monkeypatch.setenv("GDN_AOT_ARTIFACTS", str(other))
    assert find_root() == other  # env beats ./artifacts
    assert find_root(tiny_build.out) == tiny_build.out  # explicit beats env
    monkeypatch.setenv("GDN_AOT_ARTIFACTS", str(tmp_path / "missing"))
    with pytest.raises(ArtifactsNotFound, match="GDN_AOT_ARTIFACTS"):
        find_root()  # a set but wrong env var does not silently fall through


def test_manifest_version_checks(tiny_copy):
    path = tiny_copy.out / "sm_90a" / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(CorruptArtifact, match="schema 99"):
        Manifest(tiny_copy.out, "sm_90a")
    path.write_text(json.dumps({**data, "launcher": {**data["launcher"], "abi_version": 99}}))
    with pytest.raises(CorruptArtifact, match="launcher ABI 99"):
        Manifest(tiny_copy.out, "sm_90a")
    path.write_text("{")
    with pytest.raises(CorruptArtifact, match="not valid JSON"):
        Manifest(tiny_copy.out, "sm_90a")


def test_verify_ok(tiny_build):
    r = run_cli("verify", tiny_build.out)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def test_tampered_cubin_is_detected(tiny_copy):
    m = Manifest(tiny_copy.out, "sm_90a")
    key = next(iter(m.variants))
    cubin = m.cubin_path(key)
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    r = run_cli("verify", tiny_copy.out)
    assert r.returncode == 1 and cubin.name in r.stderr and key in r.stderr
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_copy.out)
    with pytest.raises(CorruptArtifact, match="sha256"):
        s.kernel(key).load()  # checked before anything reaches the driver


def test_tampered_launcher_is_detected(tiny_copy):
    so = tiny_copy.out / "sm_100a" / "launcher" / f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}"
    so.write_bytes(so.read_bytes() + b"\0")
    r = run_cli("verify", tiny_copy.out)
    assert r.returncode == 1 and so.name in r.stderr
    with pytest.raises(CorruptArtifact):
        Manifest(tiny_copy.out, "sm_100a").verify_launcher()


@pytest.mark.parametrize("arch", ARCHES)
def test_launcher_library_opens_without_a_driver(tiny_build, arch):
    lib = Launcher.open(Manifest(tiny_build.out, arch).verify_launcher())
    assert lib.lib.gdn_aot_abi_version() == LAUNCHER_ABI_VERSION
    assert lib.error_string(0) == "no error"
    for kernel in tiny_build.manifest(arch)["kernels"]:
        assert hasattr(lib.lib, f"gdn_aot_launch_{kernel}")
    assert not hasattr(lib.lib, "gdn_aot_launch_gdn_l2norm")  # fused away in launcher ABI 2
    for fn in ("gdn_aot_forward", "gdn_aot_forward_plan", "gdn_aot_forward_workspace_bytes",  # added in ABI 3
               "gdn_aot_select", "gdn_aot_dispatch_rows"):  # added in ABI 4
        assert hasattr(lib.lib, fn)
    assert lib.gdn_aot_forward is not None
    assert lib.path.name == f"libgdn_aot_launch.so.{LAUNCHER_ABI_VERSION}"
    if not os.path.exists("/dev/nvidiactl"):
        with pytest.raises(DriverError, match="gdn_aot_init failed"):
            lib.init()


def test_loader_never_imports_triton(tiny_build, tmp_path):
    """Opening artifacts, picking a variant and loading the launcher .so leave triton (and the build) unimported."""
    script = textwrap.dedent(f"""
        import json, sys
        import gdn_aot
        from gdn_aot.loader import Artifacts, Launcher
        s = Artifacts.for_device(0, capability=(9, 0), root={str(tiny_build.out)!r})
        k = s.pick("gdn_prepare", dtype="bf16", K=128, V=128, varlen=True)
        s.pick("gdn_scan", dtype="bf16", K=128, V=128, varlen=True, transpose=False, BV=64)
        lib = Launcher.open(s.manifest.verify_launcher())
        assert lib.lib.gdn_aot_abi_version() == {LAUNCHER_ABI_VERSION}
        print(json.dumps({{"key": k.key, "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                           ("triton", "torch") or m.startswith("gdn_aot.build") or m.startswith("gdn_aot.kernels"))}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["key"].startswith("gdn_prepare.sm_90a.bf16")
    assert out["modules"] == [], f"the loader imported {out['modules']}"


@pytest.mark.gpu
@pytest.mark.parametrize("l2norm", [True, False])
def test_prepare_through_the_loader_on_gpu(device_build, l2norm):
    """gdn_prepare launched directly (ABI 5 argument list, one program per chunk slot and key head): gam = the
    chunk-local cumsum of g, and per (token, value head) qg = gam + ln rq, kg = gam - ln rk, with rq, rk the inverse
    L2 norms 1 / sqrt(sum x^2 + 1e-6) of the q and k rows under PREPARE_L2NORM, else 1 (qg = kg = gam); the three
    are stored head-major, [HV, rows]."""
    import torch

    build, arch = device_build
    build.require(arch, "gdn_prepare")
    s = Artifacts.for_device(0, root=build.out)
    kern = s.pick("gdn_prepare", dtype="bf16", K=128, V=128, varlen=True)
    lens, H, HV, K, V = [70, 1, 0, 130], 2, 4, 128, 128
    rows, n = sum(lens), len(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(rows, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(rows, HV, V, device="cuda", generator=gen).to(torch.bfloat16)
    g = -torch.rand(rows, HV, device="cuda", generator=gen)
    beta = torch.rand(rows, HV, device="cuda", generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    w = torch.empty(rows, HV, K, device="cuda", dtype=torch.bfloat16)
    u = torch.empty(rows, HV, V, device="cuda", dtype=torch.bfloat16)
    gam, qg, kg = (torch.full((HV, rows), float("nan"), device="cuda") for _ in range(3))
    grid = (rows // 64 + n, H, 1)
    scratch = torch.empty(max(kern.scratch_bytes(grid), 1), device="cuda", dtype=torch.uint8)
    kern.launch(grid, torch.cuda.current_stream().cuda_stream, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                g.data_ptr(), beta.data_ptr(), 0, 0,  # no A_log, dt_bias
                cu.data_ptr(), w.data_ptr(), u.data_ptr(), gam.data_ptr(),
                qg.data_ptr(), kg.data_ptr(), rows, n, H, HV, PREPARE_L2NORM if l2norm else 0,
                scratch_ptr=scratch.data_ptr() if kern.scratch_size else 0)
    torch.cuda.synchronize()
    ref_gam = torch.empty_like(g)
    bounds = cu.tolist()
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        for c in range(s0, s1, 64):
            ref_gam[c:min(c + 64, s1)] = g[c:min(c + 64, s1)].cumsum(0)
    torch.testing.assert_close(gam.t(), ref_gam, atol=1e-4, rtol=1e-4)
    for x, got, sign in ((q, qg, 1), (k, kg, -1)):
        ln_r = -0.5 * torch.log(x.float().square().sum(-1) + 1e-6) if l2norm else torch.zeros(rows, H, device="cuda")
        torch.testing.assert_close(got.t(), ref_gam + sign * ln_r.repeat_interleave(HV // H, dim=1), atol=1e-4,
                                   rtol=1e-4)
    assert torch.isfinite(w.float()).all() and torch.isfinite(u.float()).all()


def test_artifact_lookup_follows_env_and_working_directory(tiny_build, tmp_path, monkeypatch):
    """for_device answers repeated requests from its cache, and resolves again when what chose the root changed:
    $GDN_AOT_ARTIFACTS (ignored with an explicit root), or the working directory when the root was ./artifacts."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):  # two working directories whose ./artifacts is the tiny build
        d.mkdir()
        (d / "artifacts").symlink_to(tiny_build.out)
    monkeypatch.delenv("GDN_AOT_ARTIFACTS", raising=False)
    monkeypatch.chdir(a)
    via_a = Artifacts.for_device(0, capability=(9, 0))
    if via_a.manifest.root.resolve() != tiny_build.out.resolve():
        pytest.skip("package data artifacts take precedence over ./artifacts in this install")
    assert Artifacts.for_device(0, capability=(9, 0)) is via_a
    monkeypatch.chdir(b)
    assert Artifacts.for_device(0, capability=(9, 0)) is via_a  # looked again; same resolved root, same set
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactsNotFound):  # a working directory without artifacts
        Artifacts.for_device(0, capability=(9, 0))
    other = tmp_path / "other"
    shutil.copytree(tiny_build.out, other, symlinks=True)
    monkeypatch.setenv("GDN_AOT_ARTIFACTS", str(other))
    via_env = Artifacts.for_device(0, capability=(9, 0))
    assert via_env.manifest.root == other.resolve()
    monkeypatch.setenv("GDN_AOT_ARTIFACTS", str(tmp_path / "missing"))
    assert Artifacts.for_device(0, capability=(9, 0), root=other) is via_env  # an explicit root ignores the env
    with pytest.raises(ArtifactsNotFound, match="GDN_AOT_ARTIFACTS"):
        Artifacts.for_device(0, capability=(9, 0))


def test_modules_are_per_device_and_created_once_under_threads(tiny_build):
    """Multi-GPU bookkeeping without a second GPU: each device index gets its own ArtifactSet and Kernel
    handles (so its module is loaded in that device's context), and concurrent first use from several threads
    yields one handle per device."""
    import concurrent.futures

    key = next(iter(tiny_build.require("sm_90a", "gdn_prepare")))
    sets = [Artifacts.for_device(i, capability=(9, 0), root=tiny_build.out) for i in (0, 1)]
    assert sets[0] is not sets[1] and [s.device_index for s in sets] == [0, 1]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        handles = list(pool.map(lambda i: sets[i % 2].kernel(key), range(64)))
    by_device = {h.device_index: h for h in handles}
    assert set(by_device) == {0, 1} and by_device[0] is not by_device[1]
    assert all(h is by_device[h.device_index] for h in handles)


def test_route_packs_its_half_of_the_arguments(tiny_build, monkeypatch):
    """Route.load packs the route's fields of gdn_aot_forward_args_t once: the route id, its kernels' handles (the
    other families' 0), K, V, BT, BV and the element size, read back here by the declared names."""
    from gdn_aot.loader.abi import ROUTE_ARGS, ROUTE_FIELDS, ROUTES
    from gdn_aot.loader.kernel import Kernel

    def fake_load(self):
        self.handle = 1000 + len(self.key)

    monkeypatch.setattr(Kernel, "load", fake_load)
    s = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    for route in s.routes("bf16", 128, 128, True, True, sm_count=132).routes:
        route.load()
        got = dict(zip([f.name for f in ROUTE_FIELDS], ROUTE_ARGS.unpack(route.prefix)))
        prep, scan = route.kernels["gdn_prepare"], route.kernels["gdn_scan"]
        assert got == dict(route=ROUTES["prepare_scan"].id, prepare=prep.handle, scan=scan.handle, fused=0,
                           fused_terms=0, K=128, V=128, BT=64, BV=scan.BV, elt=2)
