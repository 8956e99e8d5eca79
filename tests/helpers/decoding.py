"""The decoding loop run to the end, for tests that check its tokens and its steps."""

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import LoopOptions, dflash_generate_step

# (model, tokens) by (id(model), prompt, max_tokens); the model is kept so that its id is not reused.
_GREEDY: dict = {}


def run(model, draft, prompt, prompt_cache=None, **kwargs):
    """(every token emitted, every step) of ``dflash_generate_step``; ``kwargs`` are its options."""
    out, cycles = [], []
    for step in dflash_generate_step(prompt, model, draft, LoopOptions(**kwargs), prompt_cache=prompt_cache):
        out.extend(step.tokens)
        cycles.append(step)
    return out, cycles


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy decoding of ``model``, decoded once per prompt and length in a worker:
    the same reference is checked against many block sizes and drafters."""
    key = (id(model), tuple(prompt), max_tokens)
    if key not in _GREEDY:
        _GREEDY[key] = model, [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
    return list(_GREEDY[key][1])
