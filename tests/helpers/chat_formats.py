"""Tiny tokenizers in the chat formats of reasoning models, and a target that says a script.

``write_harmony_tokenizer`` has gpt-oss's harmony markers as special tokens and a small
template in harmony's shape (system, developer, user and final-channel assistant messages,
``reasoning_effort`` in the system message, a generation prompt ending with
``<|start|>assistant``); ``write_gemma_tokenizer`` has Gemma 4's turn and thought markers and a
template that opens a system turn for a system prompt or for ``<|think|>`` (``enable_thinking``).
Both keep the 128-token vocabulary of ``helpers.checkpoints``, with the EOS (``<|return|>``,
``<turn|>``) at its id and ``<|mask|>`` at the drafter's mask id, so they fit its tiny targets.
Their decoder joins tokens without spaces, as the real byte-level and SentencePiece ones do
around these markers.

``ScriptedReply`` is a logits processor that makes any target reply with given tokens, so a
real pair produces a reasoning model's output through every layer (generation, server, chat).
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx

from helpers.checkpoints import VOCAB

HARMONY_WORDS = ["system", "developer", "user", "assistant", "analysis", "final", "Reasoning:", "low",
                 "medium", "high"]  # fmt: skip
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|endoftext|>", "<|return|>", "<|mask|>"]
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}"
    "<|end|>"
    "{%- for m in messages %}"
    "{%- if m.role in ('system', 'developer') %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if '<|channel|>' in m.content %}{{ raise_exception('pass the final channel alone as content') }}{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)

GEMMA_WORDS = ["system", "user", "model", "thought"]
GEMMA_SPECIALS = ["<|turn>", "<|think|>", "<|channel>", "<channel|>", "<|endoftext|>", "<turn|>", "<|mask|>"]
GEMMA_TEMPLATE = (
    "{%- set thinking = enable_thinking | default(false) %}"
    "{%- set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{%- if thinking or system %}<|turn>system\n{% if thinking %}<|think|>{% endif %}{{ system }}<turn|>\n"
    "{% endif %}"
    "{%- for m in messages if m.role != 'system' %}"
    "<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<turn|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _write(path: Path, words: list[str], specials: list[str], template: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    assert len(words) + len(specials) < VOCAB
    filler = VOCAB - len(words) - len(specials)
    vocab = {f"t{i}": i for i in range(filler)}
    vocab.update({w: filler + i for i, w in enumerate(words)})
    vocab.update({s: filler + len(words) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[-2],
              "pad_token": "<|endoftext|>", "chat_template": template}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_harmony_tokenizer(path: Path) -> None:
    _write(path, HARMONY_WORDS, HARMONY_SPECIALS, HARMONY_TEMPLATE)


def write_gemma_tokenizer(path: Path) -> None:
    _write(path, GEMMA_WORDS, GEMMA_SPECIALS, GEMMA_TEMPLATE)


def with_tokenizer(target: Path, path: Path, write) -> Path:
    """A copy of the ``target`` folder at ``path`` with the tokenizer ``write`` makes."""
    shutil.copytree(target, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    write(path)
    return path


def token_ids(tokenizer, text: str) -> list[int]:
    """The ids of ``text``'s tokens, markers included, as written."""
    return list(tokenizer.encode(text, add_special_tokens=False))


class ScriptedReply:
    """A logits processor that makes the target say ``script`` (token ids) whatever its weights:
    its first call sees the prompt, each later one the prompt and the reply so far."""

    def __init__(self, script: list[int]):
        self.script, self.prompt_len = script, None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.prompt_len is None:
            self.prompt_len = tokens.size
        token = self.script[min(tokens.size - self.prompt_len, len(self.script) - 1)]
        forced = mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -1e9)
        return mx.broadcast_to(forced, logits.shape).astype(logits.dtype)


def script_target(monkeypatch, module, script: list[int]) -> None:
    """Make ``module``'s ``stream_generate`` reply with ``script`` in every call."""
    real = module.stream_generate

    def scripted(*args, **kwargs):
        return real(*args, **{**kwargs, "logits_processors": [ScriptedReply(script)]})

    monkeypatch.setattr(module, "stream_generate", scripted)


THINK_WORDS = ["system", "user", "assistant"]
THINK_SPECIALS = ["<|im_start|>", "<think>", "</think>", "<|endoftext|>", "<|im_end|>", "<|mask|>"]
# Qwen3's shape: thinking switched off writes an empty thinking block into the generation prompt.
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def write_think_tokenizer(path: Path) -> None:
    _write(path, THINK_WORDS, THINK_SPECIALS, THINK_TEMPLATE)
