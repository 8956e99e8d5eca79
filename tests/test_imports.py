"""Which way the package's imports point: no cycles between its modules or its folders, the folders in one
order (each imports only the ones below it), and the core never imports a tool.

Read from the sources with ``ast``, so every import counts, at module level and inside functions alike.
"""

import ast
from pathlib import Path

PACKAGE = "dflash_mlx"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
# The tools' packages: the core never imports them. The PyTorch reference is an optional extra: the core never
# imports it either.
TOOLS = tuple(f"{PACKAGE}.{name}" for name in ("tools", "tui", "convert", "reference"))
# The folders (and top-level modules) from the bottom up: each imports only its own layer and the ones below.
# base and text are plain Python; the kernels and the CPU code sit under the models; the loop asks the proposal
# protocol (loop/proposal.py) and never a draft source; the tools sit on top (tui/ and convert/ are tools too:
# the design keeps their import names dflash_mlx.tui and dflash_mlx.convert).
LAYERS = (
    ("base", "text", "assets"),
    ("kernels", "cpu"),
    ("sampling",),
    ("models",),
    ("loading",),
    ("tuning",),
    ("loop",),
    ("drafts",),
    ("generation",),
    ("tools", "tui", "convert", "reference"),
)
# The one lazy import allowed to close a loop: the public API in dflash_mlx/__init__.py loads each name on first
# use (its _EXPORTS table), so by then the module that asked has finished importing.
LAZY = "_EXPORTS"


