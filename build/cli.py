"""`gdn-aot`: build, list, verify and inspect ahead-of-time compiled GDN kernels."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from .. import __version__
from .manifest import MANIFEST, TSV, tsv
from .spec import ARCH_CHOICES
from ..loader.artifacts import Manifest, available_arches, sha256_file
from ..loader.dispatch import SHAPE_CLASSES
from ..loader.errors import GdnAotError

EPILOG_BUILD = """\b
Examples:
  gdn-aot build specs/qwen35.yaml                     # every arch of the spec into ./artifacts
  gdn-aot build specs/qwen35.yaml --arch sm_103       # Blackwell Ultra (B300) only
  gdn-aot build specs/qwen35.yaml --arch sm_90 -j 8   # Hopper only, 8 parallel compiles
  gdn-aot build tiny --out /tmp/a --json              # a shipped spec by name, machine-readable report
A second run recompiles only variants whose inputs changed (kernel sources, spec, triton/ptxas, build code).
Exit status 1 names the variants that failed; their logs are under OUT/<arch>/logs/."""


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "-V", "--version", prog_name="gdn-aot")
def main():
    """Ahead-of-time build of the Gated DeltaNet prefill kernels (Gluon -> cubin + C launcher).

    \b
    Examples:
      gdn-aot build specs/qwen35.yaml --arch sm_90       # compile (needs triton: pip install 'gdn-aot[build]')
      gdn-aot list artifacts                             # what was built, registers, spills
      gdn-aot verify artifacts                           # re-hash everything against the manifests
      gdn-aot inspect artifacts gdn_scan.sm_90a.bf16     # metadata, launcher signature, SASS summary
      gdn-aot package artifacts --into /opt/gdn-aot      # runtime-only copy for deployment
    Every command takes --json for machine-readable output. docs/deploy.md: shipping artifacts.
    """


def _fail(msg: str, code: int = 1):
    click.secho(msg, fg="red", err=True)
    sys.exit(code)


@main.command(epilog=EPILOG_BUILD)
@click.argument("spec")
@click.option("--arch", default="all", show_default=True, help=f"{ARCH_CHOICES} or all (the spec's arches)")
@click.option("--out", default="artifacts", show_default=True, type=click.Path(file_okay=False),
              help="output directory (one subdirectory per arch)")
@click.option("-j", "--jobs", type=int, default=None, help="parallel compiles [default: CPU count]")
@click.option("--json", "as_json", is_flag=True, help="print the build report as JSON on stdout")
def build(spec, arch, out, jobs, as_json):
    """Compile every variant of SPEC (a YAML file, or the name of a shipped spec)."""
    from . import compile as compile_mod
    from .spec import SpecError, load_spec, resolve_arches
    from .launcher import LauncherError
    from .toolchain import ToolchainError

    try:
        s = load_spec(spec)
        arches = resolve_arches(arch, s.arches, s.path)
    except SpecError as e:
        _fail(f"spec error: {e}", 2)
    jobs = jobs or os.cpu_count() or 1
    total = sum(len(s.for_arch(a)) for a in arches)
    try:
        if as_json or not sys.stderr.isatty():
            report = compile_mod.build(s, arches, Path(out), jobs)
        else:
            with click.progressbar(length=total, label=f"building {total} variants (-j {jobs})", file=sys.stderr,
                                   item_show_func=lambda r: r and f"{r.status:8} {r.key}",
                                   show_pos=True) as bar:
                report = compile_mod.build(s, arches, Path(out), jobs, on_result=lambda r: bar.update(1, r))
    except (ToolchainError, LauncherError) as e:
        _fail(str(e), 2)
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=1))
    else:
        for r in report.results:
            if r.status == "compiled":
                click.echo(f"  {click.style('compiled', fg='green')}  {r.key}  {r.seconds:.1f} s")
        for r in report.failed:
            click.echo(f"  {click.style('FAILED', fg='red', bold=True)}    {r.key}: {r.error}\n"
                       f"            log: {Path(out) / r.log if r.log.endswith('.log') else r.log}")
        j = report.as_json()
        line = (f"{j['compiled']} compiled, {j['up_to_date']} up to date, {j['failed']} failed in "
                f"{j['wall_s']:.1f} s (compile time {j['compile_s']:.1f} s, -j {jobs}); "
                f"launcher {'rebuilt' if j['launchers_compiled'] else 'up to date'}; artifacts in {out}")
        click.secho(line, fg="red" if report.failed else "green")
    if report.failed:
        if not as_json:
            click.secho("failed variants: " + ", ".join(r.key for r in report.failed), fg="red", err=True)
        sys.exit(1)


def _manifests(root: Path) -> list[Manifest]:
    root = Path(root)
    if not root.is_dir() or not available_arches(root):
        _fail(f"{root}: no <arch>/{MANIFEST} here (build with `gdn-aot build SPEC --out {root}`)", 2)
    try:
        return [Manifest(root, a) for a in available_arches(root)]
    except GdnAotError as e:
        _fail(str(e))


def _classes(manifest) -> dict[str, list[str]]:
    """key -> the shape classes of the dispatch table's rows that take the variant (in class order)."""
    taken: dict[str, set] = {}
    for row in manifest.dispatch.get("table", []):
        for key in row["kernels"].values():
            taken.setdefault(key, set()).add(row["class"])
    return {key: [c for c in SHAPE_CLASSES if c in cs] for key, cs in taken.items()}


