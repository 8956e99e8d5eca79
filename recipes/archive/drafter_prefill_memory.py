"""The drafter's memory after a long prompt: its keys and values, against the peak it took.

The default pair's drafter (fp32) is fed a prompt of each --contexts positions through the
prefill (``Verifier.prefill``, chunks of --chunk) and then runs its first draft pass. The target
is a stand-in that only hands out random taps of the right width per chunk (and one logits
row), so all the memory measured beyond it is the drafter's side: the taps waiting for the
drafter, its context cache, and the pass. Reported in MB: the drafter's keys and values from
their shapes, the peak increase during the prefill and during the first pass (over the memory
in use before the prompt), and what stays held after.

    python -m dflash_mlx.cpu.openblas python recipes/archive/drafter_prefill_memory.py
    PYTHONPATH=BEFORE python recipes/archive/drafter_prefill_memory.py   # the version before, to compare

``--real-target`` runs the default pair's real target instead of the stand-in, and reports the
prefill's peak with the drafter beyond the peak of the same prefill without it (the target alone,
no taps): what drafting adds to a long prompt's prefill, the target's own activations and the
taps it makes for the drafter included.

``--shape qwen3-8b`` replaces the default pair with random weights in the shape of Qwen3-8B and
its published drafter (z-lab/Qwen3-8B-DFlash-b16: 5 layers of hidden 4096, 32 heads over 8 KV
heads of 128, taps of layers 1, 9, 17, 25, 33), in float32 as MLX's CPU backend runs it; the stand-in target has
the real embedding and head (151,936 x 4096) but only 2 thin layers, since only its taps' width
and its head matter here.
"""

import argparse
import inspect

import mlx.core as mx
from mlx_lm.models import qwen3

from dflash_mlx import load
from dflash_mlx.cpu.speedups import choose_speedups
from dflash_mlx.drafts.proposer import DFlashProposer
from dflash_mlx.loop.cache import make_cache
from dflash_mlx.loop.verify import Verifier
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftArgs, DraftModel

MB = 1024**2
# The version before the prefill handed taps to the drafter took no drafter: its taps waited in pending.
FEEDS = "drafter" in inspect.signature(Verifier.prefill).parameters


def kv_bytes(args: DraftArgs, context: int, size: int) -> int:
    """The drafter's keys and values of ``context`` positions, from their shapes."""
    return args.num_hidden_layers * 2 * context * args.num_key_value_heads * args.head_dim * size


class TapsOnly(Verifier):
    """A target that costs nothing: random taps of the drafter's width (or, asked to fold them,
    of ``fc``'s output width), one logits row. The memory its making of them takes is left out
    of ``peak`` (the taps themselves are counted)."""

    peak = 0

    def _forward(self, tokens: mx.array, last_logits: bool = False, fold=None):
        self.peak = max(self.peak, mx.get_peak_memory())
        width = self.width if fold else len(self.tap_ids) * self.width
        taps = mx.random.normal((1, tokens.shape[1], width), dtype=self.dtype)
        mx.eval(taps)
        mx.reset_peak_memory()
        return mx.zeros((1, 1, self.vocab)), taps


