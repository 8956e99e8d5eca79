"""DFlash generation: draft a block, verify it in one target pass, keep the agreed prefix.

Three layers, as in mlx-lm: ``dflash_generate_step`` (token ids), ``stream_generate``
(text and stats as ``GenerationResponse``), and ``generate`` (drains it).
"""

import sys
import time
from collections.abc import Generator
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .base.errors import DFlashError
from .cpu.openblas import blas_in_use
from .cpu.speedups import choose_speedups
from .drafts.build import make_proposer
from .drafts.datastore import Datastore, pair_datastore
from .drafts.lookup import PromptLookup
from .loop.batch import BatchEngine, RowRequest, batch_stream
from .loop.cache import DFlashCache, make_cache
from .loop.distributed import on_ranks, sharded_group, target_group
from .loop.options import Budget, LoopOptions
from .loop.plain_speed import plain_tokens_per_second
from .loop.proposal import Proposer
from .loop.verify import Verifier
from .models import target as tgt
from .models.drafter import DraftModel
from .sampling import is_greedy
from .text.inputs import check_text
from .text.reasoning import join, reasoning_parser
from .text.responses import AcceptanceStats, GenerationResponse
from .tuning.policy import PolicyState

# A stream for generation on whichever thread runs the generator (CLI or TUI worker).
generation_stream = mx.new_thread_local_stream(mx.default_device())
# The public calls' default datastore: the tools' default (drafts.datastore.pair_datastore).
AUTO = "auto"


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


def _prompt_ids(prompt) -> list[int]:
    if isinstance(prompt, mx.array):
        prompt = prompt.reshape(-1).tolist()
    ids = [int(t) for t in prompt]
    if not ids:
        raise DFlashError("The prompt is empty: pass at least one token or character.")
    return ids


