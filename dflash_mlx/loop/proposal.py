"""The proposal protocol between the loop and what drafts: ``propose`` the next drafts after the last
committed token, then ``accept`` how many positions of the verified block were kept, with their taps.

A proposer with a DFlash drafter names it as ``drafter``: the verifier's prefill hands it each chunk's taps
(``take_context``). A proposal carries the distribution its drafts were drawn from, or None when they are
certain (greedy or looked-up drafts). The implementations live in :mod:`dflash_mlx.drafts`.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from ..models.tree import DraftTree


@dataclass
class Proposal:
    """Drafts for one cycle.

    Args:
        tokens: ``(n,)`` draft ids, possibly still being computed.
        q: ``(n, vocab)`` the distribution each draft was drawn from, or None when the
          drafts are one-hot (greedy or looked up).
        source: What proposed them (``"drafter"``, ``"lookup"``, ``"datastore"``).
        tree: The drafts as a draft tree's nodes (``tokens`` in node order), or None for a path.
    """

    tokens: mx.array
    q: mx.array | None = None
    source: str = ""
    tree: DraftTree | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth(self) -> int:
        """The most drafts a cycle can keep: a path's size, a tree's depth."""
        return max(self.tree.depths, default=0) if self.tree is not None else self.size

    def line(self) -> "Proposal":
        """A tree's likeliest line as a path (a path as it is), for a pass that verifies paths only."""
        if self.tree is None:
            return self
        return Proposal(mx.array(self.tree.first_path(), dtype=mx.uint32), None, self.source)

    def first(self, n: int) -> "Proposal":
        """The first ``n`` drafts (a tree's first ``n`` nodes: whole, a parent comes before its children)."""
        if self.size <= n:
            return self
        if n == 0:
            return Proposal(mx.zeros((0,), dtype=mx.uint32), None, self.source)
        if self.tree is not None:
            return Proposal(self.tokens[:n], None, self.source, self.tree.first(n))
        return Proposal(self.tokens[:n], None if self.q is None else self.q[:n], self.source)


@dataclass
class DrafterPass:
    """The DFlash drafter pass a proposer's next proposal runs (:meth:`Proposer.drafter_pass`): the batching
    engine runs several rows' in one (:func:`dflash_mlx.models.draft_rows.propose_rows`) and hands each
    proposer its rows' logits (``proposer.given``), which its next ``propose`` uses instead of a pass of its own."""

    proposer: Any  # the DFlash proposer: its model, draft, cache and speedups, and ``given``
    last: int
    n: int


class ContextTaker(Protocol):
    """What takes the prefill's taps into a drafter's context cache (the DFlash proposer)."""

    # Per tapped layer, the drafter's projection of that layer's taps (None: taps are handed over unprojected).
    fold: dict[int, mx.array] | None

    def take_context(self, taps: mx.array | None, remaining: int) -> list[mx.array]:
        """Keeps ``taps`` (one prefill chunk's, ``remaining`` prompt tokens still to come); returns the arrays
        to evaluate with the chunk."""
        ...


class Proposer(Protocol):
    """Proposes drafts; keeps whatever state it needs across the cycles of one generation."""

    tap_ids: list[int]  # target layers whose taps it needs (empty: none)
    # The DFlash drafter's proposer, which takes the prefill's taps into its context cache (None: no drafter).
    drafter: "ContextTaker | None" = None

    def propose(self, last: int, n: int) -> Proposal:
        """Up to ``n`` drafts to follow ``last``, the newest committed token."""
        ...

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        """The target accepted the first ``num_accepted`` drafts of the verified block
        ``[last, drafts...]``, so its first ``num_accepted + 1`` positions stay; ``taps`` are
        the block's taps (all of its positions)."""
        ...

    def plain_next(self) -> bool:
        """After a proposal of no drafts: whether the next one has none either, known before
        this cycle's verdict (the loop then queues that plain step before reading this one)."""
        ...

    def rates(self) -> tuple[float | None, float | None]:
        """Measured tokens per second of plain decoding and of drafting (None: not measured)."""
        return None, None

    def drafter_pass(self, last: int, n: int) -> DrafterPass | None:
        """The drafter pass ``propose(last, n)`` will run next, asked before it without changing what it will
        do, so that several rows' passes run as one (None: no pass, or one that runs only alone)."""
        return None


class PlainProposer(Proposer):
    """No drafts: plain decoding through the same loop. ``keeps``, a proposer whose drafter must
    still see the text (a drafter at block size 1, which never drafts), is told what was kept."""

    def __init__(self, keeps: Proposer | None = None):
        self.keeps = keeps
        self.tap_ids = keeps.tap_ids if keeps is not None else []
        self.drafter = keeps.drafter if keeps is not None else None

    def propose(self, last: int, n: int) -> Proposal:
        return Proposal(mx.zeros((0,), dtype=mx.uint32))

    def plain_next(self) -> bool:
        return True

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        if self.keeps is not None:
            self.keeps.accept(num_accepted, taps)


class TextSource(Protocol):
    """The target's past text that draft-free cycles continue (:class:`dflash_mlx.drafts.datastore.Datastore`):
    the loop's options carry it, and each finished reply is added to it."""

    def add(self, tokens: list[int]) -> None:
        """Keeps a finished reply's ``tokens``, so later drafts can continue them."""
        ...
