"""DFlash on a target sharded over several processes with ``mlx.distributed``: rank 0 decides.

Every rank runs the same generation on its shard of the target (mlx-lm's tensor parallel
``model.shard`` or pipeline ``model.model.pipeline``), so every target pass is one pass of
all of them. What must not differ between ranks is what they feed the target and what they
keep of it: rank 0 drafts, verifies and accepts as one process would, and after each cycle
sends the others one small message (:class:`Peers`): its verdict's tokens, how many drafts
were accepted, and the next cycle's drafts, or that generation stops. The others verify the
same drafts (their share of the pass) and keep what rank 0 kept (cut to the same budget),
never their own verdict, so they cannot drift apart even where machines' timings or rounding
differ. A rank that dies mid-generation ends the others through a TCP connection beside the
collectives (:meth:`Peers.watch`), naming it.

The loop knows none of this: :func:`on_ranks` wraps its proposer and verifier, on rank 0 in
:class:`LeadProposer` and :class:`LeadVerifier`, which tell the others, and on the others in
:class:`FollowProposer` and :class:`FollowVerifier`, which take what rank 0 told.
"""

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..loading.watch import RankWatch, end_load_watch, hand_over
from ..models import drafter2
from ..models import target as tgt
from .options import LoopOptions
from .proposal import ContextTaker, Proposal, Proposer
from .verify import Verdict, Verifier

_SHARDED = (
    nn.AllToShardedLinear,
    nn.ShardedToAllLinear,
    nn.QuantizedAllToShardedLinear,
    nn.QuantizedShardedToAllLinear,
)


def target_group(model: nn.Module) -> mx.distributed.Group | None:
    """The group a target is sharded over (pipeline or tensor parallel), or None if it is whole."""
    inner = getattr(tgt._text(model), "model", None)  # a vision-language target's text decoder too
    if getattr(inner, "pipeline_size", 1) > 1:
        return mx.distributed.init()  # mlx-lm's pipeline sends and receives in the world group
    for _, module in model.named_modules():
        if isinstance(module, _SHARDED) and module.group.size() > 1:
            return module.group
        # mlx-lm's MoE layers sum their experts' shards themselves.
        group = getattr(module, "sharding_group", None)
        if group is not None and group.size() > 1:
            return group
    return None


def sharded_group(model: nn.Module, draft: nn.Module | None, options: LoopOptions) -> mx.distributed.Group | None:
    """The group the target is sharded over (None: whole), once what only rank 0 would run is refused."""
    group = target_group(model)
    if group is not None:
        check_sharded(model, draft, options.block_size == "auto")
        if options.tree_budget_for(model, draft):
            raise DFlashError(
                "Draft trees run in one process only for now: leave tree_budget at 0 on a sharded target."
            )
    return group


def check_sharded(model: nn.Module, draft: nn.Module | None, choose_width: bool) -> None:
    """Refuse what only rank 0 would run on a sharded target (its passes need every rank)."""
    if choose_width:
        raise DFlashError(
            "block_size='auto' times verify passes on rank 0 alone, which a sharded target cannot run: "
            "pass a fixed block size (--block-size)."
        )
    if isinstance(draft, drafter2.DraftModel) and tgt.head_group(model) is not None:
        raise DFlashError(
            "A DFlash2 drafter reads the target's whole head each pass, which this target splits over its "
            "ranks (tensor parallel). Use a DFlash drafter, or shard the target as a pipeline (--pipeline)."
        )


