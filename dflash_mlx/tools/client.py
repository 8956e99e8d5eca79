"""A client of any OpenAI-compatible server: dflash-serve, vLLM, SGLang, mlx_lm.server.

``RemoteClient.stream_chat`` yields the same ``GenerationResponse`` objects as
``stream_generate``, measured at the client (tok/s from the arrival of the text), so the chat
app and the benchmark treat a server like the local pair. The acceptance length (tau) comes
from whatever the server reports, best first:

1. the response's ``metrics.speculative_decoding`` (dflash-serve; vLLM started with
   ``--per-request-spec-decode-metrics summary``); dflash-serve also sends each cycle's numbers;
2. SGLang's ``meta_info.spec_accept_length`` (asked for with ``return_meta_info``);
3. the change in vLLM's Prometheus counters ``vllm:spec_decode_num_drafts_total`` and
   ``vllm:spec_decode_num_accepted_tokens_total`` around the request: tau = 1 + accepted / drafts
   (server-wide: other users' requests in the same window count too);
4. SGLang's ``sglang:spec_accept_length`` gauge (a server-wide recent average);

and otherwise it is "n/a" with the reason. A reasoning model's reasoning, which servers send
apart from the answer (``reasoning_content``: dflash-serve, vLLM, SGLang; ``reasoning``:
mlx_lm.server, newer vLLM), becomes the responses' ``reasoning``. Only the standard library is
used.
"""

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from ..base.errors import DFlashError
from ..text.responses import AcceptanceStats, GenerationResponse

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DFLASH_DRAFTS = "dflash:spec_decode_num_drafts_total"
DFLASH_ACCEPTED = "dflash:spec_decode_num_accepted_tokens_total"
SGLANG_GAUGE = "sglang:spec_accept_length"
# What /v1/models says in ``owned_by``, per server.
KINDS = {"dflash-mlx": "dflash", "vllm": "vllm", "sglang": "sglang"}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (the text exposition format)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


@dataclass
class ServerInfo:
    """What a probe learned about the server.

    ``kind`` is ``"dflash"``, ``"vllm"``, ``"sglang"`` or ``"openai"`` (anything else);
    ``tau_source`` says where tau will come from, or ``tau_reason`` why it will be "n/a".
    """

    base_url: str
    model: str
    kind: str
    block_size: int | None = None
    has_metrics: bool = False
    tau_source: str | None = None
    tau_reason: str | None = None

    def describe(self) -> str:
        tau = f"tau from {self.tau_source}" if self.tau_source else f"tau n/a: {self.tau_reason}"
        return f"{self.model} @ {self.base_url} ({self.kind}) · {tau}"


