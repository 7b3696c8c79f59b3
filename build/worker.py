"""Compile ONE variant: `python -m gdn_aot.build.worker < job.json`.

Runs in its own process because LLVM aborts the whole process on some errors (e.g. an op the arch lacks), which
no try/except can catch. The job (JSON on stdin): {"variant": Variant.as_dict(), "out_dir": DIR}. On success
writes DIR/kernel.cubin, DIR/kernel.ptx, DIR/meta.json and exits 0; on failure prints the error and exits non-zero.
The parent sets a private TRITON_CACHE_DIR/TRITON_HOME and TRITON_ALWAYS_COMPILE=1 (toolchain.sanitized_env).

Reproducibility: ptxas-blackwell 12.9 assigns some uniform registers in an order that depends on heap addresses,
so with address-space randomisation the same PTX gives different (equally valid) sm_100a cubins from run to run.
The worker therefore turns ASLR off for itself (personality ADDR_NO_RANDOMIZE, inherited by the ptxas it runs);
with it off the output is byte-identical.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# metadata fields the manifest keeps (the rest is compiler configuration, already in the input hash)
META_KEYS = (
    "name", "shared", "num_warps", "num_stages", "num_ctas", "global_scratch_size", "global_scratch_align",
    "profile_scratch_size", "profile_scratch_align", "tmem_size", "launch_pdl", "launch_cooperative_grid",
    "tensordesc_meta", "triton_version", "hash", "arch",
)


class KernelMismatch(Exception):
    pass


def build_source(kd, variant, fn):
    """GluonASTSource for the variant, with the signature in the kernel's own argument order."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = kd.signature(variant)
    consts = kd.constexprs(variant)
    arg_names = list(fn.arg_names)
    if set(arg_names) != set(sig):
        raise KernelMismatch(
            f"{kd.name}: the kernel's arguments {arg_names} differ from the registry's params + constexprs "
            f"{list(sig)} (kernels/__init__.py)")
    runtime = [n for n, _ in kd.params]
    if [a for a in arg_names if a in runtime] != runtime:
        raise KernelMismatch(f"{kd.name}: runtime arguments are in a different order in the kernel "
                             f"({[a for a in arg_names if a in runtime]}) than in the registry ({runtime}); "
                             "the registry order is the launcher ABI")
    signature = {a: sig[a] for a in arg_names}
    attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n, t in kd.params if t.startswith("*")}
    return GluonASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)


def compile_job(job: dict) -> dict:
    from ..kernels import KERNELS
    from ..kernels.registry import Variant, arch_capability

    variant = Variant(**job["variant"])
    kd = KERNELS[variant.kernel]
    out = Path(job["out_dir"])
    t0 = time.perf_counter()
    fn = kd.source(variant.arch)  # imports the Gluon module (and triton)
    import triton
    from triton.backends.compiler import GPUTarget

    src = build_source(kd, variant, fn)
    t1 = time.perf_counter()
    k = triton.compile(src, target=GPUTarget("cuda", arch_capability(variant.arch), 32),
                       options=kd.compile_options(variant))
    t2 = time.perf_counter()
    md = k.metadata._asdict()
    meta = {key: md.get(key) for key in META_KEYS}
    meta["entry"] = k.name
    meta["compile_s"] = round(t2 - t1, 3)
    meta["import_s"] = round(t1 - t0, 3)
    (out / "kernel.cubin").write_bytes(k.asm["cubin"])
    (out / "kernel.ptx").write_text(k.asm["ptx"])
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    return meta


ADDR_NO_RANDOMIZE = 0x0040000


def disable_aslr() -> bool:
    """Ask Linux not to randomise the address space of the programs this process starts (ptxas)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        current = libc.personality(0xFFFFFFFF)
        return current != -1 and libc.personality(current | ADDR_NO_RANDOMIZE) != -1
    except (OSError, AttributeError):
        return False


def main() -> int:
    job = json.load(sys.stdin)
    if not disable_aslr():
        print("warning: could not disable ASLR; sm_100a cubins may not be reproducible", file=sys.stderr)
    try:
        meta = compile_job(job)
    except Exception:  # report and exit non-zero; the parent saves this output as the variant's log
        import traceback

        traceback.print_exc()
        return 1
    print(f"compiled {meta['entry']} in {meta['compile_s']} s (shared={meta['shared']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
