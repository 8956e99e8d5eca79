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


# Negative controls, each run on a family's own drafter: the check above must fail them.
# Runs of a negative control: each fails by far more than its bound there (a q stated from the wrong slot by 0.15
# of TV and more at 100 runs, every draft accepted by 0.5 and more at 50).
CONTROL_RUNS = 100
ACCEPT_RUNS = 50


def always_accept(monkeypatch) -> None:
    """Broken on purpose: every draft accepted, whatever the target's distribution says."""
    from dflash_mlx.loop import verify
    from dflash_mlx.sampling import speculative_accept

    monkeypatch.setattr(verify, "accept_one_hot", lambda d, t: mx.ones(d.shape, dtype=mx.bool_))
    monkeypatch.setattr(
        verify, "speculative_accept", lambda d, q, p: (mx.ones(d.shape, dtype=mx.bool_), speculative_accept(d, q, p)[1])
    )


def q_from_the_anchor_slot(draft, monkeypatch, temp: float):
    """Broken on purpose: ``draft`` (of any family) drawing its drafts from slots 1.. as it should, but
    stating each one's distribution ``q`` from the slot before it, the anchor's first (the slicing
    JetSpec's ``draft_shift`` selects; a drafter read with the wrong slot offset)."""
    from dflash_mlx.drafts import proposer
    from dflash_mlx.sampling import sample_rows

    drawn = {}

    class AnchorSlotQ(type(draft)):
        def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
            h = self.block_hidden(model, block, taps, cache, speedups)
            n = num_drafts or h.shape[1] - 1
            drawn["logits"] = self.logits(model, h[0, 1 : 1 + n])
            return self.logits(model, h[:, :n])

    sampler = make_sampler(temp)
    monkeypatch.setattr(proposer, "sample_rows", lambda q: sample_rows(sampler.probs(drawn["logits"][: q.shape[0]])))
    broken = AnchorSlotQ(draft.args)
    broken.update(draft.parameters())
    return broken


def check_with_controls(model, draft, exact: list[np.ndarray], temp: float, broken: str | None, monkeypatch) -> None:
    """Sampled drafts from ``draft`` keep the target's distribution (``broken`` None); the same check
    fails with every draft accepted (``"accept"``) or with ``q`` stated from the wrong slot (``"q"``)."""
    if broken == "accept":
        always_accept(monkeypatch)
    elif broken == "q":
        draft = q_from_the_anchor_slot(draft, monkeypatch, temp)
    result = excess(model, draft, exact, temp, runs={None: RUNS, "accept": ACCEPT_RUNS}.get(broken, CONTROL_RUNS))
    assert (max(result) > 0) == (broken is not None), (broken, result)
