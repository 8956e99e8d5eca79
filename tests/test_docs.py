"""The documentation against the tree: the architecture page lists every module, and every relative link resolves."""

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
PACKAGE_ROOTS = ("dflash_mlx",)
# A list item that opens with a module path: "- `dflash_mlx/loop/cache.py`: ..." or a subpackage: "- `dflash_mlx/models/`: ..."
LISTED = re.compile(rf"^- `((?:{'|'.join(PACKAGE_ROOTS)})/(?:[\w/]*\.py|[\w/]*/)?)`", re.MULTILINE)
# [text](target), skipping images' "!" prefix the same way; the target stops at whitespace or ")".
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _modules_on_disk() -> set[str]:
    found = set()
    for root in PACKAGE_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO).as_posix()
            # A package stands for its __init__.py: listed as its folder.
            found.add(rel[: -len("__init__.py")] if path.name == "__init__.py" else rel)
    return found


def test_the_architecture_page_lists_every_module_and_nothing_else():
    page = (REPO / "docs" / "architecture.md").read_text()
    listed = set(LISTED.findall(page))
    on_disk = _modules_on_disk()
    missing, extra = sorted(on_disk - listed), sorted(listed - on_disk)
    assert not missing and not extra, f"docs/architecture.md lacks {missing} and lists {extra}, which are not on disk"


def _markdown_pages() -> list[Path]:
    docs = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "recipes" / "README.md", *(REPO / "docs").rglob("*.md")]
    return docs + sorted((REPO / "notes").glob("*.md"))  # history, not documentation: its links resolve too


def test_every_relative_link_in_the_docs_points_to_a_file():
    broken = []
    for page in _markdown_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = unquote(target.split("#")[0])
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"links to nothing: {broken}"