def qwen3_8b_shaped() -> tuple:
    """A stand-in target and a random drafter in Qwen3-8B's and its DFlash drafter's shapes (float32)."""
    shared = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
    }
    target = qwen3.Model(
        qwen3.ModelArgs(
            model_type="qwen3", num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=False, **shared
        )
    )
    draft = DraftModel(DraftArgs.from_dict({
        **shared, "model_type": "qwen3", "num_hidden_layers": 5, "intermediate_size": 12288, "num_target_layers": 36,
        "block_size": 16, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }))  # fmt: skip
    for model in (target, draft):
        mx.eval(model.parameters())
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--chunk", type=int, default=512, help="prefill_step_size")
    parser.add_argument(
        "--no-cpu-speedups", action="store_true",
        help="MLX's own ops, as on a GPU (the CPU's fused-exp attention keeps several score-sized arrays)",
    )  # fmt: skip
    parser.add_argument("--shape", choices=["default-pair", "qwen3-8b"], default="default-pair")
    parser.add_argument("--real-target", action="store_true", help="the default pair's own target (see above)")
    args = parser.parse_args()
    if args.real_target:
        return real_target(args)
    model, draft = qwen3_8b_shaped() if args.shape == "qwen3-8b" else load(dtype="float32")[:2]
    dtype = mx.float32
    size = dtype.size
    speedups = None if args.no_cpu_speedups else choose_speedups(dtype)
    a = draft.args
    print(f"prefill hands taps to the drafter: {FEEDS}; CPU speedups: {speedups is not None}; "
          f"drafter: {a.num_hidden_layers} layers, {a.num_key_value_heads} KV heads x {a.head_dim}, "
          f"{len(draft.target_layer_ids)} taps x {a.hidden_size}")  # fmt: skip
    for context in args.contexts:
        cache = make_cache(model, draft)
        feed = {"drafter": DFlashProposer(model, draft, cache, speedups=speedups)} if FEEDS else {}
        verifier = TapsOnly(
            model, cache, sampler=None, logits_processors=None, tap_ids=draft.target_layer_ids, speedups=speedups,
        )  # fmt: skip
        verifier.width, verifier.vocab, verifier.dtype = a.hidden_size, tgt.vocab_size(model), dtype
        mx.random.seed(0)
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        last = verifier.prefill([1] * context, args.chunk, **feed)
        prefill_peak = max(verifier.peak, mx.get_peak_memory()) - base
        mx.reset_peak_memory()
        proposal = DFlashProposer(model, draft, cache, speedups=speedups).propose(last, draft.block_size - 1)
        mx.eval(proposal.tokens)
        pass_peak = mx.get_peak_memory() - base
        held = mx.get_active_memory() - base
        kv = kv_bytes(a, context, size)
        taps = context * len(draft.target_layer_ids) * a.hidden_size * size
        handed = min(args.chunk, context) * len(draft.target_layer_ids) * a.hidden_size * size
        print(f"{context:>6} context: K/V {kv / MB:.1f} MB (raw taps would be {taps / MB:.1f}, one chunk's taps "
              f"{handed / MB:.1f}); peak increase: "
              f"prefill {prefill_peak / MB:.1f} MB ({prefill_peak / kv:.2f}x K/V), first pass {pass_peak / MB:.1f} MB "
              f"({pass_peak / kv:.2f}x); held after {held / MB:.1f} MB")  # fmt: skip
        del cache, verifier, proposal


def real_target(args) -> None:
    model, draft = load(dtype="float32")[:2]
    speedups = None if args.no_cpu_speedups else choose_speedups(mx.float32)
    a = draft.args
    for context in args.contexts:
        peaks = []
        for drafter in (None, draft):
            cache = make_cache(model, drafter)
            feed = {"drafter": DFlashProposer(model, drafter, cache, speedups=speedups)} if FEEDS and drafter else {}
            verifier = Verifier(
                model, cache, sampler=None, logits_processors=None,
                tap_ids=drafter.target_layer_ids if drafter else [], speedups=speedups,
            )  # fmt: skip
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            verifier.prefill([1 + i % 1000 for i in range(context)], args.chunk, **feed)
            mx.eval([c.state for c in cache.draft or []])  # the version before left the last chunk's taps pending
            peaks.append(mx.get_peak_memory() - base)
            del cache, verifier
        kv = kv_bytes(a, context, mx.float32.size)
        added = peaks[1] - peaks[0]
        print(
            f"{context:>6} context: target alone peaks {peaks[0] / MB:.1f} MB, with the drafter {peaks[1] / MB:.1f} "
            f"MB: drafting adds {added / MB:.1f} MB ({added / kv:.2f}x the drafter's K/V, {kv / MB:.1f} MB)"
        )


if __name__ == "__main__":
    main()
