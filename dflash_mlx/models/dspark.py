"""The DSpark drafter: DFlash's block denoiser in which every slot drafts, with a Markov bias and a
confidence head.

Read from the published checkpoints (``architectures: ["Qwen3DSparkModel"]``, e.g.
``deepseek-ai/dspark_qwen3_8b_block7``; DeepSeek-AI and PKU, arXiv 2607.05147, reference code in
deepseek-ai/DeepSpec). Three things change from DFlash (``drafter.py``):

* every slot drafts: the block ``[last, MASK x (B-1)]`` gives B drafts, slot ``k`` the token at
  ``start + k + 1`` (z-lab's drafters keep slot 0 for the anchor and draft B - 1). The loop verifies
  ``B + 1`` tokens a cycle, so :attr:`DraftModel.block_size` is ``B + 1`` and the drafter reads the
  first B ids of the block the loop hands it;
* a rank-r "Markov" bias ``W2 W1[prev]`` is added to each slot's logits, ``prev`` the token drafted
  at the slot before (the anchor at slot 0): B small steps after the head, no transformer pass;
* a linear confidence head (with bias) scores each slot, from its hidden state (and ``W1[prev]``
  when ``confidence_head_with_markov``); the drafts stop before the first whose sigmoid is below
  a threshold (0, the reference's default: the whole block).

The weights carry their own ``embed_tokens`` and ``lm_head`` (trained frozen from the target's);
community heads without them borrow the target's. DeepSeek's ``dflash_*_block7`` checkpoints are
this layout with ``markov_rank`` 0 and no confidence head.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..cpu.speedups import CpuSpeedups
from ..sampling import sample_rows
from . import drafter

ARCHITECTURE = "Qwen3DSparkModel"

# Fields without which the reference class refuses to build.
_REQUIRED = ("target_layer_ids", "mask_token_id", "block_size", "markov_rank", "enable_confidence_head")


def is_dspark(config: dict) -> bool:
    """Whether a drafter config is a DSpark one (by its ``architectures``)."""
    return any(a.endswith("DSparkModel") for a in config.get("architectures") or [])


def check_layout(config: dict) -> None:
    """Refuse a DSpark config we cannot run as its authors' class would.

    Raises:
        DFlashError: For another DSpark architecture (Gemma 4's), a missing field, a Markov head
          other than ``vanilla`` (the released one), or an attention layout DFlash refuses.
    """
    fix = "The config does not describe a Qwen3 DSpark drafter: re-download it, or pass a DFlash drafter."
    archs = [a for a in config.get("architectures") or [] if a.endswith("DSparkModel") and a != ARCHITECTURE]
    if archs:
        raise DFlashError(f"Unsupported DSpark architecture {archs[0]!r}: only {ARCHITECTURE} is implemented.")
    drafter.check_attention_layout(config, fix)
    missing = [k for k in _REQUIRED if config.get(k) is None]
    if missing:
        raise DFlashError(f"The DSpark drafter config lacks {', '.join(missing)}. {fix}")
    rank = config["markov_rank"]
    if not isinstance(rank, int) or rank < 0:
        raise DFlashError(f"The DSpark drafter config has markov_rank={rank!r}; it must be an integer >= 0. {fix}")
    kind = str(config.get("markov_head_type", "vanilla")).lower()
    if rank > 0 and kind != "vanilla":
        raise DFlashError(
            f"Unsupported DSpark markov_head_type={kind!r}: only 'vanilla' (the released heads') is implemented."
        )
    if config["enable_confidence_head"] and config.get("confidence_head_with_markov") is None:
        raise DFlashError(f"The DSpark drafter config lacks confidence_head_with_markov. {fix}")


@dataclass
class DraftArgs(drafter.DraftArgs):
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    # Whether the weights carry embed_tokens and lm_head (set by the loader from the weights).
    own_head: bool = True
    check: ClassVar = staticmethod(check_layout)


class MarkovHead(nn.Module):
    """The rank-r bias ``markov_w2(markov_w1[prev])`` on the next slot's logits."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """A logit per slot that its draft is accepted (the reference's ``AcceptRatePredictor``)."""

    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features)[..., 0]


class DraftModel(drafter.DraftModel):
    """The DSpark drafter: DFlash's layers, every slot drafting, then the Markov steps."""

    def __init__(self, args: DraftArgs):
        if args.draft_vocab_size:
            raise DFlashError("A DSpark drafter drafts over its own head's vocabulary: remove draft_vocab_size.")
        super().__init__(args)
        if args.own_head:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.markov_head = MarkovHead(args.vocab_size, args.markov_rank) if args.markov_rank > 0 else None
        self.confidence_head = None
        if args.enable_confidence_head:
            extra = args.markov_rank if args.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(args.hidden_size + extra)

    family = "DSpark"

    @property
    def block_size(self) -> int:
        """Tokens verified a cycle: the anchor and one draft per trained slot."""
        return self.args.block_size + 1

    def embed(self, model: nn.Module, block: mx.array) -> mx.array:
        # The loop hands B + 1 ids (its cycle width); the drafter was trained on its B.
        block = block[:, : self.args.block_size]
        return self.embed_tokens(block) if self.args.own_head else super().embed(model, block)

    def logits(self, model: nn.Module, h: mx.array) -> mx.array:
        return self.lm_head(h) if self.args.own_head else super().logits(model, h)

    def propose(
        self,
        model: nn.Module,
        block: mx.array,
        taps: mx.array | None,
        cache: list[Any],
        speedups: CpuSpeedups | None = None,
        num_drafts: int | None = None,
    ) -> mx.array:
        """The slots' logits before the Markov bias, ``(1, num_drafts or B, V)``: a drafter with
        ``markov_rank`` 0 drafts their argmax, as DFlash's proposers do."""
        h = self.block_hidden(model, block, taps, cache, speedups)
        return self.logits(model, h[:, :num_drafts])

    def draft_steps(
        self,
        model: nn.Module,
        block: mx.array,
        taps: mx.array | None,
        cache: list[Any],
        num_drafts: int,
        probs: Callable[[mx.array], mx.array] | None = None,
        speedups: CpuSpeedups | None = None,
    ) -> tuple[mx.array, mx.array | None, mx.array, mx.array | None]:
        """One pass over the block, then the Markov steps slot by slot.

        Args:
            model: The target (whose embedding and head a drafter without its own borrows).
            block: ``(1, >= B)`` ids ``[last, mask, ...]``.
            taps: Taps of context positions not yet in ``cache`` (or None).
            cache: The drafter's per-layer context caches.
            num_drafts: Slots to draft, at most B.
            probs: The sampler's distribution of a slot's corrected logits; None drafts the argmax.
            speedups: The CPU speedups, or None.

        Returns:
            ``(drafts (n,), q (n, V) or None, corrected logits (n, V), confidence logits (n,) or None)``:
            each draft's distribution and logits given the drafts before it.
        """
        h = self.block_hidden(model, block, taps, cache, speedups)[0, :num_drafts]
        base = self.logits(model, h)
        prev = block[0, :1].astype(mx.int32)
        drafts, qs, logits, prevs = [], [], [], []
        for k in range(num_drafts):
            prevs.append(prev)
            step = base[k : k + 1]
            if self.markov_head is not None:
                step = step + self.markov_head(prev).astype(step.dtype)
            logits.append(step)
            if probs is None:
                prev = mx.argmax(step, axis=-1).astype(mx.int32)
            else:
                qs.append(probs(step))
                prev = sample_rows(qs[-1]).astype(mx.int32)
            drafts.append(prev)
        drafts = mx.concatenate(drafts).astype(mx.uint32)
        q = mx.concatenate(qs) if qs else None
        confidence = None
        if self.confidence_head is not None:
            features = h
            if self.args.confidence_head_with_markov:
                features = mx.concatenate([h, self.markov_head.markov_w1(mx.concatenate(prevs)).astype(h.dtype)], -1)
            confidence = self.confidence_head(features).astype(mx.float32)
        return drafts, q, mx.concatenate(logits), confidence

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            if k.startswith("model."):
                k = k[len("model.") :]
            if "rotary_emb" in k or (not self.args.own_head and k.startswith(("embed_tokens.", "lm_head."))):
                continue
            out[k] = v
        return out


def confident_count(confidence: mx.array, threshold: float) -> int:
    """Drafts before the first whose confidence (a logit) is below ``threshold`` as a probability;
    all of them at a threshold of 0, as the reference."""
    if threshold <= 0:
        return confidence.shape[0]
    below = (mx.sigmoid(confidence) < threshold).tolist()
    return below.index(True) if True in below else len(below)


def adapt_args(args: DraftArgs, weights: dict[str, mx.array]) -> None:
    """A community head without ``lm_head`` in its weights borrows the target's embedding and head."""
    args.own_head = any(k.endswith("lm_head.weight") for k in weights)
