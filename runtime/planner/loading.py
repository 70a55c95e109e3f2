"""The placement and thread split a pipeline opens with, chosen before any session opens.

    default     without ``DeviceRequest.plan_from_profile``: the auto chains' placement, the given threads or every
                core per session, the shared pool as asked (devices/thread_pool.resolve)
    planned     with it: the chain's pick and its split are what the choice starts from ("here"); the cached
                profiles of every placement the request allows (placement_profiles) and placement.py /
                threads.py choose; the sessions then open once, with the choice
    confirmed   when where the chain's pick would run cannot be told without opening it (a device other than
                ONNX Runtime's CPU reports what really runs the graph only once open, and the profile cache keys
                on that), the chain's pick opens first and the choice is made then; a different choice reopens

``here`` is a placement as the choice sees it: its (target, draft) device strings, its thread split, and its cached
profile, found by the exact placement the profile cache keys on (profile.cache_path).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mirrorsd.runtime.planner import profile as profiles
from mirrorsd.runtime.planner import threads as auto_threads
from mirrorsd.runtime.planner.placement import PlacementChoice, choose_placement
from mirrorsd.runtime.planner.threads import SplitRule, ThreadChoice

CPU_PROVIDER = "CPUExecutionProvider"
_CURRENT_POOL = object()  # planned_request's default: the process's shared pool as it is now


@dataclass(frozen=True)
class Here:
    """A placement the choice starts from: (target, draft) device strings, (target threads, draft threads, shared
    pool), and its cached profile (None: none yet)."""

    pair: tuple[str, str]
    key: tuple[int, int, bool]
    profile: object = None


@dataclass(frozen=True)
class LoadChoice:
    request: object  # the DeviceRequest to open
    threads: tuple[int, int]
    thread_choice: ThreadChoice
    placement_choice: PlacementChoice | None
    plan: object = None  # the placement plan of ``request`` when made already (devices.placement.Plan)
    confirm: bool = False  # choose once open (the chain's pick could not be told before; see the module docstring)


def device_request(devices):
    """``devices`` as a DeviceRequest: None (auto placement), a DeviceRequest, or one device string for both models
    (as the CLI's --device flags take it)."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.errors import DeviceError

    if isinstance(devices, str):
        devices = DeviceRequest(target=devices, draft=devices)
    devices = devices or DeviceRequest()
    if not isinstance(devices, DeviceRequest):
        raise DeviceError(f"devices must be a DeviceRequest or a device string, not {type(devices).__name__}",
                          "it says where each model runs", "pass DeviceRequest(target=..., draft=...), 'cpu', "
                                                           "or None (auto placement)")
    if devices.spin_in_run is None:  # a load planned from the profiles runs on the pools `mirrorsd devices` measured
        devices = replace(devices, spin_in_run=devices.plan_from_profile)
    return devices


def cached_profile(folder: Path, placement: dict[str, str]):
    """The cached profile of export ``folder`` on ``placement`` (graph role -> Placement.describe()), or None (none
    yet, or unusable: measured again)."""
    from mirrorsd.runtime.planner.profiling import cached

    return cached(profiles.cache_path(folder, placement))


def placement_profiles(folder: Path, manifest, devices, here: Here) -> dict:
    """(target, draft) device pair -> its cached profile or None, for every pair ``devices`` allows here (``here``'s
    own pair with its exact profile); nothing is measured."""
    from mirrorsd.devices.placement import placement_candidates

    cached = profiles.cached_by_devices(folder)
    found = {pair: cached.get(pair) for pair in placement_candidates(manifest, devices)}
    found[here.pair] = here.profile  # by its exact placement (older profiles lack "devices")
    return found


def planned_request(folder: Path, manifest, devices, here: Here, found: dict | None = None,
                    pool_size=_CURRENT_POOL):
    """(the DeviceRequest to open instead of ``here``, or None to keep it; the PlacementChoice): the placement and
    thread split the cached profiles (``found``: placement_profiles) predict fastest (placement.py), among the
    devices ``devices`` allows; nothing is measured. ``pool_size``: the process's shared pool (default: as now)."""
    from mirrorsd.devices import thread_pool

    found = placement_profiles(folder, manifest, devices, here) if found is None else found
    given = bool(devices.target_threads or devices.draft_threads)
    pool_size = thread_pool.shared_size() if pool_size is _CURRENT_POOL else pool_size
    rule = SplitRule(here.key[:2] if given else None, devices.shared_pool, pool_size)
    choice = choose_placement(found, here.pair, here.key, rule)
    if choice.devices == here.pair and choice.threads.key == here.key:
        return None, choice
    target_threads, draft_threads = choice.threads.threads
    return replace(devices, target=choice.devices[0], draft=choice.devices[1], target_threads=target_threads,
                   draft_threads=draft_threads, shared_pool=choice.threads.shared_pool), choice


def before_opening(folder: Path, manifest, devices) -> LoadChoice:
    """What to open (see the module docstring); raises DeviceError where opening ``devices`` would."""
    from mirrorsd.devices import thread_pool
    from mirrorsd.devices.backends import default_threads
    from mirrorsd.devices.placement import plan_placement

    threads = (devices.target_threads or default_threads(), devices.draft_threads or default_threads())
    plan = plan_placement(manifest, devices)  # decided once for both models; warns when auto fell back
    pool = thread_pool.resolve(devices.shared_pool, threads, thread_pool.shared_size())
    shared = pool and any(_on_ort_cpu(plan.decision(model)) for model in ("target", "draft"))
    if devices.target_threads or devices.draft_threads:
        chosen = auto_threads.given(threads, shared)
    else:
        chosen = auto_threads.default(threads, "threads not planned (DeviceRequest.plan_from_profile off)", shared)
    opened = LoadChoice(devices, threads, chosen, None, plan)
    if not devices.plan_from_profile:
        return opened
    placement = predicted_placement(folder, manifest, plan, shared, bool(devices.spin_in_run), devices)
    first_pool = thread_pool.shared_size() or (threads[0] if shared else None)  # what opening the pick would make
    if placement is None or (shared and threads[0] != threads[1] and thread_pool.shared_size() is None):
        return replace(opened, confirm=True)  # (unequal threads on a new pool: opening says what is wrong)
    here = Here((plan.target.choice.label, plan.draft.choice.label), (*threads, shared),
                cached_profile(folder, placement))
    request, choice = planned_request(folder, manifest, devices, here, pool_size=first_pool)
    if request is None:
        return LoadChoice(devices, threads, choice.threads, choice, plan)
    return LoadChoice(request, choice.threads.threads, choice.threads, choice)


def predicted_placement(folder: Path, manifest, plan, shared: bool, spin_in_run: bool = False, devices=None
                        ) -> dict[str, str] | None:
    """Graph role -> Placement.describe() that opening ``plan`` would report, or None when a graph goes to a device
    other than ONNX Runtime's CPU (what runs it there is read back from the open session) or a graph file cannot
    be read (opening it says what is wrong, as it would without a plan). ``devices`` (the DeviceRequest; default:
    DeviceRequest()) says which load-time rewrites opening asks for where mirrorsd's kernels run a graph."""
    from mirrorsd.devices.kernels.rewrite import imports_ort_domain
    from mirrorsd.devices.placement import DeviceRequest, Placement, requested_rewrites
    from mirrorsd.errors import MirrorSDError
    from mirrorsd.manifest import check_inside
    from mirrorsd.runtime.open_graphs import graphs_to_open, request_for

    graphs = graphs_to_open(manifest, plan)
    devices = request_for(devices or DeviceRequest(), graphs)
    found = {}
    for role, spec, model, _ in graphs:
        decision = plan.decision(model)
        if not _on_ort_cpu(decision):
            return None
        kernels = "ort"  # mirrorsd's kernels run a graph only when it holds MatMulNBits (devices/backends.py)
        if plan.kernels == "mirrorsd":
            try:
                path = check_inside(folder, spec.file, f"graph '{spec.role}'")
                kernels = "mirrorsd" if imports_ort_domain(path) else "ort"
            except (MirrorSDError, OSError):
                return None
        in_place = fused = 0
        if kernels == "mirrorsd":  # the rewrites opening applies, predicted: a cache in place needs a graph with one
            wants_in_place, wants_fused = requested_rewrites(devices, model)
            in_place = int(wants_in_place and bool(spec.kv))
            fused = int(wants_fused and not in_place)
        found[role] = Placement(spec.model, decision.requested, CPU_PROVIDER, "onnxruntime", decision.fell_back,
                                decision.reason, decision.static, kernels, decision.choice.label, shared,
                                spin_in_run or shared, fused, in_place).describe()
    return found


def _on_ort_cpu(decision) -> bool:
    return decision.choice.backend == "onnxruntime" and decision.choice.device == "cpu"
