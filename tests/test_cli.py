import subprocess
import sys

import pytest

from dflash_mlx.kernels.dispatch import on_metal
from dflash_mlx.tools.cli.generate import main


def test_help_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.tools.cli.generate", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    for flag in ("--model", "--draft", "--prompt", "--max-tokens", "--block-size", "--temp", "--system-prompt",
                 "--kernels"):  # fmt: skip
        assert flag in out.stdout


def test_generates_with_a_pair(pair_dirs, capsys):
    main(
        [
            "--model",
            str(pair_dirs["qwen3-tied"]),
            "--draft",
            str(pair_dirs["draft"]),
            "--prompt",
            "t1 t2 t3",
            "--max-tokens",
            "12",
            "--block-size",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "Generation:" in out and "Acceptance length:" in out


def test_verbose_names_the_target_and_drafter_loaded(pair_dirs, capsys):
    target, draft = str(pair_dirs["qwen3-tied"]), str(pair_dirs["draft"])
    main(["--model", target, "--draft", draft, "--prompt", "t1 t2", "--max-tokens", "4", "--block-size", "4"])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"Target: {target}", f"Drafter: {draft}"]
    main(["--model", target, "--no-draft", "--prompt", "t1 t2", "--max-tokens", "4"])
    assert capsys.readouterr().out.splitlines()[:2] == [f"Target: {target}", "Drafter: none (plain decoding)"]


def test_a_gguf_file_as_the_model_names_dflash_convert(tmp_path, capsys):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(gguf), "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err
    assert f"is a GGUF file; convert it first with dflash-convert --hf-path {gguf} --mlx-path FOLDER" in err


OPTIONS = [["--min-confidence", "0.05"], ["--lookup-fallback", "4"], ["--adaptive", "false"], ["--adaptive", "True"],
           ["--kernels", "off"], ["--tree-budget", "8"], ["--tree-budget", "auto"]]  # fmt: skip


@pytest.mark.parametrize("option", OPTIONS)
def test_cycle_options_same_text(pair_dirs, capsys, option):
    base = ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]),
            "--prompt", "t1 t2 t3", "--max-tokens", "20", "--verbose", "false"]  # fmt: skip
    main(base)
    plain = capsys.readouterr().out
    main([*base, *option])
    assert capsys.readouterr().out == plain and plain.strip()


def test_bad_lookup_fallback_is_one_line(pair_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--lookup-fallback", "-1"])
    err = capsys.readouterr().err.strip()
    assert err == "dflash-generate: error: --lookup-fallback must be at least 0 (got -1)."


def test_bad_adaptive_value_is_refused(pair_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--adaptive", "maybe"])
    assert "--adaptive: expected true or false (got 'maybe')" in capsys.readouterr().err


def test_bad_min_confidence_is_one_line(pair_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--min-confidence", "2"])
    err = capsys.readouterr().err.strip()
    assert err == "dflash-generate: error: --min-confidence must be from 0 to 1 (got 2)."


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be at least 1 (got 0)"),
        (["--temp", "-1"], "--temp must be from 0 to 10 (got -1)"),
        (["--block-size", "x"], "'x' is not a block size: pass an integer or 'auto'"),
        (["--seed", "-1"], "--seed must be from 0 to 18446744073709551615 (got -1)"),
        (["--seed", str(2**64)], f"--seed must be from 0 to 18446744073709551615 (got {2**64})"),
    ],
)
def test_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_model_gives_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1
    assert err.startswith("dflash-generate: error: No config.json in") and "\n" not in err


def test_block_size_out_of_range_is_one_line(pair_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--block-size", "40"])
    err = capsys.readouterr().err
    assert err == "dflash-generate: error: --block-size must be from 1 to the drafter's block size 16 (got 40).\n"


@pytest.mark.skipif(on_metal(), reason="off Metal only: on a Mac --kernels on runs the kernels")
def test_kernels_on_without_metal_is_one_line(pair_dirs, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--kernels", "on"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith("dflash-generate: error: kernels 'on' needs a Metal device (an Apple GPU)")


def test_unknown_target_without_drafter_says_plain_decoding(pair_dirs, capsys):
    main(["--model", str(pair_dirs["qwen3-tied"]), "--prompt", "t1 t2", "--max-tokens", "3"])
    assert "plain decoding (pass --draft for DFlash)" in capsys.readouterr().err


# ---- the flags as mlx_lm generate has them, checked where they are parsed ----------------------


def _pair_args(pair_dirs, *argv):
    return ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), *argv]


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--block-size", "0"], "--block-size must be at least 1 (got 0)."),
        (["--repetition-penalty", "-1"], "--repetition-penalty must be greater than 0 (got -1)."),
        (["--temp", "nan"], "--temp must be from 0 to 10 (got nan)."),
        (["--max-kv-size", "0"], "--max-kv-size must be at least 1 (got 0)."),
        (["--verbose", "yes"], "argument --verbose: expected True/T or False/F (got 'yes')"),
        (["--chat-template-config", "[1]"], "argument --chat-template-config: must be a JSON object"),
        (["--prompt", ""], "--prompt is empty: pass at least one character."),
    ],
)
def test_bad_values_are_one_line_naming_the_flag_before_any_output(pair_dirs, capsys, argv, line):
    code, out, err = _run(_pair_args(pair_dirs, *argv), capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"dflash-generate: error: {line}") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--block-size", "99"], "--block-size must be from 1 to the drafter's block size 16 (got 99)."),
        (["--no-draft", "--block-size", "4"], "--block-size 4 needs a drafter, but none is loaded"),
        (["--extra-eos-token", "nope"], "--extra-eos-token 'nope' is not a token of this tokenizer"),
        (["--max-kv-size", "64"], "--max-kv-size needs plain decoding (--no-draft)"),
    ],
)
def test_values_the_pair_cannot_take_are_one_line_before_any_output(pair_dirs, capsys, argv, line):
    code, out, err = _run(_pair_args(pair_dirs, *argv), capsys)
    assert code == 1 and out == ""
    assert err.startswith(f"dflash-generate: error: {line}") and err.count("\n") == 1


