"""Widgets of dflash-chat: the prompt box, the transcript entries, the stats panel, the error screen."""

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Collapsible, Markdown, Static, TextArea

from ..text.responses import AcceptanceStats
from .messages import ConversationStats, ReplyStats

BARS = " ▁▂▃▄▅▆▇█"
SPARK_HEIGHT = 3


class PromptInput(TextArea):
    """A multi-line prompt: Enter sends, Ctrl+J or Shift+Enter starts a new line.

    Terminals send the same byte for Enter and Shift+Enter unless they speak the kitty
    keyboard protocol, so Ctrl+J (a plain line feed) is the newline key that always works.
    Up/Down on the first/last line walk through what was sent before.
    """

    # Shown in the footer; the keys are handled in ``_on_key`` so they stay in order with the
    # typed characters (a priority binding would run before keys still in the queue).
    BINDINGS = [
        Binding("enter", "submit", "Send"),
        Binding("ctrl+j,shift+enter,alt+enter", "newline", "New line", key_display="^j"),
    ]
    NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")

    class Submitted(Message):
        """The user pressed Enter; the text stays in the box until the app takes it."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs) -> None:
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            placeholder="Message · Enter sends · Ctrl+J new line · /help",
            **kwargs,
        )
        self.sent: list[str] = []
        self._history_index: int | None = None
        self._draft = ""

    def action_submit(self) -> None:
        self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter" or event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_submit() if event.key == "enter" else self.action_newline()
            return
        if event.key in ("up", "down") and self.sent and self._walk_history(event.key):
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)

    def _walk_history(self, key: str) -> bool:
        row = self.cursor_location[0]
        if key == "up" and row != 0 or key == "down" and row != self.document.line_count - 1:
            return False
        if self._history_index is None:
            if key == "down":
                return False
            self._draft, self._history_index = self.text, len(self.sent)
        self._history_index += -1 if key == "up" else 1
        self._history_index = max(0, self._history_index)
        if self._history_index >= len(self.sent):
            # Walked past the newest entry: back to what was being typed.
            self._history_index = None
            self.load_text(self._draft)
        else:
            self.load_text(self.sent[self._history_index])
        self.move_cursor(self.document.end)
        return True

    def take(self, text: str) -> None:
        """Remove the submitted ``text`` from the box and remember it in the history.

        Whatever was typed after Enter, before the app got the message, stays in the box.
        """
        if text.strip() and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._history_index = None
        rest = self.text[len(text) :] if self.text.startswith(text) else self.text
        self.load_text(rest)
        self.move_cursor(self.document.end)


class UserMessage(Static):
    """What the user sent, shown verbatim (no Markdown)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), classes="user")
        self.border_title = "you"


class Note(Static):
    """A message from the app itself: command results, errors, help."""

    def __init__(self, text: str, error: bool = False) -> None:
        super().__init__(Text(text), classes="note error" if error else "note")


class HelpNote(Markdown):
    """The /help text."""


class Reply(Vertical):
    """One streamed reply: Markdown that grows as tokens arrive, and a stats line at the end.

    A reasoning model's reasoning goes in a folded section above the answer (a ``Collapsible``,
    like HTML's details element), made when the first of it arrives: a reply without any
    looks as it always did.
    """

    def __init__(self, title: str = "assistant") -> None:
        super().__init__(classes="reply")
        self.border_title = title

    def compose(self) -> ComposeResult:
        yield Markdown("", classes="body")
        yield Static("", classes="reply-stats")

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    @property
    def reasoning_section(self) -> Collapsible | None:
        try:
            return self.query_one(".reasoning", Collapsible)
        except NoMatches:
            return None

    async def reasoning(self) -> Markdown:
        """The Markdown of the folded reasoning section, mounted on first use."""
        section = self.reasoning_section
        if section is None:
            section = Collapsible(Markdown("", classes="reasoning-body"), title="thinking…", classes="reasoning")
            await self.mount(section, before=self.body)
        return section.query_one(".reasoning-body", Markdown)

    def set_stats(self, line: str, reasoning_words: int = 0) -> None:
        self.query_one(".reply-stats", Static).update(Text(line))
        section = self.reasoning_section
        if section is not None:
            section.title = f"reasoning · {reasoning_words} words"
        self.add_class("done")


class Transcript(VerticalScroll):
    """The conversation; it follows new text unless the user scrolled up."""

    def follow(self) -> None:
        if self.max_scroll_y - self.scroll_y <= 3:
            self.scroll_end(animate=False, immediate=False)


