"""Files and formats: loading a pair, the registry of published pairs, GGUF, atomic writes, JSONL."""
