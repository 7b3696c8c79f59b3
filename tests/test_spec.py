"""Spec parsing and validation: every error names the file, the key path and the bad value."""
from __future__ import annotations

import dataclasses
import itertools
import textwrap

import pytest
import yaml

from gdn_aot.build.spec import SpecError, load_spec, parse_spec, resolve_arches
from gdn_aot.kernels import KERNELS
from gdn_aot.kernels.registry import KernelDef

from conftest import REPO

BASE = """
K: 128
V: 128
arches: [sm_90a, sm_100a]
kernels:
  gdn_scan:
    BV: [64, 128]
    dtype: [bf16, fp16]
    varlen: [true, false]
    transpose: [false, true]
"""


def write(tmp_path, text, name="spec.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def spec_error(tmp_path, text) -> SpecError:
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as ei:
        load_spec(p)
    assert str(p) in str(ei.value), "the message names the file"
    return ei.value


@pytest.mark.parametrize("text, keypath, value", [
    (BASE + "bogus: 1\n", "bogus", "bogus"),
    (BASE + "    colour: red\n", "kernels.gdn_scan.colour", "colour"),
    (BASE.replace("K: 128", "K: '128'"), "K", "'128'"),
    (BASE.replace("BV: [64, 128]", "BV: [64, true]"), "kernels.gdn_scan.BV", "True"),
    (BASE.replace("varlen: [true, false]", "varlen: [1, 0]"), "kernels.gdn_scan.varlen", "1"),
    (BASE.replace("gdn_scan:", "gdn_scna:"), "kernels.gdn_scna", "gdn_scna"),
    (BASE.replace("    BV: [64, 128]", "    BT: [48]"), "kernels.gdn_scan.BT", "48"),
    (BASE.replace("BV: [64, 128]", "BV: [64, 96]"), "kernels.gdn_scan.BV", "96"),
    (BASE.replace("    BV: [64, 128]", "    BK: [48]"), "kernels.gdn_scan.BK", "48"),
    (BASE.replace("dtype: [bf16, fp16]", "dtype: [bf16, fp8]"), "kernels.gdn_scan.dtype", "fp8"),
    (BASE.replace("arches: [sm_90a, sm_100a]", "arches: [sm_90a, sm_120a]"), "arches", "sm_120a"),
    (BASE + "    exclude:\n      - {colour: red}\n", "kernels.gdn_scan.exclude[0].colour", "colour"),
    (BASE + "    exclude:\n      - {dtype: 16}\n", "kernels.gdn_scan.exclude[0].dtype", "16"),
    (BASE + "    launch: {sm_90a: {num_warps: [3]}}\n", "kernels.gdn_scan.launch.sm_90a.num_warps", "3"),
    (BASE + "    launch: {sm_90a: {warps: [4]}}\n", "kernels.gdn_scan.launch.sm_90a.warps", "warps"),
    (BASE + "dispatch: {sm_90a: {gdn_scan: {default_BV: 32}}}\n", "dispatch.sm_90a.gdn_scan.default_BV", "32"),
    (BASE + "dispatch: {sm_90a: {gdn_scan: {best_BV: 64}}}\n", "dispatch.sm_90a.gdn_scan.best_BV", "best_BV"),
    (BASE + "dispatch: {sm_90a: {gdn_prepare: {default_BV: 64}}}\n", "dispatch.sm_90a.gdn_prepare", "gdn_prepare"),
    (BASE + "dispatch: {sm_90a: {gdn_scan: {small_batch_factor: 0}}}\n",
     "dispatch.sm_90a.gdn_scan.small_batch_factor", "0"),
    (BASE + "dispatch: {sm_90a: {gdn_scan: {small_batch_factor: two}}}\n",
     "dispatch.sm_90a.gdn_scan.small_batch_factor", "two"),
    (BASE + "dispatch: {sm_90a: {gdn_scan: {single_wave_warps: 16}}}\n",  # BASE builds 4 warps only
     "dispatch.sm_90a.gdn_scan.single_wave_warps", "16"),
    (BASE + "  gdn_fused: {dtype: bf16}\ndispatch: {sm_90a: {gdn_fused: {above_factor: -1}}}\n",
     "dispatch.sm_90a.gdn_fused.above_factor", "-1"),
    (BASE + "  gdn_fused: {dtype: bf16}\ndispatch: {sm_90a: {gdn_fused: {above_factor: half}}}\n",
     "dispatch.sm_90a.gdn_fused.above_factor", "half"),
    (BASE + "  gdn_fused: {dtype: bf16}\ndispatch: {sm_90a: {gdn_fused: {default_BV: 128}}}\n",
     "dispatch.sm_90a.gdn_fused.default_BV", "default_BV"),
    (BASE + "dispatch: {sm_90a: {gdn_scan: {above_factor: 0.5}}}\n", "dispatch.sm_90a.gdn_scan.above_factor",
     "above_factor"),
])
def test_error_names_file_key_and_value(tmp_path, text, keypath, value):
    e = spec_error(tmp_path, text)
    assert e.keypath == keypath
    assert f": {keypath}:" in str(e)
    assert value in str(e)


def test_unknown_kernel_lists_known_ones(tmp_path):
    e = spec_error(tmp_path, BASE.replace("gdn_scan:", "gdn_scna:"))
    for name in KERNELS:
        assert name in str(e)


def test_missing_required_keys(tmp_path):
    assert spec_error(tmp_path, BASE.replace("K: 128\n", "")).keypath == "K"
    assert spec_error(tmp_path, BASE.replace("    dtype: [bf16, fp16]\n", "")).keypath == "kernels.gdn_scan.dtype"
    assert spec_error(tmp_path, BASE.replace("arches: [sm_90a, sm_100a]\n", "")).keypath == "arches"


def test_unused_axis_with_several_values(tmp_path):
    e = spec_error(tmp_path, BASE + "  gdn_prepare:\n    dtype: bf16\n    BV: [64, 128]\n")
    assert e.keypath == "kernels.gdn_prepare.BV" and "does not use axis BV" in str(e) and "[64, 128]" in str(e)
    e = spec_error(tmp_path, BASE + "  gdn_prepare:\n    dtype: bf16\n    transpose: [true, false]\n")
    assert e.keypath == "kernels.gdn_prepare.transpose"
    e = spec_error(tmp_path, BASE + "  gdn_prepare:\n    dtype: bf16\n    state_dtype: [fp32, bf16]\n")
    assert e.keypath == "kernels.gdn_prepare.state_dtype"  # gdn_prepare never touches the state
    e = spec_error(tmp_path, BASE + "  gdn_scan:\n    dtype: bf16\n    gating: [false, true]\n")
    assert e.keypath == "kernels.gdn_scan.gating"  # the gates are gdn_prepare's


def test_functional_axes(tmp_path):
    """state_dtype, gating and checkpoints: checked values, in the variant's key only where not the default."""
    e = spec_error(tmp_path, BASE.replace("    dtype: [bf16, fp16]\n", "    dtype: bf16\n    state_dtype: fp64\n"))
    assert e.keypath == "kernels.gdn_scan.state_dtype" and "fp8e4m3" in str(e) and "'fp64'" in str(e)
    e = spec_error(tmp_path, BASE + "  gdn_prepare:\n    dtype: bf16\n    gating: yes please\n")
    assert e.keypath == "kernels.gdn_prepare.gating" and "bool" in str(e)
    s = load_spec(write(tmp_path, BASE.replace("    dtype: [bf16, fp16]\n",
                                                "    dtype: bf16\n    state_dtype: [fp32, fp8e5m2]\n")))
    keys = [v.key for v in s.for_arch("sm_90a")]
    fp8 = [k for k in keys if ".kv.state-fp8e5m2.w" in k or ".vk.state-fp8e5m2.w" in k]
    assert len(fp8) * 2 == len(keys) and not any("fp32" in k for k in keys)


def test_empty_product_after_exclusions(tmp_path):
    e = spec_error(tmp_path, BASE + "    exclude:\n      - {dtype: bf16}\n      - {dtype: fp16}\n")
    assert e.keypath == "kernels.gdn_scan" and "empty" in str(e)


def test_kernel_without_source_for_arch(tmp_path, monkeypatch):
    base = KERNELS["gdn_prepare"]
    fake = KernelDef(name="hopper_only", params=base.params, constexprs=base.constexprs,
                     sources={"sm90": base.sources["sm90"]}, grid=base.grid, uses_axes=base.uses_axes)
    monkeypatch.setitem(KERNELS, "hopper_only", fake)
    e = spec_error(tmp_path, "K: 128\nV: 128\narches: [sm_90a, sm_100a]\nkernels:\n  hopper_only: {dtype: bf16}\n")
    assert e.keypath == "kernels.hopper_only" and "sm_100a" in str(e) and "no source" in str(e)
    s = parse_spec({"K": 128, "V": 128, "arches": ["sm_90a"], "kernels": {"hopper_only": {"dtype": "bf16"}}})
    assert len(s.variants) == 1


def test_invalid_yaml(tmp_path):
    e = spec_error(tmp_path, "kernels: [unclosed\n")
    assert "YAML" in str(e)


def test_base_lays_a_spec_over_another(tmp_path):
    """`base`, a path relative to the spec's folder: mappings merge at every depth, lists and scalars replace,
    null removes the base's key; the spec's sha256 covers its base."""
    base = write(tmp_path, BASE + "    launch:\n      sm_90a: {num_warps: [4]}\n", "base.yaml")
    (tmp_path / "sub").mkdir()
    over = "base: ../base.yaml\narches: [sm_90a]\nkernels:\n  gdn_scan:\n    dtype: bf16\n    transpose: null\n"
    derived = load_spec(write(tmp_path / "sub", over, "derived.yaml"))
    whole = yaml.safe_load(BASE)
    whole["arches"], whole["kernels"]["gdn_scan"]["dtype"] = ["sm_90a"], "bf16"
    whole["kernels"]["gdn_scan"].pop("transpose")
    whole["kernels"]["gdn_scan"]["launch"] = {"sm_90a": {"num_warps": [4]}}
    assert derived.variants == parse_spec(whole).variants and len(derived.variants) == 4
    assert derived.path == str(tmp_path / "sub" / "derived.yaml")
    before = derived.sha256
    base.write_text(base.read_text().replace("BV: [64, 128]", "BV: [128]"))
    after = load_spec(tmp_path / "sub" / "derived.yaml")
    assert len(after.variants) == 2 and after.sha256 != before


def test_base_by_shipped_name(tmp_path):
    """A base not beside the spec is the shipped spec of that name."""
    spec = load_spec(write(tmp_path, "base: qwen35\narches: [sm_90a]\ndispatch: {sm_100a: null}\n"))
    assert spec.arches == ("sm_90a",) and {v.arch for v in spec.variants} == {"sm_90a"}
    assert {v.key for v in spec.variants} == {v.key for v in load_spec("qwen35").for_arch("sm_90a")}


@pytest.mark.parametrize("over, problem", [
    ("base: missing.yaml\n", "no such spec file"),
    ("base: 3\n", "expected the path of another spec"),
    ("base: spec.yaml\n", "a cycle"),
])
def test_bad_base(tmp_path, over, problem):
    e = spec_error(tmp_path, over + BASE)
    assert e.keypath == "base" and problem in e.problem


def test_base_cycle_through_two_files(tmp_path):
    write(tmp_path, "base: spec.yaml\n" + BASE, "other.yaml")
    e = spec_error(tmp_path, "base: other.yaml\n" + BASE)
    assert e.keypath == "base" and "a cycle" in e.problem


def test_base_that_is_not_a_mapping(tmp_path):
    """A base whose document is not a mapping is refused naming the base's file."""
    write(tmp_path, "- a list\n", "other.yaml")
    with pytest.raises(SpecError) as ei:
        load_spec(write(tmp_path, "base: other.yaml\n" + BASE))
    e = ei.value
    assert e.path == str(tmp_path / "other.yaml") and e.keypath == "" and "a spec is a YAML mapping" in e.problem


def test_shipped_specs_enumerate():
    q = load_spec(REPO / "specs" / "qwen35.yaml")
    # prepare: dtype x varlen x gating; scan: (dtype, state dtype) x varlen x transpose x (BV, warps), the (dtype,
    # state dtype) pairs (bf16, fp32), (fp16, fp32), (bf16, bf16), the (BV, warps) sm_90a 128/w8, 32/w16 and 64/w16
    # (warp-specialised, varlen only), 32/w4 (fixed-length only: for varlen batches the BV 64 single-wave row
    # covers its small-batch row) and sm_100a BV 64/w4, 128/w4, 64/w16 (warp-specialised); and with checkpoints,
    # varlen only, the same (BV, warps): the ones the dispatch table takes; on sm_90a gdn_prepare for gating only
    # and gdn_fused (without gating) at BV 64 and 128, with checkpoints for varlen batches; gdn_fused_terms as
    # gdn_fused at BV 64
    sm100 = {"gdn_prepare": 8, "gdn_scan": 36 + 18}
    per_arch = {"sm_90a": {"gdn_prepare": 4, "gdn_scan": 30 + 18, "gdn_fused": 24 + 12, "gdn_fused_terms": 12 + 6},
                "sm_100a": sm100,
                "sm_103a": sm100}
    for arch, counts in per_arch.items():
        vs = q.for_arch(arch)
        assert {v.kernel for v in vs} == set(counts)  # no gdn_l2norm: fused into every route
        assert {k: sum(v.kernel == k for v in vs) for k in counts} == counts
        assert all(v.K == 128 and v.V == 128 and v.num_warps in (4, 8, 16) for v in vs)
    assert {(v.BV, v.num_warps) for v in q.for_arch("sm_90a") if v.kernel == "gdn_scan"} == {
        (32, 4), (128, 8), (32, 16), (64, 16)}
    assert {(v.BV, v.num_warps) for v in q.for_arch("sm_100a") if v.kernel == "gdn_scan"} == {
        (64, 4), (128, 4), (64, 16)}
    assert len(q.variants) == 230 and len({v.key for v in q.variants}) == 230
    assert _as_sm100(q.for_arch("sm_103a")) == q.for_arch("sm_100a")  # sm_103a takes sm_100a's sections
    assert q.dispatch["sm_103a"] == q.dispatch["sm_100a"]
    ws = [v for v in q.for_arch("sm_90a")
          if v.kernel == "gdn_scan" and v.num_warps == q.dispatch["sm_90a"]["gdn_scan"]["single_wave_warps"]]
    assert {(v.kernel, v.BV, v.varlen) for v in ws} == {("gdn_scan", 32, True), ("gdn_scan", 64, True)}
    assert len(ws) == 24  # (bf16, fp32), (fp16, fp32), (bf16, bf16) x BV 32, 64 x both layouts, and with checkpoints
    ckpt = [v for v in q.variants if v.checkpoints]
    assert {v.kernel for v in ckpt} == {"gdn_scan", "gdn_fused", "gdn_fused_terms"} and all(v.varlen for v in ckpt)
    assert len(ckpt) == 72
    assert {(v.kernel, v.BV, v.num_warps) for v in ckpt if v.arch == "sm_90a"} == {
        ("gdn_scan", 128, 8), ("gdn_scan", 32, 16), ("gdn_scan", 64, 16), ("gdn_fused", 64, 16), ("gdn_fused", 128, 16),
        ("gdn_fused_terms", 64, 16)}
    t = load_spec("tiny")  # a shipped spec by name
    assert len(t.variants) == 33
    for arch in ("sm_90a", "sm_100a"):
        assert sorted(v.num_warps for v in t.for_arch(arch) if v.kernel == "gdn_prepare") == [4, 16]
    assert {(v.kernel, v.BV, v.num_warps, v.transpose, v.state_dtype, v.checkpoints) for v in t.for_arch("sm_103a")} \
        == {("gdn_prepare", 128, 4, False, "fp32", False), ("gdn_scan", 64, 4, False, "fp32", False),
            ("gdn_scan", 64, 16, False, "fp32", False), ("gdn_fused", 128, 16, False, "fp32", False)}
    assert {v.kernel for v in t.variants} == {"gdn_prepare", "gdn_scan", "gdn_fused", "gdn_fused_terms"}
    plain_scans = [v for v in t.for_arch("sm_90a") if v.kernel == "gdn_scan" and not v.checkpoints]
    assert sorted(v.transpose for v in plain_scans) == [False, False, True, True, True]  # one of them bf16-state
    # the shipped specs' BVs: sm_90a's 4-warp scan at 32, the warp-specialised one at 64
    assert {(v.BV, v.num_warps) for v in plain_scans} == {(32, 4), (64, 16)}
    assert sorted(v.transpose for v in t.for_arch("sm_100a") if v.kernel == "gdn_fused") == [False, False, True]
    assert {(v.arch, v.kernel, v.BV, v.num_warps, v.transpose) for v in t.variants if v.checkpoints} == {
        ("sm_90a", "gdn_scan", 64, 16, False), ("sm_90a", "gdn_scan", 64, 16, True),
        ("sm_90a", "gdn_scan", 32, 4, False),
        ("sm_100a", "gdn_scan", 64, 4, False), ("sm_100a", "gdn_scan", 64, 4, True),
        ("sm_100a", "gdn_scan", 64, 16, False), ("sm_100a", "gdn_scan", 64, 16, True),
        ("sm_90a", "gdn_fused", 128, 16, False), ("sm_100a", "gdn_fused", 128, 16, False)}
    f = load_spec(REPO / "specs" / "fused-preview.yaml")  # every configuration, the one-kernel route only
    # with and without gating; with checkpoints for varlen batches; sm_90a at BV 64 and 128
    assert len(f.variants) == 144 and {v.kernel for v in f.variants} == {"gdn_fused"}
    assert sum(v.checkpoints for v in f.variants) == 48 and all(v.varlen for v in f.variants if v.checkpoints)
    assert all(v.num_warps == 16 and v.BT == 64 for v in f.variants)
    assert {(v.arch, v.BV) for v in f.variants} == {("sm_90a", 64), ("sm_90a", 128), ("sm_100a", 128),
                                                    ("sm_103a", 128)}
    assert {v.dtype for v in t.variants} == {"bf16"}
    prep = [v for v in q.variants if v.kernel == "gdn_prepare"]  # BV and transpose unused: their defaults
    assert all(v.BT == 64 and v.BK == 128 and v.BV == 128 and not v.transpose for v in prep)
    # every arch: the warp-specialised gdn_prepare (16 warps) but for the gating variants; sm_90a gating only
    assert all(v.num_warps == (4 if v.gating else 16) for v in prep)
    assert {v.arch for v in prep} == {"sm_90a", "sm_100a", "sm_103a"}
    assert {(v.dtype, v.varlen, v.gating) for v in prep if v.arch == "sm_100a"} == set(
        itertools.product(("bf16", "fp16"), (True, False), (True, False)))
    assert all(v.gating for v in prep if v.arch == "sm_90a")
    assert {v.state_dtype for v in prep} == {"fp32"}  # gdn_prepare never touches the state
    assert q.dispatch["sm_90a"]["gdn_scan"]["small_batch_factor"] == 0.5  # a fraction of the SMs is allowed
    for arch in ("sm_90a", "sm_100a", "sm_103a"):
        d = q.dispatch[arch]["gdn_scan"]
        assert {d["default_BV"], d["small_batch_BV"]} <= {v.BV for v in q.for_arch(arch) if v.kernel == "gdn_scan"}


def test_exclusions_and_scalars(tmp_path):
    p = write(tmp_path, BASE + "    exclude:\n      - {dtype: fp16, BV: 64}\n      - {arch: sm_100a, transpose: true}\n")
    s = load_spec(p)
    assert len(s.for_arch("sm_90a")) == 16 - 4
    assert len(s.for_arch("sm_100a")) == 8 - 2
    assert not any(v.dtype == "fp16" and v.BV == 64 for v in s.variants)
    s = parse_spec({"K": 64, "V": 128, "arches": "sm_90a",
                    "kernels": {"gdn_prepare": {"dtype": "fp16", "K": 128, "launch": {"sm_90a": {"num_warps": 8}}}}})
    (v,) = s.variants
    assert (v.K, v.V, v.BK, v.BV, v.num_warps, v.num_stages, v.varlen) == (128, 128, 128, 128, 8, 1, False)


def test_resolve_arches():
    every = ("sm_90a", "sm_100a", "sm_103a")
    assert resolve_arches("all", every) == every
    assert resolve_arches("sm_90", every) == ("sm_90a",)
    assert resolve_arches("sm_100a", every) == ("sm_100a",)
    for word in ("sm_103", "sm_103a", "103"):
        assert resolve_arches(word, every) == ("sm_103a",)
    assert resolve_arches("sm_103,90", every) == ("sm_103a", "sm_90a")
    with pytest.raises(SpecError, match="sm_100a was requested"):
        resolve_arches("sm_100", ("sm_90a",), "x.yaml")
    with pytest.raises(SpecError, match="sm_103a was requested"):
        resolve_arches("sm_103", ("sm_90a", "sm_100a"), "x.yaml")
    with pytest.raises(SpecError, match="unknown arch; use one of sm_90, sm_100, sm_103, all"):
        resolve_arches("sm_80", every)


def _as_sm100(variants):
    return [dataclasses.replace(v, arch="sm_100a") for v in variants]


SM103 = """
K: 128
V: 128
arches: [sm_100a, sm_103a]
kernels:
  gdn_scan:
    BV: [32, 64, 128]
    dtype: bf16
    launch: {sm_100a: {num_warps: [4, 8]}}
    exclude:
      - {arch: sm_100a, BV: 32}
      - {BV: 128, num_warps: 4}
dispatch:
  sm_100a:
    gdn_scan: {default_BV: 128, small_batch_BV: 64}
"""


def test_sm103a_takes_sm100a_sections():
    """sm_103a (the sm_100a sources) takes sm_100a's launch and dispatch entries and its exclusions, unless the spec
    gives sm_103a its own (docs/spec-format.md)."""
    s = parse_spec(yaml.safe_load(SM103))
    assert _as_sm100(s.for_arch("sm_103a")) == s.for_arch("sm_100a")
    assert {(v.BV, v.num_warps) for v in s.for_arch("sm_103a")} == {(64, 4), (64, 8), (128, 8)}
    assert s.dispatch["sm_103a"] == s.dispatch["sm_100a"]
    own = yaml.safe_load(SM103)
    own["kernels"]["gdn_scan"]["launch"]["sm_103a"] = {"num_warps": [4]}
    own["kernels"]["gdn_scan"]["exclude"].append({"arch": "sm_103a", "BV": 128})
    own["dispatch"]["sm_103a"] = {"gdn_scan": {"default_BV": 64}}
    s = parse_spec(own)
    assert {(v.BV, v.num_warps) for v in s.for_arch("sm_103a")} == {(64, 4)}  # sm_100a's exclusions still apply
    assert len(s.for_arch("sm_100a")) == 3  # an exclusion naming sm_103a leaves sm_100a alone
    assert s.dispatch["sm_103a"]["gdn_scan"]["default_BV"] == 64 and "small_batch_BV" not in s.dispatch["sm_103a"][
        "gdn_scan"]
    alone = yaml.safe_load(SM103)  # a spec for sm_103a alone may still write sm_100a's sections
    alone["arches"] = ["sm_103a"]
    s = parse_spec(alone)
    assert {(v.BV, v.num_warps) for v in s.variants} == {(64, 4), (64, 8), (128, 8)}
    assert set(s.dispatch) == {"sm_103a"}


def test_sm103a_inherited_dispatch_is_checked_against_its_own_variants():
    doc = yaml.safe_load(SM103)
    doc["kernels"]["gdn_scan"]["exclude"].append({"arch": "sm_103a", "BV": 128})
    doc["dispatch"]["sm_100a"]["gdn_scan"]["single_wave_warps"] = 8
    doc["kernels"]["gdn_scan"]["launch"]["sm_103a"] = {"num_warps": [4]}
    with pytest.raises(SpecError) as ei:
        parse_spec(doc)
    assert ei.value.keypath == "dispatch.sm_100a (taken by sm_103a).gdn_scan.single_wave_warps"


def test_fused_routing(tmp_path):
    """gdn_fused takes the batches above a number of programs an SM (docs/spec-format.md); its variants are the
    fused kernel's axes."""
    s = load_spec(write(tmp_path, BASE + "  gdn_prepare: {dtype: [bf16, fp16], varlen: [true, false]}\n"
                        "  gdn_fused: {dtype: bf16, varlen: true, launch: {sm_90a: {num_warps: 16}}}\n"
                        "dispatch:\n  sm_90a:\n    gdn_scan: {default_BV: 128}\n"
                        "    gdn_fused: {above_factor: 0.5}\n"))
    assert s.dispatch["sm_90a"]["gdn_fused"] == {"above_factor": 0.5}
    fused = [v for v in s.variants if v.kernel == "gdn_fused"]
    assert {(v.arch, v.num_warps, v.BV) for v in fused} == {("sm_90a", 16, 128), ("sm_100a", 4, 128)}
    assert KERNELS["gdn_fused"].compile_options(fused[0]) == {"num_warps": 8, "num_stages": 1, "maxnreg": 128}
    assert KERNELS["gdn_fused"].constexprs(fused[0])["num_warps"] == 8


def test_state_dtype_specs_enumerate():
    """qwen35.yaml and fused-preview.yaml store the state in fp32 or (with bf16 inputs) bf16; state-dtypes.yaml
    builds every state dtype for varlen bf16 batches, in both layouts, with qwen35.yaml's scan tiers."""
    q = load_spec(REPO / "specs" / "qwen35.yaml")
    scans = [v for v in q.variants if v.kernel == "gdn_scan"]
    assert {(v.dtype, v.state_dtype) for v in scans} == {("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16")}
    for arch in ("sm_90a", "sm_100a", "sm_103a"):  # a bf16-state scan for every bf16 fp32-state one
        tiers = lambda state: sorted((v.BV, v.num_warps, v.varlen, v.transpose) for v in scans  # noqa: E731
                                     if v.arch == arch and v.dtype == "bf16" and v.state_dtype == state)
        assert tiers("bf16") == tiers("fp32")
    f = load_spec(REPO / "specs" / "fused-preview.yaml")
    assert {(v.dtype, v.state_dtype) for v in f.variants} == {("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16")}
    assert len(f.variants) == 144
    s = load_spec(REPO / "specs" / "state-dtypes.yaml")
    assert s.dispatch == q.dispatch
    per_arch = {"sm_90a": 3, "sm_100a": 3, "sm_103a": 3}  # (BV, warps) tiers, as qwen35.yaml's varlen ones
    for arch, tiers in per_arch.items():
        vs = s.for_arch(arch)
        assert sum(v.kernel == "gdn_prepare" for v in vs) == 1
        scans = [v for v in vs if v.kernel == "gdn_scan"]
        assert len(scans) == tiers * 2 * 5 and all(v.varlen and v.dtype == "bf16" for v in scans)
        assert {v.state_dtype for v in scans} == {"fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2"}
        assert {(v.BV, v.num_warps) for v in scans} == {(v.BV, v.num_warps) for v in q.for_arch(arch)
                                                         if v.kernel == "gdn_scan" and v.varlen}


@pytest.mark.parametrize("name", ["qwen35", "state-dtypes", "fused-preview"])
def test_shipped_specs_build_only_what_the_dispatch_takes(name):
    """Every variant a serving spec builds is a kernel of some row of its dispatch table, whose rows all serve
    some batch (a row an earlier one covers is dropped; tiny.yaml, the test build, adds variants for the SASS
    checks): nothing is compiled, shipped and loaded that no batch would run."""
    from gdn_aot.loader.dispatch import build_table

    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    for arch in spec.arches:
        variants = {v.key: {"kernel": v.kernel, "num_warps": v.num_warps, "key": v.key,
                            "axes": {a: getattr(v, a) for a in ("K", "V", "BT", "BK", "BV", "dtype", "varlen",
                                                                "transpose", "state_dtype", "gating", "checkpoints")}}
                    for v in spec.for_arch(arch)}
        uses = {kernel: sorted(KERNELS[kernel].uses_axes) for kernel in {v["kernel"] for v in variants.values()}}
        table = build_table(spec.dispatch.get(arch, {}), variants, uses)
        taken = {key for row in table for key in row["kernels"].values()}
        assert sorted(set(variants) - taken) == [], arch
