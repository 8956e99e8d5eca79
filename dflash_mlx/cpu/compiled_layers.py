"""Compiled layer steps (Qwen3's, and Llama's without its q/k norms) for MLX's CPU backend.

On MLX's CPU backend every operation costs a fixed few microseconds on top of its
arithmetic, and a layer of a small model is some twenty of them. Compiled, the
operations before a layer's attention (norm, projections, q/k norms, RoPE) and after it
(output projection, residual, norm, MLP) each run as one traced graph: a 16-token verify
of the embedded target takes ~12% less time, with bit-identical results. The attention
stays outside, since its key length changes every cycle. Each function is traced once
per input shape (a few milliseconds, once per block size or prompt-chunk length).
"""

from collections.abc import Callable
from functools import cache, partial
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import fast_math
from .speedups import CpuSpeedups


def rope_key(rope: nn.Module) -> tuple | None:
    """Plain (and linearly scaled) RoPE as hashable settings for the compiled step, or
    None for other variants, which the caller applies outside it."""
    if type(rope) is not nn.RoPE:
        return None
    return (("dims", rope.dims), ("traditional", rope.traditional), ("base", rope.base), ("scale", rope.scale))


def qk_norms(attn: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The attention's per-head query and key norms (Qwen3's), or None (Llama's has none)."""
    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return None if norms == (None, None) else norms


def plain_layer(attn: nn.Module, mlp: nn.Module, input_norm: nn.Module, post_norm: nn.Module) -> bool:
    """True when the layer is what the steps compute: unquantized bias-free projections,
    RMS norms with the same eps before the attention and before the MLP, and RMS query and key
    norms with one eps, or none."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    norms = qk_norms(attn)
    return (
        all(type(p) is nn.Linear and "bias" not in p for p in projections)
        and all(type(n) is nn.RMSNorm for n in (input_norm, post_norm, *(norms or ())))
        and input_norm.eps == post_norm.eps
        and (norms is None or norms[0].eps == norms[1].eps)
    )


@cache
def _steps(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: float,
    qk_eps: float | None,
    rope: tuple | None,
    compiled: bool,
    fast_exp: bool,
):
    # compiled=False gives the same functions op by op, for measuring what compiling saves.
    # qk_eps None: no query and key norms (Llama); their weights are then passed as None.
    rope_fn = None if rope is None else partial(mx.fast.rope, **dict(rope))

    def heads(x, n):
        b, length, _ = x.shape
        return x.reshape(b, length, n, head_dim)

    def qk_norm(x, w_norm):
        return x if qk_eps is None else mx.fast.rms_norm(x, w_norm, qk_eps)

    def key_values(x, offset, w_k, w_v, w_k_norm=None):
        k = qk_norm(heads(x @ w_k.T, n_kv_heads), w_k_norm).transpose(0, 2, 1, 3)
        v = heads(x @ w_v.T, n_kv_heads).transpose(0, 2, 1, 3)
        return (k if rope_fn is None else rope_fn(k, offset=offset)), v

    def before(x, offset, w_norm, w_q, w_k, w_v, w_q_norm=None, w_k_norm=None):
        h = mx.fast.rms_norm(x, w_norm, eps)
        q = qk_norm(heads(h @ w_q.T, n_heads), w_q_norm).transpose(0, 2, 1, 3)
        if rope_fn is not None:
            q = rope_fn(q, offset=offset)
        return (q, *key_values(h, offset, w_k, w_v, w_k_norm))

    def after(out, x, w_o, w_norm, w_gate, w_up, w_down):
        b, _, length, _ = out.shape
        h = x + out.transpose(0, 2, 1, 3).reshape(b, length, -1) @ w_o.T
        g = mx.fast.rms_norm(h, w_norm, eps)
        return h + fast_math.swiglu(g @ w_gate.T, g @ w_up.T, fast_exp) @ w_down.T

    wrap = mx.compile if compiled else (lambda fn: fn)
    return wrap(before), wrap(key_values), wrap(after)


class LayerSteps(NamedTuple):
    """A layer's compiled steps, and whether its RoPE is inside them (plain or linear RoPE;
    other variants are left to the caller)."""

    before: Callable
    key_values: Callable
    after: Callable
    rope_inside: bool


def layer_steps(attn: nn.Module, eps: float, speedups: CpuSpeedups) -> LayerSteps:
    """The steps of a layer whose norms have ``eps``; a caller running the same layers every pass
    looks them up once (on a small model the lookup costs as much as building the layer's graph)."""
    key = rope_key(attn.rope)
    norms = qk_norms(attn)
    head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
    qk_eps = None if norms is None else norms[0].eps
    steps = _steps(
        attn.n_heads, attn.n_kv_heads, head_dim, eps, qk_eps, key, speedups.compiled_steps, speedups.fast_exp
    )
    return LayerSteps(*steps, rope_inside=key is not None)


def _norm_weights(attn: nn.Module) -> tuple:
    norms = qk_norms(attn)
    return () if norms is None else (norms[0].weight, norms[1].weight)


def before(
    attn: nn.Module,
    input_norm: nn.Module,
    x: mx.array,
    offset: int,
    speedups: CpuSpeedups,
    steps: LayerSteps | None = None,
) -> tuple[mx.array, ...]:
    """``(q, k, v)`` of a layer's input ``x``, ``(B, heads, L, D)``, RoPE'd from ``offset``
    (``steps``: the layer's :func:`layer_steps`, if the caller keeps them)."""
    steps = steps or layer_steps(attn, input_norm.eps, speedups)
    q, k, v = steps.before(
        x,
        mx.array(offset),
        input_norm.weight,
        attn.q_proj.weight,
        attn.k_proj.weight,
        attn.v_proj.weight,
        *_norm_weights(attn),
    )
    if not steps.rope_inside:
        q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
    return q, k, v


def key_values(attn: nn.Module, x: mx.array, offset: int, speedups: CpuSpeedups) -> tuple[mx.array, mx.array]:
    """``(k, v)`` of inputs taken as they are (no input norm), RoPE'd from ``offset``."""
    steps = layer_steps(attn, attn.k_norm.eps, speedups)
    k, v = steps.key_values(x, mx.array(offset), attn.k_proj.weight, attn.v_proj.weight, *_norm_weights(attn)[1:])
    return (k if steps.rope_inside else attn.rope(k, offset=offset)), v


def after(
    attn: nn.Module,
    mlp: nn.Module,
    post_norm: nn.Module,
    out: mx.array,
    x: mx.array,
    speedups: CpuSpeedups,
    steps: LayerSteps | None = None,
) -> mx.array:
    """The layer's output from its attention's ``(B, heads, L, D)`` output and its input ``x``."""
    steps = steps or layer_steps(attn, post_norm.eps, speedups)
    return steps.after(
        out, x, attn.o_proj.weight, post_norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    )
