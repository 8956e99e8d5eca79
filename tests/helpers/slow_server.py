"""dflash-serve (its real ``main``, signals and shutdown) on a fake generator that never finishes.

``python tests/helpers/slow_server.py --model T --draft D --port 0`` serves the pair's tokenizer and
cache, but every reply comes from ``endless_responses``: a cycle every few milliseconds until the
request is cut. The first cycle prints ``generating`` on stdout, so a test knows a request is in
flight before it sends SIGTERM.

Once shutdown begins, every write to a client is held back for ``LATE_WRITE_S``: a handler thread
that the scheduler runs late. A server that exits without waiting for its handlers cuts their
answers short; one that waits delivers them whole.
"""

import sys
import threading
import time

from dflash_mlx import generation
from dflash_mlx.generation import GenerationResponse
from dflash_mlx.tools.server import app, handler, worker

CYCLE_S = 0.005
LATE_WRITE_S = 0.5

closing = threading.Event()


def endless_responses(model, draft, tokenizer, prompt, **kwargs):
    for cycle in range(10**9):
        if cycle == 1:
            print("generating", flush=True)
        time.sleep(CYCLE_S)
        yield GenerationResponse(
            text=" t1",
            tokens=[1],
            acceptance_length=1,
            mean_acceptance_length=1.0,
            cycle=cycle,
            prompt_tokens=len(prompt),
            prompt_tps=1.0,
            generation_tokens=cycle + 1,
            generation_tps=1.0,
            peak_memory=0.0,
        )


class LateWriter:
    """A handler's ``wfile`` whose writes lag once shutdown has begun."""

    def __init__(self, wfile):
        self.wfile = wfile

    def write(self, data):
        if closing.is_set():
            time.sleep(LATE_WRITE_S)
        return self.wfile.write(data)

    def __getattr__(self, name):
        return getattr(self.wfile, name)


def _patch() -> None:
    generation.stream_generate = endless_responses  # what the server's session streams
    close, setup = worker.Worker.close, handler.APIHandler.setup

    def closing_close(self):
        closing.set()
        close(self)

    def late_setup(self):
        setup(self)
        self.wfile = LateWriter(self.wfile)

    worker.Worker.close = closing_close
    handler.APIHandler.setup = late_setup


if __name__ == "__main__":
    _patch()
    app.main(sys.argv[1:])
