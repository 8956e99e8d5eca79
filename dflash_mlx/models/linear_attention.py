"""A Gated DeltaNet layer's forward for a verify pass that keeps what a rollback needs.

mlx-lm's ``GatedDeltaNet`` (Qwen3.5) and ``Qwen3NextGatedDeltaNet`` (Qwen3-Next) run their
recurrence inside ``__call__`` and keep only the final state. :func:`linear_attention` is the
same forward written with the layer's own modules (projections, conv1d, gated norm, output
projection) and mlx-lm's own ``normalize_qk`` and ``compute_g``, but its recurrence
(``kernels.gdn.gated_delta_states``) also returns the state after every position; with the
convolution's inputs, that lets ``RecurrentCache.trim`` select the state at any kept length.
It gives the layer's output (tests/test_hybrid.py compares the two in float32).
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..kernels.gdn import gated_delta_states
from ..kernels.gdn_tree import gated_delta_tree

# The layers whose forward this mirrors: any other runs as it is (and rolls back by replay).
LAYERS = (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)


def _heads(attn, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The convolution's output split into normalised queries and keys and the values, per head."""
    B, L = conv_out.shape[:2]
    q, k, v = [
        t.reshape(B, L, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


def supports(attn: nn.Module, mask: mx.array | None, cache: Any) -> bool:
    """Whether :func:`linear_attention` gives ``attn``'s output here: one of ``LAYERS``, not
    sharded, with no padding mask and no per-row lengths in the cache."""
    return (
        isinstance(attn, LAYERS)
        and getattr(attn, "sharding_group", None) is None
        and mask is None
        and cache.lengths is None
    )


def _projections(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    # (B, L, conv_dim) convolution inputs, (B, L, Hv, Dv) gate z, (B, L, Hv) b and a.
    B, L, _ = x.shape
    if isinstance(attn, qwen3_next.Qwen3NextGatedDeltaNet):
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, L, -1), k.reshape(B, L, -1), v.reshape(B, L, -1)], axis=-1)
        return qkv, z, b, a
    z = attn.in_proj_z(x).reshape(B, L, attn.num_v_heads, attn.head_v_dim)
    return attn.in_proj_qkv(x), z, attn.in_proj_b(x), attn.in_proj_a(x)


def linear_attention(attn: nn.Module, x: mx.array, cache: Any) -> tuple[mx.array, mx.array, list[mx.array]]:
    """``attn(x, None, cache)``, also returning what selects a shorter pass's state.

    Args:
        attn: A Gated DeltaNet layer of ``LAYERS`` (see :func:`supports`).
        x: ``(B, L, hidden)`` the normalized decoder layer input.
        cache: The layer's ``[conv_state, recurrent_state]``, updated and advanced as the layer
          updates it.

    Returns:
        ``(out, conv_input, states)``: the layer's ``(B, L, hidden)`` output;
        ``(B, K - 1 + L, conv_dim)`` the convolution's inputs (the conv state before the pass,
        then the pass's), whose positions ``k .. k + K - 2`` are the conv state after ``k``
        tokens; and the recurrent state after each position, ``L`` ``(B, Hv, Dv, Dk)`` arrays.
    """
    B, L, _ = x.shape
    qkv, z, b, a = _projections(attn, x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(attn.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(attn.conv1d(conv_input))
    q, k, v = _heads(attn, conv_out)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32)
    g = compute_g(attn.A_log, a, attn.dt_bias)
    # As the layer does, the ops when training: the kernel has no gradient.
    mode = "off" if attn.training else cache.kernels
    y, cache[1], states = gated_delta_states(q, k, v, g, mx.sigmoid(b), state, mode=mode)
    cache.advance(L)
    out = attn.out_proj(attn.norm(y, z).reshape(B, L, -1))
    return out, conv_input, states


def tree_linear_attention(
    attn: nn.Module, x: mx.array, cache: Any, parents: list[int]
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """``attn`` over a draft tree's nodes, each row continuing its own path (:mod:`dflash_mlx.drafts.tree`).

    The convolution of a node sees the inputs of its nearest ancestors (before the root, the conv
    state) and its own; its recurrent state is its parent's, stepped by its own input. The cache is
    left as it was: the accepted node's states are installed afterwards (``RecurrentCache.keep``).

    Args:
        attn: A Gated DeltaNet layer of ``LAYERS``.
        x: ``(N, 1, hidden)`` the normalized layer input of each node, the root first.
        cache: The layer's ``[conv_state, recurrent_state]`` before the tree.
        parents: Each node's parent index (``-1`` for the root).

    Returns:
        ``(out, sources, states)``: the ``(N, 1, hidden)`` outputs; ``(K - 1 + N, conv_dim)`` the conv
        state before the tree, then each node's convolution input; the recurrent state after each
        node, ``N`` ``(1, Hv, Dv, Dk)``.
    """
    N = x.shape[0]
    K = attn.conv_kernel_size
    qkv, z, b, a = _projections(attn, x)  # (N, 1, ...) each
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((1, K - 1, attn.conv_dim), dtype=x.dtype)
    sources = mx.concatenate([conv_state[0], qkv[:, 0]], axis=0)  # (K - 1 + N, conv_dim)
    rows = []
    for i in range(N):
        path, j = [], i
        while j >= 0 and len(path) < K:
            path.append(K - 1 + j)
            j = parents[j]
        path += list(range(K - 2, K - 2 - (K - len(path)), -1))  # before the root: the conv state, newest first
        rows.append(path[::-1])
    windows = sources[mx.array(rows)]  # (N, K, conv_dim)
    conv_out = nn.silu(attn.conv1d(windows))[:, -1:]  # (N, 1, conv_dim)
    q, k, v = _heads(attn, conv_out)
    state = cache[1]
    if state is None:
        state = mx.zeros((1, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32)
    g = compute_g(attn.A_log, a, attn.dt_bias)
    mode = "off" if attn.training else cache.kernels
    beta = mx.sigmoid(b)[:, 0]
    y, states = gated_delta_tree(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta, state, parents, mode=mode)
    out = attn.out_proj(attn.norm(y[:, None], z).reshape(N, 1, -1))
    return out, sources, states
