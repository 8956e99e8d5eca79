"""Held-out greedy acceptance of a drafter at every anchor of cached target responses, per category.

A second table splits each category by the prompts' source (``chat/topics``, ``chat/chitchat``, ...): a gain on
the sources the training data has most of can hide a flat line on the others.

Teacher-forced: the target's greedy responses to held-out prompts are cached once; then each
drafter is read at every anchor of them (dflash_mlx.tools.train.block_acceptance), without a
generation loop: on 2 cores about 2 minutes per drafter (all block sizes from one read), plus 2-3 minutes for the
target's taps, shared by the drafters of one run. The drafter comparisons in docs/lab/drafter-stages.md use it.

    python recipes/measure/smollm2_block_tau.py --select-prompts runs/heldout/prompts.jsonl
    LD_PRELOAD=.../libopenblas.so.0 python recipes/rebuild/smollm2_responses.py --prompts runs/heldout/prompts.jsonl \\
        --cache runs/heldout/responses.jsonl --batch-size 64 --workers 2 --threads 1 --coretype SkylakeX
    python -m dflash_mlx.cpu.openblas python recipes/measure/smollm2_block_tau.py --draft assets/smollm2/draft runs/a \\
        --prompts runs/heldout/prompts.jsonl --cache runs/heldout/responses.jsonl --block-sizes 16 8
"""

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def select_prompts(out: Path, data: Path = Path("assets/smollm2/data")) -> None:
    def read(name):
        return [json.loads(line) for line in open(data / name) if line.strip()]

    by_category, by_kind = defaultdict(list), defaultdict(list)
    for rec in read("prompts_heldout.jsonl"):
        by_category[rec["category"]].append(rec)
    for rec in read("prompts_heldout2.jsonl"):
        by_kind[rec["source"].split(":")[0]].append(rec)
    chosen = [r for c in sorted(by_category) for r in by_category[c][:16]]
    chosen += by_kind["chitchat"][:24] + by_kind["magpie"][:16] + by_kind["followup"][:8]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    print(f"{len(chosen)} held-out prompts written to {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/smollm2/target", help="The target (float32 mlx-lm folder).")
    p.add_argument(
        "--draft",
        nargs="+",
        default=["assets/smollm2/draft"],
        help="Drafter folders (with the same taps): the target's taps are computed once for all.",
    )
    p.add_argument(
        "--select-prompts",
        default=None,
        metavar="OUT",
        help="Only write the held-out selection to OUT: the first 16 prompts per category of "
        "prompts_heldout.jsonl, then of prompts_heldout2.jsonl the first 24 chitchat, 16 magpie and "
        "8 followup prompts (128 in all).",
    )
    p.add_argument("--prompts", default=None, help="The held-out prompts (JSONL with a 'category' each).")
    p.add_argument("--cache", default=None, help="The target's responses to them (response cache JSONL).")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16])
    p.add_argument("--max-seq-len", type=int, default=640)
    p.add_argument("--json", default=None, help="Also write the results here.")
    args = p.parse_args()
    if args.select_prompts:
        select_prompts(Path(args.select_prompts))
        return
    if not args.prompts or not args.cache:
        p.error("--prompts and --cache are needed (or --select-prompts OUT)")

    from dflash_mlx.loading.draft_loader import load_draft
    from dflash_mlx.loading.target_loader import load_target
    from dflash_mlx.tools.train.block_acceptance import response_acceptance
    from dflash_mlx.tools.train.data import prompt_key, read_cache, read_prompts, render_prompt
    from dflash_mlx.tools.train.taps import TapStore

    target, tokenizer = load_target(Path(args.model))
    drafts = {d: load_draft(Path(d), target=target, tokenizer=tokenizer) for d in args.draft}
    records = [json.loads(line) for line in open(args.prompts) if line.strip()]
    category, group = {}, {}  # by response key: the category, and "category/source kind" (before the first colon)
    for rec, prompt in zip(records, read_prompts(args.prompts)):
        key = prompt_key(render_prompt(tokenizer, prompt))
        category[key] = rec.get("category", "all")
        group[key] = f"{category[key]}/{rec.get('source', '?').split(':')[0]}"
    examples = [ex for ex in read_cache(args.cache) if ex["key"] in category]
    tap_ids = {tuple(d.target_layer_ids) for d in drafts.values()}
    if len(tap_ids) != 1:
        raise SystemExit(f"The drafters tap different layers {sorted(tap_ids)}: compare them in separate runs.")
    store = TapStore(target, list(tap_ids.pop()), args.max_seq_len)
    results = {}
    for name, draft in drafts.items():
        tic = time.perf_counter()
        # The drafter drafts its whole block at any verify width, so a smaller block size accepts
        # min(what the largest reads, its width): one read serves every block size.
        accepted = defaultdict(list)
        for ex in examples:
            got = response_acceptance(draft, target, store, ex, block_size=max(args.block_sizes)).accepted
            accepted[category[ex["key"]]].append(got)
            accepted[group[ex["key"]]].append(got)
            accepted["all"].append(got)
        reads = {c: np.concatenate(v) for c, v in sorted(accepted.items())}
        results[name] = {
            B: {c: {"anchors": int(read.size), "tau": float(np.minimum(read, B - 1).mean() + 1)} for c, read in reads.items()}
            for B in args.block_sizes
        }  # fmt: skip
        print(f"{name}: {len(examples)} responses, {results[name][args.block_sizes[0]]['all']['anchors']:,} anchors, "
              f"{time.perf_counter() - tic:.0f} s (the first drafter's time includes the target's taps)", flush=True)  # fmt: skip
    first = results[args.draft[0]][args.block_sizes[0]]
    cats = [c for c in first if "/" not in c]
    print("| drafter | block | " + " | ".join(cats) + " |")
    for name, rows in results.items():
        for B, row in rows.items():
            print(f"| {name} | {B} | " + " | ".join(f"{row[c]['tau']:.3f}" for c in cats) + " |")
    groups = [g for g in first if "/" in g]
    print(
        f"\nBy source, block {args.block_sizes[0]} (anchors: "
        + ", ".join(f"{g} {first[g]['anchors']:,}" for g in groups)
        + ")"
    )
    print("| drafter | " + " | ".join(groups) + " |")
    for name, rows in results.items():
        row = rows[args.block_sizes[0]]
        print(f"| {name} | " + " | ".join(f"{row[g]['tau']:.3f}" for g in groups) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
