"""Caches for a target + drafter pair, and their rollback.

The target cache is mlx-lm's own per-layer ``KVCache``; rolling back a rejected draft
is ``trim``. Layers that mlx-lm gives state that cannot be cut (a hybrid target's recurrent
state, a sliding window's rotating buffer) get caches of ours with the same ``trim``, which
return only to some lengths (:mod:`dflash_mlx.models.caches`, the one protocol the loop asks).
The drafter's cache holds context keys/values only (the noisy block is never cached), so its
rollback is a trim to the committed length too.
"""

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache

from ..base.errors import DFlashError
from ..kernels import check_kernels
from ..models import caches as layer_caches
from ..models.drafter import DraftModel
from ..models.families import make_target_cache


class WindowedKVCache:
    """A drafter context cache that keeps the first ``sinks`` positions and the latest
    ``window`` ones, so a draft pass costs the same however long the conversation is.

    The stored keys are positions ``[0, sinks_kept) + [window_start, offset)``; ``offset`` counts every position
    ever added (the RoPE position of the next one, as for mlx-lm's ``KVCache``). The
    context only shapes the drafts, which the target verifies, so what the window drops
    never changes the output.
    """

    def __init__(self, window: int, sinks: int = 4):
        self.window, self.sinks = window, sinks
        self.keys = self.values = None
        self.offset = 0
        self.sinks_kept = self.window_start = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += keys.shape[2]
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        # Stored contiguously from position 0 (no gap yet), the first entries are the sinks;
        # else the first sinks_kept are, and the gap after them is already gone.
        lead = self.sinks if self.window_start == self.sinks_kept else self.sinks_kept
        if keys.shape[2] > lead + self.window:
            keys = mx.concatenate([keys[..., :lead, :], keys[..., -self.window :, :]], axis=2)
            values = mx.concatenate([values[..., :lead, :], values[..., -self.window :, :]], axis=2)
            self.sinks_kept, self.window_start = lead, self.offset - self.window
        self.keys, self.values = keys, values
        return keys, values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the latest ``n`` positions (of those outside the window, nothing is left)."""
        n = min(n, self.offset)
        new = self.offset - n
        if self.keys is not None:
            if new >= self.window_start:
                kept = self.keys.shape[2] - n
            else:
                kept = min(self.sinks_kept, new)
                self.sinks_kept, self.window_start = kept, new
            self.keys, self.values = self.keys[..., :kept, :], self.values[..., :kept, :]
        self.offset = new
        return n

    @property
    def stored(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def make_draft_cache(draft: nn.Module, window: int | None = None, sinks: int = 4) -> list:
    """The drafter's per-layer context caches: all of the context, or with ``window``, the
    first ``sinks`` positions and the latest ``window`` (:class:`WindowedKVCache`).

    A ``sliding_attention`` layer (a drafter config's ``layer_types``) keeps only the latest
    ``sliding_window`` positions whatever ``window`` is: no block query sees further back, so its
    draft pass and cache stay the same size at any context length.
    """
    caches = []
    for layer in draft.layers:
        own = layer.self_attn.window
        if own is not None:
            caches.append(WindowedKVCache(own, sinks=0))
        else:
            caches.append(KVCache() if window is None else WindowedKVCache(window, sinks))
    return caches


def reserve(caches: list[Any], length: int, draft: DraftModel) -> None:
    """Room for ``length`` positions in each of the drafter's full context caches, in one buffer.

    mlx-lm's ``KVCache`` grows 256 positions at a time by copying its buffer into a larger one;
    taking in a long prompt chunk by chunk, that is a copy per chunk, with both buffers held
    for a moment. Sized once for the whole prompt, it holds the drafter's keys and values alone.
    """
    args = draft.args
    if not args.use_target_features:
        return  # the ablation caches no context
    for c in caches:
        if type(c) is not KVCache or (c.keys is not None and c.keys.shape[2] >= length):
            continue
        size = -(-length // c.step) * c.step
        shape = (1, args.num_key_value_heads, size, args.head_dim)
        dtype = draft.norm.weight.dtype if c.keys is None else c.keys.dtype
        keys, values = mx.zeros(shape, dtype=dtype), mx.zeros(shape, dtype=dtype)
        if c.offset > 0:
            keys[..., : c.offset, :] = c.keys[..., : c.offset, :]
            values[..., : c.offset, :] = c.values[..., : c.offset, :]
        c.keys, c.values = keys, values


@dataclass
class DFlashCache:
    """Everything a pair remembers about a conversation, reusable across calls: keys, values and states.

    Each side of a cycle has its own methods: the loop ``resume`` (a generation's start) and
    ``commit`` (each cycle's verdict); the verifier the ``target`` caches and ``tokens``,
    ``trim_target`` and ``drop_uncommitted``; the DFlash proposer the ``draft`` caches,
    ``reserve_draft``, ``append_pending`` and ``take_pending``.

    Invariants between generation cycles:
      * ``target[i].offset == len(tokens)``: ``tokens`` are exactly what the target has seen;
      * ``draft[i].offset + pending_length == len(tokens)``: the taps of the last few
        positions wait in ``pending`` until the next draft call injects them.
    """

    target: list[Any]
    draft: list[Any] | None = None
    tokens: list[int] = field(default_factory=list)
    pending_taps: mx.array | None = None
    # Why the last reusable_prefix() reused less than the common prefix, or None.
    reuse_note: str | None = None

    @property
    def offset(self) -> int:
        return self.target[0].offset

    @property
    def draft_offset(self) -> int:
        return self.draft[0].offset if self.draft else 0

    @property
    def pending_length(self) -> int:
        return 0 if self.pending_taps is None else self.pending_taps.shape[1]

    # The loop's side: what a generation reuses, and what each cycle keeps.

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading ``ids`` are already cached; one is always left to prefill."""
        n = 0
        for a, b in zip(self.tokens, ids[:-1]):
            if a != b:
                break
            n += 1
        self.reuse_note = None
        restorable = layer_caches.restorable_lengths(self.target)
        if restorable is not None and n not in restorable:
            # A recurrent state or a window returns only to where it was saved: reuse the nearest one.
            best = max(k for k in restorable if k <= n)
            kind = layer_caches.limited_by(self.target, n)
            self.reuse_note = (
                f"reused {best} of {n} cached tokens: the target's {kind} was saved "
                f"at {sorted(restorable)[-6:]} only, so the rest is prefilled again"
            )
            n = best
        return n

    def resume(self, ids: list[int]) -> int:
        """Start a generation on ``ids``: keep the longest prefix the pair can return to and forget
        the rest; returns its length (at least one id is left to prefill, for its logits)."""
        reuse = self.reusable_prefix(ids)
        self.trim_to(reuse)
        return reuse

    def trim_to(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""
        length = max(0, min(length, len(self.tokens)))
        layer_caches.trim_to(self.target, length)
        if self.draft:
            d = self.draft_offset
            if length >= d:
                if self.pending_taps is not None:
                    self.pending_taps = self.pending_taps[:, : length - d] if length > d else None
            else:
                for c in self.draft:
                    c.trim(d - length)
                self.pending_taps = None
        del self.tokens[length:]

    def commit(self, last: int, emitted: list[int], verified: int) -> None:
        """A cycle fed ``[last, ...]`` (``verified`` positions) and emitted ``emitted``: the target
        keeps ``last`` and all but the newest emitted token (which the next cycle feeds) and
        forgets the rest of the block."""
        self.trim_target(verified - len(emitted))
        self.tokens.append(last)
        self.tokens.extend(emitted[:-1])

    # The verifier's side: the target's caches, the committed tokens, and the rewind.

    def drop_uncommitted(self) -> None:
        """Forget target entries past ``tokens`` (a cycle cut short, a step queued ahead)."""
        if self.offset != len(self.tokens):
            self.trim_to(len(self.tokens))

    def trim_target(self, n: int) -> None:
        """Forget the target's last ``n`` entries (a verified block's rejected drafts)."""
        for c in self.target:
            c.trim(n)

    # The DFlash proposer's side: the drafter's context cache and the taps not yet in it.

    def reserve_draft(self, n: int, draft: DraftModel) -> None:
        """Room for ``n`` positions after the pending ones in the drafter's context caches (:func:`reserve`)."""
        reserve(self.draft, self.draft_offset + self.pending_length + n, draft)

    def append_pending(self, taps: mx.array | None) -> None:
        """Keep ``taps`` of newly committed positions until the drafter's next pass takes them in."""
        if taps is None or not self.draft:
            return
        if self.pending_taps is None:
            self.pending_taps = taps
        else:
            self.pending_taps = mx.concatenate([self.pending_taps, taps], axis=1)

    def take_pending(self) -> mx.array | None:
        """The pending taps, handed over (None if there are none)."""
        taps, self.pending_taps = self.pending_taps, None
        return taps


def make_cache(
    target: nn.Module,
    draft: nn.Module | None = None,
    *,
    draft_window: int | None = None,
    draft_sinks: int = 4,
    kernels: str = "auto",
) -> DFlashCache:
    """A fresh cache for ``target`` (and ``draft`` if given).

    ``draft`` may also be any other proposer (prompt lookup): only a DFlash drafter keeps
    a context cache of its own: all of the target's taps, or with ``draft_window``, those of
    the first ``draft_sinks`` positions and the latest ``draft_window`` ones. ``kernels`` is the
    Metal kernels' mode of the target layers whose passes run one (a recurrent layer's recurrence;
    :mod:`dflash_mlx.kernels`), for every generation that continues this cache.

    Raises:
        DFlashError: If the target's cache cannot be rolled back (e.g. a rotating window),
          or on a bad window.
    """
    check_draft_window(draft_window, draft_sinks)
    check_kernels(kernels)
    target_cache = make_target_cache(target, kernels)
    if not can_trim_prompt_cache(target_cache):
        types = {type(c).__name__ for c in target_cache if not c.is_trimmable()}
        raise DFlashError(
            f"DFlash needs a trimmable target cache (got {sorted(types)}). Use a target with full attention layers."
        )
    if not isinstance(draft, DraftModel):
        return DFlashCache(target_cache, None)
    if draft_window is not None and any(layer.self_attn.window is not None for layer in draft.layers):
        raise DFlashError(
            "This drafter has sliding_attention layers with a window of their own; leave draft_window out."
        )
    return DFlashCache(target_cache, make_draft_cache(draft, draft_window, draft_sinks))


def check_draft_window(window: int | None, sinks: int) -> None:
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise DFlashError(f"draft_window must be a positive number of positions, or None for all (got {window!r}).")
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise DFlashError(f"draft_sinks must be a non-negative number of positions (got {sinks!r}).")
