"""dflash-train's data step at one batch size: the slot engine against mlx-lm's BatchGenerator.

The same prompts (the held-out file's first ``--prompts``), greedy, one process, in turn
(A, B, A, B, ...) so that other load slows both alike; prints response tokens per second of
each run and checks that both wrote the same responses.

    python -m dflash_mlx.cpu.openblas python recipes/archive/data_step_timing.py --target runs/smollm2/target \\
        --prompts 64 --max-tokens 64 --batch-size 16 --rounds 2
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from dflash_mlx.cpu.openblas import blas_in_use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="The target folder (float32).")
    parser.add_argument("--data", default="assets/smollm2/data/prompts_heldout.jsonl")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from dflash_mlx import load
    from dflash_mlx.tools.train import batch_decode
    from dflash_mlx.tools.train.data import generate_responses, read_prompts

    model, _, tokenizer = load(args.target, dtype="float32")
    prompts = read_prompts(args.data)[: args.prompts]
    engines = {"slot engine": True, "mlx-lm BatchGenerator": False}
    rates = {name: [] for name in engines}
    answers = {}
    real_supports = batch_decode.supports
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, slots in engines.items():
                batch_decode.supports = real_supports if slots else (lambda model: False)
                cache = Path(tmp) / f"{r}-{slots}.jsonl"
                tic = time.perf_counter()
                out = generate_responses(model, tokenizer, prompts, cache, max_tokens=args.max_tokens,
                                         batch_size=args.batch_size, verbose=False)  # fmt: skip
                seconds = time.perf_counter() - tic
                tokens = sum(len(ex["response_ids"]) for ex in out)
                rates[name].append(tokens / seconds)
                answers.setdefault(name, {ex["key"]: ex["response_ids"] for ex in out})
                print(f"round {r} | {name}: {len(out)} responses, {tokens} tokens in {seconds:.1f} s = "
                      f"{tokens / seconds:.1f} tok/s", flush=True)  # fmt: skip
    batch_decode.supports = real_supports
    same = answers["slot engine"] == answers["mlx-lm BatchGenerator"]
    print(f"BLAS: {blas_in_use()}; batch {args.batch_size}; same responses: {same}")
    base = statistics.median(rates["mlx-lm BatchGenerator"])
    for name, r in rates.items():
        print(f"{name}: median {statistics.median(r):.1f} tok/s ({statistics.median(r) / base:.2f}x)")
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
