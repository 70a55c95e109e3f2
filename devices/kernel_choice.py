"""Which MatMulNBits kernel ONNX Runtime CPU sessions run: mirrorsd's (devices/kernels) or ONNX Runtime's own.

    auto      mirrorsd's when it builds and runs a fast path on this CPU, else ONNX Runtime's (the reason is kept for
              ``mirrorsd devices`` and the generation statistics, not warned: nothing the user asked for was refused)
    mirrorsd  mirrorsd's, or DeviceError saying why it cannot run here
    ort       ONNX Runtime's

mirrorsd's computes a row's bits the same whatever the number of rows beside it, by construction, on every path.
ONNX Runtime's does so at accuracy level 4 on the AVX-512 VNNI CPUs measured, not on an AVX2-only one: the pipeline
measures it at the first speculative generation (devices/ort_kernel_check.py) and refuses sd/mirror where it is not
(Pipeline.inexact_windows). The two kernels are not bitwise equal to each other, so compare modes within one
choice. mirrorsd's is the faster, most of all for several-row windows (docs/lab-notes/performance-log.md, Changes).
"""
from __future__ import annotations

from mirrorsd.errors import DeviceError, KernelsUnavailableError
from mirrorsd.names import FLOAT_ZERO_POINT_WEIGHTS

CHOICES = ("auto", "mirrorsd", "ort")
MIRRORSD, ORT = "mirrorsd", "ort"


def resolve_kernels(asked: str) -> tuple[str, str]:
    """(kernel, why ONNX Runtime's is used when auto could not take mirrorsd's, else "")."""
    if asked not in CHOICES:
        raise DeviceError(f"Unknown kernels '{asked}'", f"the choices are {', '.join(CHOICES)}", "pick one")
    if asked == ORT:
        return ORT, ""
    from mirrorsd.devices import kernels

    try:
        kernels.usable_library()  # builds the library once into the cache when it is missing
    except KernelsUnavailableError as exc:
        if asked == MIRRORSD:
            raise DeviceError("mirrorsd's kernels cannot run here", exc.why,
                              f"{exc.fix}; or pass --kernels ort (or auto)") from None
        return ORT, str(exc)
    return MIRRORSD, ""


class SlowKernelWarning(UserWarning):
    """An export whose weights ONNX Runtime's own kernel runs far slower than mirrorsd's would."""


def slow_weights_note(manifest, kernels: str) -> str:
    """What to tell the user when ONNX Runtime's kernel will run float-zero-point weights (GGUF Q4_K blocks carried
    by the exporter): it dequantizes them to float on every call, tens of times slower than mirrorsd's kernel.
    Empty when nothing is slow."""
    count = sum(int(g.validation.get(FLOAT_ZERO_POINT_WEIGHTS, 0)) for g in manifest.graphs.values())
    if kernels != ORT or not count:
        return ""
    return (f"this export has {count} int4 weights with float zero points (GGUF Q4_K blocks carried as they are), and "
            f"ONNX Runtime's own MatMulNBits dequantizes those on every call: decoding will be very slow. Fix: let "
            f"mirrorsd build its kernels (a C++ compiler; python -m mirrorsd.devices.kernels says why it cannot), or "
            f"re-export with --gguf-blocks requantize")
