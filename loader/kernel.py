"""One built variant on one device: its module is loaded lazily, once, in that device's primary context.

The first launch (or load()) verifies the cubin's sha256 and the launcher's, then loads the module under a lock;
after that a launch is one dict-free ctypes call.
"""
from __future__ import annotations

import ctypes
import threading

from .abi import KernelStruct
from .artifacts import Manifest
from .binding import Launcher
from .errors import CorruptArtifact, DriverError, DriverTooOld

CUDA_ERROR_NO_BINARY_FOR_GPU = 209
CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222
CUDA_ERROR_INVALID_IMAGE = 200
CUDA_ERROR_INVALID_CONTEXT = 201


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

    @property
    def resident(self) -> int:
        """How many programs of this kernel the device runs at once (gdn_aot_kernel_load counts them: occupancy
        times SMs); a co-resident family's grid up to this many launches cooperatively."""
        self.load()
        return self._struct.resident

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