def dflash_generate_step(
    prompt: mx.array | list[int],
    model: nn.Module,
    draft: DraftModel | PromptLookup | None,
    options: LoopOptions = LoopOptions(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    prompt_cache: DFlashCache | None = None,
    stream: mx.Stream = generation_stream,
) -> Generator[StepOutput, None, None]:
    """Generate token ids with DFlash speculative decoding.

    Every emitted token follows the target's own distribution under ``options.sampler`` (greedy
    by default), so greedy output equals the target's own greedy decoding token for token.

    Args:
        prompt: The prompt token ids (the chat template already applied).
        model: The target, an mlx-lm model; or its shard under ``mlx.launch``
          (:func:`dflash_mlx.load` splits it), where every rank calls this with the same
          arguments, rank 0 decides each cycle and the others yield its tokens
          (:mod:`dflash_mlx.loop.distributed`).
        draft: The DFlash drafter; a :class:`dflash_mlx.drafts.lookup.PromptLookup` to draft by
          prompt lookup alone; or None for plain decoding.
        options: How to decode (:class:`dflash_mlx.loop.options.LoopOptions`, checked when made).
        prompt_cache: A ``DFlashCache`` to continue from; its common prefix with
          ``prompt`` is reused and the rest is prefilled. Updated in place.
        stream: The MLX stream to run on.

    Yields:
        StepOutput: The tokens of each cycle with its acceptance counts.

    Raises:
        DFlashError: On an empty prompt, a ``block_size`` or ``tree_budget`` the pair cannot
          run; on a sharded target, ``block_size="auto"``, a draft tree or a DFlash2 drafter
          on a head split by vocabulary.
    """
    ids, o = _prompt_ids(prompt), options
    cache = prompt_cache
    if cache is None:
        cache = make_cache(model, draft, draft_window=o.draft_window, draft_sinks=o.draft_sinks, kernels=o.kernels)
    if isinstance(draft, DraftModel) and cache.draft is None:
        raise DFlashError("The prompt cache was made without a drafter; make it with make_cache(model, draft).")
    group = sharded_group(model, draft, o)  # None: one process
    sampler = None if is_greedy(o.sampler) else o.sampler
    speedups = choose_speedups(tgt.compute_dtype(model), o.cpu_speedups)
    proposer, block_size = make_proposer(model, draft, cache, o, sampler=sampler, speedups=speedups)
    budget = Budget(o.max_tokens, o.stop_tokens)
    # Always the whole block, cut to the budget after verifying: a seeded run then draws the same
    # random numbers whatever max_tokens is, so its text keeps its prefix.
    n = block_size - 1
    with mx.stream(stream):
        if o.seed is not None:
            mx.random.seed(o.seed)
        reuse = cache.resume(ids)  # the longest common prefix; at least one token is prefilled for its logits
        verifier = Verifier(
            model,
            cache,
            sampler=sampler,
            logits_processors=o.logits_processors,
            tap_ids=proposer.tap_ids,
            speedups=speedups,
            kernels=o.kernels,
            run_ahead=group is None,
        )
        proposer, verifier = on_ranks(group, proposer, verifier, block_size)
        try:
            last = verifier.prefill(ids[reuse:], o.prefill_step_size, proposer.drafter, o.prompt_progress_callback)
            emitted = budget.emit([last])
            # The next cycle's drafts, their pass already started; None when generation is over.
            drafts = proposer.propose(last, n) if budget.open else None
            yield StepOutput(emitted, 0, 0)
            while drafts is not None:
                room = budget.room  # the drafts past it count as neither drafted nor accepted
                verdict = verifier.verify(last, drafts, plain_next=room > 1 and proposer.plain_next())
                if not verdict.tokens:
                    return  # the generation was ended elsewhere (rank 0 of a sharded target left)
                # Rewind: the target forgets the rejected drafts, the proposer keeps the taps of the kept positions.
                emitted = budget.emit(verdict.tokens)
                cache.commit(last, emitted, verdict.cached)
                proposer.accept(len(emitted) - 1, verdict.taps)
                accepted, drafted = min(verdict.num_accepted, room - 1), min(drafts.size, room - 1)
                step = StepOutput(emitted, accepted, drafted, *proposer.rates(), source=drafts.source)
                # The next drafter pass starts before this cycle's tokens are handed out, so it runs
                # while the caller decodes and shows them.
                last = emitted[-1]
                drafts = proposer.propose(last, n) if budget.open else None
                yield step
        finally:
            verifier.finish()


def _datastore(choice, model: nn.Module, draft: nn.Module | None):
    # "auto", the public calls' default: what the tools draft from by default (pair_datastore).
    if not isinstance(choice, str):
        return choice
    if choice != AUTO:
        raise DFlashError(f"datastore must be 'auto', None or a Datastore (got {choice!r}).")
    return pair_datastore(model, draft)


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
          :mod:`dflash_mlx.text.reasoning`): ``text`` is then the answer and ``reasoning`` the rest,
          without their markers. A model without such a format gives the answer alone.
        kwargs: The remaining options (``block_size``, ``sampler``, ...) make the loop's
          :class:`~dflash_mlx.loop.options.LoopOptions`; see it for what each does. ``prompt_cache``
          and ``stream`` go to :func:`dflash_generate_step` as they are. Generation stops at the
          tokenizer's end-of-sequence tokens. ``datastore`` defaults to ``"auto"``, what the tools
          draft from by default: the default pair's shipped answers for its drafter, nothing for
          other pairs (:func:`dflash_mlx.drafts.datastore.pair_datastore`); None: prompt lookup alone.

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
    prompt_cache, stream = kwargs.pop("prompt_cache", None), kwargs.pop("stream", generation_stream)
    stop_tokens = frozenset(tokenizer.eos_token_ids)
    datastore = _datastore(kwargs.pop("datastore", AUTO), model, draft)
    options = LoopOptions(max_tokens=max_tokens, stop_tokens=stop_tokens, datastore=datastore, **kwargs)
    reused = prompt_cache.reusable_prefix(ids) if prompt_cache is not None else 0
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    parser = reasoning_parser(tokenizer, ids) if parse_reasoning else None

    steps = dflash_generate_step(ids, model, draft, options, prompt_cache=prompt_cache, stream=stream)
    tic = time.perf_counter()
    prompt_tps, generated, acceptance = 0.0, 0, AcceptanceStats()
    if options.datastore is not None:
        steps = _kept_in(options.datastore, steps)
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
        :class:`dflash_mlx.text.responses.AcceptanceStats`) and peak memory.
    """
    text, response, acceptance = "", None, AcceptanceStats()
    dim, undim = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    in_reasoning = False
    if verbose and kwargs.get("prompt_cache") is None:
        # Kept, so that a run that never decoded plainly can time plain decoding afterwards.
        window = {k: kwargs.pop(k) for k in ("draft_window", "draft_sinks") if k in kwargs}
        kwargs["prompt_cache"] = make_cache(model, draft, **window, kernels=kwargs.get("kernels", "auto"))
    if verbose:
        print("=" * 10)
    # The rates a policy comes with were measured by earlier runs, not this one.
    policy = kwargs.get("policy")
    earlier = (policy.plain_tps, policy.draft_tps) if policy is not None else (None, None)
    why_paused, paused_before = [], policy.paused_cycles if policy is not None else 0
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text += response.text
        if policy is not None and policy.paused_why and policy.paused_why not in why_paused:
            why_paused.append(policy.paused_why)  # each pause's reason, kept after it ends
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
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
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
        paused = policy.paused_cycles - paused_before if policy is not None else 0
        if paused:
            later = f"; later, {why_paused[-1]}" if len(why_paused) > 1 else ""
            print(
                f"Drafter paused for {paused} cycles of this run: {why_paused[0] if why_paused else 'drafting was timed slower than plain decoding'}{later}"
            )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        if sys.platform == "linux" and mx.default_device() == mx.cpu:
            print(f"BLAS: {blas_in_use()}")  # what every CPU number above depends on most
    return text


def batch_request(
    model: nn.Module,
    draft: DraftModel | PromptLookup | None,
    ids: list[int],
    options: LoopOptions = LoopOptions(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    prompt_cache: DFlashCache | None = None,
) -> RowRequest:
    """One request for the :class:`~dflash_mlx.loop.batch.BatchEngine`, drafting as
    :func:`dflash_generate_step` would with ``options`` (its proposer is built when the row joins).

    A draft tree (``tree_budget``) is verified whole while the row runs alone, and in a cycle it shares with
    other rows where the target's rows pass can place each node (else as its likeliest line).

    Raises:
        DFlashError: For what the engine does not batch: ``"auto"`` widths or trees, which time the row's own
          passes (the engine sizes every row's drafts from its batched passes instead).
    """
    o = options
    if o.tree_budget_for(model, draft) == "auto":
        raise DFlashError("tree_budget='auto' is not batched (it times one row's passes): pass a number of nodes.")
    if o.block_size == "auto":
        raise DFlashError("block_size='auto' is not batched (the engine sizes every row's drafts): pass a number.")
    block_size = o.block_size_for(draft)
    sampler = None if is_greedy(o.sampler) else o.sampler
    speedups = choose_speedups(tgt.compute_dtype(model), o.cpu_speedups)

    def proposer(cache: DFlashCache) -> Proposer:
        return make_proposer(model, draft, cache, o, sampler=sampler, speedups=speedups)[0]

    return RowRequest(_prompt_ids(ids), proposer, prompt_cache, o.max_tokens, o.stop_tokens, sampler,
                      o.logits_processors, block_size, o.seed)  # fmt: skip


def batch_engine(model: nn.Module, draft, *, max_batch: int = 8, prefill_step_size: int = 512,
                 cpu_speedups=None, kernels: str = "auto", costs=None) -> BatchEngine:  # fmt: skip
    """A :class:`~dflash_mlx.loop.batch.BatchEngine` for the pair (the drafter's taps, the CPU speedups);
    ``costs``, a :class:`~dflash_mlx.tuning.batch.BatchCosts` to continue (a server's, across engines)."""
    return BatchEngine(
        model, tap_ids=draft.target_layer_ids if isinstance(draft, DraftModel) else [], max_batch=max_batch,
        prefill_step_size=prefill_step_size, speedups=choose_speedups(tgt.compute_dtype(model), cpu_speedups),
        kernels=kernels, costs=costs,
    )  # fmt: skip


@dataclass
class BatchResponse:
    """:func:`batch_generate`'s answer, one entry per prompt in order: the text, its token ids (without
    the stop token), why it ended, and its drafting cycles' acceptance."""

    texts: list[str]
    tokens: list[list[int]]
    finish_reasons: list[str]
    acceptance: list[AcceptanceStats]


def batch_generate(
    model: nn.Module,
    draft: nn.Module | None,
    tokenizer: TokenizerWrapper,
    prompts: list[str | list[int]],
    *,
    max_tokens: int | list[int] = 256,
    max_batch: int = 8,
    verbose: bool = False,
    **kwargs,
) -> BatchResponse:
    """Generate replies to several prompts at once, drafting and verifying them together (like mlx-lm's
    ``batch_generate``). Each reply equals the one :func:`generate` gives its prompt alone (greedy: token
    for token; sampled: in distribution).

    Args:
        prompts: Texts (encoded as is: apply the chat template first) or token id lists.
        max_tokens: The most tokens of each reply (one for all, or one per prompt).
        max_batch: The most prompts decoded at once; the others start as earlier ones finish.
        verbose: Print each reply's progress count and the totals.
        kwargs: :class:`~dflash_mlx.loop.options.LoopOptions` for every prompt (``block_size``,
          ``sampler``, ``datastore``, ...), and ``prefill_step_size``, the prompt tokens a joining
          prompt prefills per cycle.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    if len(limits) != len(prompts):
        raise DFlashError(f"max_tokens has {len(limits)} entries for {len(prompts)} prompts: give one per prompt.")
    stop_tokens = frozenset(tokenizer.eos_token_ids)
    kwargs.setdefault("policy", PolicyState())  # what the adaptive policy learns, shared by the rows
    kwargs["datastore"] = _datastore(kwargs.get("datastore", AUTO), model, draft)
    engine = batch_engine(model, draft, max_batch=max_batch, prefill_step_size=kwargs.get("prefill_step_size", 512),
                          cpu_speedups=kwargs.get("cpu_speedups"), kernels=kwargs.get("kernels", "auto"))  # fmt: skip
    order = {}
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        if isinstance(prompt, str):
            if not prompt:
                raise DFlashError(f"Prompt {i} is empty: pass at least one character.")
            check_text(prompt)
            bos = tokenizer.bos_token
            prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        options = LoopOptions(max_tokens=limit, stop_tokens=stop_tokens, **kwargs)
        request = batch_request(model, draft, prompt, options)
        order[engine.add(request, partial(make_cache, model, draft, kernels=options.kernels))] = i
    n = len(prompts)
    tokens, finish, acceptance = [[] for _ in range(n)], [""] * n, [AcceptanceStats() for _ in range(n)]
    datastore = kwargs.get("datastore")
    with wired_limit(model, [batch_stream]):
        while not engine.idle:
            for event in engine.step():
                i = order[event.id]
                if event.tokens and not event.prompt_tokens:  # the prefill's token is no cycle
                    acceptance[i].add(event.num_draft, len(event.tokens), event.source)
                tokens[i].extend(event.tokens)
                if event.finish:
                    finish[i] = event.finish
                    if datastore is not None:
                        datastore.add(tokens[i])
                    if verbose:
                        print(f"[{i}] {len(tokens[i])} tokens ({event.finish})", flush=True)
    texts = []
    for i in range(n):
        if tokens[i] and tokens[i][-1] in stop_tokens:
            tokens[i].pop()
        texts.append(tokenizer.decode(tokens[i]))
    if verbose:
        print(f"BLAS: {blas_in_use()}" if sys.platform == "linux" and mx.default_device() == mx.cpu else "")
    return BatchResponse(texts, tokens, finish, acceptance)
