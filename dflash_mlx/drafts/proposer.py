"""What proposes drafts for the verify loop: the DFlash drafter, prompt lookup, or both.

The loop in ``dflash_mlx.generation`` sees only the :class:`Proposer` protocol: ``propose`` the
next drafts after the last committed token, then ``accept`` how many positions of the
verified block were kept, with their taps. A proposer with a DFlash drafter names it as
``drafter``: the verifier's prefill hands it each chunk's taps (:meth:`DFlashProposer.take_context`).
A proposal carries the distribution its drafts were drawn from, or None when they are certain
(greedy or looked-up drafts).
"""

import dataclasses
import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..cpu.speedups import CpuSpeedups
from ..loop.cache import DFlashCache
from ..loop.proposal import DrafterPass, Proposal, Proposer
from ..models import draft_rows
from ..models import target as tgt
from ..models.tree import DraftTree
from ..sampling import Sampler, sample_rows, top_probability
from ..tuning.policy import PolicyState
from .tree import build_fanout_tree, build_tree, top_log_probs


class DFlashProposer(Proposer):
    """The DFlash drafter: one pass over ``[last, MASK x (B-1)]`` with the target's taps
    injected through its context cache (``cache.draft``; the taps of newly committed
    positions wait in ``cache.pending_taps`` until the next pass takes them in). It feeds that cache
    itself: the prefill's taps chunk by chunk (:meth:`take_context`), the kept positions' after
    each cycle (:meth:`accept`). Made on every rank of a target whose head is split by vocabulary,
    it reads the head's rows there, together.

    A drafter with a draft vocabulary (``draft.draft_vocab``) drafts, samples and states its
    confidences among those ids only; ``q`` is then zero outside them, a proposal
    distribution like any other for speculative sampling.

    Args:
        model: The target, whose embedding and LM head the drafter borrows.
        draft: The drafter.
        cache: The pair's cache.
        sampler: When given, drafts are drawn from the drafter's distribution filtered as
          the sampler filters the target's (``q``); else the drafter's argmax.
        min_confidence: Keep only the leading drafts the drafter gives at least this
          probability (at least one). The cut depends on the drafter alone, so verifying the
          shorter block is still exact.
        speedups: The CPU speedups, or None.
        width: Choose each cycle's number of drafts (``block_size="auto"``,
          :class:`dflash_mlx.tuning.widths.VerifyWidth`); told of each cycle's acceptance.
    """

    def __init__(
        self,
        model: nn.Module,
        draft: nn.Module,
        cache: DFlashCache,
        *,
        sampler: Sampler | None = None,
        min_confidence: float = 0.0,
        speedups: CpuSpeedups | None = None,
        width=None,
    ):
        self.model, self.draft, self.cache = model, draft, cache
        self.sampler, self.min_confidence, self.speedups, self.width = sampler, min_confidence, speedups, width
        self.tap_ids, self.drafter = draft.target_layer_ids, self
        self.given: mx.array | None = None  # this cycle's logits from a batched pass (DrafterPass)
        # The drafter's fc split by tap, for the target to apply as each tapped layer is done in a
        # prefill: a chunk then holds one projected row per position instead of n_taps raw ones.
        self.fold = draft.tap_blocks()
        if tgt.head_group(model) is not None:
            draft.head_rows(model)  # every rank together: a collective, then rank 0 drafts alone
        vocab = draft.draft_vocab
        if vocab is not None and sampler is not None and sampler.xtc_special_tokens:
            # XTC's protected ids, as indices into the drafter's vocabulary.
            where = {t: i for i, t in enumerate(vocab.tolist())}
            special = tuple(where[t] for t in sampler.xtc_special_tokens if t in where)
            self.sampler = dataclasses.replace(sampler, xtc_special_tokens=special)

    def take_context(self, taps: mx.array | None, remaining: int) -> list[mx.array]:
        """A prefill chunk's taps into the drafter's context cache, after any left pending (raw: an
        earlier turn's last verified block's), so that a long prompt keeps the drafter's keys and
        values only; ``remaining`` prompt tokens, this chunk's included, are still to come. With
        ``fold``, ``taps`` are already projected. Returns what to evaluate."""
        # The whole prompt and a block after it, in buffers sized at the first chunk.
        self.cache.reserve_draft(remaining + self.draft.block_size, self.draft)
        if self.fold is None:
            self.cache.append_pending(taps)
        pending = self.cache.take_pending()
        if pending is not None:
            self.draft.extend_context(pending, self.cache.draft, self.speedups)
        if self.fold is not None and taps is not None:
            self.draft.extend_context(taps, self.cache.draft, self.speedups, projected=True)
        return [c.state for c in self.cache.draft]

    def propose(self, last: int, n: int) -> Proposal:
        # The drafter always sees its trained block, whatever n is.
        block = mx.array([[last] + [self.draft.mask_token_id] * (self.draft.block_size - 1)], dtype=mx.uint32)
        if self.width is not None:
            self.width.costs()  # measured before this pass's taps leave pending, if the bucket is new
        # (n, V) over the drafter's vocabulary; drafts and q index it until mapped to token ids.
        logits = self._logits(block, n)
        if self.sampler is None:
            drafts, q = mx.argmax(logits, axis=-1).astype(mx.uint32), None
        else:
            q = self.sampler.probs(logits, fast_exp=self._fast_exp)
            drafts = sample_rows(q)  # (n,), (n, V)
        if self.width is not None and n > 1:
            k = self.width.choose(self._confidences(logits, drafts, q).tolist())
            drafts, q = drafts[:k], None if q is None else q[:k]
        elif self.min_confidence > 0 and n > 1:
            drafts, q = self._confident_prefix(logits, drafts, q)
        if self.draft.draft_vocab is not None:
            drafts = self.draft.token_ids(drafts)
            q = None if q is None else self.draft.to_target_vocab(q, tgt.vocab_size(self.model))
        # Start drafting now, so that the verify graph is built while the pass runs.
        mx.async_eval(drafts)
        return Proposal(drafts, q, "drafter")

    def _logits(self, block: mx.array, n: int) -> mx.array:
        # The drafter's (n, V) logits of the block: a batched pass's, else this row's own pass.
        given, self.given = self.given, None
        if given is not None:
            return given[:n]
        taps = self.cache.take_pending()
        return self.draft.propose(self.model, block, taps, self.cache.draft, self.speedups, num_drafts=n)[0, :n]

    def drafter_pass(self, last: int, n: int) -> DrafterPass | None:
        # "auto" widths time this row's own passes, so its proposals stay its own.
        if self.width is not None or not draft_rows.batchable(self.model, self.draft, self.cache.draft):
            return None
        return DrafterPass(self, last, n)

    @property
    def _fast_exp(self) -> bool:
        return self.speedups is not None and self.speedups.fast_exp

    def _confidences(self, logits, drafts, q) -> mx.array:
        """The probability the drafter gave each draft."""
        if q is None:  # greedy drafts are the argmax, so their probability is the top one
            return top_probability(logits, fast_exp=self._fast_exp)
        return mx.take_along_axis(q, drafts[:, None].astype(mx.int32), axis=-1)[:, 0]

    def _confident_prefix(self, logits, drafts, q):
        confident = (self._confidences(logits, drafts, q) >= self.min_confidence).tolist()
        k = 1
        while k < len(confident) and confident[k - 1] and confident[k]:
            k += 1
        return drafts[:k], None if q is None else q[:k]

    def plain_next(self) -> bool:
        return False

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        self.given = None  # a batched pass's logits serve the cycle they were made for only
        if self.width is not None:
            self.width.update(num_accepted)
        if taps is not None:
            self.cache.append_pending(taps[:, : num_accepted + 1])


