"""How much the tests bite: plant small realistic bugs one at a time in a scratch copy of the tree and run the
tests that should see each one; every planted bug must make at least one of them fail.

Each bug is a text edit (``old`` -> ``new``, ``old`` found exactly once in its file) in a copy of the repository
made once in a temporary folder (the working tree is never touched), run with this interpreter and the copy first
on ``PYTHONPATH``, OpenBLAS preloaded. A bug whose ``old`` text is not found (or found more than once) is a failure
of its own, "pattern not found": the code moved, and the table below needs re-targeting. The unmutated copy runs
the same tests first (``--no-baseline`` skips it): a test that fails without a bug would "catch" every one.

    python recipes/measure/mutants.py                 # every bug (make mutants)
    python recipes/measure/mutants.py tree- hybrid-   # the bugs whose names start so
    python recipes/measure/mutants.py --list

Exit status 0 only when every bug chosen was caught.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Bug:
    """A planted bug: ``old`` replaced by ``new`` in ``file`` (each pair of ``edits``), caught when the pytest run
    of ``tests`` (files, optionally ``::name`` or with ``-k``) fails."""

    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file, old, new)
    tests: tuple[str, ...]
    k: str | None = None


def bug(name, what, file, old, new, tests, k=None, more=()):
    return Bug(name, what, ((file, old, new), *more), tuple(tests), k)


P = "dflash_mlx/"
TREE, VOCAB, SLIDING, HYBRID = (
    "tests/test_tree.py",
    "tests/test_draft_vocab.py",
    "tests/test_gpt_oss.py",
    "tests/test_hybrid.py",
)
DATASTORE, FREE, ADAPTIVE = "tests/test_datastore.py", "tests/test_free_drafts.py", "tests/test_adaptive.py"
STATE = "branching_tree_leaves_the_state"  # test_tree's direct state check
KEY = "ident = json.dumps([machine_key(), model_key(model), drafter, setup], sort_keys=True)"
# fmt: off
BUGS = [
    # Draft trees.
    bug("tree-draft-vocab", "a tree from a drafter with a draft vocabulary walks on draft-vocabulary ids",
        P + "drafts/proposer.py", "            tree = DraftTree(tokens.tolist(), tree.parents, tree.depths, tree.log_probs)\n",
        "", [VOCAB], k="trees_with_a_draft_vocab"),
    bug("tree-processor-path", "each tree node's logits processors see the cached tokens only, not its own path",
        P + "loop/verify.py", "rows.append(self.cache.tokens + [last] + path[::-1])",
        "rows.append(self.cache.tokens + [last])", [TREE], k="repetition_penalty_sees"),
    bug("tree-keep-first-branch", "the first nodes' keys and values are kept instead of the accepted branch's",
        P + "models/tree.py", "if path != list(range(len(path))):", "if False:", [TREE], k=STATE),
    bug("tree-mask-chain", "a node sees the node before it (a chain) instead of its parent's ancestors",
        P + "models/tree.py", "rows[i] = list(rows[self.parents[i]])", "rows[i] = list(rows[i - 1])", [TREE], k=STATE),
    bug("tree-positions", "tree nodes at consecutive positions instead of offset + depth",
        P + "models/tree.py", "positions = (offset + depths).astype(mx.int32)",
        "positions = (offset + mx.arange(len(tree.depths) + 1)).astype(mx.int32)", [TREE], k=STATE),
    bug("tree-taps-prefix", "the drafter is given the taps of the first nodes, not of the accepted path",
        P + "loop/verify.py", "taps = taps[:, mx.array(path)]", "taps = taps[:, : len(path)]", [TREE], k=STATE),
    bug("tree-bonus", "the bonus token is the target's token after the root, not after the path's last node",
        P + "models/tree.py", "return path, target_tokens[path[-1]]", "return path, target_tokens[path[0]]",
        [TREE], k="greedy_equals"),
    bug("tree-sibling-score", "a sibling's score keeps its elder sibling's log-probability",
        P + "drafts/tree.py", "sibling = logw - log_probs[depth - 1][rank] + log_probs[depth - 1][rank + 1]",
        "sibling = logw + log_probs[depth - 1][rank + 1]", [TREE], k="most_likely"),
    # Sliding-window layers in a tree pass (gpt-oss's tiny target).
    bug("sliding-tree-window-edge", "a tree node sees one committed position past its window",
        P + "models/tree.py", "visible_past = past[None, :] > depths[:, None] - window",
        "visible_past = past[None, :] >= depths[:, None] - window", [SLIDING], k="draft_trees"),
    bug("sliding-tree-ancestor-window", "a tree node sees an ancestor a window away",
        P + "models/tree.py", "depths[:, None] - depths[None, :] < window", "depths[:, None] - depths[None, :] <= window",
        [SLIDING], k="draft_trees"),
    bug("sliding-keep-row", "a sliding window's buffer rows of the kept path counted from position 0",
        P + "models/tree.py", "first = start - (c.start if isinstance(c, SlidingKVCache) else 0)", "first = start",
        [SLIDING], k="draft_trees"),
    # Hybrid (Gated DeltaNet) targets.
    bug("hybrid-tree-wrong-node-state", "the recurrent state of the node at the path's length is installed",
        P + "models/hybrid.py", "self.cache = [mx.contiguous(conv_input[:, -width:]), states[path[-1]]]",
        "self.cache = [mx.contiguous(conv_input[:, -width:]), states[len(path) - 1]]", [HYBRID], k="trees_fork"),
    bug("hybrid-tree-conv-rows", "the convolution state of the first nodes, not of the path",
        P + "models/hybrid.py", "rows = list(range(width)) + [width + i for i in path]",
        "rows = list(range(width)) + [width + i for i in range(len(path))]", [HYBRID], k="trees_fork"),
    bug("hybrid-tree-rollback-states", "a cut inside the accepted path rolls back to the first nodes' states",
        P + "models/hybrid.py", "self._steps = (conv_input, [states[i] for i in path])",
        "self._steps = (conv_input, states[: len(path)])", [HYBRID], k="trees_fork"),
    bug("hybrid-trim-state", "a trim after a verify pass selects the state one token late",
        P + "models/hybrid.py", "states[keep - 1]]", "states[min(keep, len(states) - 1)]]",
        [HYBRID], k="recurrent_trim_equals"),
    # The datastore.
    bug("datastore-query-early", "the datastore proposer queries the text before the last committed token",
        P + "drafts/datastore.py", "text = self.history[-self.store.max_order :] + [last]",
        "text = self.history[-self.store.max_order :]", [DATASTORE], k="queries or datastore_alone"),
    bug("datastore-shortest-first", "the datastore tries its shortest match first",
        P + "drafts/datastore.py", "for order in range(min(self.max_order, len(text)), self.min_order - 1, -1):",
        "for order in range(self.min_order, min(self.max_order, len(text)) + 1):", [DATASTORE], k="longest_match"),
    bug("bench-datastore-learns", "the benchmark's datastore learns from the runs",
        P + "tools/bench/benchmark.py", "open_datastore(datastore, model, vocab_size(target), learns=False)",
        "open_datastore(datastore, model, vocab_size(target))", ["tests/test_benchmark.py"], k="datastore"),
    # Free drafts.
    bug("free-query-early", "free drafts query the text before the last committed token",
        P + "drafts/free.py", "self._candidates(self.history + [last], n)", "self._candidates(self.history, n)",
        [FREE], k="query"),
    bug("free-worse-offer", "free drafts verify the last offer that beats a plain step, not the best",
        P + "drafts/free.py", "if k and rate > best[5]:", "if k and rate > 1.0:", [FREE], k="offers"),
    bug("free-costs-never-forget", "the cost estimates weigh every cycle ever timed alike",
        P + "tuning/policy.py", "self.sizes[drafts] = (0.98 * weight + 1.0, 0.98 * total + y)",
        "self.sizes[drafts] = (weight + 1.0, total + y)", [FREE], k="machine_speed",
        more=((P + "tuning/policy.py", "self.fit = [0.98 * s + v", "self.fit = [s + v"),)),
    bug("free-hits-off-by-one", "a draft at the first wrong position is counted as right",
        P + "tuning/policy.py", "hit[0] += i < accepted", "hit[0] += i <= accepted", [FREE], k="chances"),
    # The adaptive policy.
    bug("policy-key-no-setup", "the policy key ignores the drafting setup",
        P + "generation.py", KEY, KEY.replace(", setup]", "]"), [ADAPTIVE], k="policy_key"),
    bug("policy-key-no-drafter", "the policy key ignores the drafter",
        P + "generation.py", KEY, KEY.replace(" drafter,", ""), [ADAPTIVE], k="policy_key"),
    bug("policy-saved-field-dropped", "a field dropped from the policy's save list",
        P + "tuning/policy.py", '_SAVED = ("plain_time", "draft_time", "plain_left", "run", "since_plain")',
        '_SAVED = ("plain_time", "draft_time", "plain_left", "run")', [ADAPTIVE], k="saved_policy_field"),
    bug("policy-no-backoff", "a losing window does not double the next plain run",
        P + "tuning/policy.py", "min(2 * self.run, self.max_run)", "min(self.run, self.max_run)",
        [ADAPTIVE], k="backs_off"),
    # Distributed.
    bug("distributed-drafts-shifted", "the followers read the drafts one slot late",
        P + "loop/distributed.py", "Proposal(mx.array(total[start : start + n_drafts - 1], dtype=mx.uint32))",
        "Proposal(mx.array(total[start + 1 : start + n_drafts], dtype=mx.uint32))",
        ["tests/test_distributed.py"], k="greedy_on_two_ranks"),
    # Sampling with trees.
    bug("sampling-tree-argmax", "a sampled tree walks on the target's argmax instead of its samples",
        P + "loop/verify.py", "target_tokens = self._sample(logits)  # (n + 1,)\n        path, bonus",
        "target_tokens = mx.argmax(logits, axis=-1)  # (n + 1,)\n        path, bonus",
        ["tests/test_sampling.py"], k="draft_trees"),
]
# fmt: on


def scratch_copy(dest: Path) -> Path:
    """The repository's files (not .git, virtual environments or caches) under ``dest``."""
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "*.egg-info")
    shutil.copytree(ROOT, dest, ignore=skip, symlinks=True)
    return dest


