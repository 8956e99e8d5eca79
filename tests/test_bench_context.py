"""dflash-bench --context: long-context prompts, per-length tables and component times."""

import json

import numpy as np
import pytest
from helpers.checkpoints import VOCAB

from dflash_mlx import DFlashError, load
from dflash_mlx.tools.bench.benchmark import main, run_benchmark
from dflash_mlx.tools.bench.context import context_rows, label, load_documents, parse_lengths


def _words(n: int, seed: int) -> str:
    return " ".join(f"t{i}" for i in np.random.default_rng(seed).integers(0, VOCAB - 4, n))


@pytest.fixture()
def documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [
        {"document": _words(400, 1), "question": "t1 t2 t3", "source": "one"},
        {"document": _words(400, 2), "question": "t4 t5", "source": "two"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_parse_lengths():
    assert parse_lengths("1k,2k,4k,7k") == [1024, 2048, 4096, 7168]
    assert parse_lengths("4K, 1500,1k") == [1024, 1500, 4096]
    for bad in ("", "x", "2m", "0", "1k,,2k"):
        with pytest.raises(DFlashError, match="is not a length"):
            parse_lengths(bad)


def test_context_rows_are_the_length_asked_for_and_end_with_the_question(pair_dirs, documents):
    _, _, tokenizer = load(pair_dirs["qwen3-tied"], dtype="float32")
    docs = load_documents(documents)
    rows = context_rows(tokenizer, docs, [64, 200])
    assert [(r["category"], r["source"]) for r in rows] == [("64", "one"), ("64", "two"), ("200", "one"),
                                                            ("200", "two")]  # fmt: skip
    for r in rows:
        assert abs(len(r["ids"]) - r["context"]) <= 2, (len(r["ids"]), r["context"])
        text = tokenizer.decode(r["ids"])
        question = next(d["question"] for d in docs if d["source"] == r["source"])
        assert question in text[-len(question) - 40 :]
    assert label(7168) == "7k" and label(1500) == "1500"
    with pytest.raises(DFlashError, match="too few for a 4k prompt"):
        context_rows(tokenizer, docs, [4096])


def test_documents_longer_than_the_model_raise_no_tokenizer_warning(pair_dirs, documents):
    _, _, tokenizer = load(pair_dirs["qwen3-tied"], dtype="float32")
    hf = tokenizer._tokenizer
    hf.model_max_length = 100  # the 400-word documents are longer
    context_rows(tokenizer, load_documents(documents), [64])
    # transformers records each warning it has given once per tokenizer (its log handler may
    # write where pytest cannot capture it)
    assert not [k for k in hf.deprecation_warnings if "longer-than" in k]


def test_context_mode_reports_each_length_with_its_own_component_times(pair_dirs, documents, tmp_path, capsys):
    main([
        "--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--context", "64,200",
        "--documents", str(documents), "--max-tokens", "8", "--block-sizes", "4", "--runs", "1",
        "--methods", "baseline", "dflash", "--draft-window", "16", "--json", str(tmp_path / "r.json"),
    ])  # fmt: skip
    result = json.loads((tmp_path / "r.json").read_text())
    assert list(result["by_category"]) == ["64", "200"] and result["mismatches"] == []
    assert result["meta"]["context"] == ["64", "200"] and result["meta"]["draft_window"] == 16
    assert {k: v["context"] for k, v in result["times_by_category"].items()} == {"64": 68, "200": 204}
    for rows in result["by_category"].values():
        dflash = next(r for r in rows if r["method"] == "dflash")
        assert dflash["limit"] > 0 and dflash["prompt_tps"] > 0 and dflash["peak_memory_gb"] > 0
    out = capsys.readouterr().out
    assert "### 64" in out and "at a 204-token context" in out


def test_context_mode_errors_are_one_line(pair_dirs, documents, capsys):
    base = ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--methods", "baseline"]
    with pytest.raises(SystemExit):
        main(base + ["--context", "lots"])
    assert "is not a length" in capsys.readouterr().err
    with pytest.raises(DFlashError, match="too few"):
        run_benchmark(model=str(pair_dirs["qwen3-tied"]), draft=str(pair_dirs["draft"]), context=[2000],
                      documents=str(documents), methods=("baseline",), max_tokens=4, runs=1, progress=False)  # fmt: skip
    with pytest.raises(DFlashError, match="more than the target's"):
        run_benchmark(model=str(pair_dirs["qwen3-tied"]), draft=str(pair_dirs["draft"]), context=[10**6],
                      documents=str(documents), methods=("baseline",), max_tokens=4, runs=1, progress=False)  # fmt: skip
    with pytest.raises(DFlashError, match="needs a 'document'"):
        bad = documents.with_name("bad.jsonl")
        bad.write_text('{"question": "q"}\n')
        load_documents(bad)
