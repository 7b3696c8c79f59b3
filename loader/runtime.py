"""ctypes binding of the generated launcher, lazily loaded kernels, and variant dispatch.

    arts = Artifacts.for_device(q.device)                 # ArtifactSet for that GPU's arch (exact match)
    k = arts.pick("gdn_scan", dtype="bf16", varlen=True, transpose=False, BV=arts.choose_BV("gdn_scan", n * HV, sms))
    k.launch((n, HV, 128 // k.axes["BV"]), stream_ptr, q.data_ptr(), ..., scratch_ptr=scratch.data_ptr())
    fwd = arts.forward("bf16", 128, 128, varlen=True, transpose=False)  # both kernels of a call: fwd.load() once,
    fwd.launch(FORWARD_ARGS.pack(fwd.prepare.handle, fwd.scan_for(n * HV).handle, stream_ptr, ...))  # then 1 call

The first launch of a Kernel on a device verifies the cubin's sha256 and loads its module in that device's primary
context (once, under a lock). After that a launch is one dict-free ctypes call.
"""
from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from pathlib import Path

from gdn_aot.loader.artifacts import ENV_VAR, LAUNCHER_ABI_VERSION, Manifest, arch_for_capability, locate_root
from gdn_aot.loader.errors import CorruptArtifact, DriverError, DriverTooOld, VariantNotBuilt

CUDA_ERROR_NO_BINARY_FOR_GPU = 209
CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222
CUDA_ERROR_INVALID_IMAGE = 200
CUDA_ERROR_INVALID_CONTEXT = 201

_CTYPES = {"c_uint64": ctypes.c_uint64, "c_int64": ctypes.c_int64, "c_int32": ctypes.c_int32,
           "c_uint32": ctypes.c_uint32, "c_float": ctypes.c_float, "c_double": ctypes.c_double}


WORKSPACE_ALIGN = 256  # every region of the forward's workspace starts on this boundary (gdn_aot_forward_plan)
# gdn_aot_forward_args_t (gdn_aot_launch.h) field by field: (name, struct code, C type, comment). All are 8 bytes
# wide, so the C struct has no padding; the build renders it from this list and the loader packs it with FORWARD_ARGS.
FORWARD_ARG_FIELDS = (
    ("prepare", "Q", "const gdn_aot_kernel_t *", "the loaded gdn_prepare variant"),
    ("scan", "Q", "const gdn_aot_kernel_t *", "the loaded gdn_scan variant"),
    ("stream", "Q", "CUstream", None),
    *((n, "Q", "CUdeviceptr", None) for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "h0", "ht", "state_indices",
                                              "o")),
    ("workspace", "Q", "CUdeviceptr", "GDN_AOT_WORKSPACE_ALIGN-byte aligned"),
    ("workspace_bytes", "Q", "uint64_t", "its size: at least the plan's workspace_bytes"),
    ("B", "q", "int64_t", "q is [B, T, H, K]"),
    ("T", "q", "int64_t", None),
    ("num_seqs", "q", "int64_t", "N: cu_seqlens has N + 1 entries (or N = B)"),
    *((n, "q", "int64_t", None) for n in ("H", "HV", "K", "V")),
    ("BT", "q", "int64_t", "the variants' chunk length (kernels.tsv column BT)"),
    ("BV", "q", "int64_t", "the gdn_scan variant's V tile (kernels.tsv column BV)"),
    ("elt", "q", "int64_t", "bytes per q/k/v element: 2"),
    ("prepare_flags", "q", "int64_t", "GDN_AOT_PREPARE_* bits"),
    ("scan_flags", "q", "int64_t", "GDN_AOT_SCAN_* bits"),
    ("scale", "d", "double", "passed to gdn_scan as float"),
)
FORWARD_ARGS = struct.Struct("=" + "".join(f[1] for f in FORWARD_ARG_FIELDS))


