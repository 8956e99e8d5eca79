"""Messages from the model thread to the UI, and the numbers they add up to.

Everything here is plain Python: the UI thread never sees an ``mx.array``.
"""

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

# Cycles over which "tok/s now" is measured: one cycle is too noisy, a reply too slow to react.
RATE_WINDOW = 4


@dataclass
class ModelReady(Message):
    """The models are loaded (or a fake stream needs no loading)."""

    name: str
    has_draft: bool
    max_block_size: int | None
    chat_template: bool
    context_limit: int | None = None  # the target's trained context, in tokens (None: unknown)


@dataclass
class LoadFailed(Message):
    """Loading failed; ``error`` is a one-line message for the user."""

    error: str


@dataclass
class Delta(Message):
    """One generation cycle: its new text and the numbers of ``GenerationResponse``."""

    text: str
    num_tokens: int
    acceptance_length: int
    mean_acceptance_length: float
    cycle: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    plain_tps: float | None = None
    draft_tps: float | None = None

    @classmethod
    def from_response(cls, response: Any) -> "Delta":
        """Copy the plain fields of a ``GenerationResponse`` (or anything shaped like one)."""
        return cls(
            text=response.text,
            num_tokens=len(response.tokens),
            acceptance_length=int(response.acceptance_length),
            mean_acceptance_length=float(response.mean_acceptance_length),
            cycle=int(response.cycle),
            prompt_tokens=int(response.prompt_tokens),
            prompt_tps=float(response.prompt_tps),
            generation_tokens=int(response.generation_tokens),
            generation_tps=float(response.generation_tps),
            peak_memory=float(response.peak_memory),
            finish_reason=response.finish_reason,
            plain_tps=response.plain_tps,
            draft_tps=response.draft_tps,
        )


@dataclass
class ReplyDone(Message):
    """The reply ended: ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``."""

    reason: str
    error: str | None = None
    context_tokens: int | None = None


@dataclass
class ReplyStats:
    """The live numbers of one reply, built from its ``Delta`` messages.

    Rates come from the library's own clock (``generation_tokens`` and ``generation_tps``),
    not from when a message reached the UI, so they are exact and reproducible.
    """

    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    tokens: int = 0
    tps: float = 0.0
    acceptance_length: int = 0
    mean_acceptance_length: float = 0.0
    cycles: int = 0
    peak_memory: float = 0.0
    finish_reason: str | None = None
    context_tokens: int | None = None
    dflash: bool = True
    block_size: int | None = None
    plain_tps: float | None = None
    draft_tps: float | None = None
    _window: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOW + 1), repr=False)

    def add(self, d: Delta) -> None:
        if d.cycle == 0:
            self.prompt_tokens, self.prompt_tps = d.prompt_tokens, d.prompt_tps
        else:
            self.acceptance_length = d.acceptance_length
            self.mean_acceptance_length = d.mean_acceptance_length
            self.cycles = d.cycle
        self.tokens, self.tps = d.generation_tokens, d.generation_tps
        self.plain_tps, self.draft_tps = d.plain_tps, d.draft_tps
        self.peak_memory = max(self.peak_memory, d.peak_memory)
        self.finish_reason = d.finish_reason or self.finish_reason
        # Seconds since the first token, as stream_generate measured them.
        elapsed = (d.generation_tokens - 1) / d.generation_tps if d.generation_tps > 0 else 0.0
        self._window.append((d.generation_tokens, elapsed))

    @property
    def ttft(self) -> float:
        """Time to first token: the prefill, in seconds."""
        return self.prompt_tokens / self.prompt_tps if self.prompt_tps > 0 else 0.0

    @property
    def tps_now(self) -> float:
        """Tokens per second over the last few cycles."""
        if len(self._window) < 2:
            return self.tps
        (n0, t0), (n1, t1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else self.tps

    def summary(self) -> str:
        """The one-line stats shown under a finished reply."""
        parts = [f"{self.tokens} tok", f"{self.tps:.1f} tok/s"]
        if self.dflash and self.cycles:
            block = f"/{self.block_size}" if self.block_size else ""
            parts.append(f"accept {self.mean_acceptance_length:.2f}{block} over {self.cycles} cycles")
        elif not self.dflash:
            parts.append("DFlash off")
        parts.append(f"prefill {self.prompt_tokens} tok @ {self.prompt_tps:.0f} tok/s")
        if self.context_tokens is not None:
            parts.append(f"context {self.context_tokens} tok")
        parts.append(f"TTFT {self.ttft:.2f}s")
        parts.append(f"peak {self.peak_memory:.2f} GB")
        if self.finish_reason:
            parts.append(self.finish_reason)
        return " · ".join(parts)


@dataclass
class ConversationStats:
    """Acceptance lengths of every cycle in the conversation, for the sparkline and histogram."""

    lengths: list[int] = field(default_factory=list)
    histogram: Counter = field(default_factory=Counter)

    def add(self, acceptance_length: int) -> None:
        self.lengths.append(acceptance_length)
        self.histogram[acceptance_length] += 1

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths) if self.lengths else 0.0

    def clear(self) -> None:
        self.lengths.clear()
        self.histogram.clear()
