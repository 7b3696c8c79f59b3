"""The contract between the Gluon kernel sources and the build step.

Every kernel family registers one :class:`KernelDef`. The build step knows nothing about GDN: it asks a
``KernelDef`` for the runtime signature, the constexprs and the launch options of a :class:`Variant`,
compiles ``KernelDef.source(arch)`` with them, and records the result in the manifest. The runtime parameters
of a family come from the launcher ABI's declaration (loader/abi.py FAMILIES), which also says how the forward
feeds each of them; the worker checks that the kernel function takes them in that order.

Runtime parameter types use Triton's signature strings: ``*bf16``/``*fp16``/``*fp32``/``*i32`` for pointers
(``*{dtype}`` is replaced by the variant's input dtype, ``*{state}`` by its state storage dtype),
``i32``/``i64``/``fp32`` for scalars.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Callable

ARCHES = ("sm_90a", "sm_100a", "sm_103a")
# arch -> (source family, compute capability). sm_103a (Blackwell Ultra) compiles the sm_100a sources: the same
# tcgen05 / TMEM / TMA instructions, but an arch-specific cubin runs on one capability only, so it is its own target.
_ARCH_INFO = {"sm_90a": ("sm90", 90), "sm_100a": ("sm100", 100), "sm_103a": ("sm100", 103)}
DTYPES = ("bf16", "fp16")
# state storage dtypes (spec spelling -> Triton's): the initial and final state in HBM; the recurrence is fp32
STATE_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8e4m3": "fp8e4nv", "fp8e5m2": "fp8e5"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One point of a spec's cross product: everything that selects a cubin."""

    kernel: str
    arch: str  # ARCHES
    K: int
    V: int
    BT: int
    BK: int
    BV: int
    dtype: str  # "bf16" | "fp16"
    varlen: bool
    transpose: bool  # state stored [V, K] instead of [K, V]
    num_warps: int
    num_stages: int
    state_dtype: str = "fp32"  # STATE_DTYPES: how h0 and ht are stored
    gating: bool = False  # computes g and beta from raw inputs where asked (fla's use_gate_in_kernel, ...)
    checkpoints: bool = False  # writes the state every checkpoint_every_n_tokens tokens where asked

    @property
    def key(self) -> str:
        """Stable, human-readable identifier; also the manifest key. The functional options name themselves
        only where they differ from the default, so the plain variants keep their names."""
        return (
            f"{self.kernel}.{self.arch}.{self.dtype}.k{self.K}v{self.V}.bt{self.BT}bk{self.BK}bv{self.BV}"
            f".{'varlen' if self.varlen else 'fixed'}.{'vk' if self.transpose else 'kv'}"
            + (f".state-{self.state_dtype}" if self.state_dtype != "fp32" else "")
            + (".gating" if self.gating else "") + (".checkpoints" if self.checkpoints else "")
            + f".w{self.num_warps}s{self.num_stages}"
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KernelDef:
    """What the build step needs to compile one kernel family for any variant.

    params: runtime parameters in launch order, as (name, type) with ``*{dtype}`` standing for the input dtype
      (``abi.FAMILIES[name].kernel_params``).
    constexprs: variant -> {name: value} for every ``gl.constexpr`` parameter of the kernel (num_warps included).
    sources: arch family ("sm90"; "sm100" for sm_100a and sm_103a) -> "module:function" of the ``@gluon.jit``
      kernel, the module relative to this package (".scan_sm90") or absolute, imported lazily so that reading the
      registry never imports triton.
    grid: the grid rule, in words, recorded in the manifest for launcher writers.
    uses_axes: the spec axes that change the generated code; the others must hold a single value for this
      kernel (validation rejects a spec that varies them, so no two variants compile to the same cubin).
    options: variant -> triton.compile options, when they are not just the variant's num_warps and num_stages.
    """

    name: str
    params: tuple[tuple[str, str], ...]
    constexprs: Callable[[Variant], dict]
    sources: dict[str, str]
    grid: str
    uses_axes: frozenset[str]
    doc: str = ""
    options: Callable[[Variant], dict] | None = None

    def compile_options(self, variant: Variant) -> dict:
        """triton.compile options of the variant: `options(variant)` when given, else its num_warps and
        num_stages. (A warp-specialised variant compiles with the warps of its default partition; the cubin's
        metadata then reports all of its warps, which is what the launcher starts.)"""
        if self.options is not None:
            return self.options(variant)
        return {"num_warps": variant.num_warps, "num_stages": variant.num_stages}

    def signature(self, variant: Variant) -> dict[str, str]:
        """Triton signature: runtime params (dtype substituted) then constexprs, in the kernel's own order."""
        state = STATE_DTYPES[variant.state_dtype]
        sig = {name: ty.replace("{dtype}", variant.dtype).replace("{state}", state) for name, ty in self.params}
        for name in self.constexprs(variant):
            sig[name] = "constexpr"
        return sig

    def module(self, arch: str) -> str:
        """The absolute name of the module holding the arch's kernel."""
        family = arch_family(arch)
        if family not in self.sources:
            raise KeyError(f"kernel {self.name!r} has no {arch} source")
        return importlib.util.resolve_name(self.sources[family].split(":")[0], __package__)

    def source(self, arch: str):
        fn = self.sources[arch_family(arch)].split(":")[1]
        return getattr(importlib.import_module(self.module(arch)), fn)


def arch_family(arch: str) -> str:
    return _ARCH_INFO[arch][0]


def arch_capability(arch: str) -> int:
    return _ARCH_INFO[arch][1]
