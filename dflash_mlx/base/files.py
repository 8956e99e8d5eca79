"""Files a user owns or hands a tool: written next to their destination and moved into place in one rename,
and JSONL read with each bad line named."""

import json
import os
import shutil
import uuid
from pathlib import Path

from .errors import DFlashError


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


def read_objects(path: Path, flag: str, what: str) -> list[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line of a JSONL file ``path``.

    Raises:
        DFlashError: For a missing file (naming ``flag``, which passes another), a line that is
          not JSON or not an object, or a file with no lines (``what`` names its contents).
    """
    if not path.is_file():
        raise DFlashError(f"No {what} file at {path}; pass a JSONL file with {flag}.")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be one JSON object.") from None
        if not isinstance(row, dict):
            raise DFlashError(f"{path}:{n} is not a JSON object; each line must be one.")
        rows.append((n, row))
    if not rows:
        raise DFlashError(f"{path} holds no {what}.")
    return rows
