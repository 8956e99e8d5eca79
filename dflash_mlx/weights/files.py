"""Files and folders a user owns are built next to their destination and moved into place in one rename."""

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
