"""Direct state checks: the caches a generation leaves against those of one plain pass over the committed
tokens. Equal output is too blunt where a wrong state drafts the same tokens; equal states are not."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from dflash_mlx import make_cache
from dflash_mlx.loop.cache import make_draft_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.models.hybrid import RecurrentCache
from dflash_mlx.models.sliding import SlidingKVCache

TOLERANCE = 1e-4  # relative to the largest value: a batched tree pass and one prefill round differently


def layer_state(c) -> tuple[int, list[mx.array]]:
    """``(offset, arrays)`` of what a layer's cache holds for the next pass: an attention layer's keys and
    values of every position, a sliding window's of the positions the next pass sees, a recurrent layer's
    convolution and recurrent states."""
    if isinstance(c, RecurrentCache):
        return c.offset, [x for x in c.cache if x is not None]
    if isinstance(c, SlidingKVCache):
        keys, values = c.keys_and_values()
        seen = c.seen
        return c.offset, [keys[..., keys.shape[2] - seen :, :], values[..., values.shape[2] - seen :, :]]
    if isinstance(c, KVCache):
        return c.offset, [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    raise TypeError(f"no state check for {type(c).__name__}")


def _keys_and_values(c) -> tuple[mx.array, mx.array]:
    if hasattr(c, "keys_and_values"):  # a drafter's windowed context
        return c.keys_and_values()
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def _close(a: mx.array, b: mx.array) -> bool:
    if a.shape != b.shape:
        return False
    scale = max(mx.abs(b).max().item(), 1e-6)
    return (mx.abs(a - b).max() / scale).item() < TOLERANCE


def check_states_equal_a_plain_pass(model, cache, draft=None) -> None:
    """``cache`` (a DFlashCache between generations) holds what one plain pass over its committed tokens
    gives: every target layer's offset and state (:func:`layer_state`), and, with ``draft``, the drafter's
    context cache and pending taps (the taps of exactly the committed positions)."""
    tokens = cache.tokens
    assert all(c.offset == len(tokens) for c in cache.target)
    plain = make_cache(model)
    tap_ids = list(draft.target_layer_ids) if draft is not None else []
    _, taps = tgt.forward_with_taps(model, mx.array([tokens]), plain.target, tap_ids)
    for i, (got, want) in enumerate(zip(cache.target, plain.target)):
        (offset, arrays), (want_offset, want_arrays) = layer_state(got), layer_state(want)
        assert offset == want_offset, (i, type(got).__name__, offset, want_offset)
        assert len(arrays) == len(want_arrays), (i, type(got).__name__)
        for a, b in zip(arrays, want_arrays):
            assert _close(a, b), (i, type(got).__name__, "state differs from a plain pass")
    if draft is None:
        return
    # The drafter's context: the taps of the positions it took in, then the ones pending.
    taken = cache.draft_offset
    assert taken + cache.pending_length == len(tokens)
    context = make_draft_cache(draft)
    if taken:
        draft.extend_context(taps[:, :taken], context)
    for i, (got, want) in enumerate(zip(cache.draft, context)):
        assert got.offset == want.offset == taken, (i, got.offset, want.offset)
        if taken:
            for a, b in zip(_keys_and_values(got), _keys_and_values(want)):
                assert _close(a, b), (i, "drafter context differs from a plain pass's taps")
    if cache.pending_length:
        assert _close(cache.pending_taps, taps[:, taken:]), "pending taps differ from a plain pass's"
