"""libmirrorsd (runtime/native, C++ on ONNX Runtime's C API) from Python: build it with CMake, load it with ctypes.

    lib = build_library()                              # once; cached under ~/.cache/mirrorsd/native
    with NativeModel("exports/smollm2", library=lib) as model:
        out = model.generate([1, 17, 42], mode="mirror", max_new_tokens=32)
        print(out.tokens, out.stats["tokens_per_second"])

``mirrorsd bench`` runs the library as the modes c-ar, c-sd, c-mirror (and c-mirror-noexit), beside the Python
runtime's modes in one run; the tests check its tokens against the Python runtime's. ``kernels`` chooses the
MatMulNBits kernel as the Python runtime's ``--kernels`` does (auto: mirrorsd's devices/kernels library when this
machine builds and runs it, handed to libmirrorsd as ``kernels_library``; ort: ONNX Runtime's own), so C and Python
compute the same bits. The structs below mirror
``runtime/native/include/mirrorsd.h``; a mismatch is caught by the library's ``struct_size`` checks.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import (DeviceError, DraftWorkerError, GenerationInputError, GraphFileError, ManifestError,
                             MirrorSDError)

from mirrorsd.runtime.config import BRANCH_BUDGETS, DRAFT_FAILURE

C_MODES = ("ar", "sd", "mirror")  # the modes libmirrorsd implements: the first ones of config.py's MODES
MODES = {mode: value for value, mode in enumerate(C_MODES)}  # the C ABI's values: positions in config.py's tuples
BUDGETS = {budget: value for value, budget in enumerate(BRANCH_BUDGETS)}
DRAFT_FAILURES = {choice: value for value, choice in enumerate(DRAFT_FAILURE)}
FINISH_REASONS = ("length", "eos", "context", "callback")
LIBRARY_NAME = "libmirrorsd.so"


class NativeLibraryError(MirrorSDError):
    """libmirrorsd could not be built or loaded, or failed inside (an ONNX Runtime or internal error)."""


ERRORS = {1: GenerationInputError, 2: ManifestError, 3: GraphFileError, 4: DeviceError, 5: NativeLibraryError,
          6: DraftWorkerError, 7: NativeLibraryError, 8: GenerationInputError}  # 8: busy (re-entry, close in use)


class OpenOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("target_device", ctypes.c_char_p),
                ("draft_device", ctypes.c_char_p), ("target_threads", ctypes.c_int32),
                ("draft_threads", ctypes.c_int32), ("openvino_ep_library", ctypes.c_char_p),
                ("kernels_library", ctypes.c_char_p)]


class GenerateConfig(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32)] + [(name, ctypes.c_int32) for name in (
        "mode", "max_new_tokens", "gamma", "branches", "branch_batch", "runner_up_k", "branch_budget", "exit_head",
        "on_draft_failure")] + [("draft_timeout_s", ctypes.c_double)]


STAT_COUNTS = ("prompt_tokens", "new_tokens", "steps", "drafted", "accepted", "windows", "reused", "fallbacks",
               "draft_forwards", "branches_rolled_out", "draft_failures")
STAT_TIMES = ("seconds", "time_to_first_token_s", "tokens_per_second", "decode_tokens_per_second",
              "mean_accepted_tokens", "acceptance_rate", "reuse_rate", "target_busy_s", "draft_busy_s",
              "draft_hidden_s", "overlap_ratio")


class Stats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("mode", ctypes.c_int32), ("finish_reason", ctypes.c_int32),
                ("reserved", ctypes.c_int32)] + [(n, ctypes.c_int64) for n in STAT_COUNTS] + \
               [(n, ctypes.c_double) for n in STAT_TIMES]


class ModelInfo(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("eos_count", ctypes.c_int32)] + \
               [(n, ctypes.c_int64) for n in ("vocab_size", "context_limit", "target_layers", "exit_layer",
                                              "draft_layers", "top_k")] + \
               [("eos_token_ids", ctypes.c_int64 * 8), ("target_provider", ctypes.c_char * 64),
                ("draft_provider", ctypes.c_char * 64), ("target_kernels", ctypes.c_char * 16),
                ("draft_kernels", ctypes.c_char * 16), ("target_threads", ctypes.c_int32),
                ("draft_threads", ctypes.c_int32)]


TOKEN_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p)


def source_dir() -> Path:
    """runtime/native: the library's CMake project (this binding's own folder)."""
    return Path(__file__).resolve().parent


def wheel_onnxruntime() -> Path:
    """The onnxruntime wheel's shared library (onnxruntime/capi/libonnxruntime.so.1.x)."""
    import onnxruntime

    found = sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.1.*"))
    if not found:
        raise NativeLibraryError("The onnxruntime package ships no libonnxruntime.so.1.*",
                                 f"looked in {Path(onnxruntime.__file__).parent / 'capi'}",
                                 "install the onnxruntime wheel from PyPI (Linux), or pass the library's path")
    return found[-1]


