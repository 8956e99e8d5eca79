"""Checkpoints of drafter training: written whole or not at all, resumed only as they were made.

A checkpoint is one folder, ``OUT/training_state/step-N/``: the drafter (``draft/``), the
optimizer state, the step and the data RNG. It is written under a temporary name and renamed
into place, so resuming never pairs weights and optimizer state of different steps. The
drafter at the top of ``OUT`` (what ``dflash_mlx.load(target, OUT)`` reads) is a hard link to
the newest checkpoint's, swapped in with one rename: it loads at any moment of a run.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import uuid
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ...base.errors import DFlashError
from ...loading.folders import read_config
from ...models.drafter import save_draft

STATE_DIR = "training_state"
RESPONSE_CACHE = "data.jsonl"  # the default --cache, inside --out


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl+C during training, after the checkpoint of ``step`` was saved in ``out``."""

    def __init__(self, step: int, out: Path):
        super().__init__(f"interrupted at step {step}; saved to {out}")
        self.step, self.out = step, out


def latest_checkpoint(out: Path) -> tuple[Path, Path] | None:
    """``(state folder, drafter folder)`` of the newest checkpoint in ``out``, or None."""
    steps = [p for p in (out / STATE_DIR).glob("step-*") if (p / "state.json").is_file()]
    if steps:
        newest = max(steps, key=lambda p: int(p.name.partition("-")[2]))
        return newest, newest / "draft"
    if (out / STATE_DIR / "state.json").is_file():
        # Written before each checkpoint had a folder of its own: the drafter is OUT's.
        return out / STATE_DIR, out
    return None


EXTRA_FILE = "training_arrays.safetensors"
LOSS_VOCAB = "loss_vocab"  # the --loss-vocab token ids, among the extra arrays


def save_checkpoint(
    out, draft, config, optimizer, step, rng, args, target: dict | None = None, extra: dict | None = None
) -> None:
    """The drafter plus what resuming needs: optimizer state, step and the data RNG.

    MLX's RNG only draws the initial weights, which the checkpoint holds; every later
    random choice (examples, anchors) comes from the saved numpy generator. The checkpoint
    is complete in a temporary folder before one rename makes it ``training_state/step-N``;
    then the drafter at the top of ``out`` is swapped for its own, and older checkpoints go.
    ``extra`` arrays (the training-time form of weights the drafter holds folded, the loss's
    token subset) are kept with it, for :func:`load_extra`.
    """
    states = out / STATE_DIR
    final = states / f"step-{step:08d}"
    if not (final / "state.json").is_file():
        tmp = states / f".step-{step:08d}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir(parents=True)
        try:
            save_draft(draft, config, tmp / "draft")
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
            if extra:
                mx.save_safetensors(str(tmp / EXTRA_FILE), extra)
            state = {"step": step, "numpy_rng": rng.bit_generator.state, "args": dataclasses.asdict(args)}
            (tmp / "state.json").write_text(json.dumps({**state, "target": target}))
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    for name in ("config.json", "model.safetensors"):
        _link_into_place(final / "draft" / name, out / name)
    for old in states.iterdir():
        if old != final and (old.name.startswith("step-") or old.name.endswith(".tmp")):
            shutil.rmtree(old, ignore_errors=True)
    # A checkpoint of the earlier layout (state files straight in training_state/).
    for name in ("optimizer.safetensors", "state.json"):
        (states / name).unlink(missing_ok=True)


def _link_into_place(src: Path, dest: Path) -> None:
    # A hard link costs no second copy of the weights; the rename swaps it in whole.
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # a file system without hard links
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def load_state(state_dir: Path, optimizer) -> tuple[int, dict]:
    """Fill ``optimizer`` from a checkpoint; returns its step and the numpy RNG state."""
    arrays = mx.load(str(state_dir / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(arrays.items()))
    state = json.loads((state_dir / "state.json").read_text())
    return state["step"], state["numpy_rng"]


def load_extra(state_dir: Path) -> dict:
    """The ``extra`` arrays a checkpoint was saved with (empty if none)."""
    file = state_dir / EXTRA_FILE
    return mx.load(str(file)) if file.is_file() else {}


def check_out(out: Path, resume: bool, data_only: bool = False) -> tuple[Path, Path] | None:
    """The checkpoint to resume from, or None for a new run; refuses an ``out`` it would spoil.

    Raises:
        DFlashError: If ``out`` is a file; with ``resume``, if it holds no checkpoint; without,
          if it holds other files than the response cache.
    """
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out} is a file; pass a folder for the drafter.")
    if data_only:
        return None  # the data step only adds to the response cache
    checkpoint = latest_checkpoint(out)
    if resume and checkpoint is None:
        raise DFlashError(
            f"--resume: there is no saved training state in {out} (no {STATE_DIR}/ checkpoint). "
            "Drop --resume to start a new run, or pass the --out of the run to continue."
        )
    if resume or not out.is_dir():
        return checkpoint
    # The response cache of an earlier --data-only run is what a new run starts from.
    used = sorted(p.name for p in out.iterdir() if p.name != RESPONSE_CACHE and not p.name.startswith("."))
    if used:
        files = f"{', '.join(used[:3])}{', ...' if len(used) > 3 else ''}"
        if checkpoint is None:  # not a run dflash-train can continue: --resume would be refused
            raise DFlashError(
                f"--out {out} already holds files ({files}) and no saved training state. Pass a new folder "
                "with --out (with --init-draft FOLDER to start from a drafter's weights)."
            )
        raise DFlashError(
            f"--out {out} already holds files ({files}). Pass --resume to continue its training, or a new "
            "folder with --out."
        )
    return None


