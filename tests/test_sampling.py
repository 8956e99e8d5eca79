"""Speculative sampling keeps the target's distribution: checked against exact marginals."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import VOCAB
from helpers.oracles import ScriptedDraft
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load
from dflash_mlx.drafts.lookup import PromptLookup
from dflash_mlx.loop import verify
from dflash_mlx.models.drafter import DraftModel
from dflash_mlx.sampling import make_sampler, sample_rows, speculative_accept, top_probability

PROMPT = [3, 17, 42, 8, 99]
TEMP = 1.0
# 400 runs: the negative controls below show a bias on 200 runs (or fewer), so 400 keep a margin.
RUNS = 400
CONTROL_RUNS = 200
DEPTH = 3


def _tokens(model, draft, prompt=PROMPT, **kwargs):
    return [t for s in dflash_generate_step(prompt, model, draft, LoopOptions(**kwargs)) for t in s.tokens]


def _exact_marginals(model, sampler=None) -> list[np.ndarray]:
    """p(x_1), p(x_2), p(x_3) of the target at TEMP, by enumerating all prefixes."""
    sampler = sampler or make_sampler(TEMP)

    def next_probs(prefixes):
        logits = model(mx.array([PROMPT + p for p in prefixes]))[:, -1]
        return np.array(sampler.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))

    marginals, joint, prefixes = [], np.ones(1), [[]]
    for depth in range(DEPTH):
        probs = next_probs(prefixes) * joint[:, None]  # (n_prefixes, V)
        marginals.append(probs.sum(axis=0))
        if depth + 1 < DEPTH:
            joint = probs.reshape(-1)
            prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return marginals


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def _tv_bound(probs: np.ndarray, n: int) -> float:
    """The 99.9th percentile of the TV distance of n exact samples: a bound a correct sampler meets."""
    rng = np.random.default_rng(0)
    draws = rng.multinomial(n, probs / probs.sum(), size=2000)
    return float(np.quantile([_tv(d, probs) for d in draws], 0.999))


@pytest.fixture(scope="module")
def pair(sampling_target, pair_dirs):
    """A target with smaller logits than the shared one, so that sampling has real choices."""
    return load(sampling_target, pair_dirs["draft"])


@pytest.fixture(scope="module")
def exact(pair):
    return _exact_marginals(pair[0])


def _drafter(pair, proposal):
    model, draft, _ = pair
    if proposal == "greedy":
        # Proposes the target's greedy continuation: accepted often at TEMP, not always.
        greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=DEPTH)]
        return ScriptedDraft(draft, PROMPT + greedy, VOCAB)
    return draft  # the random drafter's own distribution q


def _excess(pair, exact, proposal, sampler=None, drafter=None, runs=RUNS, **kwargs) -> list[float]:
    """TV distance minus its bound, per position; all negative for a correct sampler."""
    model, drafter = pair[0], drafter or _drafter(pair, proposal)
    counts = np.zeros((DEPTH, VOCAB))
    sampler = sampler or make_sampler(TEMP)
    for seed in range(runs):
        out = _tokens(model, drafter, sampler=sampler, proposal=proposal, seed=seed, block_size=DEPTH, max_tokens=DEPTH,
                      **kwargs)  # fmt: skip
        for pos, tok in enumerate(out):
            counts[pos, tok] += 1
    return [_tv(counts[p], exact[p]) - _tv_bound(exact[p], runs) for p in range(DEPTH)]


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_distribution_matches_target(pair, exact, proposal):
    excess = _excess(pair, exact, proposal)
    assert max(excess) < 0, excess


def test_distribution_matches_target_with_a_draft_vocab(pair, exact):
    """Drafts sampled among a subset of ids (q is 0 elsewhere, FR-Spec): still the target's distribution."""
    model, draft, _ = pair
    subset = DraftModel(copy.deepcopy(draft.args))
    subset.update(draft.parameters())
    subset.set_draft_vocab(mx.arange(VOCAB - 1, -1, -2, dtype=mx.int32))  # every other id
    excess = _excess(pair, exact, "sample", drafter=subset)
    assert max(excess) < 0, excess


XTC = dict(xtc_probability=0.5, xtc_threshold=0.05)


