import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from dflash_mlx import DFlashError
from dflash_mlx.kernels.dispatch import on_metal
from dflash_mlx.loading.pairs import EMBEDDED_PAIRS
from dflash_mlx.tools.bench import benchmark
from dflash_mlx.tools.bench.benchmark import load_prompts, main, run_benchmark
from dflash_mlx.tools.bench.report import markdown
from dflash_mlx.tools.bench.stats import efficiency, loop_efficiency, physical_limit, summarize
from dflash_mlx.tools.bench.timing import RunResult, fastest_times


def test_physical_limit_and_efficiency():
    # tau 6 tokens per cycle; a cycle costs one draft (2 ms) + one verify (10 ms); an AR step 8 ms.
    assert physical_limit(6.0, 0.008, 0.002, 0.010) == pytest.approx(4.0)
    # A measured 3.0x against that 4.0x limit.
    assert efficiency(3.0, 4.0) == pytest.approx(0.75)
    assert efficiency(3.0, 0.0) == 0.0
    # The ideal loop makes 6 tokens per 12 ms = 500 tok/s; 375 tok/s measured is 75% of it.
    assert loop_efficiency(375.0, 6.0, 0.002, 0.010) == pytest.approx(0.75)
    assert loop_efficiency(1.0, 0.0, 0.002, 0.010) == 0.0


def test_summary_speedup_and_limit():
    results = [
        RunResult("baseline", 1, 0, "code", 10, 100.0, 500.0, [1] * 9),
        RunResult("dflash", 16, 0, "code", 10, 250.0, 500.0, [4, 6]),
    ]
    times = {"ar": 0.01, "verify": {16: 0.015}, "draft": {16: 0.005}}
    rows = {r["method"]: r for r in summarize(results, times)}
    assert rows["dflash"]["speedup"] == pytest.approx(2.5)
    assert rows["dflash"]["tau"] == pytest.approx(5.0)
    assert rows["dflash"]["limit"] == pytest.approx(5.0 * 0.01 / 0.02)
    assert rows["dflash"]["efficiency"] == pytest.approx(2.5 / 2.5)
    # The baseline's own step (10 ms at 100 tok/s) equals the AR pass here, so the two agree.
    assert rows["dflash"]["loop_efficiency"] == pytest.approx(250.0 * 0.02 / 5.0)
    assert rows["dflash"]["histogram"] == {4: 1, 6: 1}
    # Two cycles of 15 drafts, keeping 3 and 5: both reach depth 3, one depth 4 and 5, none 6.
    assert rows["dflash"]["depths"] == {d: 1.0 if d <= 3 else 0.5 if d <= 5 else 0.0 for d in range(1, 16)}
    meta = {"machine": "m", "device": "d", "blas": "b", "mlx": "1", "mlx_lm": "1", "commit": "c", "date": "t"}
    table = markdown(summarize(results, times), meta, times)
    assert "- dflash B=16: 1: 100%, 2: 100%, 3: 100%, 4: 50%, 5: 50%, 6: 0%" in table


def test_efficiency_is_speedup_over_limit_when_the_baseline_beats_a_lone_ar_pass():
    # The baseline runs at 125 tok/s (8 ms a token) while a lone AR pass times 10 ms.
    results = [
        RunResult("baseline", 1, 0, "code", 10, 125.0, 500.0, [1] * 9),
        RunResult("dflash", 16, 0, "code", 10, 250.0, 500.0, [4, 6]),
    ]
    times = {"ar": 0.01, "verify": {16: 0.015}, "draft": {16: 0.005}}
    row = {r["method"]: r for r in summarize(results, times)}["dflash"]
    assert row["speedup"] == pytest.approx(2.0) and row["limit"] == pytest.approx(2.5)
    assert row["efficiency"] == pytest.approx(0.8)
    assert row["loop_efficiency"] == pytest.approx(1.0)


def test_without_a_baseline_there_is_no_speedup(tmp_path):
    """--methods without "baseline": the speedup column stays empty rather than reading 0.00x."""
    from dflash_mlx.tools.bench.report import markdown, plots

    results = [RunResult("dflash", 16, 0, "code", 10, 250.0, 500.0, [4, 6])]
    times = {"ar": 0.01, "verify": {16: 0.015}, "draft": {16: 0.005}, "context": 20}
    rows = summarize(results, times)
    assert rows[0]["speedup"] is None and rows[0]["limit"] == pytest.approx(2.5)
    assert rows[0]["efficiency"] is None and rows[0]["loop_efficiency"] == pytest.approx(1.0)
    table = markdown(rows, {"machine": "m", "device": "d", "blas": "b", "mlx": "1", "mlx_lm": "1",
                            "commit": "c", "date": "now"}, times)  # fmt: skip
    assert "| dflash | 16 | 250.0 |  | 5.00 |" in table and "0.00x" not in table
    assert all(path.is_file() for path in plots(rows, tmp_path))


