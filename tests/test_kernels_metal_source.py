"""Each Metal kernel's own source, run on the CPU by the harness, against its MLX-ops twin; and
planted bugs (an index off by one, a removed barrier or reduction) that the comparison must catch. The
``metal`` tests run the real kernels through ``mx.fast.metal_kernel`` on a Mac."""

import mlx.core as mx
import pytest

from dflash_mlx.kernels import accept, gdn, gdn_tree, harness, qmm
from dflash_mlx.kernels.dispatch import on_metal

needs_compiler = pytest.mark.skipif(harness.compiler_missing() is not None, reason=str(harness.compiler_missing()))
needs_metal = pytest.mark.skipif(not on_metal(), reason="needs an Apple GPU: MLX's default device is not Metal")

HALF_TYPES = [mx.float32, mx.float16, mx.bfloat16]


def _block(rows: int, vocab: int, num_accepted: int, dtype, seed: int) -> tuple[mx.array, mx.array]:
    """Logits whose row maxima sit on the edges of the vocabulary and of the threads' tiles, with
    ties (the lowest index must win), and drafts that match the first ``num_accepted`` rows."""
    key = mx.random.key(seed)
    x = mx.random.normal((rows, vocab), key=key)
    spots = [0, vocab - 1, min(1023, vocab - 1), min(1024, vocab - 1), vocab // 2]
    for r in range(rows):
        spot = spots[r % len(spots)]
        x[r, spot] = 10.0
        if r % 3 == 2 and spot + 1 < vocab:
            x[r, spot + 1] = 10.0  # a tie: argmax is the first
    x = x.astype(dtype)
    target = mx.argmax(x, axis=-1).astype(mx.int32)
    drafts = mx.where(mx.arange(rows - 1) < num_accepted, target[:-1], (target[:-1] + 1) % vocab)
    return x, drafts


def _accept_on_cpu(logits, drafts, source=accept.SOURCE):
    kernel = harness.cpu_metal_kernel("greedy_accept_test", ["logits", "drafts"], ["out"], source)
    (out,) = kernel(
        inputs=[logits, drafts.astype(mx.int32)],
        template=[("T", logits.dtype)],
        grid=(accept.THREADS, 1, 1),
        threadgroup=(accept.THREADS, 1, 1),
        output_shapes=[(2,)],
        output_dtypes=[mx.int32],
    )
    return out


@needs_compiler
@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 1), (2, 31), (5, 1024), (9, 1025), (17, 3001)])
def test_greedy_accept_source_matches_twin(rows, vocab, dtype):
    for num_accepted in sorted({0, (rows - 1) // 2, rows - 1}):
        logits, drafts = _block(rows, vocab, num_accepted, dtype, seed=rows * vocab + num_accepted)
        want = accept.greedy_accept_ops(logits, drafts)
        assert want[0].item() == num_accepted
        got = accept.greedy_accept_kernel(logits, drafts, factory=harness.cpu_metal_kernel)
        assert got.tolist() == want.tolist()


@needs_compiler
def test_greedy_accept_source_on_random_logits():
    for seed in range(4):
        logits = mx.random.normal((16, 777), key=mx.random.key(seed))
        target = mx.argmax(logits, axis=-1).astype(mx.int32)
        drafts = mx.where(mx.random.uniform(shape=(15,), key=mx.random.key(100 + seed)) < 0.8, target[:-1], 0)
        got = accept.greedy_accept_kernel(logits, drafts, factory=harness.cpu_metal_kernel)
        assert got.tolist() == accept.greedy_accept_ops(logits, drafts).tolist()


def _planted(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"the planted bug's anchor {old!r} is not in the source once"
    return source.replace(old, new)


@needs_compiler
def test_greedy_accept_index_off_by_one_is_caught():
    # Each thread starts its slice one element late: the maxima planted at index 0 are missed.
    bug = _planted(accept.SOURCE, "for (uint i = tid;", "for (uint i = tid + 1;")
    logits, drafts = _block(6, 2000, 5, mx.float32, seed=1)
    assert _accept_on_cpu(logits, drafts).tolist() == accept.greedy_accept_ops(logits, drafts).tolist()
    assert _accept_on_cpu(logits, drafts, bug).tolist() != accept.greedy_accept_ops(logits, drafts).tolist()


@needs_compiler
def test_greedy_accept_missing_barrier_is_caught():
    # Without the barrier, simdgroup 0 reads the other simdgroups' partial maxima before they are written.
    write = "if (lane == 0) { part_val[sg] = m; part_idx[sg] = first; }"
    bug = _planted(accept.SOURCE, write + "\n        threadgroup_barrier(mem_flags::mem_threadgroup);", write)
    logits, drafts = _block(6, 2000, 3, mx.float32, seed=2)
    assert _accept_on_cpu(logits, drafts, bug).tolist() != accept.greedy_accept_ops(logits, drafts).tolist()


@needs_compiler
def test_barrier_not_every_thread_reaches_is_an_error():
    bug = _planted(accept.SOURCE, "if (done >= 0) break;", "if (done >= 0) break;\n        if (tid == 40) return;")
    logits, drafts = _block(6, 2000, 3, mx.float32, seed=3)
    with pytest.raises(harness.KernelError, match="not reached by every thread"):
        _accept_on_cpu(logits, drafts, bug)


@needs_compiler
def test_simd_calls_on_different_lines_are_an_error():
    source = """
    uint lane = thread_index_in_simdgroup;
    float v = x[thread_position_in_grid.x];
    if (lane < 16) {
        v = simd_sum(v);
    } else {
        v = simd_max(v);
    }
    out[thread_position_in_grid.x] = v;
    """
    kernel = harness.cpu_metal_kernel("divergent_simd", ["x"], ["out"], source)
    with pytest.raises(harness.KernelError, match="different source lines"):
        kernel(
            inputs=[mx.ones((32,))],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(32,)],
            output_dtypes=[mx.float32],
        )


@needs_compiler
def test_harness_threads_and_simd_ops():
    # A tree reduction in threadgroup memory over edge-sized groups, simd shuffles, and the ids.
    source = """
    uint t = thread_position_in_threadgroup.x;
    uint n = threads_per_threadgroup.x;
    uint g = thread_position_in_grid.x;
    threadgroup float buf[128];
    buf[t] = x[g];
    for (uint stride = 64; stride > 0; stride /= 2) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (t < stride && t + stride < n) buf[t] += buf[t + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t == 0) sums[threadgroup_position_in_grid.x] = buf[0];
    down[g] = simd_shuffle_down(x[g], 1);
    xr[g] = simd_shuffle_xor(x[g], 3);
    lanes[g] = thread_index_in_simdgroup + 100 * simdgroup_index_in_threadgroup;
    """
    kernel = harness.cpu_metal_kernel("tree_sum", ["x"], ["sums", "down", "xr", "lanes"], source)
    x = mx.arange(300).astype(mx.float32)
    sums, down, xr, lanes = kernel(
        inputs=[x],
        grid=(300, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(3,), (300,), (300,), (300,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, mx.uint32],
    )
    assert sums.tolist() == [sum(range(0, 128)), sum(range(128, 256)), sum(range(256, 300))]
    g = list(range(300))
    # The last group holds 44 threads: a simdgroup of 32 and one of 12 lanes.
    size = lambda i: 12 if i >= 288 else 32  # noqa: E731
    want_down = [i + 1 if (i % 128) % 32 + 1 < size(i) else i for i in g]
    assert down.tolist() == want_down
    want_xr = [i ^ 3 if ((i % 128) % 32 ^ 3) < size(i) else i for i in g]
    assert xr.tolist() == want_xr
    assert lanes.tolist() == [(i % 128) % 32 + 100 * ((i % 128) // 32) for i in g]


@needs_compiler
def test_unwritten_output_reads_as_poison():
    source = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = x[0];"
    kernel = harness.cpu_metal_kernel("half_write", ["x"], ["out"], source)
    launch = dict(grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32])
    (out,) = kernel(inputs=[mx.zeros((1,))], **launch)
    assert out[0].item() == 0.0 and out[1].item() > 1e38
    (out,) = kernel(inputs=[mx.zeros((1,))], init_value=-1.0, **launch)
    assert out.tolist() == [0.0, -1.0, 0.0, -1.0]


def _quantized(M, N, K, bits, group_size, dtype, seed):
    key_w, key_x = mx.random.split(mx.random.key(seed))
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=key_w) * 0.1, group_size=group_size, bits=bits)
    x = mx.random.normal((M, K), key=key_x).astype(dtype)
    return x, w, scales.astype(dtype), biases.astype(dtype), group_size, bits


# Odd N leaves the last threadgroup one simdgroup; K / (32 / bits) words not a multiple of 32 lanes.
QMM_CASES = [
    (2, 5, 64, 4, 32, mx.float32),
    (5, 3, 320, 4, 64, mx.float32),
    (16, 7, 192, 8, 64, mx.float32),
    (3, 9, 96, 8, 32, mx.float32),
    (4, 11, 512, 4, 32, mx.float16),
    (8, 6, 256, 8, 64, mx.bfloat16),
]


@needs_compiler
@pytest.mark.parametrize("M, N, K, bits, group_size, dtype", QMM_CASES)
def test_verify_qmm_source_matches_twin(M, N, K, bits, group_size, dtype):
    args = _quantized(M, N, K, bits, group_size, dtype, seed=M * N + K)
    got = qmm.verify_qmm_kernel(*args, factory=harness.cpu_metal_kernel)
    assert qmm.close(got, qmm.verify_qmm_reference(*args))
    if dtype == mx.float32:
        assert qmm.close(got, qmm.verify_qmm_ops(*args))


@needs_compiler
def test_verify_qmm_index_off_by_one_is_caught():
    # The unpacking loop stops one element short of each word.
    bug = _planted(qmm.SOURCE, "for (uint j = 0; j < PER_WORD; ++j)", "for (uint j = 0; j + 1 < PER_WORD; ++j)")
    args = _quantized(3, 5, 128, 4, 32, mx.float32, seed=7)
    kernel = harness.cpu_metal_kernel("verify_qmm_test", ["x", "w", "scales", "biases"], ["out"], bug)
    (got,) = kernel(
        inputs=list(args[:4]),
        template=[("T", mx.float32), ("M", 3), ("BITS", 4), ("GS", 32), ("SIMDS", qmm.SIMDS_PER_GROUP)],
        grid=(32 * 5, 1, 1),
        threadgroup=(32 * qmm.SIMDS_PER_GROUP, 1, 1),
        output_shapes=[(3, 5)],
        output_dtypes=[mx.float32],
    )
    assert not qmm.close(got, qmm.verify_qmm_ops(*args))


@pytest.mark.parametrize("M, bits, group_size", [(1, 4, 32), (16, 8, 64), (17, 4, 32), (4, 3, 32), (4, 4, 128)])
def test_verify_qmm_supports(M, bits, group_size):
    x = mx.zeros((M, 128))
    w = mx.zeros((8, 128 * bits // 32), dtype=mx.uint32)
    expected = M <= 16 and bits in (4, 8) and group_size in (32, 64)
    assert qmm.supports(x, w, None, None, group_size, bits) == expected


def _recurrence(B, T, Hk, Dk, Hv, Dv, dtype, seed):
    """Inputs of the gated delta recurrence as a layer gives them (``gdn.example``'s), per seed."""
    like = (mx.zeros((B, T, Hk, Dk), dtype=dtype),) * 2 + (mx.zeros((B, T, Hv, Dv), dtype=dtype),)
    args = gdn.example(*like, mx.zeros((B, T, Hv)), mx.zeros((B, T, Hv), dtype=dtype), mx.zeros((B, Hv, Dv, Dk)))
    noise = mx.random.normal((B, Hv, Dv, Dk), key=mx.random.key(seed))
    return (*args[:5], args[5] + 0.1 * noise)


def _recurrence_on_cpu(args, source=gdn.SOURCE):
    q, k, v, g, beta, state = args
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    kernel = harness.cpu_metal_kernel("gdn_test", ["q", "k", "v", "g", "beta", "state_in"],
                                      ["y", "state_out", "states"], source)  # fmt: skip
    y, final, states = kernel(
        inputs=list(args),
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, gdn.ROWS_PER_GROUP, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype, state.dtype],
    )
    return y, final, [states[:, t] for t in range(T)]


# (B, T, Hk, Dk, Hv, Dv, dtype): one position; Dk under, over and not a multiple of 32 lanes; Dv
# not a multiple of the threadgroup's 4 rows (an edge threadgroup); Hv = 1, 2, 4 x Hk; two rows.
GDN_CASES = [
    (1, 1, 1, 32, 1, 1, mx.float32),
    (1, 5, 2, 40, 4, 7, mx.float32),
    (1, 16, 2, 16, 4, 16, mx.float32),
    (2, 16, 2, 128, 2, 6, mx.float32),
    (1, 3, 1, 16, 2, 5, mx.bfloat16),
    (1, 8, 2, 64, 4, 9, mx.float16),
]


@needs_compiler
@pytest.mark.parametrize("B, T, Hk, Dk, Hv, Dv, dtype", GDN_CASES)
def test_gated_delta_states_source_matches_twin(B, T, Hk, Dk, Hv, Dv, dtype):
    args = _recurrence(B, T, Hk, Dk, Hv, Dv, dtype, seed=T * Dk + Dv)
    got = gdn.gated_delta_states_kernel(*args, factory=harness.cpu_metal_kernel)
    want = gdn.gated_delta_states_ops(*args)
    assert gdn.close(got, want)
    assert len(got[2]) == T and mx.array_equal(got[2][-1], got[1]).item()


@needs_compiler
def test_gated_delta_states_source_on_random_shapes():
    # Ranges of B, T, Hk, Dk, Hv / Hk and Dv.
    ranges = [(1, 3), (1, 17), (1, 3), (1, 97), (1, 3), (1, 11)]
    for seed in range(4):
        keys = mx.random.split(mx.random.key(seed), len(ranges))
        B, T, Hk, Dk, group, Dv = (mx.random.randint(lo, hi, (), key=k).item() for k, (lo, hi) in zip(keys, ranges))
        args = _recurrence(B, T, Hk, Dk, Hk * group, Dv, mx.float32, seed=seed)
        got = gdn.gated_delta_states_kernel(*args, factory=harness.cpu_metal_kernel)
        assert gdn.close(got, gdn.gated_delta_states_ops(*args)), (B, T, Hk, Dk, Hk * group, Dv)


@needs_compiler
@pytest.mark.parametrize(
    "old, new",
    [
        # An index off by one: each row reads the next row's value (the last, the next head's).
        ("static_cast<float>(v_[dv_idx])", "static_cast<float>(v_[dv_idx + 1])"),
        # The kept state one position early: written before the step's update (y is still right).
        (
            "s[i] = s[i] + static_cast<float>(k_[d]) * delta;\n"
            "                out += s[i] * static_cast<float>(q_[d]);\n"
            "                s_all[d] = static_cast<StT>(s[i]);",
            "s_all[d] = static_cast<StT>(s[i]);\n"
            "                s[i] = s[i] + static_cast<float>(k_[d]) * delta;\n"
            "                out += s[i] * static_cast<float>(q_[d]);",
        ),
        # A removed reduction: each lane reads kv_mem from its own slice of the key only.
        ("kv_mem = simd_sum(kv_mem);", ""),
    ],
    ids=["value-row-off-by-one", "state-one-position-early", "no-simd-sum"],
)
def test_gated_delta_states_planted_bugs_are_caught(old, new):
    # The kernel shares nothing through threadgroup memory (each row is one simdgroup's), so it
    # has no barrier to remove; its cross-lane step is the reduction.
    args = _recurrence(1, 6, 2, 40, 4, 8, mx.float32, seed=3)
    want = gdn.gated_delta_states_ops(*args)
    assert gdn.close(_recurrence_on_cpu(args), want)
    assert not gdn.close(_recurrence_on_cpu(args, _planted(gdn.SOURCE, old, new)), want)


def _tree(parents, Hk, Dk, Hv, Dv, dtype, seed):
    """The tree recurrence's inputs for the nodes of ``parents``, as a layer gives them (``_recurrence``'s)."""
    q, k, v, g, beta, state = _recurrence(1, len(parents), Hk, Dk, Hv, Dv, dtype, seed)
    return q[0], k[0], v[0], g[0], beta[0], state, list(parents)


def _tree_on_cpu(args, source=gdn_tree.SOURCE):
    # The kernel's own launch, its source swapped for a planted bug's.
    def factory(**kwargs):
        return harness.cpu_metal_kernel(**{**kwargs, "source": source})

    return gdn_tree.gated_delta_tree_kernel(*args, factory=factory)


CHAIN_7 = [-1, 0, 1, 2, 3, 4, 5]
STAR_9 = [-1] + [0] * 8
# Two chains off the root and a branch off each, as a draft tree of a few top-k choices grows.
FORK_11 = [-1, 0, 1, 2, 0, 4, 5, 1, 7, 4, 9]

# (parents, Hk, Dk, Hv, Dv, dtype): the root alone; a chain, a star and branching trees; node counts
# (1, 7, 9, 11, 13, 23) that are multiples of neither the 32 lanes nor the 4 rows of a threadgroup;
# Dk under, over and not a multiple of 32; Dv an edge threadgroup; Hv = 1, 2, 3, 4 x Hk.
TREE_CASES = [
    ([-1], 1, 32, 1, 1, mx.float32),
    (CHAIN_7, 2, 40, 4, 7, mx.float32),
    (STAR_9, 1, 16, 2, 5, mx.float32),
    (FORK_11, 2, 128, 2, 6, mx.float32),
    ("random13", 2, 64, 4, 9, mx.float32),
    ("random23", 1, 97, 3, 11, mx.float32),
    (STAR_9, 1, 16, 2, 5, mx.bfloat16),
    (FORK_11, 1, 48, 2, 5, mx.bfloat16),
    (CHAIN_7, 2, 64, 4, 9, mx.float16),
    ("random13", 2, 64, 4, 9, mx.float16),
]


@needs_compiler
@pytest.mark.parametrize("parents, Hk, Dk, Hv, Dv, dtype", TREE_CASES)
def test_gated_delta_tree_source_matches_twin(parents, Hk, Dk, Hv, Dv, dtype):
    if isinstance(parents, str):
        n = int(parents.removeprefix("random"))
        parents = gdn_tree.random_parents(n, mx.random.key(n))
        assert any(p != i - 1 for i, p in enumerate(parents))  # it branches
    args = _tree(parents, Hk, Dk, Hv, Dv, dtype, seed=len(parents) * Dk + Dv)
    assert gdn_tree.supports(*args)
    got = gdn_tree.gated_delta_tree_kernel(*args, factory=harness.cpu_metal_kernel)
    want = gdn_tree.gated_delta_tree_ops(*args)
    assert got[0].dtype == dtype and [s.shape for s in got[1]] == [(1, Hv, Dv, Dk)] * len(parents)
    assert gdn_tree.close(got, want)


@needs_compiler
def test_gated_delta_tree_source_on_random_trees_and_shapes():
    # Ranges of N, Hk, Dk, Hv / Hk and Dv.
    ranges = [(1, 41), (1, 3), (1, 97), (1, 3), (1, 11)]
    for seed in range(4):
        keys = mx.random.split(mx.random.key(seed), len(ranges) + 1)
        N, Hk, Dk, group, Dv = (mx.random.randint(lo, hi, (), key=k).item() for k, (lo, hi) in zip(keys, ranges))
        args = _tree(gdn_tree.random_parents(N, keys[-1]), Hk, Dk, Hk * group, Dv, mx.float32, seed=seed)
        got = gdn_tree.gated_delta_tree_kernel(*args, factory=harness.cpu_metal_kernel)
        assert gdn_tree.close(got, gdn_tree.gated_delta_tree_ops(*args)), (N, Hk, Dk, Hk * group, Dv)


@needs_compiler
def test_gated_delta_tree_source_reads_the_parents():
    # A negative control: the same nodes walked as a chain give other states than the tree, so a
    # kernel that ignored the parents (every node continuing the node before) would fail the test.
    q, k, v, g, beta, state, tree = _tree(FORK_11, 2, 40, 4, 7, mx.float32, seed=1)
    chain = list(range(-1, len(tree) - 1))
    want = gdn_tree.gated_delta_tree_ops(q, k, v, g, beta, state, tree)
    as_chain = gdn_tree.gated_delta_tree_kernel(q, k, v, g, beta, state, chain, factory=harness.cpu_metal_kernel)
    assert gdn_tree.close(as_chain, gdn_tree.gated_delta_tree_ops(q, k, v, g, beta, state, chain))
    assert not gdn_tree.close(as_chain, want)
    # Where the chain and the tree agree (the root's first path, nodes 0..3), so do the states.
    assert mx.allclose(mx.concatenate(as_chain[1][:4]), mx.concatenate(want[1][:4]), atol=1e-5).item()


@needs_compiler
@pytest.mark.parametrize(
    "old, new",
    [
        # Parents ignored: every node continues the node before it, as on a path.
        ("if (p != n - 1) {", "if (false) {"),
        # Every branch restarted from the state before the root instead of its parent's.
        ("p < 0 ? state_in + row : states + p * NODE + row", "state_in + row"),
        # A parent's state read one node late (the parent's first child, or a node not yet written).
        ("states + p * NODE + row", "states + (p + 1) * NODE + row"),
        # A removed reduction: each lane reads kv_mem from its own slice of the key only.
        ("kv_mem = simd_sum(kv_mem);", ""),
    ],
    ids=["parents-ignored", "branch-from-root-state", "parent-off-by-one", "no-simd-sum"],
)
def test_gated_delta_tree_planted_bugs_are_caught(old, new):
    args = _tree(FORK_11, 2, 40, 4, 8, mx.float32, seed=3)
    want = gdn_tree.gated_delta_tree_ops(*args)
    assert gdn_tree.close(_tree_on_cpu(args), want)
    assert not gdn_tree.close(_tree_on_cpu(args, _planted(gdn_tree.SOURCE, old, new)), want)


def test_gated_delta_tree_supports():
    args = _tree(FORK_11, 1, 16, 2, 4, mx.float32, seed=0)
    assert gdn_tree.supports(*args)
    for parents in ([], [0] + FORK_11[1:], [-1, 0, 3, 1] + FORK_11[4:], [-1, 0, -1] + FORK_11[3:], FORK_11[:-1]):
        assert not gdn_tree.supports(*args[:6], parents), parents
    assert not gdn_tree.supports(*args[:5], args[5].astype(mx.float16), FORK_11)


@pytest.mark.parametrize("M, N, K, bits, group_size, dtype", QMM_CASES[:1] + QMM_CASES[-2:])
@pytest.mark.metal
@needs_metal
def test_verify_qmm_kernel_on_metal(M, N, K, bits, group_size, dtype):
    args = _quantized(M, N, K, bits, group_size, dtype, seed=M * N + K)
    assert qmm.close(qmm.verify_qmm_kernel(*args), qmm.verify_qmm_reference(*args))


@pytest.mark.parametrize("rows, vocab", [(1, 1), (9, 1025), (16, 151936)])
@pytest.mark.metal
@needs_metal
def test_greedy_accept_kernel_on_metal(rows, vocab):
    for dtype in HALF_TYPES:
        for num_accepted in sorted({0, (rows - 1) // 2, rows - 1}):
            logits, drafts = _block(rows, vocab, num_accepted, dtype, seed=rows + num_accepted)
            want = accept.greedy_accept_ops(logits, drafts)
            assert accept.greedy_accept_kernel(logits, drafts).tolist() == want.tolist()


@pytest.mark.parametrize("B, T, Hk, Dk, Hv, Dv, dtype", GDN_CASES + [(1, 16, 16, 128, 32, 128, mx.bfloat16)])
@pytest.mark.metal
@needs_metal
def test_gated_delta_states_kernel_on_metal(B, T, Hk, Dk, Hv, Dv, dtype):
    args = _recurrence(B, T, Hk, Dk, Hv, Dv, dtype, seed=T * Dk + Dv)
    assert gdn.close(gdn.gated_delta_states_kernel(*args), gdn.gated_delta_states_ops(*args))


@pytest.mark.parametrize("parents, Hk, Dk, Hv, Dv, dtype", TREE_CASES + [("random65", 16, 128, 32, 128, mx.bfloat16)])
@pytest.mark.metal
@needs_metal
def test_gated_delta_tree_kernel_on_metal(parents, Hk, Dk, Hv, Dv, dtype):
    if isinstance(parents, str):
        n = int(parents.removeprefix("random"))
        parents = gdn_tree.random_parents(n, mx.random.key(n))
    args = _tree(parents, Hk, Dk, Hv, Dv, dtype, seed=len(parents) * Dk + Dv)
    assert gdn_tree.close(gdn_tree.gated_delta_tree_kernel(*args), gdn_tree.gated_delta_tree_ops(*args))


@pytest.mark.metal
@needs_metal
def test_dispatchers_check_themselves_on_metal(tmp_path):
    from dflash_mlx.kernels.dispatch import KernelStore

    for dispatcher, args in [
        (accept.greedy_accept, _block(16, 32000, 7, mx.bfloat16, seed=0)),
        (qmm.verify_qmm, _quantized(16, 4096, 4096, 4, 64, mx.bfloat16, seed=0)),
        (gdn.gated_delta_states, _recurrence(1, 16, 16, 128, 32, 128, mx.bfloat16, seed=0)),
        (
            gdn_tree.gated_delta_tree,
            _tree(gdn_tree.random_parents(17, mx.random.key(0)), 16, 128, 32, 128, mx.bfloat16, seed=0),
        ),  # fmt: skip
    ]:
        fresh = dispatcher.with_store(KernelStore(tmp_path / "kernels.json"))
        verdict = fresh.verdict(*args)
        print(dispatcher.name, verdict)
        assert "differs" not in verdict.reason and "failed" not in verdict.reason


@needs_compiler
@pytest.mark.parametrize("block_size", [4, 16])
def test_generation_with_the_emulated_kernel_is_lossless(qwen3_pair, block_size, monkeypatch, tmp_path):
    """The loop's greedy acceptance through a dispatcher that enabled the kernel (run here by the
    harness): still the target's own greedy output, with every kind of acceptance."""
    from helpers.checkpoints import VOCAB
    from helpers.decoding import run
    from helpers.emulated import emulated_dispatcher
    from helpers.oracles import ScriptedDraft
    from mlx_lm.generate import generate_step

    from dflash_mlx.loop import verify

    dispatcher, calls = emulated_dispatcher(
        "greedy_accept", accept.greedy_accept_kernel, accept.greedy_accept_ops, tmp_path,
        shape_class=accept.shape_class, example=accept.greedy_accept.example, close=accept.greedy_accept.close,
    )  # fmt: skip
    monkeypatch.setattr(verify, "greedy_accept", dispatcher)
    model, draft, _ = qwen3_pair
    prompt = mx.random.randint(0, VOCAB - 4, (7,), key=mx.random.key(3)).tolist()
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=60)]
    mixed = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3)
    seen = set()
    for drafter in (draft, mixed):
        calls.clear()
        out, cycles = run(model, drafter, prompt, block_size=block_size, max_tokens=60)
        assert out == ref
        # Past each shape class's check, only the kernel runs.
        assert calls.count("kernel") > calls.count("twin")
        seen |= {s.num_accepted for s in cycles[1:]}
    assert all(v.enabled for v in dispatcher.verdicts.values())
    assert 0 in seen and len(seen) >= 3
