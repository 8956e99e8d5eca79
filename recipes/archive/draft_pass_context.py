"""The default pair's draft pass at a long context, and the attention's share of it.

One pass over the block after a context of each --contexts positions (random keys and values
already in the drafter's cache; each pass also takes in --new positions of random taps, as a
cycle takes in the kept ones, which are trimmed off again after it), median of --reps. Beside it,
the attention alone: every layer's block queries over that context plus the block, as one
joined array each. What the pass costs beyond the attention should not grow with the context.

With --before DIR the same is measured for the dflash_mlx under DIR (e.g. a checkout of the
previous version) and for this one, in fresh processes taking turns, --rounds each:

    git archive REV dflash_mlx assets | tar -x -C BEFORE     # the older code, in a folder BEFORE
    python -m dflash_mlx.cpu.openblas python recipes/archive/draft_pass_context.py --before BEFORE
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from turns import run_in_turns


def measure(contexts: list[int], reps: int, new: int) -> dict:
    from dflash_mlx import load
    from dflash_mlx.cpu import fast_math
    from dflash_mlx.cpu.speedups import choose_speedups
    from dflash_mlx.loop.cache import make_draft_cache

    model, draft, _ = load(dtype="float32")
    speedups = choose_speedups(mx.float32)
    args = draft.args
    width = len(draft.target_layer_ids) * args.hidden_size
    block = mx.array([[5] + [draft.mask_token_id] * (draft.block_size - 1)])
    kv = (1, args.num_key_value_heads)

    def median_ms(fn) -> float:
        fn()
        fn()  # warm: compiled, and the cache's buffer grown past the block
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            fn()
            times.append(time.perf_counter() - tic)
        return 1000 * statistics.median(times)

    out = {}
    for context in contexts:
        mx.random.seed(0)
        cache = make_draft_cache(draft)
        shape = (*kv, context, args.head_dim)
        for c in cache:
            c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval([c.keys for c in cache], [c.values for c in cache])
        taps = mx.random.normal((1, new, width))

        def draft_pass():
            mx.eval(draft.propose(model, block, taps, cache, speedups))
            for c in cache:
                c.trim(new)

        total = context + new + draft.block_size
        q = mx.random.normal((1, args.num_attention_heads, draft.block_size, args.head_dim))
        keys = [mx.random.normal((*kv, total, args.head_dim)) for _ in draft.layers]  # joined, as before
        values = [mx.random.normal((*kv, total, args.head_dim)) for _ in draft.layers]
        mx.eval(q, keys, values)
        scale = args.head_dim**-0.5

        def attention():
            mx.eval([fast_math.attention(q, k, v, scale, fast_exp=speedups.fast_exp) for k, v in zip(keys, values)])

        out[context] = {"pass_ms": median_ms(draft_pass), "attention_ms": median_ms(attention)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--new", type=int, default=4, help="context positions each pass takes in")
    parser.add_argument("--before", help="a folder whose dflash_mlx is measured as the version before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line (used for --before)")
    args = parser.parse_args()
    if args.before is None:
        result = measure(args.contexts, args.reps, args.new)
        if args.json:
            print(json.dumps(result))
            return
        for context, r in result.items():
            print(f"{context:>6} context: pass {r['pass_ms']:.2f} ms, attention {r['attention_ms']:.2f} ms, "
                  f"beyond it {r['pass_ms'] - r['attention_ms']:.2f} ms")  # fmt: skip
        return

    argv = ["--json", "--reps", str(args.reps), "--new", str(args.new), "--contexts", *map(str, args.contexts)]
    runs = run_in_turns(args.before, argv, args.rounds)
    print(f"median of {args.rounds} rounds (each a median of {args.reps} passes), ms")
    print(f"{'context':>7} | pass: before, after | attention: before, after | beyond it: before, after")
    for c in map(str, args.contexts):
        med = {n: {k: statistics.median(r[c][k] for r in runs[n]) for k in ("pass_ms", "attention_ms")} for n in runs}
        (b, att_b), (a, att_a) = ((med[n]["pass_ms"], med[n]["attention_ms"]) for n in ("before", "after"))
        print(f"{c:>7} | {b:.2f}, {a:.2f} | {att_b:.2f}, {att_a:.2f} | {b - att_b:.2f}, {a - att_a:.2f}")


if __name__ == "__main__":
    main()
