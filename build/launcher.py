"""Generate the C launcher (jinja2 templates in build/templates) and compile it into a versioned shared library.

Everything the templates render comes from the launcher ABI's declarations (loader/abi.py) and the arch's
dispatch table (loader/dispatch.py): one launch function per kernel family (its runtime params, then
global_scratch); the flag and option macros; and, when the spec builds every kernel of a route, gdn_aot_forward:
the whole forward of a dispatch row (the route's launches, their grids and the workspace layout computed in C)
from one argument struct, the one call per forward the Python API makes; gdn_aot_select, the dispatch table.
The header is the documented C ABI. cuda.h comes from triton's bundled include dir; libcuda is dlopen'ed at run
time, so neither building nor loading the .so needs a driver.

The library is versioned like any system library: the file is libgdn_aot_launch.so.<ABI> with that soname
(DT_SONAME), and libgdn_aot_launch.so is a symlink to it for `-lgdn_aot_launch` at link time. A program linked
against it records the versioned name, so an artifact directory with another launcher ABI fails at load time
instead of being called with the wrong arguments.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import jinja2

from ..kernels import KERNELS
from ..loader import abi
from ..loader.dispatch import c_rows
from . import toolchain
from .manifest import atomic_write
from .params import family_params

HEADER, SOURCE, LINK_NAME = "gdn_aot_launch.h", "gdn_aot_launch.c", "libgdn_aot_launch.so"
SONAME = f"{LINK_NAME}.{abi.LAUNCHER_ABI_VERSION}"
LIBRARY = SONAME  # the real file
DRIVER_FUNCTIONS = (
    "Init", "DriverGetVersion", "DeviceGet", "DeviceGetCount", "DeviceGetAttribute", "DevicePrimaryCtxRetain",
    "DevicePrimaryCtxRelease", "CtxGetCurrent", "CtxSetCurrent", "CtxSynchronize", "ModuleLoadData",
    "ModuleUnload", "ModuleGetFunction", "FuncSetAttribute", "FuncGetAttribute", "LaunchKernel",
    "GetErrorString", "GetErrorName", "MemAlloc", "MemFree", "MemcpyHtoD", "MemcpyDtoH", "MemsetD8",
    "StreamSynchronize", "StreamCreate", "StreamDestroy", "MemsetD32Async", "LaunchKernelEx", "CtxGetDevice",
    "OccupancyMaxActiveBlocksPerMultiprocessor",
    # new entries only ever go at the end (struct layout)
)
CFLAGS = ("-O2", "-shared", "-fPIC", "-Wall", "-Werror")
LIBS = ("-ldl", "-lpthread")
_ARG_FIELDS = {f.name for f in abi.FORWARD_ARG_FIELDS}
_PLAN_FIELDS = {f.name for f in abi.PLAN_FIELDS}
_REGIONS = {r.name for r in abi.REGIONS}


class LauncherError(RuntimeError):
    pass


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def families(kernel_names) -> list[dict]:
    out = []
    for name in kernel_names:
        kd = KERNELS[name]
        out.append({"name": name, "doc": kd.doc, "grid": kd.grid, "params": family_params(kd),
                    "co_resident": name in abi.FAMILIES and abi.FAMILIES[name].co_resident})
    return out


def param_expr(family: str, p: abi.Param) -> str:
    """The C expression gdn_aot_forward passes for a kernel param, from its declared source (loader/abi.py):
    over `a` (the caller's gdn_aot_forward_args_t), `p` (its plan) and `ws` (the workspace)."""
    kind, _, name = p.source.partition(".")
    if kind == "args" and name in _ARG_FIELDS:
        return f"a.{name}" if p.type.startswith("*") else f"({abi.param_abi(p.name, p.type)['ctype']})a.{name}"
    if kind == "workspace" and name in _REGIONS:
        return f"ws + p.{name}"
    if kind == "plan" and name in _PLAN_FIELDS:
        return f"p.{name}"
    if p.source == "flags":
        return f"gdn_flags_{family}(a.options)"
    raise LauncherError(f"{family}'s param {p.name!r} has source {p.source!r}, which names no forward argument, "
                        "workspace region or plan field (loader/abi.py)")


def _grid_expr(q) -> str:
    if isinstance(q, int):
        return str(q)
    if q not in abi.GRID_QUANTITIES:
        raise LauncherError(f"grid quantity {q!r} is not among {abi.GRID_QUANTITIES} (loader/abi.py)")
    return q if q in ("slots", *abi.V_TILED) else f"a.{q}"


def _launch(fam: abi.Family) -> dict:
    kd = KERNELS.get(fam.name)
    if kd is not None and tuple(kd.params) != fam.kernel_params:
        extra = [n for n, _ in kd.params if n not in {p.name for p in fam.params}]
        raise LauncherError(f"{fam.name}'s params {extra or [n for n, _ in kd.params]} differ from the launcher ABI's "
                            "(loader/abi.py FAMILIES gives each kernel param its source; KernelDef takes them "
                            "from there)")
    values = [param_expr(fam.name, p) for p in fam.params]
    return {"name": fam.name, "handle": fam.handle, "grid": [_grid_expr(q) for q in fam.grid],
            "lines": [", ".join(values[i:i + 6]) for i in range(0, len(values), 6)],  # 6 a line
            "flags": fam.flags}


def _region(r: abi.Region) -> dict:
    """A region's size in C (over `a`, and hv_rows or seq_heads), for the plan."""
    factors = "".join(f" * (uint64_t)a.{f}" if isinstance(f, str) else f" * {f}" for f in r.size)
    count = {"row_head": "hv_rows", "seq_head": "seq_heads"}[r.per]
    uses = " || ".join(f"a.route == GDN_AOT_ROUTE_{name.upper()}" for name in r.routes)
    return {"name": r.name, "size": f"({uses}) ? {count}{factors} : 0", "doc": r.doc}


def _zeroed(route: str) -> list[dict]:
    """The route's zeroed regions, each with the plan field that follows it (the next region or the scratch): the
    forward zeroes the span between the two offsets, the region and its alignment padding (whole 4-byte words, as
    WORKSPACE_ALIGN is)."""
    after = [r.name for r in abi.REGIONS[1:]] + ["scratch"]
    return [{"name": r.name, "end": end} for r, end in zip(abi.REGIONS, after) if r.zeroed and route in r.routes]


def forward_context(kernel_names, arch: str) -> dict | None:
    """What the templates need for gdn_aot_forward on `arch`, or None when the spec builds no route's kernels."""
    routes = []
    for r in abi.ROUTES.values():
        fams = abi.families_of(r.name)
        built = all(f.name in kernel_names for f in fams)
        refused = [f"!a->{f.handle}" for f in fams]  # gdn_check_route: a missing kernel, or a V tile not dividing V
        if any(z in f.grid for f in fams for z in abi.V_TILED):
            refused += ["a->BV <= 0", "a->V % a->BV", "a->V / a->BV > 65535"]
        refused += [f"(a->options & GDN_AOT_FORWARD_{option})" for on, option, _ in r.refuses if on == arch]
        routes.append({"name": r.name, "NAME": r.name.upper(), "id": r.id, "built": built,
                       "refused": " || ".join(refused), "launches": [_launch(f) for f in fams] if built else [],
                       "zeroed": _zeroed(r.name)})
    if not any(r["built"] for r in routes):
        return None
    return {"fields": abi.FORWARD_ARG_FIELDS, "plan_fields": abi.PLAN_FIELDS, "align": abi.WORKSPACE_ALIGN,
            "terms_programs": abi.TERMS_PROGRAMS,
            "routes": routes, "regions": [_region(r) for r in abi.REGIONS]}


def render(arch: str, kernel_names, table: list[dict] | None = None) -> dict[str, str]:
    """Header and source text for a spec building `kernel_names`, with the arch's dispatch table."""
    ctx = {"arch": arch, "abi_version": abi.LAUNCHER_ABI_VERSION, "families": families(kernel_names),
           "driver_functions": DRIVER_FUNCTIONS, "forward": forward_context(kernel_names, arch),
           "kernel_fields": abi.KERNEL_FIELDS, "options": abi.OPTIONS,
           "flags": list({fl.name: fl for f in abi.FAMILIES.values() for fl in f.flags}.values()),
           "routes": abi.ROUTES.values(), "bounds": abi.BOUNDS, "row_fields": abi.DISPATCH_ROW_FIELDS,
           "dispatch": c_rows(table or []), "handles": [f.handle for f in abi.FAMILIES.values()]}
    env = _env()
    return {HEADER: env.get_template(f"{HEADER}.j2").render(ctx),
            SOURCE: env.get_template(f"{SOURCE}.j2").render(ctx)}


def compile_so(src_dir: Path, out: Path) -> None:
    cmd = [toolchain.cc(), *CFLAGS, f"-Wl,-soname,{SONAME}", f"-I{src_dir}", f"-I{toolchain.cuda_include()}",
           "-o", str(out), SOURCE, *LIBS]
    r = subprocess.run(cmd, cwd=src_dir, capture_output=True, text=True)
    if r.returncode:
        raise LauncherError(f"compiling the launcher failed:\n$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")


def _write_if_changed(launcher_dir: Path, texts: dict, previous: dict | None) -> bool:
    """Write header, source and .so (atomically, each file) unless the text, the compiler and the previous .so are
    unchanged; True when the .so was compiled."""
    so = launcher_dir / LIBRARY
    prev_files = (previous or {}).get("files", {})
    unchanged = (
        so.is_file() and (previous or {}).get("cc") == toolchain.cc_version()
        and all((launcher_dir / n).is_file() and (launcher_dir / n).read_text() == t for n, t in texts.items())
        and prev_files.get(LIBRARY) == toolchain.file_sha256(so)
    )
    if unchanged:
        return False
    with tempfile.TemporaryDirectory(dir=launcher_dir, prefix=".tmp-") as tmp:
        tmp = Path(tmp)
        for n, t in texts.items():
            (tmp / n).write_text(t)
        compile_so(tmp, tmp / LIBRARY)
        for n, t in texts.items():
            atomic_write(launcher_dir / n, t.encode())
        atomic_write(so, (tmp / LIBRARY).read_bytes(), mode=0o755)
    return True


def build(arch: str, kernel_names, launcher_dir: Path, previous: dict | None = None,
          table: list[dict] | None = None) -> dict:
    """Write header, source and .so into launcher_dir; return the manifest entry."""
    launcher_dir = Path(launcher_dir).resolve()
    launcher_dir.mkdir(parents=True, exist_ok=True)
    compiled = _write_if_changed(launcher_dir, render(arch, kernel_names, table), previous)
    _link(launcher_dir / LINK_NAME, SONAME)
    for old in launcher_dir.glob(f"{LINK_NAME}.*"):  # the library of another launcher ABI, from an older build
        if old.name != SONAME:
            old.unlink()
    files = {n: toolchain.file_sha256(launcher_dir / n) for n in (HEADER, SOURCE, LIBRARY)}
    fwd = forward_context(kernel_names, arch)
    return {
        "abi_version": abi.LAUNCHER_ABI_VERSION,
        "header": f"launcher/{HEADER}", "source": f"launcher/{SOURCE}", "library": f"launcher/{LIBRARY}",
        "soname": SONAME, "link_name": f"launcher/{LINK_NAME}",
        "files": files, "cc": toolchain.cc_version(), "cflags": list(CFLAGS),
        "families": {f["name"]: {"function": f"gdn_aot_launch_{f['name']}",
                                 "params": [p["name"] for p in f["params"]] + ["global_scratch"]}
                     for f in families(kernel_names)},
        "forward": {"function": "gdn_aot_forward", "plan": "gdn_aot_forward_plan",
                    "workspace_bytes": "gdn_aot_forward_workspace_bytes", "select": "gdn_aot_select",
                    "args": [f.name for f in abi.FORWARD_ARG_FIELDS],
                    "routes": [r["name"] for r in fwd["routes"] if r["built"]]} if fwd else None,
        "_compiled": compiled,
    }


def _link(path: Path, target: str) -> None:
    """path -> target (relative symlink), replaced atomically; also replaces a regular file of an older build."""
    if path.is_symlink() and os.readlink(path) == target:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, path)
