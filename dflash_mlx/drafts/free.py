"""Drafts that cost no drafter pass (prompt lookup, the datastore), each cycle as many as pay.

A cycle that verifies ``k`` drafts costs more than a plain step: the first draft costs a share
``first`` of a step (on a CPU target the host also waits for the verdict before it can queue the
next pass), each further one ``each``. It gives ``1 + sum_i P(the first i drafts are right)``
tokens. :class:`FreeDrafts` asks prompt lookup and the datastore, estimates each draft's chance,
and verifies the prefix of the candidate that gives the most tokens per step, or none (a plain
step) when none beats one token a step.

The chances are learned as the text goes: prompt lookup's per draft position, length of match
and whether the match's earlier occurrence went on the same way, the datastore's as its shares
of the continuation scaled by how often such drafts were right. The costs start from what a
2-core CPU measured for the default pair and follow this machine's cycle times. Drafts are
certain (one-hot): verifying any prefix of them is exact, so the output never depends on the
choice.

Both sources together also make a draft tree (:mod:`dflash_mlx.drafts.text_tree`): prompt lookup's
continuation and the datastore's most frequent continuations, best first, verified in one pass when
that gives more tokens a step than the best single path (a tree pass costs more than a path pass of as
many drafts, and what it costs is timed as the cycles go).
"""

import time
from collections.abc import Callable

import mlx.core as mx

from ..loop.proposal import DrafterPass, Proposal, Proposer
from ..tuning.policy import FreeStats
from .datastore import Datastore
from .lookup import PromptLookup
from .text_tree import SourcePath, TextTree, agreed, choose_size, present

# A text tree's most nodes a cycle: a bound on the host's work (a suffix-array range read per node); the
# size verified is chosen by cost, each further node repaying its share of a tree pass.
TREE_NODES = 12