class Peers:
    """The ranks of one generation. Alone (``group`` None) every call is a no-op.

    The message is ``2 * block_size + 3`` int32 values, an ``all_sum`` in which only rank 0's
    values are not zero: ``[kept count, num_accepted, draft count + 1 (0: stop), kept tokens...,
    drafts...]``; 140 bytes a cycle at block size 16. A kept count of 0 means rank 0 left the
    generation early: the others stop without keeping anything.
    """

    def __init__(self, group: mx.distributed.Group | None, block_size: int):
        self.group = group if group is not None and group.size() > 1 else None
        self.leads = self.group is None or self.group.rank() == 0
        self.block_size = block_size
        self.width = 2 * block_size + 3
        self.done = False  # the generation's last message went round
        self.verdict: tuple[list[int], int] | None = None  # rank 0's latest, not yet told
        self.sent: tuple[int, Proposal] | None = None  # rank 0's drafts the others verify next (after last)
        self.drafts: Proposal | None = None  # the drafts rank 0 sent last (None: it stopped)
        self.ranks: RankWatch | None = None  # the generation's watch on the other ranks

    def watch(self) -> None:
        """Beside MLX's collectives, a TCP connection between rank 0 and each other rank for the
        generation (:class:`~dflash_mlx.loading.watch.RankWatch`): a rank whose peer goes away before
        the last message exits (1) at once, naming that rank. It takes over from the load's watch."""
        if self.group is None:
            return
        self.ranks = RankWatch(self.group)
        try:
            self.ranks.start()
        except RuntimeError:
            end_load_watch(done=False)  # a rank left before this generation: named, if it is gone
            raise
        hand_over()

    def close(self) -> None:
        """End the watch: the peers are told goodbye when the last message went round, else they exit."""
        if self.ranks is not None:
            self.ranks.close(done=self.done)
            self.ranks = None

    def settle(
        self, kept: list[int], num_accepted: int, drafts: Proposal | None
    ) -> tuple[list[int], int, Proposal | None]:
        """Rank 0's ``(kept, num_accepted, drafts)`` on every rank."""
        if self.group is None:
            return kept, num_accepted, drafts
        message = [0] * self.width
        if self.leads:
            tokens = [] if drafts is None else drafts.tokens.tolist()
            message[:3] = [len(kept), num_accepted, 0 if drafts is None else len(tokens) + 1]
            message[3 : 3 + len(kept)] = kept
            message[3 + self.block_size : 3 + self.block_size + len(tokens)] = tokens
        # On the CPU stream: a ring or JACCL collective runs there on every device.
        total = mx.distributed.all_sum(mx.array(message, dtype=mx.int32), group=self.group, stream=mx.cpu).tolist()
        n_kept, num_accepted, n_drafts = total[:3]
        self.done = n_kept == 0 or n_drafts == 0
        if self.leads:
            return kept, num_accepted, drafts
        start = 3 + self.block_size
        drafts = None if n_drafts == 0 else Proposal(mx.array(total[start : start + n_drafts - 1], dtype=mx.uint32))
        return total[3 : 3 + n_kept], num_accepted, drafts

    def decided(self, tokens: list[int], num_accepted: int) -> None:
        """Rank 0's verdict, told with what follows it."""
        self.verdict = (tokens, num_accepted)

    def tell(self, drafts: Proposal | None) -> None:
        """Rank 0: the verdict and the drafts after it (None: generation stops)."""
        (tokens, num_accepted), self.verdict = self.verdict, None
        self.settle(tokens, num_accepted, drafts)

    def hear(self) -> tuple[list[int], int]:
        """The others: rank 0's verdict (no tokens: it left); its drafts after it wait in ``drafts``."""
        tokens, num_accepted, self.drafts = self.settle([], 0, None)
        return tokens, num_accepted