def cmake_build(source: Path, build_dir: Path, onnxruntime_library: Path | None = None) -> Path:
    """Configure and build the CMake project at ``source`` (runtime/native, or samples/cpp which includes it) into
    ``build_dir`` against ``onnxruntime_library`` (default: the wheel's); incremental. Returns ``build_dir``."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None and
               not (tool == "c++" and shutil.which("g++"))]
    if missing:
        raise NativeLibraryError(f"Cannot build libmirrorsd: {' and '.join(missing)} not found",
                                 "it is C++17 built with CMake", "install cmake and a C++17 compiler (g++ >= 9)")
    library = onnxruntime_library or wheel_onnxruntime()
    for command in (["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DONNXRUNTIME_LIBRARY={library}"],
                    ["cmake", "--build", str(build_dir), "-j", str(max(1, os.cpu_count() or 1))]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeLibraryError(f"Building libmirrorsd failed: {' '.join(command[:2])}",
                                     (done.stdout + done.stderr)[-1500:], "read the compiler output above")
    return Path(build_dir)


def build_library(build_dir: Path | None = None, onnxruntime_library: Path | None = None) -> Path:
    """Build libmirrorsd (default: into the mirrorsd cache, ``~/.cache/mirrorsd/native/build``); its path."""
    from mirrorsd.weights import default_cache_dir

    build_dir = Path(build_dir or default_cache_dir() / "native" / "build")
    return cmake_build(source_dir(), build_dir, onnxruntime_library) / LIBRARY_NAME


_loaded: dict[str, ctypes.CDLL] = {}


def load_library(path: Path | str) -> ctypes.CDLL:
    """Load libmirrorsd once per path and declare its functions."""
    key = str(Path(path).resolve())
    if key in _loaded:
        return _loaded[key]
    try:
        lib = ctypes.CDLL(key)
    except OSError as exc:
        raise NativeLibraryError(f"Cannot load {path}", str(exc),
                                 "build it: mirrorsd.runtime.native.build_library()") from None
    status, ptr, i32, p_i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)
    declare = {"mirrorsd_version": (ctypes.c_char_p, []), "mirrorsd_last_error": (ctypes.c_char_p, []),
               "mirrorsd_open_options_init": (None, [ctypes.POINTER(OpenOptions)]),
               "mirrorsd_generate_config_init": (None, [ctypes.POINTER(GenerateConfig)]),
               "mirrorsd_open": (status, [ctypes.c_char_p, ctypes.POINTER(OpenOptions), ctypes.POINTER(ptr)]),
               "mirrorsd_model_get_info": (status, [ptr, ctypes.POINTER(ModelInfo)]),
               "mirrorsd_generate": (status, [ptr, p_i64, i32, ctypes.POINTER(GenerateConfig), TOKEN_CALLBACK, ptr,
                                              ctypes.POINTER(Stats)]),
               "mirrorsd_close": (status, [ptr])}
    for name, (restype, argtypes) in declare.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    _loaded[key] = lib
    return lib


def raise_for(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        text = (lib.mirrorsd_last_error() or b"").decode("utf-8", "replace")
        error = ERRORS.get(status, NativeLibraryError)(f"libmirrorsd: {text}" if text else f"libmirrorsd status {status}")
        error.status = status
        raise error


def kernels_library(kernels: str) -> str | None:
    """The kernels library libmirrorsd should load for the choice ``kernels`` (auto | mirrorsd | ort), resolved as
    the Python runtime resolves it (devices/kernel_choice.py): its path, or None for ONNX Runtime's own kernel."""
    from mirrorsd.devices.kernel_choice import MIRRORSD, resolve_kernels

    if resolve_kernels(kernels)[0] != MIRRORSD:
        return None
    from mirrorsd.devices import kernels as kernel_library

    return str(kernel_library.usable_library().path)


