"""Train the default pair's small autoregressive draft: mlx-lm speculative decoding's baseline.

The target (SmolLM2-135M-Instruct as ``load()`` converts it) cut to its first ``--layers``
layers, those layers fine-tuned with mlx-lm's own trainer on the same target responses the DFlash
drafter learned from (the loss on response tokens only). mlx-lm's full fine-tuning trains the
decoder layers alone, so the embedding and final norm stay the target's: the saved folder keeps
only the layers and names the modules it borrows (``dflash_borrowed``), which dflash-bench takes
from the loaded target, sharing their memory. That keeps the asset at the layers' size instead of
another copy of the 28M-parameter embedding.

    python recipes/rebuild/smollm2_ar_draft.py --responses runs/smollm2/data/responses.jsonl \\
        --work runs/smollm2/ar --iters 200
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import TrainingArgs, evaluate, train
from mlx_lm.utils import load_model

from dflash_mlx.loading.pairs import embedded_pair

OUT = Path(__file__).resolve().parents[2] / "assets" / "smollm2" / "ar-draft"
BORROWED = ("model.embed_tokens", "model.norm")


def make_init(target: Path, out: Path, layers: int) -> None:
    """The target cut to its first ``layers`` layers, in float32, as an mlx-lm model folder."""
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=layers, torch_dtype="float32")
    config.pop("gguf_source", None)
    keep = tuple(f"{name}." for name in BORROWED) + tuple(f"model.layers.{i}." for i in range(layers))
    weights = {
        k: v.astype(mx.float32) for k, v in mx.load(str(target / "model.safetensors")).items() if k.startswith(keep)
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def examples(path: Path, max_len: int) -> list[tuple[list[int], int]]:
    """``(prompt + response ids, prompt length)`` per response: mlx-lm's trainer masks the prompt."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [((r["prompt_ids"] + r["response_ids"])[:max_len], len(r["prompt_ids"])) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", required=True, help="The drafter's training responses (JSONL of ids).")
    parser.add_argument("--work", required=True, help="Scratch folder (init model and checkpoints).")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--max-seq-len", type=int, default=384)
    parser.add_argument("--valid", type=int, default=16, help="The last N responses: validation only.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    mx.random.seed(args.seed)
    target = embedded_pair()[0]
    work = Path(args.work)
    make_init(target, work / "init", args.layers)
    model, _ = load_model(work / "init")
    model.freeze()
    for layer in model.layers:
        layer.unfreeze()
    data = examples(Path(args.responses), args.max_seq_len)
    train_set, valid_set = data[: -args.valid], data[-args.valid :]
    print(f"{len(train_set)} training responses, {len(valid_set)} validation; {args.layers} layers")

    def valid_loss() -> float:
        return evaluate(model, valid_set, batch_size=args.batch_size, num_batches=-1, max_seq_length=args.max_seq_len)

    print(f"validation loss before: {valid_loss():.3f}")
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-7, args.learning_rate, 20),
            optim.cosine_decay(args.learning_rate, args.iters, args.learning_rate / 10),
        ],
        [20],
    )
    training = TrainingArgs(
        batch_size=args.batch_size, iters=args.iters, val_batches=-1, steps_per_report=20,
        steps_per_eval=10**9, steps_per_save=50, max_seq_length=args.max_seq_len,
        adapter_file=str(work / "layers.safetensors"),
    )  # fmt: skip
    train(model, optim.AdamW(learning_rate=schedule, weight_decay=0.01), train_set, None, args=training)
    loss = valid_loss()
    print(f"validation loss after {args.iters} steps: {loss:.3f} (perplexity {math.exp(loss):.1f})")

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    layers = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters()) if k.startswith("model.layers.")}
    mx.save_safetensors(str(out / "model.safetensors"), layers, metadata={"format": "mlx"})
    config = json.loads((work / "init" / "config.json").read_text())
    config.update(torch_dtype="bfloat16", dflash_borrowed=list(BORROWED))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
