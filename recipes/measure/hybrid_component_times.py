"""The DFlash loop's passes on a hybrid target of a real Qwen3.5 shape: the numbers behind BENCHMARKS.md.

Builds a random-weight Qwen3.5 of Qwen3.5-0.8B's published shape (``text_config`` of
Qwen/Qwen3.5-0.8B: hidden 1024, 24 layers of which every 4th is full attention, 8 attention
heads of 256 with 2 KV heads, 16/16 linear key/value heads of 128, conv kernel 4, MLP 3584,
vocabulary 248320, tied embeddings), fp32, and a 5-layer drafter of the published Qwen3.5
drafters' shape for it (z-lab's: Qwen3 layers of the target's width and MLP, 32 heads of 128
with 8 KV heads, rope theta 1e7, block 16, taps from ``default_target_layer_ids``). Qwen3.5-4B
(~18 GB in fp32) would not fit; the weights' values do not change a pass's time.

Then ``bench_timing.component_times`` at ``--context`` tokens: one AR step, a verify pass of
each block size B, one drafter pass (always the drafter's full block of 16, as the loop runs
it) and the rollback after a B-token verify that kept k drafts, each the fastest of
``--rounds`` rounds of ``--repeats`` runs (merged by ``bench_timing.fastest_times``: on a
shared machine a busy phase can last through all runs of one pass). Prints, per B, those times,
the rollback's share of a cycle ``t_rollback / (t_draft + t_verify + t_rollback)`` at each
measured k and at the mean over k = 0..B-1 (interpolated as ``bench_stats.mean_rollback``
does), and ``bench_stats.physical_limit`` at tau = min(--tau, B) without a rollback and with
that mean rollback. The default tau 6.49 is the paper's Qwen3-8B mean at B = 16; min(tau, B)
is only an upper bound for B < 16 (B = 4 then assumes every block kept whole).

    LD_PRELOAD=<libopenblas.so.0> OPENBLAS_NUM_THREADS=1 \\
        python recipes/measure/hybrid_component_times.py --json hybrid_times.json
"""

import argparse
import json
import resource
import time

import mlx.core as mx
from mlx_lm.models import qwen3_5

from dflash_mlx.models.drafter import DraftArgs, DraftModel, default_target_layer_ids
from dflash_mlx.tools.bench.stats import mean_rollback, physical_limit
from dflash_mlx.tools.bench.timing import component_times, fastest_times

# text_config of Qwen/Qwen3.5-0.8B's config.json (the fields mlx-lm's qwen3_5 reads).
QWEN3_5_0_8B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "attention_bias": False, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6, "full_attention_interval": 4, "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True,
    },
}  # fmt: skip
DRAFT_LAYERS = 5
PAPER_TAU = 6.49  # the paper's Qwen3-8B mean acceptance length at B = 16


def build_pair(layers: int, block_size: int = 16) -> tuple:
    """The random fp32 target (``layers`` deep) and its 5-layer drafter."""
    text = dict(QWEN3_5_0_8B, num_hidden_layers=layers)
    target = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    draft = DraftModel(
        DraftArgs.from_dict(
            {
                "hidden_size": text["hidden_size"],
                "intermediate_size": text["intermediate_size"],
                "num_hidden_layers": DRAFT_LAYERS,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "rope_theta": 1e7,
                "vocab_size": text["vocab_size"],
                "block_size": block_size,
                "mask_token_id": text["vocab_size"] - 1,
                "num_target_layers": layers,
                "target_layer_ids": default_target_layer_ids(layers, DRAFT_LAYERS),
            }
        )  # fmt: skip
    )
    target.set_dtype(mx.float32)
    draft.set_dtype(mx.float32)
    mx.eval(target.parameters(), draft.parameters())
    return target, draft


