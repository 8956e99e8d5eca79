"""Train the small autoregressive draft used as the mlx-lm speculative-decoding baseline.

A 2-layer Qwen3 started from the embedded target's first layers, embedding and head, trained on the
same stdlib corpus with mlx-lm's own trainer (full fine-tuning of its layers), then saved in bf16:

    python recipes/rebuild/train_ar_draft.py --data runs/data --work runs/ar \
        --out assets/dflash-tiny/ar-draft --iters 500
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from transformers import AutoTokenizer

TARGET = Path(__file__).resolve().parents[2] / "assets" / "dflash-tiny" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_init(out: Path, layers: int) -> None:
    """The target cut to its first ``layers`` layers: its embedding, head and final norm stay.

    mlx-lm's full fine-tuning trains the decoder layers only, so the draft starts from the target's
    trained embedding rather than a random one.
    """
    config = json.loads((TARGET / "config.json").read_text())
    config.update(num_hidden_layers=layers, torch_dtype="float32")
    for key in ("layer_types", "max_window_layers"):
        config.pop(key, None)
    keep = ("model.embed_tokens.", "model.norm.", "lm_head.") + tuple(f"model.layers.{i}." for i in range(layers))
    weights = {
        k: v.astype(mx.float32) for k, v in mx.load(str(TARGET / "model.safetensors")).items() if k.startswith(keep)
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (TARGET / name).exists():
            shutil.copy(TARGET / name, out / name)


def make_text_split(src: Path, dst: Path, tokenizer) -> int:
    # mlx-lm's loader wants one format per file: render the chat turns to text with the template.
    rows = []
    for line in src.read_text().splitlines():
        row = json.loads(line)
        if "messages" in row:
            rows.append(tokenizer.apply_chat_template(row["messages"], tokenize=False))
        else:
            rows.append(row["text"])
    dst.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/data", help="Folder with train.jsonl and valid.jsonl.")
    parser.add_argument("--work", default="runs/ar", help="Scratch folder.")
    parser.add_argument("--out", default=str(TARGET.parent / "ar-draft"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    work, data = Path(args.work), Path(args.work) / "data"
    data.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    for split in ("train", "valid"):
        n = make_text_split(Path(args.data) / f"{split}.jsonl", data / f"{split}.jsonl", tokenizer)
        print(f"{split}: {n} rows")
    make_init(work / "init", args.layers)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "lora",
            "--model",
            str(work / "init"),
            "--train",
            "--data",
            str(data),
            "--fine-tune-type",
            "full",
            "--num-layers",
            "-1",
            "--optimizer",
            "adamw",
            "--batch-size",
            str(args.batch_size),
            "--iters",
            str(args.iters),
            "--learning-rate",
            str(args.learning_rate),
            "--max-seq-length",
            "512",
            "--steps-per-report",
            "50",
            "--steps-per-eval",
            "500",
            "--val-batches",
            "20",
            "--adapter-path",
            str(work / "adapters"),
            "--save-every",
            "500",
            "--seed",
            str(args.seed),
        ],
        check=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "fuse",
            "--model",
            str(work / "init"),
            "--adapter-path",
            str(work / "adapters"),
            "--save-path",
            str(work / "fused"),
        ],
        check=True,
    )
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(work / "fused", out, ignore=shutil.ignore_patterns("README.md"))
    # Store in bf16 like the target; benchmarks cast back to fp32 at load.
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(out / "model.safetensors")).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
