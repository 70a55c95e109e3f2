"""mirrorsd: Mirror Speculative Decoding for on-device LLM inference on ONNX Runtime and OpenVINO.

Subpackages: ``mirrorsd.export`` (torch-based exporter), ``mirrorsd.runtime`` (decoding on ONNX graphs, no torch),
``mirrorsd.devices`` (probing and placement). This package holds what all share: the manifest, errors and CLI.
"""
from mirrorsd.errors import MirrorSDError

__version__ = "0.1.0"
__all__ = ["MirrorSDError", "__version__"]
