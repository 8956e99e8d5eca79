"""The adaptive policy: plain cycles while drafting loses, judged on injected timings; what it
learned carries over from one call to the next; lossless either way."""

import json
import math
import random
import time

import mlx.core as mx
import pytest
from helpers.policy import Clock, CostlyDraft
from test_generate import _prompt, _truncate_at_stop, lossless_length, reference, run

from dflash_mlx import DFlashError, make_cache, stream_generate
from dflash_mlx.drafts.proposer import AdaptiveProposer
from dflash_mlx.loop.proposal import Proposal
from dflash_mlx.tuning.policy import SAVED_MAX_AGE, PolicyState


class FakeDrafter:
    """Proposes ``n`` drafts and records whether each cycle drafted and what it kept."""

    tap_ids = [0]
    drafter = None  # no drafter context to feed

    def __init__(self):
        self.proposed, self.kept = [], []

    def propose(self, last, n):
        self.proposed.append(n)
        return Proposal(mx.zeros((n,), dtype=mx.uint32))

    def accept(self, num_accepted, taps):
        self.kept.append(num_accepted + 1)


def _drive(policy, clock, cycles, plain_seconds, draft_seconds, kept, inner=None, start=0):
    """Runs ``cycles`` cycles of block 4 as one generation (one ``AdaptiveProposer`` over
    ``policy``); returns per cycle whether it drafted. ``start`` numbers the first cycle."""
    proposer = AdaptiveProposer(inner or FakeDrafter(), policy)
    drafted = []
    for i in range(start, start + cycles):
        proposal = proposer.propose(0, 3)
        drafted.append(proposal.size > 0)
        clock.now += draft_seconds(i) if proposal.size else plain_seconds
        proposer.accept(kept(i) - 1 if proposal.size else 0, None)
    return drafted


def _conversation(policy, clock, replies, cycles, plain_seconds, draft_seconds, kept):
    """A chat of ``replies`` replies of ``cycles`` cycles each, every one a new generation on
    the same ``policy``; returns per reply whether each cycle drafted."""
    return [_drive(policy, clock, cycles, plain_seconds, draft_seconds, kept, start=r * cycles) for r in range(replies)]


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
    # No cost bound (probe_cost=inf): the doubling alone.
    policy = PolicyState(window=4, probe=2, max_run=16, probe_cost=math.inf, clock=clock)
    # A plain step takes 1 s; a drafting cycle 3 s for 2 tokens: 1.5 s a token.
    drafted = _drive(policy, clock, 120, 1.0, lambda i: 3.0, lambda i: 2, inner=inner)
    assert drafted == _expected_losing(120, judged=4, probe=2, window=4, max_run=16)
    assert policy.plain_tps == pytest.approx(1.0) and policy.draft_tps == pytest.approx(1 / 1.5)
    # Every cycle reached the drafter's accept, plain ones too (their taps stay pending).
    assert len(inner.kept) == 120 and len(inner.proposed) == drafted.count(True)


def test_badly_losing_drafter_is_judged_after_three_cycles_once_it_lost():
    clock = Clock()
    policy = PolicyState(window=8, probe=1, max_run=16, probe_cost=math.inf, clock=clock)
    # 3 s a token against 1 s: after the first full window, three drafting cycles settle it.
    drafted = _drive(policy, clock, 60, 1.0, lambda i: 3.0, lambda i: 1)
    assert drafted == _expected_losing(60, judged=3, probe=1, window=8, max_run=16)
    assert policy.run == 16


def test_winning_drafter_keeps_drafting_with_rare_plain_refreshes():
    clock = Clock()
    policy = PolicyState(window=4, probe=2, refresh=20, clock=clock)
    # 2 s for 4 tokens: twice as fast as plain decoding.
    drafted = _drive(policy, clock, 100, 1.0, lambda i: 2.0, lambda i: 4)
    assert drafted[:3] == [True, False, False]
    plain = [i for i, d in enumerate(drafted) if not d]
    # After the probe, one plain cycle per 20 drafting ones, to keep the plain time current.
    assert plain == [1, 2, 23, 44, 65, 86]
    assert policy.draft_tps == pytest.approx(2.0) and policy.plain_tps == pytest.approx(1.0)


