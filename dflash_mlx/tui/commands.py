"""Slash commands and transcript saving for dflash-chat: pure functions, no UI.

``parse_command`` turns a line such as ``/block 8`` into a ``Command``: the new settings or an
action for the app, and a message for the user. A bad command changes nothing.
"""

import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..text.chat_template import REASONING_EFFORTS, THINKING_SWITCHES
from ..tools.cli.options import MAX_TEMP

# Limits that keep a typo (``/max 1000000000``) from hanging the app.
MAX_TOKENS_LIMIT = 32768
MAX_FALLBACK = 1024
MAX_TREE_BUDGET = 1024
SAVE_FORMATS = {".md": "markdown", ".markdown": "markdown", ".txt": "markdown", ".json": "json"}

HELP = """\
**Keys**: `Enter` send · `Ctrl+J` or `Shift+Enter` new line · `Esc` or `Ctrl+C` stop generating · \
`Ctrl+L` clear · `Ctrl+Q` quit

**Commands**
- `/block N`: tokens verified per cycle (1 to the drafter's block size), or `/block auto`: each cycle the
  number of drafts that pays best (from measured pass costs and the drafter's confidences)
- `/temp T`: sampling temperature (0 = greedy, output identical to the target alone)
- `/max N`: most tokens per reply
- `/dflash on|off`: speculative decoding on, or plain decoding with the same model
- `/think on|off`: thinking on or off, for models whose chat template has the switch (Qwen3,
  Gemma 4); `/think low|medium|high`: gpt-oss's reasoning effort; `/think default`: the template's
  own. A reply's reasoning shows folded above it: click it (or focus it and press Enter) to open it
- `/cutoff P`: verify only the drafts the drafter gives at least probability P (0 = the whole block;
  faster on CPUs, same text)
- `/fallback N`: after the drafter misses its first draft, draft up to N cycles by prompt lookup
  (0 = never; faster where the drafter is often wrong, same text)
- `/tree N`: verify a draft tree of up to N nodes a cycle, the drafter's most likely continuations
  (0 = its one path; `/tree auto`: the nodes that pay best each cycle; same text)
- `/clear`: start a new conversation
- `/save FILE`: save the transcript (`.md` or `.json`); `/save! FILE` overwrites
- `/help`: this message

A message that starts with `/` is sent with `//` (`//etc/hosts is...`)."""


@dataclass(frozen=True)
class Settings:
    """What the next reply is generated with.

    Args:
        block_size: Tokens verified per cycle; None means the drafter's trained block size.
        temp: Sampling temperature; 0 is greedy decoding.
        top_p: Nucleus sampling threshold; 0 is off.
        max_tokens: The most tokens per reply.
        dflash: Draft with the drafter (True) or decode one token per target pass (False).
        min_confidence: Verify only the drafter's confident leading drafts (0: the whole block).
        confidence_threshold: A DSpark drafter's confidence head: stop its drafts before the first
          whose predicted chance of acceptance is under this (0: the whole block).
        lookup_fallback: Draft up to this many cycles by prompt lookup after the drafter misses
          its first draft (0: never).
        tree_budget: Verify a draft tree of up to this many nodes a cycle (0: the drafter's path).
        system_prompt: The system message put first in the chat template, if any.
        thinking: The chat template's ``enable_thinking``; None leaves the template's default.
        reasoning_effort: The chat template's ``reasoning_effort`` (gpt-oss: low, medium,
          high); None leaves the template's default.
    """

    block_size: int | str | None = None
    temp: float = 0.0
    max_tokens: int = 512
    top_p: float = 0.0
    dflash: bool = True
    system_prompt: str | None = None
    min_confidence: float = 0.0
    confidence_threshold: float = 0.0
    lookup_fallback: int = 0
    tree_budget: int | str = 0
    thinking: bool | None = None
    reasoning_effort: str | None = None

    def template_args(self) -> dict[str, Any]:
        """The chat template's thinking switches these settings set."""
        args: dict[str, Any] = {}
        if self.thinking is not None:
            args["enable_thinking"] = self.thinking
        if self.reasoning_effort is not None:
            args["reasoning_effort"] = self.reasoning_effort
        return args

    def in_use(self, max_block_size: int | None) -> "Settings":
        """These settings with the drafter's block size in place of None (the trained default)."""
        return replace(self, block_size=self.block_size or max_block_size) if self.dflash else self

    def describe(self, max_block_size: int | None = None) -> str:
        block = self.block_size or max_block_size
        mode = f"DFlash on · block {block if block else 'auto'}" if self.dflash else "DFlash off"
        if self.dflash and self.min_confidence > 0:
            mode += f" · cutoff {self.min_confidence:g}"
        if self.dflash and self.confidence_threshold > 0:
            mode += f" · threshold {self.confidence_threshold:g}"
        if self.dflash and self.lookup_fallback > 0:
            mode += f" · fallback {self.lookup_fallback}"
        if self.dflash and self.tree_budget:
            mode += f" · tree {self.tree_budget}"
        top_p = f" · top-p {self.top_p:g}" if self.temp > 0 and 0 < self.top_p < 1 else ""
        text = f"{mode} · temp {self.temp:g}{top_p} · max {self.max_tokens}"
        if self.thinking is not None:
            text += f" · thinking {'on' if self.thinking else 'off'}"
        if self.reasoning_effort is not None:
            text += f" · effort {self.reasoning_effort}"
        return text


