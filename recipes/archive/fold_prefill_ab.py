"""The default pair's prefill with the taps folded through the drafter's ``fc`` by the target
(``FoldedTaps``, what ``Verifier.prefill`` does) against the raw taps handed to the drafter, in one
process taking turns: seconds per prefill of --length random token ids, chunks of 512, fp32.

The raw side is the same drafter with :meth:`DraftModel.tap_blocks` answering None, as it does
for a quantized ``fc``.

    python -m dflash_mlx.cpu.openblas python recipes/archive/fold_prefill_ab.py --length 2048 --rounds 4
"""

import argparse
import statistics
import time

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.cpu.speedups import choose_speedups
from dflash_mlx.drafts.proposer import DFlashProposer
from dflash_mlx.loop.cache import make_cache
from dflash_mlx.loop.verify import Verifier
from dflash_mlx.models.drafter import DraftModel


class RawTaps(DraftModel):
    def tap_blocks(self):
        return None


def prefill_seconds(model, draft, ids: list[int], speedups) -> float:
    cache = make_cache(model, draft)
    verifier = Verifier(
        model, cache, sampler=None, logits_processors=None, tap_ids=draft.target_layer_ids, speedups=speedups,
    )  # fmt: skip
    start = time.perf_counter()
    verifier.prefill(ids, 512, DFlashProposer(model, draft, cache, speedups=speedups))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model, draft = load(dtype="float32")[:2]
    speedups = choose_speedups(mx.float32)
    ids = mx.random.randint(100, 40000, (args.length,), key=mx.random.key(0)).tolist()
    folded = draft
    raw = RawTaps(draft.args)
    raw.update(draft.parameters())
    prefill_seconds(model, folded, ids[:256], speedups)  # warm-up
    times = {"folded": [], "raw": []}
    for _ in range(args.rounds):
        for name, drafter in (("folded", folded), ("raw", raw)):
            times[name].append(prefill_seconds(model, drafter, ids, speedups))
    for name, values in times.items():
        print(f"{name:>6}: {' '.join(f'{t:.2f}' for t in values)} s; median {statistics.median(values):.2f} s")


if __name__ == "__main__":
    main()
