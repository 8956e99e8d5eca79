"""Plain decoding with and without the drafter loaded: does a plain run of the adaptive policy cost
more than --no-draft? Greedy, the default pair, the same prompt, interleaved runs in one process.

    python -m dflash_mlx.cpu.openblas python recipes/archive/plain_run_cost.py
"""

import statistics
import time

from dflash_mlx import LoopOptions, dflash_generate_step, load
from dflash_mlx.text.chat_template import render_chat
from dflash_mlx.tuning.policy import PolicyState

model, draft, tok = load()
ids = render_chat(tok, [{"role": "user", "content": "Explain what a hash table is"}])


def run(d, policy=None, n=120):
    t = time.perf_counter()
    k = 0
    for i, s in enumerate(dflash_generate_step(ids, model, d, LoopOptions(max_tokens=n, policy=policy))):
        if i == 0:
            t = time.perf_counter()
        k += len(s.tokens)
    return (k - 1) / (time.perf_counter() - t)


def plain_policy():
    p = PolicyState()
    p.warm = True
    p.plain_time = 0.06
    p.draft_time = 0.2
    p.plain_left = 250
    p.run = 256
    return p


run(None, n=10)
run(draft, plain_policy(), n=10)
res = {"no draft": [], "drafter, plain run": []}
for _r in range(4):
    res["no draft"].append(run(None))
    res["drafter, plain run"].append(run(draft, plain_policy()))
for k, v in res.items():
    print(k, [round(x, 2) for x in v], round(statistics.median(v), 2))
