"""Draft trees from the target's own text: the datastore's frequent continuations and prompt lookup's,
merged and verified in one pass; lossless greedy on every target family and exact when sampled."""

import random

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import VOCAB, write_target
from helpers.decoding import greedy, run
from helpers.policy import Clock

from dflash_mlx import load
from dflash_mlx.drafts.datastore import Datastore, SuffixIndex
from dflash_mlx.drafts.free import FreeDrafts
from dflash_mlx.drafts.text_tree import SourcePath, TextTree, choose_size
from dflash_mlx.loop.verify import Verifier
from dflash_mlx.models.tree import DraftTree
from dflash_mlx.sampling import make_sampler
from dflash_mlx.tuning.policy import FreeStats, PolicyState


def _store(documents, **settings):
    return Datastore(SuffixIndex.build(documents, 20), 20, **{"min_count": 1, "min_step": 0.1, **settings})


def test_branches_are_the_most_frequent_continuations_best_first():
    # After [1, 2]: 3 four times in six (then 4 three times, 5 once), 6 twice (then 7).
    docs = [[1, 2, 3, 4]] * 3 + [[1, 2, 3, 5], [1, 2, 6, 7], [1, 2, 6, 7]]
    store = _store(docs, min_path=0.05)
    match, branches = store.branches([9, 1, 2], nodes=10, depth=3)
    assert match == 2
    nodes = [(b.parent, b.token, round(b.share, 3)) for b in branches]
    # Path chances 4/6, 4/6 * 3/4 = 1/2, 2/6, 2/6 * 1 = 1/3 (after its parent), 4/6 * 1/4 = 1/6.
    assert nodes == [(0, 3, 0.667), (1, 4, 0.75), (0, 6, 0.333), (3, 7, 1.0), (1, 5, 0.25)]
    # Its first children are draft()'s path.
    assert store.draft([9, 1, 2], 3).tokens == [3, 4]
    assert [b.token for b in store.branches([9, 1, 2], nodes=2, depth=3)[1]] == [3, 4]
    assert store.branches([9, 1, 2], nodes=10, depth=1)[1] == branches[:1] + branches[2:3]
    assert store.branches([9, 8], nodes=4, depth=3) == (0, [])


def test_sources_merge_into_one_tree_best_first():
    tree = TextTree()
    tree.add_path(SourcePath("lookup 2 agree", [3, 4, 9], [0.9, 0.5, 0.5]))
    tree.add_branches([(0, 3, 0.6), (1, 4, 0.8), (0, 6, 0.3), (2, 8, 0.5)])
    nodes, chances = tree.best_first(10)
    # 3 (0.9, the larger of its two sources), 4 (max(0.45, 0.48)), 6, 9 (0.225), 8 (0.24).
    assert nodes.tokens == [3, 4, 6, 8, 9]
    assert nodes.parents == [-1, 0, 1, 0, 2, 2]
    assert chances == pytest.approx([0.9, 0.48, 0.3, 0.24, 0.225])
    first = tree.best_first(3)[0]
    assert first.tokens == [3, 4, 6] and first.parents == [-1, 0, 1, 0]


def test_the_trees_size_is_the_most_tokens_per_step():
    stats = FreeStats(first=0.1, each=0.1, tree_extra=0.5)
    chain = DraftTree([1, 2, 3], [-1, 0, 1, 2], [1, 2, 3])
    # 1.9 / 1.1, 2.7 / 1.2, 2.8 / 1.3: two, as one path.
    assert choose_size(chain, [0.9, 0.8, 0.1], stats)[::2] == (2, True)
    star = DraftTree([1, 2, 3], [-1, 0, 0, 0], [1, 1, 1])
    # A second sibling costs a tree pass: 1.8 / 1.7 is less than 1.5 / 1.1.
    assert choose_size(star, [0.5, 0.3, 0.1], stats)[::2] == (1, True)
    stats.tree_extra = 0.0
    assert choose_size(star, [0.5, 0.3, 0.1], stats)[::2] == (2, False)
    assert choose_size(star, [0.01, 0.01, 0.01], stats)[0] == 0  # nothing pays: a plain step


def test_a_tree_cycle_teaches_each_source_and_the_tree_cost():
    history = [1]
    store = _store([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 6, 7], [1, 2, 6, 7]])
    stats = FreeStats(first=0.0, each=0.0, tree_extra=0.0)
    stats.timed(1.0, 0)  # a plain step: one second on this clock, as every cycle
    free = FreeDrafts(history, store, 4, stats, clock=Clock(step=1.0))
    proposal = free.propose(2, 4)
    assert proposal.source == "datastore" and proposal.tree.parents == [-1, 0, 0, 1, 2]
    assert proposal.tokens.tolist() == [3, 6, 4, 7]
    history.extend([2, 6])  # the loop commits the root and the accepted 6 (the target's token after it is next)
    free.accept(1, None)
    # The datastore's own path was [3, 4]: its first draft judged wrong (0 right where 0.5 was expected).
    assert stats.trust["datastore 2"] == [4.0, 4.5]
    assert stats.tree_sizes[4] == (1.0, 0.0)  # a tree of 4 nodes cost what a plain step does here


def _count_tree_passes(monkeypatch) -> list[int]:
    sizes = []
    verify_tree = Verifier._verify_tree

    def counted(self, last, proposal):
        sizes.append(proposal.size)
        return verify_tree(self, last, proposal)

    monkeypatch.setattr(Verifier, "_verify_tree", counted)
    return sizes


