"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block at once.

The drafter has no embedding or LM head of its own; it borrows the target's. It is
conditioned on the target's hidden states (the "taps"), which are projected once by
``fc`` + ``hidden_norm`` and injected as extra keys/values into every layer (paper §3).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.utils import save_config, save_model

from ..base.errors import DFlashError
from ..cpu import compiled_layers, fast_math
from ..cpu.speedups import CpuSpeedups
from . import target as tgt

# Prompt positions whose taps extend_context projects at a time (see there): at 64 an 8B-shaped
# drafter's prefill peaks at 1.09x its K/V at 16k (1.10x at 128); BENCHMARKS.md, "Long prompts".
CONTEXT_SLICE = 64

# Keys of the published checkpoints that may live under "dflash_config".
_DFLASH_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "num_target_layers",
    "use_target_features",
    # JetSpec's heads (hao-ai-lab/JetSpec): a block-causal mask in every layer, and the width of
    # the target's hidden states where a shared linear adapter maps them to the drafter's.
    "causal_head",
    "target_hidden_size",
)

# Fields of newer drafters (DFlash2: a convolution, a token selector, scaled logits and
# embeddings) that change what the model computes; this drafter implements none of them.
# (A top-level final_logit_softcapping is the target's, as Gemma 4's drafters carry it: the
# drafter borrows the target's head, softcap included, and the pair check compares the two.)
_UNSUPPORTED_DFLASH_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
)


def check_layout(config: dict) -> None:
    """Refuse a drafter config whose attention layout or extra fields we cannot honour.

    Read: ``rope_theta`` or ``rope_parameters``, any number of taps and layers, and
    ``layer_types`` of ``full_attention`` and ``sliding_attention`` layers (with
    ``sliding_window`` and ``is_causal``, see :func:`block_mask`).

    Raises:
        DFlashError: For other layer types, a sliding layer without a window, a scaled input
          embedding or DFlash2's fields, each named in the message.
    """
    fix = "Use a DFlash drafter of full_attention or sliding_attention layers."
    others = ("DFlash", "DFlare", "DSpark")
    archs = [a for a in config.get("architectures") or [] if a != "DFlashDraftModel" and any(o in a for o in others)]
    if archs:
        raise DFlashError(f"Unsupported drafter architecture {archs[0]!r}: this drafter is DFlashDraftModel. {fix}")
    check_attention_layout(config, fix)
    nested = {**config, **(config.get("dflash_config") or {})}
    extra = [k for k in _UNSUPPORTED_DFLASH_KEYS if nested.get(k) is not None]
    if extra:
        raise DFlashError(f"Unsupported drafter fields {extra} (a DFlash2 drafter?). {fix}")
    scale = nested.get("input_embedding_scale", 1.0)
    if scale != 1.0:
        raise DFlashError(f"Unsupported drafter input_embedding_scale={scale!r}: only 1.0 is implemented. {fix}")