def test_limit_uses_each_cycles_verify_size():
    # dflash-cut verified 16, 2 and 2 tokens in its three cycles: its ideal cycle is the mean.
    results = [
        RunResult("baseline", 1, 0, "code", 10, 100.0, 500.0, [1] * 9),
        RunResult("dflash-cut", 16, 0, "code", 10, 200.0, 500.0, [8, 1, 2], verify_sizes=[16, 2, 2]),
    ]
    times = {"ar": 0.01, "verify": {16: 0.02}, "draft": {16: 0.004}, "verify_by_size": {1: 0.01, 2: 0.011, 16: 0.02}}
    row = summarize(results, times)[1]
    # By hand: tau = (8 + 1 + 2) / 3 = 3.667; a cycle = 4 ms draft + (20 + 11 + 11) / 3 = 14 ms verify = 18 ms.
    assert row["verify_size"] == pytest.approx(6.6667, abs=1e-4)
    # limit = 3.667 tokens per 18 ms against one per 10 ms = 2.037x.
    assert row["limit"] == pytest.approx(2.0370, abs=1e-4)
    # The ideal loop makes 3.667 tokens per 18 ms = 203.7 tok/s; 200 tok/s measured is 98.18% of it,
    # and the 2.0x speedup is 98.18% of the 2.037x limit.
    assert row["loop_efficiency"] == pytest.approx(0.9818, abs=1e-4)
    assert row["efficiency"] == pytest.approx(0.9818, abs=1e-4)


def test_limit_adds_each_cycles_rollback_on_a_hybrid_target():
    from dflash_mlx.tools.bench.report import markdown

    results = [
        RunResult("baseline", 1, 0, "code", 10, 100.0, 500.0, [1] * 9),
        RunResult("dflash", 4, 0, "code", 10, 120.0, 500.0, [1, 2, 4, 3], verify_sizes=[4, 4, 4, 3]),
    ]
    # A rollback after a 4-token verify, timed at k = 0, 2 and 3 accepted drafts (3: nothing to trim).
    times = {"ar": 0.01, "verify": {4: 0.012}, "draft": {4: 0.004}, "context": 20,
             "verify_by_size": {1: 0.01, 2: 0.011, 3: 0.011, 4: 0.012},
             "rollback": {4: {0: 0.001, 2: 0.002, 3: 0.0}}}  # fmt: skip
    row = summarize(results, times)[1]
    # By hand: the cycles' rollbacks are 1 ms (k = 0), 1.5 ms (k = 1, halfway to k = 2), 0 (all 4 kept)
    # and 0 (all 3 of a shorter verify kept): 0.625 ms a cycle.
    assert row["rollback"] == pytest.approx(0.000625)
    # tau = 2.5 per 4 ms draft + 11.75 ms verify + 0.625 ms rollback, against 10 ms a token: 1.5267x
    # (1.5873x if the rollback were left out).
    assert row["limit"] == pytest.approx(1.5267, abs=1e-4)
    assert row["loop_efficiency"] == pytest.approx(120.0 * 0.016375 / 2.5)
    meta = {"machine": "m", "device": "d", "blas": "b", "mlx": "1", "mlx_lm": "1", "commit": "c", "date": "now"}
    table = markdown([row], meta, times)
    assert "- B=4: verify 12.00, draft 4.00, rollback 1.00 / 2.00 / 0.00 at k = 0 / 2 / 3 accepted" in table
    # A dense target's times have no rollback: neither have its rows and its report.
    del times["rollback"]
    rows = summarize(results, times)
    assert "rollback" not in rows[1] and "rollback" not in markdown(rows, meta, times)


