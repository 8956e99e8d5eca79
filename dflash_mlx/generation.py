"""DFlash generation: draft a block, verify it in one target pass, keep the agreed prefix.

Three layers, as in mlx-lm: ``dflash_generate_step`` (token ids), ``stream_generate``
(text and stats as ``GenerationResponse``), and ``generate`` (drains it).
"""

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Generator, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .adaptive import PolicyState
from .cache import DFlashCache, check_draft_window, make_cache
from .cpu.openblas import blas_in_use
from .cpu.speedups import CpuSpeedups
from .cpu.speedups import choose_speedups
from .datastore import Datastore, DatastoreProposer
from .distributed import FollowProposer, Peers, check_sharded, target_group
from .errors import DFlashError
from .free_drafts import FreeDrafts
from .inputs import MAX_SEED, check_text
from .kernels import check_kernels
from .lookup import LookupProposer, PromptLookup
from .models import drafter2, hybrid
from .models import target as tgt
from .models.drafter import DraftModel
from .plain_speed import plain_tokens_per_second
from .proposer import (
    AdaptiveProposer, DFlashProposer, FallbackProposer, FirstOf, PlainProposer, Proposer, SelectorProposer, TreeProposer,
)  # fmt: skip
from .reasoning import join, reasoning_parser
from .responses import AcceptanceStats, GenerationResponse
from .sampling import can_sample_proposals, check_proposal
from .verify import LogitsProcessor, Verifier
from .verify_width import VerifyWidth, machine_key, model_key

SampleFn = Callable[[mx.array], mx.array]  # any mlx-lm sampler: logprobs -> token ids

# tree_budget="auto" verifies up to this many draft tree nodes a cycle.
MAX_AUTO_TREE_BUDGET = 64

# A stream for generation on whichever thread runs the generator (CLI or TUI worker).
generation_stream = mx.new_thread_local_stream(mx.default_device())


class StepOutput(NamedTuple):
    """One cycle of ``dflash_generate_step``.

    ``tokens`` are the emitted tokens (accepted drafts then the bonus token, cut after a stop token, which
    they end with; ``GenerationResponse.tokens`` leaves it out), ``num_accepted``
    how many of the ``num_draft`` drafted tokens the target agreed with. The prefill's
    first token comes alone with ``num_draft == 0``. With ``adaptive``, ``plain_tps`` and
    ``draft_tps`` are the measured tokens per second of plain decoding and of drafting
    (None until measured).
    """

    tokens: list[int]
    num_accepted: int
    num_draft: int
    plain_tps: float | None = None
    draft_tps: float | None = None
    source: str = ""


# The most drafts a draft-free cycle verifies (prompt lookup's or the datastore's, each cycle as
# many as pay by their learned chances and this machine's cycle costs: dflash_mlx.free_drafts).
FREE_DRAFTS = 7


def free_sources(
    cache: DFlashCache, datastore: Datastore | None, lookup: int, width: int = FREE_DRAFTS
) -> Proposer | None:
    """What drafts without a drafter pass: with a datastore, up to ``width`` drafts from it or
    from prompt lookup, as many as pay (:class:`~dflash_mlx.free_drafts.FreeDrafts`); without,
    prompt lookup's ``lookup`` drafts on any match (None: ``lookup`` 0, plain steps)."""
    if not lookup:  # paused cycles are plain steps (PolicyState(lookup=0))
        return None
    if datastore is None:
        return LookupProposer(PromptLookup(lookup + 1), cache.tokens)
    return FreeDrafts(cache.tokens, datastore, width, cache.policy.free, clock=cache.policy.clock)


def resolve_block_size(draft: nn.Module | None, block_size: int | str | None, datastore: bool = False) -> int:
    """Check ``block_size`` against the drafter; None and ``"auto"`` mean the drafter's trained
    size (``"auto"`` verifies a chosen prefix of it each cycle). Without a drafter, drafts come
    only from a datastore: up to ``FREE_DRAFTS`` a cycle by default."""
    if block_size == "auto":
        if not isinstance(draft, DraftModel):
            raise DFlashError("block_size='auto' chooses how many of a DFlash drafter's drafts to verify: "
                              "pass a DFlash drafter, or a fixed block size.")  # fmt: skip
        return draft.block_size
    if draft is None and datastore:
        if block_size is None:
            return FREE_DRAFTS + 1
        if not isinstance(block_size, int) or not 1 <= block_size <= 64:
            raise DFlashError(f"block_size must be an integer from 1 to 64 with a datastore alone (got {block_size!r}).")
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
            f"block_size must be an integer from 1 to the drafter's trained block size "
            f"{trained} (got {block_size!r})."
        )
    return block_size


