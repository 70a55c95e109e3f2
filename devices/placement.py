"""Placement: which backend and device runs each graph, decided once per pipeline and reported as it really is.

Device strings (``--target-device``, ``--draft-device``; case does not matter after the colon):

    auto                 the default chain for that model (below)
    cpu                  ONNX Runtime, CPU execution provider (alias: ort-cpu)
    cuda                 ONNX Runtime, CUDA execution provider (onnxruntime-gpu, an NVIDIA GPU)
    dml                  ONNX Runtime, DirectML execution provider (onnxruntime-directml, Windows)
    openvino:DEV         the OpenVINO runtime on DEV = CPU | GPU | NPU (or GPU.1, ... as OpenVINO names them)
    ort-openvino:DEV     ONNX Runtime with the OpenVINO plugin EP (onnxruntime-ep-openvino) on DEV

    auto chains          target: cuda -> dml -> openvino:GPU -> cpu
                         draft:  openvino:NPU -> ort-openvino:NPU -> openvino:CPU -> cpu

An explicit device that this machine cannot honour raises DeviceError listing what it has. ``auto`` never fails: it
takes the first usable entry and records the entries it skipped, with the reasons (``mirrorsd devices`` prints them).
Skipping a device this machine does not have, or one the policy does not pick (``auto_skips``), is the expected
case: one INFO log line, no warning. A device that is here and still could not take the graph (a provider that is
listed but does not work, an NPU without a static draft, a session that silently moved to the CPU) is a surprise:
DeviceFallbackWarning, and ``fell_back`` in the generation statistics (``stats.placement``). NPU devices take only
fixed-shape graphs, so the draft on an NPU runs the folder's static draft (``mirrorsd-export --static-draft``); the
target's graphs are dynamic and never go to an NPU.
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from mirrorsd import names
from mirrorsd.devices.backends import BACKENDS, OpenVINOTuning, OrtSession, SessionSettings
from mirrorsd.devices.kernel_choice import SlowKernelWarning, resolve_kernels, slow_weights_note
from mirrorsd.devices.probe import PLUGIN_EP, DeviceReport, probe
from mirrorsd.errors import DeviceError

AUTO = "auto"
CHAINS = {
    "target": ("cuda", "dml", "openvino:GPU", "cpu"),
    "draft": ("openvino:NPU", "ort-openvino:NPU", "openvino:CPU", "cpu"),
}
SYNTAX = "auto, cpu, cuda, dml, openvino:CPU|GPU|NPU, ort-openvino:CPU|GPU|NPU"
FIXED_SHAPE_KINDS = ("NPU",)  # devices that compile static shapes only
log = logging.getLogger("mirrorsd.devices")

FUSED_ATTENTION_MARK = "[fused attention]"  # in describe(), so a profile measured without it is not reused
KV_IN_PLACE_MARK = "[KV in place]"  # likewise
KERNELS_MARK = "[mirrorsd kernels]"  # in describe(): the profile cache keys on it (runtime/planner/profile.py)
SHARED_POOL_MARK = " [shared pool]"  # in describe(); the profile cache does not key on it (a split of its own)
# in describe(): workers that spin (a pool of its own within a run, or the shared pool); the profile cache keys on it,
# so the shared pool's split and the spinning per-session splits share one file, and sleeping pools have their own
SPINNING_POOL_MARK = " [spinning]"


def auto_skips(label: str, report: DeviceReport) -> str:
    """Devices the auto chain does not pick although they work here (why, or ""). The one place this policy lives.
    Mode auto overrides it from measurements: with cached profiles of the placements (``mirrorsd devices --profile``
    profiles every one, these included) it loads the one predicted fastest (runtime/planner/placement.py).

    OpenVINO's CPU plugin is skipped on every CPU. Its memory grew with every new input shape (docs/platform-notes.md,
    OpenVINO); the bounded runtime cache now keeps it flat, but it has not measured as fast as ONNX Runtime for the
    draft on the CPUs tried (docs/reliability.md, docs/lab-notes/performance-log.md). Asked for explicitly, it runs.
    """
    if label == "openvino:CPU":
        return "auto does not pick OpenVINO's CPU plugin (not measured as fast as ONNX Runtime here; ask for it " \
               "explicitly to use it)"
    return ""


class DeviceFallbackWarning(UserWarning):
    """``auto`` could not use the first device of its chain and took a later one."""


@dataclass(frozen=True)
class DeviceRequest:
    """What the user asked for: a device per model ("auto" = the default chain) and threads per session."""

    target: str = AUTO
    draft: str = AUTO
    target_threads: int | None = None
    draft_threads: int | None = None
    static_draft: bool = False  # run the fixed-shape draft graph even where the device does not need it
    # How the OpenVINO CPU plugin computes each model's graphs (ignored elsewhere), measured by
    # scripts/lab/openvino_target.py (docs/lab-notes/performance-log.md, the int4 target on OpenVINO's CPU plugin):
    # the target's is the fastest setting that keeps sd/mirror equal to ar (stateful, fused attention, f16 cache);
    # the draft's exactness does not matter and fusing its attention did not make it faster.
    target_openvino: OpenVINOTuning = OpenVINOTuning(attention="fused", stateful=True, kv_precision="f16")
    draft_openvino: OpenVINOTuning = OpenVINOTuning(attention="as-exported")
    kernels: str = AUTO  # MatMulNBits on ONNX Runtime CPU: auto | mirrorsd | ort (devices/kernel_choice.py)
    # Where mirrorsd's kernels run the draft (ONNX Runtime CPU) and its cache is not in place (draft_kv_in_place
    # below), each layer's attention runs as one fused node (devices/kernels/attention_rewrite.py) instead of the
    # graph's ~30 small ones; False (with draft_kv_in_place False) keeps the graph's nodes
    fused_draft_attention: bool = True
    # Where mirrorsd's kernels run the target (ONNX Runtime CPU), write its KV cache in place into buffers the runtime
    # owns and run each layer's attention as one InPlaceAttention node (devices/kernels/kv_in_place.py,
    # runtime/view_cache.py) instead of the graph's Concat of the whole past into new outputs every step: much faster
    # decoding at long contexts, and each row's bits independent of its window (every mode still equals ar); prompt
    # chunks read about as fast as with the Concat at 8k cached tokens, its attention ~0.84 of ONNX Runtime's GEMM
    # (devices/kernels/README.md). False runs the graphs' own nodes, as the C/C++ host does (the two then give the
    # same tokens)
    target_kv_in_place: bool = True
    # Likewise for the draft (ONNX Runtime CPU with mirrorsd's kernels): its cache written in place, each layer's
    # attention one InPlaceAttention node, in place of the fused node above, which reads the past the host feeds
    # and writes it out again as the presents every forward (one-row forwards of the 0.5B draft 0.89x / 0.75x /
    # 0.65x at 300 / 1000 / 2000 cached tokens, the same logits; devices/kernels/README.md). Not beside a
    # streaming draft graph, which shares the plain graph's cache and keeps the exported form
    draft_kv_in_place: bool = True
    # Where mirrorsd's kernels run the draft and the target's suffix (ONNX Runtime CPU), a prompt chunk scores its
    # last row only instead of all 256 (devices/kernels/logits_rows.py: the LM head is ~15 % of a target row's and
    # ~27 % of a draft row's work, and the other rows' logits were never read). The same bits for the rows used
    prompt_last_row_only: bool = True
    # Mode auto: take the placement (of the models left on auto) and the thread split (when no threads are given)
    # that the cached profiles predict fastest (runtime/planner/placement.py, runtime/planner/threads.py)
    plan_from_profile: bool = False
    shared_pool: bool | None = None  # the process's one ONNX Runtime CPU pool; None: as devices/thread_pool.resolve
    # ONNX Runtime CPU sessions with pools of their own: workers spin within a run and stop at its end (True: for a
    # pipeline that runs one session at a time, what `mirrorsd generate` opens for ar, sd, ngram and auto), or sleep
    # between parallel sections (False: safe when the draft runs beside the target, mode mirror; devices/backends.py).
    # None: as plan_from_profile, so that a planned load finds the profiles `mirrorsd devices --profile` measured
    spin_in_run: bool | None = None


@dataclass(frozen=True)
class DeviceChoice:
    """A parsed device string: a key of ``BACKENDS`` and that backend's device name."""

    backend: str
    device: str

    @property
    def label(self) -> str:
        return {"onnxruntime": self.device}.get(self.backend, f"{self.backend}:{self.device}")

    @property
    def kind(self) -> str:
        return self.device.split(".")[0].upper()

    @property
    def fixed_shapes(self) -> bool:
        return self.backend != "onnxruntime" and self.kind in FIXED_SHAPE_KINDS


