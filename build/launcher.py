"""Generate the C launcher (jinja2 templates in build/templates) and compile it into a versioned shared library.

One launch function per kernel family (the family's runtime params from the registry, then global_scratch),
and, when both families are built, gdn_aot_forward: the whole forward (both launches, grids and workspace layout
computed in C) from one argument struct, the one call per forward the Python API makes. The header is the
documented C ABI. cuda.h comes from triton's bundled include dir; libcuda is dlopen'ed at run time, so neither
building nor loading the .so needs a driver.

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

import gdn_aot.kernels as kernels
from gdn_aot.build import toolchain
from gdn_aot.build.abi import family_params
from gdn_aot.build.manifest import atomic_write
from gdn_aot.kernels import KERNELS
from gdn_aot.loader.artifacts import LAUNCHER_ABI_VERSION
from gdn_aot.loader.runtime import FORWARD_ARG_FIELDS, WORKSPACE_ALIGN

HEADER, SOURCE, LINK_NAME = "gdn_aot_launch.h", "gdn_aot_launch.c", "libgdn_aot_launch.so"
SONAME = f"{LINK_NAME}.{LAUNCHER_ABI_VERSION}"
LIBRARY = SONAME  # the real file
DRIVER_FUNCTIONS = (
    "Init", "DriverGetVersion", "DeviceGet", "DeviceGetCount", "DeviceGetAttribute", "DevicePrimaryCtxRetain",
    "DevicePrimaryCtxRelease", "CtxGetCurrent", "CtxSetCurrent", "CtxSynchronize", "ModuleLoadData",
    "ModuleUnload", "ModuleGetFunction", "FuncSetAttribute", "FuncGetAttribute", "LaunchKernel",
    "GetErrorString", "GetErrorName", "MemAlloc", "MemFree", "MemcpyHtoD", "MemcpyDtoH", "MemsetD8",
    "StreamSynchronize", "StreamCreate", "StreamDestroy",  # new entries only ever go at the end (struct layout)
)
CFLAGS = ("-O2", "-shared", "-fPIC", "-Wall", "-Werror")
LIBS = ("-ldl", "-lpthread")
# gdn_aot_forward passes each kernel param as a C expression over `a` (the caller's gdn_aot_forward_args_t), `p`
# (its gdn_aot_forward_plan_t) and `ws` (the workspace); a param missing here fails the build (see forward()).
_FORWARD_COMMON = {
    "q": "a.q", "k": "a.k", "v": "a.v", "g": "a.g", "beta": "a.beta", "cu_seqlens": "a.cu_seqlens",
    "w": "ws + p.w", "u": "ws + p.u", "gam": "ws + p.gam", "qg": "ws + p.qg", "kg": "ws + p.kg",
    "h0": "a.h0", "ht": "a.ht", "state_indices": "a.state_indices", "o": "a.o", "scale": "(float)a.scale",
    "T": "p.T_arg", "num_seqs": "(int32_t)a.num_seqs", "H": "(int32_t)a.H", "HV": "(int32_t)a.HV",
}
FORWARD_CALLS = {"gdn_prepare": {**_FORWARD_COMMON, "flags": "(int32_t)a.prepare_flags"},
                 "gdn_scan": {**_FORWARD_COMMON, "flags": "(int32_t)a.scan_flags"}}


class LauncherError(RuntimeError):
    pass


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def families(kernel_names) -> list[dict]:
    out = []
    for name in kernel_names:
        kd = KERNELS[name]
        out.append({"name": name, "doc": kd.doc, "grid": kd.grid, "params": family_params(kd)})
    return out


def forward(kernel_names) -> dict | None:
    """What the template needs for gdn_aot_forward, or None when the spec does not build both kernels."""
    if not all(name in kernel_names for name in FORWARD_CALLS):
        return None
    calls = {}
    for name, exprs in FORWARD_CALLS.items():
        missing = [n for n, _ in KERNELS[name].params if n not in exprs]
        if missing:
            raise LauncherError(f"gdn_aot_forward has no value for {name}'s params {missing}: give them one in "
                                "FORWARD_CALLS (build/launcher.py)")
        values = [exprs[n] for n, _ in KERNELS[name].params]
        calls[name] = [", ".join(values[i:i + 6]) for i in range(0, len(values), 6)]  # 6 a line
    fields = [{"decl": f"{ctype}{'' if ctype.endswith('*') else ' '}{n}", "doc": doc}
              for n, _, ctype, doc in FORWARD_ARG_FIELDS]
    return {"calls": calls, "fields": fields, "align": WORKSPACE_ALIGN,
            "prepare_grid": KERNELS["gdn_prepare"].grid, "scan_grid": KERNELS["gdn_scan"].grid}


def flags() -> list[tuple[str, int]]:
    """The kernels' flag bits (gdn_aot.kernels PREPARE_* / SCAN_*), as #defines in the header."""
    return [(n, getattr(kernels, n)) for n in kernels.__all__ if n.startswith(("PREPARE_", "SCAN_"))]


