"""The gated delta rule down a draft tree: each node's state is its parent's, stepped by its own input.

A hybrid target verifies a draft tree (:mod:`dflash_mlx.drafts.tree`) in one pass over its flattened
nodes; its Gated DeltaNet layers must give every node the state a pass along that node's path
alone would (``models.linear_attention.tree_linear_attention``). The step is
:mod:`.gdn`'s (mlx-lm's recurrence), only the state it starts from is the parent's.

The Metal kernel keeps :mod:`.gdn`'s layout: one simdgroup per value row of each head, lane
``l`` holding state elements ``l, l + 32, ...`` of the row in registers. It walks the nodes in
their order (a parent comes before its children) and keeps every node's state in the ``states``
output, so a node whose parent is not the node just before it reloads the parent's row from
there. Each lane reloads only the elements it wrote itself, so no thread needs another's
writes: no barrier, no threadgroup memory, and a tree costs what a path of as many nodes costs,
plus one reload per branch. (Recomputing each node along its path from the root would need no
kept states, but costs a step per ancestor: N * depth steps instead of N.)
"""

import mlx.core as mx

from .dispatch import SelfChecked
from .gdn import _TOLERANCE, MAX_KEY_DIM, ROWS_PER_GROUP, _near, _step
from .gdn import example as path_example

# q, k: (N, Hk, Dk); v, y: (N, Hv, Dv); g, beta: (N, Hv); parents: (N,) int32;
# state_in: (1, Hv, Dv, Dk); states: (N, Hv, Dv, Dk).
SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint dv_idx = thread_position_in_grid.y;
    uint hv_idx = thread_position_in_grid.z;
    uint hk_idx = hv_idx / (Hv / Hk);
    int N = q_shape[0];
    constexpr int PER_LANE = (Dk + 31) / 32;
    constexpr size_t NODE = (size_t)Hv * Dv * Dk;  // one node's state
    size_t row = ((size_t)hv_idx * Dv + dv_idx) * Dk;  // this thread's row in a state

    float s[PER_LANE];
    for (int i = 0; i < PER_LANE; ++i) {
        uint d = lane + 32 * i;
        s[i] = d < Dk ? static_cast<float>(state_in[row + d]) : 0.0f;
    }
    for (int n = 0; n < N; ++n) {
        int p = parents[n];
        // The node before this one left its state in s: a parent elsewhere is read back from what
        // this same lane wrote to states (the root's parent, -1, is state_in, already in s).
        if (p != n - 1) {
            const device StT* from = p < 0 ? state_in + row : states + p * NODE + row;
            for (int i = 0; i < PER_LANE; ++i) {
                uint d = lane + 32 * i;
                s[i] = d < Dk ? static_cast<float>(from[d]) : 0.0f;
            }
        }
        const device InT* q_ = q + ((size_t)n * Hk + hk_idx) * Dk;
        const device InT* k_ = k + ((size_t)n * Hk + hk_idx) * Dk;
        size_t gn = (size_t)n * Hv + hv_idx;
        float decay = static_cast<float>(g[gn]);
        float kv_mem = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
            uint d = lane + 32 * i;
            s[i] = s[i] * decay;
            if (d < Dk) kv_mem += s[i] * static_cast<float>(k_[d]);
        }
        kv_mem = simd_sum(kv_mem);
        float delta = (static_cast<float>(v[gn * Dv + dv_idx]) - kv_mem) * static_cast<float>(beta[gn]);
        device StT* to = states + n * NODE + row;
        float out = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
            uint d = lane + 32 * i;
            if (d < Dk) {
                s[i] = s[i] + static_cast<float>(k_[d]) * delta;
                out += s[i] * static_cast<float>(q_[d]);
                to[d] = static_cast<StT>(s[i]);
            }
        }
        out = simd_sum(out);
        if (lane == 0) y[gn * Dv + dv_idx] = static_cast<InT>(out);
    }
