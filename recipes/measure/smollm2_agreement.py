"""Do cached (batched) responses equal the target's plain greedy decoding, one prompt at a time?

Re-decodes N cached responses alone with mlx-lm's ``generate_step`` (greedy argmax, the model
as loaded: float32), stopping at an EOS id or the cached response's length cap, and reports the
share identical and, for the others, the first position where they differ.

    LD_PRELOAD=.../libopenblas.so.0 OPENBLAS_CORETYPE=SkylakeX OPENBLAS_NUM_THREADS=1 \\
    .venv/bin/python recipes/measure/smollm2_agreement.py --cache runs/smollm2/data/responses.jsonl --skip 1234 --n 20
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/smollm2/target")
    p.add_argument("--cache", required=True)
    p.add_argument("--skip", type=int, default=0, help="Skip the first lines of the cache (e.g. older responses).")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--every", type=int, default=1, help="Take every k-th cached response after --skip.")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="Write per-response results (JSONL) here.")
    args = p.parse_args()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from dflash_mlx.tools.train.data import read_cache

    model, tokenizer = load(args.model)
    eos = set(tokenizer.eos_token_ids)
    examples = read_cache(args.cache)[args.skip :: args.every][: args.n]
    same, rows = 0, []
    tic = time.perf_counter()
    for i, ex in enumerate(examples):
        cached = ex["response_ids"]
        plain = []
        for tok, _ in generate_step(mx.array(ex["prompt_ids"]), model, max_tokens=args.max_tokens):
            plain.append(int(tok))
            if plain[-1] in eos:
                break
        diverge = next((j for j, (a, b) in enumerate(zip(cached, plain)) if a != b), None)
        if diverge is None and len(cached) != len(plain):
            diverge = min(len(cached), len(plain))
        same += diverge is None
        row = {"key": ex["key"], "cached_len": len(cached), "plain_len": len(plain), "first_divergence": diverge}
        rows.append(row)
        print(
            f"{i + 1}/{len(examples)} {ex['key']} len {len(cached)}/{len(plain)} "
            f"{'identical' if diverge is None else f'diverges at {diverge}'}",
            flush=True,
        )
    print(
        f"agreement: {same}/{len(examples)} identical; divergences at "
        f"{[r['first_divergence'] for r in rows if r['first_divergence'] is not None]}; "
        f"{time.perf_counter() - tic:.0f} s"
    )
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
