"""The target side: hidden-state taps, embedding and LM head, without patching mlx-lm.

Tap ``i`` is the output of decoder layer ``i`` (0-based), which is HF's
``hidden_states[i + 1]`` since HF's ``hidden_states[0]`` is the embedding output. As in HF,
the last layer's tap is taken after the final norm.
"""

import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen3
from mlx_lm.models.base import create_attention_mask, gather_last_axis
from mlx_lm.models.cache import KVCache

from ..cpu import compiled_layers, fast_math
from ..cpu.speedups import CpuSpeedups
from . import gemma, hybrid, kimi
from .stages import Stage
from .tree import DraftTree, tree_caches

# mlx-lm model families whose decoder we know how to walk layer by layer.
SUPPORTED_MODEL_TYPES = (
    ("qwen3", "qwen2", "llama", "qwen3_moe", "gpt_oss")
    + hybrid.HYBRID_MODEL_TYPES
    + gemma.GEMMA_MODEL_TYPES
    + kimi.KIMI_MODEL_TYPES
)


def _text(model: nn.Module) -> nn.Module:
    # Qwen3.5, Gemma 4 and Kimi K2.5 checkpoints are vision-language models: the text model sits one level down.
    return getattr(model, "language_model", model)


def _gpt_oss_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list:
    # gpt-oss alternates sliding-window and full attention layers (its layer_types), as
    # mlx-lm's GptOssMoeModel builds them: one mask of each kind, from a layer of that kind.
    full = create_attention_mask(h, cache[inner.ga_idx])
    swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
    return [full if kind == "full_attention" else swa for kind in inner.layer_types]


def _layer_masks(model: nn.Module, h: mx.array, cache: list[Any]) -> list:
    inner = model.model
    if model.model_type == "gpt_oss":
        return _gpt_oss_masks(inner, h, cache)
    if model.model_type in kimi.KIMI_MODEL_TYPES:
        return kimi.layer_masks(inner, h, cache)
    if model.model_type == "llama":
        fa = create_attention_mask(h, cache[inner.fa_idx])
        if inner.swa_idx is None:
            return [fa] * len(inner.layers)
        swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
        return [swa if layer.use_sliding else fa for layer in inner.layers]
    return [create_attention_mask(h, cache[0])] * len(inner.layers)


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must fit in its target, and the dtype the target computes in."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    final_logit_softcapping: float | None
    compute_dtype: mx.Dtype


def target_shape(model: nn.Module) -> TargetShape:
    """``model``'s :class:`TargetShape`, read once from the loaded model."""
    args = text_args(model)
    return TargetShape(num_layers(model), args.hidden_size, args.vocab_size,
                       getattr(args, "final_logit_softcapping", None), compute_dtype(model))  # fmt: skip


def text_args(model: nn.Module) -> Any:
    """The text model's ``ModelArgs`` (a vision-language checkpoint's, not its wrapper's)."""
    return _text(model).args


def num_layers(model: nn.Module) -> int:
    """The target's decoder layers, all of them (a pipeline stage holds only some)."""
    return _text(model).args.num_hidden_layers


def hidden_size(model: nn.Module) -> int:
    return _text(model).args.hidden_size


def vocab_size(model: nn.Module) -> int:
    return _text(model).args.vocab_size


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the target's activations are in (a quantized embedding's scales')."""
    emb = _text(model).model.embed_tokens
    return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype


def embed(model: nn.Module, tokens: mx.array) -> mx.array:
    """The target's input embedding, shared with the drafter (scaled as the target's own
    first layer gets it: Gemma's by ``sqrt(hidden_size)``, as in HF's embedding module)."""
    inner = _text(model).model
    if model.model_type in gemma.GEMMA_MODEL_TYPES:
        return inner.embed_tokens(tokens) * inner.embed_scale
    return inner.embed_tokens(tokens)


def lm_head(model: nn.Module, h: mx.array) -> mx.array:
    """The target's output head (tied or untied, softcapped where the target is), shared with
    the drafter: exactly the target's own logits."""
    return softcap(model, head_linear(model, h))


def head_linear(model: nn.Module, h: mx.array) -> mx.array:
    """The head's linear map alone, before any softcap: ``head_linear(model, I)`` is ``W^T``."""
    text = _text(model)
    if getattr(text.args, "tie_word_embeddings", False):
        return text.model.embed_tokens.as_linear(h)
    group = head_group(model)
    # A head sharded by vocabulary (mlx-lm's tensor parallel Qwen3.5) gives each rank a slice.
    return text.lm_head(h) if group is None else gather_last_axis(text.lm_head(h), group)


