"""The target model and its tokenizer, built by mlx-lm from a checked folder."""

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from ..base.errors import DFlashError
from .folders import PairSource, parse_config, read_config, read_pair
from .hub import PairFolders
from .sharding import kept_layers, layer_files, rank_files, read_shards, shard_target, world_size
from .target_checks import check_target

INDEX = "model.safetensors.index.json"


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
    over the ranks when there are several (:func:`dflash_mlx.loading.sharding.shard_target`)."""
    path = source.target
    several = world_size() > 1
    absent = _absent_files(path)  # a pipeline rank's download holds only its own files
    # Several ranks: built lazily, so that each reads only the weights its shard keeps.
    model, config = load_target_model(path, config=source.target_config, lazy=several, strict=not (several and absent))
    if several or parallel is not None:
        shard_target(model, parallel, pipeline_split)  # alone, an error that says to use mlx.launch
    layers = kept_layers(model)
    if absent and (lacking := sorted(absent & layer_files(_weight_map(path), layers))):
        rank = mx.distributed.init().rank()
        whose = "every rank" if layers is None else f"rank {rank} (layers {layers.start}..{layers.stop - 1})"
        raise DFlashError(
            f"The target folder {path} lacks {', '.join(lacking)}, which {whose} needs. Download the whole "
            "checkpoint, or pass the target's hub id: each rank then downloads the files it needs."
        )
    if several:
        read_shards(model)
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


def select_files(path: Path, *, parallel: str | None, pipeline_split: list[int] | None) -> list[str] | None:
    """The weight files this rank downloads of a hub target, from its snapshot without weights
    (config, index, tokenizer): None (all) for a checkpoint without an index, else
    :func:`dflash_mlx.loading.sharding.rank_files` of the target built without weights."""
    if world_size() == 1 or not (path / INDEX).is_file():
        return None
    config = read_config(path, "target")
    model, _ = load_target_model(path, config=config, lazy=True, strict=False)
    return sorted(rank_files(model, _weight_map(path), parallel, pipeline_split))


def _weight_map(path: Path) -> dict[str, str]:
    index = parse_config(path / INDEX, "target") if (path / INDEX).is_file() else {}
    weight_map = index.get("weight_map")
    return weight_map if isinstance(weight_map, dict) else {}


def _absent_files(path: Path) -> set[str]:
    # The files the checkpoint's index lists that the folder does not hold.
    return {f for f in set(_weight_map(path).values()) if not (path / f).is_file()}


def load_target_model(
    path: Path, *, config: dict[str, Any], lazy: bool = False, strict: bool = True
) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's ``load_model`` on a target folder, with a broken folder reported in one line.
    ``strict=False`` takes a folder that holds only some of the weights (or none).

    Raises:
        DFlashError: If a config field the architecture needs is missing, or the weights are
          missing, corrupt or do not fit the config.
    """
    try:
        return load_model(path, lazy=lazy, strict=strict, trust_remote_code=False)
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
