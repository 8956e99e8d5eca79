"""Time to the first token of the default pair after a long prompt (the prefill), this code against another.

A prompt of each --lengths token ids (random, seeded) is fed to ``stream_generate`` for one
token, fp32, after a warm-up on a short prompt; median of --reps. With --before DIR the same is
measured for the dflash_mlx under DIR, in fresh processes taking turns, --rounds each:

    git archive REV dflash_mlx assets | tar -x -C BEFORE
    python -m dflash_mlx.cpu.openblas python recipes/archive/prefill_timing.py --before BEFORE
"""

import argparse
import json
import statistics
import time

from turns import run_in_turns


def measure(lengths: list[int], reps: int) -> dict:
    import mlx.core as mx

    from dflash_mlx import load, stream_generate

    model, draft, tokenizer = load(dtype="float32")
    rng = mx.random.key(0)
    ids = mx.random.randint(100, 40000, (max(lengths),), key=rng).tolist()
    next(iter(stream_generate(model, draft, tokenizer, ids[:64], max_tokens=1)))
    out = {}
    for length in lengths:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            next(iter(stream_generate(model, draft, tokenizer, ids[:length], max_tokens=1)))
            times.append(time.perf_counter() - start)
        out[length] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", help="a folder whose dflash_mlx is measured as the version before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line (used for --before)")
    args = parser.parse_args()
    if args.before is None:
        result = measure(args.lengths, args.reps)
        if args.json:
            print(json.dumps(result))
        else:
            for length, seconds in result.items():
                print(f"{length:>6} tokens: first token after {seconds:.2f} s ({length / seconds:.0f} prompt tok/s)")
        return
    argv = ["--json", "--reps", str(args.reps), "--lengths", *map(str, args.lengths)]
    runs = run_in_turns(args.before, argv, args.rounds)
    print(f"median of {args.rounds} rounds (each a median of {args.reps}), seconds to the first token")
    for length in map(str, args.lengths):
        b, a = (statistics.median(r[length] for r in runs[n]) for n in ("before", "after"))
        print(f"{length:>6} tokens | before {b:.2f} s ({int(length) / b:.0f} tok/s) | after {a:.2f} s "
              f"({int(length) / a:.0f} tok/s) | after / before {a / b:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
