"""The checks every target family passes on its tiny exact-layout pair: DFlash's greedy output is
mlx-lm's own greedy decoding with a random drafter, through every rollback length, and across a
stop token inside a block. tests/test_families.py runs them on every family's pairs; each family's
own module runs the checks that are its alone (multi-turn reuse, its cache's rollback, its layouts)."""

import json

import mlx.core as mx

from dflash_mlx import make_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftArgs, DraftModel

from .checkpoints import VOCAB, draft_config
from .decoding import greedy, run
from .oracles import AcceptExactlyDraft, ScriptedDraft, SecondChoiceDraft
from .states import check_states_equal_a_plain_pass

MAX_REF = 64
SLIDING_SLACK = 16  # the largest rollback in these checks: a block of 16's rejected drafts, plus one


def small_sliding_caches(monkeypatch) -> None:
    """Sliding caches that drop old positions within these short runs (every 8 past the window and
    a slack of 16), so that the checks go through what long conversations do."""
    from dflash_mlx.models import sliding

    monkeypatch.setattr(sliding, "SLIDING_SLACK", SLIDING_SLACK)
    monkeypatch.setattr(sliding.SlidingKVCache, "step", 8)


def gemma_draft_config() -> dict:
    """A drafter config with the keys of z-lab's published Gemma 4 drafters (sliding layers, the
    target's softcap, rope_theta at the top level), at these tests' sizes."""
    config = draft_config(num_target_layers=4, layers=2, target_layer_ids=(1, 2))
    config.update(
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True,
        final_logit_softcapping=5.0, rope_scaling=None, tie_word_embeddings=True, attention_bias=False, dtype="float32",
    )  # fmt: skip
    return config


def oracle_for(oracle: type, draft, *args, **kwargs):
    """An oracle drafter (tests/helpers/oracles.py) on ``draft``'s own family (DFlare's, say), so that
    its real passes are that family's."""
    if type(draft) is not DraftModel:
        oracle = type(oracle.__name__, (oracle, type(draft)), {})
    return oracle(draft, *args, **kwargs)


def prompt_ids(length: int, seed: int = 3) -> list[int]:
    return mx.random.randint(0, VOCAB - 4, (length,), key=mx.random.key(seed)).tolist()


def reference(model, prompt: list[int], max_tokens: int = MAX_REF) -> list[int]:
    """mlx-lm's own greedy decoding, with the family's own caches."""
    return greedy(model, prompt, max_tokens)


def check_folded_taps(model) -> None:
    """The target's taps folded through a drafter's ``fc`` as each layer makes them (the
    prefill's way) equal ``fc`` of the concatenated taps, a repeated layer and the (normed)
    last layer among them."""
    last = tgt.num_layers(model) - 1
    tap_ids = [0, last, min(1, last), 0]
    config = draft_config(num_target_layers=tgt.num_layers(model), target_layer_ids=tap_ids)
    config["hidden_size"] = tgt.hidden_size(model)
    mx.random.seed(6)
    draft = DraftModel(DraftArgs.from_dict(config))
    tokens = mx.array([prompt_ids(13)])
    _, raw = tgt.forward_with_taps(model, tokens, make_cache(model).target, tap_ids)
    _, folded = tgt.forward_with_taps(model, tokens, make_cache(model).target, tap_ids, fold=draft.tap_blocks())
    expected = draft.fc(raw)
    assert folded.shape == expected.shape == (1, 13, tgt.hidden_size(model))
    assert (mx.abs(folded - expected).max() / mx.abs(expected).max()).item() < 1e-5


def check_lossless(model, draft, block_size: int, prompt_len: int) -> None:
    """A random drafter at every max_tokens that ends a block early, on time or late."""
    prompt = prompt_ids(prompt_len)
    ref = reference(model, prompt)
    for max_tokens in (1, block_size + 1, MAX_REF):
        out, _ = run(model, draft, prompt, block_size=block_size, max_tokens=max_tokens)
        assert out == ref[:max_tokens], (block_size, prompt_len, max_tokens)


