"""The documentation against the tree: the architecture page lists every module, and every relative link resolves."""

import importlib
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

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


def test_the_readme_install_says_what_pip_calls_the_package():
    # The project is dflash-mlx, the distribution mlx-dflash: `pip show dflash-mlx` finds nothing.
    install = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip show\nmlx-dflash" in install or "pip show mlx-dflash" in install
    assert "`dflash-mlx` was taken" in install and "--version" in install


# Each tool's page and its parser: a flag added to --help and left out of the page fails here.
TOOL_PAGES = {
    "dflash_mlx.tools.cli.generate:setup_arg_parser": "generate.md",
    "dflash_mlx.tui.app:setup_arg_parser": "chat.md",
    "dflash_mlx.tools.bench.benchmark:setup_arg_parser": "bench.md",
    "dflash_mlx.convert.convert:configure_parser": "convert.md",
    "dflash_mlx.tools.server.app:setup_arg_parser": "serve.md",
    "dflash_mlx.tools.train.cli:setup_arg_parser": "train.md",
}


def _actions(parser: str) -> list:
    module, name = parser.split(":")
    return getattr(importlib.import_module(module), name)()._actions


@pytest.mark.parametrize("parser, page", TOOL_PAGES.items())
def test_every_flag_in_a_tools_help_is_on_its_page(parser, page):
    actions = _actions(parser)
    text = (REPO / "docs" / page).read_text()
    missing = [
        a.option_strings[0]
        for a in actions
        if a.option_strings and a.dest not in ("help", "version")
        and not any(f"`{o}" in text for o in a.option_strings if o.startswith("--"))
    ]  # fmt: skip
    assert not missing, f"docs/{page} does not name {missing}"


FLAG = re.compile(r"`(--[a-z][a-z0-9-]*)")


@pytest.mark.parametrize("parser, page", TOOL_PAGES.items())
def test_every_flag_a_tools_page_names_is_a_tools_flag(parser, page):
    # A page may name another tool's flag (serve.md: dflash-bench's --concurrency), never one no tool has.
    ours = {o for p in TOOL_PAGES for a in _actions(p) for o in a.option_strings}
    own = {o for a in _actions(parser) for o in a.option_strings}
    text = (REPO / "docs" / page).read_text()
    # generate.md's table of mlx-lm's flags it lacks: those must stay absent from its --help.
    table = "".join(re.findall(r"^\| mlx-lm flag \|.*?\n\n", text, re.M | re.S))
    lacked = {f for row in re.findall(r"^\| ([^|]*)\|", table, re.M) for f in FLAG.findall(row) if " with " not in row}
    assert not lacked & own, f"docs/{page} says its tool lacks {sorted(lacked & own)}, which it has"
    unknown = sorted(set(FLAG.findall(text)) - ours - lacked)
    assert not unknown, f"docs/{page} names {unknown}, which no tool's --help has"


def test_the_flag_check_reads_generates_table_of_mlx_lm_flags():
    text = (REPO / "docs" / "generate.md").read_text()
    table = text.split("| mlx-lm flag |", 1)[1].split("\n\n", 1)[0]
    assert "`--kv-bits`" in table and "`--max-kv-size` with a drafter" in table


def test_the_chat_page_lists_the_apps_help_commands_and_keys():
    from dflash_mlx.tui.commands import HELP

    text = (REPO / "docs" / "chat.md").read_text()
    commands = set(re.findall(r"`(/[a-z!]+(?: auto)?)", HELP))
    assert {"/block", "/block auto", "/tree", "/tree auto", "/cutoff", "/save!"} <= commands
    assert not [c for c in commands if f"`{c}" not in text]
    # And the page documents no command the app does not have.
    assert not [c for c in re.findall(r"^\| `(/[a-z!]+)", text, re.M) if c not in commands]
    keys = re.findall(r"`([A-Z][a-z]*(?:\+[A-Z])?)`", HELP.split("**Commands**")[0])
    assert {"Enter", "Esc", "Ctrl+C", "Ctrl+J", "Ctrl+L", "Ctrl+Q"} <= set(keys)
    assert not [k for k in keys if f"`{k}`" not in text]


def test_the_bench_page_names_every_method_and_their_number():
    from dflash_mlx.tools.bench.timing import METHODS

    text = (REPO / "docs" / "bench.md").read_text()
    defaults = text.split("Defaults:", 1)[1].split("\n\n", 1)[0]
    assert not [m for m in METHODS if f"`{m}`" not in defaults]
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert f"all {words[len(METHODS) - 1]}" in defaults
    assert "unlike the other tools" not in text  # its dtype default is dflash-generate's
