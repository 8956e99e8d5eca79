"""What a new user meets first: text that is not UTF-8, the Python path's BLAS, the verbose stats, the chat's
defaults, the first conversion of the default pair, `make chat`."""

import io
import logging
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.snapshot_app import FakeStream, wait_until

from dflash_mlx import DFlashError, generate, stream_generate
from dflash_mlx.cpu import openblas as blas
from dflash_mlx.text.inputs import check_text, decode_utf8, text_problem
from dflash_mlx.tools.cli import generate as cli_generate
from dflash_mlx.tuning.policy import PolicyState

REPO = Path(__file__).resolve().parents[1]
DEBIAN = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


# ---- text that is not UTF-8 -------------------------------------------------------------------


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


@pytest.mark.parametrize("data, byte", [(b"caf\xe9", "0xe9"), (bytes(range(256)), "0x80")])
def test_stdin_that_is_not_utf8_is_one_line(monkeypatch, capsys, data, byte):
    _stdin(monkeypatch, data)
    with pytest.raises(SystemExit) as e:
        cli_generate.main(["--prompt", "-"])  # refused before anything loads
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"dflash-generate: error: stdin is not UTF-8 text: byte {byte} at offset ")
    assert "Traceback" not in err and "TextEncodeInput" not in err


def test_a_prompt_argument_with_a_byte_that_is_not_utf8_is_one_line(capsys):
    # How Python hands over a command line byte that is not UTF-8 (surrogateescape).
    with pytest.raises(SystemExit):
        cli_generate.main(["--prompt", "caf\udce9"])
    err = capsys.readouterr().err
    assert err == ("dflash-generate: error: --prompt is not valid UTF-8 text: it has the byte 0xe9, which is not "
                   "UTF-8, at character 3. Pass text in UTF-8.\n")  # fmt: skip


def test_stdin_in_utf8_is_read_as_is(monkeypatch, pair_dirs, capsys):
    _stdin(monkeypatch, "t1 t2 café\n".encode())
    cli_generate.main(["--model", str(pair_dirs["qwen3-tied"]), "--no-draft", "--prompt", "-", "-m", "2",
                       "--verbose", "F", "--ignore-chat-template"])  # fmt: skip
    assert capsys.readouterr().err == ""


