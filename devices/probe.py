"""What this machine can run: ONNX Runtime providers, OpenVINO plugin-EP devices and OpenVINO runtime devices.

    probe() -> DeviceReport        (cached per process; probe(refresh=True) looks again)

ONNX Runtime *lists* providers it was built with, not ones that work: onnxruntime-gpu lists CUDAExecutionProvider on
a machine without a GPU, and a session that asks for it silently runs on CPU. So every accelerator provider listed
is tried on a one-node graph and counted as working only if the session reports it back from ``get_providers()``.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from mirrorsd.devices.openvino_import import load_openvino
from mirrorsd.onnx_wire import message_field as _msg
from mirrorsd.onnx_wire import varint_field as _varint_field

ORT_CPU = "CPUExecutionProvider"
ORT_ACCELERATORS = ("CUDAExecutionProvider", "DmlExecutionProvider")  # the ones the placement policy uses
PLUGIN_PACKAGE = "onnxruntime_ep_openvino"  # pip: onnxruntime-ep-openvino
PLUGIN_REGISTRATION = "mirrorsd_openvino_plugin"  # the name we register the plugin library under (once a process)
PLUGIN_EP = "OpenVINOExecutionProvider"


@dataclass(frozen=True)
class PluginDevice:
    """One device that an ONNX Runtime plugin EP offers (``onnxruntime.get_ep_devices()``)."""

    ep_name: str
    kind: str  # "CPU", "GPU" or "NPU"
    vendor: str


@dataclass(frozen=True)
class DeviceReport:
    onnxruntime_version: str
    ort_listed: tuple[str, ...]  # onnxruntime.get_available_providers()
    ort_working: tuple[str, ...]  # listed providers a probe session really ran on
    ort_failures: tuple[tuple[str, str], ...]  # (provider, why it did not work)
    plugin_status: str  # "not installed" | "registered" | an error
    plugin_devices: tuple[PluginDevice, ...]  # the plugin EP's devices (empty on non-Intel hardware)
    openvino_version: str | None  # None: the openvino package is not installed
    openvino_devices: tuple[str, ...]  # openvino.Core().available_devices, e.g. ("CPU", "GPU.0", "NPU")
    openvino_names: tuple[tuple[str, str], ...]  # (device, FULL_DEVICE_NAME)
    cpu_vendor: str = ""  # /proc/cpuinfo vendor_id, e.g. "GenuineIntel", "AuthenticAMD"

    def ort_works(self, provider: str) -> bool:
        return provider == ORT_CPU or provider in self.ort_working

    def openvino_has(self, device: str) -> bool:
        """``device`` "GPU" matches "GPU", "GPU.0", "GPU.1"; "GPU.1" matches only itself."""
        return any(d == device or d.split(".")[0] == device for d in self.openvino_devices)

    def plugin_has(self, kind: str) -> bool:
        return any(d.ep_name == PLUGIN_EP and d.kind == kind for d in self.plugin_devices)

    def lines(self) -> list[str]:
        """A human summary, one fact a line."""
        failures = dict(self.ort_failures)
        out = [f"onnxruntime {self.onnxruntime_version}"]
        for provider in self.ort_listed:
            state = "works" if self.ort_works(provider) else f"listed but does not work: {failures.get(provider, '?')}"
            if provider not in (ORT_CPU, *ORT_ACCELERATORS):
                state = "listed (not used by mirrorsd)"
            out.append(f"  {provider:28s} {state}")
        out.append(f"OpenVINO plugin EP ({PLUGIN_PACKAGE}): {self.plugin_status}")
        if self.plugin_status == "registered":
            if self.plugin_devices:
                out += [f"  {d.ep_name} {d.kind} ({d.vendor})" for d in self.plugin_devices]
            else:
                out.append("  no devices (it only sees Intel CPUs, GPUs and NPUs)")
        if self.openvino_version is None:
            out.append("OpenVINO runtime: not installed (pip install 'mirrorsd[openvino]')")
        else:
            out.append(f"OpenVINO runtime {self.openvino_version}")
            names = dict(self.openvino_names)
            out += [f"  {d:8s} {names.get(d, '')}" for d in self.openvino_devices]
            if not self.openvino_devices:
                out.append("  no devices")
        return out


_lock = threading.Lock()


def probe(refresh: bool = False) -> DeviceReport:
    """Look at this machine once per process (each ONNX Runtime try creates a session)."""
    with _lock:
        if refresh:
            _probe.cache_clear()
        return _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> DeviceReport:
    import onnxruntime as ort

    listed = tuple(ort.get_available_providers())
    working, failures = [], []
    for provider in listed:
        if provider in ORT_ACCELERATORS:
            ok, why = try_ort_provider(provider)
            (working.append(provider) if ok else failures.append((provider, why)))
    plugin_status, plugin_devices = _plugin_devices()
    ov_version, ov_devices, ov_names = _openvino()
    return DeviceReport(ort.__version__, listed, tuple(working), tuple(failures), plugin_status, plugin_devices,
                        ov_version, ov_devices, ov_names, _cpu_vendor())


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def try_ort_provider(provider: str) -> tuple[bool, str]:
    """Run a one-node graph on ``provider``; it works only if the session keeps it first in get_providers()."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # a missing CUDA library logs an error before falling back: that is expected here
    if provider == "DmlExecutionProvider":
        opts.enable_mem_pattern = False
    try:
        providers = [provider] if provider == ORT_CPU else [provider, ORT_CPU]
        session = ort.InferenceSession(probe_model_bytes(), opts, providers=providers)
        session.run(None, {"x": np.ones((1, 4), np.float32)})
    except Exception as exc:  # noqa: BLE001 - any failure means "does not work"; the reason is reported
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    got = session.get_providers()
    if got[0] != provider:
        return False, f"a session asking for it ran on {got[0]} (no device or driver)"
    return True, ""