def sparkline_rows(values: list[int], top: int, height: int) -> list[str]:
    """A sparkline ``height`` rows tall on a fixed 0..``top`` scale, newest value on the right.

    A fixed scale (unlike textual's ``Sparkline``, which stretches min..max) keeps a run of
    1s looking low and a run of full blocks looking high.
    """
    levels = len(BARS) - 1
    units = [round(min(v, top) / top * height * levels) for v in values]
    return ["".join(BARS[min(max(u - row * levels, 0), levels)] for u in units) for row in reversed(range(height))]


def histogram_rows(stats: ConversationStats, width: int) -> tuple[str, str]:
    """A one-line histogram of acceptance lengths 1..width, and its axis labels."""
    peak = max(stats.histogram.values(), default=0)
    bars = ""
    for length in range(1, width + 1):
        n = stats.histogram.get(length, 0)
        bars += BARS[0] if n == 0 else BARS[max(1, round(n / peak * (len(BARS) - 1)))]
    axis = ""
    for i in range(1, width + 1):
        if len(axis) < i:
            axis += str(i) if i == 1 or i % 5 == 0 else " "
    return bars, axis[:width]


class StatsPanel(VerticalScroll):
    """Live numbers: this cycle's acceptance length, tau and the cycles it counts (the reply's
    and the conversation's), speeds, memory, and the drafting cycles' history."""

    def compose(self) -> ComposeResult:
        yield Static("", id="state")
        yield Static("", id="live")
        yield Static("", id="caption", classes="caption")
        yield Static("", id="sparkline")
        yield Static("", id="histogram")

    def show(
        self,
        state: str,
        reply: ReplyStats | None,
        conversation: ConversationStats,
        block_size: int | None,
    ) -> None:
        """Redraw from plain numbers; called on every cycle and when settings change."""
        self.query_one("#state", Static).update(Text(state, style="bold"))
        r = reply or ReplyStats()
        now = ("plain" if r.num_draft == 0 else r.acceptance_length) if r.cycles else "-"
        lines = [
            f"accept now  {now:>6}",
            *_acceptance_lines("tau reply", r.acceptance if r.cycles else None),
            f"tok/s now   {r.tps_now:>6.1f}",
            f"tok/s reply {r.tps:>6.1f}",
            f"tokens      {r.tokens:>6}",
            f"prefill     {r.prompt_tokens:>6} tok",
            f"prompt tok/s{r.prompt_tps:>7.0f}",
            f"TTFT        {r.ttft:>6.2f} s",
            f"peak mem    {r.peak_memory:>6.2f} GB" if r.peak_memory_known else f"peak mem    {'n/a':>6}",
        ]
        if r.plain_tps and r.draft_tps:
            # The adaptive policy's two rates, side by side and unjudged: the latest window of drafting
            # cycles against plain steps (it pauses the drafter while the first is lower).
            lines[6:6] = [f"tok/s draft {r.draft_tps:>6.1f}", f"tok/s plain {r.plain_tps:>6.1f}"]
        if r.plain_step_tps:  # the whole reply against its own plain steps: what drafting bought
            lines.insert(4, f"reply/plain {r.tps / r.plain_step_tps:>5.2f}x")
        self.query_one("#live", Static).update(Text("\n".join(lines)))
        total = conversation.acceptance
        caption = ["conversation", *_acceptance_lines("tau", total if total.cycles else None)]
        self.query_one("#caption", Static).update(Text("\n".join(caption)))
        spark = self.query_one("#sparkline", Static)
        top = max(block_size or 1, max(conversation.histogram, default=1))
        rows = sparkline_rows(conversation.lengths[-max(1, spark.size.width or 24) :], top, SPARK_HEIGHT)
        spark.update(Text("\n".join(rows)))
        bars, axis = histogram_rows(conversation, top)
        self.query_one("#histogram", Static).update(Text(f"histogram (1..{top})\n{bars}\n{axis}"))


def _acceptance_lines(label: str, stats: AcceptanceStats | None) -> list[str]:
    """tau and the cycles it counts, as the stats panel shows them ("-" before any)."""
    if stats is None:
        return [f"{label:<12}{'-':>6}", f"draft cycles{'-':>6}", f"plain cycles{'-':>6}"]
    tau = f"{stats.tau:.2f}" if stats.drafting_cycles else "-"
    return [f"{label:<12}{tau:>6}", f"draft cycles{stats.drafting_cycles:>6}", f"plain cycles{stats.plain_cycles:>6}"]


class ErrorScreen(Screen):
    """A readable error instead of a traceback: what failed and how to fix it."""

    BINDINGS = [Binding("q,escape,enter", "app.quit_with_error", "Quit")]

    def __init__(self, title: str, message: str) -> None:
        super().__init__()
        self.title_text, self.message = title, message

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box"):
            yield Static(Text(self.title_text, style="bold"), id="error-title")
            yield Static(Text(self.message), id="error-message")
            yield Static(Text("Press q to quit."), id="error-hint")
