"""DFlash generation: draft a block, verify it in one target pass, keep the agreed prefix.

Three layers, as in mlx-lm: ``dflash_generate_step`` (token ids), ``stream_generate``
(text and stats as ``GenerationResponse``), and ``generate`` (drains it).
"""

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Generator, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .adaptive import PolicyState, PolicyStore
from .cache import DFlashCache, check_draft_window, make_cache
from .chat_template import has_chat_template, render_chat
from .cli.options import add_cycle_arguments  # noqa: F401 (dflash-serve imports it from here)
from .cli.options import (
    MAX_SEED,
    ArgumentParser,
    InRange,
    add_blas_argument,
    add_decoding_arguments,
    add_model_arguments,
    add_stop_tokens,
    add_window_arguments,
    block_size_problem,
    boolean_words,
    str2bool,
)
from .cpu.openblas import blas_in_use
from .cpu.speedups import CpuSpeedups
from .cpu.speedups import choose_speedups
from .errors import DFlashError
from .lookup import LookupProposer, PromptLookup
from .models import drafter2
from .models import target as tgt
from .models.drafter import DraftModel
from .plain_speed import plain_tokens_per_second
from .proposer import AdaptiveProposer, DFlashProposer, FallbackProposer, PlainProposer, SelectorProposer
from .reasoning import join, reasoning_parser
from .responses import AcceptanceStats, GenerationResponse
from .sampling import can_sample_proposals, check_proposal, make_sampler
from .verify import Verdict, Verifier
from .verify_width import VerifyWidth, machine_key, model_key

SampleFn = Callable[[mx.array], mx.array]  # any mlx-lm sampler: logprobs -> token ids
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# A stream for generation on whichever thread runs the generator (CLI or TUI worker).
generation_stream = mx.new_thread_local_stream(mx.default_device())