def summarize(times: dict, block_sizes: list[int], tau: float) -> list[dict]:
    """Per block size: the passes in ms, the rollback's share of a cycle, and the limits."""
    rows = []
    for b in block_sizes:
        t_verify, t_draft, by_k = times["verify"][b], times["draft"][b], times["rollback"][b]
        # Every k in 0..B-1 once: a cycle keeping k drafts has acceptance length k + 1.
        t_mean = mean_rollback(by_k, b, [(k + 1, b) for k in range(b)])
        tau_b = min(tau, b)
        rows.append({
            "block_size": b, "verify_ms": 1e3 * t_verify, "draft_ms": 1e3 * t_draft, "ar_ms": 1e3 * times["ar"],
            "rollback_ms": {k: 1e3 * t for k, t in by_k.items()},
            "rollback_share": {k: t / (t_draft + t_verify + t) for k, t in by_k.items()},
            "rollback_mean_ms": 1e3 * t_mean, "rollback_mean_share": t_mean / (t_draft + t_verify + t_mean),
            "tau": tau_b, "limit_without_rollback": physical_limit(tau_b, times["ar"], t_draft, t_verify),
            "limit_with_rollback": physical_limit(tau_b, times["ar"], t_draft, t_verify, t_mean),
        })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| B | verify ms | draft ms | AR step ms | rollback ms at k (share of a cycle) | mean rollback ms over "
        "k = 0..B-1 (share) | tau | limit without rollback | limit with mean rollback |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        points = ", ".join(
            f"k={k}: {ms:.1f} ({100 * r['rollback_share'][k]:.1f}%)" for k, ms in r["rollback_ms"].items()
        )
        lines.append(
            f"| {r['block_size']} | {r['verify_ms']:.1f} | {r['draft_ms']:.1f} | {r['ar_ms']:.1f} | {points} | "
            f"{r['rollback_mean_ms']:.1f} ({100 * r['rollback_mean_share']:.1f}%) | {r['tau']:.2f} | "
            f"{r['limit_without_rollback']:.2f}x | {r['limit_with_rollback']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="Target layers, a multiple of 4 (Qwen3.5-0.8B: 24).")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--context", type=int, default=256, help="Tokens in the target's cache before each pass.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per pass and round; the fastest is kept.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of all passes; each pass keeps its fastest.")
    parser.add_argument("--tau", type=float, default=PAPER_TAU, help="Acceptance length for the limit (min(tau, B)).")
    parser.add_argument("--json", type=str, default=None, help="Write the raw times and the table's rows here.")
    args = parser.parse_args()
    if args.layers % 4 or args.layers < 4:
        parser.error(f"--layers must be a positive multiple of 4 (every 4th is full attention), got {args.layers}.")
    if max(args.block_sizes) > 16 or min(args.block_sizes) < 2:
        parser.error(f"--block-sizes must lie in 2..16 (the drafter's block), got {args.block_sizes}.")

    mx.random.seed(0)
    tic = time.perf_counter()
    target, draft = build_pair(args.layers)
    times = {}
    for _ in range(args.rounds):
        # Rounds spread each pass's samples over time, so one busy phase of the machine
        # cannot slow all of them.
        round_times = component_times(target, draft, sorted(args.block_sizes), args.context, args.repeats)
        times = fastest_times(times, round_times)
    rows = summarize(times, sorted(args.block_sizes), args.tau)
    wall = time.perf_counter() - tic
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"Random fp32 Qwen3.5-0.8B shape, {args.layers} layers ({args.layers // 4} full attention), "
        f"5-layer drafter with taps {draft.target_layer_ids}, context {args.context}, "
        f"fastest of {args.rounds} rounds x {args.repeats} runs, "
        f"device {mx.default_device()}; tau = min({args.tau}, B).\n"
    )
    print(markdown(rows))
    print(f"wall {wall:.0f} s, MLX peak {mx.get_peak_memory() / 2**30:.2f} GB, peak RSS {peak_rss_gb:.2f} GB")
    if args.json:
        out = {
            "settings": vars(args), "target_text_config": dict(QWEN3_5_0_8B, num_hidden_layers=args.layers),
            "draft_target_layer_ids": draft.target_layer_ids, "device": str(mx.default_device()),
            "times_s": times, "rows": rows, "wall_s": wall,
            "peak_memory_gb": mx.get_peak_memory() / 2**30, "peak_rss_gb": peak_rss_gb,
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
