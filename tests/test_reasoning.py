"""A reply's reasoning apart from its answer: the parsers on text cut at every position, the
format a tokenizer gets, stream_generate and dflash-generate on a target scripted to answer in
harmony, and the chat templates' thinking switches (gpt-oss's reasoning_effort, Gemma 4's
enable_thinking with a system prompt)."""

import importlib
from types import SimpleNamespace

import pytest
from helpers.chat_formats import (
    ScriptedReply,
    token_ids,
    with_tokenizer,
    write_gemma_tokenizer,
    write_harmony_tokenizer,
    write_think_tokenizer,
)
from mlx_lm.utils import load_tokenizer

from dflash_mlx import load, stream_generate
from dflash_mlx.text.chat_template import render_chat, template_switches
from dflash_mlx.text.reasoning import ANSWER, REASONING, HarmonyParser, TagParser, join, reasoning_parser
from dflash_mlx.tui.commands import Settings
from dflash_mlx.tui.engine import MLXEngine

HARMONY = (
    "<|channel|>analysis<|message|>The user wants <|e a sum. 1+2=3.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is **3**.<|return|>"
)
HARMONY_SPLIT = ("It is **3**.", "The user wants <|e a sum. 1+2=3.Checking.")
# The reply the scripted target gives, token by token (the tiny tokenizer's words).
SCRIPT = ("<|channel|> analysis <|message|> t5 t6 <|end|> <|start|> assistant <|channel|> final <|message|> "
          "t7 t8 t9 <|return|>")  # fmt: skip
TURNS = [{"role": "user", "content": "t1"}, {"role": "assistant", "content": "t2"}, {"role": "user", "content": "t3"}]
THINK = lambda: TagParser("<think>", "</think>")  # noqa: E731


def _run(parser, text: str, cuts: tuple[int, ...]) -> list[tuple[str, str]]:
    pieces, start = [], 0
    for cut in (*cuts, len(text)):
        pieces += parser.feed(text[start:cut])
        start = cut
    return pieces + parser.flush()


def _every_split(make, text: str, expected: tuple[str, str]) -> None:
    """``text`` fed in two and in three pieces, cut at every position, parses as in one."""
    assert join(_run(make(), text, ())) == expected
    for i in range(len(text) + 1):
        assert join(_run(make(), text, (i,))) == expected, i
        for j in range(i, len(text) + 1, 3):
            pieces = _run(make(), text, (i, j))
            assert join(pieces) == expected, (i, j)
            assert all(channel in (ANSWER, REASONING) and text for channel, text in pieces)


def test_harmony_channels_split_at_every_position():
    _every_split(
        lambda: HarmonyParser.after_prompt("<|start|>user<|message|>hi<|end|><|start|>assistant"),
        HARMONY,
        HARMONY_SPLIT,
    )


def test_harmony_streams_each_piece_as_soon_as_it_is_known():
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|mess") == []
    assert parser.feed("age|>Think") == [(REASONING, "Think")]
    assert parser.feed("ing<|e") == [(REASONING, "ing")]  # "<|e" may start <|end|>: held back
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>A") == [(ANSWER, "A")]
    assert parser.feed("<|e") == [] and parser.flush() == [(ANSWER, "<|e")]


