"""DFlash generation: draft a block, verify it in one target pass, keep the agreed prefix.

Three layers, as in mlx-lm: ``dflash_generate_step`` (token ids), ``stream_generate``
(text and stats as ``GenerationResponse``), and ``generate`` (drains it).
"""

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Generator, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import target as tgt
from .cache import DFlashCache, make_cache
from .cli import (
    ArgumentParser,
    InRange,
    add_cycle_arguments,  # noqa: F401 (dflash-serve imports it from here)
    add_decoding_arguments,
    add_model_arguments,
    add_stop_tokens,
    block_size_problem,
    str2bool,
)
from .errors import DFlashError
from .lookup import PromptLookupDraft
from .sampling import (
    accept_one_hot,
    can_sample_proposals,
    check_proposal,
    make_sampler,
    speculative_accept,
    top_probability,
)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# A stream for generation on whichever thread runs the generator (CLI or TUI worker).
generation_stream = mx.new_thread_local_stream(mx.default_device())


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class StepOutput(NamedTuple):
    """One cycle of ``dflash_generate_step``.

    ``tokens`` are the new tokens (accepted drafts then the bonus token), ``num_accepted``
    how many of the ``num_draft`` drafted tokens the target agreed with. The prefill's
    first token comes alone with ``num_draft == 0``.
    """

    tokens: list[int]
    num_accepted: int
    num_draft: int


def resolve_block_size(draft: nn.Module | None, block_size: int | None) -> int:
    """Check ``block_size`` against the drafter; None means the drafter's trained size."""
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


# A verify pass starts running after every this many target layers are built: building its
# graph in Python takes longer than a drafter pass takes to run on MLX's CPU backend, and
# the stream would otherwise wait for all of it (1-3 measured within noise of each other).
_VERIFY_START_EVERY = 3


