"""dflash-serve: an OpenAI-compatible HTTP server for a target + DFlash drafter pair.

Why not ``mlx_lm.server``: its ``ResponseGenerator`` drives mlx-lm's own ``stream_generate`` and
``BatchGenerator`` and cannot run our generator, so this is a small server on the standard
library (``ThreadingHTTPServer`` plus one worker thread that owns the pair), with mlx-lm's
flag names and request parameters.
"""

import argparse
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx

from ...base.dtypes import DTYPES
from ...base.errors import DFlashError
from ...cpu.openblas import blas_in_use
from ...loading.watch import keep_load_watch
from ...models.rows import rows_supported
from ..cli.options import (
    MAX_TEMP,
    ArgumentParser,
    InRange,
    add_blas_argument,
    add_cycle_arguments,
    add_parallel_arguments,
)
from .batch_worker import BatchWorker
from .handler import APIHandler
from .metrics import Metrics
from .protocol import Defaults
from .ranks import Ranks, follow
from .worker import Worker

log = logging.getLogger("dflash-serve")


class DFlashHTTPServer(ThreadingHTTPServer):
    """The listening socket and what every handler thread shares.

    Handler threads are daemons, so the process may exit while one is still writing; ``drain``
    waits for the connections that are serving a request, and closes the idle ones.
    """

    daemon_threads = True
    request_queue_size = 64  # the listen backlog: a burst of clients waits in our queue, not here

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._connections: dict[socket.socket, bool] = {}  # open connection -> serving a request
        self._changed = threading.Condition()
        self._draining = False

    def process_request(self, request, client_address) -> None:
        # Counted from here, on the accepting thread, so none slips past a drain that follows.
        with self._changed:
            self._connections[request] = False
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        super().shutdown_request(request)
        with self._changed:
            self._connections.pop(request, None)
            self._changed.notify_all()

    def serving(self, connection: socket.socket, busy: bool) -> None:
        """A handler starts (``busy``) or ends a request; an idle connection is closed when draining."""
        with self._changed:
            if connection in self._connections:
                self._connections[connection] = busy
            if self._draining and not busy:
                _stop_reading(connection)

    def drain(self, timeout: float) -> bool:
        """Wait until every answer in progress is written; True if all were within ``timeout``."""
        with self._changed:
            self._draining = True
            for connection, busy in self._connections.items():
                if not busy:  # waiting for a next request that may never come
                    _stop_reading(connection)
            return self._changed.wait_for(lambda: not self._connections, timeout)


def _stop_reading(connection: socket.socket) -> None:
    # The handler's read returns end-of-file and it closes the connection; what it writes still goes out.
    try:
        connection.shutdown(socket.SHUT_RD)
    except OSError:
        pass


