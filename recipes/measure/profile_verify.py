"""Where a verify pass's time goes on MLX's CPU backend: the numbers behind BENCHMARKS.md.

Times one target pass of 1 token (an AR step) and of B tokens at a fixed context (fp32):
through mlx-lm's own decoder layers ("stock"), again with the two places a pass calls exp
(SwiGLU's sigmoid and the attention softmax) replaced by exp-free stand-ins of the same
shapes, and as dflash_mlx runs it, with its CPU kernels (dflash_mlx.cpu.fast_math) and compiled
layer steps (dflash_mlx.cpu.compiled_layers). DFlash makes no 1-token target passes, so dflash_mlx leaves
those to mlx-lm's layers; the last row forces them through the compiled steps too, to show
what an AR step would gain from the same treatment. The stand-ins
give wrong outputs: they exist only to measure what exp costs, and are swapped in for the
timing and restored after. Also prints the per-element cost of exp and of an add.

    LD_PRELOAD=<path to libopenblas.so.0> OPENBLAS_NUM_THREADS=1 \\
        python recipes/measure/profile_verify.py
"""

import argparse
import statistics
import time

import mlx.core as mx
import mlx_lm.models.qwen3 as qwen3

from dflash_mlx import load
from dflash_mlx.cpu.speedups import CPU_SPEEDUPS, CpuSpeedups
from dflash_mlx.loop.cache import make_cache
from dflash_mlx.models import target as tgt


def _per_element_ns(fn, n: int = 1 << 20, repeats: int = 20) -> float:
    x = mx.random.normal((n,))
    mx.eval(x)
    mx.eval(fn(x))
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(x))
    return (time.perf_counter() - tic) / repeats / n * 1e9


def _sdpa_without_softmax(queries, keys, values, cache, scale, mask, sinks=None):
    # The same two matmuls as the unfused attention, with the softmax replaced by a scale.
    b, n_q, length, dim = queries.shape
    n_kv = keys.shape[1]
    q = queries.reshape(b, n_kv, n_q // n_kv, length, dim) * scale
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    scores = scores * (1.0 / scores.shape[-1])
    return (scores @ mx.expand_dims(values, 2)).reshape(b, n_q, length, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=153, help="Cached tokens before the pass.")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12, help="Interleaved rounds of 10 passes each.")
    args = parser.parse_args()

    model, draft, _ = load(dtype="float32")
    if model.model_type != "qwen3":
        raise SystemExit("profile_verify.py swaps Qwen3's activation and attention; the target is not Qwen3.")
    cache = make_cache(model, draft)
    _, taps = tgt.forward_with_taps(model, mx.array([[1] * args.context]), cache.target, draft.target_layer_ids)
    mx.eval(taps, [c.state for c in cache.target])

    def target_pass(n: int, use_kernels: bool, force: bool = False) -> None:
        # Without the speedups, forward_with_taps calls mlx-lm's layers as they are, which is
        # where the stand-ins take effect; min_tokens=1 sends 1-token passes through them too.
        speedups = (CpuSpeedups(min_tokens=1) if force else CPU_SPEEDUPS) if use_kernels else None
        logits, taps = tgt.forward_with_taps(model, mx.array([[1] * n]), cache.target, draft.target_layer_ids, speedups)
        mx.eval(mx.argmax(logits, axis=-1), taps)
        for c in cache.target:
            c.trim(n)

    stock = (qwen3.swiglu, qwen3.scaled_dot_product_attention)
    variants = {
        "stock": stock,
        "SwiGLU without exp": (lambda gate, x: gate * x, stock[1]),
        "attention without softmax": (stock[0], _sdpa_without_softmax),
        "neither": (lambda gate, x: gate * x, _sdpa_without_softmax),
        "dflash_mlx": stock,
        "dflash_mlx, 1-token passes compiled too": stock,
    }
    sizes = (1, args.block_size)
    samples = {(v, n): [] for v in variants for n in sizes}
    try:
        for _ in range(args.rounds):
            for name, (swiglu, sdpa) in variants.items():
                qwen3.swiglu, qwen3.scaled_dot_product_attention = swiglu, sdpa
                use_kernels, force = name.startswith("dflash_mlx"), name.endswith("too")
                for n in sizes:
                    target_pass(n, use_kernels, force)
                    tic = time.perf_counter()
                    for _ in range(10):
                        target_pass(n, use_kernels, force)
                    samples[(name, n)].append((time.perf_counter() - tic) / 10 * 1e3)
    finally:
        qwen3.swiglu, qwen3.scaled_dot_product_attention = stock

    print(f"exp: {_per_element_ns(mx.exp):.2f} ns/element, add: {_per_element_ns(lambda x: x + 1):.2f} ns/element")
    print(f"\ncontext {args.context}, median of {args.rounds} rounds of 10 passes (ms)\n")
    print(f"| variant | 1 token | {args.block_size} tokens | difference |")
    print("|---|---|---|---|")
    for name in variants:
        one, block = (statistics.median(samples[(name, n)]) for n in sizes)
        print(f"| {name} | {one:.2f} | {block:.2f} | {block - one:.2f} |")


if __name__ == "__main__":
    main()
