"""dflash-chat: chat with a target + DFlash drafter pair and watch the drafter work.

The app never touches MLX. ``MLXEngine`` loads the models and runs every MLX call on one
dedicated thread (MLX streams are per thread); a Textual thread worker drives it and posts
plain-Python messages (``messages.py``) that the UI turns into text and numbers.
"""

import argparse
import sys
from dataclasses import asdict, replace

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Markdown, Static
from textual.worker import get_current_worker

from ..base.errors import DFlashError
from ..text.inputs import text_problem
from ..tools.cli.options import (
    ArgumentParser,
    InRange,
    add_blas_argument,
    add_decoding_arguments,
    add_model_arguments,
    block_size_problem,
)
from .commands import HELP, Settings, parse_command, save_transcript
from .engine import MLXEngine, RemoteEngine, StreamEngine, StreamFn
from .messages import ConversationStats, CycleUpdate, LoadFailed, ModelReady, PrefillProgress, ReplyDone, ReplyStats
from .widgets import ErrorScreen, HelpNote, Note, PromptInput, Reply, StatsPanel, Transcript, UserMessage

WELCOME = "Type a message and press Enter. Ctrl+J adds a new line, Esc stops a reply, /help lists commands."


class ChatApp(App):
    """The chat: a transcript with streamed Markdown replies, live DFlash stats, slash commands.

    Args:
        engine: An ``MLXEngine``, or any callable ``(messages, settings) -> iterator of
          GenerationResponse``-like objects (tests pass a fake generator).
        settings: The initial settings (block size, temperature, ...).
    """

    CSS_PATH = "chat.tcss"
    TITLE = "dflash-chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop reply"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        engine: MLXEngine | StreamFn,
        *,
        settings: Settings | None = None,
        note: str | None = None,
        pair_sampling: dict | None = None,
    ):
        super().__init__()
        # Sampling for a server's model that turns out to be the default pair (None: keep the settings).
        self.pair_sampling = pair_sampling
        self.engine = engine if hasattr(engine, "load") else StreamEngine(engine)
        self.settings = settings or Settings()
        self.note = note  # shown under the welcome line (why the settings are what they are)
        self.info: ModelReady | None = None
        self.turns: list[dict] = []
        self.conversation = ConversationStats()
        self.reply_stats: ReplyStats | None = None
        self.generating = False
        self._reply: Reply | None = None
        self._reply_text = ""
        self._stream = None
        self._reasoning_text = ""
        self._reasoning_stream = None
        self._stop_key = "Esc"
        self._reply_settings = self.settings
        self._prefill: tuple[int, int] | None = None  # (done, total) prompt tokens of the reply under way
        self._replies = 0  # replies started this session: the first one warms the models up
        # Posted from the model thread; Textual's post_message is thread-safe.
        self.engine.on_prefill = lambda done, total: self.post_message(PrefillProgress(done, total))

    def compose(self) -> ComposeResult:
        yield Static("", id="settings-bar")
        with Horizontal(id="body"):
            yield Transcript(id="transcript")
            yield StatsPanel(id="stats")
        yield PromptInput(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Transcript).mount(Note(WELCOME))
        if self.note:
            self.query_one(Transcript).mount(Note(self.note))
        self.query_one(PromptInput).focus()
        self._refresh()
        self.load_models()

    # ---- the model thread -------------------------------------------------------------

    @work(thread=True, exclusive=True, group="load")
    def load_models(self) -> None:
        try:
            info = self.engine.load()
        except DFlashError as e:
            self.post_message(LoadFailed(str(e)))
        except Exception as e:  # a readable screen beats a traceback for any failure here
            self.post_message(LoadFailed(f"{type(e).__name__}: {e}"))
        else:
            self.post_message(ModelReady(**info))

    @work(thread=True, exclusive=True, group="generate")
    def generate_reply(self, messages: list[dict[str, str]], settings: Settings) -> None:
        worker = get_current_worker()
        stream = self.engine(messages, settings)
        reason, error = None, None
        try:
            for response in stream:
                self.post_message(CycleUpdate(response))
                reason = response.finish_reason or reason
                if worker.is_cancelled and reason is None:
                    reason = "cancelled"
                    break
        except DFlashError as e:
            reason, error = "error", str(e)
        except Exception as e:
            reason, error = "error", f"{type(e).__name__}: {e}"
        finally:
            if hasattr(stream, "close"):
                stream.close()
        context = getattr(self.engine, "context_tokens", None)
        self.post_message(ReplyDone(reason or "stop", error, context))

    # ---- messages from the model thread -----------------------------------------------

    def on_model_ready(self, message: ModelReady) -> None:
        self.info = message
        # The same answer as dflash-generate's for a --block-size the drafter cannot take.
        problem = block_size_problem(self.settings.block_size, message.max_block_size if message.has_draft else None)
        if problem:
            self.push_screen(ErrorScreen("dflash-chat cannot start with these settings", problem))
            return
        if not message.has_draft:
            self.settings = replace(self.settings, dflash=False, block_size=None)
        if message.default_pair and self.pair_sampling:
            # As a local chat samples it: the server's model is the default pair.
            temp, top_p = self.pair_sampling["temp"], self.pair_sampling["top_p"]
            self.settings = replace(self.settings, temp=temp, top_p=top_p)
            self._note(_pair_sampling_note(temp, top_p))
        if not message.chat_template:
            self._note("This model has no chat template: it continues your text as a completion pad.")
        self._refresh()

    def on_load_failed(self, message: LoadFailed) -> None:
        self.push_screen(ErrorScreen("dflash-chat could not load the models", message.error))

    def on_prefill_progress(self, message: PrefillProgress) -> None:
        if self.generating:
            self._prefill = (message.done, message.total)
            self._refresh()

    async def on_cycle_update(self, message: CycleUpdate) -> None:
        d = message.response
        stats = self.reply_stats
        stats.add(d)
        self.conversation.add(d)
        if d.reasoning:
            if self._reasoning_stream is None:
                self._reasoning_stream = Markdown.get_stream(await self._reply.reasoning())
            self._reasoning_text += d.reasoning
            await self._reasoning_stream.write(d.reasoning)
        if d.text:
            self._reply_text += d.text
            await self._stream.write(d.text)
        self._refresh()
        self.query_one(Transcript).follow()

    async def on_reply_done(self, message: ReplyDone) -> None:
        await self._stream.stop()
        if self._reasoning_stream is not None:
            await self._reasoning_stream.stop()
        self.conversation.end_reply()
        stats = self.reply_stats
        stats.context_tokens = message.context_tokens
        stats.finish_reason = {"cancelled": f"stopped ({self._stop_key})", "error": "error"}.get(
            message.reason, message.reason
        )
        summary = stats.summary()
        self._reply.set_stats(summary, reasoning_words=len(self._reasoning_text.split()))
        if message.error:
            self._note(message.error, error=True)
        self._warn_context(message.context_tokens)
        if message.error and not self._reply_text and not self._reasoning_text:
            # Nothing came back: drop the turn and give the user their text back.
            await self._reply.remove()
            await self.query(UserMessage).last().remove()
            user = self.turns.pop()
            prompt = self.query_one(PromptInput)
            if not prompt.text:
                # The cursor at its end, so that what is typed next extends it rather than lands before it.
                prompt.load_text(user["content"])
                prompt.move_cursor(prompt.document.end)
        else:
            # The answer alone goes back to the template (gpt-oss's refuses a reply with its channels).
            turn = {"role": "assistant", "content": self._reply_text}
            if self._reasoning_text:
                turn["reasoning"] = self._reasoning_text
            # The settings this reply was generated with: /save names them under it.
            used = asdict(self._reply_settings.in_use(self._max_block()))
            self.turns.append({**turn, "stats": summary, "settings": used})
        self.generating, self._reply, self._stream = False, None, None
        self._reasoning_stream = None
        self._refresh()
        self.query_one(Transcript).follow()

    # ---- user input -------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def submit(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if not text.strip():
            return
        prompt = self.query_one(PromptInput)
        message = text
        if text.lstrip().startswith("//"):
            # "//" sends a message that starts with "/" (a path, say).
            message = text.replace("/", "", 1)
        elif text.lstrip().startswith("/"):
            await self.run_command(text, prompt)
            return
        if self.generating:
            self.notify("Still generating: press Esc to stop the reply first.", severity="warning")
            return
        problem = text_problem(message, "This message")
        if problem:
            self._note(problem, error=True)
            return
        if self.info is None:
            self.notify("The models are still loading; your message is kept.", severity="warning")
            return
        prompt.take(text)
        await self.send(message)

    async def send(self, text: str) -> None:
        """Add ``text`` as the user's turn and stream the reply."""
        transcript = self.query_one(Transcript)
        self.turns.append({"role": "user", "content": text})
        self._reply, self._reply_text = Reply(), ""
        self._reasoning_text, self._reasoning_stream = "", None
        await transcript.mount_all([UserMessage(text), self._reply])
        self._stream = Markdown.get_stream(self._reply.body)
        s = self._reply_settings = self.settings
        block = (_block(s.block_size) or self.info.max_block_size) if s.dflash else 1
        self.reply_stats = ReplyStats(dflash=s.dflash, block_size=block, peak_memory_known=self.info.peak_memory_known)
        self.generating, self._prefill = True, None
        self._replies += 1
        self._refresh()
        transcript.scroll_end(animate=False)
        messages = [{"role": t["role"], "content": t["content"]} for t in self.turns]
        self.generate_reply(messages, s)

    async def run_command(self, text: str, prompt: PromptInput) -> None:
        info = self.info
        command = parse_command(
            text.strip(),
            self.settings,
            max_block_size=info.max_block_size if info else None,
            has_draft=info.has_draft if info else True,
            switches=info.switches if info else None,
        )
        if command.action == "clear" and self.generating:
            self.notify("Stop the reply (Esc) before /clear.", severity="warning")
            return
        # A command that failed stays in the box, to be fixed rather than retyped.
        if command.action == "help":
            prompt.take(text)
            await self.query_one(Transcript).mount(HelpNote(HELP, classes="note"))
        elif command.action == "clear":
            prompt.take(text)
            await self.action_clear()
            return
        elif command.action == "save":
            try:
                path = save_transcript(
                    command.path, self.turns, self.settings, force=command.force, max_block_size=self._max_block()
                )
            except (OSError, ValueError) as e:
                self._note(f"Not saved: {e}", error=True)
            else:
                prompt.take(text)
                self._note(f"Saved {len(self.turns)} messages to {path}.")
        else:
            if command.ok:
                prompt.take(text)
                self.settings = command.settings
            self._note(command.message, error=not command.ok)
        self._refresh()
        self.query_one(Transcript).scroll_end(animate=False)

    def _warn_context(self, used: int | None) -> None:
        """Say when the next reply may run past the target's trained context, and what then."""
        limit = self.info.context_limit if self.info else None
        if not used or not limit or used + self.settings.max_tokens <= limit:
            return
        if used >= limit:
            what = f"This conversation ({used:,} tokens) is past the model's {limit:,}-token context"
        else:
            what = (f"This conversation holds {used:,} of the model's {limit:,} tokens of context; the next reply "
                    f"(up to {self.settings.max_tokens:,} tokens) may run past it")  # fmt: skip
        self._note(f"{what}. Past it the model works on positions it was not trained for and its answers degrade "
                   "(DFlash stays exact to it). /clear starts a new conversation.")  # fmt: skip

    def _note(self, text: str, error: bool = False) -> None:
        self.query_one(Transcript).mount(Note(text, error=error))

    # ---- actions ----------------------------------------------------------------------

    def action_stop(self, key: str = "Esc") -> None:
        if self.generating:
            self._stop_key = key
            self.workers.cancel_group(self, "generate")
            self.query_one("#state", Static).update("stopping…")

    def action_help_quit(self) -> None:
        # Ctrl+C (with no text selected to copy) stops a reply as Esc does; with none running it
        # keeps Textual's answer, a note that Ctrl+Q quits, so a reflexive second press loses nothing.
        if self.generating:
            self.action_stop("Ctrl+C")
        else:
            super().action_help_quit()

    async def action_clear(self) -> None:
        if self.generating:
            self.notify("Stop the reply (Esc) before clearing.", severity="warning")
            return
        self.turns.clear()
        self.conversation.clear()
        self.reply_stats = None
        await self.query_one(Transcript).remove_children()
        self._note("New conversation.")
        self.engine.reset()
        self._refresh()

    async def action_help(self) -> None:
        await self.query_one(Transcript).mount(HelpNote(HELP, classes="note"))
        self.query_one(Transcript).scroll_end(animate=False)

    def action_quit_with_error(self) -> None:
        self.exit(return_code=1)

    def _max_block(self) -> int | None:
        # What a block size of None means: the drafter's; the settings bar and /save both name it.
        return self.info.max_block_size if self.info else None

    def _refresh(self) -> None:
        info = self.info
        max_block = self._max_block()
        name = info.name if info else "loading…"
        mode = "" if info is None or info.chat_template else " · completion"
        self.query_one("#settings-bar", Static).update(f"{name}{mode} · {self.settings.describe(max_block)}")
        if info is None:
            state = "loading models…"
        else:
            state = "generating…" if self.generating else "ready"
            if self.generating and self.reply_stats is not None and not self.reply_stats.cycles:
                state = self._waiting()
            state += " · DFlash " + ("on" if self.settings.dflash else "off")
        # The scale stays the drafter's block size with DFlash off, so the history keeps its look.
        block = _block(self.settings.block_size) or max_block
        self.query_one(StatsPanel).show(state, self.reply_stats, self.conversation, block)

    def _waiting(self) -> str:
        # Before a reply's first token: a long prompt's prefill, or the first reply's one-time warm-up.
        if self._prefill is not None and self._prefill[1] > 1:
            done, total = self._prefill
            return f"prefilling {done:,}/{total:,} prompt tokens…"
        return "warming up (the first reply prepares the models)…" if self._replies == 1 else "prefilling…"