class TreeProposer(DFlashProposer):
    """The DFlash drafter's block as a draft tree (DDTree, :mod:`dflash_mlx.drafts.tree`): from one
    pass, the ``budget`` most likely continuations of up to ``n`` tokens, verified together.

    The tree is the drafter's (its most likely nodes), whatever the sampler: the target's own
    sample at each node picks the child to follow, so every emitted token is a target sample.
    With ``width`` (``tree_budget="auto"``), each cycle verifies the first of the ``budget``
    nodes that give the most tokens per second (:class:`dflash_mlx.tuning.widths.VerifyWidth`).
    With ``fanout``, the tree is JetSpec's instead: each node expanded gets its ``fanout`` likeliest
    children at once (:func:`dflash_mlx.drafts.tree.build_fanout_tree`).
    """

    def __init__(self, model: nn.Module, draft: nn.Module, cache: DFlashCache, budget: int, *,
                 fanout: int | None = None, **kwargs):  # fmt: skip
        super().__init__(model, draft, cache, **kwargs)
        self.budget, self.fanout = budget, fanout

    def propose(self, last: int, n: int) -> Proposal:
        block = mx.array([[last] + [self.draft.mask_token_id] * (self.draft.block_size - 1)], dtype=mx.uint32)
        if self.width is not None:
            self.width.costs()  # measured before this pass's taps leave pending, if the bucket is new
        logits = self._logits(block, n)
        # The heap runs on the host: each position's top `budget` (or `fanout`) ids are all it can use.
        log_probs, ids = top_log_probs(logits, min(self.fanout or self.budget, logits.shape[-1]))
        tree = (
            build_tree(log_probs, ids, self.budget)
            if self.fanout is None
            else build_fanout_tree(log_probs, ids, self.budget)
        )
        if self.width is not None and tree.size > 1:
            tree = tree.first(self.width.choose_nodes([math.exp(lp) for lp in tree.log_probs]))
        tokens = mx.array(tree.tokens, dtype=mx.uint32)
        if self.draft.draft_vocab is not None:
            tokens = self.draft.token_ids(tokens).astype(mx.uint32)
            tree = DraftTree(tokens.tolist(), tree.parents, tree.depths, tree.log_probs)
        return Proposal(tokens, tree=tree)