_PLAIN = {"cpu": DeviceChoice("onnxruntime", "cpu"), "ort-cpu": DeviceChoice("onnxruntime", "cpu"),
          "cuda": DeviceChoice("onnxruntime", "cuda"), "dml": DeviceChoice("onnxruntime", "dml")}
_PREFIXED = {"openvino": "openvino", "ov": "openvino", "ort-openvino": "ort-openvino"}
_OV_DEVICE = re.compile(r"^(CPU|GPU|NPU)(\.\d+)?$")


def parse_device(text: str) -> DeviceChoice:
    """A device string (not ``auto``) -> DeviceChoice; DeviceError on anything else."""
    key = text.strip()
    if key.lower() in _PLAIN:
        return _PLAIN[key.lower()]
    prefix, _, device = key.partition(":")
    if prefix.lower() in _PREFIXED and _OV_DEVICE.match(device.upper()):
        return DeviceChoice(_PREFIXED[prefix.lower()], device.upper())
    raise DeviceError(f"Unknown device '{text}'", f"device strings are: {SYNTAX}",
                      "run `mirrorsd devices` to see which of them this machine has")


def unavailable(choice: DeviceChoice, report: DeviceReport) -> str:
    """Why ``choice`` cannot run here ("" when it can)."""
    if choice.backend == "onnxruntime":
        provider = OrtSession.PROVIDERS[choice.device]
        if report.ort_works(provider):
            return ""
        failures = dict(report.ort_failures)
        if provider in failures:
            return f"{provider} is listed but does not work ({failures[provider]})"
        return f"this onnxruntime build has no {provider}"
    if choice.backend == "openvino":
        if report.openvino_version is None:
            return "the openvino package is not installed"
        if not report.openvino_has(choice.device):
            return f"OpenVINO sees no {choice.device} (it has {', '.join(report.openvino_devices) or 'nothing'})"
        return ""
    if report.plugin_status != "registered":
        return f"the OpenVINO plugin EP is {report.plugin_status}"
    if not report.plugin_has(choice.kind):
        kinds = sorted({d.kind for d in report.plugin_devices})
        return f"the OpenVINO plugin EP offers no {choice.kind} (it offers {', '.join(kinds) or 'no device'})"
    return ""


