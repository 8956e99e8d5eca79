"""Train a DFlash drafter for any mlx-lm target, as in the paper (arXiv 2602.06036).

One flat loop in the spirit of nanoGPT's ``train.py``. The target is frozen; the drafter
borrows its embedding and LM head, and only its own layers, ``fc`` and norms learn.
The data are the target's own greedy responses to the prompts (``train_data.py``). Each
step packs a few sequences side by side and trains many blocks per sequence, each at a
random anchor in the response, against the target's taps (computed once per example).

    dflash-train --model path/to/target --data prompts.jsonl --out runs/draft

``OUT`` then holds the drafter (``config.json`` + ``model.safetensors``, the z-lab layout
that ``dflash_mlx.load`` reads), ``training_state/`` (for ``--resume``), ``metrics.jsonl``
(losses and acceptance evaluations) and, by default, the response cache ``data.jsonl``.
The checkpoints and what may be resumed: ``train_checkpoint.py``.
"""

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..cli.options import ArgumentParser, add_blas_argument
from ..cli.progress import Progress
from ..cpu.speedups import choose_speedups
from ..errors import DFlashError
from ..generation import dflash_generate_step
from ..options import LoopOptions
from ..inputs import MAX_SEED
from ..models import target as tgt
from ..models.drafter import DraftModel, DraftArgs, default_target_layer_ids
from ..responses import AcceptanceStats
from ..dtypes import DTYPES
from ..weights.casting import cast, cast_pair
from ..weights.draft_loader import MASK_TOKENS, load_draft, tokenizer_mask_token
from ..weights.folders import check_not_drafter, read_config
from ..weights.pairs import embedded_pair
from ..weights.hub import local_folder
from ..weights.target_loader import load_target
from .checkpoint import (
    LOSS_VOCAB,
    TrainingInterrupted,
    check_out,
    check_resume,
    drafter_mismatch,
    interrupt_after_step,
    latest_checkpoint,
    load_extra,
    load_state,
    resumed_settings,
    save_checkpoint,
    target_record,
)
from .data import (
    dataset_examples,
    generate_responses,
    make_batch,
    position_weights,
    read_prompts,
    render_prompt,
    usable,
)
from .precondition import ScaledLinear, feature_scale, folded_fc
from .grow import deepen
from .taps import TapStore
from .vocab import LossVocab, coverage, token_counts, top_tokens


