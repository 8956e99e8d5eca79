"""The round robin that the A/B recipes share: every configuration on every prompt, in one process."""

import argparse
import statistics
from collections.abc import Callable

from dflash_mlx import load
from dflash_mlx.loading.pairs import default_pair_path
from dflash_mlx.tools.bench.benchmark import encode, prompt_rows


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every A/B recipe takes: how many prompts, tokens and timed rounds."""
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)


def embedded_pair_and_prompts(num_prompts: int) -> tuple:
    """The default pair in fp32 and the first ``num_prompts`` of its held-out prompts."""
    model, draft, tokenizer = load(dtype="float32")
    return model, draft, tokenizer, prompt_rows(str(default_pair_path() / "prompts.jsonl"), num_prompts)


def run_interleaved(tokenizer, rows: list, names: list[str], run: Callable, runs: int) -> tuple[dict, dict]:
    """Per prompt, a warm-up of each configuration, then ``runs`` rounds across them.

    ``run(name, ids)`` returns what ``dflash_mlx.tools.bench.timing.time_stream`` does. Returns the
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
