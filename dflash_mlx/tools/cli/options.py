"""The command-line options that dflash-generate, dflash-chat and dflash-bench share.

Each value is checked where it is parsed, once, with the flag's own name in the message
(``--block-size must be at least 1 (got 0).``), so every tool answers a bad value the same way
and before anything loads or prints. Flag names and meanings follow ``mlx_lm generate``.
"""

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

from ...base.dtypes import DTYPES
from ...cpu.openblas import BLAS_CHOICES

DTYPE_HELP = (
    "Compute dtype of both models. Default: float32 on MLX's CPU backend when float32 weights take at most "
    "half the memory available (it runs several times faster there than bfloat16), else the checkpoint's; "
    "on a GPU the checkpoint's."
)
# The largest sampling temperature any tool takes (dflash-chat's /temp too).
MAX_TEMP = 10.0


def version_line(prog: str) -> str:
    """What ``--version`` prints: the tool, this package's version and distribution name (pip's
    ``mlx-dflash``), and the mlx and mlx-lm it runs on."""
    from importlib.metadata import PackageNotFoundError, version

    from ... import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"{prog} {__version__} (pip: mlx-dflash; mlx {installed('mlx')}, mlx-lm {installed('mlx-lm')})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with errors on one line: what was wrong and the fix, without the usage
    block above it (``--help`` shows that), and ``--version``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=version_line(self.prog),
                          help="Print the version (and mlx's and mlx-lm's) and exit.")  # fmt: skip

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class InRange(argparse.Action):
    """Store a number (or each of a list) only if it lies within bounds; otherwise a parser
    error that names the flag. ``low_open`` excludes ``low`` itself."""

    def __init__(self, option_strings, dest, *, low=None, high=None, low_open: bool = False, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.low, self.high, self.low_open = low, high, low_open

    def describe(self) -> str:
        low, high = (f"{v:g}" if isinstance(v, float) else str(v) for v in (self.low, self.high))
        if self.low is not None and self.high is not None:
            return f"greater than {low} and at most {high}" if self.low_open else f"from {low} to {high}"
        if self.low is not None:
            return f"greater than {low}" if self.low_open else f"at least {low}"
        return f"at most {high}"

    def ok(self, value) -> bool:
        if isinstance(value, str):  # a word the flag's type lets through ("auto")
            return True
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def __call__(self, parser, namespace, values, option_string=None):
        for value in values if isinstance(values, list) else [values]:
            if not self.ok(value):
                got = f"{value:g}" if isinstance(value, float) else value
                parser.error(f"{self.option_strings[0]} must be {self.describe()} (got {got}).")
        setattr(namespace, self.dest, values)


def boolean_words(true: tuple[str, ...], false: tuple[str, ...]) -> Callable[[str], bool]:
    """An argparse type for a yes/no flag that takes exactly these words, in any case.

    Any other word is an error listing them (``expected True/T or False/F (got 'yes')``): mlx-lm
    reads every word but its false ones as true (``--verbose 0`` is verbose there), and a word that
    reads as "no" must not silently mean yes.
    """
    answers = {**{w.lower(): True for w in true}, **{w.lower(): False for w in false}}

    def parse(text: str) -> bool:
        answer = answers.get(text.strip().lower())
        if answer is None:
            raise argparse.ArgumentTypeError(f"expected {'/'.join(true)} or {'/'.join(false)} (got {text!r})")
        return answer

    return parse


# ``--verbose`` as mlx-lm documents it.
str2bool = boolean_words(("True", "T"), ("False", "F"))


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (``--chat-template-config``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"enable_thinking\": false}}' (got {text!r})")
    return value


def block_size_arg(text: str) -> int | str:
    """A block size on the command line: an integer, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block size: pass an integer or 'auto'.") from None


def tree_budget_arg(text: str) -> int | str:
    """A draft tree budget on the command line: an integer, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tree budget: pass an integer or 'auto'.") from None


def block_size_problem(block_size: int | str | None, trained: int | None, flag: str = "--block-size") -> str | None:
    """Why ``block_size`` does not suit the loaded drafter (``trained`` is its block size, None
    without a drafter), or None if it does. Checked after loading, since only the drafter knows."""
    if block_size is None:
        return None
    if block_size == "auto":
        return (
            None
            if trained is not None
            else (
                f"{flag} auto chooses how many drafts to verify, but no drafter is loaded. Pass --draft, or a "
                "fixed block size."
            )
        )
    if trained is None:
        if block_size == 1:
            return None
        return (
            f"{flag} {block_size} needs a drafter, but none is loaded (--no-draft, or no drafter given or "
            "known for this target). Pass --draft, or leave out --block-size."
        )
    if not 1 <= block_size <= trained:
        return f"{flag} must be from 1 to the drafter's block size {trained} (got {block_size})."
    return None


def add_blas_argument(parser: argparse.ArgumentParser) -> None:
    """``--blas``: read by the console script before anything loads (see ``cli.entry``); listed here for --help."""
    parser.add_argument(
        "--blas", choices=BLAS_CHOICES, default="auto",
        help="Linux CPU: restart with the fastest BLAS installed preloaded (auto, the default: MKL on an Intel CPU "
        "where `pip install mkl` put it, else OpenBLAS; several times faster than MLX's bundled reference BLAS), "
        "require one (mkl, openblas), or keep MLX's own (bundled).",
    )  # fmt: skip


def add_kernels_argument(parser: argparse.ArgumentParser) -> None:
    """``--kernels``: the Metal kernels' mode (``dflash_mlx.kernels.dispatch``)."""
    parser.add_argument(
        "--kernels", choices=("auto", "on", "off"), default="auto",
        help="Apple GPU: run each Metal kernel where it checked itself against its MLX-ops twin on this machine "
        "and was faster (auto, the default), wherever it can run, untimed, failing if it differs from its twin "
        "(on; an error without a Metal device), or never (off: the twins). Same tokens either way.",
    )  # fmt: skip


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --draft (or mlx-lm's --draft-model), --no-draft and --dtype."""
    parser.add_argument(
        "--model",
        default=None,
        help="Target: local folder, pair folder or Hugging Face id (default: the default pair, "
        "SmolLM2-135M-Instruct, also named smollm2; dflash-tiny: the toy pair).",
    )
    parser.add_argument(
        "--draft",
        "--draft-model",
        dest="draft",
        default=None,
        help="DFlash drafter: local folder or Hugging Face id (default: the pair folder's, or the known drafter "
        "of the target; plain decoding if none). --draft-model is the same, as in mlx_lm generate.",
    )
    parser.add_argument("--no-draft", action="store_true", help="Plain decoding, without the drafter.")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help=DTYPE_HELP)


def layer_counts(text: str) -> list[int]:
    """``--pipeline-split``: layers per rank, comma-separated, rank 0's first."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 20,12 (got {text!r})") from None
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"every rank needs at least one layer (got {text!r})")
    return counts


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel, --pipeline and --pipeline-split: how a target is split under mlx.launch."""
    how = parser.add_mutually_exclusive_group()
    how.add_argument(
        "--tensor-parallel", dest="parallel", action="store_const", const="tensor", default=None,
        help="Under mlx.launch: split every target layer over the ranks (mlx-lm's model.shard; the default "
        "where mlx-lm has it for the family).",
    )  # fmt: skip
    how.add_argument(
        "--pipeline", dest="parallel", action="store_const", const="pipeline",
        help="Under mlx.launch: give each rank a run of the target's layers (rank 0 the last ones).",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-split", type=layer_counts, default=None, metavar="N,N,...",
        help="With --pipeline: layers per rank, rank 0's first (default: even).",
    )  # fmt: skip


def add_decoding_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """The options of a reply: length, block size, temperature, stop tokens, chat template."""
    parser.add_argument(
        "--max-tokens", "-m", type=int, action=InRange, low=1, default=max_tokens,
        help=f"Most tokens to generate (default: {max_tokens}).",
    )  # fmt: skip
    parser.add_argument(
        "--block-size", type=block_size_arg, action=InRange, low=1, default=None,
        help="Tokens verified per cycle, 1 to the drafter's block size (default: the drafter's), or 'auto': "
        "each cycle the number of drafts that gives the most tokens per second, from verify costs measured "
        "once per machine, model and context length and the drafter's confidences.",
    )  # fmt: skip
    parser.add_argument(
        "--temp", type=float, action=InRange, low=0.0, high=MAX_TEMP, default=0.0,
        help=f"Sampling temperature, 0 to {MAX_TEMP:g} (default: 0, greedy: the target's own output).",
    )  # fmt: skip
    parser.add_argument("--system-prompt", default=None, help="System message for the chat template.")
    parser.add_argument(
        "--chat-template-config", type=json_object, default=None,
        help="""JSON keyword arguments for apply_chat_template, e.g. '{"enable_thinking": false}'.""",
    )  # fmt: skip
    parser.add_argument(
        "--extra-eos-token", nargs="+", default=[], metavar="TOKEN",
        help="More tokens (as text, or ids) that end a reply, besides the tokenizer's EOS tokens.",
    )  # fmt: skip
    add_cycle_arguments(parser)


def add_cycle_arguments(parser: argparse.ArgumentParser) -> None:
    """The per-cycle options shared by dflash-generate, dflash-chat and dflash-serve."""
    parser.add_argument(
        "--min-confidence", type=float, action=InRange, low=0.0, high=1.0, default=0.0,
        help="Verify only the drafts the drafter gives at least this probability (default: 0, the whole block).",
    )  # fmt: skip
    parser.add_argument(
        "--confidence-threshold", type=float, action=InRange, low=0.0, high=1.0, default=0.0,
        help="A DSpark drafter's confidence head: stop its drafts before the first whose predicted chance "
        "of acceptance is under this (default: 0, the whole block, as the reference).",
    )  # fmt: skip
    parser.add_argument(
        "--lookup-fallback", type=int, action=InRange, low=0, default=0,
        help="After the drafter misses its first draft, draft up to this many cycles by prompt lookup "
        "(default: 0, never).",
    )  # fmt: skip
    parser.add_argument(
        "--datastore", default="auto", metavar="auto|none|FILE",
        help="Draft from the target's own past text in the cycles that run no drafter pass, where prompt "
        "lookup finds no match of 2 tokens or more: 'auto' (default) the default pair's shipped answers and "
        "this process's replies (other pairs: the replies); FILE, a response cache (dflash-train's JSONL, "
        ".gz too), and the replies; 'none', prompt lookup alone. Same output either way.",
    )  # fmt: skip
    parser.add_argument(
        "--tree-budget", type=tree_budget_arg, action=InRange, low=0, default=0, metavar="N",
        help="Verify a draft tree of up to N nodes a cycle (DDTree: the drafter's most likely continuations, "
        "one target pass) instead of its one path (default: 0, the path), or 'auto': each cycle the nodes that "
        "pay best, from tree pass costs measured once per machine, model and context length (not on hybrid "
        "targets).",
    )  # fmt: skip


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """The drafter's context window (dflash-generate, dflash-bench)."""
    parser.add_argument(
        "--draft-window", type=int, action=InRange, low=1, default=None, metavar="N",
        help="Let the drafter see the target's taps of the latest N positions only (plus --draft-sinks), "
        "so a draft pass costs the same at any context length; the output is the same (default: all).",
    )  # fmt: skip
    parser.add_argument(
        "--draft-sinks", type=int, action=InRange, low=0, default=4, metavar="N",
        help="The leading positions --draft-window always keeps (default: 4).",
    )  # fmt: skip
