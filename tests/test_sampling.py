"""Sampling at T > 0: the pure rules (scenario tables, Monte Carlo), transformers' processors, seeded determinism,
and end-to-end distribution tests of sd and mirror (both rules) against the target's own distribution.

Distribution test (``gof_pvalue``): a Pearson chi-square goodness-of-fit test of the first three generated tokens,
as one joint category, against their exact target-only distribution. The reference is enumerated from target-only
logits with transformers' own logits processors (so it also checks our processors and their order); categories
with an expected count below 5 are pooled into one; an outcome the target cannot produce fails outright. Each
configuration is rejected at p < ALPHA = 0.001. With gamma 2 and 4 new tokens the three tokens span the first
verification and, after an early rejection, a second one whose window mirror usually adopts from a branch.
Power: the same test with the same N must reject two deliberately wrong rules plugged into the runtime (accept every
draft token; on rejection resample from p without the rejected token instead of the residual). Measured with
RUNS = 800: the five correct configurations p = 0.35 .. 0.92; the wrong rules p = 0 (an impossible outcome) and
p = 2e-23 (and already 9e-9 with 500 runs).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime import sampling
from mirrorsd.runtime.sampling import SamplingParams, process_logits, softmax, uniforms
from mirrorsd.runtime.verify import (Verdict, inverse_cdf, residual_distribution, verify_exact_sampled,
                                     verify_residual)

ALPHA = 0.001  # significance level of every distribution test
RUNS = 800  # generations per configuration: the wrong rules below already fall under 1e-6 with 500
PROMPT = [1, 17, 42, 99, 7]
# Flattened so several tokens per position carry mass (the fixture models are peaked), with every processor on.
DIST = dict(do_sample=True, temperature=1.5, top_k=5, top_p=0.95, repetition_penalty=1.3)


def onehot(vocab, *pairs):
    row = np.zeros(vocab)
    for token, mass in pairs:
        row[token] = mass
    return row


# ---- pure rules: scenario tables ---------------------------------------------------------------------------
V = 6
EXACT_SCENARIOS = [  # window, target rows (as (token, mass) pairs), uniforms, accepted, correction
    ([1, 2], [[(1, 1.0)], [(2, 1.0)], [(4, 1.0)]], [0.5, 0.5, 0.5], 2, 4),  # all match: bonus drawn at row g
    ([1, 2], [[(3, 1.0)], [(2, 1.0)], [(4, 1.0)]], [0.5, 0.5, 0.5], 0, 3),  # first mismatch: the target's draw
    ([1, 2], [[(1, 0.5), (3, 0.5)], [(2, 1.0)], [(4, 1.0)]], [0.49, 0.5, 0.5], 2, 4),  # u picks token 1
    ([1, 2], [[(1, 0.5), (3, 0.5)], [(2, 1.0)], [(4, 1.0)]], [0.51, 0.5, 0.5], 0, 3),  # u picks token 3
    ([], [[(5, 1.0)]], [0.9], 0, 5),  # no window: an ar draw
]


@pytest.mark.parametrize("window,rows,u,accepted,correction", EXACT_SCENARIOS)
def test_exact_rule_scenarios(window, rows, u, accepted, correction):
    probs = np.stack([onehot(V, *r) for r in rows])
    verdict = verify_exact_sampled(np.array(window, np.int64), probs, np.array(u))
    assert verdict == Verdict(accepted, correction, len(window))


RESIDUAL_SCENARIOS = [  # window, q rows, p rows, accept uniforms, sample uniforms, accepted, correction
    # p(x) >= q(x): always accepted; the bonus is drawn from p at row g
    ([1], [[(1, 1.0)]], [[(1, 1.0)], [(3, 1.0)]], [0.99], [0.5, 0.5], 1, 3),
    # p(1)/q(1) = 0.5: accepted when u < 0.5 ...
    ([1], [[(1, 1.0)]], [[(1, 0.5), (2, 0.5)], [(3, 1.0)]], [0.49], [0.5, 0.5], 1, 3),
    # ... rejected otherwise; the residual max(0, p - q) is all on token 2
    ([1], [[(1, 1.0)]], [[(1, 0.5), (2, 0.5)], [(3, 1.0)]], [0.51], [0.0, 0.5], 0, 2),
    # a token the target cannot produce (p = 0) is always rejected
    ([4, 1], [[(4, 0.2), (1, 0.8)], [(1, 1.0)]], [[(1, 1.0)], [(1, 1.0)], [(0, 1.0)]], [0.0, 0.0], [0.3, 0.3, 0.3],
     0, 1),
    # second position rejected: the residual there, not p
    ([1, 2], [[(1, 1.0)], [(2, 0.6), (3, 0.4)]], [[(1, 1.0)], [(2, 0.3), (3, 0.4), (5, 0.3)], [(0, 1.0)]],
     [0.9, 0.8], [0.0, 0.0, 0.0], 1, 5),
]


@pytest.mark.parametrize("window,q,p,ua,us,accepted,correction", RESIDUAL_SCENARIOS)
def test_residual_rule_scenarios(window, q, p, ua, us, accepted, correction):
    verdict = verify_residual(np.array(window, np.int64), np.stack([onehot(V, *r) for r in q]),
                              np.stack([onehot(V, *r) for r in p]), np.array(ua), np.array(us))
    assert verdict == Verdict(accepted, correction, len(window))


def test_inverse_cdf_never_returns_a_zero_probability_token():
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    picks = [inverse_cdf(probs, u) for u in np.linspace(0, 1, 101)[:-1]]
    assert set(picks) == {1, 3} and picks.count(1) == 25
    assert inverse_cdf(probs, 0.9999999999) == 3
    np.testing.assert_allclose(residual_distribution(np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.6, 0.2]), 1),
                               [1.0, 0.0, 0.0])
    # p == q: a rejection had probability 0; the fallback is p without the rejected token, never that token
    np.testing.assert_allclose(residual_distribution(np.array([0.5, 0.5]), np.array([0.5, 0.5]), 0), [0.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_rules_commit_only_target_supported_tokens(g, seed):
    rng = np.random.default_rng(seed)

    def dist():
        mass = rng.random(V) * (rng.random(V) < 0.6)
        mass[rng.integers(V)] += 0.1
        return mass / mass.sum()

    p = np.stack([dist() for _ in range(g + 1)])
    q = np.stack([dist() for _ in range(g)]) if g else np.zeros((0, V))
    window = np.array([inverse_cdf(q[i], rng.random()) for i in range(g)], np.int64)
    for verdict in (verify_residual(window, q, p, rng.random(g), rng.random(g + 1)),
                    verify_exact_sampled(window, p, rng.random(g + 1))):
        a = verdict.accepted
        assert 0 <= a <= g and verdict.drafted == g
        assert all(p[i][window[i]] > 0 for i in range(a)) and p[a][verdict.correction] > 0
        assert a == g or verdict.correction != window[a]  # a correction never repeats the token it replaces


def monte_carlo_first_token(rule, p, q, draws, seed=0):
    """Distribution of the first committed token of one-token windows x ~ q under ``rule`` (pure, no models)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(p))
    for _ in range(draws):
        x = inverse_cdf(q, rng.random())
        verdict = rule(np.array([x]), q[None], np.stack([p, p]), rng.random(1), rng.random(2))
        counts[x if verdict.accepted else verdict.correction] += 1
    return counts


