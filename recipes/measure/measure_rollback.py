"""What rolling back a hybrid target's recurrent state costs, next to the rest of a cycle.

Builds a random-weight Qwen3.5 (Gated DeltaNet layers with full attention every 4th layer)
of a given width and depth, fp32, and a DFlash drafter for it, prefills a context, then times:
a verify pass of ``--block-size`` tokens, the rollback after it for k accepted drafts
(``trim(B - 1 - k)`` on every layer: linear attention layers select the state the verify pass
kept for k + 1 tokens, or with ``--replay`` restore the state from before it and replay the
k + 1 kept tokens, as they still do after a pass longer than ``RECORD_POSITIONS``; full
attention layers lower their offset) and a drafter pass. Each
time is the median of interleaved rounds. The rollback's share of a cycle is
rollback / (drafter + verify + rollback). Defaults: a Qwen3.5-4B-like width (hidden 2560,
16/32 linear key/value heads of 128, 16 attention heads of 256 with 4 KV heads, MLP 9216)
with 8 layers; the per-layer times scale to the full depth.

    LD_PRELOAD=<openblas-pthread>/libopenblas.so.0 OPENBLAS_CORETYPE=SkylakeX \\
        python recipes/measure/measure_rollback.py
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models import qwen3_5

from dflash_mlx.loop.cache import make_cache
from dflash_mlx.models import hybrid
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftArgs, DraftModel
from dflash_mlx.models.hybrid import RecurrentCache


def _target(args) -> qwen3_5.Model:
    text = {
        "model_type": "qwen3_5_text", "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "vocab_size": args.vocab, "tie_word_embeddings": True,
        "full_attention_interval": 4,
    }  # fmt: skip
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    mx.eval(model.parameters())
    return model


def _draft(args, num_target_layers: int) -> DraftModel:
    draft = DraftModel(
        DraftArgs.from_dict(
            {
                "hidden_size": args.hidden,
                "num_hidden_layers": args.draft_layers,
                "intermediate_size": args.intermediate,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": args.vocab,
                "block_size": args.block_size,
                "mask_token_id": 0,
                "num_target_layers": num_target_layers,
                "rope_theta": 1e7,
                "target_layer_ids": list(range(1, num_target_layers, max(1, num_target_layers // 5)))[:5],
            }
        )  # fmt: skip
    )
    mx.eval(draft.parameters())
    return draft


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--intermediate", type=int, default=9216)
    parser.add_argument("--layers", type=int, default=8, help="Target layers (every 4th is full attention).")
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=256, help="Tokens prefilled before the timed passes.")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accepted", type=int, nargs="+", default=[0, 7, 15], help="k values to time.")
    parser.add_argument("--replay", action="store_true",
                        help="Keep no per-position states: every rollback replays the kept tokens.")  # fmt: skip
    args = parser.parse_args()
    if args.replay:
        hybrid.RECORD_POSITIONS = 0

    mx.random.seed(0)
    model = _target(args)
    draft = _draft(args, args.layers)
    cache = make_cache(model, draft)
    tap_ids = draft.target_layer_ids
    B = args.block_size
    prompt = mx.random.randint(0, args.vocab, (1, args.context))
    _, taps = tgt.forward_with_taps(model, prompt, cache.target, tap_ids)
    mx.eval(taps, [c.state for c in cache.target])
    base = [(list(c.cache), c.offset) if isinstance(c, RecurrentCache) else c.offset for c in cache.target]

    def reset():
        for c, b in zip(cache.target, base):
            if isinstance(c, RecurrentCache):
                c.cache, c.offset = list(b[0]), b[1]
                c.trim(0)
            else:
                c.trim(c.offset - b)

    block = mx.random.randint(0, args.vocab, (1, B))
    draft_block = mx.array([[1] + [0] * (B - 1)])
    # The drafter's context: all but the newest tap, which each timed pass injects.
    mx.eval(draft.propose(model, draft_block, taps[:, :-1], cache.draft))
    times = {"verify": [], "draft": [], **{f"rollback_k{k}": [] for k in args.accepted}}
    for _ in range(args.rounds + 1):  # the first round warms up
        tic = time.perf_counter()
        mx.eval(draft.propose(model, draft_block, taps[:, -1:], cache.draft))
        times["draft"].append(time.perf_counter() - tic)
        for c in cache.draft:
            c.trim(1)
        for k in args.accepted:
            reset()
            tic = time.perf_counter()
            logits, t = tgt.forward_with_taps(model, block, cache.target, tap_ids)
            mx.eval(logits, t, [c.state for c in cache.target])
            times["verify"].append(time.perf_counter() - tic)
            tic = time.perf_counter()
            for c in cache.target:
                c.trim(B - 1 - k)
            mx.eval([c.state for c in cache.target])
            times[f"rollback_k{k}"].append(time.perf_counter() - tic)
    times = {name: samples[len(samples) // (args.rounds + 1) :] for name, samples in times.items()}
    result = {name: _median_ms(samples) for name, samples in times.items()}
    cycle = {k: result["draft"] + result["verify"] + result[f"rollback_k{k}"] for k in args.accepted}
    result["rollback_share_of_cycle"] = {k: round(result[f"rollback_k{k}"] / cycle[k], 3) for k in args.accepted}
    result["settings"] = vars(args)
    result["device"] = str(mx.default_device())
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
