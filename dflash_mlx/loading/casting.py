"""The dtype a loaded pair computes in: what is asked for, or what runs fastest where it fits."""

import logging
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..base.dtypes import DTYPES, dtype_name
from ..base.errors import DFlashError

# MLX's CPU backend runs float32 several times faster than bfloat16 or float16 (6x on the embedded
# pair), so there a pair computes in float32 when its float32 weights take at most this share of
# the memory at hand (what is available plus what the checkpoint's weights already take).
CPU_FLOAT32_MEMORY_SHARE = 0.5

log = logging.getLogger("dflash_mlx")


def cast_pair(
    target: nn.Module, draft: nn.Module | None, dtype: str | None, *, target_dtype: mx.Dtype | None = None
) -> None:
    """Cast a loaded pair to ``dtype``, or as :func:`cast_to_default` chooses when None
    (``target_dtype``, the dtype the target computes in, is then needed with a drafter)."""
    if dtype is None:
        cast_to_default(target, draft, target_dtype=target_dtype)
        return
    for model in (target, draft):
        if model is not None:
            cast(model, dtype)
            mx.eval(model.parameters())


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
    name = dtype_name(current) or str(current)
    budget = "unknown" if available is None else f"{(available + loaded) / 1e9:.1f} GB"
    hint = (
        f"Computing in {name}, the checkpoint's dtype: float32 weights "
        f"({as_float32 / 1e9:.1f} GB) would take over half the memory at hand ({budget}). On MLX's CPU "
        "backend float32 runs several times faster; pass --dtype float32 (dtype='float32') if it fits."
    )
    return None, hint


def cast_to_default(target: nn.Module, draft: nn.Module | None = None, *, target_dtype: mx.Dtype | None = None) -> None:
    """Cast a pair loaded without a dtype as :func:`default_dtype` chooses (the drafter's weights
    counted in the memory): the target to its choice, the drafter to it or else to the target's
    compute dtype (``target_dtype``, see ``models.target.compute_dtype``); when a CPU run keeps
    a slower dtype, its hint goes to the log."""
    dtype, hint = default_dtype(target, draft)
    if dtype is not None:
        cast(target, dtype)
        mx.eval(target.parameters())
    elif hint:
        log.warning(hint)
    if draft is not None and (draft_dtype := dtype or dtype_name(target_dtype)):
        cast(draft, draft_dtype)
        mx.eval(draft.parameters())
