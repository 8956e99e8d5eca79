"""Several rows' DFlash drafter passes in one: the block ``[last, MASK x (B-1)]`` of every row at once.

Each row keeps its own context caches (its :class:`~dflash_mlx.loop.cache.DFlashCache`'s ``draft``), so a row
drafts alone or batched from the same state and nothing moves when rows join or leave. A batched pass first takes
each row's pending taps into its own caches (as the row's next pass alone would), then stacks the rows' contexts,
padded to the longest, under a mask that lets a row's block see its own context and its own block only, each
block at its row's own position. The target's head, the largest matmul of a draft pass, then reads its weights
once for every row instead of once a row.

Only the plain DFlash drafter over full context caches runs here (:func:`batchable`); the others (DFlash2's
selector, DSpark's Markov steps, DFlare's layers, causal or sliding drafter layers, a windowed context) draft row
by row.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..cpu.speedups import CpuSpeedups
from . import drafter
from . import target as tgt


class StackedContext:
    """One drafter layer's context keys and values of several rows, ``(B, kv_heads, S, D)``, padded to the
    longest row: what a layer's attention reads in place of a context cache (it adds none)."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values

    @property
    def offset(self) -> int:
        return self.keys.shape[2]

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


def batchable(model: nn.Module, draft: nn.Module, caches: list[Any]) -> bool:
    """Whether a drafter pass over ``caches`` (a row's context caches) may run in :func:`propose_rows` (a
    head split over ranks drafts on rank 0 alone, row by row)."""
    return (
        type(draft) is drafter.DraftModel
        and tgt.head_group(model) is None
        and draft.args.use_target_features
        and all(not layer.self_attn.causal and layer.self_attn.window is None for layer in draft.layers)
        and all(type(c) is KVCache and c.offset > 0 for c in caches)
    )


def _stacked(caches: list[KVCache], length: int) -> StackedContext:
    # Every row's keys and values of one layer, zero past its own length (the mask hides them).
    keys, values = [], []
    for c in caches:
        pad = [(0, 0), (0, 0), (0, length - c.offset), (0, 0)]
        keys.append(mx.pad(c.keys[..., : c.offset, :], pad))
        values.append(mx.pad(c.values[..., : c.offset, :], pad))
    return StackedContext(mx.concatenate(keys), mx.concatenate(values))


def propose_rows(
    model: nn.Module,
    draft: drafter.DraftModel,
    lasts: list[int],
    contexts: list[list[KVCache]],
    pending: list[mx.array | None],
    num_drafts: int,
    speedups: CpuSpeedups | None = None,
) -> mx.array:
    """Draft logits of several rows in one pass, as each row's own :meth:`~dflash_mlx.models.drafter.DraftModel.propose`.

    Args:
        model: The target whose embedding and head the drafter borrows.
        draft: The drafter (:func:`batchable` with every row's caches).
        lasts: Each row's newest committed token.
        contexts: Each row's per-layer context caches; they grow by the row's pending taps.
        pending: Each row's taps not yet in its caches (None: none), taken in first.
        num_drafts: Logits for the first this many block positions after ``last``.
        speedups: The CPU speedups, or None.

    Returns:
        ``(rows, num_drafts, V)`` logits over the drafter's vocabulary.
    """
    for taps, caches in zip(pending, contexts):
        if taps is not None:
            draft.extend_context(taps, caches, speedups)
    lengths = [caches[0].offset for caches in contexts]
    S, B = max(lengths), draft.block_size
    block = mx.array([[last] + [draft.mask_token_id] * (B - 1) for last in lasts], dtype=mx.uint32)
    stacked = [_stacked([caches[i] for caches in contexts], S) for i in range(len(draft.layers))]
    # Row r's block sees its context (keys < lengths[r]) and its whole block (the last B keys), both ways.
    keys = mx.arange(S + B, dtype=mx.int32)[None, None, None, :]
    mask = (keys < mx.array(lengths, dtype=mx.int32)[:, None, None, None]) | (keys >= S)
    width = len(draft.target_layer_ids) * (draft.args.target_hidden_size or draft.args.hidden_size)
    no_taps = mx.zeros((len(lasts), 0, width), dtype=draft.norm.weight.dtype)
    h = draft(draft.embed(model, block), no_taps, stacked, mask, mx.array(lengths, dtype=mx.int32), speedups)
    return draft.logits(model, h[:, 1 : 1 + num_drafts])
