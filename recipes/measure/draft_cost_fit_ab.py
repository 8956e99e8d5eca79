"""Draft-free cycles sized with each further draft's cost fitted to this machine's cycle times, against the
cost fixed at its starting 0.06 of a step (only the first draft's fitted, as before), side by side in one process
with plain decoding through the same loop: the default pair with its defaults (adaptive policy, datastore), greedy,
topic questions of the held-out set (or sampled as the chat samples: then each arm's text differs), a policy state per arm kept across questions as the chat keeps one, rounds
taking turns (the first is warm-up); prints cumulative tokens per second, the fitted costs, and the check that
every arm's text is the same.

    python -m dflash_mlx.cpu.openblas python recipes/measure/draft_cost_fit_ab.py [--prompts 6] [--rounds 2]
"""

import argparse
import json
import time

from dflash_mlx import load, stream_generate
from dflash_mlx.loading.pairs import DEFAULT_PAIR, default_pair_path
from dflash_mlx.sampling import make_sampler
from dflash_mlx.tools.session import open_datastore
from dflash_mlx.tuning.policy import FreeStats, PolicyState

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=6)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--max-tokens", type=int, default=160)
parser.add_argument("--temp", type=float, default=0.0, help="0.2 with --top-p 0.9: the chat's default decoding")
parser.add_argument("--top-p", type=float, default=1.0)
args = parser.parse_args()

model, draft, tok = load()
store = open_datastore("auto", DEFAULT_PAIR, 49152, learns=False)
heldout = default_pair_path() / "data" / "prompts_heldout.jsonl"
rows = [r for r in map(json.loads, open(heldout)) if r.get("source", "").startswith("topics")][: args.prompts]
texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
fitted = FreeStats.timed


def first_only(self, seconds, drafts):  # the rule before: each further draft's cost stays where it started
    if drafts == 0 or self.step is None:
        return fitted(self, seconds, drafts)
    first = seconds / self.step - 1.0 - self.each * (drafts - 1)
    self.first = min(max((1 - 1 / self.prior) * self.first + first / self.prior, 0.0), 4.0)


policies = {"fixed each": PolicyState(), "fitted each": PolicyState()}
totals = {name: [0.0, 0] for name in ("plain", *policies)}
outputs = {}
for rnd in range(args.rounds + 1):
    for name in totals:
        FreeStats.timed = first_only if name == "fixed each" else fitted
        for i, text in enumerate(texts):
            tic, tokens = time.perf_counter(), []
            for r in stream_generate(model, None if name == "plain" else draft, tok, text, max_tokens=args.max_tokens,
                                     sampler=make_sampler(args.temp, top_p=args.top_p),
                                     datastore=None if name == "plain" else store, policy=policies.get(name)):  # fmt: skip
                tokens += r.tokens
            outputs.setdefault(i, set()).add(tuple(tokens))
            if rnd:
                totals[name][0] += time.perf_counter() - tic
                totals[name][1] += len(tokens)
    if rnd:
        base = totals["plain"][0] / totals["plain"][1]
        print(rnd, {k: f"{v[1] / v[0]:.2f} tok/s {base / (v[0] / v[1]):.3f}x" for k, v in totals.items()},
              {k: (round(p.free.first, 3), round(p.free.each, 3)) for k, p in policies.items()},
              "same text:", all(len(v) == 1 for v in outputs.values()), flush=True)  # fmt: skip
