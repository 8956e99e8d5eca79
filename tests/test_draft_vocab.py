"""Drafters with a draft vocabulary (FR-Spec): they draft among a subset of token ids, the target
verifies over all of them, so the output is the target's own."""

import copy
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import family
from helpers.checkpoints import HIDDEN, VOCAB
from helpers.decoding import greedy, run
from helpers.oracles import ScriptedDraft

from dflash_mlx import DFlashError, load
from dflash_mlx.loading.draft_loader import load_draft
from dflash_mlx.loading.folders import read_config
from dflash_mlx.loop import verify
from dflash_mlx.loop.cache import make_draft_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftModel, save_draft
from dflash_mlx.sampling import make_sampler

MAX_REF = 64
# Every fourth id, in an order that is not the ids' own: an index mixed up with its id shows.
SUBSET = list(range(0, VOCAB, 4))[::-1]


def _prompt(length: int, seed: int = 3) -> list[int]:
    return mx.random.randint(0, VOCAB - 4, (length,), key=mx.random.key(seed)).tolist()


def _reference(model, prompt: list[int], max_tokens: int = MAX_REF) -> list[int]:
    return greedy(model, prompt, max_tokens)


def _with_vocab(base: DraftModel, ids: list[int]) -> DraftModel:
    """``base``'s weights, drafting among ``ids``."""
    draft = DraftModel(copy.deepcopy(base.args))
    draft.update(base.parameters())
    draft.set_draft_vocab(mx.array(ids, dtype=mx.int32))
    return draft


class MaskedDraft(DraftModel):
    """The full-vocabulary drafter with every id outside ``ids`` at -inf: what a draft vocabulary means."""

    def __init__(self, base: DraftModel, ids: list[int]):
        super().__init__(base.args)
        self.update(base.parameters())
        self.inside = mx.zeros((VOCAB,), dtype=mx.bool_).at[mx.array(ids)].add(True)

    def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
        logits = super().propose(model, block, taps, cache, speedups, num_drafts)
        return mx.where(self.inside, logits, -mx.inf)


class SubsetOracle(ScriptedDraft):
    """ScriptedDraft's one-hot logits (the target's own continuation), given over its draft vocabulary."""

    def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
        return super().propose(model, block, taps, cache, speedups, num_drafts)[..., self.draft_vocab]


@pytest.mark.parametrize("name", ["qwen3-tied", "qwen3-untied"])
@pytest.mark.parametrize("quantized", [False, True])
def test_head_rows_are_the_heads_columns(pair_dirs, name, quantized):
    model, _, _ = load(pair_dirs[name], dtype="float32")
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    h = mx.random.normal((3, HIDDEN))
    ids = mx.array([5, 0, 127, 64, 6])
    assert mx.allclose(h @ tgt.head_rows(model, ids).T, tgt.lm_head(model, h)[:, ids], atol=1e-4)


