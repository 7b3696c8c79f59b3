"""Runtime side of gdn_aot: finds built artifacts, picks variants, loads cubins through the generated C launcher.

Never imports triton and never compiles anything. Entry point: ``Artifacts.for_device(device)``. The names below
are imported on first use, so that `gdn_aot.loader.abi` (which the build and the kernels read) imports nothing else.
"""
import importlib

_EXPORTS = {
    "Artifacts": "artifact_sets", "ArtifactSet": "artifact_sets", "Kernel": "kernel", "Launcher": "binding",
    "Route": "routes", "Routes": "routes", "Manifest": "artifacts", "arch_for_capability": "artifacts",
    "find_root": "artifacts", "LAUNCHER_ABI_VERSION": "abi", "MANIFEST_SCHEMA_VERSION": "abi",
    "GdnAotError": "errors", "ArtifactsNotFound": "errors", "VariantNotBuilt": "errors", "CorruptArtifact": "errors",
    "DriverTooOld": "errors", "UnsupportedDevice": "errors", "DriverError": "errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
