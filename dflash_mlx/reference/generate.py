"""The DFlash speculative loop in plain PyTorch, on a transformers target.

Greedy only: it mirrors ``dflash_mlx.generate.dflash_generate_step`` step for step (same
acceptance rule, same rollback, same handling of ``max_tokens`` and stop tokens), so the two
can be compared token for token and cycle for cycle.

A sliding-window layer (gpt-oss) keeps its last pass until the crop after it, as transformers'
assisted decoding has it keep it. A hybrid target's cache (Qwen3.5: linear attention layers with
a recurrent state) is not cropped, even where transformers can crop it by recording every state
of a pass: the loop copies the cache before each verify pass and, after a rejection, goes back
to the copy and runs the target again over the kept tokens: slower than the MLX side's replay
of the linear attention alone, and independent of it.
"""

import copy
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..base.errors import DFlashError
from .model import ReferenceDraft


class ReferenceStep(NamedTuple):
    """One cycle: new tokens (accepted drafts, then the bonus token), and how many of the
    ``num_draft`` drafted tokens the target agreed with. The prefill's token comes alone."""

    tokens: list[int]
    num_accepted: int
    num_draft: int


@dataclass
class ReferenceOutput:
    """What :func:`reference_generate` returns.

    Args:
        tokens: All generated token ids (a stop token included, as the last one).
        acceptance_lengths: ``num_accepted + 1`` per draft/verify cycle (the prefill excluded).
        steps: Every cycle as a ``ReferenceStep``, the prefill first.
    """

    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    steps: list[ReferenceStep] = field(default_factory=list)


@torch.no_grad()
def forward_with_taps(
    target: nn.Module, tokens: torch.Tensor, cache: DynamicCache, tap_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the target on ``tokens`` and capture the outputs of decoder layers ``tap_ids``.

    Tap ``i`` is ``hidden_states[i + 1]``: transformers puts the embedding output first.

    Returns:
        ``(B, L, vocab)`` logits and the taps concatenated in ``tap_ids`` order,
        ``(B, L, len(tap_ids) * H)``, or None when ``tap_ids`` is empty.
    """
    out = target(tokens, cache=cache, use_cache=True, output_hidden_states=bool(tap_ids))
    if not tap_ids:
        return out.logits, None
    return out.logits, torch.cat([out.hidden_states[i + 1] for i in tap_ids], dim=-1)


def _check(prompt, draft, block_size, max_tokens) -> tuple[list[int], int]:
    ids = prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else [int(t) for t in prompt]
    if not ids:
        raise DFlashError("The prompt is empty: pass at least one token.")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise DFlashError(f"max_tokens must be a positive integer (got {max_tokens!r}).")
    trained = draft.block_size if draft is not None else 1
    if block_size is None:
        block_size = trained
    if not isinstance(block_size, int) or not 1 <= block_size <= trained:
        raise DFlashError(
            f"block_size must be an integer from 1 to the drafter's trained block size {trained} (got {block_size!r})."
        )
    return ids, block_size


@torch.no_grad()
def reference_generate_step(
    prompt: list[int] | torch.Tensor,
    target: nn.Module,
    draft: ReferenceDraft | None,
    *,
    block_size: int | None = None,
    max_tokens: int = 256,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
) -> Generator[ReferenceStep, None, None]:
    """Greedy DFlash decoding with a transformers target and the PyTorch drafter.

    Args:
        prompt: The prompt token ids.
        target: A transformers ``AutoModelForCausalLM`` (runs on its own device).
        draft: A ``ReferenceDraft`` on the same device, or None for plain greedy decoding.
        block_size: Tokens verified per cycle, 1..the drafter's trained size (default).
        max_tokens: The most tokens to generate.
        stop_tokens: Generation ends right after the first of these, even mid-block.

    Yields:
        ReferenceStep: The tokens of each cycle with its acceptance counts.

    Raises:
        DFlashError: On an empty prompt, ``max_tokens < 1``, a bad ``block_size``, or a
          drafter on another device than the target.
    """
    ids, block_size = _check(prompt, draft, block_size, max_tokens)
    device = next(target.parameters()).device
    if draft is not None and draft.fc.weight.device != device:
        raise DFlashError(
            f"The drafter is on {draft.fc.weight.device} but the target on {device}; "
            "load both with load_reference(..., device=...)."
        )
    tap_ids = draft.target_layer_ids if draft is not None else []
    # The config gives a hybrid target its linear attention layers' caches, and gpt-oss its
    # sliding-window layers', which keep the last pass until a crop (as in transformers' own
    # assisted decoding), so that a rejected draft can be cropped off past the window.
    cache = DynamicCache(config=target.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    draft_cache = draft.make_cache() if draft is not None else None

    def _verify(tokens: list[int]) -> tuple[list[int], torch.Tensor | None]:
        logits, taps = forward_with_taps(target, torch.tensor([tokens], device=device), cache, tap_ids)
        return logits[0].argmax(dim=-1).tolist(), taps

    # Taps of committed positions that the drafter has not seen yet.
    posterior, pending = _verify(ids)
    # Known once the layers hold state. A recurrent layer is never cropped (see above): transformers
    # before 5.25 cannot, and from 5.25 it can only with past recording, another rollback than the copy.
    croppable = cache.is_croppable and not any(isinstance(x, LinearAttentionCacheLayerMixin) for x in cache.layers)
    last = posterior[-1]
    yield ReferenceStep([last], 0, 0)
    generated, stopped = 1, last in stop_tokens

    while generated < max_tokens and not stopped:
        verify_size = min(block_size, max_tokens - generated)
        num_draft = verify_size - 1
        drafted = []
        if num_draft > 0:
            # The drafter always sees its trained block: [last, MASK x (B-1)].
            block = [last] + [draft.mask_token_id] * (draft.block_size - 1)
            logits = draft.propose(target, torch.tensor([block], device=device), pending, draft_cache)
            drafted, pending = logits[0, :num_draft].argmax(dim=-1).tolist(), None
        before = None if croppable else copy.deepcopy(cache)
        posterior, taps = _verify([last] + drafted)

        n = 0
        while n < num_draft and drafted[n] == posterior[n]:
            n += 1
        emitted = posterior[: n + 1]
        for j, tok in enumerate(emitted):
            if tok in stop_tokens:
                emitted, stopped = emitted[: j + 1], True
                break
        # Rollback: keep the target's state after [last, d1..d_(k-1)] for the k emitted tokens.
        if verify_size > len(emitted):
            if croppable:
                cache.crop(-(verify_size - len(emitted)))
            else:  # a recurrent state: the one from before the pass, then the kept tokens again
                cache = before
                _verify(([last] + drafted)[: len(emitted)])
        if taps is not None:
            kept = taps[:, : len(emitted)]
            pending = kept if pending is None else torch.cat([pending, kept], dim=1)
        last = emitted[-1]
        generated += len(emitted)
        yield ReferenceStep(emitted, n, num_draft)


def reference_generate(
    prompt: list[int] | torch.Tensor,
    target: nn.Module,
    draft: ReferenceDraft | None,
    **kwargs,
) -> ReferenceOutput:
    """Run :func:`reference_generate_step` to the end; see it for the arguments.

    Returns:
        ReferenceOutput: The generated ids and the per-cycle acceptance lengths.
    """
    result = ReferenceOutput()
    for step in reference_generate_step(prompt, target, draft, **kwargs):
        if result.steps:
            result.acceptance_lengths.append(step.num_accepted + 1)
        result.steps.append(step)
        result.tokens.extend(step.tokens)
    return result