def test_saved_draft_vocab_reloads_and_drafts_the_masked_argmax(pair_dirs, tmp_path, monkeypatch):
    model, full, _ = load(pair_dirs["qwen3-tied"], pair_dirs["draft"], dtype="float32")
    assert full.draft_vocab is None  # a z-lab layout drafter drafts over the whole vocabulary
    save_draft(_with_vocab(full, SUBSET), read_config(pair_dirs["draft"], "drafter"), tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == len(SUBSET)
    _, draft, _ = load(pair_dirs["qwen3-tied"], tmp_path / "d", dtype="float32")
    assert draft.draft_vocab.dtype == mx.int32 and draft.draft_vocab.tolist() == SUBSET
    # One pass: the logits over the subset are the full logits' columns of its ids.
    ids = mx.random.randint(0, VOCAB - 4, (1, 30))
    _, taps = tgt.forward_with_taps(model, ids, [None] * 4, draft.target_layer_ids)
    block = mx.array([[ids[0, 20].item()] + [draft.mask_token_id] * (draft.block_size - 1)])
    sub = draft.propose(model, block, taps[:, :20], make_draft_cache(draft))[0]
    whole = full.propose(model, block, taps[:, :20], make_draft_cache(full))[0]
    assert sub.shape == (draft.block_size - 1, len(SUBSET))
    assert mx.allclose(sub, whole[:, mx.array(SUBSET)], atol=1e-5)
    # The whole loop: each cycle verifies the same drafts as the masked full-vocabulary drafter,
    # cut where its probabilities (over the subset) fall below min_confidence.
    seen = []
    real_verify = verify.Verifier.verify

    def spy(self, last, proposal, **kwargs):
        seen.append(proposal.tokens.tolist())
        return real_verify(self, last, proposal, **kwargs)

    monkeypatch.setattr(verify.Verifier, "verify", spy)
    masked = MaskedDraft(full, SUBSET)
    prompt = _prompt(7)
    runs = {}
    for name, drafter in (("subset", draft), ("masked", masked)):
        seen.clear()
        out, _ = run(model, drafter, prompt, max_tokens=60, min_confidence=0.45, adaptive=False)
        runs[name] = (out, [list(s) for s in seen])
    assert runs["subset"] == runs["masked"]
    drafts = [t for cycle in runs["subset"][1] for t in cycle]
    assert drafts and set(drafts) <= set(SUBSET)
    assert len({len(c) for c in runs["subset"][1]}) > 1  # the cutoff did cut some blocks


def _check_lossless(model, base, block_size, prompt_lens):
    draft = _with_vocab(base, SUBSET)
    for prompt_len in prompt_lens:
        prompt = _prompt(prompt_len)
        ref = _reference(model, prompt)
        for max_tokens in sorted({1, block_size, MAX_REF}):
            out, _ = run(model, draft, prompt, block_size=block_size, max_tokens=max_tokens, adaptive=False)
            assert out == ref[:max_tokens], (block_size, prompt_len, max_tokens)
        # An oracle over a subset holding every token the target says: each draft is mapped back to
        # its token id and accepted. Its order is not the ids' own.
        said = sorted(set(ref), reverse=True)
        ids = said + [t for t in range(VOCAB) if t not in said][: 64 - len(said)]
        oracle = SubsetOracle(_with_vocab(base, ids), prompt + ref, VOCAB)
        out, cycles = run(model, oracle, prompt, block_size=block_size, max_tokens=MAX_REF, adaptive=False)
        assert out == ref
        assert all(s.num_accepted == s.num_draft for s in cycles) and max(s.num_draft for s in cycles) == block_size - 1


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_lossless_with_a_draft_vocab(qwen3_pair, block_size):
    model, base, _ = qwen3_pair
    _check_lossless(model, base, block_size, (1, 130))


def test_lossless_with_a_draft_vocab_every_target_kind(tiny_pair):
    model, base, _ = tiny_pair
    _check_lossless(model, base, 16, (7,))


def test_trees_with_a_draft_vocab_walk_on_token_ids(varied_pair):
    """On every dense target kind (helpers/family.check_tree_with_draft_vocab)."""
    family.check_tree_with_draft_vocab(*varied_pair[:2])


def test_sampled_proposals_are_distributions_over_the_draft_vocab(qwen3_pair, monkeypatch):
    model, base, _ = qwen3_pair
    draft = _with_vocab(base, SUBSET)
    seen = []
    real = verify.speculative_accept

    def spy(drafts, q, p):
        seen.append((drafts, q))
        return real(drafts, q, p)

    monkeypatch.setattr(verify, "speculative_accept", spy)
    run(model, draft, _prompt(7), max_tokens=40, sampler=make_sampler(1.0), seed=0, adaptive=False)
    assert seen
    outside = np.ones(VOCAB, dtype=bool)
    outside[SUBSET] = False
    for drafts, q in seen:
        q, drafts = np.array(q), np.array(drafts)
        assert q.shape == (len(drafts), VOCAB)
        assert np.allclose(q.sum(axis=-1), 1.0, atol=1e-5) and (q[:, outside] == 0).all()
        assert set(drafts.tolist()) <= set(SUBSET) and (q[np.arange(len(drafts)), drafts] > 0).all()


def _drafter_with(folder, tmp_path, *, size=None, ids=None):
    """A copy of the drafter folder with ``draft_vocab_size=size`` and a ``draft_vocab`` tensor ``ids``."""
    out = tmp_path / "bad"
    out.mkdir()
    config = json.loads((folder / "config.json").read_text())
    if size is not None:
        config["draft_vocab_size"] = size
    (out / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(folder / "model.safetensors"))
    if ids is not None:
        weights["draft_vocab"] = mx.array(ids)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


@pytest.mark.parametrize(
    "size, ids, message",
    [
        (8, None, "has draft_vocab_size=8, but its weights hold no draft_vocab tensor"),
        (8, list(range(6)), "has draft_vocab_size=8, but its draft_vocab tensor has shape (6,)"),
        (None, list(range(8)), "hold a draft_vocab tensor, but its config has no draft_vocab_size"),
        (4, [1, 2, 2, 3], "must hold 4 distinct integer token ids from 0 to 127"),
        (2, [1, VOCAB], "must hold 2 distinct integer token ids from 0 to 127"),
        (2, [0.0, 1.0], "must hold 2 distinct integer token ids"),
        (0, [], "draft_vocab_size=0; it must be a positive number of token ids"),
    ],
)
def test_a_bad_draft_vocab_is_one_line(pair_dirs, tmp_path, size, ids, message):
    bad = _drafter_with(pair_dirs["draft"], tmp_path, size=size, ids=ids)
    with pytest.raises(DFlashError) as e:
        load(pair_dirs["qwen3-tied"], bad)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_draft_vocab_past_the_targets_vocabulary_is_refused(pair_dirs, tmp_path):
    # A config without vocab_size: only the pairing with the target can tell.
    config = read_config(pair_dirs["draft"], "drafter")
    del config["vocab_size"]
    folder = tmp_path / "d"
    draft = load_draft(pair_dirs["draft"])
    draft.set_draft_vocab(mx.array([3, VOCAB + 5], dtype=mx.int32))
    save_draft(draft, config, folder)
    with pytest.raises(DFlashError, match=rf"draft_vocab holds token ids up to {VOCAB + 5}, but the target has "
                                          rf"vocab_size={VOCAB}\."):  # fmt: skip
        load(pair_dirs["qwen3-tied"], folder)


def test_xtc_protected_ids_are_found_in_the_draft_vocab(qwen3_pair):
    from dflash_mlx.drafts.proposer import DFlashProposer

    model, base, _ = qwen3_pair
    sampler = make_sampler(1.0, xtc_probability=0.5, xtc_special_tokens=[SUBSET[3], 1, SUBSET[0]])
    proposer = DFlashProposer(model, _with_vocab(base, SUBSET), None, sampler=sampler)
    assert proposer.sampler.xtc_special_tokens == (3, 0)  # their places in the subset; 1 is not in it
    assert DFlashProposer(model, base, None, sampler=sampler).sampler is sampler


def test_the_pytorch_reference_refuses_a_draft_vocab_in_one_line(pair_dirs, tmp_path):
    pytest.importorskip("torch")
    from dflash_mlx.reference.model import load_draft as load_reference_draft

    draft = _with_vocab(load_draft(pair_dirs["draft"]), SUBSET)
    save_draft(draft, read_config(pair_dirs["draft"], "drafter"), tmp_path)
    with pytest.raises(DFlashError, match=f"draft_vocab_size={len(SUBSET)} token ids; the PyTorch reference drafts "
                                          "over the whole vocabulary only"):  # fmt: skip
        load_reference_draft(tmp_path)
