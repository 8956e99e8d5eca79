"""Top-p over every verified row from each row's likeliest tokens, without sorting the vocabulary:
the tokens mlx-lm's sort keeps, and the target's distribution when sampling."""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_p

from dflash_mlx import load, sampling
from dflash_mlx.sampling import make_sampler, top_p_filter


def _rows(vocab: int) -> mx.array:
    scale = mx.array([[0.5], [2.0], [8.0], [30.0], [0.01]])  # flat (a nucleus of most of the vocabulary) to sharp
    rows = mx.random.normal((5, vocab), key=mx.random.key(1)) * scale
    tied = mx.concatenate([mx.full((vocab // 2,), 1.0), mx.zeros((vocab - vocab // 2,))])[None]
    return mx.concatenate([rows, tied])  # and a row of ties across the cut


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("top", [4, 64, 256])
def test_the_tokens_kept_are_mlx_lms(top_p, top):
    logits = _rows(3000)
    for shifted in (logits - mx.logsumexp(logits, axis=-1, keepdims=True), logits - logits.max(-1, keepdims=True)):
        ours, theirs = top_p_filter(shifted, top_p, top), apply_top_p(shifted, top_p)
        assert mx.array_equal(ours == -mx.inf, theirs == -mx.inf).item()
        assert mx.array_equal(mx.where(ours == -mx.inf, 0, ours), mx.where(theirs == -mx.inf, 0, theirs)).item()


def test_a_sharp_row_never_sorts_the_vocabulary(monkeypatch):
    sorted_rows = []
    monkeypatch.setattr(sampling, "_mlx_lm_threshold", lambda x, p: sorted_rows.append(x) or mx.zeros((1, 1)))
    top_p_filter(_rows(3000)[3:4] - 50, 0.9, 256)  # a sharp row: its nucleus is a few tokens
    assert not sorted_rows
    top_p_filter(_rows(3000)[4:5], 0.9, 256)  # a flat one takes the sort
    assert len(sorted_rows) == 1


TOP_P = 0.95
TOP = 4  # of the 128 tokens: some rows' nucleus fits, most do not (a nucleus cut there is 0.12-0.26 off in TV)


@pytest.fixture(scope="module")
def pair(sampling_target, pair_dirs):
    """The shared sampling target (as test_sampling's), whose samples have real choices."""
    return load(sampling_target, pair_dirs["draft"])


@pytest.fixture(scope="module")
def exact_top_p(pair):
    from test_sampling import _exact_marginals

    # The reference: a vocabulary of 128 is within NUCLEUS_TOP, so this is mlx-lm's own sort.
    return _exact_marginals(pair[0], make_sampler(1.0, top_p=TOP_P))


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_top_p_keeps_the_targets_distribution(pair, exact_top_p, monkeypatch, broken):
    """Every row's nucleus found from its 4 likeliest of 128 tokens (rows that do not fit take the sort):
    the target's marginals. Negative control: rows that do not fit kept as if they did (a nucleus cut short)."""
    from test_sampling import CONTROL_RUNS, RUNS, _excess

    monkeypatch.setattr(sampling, "NUCLEUS_TOP", TOP)
    found, rows = sampling._nucleus_threshold, [0, 0]

    def counted(x, p, k):
        threshold, fits = found(x, p, k)
        rows[0] += fits.size
        rows[1] += fits.sum().item()
        return threshold, mx.array(True) if broken else fits

    monkeypatch.setattr(sampling, "_nucleus_threshold", counted)
    excess = _excess(pair, exact_top_p, "sample", make_sampler(1.0, top_p=TOP_P), runs=CONTROL_RUNS if broken else RUNS)
    assert (max(excess) > 0) == broken, excess
    assert broken or 0 < rows[1] < rows[0]  # both ways were taken
