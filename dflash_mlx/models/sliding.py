"""Sliding-window attention layers (gpt-oss; Llama variants with sliding layers): a window
cache that rolls back exactly.

mlx-lm gives these layers a ``RotatingKVCache``, which overwrites the oldest entries in place
once the window is full, so a rejected draft can no longer be cut off it. ``SlidingKVCache``
keeps its keys in order instead: before each pass it drops all but the last ``window - 1``
positions (all a new query can still see), so after a pass it holds those plus the pass, and
``trim(n)`` of up to the whole last pass leaves exactly what a shorter pass would have left.
Its memory stays bounded by the window plus one pass, as mlx-lm's does.

Like the recurrent cache of hybrid targets it also keeps a few earlier states
("checkpoints") at the ends of prefills, where a chat's next turn may want to return to.
"""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ..errors import DFlashError

# States kept per layer for prefix reuse across calls, as for a hybrid target's recurrent state.
MAX_CHECKPOINTS = 4


class SlidingKVCache:
    """Keys and values of a layer that attends to its last ``window`` positions only.

    It also builds that layer's mask (mlx-lm asks the cache, ``make_mask``) for the keys its
    ``update_and_fetch`` returns: the last ``window - 1`` positions before the pass and the pass.
    """

    def __init__(self, window: int):
        self.window = window
        self.keys = self.values = None
        self.offset = 0
        self.checkpoints: dict[int, tuple] = {}
        self._passed = False  # a pass since the last trim (a prefill, not a verified block)

    @property
    def stored(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _seen(self) -> int:
        # Positions before the next pass that its first query sees.
        return min(self.stored, self.window - 1)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        # window_size is the layer's own window, the one this cache was made with.
        seen = self._seen()
        if return_array or seen + N > self.window:
            return create_causal_mask(N, seen, window_size=self.window)
        return "causal" if N > 1 else None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._passed:
            # Nothing was trimmed from the previous pass: a prefill (verified blocks are always
            # trimmed after), so this offset is where a generation started.
            self.checkpoint()
        self._passed = True
        self.offset += keys.shape[2]
        if self.keys is not None:
            seen = self._seen()
            keys = mx.concatenate([self.keys[..., self.stored - seen :, :], keys], axis=2)
            values = mx.concatenate([self.values[..., self.stored - seen :, :], values], axis=2)
        self.keys, self.values = keys, values
        return keys, values

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """Whether ``trim(n)`` keeps every position the next query can see."""
        new = self.offset - min(max(n, 0), self.offset)
        return self.offset - self.stored <= max(0, new - (self.window - 1))

    def trim(self, n: int) -> int:
        n = min(max(n, 0), self.offset)
        self._passed = False
        if n == 0:
            return 0
        if not self.can_trim(n):
            raise DFlashError(
                f"A sliding-window target cache cannot drop {n} tokens: it keeps only the last "
                f"{self.stored} positions. Start from a fresh cache (make_cache)."
            )
        self.keys, self.values = self.keys[..., : self.stored - n, :], self.values[..., : self.stored - n, :]
        self.offset -= n
        return n

    def checkpoint(self) -> None:
        """Keep the current state for :meth:`restore` (the newest ``MAX_CHECKPOINTS``)."""
        if self.offset > 0:
            self.checkpoints[self.offset] = (self.keys, self.values)
            while len(self.checkpoints) > MAX_CHECKPOINTS:
                del self.checkpoints[min(self.checkpoints)]

    def restorable_lengths(self) -> set[int]:
        """Every length :meth:`trim` or :meth:`restore` can return this cache to."""
        start = self.offset - self.stored  # the first position kept
        lowest = start + self.window - 1 if start > 0 else 0
        return {0} | set(range(lowest, self.offset + 1)) | set(self.checkpoints)

    def restore(self, offset: int) -> None:
        """Return to the checkpoint at ``offset`` (0: the empty state)."""
        self.keys, self.values = (None, None) if offset == 0 else self.checkpoints[offset]
        self.offset, self._passed = offset, False
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= offset}

    @property
    def state(self):
        return self.keys, self.values

    def size(self) -> int:
        return self.stored

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