def run_tests(tree: Path, tests: tuple[str, ...], k: str | None, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "dflash_mlx.cpu.openblas", sys.executable, "-m", "pytest", "-q", "-x", "-n", "0",
           "-p", "no:cacheprovider", *tests]  # fmt: skip
    if k:
        cmd += ["-k", k]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else done.stderr.strip()[-200:]


def plant(tree: Path, b: Bug) -> dict[Path, str] | str:
    """The bug's edits applied in ``tree``; returns the files' original texts, or why it could not be planted."""
    originals: dict[Path, str] = {}
    for file, old, new in b.edits:
        path = tree / file
        text = originals.get(path) or path.read_text()
        current = path.read_text()
        if current.count(old) != 1:
            for p, t in originals.items():
                p.write_text(t)
            return f"pattern not found in {file}" if current.count(old) == 0 else f"pattern found twice in {file}"
        originals.setdefault(path, text)
        path.write_text(current.replace(old, new))
    return originals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only the bugs whose names start with one of these")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated copy")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one bug's tests")
    args = parser.parse_args()
    chosen = [b for b in BUGS if not args.names or any(b.name.startswith(n) for n in args.names)]
    if args.list:
        for b in chosen:
            print(f"{b.name:32} {b.what}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="dflash-mutants-") as tmp:
        tree = scratch_copy(Path(tmp) / "tree")
        if not args.no_baseline:
            for b in chosen:
                rc, last = run_tests(tree, b.tests, b.k, args.timeout)
                if rc != 0:
                    print(f"baseline fails for {b.name} ({' '.join(b.tests)} -k {b.k!r}): {last}")
                    return 2
            print(f"baseline: the tests of {len(chosen)} bugs pass unmutated", flush=True)
        for b in chosen:
            start = time.perf_counter()
            planted = plant(tree, b)
            if isinstance(planted, str):
                verdict, last = "PATTERN NOT FOUND", planted
            else:
                try:
                    rc, last = run_tests(tree, b.tests, b.k, args.timeout)
                finally:
                    for path, text in planted.items():
                        path.write_text(text)
                # 1: a test failed; 0: all passed; 5: no test selected; -1: timed out; others: errors.
                verdict = {1: "caught", 0: "NOT CAUGHT", 5: "NO TESTS RAN"}.get(rc, f"ERROR (pytest exit {rc})")
            seconds = time.perf_counter() - start
            results.append((b, verdict))
            print(f"{b.name:32} {verdict:18} {seconds:6.1f}s  {last}", flush=True)
    missed = [b for b, v in results if v != "caught"]
    print(f"\n{len(results) - len(missed)} of {len(results)} planted bugs caught")
    for b in missed:
        print(f"  not caught: {b.name}: {b.what}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
