"""A pipeline-parallel target's stage: this process's run of decoder layers, and the hand-offs
around it that carry the taps.

mlx-lm's ``PipelineMixin.pipeline(group)`` (qwen2, qwen3_moe, qwen3_5, qwen3_next, the DeepSeek-V3
family) keeps on each rank a run of consecutive layers, the last ones on rank 0 and the first
ones on the highest rank, and leaves the others as None. Its own ``__call__`` receives the hidden
state from the rank above, runs the local layers, sends the result to the rank below, and gathers
rank 0's final state to every rank. The tap walkers do the same, and carry the taps with it:

* folded taps (:class:`~dflash_mlx.models.target.FoldedTaps`) travel down the pipeline with the
  hidden state, in one send, so that they are summed in the same order as in one process (the
  same bits);
* raw taps stay on the rank that made them until the end;
* then one ``all_sum`` hands every rank the final hidden state and all the taps: each slot of
  it has exactly one rank that is not zero, so the sum is exact.

A target that is not pipelined is one stage of all its layers, and nothing is sent.

For the families mlx-lm does not pipeline (Qwen3, Llama, gpt-oss, Gemma 4), :func:`split_decoder`
gives their decoder the same layout and the attributes the stage reads; it leaves the model's
own ``__call__`` unable to run it, so only the walkers here run it, and the caches of a stage
(:func:`stage_caches`) are those of its own layers, as mlx-lm's pipelined models make them.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.pipeline import PipelineMixin

from .sliding import SlidingKVCache


def even_split(num_layers: int, size: int) -> list[int]:
    """Layers per rank, rank 0's first, as mlx-lm's ``PipelineMixin`` splits by default (the low
    ranks get the extra layers)."""
    base, extra = divmod(num_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def split_decoder(inner: nn.Module, group: mx.distributed.Group, split: list[int] | None = None) -> None:
    """Keep on this rank the run of ``inner``'s layers that mlx-lm's ``PipelineMixin.pipeline``
    would keep (the last ones on rank 0, the first on the highest rank; layers before the run are
    None, those after it dropped, so that the weights keep their layer numbers), and set the
    attributes :class:`Stage` reads. For a decoder mlx-lm does not pipeline.

    Raises:
        ValueError: If ``split`` does not give every rank at least one layer of the decoder's.
    """
    n = len(inner.layers)
    split = even_split(n, group.size()) if split is None else list(split)
    if len(split) != group.size():
        raise ValueError(f"split has {len(split)} entries for group size {group.size()}")
    if any(s <= 0 for s in split) or sum(split) != n:
        raise ValueError(f"split {split} must be positive and sum to {n} layers")
    inner.pipeline_rank, inner.pipeline_size = group.rank(), group.size()
    inner.start_idx = sum(split[group.rank() + 1 :])
    inner.end_idx = inner.start_idx + split[group.rank()]
    inner.layers = [None] * inner.start_idx + inner.layers[inner.start_idx : inner.end_idx]


def own_split(inner: nn.Module) -> bool:
    """Whether ``inner`` was split by :func:`split_decoder` (not by mlx-lm's own pipeline)."""
    return getattr(inner, "pipeline_size", 1) > 1 and not isinstance(inner, PipelineMixin)


def stage_caches(kinds: list[str] | None, window: int | None, stage: "Stage") -> list[Any]:
    """The caches of ``stage``'s layers, by each one's kind in the whole decoder's ``kinds``
    (``layer_types``; None: all full attention): a sliding window layer's :class:`SlidingKVCache`,
    else a ``KVCache``."""
    sliding = [kinds is not None and kinds[i] == "sliding_attention" for i, _ in stage.layers]
    return [SlidingKVCache(window) if s else KVCache() for s in sliding]


def stage_masks(h: mx.array, cache: list[Any], kinds: list[str] | None, window: int | None, stage: "Stage") -> list:
    """One attention mask per layer of ``stage`` (paired with ``cache``, its own layers'), by each
    layer's kind in the whole decoder (``kinds``: ``layer_types``, None for all full attention),
    each kind's made from the first of the stage's caches of that kind (they all hold as much)."""
    made: dict[str, Any] = {}
    masks = []
    for (i, _), c in zip(stage.layers, cache):
        kind = "full_attention" if kinds is None else kinds[i]
        if kind not in made:
            sliding = kind == "sliding_attention"
            made[kind] = create_attention_mask(h, c, window_size=window if sliding else None)
        masks.append(made[kind])
    return masks


class Stage:
    """The layers this process runs of the decoder ``inner`` (mlx-lm's ``model.model``).

    Args:
        inner: The decoder, pipelined by mlx-lm or not.
        num_layers: The target's number of layers (``inner.layers`` stops at the stage's end).
        last: The target's last layer, whose tap every rank sets after the final norm.
    """

    def __init__(self, inner: nn.Module, num_layers: int, last: int | None = None):
        self.inner = inner
        self.rank = getattr(inner, "pipeline_rank", 0)
        self.size = getattr(inner, "pipeline_size", 1)
        self.start = getattr(inner, "start_idx", 0) if self.size > 1 else 0
        self.end = (getattr(inner, "end_idx", None) or num_layers) if self.size > 1 else num_layers
        self.last = num_layers - 1 if last is None else last
        self._carry: tuple[int, ...] | None = None  # the shape of what arrived from the rank above

    @property
    def layers(self) -> list[tuple[int, nn.Module]]:
        """``(layer index, layer)`` of the local layers, in order."""
        return list(enumerate(self.inner.layers[self.start : self.end], self.start))

    def receive(self, h: mx.array, captured: Any) -> mx.array:
        """The hidden state (and the folded taps so far) from the rank above; ``h`` itself on
        the first stage."""
        if self.rank >= self.size - 1:
            return h
        folded = _folded(captured)
        width = h.shape[-1] + (captured.width if folded else 0)
        carry = mx.distributed.recv_like(mx.zeros((*h.shape[:-1], width), mx.float32), self.rank + 1)
        if folded:
            captured.sum = carry[..., h.shape[-1] :]
            captured.dtype = h.dtype
        return carry[..., : h.shape[-1]].astype(h.dtype)

    def finish(self, h: mx.array, captured: Any, tap_ids: list[int]) -> mx.array:
        """Hand ``h`` (and the folded taps) to the rank below, then give every rank the final
        hidden state and every tap: the state to return; ``captured`` holds the taps after it."""
        if self.size == 1:
            return h
        folded = _folded(captured)
        if folded and captured.sum is None:
            captured.sum = mx.zeros((*h.shape[:-1], captured.width), mx.float32)
        # (B, L, H [+ H_fc]) in float32: exact for the float16 and bfloat16 states too.
        carry = mx.concatenate([h.astype(mx.float32)] + ([captured.sum] if folded else []), axis=-1)
        if self.rank != 0:
            sent = mx.distributed.send(carry, self.rank - 1)
            carry = mx.depends(mx.zeros_like(carry), sent)
        raw = [] if folded else [i for i in tap_ids if i != self.last]
        parts = [carry] + [_own(captured, i, h) for i in raw]
        total = mx.distributed.all_sum(mx.concatenate(parts, axis=-1))
        H = h.shape[-1]
        if folded:
            captured.sum, captured.dtype = total[..., H : carry.shape[-1]], h.dtype
        for k, i in enumerate(raw):
            start = carry.shape[-1] + k * H
            captured[i] = total[..., start : start + H].astype(h.dtype)
        return total[..., :H].astype(h.dtype)


def _folded(captured: Any) -> bool:
    return hasattr(captured, "width")


def _own(captured: dict, i: int, h: mx.array) -> mx.array:
    # A raw tap this rank made, or zeros in its place for the rank that made it.
    tap = captured.get(i)
    return mx.zeros(h.shape, mx.float32) if tap is None else tap.astype(mx.float32)
