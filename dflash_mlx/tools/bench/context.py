"""Long-context prompts for ``dflash-bench --context``: a document cut to a length, then a question.

The documents file holds one ``{"document", "question", "category", "source"}`` per line
(the default pair's: ``assets/smollm2/long_context.jsonl``, from its recipe). Each prompt is
the chat-templated user turn ``document[:n tokens] + question``, with ``n`` chosen so the
whole prompt is the bucket's length; the bucket's label (``2k``) is its category.
"""

import re
from pathlib import Path

from ...base.errors import DFlashError
from ...base.files import read_objects
from ...text.chat_template import has_chat_template, render_chat


def parse_lengths(spec: str) -> list[int]:
    """``"1k,2k,4k,7k"`` (k = 1024 tokens) or plain token counts, as a sorted list."""
    lengths = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(k?)\s*", part, re.IGNORECASE)
        if not m or int(m.group(1)) < 1:
            raise DFlashError(f"--context {spec!r}: {part!r} is not a length; pass tokens like 1k,2k,4k,7k or 1500.")
        lengths.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return sorted(set(lengths))


def label(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def load_documents(path: Path) -> list[dict]:
    docs = []
    for n, row in read_objects(path, "--documents", "documents"):
        if not isinstance(row.get("document"), str) or not row.get("question"):
            raise DFlashError(f"{path}:{n} needs a 'document' text and a 'question'.")
        docs.append(row)
    return docs


def _render(tokenizer, text: str) -> list[int]:
    if has_chat_template(tokenizer):
        return render_chat(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def context_rows(tokenizer, documents: list[dict], lengths: list[int]) -> list[dict]:
    """One benchmark row per (length, document), its prompt ``ids`` already encoded.

    Raises:
        DFlashError: When a document is too short for a length.
    """
    # Each document and question is encoded once, not once per length. Documents run past the
    # model's context on purpose (they are cut below), so the tokenizer's "longer than the
    # maximum" warning would only alarm the reader.
    encoded = []
    for doc in documents:
        question = "\n\n" + doc["question"]
        doc_ids = tokenizer.encode(doc["document"], add_special_tokens=False, verbose=False)
        encoded.append((doc, question, len(_render(tokenizer, question)), doc_ids))
    rows = []
    for length in lengths:
        for doc, question, question_len, doc_ids in encoded:
            room = length - question_len
            if room < 1 or len(doc_ids) < room:
                raise DFlashError(
                    f"The document {doc.get('source', '?')!r} has {len(doc_ids)} tokens, too few for a "
                    f"{label(length)} prompt; pass a shorter --context or longer documents."
                )
            ids = _render(tokenizer, tokenizer.decode(doc_ids[:room]) + question)
            rows.append({"category": label(length), "source": doc.get("source"), "ids": ids, "context": length})
    return rows
