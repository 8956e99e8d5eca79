"""The Python API with its defaults against the same calls with ``datastore=None`` (prompt lookup alone, what the
API drafted from before its default became the tools' datastore) and mlx-lm's plain decoding, on the default pair,
greedy, in one process taking turns on each prompt: a warm-up prompt, then each of the first PROMPTS held-out
prompts once per arm (the datastore learns each reply, as in a process that answers several prompts), and whether
the two DFlash arms wrote mlx-lm's tokens.

    python -m dflash_mlx.cpu.openblas python recipes/measure/api_defaults_ab.py PROMPTS MAX_TOKENS
"""

import json
import sys
import time

from mlx_lm.generate import stream_generate as mlx_stream

from dflash_mlx import load, stream_generate
from dflash_mlx.cpu.openblas import blas_in_use
from dflash_mlx.loading.pairs import default_pair_path


def _timed(steps, plain: bool) -> tuple[list[int], float]:
    tokens, first = [], None
    for r in steps:
        # mlx-lm's last response carries the stop token; ours leave it out.
        tokens += ([] if r.finish_reason == "stop" else [r.token]) if plain else r.tokens
        first = first or time.perf_counter()  # generation time only, from the first token on
    return tokens, time.perf_counter() - first


def main(prompts: int, max_tokens: int) -> None:
    model, draft, tok = load()
    print("BLAS:", blas_in_use(), flush=True)
    rows = [json.loads(line) for line in open(default_pair_path() / "prompts.jsonl")][: prompts + 1]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
    arms = {
        "mlx-lm": lambda p: _timed(mlx_stream(model, tok, p, max_tokens=max_tokens), True),
        "defaults": lambda p: _timed(stream_generate(model, draft, tok, p, max_tokens=max_tokens), False),
        "datastore=None": lambda p: _timed(
            stream_generate(model, draft, tok, p, max_tokens=max_tokens, datastore=None), False
        ),
    }
    totals, same = {a: [0.0, 0] for a in arms}, True
    for i, prompt in enumerate(ids):
        order = list(arms) if i % 2 else [*arms][::-1]
        outs = {a: arms[a](prompt) for a in order}
        same &= outs["defaults"][0] == outs["datastore=None"][0] == outs["mlx-lm"][0]
        if i:  # the first prompt warms up
            for a, (tokens, dt) in outs.items():
                totals[a][0] += dt
                totals[a][1] += len(tokens) - 1
    plain = totals["mlx-lm"][1] / totals["mlx-lm"][0]
    print("  ".join(f"{a} {n / s:.1f} tok/s ({n / s / plain:.2f}x)" for a, (s, n) in totals.items()))
    print("same tokens in every arm:", same)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
