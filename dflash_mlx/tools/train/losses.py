"""The training loss: many blocks drafted over one packed context, as at inference, scored by cross-entropy on
the target's own tokens, plus an optional logit-matching term against the target's final hidden states."""

import mlx.core as mx
import mlx.nn as nn

from ...models import target as tgt
from .vocab import LossVocab


def packed_block_mask(anchors: mx.array, starts: mx.array, context_len: int, block_size: int) -> mx.array:
    """Which keys each training block may see: ``(nb, 1, B, L + B)`` booleans.

    Block i sees the context of its own sequence strictly before its anchor (what the
    target has verified when the block is drafted), and its own block both ways. It never
    sees another block: those are other batch rows.
    """
    nb = anchors.shape[0]
    pos = mx.arange(context_len)[None]
    context = (pos >= starts[:, None]) & (pos < anchors[:, None])  # (nb, L)
    mask = mx.concatenate([context, mx.ones((nb, block_size), dtype=mx.bool_)], axis=1)
    return mx.broadcast_to(mask[:, None, None, :], (nb, 1, block_size, context_len + block_size))


def block_hidden(draft, target, taps, blocks, anchors, starts, speedups=None) -> mx.array:
    """The drafter's last hidden states ``(nb, B, H)`` for many blocks over one packed context
    ``taps``; each block row gets its own RoPE position (its anchor), as in inference."""
    mask = packed_block_mask(anchors, starts, taps.shape[1], blocks.shape[1])
    return draft(tgt.embed(target, blocks), taps, mask=mask, block_offset=anchors, speedups=speedups)


def block_logits(
    draft, target, taps, blocks, anchors, starts, speedups=None, positions=None, vocab: LossVocab | None = None
) -> mx.array:
    """Draft logits ``(nb, positions, vocab)`` of many blocks over one packed context ``taps``:
    the first ``positions`` drafted positions (None: all ``B - 1``), over the whole vocabulary
    or the ``vocab`` subset's ids (``(nb, positions, N)``).

    The whole block goes through the drafter either way, so every position sees the block
    it sees at inference.
    """
    h = block_hidden(draft, target, taps, blocks, anchors, starts, speedups)
    end = blocks.shape[1] if positions is None else 1 + positions
    return _head(target, h[:, 1:end], vocab)


def _head(target, h: mx.array, vocab: LossVocab | None) -> mx.array:
    return tgt.lm_head(target, h) if vocab is None else vocab.logits(h)


def block_loss(
    draft, target, taps, blocks, anchors, starts, labels, weights, speedups=None, positions=None,
    target_final=None, gram=None, logit_mse=0.0, vocab: LossVocab | None = None,
) -> mx.array:  # fmt: skip
    """Weighted cross-entropy on the masked block positions (the first ``positions`` of them),
    plus ``logit_mse`` times :func:`logit_error` at every position when it is positive
    (``target_final``: the target's packed final hidden states, ``gram``: :func:`head_gram`).

    With ``vocab`` the cross-entropy is over its ids only, and a position whose label is not
    among them has weight 0; the distillation term is the same either way."""
    h = block_hidden(draft, target, taps, blocks, anchors, starts, speedups)
    end = blocks.shape[1] if positions is None else 1 + positions
    logits = _head(target, h[:, 1:end], vocab).astype(mx.float32)
    n = logits.shape[1]
    targets, w = labels[:, :n], weights[:, :n]
    if vocab is not None:
        targets, w = vocab.labels(targets, w)
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    # At least one label inside the subset in a real batch; no NaN from a batch with none.
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
    if logit_mse > 0:
        loss = loss + logit_mse * logit_error(h[:, 1:], target_final, anchors, gram, weights)
    return loss


def head_gram(target: nn.Module) -> mx.array:
    """``G = Wc^T Wc / V`` for the LM head ``W (V, H)`` with its mean row removed.

    For hidden states ``h`` and ``h*``, ``(h - h*)^T G (h - h*)`` is the mean squared
    difference of their logits over the vocabulary, each set shifted to mean zero (a shift
    does not change the softmax): logit matching at the cost of an ``H x H`` product.
    """
    eye = mx.eye(tgt.hidden_size(target), dtype=mx.float32)
    # The head applied to the identity is W^T, whatever form (tied, quantized) it has.
    w = tgt.head_linear(target, eye.astype(tgt.compute_dtype(target))).astype(mx.float32)  # (H, V)
    w = w - w.mean(axis=1, keepdims=True)
    return mx.stop_gradient((w @ w.T) / w.shape[1])


def logit_error(h: mx.array, target_final: mx.array, anchors: mx.array, gram: mx.array, weights: mx.array) -> mx.array:
    """Weighted mean over the drafted positions of the centred logits' squared error
    against the target's (see :func:`head_gram`).

    Block position ``k`` drafts the token at ``anchor + k``, which the target predicted
    from its last hidden state at ``anchor + k - 1``: row ``k - 1`` of ``h``. Positions past
    a sequence's end have weight 0 (their index is clamped).
    """
    n = h.shape[1]
    idx = mx.minimum(anchors[:, None] + mx.arange(n)[None], target_final.shape[1] - 1)
    d = h.astype(mx.float32) - target_final[0][idx].astype(mx.float32)
    err = ((d @ gram) * d).sum(axis=-1)
    return (err * weights[:, :n]).sum() / weights[:, :n].sum()