def test_fastest_times_keeps_the_faster_of_each_entry():
    a = {"context": 40, "ar": 0.010, "verify": {4: 0.02}, "draft": {4: 0.004}, "verify_by_size": {1: 0.010, 4: 0.02}}
    b = {"context": 40, "ar": 0.008, "verify": {4: 0.03}, "draft": {4: 0.003}, "verify_by_size": {1: 0.008, 4: 0.03}}
    assert fastest_times(a, b) == {
        "context": 40,
        "ar": 0.008,
        "verify": {4: 0.02},
        "draft": {4: 0.003},
        "verify_by_size": {1: 0.008, 4: 0.02},
    }
    assert fastest_times({}, {}) == {}
    a["rollback"], b["rollback"] = {4: {0: 0.002, 2: 0.001}}, {4: {0: 0.001, 2: 0.003}}
    assert fastest_times(a, b)["rollback"] == {4: {0: 0.001, 2: 0.001}}


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "t1 t2 t3 t1 t2", "category": "a"}, {"prompt": "t5 t6 t7", "category": "b"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_without_an_ar_draft_the_default_methods_leave_out_mlx_spec(pair_dirs, prompts, capsys):
    result = run_benchmark(
        model=str(pair_dirs["qwen3-tied"]),
        draft=str(pair_dirs["draft"]),
        prompts=str(prompts),
        max_tokens=4,
        block_sizes=(4,),
        runs=1,
    )
    assert {r["method"] for r in result["rows"]} == {"baseline", "lookup", "dflash", "dflash-cut", "dflash-fallback",
                                                     "dflash-auto", "dflash-default"}  # fmt: skip
    assert "mlx-spec left out" in capsys.readouterr().err
    assert result["meta"]["model"] == str(pair_dirs["qwen3-tied"]) and result["meta"]["ar_draft"] is None


def test_an_embedded_pair_without_its_ar_draft_says_which_recipe_rebuilds_it(tmp_path):
    # The wheel leaves the ar-drafts out; the one line names a recipe that exists in the checkout.
    repo = Path(__file__).resolve().parents[1]
    assert set(benchmark.AR_DRAFT_RECIPES) == set(EMBEDDED_PAIRS.values())
    for pair, recipe in benchmark.AR_DRAFT_RECIPES.items():
        line = benchmark._missing_ar_draft(tmp_path / pair)
        assert "\n" not in line and "--ar-draft FOLDER" in line and recipe in line
        assert (repo / recipe.split()[1]).is_file()
    with pytest.raises(DFlashError, match="smollm2_ar_draft.py"):
        benchmark._load_ar_draft(str(tmp_path / "smollm2" / "ar-draft"), None, given=False, dtype=None)


def test_smoke_run_writes_json_markdown_and_plots(pair_dirs, prompts, tmp_path, capsys):
    out = tmp_path / "out"
    main(
        [
            "--model",
            str(pair_dirs["qwen3-tied"]),
            "--draft",
            str(pair_dirs["draft"]),
            "--ar-draft",
            str(pair_dirs["qwen3-untied"]),
            "--prompts",
            str(prompts),
            "--max-tokens",
            "12",
            "--block-sizes",
            "4",
            "8",
            "--runs",
            "1",
            "--json",
            str(tmp_path / "r.json"),
            "--markdown",
            str(tmp_path / "r.md"),
            "--plots",
            str(out),
        ]
    )
    result = json.loads((tmp_path / "r.json").read_text())
    methods = {(r["method"], r["block_size"]) for r in result["rows"]}
    assert methods == {("baseline", 1), ("mlx-spec", 1), ("lookup", 4), ("lookup", 8), ("dflash", 4), ("dflash", 8),
                       ("dflash-cut", 4), ("dflash-cut", 8), ("dflash-fallback", 4), ("dflash-fallback", 8),
                       ("dflash-auto", 16), ("dflash-default", 16)}  # fmt: skip
    for r in result["rows"]:
        if r["method"].startswith("dflash"):
            assert 1 <= r["verify_size"] <= r["block_size"]
            assert (r["limit"] > 0) if r["method"] not in ("dflash-fallback", "dflash-default") else "limit" not in r
    assert set(result["by_category"]) == {"a", "b"}
    assert result["meta"]["blas"] and result["meta"]["mlx"]
    # Lossless: every method emitted the same tokens on each prompt.
    assert result["mismatches"] == []
    for i in range(2):
        assert len({tuple(r["output_ids"]) for r in result["runs"] if r["prompt"] == i}) == 1
    table = (tmp_path / "r.md").read_text()
    assert "| dflash | 8 |" in table and "BLAS" in table
    # The limit, efficiency and loop eff. cells: numbers in the rows that have a limit, "-" in the others.
    head = next(line for line in table.splitlines() if line.startswith("| method"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    at = columns.index("limit")
    for line in table.split("\n\n", 2)[1].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        limit, eff, loop = cells[at : at + 3]
        if cells[0] in ("dflash", "dflash-cut", "dflash-auto"):
            assert limit.endswith("x") and eff.endswith("%") and loop.endswith("%"), line
            assert float(limit[:-1]) > 0 and float(eff[:-1]) > 0 and float(loop[:-1]) > 0, line
        else:
            assert (limit, eff, loop) == ("-", "-", "-"), line
    # Component times are taken at the mean context of the generated tokens.
    assert result["times"]["context"] > 12 / 2 and f"at a {result['times']['context']}-token context" in table
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "acceptance_histogram.png").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_runs_are_round_robin(pair_dirs, prompts, monkeypatch):
    """Each method's timed runs are spread over the prompt's time: a slow spell of the machine hits
    one run of every method, and the median drops it."""
    calls = []

    def fake_runner(method, *args, **kwargs):
        def run(ids):
            calls.append(method)
            slow = len(calls) == 8  # one disturbed run: the second timed run of lookup
            return [1, 2, 3], 10.0 if slow else 1.0, 0.1, [2], [2]

        return run

    monkeypatch.setattr(benchmark, "make_runner", fake_runner)
    result = benchmark.run_benchmark(
        model=str(pair_dirs["qwen3-tied"]),
        draft=str(pair_dirs["draft"]),
        prompts=str(prompts),
        num_prompts=1,
        max_tokens=4,
        block_sizes=(4,),
        runs=3,
        methods=("baseline", "lookup", "dflash"),
        progress=False,
    )
    methods = ["baseline", "lookup", "dflash"]
    assert calls == methods * 4  # warm-up, then three rounds
    assert {r["method"]: r["generation_tps"] for r in result["rows"]} == {m: 2.0 for m in methods}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--methods", "dflash", "--block-sizes", "40"],
            "--block-sizes must be from 1 to the drafter's block size 16 (got 40).",
        ),
        (["--methods", "mlx-spec"], "needs a small autoregressive draft"),
    ],
)
def test_bad_arguments(pair_dirs, prompts, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--model",
                str(pair_dirs["qwen3-tied"]),
                "--draft",
                str(pair_dirs["draft"]),
                "--prompts",
                str(prompts),
                *argv,
            ]
        )
    assert e.value.code == 1 and message in capsys.readouterr().err


