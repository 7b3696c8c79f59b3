"""Build specs: which variants of which kernels to compile, for which arches.

A spec is one YAML file, optionally laid over another. Schema (every key optional unless marked *):

    base: qwen35.yaml           # another spec this one changes: a path relative to this file's folder, or a
                                # shipped spec's name
    K: 128                      # * head dim of q/k (top level, or per kernel; per kernel wins)
    V: 128                      # * head dim of v   (same)
    arches: [sm_90a, sm_100a]   # * arches this spec targets (`--arch` picks a subset): sm_90a, sm_100a, sm_103a
    kernels:                    # * kernel name (see gdn_aot.kernels.KERNELS) -> axes
      gdn_scan:
        K: 128                  # overrides the top-level K for this kernel
        BT: [64]                # chunk length, powers of two           (default [64])
        BK: [128]               # K tile, must divide K                  (default [K])
        BV: [64, 128]           # V tile, must divide V                  (default [V])
        dtype: [bf16, fp16]     # * input dtype, bf16 | fp16
        varlen: [true, false]   # cu_seqlens-packed batch or fixed-length batch   (default [false])
        transpose: [false]      # state stored [V, K] instead of [K, V]           (default [false])
        state_dtype: [fp32, bf16]   # how h0 and ht are stored: fp32 | bf16 | fp16 | fp8e4m3 | fp8e5m2 (default [fp32])
        gating: [false, true]   # variants that compute g, beta from raw inputs on request (default [false])
        checkpoints: [false]    # variants that write the state every N tokens on request (default [false])
        launch:                 # per arch launch choices                (default num_warps [4], num_stages [1])
          sm_90a:  {num_warps: [4], num_stages: [1]}
          sm_100a: {num_warps: [4]}
        exclude:                # partial assignments removed from the cross product
          - {dtype: fp16, BV: 64}
          - {arch: sm_100a, transpose: true}
    dispatch:                   # per arch: the shape classes and variants of the dispatch table (loader/dispatch.py)
      sm_90a:
        gdn_scan: {default_BV: 128, small_batch_BV: 64, small_batch_factor: 2}
        gdn_fused: {above_factor: 0.25}   # gdn_fused above SMs / 4 programs, gdn_prepare + gdn_scan below

An axis value may be a list or a single scalar. Each kernel's variants are the cross product of its axes
(x arch x num_warps x num_stages) minus the exclusions. An axis the kernel's code does not depend on
(``KernelDef.uses_axes``) may be omitted and must not list more than one value, so that no two variants
compile to the same cubin. `dispatch` keys: ``default_BV`` (used when the caller names no BV),
``small_batch_BV`` (preferred when num_seqs * HV < small_batch_factor * SMs), ``small_batch_factor`` (a positive
number, default 2), ``single_wave_warps`` (the variants with this num_warps are preferred, ahead of the rest,
when one of them runs the batch in one wave of one program an SM: the smallest BV with
num_seqs * HV * V / BV <= SMs); the BVs named must be among the kernel's BV values, the num_warps among its
variants'. A kernel that is a route of its own (gdn_fused) takes ``above_factor`` (a number >= 0): it serves the
batches of more than above_factor * SMs programs, gdn_prepare + gdn_scan the rest; a configuration only it serves
needs none (and gets a single-wave row per built BV below its largest, loader/dispatch.py).
The build turns these into the dispatch table of the manifest and the launcher (loader/dispatch.py).
With ``base``, the spec is its base with this file laid over it: a mapping merges key by key, at every depth,
any other value (a list, a scalar) replaces the base's, and a null removes the base's key; the base may have a
base of its own. The spec's sha256 covers every file of the chain.
sm_103a is built from the sm_100a sources and, where it has no `launch`/`dispatch` entry of its own, takes
sm_100a's; exclusions naming sm_100a remove the matching sm_103a variants too (SECTIONS_FROM).

Every problem raises :class:`SpecError`, whose message names the file, the key path and the bad value.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from pathlib import Path
from typing import Any

import yaml

from ..kernels import KERNELS
from ..kernels.registry import ARCHES, DTYPES, STATE_DTYPES, Variant, arch_family
from ..loader.abi import FAMILIES, ROUTES
from ..loader.dispatch import DEFAULT_SMALL_BATCH_FACTOR, ROUTE_PREFERENCES, SCAN_PREFERENCES

AXES = ("K", "V", "BT", "BK", "BV", "dtype", "varlen", "transpose", "state_dtype", "gating", "checkpoints")
LIST_AXES = AXES[2:]
BOOL_AXES = ("varlen", "transpose", "gating", "checkpoints")
STR_AXES = ("dtype", "state_dtype")
LAUNCH_KEYS = ("num_warps", "num_stages")
EXCLUDE_KEYS = AXES + LAUNCH_KEYS + ("arch",)
TOP_KEYS = ("K", "V", "arches", "kernels", "dispatch")
KERNEL_KEYS = AXES + ("launch", "exclude")
DEFAULT_LAUNCH = {"num_warps": [4], "num_stages": [1]}
# CLI spellings of arches: `sm_90`, `sm_90a` and `90` all mean the arch-specific sm_90a target.
ARCH_ALIASES = {alias: a for a in ARCHES for alias in (a, a[:-1], a[3:-1])}
ARCH_CHOICES = ", ".join(a[:-1] for a in ARCHES)  # how help texts and errors spell them
# An arch built from another arch's sources takes that arch's spec sections where it has none of its own:
# launch.<arch> and dispatch.<arch>, and every exclusion naming the other arch applies to it too (the same code,
# so the same limits). A spec adding sm_103a (Blackwell Ultra) to its arches thus builds and dispatches it as
# sm_100a; `launch: {sm_103a: ...}`, `dispatch: {sm_103a: ...}` or `{arch: sm_103a, ...}` exclusions set it apart.
SECTIONS_FROM = {"sm_103a": "sm_100a"}


class SpecError(ValueError):
    """A spec file is invalid. The message names the file, the key path and the bad value."""

    def __init__(self, path, keypath: str, problem: str, value: Any = dataclasses.MISSING):
        self.path, self.keypath, self.problem, self.value = str(path), keypath, problem, value
        got = "" if value is dataclasses.MISSING else f" (got {value!r})"
        super().__init__(f"{path}: {keypath or '<top>'}: {problem}{got}")


@dataclasses.dataclass(frozen=True)
class Spec:
    path: str
    sha256: str
    arches: tuple[str, ...]
    variants: tuple[Variant, ...]  # every arch, spec order
    dispatch: dict  # arch -> kernel -> {default_BV, small_batch_BV, small_batch_factor, single_wave_warps}

    def for_arch(self, arch: str) -> list[Variant]:
        return [v for v in self.variants if v.arch == arch]

    @property
    def kernels(self) -> list[str]:
        return list(dict.fromkeys(v.kernel for v in self.variants))


def resolve_arches(requested: str | None, spec_arches: tuple[str, ...], path="<cli>") -> tuple[str, ...]:
    """`all`/None -> the spec's arches; `sm_90`/`sm_90a`/`90`/`sm_103`... -> that arch (must be in the spec)."""
    if requested in (None, "", "all"):
        return spec_arches
    out = []
    for word in str(requested).split(","):
        arch = ARCH_ALIASES.get(word.strip())
        if arch is None:
            raise SpecError(path, "--arch", f"unknown arch; use one of {ARCH_CHOICES}, all", word)
        if arch not in spec_arches:
            raise SpecError(path, "arches", f"{arch} was requested but the spec only targets {list(spec_arches)}")
        out.append(arch)
    return tuple(dict.fromkeys(out))


