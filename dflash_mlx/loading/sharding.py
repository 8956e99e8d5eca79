"""A target split over the ranks of ``mlx.distributed``, by mlx-lm's own sharding.

Under ``mlx.launch`` every rank loads the same pair: the target lazily, then split by mlx-lm's
``model.shard(group)`` (tensor parallel: each rank a slice of every layer) or
``model.model.pipeline(group)`` (pipeline parallel: each rank a run of layers, rank 0 the last
ones; for the families mlx-lm does not pipeline, the same layout by
:func:`dflash_mlx.models.stages.split_decoder`), and only then read, so that a rank reads only the weights it keeps. The drafter is
whole on every rank. How generation then runs on all of them: :mod:`dflash_mlx.loop.distributed`.

From the hub, a pipeline rank downloads only the files of a sharded checkpoint that hold its
layers, and those that hold no layer (:func:`rank_files`), as mlx-lm's ``sharded_load`` does;
under tensor parallelism every rank keeps a slice of every layer, so it downloads them all.
"""

import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.pipeline import PipelineMixin

from ..base.errors import DFlashError
from ..models import gemma, stages
from ..models import target as tgt
from .watch import end_load_watch

PARALLEL = ("tensor", "pipeline")
# A checkpoint tensor's layer number, matched as mlx-lm's sharded_load does (sanitize may rename the rest).
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The families whose taps we walk, each pipelined by mlx-lm (PipelineMixin) or split by
# stages.split_decoder into the same layout.
PIPELINE_MODEL_TYPES = tgt.SUPPORTED_MODEL_TYPES
_ALONE = (
    "parallel={parallel!r} splits the target over several ranks, but this process is alone. "
    "Start it with mlx.launch (e.g. mlx.launch -n 2 -- dflash-generate ...)."
)


def world_size() -> int:
    """The ranks this process was started among (1 outside ``mlx.launch``)."""
    return mx.distributed.init().size()


def check_sharding_options(parallel: str | None, pipeline_split: list[int] | None) -> None:
    """Refuse a bad ``parallel`` or ``pipeline_split`` before anything is read."""
    if parallel is not None and parallel not in PARALLEL:
        raise DFlashError(f"parallel must be one of {', '.join(PARALLEL)} or None (got {parallel!r}).")
    if pipeline_split is not None and parallel != "pipeline":
        raise DFlashError("pipeline_split splits a pipeline: pass it with parallel='pipeline' (--pipeline).")
    if parallel is not None and world_size() == 1:
        raise DFlashError(_ALONE.format(parallel=parallel))
    if pipeline_split is not None and len(pipeline_split) != world_size():
        raise DFlashError(
            f"pipeline_split {list(pipeline_split)} has {len(pipeline_split)} entries for {world_size()} ranks: "
            "give one number of layers per rank, rank 0's first (rank 0 runs the last layers)."
        )


def shard_target(model: nn.Module, parallel: str | None, pipeline_split: list[int] | None = None) -> str | None:
    """Split ``model`` (loaded lazily) over the world group; returns how, or None when alone.

    ``parallel`` None picks tensor parallelism where mlx-lm has it for the family, else the
    pipeline. The weights a rank keeps are read by :func:`read_shards`.

    Raises:
        DFlashError: If ``parallel`` is given on one rank, or the family cannot be split that way.
    """
    group = mx.distributed.init()
    if group.size() == 1:
        if parallel is not None:
            raise DFlashError(_ALONE.format(parallel=parallel))
        return None
    parallel = _choose(model, parallel)
    try:
        if parallel == "tensor":
            model.shard(group)
        else:
            pipeline(model, group, pipeline_split)
    except (AssertionError, ValueError) as e:
        raise DFlashError(f"Could not split the {model.model_type} target over {group.size()} ranks ({e}).") from e
    return parallel


def read_shards(model: nn.Module) -> None:
    """Read the weights this rank keeps of a split ``model``, then wait for the other ranks."""
    group = mx.distributed.init()
    try:
        mx.eval(model.parameters())
        # Every rank has its weights before any of them starts (as mlx-lm's sharded_load).
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    except RuntimeError:
        end_load_watch(done=False)  # a rank that left the load is named, if it is gone
        raise


def kept_layers(model: nn.Module) -> range | None:
    """The layers a pipeline rank runs, or None when it holds a part of every layer (or all of them)."""
    inner = getattr(tgt._text(model), "model", None)
    if getattr(inner, "pipeline_size", 1) == 1:
        return None
    return range(inner.start_idx, inner.end_idx)


def rank_files(model: nn.Module, weight_map: dict[str, str], parallel: str | None,
               pipeline_split: list[int] | None) -> set[str]:  # fmt: skip
    """The files of a sharded checkpoint that this rank reads: under a pipeline those that hold a
    tensor of its layers or of no layer (every stage keeps the embeddings, the final norm and the
    head), else all of them.

    Args:
        model: The target built without its weights; it is split here, so it is then thrown away.
        weight_map: The checkpoint index's tensor name -> file name.
    """
    if world_size() == 1 or _choose(model, parallel) != "pipeline":
        return set(weight_map.values())
    try:
        pipeline(model, mx.distributed.init(), pipeline_split)
    except ValueError as e:
        raise DFlashError(f"Could not split the {model.model_type} target over {world_size()} ranks ({e}).") from e
    return layer_files(weight_map, kept_layers(model))


def pipeline(model: nn.Module, group: mx.distributed.Group, split: list[int] | None = None) -> None:
    """Split ``model``'s decoder over ``group`` as a pipeline: by mlx-lm's own ``pipeline`` where the
    family has one, else into the same layout (:func:`dflash_mlx.models.stages.split_decoder`).

    Raises:
        ValueError: On a ``split`` that does not fit the layers; DFlashError: on one that parts a
          Gemma 4 layer from the layer whose keys and values it reuses.
    """
    inner = tgt.decoder(model)
    if isinstance(inner, PipelineMixin):
        inner.pipeline(group, split=split)
        return
    if model.model_type in gemma.GEMMA_MODEL_TYPES:
        split = gemma.pipeline_split(model, group.size(), split)
    stages.split_decoder(inner, group, split)


def layer_files(weight_map: dict[str, str], layers: range | None) -> set[str]:
    """The files that hold a tensor of ``layers`` (None: every layer) or of no layer."""
    files = set()
    for name, file in weight_map.items():
        m = _LAYER.search(name)
        if layers is None or m is None or int(m.group(1)) in layers:
            files.add(file)
    return files


def _choose(model: nn.Module, parallel: str | None) -> str:
    # None picks tensor parallelism where mlx-lm has it for the family, else the pipeline.
    model_type = model.model_type
    can_tensor = hasattr(model, "shard")
    can_pipeline = model_type in PIPELINE_MODEL_TYPES
    parallel = parallel or ("tensor" if can_tensor else "pipeline" if can_pipeline else None)
    if parallel is None or (parallel == "tensor" and not can_tensor):
        raise DFlashError(
            f"mlx-lm cannot split a {model_type} target over ranks by tensor parallelism"
            + (": pass --pipeline." if can_pipeline else ", nor can DFlash as a pipeline. Run it on one machine.")
        )
    if parallel == "pipeline" and not can_pipeline:
        raise DFlashError(
            f"A {model_type} target cannot run as a pipeline here (the families that can: "
            f"{', '.join(PIPELINE_MODEL_TYPES)}). Pass --tensor-parallel, or run it on one machine."
        )
    return parallel
