"""Several sequences in one target pass: a cache whose rows have their own lengths, and the pass over it.

Each row of :class:`RowsKVCache` holds one sequence's keys and values from position 0, as long as that
sequence is (ragged on the right). A pass feeds every row a block of the same width ``W`` (a row with fewer
tokens is padded); each row's block is written right after that row's own entries, at its own RoPE positions
(``offset`` is the rows' lengths), and a mask lets query ``q`` of row ``i`` see keys ``0 .. length_i + q``
only, so a row never sees another row's padding or its own stale entries. Rolling back is per row: ``trim_rows``
lowers each row's length, nothing is copied; the stale entries past a row's length are overwritten by its next
block. A row joins by copying its prefilled cache in and leaves by copying its entries out.

mlx-lm's ``BatchKVCache`` pads rows on the left and trims every row alike, which speculative decoding cannot
use: each row keeps a different number of its block. A sliding-window layer's rows keep their positions in place
under a windowed mask; a hybrid target's Gated DeltaNet layers keep a state a row (:class:`RowsRecurrentCache`).
The families of :data:`ROW_MODEL_TYPES` run here; others are served one at a time.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from ..cpu import compiled_layers, fast_math
from ..cpu.speedups import CpuSpeedups
from . import families, gemma, hybrid, kimi, linear_attention
from . import target as tgt
from .sliding import SlidingKVCache

# Targets whose decoder layers are ``layer(h, mask, cache)`` over full or sliding-window attention (Llama's
# sliding layers, gpt-oss's; Kimi K2.5's latent attention, one latent a position), the hybrid ones (Gated
# DeltaNet layers between full attention ones), whose linear layers keep a state per row, and Gemma 4, walked
# its own way with these masks.
ROW_MODEL_TYPES = (
    "llama", "qwen3", "qwen2", "qwen3_moe", "gpt_oss", *hybrid.HYBRID_MODEL_TYPES, *gemma.GEMMA_MODEL_TYPES,
    *kimi.KIMI_MODEL_TYPES,
)  # fmt: skip


def rows_supported(model: nn.Module) -> str | None:
    """None when ``model`` can run rows of different lengths in one pass, else why not (one line)."""
    kind = getattr(model, "model_type", None)
    if kind not in ROW_MODEL_TYPES:
        return f"batching is implemented for {', '.join(ROW_MODEL_TYPES)} targets, not {kind}"
    if kind in hybrid.HYBRID_MODEL_TYPES:
        linear = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
        if any(not isinstance(a, linear_attention.LAYERS) or getattr(a, "sharding_group", None) for a in linear):
            return "batching a hybrid target needs Gated DeltaNet layers this library walks itself, unsharded"
    return None


class RowsKVCache:
    """One layer's keys and values for several sequences, each row as long as its own sequence.

    ``lengths`` are the rows' committed positions (host ints); ``offset`` gives them to RoPE as an array,
    read by the layer before ``update_and_fetch`` writes the block.
    """

    step = 256

    def _whole(self, size: int) -> int:
        # ``size`` positions rounded up to whole steps.
        return -(-size // self.step) * self.step

    def __init__(self, window: int | None = None):
        self.keys = self.values = None
        self.lengths: list[int] = []
        self.window = window  # a sliding-window layer's: its queries see that many positions, their own included

    @property
    def offset(self) -> mx.array:
        return mx.array(self.lengths, dtype=mx.int32)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def _room(self, size: int) -> None:
        # Grow the buffer (by whole steps) to hold ``size`` positions per row.
        if self.keys.shape[2] >= size:
            return
        pad = self._whole(size) - self.keys.shape[2]
        self.keys = mx.pad(self.keys, [(0, 0), (0, 0), (0, pad), (0, 0)])
        self.values = mx.pad(self.values, [(0, 0), (0, 0), (0, pad), (0, 0)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's block ``(B, H, W, D)`` after that row's entries; every row grows by ``W``."""
        W = keys.shape[2]
        if self.keys is None:
            self.keys = mx.zeros((*keys.shape[:2], 0, keys.shape[3]), dtype=keys.dtype)
            self.values = mx.zeros((*values.shape[:2], 0, values.shape[3]), dtype=values.dtype)
        self._room(max(self.lengths) + W)
        if len(set(self.lengths)) == 1:
            s = self.lengths[0]
            self.keys[..., s : s + W, :] = keys
            self.values[..., s : s + W, :] = values
        else:
            for i, s in enumerate(self.lengths):
                self.keys[i : i + 1, :, s : s + W, :] = keys[i : i + 1]
                self.values[i : i + 1, :, s : s + W, :] = values[i : i + 1]
        self.lengths = [s + W for s in self.lengths]
        used = max(self.lengths)
        return self.keys[..., :used, :], self.values[..., :used, :]

    def trim_rows(self, counts: list[int]) -> None:
        """Forget the last ``counts[i]`` positions of row ``i``."""
        self.lengths = [s - n for s, n in zip(self.lengths, counts)]

    def keep(self, row: int, start: int, path: list[int]) -> None:
        """Row ``row``'s block written from ``start`` keeps its positions ``path`` (a draft tree's accepted
        nodes, in order) as its first ones; the caller then trims the rest."""
        where = mx.array([start + i for i in path])
        end = start + len(path)
        self.keys[row : row + 1, :, start:end, :] = self.keys[row : row + 1, :, where, :]
        self.values[row : row + 1, :, start:end, :] = self.values[row : row + 1, :, where, :]

    def add(self, cache: KVCache | SlidingKVCache) -> int:
        """A prefilled single-sequence cache joins as the last row (copied); returns its row. A sliding
        window's row holds its positions where they are: the ones it dropped are zeros no query sees."""
        n = cache.offset
        if isinstance(cache, SlidingKVCache):
            k, v = cache.keys_and_values()
            gap = [(0, 0), (0, 0), (cache.start, 0), (0, 0)]
            k, v = mx.pad(k, gap), mx.pad(v, gap)
        else:
            k, v = cache.keys[..., :n, :], cache.values[..., :n, :]
        if self.keys is None or self.rows == 0:
            size = self._whole(max(n, 1))
            self.keys = mx.zeros((1, k.shape[1], size, k.shape[3]), dtype=k.dtype)
            self.values = mx.zeros((1, v.shape[1], size, v.shape[3]), dtype=v.dtype)
            self.keys[..., :n, :], self.values[..., :n, :] = k, v
            self.lengths = [n]
            return 0
        self._room(n)
        size = self.keys.shape[2]
        k = mx.pad(k, [(0, 0), (0, 0), (0, size - n), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, 0), (0, size - n), (0, 0)])
        self.keys = mx.concatenate([self.keys, k.astype(self.keys.dtype)], axis=0)
        self.values = mx.concatenate([self.values, v.astype(self.values.dtype)], axis=0)
        self.lengths.append(n)
        return self.rows - 1

    def take(self, row: int, into: KVCache | SlidingKVCache) -> None:
        """Row ``row``'s entries into ``into`` (a single-sequence cache, e.g. a conversation's), leaving here."""
        n = self.lengths[row]
        start = max(0, n - into.window + 1 - into.slack) if isinstance(into, SlidingKVCache) else 0
        keys = mx.array(self.keys[row : row + 1, :, start:n, :])
        values = mx.array(self.values[row : row + 1, :, start:n, :])
        if isinstance(into, SlidingKVCache):
            into.hold(keys, values, start, n)
        else:
            into.keys, into.values, into.offset = keys, values, n
        self.remove(row)

    def remove(self, row: int) -> None:
        """Row ``row`` leaves; the rows after it move up one."""
        keep = [i for i in range(self.rows) if i != row]
        self.lengths.pop(row)
        if not keep:
            self.keys = self.values = None
            return
        index = mx.array(keep)
        used = self._whole(max(self.lengths)) if max(self.lengths) else self.step
        self.keys, self.values = self.keys[index, :, :used, :], self.values[index, :, :used, :]

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values


