"""mlx-lm's plain decoding, then the default pair with its defaults finding its compiled CPU layer steps once per
model ("kept", as the library does) and again on every verify pass ("every pass": each layer checked and its steps
looked up, as before they were kept), one process, rounds taking turns (the first a warm-up), greedy, the bench's
two held-out prompts, 256 tokens. Prints cumulative tokens per second and whether every arm wrote the same tokens.

    python -m dflash_mlx.cpu.openblas python recipes/measure/layer_steps_ab.py --rounds 3
"""

import argparse

from ab_rounds import run_rounds

from dflash_mlx.models import target
from dflash_mlx.tuning.policy import PolicyState

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--prompts", type=int, default=2)
args = parser.parse_args()

found_once = target._cpu_steps
every_pass = {"on": False}


def steps(*a, **k):
    # The "every pass" arm forgets what was found, so each pass checks and looks up all layers again.
    if every_pass["on"]:
        target._CPU_STEPS.clear()
    return found_once(*a, **k)


target._cpu_steps = steps
run_rounds(
    {"kept": dict(policy=PolicyState()), "every pass": dict(policy=PolicyState())},
    args.rounds,
    args.prompts,
    setup={"kept": lambda: every_pass.update(on=False), "every pass": lambda: every_pass.update(on=True)},
)
