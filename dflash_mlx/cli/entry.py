"""The console scripts' entry points: each imports its tool inside a Ctrl+C handler.

A tool spends its first seconds importing mlx, mlx-lm and transformers, before its own ``main()``
runs. A Ctrl+C then ends it with one line, not a traceback from deep inside an import.
"""

import sys
from importlib import import_module
from typing import Callable

INTERRUPTED = 130  # what a shell reports for a process ended by SIGINT (128 + 2)


def _entry(prog: str, module: str) -> Callable[[], None]:
    def run() -> None:
        try:
            import_module(module).main()
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            sys.exit(INTERRUPTED)

    return run


generate_main = _entry("dflash-generate", "dflash_mlx.generate")
chat_main = _entry("dflash-chat", "dflash_mlx.tui.app")
convert_main = _entry("dflash-convert", "dflash_mlx.convert.convert")
train_main = _entry("dflash-train", "dflash_mlx.train.loop")
bench_main = _entry("dflash-bench", "dflash_mlx.bench.benchmark")
serve_main = _entry("dflash-serve", "dflash_mlx.server.app")
