"""Train the tiny DSpark, JetSpec and DFlare drafters of the test fixtures on the embedded toy target (dflash-tiny).

Each is one layer on the target's taps (layers 1, 4, 6, 9, as the toy pair's DFlash drafter), fitted to the target's
own greedy continuations of 12-line chunks of Python standard-library files (the toy target's corpus, its held-out
files left out), one block per anchor, each block denoised exactly as it is drafted: the context the taps of the
positions before the anchor, the block ``[anchor, MASK...]`` at the anchor's position. DSpark's every slot is trained
(slot k: the token at anchor + k + 1, its Markov bias from the true token before it); JetSpec's and DFlare's slots
1.. (z-lab's layout). All three borrow the target's embedding and head. Saved in bf16 with their configs:

    python recipes/rebuild/train_family_drafters.py --out tests/fixtures/families --steps 400 --prompts 40 --length 96
    python recipes/rebuild/train_family_drafters.py --out tests/fixtures/families --steps 1200 --lr 3e-3 \
        --prompts 40 --length 96 --families jetspec dflare

The measured acceptance is written to ``--out``/README.md's table by hand from this script's last lines.
"""

import argparse
import json
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx
from dflash_mlx import LoopOptions, dflash_generate_step, load
from dflash_mlx.models import dflare, drafter, dspark
from dflash_mlx.models import target as tgt

HELDOUT = Path(__file__).resolve().parent / "heldout_files.txt"
PROMPTS = Path(dflash_mlx.__file__).parent / "assets" / "dflash-tiny" / "prompts.jsonl"
TAPS = [1, 4, 6, 9]
MASK = 3


def base_config(block: int, architecture: str) -> dict:
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": 4096,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": 12,
        "block_size": block,
        "layer_types": ["full_attention"],
        "torch_dtype": "bfloat16",
    }


def configs() -> dict[str, dict]:
    """Each family's config in its published layout."""
    spark = base_config(7, dspark.ARCHITECTURE)
    spark.update(mask_token_id=MASK, target_layer_ids=TAPS, num_anchors=512, enable_confidence_head=False,
                 markov_rank=32, markov_head_type="vanilla")  # fmt: skip
    jet = base_config(8, "DFlashDraftModel")
    jet["dflash_config"] = {"mask_token_id": MASK, "target_layer_ids": TAPS, "causal_head": True}
    flare = base_config(8, "QwenDFlareDraftModel")
    flare["dflash_config"] = {"mask_token_id": MASK, "target_layer_ids": TAPS}
    return {"dspark": spark, "jetspec": jet, "dflare": flare}


def build(family: str, config: dict) -> nn.Module:
    if family == "dspark":
        args = dspark.DraftArgs.from_dict(config)
        args.own_head = False  # the target's embedding and head, as a community head
        return dspark.DraftModel(args)
    module = dflare if family == "dflare" else drafter
    return module.DraftModel(module.DraftArgs.from_dict(config))


def prompts(tokenizer, count: int) -> list[list[int]]:
    """12-line chunks of standard-library files outside the toy target's held-out list, 3 per file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    held = set(HELDOUT.read_text().split())
    out = []
    for path in sorted(root.glob("*.py")):
        if path.relative_to(root).as_posix() in held:
            continue
        lines = path.read_text(errors="ignore").splitlines()
        for start in (40, 120, 200):
            if len(lines) > start + 12 and len(out) < count:
                out.append(tokenizer.encode("\n".join(lines[start : start + 12]) + "\n"))
    return out


def sequences(model, tokenizer, count: int, length: int) -> list[tuple[list[int], int, mx.array]]:
    """(prompt + the target's greedy continuation, where the continuation starts, the taps of all of it)."""
    out = []
    for prompt in prompts(tokenizer, count):
        prompt = prompt[-200:]
        text = [s.tokens for s in dflash_generate_step(prompt, model, None, LoopOptions(max_tokens=length))]
        ids = prompt + [t for tokens in text for t in tokens]
        _, taps = tgt.forward_with_taps(model, mx.array([ids]), make_prompt_cache(model), TAPS)
        mx.eval(taps)
        out.append((ids, len(prompt), taps))
    return out


def block_loss(draft, model, ids: list[int], p: int, taps: mx.array) -> mx.array:
    """Cross-entropy of one block at anchor ``p``, as the family drafts it."""
    B = draft.args.block_size
    block = mx.array([[ids[p]] + [MASK] * (B - 1)])
    h = draft(draft.embed(model, block), taps[:, :p])[0]
    if isinstance(draft, dspark.DraftModel):
        logits = draft.logits(model, h) + draft.markov_head(mx.array(ids[p : p + B]))
        labels = ids[p + 1 : p + B + 1]
    else:
        logits, labels = draft.logits(model, h[1:]), ids[p + 1 : p + B]
    return nn.losses.cross_entropy(logits, mx.array(labels), reduction="mean")


def train(family, draft, model, data, steps: int, anchors: int, lr: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    opt = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr / 10), weight_decay=0.01)
    width = draft.args.block_size + 1

    def loss_fn(draft, picks):
        return sum(block_loss(draft, model, ids, p, taps) for ids, p, taps in picks) / len(picks)

    grad = nn.value_and_grad(draft, loss_fn)
    started, recent = time.perf_counter(), []
    for step in range(1, steps + 1):
        picks = []
        for _ in range(anchors):
            ids, start, taps = data[rng.integers(len(data))]
            p = int(rng.integers(max(start - 1, 1), len(ids) - width))
            picks.append((ids, p, taps))
        loss, grads = grad(draft, picks)
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state, loss)
        recent.append(loss.item())
        if step % 100 == 0:
            print(f"{family} step {step}: loss {np.mean(recent):.3f} ({time.perf_counter() - started:.0f} s)")
            recent = []


def acceptance(model, draft, tokenizer, count: int = 8, max_tokens: int = 64) -> float:
    """Mean tokens per drafting cycle, greedy, on the toy pair's held-out prompts (assets/dflash-tiny/prompts.jsonl)."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    emitted = cycles = 0
    for row in rows[:count]:
        if "messages" in row:
            prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True)
        else:
            prompt = tokenizer.encode(row["prompt"])
        for step in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=max_tokens, adaptive=False)):
            if step.num_draft:
                emitted, cycles = emitted + len(step.tokens), cycles + 1
    return emitted / max(cycles, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--anchors", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--families", nargs="+", default=["dspark", "jetspec", "dflare"])
    args = parser.parse_args()
    model, _, tokenizer = load("dflash-tiny", dtype="float32")
    data = sequences(model, tokenizer, args.prompts, args.length)
    print(f"{len(data)} sequences, {sum(len(ids) - start for ids, start, _ in data)} response tokens")
    for family in args.families:
        config = configs()[family]
        mx.random.seed(0)
        draft = build(family, config)
        train(family, draft, model, data, args.steps, args.anchors, args.lr)
        draft.set_dtype(mx.bfloat16)
        folder = args.out / family
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(draft.parameters())),
                            metadata={"format": "mlx"})  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _, loaded, _ = load("dflash-tiny", folder, dtype="float32")
        print(f"{family}: acceptance {acceptance(model, loaded, tokenizer):.2f} tokens per drafting cycle")


if __name__ == "__main__":
    main()
