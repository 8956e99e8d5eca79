"""Known official DFlash pairs: which published drafter goes with which target.

A target is recognised by its repository name, whatever the organisation, so the official
Hugging Face id (``Qwen/Qwen3-4B``), an MLX conversion (``mlx-community/Qwen3-4B-4bit``) and
a local Hugging Face cache snapshot of either all map to the same drafter. Only the usual
quantization and dtype suffixes are stripped: fine-tunes such as ``Qwen3-4B-Instruct-2507``
are different models and are not matched.

This module only holds data and string matching; it imports nothing heavy, so the command-line
tools can consult it before loading anything.
"""

import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..base.errors import DFlashError
from .pairs import AUTO_DRAFT, DEFAULT_PAIR, PairNames, default_pair_draft, is_embedded_pair, name_pair

# What the MLX community appends to a converted repository name: "-4bit", "-MLX-8bit",
# "-bf16", "-4bit-DWQ", "-mxfp4" and the like.
_QUANT_SUFFIX = re.compile(
    r"^(mlx-?)?(\d+(\.\d+)?-?bits?|bf16|fp16|float16|bfloat16|mxfp4|mxfp8|nvfp4|mlx)([-_].*)?$",
    re.IGNORECASE,
)
# A snapshot folder in the Hugging Face cache: .../models--org--name/snapshots/<revision>
_CACHE_FOLDER = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>.+)$")


@dataclass(frozen=True)
class KnownPair:
    """An official target and the DFlash drafter trained for it.

    Args:
        target: The target's Hugging Face id.
        draft: The drafter's Hugging Face id.
        model_type: The target's mlx-lm ``model_type``; DFlash runs only on the families
          ``dflash_mlx.models.target`` can tap.
        aliases: Other repository names of the same target (e.g. MLX community naming).
        mlx_ids: Published MLX conversions of the target known to exist, for the docs;
          any other ``<name>-<bits>bit`` conversion is matched too.
        needs: What DFlash still lacks to run the pair, said to whoever asks for it; None
          when it runs today.
    """

    target: str
    draft: str
    model_type: str
    aliases: tuple[str, ...] = ()
    mlx_ids: tuple[str, ...] = ()
    needs: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.target.rsplit("/", 1)[-1], *self.aliases)


