"""What a target's config must say before anything is built from it (or downloaded for it)."""

import json
from collections.abc import Callable, Iterable
from typing import Any

from ..base.errors import DFlashError
from ..models import gemma, hybrid, kimi
from ..models import target as tgt
from .folders import PairSource

# The families whose configs mlx-lm may read differently from transformers: checked before loading.
LAYOUT_CHECKS = {
    **{t: hybrid.check_layout for t in hybrid.HYBRID_MODEL_TYPES},
    **{t: gemma.check_layout for t in gemma.GEMMA_MODEL_TYPES},
    **{t: kimi.check_layout for t in kimi.KIMI_MODEL_TYPES},
}


def check_target(source: PairSource) -> PairSource:
    """``source`` once its target folder passed :func:`check_target_config` and the gpt-oss check."""
    check_target_config(source.target_config, str(source.target))
    check_gpt_oss_layout(source.target_config, source.target_weight_names, str(source.target))
    return source


def vet_hub_target(
    repo: str, known: Any, read_config: Callable[[], Any], weight_names: Callable[[], list[str]]
) -> dict[str, Any] | None:
    """Refuse a hub target of an unsupported type before downloading its weights (``hub.Vet``).

    The registry of known pairs (``known``, a ``registry.KnownPair`` or None) names the type of
    the official targets; any other hub id gets its ``config.json`` alone fetched first.

    Returns:
        The config as fetched, or None when it could not be had for a known target (or is no
        JSON object: the downloaded folder's own check then says what is wrong with it).

    Raises:
        DFlashError: If the target's ``model_type`` is not one DFlash can tap, it is a known
          pair's that DFlash cannot run yet (``KnownPair.needs``), its config is one mlx-lm cannot
          load (the family's check in ``LAYOUT_CHECKS``), or its ``config.json`` cannot be had
          (see ``hub.hub_file``).
    """
    if known is not None and known.needs is not None:
        raise DFlashError(
            f"{repo} pairs with the drafter {known.draft}, but DFlash cannot run it yet: {known.needs}. "
            "No weights were downloaded."
        )
    config = None
    # A known pair's target of a type DFlash cannot tap is refused without a request; for the
    # others the config is read too: a repo named like a known target (a quantized variant,
    # say) may hold a layout mlx-lm cannot load, which only its config shows.
    if known is None or known.model_type in tgt.SUPPORTED_MODEL_TYPES:
        try:
            config = read_config()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        except DFlashError:
            if known is None:
                raise
    if isinstance(config, dict):
        check_model_type(config.get("model_type"), repo, "its config.json")
        try:
            check_family_layout(config)
        except DFlashError as e:
            raise DFlashError(f"{repo}: {e} No weights were downloaded.") from e
        if known is None:
            check_gpt_oss_layout(config, weight_names() if config.get("model_type") == "gpt_oss" else (),
                                 f"{repo} (no weights were downloaded)")  # fmt: skip
        return config
    if known is not None:
        check_model_type(known.model_type, repo, "the registry of known pairs")
    return None


def check_target_config(config: dict[str, Any], where: str) -> None:
    """Refuse a target config DFlash cannot run: a family it cannot tap, a config mlx-lm would
    misread; ``where`` names the folder in the error. (A gpt-oss layout needs the weights' names
    too: :func:`check_gpt_oss_layout`.)"""
    if config.get("model_type") not in tgt.SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"Unsupported target architecture model_type={config.get('model_type')!r} in {where}: "
            f"DFlash supports {', '.join(tgt.SUPPORTED_MODEL_TYPES)} targets."
        )
    check_family_layout(config)


def check_model_type(model_type: str | None, repo: str, source: str) -> None:
    """Refuse a hub target whose type (read from ``source``) DFlash cannot tap, before its download."""
    if model_type not in tgt.SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"Unsupported target architecture model_type={model_type!r} for {repo} (from {source}): "
            f"DFlash supports {', '.join(tgt.SUPPORTED_MODEL_TYPES)} targets. No weights were downloaded."
        )


def check_family_layout(config: dict[str, Any]) -> None:
    """The family's own check of a config mlx-lm may read differently from transformers."""
    if (family_check := LAYOUT_CHECKS.get(config.get("model_type"))) is not None:
        family_check(config)


def check_gpt_oss_layout(config: dict[str, Any], weight_names: Iterable[str], where: str) -> None:
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
