"""Messages from the model thread to the UI, and the numbers they add up to.

Everything here is plain Python: the UI thread never sees an ``mx.array``.
"""

from collections import Counter, deque
from dataclasses import dataclass, field

from textual.message import Message

from ..text.responses import AcceptanceStats, GenerationResponse

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
    switches: frozenset[str] | None = None  # the thinking switches the chat template reads (None: unknown)
    peak_memory_known: bool = True  # False for a server's model: its memory is not reported
    default_pair: bool = False  # the model is the default pair (a server's, whose id says so)


@dataclass
class LoadFailed(Message):
    """Loading failed; ``error`` is a one-line message for the user."""

    error: str


@dataclass
class CycleUpdate(Message):
    """One generation cycle: the library's ``GenerationResponse`` (plain Python values only),
    carried from the worker thread to the app as it is."""

    response: GenerationResponse


@dataclass
class PrefillProgress(Message):
    """``done`` of a reply's ``total`` prompt tokens prefilled (a long prompt takes minutes on a CPU)."""

    done: int
    total: int


@dataclass
class ReplyDone(Message):
    """The reply ended: ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``."""

    reason: str
    error: str | None = None
    context_tokens: int | None = None


@dataclass
class ReplyStats:
    """The live numbers of one reply, built from its cycles' ``GenerationResponse``s.

    Rates come from the library's own clock (``generation_tokens`` and ``generation_tps``),
    not from when a message reached the UI, so they are exact and reproducible.
    """

    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    tokens: int = 0
    tps: float = 0.0
    acceptance_length: int = 0
    num_draft: int = 0  # this cycle's (0: a plain cycle)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)  # the reply's, as the stream counts it
    cycles: int = 0
    peak_memory: float = 0.0
    peak_memory_known: bool = True  # a server's model: "n/a", not a made-up 0
    finish_reason: str | None = None
    context_tokens: int | None = None
    dflash: bool = True
    block_size: int | None = None
    plain_tps: float | None = None
    draft_tps: float | None = None
    # This reply's plain steps (cycles that verified no draft): their count and seconds.
    plain_steps: int = 0
    plain_seconds: float = 0.0
    _window: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOW + 1), repr=False)

    def add(self, d: GenerationResponse) -> None:
        if d.cycle == 0:
            self.prompt_tokens, self.prompt_tps = d.prompt_tokens, d.prompt_tps
        else:
            self.acceptance_length, self.num_draft = d.acceptance_length, d.num_draft
            self.acceptance = AcceptanceStats.from_totals(d.mean_acceptance_length, d.drafting_cycles, d.plain_cycles)
            self.cycles = d.cycle
        self.tokens, self.tps = d.generation_tokens, d.generation_tps
        self.plain_tps, self.draft_tps = d.plain_tps, d.draft_tps
        self.peak_memory = max(self.peak_memory, d.peak_memory)
        self.finish_reason = d.finish_reason or self.finish_reason
        # Seconds since the first token, as stream_generate measured them.
        elapsed = (d.generation_tokens - 1) / d.generation_tps if d.generation_tps > 0 else 0.0
        if d.cycle > 1 and d.num_draft == 0 and self._window and elapsed > self._window[-1][1]:
            self.plain_steps += 1
            self.plain_seconds += elapsed - self._window[-1][1]
        self._window.append((d.generation_tokens, elapsed))

    @property
    def plain_step_tps(self) -> float | None:
        """Plain decoding's tokens per second, from this reply's own plain steps (None: too few)."""
        return self.plain_steps / self.plain_seconds if self.plain_steps >= 3 and self.plain_seconds > 0 else None

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
            parts.append(self.acceptance.describe())
        elif not self.dflash:
            parts.append("DFlash off")
        parts.append(f"prefill {self.prompt_tokens} tok @ {self.prompt_tps:.0f} tok/s")
        if self.context_tokens is not None:
            parts.append(f"context {self.context_tokens} tok")
        parts.append(f"TTFT {self.ttft:.2f}s")
        parts.append(f"peak {self.peak_memory:.2f} GB" if self.peak_memory_known else "peak n/a")
        if self.finish_reason:
            parts.append(self.finish_reason)
        return " · ".join(parts)


@dataclass
class ConversationStats:
    """The conversation's acceptance: the counts of its replies (the finished ones and the one
    streaming), and each drafting cycle's acceptance length for the sparkline and histogram."""

    finished: AcceptanceStats = field(default_factory=AcceptanceStats)
    current: AcceptanceStats = field(default_factory=AcceptanceStats)
    lengths: list[int] = field(default_factory=list)
    histogram: Counter = field(default_factory=Counter)

    def add(self, d: GenerationResponse) -> None:
        if d.cycle == 0:
            return
        self.current = AcceptanceStats.from_totals(d.mean_acceptance_length, d.drafting_cycles, d.plain_cycles)
        if d.num_draft > 0:
            self.lengths.append(d.acceptance_length)
            self.histogram[d.acceptance_length] += 1

    def end_reply(self) -> None:
        self.finished.merge(self.current)
        self.current = AcceptanceStats()

    @property
    def acceptance(self) -> AcceptanceStats:
        total = AcceptanceStats()
        total.merge(self.finished)
        total.merge(self.current)
        return total

    def clear(self) -> None:
        self.finished, self.current = AcceptanceStats(), AcceptanceStats()
        self.lengths.clear()
        self.histogram.clear()
