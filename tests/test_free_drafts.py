"""Draft-free cycles verify as many of prompt lookup's or the datastore's drafts as pay."""

import pytest

from dflash_mlx.drafts.datastore import Datastore, SuffixIndex
from dflash_mlx.drafts.free import FreeDrafts
from dflash_mlx.drafts.text_tree import TextTree
from dflash_mlx.tuning.policy import FreeStats


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_number_of_drafts_is_the_most_tokens_per_step():
    stats = FreeStats(first=0.2, each=0.1)
    assert stats.best([0.1, 0.9]) == (0, 1.0)  # 1.1 tokens for 1.2 steps, 1.19 for 1.3: a plain step
    k, rate = stats.best([0.9, 0.9, 0.1, 0.9])
    # 1.9/1.2, 2.71/1.3, 2.791/1.4, 2.8639/1.5: two drafts
    assert k == 2 and rate == pytest.approx(2.71 / 1.3)
    assert stats.best([1.0] * 7)[0] == 7


def test_chances_are_learned_per_kind_and_position():
    stats = FreeStats()
    assert stats.chances("lookup 1", 2) == [0.5, 0.5]  # the prior
    for _ in range(8):
        stats.judged("lookup 1", 0, [0.5, 0.5], None)  # the first draft wrong: the second never judged
    first, second = stats.chances("lookup 1", 2)
    assert first == pytest.approx(1 / 10) and second == 0.5
    assert stats.chances("lookup 3", 1) == [0.5]  # another match length, another kind
    # The datastore's shares, scaled by how often its drafts were right against their shares.
    for _ in range(4):
        stats.judged("datastore 4", 1, [0.8, 0.8], [0.8, 0.8])  # 1 right where 1.6 were expected
    assert stats.chances("datastore 4", 2, [0.8, 0.5]) == pytest.approx([0.8 * 8 / 10.4, 0.5 * 8 / 10.4])


def test_cycle_times_set_the_first_drafts_cost_and_each_further_ones():
    stats = FreeStats(first=0.15, each=0.06, prior=4.0)
    stats.timed(2.0, 3)  # no plain step timed yet: nothing to compare with
    assert (stats.first, stats.each) == (0.15, 0.06)
    stats.timed(1.0, 0)
    # This machine: 0.3 of a step for the first draft, 0.15 for each further one (a verify pass on a CPU
    # that is not bound by memory alone), cycles of 1 to 6 drafts.
    for i in range(60):
        k = 1 + i % 6
        stats.timed(1.0 + 0.3 + 0.15 * (k - 1), k)
    assert stats.first == pytest.approx(0.3, abs=0.02) and stats.each == pytest.approx(0.15, abs=0.01)
    # Cycles of one size only say nothing of the slope: the starting one holds it, the level follows the data.
    stats = FreeStats(first=0.15, each=0.06, prior=4.0)
    stats.timed(1.0, 0)
    for _ in range(60):
        stats.timed(1.0 + 0.5, 2)
    assert stats.each == pytest.approx(0.06, abs=0.03) and 1 + stats.first + stats.each == pytest.approx(1.5, abs=0.05)


def test_each_size_learns_its_own_cost_where_the_line_misses_a_step():
    # MKL on the default pair: 1 to 4 drafts cost 0.09, 0.20, 0.50 and 0.50 of a plain step more.
    measured = {1: 0.09, 2: 0.20, 3: 0.50, 4: 0.50}
    stats = FreeStats(first=0.15, each=0.06, prior=4.0)
    stats.timed(1.0, 0)
    for i in range(80):
        k = 1 + i % 4
        stats.timed(1.0 + measured[k], k)
    for k, extra in measured.items():
        assert stats.cost(k) == pytest.approx(1.0 + extra, abs=0.03)
    # The line alone would take a third draft here (2.30 tokens a step against 2.19 for two); its real cost says two.
    line = 1 + stats.first + 2 * stats.each
    assert 3.196 / line > 2.71 / (1 + stats.first + stats.each)
    assert stats.best([0.9, 0.9, 0.6])[0] == 2
    # A size never run costs what the line says.
    assert stats.cost(6) == pytest.approx(1 + stats.first + 5 * stats.each)


def test_cost_estimates_follow_a_change_in_machine_speed():
    """Cycle costs from a slow spell, then from a faster machine: the estimates follow the new cycles
    (recent cycles weigh most). (Weighing every cycle ever timed alike keeps them halfway: fails.)"""
    stats = FreeStats(first=0.15, each=0.06, prior=4.0)
    stats.timed(1.0, 0)
    for i in range(400):
        k = 1 + i % 4
        stats.timed(1.0 + 0.6 + 0.2 * (k - 1), k)
    assert [stats.cost(k) for k in (1, 2, 3, 4)] == pytest.approx([1.6, 1.8, 2.0, 2.2], abs=0.02)
    for i in range(600):
        k = 1 + i % 4
        stats.timed(1.0 + 0.1 + 0.05 * (k - 1), k)
    assert [stats.cost(k) for k in (1, 2, 3, 4)] == pytest.approx([1.1, 1.15, 1.2, 1.25], abs=0.05)
    assert stats.first == pytest.approx(0.1, abs=0.02) and stats.each == pytest.approx(0.05, abs=0.02)


