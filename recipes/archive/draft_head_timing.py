"""The default pair's draft pass with the head for every slot, and for only the slots to be verified.

One pass over the block after a context of --context positions (random taps, already in the
drafter's cache), median of --reps; the head runs for `num_drafts` rows (all 15, 7, or 1).

    python -m dflash_mlx.cpu.openblas python recipes/archive/draft_head_timing.py
"""

import argparse
import statistics
import time

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.cpu.speedups import choose_speedups
from dflash_mlx.loop.cache import make_draft_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    model, draft, _ = load()
    speedups = choose_speedups(mx.float32)
    block = mx.array([[5] + [draft.mask_token_id] * (draft.block_size - 1)])
    taps = mx.random.normal((1, args.context, len(draft.target_layer_ids) * draft.args.hidden_size))

    def median_ms(num_drafts: int | None) -> float:
        times = []
        for _ in range(args.reps):
            cache = make_draft_cache(draft)
            mx.eval(draft.propose(model, block, taps, cache, speedups))  # the context, into the cache
            tic = time.perf_counter()
            mx.eval(draft.propose(model, block, None, cache, speedups, num_drafts=num_drafts))
            times.append(time.perf_counter() - tic)
        return 1000 * statistics.median(times)

    for _ in range(2):  # the first round also warms up
        print({n or draft.block_size - 1: round(median_ms(n), 1) for n in (None, 7, 1)}, "ms by drafts headed")


if __name__ == "__main__":
    main()
