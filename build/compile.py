"""Parallel, incremental compilation of a spec's variants, one worker subprocess per variant.

Input hash of a variant = sha256 of (every kernels/*.py source text, the variant, its signature (the launcher
ABI's parameters, loader/abi.py) and compile options, the triton version, the ptxas and nvdisasm versions (the
manifest's SASS counts are nvdisasm's), the build code version). A variant whose input hash matches the previous
manifest's and whose cubin is still intact is reused; everything else is compiled (in parallel, -j), checked (ABI
against the PTX .entry, launch constraints), analysed (cuobjdump/nvdisasm) and written content-addressed. A failed
variant is logged under OUT/<arch>/logs/<key>.log and left out of the manifest; the others still build.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..kernels import KERNELS
from ..kernels.registry import Variant
from ..loader.abi import LAUNCHER_ABI_VERSION, MANIFEST_SCHEMA_VERSION
from ..loader.dispatch import build_table
from . import launcher, manifest, params, sass, toolchain
from .spec import Spec

WORKER_TIMEOUT_S = 900
KERNELS_PACKAGE = importlib.util.resolve_name("..kernels", __package__)
WORKER_MODULE = importlib.util.resolve_name(".worker", __package__)


@dataclasses.dataclass
class Result:
    variant: Variant
    status: str  # "compiled" | "cached" | "failed"
    seconds: float = 0.0
    entry: dict | None = None
    error: str = ""
    log: str = ""  # path of the failure log, relative to OUT

    @property
    def key(self) -> str:
        return self.variant.key


@dataclasses.dataclass
class Report:
    out: Path
    arches: tuple[str, ...]
    results: list[Result]
    wall_s: float
    launchers: dict  # arch -> launcher manifest entry

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "failed"]

    def as_json(self) -> dict:
        return {
            "out": str(self.out), "arches": list(self.arches), "wall_s": round(self.wall_s, 3),
            "compiled": self.count("compiled"), "up_to_date": self.count("cached"), "failed": self.count("failed"),
            "compile_s": round(sum(r.seconds for r in self.results if r.status != "cached"), 3),
            "launchers_compiled": [a for a, e in self.launchers.items() if e.get("_compiled")],
            "variants": [{"key": r.key, "arch": r.variant.arch, "status": r.status, "seconds": round(r.seconds, 3),
                          **({"error": r.error, "log": r.log} if r.status == "failed" else {})}
                         for r in self.results],
        }


def _tree_sha(files) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def kernels_source_sha() -> str:
    return _tree_sha(Path(importlib.util.find_spec(KERNELS_PACKAGE).origin).parent.glob("*.py"))


# the build modules whose code shapes a cubin or its manifest entry (the CLI, the spec parser and the launcher
# generator do not: the variant itself is hashed, and the launcher has its own up-to-date check)
HASHED_BUILD_MODULES = ("worker.py", "toolchain.py", "params.py", "sass.py", "compile.py")


def build_code_version() -> str:
    here = Path(__file__).parent
    return _tree_sha([here / m for m in HASHED_BUILD_MODULES]) + \
        f"/schema{MANIFEST_SCHEMA_VERSION}/abi{LAUNCHER_ABI_VERSION}"


def compile_options(v: Variant) -> dict:
    return KERNELS[v.kernel].compile_options(v)


def input_hash(v: Variant, common: dict) -> str:
    doc = {"variant": v.as_dict(), "options": compile_options(v), "signature": KERNELS[v.kernel].signature(v),
           **common, "ptxas": toolchain.ptxas_version(v.arch), "nvdisasm": toolchain.nvdisasm_version(v.arch)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def precheck(v: Variant) -> str:
    """Why the variant cannot compile, found without starting a worker; '' if none."""
    kd = KERNELS[v.kernel]
    try:
        params.variant_params(kd, v)
    except params.AbiError as e:
        return str(e)
    module = kd.module(v.arch)
    if importlib.util.find_spec(module) is None:
        return f"kernel source module {module} does not exist (yet): nothing to compile for {v.kernel} on {v.arch}"
    return ""


def _reusable(prev: dict, key: str, h: str, arch_dir: Path) -> dict | None:
    e = prev.get("variants", {}).get(key)
    if not e or e.get("input_hash") != h:
        return None
    cubin = arch_dir / e["cubin"]["path"]
    if not cubin.is_file() or toolchain.file_sha256(cubin) != e["cubin"]["sha256"]:
        return None
    return e


def _check_launchable(meta: dict) -> str:
    if meta.get("num_ctas", 1) != 1 or meta.get("launch_pdl") or meta.get("launch_cooperative_grid"):
        return "the kernel needs cuLaunchKernelEx (num_ctas > 1, PDL or cooperative launch); the launcher " \
               "uses cuLaunchKernel"
    if meta.get("profile_scratch_size"):
        return "the kernel asks for profile scratch (instrumentation on?); the launcher passes none"
    if meta.get("num_warps") is None:
        return "no num_warps in the metadata"
    return ""


def compile_one(v: Variant, h: str, arch_dir: Path, tmp_root: Path) -> Result:
    """Compile in a worker subprocess, check, analyse, store the cubin; never raises for a kernel problem."""
    t0 = time.perf_counter()
    why = precheck(v)
    if why:
        return Result(v, "failed", time.perf_counter() - t0, error=why, log=why)
    job_dir = Path(tempfile.mkdtemp(dir=tmp_root, prefix="job-"))
    job = {"variant": v.as_dict(), "out_dir": str(job_dir)}
    try:
        r = subprocess.run([sys.executable, "-m", WORKER_MODULE], input=json.dumps(job), text=True,
                           capture_output=True, cwd=job_dir, env=toolchain.sanitized_env(tmp_root / "triton"),
                           timeout=WORKER_TIMEOUT_S)
        log, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\nworker timed out after {WORKER_TIMEOUT_S} s", -1
    if rc != 0:
        last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or [f"exit status {rc}"]
        if rc < 0:
            last = [f"worker killed by signal {-rc} (LLVM abort?): {last[0]}"]
        return Result(v, "failed", time.perf_counter() - t0, error=last[0][:300], log=log)
    try:
        entry = _finish(v, h, job_dir, arch_dir)
    except (params.AbiError, RuntimeError, OSError, KeyError, ValueError) as e:
        return Result(v, "failed", time.perf_counter() - t0, error=str(e)[:300], log=f"{log}\n{e}")
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return Result(v, "compiled", time.perf_counter() - t0, entry=entry)


def _finish(v: Variant, h: str, job_dir: Path, arch_dir: Path) -> dict:
    kd = KERNELS[v.kernel]
    meta = json.loads((job_dir / "meta.json").read_text())
    why = _check_launchable(meta)
    if why:
        raise ValueError(why)
    if meta["num_warps"] != v.num_warps:  # the launcher starts the cubin's warps; the key must say the same
        raise ValueError(f"the cubin runs {meta['num_warps']} warps, the variant names {v.num_warps}")
    plist = params.variant_params(kd, v)
    ptx = (job_dir / "kernel.ptx").read_bytes()
    params.check_against_ptx(plist, ptx.decode(), meta["entry"])
    params.check_against_cubin(plist, job_dir / "kernel.cubin")
    cubin = (job_dir / "kernel.cubin").read_bytes()
    digest = hashlib.sha256(cubin).hexdigest()
    rel, ptx_rel = f"cubins/{digest}.cubin", f"ptx/{digest}.ptx"
    for path, data in ((rel, cubin), (ptx_rel, ptx)):  # content-addressed: never overwrites a live file
        if not (arch_dir / path).is_file() or (arch_dir / path).read_bytes() != data:
            manifest.atomic_write(arch_dir / path, data)
    facts = sass.analyse(arch_dir / rel, v.arch)
    return {
        "key": v.key, "kernel": v.kernel, "axes": v.as_dict(), "entry": meta["entry"],
        "cubin": {"path": rel, "sha256": digest, "size": len(cubin)},
        "ptx": {"path": ptx_rel, "sha256": hashlib.sha256(ptx).hexdigest()},
        "num_warps": meta["num_warps"], "num_stages": meta["num_stages"], "shared": meta["shared"],
        "global_scratch_size": meta["global_scratch_size"], "global_scratch_align": meta["global_scratch_align"],
        "profile_scratch_size": meta["profile_scratch_size"], "tmem_size": meta.get("tmem_size") or 0,
        "params": plist, "grid": kd.grid, "input_hash": h, **facts,
    }


def build(spec: Spec, arches, out: Path, jobs: int | None = None,
          on_result: Callable[[Result], None] | None = None) -> Report:
    t_start = time.perf_counter()
    out = Path(out)
    jobs = max(1, jobs or 1)
    common = {"kernels_source": kernels_source_sha(), "triton": toolchain.triton_version(),
              "build_code": build_code_version()}
    results: dict[str, list[Result]] = {a: [] for a in arches}
    prev = {a: manifest.read_previous(out / a) for a in arches}
    todo: list[tuple[Variant, str]] = []
    for arch in arches:
        for v in spec.for_arch(arch):
            h = input_hash(v, common)
            e = _reusable(prev[arch], v.key, h, out / arch)
            if e is not None:
                res = Result(v, "cached", 0.0, entry=e)
                results[arch].append(res)
                if on_result:
                    on_result(res)
            else:
                todo.append((v, h))
    tmp_root = Path(tempfile.mkdtemp(prefix="gdn-aot-build-"))
    try:
        with cf.ThreadPoolExecutor(jobs) as pool:
            futs = [pool.submit(compile_one, v, h, out / v.arch, tmp_root) for v, h in todo]
            for fut in cf.as_completed(futs):
                res = fut.result()
                results[res.variant.arch].append(res)
                if on_result:
                    on_result(res)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    launchers = {}
    for arch in arches:
        launchers[arch] = _write_arch(spec, arch, out / arch, results[arch], prev[arch], common, out)
    order = {v.key: i for i, v in enumerate(spec.variants)}
    flat = sorted((r for a in arches for r in results[a]), key=lambda r: order[r.key])
    return Report(out, tuple(arches), flat, time.perf_counter() - t_start, launchers)


def _write_logs(arch_dir: Path, results: list[Result], out: Path) -> dict:
    """A log per failed variant (the failed dict of the manifest); logs of variants that now build are removed."""
    logs = arch_dir / "logs"
    failed = {}
    for r in results:
        if r.status == "failed":
            log = logs / f"{r.key}.log"
            manifest.atomic_write(log, (r.log or r.error).encode())
            r.log = str(log.relative_to(out))
            failed[r.key] = f"logs/{log.name}"
    for log in logs.glob("*.log"):  # logs of variants that now build, or left the spec
        if f"logs/{log.name}" not in failed.values():
            log.unlink()
    return failed


def kernel_entries(kernel_names) -> dict:
    """The manifest's `kernels`: per family its axes, grid rule, launch function and parameter list."""
    return {name: {"uses_axes": sorted(KERNELS[name].uses_axes), "grid": KERNELS[name].grid, "doc": KERNELS[name].doc,
                   "launch_function": f"gdn_aot_launch_{name}",
                   "params": [{k: p[k] for k in ("name", "type", "ctype")}
                              for p in params.family_params(KERNELS[name])]}
            for name in kernel_names}