class RowsRecurrentCache(ArraysCache):
    """One Gated DeltaNet layer's ``[conv_state, recurrent_state]`` for several sequences, a row each.

    A pass runs every row ``W`` tokens on (the linear attention is a recurrence: a row's length does not
    matter to it) and keeps each position's state (:func:`~dflash_mlx.models.hybrid.recorded_layer`), so
    that ``trim_rows`` takes each row back to its own kept length by selecting, not replaying. mlx-lm's
    ``ArraysCache`` joins (``extend``) and splits (``extract``, ``filter``) the rows.
    """

    def __init__(self, kernels: str = "auto"):
        super().__init__(size=2)
        self.kernels = kernels
        self.offsets: list[int] = []  # the rows' lengths (``lengths`` is mlx-lm's padding, unused here)
        self._steps: tuple[mx.array, list[mx.array]] | None = None

    @property
    def rows(self) -> int:
        return len(self.offsets)

    def advance(self, n: int) -> None:
        self.offsets = [o + n for o in self.offsets]

    def record(self, conv_input: mx.array, states: list[mx.array]) -> None:
        self._steps = (conv_input, states)

    def trim_rows(self, counts: list[int]) -> None:
        """Forget the last ``counts[i]`` tokens of row ``i``'s last pass: its state after the ones kept."""
        conv_input, states = self._steps
        self._steps = None
        if not any(counts):
            return
        width = conv_input.shape[1] - len(states)  # K - 1
        convs, finals = [], []
        for i, n in enumerate(counts):
            keep = len(states) - n
            convs.append(conv_input[i : i + 1, keep : keep + width])
            finals.append(states[keep - 1][i : i + 1])
        self.cache = [mx.concatenate(convs), mx.concatenate(finals)]
        self.offsets = [o - n for o, n in zip(self.offsets, counts)]

    def add(self, cache: hybrid.RecurrentCache) -> int:
        """A prefilled single-sequence state joins as the last row (copied); returns its row."""
        if self.rows == 0:
            self.cache = list(cache.cache)
        else:
            self.extend(cache)
        self.offsets.append(cache.offset)
        return self.rows - 1

    def take(self, row: int, into: hybrid.RecurrentCache) -> None:
        """Row ``row``'s state into ``into`` (a conversation's), leaving here."""
        into.cache = [None if c is None else mx.array(c[row : row + 1]) for c in self.cache]
        into.offset = self.offsets[row]
        into.settled()
        self.remove(row)

    def remove(self, row: int) -> None:
        keep = [i for i in range(self.rows) if i != row]
        self.offsets.pop(row)
        if keep:
            self.filter(mx.array(keep))
        else:
            self.cache = [None, None]