def test_drafting_resumes_when_it_pays_again():
    clock = Clock()
    policy = PolicyState(window=4, probe=1, max_run=64, probe_cost=math.inf, clock=clock)
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
    policy = PolicyState(clock=clock)
    proposer = AdaptiveProposer(inner, policy)
    for _ in range(5):  # block size 1: the loop never asks for drafts
        clock.now += 1.0
        proposer.accept(0, None)
    assert policy.plain_tps is None and policy.draft_tps is None and len(inner.kept) == 5
    assert not policy.warm  # the warm-up cycle is still to come


# ---- what the policy learned lasts: a conversation of short replies --------------------------


def test_short_replies_draft_only_in_the_first_replys_probe_when_drafting_is_slower():
    """The chat's case: drafting at 4.5 s a token against 1 s plainly, replies of 30 tokens.
    The first reply drafts in its warm-up and a window cut short after three cycles (over three
    times slower); later ones decode plainly, with re-probes that cost at most ``probe_cost``,
    and the conversation stays within 5% of plain decoding."""
    clock = Clock()
    policy = PolicyState(clock=clock)  # the defaults: window 8, probe 2, probe_cost 3%
    first = _drive(policy, clock, 30, 1.0, lambda i: 4.5, lambda i: 1)
    assert first == [True] + [False] * 2 + [True] * 3 + [False] * 24
    learning = clock.now
    later = [d for reply in _conversation(policy, clock, 39, 30, 1.0, lambda i: 4.5, lambda i: 1) for d in reply]
    # Re-probes of three drafting cycles (a clear loss), each after a plain run long enough (350
    # cycles) that the 10.5 s the three cycles took over plain decoding are 3% of it.
    assert later.index(True) == 6 + 350 - 30
    assert _segments(later[later.index(True) :])[:-1] == [(3, 350), (3, 350)]
    assert clock.now - learning <= 1.03 * len(later)  # later replies: at most 3% over plain decoding
    assert clock.now <= 1.05 * 30 * 40  # the whole conversation, first reply included: within 5%
    assert policy.drafts_next() is False


@pytest.mark.parametrize(("seconds_a_token", "first_window"), [(2.5, 8), (4.0, 3)])
def test_the_first_window_is_cut_short_only_for_a_drafter_three_times_slower(seconds_a_token, first_window):
    """Before any loss, a window ends early only when its first three cycles take over three
    times the paused cycles' time a token; after a loss, twice already settles it."""
    clock = Clock()
    drafted = _drive(PolicyState(clock=clock), clock, 3000, 1.0, lambda i: seconds_a_token, lambda i: 1)
    segments = _segments(drafted[3:])
    assert segments[0][0] == first_window and len(segments) >= 3
    assert all(d == 3 for d, _ in segments[1:])


def test_short_replies_keep_drafting_when_drafting_is_faster():
    """2 s for 4 tokens against 1 s a token: every reply drafts from its first cycle; the only
    plain cycles are the first reply's probe and one per 64 drafting cycles, across replies."""
    clock = Clock()
    policy = PolicyState(clock=clock)
    replies = _conversation(policy, clock, 10, 30, 1.0, lambda i: 2.0, lambda i: 4)
    cycles = [d for reply in replies for d in reply]
    assert [i for i, d in enumerate(cycles) if not d] == [1, 2, 67, 132, 197, 262]
    assert all(reply[0] for reply in replies)  # no reply starts with a probe again
    assert policy.draft_tps == pytest.approx(2.0) and policy.plain_tps == pytest.approx(1.0)


def _segments(drafted):
    """(drafting cycles, plain cycles after them) for each drafting run."""
    out, i = [], 0
    while i < len(drafted):
        j = i
        while j < len(drafted) and drafted[j]:
            j += 1
        k = j
        while k < len(drafted) and not drafted[k]:
            k += 1
        if j > i:
            out.append((j - i, k - j))
        i = k
    return out


@pytest.mark.parametrize("seconds_a_token", [1.2, 1.9, 4.5, 10.0, 40.0])
def test_reprobes_cost_at_most_probe_cost_however_slow_drafting_is(seconds_a_token):
    """Each losing re-probe's time beyond plain decoding is at most 3% of the plain run that
    follows it, from a slight loss to a drafter 40 times slower."""
    clock = Clock()
    policy = PolicyState(clock=clock)
    drafted = _drive(policy, clock, 20000, 1.0, lambda i: seconds_a_token, lambda i: 1)
    # Past the warm-up and the probe; the last run may be cut by the end of the run.
    segments = _segments(drafted[3:])[:-1]
    assert len(segments) >= 2
    for drafting, plain in segments:
        extra = drafting * (seconds_a_token - 1.0)
        assert extra <= 0.03 * plain + 1e-9, (drafting, plain)
    total = sum(d * seconds_a_token + p for d, p in segments)
    assert total <= 1.03 * sum(d + p for d, p in segments)


