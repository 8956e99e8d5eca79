"""A reply's reasoning apart from its answer, as the text streams.

Reasoning models write their thinking into the same token stream as their answer:

- gpt-oss (OpenAI's harmony format) writes messages ``<|channel|>analysis<|message|>...<|end|>``,
  each after a ``<|start|>assistant`` header, and ends with one in the ``final`` channel (closed
  by ``<|return|>``, a stop token). The chat template's generation prompt ends with
  ``<|start|>assistant``, so a reply starts in a header.
- Qwen3, QwQ and DeepSeek-R1 wrap their thinking in ``<think>...</think>``; some templates put the
  ``<think>`` in the prompt, so the reply starts inside it.
- Gemma 4 wraps it in ``<|channel>thought ... <channel|>``.

A parser takes the decoded text in the pieces it streams in, which may cut a marker anywhere,
and returns ``(channel, text)`` pieces, ``channel`` being ``REASONING`` or ``ANSWER``; markers
never reach either. :func:`reasoning_parser` picks the parser a tokenizer's model needs.
"""

REASONING, ANSWER = "reasoning", "answer"
Piece = tuple[str, str]

# harmony's markers: each one token of the o200k_harmony vocabulary.
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# Tags that bracket the thinking, and the tokens a vocabulary must have for each.
TAG_FORMATS = (
    ("<think>", "</think>", ("<think>", "</think>")),
    ("<|channel>thought", "<channel|>", ("<|channel>", "<channel|>")),
)
# Prompt tokens decoded to learn where the generation prompt leaves the parser.
PROMPT_TAIL = 16


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of ``markers`` starts in ``text``, and which; with none, how much of
    ``text`` is safe to pass on (its tail may be the start of a marker cut by the stream)."""
    best, found = len(text), None
    for marker in markers:
        i = text.find(marker)
        if i != -1 and (found is None or i < best or i == best and len(marker) > len(found)):
            best, found = i, marker
    if found is not None:
        return best, found
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:k]):
                hold = k
                break
    return len(text) - hold, None


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for channel, text in pieces:
        if not text:
            continue
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))
    return out


def join(pieces: list[Piece]) -> tuple[str, str]:
    """``(answer, reasoning)``: the text of each channel."""
    answer = "".join(text for channel, text in pieces if channel == ANSWER)
    reasoning = "".join(text for channel, text in pieces if channel == REASONING)
    return answer, reasoning


class HarmonyParser:
    """gpt-oss's harmony messages: ``final`` is the answer, every other channel (``analysis``,
    and ``commentary``, where tool calls and their preambles go) is reasoning.

    A reply that never writes ``<|message|>`` within ``MAX_HEADER`` characters is not harmony
    after all (a base model, a broken template): its text is the answer, as it came.
    """

    MAX_HEADER = 256
    _HEADER, _BODY, _BETWEEN = "header", "body", "between"

    def __init__(self):
        self.state, self.channel = self._HEADER, ANSWER
        self._pending = ""  # a header read so far, or a tail that may start a marker
        self._saw_marker = False

    @classmethod
    def after_prompt(cls, prompt_tail: str) -> "HarmonyParser":
        """A parser in the state the prompt leaves it: in a header after ``<|start|>assistant``,
        or in a message's body when the prompt already opened one."""
        parser = cls()
        start = prompt_tail.rfind(START)
        if start != -1:
            parser.feed(prompt_tail[start:])
        if parser.state == cls._HEADER:
            parser._pending = ""  # the role, "assistant": the channel comes after it
        parser._saw_marker = False
        return parser

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes; a tail that may start a marker waits for the next."""
        self._pending += text
        out: list[Piece] = []
        while self._pending:
            if self.state == self._HEADER:
                i, marker = _first(self._pending, (MESSAGE, START, END, RETURN, CALL))
                if marker is None:
                    if len(self._pending) > self.MAX_HEADER:
                        self.state, self.channel = self._BODY, ANSWER
                        continue
                    break
                header, self._pending = self._pending[:i], self._pending[i + len(marker) :]
                self._saw_marker = True
                if marker == MESSAGE:
                    self.state, self.channel = self._BODY, _channel(header)
                elif marker != START:
                    self.state = self._BETWEEN
            elif self.state == self._BODY:
                i, marker = _first(self._pending, (END, RETURN, CALL, START))
                out.append((self.channel, self._pending[:i]))
                if marker is None:
                    self._pending = self._pending[i:]
                    break
                self._pending = self._pending[i + len(marker) :]
                self._saw_marker = True
                self.state = self._HEADER if marker == START else self._BETWEEN
            else:
                # Between messages only a new header belongs; stray text is shown, not lost.
                rest = self._pending.lstrip()
                if rest.startswith(START):
                    self._pending, self.state = rest[len(START) :], self._HEADER
                elif rest.startswith(CHANNEL):  # a header without its "<|start|>assistant"
                    self._pending, self.state = rest, self._HEADER
                elif not rest or START.startswith(rest) or CHANNEL.startswith(rest):
                    self._pending = rest
                    break
                else:
                    self._pending, self.state, self.channel = rest, self._BODY, ANSWER
        return _merge(out)

    def flush(self) -> list[Piece]:
        """What is left once the reply has ended."""
        pending, self._pending = self._pending, ""
        if self.state == self._BODY:
            return _merge([(self.channel, pending)])
        if self.state == self._HEADER and not self._saw_marker:
            return _merge([(ANSWER, pending)])  # a short reply that was never harmony
        return []  # a header cut off by the token limit, or a partial marker


def _channel(header: str) -> str:
    # "assistant<|channel|>final", or "<|channel|>commentary to=functions.f <|constrain|>json".
    _, found, rest = header.partition(CHANNEL)
    words = rest.split("<|")[0].split()
    if not found or not words or words[0] == "final":
        return ANSWER
    return REASONING


class TagParser:
    """Thinking between an opening and a closing tag (``<think>`` and ``</think>``).

    Outside the tags is the answer. Only a reply that starts with the opening tag (after
    whitespace) opens it: later in an answer the tag is text, as a model may quote it. Each
    part's leading whitespace (the newlines after a tag) is dropped.

    Args:
        open_tag, close_tag: The tags.
        thinking: Start inside the tags (the prompt ended with the opening one).
    """

    def __init__(self, open_tag: str, close_tag: str, thinking: bool = False):
        self.open_tag, self.close_tag, self.thinking = open_tag, close_tag, thinking
        self._fresh = True  # this part has no text yet
        self._pending = ""

    def _emit(self, out: list[Piece], channel: str, text: str) -> None:
        if self._fresh:
            text = text.lstrip()
        if text:
            self._fresh = False
            out.append((channel, text))

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes; a tail that may start a tag waits for the next."""
        self._pending += text
        out: list[Piece] = []
        while self._pending:
            if self.thinking:
                i, marker = _first(self._pending, (self.close_tag,))
                self._emit(out, REASONING, self._pending[:i])
                if marker is None:
                    self._pending = self._pending[i:]
                    break
                self._pending = self._pending[i + len(marker) :]
                self.thinking, self._fresh = False, True
            elif self._fresh:
                i, marker = _first(self._pending, (self.open_tag,))
                if self._pending[:i].strip():
                    self._emit(out, ANSWER, self._pending)
                    self._pending = ""
                elif marker is None:
                    break  # whitespace, maybe the start of the tag
                else:
                    self._pending = self._pending[i + len(marker) :]
                    self.thinking = True
            else:
                self._emit(out, ANSWER, self._pending)
                self._pending = ""
        return _merge(out)

    def flush(self) -> list[Piece]:
        """What is left once the reply has ended (a cut-off thinking part stays reasoning)."""
        out: list[Piece] = []
        self._emit(out, REASONING if self.thinking else ANSWER, self._pending)
        self._pending = ""
        return out


def _has_tokens(tokenizer, tokens: tuple[str, ...]) -> bool:
    # Token by token: a whole vocabulary of 200k entries is slow to copy for every request.
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    if any(i is None for i in ids):
        return False
    return list(tokenizer.convert_ids_to_tokens(ids)) == list(tokens)


def reasoning_parser(tokenizer, prompt: list[int]) -> HarmonyParser | TagParser | None:
    """The parser for replies to ``prompt`` (chat-template token ids), or None for a model
    without a reasoning format, whose whole reply is the answer.

    The format comes from the vocabulary (harmony's ``<|channel|>``, ``<think>``, Gemma 4's
    ``<|channel>``); the prompt's last tokens say where the reply starts (inside a ``<think>``
    the template opened, in a harmony header).
    """
    if not prompt:
        return None
    tail = tokenizer.decode(list(prompt[-PROMPT_TAIL:]))
    if _has_tokens(tokenizer, (START, CHANNEL, MESSAGE, END)):
        return HarmonyParser.after_prompt(tail)
    for open_tag, close_tag, tokens in TAG_FORMATS:
        if _has_tokens(tokenizer, tokens):
            return TagParser(open_tag, close_tag, thinking=tail.rfind(open_tag) > tail.rfind(close_tag))
    return None
