"""The adaptive policy: plain cycles while drafting loses, judged on injected timings; lossless either way."""

import random
from functools import partialmethod

import mlx.core as mx
import pytest
from test_generate import MAX_REF, _prompt, reference, run

from dflash_mlx import stream_generate
from dflash_mlx.proposer import AdaptiveProposer, Proposal


class FakeDrafter:
    """Proposes ``n`` drafts and records whether each cycle drafted and what it kept."""

    tap_ids = [0]

    def __init__(self):
        self.proposed, self.kept = [], []

    def propose(self, last, n):
        self.proposed.append(n)
        return Proposal(mx.zeros((n,), dtype=mx.uint32))

    def accept(self, num_kept, taps):
        self.kept.append(num_kept)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _drive(policy, clock, cycles, plain_seconds, draft_seconds, kept):
    """Runs ``cycles`` cycles of block 4; returns per cycle whether it drafted."""
    drafted = []
    for i in range(cycles):
        proposal = policy.propose(0, 3)
        drafted.append(proposal.size > 0)
        clock.now += draft_seconds(i) if proposal.size else plain_seconds
        policy.accept(kept(i) if proposal.size else 1, None)
    return drafted


def _expected_losing(cycles, judged, probe, window, max_run):
    # Warm-up, the probe, a window of drafting cycles, then ``judged`` ones each time, each
    # followed by a plain run: one window, doubling up to max_run.
    expected, run, drafting = [True] + [False] * probe, window, window
    while len(expected) < cycles:
        expected += [True] * drafting + [False] * run
        run, drafting = min(2 * run, max_run), judged
    return expected[:cycles]


def test_losing_drafter_backs_off_exponentially():
    clock = Clock()
    inner = FakeDrafter()
    policy = AdaptiveProposer(inner, window=4, probe=2, max_run=16, clock=clock)
    # A plain step takes 1 s; a drafting cycle 3 s for 2 tokens: 1.5 s a token.
    drafted = _drive(policy, clock, 120, 1.0, lambda i: 3.0, lambda i: 2)
    assert drafted == _expected_losing(120, judged=4, probe=2, window=4, max_run=16)
    assert policy.plain_tps == pytest.approx(1.0) and policy.draft_tps == pytest.approx(1 / 1.5)
    # Every cycle reached the drafter's accept, plain ones too (their taps stay pending).
    assert len(inner.kept) == 120 and len(inner.proposed) == drafted.count(True)


def test_badly_losing_drafter_is_judged_after_three_cycles_once_it_lost():
    clock = Clock()
    policy = AdaptiveProposer(FakeDrafter(), window=8, probe=1, max_run=16, clock=clock)
    # 3 s a token against 1 s: after the first full window, three drafting cycles settle it.
    drafted = _drive(policy, clock, 60, 1.0, lambda i: 3.0, lambda i: 1)
    assert drafted == _expected_losing(60, judged=3, probe=1, window=8, max_run=16)
    assert policy.run == 16


def test_winning_drafter_keeps_drafting_with_rare_plain_refreshes():
    clock = Clock()
    policy = AdaptiveProposer(FakeDrafter(), window=4, probe=2, refresh=20, clock=clock)
    # 2 s for 4 tokens: twice as fast as plain decoding.
    drafted = _drive(policy, clock, 100, 1.0, lambda i: 2.0, lambda i: 4)
    assert drafted[:3] == [True, False, False]
    plain = [i for i, d in enumerate(drafted) if not d]
    # After the probe, one plain cycle per 20 drafting ones, to keep the plain time current.
    assert plain == [1, 2, 23, 44, 65, 86]
    assert policy.draft_tps == pytest.approx(2.0) and policy.plain_tps == pytest.approx(1.0)


def test_drafting_resumes_when_it_pays_again():
    clock = Clock()
    policy = AdaptiveProposer(FakeDrafter(), window=4, probe=1, max_run=64, clock=clock)
    # Slow for the first 30 cycles (1 token in 3 s), then fast (4 tokens in 2 s).
    drafted = _drive(policy, clock, 80, 1.0, lambda i: 3.0 if i < 30 else 2.0, lambda i: 1 if i < 30 else 4)
    assert drafted[:2] == [True, False] and not all(drafted[2:30])
    # Once drafting wins a window, the plain runs stop (no refresh is due within 64 cycles).
    last_plain = max(i for i, d in enumerate(drafted) if not d)
    assert last_plain < 60 and all(drafted[last_plain + 1 :])
    assert policy.run == 4  # reset to one window