def find_spec_file(spec: str | Path) -> Path:
    """A path as given, else a file of that name among the shipped specs (gdn_aot/specs)."""
    p = Path(spec)
    if p.is_file():
        return p
    shipped = Path(__file__).resolve().parent.parent / "specs"
    for cand in (shipped / p.name, shipped / f"{p.name}.yaml"):
        if cand.is_file():
            return cand
    raise SpecError(spec, "", "no such spec file (nor a shipped spec of that name in gdn_aot/specs)")


def load_spec(path: str | Path) -> Spec:
    path = find_spec_file(path)
    doc, sha256 = _read_spec(path, ())
    return parse_spec(doc, path=str(path), sha256=sha256)


def _read_spec(path: Path, derived: tuple[Path, ...]) -> tuple[dict, str]:
    """The document of the spec file at `path` laid over its base's, and the sha256 of the chain's bytes
    (`derived`: the specs that named this one as their base, to refuse a cycle)."""
    raw = path.read_bytes()
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise SpecError(path, "", f"not valid YAML: {e}") from None
    if "base" not in _spec_mapping(doc, path):
        return doc, hashlib.sha256(raw).hexdigest()
    name = doc.pop("base")
    if not isinstance(name, str) or not name:
        raise SpecError(path, "base", "expected the path of another spec (relative to this file) or a shipped "
                                      "spec's name", name)
    beside = path.parent / name
    try:
        base = find_spec_file(beside)  # else the shipped spec of that file name
    except SpecError:
        raise SpecError(path, "base", f"no such spec file (looked for {beside} and a shipped spec of that name)",
                        name) from None
    chain = (*derived, path.resolve())
    if base.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, base.resolve()))
        raise SpecError(path, "base", f"the specs name each other as base (a cycle: {cycle})", name)
    base_doc, base_sha256 = _read_spec(base, chain)
    return _laid_over(base_doc, doc), hashlib.sha256(raw + base_sha256.encode()).hexdigest()


