"""Draft-free cycles sized by the cost line alone against the line plus each size's own measured cost, with
mlx-lm's plain decoding beside them: one process, rounds taking turns (the first a warm-up), greedy, the bench's
two held-out prompts, 256 tokens. Prints cumulative tokens per second and whether every arm wrote the same tokens.

    python -m dflash_mlx.cpu.openblas python recipes/measure/draft_cost_sizes_ab.py --rounds 3
"""
import argparse
import json
import time

from mlx_lm.generate import stream_generate as mlx_lm_stream

from dflash_mlx import load, stream_generate
from dflash_mlx.adaptive import FreeStats, PolicyState
from dflash_mlx.cpu.openblas import blas_in_use
from dflash_mlx.datastore import open_datastore
from dflash_mlx.loading.pairs import DEFAULT_PAIR, default_pair_path


class LineOnly(FreeStats):
    """The earlier rule: every size costs what the fitted line says."""

    def cost(self, k: int) -> float:
        return 1.0 if k == 0 else 1.0 + self.first + self.each * (k - 1)


parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

model, draft, tok = load()
store = open_datastore("auto", DEFAULT_PAIR, 49152, learns=False)
rows = [json.loads(line) for line in open(default_pair_path() / "prompts.jsonl")][:2]
ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
policies = {"line": PolicyState(), "sizes": PolicyState()}
policies["line"].free = LineOnly()
totals = {arm: [0.0, 0] for arm in ("mlx-lm", *policies)}
outputs = {}
print(f"BLAS: {blas_in_use()}", flush=True)
for rnd in range(args.rounds + 1):
    for arm in totals:
        for i, prompt in enumerate(ids):
            tokens, first = [], None
            if arm == "mlx-lm":
                steps = mlx_lm_stream(model, tok, prompt, max_tokens=256)
            else:
                steps = stream_generate(model, draft, tok, prompt, max_tokens=256, datastore=store, policy=policies[arm])
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
sizes = {k: round(policies["sizes"].free.cost(k), 3) for k in range(1, 8)}
print("learned cost by drafts (plain steps):", sizes, flush=True)