def test_bad_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"x": 1}\n')
    with pytest.raises(DFlashError, match="has neither 'prompt' nor 'messages'"):
        load_prompts(path)
    path.write_text("{nope\n")
    with pytest.raises(DFlashError, match="is not valid JSON"):
        load_prompts(path)
    with pytest.raises(DFlashError, match="No prompts file"):
        load_prompts(tmp_path / "missing.jsonl")


def test_scaling_mode_on_a_small_shape(tmp_path, monkeypatch, capsys):
    from dflash_mlx.tools.bench import scaling as bench_scaling

    tiny = dict(
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        vocab_size=256,
    )
    monkeypatch.setitem(bench_scaling.SHAPES, "tiny", tiny)
    # A clock that reads one second later each time: a plain run reads it after its first token and
    # after 24 more (1 s / 24 tokens = 41.7 ms a token), a DFlash run around 6 cycles (166.7 ms a cycle).
    ticks = iter(range(1000))
    monkeypatch.setattr(bench_scaling, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    replay = tmp_path / "r.json"
    replay.write_text(json.dumps({"rows": [{"method": "dflash", "block_size": 4, "tau": 3.0}]}))
    main(["--scaling", "tiny", "--replay", str(replay), "--json", str(tmp_path / "s.json")])
    rows = json.loads((tmp_path / "s.json").read_text())["scaling"]
    assert rows[0]["shape"] == "tiny" and rows[0]["tau"] == 3.0
    assert rows[0]["ar_step_ms"] == pytest.approx(41.667, abs=1e-3)
    assert rows[0]["cycle_ms"] == pytest.approx(166.667, abs=1e-3)
    # 3 tokens a cycle at 166.7 ms against 41.7 ms a token: 0.75x.
    assert rows[0]["projected_speedup"] == pytest.approx(0.75)
    out = capsys.readouterr().out
    assert "projected speedup" in out and "| tiny | 4 | 3.00 | 41.7 | 166.7 | 0.75x |" in out


def test_scaling_needs_a_replay(capsys):
    with pytest.raises(SystemExit):
        main(["--scaling", "qwen3-0.6b"])
    assert "--scaling needs --replay" in capsys.readouterr().err


def test_prompt_sets_from_a_local_hub_cache(tmp_path):
    """The real huggingface_hub path for a named set, resolved offline from an HF cache layout."""
    from dflash_mlx.tools.bench.benchmark import prompt_rows
    from dflash_mlx.tools.bench.datasets import load_prompt_set

    snapshot = tmp_path / "hf-cache" / "datasets--HuggingFaceH4--MATH-500" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "test.jsonl").write_text("".join(json.dumps({"problem": f"1+{i}?"}) + "\n" for i in range(5)))
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    rows = load_prompt_set("math500", limit=3)
    assert [r["messages"][0]["content"] for r in rows] == ["1+0?", "1+1?", "1+2?"]
    assert rows[0]["category"] == "math500"
    assert len(prompt_rows("math500", 2)) == 2


def test_prompt_set_offline_or_unknown_is_one_line():
    from dflash_mlx.tools.bench.datasets import load_prompt_set

    with pytest.raises(DFlashError, match="Could not get the gsm8k prompts from the Hugging Face hub"):
        load_prompt_set("gsm8k")
    with pytest.raises(DFlashError, match="Unknown prompt set 'nope'"):
        load_prompt_set("nope")


