"""The target model and its tokenizer, built by mlx-lm from a checked folder."""

import re
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from ..errors import DFlashError
from .folders import PairSource, read_pair
from .hub import PairFolders
from .sharding import shard_target, world_size
from .target_checks import check_target


def load_target(path: Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm target and its tokenizer from a local folder, in the checkpoint's dtype,
    its files read and checked as :func:`dflash_mlx.load` does.

    Raises:
        DFlashError: On missing or corrupt files, or a target DFlash cannot run.
    """
    return build_target(check_target(read_pair(PairFolders(path, None))))


def build_target(
    source: PairSource, *, parallel: str | None = None, pipeline_split: list[int] | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """The target of a read and checked pair, built by mlx-lm's loader, and its tokenizer; split
    over the ranks when there are several (:func:`dflash_mlx.weights.sharding.shard_target`)."""
    path = source.target
    several = world_size() > 1
    # Several ranks: built lazily, so that each reads only the weights its shard keeps.
    model, config = load_target_model(path, config=source.target_config, lazy=several)
    if several or parallel is not None:
        shard_target(model, parallel, pipeline_split)  # alone, an error that says to use mlx.launch
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise DFlashError(
            f"Could not load the tokenizer from {path} ({type(e).__name__}: {e}). "
            "The target folder needs its tokenizer files."
        ) from e
    if len(tokenizer.get_vocab()) < 2:
        raise DFlashError(
            f"The tokenizer files in {path} give an empty vocabulary: copy them from the model's original "
            "folder or Hugging Face repository."
        )
    return model, tokenizer


def load_target_model(path: Path, *, config: dict[str, Any], lazy: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's ``load_model`` on a target folder, with a broken folder reported in one line.

    Raises:
        DFlashError: If a config field the architecture needs is missing, or the weights are
          missing, corrupt or do not fit the config.
    """
    try:
        return load_model(path, lazy=lazy, trust_remote_code=False)
    except TypeError as e:
        # mlx-lm builds ModelArgs(**config): a missing field is a missing constructor argument.
        fields = re.findall(r"'(\w+)'", str(e).partition("missing")[2])
        if not fields:
            raise
        model_type = config.get("model_type")
        raise DFlashError(
            f"The target config {path / 'config.json'} lacks {', '.join(fields)}, which a {model_type} "
            "model needs. Re-download or re-convert the target, or add the field to its config.json."
        ) from e
    except RuntimeError as e:
        # MLX's safetensors reader reports a truncated or corrupt file as a RuntimeError.
        raise DFlashError(
            f"Could not read the target weights in {path} ({e}). Re-download or re-convert the target."
        ) from e
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise DFlashError(f"Could not load the target from {path} ({type(e).__name__}: {e}).") from e
