"""Runtime reliability: bad generation requests, and a draft that fails, hangs or talks nonsense.

Bad requests get a GenerationInputError / DeviceError with what/why/fix. Faults are injected by wrapping the real
draft backend (the graph still runs; only the fault is fake). Whatever the draft does, a generation either fails
with DraftWorkerError or, with on_draft_failure="fallback", finishes with exactly the ar tokens; no
``mirrorsd-draft`` thread outlives a generation, and two threads sharing a pipeline never mix their state.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.errors import DeviceError, DraftWorkerError, GenerationInputError, MirrorSDError
from mirrorsd.runtime import GenerationConfig, Pipeline

PROMPT = [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62]
NEW = 40


def draft_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mirrorsd-draft" and t.is_alive()]


def wait_no_draft_threads(seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while draft_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not draft_threads()


@pytest.fixture(scope="module")
def folder(exported):
    return exported("llama", draft_layers=2)


@pytest.fixture(scope="module")
def shared(folder):
    """One pipeline for the tests that do not touch its backends."""
    with Pipeline.load(folder) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def ar_tokens(shared):
    return shared.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens


@pytest.fixture()
def pipe(folder):
    """A pipeline of the test's own, whose draft backend the test may wrap; closed and checked afterwards."""
    pipe = Pipeline.load(folder)
    yield pipe
    pipe.close()
    wait_no_draft_threads()


def assert_clear(exc: MirrorSDError, *phrases: str) -> None:
    assert exc.what and exc.why and exc.fix, str(exc)
    for phrase in phrases:
        assert phrase in str(exc), str(exc)


# ---- bad requests ------------------------------------------------------------------------------------------------
def test_prompt_longer_than_the_context(shared):
    limit = shared.context_limit
    with pytest.raises(GenerationInputError) as info:
        shared.generate([5] * limit, GenerationConfig(mode="ar"))
    assert_clear(info.value, f"{limit} tokens", "shorten")
    out = shared.generate([5] * (limit - 1), GenerationConfig(mode="mirror", max_new_tokens=NEW))
    assert len(out.tokens) == 1  # the one token that fits, then a clean stop at the context limit


def test_max_new_tokens_beyond_the_context_stops_at_the_context(shared):
    """A huge budget must not size the KV cache by the budget (that would be terabytes), only by the context."""
    prompt = [5] * (shared.context_limit - 30)
    for mode in ("ar", "sd", "mirror"):
        out = shared.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=10**12))
        assert len(prompt) + len(out.tokens) <= shared.context_limit


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(max_new_tokens=-5), dict(max_new_tokens=2.5), dict(gamma=0), dict(branches=-1),
    dict(mode="fast"), dict(mode="AR"), dict(branch_budget="forever"), dict(on_draft_failure="ignore"),
    dict(draft_timeout_s=0), dict(draft_timeout_s=-1.0), dict(draft_timeout_s=float("nan")),
    dict(do_sample=True, temperature=-0.5), dict(do_sample=True, temperature=float("nan")),
    dict(do_sample=True, top_p=0.0), dict(do_sample=True, top_p=1.01), dict(do_sample=True, top_p=-1.0),
    dict(do_sample=True, top_k=-1), dict(repetition_penalty=0.0), dict(seed=-1), dict(verify="lenient"),
    dict(temperature="hot"), dict(top_k=1.5), dict(top_k="x"), dict(seed="x"), dict(max_new_tokens=True),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_bad_generation_config(shared, bad):
    with pytest.raises(GenerationInputError) as info:
        shared.generate(PROMPT, GenerationConfig(**bad))
    assert_clear(info.value)
    assert not draft_threads()


@pytest.mark.parametrize("prompt", [[], [-1, 5], [384], [1.5, 2], ["a"], [[1, 2]], [None]],
                         ids=["empty", "negative", "past-vocab", "float", "str", "nested", "none"])
def test_bad_prompt_ids(shared, prompt):
    with pytest.raises(GenerationInputError) as info:
        shared.generate(prompt, GenerationConfig(mode="ar"))
    assert_clear(info.value)


@pytest.mark.parametrize("request_", [DeviceRequest(target="tpu"), DeviceRequest(draft="gpu:0"),
                                      DeviceRequest(target="cuda"), DeviceRequest(draft="openvino:NPU")],
                         ids=["tpu", "gpu:0", "cuda", "npu"])
def test_device_that_does_not_exist(folder, request_):
    from mirrorsd.devices.placement import PlacementPolicy, available_devices

    if request_.target == "cuda" and "cuda" in available_devices(PlacementPolicy().report):
        pytest.skip("this machine has CUDA")
    if request_.draft == "openvino:NPU" and "openvino:NPU" in available_devices(PlacementPolicy().report):
        pytest.skip("this machine has an NPU")
    with pytest.raises(DeviceError) as info:
        Pipeline.load(folder, request_)
    assert_clear(info.value, "this machine has: cpu")