def render(arch: str, kernel_names) -> dict[str, str]:
    ctx = {"arch": arch, "abi_version": LAUNCHER_ABI_VERSION, "families": families(kernel_names),
           "driver_functions": DRIVER_FUNCTIONS, "forward": forward(kernel_names), "flags": flags()}
    env = _env()
    return {HEADER: env.get_template(f"{HEADER}.j2").render(ctx),
            SOURCE: env.get_template(f"{SOURCE}.j2").render(ctx)}


def compile_so(src_dir: Path, out: Path) -> None:
    cmd = [toolchain.cc(), *CFLAGS, f"-Wl,-soname,{SONAME}", f"-I{src_dir}", f"-I{toolchain.cuda_include()}",
           "-o", str(out), SOURCE, *LIBS]
    r = subprocess.run(cmd, cwd=src_dir, capture_output=True, text=True)
    if r.returncode:
        raise LauncherError(f"compiling the launcher failed:\n$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")


def build(arch: str, kernel_names, launcher_dir: Path, previous: dict | None = None) -> dict:
    """Write header, source and .so into launcher_dir (atomically, each file); return the manifest entry.

    The .so is recompiled only when the generated text, the compiler or the previous .so changed."""
    launcher_dir = Path(launcher_dir).resolve()
    launcher_dir.mkdir(parents=True, exist_ok=True)
    texts = render(arch, kernel_names)
    so = launcher_dir / LIBRARY
    prev_files = (previous or {}).get("files", {})
    unchanged = (
        so.is_file() and (previous or {}).get("cc") == toolchain.cc_version()
        and all((launcher_dir / n).is_file() and (launcher_dir / n).read_text() == t for n, t in texts.items())
        and prev_files.get(LIBRARY) == toolchain.file_sha256(so)
    )
    compiled = False
    if not unchanged:
        with tempfile.TemporaryDirectory(dir=launcher_dir, prefix=".tmp-") as tmp:
            tmp = Path(tmp)
            for n, t in texts.items():
                (tmp / n).write_text(t)
            compile_so(tmp, tmp / LIBRARY)
            for n, t in texts.items():
                atomic_write(launcher_dir / n, t.encode())
            atomic_write(so, (tmp / LIBRARY).read_bytes(), mode=0o755)
        compiled = True
    _link(launcher_dir / LINK_NAME, SONAME)
    for old in launcher_dir.glob(f"{LINK_NAME}.*"):  # the library of another launcher ABI, from an older build
        if old.name != SONAME:
            old.unlink()
    files = {n: toolchain.file_sha256(launcher_dir / n) for n in (HEADER, SOURCE, LIBRARY)}
    return {
        "abi_version": LAUNCHER_ABI_VERSION,
        "header": f"launcher/{HEADER}", "source": f"launcher/{SOURCE}", "library": f"launcher/{LIBRARY}",
        "soname": SONAME, "link_name": f"launcher/{LINK_NAME}",
        "files": files, "cc": toolchain.cc_version(), "cflags": list(CFLAGS),
        "families": {f["name"]: {"function": f"gdn_aot_launch_{f['name']}",
                                 "params": [p["name"] for p in f["params"]] + ["global_scratch"]}
                     for f in families(kernel_names)},
        "forward": {"function": "gdn_aot_forward", "plan": "gdn_aot_forward_plan",
                    "workspace_bytes": "gdn_aot_forward_workspace_bytes",
                    "args": [f[0] for f in FORWARD_ARG_FIELDS]} if forward(kernel_names) else None,
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