def test_policy_settings_are_checked():
    for bad in ({"window": 0}, {"probe": -1}, {"refresh": 0}, {"max_run": 1.5}, {"probe_cost": 0}):
        with pytest.raises(DFlashError, match=next(iter(bad))):
            PolicyState(**bad)


# ---- through the loop: the tiny pair, a drafter whose pass costs time on the policy's clock ----


@pytest.mark.parametrize("slow", [True, False])
def test_drafting_slower_is_what_the_policy_then_acts_on(qwen3_pair, slow):
    """Every reading takes 1 s, a drafter pass 3 s more. Always wrong (1 token a cycle), drafting
    is slower: the stream says so, and the cycles after the verdict decode plainly. An oracle
    (4 tokens a cycle) at 1 s a pass is faster: the stream says so, and they keep drafting."""
    model, draft, tokenizer = qwen3_pair
    prompt = _prompt(7)
    clock = Clock(step=1.0)
    drafter = CostlyDraft(draft, prompt + reference(model, prompt, 80), clock, 3.0 if slow else 1.0,
                          wrong_every=1 if slow else 0)  # fmt: skip
    policy = PolicyState(clock=clock, lookup=0)  # paused cycles are plain steps: num_draft 0
    responses = list(stream_generate(model, drafter, tokenizer, prompt, block_size=4, max_tokens=60, policy=policy))
    judged = next(i for i, r in enumerate(responses) if r.draft_tps is not None)
    assert responses[judged].drafting_slower is slow
    after = responses[judged + 1 : -1]  # the last cycle may have had no room for drafts
    assert len(after) >= 3 and all((r.num_draft == 0) is slow for r in after)
    assert [r.num_draft > 0 for r in responses[1:4]] == [True, False, False]  # warm-up, then the probe


@pytest.mark.parametrize("carried_by", ["prompt_cache", "policy"])
def test_later_replies_continue_the_policy(qwen3_pair, carried_by):
    """Three turns with a drafter that loses: only the first turn drafts (its warm-up and one
    window, cut short). The state is passed to every call, with the conversation's cache or with a fresh cache
    each turn (as after /clear)."""
    model, draft, tokenizer = qwen3_pair
    clock = Clock(step=1.0)
    drafter = CostlyDraft(draft, [], clock, 3.0, wrong_every=1)
    policy = PolicyState(clock=clock, lookup=0)  # paused cycles are plain steps: num_draft 0
    cache = make_cache(model, drafter)
    ids, turns = _prompt(7), []
    for _ in range(3):
        if carried_by == "prompt_cache":
            kwargs = {"policy": policy, "prompt_cache": cache}
        else:
            kwargs = {"policy": policy, "prompt_cache": make_cache(model, drafter)}
        responses = list(stream_generate(model, drafter, tokenizer, ids, block_size=4, max_tokens=24, **kwargs))
        turns.append([r.num_draft > 0 for r in responses[1:]])
        ids = ids + [t for r in responses for t in r.tokens] + [5, 6]
    assert turns[0][:4] == [True, False, False, True]
    # One warm-up cycle and one judged window, cut short after three cycles three times slower.
    assert sum(sum(t) for t in turns) == 1 + 3
    assert not any(turns[2]) and policy.drafts_next() is False


def _random_policy(**settings):
    """Each cycle takes a random time, so that the policy switches at random."""
    rng = random.Random(0)
    clock = Clock()

    def tick():
        clock.now += rng.uniform(0.0, 1.0)
        return clock.now

    return PolicyState(clock=tick, **settings)