def dflash_generate_step(
    prompt: mx.array | list[int],
    model: nn.Module,
    draft: nn.Module | None,
    *,
    block_size: int | None = None,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    proposal: str = "sample",
    min_confidence: float = 0.0,
    lookup_fallback: int = 0,
    seed: int | None = None,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
    prompt_cache: DFlashCache | None = None,
    prefill_step_size: int = 512,
    stream: mx.Stream = generation_stream,
) -> Generator[StepOutput, None, None]:
    """Generate token ids with DFlash speculative decoding.

    Every emitted token follows the target's own distribution under ``sampler`` (greedy by
    default), so greedy output equals the target's own greedy decoding token for token.

    Args:
        prompt: The prompt token ids (the chat template already applied).
        model: The target, an mlx-lm model.
        draft: The DFlash drafter, or None for plain decoding.
        block_size: Tokens verified per cycle, 1..drafter's trained size (default).
        max_tokens: The most tokens to generate.
        sampler: ``logprobs -> token ids``: :func:`dflash_mlx.sampling.make_sampler` or any
          mlx-lm sampler. Greedy when None.
        logits_processors: mlx-lm logits processors (e.g. a repetition penalty), applied to
          the target's logits at every position with that position's preceding tokens.
        proposal: ``"sample"`` (default) draws drafts from the drafter's distribution when
          ``sampler`` is a non-greedy :class:`dflash_mlx.sampling.Sampler`; ``"greedy"``, or any
          other sampler, drafts the drafter's argmax. At temperature 0 both are the greedy path.
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
        seed: Seed MLX's random generator first: the same seed gives the same output.
        stop_tokens: Generation ends right after the first of these, even mid-block.
        prompt_cache: A ``DFlashCache`` to continue from; its common prefix with
          ``prompt`` is reused and the rest is prefilled. Updated in place.
        prefill_step_size: Prompt tokens per prefill chunk.
        stream: The MLX stream to run on.

    Yields:
        StepOutput: The tokens of each cycle with its acceptance counts.

    Raises:
        DFlashError: On an empty prompt, ``max_tokens < 1``, a bad ``block_size``,
          ``proposal``, ``min_confidence`` or ``lookup_fallback``.
    """
    ids = _prompt_ids(prompt)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise DFlashError(f"max_tokens must be a positive integer (got {max_tokens!r}).")
    block_size = resolve_block_size(draft, block_size)
    check_proposal(proposal)
    if not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence <= 1.0:
        raise DFlashError(f"min_confidence must be a probability from 0 to 1 (got {min_confidence!r}).")
    if not isinstance(lookup_fallback, int) or isinstance(lookup_fallback, bool) or lookup_fallback < 0:
        raise DFlashError(f"lookup_fallback must be a non-negative integer of cycles (got {lookup_fallback!r}).")
    lookup = PromptLookupDraft() if lookup_fallback and draft is not None else None
    # Greedy needs only the argmax: normalising 16 rows of logits costs a verify pass about
    # a millisecond on MLX's CPU backend, whose exp is slow.
    greedy = sampler is None or sampler is _greedy or getattr(sampler, "greedy", False) is True
    sampler = _greedy if greedy else sampler
    sample_proposals = proposal == "sample" and can_sample_proposals(sampler)
    cache = prompt_cache if prompt_cache is not None else make_cache(model, draft)
    if draft is not None and cache.draft is None:
        raise DFlashError(
            "The prompt cache was made without a drafter; make it with make_cache(model, draft)."
        )
    tap_ids = draft.target_layer_ids if cache.draft else []
    mask_id = draft.mask_token_id if draft is not None else None

    def _logprobs(logits: mx.array, block: mx.array | None = None) -> mx.array:
        # Row i of a verified block sees the cached tokens plus block[: i + 1].
        if logits_processors:
            seen = mx.array(cache.tokens, dtype=mx.uint32)
            rows = []
            for i in range(logits.shape[0]):
                tokens = seen if block is None else mx.concatenate([seen, block[0, : i + 1]])
                row = logits[i : i + 1]
                for processor in logits_processors:
                    row = processor(tokens, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        if greedy:
            return logits  # the argmax of the logprobs, without computing them
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _prefill(tokens: list[int]) -> mx.array:
        for i in range(0, len(tokens), prefill_step_size):
            chunk = tokens[i : i + prefill_step_size]
            logits, taps = tgt.forward_with_taps(model, mx.array(chunk)[None], cache.target, tap_ids)
            cache.append_pending(taps)
            cache.tokens.extend(chunk)
            mx.eval(logits, cache.pending, [c.state for c in cache.target])
        return logits[0, -1:]

    def _draft_block(last: int, num_draft: int) -> tuple[mx.array, mx.array | None]:
        # The drafter always sees its trained block: [last, MASK x (B-1)].
        block = mx.array([[last] + [mask_id] * (draft.block_size - 1)], dtype=mx.uint32)
        draft_logits = draft.propose(model, block, cache.take_pending(), cache.draft, history=cache.tokens)
        draft_logits = draft_logits[0, :num_draft]  # a proposer may offer fewer tokens
        if draft_logits.shape[0] == 0:
            return mx.zeros((0,), dtype=mx.uint32), None
        if not sample_proposals:
            drafts, q = mx.argmax(draft_logits, axis=-1).astype(mx.uint32), None
        else:
            q = sampler.probs(draft_logits - mx.logsumexp(draft_logits, axis=-1, keepdims=True))
            drafts = mx.random.categorical(mx.log(q)).astype(mx.uint32)  # (num_draft,), (num_draft, V)
        if min_confidence > 0 and drafts.shape[0] > 1:
            drafts, q = _confident_prefix(draft_logits, drafts, q)
        return drafts, q

    def _confident_prefix(draft_logits, drafts, q):
        # The cut depends on the drafter alone, so verifying the shorter block is still exact.
        if q is None:  # greedy drafts are the argmax, so their probability is the top one
            conf = top_probability(draft_logits)
        else:
            conf = mx.take_along_axis(q, drafts[:, None].astype(mx.int32), axis=-1)[:, 0]
        confident = (conf >= min_confidence).tolist()
        k = 1
        while k < len(confident) and confident[k - 1] and confident[k]:
            k += 1
        return drafts[:k], None if q is None else q[:k]

    def _rewind(num_kept: int, num_verified: int, taps: mx.array | None) -> None:
        for c in cache.target:
            c.trim(num_verified - num_kept)
        cache.append_pending(None if taps is None else taps[:, :num_kept])

    with mx.stream(stream):
        if seed is not None:
            mx.random.seed(seed)
        # Reuse the longest common prefix; at least one token is prefilled for its logits.
        reuse = cache.reusable_prefix(ids)
        cache.trim_to(reuse)
        last = sampler(_logprobs(_prefill(ids[reuse:]))).item()
        yield StepOutput([last], 0, 0)
        generated, stopped = 1, last in stop_tokens

        # Lookup cycles still to run, and how many the drafter's next first-draft miss buys.
        lookup_cycles, next_fallback = 0, 1

        def _propose() -> tuple[mx.array, mx.array | None, bool, int]:
            # The block to verify next, [last, drafts...], with the drafter's pass started.
            nonlocal lookup_cycles
            num_draft = min(block_size, max_tokens - generated) - 1
            block, q, drafter_cycle = mx.array([[last]], dtype=mx.uint32), None, False
            if num_draft > 0 and lookup_cycles > 0:
                # The taps stay pending: the drafter's next pass takes them all in.
                lookup_cycles -= 1
                found = lookup.lookup(cache.tokens + [last], num_draft)
                num_draft = len(found)
                block = mx.array([[last] + found], dtype=mx.uint32)
            elif num_draft > 0:
                drafts, q = _draft_block(last, num_draft)
                num_draft, drafter_cycle = drafts.shape[0], True
                # Start drafting now, so the verify graph below is built while it runs.
                mx.async_eval(drafts)
                block = mx.concatenate([block, drafts[None]], axis=1)
            return block, q, drafter_cycle, num_draft

        try:
            proposal = _propose() if generated < max_tokens and not stopped else None
            while proposal is not None:
                block, q, drafter_cycle, num_draft = proposal
                verify_size = num_draft + 1
                logits, taps = tgt.forward_with_taps(
                    model, block, cache.target, tap_ids, start_every=_VERIFY_START_EVERY
                )
                logprobs = _logprobs(logits[0], block)
                if q is None:
                    # One-hot proposals: keep the drafts that the target's own samples match.
                    target_tokens = sampler(logprobs)  # (verify_size,)
                    passed = accept_one_hot(block[0, 1:], target_tokens)
                else:
                    passed, target_tokens = speculative_accept(block[0, 1:], q, sampler.probs(logprobs))
                # The one host synchronisation of the cycle.
                mx.eval(block, passed, target_tokens)
                drafted, passed, posterior = block.tolist()[0][1:], passed.tolist(), target_tokens.tolist()

                n = 0
                while n < num_draft and passed[n]:
                    n += 1
                if lookup is not None and drafter_cycle and num_draft > 0:
                    if n == 0:
                        lookup_cycles, next_fallback = next_fallback, min(2 * next_fallback, lookup_fallback)
                    else:
                        next_fallback = 1
                emitted = drafted[:n] + [posterior[n]]
                for j, tok in enumerate(emitted):
                    if tok in stop_tokens:
                        emitted, stopped = emitted[: j + 1], True
                        break
                _rewind(len(emitted), verify_size, taps)
                cache.tokens.append(last)
                cache.tokens.extend(emitted[:-1])
                last = emitted[-1]
                generated += len(emitted)
                # The next drafter pass starts before this cycle's tokens are handed out, so it
                # runs while the caller decodes and shows them.
                proposal = _propose() if generated < max_tokens and not stopped else None
                yield StepOutput(emitted, n, num_draft)
        finally:
            # A cycle cut short (an exception) leaves unverified entries: drop them.
            if cache.offset != len(cache.tokens):
                cache.trim_to(len(cache.tokens))


@dataclass
class GenerationResponse:
    """The output of :func:`stream_generate`, one per cycle. All plain Python values.

    Args:
        text: The new segment of decoded text (may be empty).
        tokens: This cycle's new token ids (a stop token is not included).
        acceptance_length: Tokens this cycle's target pass produced (``num_accepted + 1``).
        num_draft: Tokens drafted this cycle (the target verified ``num_draft + 1``).
        mean_acceptance_length: The running mean over the cycles so far (the paper's tau).
        cycle: 0 for the prefill's first token, then 1, 2, ... per draft/verify cycle.
        prompt_tokens: Prompt tokens prefilled (after any cache reuse).
        prompt_tps: Prompt tokens per second (prefill up to the first token).
        generation_tokens: Tokens generated so far.
        generation_tps: Generated tokens per second since the first token.
        peak_memory: Peak memory so far, in GB.
        finish_reason: ``"stop"``, ``"length"`` or None while generating.
    """

    text: str
    tokens: list[int]
    acceptance_length: int
    mean_acceptance_length: float
    cycle: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    num_draft: int = 0


def stream_generate(
    model: nn.Module,
    draft: nn.Module | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    *,
    max_tokens: int = 256,
    block_size: int | None = None,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    proposal: str = "sample",
    min_confidence: float = 0.0,
    lookup_fallback: int = 0,
    seed: int | None = None,
    prompt_cache: DFlashCache | None = None,
    prefill_step_size: int = 512,
) -> Generator[GenerationResponse, None, None]:
    """Stream text from ``model`` with DFlash drafting by ``draft``.

    Args:
        model: The target model.
        draft: The DFlash drafter, or None for plain decoding through the same API.
        tokenizer: The target's tokenizer (an mlx-lm ``TokenizerWrapper``).
        prompt: Text (encoded as is: apply the chat template first) or token ids.
        max_tokens: The most tokens to generate.
        block_size: Tokens verified per cycle; defaults to the drafter's block size.
        sampler: ``logprobs -> ids``; greedy when None.
        logits_processors: mlx-lm logits processors applied to the target's logits.
        proposal: ``"greedy"`` or ``"sample"`` drafts; see :func:`dflash_generate_step`.
        min_confidence: Verify only the drafter's confident leading drafts (0: the whole
          block); see :func:`dflash_generate_step`.
        lookup_fallback: Draft by prompt lookup for up to this many cycles after the
          drafter misses its first draft (0: never); see :func:`dflash_generate_step`.
        seed: Seed for sampling; the same seed gives the same output.
        prompt_cache: A ``DFlashCache`` to reuse across calls (multi-turn chat).
        prefill_step_size: Prompt tokens per prefill chunk.

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
        seed=seed,
        stop_tokens=stop_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
    )
    tic = time.perf_counter()
    prompt_tps, generated, cycles, acceptance_sum = 0.0, 0, 0, 0
    for step in steps:
        now = time.perf_counter()
        if generated == 0:
            prompt_tps = (len(ids) - reused) / max(now - tic, 1e-9)
            tic = now
        else:
            cycles += 1
            acceptance_sum += step.num_accepted + 1
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
        elapsed = max(now - tic, 1e-9)
        yield GenerationResponse(
            text=detokenizer.last_segment,
            tokens=tokens,
            acceptance_length=step.num_accepted + 1,
            mean_acceptance_length=acceptance_sum / cycles if cycles else 1.0,
            cycle=cycles,
            prompt_tokens=len(ids) - reused,
            prompt_tps=prompt_tps,
            generation_tokens=generated,
            generation_tps=(generated - 1) / elapsed if generated > 1 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            num_draft=step.num_draft,
        )
        if finish:
            break


def generate(
    model: nn.Module,
    draft: nn.Module | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response; see :func:`stream_generate` for the arguments.

    Returns:
        The generated text. With ``verbose`` it is also printed as it streams, followed
        by prompt/generation speed, mean acceptance length and peak memory.
    """
    text, response, histogram = "", None, {}
    if verbose:
        print("=" * 10)
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text += response.text
        if verbose:
            print(response.text, end="", flush=True)
        if response.cycle > 0:
            histogram[response.acceptance_length] = histogram.get(response.acceptance_length, 0) + 1
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        hist = " ".join(f"{k}:{v}" for k, v in sorted(histogram.items()))
        print(f"Acceptance length: {response.mean_acceptance_length:.2f} mean [{hist}]")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dflash-generate", description="Generate text with DFlash speculative decoding.")
    add_model_arguments(parser)
    parser.add_argument("--prompt", "-p", default="Hello", help="The prompt ('-' reads stdin; default: 'Hello').")
    add_decoding_arguments(parser, max_tokens=256)
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
    parser.add_argument("--seed", type=int, default=None, help="Random seed for sampling (default: none).")
    parser.add_argument(
        "--ignore-chat-template", action="store_true", help="Use the prompt as is, without the chat template."
    )
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


def apply_chat_template(
    tokenizer, prompt: str, system_prompt: str | None = None, template_kwargs: dict | None = None
) -> list[int] | str:
    """The prompt as token ids in the chat template, or as is when there is none.

    ``template_kwargs`` go to ``apply_chat_template`` (``--chat-template-config``).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {}))


def _window_cache(model: nn.Module, ids: list[int], max_kv_size: int) -> DFlashCache:
    """A target cache that keeps the last ``max_kv_size`` tokens (mlx-lm's rotating cache), with
    all but the last prompt token prefilled the way ``mlx_lm generate`` does, so the output is
    mlx-lm's. Plain decoding only: it never rolls back."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = DFlashCache(make_prompt_cache(model, max_kv_size=max_kv_size))
    step = 2048  # mlx-lm's prefill step; with a rotating cache the chunks change the output
    with mx.stream(generation_stream):
        for i in range(0, len(ids) - 1, step):
            chunk = ids[i : min(i + step, len(ids) - 1)]
            model(mx.array(chunk)[None], cache=cache.target)
            mx.eval([c.state for c in cache.target])
            cache.tokens.extend(chunk)
    return cache


def main(argv: list[str] | None = None) -> None:
    from .loading import draft_for_cli, load

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
        if not args.ignore_chat_template:
            prompt = apply_chat_template(tokenizer, prompt, args.system_prompt, args.chat_template_config)
        cache = None
        if args.max_kv_size is not None:
            if isinstance(prompt, str):
                bos = tokenizer.bos_token
                prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
            cache = _window_cache(model, list(prompt), args.max_kv_size)
        text = generate(
            model,
            draft,
            tokenizer,
            prompt,
            verbose=args.verbose,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            sampler=make_sampler(args.temp, args.top_p, args.min_p, args.top_k),
            logits_processors=make_logits_processors(repetition_penalty=args.repetition_penalty),
            proposal=args.proposal,
            min_confidence=args.min_confidence,
            lookup_fallback=args.lookup_fallback,
            seed=args.seed,
            prompt_cache=cache,
        )
        if not args.verbose:
            print(text)  # the text alone, as mlx_lm.generate does
    except DFlashError as e:
        print(f"dflash-generate: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