def head_group(model: nn.Module) -> mx.distributed.Group | None:
    """The group over which the output head's rows are split by ``model.shard``, or None."""
    layer = _head_layer(model)
    sharded = isinstance(layer, (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear))
    return layer.group if sharded and layer.group.size() > 1 else None


def softcap(model: nn.Module, logits: mx.array) -> mx.array:
    """The target's final logit softcapping (Gemma's) on logits of its head's rows; others have none."""
    if model.model_type in gemma.GEMMA_MODEL_TYPES:
        return gemma.softcap(model, logits)
    return logits


def _head_layer(model: nn.Module) -> nn.Module:
    text = _text(model)
    if getattr(text.args, "tie_word_embeddings", False):
        return text.model.embed_tokens
    return text.lm_head


def head_weight(model: nn.Module) -> mx.array:
    """The array the output head's rows are stored in (to tell when they change)."""
    return _head_layer(model).weight


def head_rows(model: nn.Module, ids: mx.array) -> mx.array:
    """Rows ``ids`` of the target's output head as a ``(len(ids), H)`` matrix, whatever form
    the head has (tied or untied, quantized or not): ``softcap(model, h @ rows.T)`` is
    ``lm_head(model, h)[..., ids]``.

    Only those rows are read (a quantized head's own groups, dequantized), never the whole head.
    Under tensor parallelism each rank reads those in its slice and one ``all_sum`` joins them.
    """
    layer, group = _head_layer(model), head_group(model)
    if group is None:
        return _rows(layer, ids)
    local = layer.weight.shape[0]
    index = ids - group.rank() * local
    inside = (index >= 0) & (index < local)
    rows = _rows(layer, mx.where(inside, index, 0))
    return mx.distributed.all_sum(mx.where(inside[:, None], rows, mx.zeros_like(rows)), group=group)


def _rows(layer: nn.Module, ids: mx.array) -> mx.array:
    if not hasattr(layer, "scales"):
        return layer.weight[ids]
    biases = layer.get("biases")
    return mx.dequantize(
        layer.weight[ids],
        scales=layer.scales[ids],
        biases=biases[ids] if biases is not None else None,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )


# The decoder blocks whose layers the compiled CPU steps reproduce (Llama's without a sliding window).
CPU_BLOCKS = {"qwen3": qwen3.TransformerBlock, "llama": llama.TransformerBlock}


def cpu_block(
    block: nn.Module, x: mx.array, cache: KVCache, visible: mx.array, speedups: CpuSpeedups,
    steps: compiled_layers.LayerSteps,
) -> mx.array:  # fmt: skip
    # mlx-lm's Qwen3 or Llama TransformerBlock, the same operations in the same order, compiled
    # around the attention and with the CPU kernels for the softmax and SwiGLU: its own
    # call would reach MLX's slow CPU exp, one operation at a time.
    attn = block.self_attn
    q, k, v = compiled_layers.before(attn, block.input_layernorm, x, cache.offset, speedups, steps)
    k, v = cache.update_and_fetch(k, v)
    out = fast_math.attention(q, k, v, attn.scale, visible, fast_exp=speedups.fast_exp)
    return compiled_layers.after(attn, block.mlp, block.post_attention_layernorm, out, x, speedups, steps)


# Each target's layer steps (None: not layers the steps reproduce), by (id(model), speedups), with
# what identified its layers when they were found: checking and looking up 30 layers every pass
# took ~1 ms of the 4 ms it took to build a verify pass's graph. An entry goes with its model.
_CPU_STEPS: dict[tuple[int, CpuSpeedups], tuple[tuple[int, ...], list | None]] = {}


def _plain_layers(model: nn.Module, speedups: CpuSpeedups) -> list[compiled_layers.LayerSteps] | None:
    block = CPU_BLOCKS.get(model.model_type)
    layers = model.model.layers
    plain = block is not None and all(
        type(layer) is block
        and not getattr(layer, "use_sliding", False)
        and compiled_layers.plain_layer(
            layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        )
        for layer in layers
    )
    if not plain:
        return None
    return [compiled_layers.layer_steps(layer.self_attn, layer.input_layernorm.eps, speedups) for layer in layers]


