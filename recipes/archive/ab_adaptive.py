"""What a user of the default pair gets: plain decoding, DFlash drafting every cycle, and DFlash with the
adaptive policy (the default), greedy, interleaved on the same prompts; checks the tokens match.

    LD_PRELOAD=<path to libopenblas.so.0> OPENBLAS_NUM_THREADS=1 \\
        python recipes/archive/ab_adaptive.py --num-prompts 6 --runs 1
"""

import argparse

# recipes/archive/interleaved.py, beside this script
from interleaved import add_run_arguments, embedded_pair_and_prompts, run_interleaved

from dflash_mlx.generation import stream_generate
from dflash_mlx.tools.bench.timing import time_stream

CONFIGS = {"plain": (False, None), "dflash, every cycle": (True, False), "dflash, adaptive (default)": (True, None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    args = parser.parse_args()

    model, draft, tokenizer, rows = embedded_pair_and_prompts(args.num_prompts)

    def run(name: str, ids: list[int]):
        drafted, adaptive = CONFIGS[name]
        stream = stream_generate(model, draft if drafted else None, tokenizer, ids, max_tokens=args.max_tokens,
                                 adaptive=adaptive)  # fmt: skip
        return time_stream(stream, lambda r: r.tokens)

    tps, outputs = run_interleaved(tokenizer, rows, list(CONFIGS), run, args.runs)
    same = all(outputs[name] == outputs["plain"] for name in CONFIGS)
    for name in CONFIGS:
        print(f"{name:28s} {tps[name]:7.1f} tok/s  x{tps[name] / tps['plain']:.2f}")
    print("tokens identical across configurations:", same)


if __name__ == "__main__":
    main()
