"""The decoding loop run to the end, for tests that check its tokens and its steps."""

from dflash_mlx import dflash_generate_step


def run(model, draft, prompt, **kwargs):
    """(every token emitted, every step) of ``dflash_generate_step``."""
    out, cycles = [], []
    for step in dflash_generate_step(prompt, model, draft, **kwargs):
        out.extend(step.tokens)
        cycles.append(step)
    return out, cycles