def _rows(manifests) -> list[dict]:
    rows = []
    for m in manifests:
        classes = _classes(m)
        for key, e in m.variants.items():
            a, res = e["axes"], e.get("resources", {})
            rows.append({"arch": m.arch, "kernel": e["kernel"], "BT": a["BT"], "BK": a["BK"], "BV": a["BV"],
                         "dtype": a["dtype"], "varlen": a["varlen"], "transpose": a["transpose"],
                         "state_dtype": a["state_dtype"], "gating": a["gating"], "checkpoints": a["checkpoints"],
                         "warps": e["num_warps"], "shared": e["shared"], "regs": res.get("registers"),
                         "spills": res.get("spill_stores", 0) + res.get("spill_loads", 0),
                         "cubin_bytes": e["cubin"]["size"], "classes": classes.get(key, []), "key": key,
                         "status": "ok"})
        for key, log in m.failed.items():
            rows.append({"arch": m.arch, "key": key, "kernel": key.split(".")[0], "status": "failed",
                         "log": str(m.dir / log)})
    return rows


def _options(row: dict) -> str:
    """A variant's functional options in a word: gate (gating), ckpt (checkpoints), - (neither)."""
    return ",".join(w for w, on in (("gate", row["gating"]), ("ckpt", row["checkpoints"])) if on) or "-"


