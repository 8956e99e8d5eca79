"""Write a copy of a dflash-train response cache in which raw completion examples appear N times.

Training draws one example per step uniformly from the cache, and the target answers most chat
prompts with long loops, so raw code completions (the harder case) get few steps. The extra copies
go first and get their own keys, so the cache's last examples (the validation set) stay the same.

    python recipes/rebuild/oversample_cache.py --cache runs/draft/data/responses.jsonl \
        --out runs/draft/data/responses_weighted.jsonl --times 3
"""

import argparse
import json
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from dflash_mlx.loading.pairs import TINY_PAIR, embedded_pair_path
from dflash_mlx.tools.train.data import read_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, help="Response cache JSONL written by dflash-train.")
    parser.add_argument("--out", required=True, help="Where to write the weighted copy.")
    parser.add_argument("--times", type=int, default=3, help="Copies of each completion example in all.")
    parser.add_argument(
        "--model", default=str(embedded_pair_path(TINY_PAIR) / "target"), help="The target (its tokenizer)."
    )
    args = parser.parse_args()
    if Path(args.out).resolve() == Path(args.cache).resolve():
        raise SystemExit("--out must differ from --cache: the cache is the record of the data step.")

    # Chat prompts are rendered in the chat template, completions raw: the template's first token tells them apart.
    tokenizer = load_tokenizer(Path(args.model))
    chat_start = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)[0]
    examples = read_cache(args.cache)
    completions = [e for e in examples if e["prompt_ids"][0] != chat_start and len(e["response_ids"]) >= 2]
    extra = [dict(e, key=f"{e['key']}-x{r}") for r in range(1, args.times) for e in completions]
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in extra + examples))
    tmp.replace(args.out)
    print(f"{len(examples)} examples, {len(completions)} completions x {args.times}: {len(extra + examples)} lines")


if __name__ == "__main__":
    main()
