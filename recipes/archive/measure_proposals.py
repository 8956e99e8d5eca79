"""Mean acceptance length of greedy vs sampled proposals when sampling, on the embedded pair.

python recipes/archive/measure_proposals.py --temps 0.6 1.0 --max-tokens 128 --seeds 2
"""

import argparse
import json
import statistics
from pathlib import Path

from dflash_mlx import load, stream_generate
from dflash_mlx.loading.pairs import default_pair_path
from dflash_mlx.sampling import make_sampler
from dflash_mlx.tools.bench.benchmark import encode, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=str(default_pair_path() / "prompts.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--temps", type=float, nargs="+", default=[0.6, 1.0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=2, help="Seeded runs per prompt.")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    model, draft, tokenizer = load(dtype="float32")
    prompts = [encode(tokenizer, row) for row in load_prompts(Path(args.prompts), args.num_prompts)]
    results = []
    for temp in args.temps:
        for proposal in ("greedy", "sample"):
            accept = []
            for ids in prompts:
                for seed in range(args.seeds):
                    for r in stream_generate(
                        model,
                        draft,
                        tokenizer,
                        ids,
                        max_tokens=args.max_tokens,
                        block_size=args.block_size,
                        sampler=make_sampler(temp),
                        proposal=proposal,
                        seed=seed,
                    ):
                        if r.cycle > 0:
                            accept.append(r.acceptance_length)
            row = {"temp": temp, "proposal": proposal, "tau": statistics.mean(accept), "cycles": len(accept)}
            results.append(row)
            print(
                f"temp {temp}: {proposal:6s} proposals, mean acceptance length {row['tau']:.2f} "
                f"over {row['cycles']} cycles"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
