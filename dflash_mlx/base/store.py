"""What dflash-mlx keeps in its per-user cache folder: small JSON stores, written atomically.

Plain Python at the bottom of the package: the kernels, the adaptive policy and the verify widths
each keep what they measured here.
"""

import json
from pathlib import Path

from .files import write_text_atomic


def default_cache_root() -> Path:
    """Where dflash-mlx keeps what it converts and measures: ``~/.cache/dflash-mlx``."""
    return Path.home() / ".cache" / "dflash-mlx"


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
