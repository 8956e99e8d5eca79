"""A DFlash drafter built from its folder, and the checks that it belongs to its target."""

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..base.errors import DFlashError
from ..models import dflare, drafter, drafter2, dspark
from ..models import target as tgt
from ..models.drafter import DraftArgs, DraftModel
from .folders import read_draft_config, read_weights

MASK_TOKENS = ("<|MASK|>", "<|mask|>", "<mask>")


def load_draft(path: Path, *, target: nn.Module | None = None, tokenizer: TokenizerWrapper | None = None) -> DraftModel:
    """Load a DFlash drafter (z-lab format: config.json + *.safetensors) from a local folder, in
    the checkpoint's dtype; a DFlash2 one (``architectures: ["DFlash2DraftModel"]``) as
    :class:`dflash_mlx.models.drafter2.DraftModel`.

    Args:
        path: The drafter's folder.
        target: The target it drafts for: its layer count stands in where the config names none,
          and the two are checked to belong together (:func:`check_drafter`).
        tokenizer: The target's tokenizer, whose mask token (:func:`tokenizer_mask_token`) stands
          in where the config names none.

    Raises:
        DFlashError: On missing or corrupt files, a checkpoint that is no DFlash drafter, or one
          made for another target.
    """
    shape = None if target is None else tgt.target_shape(target)
    return build_draft(path, read_draft_config(path), read_weights(path, "drafter"), shape, tokenizer)


def build_draft(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    shape: tgt.TargetShape | None,
    tokenizer: TokenizerWrapper | None,
) -> DraftModel:
    """The drafter of a read pair (see :func:`load_draft`), checked against ``shape`` when given."""
    weights = dict(weights)
    config = dict(config)
    if shape is not None and not config.get("num_target_layers"):
        config["num_target_layers"] = shape.num_layers
    named = config.get("dflash_config", {}).get("mask_token_id", config.get("mask_token_id"))
    if named is None and tokenizer is not None and (mask_token_id := tokenizer_mask_token(tokenizer)) is not None:
        config["mask_token_id"] = mask_token_id
    # The architecture's module: its DraftArgs and DraftModel.
    family = family_module(config)
    try:
        args = family.DraftArgs.from_dict(config)
    except TypeError as e:
        raise DFlashError(f"The drafter config {path / 'config.json'} is missing a field: {e}") from e
    if not args.target_layer_ids:
        raise DFlashError(
            f"The drafter config in {path} has no target_layer_ids and no num_target_layers; "
            "add dflash_config.target_layer_ids to its config.json."
        )
    _check_draft_vocab(path, args, weights)
    if family is dspark:
        dspark.adapt_args(args, weights)
    draft = family.DraftModel(args)
    weights = draft.sanitize(weights)
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            draft,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights,
        )
    try:
        draft.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        # MLX names the missing, unexpected or misshapen parameters.
        detail = " ".join(str(e).split())
        raise DFlashError(
            f"The drafter weights in {path} do not match its config ({detail}). The config and the "
            "weights do not belong together: re-download or re-convert the drafter."
        ) from e
    mx.eval(draft.parameters())
    draft.eval()
    # Where it came from: the Python API's datastore="auto" knows the default pair's drafter by it.
    draft.folder = Path(path)
    if shape is not None:
        check_drafter(shape, draft)
    return draft


def family_module(config: dict[str, Any]):
    """The module of the drafter family a config names (its DraftArgs and DraftModel): DFlash2, DSpark,
    DFlare by their ``architectures``, else DFlash (JetSpec's heads among them)."""
    for module, matches in ((drafter2, drafter2.is_dflash2), (dspark, dspark.is_dspark), (dflare, dflare.is_dflare)):
        if matches(config):
            return module
    return drafter