@dataclass(frozen=True)
class Command:
    """The outcome of one slash command.

    Args:
        action: ``"set"``, ``"clear"``, ``"save"``, ``"help"`` or ``"error"``.
        settings: The settings after the command (unchanged unless ``action == "set"``).
        message: What to tell the user.
        path: The file for ``"save"``.
        force: ``/save!``: overwrite an existing file.
    """

    action: str
    settings: Settings
    message: str = ""
    path: str | None = None
    force: bool = False

    @property
    def ok(self) -> bool:
        return self.action != "error"


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_command(
    line: str,
    settings: Settings,
    *,
    max_block_size: int | None = None,
    has_draft: bool = True,
    switches: frozenset[str] | None = None,
) -> Command:
    """Parse a slash command against the current settings.

    Args:
        line: The user's input, starting with ``/``.
        settings: The current settings.
        max_block_size: The drafter's trained block size, the largest ``/block`` allowed.
        has_draft: Whether a drafter is loaded (``/dflash on`` needs one).
        switches: The thinking switches the chat template reads (``/think`` sets only
          those); None when unknown (a server's model), which allows every one.

    Returns:
        Command: The new settings or an action, with a message. On bad input the action is
        ``"error"``, the settings are unchanged and the message says what would work.
    """
    name, _, arg = line.strip().partition(" ")
    name, arg = name.lower(), arg.strip()

    def error(message: str) -> Command:
        return Command("error", settings, message)

    def usage_error(what: str, usage: str) -> Command:
        got = f"got {arg!r}" if arg else "got nothing"
        return error(f"{name} needs {what} ({got}). Usage: {usage}")

    if name == "/help":
        return Command("help", settings, HELP)
    if name == "/clear":
        return Command("clear", settings, "New conversation.")
    if name in ("/save", "/save!"):
        if not arg:
            return usage_error("a file name", "/save chat.md or /save chat.json")
        suffix = Path(arg).suffix.lower()
        if suffix not in SAVE_FORMATS:
            return error(f"/save writes .md or .json files (got {arg!r}). Try /save chat.md")
        return Command("save", settings, path=arg, force=name == "/save!")
    if name == "/block":
        n, top = _int(arg), max_block_size or 16
        if not has_draft:
            return error("/block needs a drafter, but none is loaded. Restart with --draft.")
        if arg.strip().lower() == "auto":
            clash = _clash(settings, block_size="auto")
            if clash:
                return error(clash)
            return Command("set", replace(settings, block_size="auto"), "Block size auto: each cycle verifies "
                           "the drafts that pay best.")  # fmt: skip
        if n is None or not 1 <= n <= top:
            return usage_error(f"an integer from 1 to {top}, or auto", "/block 8")
        return Command("set", replace(settings, block_size=n), f"Block size {n}.")
    if name == "/temp":
        t = _float(arg)
        if t is None or not 0.0 <= t <= MAX_TEMP:  # also rejects nan
            return usage_error(f"a number from 0 to {MAX_TEMP:g}", "/temp 0.7")
        return Command("set", replace(settings, temp=t), f"Temperature {t:g}.")
    if name == "/max":
        n = _int(arg)
        if n is None or not 1 <= n <= MAX_TOKENS_LIMIT:
            return usage_error(f"an integer from 1 to {MAX_TOKENS_LIMIT}", "/max 256")
        return Command("set", replace(settings, max_tokens=n), f"At most {n} tokens per reply.")
    if name == "/cutoff":
        p = _float(arg)
        if p is None or not 0.0 <= p <= 1.0:  # also rejects nan
            return usage_error("a probability from 0 to 1", "/cutoff 0.5")
        clash = _clash(settings, min_confidence=p)
        if clash:
            return error(clash)
        what = f"verifying drafts up to the first below {p:g}" if p > 0 else "verifying whole blocks"
        return Command("set", replace(settings, min_confidence=p), f"Cutoff {p:g}: {what}.")
    if name == "/fallback":
        n = _int(arg)
        if n is None or not 0 <= n <= MAX_FALLBACK:
            return usage_error(f"an integer from 0 to {MAX_FALLBACK}", "/fallback 4")
        what = f"up to {n} prompt-lookup cycles after a missed first draft" if n else "always the drafter"
        return Command("set", replace(settings, lookup_fallback=n), f"Fallback {n}: {what}.")
    if name == "/tree":
        n = _int(arg)
        if not has_draft:
            return error("/tree needs a drafter, but none is loaded. Restart with --draft.")
        if arg.strip().lower() == "auto":
            clash = _clash(settings, tree_budget="auto")
            if clash:
                return error(clash)
            return Command("set", replace(settings, tree_budget="auto"), "Tree auto: each cycle verifies the "
                           "draft tree nodes that pay best.")  # fmt: skip
        if n is None or not 0 <= n <= MAX_TREE_BUDGET:
            return usage_error(f"an integer from 0 to {MAX_TREE_BUDGET}, or auto", "/tree 16")
        clash = _clash(settings, tree_budget=n)
        if clash:
            return error(clash)
        what = f"a draft tree of up to {n} nodes a cycle" if n else "the drafter's one path"
        return Command("set", replace(settings, tree_budget=n), f"Tree {n}: {what}.")
    if name == "/dflash":
        if arg.lower() not in ("on", "off"):
            return usage_error("on or off", "/dflash off")
        on = arg.lower() == "on"
        if on and not has_draft:
            return error("/dflash on needs a drafter, but none is loaded. Restart with --draft.")
        state = "on: drafting blocks" if on else "off: plain decoding with the same model"
        return Command("set", replace(settings, dflash=on), f"DFlash {state}.")
    if name == "/think":
        return _think(arg.lower(), settings, switches, usage_error, error)
    return error(f"Unknown command {name!r}. Type /help for the list of commands.")


