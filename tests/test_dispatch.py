"""The dispatch table (loader/dispatch.py): built from a spec's preferences and the variants that compiled, it
gives the shape classes of the two-kernel route (single wave, small batch, default) and the classes a spec routes
to gdn_fused; the launcher's C copy (gdn_aot_select) answers every batch as the Python loader does. On the CPU:
synthetic variant sets, no kernel build (the launcher is rendered from the table and compiled here)."""
from __future__ import annotations

import itertools

import pytest

from gdn_aot.build import launcher
from gdn_aot.kernels import KERNELS, Variant
from gdn_aot.loader import Launcher
from gdn_aot.loader.abi import ROUTES
from gdn_aot.loader.dispatch import build_table, config_rows, most_programs, select

USES = {name: sorted(kd.uses_axes) for name, kd in KERNELS.items()}
SMS = (16, 78, 114, 132, 148)
# specs/qwen35.yaml's sm_90a dispatch preferences
QWEN_SM90 = {"gdn_scan": {"default_BV": 128, "small_batch_BV": 32, "small_batch_factor": 0.5,
                          "single_wave_warps": 16}}


def variant(kernel, BV=128, warps=4, dtype="bf16", varlen=True, transpose=False, K=128, V=128, BT=64,
            state_dtype="fp32", gating=False, checkpoints=False):
    v = Variant(kernel=kernel, arch="sm_90a", K=K, V=V, BT=BT, BK=K, BV=BV, dtype=dtype, varlen=varlen,
                transpose=transpose, num_warps=warps, num_stages=1, state_dtype=state_dtype, gating=gating,
                checkpoints=checkpoints)
    return v.key, entry(v)


def entry(v: Variant) -> dict:
    """A variant as the manifest's `variants` hold it, as far as the dispatch table reads it."""
    return {"kernel": v.kernel, "axes": v.as_dict(), "num_warps": v.num_warps}


def config(dtype="bf16", K=128, V=128, varlen=True, transpose=False, state_dtype="fp32", gating=False,
           checkpoints=False) -> tuple:
    """A forward's configuration, in CONFIG_AXES order."""
    return dtype, K, V, varlen, transpose, state_dtype, gating, checkpoints


def qwen_sm90_variants(transposes=(False, True), fused=False) -> dict:
    """The sm_90a variants of specs/qwen35.yaml's varlen bf16 configurations (and a 16-warp gdn_fused)."""
    out = dict([variant("gdn_prepare")])
    for tr in transposes:
        out.update(variant("gdn_scan", bv, w, transpose=tr) for bv, w in ((32, 4), (64, 4), (128, 8), (32, 16),
                                                                           (64, 16)))
        if fused:
            out.update([variant("gdn_fused", 128, 16, transpose=tr)])
    return out


def scan_bv(row) -> int:
    return int(row["kernels"]["gdn_scan"].split(".bt64bk128bv")[1].split(".")[0])


def todays_rule(programs: int, sm_count: int) -> tuple[int, int]:
    """The rule the loader applied before the table (per-call Python tiers): (BV, num_warps) of gdn_scan."""
    tiers = []
    for bv in (32, 64):  # single wave: the smallest BV of the 16-warp scan whose grid fits the SMs
        upto = sm_count // (128 // bv)
        if upto > (tiers[-1][0] if tiers else 0):
            tiers.append((upto, bv))
    if tiers and programs <= tiers[-1][0]:
        return next(bv for upto, bv in tiers if programs <= upto), 16
    return (32, 4) if programs < 0.5 * sm_count else (128, 8)