def test_an_empty_stdin_is_named_as_stdin(monkeypatch, capsys):
    _stdin(monkeypatch, b"")
    with pytest.raises(SystemExit) as e:
        cli_generate.main(["--prompt", "-"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (
        "dflash-generate: error: --prompt - read nothing: stdin was empty; pipe or type at least one character.\n"
    )


def test_the_python_api_refuses_a_lone_surrogate_in_one_line(qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    with pytest.raises(DFlashError) as e:
        next(stream_generate(model, draft, tokenizer, "\ud800", max_tokens=2))
    assert str(e.value) == ("The prompt is not valid UTF-8 text: it has an unpaired surrogate '\\ud800' at character "
                            "0. Pass text in UTF-8.")  # fmt: skip


def test_text_checks():
    assert text_problem("café 🙂") is None and check_text("ok") is None
    assert decode_utf8("é".encode()) == "é"
    with pytest.raises(DFlashError, match=r"^stdin is not UTF-8 text: byte 0xff at offset 2 "):
        decode_utf8(b"ab\xff")


async def test_the_chat_refuses_a_message_that_is_not_utf8():
    from dflash_mlx.tui.app import ChatApp
    from dflash_mlx.tui.widgets import Note, PromptInput

    fake = FakeStream()
    app = ChatApp(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.info is not None)
        app.query_one(PromptInput).load_text("caf\udce9")
        await pilot.press("enter")
        await pilot.pause()
        assert not fake.calls and not app.turns
        assert any("This message is not valid UTF-8 text" in str(n.render()) for n in app.query(Note))


# ---- the Python path on Linux: a fast BLAS ------------------------------------------------------


@pytest.mark.parametrize(
    "platform, in_use, installed, warned",
    [
        ("linux", "reference BLAS bundled with MLX (libblas.so.3)", DEBIAN, True),
        ("linux", "OpenBLAS 0.3.21 (preloaded), core Haswell (detected)", DEBIAN, False),
        ("darwin", "Accelerate", None, False),
    ],
)
def test_python_on_the_reference_blas_is_told_once_how_to_start_with_openblas(
    monkeypatch, caplog, platform, in_use, installed, warned
):
    monkeypatch.setattr(blas, "_noted", False)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(blas, "blas_in_use", lambda: in_use)
    monkeypatch.setattr(blas, "find_openblas", lambda: installed)
    monkeypatch.setattr(blas.mkl, "find_mkl", lambda: None)
    monkeypatch.setattr(sys, "argv", ["chat_bot.py"])
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        blas.note_reference_blas()
        blas.note_reference_blas()
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == (1 if warned else 0)
    if warned:
        assert "\n" not in notes[0]
        assert (
            "run python -m dflash_mlx.cpu.openblas python chat_bot.py" in notes[0]
            and f"LD_PRELOAD={DEBIAN}" in notes[0]
        )


def test_a_tool_run_with_blas_bundled_is_not_told_to_restart(monkeypatch, caplog):
    monkeypatch.setattr(blas, "_noted", False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "blas_in_use", lambda: "reference BLAS bundled with MLX (libblas.so.3)")
    monkeypatch.setattr(blas, "find_openblas", lambda: DEBIAN)
    blas.use_fast_blas("dflash-generate", "bundled", environ={}, execv=lambda *a: pytest.fail("restarted"))
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        blas.note_reference_blas()
    assert not caplog.records


def test_readme_says_how_to_run_a_python_script_with_openblas():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use it from Python") :]
    section = section[: section.index("\n## ")]
    assert "python -m dflash_mlx.cpu.openblas python script.py" in section


# ---- dflash-generate --verbose and its statistics ----------------------------------------------


def test_verbose_is_a_flag_and_still_takes_its_words():
    parser = cli_generate.setup_arg_parser()
    assert parser.parse_args(["--verbose"]).verbose is True
    assert parser.parse_args(["--verbose", "--prompt", "x"]).verbose is True
    assert parser.parse_args(["--verbose", "F"]).verbose is False and parser.parse_args([]).verbose is True
    assert "tau = tokens per drafting cycle" in " ".join(parser.format_help().split())


def _stats(out: str) -> list[str]:
    return out.split("==========")[-1].strip().splitlines()


def test_a_rate_saved_by_an_earlier_run_is_not_shown_as_this_runs(qwen3_pair, capsys):
    model, draft, tokenizer = qwen3_pair
    # An earlier run found drafting slow and set a run of plain cycles: this run drafts nothing.
    saved = {"plain_time": 0.01, "draft_time": 0.05, "plain_left": 200, "run": 256}
    policy = PolicyState.restored(saved, lookup=0)  # paused cycles: plain steps (no lookup drafts)
    generate(model, draft, tokenizer, [5, 6, 7], max_tokens=9, block_size=4, verbose=True, policy=policy)
    stats = _stats(capsys.readouterr().out)
    assert "Acceptance length: no drafting cycles; 8 plain" in stats
    (line,) = [x for x in stats if x.startswith("Drafting:")]
    assert line.startswith("Drafting: 20.000 tokens-per-sec (measured by an earlier run), ")
    assert re.search(r"\(\d+\.\d{3} measured; 8 cycles decoded plainly\)", line)  # plain: timed in this run
    # And it says plainly that the drafter was paused, and why.
    (paused,) = [x for x in stats if x.startswith("Drafter paused")]
    assert paused.startswith("Drafter paused for 8 cycles of this run: an earlier run measured drafting at 20.0 ")


def test_an_earlier_runs_pause_is_re_checked_within_one_window(qwen3_pair, capsys):
    # A drafting speed timed on a busy machine must not pause the drafter of later runs for long:
    # the carried pause is cut to one window, then this run times the drafter itself.
    model, draft, tokenizer = qwen3_pair
    saved = {"plain_time": 0.01, "draft_time": 0.64, "plain_left": 272, "run": 256}
    policy = PolicyState.restored(saved, lookup=0)
    assert policy.plain_left == policy.window
    generate(model, draft, tokenizer, [5, 6, 7], max_tokens=40, block_size=4, verbose=True, policy=policy)
    stats = _stats(capsys.readouterr().out)
    assert "no drafting cycles" not in " ".join(stats)  # it drafted again after the window
    (line,) = [x for x in stats if x.startswith("Drafting:")]
    assert "(measured by an earlier run)" not in line.split(",")[0]  # and timed the drafter itself
    assert any(x.startswith("Drafter paused for ") for x in stats), stats


def test_tau_is_explained_where_it_is_printed(qwen3_pair, capsys):
    model, draft, tokenizer = qwen3_pair
    generate(model, draft, tokenizer, [5, 6, 7], max_tokens=12, block_size=4, verbose=True, adaptive=False)
    (line,) = [x for x in _stats(capsys.readouterr().out) if x.startswith("Acceptance length:")]
    assert line.startswith("Acceptance length: tau ") and line.endswith(" (tau = tokens per drafting cycle)")


# ---- the chat's default decoding ---------------------------------------------------------------


def test_the_chat_samples_the_default_pair_as_its_model_card_does():
    from dflash_mlx.tui.app import make_app, setup_arg_parser

    assert setup_arg_parser().parse_args([]).temp is None  # so that "not given" is known
    app = make_app(None)
    app.engine.close()
    assert (app.settings.temp, app.settings.top_p) == (0.2, 0.9)
    assert "temp 0.2, top-p 0.9" in app.note and "/temp 0" in app.note
    for kwargs in ({"temp": 0.0}, {"top_p": 0.5}, {"model": "dflash-tiny"}):
        other = make_app(**{"model": None, **kwargs})
        other.engine.close()
        assert other.note is None and other.settings.temp == kwargs.get("temp", 0.0)


async def test_the_chat_shows_its_default_decoding():
    from dflash_mlx.tui.app import make_app
    from dflash_mlx.tui.engine import StreamEngine
    from dflash_mlx.tui.widgets import Note

    app = make_app(None)
    app.engine.close()
    fake = FakeStream()
    app.engine = StreamEngine(fake)  # no model runs here
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.info is not None)
        assert "temp 0.2 · top-p 0.9" in str(app.query_one("#settings-bar").render())
        assert any("as SmolLM2-135M-Instruct's model card does" in str(n.render()) for n in app.query(Note))
        await pilot.press(*"hi", "enter")
        await app.workers.wait_for_complete()
        assert fake.calls[0][1].temp == 0.2 and fake.calls[0][1].top_p == 0.9


# ---- the first use of the default pair, and make chat ------------------------------------------


def test_the_first_conversion_says_where_it_writes_and_how_much(monkeypatch, tmp_path, capsys):
    from dflash_mlx.loading import gguf

    src = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setattr(gguf, "smollm2_gguf", lambda: src)
    weights = {"w": mx.zeros((1000, 1000), dtype=mx.float32), "b": mx.zeros((250_000,), dtype=mx.float32)}
    monkeypatch.setattr(gguf, "_convert", lambda path, dtype: ({}, weights, None, None))
    monkeypatch.setattr(gguf, "_write", lambda folder, *parts: (folder / "config.json").write_text("{}"))
    dest = gguf.prepare_default_target(tmp_path / "cache")
    err = capsys.readouterr().err
    assert err == f"dflash-mlx: converting {src.name} once into {dest} (5 MB; later runs reuse it)\n"
    assert gguf.prepare_default_target(tmp_path / "cache") == dest and capsys.readouterr().err == ""


def test_make_chat_installs_quietly():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("$(VENV)/.chat:") :].split("\n\n")[0]
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    # setuptools' editable-install banner comes through pip -q: the output goes to a log, shown on failure.
    assert installs and all("> $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }" in x for x in installs)


def test_a_long_prompts_prefill_reports_its_progress(qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    seen = []
    prompt = [5 + i % 50 for i in range(300)]
    text = generate(model, draft, tokenizer, prompt, max_tokens=4, block_size=4, prefill_step_size=128,
                    prompt_progress_callback=lambda done, total: seen.append((done, total)))  # fmt: skip
    assert seen == [(128, 300), (256, 300), (300, 300)]
    assert text == generate(model, draft, tokenizer, prompt, max_tokens=4, block_size=4, prefill_step_size=128)


def test_dflash_generate_draws_a_bar_for_a_long_prompts_prefill(pair_dirs, capsys):
    argv = ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--max-tokens", "2",
            "--ignore-chat-template"]  # fmt: skip
    cli_generate.main([*argv, "--prompt", " ".join(f"t{i % 9}" for i in range(1500))])
    err = capsys.readouterr().err
    done = re.search(r"\] (\d+)/(\d+) prompt tokens prefilled", err.splitlines()[-1])
    assert done and done[1] == done[2] and int(done[1]) >= 1024, err
    cli_generate.main([*argv, "--prompt", "t1 t2"])  # a short prompt: no bar
    assert "prefilled" not in capsys.readouterr().err


@pytest.mark.parametrize("served", ["smollm2-135m-instruct", "Qwen/Qwen3-8B"])
async def test_a_chat_with_a_server_samples_its_default_pair_as_locally_and_has_no_peak_memory(served):
    from dflash_mlx.tui.app import make_app
    from dflash_mlx.tui.widgets import Reply

    class Served(FakeStream):  # what RemoteEngine.load says of a server and its model
        def load(self):
            from dflash_mlx.loading.pairs import is_default_pair

            return {"name": f"{served} @ server", "has_draft": True, "max_block_size": 16, "chat_template": True,
                    "peak_memory_known": False, "default_pair": is_default_pair(served)}  # fmt: skip

        def reset(self):
            pass

    app = make_app(None, base_url="http://127.0.0.1:9/v1")
    app.engine = engine = Served()
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.info is not None)
        app.query_one("#prompt").load_text("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.generating and app.turns)
        await pilot.pause()
        sampled = served == "smollm2-135m-instruct"
        assert (engine.calls[0][1].temp, engine.calls[0][1].top_p) == ((0.2, 0.9) if sampled else (0.0, 0.0))
        assert f"peak mem    {'n/a':>6}" in str(app.query_one("#live").render())
        stats = str(app.query_one(Reply).query_one(".reply-stats").render())
        assert "peak n/a" in stats and "GB" not in stats


def test_draft_takes_the_embedded_pairs_names_as_model_does(capsys):
    from dflash_mlx.loading.pairs import default_pair_draft, embedded_pair_path, name_pair

    assert name_pair("Some/target", "smollm2").draft == default_pair_draft()
    assert name_pair("Some/target", "SmolLM2-135M-Instruct").draft == default_pair_draft()
    cli_generate.main(["--model", "dflash-tiny", "--draft", "dflash-tiny", "--prompt", "hi", "-m", "3"])
    out = capsys.readouterr().out
    assert f"Drafter: {embedded_pair_path('dflash-tiny') / 'draft'}" in out and "Acceptance length:" in out