def modules_in(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by import name; a package is its ``__init__.py``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` imports: itself, or its longest prefix that is a module (``import a.b.c`` runs a.b)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def imports_of(name: str, tree: ast.Module, modules: dict[str, Path], is_package: bool) -> set[str]:
    """The package's own modules that module ``name`` imports, anywhere in its body.

    ``from x import y`` imports the module ``x.y`` when there is one, else the module ``x`` (a name in it, which
    for a package is a name its ``__init__`` defines or re-exports).
    """
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_target(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else _target(module, modules))
    return {m for m in found if m is not None and m != name}


def lazy_exports(name: str, tree: ast.Module) -> set[str]:
    """The modules a package's lazy public API (a ``_EXPORTS = {public name: module}`` table) loads."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == LAZY for t in node.targets):
            return {f"{name}.{module}" for module in ast.literal_eval(node.value).values()}
    return set()


def import_graph(modules: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each module's imports, and apart from them the lazy public API's."""
    graph, lazy = {}, {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = imports_of(name, tree, modules, is_package)
        lazy[name] = lazy_exports(name, tree) if is_package else set()
    return graph, lazy


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), and modules importing
    themselves."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if group or v in graph.get(v, ()):
                groups.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _graph_of(sources: dict[str, str], tmp_path: Path) -> dict[str, set[str]]:
    """The import graph of a small synthetic package ``pkg``, written out file by file."""
    root = tmp_path / "pkg"
    for rel, text in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    modules = modules_in(root, "pkg")
    return {name: imports_of(name, ast.parse(path.read_text()), modules, path.name == "__init__.py")
            for name, path in modules.items()}  # fmt: skip


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    # Negative control: a cycle closed only inside a function, through relative imports and a package.
    graph = _graph_of({
        "__init__.py": "",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import g\n",
        "c.py": "import pkg.a\n",
        "d.py": "from . import a\n",
    }, tmp_path)  # fmt: skip
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycles({"a": {"b"}, "b": set()}) == [] and cycles({"a": {"a"}}) == [["a"]]


def test_a_package_that_re_exports_its_modules_is_no_cycle_but_a_module_importing_it_back_is(tmp_path):
    # Importing pkg.sub.x runs pkg.sub's __init__ first, so an __init__ that imports its own modules is fine.
    sources = {"__init__.py": "", "sub/__init__.py": "from .x import f\n", "sub/x.py": "def f(): ...\n",
               "y.py": "from .sub.x import f\n"}  # fmt: skip
    assert cycles(_graph_of(sources, tmp_path / "fine")) == []
    # A module taking a name from its own package's __init__ runs into the half-imported package.
    sources["sub/x.py"] = "from . import g\n"
    assert cycles(_graph_of(sources, tmp_path / "loop")) == [["pkg.sub", "pkg.sub.x"]]


def test_no_import_cycles_between_modules():
    graph, lazy = import_graph(modules_in(ROOT, PACKAGE))
    assert len(graph) > 80 and f"{PACKAGE}.loop.cache" in graph[f"{PACKAGE}.generation"]  # the walk found the package
    assert cycles(graph) == []
    # The lazy public API is the only place that may close a loop, and only because it waits for first use.
    assert lazy[PACKAGE] and {m for m, found in lazy.items() if found} == {PACKAGE}
    assert all(m in graph for m in lazy[PACKAGE]), "dflash_mlx.__init__ names a module that is not there"


def test_the_core_never_imports_the_tools():
    graph, lazy = import_graph(modules_in(ROOT, PACKAGE))
    upward = sorted((name, m) for name, deps in graph.items() if not name.startswith(TOOLS)
                    for m in deps | lazy[name] if m.startswith(TOOLS))  # fmt: skip
    assert upward == []
    # The kernels sit below loading, and the generic file helpers below everything.
    assert not [(n, m) for n, deps in graph.items() if n.startswith(f"{PACKAGE}.kernels") for m in deps
                if m.startswith(f"{PACKAGE}.loading")]  # fmt: skip
    assert graph[f"{PACKAGE}.base.files"] <= {f"{PACKAGE}.base.errors"}


def test_the_checker_sees_an_upward_import(tmp_path):
    # Negative control for the test above: a core module's lazy import of a tool is still an edge.
    graph = _graph_of({"__init__.py": "", "generation.py": "def f():\n    from .cli.options import X\n",
                       "cli/__init__.py": "", "cli/options.py": "X = 1\n"}, tmp_path)  # fmt: skip
    assert graph["pkg.generation"] == {"pkg.cli.options"}


def unit(name: str) -> str:
    """The folder a module belongs to (``loop``, ``tools.cli``), or the top-level module itself (``generation``);
    the package's own ``__init__`` is ``""``."""
    parts = name.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "tools" and len(parts) > 1 and (ROOT / "tools" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def layer_of(u: str) -> int | None:
    top = u.split(".")[0]
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between folders: one edge for each module of one importing a module of another."""
    folders = {}
    for name, deps in graph.items():
        folders.setdefault(unit(name), set()).update(unit(m) for m in deps if unit(m) != unit(name))
    return folders


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Each import of a module in a higher layer than the importer's (the package's ``__init__`` excepted: it is
    the public API over all of them, and the tools may import it)."""
    return sorted((name, m) for name, deps in graph.items() if unit(name) for m in deps
                  if unit(m) and layer_of(unit(m)) > layer_of(unit(name)))  # fmt: skip


def test_every_folder_has_a_layer():
    names = {unit(m) for m in modules_in(ROOT, PACKAGE)} - {""}
    assert {n for n in names if layer_of(n) is None} == set()
    # The top of the package stays small: at most 16 entries besides the assets.
    entries = {p.name for p in ROOT.iterdir() if p.name not in ("assets", "__pycache__") and not p.name.startswith(".")}
    assert len(entries) <= 16, sorted(entries)


def test_the_folders_import_downward_only_and_in_no_loop():
    graph, _ = import_graph(modules_in(ROOT, PACKAGE))
    assert upward_imports(graph) == []
    assert cycles(folder_graph(graph)) == []


def test_the_checker_sees_an_import_up_the_layers(tmp_path, monkeypatch):
    # Negative control: a loop module importing a draft source is an upward edge.
    graph = {f"{PACKAGE}.loop.verify": {f"{PACKAGE}.drafts.proposer"}, f"{PACKAGE}.drafts.proposer": set()}
    assert upward_imports(graph) == [(f"{PACKAGE}.loop.verify", f"{PACKAGE}.drafts.proposer")]
    # ... and a model importing the tuning layer, through a function-level import.
    graph = _graph_of({"__init__.py": "", "models/__init__.py": "", "models/target.py": "def f():\n    from ..tuning import policy\n",
                       "tuning/__init__.py": "", "tuning/policy.py": ""}, tmp_path)  # fmt: skip
    graph = {k.replace("pkg", PACKAGE, 1): {m.replace("pkg", PACKAGE, 1) for m in v} for k, v in graph.items()}
    assert upward_imports(graph) == [(f"{PACKAGE}.models.target", f"{PACKAGE}.tuning.policy")]


def test_the_checker_sees_a_loop_between_folders_that_no_module_loop_shows():
    # Negative control: models.target imports models' tree views from drafts, and drafts.tree imports models.hybrid:
    # no module imports itself back, but the two folders do.
    graph = {f"{PACKAGE}.models.target": {f"{PACKAGE}.drafts.tree"}, f"{PACKAGE}.drafts.tree": {f"{PACKAGE}.models.hybrid"},
             f"{PACKAGE}.models.hybrid": set()}  # fmt: skip
    assert cycles(graph) == []
    assert cycles(folder_graph(graph)) == [["drafts", "models"]]
