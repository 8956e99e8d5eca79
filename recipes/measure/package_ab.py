"""Two versions of the package in one process, taking turns: mlx-lm's plain decoding, then generate's defaults
(datastore and adaptive policy, as the tools run them) with an earlier version of dflash_mlx and with this one, on
the default pair's held-out prompts, greedy; a warm-up round, then rounds whose tokens per second add up, and
whether both versions wrote the same tokens.

The earlier version is a copy of its package renamed ``dflash_base``, made once with
``git archive REV dflash_mlx | tar -x -C DIR && mv DIR/dflash_mlx DIR/dflash_base`` and then
``grep -rl dflash_mlx --include=*.py DIR/dflash_base | xargs sed -i s/dflash_mlx/dflash_base/g``.

    python -m dflash_mlx.cpu.openblas python recipes/measure/package_ab.py DIR ROUNDS PROMPTS MAX_TOKENS
"""

import json
import sys
import time
from importlib import import_module

from mlx_lm.generate import stream_generate as mlx_stream

import dflash_mlx
from dflash_mlx.cpu.openblas import blas_in_use


def _side(pkg):
    """The pair, the datastore and a policy state, found where that version keeps them."""
    name = pkg.__name__

    def first(*modules):
        for module in modules:
            try:
                return import_module(name + module)
            except ModuleNotFoundError:
                continue
        raise ModuleNotFoundError(f"{name}: none of {modules}")

    model, draft, tok = pkg.load()
    pairs = import_module(name + ".loading.pairs")
    store = first(".tools.session", ".drafts.datastore", ".datastore").open_datastore(
        "auto", pairs.DEFAULT_PAIR, 49152, learns=False
    )
    policy = first(".tuning.policy", ".adaptive").PolicyState()
    return model, draft, tok, store, policy


def main(folder: str, rounds: int, prompts: int, max_tokens: int) -> None:
    sys.path.insert(0, folder)
    base = import_module("dflash_base")
    sides = {"before": (base, *_side(base)), "after": (dflash_mlx, *_side(dflash_mlx))}
    print("before from", base.__file__, "| after from", dflash_mlx.__file__)
    print("BLAS:", blas_in_use(), flush=True)
    _, model, _, tok, *_ = sides["after"]
    path = import_module("dflash_mlx.loading.pairs").default_pair_path() / "prompts.jsonl"
    rows = [json.loads(line) for line in open(path)][:prompts]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
    arms = ["mlx-lm", "before", "after"]
    totals = {a: [0.0, 0] for a in arms}
    outs = {}
    for rnd in range(rounds + 1):
        for arm in arms if rnd % 2 == 0 else arms[:1] + arms[1:][::-1]:
            for i, prompt in enumerate(ids):
                if arm == "mlx-lm":
                    steps = mlx_stream(model, tok, prompt, max_tokens=max_tokens)
                else:
                    pkg, m, d, t, store, policy = sides[arm]
                    steps = pkg.stream_generate(m, d, t, prompt, max_tokens=max_tokens, datastore=store, policy=policy)
                tokens, first = [], None
                for r in steps:
                    tokens += [r.token] if arm == "mlx-lm" else r.tokens
                    if first is None:  # generation time only, from the first token on
                        first = time.perf_counter()
                dt = time.perf_counter() - first
                if arm != "mlx-lm":
                    outs.setdefault(i, set()).add(tuple(tokens))
                if rnd:
                    totals[arm][0] += dt
                    totals[arm][1] += len(tokens) - 1
        if rnd:
            plain = totals["mlx-lm"][1] / totals["mlx-lm"][0]
            line = "  ".join(
                f"{a} {totals[a][1] / totals[a][0]:.1f} tok/s ({totals[a][1] / totals[a][0] / plain:.3f}x)"
                for a in arms
            )
            print(f"round {rnd}: {line}", flush=True)
    print("both versions wrote the same tokens:", all(len(v) == 1 for v in outs.values()))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
