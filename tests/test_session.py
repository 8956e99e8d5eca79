"""The tools' session: the set-up every tool shares, done in one place, and the tools built on it."""

import ast
from pathlib import Path

import pytest

from dflash_mlx import DFlashError, stream_generate
from dflash_mlx.loop.cache import DFlashCache
from dflash_mlx.sampling import make_sampler
from dflash_mlx.tools.session import Session
from dflash_mlx.tuning.policy import PolicyState, PolicyStore

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_mlx"
# Each tool's modules, and the ones among them that open the session.
TOOLS = {
    "dflash-generate": (["tools/cli"], "tools/cli/generate.py"),
    "dflash-chat": (["tui"], "tui/engine.py"),
    "dflash-serve": (["tools/server"], "tools/server/app.py"),
    "dflash-bench": (["tools/bench"], "tools/bench/benchmark.py"),
}
# The set-up steps the session owns: a tool that imports one of these repeats its work.
SET_UP = {
    "dflash_mlx.loading.loading": None,  # load
    "dflash_mlx.loading.registry": {"draft_for_cli"},
    "dflash_mlx.loop.cache": {"make_cache"},
    "dflash_mlx.drafts.datastore": {"load_datastore", "open_datastore"},
    "dflash_mlx.tuning.policy": {"policy_key"},
}
# The benchmark times each method on caches of its own, fresh for every run: measuring, not setting up.
ALLOWED = {("tools/bench/timing.py", "dflash_mlx.loop.cache", "make_cache")}


def _absolute(module: str | None, level: int, path: Path) -> str:
    if not level:
        return module or ""
    parts = ["dflash_mlx", *path.relative_to(PACKAGE).parent.parts]
    return ".".join([*parts[: len(parts) - level + 1], *([module] if module else [])])


def set_up_imports(source: str, path: Path) -> list[tuple[str, str]]:
    """The set-up steps (module, name) that ``source`` imports, at module level or in a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, path)
            for alias in node.names:
                names = SET_UP.get(module, ())
                if module in SET_UP and (names is None or alias.name in names):
                    found.append((module, alias.name))
                elif f"{module}.{alias.name}" in SET_UP and SET_UP[f"{module}.{alias.name}"] is None:
                    found.append((f"{module}.{alias.name}", "*"))
        elif isinstance(node, ast.Import):
            found += [(a.name, "*") for a in node.names if a.name in SET_UP and SET_UP[a.name] is None]
    return found


def opens_a_session(source: str, path: Path) -> bool:
    """Whether ``source`` imports :class:`Session` from the tools' session module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and _absolute(node.module, node.level, path) == "dflash_mlx.tools.session":
            if any(a.name == "Session" for a in node.names):
                return True
    return False


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_tool_builds_on_the_session_and_repeats_none_of_its_steps(tool):
    folders, opener = TOOLS[tool]
    assert opens_a_session((PACKAGE / opener).read_text(), PACKAGE / opener)
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            relative = path.relative_to(PACKAGE).as_posix()
            steps = [s for s in set_up_imports(path.read_text(), path) if (relative, *s) not in ALLOWED]
            assert steps == [], f"{relative} sets up by itself: {steps}; ask the session (tools/session.py)"


def test_the_checks_see_a_tool_that_sets_up_by_itself():
    # Negative controls: each way of reaching a set-up step is seen, and a tool without the session is told.
    path = PACKAGE / "tools" / "cli" / "generate.py"
    sources = {
        "from ...loading.loading import load": [("dflash_mlx.loading.loading", "load")],
        "def main():\n    from ...loading import loading": [("dflash_mlx.loading.loading", "*")],
        "import dflash_mlx.loading.loading": [("dflash_mlx.loading.loading", "*")],
        "from dflash_mlx.loop.cache import DFlashCache, make_cache": [("dflash_mlx.loop.cache", "make_cache")],
        "from ...tuning.policy import PolicyStore, policy_key": [("dflash_mlx.tuning.policy", "policy_key")],
        "from ...loop.cache import DFlashCache": [],
    }
    for source, found in sources.items():
        assert set_up_imports(source, path) == found, source
    assert not opens_a_session("from ...generation import generate", path)
    assert opens_a_session("def main():\n    from ..session import Session", path)


