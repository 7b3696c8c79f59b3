"""Typed errors of the loader. Every message says what is available and the command that builds what is missing."""
from __future__ import annotations

DEFAULT_SPEC = "specs/qwen35.yaml"
STATE_DTYPES_SPEC = "specs/state-dtypes.yaml"  # builds every state storage dtype (fp16 and fp8 only there)


def build_command(arch: str | None = None, spec: str | None = None, out: str | None = None) -> str:
    """The exact command that builds artifacts for `arch` (sm_90a -> `--arch sm_90`)."""
    short = arch[:-1] if arch and arch.endswith("a") else (arch or "all")
    cli = f"gdn-aot build {spec or DEFAULT_SPEC} --arch {short}" + (f" --out {out}" if out else "")
    mk = f"make build ARCH={short}" + (f" SPEC={spec}" if spec and spec != DEFAULT_SPEC else "") + (
        f" OUT={out}" if out else "")
    return f"`{cli}` (in a checkout: `{mk}`)"


class GdnAotError(RuntimeError):
    """Base class of every gdn_aot loader error."""


class ArtifactsNotFound(GdnAotError, FileNotFoundError):
    """No artifact root (or no manifest for the arch) where the loader looked."""


class VariantNotBuilt(GdnAotError, LookupError):
    """The artifacts hold no variant matching the request."""


class CorruptArtifact(GdnAotError):
    """A manifest, cubin or launcher library does not match what the build recorded."""


class DriverTooOld(GdnAotError):
    """The driver refused the cubin (CUDA_ERROR_UNSUPPORTED_PTX_VERSION / CUDA_ERROR_NO_BINARY_FOR_GPU)."""


class UnsupportedDevice(GdnAotError):
    """The GPU's compute capability has no exact arch-specific target (no silent fallback)."""


class DriverError(GdnAotError):
    """A CUDA driver call returned an error (the message carries the driver's error string)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code
