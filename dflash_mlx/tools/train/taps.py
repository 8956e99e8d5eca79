"""The frozen target's per-example taps for drafter training, computed once.

A training step needs, for each example it samples, the target's taps (the drafter's
context) and, for the distillation term, the target's last hidden state (what its LM head
turns into logits). The target is the costly part of a step, and its outputs never
change, so each example's are kept: in memory, or with a folder on disk in bfloat16
(``<key>.safetensors``), written the first time the example is drawn, where they outlive
the run. A long run reads an example's taps back when it draws it again, and a resumed or
later run on the same data and target starts from what earlier runs wrote, so one schedule
resumed time after time runs the target less and less. The folder is held under a
size limit (a large response cache's taps run to tens of GB: ~7 kB a token for SmolLM2's
5 taps); past it, examples not on disk are computed each time they are drawn.
``meta.json`` names what the files were made from; a folder made for another target, other
taps or another cut is refused.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...base.errors import DFlashError
from ...base.files import write_text_atomic
from ...models import target as tgt

_FORMAT = 1


class TapStore:
    """Each example's ``taps (1, L, n_taps * H)`` and last hidden state ``(1, L, H)``.

    Args:
        target: The frozen target.
        tap_ids: The drafter's tapped layers.
        max_seq_len: Sequences are cut to this many tokens before the target sees them.
        folder: Where to keep them across runs (None: memory only).
        identity: What identifies the target (its path and config), written to and checked
          against ``meta.json``.
        keep: Without a folder, keep what was computed in memory (False: recompute every
          time). With a folder nothing is kept in memory: the files are read back (the
          operating system caches them), so a large cache costs disk, not RAM.
        max_bytes: The folder's size limit; examples past it are not written.
    """

    def __init__(
        self,
        target: nn.Module,
        tap_ids: list[int],
        max_seq_len: int,
        folder: str | Path | None = None,
        identity: dict | None = None,
        keep: bool = True,
        max_bytes: int | None = None,
    ):
        self.target, self.tap_ids, self.max_seq_len, self.keep = target, list(tap_ids), max_seq_len, keep
        self.n_layers, self.hidden = tgt.num_layers(target), tgt.hidden_size(target)
        self.memory: dict[str, tuple[mx.array, mx.array]] = {}
        self.folder = None if folder is None else Path(folder)
        self.max_bytes, self.bytes = max_bytes, 0
        # How each get() was served, for the training log: from the folder, or by the target.
        self.read = self.computed = 0
        if self.folder is not None:
            self._open(identity or {})
            self.bytes = sum(p.stat().st_size for p in self.folder.glob("*.safetensors"))

    def _open(self, identity: dict) -> None:
        meta = {"format": _FORMAT, "tap_ids": self.tap_ids, "max_seq_len": self.max_seq_len, "target": identity}
        file = self.folder / "meta.json"
        if self.folder.exists() and not self.folder.is_dir():
            raise DFlashError(f"--tap-cache {self.folder} is a file; pass a folder for the taps.")
        if file.exists():
            try:
                saved = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                raise DFlashError(
                    f"--tap-cache {self.folder}: unreadable meta.json ({e}); pass another folder."
                ) from None
            if saved != meta:
                what = next(k for k in meta if saved.get(k) != meta[k])
                raise DFlashError(
                    f"--tap-cache {self.folder} holds features made with another {what.replace('_', ' ')}; "
                    "pass a new folder (or delete this one)."
                )
        elif self.folder.exists() and any(self.folder.iterdir()):
            raise DFlashError(
                f"--tap-cache {self.folder} is a folder of other files; pass a new or empty folder for the taps."
            )
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Whole or absent: a torn meta.json would make the folder unusable ("unreadable") next run.
            write_text_atomic(file, json.dumps(meta, indent=1))

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def _compute(self, example: dict) -> tuple[mx.array, mx.array]:
        ids = (example["prompt_ids"] + example["response_ids"])[: self.max_seq_len]
        # The last layer's entry is the normed last hidden state (the LM head's input).
        wanted = self.tap_ids + [self.n_layers - 1]
        _, both = tgt.forward_with_taps(self.target, mx.array([ids]), [None] * self.n_layers, wanted)
        taps, last = both[..., : -self.hidden], both[..., -self.hidden :]
        return mx.stop_gradient(taps), mx.stop_gradient(last)

    def get(self, example: dict) -> tuple[mx.array, mx.array]:
        """``(taps, last_hidden)`` of one example, in the target's compute dtype."""
        key = example["key"]
        if key in self.memory:
            taps, last = self.memory[key]
        elif self.folder is not None and self._path(key).exists():
            arrays = mx.load(str(self._path(key)))
            taps, last = arrays["taps"], arrays["last"]
            self.read += 1
        else:
            taps, last = self._compute(example)
            self.computed += 1
            if self.folder is not None:
                # The same bfloat16 values whether this run computed them or a later one reads them.
                taps, last = taps.astype(mx.bfloat16), last.astype(mx.bfloat16)
                mx.eval(taps, last)
                if self.max_bytes is None or self.bytes < self.max_bytes:
                    self._write(key, taps, last)
            elif self.keep:
                self.memory[key] = (taps, last)
        dtype = tgt.compute_dtype(self.target)
        return taps.astype(dtype), last.astype(dtype)

    def _write(self, key: str, taps: mx.array, last: mx.array) -> None:
        # Whole or absent: a run stopped mid-write leaves a hidden temporary file, not a torn one.
        tmp = self.folder / f".{key}.tmp.safetensors"
        mx.save_safetensors(str(tmp), {"taps": taps, "last": last})
        os.replace(tmp, self._path(key))
        self.bytes += self._path(key).stat().st_size

    def served(self) -> str:
        """Where the taps came from so far, e.g. ``taps 40% from disk``, for a progress line."""
        total = self.read + self.computed
        return f"taps {100 * self.read / total:.0f}% from disk" if self.folder is not None and total else ""
