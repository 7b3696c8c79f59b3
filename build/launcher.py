"""Generate the C launcher (jinja2 templates in build/templates) and compile it into libgdn_aot_launch.so.

One launch function per kernel family (the family's runtime params from the registry, then global_scratch);
the header is the documented C ABI. cuda.h comes from triton's bundled include dir; libcuda is dlopen'ed at
run time, so neither building nor loading the .so needs a driver.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import jinja2

from gdn_aot.build import toolchain
from gdn_aot.build.abi import family_params
from gdn_aot.build.manifest import atomic_write
from gdn_aot.kernels import KERNELS
from gdn_aot.loader.artifacts import LAUNCHER_ABI_VERSION

HEADER, SOURCE, LIBRARY = "gdn_aot_launch.h", "gdn_aot_launch.c", "libgdn_aot_launch.so"
DRIVER_FUNCTIONS = (
    "Init", "DriverGetVersion", "DeviceGet", "DeviceGetCount", "DeviceGetAttribute", "DevicePrimaryCtxRetain",
    "DevicePrimaryCtxRelease", "CtxGetCurrent", "CtxSetCurrent", "CtxSynchronize", "ModuleLoadData",
    "ModuleUnload", "ModuleGetFunction", "FuncSetAttribute", "FuncGetAttribute", "LaunchKernel",
    "GetErrorString", "GetErrorName", "MemAlloc", "MemFree", "MemcpyHtoD", "MemcpyDtoH", "MemsetD8",
    "StreamSynchronize",
)
CFLAGS = ("-O2", "-shared", "-fPIC", "-Wall", "-Werror")
LIBS = ("-ldl", "-lpthread")


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


def render(arch: str, kernel_names) -> dict[str, str]:
    ctx = {"arch": arch, "abi_version": LAUNCHER_ABI_VERSION, "families": families(kernel_names),
           "driver_functions": DRIVER_FUNCTIONS}
    env = _env()
    return {HEADER: env.get_template(f"{HEADER}.j2").render(ctx),
            SOURCE: env.get_template(f"{SOURCE}.j2").render(ctx)}


def compile_so(src_dir: Path, out: Path) -> None:
    cmd = [toolchain.cc(), *CFLAGS, f"-I{src_dir}", f"-I{toolchain.cuda_include()}", "-o", str(out), SOURCE, *LIBS]
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
    files = {n: toolchain.file_sha256(launcher_dir / n) for n in (HEADER, SOURCE, LIBRARY)}
    return {
        "abi_version": LAUNCHER_ABI_VERSION,
        "header": f"launcher/{HEADER}", "source": f"launcher/{SOURCE}", "library": f"launcher/{LIBRARY}",
        "files": files, "cc": toolchain.cc_version(), "cflags": list(CFLAGS),
        "families": {f["name"]: {"function": f"gdn_aot_launch_{f['name']}",
                                 "params": [p["name"] for p in f["params"]] + ["global_scratch"]}
                     for f in families(kernel_names)},
        "_compiled": compiled,
    }