@dataclass(frozen=True)
class NativeResult:
    tokens: list[int]
    stats: dict  # GenerationStats.to_dict() keys, plus finish_reason


class NativeModel:
    """An export folder opened by libmirrorsd (one session per graph, as the Python Pipeline)."""

    def __init__(self, folder: str | os.PathLike, library: Path | str, target_device: str = "auto",
                 draft_device: str = "auto", target_threads: int = 0, draft_threads: int = 0,
                 openvino_ep_library: str | None = None, kernels: str = "auto",
                 kernels_path: str | os.PathLike | None = None) -> None:
        """kernels: auto | mirrorsd | ort, as the Python runtime's --kernels; kernels_path: a libmirrorsd_kern.so of
        your own instead (tests, another build)."""
        self.handle = None
        library_path = os.fspath(kernels_path) if kernels_path is not None else kernels_library(kernels)
        self.lib = load_library(library)
        options = OpenOptions()
        self.lib.mirrorsd_open_options_init(ctypes.byref(options))
        options.target_device, options.draft_device = target_device.encode(), draft_device.encode()
        options.target_threads, options.draft_threads = target_threads, draft_threads
        options.openvino_ep_library = openvino_ep_library.encode() if openvino_ep_library else None
        options.kernels_library = os.fsencode(library_path) if library_path else None
        handle = ctypes.c_void_p()
        raise_for(self.lib, self.lib.mirrorsd_open(os.fsencode(folder), ctypes.byref(options), ctypes.byref(handle)))
        self.handle = handle
        info = ModelInfo(struct_size=ctypes.sizeof(ModelInfo))
        raise_for(self.lib, self.lib.mirrorsd_model_get_info(self.handle, ctypes.byref(info)))
        self.info = {name: getattr(info, name) for name, _ in ModelInfo._fields_[2:8]}
        self.info["eos_token_ids"] = list(info.eos_token_ids[:info.eos_count])
        self.threads = {"target": info.target_threads, "draft": info.draft_threads}
        self.placement = {"target": info.target_provider.decode(), "draft": info.draft_provider.decode()}
        self.kernels = {"target": info.target_kernels.decode(), "draft": info.draft_kernels.decode()}
        self.folder = Path(folder)

    def inexact_windows(self) -> str:
        """Why sd/mirror would not emit ar's tokens here, or "": Pipeline.inexact_windows' rule (a quantized
        grouped-attention target on ONNX Runtime's own CPU kernel, on a CPU where that kernel is not row-invariant)."""
        from mirrorsd.manifest import load_manifest

        manifest = load_manifest(self.folder)
        precision = manifest.export_options.get("target_precision")
        if manifest.attention != "grouped" or precision not in ("int4", "int8") or self.kernels["target"] != "ort" \
                or "CPU" not in self.placement["target"]:
            return ""
        from mirrorsd.devices.ort_kernel_check import target_kernel_difference

        difference, paths = target_kernel_difference(manifest)
        if difference == 0.0:
            return ""
        return (f"the {precision} target runs ONNX Runtime's MatMulNBits kernel with {paths} (no "
                f"kernels_library), whose one-row path differs from its several-row path on this CPU (by "
                f"{difference:.1e} per layer), so verification windows drift from one-row decoding")

    def generate(self, ids: list[int], **settings) -> NativeResult:
        """Decode ``ids`` with the C++ decoders. ``settings``: GenerationConfig's fields that the library has (its
        mirrorsd_generate_config: mode ar|sd|mirror, max_new_tokens, gamma, branches, branch_batch, runner_up_k,
        branch_budget, exit_head, on_draft_failure, draft_timeout_s); the ones left out keep the library's own
        defaults (mirrorsd_generate_config_init: GenerationConfig's, with mode mirror for auto)."""
        if self.handle is None:
            raise NativeLibraryError("The native model is closed", "close() was called", "open it again")
        config = GenerateConfig()
        self.lib.mirrorsd_generate_config_init(ctypes.byref(config))
        choices = {"mode": MODES, "branch_budget": BUDGETS, "on_draft_failure": DRAFT_FAILURES}
        known = {name for name, _ in GenerateConfig._fields_[1:]}
        for name, value in settings.items():
            if name not in known:
                raise GenerationInputError(f"libmirrorsd has no setting {name!r}", f"it has {', '.join(sorted(known))}",
                                           "leave it out (tests/test_native_settings.py lists what C lacks)")
            if name in choices and value not in choices[name]:
                raise GenerationInputError(f"{name} {value!r} is not one libmirrorsd has",
                                           f"it has {', '.join(choices[name])}", "pick one")
            value = choices[name][value] if name in choices else value
            if isinstance(value, int) and name != "draft_timeout_s" and not -2**31 <= value < 2**31:
                raise GenerationInputError(f"{name} {value} does not fit the C ABI's 32-bit field",
                                           "libmirrorsd's settings are int32", f"pass {name} below 2**31")
            setattr(config, name, value)
        mode = C_MODES[config.mode] if 0 <= config.mode < len(C_MODES) else str(config.mode)
        if mode != "ar" and (why := self.inexact_windows()):
            raise GenerationInputError(f"mode {mode} would not reproduce target-only decoding here", why,
                                       "open with kernels='mirrorsd' or 'auto' (mirrorsd's kernels need a C++ "
                                       "compiler), or use mode ar")
        tokens: list[int] = []
        callback = TOKEN_CALLBACK(lambda token, _: tokens.append(token) or 0)
        prompt = (ctypes.c_int64 * len(ids))(*ids)
        stats = Stats(struct_size=ctypes.sizeof(Stats))
        raise_for(self.lib, self.lib.mirrorsd_generate(self.handle, prompt, len(ids), ctypes.byref(config), callback,
                                                       None, ctypes.byref(stats)))
        return NativeResult(tokens, self._stats(mode, stats))

    def _stats(self, mode: str, s: Stats) -> dict:
        out = {"mode": mode, **{n: getattr(s, n) for n in STAT_COUNTS}, **{n: getattr(s, n) for n in STAT_TIMES}}
        out["fallback_rate"] = s.fallbacks / s.windows if s.windows else 0.0
        out["draft_forwards_per_window"] = s.draft_forwards / s.windows if s.windows else 0.0
        tag = {model: " [mirrorsd kernels]" if self.kernels[model] == "mirrorsd" else "" for model in self.kernels}
        out["placement"] = {"target": self.placement["target"] + tag["target"],
                            "draft": self.placement["draft"] + tag["draft"], "host": "libmirrorsd (C++)"}
        out["finish_reason"] = FINISH_REASONS[s.finish_reason]
        return out

    def close(self) -> None:
        if self.handle is not None:
            raise_for(self.lib, self.lib.mirrorsd_close(self.handle))
            self.handle = None

    def __enter__(self) -> "NativeModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