def test_cycles_the_loop_proposes_itself_are_not_timed():
    clock = Clock()
    inner = FakeDrafter()
    policy = AdaptiveProposer(inner, clock=clock)
    for _ in range(5):  # block size 1: the loop never asks for drafts
        clock.now += 1.0
        policy.accept(1, None)
    assert policy.plain_tps is None and policy.draft_tps is None and len(inner.kept) == 5


def _random_clock(monkeypatch, **settings):
    """Each cycle takes a random time, so that the policy switches at random; short windows."""
    rng = random.Random(0)
    clock = Clock()

    def tick():
        clock.now += rng.uniform(0.0, 1.0)
        return clock.now

    monkeypatch.setattr(AdaptiveProposer, "__init__", partialmethod(AdaptiveProposer.__init__, clock=tick, **settings))


@pytest.mark.parametrize("prompt_len", [1, 7, 130])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_lossless_with_adaptive(tiny_pair, block_size, prompt_len, monkeypatch):
    """Drafting and plain cycles mixed at random: still the target's own greedy output."""
    _random_clock(monkeypatch, window=2, probe=1, refresh=5, max_run=4)
    model, draft, _ = tiny_pair
    prompt = _prompt(prompt_len)
    ref = reference(model, prompt)
    for max_tokens in (1, block_size + 1, MAX_REF):
        out, cycles = run(model, draft, prompt, block_size=block_size, max_tokens=max_tokens, adaptive=True)
        assert out == ref[:max_tokens], (block_size, prompt_len, max_tokens)
    kinds = {s.num_draft > 0 for s in cycles[1:-1]}
    assert kinds == {True, False}  # both kinds of cycle ran


def test_adaptive_default_and_stats(qwen3_pair, monkeypatch):
    """On by default (off with a seed); the stream reports both measured rates."""
    _random_clock(monkeypatch, window=2, probe=1)
    model, draft, tokenizer = qwen3_pair
    prompt = _prompt(7)
    _, cycles = run(model, draft, prompt, block_size=4, max_tokens=60)
    assert any(s.num_draft == 0 for s in cycles[1:-1]) and cycles[-1].plain_tps is not None
    _, seeded = run(model, draft, prompt, block_size=4, max_tokens=60, seed=0)
    assert all(s.num_draft > 0 for s in seeded[1:-1]) and seeded[-1].plain_tps is None
    last = list(stream_generate(model, draft, tokenizer, prompt, block_size=4, max_tokens=60))[-1]
    assert last.plain_tps > 0 and last.draft_tps > 0
    assert last.drafting_slower == (last.draft_tps < last.plain_tps)


def test_plain_probe_leaves_the_cache_as_it_was(qwen3_pair):
    """The plain steps timed after a run are trimmed away: the cache continues exactly."""
    from dflash_mlx.cache import make_cache
    from dflash_mlx.plain_probe import plain_tokens_per_second

    model, draft, tokenizer = qwen3_pair
    cache = make_cache(model, draft)
    first = list(stream_generate(model, draft, tokenizer, _prompt(7), block_size=4, max_tokens=20, prompt_cache=cache))
    offset, tokens = cache.offset, list(cache.tokens)
    assert plain_tokens_per_second(model, cache) > 0
    assert cache.offset == offset and cache.tokens == tokens
    assert plain_tokens_per_second(model, make_cache(model, draft)) is None  # nothing to time it on
    # The next turn reuses the cache as if nothing had run in between.
    ids = _prompt(7) + [t for r in first for t in r.tokens] + [5, 6]
    again = [t for r in stream_generate(model, draft, tokenizer, ids, block_size=4, max_tokens=12, prompt_cache=cache) for t in r.tokens]
    fresh = [t for r in stream_generate(model, draft, tokenizer, ids, block_size=4, max_tokens=12) for t in r.tokens]
    assert again == fresh


@pytest.mark.parametrize("settings", [{"adaptive": False}, {"seed": 3}])
def test_verbose_says_when_drafting_loses_with_the_policy_off(qwen3_pair, capsys, settings):
    """With no plain cycles to compare against, plain steps timed after the run still give the verdict."""
    from dflash_mlx import generate

    model, draft, tokenizer = qwen3_pair
    generate(model, draft, tokenizer, _prompt(7), verbose=True, block_size=4, max_tokens=24, **settings)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Drafting:")]
    assert len(line) == 1 and "than plain decoding" in line[0] and "timed after the run" in line[0]
    generate(model, None, tokenizer, _prompt(7), verbose=True, max_tokens=8, **settings)
    assert "Drafting:" not in capsys.readouterr().out  # nothing drafted, nothing to compare
