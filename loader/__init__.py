"""Runtime side of gdn_aot: finds built artifacts, picks variants, loads cubins through the generated C launcher.

Never imports triton and never compiles anything. Entry point: ``Artifacts.for_device(device)``.
"""
from gdn_aot.loader.artifacts import (
    LAUNCHER_ABI_VERSION, MANIFEST_SCHEMA_VERSION, Manifest, arch_for_capability, find_root,
)
from gdn_aot.loader.errors import (
    ArtifactsNotFound, CorruptArtifact, DriverError, DriverTooOld, GdnAotError, UnsupportedDevice, VariantNotBuilt,
)
from gdn_aot.loader.runtime import Artifacts, ArtifactSet, Kernel, Launcher

__all__ = [
    "Artifacts", "ArtifactSet", "Kernel", "Launcher", "Manifest", "arch_for_capability", "find_root",
    "LAUNCHER_ABI_VERSION", "MANIFEST_SCHEMA_VERSION", "GdnAotError", "ArtifactsNotFound", "VariantNotBuilt",
    "CorruptArtifact", "DriverTooOld", "UnsupportedDevice", "DriverError",
]
