"""What dflash-mlx keeps in its per-user cache folder: small JSON stores, written atomically.

Plain Python at the bottom of the package: the kernels, the adaptive policy and the verify widths
each keep what they measured here.
"""

import json
import os
import uuid
from pathlib import Path


def default_cache_root() -> Path:
    """Where dflash-mlx keeps what it converts and measures: ``~/.cache/dflash-mlx``."""
    return Path.home() / ".cache" / "dflash-mlx"


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a hidden sibling renamed into place: an interrupted or
    concurrent write never leaves half a file. Errors propagate; the sibling is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class JsonStore:
    """One JSON object kept in a file (by default ``name`` in dflash-mlx's cache folder), read and
    written whole. Missing or unreadable reads as empty; a write that fails (a read-only home) is
    dropped: what it held is measured again next time."""

    def __init__(self, name: str, path: str | Path | None = None):
        if path is None:
            path = default_cache_root() / name
        self.path = Path(path)

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write(self, key: str, value) -> None:
        data = self.read()
        data[key] = value
        try:
            write_text_atomic(self.path, json.dumps(data, indent=1))
        except OSError:
            pass
