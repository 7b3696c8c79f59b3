"""The variants of one arch bound to one device (ArtifactSet), and finding the set of a device (Artifacts).

    arts = Artifacts.for_device(q.device)         # ArtifactSet for that GPU's arch (exact match)
    k = arts.pick("gdn_prepare", dtype="bf16", K=128, V=128, varlen=True)   # one variant, to launch directly
    k.launch(grid, stream_ptr, q.data_ptr(), ..., scratch_ptr=scratch.data_ptr())
    routes = arts.routes("bf16", 128, 128, varlen=True, transpose=False)   # what the API uses: the dispatch
    route = routes.select(num_seqs * HV)                                    # table's row of a batch
"""
from __future__ import annotations

import functools
import os
import threading

from . import dispatch
from .artifacts import ENV_VAR, Manifest, arch_for_capability, locate_root
from .errors import STATE_DTYPES_SPEC, VariantNotBuilt, build_command
from .kernel import Kernel
from .routes import Routes


class ArtifactSet:
    """The variants built for one arch, bound to one device index."""

    def __init__(self, manifest: Manifest, device_index: int = 0):
        self.manifest = manifest
        self.arch = manifest.arch
        self.device_index = device_index
        self._kernels: dict[str, Kernel] = {}
        self._picked: dict[tuple, Kernel] = {}
        self._routes: dict[tuple, Routes] = {}
        # a configuration (dispatch.CONFIG_AXES values) -> its Routes once loaded: the API's per-call lookup
        self.loaded: dict[tuple, Routes] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"ArtifactSet({self.manifest.dir}, device={self.device_index}, {len(self.manifest.variants)} variants)"

    @property
    def keys(self) -> list[str]:
        return list(self.manifest.variants)

    @property
    def table(self) -> list[dict]:
        """The dispatch table (loader/dispatch.py): rows of configuration, bound, route and variant keys."""
        return self.manifest.dispatch.get("table", [])

    def preferences(self, kernel: str) -> dict:
        """The spec's dispatch preferences for a kernel (default_BV, ...; docs/spec-format.md)."""
        return self.manifest.dispatch.get("spec", {}).get(kernel, {})

    @functools.cached_property
    def head_dims(self) -> frozenset[tuple[int, int]]:
        """(K, V) pairs some dispatch row serves."""
        return frozenset((r["K"], r["V"]) for r in self.table)

    def kernel(self, key: str) -> Kernel:
        k = self._kernels.get(key)
        if k is None:
            if key not in self.manifest.variants:
                raise self._not_built(f"variant {key!r}", key.split(".")[0] + ".")
            with self._lock:
                k = self._kernels.setdefault(key, Kernel(self.manifest, key, self.device_index))
        return k

    def routes(self, dtype: str, K: int, V: int, varlen: bool, transpose: bool, state_dtype: str = "fp32",
               gating: bool = False, checkpoints: bool = False, sm_count: int | None = None) -> Routes:
        """The Routes of this configuration (dispatch.CONFIG_AXES), made once per configuration and device.
        sm_count (for the bounds of the table's rows) defaults to the device's."""
        key = (dtype, K, V, varlen, transpose, state_dtype, gating, checkpoints)
        r = self._routes.get(key)
        if r is None:
            rows = dispatch.config_rows(self.table, key)
            if not rows:
                raise self._no_route(key)
            if sm_count is None:
                import torch

                sm_count = torch.cuda.get_device_properties(self.device_index).multi_processor_count
            r = Routes(rows, self.kernel, self.manifest, self.device_index, sm_count)
            with self._lock:
                r = self._routes.setdefault(key, r)
        return r

    def pick(self, kernel: str, *, dtype: str, K: int | None = None, V: int | None = None, varlen: bool = False,
             transpose: bool = False, BV: int | None = None, BT: int | None = None,
             num_warps: int | None = None, state_dtype: str = "fp32", gating: bool = False,
             checkpoints: bool = False) -> Kernel:
        """The built variant for these axes: BV if built, else the spec's default_BV, else the largest built BV
        (loader/dispatch.py pick, the rule the build's dispatch table uses)."""
        cache_key = (kernel, dtype, K, V, varlen, transpose, BV, BT, num_warps, state_dtype, gating, checkpoints)
        k = self._picked.get(cache_key)
        if k is not None:
            return k
        want = {"dtype": dtype, "K": K, "V": V, "BT": BT, "varlen": varlen, "transpose": transpose,
                "state_dtype": state_dtype, "gating": gating, "checkpoints": checkpoints}
        uses = self.manifest.data.get("kernels", {}).get(kernel, {}).get("uses_axes")
        if uses is not None:  # an axis the kernel's code ignores holds one (default) value: do not match on it
            want = {a: x for a, x in want.items() if a in uses}
        chosen = dispatch.pick(self.manifest.variants, kernel, want, BV, num_warps,
                               self.preferences(kernel).get("default_BV"))
        if chosen is None:
            desc = ", ".join(f"{a}={x}" for a, x in want.items() if x is not None)
            raise self._not_built(f"{kernel} with {desc}", kernel + ".")
        k = self._picked[cache_key] = self.kernel(chosen)
        return k

    def _no_route(self, config: tuple) -> VariantNotBuilt:
        """The error for a configuration no dispatch row serves; when no row at all stores the state in its state
        dtype, it names the spec that builds every state dtype."""
        desc = ", ".join(f"{a}={x}" for a, x in zip(dispatch.CONFIG_AXES, config))
        state_dtype = config[dispatch.CONFIG_AXES.index("state_dtype")]
        built = sorted({r["state_dtype"] for r in self.table})
        if state_dtype in built:
            return self._not_built(f"a forward with {desc} (no dispatch row)", "gdn_")
        return VariantNotBuilt(
            f"a forward with {desc} is not built for {self.arch} in {self.manifest.dir}: no variant there stores "
            f"the state in {state_dtype} (built state dtypes: {built}). {STATE_DTYPES_SPEC} builds all five: run "
            f"{build_command(self.arch, STATE_DTYPES_SPEC, 'artifacts-state')} and point ${ENV_VAR} (or the API's "
            f"artifacts=) at that directory.")

    def _not_built(self, what: str, prefix: str) -> VariantNotBuilt:
        m = self.manifest
        built = [k for k in m.variants if k.startswith(prefix)] or list(m.variants)
        failed = [f"{k} (log: {log})" for k, log in m.failed.items() if k.startswith(prefix)]
        return VariantNotBuilt(
            f"{what} is not built for {m.arch} in {m.dir}. Built: {built or 'none'}."
            + (f" Failed to compile in the last build: {failed}." if failed else "")
            + f" Add it to a spec and run {m.build_command()}.")


class Artifacts:
    """Entry point: `Artifacts.for_device(device, capability=None, root=None) -> ArtifactSet`."""

    _sets: dict[tuple, ArtifactSet] = {}
    _requests: dict[tuple, tuple] = {}  # what each (root, device, capability) resolved to, and from where
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


try:  # CPython's os.environ keeps its values in a dict of encoded keys: a lookup there is cheaper than os.environ's
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