def test_a_stop_token_does_not_count_as_a_mismatch(pair_dirs, tmp_path):
    """mlx-lm yields the stop token in its last response; the lossless check must not see a difference."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import load

    model, _, tokenizer = load(pair_dirs["qwen3-tied"])
    ids = tokenizer.encode("t1 t2 t3")
    first = int(next(iter(generate_step(mx.array(ids), model, max_tokens=1)))[0])
    tokenizer.eos_token_ids = {first}  # the very first generated token stops generation
    from dflash_mlx.tools.bench.timing import make_runner

    outs = [make_runner(m, model, None, None, tokenizer, 1, 2, 8)(ids)[0] for m in ("baseline", "lookup")]
    assert outs[0] == outs[1] == []


def test_git_commit_says_when_tracked_files_changed(tmp_path):
    import shutil
    import subprocess

    from dflash_mlx.tools.bench.report import git_commit

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert git_commit(tmp_path) == ""  # not a checkout
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "weights.txt").write_text("a")
    subprocess.run([*git, "add", "weights.txt"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    clean = git_commit(tmp_path)
    assert clean == head.stdout.strip() and clean
    (tmp_path / "notes.txt").write_text("untracked files do not count")
    assert git_commit(tmp_path) == clean
    (tmp_path / "weights.txt").write_text("b")
    assert git_commit(tmp_path) == clean + "+changes"


@pytest.fixture()
def no_loading(monkeypatch):
    """Fails the test if a model is loaded: the checks under test must come first."""
    import dflash_mlx.loading.loading

    def load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(dflash_mlx.loading.loading, "load", load)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--json", "{tmp}/nodir/out.json"], "--json {tmp}/nodir/out.json: the folder {tmp}/nodir does not exist"),
        (["--markdown", "{tmp}"], "--markdown {tmp} is a folder; pass a file name."),
        (["--plots", "{tmp}/file.txt/plots"], "--plots {tmp}/file.txt/plots: {tmp}/file.txt is a file, not a folder"),
        (["--plots", "{tmp}/file.txt"], "--plots {tmp}/file.txt is a file; pass a folder."),
        (["--num-prompts", "0"], "--num-prompts must be at least 1 (got 0)"),
        # Against a server too: checked before the first request (nothing listens on port 9).
        (["--base-url", "http://127.0.0.1:9", "--num-prompts", "0"], "--num-prompts must be at least 1 (got 0)"),
        (["--base-url", "http://127.0.0.1:9", "--json", "{tmp}/nodir/r.json"], "--json {tmp}/nodir/r.json: the folder"),
    ],
)
def test_bad_outputs_and_values_fail_before_loading(no_loading, tmp_path, capsys, argv, message):
    (tmp_path / "file.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith(f"dflash-bench: error: {message.format(tmp=tmp_path)}")
    assert "\n" not in err
    assert (tmp_path / "file.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["missing", "not-a-model", "dflash-drafter"])
def test_a_bad_ar_draft_is_one_line(pair_dirs, prompts, tmp_path, capsys, kind):
    path = {"missing": tmp_path / "nope", "not-a-model": tmp_path, "dflash-drafter": pair_dirs["draft"]}[kind]
    if kind == "not-a-model":
        (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(SystemExit) as e:
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--prompts", str(prompts),
              "--methods", "mlx-spec", "--ar-draft", str(path)])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith(f"dflash-bench: error: --ar-draft {path} ")
    assert "pass --ar-draft FOLDER" not in err
    expected = {"missing": "is not a folder", "not-a-model": "is not a model mlx-lm can load",
                "dflash-drafter": "is a DFlash drafter; mlx-spec needs a small autoregressive model"}[kind]  # fmt: skip
    assert expected in err


def test_results_name_the_model_drafter_and_prompts_and_the_run_time_is_estimated(pair_dirs, prompts, tmp_path, capsys):
    from dflash_mlx.tools.bench.benchmark import estimate_seconds
    from dflash_mlx.tools.bench.report import plot_caption

    main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--prompts", str(prompts),
          "--methods", "baseline", "dflash", "--block-sizes", "4", "--runs", "1", "--max-tokens", "8",
          "--json", str(tmp_path / "r.json"), "--kernels", "off"])  # fmt: skip
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["kernels"] == "off" and meta["kernel_verdicts"] == []
    assert meta["model"] == str(pair_dirs["qwen3-tied"]) and meta["draft"] == str(pair_dirs["draft"])
    assert meta["prompt_set"] == str(prompts) and meta["prompts"] == 2
    assert str(prompts) in plot_caption(meta) and str(pair_dirs["draft"]) in plot_caption(meta)
    assert meta["draft_family"] == "DFlash" and "(DFlash)" in plot_caption(meta)
    assert "Estimated run time: about" in capsys.readouterr().err
    # 2 prompts x 2 settings x (1 run + warm-up) x 8 tokens at 10 ms.
    assert estimate_seconds(2, 2, 1, 8, 0.01) == pytest.approx(0.64)


def test_help_shows_the_defaults():
    from dflash_mlx.tools.bench.benchmark import setup_arg_parser

    text = " ".join(setup_arg_parser().format_help().split())
    for default in ("Most tokens per prompt and run (default: 128)", "(default: 4 8 16)", "(default: all but dflash-tree, which runs when named; mlx-spec only with an AR draft",
                    "generate uses: float32 on a CPU", "was faster (auto, the default)"):  # fmt: skip
        assert default in text


@pytest.mark.parametrize(
    "argv, message",
    [
        # The same limits as dflash-generate's, on the same flags: 0 is "off" there and here.
        (["--min-confidence", "1.5"], "--min-confidence must be from 0 to 1 (got 1.5)."),
        (["--min-confidence", "-0.1"], "--min-confidence must be from 0 to 1 (got -0.1)."),
        (["--lookup-fallback", "-1"], "--lookup-fallback must be at least 0 (got -1)."),
        (["--num-draft-tokens", "0"], "--num-draft-tokens must be at least 1 (got 0)."),
        (["--runs", "0"], "--runs must be at least 1 (got 0)."),
        (["--concurrency", "4", "0"], "--concurrency must be at least 1 (got 0)."),
    ],
)
def test_out_of_range_flags_are_one_line(no_loading, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"dflash-bench: error: {message}"


@pytest.mark.skipif(on_metal(), reason="off Metal only: on a Mac --kernels on runs the kernels")
def test_kernels_on_without_metal_is_one_line_before_loading(no_loading, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--kernels", "on"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith("dflash-bench: error: kernels 'on' needs a Metal device (an Apple GPU)")


def test_kernel_verdicts_are_reported(monkeypatch, tmp_path):
    import dflash_mlx.kernels
    from dflash_mlx.kernels import KernelStore, Verdict, accept
    from dflash_mlx.tools.bench.report import markdown, stamp

    d = accept.greedy_accept.with_store(KernelStore(tmp_path / "k.json"))
    d.verdicts["mlx.core.bfloat16|16x151936"] = verdict = Verdict(True, "matches its twin, faster", 1e-5, 2e-5)
    d.forced.add("mlx.core.bfloat16|8x151936")
    monkeypatch.setattr(dflash_mlx.kernels, "DISPATCHERS", (d,))
    rows = benchmark.kernel_verdicts()
    assert rows[0] == {"kernel": "greedy_accept", "shape": "mlx.core.bfloat16|16x151936", **vars(verdict)}
    assert rows[1]["enabled"] and rows[1]["reason"].startswith("forced")
    table = markdown([], {**stamp(), "kernels": "auto", "kernel_verdicts": rows}, {})
    assert "; kernels auto" in table.splitlines()[0]
    assert "- greedy_accept mlx.core.bfloat16|16x151936: kernel, matches its twin, faster" in table


def test_zero_cut_and_fallback_are_accepted_as_off(pair_dirs, prompts):
    """dflash-generate takes --min-confidence 0 and --lookup-fallback 0 as off; so does the benchmark."""
    result = benchmark.run_benchmark(
        model=str(pair_dirs["qwen3-tied"]),
        draft=str(pair_dirs["draft"]),
        prompts=str(prompts),
        num_prompts=1,
        max_tokens=6,
        block_sizes=(4,),
        runs=1,
        methods=("dflash", "dflash-cut", "dflash-fallback"),
        min_confidence=0.0,
        lookup_fallback=0,
        progress=False,
    )
    rows = {r["method"]: r for r in result["rows"]}
    assert not result["mismatches"] and rows["dflash-cut"]["tau"] == rows["dflash"]["tau"]
    assert rows["dflash-fallback"]["tau"] == rows["dflash"]["tau"]


def test_no_dflash_method_times_no_dflash_pass(pair_dirs, prompts, monkeypatch):
    timed = []
    real = benchmark.component_times
    monkeypatch.setattr(
        benchmark,
        "component_times",
        lambda target, drafter, *a, **k: timed.append(drafter) or real(target, drafter, *a, **k),
    )
    result = benchmark.run_benchmark(
        model=str(pair_dirs["qwen3-tied"]),
        draft=str(pair_dirs["draft"]),
        prompts=str(prompts),
        num_prompts=1,
        max_tokens=4,
        block_sizes=(4,),
        runs=1,
        methods=("baseline", "lookup"),
        progress=False,
    )
    assert all(d is None for d in timed) and result["times"] == {}


def test_ar_draft_by_hub_id_and_empty(pair_dirs, prompts, tmp_path, capsys, monkeypatch):
    """--ar-draft takes a Hugging Face id as docs/bench.md shows (here from an offline cache); '' is refused."""
    import huggingface_hub.constants

    def run(ar):
        main(["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--prompts", str(prompts),
              "--num-prompts", "1", "--methods", "baseline", "mlx-spec", "--max-tokens", "4", "--runs", "1",
              "--ar-draft", ar])  # fmt: skip

    with pytest.raises(SystemExit) as e:
        run("org/small-draft")
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Could not get the --ar-draft model 'org/small-draft' from the Hugging Face hub" in err
    with pytest.raises(SystemExit) as e:
        run("")
    assert e.value.code == 1 and "--ar-draft is empty" in capsys.readouterr().err
    cache = tmp_path / "hub"
    repo = cache / "models--org--small-draft"
    shutil.copytree(pair_dirs["qwen3-tied"], repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    run("org/small-draft")
    assert "mlx-spec" in capsys.readouterr().out


def test_ar_draft_that_borrows_the_targets_embedding(pair_dirs, prompts, tmp_path):
    """A draft folder holding only its layers takes the embedding and final norm from the target, shared."""
    import mlx.core as mx

    from dflash_mlx import load
    from dflash_mlx.tools.bench.benchmark import _load_ar_draft

    src = pair_dirs["qwen3-tied"]
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=1, dflash_borrowed=["model.embed_tokens", "model.norm"])
    folder = tmp_path / "ar"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    weights = {}
    for f in src.glob("*.safetensors"):
        weights.update({k: v for k, v in mx.load(str(f)).items() if k.startswith("model.layers.0.")})
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    target, _, _ = load(src)
    ar = _load_ar_draft(str(folder), target, given=True, dtype="float32")
    assert ar.model.embed_tokens is target.model.embed_tokens and ar.model.norm is target.model.norm
    result = benchmark.run_benchmark(
        model=str(src),
        draft=str(pair_dirs["draft"]),
        ar_draft=str(folder),
        prompts=str(prompts),
        num_prompts=1,
        max_tokens=8,
        block_sizes=(4,),
        runs=1,
        methods=("baseline", "mlx-spec"),
        progress=False,
    )
    assert not result["mismatches"]  # lossless against plain decoding
    config["dflash_borrowed"] = ["model.nowhere"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="borrows model.nowhere from the target, which has no such module"):
        _load_ar_draft(str(folder), target, given=True, dtype="float32")


def test_the_default_dtype_is_the_one_generate_uses(pair_dirs, prompts, monkeypatch):
    """float32 on this CPU; where load keeps the checkpoint's dtype (a GPU), the benchmark runs in it too."""
    import dflash_mlx.loading.loading as loading

    kwargs = dict(model=str(pair_dirs["qwen3-tied"]), draft=str(pair_dirs["draft"]), prompts=str(prompts),
                  num_prompts=1, max_tokens=4, block_sizes=(4,), runs=1, methods=("baseline", "dflash"),
                  progress=False)  # fmt: skip
    assert run_benchmark(**kwargs)["meta"]["dtype"] == "float32"
    loaded = []
    real_load = loading.load

    def gpu_like_load(model, draft, dtype=None, **kwargs):
        target, drafter, tokenizer = real_load(model, draft, dtype=dtype or "bfloat16", **kwargs)
        loaded.append(dtype)
        return target, drafter, tokenizer

    monkeypatch.setattr(loading, "load", gpu_like_load)
    assert run_benchmark(**kwargs)["meta"]["dtype"] == "bfloat16" and loaded == [None]


