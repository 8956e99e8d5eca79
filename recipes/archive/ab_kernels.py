"""What the CPU kernels (dflash_mlx.cpu.fast_math) and compiled layer steps (dflash_mlx.cpu.compiled_layers) are worth
end to end: an interleaved A/B/C in one process.

Runs the embedded pair (fp32) on the benchmark's held-out prompts with the paper's loop and with
lookup_fallback=4, each three ways: MLX's native ops through mlx-lm's layers; the kernels with
the layer steps run op by op; and as dflash_mlx runs, kernels and compiled steps. Round robin per
prompt after a warm-up (median of 3 runs); checks that all six emit the same tokens. Each way is
a ``cpu_speedups`` setting of the loop: off (the portable path), ``CpuSpeedups(compiled_steps=False)``
and the default.

    LD_PRELOAD=<path to libopenblas.so.0> OPENBLAS_NUM_THREADS=1 \\
        python recipes/archive/ab_kernels.py --block-size 16
"""

import argparse

# recipes/archive/interleaved.py, beside this script
from interleaved import add_run_arguments, embedded_pair_and_prompts, run_interleaved

from dflash_mlx.cpu.speedups import CPU_SPEEDUPS, CpuSpeedups
from dflash_mlx.generation import stream_generate
from dflash_mlx.tools.bench.timing import time_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    add_run_arguments(parser)
    args = parser.parse_args()

    model, draft, tokenizer, rows = embedded_pair_and_prompts(args.num_prompts)
    ways = {
        "native ops": False,
        "kernels, op by op": CpuSpeedups(compiled_steps=False),
        "kernels, compiled": CPU_SPEEDUPS,
    }
    configs = {
        f"{loop}, {way}": (extra, way)
        for loop, extra in (("dflash", {}), ("dflash-fallback", {"lookup_fallback": 4}))
        for way in ways
    }

    def run(name: str, ids: list[int]):
        extra, way = configs[name]
        stream = stream_generate(
            model,
            draft,
            tokenizer,
            ids,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            cpu_speedups=ways[way],
            **extra,
        )
        return time_stream(stream, lambda r: r.tokens)

    tps, outputs = run_interleaved(tokenizer, rows, list(configs), run, args.runs)

    print(f"block {args.block_size}, {len(rows)} prompts x {args.max_tokens} tokens, median of {args.runs}")
    for name in configs:
        print(f"{name:36s} {tps[name]:7.1f} tok/s")
    for loop in ("dflash", "dflash-fallback"):
        native, by_op, compiled = (tps[f"{loop}, {way}"] for way in ways)
        print(
            f"{loop}: kernels op by op / native = {by_op / native:.3f}, compiled / op by op = "
            f"{compiled / by_op:.3f}, compiled / native = {compiled / native:.3f}"
        )
    same = all(outputs[name] == outputs["dflash, native ops"] for name in configs)
    print("identical tokens:", same)


if __name__ == "__main__":
    main()