def _clash(settings: Settings, **change) -> str | None:
    """Why ``change`` cannot go with the other settings, in the app's own commands (None: it can).
    The library refuses the same pairs; saying so here keeps the next message from failing."""
    new = replace(settings, **change)
    (name, value), command = next(iter(change.items())), None
    typed = {"block_size": "/block", "min_confidence": "/cutoff", "tree_budget": "/tree"}[name]
    this = f"{typed} {value:g}" if isinstance(value, float) else f"{typed} {value}"
    if new.tree_budget and new.min_confidence > 0:
        command = "/tree 0" if name == "min_confidence" else "/cutoff 0"
        why = "a draft tree verifies the drafter's likeliest nodes, not a path cut at a probability"
    elif new.tree_budget and new.block_size == "auto":
        command = "/tree 0" if name == "block_size" else "/block N"
        why = "a draft tree needs a fixed block size to grow from"
    elif new.block_size == "auto" and new.min_confidence > 0:
        command = "/cutoff 0" if name == "block_size" else "/block N"
        why = "/block auto chooses each cycle's drafts itself"
    if command is None:
        return None
    return f"{this} cannot go with the current settings: {why}. Send {command} first, then {this}."


def _think(arg: str, settings: Settings, switches: frozenset[str] | None, usage_error, error) -> Command:
    known = THINKING_SWITCHES if switches is None else switches
    if arg == "default":
        return Command("set", replace(settings, thinking=None, reasoning_effort=None),
                       "Thinking as the chat template sets it by default.")  # fmt: skip
    if arg in ("on", "off"):
        if "enable_thinking" not in known:
            hint = " Its reasoning effort is set with /think low|medium|high." if "reasoning_effort" in known else ""
            return error(f"This model's chat template has no thinking switch (it does not read enable_thinking).{hint}")
        on = arg == "on"
        return Command("set", replace(settings, thinking=on), f"Thinking {arg}: the next reply " +
                       ("may think first." if on else "answers without thinking."))  # fmt: skip
    if arg in REASONING_EFFORTS:
        if "reasoning_effort" not in known:
            hint = " Thinking is switched with /think on|off." if "enable_thinking" in known else ""
            return error(
                f"This model's chat template has no reasoning effort (it does not read reasoning_effort).{hint}"
            )
        return Command("set", replace(settings, reasoning_effort=arg), f"Reasoning effort {arg}.")
    return usage_error("on, off, low, medium, high or default", "/think off")