@pytest.mark.parametrize("word, verbose", [("T", True), ("True", True), ("true", True), ("F", False), ("False", False)])
def test_verbose_reads_the_words_mlx_lm_documents(pair_dirs, capsys, word, verbose):
    from mlx_lm.generate import str2bool as mlx_lm_str2bool

    from dflash_mlx.tools.cli.options import str2bool

    assert str2bool(word) is mlx_lm_str2bool(word) is verbose
    code, out, _ = _run(_pair_args(pair_dirs, "--prompt", "t1 t2", "--max-tokens", "4", "--verbose", word), capsys)
    assert code == 0 and ("Generation:" in out) is verbose


def test_draft_model_is_another_name_for_draft(pair_dirs, capsys):
    argv = ["--model", str(pair_dirs["qwen3-tied"]), "--prompt", "t1 t2", "-m", "12", "--verbose", "F"]
    _, with_draft, _ = _run([*argv, "--draft", str(pair_dirs["draft"])], capsys)
    code, with_draft_model, err = _run([*argv, "--draft-model", str(pair_dirs["draft"])], capsys)
    assert code == 0 and with_draft_model == with_draft and with_draft.strip()
    assert "plain decoding" not in err


def test_extra_eos_token_ends_the_text_at_that_token(pair_dirs, capsys):
    # The penalty makes this target's greedy text change token now and then instead of repeating one.
    argv = _pair_args(pair_dirs, "--prompt", "t5 t9", "-m", "24", "--verbose", "F", "--repetition-penalty", "1.5")
    _, full, _ = _run(argv, capsys)
    words = full.split()
    stop = next(w for w in words[1:] if w != words[0])  # not the first token, so the text is cut short
    expected = full[: full.index(" " + stop)].strip() if " " + stop in full else ""
    for token in (stop, str(int(stop[1:]))):  # the token's text, or its id ('t5' is id 5)
        code, out, _ = _run([*argv, "--extra-eos-token", token], capsys)
        assert code == 0 and out.strip() == expected and len(out) < len(full)


