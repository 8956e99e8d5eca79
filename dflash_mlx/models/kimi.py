"""Kimi K2.5 targets (``kimi_k25``): a DeepSeek-V3 text model (MLA attention, MoE) under a vision
wrapper, and the checkpoint layouts mlx-lm would misread.

mlx-lm's ``kimi_k25.Model`` keeps the text model at ``language_model`` (``model.model`` reaches
its decoder) and drops the vision tower and projector on load. Its layers take the walk of
``target.forward_with_taps`` unchanged, with one difference: multi-head latent attention folds
the causal mask into its RoPE scores with ``mx.where``, so it needs the mask as a boolean array,
never mlx-lm's ``"causal"`` shortcut (:func:`layer_masks`).

Each layer's cache is a plain ``KVCache`` holding the compressed latent (``kv_lora_rank``) as keys
and the shared RoPE key (``qk_rope_head_dim``) as values, one position per token: ``trim(n)``
drops a rejected draft exactly, as for any attention layer.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..base.errors import DFlashError

KIMI_MODEL_TYPES = ("kimi_k25",)

# What mlx-lm's deepseek_v3 sanitize reads: INT4 experts as compressed-tensors packs them
# (``weight_packed``, ``weight_scale``, ``weight_shape``; signed values stored offset by 8), and FP8
# weights with one ``weight_scale_inv`` per 128x128 block.
_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
_FP8_BLOCK = [128, 128]
_PUBLISHED = "Use moonshotai/Kimi-K2.5 as published or an MLX conversion of it."


def layer_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list:
    """One boolean causal mask (or None for a single token) for every layer, as mlx-lm's
    ``DeepseekV3Model`` builds it."""
    mask = create_attention_mask(h, cache[0], return_array=True)
    return [mask] * len(inner.layers)


def check_layout(config: dict) -> None:
    """Refuse, from its config alone, a Kimi K2.5 checkpoint that mlx-lm would build or load wrongly
    (so that a hub target is refused before its weights are downloaded).

    mlx-lm's ``kimi_k25`` always builds an untied output head; reads the text model's RoPE from
    ``rope_theta`` and ``rope_scaling`` only (transformers 5 saves them under ``rope_parameters``);
    unpacks compressed-tensors experts as signed 4-bit integers in groups whatever the config says;
    and dequantizes FP8 weights in 128x128 blocks whatever their block size.
    """
    text = config.get("text_config") or {}
    for where, fields in (("config", config), ("text_config", text)):
        if fields.get("tie_word_embeddings"):
            raise DFlashError(
                f"The Kimi K2.5 target's {where} has tie_word_embeddings=true, but mlx-lm's kimi_k25 always "
                f"reads a separate output head (language_model.lm_head). {_PUBLISHED}"
            )
    if "rope_parameters" in text and not {"rope_theta", "rope_scaling"} <= set(text):
        raise DFlashError(
            "The Kimi K2.5 target's text_config gives its RoPE as rope_parameters only, which mlx-lm does not read "
            "(it would run with rope_theta=10000 and no YaRN). Copy rope_theta and the YaRN fields to rope_theta and "
            "rope_scaling in its config.json."
        )
    # As mlx-lm reads it: an MLX conversion's own quantization first, then the top level's, then the text model's.
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    method = None if "quantization" in config else quant.get("quant_method")
    if method == "compressed-tensors":
        unread = [] if quant.get("format") == "pack-quantized" else [f"format={quant.get('format')!r}"]
        for name, group in (quant.get("config_groups") or {}).items():
            weights = (group or {}).get("weights") or {}
            unread += [f"{name}.weights.{k}={weights.get(k)!r}" for k, v in _INT4.items() if weights.get(k) != v]
        if unread:
            raise DFlashError(
                f"The Kimi K2.5 target is quantized with compressed-tensors {unread[0]}, which mlx-lm cannot read for "
                f"kimi_k25: it reads pack-quantized symmetric 4-bit integer groups only. {_PUBLISHED}"
            )
    elif method == "fp8" and list(quant.get("weight_block_size") or ()) != _FP8_BLOCK:
        raise DFlashError(
            f"The Kimi K2.5 target is an FP8 checkpoint with weight_block_size={quant.get('weight_block_size')}, "
            f"which mlx-lm dequantizes as 128x128 blocks. {_PUBLISHED}"
        )