def _cpu_steps(
    model: nn.Module, h: mx.array, cache: list[Any], masks: list, speedups: CpuSpeedups | None
) -> list[compiled_layers.LayerSteps] | None:
    # The compiled steps of every layer, or None to run mlx-lm's own: only layers the steps
    # reproduce exactly, with plain caches and causal masks; a pass shorter than min_tokens
    # (plain decoding's step) stays mlx-lm's own.
    if not (
        speedups is not None
        and h.shape[1] >= speedups.min_tokens
        and h.dtype == mx.float32
        and model.model_type in CPU_BLOCKS
        and all(type(c) is KVCache for c in cache)
        and all(isinstance(m, str) and m == "causal" for m in masks)
    ):
        return None
    return cpu_layer_steps(model, speedups)


def cpu_layer_steps(model: nn.Module, speedups: CpuSpeedups) -> list[compiled_layers.LayerSteps] | None:
    """The compiled CPU steps of every layer of ``model`` (found once per model), or None where its layers
    are not ones they reproduce exactly; the caller checks its caches, masks and dtype."""
    if model.model_type not in CPU_BLOCKS:
        return None
    # nn.quantize swaps the projections in place, and a list of layers can be cut or replaced:
    # any of those seen here means look again.
    layers = model.model.layers
    first = layers[0]
    found = (len(layers), id(first), id(first.self_attn.q_proj), id(first.mlp.down_proj))
    key = (id(model), speedups)
    entry = _CPU_STEPS.get(key)
    if entry is None or entry[0] != found:
        if entry is None:
            weakref.finalize(model, _CPU_STEPS.pop, key, None)
        entry = _CPU_STEPS[key] = (found, _plain_layers(model, speedups))
    return entry[1]


class FoldedTaps:
    """Taps projected by a drafter's linear ``fc`` as the target makes them.

    ``fc(concat(taps)) == sum over k of taps[k] @ fc.weight[:, k*H:(k+1)*H].T``, so each tapped
    layer's output is folded into one ``(B, L, H_fc)`` sum as soon as it exists: a prefill chunk
    then holds that sum instead of ``n_taps`` hidden states waiting to be concatenated (and
    their concatenation). Used as the layer walkers' ``captured`` mapping.

    Args:
        blocks: Each tapped layer's ``(H_fc, H)`` block of ``fc.weight`` (summed over the
          places it appears in ``tap_ids``).
        last: The target's last layer, whose tap is set twice (by the walker, then after the
          final norm by ``_head``): it is folded in by :meth:`total`, from its last setting.
    """

    def __init__(self, blocks: dict[int, mx.array], last: int):
        self.blocks, self.last = blocks, last
        self.width = next(iter(blocks.values())).shape[0]  # H_fc
        self.sum, self.last_tap, self.dtype = None, None, None

    def __setitem__(self, layer: int, h: mx.array) -> None:
        if layer == self.last:
            self.last_tap = h
            return
        self._add(h @ self.blocks[layer].T)

    def _add(self, part: mx.array) -> None:
        # Summed in float32, as the one matmul over the concatenated taps accumulates.
        self.dtype = part.dtype
        part = part.astype(mx.float32)
        self.sum = part if self.sum is None else self.sum + part
        # Started now: MLX would otherwise run the target's whole pass first and fold the taps
        # at the end, keeping every tapped layer's output until then.
        mx.async_eval(self.sum)

    def total(self) -> mx.array | None:
        if self.last_tap is not None:
            self._add(self.last_tap @ self.blocks[self.last].T)
            self.last_tap = None
        return None if self.sum is None else self.sum.astype(self.dtype)


