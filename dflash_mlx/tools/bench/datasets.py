"""The paper's benchmark prompt sets, fetched from the Hugging Face hub when online.

Each set is one file of a dataset repository; its question field becomes a chat prompt with the
set's name as the category. Offline, pass a local JSONL file to ``dflash-bench --prompts``.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from ...base.errors import DFlashError


@dataclass(frozen=True)
class PromptSet:
    repo: str
    filename: str
    field: str


DATASETS = {
    "gsm8k": PromptSet("openai/gsm8k", "main/test-00000-of-00001.parquet", "question"),
    "math500": PromptSet("HuggingFaceH4/MATH-500", "test.jsonl", "problem"),
    "humaneval": PromptSet("openai/openai_humaneval", "openai_humaneval/test-00000-of-00001.parquet", "prompt"),
    "mbpp": PromptSet("google-research-datasets/mbpp", "full/test-00000-of-00001.parquet", "text"),
    "mt-bench": PromptSet("HuggingFaceH4/mt_bench_prompts", "raw/question.jsonl", "prompt"),
}


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DFlashError(f"Reading {path.name} needs pyarrow: pip install pyarrow.") from e
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_prompt_set(name: str, limit: int | None = None) -> list[dict]:
    """The prompts of a named set as benchmark rows (``messages`` + ``category``).

    Raises:
        DFlashError: For an unknown name, or when the hub cannot be reached.
    """
    if name not in DATASETS:
        raise DFlashError(f"Unknown prompt set {name!r}; choose from {', '.join(DATASETS)} or pass a JSONL file.")
    spec = DATASETS[name]
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(spec.repo, spec.filename, repo_type="dataset"))
    except Exception as e:  # offline, 404, auth: the hub client raises many types
        raise DFlashError(
            f"Could not get the {name} prompts from the Hugging Face hub ({type(e).__name__}). "
            "Go online, or pass a local JSONL file with --prompts."
        ) from e
    rows = []
    for row in _rows(path)[:limit]:
        text = row[spec.field]
        # mt-bench keeps a list of turns; the first one is the prompt.
        text = text[0] if isinstance(text, list) else text
        rows.append({"category": name, "messages": [{"role": "user", "content": text}]})
    return rows
