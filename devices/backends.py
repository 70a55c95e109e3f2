"""Backends behind one interface: something that opens an ONNX file on a device and runs it.

    BACKENDS[name](path, SessionSettings) -> BackendSession
    BackendSession.run(feeds: {name: ndarray}) -> {name: ndarray}
    BackendSession.effective -> what actually runs the graph (provider or compiled device), read back, never assumed

    "onnxruntime"    OrtSession         ONNX Runtime with a built-in EP: CPU, CUDA, DirectML
    "ort-openvino"   OrtPluginSession   ONNX Runtime with the OpenVINO plugin EP (onnxruntime-ep-openvino)
    "openvino"       OpenVINOSession    the OpenVINO runtime itself (Core.compile_model)

ONNX Runtime falls back to CPU silently, so ``effective`` is read from the session. Every ``run`` releases the GIL
while the graph computes (ORT's ``run`` and OpenVINO's ``infer`` both do), so a draft thread and a target thread
overlap.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from mirrorsd.devices.heap import HeapTrimmer, trim_heap
from mirrorsd.devices.openvino_import import load_openvino
from mirrorsd.devices.unpack import unpacked_bytes, uses_external_data
from mirrorsd.errors import DeviceError, GraphFileError


ATTENTION_MODES = ("fused", "exact-softmax", "as-exported")
KV_PRECISIONS = ("f32", "f16", "bf16", "u8")


@dataclass(frozen=True)
class OpenVINOTuning:
    """How the OpenVINO runtime computes one graph, beyond device, threads and precision (devices/openvino_graph.py;
    scripts/lab/openvino_target.py measures each choice).

    attention     "fused": one ScaledDotProductAttention op per attention (the plugin's attention kernel);
                  "exact-softmax": the exported ops with a row-invariant softmax; "as-exported": untouched
    stateful      KV pairs become state inside the request (graphs with KV only; the runtime then keeps a
                  StateCache, and a rollback trims the state)
    kv_precision  what a stateful cache stores: "f32", "f16", "bf16" or "u8" (the plugin's default)
    dynamic_quantization_group_size
                  int8 activations for compressed (int4/int8) weights, per group of this many inputs; None = the
                  plugin's default (32 on CPU), 0 = off (f32 activations, much slower)
    """

    attention: str = "as-exported"  # the bare default changes nothing; DeviceRequest holds the measured choices
    stateful: bool = False
    kv_precision: str = "f32"
    dynamic_quantization_group_size: int | None = None

    def check(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise DeviceError(f"Unknown OpenVINO attention mode '{self.attention}'",
                              f"modes are {', '.join(ATTENTION_MODES)}", "pick one")
        if self.kv_precision not in KV_PRECISIONS:
            raise DeviceError(f"Unknown KV precision '{self.kv_precision}'", f"they are {', '.join(KV_PRECISIONS)}",
                              "pick one")

    def inexact(self) -> str:
        """Why a target computed this way would not verify a window as it decodes one row ("" when it would).
        Measured on Qwen2.5-Coder-1.5B int4 (scripts/lab/openvino_target.py); each reason is one of those results."""
        if self.attention == "as-exported":
            return "the plugin's Softmax sums a row in an order that depends on the window (0.29 logits with int8 " \
                   "activations)"
        if self.attention == "fused" and not self.stateful:
            return "the plugin's attention kernel for several query rows differs from its one-row kernel"
        if self.stateful and self.kv_precision == "u8":
            return "a u8 cache is re-quantized when a rejected window is trimmed"
        return ""


# How a session's own ONNX Runtime thread pool waits (SessionSettings.spin_in_run):
#   spinning within a run (what `mirrorsd generate` and `mirrorsd bench` open for every mode but mirror): the workers
#       spin between the graph's parallel sections instead of sleeping. A decode step has hundreds of them (every
#       MatMulNBits), and waking a sleeping worker for each cost 12-16 % of ar's, sd's and ngram's speed on the 2-core
#       machines measured. At the end of every run the spinning stops (session.force_spinning_stop), so a session
#       that is not running takes no core from one that is: sd's draft and target, and the graphs of a target step,
#       run one after another on pools of their own. Pools that kept spinning after their runs made ar 30 % slower
#       (docs/lab-notes/performance-log.md, "pools that spin within a run").
#   sleeping (the default, and mode mirror's): for sessions that may run at the same time on the same cores
#       (Mirror-SD's draft beside its target), where a spinning worker of one takes the core the other needs: mirror
#       measured 9 % slower with the Qwen pair, and the tiny models' Mirror-SD tests 30 % slower, spinning.
SPINNING_POOL = (("session.intra_op.allow_spinning", "1"), ("session.force_spinning_stop", "1"))
SLEEPING_POOL = (("session.intra_op.allow_spinning", "0"),)
KERNEL_REFUSAL = "mirrorsd.kern MatMulNBits node"  # how mirrorsd's kernel starts the reason it refuses a node


@dataclass(frozen=True)
class SessionSettings:
    """How to run one graph: the device request and the host threads it may use."""

    device: str = "cpu"  # a backend-specific device: "cpu", "cuda", "dml" (ORT); "CPU", "GPU", "NPU" (OpenVINO)
    threads: int = 1
    precision: str = "f32"  # OpenVINO inference precision hint; ONNX Runtime CPU is always f32
    fixed_shapes: bool = False  # compile one static-shape variant per input shape seen (what an NPU needs)
    openvino: OpenVINOTuning = OpenVINOTuning()
    kv_pairs: tuple[tuple[str, str], ...] = ()  # (past input, present output) names; a stateful graph needs them
    kernels: str = "ort"  # ONNX Runtime CPU: "mirrorsd" runs devices/kernels' MatMulNBits (devices/kernel_choice.py)
    shared_pool: bool = False  # ONNX Runtime: the process's one spinning pool (devices/thread_pool.py)
    spin_in_run: bool = False  # ONNX Runtime, a pool of its own: SPINNING_POOL, else SLEEPING_POOL (see above)
    fuse_attention: bool = False  # with mirrorsd's kernels: each layer's attention as one fused node, where it fits
    # with mirrorsd's kernels: the KV cache written in place (devices/kernels/kv_in_place.py); with fuse_attention
    # too, in place where the graph's layers take it, else fused
    kv_in_place: bool = False
    # with mirrorsd's kernels: this output (the LM head's logits) computed from row ``logits_from`` on, an input the
    # rewrite adds (devices/kernels/logits_rows.py); empty: the graph as exported
    logits_output: str = ""


class BackendSession(Protocol):
    effective: str

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def input_names(self) -> list[str]: ...


def _kernel_refusal(exc: BaseException) -> str:
    """What mirrorsd's kernel said when it refused a node at session creation (devices/kernels/src/kernel.cpp:
    "mirrorsd.kern MatMulNBits node 'NAME': WHAT. Fix: ..."), without its fix; empty for any other failure."""
    text = str(exc)
    start = text.find(KERNEL_REFUSAL)
    if start < 0:
        return ""
    return text[start:].split(". Fix:", 1)[0].strip()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _release_model_bytes(session) -> bool:
    """A session made from bytes (unpacked weights, a fused attention) keeps them in ``_model_bytes`` only to rebuild
    itself on a provider fallback, which mirrorsd never asks for: hundreds of MB held for nothing. Let them go."""
    if getattr(session, "_model_bytes", None) is None:
        return False
    session.disable_fallback()
    session._model_bytes = None
    return True


def _read_openvino(core, path: Path):
    """``core.read_model`` of the graph file, or of its bytes with packed weights unpacked (devices/unpack.py:
    OpenVINO's MatMulNBits reader needs constant zero points, so it cannot read the packed graph itself)."""
    data = unpacked_bytes(path)
    if data is None:
        return core.read_model(str(path))
    if uses_external_data(data):
        raise GraphFileError(f"OpenVINO cannot read the packed weights of '{path.name}'",
                             "its other weights are in external data files, which OpenVINO finds only when it "
                             "reads the graph from its file", "export with --weight-storage plain for OpenVINO")
    return core.read_model(data)


def unpacked_for_session(path: Path, opts) -> bytes | None:
    """The graph's bytes with its packed weights unpacked (devices/unpack.py), ``opts`` (ONNX Runtime SessionOptions)
    told where its external data is; None for a graph without packed weights (open the file)."""
    from mirrorsd.devices.kernels import external_data_config

    data = unpacked_bytes(path)
    if data is not None:
        for key, value in external_data_config(path).items():
            opts.add_session_config_entry(key, value)
    return data


class OrtSession:
    """An ONNX Runtime InferenceSession on one built-in execution provider."""

    PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider"}

    def __init__(self, path: Path, settings: SessionSettings) -> None:
        import onnxruntime as ort

        opts = self._options(settings)
        provider = self.PROVIDERS.get(settings.device, settings.device)
        providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
        if provider == "DmlExecutionProvider":
            opts.enable_mem_pattern = False  # DirectML's documented requirement
        self.kernels, self.fused_attention = "ort", 0
        self.kv_in_place: list = []  # the layers whose cache the host feeds as views (devices/kernels/kv_in_place.py)
        self.logits_rows = False  # the graph takes logits_from (devices/kernels/logits_rows.py)
        unpacked = unpacked_for_session(path, opts)
        model: str | bytes = str(path) if unpacked is None else unpacked
        if settings.kernels == "mirrorsd" and provider == "CPUExecutionProvider":
            from mirrorsd.devices import kernels
            from mirrorsd.devices.kernels.rewrite import imports_ort_domain

            # Only graphs that hold MatMulNBits: registering the replacement claims ONNX Runtime's contrib domain,
            # and a graph that does not import it then fails to load the contrib ops its optimizer fuses in.
            if imports_ort_domain(path):
                kernels.register(opts, replace=True)  # every com.microsoft MatMulNBits node runs mirrorsd's kernel
                self.kernels = "mirrorsd"
                if settings.kv_in_place:  # (the draft asks for both: in place where its layers take it)
                    model = self._in_place(path, opts, unpacked)
                if settings.fuse_attention and not self.kv_in_place:
                    model = self._fused(path, opts, unpacked)
                if settings.logits_output:
                    current = None if isinstance(model, str) else model  # the bytes so far, if any
                    unpacked = None  # (a packed graph's weights are inline: one copy fewer held while rewriting)
                    model = self._logits_rows(path, opts, current, settings.logits_output)
                    del current
        self._open(lambda: ort.InferenceSession(model, opts, providers=providers), path)

    def _fused(self, path: Path, opts, unpacked: bytes | None = None) -> str | bytes:
        """The graph with each layer's attention one mirrorsd.kern::GroupedAttention node
        (devices/kernels/attention_rewrite.py), or unchanged when its attention does not have the shape the rewrite
        knows."""
        from mirrorsd.devices.kernels.attention_rewrite import fuse_attention

        model, self.fused_attention = self._rewritten(path, opts, unpacked, fuse_attention, 0)
        return model

    def _in_place(self, path: Path, opts, unpacked: bytes | None = None) -> str | bytes:
        """The graph with each layer's KV cache written in place into views the host feeds
        (devices/kernels/kv_in_place.py), or unchanged when its layers do not have the shape the rewrite knows (a
        graph without a KV cache, another exporter's)."""
        from mirrorsd.devices.kernels.kv_in_place import kv_in_place

        model, self.kv_in_place = self._rewritten(path, opts, unpacked, kv_in_place, [])
        return model

    def _logits_rows(self, path: Path, opts, current: bytes | None, logits: str) -> str | bytes:
        """The graph (``current``'s bytes, else the file's) with its ``logits`` output scored from row
        ``logits_from`` on (devices/kernels/logits_rows.py), or unchanged when its head is not one MatMulNBits."""
        from mirrorsd.devices.kernels.logits_rows import logits_from_input

        model, self.logits_rows = self._rewritten(path, opts, current, lambda m: logits_from_input(m, logits),
                                                  False)
        return model

    @staticmethod
    def _rewritten(path: Path, opts, unpacked: bytes | None, rewrite, nothing):
        """(the graph's bytes — ``unpacked``, or the file's — through ``rewrite``, what it changed), or (the graph
        as it was, ``nothing``) when the rewrite changed nothing or the bytes are malformed (opening the file then
        says what is wrong with it)."""
        from mirrorsd.devices.kernels import external_data_config
        from mirrorsd.onnx_wire import MalformedProtobuf

        unchanged = str(path) if unpacked is None else unpacked
        try:
            data, changed = rewrite(path.read_bytes() if unpacked is None else unpacked)
        except MalformedProtobuf:
            return unchanged, nothing
        if not changed:
            return unchanged, nothing
        if unpacked is None:  # (unpacked bytes had their external-data folder set already)
            for key, value in external_data_config(path).items():
                opts.add_session_config_entry(key, value)
        return data, changed

    @staticmethod
    def _options(settings: SessionSettings):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        if settings.shared_pool:  # thread counts and spinning are the pool's (set here, ONNX Runtime warns)
            from mirrorsd.devices.thread_pool import use_shared_pool

            use_shared_pool(opts, max(1, settings.threads))
            return opts
        opts.intra_op_num_threads = max(1, settings.threads)
        opts.inter_op_num_threads = 1
        for key, value in SPINNING_POOL if settings.spin_in_run else SLEEPING_POOL:
            opts.add_session_config_entry(key, value)
        return opts

    def _open(self, make, path: Path) -> None:
        try:
            self.session = make()
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            refusal = _kernel_refusal(exc)
            if refusal:  # a valid graph with a MatMulNBits layout mirrorsd's kernel does not take
                raise GraphFileError(f"mirrorsd's MatMulNBits kernel cannot run a node of '{path.name}'", refusal,
                                     "pass --kernels ort to run the graph on ONNX Runtime's own kernel, or export "
                                     "it with mirrorsd-export (blocks of 32, no uint8 zero points)") from exc
            raise GraphFileError(f"ONNX Runtime could not load '{path.name}'", _first_line(exc),
                                 "the file may be truncated or damaged: re-export the folder") from exc
        if _release_model_bytes(self.session):
            trim_heap()  # the bytes, and the unpacking's temporaries, back to the system
        self.effective = self.session.get_providers()[0]
        self._outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self.session.run(self._outputs, feeds)))

    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]


