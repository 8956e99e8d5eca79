"""Write the long-context documents of ``dflash-bench --context``.

Four documents, each long enough for a 7k-token prompt, from modules of Python's standard
library that the default pair's drafter never saw (its held-out packages: DATA.md): two
source files and two modules' documentation as pydoc renders it, each with a question or
a continuation request. ``dflash-bench --context 1k,2k,4k,7k`` cuts each document to fit
the length and asks its question after it.

    python recipes/measure/long_context_prompts.py --out assets/smollm2/long_context.jsonl
"""

import argparse
import difflib
import inspect
import json
import pickle
import pydoc
import re
import socket
import sys
from pathlib import Path

MAX_CHARS = 40_000  # about 10k tokens of code, more than the longest bucket needs

DOCUMENTS = [
    ("code", "stdlib:difflib", lambda: inspect.getsource(difflib),
     "What does the code above do? Describe its main classes and functions."),
    ("code", "stdlib:pickle", lambda: inspect.getsource(pickle),
     "Continue the code above from where it stops."),
    ("summarize", "stdlib:re", lambda: pydoc.plain(pydoc.render_doc(re)),
     "Summarize the documentation above in a few sentences."),
    ("chat", "stdlib:socket", lambda: pydoc.plain(pydoc.render_doc(socket)),
     "Based on the documentation above, how do I write a small TCP echo server? Show a short example."),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets/smollm2/long_context.jsonl")
    args = parser.parse_args()
    lines = []
    for category, source, text, question in DOCUMENTS:
        # pydoc ends with the module's FILE path on this machine: not part of the document.
        document = re.sub(r"\nFILE\n    \S+\n*$", "\n", text())[:MAX_CHARS]
        lines.append(json.dumps({"category": category, "source": source, "document": document, "question": question}))
    Path(args.out).write_text("".join(line + "\n" for line in lines))
    print(f"wrote {len(lines)} documents to {args.out} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