def check_attention_layout(config: dict, fix: str) -> None:
    """Refuse ``layer_types`` other than full and sliding attention, a sliding layer without a
    window, and an ``is_causal`` that is not a boolean; ``fix`` ends each message."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        layers = config.get("num_hidden_layers")
        if len(layer_types) != layers:
            raise DFlashError(f"The drafter's layer_types has {len(layer_types)} entries for {layers} layers. {fix}")
        other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if other:
            raise DFlashError(f"Unsupported drafter layer_types {other}. {fix}")
        window = config.get("sliding_window")
        if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
            raise DFlashError(f"The drafter has sliding_attention layers but sliding_window={window!r}. {fix}")
    rope = config.get("rope_parameters") or {}
    per_type = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if per_type:
        raise DFlashError(
            f"Unsupported drafter rope_parameters per layer type {per_type}: this drafter takes one RoPE "
            "for all its layers: give rope_parameters a rope_theta (and rope_type) of its own."
        )
    if config.get("is_causal") not in (None, True, False):
        raise DFlashError(f"Unsupported drafter is_causal={config['is_causal']!r}: use true or false. {fix}")


def block_mask(start: int, length: int, causal: bool, window: int | None) -> mx.array | None:
    """Which keys each block query sees, ``(length, start + length)`` booleans, or None for all.

    Keys are the context positions ``0..start-1`` then the block's; query ``i`` sits at
    ``start + i``. As in z-lab's drafters: a causal layer sees no later key, a sliding one
    no key ``window`` or more positions before (and, if not causal, after) its query.
    """
    if not causal and window is None:
        return None
    q = mx.arange(start, start + length)[:, None]
    k = mx.arange(start + length)[None]
    visible = k <= q if causal else mx.ones((length, start + length), dtype=mx.bool_)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The paper's rule: ``num_taps`` layers spread evenly from layer 1 to L-3."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DraftArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    vocab_size: int | None = None
    num_target_layers: int | None = None
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    # False only for the ablation drafter trained without the target's context.
    use_target_features: bool = True
    # JetSpec: every layer block-causal (as is_causal=True), and the taps' width when not hidden_size.
    causal_head: bool = False
    target_hidden_size: int | None = None
    # Drafts only among these many token ids (FR-Spec), held in the weights as ``draft_vocab``.
    draft_vocab_size: int | None = None
    # The target head's softcapping the drafter was trained through (None: not stated).
    final_logit_softcapping: float | None = None
    model_type: str = "qwen3"
    # The keys lifted from "dflash_config", and the check a config passes first.
    nested_keys: ClassVar[tuple[str, ...]] = _DFLASH_KEYS
    check: ClassVar = staticmethod(check_layout)

    @classmethod
    def from_dict(cls, params: dict) -> "DraftArgs":
        cls.check(params)
        params = dict(params)
        nested = params.get("dflash_config") or {}
        for key in cls.nested_keys:
            if nested.get(key) is not None:
                params[key] = nested[key]
        return super().from_dict(params)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # transformers >= 5 nests rope settings under rope_parameters.
        rope = self.rope_parameters or {}
        if self.rope_theta is None:
            self.rope_theta = rope.get("rope_theta", 1_000_000.0)
        if self.rope_scaling is None and rope.get("rope_type", "default") != "default":
            self.rope_scaling = rope
        if self.causal_head and self.is_causal is None:
            self.is_causal = True
        self.target_layer_ids = list(self.target_layer_ids or [])
        if not self.target_layer_ids and self.num_target_layers:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)


class Attention(nn.Module):
    def __init__(self, args: DraftArgs, layer_idx: int = 0):
        super().__init__()
        # Sliding layers of newer drafters: causal by default, and windowed (see block_mask).
        sliding = bool(args.layer_types) and args.layer_types[layer_idx] == "sliding_attention"
        self.causal = sliding if args.is_causal is None else bool(args.is_causal)
        self.window = args.sliding_window if sliding else None
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim, self.scale = hd, hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        # An explicit head_dim: an empty context (L == 0) cannot infer a -1.
        return x.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(
        self,
        x: mx.array,
        context: mx.array,
        cache: Any | None = None,
        mask: mx.array | None = None,
        block_offset: int | mx.array | None = None,
        fast_exp: bool = False,
    ) -> mx.array:
        B, L, _ = x.shape
        ctx_offset = cache.offset if cache is not None else 0
        if block_offset is None:
            # The block sits right after the context: [context..., last, mask, ...].
            block_offset = ctx_offset + context.shape[1]

        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), block_offset)
        k = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), block_offset)
        v = self._heads(self.v_proj(x), self.n_kv_heads)

        k_ctx, v_ctx = self.context_key_values(context, ctx_offset)
        out = self.attend(q, k, v, k_ctx, v_ctx, cache, mask, fast_exp)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def context_key_values(self, context: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Keys and values ``(B, n_kv_heads, Lc, D)`` of context rows ``context`` (``hidden_norm``'s
        output, not normed again per layer) at positions from ``offset``."""
        k = self.rope(self.k_norm(self._heads(self.k_proj(context), self.n_kv_heads)), offset)
        return k, self._heads(self.v_proj(context), self.n_kv_heads)

    def attend(
        self, q, k, v, k_ctx, v_ctx, cache: Any | None, mask: mx.array | None, fast_exp: bool = False
    ) -> mx.array:
        """The block's queries over the cached context, the new context and the block
        itself, all ``(B, heads, length, D)``; returns ``(B, n_heads, L, D)``."""
        B = q.shape[0]
        # A windowed cache keeps no room past its context, and a block of more rows than the
        # context (sampled proposals) no longer fits the cache's one row: both are joined below.
        if cache is not None and k_ctx.shape[0] == B and type(cache) is KVCache:
            keys, values = _with_block(cache, k_ctx, v_ctx, k, v)
        else:
            if cache is not None:
                # Only the context is cached; the noisy block is recomputed every cycle.
                if k_ctx.shape[2] > 0:
                    k_ctx, v_ctx = cache.update_and_fetch(k_ctx, v_ctx)
                elif cache.offset > 0:
                    k_ctx, v_ctx = cache.keys_and_values()
            if k_ctx.shape[0] != B:
                k_ctx = mx.broadcast_to(k_ctx, (B, *k_ctx.shape[1:]))
                v_ctx = mx.broadcast_to(v_ctx, (B, *v_ctx.shape[1:]))
            keys = mx.concatenate([k_ctx, k], axis=2)
            values = mx.concatenate([v_ctx, v], axis=2)
        if mask is not None and mask.shape[-1] > keys.shape[2]:
            # A windowed cache dropped the oldest context keys; the mask was made for all of
            # them. Only a sliding layer's (whose window they are outside of) or a causal one's
            # (which sees every context key) are dropped, so the mask's last columns are theirs.
            mask = mask[..., -keys.shape[2] :]

        # No causal mask: the block attends to the whole context and to itself both ways.
        return fast_math.attention(q, keys, values, self.scale, mask, fast_exp=fast_exp)


