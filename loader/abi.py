"""The launcher ABI, declared once: everything the generated C launcher and its callers agree on.

From these declarations the build renders the C launcher (build/launcher.py, build/templates: the header's
structs, flag macros, launch functions, gdn_aot_forward and its plan), the loader builds its ctypes mirrors and
packs the forward's argument struct (loader/binding.py, loader/api.py), and tests/test_abi.py checks the compiled
launcher against them; examples/cpp reads only the generated header. Adding a forward argument or a kernel
parameter is one edit here plus a LAUNCHER_ABI_VERSION bump (then the kernel source, for a kernel parameter).

  kernel parameters   FAMILIES: per kernel family, its runtime parameters in launch order, each with the source
                      gdn_aot_forward feeds it from (an argument, a workspace region, a plan value or the flags)
  flag bits           OPTIONS (the forward's `options` word) and each family's `flags` bits, derived from them
  argument struct     ROUTE_FIELDS + CALL_FIELDS = gdn_aot_forward_args_t, every field 8 bytes wide
  plan                PLAN_FIELDS = gdn_aot_forward_plan_t: grids, the kernels' T, the workspace layout (REGIONS)
  routes              ROUTES: the kernels one forward launches (gdn_prepare + gdn_scan, or gdn_fused); the
                      dispatch table (loader/dispatch.py) picks a route and its variants per shape class
  dispatch rows       DISPATCH_ROW_FIELDS = gdn_aot_dispatch_row_t, the table compiled into the launcher

Imports only the standard library (no torch, no triton): the build, the loader and the kernels all read it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct

# 2: gdn_l2norm fused away; gdn_prepare/gdn_scan take q, rq, rk, flags; the library versioned (.so.2 soname)
# 3: rq, rk -> qg, kg (always written by gdn_prepare, always read by gdn_scan); gdn_prepare's grid (slots, H, 1);
#    gdn_aot_forward (both launches in one call)
# 4: the gdn_fused family and routes: gdn_aot_forward_args_t starts with the route and its kernels, one `options`
#    word replaces the two flag words; the dispatch table and gdn_aot_select in the launcher
# 5: the gating computed in the kernels: A_log and dt_bias (arguments of gdn_aot_forward, parameters of gdn_prepare
#    and gdn_fused after beta), options GATE_IN_KERNEL, GATE_BIAS, BETA_SIGMOID, BETA_NEG_EIGVAL; h0 and ht in the
#    variant's state dtype; gdn_aot_select takes the configuration's state_dtype, gating and checkpoints; the
#    prefix-cache state checkpoints: state_checkpoints, checkpoint_rows, checkpoint_cu_starts (int64) and
#    checkpoint_every_n_tokens (arguments of gdn_aot_forward, the last parameters of gdn_scan and gdn_fused, read by
#    their `checkpoints` variants)
# 6: gdn_fused tiles V: grid (num_seqs, HV, V // BV), the route's BV its variant's (BV > 0 on every route)
# 7: the fused_terms route (gdn_fused_terms: gdn_fused's state programs beside terms programs, a (sequence, head)'s
#    programs one cluster); gdn_fused's exchange_tiles, exchange_scalings and exchange_counters parameters (after
#    the checkpoint parameters); workspace regions per (sequence, value head), and regions zeroed by the forward
# 8: gdn_aot_kernel_t's `resident` (filled by gdn_aot_kernel_load); gdn_fused_terms launches cooperatively where its
#    grid fits on the device at once, in clusters only where it does not
LAUNCHER_ABI_VERSION = 8
# 2: `dispatch` holds the spec's preferences (`spec`) and the table (`table`); launcher.forward lists its routes
# 3: the variants' functional axes state_dtype, gating, checkpoints (in the dispatch table's configurations too)
MANIFEST_SCHEMA_VERSION = 3

WORKSPACE_ALIGN = 256  # every workspace region starts on this boundary (gdn_aot_forward_plan)
DTYPE_BYTES = {"bf16": 2, "fp16": 2}  # bytes of a q, k, v, o element per input dtype
# The chunk terms' hand-over of gdn_fused_terms (kernels/fused_sm90.py, docs/design.md "Terms programs"): a (sequence,
# value head) has TERMS_PROGRAMS terms programs, each taking every TERMS_PROGRAMS-th chunk, and each hands its
# chunks' terms to the state programs through a ring of EXCHANGE_SLOTS chunk slots in the workspace: two [BT, BT]
# tiles in the input dtype and EXCHANGE_SCALINGS [BT] fp32 rows a slot, and two int32 counters (ready, consumed).
TERMS_PROGRAMS = 2
EXCHANGE_SLOTS = 8
EXCHANGE_SCALINGS = 8

# Kernel parameter types, as Triton signature strings -> (C type, PTX param type, bytes, ctypes type name).
# Pointers ("*bf16", "*fp32", "*{dtype}" = the variant's input dtype, ...) are all POINTER_TYPE.
SCALAR_TYPES = {
    "i32": ("int32_t", "u32", 4, "c_int32"),
    "u32": ("uint32_t", "u32", 4, "c_uint32"),
    "i64": ("int64_t", "u64", 8, "c_int64"),
    "u64": ("uint64_t", "u64", 8, "c_uint64"),
    "fp32": ("float", "f32", 4, "c_float"),
    "fp64": ("double", "f64", 8, "c_double"),
}
POINTER_TYPE = ("CUdeviceptr", "u64", 8, "c_uint64")


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a C struct of the ABI: its name, C declaration type, struct/ctypes spelling and comment."""

    name: str
    ctype: str
    code: str  # struct module code (the forward's argument struct) or "" where never packed by struct
    ctypes: str  # ctypes type name
    doc: str = ""
    count: int = 1  # array length (1: a scalar field)

    @property
    def decl(self) -> str:
        sep = "" if self.ctype.endswith("*") else " "
        return f"{self.ctype}{sep}{self.name}" + (f"[{self.count}]" if self.count > 1 else "")


