"""What proposes each cycle's drafts for one generation, from the loop's options: :func:`make_proposer`.

A proposer is built from the inside out: the source of drafts (plain decoding, prompt lookup, the datastore,
the DFlash drafter, its trees, its DFlash2 selector or a DSpark drafter's Markov steps), then what is wrapped around it (prompt-lookup cycles
after the drafter's misses; with the datastore, prompt lookup's and the datastore's continuations merged with the
drafter's drafts into one tree; the adaptive policy, which pauses the drafter while it loses and drafts from lookup
and the datastore meanwhile).
"""

import mlx.nn as nn

from ..base.errors import DFlashError
from ..cpu.speedups import CpuSpeedups
from ..loop.cache import DFlashCache
from ..loop.distributed import target_group
from ..loop.options import FREE_DRAFTS, LoopOptions
from ..loop.proposal import PlainProposer, Proposer, TextSource
from ..models import drafter2, dspark
from ..sampling import Sampler, can_sample_proposals
from ..tuning.policy import PolicyState
from ..tuning.widths import VerifyWidth
from .datastore import DatastoreProposer
from .dspark import DSparkProposer
from .free import TREE_NODES, DrafterAndText, FreeDrafts
from .lookup import LookupProposer, PromptLookup
from .proposer import AdaptiveProposer, DFlashProposer, FallbackProposer, FirstOf, SelectorProposer, TreeProposer

# tree_budget="auto" verifies up to this many draft tree nodes a cycle.
MAX_AUTO_TREE_BUDGET = 64


def make_proposer(
    model: nn.Module, draft, cache: DFlashCache, options: LoopOptions, *, sampler: Sampler | None, speedups
) -> tuple[Proposer, int]:
    """The proposer of one generation, and its block size (drafts + 1 a cycle; 1 never drafts).

    Args:
        model: The target.
        draft: The DFlash drafter (or a DFlash2 one), a :class:`PromptLookup`, or None.
        cache: The pair's cache.
        options: The loop's options: the block size, tree budget, sampling of drafts, cutoffs, the lookup
          fallback, the adaptive policy and its state, the datastore.
        sampler: The target's sampler (None: greedy).
        speedups: The CPU speedups the loop runs with.
    """
    o = options
    tree_budget = o.tree_budget_for(model, draft)  # checked first: a tree needs a DFlash drafter
    block_size = o.block_size_for(draft)
    policy = o.policy if o.policy is not None else PolicyState()  # what draft-free cycles learn, too
    # The other ranks of a sharded target verify what rank 0 sends them as a path: its text drafts are paths too.
    trees = target_group(model) is None
    if draft is None:
        if o.datastore is None or block_size == 1:
            return PlainProposer(), block_size
        return free_sources(cache, o.datastore, 1, policy, block_size - 1, trees), block_size
    if isinstance(draft, PromptLookup):
        lookup = LookupProposer(draft, cache.tokens)
        if o.datastore is not None:
            lookup = FirstOf(lookup, DatastoreProposer(o.datastore, cache.tokens, draft.block_size))
        return (PlainProposer(lookup) if block_size == 1 else lookup), block_size
    drafter = _drafter(model, draft, cache, o, tree_budget, sampler, speedups)
    if block_size == 1:
        return PlainProposer(drafter), block_size  # the drafter still sees the text
    if o.lookup_fallback:
        lookup = LookupProposer(PromptLookup(draft.block_size), cache.tokens)
        drafter = FallbackProposer(drafter, lookup, o.lookup_fallback)
    if not o.adaptive_on:
        return drafter, block_size
    free = free_sources(cache, o.datastore, policy.lookup, policy, trees=trees)
    if isinstance(free, FreeDrafts) and not tree_budget:
        drafter = DrafterAndText(drafter, free)  # the text's continuations beside the drafter's, one tree
    return AdaptiveProposer(drafter, policy, free), block_size


def _drafter(
    model, draft, cache, o: LoopOptions, tree_budget: int | str, sampler, speedups: CpuSpeedups | None
) -> DFlashProposer:
    # The drafter's own proposer: its path, its tree, or its DFlash2 selector's path; "auto" widths and trees
    # from the target's passes of each width, timed on this machine.
    sample = sampler if o.proposal == "sample" and can_sample_proposals(sampler) else None
    nodes = MAX_AUTO_TREE_BUDGET if tree_budget == "auto" else tree_budget
    choose_width = o.block_size == "auto"
    if isinstance(draft, drafter2.DraftModel):
        if choose_width or o.min_confidence > 0:
            # Its drafts are a path through the selector, with no per-draft confidence to cut or size blocks by.
            raise DFlashError("A DFlash2 drafter verifies whole blocks: use a fixed block_size and min_confidence=0.")
        return SelectorProposer(model, draft, cache, sampler=sample, speedups=speedups)
    width = None
    if choose_width or tree_budget == "auto":
        width = VerifyWidth(model, draft, cache, speedups, tree_nodes=nodes if tree_budget else 0)
    if tree_budget:
        return TreeProposer(model, draft, cache, nodes, fanout=o.tree_width, speedups=speedups, width=width)
    if isinstance(draft, dspark.DraftModel):
        return DSparkProposer(model, draft, cache, threshold=o.confidence_threshold, sampler=sample,
                              min_confidence=o.min_confidence, speedups=speedups, width=width)  # fmt: skip
    return DFlashProposer(
        model, draft, cache, sampler=sample, min_confidence=o.min_confidence, speedups=speedups, width=width
    )


def free_sources(
    cache: DFlashCache, datastore: TextSource | None, lookup: int, state: PolicyState, width: int = FREE_DRAFTS,
    trees: bool = True,
) -> Proposer | None:  # fmt: skip
    """What drafts without a drafter pass: with a datastore, up to ``width`` drafts from it or
    from prompt lookup, as many as pay (:class:`~dflash_mlx.drafts.free.FreeDrafts`, learning
    into ``state``, the policy state the caller keeps; with ``trees``, a tree of their continuations
    where it pays, else one path); without, prompt lookup's ``lookup`` drafts on any match (None:
    ``lookup`` 0, plain steps)."""
    if not lookup:  # paused cycles are plain steps (PolicyState(lookup=0))
        return None
    if datastore is None:
        return LookupProposer(PromptLookup(lookup + 1), cache.tokens)
    return FreeDrafts(cache.tokens, datastore, width, state.free, clock=state.clock,
                      tree_nodes=TREE_NODES if trees else 0)  # fmt: skip
