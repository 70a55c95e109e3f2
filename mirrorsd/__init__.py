"""mirrorsd: Mirror Speculative Decoding for on-device LLM inference on ONNX Runtime and OpenVINO.

Subpackages: ``mirrorsd.export`` (torch-based exporter), ``mirrorsd.runtime`` (decoding on ONNX graphs, no torch;
its planner for mode auto in ``mirrorsd.runtime.planner``), ``mirrorsd.devices`` (probing and placement) and
``mirrorsd.apps`` (the CLI, plan, bench and peers). This package's own modules hold the contracts all share: errors,
names, the manifest, the ONNX wire format, flags, output folders, weights and the SpecBench questions.
"""
from mirrorsd.errors import MirrorSDError

__version__ = "0.1.0"
__all__ = ["MirrorSDError", "__version__"]
