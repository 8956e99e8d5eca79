"""Gemma 4 targets: their taps, their caches, and the layouts mlx-lm cannot build.

mlx-lm's ``gemma4_text``, and ``gemma4`` / ``gemma4_unified`` (both built by mlx-lm's gemma4
module) with the text model under ``language_model``.

Gemma 4 differs from the Qwen-style decoder in what surrounds the layers: the embedding is
scaled by ``sqrt(hidden_size)``; the small models add a per-layer input to every layer and let
their last layers reuse the keys and values of an earlier layer of the same type; sliding
window layers and full attention layers take masks of their own; the logits are softcapped.
:func:`forward_with_taps` walks mlx-lm's ``Gemma4TextModel.__call__`` step for step, with
the model's own helpers for the per-layer inputs and the masks.

mlx-lm gives the sliding layers a ``RotatingKVCache``, which cannot drop a rejected draft once
it has wrapped around. Here the full attention layers get a plain ``KVCache`` and the sliding
layers the :class:`~dflash_mlx.models.sliding.SlidingKVCache` that gpt-oss targets use too.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gemma4_text import logit_softcap

from ..base.errors import DFlashError
from .sliding import SlidingKVCache
from .stages import Stage, even_split, stage_caches, stage_masks

GEMMA_MODEL_TYPES = ("gemma4_text", "gemma4", "gemma4_unified")

# What mlx-lm 0.32's gemma4_text.ModelArgs assumes when a config leaves a field out.
_MLX_GLOBAL_HEAD_DIM = 512
_MLX_VOCAB_SIZE = 262144
# Fields whose default differs between mlx-lm and transformers: (mlx-lm's, transformers').
_DEFAULTS_THAT_DIFFER = {"num_kv_shared_layers": (20, 0), "final_logit_softcapping": (30.0, None)}


def text_model(model: nn.Module) -> nn.Module:
    """The ``gemma4_text.Model`` (a ``gemma4`` checkpoint keeps it under ``language_model``)."""
    return getattr(model, "language_model", model)


def make_cache(model: nn.Module) -> list[Any]:
    """The caches of the layers that keep keys and values (not the layers that reuse an earlier
    layer's): a :class:`SlidingKVCache` for a sliding-window layer, a ``KVCache`` for the others."""
    args = text_model(model).args
    stage = Stage(text_model(model).model, args.num_hidden_layers)
    if stage.size > 1:
        return stage_caches(args.layer_types, args.sliding_window, stage)[: max(0, _first_shared(args) - stage.start)]
    return [
        SlidingKVCache(args.sliding_window) if kind == "sliding_attention" else KVCache()
        for kind in args.layer_types[: _first_shared(args)]
    ]


def _first_shared(args: Any) -> int:
    # The first layer that reuses an earlier layer's keys and values (the number of layers: none).
    return args.num_hidden_layers - args.num_kv_shared_layers


def pipeline_split(model: nn.Module, size: int, split: list[int] | None) -> list[int] | None:
    """The layers per rank (rank 0's first) of a pipeline over ``size`` ranks: ``split``, or
    None for mlx-lm's even split, unless layers that reuse an earlier layer's keys and values
    would be on another rank than that layer: rank 0, which runs the last layers, then runs
    all of them from the first layer they reuse.

    Raises:
        DFlashError: If ``split`` puts such a layer apart from the one it reuses, or the ranks
          are too many for the layers left to the others.
    """
    inner = text_model(model).model
    args = text_model(model).args
    n, first = args.num_hidden_layers, _first_shared(args)
    if first == n:
        return split
    together = n - min(inner.previous_kvs[first:])  # rank 0's layers at least
    if split is not None and split[0] < together:
        raise DFlashError(
            f"This Gemma 4 target's last {n - first} layers reuse the keys and values of layers from layer "
            f"{n - together} on, so rank 0 must run its last {together} layers (got --pipeline-split "
            f"{','.join(map(str, split))}): give rank 0 at least {together}, or leave --pipeline-split out."
        )
    if split is not None:
        return split
    even = even_split(n, size)
    if even[0] >= together:
        return None
    if n - together < size - 1:
        raise DFlashError(
            f"This Gemma 4 target's last {together} layers reuse keys and values among themselves and must "
            f"run on one rank, which leaves {n - together} layers for the other {size - 1} ranks: use fewer ranks."
        )
    return [together] + even_split(n - together, size - 1)


def softcap(model: nn.Module, logits: mx.array) -> mx.array:
    """The target's final logit softcapping, as mlx-lm applies it (none if not configured)."""
    cap = text_model(model).final_logit_softcapping
    return logits if cap is None else logit_softcap(cap, logits)


def check_layout(config: dict) -> None:
    """Refuse a Gemma 4 checkpoint that mlx-lm would build differently from its config.

    transformers 5.24 writes the full attention layers' head size and key/value heads as a
    ``per_layer_config``, which mlx-lm does not read: it would build those layers with
    ``global_head_dim`` (default 512). A ``gemma4`` (or ``gemma4_unified``) config without a top-level ``vocab_size``
    gets mlx-lm's 262144. A config without ``num_kv_shared_layers`` or ``final_logit_softcapping``
    means 0 / none to transformers, 20 / 30.0 to mlx-lm. Bidirectional text attention is not
    implemented by mlx-lm.
    """
    text = config.get("text_config") or config
    fix = "Use the checkpoint as published, or add the field to its config.json."
    for key, (mlx_default, hf_default) in _DEFAULTS_THAT_DIFFER.items():
        if key not in text:
            raise DFlashError(
                f"The target config has no {key}: transformers reads that as {hf_default}, mlx-lm as "
                f'{mlx_default}. Add "{key}" to its config.json.'
            )
    for layer, override in sorted((text.get("per_layer_config") or {}).items(), key=lambda kv: int(kv[0])):
        for key, mlx_key, default in (
            ("head_dim", "global_head_dim", _MLX_GLOBAL_HEAD_DIM),
            ("num_key_value_heads", "num_global_key_value_heads", text.get("num_key_value_heads")),
        ):
            if key in override and override[key] != text.get(mlx_key, default):
                raise DFlashError(
                    f"The target's per_layer_config gives layer {layer} {key}={override[key]}, which mlx-lm does "
                    f"not read: it builds that layer from {mlx_key}={text.get(mlx_key, default)}. Set "
                    f"{mlx_key}={override[key]} in its config.json (the published Gemma 4 configs have it)."
                )
    if config.get("model_type") in ("gemma4", "gemma4_unified"):
        vocab, text_vocab = config.get("vocab_size", _MLX_VOCAB_SIZE), text.get("vocab_size", _MLX_VOCAB_SIZE)
        if vocab != text_vocab:
            raise DFlashError(
                f"The target's text_config has vocab_size={text_vocab}, but mlx-lm builds a gemma4 model "
                f"from the top-level vocab_size={vocab}. {fix}"
            )
    if text.get("use_bidirectional_attention") == "all":
        raise DFlashError(
            "The target has use_bidirectional_attention='all', which mlx-lm does not implement "
            "(it runs Gemma 4 causally). Use a causal Gemma 4 checkpoint."
        )


def forward_with_taps(
    model: nn.Module,
    tokens: mx.array,
    cache: list[Any],
    tap_ids: list[int],
    captured: Any,
    start_every: int = 0,
    masks: list[mx.array] | None = None,
    stage_layers: int | None = None,
) -> mx.array:
    """The Gemma 4 decoder walked layer by layer, as mlx-lm's ``Gemma4TextModel.__call__``: the
    last layer's output before the final norm; each layer in ``tap_ids`` has its output set in
    ``captured`` (a dict, or ``target.FoldedTaps``). ``masks``: one per cached layer (a draft
    tree's), instead of the model's own; a layer that reuses another's keys takes its mask.
    A pipelined target runs its stage's layers (``stage_layers``: the target's number of layers;
    :class:`~dflash_mlx.models.stages.Stage`), whose ``cache`` is its own layers'."""
    inner = text_model(model).model
    stage = Stage(inner, len(inner.layers) if stage_layers is None else stage_layers)
    embedding = inner.embed_tokens(tokens)
    h = embedding * inner.embed_scale
    per_layer = {}
    if inner.hidden_size_per_layer_input:
        inputs = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens, embedding))
        per_layer = {i: inputs[:, :, i, :] for i, _ in stage.layers}  # (B, L, hidden_size_per_layer_input) each
    # Layers that reuse an earlier layer's keys and values keep no cache of their own.
    cache = list(cache) + [None] * (len(stage.layers) - len(cache))
    if masks is None:
        kinds = text_model(model).args.layer_types
        masks = stage_masks(h, cache, kinds, inner.window_size, stage)
    else:
        masks = [masks[inner.previous_kvs[i] - stage.start] for i, _ in stage.layers]  # the stage's own caches
    h = stage.receive(h, captured)
    shared = {}  # each layer's (keys, values) and RoPE offset, for the layers reusing them
    wanted = set(tap_ids)
    for (i, layer), c, mask in zip(stage.layers, cache, masks):
        kvs, offset = shared.get(inner.previous_kvs[i], (None, None))
        h, kvs, offset = layer(h, mask, c, per_layer_input=per_layer.get(i), shared_kv=kvs, offset=offset)
        shared[i] = (kvs, offset)
        if i in wanted:
            captured[i] = h
        if start_every and (i + 1) % start_every == 0 and i + 1 < stage.end:
            mx.async_eval(h)
    return stage.finish(h, captured, tap_ids)
