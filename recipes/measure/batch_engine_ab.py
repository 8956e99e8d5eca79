"""The batching engine against itself with one of its parts taken out, in one process taking turns: N held-out
chat prompts decoded at once, greedy, on an embedded pair, with the tools' default drafting (the drafter, prompt
lookup and, on the default pair, its datastore's trees). ``--compare drafts``: the rows' drafter passes run as one
pass against each row drafting alone; ``--compare trees``: shared passes verifying draft trees whole against
each tree's likeliest line. Prints each arm's aggregate tok/s (the first token of each reply on, prefills
included), the drafter passes run batched, and whether both arms wrote the same tokens as each prompt alone.

    python -m dflash_mlx.cpu.openblas python recipes/measure/batch_engine_ab.py --model dflash-tiny --rows 4
    python -m dflash_mlx.cpu.openblas python recipes/measure/batch_engine_ab.py --rows 4 --no-adaptive
    python -m dflash_mlx.cpu.openblas python recipes/measure/batch_engine_ab.py --rows 4 --compare trees

``--no-adaptive`` drafts every cycle (the adaptive policy pauses a drafter that does not pay for itself, which on
the default pair's chat prompts is most cycles).
"""

import argparse
import json
import time

from dflash_mlx import LoopOptions, load, make_cache, stream_generate
from dflash_mlx.cpu.openblas import blas_in_use
from dflash_mlx.cpu.speedups import choose_speedups
from dflash_mlx.drafts.datastore import pair_datastore
from dflash_mlx.generation import batch_request
from dflash_mlx.loading.pairs import DEFAULT_PAIR, embedded_pair_path
from dflash_mlx.loop.batch import BatchEngine
from dflash_mlx.models import target as tgt
from dflash_mlx.tuning.policy import PolicyState


class RowByRow(BatchEngine):
    """Every row's drafter pass its own."""

    def _draft_together(self, passes) -> None:
        pass


class Lines(BatchEngine):
    """Shared passes verify each draft tree's likeliest line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trees = False


def _run(engine, model, draft, ids, options) -> tuple[list[list[int]], float, int]:
    rows = [engine.add(batch_request(model, draft, p, options), lambda: make_cache(model, draft)) for p in ids]
    out = {r: [] for r in rows}
    tic = time.perf_counter()
    while not engine.idle:
        for e in engine.step():
            out[e.id].extend(e.tokens)
    return [out[r] for r in rows], time.perf_counter() - tic, engine.drafted_together


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_PAIR, help="An embedded pair: the default one or dflash-tiny.")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-adaptive", action="store_true")
    parser.add_argument("--compare", choices=["drafts", "trees"], default="drafts")
    args = parser.parse_args()
    folder = embedded_pair_path(args.model)
    model, draft, tok = load(args.model)
    rows = [r for r in map(json.loads, open(folder / "prompts.jsonl")) if "messages" in r][: args.rows]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
    # Greedy: the datastore changes no token; left out here so that no reply joins it before the arms run.
    alone = [
        [t for r in stream_generate(model, draft, tok, p, max_tokens=args.max_tokens, datastore=None) for t in r.tokens]
        for p in ids
    ]
    speedups = choose_speedups(tgt.compute_dtype(model), None)
    print("BLAS:", blas_in_use(), flush=True)
    store = pair_datastore(model, draft)  # the engine's rows add no reply to it

    def options():  # a fresh policy state each run: neither arm goes on from what the other learned
        return LoopOptions(max_tokens=args.max_tokens, stop_tokens=frozenset(tok.eos_token_ids), policy=PolicyState(),
                           adaptive=False if args.no_adaptive else None, datastore=store)  # fmt: skip

    arms = (
        {"together": BatchEngine, "row by row": RowByRow}
        if args.compare == "drafts"
        else {"trees": BatchEngine, "lines": Lines}
    )
    totals = {a: [0.0, 0, 0] for a in arms}
    same = True
    for k in range(args.rounds + 1):  # the first round warms up
        for name in list(arms) if k % 2 else [*arms][::-1]:
            engine = arms[name](model, tap_ids=draft.target_layer_ids, max_batch=args.rows, speedups=speedups)
            out, seconds, together = _run(engine, model, draft, ids, options())
            same &= all(o[: len(a)] == a for o, a in zip(out, alone))
            if k:
                totals[name][0] += seconds
                totals[name][1] += sum(len(o) for o in out)
                totals[name][2] += together
            print(
                f"round {k} {name}: {sum(len(o) for o in out) / seconds:.1f} tok/s, {together} passes batched",
                flush=True,
            )
    rates = {a: n / s for a, (s, n, _) in totals.items()}
    first, second = arms
    print(f"{args.model}, {args.rows} rows, {args.max_tokens} tokens, adaptive {'off' if args.no_adaptive else 'on'}: "
          + "  ".join(f"{a} {r:.1f} tok/s" for a, r in rates.items())
          + f"  ratio {rates[first] / rates[second]:.2f}x")  # fmt: skip
    print("every reply as alone:", same)


if __name__ == "__main__":
    main()