# The settings a resumed run may change (dflash-train's documented way to move the schedule's end
# is --resume with a new --iters), but then it no longer repeats an uninterrupted run.
RUN_SETTINGS = (
    "iters",
    "learning_rate",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "grad_clip",
    "batch_size",
    "blocks_per_seq",
    "max_seq_len",
    "loss_decay",
    "loss_positions",
    "logit_mse",
    "seed",
)


def resumed_settings(saved: dict, args: dict) -> tuple[str, list[str]]:
    """The run settings a resume goes on with, and those changed from the checkpoint's, as flags."""

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    # A setting left at None (e.g. --loss-positions: every position) is left out.
    now = ", ".join(f"{flag(k)} {args[k]}" for k in RUN_SETTINGS if args.get(k) is not None)
    changed = [f"{flag(k)} {args[k]} (was {saved[k]})" for k in RUN_SETTINGS if k in saved and k in args
               and saved[k] != args[k]]  # fmt: skip
    return now, changed


def target_record(path: Path) -> dict:
    """What a checkpoint keeps of its target, for :func:`check_resume`."""
    return {"path": str(path.resolve()), "config": read_config(path, "target")}


def drafter_mismatch(saved: dict, fresh: dict) -> tuple[str, str] | None:
    """The first drafter setting (as flags: saved, asked for) in which two drafter configs differ."""

    def flags(name: str, value) -> str:
        if name == "--target-layer-ids":
            return f"{name} {' '.join(map(str, value))}"
        if name == "--target-features":
            return "--target-features" if value else "--no-target-features"
        return f"{name} {value}"

    def dflash(config: dict, key: str, default=None):
        return config.get("dflash_config", {}).get(key, config.get(key, default))

    settings = [
        ("--num-layers", saved.get("num_hidden_layers"), fresh["num_hidden_layers"]),
        ("--block-size", saved.get("block_size"), fresh["block_size"]),
        ("--target-layer-ids", dflash(saved, "target_layer_ids"), dflash(fresh, "target_layer_ids")),
        ("--intermediate-size", saved.get("intermediate_size"), fresh["intermediate_size"]),
        ("--mask-token-id", dflash(saved, "mask_token_id"), dflash(fresh, "mask_token_id")),
        ("--target-features", dflash(saved, "use_target_features", True), dflash(fresh, "use_target_features", True)),
    ]
    for name, old, new in settings:
        if old is not None and old != new:
            return flags(name, old), flags(name, new)
    return None


# Run settings a resume must keep: the loss's token subset is the checkpoint's own.
FIXED_SETTINGS = {"loss_vocab": None, "draft_vocab": False}


def _fixed_flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"no {flag}" if value is None else f"{flag} {value}"


def check_resume(
    out: Path, saved: dict, fresh: dict, saved_target: dict | None, target: dict,
    saved_args: dict, args: dict,
) -> None:  # fmt: skip
    """Refuse to resume with drafter settings, ``FIXED_SETTINGS`` or a target other than the checkpoint's."""
    new_run = "to resume it, or start a new run with another --out"
    if (mismatch := drafter_mismatch(saved, fresh)) is not None:
        old, new = mismatch
        raise DFlashError(
            f"The checkpoint in {out} was trained with {old}, but this run asks for {new}. Pass {old} {new_run}."
        )
    for name, default in FIXED_SETTINGS.items():
        old, new = saved_args.get(name, default), args.get(name, default)
        if old != new:
            raise DFlashError(
                f"The checkpoint in {out} was trained with {_fixed_flag(name, old)}, but this run asks for "
                f"{_fixed_flag(name, new)}. Resume it with {_fixed_flag(name, old)}, or start a new run with "
                "another --out."
            )
    if saved_target is None:
        return
    # A target folder moved since (another machine) is the same target if its config is.
    moved = not Path(saved_target["path"]).exists() and saved_target["config"] == target["config"]
    if saved_target["path"] != target["path"] and not moved:
        raise DFlashError(
            f"The checkpoint in {out} was trained on the target {saved_target['path']}, but this run gives "
            f"{target['path']}. Pass --model {saved_target['path']} {new_run}."
        )


@contextlib.contextmanager
def interrupt_after_step():
    """The first Ctrl+C sets the flag the loop checks after each step; a second stops at once."""
    flag = []
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag:
            raise KeyboardInterrupt
        flag.append(signum)
        print("\ninterrupted: saving after this step (Ctrl+C again to stop without saving)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
