"""What starting a verify pass while its graph is still being built is worth: an interleaved A/B.

The loop builds a verify pass's graph in Python while the drafter's pass runs; on MLX's CPU
backend the building takes longer than the drafter pass, so the stream would wait. With
``start_every`` the pass starts running after every few target layers are built. Runs the
embedded pair (fp32) on the benchmark's held-out prompts with the paper's loop and with
lookup_fallback=4, each with the pass left lazy until the end (0) and started every 1, 2 or
3 layers, round robin per prompt after a warm-up (median of 3 runs); checks the tokens match.

    LD_PRELOAD=<path to libopenblas.so.0> OPENBLAS_NUM_THREADS=1 \\
        python recipes/archive/ab_loop.py
"""

import argparse

# recipes/archive/interleaved.py, beside this script
from interleaved import add_run_arguments, embedded_pair_and_prompts, run_interleaved

from dflash_mlx.cpu.speedups import CpuSpeedups
from dflash_mlx.generation import stream_generate
from dflash_mlx.tools.bench.timing import time_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, nargs="+", default=[0, 1, 2, 3])
    add_run_arguments(parser)
    args = parser.parse_args()

    model, draft, tokenizer, rows = embedded_pair_and_prompts(args.num_prompts)
    configs = {f"{loop}, start_every={e}": (fb, e) for loop, fb in (("dflash", 0), ("dflash-fallback", 4))
               for e in args.every}  # fmt: skip

    def run(name: str, ids: list[int]):
        fallback, every = configs[name]
        stream = stream_generate(
            model,
            draft,
            tokenizer,
            ids,
            max_tokens=args.max_tokens,
            block_size=16,
            lookup_fallback=fallback,
            cpu_speedups=CpuSpeedups(start_every=every),
        )
        return time_stream(stream, lambda r: r.tokens)

    tps, outputs = run_interleaved(tokenizer, rows, list(configs), run, args.runs)

    print(f"block 16, {len(rows)} prompts x {args.max_tokens} tokens, median of {args.runs}")
    for name in configs:
        fallback, every = configs[name]
        lazy = next(n for n, (f, e) in configs.items() if f == fallback and e == args.every[0])
        print(f"{name:36s} {tps[name]:7.1f} tok/s  {tps[name] / tps[lazy]:.3f}")
    print("identical tokens:", all(o == outputs[next(iter(configs))] for o in outputs.values()))


if __name__ == "__main__":
    main()
