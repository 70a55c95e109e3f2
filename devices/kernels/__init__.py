"""mirrorsd's CPU kernel for int4/int8 ``MatMulNBits``: every row's bits independent of M, near the memory bandwidth.

ONNX Runtime's ``com.microsoft::MatMulNBits`` is far from the bandwidth at M = 1 and costs two one-row steps at M = 5.
``libmirrorsd_kern`` (C++ sources in ``src/``, ONNX Runtime's C API only) is a drop-in for it: B repacked once per
session for AVX-512 VNNI or AVX2, activations quantized per row and block of 32 to int8 (like ONNX Runtime's
accuracy level 4), exact integer block dot products, one fixed float order per (row, column). See src/qgemm.hpp.

    from mirrorsd.devices import kernels
    kernels.register(options)                 # adds the domain "mirrorsd.kern" (builds the library on first use)
    kernels.register(options, replace=True)   # ...and runs it for every com.microsoft MatMulNBits node as well
    data, count = kernels.read_switched(path) # or: a graph whose MatMulNBits nodes name "mirrorsd.kern"

Both raise KernelsUnavailableError with the reason (no compiler, a CPU without AVX2/AVX-512 VNNI, another OS), so a
caller can fall back to ONNX Runtime's kernel. ``MIRRORSD_KERNELS_ISA`` = avx512vnni | amx | avx2 | scalar forces a
path when a session is created (the paths agree bit for bit; tests use it to compare them).
"""
from __future__ import annotations

from mirrorsd.errors import KernelsUnavailableError
from mirrorsd.devices.kernels.build import KernelLibrary, library
from mirrorsd.devices.kernels.rewrite import DOMAIN, ORT_DOMAIN, external_data_config, read_switched, switch_domain

ISA_ENV = "MIRRORSD_KERNELS_ISA"
REPLACE_KEY = "mirrorsd_kern.replace_com_microsoft"  # session config entry read by the library at registration

__all__ = ["DOMAIN", "ORT_DOMAIN", "ISA_ENV", "REPLACE_KEY", "KernelLibrary", "KernelsUnavailableError",
           "build_id", "external_data_config", "library", "read_switched", "register", "switch_domain", "unavailable_reason",
           "usable_library"]


def usable_library() -> KernelLibrary:
    """The library, if this machine builds it and runs one of its fast paths; else KernelsUnavailableError."""
    built = library()
    if built.fast_path is None:
        raise KernelsUnavailableError("This CPU runs none of the fast mirrorsd kernel paths",
                                      "it has neither AVX-512 VNNI nor AVX2 with FMA, and the scalar reference path "
                                      "is slower than ONNX Runtime's kernel", "run with ONNX Runtime's kernels")
    return built


def build_id() -> str | None:
    """Which build of the library and which path of it sessions here run (e.g. "avx2/3f9c0e1d2a4b5c6d"), or None
    when they cannot: a profile measured with one build does not describe another (runtime/planner/profile.py)."""
    try:
        built = usable_library()
    except KernelsUnavailableError:
        return None
    return f"{built.fast_path}/{built.path.parent.name}"


def unavailable_reason() -> str | None:
    """None when the kernels can be used here, else why not (the message of KernelsUnavailableError)."""
    try:
        usable_library()
    except KernelsUnavailableError as exc:
        return str(exc)
    return None


def register(options, replace: bool = False, allow_slow: bool = False) -> KernelLibrary:
    """Register the library on an ``onnxruntime.SessionOptions``.

    replace: also run it for every ``com.microsoft`` MatMulNBits node, so an unchanged graph loaded by path uses it
        (ONNX Runtime prefers custom-op kernels to its own); a node it cannot run fails the session with the reason.
    allow_slow: accept a CPU that runs only the scalar reference path (tests)."""
    built = library() if allow_slow else usable_library()
    options.add_session_config_entry(REPLACE_KEY, "1" if replace else "0")  # read when the library registers
    options.register_custom_ops_library(str(built.path))
    return built
