"""bench/ab.py's CPU half: which variants of a manifest it compares, and how it compares outputs (the launches and
the timing need a GPU)."""
import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
_spec = importlib.util.spec_from_file_location("bench_ab", REPO / "bench" / "ab.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def _variant(kernel, warps, **axes):
    base = {"varlen": True, "dtype": "bf16", "gating": False, "transpose": False, "state_dtype": "fp32",
            "checkpoints": False, "BV": 128}
    return {"kernel": kernel, "num_warps": warps, "axes": {**base, **axes}}


VARIANTS = {
    "scan.bv32.w4": _variant("gdn_scan", 4, BV=32),
    "scan.bv32.w16": _variant("gdn_scan", 16, BV=32),
    "scan.bv64.w16": _variant("gdn_scan", 16, BV=64),
    "scan.bv64.w16.vk": _variant("gdn_scan", 16, BV=64, transpose=True),
    "scan.bv64.w16.ckpt": _variant("gdn_scan", 16, BV=64, checkpoints=True),
    "scan.bv64.w16.bf16state": _variant("gdn_scan", 16, BV=64, state_dtype="bf16"),
    "scan.bv64.w16.fixed": _variant("gdn_scan", 16, BV=64, varlen=False),
    "scan.bv64.w16.fp16": _variant("gdn_scan", 16, BV=64, dtype="fp16"),
    "prepare.w4": _variant("gdn_prepare", 4),
    "prepare.w4.gating": _variant("gdn_prepare", 4, gating=True),
    "prepare.w16": _variant("gdn_prepare", 16),
    "fused.bv64": _variant("gdn_fused", 16, BV=64),
    "fused.bv128": _variant("gdn_fused", 16),
    "fused.bv128.vk": _variant("gdn_fused", 16, transpose=True),
    "fused.bv128.ckpt": _variant("gdn_fused", 16, checkpoints=True),
}


def test_select_scan_variants_by_bv():
    assert ab.select_variants(VARIANTS, "gdn_scan", 16) == {32: "scan.bv32.w16", 64: "scan.bv64.w16"}
    # any warps: the smallest key of each BV
    assert ab.select_variants(VARIANTS, "gdn_scan", None) == {32: "scan.bv32.w16", 64: "scan.bv64.w16"}
    assert ab.select_variants(VARIANTS, "gdn_scan", 4) == {32: "scan.bv32.w4"}
    assert ab.select_variants(VARIANTS, "gdn_scan", 16, bv=64) == {64: "scan.bv64.w16"}
    assert ab.select_variants(VARIANTS, "gdn_scan", 8) == {}


def test_select_prepare_variants_by_warps():
    assert ab.select_variants(VARIANTS, "gdn_prepare", None) == {4: "prepare.w4", 16: "prepare.w16"}
    assert ab.select_variants(VARIANTS, "gdn_prepare", 16) == {16: "prepare.w16"}


def test_fused_compares_every_bv_of_every_root_with_the_first_root_s_largest():
    """gdn_fused: a group per BV of the [K, V] fp32 variants without checkpoints; the compared list starts with the
    first root's largest BV (the reference of the bitwise check), then its other BVs, then the next root's."""
    chosen = ab.select_variants(VARIANTS, "gdn_fused", None)
    assert chosen == {64: "fused.bv64", 128: "fused.bv128"}
    assert ab.fused_sets(["A"], [chosen]) == [("A/BV128", 0, 128, "fused.bv128"), ("A/BV64", 0, 64, "fused.bv64")]
    assert [(label, root) for label, root, _, _ in ab.fused_sets(["A", "B"], [{128: "a"}, chosen])] == [
        ("A/BV128", 0), ("B/BV128", 1), ("B/BV64", 1)]


def test_select_from_a_real_manifest(tiny_build):
    """tiny.yaml's sm_90a scans: the [K, V] fp32 variants without checkpoints, BV 32 at 4 warps, 64 at 16."""
    variants = tiny_build.manifest("sm_90a")["variants"]
    assert list(ab.select_variants(variants, "gdn_scan", 4)) == [32]
    chosen = ab.select_variants(variants, "gdn_scan", 16)
    assert list(chosen) == [64]
    e = variants[chosen[64]]
    assert (e["num_warps"], e["axes"]["transpose"], e["axes"]["checkpoints"]) == (16, False, False)
    assert set(ab.select_variants(variants, "gdn_prepare", None)) == {4, 16}
    assert set(ab.select_variants(variants, "gdn_fused", None)) == {64, 128}  # sm_90a's V tiles


def test_compare():
    a = [torch.tensor([1.0, -2.0, 4.0]), torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)]
    same = [t.clone() for t in a]
    assert ab.compare(same, a) == ([0.0, 0.0], True, 0)
    off = [torch.tensor([1.0, -2.0, 4.5]), torch.tensor([[float("nan"), 0.25]], dtype=torch.bfloat16)]
    rel, bitwise, nans = ab.compare(off, a)
    assert abs(rel[0] - 0.125) < 1e-7 and not bitwise and nans == 1


def test_reference_errors():
    """Each root's (o, final state) error against the reference forward: 0 for the reference itself."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 70, 2, 4, 16, 8
    x = SimpleNamespace(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                        v=torch.randn(1, T, HV, V, generator=gen),
                        g=-torch.nn.functional.softplus(torch.randn(1, T, HV, generator=gen)),
                        beta=torch.rand(1, T, HV, generator=gen), cu=torch.tensor([0, 5, 5, T]),
                        h0=torch.randn(3, HV, K, V, generator=gen))
    o, ht = ab.reference_forward(x)
    assert o.shape == x.v.shape and ht.shape == x.h0.shape
    off = o.clone()
    off[0, 3, 1, 2] += 0.5 * o.abs().max()
    (eo, eh), (eo2, eh2) = ab.reference_errors((o, ht), [(o, ht), (off.bfloat16(), ht)])
    assert eo == eh == eh2 == 0.0 and 0.49 < eo2 < 0.51


def test_roots_are_named_by_what_tells_them_apart():
    assert ab.root_names(["/tmp/old/gdn_aot/artifacts", "/tmp/new/gdn_aot/artifacts"]) == ["old", "new"]
    assert ab.root_names(["artifacts-a", "artifacts-b/"]) == ["artifacts-a", "artifacts-b"]
    assert ab.root_names(["/x/a/b/artifacts", "/x/c/artifacts"]) == ["a/b", "c"]
    assert ab.root_names(["/tmp/w/artifacts"]) == ["artifacts"]
    assert ab.root_names(["/tmp/w/artifacts", "/tmp/w/artifacts/"]) == ["root0", "root1"]