def _plugin_devices() -> tuple[str, tuple[PluginDevice, ...]]:
    try:
        register_plugin_ep()
    except ImportError:
        return "not installed", ()
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop the CPU paths; it is reported
        return f"failed to register: {type(exc).__name__}: {str(exc)[:160]}", ()
    import onnxruntime as ort

    devices = tuple(PluginDevice(d.ep_name, d.device.type.name, str(d.device.vendor))
                    for d in ort.get_ep_devices() if d.ep_name == PLUGIN_EP)
    return "registered", devices


_registered = False


def register_plugin_ep() -> None:
    """Register the OpenVINO plugin EP library with ONNX Runtime (once per process). ImportError if absent."""
    global _registered
    import onnxruntime as ort

    plugin = __import__(PLUGIN_PACKAGE)
    if _registered:
        return
    try:
        ort.register_execution_provider_library(PLUGIN_REGISTRATION, plugin.get_library_path())
    except Exception as exc:
        if "already registered" not in str(exc):
            raise
    _registered = True


def _openvino() -> tuple[str | None, tuple[str, ...], tuple[tuple[str, str], ...]]:
    try:
        ov = load_openvino()
    except ImportError:
        return None, (), ()
    core = ov.Core()
    devices = tuple(core.available_devices)
    names = []
    for device in devices:
        try:
            names.append((device, str(core.get_property(device, "FULL_DEVICE_NAME"))))
        except Exception:  # noqa: BLE001 - a name is decoration; the device is still listed
            names.append((device, ""))
    return ov.__version__.split("-")[0], devices, tuple(names)


@functools.lru_cache(maxsize=1)
def probe_model_bytes() -> bytes:
    """A serialized ONNX model ``y = x + x`` (x: float[1, 4]), written by hand so probing needs no onnx package."""
    dims = _msg(1, _varint_field(1, 1)) + _msg(1, _varint_field(1, 4))  # TensorShapeProto.dim x2
    tensor_type = _varint_field(1, 1) + _msg(2, dims)  # elem_type FLOAT, shape
    value_type = _msg(1, tensor_type)  # TypeProto.tensor_type

    def value_info(name: str) -> bytes:
        return _msg(1, name.encode()) + _msg(2, value_type)

    node = _msg(1, b"x") + _msg(1, b"x") + _msg(2, b"y") + _msg(4, b"Add")
    graph = _msg(1, node) + _msg(2, b"probe") + _msg(11, value_info("x")) + _msg(12, value_info("y"))
    opset = _msg(1, b"") + _varint_field(2, 17)
    return _varint_field(1, 8) + _msg(7, graph) + _msg(8, opset)  # ir_version 8, graph, opset 17