def test_xtc_probs_are_what_mlx_lm_samples_from():
    """Our XTC distribution (the mixture of cut and uncut draws) against mlx-lm's own sampler."""
    logits = mx.array([[2.0, 1.8, 1.5, 0.5, 0.0, -1.0, -2.0, -3.0]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ours = np.array(make_sampler(TEMP, **XTC).probs(logprobs))[0]
    theirs = mlx_lm_make_sampler(TEMP, **XTC)
    mx.random.seed(0)
    n = 4000
    counts = np.bincount([theirs(logprobs).item() for _ in range(n)], minlength=8)
    assert _tv(counts, ours) < _tv_bound(ours, n)
    plain = np.array(make_sampler(TEMP).probs(logprobs))[0]
    assert _tv(counts, plain) > _tv_bound(plain, n)  # the check tells XTC from no XTC


@pytest.fixture(scope="module")
def exact_xtc(pair):
    return _exact_marginals(pair[0], make_sampler(TEMP, **XTC))


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_distribution_matches_target_with_xtc(pair, exact_xtc, proposal):
    sampler = make_sampler(TEMP, **XTC)
    excess = _excess(pair, exact_xtc, proposal, sampler)
    assert max(excess) < 0, excess


@pytest.mark.parametrize("proposal, cutoff", [("greedy", 0.5), ("sample", 0.009)])
def test_distribution_matches_target_with_confidence_cutoff(pair, exact, proposal, cutoff):
    """Verifying only the drafter's confident prefix keeps the target's distribution."""
    model, draft, _ = pair
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=DEPTH)]
    # The scripted drafter is sure of its first draft (position 6) and unsure of the second (7).
    drafter = ScriptedDraft(draft, PROMPT + greedy, VOCAB, unsure_every=7) if proposal == "greedy" else draft
    counts, drafted = np.zeros((DEPTH, VOCAB)), []
    sampler = make_sampler(TEMP)
    for seed in range(RUNS):
        steps = list(
            dflash_generate_step(PROMPT, model, drafter, LoopOptions(sampler=sampler, proposal=proposal, seed=seed,
                                                                     block_size=DEPTH, max_tokens=DEPTH + 1,
                                                                     min_confidence=cutoff))
        )  # fmt: skip
        # One more token than counted, so the first cycle may draft DEPTH - 1 tokens.
        drafted.append(steps[1].num_draft)
        for pos, tok in enumerate([t for s in steps for t in s.tokens][:DEPTH]):
            counts[pos, tok] += 1
    excess = [_tv(counts[p], exact[p]) - _tv_bound(exact[p], RUNS) for p in range(DEPTH)]
    assert max(excess) < 0, excess
    # Cut blocks occurred (and, with sampled drafts, full ones too): the cutoff was exercised.
    assert 1 in drafted and (proposal == "greedy" or DEPTH - 1 in drafted)


def test_distribution_matches_target_with_lookup_fallback(pair, exact, monkeypatch):
    """Lookup cycles verify one-hot proposals the same way: the target's distribution is kept."""
    model, draft, _ = pair
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=DEPTH)]
    # The drafter always misses, so its cycle is followed by a lookup cycle.
    wrong = ScriptedDraft(draft, PROMPT + greedy, VOCAB, wrong_every=1)
    proposed = []

    def likely_lookup(self, tokens, count):
        # Propose the target's most likely next token, so that lookup drafts are often accepted.
        proposed.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
        return proposed[-1:][:count]

    monkeypatch.setattr(PromptLookup, "lookup", likely_lookup)
    counts, sampler = np.zeros((DEPTH, VOCAB)), make_sampler(TEMP)
    accepted = 0
    for seed in range(RUNS):
        # One more token than counted, so the cycle after the drafter's may still draft.
        options = LoopOptions(sampler=sampler, seed=seed, block_size=2, max_tokens=DEPTH + 1, lookup_fallback=2)
        steps = list(dflash_generate_step(PROMPT, model, wrong, options))
        out = [t for s in steps for t in s.tokens][:DEPTH]
        accepted += sum(s.num_accepted for s in steps[2:])
        for pos, tok in enumerate(out):
            counts[pos, tok] += 1
    excess = [_tv(counts[p], exact[p]) - _tv_bound(exact[p], RUNS) for p in range(DEPTH)]
    assert max(excess) < 0, excess
    # Lookup cycles ran, and some of their drafts were accepted.
    assert len(proposed) > RUNS // 2 and accepted > 0


