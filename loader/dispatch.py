"""The dispatch decision, as data: which route and variants serve which shape class.

The build turns a spec's `dispatch:` preferences and the variants that compiled into a table (build_table); the
table goes into the manifest (`dispatch.table`) and, compiled from the same rows, into the C launcher
(gdn_aot_select), so the Python API, C and C++ callers make the same choice. A shape class is decided from
host-known numbers only: the configuration (CONFIG_AXES) and the batch's num_seqs * HV
programs against the device's SM count (never cu_seqlens' values, so no device-to-host copy).

Rows are tried in order; the first whose configuration matches and whose bound holds serves the batch:
  bound "le": programs * den <= sm_count * num    bound "lt": programs * den < sm_count * num    "any": always
For each configuration the rows are the shape classes of the two-kernel route (gdn_prepare + gdn_scan):
  single_wave  (spec: single_wave_warps) one row per built BV of the gdn_scan variants with that num_warps,
               smallest BV first, bound "le" 1 / (V / BV): the batch fits one wave of one program an SM;
  small_batch  (spec: small_batch_BV) bound "lt" small_batch_factor: few programs, a finer V split;
  default      no bound: default_BV (or the largest built BV);
less any row an earlier one covers on every SM count (specs/qwen35.yaml's sm_90a small_batch, factor 1/2, where
the BV 64 single-wave row, le 1/2, exists), which would never serve a batch.
gdn_fused's own classes, for a configuration it serves alone (no two-kernel variants, or `above_factor: 0`): a
single_wave row per built BV below the largest, smallest first, bound "le" 1 / (V / BV) (its programs at that V
tile fit one wave: 64-row programs walk a chunk faster than 128-row ones, and compute the same bits), then default
at the largest BV. Where gdn_fused_terms is built for the configuration, its row comes first: "terms", bound "le"
1 / (V / BV + TERMS_PROGRAMS), the batches whose state and terms programs all fit one wave (each (sequence,
head)'s chunk terms computed once, by its terms programs, rather than by both 64-row programs: gdn_fused's bits,
so the choice keeps a configuration batch invariant; the GPU invariance tests check it).
A spec mixes the routes with `gdn_fused: {above_factor: f}`: the two-kernel rows serve batches of up to f * SMs
programs (the row reaching past that bound cut to "le" f), gdn_fused's rows the rest.
Pure Python: the build imports it without the runtime, the runtime without the build.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

from .abi import BOUNDS, FAMILIES, ROUTES, z_programs

SHAPE_CLASSES = ("terms", "single_wave", "small_batch", "default")
SCAN_PREFERENCES = ("default_BV", "small_batch_BV", "small_batch_factor", "single_wave_warps")
ROUTE_PREFERENCES = ("above_factor",)  # for a kernel whose family is a route of its own (gdn_fused)
# a forward's configuration: what it needs of the variants (the functional axes); the rest are tuning choices
CONFIG_AXES = ("dtype", "K", "V", "varlen", "transpose", "state_dtype", "gating", "checkpoints")
DEFAULT_SMALL_BATCH_FACTOR = 2
_INF = float("inf")


def matching(variants: dict, kernel: str, want: dict, num_warps: int | None = None) -> list[str]:
    """Keys of the built variants of `kernel` whose axes equal `want`'s (None matches anything) and, unless None,
    whose num_warps is `num_warps`."""
    return [key for key, e in variants.items()
            if e["kernel"] == kernel and all(x is None or e["axes"][a] == x for a, x in want.items())
            and (num_warps is None or e["num_warps"] == num_warps)]


def pick(variants: dict, kernel: str, want: dict, BV: int | None = None, num_warps: int | None = None,
         default_BV: int | None = None) -> str | None:
    """The key of the built variant for these axes: BV if built, else default_BV, else the largest built BV;
    among variants of one BV the fewest warps, then the smallest key. None when nothing matches."""
    by_bv: dict[int, str] = {}
    for key in sorted(matching(variants, kernel, want, num_warps), key=lambda c: (variants[c]["num_warps"], c)):
        by_bv.setdefault(variants[key]["axes"]["BV"], key)
    if not by_bv:
        return None
    return by_bv.get(BV) or by_bv.get(default_BV) or by_bv[max(by_bv)]


def _want(kernel: str, config: dict, uses: dict) -> dict:
    """The config's axes the kernel's code depends on (an axis it ignores holds one default value)."""
    return {a: x for a, x in config.items() if a in uses.get(kernel, CONFIG_AXES)}


def _row(config: dict, shape_class: str, bound: str, limit: Fraction, route: str, kernels: dict) -> dict:
    return {**config, "class": shape_class, "bound": bound, "num": limit.numerator, "den": limit.denominator,
            "route": route, "kernels": kernels}


def _two_kernel_rows(config: dict, prefs: dict, variants: dict, uses: dict) -> list[tuple]:
    """(class, bound, limit, {kernel: key}) of the gdn_prepare + gdn_scan route, or [] where either is missing."""
    prepare = pick(variants, "gdn_prepare", _want("gdn_prepare", config, uses))
    if prepare is None:
        return []
    want = {**_want("gdn_scan", config, uses), "BT": variants[prepare]["axes"]["BT"]}  # one chunk length for both
    if not matching(variants, "gdn_scan", want):
        return []
    scan = {"default_BV": None, **prefs.get("gdn_scan", {})}

    def kernels(key):
        return {"gdn_prepare": prepare, "gdn_scan": key}

    rows = []
    warps = scan.get("single_wave_warps")
    if warps is not None:
        bvs = sorted({variants[k]["axes"]["BV"] for k in matching(variants, "gdn_scan", want, warps)})
        for bv in bvs:
            key = pick(variants, "gdn_scan", want, BV=bv, num_warps=warps)
            rows.append(("single_wave", "le", Fraction(bv, config["V"]), kernels(key)))
    if "small_batch_BV" in scan:
        key = pick(variants, "gdn_scan", want, BV=scan["small_batch_BV"], default_BV=scan["default_BV"])
        factor = Fraction(str(scan.get("small_batch_factor", DEFAULT_SMALL_BATCH_FACTOR)))
        rows.append(("small_batch", "lt", factor, kernels(key)))
    key = pick(variants, "gdn_scan", want, BV=scan["default_BV"], default_BV=scan["default_BV"])
    rows.append(("default", "any", Fraction(0), kernels(key)))
    return _uncovered(rows)


def _uncovered(rows: list[tuple]) -> list[tuple]:
    """The rows less any that an earlier one covers on every SM count (rows are tried in order)."""
    return [r for i, r in enumerate(rows) if not any(_covers(e, r) for e in rows[:i])]


def _covers(earlier: tuple, row: tuple) -> bool:
    """Whether an earlier row takes every batch `row` would on every SM count, so that `row` never serves one
    (rows are tried in order). With bounds le f: programs <= floor(sms f), lt f: programs <= ceil(sms f) - 1."""
    (_, e_bound, e_limit, _), (_, bound, limit, _) = earlier, row
    if e_bound == "any" or bound == "any":
        return e_bound == "any"
    if bound == "le" and e_bound == "lt":  # floor(s f) <= ceil(s g) - 1 for every s only when f < g
        return limit < e_limit
    return limit <= e_limit


def _up_to(rows: list[tuple], limit: Fraction) -> list[tuple]:
    """The rows as they serve batches of up to limit * SMs programs: the first row reaching past that bound is
    cut to "le" limit and ends the list (limit 0: none)."""
    out = []
    for row in rows if limit > 0 else ():
        if not _covers(("", "le", limit, {}), row):
            return out + [(row[0], "le", limit, row[3])]
        out.append(row)
    return out


def _fused_rows(config: dict, variants: dict, want: dict) -> list[tuple]:
    """(class, bound, limit, {kernel: key}) of a configuration gdn_fused serves alone (module docstring)."""
    bvs = sorted({variants[k]["axes"]["BV"] for k in matching(variants, "gdn_fused", want)})

    def kernels(bv):
        return {"gdn_fused": pick(variants, "gdn_fused", want, BV=bv)}

    terms = pick(variants, "gdn_fused_terms", want)
    first = []
    if terms is not None:
        programs = z_programs(FAMILIES["gdn_fused_terms"].grid[2], config["V"], variants[terms]["axes"]["BV"])
        first = [("terms", "le", Fraction(1, programs), {"gdn_fused_terms": terms})]
    return (first + [("single_wave", "le", Fraction(bv, config["V"]), kernels(bv)) for bv in bvs[:-1]]
            + [("default", "any", Fraction(0), kernels(bvs[-1]))])


def build_table(prefs: dict, variants: dict, uses: dict) -> list[dict]:
    """The dispatch table of one arch: `prefs` is the spec's `dispatch.<arch>` section, `variants` the built
    variants (manifest entries by key), `uses` each kernel's uses_axes."""
    # every combination of the built axis values; one no route serves gets no rows (a route's kernels may take
    # their axes from different variants: gdn_prepare the gating, gdn_scan the state dtype)
    axis_values = [sorted({e["axes"][a] for e in variants.values()}, key=repr) for a in CONFIG_AXES]
    above = prefs.get("gdn_fused", {}).get("above_factor")
    table = []
    for values in itertools.product(*axis_values):
        config = dict(zip(CONFIG_AXES, values))
        rows = _two_kernel_rows(config, prefs, variants, uses)
        fused_want = _want("gdn_fused", config, uses)
        if matching(variants, "gdn_fused", fused_want) and (not rows or above is not None):
            rows = _uncovered(_up_to(rows, Fraction(str(above or 0))) + _fused_rows(config, variants, fused_want))
        for shape_class, bound, limit, kernels in rows:
            route = FAMILIES[next(iter(kernels))].route
            table.append(_row(config, shape_class, bound, limit, route, kernels))
    return table


