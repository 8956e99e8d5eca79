"""Plain decoding against DFlash at several temperatures and block sizes: the rows behind BENCHMARKS.md.

Runs the embedded pair (fp32) on the benchmark's held-out prompts, round robin per prompt
after a warm-up (median of ``--runs``): plain decoding (no drafter), DFlash at each block
size with ``adaptive=False`` (the paper's loop: a draft every cycle), and, where the
installed dflash_mlx has it, with ``adaptive=True`` (plain cycles while drafting loses).
Every sampled run of a prompt uses the same seed. ``--quantize`` quantizes the target to
4 bits (mlx-lm's affine quantization, group 64) first. Prints tok/s, the drafting cycles'
mean acceptance length, and the share of plain cycles. To compare two versions of the
library, run this script once with each on the path, alternately.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_CORETYPE=SkylakeX \\
        python recipes/archive/ab_sampling.py --num-prompts 3 --temps 0 0.6 1.0 --block-sizes 2 4 16
"""

import argparse
import inspect

import mlx.nn as nn

# recipes/archive/interleaved.py, beside this script
from interleaved import add_run_arguments, embedded_pair_and_prompts, run_interleaved

from dflash_mlx.generation import stream_generate
from dflash_mlx.sampling import make_sampler
from dflash_mlx.tools.bench.timing import time_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.6, 1.0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--quantize", action="store_true", help="Quantize the target to 4 bits first.")
    parser.add_argument("--no-adaptive", action="store_true", help="Leave out the adaptive rows.")
    add_run_arguments(parser)
    args = parser.parse_args()

    model, draft, tokenizer, rows = embedded_pair_and_prompts(args.num_prompts)
    if args.quantize:
        nn.quantize(model, group_size=64, bits=4)
    has_adaptive = "adaptive" in inspect.signature(stream_generate).parameters
    configs = {}
    for temp in args.temps:
        configs[f"t={temp} plain"] = (temp, None, None)
        for b in args.block_sizes:
            configs[f"t={temp} dflash b{b}"] = (temp, b, False)
            if has_adaptive and not args.no_adaptive:
                configs[f"t={temp} adaptive b{b}"] = (temp, b, True)
    stats = {name: [0, 0, 0, 0] for name in configs}  # accepted+1 sum, drafting cycles, plain cycles, cycles

    def run(name: str, ids: list[int]):
        temp, block_size, adaptive = configs[name]
        extra = {"adaptive": adaptive} if has_adaptive and block_size else {}
        stream = stream_generate(
            model,
            draft if block_size else None,
            tokenizer,
            ids,
            max_tokens=args.max_tokens,
            block_size=block_size,
            sampler=make_sampler(temp),
            seed=len(ids),
            **extra,
        )
        out = time_stream(stream, lambda r: r.tokens)
        for accepted, size in zip(out[3], out[4]):
            s = stats[name]
            s[3] += 1
            if size > 1:
                s[0], s[1] = s[0] + accepted, s[1] + 1
            else:
                s[2] += 1
        return out

    tps, outputs = run_interleaved(tokenizer, rows, list(configs), run, args.runs)
    print(f"{'quantized (4-bit) target' if args.quantize else 'fp32'}, {len(rows)} prompts x {args.max_tokens} "
          f"tokens, median of {args.runs}")  # fmt: skip
    for name in configs:
        temp = configs[name][0]
        acc, drafting, plain, cycles = stats[name]
        tau = f"{acc / drafting:5.2f}" if drafting else "    -"
        share = f"{plain / cycles:4.0%}" if cycles and configs[name][1] else "   -"
        ratio = tps[name] / tps[f"t={temp} plain"]
        print(f"{name:22s} {tps[name]:7.1f} tok/s  x{ratio:4.2f}  tau {tau}  plain cycles {share}")
    greedy = [n for n in configs if configs[n][0] == 0]
    if greedy:
        print("greedy tokens identical:", all(outputs[n] == outputs[greedy[0]] for n in greedy))


if __name__ == "__main__":
    main()
