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
"""

import time
from collections.abc import Callable

import mlx.core as mx

from ..loop.proposal import Proposal, Proposer
from ..tuning.policy import FreeStats
from .datastore import Datastore
from .lookup import PromptLookup


class FreeDrafts(Proposer):
    """Prompt lookup's and the datastore's drafts, sized by :class:`~dflash_mlx.tuning.policy.FreeStats` (module docstring).

    Args:
        history: The committed tokens (the pair cache's ``tokens``, which the loop extends in place).
        store: The datastore, or None for prompt lookup alone.
        width: The most drafts a cycle.
        stats: What earlier cycles taught (a fresh one when None).
        clock: Seconds; ``time.perf_counter`` by default (tests inject their own).
    """

    tap_ids: list[int] = []

    def __init__(
        self, history: list[int], store: Datastore | None, width: int, stats: FreeStats | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):  # fmt: skip
        self.history, self.store, self.width = history, store, width
        self.stats = stats if stats is not None else FreeStats()
        self.lookup = PromptLookup(width + 1)
        self.clock = clock
        self.pending = None  # (kind, chances, shares, drafts, start) of the cycle being verified

    def _candidates(self, text: list[int], n: int):
        tokens, match, evidence = self.lookup.lookup_evidence(text, n)
        if tokens:
            kind = f"lookup {match} {evidence}"
            yield kind, tokens, self.stats.chances(kind, len(tokens)), None
        if self.store is not None:
            found = self.store.draft(text[-self.store.max_order :], n)
            if found.tokens:
                kind = f"datastore {found.match}"
                yield kind, found.tokens, self.stats.chances(kind, len(found.tokens), found.shares), found.shares

    def propose(self, last: int, n: int) -> Proposal:
        n = min(n, self.width)
        best = None, [], [], None, 0, 1.0  # kind, tokens, chances, shares, k, tokens per step
        if n > 0:
            for kind, tokens, chances, shares in self._candidates(self.history + [last], n):
                k, rate = self.stats.best(chances)
                if k and rate > best[5]:
                    best = kind, tokens, chances, shares, k, rate
        kind, tokens, chances, shares, k, _ = best
        self.pending = kind, chances[:k], shares, k, self.clock()
        source = "" if kind is None else kind.split()[0]
        return Proposal(mx.array(tokens[:k], dtype=mx.uint32), None, source)

    def plain_next(self) -> bool:
        return False  # what the next cycle finds depends on this one's tokens

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        if self.pending is None:
            return
        kind, chances, shares, k, start = self.pending
        self.pending = None
        if k:
            self.stats.judged(kind, num_accepted, chances, shares)
        self.stats.timed(self.clock() - start, k)