class StepOutput(NamedTuple):
    """One cycle of ``dflash_generate_step``.

    ``tokens`` are the new tokens (accepted drafts then the bonus token), ``num_accepted``
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


def resolve_block_size(draft: nn.Module | None, block_size: int | str | None) -> int:
    """Check ``block_size`` against the drafter; None and ``"auto"`` mean the drafter's trained
    size (``"auto"`` verifies a chosen prefix of it each cycle)."""
    if block_size == "auto":
        if not isinstance(draft, DraftModel):
            raise DFlashError("block_size='auto' chooses how many of a DFlash drafter's drafts to verify: "
                              "pass a DFlash drafter, or a fixed block size.")  # fmt: skip
        return draft.block_size
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


def _check_cycle_settings(max_tokens: int, min_confidence: float, lookup_fallback: int, proposal: str) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise DFlashError(f"max_tokens must be a positive integer (got {max_tokens!r}).")
    check_proposal(proposal)
    if not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence <= 1.0:
        raise DFlashError(f"min_confidence must be a probability from 0 to 1 (got {min_confidence!r}).")
    if not isinstance(lookup_fallback, int) or isinstance(lookup_fallback, bool) or lookup_fallback < 0:
        raise DFlashError(f"lookup_fallback must be a non-negative integer of cycles (got {lookup_fallback!r}).")


def _make_proposer(
    model, draft, cache, *, sampler, proposal, min_confidence, lookup_fallback, policy, speedups, block_size,
    auto=False,
):  # fmt: skip
    # Plain decoding; prompt lookup alone; the drafter, with the lookup fallback, paused while
    # it loses to plain decoding (with a policy). Block size 1 never drafts.
    if draft is None:
        return PlainProposer()
    if isinstance(draft, PromptLookup):
        lookup = LookupProposer(draft, cache.tokens)
        return PlainProposer(lookup) if block_size == 1 else lookup
    sample = proposal == "sample" and can_sample_proposals(sampler)
    if isinstance(draft, drafter2.DraftModel):
        # Its drafts are a path through the selector, with no per-draft confidence to cut or size blocks by.
        if auto or min_confidence > 0:
            raise DFlashError("A DFlash2 drafter verifies whole blocks: use a fixed block_size and min_confidence=0.")
        drafter = SelectorProposer(model, draft, cache, sampler=sampler if sample else None, speedups=speedups)
    else:
        width = VerifyWidth(model, draft, cache, speedups) if auto else None
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
    paused = LookupProposer(PromptLookup(policy.lookup + 1), cache.tokens) if policy.lookup else None
    return AdaptiveProposer(drafter, policy, paused)


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
    seed: int | None = None,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
    prompt_cache: DFlashCache | None = None,
    prefill_step_size: int = 512,
    cpu_speedups: CpuSpeedups | bool | None = None,
    stream: mx.Stream = generation_stream,
) -> Generator[StepOutput, None, None]:
    """Generate token ids with DFlash speculative decoding.

    Every emitted token follows the target's own distribution under ``sampler`` (greedy by
    default), so greedy output equals the target's own greedy decoding token for token.

    Args:
        prompt: The prompt token ids (the chat template already applied).
        model: The target, an mlx-lm model.
        draft: The DFlash drafter; a :class:`dflash_mlx.lookup.PromptLookup` to draft by
          prompt lookup alone; or None for plain decoding.
        block_size: Tokens verified per cycle, 1..drafter's trained size (default), or
          ``"auto"``: each cycle, the number of drafts that gives the most tokens per second,
          from the measured cost of verify passes of each width at this context (kept on disk,
          :mod:`dflash_mlx.verify_width`) and the drafter's confidences, scaled by how often they
          were right so far. Same output either way.
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
        seed: Seed MLX's random generator first: the same seed gives the same output.
        stop_tokens: Generation ends right after the first of these, even mid-block.
        prompt_cache: A ``DFlashCache`` to continue from; its common prefix with
          ``prompt`` is reused and the rest is prefilled. Updated in place.
        prefill_step_size: Prompt tokens per prefill chunk.
        cpu_speedups: None (default) uses the CPU speedups where they pay (float32 on MLX's
          CPU backend; :func:`dflash_mlx.cpu.speedups.choose_speedups`); False runs the portable path
          an Apple GPU takes; True or a ``CpuSpeedups`` forces them. Same tokens either way.
        stream: The MLX stream to run on.

    Yields:
        StepOutput: The tokens of each cycle with its acceptance counts.

    Raises:
        DFlashError: On an empty prompt, ``max_tokens < 1``, a bad ``block_size``,
          ``proposal``, ``min_confidence`` or ``lookup_fallback``.
    """
    ids = _prompt_ids(prompt)
    _check_cycle_settings(max_tokens, min_confidence, lookup_fallback, proposal)
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise DFlashError(f"seed must be an integer from 0 to {MAX_SEED} (got {seed!r}).")
    auto = block_size == "auto"
    if auto and min_confidence > 0:
        raise DFlashError("block_size='auto' chooses each cycle's drafts itself; leave min_confidence at 0.")
    block_size = resolve_block_size(draft, block_size)
    sampler = None if is_greedy(sampler) else sampler
    if prompt_cache is None:
        cache = make_cache(model, draft, draft_window=draft_window, draft_sinks=draft_sinks)
    else:
        check_draft_window(draft_window, draft_sinks)
        cache = prompt_cache
    if isinstance(draft, DraftModel) and cache.draft is None:
        raise DFlashError(
            "The prompt cache was made without a drafter; make it with make_cache(model, draft)."
        )
    speedups = choose_speedups(tgt.compute_dtype(model), cpu_speedups)
    adaptive = seed is None if adaptive is None else adaptive
    # The policy paces the DFlash drafter; with block 1 it never drafts, so it is left alone.
    if not (adaptive and isinstance(draft, DraftModel) and block_size > 1):
        policy = None
    elif policy is None:
        policy = cache.policy
    proposer = _make_proposer(
        model, draft, cache, sampler=sampler, proposal=proposal, min_confidence=min_confidence,
        lookup_fallback=lookup_fallback, policy=policy, speedups=speedups, block_size=block_size, auto=auto,
    )
    verifier = Verifier(
        model, cache, sampler=sampler, logits_processors=logits_processors, tap_ids=proposer.tap_ids,
        speedups=speedups, draft=draft if isinstance(draft, DraftModel) else None,
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
        last = verifier.prefill(ids[reuse:], prefill_step_size)
        yield StepOutput(budget.emit([last]), 0, 0)

        # A plain step queued before the host read the one before it, as mlx-lm's generate_step
        # pipelines plain decoding: (its token, its taps). Taken back if unused.
        ahead = None
        try:
            # The next cycle's drafts, their pass already started; None when generation is over.
            drafts = proposer.propose(last, n) if budget.open else None
            while drafts is not None:
                num_draft = drafts.size
                if num_draft == 0 and verifier.can_run_ahead:
                    if ahead is None:
                        ahead = verifier.step(mx.array([last]), lambda: cache.tokens)
                        mx.async_eval(ahead[0])
                    (token, taps), ahead = ahead, None
                    if budget.room > 1 and proposer.plain_next():
                        ahead = verifier.step(token, lambda: cache.tokens + [last])
                        mx.async_eval(ahead[0])
                    verdict = Verdict(0, [token.item()], taps)
                else:
                    if ahead is not None:  # the cycle drafts after all
                        cache.trim_target(1)
                        ahead = None
                    verdict = verifier.verify(last, drafts)
                room = budget.room  # the drafts past it count as neither drafted nor accepted
                emitted = budget.emit(verdict.tokens)
                # Rewind: the target forgets the rejected drafts, the proposer keeps the taps
                # of the kept positions.
                cache.commit(last, emitted, verified=num_draft + 1)
                proposer.accept(len(emitted), verdict.taps)
                last = emitted[-1]
                # The next drafter pass starts before this cycle's tokens are handed out, so it
                # runs while the caller decodes and shows them.
                drafts = proposer.propose(last, n) if budget.open else None
                rates = (policy.plain_tps, policy.draft_tps) if policy is not None else (None, None)
                yield StepOutput(emitted, min(verdict.num_accepted, room - 1), min(num_draft, room - 1), *rates)
        finally:
            cache.drop_uncommitted()


def stream_generate(
    model: nn.Module,
    draft: nn.Module | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    *,
    max_tokens: int = 256,
    block_size: int | str | None = None,
    sampler: SampleFn | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    proposal: str = "sample",
    min_confidence: float = 0.0,
    lookup_fallback: int = 0,
    adaptive: bool | None = None,
    policy: PolicyState | None = None,
    draft_window: int | None = None,
    draft_sinks: int = 4,
    seed: int | None = None,
    prompt_cache: DFlashCache | None = None,
    prefill_step_size: int = 512,
    cpu_speedups: CpuSpeedups | bool | None = None,
    parse_reasoning: bool = False,
) -> Generator[GenerationResponse, None, None]:
    """Stream text from ``model`` with DFlash drafting by ``draft``.

    Args:
        model: The target model.
        draft: The DFlash drafter, or None for plain decoding through the same API.
        tokenizer: The target's tokenizer (an mlx-lm ``TokenizerWrapper``).
        prompt: Text (encoded as is: apply the chat template first) or token ids.
        max_tokens: The most tokens to generate.
        block_size: Tokens verified per cycle; defaults to the drafter's block size; ``"auto"``
          chooses each cycle's (see :func:`dflash_generate_step`).
        sampler: ``logprobs -> ids``; greedy when None.
        logits_processors: mlx-lm logits processors applied to the target's logits.
        proposal: ``"greedy"`` or ``"sample"`` drafts; see :func:`dflash_generate_step`.
        min_confidence: Verify only the drafter's confident leading drafts (0: the whole
          block); see :func:`dflash_generate_step`.
        lookup_fallback: Draft by prompt lookup for up to this many cycles after the
          drafter misses its first draft (0: never); see :func:`dflash_generate_step`.
        adaptive: Decode plainly while drafting is measured slower than plain decoding
          (None: unless ``seed`` is given); see :func:`dflash_generate_step`.
        policy: The adaptive policy's state to continue (None: the ``prompt_cache``'s, else a
          fresh one); see :func:`dflash_generate_step`.
        draft_window: The drafter sees the taps of the first ``draft_sinks`` and the latest
          ``draft_window`` positions only (None: all); see :func:`dflash_generate_step`.
        draft_sinks: The leading positions a ``draft_window`` keeps.
        seed: Seed for sampling; the same seed gives the same output.
        prompt_cache: A ``DFlashCache`` to reuse across calls (multi-turn chat).
        prefill_step_size: Prompt tokens per prefill chunk.
        cpu_speedups: The CPU speedups (None: where they pay); see :func:`dflash_generate_step`.
        parse_reasoning: Split the reply's reasoning from its answer, for a prompt made by the
          chat template of a reasoning model (gpt-oss's harmony channels, ``<think>`` tags; see
          :mod:`dflash_mlx.reasoning`): ``text`` is then the answer and ``reasoning`` the rest,
          without their markers. A model without such a format gives the answer alone.

    Yields:
        GenerationResponse: One per cycle; the last one has ``finish_reason`` set.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        if not prompt:
            raise DFlashError("The prompt is empty: pass at least one character.")
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    ids = _prompt_ids(prompt)
    reused = prompt_cache.reusable_prefix(ids) if prompt_cache is not None else 0
    stop_tokens = frozenset(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    parser = reasoning_parser(tokenizer, ids) if parse_reasoning else None

    steps = dflash_generate_step(
        ids,
        model,
        draft,
        block_size=block_size,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        proposal=proposal,
        min_confidence=min_confidence,
        lookup_fallback=lookup_fallback,
        adaptive=adaptive,
        policy=policy,
        draft_window=draft_window,
        draft_sinks=draft_sinks,
        seed=seed,
        stop_tokens=stop_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        cpu_speedups=cpu_speedups,
    )
    tic = time.perf_counter()
    prompt_tps, generated, acceptance = 0.0, 0, AcceptanceStats()
    # On a Mac, mlx-lm's wired limit keeps the weights resident while it runs (a no-op elsewhere).
    with wired_limit(model, [generation_stream]):
        for step in steps:
            now = time.perf_counter()
            if generated == 0:
                prompt_tps = (len(ids) - reused) / max(now - tic, 1e-9)
                tic = now
            else:
                acceptance.add(step.num_draft, len(step.tokens))
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
            acceptance.add(response.num_draft, response.acceptance_length)
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
            print(f"Acceptance length: {acceptance.describe()}" + (f" [length:cycles {hist}]" if hist else ""))
        if response.plain_tps is not None and response.draft_tps is not None:
            verdict = "slower" if response.drafting_slower else "faster"
            print(
                f"Drafting: {response.draft_tps:.3f} tokens-per-sec, {verdict} than plain decoding "
                f"({response.plain_tps:.3f} measured; {acceptance.plain_cycles} cycles decoded plainly)"
            )
        elif acceptance.drafting_cycles >= 4:  # no plain cycle measured plain decoding; a few cycles say little
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


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dflash-generate", description="Generate text with DFlash speculative decoding.")
    add_model_arguments(parser)
    add_blas_argument(parser)
    parser.add_argument("--prompt", "-p", default="Hello", help="The prompt ('-' reads stdin; default: 'Hello').")
    add_decoding_arguments(parser, max_tokens=256)
    add_window_arguments(parser)
    parser.add_argument(
        "--top-p", type=float, action=InRange, low=0.0, high=1.0, default=0.0,
        help="Nucleus sampling threshold (default: 0, off).",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=int, action=InRange, low=0, default=0,
        help="Sample from the k most likely tokens (default: 0, off).",
    )  # fmt: skip
    parser.add_argument(
        "--min-p", type=float, action=InRange, low=0.0, high=1.0, default=0.0,
        help="Min-p sampling threshold (default: 0, off).",
    )  # fmt: skip
    parser.add_argument(
        "--repetition-penalty", type=float, action=InRange, low=0.0, low_open=True, default=None,
        help="Penalty for repeating recent tokens, e.g. 1.1 (default: none).",
    )  # fmt: skip
    parser.add_argument(
        "--proposal", choices=["greedy", "sample"], default="sample",
        help="How the drafter proposes when sampling (default: sample).",
    )  # fmt: skip
    parser.add_argument(
        "--adaptive",
        type=boolean_words(("true",), ("false",)),
        default=None,
        metavar="{true,false}",
        help="Pause the drafter while drafting is measured slower than decoding without it, drafting again "
        "later (same distribution; default: true, false with --seed, whose output would depend on timings). What "
        "it measured is kept per pair, setup and machine in ~/.cache/dflash-mlx/policy.json, where the next run "
        "goes on from it.",
    )
    parser.add_argument(
        "--paused-lookup", type=int, action=InRange, low=0, default=1, metavar="N",
        help="While --adaptive pauses the drafter, verify up to N prompt-lookup drafts a cycle (no drafter pass; "
        "default: 1, which a small target verifies at about a plain step's cost; 0: plain steps).",
    )
    parser.add_argument("--seed", type=int, action=InRange, low=0, high=MAX_SEED, default=None,
                        help="Random seed for sampling (default: none).")  # fmt: skip
    parser.add_argument(
        "--ignore-chat-template", action="store_true", help="Use the prompt as is, without the chat template."
    )
    parser.add_argument(
        "--hide-reasoning", action="store_true",
        help="Print only the answer of a reasoning model (gpt-oss's final channel, the text after </think>), "
        "not its reasoning, which is otherwise printed first under 'Reasoning:'. With --verbose F only the "
        "answer is printed either way.",
    )  # fmt: skip
    parser.add_argument(
        "--max-kv-size", type=int, action=InRange, low=1, default=None,
        help="Keep only the last this many tokens' keys and values (a rotating cache), with --no-draft: "
        "DFlash rolls back rejected drafts, which a rotating cache cannot (default: no limit).",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", type=str2bool, default=True,
        help="True/T: the text as it streams, then the statistics; False/F: only the text (default: True).",
    )  # fmt: skip
    return parser


def policy_key(model: nn.Module, draft: DraftModel, setup: dict) -> str:
    """What the adaptive policy's verdict depends on: the machine, the target's shape and dtype,
    the drafter's weights (a checksum) and the drafting setup."""
    weights = mx.sum(draft.fc.weight.astype(mx.float32)).item()
    drafter = json.dumps([vars(draft.args), round(weights, 6)], sort_keys=True, default=str)
    ident = json.dumps([machine_key(), model_key(model), drafter, setup], sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _window_cache(model: nn.Module, max_kv_size: int) -> DFlashCache:
    """An empty target cache that keeps the last ``max_kv_size`` tokens (mlx-lm's rotating
    cache). Plain decoding only: it never rolls back. Prefilled with mlx-lm's step (2048),
    it gives ``mlx_lm generate``'s output (see ``Verifier.prefill``)."""
    from mlx_lm.models.cache import make_prompt_cache

    return DFlashCache(make_prompt_cache(model, max_kv_size=max_kv_size))


def main(argv: list[str] | None = None) -> None:
    from .weights.loading import draft_for_cli, load

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        parser.error("--prompt is empty: pass at least one character.")
    try:
        draft_arg = draft_for_cli(args.model, args.draft, args.no_draft)
        model, draft, tokenizer = load(args.model, draft_arg, dtype=args.dtype)
        if draft is None and not args.no_draft:
            print("dflash-generate: no drafter given or known for this target: plain decoding "
                  "(pass --draft for DFlash).", file=sys.stderr)
        if args.no_draft:
            draft = None
        problem = block_size_problem(args.block_size, draft.block_size if draft is not None else None)
        if problem:
            raise DFlashError(problem)
        if args.max_kv_size is not None and draft is not None:
            raise DFlashError(
                "--max-kv-size needs plain decoding (--no-draft): DFlash rolls back the cache after a "
                "rejected draft, which a rotating cache cannot do once it is full."
            )
        add_stop_tokens(tokenizer, args.extra_eos_token)
        # A reply to a chat prompt may carry reasoning; a raw prompt's text is left as it comes.
        parse_reasoning = not args.ignore_chat_template and has_chat_template(tokenizer)
        if not args.ignore_chat_template:
            prompt = render_chat(tokenizer, [{"role": "user", "content": prompt}], system_prompt=args.system_prompt,
                                 template_args=args.chat_template_config)  # fmt: skip
        cache = _window_cache(model, args.max_kv_size) if args.max_kv_size is not None else None
        # One-shot runs go on from what earlier ones measured of this pair on this machine.
        adaptive = args.seed is None if args.adaptive is None else args.adaptive
        store = key = policy = None
        if adaptive and isinstance(draft, DraftModel):
            setup = {k: getattr(args, k) for k in ("block_size", "temp", "top_p", "min_p", "top_k", "proposal",
                                                   "min_confidence", "lookup_fallback", "draft_window",
                                                   "paused_lookup")}  # fmt: skip
            store, key = PolicyStore(), policy_key(model, draft, setup)
            policy = store.get(key, lookup=args.paused_lookup)
        text = generate(
            model,
            draft,
            tokenizer,
            prompt,
            verbose=args.verbose,
            show_reasoning=not args.hide_reasoning,
            parse_reasoning=parse_reasoning,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            sampler=make_sampler(args.temp, args.top_p, args.min_p, args.top_k),
            logits_processors=make_logits_processors(repetition_penalty=args.repetition_penalty),
            proposal=args.proposal,
            min_confidence=args.min_confidence,
            lookup_fallback=args.lookup_fallback,
            adaptive=args.adaptive,
            policy=policy,
            draft_window=args.draft_window,
            draft_sinks=args.draft_sinks,
            seed=args.seed,
            prompt_cache=cache,
            # mlx-lm's prefill step: with a rotating window (--max-kv-size) the chunks shape the output.
            prefill_step_size=2048 if cache is not None else 512,
        )
        if store is not None:
            store.put(key, policy)
        if not args.verbose:
            print(text)  # the text alone, as mlx_lm.generate does
    except DFlashError as e:
        print(f"dflash-generate: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
