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
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn


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
