"""Sliding-window attention layers (gpt-oss, Llama variants with sliding layers, Gemma 4): a
window cache that rolls back exactly.

mlx-lm gives these layers a ``RotatingKVCache``, which overwrites the oldest entries in place
once the window is full, so a rejected draft can no longer be cut off it. ``SlidingKVCache``
keeps its keys in order in a buffer written in place (a step does not copy the window): the
last pass and at least the ``window - 1 + SLIDING_SLACK`` positions before it. ``trim(n)`` of the
last pass, and of up to the slack before it, leaves exactly what a shorter pass would have
left. Positions no query or trim can need are dropped when the buffer is renewed, about every
``step`` positions, so its memory stays bounded by the window, the slack and one pass.

Like the recurrent cache of hybrid targets it also keeps a few earlier states
("checkpoints") at the ends of prefills, where a chat's next turn may want to return to.
"""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ..base.errors import DFlashError
from .caches import Restoring, keep_rows

# States kept per layer for prefix reuse across calls, as for a hybrid target's recurrent state.
MAX_CHECKPOINTS = 4
# Positions kept beyond the window, so that a trim can go back that far before the last pass
# (the timing passes of block_size="auto", the end of an answer a next turn rewrites).
SLIDING_SLACK = 256


def _fresh(x: mx.array, size: int) -> mx.array:
    # A new buffer of ``size`` positions that starts with ``x`` (B, n_kv_heads, L, head_dim).
    buf = mx.zeros((*x.shape[:2], size, x.shape[3]), x.dtype)
    buf[..., : x.shape[2], :] = x
    return buf


class SlidingKVCache(Restoring):
    """Keys and values of a layer that attends to its last ``window`` positions only.

    It stores positions ``[start, offset)`` from ``keys[..., 0, :]``. ``update_and_fetch`` returns
    what the pass can see (the last ``window - 1`` positions before it and the pass), and
    ``make_mask`` (mlx-lm asks the cache) builds the mask for exactly those keys.

    Args:
        window: The layer's ``sliding_window``.
        slack: Positions kept beyond the window (default ``SLIDING_SLACK``).
    """

    step = 256
    kind = "sliding window"

    def __init__(self, window: int, slack: int | None = None):
        self.window = window
        self.slack = SLIDING_SLACK if slack is None else slack
        self.keys = self.values = None
        self.offset = 0
        self.start = 0
        self.checkpoints: dict[int, tuple] = {}
        self._passed = False  # a pass since the last trim (a prefill, not a verified block)

    @property
    def stored(self) -> int:
        return self.offset - self.start

    @property
    def floor(self) -> int:
        """The shortest length above 0 a trim can reach: every query from there on must still
        find the ``window - 1`` positions before it."""
        return 0 if self.start == 0 else self.start + self.window - 1

    @property
    def seen(self) -> int:
        """Positions before the next pass that its first query sees (what ``update_and_fetch``
        returns ahead of the pass)."""
        return min(self.stored, self.window - 1)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        # window_size is the layer's own window, the one this cache was made with.
        seen = self.seen
        if return_array or seen + N > self.window:
            return create_causal_mask(N, seen, window_size=self.window)
        return "causal" if N > 1 else None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._passed:
            # Nothing was trimmed from the previous pass: a prefill (verified blocks are always
            # trimmed after), so this offset is where a generation started.
            self.checkpoint()
        self._passed = True
        used, n = self.stored, keys.shape[2]
        keep = self.window - 1 + self.slack
        if self.keys is None or used + n > self.keys.shape[2] or used > keep + self.step:
            # A new buffer, holding only what a trim back over the slack needs, with room for the pass.
            drop = max(0, used - keep)
            size = (used - drop + n) // self.step * self.step + self.step
            old_k, old_v = (keys, values) if self.keys is None else (self.keys, self.values)
            self.keys = _fresh(old_k[..., drop:used, :], size)
            self.values = _fresh(old_v[..., drop:used, :], size)
            self.start += drop
            used -= drop
        self.keys[..., used : used + n, :] = keys
        self.values[..., used : used + n, :] = values
        self.offset += n
        seen = min(used, self.window - 1)
        return self.keys[..., used - seen : used + n, :], self.values[..., used - seen : used + n, :]

    def hold(self, keys: mx.array | None, values: mx.array | None, start: int, offset: int) -> None:
        """Positions ``[start, offset)`` set from outside (a batch's row coming back; None: given to one), with no
        pass of its own to keep; its checkpoints stay, they are its prompt's."""
        self.keys, self.values, self.start, self.offset = keys, values, start, offset
        self._passed = False

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys[..., : self.stored, :], self.values[..., : self.stored, :]

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """Whether ``trim(n)`` keeps every position the next query can see."""
        length = self.offset - min(max(n, 0), self.offset)
        return length == 0 or length >= self.floor

    def trim(self, n: int) -> int:
        n = min(max(n, 0), self.offset)
        self._passed = False
        if n == 0:
            return 0
        length = self.offset - n
        if not self.can_trim(n):
            raise DFlashError(
                f"A sliding-window target layer cannot go back to {length} tokens: it keeps positions from "
                f"{self.start} on, enough for lengths from {self.floor}. Start from a fresh cache (make_cache)."
            )
        if length == 0:
            self.keys = self.values = None
            self.start = 0
        self.offset = length
        # A checkpoint past the new end would stand for tokens that the next passes replace.
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= length}
        return n

    def checkpoint(self) -> None:
        """Keep the current state for :meth:`restore` (the newest ``MAX_CHECKPOINTS``): a copy of
        the positions a next query sees, not a view that would keep the whole buffer alive."""
        if self.offset > 0:
            kept = self.seen
            a = self.stored - kept
            self.checkpoints[self.offset] = (
                _fresh(self.keys[..., a : self.stored, :], kept),
                _fresh(self.values[..., a : self.stored, :], kept),
            )
            while len(self.checkpoints) > MAX_CHECKPOINTS:
                del self.checkpoints[min(self.checkpoints)]

    def restorable_lengths(self) -> set[int]:
        """Every length :meth:`trim` or :meth:`restore` can return this cache to."""
        return {0} | set(range(self.floor, self.offset + 1)) | set(self.checkpoints)

    def restore(self, offset: int) -> None:
        """Return to the checkpoint at ``offset`` (0: the empty state)."""
        if offset == 0:
            self.keys = self.values = None
            self.start = 0
        else:
            # Slices, so that writing into the buffer never changes the checkpoint; it is full,
            # so the next pass renews it anyway.
            keys, values = self.checkpoints[offset]
            self.keys, self.values = keys[..., :, :], values[..., :, :]
            self.start = offset - keys.shape[2]
        self.offset, self._passed = offset, False
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= offset}

    def keep(self, start: int, path: list[int]) -> None:
        # The buffer row of position p is p - self.start.
        keep_rows(self.keys, self.values, start - self.start, path)
        self.trim(self.offset - start - len(path))

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
