"""The round robin that the A/B recipes share: every configuration on every prompt, in one process."""

import statistics
from typing import Callable

from dflash_mlx.benchmark import encode


def run_interleaved(tokenizer, rows: list, names: list[str], run: Callable, runs: int) -> tuple[dict, dict]:
    """Per prompt, a warm-up of each configuration, then ``runs`` rounds across them.

    ``run(name, ids)`` returns what ``dflash_mlx.benchmark._time_stream`` does. Returns the
    tok/s of each configuration (its tokens over the sum of its per-prompt median times) and
    the token ids of each of its runs.
    """
    tokens = {name: 0 for name in names}
    seconds = {name: 0.0 for name in names}
    outputs = {name: [] for name in names}
    for row in rows:
        ids = encode(tokenizer, row)
        for name in names:
            run(name, ids)
        times = {name: [] for name in names}
        for _ in range(runs):
            for name in names:
                out, gen_seconds, *_ = run(name, ids)
                times[name].append(gen_seconds)
                outputs[name].append(list(out))
        for name in names:
            tokens[name] += len(outputs[name][-1]) - 1  # the first token is the prefill's
            seconds[name] += statistics.median(times[name])
    return {name: tokens[name] / seconds[name] for name in names}, outputs
