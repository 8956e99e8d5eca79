"""The OpenAI request and response shapes of dflash-serve: parsing, checking, building.

Pure functions and plain dataclasses, no HTTP and no MLX, so every rule is testable alone.
Parameter names and defaults follow ``mlx_lm.server`` (``max_tokens``/``max_completion_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop``, ``seed``);
``block_size``, ``min_confidence``, ``confidence_threshold`` (a DSpark drafter's), ``lookup_fallback`` and
``tree_budget`` are ours. A chat request's
``chat_template_kwargs`` (as vLLM and SGLang take it, e.g. ``{"enable_thinking": false}``) and
``reasoning_effort`` (which gpt-oss's template reads) reach the chat template; a reasoning
model's reasoning comes back apart from its answer, as ``reasoning_content`` (as vLLM sends it).
"""

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...text.chat_template import REASONING_EFFORTS
from ...text.inputs import MAX_SEED, text_problem
from ...text.responses import AcceptanceStats

CHAT, TEXT = "chat", "text"
ROLES = ("system", "user", "assistant", "developer", "tool")
# OpenAI's own limit on stop sequences.
MAX_STOP = 4
# apply_chat_template's own arguments, which the server sets: a request may not replace them.
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


class APIError(Exception):
    """A request the server refuses, with the HTTP status and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Defaults:
    """Server-wide defaults for parameters a request leaves out (``dflash-serve`` flags)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    min_confidence: float = 0.0
    confidence_threshold: float = 0.0
    lookup_fallback: int = 0
    tree_budget: int | str = 0


@dataclass
class CompletionRequest:
    """One checked request: what to generate and how to answer."""

    kind: str  # CHAT or TEXT
    model: str
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | list[int] = ""
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    block_size: int | str | None = None  # or "auto"
    min_confidence: float = 0.0
    confidence_threshold: float = 0.0  # a DSpark drafter's confidence head cuts its drafts under it
    lookup_fallback: int = 0
    tree_budget: int | str = 0  # draft tree nodes a cycle (0: the drafter's path), or "auto"
    template_args: dict[str, Any] = field(default_factory=dict)  # for the chat template
    id: str = ""
    created: int = 0


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, optional=False):
    value = body.get(name, default)
    if value is None and optional:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"'{name}' must be {kind} (got {value!r}).", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise APIError(400, f"'{name}' must be {bounds} (got {value!r}).", param=name)
    return value


def _content(message: Any, i: int) -> str:
    if not isinstance(message, dict):
        raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content'.", param="messages")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r}).", param="messages")
    if content is None:
        content = ""
    if isinstance(content, list):
        # Content parts: only text parts can be shown to a text model.
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"messages[{i}].content has a part that is not text; this server takes text only.",
                    param="messages",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts.", param="messages")
    _check_text(content, f"messages[{i}].content", "messages")
    return content


def _check_text(text: str, what: str, param: str) -> None:
    # JSON's \ud800 escapes decode to strings no tokenizer can encode.
    problem = text_problem(text, what)
    if problem:
        raise APIError(400, problem, param=param)


def parse_request(body: Any, kind: str, defaults: Defaults = Defaults()) -> CompletionRequest:
    """Check a decoded JSON body of ``/v1/chat/completions`` (CHAT) or ``/v1/completions`` (TEXT).

    Raises:
        APIError: 400 naming the first bad field.
    """
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    req = CompletionRequest(kind=kind, model=body.get("model") or "")
    if not isinstance(req.model, str):
        raise APIError(400, f"'model' must be a string (got {req.model!r}).", param="model")
    if kind == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(
                400, "'messages' is required: a non-empty list of {role, content} objects.", param="messages"
            )
        req.messages = [{"role": m["role"], "content": _content(m, i)} for i, m in enumerate(messages)]
        req.template_args = _template_args(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise APIError(400, "'prompt' is required: a non-empty string (or one list of token ids).", param="prompt")
        if isinstance(prompt, str):
            _check_text(prompt, "'prompt'", "prompt")
        req.prompt = prompt
    n = body.get("n", 1)
    if n != 1:
        raise APIError(400, f"'n' must be 1: this server generates one choice per request (got {n!r}).", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false (got {stream!r}).", param="stream")
    req.stream = stream
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object.", param="stream_options")
    req.include_usage = bool(options.get("include_usage", False))
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    req.max_tokens = _number({name: max_tokens}, name, None, lo=1, integer=True, optional=True) or defaults.max_tokens
    req.temperature = float(_number(body, "temperature", defaults.temp, lo=0, hi=10))
    req.top_p = float(_number(body, "top_p", defaults.top_p, lo=0, hi=1))
    req.top_k = _number(body, "top_k", defaults.top_k, lo=-1, integer=True)
    req.top_k = max(req.top_k, 0)  # vLLM and SGLang spell "off" as -1
    req.min_p = float(_number(body, "min_p", defaults.min_p, lo=0, hi=1))
    penalty = _number(body, "repetition_penalty", None, lo=0, hi=10, optional=True)
    req.repetition_penalty = None if penalty in (None, 1, 1.0) else float(penalty)
    req.seed = _number(body, "seed", None, lo=0, hi=MAX_SEED, integer=True, optional=True)
    if body.get("block_size") == "auto":
        req.block_size = "auto"
    else:
        req.block_size = _number(body, "block_size", None, lo=1, integer=True, optional=True)
    req.min_confidence = float(_number(body, "min_confidence", defaults.min_confidence, lo=0, hi=1))
    req.confidence_threshold = float(_number(body, "confidence_threshold", defaults.confidence_threshold, lo=0, hi=1))
    req.lookup_fallback = _number(body, "lookup_fallback", defaults.lookup_fallback, lo=0, hi=1024, integer=True)
    if body.get("tree_budget") == "auto":
        req.tree_budget = "auto"
    else:
        req.tree_budget = _number(body, "tree_budget", defaults.tree_budget, lo=0, hi=1024, integer=True)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them.", param="stop")
    req.stop = stop
    req.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
    req.created = int(time.time())
    return req


def _template_args(body: dict) -> dict[str, Any]:
    args = body.get("chat_template_kwargs") or {}
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise APIError(
            400,
            "'chat_template_kwargs' must be an object, e.g. {\"enable_thinking\": false}.",
            param="chat_template_kwargs",
        )
    reserved = sorted(RESERVED_TEMPLATE_ARGS & args.keys())
    if reserved:
        raise APIError(
            400,
            f"'chat_template_kwargs' may not set {', '.join(reserved)}: the server sets them.",
            param="chat_template_kwargs",
        )
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(
                400,
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)} (got {effort!r}).",
                param="reasoning_effort",
            )
        args = {"reasoning_effort": effort, **args}
    return dict(args)


