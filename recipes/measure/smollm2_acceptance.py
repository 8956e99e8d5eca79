"""Acceptance of the default pair's drafter on its held-out prompts, per category and block size.

Greedy, every cycle drafted (no adaptive plain cycles), as the drafter card reports it. Also
the share of the target's 4-grams that repeat an earlier one of the same answer, so a reader
can tell acceptance earned from acceptance handed over by loops.

    python recipes/measure/smollm2_acceptance.py --per-category 8 --max-tokens 128 --block-sizes 16 8
    python recipes/measure/smollm2_acceptance.py --draft runs/smollm2/blind --json blind.json

With ``--defaults``, the loop as generate runs it by default instead: the adaptive policy (one
state across the prompts, as a chat keeps it) and the default pair's datastore, which learns
nothing from these answers; tau then counts every cycle that verified drafts, whoever proposed
them, and the table adds tokens per cycle (plain steps included) and each source's share:

    python -m dflash_mlx.cpu.openblas python recipes/measure/smollm2_acceptance.py --defaults --per-category 4 \
        --max-tokens 128 --block-sizes 16 8
"""

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2_data_stats import repeat_share  # noqa: E402

from dflash_mlx import LoopOptions, dflash_generate_step, load  # noqa: E402
from dflash_mlx.text.chat_template import render_chat  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Target (default: the default pair's).")
    parser.add_argument("--draft", default=None, help="Drafter (default: the default pair's).")
    parser.add_argument("--prompts", default="assets/smollm2/data/prompts_heldout.jsonl")
    parser.add_argument("--per-category", type=int, default=8, help="Prompts per category (the file's first).")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--json", default=None, help="Also write the results here.")
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="The loop's defaults (adaptive policy, datastore) instead of every cycle drafted.",
    )
    parser.add_argument("--datastore", default="auto", help="With --defaults: as dflash-generate's --datastore.")
    parser.add_argument("--by-source", action="store_true", help="Group the prompts by category/source kind.")
    args = parser.parse_args()

    model, draft, tokenizer = load(args.model, args.draft)
    settings = {"adaptive": False}
    if args.defaults:
        from dflash_mlx.models.target import vocab_size
        from dflash_mlx.tools.session import open_datastore
        from dflash_mlx.tuning.policy import PolicyState

        store = open_datastore(args.datastore, args.model, vocab_size(model), learns=False)
        settings = {"adaptive": True, "datastore": store}
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    by_category = defaultdict(list)
    for row in rows:
        group = row["category"]
        if args.by_source:
            source = row.get("source", "?")
            group += "/" + ("topics:wordnet" if source.startswith("topics:wordnet") else source.split(":")[0])
        if len(by_category[group]) < args.per_category:
            by_category[group].append(row)
    eos = frozenset(tokenizer.eos_token_ids)
    results = {}
    for block in args.block_sizes:
        if args.defaults:
            settings["policy"] = PolicyState()  # one per block size, kept across the prompts
        for category, picked in sorted(by_category.items()):
            hist, repeated, grams, tokens, all_cycles, shares = Counter(), 0, 0, 0, 0, Counter()
            for row in picked:
                ids = render_chat(tokenizer, row["messages"])
                out = []
                options = LoopOptions(max_tokens=args.max_tokens, stop_tokens=eos, block_size=block, **settings)
                for step in dflash_generate_step(ids, model, draft, options):
                    out += step.tokens
                    all_cycles += step.num_draft > 0 or len(out) > len(step.tokens)  # the prefill's token is no cycle
                    if step.num_draft:
                        hist[step.num_accepted + 1] += 1
                        shares[step.source] += step.num_accepted
                r, g = repeat_share(out)
                repeated, grams, tokens = repeated + r, grams + g, tokens + len(out)
            cycles = sum(hist.values())
            results[f"{category}@{block}"] = {
                "category": category, "block_size": block, "prompts": len(picked), "tokens": tokens,
                "cycles": cycles, "tau": round(sum(k * v for k, v in hist.items()) / max(cycles, 1), 3),
                "repeat4": round(repeated / max(grams, 1), 3), "hist": dict(sorted(hist.items())),
                "all_cycles": all_cycles, "tokens_per_cycle": round((tokens - len(picked)) / max(all_cycles, 1), 3),
                "accepted_by": dict(shares),
            }  # fmt: skip
            print(json.dumps(results[f"{category}@{block}"]), flush=True)
    for block in args.block_sizes:
        picked = [r for r in results.values() if r["block_size"] == block]
        cycles = sum(r["cycles"] for r in picked)
        accepted = sum(k * v for r in picked for k, v in r["hist"].items())
        every = sum(r["all_cycles"] for r in picked)  # plain steps included
        emitted = sum(r["tokens"] - r["prompts"] for r in picked)
        shares = Counter()
        for r in picked:
            shares.update(r["accepted_by"])
        total = max(sum(shares.values()), 1)
        print(
            f"block {block}: tau {accepted / max(cycles, 1):.3f} over {cycles} drafting cycles, "
            f"{emitted / max(every, 1):.3f} tokens per cycle over all {every:.0f}; accepted drafts from "
            + ", ".join(f"{k or '?'} {100 * v / total:.0f}%" for k, v in sorted(shares.items()))
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
