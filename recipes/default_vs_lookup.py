"""Generate's defaults against prompt lookup at block 2 on the default pair, alternating in one process.

dflash-bench runs each method after the other; this alternates them round by round on the bench's first two chat
prompts (256 tokens, greedy, the default policy kept across its runs as dflash-bench keeps it), so that a drift of
the machine falls on both.

    python -m dflash_mlx.cpu.openblas python recipes/default_vs_lookup.py --rounds 2
"""

import argparse
import json
from pathlib import Path

from dflash_mlx import load
from dflash_mlx.bench.benchmark import encode
from dflash_mlx.bench.timing import make_runner


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    model, draft, tokenizer = load()
    rows = [json.loads(line) for line in Path("assets/smollm2/prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [encode(tokenizer, row) for row in rows[:2]]
    settings = {"lookup": 2, "dflash-default": 16}
    runners = {m: make_runner(m, model, draft, None, tokenizer, b, 0, args.max_tokens) for m, b in settings.items()}
    for run in runners.values():
        run(prompts[0])  # warm-up, as dflash-bench does
    for r in range(args.rounds):
        for method, run in runners.items():
            tokens = seconds = 0
            for ids in prompts:
                out, gen_seconds, *_ = run(ids)
                tokens, seconds = tokens + len(out), seconds + gen_seconds
            print(f"round {r}: {method} {tokens / seconds:.2f} tok/s", flush=True)


if __name__ == "__main__":
    main()
