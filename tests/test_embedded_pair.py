"""The shipped default pair: it loads offline, and DFlash reproduces its target's greedy output."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import dflash_generate_step, load
from dflash_mlx.benchmark import encode, load_prompts
from dflash_mlx.loading import default_pair_path

PAIR = default_pair_path()


@pytest.fixture(scope="module")
def pair():
    return load(dtype="float32")


def test_loads_offline_with_its_drafter(pair):
    model, draft, tokenizer = pair
    assert draft is not None and draft.block_size == 16
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)


@pytest.mark.parametrize("index", [0, 2])
def test_dflash_equals_its_own_greedy_output(pair, index):
    model, draft, tokenizer = pair
    row = load_prompts(PAIR / "prompts.jsonl")[index]
    ids = encode(tokenizer, row)
    steps = list(dflash_generate_step(ids, model, draft, max_tokens=96, stop_tokens=tokenizer.eos_token_ids))
    out = [t for s in steps for t in s.tokens]
    ref = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=96):
        ref.append(int(tok))
        if tok in tokenizer.eos_token_ids:
            break
    assert out == ref
    if row["category"] == "chat":
        # On the chat turns it was trained for, the drafter is accepted well beyond one token per cycle.
        cycles = steps[1:]
        assert sum(s.num_accepted + 1 for s in cycles) / len(cycles) > 2
