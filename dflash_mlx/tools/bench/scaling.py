"""Scaling mode of dflash-bench: the loop's cost on larger, memory-bound targets.

Random-weight targets with real model shapes (fp32) stand in for trained ones: the time of a
forward pass does not depend on the weights' values. The real loop runs with a drafter of the
paper's shape; its measured cycle time, with a recorded mean acceptance length, projects the
speedup that acceptance would give on that target, and shows the loop's own overhead.
"""

import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3

from ...generation import dflash_generate_step
from ...loop.options import LoopOptions
from ...models.drafter import DraftArgs, DraftModel, default_target_layer_ids

# Qwen3 shapes from their published configs.
SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        vocab_size=151936,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        intermediate_size=6144,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        vocab_size=151936,
    ),
}
DRAFT_LAYERS = 5


def build_pair(shape: str, block_size: int = 16, dtype=mx.float32) -> tuple:
    """A random Qwen3 target of ``shape`` and a 5-layer DFlash drafter made for it."""
    s = SHAPES[shape]
    vocab = s["vocab_size"]
    config = dict(s, model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1e6)
    target = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    target.set_dtype(dtype)
    draft_args = DraftArgs.from_dict(
        dict(
            s,
            num_hidden_layers=DRAFT_LAYERS,
            block_size=block_size,
            rope_theta=1e6,
            mask_token_id=vocab - 1,
            target_layer_ids=default_target_layer_ids(s["num_hidden_layers"], DRAFT_LAYERS),
        )
    )
    draft = DraftModel(draft_args)
    draft.set_dtype(dtype)
    mx.eval(target.parameters(), draft.parameters())
    return target, draft


def _per_token_seconds(step_iter, count: int) -> float:
    """Seconds per emitted token after the first, over ``count`` tokens."""
    first, n, tic = True, 0, 0.0
    for out in step_iter:
        if first:
            tic, first = time.perf_counter(), False
            continue
        n += len(out) if isinstance(out, list) else 1
        if n >= count:
            break
    return (time.perf_counter() - tic) / max(n, 1)


def measure_shape(shape: str, taus: dict[int, float], prompt_len: int = 64, tokens: int = 24) -> list[dict]:
    """Measure plain decoding and the DFlash cycle on ``shape``; project each block size's speedup."""
    target, draft = build_pair(shape, block_size=max(taus))
    prompt = mx.random.randint(0, SHAPES[shape]["vocab_size"] - 1, (prompt_len,)).tolist()
    ar = statistics.median(
        _per_token_seconds(generate_step(mx.array(prompt), target, max_tokens=tokens + 1), tokens) for _ in range(2)
    )
    rows = []
    for block_size, tau in sorted(taus.items()):
        cycles = []
        for _ in range(2):
            options = LoopOptions(block_size=block_size, max_tokens=tokens * block_size)
            steps = dflash_generate_step(prompt, target, draft, options)
            next(steps)
            tic = time.perf_counter()
            n = 0
            for _ in steps:
                n += 1
                if n == 6:
                    break
            cycles.append((time.perf_counter() - tic) / n)
        cycle = statistics.median(cycles)
        rows.append(
            {
                "shape": shape,
                "block_size": block_size,
                "tau": tau,
                "ar_step_ms": 1e3 * ar,
                "cycle_ms": 1e3 * cycle,
                "projected_speedup": tau * ar / cycle,
            }
        )
    del target, draft
    mx.clear_cache()
    return rows


def scaling_markdown(rows: list[dict]) -> str:
    lines = [
        "| target shape (random fp32) | block | recorded tau | AR step ms | DFlash cycle ms | projected speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['block_size']} | {r['tau']:.2f} | {r['ar_step_ms']:.1f} | {r['cycle_ms']:.1f} | "
            f"{r['projected_speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