def transcript_markdown(turns: list[dict[str, Any]], settings: Settings) -> str:
    """The conversation as Markdown: one section per message, stats under each reply."""
    lines = ["# dflash-chat transcript", "", f"_Settings at save time: {settings.describe()}_", ""]
    if settings.system_prompt:
        lines += ["## System", "", settings.system_prompt, ""]
    for turn in turns:
        lines += [f"## {turn['role'].capitalize()}", ""]
        if turn.get("reasoning"):
            # Folded, as the app shows it; Markdown viewers render the HTML details element.
            lines += ["<details><summary>Reasoning</summary>", "", turn["reasoning"], "", "</details>", ""]
        lines += [turn["content"], ""]
        if turn.get("settings"):  # what this reply was generated with, which may differ from the header's
            lines += [f"_Generated with: {Settings(**turn['settings']).describe()}_", ""]
        if turn.get("stats"):
            lines += [f"_{turn['stats']}_", ""]
    return "\n".join(lines)


def transcript_json(turns: list[dict[str, Any]], settings: Settings) -> str:
    """The conversation as JSON: the settings and the messages with their stats."""
    return json.dumps({"settings": asdict(settings), "messages": turns}, indent=2, ensure_ascii=False) + "\n"


def save_transcript(
    path: str | Path,
    turns: list[dict[str, Any]],
    settings: Settings,
    *,
    force: bool = False,
    max_block_size: int | None = None,
) -> Path:
    """Write the transcript to ``path``, as Markdown or JSON by its extension.

    The text goes to a temporary file in the same folder that is then renamed, so an
    interrupted save never leaves a half-written file.

    Args:
        path: ``.md``/``.markdown``/``.txt`` (Markdown) or ``.json``.
        turns: The messages, ``{"role", "content"}`` and optionally ``"stats"`` and ``"settings"``
          (a reply's own, as :class:`Settings` fields), written under each reply.
        settings: The current settings, written in the header.
        force: Overwrite ``path`` if it exists.
        max_block_size: The drafter's block size, which a ``block_size`` of None means; the
          header then names the block size in use, as the app's settings bar does.

    Returns:
        The absolute path written.

    Raises:
        FileExistsError: If ``path`` exists and ``force`` is False.
        ValueError: On an unsupported extension.
        OSError: If the folder does not exist or cannot be written.
    """
    typed = str(path)  # the hint repeats it: /save! with only the file name would write elsewhere
    path = Path(path).expanduser().absolute()
    kind = SAVE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"Cannot save as {path.suffix!r}: use .md or .json.")
    exists = FileExistsError(f"{path} exists; use /save! {typed} to overwrite it.")
    if path.exists() and not force:
        raise exists
    settings = settings.in_use(max_block_size)
    text = transcript_json(turns, settings) if kind == "json" else transcript_markdown(turns, settings)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a transcript is an ordinary file
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            # A hard link fails if the name was taken meanwhile, so nothing is overwritten.
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise exists from None
            except OSError:  # file systems without hard links
                if path.exists():
                    raise exists from None
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
