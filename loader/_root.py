"""gdn_aot: Gated DeltaNet prefill kernels compiled ahead of time (Gluon -> cubin + C launcher).

Installed layout (one namespace):
  gdn_aot.kernels  Gluon sources + the kernel registry (build time only; imports triton lazily)
  gdn_aot.build    the build step (`gdn-aot build|list|verify|inspect`)
  gdn_aot.loader   the runtime: loads built cubins through the generated launcher, never imports triton
  gdn_aot.specs    the shipped build specs (YAML)

`import gdn_aot` is cheap: it imports nothing heavy; `gdn_aot.chunk_gated_delta_rule` is resolved on first use.
"""
__version__ = "0.1.0"
__all__ = ["chunk_gated_delta_rule"]


def __getattr__(name):
    if name == "chunk_gated_delta_rule":
        from .loader.api import chunk_gated_delta_rule

        globals()[name] = chunk_gated_delta_rule
        return chunk_gated_delta_rule
    raise AttributeError(f"module 'gdn_aot' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