@pytest.mark.parametrize(
    "prompt_tail, text, expected",
    [
        # Not harmony after all: a short reply, and one longer than any header.
        ("<|start|>assistant", "Hello there.", ("Hello there.", "")),
        ("<|start|>assistant", "x" * 300, ("x" * 300, "")),
        # The prompt opened the final channel itself.
        ("<|start|>assistant<|channel|>final<|message|>", "Right away.", ("Right away.", "")),
        # A header cut off by the token limit is dropped.
        ("<|start|>assistant", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fi", ("", "Hm.")),
        # A second header without its <|start|>, and stray text between messages: shown, not lost.
        ("<|start|>assistant", "<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>b", ("b", "a")),
        ("<|start|>assistant", "<|channel|>analysis<|message|>a<|end|> stray", ("stray", "a")),
        # A tool call's arguments (commentary, to a recipient) are not the answer.
        (
            "<|start|>assistant",
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
            ("", "{}"),
        ),
    ],
)
def test_harmony_edge_cases(prompt_tail, text, expected):
    _every_split(lambda: HarmonyParser.after_prompt(prompt_tail), text, expected)


@pytest.mark.parametrize(
    "make, text, expected",
    [
        (THINK, "\n<think>\nLet me see.\n</think>\n\nYes.", ("Yes.", "Let me see.\n")),
        # The template opened <think> in the prompt (Qwen3-Thinking, DeepSeek-R1).
        (
            lambda: TagParser("<think>", "</think>", thinking=True),
            "Hm </thin k>.</think>\n\nNo.",
            ("No.", "Hm </thin k>."),
        ),
        # Only a reply that starts with the tag opens it.
        (THINK, "Use <think> tags.", ("Use <think> tags.", "")),
        (THINK, "  \n ", ("", "")),
        # Cut off while thinking: all of it is reasoning.
        (THINK, "<think>still going", ("", "still going")),
        # Gemma 4's thought channel.
        (
            lambda: TagParser("<|channel>thought", "<channel|>"),
            "<|channel>thought\nPlan.<channel|>Done.",
            ("Done.", "Plan."),
        ),
    ],
)
def test_think_tags_split_at_every_position(make, text, expected):
    _every_split(make, text, expected)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-formats")
    out = {}
    for name, write in (("harmony", write_harmony_tokenizer), ("gemma", write_gemma_tokenizer),
                        ("think", write_think_tokenizer)):  # fmt: skip
        write(root / name)
        out[name] = load_tokenizer(root / name, eos_token_ids=126)
    return out


def test_the_tokenizer_names_the_format_and_the_prompt_where_the_reply_starts(tokenizers, qwen3_pair):
    chat = [{"role": "user", "content": "t1 t2"}]
    assert reasoning_parser(qwen3_pair[2], [1, 2, 3]) is None  # no reasoning format: the whole reply is the answer
    harmony = reasoning_parser(tokenizers["harmony"], render_chat(tokenizers["harmony"], chat))
    assert isinstance(harmony, HarmonyParser) and harmony.state == "header"
    gemma = reasoning_parser(tokenizers["gemma"], render_chat(tokenizers["gemma"], chat))
    assert isinstance(gemma, TagParser) and (gemma.open_tag, gemma.close_tag) == ("<|channel>thought", "<channel|>")
    think = tokenizers["think"]
    on = reasoning_parser(think, render_chat(think, chat))
    off = reasoning_parser(think, render_chat(think, chat, template_args={"enable_thinking": False}))
    opened = reasoning_parser(think, render_chat(think, chat) + token_ids(think, "<think>"))
    assert (on.open_tag, on.thinking, off.thinking, opened.thinking) == ("<think>", False, False, True)
    assert join(off.feed("t5 <think>") + off.flush()) == ("t5 <think>", "")


def test_the_templates_thinking_switches(tokenizers):
    assert template_switches(tokenizers["harmony"]) == {"reasoning_effort"}
    assert template_switches(tokenizers["gemma"]) == {"enable_thinking"}
    assert template_switches(tokenizers["think"]) == {"enable_thinking"}


def test_gemma_system_prompt_and_enable_thinking_reach_the_template(tokenizers):
    tok = tokenizers["gemma"]

    def prompt(**kwargs) -> str:
        return tok.decode(render_chat(tok, TURNS, **kwargs))

    thinking, plain = "<|turn>system<|think|>t9t8<turn|>", "<|turn>systemt9t8<turn|>"
    rest = "<|turn>usert1<turn|><|turn>modelt2<turn|><|turn>usert3<turn|><|turn>model"
    assert prompt(system_prompt="t9 t8", template_args={"enable_thinking": True}) == thinking + rest
    assert prompt(system_prompt="t9 t8", template_args={"enable_thinking": False}) == plain + rest
    assert prompt(template_args={"enable_thinking": False}) == rest
    # The chat app's /think and --chat-template-config reach it the same way, /think winning.
    engine = MLXEngine(chat_template_config={"enable_thinking": True})
    engine.session = SimpleNamespace(tokenizer=tok)  # a loaded pair's tokenizer, nothing loaded
    assert tok.decode(engine._prompt(TURNS, Settings(system_prompt="t9 t8", thinking=False))) == plain + rest
    assert tok.decode(engine._prompt(TURNS, Settings(system_prompt="t9 t8"))) == thinking + rest


def test_harmony_reasoning_effort_reaches_the_template(tokenizers):
    tok = tokenizers["harmony"]
    text = tok.decode(render_chat(tok, TURNS, system_prompt="t9", template_args={"reasoning_effort": "high"}))
    assert text == ("<|start|>system<|message|>Reasoning:high<|end|><|start|>developer<|message|>t9<|end|>"
                    "<|start|>user<|message|>t1<|end|><|start|>assistant<|channel|>final<|message|>t2<|end|>"
                    "<|start|>user<|message|>t3<|end|><|start|>assistant")  # fmt: skip
    engine = MLXEngine()
    engine.session = SimpleNamespace(tokenizer=tok)  # a loaded pair's tokenizer, nothing loaded
    assert "Reasoning:low" in tok.decode(engine._prompt(TURNS, Settings(reasoning_effort="low")))


@pytest.fixture(scope="module")
def harmony_pair(pair_dirs, tmp_path_factory):
    target = with_tokenizer(pair_dirs["qwen3-tied"], tmp_path_factory.mktemp("harmony") / "target",
                            write_harmony_tokenizer)  # fmt: skip
    return target, load(target, pair_dirs["draft"])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_stream_generate_splits_a_scripted_harmony_reply(harmony_pair, block_size):
    _, (model, draft, tokenizer) = harmony_pair
    prompt = render_chat(tokenizer, [{"role": "user", "content": "t1 t2"}])
    script = token_ids(tokenizer, SCRIPT)

    def responses(parse):
        # Not adaptive: its timed choices would group the two runs' tokens into cycles differently.
        return list(stream_generate(model, draft, tokenizer, prompt, max_tokens=64, block_size=block_size,
                                    logits_processors=[ScriptedReply(script)], parse_reasoning=parse,
                                    adaptive=False))  # fmt: skip

    raw = responses(False)
    assert "".join(r.text for r in raw) == tokenizer.decode(script[:-1]) and raw[-1].finish_reason == "stop"
    split = responses(True)
    assert "".join(r.text for r in split) == "t7t8t9" and "".join(r.reasoning for r in split) == "t5t6"
    assert [r.tokens for r in split] == [r.tokens for r in raw]
    # The reasoning streams before the answer starts, piece by piece.
    first_answer = next(i for i, r in enumerate(split) if r.text)
    assert all(not r.reasoning for r in split[first_answer:]) and "".join(r.reasoning for r in split[:first_answer])


def test_dflash_generate_prints_the_reasoning_apart_or_hides_it(harmony_pair, pair_dirs, monkeypatch, capsys):
    target, (_, _, tokenizer) = harmony_pair
    script = token_ids(tokenizer, SCRIPT)
    generate_module = importlib.import_module("dflash_mlx.tools.cli.generate")
    monkeypatch.setattr(generate_module, "make_logits_processors", lambda **_: [ScriptedReply(script)])
    argv = ["--model", str(target), "--draft", str(pair_dirs["draft"]), "--prompt", "t1 t2", "-m", "32"]
    generate_module.main(argv)
    out = capsys.readouterr().out
    assert "==========\nReasoning:\nt5t6\n----------\nt7t8t9\n==========" in out
    generate_module.main([*argv, "--hide-reasoning"])
    out = capsys.readouterr().out
    assert "==========\nt7t8t9\n==========" in out and "t5t6" not in out and "Reasoning" not in out
    generate_module.main([*argv, "--verbose", "F"])
    assert capsys.readouterr().out == "t7t8t9\n"
    # Without the chat template the text is left as it came, markers and all.
    generate_module.main([*argv, "--verbose", "F", "--ignore-chat-template"])
    assert capsys.readouterr().out == tokenizer.decode(script[:-1]) + "\n"
