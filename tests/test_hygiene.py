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


def private_imports(source: str) -> list[str]:
    """The private names (a leading underscore) that ``source`` imports from the package, or reads off a module of
    it: a recipe that does either breaks silently when the package renames its internals."""
    import ast

    tree, modules, found = ast.parse(source), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dflash_mlx":
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules.update(a.asname or a.name for a in node.names if not a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("dflash_mlx"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in modules:
                found.append(f"{node.value.id}.{node.attr}")
    return found


# The one recipe that reaches inside on purpose: it replays the design before a target's compiled layer steps were
# kept, by emptying the library's store of them before every pass.
REPLAYS_INTERNALS = {
    "recipes/measure/layer_steps_ab.py": ["target._cpu_steps", "target._cpu_steps", "target._CPU_STEPS"]
}


@needs_source
def test_the_recipes_use_only_public_names():
    found = {
        path.relative_to(REPO).as_posix(): names
        for path in sorted((REPO / "recipes").rglob("*.py"))
        if (names := private_imports(path.read_text()))
    }
    assert found == REPLAYS_INTERNALS
    # Negative controls: each form is seen; a private name of the recipe's own or of another package is not.
    assert private_imports("from dflash_mlx.tools.bench.timing import _time_stream") == [
        "dflash_mlx.tools.bench.timing._time_stream"
    ]
    assert private_imports("import dflash_mlx.generation as g\ng._make_proposer()") == ["g._make_proposer"]
    assert private_imports("from dflash_mlx.tools.train import data\ndata._key([1])") == ["data._key"]
    assert private_imports("import os\nos._exit(1)\nclass A:\n    def f(self):\n        self._x = 1") == []
