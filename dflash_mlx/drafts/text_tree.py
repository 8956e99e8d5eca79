"""Draft trees from the target's own text: prompt lookup's continuation and the datastore's tree of
frequent continuations, merged into one tree that the target verifies in one pass.

Each source says what may follow the text, with an estimated chance for each step (learned per
source as :class:`~dflash_mlx.tuning.policy.FreeStats` learns a path's). A node's chance is that of
its whole path (the product of its steps; where two sources propose the same node, the larger), so a
tree of nodes gives ``1 + sum of its nodes' chances`` tokens in expectation: the target follows one
path, and the events "the text goes through node i" of one depth exclude each other. Nodes are taken
best first (a node's chance is at most its parent's, so the first ``n`` are a tree) and the tree's size
is the one that gives the most tokens per plain step's time, where a tree pass costs what this
machine measured for one (:meth:`~dflash_mlx.tuning.policy.FreeStats.tree_cost`). Drafts are certain
(one-hot): following, from the root, the child that equals the target's own token keeps exactly the
target's samples, whatever the tree holds.
"""

from dataclasses import dataclass, field

from ..models.tree import DraftTree
from ..tuning.policy import FreeStats


@dataclass
class SourcePath:
    """One source's own most likely continuation in a tree: what its chances are learned from.

    Args:
        kind: The source and its evidence (``"lookup 2 agree"``, ``"datastore 4"``).
        tokens: The continuation.
        chances: Each token's chance given the ones before it.
        shares: The datastore's shares of the continuations (None for prompt lookup).
    """

    kind: str
    tokens: list[int]
    chances: list[float]
    shares: list[float] | None = None


@dataclass
class TextTree:
    """A trie of the sources' continuations under the root (the last committed token, node 0)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=lambda: [-1])
    chances: list[float] = field(default_factory=lambda: [1.0])  # each node's path chance
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    paths: list[SourcePath] = field(default_factory=list)

    def _node(self, parent: int, token: int, chance: float) -> int:
        node = self.children[parent].get(token)
        if node is None:
            node = len(self.parents)
            self.tokens.append(token)
            self.parents.append(parent)
            self.chances.append(chance)
            self.children.append({})
            self.children[parent][token] = node
        else:
            self.chances[node] = max(self.chances[node], chance)
        return node

    def add_path(self, path: SourcePath) -> None:
        """A source's continuation, one node a token."""
        node, chance = 0, 1.0
        for token, step in zip(path.tokens, path.chances):
            chance *= step
            node = self._node(node, token, chance)
        self.paths.append(path)

    def add_branches(self, branches: list[tuple[int, int, float]]) -> None:
        """A source's tree: ``(parent, token, chance given the parent)`` a node, parents before their
        children (0: the root, ``i``: the ``i``-th of these)."""
        nodes, chances = [0], [1.0]
        for parent, token, step in branches:
            chances.append(chances[parent] * step)
            nodes.append(self._node(nodes[parent], token, chances[-1]))

    def best_first(self, most: int) -> tuple[DraftTree, list[float]]:
        """The ``most`` likeliest nodes as a :class:`DraftTree` in that order, and their chances; a
        tie goes to the shallower node, so every node comes after its parent."""
        depth = [0]
        for parent in self.parents[1:]:
            depth.append(depth[parent] + 1)
        order = sorted(range(1, len(self.parents)), key=lambda i: (-self.chances[i], depth[i], i))[:most]
        where = {0: 0}
        for i in order:
            where[i] = len(where)
        tree = DraftTree(
            [self.tokens[i - 1] for i in order],
            [-1] + [where[self.parents[i]] for i in order],
            [depth[i] for i in order],
        )
        return tree, [self.chances[i] for i in order]


def choose_size(tree: DraftTree, chances: list[float], stats: FreeStats) -> tuple[int, float, bool]:
    """How many of a best-first tree's nodes to verify, the tokens per plain step they give, and whether
    they form one path (then verified as one, at a path's cost)."""
    best, best_rate, best_chain = 0, 1.0, True
    expected, chain = 1.0, True
    for n, chance in enumerate(chances, 1):
        expected += chance
        chain = chain and tree.parents[n] == n - 1
        rate = expected / (stats.cost(n) if chain else stats.tree_cost(n))
        if rate > best_rate:
            best, best_rate, best_chain = n, rate, chain
    return best, best_rate, best_chain


def agreed(path: list[int], tokens: list[int]) -> int:
    """How many leading tokens of ``path`` equal the accepted ``tokens``."""
    n = 0
    while n < len(path) and n < len(tokens) and path[n] == tokens[n]:
        n += 1
    return n


def present(tree: DraftTree, tokens: list[int]) -> int:
    """How many leading tokens of a source's path the tree holds (from the root)."""
    node, n = 0, 0
    for token in tokens:
        node = tree.children[node].get(token)
        if node is None:
            break
        n += 1
    return n