def _write_arch(spec: Spec, arch: str, arch_dir: Path, results: list[Result], prev: dict, common: dict,
                out: Path) -> dict:
    """The arch's logs, dispatch table, launcher and (last) manifest; returns the launcher's manifest entry."""
    failed = _write_logs(arch_dir, results, out)
    kernel_names = list(dict.fromkeys(v.kernel for v in spec.for_arch(arch)))
    variants = {r.key: r.entry for r in results if r.status != "failed"}
    kernels = kernel_entries(kernel_names)
    prefs = spec.dispatch.get(arch, {})
    table = build_table(prefs, variants, {name: k["uses_axes"] for name, k in kernels.items()})
    lent = launcher.build(arch, kernel_names, arch_dir / "launcher", prev.get("launcher"), table)
    data = {
        "schema_version": MANIFEST_SCHEMA_VERSION, "arch": arch,
        "triton_version": common["triton"], "ptxas_version": toolchain.ptxas_version(arch),
        "ptxas": toolchain.ptxas_for(arch).name, "nvdisasm_version": toolchain.nvdisasm_version(arch),
        "build_code_version": common["build_code"],
        "kernels_source_sha256": common["kernels_source"],
        "spec": {"path": str(Path(spec.path).resolve()), "sha256": spec.sha256},
        "launcher": {k: x for k, x in lent.items() if not k.startswith("_")},
        "kernels": kernels, "dispatch": {"spec": prefs, "table": table},
        "variants": variants, "failed": failed,
    }
    manifest.write(arch_dir, data)
    return lent
