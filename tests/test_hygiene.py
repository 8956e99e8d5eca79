"""The repository's own rules: lint, license, what the wheel ships, and which way imports point."""

import ast
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
# The tools' packages: the core (everything else) never imports them.
TOOLS = ("dflash_mlx.cli", "dflash_mlx.server", "dflash_mlx.bench", "dflash_mlx.train", "dflash_mlx.tui",
         "dflash_mlx.convert")  # fmt: skip

needs_source = pytest.mark.skipif(PYPROJECT is None, reason="needs the source tree (and Python 3.11's tomllib)")


@needs_source
def test_ruff_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@needs_source
def test_the_license_is_the_one_pyproject_names():
    assert PYPROJECT["project"]["license"] == "MIT"
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) " in text and "the dflash-mlx authors" in text


@needs_source
def test_the_wheel_leaves_out_the_baseline_drafts_and_bench_results():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assets = Path(setuptools["package-dir"]["dflash_mlx.assets"])
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


def _modules() -> dict[str, Path]:
    """Every module of the package by import name, through the package-dir mapping."""
    roots = {"dflash_mlx": REPO / "dflash_mlx"}
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        if package != "dflash_mlx.assets":
            roots[package] = REPO / folder
    modules = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's own modules, at any depth (imports inside functions too)."""
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                # ``from . import x`` names a module; ``from .x import y`` usually a name in x.
                found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                group.append(w)
            on_stack.discard(v)
            if group:
                groups.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@needs_source
def test_no_import_cycles_between_modules():
    graph = _imports(_modules())
    assert len(graph) > 50 and graph["dflash_mlx.generation"]  # the walk found the package
    assert _cycles(graph) == []


@needs_source
def test_the_core_never_imports_the_tools():
    graph = _imports(_modules())
    upward = {(name, m) for name, deps in graph.items() if not name.startswith(TOOLS)
              for m in deps if m.startswith(TOOLS)}  # fmt: skip
    assert upward == set()
    # The kernels sit below loading.
    assert not [(n, m) for n, deps in graph.items() if n.startswith("dflash_mlx.kernels") for m in deps
                if m.startswith("dflash_mlx.loading")]  # fmt: skip
