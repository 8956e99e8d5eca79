"""A quantized matmul for the verify pass's few rows: each weight word is read once for all rows.

A verify pass multiplies ``M = block_size`` rows (2..16) by every quantized weight of the target.
One simdgroup computes one output column: its lanes walk the column's packed words (MLX's affine
packing, as ``mx.quantize`` writes it: element ``j`` of a word in bits ``[bits*j, bits*(j+1))``,
one scale and bias a group), dequantize each word once and multiply it into all ``M`` rows.
The twin is ``mx.quantized_matmul``.
"""

import mlx.core as mx

from .dispatch import SelfChecked

MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64)
SIMDS_PER_GROUP = 2  # columns per threadgroup

SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint n = threadgroup_position_in_grid.x * SIMDS + simdgroup_index_in_threadgroup;
    uint N = w_shape[0];
    uint words = w_shape[1];  // per column
    uint K = x_shape[1];
    uint groups = scales_shape[1];
    if (n >= N) return;  // the whole simdgroup: an edge threadgroup's spare column

    constexpr uint PER_WORD = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    float acc[M];
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    const device uint32_t* col = w + (size_t)n * words;
    for (uint i = lane; i < words; i += 32) {
        uint word = col[i];
        uint k0 = i * PER_WORD;
        // A group holds whole words: GS is a multiple of PER_WORD.
        float s = float(scales[(size_t)n * groups + k0 / GS]);
        float b = float(biases[(size_t)n * groups + k0 / GS]);
        for (uint j = 0; j < PER_WORD; ++j) {
            float wv = s * float((word >> (BITS * j)) & MASK) + b;
            for (int m = 0; m < M; ++m) acc[m] += float(x[(size_t)m * K + k0 + j]) * wv;
        }
    }
    for (int m = 0; m < M; ++m) {
        float total = simd_sum(acc[m]);
        if (lane == 0) out[(size_t)m * N + n] = T(total);
    }
"""


def _make_kernel(factory):
    return factory(
        name="dflash_verify_qmm",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
    )


_KERNELS: dict = {}


def verify_qmm_ops(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """``x @ dequantize(w).T`` with MLX's own quantized matmul: the truth the kernel is checked against.

    Args:
        x: ``(M, K)`` rows.
        w: ``(N, K * bits / 32)`` uint32 weights packed by ``mx.quantize``.
        scales, biases: ``(N, K / group_size)``.
        group_size, bits: The quantization (32 or 64; 4 or 8).

    Returns:
        ``(M, N)`` in ``x``'s dtype.
    """
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def verify_qmm_kernel(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, *, factory=None
) -> mx.array:
    """The Metal kernel (``factory``: ``mx.fast.metal_kernel``, or the CPU harness's stand-in).

    Takes what :func:`verify_qmm_ops` takes, with ``M <= 16``, ``bits`` 4 or 8 and
    ``group_size`` 32 or 64; the dispatcher sends anything else to the twin.
    """
    if factory is None:
        factory = mx.fast.metal_kernel
    if factory not in _KERNELS:
        _KERNELS[factory] = _make_kernel(factory)
    M, N = x.shape[0], w.shape[0]
    (out,) = _KERNELS[factory](
        inputs=[x, w, scales.astype(x.dtype), biases.astype(x.dtype)],
        template=[("T", x.dtype), ("M", M), ("BITS", bits), ("GS", group_size), ("SIMDS", SIMDS_PER_GROUP)],
        grid=(32 * N, 1, 1),
        threadgroup=(32 * SIMDS_PER_GROUP, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return out


def supports(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> bool:
    """Whether the kernel handles these inputs (else the twin runs)."""
    return (
        x.ndim == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and bits in BITS
        and group_size in GROUP_SIZES
        and w.dtype == mx.uint32
        and x.shape[1] == w.shape[1] * 32 // bits
        and x.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def shape_class(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> str:
    """What a kernel's speed depends on: dtype, rows, the weight's shape and its quantization."""
    return f"{x.dtype}|M{x.shape[0]}|{w.shape[0]}x{x.shape[1]}|{bits}bit|g{group_size}"


def _example(x, w, scales, biases, group_size, bits) -> tuple:
    key_w, key_x = mx.random.split(mx.random.key(0))  # the caller's random state is left alone
    weight = mx.random.normal((w.shape[0], x.shape[1]), key=key_w) * 0.05
    wq, s, b = mx.quantize(weight, group_size=group_size, bits=bits)
    rows = mx.random.normal(x.shape, key=key_x).astype(x.dtype)
    return rows, wq, s.astype(x.dtype), b.astype(x.dtype), group_size, bits


def verify_qmm_reference(x, w, scales, biases, group_size, bits) -> mx.array:
    """The twin computed in float32, rounded once to ``x``'s dtype: what a kernel that
    accumulates in float32 should give. (MLX's CPU quantized matmul rounds its running sums in
    bfloat16, off by several percent on a row of 2048.)"""
    f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
    return verify_qmm_ops(f32[0], w, f32[1], f32[2], group_size, bits).astype(x.dtype)


# Largest error allowed, relative to the largest output: the summation order, plus one rounding
# of the output and of the inputs' products in a half dtype.
_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def close(got: mx.array, want: mx.array) -> bool:
    """Whether ``got`` equals ``want`` up to the dtype's rounding (see ``_TOLERANCE``)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    tol = _TOLERANCE[want.dtype]
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = max(mx.abs(want).max().item(), 1e-6)
    return mx.abs(got - want).max().item() <= tol * scale


verify_qmm = SelfChecked(
    "verify_qmm",
    verify_qmm_kernel,
    verify_qmm_ops,
    shape_class=shape_class,
    example=_example,
    close=close,
    reference=verify_qmm_reference,
    supports=supports,
)
verify_qmm.__doc__ = """``x @ dequantize(w).T`` for a verify pass (see :func:`verify_qmm_ops`): the Metal
kernel where it checked itself at this shape class on this machine, the twin elsewhere."""