def test_qwen35_rules_become_rows():
    """The single-wave rows, then small_batch, then default; a row that an earlier one covers on every SM count
    is dropped: on sm_90a the BV 64 single-wave row (le 1/2) covers small_batch (lt 1/2) wherever the
    warp-specialised scan is built, so small_batch stays only for the fixed-length batches, which have none."""
    fixed = dict(variant("gdn_scan", bv, w, varlen=False) for bv, w in ((32, 4), (128, 8)))
    table = build_table(QWEN_SM90, {**qwen_sm90_variants(), **fixed, **dict([variant("gdn_prepare", varlen=False)])},
                        USES)
    rows = config_rows(table, config())
    assert [(r["class"], r["bound"], r["num"], r["den"], scan_bv(r)) for r in rows] == [
        ("single_wave", "le", 1, 4, 32), ("single_wave", "le", 1, 2, 64), ("default", "any", 0, 1, 128)]
    assert [most_programs(r, 132) for r in rows] == [33, 66, float("inf")]
    assert all(r["route"] == "prepare_scan" and r["kernels"]["gdn_prepare"].startswith("gdn_prepare.") for r in rows)
    assert ".w16s1" in rows[0]["kernels"]["gdn_scan"] and ".w8s1" in rows[2]["kernels"]["gdn_scan"]
    fixed_rows = config_rows(table, config(varlen=False))
    assert [(r["class"], r["bound"], r["num"], r["den"], scan_bv(r)) for r in fixed_rows] == [
        ("small_batch", "lt", 1, 2, 32), ("default", "any", 0, 1, 128)]
    assert ".w4s1" in fixed_rows[0]["kernels"]["gdn_scan"] and most_programs(fixed_rows[0], 132) == 65
    assert len(table) == 8  # both state layouts (3 rows each), and the fixed-length batches


@pytest.mark.parametrize("sm_count", SMS)
def test_table_keeps_the_rule_it_replaces(sm_count):
    """Every batch size gets the gdn_scan variant the per-call tiers gave (ties included: programs == SMs / 2)."""
    table = build_table(QWEN_SM90, qwen_sm90_variants(), USES)
    for programs in range(1, 4 * sm_count):
        r = select(table, config(), programs, sm_count)
        got = (scan_bv(r), int(r["kernels"]["gdn_scan"].rsplit(".w", 1)[1].split("s")[0]))
        assert got == todays_rule(programs, sm_count), (programs, r["class"])


def test_a_row_is_dropped_only_when_an_earlier_one_covers_it_on_every_sm_count():
    """_covers against brute force: row r never serves a batch after row e iff, on every SM count, e takes every
    program count r would."""
    from fractions import Fraction

    from gdn_aot.loader.dispatch import _covers

    limits = [Fraction(n, d) for n, d in ((1, 4), (1, 2), (2, 3), (1, 1), (2, 1))]
    rows = [("any", Fraction(0))] + [(b, f) for b in ("le", "lt") for f in limits]

    def most(bound, limit, sm_count):
        return most_programs({"bound": bound, "num": limit.numerator, "den": limit.denominator}, sm_count)

    for (eb, ef), (rb, rf) in itertools.product(rows, rows):
        covered = all(most(rb, rf, s) <= most(eb, ef, s) for s in range(1, 400))
        assert _covers(("", eb, ef, {}), ("", rb, rf, {})) == covered, ((eb, ef), (rb, rf))


def test_missing_variants_fall_back_like_pick():
    """A preferred BV that did not compile: the row takes default_BV, else the largest built BV (among variants of
    one BV, the fewest warps)."""
    variants = qwen_sm90_variants(transposes=(False,))
    for w in (4, 16):
        del variants[f"gdn_scan.sm_90a.bf16.k128v128.bt64bk128bv32.varlen.kv.w{w}s1"]
    rows = build_table(QWEN_SM90, variants, USES)
    assert [(r["class"], scan_bv(r)) for r in rows] == [("single_wave", 64), ("default", 128)]
    del variants["gdn_scan.sm_90a.bf16.k128v128.bt64bk128bv128.varlen.kv.w8s1"]
    rows = build_table(QWEN_SM90, variants, USES)
    assert [(r["class"], scan_bv(r), r["kernels"]["gdn_scan"].rsplit(".", 1)[1]) for r in rows] == [
        ("single_wave", 64, "w16s1"), ("default", 64, "w4s1")]
    no_single_wave = {k: e for k, e in variants.items() if e["num_warps"] != 16}
    assert [(r["class"], scan_bv(r)) for r in build_table(QWEN_SM90, no_single_wave, USES)] == [
        ("small_batch", 64), ("default", 64)]
    assert [r["class"] for r in build_table({}, variants, USES)] == ["default"]  # no preferences: one row