# ---- draft faults --------------------------------------------------------------------------------------------
class Faulty:
    """Wraps the real draft backend; ``fault(call, outputs)`` may raise, block or rewrite the outputs.

    Also records how many calls overlapped: the draft model belongs to one thread at a time.
    """

    def __init__(self, real, fault) -> None:
        self.real, self.fault = real, fault
        self.effective = real.effective
        self.calls = self.active = self.max_active = 0
        self._lock = threading.Lock()

    def run(self, feeds):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            call = self.calls
        try:
            return self.fault(call, feeds, self.real)
        finally:
            with self._lock:
                self.active -= 1

    def input_names(self):
        return self.real.input_names()


def inject(pipe: Pipeline, fault) -> Faulty:
    session = pipe.sessions["draft"]
    session.backend = Faulty(session.backend, fault)
    return session.backend


def raise_after(n: int):
    def fault(call, feeds, real):
        if call > n:
            raise RuntimeError(f"injected draft failure at call {call}")
        return real.run(feeds)
    return fault


@pytest.mark.parametrize("mode", ["sd", "mirror"])
@pytest.mark.parametrize("ok_calls", [0, 1, 2, 3, 8, 21])  # 0: the prefill itself fails (mirror)
def test_draft_raising_at_any_call(pipe, ar_tokens, mode, ok_calls):
    faulty = inject(pipe, raise_after(ok_calls))
    with pytest.raises(DraftWorkerError, match="injected draft failure") as info:
        pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, branch_budget="cap"))
    assert_clear(info.value)
    wait_no_draft_threads()
    faulty.calls = 0  # the same fault again, this time survived
    out = pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, on_draft_failure="fallback"))
    assert out.tokens == ar_tokens and out.stats.draft_failures == 1
    assert faulty.max_active == 1


def test_streaming_draft_failure_is_a_draft_error():
    """sd with a streaming draft (an export from mirrorsd-train-draft) reports draft faults the same way."""
    from mirrorsd.runtime.proposers import SerialDraft

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("injected streaming draft failure")

    with pytest.raises(DraftWorkerError, match="injected streaming draft failure"):
        SerialDraft(Broken(), lookahead=True).propose([1, 2, 3], 4)


def hang_on(n: int, release: threading.Event, seconds: float = 30.0):
    def fault(call, feeds, real):
        if call == n:
            release.wait(seconds)
        return real.run(feeds)
    return fault


@pytest.mark.parametrize("hang_call", [1, 6])  # in the prefill, and in a branch rollout
def test_hung_draft_fails_cleanly(pipe, hang_call):
    release = threading.Event()
    inject(pipe, hang_on(hang_call, release))
    started = time.monotonic()
    with pytest.raises(DraftWorkerError) as info:
        pipe.generate(PROMPT, GenerationConfig(mode="mirror", max_new_tokens=NEW, draft_timeout_s=0.5))
    assert time.monotonic() - started < 10
    assert_clear(info.value)
    release.set()  # the hung call returns; its worker finds its stop message and exits
    wait_no_draft_threads()


@pytest.mark.parametrize("hang_call", [1, 6])
def test_hung_draft_falls_back_exactly(pipe, ar_tokens, hang_call):
    release = threading.Event()
    faulty = inject(pipe, hang_on(hang_call, release))
    config = GenerationConfig(mode="mirror", max_new_tokens=NEW, draft_timeout_s=1.0, on_draft_failure="fallback")
    out = pipe.generate(PROMPT, config)
    assert out.tokens == ar_tokens and out.stats.draft_failures == 1
    # The worker is still stuck in its draft call. The next generation must not share the draft model with it:
    # it waits for the stuck call (released shortly) and then runs on its own.
    threading.Timer(0.2, release.set).start()
    again = pipe.generate(PROMPT, config)
    assert again.tokens == ar_tokens and again.stats.draft_failures == 0
    assert faulty.max_active == 1
    wait_no_draft_threads()


def test_draft_stuck_for_good_is_reported_by_the_next_generation(pipe, ar_tokens):
    release = threading.Event()
    faulty = inject(pipe, hang_on(2, release))
    config = GenerationConfig(mode="mirror", max_new_tokens=NEW, draft_timeout_s=0.3, on_draft_failure="fallback")
    assert pipe.generate(PROMPT, config).tokens == ar_tokens
    with pytest.raises(DraftWorkerError, match="still"):
        pipe.generate(PROMPT, config)  # refuses to start a second worker beside the stuck one
    assert faulty.max_active == 1
    release.set()
    wait_no_draft_threads()
    assert pipe.generate(PROMPT, config).tokens == ar_tokens  # and recovers once the draft answers again