def release(cache: Any) -> None:
    """Free a single-sequence cache whose entries the rows now hold (they come back with ``take``); its
    checkpoints stay: they are its prompt's, still right."""
    if isinstance(cache, hybrid.RecurrentCache):
        cache.cache = [None, None]
        cache.settled()
    elif isinstance(cache, SlidingKVCache):
        cache.hold(None, None, 0, 0)
    else:
        cache.keys = cache.values = None
        cache.offset = 0


def rows_mask(lengths: list[int], width: int, window: int | None = None) -> mx.array:
    """``(B, 1, W, S)``: query ``q`` of row ``i`` sees keys ``0 .. lengths[i] + q`` (S = max(lengths) + W),
    with a ``window`` only the last ``window`` of them."""
    S = max(lengths) + width
    start = mx.array(lengths, dtype=mx.int32)[:, None, None, None]
    q = mx.arange(width, dtype=mx.int32)[None, None, :, None]
    keys = mx.arange(S, dtype=mx.int32)[None, None, None, :]
    visible = keys <= start + q
    return visible if window is None else visible & (keys > start + q - window)


def trees_supported(model: nn.Module, caches: list[Any], speedups: CpuSpeedups | None) -> bool:
    """Whether a rows pass over ``caches`` can verify draft trees (:func:`forward_rows`'s ``trees``): float32
    layers the compiled CPU steps run, over full attention rows."""
    return (
        speedups is not None
        and tgt.compute_dtype(model) == mx.float32
        and all(type(c) is RowsKVCache and c.window is None for c in caches)
        and tgt.cpu_layer_steps(model, speedups) is not None
    )


def tree_rows_mask(lengths: list[int], ancestors: mx.array) -> mx.array:
    """``(B, 1, W, S)``: node ``q`` of row ``i`` sees the row's keys ``0 .. lengths[i] - 1`` and, of its block
    (written from ``lengths[i]``), the nodes ``ancestors[i, q]`` marks (S = max(lengths) + W)."""
    W = ancestors.shape[-1]
    start = mx.array(lengths, dtype=mx.int32)[:, None, None, None]
    index = mx.arange(max(lengths) + W, dtype=mx.int32)[None, None, None, :] - start  # key's place in the block
    inside = (index >= 0) & (index < W)
    at = mx.broadcast_to(mx.clip(index, 0, W - 1), (len(lengths), 1, W, index.shape[-1]))
    picked = mx.take_along_axis(ancestors[:, None], at, axis=-1)
    return (index < 0) | (inside & picked)