class DFlashServer:
    """The server on a loaded pair; ``start()`` serves on a background thread.

    Args:
        model, draft, tokenizer: The loaded pair (``dflash_mlx.load``); ``draft`` may be None.
        model_name: The id clients send as ``model`` (any other is refused, 404).
        host, port: Where to listen; port 0 picks a free one (see ``url``).
        api_key: When set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        defaults: Sampling defaults for parameters a request leaves out.
        queue_size, prompt_cache_size, max_context, chat_template_args, prefill_step_size: See
          ``Worker``.
        aliases: Other names accepted for the model.
        datastore: See ``Worker``.
        ranks: On rank 0 of a sharded target, the other ranks (:class:`dflash_mlx.tools.server.ranks.Ranks`).
        max_batch: Requests decoded together (:class:`~dflash_mlx.tools.server.batch_worker.BatchWorker`); None
          as many as the memory allows (up to 8); 1 (default) one at a time (``Worker``), as are targets the
          engine cannot batch and sharded ones whatever is asked (``batch_note`` says why).
    """

    def __init__(
        self,
        model,
        draft,
        tokenizer,
        *,
        model_name: str = "default",
        host: str = "127.0.0.1",
        port: int = 8080,
        api_key: str | None = None,
        defaults: Defaults = Defaults(),  # noqa: B008 (frozen: one shared default is safe)
        queue_size: int = 16,
        prompt_cache_size: int = 4,
        max_context: int | None = None,
        chat_template_args: dict | None = None,
        prefill_step_size: int = 512,
        aliases: tuple[str, ...] = (),
        datastore=None,
        ranks=None,
        max_batch: int | None = 1,
    ):
        self.metrics = Metrics()
        settings = {
            "queue_size": queue_size, "prompt_cache_size": prompt_cache_size, "max_context": max_context,
            "chat_template_args": chat_template_args, "prefill_step_size": prefill_step_size,
            "metrics": self.metrics, "datastore": datastore, "ranks": ranks,
        }  # fmt: skip
        why = "a sharded target" if ranks is not None else rows_supported(model)
        if max_batch == 1 or why is not None:
            self.worker = Worker(model, draft, tokenizer, **settings)
            self.batch_note = "one request at a time" + (f" ({why})" if why and max_batch != 1 else "")
        else:
            self.worker = BatchWorker(model, draft, tokenizer, max_batch=max_batch, **settings)
            self.batch_note = f"up to {self.worker.max_batch} requests together ({self.worker.batch_note})"

        httpd = DFlashHTTPServer((host, port), APIHandler)
        httpd.worker, httpd.metrics, httpd.defaults, httpd.api_key = self.worker, self.metrics, defaults, api_key
        httpd.model_name, httpd.model_names = model_name, {model_name, *aliases}
        # What /v1/models says about the pair beyond OpenAI's fields.
        httpd.model_info = {
            "block_size": draft.block_size if draft is not None else None,
            "has_draft": draft is not None,
        }
        httpd.created = int(time.time())
        self.httpd = httpd
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "DFlashServer":
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="dflash-serve-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop: refuse new requests, cut the running one after its cycle, let every client get
        its whole answer (a reply, or a 503 saying the server is shutting down), close the socket."""
        self.worker.close()
        self.httpd.shutdown()
        deadline = time.monotonic() + timeout
        while self.worker.running is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.worker.ranks is not None and not self.worker.released.wait(max(0.0, deadline - time.monotonic())):
            log.warning("the other ranks were not told to stop within %g s", timeout)
        if not self.httpd.drain(max(0.0, deadline - time.monotonic())):
            log.warning("stopped with a client still being answered after %g s", timeout)
        self.httpd.server_close()


def setup_arg_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dflash-serve", description="An OpenAI-compatible server for DFlash speculative decoding.")
    p.add_argument(
        "--model",
        default=None,
        help="Target: local folder, pair folder or Hugging Face id (default: the default pair, "
        "SmolLM2-135M-Instruct, also named smollm2; dflash-tiny: the toy pair).",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="DFlash drafter: local folder or Hugging Face id (default: the pair folder's or the known "
        "drafter of the target; plain decoding if none).",
    )
    p.add_argument("--no-draft", action="store_true", help="Plain decoding, without the drafter.")
    p.add_argument("--served-model-name", default=None, help="The model id clients use (default: --model as given).")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1, this machine only).")
    p.add_argument(
        "--port",
        type=int,
        action=InRange,
        low=0,
        high=65535,
        default=8080,
        help="Port (default: 8080; 0 picks a free one).",
    )
    p.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/*.")
    # The same limits a request's own values get (and dflash-generate's flags).
    p.add_argument(
        "--temp",
        type=float,
        action=InRange,
        low=0.0,
        high=MAX_TEMP,
        default=0.0,
        help=f"Default sampling temperature, 0 to {MAX_TEMP:g} (default: 0.0).",
    )
    p.add_argument(
        "--top-p",
        type=float,
        action=InRange,
        low=0.0,
        high=1.0,
        default=1.0,
        help="Default nucleus sampling top-p (default: 1.0).",
    )
    p.add_argument(
        "--top-k", type=int, action=InRange, low=0, default=0, help="Default top-k sampling (default: 0, off)."
    )
    p.add_argument(
        "--min-p",
        type=float,
        action=InRange,
        low=0.0,
        high=1.0,
        default=0.0,
        help="Default min-p sampling (default: 0.0, off).",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        action=InRange,
        low=1,
        default=512,
        help="Default most tokens per reply (default: 512).",
    )
    add_cycle_arguments(p)
    p.add_argument(
        "--queue-size",
        type=int,
        action=InRange,
        low=1,
        default=16,
        help="Requests that may wait behind the running one; more get 429 (default: 16).",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        action=InRange,
        low=1,
        default=None,
        help="Requests decoded together, drafting and verifying in shared passes (default: as many as a quarter of "
        "the memory holds at the full context, up to 8; said at start); 1 serves them one at a time.",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        action=InRange,
        low=1,
        default=4,
        help="Conversation caches kept for prefix reuse (default: 4).",
    )
    p.add_argument(
        "--frozen-datastore",
        action="store_true",
        help="Keep the datastore as it starts: replies do not join it (a load test that repeats its prompts would "
        "otherwise draft each later reply from an earlier one).",
    )
    p.add_argument(
        "--max-context",
        type=int,
        action=InRange,
        low=1,
        default=None,
        help="Most tokens of prompt plus reply (default: the target's max_position_embeddings).",
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        action=InRange,
        low=1,
        default=512,
        help="Prompt tokens per prefill chunk (default: 512).",
    )
    p.add_argument(
        "--chat-template-args",
        default="{}",
        help="""JSON keyword arguments for apply_chat_template, e.g. '{"enable_thinking": false}'; a """
        "request's chat_template_kwargs and reasoning_effort go over them.",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="Cast both models to this dtype (default: float32 on a CPU when it fits, else the checkpoint's).",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_parallel_arguments(p)
    add_blas_argument(p)
    return p


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error(message: str) -> None:
    print(f"dflash-serve: error: {message}", file=sys.stderr)
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    import json

    from ...loading.pairs import DEFAULT_PAIR
    from ..session import Session

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    try:
        template_args = json.loads(args.chat_template_args)
    except json.JSONDecodeError as e:
        parser.error(f"--chat-template-args is not valid JSON ({e.msg}): {args.chat_template_args!r}.")
    if not isinstance(template_args, dict):
        parser.error("--chat-template-args must be a JSON object.")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.pipeline_split is not None and args.parallel != "pipeline":
            parser.error("--pipeline-split needs --pipeline.")
        session = Session.open(
            args.model,
            args.draft,
            no_draft=args.no_draft,
            dtype=args.dtype,
            parallel=args.parallel,
            pipeline_split=args.pipeline_split,
        )
    except DFlashError as e:
        _error(str(e))
    model, draft, tokenizer = session.model, session.draft, session.tokenizer
    # Under mlx.launch: rank 0 serves, the others run what it announces.
    group = mx.distributed.init()
    if group.size() > 1:
        keep_load_watch()  # between requests too, until the ranks stop together
    if group.size() > 1 and group.rank() > 0:
        follow(
            model, draft, tokenizer, prompt_cache_size=args.prompt_cache_size, prefill_step_size=args.prefill_step_size
        )
        return
    try:  # plain decoding stays plain
        datastore = session.open_datastore(args.datastore, learns=not args.frozen_datastore)
    except DFlashError as e:
        _error(str(e))
    name = args.served_model_name or args.model or DEFAULT_PAIR
    aliases = tuple({Path(name).name} - {name})
    defaults = Defaults(
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        min_confidence=args.min_confidence,
        confidence_threshold=args.confidence_threshold,
        lookup_fallback=args.lookup_fallback,
        tree_budget=args.tree_budget,
    )
    try:
        server = DFlashServer(
            model,
            draft,
            tokenizer,
            model_name=name,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            defaults=defaults,
            queue_size=args.queue_size,
            prompt_cache_size=args.prompt_cache_size,
            max_context=args.max_context,
            chat_template_args=template_args,
            prefill_step_size=args.prefill_step_size,
            aliases=aliases,
            datastore=datastore,
            ranks=Ranks(group) if group.size() > 1 else None,
            max_batch=args.max_batch,
        )
    except OSError as e:
        _error(f"cannot listen on {args.host}:{args.port} ({e.strerror}); pick another --port or --host.")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(banner(name, draft, server.url, exposed=not _is_loopback(args.host) and not args.api_key,
                 batching=server.batch_note), file=sys.stderr, flush=True)  # fmt: skip
    while not stop.wait(0.5):
        pass
    cut = " (the running request is cut after its cycle)" if server.worker.running is not None else ""
    print(f"dflash-serve: stopping{cut}", file=sys.stderr, flush=True)
    server.close()


def banner(name: str, draft, url: str, exposed: bool = False, batching: str = "") -> str:
    """The line dflash-serve prints once it listens: the model, the drafter, how many requests it decodes
    together, where, and on a Linux CPU the BLAS every number it serves depends on."""
    drafter = f"drafter block {draft.block_size}" if draft is not None else "no drafter"
    drafter += f", {batching}" if batching else ""
    line = f"dflash-serve: {name} ({drafter}) at {url}/v1"
    if sys.platform == "linux" and mx.default_device() == mx.cpu:
        line += f"; BLAS: {blas_in_use()}"
    if exposed:
        line += " -- listening beyond this machine WITHOUT --api-key: anyone who can reach it can use it"
    return line


if __name__ == "__main__":
    main()
