"""Generate's defaults against prompt lookup at block 2 on the default pair, interleaved in one process.

dflash-bench runs each method after the other; this takes turns on each of the bench's first two chat prompts
(256 tokens, greedy, the default policy kept across its runs as dflash-bench keeps it), so that a drift of the
machine falls on both.

    python -m dflash_mlx.cpu.openblas python recipes/archive/default_vs_lookup.py --num-prompts 2 --max-tokens 256 --runs 3
"""

import argparse

# recipes/archive/interleaved.py, beside this script
from interleaved import add_run_arguments, embedded_pair_and_prompts, run_interleaved

from dflash_mlx.tools.bench.timing import make_runner

BLOCK_SIZES = {"lookup": 2, "dflash-default": 16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    args = parser.parse_args()

    model, draft, tokenizer, rows = embedded_pair_and_prompts(args.num_prompts)
    runners = {m: make_runner(m, model, draft, None, tokenizer, b, 0, args.max_tokens) for m, b in BLOCK_SIZES.items()}
    tps, outputs = run_interleaved(tokenizer, rows, list(BLOCK_SIZES), lambda name, ids: runners[name](ids), args.runs)
    for name in BLOCK_SIZES:
        print(f"{name:16s} {tps[name]:7.2f} tok/s  x{tps[name] / tps['lookup']:.3f}")
    print("tokens identical:", outputs["lookup"] == outputs["dflash-default"])


if __name__ == "__main__":
    main()