"""


def gated_delta_tree_ops(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, parents: list[int]
) -> tuple[mx.array, list[mx.array]]:
    """The gated delta recurrence down a draft tree: each node's state is its parent's, stepped by
    the node's own input (the root's parent is ``state``), so every path gets exactly the states a
    pass along it alone would.

    Args:
        q, k: ``(N, Hk, Dk)`` per node, normalized as mlx-lm's ``normalize_qk`` leaves them.
        v: ``(N, Hv, Dv)``.
        g, beta: ``(N, Hv)``.
        state: ``(1, Hv, Dv, Dk)`` the state before the root (float32).
        parents: ``parents[i]`` is node ``i``'s parent (``-1`` for the root, node 0); a parent
          comes before its children.

    Returns:
        ``(y, states)``: ``(N, Hv, Dv)`` outputs and the state after each node, ``N`` ``(1, Hv, Dv, Dk)``.
    """
    if (repeat := v.shape[1] // k.shape[1]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    ys, states = [None] * len(parents), [None] * len(parents)
    # One batched step per depth: the nodes of a depth are independent given their parents.
    for d in range(max(depth) + 1):
        nodes = [i for i in range(len(parents)) if depth[i] == d]
        before = state if d == 0 else mx.concatenate([states[parents[i]] for i in nodes], axis=0)
        at = mx.array(nodes)
        y, after = _step(q[at], k[at], v[at], g[at], beta[at], before)
        for j, i in enumerate(nodes):
            ys[i], states[i] = y[j], after[j : j + 1]
    return mx.stack(ys), states


def _make_kernel(factory):
    return factory(
        name="dflash_gated_delta_tree",
        input_names=["q", "k", "v", "g", "beta", "state_in", "parents"],
        output_names=["y", "states"],
        source=SOURCE,
    )


_KERNELS: dict = {}


def gated_delta_tree_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    parents: list[int],
    *,
    factory=None,
) -> tuple[mx.array, list[mx.array]]:
    """The Metal kernel (``factory``: ``mx.fast.metal_kernel``, or the CPU harness's stand-in).

    Takes and returns what :func:`gated_delta_tree_ops` does, for inputs :func:`supports`.
    """
    if factory is None:
        factory = mx.fast.metal_kernel
    if factory not in _KERNELS:
        _KERNELS[factory] = _make_kernel(factory)
    N, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    y, states = _KERNELS[factory](  # states: (N, Hv, Dv, Dk)
        inputs=[q, k, v, g, beta, state, mx.array(parents, dtype=mx.int32)],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, Hv),
        threadgroup=(32, ROWS_PER_GROUP, 1),
        output_shapes=[(N, Hv, Dv), (N, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype],
    )
    return y, [states[n : n + 1] for n in range(N)]


def supports(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, parents: list[int]
) -> bool:
    """Whether the kernel handles these inputs (a scalar gate, a float32 state, one root first and
    every parent before its child); else the twin runs."""
    N, Hk, Dk = k.shape
    return (
        q.shape == k.shape
        and v.ndim == 3
        and v.shape[0] == N
        and v.shape[1] % Hk == 0
        and g.shape == beta.shape == v.shape[:2]
        and state.shape == (1, v.shape[1], v.shape[2], Dk)
        and state.dtype == mx.float32
        and 1 <= Dk <= MAX_KEY_DIM
        and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and k.dtype == v.dtype == q.dtype
        and len(parents) == N >= 1
        and parents[0] == -1
        and all(0 <= p < n for n, p in enumerate(parents[1:], 1))
    )


def shape_class(q, k, v, g, beta, state, parents) -> str:
    """What the kernel's speed depends on: the dtype, the nodes and the heads' shapes (not the
    tree's shape, which changes every cycle and costs at most a reload per branch)."""
    return f"{q.dtype}|N{q.shape[0]}|Hk{k.shape[1]}x{k.shape[2]}|Hv{v.shape[1]}x{v.shape[2]}"


def random_parents(n: int, key: mx.array) -> list[int]:
    """A tree of ``n`` nodes, node 0 the root: each node continues the one before it or, as often,
    branches off a node drawn from all earlier ones."""
    if n <= 1:
        return [-1] * n
    chain, pick = mx.random.split(key)
    branch = mx.random.uniform(shape=(n - 1,), key=chain) < 0.5
    drawn = (mx.random.uniform(shape=(n - 1,), key=pick) * mx.arange(1, n)).astype(mx.int32)
    return [-1] + mx.where(branch, drawn, mx.arange(n - 1)).tolist()


def example(q, k, v, g, beta, state, parents) -> tuple:
    """Random inputs of the class of these (:func:`.gdn.example`'s per node) on a random tree with
    branches, so the check reads parents that are not the node before."""
    path = path_example(q[None], k[None], v[None], g[None], beta[None], state)
    tree = random_parents(q.shape[0], mx.random.key(1))  # the caller's random state is left alone
    return (*(x[0] for x in path[:5]), path[5], tree)


def close(got: tuple, want: tuple) -> bool:
    """Whether ``(y, states)`` match: ``y`` to its dtype's rounding, the float32 states to float32's."""
    y, states = got
    want_y, want_states = want
    return (
        len(states) == len(want_states)
        and _near(y, want_y, _TOLERANCE[want_y.dtype])
        and _near(mx.concatenate(states), mx.concatenate(want_states), _TOLERANCE[mx.float32])
    )


gated_delta_tree = SelfChecked(
    "gated_delta_tree",
    gated_delta_tree_kernel,
    gated_delta_tree_ops,
    shape_class=shape_class,
    example=example,
    close=close,
    supports=supports,
)
gated_delta_tree.__doc__ = """The gated delta recurrence down a draft tree (see :func:`gated_delta_tree_ops`):
the Metal kernel where it checked itself at this shape class on this machine, the twin elsewhere."""