def available_devices(report: DeviceReport) -> list[str]:
    """Every explicit device string this machine can honour."""
    found = [c.label for c in _PLAIN.values() if not unavailable(c, report)]
    found += [f"openvino:{d}" for d in report.openvino_devices]
    found += sorted({f"ort-openvino:{d.kind}" for d in report.plugin_devices})
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Decision:
    """Where one model's graphs run, and why: the chain entries skipped before it, with their reasons."""

    model: str
    requested: str
    choice: DeviceChoice
    static: bool  # the draft runs the fixed-shape graph (draft_static)
    skipped: tuple[tuple[str, str], ...] = ()
    unexpected: tuple[str, ...] = ()  # skipped devices that are here and could not take the graph (a warning)

    @property
    def fell_back(self) -> bool:
        return bool(self.unexpected)

    @property
    def reason(self) -> str:
        return "; ".join(f"{label}: {why}" for label, why in self.skipped)


class PlacementPolicy:
    """Turns a DeviceRequest into one Decision per model, from a DeviceReport (probed once)."""

    def __init__(self, report: DeviceReport | None = None) -> None:
        self.report = report if report is not None else probe()

    def decide(self, model: str, requested: str, static_available: bool = False,
               static_requested: bool = False) -> Decision:
        if requested.strip().lower() == AUTO:
            return self._auto(model, static_available, static_requested)
        fix = f"this machine has: {', '.join(available_devices(self.report))} (run `mirrorsd devices`), or pass auto"
        try:
            choice = parse_device(requested)
        except DeviceError as exc:  # a typo: say what would work here, not only the syntax
            raise DeviceError(exc.what, exc.why, fix) from None
        why = unavailable(choice, self.report) or self._shape_problem(model, choice, static_available,
                                                                    static_requested)
        if why:
            raise DeviceError(f"Device '{requested}' for the {model} is not available", why, fix)
        return Decision(model, requested, choice, self._static(model, choice, static_requested))

    def candidates(self, model: str, requested: str, static_available: bool = False,
                   static_requested: bool = False) -> list[str]:
        """The devices ``requested`` allows for ``model`` here: itself when explicit; for ``auto`` every entry of
        the chain that works here, the ones auto does not pick by default (auto_skips) included: a measured
        profile decides between them (runtime/planner/placement.py)."""
        if requested.strip().lower() != AUTO:
            return [requested]
        return [label for label in CHAINS[model]
                if not unavailable(parse_device(label), self.report)
                and not self._shape_problem(model, parse_device(label), static_available, static_requested)]

    def _auto(self, model: str, static_available: bool, static_requested: bool) -> Decision:
        skipped, unexpected = [], []
        for label in CHAINS[model]:
            choice = parse_device(label)
            absent = unavailable(choice, self.report)
            broken = ("listed but does not work" in absent) or (not absent and self._shape_problem(
                model, choice, static_available, static_requested))
            why = absent or broken or auto_skips(label, self.report)
            if not why:
                return Decision(model, AUTO, choice, self._static(model, choice, static_requested), tuple(skipped),
                                tuple(unexpected))
            skipped.append((label, why))
            unexpected += [label] if broken else []
        raise AssertionError("every auto chain ends with the always-available ONNX Runtime CPU")

    @staticmethod
    def _static(model: str, choice: DeviceChoice, static_requested: bool) -> bool:
        return model == "draft" and (static_requested or choice.fixed_shapes)

    @staticmethod
    def _shape_problem(model: str, choice: DeviceChoice, static_available: bool, static_requested: bool) -> str:
        needs_static = choice.fixed_shapes or (model == "draft" and static_requested)
        if not needs_static:
            return ""
        if model != "draft":
            return f"{choice.kind} needs fixed shapes and the target's graphs are dynamic (only the draft has a " \
                   f"static variant)"
        if not static_available:
            return "this export has no static-shape draft (export with --static-draft --max-context N)"
        return ""