@pytest.mark.parametrize("lookup", [0, 1])
def test_distribution_matches_target_with_adaptive(pair, exact, lookup):
    """The adaptive policy's paused cycles after a sampled drafting cycle (the drafter's taps left
    pending) keep the distribution: its first cycle drafts, the next ones probe the paused rate,
    as plain steps (lookup 0) or verifying a looked-up draft where the text has one (lookup 1)."""
    from dflash_mlx.tuning.policy import PolicyState

    model, draft, _ = pair
    counts, sampler, kinds = np.zeros((DEPTH, VOCAB)), make_sampler(TEMP), set()
    for seed in range(RUNS):
        options = LoopOptions(sampler=sampler, seed=seed, block_size=DEPTH, max_tokens=DEPTH + 1, adaptive=True,
                              policy=PolicyState(lookup=lookup))  # fmt: skip
        steps = list(dflash_generate_step(PROMPT, model, draft, options))
        kinds.update((i, s.num_draft) for i, s in enumerate(steps[1:3]))
        for pos, tok in enumerate([t for s in steps for t in s.tokens][:DEPTH]):
            counts[pos, tok] += 1
    excess = [_tv(counts[p], exact[p]) - _tv_bound(exact[p], RUNS) for p in range(DEPTH)]
    assert max(excess) < 0, excess
    # The drafter's whole block first, then paused cycles: no draft, or one looked-up draft.
    assert {k for k in kinds if k[0] == 0} == {(0, DEPTH - 1)}
    assert {n for i, n in kinds if i == 1} == ({0} if lookup == 0 else {0, 1})


@pytest.mark.parametrize("broken", [False, True])
def test_distribution_matches_target_with_draft_trees(pair, exact, monkeypatch, broken):
    """Draft trees sample the target at every node and follow the child equal to its draw. The
    drafter sure of the target's greedy continuation, with branches beside it (budget 6): right.
    Negative control: a walk that follows the drafter's first child whatever the target drew."""
    from dflash_mlx.models.tree import DraftTree

    def first_child(tree, target_tokens):
        path = [0]
        while tree.children[path[-1]]:
            path.append(min(tree.children[path[-1]].values()))
        return path, target_tokens[path[-1]]

    if broken:
        monkeypatch.setattr(DraftTree, "walk", first_child)
    # The broken walk emits the drafter's path every time: far fewer runs show it.
    excess = _excess(pair, exact, "greedy", runs=CONTROL_RUNS // 2 if broken else RUNS, tree_budget=6, adaptive=False)
    assert (max(excess) > 0) == broken, excess


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_broken_acceptance_rule_fails_the_same_check(pair, exact, proposal, monkeypatch):
    """Negative control: with an always-accept rule the check above must fail."""
    monkeypatch.setattr(verify, "accept_one_hot", lambda d, t: mx.ones(d.shape, dtype=mx.bool_))
    monkeypatch.setattr(
        verify, "speculative_accept", lambda d, q, p: (mx.ones(d.shape, dtype=mx.bool_), speculative_accept(d, q, p)[1])
    )
    # Half the runs: a bias that fails the check there fails it at RUNS too, by more.
    excess = _excess(pair, exact, proposal, runs=CONTROL_RUNS)
    assert max(excess) > 0, excess


@pytest.mark.parametrize("broken", [False, True])
def test_resampling_from_p_after_a_rejection_fails_the_same_check(pair, exact, monkeypatch, broken):
    """A subtle negative control: the right acceptance test, but a rejected draft replaced by a
    sample of p instead of normalize(max(p - q, 0)). The check must catch that too. It shows
    where q is sharp on a likely token (a drafter sure of the target's greedy continuation,
    with sampled proposals), so the same setting is also checked with the right rule."""

    def from_p(draft_tokens, q, p):
        accepted, _ = speculative_accept(draft_tokens, q, p)
        return accepted, mx.random.categorical(mx.log(p))

    if broken:
        monkeypatch.setattr(verify, "speculative_accept", from_p)
    excess = _excess(pair, exact, "sample", drafter=_drafter(pair, "greedy"))
    assert (max(excess) > 0) == broken, excess


def test_lookup_drafts_are_one_hot_and_accepted_as_the_target_allows(qwen3_pair, monkeypatch):
    """Prompt-lookup drafts are certain: at a low temperature, where the target's own samples are
    its argmax, drafts of its argmax continuation are all accepted."""
    model, _, _ = qwen3_pair
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40)]
    script = PROMPT + greedy
    monkeypatch.setattr(PromptLookup, "lookup", lambda self, tokens, count: script[len(tokens) : len(tokens) + count])
    options = LoopOptions(sampler=make_sampler(0.01), seed=0, max_tokens=40)
    steps = list(dflash_generate_step(PROMPT, model, PromptLookup(8), options))
    assert [t for s in steps for t in s.tokens] == greedy
    assert all(s.num_accepted == s.num_draft for s in steps[1:])
    assert sum(s.num_draft for s in steps) >= 30


