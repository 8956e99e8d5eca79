"""Two versions of the package measured by the same recipe, in fresh processes taking turns."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_in_turns(before: str, argv: list[str], rounds: int) -> dict[str, list]:
    """``rounds`` runs each of the recipe ``sys.argv[0]`` with ``argv`` (which must make it print
    one JSON line last) under the dflash_mlx of folder ``before`` and of this checkout,
    alternating: ``{"before": [result, ...], "after": [...]}``."""
    sides = {"before": str(Path(before).resolve()), "after": str(ROOT)}
    runs = {name: [] for name in sides}
    for _ in range(rounds):
        for name, path in sides.items():
            env = {**os.environ, "PYTHONPATH": path}
            line = subprocess.run([sys.executable, sys.argv[0], *argv], env=env, check=True, capture_output=True,
                                  text=True)  # fmt: skip
            runs[name].append(json.loads(line.stdout.strip().splitlines()[-1]))
    return runs
