"""The new user's trial on the default pair: dflash-generate against mlx-lm's own generate, BLAS x dtype.

Each configuration runs as a fresh process, round robin (a slow spell of the machine costs every one a run),
on the same prompt and token count; the median generation tok/s and its ratio to mlx-lm's are printed.
mlx-lm runs with OpenBLAS preloaded by hand; the dflash tools start from an environment without LD_PRELOAD,
as a new user's shell would, and preload it themselves.

    python recipes/measure/new_user_trial.py --target runs/smollm2/target --max-tokens 100 --rounds 3
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from dflash_mlx.cpu.openblas import find_openblas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="The default pair's target as an mlx-lm folder (for mlx-lm).")
    parser.add_argument("--prompt", default="Explain what a hash table is")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="Run only the configurations whose name contains one of these (mlx_lm's always runs).",
    )
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    clean = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    preloaded = {**clean, "LD_PRELOAD": find_openblas() or ""}
    gen = [str(bin_dir / "dflash-generate"), "--prompt", args.prompt, "--max-tokens", str(args.max_tokens)]
    configs = {
        "mlx_lm generate (OpenBLAS preloaded)": (
            [sys.executable, "-m", "mlx_lm", "generate", "--model", args.target, "--prompt", args.prompt,
             "--max-tokens", str(args.max_tokens)], preloaded),
        "dflash-generate (defaults)": (gen, clean),
        "dflash-generate --no-draft": (gen + ["--no-draft"], clean),
        "dflash-generate --paused-lookup 0": (gen + ["--paused-lookup", "0"], clean),
        "dflash-generate --dtype bfloat16": (gen + ["--dtype", "bfloat16"], clean),
        "dflash-generate --blas bundled": (gen + ["--blas", "bundled"], clean),
        "dflash-generate --blas bundled --dtype bfloat16": (gen + ["--blas", "bundled", "--dtype", "bfloat16"], clean),
    }  # fmt: skip
    if args.only:
        configs = {k: v for i, (k, v) in enumerate(configs.items()) if i == 0 or any(o in k for o in args.only)}
    results = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (cmd, env) in configs.items():
            out = subprocess.run(cmd, env=env, capture_output=True, text=True).stdout
            g = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", out)
            p = re.search(r"Prompt: (\d+) tokens.*?, ([\d.]+) tokens-per-sec", out)
            blas = re.search(r"BLAS: (.*)", out)
            acc = re.search(r"Acceptance length: (.*)", out)
            results[name].append(float(g.group(2)) if g else None)
            print(
                f"round {r} | {name} | gen {g and g.group(2)} tok/s ({g and g.group(1)} tokens) | prompt "
                f"{p and p.group(2)} tok/s | {blas and blas.group(1)} | {acc and acc.group(1)}",
                flush=True,
            )
    print(json.dumps(results))
    med = {name: sorted(v for v in rs if v)[len([v for v in rs if v]) // 2] for name, rs in results.items() if any(rs)}
    base = med.get("mlx_lm generate (OpenBLAS preloaded)")
    for name, m in med.items():
        print(f"{name}: median {m:.2f} tok/s" + (f", {m / base:.2f}x mlx_lm" if base else ""))


if __name__ == "__main__":
    main()
