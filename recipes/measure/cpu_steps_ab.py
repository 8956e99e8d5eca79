"""mlx-lm's plain decoding, then the default pair with its defaults through mlx-lm's own layers ("old") and
through the compiled CPU steps ("new": a verify pass of 2+ tokens compiled around a grouped fast-exp
attention), one process, rounds taking turns (the first a warm-up), greedy, the bench's two held-out prompts,
256 tokens. Prints cumulative tokens per second and whether every arm wrote the same tokens.

    python -m dflash_mlx.cpu.openblas python recipes/measure/cpu_steps_ab.py --rounds 3
"""

import argparse

from ab_rounds import run_rounds

from dflash_mlx.cpu.speedups import CpuSpeedups
from dflash_mlx.tuning.policy import PolicyState

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--prompts", type=int, default=2)
args = parser.parse_args()
run_rounds(
    {
        "old": dict(policy=PolicyState(), cpu_speedups=CpuSpeedups(min_tokens=10**6)),
        "new": dict(policy=PolicyState(), cpu_speedups=CpuSpeedups()),
    },
    args.rounds,
    args.prompts,
)