def test_fused_above_a_factor_and_fused_only_configurations():
    """above_factor 1/2: the two-kernel rows up to SMs / 2 programs (the default row, cut there, is covered by the
    BV 64 single-wave row), gdn_fused beyond."""
    prefs = {**QWEN_SM90, "gdn_fused": {"above_factor": 0.5}}
    rows = build_table(prefs, qwen_sm90_variants(transposes=(False,), fused=True), USES)
    assert [(r["class"], r["route"]) for r in rows] == [
        ("single_wave", "prepare_scan"), ("single_wave", "prepare_scan"), ("default", "fused")]
    assert set(rows[-1]["kernels"]) == {"gdn_fused"} and ".w16s1" in rows[-1]["kernels"]["gdn_fused"]
    # without a gdn_fused preference the two-kernel route keeps every class; a configuration only gdn_fused
    # serves (here the transposed layout) gets one unbounded fused row
    variants = {**qwen_sm90_variants(transposes=(False,)), **dict([variant("gdn_fused", 128, 16, transpose=True)])}
    rows = build_table(QWEN_SM90, variants, USES)
    assert {r["route"] for r in config_rows(rows, config())} == {"prepare_scan"}
    (only,) = config_rows(rows, config(transpose=True))
    assert (only["class"], only["bound"], only["route"]) == ("default", "any", "fused")


def test_fused_alone_takes_its_64_row_tile_for_one_wave():
    """A configuration gdn_fused serves alone, built at BV 64 and 128: BV 64 (two programs a value head) while
    num_seqs * HV * 2 fits the SMs, BV 128 beyond; the same rows with above_factor 0 (the two-kernel variants are
    then unused); with above_factor 1/4 (a spec trading batch invariance for speed, sending SMs / 4 programs and
    fewer to the two-kernel route): the two-kernel route up to there (the fixed-length small_batch row cut to it),
    then gdn_fused's rows."""
    fused = dict(variant("gdn_fused", bv, 16) for bv in (64, 128))

    def bv(row):
        return fused_all[row["kernels"]["gdn_fused"]]["axes"]["BV"]

    fixed = dict(variant(k, bv, w, varlen=False) for k, bv, w in (("gdn_prepare", 128, 4), ("gdn_scan", 32, 4),
                                                                   ("gdn_scan", 128, 8), ("gdn_fused", 64, 16),
                                                                   ("gdn_fused", 128, 16)))
    fused_all = {**fused, **fixed}
    alone = build_table({}, fused, USES)
    assert [(r["class"], r["bound"], r["num"], r["den"], bv(r)) for r in alone] \
        == [("single_wave", "le", 1, 2, 64), ("default", "any", 0, 1, 128)]
    for programs, sm_count, want in ((66, 132, 64), (67, 132, 128), (1, 132, 64), (66, 131, 128)):
        assert bv(select(alone, config(), programs, sm_count)) == want
    two_kernel = {**qwen_sm90_variants(transposes=(False,)), **fused}
    assert build_table({**QWEN_SM90, "gdn_fused": {"above_factor": 0}}, two_kernel, USES) == alone
    table = build_table({**QWEN_SM90, "gdn_fused": {"above_factor": 0.25}}, {**two_kernel, **fixed}, USES)
    for c, first in ((config(), "single_wave"), (config(varlen=False), "small_batch")):
        rows = config_rows(table, c)
        assert [(r["class"], r["route"], r["bound"], r["num"], r["den"]) for r in rows] == [
            (first, "prepare_scan", "le", 1, 4), ("single_wave", "fused", "le", 1, 2),
            ("default", "fused", "any", 0, 1)]
        assert [bv(r) for r in rows[1:]] == [64, 128]
        assert [select(table, c, p, 132)["route"] for p in (1, 33, 34, 66, 67)] == [
            "prepare_scan", "prepare_scan", "fused", "fused", "fused"]
    half = build_table({**QWEN_SM90, "gdn_fused": {"above_factor": 0.5}}, two_kernel, USES)
    assert [r["route"] for r in half] == ["prepare_scan", "prepare_scan", "fused"] and bv(half[-1]) == 128


