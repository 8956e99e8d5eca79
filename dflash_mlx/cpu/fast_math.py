"""Element-wise operations for MLX's CPU backend, where exp is the expensive operation.

MLX's CPU exp costs about 12 ns an element against 0.2 ns for an add, so in a 16-token
verify of a small target, SwiGLU's sigmoid and the attention softmax are a quarter of the
pass. Here exp is a polynomial of adds and multiplies that ``mx.compile`` fuses with its
neighbours into one kernel, as accurate as MLX's own (a few float32 ulps). On a GPU, exp
costs what an add does: callers pass ``fast_exp`` from the one switch in
``dflash_mlx.cpu.speedups``, and the dispatchers here fall back to MLX's native ops when it is off
or the inputs are not float32.
"""

from functools import partial

import mlx.core as mx
from mlx_lm.models.activations import swiglu as _native_swiglu

_LOG2E = 1.4426950408889634
# Taylor coefficients of 2**f = exp(f ln 2) for |f| <= 1/2, highest degree first; the
# degree-7 term leaves a relative error under 3e-8, below float32's rounding.
_COEFFS = (
    1.525273380405984e-05,
    1.5403530393381606e-04,
    1.3333558146428443e-03,
    9.618129107628477e-03,
    5.550410866482158e-02,
    2.402265069591007e-01,
    6.931471805599453e-01,
    1.0,
)
# Below this, exp leaves float32's normal range; both versions return 0 there.
_EXP_MIN = -87.0
# The attention's version makes 2**n from an int64 shift, so n = round(x log2 e) stays
# within 62 bits: below x = -43 it returns 0, which beside a softmax's largest weight of 1
# is lost in float32's rounding anyway (exp(-43) = 2e-19).
_SHIFT_MIN = -43.0
# A one-token step stays MLX's own attention (plain decoding's, the baseline). From two queries
# on, with a KV group's heads as one matrix, the default pair's 2-4 token verify passes took
# 0.86-0.95x the time over 1k keys and 0.97-1.01x over 300 (OpenBLAS, 2-core Xeon).
_MIN_QUERIES = 2
# Past CHUNK_ABOVE keys the fused exp's working set (several arrays of heads x queries x keys, as
# the compiled kernel keeps its inputs and outputs) outgrows the drafter's own K/V at long
# contexts, and the scores outgrow the CPU's caches; the keys are then taken in equal chunks of at
# most KEY_CHUNK, each evaluated before the next (an online softmax), so what a pass holds beyond
# the K/V stays one chunk's at any context. Measured on a 2-core EPYC (9 heads x 16 queries):
# 0.4-0.7x the time of one pass over 4k-16k keys, 1.1x over 2-3k keys, hence the threshold.
# Chunks of 1,024 keys took the time of 2,048's over 4k-32k keys with half the working set
# (about 8 score-sized arrays then, 4.3 against 8.1 MB at 16k; about 6 since the exp's split
# below); 512 were slower (a draft pass 11-23% slower at 16k-32k keys).
CHUNK_ABOVE = 4096
KEY_CHUNK = 1024


def _two_to_the_f(y: mx.array) -> tuple[mx.array, mx.array]:
    # 2**y = 2**f * 2**n with n = round(y), |f| <= 1/2; returns (2**f, n).
    n = mx.floor(y + 0.5)
    f = y - n
    p = _COEFFS[0]
    for c in _COEFFS[1:]:
        p = p * f + c
    return p, n


def _exp(x: mx.array) -> mx.array:
    # 2**n is written straight into the exponent bits: the fastest form, but a bitcast
    # needs known shapes, so the compiles around it are traced once per shape.
    p, n = _two_to_the_f(mx.clip(x, _EXP_MIN, 88.0) * _LOG2E)
    scale = mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)
    return mx.where(x < _EXP_MIN, 0.0, p * scale)


def _exp_nonpositive(x: mx.array) -> mx.array:
    # For x <= 0, shapeless.
    return _scaled_down(x, *_nonpositive_parts(x))


def _nonpositive_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    # (2**f, n) of x log2 e, x clamped at _SHIFT_MIN so that n fits the shift below.
    return _two_to_the_f(mx.maximum(x, _SHIFT_MIN) * _LOG2E)