def _pair_sampling_note(temp: float, top_p: float) -> str:
    return (f"Sampling at temp {temp:g}, top-p {top_p:g}, as SmolLM2-135M-Instruct's model card does: greedy "
            "decoding makes this small model repeat itself. DFlash keeps the target's own distribution. "
            "/temp 0 decodes greedily.")  # fmt: skip


def _block(block_size: int | str | None) -> int | None:
    # "auto" verifies up to the drafter's block size, whose scale the panels keep.
    return None if block_size == "auto" else block_size


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="dflash-chat", description="Chat with a model in the terminal, with DFlash speculative decoding."
    )
    add_model_arguments(parser)
    add_blas_argument(parser)
    add_decoding_arguments(parser, max_tokens=512)
    parser.add_argument(
        "--top-p", type=float, action=InRange, low=0.0, high=1.0, default=None,
        help="Nucleus sampling threshold (default: 0, off; the default pair: 0.9 with --temp 0.2, as its model "
        "card samples, unless --temp or --top-p is given).",
    )  # fmt: skip
    # None: not given, so that the default pair can take its model card's sampling.
    parser.set_defaults(temp=None)
    parser.add_argument(
        "--base-url",
        default=None,
        help="Chat with an OpenAI-compatible server instead (dflash-serve, vLLM, SGLang, mlx_lm.server), "
        "e.g. http://host:8000/v1; --model then names the server's model.",
    )
    parser.add_argument("--api-key", default=None, help="The server's API key (with --base-url).")
    return parser