def functional_variants() -> dict:
    """A gating gdn_prepare and bf16-state gdn_scan variants (qwen35's BVs, no warp-specialised one)."""
    return dict([variant("gdn_prepare", gating=True),
                 *(variant("gdn_scan", bv, w, state_dtype="bf16") for bv, w in ((32, 4), (128, 8)))])


def test_functional_axes_take_their_variants():
    """A configuration's gating comes from gdn_prepare's variants and its state dtype from gdn_scan's (each kernel
    matches only the axes it uses); a configuration no built variant serves has no rows."""
    table = build_table(QWEN_SM90, {**qwen_sm90_variants(transposes=(False,)), **functional_variants()}, USES)

    def kernels(c):
        return [(r["class"], r["kernels"]["gdn_prepare"], r["kernels"]["gdn_scan"]) for r in config_rows(table, c)]

    plain, gating, bf16, both = (kernels(config(gating=g, state_dtype=s)) for g, s in (
        (False, "fp32"), (True, "fp32"), (False, "bf16"), (True, "bf16")))
    assert [c for c, *_ in plain] == ["single_wave", "single_wave", "default"]
    assert [c for c, *_ in bf16] == ["small_batch", "default"]  # no 16-warp bf16-state scan built
    assert all(".gating." in p and ".state-" not in s for _, p, s in gating)
    assert [s for *_, s in gating] == [s for *_, s in plain]
    assert all(".gating." not in p and ".state-bf16." in s for _, p, s in bf16)
    assert [(p, s) for _, p, s in both] == [(gating[0][1], s) for *_, s in bf16]
    assert config_rows(table, config(checkpoints=True)) == []


def test_checkpoints_take_their_scan_variants():
    """specs/qwen35.yaml's checkpoint variants (gdn_scan, varlen, the BVs and warps the rows take): the configuration
    with checkpoints gets the same shape classes, the plain gdn_prepare and gdn_scan variants with checkpoints; a
    fixed-length batch with checkpoints, which none serves, gets no rows."""
    ckpt = dict(variant("gdn_scan", bv, w, checkpoints=True) for bv, w in ((32, 4), (128, 8), (32, 16), (64, 16)))
    table = build_table(QWEN_SM90, {**qwen_sm90_variants(transposes=(False,)), **ckpt}, USES)
    plain, with_ckpt = config_rows(table, config()), config_rows(table, config(checkpoints=True))
    assert [(r["class"], scan_bv(r)) for r in with_ckpt] == [(r["class"], scan_bv(r)) for r in plain]
    assert all(r["kernels"]["gdn_prepare"] == p["kernels"]["gdn_prepare"] for r, p in zip(with_ckpt, plain))
    assert all(".checkpoints." in r["kernels"]["gdn_scan"] for r in with_ckpt)
    assert not any(".checkpoints." in r["kernels"]["gdn_scan"] for r in plain)
    assert config_rows(table, config(varlen=False, checkpoints=True)) == []


@pytest.fixture(scope="module")
def table_launcher(tmp_path_factory):
    """A launcher of all three families compiled with a synthetic table: qwen35's rules, fused for default."""
    prefs = {**QWEN_SM90, "gdn_fused": {"classes": ["default"]}}
    table = build_table(prefs, {**qwen_sm90_variants(fused=True), **functional_variants()}, USES)
    out = tmp_path_factory.mktemp("table_launcher")
    for name, text in launcher.render("sm_90a", list(KERNELS), table).items():
        (out / name).write_text(text)
    launcher.compile_so(out, out / launcher.LIBRARY)
    return table, Launcher(out / launcher.LIBRARY)


