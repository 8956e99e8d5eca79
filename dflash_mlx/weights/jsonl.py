"""JSONL files a user hands a tool: one JSON object a line, each bad line named in one error."""

import json
from pathlib import Path

from ..errors import DFlashError


def read_objects(path: Path, flag: str, what: str) -> list[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line of ``path``.

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
            raise DFlashError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be one JSON object.")
        if not isinstance(row, dict):
            raise DFlashError(f"{path}:{n} is not a JSON object; each line must be one.")
        rows.append((n, row))
    if not rows:
        raise DFlashError(f"{path} holds no {what}.")
    return rows