def chi2_pvalue(observed, expected):
    from scipy.stats import chi2

    keep = expected > 0
    assert observed[~keep].sum() == 0, "an outcome of probability 0 occurred"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(chi2.sf(stat, keep.sum() - 1))


def accept_every_draft_token(window, draft_probs, target_probs, accept_uniforms, sample_uniforms):
    """WRONG on purpose: skips the p/q test."""
    return verify_residual(window, draft_probs, target_probs, np.zeros(len(window)) - 1.0, sample_uniforms)


def resample_from_p(window, draft_probs, target_probs, accept_uniforms, sample_uniforms):
    """WRONG on purpose: on rejection draws from p without the rejected token instead of norm(max(0, p - q))."""
    g = len(window)
    for i in range(g):
        x = int(window[i])
        if accept_uniforms[i] * draft_probs[i][x] >= target_probs[i][x]:
            p = np.array(target_probs[i], np.float64)
            p[x] = 0.0
            return Verdict(i, inverse_cdf(p, sample_uniforms[i]), g)
    return Verdict(g, inverse_cdf(target_probs[g], sample_uniforms[g]), g)


def test_residual_rule_reproduces_p_and_wrong_rules_do_not():
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    q = np.array([0.1, 0.1, 0.3, 0.3, 0.2])
    draws = 20000
    good = monte_carlo_first_token(verify_residual, p, q, draws)
    assert chi2_pvalue(good, draws * p) > ALPHA
    with pytest.raises(AssertionError, match="probability 0"):  # accepting everything emits token 4 (p = 0)
        chi2_pvalue(monte_carlo_first_token(accept_every_draft_token, p, q, draws), draws * p)
    assert chi2_pvalue(monte_carlo_first_token(resample_from_p, p, q, draws), draws * p) < 1e-10


