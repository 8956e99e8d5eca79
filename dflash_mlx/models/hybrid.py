"""Hybrid targets (Qwen3.5 / Qwen3.6 and Qwen3-Next / Qwen3-Coder-Next: Gated DeltaNet
linear attention with gated full attention every few layers): their taps, and a recurrent
cache that rolls back like a ``KVCache``.

mlx-lm builds both families' decoders alike: ``model.model`` holds the layers, each with
``is_linear``, an ``input_layernorm`` and either a ``linear_attn(x, mask, cache)`` over an
``ArraysCache`` of ``[conv_state, recurrent_state]`` or a ``self_attn`` over a ``KVCache``,
and the ids of a layer of each kind for the masks (``ssm_idx``, ``fa_idx``). They differ
around that: Qwen3.5 is a vision-language model whose text model sits under
``language_model`` (``model.model`` reaches it), its projections are split
(``in_proj_qkv``, ``in_proj_z``, ...) where Qwen3-Next fuses them (``in_proj_qkvz``,
``in_proj_ba``), and Qwen3-Next picks a layer's experts by ``decoder_sparse_step`` and
``mlp_only_layers``. Nothing here depends on those.

A Gated DeltaNet layer keeps a conv state and a recurrent state (mlx-lm's ``ArraysCache``)
instead of per-token keys and values, so a rejected draft cannot be cut off its state.
``RecurrentCache`` is an ``ArraysCache`` that the layer reads and writes unchanged, and that
remembers, for the last pass, the state from before it and the decoder layer's input.
A pass of at most ``RECORD_POSITIONS`` tokens (a verify pass) runs the linear attention
through ``linear_attention``, which also returns the recurrent state after every position and
the convolution's inputs; ``trim(n)`` then selects the state at the kept length. A longer pass
(a prefill) keeps nothing per position: ``trim(n)`` restores the state from before it and
replays the layer's input norm and linear attention over the kept tokens only. Their outputs
are never needed, and MLX computes lazily, so a replay costs only the norm, the input
projections, the convolution and the recurrence of the kept tokens.

It also keeps a few earlier states ("checkpoints"), at the start of passes that followed a
pass nothing was trimmed from: the ends of prefills, which is where a chat's next turn
may want to return to. ``DFlashCache.reusable_prefix`` limits prefix reuse to them
(:func:`dflash_mlx.models.caches.restorable_lengths`).
"""

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from ..base.errors import DFlashError
from . import linear_attention
from .caches import Restoring
from .stages import Stage

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# States kept per layer for prefix reuse across calls (each one is a layer's conv and
# recurrent state: ~2 MB in fp32 for a Qwen3.5-4B layer).
MAX_CHECKPOINTS = 4
# The longest pass whose per-position states are kept for trim (a verify block): each position
# holds a layer's whole recurrent state, ~2 MB in float32 for a Qwen3.5-4B layer.
RECORD_POSITIONS = 16