@pytest.mark.parametrize(("prompt_len", "lookup"), [(1, 1), (7, 0), (130, 1)])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_lossless_with_adaptive(tiny_pair, block_size, prompt_len, lookup):
    """Drafting and paused cycles (plain steps, or prompt-lookup drafts) mixed at random, one
    policy across the runs: still the target's own greedy output."""
    policy = _random_policy(window=2, probe=1, refresh=5, max_run=4, probe_cost=math.inf, lookup=lookup)
    model, draft, _ = tiny_pair
    prompt = _prompt(prompt_len)
    length = lossless_length(prompt_len)
    ref = reference(model, prompt, length)
    for max_tokens in (1, block_size + 1, length):
        out, cycles = run(model, draft, prompt, block_size=block_size, max_tokens=max_tokens, policy=policy)
        assert out == ref[:max_tokens], (block_size, prompt_len, max_tokens)
    # A drafter cycle verifies the whole block; a paused one at most ``lookup`` drafts (at block 2
    # with lookup 1 the two look alike).
    kinds = {s.num_draft == block_size - 1 for s in cycles[1:-1]}
    assert kinds == {True, False} or block_size - 1 == lookup  # both kinds of cycle ran


def test_adaptive_default_and_stats(qwen3_pair):
    """On by default (off with a seed); the stream reports both measured rates."""
    model, draft, tokenizer = qwen3_pair
    prompt = _prompt(7)
    _, cycles = run(model, draft, prompt, block_size=4, max_tokens=60, policy=_random_policy(window=2, probe=1))
    assert any(s.num_draft == 0 for s in cycles[1:-1]) and cycles[-1].plain_tps is not None
    untouched = _random_policy(window=2, probe=1)
    _, seeded = run(model, draft, prompt, block_size=4, max_tokens=60, seed=0, policy=untouched)
    assert all(s.num_draft > 0 for s in seeded[1:-1]) and seeded[-1].plain_tps is None
    assert not untouched.warm  # a seeded run leaves the policy alone
    last = list(stream_generate(model, draft, tokenizer, prompt, block_size=4, max_tokens=60))[-1]
    assert last.plain_tps > 0 and last.draft_tps > 0


def test_plain_probe_leaves_the_cache_as_it_was(qwen3_pair):
    """The plain steps timed after a run are trimmed away: the cache continues exactly."""
    from dflash_mlx.loop.plain_speed import plain_tokens_per_second

    model, draft, tokenizer = qwen3_pair
    cache = make_cache(model, draft)
    first = list(stream_generate(model, draft, tokenizer, _prompt(7), block_size=4, max_tokens=20, prompt_cache=cache))
    offset, tokens = cache.offset, list(cache.tokens)
    assert plain_tokens_per_second(model, cache) > 0
    assert cache.offset == offset and cache.tokens == tokens
    assert plain_tokens_per_second(model, make_cache(model, draft)) is None  # nothing to time it on
    # The next turn reuses the cache as if nothing had run in between.
    ids = _prompt(7) + [t for r in first for t in r.tokens] + [5, 6]
    again = [
        t
        for r in stream_generate(model, draft, tokenizer, ids, block_size=4, max_tokens=12, prompt_cache=cache)
        for t in r.tokens
    ]
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


def _two_back(tokens, logits):
    # Forces the token after the one two back, so that a tiny random target's text varies.
    return logits + 1e4 * (mx.arange(logits.shape[-1]) == (tokens[-2] + 1) % logits.shape[-1])


@pytest.mark.parametrize("stops", [False, True])
def test_plain_runs_are_pipelined_and_lossless(qwen3_pair, monkeypatch, stops):
    # A run of plain cycles queues each step before reading the last (mlx-lm's pipelining),
    # keeps the drafter's taps in step, and ends in a cache the next turn continues from.
    from mlx_lm.generate import generate_step

    from dflash_mlx.loop.verify import Verifier

    model, draft, _ = qwen3_pair
    calls = []
    real = Verifier._queue
    monkeypatch.setattr(Verifier, "_queue", lambda self, *a: calls.append(1) or real(self, *a))
    prompt = _prompt(9, seed=5)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, logits_processors=[_two_back])]
    # A stop token first met inside the plain run.
    stop = {next(t for i, t in enumerate(ref) if i >= 4 and t not in ref[:i])} if stops else set()
    policy = PolicyState()
    policy.warm, policy.plain_left = True, 10  # ten plain cycles, then drafting
    cache = make_cache(model, draft)
    out, cycles = run(model, draft, prompt, max_tokens=40, policy=policy, prompt_cache=cache, stop_tokens=stop,
                      logits_processors=[_two_back])  # fmt: skip
    assert out == _truncate_at_stop(ref, stop) and 5 <= len(out) < 11 if stops else out == ref
    # The scheduled run: the cycles after the first are plain until it ends (later plain cycles are the
    # policy's own choice, which depends on measured times, so they are not counted).
    run_length = min(10, len(cycles) - 1)
    assert all(c.num_draft == 0 for c in cycles[1 : 1 + run_length]) and len(calls) >= run_length
    assert cache.offset == len(cache.tokens) == cache.draft_offset + cache.pending_length
    follow = prompt + out + _prompt(5, seed=9)
    again, _ = run(model, draft, follow, max_tokens=30, prompt_cache=cache)
    assert again == reference(model, follow, 30)


