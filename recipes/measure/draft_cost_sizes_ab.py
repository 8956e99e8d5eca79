"""Draft-free cycles sized by the cost line alone against the line plus each size's own measured cost, with
mlx-lm's plain decoding beside them: one process, rounds taking turns (the first a warm-up), greedy, the bench's
two held-out prompts, 256 tokens. Prints cumulative tokens per second, whether every arm wrote the same tokens,
and the costs the second arm learned.

    python -m dflash_mlx.cpu.openblas python recipes/measure/draft_cost_sizes_ab.py --rounds 3
"""

import argparse

from ab_rounds import run_rounds

from dflash_mlx.tuning.policy import FreeStats, PolicyState


class LineOnly(FreeStats):
    """The earlier rule: every size costs what the fitted line says."""

    def cost(self, k: int) -> float:
        return 1.0 if k == 0 else 1.0 + self.first + self.each * (k - 1)


parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
policies = {"line": PolicyState(), "sizes": PolicyState()}
policies["line"].free = LineOnly()
run_rounds({arm: dict(policy=policy) for arm, policy in policies.items()}, args.rounds)
sizes = {k: round(policies["sizes"].free.cost(k), 3) for k in range(1, 8)}
print("learned cost by drafts (plain steps):", sizes, flush=True)
