"""Train a DFlash drafter for any mlx-lm target, as in the paper (arXiv 2602.06036).

One flat loop in the spirit of nanoGPT's ``train.py``. The target is frozen; the drafter
borrows its embedding and LM head, and only its own layers, ``fc`` and norms learn.
The data are the target's own greedy responses to the prompts (``data.py``). Each
step packs a few sequences side by side and trains many blocks per sequence, each at a
random anchor in the response, against the target's taps (computed once per example).

    dflash-train --model path/to/target --data prompts.jsonl --out runs/draft

``OUT`` then holds the drafter (``config.json`` + ``model.safetensors``, the z-lab layout
that ``dflash_mlx.load`` reads), ``training_state/`` (for ``--resume``), ``metrics.jsonl``
(losses and acceptance evaluations) and, by default, the response cache ``data.jsonl``.
The checkpoints and what may be resumed: ``checkpoint.py``.
"""

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ...base.dtypes import DTYPES
from ...base.errors import DFlashError
from ...cpu.speedups import choose_speedups
from ...generation import dflash_generate_step
from ...loading.casting import cast, cast_pair
from ...loading.draft_loader import load_draft
from ...loading.folders import check_not_drafter, read_config
from ...loading.hub import local_folder
from ...loading.pairs import embedded_pair
from ...loading.target_loader import load_target
from ...loop.options import LoopOptions
from ...models import target as tgt
from ...models.drafter import DraftArgs, DraftModel
from ...text.responses import AcceptanceStats
from ..cli.progress import Progress
from .checkpoint import (
    LOSS_VOCAB,
    TrainingInterrupted,
    check_out,
    check_resume,
    drafter_mismatch,
    interrupt_after_step,
    load_extra,
    load_state,
    resumed_settings,
    save_checkpoint,
    target_record,
)
from .config import TrainingArgs, check_args, draft_config, drafter_dtype
from .data import (
    dataset_examples,
    generate_responses,
    make_batch,
    position_weights,
    read_prompts,
    render_prompt,
    usable,
)
from .grow import deepen
from .losses import block_loss, head_gram
from .precondition import ScaledLinear, feature_scale, folded_fc
from .taps import TapStore
from .vocab import LossVocab, coverage, token_counts, top_tokens

# A batch's arrays in the order the loss takes them.
BATCH_KEYS = ("blocks", "anchors", "starts", "labels", "weights")