class LeadVerifier:
    """Rank 0's verifier: each verdict is kept until what follows it is known, then told to the others with the
    next cycle's drafts (:class:`LeadProposer`), or with none when the generation ends (:meth:`finish`)."""

    def __init__(self, verifier: Verifier, peers: Peers):
        self.verifier, self.peers = verifier, peers

    def prefill(self, tokens: list[int], step_size: int, drafter: ContextTaker | None = None, progress=None) -> int:
        self.peers.watch()
        token = self.verifier.prefill(tokens, step_size, drafter, progress)
        self.peers.decided([token], 0)
        return token

    def verify(self, last: int, proposal: Proposal, plain_next: bool = False) -> Verdict:
        self.peers.sent = None  # the others take part in this pass
        verdict = self.verifier.verify(last, proposal, plain_next)
        self.peers.decided(verdict.tokens, verdict.num_accepted)
        return verdict

    def finish(self) -> None:
        try:
            if self.peers.sent is not None:
                # Left between cycles: the others are verifying the drafts sent last. Take part in
                # that pass, then tell them to stop.
                self.verifier.verify(*self.peers.sent)
                self.peers.settle([], 0, None)
            elif self.peers.verdict is not None:
                self.peers.tell(None)  # the last verdict, and no drafts after it
        finally:
            self.peers.close()
            self.verifier.finish()


class LeadProposer(Proposer):
    """Rank 0's proposer: its drafts go to the others with the verdict before them."""

    def __init__(self, inner: Proposer, peers: Peers):
        self.inner, self.peers = inner, peers
        self.tap_ids, self.drafter = inner.tap_ids, inner.drafter

    def propose(self, last: int, n: int) -> Proposal:
        drafts = self.inner.propose(last, n)
        if drafts is not None:
            # The others verify what they are told as a path: a tree (none is built for a sharded target; this
            # keeps any that comes from leaving the ranks' passes apart) goes as its likeliest line.
            drafts = drafts.line()
        self.peers.tell(drafts)
        self.peers.sent = (last, drafts)
        return drafts

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        self.inner.accept(num_accepted, taps)

    def plain_next(self) -> bool:
        return self.inner.plain_next()

    def rates(self) -> tuple[float | None, float | None]:
        return self.inner.rates()


class FollowVerifier:
    """Another rank's verifier: it runs its share of each pass, and its verdict is rank 0's. No tokens: rank 0
    left the generation early."""

    def __init__(self, verifier: Verifier, peers: Peers):
        self.verifier, self.peers = verifier, peers

    def prefill(self, tokens: list[int], step_size: int, drafter: ContextTaker | None = None, progress=None) -> int:
        self.peers.watch()
        self.verifier.prefill(tokens, step_size, drafter, progress)
        return self.peers.hear()[0][0]

    def verify(self, last: int, proposal: Proposal, plain_next: bool = False) -> Verdict:
        cached = self.verifier.verify(last, proposal).cached
        tokens, num_accepted = self.peers.hear()
        return Verdict(num_accepted, tokens, None, cached)

    def finish(self) -> None:
        self.peers.close()
        self.verifier.finish()


class FollowProposer(Proposer):
    """Another rank's proposer: it drafts nothing (rank 0's drafts came with its last verdict) and keeps
    nothing, but its taps are the leader's (a pipeline's hand-offs carry them), and so is its prefill:
    ``drafter`` takes the taps in, folded as the leader's are."""

    def __init__(self, peers: Peers, tap_ids: list[int], drafter: ContextTaker | None = None):
        self.peers, self.tap_ids, self.drafter = peers, tap_ids, drafter

    def propose(self, last: int, n: int) -> Proposal | None:
        return self.peers.drafts

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        pass

    def plain_next(self) -> bool:
        return False


def on_ranks(
    group: mx.distributed.Group | None, proposer: Proposer, verifier: Verifier, block_size: int
) -> tuple[Proposer, "Verifier | LeadVerifier | FollowVerifier"]:
    """The proposer and verifier of this rank: as they are alone (``group`` None); on rank 0 telling the others
    what it decided; on the others, taking it."""
    if group is None:
        return proposer, verifier
    peers = Peers(group, block_size)
    if peers.leads:
        return LeadProposer(proposer, peers), LeadVerifier(verifier, peers)
    return FollowProposer(peers, proposer.tap_ids, proposer.drafter), FollowVerifier(verifier, peers)
