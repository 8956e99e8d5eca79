"""The tiny trained DSpark, JetSpec and DFlare drafters of tests/fixtures/families on the toy target (dflash-tiny):
lossless, their acceptance well above one token a cycle, and a DSpark read with z-lab's slot offset or a broken
Markov chain losing it (recipes/rebuild/train_family_drafters.py made them; the README there gives the numbers)."""

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
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