def get_lr(it: int, args: TrainingArgs, elapsed: float | None = None) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * learning_rate``: over the steps up
    to ``--iters``, or with ``--minutes`` over that time (``elapsed``: the seconds trained so far)."""
    if it < args.warmup:
        return args.learning_rate * (it + 1) / args.warmup
    if args.minutes is not None and elapsed is not None:
        progress = min(1.0, elapsed / (60 * args.minutes))
    else:
        progress = min(1.0, (it - args.warmup) / max(1, args.iters - args.warmup))
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.learning_rate * (args.min_lr_ratio + (1 - args.min_lr_ratio) * coeff)


def to_mx(batch: dict) -> dict:
    """A batch of numpy arrays as MLX arrays (the training step and the recipes that replay it)."""
    return {k: mx.array(v) for k, v in batch.items()}


def evaluate_acceptance(
    target: nn.Module,
    draft: DraftModel,
    prompts: list[list[int]],
    max_tokens: int,
    stop_tokens,
    block_size: int | None = None,
    tree_budget: int | None = None,
) -> tuple[float, dict[int, int]]:
    """Mean acceptance length (tau over drafting cycles, :class:`dflash_mlx.text.responses.AcceptanceStats`)
    with the real speculative loop, and drafting cycles by acceptance length (with ``tree_budget``,
    of draft trees)."""
    acceptance = AcceptanceStats()
    for ids in prompts:
        options = LoopOptions(
            max_tokens=max_tokens,
            stop_tokens=stop_tokens,
            block_size=block_size,
            tree_budget=tree_budget,
            adaptive=False,  # the drafter's own acceptance, every cycle drafted
        )
        steps = dflash_generate_step(ids, target, draft, options)
        for i, step in enumerate(steps):
            if i > 0:  # the prefill's token is no cycle
                acceptance.add(step.num_draft, len(step.tokens))
    return acceptance.tau, acceptance.lengths


def _target_and_config(args: TrainingArgs, out: Path, checkpoint) -> tuple:
    """The frozen target, its tokenizer, the drafter config (the checkpoint's when resuming)
    and the target's record for the checkpoint; bad settings fail here, before any data."""
    target_path = local_folder(args.model, what="target") if args.model else embedded_pair()[0]
    check_not_drafter(
        read_config(target_path, "target"),
        target_path,
        "Pass the target it drafts for with --model; to train this drafter further, pass it with --init-draft (a "
        "new run in a new --out), or its run folder with --out and --resume if it holds a training_state.",
    )
    target, tokenizer = load_target(target_path)
    cast_pair(target, None, args.dtype)
    target.freeze()
    vocab_size = tgt.vocab_size(target)
    if args.loss_vocab is not None and args.loss_vocab > vocab_size:
        raise DFlashError(
            f"--loss-vocab {args.loss_vocab} is more than the target's {vocab_size} token ids; pass at most "
            f"{vocab_size}, or leave it out for the whole vocabulary."
        )
    # Built before the data step, so that bad drafter settings fail before it runs.
    config = None if args.data_only else draft_config(target, tokenizer, args)
    target_info = target_record(target_path)
    init = None
    if checkpoint is not None:
        saved_state = json.loads((checkpoint[0] / "state.json").read_text())
        saved_config = read_config(checkpoint[1], "drafter")
        check_resume(out, saved_config, config, saved_state.get("target"), target_info,
                     saved_state.get("args", {}), dataclasses.asdict(args))  # fmt: skip
        config = saved_config
    elif args.init_draft is not None and config is not None:
        init_path = local_folder(args.init_draft, what="drafter")
        init = load_draft(init_path, target=target, tokenizer=tokenizer)
        init_config = read_config(init_path, "drafter")
        cast(init, drafter_dtype(args))
        # More layers than the starting drafter's: it is grown (dflash_mlx.tools.train.grow).
        depth = config["num_hidden_layers"]
        grows = depth > len(init.layers)
        same_depth = {**config, "num_hidden_layers": len(init.layers)} if grows else config
        # A smaller block than the starting drafter's: its weights draft any block up to its own
        # (the block size only sets how many slots a pass fills).
        shrinks = config["block_size"] < init_config.get("block_size", 0)
        if shrinks:
            same_depth = {**same_depth, "block_size": init_config["block_size"]}
        if (mismatch := drafter_mismatch(init_config, same_depth)) is not None:
            raise DFlashError(
                f"--init-draft {args.init_draft} was trained with {mismatch[0]}, but this run asks for "
                f"{mismatch[1]}. Pass {mismatch[0]} to start from it."
            )
        if grows:
            print(f"growing {args.init_draft} from {len(init.layers)} to {depth} layers, the new ones starting "
                  "as identities", flush=True)  # fmt: skip
            init = deepen(init, depth)
        config = {**init_config, "num_hidden_layers": len(init.layers), "block_size": config["block_size"]}
        if shrinks:
            init.args.block_size = config["block_size"]
            print(
                f"training {args.init_draft} (block size {init_config['block_size']}) at block size "
                f"{config['block_size']}",
                flush=True,
            )
    return target, tokenizer, config, target_info, init


@dataclass
class _Data:
    train: list[dict]
    val: list[dict]
    eval_prompts: list[list[int]]


def _training_data(args: TrainingArgs, target: nn.Module, tokenizer, out: Path) -> _Data | None:
    """The target's own greedy responses (cached and resumable), split into training and
    held-out examples, and the prompts the acceptance is evaluated on; None with data_only."""
    prompts = read_prompts(args.data, text_prompt_lines=args.text_prompt_lines)
    if args.responses == "generate":
        cache = args.cache or out / "data.jsonl"
        examples = generate_responses(
            target,
            tokenizer,
            prompts,
            cache,
            max_tokens=args.gen_max_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            max_prompts=args.max_prompts,
            minutes=args.data_minutes,
            batch_size=args.gen_batch_size,
        )
    else:
        examples = dataset_examples(tokenizer, prompts[: args.max_prompts], args.max_prompt_tokens)
    if args.data_only:
        return None
    examples = usable(examples, args.max_seq_len)
    n_val = min(args.val_examples, len(examples) // 5)
    train_ex, val_ex = examples[: len(examples) - n_val], examples[len(examples) - n_val :]
    if not train_ex:
        raise DFlashError(f"No usable training examples in {args.data}: check --max-seq-len and the responses.")
    if args.eval_data:
        eval_prompts = [
            render_prompt(tokenizer, p)
            for p in read_prompts(args.eval_data, text_prompt_lines=args.text_prompt_lines)[: args.eval_prompts]
        ]
    else:
        eval_prompts = [ex["prompt_ids"] for ex in (val_ex or train_ex)[: args.eval_prompts]]
    if val_ex:
        no_val = ""
    elif args.val_examples == 0:
        no_val = "no held-out set for a validation loss (--val-examples 0; pass --val-examples N for one)"
    else:
        no_val = (
            f"no held-out set for a validation loss: {len(examples)} usable examples, and one in five at most "
            "is held out; pass more prompts with --data (or a larger --max-prompts)"
        )
    print(
        f"data: {len(train_ex)} train / {len(val_ex)} val examples, {len(eval_prompts)} eval prompts"
        + (f"; {no_val}" if no_val else ""),
        flush=True,
    )

    return _Data(train_ex, val_ex, eval_prompts)


def _loss_vocab(args: TrainingArgs, target: nn.Module, data: _Data, resumed_from: Path | None) -> LossVocab | None:
    """The --loss-vocab subset: the top N token ids of the cached responses, or the checkpoint's
    own when resuming; logged with the share of the responses' tokens it covers."""
    if args.loss_vocab is None:
        return None
    vocab_size = tgt.vocab_size(target)
    counts = token_counts(data.train + data.val, vocab_size)
    saved = load_extra(resumed_from).get(LOSS_VOCAB) if resumed_from is not None else None
    ids = np.array(saved) if saved is not None else top_tokens(counts, args.loss_vocab)
    source = " (the checkpoint's)" if saved is not None else ""
    drafts = "; the drafter drafts among them" if args.draft_vocab else ""
    print(f"loss vocab: {len(ids)} of {vocab_size} token ids{source}, "
          f"{100 * coverage(counts, ids):.1f}% of the responses' tokens{drafts}", flush=True)  # fmt: skip
    return LossVocab.for_target(target, mx.array(ids))


def _drafter_and_optimizer(
    args: TrainingArgs, config: dict, checkpoint, init: DraftModel | None, draft_vocab: mx.array | None = None
) -> tuple:
    """A fresh drafter from ``config`` (or ``init``, the --init-draft weights), or the
    checkpoint's with its optimizer state, step and data RNG; it drafts among ``draft_vocab``
    (None: the whole vocabulary)."""
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if checkpoint is not None:
        draft = load_draft(checkpoint[1])
        cast(draft, drafter_dtype(args))
    elif init is not None:
        draft = init
        print(f"starting from the drafter {args.init_draft}", flush=True)
    else:
        draft = DraftModel(DraftArgs.from_dict(config))
        draft.set_dtype(DTYPES[drafter_dtype(args)])
    draft.set_draft_vocab(draft_vocab)
    draft.train()
    optimizer = optim.AdamW(learning_rate=args.learning_rate, betas=[0.9, 0.95], weight_decay=args.weight_decay)
    optimizer.init(draft.trainable_parameters())
    start = 0
    if checkpoint is not None:
        start, rng_state = load_state(checkpoint[0], optimizer)
        optimizer.init(draft.trainable_parameters())
        rng.bit_generator.state = rng_state
        print(f"resumed from {checkpoint[0]} at step {start}", flush=True)
        saved_args = json.loads((checkpoint[0] / "state.json").read_text()).get("args", {})
        now, changed = resumed_settings(saved_args, dataclasses.asdict(args))
        print(f"run settings: {now}", flush=True)
        if changed:
            print(
                f"dflash-train: note: resuming with {'; '.join(changed)}: the run goes on with these, so it no "
                "longer repeats an uninterrupted run of the checkpoint's settings.",
                file=sys.stderr,
                flush=True,
            )
    n_params = sum(v.size for _, v in tree_flatten(draft.trainable_parameters()))
    print(
        f"drafter: {draft.args.num_hidden_layers} layers, block size {draft.block_size}, "
        f"{n_params / 1e6:.2f}M trainable, taps {draft.target_layer_ids}",
        flush=True,
    )

    return draft, optimizer, start, rng


def _train_loop(args, out, target, tokenizer, draft, optimizer, start, rng, data, config, target_info,
                resumed_from: Path | None = None, vocab: LossVocab | None = None):  # fmt: skip
    """The optimizer steps, with progress lines, evaluations and checkpoints."""
    B, mask_id, tap_ids = draft.block_size, draft.mask_token_id, draft.target_layer_ids
    train_ex, val_ex, eval_prompts = data.train, data.val, data.eval_prompts
    stop_tokens = frozenset(tokenizer.eos_token_ids)
    weights = position_weights(B, args.loss_decay)
    batch_kwargs = dict(
        batch_size=args.batch_size,
        blocks_per_seq=args.blocks_per_seq,
        block_size=B,
        max_seq_len=args.max_seq_len,
        mask_token_id=mask_id,
        weights=weights,
    )
    val_rng = np.random.default_rng(args.seed + 1)
    val_batches = [make_batch(val_ex, val_rng, **batch_kwargs) for _ in range(2)] if val_ex else []

    store = TapStore(target, tap_ids, args.max_seq_len, folder=args.tap_cache, identity=target_info,
                     keep=args.cache_taps, max_bytes=int(args.tap_cache_gb * 1e9))  # fmt: skip

    def taps_for(batch: dict, examples: list[dict]) -> tuple[mx.array, mx.array]:
        """The packed taps ``(1, S * L, n_taps * H)`` and final hidden states ``(1, S * L, H)``
        of a batch, each sequence in its slot."""
        L = batch["tokens"].shape[1]
        parts = [store.get(examples[i]) for i in batch["index"].tolist()]

        def packed(arrays):
            return mx.concatenate([mx.pad(t, [(0, 0), (0, L - t.shape[1]), (0, 0)]) for t in arrays], axis=1)

        return packed([t for t, _ in parts]), packed([h for _, h in parts])

    if args.precondition_fc:
        saved = load_extra(resumed_from) if resumed_from is not None else {}
        if "fc.weight" in saved:
            draft.fc = ScaledLinear(saved["fc.weight"], saved["fc.scale"])
        else:
            # The scale comes from a few examples' taps: the outsized features are the target's own.
            draft.fc = ScaledLinear.from_linear(draft.fc, feature_scale([store.get(ex)[0] for ex in train_ex[:8]]))
        mx.eval(draft.fc.parameters())

    def training_arrays() -> dict:
        fc = draft.fc
        arrays = {"fc.weight": fc.weight, "fc.scale": fc.scale} if isinstance(fc, ScaledLinear) else {}
        if vocab is not None:
            arrays[LOSS_VOCAB] = vocab.ids  # a resumed run's loss is over the same ids
        return arrays

    # The CPU kernels have exact gradients (custom VJPs), so training uses them too.
    gram = head_gram(target) if args.logit_mse > 0 else None
    loss_fn = partial(block_loss, draft, target, speedups=choose_speedups(DTYPES[drafter_dtype(args)]),
                      positions=args.loss_positions, gram=gram, logit_mse=args.logit_mse, vocab=vocab)  # fmt: skip
    loss_and_grad = nn.value_and_grad(draft, loss_fn)
    state = [draft.state, optimizer.state]

    def step_fn(taps, target_final, blocks, anchors, starts, labels, weights):
        loss, grads = loss_and_grad(taps, blocks, anchors, starts, labels, weights, target_final=target_final)
        if args.grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, args.grad_clip)
        optimizer.update(draft, grads)
        return loss

    if args.compile:
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    def run_eval(step: int) -> dict:
        draft.eval()
        val = []
        for b in map(to_mx, val_batches):
            taps, target_final = taps_for(b, val_ex)
            val.append(loss_fn(taps, *[b[k] for k in BATCH_KEYS], target_final=target_final).item())
        mean, hist = None, {}
        if eval_prompts:
            mean, hist = evaluate_acceptance(target, draft, eval_prompts, args.eval_max_tokens, stop_tokens)
        draft.train()
        record = {
            "step": step,
            "val_loss": float(np.mean(val)) if val else None,
            "acceptance": mean,
            "hist": hist,
        }
        val_text = f"val loss {record['val_loss']:.4f}" if val else "no val loss (no held-out set)"
        accept_text = f"acceptance {mean:.2f} {hist}" if eval_prompts else "no acceptance (no eval prompts)"
        print(f"eval step {step}: {val_text}, {accept_text}", flush=True)
        return record

    # ---- the loop ----
    out.mkdir(parents=True, exist_ok=True)
    tic, tokens_done, losses = time.perf_counter(), 0, []

    def save(step: int) -> None:
        extra = training_arrays()
        with folded_fc(draft):
            save_checkpoint(out, draft, config, optimizer, step, rng, args, target_info, extra=extra)

    end_step = min(args.iters, args.stop_at or args.iters)
    bar = Progress(args.iters, width=20, stream=sys.stdout)
    with open(out / "metrics.jsonl", "a") as metrics, interrupt_after_step() as interrupted:
        for it in range(start, end_step):
            optimizer.learning_rate = get_lr(it, args, time.perf_counter() - tic)
            batch = to_mx(make_batch(train_ex, rng, **batch_kwargs, drop_lookup=args.drop_lookup_anchors))
            taps, last_hidden = taps_for(batch, train_ex)
            loss = step_fn(taps, last_hidden, *[batch[k] for k in BATCH_KEYS])
            mx.eval(loss, state)
            losses.append(loss.item())
            tokens_done += int(batch["weights"].size)
            step = it + 1
            if args.minutes is not None and time.perf_counter() - tic >= 60 * args.minutes:
                end_step = step
            last = step == end_step
            if step % args.log_every == 0 or last:
                elapsed = time.perf_counter() - tic
                eta = elapsed / (step - start) * (args.iters - step)
                if args.minutes is not None:
                    eta = min(eta, max(0.0, 60 * args.minutes - elapsed))
                # The mean training loss since the last progress line.
                loss, losses = float(np.mean(losses)), []
                eta_text = f"{int(eta) // 60}m{int(eta) % 60:02d}s"
                note = " ".join(filter(None, [f"loss {loss:.3f} {tokens_done / elapsed:,.0f} tok/s", store.served()]))
                bar.update(step, f"{note} ETA {eta_text}", elapsed=False)
                metrics.write(json.dumps({"step": step, "loss": loss, "lr": optimizer.learning_rate.item()}) + "\n")
            if (args.eval_every and step % args.eval_every == 0) or step == args.iters or (last and args.minutes):
                metrics.write(json.dumps(run_eval(step)) + "\n")
            if step % args.save_every == 0 or step in (args.iters, args.stop_at) or last or interrupted:
                save(step=step)
            metrics.flush()
            if interrupted and step < end_step:
                raise TrainingInterrupted(step, out)
            if last:
                break
    bar.close()
    if args.minutes is not None:
        print(f"stopped after {args.minutes:g} minutes at step {end_step}; saved to {out}", flush=True)
    elif end_step < args.iters:
        print(f"stopped at step {end_step} of {args.iters} (--stop-at); saved to {out}; rerun with --resume to continue",
              flush=True)  # fmt: skip
    if isinstance(draft.fc, ScaledLinear):
        draft.fc = draft.fc.folded()
    draft.eval()
    return draft


def train(args: TrainingArgs) -> DraftModel | None:
    """Generate (or read) the data, then train and save a drafter for ``args.model``.

    Returns:
        The trained drafter (also saved in ``args.out``), or None with ``data_only``.

    Raises:
        DFlashError: On bad arguments, data or models; an ``out`` that holds other files than
          the response cache without ``resume``; ``resume`` without a checkpoint in ``out``, or
          with drafter settings or a target other than the checkpoint's.
        TrainingInterrupted: On Ctrl+C in the loop, once the current step is saved.
    """
    check_args(args)
    out = Path(args.out)
    checkpoint = check_out(out, args.resume, args.data_only)
    target, tokenizer, config, target_info, init = _target_and_config(args, out, checkpoint)
    data = _training_data(args, target, tokenizer, out)
    if data is None:
        return None
    resumed_from = checkpoint[0] if checkpoint is not None else None
    vocab = _loss_vocab(args, target, data, resumed_from)
    draft_vocab = vocab.ids if vocab is not None and args.draft_vocab else None
    draft, optimizer, start, rng = _drafter_and_optimizer(args, config, checkpoint, init, draft_vocab)
    return _train_loop(args, out, target, tokenizer, draft, optimizer, start, rng, data, config, target_info,
                       resumed_from, vocab)  # fmt: skip
