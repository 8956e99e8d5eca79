"""FR-Spec on the default pair: one drafter training step with and without --loss-vocab N (the same batch,
dflash-train's default settings), one draft pass with and without an N-token draft vocabulary, and
optionally the shipped drafter's acceptance both ways (greedy, held-out prompts).

    python recipes/archive/frspec_timing.py --target runs/smollm2/target --responses runs/smollm2/data/responses.jsonl \\
        --repeats 6 --acceptance-prompts 12

Steps and passes are interleaved (A, B, A, B, ...), so that other load on the machine slows both alike.
"""

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

from dflash_mlx.cpu.openblas import blas_in_use, use_openblas


def _timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def _report(what: str, times: dict[str, list[float]], unit: float = 1e3) -> None:
    for name, t in times.items():
        print(f"{what}, {name:20}: median {statistics.median(t) * unit:8.2f} ms, min {min(t) * unit:8.2f} ms "
              f"({len(t)} runs)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="The target folder (float32).")
    parser.add_argument("--responses", required=True, help="A response cache (dflash-train's data.jsonl).")
    parser.add_argument("--draft", default="assets/smollm2/draft", help="The drafter whose pass is timed.")
    parser.add_argument("--vocab", type=int, default=8192, help="N, the subset's size.")
    parser.add_argument("--mask-token-id", type=int, default=16, help="The shipped drafter's mask token.")
    parser.add_argument("--repeats", type=int, default=6, help="Training steps per setting (draft passes: 10x).")
    parser.add_argument("--context", type=int, default=256, help="Context of the timed draft pass.")
    parser.add_argument("--heldout", default="assets/smollm2/data/prompts_heldout.jsonl")
    parser.add_argument("--acceptance-prompts", type=int, default=0, help="Held-out prompts for acceptance (0: none).")
    args = parser.parse_args()
    use_openblas("frspec_timing", "auto")  # as every dflash tool starts

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from dflash_mlx.cpu.speedups import choose_speedups
    from dflash_mlx.loading.casting import cast
    from dflash_mlx.loading.draft_loader import load_draft
    from dflash_mlx.loading.target_loader import load_target
    from dflash_mlx.loop.cache import make_cache
    from dflash_mlx.models import target as tgt
    from dflash_mlx.models.drafter import DraftArgs, DraftModel
    from dflash_mlx.tools.train.config import TrainingArgs, draft_config
    from dflash_mlx.tools.train.data import (
        make_batch,
        position_weights,
        read_cache,
        read_prompts,
        render_prompt,
        usable,
    )
    from dflash_mlx.tools.train.losses import block_loss
    from dflash_mlx.tools.train.precondition import ScaledLinear, feature_scale
    from dflash_mlx.tools.train.taps import TapStore
    from dflash_mlx.tools.train.trainer import BATCH_KEYS, evaluate_acceptance, to_mx
    from dflash_mlx.tools.train.vocab import LossVocab, coverage, token_counts, top_tokens

    print(f"BLAS: {blas_in_use()}")
    target, tokenizer = load_target(Path(args.target))
    cast(target, "float32")
    target.freeze()
    train_args = TrainingArgs(model=args.target, data="-", mask_token_id=args.mask_token_id)
    examples = usable(read_cache(args.responses), train_args.max_seq_len)
    counts = token_counts(examples, tgt.vocab_size(target))
    ids = top_tokens(counts, args.vocab)
    print(f"{len(examples)} examples, {counts.sum()} response tokens; the top {args.vocab} ids cover "
          f"{100 * coverage(counts, ids):.1f}% of them")  # fmt: skip

    # ---- one training step, as dflash-train runs it ----
    mx.random.seed(0)
    draft = DraftModel(DraftArgs.from_dict(draft_config(target, tokenizer, train_args)))
    draft.train()
    store = TapStore(target, draft.target_layer_ids, train_args.max_seq_len, keep=True)
    draft.fc = ScaledLinear.from_linear(draft.fc, feature_scale([store.get(ex)[0] for ex in examples[:8]]))
    a = train_args
    batch = to_mx(make_batch(examples, np.random.default_rng(0), batch_size=a.batch_size, blocks_per_seq=a.blocks_per_seq,
                              block_size=a.block_size, max_seq_len=a.max_seq_len, mask_token_id=draft.mask_token_id,
                              weights=position_weights(a.block_size, a.loss_decay)))  # fmt: skip
    L = batch["tokens"].shape[1]
    parts = [store.get(examples[i]) for i in batch["index"].tolist()]

    def packed(arrays):
        return mx.concatenate([mx.pad(t, [(0, 0), (0, L - t.shape[1]), (0, 0)]) for t in arrays], axis=1)

    taps, last = packed([t for t, _ in parts]), packed([h for _, h in parts])
    mx.eval(taps, last)
    print(f"batch: {a.batch_size} sequences x {a.blocks_per_seq} blocks of {a.block_size}, slots of {L} tokens")

    def make_step(vocab):
        loss_fn = partial(block_loss, draft, target, speedups=choose_speedups(mx.float32), vocab=vocab)
        loss_and_grad = nn.value_and_grad(draft, loss_fn)
        optimizer = optim.AdamW(learning_rate=1e-4, betas=[0.9, 0.95], weight_decay=a.weight_decay)
        optimizer.init(draft.trainable_parameters())
        state = [draft.state, optimizer.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(taps, last, blocks, anchors, starts, labels, weights):
            loss, grads = loss_and_grad(taps, blocks, anchors, starts, labels, weights, target_final=last)
            grads, _ = optim.clip_grad_norm(grads, a.grad_clip)
            optimizer.update(draft, grads)
            return loss

        return lambda: mx.eval(step(taps, last, *[batch[k] for k in BATCH_KEYS]), state)

    steps = {
        "whole vocabulary": make_step(None),
        f"--loss-vocab {args.vocab}": make_step(LossVocab.for_target(target, mx.array(ids))),
    }
    for run in steps.values():
        run(), run()  # compiled, warm
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, run in steps.items():
            times[name].append(_timed(run))
    _report("training step", times)

    # ---- one draft pass (block 16, argmax), as dflash-bench times it ----
    speedups = choose_speedups(mx.float32)
    passes = {}
    for name, vocab in (("whole vocabulary", None), (f"draft vocab {args.vocab}", mx.array(ids))):
        d = load_draft(Path(args.draft), target=target)
        cast(d, "float32")
        d.set_draft_vocab(vocab)
        cache = make_cache(target, d)
        for c in cache.draft:
            c.update_and_fetch(*[mx.zeros((1, d.args.num_key_value_heads, args.context, d.args.head_dim))] * 2)
        block = mx.array([[1] + [d.mask_token_id] * (d.block_size - 1)])
        passes[name] = partial(lambda d, c, b: mx.eval(mx.argmax(d.propose(target, b, None, c, speedups), -1)),
                               d, cache.draft, block)  # fmt: skip
        passes[name](), passes[name]()
    times = {name: [] for name in passes}
    for _ in range(10 * args.repeats):
        for name, run in passes.items():
            times[name].append(_timed(run))
    _report(f"draft pass at context {args.context}", times)

    if args.acceptance_prompts:
        prompts = [render_prompt(tokenizer, p) for p in read_prompts(args.heldout)[: args.acceptance_prompts]]
        stop = frozenset(tokenizer.eos_token_ids)
        for name, vocab in (("whole vocabulary", None), (f"draft vocab {args.vocab}", mx.array(ids))):
            d = load_draft(Path(args.draft), target=target)
            cast(d, "float32")
            d.set_draft_vocab(vocab)
            mean, hist = evaluate_acceptance(target, d, prompts, 128, stop)
            print(f"acceptance, {name:20}: {mean:.3f} tokens per cycle over {sum(hist.values())} cycles {hist}")


if __name__ == "__main__":
    main()
