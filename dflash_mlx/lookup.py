"""Prompt-lookup drafting through the same verify loop: a cheap, strong baseline on code.

The proposer finds the latest earlier occurrence of the last few tokens and proposes what
followed it (Saxena, "Prompt Lookup Decoding", 2023). It has no layers and no taps.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import target as tgt


class PromptLookupDraft(nn.Module):
    """Drop-in proposer for ``dflash_generate_step`` that drafts by n-gram lookup.

    Args:
        block_size: Most tokens verified per cycle (drafts + 1).
        max_ngram: Longest suffix to look up; shorter ones are tried next.
        min_ngram: Shortest suffix to look up.
    """

    def __init__(self, block_size: int = 16, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        self.block_size = block_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.layers: list = []
        self.target_layer_ids: list[int] = []
        self.mask_token_id = 0

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier match of a suffix of ``tokens``."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix, end = tokens[-n:], tokens[-1]
            for start in range(len(tokens) - n - 1, -1, -1):
                # Compare one token before slicing: a miss scans the whole history in Python.
                if tokens[start + n - 1] == end and tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + count]
        return []

    def propose(
        self,
        model: nn.Module,
        block: mx.array,
        target_hidden: mx.array | None,
        cache: list[Any],
        history: list[int] | None = None,
    ) -> mx.array:
        """One-hot logits ``(1, k, vocab)`` for the ``k <= B - 1`` looked-up tokens."""
        tokens = list(history or []) + [int(block[0, 0].item())]
        found = self.lookup(tokens, block.shape[1] - 1)
        vocab = tgt.vocab_size(model)
        if not found:
            return mx.zeros((1, 0, vocab))
        return (mx.arange(vocab)[None] == mx.array(found)[:, None]).astype(mx.float32)[None]