class SelectorProposer(DFlashProposer):
    """The DFlash2 drafter: one pass over ``[last, MASK x (B-1)]`` as for DFlash, then a path
    through its candidate selector as the drafts.

    Without ``sampler`` the drafts are the selector's greedy path (``draft.draft_tokens``) and
    certain (``q`` is None): verification keeps exactly the drafts that equal the target's own
    samples, under any sampler. With ``sampler``, each draft is drawn from the softmax of its
    candidates' scores, filtered as the sampler filters the target's (``draft.sample_tokens``);
    a draft's scores depend on the draft before it, so ``q`` holds each distribution given the
    drafts drawn before, which is what the speculative-sampling test needs.
    """

    def propose(self, last: int, n: int) -> Proposal:
        block = mx.array([[last] + [self.draft.mask_token_id] * (self.draft.block_size - 1)], dtype=mx.uint32)
        taps = self.cache.take_pending()
        if self.sampler is None:
            drafts, q = self.draft.draft_tokens(self.model, block, taps, self.cache.draft, self.speedups)[0, :n], None
        else:
            probs = partial(self.sampler.probs, fast_exp=self._fast_exp)
            drafts, q = self.draft.sample_tokens(
                self.model, block, taps, self.cache.draft, probs, self.speedups, num_drafts=n
            )
            drafts, q = drafts[0], q[0]  # (n,), (n, V)
        drafts = drafts.astype(mx.uint32)
        mx.async_eval(drafts)
        return Proposal(drafts, q, "drafter")