def _kernel_ptr(name, doc):
    return Field(name, "const gdn_aot_kernel_t *", "Q", "c_uint64", doc)


def _i64(name, doc=""):
    return Field(name, "int64_t", "q", "c_int64", doc)


def _ptr(name, doc=""):
    return Field(name, "CUdeviceptr", "Q", "c_uint64", doc)


# gdn_aot_kernel_t: a loaded variant (gdn_aot_kernel_load fills it)
KERNEL_FIELDS = (
    Field("module", "CUmodule", "", "c_void_p"),
    Field("function", "CUfunction", "", "c_void_p"),
    Field("num_warps", "unsigned", "", "c_uint", "blockDim.x = 32 * num_warps"),
    Field("shared", "unsigned", "", "c_uint", "dynamic shared memory bytes"),
    Field("scratch_size", "unsigned", "", "c_uint", "global scratch bytes per program (0: pass global_scratch = 0)"),
    Field("resident", "unsigned", "", "c_uint", "programs the device runs at once: occupancy times SMs"),
)


@dataclasses.dataclass(frozen=True)
class Option:
    """A bit of the forward's `options` word (GDN_AOT_FORWARD_<name>)."""

    name: str
    bit: int
    doc: str


OPTIONS = (
    Option("L2NORM", 1, "use_qk_l2norm_in_kernel: normalise the q and k rows"),
    Option("HAS_H0", 2, "read the initial state h0"),
    Option("STORE_HT", 4, "write the final state ht"),
    Option("USE_INDICES", 8, "h0 and ht are a pool of slots, sequence n's being state_indices[n]"),
    Option("GATE_IN_KERNEL", 16, "use_gate_in_kernel: g holds the raw a, g = -exp(A_log) softplus(a + dt_bias)"),
    Option("GATE_BIAS", 32, "with GATE_IN_KERNEL: add dt_bias (else no bias)"),
    Option("BETA_SIGMOID", 64, "use_beta_sigmoid_in_kernel: beta holds the raw b, beta = sigmoid(b)"),
    Option("BETA_NEG_EIGVAL", 128, "allow_neg_eigval, with BETA_SIGMOID: beta = 2 sigmoid(b), in (0, 2)"),
)
OPTION_BITS = {o.name: o.bit for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Flag:
    """A bit of a kernel family's `flags` parameter (GDN_AOT_<name> in C, gdn_aot.kernels.<name> in Python),
    set by gdn_aot_forward when the forward option of the same meaning is."""

    name: str
    bit: int
    option: str
    doc: str


@dataclasses.dataclass(frozen=True)
class Param:
    """A kernel runtime parameter: name, Triton type, and what gdn_aot_forward passes:
    "args.<field>" (of gdn_aot_forward_args_t, cast to the parameter's type), "workspace.<region>" (the region's
    address), "plan.<field>" (of gdn_aot_forward_plan_t) or "flags" (the family's flag bits of the options)."""

    name: str
    type: str
    source: str


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family as the launcher sees it."""

    name: str
    handle: str  # the field of gdn_aot_forward_args_t (and of a dispatch row) naming its loaded variant
    route: str
    grid: tuple  # three plan quantities (GRID_QUANTITIES) or ints
    grid_doc: str
    params: tuple[Param, ...]
    flags: tuple[Flag, ...]
    # its programs wait for each other: a grid that fits on the device at once (the kernel's `resident`) launches
    # cooperatively (every program resident together), a larger one with a (sequence, head)'s programs, the grid's z
    # extent, as one thread-block cluster (the GPU starts them together, the clusters in waves); either way a program
    # that waits for another never waits for one that cannot start
    co_resident: bool = False

    @property
    def kernel_params(self) -> tuple[tuple[str, str], ...]:
        """(name, type) in launch order: KernelDef.params."""
        return tuple((p.name, p.type) for p in self.params)


def _p(spec: str) -> tuple[Param, ...]:
    """Params from "name:type:source" words (source "args.<name>" when omitted)."""
    out = []
    for word in spec.split():
        name, ty, *src = word.split(":")
        out.append(Param(name, ty, src[0] if src else f"args.{name}"))
    return tuple(out)


_STATE_PARAMS = "h0:*{state} ht:*{state} state_indices:*i32 o:*{dtype}"
# last, after `flags`: the parameters before them keep their offsets, so a variant without checkpoints compiles to
# the SASS it had before they existed
_CHECKPOINT_PARAMS = (" state_checkpoints:*{state} checkpoint_rows:i64 checkpoint_cu_starts:*i64 "
                      "checkpoint_every_n_tokens:i32")
# gdn_fused's, last (as the checkpoints'): the terms hand-over of gdn_fused_terms, unused by gdn_fused
_EXCHANGE_PARAMS = (" exchange_tiles:*{dtype}:workspace.exchange_tiles "
                    "exchange_scalings:*fp32:workspace.exchange_scalings "
                    "exchange_counters:*i32:workspace.exchange_counters")
_FUSED_PARAMS = _p("q:*{dtype} k:*{dtype} v:*{dtype} g:*fp32 beta:*fp32 A_log:*fp32 dt_bias:*fp32 cu_seqlens:*i32 "
                   + _STATE_PARAMS + " scale:fp32 T:i32:plan.T_arg H:i32 HV:i32 flags:i32:flags"
                   + _CHECKPOINT_PARAMS + _EXCHANGE_PARAMS)


def _gate_flags(family: str, first: int) -> tuple[Flag, ...]:
    """The gating bits of a family that reads g and beta (gdn_prepare, gdn_fused), from bit `first` up, in this
    order (the kernels' GateSource reads them as one field)."""
    return (Flag(f"{family}_GATE_IN_KERNEL", first, "GATE_IN_KERNEL", "g = -exp(A_log) softplus(g + dt_bias)"),
            Flag(f"{family}_GATE_BIAS", first * 2, "GATE_BIAS", "add dt_bias in that formula"),
            Flag(f"{family}_BETA_SIGMOID", first * 4, "BETA_SIGMOID", "beta = sigmoid(beta)"),
            Flag(f"{family}_BETA_NEG_EIGVAL", first * 8, "BETA_NEG_EIGVAL", "with BETA_SIGMOID: beta = 2 sigmoid(beta)"))
# gdn_fused_terms compiles gdn_fused's source: the same parameters and flags
_FUSED_FLAGS = (
    Flag("FUSED_L2NORM", 1, "L2NORM", "normalise the q and k rows"),
    Flag("FUSED_HAS_H0", 2, "HAS_H0", "read the initial state"),
    Flag("FUSED_STORE_HT", 4, "STORE_HT", "write the final state"),
    Flag("FUSED_USE_INDICES", 8, "USE_INDICES", "state slot = state_indices[sequence] (-1: zero state, not written)"),
    *_gate_flags("FUSED", 16))
FAMILIES = {f.name: f for f in (
    Family(
        "gdn_prepare", "prepare", "prepare_scan", ("slots", "H", 1),
        "varlen: (T // BT + num_seqs, H, 1); fixed: (num_seqs * cdiv(T, BT), H, 1)",
        _p("q:*{dtype} k:*{dtype} v:*{dtype} g:*fp32 beta:*fp32 A_log:*fp32 dt_bias:*fp32 cu_seqlens:*i32 "
           "w:*{dtype}:workspace.w "
           "u:*{dtype}:workspace.u gam:*fp32:workspace.gam qg:*fp32:workspace.qg kg:*fp32:workspace.kg "
           "T:i32:plan.T_arg num_seqs:i32 H:i32 HV:i32 flags:i32:flags"),
        (Flag("PREPARE_L2NORM", 1, "L2NORM", "normalise k, fold the q/k row norms into qg and kg"),
         *_gate_flags("PREPARE", 2)),
    ),
    Family(
        "gdn_scan", "scan", "prepare_scan", ("num_seqs", "HV", "ztiles"), "(num_seqs, HV, V // BV)",
        _p("q:*{dtype} k:*{dtype} w:*{dtype}:workspace.w u:*{dtype}:workspace.u gam:*fp32:workspace.gam "
           "qg:*fp32:workspace.qg kg:*fp32:workspace.kg cu_seqlens:*i32 " + _STATE_PARAMS
           + " scale:fp32 T:i32:plan.T_arg H:i32 HV:i32 flags:i32:flags" + _CHECKPOINT_PARAMS),
        (Flag("SCAN_HAS_H0", 1, "HAS_H0", "read the initial state"),
         Flag("SCAN_STORE_HT", 2, "STORE_HT", "write the final state"),
         Flag("SCAN_USE_INDICES", 4, "USE_INDICES",
              "state slot = state_indices[sequence] (-1: zero state, not written)")),
    ),
    Family(
        "gdn_fused", "fused", "fused", ("num_seqs", "HV", "ztiles"), "(num_seqs, HV, V // BV)", _FUSED_PARAMS,
        _FUSED_FLAGS,
    ),
    Family(
        "gdn_fused_terms", "fused_terms", "fused_terms", ("num_seqs", "HV", "zterms"),
        f"(num_seqs, HV, V // BV + {TERMS_PROGRAMS}), cooperative or clusters (1, 1, V // BV + {TERMS_PROGRAMS})",
        _FUSED_PARAMS, _FUSED_FLAGS, co_resident=True,
    ),
)}
FLAGS = {fl.name: fl.bit for f in FAMILIES.values() for fl in f.flags}
# what a family's grid may name: computed by gdn_aot_forward_plan (slots: chunk slots, an upper bound on a batch's
# chunks; ztiles: V // BV; zterms: V // BV + TERMS_PROGRAMS) or an argument
GRID_QUANTITIES = ("slots", "ztiles", "zterms", "num_seqs", "H", "HV")
V_TILED = ("ztiles", "zterms")  # the grid z extents that tile V by the route's BV


def z_programs(z, V: int, BV: int) -> int:
    """A grid z extent's programs: an int as is, ztiles V // BV, zterms V // BV + TERMS_PROGRAMS."""
    if isinstance(z, int):
        return z
    return V // BV + (TERMS_PROGRAMS if z == "zterms" else 0)


@dataclasses.dataclass(frozen=True)
class Route:
    """The kernels one forward launches, in order (GDN_AOT_ROUTE_<name>); `refuses`: (arch, option, why) of the
    options its kernels cannot honour on that arch: gdn_aot_forward returns CUDA_ERROR_INVALID_VALUE for them and
    the Python API raises `why`."""

    name: str
    id: int
    families: tuple[str, ...]
    refuses: tuple[tuple[str, str, str], ...] = ()
    # a route whose kernels compute bit for bit what this one's do (the GPU suite checks it): batches sent to
    # either stay batch invariant
    same_bits_as: str = ""

    @property
    def bits(self) -> str:
        return self.same_bits_as or self.name


_FUSED_REFUSES = (
    ("sm_90a", "BETA_NEG_EIGVAL",
     "allow_neg_eigval=True: the sm_90a gdn_fused inverts each chunk's I + A in fp16, and with beta up to 2 the "
     "powers of a block of near-identical keys exceed fp16's range; use artifacts whose dispatch sends gating "
     "configurations to gdn_prepare + gdn_scan (specs/qwen35.yaml)"),)
ROUTES = {r.name: r for r in (
    Route("prepare_scan", 0, ("gdn_prepare", "gdn_scan")),
    Route("fused", 1, ("gdn_fused",), refuses=_FUSED_REFUSES),
    Route("fused_terms", 2, ("gdn_fused_terms",), refuses=_FUSED_REFUSES, same_bits_as="fused"),
)}


@dataclasses.dataclass(frozen=True)
class Region:
    """A workspace region of gdn_aot_forward: `per` ("row_head": rows x HV; "seq_head": num_seqs x HV) x the product
    of `size` (names of arguments, or byte counts) bytes, used by the routes named; another route's call gives it 0
    bytes. `zeroed`: gdn_aot_forward sets it to zero (on the call's stream) before the route's launches. The
    global scratch (the larger of the route's launches' needs, shared by them) follows the regions."""

    name: str
    size: tuple
    routes: tuple[str, ...]
    doc: str
    per: str = "row_head"
    zeroed: bool = False


_RING_SLOTS = TERMS_PROGRAMS * EXCHANGE_SLOTS  # exchange ring slots a (sequence, value head)
REGIONS = (
    Region("w", ("K", "elt"), ("prepare_scan",), "w [rows, HV, K], input dtype"),
    Region("u", ("V", "elt"), ("prepare_scan",), "u [rows, HV, V], input dtype"),
    Region("gam", (4,), ("prepare_scan",), "gam [HV, rows] fp32: the chunk-local cumsum of g"),
    Region("qg", (4,), ("prepare_scan",), "qg [HV, rows] fp32: gam + ln rq"),
    Region("kg", (4,), ("prepare_scan",), "kg [HV, rows] fp32: gam - ln rk"),
    Region("exchange_tiles", (_RING_SLOTS * 2, "BT", "BT", "elt"), ("fused_terms",),
           "[num_seqs, HV, TERMS_PROGRAMS, EXCHANGE_SLOTS, 2, BT, BT] input dtype: Tc diag(beta) and P", "seq_head"),
    Region("exchange_scalings", (_RING_SLOTS * EXCHANGE_SCALINGS * 4, "BT"), ("fused_terms",),
           "[num_seqs, HV, TERMS_PROGRAMS, EXCHANGE_SLOTS, EXCHANGE_SCALINGS, BT] fp32: the row scalings",
           "seq_head"),
    Region("exchange_counters", (_RING_SLOTS * 2 * 4,), ("fused_terms",),
           "[num_seqs, HV, TERMS_PROGRAMS, EXCHANGE_SLOTS, 2] int32: a slot's ready and consumed counts",
           "seq_head", zeroed=True),
)

# gdn_aot_forward_args_t. The fields of a route (the same for every call of a dispatch row) come first, then the
# fields of a call, so the Python API packs the first group once per route.
ROUTE_FIELDS = (
    _i64("route", "GDN_AOT_ROUTE_*: the dispatch row's route"),
    *(_kernel_ptr(f.handle, f"the loaded {f.name} variant (route {f.route}; else 0)") for f in FAMILIES.values()),
    _i64("K"), _i64("V"),
    _i64("BT", "the variants' chunk length (kernels.tsv column BT)"),
    _i64("BV", "the V tile of the route's kernel that tiles V, gdn_scan or gdn_fused (kernels.tsv column BV)"),
    _i64("elt", "bytes per q/k/v element: 2"),
)
CALL_FIELDS = (
    Field("stream", "CUstream", "Q", "c_uint64"),
    *(_ptr(n) for n in ("q", "k", "v", "g", "beta")),
    _ptr("A_log", "[HV] fp32 with GATE_IN_KERNEL (else 0)"),
    _ptr("dt_bias", "[HV] fp32 with GATE_BIAS (else 0)"),
    *(_ptr(n) for n in ("cu_seqlens", "h0", "ht", "state_indices", "o")),
    _ptr("state_checkpoints", "[checkpoint_rows, HV, K, V] ([.., V, K] transposed) in the state dtype: the state "
                              "after every checkpoint_every_n_tokens tokens of each sequence"),
    _i64("checkpoint_rows", "state_checkpoints' rows: the kernels write none past them (0: no buffer)"),
    _ptr("checkpoint_cu_starts", "[num_seqs + 1] int64: sequence n's checkpoints are rows [cu_starts[n], "
                                 "cu_starts[n + 1]) of state_checkpoints, seq_len_n // N of them"),
    _i64("checkpoint_every_n_tokens", "N: 0 (no checkpoints) or a multiple of BT; needs a checkpoints variant"),
    _ptr("workspace", "GDN_AOT_WORKSPACE_ALIGN-byte aligned"),
    Field("workspace_bytes", "uint64_t", "Q", "c_uint64", "its size: at least the plan's workspace_bytes"),
    _i64("B", "q is [B, T, H, K]"),
    _i64("T"),
    _i64("num_seqs", "N: cu_seqlens has N + 1 entries (or N = B)"),
    _i64("H"), _i64("HV"),
    _i64("options", "GDN_AOT_FORWARD_* bits"),
    Field("scale", "double", "d", "c_double", "passed to the kernels as float"),
)
FORWARD_ARG_FIELDS = ROUTE_FIELDS + CALL_FIELDS
ROUTE_ARGS = struct.Struct("=" + "".join(f.code for f in ROUTE_FIELDS))
CALL_ARGS = struct.Struct("=" + "".join(f.code for f in CALL_FIELDS))
FORWARD_ARGS = struct.Struct("=" + "".join(f.code for f in FORWARD_ARG_FIELDS))

# gdn_aot_forward_plan_t: a grid per family, the kernels' T, a byte offset per region and for the scratch
PLAN_FIELDS = (
    *(Field(f"{f.handle}_grid", "unsigned", "", "c_uint", f"{f.name}: {f.grid_doc}", 3) for f in FAMILIES.values()),
    Field("T_arg", "int32_t", "", "c_int32", "the kernels' `T`: rows for varlen batches, T for fixed-length ones"),
    *(Field(r.name, "uint64_t", "", "c_uint64", r.doc) for r in REGIONS),
    Field("scratch", "uint64_t", "", "c_uint64", "the global scratch the route's launches share"),
    Field("scratch_bytes", "uint64_t", "", "c_uint64", "its size: the largest of the route's launches' needs"),
    Field("workspace_bytes", "uint64_t", "", "c_uint64", "the workspace the call needs"),
)

# gdn_aot_dispatch_row_t: a row of the dispatch table (loader/dispatch.py builds it; gdn_aot_select reads it)
BOUNDS = {"any": 0, "le": 1, "lt": 2}  # GDN_AOT_BOUND_*: every batch; programs * den <= / < sm_count * num
DISPATCH_ROW_FIELDS = (
    Field("dtype", "const char *", "", "c_char_p", "\"bf16\" | \"fp16\""),
    *(Field(n, "int32_t", "", "c_int32") for n in ("K", "V", "varlen", "transpose")),
    Field("state_dtype", "const char *", "", "c_char_p", "\"fp32\" | \"bf16\" | \"fp16\" | \"fp8e4m3\" | \"fp8e5m2\""),
    *(Field(n, "int32_t", "", "c_int32") for n in ("gating", "checkpoints")),
    Field("bound", "int32_t", "", "c_int32", "GDN_AOT_BOUND_*: which num_seqs * HV (programs) the row takes"),
    Field("num", "int32_t", "", "c_int32", "programs * den <= (or <) sm_count * num"),
    Field("den", "int32_t", "", "c_int32"),
    Field("route", "int32_t", "", "c_int32", "GDN_AOT_ROUTE_*"),
    *(Field(f.handle, "const char *", "", "c_char_p", f"{f.name} variant key (kernels.tsv), NULL where unused")
      for f in FAMILIES.values()),
    Field("shape_class", "const char *", "", "c_char_p", "the row's shape class, for messages"),
)


def ctypes_struct(name: str, fields) -> type:
    """A ctypes.Structure mirroring a C struct of the ABI."""
    return type(name, (ctypes.Structure,), {"_fields_": [
        (f.name, getattr(ctypes, f.ctypes) * f.count if f.count > 1 else getattr(ctypes, f.ctypes)) for f in fields]})


KernelStruct = ctypes_struct("KernelStruct", KERNEL_FIELDS)
ForwardPlan = ctypes_struct("ForwardPlan", PLAN_FIELDS)
DispatchRow = ctypes_struct("DispatchRow", DISPATCH_ROW_FIELDS)


def param_abi(name: str, ty: str) -> dict:
    """A kernel parameter as the launcher passes it: {name, type, kind, ctype, ptx, bytes, ctypes}."""
    if ty.startswith("*"):
        (ctype, ptx, size, ct), kind = POINTER_TYPE, "pointer"
    elif ty in SCALAR_TYPES:
        (ctype, ptx, size, ct), kind = SCALAR_TYPES[ty], "scalar"
    else:
        raise ValueError(f"parameter {name!r} has type {ty!r}, which the launcher does not support "
                         f"(pointers and {sorted(SCALAR_TYPES)})")
    return {"name": name, "type": ty, "kind": kind, "ctype": ctype, "ptx": ptx, "bytes": size, "ctypes": ct}


def families_of(route: str) -> list[Family]:
    return [FAMILIES[n] for n in ROUTES[route].families]


def region_bytes(route: str, values: dict, per: str) -> int:
    """Bytes per (row, value head) (per "row_head") or per (sequence, value head) ("seq_head") of the route's
    workspace regions, the sizes named by `values` (K, V, BT, elt)."""
    total = 0
    for r in REGIONS:
        if route in r.routes and r.per == per:
            size = 1
            for f in r.size:
                size *= values[f] if isinstance(f, str) else f
            total += size
    return total
