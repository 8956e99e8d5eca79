"""A short check that sampled generation keeps the target's distribution: the first few tokens' counts
over seeded runs against the target's exact marginals (tests/test_sampling.py's method, fewer runs)."""

import mlx.core as mx
import numpy as np

from dflash_mlx.sampling import make_sampler

from .checkpoints import VOCAB
from .decoding import run

PROMPT = [3, 17, 42, 8, 99]
RUNS = 200


def marginals(model, sampler, depth: int = 3) -> list[np.ndarray]:
    """p(x_1), ..., p(x_depth) of the target after ``PROMPT``, enumerating the prefixes of probability
    over 1e-6 (the rest, whose mass is checked to be negligible, left out)."""
    out, prefixes, joint, dropped = [], [[]], np.ones(1), 0.0
    for k in range(depth):
        probs = np.array(sampler.probs(model(mx.array([PROMPT + p for p in prefixes]))[:, -1])) * joint[:, None]
        out.append(probs.sum(axis=0))
        if k + 1 < depth:
            keep = probs > 1e-6
            dropped += probs[~keep].sum()
            rows, cols = np.nonzero(keep)
            prefixes, joint = [prefixes[r] + [int(c)] for r, c in zip(rows, cols)], probs[keep]
    assert dropped < 1e-3, dropped
    return out


def excess(model, drafter, exact: list[np.ndarray], temp: float, runs: int = RUNS) -> list[float]:
    """Per position, the TV distance of the sampled tokens from ``exact`` minus the distance ``runs``
    exact samples stay under 99.9% of the time: all negative for a correct sampler. Blocks of 3 (two
    drafts: the second draft is the third token, the first coming from the prefill)."""
    from test_sampling import _tv, _tv_bound

    depth = len(exact)
    counts = np.zeros((depth, VOCAB))
    for seed in range(runs):
        out, _ = run(model, drafter, PROMPT, sampler=make_sampler(temp), seed=seed, block_size=3, max_tokens=depth)
        counts[np.arange(depth), out] += 1
    return [_tv(counts[p], exact[p]) - _tv_bound(exact[p], runs) for p in range(depth)]