def _prompt_ids(prompt) -> list[int]:
    if isinstance(prompt, mx.array):
        prompt = prompt.reshape(-1).tolist()
    ids = [int(t) for t in prompt]
    if not ids:
        raise DFlashError("The prompt is empty: pass at least one token or character.")
    return ids


def is_greedy(sampler: SampleFn | None) -> bool:
    """True for samplers that take the argmax: None, ours at temperature 0, mlx-lm's own."""
    return sampler is None or sampler is greedy_sampler or getattr(sampler, "greedy", False) is True


def check_cycle_settings(max_tokens: int, min_confidence: float, lookup_fallback: int, proposal: str) -> None:
    """The one check of the cycle's settings (dflash-bench runs it before loading anything)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise DFlashError(f"max_tokens must be a positive integer (got {max_tokens!r}).")
    check_proposal(proposal)
    if not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence <= 1.0:
        raise DFlashError(f"min_confidence must be a probability from 0 to 1 (got {min_confidence!r}).")
    if not isinstance(lookup_fallback, int) or isinstance(lookup_fallback, bool) or lookup_fallback < 0:
        raise DFlashError(f"lookup_fallback must be a non-negative integer of cycles (got {lookup_fallback!r}).")


def check_tree_budget(
    tree_budget: int | str | None, model: nn.Module, draft, block_size, min_confidence: float
) -> int | str:
    """``tree_budget`` as a number of nodes (0: a path) or ``"auto"``, checked against the pair and the settings."""
    if tree_budget is None or tree_budget == 0:
        return 0
    valid = isinstance(tree_budget, int) and not isinstance(tree_budget, bool) and tree_budget > 0
    if not valid and tree_budget != "auto":
        raise DFlashError(
            f"tree_budget must be a non-negative integer of nodes (0: a path) or 'auto' (got {tree_budget!r})."
        )
    if isinstance(draft, drafter2.DraftModel):
        # Its selector scores each draft given the one before, not one distribution per position.
        raise DFlashError("A DFlash2 drafter drafts one path through its selector, not a tree: use tree_budget=0.")
    if not isinstance(draft, DraftModel):
        raise DFlashError(f"tree_budget={tree_budget} builds trees from a DFlash drafter's block: pass one (--draft).")
    if block_size == "auto" or min_confidence > 0:
        raise DFlashError("A draft tree chooses its own nodes: leave block_size fixed and min_confidence at 0.")
    if tree_budget == "auto" and model.model_type in hybrid.HYBRID_MODEL_TYPES:
        raise DFlashError(
            "tree_budget='auto' times tree passes on the live cache and rolls them back, which a hybrid target's "
            "recurrent state cannot do cheaply; pass a fixed tree_budget."
        )
    return tree_budget


def _make_proposer(
    model, draft, cache, *, sampler, proposal, min_confidence, lookup_fallback, policy, speedups, block_size,
    choose_width=False, tree_budget=0, datastore=None,
):  # fmt: skip
    # Plain decoding (or the datastore's drafts); prompt lookup alone (and the datastore); the
    # drafter (or its trees), with the lookup fallback, paused while it loses to plain decoding
    # (with a policy) and then drafting from lookup and the datastore. Block size 1 never drafts.
    if draft is None:
        if datastore is None or block_size == 1:
            return PlainProposer()
        return free_sources(cache, datastore, 1, block_size - 1)
    if isinstance(draft, PromptLookup):
        lookup = LookupProposer(draft, cache.tokens)
        if datastore is not None:
            lookup = FirstOf(lookup, DatastoreProposer(datastore, cache.tokens, draft.block_size))
        return PlainProposer(lookup) if block_size == 1 else lookup
    sample = proposal == "sample" and can_sample_proposals(sampler)
    if isinstance(draft, drafter2.DraftModel):
        # Its drafts are a path through the selector, with no per-draft confidence to cut or size blocks by.
        if choose_width or min_confidence > 0:
            raise DFlashError("A DFlash2 drafter verifies whole blocks: use a fixed block_size and min_confidence=0.")
        drafter = SelectorProposer(model, draft, cache, sampler=sampler if sample else None, speedups=speedups)
    elif tree_budget == "auto":
        width = VerifyWidth(model, draft, cache, speedups, tree_nodes=MAX_AUTO_TREE_BUDGET)
        drafter = TreeProposer(model, draft, cache, MAX_AUTO_TREE_BUDGET, speedups=speedups, width=width)
    elif tree_budget:
        drafter = TreeProposer(model, draft, cache, tree_budget, speedups=speedups)
    else:
        width = VerifyWidth(model, draft, cache, speedups) if choose_width else None
        drafter = DFlashProposer(
            model, draft, cache, sampler=sampler if sample else None, min_confidence=min_confidence,
            speedups=speedups, width=width,
        )
    if block_size == 1:
        return PlainProposer(drafter)
    if lookup_fallback:
        lookup = LookupProposer(PromptLookup(draft.block_size), cache.tokens)
        drafter = FallbackProposer(drafter, lookup, lookup_fallback)
    if policy is None:
        return drafter
    return AdaptiveProposer(drafter, policy, free_sources(cache, datastore, policy.lookup))


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


def dflash_generate_step(
    prompt: mx.array | list[int],
    model: nn.Module,
    draft: DraftModel | PromptLookup | None,
    *,
    block_size: int | str | None = None,
    tree_budget: int | str | None = None,
    max_tokens: int = 256,
    sampler: SampleFn | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    proposal: str = "sample",
    min_confidence: float = 0.0,
    lookup_fallback: int = 0,
    adaptive: bool | None = None,
    policy: PolicyState | None = None,
    draft_window: int | None = None,
    draft_sinks: int = 4,
    datastore: Datastore | None = None,
    seed: int | None = None,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
    prompt_cache: DFlashCache | None = None,
    prefill_step_size: int = 512,
    cpu_speedups: CpuSpeedups | bool | None = None,
    kernels: str = "auto",
    stream: mx.Stream = generation_stream,
) -> Generator[StepOutput, None, None]:
    """Generate token ids with DFlash speculative decoding.

    Every emitted token follows the target's own distribution under ``sampler`` (greedy by
    default), so greedy output equals the target's own greedy decoding token for token.

    Args:
        prompt: The prompt token ids (the chat template already applied).
        model: The target, an mlx-lm model; or its shard under ``mlx.launch``
          (:func:`dflash_mlx.load` splits it), where every rank calls this with the same
          arguments, rank 0 decides each cycle and the others yield its tokens
          (:mod:`dflash_mlx.distributed`).
        draft: The DFlash drafter; a :class:`dflash_mlx.lookup.PromptLookup` to draft by
          prompt lookup alone; or None for plain decoding.
        block_size: Tokens verified per cycle, 1..drafter's trained size (default), or
          ``"auto"``: each cycle, the number of drafts that gives the most tokens per second,
          from the measured cost of verify passes of each width at this context (kept on disk,
          :mod:`dflash_mlx.verify_width`) and the drafter's confidences, scaled by how often they
          were right so far. Same output either way.
        tree_budget: Verify a draft tree of up to this many nodes each cycle instead of one path
          (DDTree, :mod:`dflash_mlx.tree`): the most likely continuations of up to
          ``block_size - 1`` tokens under the drafter's per-position distributions, all checked in
          one target pass, the longest one the target agrees with kept. 0 or None (default): the
          drafter's single path. ``"auto"``: each cycle, the first nodes of a tree of
          ``MAX_AUTO_TREE_BUDGET`` that give the most tokens per second, from the measured cost of
          tree passes of each size (kept on disk, as for ``block_size="auto"``) and the drafter's
          path probabilities, scaled by how often they were right so far. Same output either way;
          ``num_draft`` counts the tree's nodes.
          On hybrid targets each node's recurrent state continues its parent's (forked at
          branches); ``"auto"`` is not for them. Not with DFlash2 drafters, ``block_size="auto"``
          or ``min_confidence``.
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
          most 3% of the time (:class:`dflash_mlx.adaptive.PolicyState`).
          Every token is still the target's own sample, but which cycles draft depends on
          timings, and so, when sampling, do the random draws: None (default) turns it on
          unless ``seed`` asks for reproducible output; False drafts every cycle, as in
          the paper.
        policy: What ``adaptive`` measured so far and its schedule, continued and updated in
          place: pass the same :class:`dflash_mlx.adaptive.PolicyState` to every call for a
          pair (each reply of a chat), so a reply does not pay again to learn that drafting
          loses. None (default): the ``prompt_cache``'s own (``DFlashCache.policy``), else a
          fresh one.
        draft_window: Let the drafter see the target's taps of only the first
          ``draft_sinks`` positions and the latest ``draft_window`` ones, so that a draft pass
          and the drafter's cache stay the same size however long the context grows. None
          (default): all of them, as in the paper. The output is the same either way; the
          drafts may differ. Ignored with a ``prompt_cache``, which keeps the window it was
          made with (:func:`dflash_mlx.cache.make_cache`).
        draft_sinks: The leading positions a ``draft_window`` always keeps.
        datastore: The target's past text (:class:`dflash_mlx.datastore.Datastore`): cycles that
          run no drafter pass (the adaptive policy's paused cycles, or every cycle without a
          drafter or with prompt lookup) verify its continuation of the text where prompt
          lookup finds no match of two tokens or more. None (default): prompt lookup alone.
          The output is the same either way.
        seed: Seed MLX's random generator first: the same seed gives the same output.
        stop_tokens: Generation ends right after the first of these, even mid-block.
        prompt_cache: A ``DFlashCache`` to continue from; its common prefix with
          ``prompt`` is reused and the rest is prefilled. Updated in place.
        prefill_step_size: Prompt tokens per prefill chunk.
        cpu_speedups: None (default) uses the CPU speedups where they pay (float32 on MLX's
          CPU backend; :func:`dflash_mlx.cpu.speedups.choose_speedups`); False runs the portable path
          an Apple GPU takes; True or a ``CpuSpeedups`` forces them. Same tokens either way.
        kernels: The Metal kernels of this loop (greedy acceptance; :mod:`dflash_mlx.kernels`):
          ``"auto"`` (default) runs each where it checked itself against its MLX-ops twin on
          this machine and was faster; ``"on"`` wherever it can run, untimed, raising if it
          differs from its twin; ``"off"`` the twins only. Off Metal the twins run, and
          ``"on"`` is an error. The quantized target's matmuls are chosen by ``load``'s own
          ``kernels``. Same tokens either way.
        stream: The MLX stream to run on.

    Yields:
        StepOutput: The tokens of each cycle with its acceptance counts.

    Raises:
        DFlashError: On an empty prompt, ``max_tokens < 1``, a bad ``block_size``, ``tree_budget``,
          ``proposal``, ``min_confidence``, ``lookup_fallback`` or ``kernels``; on a sharded
          target, ``block_size="auto"``, a draft tree or a DFlash2 drafter on a head split by vocabulary.
    """
    ids = _prompt_ids(prompt)
    check_kernels(kernels)
    check_cycle_settings(max_tokens, min_confidence, lookup_fallback, proposal)
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise DFlashError(f"seed must be an integer from 0 to {MAX_SEED} (got {seed!r}).")
    tree_budget = check_tree_budget(tree_budget, model, draft, block_size, min_confidence)
    choose_width = block_size == "auto"
    if choose_width and min_confidence > 0:
        raise DFlashError("block_size='auto' chooses each cycle's drafts itself; leave min_confidence at 0.")
    block_size = resolve_block_size(draft, block_size, datastore is not None)
    # A sharded target: rank 0 decides each cycle and the others follow (dflash_mlx.distributed).
    peers = Peers(target_group(model), block_size)
    if peers.group is not None:
        check_sharded(model, draft, choose_width)
        if tree_budget:
            raise DFlashError("Draft trees run in one process only for now: leave tree_budget at 0 on a sharded target.")
    sampler = None if is_greedy(sampler) else sampler
    if prompt_cache is None:
        cache = make_cache(model, draft, draft_window=draft_window, draft_sinks=draft_sinks)
    else:
        check_draft_window(draft_window, draft_sinks)
        cache = prompt_cache
    drafter = draft if isinstance(draft, DraftModel) else None  # DFlash's (not prompt lookup, not None)
    if drafter is not None and cache.draft is None:
        raise DFlashError(
            "The prompt cache was made without a drafter; make it with make_cache(model, draft)."
        )
    cache.use_kernels(kernels)
    speedups = choose_speedups(tgt.compute_dtype(model), cpu_speedups)
    adaptive = seed is None if adaptive is None else adaptive
    # The policy paces the DFlash drafter; with block 1 it never drafts, so it is left alone.
    if not (adaptive and drafter is not None and block_size > 1):
        policy = None
    elif policy is None:
        policy = cache.policy
    proposer = _make_proposer(
        model, draft, cache, sampler=sampler, proposal=proposal, min_confidence=min_confidence,
        lookup_fallback=lookup_fallback, policy=policy, speedups=speedups, block_size=block_size,
        choose_width=choose_width, tree_budget=tree_budget, datastore=datastore,
    )  # fmt: skip
    if peers.group is not None and drafter is not None and tgt.head_group(model) is not None:
        drafter.head_rows(model)  # every rank together: a collective, then rank 0 drafts alone
    if not peers.leads:
        proposer = FollowProposer(proposer.tap_ids)
    verifier = Verifier(
        model, cache, sampler=sampler, logits_processors=logits_processors, tap_ids=proposer.tap_ids,
        speedups=speedups, kernels=kernels, draft=drafter, run_ahead=peers.group is None,
    )

    budget = Budget(max_tokens, frozenset(stop_tokens))
    # Always the whole block, cut to the budget after verifying: a seeded run then draws the same
    # random numbers whatever max_tokens is, so its text keeps its prefix.
    n = block_size - 1
    with mx.stream(stream):
        if seed is not None:
            mx.random.seed(seed)
        # Reuse the longest common prefix; at least one token is prefilled for its logits.
        reuse = cache.reusable_prefix(ids)
        cache.trim_to(reuse)
        drafts = None
        try:
            peers.watch()
            last = verifier.prefill(ids[reuse:], prefill_step_size)
            # The next cycle's drafts, their pass already started; None when generation is over.
            emitted = budget.emit([last]) if peers.leads else []
            if peers.leads and budget.open:
                drafts = proposer.propose(last, n)
            emitted, _, drafts = peers.settle(emitted, 0, drafts)
            if not peers.leads:
                budget.emit(emitted)
            last = emitted[-1]
            yield StepOutput(emitted, 0, 0)
            while drafts is not None:
                room = budget.room  # the drafts past it count as neither drafted nor accepted
                verdict = verifier.verify(last, drafts, plain_next=room > 1 and proposer.plain_next())
                verified, num_accepted, emitted, next_drafts = verdict.cached, verdict.num_accepted, [], None
                source, num_draft = drafts.source, min(drafts.size, room - 1)
                if peers.leads:
                    # Rewind: the target forgets the rejected drafts, the proposer keeps the taps
                    # of the kept positions.
                    emitted = budget.emit(verdict.tokens)
                    cache.commit(last, emitted, verified)
                    proposer.accept(len(emitted) - 1, verdict.taps)
                    # The next drafter pass starts before this cycle's tokens are handed out, so it
                    # runs while the caller decodes and shows them.
                    next_drafts = proposer.propose(emitted[-1], n) if budget.open else None
                emitted, num_accepted, next_drafts = peers.settle(emitted, num_accepted, next_drafts)
                if not emitted:
                    return  # rank 0 left early
                if not peers.leads:
                    cache.commit(last, budget.emit(emitted), verified)
                last, drafts = emitted[-1], next_drafts
                yield StepOutput(
                    emitted, min(num_accepted, room - 1), num_draft, *proposer.rates(), source=source
                )
        finally:
            if peers.leads and peers.group is not None and drafts is not None:
                # Left between cycles: the others are verifying the drafts sent last. Take part in
                # that pass, then tell them to stop.
                verifier.verify(last, drafts)
                peers.settle([], 0, None)
            peers.close()
            cache.drop_uncommitted()


def _kept_in(datastore: Datastore, steps: Generator[StepOutput, None, None]) -> Generator[StepOutput, None, None]:
    # What the target wrote drafts what follows: the reply goes into the datastore when it ends,
    # however it ends (a stop, the budget, a caller that stops reading).
    reply = []
    try:
        for step in steps:
            reply.extend(step.tokens)
            yield step
    finally:
        datastore.add(reply)


def stream_generate(
    model: nn.Module,
    draft: nn.Module | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    *,
    max_tokens: int = 256,
    parse_reasoning: bool = False,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Stream text from ``model`` with DFlash drafting by ``draft``.

    Args:
        model: The target model.
        draft: The DFlash drafter, or None for plain decoding through the same API.
        tokenizer: The target's tokenizer (an mlx-lm ``TokenizerWrapper``).
        prompt: Text (encoded as is: apply the chat template first) or token ids.
        max_tokens: The most tokens to generate.
        parse_reasoning: Split the reply's reasoning from its answer, for a prompt made by the
          chat template of a reasoning model (gpt-oss's harmony channels, ``<think>`` tags; see
          :mod:`dflash_mlx.reasoning`): ``text`` is then the answer and ``reasoning`` the rest,
          without their markers. A model without such a format gives the answer alone.
        kwargs: The remaining options (``block_size``, ``sampler``, ``prompt_cache``, ...) are
          passed to :func:`dflash_generate_step`; see it for what each does. Generation stops
          at the tokenizer's end-of-sequence tokens.

    Yields:
        GenerationResponse: One per cycle; the last one has ``finish_reason`` set.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        if not prompt:
            raise DFlashError("The prompt is empty: pass at least one character.")
        check_text(prompt)
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    ids = _prompt_ids(prompt)
    prompt_cache = kwargs.get("prompt_cache")
    reused = prompt_cache.reusable_prefix(ids) if prompt_cache is not None else 0
    stop_tokens = frozenset(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    parser = reasoning_parser(tokenizer, ids) if parse_reasoning else None

    steps = dflash_generate_step(ids, model, draft, max_tokens=max_tokens, stop_tokens=stop_tokens, **kwargs)
    tic = time.perf_counter()
    prompt_tps, generated, acceptance = 0.0, 0, AcceptanceStats()
    if kwargs.get("datastore") is not None:
        steps = _kept_in(kwargs["datastore"], steps)
    # On a Mac, mlx-lm's wired limit keeps the weights resident while it runs (a no-op elsewhere).
    with wired_limit(model, [generation_stream]):
        for step in steps:
            now = time.perf_counter()
            if generated == 0:
                prompt_tps = (len(ids) - reused) / max(now - tic, 1e-9)
                tic = now
            else:
                acceptance.add(step.num_draft, len(step.tokens), step.source)
            generated += len(step.tokens)
            finish = None
            tokens = list(step.tokens)
            if tokens[-1] in stop_tokens:
                tokens.pop()
                finish = "stop"
            elif generated >= max_tokens:
                finish = "length"
            for t in tokens:
                detokenizer.add_token(t)
            if finish:
                detokenizer.finalize()
            text, reasoning = detokenizer.last_segment, ""
            if parser is not None:
                text, reasoning = join(parser.feed(text) + (parser.flush() if finish else []))
            elapsed = max(now - tic, 1e-9)
            yield GenerationResponse(
                text=text,
                reasoning=reasoning,
                tokens=tokens,
                acceptance_length=len(step.tokens),
                mean_acceptance_length=acceptance.tau,
                cycle=acceptance.cycles,
                prompt_tokens=len(ids) - reused,
                prompt_tps=prompt_tps,
                generation_tokens=generated,
                generation_tps=(generated - 1) / elapsed if generated > 1 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                num_draft=step.num_draft,
                prompt_cached=reused,
                plain_tps=step.plain_tps,
                draft_tps=step.draft_tps,
                drafting_cycles=acceptance.drafting_cycles,
                plain_cycles=acceptance.plain_cycles,
                draft_source=step.source,
                accepted_by_source=dict(acceptance.by_source),
            )
            if finish:
                break


def generate(
    model: nn.Module,
    draft: nn.Module | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    verbose: bool = False,
    show_reasoning: bool = True,
    **kwargs,
) -> str:
    """Generate a complete response; see :func:`stream_generate` for the arguments.

    With ``parse_reasoning`` the returned text is the answer; ``verbose`` prints the reasoning
    before it, under ``Reasoning:`` (dimmed on a terminal) and apart from the answer by a
    line, unless ``show_reasoning`` is False.

    Returns:
        The generated text. With ``verbose`` it is also printed as it streams, followed
        by prompt/generation speed, mean acceptance length (tau, over drafting cycles only:
        :class:`dflash_mlx.responses.AcceptanceStats`) and peak memory.
    """
    text, response, acceptance = "", None, AcceptanceStats()
    dim, undim = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    in_reasoning = False
    if verbose and kwargs.get("prompt_cache") is None:
        # Kept, so that a run that never decoded plainly can time plain decoding afterwards.
        window = {k: kwargs.pop(k) for k in ("draft_window", "draft_sinks") if k in kwargs}
        kwargs["prompt_cache"] = make_cache(model, draft, **window)
    if verbose:
        print("=" * 10)
    # The rates a policy comes with were measured by earlier runs, not this one.
    policy = kwargs.get("policy") or getattr(kwargs.get("prompt_cache"), "policy", None)
    earlier = (policy.plain_tps, policy.draft_tps) if policy is not None else (None, None)
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text += response.text
        if verbose and show_reasoning and response.reasoning:
            if not in_reasoning:
                print("Reasoning:", flush=True)
                in_reasoning = True
            print(f"{dim}{response.reasoning}{undim}", end="", flush=True)
        if verbose and response.text:
            if in_reasoning:
                print("\n" + "-" * 10, flush=True)
                in_reasoning = False
            print(response.text, end="", flush=True)
        if response.cycle > 0:
            acceptance.add(response.num_draft, response.acceptance_length, response.draft_source)
    if verbose and response is not None:
        print()
        print("=" * 10)
        cached = f" ({response.prompt_cached} of them reused from the prompt cache)" if response.prompt_cached else ""
        print(
            f"Prompt: {response.prompt_tokens + response.prompt_cached} tokens{cached}, "
            f"{response.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        if draft is not None:
            # Drafting cycles by acceptance length: "length:cycles".
            hist = " ".join(f"{k}:{v}" for k, v in acceptance.lengths.items())
            print(f"Acceptance length: {acceptance.describe()}" + (f" [length:cycles {hist}]" if hist else "")
                  + (" (tau = tokens per drafting cycle)" if acceptance.drafting_cycles else ""))  # fmt: skip
            if len(acceptance.shares) > 1:
                print("Accepted drafts from: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in acceptance.shares.items()))
        if response.plain_tps is not None and response.draft_tps is not None:
            verdict = "slower" if response.drafting_slower else "faster"
            draft_when = " (measured by an earlier run)" if response.draft_tps == earlier[1] else ""
            plain_when = "measured by an earlier run" if response.plain_tps == earlier[0] else "measured"
            print(
                f"Drafting: {response.draft_tps:.3f} tokens-per-sec{draft_when}, {verdict} than plain decoding "
                f"({response.plain_tps:.3f} {plain_when}; {acceptance.plain_cycles} cycles decoded plainly)"
            )
        elif acceptance.drafting_cycles >= 4 and target_group(model) is None:
            # No plain cycle measured plain decoding; a few cycles say little. (A sharded target's
            # steps need every rank, and only rank 0 prints.)
            rate = plain_tokens_per_second(model, kwargs["prompt_cache"], sampler=kwargs.get("sampler"))
            if rate is not None:
                verdict = "slower" if response.generation_tps < rate else "faster"
                print(
                    f"Drafting: {response.generation_tps:.3f} tokens-per-sec, {verdict} than plain decoding "
                    f"({rate:.3f} in plain steps timed after the run; --no-draft decodes plainly)"
                )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        if sys.platform == "linux" and mx.default_device() == mx.cpu:
            print(f"BLAS: {blas_in_use()}")  # what every CPU number above depends on most
    return text
def policy_key(model: nn.Module, draft: DraftModel, setup: dict) -> str:
    """What the adaptive policy's verdict depends on: the machine, the target's shape and dtype,
    the drafter's weights (a checksum) and the drafting setup."""
    weights = mx.sum(draft.fc.weight.astype(mx.float32)).item()
    drafter = json.dumps([vars(draft.args), round(weights, 6)], sort_keys=True, default=str)
    ident = json.dumps([machine_key(), model_key(model), drafter, setup], sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


