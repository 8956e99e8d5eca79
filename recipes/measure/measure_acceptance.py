"""Greedy acceptance length of a target + drafter pair on held-out prompts (the numbers in DRAFT.md).

python recipes/measure/measure_acceptance.py --prompts assets/dflash-tiny/prompts.jsonl
python recipes/measure/measure_acceptance.py --draft runs/draft --prompts valid.jsonl --skip 8 --num-prompts 32
python recipes/measure/measure_acceptance.py --prompts valid.jsonl --skip 8 --kind completion --num-prompts 24
python recipes/measure/measure_acceptance.py --num-prompts 4 --max-tokens 96 --tree-budget 16
"""

import argparse
import json

from dflash_mlx import load
from dflash_mlx.loading.pairs import default_pair_path
from dflash_mlx.tools.train.data import read_prompts, render_prompt
from dflash_mlx.tools.train.trainer import evaluate_acceptance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Target (default: the embedded pair's).")
    parser.add_argument("--draft", default=None, help="Drafter (default: the embedded pair's).")
    parser.add_argument("--prompts", default=str(default_pair_path() / "prompts.jsonl"))
    parser.add_argument("--skip", type=int, default=0, help="Leave out the first N prompts.")
    parser.add_argument(
        "--kind",
        choices=["chat", "completion"],
        default=None,
        help="Only chat prompts or only raw completions (after --skip).",
    )
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="Draft trees of up to N nodes (default: the path).")  # fmt: skip
    parser.add_argument("--dtype", default=None, help="Cast both models (default: as load() gives them).")
    args = parser.parse_args()

    model, draft, tokenizer = load(args.model, args.draft, dtype=args.dtype)
    # Corpus chunks become 12-line completion prompts, as in dflash-bench and the training data.
    rows = read_prompts(args.prompts, text_prompt_lines=12)[args.skip :]
    if args.kind is not None:
        rows = [row for row in rows if (row.text is not None) == (args.kind == "completion")]
    rows = rows[: args.num_prompts]
    prompts = [render_prompt(tokenizer, row) for row in rows]
    mean, hist = evaluate_acceptance(
        model,
        draft,
        prompts,
        args.max_tokens,
        frozenset(tokenizer.eos_token_ids),
        block_size=args.block_size,
        tree_budget=args.tree_budget,
    )
    print(json.dumps({
        "prompts": len(rows),
        "cycles": sum(hist.values()),
        "mean_acceptance": round(mean, 3),
        "hist": hist,
        "dtype": str(draft.norm.weight.dtype),
        "tree_budget": args.tree_budget,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
