"""The one place a conversation becomes a prompt: the tokenizer's chat template, or, for a
model without one (a base model), the conversation as one running text to continue."""

from typing import Any


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def render_chat(
    tokenizer,
    messages: list[dict[str, str]],
    *,
    system_prompt: str | None = None,
    template_args: dict[str, Any] | None = None,
) -> list[int] | str:
    """Prompt token ids ready for the assistant's answer, or the running text without a template.

    Args:
        tokenizer: The target's tokenizer (an mlx-lm ``TokenizerWrapper`` or a transformers one).
        messages: Chat turns, ``{"role": ..., "content": ...}``.
        system_prompt: A system message put first, if given.
        template_args: Extra keyword arguments for ``apply_chat_template`` (e.g.
          ``{"enable_thinking": False}``).

    Returns:
        Token ids with a template; else the text (system prompt and turns joined), which the
        caller encodes as a plain prompt.
    """
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not has_chat_template(tokenizer):
        return "".join(m["content"] for m in messages)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_args or {})))


# The keyword arguments by which chat templates switch thinking: on or off (Qwen3, Gemma 4 and
# others read enable_thinking) and gpt-oss's level, low to high.
THINKING_SWITCHES = ("enable_thinking", "reasoning_effort")
# The reasoning_effort levels gpt-oss was trained on ("Reasoning: low" in its system message).
REASONING_EFFORTS = ("low", "medium", "high")


def template_switches(tokenizer) -> frozenset[str]:
    """Which of ``THINKING_SWITCHES`` the tokenizer's chat template reads (none without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates, as some tokenizers keep them
        template = " ".join(str(t) for t in template.values())
    if not isinstance(template, str):
        return frozenset()
    return frozenset(name for name in THINKING_SWITCHES if name in template)
