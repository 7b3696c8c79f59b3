"""ctypes binding of the generated launcher library (libgdn_aot_launch.so.<ABI>); opening it needs no driver.

The structs it passes are the mirrors loader/abi.py builds from the same declarations the C header is rendered
from; their sizes are checked against the library's on open.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from .abi import FORWARD_ARGS, LAUNCHER_ABI_VERSION, DispatchRow, ForwardPlan, KernelStruct
from .errors import CorruptArtifact, DriverError

_CTYPES = {"c_uint64": ctypes.c_uint64, "c_int64": ctypes.c_int64, "c_int32": ctypes.c_int32,
           "c_uint32": ctypes.c_uint32, "c_float": ctypes.c_float, "c_double": ctypes.c_double}


def _bind(fn, restype, *argtypes):
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


class Launcher:
    """The generated libgdn_aot_launch.so of one arch. Opening it needs no driver; init() does.

    gdn_aot_forward (present when the spec builds a route's kernels; else None) and its plan take one argument,
    the packed FORWARD_ARGS as bytes (ctypes passes a pointer to their buffer; the C side copies the struct out)."""

    _lock = threading.Lock()
    _open: dict[str, "Launcher"] = {}

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        _bind(lib.gdn_aot_abi_version, ctypes.c_uint)
        _bind(lib.gdn_aot_kernel_struct_size, ctypes.c_uint)
        _bind(lib.gdn_aot_init, ctypes.c_int)
        _bind(lib.gdn_aot_error_string, ctypes.c_char_p, ctypes.c_int)
        _bind(lib.gdn_aot_kernel_load, ctypes.c_int, ctypes.POINTER(KernelStruct), ctypes.c_char_p, ctypes.c_char_p,
              ctypes.c_uint, ctypes.c_uint, ctypes.c_uint)
        _bind(lib.gdn_aot_kernel_unload, ctypes.c_int, ctypes.POINTER(KernelStruct))
        self.gdn_aot_select = _bind(lib.gdn_aot_select, ctypes.POINTER(DispatchRow), ctypes.c_char_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        self._check(lib.gdn_aot_abi_version(), LAUNCHER_ABI_VERSION, "speaks launcher ABI", "this loader")
        self._check(lib.gdn_aot_kernel_struct_size(), ctypes.sizeof(KernelStruct), "gdn_aot_kernel_t is",
                    "the loader's mirror")
        self.gdn_aot_forward = getattr(lib, "gdn_aot_forward", None)
        if self.gdn_aot_forward is not None:
            _bind(lib.gdn_aot_forward_args_size, ctypes.c_uint)
            self._check(lib.gdn_aot_forward_args_size(), FORWARD_ARGS.size, "gdn_aot_forward_args_t is",
                        "the loader packs")
            _bind(self.gdn_aot_forward, ctypes.c_int, ctypes.c_char_p)
            self.workspace_bytes = _bind(lib.gdn_aot_forward_workspace_bytes, ctypes.c_int64, ctypes.c_char_p)
            _bind(lib.gdn_aot_forward_plan, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ForwardPlan))
        self.lib = lib
        self._initialized = False

    def _check(self, got, want, what, ours):
        if got != want:
            raise CorruptArtifact(f"{self.path}: {what} {got}, {ours} {want}; rebuild the artifacts")

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

    def select(self, config: tuple, programs: int, sm_count: int) -> dict | None:
        """gdn_aot_select: the C dispatch table's row for a batch of a configuration (dispatch.CONFIG_AXES
        values), as {field: value} (None: no row)."""
        dtype, K, V, varlen, transpose, state_dtype, gating, checkpoints = config
        row = self.gdn_aot_select(dtype.encode(), K, V, int(varlen), int(transpose), state_dtype.encode(),
                                  int(gating), int(checkpoints), programs, sm_count)
        if not row:
            return None
        return {name: (x.decode() if isinstance(x, bytes) else x)
                for name, x in ((n, getattr(row.contents, n)) for n, _ in DispatchRow._fields_)}

    def function(self, kernel: str, params: list[dict]):
        """The family's launch function with argtypes from the manifest's param list."""
        fn = getattr(self.lib, f"gdn_aot_launch_{kernel}")
        if fn.argtypes is None:
            _bind(fn, ctypes.c_int, ctypes.POINTER(KernelStruct), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint,
                  ctypes.c_uint, *(_CTYPES[p["ctypes"]] for p in params if p["kind"] != "profile_scratch"))
        return fn
