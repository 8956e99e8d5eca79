import subprocess
import sys

import pytest

from dflash_mlx.generate import main


def test_help_smoke():
    out = subprocess.run([sys.executable, "-m", "dflash_mlx.generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--model", "--draft", "--prompt", "--max-tokens", "--block-size", "--temp", "--system-prompt"):
        assert flag in out.stdout


def test_generates_with_a_pair(pair_dirs, capsys):
    main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]),
          "--prompt", "t1 t2 t3", "--max-tokens", "12", "--block-size", "4"])
    out = capsys.readouterr().out
    assert "Generation:" in out and "Acceptance length:" in out


OPTIONS = [["--min-confidence", "0.05"], ["--lookup-fallback", "4"], ["--adaptive", "false"], ["--adaptive", "True"]]


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
    assert err == "dflash-generate: error: lookup_fallback must be a non-negative integer of cycles (got -1)."


def test_bad_adaptive_value_is_refused(pair_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--adaptive", "maybe"])
    assert "--adaptive: expected true or false (got 'maybe')" in capsys.readouterr().err


def test_bad_min_confidence_is_one_line(pair_dirs, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--min-confidence", "2"])
    err = capsys.readouterr().err.strip()
    assert err == "dflash-generate: error: min_confidence must be a probability from 0 to 1 (got 2.0)."


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be at least 1 (got 0)"),
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--block-size", "x"], "invalid int value"),
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
    assert "block_size must be an integer from 1 to the drafter's trained block size 16 (got 40)" in capsys.readouterr().err


def test_unknown_target_without_drafter_says_plain_decoding(pair_dirs, capsys):
    main(["--model", str(pair_dirs["qwen3-tied"]), "--prompt", "t1 t2", "--max-tokens", "3"])
    assert "plain decoding (pass --draft for DFlash)" in capsys.readouterr().err
