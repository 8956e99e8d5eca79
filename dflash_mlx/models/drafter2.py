"""The DFlash2 drafter: DFlash's block denoiser with local convolutions and a candidate selector.

Three things change from DFlash (``drafter.py``), all read from the published checkpoints
(``architectures: ["DFlash2DraftModel"]``, e.g. ``z-lab/Qwen3.8-27B-DFlash2``):

* every decoder layer wraps its attention and its MLP in a grouped, dynamic, causal
  convolution along the block (:class:`GroupedDynamicCausalConv`): the input of each is mixed
  with the few block positions before it, and its output again, with weights that are part
  fixed, part predicted from the token's own hidden state;
* the logits are the target head's times ``output_multiplier``, soft-capped at
  ``final_logit_softcapping``, and the noisy block's embedding is scaled by
  ``input_embedding_scale``;
* the drafts are not each position's argmax: a :class:`CandidateSelector` walks the block left
  to right and picks, among each position's ``selector_top_k`` likeliest tokens, the one whose
  logit plus a low-rank score of the pair (previous draft, candidate) is highest. The drafts
  thus form a path in which each token fits the one before it. When sampling, each is drawn
  from the softmax of those scores instead, after the drafts drawn before it.

The context path (taps through ``fc`` + ``hidden_norm``, injected as keys and values), the
attention, the caches and the weight names are DFlash's. Inco AI, "DFlash 2: Keep Drafting
Parallel" (2026); z-lab's ``dflash`` package holds the reference implementation.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..sampling import sample_rows
from . import drafter
from . import target as tgt

ARCHITECTURE = "DFlash2DraftModel"

# What "dflash_config" holds in DFlash2 checkpoints, lifted to the top level on reading.
_NESTED_KEYS = drafter._DFLASH_KEYS + (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
)
# Fields without which the architecture is undefined.
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "vocab_size")


def is_dflash2(config: dict) -> bool:
    """Whether a drafter config is a DFlash2 one (by its ``architectures``)."""
    return ARCHITECTURE in (config.get("architectures") or [])


def check_layout(config: dict) -> None:
    """Refuse a DFlash2 config we cannot run as its authors' class would.

    Raises:
        DFlashError: For a missing or non-positive convolution or selector field, a group size
          that does not divide ``hidden_size``, a selector wider than the vocabulary, or an
          attention layout :func:`dflash_mlx.models.drafter.check_attention_layout` refuses.
    """
    fix = "The config does not describe a DFlash2 drafter: re-download it, or pass a DFlash drafter."
    drafter.check_attention_layout(config, fix)
    nested = {**config, **(config.get("dflash_config") or {})}
    missing = [k for k in _REQUIRED if nested.get(k) is None]
    if missing:
        raise DFlashError(f"The DFlash2 drafter config lacks {', '.join(missing)}. {fix}")
    bad = {k: nested[k] for k in _REQUIRED if not (isinstance(nested[k], int) and nested[k] > 0)}
    if bad:
        raise DFlashError(f"The DFlash2 drafter config has {bad}; each must be a positive integer. {fix}")
    hidden, group = nested.get("hidden_size"), nested["conv_group_size"]
    if not isinstance(hidden, int) or hidden % group:
        raise DFlashError(
            f"The DFlash2 drafter's conv_group_size={group} does not divide its hidden_size={hidden}. {fix}"
        )
    if nested["selector_top_k"] > nested["vocab_size"]:
        raise DFlashError(
            f"The DFlash2 drafter's selector_top_k={nested['selector_top_k']} exceeds its "
            f"vocab_size={nested['vocab_size']}. {fix}"
        )


@dataclass
class DraftArgs(drafter.DraftArgs):
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    block_size: int = 8
    nested_keys: ClassVar[tuple[str, ...]] = _NESTED_KEYS
    check: ClassVar = staticmethod(check_layout)


def dynamic_causal_conv(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """A depthwise causal convolution along the sequence whose taps are ``base`` plus ``dynamic``.

    ``out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c]``, with
    ``x`` zero before the first position: the weights belong to the output position and are
    shared within each group of ``group_size`` channels.

    Args:
        x: ``(B, L, H)``.
        dynamic: ``(B, L, K, H // group_size)`` per-position weights.
        base: ``(K, H)`` fixed weights; tap ``o`` reaches ``o`` positions back.
    """
    L, K = x.shape[1], base.shape[0]
    taps = base.astype(x.dtype) + mx.repeat(dynamic, group_size, axis=-1)  # (B, L, K, H)
    padded = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
    out = taps[:, :, 0] * x
    for o in range(1, K):
        out = out + taps[:, :, o] * padded[:, K - 1 - o : K - 1 - o + L]
    return out


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer (attention or MLP).

    One projection of the sublayer's (normed) input predicts the dynamic weights of both: the
    first convolution mixes the input before the sublayer, the second mixes its output, each
    with its own ``base_kernel`` row.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def before(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``(x convolved, the dynamic weights for after())``."""
        B, L, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, self.groups)
        mixed = dynamic_causal_conv(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size)
        return mixed, dynamic[:, :, 1]

    def after(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return dynamic_causal_conv(y, dynamic, self.base_kernel[1], self.group_size)


class DecoderLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer_idx: int = 0):
        super().__init__()
        self.self_attn = drafter.Attention(args, layer_idx)
        self.mlp = drafter.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(*conv)
        self.mlp_conv = GroupedDynamicCausalConv(*conv)

    def __call__(self, h, context, cache=None, mask=None, block_offset=None, speedups=None) -> mx.array:
        kernel = speedups is not None and speedups.fast_exp
        # The convolutions run along the block only; the context enters through attention.
        x, dynamic = self.attention_conv.before(self.input_layernorm(h))
        h = h + self.attention_conv.after(self.self_attn(x, context, cache, mask, block_offset, kernel), dynamic)
        x, dynamic = self.mlp_conv.before(self.post_attention_layernorm(h))
        return h + self.mlp_conv.after(self.mlp(x, kernel), dynamic)

    def context_key_values(self, context: mx.array, offset: int, speedups=None) -> tuple[mx.array, mx.array]:
        return self.self_attn.context_key_values(context, offset)