class OrtPluginSession(OrtSession):
    """ONNX Runtime with the OpenVINO plugin EP on one of its devices (``settings.device``: "CPU", "GPU", "NPU").

    The plugin is chosen through ``add_provider_for_devices``; naming it in ``providers=[...]`` is silently ignored.
    """

    def __init__(self, path: Path, settings: SessionSettings) -> None:
        import onnxruntime as ort

        from mirrorsd.devices.probe import PLUGIN_EP, register_plugin_ep

        try:
            register_plugin_ep()
        except ImportError as exc:
            raise DeviceError("The OpenVINO plugin EP is not installed", str(exc),
                              "pip install onnxruntime-ep-openvino, or pick another device") from exc
        kind = settings.device.split(".")[0].upper()
        devices = [d for d in ort.get_ep_devices() if d.ep_name == PLUGIN_EP and d.device.type.name == kind]
        if not devices:
            raise DeviceError(f"The OpenVINO plugin EP offers no {kind} device", "it sees only Intel hardware",
                              "run `mirrorsd devices` to see what this machine has")
        opts = self._options(settings)
        provider_options = {"device_type": kind}
        if settings.precision == "f32" and kind in ("CPU", "GPU"):
            provider_options["load_config"] = json.dumps({kind: {"INFERENCE_PRECISION_HINT": "f32"}})
        opts.add_provider_for_devices(devices[:1], provider_options)
        unpacked = unpacked_for_session(path, opts)
        self._open(lambda: ort.InferenceSession(str(path) if unpacked is None else unpacked, opts), path)
        if self.effective == PLUGIN_EP:
            self.effective = f"{PLUGIN_EP}:{kind}"