def make_app(
    model: str | None = None,
    draft: str | None = None,
    *,
    block_size: int | None = None,
    temp: float | None = None,
    top_p: float | None = None,
    max_tokens: int = 512,
    system_prompt: str | None = None,
    min_confidence: float = 0.0,
    confidence_threshold: float = 0.0,
    lookup_fallback: int = 0,
    tree_budget: int = 0,
    dtype: str | None = None,
    no_draft: bool = False,
    extra_eos_token: list[str] = (),
    chat_template_config: dict | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    datastore: str = "auto",
) -> ChatApp:
    """A ``ChatApp`` on the real models; they load in the background once the app starts.

    Args:
        model: Target folder, pair folder or Hugging Face id; None is the embedded default pair.
        draft: Drafter folder or Hugging Face id (see ``MLXEngine``).
        block_size: Tokens verified per cycle; None is the drafter's trained block size.
        temp: Sampling temperature (0 = greedy). None with ``top_p`` None: the default pair
          samples as its model card does (``DEFAULT_PAIR_SAMPLING``), anything else greedily.
        top_p: Nucleus sampling threshold (0 = off).
        max_tokens: The most tokens per reply.
        system_prompt: System message for the chat template.
        min_confidence: Verify only the drafter's confident leading drafts (0: the whole block).
        confidence_threshold: A DSpark drafter's confidence head: stop its drafts before the first
          whose predicted chance of acceptance is under this (0: the whole block).
        lookup_fallback: Draft up to this many cycles by prompt lookup after the drafter
          misses its first draft (0: never).
        tree_budget: Verify a draft tree of up to this many nodes a cycle (0: the drafter's path).
        dtype: Cast both models to this dtype (default: see ``dflash_mlx.load``).
        no_draft: Plain decoding, without the drafter.
        extra_eos_token: More tokens (text or ids) that end a reply.
        chat_template_config: Keyword arguments for ``apply_chat_template``.
        base_url: Chat with this OpenAI-compatible server instead; ``model`` names its model.
        api_key: The server's API key.
        datastore: Draft from the target's past text: ``"auto"``, ``"none"`` or a response cache
          file (``--datastore``).

    Returns:
        ChatApp: Call ``.run()`` on it.
    """
    from ..loading.pairs import DEFAULT_PAIR_SAMPLING, is_default_pair

    note = None
    if temp is None and top_p is None and not base_url and is_default_pair(model):
        temp, top_p = DEFAULT_PAIR_SAMPLING["temp"], DEFAULT_PAIR_SAMPLING["top_p"]
        note = _pair_sampling_note(temp, top_p)
    settings = Settings(
        block_size=block_size,
        temp=temp or 0.0,
        top_p=top_p or 0.0,
        max_tokens=max_tokens,
        system_prompt=system_prompt,
        min_confidence=min_confidence,
        confidence_threshold=confidence_threshold,
        lookup_fallback=lookup_fallback,
        tree_budget=tree_budget,
    )
    if base_url:
        # Known once the server names its model: the default pair is sampled as it is locally.
        pair_sampling = DEFAULT_PAIR_SAMPLING if temp is None and top_p is None else None
        engine = RemoteEngine(base_url, api_key=api_key, model=model)
        return ChatApp(engine, settings=settings, note=note, pair_sampling=pair_sampling)
    from ..tuning.policy import PolicyStore

    engine = MLXEngine(
        model, draft, dtype=dtype, no_draft=no_draft, extra_eos_token=extra_eos_token,
        chat_template_config=chat_template_config, policy_store=PolicyStore(), datastore=datastore,
    )  # fmt: skip
    return ChatApp(engine, settings=settings, note=note)


