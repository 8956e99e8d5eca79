"""Arms of the default pair's decoding taking turns in one process: mlx-lm's plain decoding first, then each arm
of ``stream_generate`` keyword arguments, on the bench's held-out prompts, greedy, 256 tokens, rounds after a
warm-up one; prints each round's cumulative tokens per second against mlx-lm's and whether every arm wrote the
same tokens. Used by the ``*_ab.py`` recipes beside it."""

import json
import time

from mlx_lm.generate import stream_generate as mlx_lm_stream

from dflash_mlx import load, stream_generate
from dflash_mlx.cpu.openblas import blas_in_use
from dflash_mlx.loading.pairs import DEFAULT_PAIR, default_pair_path
from dflash_mlx.tools.session import open_datastore


def run_rounds(arms: dict[str, dict], rounds: int, prompts: int = 2, setup: dict | None = None) -> None:
    """``arms``: name -> keyword arguments for ``stream_generate`` beside the defaults (a ``policy`` each);
    ``setup``: name -> a function called before that arm's turn."""
    model, draft, tok = load()
    store = open_datastore("auto", DEFAULT_PAIR, 49152, learns=False)
    rows = [json.loads(line) for line in open(default_pair_path() / "prompts.jsonl")][:prompts]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
    totals = {arm: [0.0, 0] for arm in ("mlx-lm", *arms)}
    outputs = {}
    print(f"BLAS: {blas_in_use()}", flush=True)
    for rnd in range(rounds + 1):
        for arm in totals:
            (setup or {}).get(arm, lambda: None)()
            for i, prompt in enumerate(ids):
                tokens, first = [], None
                if arm == "mlx-lm":
                    steps = mlx_lm_stream(model, tok, prompt, max_tokens=256)
                else:
                    steps = stream_generate(model, draft, tok, prompt, max_tokens=256, datastore=store, **arms[arm])
                for r in steps:
                    if first is None:  # generation time only, from the first token on
                        first = time.perf_counter()
                        continue
                    if arm == "mlx-lm":
                        tokens += [] if r.finish_reason == "stop" else [r.token]
                    else:
                        tokens += r.tokens
                seconds = time.perf_counter() - first
                outputs.setdefault(i, set()).add(tuple(tokens))
                if rnd:
                    totals[arm][0] += seconds
                    totals[arm][1] += len(tokens)
        if rnd:
            base = totals["mlx-lm"][1] / totals["mlx-lm"][0]
            rates = ", ".join(f"{arm} {n / s:.2f} tok/s ({n / s / base:.3f}x)" for arm, (s, n) in totals.items())
            print(f"round {rnd}: {rates}; same tokens: {all(len(v) == 1 for v in outputs.values())}", flush=True)
