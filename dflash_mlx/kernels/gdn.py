"""The gated delta rule over a verify pass that also keeps the state after every position.

A Gated DeltaNet layer's recurrent state cannot be cut back like keys and values. With the
state after each of the pass's positions kept, rolling back to ``k`` kept tokens selects the
``k``-th state instead of running the kept tokens through the layer again
(``models.hybrid.RecurrentCache.trim``). The recurrence is mlx-lm's
(``mlx_lm.models.gated_delta``), step for step: decay the state by ``g``, read ``kv_mem`` with
``k``, write ``beta * (v - kv_mem)`` along ``k``, read the output with ``q``.

The Metal kernel gives each value row of each head one simdgroup; lane ``l`` keeps state
elements ``l, l + 32, ...`` of the row in registers, so any key width works and the state's
loads and stores are contiguous across the lanes. Nothing is shared through threadgroup
memory: the two dot products per step are ``simd_sum``s.
"""

import mlx.core as mx

from .dispatch import SelfChecked

ROWS_PER_GROUP = 4  # value rows (simdgroups) per threadgroup
MAX_KEY_DIM = 256  # state elements a lane keeps: MAX_KEY_DIM / 32

# q, k: (B, T, Hk, Dk); v, y: (B, T, Hv, Dv); g, beta: (B, T, Hv); state_in, state_out:
# (B, Hv, Dv, Dk); states: (B, T, Hv, Dv, Dk).
SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint dv_idx = thread_position_in_grid.y;
    uint n = thread_position_in_grid.z;  // b * Hv + hv
    uint b_idx = n / Hv;
    uint hv_idx = n % Hv;
    uint hk_idx = hv_idx / (Hv / Hk);
    int T = q_shape[1];
    constexpr int PER_LANE = (Dk + 31) / 32;

    const device InT* q_ = q + ((size_t)b_idx * T * Hk + hk_idx) * Dk;
    const device InT* k_ = k + ((size_t)b_idx * T * Hk + hk_idx) * Dk;
    const device InT* v_ = v + ((size_t)b_idx * T * Hv + hv_idx) * Dv;
    device InT* y_ = y + ((size_t)b_idx * T * Hv + hv_idx) * Dv;
    const device StT* s_in = state_in + ((size_t)n * Dv + dv_idx) * Dk;
    device StT* s_out = state_out + ((size_t)n * Dv + dv_idx) * Dk;
    device StT* s_all = states + (((size_t)b_idx * T * Hv + hv_idx) * Dv + dv_idx) * Dk;

    float s[PER_LANE];
    for (int i = 0; i < PER_LANE; ++i) {
        uint d = lane + 32 * i;
        s[i] = d < Dk ? static_cast<float>(s_in[d]) : 0.0f;
    }
    for (int t = 0; t < T; ++t) {
        size_t gt = ((size_t)b_idx * T + t) * Hv + hv_idx;
        float decay = static_cast<float>(g[gt]);
        float kv_mem = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
            uint d = lane + 32 * i;
            s[i] = s[i] * decay;
            if (d < Dk) kv_mem += s[i] * static_cast<float>(k_[d]);
        }
        kv_mem = simd_sum(kv_mem);
        float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta[gt]);
        float out = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
            uint d = lane + 32 * i;
            if (d < Dk) {
                s[i] = s[i] + static_cast<float>(k_[d]) * delta;
                out += s[i] * static_cast<float>(q_[d]);
                s_all[d] = static_cast<StT>(s[i]);
            }
        }
        out = simd_sum(out);
        if (lane == 0) y_[dv_idx] = static_cast<InT>(out);
        q_ += Hk * Dk;
        k_ += Hk * Dk;
        v_ += Hv * Dv;
        y_ += Hv * Dv;
        s_all += (size_t)Hv * Dv * Dk;
    }
    for (int i = 0; i < PER_LANE; ++i) {
        uint d = lane + 32 * i;
        if (d < Dk) s_out[d] = static_cast<StT>(s[i]);
    }