def test_policy_state_saved_and_restored():
    policy = PolicyState()
    policy.warm, policy.plain_time, policy.draft_time, policy.plain_left, policy.run = True, 0.1, 0.3, 40, 32
    again = PolicyState.restored(policy.saved())
    # A carried pause is cut to one window: the new process times the drafter again soon.
    assert again.saved() == {**policy.saved(), "plain_left": again.window}
    # It goes on with its plain run at once; its next drafting cycle (the drafter's graphs
    # compile in a new process) is not timed.
    assert not again.drafts_next()
    again.plain_left = 0
    assert again.drafts_next()
    again.record(99.0, 1, drafted=True)
    assert again.window_cycles == 0 and again.draft_time == 0.3 and again.since_plain == 1
    again.record(0.2, 1, drafted=True)
    assert again.window_cycles == 1


def test_a_restored_states_cold_cycle_lengthens_the_plain_run_after_a_loss():
    # The untimed first drafting cycle of a new process (graphs compile) is still paid for: when
    # the probe loses, the plain run that follows covers it at probe_cost, so one-shot runs stay
    # within a few percent of plain decoding.
    def probe(cold_seconds):
        policy = PolicyState()
        policy.warm, policy.plain_time, policy.draft_time, policy.run = True, 0.1, 0.3, 256
        state = PolicyState.restored(policy.saved())
        state.plain_left = 0
        state.record(cold_seconds, 1, drafted=True)
        for _ in range(3):  # three cycles twice as slow settle a probe after a loss
            state.record(0.5, 1, drafted=True)
        return state.plain_left

    base = probe(0.1)  # a cold cycle no dearer than a plain step
    assert abs(base - 3 * 0.4 / (0.03 * 0.1)) <= 1  # the three losing cycles' extra 0.4 s each
    assert abs(probe(3.1) - (3 * 0.4 + 3.0) / (0.03 * 0.1)) <= 1  # and the cold cycle's extra 3 s
    # Values it cannot use are left fresh, never raised on.
    odd = PolicyState.restored({"plain_time": -1, "draft_time": "x", "plain_left": 10**9, "run": 3.5})
    assert odd.saved() == PolicyState().saved()


# Every field a saved policy state holds, and a value for each that no fresh state has (plain_left within the
# one window a restored pause is cut to): the file below is written from this list, not from the code's own,
# so a field the code stops saving or reading shows. Plus when it was saved (states too old are not trusted).
SAVED_FIELDS = {"plain_time": 0.0125, "draft_time": 0.0375, "plain_left": 6, "run": 32, "since_plain": 5}
SAVED_AT = 1.8e9


def test_every_saved_policy_field_round_trips_through_a_file(tmp_path):
    """A policy file written by a version of dflash-mlx (the fields above) is read back field by field, and
    a state holding those values writes exactly that file. (A field dropped from the save list fails it.)"""
    import json

    from dflash_mlx.tuning.policy import PolicyStore

    fresh = PolicyState()
    assert all(getattr(fresh, name) != value for name, value in SAVED_FIELDS.items())
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"key": {**SAVED_FIELDS, "saved_at": SAVED_AT}}))
    restored = PolicyStore(path).get("key", now=SAVED_AT + 60)
    assert {name: getattr(restored, name) for name in SAVED_FIELDS} == SAVED_FIELDS
    again = tmp_path / "again.json"
    PolicyStore(again).put("key", restored)
    written = json.loads(again.read_text())["key"]
    assert isinstance(written.pop("saved_at"), float) and written == SAVED_FIELDS


