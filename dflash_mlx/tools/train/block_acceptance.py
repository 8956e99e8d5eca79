"""Greedy acceptance read off whole responses, at every anchor, without a generation loop.

At an anchor ``a`` of the target's own greedy response, a drafting cycle drafts the block
``[token a, mask, ...]`` from the target's taps before ``a``, and the target accepts the longest
run of drafts equal to its next tokens, which are the response's. So one forward pass of
the target over the response and the drafter's block logits at each anchor give the
accepted length of every cycle that could start there: exact per anchor, over all anchors
of held-out responses instead of the few hundred a loop visits, and far cheaper. A loop's
tau weighs these anchors by where its cycles happen to land, so the two differ a little.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .losses import block_hidden
from .taps import TapStore

# Blocks drafted together: bounds the drafter's activations for a long response.
BLOCKS_PER_PASS = 64


@dataclass
class ResponseAcceptance:
    """Accepted drafts at each anchor of one response (``accepted[i]`` for anchor ``anchors[i]``)."""

    anchors: np.ndarray
    accepted: np.ndarray


def _accepted(draft, target, h: mx.array, labels: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per block (row of ``h``), how many leading drafts equal their labels before the first
    miss or the first slot without a label (past the response's end)."""
    # Slot by slot, the head only for blocks still accepted up to it: the head is most of the
    # cost, and most blocks stop at their first draft.
    accepted = np.zeros(len(labels), np.int64)
    alive = np.arange(len(labels))
    for k in range(labels.shape[1]):
        alive = alive[valid[alive, k]]
        if alive.size == 0:
            break
        logits = draft.logits(target, h[mx.array(alive), k])
        drafts = np.array(draft.token_ids(mx.argmax(logits, axis=-1)))
        alive = alive[drafts == labels[alive, k]]
        accepted[alive] += 1
    return accepted


def response_acceptance(
    draft, target, store: TapStore, example: dict, block_size: int | None = None
) -> ResponseAcceptance:
    """Greedy acceptance at every anchor of ``example``'s response (a response cache line).

    Args:
        draft: The drafter; it drafts over its own vocabulary (its ``draft_vocab`` if it has one).
        target: The target whose greedy response ``example`` holds.
        store: Where the example's taps come from (they must be the drafter's tapped layers).
        block_size: The loop's block size (default: the drafter's): as in generation, the
          drafter drafts its whole block and the first ``block_size - 1`` drafts are verified.

    Returns:
        The anchors (positions in prompt + response whose next token is in the response) and
        the drafts accepted at each, at most ``block_size - 1``.
    """
    B, width = draft.block_size, (block_size or draft.block_size) - 1
    ids = np.array(example["prompt_ids"] + example["response_ids"])[: store.max_seq_len]
    taps, _ = store.get(example)
    anchors = np.arange(len(example["prompt_ids"]), len(ids) - 1)
    out = []
    for first in range(0, len(anchors), BLOCKS_PER_PASS):
        part = anchors[first : first + BLOCKS_PER_PASS]
        blocks = np.full((len(part), B), draft.mask_token_id, np.int32)
        blocks[:, 0] = ids[part]
        index = part[:, None] + np.arange(1, width + 1)[None]
        valid = index < len(ids)
        labels = np.where(valid, ids[np.minimum(index, len(ids) - 1)], -1)
        h = block_hidden(draft, target, taps, mx.array(blocks), mx.array(part), mx.zeros(len(part), mx.int32))
        out.append(_accepted(draft, target, h[:, 1:], labels, valid))
    accepted = np.concatenate(out) if out else np.zeros(0, np.int64)
    return ResponseAcceptance(anchors=anchors, accepted=accepted)