def forward_with_taps(
    model: nn.Module,
    tokens: mx.array,
    cache: list[Any],
    tap_ids: list[int],
    speedups: CpuSpeedups | None = None,
    last_logits: bool = False,
    fold: dict[int, mx.array] | None = None,
    tree: "DraftTree | None" = None,
) -> tuple[mx.array, mx.array | None]:
    """Run the target on ``tokens`` and capture the hidden states after ``tap_ids``.

    Args:
        model: An mlx-lm model of one of ``SUPPORTED_MODEL_TYPES``.
        tokens: ``(B, L)`` token ids.
        cache: The target's per-layer caches, updated in place.
        tap_ids: 0-based decoder layer indices to capture (may be empty).
        speedups: The CPU speedups from :func:`dflash_mlx.cpu.speedups.choose_speedups` (None: the
          portable path, mlx-lm's layers as they are). With ``start_every`` the pass starts
          running (``mx.async_eval``) while the rest of its graph is still being built, so
          not inside ``mx.compile`` or a gradient.
        last_logits: The head on the last position only (``(B, 1, vocab)`` logits), as a prefill
          needs: on every position a 512-token chunk of a 49k vocabulary is 100 MB and 29 GFLOP.
        fold: Each tapped layer's block of a drafter's ``fc`` weight (:class:`FoldedTaps`;
          :meth:`~dflash_mlx.models.drafter.DraftModel.tap_blocks`), or None for the raw taps.
          The folded sum is started as it grows (``mx.async_eval``), so not inside ``mx.compile``
          or a gradient either.
        tree: A draft tree whose root and nodes ``tokens`` (``(1, n + 1)``) are: each is run at
          its own position, seeing the cache and its ancestors only (:mod:`dflash_mlx.drafts.tree`).
          The cache then holds all the nodes, in order, until :func:`dflash_mlx.models.tree.keep_path`.

    Returns:
        ``(logits, taps)``: ``(B, L, vocab)`` logits and the taps concatenated
        in ``tap_ids`` order, ``(B, L, len(tap_ids) * H)`` (with ``fold``: their ``fc``
        projection, ``(B, L, H_fc)``), or None if ``tap_ids`` is empty.
    """
    if tree is not None:
        return _forward_tree(model, tokens, cache, tap_ids, tree)
    start_every = speedups.start_every if speedups is not None else 0
    captured = {} if fold is None else FoldedTaps(fold, num_layers(model) - 1)
    if model.model_type in hybrid.HYBRID_MODEL_TYPES:
        h = hybrid.forward_with_taps(model, tokens, cache, tap_ids, captured, start_every, num_layers(model))
        return _head(model, h, captured, tap_ids, last_logits)
    if model.model_type in gemma.GEMMA_MODEL_TYPES:
        h = gemma.forward_with_taps(model, tokens, cache, tap_ids, captured, start_every)
        return _head(model, h, captured, tap_ids, last_logits)
    inner = model.model
    stage = Stage(inner, num_layers(model))
    h = inner.embed_tokens(tokens)
    masks = _layer_masks(model, h, cache)
    wanted = set(tap_ids)
    steps = _cpu_steps(model, h, cache, masks, speedups) if stage.size == 1 else None
    visible = None if steps is None else fast_math.causal_mask(cache[0].offset, h.shape[1])
    # A pipeline stage's masks are the first layers' (these families use one mask for all).
    h = stage.receive(h, captured)
    for (i, layer), c, mask in zip(stage.layers, cache, masks):
        h = layer(h, mask, c) if steps is None else cpu_block(layer, h, c, visible, speedups, steps[i])
        if i in wanted:
            captured[i] = h
        if start_every and (i + 1) % start_every == 0 and i + 1 < stage.end:
            mx.async_eval(h)
    h = stage.finish(h, captured, tap_ids)
    return _head(model, h, captured, tap_ids, last_logits)


def _forward_tree(
    model: nn.Module, tokens: mx.array, cache: list[Any], tap_ids: list[int], tree: "DraftTree"
) -> tuple[mx.array, mx.array | None]:
    # The tree as a batch of one-token rows, node i in row i (dflash_mlx.drafts.tree).
    rows = tokens.reshape(-1, 1)  # (n + 1, 1)
    views, masks = tree_caches(cache, tree)
    captured = {}
    if model.model_type in hybrid.HYBRID_MODEL_TYPES:
        h = hybrid.forward_tree(model, rows, views, masks, tap_ids, captured, tree.parents)
    elif model.model_type in gemma.GEMMA_MODEL_TYPES:
        h = gemma.forward_with_taps(model, rows, views, tap_ids, captured, masks=masks)
    else:
        inner = model.model
        h = inner.embed_tokens(rows)
        wanted = set(tap_ids)
        for i, (layer, c, mask) in enumerate(zip(inner.layers, views, masks)):
            h = layer(h, mask, c)
            if i in wanted:
                captured[i] = h
    logits, taps = _head(model, h, captured, tap_ids)
    # (n + 1, 1, ...) -> (1, n + 1, ...), a block's layout
    return logits.swapaxes(0, 1), None if taps is None else taps.swapaxes(0, 1)


def _head(
    model: nn.Module, h: mx.array, captured: "dict | FoldedTaps", tap_ids: list[int], last_logits: bool = False
) -> tuple[mx.array, mx.array | None]:
    inner = _text(model).model
    h = inner.norm(h)
    wanted = set(tap_ids)
    last = num_layers(model) - 1
    # HF's last hidden state is taken after the final norm; drafters were trained on that.
    if last in wanted:
        captured[last] = h
    logits = lm_head(model, h[:, -1:] if last_logits else h)
    if not tap_ids:
        return logits, None
    if isinstance(captured, FoldedTaps):
        return logits, captured.total()
    return logits, mx.concatenate([captured[i] for i in tap_ids], axis=-1)
