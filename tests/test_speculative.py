"""sd and mirror emit exactly the ar token ids, for drafts that always agree, never agree, and in between,
over a grid of (gamma, exit layer, branch budget) settings; statistics invariants hold in every run."""
from __future__ import annotations

import threading

import pytest

from mirrorsd.errors import DraftWorkerError
from mirrorsd.runtime import GenerationConfig

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62], [5], [1, 300, 2],
           list(range(20, 60))]
NEW = 40


def check_invariants(stats, mode):
    assert stats.accepted <= stats.drafted
    assert stats.reused + stats.fallbacks == stats.windows <= stats.steps
    assert 0.0 <= stats.acceptance_rate <= 1.0 and 0.0 <= stats.overlap_ratio <= 1.0 + 1e-9
    assert stats.mean_accepted_tokens >= 1.0
    # every committed token comes from a step (+1 for the prefill's token), unless EOS/max cut a step short
    assert stats.new_tokens <= stats.steps + stats.accepted + 1
    if mode == "ar":
        assert stats.drafted == 0 and stats.mean_accepted_tokens == 1.0 and stats.windows == 0
    if mode == "sd":
        assert stats.reused == 0 and stats.fallbacks == stats.windows
        assert stats.draft_forwards == stats.drafted  # one forward per drafted token
    if mode != "mirror":
        assert stats.branches_rolled_out == 0


@pytest.fixture(scope="module")
def drafts(exported, tiny_model):
    """Export folders keyed by draft kind: identical to the target, random weights, truncated target."""
    return {
        "identical": exported("llama", draft_layers=4),
        "random": exported("llama", draft=tiny_model("llama", layers=2, seed=7)),
        "truncated": exported("llama", draft_layers=2),
    }


@pytest.mark.parametrize("kind", ["identical", "random", "truncated"])
@pytest.mark.parametrize("gamma,branches,budget", [(1, 1, "time"), (3, 4, "cap"), (5, 2, "time"), (4, 6, "cap")])
def test_speculative_modes_equal_ar(kind, gamma, branches, budget, drafts, pipelines):
    pipe = pipelines(drafts[kind])
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        check_invariants(ar.stats, "ar")
        for mode in ("sd", "mirror"):
            config = GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=gamma, branches=branches,
                                      branch_budget=budget)
            out = pipe.generate(prompt, config)
            assert out.tokens == ar.tokens, (mode, kind, gamma, prompt)
            check_invariants(out.stats, mode)
            if kind == "identical":
                assert out.stats.acceptance_rate == 1.0  # a draft equal to the target is always accepted
            if kind == "identical" and mode == "mirror" and budget == "cap" and out.stats.windows > 2:
                assert out.stats.reuse_rate > 0.5  # the bonus branch is the best-ranked one and gets rolled out


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_mirror_equal_ar_at_every_exit_layer(exit_layer, exported, pipelines):
    pipe = pipelines(exported("qwen2", exit_layer=exit_layer, draft_layers=3))
    for prompt in PROMPTS[:3]:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        out = pipe.generate(prompt, GenerationConfig(mode="mirror", max_new_tokens=NEW, branch_budget="cap"))
        assert out.tokens == ar
        check_invariants(out.stats, "mirror")


def test_random_draft_is_rarely_accepted(drafts, pipelines):
    pipe = pipelines(drafts["random"])
    stats = pipe.generate(PROMPTS[1], GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4)).stats
    assert stats.acceptance_rate < 0.3


def test_text_prompt_and_streaming_pieces_match_text(drafts, pipelines):
    pipe = pipelines(drafts["truncated"])
    pieces = []
    out = pipe.generate("Hello there", GenerationConfig(mode="mirror", max_new_tokens=24), on_text=pieces.append)
    assert "".join(pieces) == out.text


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_a_new_prompt_keeps_the_draft_slots_it_shares_with_the_last_text(mode, drafts, pipelines, monkeypatch):
    """A prompt that begins like the last generation's text (a system prompt, an earlier turn) has the draft read
    only the rest: the shared slots are kept, and the windows are the ones a fresh prefill gives (a slot's KV depends
    only on the tokens up to it), so the tokens equal ar's and sd drafts the same as from an empty cache."""
    pipe = pipelines(drafts["truncated"])
    shared = list(range(20, 50))
    fed = []  # tokens per draft forward
    forward = pipe.draft.forward

    def counting(cache, ids, mask, positions, *rest):  # rest: logits_from
        fed.append(ids.shape[1])
        return forward(cache, ids, mask, positions, *rest)

    monkeypatch.setattr(pipe.draft, "forward", counting)
    config = GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=3)
    pipe.generate(shared + [7, 8, 9], config)
    fed.clear()
    kept = pipe.generate(shared + [300, 2, 5], config)
    kept_first = fed[0]
    pipe.draft.reset()  # the same prompt from an empty draft cache
    fed.clear()
    fresh = pipe.generate(shared + [300, 2, 5], config)
    assert kept_first == fed[0] - len(shared)  # the first draft forward read the prompt's unshared tokens only
    ar = pipe.generate(shared + [300, 2, 5], GenerationConfig(mode="ar", max_new_tokens=NEW))
    assert kept.tokens == fresh.tokens == ar.tokens
    if mode == "sd":
        assert (kept.stats.drafted, kept.stats.accepted) == (fresh.stats.drafted, fresh.stats.accepted)


