"""Continuous batched greedy decoding for the data step: many prompts, one target, few copies.

A batch of ``B`` decode rows shares one write column (rows right-aligned, as in mlx-lm's
``BatchKVCache``). A finished row's slot is refilled in place: new prompts are prefilled
together (all but their last token, left-padded, in a ``BatchKVCache``) and their keys and
values are written into the free slots, ending at the write column; the last prompt token is
the row's next input. Nothing else is copied, where mlx-lm's ``BatchGenerator`` filters or
extends the whole cache each time a row leaves or joins (on a 2-core CPU that costs about as
much as a decode step per event at batch 64), and only the argmax of each row's logits is
taken, not a normalised distribution. The next step is queued (``mx.async_eval``) before the
host reads the current tokens.

Attention-only targets (each layer's cache a plain ``KVCache``); recurrent layers are not
refilled this way.
"""

from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache


def supports(model: nn.Module) -> bool:
    """Whether ``model``'s layers all keep plain key/value caches (no recurrent state, no window)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


class _SlotLayer:
    """One layer's cache in a :class:`SlotBatch`, with the interface mlx-lm's attention uses."""

    def __init__(self, batch: "SlotBatch"):
        self.batch = batch
        self.keys = self.values = None

    @property
    def offset(self) -> mx.array:  # each row's RoPE position of the token being decoded
        return self.batch.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs) -> mx.array:
        if N != 1 or window_size is not None:
            raise ValueError("a SlotBatch decodes one token per row, without a sliding window")
        return self.batch.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b = self.batch
        self.keys[..., b.idx : b.idx + 1, :] = keys
        self.values[..., b.idx : b.idx + 1, :] = values
        return self.keys[..., b.start : b.idx + 1, :], self.values[..., b.start : b.idx + 1, :]

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


class SlotBatch:
    """``B`` decode rows sharing one write column ``idx``, refilled in place.

    Row ``b`` holds valid keys from column ``lp[b]`` on (the mask hides the rest); attention
    reads the columns ``[start, idx]``, ``start`` the oldest live row's first one. When the
    buffer is full, that window is copied to the front of a new one, ``step`` columns larger.
    """

    step = 256

    def __init__(self, model: nn.Module, batch_size: int):
        self.B = batch_size
        self.layers = [_SlotLayer(self) for _ in model.layers]
        self.idx = self.start = self.cap = 0
        self.lp = np.zeros(batch_size, np.int64)
        self.live = np.zeros(batch_size, bool)
        self.offset = self.mask = None

    def _compact(self, extra_left: int = 0) -> None:
        width = self.idx - self.start
        new_cap = extra_left + width + self.step
        for layer in self.layers:
            k, v = layer.keys, layer.values
            shape = (self.B, self.kv_heads, new_cap, self.head_dim)
            nk, nv = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
            if k is not None and width > 0:
                nk[..., extra_left : extra_left + width, :] = k[..., self.start : self.idx, :]
                nv[..., extra_left : extra_left + width, :] = v[..., self.start : self.idx, :]
            layer.keys, layer.values = nk, nv
        self.lp -= self.start - extra_left
        self.idx, self.start, self.cap = extra_left + width, extra_left, new_cap
        mx.eval([layer.state for layer in self.layers])

    def insert(self, slots: list[int], group_cache: list[BatchKVCache], group_pad: np.ndarray, width: int) -> None:
        """Write a prefilled group (``width`` columns per layer) into ``slots``, ending at ``idx``."""
        k0 = group_cache[0].keys
        self.kv_heads, self.head_dim, self.dtype = k0.shape[1], k0.shape[3], k0.dtype
        if self.layers[0].keys is None or self.idx < width:
            self._compact(extra_left=max(0, width - (self.idx - self.start)))
        c0 = self.idx - width
        index = mx.array(slots)
        for layer, src in zip(self.layers, group_cache):
            layer.keys[index, :, c0 : self.idx, :] = src.keys[..., :width, :]
            layer.values[index, :, c0 : self.idx, :] = src.values[..., :width, :]
        self.lp[slots] = c0 + group_pad
        self.live[slots] = True
        self.start = min(self.start, c0)

    def prepare_step(self) -> None:
        """The offsets and mask of the next decode step (one column more)."""
        if self.idx + 1 > self.cap:
            self._compact()
        self.start = max(int(self.lp[self.live].min()) if self.live.any() else self.idx, 0)
        self.offset = mx.array(self.idx - self.lp, dtype=mx.int32)
        cols = np.arange(self.start, self.idx + 1)
        self.mask = mx.array((cols[None, :] >= self.lp[:, None])[:, None, None, :])


def decode_slots(
    model: nn.Module,
    take_group: Callable[[int], list[tuple[object, list[int]]]],
    *,
    batch_size: int,
    group: int,
    max_tokens: int,
    eos: frozenset[int] | set[int],
    on_step: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[object, list[int], str]]:
    """Greedy responses, ``(item, response_ids, finish_reason)`` as each row finishes.

    Args:
        model: An attention-only mlx-lm model (:func:`supports`).
        take_group: ``take_group(n)`` gives up to ``n`` items ``(anything, prompt_ids)`` (prompts
          of at least 2 tokens; similar lengths pad least), or ``[]`` when there are no more.
        batch_size: Rows decoded together.
        group: Free rows are refilled once this many are free, their prompts prefilled together.
        max_tokens: The most tokens per response.
        eos: Stop tokens; a response keeps its stop token (``finish_reason`` "stop", else "length").
        on_step: Called after each step with the tokens it added to responses and the live rows.
    """

    def prefill(items):
        heads = [ids[:-1] for _, ids in items]
        width = max(len(h) for h in heads)
        pad = [width - len(h) for h in heads]
        cache = [BatchKVCache(pad) for _ in model.layers]
        model(mx.array([[0] * p + h for p, h in zip(pad, heads)], dtype=mx.uint32), cache=cache)
        mx.eval([c.state for c in cache])
        return cache, pad, width

    group = min(group, batch_size)
    batch = SlotBatch(model, batch_size)
    state = ["free"] * batch_size  # free | first (its input is the prompt's last token) | live
    item, out = [None] * batch_size, [None] * batch_size
    y = mx.zeros((batch_size,), mx.uint32)
    more = True
    while True:
        free = [s for s in range(batch_size) if state[s] == "free"]
        if more and len(free) >= group:
            while more and free:
                items = take_group(min(group, len(free)))
                if not items:
                    more = False
                    break
                if min(len(ids) for _, ids in items) < 2:
                    raise ValueError("batched decoding needs prompts of at least 2 tokens")
                slots, free = free[: len(items)], free[len(items) :]
                cache, pad, width = prefill(items)
                batch.insert(slots, cache, np.array(pad), width)
                y[mx.array(slots)] = mx.array([ids[-1] for _, ids in items], dtype=mx.uint32)
                for s, it in zip(slots, items):
                    state[s], item[s], out[s] = "first", it, []
        if not batch.live.any():
            return
        batch.prepare_step()
        y_next = mx.argmax(model(y[:, None], cache=batch.layers)[:, -1, :], axis=-1).astype(mx.uint32)
        batch.idx += 1
        mx.async_eval(y_next)
        useful = 0
        for s, t in enumerate(y.tolist()):
            if state[s] == "first":
                state[s] = "live"
            elif state[s] == "live":
                out[s].append(t)
                useful += 1
                if t in eos or len(out[s]) >= max_tokens:
                    yield item[s], out[s], "stop" if t in eos else "length"
                    state[s], item[s], out[s] = "free", None, None
                    batch.live[s] = False
        if on_step is not None:
            on_step(useful, int(batch.live.sum()))
        y = y_next
