"""Hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet linear attention with full attention
every few layers): their taps, and a recurrent cache that rolls back like a ``KVCache``.

A Gated DeltaNet layer keeps a conv state and a recurrent state (mlx-lm's ``ArraysCache``)
instead of per-token keys and values, so a rejected draft cannot be cut off its state.
``RecurrentCache`` is an ``ArraysCache`` that the layer reads and writes unchanged, and that
remembers, for the last pass, the state from before it and the decoder layer's input.
``trim(n)`` restores that state and replays the layer's input norm and linear attention
over the kept tokens only. Their outputs are never needed, and MLX computes lazily, so a
replay costs only the norm, the input projections, the convolution and the recurrence of
the kept tokens.

It also keeps a few earlier states ("checkpoints"), at the start of passes that followed a
pass nothing was trimmed from: the ends of prefills, which is where a chat's next turn
may want to return to. ``DFlashCache.reusable_prefix`` limits prefix reuse to them
(``dflash_mlx.cache.restorable_lengths``).
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from ..errors import DFlashError

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")

# States kept per layer for prefix reuse across calls (each one is a layer's conv and
# recurrent state: ~2 MB in fp32 for a Qwen3.5-4B layer).
MAX_CHECKPOINTS = 4


class RecurrentCache(ArraysCache):
    """A Gated DeltaNet layer's ``[conv_state, recurrent_state]`` that can be trimmed.

    ``begin(layer, h)`` is called before each pass with the decoder layer and its input;
    ``trim(n)`` then drops the last ``n`` tokens of that pass (and only of that pass), and
    :meth:`restore` returns the state to a checkpoint.
    """

    def __init__(self):
        super().__init__(size=2)
        self.offset = 0
        self._layer: nn.Module | None = None
        self._inputs: mx.array | None = None  # (B, L, H): the last pass's decoder layer input
        self._before: tuple[list, int] | None = None  # the state from before that pass
        self.checkpoints: dict[int, list] = {}

    def begin(self, layer: nn.Module, h: mx.array) -> None:
        """Remember the state before a pass of the decoder ``layer`` over its input ``h``."""
        if self._before is not None and self._inputs is not None and self.offset > 0:
            # Nothing was trimmed from the previous pass: it was a prefill (verify passes
            # are always followed by a trim), and this offset is a prompt boundary.
            self.checkpoint()
        self._layer, self._inputs = layer, h
        self._before = (list(self.cache), self.offset)

    def checkpoint(self) -> None:
        """Keep the current state for :meth:`restore` (the newest ``MAX_CHECKPOINTS``)."""
        if self.offset > 0:
            self.checkpoints[self.offset] = list(self.cache)
            while len(self.checkpoints) > MAX_CHECKPOINTS:
                del self.checkpoints[min(self.checkpoints)]

    def advance(self, n: int) -> None:
        super().advance(n)
        self.offset += n

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """Whether ``trim(n)`` can drop ``n`` tokens exactly."""
        if n <= 0:
            return True
        return self._before is not None and n <= self.offset - self._before[1]

    def trim(self, n: int) -> int:
        if n <= 0:
            self._before = self._inputs = None
            return 0
        if not self.can_trim(n):
            raise DFlashError(
                f"A recurrent target state cannot drop {n} tokens: only the last pass "
                f"({0 if self._before is None else self.offset - self._before[1]} tokens) can be undone. "
                "Start from a fresh cache (make_cache)."
            )
        state, start = self._before
        keep = self.offset - n - start
        self.cache, self.offset = list(state), start
        if keep > 0:
            # The layer's own modules on its own inputs: the linear attention sets the conv
            # and recurrent states and advances the offset. Its output is never evaluated.
            layer = self._layer
            layer.linear_attn(layer.input_layernorm(self._inputs[:, :keep]), None, self)
        self._before = self._inputs = None
        return n

    def restorable_lengths(self) -> set[int]:
        """Every length :meth:`trim` or :meth:`restore` can return this state to."""
        lengths = {0, self.offset} | set(self.checkpoints)
        if self._before is not None:
            lengths |= set(range(self._before[1], self.offset + 1))
        return lengths

    def restore(self, offset: int) -> None:
        """Return to the checkpoint at ``offset`` (0: the empty state)."""
        self.cache = [None, None] if offset == 0 else list(self.checkpoints[offset])
        self.offset = offset
        self._before = self._inputs = None
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= offset}

    @property
    def state(self):
        return self.cache

    @state.setter
    def state(self, v):
        self.cache = v


def make_cache(model: nn.Module) -> list[Any]:
    """The per-layer caches of a hybrid target: recurrent ones for linear attention layers."""
    return [RecurrentCache() if layer.is_linear else KVCache() for layer in model.layers]


def check_layout(config: dict) -> None:
    """Refuse a hybrid checkpoint whose ``layer_types`` mlx-lm would not build as written:
    mlx-lm places a full attention layer every ``full_attention_interval`` layers."""
    text = config.get("text_config") or config
    layer_types = text.get("layer_types")
    if layer_types is None:
        return
    interval = text.get("full_attention_interval", 4)
    built = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))]
    if list(layer_types) != built:
        raise DFlashError(
            f"The target's layer_types {list(layer_types)} differ from the layers mlx-lm builds ({built}: "
            f"full attention every full_attention_interval={interval} layers). Set full_attention_interval to match."
        )


def forward_with_taps(
    model: nn.Module, tokens: mx.array, cache: list[Any], tap_ids: list[int], start_every: int = 0
) -> tuple[mx.array, dict[int, mx.array]]:
    """The hybrid decoder walked layer by layer: ``(last layer's output, {layer: its output})``.

    Each linear attention layer's cache is told the layer's input first (see
    ``RecurrentCache.begin``); the layers themselves run unchanged.
    """
    inner = model.language_model.model
    h = inner.embed_tokens(tokens)
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    wanted, captured = set(tap_ids), {}
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        if isinstance(c, RecurrentCache):
            c.begin(layer, h)
        h = layer(h, ssm_mask if layer.is_linear else fa_mask, c)
        if i in wanted:
            captured[i] = h
        if start_every and (i + 1) % start_every == 0 and i + 1 < len(inner.layers):
            mx.async_eval(h)
    return h, captured
