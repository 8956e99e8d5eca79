"""Acceptance read off a whole response equals what the generation loop accepts, cycle by cycle."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import LoopOptions, dflash_generate_step, load
from dflash_mlx.loading.pairs import TINY_PAIR, embedded_pair_path
from dflash_mlx.tools.bench.benchmark import encode, load_prompts
from dflash_mlx.tools.train.block_acceptance import _accepted, response_acceptance
from dflash_mlx.tools.train.taps import TapStore


class OneHotDraft:
    """A drafter whose block hidden state is its logits: slot k of block i drafts argmax h[i, k]."""

    def logits(self, target, h):
        return h

    def token_ids(self, ids):
        return ids


def test_accepted_stops_at_the_first_miss_or_the_end():
    labels = np.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = np.array([[5, 6, 0, 8], [0, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    valid = np.ones_like(labels, bool)
    valid[3, 2:] = False  # the response ends after two more tokens
    h = mx.array(np.eye(10, dtype=np.float32)[drafts])
    assert _accepted(OneHotDraft(), None, h, labels, valid).tolist() == [2, 0, 4, 2]


@pytest.fixture(scope="module")
def tiny():
    return load(TINY_PAIR, dtype="float32")


@pytest.mark.parametrize("block_size", [16, 6])
def test_every_cycle_of_the_loop_accepts_what_its_anchor_reads(tiny, block_size):
    model, draft, tokenizer = tiny
    row = next(r for r in load_prompts(embedded_pair_path(TINY_PAIR) / "prompts.jsonl") if r["category"] == "chat")
    prompt = encode(tokenizer, row)
    options = LoopOptions(max_tokens=80, block_size=block_size, adaptive=False, stop_tokens=tokenizer.eos_token_ids)
    steps = list(dflash_generate_step(prompt, model, draft, options))
    response = [t for s in steps for t in s.tokens]
    example = {"key": "k", "prompt_ids": list(prompt), "response_ids": response}
    read = response_acceptance(draft, model, TapStore(model, draft.target_layer_ids, 4096), example, block_size)
    at = dict(zip(read.anchors.tolist(), read.accepted.tolist()))
    cycles, emitted = [], 0
    for s in steps:
        if s.num_draft:
            # The cycle drafts from the last token emitted; it can verify no more than it drafted.
            cycles.append((len(prompt) + emitted - 1, s.num_draft, s.num_accepted))
        emitted += len(s.tokens)
    assert [acc for _, _, acc in cycles] == [min(at[a], n) for a, n, _ in cycles]
    # A trained pair: cycles that accepted several drafts and cycles that accepted none.
    accepted = [acc for _, _, acc in cycles]
    assert len(cycles) >= 10 and max(accepted) >= 3 and min(accepted) == 0
    # Read one position off, the counts no longer match the loop's (so the check above can fail).
    for shift in (-1, 1):
        assert accepted != [min(at.get(a + shift, -1), n) for a, n, _ in cycles]


def test_a_smaller_block_accepts_the_larger_read_capped_at_its_width(tiny):
    # What recipes/measure/smollm2_block_tau.py relies on to read every block size at once.
    model, draft, tokenizer = tiny
    row = next(r for r in load_prompts(embedded_pair_path(TINY_PAIR) / "prompts.jsonl") if r["category"] == "chat")
    prompt = encode(tokenizer, row)
    options = LoopOptions(max_tokens=60, block_size=16, adaptive=False, stop_tokens=tokenizer.eos_token_ids)
    steps = list(dflash_generate_step(prompt, model, draft, options))
    example = {"key": "k", "prompt_ids": list(prompt), "response_ids": [t for s in steps for t in s.tokens]}
    store = TapStore(model, draft.target_layer_ids, 4096)
    full = response_acceptance(draft, model, store, example, 16).accepted
    assert full.max() > 4  # the cap below bites
    for B in (8, 5):
        assert (
            response_acceptance(draft, model, store, example, B).accepted.tolist() == np.minimum(full, B - 1).tolist()
        )
