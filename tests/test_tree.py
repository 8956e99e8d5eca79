"""Draft trees (DDTree): the tree builder against a brute-force oracle and the authors' own
builder, the verify pass against mlx-lm's greedy decoding on the dense targets, and bad input."""

import itertools
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import VOCAB
from helpers.decoding import run
from helpers.family import prompt_ids, reference
from helpers.oracles import AcceptExactlyDraft, ScriptedDraft, SecondChoiceDraft
from helpers.states import check_states_equal_a_plain_pass

from dflash_mlx import DFlashError, make_cache
from dflash_mlx.drafts.lookup import PromptLookup
from dflash_mlx.drafts.tree import build_tree, top_log_probs
from dflash_mlx.models.tree import DraftTree


def _random_logits(depth: int, vocab: int, seed: int) -> mx.array:
    return mx.random.normal((depth, vocab), key=mx.random.key(seed)) * 2.0


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root, in node order."""
    paths = [()]
    for i in range(1, tree.size + 1):
        paths.append(paths[tree.parents[i]] + (tree.tokens[i - 1],))
    return paths[1:]


def _brute_force(log_probs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The ``budget`` most likely continuations of every length, most likely first, by enumeration."""
    depth, vocab = log_probs.shape
    scored = []
    for d in range(1, depth + 1):
        for seq in itertools.product(range(vocab), repeat=d):
            scored.append((-sum(log_probs[i, t] for i, t in enumerate(seq)), seq))
    return [seq for _, seq in sorted(scored)[:budget]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 2, 5, 16, 40])
def test_tree_is_the_most_likely_continuations(seed, budget):
    """The nodes are the budget most likely continuations (a prefix-closed set, since a prefix is
    at least as likely), in order of probability, each under its own prefix."""
    depth, vocab = 3, 5
    logits = _random_logits(depth, vocab, seed)
    log_probs, ids = top_log_probs(logits, min(budget, vocab))
    tree = build_tree(log_probs, ids, budget)
    full = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert _paths(tree) == _brute_force(full, budget)
    assert tree.depths == [len(p) for p in _paths(tree)]
    assert all(tree.parents[i] < i for i in range(1, tree.size + 1))


def test_tree_edges():
    log_probs, ids = top_log_probs(_random_logits(4, 7, 0), 7)
    assert build_tree(log_probs, ids, 0).size == 0
    assert build_tree(log_probs, ids, 1).tokens == [ids[0][0]]
    # More budget than continuations: all of them.
    assert build_tree(log_probs[:2], ids[:2], 100).size == 7 + 49


def test_ancestor_mask_and_walk():
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 1, 3], depths=[1, 1, 2, 3])
    visible = tree.ancestors().tolist()
    assert visible[4] == [True, True, False, True, True]
    assert visible[2] == [True, False, True, False, False]
    # The target's token after each node (index 0: after the root).
    assert tree.walk([5, 7, 0, 8, 9]) == ([0, 1, 3, 4], 9)
    assert tree.walk([6, 0, 1, 0, 0]) == ([0, 2], 1)
    assert tree.walk([3, 7, 0, 8, 9]) == ([0], 3)


@pytest.mark.parametrize("seed", range(3))
def test_tree_equals_the_authors_builder(seed, monkeypatch):
    """Node tokens and parents equal those of ``build_ddtree_tree`` in the authors' ddtree.py."""
    ddtree = pytest.importorskip(
        "ddtree", reason="the authors' ddtree.py (github.com/liranringel/ddtree) is not on PyPI; put it on PYTHONPATH"
    )
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(ddtree, "cuda_time", time.perf_counter)  # its stage clock syncs CUDA
    logits = _random_logits(15, VOCAB, seed)
    for budget in (1, 4, 16, 64):
        tokens, _, parents, *_ = ddtree.build_ddtree_tree(torch.tensor(np.array(logits)), budget)
        ours = build_tree(*top_log_probs(logits, min(budget, VOCAB)), budget)
        assert ours.tokens == tokens.tolist() and ours.parents == parents, budget


@pytest.mark.parametrize("budget, prompt_len", [(1, 30), (4, 1), (16, 9), (64, 30)])
def test_greedy_equals_plain_decoding(varied_pair, budget, prompt_len):
    """A random drafter's trees, on every dense target kind (tied and untied Qwen3, Llama, Qwen2)."""
    model, draft, _ = varied_pair
    prompt = prompt_ids(prompt_len)
    ref = reference(model, prompt, 16)
    cache = make_cache(model, draft)
    out, cycles = run(model, draft, prompt, tree_budget=budget, max_tokens=16, prompt_cache=cache, adaptive=False)
    assert out == ref
    check_states_equal_a_plain_pass(model, cache, draft)
    assert cycles[1].num_draft == min(budget, 14)  # the nodes, up to the room left


