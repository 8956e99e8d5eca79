"""The decoding loop's options, checked once: :class:`LoopOptions`.

``stream_generate`` and ``generate`` take them as keyword arguments, as mlx-lm's do, and build a
``LoopOptions``; :func:`dflash_mlx.generation.dflash_generate_step` receives that one object.
What can be checked without the pair is checked when it is made; what depends on the target or
the drafter (the block size, a draft tree) by :meth:`LoopOptions.block_size_for` and
:meth:`LoopOptions.tree_budget_for`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..cpu.speedups import CpuSpeedups
from ..kernels import check_kernels
from ..models import drafter2, dspark
from ..models.drafter import DraftModel
from ..models.families import family
from ..sampling import check_proposal
from ..text.inputs import MAX_SEED
from ..tuning.policy import PolicyState
from .cache import check_draft_window
from .proposal import TextSource
from .verify import LogitsProcessor

SampleFn = Callable[[mx.array], mx.array]  # any mlx-lm sampler: logprobs -> token ids

# The most drafts a draft-free cycle verifies (prompt lookup's or the datastore's, each cycle as
# many as pay by their learned chances and this machine's cycle costs: dflash_mlx.drafts.free).
FREE_DRAFTS = 7


@dataclass(frozen=True)
class LoopOptions:
    """How :func:`~dflash_mlx.generation.dflash_generate_step` decodes. ``stream_generate`` and
    ``generate`` take each field as a keyword argument of the same name.

    Args:
        block_size: Tokens verified per cycle, 1..drafter's trained size (default), or
          ``"auto"``: each cycle, the number of drafts that gives the most tokens per second,
          from the measured cost of verify passes of each width at this context (kept on disk,
          :mod:`dflash_mlx.tuning.widths`) and the drafter's confidences, scaled by how often they
          were right so far. Same output either way.
        tree_budget: Verify a draft tree of up to this many nodes each cycle instead of one path
          (DDTree, :mod:`dflash_mlx.drafts.tree`): the most likely continuations of up to
          ``block_size - 1`` tokens under the drafter's per-position distributions, all checked in
          one target pass, the longest one the target agrees with kept. 0 or None (default): the
          drafter's single path. ``"auto"``: each cycle, the first nodes of a tree of
          64 (``drafts.build.MAX_AUTO_TREE_BUDGET``) that give the most tokens per second, from the measured cost of
          tree passes of each size (kept on disk, as for ``block_size="auto"``) and the drafter's
          path probabilities, scaled by how often they were right so far. Same output either way;
          ``num_draft`` counts the tree's nodes.
          On hybrid targets each node's recurrent state continues its parent's (forked at
          branches); ``"auto"`` is not for them. Not with DFlash2 drafters, ``block_size="auto"``
          or ``min_confidence``.
        tree_width: Build each tree as JetSpec's engine does (its ``accum_logp``,
          :func:`dflash_mlx.drafts.tree.build_fanout_tree`): nodes expanded best first, each getting
          its ``tree_width`` likeliest children at once; ``tree_budget`` nodes in all. None
          (default): DDTree's ``tree_budget`` most likely continuations. Needs a fixed ``tree_budget``.
        max_tokens: The most tokens to generate.
        sampler: ``logprobs -> token ids``: :func:`dflash_mlx.sampling.make_sampler` or any
          mlx-lm sampler. Greedy when None.
        logits_processors: mlx-lm logits processors (e.g. a repetition penalty), applied to
          the target's logits at every position with that position's preceding tokens.
        proposal: ``"sample"`` (default) draws drafts from the drafter's distribution when
          ``sampler`` is a non-greedy :class:`dflash_mlx.sampling.Sampler`; ``"greedy"``, or any
          other sampler, drafts the drafter's argmax (a DFlash2 drafter's: its selector's greedy path).
          At temperature 0 both are the greedy path.
        min_confidence: Verify only the leading drafts to which the drafter gives at least this
          probability (always at least one). 0 (default) verifies the whole block, as in the
          paper. The output is the same either way; a cutoff pays where a verify pass costs
          more the more tokens it checks (CPUs, small targets), at the price of one more
          host synchronisation per cycle.
        confidence_threshold: A DSpark drafter's confidence head (:mod:`dflash_mlx.models.dspark`):
          its drafts stop before the first whose predicted chance of acceptance is under this.
          0 (default, the reference's): the whole block. The output is the same either way.
        lookup_fallback: When the target rejects the drafter's first draft, draft the next
          cycle by prompt lookup instead (no drafter pass: it matches the last few tokens
          against the earlier text); each further such miss doubles the lookup cycles that
          follow it, up to this many, and an accepted draft resets them to one. 0 (default)
          drafts every cycle with the drafter, as in the paper. The output is the same
          either way; the fallback pays where a drafter pass is a sizeable part of a cycle
          and the drafter is often wrong from the first token (fresh text, small targets).
        adaptive: Time drafting cycles against plain decoding steps (cycles of no drafts,
          a few early on and one every 64 drafting cycles), decode plainly while drafting
          gives tokens more slowly, and try drafting again after a run of plain cycles that
          doubles with each further loss, and is long enough that these re-probes cost at
          most 3% of the time (:class:`dflash_mlx.tuning.policy.PolicyState`).
          Every token is still the target's own sample, but which cycles draft depends on
          timings, and so, when sampling, do the random draws: None (default) turns it on
          unless ``seed`` asks for reproducible output; False drafts every cycle, as in
          the paper.
        policy: What ``adaptive`` measured so far and its schedule, continued and updated in
          place: pass the same :class:`dflash_mlx.tuning.policy.PolicyState` to every call for a
          pair (each reply of a chat), so a reply does not pay again to learn that drafting
          loses. None (default): a fresh one for this call.
        draft_window: Let the drafter see the target's taps of only the first
          ``draft_sinks`` positions and the latest ``draft_window`` ones, so that a draft pass
          and the drafter's cache stay the same size however long the context grows. None
          (default): all of them, as in the paper. The output is the same either way; the
          drafts may differ. Ignored with a ``prompt_cache``, which keeps the window it was
          made with (:func:`dflash_mlx.loop.cache.make_cache`).
        draft_sinks: The leading positions a ``draft_window`` always keeps.
        datastore: The target's past text (:class:`dflash_mlx.drafts.datastore.Datastore`): cycles that
          run no drafter pass (the adaptive policy's paused cycles, or every cycle without a
          drafter or with prompt lookup) verify its continuation of the text where prompt
          lookup finds no match of two tokens or more. None (default): prompt lookup alone.
          The output is the same either way. :func:`dflash_mlx.stream_generate`, ``generate`` and
          ``batch_generate`` default to ``"auto"``: the tools' default
          (:func:`dflash_mlx.drafts.datastore.pair_datastore`).
        seed: Seed MLX's random generator first: the same seed gives the same output.
        stop_tokens: Generation ends right after the first of these, even mid-block.
        prefill_step_size: Prompt tokens per prefill chunk.
        prompt_progress_callback: Called as ``(processed, total)`` prompt tokens after each
          prefill chunk, as mlx-lm's own option (``total``: the tokens to prefill, those the
          ``prompt_cache`` reuses left out), so a tool can show a long prompt's prefill.
        cpu_speedups: None (default) uses the CPU speedups where they pay (float32 on MLX's
          CPU backend; :func:`dflash_mlx.cpu.speedups.choose_speedups`); False runs the portable path
          an Apple GPU takes; True or a ``CpuSpeedups`` forces them. Same tokens either way.
        kernels: The Metal kernels of this loop (greedy acceptance; :mod:`dflash_mlx.kernels`):
          ``"auto"`` (default) runs each where it checked itself against its MLX-ops twin on
          this machine and was faster; ``"on"`` wherever it can run, untimed, raising if it
          differs from its twin; ``"off"`` the twins only. Off Metal the twins run, and
          ``"on"`` is an error. The quantized target's matmuls are chosen by ``load``'s own
          ``kernels``, a recurrent layer's recurrence by the cache's (``make_cache(kernels=)``;
          a cache the loop makes itself takes this one). Same tokens either way.

    Raises:
        DFlashError: On ``max_tokens < 1``, a bad ``proposal``, ``min_confidence``,
          ``lookup_fallback``, ``seed``, ``kernels``, ``tree_budget``, ``draft_window`` or
          ``draft_sinks``, or ``block_size="auto"`` with ``min_confidence``.
    """

    max_tokens: int = 256
    block_size: int | str | None = None
    tree_budget: int | str | None = None
    tree_width: int | None = None
    sampler: SampleFn | None = None
    logits_processors: list[LogitsProcessor] | None = None
    proposal: str = "sample"
    min_confidence: float = 0.0
    confidence_threshold: float = 0.0
    lookup_fallback: int = 0
    adaptive: bool | None = None
    policy: PolicyState | None = None
    draft_window: int | None = None
    draft_sinks: int = 4
    datastore: TextSource | None = None
    seed: int | None = None
    stop_tokens: frozenset[int] = frozenset()
    prefill_step_size: int = 512
    prompt_progress_callback: Callable[[int, int], None] | None = None
    cpu_speedups: CpuSpeedups | bool | None = None
    kernels: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "stop_tokens", frozenset(self.stop_tokens))
        check_kernels(self.kernels)
        check_cycle_settings(self.max_tokens, self.min_confidence, self.lookup_fallback, self.proposal)
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise DFlashError(f"seed must be an integer from 0 to {MAX_SEED} (got {self.seed!r}).")
        check_draft_window(self.draft_window, self.draft_sinks)
        budget = self.tree_budget
        valid = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0
        if not (budget is None or budget == 0 or valid or budget == "auto"):
            raise DFlashError(
                f"tree_budget must be a non-negative integer of nodes (0: a path) or 'auto' (got {budget!r})."
            )
        check_tree_width(self.tree_width, budget)
        threshold = self.confidence_threshold
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise DFlashError(f"confidence_threshold must be a probability from 0 to 1 (got {threshold!r}).")
        if self.block_size == "auto" and self.min_confidence > 0:
            raise DFlashError("block_size='auto' chooses each cycle's drafts itself; leave min_confidence at 0.")

    @property
    def adaptive_on(self) -> bool:
        """``adaptive``, whose default (None) is on unless ``seed`` asks for reproducible output."""
        return self.seed is None if self.adaptive is None else self.adaptive

    def block_size_for(self, draft: nn.Module | None) -> int:
        """``block_size`` checked against the drafter: None and ``"auto"`` mean the drafter's
        trained size (``"auto"`` verifies a chosen prefix of it each cycle). Without a drafter,
        drafts come only from a datastore: up to ``FREE_DRAFTS`` a cycle by default."""
        return resolve_block_size(draft, self.block_size, self.datastore is not None)

    def tree_budget_for(self, model: nn.Module, draft) -> int | str:
        """``tree_budget`` as a number of nodes (0: a path) or ``"auto"``, checked against the pair."""
        budget = check_tree_budget(self.tree_budget, model, draft, self.block_size, self.min_confidence)
        if budget and isinstance(draft, dspark.DraftModel):
            dspark_tree_check(draft, self.confidence_threshold)
        return budget


def check_tree_width(tree_width: int | None, tree_budget: int | str | None) -> None:
    """``tree_width`` (JetSpec's trees), as ``LoopOptions`` checks it when it is made."""
    if tree_width is None:
        return
    if not isinstance(tree_width, int) or isinstance(tree_width, bool) or tree_width < 1:
        raise DFlashError(f"tree_width must be a positive integer of children per node (got {tree_width!r}).")
    if not tree_budget or tree_budget == "auto":
        raise DFlashError(
            f"tree_width={tree_width} shapes a draft tree of a fixed size: pass a tree_budget of nodes too."
        )


def check_cycle_settings(max_tokens: int, min_confidence: float, lookup_fallback: int, proposal: str) -> None:
    """The cycle's own settings, as ``LoopOptions`` checks them when it is made."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise DFlashError(f"max_tokens must be a positive integer (got {max_tokens!r}).")
    check_proposal(proposal)
    if not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence <= 1.0:
        raise DFlashError(f"min_confidence must be a probability from 0 to 1 (got {min_confidence!r}).")
    if not isinstance(lookup_fallback, int) or isinstance(lookup_fallback, bool) or lookup_fallback < 0:
        raise DFlashError(f"lookup_fallback must be a non-negative integer of cycles (got {lookup_fallback!r}).")


def resolve_block_size(draft: nn.Module | None, block_size: int | str | None, datastore: bool = False) -> int:
    """See :meth:`LoopOptions.block_size_for`."""
    if block_size == "auto":
        if not isinstance(draft, DraftModel):
            raise DFlashError("block_size='auto' chooses how many of a DFlash drafter's drafts to verify: "
                              "pass a DFlash drafter, or a fixed block size.")  # fmt: skip
        return draft.block_size
    if draft is None and datastore:
        if block_size is None:
            return FREE_DRAFTS + 1
        if not isinstance(block_size, int) or not 1 <= block_size <= 64:
            raise DFlashError(
                f"block_size must be an integer from 1 to 64 with a datastore alone (got {block_size!r})."
            )
        return block_size
    if draft is None:
        if block_size not in (None, 1):
            raise DFlashError(
                f"block_size={block_size} needs a drafter, but none was loaded. "
                "Pass a drafter (--draft) or use block_size=1."
            )
        return 1
    trained = draft.block_size
    if block_size is None:
        return trained
    if not isinstance(block_size, int) or not 1 <= block_size <= trained:
        raise DFlashError(
            f"block_size must be an integer from 1 to the drafter's trained block size {trained} (got {block_size!r})."
        )
    return block_size


def check_tree_budget(
    tree_budget: int | str | None, model: nn.Module, draft, block_size, min_confidence: float
) -> int | str:
    """See :meth:`LoopOptions.tree_budget_for`."""
    if tree_budget is None or tree_budget == 0:
        return 0
    if isinstance(draft, drafter2.DraftModel):
        # Its selector scores each draft given the one before, not one distribution per position.
        raise DFlashError("A DFlash2 drafter drafts one path through its selector, not a tree: use tree_budget=0.")
    if not isinstance(draft, DraftModel):
        raise DFlashError(f"tree_budget={tree_budget} builds trees from a DFlash drafter's block: pass one (--draft).")
    if block_size == "auto" or min_confidence > 0:
        raise DFlashError("A draft tree chooses its own nodes: leave block_size fixed and min_confidence at 0.")
    if tree_budget == "auto" and family(model).recurrent:
        raise DFlashError(
            "tree_budget='auto' times tree passes on the live cache and rolls them back, which a hybrid target's "
            "recurrent state cannot do cheaply; pass a fixed tree_budget."
        )
    return tree_budget


def dspark_tree_check(draft: "dspark.DraftModel", threshold: float) -> None:
    """A DSpark drafter builds trees only without its Markov bias and its confidence cut."""
    if draft.markov_head is not None:
        # Each slot's distribution depends on the draft before it: no one distribution per depth.
        raise DFlashError("A DSpark drafter with a Markov head drafts one path: use tree_budget=0.")
    if threshold > 0:
        raise DFlashError("A draft tree chooses its own nodes: leave confidence_threshold at 0.")


@dataclass
class Budget:
    """What a generation may still emit: up to ``max_tokens``, nothing after a stop token."""

    max_tokens: int
    stop_tokens: frozenset[int]
    used: int = 0
    open: bool = True

    @property
    def room(self) -> int:
        return self.max_tokens - self.used

    def emit(self, tokens: list[int]) -> list[int]:
        """The leading ``tokens`` that fit, cut after a stop token; counted as emitted."""
        tokens = tokens[: self.room]
        for j, t in enumerate(tokens):
            if t in self.stop_tokens:
                tokens, self.open = tokens[: j + 1], False
                break
        self.used += len(tokens)
        self.open = self.open and self.used < self.max_tokens
        return tokens

    def finish(self, tokens: list[int]) -> str | None:
        """Why the generation ended with the just emitted ``tokens`` (None: it goes on)."""
        if self.open:
            return None
        return "stop" if tokens and tokens[-1] in self.stop_tokens else "length"