@dataclass(frozen=True)
class Plan:
    """The decisions for both models of an export folder."""

    target: Decision
    draft: Decision
    kernels: str = "ort"  # the MatMulNBits kernel of ONNX Runtime CPU sessions (devices/kernel_choice.py)
    kernels_note: str = ""  # why auto did not take mirrorsd's kernels

    def decision(self, model: str) -> Decision:
        return self.target if model == "target" else self.draft

    def graph_role(self, role: str) -> str:
        """The manifest role that serves ``role``: the draft is served by draft_static when it must be static."""
        return names.DRAFT_STATIC if role == names.DRAFT and self.draft.static else role

    def warn(self) -> None:
        """A warning per surprising fallback; otherwise one INFO line saying where auto put the models."""
        _warn(self.target)
        _warn(self.draft)
        quiet = [d for d in (self.target, self.draft) if d.skipped and not d.fell_back]
        if quiet:
            log.info("auto placement: %s (`mirrorsd devices` says why)",
                     ", ".join(f"{d.model} on {d.choice.label}" for d in quiet))

    def lines(self, manifest) -> list[str]:
        """Where each graph of ``manifest`` would run, and why (for ``mirrorsd devices --model``)."""
        out = []
        for d in (self.target, self.draft):
            roles = [self.graph_role(r) for r in names.GRAPH_ROLES if manifest.graph(r).model == d.model]
            how = "fixed shapes, " if d.static else ""
            out.append(f"  {d.model} (asked: {d.requested}) -> {d.choice.label} "
                       f"[{how}{', '.join(manifest.graph(r).file for r in roles)}]")
            out += [f"      skipped {label}: {why}" for label, why in d.skipped]
            if d.requested == AUTO and not d.skipped:
                out.append("      first choice of the auto chain")
        out.append(f"  MatMulNBits on ONNX Runtime CPU: {self.kernels}'s kernels"
                   + (f" (mirrorsd's: {self.kernels_note})" if self.kernels_note else ""))
        return out


