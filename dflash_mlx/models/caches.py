"""One protocol for a target's per-layer caches: how far each can go back, and keeping a draft tree's path.

Every layer cache has mlx-lm's ``offset``, ``update_and_fetch``, ``is_trimmable()`` and ``trim(n)``; mlx-lm's
``KVCache`` goes back to any shorter length by ``trim``. The caches of ours whose state a trim cannot always cut
(a recurrent layer's state, :mod:`~dflash_mlx.models.hybrid`; a sliding window's buffer,
:mod:`~dflash_mlx.models.sliding`) are :class:`Restoring`: they say which lengths they can return to, keep
checkpoints where a generation starts and return to them. The loop and the verifier ask the functions below,
never a cache's class.
"""

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache


class Restoring:
    """A layer cache that returns only to some lengths: by ``trim`` over its last pass, by ``restore`` to a
    checkpoint further back."""

    kind = ""  # what it keeps, as a message names it ("recurrent state", "sliding window")

    def can_trim(self, n: int) -> bool:
        """Whether ``trim(n)`` drops ``n`` positions exactly."""
        raise NotImplementedError

    def restorable_lengths(self) -> set[int]:
        """Every length ``trim`` or :meth:`restore` can return it to."""
        raise NotImplementedError

    def restore(self, offset: int) -> None:
        """Return to the checkpoint at ``offset`` (0: empty)."""
        raise NotImplementedError

    def checkpoint(self) -> None:
        """Keep the current state for :meth:`restore`."""
        raise NotImplementedError

    def keep(self, start: int, path: list[int]) -> None:
        """After a draft tree pass appended its nodes from ``start``: keep the nodes of ``path`` (indices into
        the pass, root first) at ``start, start + 1, ...`` and forget the rest."""
        raise NotImplementedError


def restorable_lengths(caches: list[Any]) -> set[int] | None:
    """Lengths every layer can return to, or None if every layer can return anywhere."""
    sets = [c.restorable_lengths() for c in caches if isinstance(c, Restoring)]
    return set.intersection(*sets) if sets else None


def limited_by(caches: list[Any], length: int) -> str:
    """What keeps the layers from returning to ``length`` (their :attr:`Restoring.kind`)."""
    kinds = [c.kind for c in caches if isinstance(c, Restoring) and length not in c.restorable_lengths()]
    return " and ".join(dict.fromkeys(kinds))


def trim_to(caches: list[Any], length: int) -> None:
    """Trim every layer to ``length``, through a checkpoint where a trim cannot reach."""
    for c in caches:
        if isinstance(c, Restoring) and not c.can_trim(c.offset - length):
            c.restore(length)
        else:
            c.trim(c.offset - length)
        if isinstance(c, Restoring):
            # Where a generation starts (the end of the previous turn): a later turn may
            # return here even after this one's prefill and cycles.
            c.checkpoint()


def fed_as_mlx_lm(caches: list[Any]) -> bool:
    """Whether a layer is mlx-lm's rotating window: it cannot be trimmed once full (plain decoding only), and
    what it keeps depends on how it is fed, so it is fed as ``mlx_lm generate`` feeds it. By class, once: an
    empty rotating cache still says it can be trimmed."""
    return any(isinstance(c, RotatingKVCache) for c in caches)


def keep_rows(keys: mx.array, values: mx.array, first: int, path: list[int]) -> None:
    """Move the keys and values of ``path``'s rows (counted from buffer row ``first``) to rows
    ``first, first + 1, ...``, in place."""
    if path != list(range(len(path))):
        index = first + mx.array(path)
        keys[..., first : first + len(path), :] = keys[..., index, :]
        values[..., first : first + len(path), :] = values[..., index, :]


def keep_path(caches: list[Any], start: int, path: list[int]) -> None:
    """After a tree pass that appended its nodes from ``start``: keep the nodes of ``path`` (indices into the
    pass, root first) at ``start, start + 1, ...`` and forget the rest, in every layer."""
    for c in caches:
        if isinstance(c, Restoring):
            c.keep(start, path)
            continue
        keep_rows(c.keys, c.values, start, path)
        c.trim(c.offset - start - len(path))