class FreeDrafts(Proposer):
    """Prompt lookup's and the datastore's drafts, sized by :class:`~dflash_mlx.tuning.policy.FreeStats` (module docstring).

    Args:
        history: The committed tokens (the pair cache's ``tokens``, which the loop extends in place).
        store: The datastore, or None for prompt lookup alone.
        width: The most drafts a cycle (a tree's depth).
        stats: What earlier cycles taught (a fresh one when None).
        clock: Seconds; ``time.perf_counter`` by default (tests inject their own).
        tree_nodes: The most nodes of a draft tree of both sources' continuations (0: one path a cycle).
    """

    tap_ids: list[int] = []

    def __init__(
        self, history: list[int], store: Datastore | None, width: int, stats: FreeStats | None = None,
        clock: Callable[[], float] = time.perf_counter, tree_nodes: int = TREE_NODES,
    ):  # fmt: skip
        self.history, self.store, self.width, self.tree_nodes = history, store, width, tree_nodes
        self.stats = stats if stats is not None else FreeStats()
        self.lookup = PromptLookup(width + 1)
        self.clock = clock
        self.pending = None  # what the cycle being verified proposed, and when

    def _sources(self, text: list[int], n: int, tree: TextTree):
        # Each source's own path (to choose the best single one), its nodes merged into ``tree``.
        tokens, match, evidence = self.lookup.lookup_evidence(text, n)
        if tokens:
            kind = f"lookup {match} {evidence}"
            path = SourcePath(kind, tokens, self.stats.chances(kind, len(tokens)))
            tree.add_path(path)
            yield path
        if self.store is None:
            return
        if self.tree_nodes == 0:
            found = self.store.draft(text[-self.store.max_order :], n)
            if found.tokens:
                kind = f"datastore {found.match}"
                chances = self.stats.chances(kind, len(found.tokens), found.shares)
                yield SourcePath(kind, found.tokens, chances, found.shares)
            return
        match, branches = self.store.branches(text[-self.store.max_order :], self.tree_nodes, n)
        if not branches:
            return
        kind = f"datastore {match}"
        steps = self.stats.chances(kind, len(branches), [b.share for b in branches])
        tree.add_branches([(b.parent, b.token, c) for b, c in zip(branches, steps)])
        # Its own path: the first child at each level (the most frequent, popped first).
        node, tokens, shares = 0, [], []
        for i, b in enumerate(branches, 1):
            if b.parent == node:
                node = i
                tokens.append(b.token)
                shares.append(b.share)
        path = SourcePath(kind, tokens, self.stats.chances(kind, len(tokens), shares), shares)
        tree.paths.append(path)
        yield path

    def propose(self, last: int, n: int) -> Proposal:
        return self._propose(last, n, None)

    def merge(self, last: int, n: int, drafter: list[int]) -> Proposal | None:
        """The drafter's drafts of this cycle as one more source of the text tree (one tree, one verify), their
        chances learned like the other sources'; None where the text has no continuation or nothing pays (the
        drafter's own proposal stands). Its cycles are not timed here: the drafter's pass is in them."""
        return self._propose(last, n, SourcePath("drafter", drafter, self.stats.chances("drafter", len(drafter))))

    def _propose(self, last: int, n: int, drafter: SourcePath | None) -> Proposal | None:
        n = min(n, self.width)
        best, best_k, best_rate = None, 0, 1.0
        tree = TextTree()
        if n > 0:
            for path in self._sources(self.history + [last], n, tree):
                k, rate = self.stats.best(path.chances)
                if k and rate > best_rate:
                    best, best_k, best_rate = path, k, rate
        if drafter is not None:
            if not tree.paths or not drafter.tokens:
                return None
            tree.add_path(drafter)
            k, rate = self.stats.best(drafter.chances)
            if k and rate > best_rate:
                best, best_k, best_rate = drafter, k, rate
        start, started = len(self.history), None if drafter is not None else self.clock()
        if tree.paths and self.tree_nodes:
            nodes, chances = tree.best_first(self.tree_nodes)
            m, rate, chain = choose_size(nodes, chances, self.stats)
            if m and rate > best_rate:
                nodes = nodes.first(m)
                self.pending = "tree", tree.paths, nodes, chain, start, started
                # Named after the source whose own path it holds the most of (the likelier on a tie).
                top = max(
                    tree.paths, key=lambda p: (present(nodes, p.tokens), sum(p.chances[: present(nodes, p.tokens)]))
                )
                tokens = mx.array(nodes.tokens, dtype=mx.uint32)
                return Proposal(tokens, None, top.kind.split()[0], None if chain else nodes)
        if best is None:
            if drafter is not None:
                return None
            self.pending = "path", None, 0, start, started
            return Proposal(mx.zeros((0,), dtype=mx.uint32), None, "")
        self.pending = "path", best, best_k, start, started
        return Proposal(mx.array(best.tokens[:best_k], dtype=mx.uint32), None, best.kind.split()[0])

    def plain_next(self) -> bool:
        return False  # what the next cycle finds depends on this one's tokens

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        if pending[0] == "path":
            _, path, k, _, started = pending
            if k:
                self.stats.judged(path.kind, num_accepted, path.chances[:k], path.shares)
            if started is not None:
                self.stats.timed(self.clock() - started, k)
            return
        _, paths, nodes, chain, start, started = pending
        accepted = self.history[start + 1 : start + 1 + num_accepted]
        for path in paths:
            held = present(nodes, path.tokens)
            if held:
                kept = agreed(path.tokens[:held], accepted)
                self.stats.judged(path.kind, kept, path.chances[:held], path.shares)
        if started is None:
            return
        if chain:
            self.stats.timed(self.clock() - started, nodes.size)
        else:
            self.stats.timed_tree(self.clock() - started, nodes.size)


class DrafterAndText(Proposer):
    """The drafter's drafts and the text's continuations in one tree a cycle (:meth:`FreeDrafts.merge`).

    Each cycle the drafter runs as it would alone; where prompt lookup or the datastore also know what may
    follow, its drafts join their tree as one more source and the tree (or the best single path, the drafter's
    included) is verified in the one pass; elsewhere its own proposal is. Drawn drafts (a sampled ``q``) and the
    drafter's own trees are verified as they are. Every token is the target's own either way.

    Args:
        drafter: The drafter's proposer (greedy drafts).
        text: The cycles' text sources, whose statistics learn the drafter's chances too.
    """

    def __init__(self, drafter: Proposer, text: FreeDrafts):
        self.inner, self.text = drafter, text
        self.tap_ids, self.drafter = drafter.tap_ids, drafter.drafter
        self.merged = False

    def propose(self, last: int, n: int) -> Proposal:
        p = self.inner.propose(last, n)
        merged = None
        if p.q is None and p.tree is None and p.size:
            merged = self.text.merge(last, n, p.tokens.tolist())
        self.merged = merged is not None
        return p if merged is None else merged

    def plain_next(self) -> bool:
        return self.inner.plain_next()

    def drafter_pass(self, last: int, n: int) -> DrafterPass | None:
        return self.inner.drafter_pass(last, n)

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        self.inner.accept(num_accepted, taps)
        if self.merged:
            self.text.accept(num_accepted, taps)
        self.merged = False