def test_dflash_tree_runs_when_named_and_gives_the_same_tokens(pair_dirs, prompts):
    result = run_benchmark(
        model=str(pair_dirs["qwen3-tied"]),
        draft=str(pair_dirs["draft"]),
        prompts=str(prompts),
        max_tokens=8,
        block_sizes=(4,),
        runs=1,
        methods=("baseline", "dflash-tree"),
        tree_budget=8,
        progress=False,
    )
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"baseline", "dflash-tree"} and rows["dflash-tree"]["block_size"] == 16
    assert result["meta"]["tree_budget"] == 8
    assert 1 < rows["dflash-tree"]["verify_size"] <= 9  # the nodes and the root


def test_the_benchmarks_datastore_learns_nothing_from_the_runs(pair_dirs, prompts, monkeypatch):
    """dflash-default's datastore in a benchmark holds no reply of its runs afterwards: a run must not
    draft from another run's answer to the same prompt. (A datastore opened to learn fails it.)"""
    from dflash_mlx.tools import session

    opened = []
    real = session.open_datastore
    monkeypatch.setattr(session, "open_datastore", lambda *a, **k: opened.append(real(*a, **k)) or opened[-1])
    benchmark.run_benchmark(
        model=str(pair_dirs["qwen3-tied"]),
        draft=str(pair_dirs["draft"]),
        prompts=str(prompts),
        num_prompts=1,
        max_tokens=6,
        block_sizes=(4,),
        runs=2,
        methods=("dflash-default",),
        datastore="auto",
    )
    assert len(opened) == 1 and opened[0].session_length == 0
    # The same store told to learn would have kept them: the check can see a reply.
    opened[0].learns = True
    opened[0].add([1, 2, 3])
    assert opened[0].session_length == 3


