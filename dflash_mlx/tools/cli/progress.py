"""One plain-text progress bar for the command-line tools (convert, train)."""

import sys
import time
from typing import TextIO


class Progress:
    """``[####----] done/total label (elapsed)``: redrawn in place on a terminal, one line
    per update when the output is a file or a pipe (logs stay readable).

    Args:
        total: The count that fills the bar.
        enabled: False prints nothing (quiet runs).
        width: Characters of the bar.
        stream: Where to print (default: stderr).
    """

    def __init__(self, total: int, *, enabled: bool = True, width: int = 24, stream: TextIO | None = None):
        self.total, self.done, self.enabled, self.width = max(total, 1), 0, enabled, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.steps = 0

    def update(self, done: int, label: str, elapsed: bool = True, count: bool = True) -> None:
        self.done = done
        if not self.enabled:
            return
        filled = self.width * min(done, self.total) // self.total
        line = f"[{'#' * filled}{'-' * (self.width - filled)}] " + (f"{done}/{self.total} " if count else "") + label
        if elapsed:
            line += f" ({time.perf_counter() - self.start:.1f}s)"
        if self.tty:
            print(f"\r\033[K{line}", end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def step(self, label: str) -> None:
        self.update(self.done + 1, label)

    def begin(self, label: str) -> None:
        """Start the next of ``total`` steps: the bar fills with those finished, the count names
        the one running (``step 4/6`` while the fourth runs), so a long step shows its own number."""
        self.steps += 1
        self.update(self.steps - 1, f"step {min(self.steps, self.total)}/{self.total}: {label}", count=False)

    def finish(self, label: str) -> None:
        self.update(self.total, label)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=self.stream)


def prefill_progress(min_tokens: int = 1024, stream: TextIO | None = None):
    """A ``prompt_progress_callback`` that draws a bar for a prompt of at least ``min_tokens``
    tokens to prefill (a long prompt takes minutes on a CPU; a short one shows nothing)."""
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if total < min_tokens:
            return
        if bar is None:
            bar = Progress(total, stream=stream)
        rate = done / max(time.perf_counter() - bar.start, 1e-9)
        bar.update(done, f"prompt tokens prefilled ({rate:.0f} tok/s)", elapsed=False)
        if done >= total:
            bar.close()

    return update