def _warn(decision: Decision) -> None:
    if decision.fell_back:
        warnings.warn(f"{decision.model}: auto placed it on {decision.choice.label}, although "
                      f"{', '.join(decision.unexpected)} is here ({decision.reason})", DeviceFallbackWarning,
                      stacklevel=4)


def plan_placement(manifest, request: DeviceRequest, policy: PlacementPolicy | None = None,
                   warn: bool = True) -> Plan:
    """Decide once where the target's and the draft's graphs of ``manifest`` run."""
    policy = policy or PlacementPolicy()
    if request.static_draft and names.DRAFT_STATIC not in manifest.graphs:
        raise DeviceError("--static-draft was asked for, and this export has no static-shape draft",
                          f"its graphs are {', '.join(sorted(manifest.graphs))}",
                          "re-export with mirrorsd-export --static-draft --max-context N")
    static_available = names.DRAFT_STATIC in manifest.graphs
    kernels, note = resolve_kernels(request.kernels)
    if warn and (slow := slow_weights_note(manifest, kernels)):
        warnings.warn(slow, SlowKernelWarning, stacklevel=3)
    plan = Plan(policy.decide("target", request.target),
                policy.decide("draft", request.draft, static_available, request.static_draft), kernels, note)
    if warn:
        plan.warn()
    return plan


def placement_candidates(manifest, request: DeviceRequest, policy: PlacementPolicy | None = None
                         ) -> list[tuple[str, str]]:
    """Every (target, draft) device pair ``request`` allows here (PlacementPolicy.candidates), the default first."""
    policy = policy or PlacementPolicy()
    static_available = names.DRAFT_STATIC in manifest.graphs
    default = plan_placement(manifest, request, policy, warn=False)
    first = (default.target.choice.label, default.draft.choice.label)
    pairs = [(t, d) for t in policy.candidates("target", request.target)
             for d in policy.candidates("draft", request.draft, static_available, request.static_draft)]
    return [first] + [pair for pair in pairs if pair != first]


@dataclass(frozen=True)
class Placement:
    model: str  # "target" or "draft"
    requested: str
    effective: str  # what runs the graph, read back from the backend
    backend: str
    fell_back: bool
    reason: str = ""
    static: bool = False  # the fixed-shape draft graph
    kernels: str = "ort"  # whose MatMulNBits kernel runs it (ONNX Runtime CPU only)
    device: str = ""  # the device string it was placed on ("cpu", "openvino:CPU", ...): what reopens it there
    shared_pool: bool = False  # an ONNX Runtime session on the process's shared thread pool
    spinning_pool: bool = False  # an ONNX Runtime CPU session whose workers spin (its own pool within a run, or shared)
    fused_attention: int = 0  # layers whose attention runs as mirrorsd's fused node (devices/kernels/attention_rewrite)
    kv_in_place: int = 0  # layers whose KV cache is written in place (devices/kernels/kv_in_place.py)

    def describe(self) -> str:
        shapes = " [static shapes]" if self.static else ""
        kernels = f" {KERNELS_MARK}" if self.kernels == "mirrorsd" else ""
        kernels += f" {FUSED_ATTENTION_MARK}" if self.fused_attention else ""
        kernels += f" {KV_IN_PLACE_MARK}" if self.kv_in_place else ""
        kernels += SHARED_POOL_MARK if self.shared_pool else ""
        kernels += SPINNING_POOL_MARK if self.spinning_pool else ""
        note = f" (fell back: {self.reason})" if self.fell_back else ""
        return f"{self.backend}:{self.effective}{shapes}{kernels}{note}"


