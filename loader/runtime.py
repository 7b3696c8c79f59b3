"""The runtime's public classes under the module name earlier code imports them from (gdn_aot.loader.runtime).

The runtime is split by job: binding.py (the launcher library), kernel.py (one variant on one device),
routes.py (the dispatch table's rows on a device), artifact_sets.py (an arch's variants bound to a device, and
finding them), abi.py (the launcher ABI, declared).
"""
from .artifact_sets import Artifacts, ArtifactSet
from .binding import Launcher
from .kernel import Kernel
from .routes import Route, Routes

__all__ = ["Artifacts", "ArtifactSet", "Kernel", "Launcher", "Route", "Routes"]
