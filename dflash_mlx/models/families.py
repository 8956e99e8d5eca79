"""One row per target family for what the loop and the tuning need to know of a target: how its caches are
made, and whether its state goes back over the last pass only. Adding a family is a module in this folder and
one row here; the code above ``models/`` asks :func:`family`, never a ``model_type``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from . import gemma, hybrid, target
from .sliding import SlidingKVCache
from .stages import Stage, own_split, stage_caches


def _mlx_lm_cache(model: nn.Module, kernels: str) -> list[Any]:
    # mlx-lm's own caches, except that a rotating window (which cannot drop a rejected draft once it has
    # wrapped around) becomes a sliding cache of the same window.
    if own_split(model.model):
        # mlx-lm's make_cache would walk the layers this stage dropped: its own layers' alone, by kind.
        stage = Stage(model.model, target.num_layers(model))
        return stage_caches(target.layer_kinds(model), target.sliding_window(model), stage)
    caches = make_prompt_cache(model)
    return [SlidingKVCache(c.max_size) if type(c) is RotatingKVCache and c.keep == 0 else c for c in caches]


@dataclass(frozen=True)
class Family:
    """What differs by target family above ``models/``.

    Args:
        make_cache: ``(model, kernels) -> per-layer caches`` that roll back after a rejected draft;
          ``kernels`` is the Metal kernels' mode of the layers whose passes run one (a recurrent layer's).
        recurrent: Its state goes back over the last pass only: no plain step may run ahead of the host,
          and no pass may be timed on the live cache and trimmed off (``block_size="auto"``,
          ``tree_budget="auto"``, plain decoding's speed after a run).
    """

    make_cache: Callable[[nn.Module, str], list[Any]] = _mlx_lm_cache
    recurrent: bool = False


_HYBRID = Family(hybrid.make_cache, recurrent=True)
_GEMMA = Family(lambda model, kernels: gemma.make_cache(model))
FAMILIES = {
    **{model_type: _HYBRID for model_type in hybrid.HYBRID_MODEL_TYPES},
    **{model_type: _GEMMA for model_type in gemma.GEMMA_MODEL_TYPES},
}


def family(model: nn.Module) -> Family:
    """The row of ``model``'s family (mlx-lm's caches and full rollback unless a row says otherwise)."""
    return FAMILIES.get(getattr(model, "model_type", None), Family())


def make_target_cache(model: nn.Module, kernels: str = "auto") -> list[Any]:
    """The target's per-layer caches, each one that can be rolled back after a rejected draft: mlx-lm's own,
    a recurrent layer's :class:`~dflash_mlx.models.hybrid.RecurrentCache`, a sliding-window layer's
    :class:`~dflash_mlx.models.sliding.SlidingKVCache`."""
    return family(model).make_cache(model, kernels)
