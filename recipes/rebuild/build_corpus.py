"""Build the training corpus for the tiny target from the Python standard library.

Every function or method with a docstring becomes a chat turn: the user asks with the docstring and the
assistant answers with the function's source, docstring removed (so the answer is never a copy of the
question). Whole modules are also cut into plain code chunks so the model learns raw code too.
A fixed, hash-chosen share of files is held out for evaluation.

    python recipes/rebuild/build_corpus.py --out runs/data
"""

import argparse
import ast
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "ensurepip",
    "__pycache__",
}
HELDOUT_FILE = Path(__file__).parent / "heldout_files.txt"
MAX_CHUNK_LINES = 60
MAX_FUNCTION_CHARS = 4000
MIN_DOCSTRING_CHARS = 20


def list_files(stdlib: Path) -> list[str]:
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        files.append(rel.as_posix())
    return sorted(files)


def is_heldout(rel: str, heldout_per_mille: int) -> bool:
    # A hash of the path, not a random draw, so the split never moves between runs or machines.
    digest = hashlib.sha1(rel.encode()).hexdigest()
    return int(digest[:8], 16) % 1000 < heldout_per_mille


def _strip_docstring(node: ast.AST, lines: list[str]) -> str:
    """Return the source of ``node`` without its docstring, dedented."""
    start = node.lineno
    if node.decorator_list:
        start = min(d.lineno for d in node.decorator_list)
    doc = node.body[0]
    keep = lines[start - 1 : doc.lineno - 1] + lines[doc.end_lineno : node.end_lineno]
    # A function whose body is only a docstring still needs a body.
    if len(node.body) == 1:
        indent = lines[doc.lineno - 1][: len(lines[doc.lineno - 1]) - len(lines[doc.lineno - 1].lstrip())]
        keep.append(indent + "pass")
    return textwrap.dedent("\n".join(keep)).strip("\n") + "\n"


def function_examples(source: str) -> list[dict]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    examples = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(doc) < MIN_DOCSTRING_CHARS or node.body[0].lineno == node.lineno:
            continue
        code = _strip_docstring(node, lines)
        if len(code) > MAX_FUNCTION_CHARS or code.count("\n") < 2:
            continue
        examples.append(
            {
                "messages": [
                    {"role": "user", "content": doc.strip()},
                    {"role": "assistant", "content": code},
                ]
            }
        )
    return examples


def module_chunks(source: str) -> list[dict]:
    lines = source.splitlines()
    chunks = []
    for i in range(0, len(lines), MAX_CHUNK_LINES):
        text = "\n".join(lines[i : i + MAX_CHUNK_LINES]).strip("\n")
        if text.strip():
            chunks.append({"text": text + "\n"})
    return chunks


def main():
    parser = argparse.ArgumentParser(description="Build the stdlib docstring->code corpus.")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/data"),
        help="Output folder for JSONL files.",
    )
    parser.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="Stdlib root.",
    )
    parser.add_argument(
        "--heldout-per-mille",
        type=int,
        default=50,
        help="Share of files held out, per mille.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Shuffle seed for the example order.")
    args = parser.parse_args()

    files = list_files(args.stdlib)
    heldout = [f for f in files if is_heldout(f, args.heldout_per_mille)]
    HELDOUT_FILE.write_text("".join(f + "\n" for f in heldout))
    heldout_set = set(heldout)

    split = {"train": [], "valid": []}
    counts = {"train": [0, 0, 0], "valid": [0, 0, 0]}  # files, chat examples, chunks
    for rel in files:
        name = "valid" if rel in heldout_set else "train"
        source = (args.stdlib / rel).read_text(encoding="utf-8", errors="replace")
        chats, chunks = function_examples(source), module_chunks(source)
        for ex in chats + chunks:
            ex["file"] = rel
        split[name].extend(chats + chunks)
        counts[name][0] += 1
        counts[name][1] += len(chats)
        counts[name][2] += len(chunks)

    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, examples in split.items():
        rng.shuffle(examples)
        with open(args.out / f"{name}.jsonl", "w") as f:
            for ex in examples:
                f.write(json.dumps(ex, ensure_ascii=False) + "\n")
        files_n, chats_n, chunks_n = counts[name]
        print(f"{name}: {files_n} files, {chats_n} chat examples, {chunks_n} code chunks")
    print(f"python {sys.version.split()[0]} stdlib at {args.stdlib}")


if __name__ == "__main__":
    main()