KNOWN_PAIRS: tuple[KnownPair, ...] = (
    KnownPair(
        "Qwen/Qwen3-4B",
        "z-lab/Qwen3-4B-DFlash-b16",
        "qwen3",
        mlx_ids=("mlx-community/Qwen3-4B-4bit", "mlx-community/Qwen3-4B-8bit", "mlx-community/Qwen3-4B-bf16"),
    ),
    KnownPair(
        "Qwen/Qwen3-8B",
        "z-lab/Qwen3-8B-DFlash-b16",
        "qwen3",
        mlx_ids=("mlx-community/Qwen3-8B-4bit", "mlx-community/Qwen3-8B-8bit", "mlx-community/Qwen3-8B-bf16"),
    ),
    KnownPair(
        "meta-llama/Llama-3.1-8B-Instruct",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "llama",
        aliases=("Meta-Llama-3.1-8B-Instruct",),
        mlx_ids=(
            "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
            "mlx-community/Meta-Llama-3.1-8B-Instruct-8bit",
        ),
    ),
    KnownPair(
        "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        "z-lab/Qwen3-Coder-30B-A3B-DFlash",
        "qwen3_moe",
        mlx_ids=(
            "mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit",
            "mlx-community/Qwen3-Coder-30B-A3B-Instruct-8bit",
        ),
    ),
    KnownPair(
        "Qwen/Qwen3.5-4B",
        "z-lab/Qwen3.5-4B-DFlash",
        "qwen3_5",
        mlx_ids=("mlx-community/Qwen3.5-4B-4bit",),
    ),
    KnownPair(
        "Qwen/Qwen3.5-9B",
        "z-lab/Qwen3.5-9B-DFlash",
        "qwen3_5",
        mlx_ids=(
            "mlx-community/Qwen3.5-9B-4bit",
            "mlx-community/Qwen3.5-9B-8bit",
            "mlx-community/Qwen3.5-9B-MLX-4bit",
        ),
    ),
    KnownPair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", "qwen3_5"),
    KnownPair(
        "Qwen/Qwen3.5-35B-A3B",
        "z-lab/Qwen3.5-35B-A3B-DFlash",
        "qwen3_5_moe",
        mlx_ids=("mlx-community/Qwen3.5-35B-A3B-4bit",),
    ),
    KnownPair(
        "Qwen/Qwen3.5-122B-A10B",
        "z-lab/Qwen3.5-122B-A10B-DFlash",
        "qwen3_5_moe",
        mlx_ids=("mlx-community/Qwen3.5-122B-A10B-4bit",),
    ),
    KnownPair("Qwen/Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash", "qwen3_5_moe"),
    KnownPair(
        "openai/gpt-oss-20b",
        "z-lab/gpt-oss-20b-DFlash",
        "gpt_oss",
        mlx_ids=("mlx-community/gpt-oss-20b-MXFP4-Q8", "mlx-community/gpt-oss-20b-MXFP4-Q4"),
    ),
    KnownPair(
        "openai/gpt-oss-120b",
        "z-lab/gpt-oss-120b-DFlash",
        "gpt_oss",
        mlx_ids=(
            "mlx-community/gpt-oss-120b-MXFP4-Q8",
            "mlx-community/gpt-oss-120b-MXFP4-Q4",
            "mlx-community/gpt-oss-120b-4bit",
        ),
    ),
    KnownPair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", "qwen3_5"),
    KnownPair("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", "qwen3_5_moe"),
    # DFlash2 drafters (dflash_mlx.models.drafter2). Qwen3.8 is a Qwen3.5-architecture model; z-lab's
    # drafter is a mirror of incoai/Qwen3.8-27B-DFlash2.
    KnownPair(
        "Qwen/Qwen3.8-27B",
        "z-lab/Qwen3.8-27B-DFlash2",
        "qwen3_5",
        mlx_ids=("mlx-community/Qwen3.8-27B-4bit",),
    ),
    KnownPair(
        "zai-org/GLM-5.3-Flash",
        "incoai/GLM-5.3-Flash-DFlash2",
        "glm5_next",
        needs=(
            "its target's architecture (model_type glm5_next: Kimi delta attention and mHC layers) is not in "
            "mlx-lm 0.32, and DFlash has no taps or rollback for it"
        ),
    ),
    KnownPair(
        "Qwen/Qwen3-Coder-Next",
        "z-lab/Qwen3-Coder-Next-DFlash",
        "qwen3_next",
        mlx_ids=(
            "mlx-community/Qwen3-Coder-Next-4bit",
            "mlx-community/Qwen3-Coder-Next-5bit",
            "mlx-community/Qwen3-Coder-Next-8bit",
        ),
    ),
    KnownPair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", "gemma4"),
    KnownPair("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", "gemma4"),
    # The 12B's drafter is named gemma4-, not gemma-4-, on the hub.
    KnownPair("google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash", "gemma4_unified"),
    # Published with INT4 experts (compressed-tensors), which mlx-lm reads as they are.
    KnownPair("moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", "kimi_k25"),
)


# The default pair's target (dflash_mlx.loading.pairs.DEFAULT_PAIR), whose drafter ships here.
DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_TARGET_NAME = DEFAULT_TARGET.rsplit("/", 1)[-1]


def _repo_name(model: str | Path) -> str | None:
    """The repository name of a hub id, an HF cache snapshot folder, or None for other paths."""
    text = str(model).rstrip("/")
    parts = Path(text).parts
    # .../models--org--name/snapshots/<revision>
    if len(parts) >= 3 and parts[-2] == "snapshots" and (m := _CACHE_FOLDER.match(parts[-3])):
        return m.group("name")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return text.split("/")[1]
    return None


def _matches(name: str, base: str) -> bool:
    name, base = name.lower(), base.lower()
    if name == base:
        return True
    return name.startswith(base + "-") and _QUANT_SUFFIX.match(name[len(base) + 1 :]) is not None