@dataclass
class TrainingArgs:
    model: str | None = field(
        default=None, metadata={"help": "Target folder or hub id (default: SmolLM2-135M-Instruct, from its GGUF)."}
    )
    data: str | None = field(default=None, metadata={"help": "Prompts JSONL ('messages' or 'prompt'); required."})
    out: str = field(default="dflash-draft", metadata={"help": "Checkpoint folder (z-lab drafter format)."})
    responses: str = field(
        default="generate",
        metadata={"help": "'generate': the target's greedy answers; 'dataset': the file's."},
    )
    cache: str | None = field(
        default=None, metadata={"help": "Response cache JSONL (default: OUT/data.jsonl)."}
    )
    max_prompts: int | None = field(
        default=None, metadata={"help": "Most prompts to generate responses for (default: all)."}
    )
    data_minutes: float | None = field(
        default=None, metadata={"help": "Minutes of generating (0: the cache as is; default: no limit)."}
    )
    gen_max_tokens: int = field(default=256, metadata={"help": "Most tokens per generated response."})
    gen_batch_size: int = field(default=1, metadata={"help": "Responses generated together (1: plain loop)."})
    max_prompt_tokens: int = field(default=384, metadata={"help": "Longer prompts are skipped."})
    text_prompt_lines: int = field(
        default=0,
        metadata={"help": "Corpus 'text' chunks: first N lines as raw completion prompts (0: skip)."},
    )
    data_only: bool = field(default=False, metadata={"help": "Stop after the data step."})
    eval_data: str | None = field(
        default=None,
        metadata={"help": "Held-out prompts JSONL for acceptance (default: the held-out examples' prompts)."},
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per draft block."})
    num_layers: int = field(default=2, metadata={"help": "Drafter decoder layers."})
    intermediate_size: int | None = field(
        default=None, metadata={"help": "Drafter MLP size (default: target's)."}
    )
    num_taps: int = field(default=4, metadata={"help": "Target layers tapped (the paper's spread)."})
    target_features: bool = field(
        default=True,
        metadata={"help": "Condition on the target's taps (--no-target-features: the ablation without them)."},
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Explicit tapped layers (default: --num-taps layers, spread out)."}
    )
    mask_token_id: int | None = field(
        default=None, metadata={"help": "Mask token (default: the tokenizer's)."}
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "Compute dtype of both models (default: the drafter trains in float32; the target "
                          "computes its taps in the dtype dflash-generate uses: float32 on a CPU, the "
                          "checkpoint's on a GPU)."},
    )
    iters: int = field(default=1000, metadata={"help": "Optimizer steps."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per step."})
    blocks_per_seq: int = field(default=16, metadata={"help": "Anchored blocks per sequence."})
    max_seq_len: int = field(default=512, metadata={"help": "Sequences are cut to this many tokens."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Final LR as a fraction of the peak."})
    warmup: int = field(default=50, metadata={"help": "Linear warmup steps."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    grad_clip: float = field(default=1.0, metadata={"help": "Gradient norm clip (0: off)."})
    loss_decay: float = field(default=7.0, metadata={"help": "Block position weight exp(-(k-1)/d); 0: flat."})
    loss_positions: int | None = field(
        default=None,
        metadata={"help": "Train on the first N drafted positions of each block only (default: all B-1). The "
                          "LM head's cost is per position; a drafter accepted a few tokens a cycle rarely "
                          "reaches the last ones."},
    )
    loss_vocab: int | None = field(
        default=None,
        metadata={"help": "Compute the loss over the N token ids most frequent in the training responses only "
                          "(FR-Spec): the LM head's cost is N of its rows; a position whose label is not among "
                          "them counts for nothing (default: the whole vocabulary)."},
    )
    draft_vocab: bool = field(
        default=False,
        metadata={"help": "Save the --loss-vocab ids with the drafter, which then drafts among them only (its head "
                          "pass costs N rows too); the target still verifies over its whole vocabulary."},
    )
    val_examples: int = field(default=16, metadata={"help": "Examples held out for the validation loss."})
    eval_every: int = field(default=200, metadata={"help": "Steps between evaluations (0: only at the end)."})
    eval_prompts: int = field(default=8, metadata={"help": "Held-out prompts per acceptance evaluation."})
    eval_max_tokens: int = field(default=128, metadata={"help": "Tokens generated per evaluation prompt."})
    save_every: int = field(default=200, metadata={"help": "Steps between checkpoints."})
    log_every: int = field(default=10, metadata={"help": "Steps between progress lines."})
    stop_at: int | None = field(
        default=None, metadata={"help": "Stop after this step, to resume later (default: run all --iters)."}
    )
    minutes: float | None = field(
        default=None,
        metadata={"help": "Train for this many minutes (at most --iters steps); the cosine decay runs over the time, "
                          "so runs of different step costs compare at equal compute. Not with --resume."},
    )
    resume: bool = field(default=False, metadata={"help": "Continue from the checkpoint in --out."})
    init_draft: str | None = field(
        default=None,
        metadata={"help": "Start from this drafter's weights (folder or hub id; its settings must match this "
                          "run's, except a larger --num-layers, which grows it: the added layers go after its own "
                          "and start as identities) with a fresh optimizer, e.g. to train a shipped drafter "
                          "further on new data."},
    )
    cache_taps: bool = field(default=True, metadata={"help": "Keep each example's taps in memory."})
    drop_lookup_anchors: int = field(
        default=0,
        metadata={"help": "Draw no training anchor whose next this many tokens prompt lookup already drafts right "
                          "(the loop verifies lookup's drafts there without a drafter pass; 0: every anchor)."},
    )
    tap_cache: str | None = field(
        default=None,
        metadata={"help": "Folder keeping each example's taps on disk (bfloat16), computed up front "
                          "and reused by later runs on the same data and target (default: memory only)."},
    )
    logit_mse: float = field(
        default=0.0,
        metadata={"help": "Weight of a distillation term at every drafted position: the mean squared difference "
                          "of the drafter's and the target's centred logits over the whole vocabulary, computed "
                          "exactly in the hidden size (through the LM head's Gram matrix), so it costs almost "
                          "nothing; with it a small --loss-positions is enough (0: off)."},
    )
    precondition_fc: bool = field(
        default=True,
        metadata={"help": "Scale fc's outsized input features down while training (saved folded into fc, so the "
                          "drafter is a plain one); speeds up learning on targets with massive activations."},
    )
    compile: bool = field(default=True, metadata={"help": "Compile the training step with mx.compile."})
    seed: int = field(default=0, metadata={"help": "Seed for the drafter init and the data sampling."})


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


def _check_args(args: TrainingArgs) -> None:
    positive = [
        "block_size",
        "num_layers",
        "num_taps",
        "iters",
        "batch_size",
        "blocks_per_seq",
        "gen_max_tokens",
        "gen_batch_size",
        "max_seq_len",
        "max_prompt_tokens",
        "eval_max_tokens",
        "save_every",
        "log_every",
    ]
    for name in positive:
        if getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)}).")
    # 0 means none / off / flat for these; below 0 means nothing.
    for name in ("warmup", "weight_decay", "grad_clip", "val_examples", "eval_every", "eval_prompts", "logit_mse",
                 "text_prompt_lines"):
        if getattr(args, name) < 0:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 0 (got {getattr(args, name):g}).")
    if not 0 <= args.min_lr_ratio <= 1:
        raise DFlashError(f"--min-lr-ratio must be from 0 to 1 (got {args.min_lr_ratio:g}).")
    for name in ("intermediate_size", "stop_at", "max_prompts", "loss_vocab"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1 (got {value}); leave it out for the default.")
    if args.data_minutes is not None and args.data_minutes < 0:
        raise DFlashError(f"--data-minutes must be at least 0 (got {args.data_minutes:g}).")
    if args.block_size < 2:
        raise DFlashError(
            f"--block-size must be at least 2: one clean token and one to draft (got {args.block_size})."
        )
    if args.max_seq_len < args.block_size:
        raise DFlashError(
            f"--max-seq-len {args.max_seq_len} must be at least --block-size {args.block_size}."
        )
    if args.loss_positions is not None and not 1 <= args.loss_positions <= args.block_size - 1:
        raise DFlashError(
            f"--loss-positions must be from 1 to --block-size minus 1 = {args.block_size - 1} "
            f"(got {args.loss_positions}); leave it out to train on every position."
        )
    if args.draft_vocab and args.loss_vocab is None:
        raise DFlashError("--draft-vocab saves the --loss-vocab ids with the drafter: pass --loss-vocab N with it.")
    if args.learning_rate <= 0:
        raise DFlashError(f"--learning-rate must be greater than 0 (got {args.learning_rate:g}).")
    if args.loss_decay < 0:
        raise DFlashError(f"--loss-decay must be at least 0, 0 for flat weights (got {args.loss_decay:g}).")
    if not 0 <= args.seed <= MAX_SEED:
        raise DFlashError(f"--seed must be from 0 to {MAX_SEED} (got {args.seed}).")
    if args.responses not in ("generate", "dataset"):
        raise DFlashError(f"responses must be 'generate' or 'dataset' (got {args.responses!r}).")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise DFlashError(f"dtype={args.dtype!r} is not one of {', '.join(DTYPES)}.")
    if args.data is None:
        raise DFlashError("No training prompts: pass a JSONL file with --data.")
    if args.minutes is not None and args.minutes <= 0:
        raise DFlashError(f"--minutes must be greater than 0 (got {args.minutes:g}).")
    if args.minutes is not None and args.resume:
        raise DFlashError("--minutes schedules one uninterrupted run and cannot be resumed; leave out --resume "
                          "(or --minutes, to continue by steps).")
    if args.resume and args.init_draft is not None:
        raise DFlashError("--resume continues the run in --out; --init-draft starts a new one. Pass one of them.")


def draft_config(target: nn.Module, tokenizer, args: TrainingArgs) -> dict:
    """A z-lab-format drafter config whose attention shapes follow the target's."""
    a, n_layers = target.args, tgt.num_layers(target)
    ids = args.target_layer_ids or default_target_layer_ids(n_layers, args.num_taps)
    if not all(0 <= i < n_layers for i in ids) or len(set(ids)) != len(ids):
        raise DFlashError(
            f"--target-layer-ids {' '.join(map(str, ids))} must be distinct layers of the target (0..{n_layers - 1}); "
            f"pass fewer --num-taps or valid --target-layer-ids."
        )
    mask_id = tokenizer_mask_token(tokenizer) if args.mask_token_id is None else args.mask_token_id
    if mask_id is None or not 0 <= mask_id < a.vocab_size:
        raise DFlashError(
            f"No usable mask token (got {mask_id}): the tokenizer has none of {', '.join(MASK_TOKENS)}. "
            f"Pass --mask-token-id with an id below {a.vocab_size}."
        )
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": a.hidden_size,
        "intermediate_size": args.intermediate_size or a.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": getattr(a, "rope_theta", 10000.0),
        "max_position_embeddings": getattr(a, "max_position_embeddings", None) or 32768,
        "vocab_size": a.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": n_layers,
        "block_size": args.block_size,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(ids)},
        "torch_dtype": "float32",
    }
    if not args.target_features:
        config["dflash_config"]["use_target_features"] = False
    scaling = getattr(a, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        config["rope_scaling"] = scaling
    return config


def packed_block_mask(anchors: mx.array, starts: mx.array, context_len: int, block_size: int) -> mx.array:
    """Which keys each training block may see: ``(nb, 1, B, L + B)`` booleans.

    Block i sees the context of its own sequence strictly before its anchor (what the
    target has verified when the block is drafted), and its own block both ways. It never
    sees another block: those are other batch rows.
    """
    nb = anchors.shape[0]
    pos = mx.arange(context_len)[None]
    context = (pos >= starts[:, None]) & (pos < anchors[:, None])  # (nb, L)
    mask = mx.concatenate([context, mx.ones((nb, block_size), dtype=mx.bool_)], axis=1)
    return mx.broadcast_to(mask[:, None, None, :], (nb, 1, block_size, context_len + block_size))


def block_hidden(draft, target, taps, blocks, anchors, starts, speedups=None) -> mx.array:
    """The drafter's last hidden states ``(nb, B, H)`` for many blocks over one packed context
    ``taps``; each block row gets its own RoPE position (its anchor), as in inference."""
    mask = packed_block_mask(anchors, starts, taps.shape[1], blocks.shape[1])
    return draft(tgt.embed(target, blocks), taps, mask=mask, block_offset=anchors, speedups=speedups)


def block_logits(
    draft, target, taps, blocks, anchors, starts, speedups=None, positions=None, vocab: LossVocab | None = None
) -> mx.array:
    """Draft logits ``(nb, positions, vocab)`` of many blocks over one packed context ``taps``:
    the first ``positions`` drafted positions (None: all ``B - 1``), over the whole vocabulary
    or the ``vocab`` subset's ids (``(nb, positions, N)``).

    The whole block goes through the drafter either way, so every position sees the block
    it sees at inference.
    """
    h = block_hidden(draft, target, taps, blocks, anchors, starts, speedups)
    end = blocks.shape[1] if positions is None else 1 + positions
    return _head(target, h[:, 1:end], vocab)


def _head(target, h: mx.array, vocab: LossVocab | None) -> mx.array:
    return tgt.lm_head(target, h) if vocab is None else vocab.logits(h)


def block_loss(
    draft, target, taps, blocks, anchors, starts, labels, weights, speedups=None, positions=None,
    target_final=None, gram=None, logit_mse=0.0, vocab: LossVocab | None = None,
) -> mx.array:  # fmt: skip
    """Weighted cross-entropy on the masked block positions (the first ``positions`` of them),
    plus ``logit_mse`` times :func:`logit_error` at every position when it is positive
    (``target_final``: the target's packed final hidden states, ``gram``: :func:`head_gram`).

    With ``vocab`` the cross-entropy is over its ids only, and a position whose label is not
    among them has weight 0; the distillation term is the same either way."""
    h = block_hidden(draft, target, taps, blocks, anchors, starts, speedups)
    end = blocks.shape[1] if positions is None else 1 + positions
    logits = _head(target, h[:, 1:end], vocab).astype(mx.float32)
    n = logits.shape[1]
    targets, w = labels[:, :n], weights[:, :n]
    if vocab is not None:
        targets, w = vocab.labels(targets, w)
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    # At least one label inside the subset in a real batch; no NaN from a batch with none.
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
    if logit_mse > 0:
        loss = loss + logit_mse * logit_error(h[:, 1:], target_final, anchors, gram, weights)
    return loss


def head_gram(target: nn.Module) -> mx.array:
    """``G = Wc^T Wc / V`` for the LM head ``W (V, H)`` with its mean row removed.

    For hidden states ``h`` and ``h*``, ``(h - h*)^T G (h - h*)`` is the mean squared
    difference of their logits over the vocabulary, each set shifted to mean zero (a shift
    does not change the softmax): logit matching at the cost of an ``H x H`` product.
    """
    eye = mx.eye(tgt.hidden_size(target), dtype=mx.float32)
    # The head applied to the identity is W^T, whatever form (tied, quantized) it has.
    w = tgt.head_linear(target, eye.astype(tgt.compute_dtype(target))).astype(mx.float32)  # (H, V)
    w = w - w.mean(axis=1, keepdims=True)
    return mx.stop_gradient((w @ w.T) / w.shape[1])


def logit_error(
    h: mx.array, target_final: mx.array, anchors: mx.array, gram: mx.array, weights: mx.array
) -> mx.array:
    """Weighted mean over the drafted positions of the centred logits' squared error
    against the target's (see :func:`head_gram`).

    Block position ``k`` drafts the token at ``anchor + k``, which the target predicted
    from its last hidden state at ``anchor + k - 1``: row ``k - 1`` of ``h``. Positions past
    a sequence's end have weight 0 (their index is clamped).
    """
    n = h.shape[1]
    idx = mx.minimum(anchors[:, None] + mx.arange(n)[None], target_final.shape[1] - 1)
    d = h.astype(mx.float32) - target_final[0][idx].astype(mx.float32)
    err = ((d @ gram) * d).sum(axis=-1)
    return (err * weights[:, :n]).sum() / weights[:, :n].sum()


def _to_mx(batch: dict) -> dict:
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
    """Mean acceptance length (tau over drafting cycles, :class:`dflash_mlx.responses.AcceptanceStats`)
    with the real speculative loop, and drafting cycles by acceptance length (with ``tree_budget``,
    of draft trees)."""
    acceptance = AcceptanceStats()
    for ids in prompts:
        options = LoopOptions(
            max_tokens=max_tokens, stop_tokens=stop_tokens, block_size=block_size,
            tree_budget=tree_budget, adaptive=False,  # the drafter's own acceptance, every cycle drafted
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
        cast(init, _drafter_dtype(args))
        # More layers than the starting drafter's: it is grown (dflash_mlx.train.grow).
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
            print(f"training {args.init_draft} (block size {init_config['block_size']}) at block size "
                  f"{config['block_size']}", flush=True)
    return target, tokenizer, config, target_info, init


def _drafter_dtype(args: TrainingArgs) -> str:
    # The drafter's weights train in float32 wherever the target computes (bfloat16 on a GPU).
    return args.dtype or "float32"


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
        raise DFlashError(
            f"No usable training examples in {args.data}: check --max-seq-len and the responses."
        )
    if args.eval_data:
        eval_prompts = [
            render_prompt(tokenizer, p)
            for p in read_prompts(args.eval_data, text_prompt_lines=args.text_prompt_lines)[
                : args.eval_prompts
            ]
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
        cast(draft, _drafter_dtype(args))
    elif init is not None:
        draft = init
        print(f"starting from the drafter {args.init_draft}", flush=True)
    else:
        draft = DraftModel(DraftArgs.from_dict(config))
        draft.set_dtype(DTYPES[_drafter_dtype(args)])
    draft.set_draft_vocab(draft_vocab)
    draft.train()
    optimizer = optim.AdamW(
        learning_rate=args.learning_rate, betas=[0.9, 0.95], weight_decay=args.weight_decay
    )
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
            print(f"dflash-train: note: resuming with {'; '.join(changed)}: the run goes on with these, so it no "
                  "longer repeats an uninterrupted run of the checkpoint's settings.", file=sys.stderr, flush=True)
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
                     keep=args.cache_taps)  # fmt: skip
    if args.tap_cache is not None:
        store.fill(train_ex + val_ex, stream=sys.stdout)

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
    loss_fn = partial(block_loss, draft, target, speedups=choose_speedups(DTYPES[_drafter_dtype(args)]),
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
        for b in map(_to_mx, val_batches):
            taps, target_final = taps_for(b, val_ex)
            val.append(loss_fn(taps, *[b[k] for k in _KEYS], target_final=target_final).item())
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
            batch = _to_mx(make_batch(train_ex, rng, **batch_kwargs, drop_lookup=args.drop_lookup_anchors))
            taps, last_hidden = taps_for(batch, train_ex)
            loss = step_fn(taps, last_hidden, *[batch[k] for k in _KEYS])
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
                bar.update(step, f"loss {loss:.3f} {tokens_done / elapsed:,.0f} tok/s ETA {eta_text}", elapsed=False)
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
    _check_args(args)
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


_KEYS = ("blocks", "anchors", "starts", "labels", "weights")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    # A help text that already says its default (or has none worth saying) is shown as it is.
    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter for an mlx-lm target.",
        formatter_class=_HelpFormatter,
    )
    for f in dataclasses.fields(TrainingArgs):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif f.name == "target_layer_ids":
            parser.add_argument(flag, type=int, nargs="+", default=None, help=help_text)
        else:
            kind = next((t for t in (int, float) if f.type is t or t in getattr(f.type, "__args__", ())), str)
            choices = {"responses": ["generate", "dataset"], "dtype": list(DTYPES)}
            parser.add_argument(
                flag, type=kind, default=f.default, help=help_text, choices=choices.get(f.name)
            )
    add_blas_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = setup_arg_parser()
    args = vars(parser.parse_args(argv))
    args.pop("blas")  # used by the console script before anything loaded
    try:
        _check_args(TrainingArgs(**args))
    except DFlashError as e:
        parser.error(str(e))  # a bad value exits 2, as in the other tools
    try:
        train(TrainingArgs(**args))
    except DFlashError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        sys.exit(1)
    except TrainingInterrupted as e:
        print(f"dflash-train: interrupted at step {e.step}; saved to {e.out}; rerun with --resume to continue",
              file=sys.stderr)  # fmt: skip
        sys.exit(130)
    except KeyboardInterrupt:
        checkpoint = latest_checkpoint(Path(args["out"])) if Path(args["out"]).is_dir() else None
        if checkpoint is None:
            saved = "no checkpoint saved (the response cache keeps the responses generated so far)"
        else:
            step = json.loads((checkpoint[0] / "state.json").read_text())["step"]
            saved = f"the last checkpoint in {args['out']} is at step {step}; rerun with --resume to continue"
        print(f"dflash-train: interrupted; {saved}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