class CandidateSelector(nn.Module):
    """Picks each draft among its position's ``top_k`` likeliest tokens, left to right.

    The score of candidate ``c`` at position ``i`` after the draft ``p`` before it is
    ``logit[i, c] + sum_r P[p, r] * G[i, r] * S[c, r]``: ``P`` and ``S`` are low-rank
    codebooks of the vocabulary, ``G`` a projection of the position's hidden state.
    """

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def __call__(self, h: mx.array, logits: mx.array, anchor: mx.array) -> tuple[mx.array, mx.array]:
        """The greedy path: at each position the best-scoring candidate.

        Args:
            h: ``(B, L, H)`` the drafter's hidden states of the positions to draft.
            logits: ``(B, L, V)`` their logits.
            anchor: ``(B,)`` the committed token before the first of them.

        Returns:
            ``(path, candidates)``: ``(B, L)`` token ids and the ``(B, L, top_k)`` candidates
            they were chosen among (in no particular order).
        """

        def best(scores, candidates):
            pick = mx.argmax(scores, axis=-1)
            return mx.take_along_axis(candidates, pick[:, None], axis=-1)[:, 0]

        return self._walk(h, logits, anchor, best)

    def sample(
        self, h: mx.array, logits: mx.array, anchor: mx.array, probs: Callable[[mx.array], mx.array]
    ) -> tuple[mx.array, mx.array]:
        """A sampled path: each position's token drawn from ``probs`` of its candidates' scores.

        A position's scores depend on the token drawn before it, so its distribution is the one
        conditioned on the path so far: what speculative sampling needs as ``q``.

        Args:
            h, logits, anchor: As for :meth:`__call__`.
            probs: Maps ``(B, V)`` scores (``-inf`` outside the candidates) to the distribution
              to draw from, ``(B, V)``: a sampler's, with its temperature and filters.

        Returns:
            ``(path, q)``: ``(B, L)`` token ids and ``(B, L, V)`` the distribution each was
            drawn from, zero outside its position's candidates.
        """
        B, _, V = logits.shape
        rows = []

        def draw(scores, candidates):
            # Over the whole vocabulary, so that the sampler's filters (XTC's protected ids too)
            # act as on the target's logits; one softmax over it per draft, as DFlash's sampled drafts.
            full = mx.full((B, V), -mx.inf, dtype=mx.float32)
            rows.append(probs(mx.put_along_axis(full, candidates, scores.astype(mx.float32), axis=-1)))
            return sample_rows(rows[-1]).astype(candidates.dtype)

        path, _ = self._walk(h, logits, anchor, draw)
        return path, mx.stack(rows, axis=1)

    def _walk(self, h, logits, anchor, choose) -> tuple[mx.array, mx.array]:
        # Left to right: each position's candidates scored after the token chosen before it.
        L, k = h.shape[1], self.top_k
        candidates = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
        unary = mx.take_along_axis(logits, candidates, axis=-1)  # (B, L, k)
        gate = self.hidden_projection(h)  # (B, L, r)
        successors = self.successor_codebook(candidates)  # (B, L, k, r)
        previous, path = anchor, []
        for i in range(L):
            query = self.predecessor_codebook(previous) * gate[:, i]  # (B, r)
            scores = unary[:, i] + (successors[:, i] @ query[:, :, None])[..., 0]  # (B, k)
            previous = choose(scores, candidates[:, i])
            path.append(previous)
        return mx.stack(path, axis=1), candidates


