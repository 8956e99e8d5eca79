"""Pick the default pair's benchmark prompts from the drafter's held-out prompts.

The held-out file (``smollm2_prompts.py``) shares no source with the training prompts. The
chat prompts come first, so ``dflash-bench --num-prompts 12`` runs on chat turns alone; the
other categories follow in turn.

    python recipes/measure/smollm2_bench_prompts.py --heldout assets/smollm2/data/prompts_heldout.jsonl \
        --out assets/smollm2/prompts.jsonl
"""

import argparse
import json
import random
from pathlib import Path

COUNTS = {"chat": 12, "code": 4, "writing": 4, "math": 2, "summarize": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", default="assets/smollm2/data/prompts_heldout.jsonl")
    parser.add_argument("--out", default="assets/smollm2/prompts.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = [json.loads(line) for line in Path(args.heldout).read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    picked = {}
    for category, n in COUNTS.items():
        pool = [r for r in rows if r["category"] == category]
        picked[category] = rng.sample(pool, min(n, len(pool)))
    out = picked.pop("chat")
    while any(picked.values()):
        for rest in picked.values():
            out += rest[:1]
            del rest[:1]
    lines = [json.dumps({"category": r["category"], "source": r["source"], "messages": r["messages"]}) for r in out]
    Path(args.out).write_text("".join(line + "\n" for line in lines))
    print(f"wrote {len(out)} prompts to {args.out}")


if __name__ == "__main__":
    main()