def _with_block(cache: KVCache, k_ctx, v_ctx, k, v) -> tuple[mx.array, mx.array]:
    # The context's keys/values, then the block's, without copying the context: mlx-lm's
    # KVCache writes into a buffer with room past its offset and hands back a view of it, so
    # the block is written there and trimmed off again (the next context overwrites it).
    length = k.shape[2]
    if k_ctx.shape[2] > 0:
        k, v = mx.concatenate([k_ctx, k], axis=2), mx.concatenate([v_ctx, v], axis=2)
    keys, values = cache.update_and_fetch(k, v)
    cache.trim(length)
    return keys, values


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array, fast_exp: bool = False) -> mx.array:
        return self.down_proj(fast_math.swiglu(self.gate_proj(x), self.up_proj(x), fast_exp))


class DecoderLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h, context, cache=None, mask=None, block_offset=None, speedups=None) -> mx.array:
        # Compiled: drafting (no mask), or several rows' blocks at their own positions under their mask; a causal
        # layer's own mask (no block_offset) runs as written.
        if cache is not None and (mask is None or block_offset is not None) and self._compiled_steps(h, speedups):
            return self._compiled_call(h, context, cache, speedups, mask, block_offset)
        kernel = speedups is not None and speedups.fast_exp
        # The context is used as it comes out of hidden_norm, not re-normed per layer.
        h = h + self.self_attn(self.input_layernorm(h), context, cache, mask, block_offset, kernel)
        return h + self.mlp(self.post_attention_layernorm(h), kernel)

    def _compiled_steps(self, h: mx.array, speedups: CpuSpeedups | None) -> bool:
        # Drafting with the CPU speedups (float32): the same operations as below, compiled
        # around the attention (dflash_mlx.cpu.compiled_layers). Training (no cache) stays as written.
        attn = self.self_attn
        return (
            speedups is not None
            and h.dtype == mx.float32
            and compiled_layers.plain_layer(attn, self.mlp, self.input_layernorm, self.post_attention_layernorm)
        )

    def _compiled_call(
        self, h: mx.array, context: mx.array, cache: Any, speedups: CpuSpeedups, mask=None, block_offset=None
    ) -> mx.array:
        attn = self.self_attn
        ctx_offset = cache.offset
        offset = ctx_offset + context.shape[1] if block_offset is None else block_offset
        q, k, v = compiled_layers.before(attn, self.input_layernorm, h, offset, speedups)
        if context.shape[1] > 0:
            k_ctx, v_ctx = compiled_layers.key_values(attn, context, ctx_offset, speedups)
        else:
            k_ctx = v_ctx = mx.zeros((context.shape[0], attn.n_kv_heads, 0, attn.head_dim), dtype=h.dtype)
        out = attn.attend(q, k, v, k_ctx, v_ctx, cache, mask, speedups.fast_exp)
        return compiled_layers.after(attn, self.mlp, self.post_attention_layernorm, out, h, speedups)

    def context_key_values(
        self, context: mx.array, offset: int, speedups: CpuSpeedups | None = None
    ) -> tuple[mx.array, mx.array]:
        """The context's keys and values as a drafting pass of this layer computes them."""
        if self._compiled_steps(context, speedups):
            return compiled_layers.key_values(self.self_attn, context, offset, speedups)
        return self.self_attn.context_key_values(context, offset)