@main.command("list")
@click.argument("dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="rows as JSON")
def list_cmd(dir, as_json):
    """Table of the variants built in DIR (and those that failed).

    \b
    Example: gdn-aot list artifacts"""
    rows = _rows(_manifests(Path(dir)))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    head = f"{'arch':8} {'kernel':12} {'BT/BK/BV':12} {'dtype':5} {'varlen':6} {'transp':6} {'state':7} " \
           f"{'options':8} {'warps':5} {'shared':>7} {'regs/spills':>11} {'cubin':>8}  dispatch classes"
    click.secho(head, bold=True)
    for r in rows:
        if r["status"] == "failed":
            click.secho(f"{r['arch']:8} {r['kernel']:12} FAILED  {r['key']}  (log: {r['log']})", fg="red")
            continue
        spill = click.style(f"{r['regs']}/{r['spills']}".rjust(11), fg="red" if r["spills"] else None)
        click.echo(f"{r['arch']:8} {click.style(r['kernel'].ljust(12), fg='cyan')} "
                   f"{r['BT']}/{r['BK']}/{r['BV']:<6} {r['dtype']:5} {str(r['varlen']):6} {str(r['transpose']):6} "
                   f"{r['state_dtype']:7} {_options(r):8} {r['warps']:5} {r['shared']:7} {spill} {r['cubin_bytes']:8}  "
                   f"{','.join(r['classes']) or '-'}")
    ok = [r for r in rows if r["status"] == "ok"]
    failed = len(rows) - len(ok)
    per_arch = ", ".join(f"{a}: {sum(r['arch'] == a for r in ok)}" for a in dict.fromkeys(r["arch"] for r in rows))
    spilling = sum(bool(r["spills"]) for r in ok)
    unused = sum(not r["classes"] for r in ok)
    click.secho(f"{len(ok)} variants built ({per_arch}), {failed} failed, {spilling} spilling, {unused} taken by no "
                "dispatch row",
                fg="red" if failed else ("yellow" if spilling else "green"))


def verify_dir(root: Path) -> list[str]:
    """Problems found in the artifacts under root (empty = all good). PTX is checked where it was shipped: a
    runtime-only copy (`gdn-aot package` without --with-ptx) has no ptx/ directory at all."""
    problems = []
    for m in _manifests(root):
        kinds = ("cubin", "ptx") if (m.dir / "ptx").is_dir() else ("cubin",)
        for key, e in m.variants.items():
            for kind in kinds:
                p = m.dir / e[kind]["path"]
                if not p.is_file():
                    problems.append(f"{m.arch}: {key}: {kind} {p} is missing")
                elif sha256_file(p) != e[kind]["sha256"] or (kind == "cubin" and p.stat().st_size != e[kind]["size"]):
                    problems.append(f"{m.arch}: {key}: {kind} {p} does not match its sha256 {e[kind]['sha256']}")
        for name, digest in m.data["launcher"]["files"].items():
            p = m.dir / "launcher" / name
            if not p.is_file() or sha256_file(p) != digest:
                problems.append(f"{m.arch}: launcher file {p} is missing or does not match its sha256")
        t = m.dir / TSV
        if not t.is_file() or t.read_bytes() != tsv(m.variants):
            problems.append(f"{m.arch}: {t} is missing or does not match the manifest")
    return problems


@main.command()
@click.argument("dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print {ok, problems, variants, arches} as JSON")
def verify(dir, as_json):
    """Re-hash every cubin and launcher file of DIR against its manifest; exit 1 naming any mismatch.

    \b
    Examples:
      gdn-aot verify artifacts
      gdn-aot verify /opt/gdn-aot/artifacts --json"""
    problems = verify_dir(Path(dir))
    manifests = _manifests(Path(dir))
    n = sum(len(m.variants) for m in manifests)
    if as_json:
        click.echo(json.dumps({"ok": not problems, "problems": problems, "variants": n,
                               "arches": [m.arch for m in manifests]}, indent=1))
    elif problems:
        for p in problems:
            click.secho(f"MISMATCH {p}", fg="red", err=True)
        click.secho(f"{len(problems)} problem(s) in {dir}; rebuild with {manifests[0].build_command()}", fg="red",
                    err=True)
    else:
        click.secho(f"OK: {n} variants, {len(manifests)} arch(es) verified in {dir}", fg="green")
    if problems:
        sys.exit(1)


def _find(manifests, pattern: str):
    exact = [(m, k) for m in manifests for k in m.variants if k == pattern]
    if exact:
        return exact
    return [(m, k) for m in manifests for k in m.variants if pattern in k]


@main.command()
@click.argument("dir", type=click.Path(exists=True, file_okay=False))
@click.argument("keys", nargs=-1, required=True)
@click.option("--sass", "dump_sass", is_flag=True, help="also print the full disassembly (nvdisasm -c)")
@click.option("--json", "as_json", is_flag=True, help="the manifest entries (+ launcher signature) as JSON")
def inspect(dir, keys, dump_sass, as_json):
    """Metadata, launcher parameter list and SASS summary of the variants KEYS (a key or a substring of keys).

    \b
    Examples:
      gdn-aot inspect artifacts gdn_scan.sm_90a.bf16.k128v128.bt64bk128bv128.varlen.kv.w4s1
      gdn-aot inspect artifacts gdn_prepare.sm_100a --sass"""
    manifests = _manifests(Path(dir))
    bad = False
    found = []
    for pattern in keys:
        hits = _find(manifests, pattern)
        if not hits:
            click.secho(f"no variant matches {pattern!r}; built: {[k for m in manifests for k in m.variants]}",
                        fg="red", err=True)
            bad = True
            continue
        for m, key in hits:
            e = m.variants[key]
            if as_json:
                fam = m.data["kernels"][e["kernel"]]
                found.append({**e, "arch": m.arch, "cubin_file": str(m.dir / e["cubin"]["path"]),
                              "launch_function": fam["launch_function"], "launcher_params": fam["params"]})
                continue
            click.secho(key, bold=True, fg="cyan")
            for f in ("kernel", "entry", "num_warps", "num_stages", "shared", "global_scratch_size",
                      "global_scratch_align", "profile_scratch_size", "tmem_size", "grid", "input_hash"):
                click.echo(f"  {f:22} {e.get(f)}")
            click.echo(f"  {'cubin':22} {m.dir / e['cubin']['path']} ({e['cubin']['size']} bytes)")
            click.echo(f"  {'resources':22} " + " ".join(f"{k}={v}" for k, v in e.get("resources", {}).items()))
            fam = m.data["kernels"][e["kernel"]]
            click.echo(f"  launcher: CUresult {fam['launch_function']}(const gdn_aot_kernel_t *kern, CUstream "
                       f"stream, unsigned gx, unsigned gy, unsigned gz,")
            click.echo("      " + ", ".join(f"{p['ctype']} {p['name']}" for p in fam["params"])
                       + ", CUdeviceptr global_scratch)")
            click.echo("  kernel ABI (PTX .entry order): " + ", ".join(
                f"{p['name']}:{p['type']}->.{p['ptx']}" for p in e["params"]))
            click.echo("  SASS: " + " ".join(f"{k}={v}" for k, v in e.get("sass", {}).items()))
            if dump_sass:
                from .sass import disassemble

                click.echo(disassemble(m.dir / e["cubin"]["path"], m.arch))
    if as_json:
        click.echo(json.dumps(found, indent=1))
    if bad:
        sys.exit(1)


EPILOG_PACKAGE = """\b
Examples:
  gdn-aot package artifacts --into /opt/gdn-aot/artifacts    # then: GDN_AOT_ARTIFACTS=/opt/gdn-aot/artifacts
  gdn-aot package artifacts --arch sm_90 --into deploy/       # one arch only
  gdn-aot package artifacts --wheel .whl/gdn_aot-0.1.0-py3-none-any.whl --out dist
      # -> dist/gdn_aot-0.1.0-py3-none-linux_x86_64.whl: the loader finds gdn_aot/artifacts by itself
  make wheel-with-artifacts                                   # the same from a checkout (ARTIFACTS=artifacts)
Only verified files are shipped: manifest.json, kernels.tsv, the listed cubins, the launcher (header, source,
libgdn_aot_launch.so.<ABI>); PTX with --with-ptx; build logs never. docs/deploy.md has a Dockerfile."""


@main.command(epilog=EPILOG_PACKAGE)
@click.argument("artifacts", type=click.Path(exists=True, file_okay=False))
@click.option("--into", type=click.Path(file_okay=False), help="copy the runtime files to INTO/<arch>/")
@click.option("--wheel", type=click.Path(exists=True, dir_okay=False),
              help="a gdn_aot wheel (`make wheel`) to copy with the artifacts as package data gdn_aot/artifacts")
@click.option("--out", default="dist", show_default=True, type=click.Path(file_okay=False),
              help="where --wheel writes the new wheel")
@click.option("--arch", "arches", multiple=True, help=f"{ARCH_CHOICES} (repeatable) [default: every built arch]")
@click.option("--with-ptx", is_flag=True, help="also ship the PTX (debugging only; the loader never reads it)")
@click.option("--json", "as_json", is_flag=True, help="print what was written as JSON")
def package(artifacts, into, wheel, out, arches, with_ptx, as_json):
    """Ship the artifacts built in ARTIFACTS: a runtime-only copy (--into) or a wheel carrying them (--wheel)."""
    from .package import PackageError, add_to_wheel, copy_runtime
    from .spec import ARCH_ALIASES

    if (into is None) == (wheel is None):
        raise click.UsageError("give exactly one of --into DIR and --wheel WHEEL")
    try:
        arch_list = [ARCH_ALIASES[a] for a in arches]
    except KeyError as e:
        raise click.BadParameter(f"unknown arch {e.args[0]!r} ({ARCH_CHOICES})", param_hint="--arch") from None
    try:
        if into is not None:
            report = copy_runtime(Path(artifacts), Path(into), arch_list or None, with_ptx)
            line = ", ".join(f"{a}: {r['files']} files, {r['bytes'] / 1e6:.1f} MB" for a, r in report["arches"].items())
            msg = f"packaged {line} into {into}; point GDN_AOT_ARTIFACTS at it"
        else:
            path = add_to_wheel(Path(wheel), Path(artifacts), Path(out), arch_list or None, with_ptx)
            report = {"wheel": str(path), "bytes": path.stat().st_size}
            msg = f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); pip install it: no triton needed"
    except (PackageError, GdnAotError) as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        click.secho(msg, fg="green")


if __name__ == "__main__":
    main()