def _tree_policy() -> PolicyState:
    # Every cycle costs the same on this clock, so any tree that adds expected tokens is verified.
    policy = PolicyState(clock=Clock(step=1.0))
    policy.free.tree_extra = 0.0
    return policy


def _prompt(length, seed):
    return mx.random.randint(0, VOCAB - 4, (length,), key=mx.random.key(seed)).tolist()


def _store_of(documents) -> Datastore:
    return Datastore(SuffixIndex.build(documents, VOCAB), VOCAB, min_count=1, min_step=0.01, min_path=0.001)


def _branchy_store(model, prompts):
    """The target's own greedy text and copies of it with a fifth of their tokens changed at random:
    rare continuations beside the frequent ones, kept as branches (every share of 1% or more)."""
    texts = [p + greedy(model, p, 60) for p in prompts]
    rng = random.Random(0)
    changed = [[t if rng.random() > 0.2 else rng.randrange(VOCAB) for t in text] for text in texts * 3]
    return _store_of(texts + changed)


@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_text_trees_equal_plain_decoding(tiny_pair, block_size, monkeypatch):
    model, _, _ = tiny_pair
    prompts = [_prompt(7, 3), _prompt(20, 4)]
    store = _branchy_store(model, prompts)
    sizes = _count_tree_passes(monkeypatch)
    for prompt in prompts + [_prompt(1, 5)]:
        ref = greedy(model, prompt, 60)
        out, _ = run(model, None, prompt, block_size=block_size, max_tokens=60, datastore=store, policy=_tree_policy())
        assert out == ref, (block_size, len(prompt))
    assert sizes and max(sizes) > 1


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_moe"])
def test_greedy_text_trees_on_hybrid_and_moe_targets(tmp_path, kind, monkeypatch):
    """A hybrid target's recurrent layers follow each node's path and keep the accepted one; MoE routes per node."""
    pytest.importorskip("torch")
    from helpers.hf_checkpoints import write_hf_target

    write_hf_target(tmp_path, kind)
    model, _, _ = load(tmp_path)
    prompts = [_prompt(7, 3), _prompt(20, 4)]
    store = _branchy_store(model, prompts)
    sizes = _count_tree_passes(monkeypatch)
    for prompt in prompts:
        out, _ = run(model, None, prompt, block_size=8, max_tokens=40, datastore=store, policy=_tree_policy())
        assert out == greedy(model, prompt, 40), (kind, len(prompt))
    assert sizes and max(sizes) > 1


def test_text_trees_in_the_drafters_paused_cycles(qwen3_pair, monkeypatch):
    """The tools' defaults: the drafter paced by the adaptive policy, its paused cycles verifying trees."""
    model, draft, _ = qwen3_pair
    prompts = [_prompt(7, 3), _prompt(20, 4)]
    store = _branchy_store(model, prompts)
    sizes = _count_tree_passes(monkeypatch)
    policy = PolicyState.restored({"plain_time": 0.01, "plain_left": 40})
    policy.free.tree_extra = 0.0
    for prompt in prompts:
        out, _ = run(model, draft, prompt, max_tokens=60, datastore=store, policy=policy)
        assert out == greedy(model, prompt, 60)
    assert sizes


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory, pair_dirs):
    """test_sampling's target, whose samples have real choices."""
    folder = tmp_path_factory.mktemp("text-trees") / "target"
    write_target(folder, embed_scale=0.2)
    return load(folder, pair_dirs["draft"])


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_text_trees_keep_the_targets_distribution(sampling_pair, monkeypatch, broken):
    """A datastore that continues the prompt with the target's likeliest first tokens, each followed by
    likely second and third ones (the likeliest second one left out, so that the first child is not the
    target's usual choice): two-level trees verified, the target's marginals. Negative control: a walk
    that follows the last child whatever the target drew."""
    from test_sampling import CONTROL_RUNS, DEPTH, PROMPT, RUNS, TEMP, _exact_marginals, _tokens, _tv, _tv_bound

    model = sampling_pair[0]
    exact = _exact_marginals(model)
    firsts, seconds, thirds = (
        np.argsort(-p)[ranks].tolist() for p, ranks in zip(exact, ([0, 1, 2, 3], [1, 2, 3], [0, 1]))
    )
    store = _store_of([PROMPT + [a, b, c] for a in firsts for b in seconds for c in thirds])
    if broken:

        def last_child(tree, target_tokens):
            path = [0]
            while tree.children[path[-1]]:
                path.append(max(tree.children[path[-1]].values()))
            return path, target_tokens[path[-1]]

        monkeypatch.setattr(DraftTree, "walk", last_child)
    sizes = _count_tree_passes(monkeypatch)
    runs = CONTROL_RUNS // 2 if broken else RUNS
    counts = np.zeros((DEPTH, VOCAB))
    for seed in range(runs):
        out = _tokens(model, None, sampler=make_sampler(TEMP), seed=seed, block_size=DEPTH, max_tokens=DEPTH,
                      datastore=store, policy=_tree_policy())  # fmt: skip
        for pos, tok in enumerate(out):
            counts[pos, tok] += 1
    excess = [_tv(counts[p], exact[p]) - _tv_bound(exact[p], runs) for p in range(DEPTH)]
    assert (max(excess) > 0) == broken, excess
    assert len(sizes) > runs // 2 and max(sizes) > 4  # trees in most runs, two levels deep