class RemoteClient:
    """Talks to one OpenAI-compatible server.

    Args:
        base_url: The API root, e.g. ``http://host:8000/v1``.
        api_key: Sent as ``Authorization: Bearer``.
        model: The model id to ask for; None takes the server's first.
        timeout: Seconds to wait for the server to answer or to send the next chunk.
        counter_deltas: Read vLLM's counters around each request when it gives no per-request
          metrics (off for concurrent use, where other requests move them too).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        counter_deltas: bool = True,
    ):
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        self.api_key, self.model, self.timeout = api_key, model, timeout
        self.counter_deltas = counter_deltas
        self._per_request_metrics = False  # once seen, counters need not be read around requests
        self.info: ServerInfo | None = None

    # ---- HTTP --------------------------------------------------------------------------

    def _open(self, url: str, body: dict | None = None, timeout: float | None = None):
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            raise DFlashError(self._http_error(e)) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise DFlashError(
                f"Cannot reach the server at {self.base_url} ({reason}). Is it running, and is --base-url right?"
            ) from None

    def _http_error(self, e: urllib.error.HTTPError) -> str:
        try:
            body = json.loads(e.read() or b"{}")
            error = body.get("error", body)
            message = error.get("message") if isinstance(error, dict) else str(error)
        except (json.JSONDecodeError, AttributeError, OSError):
            message = e.reason
        if e.code == 401:
            return f"The server refused the API key (401: {message}). Pass the right one with --api-key."
        if e.code == 429:
            after = e.headers.get("Retry-After")
            return f"The server is busy (429: {message})" + (f"; retry in {after} s." if after else ".")
        return f"The server answered {e.code}: {message}"

    def _get_json(self, path: str) -> dict:
        with self._open(self.base_url + path, timeout=min(self.timeout, 30)) as resp:
            return json.loads(resp.read())

    def scrape(self) -> dict[str, float] | None:
        """The server's Prometheus metrics, or None when it has no ``/metrics``."""
        try:
            with self._open(self.root + "/metrics", timeout=min(self.timeout, 10)) as resp:
                return parse_prometheus(resp.read().decode("utf-8", "replace"))
        except DFlashError:
            return None

    # ---- probing -----------------------------------------------------------------------

    def server_info(self) -> ServerInfo:
        """Check the server, the key and the model name; find where tau will come from.

        Raises:
            DFlashError: Unreachable server, refused key, or a model the server lacks.
        """
        models = self._get_json("/models").get("data") or []
        ids = [m.get("id") for m in models]
        if self.model is None:
            if not models:
                raise DFlashError(f"The server at {self.base_url} lists no models; pass one with --model.")
            card = models[0]
        elif self.model in ids:
            card = models[ids.index(self.model)]
        else:
            raise DFlashError(
                f"The server has no model '{self.model}'; it has: {', '.join(map(str, ids))}. "
                "Pass one of them with --model."
            )
        metrics = self.scrape()
        kind = KINDS.get(card.get("owned_by"))
        if kind is None and metrics:
            kind = next((k for k in ("vllm", "sglang", "dflash") if any(n.startswith(k + ":") for n in metrics)), None)
        info = ServerInfo(self.base_url, card["id"], kind or "openai", has_metrics=metrics is not None)
        info.block_size = (card.get("dflash") or {}).get("block_size")
        metrics = metrics or {}
        if kind == "dflash":
            info.tau_source = "the server's per-cycle statistics"
        elif kind == "vllm" and VLLM_DRAFTS in metrics:
            info.tau_source = "per-request metrics, else the change in vllm:spec_decode_* counters"
        elif kind == "vllm":
            info.tau_source = "per-request metrics (--per-request-spec-decode-metrics summary)"
        elif kind == "sglang":
            info.tau_source = "meta_info.spec_accept_length, else the sglang:spec_accept_length gauge"
        else:
            info.tau_reason = "this server reports no speculative-decoding statistics"
        self.model, self.info = info.model, info
        return info

    # ---- generation --------------------------------------------------------------------

    def stream_chat(self, messages: list[dict[str, str]], **params) -> Iterator[GenerationResponse]:
        """Stream a chat reply; ``params`` are request fields (``max_tokens``, ``temperature``, ...)."""
        return self._stream("/chat/completions", {"messages": messages, **params})

    def stream_completion(self, prompt: str, **params) -> Iterator[GenerationResponse]:
        """Stream a text completion."""
        return self._stream("/completions", {"prompt": prompt, **params})

    def _stream(self, path: str, body: dict) -> Iterator[GenerationResponse]:
        info = self.info or self.server_info()
        body = {"model": info.model, **body, "stream": True, "stream_options": {"include_usage": True}}
        if info.kind == "sglang":
            body["return_meta_info"] = True
        scrape = info.kind == "vllm" and info.has_metrics and self.counter_deltas and not self._per_request_metrics
        before = self.scrape() if scrape else None
        tic = time.perf_counter()
        first = None
        generated, acceptance = 0, AcceptanceStats()
        usage, spec, meta, finish = {}, None, {}, None
        with self._open(self.base_url + path, body) as resp:
            for obj in _events(resp):
                if "error" in obj:
                    error = obj["error"]
                    raise DFlashError(f"The server stopped the reply: {error.get('message', error)}")
                usage = obj.get("usage") or usage
                spec = (obj.get("metrics") or {}).get("speculative_decoding") or spec
                meta = obj.get("meta_info") or meta
                for choice in obj.get("choices") or []:
                    meta = choice.get("meta_info") or meta
                    finish = choice.get("finish_reason") or finish
                    message = choice.get("delta") or choice.get("message") or {}
                    text = message.get("content") or choice.get("text") or ""
                    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
                    reasoning = reasoning if isinstance(reasoning, str) else ""  # not another API's object
                    cycle = obj.get("dflash")
                    if cycle is None and not text and not reasoning:
                        continue
                    now = time.perf_counter()
                    first = first or now
                    n = cycle["tokens"] if cycle else 1  # a chunk is about a token elsewhere
                    generated += n
                    if cycle and cycle["cycle"] > 0:
                        acceptance.add(cycle["num_draft"], cycle["acceptance_length"])
                    yield GenerationResponse(
                        text=text,
                        reasoning=reasoning,
                        tokens=[],
                        cycle=cycle["cycle"] if cycle else 0,
                        acceptance_length=cycle["acceptance_length"] if cycle else 1,
                        num_draft=cycle["num_draft"] if cycle else 0,
                        mean_acceptance_length=acceptance.tau,
                        drafting_cycles=acceptance.drafting_cycles,
                        plain_cycles=acceptance.plain_cycles,
                        prompt_tokens=0,
                        prompt_tps=0.0,
                        generation_tokens=generated,
                        generation_tps=(generated - 1) / (now - first) if now > first else 0.0,
                        peak_memory=0.0,
                    )
        end = time.perf_counter()
        first = first or end
        completion = usage.get("completion_tokens") or generated
        prompt = usage.get("prompt_tokens") or 0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        tps = (completion - 1) / (end - first) if end > first and completion > 1 else 0.0
        # The prompt's numbers, now that usage has them (cycle 0 carries them, as in stream_generate).
        common = dict(
            text="",
            tokens=[],
            prompt_tokens=prompt - cached,
            prompt_tps=(prompt - cached) / (first - tic) if first > tic else 0.0,
            generation_tokens=completion,
            generation_tps=tps,
            peak_memory=0.0,
        )
        tau, steps = self._tau(info, spec, meta, before)
        if tau is None or info.kind == "dflash":
            yield GenerationResponse(
                acceptance_length=1,
                mean_acceptance_length=acceptance.tau,
                cycle=0,
                drafting_cycles=acceptance.drafting_cycles,
                plain_cycles=acceptance.plain_cycles,
                finish_reason=finish or "stop",
                **common,
            )
            return
        yield GenerationResponse(acceptance_length=1, mean_acceptance_length=1.0, cycle=0, **common)
        # One summary: the server's tau over its verification steps (a gauge gives no count: one).
        yield GenerationResponse(
            acceptance_length=max(1, round(tau)),
            mean_acceptance_length=tau,
            cycle=max(steps, 1),
            drafting_cycles=max(steps, 1),
            finish_reason=finish or "stop",
            **common,
        )

    def _tau(self, info: ServerInfo, spec: dict | None, meta: dict, before: dict | None) -> tuple[float | None, int]:
        """(tau, verification steps) from the best source the server gave, else (None, 0)."""
        if spec and spec.get("num_spec_steps"):
            self._per_request_metrics = True
            return float(spec["mean_acceptance_length"]), int(spec["num_spec_steps"])
        if meta.get("spec_accept_length") is not None:
            return float(meta["spec_accept_length"]), int(meta.get("spec_verify_ct") or 0)
        if before is not None:
            after = self.scrape() or {}
            drafts = after.get(VLLM_DRAFTS, 0.0) - before.get(VLLM_DRAFTS, 0.0)
            accepted = after.get(VLLM_ACCEPTED, 0.0) - before.get(VLLM_ACCEPTED, 0.0)
            if drafts > 0:
                return 1.0 + accepted / drafts, int(drafts)
            info.tau_reason = "vLLM's spec-decode counters did not move (is --speculative-config set?)"
            return None, 0
        if info.kind == "sglang" and info.has_metrics:
            gauge = (self.scrape() or {}).get(SGLANG_GAUGE)
            if gauge:
                return float(gauge), 0
            info.tau_reason = "SGLang reported no spec_accept_length (is --speculative-algorithm set?)"
        return None, 0


def _events(resp) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, up to ``[DONE]`` (or one plain JSON body)."""
    if not (resp.headers.get("Content-Type") or "").startswith("text/event-stream"):
        yield json.loads(resp.read())  # a server that ignored "stream": one whole answer
        return
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
