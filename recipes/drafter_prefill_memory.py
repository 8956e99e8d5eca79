"""The drafter's memory after a long prompt: its keys and values, against the peak it took.

The default pair's drafter (fp32) is fed a prompt of each --contexts positions through the
prefill (``Verifier.prefill``, chunks of --chunk) and then runs its first draft pass. The target
is a stand-in that only hands out random taps of the right width per chunk (and one logits
row), so all the memory measured beyond it is the drafter's side: the taps waiting for the
drafter, its context cache, and the pass. Reported in MB: the drafter's keys and values from
their shapes, the peak increase during the prefill and during the first pass (over the memory
in use before the prompt), and what stays held after.

    python -m dflash_mlx.cpu.openblas python recipes/drafter_prefill_memory.py
    PYTHONPATH=BEFORE python recipes/drafter_prefill_memory.py   # the version before, to compare
"""

import argparse
import inspect

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.cache import make_cache
from dflash_mlx.cpu.speedups import choose_speedups
from dflash_mlx.models import target as tgt
from dflash_mlx.proposer import DFlashProposer
from dflash_mlx.verify import Verifier

MB = 1024**2


class TapsOnly(Verifier):
    """A target that costs nothing: random taps of the drafter's width, one logits row."""

    def _forward(self, tokens: mx.array):
        width = len(self.tap_ids) * self.width
        return mx.zeros((1, 1, self.vocab)), mx.random.normal((1, tokens.shape[1], width))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--chunk", type=int, default=512, help="prefill_step_size")
    parser.add_argument(
        "--no-cpu-speedups", action="store_true",
        help="MLX's own ops, as on a GPU (the CPU's fused-exp attention keeps several score-sized arrays)",
    )  # fmt: skip
    args = parser.parse_args()
    model, draft, _ = load(dtype="float32")
    speedups = None if args.no_cpu_speedups else choose_speedups(mx.float32)
    a = draft.args
    # The version before this one's Verifier took no drafter: its taps waited in pending.
    feeds = "draft" in inspect.signature(Verifier.__init__).parameters
    print(f"prefill hands taps to the drafter: {feeds}; CPU speedups: {speedups is not None}; "
          f"drafter: {a.num_hidden_layers} layers, {a.num_key_value_heads} KV heads x {a.head_dim}, "
          f"{len(draft.target_layer_ids)} taps x {a.hidden_size}")  # fmt: skip
    for context in args.contexts:
        cache = make_cache(model, draft)
        extra = {"draft": draft} if feeds else {}
        verifier = TapsOnly(
            model, cache, sampler=None, logits_processors=None, tap_ids=draft.target_layer_ids,
            speedups=speedups, **extra,
        )  # fmt: skip
        verifier.width, verifier.vocab = a.hidden_size, tgt.vocab_size(model)
        mx.random.seed(0)
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        last = verifier.prefill([1] * context, args.chunk)
        prefill_peak = mx.get_peak_memory() - base
        mx.reset_peak_memory()
        proposal = DFlashProposer(model, draft, cache, speedups=speedups).propose(last, draft.block_size - 1)
        mx.eval(proposal.tokens)
        pass_peak = mx.get_peak_memory() - base
        held = mx.get_active_memory() - base
        kv = a.num_hidden_layers * 2 * context * a.num_key_value_heads * a.head_dim * 4
        taps = context * len(draft.target_layer_ids) * a.hidden_size * 4
        print(f"{context:>6} context: K/V {kv / MB:.1f} MB (raw taps would be {taps / MB:.1f}); peak increase: "
              f"prefill {prefill_peak / MB:.1f} MB ({prefill_peak / kv:.2f}x K/V), first pass {pass_peak / MB:.1f} MB "
              f"({pass_peak / kv:.2f}x); held after {held / MB:.1f} MB")  # fmt: skip
        del cache, verifier, proposal


if __name__ == "__main__":
    main()
