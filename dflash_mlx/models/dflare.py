"""The DFlare drafter: DFlash with learned per-layer fusion of the taps and the context's own key/value
projections.

Read from the published checkpoints (Tencent AngelSlim, arXiv 2606.02091: ``AngelSlim/Qwen3-4b-dflare``;
reference ``qwen_dflare.py`` in Tencent/AngelSlim). Two things change from DFlash (``drafter.py``):

* no ``fc``: draft layer ``i`` sees ``hidden_norm`` of its own mix of the taps,
  ``sum_t softmax(layer_fusion_weights[i])[t] * tap_t`` (the taps each of the target's width);
* the context's keys and values come from ``k_proj_target`` / ``v_proj_target`` in each layer, the
  block's from ``k_proj`` / ``v_proj`` (``k_norm`` and RoPE on both, as in DFlash).

The block, its positions, the borrowed embedding and head, and the cache are DFlash's.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..cpu.speedups import CpuSpeedups
from . import drafter


def is_dflare(config: dict) -> bool:
    """Whether a drafter config is a DFlare one (by its ``architectures``)."""
    return any("DFlare" in a for a in config.get("architectures") or [])


def check_layout(config: dict) -> None:
    """Refuse a DFlare config we cannot run as its authors' class would (DFlash's attention layouts)."""
    drafter.check_attention_layout(config, "The config does not describe a DFlare drafter: re-download it.")


class DraftArgs(drafter.DraftArgs):
    check = staticmethod(check_layout)


class Attention(drafter.Attention):
    def __init__(self, args: drafter.DraftArgs, layer_idx: int = 0):
        super().__init__(args, layer_idx)
        dim, width = args.hidden_size, args.num_key_value_heads * args.head_dim
        self.k_proj_target = nn.Linear(dim, width, bias=args.attention_bias)
        self.v_proj_target = nn.Linear(dim, width, bias=args.attention_bias)

    def context_key_values(self, context: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        k = self.rope(self.k_norm(self._heads(self.k_proj_target(context), self.n_kv_heads)), offset)
        return k, self._heads(self.v_proj_target(context), self.n_kv_heads)


class DecoderLayer(drafter.DecoderLayer):
    def __init__(self, args: drafter.DraftArgs, layer_idx: int = 0):
        super().__init__(args, layer_idx)
        self.self_attn = Attention(args, layer_idx)

    def _compiled_steps(self, h: mx.array, speedups: CpuSpeedups | None) -> bool:
        return False  # the compiled steps project the context with k_proj/v_proj


class DraftModel(drafter.DraftModel):
    """The DFlare drafter: a context of its own per layer, from the fused taps."""

    layer_class = DecoderLayer
    family = "DFlare"

    def __init__(self, args: DraftArgs):
        if args.draft_vocab_size or args.target_hidden_size or not args.use_target_features:
            raise DFlashError("A DFlare drafter has no draft_vocab_size, target_hidden_size or use_target_features.")
        super().__init__(args)
        del self["fc"]
        n_taps = len(args.target_layer_ids) or args.num_hidden_layers
        self.layer_fusion_weights = mx.zeros((args.num_hidden_layers, n_taps))

    def tap_blocks(self) -> None:
        return None  # no fc to fold into the target's layers

    def contexts(self, taps: mx.array) -> list[mx.array]:
        B, L, width = taps.shape
        per_tap = taps.reshape(B, L, self.layer_fusion_weights.shape[1], width // self.layer_fusion_weights.shape[1])
        fused = mx.einsum("blth,dt->dblh", per_tap, mx.softmax(self.layer_fusion_weights, axis=-1))
        return [self.hidden_norm(f) for f in fused]

    def __call__(
        self,
        noise_embedding: mx.array,
        taps: mx.array,
        cache: list[Any] | None = None,
        mask: mx.array | None = None,
        block_offset: int | mx.array | None = None,
        speedups: CpuSpeedups | None = None,
    ) -> mx.array:
        """As :meth:`dflash_mlx.models.drafter.DraftModel.__call__`, each layer with its own context."""
        h = noise_embedding
        if cache is None:
            cache = [None] * len(self.layers)
        start = taps.shape[1] + (cache[0].offset if cache[0] is not None else 0)
        for layer, c, context in zip(self.layers, cache, self.contexts(taps)):
            layer_mask = mask
            if layer.self_attn.causal or layer.self_attn.window is not None:
                if mask is not None or block_offset is not None:
                    raise DFlashError("Training or batching a DFlare drafter with causal or sliding layers is not "
                                      "implemented.")  # fmt: skip
                layer_mask = drafter.block_mask(start, h.shape[1], layer.self_attn.causal, layer.self_attn.window)
            h = layer(h, context, c, layer_mask, block_offset, speedups)
        return self.norm(h)

    def extend_context(
        self, taps: mx.array, cache: list[Any], speedups: CpuSpeedups | None = None, projected: bool = False
    ) -> None:
        """As :meth:`dflash_mlx.models.drafter.DraftModel.extend_context` (``taps`` always raw)."""
        for start in range(0, taps.shape[1], drafter.CONTEXT_SLICE):
            rows = taps[:, start : start + drafter.CONTEXT_SLICE]
            for layer, c, context in zip(self.layers, cache, self.contexts(rows)):
                c.update_and_fetch(*layer.context_key_values(context, c.offset, speedups))
            if start + drafter.CONTEXT_SLICE < taps.shape[1]:
                mx.eval([c.state for c in cache])