def test_plots_without_matplotlib_fail_before_loading(no_loading, tmp_path, capsys, monkeypatch):
    # matplotlib comes only with the [bench] extra; a missing one must not cost the whole run first.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        main(["--plots", str(tmp_path / "plots")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err
    assert err.startswith(f"dflash-bench: error: --plots {tmp_path / 'plots'} needs matplotlib")
    assert "mlx-dflash[bench]" in err


def test_the_tables_limit_columns_are_left_out_when_no_row_has_a_limit_and_dashed_where_one_lacks_it():
    from dflash_mlx.tools.bench.report import markdown

    meta = {k: "x" for k in ("machine", "device", "blas", "mlx", "mlx_lm", "commit", "date")}
    row = {"method": "baseline", "block_size": 1, "generation_tps": 10.0, "speedup": 1.0, "tau": 0.0,
           "drafting_cycles": 0, "plain_cycles": 9, "prompt_tps": 100.0, "peak_memory_gb": 0.1}  # fmt: skip
    table = markdown([row, {**row, "method": "dflash-default"}], meta, {}).splitlines()
    head = next(line for line in table if line.startswith("| method"))
    assert "limit" not in head and "efficiency" not in head
    assert all(line.count("|") == head.count("|") for line in table if line.startswith("| "))
    limited = {**row, "method": "dflash", "limit": 2.0, "efficiency": 0.5, "loop_efficiency": 0.9}
    table = markdown([row, limited], meta, {}).splitlines()
    rows = [line for line in table if line.startswith("| baseline") or line.startswith("| dflash")]
    assert "| - | - | - |" in rows[0] and "| 2.00x | 50% | 90% |" in rows[1]


