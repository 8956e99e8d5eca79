"""What generation reports: ``GenerationResponse`` per cycle, and ``AcceptanceStats``, the one
definition of the mean acceptance length (tau) that every tool shows.

Plain Python only (no mlx import), so the HTTP client and the chat app can use it without
loading MLX.
"""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """Counts of drafting and plain cycles; their tau is the mean acceptance length.

    A drafting cycle verified at least one draft; it emits its accepted drafts and the
    target's own token (cut after a stop token). A plain cycle verified no draft (the
    adaptive policy's, a prompt-lookup miss, a last cycle with no room) and emits one token.
    tau = tokens emitted by drafting cycles / drafting cycles, so a run's tokens are
    1 (the prefill's) + tau x drafting cycles + plain cycles. Plain cycles are counted apart,
    never averaged in.

    Args:
        drafting_cycles: Cycles that verified at least one draft.
        drafting_tokens: Tokens those cycles emitted.
        draft_tokens: Drafts those cycles verified.
        plain_cycles: Cycles that verified no draft (one token each).
        histogram: Drafting cycles by ``(drafts verified, tokens emitted)``.
        by_source: Accepted drafts by what proposed them (``"drafter"``, ``"lookup"``,
          ``"datastore"``).
    """

    drafting_cycles: int = 0
    drafting_tokens: int = 0
    draft_tokens: int = 0
    plain_cycles: int = 0
    histogram: Counter = field(default_factory=Counter)
    by_source: Counter = field(default_factory=Counter)

    def add(self, num_draft: int, num_tokens: int, source: str = "") -> None:
        """One cycle that verified ``num_draft`` drafts (proposed by ``source``) and emitted
        ``num_tokens`` tokens."""
        if num_draft <= 0:
            self.plain_cycles += 1
            return
        self.drafting_cycles += 1
        self.drafting_tokens += num_tokens
        self.draft_tokens += num_draft
        self.histogram[(num_draft, num_tokens)] += 1
        if source:
            self.by_source[source] += num_tokens - 1

    def merge(self, other: "AcceptanceStats") -> None:
        """Add ``other``'s counts to these (replies of a conversation, requests of a server)."""
        self.drafting_cycles += other.drafting_cycles
        self.drafting_tokens += other.drafting_tokens
        self.draft_tokens += other.draft_tokens
        self.plain_cycles += other.plain_cycles
        self.histogram.update(other.histogram)
        self.by_source.update(other.by_source)

    @classmethod
    def from_totals(cls, tau: float, drafting_cycles: int, plain_cycles: int = 0) -> "AcceptanceStats":
        """The counts a response reports (``mean_acceptance_length``, ``drafting_cycles``,
        ``plain_cycles``), without the per-cycle histogram."""
        return cls(drafting_cycles, round(tau * drafting_cycles), 0, plain_cycles)

    @property
    def tau(self) -> float:
        """Tokens per drafting cycle (1.0 before any, as vLLM reports it)."""
        return self.drafting_tokens / self.drafting_cycles if self.drafting_cycles else 1.0

    @property
    def cycles(self) -> int:
        return self.drafting_cycles + self.plain_cycles

    @property
    def tokens(self) -> int:
        """Tokens all cycles emitted (the prefill's first token not included)."""
        return self.drafting_tokens + self.plain_cycles

    @property
    def accepted_drafts(self) -> int:
        return self.drafting_tokens - self.drafting_cycles

    @property
    def lengths(self) -> dict[int, int]:
        """Drafting cycles by acceptance length (tokens emitted), shortest first."""
        counts: Counter = Counter()
        for (_, length), n in self.histogram.items():
            counts[length] += n
        return dict(sorted(counts.items()))

    @property
    def by_draft_length(self) -> dict[int, list[int]]:
        """Per number of drafts verified, drafting cycles by drafts accepted (0 to that number)."""
        rows: dict[int, list[int]] = {}
        for (num_draft, length), n in sorted(self.histogram.items()):
            rows.setdefault(num_draft, [0] * (num_draft + 1))[length - 1] += n
        return rows

    @property
    def depths(self) -> dict[int, float]:
        """Per depth ``d``: of the drafting cycles that verified ``d`` drafts or more, the share that kept ``d``
        or more (of a draft tree: whose accepted path reached depth ``d``), shallowest first."""
        reached: Counter = Counter()
        verified: Counter = Counter()
        for (num_draft, length), n in self.histogram.items():
            for d in range(1, num_draft + 1):
                verified[d] += n
                reached[d] += n if length - 1 >= d else 0
        return {d: reached[d] / verified[d] for d in sorted(verified)}

    @property
    def shares(self) -> dict[str, float]:
        """Each source's share of the accepted drafts (empty before any was accepted)."""
        total = sum(self.by_source.values())
        return {k: v / total for k, v in sorted(self.by_source.items())} if total else {}

    def describe(self) -> str:
        """``tau 1.42 over 120 drafting cycles; 173 plain``: what tau is and what it counts."""
        return describe_acceptance(self.tau, self.drafting_cycles, self.plain_cycles)