# OpenVINO's CPU plugin keeps the kernels it compiled for each input shape, 5000 shapes by default. A KV cache makes
# every decode step a new shape (past length + 1), so that cache only grew, to gigabytes over a long generation.
# A step almost never repeats a shape, so a small cache costs nothing and keeps memory flat
# (scripts/lab/openvino_memory.py measures it; docs/reliability.md has the numbers).
CPU_RUNTIME_CACHE_SHAPES = 16


class OpenVINOSession:
    """The OpenVINO runtime: ``Core.compile_model(read_model(path), device, config)`` and one InferRequest.

    Dynamic graphs (the KV inputs grow every step) compile once with their dynamic axes. With
    ``settings.fixed_shapes`` every distinct set of input shapes gets its own static compile (``Model.reshape``),
    which is what an NPU requires; the static-shape draft only ever shows one or two shapes (batch 1 for the main
    cache, the branch batch for rollouts), so this stays a handful of compiles. ``settings.openvino`` rewrites the
    graph at load (devices/openvino_graph.py); a stateful session keeps the KV in its request (see ``trim_state``).
    """

    MAX_VARIANTS = 4  # static compiles kept per graph; more means the graph's shapes are not really fixed

    def __init__(self, path: Path, settings: SessionSettings) -> None:
        try:
            ov = load_openvino()
        except ImportError as exc:
            raise DeviceError("The OpenVINO runtime is not installed", str(exc),
                              "pip install 'mirrorsd[openvino]', or pick an onnxruntime device") from exc
        settings.openvino.check()
        self.path, self.settings = path, settings
        self.core = ov.Core()
        try:
            self.model = _read_openvino(self.core, path)
        except GraphFileError:
            raise
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError with the parser's message
            raise GraphFileError(f"OpenVINO could not read '{path.name}'", _first_line(exc),
                                 "the file may be truncated or damaged: re-export the folder") from exc
        self._inputs = [p.get_any_name() for p in self.model.inputs]  # as exported (a stateful graph hides its KV)
        # the rewrites were measured on the CPU plugin only: other devices get the graph as exported
        self.tuned = settings.device.split(".")[0].upper() == "CPU" and not settings.fixed_shapes
        self.stateful = self.tuned and settings.openvino.stateful and bool(settings.kv_pairs)
        self.state_length = 0  # slots held by a stateful session's state
        self.rewrites = self._rewrite(self.model, settings.openvino)
        self._variants: dict[tuple, tuple] = {}  # input shapes -> (compiled model, request, output names)
        self._lock = threading.Lock()
        self.effective = settings.device
        # a new input shape every step makes the CPU plugin reallocate its buffers: give the freed pages back
        self.heap = HeapTrimmer() if self.tuned else None  # (devices/heap.py says why and what it measured)
        if not settings.fixed_shapes:
            self._variants[()] = self._compile(self.model)
            if self.stateful and self.rewrites.get("fused_attention", 0) > _cached_attention(self._variants[()][0]):
                self._recompile_without_fusion()
        else:  # compile batch 1 now, so that a device that cannot take the graph fails at load, not mid-generation
            ones = {p.get_any_name(): [d.get_length() if d.is_static else 1 for d in p.get_partial_shape()]
                    for p in self.model.inputs}
            self._variant({name: np.empty(shape, np.int8) for name, shape in ones.items()})

    def _recompile_without_fusion(self) -> None:
        """The plugin did not take a fused attention's cache into it (a pattern it does not know): its attention would
        then run several query rows through another kernel than one row. Fall back to the exact softmax."""
        import warnings

        warnings.warn(f"{self.path.name}: OpenVINO did not fuse every attention with its cache; using the exact "
                      "softmax instead (slower, still exact)", RuntimeWarning, stacklevel=3)
        self.model = _read_openvino(self.core, self.path)
        exact = dataclasses.replace(self.settings.openvino, attention="exact-softmax")
        self.rewrites = self._rewrite(self.model, exact)
        self._variants[()] = self._compile(self.model)

    def _rewrite(self, model, tuning: OpenVINOTuning) -> dict[str, int]:
        """Apply ``tuning`` to the graph; how many attentions / softmaxes / KV pairs each rewrite took."""
        from mirrorsd.devices import openvino_graph as graph

        done = {}
        if not self.tuned:
            return done
        # fused attention is exact only with the cache inside it: a graph opened without its KV pairs keeps its ops
        if tuning.attention == "fused" and (self.stateful or not tuning.stateful):
            done["fused_attention"] = graph.fused_attention(model)
        if tuning.attention != "as-exported":
            done["row_invariant_softmax"] = graph.row_invariant_softmax(model)  # whatever was not fused
        if self.stateful:
            graph.make_stateful(model, dict(self.settings.kv_pairs))
            done["state_pairs"] = len(self.settings.kv_pairs)
        return done

    def config(self) -> dict[str, str]:
        """Compile options: f32 compute where numbers are compared (CPU/GPU default to bf16/f16), thread count, and
        on CPU the tuning's KV cache precision (used by stateful attention only) and dynamic quantization group."""
        device = self.settings.device.split(".")[0].upper()
        tuning = self.settings.openvino
        config = {"PERFORMANCE_HINT": "LATENCY"}
        if device in ("CPU", "GPU") and self.settings.precision:
            config["INFERENCE_PRECISION_HINT"] = self.settings.precision
        if device == "CPU":
            config["INFERENCE_NUM_THREADS"] = str(max(1, self.settings.threads))
            config["NUM_STREAMS"] = "1"
            config["ENABLE_HYPER_THREADING"] = "NO"
            config["CPU_RUNTIME_CACHE_CAPACITY"] = str(CPU_RUNTIME_CACHE_SHAPES)
            config["KV_CACHE_PRECISION"] = tuning.kv_precision
            if tuning.dynamic_quantization_group_size is not None:
                config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(tuning.dynamic_quantization_group_size)
        return config

    def _compile(self, model) -> tuple:
        try:
            compiled = self.core.compile_model(model, self.settings.device, self.config())
        except Exception as exc:  # noqa: BLE001 - unknown device, unsupported op or shape: all are device errors
            raise DeviceError(f"OpenVINO could not compile '{self.path.name}' for {self.settings.device}",
                              _first_line(exc), "run `mirrorsd devices`, or pick another device") from exc
        executed = compiled.get_property("EXECUTION_DEVICES")
        self.effective = ",".join(executed) if executed else self.settings.device
        outputs = [p.get_any_name() for p in compiled.outputs]
        return compiled, compiled.create_infer_request(), outputs

    def _variant(self, feeds: dict[str, np.ndarray]) -> tuple:
        if not self.settings.fixed_shapes:
            return self._variants[()]
        key = tuple(tuple(feeds[name].shape) for name in self._inputs)
        variant = self._variants.get(key)
        if variant is None:
            if len(self._variants) >= self.MAX_VARIANTS:
                raise DeviceError(f"'{self.path.name}' was fed a new input shape set on a fixed-shape device",
                                  f"{len(self._variants)} static variants were compiled already",
                                  "fixed-shape devices need the static draft: export with --static-draft")
            model = self.model.clone()
            model.reshape({name: list(shape) for name, shape in zip(self._inputs, key)})
            variant = self._variants[key] = self._compile(model)
        return variant

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:  # one InferRequest per variant: calls from two threads must not interleave
            _, request, outputs = self._variant(feeds)
            if self.stateful:
                from mirrorsd.devices.openvino_graph import BEAM_INPUT

                first = feeds[self._inputs[0]]  # [B, S, ...]
                feeds = {**feeds, BEAM_INPUT: np.arange(first.shape[0], dtype=np.int32)}  # no reordering
            # infer releases the GIL. Inputs are borrowed for the call (no copy of contiguous KV buffers);
            # outputs are copied out, since the request's own buffers are reused by the next call.
            result = request.infer(feeds, share_inputs=True, share_outputs=False)
            if self.stateful:
                self.state_length += first.shape[1]
            outs = {name: result[i] for i, name in enumerate(outputs)}
            if self.heap is not None:
                self.heap.after_call()
            return outs

    def input_names(self) -> list[str]:
        return list(self._inputs)

    def compiled_model(self):
        """The compiled model of a dynamic-shape session (the first static variant of a fixed-shape one)."""
        return next(iter(self._variants.values()))[0]

    # ---- stateful sessions: the KV cache lives in the request ----------------------------------------------------
    def reset_state(self) -> None:
        """Empty every state; the next call's batch sets the state's batch."""
        with self._lock:
            self._variants[()][1].reset_state()
            self.state_length = 0

    def trim_state(self, length: int) -> None:
        """Keep the first ``length`` slots of every state (a rejected window's slots go).

        OpenVINO has no in-place trim: each state is read, sliced and written back (what OpenVINO GenAI does too),
        moving the kept KV twice (a few ms a rollback, growing with the context). An f16/bf16 cache
        survives the round trip bit for bit (f32 holds every value); a u8 cache is re-quantized from its dequantized
        values and changes, so the runtime refuses u8 for the target (OpenVINOTuning.inexact).
        """
        ov = load_openvino()

        if not 0 <= length <= self.state_length:
            raise ValueError(f"cannot trim a state of {self.state_length} slots to {length}")
        with self._lock:
            if length == self.state_length:
                return
            for state in self._variants[()][1].query_state():
                kept = np.ascontiguousarray(state.state.data[:, :, :length])  # [B, h, length, D]
                state.state = ov.Tensor(kept)
            self.state_length = length


def _cached_attention(compiled) -> int:
    """Attention nodes of a compiled model that read their KV from state (the plugin's cache-fused attention)."""
    count = 0
    for node in compiled.get_runtime_model().get_ordered_ops():
        kinds = [i.get_source_output().get_node().get_rt_info()["layerType"].astype(str) for i in node.inputs()]
        count += node.get_rt_info()["layerType"].astype(str) == "ScaledDotProductAttention" and "MemoryInput" in kinds
    return count


BACKENDS = {"onnxruntime": OrtSession, "ort-openvino": OrtPluginSession, "openvino": OpenVINOSession}


def default_threads() -> int:
    """Every core for each session, whatever the mode. ar and sd never run two sessions at once, so each should
    have the whole CPU; Mirror-SD's draft and target then share the cores (with spinning off, an idle session's
    threads sleep), which measured faster than splitting them on the 2-core machines tried
    (docs/lab-notes/performance-log.md, Changes: every core for each session)."""
    return max(1, os.cpu_count() or 1)