def _allowed(model, prompt, out, keep):
    """For each emitted token, whether the target's filtered distribution allows it."""
    logits = model(mx.array([prompt + out]))[0, len(prompt) - 1 : -1]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    allowed = keep(logprobs) > -float("inf")
    return [bool(allowed[i, t].item()) for i, t in enumerate(out)]


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
@pytest.mark.parametrize("settings", [{"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.3}])
def test_filters_never_emit_a_disallowed_token(pair, proposal, settings):
    model, draft, _ = pair
    sampler = make_sampler(temp=1.5, **settings)
    out = _tokens(model, draft, sampler=sampler, proposal=proposal, seed=1, max_tokens=60, block_size=4)
    assert len(out) == 60
    assert all(_allowed(model, PROMPT, out, sampler.filtered))


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_same_seed_same_output(pair, proposal):
    model, draft, _ = pair
    sampler = make_sampler(temp=1.0)
    runs = [_tokens(model, draft, sampler=sampler, proposal=proposal, seed=s, max_tokens=40) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("settings", [
    {"proposal": "greedy"}, {"proposal": "sample"}, {"block_size": "auto"}, {"lookup_fallback": 2}, {"block_size": 5},
])  # fmt: skip
def test_a_seeded_run_keeps_its_prefix_whatever_max_tokens_is(pair, settings):
    """As mlx-lm's seeded decoding does: a shorter run is a prefix of a longer one with the same seed."""
    model, draft, _ = pair
    sampler = make_sampler(temp=0.7)
    longest = _tokens(model, draft, sampler=sampler, seed=1, max_tokens=40, **settings)
    for max_tokens in (1, 2, 7, 14, 23):
        assert _tokens(model, draft, sampler=sampler, seed=1, max_tokens=max_tokens, **settings) == longest[:max_tokens]


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
@pytest.mark.parametrize("kind", ["ours", "mlx-lm", "none"])
def test_temperature_zero_is_greedy(pair, proposal, kind):
    # Ours and None take the argmax of the logits directly; mlx-lm's greedy sampler gets logprobs.
    model, draft, _ = pair
    sampler = {"ours": make_sampler(0.0), "mlx-lm": mlx_lm_make_sampler(0.0), "none": None}[kind]
    out = _tokens(model, draft, sampler=sampler, proposal=proposal, max_tokens=40)
    assert out == [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40)]


def test_top_probability_matches_softmax():
    rng = np.random.default_rng(0)
    rows = [rng.normal(0, scale, 4096) for scale in (0.1, 1.0, 5.0, 30.0, 300.0)]
    rows.append(np.zeros(4096))  # uniform: 1 / V
    spiky = rng.normal(0, 1, 4096)
    spiky[17] = 200.0  # everything else underflows
    rows.append(spiky)
    logits = mx.array(np.stack(rows).astype(np.float32))
    ref = np.asarray(mx.max(mx.softmax(logits, axis=-1, precise=True), axis=-1))
    got = np.asarray(top_probability(logits))
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert got[-2] == pytest.approx(1 / 4096, rel=1e-6) and got[-1] == pytest.approx(1.0)
    with_inf = mx.array([[0.0, -np.inf, np.log(3.0)]], dtype=mx.float32)
    assert np.asarray(top_probability(with_inf))[0] == pytest.approx(0.75, rel=1e-5)
    half = logits.astype(mx.bfloat16)
    np.testing.assert_allclose(
        np.asarray(top_probability(half)),
        np.asarray(mx.max(mx.softmax(half.astype(mx.float32), axis=-1), axis=-1)),
        rtol=1e-5,
    )


def test_repetition_penalty_matches_mlx_lm(pair):
    model, draft, _ = pair
    processors = make_logits_processors(repetition_penalty=1.5, repetition_context_size=8)
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40)]
    oracle = ScriptedDraft(draft, PROMPT + greedy, VOCAB)
    ref = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40, logits_processors=processors)]
    for drafter in (draft, oracle):
        assert _tokens(model, drafter, logits_processors=processors, max_tokens=40, block_size=8) == ref


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temp": -1}, "temp must be >= 0 (got -1)"),
        ({"top_p": 1.5}, "top_p must be in [0, 1] (got 1.5)"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"top_k": -2}, "top_k must be a non-negative integer (got -2)"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(DFlashError) as e:
        make_sampler(**kwargs)
    assert message in str(e.value)


def test_bad_proposal(pair):
    model, draft, _ = pair
    with pytest.raises(DFlashError, match="proposal must be one of greedy, sample"):
        _tokens(model, draft, proposal="beam")


def test_sample_rows_draws_in_proportion_and_never_a_zero_weight():
    """Inverse-CDF draws from unnormalised weights, zeros anywhere (first, last, between)."""
    weights = mx.array([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1e-3]])
    mx.random.seed(0)
    n = 4000
    counts = np.zeros((2, 6))
    for _ in range(n):
        counts[np.arange(2), np.array(sample_rows(weights))] += 1
    probs = np.array(weights).astype(np.float64)
    probs /= probs.sum(axis=-1, keepdims=True)
    assert counts[probs == 0].sum() == 0
    assert _tv(counts[0], probs[0]) < _tv_bound(probs[0], n)