@pytest.mark.parametrize("max_tokens", [17, 25])
def test_a_branching_tree_leaves_the_state_of_a_plain_pass(varied_pair, max_tokens):
    """After cycles whose accepted path is a second branch (its keys and values moved down over the first
    branch's), ended at a block's end or cut inside a path: every layer's keys, values and offset, and the
    drafter's context and pending taps, equal those of one plain pass over the committed tokens. (Keeping
    the first nodes' keys, a node masked to the node before it instead of its parent, nodes at consecutive
    positions, or the taps of the first nodes instead of the path's each fail it.)"""
    model, draft, _ = varied_pair
    prompt = prompt_ids(9)
    ref = reference(model, prompt, 40)
    oracle = SecondChoiceDraft(draft, prompt + ref, VOCAB)
    cache = make_cache(model, oracle)
    out, cycles = run(model, oracle, prompt, tree_budget=2 * (draft.block_size - 1), max_tokens=max_tokens,
                      prompt_cache=cache, adaptive=False)  # fmt: skip
    assert out == ref[:max_tokens] and cycles[1].num_accepted == draft.block_size - 1
    check_states_equal_a_plain_pass(model, cache, oracle)


def test_a_rollback_of_drafts_leaves_the_state_of_a_plain_pass(varied_pair):
    """A drafter right for exactly k drafts, k = 0..B-1 in turn (a rollback of every length): every
    layer's state and the drafter's context are those of one plain pass over the committed tokens."""
    model, draft, _ = varied_pair
    prompt = prompt_ids(7)
    ref = reference(model, prompt, 60)
    oracle = AcceptExactlyDraft(draft, prompt + ref, VOCAB, list(range(draft.block_size)))
    cache = make_cache(model, oracle)
    out, _ = run(model, oracle, prompt, max_tokens=60, prompt_cache=cache, adaptive=False)
    assert out == ref
    check_states_equal_a_plain_pass(model, cache, oracle)


def test_a_branch_is_accepted_where_the_path_is_not(varied_qwen3_pair):
    """The drafter's first choice at the first position is wrong and the right token second: the
    path keeps nothing, a tree with both branches keeps the whole block."""
    model, draft, _ = varied_qwen3_pair
    prompt = prompt_ids(9)
    ref = reference(model, prompt, 48)
    oracle = SecondChoiceDraft(draft, prompt + ref, VOCAB)
    _, path = run(model, oracle, prompt, max_tokens=48, adaptive=False)
    assert {c.num_accepted for c in path[1:]} == {0}
    out, tree = run(model, oracle, prompt, tree_budget=2 * (draft.block_size - 1), max_tokens=48, adaptive=False)
    assert out == ref
    assert [c.num_accepted for c in tree[1:-1]] == [draft.block_size - 1] * (len(tree) - 2)


def test_an_oracle_tree_keeps_the_block_and_the_taps_of_its_path(varied_qwen3_pair):
    """The target's own continuation as the top path: the tree keeps the whole block, and the
    drafter's context grows by exactly the kept positions."""
    model, draft, _ = varied_qwen3_pair
    prompt = prompt_ids(7)
    ref = reference(model, prompt, 40)
    oracle = ScriptedDraft(draft, prompt + ref, VOCAB)
    cache = make_cache(model, oracle)
    out, cycles = run(model, oracle, prompt, tree_budget=16, max_tokens=40, prompt_cache=cache, adaptive=False)
    assert out == ref
    assert [c.num_accepted for c in cycles[1:-1]] == [draft.block_size - 1] * (len(cycles) - 2)
    assert cache.draft_offset + cache.pending_length == len(cache.tokens)


@pytest.mark.parametrize("kwargs", [dict(lookup_fallback=4, adaptive=False), dict(adaptive=True)])
def test_trees_with_the_lookup_fallback_and_the_adaptive_policy(varied_qwen3_pair, kwargs):
    """Trees mixed with prompt-lookup paths and paused (plain) cycles: still mlx-lm's greedy tokens."""
    model, draft, _ = varied_qwen3_pair
    prompt = prompt_ids(9) * 2  # repeated text, for prompt lookup to find
    out, cycles = run(model, draft, prompt, tree_budget=8, max_tokens=30, **kwargs)
    assert out == reference(model, prompt, 30)