def find_pair(model: str | Path) -> KnownPair | None:
    """The known pair whose target is ``model``, or None.

    Args:
        model: A Hugging Face id (``Qwen/Qwen3-4B``, ``mlx-community/Qwen3-4B-4bit``) or a
          snapshot folder of one in the Hugging Face cache. Other local folders are not
          recognised; pass their drafter explicitly.

    Returns:
        The matching ``KnownPair`` or None.
    """
    name = _repo_name(model)
    if name is None:
        return None
    for pair in KNOWN_PAIRS:
        if any(_matches(name, base) for base in pair.names):
            return pair
    return None


def is_default_target(model: str | Path) -> bool:
    """Whether ``model`` is the default pair's target, SmolLM2-135M-Instruct, from elsewhere: a
    Hugging Face id or cache snapshot of it (or of a conversion), or a GGUF file of it.

    Its drafter ships in this package (``assets/smollm2/draft``) rather than on the hub.
    """
    path = Path(str(model))
    if path.suffix.lower() == ".gguf":
        # SmolLM2-135M-Instruct.Q4_1.gguf, smollm2-135m-instruct-q8_0.gguf, ...
        return path.name.lower().startswith(DEFAULT_TARGET_NAME.lower())
    name = _repo_name(model)
    return name is not None and _matches(name, DEFAULT_TARGET_NAME)


def known_draft(model: str | Path) -> str | None:
    """The drafter for target ``model``: a known target's official one (a Hugging Face id), the
    default pair's shipped folder for SmolLM2-135M-Instruct (its hub id or a GGUF of it), or None."""
    if is_default_target(model):
        return str(default_pair_draft())
    return find_draft(model)


def find_draft(model: str | Path) -> str | None:
    """The Hugging Face id of the official drafter for ``model``, or None if unknown."""
    pair = find_pair(model)
    return pair.draft if pair is not None else None


def known_targets() -> list[str]:
    """The Hugging Face ids of every target with a known drafter that DFlash runs today."""
    return [p.target for p in KNOWN_PAIRS if p.needs is None]


def look_up(names: PairNames) -> PairNames:
    """``names`` with the registry's entry for the target, and ``AUTO_DRAFT`` replaced by the
    target's known drafter (see :func:`known_draft`).

    Raises:
        DFlashError: If ``AUTO_DRAFT`` was asked for a target with no known drafter.
    """
    known = find_pair(names.target)
    if names.draft != AUTO_DRAFT:
        return replace(names, known=known)
    draft = known_draft(names.target)
    if draft is None:
        raise DFlashError(
            f"No known DFlash drafter for the target {str(names.target)!r}. Pass the drafter with --draft "
            f"(known targets: {', '.join(known_targets())})."
        )
    # The target's revision means nothing for the drafter's repository.
    return replace(names, draft=draft, draft_revision=False, known=known)


def draft_for_cli(model: str | Path | None, draft: str | Path | None, no_draft: bool = False):
    """The ``draft`` the command-line tools pass to :func:`dflash_mlx.load`.

    A known target given without a drafter gets its official one (``AUTO_DRAFT``); otherwise
    what was given, which for an unknown target means plain decoding.
    """
    if draft is None and model is not None and not no_draft and known_draft(model):
        return AUTO_DRAFT
    return draft


def loaded_names(model: str | Path | None, draft: str | Path | None) -> tuple[str, str | None]:
    """What :func:`dflash_mlx.load` loads for these arguments, named for the user: the target as
    given with the folder it resolves to, and the drafter's folder or id (None: no drafter).
    Says which files a run used (``--verbose``, the chat's bar) without loading anything."""
    names = look_up(name_pair(model, draft))
    given = DEFAULT_PAIR if model is None else str(model)
    target = given if str(names.target) == given else f"{given} ({names.target})"
    if names.draft is None:
        return target, None
    if is_embedded_pair(model) and draft in (None, AUTO_DRAFT):
        return target, f"{given}'s drafter ({names.draft})"
    return target, str(names.draft)
