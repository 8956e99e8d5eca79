import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import LoopOptions, dflash_generate_step
from dflash_mlx.drafts.lookup import PromptLookup


def test_lookup_finds_latest_longest_match():
    draft = PromptLookup(block_size=4, max_ngram=2)
    assert draft.lookup([1, 2, 3, 9, 1, 2, 5, 6, 1, 2], 3) == [5, 6, 1]
    assert draft.lookup([7, 8, 9], 3) == []
    assert draft.lookup([4, 4], 3) == [4]


def test_lookup_evidence_says_what_the_occurrence_before_the_latest_did():
    draft = PromptLookup(block_size=4, max_ngram=2)
    # [1, 2] went on with 5 last time and with 3 the time before: the drafts are the latest's.
    assert draft.lookup_evidence([1, 2, 3, 9, 1, 2, 5, 6, 1, 2], 3) == ([5, 6, 1], 2, "differ")
    assert draft.lookup_evidence([1, 2, 5, 9, 1, 2, 5, 6, 1, 2], 3) == ([5, 6, 1], 2, "agree")
    assert draft.lookup_evidence([3, 1, 2, 5, 6, 1, 2], 3) == ([5, 6, 1], 2, "once")
    assert draft.lookup_evidence([7, 8, 9], 3) == ([], 0, "")
    # The longest suffix that occurred decides, even where a shorter one occurred more often.
    assert draft.lookup_evidence([4, 9, 4, 8, 7, 4, 9], 2) == ([4, 8], 2, "once")


def test_lookup_evidence_drafts_what_lookup_drafts():
    rng = np.random.default_rng(0)
    draft = PromptLookup(block_size=8, max_ngram=3, min_ngram=1)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(2, 40))).tolist()
        found, n, evidence = draft.lookup_evidence(tokens, 7)
        assert (found, n) == draft.lookup_match(tokens, 7)
        starts = [s for s in range(len(tokens) - n) if n and tokens[s : s + n] == tokens[-n:]]
        assert evidence == (
            ""
            if not n
            else "once"
            if len(starts) == 1
            else "agree"
            if tokens[starts[-2] + n] == tokens[starts[-1] + n]
            else "differ"
        )


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_lookup_drafting_is_lossless(qwen3_pair, block_size):
    model = qwen3_pair[0]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    steps = list(dflash_generate_step(prompt, model, PromptLookup(block_size), LoopOptions(max_tokens=60)))
    out = [t for s in steps for t in s.tokens]
    assert out == [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=60)]
    assert all(s.num_draft <= block_size - 1 for s in steps)