def test_the_eta_counts_the_warm_ups_and_the_final_timing():
    from dflash_mlx.tools.bench.benchmark import estimate_seconds, eta_seconds

    # 3 prompts x 4 settings x (2 runs + a warm-up), 1 s each, then 5 s of component timing: the ETA
    # after the first prompt's warm-ups and first timed run is the time that really remains.
    prompts, settings, runs, tail = 3, 4, 2, 5.0
    units = prompts * settings * (runs + 1)
    done = settings + 1
    assert eta_seconds(float(done), done, units, tail) == pytest.approx(units - done + tail)
    assert estimate_seconds(prompts, settings, runs, 1, 1.0) == units


def test_the_runs_first_eta_counts_what_the_estimate_counts(pair_dirs, prompts, monkeypatch, capsys):
    # On a real run: each ETA is taken over the warm-ups and timed runs done of all of them, so the
    # first one (after the first prompt's warm-ups and one timed run) is the estimate less that work.
    calls = []
    real = benchmark.eta_seconds
    monkeypatch.setattr(benchmark, "eta_seconds", lambda *a: calls.append(a) or real(*a))
    run_benchmark(model=str(pair_dirs["qwen3-tied"]), draft=str(pair_dirs["draft"]), prompts=str(prompts),
                  max_tokens=4, block_sizes=(4,), runs=2, methods=("baseline", "dflash"))  # fmt: skip
    settings, prompts_n, runs = 2, 2, 2
    units = settings * prompts_n * (runs + 1)
    assert [(done, total) for _, done, total, _ in calls][:2] == [(settings + 1, units), (settings + 2, units)]
    assert calls[-1][1] == units and calls[-1][3] > 0  # the last counts all, and the final timing is left
    err = capsys.readouterr().err
    assert f"x ({runs} runs + a warm-up) x up to 4 tokens" in err and ", ETA " in err


def test_sampled_runs_sample_every_method_alike(pair_dirs, prompts, monkeypatch):
    from dflash_mlx.tools.bench import timing

    made = []
    monkeypatch.setattr(timing, "make_sampler", lambda temp, top_p: made.append((temp, top_p)) or None)
    result = run_benchmark(model=str(pair_dirs["qwen3-tied"]), draft=str(pair_dirs["draft"]), prompts=str(prompts),
                           max_tokens=4, block_sizes=(4,), runs=1, methods=("baseline", "dflash-default"),
                           temp=0.2, top_p=0.9, progress=False)  # fmt: skip
    assert set(made) == {(0.2, 0.9)} and result["meta"]["temp"] == 0.2 and result["meta"]["top_p"] == 0.9
    assert not result["mismatches"]  # sampled outputs are not compared