class DraftModel(drafter.DraftModel):
    """The DFlash2 drafter (``DFlash2DraftModel`` checkpoints).

    Its pass over a block is DFlash's, through this module's decoder layers; :meth:`draft_tokens`
    turns it into drafts through the selector (its greedy path), :meth:`sample_tokens` into drafts
    drawn from it with their distributions. It drafts over the target's whole vocabulary (no
    ``draft_vocab``).
    """

    family = "DFlash2"

    layer_class: ClassVar[type] = DecoderLayer

    def __init__(self, args: DraftArgs):
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)

    def embed(self, model: nn.Module, block: mx.array) -> mx.array:
        h = tgt.embed(model, block)
        scale = self.args.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def logits(self, model: nn.Module, h: mx.array) -> mx.array:
        logits = tgt.lm_head(model, h) * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def draft_tokens(self, model: nn.Module, block: mx.array, taps, cache, speedups=None) -> mx.array:
        """Drafts for block positions ``1..B-1``, ``(1, B - 1)`` ids: the selector's path from
        ``block[:, 0]``, with the arguments of :meth:`propose`."""
        h = self.block_hidden(model, block, taps, cache, speedups)[:, 1:]
        path, _ = self.candidate_selector(h, self.logits(model, h), block[:, 0])
        return path

    def sample_tokens(
        self,
        model: nn.Module,
        block: mx.array,
        taps,
        cache,
        probs: Callable[[mx.array], mx.array],
        speedups=None,
        num_drafts: int | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Drafts for block positions ``1..num_drafts`` drawn along the selector's path
        (:meth:`CandidateSelector.sample`): ``(1, n)`` ids and ``(1, n, V)`` the distribution
        each was drawn from, after the drafts before it."""
        h = self.block_hidden(model, block, taps, cache, speedups)[:, 1:]
        h = h if num_drafts is None else h[:, :num_drafts]  # later slots are not verified: not paid for
        return self.candidate_selector.sample(h, self.logits(model, h), block[:, 0], probs)

    def set_draft_vocab(self, ids: mx.array | None) -> None:
        if ids is not None:
            raise DFlashError("A DFlash2 drafter drafts over the whole vocabulary; it takes no draft_vocab.")
        super().set_draft_vocab(None)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        # The published checkpoints store the codebooks as bare tensors (the authors' loader
        # maps them onto nn.Embedding); save_pretrained writes them with ".weight".
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            if key in weights:
                weights[f"{key}.weight"] = weights.pop(key)
        return weights