def test_the_policy_key_is_one_per_machine_pair_drafter_and_setup(pair_dirs):
    """The adaptive policy's saved verdict is kept per target, drafter and drafting setup: changing any one
    changes the key, the same three give the same key. (A key that ignores the setup, the drafter or the
    target fails it.)"""
    import copy

    from dflash_mlx import load
    from dflash_mlx.tuning.policy import policy_key

    model, draft, _ = load(pair_dirs["qwen3-tied"], pair_dirs["draft"])
    other_model = load(pair_dirs["llama"])[0]
    other_draft = copy.deepcopy(draft)
    other_draft.fc.weight = other_draft.fc.weight * 1.01
    setup = {"block_size": 16, "lookup": 1, "tree_budget": 0}
    key = policy_key(model, draft, setup)
    assert key == policy_key(model, draft, dict(setup))
    keys = {
        key,
        policy_key(model, draft, {**setup, "block_size": 8}),
        policy_key(model, draft, {**setup, "tree_budget": 16}),
        policy_key(model, other_draft, setup),
        policy_key(other_model, draft, setup),
    }
    assert len(keys) == 5


def test_policy_store_keeps_states_by_key(tmp_path):
    from dflash_mlx.tuning.policy import PolicyStore

    store = PolicyStore(tmp_path / "sub" / "policy.json")
    assert store.get("a").saved() == PolicyState().saved()  # nothing yet
    policy = PolicyState()
    policy.plain_time, policy.plain_left = 0.2, 7  # within one window: restored as it is
    store.put("a", policy)
    store.put("b", PolicyState())
    assert store.get("a").saved() == policy.saved() and store.get("b").saved() == PolicyState().saved()
    (tmp_path / "sub" / "policy.json").write_text("{not json")
    assert store.get("a").saved() == PolicyState().saved()  # unreadable: learn again
    store.put("a", policy)  # and it is rewritten whole
    assert store.get("a").saved() == policy.saved()
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["policy.json"]  # no partial file left
    # Saved timings decay: a state saved long ago, or with no time (an older file), starts afresh.
    assert store.get("a", now=time.time() + SAVED_MAX_AGE + 1).saved() == PolicyState().saved()
    assert store.get("a", now=time.time() + SAVED_MAX_AGE - 60).saved() == policy.saved()
    (tmp_path / "sub" / "policy.json").write_text(json.dumps({"a": policy.saved()}))
    assert store.get("a").saved() == PolicyState().saved()


def test_a_pause_says_why_and_counts_its_cycles():
    policy = PolicyState(window=2, probe=1)
    policy.record(1.0, 1, drafted=True)  # warm-up
    policy.record(0.1, 1, drafted=False)  # plain: 0.1 s a token
    policy.record(0.3, 1, drafted=True)
    policy.record(0.3, 1, drafted=True)  # a losing window
    assert policy.plain_left > 0 and policy.paused_why.startswith("drafting measured 3.3 tokens-per-sec in this run")
    for _ in range(policy.plain_left):
        policy.record(0.1, 1, drafted=False)
    assert policy.paused_cycles >= 2 and policy.paused_why is None


def test_dflash_generate_goes_on_from_the_last_run(pair_dirs, tmp_path, monkeypatch, capsys):
    # A one-shot run starts where the last run of the pair left off: here, inside a run of
    # plain cycles that an earlier run's losing windows set up, cut to one window before the
    # drafter is timed again.
    from dflash_mlx.base import store
    from dflash_mlx.tools.cli.generate import main
    from dflash_mlx.tuning.policy import PolicyStore

    monkeypatch.setattr(store, "default_cache_root", lambda: tmp_path)
    args = ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]),
            "--prompt", "t1 t2 t3", "--max-tokens", "30", "--block-size", "4", "--paused-lookup", "0"]  # fmt: skip
    main(args)
    store = PolicyStore(tmp_path / "policy.json")
    (key,) = store.read()
    first = capsys.readouterr().out
    saved = store.get(key)
    saved.plain_time, saved.draft_time, saved.plain_left, saved.run = 0.01, 0.05, 200, 256
    store.put(key, saved)
    main(args)
    second = capsys.readouterr().out
    assert second.split("==========")[1] == first.split("==========")[1]  # the same text
    # The saved run of plain cycles goes on for one window, and the stats say so and why.
    (line,) = [x for x in second.splitlines() if x.startswith("Drafter paused for ")]
    # (Drafting may lose again once timed, on a busy machine: the line then adds that pause's reason.)
    assert " cycles of this run: an earlier run measured drafting at 20.0 tokens-per-sec" in line, line
    # --adaptive false and --seed leave the state alone.
    kept = store.read()
    main([*args, "--adaptive", "false"])
    main([*args, "--seed", "3"])
    assert store.read() == kept


