"""The HTTP side of dflash-serve: routes, authentication, JSON and server-sent events.

Each connection runs on its own thread (``ThreadingHTTPServer``); it checks the request,
queues it on the ``Worker`` and relays the worker's events, watching the socket so that a
client that hangs up cancels its generation.
"""

import hmac
import json
import logging
import queue
import select
import socket
import time
from http.server import BaseHTTPRequestHandler

from ... import __version__
from .protocol import CHAT, TEXT, APIError, chunk, full_response, parse_request, usage_chunk
from .worker import Job

log = logging.getLogger("dflash-serve")

ROUTES = {"/v1/chat/completions": CHAT, "/chat/completions": CHAT, "/v1/completions": TEXT}
# How often a waiting handler checks whether its client hung up.
POLL_S = 0.02
# Larger bodies are refused before they are read.
MAX_BODY = 32 * 1024 * 1024


class APIHandler(BaseHTTPRequestHandler):
    """Answers one connection; ``self.server`` is the ``DFlashHTTPServer`` with the shared state."""

    protocol_version = "HTTP/1.1"
    server_version = f"dflash-serve/{__version__}"

    # ---- plumbing ----------------------------------------------------------------------

    def parse_request(self) -> bool:
        # A request line has come: from here to the end of the answer, shutdown waits for us.
        self.server.serving(self.connection, True)
        return super().parse_request()

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        finally:
            self.server.serving(self.connection, False)

    def log_message(self, format: str, *args) -> None:
        # Every request, answered or not, at the default level: a server that logs only failures looks idle.
        log.info("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: APIError) -> None:
        log.warning("%d %s %s: %s", e.status, self.command, self.path, e.message)
        # The body may be unread (a refused key, a wrong route): end the connection, not parse it.
        self.close_connection = True
        self._send_json(e.status, e.body(), {**e.headers, "Connection": "close"})

    def _check_key(self) -> None:
        key = self.server.api_key
        if not key:
            return
        auth = self.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")

    def _client_gone(self) -> bool:
        # A readable socket with nothing to read is one the peer closed.
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ---- GET ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/health":
                return self._send_json(200, {"status": "ok"})
            if path == "/metrics":
                return self._send_metrics()
            if path in ("/v1/models", "/models") or path.startswith("/v1/models/"):
                self._check_key()
                return self._send_models(path)
            if path in ROUTES:
                raise APIError(
                    405,
                    f"{path} takes POST with a JSON body, not GET.",
                    code="method_not_allowed",
                    headers={"Allow": "POST"},
                )
            raise APIError(404, f"No route GET {path}.", code="not_found")
        except APIError as e:
            self._send_error(e)
        except Exception as e:  # the server must outlive any one request
            log.exception("GET %s failed", path)
            self._send_error(APIError(500, f"{type(e).__name__}: {e}", type="server_error"))

    def _send_metrics(self) -> None:
        worker = self.server.worker
        text = self.server.metrics.render(
            self.server.model_name, running=worker.num_running, waiting=worker.waiting
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def _model_card(self) -> dict:
        return {
            "id": self.server.model_name,
            "object": "model",
            "created": self.server.created,
            "owned_by": "dflash-mlx",
            "dflash": self.server.model_info,
        }

    def _send_models(self, path: str) -> None:
        if path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            if name not in self.server.model_names:
                raise APIError(404, f"The model '{name}' does not exist.", code="model_not_found")
            return self._send_json(200, self._model_card())
        self._send_json(200, {"object": "list", "data": [self._model_card()]})

    # ---- POST --------------------------------------------------------------------------

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path in ("/health", "/metrics", "/v1/models", "/models") or path.startswith("/v1/models/"):
                raise APIError(405, f"{path} takes GET, not POST.", code="method_not_allowed", headers={"Allow": "GET"})
            if path not in ROUTES:
                raise APIError(
                    404, f"No route POST {path}; use /v1/chat/completions or /v1/completions.", code="not_found"
                )
            self._check_key()
            body = self._read_json()
            req = parse_request(body, ROUTES[path], self.server.defaults)
            if req.model and req.model not in self.server.model_names:
                raise APIError(
                    404,
                    f"The model '{req.model}' does not exist; this server has '{self.server.model_name}'.",
                    param="model",
                    code="model_not_found",
                )
            req.model = self.server.model_name
            worker = self.server.worker
            job = Job(req, worker.prompt_ids(req))
            worker.submit(job)
        except APIError as e:
            return self._send_error(e)
        except Exception as e:  # the server must outlive any one request
            log.exception("POST %s failed", path)
            return self._send_error(APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
        self._relay(job)

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError(411, "A Content-Length header is required.")
        try:
            length = int(length)
        except ValueError:
            raise APIError(400, f"Bad Content-Length header {length!r}.") from None
        if not 0 <= length <= MAX_BODY:
            raise APIError(413, f"The request body is larger than {MAX_BODY} bytes.")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"The request body is not valid JSON: {e}.") from None

    def _next_event(self, job: Job):
        """The worker's next event, or None once the client has hung up (the job is then cancelled)."""
        while True:
            # Checked every POLL_S even while events keep coming, so a fast reply still notices.
            now = time.monotonic()
            if now - self._checked >= POLL_S:
                self._checked = now
                if self._client_gone():
                    job.cancelled.set()
                    log.info("%s: client disconnected; generation stops", job.request.id)
                    return None
            try:
                return job.events.get(timeout=POLL_S)
            except queue.Empty:
                pass

    def _relay(self, job: Job) -> None:
        req = job.request
        self._checked = time.monotonic()
        event = self._next_event(job)
        if event is None:
            return
        if event[0] == "error":  # nothing sent yet: a proper status
            return self._send_error(event[1])
        if not req.stream:
            text, reasoning = [], []
            while event[0] == "delta":
                text.append(event[1])
                reasoning.append(event[2])
                if (event := self._next_event(job)) is None:
                    return
            if event[0] == "error":
                return self._send_error(event[1])
            _, finish, usage, metrics = event
            return self._send_json(
                200, full_response(req, "".join(text), finish, usage, metrics, reasoning="".join(reasoning))
            )
        self._stream(job, event)

    def _stream(self, job: Job, event) -> None:
        req = job.request
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.end_headers()
        self.close_connection = True
        first = True
        try:
            while event is not None:
                kind = event[0]
                if kind == "delta":
                    # A cycle that ends inside a character or a stop string's possible start adds no text:
                    # no chunk (but the chat's first, which carries the role).
                    if event[1] or event[2] or (first and req.kind == CHAT):
                        self._sse(chunk(req, event[1], cycle=event[3], first=first, reasoning=event[2]))
                        first = False
                elif kind == "done":
                    _, finish, usage, metrics = event
                    self._sse(chunk(req, None, finish))
                    if req.include_usage:
                        self._sse(usage_chunk(req, usage, metrics))
                    break
                else:
                    log.warning("%d %s %s: %s", event[1].status, self.command, self.path, event[1].message)
                    self._sse(event[1].body())
                    break
                event = self._next_event(job)
            if event is not None:
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            job.cancelled.set()
            log.info("%s: client disconnected; generation stops", req.id)

    def _sse(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()