def _laid_over(base: dict, over: dict) -> dict:
    """`over` laid over `base` (load_spec's `base`): mappings merge, other values replace, null removes."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _laid_over(out[key], value)
        else:
            out[key] = value
    return out


def _spec_mapping(doc: Any, path) -> dict:
    """`doc`, which must be a mapping (a spec's document, or a base's, before it is laid under another)."""
    if not isinstance(doc, dict):
        raise SpecError(path, "", "a spec is a YAML mapping", doc)
    return doc


def parse_spec(doc: Any, path: str = "<spec>", sha256: str = "") -> Spec:
    P = _Parser(path)
    P.keys(_spec_mapping(doc, path), TOP_KEYS, "")
    arches = P.arch_list(P.required(doc, "arches", ""), "arches")
    kernels = P.required(doc, "kernels", "")
    if not isinstance(kernels, dict) or not kernels:
        raise SpecError(path, "kernels", "expected a non-empty mapping of kernel name -> axes", kernels)
    variants: list[Variant] = []
    axis_values: dict[str, dict] = {}
    for name, body in kernels.items():
        axis_values[name], produced = _kernel_variants(P, doc, name, body, arches)
        variants += produced
    keys = [v.key for v in variants]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise SpecError(path, "kernels", "two entries produce the same variant", sorted(dup)[0])
    dispatch = P.dispatch(doc.get("dispatch"), arches, axis_values, variants)
    return Spec(path=str(path), sha256=sha256, arches=arches, variants=tuple(variants), dispatch=dispatch)


def _kernel_variants(P: "_Parser", doc: dict, name: str, body, arches) -> tuple[dict, list[Variant]]:
    """One `kernels.<name>` entry: its axis values and its variants (the cross product minus the exclusions)."""
    kp = f"kernels.{name}"
    if name not in KERNELS:
        raise P.err(kp, f"unknown kernel; known kernels: {sorted(KERNELS)}", name)
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise P.err(kp, "expected a mapping of axes", body)
    kd = KERNELS[name]
    P.keys(body, KERNEL_KEYS, kp)
    K = P.int(body.get("K", doc.get("K")), f"{kp}.K" if "K" in body else "K", positive=True)
    V = P.int(body.get("V", doc.get("V")), f"{kp}.V" if "V" in body else "V", positive=True)
    ax = P.axes(body, kp, K, V)
    for axis, vals in ax.items():
        if axis not in kd.uses_axes and len(vals) > 1:
            raise P.err(f"{kp}.{axis}", f"{name} does not use axis {axis} (uses {sorted(kd.uses_axes)}), so it may "
                        "hold one value only", vals)
    launch = P.launch(body.get("launch"), f"{kp}.launch", arches)
    excludes = P.excludes(body.get("exclude"), f"{kp}.exclude")
    variants = []
    for arch in arches:
        for values in itertools.product(*(ax[a] for a in LIST_AXES), launch[arch]["num_warps"],
                                        launch[arch]["num_stages"]):
            point = dict(zip(LIST_AXES + LAUNCH_KEYS, values))
            v = Variant(kernel=name, arch=arch, K=K, V=V, **point)
            if not any(_excluded(v.as_dict(), ex) for ex in excludes):
                variants.append(v)
    if not variants:
        raise P.err(kp, "the cross product minus the exclusions is empty", body.get("exclude"))
    for arch in dict.fromkeys(v.arch for v in variants):
        if arch_family(arch) not in kd.sources:
            raise P.err(kp, f"kernel has no source for {arch} (KernelDef.sources has {sorted(kd.sources)}); drop "
                        f"the arch, exclude it ({{arch: {arch}}}) or drop the kernel", arch)
    return ax, variants


def _excluded(point: dict, exclusion: dict) -> bool:
    """The exclusion matches the variant's point; its `arch` also names the arches taking that arch's sections."""
    return all(point[k] == x or (k == "arch" and SECTIONS_FROM.get(point[k]) == x) for k, x in exclusion.items())


class _Parser:
    def __init__(self, path):
        self.path = path

    def err(self, keypath, problem, value=dataclasses.MISSING):
        return SpecError(self.path, keypath, problem, value)

    def keys(self, d: dict, allowed, kp):
        for k in d:
            if k not in allowed:
                raise self.err(f"{kp}.{k}" if kp else str(k), f"unknown key; allowed: {list(allowed)}", k)

    def required(self, d: dict, key, kp):
        if key not in d or d[key] is None:
            raise self.err(f"{kp}.{key}" if kp else key, "required key is missing")
        return d[key]

    def int(self, value, kp, positive=False):
        if value is None:
            raise self.err(kp, "required key is missing (top level or per kernel)")
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.err(kp, "expected an integer", value)
        if positive and value <= 0:
            raise self.err(kp, "expected a positive integer", value)
        return value

    def _factor(self, x, kp, zero_ok=False):
        """A fraction of the SMs (a dispatch bound): a number, not a bool; positive, or >= 0 with zero_ok."""
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (x >= 0 if zero_ok else x > 0):
            raise self.err(kp, "expected a number >= 0" if zero_ok else "expected a positive number", x)
        return x

    def _typed(self, x, ty, kp):
        ok = isinstance(x, bool) if ty is bool else (isinstance(x, ty) and not isinstance(x, bool))
        if not ok:
            raise self.err(kp, f"expected {ty.__name__} values", x)
        return x

    def values(self, body, axis, kp, ty, default):
        kp = f"{kp}.{axis}"
        if axis not in body or body[axis] is None:
            if default is None:
                raise self.err(kp, "required axis is missing")
            return list(default)
        raw = body[axis]
        vals = raw if isinstance(raw, list) else [raw]
        if not vals:
            raise self.err(kp, "an axis needs at least one value", raw)
        vals = [self._typed(x, ty, kp) for x in vals]
        if len(set(vals)) != len(vals):
            raise self.err(kp, "repeated value", raw)
        return vals

    def axes(self, body, kp, K, V) -> dict:
        """The tiling and configuration axes of a kernel entry, defaulted and checked."""
        ax = {
            "BT": self.values(body, "BT", kp, int, [64]),
            "BK": self.values(body, "BK", kp, int, [K]),
            "BV": self.values(body, "BV", kp, int, [V]),
            "dtype": self.values(body, "dtype", kp, str, None),
            "varlen": self.values(body, "varlen", kp, bool, [False]),
            "transpose": self.values(body, "transpose", kp, bool, [False]),
            "state_dtype": self.values(body, "state_dtype", kp, str, ["fp32"]),
            "gating": self.values(body, "gating", kp, bool, [False]),
            "checkpoints": self.values(body, "checkpoints", kp, bool, [False]),
        }
        for bt in ax["BT"]:
            if bt <= 0 or bt & (bt - 1):
                raise self.err(f"{kp}.BT", "BT must be a power of two", bt)
        for axis, dim, dname in (("BK", K, "K"), ("BV", V, "V")):
            for b in ax[axis]:
                if b <= 0 or dim % b:
                    raise self.err(f"{kp}.{axis}", f"{axis} must divide {dname}={dim}", b)
        for d in ax["dtype"]:
            if d not in DTYPES:
                raise self.err(f"{kp}.dtype", f"dtype must be one of {list(DTYPES)}", d)
        for d in ax["state_dtype"]:
            if d not in STATE_DTYPES:
                raise self.err(f"{kp}.state_dtype", f"state_dtype must be one of {list(STATE_DTYPES)}", d)
        return ax

    def arch_list(self, raw, kp):
        vals = raw if isinstance(raw, list) else [raw]
        if not vals:
            raise self.err(kp, "at least one arch is needed", raw)
        for a in vals:
            if a not in ARCHES:
                raise self.err(kp, f"unknown arch; known: {list(ARCHES)}", a)
        return tuple(dict.fromkeys(vals))

    def launch(self, raw, kp, arches):
        out = {a: dict(DEFAULT_LAUNCH) for a in arches}
        if raw is None:
            return out
        if not isinstance(raw, dict):
            raise self.err(kp, "expected a mapping arch -> {num_warps, num_stages}", raw)
        for arch, choice in raw.items():
            if arch not in ARCHES:
                raise self.err(f"{kp}.{arch}", f"unknown arch; known: {list(ARCHES)}", arch)
            if not isinstance(choice, dict):
                raise self.err(f"{kp}.{arch}", "expected a mapping {num_warps: [..], num_stages: [..]}", choice)
            self.keys(choice, LAUNCH_KEYS, f"{kp}.{arch}")
            if arch not in out:  # launch choices for an arch the spec does not target: validated, unused
                out[arch] = dict(DEFAULT_LAUNCH)
            for key in LAUNCH_KEYS:
                if key in choice:
                    vals = self.values(choice, key, f"{kp}.{arch}", int, None)
                    for n in vals:
                        if key == "num_warps" and (n <= 0 or n & (n - 1) or n > 32):
                            raise self.err(f"{kp}.{arch}.num_warps", "num_warps must be a power of two <= 32", n)
                        if key == "num_stages" and n < 1:
                            raise self.err(f"{kp}.{arch}.num_stages", "num_stages must be >= 1", n)
                    out[arch][key] = vals
        for arch in arches:
            if arch not in raw and SECTIONS_FROM.get(arch) in raw:
                out[arch] = out[SECTIONS_FROM[arch]]
        return out

    def excludes(self, raw, kp):
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise self.err(kp, "expected a list of partial axis mappings", raw)
        out = []
        for i, ex in enumerate(raw):
            ekp = f"{kp}[{i}]"
            if not isinstance(ex, dict) or not ex:
                raise self.err(ekp, "expected a non-empty mapping such as {dtype: fp16, BV: 64}", ex)
            self.keys(ex, EXCLUDE_KEYS, ekp)
            for k, x in ex.items():
                ty = str if k in STR_AXES + ("arch",) else bool if k in BOOL_AXES else int
                self._typed(x, ty, f"{ekp}.{k}")
            out.append(dict(ex))
        return out

    def dispatch(self, raw, arches, axis_values, variants):
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise self.err("dispatch", "expected a mapping arch -> kernel -> preferences", raw)
        for arch, per_kernel in raw.items():
            if arch not in arches and arch not in {SECTIONS_FROM.get(a) for a in arches}:
                raise self.err(f"dispatch.{arch}", f"arch not among the spec's arches {list(arches)}", arch)
            if not isinstance(per_kernel, dict):
                raise self.err(f"dispatch.{arch}", "expected a mapping kernel -> preferences", per_kernel)
        out: dict = {}
        for arch in arches:
            source = arch if arch in raw else SECTIONS_FROM.get(arch)
            if source not in raw:
                continue
            kp = f"dispatch.{source}" + ("" if source == arch else f" (taken by {arch})")
            out[arch] = {kname: self.preferences(f"{kp}.{kname}", kname, prefs, axis_values,
                                                 [v for v in variants if v.kernel == kname and v.arch == arch])
                         for kname, prefs in raw[source].items()}
        return out

    def preferences(self, kp, kname, prefs, axis_values, built):
        """One kernel's dispatch preferences: above how many programs an SM a route kernel (gdn_fused) serves, or
        gdn_scan-style BV preferences (loader/dispatch.py reads them)."""
        if kname not in axis_values:
            raise self.err(kp, f"kernel not in this spec's kernels {sorted(axis_values)}", kname)
        own_route = kname in FAMILIES and ROUTES[FAMILIES[kname].route].families == (kname,)
        allowed = ROUTE_PREFERENCES if own_route else SCAN_PREFERENCES
        if not isinstance(prefs, dict):
            raise self.err(kp, f"expected a mapping with keys {list(allowed)}", prefs)
        self.keys(prefs, allowed, kp)
        if allowed is ROUTE_PREFERENCES:
            return {"above_factor": self._factor(prefs.get("above_factor"), f"{kp}.above_factor", zero_ok=True)}
        for key, x in prefs.items():
            if key == "small_batch_factor":
                self._factor(x, f"{kp}.{key}")
                continue
            self._typed(x, int, f"{kp}.{key}")
            if key == "single_wave_warps" and x not in {v.num_warps for v in built}:
                raise self.err(f"{kp}.{key}", f"no {kname} variant of the arch has this num_warps (built: "
                               f"{sorted({v.num_warps for v in built})})", x)
            if key.endswith("_BV") and x not in axis_values[kname]["BV"]:
                raise self.err(f"{kp}.{key}", f"BV not among {kname}'s BV values {axis_values[kname]['BV']}", x)
        return {"small_batch_factor": DEFAULT_SMALL_BATCH_FACTOR, **prefs}
