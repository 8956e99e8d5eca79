import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import dflash_generate_step, LoopOptions
from dflash_mlx.lookup import PromptLookup


def test_lookup_finds_latest_longest_match():
    draft = PromptLookup(block_size=4, max_ngram=2)
    assert draft.lookup([1, 2, 3, 9, 1, 2, 5, 6, 1, 2], 3) == [5, 6, 1]
    assert draft.lookup([7, 8, 9], 3) == []
    assert draft.lookup([4, 4], 3) == [4]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_lookup_drafting_is_lossless(qwen3_pair, block_size):
    model = qwen3_pair[0]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    steps = list(dflash_generate_step(prompt, model, PromptLookup(block_size), LoopOptions(max_tokens=60)))
    out = [t for s in steps for t in s.tokens]
    assert out == [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=60)]
    assert all(s.num_draft <= block_size - 1 for s in steps)
