"""The console scripts' entry points: each imports its tool inside a Ctrl+C handler.

A tool spends its first seconds importing mlx, mlx-lm and transformers, before its own ``main()``
runs. A Ctrl+C then ends it with one line, not a traceback from deep inside an import.

On Linux each tool first restarts itself with a fast BLAS preloaded (``--blas``, default ``auto``: MKL
on an Intel CPU where it is installed, else OpenBLAS): MLX's Linux wheel calls a reference BLAS that is
several times slower.
"""

import sys
from collections.abc import Callable
from importlib import import_module

from ...base.errors import DFlashError
from ...cpu.openblas import BLAS_CHOICES, use_fast_blas

INTERRUPTED = 130  # what a shell reports for a process ended by SIGINT (128 + 2)


def _blas_choice(argv: list[str]) -> str | None:
    """The ``--blas`` value on the command line (``auto`` when absent); None for ``--help`` and
    ``--version``, which run no model."""
    if any(a in ("-h", "--help", "--version") for a in argv):
        return None
    choice = "auto"
    for i, arg in enumerate(argv):
        if arg == "--blas" and i + 1 < len(argv):
            choice = argv[i + 1]
        elif arg.startswith("--blas="):
            choice = arg.partition("=")[2]
    # A value the tool's own parser refuses: leave it to say so.
    return choice if choice in BLAS_CHOICES else None


def _entry(prog: str, module: str) -> Callable[[], None]:
    def run() -> None:
        try:
            choice = _blas_choice(sys.argv[1:])
            if choice is not None:
                try:
                    use_fast_blas(prog, choice)
                except DFlashError as e:
                    print(f"{prog}: error: {e}", file=sys.stderr)
                    sys.exit(1)
            import_module(module).main()
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            sys.exit(INTERRUPTED)

    return run


# Each console script and the module whose main() it runs.
TOOLS = {
    "dflash-generate": "dflash_mlx.tools.cli.generate",
    "dflash-chat": "dflash_mlx.tui.app",
    "dflash-convert": "dflash_mlx.convert.convert",
    "dflash-train": "dflash_mlx.tools.train.cli",
    "dflash-bench": "dflash_mlx.tools.bench.benchmark",
    "dflash-serve": "dflash_mlx.tools.server.app",
}
generate_main = _entry("dflash-generate", TOOLS["dflash-generate"])
chat_main = _entry("dflash-chat", TOOLS["dflash-chat"])
convert_main = _entry("dflash-convert", TOOLS["dflash-convert"])
train_main = _entry("dflash-train", TOOLS["dflash-train"])
bench_main = _entry("dflash-bench", TOOLS["dflash-bench"])
serve_main = _entry("dflash-serve", TOOLS["dflash-serve"])