def describe_acceptance(tau: float, drafting_cycles: int, plain_cycles: int) -> str:
    """The label every tool prints for tau (see :class:`AcceptanceStats`)."""
    plain = f"{plain_cycles} plain"
    if not drafting_cycles:
        return f"no drafting cycles; {plain}"
    cycles = "cycle" if drafting_cycles == 1 else "cycles"
    return f"tau {tau:.2f} over {drafting_cycles} drafting {cycles}; {plain}"


@dataclass
class GenerationResponse:
    """The output of :func:`dflash_mlx.generation.stream_generate`, one per cycle. All plain
    Python values.

    Args:
        text: The new segment of decoded text (may be empty).
        tokens: This cycle's new token ids (a stop token is not included).
        acceptance_length: Tokens this cycle emitted: its accepted drafts and the target's own
          token, cut after a stop token (1 for a plain cycle).
        mean_acceptance_length: tau so far: tokens emitted by drafting cycles over drafting
          cycles (1.0 before any; see :class:`AcceptanceStats`).
        cycle: 0 for the prefill's first token, then 1, 2, ... per draft/verify cycle.
        prompt_tokens: Prompt tokens prefilled (after any cache reuse).
        prompt_tps: Prompt tokens per second (prefill up to the first token).
        generation_tokens: Tokens generated so far.
        generation_tps: Generated tokens per second since the first token.
        peak_memory: Peak memory so far, in GB.
        finish_reason: ``"stop"``, ``"length"`` or None while generating.
        num_draft: Tokens drafted this cycle (0: a plain decoding step).
        prompt_cached: Prompt tokens taken from ``prompt_cache`` instead of prefilled.
        plain_tps: Plain decoding's tokens per second, as measured by ``adaptive``'s plain
          cycles (None: not measured yet, or ``adaptive=False``).
        draft_tps: Drafting cycles' tokens per second over their latest window (None likewise).
          Below ``plain_tps``, DFlash is losing to plain decoding; ``adaptive`` then decodes
          plainly until drafting pays again.
        drafting_cycles: Cycles so far that verified at least one draft (tau's denominator).
        plain_cycles: Cycles so far that verified none.
        reasoning: The new segment of reasoning, when ``stream_generate`` splits it from the
          answer (``parse_reasoning``); ``text`` is then the answer's segment.
        draft_source: What proposed this cycle's drafts: ``"drafter"`` (the DFlash drafter),
          ``"lookup"`` (prompt lookup), ``"datastore"`` (the target's past text), or ``""``.
        accepted_by_source: Accepted drafts so far, by what proposed them.
    """

    text: str
    tokens: list[int]
    acceptance_length: int
    mean_acceptance_length: float
    cycle: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    num_draft: int = 0
    prompt_cached: int = 0
    plain_tps: float | None = None
    draft_tps: float | None = None
    drafting_cycles: int = 0
    plain_cycles: int = 0
    reasoning: str = ""
    draft_source: str = ""
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def drafting_slower(self) -> bool:
        """True when drafting measured slower than plain decoding."""
        return self.plain_tps is not None and self.draft_tps is not None and self.draft_tps < self.plain_tps
