"""The CPU attention over a long context: time and peak memory per key chunk size.

One ``fast_math.attention`` call of the default pair's drafter shape (9 heads over 3 KV heads of
64, 16 queries, float32, the fused exp) over each --keys keys, for each --chunks key chunk
(``fast_math.KEY_CHUNK``; 0: the whole context in one pass): median time of --reps calls and the
peak memory over the inputs, what a draft pass holds beyond its K/V for its attention.

    python -m dflash_mlx.cpu.openblas python recipes/archive/attention_chunks.py
    python -m dflash_mlx.cpu.openblas python recipes/archive/attention_chunks.py --before BEFORE   # both, taking turns

With --before DIR the same is measured for the dflash_mlx under DIR and for this checkout, in fresh
processes taking turns (--rounds each), and the medians printed side by side.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from turns import run_in_turns

MB = 1024**2
HEADS, KV_HEADS, QUERIES, DIM = 9, 3, 16, 64


def measure(keys: list[int], chunks: list[int], reps: int) -> dict:
    from dflash_mlx.cpu import fast_math

    results = {}
    for length in keys:
        mx.random.seed(0)
        q = mx.random.normal((1, HEADS, QUERIES, DIM))
        k, v = (mx.random.normal((1, KV_HEADS, length, DIM)) for _ in range(2))
        mx.eval(q, k, v)
        for chunk in chunks:
            # Chunk 0: above any context here, so one pass over all the keys.
            fast_math.KEY_CHUNK = chunk or 1 << 30
            fast_math.CHUNK_ABOVE = 4096 if chunk else 1 << 30
            mx.eval(fast_math.attention(q, k, v, DIM**-0.5, fast_exp=True))  # compiled before it is timed
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                mx.eval(fast_math.attention(q, k, v, DIM**-0.5, fast_exp=True))
                times.append(time.perf_counter() - start)
            results[f"{length} {chunk}"] = [statistics.median(times) * 1e3, (mx.get_peak_memory() - base) / MB]
    return results


def _label(chunk: str) -> str:
    return chunk if chunk != "0" else "one pass"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[4112, 8208, 16400, 32784])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 1024, 512])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--before", help="a folder whose dflash_mlx is measured as the version before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line (used for --before)")
    args = parser.parse_args()
    own = ["--keys", *map(str, args.keys), "--chunks", *map(str, args.chunks), "--reps", str(args.reps), "--json"]
    if args.before:
        runs = run_in_turns(args.before, own, args.rounds)
        print(f"median of {args.rounds} rounds (each a median of {args.reps} calls): ms, peak MB over the inputs")
        print("keys | chunk | before | after")
        for key in runs["after"][0]:
            cells = []
            for side in ("before", "after"):
                ms = statistics.median(r[key][0] for r in runs[side])
                cells.append(f"{ms:.1f} ms, {statistics.median(r[key][1] for r in runs[side]):.1f} MB")
            length, chunk = key.split()
            print(f"{length:>6} | {_label(chunk):>8} | {cells[0]} | {cells[1]}")
        return
    results = measure(args.keys, args.chunks, args.reps)
    if args.json:
        print(json.dumps(results))
        return
    for key, (ms, peak) in results.items():
        length, chunk = key.split()
        print(f"{length:>6} keys, chunk {_label(chunk):>8}: {ms:.1f} ms, peak {peak:.1f} MB over the inputs")


if __name__ == "__main__":
    main()