def test_repetition_penalty_sees_each_nodes_own_path(varied_pair):
    """Logits processors get each node's own preceding tokens: same tokens as plain decoding with the
    penalty, on targets where the penalty changes the output and with trees whose accepted paths are deep
    second branches. (Giving each node the cached tokens only, or the first branch's, fails it.)"""
    from mlx_lm.sample_utils import make_logits_processors

    model, draft, _ = varied_pair
    prompt = prompt_ids(9)
    kwargs = dict(max_tokens=40, adaptive=False)
    penalty = make_logits_processors(repetition_penalty=1.5, repetition_context_size=40)
    plain, _ = run(model, None, prompt, **kwargs, logits_processors=penalty)
    assert plain != run(model, None, prompt, **kwargs)[0]  # the penalty changes the text
    oracle = SecondChoiceDraft(draft, prompt + plain, VOCAB)
    budget = 2 * (draft.block_size - 1)  # both branches as deep as the block
    out, cycles = run(model, oracle, prompt, tree_budget=budget, **kwargs, logits_processors=penalty)
    assert out == plain
    assert max(c.num_accepted for c in cycles[1:]) >= 4  # deeper nodes than the first are accepted


def test_auto_budget_grows_where_branches_pay_and_shrinks_where_nothing_does(varied_qwen3_pair, monkeypatch):
    """tree_budget="auto": greedy output unchanged; a drafter whose right token is its second choice gets
    trees with both branches, a random one that is never right gets trees of a node or few."""
    from dflash_mlx.tuning import widths as verify_width

    # Pass costs as on a small CPU target (a node costs a few percent of a pass), not timed here: timings on
    # a busy machine would make the choice, and so this test, depend on the load.
    monkeypatch.setattr(
        verify_width,
        "measure",
        lambda model, draft, cache, tap_ids, widths, *a, **k: verify_width.PassCosts(
            0.01, {w: 0.05 * (1 + 0.05 * (w - 1)) for w in widths}
        ),
    )
    monkeypatch.setattr(verify_width.CostStore, "get", lambda self, key: None)  # nothing timed earlier either
    model, draft, _ = varied_qwen3_pair
    prompt = prompt_ids(9)
    ref = reference(model, prompt, 40)
    oracle = SecondChoiceDraft(draft, prompt + ref, VOCAB)
    out, cycles = run(model, oracle, prompt, tree_budget="auto", max_tokens=40, adaptive=False)
    assert out == ref and max(c.num_accepted for c in cycles[1:]) > 1
    out, cycles = run(model, draft, prompt, tree_budget="auto", max_tokens=40, adaptive=False)
    assert out == ref and cycles[-2].num_draft < cycles[1].num_draft


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree_budget=-1), "tree_budget must be a non-negative integer"),
        (dict(tree_budget=2.5), "tree_budget must be a non-negative integer"),
        (dict(tree_budget="big"), "or 'auto' \\(got 'big'\\)"),
        (dict(tree_budget=4, block_size="auto"), "leave block_size fixed"),
        (dict(tree_budget=4, min_confidence=0.5), "leave block_size fixed"),
    ],
)
def test_bad_tree_settings_are_one_line(varied_qwen3_pair, kwargs, message):
    model, draft, _ = varied_qwen3_pair
    with pytest.raises(DFlashError, match=message):
        run(model, draft, [1, 2, 3], max_tokens=4, **kwargs)


@pytest.mark.parametrize("draft", [None, PromptLookup(4)])
def test_a_tree_needs_a_dflash_drafter(varied_qwen3_pair, draft):
    with pytest.raises(DFlashError, match="builds trees from a DFlash drafter"):
        run(varied_qwen3_pair[0], draft, [1, 2, 3], max_tokens=4, tree_budget=4)


def test_tree_budget_zero_is_the_path(varied_qwen3_pair):
    model, draft, _ = varied_qwen3_pair
    prompt = prompt_ids(9)
    path = run(model, draft, prompt, max_tokens=20, adaptive=False)
    zero = run(model, draft, prompt, max_tokens=20, adaptive=False, tree_budget=0)
    assert path[0] == zero[0] and [c.num_draft for c in path[1]] == [c.num_draft for c in zero[1]]
