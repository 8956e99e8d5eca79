"""Reading a model folder's files: its config, its weights, whether it has a tokenizer."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..base.errors import DFlashError
from .hub import PairFolders

# Files one of which every tokenizer needs; without them transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


@dataclass(frozen=True)
class PairSource:
    """A pair's folders with what the loaders need read once: each config, the target's tensor
    names (its weights are read by mlx-lm's loader), the drafter's weights."""

    target: Path
    target_config: dict[str, Any]
    target_weight_names: tuple[str, ...] = ()
    draft: Path | None = None
    draft_config: dict[str, Any] | None = None
    draft_weights: dict[str, mx.array] = field(default_factory=dict)


def read_pair(folders: PairFolders) -> PairSource:
    """Read a pair's folders: the target's config (unless its hub check read it), tensor names and
    tokenizer files; the drafter's config and weights.

    Raises:
        DFlashError: On missing or corrupt files, a drafter given as the target, or a drafter
          folder that holds no DFlash drafter.
    """
    config = folders.target_config or read_config(folders.target, "target")
    check_not_drafter(
        config, folders.target, "Pass it as the drafter (--draft) and give the target model with --model."
    )
    names = tuple(read_weights(folders.target, "target"))  # a clear message for missing or corrupt files
    check_tokenizer_files(folders.target)
    if folders.draft is None:
        return PairSource(folders.target, config, names)
    draft_config = read_draft_config(folders.draft)
    return PairSource(
        folders.target, config, names, folders.draft, draft_config, read_weights(folders.draft, "drafter")
    )


def check_not_drafter(config: dict[str, Any], where: str | Path, fix: str) -> None:
    """Refuse a drafter's config given as the target's; ``fix`` (how the command takes each) ends the message."""
    if is_drafter_config(config):
        raise DFlashError(f"{where} holds a DFlash drafter, not a target model. {fix}")


def read_draft_config(path: Path) -> dict[str, Any]:
    """A drafter folder's config.

    Raises:
        DFlashError: If the folder holds no DFlash drafter (a target model, say).
    """
    config = read_config(path, "drafter")
    if not is_drafter_config(config):
        archs = config.get("architectures")
        raise DFlashError(
            f"{path} is not a DFlash drafter (architectures={archs}, no dflash_config). "
            "Pass a DFlash checkpoint such as z-lab/Qwen3-8B-DFlash-b16 as the drafter."
        )
    return config


def read_config(path: Path, what: str) -> dict[str, Any]:
    """``path``'s config.json as a dict; ``what`` names the folder's role in the error."""
    file = path / "config.json"
    if not file.is_file():
        raise DFlashError(f"No config.json in {path}: the {what} must be a model folder.")
    return parse_config(file, what)


def parse_config(file: Path, what: str) -> dict[str, Any]:
    """A config file read as a JSON object (also one fetched alone from the hub)."""
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{file} is not valid JSON ({e}). Re-download or re-convert the {what}.") from None
    if not isinstance(config, dict):
        raise DFlashError(f"{file} is not a JSON object. Re-download or re-convert the {what}.")
    return config


def is_drafter_config(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    known = ("DFlash", "DFlare", "DSpark")
    return any(k in a for a in archs for k in known) or "dflash_config" in config or "target_layer_ids" in config


def read_weights(path: Path, what: str) -> dict[str, mx.array]:
    """Every ``*.safetensors`` tensor of ``path``, with a missing or corrupt file said in one line."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"No *.safetensors weights in {path}. Re-download or re-convert the {what}.")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise DFlashError(
                f"Could not read {f} ({e}). The file is corrupt or incomplete: re-download or re-convert the {what}."
            ) from e
    return weights


def check_tokenizer_files(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise DFlashError(
            f"No usable tokenizer files in {path} (tokenizer.json, tokenizer.model or vocab.json with their "
            "tokenizer_config.json): copy them from the model's original folder or Hugging Face repository."
        )