class RecurrentCache(ArraysCache, Restoring):
    """A Gated DeltaNet layer's ``[conv_state, recurrent_state]`` that can be trimmed.

    ``begin(layer, h)`` is called before each pass with the decoder layer and its input;
    ``trim(n)`` then drops the last ``n`` tokens of that pass (and only of that pass), and
    :meth:`restore` returns the state to a checkpoint. ``kernels`` is the Metal kernels' mode of its
    passes' recurrence (:mod:`dflash_mlx.kernels`), given once when the cache is made.
    """

    kind = "recurrent state"

    def __init__(self, kernels: str = "auto"):
        super().__init__(size=2)
        self.kernels = kernels
        self.offset = 0
        self._layer: nn.Module | None = None
        self._inputs: mx.array | None = None  # (B, L, H): the last pass's decoder layer input
        self._before: tuple[list, int] | None = None  # the state from before that pass
        # That pass's convolution inputs (B, K - 1 + L, C) and state after each position
        # (L of (B, Hv, Dv, Dk)), when it ran through ``linear_attention``.
        self._steps: tuple[mx.array, list[mx.array]] | None = None
        self._tree: tuple[mx.array, list[mx.array]] | None = None  # a draft tree pass's, until keep()
        self.checkpoints: dict[int, list] = {}

    def begin(self, layer: nn.Module, h: mx.array) -> None:
        """Remember the state before a pass of the decoder ``layer`` over its input ``h``."""
        if self._before is not None and self._inputs is not None and self.offset > 0:
            # Nothing was trimmed from the previous pass: it was a prefill (verify passes
            # are always followed by a trim), and this offset is a prompt boundary.
            self.checkpoint()
        self._layer, self._inputs, self._steps = layer, h, None
        self._before = (list(self.cache), self.offset)

    def record(self, conv_input: mx.array, states: list[mx.array]) -> None:
        """Keep the pass's convolution inputs and per-position states (``linear_attention``'s),
        so that :meth:`trim` selects a state instead of replaying the kept tokens."""
        self._steps = (conv_input, states)

    def fork(self, sources: mx.array, states: list[mx.array]) -> None:
        """A draft tree pass ran over this layer (``linear_attention.tree_linear_attention``'s conv
        sources and per-node states); the state stays as it was until :meth:`keep`."""
        if self._before is not None and self._inputs is not None and self.offset > 0:
            self.checkpoint()  # as begin(): the previous pass was a prefill
        self._before = self._inputs = self._steps = None
        self._tree = (sources, states)

    def keep(self, start: int, path: list[int]) -> None:
        """Take the state after the last node of ``path`` (root first) as this layer's, ``len(path)``
        tokens on; :meth:`trim` can then go back along the path like after a verify pass."""
        sources, states = self._tree
        width = sources.shape[0] - len(states)  # K - 1
        rows = list(range(width)) + [width + i for i in path]
        conv_input = sources[mx.array(rows)][None]  # (1, K - 1 + len(path), conv_dim)
        self._before = (list(self.cache), self.offset)
        self._steps = (conv_input, [states[i] for i in path])
        self.cache = [mx.contiguous(conv_input[:, -width:]), states[path[-1]]]
        self.offset += len(path)
        self._tree = None

    def settled(self) -> None:
        """Its state was set from outside (a batch's row): no pass of its own to undo."""
        self._layer = self._inputs = self._before = self._steps = self._tree = None

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
            self._before = self._inputs = self._steps = None
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
        if keep > 0 and self._steps is not None:
            # The conv state is the K - 1 convolution inputs before the next token.
            conv_input, states = self._steps
            width = conv_input.shape[1] - len(states)
            self.cache = [mx.contiguous(conv_input[:, keep : keep + width]), states[keep - 1]]
            self.offset = start + keep
        elif keep > 0:
            # The layer's own modules on its own inputs (the same two calls in Qwen3.5's and
            # Qwen3-Next's decoder layers): the linear attention sets the conv and recurrent
            # states and advances the offset. Its output is never evaluated.
            layer = self._layer
            layer.linear_attn(layer.input_layernorm(self._inputs[:, :keep]), None, self)
        self._before = self._inputs = self._steps = None
        # A state kept past the new end is one of the dropped tokens: never one to return to.
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= self.offset}
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
        self._before = self._inputs = self._steps = None
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= offset}

    @property
    def state(self):
        return self.cache

    @state.setter
    def state(self, v):
        self.cache = v


def make_cache(model: nn.Module, kernels: str = "auto") -> list[Any]:
    """The per-layer caches of a hybrid target: recurrent ones for linear attention layers, whose passes run
    the Metal kernels as ``kernels`` says."""
    return [RecurrentCache(kernels) if layer.is_linear else KVCache() for layer in model.layers]


def check_layout(config: dict) -> None:
    """Refuse, from its config alone, a hybrid checkpoint that mlx-lm would not build or load
    as written (so that a hub target is refused before its weights are downloaded).

    mlx-lm places a full attention layer every ``full_attention_interval`` layers whatever
    ``layer_types`` says, looks up the first of them in every pass, reads Qwen3-Next's RoPE
    settings from the top of the config only (transformers 5 writes them under
    ``rope_parameters``), and dequantizes no FP8 checkpoint of these families.
    """
    text = config.get("text_config") or config
    model_type = config.get("model_type")
    interval = text.get("full_attention_interval", 4)
    layer_types = text.get("layer_types")
    if layer_types is not None:
        built = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))]
        if list(layer_types) != built:
            raise DFlashError(
                f"The target's layer_types {list(layer_types)} differ from the layers mlx-lm builds ({built}: "
                f"full attention every full_attention_interval={interval} layers). Set full_attention_interval "
                "to match."
            )
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and layers < interval:
        raise DFlashError(
            f"The target has {layers} layers and full_attention_interval={interval}: mlx-lm builds no full "
            "attention layer for it and cannot run it. Use a checkpoint with at least one full attention layer."
        )
    if model_type == "qwen3_next":
        required = [
            f.name for f in dataclasses.fields(qwen3_next.ModelArgs)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]  # fmt: skip
        missing = [name for name in required if name not in config]
        if missing:
            fix = (
                "copy rope_theta and partial_rotary_factor out of its rope_parameters to the top of config.json"
                if "rope_parameters" in config and {"rope_theta", "partial_rotary_factor"} & set(missing)
                else "re-download the original checkpoint or add them to config.json"
            )
            raise DFlashError(f"The qwen3_next target config lacks {', '.join(missing)}, which mlx-lm needs: {fix}.")
    quant = text.get("quantization_config") or config.get("quantization_config") or {}
    fp8_blocks = list(quant.get("weight_block_size") or ())
    if quant.get("quant_method") == "fp8" and not (quant.get("scale_fmt") == "ue8m0" and fp8_blocks == [32, 32]):
        raise DFlashError(
            f"The target is an FP8 checkpoint (weight_block_size={fp8_blocks}), which mlx-lm cannot load for "
            f"{model_type}. Use the BF16 original or an MLX conversion (e.g. mlx-community's 4bit/8bit)."
        )


