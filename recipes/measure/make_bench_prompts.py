"""Pick the benchmark's held-out prompts from the valid split of the stdlib corpus.

Two categories: "chat" (a held-out docstring as the user's message, answered in the chat template)
and "completion" (the first lines of a held-out code chunk, continued as raw text).

    python recipes/measure/make_bench_prompts.py --data runs/data/valid.jsonl \
        --out assets/dflash-tiny/prompts.jsonl
"""

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/data/valid.jsonl")
    parser.add_argument("--out", default="assets/dflash-tiny/prompts.jsonl")
    parser.add_argument("--chat", type=int, default=16, help="Number of chat prompts.")
    parser.add_argument("--completion", type=int, default=8, help="Number of completion prompts.")
    parser.add_argument("--completion-lines", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    chats = [r for r in rows if "messages" in r and len(r["messages"][0]["content"]) < 600]
    chunks = [r for r in rows if "text" in r and r["text"].count("\n") > args.completion_lines + 4]
    chat = [
        {"category": "chat", "file": r["file"], "messages": [r["messages"][0]]}
        for r in rng.sample(chats, min(args.chat, len(chats)))
    ]
    completion = [
        {
            "category": "completion",
            "file": r["file"],
            "raw": True,
            "prompt": "\n".join(r["text"].splitlines()[: args.completion_lines]) + "\n",
        }
        for r in rng.sample(chunks, min(args.completion, len(chunks)))
    ]
    # Interleaved, so that the first N prompts (dflash-bench --num-prompts) cover both categories.
    out = []
    while chat or completion:
        out += chat[:2] + completion[:1]
        chat, completion = chat[2:], completion[1:]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in out))
    print(f"wrote {len(out)} prompts to {args.out}")


if __name__ == "__main__":
    main()