class FailingBackend:
    """Wraps the real draft backend and raises after ``ok_calls`` calls (a fault, not a mock of the draft)."""

    def __init__(self, real, ok_calls: int, error=RuntimeError("injected draft failure")) -> None:
        self.real, self.ok_calls, self.error, self.calls = real, ok_calls, error, 0
        self.effective = real.effective

    def run(self, feeds):
        self.calls += 1
        if self.calls > self.ok_calls:
            raise self.error
        return self.real.run(feeds)

    def input_names(self):
        return self.real.input_names()


def draft_threads():
    return [t for t in threading.enumerate() if t.name == "mirrorsd-draft" and t.is_alive()]


@pytest.mark.parametrize("ok_calls", [0, 5])
def test_draft_thread_failure_reaches_caller_and_leaves_no_thread(ok_calls, exported):
    from mirrorsd.runtime import Pipeline

    pipe = Pipeline.load(exported("llama", draft_layers=2))
    session = pipe.sessions["draft"]
    session.backend = FailingBackend(session.backend, ok_calls)
    with pytest.raises(DraftWorkerError, match="injected draft failure"):
        pipe.generate(PROMPTS[1], GenerationConfig(mode="mirror", max_new_tokens=NEW))
    pipe.close()
    assert not draft_threads()


def test_draft_failure_can_fall_back_to_target_only(exported):
    from mirrorsd.runtime import Pipeline

    with Pipeline.load(exported("llama", draft_layers=2)) as pipe:
        ar = pipe.generate(PROMPTS[1], GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        session = pipe.sessions["draft"]
        session.backend = FailingBackend(session.backend, 7)
        out = pipe.generate(PROMPTS[1], GenerationConfig(mode="mirror", max_new_tokens=NEW,
                                                         on_draft_failure="fallback"))
        assert out.tokens == ar and out.stats.draft_failures == 1
    assert not draft_threads()


def test_finish_reason_says_why_each_mode_stopped(drafts, capsys):
    """eos: the budget is not used up and the last token is an EOS id; length: max_new_tokens tokens; context: the
    prompt and the output fill the exported context. The same in every mode, in the result, its stats and --json."""
    import dataclasses
    import json

    from mirrorsd.apps.cli import main
    from mirrorsd.runtime import Pipeline

    with Pipeline.load(drafts["truncated"]) as pipe:
        free = pipe.generate(PROMPTS[1], GenerationConfig(mode="ar", max_new_tokens=24)).tokens
        stop = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i])  # first seen after 5 tokens
        long_prompt = [(7 * i) % 300 + 3 for i in range(pipe.context_limit - 6)]
        for mode in ("ar", "sd", "mirror"):
            out = pipe.generate(PROMPTS[1], GenerationConfig(mode=mode, max_new_tokens=9, gamma=3))
            assert (out.finish_reason, out.stats.finish_reason, len(out.tokens)) == ("length", "length", 9)
            out = pipe.generate(long_prompt, GenerationConfig(mode=mode, max_new_tokens=40, gamma=3))
            assert out.finish_reason == "context" and len(long_prompt) + len(out.tokens) == pipe.context_limit
        tokenizer = dataclasses.replace(pipe.manifest.tokenizer, eos_token_ids=(stop,))
        pipe.manifest = dataclasses.replace(pipe.manifest, tokenizer=tokenizer)  # this pipeline's EOS: `stop`
        for mode in ("ar", "sd", "mirror"):
            out = pipe.generate(PROMPTS[1], GenerationConfig(mode=mode, max_new_tokens=24, gamma=3))
            assert out.finish_reason == "eos" and out.tokens == free[:free.index(stop) + 1], mode
    assert main(["generate", "--model", str(drafts["truncated"]), "--prompt", "Hi", "--max-new-tokens", "3",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["finish_reason"] == printed["stats"]["finish_reason"] in ("eos", "length")
    assert (printed["finish_reason"] == "length") == (len(printed["tokens"]) == 3)
