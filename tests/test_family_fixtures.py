"""The tiny trained DSpark, JetSpec and DFlare drafters of tests/fixtures/families on the toy target (dflash-tiny):
lossless, their acceptance well above one token a cycle, and a DSpark read with z-lab's slot offset or a broken
Markov chain losing it (recipes/rebuild/train_family_drafters.py made them; the README there gives the numbers)."""

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers.decoding import run

from dflash_mlx import load
from dflash_mlx.models import drafter, dspark

FIXTURES = Path(__file__).parent / "fixtures" / "families"
PROMPTS = Path(__file__).parent.parent / "dflash_mlx" / "assets" / "dflash-tiny" / "prompts.jsonl"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def toy():
    model, _, tokenizer = load("dflash-tiny", dtype="float32")
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:2]
    prompts = [
        tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)
        if "messages" in r
        else tokenizer.encode(r["prompt"])
        for r in rows
    ]
    # The target's own greedy replies (plain decoding through the loop, which equals mlx-lm's: test_generate.py).
    return model, prompts, [run(model, None, p, max_tokens=MAX_TOKENS)[0] for p in prompts]


def _tau(toy, draft) -> float:
    """Tokens per drafting cycle over the prompts, checking every reply against the target's own."""
    model, prompts, refs = toy
    emitted = cycles = 0
    for prompt, ref in zip(prompts, refs):
        out, steps = run(model, draft, prompt, max_tokens=MAX_TOKENS, adaptive=False)
        assert out == ref
        drafting = [s for s in steps if s.num_draft]
        emitted, cycles = emitted + sum(len(s.tokens) for s in drafting), cycles + len(drafting)
    return emitted / cycles


def _drafter(toy, family):
    return load("dflash-tiny", FIXTURES / family, dtype="float32")[1]


@pytest.fixture(scope="module")
def dspark_tau(toy):
    return _tau(toy, _drafter(toy, "dspark"))


@pytest.mark.parametrize("family", ["dspark", "jetspec", "dflare"])
def test_trained_drafters_are_lossless_and_accepted(toy, dspark_tau, family):
    draft = _drafter(toy, family)
    assert draft.family == {"dspark": "DSpark", "jetspec": "JetSpec", "dflare": "DFlare"}[family]
    assert (dspark_tau if family == "dspark" else _tau(toy, draft)) >= 2.0


def _as_zlab(draft: dspark.DraftModel) -> drafter.DraftModel:
    """Broken on purpose: the DSpark weights read as a z-lab DFlash drafter (slot 0 kept for the anchor, drafts
    from slots 1.., no Markov bias), the mistake that keeps the text and silently loses acceptance."""
    zlab = drafter.DraftModel(copy.deepcopy(draft.args))
    zlab.update(draft.parameters(), strict=False)
    return zlab


class _AnchorBias(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head, self.anchor = head, None

    def __call__(self, prev):
        return self.head(self.anchor)


class _MarkovFromAnchor(dspark.DraftModel):
    """Broken on purpose: every slot's Markov bias from the anchor, not from the draft before it."""

    def draft_steps(self, model, block, taps, cache, num_drafts, probs=None, speedups=None):
        self.markov_head.anchor = block[0, :1].astype(mx.int32)
        return super().draft_steps(model, block, taps, cache, num_drafts, probs, speedups)


def _broken(draft):
    broken = _MarkovFromAnchor(draft.args)
    broken.update(draft.parameters())
    broken.markov_head = _AnchorBias(broken.markov_head)
    return broken


def test_a_wrong_slot_offset_or_markov_chain_loses_acceptance(toy, dspark_tau):
    """Both mistakes keep the text (the target verifies it) but lose a large part of the acceptance."""
    draft, right = _drafter(toy, "dspark"), dspark_tau
    for name, wrong in (("z-lab slots", _as_zlab(draft)), ("Markov from the anchor", _broken(draft))):
        assert _tau(toy, wrong) < 0.75 * right, (name, right)


class _ShiftedSlots(dspark.DraftModel):
    """Broken on purpose: slot k read one slot later (z-lab's offset: a pass over ``[last, MASK x B]`` with
    slot 0 left out), the Markov bias kept. On the toy target the bias does most of the drafting, so this
    loses too little acceptance for the check above to see."""

    def block_hidden(self, model, block, taps, cache, speedups=None):
        block = mx.concatenate([block, block[:, -1:]], axis=1)  # one more mask slot
        h = self(drafter.DraftModel.embed(self, model, block[:, : self.args.block_size + 1]), _taps(self, taps), cache)
        return h[:, 1:]


def _taps(draft, taps):
    return mx.zeros((1, 0, len(draft.target_layer_ids) * draft.args.hidden_size)) if taps is None else taps


def _blocks_differ(ours: dict, saved) -> str | None:
    """What of ``ours`` differs from the authors' saved numbers (None: nothing)."""
    for name in ("base", "corrected"):
        at_ids = np.take_along_axis(ours[name], saved["ids"], axis=-1)
        if not np.allclose(at_ids, saved[name], atol=1e-3):
            return f"{name} logits, off by {np.abs(at_ids - saved[name]).max():.3f}"
    if not (ours["drafts"] == saved["drafts"]).all():
        return "drafts"
    return None


@pytest.mark.parametrize("broken", [False, True])
def test_every_slot_drafts_as_the_authors_on_the_trained_fixture(broken):
    """Per block, each slot's base and Markov-corrected logits and the drafts against the authors' code's on
    the same weights (saved by recipes/rebuild/dspark_fixture_blocks.py); a read one slot off fails it."""
    from helpers import dspark_fixture

    saved = np.load(dspark_fixture.SAVED)
    model, draft, prompt = dspark_fixture.toy_pair()
    sequence, taps, anchors = dspark_fixture.sequence_and_taps(model, draft, prompt)
    assert sequence == saved["sequence"].tolist() and anchors == saved["anchors"].tolist()
    if broken:
        draft = _mutant(_ShiftedSlots, draft)
    differs = _blocks_differ(dspark_fixture.our_blocks(model, draft, sequence, taps, anchors), saved)
    assert (differs is not None) == broken, differs


def _mutant(cls, draft):
    mutant = cls(draft.args)
    mutant.update(draft.parameters())
    return mutant
