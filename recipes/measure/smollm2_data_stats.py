"""Describe a response cache made by `dflash-train --data-only`: counts, tokens, loops, agreement.

Counts are per category and source of the prompt file (``smollm2_prompts.py``), matched through
the cache key (a hash of the rendered prompt ids). The 4-gram repeat share is the share of 4-grams
(over response token ids) that repeat an earlier 4-gram of the same response, as in the toy target's
card. ``--agreement N`` re-decodes the first N cached prompts one at a time with mlx-lm's plain
greedy loop and reports how many cached responses (made by the batched generator) it reproduces
token for token:

    python recipes/measure/smollm2_data_stats.py --target runs/smollm2/target \
        --prompts assets/smollm2/data/prompts_train.jsonl assets/smollm2/data/prompts_train2.jsonl \
        --cache runs/smollm2/data/responses.jsonl
"""

import argparse
import json
from collections import Counter, defaultdict

import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step

from dflash_mlx.tools.train.data import prompt_key, read_cache, read_prompts, render_prompt


def repeat_share(ids: list[int], n: int = 4) -> tuple[int, int]:
    """``(repeated, total)`` n-grams of one sequence."""
    seen, repeated = set(), 0
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated, len(grams)


def greedy(model, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    import mlx.core as mx

    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="The target folder the cache was made with.")
    parser.add_argument("--prompts", required=True, nargs="+", help="The prompt JSONL file(s) the cache was made from.")
    parser.add_argument("--cache", required=True, help="The response cache JSONL.")
    parser.add_argument("--agreement", type=int, default=0, help="Re-decode this many cached prompts.")
    parser.add_argument("--max-tokens", type=int, default=256, help="--gen-max-tokens of the cache.")
    parser.add_argument("--json", default=None, help="Also write the numbers to this JSON file.")
    args = parser.parse_args()

    model, tokenizer = load(args.target)
    meta = {}
    for path in args.prompts:
        records = [json.loads(line) for line in open(path) if line.strip()]
        meta.update({prompt_key(render_prompt(tokenizer, p)): r for p, r in zip(read_prompts(path), records)})
    examples = read_cache(args.cache)

    by = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0]))  # n, tokens, repeated, grams
    finish = Counter()
    lengths = []
    for ex in examples:
        r = meta.get(ex["key"], {"category": "?", "source": "?"})
        rep, grams = repeat_share(ex["response_ids"])
        for level, name in (("category", r["category"]), ("source", r["source"]), ("all", "all")):
            row = by[level][name]
            row[0] += 1
            row[1] += len(ex["response_ids"])
            row[2] += rep
            row[3] += grams
        finish[ex["finish_reason"]] += 1
        lengths.append(len(ex["response_ids"]))
    stats = {"responses": len(examples), "finish": dict(finish)}
    if lengths:
        stats["length"] = {q: int(np.percentile(lengths, p)) for q, p in (("p10", 10), ("median", 50), ("p90", 90))}
        stats["mean_length"] = float(np.mean(lengths))
    for level in ("all", "category", "source"):
        stats[level] = {
            name: {"responses": n, "tokens": t, "repeat4": round(rep / max(g, 1), 4)}
            for name, (n, t, rep, g) in sorted(by[level].items())
        }
        for name, row in stats[level].items():
            print(
                f"{level:9s} {name:28s} {row['responses']:5d} responses {row['tokens']:7d} tokens  "
                f"4-gram repeat {row['repeat4']:.3f}"
            )
    print(f"finish reasons {dict(finish)}; length {stats.get('length')}")

    if args.agreement:
        eos = set(tokenizer.eos_token_ids)
        same, first_diff = 0, []
        for ex in examples[: args.agreement]:
            ref = greedy(model, ex["prompt_ids"], args.max_tokens, eos)
            got = ex["response_ids"]
            if ref == got:
                same += 1
            else:
                first_diff.append(
                    next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                )
        stats["agreement"] = {"checked": args.agreement, "identical": same, "first_difference_at": first_diff}
        print(
            f"agreement with the plain greedy loop: {same}/{args.agreement} identical; "
            f"first differences at tokens {first_diff}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=1)


if __name__ == "__main__":
    main()
