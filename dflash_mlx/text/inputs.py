"""What every entry point checks of its input the same way: the library, the tools, the server, the chat.

Plain Python (no MLX), so the server's request parsing and the chat app can use it.
"""

from ..base.errors import DFlashError

MAX_SEED = 2**64 - 1  # what mx.random.seed takes


def text_problem(text: str, what: str = "The prompt") -> str | None:
    """Why ``text`` cannot be encoded for a tokenizer (None when it can), in one line.

    A Python string may hold characters UTF-8 cannot encode: lone surrogates, which is how Python
    keeps the bytes of a command line or stream that were not UTF-8 (``\\udce9`` for byte 0xe9).
    """
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        char = text[e.start]
        if 0xDC80 <= ord(char) <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
            found = f"the byte 0x{ord(char) - 0xDC00:02x}, which is not UTF-8,"
        else:
            found = f"an unpaired surrogate {char!r}"
        return f"{what} is not valid UTF-8 text: it has {found} at character {e.start}. Pass text in UTF-8."


def check_text(text: str, what: str = "The prompt") -> None:
    """Raise ``DFlashError`` when ``text`` is not valid Unicode text (see :func:`text_problem`)."""
    problem = text_problem(text, what)
    if problem:
        raise DFlashError(problem)


def decode_utf8(data: bytes, what: str = "stdin") -> str:
    """``data`` as UTF-8 text, or a one-line ``DFlashError`` naming the first bad byte and its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DFlashError(
            f"{what} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} is not valid UTF-8. "
            "Convert it first (e.g. iconv -f latin1 -t utf-8), or pass text, not a binary file."
        ) from None