class HiddenDimAdapter(nn.Module):
    """JetSpec's adapter: one linear map (no bias) from the target's hidden width to the drafter's,
    shared by every tap of the concatenated taps."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=False)

    def __call__(self, taps: mx.array) -> mx.array:
        B, L, width = taps.shape
        in_dim = self.proj.weight.shape[1]
        return self.proj(taps.reshape(B, L, width // in_dim, in_dim)).reshape(B, L, -1)


class _HeadRows:
    # The target's head rows of the draft vocabulary, kept with what they were read from;
    # a plain object, so that they are no parameter of the drafter.
    def __init__(self):
        self.source: tuple | None = None
        self.rows: mx.array | None = None


class DraftModel(nn.Module):
    """The DFlash drafter (v1 checkpoints, e.g. ``z-lab/Qwen3-8B-DFlash-b16``).

    ``__call__`` maps the embedded noisy block and the new target taps to the block's
    final hidden states; the caller applies the target's LM head to them.

    With ``draft_vocab_size`` in its config the drafter drafts among a fixed set of token ids
    only (FR-Spec, arXiv 2502.14856: the most frequent ones), its ``draft_vocab``; its logits
    are then the hidden states times those rows of the target's head alone. The target still
    verifies over its whole vocabulary, so the output is unchanged.
    """

    layer_class: ClassVar[type] = DecoderLayer

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        n_taps = len(args.target_layer_ids) or args.num_hidden_layers
        self.layers = [self.layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        if args.target_hidden_size not in (None, args.hidden_size):
            self.hidden_dim_adapter = HiddenDimAdapter(args.target_hidden_size, args.hidden_size)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._head = _HeadRows()
        size = args.draft_vocab_size
        self.set_draft_vocab(mx.zeros((size,), dtype=mx.int32) if size else None)

    def set_draft_vocab(self, ids: mx.array | None) -> None:
        """Draft among the token ``ids`` only (``(N,)`` int32, stored with the weights as
        ``draft_vocab``), or over the target's whole vocabulary (None)."""
        self.args.draft_vocab_size = None if ids is None else ids.shape[0]
        if ids is None:
            self.draft_vocab = None
        else:
            self.draft_vocab = ids.astype(mx.int32)
            self.freeze(recurse=False, keys=["draft_vocab"])  # ids, never trained

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def family(self) -> str:
        """The drafter family, as shown to users: a causal-head z-lab layout is JetSpec's."""
        return "JetSpec" if self.args.causal_head else "DFlash"

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids

    @property
    def mask_token_id(self) -> int | None:
        return self.args.mask_token_id

    def __call__(
        self,
        noise_embedding: mx.array,
        taps: mx.array,
        cache: list[Any] | None = None,
        mask: mx.array | None = None,
        block_offset: int | mx.array | None = None,
        speedups: CpuSpeedups | None = None,
    ) -> mx.array:
        """Run the drafter on one block per batch row.

        Args:
            noise_embedding: ``(B, L, H)`` target embeddings of ``[last, mask, ...]``.
            taps: ``(1 or B, Lc, n_taps * H)`` taps of the context positions not
              yet in ``cache`` (all of them when ``cache`` is None).
            cache: Per-layer context caches; they grow by ``Lc``.
            mask: Optional attention mask over ``[context, block]`` keys (training).
            block_offset: Position of the block's first token; defaults to right after
              the context. An array of shape ``(B,)`` gives each row its own position.
            speedups: The CPU speedups (:func:`dflash_mlx.cpu.speedups.choose_speedups`); None runs
              MLX's native ops.

        Returns:
            ``(B, L, H)`` normed hidden states of the block.
        """
        if not self.args.use_target_features:
            # The ablation: the block sees only itself, never the target's taps.
            taps = taps[:, :0]
            if mask is not None:
                mask = mask[..., -noise_embedding.shape[1] :]
        context = self.hidden_norm(self.fc(self.adapt(taps)))  # (B, Lc, H)
        h = noise_embedding
        if cache is None:
            cache = [None] * len(self.layers)
        start = context.shape[1] + (cache[0].offset if cache[0] is not None else 0)
        for layer, c in zip(self.layers, cache):
            layer_mask = mask
            if layer.self_attn.causal or layer.self_attn.window is not None:
                if mask is not None or block_offset is not None:
                    raise DFlashError(
                        "Training or batching a drafter with causal or sliding_attention layers is not "
                        "implemented; train a full_attention drafter."
                    )
                layer_mask = block_mask(start, h.shape[1], layer.self_attn.causal, layer.self_attn.window)
            h = layer(h, context, c, layer_mask, block_offset, speedups)
        return self.norm(h)

    def propose(
        self,
        model: nn.Module,
        block: mx.array,
        taps: mx.array | None,
        cache: list[Any],
        speedups: CpuSpeedups | None = None,
        num_drafts: int | None = None,
    ) -> mx.array:
        """Draft logits for a block, through the target's embedding and LM head.

        Args:
            model: The target whose embedding and head the drafter borrows.
            block: ``(1, B)`` ids ``[last, mask, ..., mask]``.
            taps: Taps of context positions not yet in ``cache`` (or None).
            cache: The drafter's per-layer context caches.
            speedups: The CPU speedups, or None for MLX's native ops.
            num_drafts: Logits for only the first this many positions (None: all ``B - 1``).
              The head is the largest matmul of a draft pass, so slots that will not be
              verified (a smaller verify width, the end of a reply) are not paid for.

        Returns:
            ``(1, num_drafts or B - 1, V)`` logits for block positions ``1..`` over the
            drafter's vocabulary: the target's, or the ``draft_vocab`` ids
            (``V = draft_vocab_size``; :meth:`token_ids` maps an index back to its id).
        """
        h = self.block_hidden(model, block, taps, cache, speedups)
        end = h.shape[1] if num_drafts is None else 1 + num_drafts
        return self.logits(model, h[:, 1:end])

    def tap_blocks(self) -> dict[int, mx.array] | None:
        """``fc``'s weight split by tap, for the target to project its taps as it makes them
        (:class:`~dflash_mlx.models.target.FoldedTaps`): ``{layer: (H, H_tap) block}``, a layer
        tapped twice getting the sum of its blocks. None where ``fc`` is not a plain linear map
        of the concatenated taps (quantized, or with a bias) or the taps are not used."""
        ids = self.target_layer_ids
        fc = self.fc
        if type(fc) is not nn.Linear or "bias" in fc or not ids or not self.args.use_target_features:
            return None
        if "hidden_dim_adapter" in self:
            return None  # the taps are adapted before fc
        width = fc.weight.shape[1] // len(ids)
        blocks = {}
        for k, layer in enumerate(ids):
            block = fc.weight[:, k * width : (k + 1) * width]
            blocks[layer] = block if layer not in blocks else blocks[layer] + block
        return blocks

    def adapt(self, taps: mx.array) -> mx.array:
        """The taps at the drafter's width: through ``hidden_dim_adapter`` where it has one."""
        return self.hidden_dim_adapter(taps) if "hidden_dim_adapter" in self else taps

    def extend_context(
        self, taps: mx.array, cache: list[Any], speedups: CpuSpeedups | None = None, projected: bool = False
    ) -> None:
        """Take the taps of new context positions into the context caches now, as the next
        pass would have (``fc`` + ``hidden_norm``, then each layer's keys and values).

        The prefill calls it per chunk, so a long prompt's raw taps (``n_taps * H`` per position)
        never pile up: only the drafter's keys and values of them are kept.

        Args:
            taps: ``(1, Lc, n_taps * H)`` taps of the positions after the cached ones, or with
              ``projected`` their ``fc`` projection already (``(1, Lc, H)``, as the target
              folds them with :meth:`tap_blocks`).
            cache: The drafter's per-layer context caches; they grow by ``Lc``.
            speedups: The CPU speedups, or None.
            projected: ``taps`` went through ``fc`` already.
        """
        if not self.args.use_target_features:
            return  # the ablation never caches a context
        # A slice at a time, each written into the caches before the next, so that what the
        # projections hold beyond the keys and values is one slice's, whatever the chunk.
        for start in range(0, taps.shape[1], CONTEXT_SLICE):
            rows = taps[:, start : start + CONTEXT_SLICE]
            context = self.hidden_norm(rows if projected else self.fc(self.adapt(rows)))  # (1, <= slice, H)
            for layer, c in zip(self.layers, cache):
                c.update_and_fetch(*layer.context_key_values(context, c.offset, speedups))
            if start + CONTEXT_SLICE < taps.shape[1]:
                mx.eval([c.state for c in cache])

    def block_hidden(
        self,
        model: nn.Module,
        block: mx.array,
        taps: mx.array | None,
        cache: list[Any],
        speedups: CpuSpeedups | None = None,
    ) -> mx.array:
        """The drafter's pass over ``block`` (``(1, B)`` ids), with the arguments of
        :meth:`propose`: ``(1, B, H)`` hidden states of all its positions."""
        if taps is None:
            width = len(self.target_layer_ids) * (self.args.target_hidden_size or self.args.hidden_size)
            taps = mx.zeros((1, 0, width), dtype=self.norm.weight.dtype)
        return self(self.embed(model, block), taps, cache, speedups=speedups)

    def embed(self, model: nn.Module, block: mx.array) -> mx.array:
        """The noisy block's input: the target's embedding of its ids."""
        return tgt.embed(model, block)

    def logits(self, model: nn.Module, h: mx.array) -> mx.array:
        """The target's head on hidden states ``(..., H)``: ``(..., V)`` over the drafter's vocabulary."""
        if self.draft_vocab is None and tgt.head_group(model) is None:
            return tgt.lm_head(model, h)
        return tgt.softcap(model, h @ self.head_rows(model).T)

    def head_rows(self, model: nn.Module) -> mx.array:
        """The target head's rows of ``draft_vocab``, ``(N, H)``, read once per head and vocabulary.

        A head split by vocabulary over several ranks (tensor parallel) gives all its rows: only
        rank 0 drafts, and the head's own gather is a collective of every rank. Every rank must
        then call this once, together (:class:`dflash_mlx.drafts.proposer.DFlashProposer` does, when made).
        """
        source = (tgt.head_weight(model), self.draft_vocab)
        cached = self._head.source
        if cached is None or any(a is not b for a, b in zip(cached, source)):
            ids = self.draft_vocab if self.draft_vocab is not None else mx.arange(tgt.vocab_size(model))
            self._head.rows = tgt.head_rows(model, ids)
            mx.eval(self._head.rows)
            self._head.source = source
        return self._head.rows

    def token_ids(self, index: mx.array) -> mx.array:
        """Token ids of indices into the drafter's vocabulary (the same ids without ``draft_vocab``)."""
        if self.draft_vocab is None:
            return index
        return self.draft_vocab[index].astype(index.dtype)

    def to_target_vocab(self, probs: mx.array, vocab_size: int) -> mx.array:
        """``(..., V)`` probabilities over the drafter's vocabulary as ``(..., vocab_size)``
        over the target's: zero outside ``draft_vocab``, still a distribution to draft from."""
        if self.draft_vocab is None:
            return probs
        full = mx.zeros((*probs.shape[:-1], vocab_size), dtype=probs.dtype)
        full[..., self.draft_vocab] = probs
        return full

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            if k.startswith("model."):
                k = k[len("model.") :]
            # Some exports carry the target's embedding or head; the drafter borrows them.
            if k.startswith(("embed_tokens.", "lm_head.")) or "rotary_emb" in k:
                continue
            out[k] = v
        return out


def save_draft(draft: DraftModel, config: dict[str, Any], path: Path) -> None:
    """Write a drafter as the z-lab layout ``load`` reads: ``config.json`` + safetensors.

    The one writer of this format (dflash-convert and dflash-train both use it), on mlx-lm's
    own writers; the weights keep their dtype (and quantization, given in ``config``). A
    drafter with a draft vocabulary writes its ``draft_vocab_size`` into the config, and
    ``draft_vocab`` is among its weights.
    """
    config = {k: v for k, v in config.items() if k != "draft_vocab_size"}
    if draft.draft_vocab is not None:
        config["draft_vocab_size"] = draft.args.draft_vocab_size
    save_model(path, draft)
    save_config(config, path / "config.json")
