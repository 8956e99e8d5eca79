"""The one thread that owns the pair and runs requests, one at a time, in arrival order.

HTTP threads tokenize and check a request, then ``submit`` it to a bounded queue (full: 429
with a Retry-After); the worker runs ``stream_generate`` for each in turn and hands the text back
through the job's own event queue as plain Python values. A job whose client went away is
cancelled and stops after the cycle in flight. Conversations reuse their cache: a small LRU of
``DFlashCache`` objects, picked by the longest cached prefix of the prompt. What the adaptive
policy measured of the pair is kept across requests (one ``PolicyState`` per drafting setup),
so a request does not pay again to learn that drafting loses.
"""

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from ...base.errors import DFlashError
from ...loop.cache import DFlashCache
from ...text.chat_template import render_chat
from ...text.responses import AcceptanceStats
from ...tuning.policy import PolicyState
from ..session import Session
from .metrics import Metrics
from .protocol import CHAT, APIError, CompletionRequest, StopMatcher, spec_decoding, usage
from .settings import generation_settings, loop_settings, num_spec_tokens, policy_setup

log = logging.getLogger("dflash-serve")


@dataclass
class Job:
    """A request in the queue, and the channel its answer comes back on.

    ``events`` receives ``("delta", text, reasoning, cycle)`` per generation cycle (``reasoning``:
    a chat reply's reasoning, apart from its answer ``text``), then one
    ``("done", finish_reason, usage, metrics)`` or ``("error", APIError)``.
    """

    request: CompletionRequest
    ids: list[int]
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)


class PromptCaches:
    """A few conversation caches; a prompt continues the one whose last prompt it extends.

    A prompt that starts with the prompt a cache last served is that conversation's next turn
    (or a retry of its last one): it reuses the cache, whose reply tail may be re-prefilled.
    Any other prompt gets a fresh cache, or the least recently used one, so that two
    conversations that share only a system prompt do not keep cutting each other's cache.
    """

    def __init__(self, session: Session, size: int):
        self.session, self.size = session, max(1, size)
        self.entries: list[list] = []  # [cache, last prompt length], least recently used first

    def take(self, ids: list[int], busy: frozenset[int] = frozenset()) -> DFlashCache:
        """The cache for ``ids``; one whose ``id`` is in ``busy`` (held by a running request: the batching
        worker runs several at once) is never handed out."""
        best, reuse = None, 0
        for entry in self.entries:
            cache, prompt_len = entry
            if id(cache) in busy:
                continue
            n = cache.reusable_prefix(ids)
            # reusable_prefix leaves the last id to prefill, hence the -1 for a retried prompt.
            if n >= min(prompt_len, len(ids) - 1) and n >= reuse:
                best, reuse = entry, n
        if best is not None:
            self.entries.remove(best)
        elif len(self.entries) < self.size:
            best = [self.session.make_cache(), 0]
        else:
            idle = [e for e in self.entries if id(e[0]) not in busy]
            if not idle:
                return self.session.make_cache()  # all held: one for this request alone
            best = idle[0]  # the least recently used; stream_generate trims it
            self.entries.remove(best)
        best[1] = len(ids)
        self.entries.append(best)
        return best[0]


def generate_for(session: Session, generation: dict, *, prompt_cache: DFlashCache, prefill_step_size: int,
                 setup: dict | None = None, policy: PolicyState | None = None):  # fmt: skip
    """``session.stream`` for a request's plain ``generation`` settings (:mod:`dflash_mlx.tools.server.settings`;
    what rank 0 sends the other ranks of a sharded target, :mod:`dflash_mlx.tools.server.ranks`); only rank 0
    drafts, so only its session has a datastore. ``setup``: the session's policy state to go on from; else
    ``policy``."""
    return session.stream(
        generation["ids"],
        **loop_settings(generation),
        setup=setup,
        policy=policy,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        parse_reasoning=generation["parse_reasoning"],
    )