def test_a_session_opens_the_pair_as_the_tools_ask(pair_dirs, tmp_path):
    session = Session.open(str(pair_dirs["qwen3-tied"]), str(pair_dirs["draft"]), extra_eos_token=["7"])
    assert session.draft is not None and session.draft_path == str(pair_dirs["draft"])
    assert 7 in session.tokenizer.eos_token_ids
    assert isinstance(session.make_cache(), DFlashCache) and session.make_cache() is not session.make_cache()
    with pytest.raises(DFlashError, match="--datastore missing.jsonl: no such file"):
        session.open_datastore("missing.jsonl")
    assert session.open_datastore("none") is None and session.datastore is None
    assert session.open_datastore("auto").session_length == 0  # not the default pair: its replies only
    plain = Session.open(str(pair_dirs["qwen3-tied"]), str(pair_dirs["draft"]), no_draft=True)
    assert plain.draft is None and plain.open_datastore("auto") is None  # plain decoding stays plain
    with pytest.raises(DFlashError, match="--extra-eos-token 'nope' is not a token"):
        Session.open(str(pair_dirs["qwen3-tied"]), str(pair_dirs["draft"]), extra_eos_token=["nope"])


def test_a_session_keeps_one_policy_per_setup_and_its_store(qwen3_pair, tmp_path):
    store = PolicyStore(tmp_path / "policy.json")
    session = Session(*qwen3_pair, policy_store=store)
    first = session.policy({"chat": [4, False]})
    assert session.policy({"chat": [4, False]}) is first and session.policy({"chat": [8, False]}) is not first
    first.plain_left = 7
    session.keep_policies()
    assert len(store.read()) == 2
    again = Session(*qwen3_pair, policy_store=store)
    assert again.policy({"chat": [4, False]}).plain_left == 7  # the next process goes on from it
    # Without a store nothing is written; a drafter that is not a DFlash drafter is never stored.
    alone = Session(*qwen3_pair)
    assert isinstance(alone.policy({"chat": [4, False]}), PolicyState) and alone.policy({}, lookup=0).lookup == 0
    alone.keep_policies()
    model, _, tokenizer = qwen3_pair
    assert Session(model, None, tokenizer, policy_store=store).policy({"chat": [4, False]}).plain_left != 7


def test_the_session_streams_what_the_public_api_streams(qwen3_pair):
    model, draft, tokenizer = qwen3_pair
    session = Session(model, draft, tokenizer)
    settings = dict(max_tokens=12, block_size=4, sampler=make_sampler(0.0), adaptive=False)
    ours = [r.tokens for r in session.stream([1, 2, 3, 4], prompt_cache=session.make_cache(), **settings)]
    public = [r.tokens for r in stream_generate(model, draft, tokenizer, [1, 2, 3, 4], **settings)]
    assert ours == public and sum(map(len, ours)) == 12
    assert session.generate([1, 2, 3, 4], **settings) == "".join(
        r.text for r in stream_generate(model, draft, tokenizer, [1, 2, 3, 4], **settings)
    )


def test_the_session_passes_the_policy_of_the_setup_itself(qwen3_pair, monkeypatch):
    from dflash_mlx import generation

    seen = []
    monkeypatch.setattr(generation, "stream_generate", lambda *a, **k: seen.append(k) or iter(()))
    session = Session(*qwen3_pair, datastore="store")
    list(session.stream([1, 2], setup={"chat": [4]}, max_tokens=3))
    list(session.stream([1, 2], setup={"chat": [4]}))
    list(session.stream([1, 2], policy="given"))
    assert seen[0]["policy"] is seen[1]["policy"] is session.policy({"chat": [4]}) and seen[0]["datastore"] == "store"
    assert seen[2]["policy"] == "given" and len(session.policies) == 1