class KernelStruct(ctypes.Structure):
    """Mirror of gdn_aot_kernel_t (gdn_aot_launch.h); its size is checked against the library's."""

    _fields_ = [("module", ctypes.c_void_p), ("function", ctypes.c_void_p), ("num_warps", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("scratch_size", ctypes.c_uint)]


class ForwardPlan(ctypes.Structure):
    """Mirror of gdn_aot_forward_plan_t (gdn_aot_launch.h)."""

    _fields_ = [("prepare_grid", ctypes.c_uint * 3), ("scan_grid", ctypes.c_uint * 3), ("T_arg", ctypes.c_int32),
                *((n, ctypes.c_uint64) for n in ("w", "u", "gam", "qg", "kg", "scratch", "scratch_bytes",
                                                 "workspace_bytes"))]


class Launcher:
    """The generated libgdn_aot_launch.so of one arch. Opening it needs no driver; init() does."""

    _lock = threading.Lock()
    _open: dict[str, "Launcher"] = {}

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        lib.gdn_aot_abi_version.restype = ctypes.c_uint
        lib.gdn_aot_kernel_struct_size.restype = ctypes.c_uint
        lib.gdn_aot_init.restype = ctypes.c_int
        lib.gdn_aot_error_string.restype = ctypes.c_char_p
        lib.gdn_aot_error_string.argtypes = [ctypes.c_int]
        lib.gdn_aot_kernel_load.restype = ctypes.c_int
        lib.gdn_aot_kernel_load.argtypes = [ctypes.POINTER(KernelStruct), ctypes.c_char_p, ctypes.c_char_p,
                                            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
        lib.gdn_aot_kernel_unload.restype = ctypes.c_int
        lib.gdn_aot_kernel_unload.argtypes = [ctypes.POINTER(KernelStruct)]
        if lib.gdn_aot_abi_version() != LAUNCHER_ABI_VERSION:
            raise CorruptArtifact(f"{path} speaks launcher ABI {lib.gdn_aot_abi_version()}, this loader "
                                  f"{LAUNCHER_ABI_VERSION}; rebuild the artifacts")
        if lib.gdn_aot_kernel_struct_size() != ctypes.sizeof(KernelStruct):
            raise CorruptArtifact(f"{path}: gdn_aot_kernel_t is {lib.gdn_aot_kernel_struct_size()} bytes, the "
                                  f"loader's mirror {ctypes.sizeof(KernelStruct)}")
        # gdn_aot_forward (built when the spec has both kernels) and its helpers take one argument, the packed
        # FORWARD_ARGS as bytes (ctypes passes a pointer to their buffer; the C side copies the struct out)
        self.forward = getattr(lib, "gdn_aot_forward", None)
        if self.forward is not None:
            lib.gdn_aot_forward_args_size.restype = ctypes.c_uint
            if lib.gdn_aot_forward_args_size() != FORWARD_ARGS.size:
                raise CorruptArtifact(f"{path}: gdn_aot_forward_args_t is {lib.gdn_aot_forward_args_size()} bytes, "
                                      f"the loader packs {FORWARD_ARGS.size}")
            self.forward.restype = ctypes.c_int
            self.forward.argtypes = [ctypes.c_char_p]
            self.workspace_bytes = lib.gdn_aot_forward_workspace_bytes
            self.workspace_bytes.restype = ctypes.c_int64
            self.workspace_bytes.argtypes = [ctypes.c_char_p]
            lib.gdn_aot_forward_plan.restype = ctypes.c_int
            lib.gdn_aot_forward_plan.argtypes = [ctypes.c_char_p, ctypes.POINTER(ForwardPlan)]
        self.lib = lib
        self._initialized = False

    @classmethod
    def open(cls, path: Path) -> "Launcher":
        key = str(Path(path).resolve())
        with cls._lock:
            if key not in cls._open:
                cls._open[key] = cls(Path(key))
            return cls._open[key]

    def error_string(self, code: int) -> str:
        return self.lib.gdn_aot_error_string(code).decode()

    def init(self) -> None:
        if not self._initialized:
            r = self.lib.gdn_aot_init()
            if r:
                raise DriverError(f"gdn_aot_init failed: CUresult {r} ({self.error_string(r)})", r)
            self._initialized = True

    def plan(self, args: bytes) -> ForwardPlan:
        """gdn_aot_forward_plan of packed FORWARD_ARGS: grids and workspace layout (no driver needed)."""
        plan = ForwardPlan()
        r = self.lib.gdn_aot_forward_plan(args, ctypes.byref(plan))
        if r:
            raise DriverError(f"gdn_aot_forward_plan refused the arguments: CUresult {r} ({self.error_string(r)})", r)
        return plan

    def function(self, kernel: str, params: list[dict]):
        """The family's launch function with argtypes from the manifest's param list."""
        fn = getattr(self.lib, f"gdn_aot_launch_{kernel}")
        if fn.argtypes is None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(KernelStruct), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_uint] + [_CTYPES[p["ctypes"]] for p in params if p["kind"] != "profile_scratch"]
        return fn


class Kernel:
    """One built variant on one device. `launch()` loads the module on first use (thread-safe)."""

    def __init__(self, manifest: Manifest, key: str, device_index: int):
        entry = manifest.variants[key]
        self.manifest = manifest
        self.key = key
        self.device_index = device_index
        self.entry = entry
        self.name = entry["kernel"]
        self.axes = entry["axes"]
        self.num_warps = entry["num_warps"]
        self.shared = entry["shared"]
        self.scratch_size = entry["global_scratch_size"]
        self.scratch_align = entry["global_scratch_align"]
        self.grid_rule = entry["grid"]
        self.params = entry["params"]
        self.BT, self.BV = self.axes["BT"], self.axes["BV"]
        self._lock = threading.Lock()
        self._struct: KernelStruct | None = None
        self._ref = None
        self._fn = None
        self.handle = 0  # the address of the loaded gdn_aot_kernel_t (0: not loaded), for gdn_aot_forward

    def __repr__(self):
        return f"Kernel({self.key!r}, device={self.device_index})"

    def scratch_bytes(self, grid) -> int:
        """Global scratch the caller must pass for this grid (0: pass scratch_ptr=0)."""
        return self.scratch_size * grid[0] * grid[1] * grid[2]

    def load(self) -> None:
        with self._lock:
            if self._struct is not None:
                return
            image = self.manifest.read_cubin(self.key)  # verifies sha256 before the first load
            launcher = Launcher.open(self.manifest.verify_launcher())
            launcher.init()
            struct = KernelStruct()
            args = (ctypes.byref(struct), image, self.entry["entry"].encode(), self.num_warps, self.shared,
                    self.scratch_size)
            r = launcher.lib.gdn_aot_kernel_load(*args)
            if r == CUDA_ERROR_INVALID_CONTEXT:  # the device's primary context is not current yet: make it so
                r = self._load_in_torch_context(launcher, args)
            if r:
                raise self._load_error(launcher, r)
            self._fn = launcher.function(self.name, self.params)
            self._ref = ctypes.byref(struct)
            self._struct = struct
            self.handle = ctypes.addressof(struct)

    def _load_in_torch_context(self, launcher, args) -> int:
        import torch

        with torch.cuda.device(self.device_index):
            torch.cuda.synchronize(self.device_index)  # initialises the primary context
            return launcher.lib.gdn_aot_kernel_load(*args)

    def _load_error(self, launcher, r: int) -> Exception:
        m = self.manifest
        text = f"CUresult {r} ({launcher.error_string(r)})"
        if r in (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, CUDA_ERROR_NO_BINARY_FOR_GPU):
            return DriverTooOld(
                f"the driver refused {self.key} ({text}): the cubin is {m.arch} code from ptxas "
                f"{m.data.get('ptxas_version')}; update the NVIDIA driver, or check the GPU is {m.arch}")
        if r == CUDA_ERROR_INVALID_IMAGE:
            return CorruptArtifact(f"the driver says {self.key}'s cubin is invalid ({text}); rebuild with "
                                   f"{m.build_command()}")
        return DriverError(f"loading {self.key} on cuda:{self.device_index} failed: {text}", r)

    def launch(self, grid, stream, *args, scratch_ptr: int = 0) -> None:
        """Launch on `stream` (a CUstream / cudaStream_t as int, 0 = legacy default) with the runtime args in
        manifest order (pointers as ints, scalars as Python numbers)."""
        if self._struct is None:
            self.load()
        r = self._fn(self._ref, stream, grid[0], grid[1], grid[2], *args, scratch_ptr)
        if r:
            raise DriverError(f"launching {self.key} with grid {tuple(grid)} failed: CUresult {r} "
                              f"({Launcher.open(self.manifest.launcher_path()).error_string(r)})", r)

    def unload(self) -> None:
        with self._lock:
            if self._struct is not None:
                Launcher.open(self.manifest.launcher_path()).lib.gdn_aot_kernel_unload(self._ref)
                self._struct = self._ref = self._fn = None
                self.handle = 0


class Forward:
    """The two launches of one forward configuration on one device: gdn_prepare and the gdn_scan variant the spec's
    dispatch picks for the batch (scan_for), run by the launcher's gdn_aot_forward, which computes the grids and
    carves the workspace, from packed FORWARD_ARGS: with load() done, a call is one ctypes call of one argument."""

    def __init__(self, arts: "ArtifactSet", dtype: str, K: int, V: int, varlen: bool, transpose: bool,
                 sm_count: int):
        self.prepare = arts.pick("gdn_prepare", dtype=dtype, K=K, V=V, varlen=varlen)
        self.small_below = arts.small_batch_programs("gdn_scan", sm_count)

        def scan(programs):
            return arts.pick("gdn_scan", dtype=dtype, K=K, V=V, varlen=varlen, transpose=transpose,
                             BV=arts.choose_BV("gdn_scan", programs, sm_count))
        self.scan_large = scan(self.small_below)
        self.scan_small = scan(0) if self.small_below else self.scan_large
        # the single-wave tier, ahead of the two above: (most num_seqs * HV, variant), fewest programs first
        self.single_wave = arts.single_wave_scans(dtype=dtype, K=K, V=V, varlen=varlen, transpose=transpose,
                                                  sm_count=sm_count)
        self.wave_upto = self.single_wave[-1][0] if self.single_wave else -1
        self.manifest, self.device_index, self.BT = arts.manifest, arts.device_index, self.prepare.BT
        self.V, self.varlen = V, varlen
        self.elt = {"bf16": 2, "fp16": 2}[dtype]  # bytes per q, k, v element
        self.row_bytes = (K + V) * self.elt + 3 * 4  # workspace bytes per row and value head: w, u; gam, qg, kg
        self.padding = 6 * (WORKSPACE_ALIGN - 1)
        self.launcher: Launcher | None = None  # set by load()

    def scan_for(self, programs: int) -> Kernel:
        """The gdn_scan variant for num_seqs * HV programs: the single-wave tier (ArtifactSet.single_wave_scans)
        when it covers them, else ArtifactSet.choose_BV's rule."""
        if programs <= self.wave_upto:
            return next(k for upto, k in self.single_wave if programs <= upto)
        return self.scan_small if programs < self.small_below else self.scan_large

    @property
    def scans(self) -> tuple[Kernel, ...]:
        return (self.scan_small, self.scan_large) + tuple(k for _, k in self.single_wave)

    def load(self) -> None:
        """Load the kernels on the device (in its primary context, whatever device is current) and bind the
        launcher's forward entry points; idempotent."""
        import torch

        with torch.cuda.device(self.device_index):
            for kernel in (self.prepare, ) + self.scans:
                kernel.load()
        launcher = Launcher.open(self.manifest.launcher_path())
        if launcher.forward is None:
            raise CorruptArtifact(f"{launcher.path} has no gdn_aot_forward (built from a spec without both "
                                  f"gdn_prepare and gdn_scan?); rebuild with {self.manifest.build_command()}")
        self.launcher = launcher

    def workspace_bytes(self, scan: Kernel, B: int, T: int, num_seqs: int, H: int, HV: int) -> int:
        """Enough workspace for the call: the regions of gdn_aot_forward_plan (w, u, gam, qg, kg, scratch) each
        padded to the full WORKSPACE_ALIGN (at most 6 * 255 bytes more than the plan's exact workspace_bytes,
        which gdn_aot_forward checks it against; tests/test_abi.py compares the two)."""
        rows = B * T
        slots = rows // self.BT + num_seqs if self.varlen else num_seqs * -(-T // self.BT)  # gdn_prepare's grid x
        scratch = max(self.prepare.scratch_size * slots * H, scan.scratch_size * num_seqs * HV * (self.V // scan.BV))
        return rows * HV * self.row_bytes + scratch + self.padding

    def launch(self, args: bytes) -> None:
        """gdn_prepare then gdn_scan with packed FORWARD_ARGS, in the current context (the device's)."""
        r = self.launcher.forward(args)
        if r:
            self.failed(r, args)

    def failed(self, r: int, args: bytes):
        """Raise the DriverError of a gdn_aot_forward that returned r, with its arguments."""
        keys = {k.handle: k.key for k in (self.prepare, ) + self.scans if k.handle}
        values = ", ".join(f"{f[0]}={keys.get(x, x) if i < 2 else x}"
                           for i, (f, x) in enumerate(zip(FORWARD_ARG_FIELDS, FORWARD_ARGS.unpack(args))))
        raise DriverError(f"gdn_aot_forward failed: CUresult {r} ({self.launcher.error_string(r)}); {values}", r)


class ArtifactSet:
    """The variants built for one arch, bound to one device index."""

    def __init__(self, manifest: Manifest, device_index: int = 0):
        self.manifest = manifest
        self.arch = manifest.arch
        self.device_index = device_index
        self._kernels: dict[str, Kernel] = {}
        self._picked: dict[tuple, Kernel] = {}
        self._forwards: dict[tuple, Forward] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"ArtifactSet({self.manifest.dir}, device={self.device_index}, {len(self.manifest.variants)} variants)"

    @property
    def keys(self) -> list[str]:
        return list(self.manifest.variants)

    @functools.cached_property
    def head_dims(self) -> frozenset[tuple[int, int]]:
        """(K, V) pairs gdn_scan is built for."""
        return frozenset((e["axes"]["K"], e["axes"]["V"]) for e in self.manifest.variants.values()
                         if e["kernel"] == "gdn_scan")

    def kernel(self, key: str) -> Kernel:
        k = self._kernels.get(key)
        if k is None:
            if key not in self.manifest.variants:
                raise self._not_built(f"variant {key!r}", key.split(".")[0])
            with self._lock:
                k = self._kernels.setdefault(key, Kernel(self.manifest, key, self.device_index))
        return k

    def dispatch(self, kernel: str) -> dict:
        return self.manifest.dispatch.get(kernel, {})

    def small_batch_programs(self, kernel: str, sm_count: int) -> float:
        """Below this many programs the spec's small_batch_BV applies: small_batch_factor * SMs (a fraction is
        allowed; 0: no such rule)."""
        d = self.dispatch(kernel)
        return d.get("small_batch_factor", 2) * sm_count if "small_batch_BV" in d else 0

    def single_wave_scans(self, *, dtype: str, K: int, V: int, varlen: bool, transpose: bool,
                          sm_count: int) -> list[tuple[int, Kernel]]:
        """The spec's single-wave rule for gdn_scan as [(most num_seqs * HV, variant)], smallest BV first: the
        built variants with num_warps == single_wave_warps, each taking the batches whose grid
        num_seqs * HV * V / BV fits one program an SM and that no smaller BV takes. Empty without the rule."""
        warps = self.dispatch("gdn_scan").get("single_wave_warps")
        if warps is None:
            return []
        want = {"dtype": dtype, "K": K, "V": V, "varlen": varlen, "transpose": transpose}
        bvs = sorted(self.manifest.variants[key]["axes"]["BV"] for key in self._matching("gdn_scan", want, warps))
        tiers = []
        for bv in bvs:
            upto = sm_count // (V // bv)
            if upto > (tiers[-1][0] if tiers else 0):
                tiers.append((upto, self.pick("gdn_scan", BV=bv, num_warps=warps, **want)))
        return tiers

    def choose_BV(self, kernel: str, programs: int, sm_count: int) -> int | None:
        """The spec's preference: small_batch_BV when programs (num_seqs * HV) < small_batch_factor * SMs,
        else default_BV; None when the spec says nothing (pick() then takes any built BV)."""
        if programs < self.small_batch_programs(kernel, sm_count):
            return self.dispatch(kernel)["small_batch_BV"]
        return self.dispatch(kernel).get("default_BV")

    def forward(self, dtype: str, K: int, V: int, varlen: bool, transpose: bool,
                sm_count: int | None = None) -> Forward:
        """The Forward of this configuration, made once per configuration and device. sm_count (for the BV rule)
        defaults to the device's."""
        key = (dtype, K, V, varlen, transpose)
        f = self._forwards.get(key)
        if f is None:
            if sm_count is None:
                import torch

                sm_count = torch.cuda.get_device_properties(self.device_index).multi_processor_count
            f = Forward(self, dtype, K, V, varlen, transpose, sm_count)
            with self._lock:
                f = self._forwards.setdefault(key, f)
        return f

    def pick(self, kernel: str, *, dtype: str, K: int | None = None, V: int | None = None, varlen: bool = False,
             transpose: bool = False, BV: int | None = None, BT: int | None = None,
             num_warps: int | None = None) -> Kernel:
        """The built variant for these axes: BV if built, else the spec's default_BV, else any built one."""
        cache_key = (kernel, dtype, K, V, varlen, transpose, BV, BT, num_warps)
        k = self._picked.get(cache_key)
        if k is not None:
            return k
        want = {"dtype": dtype, "K": K, "V": V, "BT": BT, "varlen": varlen, "transpose": transpose}
        uses = self.manifest.data.get("kernels", {}).get(kernel, {}).get("uses_axes")
        if uses is not None:  # an axis the kernel's code ignores holds one (default) value: do not match on it
            want = {a: x for a, x in want.items() if a in uses}
        cands = self._matching(kernel, want, num_warps)
        if not cands:
            desc = ", ".join(f"{a}={x}" for a, x in want.items() if x is not None)
            raise self._not_built(f"{kernel} with {desc}", kernel)
        by_bv: dict[int, str] = {}
        for key in sorted(cands, key=lambda c: (self.manifest.variants[c]["num_warps"], c)):
            by_bv.setdefault(self.manifest.variants[key]["axes"]["BV"], key)
        default = self.dispatch(kernel).get("default_BV")
        chosen = by_bv.get(BV) or by_bv.get(default) or by_bv[max(by_bv)]
        k = self.kernel(chosen)
        self._picked[cache_key] = k
        return k

    def _matching(self, kernel: str, want: dict, num_warps: int | None) -> list[str]:
        """Keys of the built variants of `kernel` whose axes equal `want`'s (None matches anything) and, unless
        None, whose num_warps is `num_warps`."""
        return [key for key, e in self.manifest.variants.items()
                if e["kernel"] == kernel and all(x is None or e["axes"][a] == x for a, x in want.items())
                and (num_warps is None or e["num_warps"] == num_warps)]

    def _not_built(self, what: str, kernel: str) -> VariantNotBuilt:
        m = self.manifest
        built = [k for k in m.variants if k.startswith(kernel + ".")] or list(m.variants)
        failed = [f"{k} (log: {log})" for k, log in m.failed.items() if k.startswith(kernel + ".")]
        return VariantNotBuilt(
            f"{what} is not built for {m.arch} in {m.dir}. Built: {built or 'none'}."
            + (f" Failed to compile in the last build: {failed}." if failed else "")
            + f" Add it to a spec and run {m.build_command()}.")


class Artifacts:
    """Entry point: `Artifacts.for_device(device, capability=None, root=None) -> ArtifactSet`."""

    _sets: dict[tuple, ArtifactSet] = {}
    _requests: dict[tuple, ArtifactSet] = {}  # what each (root, env, cwd, device, capability) resolved to
    _lock = threading.Lock()

    @classmethod
    def for_device(cls, device=None, capability=None, root=None) -> ArtifactSet:
        """ArtifactSet of the device's arch. `capability` (major, minor) overrides the query (tests fake
        devices with it); without it torch.cuda reports the device's capability. A repeated request is a
        dict lookup (no capability query, no file system search): this is on every forward's path. It is
        resolved again when what chose its root changed: $GDN_AOT_ARTIFACTS (without an explicit root), or the
        working directory (when the root was its ./artifacts)."""
        index = device if type(device) is int else _device_index(device)
        request = (None if root is None else str(root), index, None if capability is None else tuple(capability))
        hit = cls._requests.get(request)
        if hit is not None:
            s, env, cwd = hit
            if (root is not None or _env_root() == env) and (cwd is None or cwd == os.getcwd()):
                return s
        env = None if root is not None else _env_root()
        s, origin = cls._resolve(index, capability, root)
        cls._requests[request] = (s, env, os.getcwd() if origin == "working directory" else None)
        return s

    @classmethod
    def _resolve(cls, index: int, capability, root) -> tuple[ArtifactSet, str]:
        if capability is None:
            import torch

            capability = torch.cuda.get_device_capability(index)
        arch = arch_for_capability(capability)
        origin, root_path = locate_root(root)
        root_path = root_path.resolve()
        key = (str(root_path), arch, index)
        s = cls._sets.get(key)
        if s is None:
            with cls._lock:
                s = cls._sets.get(key)
                if s is None:
                    s = cls._sets[key] = ArtifactSet(Manifest(root_path, arch), index)
        return s, origin

    @classmethod
    def clear(cls) -> None:
        """Forget cached sets (after rebuilding artifacts in-process)."""
        with cls._lock:
            cls._sets.clear()
            cls._requests.clear()


try:  # CPython's os.environ keeps its values in a dict of encoded keys: a lookup there costs ~0.05 us, not ~1 us
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(ENV_VAR)
except AttributeError:  # another implementation
    _ENV_DATA = None


def _env_root():
    """$GDN_AOT_ARTIFACTS, as a value only compared with earlier ones (bytes on CPython)."""
    return _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get(ENV_VAR)


def _device_index(device) -> int:
    """int | "cuda:N" | "cuda" | torch.device | None (current device) -> device index."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str):
        if device.startswith("cuda:"):
            return int(device.split(":", 1)[1])
        if device != "cuda":
            raise ValueError(f"not a CUDA device: {device!r}")
        device = None
    elif device is not None:
        if getattr(device, "type", None) != "cuda":
            raise ValueError(f"not a CUDA device: {device!r}")
        if device.index is not None:
            return device.index
        device = None
    import torch

    return torch.cuda.current_device()