class StopMatcher:
    """Cuts the text at the first stop string, holding back a tail that may start one.

    ``feed`` returns the text that is safe to send now and whether a stop string was found;
    ``flush`` returns what was held back once generation ended without one.
    """

    def __init__(self, stop: list[str]):
        self.stop, self.pending = stop, ""
        self._hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stop:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(len(self.pending) - self._hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def spec_decoding(acceptance: AcceptanceStats, num_spec_tokens: int) -> dict:
    """One request's speculative decoding statistics, shaped like vLLM's per-request metrics.

    Steps are drafting cycles only, as vLLM counts them; ``mean_acceptance_length`` is their
    tau (:class:`dflash_mlx.text.responses.AcceptanceStats`), and ``num_plain_steps`` counts the
    cycles that verified no draft.
    """
    by_draft = acceptance.by_draft_length
    k = max(num_spec_tokens, max(by_draft, default=0))
    histogram = [0] * (k + 1)
    for row in by_draft.values():
        for j, count in enumerate(row):
            histogram[j] += count
    drafted = acceptance.draft_tokens
    return {
        "mean_acceptance_length": acceptance.tau,
        "draft_acceptance_rate": acceptance.accepted_drafts / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "acceptance_histogram_by_draft_length": {str(n): row for n, row in sorted(by_draft.items())},
        "num_spec_steps": acceptance.drafting_cycles,
        "num_plain_steps": acceptance.plain_cycles,
        "num_accepted_draft_tokens": acceptance.accepted_drafts,
        "num_draft_tokens": drafted,
        "num_spec_tokens": num_spec_tokens,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(req: CompletionRequest, obj: str, choices: list) -> dict:
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices}


def full_response(
    req: CompletionRequest, text: str, finish_reason: str, usage_: dict, metrics: dict, reasoning: str = ""
) -> dict:
    """The non-streaming answer; a chat reply's reasoning goes in ``reasoning_content``."""
    if req.kind == CHAT:
        message = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        out = _envelope(req, "chat.completion", [choice])
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        out = _envelope(req, "text_completion", [choice])
    out["usage"] = usage_
    out["metrics"] = metrics
    return out


def chunk(
    req: CompletionRequest,
    text: str | None,
    finish_reason: str | None = None,
    cycle: dict | None = None,
    first: bool = False,
    reasoning: str = "",
) -> dict:
    """One streamed chunk; ``cycle`` carries our per-cycle numbers (an extension field)."""
    if req.kind == CHAT:
        delta: dict = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta["content"] = text
        if reasoning:
            delta["reasoning_content"] = reasoning
        out = _envelope(
            req,
            "chat.completion.chunk",
            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        )
    else:
        out = _envelope(
            req, "text_completion", [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
        )
    if cycle is not None:
        out["dflash"] = cycle
    return out


def usage_chunk(req: CompletionRequest, usage_: dict, metrics: dict) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, usage and metrics."""
    obj = "chat.completion.chunk" if req.kind == CHAT else "text_completion"
    out = _envelope(req, obj, [])
    out["usage"] = usage_
    out["metrics"] = metrics
    return out
