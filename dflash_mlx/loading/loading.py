"""Load a target + DFlash drafter pair from local folders or the Hugging Face hub.

One path, each step in its own module, each run once: the arguments named (``pairs``), the
registry consulted (``registry``), hub ids downloaded after their config is vetted (``hub``),
each config and the drafter's weights read (``folders``), the target checked (``target_checks``),
the target built by mlx-lm (``target_loader``), its shape read (``models.target``), the drafter
built and checked against it (``draft_loader``), both cast (``casting``), the verify kernels
chosen (``models.quantized``). Nothing shipped inside a checkpoint is ever executed (``auto_map``
/ remote code is ignored).
"""

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..models.drafter import DraftModel
from ..models.quantized import use_verify_qmm
from ..models.target import target_shape
from .casting import cast_pair
from .draft_loader import build_draft
from .folders import read_pair
from .hub import fetch_pair
from .options import check_load_options
from .pairs import name_pair
from .registry import look_up
from .sharding import check_sharding_options, world_size
from .target_checks import check_target, vet_hub_target
from .target_loader import build_target, select_files
from .watch import watch_load


def load(
    model: str | Path | None = None,
    draft: str | Path | None = None,
    *,
    dtype: str | None = None,
    revision: str | None = None,
    kernels: str = "auto",
    parallel: str | None = None,
    pipeline_split: list[int] | None = None,
) -> tuple[nn.Module, DraftModel | None, TokenizerWrapper]:
    """Load a target, its DFlash drafter and the tokenizer.

    Args:
        model: Target folder or Hugging Face id, a pair folder written by
          ``dflash-convert`` (its ``dflash_pair.json`` names the target and the drafter), or
          the name of an embedded pair (``pairs.EMBEDDED_PAIRS``). None loads the default pair,
          SmolLM2-135M-Instruct and its drafter (see :func:`dflash_mlx.loading.pairs.embedded_pair`).
        draft: Drafter folder or Hugging Face id (a pair folder gives its drafter).
          ``"auto"`` takes the pair folder's drafter, or else the official drafter of a
          known target (see ``dflash_mlx.loading.registry``). None takes the pair
          folder's drafter, and means plain decoding for any other target.
        dtype: Cast both models to ``"float32"``, ``"bfloat16"`` or ``"float16"``. By default
          ``casting.default_dtype`` decides: float32 on MLX's CPU backend when it fits in half the
          memory at hand (else the checkpoint's dtype, with a one-line hint logged to the
          ``dflash_mlx`` logger), the checkpoint's on a GPU; the drafter takes the target's.
        revision: Hub revision for both, if they come from the hub.
        kernels: The Metal kernels of a quantized target's verify passes
          (:mod:`dflash_mlx.models.quantized`): on a Metal device, unless ``"off"``, its
          affine-quantized linear layers run their 2..16-row matmuls through ``verify_qmm``,
          where it checked itself faster (``"auto"``, default) or wherever it can run
          (``"on"``). Elsewhere the target is mlx-lm's, unchanged; ``"on"`` there is an error.
        parallel: Under ``mlx.launch`` with several ranks, how the target is split over them
          (:mod:`dflash_mlx.loading.sharding`): ``"tensor"`` (mlx-lm's ``model.shard``) or
          ``"pipeline"`` (rank 0 runs the last layers: ``model.model.pipeline`` where mlx-lm has it, else
          :func:`dflash_mlx.models.stages.split_decoder`, in the same layout). None (default):
          tensor parallel where mlx-lm has it for the family, else the pipeline; on one rank, whole.
          The drafter is whole on every rank.
        pipeline_split: Layers per rank for the pipeline, rank 0's first (default: even).

    Returns:
        ``(model, draft, tokenizer)``; ``draft`` is None when none was given. ``draft.folder`` is the
        folder it was read from, by which :func:`dflash_mlx.stream_generate`'s default datastore knows
        the default pair's drafter (:func:`dflash_mlx.drafts.datastore.pair_datastore`).

    Raises:
        DFlashError: On missing or corrupt files, a non-DFlash drafter, an unsupported
          target, a drafter made for another target, ``draft="auto"`` for a target
          with no known drafter, or a bad ``kernels`` (``"on"`` without a Metal device).
    """
    check_load_options(dtype=dtype, kernels=kernels)
    check_sharding_options(parallel, pipeline_split)
    if world_size() > 1:
        # From here on a rank that dies (or fails: a file it lacks) ends the others, which would otherwise
        # wait for it for good in the load's last collective.
        watch_load(mx.distributed.init())
    names = look_up(name_pair(model, draft))
    # Several ranks: a hub target's files downloaded as each rank's shard needs them.
    select = partial(select_files, parallel=parallel, pipeline_split=pipeline_split) if world_size() > 1 else None
    source = check_target(read_pair(fetch_pair(names, revision=revision, vet=vet_hub_target, select=select)))
    target, tokenizer = build_target(source, parallel=parallel, pipeline_split=pipeline_split)
    shape = target_shape(target)
    drafter = None
    if source.draft is not None:
        drafter = build_draft(source.draft, source.draft_config, source.draft_weights, shape, tokenizer)
    cast_pair(target, drafter, dtype, target_dtype=shape.compute_dtype)
    use_verify_qmm(target, kernels)  # as nn.quantize swaps layers; a no-op off Metal
    return target, drafter, tokenizer
