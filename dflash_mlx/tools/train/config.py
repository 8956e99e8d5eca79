"""A dflash-train run's settings: ``TrainingArgs`` (one field per flag), their checks, and the drafter config a
run builds from them and its target."""

from dataclasses import dataclass, field

import mlx.nn as nn

from ...base.dtypes import DTYPES
from ...base.errors import DFlashError
from ...loading.draft_loader import MASK_TOKENS, tokenizer_mask_token
from ...models import target as tgt
from ...models.drafter import default_target_layer_ids
from ...text.inputs import MAX_SEED


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
    cache: str | None = field(default=None, metadata={"help": "Response cache JSONL (default: OUT/data.jsonl)."})
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
    intermediate_size: int | None = field(default=None, metadata={"help": "Drafter MLP size (default: target's)."})
    num_taps: int = field(default=4, metadata={"help": "Target layers tapped (the paper's spread)."})
    target_features: bool = field(
        default=True,
        metadata={"help": "Condition on the target's taps (--no-target-features: the ablation without them)."},
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Explicit tapped layers (default: --num-taps layers, spread out)."}
    )
    mask_token_id: int | None = field(default=None, metadata={"help": "Mask token (default: the tokenizer's)."})
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Compute dtype of both models (default: the drafter trains in float32; the target "
            "computes its taps in the dtype dflash-generate uses: float32 on a CPU, the "
            "checkpoint's on a GPU)."
        },
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
        metadata={
            "help": "Train on the first N drafted positions of each block only (default: all B-1). The "
            "LM head's cost is per position; a drafter accepted a few tokens a cycle rarely "
            "reaches the last ones."
        },
    )
    loss_vocab: int | None = field(
        default=None,
        metadata={
            "help": "Compute the loss over the N token ids most frequent in the training responses only "
            "(FR-Spec): the LM head's cost is N of its rows; a position whose label is not among "
            "them counts for nothing (default: the whole vocabulary)."
        },
    )
    draft_vocab: bool = field(
        default=False,
        metadata={
            "help": "Save the --loss-vocab ids with the drafter, which then drafts among them only (its head "
            "pass costs N rows too); the target still verifies over its whole vocabulary."
        },
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
        metadata={
            "help": "Train for this many minutes (at most --iters steps); the cosine decay runs over the time, "
            "so runs of different step costs compare at equal compute. Not with --resume."
        },
    )
    resume: bool = field(default=False, metadata={"help": "Continue from the checkpoint in --out."})
    init_draft: str | None = field(
        default=None,
        metadata={
            "help": "Start from this drafter's weights (folder or hub id; its settings must match this "
            "run's, except a larger --num-layers, which grows it: the added layers go after its own "
            "and start as identities) with a fresh optimizer, e.g. to train a shipped drafter "
            "further on new data."
        },
    )
    cache_taps: bool = field(
        default=True,
        metadata={
            "help": "Keep each example's taps in memory (without --tap-cache; all of them: for a small data set)."
        },
    )
    drop_lookup_anchors: int = field(
        default=0,
        metadata={
            "help": "Draw no training anchor whose next this many tokens prompt lookup already drafts right "
            "(the loop verifies lookup's drafts there without a drafter pass; 0: every anchor)."
        },
    )
    tap_cache: str | None = field(
        default=None,
        metadata={
            "help": "Folder keeping each example's taps on disk (bfloat16), written the first time the "
            "example is drawn: a long run reads them back when it draws it again, and resumed or "
            "later runs on the same data and target reuse them (default: none; see --cache-taps)."
        },
    )
    tap_cache_gb: float = field(
        default=16.0,
        metadata={
            "help": "The --tap-cache folder's size limit in GB (about 7 kB a token for SmolLM2's 5 taps); "
            "examples not on disk past it are computed each time they are drawn."
        },
    )
    logit_mse: float = field(
        default=0.0,
        metadata={
            "help": "Weight of a distillation term at every drafted position: the mean squared difference "
            "of the drafter's and the target's centred logits over the whole vocabulary, computed "
            "exactly in the hidden size (through the LM head's Gram matrix), so it costs almost "
            "nothing; with it a small --loss-positions is enough (0: off)."
        },
    )
    precondition_fc: bool = field(
        default=True,
        metadata={
            "help": "Scale fc's outsized input features down while training (saved folded into fc, so the "
            "drafter is a plain one); speeds up learning on targets with massive activations."
        },
    )
    compile: bool = field(default=True, metadata={"help": "Compile the training step with mx.compile."})
    seed: int = field(default=0, metadata={"help": "Seed for the drafter init and the data sampling."})


def check_args(args: TrainingArgs) -> None:
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
    for name in (
        "warmup",
        "weight_decay",
        "grad_clip",
        "val_examples",
        "eval_every",
        "eval_prompts",
        "logit_mse",
        "text_prompt_lines",
    ):
        if getattr(args, name) < 0:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 0 (got {getattr(args, name):g}).")
    if not 0 <= args.min_lr_ratio <= 1:
        raise DFlashError(f"--min-lr-ratio must be from 0 to 1 (got {args.min_lr_ratio:g}).")
    for name in ("intermediate_size", "stop_at", "max_prompts", "loss_vocab"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise DFlashError(
                f"--{name.replace('_', '-')} must be at least 1 (got {value}); leave it out for the default."
            )
    if args.data_minutes is not None and args.data_minutes < 0:
        raise DFlashError(f"--data-minutes must be at least 0 (got {args.data_minutes:g}).")
    if args.block_size < 2:
        raise DFlashError(f"--block-size must be at least 2: one clean token and one to draft (got {args.block_size}).")
    if args.max_seq_len < args.block_size:
        raise DFlashError(f"--max-seq-len {args.max_seq_len} must be at least --block-size {args.block_size}.")
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
    if args.tap_cache_gb <= 0:
        raise DFlashError(
            f"--tap-cache-gb must be greater than 0 (got {args.tap_cache_gb:g}); leave out --tap-cache for no folder."
        )
    if args.minutes is not None and args.minutes <= 0:
        raise DFlashError(f"--minutes must be greater than 0 (got {args.minutes:g}).")
    if args.minutes is not None and args.resume:
        raise DFlashError(
            "--minutes schedules one uninterrupted run and cannot be resumed; leave out --resume "
            "(or --minutes, to continue by steps)."
        )
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


def drafter_dtype(args: TrainingArgs) -> str:
    # The drafter's weights train in float32 wherever the target computes (bfloat16 on a GPU).
    return args.dtype or "float32"
