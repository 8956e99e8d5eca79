"""The default pair's target pass by its number of tokens, under whichever BLAS this process runs: one pass at
1, 2, 3, 4, 8 and 16 tokens after a 300-token context, the median of 12, the head's argmax and the drafter's taps
included (what a verify pass computes). With ``--compare-cpu-steps`` also the same passes through mlx-lm's own
layers, turn about, to show what the compiled CPU steps save.

    python -m dflash_mlx.cpu.openblas python recipes/measure/target_pass_sizes.py            # MKL where installed
    python -m dflash_mlx.cpu.openblas python recipes/measure/target_pass_sizes.py --compare-cpu-steps
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python recipes/measure/target_pass_sizes.py
"""

import argparse
import time

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.cpu.openblas import blas_in_use
from dflash_mlx.cpu.speedups import CpuSpeedups
from dflash_mlx.loop.cache import make_cache
from dflash_mlx.models import target as tgt

parser = argparse.ArgumentParser()
parser.add_argument("--context", type=int, default=300)
parser.add_argument("--compare-cpu-steps", action="store_true")
args = parser.parse_args()

model, draft, _ = load()
taps = draft.target_layer_ids
arms = {"cpu steps": CpuSpeedups()}
if args.compare_cpu_steps:
    arms["mlx-lm layers"] = CpuSpeedups(min_tokens=10**6)
cache = make_cache(model, draft)
_, t = tgt.forward_with_taps(model, mx.random.randint(0, 49000, (1, args.context)), cache.target, taps, CpuSpeedups())
mx.eval(t, [c.state for c in cache.target])
print(f"BLAS: {blas_in_use()}; context {args.context}")
for n in (1, 2, 3, 4, 8, 16):
    times = {name: [] for name in arms}
    for _ in range(14):
        for name, speedups in arms.items():
            tic = time.perf_counter()
            logits, tapped = tgt.forward_with_taps(model, mx.array([[1] * n]), cache.target, taps, speedups)
            mx.eval(logits.argmax(-1), tapped)
            times[name].append(time.perf_counter() - tic)
            for c in cache.target:
                c.trim(n)
    median = {name: sorted(v[2:])[len(v[2:]) // 2] * 1e3 for name, v in times.items()}
    print(f"{n:3d} tokens: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in median.items()), flush=True)