"""


@mx.compile
def _step(q, k, v, g, beta, state):
    # mlx-lm's _gated_delta_step_ops (scalar gate, no mask), the same ops in the same order, so
    # that a pass through it gives the same outputs and states as the layer's own recurrence.
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # (B, Hv, Dv)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # (B, Hv, Dv)
    return y.astype(q.dtype), state


def gated_delta_states_ops(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """The gated delta recurrence with MLX ops: the truth the kernel is checked against.

    Args:
        q, k: ``(B, T, Hk, Dk)``, normalized as mlx-lm's ``normalize_qk`` leaves them.
        v: ``(B, T, Hv, Dv)``, ``Hv`` a multiple of ``Hk``.
        g: ``(B, T, Hv)`` the decay (a scalar per head, mlx-lm's ``compute_g``).
        beta: ``(B, T, Hv)``.
        state: ``(B, Hv, Dv, Dk)`` the state before the pass (float32).

    Returns:
        ``(y, state, states)``: ``(B, T, Hv, Dv)`` outputs in ``q``'s dtype, the final state and
        the state after each position, a list of ``T`` ``(B, Hv, Dv, Dk)`` arrays (a list, not a
        stacked array: selecting one of them later copies nothing).
    """
    if (repeat := v.shape[2] // k.shape[2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), state, states


def _make_kernel(factory):
    return factory(
        name="dflash_gated_delta_states",
        input_names=["q", "k", "v", "g", "beta", "state_in"],
        output_names=["y", "state_out", "states"],
        source=SOURCE,
    )


_KERNELS: dict = {}


def gated_delta_states_kernel(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, *, factory=None
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """The Metal kernel (``factory``: ``mx.fast.metal_kernel``, or the CPU harness's stand-in).

    Takes and returns what :func:`gated_delta_states_ops` does, for inputs :func:`supports`.
    """
    if factory is None:
        factory = mx.fast.metal_kernel
    if factory not in _KERNELS:
        _KERNELS[factory] = _make_kernel(factory)
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    y, final, states = _KERNELS[factory](  # states: (B, T, Hv, Dv, Dk)
        inputs=[q, k, v, g, beta, state],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, ROWS_PER_GROUP, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype, state.dtype],
    )
    return y, final, [states[:, t] for t in range(T)]


def supports(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> bool:
    """Whether the kernel handles these inputs (a scalar gate, a float32 state); else the twin runs."""
    B, T, Hk, Dk = k.shape
    return (
        q.shape == k.shape
        and v.ndim == 4
        and v.shape[:2] == (B, T)
        and v.shape[2] % Hk == 0
        and g.shape == beta.shape == v.shape[:3]
        and state.shape == (B, v.shape[2], v.shape[3], Dk)
        and state.dtype == mx.float32
        and 1 <= Dk <= MAX_KEY_DIM
        and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and k.dtype == v.dtype == q.dtype
    )


def shape_class(q, k, v, g, beta, state) -> str:
    """What the kernel's speed depends on: the dtype, the positions and the heads' shapes."""
    return f"{q.dtype}|T{q.shape[1]}|Hk{k.shape[2]}x{k.shape[3]}|Hv{v.shape[2]}x{v.shape[3]}|B{q.shape[0]}"


def example(q, k, v, g, beta, state) -> tuple:
    """Random inputs of the class of these, as a layer would give them (unit-norm keys, gates in (0, 1))."""
    keys = mx.random.split(mx.random.key(0), 6)  # the caller's random state is left alone
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]

    def unit(key):
        x = mx.random.normal((B, T, Hk, Dk), key=key)
        return x / mx.linalg.norm(x, axis=-1, keepdims=True)

    return (
        (unit(keys[0]) * Dk**-0.5).astype(q.dtype),
        unit(keys[1]).astype(k.dtype),
        mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(v.dtype),
        mx.random.uniform(0.5, 1.0, (B, T, Hv), key=keys[3]).astype(g.dtype),
        mx.random.uniform(0.0, 1.0, (B, T, Hv), key=keys[4]).astype(beta.dtype),
        mx.random.normal(state.shape, key=keys[5]).astype(state.dtype) * 0.1,
    )


# Largest error allowed, relative to the largest value: the summation order, and one rounding of
# the output in a half dtype. (The twin computes in float32 too: a half input times the float32
# state is a float32 product.)
_TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _near(got: mx.array, want: mx.array, tol: float) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = max(mx.abs(want).max().item(), 1e-6)
    return mx.abs(got - want).max().item() <= tol * scale


def close(got: tuple, want: tuple) -> bool:
    """Whether ``(y, state, states)`` match: ``y`` to its dtype's rounding, the float32 states to float32's."""
    y, final, states = got
    want_y, want_final, want_states = want
    return (
        len(states) == len(want_states)
        and _near(y, want_y, _TOLERANCE[want_y.dtype])
        and _near(final, want_final, _TOLERANCE[mx.float32])
        and _near(mx.stack(states, axis=1), mx.stack(want_states, axis=1), _TOLERANCE[mx.float32])
    )


gated_delta_states = SelfChecked(
    "gated_delta_states",
    gated_delta_states_kernel,
    gated_delta_states_ops,
    shape_class=shape_class,
    example=example,
    close=close,
    supports=supports,
)
gated_delta_states.__doc__ = """The gated delta recurrence keeping every position's state (see
:func:`gated_delta_states_ops`): the Metal kernel where it checked itself at this shape class on this
machine, the twin elsewhere."""