def most_programs(row: dict, sm_count: int) -> float:
    """The largest num_seqs * HV the row takes on a device of sm_count SMs (inf: any)."""
    bound, num, den = row["bound"], row["num"], row["den"]
    if bound == "any":
        return _INF
    if bound == "le":  # programs * den <= sm_count * num
        return sm_count * num // den
    return (sm_count * num - 1) // den  # programs * den < sm_count * num


def config_rows(table: list[dict], config: tuple) -> list[dict]:
    """The table's rows of one configuration (values in CONFIG_AXES order), in order."""
    return [r for r in table if all(r[a] == x for a, x in zip(CONFIG_AXES, config))]


def select(table: list[dict], config: tuple, programs: int, sm_count: int) -> dict | None:
    """The row serving a batch (what gdn_aot_select returns in C), or None when no row matches."""
    for r in config_rows(table, config):
        if programs <= most_programs(r, sm_count):
            return r
    return None


def c_rows(table: list[dict]) -> list[dict]:
    """The table as the launcher's C initialisers need it (gdn_aot_dispatch_row_t)."""
    handles = {f.name: f.handle for f in FAMILIES.values()}
    out = []
    for r in table:
        keys = {handles[k]: key for k, key in r["kernels"].items()}
        out.append({"dtype": r["dtype"], "K": r["K"], "V": r["V"], "varlen": int(r["varlen"]),
                    "transpose": int(r["transpose"]), "state_dtype": r["state_dtype"], "gating": int(r["gating"]),
                    "checkpoints": int(r["checkpoints"]), "bound": BOUNDS[r["bound"]], "num": r["num"], "den": r["den"],
                    "route": ROUTES[r["route"]].id, "keys": [keys.get(f.handle) for f in FAMILIES.values()],
                    "shape_class": r["class"]})
    return out
