"""Caches for a target + drafter pair, and their rollback.

The target cache is mlx-lm's own per-layer ``KVCache``; rolling back a rejected draft
is ``trim``. The drafter's cache holds context keys/values only (the noisy block is never
cached), so its rollback is a trim to the committed length too.
"""

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache

from . import hybrid
from .drafter import DraftModel
from .errors import DFlashError


def make_draft_cache(draft: nn.Module) -> list[KVCache]:
    return [KVCache() for _ in draft.layers]


@dataclass
class DFlashCache:
    """Everything a pair remembers about a conversation, reusable across calls.

    Invariants between generation cycles:
      * ``target[i].offset == len(tokens)``: ``tokens`` are exactly what the target has seen;
      * ``draft[i].offset + pending_length == len(tokens)``: the taps of the last few
        positions wait in ``pending`` until the next draft call injects them.
    """

    target: list[Any]
    draft: list[Any] | None = None
    tokens: list[int] = field(default_factory=list)
    pending: mx.array | None = None
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
        return 0 if self.pending is None else self.pending.shape[1]

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading ``ids`` are already cached; one is always left to prefill."""
        n = 0
        for a, b in zip(self.tokens, ids[:-1]):
            if a != b:
                break
            n += 1
        self.reuse_note = None
        restorable = hybrid.restorable_lengths(self.target)
        if restorable is not None and n not in restorable:
            # A recurrent state returns only to where it was saved: reuse the nearest one.
            best = max(k for k in restorable if k <= n)
            self.reuse_note = (
                f"reused {best} of {n} cached tokens: the target's recurrent state was saved "
                f"at {sorted(restorable)[-6:]} only, so the rest is prefilled again"
            )
            n = best
        return n

    def trim_target(self, n: int) -> None:
        """Forget the target's last ``n`` entries (a verified block's rejected drafts)."""
        for c in self.target:
            c.trim(n)

    def trim_to(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""
        length = max(0, min(length, len(self.tokens)))
        hybrid.trim_to(self.target, length)
        if self.draft:
            d = self.draft_offset
            if length >= d:
                if self.pending is not None:
                    self.pending = self.pending[:, : length - d] if length > d else None
            else:
                for c in self.draft:
                    c.trim(d - length)
                self.pending = None
        del self.tokens[length:]

    def append_pending(self, taps: mx.array | None) -> None:
        if taps is None or not self.draft:
            return
        if self.pending is None:
            self.pending = taps
        else:
            self.pending = mx.concatenate([self.pending, taps], axis=1)

    def take_pending(self) -> mx.array | None:
        taps, self.pending = self.pending, None
        return taps


def make_cache(target: nn.Module, draft: nn.Module | None = None) -> DFlashCache:
    """A fresh cache for ``target`` (and ``draft`` if given).

    ``draft`` may also be any other proposer (prompt lookup): only a DFlash drafter keeps
    a context cache of its own.

    Raises:
        DFlashError: If the target's cache cannot be rolled back (e.g. a rotating window).
    """
    if getattr(target, "model_type", None) in hybrid.HYBRID_MODEL_TYPES:
        target_cache = hybrid.make_cache(target)
    else:
        target_cache = make_prompt_cache(target)
    if not can_trim_prompt_cache(target_cache):
        types = {type(c).__name__ for c in target_cache if not c.is_trimmable()}
        raise DFlashError(
            f"DFlash needs a trimmable target cache (got {sorted(types)}). "
            "Use a target with full attention layers."
        )
    return DFlashCache(target_cache, make_draft_cache(draft) if isinstance(draft, DraftModel) else None)