@pytest.mark.parametrize("datastore_trust, chosen", [((4.0, 4.0), "datastore"), ((1.6, 4.0), "lookup")])
def test_of_two_offers_the_one_that_gives_more_tokens_a_step_is_verified(datastore_trust, chosen):
    """Prompt lookup and the datastore both offer drafts, each worth verifying; the better one is verified
    whichever comes first. (Taking the last offer that beats a plain step, or the first, fails one case.)"""
    store = Datastore(SuffixIndex.build([[1, 2, 7, 8, 9, 5, 6]] * 4, 10), 10)
    stats = FreeStats()
    stats.trust["datastore 2"] = list(datastore_trust)  # its drafts right as often as its shares say, or 0.4 of it
    history = [1, 2, 3, 4, 0, 1]  # then 2: lookup finds "3 4 0 1 2" after "1 2", the datastore "7 8 9 5 6"
    # One path a cycle (no tree of both): the choice between them.
    drafts = FreeDrafts(history, store, 4, stats, clock=Clock(), tree_nodes=0)
    offers = {p.kind.split()[0]: stats.best(p.chances) for p in drafts._sources(history + [2], 4, TextTree())}
    assert set(offers) == {"lookup", "datastore"} and all(k > 0 and rate > 1.0 for k, rate in offers.values())
    proposal = drafts.propose(2, 4)
    assert proposal.source == chosen
    assert proposal.tokens.tolist() == {"lookup": [3, 4, 0, 1], "datastore": [7, 8, 9, 5]}[chosen][: proposal.size]


def test_free_drafts_query_the_text_up_to_the_last_committed_token():
    """The datastore's drafts follow ``history + [last]``. (Querying without ``last`` drafts "7 8" here.)"""
    store = Datastore(SuffixIndex.build([[4, 5, 6, 7, 8, 9], [3, 5, 6, 7, 1, 2, 0]] * 2, 10), 10, min_step=0.0)
    drafts = FreeDrafts([3, 5, 6], store, 4, FreeStats(), clock=Clock())
    assert drafts.propose(7, 4).tokens.tolist() == [1, 2, 0]


def test_a_source_that_keeps_missing_gives_way_to_plain_steps():
    text = [1, 2, 3, 9, 9, 1]  # and then 2: lookup finds [3, ...] after [1, 2]; the target never agrees
    clock = Clock()
    drafts = FreeDrafts(text, None, 4, FreeStats(), clock=clock)
    sizes = []
    for _ in range(12):
        proposal = drafts.propose(2, 4)
        sizes.append(proposal.size)
        clock.now += 1.0
        drafts.accept(0, None)
    assert sizes[0] > 0 and sizes[-1] == 0 and proposal.source == ""


def test_costly_drafting_cycles_shorten_the_drafts():
    store = Datastore(SuffixIndex.build([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, 10), 10)
    clock = Clock()
    stats = FreeStats(first=0.1, each=0.1)
    drafts = FreeDrafts([0, 1], store, 6, stats, clock=clock)
    assert drafts.propose(2, 6).tokens.tolist() == [3, 4, 5, 6, 7, 8]  # certain, and cheap
    stats.each = 0.6  # each further draft costs more than its chance of a token is worth
    assert drafts.propose(2, 6).size == 1
    stats.first = 6.0  # a verify costs more than the drafts can give
    assert drafts.propose(2, 6).size == 0


@pytest.mark.parametrize("with_drafter", [False, True])
def test_what_draft_free_cycles_learn_is_kept_with_the_policy_given(qwen3_pair, with_drafter):
    """A chat or server passes its pair's policy state to every call, each with a fresh cache: the
    draft-free cycles' chances and costs must land in that state, not in the cache's own."""
    from helpers.checkpoints import VOCAB
    from helpers.decoding import greedy, run

    from dflash_mlx.tuning.policy import PolicyState

    model, draft, _ = qwen3_pair
    prompt = [3, 17, 42, 8, 99]
    ref = greedy(model, prompt, 40)
    store = Datastore(SuffixIndex.build([ref], VOCAB), VOCAB, min_count=1)
    policy = PolicyState.restored({"plain_time": 0.01}) if with_drafter else PolicyState()
    out, _ = run(model, draft if with_drafter else None, prompt, max_tokens=len(ref), datastore=store, policy=policy)
    assert out == ref
    assert policy.free.trust  # the datastore's drafts were judged into it
