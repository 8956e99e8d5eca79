"""Files and folders a user owns are built next to their destination and moved into place in one rename."""

import json
import os
import shutil
import uuid
from pathlib import Path


def partial_sibling(dest: Path) -> Path:
    """Create and return a hidden, empty folder next to ``dest`` to build it in."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would stick to the renamed folder.
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.partial"
    tmp.mkdir()
    return tmp


def install(tmp: Path, dest: Path) -> None:
    """Move the finished ``tmp`` to ``dest``; an old ``dest`` is removed only after that succeeds."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if old is not None:
            os.replace(old, dest)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


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
            from .gguf import default_cache_root

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
