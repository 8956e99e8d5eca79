"""Draft trees (DDTree: Ringel and Romano, "Accelerating Speculative Decoding with Block
Diffusion Draft Trees", arXiv 2604.12989).

One drafter pass gives a distribution for each of the block's positions. Instead of verifying
only its most likely path, the tree holds the ``budget`` most likely continuations (by the
product of the per-position probabilities, so every prefix of a kept continuation is kept too),
and the target verifies all of them in one pass: the root (the last committed token) and the
nodes, each at position ``offset + depth`` and seeing only the committed context, its ancestors
and itself. The walk then follows, from the root, the child that equals the target's own token
at each node, so the emitted tokens are the target's samples as in a path.

The target sees the tree as a batch: node ``i`` is batch row ``i``, a one-token step at its own
position (mlx-lm's layers take a per-row RoPE offset, as for batched decoding), and every row
reads the keys of the whole pass (:class:`TreeCache`) under its row of the ancestor mask. The
pass appends all nodes to each layer's cache in node order; :func:`keep_path` then moves the
accepted path's keys to consecutive positions and drops the rest.
"""

import heapq

import mlx.core as mx

from ..models.tree import DraftTree


def top_log_probs(logits: mx.array, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's ``k`` most likely ids and their log-probabilities, most likely first (one host read)."""
    logits = logits.astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.argsort(-log_probs, axis=-1)[:, :k]  # (depth, k)
    top = mx.take_along_axis(log_probs, ids, axis=-1)
    mx.eval(ids, top)
    return top.tolist(), ids.tolist()


def build_tree(log_probs: list[list[float]], ids: list[list[int]], budget: int) -> DraftTree:
    """The ``budget`` most likely continuations under a block's per-position distributions.

    Best first, as the paper's Algorithm 1: a heap of frontier candidates ordered by path
    log-probability, where popping a node pushes its next sibling (the next rank at its depth)
    and its first child (rank 0 at the next depth). Each of these scores at most its source, so
    the nodes come out in the order of their paths' probabilities and form a prefix-closed set.
    Equal scores go to the candidate whose ranks compare smaller (the reference's tie-break).
    The root is not counted in the budget.

    Args:
        log_probs: ``[depth][k]`` log-probabilities of each position's top ``k`` ids, descending.
        ids: ``[depth][k]`` those ids.
        budget: The most nodes (not counting the root).

    Returns:
        The tree, nodes in the order they were chosen: its first ``n`` nodes are the tree of
        budget ``n`` (a node of rank ``r`` comes after its ``r`` elder siblings).
    """
    depth_limit, k = len(ids), len(ids[0]) if ids else 0
    tokens, parents, depths, path_log_probs = [], [-1], [], []
    if budget <= 0 or depth_limit == 0:
        return DraftTree(tokens, parents, depths)
    # (-log w, ranks along the path, parent index, depth, rank, log w)
    heap = [(-log_probs[0][0], (0,), 0, 1, 0, log_probs[0][0])]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        path_log_probs.append(logw)
        index = len(tokens)
        if rank + 1 < k:
            sibling = logw - log_probs[depth - 1][rank] + log_probs[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = logw + log_probs[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), index, depth + 1, 0, child))
    return DraftTree(tokens, parents, depths, path_log_probs)


def build_fanout_tree(log_probs: list[list[float]], ids: list[list[int]], budget: int) -> DraftTree:
    """JetSpec's tree under a block's per-position distributions (hao-ai-lab/JetSpec, its default
    ``accum_logp``): nodes are expanded best first by path log-probability, and each expanded node gets
    all of its ``k`` children at once, the ``k`` most likely ids of the next position (the same ids
    whatever the parent). Unlike :func:`build_tree`, a node's less likely children come in with its
    likeliest, so the tree is wider near the root for the same budget. Ties go to the node made first,
    as theirs.

    Args:
        log_probs: ``[depth][k]`` log-probabilities of each position's top ``k`` ids, descending
          (``k``: their ``tree_width``).
        ids: ``[depth][k]`` those ids.
        budget: The most nodes, not counting the root (their ``budget`` counts it: theirs less one).

    Returns:
        The tree, nodes in the order they were made.
    """
    depth_limit = len(ids)
    tokens, parents, depths, path_log_probs = [], [-1], [], []
    heap, made = [(0.0, 0, 0, 0)], 0  # (-log w, order made, node index, depth); the root is node 0
    while heap and len(tokens) < budget:
        neg_logw, _, index, depth = heapq.heappop(heap)
        if depth >= depth_limit:
            continue
        for rank in range(min(len(ids[depth]), budget - len(tokens))):
            logw = -neg_logw + log_probs[depth][rank]
            tokens.append(ids[depth][rank])
            parents.append(index)
            depths.append(depth + 1)
            path_log_probs.append(logw)
            made += 1
            heapq.heappush(heap, (-logw, made, len(tokens), depth + 1))
    return DraftTree(tokens, parents, depths, path_log_probs)