def open_graph(path: Path, model: str, request: DeviceRequest, threads: int, decision: Decision | None = None,
               kv=None, kernels: str = "ort", logits: str = ""):
    """Open one graph for ``model`` as decided (or as the request says); returns (backend session, Placement).

    ``kv`` (the graph's KVSpec) names its past/present pairs, which a stateful OpenVINO session turns into state.
    ``kernels`` (Plan.kernels) is whose MatMulNBits kernel an ONNX Runtime CPU session runs. ``logits``: the graph's
    LM-head output, whose rows a prompt chunk may cut to its last (request.prompt_last_row_only); empty: none.

    After opening, what really runs the graph is compared with the choice: ONNX Runtime moves a graph to its CPU
    provider silently when the accelerator cannot take it. An explicit device then fails; ``auto`` records it.
    """
    if decision is None:
        asked = request.target if model == "target" else request.draft
        decision = PlacementPolicy().decide(model, asked)
        _warn(decision)
    choice = decision.choice
    tuning = request.target_openvino if model == "target" else request.draft_openvino
    tuning.check()
    if model == "target" and choice.backend == "openvino" and tuning.inexact():
        raise DeviceError("The OpenVINO settings asked for the target would make sd/mirror differ from ar",
                          tuning.inexact(), "use the default DeviceRequest.target_openvino")
    on_ort_cpu = choice.backend == "onnxruntime" and choice.device == "cpu"
    shared = bool(request.shared_pool) and on_ort_cpu
    spinning = spins(request, on_ort_cpu, shared)
    in_place, fused = requested_rewrites(request, model)
    settings = SessionSettings(choice.device, threads, "f32", fixed_shapes=decision.static and
                               choice.backend == "openvino", openvino=tuning, kv_pairs=kv_pairs(kv), kernels=kernels,
                               shared_pool=shared, spin_in_run=spinning and not shared,
                               fuse_attention=fused, kv_in_place=in_place,
                               logits_output=logits if request.prompt_last_row_only else "")
    session = BACKENDS[choice.backend](path, settings)
    fell_back, reason = decision.fell_back, decision.reason
    lost = _lost_device(choice, session.effective)
    if lost:
        if decision.requested != AUTO:
            raise DeviceError(f"Device '{decision.requested}' did not take '{path.name}'", lost,
                              "pick another device, or pass auto")
        fell_back, reason = True, "; ".join(r for r in (reason, lost) if r)
        warnings.warn(f"{model}: {lost}", DeviceFallbackWarning, stacklevel=2)
    return session, Placement(model, decision.requested, session.effective, choice.backend, fell_back, reason,
                              decision.static, getattr(session, "kernels", "ort"), choice.label, shared, spinning,
                              getattr(session, "fused_attention", 0), len(getattr(session, "kv_in_place", [])))


def requested_rewrites(request: DeviceRequest, model: str) -> tuple[bool, bool]:
    """(KV cache in place, fused attention): the load-time rewrites ``request`` asks for ``model``'s graphs where
    mirrorsd's kernels run them (devices/backends.py applies them where a graph's layers take them, the fused
    attention only where the cache is not in place)."""
    in_place = request.target_kv_in_place if model == "target" else request.draft_kv_in_place
    return in_place, model == "draft" and request.fused_draft_attention


def spins(request: DeviceRequest, on_ort_cpu: bool, shared: bool) -> bool:
    """Whether a session opened for ``request`` runs on spinning workers: the shared pool's, or a pool of its own that
    spins within a run."""
    return on_ort_cpu and (shared or bool(request.spin_in_run))


def kv_pairs(kv) -> tuple[tuple[str, str], ...]:
    """(past input, present output) names of every KV pair of a graph's KVSpec (none for ``None``)."""
    if kv is None:
        return ()
    return tuple((past % i, present % i) for i in kv.layer_indices()
                 for past, present in ((kv.past_key, kv.present_key), (kv.past_value, kv.present_value)))


def _lost_device(choice: DeviceChoice, effective: str) -> str:
    """Why the session does not run where it was placed ("" when it does)."""
    if choice.backend == "onnxruntime":
        wanted = OrtSession.PROVIDERS[choice.device]
        return "" if effective == wanted else f"ONNX Runtime ran it on {effective} instead of {wanted}"
    if choice.backend == "ort-openvino" and not effective.startswith(PLUGIN_EP):
        return f"ONNX Runtime ran it on {effective} instead of the OpenVINO plugin EP"
    if choice.kind not in effective.upper():
        return f"{choice.backend} compiled it for {effective} instead of {choice.device}"
    return ""