def _tree_block(layer: nn.Module, x: mx.array, cache: RowsKVCache, visible: mx.array, positions: mx.array,
                speedups: CpuSpeedups, steps: compiled_layers.LayerSteps) -> mx.array:  # fmt: skip
    # A layer's compiled steps over rows of draft trees: the projections and RoPE take every node as a batch row
    # of one token at its own position (as a single tree pass does), the attention every row's block at once.
    B, W, H = x.shape
    attn = layer.self_attn
    flat = x.reshape(B * W, 1, H)
    q, k, v = compiled_layers.before(attn, layer.input_layernorm, flat, positions.reshape(-1), speedups, steps)
    q, k, v = (a.reshape(B, W, a.shape[1], a.shape[3]).transpose(0, 2, 1, 3) for a in (q, k, v))
    k, v = cache.update_and_fetch(k, v)
    out = fast_math.attention(q, k, v, attn.scale, visible, fast_exp=speedups.fast_exp)
    return compiled_layers.after(attn, layer.mlp, layer.post_attention_layernorm, out, x, speedups, steps)


def forward_rows(
    model: nn.Module,
    tokens: mx.array,
    caches: list[RowsKVCache],
    tap_ids: list[int],
    speedups: CpuSpeedups | None = None,
    trees: tuple[mx.array, mx.array] | None = None,
) -> tuple[mx.array, mx.array | None]:
    """The target over ``tokens`` ``(B, W)``, row ``i`` continuing row ``i`` of ``caches``.

    Returns ``(logits (B, W, vocab), taps (B, W, n_taps * H) or None)``, the taps as
    :func:`dflash_mlx.models.target.forward_with_taps` gives them (the last layer's after the final norm).
    With ``speedups``, float32 Qwen3 and Llama layers run as the single-stream passes' compiled CPU steps
    (the same operations; a batched pass is mostly the rows' weights read once, and their exp), else
    mlx-lm's own layers. ``trees``, ``(ancestors (B, W, W), depths (B, W))``, makes each row's block a draft
    tree (a path is one whose ancestors are the nodes before): node ``q`` sits at the row's length plus its
    depth and sees its ancestors only; it needs :func:`trees_supported`.
    """
    lengths = next(c.lengths for c in caches if isinstance(c, RowsKVCache))
    if trees is not None:
        ancestors, depths = trees
        visible = tree_rows_mask(lengths, ancestors)
        positions = mx.array(lengths, dtype=mx.int32)[:, None] + depths.astype(mx.int32)
    else:
        windows = {c.window for c in caches if isinstance(c, RowsKVCache)}
        masks = {w: rows_mask(lengths, tokens.shape[1], w) for w in windows}
    captured = {}
    if model.model_type in gemma.GEMMA_MODEL_TYPES:
        # Its own walk (scaled embedding, per-layer inputs, layers reusing others' keys), with these masks.
        h = gemma.forward_with_taps(model, tokens, caches, tap_ids, captured, masks=[masks[c.window] for c in caches])
        return tgt.head(model, h, captured, tap_ids)
    inner = model.model
    h = inner.embed_tokens(tokens)
    steps = None
    if trees is not None or (speedups is not None and h.dtype == mx.float32 and tokens.size >= speedups.min_tokens):
        steps = tgt.cpu_layer_steps(model, speedups)
    wanted = set(tap_ids)
    for i, (layer, c) in enumerate(zip(inner.layers, caches)):
        if isinstance(c, RowsRecurrentCache):
            h = hybrid.recorded_layer(layer, h, c)
        elif trees is not None:
            h = _tree_block(layer, h, c, visible, positions, speedups, steps[i])
        elif steps is None:
            h = layer(h, masks[c.window], c)
        else:
            h = tgt.cpu_block(layer, h, c, masks[c.window], speedups, steps[i])
        if i in wanted:
            captured[i] = h
    return tgt.head(model, h, captured, tap_ids)


def make_rows_cache(model: nn.Module, kernels: str = "auto") -> list[Any]:
    """A rows cache per decoder layer, no rows yet, of the kind of the layer's single-sequence cache: a
    :class:`RowsRecurrentCache` for a hybrid target's linear attention layers (``kernels``: their
    recurrence's Metal kernels' mode), a :class:`RowsKVCache` for the others (with the layer's window)."""
    out = []
    for c in families.make_target_cache(model, kernels):
        if isinstance(c, hybrid.RecurrentCache):
            out.append(RowsRecurrentCache(kernels))
        else:
            out.append(RowsKVCache(c.window if isinstance(c, SlidingKVCache) else None))
    return out