def test_paused_cycles_time_tokens_not_cycles():
    """A paused cycle that verified a looked-up draft gives two tokens in about a step's time: the
    paused rate is the running seconds over the running tokens (a mean of per-cycle rates would
    weigh a one-token miss like a two-token hit)."""
    state = PolicyState()
    state.record(1.0, 1, drafted=True)  # warm-up, not timed
    for tokens in (2, 1, 2, 1):
        state.record(1.0, tokens, drafted=False)
    seconds = tokens = 0.0
    for s, t in ((1.0, 2), (1.0, 1), (1.0, 2), (1.0, 1)):
        seconds, tokens = (s, t) if tokens == 0 else (0.75 * seconds + 0.25 * s, 0.75 * tokens + 0.25 * t)
    assert state.plain_time == pytest.approx(seconds / tokens) and state.plain_time < 0.7


class FakeLookup:
    """Proposes one draft while paused; records that it was asked, and the verdicts it heard."""

    tap_ids: list = []

    def __init__(self):
        self.asked = 0
        self.heard = 0

    def propose(self, last, n):
        self.asked += 1
        return Proposal(mx.zeros((1,), dtype=mx.uint32))

    def plain_next(self):
        return False

    def accept(self, num_kept, taps):
        self.heard += 1


def test_paused_cycles_ask_the_paused_proposer_never_the_drafter():
    clock = Clock()
    inner, lookup = FakeDrafter(), FakeLookup()
    policy = PolicyState(window=4, probe=2, max_run=16, probe_cost=math.inf, clock=clock)
    proposer = AdaptiveProposer(inner, policy, paused=lookup)
    drafted = []
    for _ in range(30):
        proposal = proposer.propose(0, 3)
        drafted.append(proposer.drafting)
        assert proposal.size == (3 if proposer.drafting else 1)
        assert not proposer.plain_next()  # a lookup's next cycle is not known to be plain
        clock.now += 3.0 if proposer.drafting else 1.0
        proposer.accept(0, None)
    assert len(inner.proposed) == sum(drafted) and lookup.asked == 30 - sum(drafted)
    assert lookup.heard == lookup.asked  # told the verdict of its own cycles only (it learns its chances)
    assert drafted[:3] == [True, False, False] and not all(drafted[3:])
    assert len(inner.kept) == 30  # the drafter hears of every cycle's kept positions (its taps)


def test_a_paused_drafter_lets_lookup_drafts_through_losslessly(qwen3_pair):
    """A drafter that always loses: after its verdict it is never asked again, the paused cycles
    verify at most one looked-up draft, some of them accepted, and the text is the target's own."""
    model, draft, tokenizer = qwen3_pair
    prompt = _prompt(7)
    ref = reference(model, prompt, 80)
    clock = Clock(step=1.0)
    drafter = CostlyDraft(draft, prompt + ref, clock, 3.0, wrong_every=1)
    passes = []
    real = drafter.propose
    drafter.propose = lambda *a, **k: passes.append(1) or real(*a, **k)
    policy = PolicyState(clock=clock)  # lookup 1, the default
    responses = list(stream_generate(model, drafter, tokenizer, prompt, block_size=4, max_tokens=60, policy=policy))
    assert [t for r in responses for t in r.tokens] == ref[:60]  # the tiny tokenizer has no stop token here
    judged = next(i for i, r in enumerate(responses) if r.draft_tps is not None)
    before = len(passes)
    after = responses[judged + 1 :]
    assert all(r.num_draft <= 1 for r in after) and len(passes) == before
    assert any(r.num_draft == 1 and r.acceptance_length == 2 for r in after)


def test_drafting_cycles_before_any_plain_one_settle_nothing():
    """A state that has only drafted (a server's rows drafting from their first cycle) has no plain time to
    compare with: slow drafting cycles are timed, not judged a loss (and nothing fails)."""
    state = PolicyState()
    for _ in range(2 * state.window):
        state.record(5.0, 1, drafted=True)
    assert state.plain_time is None and state.draft_time == 5.0 and state.paused_why is None
