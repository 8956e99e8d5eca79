"""A frequency-ranked token subset for the drafter's loss (FR-Spec, arXiv 2502.14856).

On a small target most of a training step is the frozen LM head: each drafted position's
hidden state times every row of the vocabulary. The ``N`` token ids most frequent in the
training responses are most of what the drafter is asked to predict, so the loss's logits
can be those rows alone; a position whose label is outside them carries no cross-entropy.
The target still verifies over its whole vocabulary, so a drafter that drafts among the
subset (``DraftModel.draft_vocab``) changes the speed, never the output.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...models import target as tgt


def token_counts(examples: list[dict], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in the examples' responses, ``(vocab_size,)``."""
    ids = [np.asarray(ex["response_ids"], dtype=np.int64) for ex in examples]
    return np.bincount(np.concatenate(ids) if ids else np.zeros(0, np.int64), minlength=vocab_size)


def top_tokens(counts: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent token ids, most frequent first, ties by id, ``(n,)`` int32."""
    # A stable sort keeps equal counts in id order.
    return np.argsort(-counts, kind="stable")[:n].astype(np.int32)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """The share of the counted tokens that are among ``ids``."""
    total = counts.sum()
    return float(counts[ids].sum() / total) if total else 0.0


@dataclass
class LossVocab:
    """The subset the loss is computed over.

    Args:
        ids: ``(N,)`` int32 token ids.
        index: ``(vocab,)`` int32, each token id's place in ``ids``, -1 outside them.
        rows: ``(N, H)`` the target head's rows of ``ids``.
    """

    ids: mx.array
    index: mx.array
    rows: mx.array

    @classmethod
    def for_target(cls, target: nn.Module, ids: mx.array) -> "LossVocab":
        ids = ids.astype(mx.int32)
        index = mx.full((tgt.vocab_size(target),), -1, dtype=mx.int32)
        index[ids] = mx.arange(ids.shape[0], dtype=mx.int32)
        rows = mx.stop_gradient(tgt.head_rows(target, ids))
        mx.eval(ids, index, rows)
        return cls(ids, index, rows)

    def logits(self, h: mx.array) -> mx.array:
        """``(..., N)`` logits of hidden states ``(..., H)`` over the subset."""
        return h @ self.rows.T

    def labels(self, labels: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
        """Labels as indices into the subset, and the weights with 0 where a label is outside it."""
        sub = self.index[labels]
        return mx.maximum(sub, 0), weights * (sub >= 0)