# ---- processors and parameters ------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(True, 0.7, 0, 1.0, 1.0), SamplingParams(True, 1.0, 5, 1.0, 1.0),
    SamplingParams(True, 1.3, 0, 0.8, 1.0), SamplingParams(True, 0.9, 20, 0.6, 1.2),
    SamplingParams(True, 2.0, 3, 0.95, 0.8), SamplingParams(False, 1.0, 50, 1.0, 1.5)])
def test_processors_match_transformers(params):
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as lp

    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(4, 300)) * 3).astype(np.float32)
    contexts = [rng.integers(0, 300, size=n).tolist() for n in (1, 5, 17, 40)]
    chain = []
    if params.repetition_penalty != 1.0:
        chain.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            chain.append(lp.TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            chain.append(lp.TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            chain.append(lp.TopPLogitsWarper(params.top_p))
    ours = process_logits(logits, params, contexts)
    for row, context in enumerate(contexts):
        ref = lp.LogitsProcessorList(chain)(torch.tensor([context]), torch.tensor(logits[row:row + 1]))[0].numpy()
        np.testing.assert_array_equal(np.isinf(ours[row]), np.isinf(ref))
        finite = ~np.isinf(ref)
        np.testing.assert_allclose(ours[row][finite], ref[finite], rtol=1e-6)


def test_uniforms_are_keyed_by_seed_stream_and_position():
    a = uniforms(5, sampling.TARGET, [3, 700, 0])
    np.testing.assert_array_equal(a[::-1], uniforms(5, sampling.TARGET, [0, 700, 3]))  # order does not matter
    assert not np.array_equal(a, uniforms(5, sampling.DRAFT, [3, 700, 0]))
    assert not np.array_equal(a, uniforms(6, sampling.TARGET, [3, 700, 0]))
    assert ((0 <= a) & (a < 1)).all()


def test_params_resolve_defaults_then_export_then_overrides():
    export = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "max_new_tokens": 2048}
    p = SamplingParams.resolve(export, seed=3)
    assert (p.do_sample, p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == (True, 0.7, 50, 0.8, 1.0, 3)
    p = SamplingParams.resolve(export, seed=3, temperature=0.0, top_k=0)
    assert p.greedy and p.top_k == 0
    assert SamplingParams.resolve({}, seed=None).seed != SamplingParams.resolve({}, seed=None).seed
    assert not SamplingParams.resolve({}).do_sample
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(repetition_penalty=0.0),
                dict(verify="maybe"), dict(top_k=2.5), dict(temperature="hot"), dict(seed="one")):
        with pytest.raises(GenerationInputError):
            SamplingParams.resolve({}, **bad)


def test_softmax_of_filtered_logits():
    probs = softmax(np.array([[0.0, -np.inf, 0.0]]))
    np.testing.assert_allclose(probs, [[0.5, 0.0, 0.5]])


# ---- end to end on tiny models -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe(exported):
    """A target with a 3-layer truncated draft: acceptance is neither ~0 nor ~1, so both paths of each rule run."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline

    with Pipeline.load(exported("llama", draft_layers=3), DeviceRequest("cpu", "cpu", 1, 1)) as pipeline:
        yield pipeline


def config(mode, verify="exact", **kw):
    settings = dict(mode=mode, verify=verify, max_new_tokens=4, gamma=2, branches=8, branch_batch=4, runner_up_k=5,
                    branch_budget="cap")
    settings.update(DIST)
    settings.update(kw)
    return GenerationConfig(**settings)


MODES = [("sd", "exact"), ("sd", "residual"), ("mirror", "exact"), ("mirror", "residual")]


@pytest.mark.parametrize("mode,verify", MODES + [("ar", "exact")])
def test_same_seed_same_tokens_and_timing_does_not_matter(mode, verify, pipe):
    ar = {seed: pipe.generate(PROMPT, config("ar", max_new_tokens=24, seed=seed)).tokens for seed in range(4)}
    for seed in range(4):
        runs = [pipe.generate(PROMPT, config(mode, verify, max_new_tokens=24, seed=seed, branch_budget=budget))
                for budget in ("cap", "time", "cap")]
        assert runs[0].tokens == runs[1].tokens == runs[2].tokens, (mode, verify, seed)
        assert runs[0].sampling.seed == seed
        if verify == "exact":  # every committed token is the target's draw at its position: ar's token
            assert runs[0].tokens == ar[seed]
        if mode == "sd":
            mirror = pipe.generate(PROMPT, config("mirror", verify, max_new_tokens=24, seed=seed))
            assert mirror.tokens == runs[0].tokens  # adopted branches are the windows sd drafts afresh


def test_greedy_settings_take_the_plain_path(pipe):
    greedy = pipe.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=16)).tokens  # export default: greedy
    for mode in ("ar", "sd", "mirror"):
        for kw in (dict(do_sample=False), dict(do_sample=True, temperature=0.0)):
            out = pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=16, **kw))
            assert out.tokens == greedy and out.sampling.greedy


def test_greedy_with_repetition_penalty_is_lossless(pipe):
    base = dict(max_new_tokens=24, repetition_penalty=1.5, do_sample=False)
    ar = pipe.generate(PROMPT, GenerationConfig(mode="ar", **base)).tokens
    assert ar != pipe.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=24)).tokens  # it does something
    for mode in ("sd", "mirror"):
        assert pipe.generate(PROMPT, GenerationConfig(mode=mode, **base)).tokens == ar


def test_sampled_streaming_and_statistics(pipe):
    pieces = []
    out = pipe.generate("Hello there", config("mirror", "residual", max_new_tokens=20, seed=11), on_text=pieces.append)
    assert "".join(pieces) == out.text
    s = out.stats
    assert s.accepted <= s.drafted and s.reused + s.fallbacks == s.windows <= s.steps
    assert s.new_tokens <= s.steps + s.accepted + 1


def test_export_defaults_apply_unless_overridden(pipe, monkeypatch):
    import dataclasses

    defaults = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05}
    monkeypatch.setattr(pipe, "manifest", dataclasses.replace(pipe.manifest, generation_defaults=defaults))
    resolved = pipe.sampling(GenerationConfig(seed=1))
    assert (resolved.do_sample, resolved.temperature, resolved.top_k, resolved.top_p,
            resolved.repetition_penalty) == (True, 0.6, 20, 0.9, 1.05)
    assert pipe.sampling(GenerationConfig(do_sample=False)).greedy
    assert pipe.sampling(GenerationConfig(top_k=0, verify="residual")).top_k == 0
    out = pipe.generate(PROMPT, GenerationConfig(mode="sd", max_new_tokens=8, seed=1))
    assert out.sampling == resolved


def test_cli_sampling_flags_and_json(exported, capsys):
    import json

    from mirrorsd.apps.cli import main

    argv = ["generate", "--model", str(exported("llama", draft_layers=3)), "--prompt", "Hello", "--max-new-tokens",
            "12", "--sample", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--repetition-penalty",
            "1.1", "--seed", "7", "--verify", "residual", "--json", "--target-device", "cpu", "--draft-device", "cpu"]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["sampling"] == {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.95,
                                   "repetition_penalty": 1.1, "seed": 7, "verify": "residual"}
    assert 0.0 <= runs[0]["stats"]["acceptance_rate"] <= 1.0 and "reuse_rate" in runs[0]["stats"]


def reference_distribution(pipe, params: SamplingParams, length: int = 3, prompt: list[int] = PROMPT
                           ) -> dict[tuple, float]:
    """Exact target-only probabilities of the first ``length`` tokens, processed by transformers' own processors."""
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as lp

    chain = lp.LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
                                    lp.TemperatureLogitsWarper(params.temperature), lp.TopKLogitsWarper(params.top_k),
                                    lp.TopPLogitsWarper(params.top_p)])
    eos = set(pipe.manifest.tokenizer.eos_token_ids)
    out, frontier = {}, {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in frontier.items():
            if prefix and (prefix[-1] in eos or prefix[-1] == -1):  # stopped: the category keeps its mass
                grown[prefix + (-1,)] = mass
                continue
            ids = prompt + [t for t in prefix]
            pipe.target.reset(1, len(ids) + 1)
            logits = torch.tensor(pipe.target.extend(ids)[-1:])
            probs = torch.softmax(chain(torch.tensor([ids]), logits), -1)[0].double().numpy()
            for token in np.flatnonzero(probs):
                grown[prefix + (int(token),)] = mass * probs[token]
        frontier = grown
    out.update(frontier)
    return out


def gof_pvalue(samples: list[tuple], reference: dict[tuple, float]) -> float:
    """Chi-square goodness of fit; categories with expected < 5 pooled; an impossible outcome gives 0."""
    from scipy.stats import chi2

    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if any(s not in reference for s in counts):
        return 0.0
    big = [c for c in reference if n * reference[c] >= 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [n * reference[c] for c in big]
    rest_e = n - sum(expected)
    if rest_e > 1e-9:
        observed.append(n - sum(observed))
        expected.append(rest_e)
    observed, expected = np.array(observed, float), np.array(expected, float)
    return float(chi2.sf(((observed - expected) ** 2 / expected).sum(), len(observed) - 1))


def sample_first_tokens(pipe, mode, verify, seeds) -> tuple[list[tuple], float]:
    """The first three tokens of each run (-1 after an EOS), and the share of windows taken from a branch."""
    out, reused, windows = [], 0, 0
    for seed in seeds:
        result = pipe.generate(PROMPT, config(mode, verify, seed=seed))
        tokens = result.tokens[:3]
        out.append(tuple(tokens) + (-1,) * (3 - len(tokens)))
        reused, windows = reused + result.stats.reused, windows + result.stats.windows
    return out, reused / max(windows, 1)


@pytest.fixture(scope="module")
def reference(pipe):
    return reference_distribution(pipe, SamplingParams(**DIST))


@pytest.mark.parametrize("index,mode,verify", [(i, m, v) for i, (m, v) in enumerate([("ar", "exact")] + MODES)])
def test_distribution_matches_target_only_sampling(index, mode, verify, pipe, reference):
    seeds = range(100_000 * (index + 1), 100_000 * (index + 1) + RUNS)  # disjoint seeds: independent samples
    samples, reuse = sample_first_tokens(pipe, mode, verify, seeds)
    p = gof_pvalue(samples, reference)
    assert p > ALPHA, f"{mode}/{verify}: p = {p:.2e}"
    if mode == "mirror":
        assert reuse > 0.01, "the test must see windows adopted from branches (measured: 3-10 %)"


@pytest.mark.parametrize("wrong", [accept_every_draft_token, resample_from_p])
def test_distribution_test_rejects_a_wrong_rule(wrong, pipe, reference, monkeypatch):
    monkeypatch.setitem(sampling.RULES, "residual", wrong)
    p = gof_pvalue(sample_first_tokens(pipe, "sd", "residual", range(900_000, 900_000 + RUNS))[0], reference)
    assert p < ALPHA, f"{wrong.__name__} passed the distribution test: p = {p:.2e}"
