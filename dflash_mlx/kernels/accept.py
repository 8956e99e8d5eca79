"""Greedy acceptance in one kernel: verify logits and drafts in, (num_accepted, bonus token) out.

The ops twin takes the argmax of every row, compares it with the drafts and counts the leading
matches: several kernels and a full read of every row. The Metal kernel reads the rows in order
with one threadgroup and stops at the first mismatch, so a block that accepts ``n`` drafts reads
``n + 1`` rows of the vocabulary.
"""

import mlx.core as mx

from .dispatch import SelfChecked

THREADS = 1024  # one threadgroup: 32 simdgroups

# Per row: each thread keeps the first maximum of its strided slice, each simdgroup reduces its
# lanes, simdgroup 0 reduces the simdgroups' partials. The lowest index wins a tie, as in argmax.
SOURCE = """
    uint tid = thread_position_in_threadgroup.x;
    uint lane = thread_index_in_simdgroup;
    uint sg = simdgroup_index_in_threadgroup;
    uint n_sg = simdgroups_per_threadgroup;
    uint n_threads = threads_per_threadgroup.x;
    int rows = logits_shape[0];
    uint V = logits_shape[1];
    int B = rows - 1;

    threadgroup float part_val[32];
    threadgroup uint part_idx[32];
    threadgroup int done;  // the row that decided the block, or -1
    threadgroup int bonus;
    if (tid == 0) { done = -1; bonus = 0; }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int r = 0; r < rows; ++r) {
        const device T* row = logits + (size_t)r * V;
        float v = -INFINITY;
        uint idx = V;  // V: none seen yet
        for (uint i = tid; i < V; i += n_threads) {
            float x = float(row[i]);
            if (x > v || idx == V) { v = x; idx = i; }
        }
        float m = simd_max(v);
        uint first = simd_min(v == m ? idx : V);
        if (lane == 0) { part_val[sg] = m; part_idx[sg] = first; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (sg == 0) {
            float pv = lane < n_sg ? part_val[lane] : -INFINITY;
            uint pi = lane < n_sg ? part_idx[lane] : V;
            float pm = simd_max(pi < V ? pv : -INFINITY);
            uint best = simd_min((pi < V && pv == pm) ? pi : V);
            if (tid == 0 && (r == B || (int)drafts[r] != (int)best)) { done = r; bonus = (int)best; }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (done >= 0) break;
    }
    if (tid == 0) { out[0] = done; out[1] = bonus; }
"""


def _make_kernel(factory):
    return factory(name="dflash_greedy_accept", input_names=["logits", "drafts"], output_names=["out"], source=SOURCE)


def greedy_accept_ops(logits: mx.array, drafts: mx.array) -> mx.array:
    """Greedy acceptance with MLX ops: the truth the kernel is checked against.

    Args:
        logits: ``(B + 1, V)`` verify logits of the block ``[last, d_1..d_B]``.
        drafts: ``(B,)`` draft tokens.

    Returns:
        ``(2,)`` int32: the number of leading drafts equal to the target's argmax (0..B) and the
        bonus token, the argmax at the first mismatch (row B when all match).
    """
    target = mx.argmax(logits, axis=-1).astype(mx.int32)  # (B + 1,)
    match = (drafts.astype(mx.int32) == target[:-1]).astype(mx.int32)
    n = mx.cumprod(match).sum()
    return mx.stack([n, target[n]]).astype(mx.int32)


def greedy_accept_kernel(logits: mx.array, drafts: mx.array, *, factory=None) -> mx.array:
    """The Metal kernel (``factory``: ``mx.fast.metal_kernel``, or the CPU harness's stand-in)."""
    if factory is None:
        factory = mx.fast.metal_kernel
    kernel = _kernel(factory)
    (out,) = kernel(
        inputs=[logits, drafts.astype(mx.int32)],
        template=[("T", logits.dtype)],
        grid=(THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(2,)],
        output_dtypes=[mx.int32],
    )
    return out


_KERNELS: dict = {}


def _kernel(factory):
    if factory not in _KERNELS:
        _KERNELS[factory] = _make_kernel(factory)
    return _KERNELS[factory]


def shape_class(logits: mx.array, drafts: mx.array) -> str:
    """What a kernel's speed depends on: the dtype, the block and the vocabulary."""
    return f"{logits.dtype}|{logits.shape[0]}x{logits.shape[1]}"


def _example(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    # Random logits of the same class whose drafts match about half the block, as a drafter might.
    # A key of its own: a check in the middle of a generation leaves the caller's random state alone.
    rows, vocab = logits.shape
    x = (mx.random.normal((rows, vocab), key=mx.random.key(0)) * 4).astype(logits.dtype)
    target = mx.argmax(x, axis=-1).astype(mx.int32)
    keep = mx.arange(rows - 1) < (rows - 1) // 2
    return x, mx.where(keep, target[:-1], (target[:-1] + 1) % vocab)


greedy_accept = SelfChecked(
    "greedy_accept",
    greedy_accept_kernel,
    greedy_accept_ops,
    shape_class=shape_class,
    example=_example,
    close=lambda a, b: a.shape == b.shape and mx.array_equal(a, b).item(),
)
greedy_accept.__doc__ = """Greedy acceptance (see :func:`greedy_accept_ops`): the Metal kernel where it
checked itself at this shape class on this machine, the MLX-ops twin elsewhere."""
