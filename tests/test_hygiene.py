"""The repository's own rules: lint, license and what the wheel ships (which way imports point: test_imports.py)."""

import fnmatch
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = (tomllib.loads((REPO / "pyproject.toml").read_text())
             if tomllib is not None and (REPO / "pyproject.toml").is_file() else None)  # fmt: skip

needs_source = pytest.mark.skipif(PYPROJECT is None, reason="needs the source tree (and Python 3.11's tomllib)")


@needs_source
def test_ruff_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@needs_source
def test_the_tree_is_formatted_by_ruff():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, "run `ruff format .`: " + out.stdout[-4000:] + out.stderr[-2000:]


@needs_source
def test_the_license_is_the_one_pyproject_names():
    assert PYPROJECT["project"]["license"] == "MIT"
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) " in text and "the dflash-mlx authors" in text


@needs_source
def test_the_wheel_leaves_out_the_baseline_drafts_and_bench_results():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assets = Path("dflash_mlx/assets")
    excluded = setuptools["exclude-package-data"]["dflash_mlx.assets"]
    files = [p.relative_to(REPO / assets).as_posix() for p in (REPO / assets).rglob("*") if p.is_file()]
    # setuptools matches each pattern against the path below the package's folder.
    shipped = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in excluded)]
    left_out = sorted(set(files) - set(shipped))
    assert any("/ar-draft/" in f for f in left_out) and any(f.startswith("bench/") for f in left_out)
    assert not [f for f in shipped if "/ar-draft/" in f or (f.startswith("bench/") and f.endswith(".json"))]
    # What load() and dflash-bench's defaults read still ships.
    for needed in ("smollm2/draft/model.safetensors", "smollm2/prompts.jsonl", "dflash-tiny/target/config.json"):
        assert needed in shipped
