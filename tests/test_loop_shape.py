"""The loop's shape, read from the sources: one screen of propose -> verify -> commit, with the sharded
target's ranks, the family differences and the layer caches' kinds kept out of it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dflash_mlx"
MAX_LOOP_LINES = 60
# The folders above models/ that must ask the family table (models/families.py), never a model_type.
ABOVE_MODELS = ("loop", "tuning", "drafts", "generation.py")
# A model_type read as part of a key, not to choose a path (the pass costs' store key).
KEYS = {("tuning/widths.py", "model_key")}


def code_lines(source: str, name: str) -> int:
    """Lines of code of function ``name`` in ``source``: its signature and body, without its docstring,
    comments and blank lines."""
    tree = ast.parse(source)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines()[fn.lineno - 1 : fn.end_lineno]
    doc = fn.body[0]
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        del lines[doc.lineno - fn.lineno : doc.end_lineno - fn.lineno + 1]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def model_type_reads(source: str) -> list[str]:
    """The functions of ``source`` that read an attribute or key named ``model_type``."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            attr = isinstance(node, ast.Attribute) and node.attr == "model_type"
            text = isinstance(node, ast.Constant) and node.value == "model_type"
            if attr or text:
                found.append(fn.name)
                break
    return found


def test_the_loop_fits_on_one_screen():
    source = (ROOT / "generation.py").read_text()
    assert code_lines(source, "dflash_generate_step") <= MAX_LOOP_LINES


def test_the_loop_knows_nothing_of_ranks():
    source = (ROOT / "generation.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(source)) if getattr(n, "name", None) == "dflash_generate_step")
    names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
    }
    assert not names & {"peers", "Peers", "leads", "settle"}


def test_the_code_above_models_asks_the_family_table():
    reads = []
    for part in ABOVE_MODELS:
        paths = [ROOT / part] if part.endswith(".py") else sorted((ROOT / part).rglob("*.py"))
        for path in paths:
            rel = str(path.relative_to(ROOT))
            reads += [(rel, fn) for fn in model_type_reads(path.read_text()) if (rel, fn) not in KEYS]
    assert reads == []


def test_the_counters_can_fail():
    long_loop = "def f():\n    '''doc\n    more'''\n" + "    x = 1\n" * (MAX_LOOP_LINES + 1)
    assert code_lines(long_loop, "f") == MAX_LOOP_LINES + 2 > MAX_LOOP_LINES  # the signature counts
    assert code_lines("def f():\n    '''doc'''\n    # why\n\n    return 1\n", "f") == 2
    branching = "def g(model):\n    if model.model_type in ('a', 'b'):\n        return 1\n"
    assert model_type_reads(branching) == ["g"]
    assert model_type_reads("def h(config):\n    return config.get('model_type')\n") == ["h"]