def test_c_select_answers_as_python(table_launcher):
    """gdn_aot_select, compiled from the same rows, picks the same row for every configuration and batch."""
    table, lib = table_launcher
    assert lib.lib.gdn_aot_dispatch_rows(None) == len(table)
    configs = [config(transpose=tr) for tr in (False, True)] + [
        config("fp16"), config(K=64, V=64), config(gating=True), config(state_dtype="bf16"),
        config(state_dtype="bf16", gating=True), config(checkpoints=True)]
    for c, sm_count in itertools.product(configs, SMS):
        for programs in range(0, 3 * sm_count, 7):
            want = select(table, c, programs, sm_count)
            got = lib.select(c, programs, sm_count)
            if want is None:
                assert got is None, (c, programs)
                continue
            assert got["shape_class"] == want["class"] and got["route"] == ROUTES[want["route"]].id
            assert [got[h] for h in ("prepare", "scan", "fused")] == [
                want["kernels"].get(k) for k in ("gdn_prepare", "gdn_scan", "gdn_fused")], (programs, sm_count)


def test_shipped_specs_route_sm90_configurations():
    """specs/qwen35.yaml: on sm_90a gdn_fused serves the configurations without gating (batch invariant), with
    gdn_fused_terms (BV 64; an fp32 or bf16 state, with or without checkpoints) ahead of it for the batches whose
    four programs a (sequence, head) all fit (num_seqs * HV * 4 <= SMs), computing gdn_fused's bits; gdn_prepare +
    gdn_scan serve the gating ones, and the non-gating sm_90a gdn_prepare is not built."""
    from gdn_aot.build.spec import load_spec

    qwen = load_spec("qwen35")
    fused = [v for v in qwen.variants if v.kernel == "gdn_fused"]
    assert {(v.arch, v.BV) for v in fused} == {("sm_90a", 64), ("sm_90a", 128)} and not any(v.gating for v in fused)
    terms = [v for v in qwen.variants if v.kernel == "gdn_fused_terms"]
    assert {(v.arch, v.BV, v.gating) for v in terms} == {("sm_90a", 64, False)}
    assert {(v.state_dtype, v.checkpoints) for v in terms} == {(d, c) for d in ("fp32", "bf16") for c in (False, True)}
    assert {fused_key.replace("gdn_fused.", "gdn_fused_terms.", 1) for fused_key in
            (v.key for v in fused if v.BV == 64)} == {v.key for v in terms}  # one terms variant a 64-row one
    assert not any(v.kernel == "gdn_prepare" and v.arch == "sm_90a" and not v.gating for v in qwen.variants)
    variants = {v.key: entry(v) for v in qwen.for_arch("sm_90a")}
    table = build_table(qwen.dispatch["sm_90a"], variants, USES)
    for state_dtype in ("fp32", "bf16"):
        for checkpoints in (False, True):
            c = config(state_dtype=state_dtype, checkpoints=checkpoints)
            assert [select(table, c, p, 132)["route"] for p in (1, 33, 34, 1024)] == [
                "fused_terms", "fused_terms", "fused", "fused"], (state_dtype, checkpoints)
    assert {r["route"] for r in config_rows(table, config(gating=True))} == {"prepare_scan"}


@pytest.mark.parametrize("sm_count", [78, 108, 114, 132, 148, 170])
def test_terms_row_takes_only_grids_one_program_an_sm_holds(sm_count):
    """The terms row's batches launch cooperatively: the launcher does so where the grid fits the kernel's resident
    programs (at least one an SM), so the row must take no batch whose grid (num_seqs * HV pairs of V / BV + 2
    programs) exceeds the SMs, on any SM count, and the next larger batch must not fit (the row takes all it can)."""
    from gdn_aot.build.spec import load_spec
    from gdn_aot.loader.abi import TERMS_PROGRAMS

    spec = load_spec("qwen35")
    variants = {v.key: entry(v) for v in spec.for_arch("sm_90a")}
    table = build_table(spec.dispatch["sm_90a"], variants, USES)
    terms = [r for r in table if r["class"] == "terms"]
    assert {(r["state_dtype"], r["checkpoints"], r["gating"]) for r in terms} == {
        (d, c, False) for d in ("fp32", "bf16") for c in (False, True)}
    for row in terms:
        per_pair = row["V"] // variants[row["kernels"]["gdn_fused_terms"]]["axes"]["BV"] + TERMS_PROGRAMS
        pairs = most_programs(row, sm_count)
        assert pairs * per_pair <= sm_count < (pairs + 1) * per_pair