def rewrite_logits(change):
    def fault(call, feeds, real):
        out = real.run(feeds)
        out["logits"] = change(out["logits"])
        return out
    return fault


MALFORMED = {
    "nan": lambda x: np.full_like(x, np.nan),
    "inf": lambda x: np.where(np.arange(x.shape[-1]) % 2 == 0, np.inf, -np.inf).astype(x.dtype) + 0 * x,
    "half-nan": lambda x: np.where(np.arange(x.shape[-1]) < x.shape[-1] // 2, np.nan, x).astype(x.dtype),
    "constant": lambda x: np.zeros_like(x),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the draft's top-k
@pytest.mark.parametrize("mode", ["sd", "mirror"])
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_nonsense_logits_only_make_bad_proposals(pipe, ar_tokens, mode, kind):
    inject(pipe, rewrite_logits(MALFORMED[kind]))
    out = pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, branch_budget="cap"))
    assert out.tokens == ar_tokens
    assert out.stats.accepted <= out.stats.drafted


WRONG_SHAPES = {
    "wide-vocab": lambda x: np.concatenate([x, np.full(x.shape[:-1] + (5,), 1e9, x.dtype)], axis=-1),
    "narrow-vocab": lambda x: x[..., :-7],
    "extra-row": lambda x: np.concatenate([x, x[:, -1:]], axis=1),
    "no-batch": lambda x: x[0],
    "empty": lambda x: x[:, :0],
}


@pytest.mark.parametrize("mode", ["sd", "mirror"])
@pytest.mark.parametrize("kind", sorted(WRONG_SHAPES))
def test_wrongly_shaped_logits_are_a_draft_error(pipe, ar_tokens, mode, kind):
    """Logits that do not fit the inputs (or name tokens the vocabulary lacks) must not reach the target."""
    inject(pipe, rewrite_logits(WRONG_SHAPES[kind]))
    with pytest.raises(DraftWorkerError) as info:
        pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW))
    assert_clear(info.value)
    out = pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, on_draft_failure="fallback"))
    assert out.tokens == ar_tokens and out.stats.draft_failures == 1


# ---- threads ---------------------------------------------------------------------------------------------------
def test_worker_lives_only_during_a_generation(pipe):
    seen = []
    out = pipe.generate(PROMPT, GenerationConfig(mode="mirror", max_new_tokens=NEW),
                        on_text=lambda piece: seen.append(len(draft_threads())))
    assert out.tokens and max(seen) == 1  # one worker while generating
    assert not draft_threads()  # none once generate returned
    for mode in ("mirror", "sd", "mirror"):
        pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=8, gamma=3))
        assert not draft_threads()


def test_generation_raising_in_the_callback_leaves_no_worker(pipe):
    def explode(piece):
        raise KeyError("consumer failed")

    with pytest.raises(KeyError):
        pipe.generate(PROMPT, GenerationConfig(mode="mirror", max_new_tokens=NEW), on_text=explode)
    assert not draft_threads()


def test_two_threads_serialize_on_one_pipeline(pipe):
    jobs = {"a": ([1, 17, 42, 99, 7], "mirror"), "b": ([1, 300, 2, 9, 9, 9], "mirror"), "c": (PROMPT, "sd"),
            "d": ([5, 6], "ar")}
    expected = {k: pipe.generate(p, GenerationConfig(mode=m, max_new_tokens=NEW)).tokens for k, (p, m) in jobs.items()}
    events: list[tuple[str, str]] = []  # (what, calling thread): generation start / target call / generation end
    target, inner = pipe.sessions["prefix"].backend, pipe._generate
    real_run = target.run

    def recording_run(feeds):
        events.append(("call", threading.current_thread().name))
        return real_run(feeds)

    def recording_generate(*args, **kwargs):  # runs under the pipeline's lock
        events.append(("start", threading.current_thread().name))
        try:
            return inner(*args, **kwargs)
        finally:
            events.append(("end", threading.current_thread().name))

    target.run, pipe._generate = recording_run, recording_generate
    results, errors = {}, []

    def work(key):
        try:
            for _ in range(2):
                prompt, mode = jobs[key]
                results.setdefault(key, []).append(
                    pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW)).tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,), name=f"caller-{k}") for k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert results == {k: [expected[k]] * 2 for k in jobs}
    owner = None  # generations never interleave: every target call falls inside its own caller's generation
    for what, name in events:
        if what == "start":
            assert owner is None
            owner = name
        elif what == "call":
            assert owner == name
        else:
            assert owner == name
            owner = None
    assert [w for w, _ in events].count("start") == 2 * len(jobs)