def _scaled_down(x: mx.array, p: mx.array, n: mx.array) -> mx.array:
    # exp(x) from _nonpositive_parts(x): 2**-n comes exact from an integer shift converted to float.
    power = mx.left_shift(mx.array(1, dtype=mx.int64), (-n).astype(mx.int64)).astype(x.dtype)
    return mx.where(x < _SHIFT_MIN, 0.0, p / power)


# Not shapeless: SwiGLU sees one shape per block size (and per prompt length in a prefill).
@mx.compile
def _swiglu_forward(gate: mx.array, up: mx.array) -> mx.array:
    return gate / (1.0 + _exp(-gate)) * up


@mx.custom_function
def _swiglu_cpu(gate: mx.array, up: mx.array) -> mx.array:
    return _swiglu_forward(gate, up)


@_swiglu_cpu.vjp
def _swiglu_cpu_vjp(primals, cotangent, output):
    # The polynomial's rounding and bit tricks have no gradient; silu's derivative does.
    gate, up = primals
    sig = mx.sigmoid(gate)
    silu = gate * sig
    d_gate = cotangent * up * sig * (1.0 + gate * (1.0 - sig))
    return d_gate, cotangent * silu


def swiglu(gate: mx.array, up: mx.array, fast_exp: bool = False) -> mx.array:
    """``silu(gate) * up``, as mlx-lm's ``swiglu``; the kernel only for float32 inputs."""
    if not fast_exp or gate.dtype != mx.float32 or up.dtype != mx.float32:
        return _native_swiglu(gate, up)
    return _swiglu_cpu(gate, up)


@partial(mx.compile, shapeless=True)
def _masked_scores(scores: mx.array, mask: mx.array, scale: mx.array) -> mx.array:
    return mx.where(mask, scores * scale, -mx.inf)


# Two kernels, not one: MLX fuses element-wise chains only so deep, and the polynomial and the
# power in one compiled function came out as several kernels that held about 7 score-sized
# arrays at once (the attention's working set per key chunk). Split where the polynomial ends,
# they hold 4 (the scores, 2**f, n, the weights), with the same result to the bit. Each kernel
# subtracts ``top`` itself: handing the difference over would hold one array more.
@partial(mx.compile, shapeless=True)
def _shifted_exp_parts(scores: mx.array, top: mx.array) -> tuple[mx.array, mx.array]:
    return _nonpositive_parts(scores - top)


@partial(mx.compile, shapeless=True)
def _shifted_exp_scaled(scores: mx.array, top: mx.array, p: mx.array, n: mx.array) -> mx.array:
    return _scaled_down(scores - top, p, n)


def _shifted_exp_forward(scores: mx.array, top: mx.array) -> mx.array:
    return _shifted_exp_scaled(scores, top, *_shifted_exp_parts(scores, top))


@mx.custom_function
def _shifted_exp(scores: mx.array, top: mx.array) -> mx.array:
    return _shifted_exp_forward(scores, top)


@_shifted_exp.vjp
def _shifted_exp_vjp(primals, cotangent, output):
    grad = cotangent * output
    return grad, -mx.sum(grad, axis=-1, keepdims=True)