class Worker:
    """Runs requests on the pair, one at a time, from a bounded queue.

    Args:
        model, draft, tokenizer: The loaded pair (``dflash_mlx.load``); ``draft`` may be None.
        queue_size: Requests that may wait behind the running one; more are refused (429).
        prompt_cache_size: Conversation caches kept for prefix reuse.
        max_context: The most tokens of prompt plus reply (default: the target's
          ``max_position_embeddings``, when it has one).
        chat_template_args: Extra keyword arguments for ``apply_chat_template``.
        metrics: Counters shared with ``/metrics``.
        datastore: The target's past text to draft from (:class:`dflash_mlx.drafts.datastore.Datastore`),
          which every reply joins, or None. Drafts never change the output, but one client's
          replies can speed up another's (only where the text repeats).
        ranks: On rank 0 of a sharded target, the other ranks (:class:`dflash_mlx.tools.server.ranks.Ranks`),
          told each request before it runs and the shutdown after the last; None alone.
    """

    def __init__(
        self,
        model,
        draft,
        tokenizer,
        *,
        queue_size: int = 16,
        prompt_cache_size: int = 4,
        max_context: int | None = None,
        chat_template_args: dict | None = None,
        prefill_step_size: int = 512,
        metrics: Metrics | None = None,
        datastore=None,
        ranks=None,
    ):
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.datastore = datastore  # every request's reply joins it
        self.session = Session(model, draft, tokenizer, datastore=datastore)
        self.ranks = ranks
        self.released = threading.Event()  # the other ranks were told to stop
        self.max_block_size = draft.block_size if draft is not None else 1
        self.max_context = max_context or getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
        self.chat_template_args = chat_template_args or {}
        self.prefill_step_size = prefill_step_size
        self.metrics = metrics or Metrics()
        self.caches = PromptCaches(self.session, prompt_cache_size)
        # The adaptive policy's state per drafting setup (block size, sampling, cut, fallback).
        self.policies = self.session.policies
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe across threads
        self._closing = threading.Event()
        self.running: Job | None = None
        self.completed = 0  # jobs finished, for tests and /health
        self._seconds_per_job = 1.0
        threading.Thread(target=self._loop, name="dflash-serve-worker", daemon=True).start()

    # ---- HTTP threads ------------------------------------------------------------------

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        """Tokenize and check a request (on the caller's thread). Raises ``APIError``."""
        if req.block_size == "auto" and self.draft is None:
            raise APIError(400, "'block_size' auto chooses how many drafts to verify, but the server has no "
                           "drafter.", param="block_size")  # fmt: skip
        if isinstance(req.block_size, int) and req.block_size > self.max_block_size:
            raise APIError(
                400,
                f"'block_size' must be from 1 to the drafter's block size {self.max_block_size} "
                f"(got {req.block_size}).",
                param="block_size",
            )
        with self._tokenizer_lock:
            ids = self._encode(req)
        if not ids:
            raise APIError(400, "The prompt is empty after tokenization.", param="prompt")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"The prompt holds token ids outside 0..{self.vocab_size - 1}.", param="prompt")
        if self.max_context is not None:
            if len(ids) >= self.max_context:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_context} tokens, but the "
                    f"prompt has {len(ids)}. Shorten the prompt or the conversation.",
                    param="messages" if req.kind == CHAT else "prompt",
                    code="context_length_exceeded",
                )
            req.max_tokens = min(req.max_tokens, self.max_context - len(ids))
        return ids

    def _encode(self, req: CompletionRequest) -> list[int]:
        tok = self.tokenizer
        if req.kind == CHAT:
            try:
                rendered = render_chat(
                    tok, req.messages, template_args={**self.chat_template_args, **req.template_args}
                )
            except Exception as e:  # a template may refuse a role order; say so, not 500
                raise APIError(400, f"The chat template rejected these messages: {e}", param="messages") from None
            if not isinstance(rendered, str):
                return rendered
            text = rendered  # a base model continues the text
        elif isinstance(req.prompt, list):
            return list(req.prompt)
        else:
            text = req.prompt
        if not text:
            return []
        bos = tok.bos_token  # as stream_generate encodes a text prompt
        return tok.encode(text, add_special_tokens=bos is None or not text.startswith(bos))

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the others. Raises ``APIError`` 429 when full, 503 when closing."""
        if self._closing.is_set():
            raise APIError(503, "The server is shutting down.", type="server_error", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = max(1, math.ceil(self._seconds_per_job * (self._queue.qsize() + 1)))
            raise APIError(
                429,
                f"The server is busy: {self._queue.maxsize} requests are already waiting. Retry in about {wait} s.",
                type="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(wait)},
            ) from None

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def num_running(self) -> int:
        """Requests being decoded now."""
        return int(self.running is not None)

    def close(self) -> None:
        """Refuse new jobs, cut the running one after its cycle, and fail the queued ones."""
        self._closing.set()
        if self.running is not None:
            self.running.cancelled.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.events.put(
                ("error", APIError(503, "The server is shutting down.", type="server_error", code="shutting_down"))
            )
        if self.ranks is not None:
            self._queue.put(None)  # the worker thread, after the running job, tells the other ranks

    # ---- the worker thread -------------------------------------------------------------

    def _loop(self) -> None:
        # The thread never exits: one that used MLX and ends during interpreter shutdown can
        # abort the process (seen with MLX 0.32 on Linux).
        while True:
            try:
                job = self._queue.get(timeout=None if self.ranks is None else self.ranks.HEARTBEAT)
            except queue.Empty:
                self.ranks.heartbeat()  # idle: a rank that died is found now, not at the next request
                continue
            if job is None:
                self.ranks.shut_down()
                self.released.set()
                continue
            if job.cancelled.is_set():
                continue
            self.running = job
            tic = time.perf_counter()
            try:
                self._run(job)
            except APIError as e:
                job.events.put(("error", e))
            except DFlashError as e:
                job.events.put(("error", APIError(400, str(e))))
            except Exception as e:  # the server must outlive any one request
                log.exception("request %s failed", job.request.id)
                if self.ranks is not None:
                    # The ranks may be out of step (a rank died mid-pass): end this one as well.
                    self.ranks.abort()
                job.events.put(("error", APIError(500, f"{type(e).__name__}: {e}", type="server_error")))
            finally:
                self.running = None
                self.completed += 1
                self._seconds_per_job = 0.7 * self._seconds_per_job + 0.3 * (time.perf_counter() - tic)

    def _run(self, job: Job) -> None:
        req, ids = job.request, job.ids
        generation = generation_settings(req, ids, has_draft=self.draft is not None, tokenizer=self.tokenizer)
        acceptance = AcceptanceStats()
        stop = StopMatcher(req.stop)
        if self.ranks is not None:
            self.ranks.announce(generation)  # the other ranks run the same generation with this one
        responses = generate_for(self.session, generation, prompt_cache=self.caches.take(ids),
                                 setup=policy_setup(generation), prefill_step_size=self.prefill_step_size)  # fmt: skip
        last, finish = None, None
        try:
            for last in responses:
                text, hit = stop.feed(last.text)
                if last.cycle > 0:
                    acceptance.add(last.num_draft, last.acceptance_length)
                finish = "stop" if hit else last.finish_reason
                if finish and not hit:
                    text += stop.flush()
                cycle = {
                    "cycle": last.cycle,
                    "tokens": len(last.tokens),
                    "num_draft": last.num_draft,
                    "acceptance_length": last.acceptance_length,
                }
                job.events.put(("delta", text, last.reasoning, cycle))
                if finish:
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
        finally:
            responses.close()
        completion = last.generation_tokens if last else 0
        cached = len(ids) - last.prompt_tokens if last else 0
        spec = None
        if self.draft is not None:
            spec = spec_decoding(acceptance, num_spec_tokens(generation, self.max_block_size))
        metrics = {"speculative_decoding": spec}
        self.metrics.observe(
            prompt_tokens=len(ids),
            generation_tokens=completion,
            acceptance=acceptance,
            tps=last.generation_tps if last else 0.0,
            finished=finish != "cancelled",
        )
        if finish == "cancelled":
            reason = "shutting down" if self._closing.is_set() else "client gone"
            log.info("%s cut after %d tokens (%s)", req.id, completion, reason)
            job.events.put(
                (
                    "error",
                    APIError(
                        503,
                        "The server is shutting down; the reply was cut.",
                        type="server_error",
                        code="shutting_down",
                    ),
                )
            )
            return
        job.events.put(("done", finish, usage(len(ids), completion, cached), metrics))