def check_tree_lossless(model, draft, max_tokens: int = 16) -> None:
    """Draft trees of budgets 1, 4, 16 and 64 across prompt lengths, from a random drafter and (at the
    budgets that hold both branches) from one whose first choice at the first position is always
    wrong, so that the target follows a branch: mlx-lm's greedy tokens, and every layer's cache and the
    drafter's context what one plain pass over the committed tokens leaves (helpers/states.py)."""
    for budget, prompt_len in ((1, 1), (4, 9), (16, 30), (64, 9)):
        prompt = prompt_ids(prompt_len)
        ref = reference(model, prompt, max_tokens)
        drafters = [draft] + ([oracle_for(SecondChoiceDraft, draft, prompt + ref, VOCAB)] if budget >= 16 else [])
        for drafter in drafters:
            cache = make_cache(model, drafter)
            out, _ = run(model, drafter, prompt, tree_budget=budget, max_tokens=max_tokens, prompt_cache=cache,
                         adaptive=False)  # fmt: skip
            assert out == ref, (prompt_len, budget, type(drafter).__name__)
            check_states_equal_a_plain_pass(model, cache, drafter)
    # A stop token inside an accepted path (a second branch as deep as the block, cut a few tokens down it:
    # a recurrent state rolls back along that path), then the next turn through the same cache.
    prompt = prompt_ids(9)
    ref = reference(model, prompt, max_tokens)
    stop_index = next((i for i in range(3, max_tokens) if ref[i] not in ref[:i]), None)
    assert stop_index is not None, f"the target's text repeats itself: {ref}"
    branching = oracle_for(SecondChoiceDraft, draft, prompt + ref, VOCAB)
    cache = make_cache(model, branching)
    deep = 2 * (draft.block_size - 1)
    out, cycles = run(model, branching, prompt, tree_budget=deep, max_tokens=max_tokens,
                      stop_tokens={ref[stop_index]}, prompt_cache=cache, adaptive=False)  # fmt: skip
    assert out == ref[: stop_index + 1] and len(cycles) == 2  # the first cycle's path was cut
    check_states_equal_a_plain_pass(model, cache, branching)
    follow = prompt + out + prompt_ids(4, seed=9)
    branching.sequence = follow + reference(model, follow, max_tokens)
    again, _ = run(model, branching, follow, tree_budget=deep, max_tokens=max_tokens, prompt_cache=cache,
                   adaptive=False)  # fmt: skip
    assert again == reference(model, follow, max_tokens)
    check_states_equal_a_plain_pass(model, cache, branching)


def check_tree_past_the_sliding_buffer(model, draft, monkeypatch) -> None:
    """Draft trees once a sliding window's buffer has moved on from position 0 (its buffers made 4
    positions at a time, so that a short prompt gets there): the accepted path's keys are moved within the
    buffer as it now stands, every window what one plain pass leaves. (Counting the buffer's rows from
    position 0 fails it.)"""
    from dflash_mlx.models import sliding

    monkeypatch.setattr(sliding.SlidingKVCache, "step", 4)
    prompt = prompt_ids(40)
    ref = reference(model, prompt, 40)
    oracle = SecondChoiceDraft(draft, prompt + ref, VOCAB)
    cache = make_cache(model, oracle)
    out, cycles = run(model, oracle, prompt, tree_budget=2 * (draft.block_size - 1), max_tokens=40,
                      prompt_cache=cache, adaptive=False)  # fmt: skip
    assert out == ref and max(c.num_accepted for c in cycles[1:]) == draft.block_size - 1
    assert any(isinstance(c, sliding.SlidingKVCache) and c.start > 0 for c in cache.target)
    check_states_equal_a_plain_pass(model, cache, oracle)