class FallbackProposer(Proposer):
    """The drafter, with prompt-lookup cycles after each of its first-draft misses.

    When the target rejects the drafter's first draft, the next cycle drafts by lookup (no
    drafter pass); each further such miss doubles the lookup cycles that follow, up to
    ``limit``, and an accepted draft resets them to one. Taps of lookup cycles stay pending
    until the drafter's next pass takes them all in.
    """

    def __init__(self, drafter: DFlashProposer, lookup: Proposer, limit: int):
        self.drafter, self.lookup, self.limit = drafter, lookup, limit
        self.tap_ids = drafter.tap_ids
        self.lookup_cycles, self.next_run = 0, 1
        self.drafted = 0  # drafts of this cycle's drafter pass (0: a lookup cycle)

    def propose(self, last: int, n: int) -> Proposal:
        if self.lookup_cycles > 0:
            self.lookup_cycles -= 1
            self.drafted = 0
            return self.lookup.propose(last, n)
        proposal = self.drafter.propose(last, n)
        self.drafted = proposal.size
        return proposal

    def drafter_pass(self, last: int, n: int) -> DrafterPass | None:
        return self.drafter.drafter_pass(last, n) if self.lookup_cycles == 0 else None

    def plain_next(self) -> bool:
        return False

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        if self.drafted > 0:
            if num_accepted == 0:  # the first draft was rejected
                self.lookup_cycles, self.next_run = self.next_run, min(2 * self.next_run, self.limit)
            else:
                self.next_run = 1
        self.drafter.accept(num_accepted, taps)


class FirstOf(Proposer):
    """The first of several draft-free proposers (prompt lookup, the datastore) that has drafts
    this cycle; none of them needs taps or is told the verdict."""

    tap_ids: list[int] = []

    def __init__(self, *sources: Proposer):
        self.sources = sources

    def propose(self, last: int, n: int) -> Proposal:
        for source in self.sources:
            proposal = source.propose(last, n)
            if proposal.size:
                return proposal
        return Proposal(mx.zeros((0,), dtype=mx.uint32))

    def plain_next(self) -> bool:
        return False

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        pass


class AdaptiveProposer(Proposer):
    """Drafting while it beats decoding without the drafter, paused cycles while it loses, as
    its :class:`~dflash_mlx.tuning.policy.PolicyState` decides.

    Times every cycle, from its proposal to the verdict (the caller's handling of the previous
    cycle's tokens included, as plain decoding would pay it too), and tells the state. The
    state outlives this generation, so the next one continues its schedule. The drafter's taps
    stay pending during paused cycles, so it resumes where the text is. Either way every token
    is the target's own sample: only the speed changes.

    Args:
        inner: The proposer to pause.
        policy: What was measured so far and the schedule; a fresh one when None.
        paused: What proposes while ``inner`` is paused (prompt lookup; None: plain steps).
    """

    def __init__(self, inner: Proposer, policy: PolicyState | None = None, paused: Proposer | None = None):
        self.inner, self.paused = inner, paused
        self.policy = policy if policy is not None else PolicyState()
        self.tap_ids = inner.tap_ids
        self.drafter = inner.drafter
        self.started: float | None = None  # when this cycle's proposal was asked for
        self.drafting = False  # this cycle ran the drafter

    def propose(self, last: int, n: int) -> Proposal:
        self.started = self.policy.clock()
        self.drafting = self.policy.drafts_next()
        if self.drafting:
            return self.inner.propose(last, n)
        if self.paused is not None:
            return self.paused.propose(last, n)
        return Proposal(mx.zeros((0,), dtype=mx.uint32))

    def drafter_pass(self, last: int, n: int) -> DrafterPass | None:
        return self.inner.drafter_pass(last, n) if self.policy.drafts_next() else None

    def plain_next(self) -> bool:
        return not self.drafting and (self.paused is None or self.paused.plain_next()) and self.policy.plain_follows()

    def accept(self, num_accepted: int, taps: mx.array | None) -> None:
        self.inner.accept(num_accepted, taps)
        if not self.drafting and self.paused is not None:
            self.paused.accept(num_accepted, taps)
        if self.started is None:  # a cycle the loop proposed itself (no room for drafts)
            return
        seconds, self.started = self.policy.clock() - self.started, None
        self.policy.record(seconds, num_accepted + 1, drafted=self.drafting)

    def rates(self) -> tuple[float | None, float | None]:
        return self.policy.plain_tps, self.policy.draft_tps
