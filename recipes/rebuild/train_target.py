"""Train the tiny Qwen3 target from random init on the stdlib corpus (PyTorch, CPU, bf16 autocast).

A flat nanoGPT-style loop: packed 512-token windows, AdamW, warmup then cosine LR, periodic held-out loss.
Without --max-steps the cosine runs on wall-clock progress and stops at --minutes, because the
cores are shared and the speed changes during a run; pass --max-steps for a step-based schedule.

    python recipes/rebuild/train_target.py --data runs/data --out assets/dflash-tiny/target
"""

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM


def model_config(tokenizer) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def render(example: dict, tokenizer) -> str:
    if "text" in example:
        return example["text"]
    return tokenizer.apply_chat_template(example["messages"], tokenize=False)


def tokenize_split(path: Path, tokenizer) -> torch.Tensor:
    """Pack a JSONL split into one token stream, documents separated by <|endoftext|>."""
    with open(path) as f:
        texts = [render(json.loads(line), tokenizer) for line in f]
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def get_batch(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([stream[s : s + seq_len] for s in starts])
    y = torch.stack([stream[s + 1 : s + seq_len + 1] for s in starts])
    return x, y


def get_lr(step: int, progress: float, lr: float, warmup: int, min_lr_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, progress)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_on(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def estimate_valid_loss(model, valid: torch.Tensor, seq_len: int, max_windows: int, batch_size: int) -> float:
    # Fixed, non-overlapping windows, so every evaluation sees the same tokens.
    n = min(max_windows, (len(valid) - 1) // seq_len)
    model.eval()
    total = 0.0
    for i in range(0, n, batch_size):
        idx = range(i, min(n, i + batch_size))
        x = torch.stack([valid[j * seq_len : (j + 1) * seq_len] for j in idx])
        y = torch.stack([valid[j * seq_len + 1 : (j + 1) * seq_len + 1] for j in idx])
        total += loss_on(model, x, y).item() * len(idx)
    model.train()
    return total / n


def save(model, tokenizer, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.generation_config = GenerationConfig(
        eos_token_id=[
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ],
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        do_sample=False,
    )
    bf16.save_pretrained(out, safe_serialization=True)
    # transformers 5 nests rope_theta under rope_parameters; older loaders read it at the top.
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description="Train the tiny Qwen3 target on the stdlib corpus.")
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("runs/data"),
        help="Folder with train/valid JSONL.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("assets/dflash-tiny/target"),
        help="Tokenizer + model folder.",
    )
    parser.add_argument(
        "--ckpt",
        type=Path,
        default=Path("runs/target_ckpt"),
        help="Periodic checkpoint folder.",
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="Fixed step count; default: fit --minutes.",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=50.0,
        help="Wall-time budget used to pick the step count.",
    )
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument(
        "--eval-windows",
        type=int,
        default=128,
        help="Held-out 512-token windows per evaluation.",
    )
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    train = tokenize_split(args.data / "train.jsonl", tokenizer)
    valid = tokenize_split(args.data / "valid.jsonl", tokenizer)
    print(f"tokens: train {len(train)} valid {len(valid)}", flush=True)

    model = Qwen3ForCausalLM(model_config(tokenizer))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    budget_s = args.minutes * 60
    t0 = time.time()
    running = None
    step = 0

    def progress() -> float:
        if args.max_steps:
            return step / args.max_steps
        return (time.time() - t0) / budget_s

    while progress() < 1.0:
        lr = get_lr(step, progress(), args.lr, args.warmup, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train, args.batch_size, args.seq_len, gen)
        loss = loss_on(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()

        if step % 10 == 0:
            elapsed = time.time() - t0
            print(
                f"step {step} progress {progress():.3f} loss {running:.4f} lr {lr:.2e} "
                f"{step * tokens_per_step / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
        done = progress() >= 1.0
        if step % args.eval_every == 0 or done:
            vl = estimate_valid_loss(model, valid, args.seq_len, args.eval_windows, args.batch_size)
            print(f"eval step {step} train {running:.4f} valid {vl:.4f}", flush=True)
        if step % args.save_every == 0 and not done:
            save(model, tokenizer, args.ckpt)
            (args.ckpt / "step.txt").write_text(f"{step}\n")

    elapsed = time.time() - t0
    save(model, tokenizer, args.out)
    summary = {
        "params": n_params,
        "steps": step,
        "minutes": args.minutes,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "train_tokens": len(train),
        "valid_tokens": len(valid),
        "tokens_seen": step * tokens_per_step,
        "wall_s": round(elapsed, 1),
        "tokens_per_s": round(step * tokens_per_step / elapsed, 1),
        "final_train_loss": round(running, 4),
        "final_valid_loss": round(vl, 4),
        "full_valid_loss": round(estimate_valid_loss(model, valid, args.seq_len, 10**9, args.batch_size), 4),
    }
    print("summary " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
