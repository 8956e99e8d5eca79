"""Draft trees as the target sees them: the tree's topology (:class:`DraftTree`), its attention masks, the
cache views a tree pass writes through; :func:`dflash_mlx.models.caches.keep_path` keeps the accepted path.

How a tree is built from a drafter's distributions is :mod:`dflash_mlx.drafts.tree`. The target sees the tree
as a batch: node ``i`` is batch row ``i``, a one-token step at its own position (mlx-lm's layers take a
per-row RoPE offset, as for batched decoding), and every row reads the keys of the whole pass (:class:`TreeCache`)
under its row of the ancestor mask. The pass appends all nodes to each layer's cache in node order;
:func:`~dflash_mlx.models.caches.keep_path` then moves the accepted path's keys to consecutive positions and drops the rest.
"""

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..base.errors import DFlashError
from .hybrid import RecurrentCache
from .sliding import SlidingKVCache


@dataclass
class DraftTree:
    """A tree of drafts under the root (the last committed token, index 0).

    Args:
        tokens: Node ``i``'s token at ``tokens[i - 1]``, for nodes ``1..n`` in the order they
          were chosen (best first).
        parents: ``parents[i]`` is node ``i``'s parent index (``parents[0] == -1``, the root).
        depths: Node ``i``'s depth at ``depths[i - 1]`` (a child of the root has depth 1).
        log_probs: Node ``i``'s path log-probability under the drafter at ``log_probs[i - 1]``
          (empty when not known).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    log_probs: list[float] = field(default_factory=list)
    children: list[dict[int, int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.children:
            self.children = [{} for _ in self.parents]
            for i, (parent, token) in enumerate(zip(self.parents[1:], self.tokens), start=1):
                self.children[parent][token] = i

    @property
    def size(self) -> int:
        """Nodes besides the root."""
        return len(self.tokens)

    def ancestors(self) -> mx.array:
        """``(n + 1, n + 1)`` bool: row ``i`` is true at node ``i``, its ancestors and the root."""
        rows = [[False] * (self.size + 1) for _ in range(self.size + 1)]
        rows[0][0] = True
        for i in range(1, self.size + 1):
            rows[i] = list(rows[self.parents[i]])  # a parent comes before its children
            rows[i][i] = True
        return mx.array(rows)

    def walk(self, target_tokens: list[int]) -> tuple[list[int], int]:
        """From the root, follow the child equal to the target's token at each node.

        Args:
            target_tokens: The target's own token after each node (index 0: after the root).

        Returns:
            ``(path, bonus)``: the accepted node indices from the root (``path[0] == 0``) and the
            target's token after the last of them.
        """
        path = [0]
        while target_tokens[path[-1]] in self.children[path[-1]]:
            path.append(self.children[path[-1]][target_tokens[path[-1]]])
        return path, target_tokens[path[-1]]

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i - 1] for i in path[1:]]

    def first_path(self) -> list[int]:
        """The tokens of the likeliest line from the root: at each node its first-chosen child (nodes are in
        the order they were chosen, best first)."""
        tokens, i = [], 0
        while self.children[i]:
            i = min(self.children[i].values())
            tokens.append(self.tokens[i - 1])
        return tokens

    def first(self, n: int) -> "DraftTree":
        """The tree of the first ``n`` nodes: a parent comes before its children, so it is whole."""
        return DraftTree(self.tokens[:n], self.parents[: n + 1], self.depths[:n], self.log_probs[:n])


def chain(n: int) -> DraftTree:
    """A tree of ``n`` nodes in one line (token 0 each): a tree pass of that size, for timing."""
    return DraftTree([0] * n, list(range(-1, n)), list(range(1, n + 1)))


def layer_mask(cache: Any, tree: DraftTree, ancestors: mx.array, depths: mx.array) -> mx.array:
    """The ``(n + 1, 1, 1, seen + n + 1)`` bool mask of a tree pass through one layer: every node
    sees the committed keys the layer returns (within its window) and its own ancestors."""
    if isinstance(cache, SlidingKVCache):
        seen, window = cache.seen, cache.window
    else:
        seen, window = cache.offset, None
    n = tree.size + 1
    visible_tree = ancestors
    visible_past = mx.ones((n, seen), dtype=mx.bool_)
    if window is not None:
        # A node at offset + d sees the positions after offset + d - window.
        past = mx.arange(-seen, 0)  # committed positions, relative to offset
        visible_past = past[None, :] > depths[:, None] - window
        visible_tree = ancestors & (depths[:, None] - depths[None, :] < window)
    return mx.concatenate([visible_past, visible_tree], axis=1)[:, None, None, :]


class TreeCache:
    """A layer's cache as the tree pass sees it: each batch row is one node, ``offset`` its position.

    ``update_and_fetch`` appends the nodes' keys to the layer's own cache in node order and
    gives every row all of the layer's keys (the mask keeps each to its ancestors).
    """

    def __init__(self, cache: Any, positions: mx.array):
        self.cache, self.offset = cache, positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[0]
        # (n, heads, 1, d) -> one row of n positions, (1, heads, n, d)
        keys, values = self.cache.update_and_fetch(keys.swapaxes(0, 2), values.swapaxes(0, 2))
        return mx.broadcast_to(keys, (n, *keys.shape[1:])), mx.broadcast_to(values, (n, *values.shape[1:]))


def tree_caches(caches: list[Any], tree: DraftTree) -> tuple[list[Any], list[mx.array | None]]:
    """Each layer's view for one tree pass (a :class:`TreeCache`, or a recurrent cache itself) and its mask."""
    check_tree_caches(caches)
    offset = caches[0].offset
    depths = mx.array([0] + tree.depths)
    ancestors = tree.ancestors()
    positions = (offset + depths).astype(mx.int32)
    masks, built = [], {}
    for c in caches:
        if isinstance(c, RecurrentCache):
            masks.append(None)  # a linear attention layer follows each node's path itself
            continue
        key = (type(c), c.seen if isinstance(c, SlidingKVCache) else c.offset, getattr(c, "window", None))
        if key not in built:
            built[key] = layer_mask(c, tree, ancestors, depths)
        masks.append(built[key])
    return [c if isinstance(c, RecurrentCache) else TreeCache(c, positions) for c in caches], masks


def check_tree_caches(caches: list[Any]) -> None:
    kinds = {type(c).__name__ for c in caches if type(c) not in (KVCache, SlidingKVCache, RecurrentCache)}
    if kinds:
        raise DFlashError(
            f"Draft trees need attention caches that keep every position (got {sorted(kinds)}); "
            "use tree_budget=0 with this target."
        )
