"""Acceptance of the default pair's drafter on its held-out prompts, per category and block size.

Greedy, every cycle drafted (no adaptive plain cycles), as the drafter card reports it. Also
the share of the target's 4-grams that repeat an earlier one of the same answer, so a reader
can tell acceptance earned from acceptance handed over by loops.

    python recipes/smollm2_acceptance.py --per-category 8 --max-tokens 128 --block-sizes 16 8
    python recipes/smollm2_acceptance.py --draft runs/smollm2/blind --json blind.json
"""

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2_data_stats import repeat_share  # noqa: E402

from dflash_mlx import dflash_generate_step, load  # noqa: E402
from dflash_mlx.chat_template import render_chat  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Target (default: the default pair's).")
    parser.add_argument("--draft", default=None, help="Drafter (default: the default pair's).")
    parser.add_argument("--prompts", default="assets/smollm2/data/prompts_heldout.jsonl")
    parser.add_argument("--per-category", type=int, default=8, help="Prompts per category (the file's first).")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args()

    model, draft, tokenizer = load(args.model, args.draft)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    by_category = defaultdict(list)
    for row in rows:
        if len(by_category[row["category"]]) < args.per_category:
            by_category[row["category"]].append(row)
    eos = frozenset(tokenizer.eos_token_ids)
    results = {}
    for block in args.block_sizes:
        for category, picked in sorted(by_category.items()):
            hist, repeated, grams, tokens = Counter(), 0, 0, 0
            for row in picked:
                ids = render_chat(tokenizer, row["messages"])
                out = []
                for step in dflash_generate_step(ids, model, draft, max_tokens=args.max_tokens, stop_tokens=eos,
                                                 block_size=block, adaptive=False):  # fmt: skip
                    out += step.tokens
                    if step.num_draft:
                        hist[step.num_accepted + 1] += 1
                r, g = repeat_share(out)
                repeated, grams, tokens = repeated + r, grams + g, tokens + len(out)
            cycles = sum(hist.values())
            results[f"{category}@{block}"] = {
                "category": category, "block_size": block, "prompts": len(picked), "tokens": tokens,
                "cycles": cycles, "tau": round(sum(k * v for k, v in hist.items()) / max(cycles, 1), 3),
                "repeat4": round(repeated / max(grams, 1), 3), "hist": dict(sorted(hist.items())),
            }  # fmt: skip
            print(json.dumps(results[f"{category}@{block}"]), flush=True)
    for block in args.block_sizes:
        picked = [r for r in results.values() if r["block_size"] == block]
        cycles = sum(r["cycles"] for r in picked)
        accepted = sum(k * v for r in picked for k, v in r["hist"].items())
        print(f"block {block}: tau {accepted / max(cycles, 1):.3f} over {cycles} cycles, all categories")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