def _prepare_embedded_pair(model: str | None, datastore: str = "auto") -> None:
    """Convert the default pair's target and index its datastore now, on the plain terminal where
    their one-time progress lines show, rather than inside the app, which hides stderr."""
    from ..loading.pairs import is_embedded_pair

    if not is_embedded_pair(model):
        return
    import json

    from ..loading.pairs import DEFAULT_PAIR, embedded_pair
    from ..tools.session import open_datastore

    try:
        target, _ = embedded_pair(model or DEFAULT_PAIR)
        open_datastore(datastore, model, json.loads((target / "config.json").read_text())["vocab_size"])
    except DFlashError as e:
        print(f"dflash-chat: error: {e}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    local = (args.draft, args.no_draft, args.dtype, args.extra_eos_token, args.chat_template_config is not None)
    if args.base_url and any(local):
        parser.error(
            "--draft, --no-draft, --dtype, --extra-eos-token and --chat-template-config apply to local models; "
            "with --base-url the server has its own."
        )
    if not args.base_url:
        _prepare_embedded_pair(args.model, args.datastore)
    kwargs = vars(args)
    kwargs.pop("blas")  # used by the console script before anything loaded
    app = make_app(**kwargs)
    try:
        app.run()
    finally:
        app.engine.close()
    sys.exit(app.return_code or 0)


if __name__ == "__main__":
    main()