def causal_mask(offset: int, length: int) -> mx.array:
    """``(length, offset + length)`` booleans: query ``i`` sees keys ``0..offset + i``."""
    return mx.arange(offset, offset + length)[:, None] >= mx.arange(offset + length)[None]


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | None = None,
    fast_exp: bool = False,
) -> mx.array:
    """Softmax attention with grouped KV heads, as ``mx.fast.scaled_dot_product_attention``.

    Args:
        queries: ``(B, n_heads, L, D)``.
        keys, values: ``(B, n_kv_heads, S, D)``; ``n_heads`` a multiple of ``n_kv_heads``.
        scale: Applied to the scores.
        mask: None (every query sees every key) or booleans broadcastable to
          ``(B, n_heads, L, S)``, True where a query may attend; every query must see at
          least one key. Other masks go to MLX's own attention.
        fast_exp: Use the fused-exp softmax (float32, from 2 queries on); else, and for
          other inputs, ``mx.fast.scaled_dot_product_attention``.
    """
    b, n_heads, length, dim = queries.shape
    n_kv = keys.shape[1]
    if (
        not fast_exp
        or queries.dtype != mx.float32
        or length < _MIN_QUERIES
        or (mask is not None and (not isinstance(mask, mx.array) or mask.dtype != mx.bool_))
    ):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    group, total = n_heads // n_kv, keys.shape[2]
    if total <= CHUNK_ABOVE and (mask is None or mask.ndim <= 2):
        # One mask for every head: a KV group's heads are one matrix of group x L query rows, so
        # each product is one matmul per KV head instead of one per query head (2-4 queries over
        # 1k keys: 0.8x the time).
        q = queries.reshape(b, n_kv, group * length, dim)
        if mask is not None:
            mask = mx.broadcast_to(mask, (group, length, total)).reshape(group * length, total)
        k, v = keys, values
    else:
        if mask is not None and mask.ndim == 4:
            # Per-head masks follow the queries into their KV groups.
            mask = mask.reshape(mask.shape[0], -1, group if mask.shape[1] > 1 else 1, *mask.shape[2:])
        # Grouped heads share their KV head through a broadcast instead of a repeat.
        q = queries.reshape(b, n_kv, group, length, dim)
        if total > CHUNK_ABOVE:
            return _chunked_attention(q, keys, values, scale, mask).reshape(b, n_heads, length, dim)
        k, v = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ k.swapaxes(-1, -2)
    if mask is None:
        scores = scores * scale
    else:
        scores = _masked_scores(scores, mask, mx.array(scale, dtype=scores.dtype))
    weights = _shifted_exp(scores, mx.max(scores, axis=-1, keepdims=True))
    # Normalising after the value product divides L x D numbers instead of L x S.
    out = (weights @ v) / mx.sum(weights, axis=-1, keepdims=True)
    return out.reshape(b, n_heads, length, dim)


def _chunked_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None) -> mx.array:
    """:func:`attention` over at most ``KEY_CHUNK`` keys at a time, each chunk evaluated before the next.

    The running maximum ``top`` rescales what the earlier chunks summed when a later chunk holds a
    larger score; a row that has seen only masked keys so far has ``top = -inf`` and sums of 0,
    which the first visible key replaces (every row sees at least one key in all).
    """
    total = keys.shape[2]
    # Chunks of equal size: a short last chunk would cost a pass of its own for little work.
    size = -(-total // -(-total // KEY_CHUNK))
    top = acc = norm = None
    for start in range(0, total, size):
        stop = min(start + size, total)
        scores = q @ mx.expand_dims(keys[:, :, start:stop], 2).swapaxes(-1, -2)
        if mask is None:
            scores = scores * scale
        else:
            part = mask[..., start:stop] if mask.shape[-1] > 1 else mask
            scores = _masked_scores(scores, part, mx.array(scale, dtype=scores.dtype))
        chunk_top = mx.max(scores, axis=-1, keepdims=True)
        new_top = chunk_top if top is None else mx.maximum(top, chunk_top)
        # Rows with no visible key yet shift by 0: their scores are all -inf, their weights 0.
        shift = mx.where(new_top == -mx.inf, 0.0, new_top)
        weights = _shifted_exp(scores, shift)
        chunk_acc = weights @ mx.expand_dims(values[:, :, start:stop], 2)
        chunk_norm = mx.sum(weights, axis=-1, keepdims=True)
        if top is None:
            acc, norm = chunk_acc, chunk_norm
        else:
            rescale = mx.where(top == -mx.inf, 0.0, mx.exp(top - shift))
            acc, norm = acc * rescale + chunk_acc, norm * rescale + chunk_norm
        top = new_top
        mx.eval(acc, norm, top)
    return acc / norm


@partial(mx.compile, shapeless=True)
def _softmax_forward(x: mx.array) -> mx.array:
    weights = _exp_nonpositive(x - mx.max(x, axis=-1, keepdims=True))
    return weights / mx.sum(weights, axis=-1, keepdims=True)


def softmax(x: mx.array, fast_exp: bool = False) -> mx.array:
    """``mx.softmax`` over the last axis; the kernel (the fused exp) only for float32 inputs.

    A sampled cycle normalises a few rows of the whole vocabulary on each side (the drafter's
    and the target's), which on MLX's CPU backend is mostly exp. Weights below e^-43 of the
    largest come out as 0, as in the attention's softmax here.
    """
    if not fast_exp or x.dtype != mx.float32:
        return mx.softmax(x, axis=-1)
    return _softmax_forward(x)