def forward_with_taps(
    model: nn.Module,
    tokens: mx.array,
    cache: list[Any],
    tap_ids: list[int],
    captured: Any,
    start_every: int = 0,
    stage_layers: int | None = None,
) -> mx.array:
    """The hybrid decoder walked layer by layer: the last layer's output; each layer in
    ``tap_ids`` has its output set in ``captured`` (a dict, or ``target.FoldedTaps``).

    Each linear attention layer's cache is told the layer's input first (see
    ``RecurrentCache.begin``). A pass of at most ``RECORD_POSITIONS`` tokens runs those layers
    through :func:`recorded_layer` (the same output, and what a rollback selects from); the
    other layers, and longer passes, run unchanged. A pipelined target runs its stage's layers
    (``stage_layers``: the target's number of layers; :class:`~dflash_mlx.models.stages.Stage`).
    """
    inner = model.model  # Qwen3.5's text model too (its Model's ``model`` property)
    stage = Stage(inner, len(inner.layers) if stage_layers is None else stage_layers)
    h = inner.embed_tokens(tokens)
    # A pipeline stage's mask ids count its own layers, and it may lack one kind.
    fa_mask = None if inner.fa_idx is None else create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = None if inner.ssm_idx is None else create_ssm_mask(h, cache[inner.ssm_idx])
    wanted = set(tap_ids)
    h = stage.receive(h, captured)
    for (i, layer), c in zip(stage.layers, cache):
        mask = ssm_mask if layer.is_linear else fa_mask
        if isinstance(c, RecurrentCache):
            c.begin(layer, h)
        if (
            isinstance(c, RecurrentCache)
            and h.shape[1] <= RECORD_POSITIONS
            and linear_attention.supports(layer.linear_attn, mask, c)
        ):
            h = recorded_layer(layer, h, c)
        else:
            h = layer(h, mask, c)
        if i in wanted:
            captured[i] = h
        if start_every and (i + 1) % start_every == 0 and i + 1 < stage.end:
            mx.async_eval(h)
    return stage.finish(h, captured, tap_ids)


def forward_tree(
    model: nn.Module,
    rows: mx.array,
    views: list[Any],
    masks: list,
    tap_ids: list[int],
    captured: Any,
    parents: list[int],
) -> mx.array:
    """The hybrid decoder over a draft tree's nodes, one per row (:mod:`dflash_mlx.drafts.tree`): full
    attention layers through their tree views and masks, linear attention layers continuing each
    node's own path (``linear_attention.tree_linear_attention``, states forked at every branch)."""
    inner = model.model
    h = inner.embed_tokens(rows)
    wanted = set(tap_ids)
    for i, (layer, c, mask) in enumerate(zip(inner.layers, views, masks)):
        if isinstance(c, RecurrentCache):
            if not linear_attention.supports(layer.linear_attn, None, c):
                raise DFlashError(
                    f"Draft trees need a Gated DeltaNet layer this library walks itself (got "
                    f"{type(layer.linear_attn).__name__}); use tree_budget=0."
                )
            r, sources, states = linear_attention.tree_linear_attention(
                layer.linear_attn, layer.input_layernorm(h), c, parents
            )
            c.fork(sources, states)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            h = layer(h, mask, c)
        if i in wanted:
            captured[i] = h
    return h


def recorded_layer(layer: nn.Module, x: mx.array, cache: Any) -> mx.array:
    """A Gated DeltaNet decoder layer over ``x`` whose ``cache`` keeps every position's state (``record``)."""
    # The decoder layer's own three lines (Qwen3.5's and Qwen3-Next's alike), its linear
    # attention through linear_attention so that the cache keeps every position's state.
    r, conv_input, states = linear_attention.linear_attention(layer.linear_attn, layer.input_layernorm(x), cache)
    cache.record(conv_input, states)
    h = x + r
    return h + layer.mlp(layer.post_attention_layernorm(h))