def test_max_kv_size_decodes_as_mlx_lm_does(pair_dirs, capsys):
    """Plain decoding keeps a window of the last N tokens: the same tokens as mlx_lm generate with
    --max-kv-size, which differ from the full cache's on this target (window 5: from the first
    token, the prompt being longer; window 8: from the fourth)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    from dflash_mlx import load

    model, _, tokenizer = load(pair_dirs["qwen3-tied"])
    prompt = " ".join(f"t{i}" for i in range(1, 11))
    ids = mx.array(tokenizer.encode(prompt))
    # The penalty keeps this target from repeating one token, so the lost context shows.
    processors = make_logits_processors(repetition_penalty=2.0)

    def mlx_lm_tokens(**kwargs):
        return [int(t) for t, _ in generate_step(ids, model, max_tokens=30, logits_processors=processors, **kwargs)]

    full = mlx_lm_tokens()
    argv = ["--model", str(pair_dirs["qwen3-tied"]), "--no-draft", "--ignore-chat-template", "--prompt", prompt,
            "-m", "30", "--verbose", "F", "--repetition-penalty", "2"]  # fmt: skip
    for window in (5, 8):
        tokens = mlx_lm_tokens(max_kv_size=window)
        assert tokens != full
        code, out, _ = _run([*argv, "--max-kv-size", str(window)], capsys)
        assert code == 0 and out == tokenizer.decode(tokens) + "\n"
    # The stats count the whole prompt, as mlx_lm does, though the window cache took all but its last token first.
    code, out, _ = _run([*argv, "--verbose", "T", "--max-kv-size", "5"], capsys)
    assert code == 0 and f"Prompt: {ids.size} tokens, " in out and "Acceptance length" not in out  # nothing drafts


def test_chat_template_config_reaches_the_template(tmp_path, capsys):
    import json

    from helpers.checkpoints import write_target

    write_target(tmp_path / "t")
    config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if greet %}t9 t9 {% endif %}" + config["chat_template"]
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path / "t"), "--prompt", "t1", "-m", "2"]
    _, plain, _ = _run(argv, capsys)
    _, greeted, _ = _run([*argv, "--chat-template-config", '{"greet": true}'], capsys)
    prompt_tokens = [int(line.split()[1]) for text in (plain, greeted) for line in text.splitlines()
                     if line.startswith("Prompt:")]  # fmt: skip
    assert prompt_tokens[1] == prompt_tokens[0] + 2


def test_target_without_tokenizer_files_says_so(pair_dirs, tmp_path, capsys):
    import shutil

    target = tmp_path / "no-tokenizer"
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(pair_dirs["qwen3-tied"] / name, target / name)
    code, out, err = _run(["--model", str(target), "--prompt", "hello"], capsys)
    assert code == 1 and out == ""
    assert err.startswith(f"dflash-generate: error: No usable tokenizer files in {target}") and err.count("\n") == 1
    assert "copy them from the model's original folder" in err


@pytest.mark.parametrize(
    "tool", ["dflash_mlx.tools.cli.generate", "dflash_mlx.tui.app", "dflash_mlx.tools.bench.benchmark"]
)
def test_help_states_the_dtype_default(tool):
    import importlib

    help_text = " ".join(importlib.import_module(tool).setup_arg_parser().format_help().split())
    assert "--dtype" in help_text
    if tool == "dflash_mlx.tools.bench.benchmark":
        assert "generate uses: float32 on a CPU" in help_text
    else:
        assert "Default: float32 on MLX's CPU backend when float32 weights take at most half" in help_text


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--block-size", "0"], "--block-size must be at least 1 (got 0)."),
        (["--max-tokens", "0"], "--max-tokens must be at least 1 (got 0)."),
        (["--temp", "11"], "--temp must be from 0 to 10 (got 11)."),
        (["--min-confidence", "1.5"], "--min-confidence must be from 0 to 1 (got 1.5)."),
        (["--lookup-fallback", "-1"], "--lookup-fallback must be at least 0 (got -1)."),
        (["--tree-budget", "-1"], "--tree-budget must be at least 0 (got -1)."),
        (["--chat-template-config", "{x"], "argument --chat-template-config: not valid JSON"),
    ],
)
def test_generate_and_chat_answer_a_bad_value_alike(argv, line, capsys):
    from dflash_mlx.tui.app import main as chat_main

    for prog, tool_main in (("dflash-generate", main), ("dflash-chat", chat_main)):
        with pytest.raises(SystemExit) as e:
            tool_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"{prog}: error: {line}") and err.count("\n") == 1


def test_every_tool_has_version(capsys):
    from importlib import import_module
    from pathlib import Path

    import tomllib

    from dflash_mlx import __version__
    from dflash_mlx.tools.cli import entry

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(entry.TOOLS)  # every console script is checked
    for prog, module in entry.TOOLS.items():
        with pytest.raises(SystemExit) as e:
            import_module(module).main(["--version"])
        out = capsys.readouterr().out.strip()
        assert e.value.code == 0 and out.startswith(f"{prog} {__version__} (pip: mlx-dflash; mlx "), (prog, out)
    assert entry._blas_choice(["--version"]) is None  # no restart with a BLAS preloaded just to print it