def check_tree_with_draft_vocab(model, base, max_tokens: int = 33) -> None:
    """Trees from a drafter with a draft vocabulary (built among its vocabulary's indices, walked on token
    ids): an oracle over a subset (in an order not the ids' own) holding every token the target says keeps
    whole blocks down second branches, and a random drafter with a subset gives mlx-lm's tokens. (A tree
    left on the drafter's indices keeps nothing of the oracle's blocks, and emits an index as a token
    wherever one equals the target's token.)"""
    import copy

    def with_vocab(ids):
        draft = type(base)(copy.deepcopy(base.args))
        draft.update(base.parameters())
        draft.set_draft_vocab(mx.array(ids, dtype=mx.int32))
        return draft

    class SubsetSecondChoice(SecondChoiceDraft):
        def propose(self, *args, **kwargs):
            return super().propose(*args, **kwargs)[..., self.draft_vocab]

    for prompt_len in (1, 9, 30):
        prompt = prompt_ids(prompt_len)
        ref = reference(model, prompt, max_tokens)
        every_fourth = list(range(0, VOCAB, 4))[::-1]
        out, _ = run(model, with_vocab(every_fourth), prompt, tree_budget=16, max_tokens=max_tokens, adaptive=False)
        assert out == ref, prompt_len
    said = sorted(set(ref), reverse=True)
    ids = said + [t for t in range(VOCAB) if t not in said][: 64 - len(said)]
    oracle = SubsetSecondChoice(with_vocab(ids), prompt + ref, VOCAB)
    budget = 2 * (base.block_size - 1)
    out, cycles = run(model, oracle, prompt, tree_budget=budget, max_tokens=max_tokens, adaptive=False)
    assert out == ref
    assert [c.num_accepted for c in cycles[1:3]] == [base.block_size - 1] * 2


def check_every_acceptance_length(model, draft, block_size: int) -> None:
    """A drafter right for exactly k drafts, k = 0..B-1 in turn: the target keeps exactly k, and
    every layer's cache (and the drafter's context) is what one plain pass over the committed tokens
    leaves, after every rollback length (helpers/states.py)."""
    prompt = prompt_ids(7)
    ref = reference(model, prompt, 200)
    schedule = list(range(block_size))
    oracle = oracle_for(AcceptExactlyDraft, draft, prompt + ref, VOCAB, schedule)
    cache = make_cache(model, oracle)
    # adaptive=False: the adaptive policy's plain cycles follow wall-clock timings.
    out, cycles = run(model, oracle, prompt, block_size=block_size, max_tokens=200, prompt_cache=cache,
                      adaptive=False)  # fmt: skip
    assert out == ref
    drafted = [s for s in cycles[1:] if s.num_draft == block_size - 1]
    assert [s.num_accepted for s in drafted][: 2 * block_size] == (schedule * 2)[: len(drafted[: 2 * block_size])]
    assert len(drafted) >= block_size
    check_states_equal_a_plain_pass(model, cache, oracle)


def check_stop_mid_block_then_continue(model, draft, prompt_len: int = 7, with_plain: bool = False) -> None:
    """A stop token inside a block ends the reply there; the next turn goes on from that cache
    (``with_plain``: plain decoding's too)."""
    # A prompt whose continuation has a new token past the first few, to stop on.
    for seed in range(3, 40):
        prompt = prompt_ids(prompt_len, seed=seed)
        ref = reference(model, prompt)
        stop_index = next((i for i in range(5, 30) if ref[i] not in ref[:i]), None)
        if stop_index is not None:
            break
    stop = {ref[stop_index]}
    oracle = oracle_for(ScriptedDraft, draft, prompt + ref, VOCAB)
    for block_size in (4, 16):
        for drafter in (oracle, draft, None) if with_plain else (oracle, draft):
            size = block_size if drafter is not None else 1
            cache = make_cache(model, drafter)
            out, _ = run(model, drafter, prompt, block_size=size, max_tokens=MAX_REF, stop_tokens=stop,
                         prompt_cache=cache)  # fmt: skip
            assert out == ref[: stop_index + 1]
            assert cache.offset == len(cache.tokens) == len(prompt) + stop_index
            follow = prompt + out + prompt_ids(4, seed=9)
            again, _ = run(model, drafter, follow, block_size=size, max_tokens=30, prompt_cache=cache)
            assert again == reference(model, follow, 30)


