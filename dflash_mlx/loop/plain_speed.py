"""Plain decoding's speed, timed on a finished generation's cache.

With ``adaptive=False`` (or a ``seed``, which turns the timing-driven policy off so that the
output repeats) no cycle decodes plainly, so nothing measures whether drafting pays. A few plain
target steps after the run, at the context the run ended with, answer that without touching the
output: the cache is trimmed back to where it was.
"""

import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from ..models.families import family
from ..sampling import Sampler
from .cache import DFlashCache


def plain_tokens_per_second(
    model: nn.Module, cache: DFlashCache, *, sampler: Sampler | None = None, steps: int = 4
) -> float | None:
    """Tokens per second of plain decoding (one target pass and a sampled token a step).

    The median of ``steps`` timed steps after one untimed one (which may compile). None when it
    cannot be timed without losing state: an empty cache, or a hybrid target whose recurrent
    state cannot be rolled back to an arbitrary position.
    """
    if not cache.tokens or family(model).recurrent:
        return None
    token = mx.array([[cache.tokens[-1]]], dtype=mx.uint32)
    times = []
    for i in range(steps + 1):
        tic = time.perf_counter()
        logits = model(token, cache=cache.target)[:, -1]
        out = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)) if sampler else mx.argmax(logits, -1)
        mx.eval(out)
        if i:
            times.append(time.perf_counter() - tic)
        cache.trim_target(1)
    return 1.0 / statistics.median(times)
