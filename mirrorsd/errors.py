"""One exception hierarchy for the whole project.

Every error says what went wrong, why, and what to do about it, so that a CLI can print it as is.
"""
from __future__ import annotations


class MirrorSDError(Exception):
    """Root of every error mirrorsd raises on purpose.

    Built from three parts so that messages stay uniform: ``what`` happened, ``why`` it is a problem (or
    its cause), and ``fix``, what the user should do next.
    """

    exit_code = 2

    def __init__(self, what: str, why: str = "", fix: str = "") -> None:
        self.what, self.why, self.fix = what, why, fix
        parts = [what.rstrip(".") + "."]
        if why:
            parts.append(f"Why: {why.rstrip('.')}.")
        if fix:
            parts.append(f"Fix: {fix.rstrip('.')}.")
        super().__init__(" ".join(parts))


class ModelSourceError(MirrorSDError):
    """The model given to the exporter is missing, unreadable or not a causal LM."""


class UnsupportedArchitectureError(MirrorSDError):
    """The model's ``model_type`` has no entry in the architecture registry."""


class IncompatibleDraftError(MirrorSDError):
    """The draft model cannot serve the target (another vocabulary, another tokenizer)."""


class ExportOptionError(MirrorSDError):
    """An export option is out of range (exit layer, top-k, draft layers...)."""


class ValidationError(MirrorSDError):
    """An exported graph disagrees with PyTorch beyond its tolerance."""


class OutputFolderError(MirrorSDError):
    """The output folder exists and is not empty, or cannot be written."""


class ManifestError(MirrorSDError):
    """An export folder's manifest is missing, malformed, from another schema version, or unsafe."""


class GraphFileError(MirrorSDError):
    """An ONNX file of an export folder is missing, truncated or refers outside its folder."""


class GenerationInputError(MirrorSDError):
    """A generation request is invalid (prompt too long, bad sampling values, max_new_tokens <= 0)."""


class DeviceError(MirrorSDError):
    """A requested device or execution provider is not available on this machine."""


class DraftWorkerError(MirrorSDError):
    """The draft worker thread failed, hung or returned malformed output."""


class WeightsFetchError(MirrorSDError):
    """Pinned model weights could not be fetched, assembled or verified."""


class ChatTemplateError(ManifestError):
    """The export's chat template does not parse, fails, or exceeds the sandbox's time or size limits."""


class ModelOutputError(MirrorSDError):
    """A graph returned NaN or infinite logits: the export's weights (or its quantization) are broken."""


class OutputStreamError(MirrorSDError):
    """Writing the result to stdout failed (a full disk, a broken device)."""


class KernelsUnavailableError(MirrorSDError):
    """mirrorsd's own CPU kernels cannot be built or used here (no compiler, unsupported CPU or platform)."""


class ProfileError(MirrorSDError):
    """A device profile (measured or hand-written) is missing, malformed or from another schema version."""
