"""DFlash drafter checkpoints to MLX: cast, map the keys, normalize the config, quantize, write.

Targets are converted by mlx-lm itself; only the drafter, which mlx-lm does not know, is
handled here. The drafter is read with the library's own ``load_draft`` (which applies
``DraftModel.sanitize``, so the published z-lab key names map to ours) and written back as
``config.json`` + ``model*.safetensors`` by the library's one writer of that layout
(``dflash_mlx.models.drafter.save_draft``).
"""

from typing import Any

import mlx.nn as nn

from ..base.errors import DFlashError
from ..models.drafter import DraftModel

# Affine quantization as mlx supports it; the drafter is small, so only 8 and 4 bits.
DRAFT_Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
# Fields that may sit under "dflash_config" (z-lab layout) or at the top level.
_DFLASH_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers")


def quantize_draft(draft: DraftModel, bits: int, group_size: int = 64) -> dict[str, int]:
    """Quantize the drafter's linear layers in place with ``nn.quantize``.

    Layers whose input size is not a multiple of ``group_size`` stay in floating point;
    the loader tells them apart by the ``scales`` each quantized layer carries.

    Args:
        draft: The drafter to quantize.
        bits: 8 or 4.
        group_size: 32, 64 or 128.

    Returns:
        The ``quantization`` entry for the drafter's config.

    Raises:
        DFlashError: On unsupported bits or group size.
    """
    if bits not in DRAFT_Q_BITS:
        raise DFlashError(
            f"Unsupported drafter quantization bits={bits!r}; use one of "
            f"{', '.join(map(str, DRAFT_Q_BITS))} (--draft-q-bits), or leave it unset for no quantization."
        )
    if group_size not in Q_GROUP_SIZES:
        raise DFlashError(
            f"Unsupported drafter quantization group size {group_size!r}; use one of "
            f"{', '.join(map(str, Q_GROUP_SIZES))} (--draft-q-group-size)."
        )

    def predicate(path: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size == 0

    nn.quantize(draft, group_size=group_size, bits=bits, class_predicate=predicate)
    return {"group_size": group_size, "bits": bits}


def normalized_config(
    config: dict[str, Any],
    draft: DraftModel,
    *,
    dtype: str | None = None,
    quantization: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The drafter's config in one layout, keeping every original field.

    The DFlash fields are written both at the top level and under ``dflash_config`` (the
    z-lab layout), with the values the loaded drafter actually uses: a mask token taken
    from the tokenizer or tap layers derived from ``num_target_layers`` become explicit.
    Other loaders of either layout keep reading the file.

    Args:
        config: The source ``config.json`` as read.
        draft: The loaded drafter (its mask token filled from the tokenizer where the config has none).
        dtype: The dtype the weights are stored in.
        quantization: The ``quantization`` entry, if the drafter was quantized.

    Returns:
        The config to write.
    """
    a = draft.args
    out = dict(config)
    fields = {
        "block_size": a.block_size,
        "target_layer_ids": list(a.target_layer_ids),
        "mask_token_id": a.mask_token_id,
        "num_target_layers": a.num_target_layers,
    }
    out.update(fields)
    out["dflash_config"] = {**(config.get("dflash_config") or {}), **fields}
    # Explicit values the drafter was built with, so no loader has to guess defaults.
    out["head_dim"] = a.head_dim
    if "rope_theta" not in out:
        out["rope_theta"] = a.rope_theta
    if dtype is not None:
        out["torch_dtype"] = dtype
        if "dtype" in out:
            out["dtype"] = dtype
    out.pop("quantization", None)
    out.pop("quantization_config", None)
    if quantization is not None:
        # mlx-lm writes both names; keep the same convention.
        out["quantization"] = dict(quantization)
        out["quantization_config"] = dict(quantization)
    return out
