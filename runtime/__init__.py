"""Decoding on exported graphs with ONNX Runtime / OpenVINO; imports without torch."""
from mirrorsd.runtime.pipeline import GenerationConfig, GenerationResult, Pipeline

__all__ = ["GenerationConfig", "GenerationResult", "Pipeline"]