def two_turns(model, draft):
    """A conversation's first two turns through one prompt cache, the second extending the first
    (everything cached is reused), each mlx-lm's own decoding. Returns ``(cache, oracle, prompt,
    follow, second)`` for the family's own later turns: ``follow`` is the second turn's prompt,
    ``second`` its answer, ``oracle`` a scripted drafter (wrong every third draft)."""
    oracle = oracle_for(ScriptedDraft, draft, [], VOCAB, wrong_every=3)  # its script is set per turn
    prompt = prompt_ids(20)
    cache = make_cache(model, oracle)
    oracle.sequence = prompt + reference(model, prompt)
    first, _ = run(model, oracle, prompt, max_tokens=30, prompt_cache=cache)
    follow = prompt + first + prompt_ids(5, seed=9)
    assert cache.reusable_prefix(follow) == len(prompt) + len(first) - 1 and cache.reuse_note is None
    oracle.sequence = follow + reference(model, follow, 40)
    second = check_turn(model, oracle, cache, follow, 40)
    return cache, oracle, prompt, follow, second


def check_turn(model, drafter, cache, ids: list[int], max_tokens: int = 30) -> list[int]:
    """One more turn through ``cache``: mlx-lm's own decoding of ``ids``, whatever was reused."""
    out, _ = run(model, drafter, ids, max_tokens=max_tokens, prompt_cache=cache)
    assert out == reference(model, ids, max_tokens)
    return out


def check_leaving_early(model, draft, cache, prompt: list[int]) -> None:
    """A prompt that leaves the conversation early: nothing saved before it, prefilled whole."""
    other = prompt[:5] + prompt_ids(9, seed=13)
    assert cache.reusable_prefix(other) == 0 and "reused 0 of 5" in cache.reuse_note
    check_turn(model, draft, cache, other)


def check_greedy_matches_transformers(model, hf, prompt: list[int], max_tokens: int = 24) -> None:
    """mlx-lm's greedy decoding of the converted target equals transformers' of the checkpoint."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: token 0 is also the pad token
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert reference(model, prompt, max_tokens) == out[0, len(prompt) :].tolist()


# Seeds whose greedy text is varied (helpers/varied.py; qwen3_5_moe's seed 0 says one token 32 times after
# one of the check prompts, kimi_k25's one 6 times in a row); every other kind's seed 0 is.
HF_SEEDS = {"qwen3_5_moe": 1, "kimi_k25": 1}


def write_targets(root, kinds, draft: dict | None = None) -> dict:
    """``{kind: (folder, transformers model)}`` for tiny targets written by transformers in their published
    layouts, and a drafter folder (with config ``draft``, if given) under ``"draft"``."""
    from .checkpoints import write_draft
    from .hf_checkpoints import write_hf_target

    out = {kind: (root / kind, write_hf_target(root / kind, kind, seed=HF_SEEDS.get(kind, 0))) for kind in kinds}
    write_draft(root / "draft")
    if draft is not None:
        (root / "draft" / "config.json").write_text(json.dumps(draft))
    out["draft"] = (root / "draft", None)
    return out


def write_pair_folders(root, kind: str):
    """``(target folder, transformers model, drafter folder)``: a tiny target of ``kind`` written by
    transformers in its published layout, and a drafter for it."""
    from .checkpoints import write_draft
    from .hf_checkpoints import write_hf_target

    hf = write_hf_target(root / "target", kind, seed=HF_SEEDS.get(kind, 0))
    write_draft(root / "draft")
    return root / "target", hf, root / "draft"