def _check_draft_vocab(path: Path, args: DraftArgs, weights: dict[str, mx.array]) -> None:
    """A ``draft_vocab_size`` in the config and a ``draft_vocab`` tensor of as many distinct
    token ids go together; cast to int32 in ``weights``."""
    size, ids = args.draft_vocab_size, weights.get("draft_vocab")
    fix = "The config and the weights do not belong together: re-save or re-convert the drafter."
    if size is None and ids is None:
        return
    if size is None:
        raise DFlashError(
            f"The drafter weights in {path} hold a draft_vocab tensor, but its config has no draft_vocab_size. {fix}"
        )
    if not isinstance(size, int) or size < 1:
        raise DFlashError(f"The drafter config in {path} has draft_vocab_size={size!r}; it must be a positive "
                          "number of token ids, or left out to draft over the whole vocabulary.")  # fmt: skip
    if ids is None:
        raise DFlashError(
            f"The drafter config in {path} has draft_vocab_size={size}, but its weights hold no draft_vocab "
            f"tensor. {fix}"
        )
    if ids.ndim != 1 or ids.shape[0] != size:
        raise DFlashError(
            f"The drafter config in {path} has draft_vocab_size={size}, but its draft_vocab tensor has shape "
            f"{tuple(ids.shape)}. {fix}"
        )
    values = np.array(ids.astype(mx.int64)) if mx.issubdtype(ids.dtype, mx.integer) else None
    vocab = args.vocab_size
    if (
        values is None
        or values.min() < 0
        or (vocab is not None and values.max() >= vocab)
        or (len(np.unique(values)) != size)
    ):
        upper = f"from 0 to {vocab - 1}" if vocab is not None else "of at least 0"
        raise DFlashError(
            f"The drafter's draft_vocab in {path} must hold {size} distinct integer token ids {upper}. "
            "Re-save or re-convert the drafter."
        )
    weights["draft_vocab"] = ids.astype(mx.int32)


def tokenizer_mask_token(tokenizer: TokenizerWrapper) -> int | None:
    """The id of the tokenizer's mask token (one of ``MASK_TOKENS``), or None."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return next((vocab[t] for t in MASK_TOKENS if t in vocab), None)


def check_pair(model: nn.Module, draft: DraftModel) -> None:
    """Check that ``draft`` was made for the target ``model`` (see :func:`check_drafter`)."""
    check_drafter(tgt.target_shape(model), draft)


def check_drafter(shape: tgt.TargetShape, draft: DraftModel) -> None:
    """Check once, at load, that ``draft`` was made for a target of this ``shape``.

    Raises:
        DFlashError: Naming the first mismatch and what to do about it.
    """
    a, fix = draft.args, "Pass the drafter trained for this target with --draft."
    n_layers, hidden, vocab = shape.num_layers, shape.hidden_size, shape.vocab_size
    if a.target_hidden_size is not None and a.target_hidden_size != hidden:
        raise DFlashError(
            f"The drafter was made for a target of hidden_size={a.target_hidden_size}, but this target has "
            f"hidden_size={hidden}. {fix}"
        )
    if a.hidden_size != hidden:
        raise DFlashError(
            f"The drafter has hidden_size={a.hidden_size}, but the target has hidden_size={hidden}. {fix}"
        )
    if a.vocab_size is not None and a.vocab_size != vocab:
        raise DFlashError(
            f"The drafter was made for vocab_size={a.vocab_size}, but the target has vocab_size={vocab}. {fix}"
        )
    if a.num_target_layers is not None and a.num_target_layers != n_layers:
        raise DFlashError(
            f"The drafter was trained on a target with num_target_layers={a.num_target_layers}, "
            f"but this target has {n_layers} layers. {fix}"
        )
    if draft.draft_vocab is not None and draft.draft_vocab.max().item() >= vocab:
        raise DFlashError(
            f"The drafter's draft_vocab holds token ids up to {draft.draft_vocab.max().item()}, but the target "
            f"has vocab_size={vocab}. {fix}"
        )
    bad = [i for i in a.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DFlashError(
            f"The drafter taps target layers {a.target_layer_ids}, but the target has only "
            f"{n_layers} layers (0..{n_layers - 1}). {fix}"
        )
    if a.block_size < 2:
        raise DFlashError(f"The drafter's block_size must be at least 2 (got {a.block_size}). {fix}")
    # A DFlash drafter borrows the target's head, softcap included: its own value only names the
    # target's. (A DFlash2 drafter's softcap is its own, applied to its scaled logits.)
    cap = shape.final_logit_softcapping
    own_cap = isinstance(draft, drafter2.DraftModel)
    if not own_cap and a.final_logit_softcapping is not None and a.final_logit_softcapping != cap:
        raise DFlashError(
            f"The drafter was made for a target head with final_logit_softcapping={a.final_logit_softcapping}, "
            f"but this target's is {cap}. {fix}"
        )
    if a.mask_token_id is None:
        raise DFlashError(
            "The drafter config has no mask_token_id and the tokenizer has no mask token; "
            "add dflash_config.mask_token_id to the drafter's config.json."
        )
    if not 0 <= a.mask_token_id < vocab:
        raise DFlashError(
            f"The drafter's mask_token_id={a.mask_token_id} is outside the target's vocabulary (0..{vocab - 1}). {fix}"
        )
