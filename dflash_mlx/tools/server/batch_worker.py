"""The worker thread on the batching engine: every request in flight decoded together.

The HTTP side is :class:`~dflash_mlx.tools.server.worker.Worker`'s (tokenize and check a request, queue it,
429 when the queue is full); the thread differs. It takes queued requests into a
:class:`~dflash_mlx.loop.batch.BatchEngine` while it has fewer than ``max_batch`` of them, runs one engine
cycle at a time, and turns each row's tokens into that request's events (text, reasoning, per-cycle
acceptance), as the one-at-a-time worker does from ``stream_generate``. A request whose client went away, or
whose stop string came, leaves the batch after the cycle in flight. Each request continues the conversation
cache whose prompt it extends, as before, but never one another running request holds.
"""

import logging
import os
import queue
import time
from dataclasses import dataclass, field

from ...base.errors import DFlashError
from ...generation import batch_engine, batch_request
from ...loop.cache import DFlashCache
from ...loop.options import LoopOptions
from ...models import target as tgt
from ...text.reasoning import join, reasoning_parser
from ...text.responses import AcceptanceStats
from ...tuning.batch import BatchCosts
from .protocol import APIError, StopMatcher, spec_decoding, usage
from .settings import generation_settings, loop_settings, num_spec_tokens, policy_setup
from .worker import Job, PromptCaches, Worker

log = logging.getLogger("dflash-serve")

# Most rows by default, and the share of the machine's memory their caches may take at the full context.
MAX_BATCH = 8
MEMORY_SHARE = 0.25


def row_bytes(model, context: int) -> int:
    """Bytes of one row's target keys and values at ``context`` tokens (the cache's dtype: the target's)."""
    args = tgt.text_args(model)
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    size = tgt.compute_dtype(model).size
    return 2 * tgt.num_layers(model) * heads * head_dim * size * context


def default_max_batch(model, context: int | None) -> tuple[int, str]:
    """Rows whose caches at the full ``context`` fit in a quarter of this machine's memory (1 to 8), and why."""
    context = context or 4096
    per_row = row_bytes(model, context)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = max(1, min(MAX_BATCH, int(MEMORY_SHARE * memory // max(per_row, 1))))
    why = f"{per_row / 1e6:.0f} MB a row for {context} tokens of context, {memory / 1e9:.0f} GB of memory"
    return rows, why


@dataclass
class _Flight:
    """A request in the engine, and what its answer so far needs."""

    job: Job
    cache: DFlashCache
    stop: StopMatcher
    detokenizer: object
    parser: object
    num_spec_tokens: int
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    tokens: list[int] = field(default_factory=list)
    cycles: int = 0
    prompt_tokens: int = 0
    cached: int = 0
    first: float | None = None
    done: bool = False


class BatchWorker(Worker):
    """:class:`Worker` whose thread decodes up to ``max_batch`` requests at once (module docstring).

    Args:
        max_batch: The most requests decoded together (None: :func:`default_max_batch`).
        kwargs: As for :class:`Worker`; ``ranks`` must be None (a sharded target serves one at a time).

    Raises:
        DFlashError: For a target the engine cannot batch (use ``max_batch=1``).
    """

    def __init__(self, model, draft, tokenizer, *, max_batch: int | None = None, **kwargs):
        if kwargs.get("ranks") is not None:
            raise DFlashError("A sharded target serves one request at a time: leave --max-batch at 1.")
        context = kwargs.get("max_context") or getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.max_batch, self.batch_note = (max_batch, "as asked") if max_batch else default_max_batch(model, context)
        self.costs = BatchCosts()  # the pair's batched passes, timed across requests
        self.engine = batch_engine(model, draft, max_batch=self.max_batch,
                                   prefill_step_size=kwargs.get("prefill_step_size", 512), costs=self.costs)  # fmt: skip
        self.flights: dict[int, _Flight] = {}
        super().__init__(model, draft, tokenizer, **kwargs)
        self.caches = PromptCaches(self.session, kwargs.get("prompt_cache_size", 4))

    @property
    def num_running(self) -> int:
        return len(self.flights)

    def close(self) -> None:
        self._closing.set()
        for flight in list(self.flights.values()):
            flight.job.cancelled.set()
        super().close()

    # ---- the worker thread -------------------------------------------------------------

    def _loop(self) -> None:
        # As Worker's: the thread never exits (MLX may abort a process whose MLX thread ends at shutdown).
        while True:
            if self.engine.idle:
                self._admit(self._queue.get())
            while len(self.flights) < self.max_batch:
                try:
                    self._admit(self._queue.get_nowait())
                except queue.Empty:
                    break
            for row_id, flight in self.flights.items():
                if flight.job.cancelled.is_set():
                    self.engine.cancel(row_id)
            if self.engine.idle:
                continue
            self.running = next(iter(self.flights.values())).job if self.flights else None
            try:
                events = self.engine.step()
            except Exception as e:  # the server must outlive any one request
                self._fail_all(e)
                continue
            for event in events:
                self._deliver(event)
            self.metrics.batch(self.engine.active, self.engine.acceptance())
            self.running = next(iter(self.flights.values())).job if self.flights else None

    def _admit(self, job: Job | None) -> None:
        if job is None or job.cancelled.is_set():
            return
        req, ids = job.request, job.ids
        generation = generation_settings(req, ids, has_draft=self.draft is not None, tokenizer=self.tokenizer)
        busy = {id(f.cache) for f in self.flights.values()}
        try:
            options = LoopOptions(
                **loop_settings(generation), policy=self.session.policy(policy_setup(generation)),
                datastore=self.datastore, stop_tokens=frozenset(self.tokenizer.eos_token_ids),
                prefill_step_size=self.prefill_step_size,
            )  # fmt: skip
            cache = self.caches.take(ids, busy)
            row_id = self.engine.add(batch_request(self.model, self.draft, ids, options, prompt_cache=cache), None)
        except DFlashError as e:
            job.events.put(("error", APIError(400, str(e))))
            self.completed += 1
            return
        parser = reasoning_parser(self.tokenizer, ids) if generation["parse_reasoning"] else None
        self.flights[row_id] = _Flight(job, cache, StopMatcher(req.stop), self.tokenizer.detokenizer, parser,
                                       num_spec_tokens(generation, self.max_block_size))  # fmt: skip

    def _deliver(self, event) -> None:
        flight = self.flights.get(event.id)
        if flight is None:
            return
        if event.finish == "cancelled":
            self._end(event.id, flight, "cancelled")
            return
        now = time.perf_counter()
        if event.prompt_tokens:
            flight.prompt_tokens, flight.cached, flight.first = event.prompt_tokens, event.cached, now
        else:
            flight.cycles += 1
            flight.acceptance.add(event.num_draft, len(event.tokens), event.source)
        flight.tokens.extend(event.tokens)
        tokens = list(event.tokens)
        if event.finish == "stop":
            tokens.pop()  # the stop token itself is not text
        for t in tokens:
            flight.detokenizer.add_token(t)
        if event.finish:
            flight.detokenizer.finalize()
        text, reasoning = flight.detokenizer.last_segment, ""
        if flight.parser is not None:
            text, reasoning = join(flight.parser.feed(text) + (flight.parser.flush() if event.finish else []))
        text, hit = flight.stop.feed(text)
        finish = "stop" if hit else event.finish
        if finish and not hit:
            text += flight.stop.flush()
        cycle = {"cycle": flight.cycles, "tokens": len(event.tokens), "num_draft": event.num_draft,
                 "acceptance_length": len(event.tokens)}  # fmt: skip
        flight.job.events.put(("delta", text, reasoning, cycle))
        if finish:
            if hit and not event.finish:
                self.engine.cancel(event.id)  # a stop string: the row leaves after this cycle
            self._end(event.id, flight, finish)

    def _end(self, row_id: int, flight: _Flight, finish: str) -> None:
        if flight.done:
            return
        flight.done = True
        self.flights.pop(row_id, None)
        self.completed += 1
        job, completion = flight.job, len(flight.tokens)
        if self.datastore is not None and flight.tokens:
            self.datastore.add(flight.tokens)
        elapsed = time.perf_counter() - flight.first if flight.first is not None else 0.0
        self.metrics.observe(
            prompt_tokens=len(job.ids),
            generation_tokens=completion,
            acceptance=flight.acceptance,
            tps=(completion - 1) / elapsed if completion > 1 and elapsed > 0 else 0.0,
            finished=finish != "cancelled",
        )
        if finish == "cancelled":
            reason = "shutting down" if self._closing.is_set() else "client gone"
            log.info("%s cut after %d tokens (%s)", job.request.id, completion, reason)
            job.events.put(("error", APIError(503, "The server is shutting down; the reply was cut.",
                                              type="server_error", code="shutting_down")))  # fmt: skip
            return
        spec = spec_decoding(flight.acceptance, flight.num_spec_tokens) if self.draft is not None else None
        job.events.put(("done", finish, usage(len(job.ids), completion, flight.cached), {"speculative_decoding": spec}))

    def _fail_all(self, e: Exception) -> None:
        # A cycle failed: every request in it ends with the error, and the engine starts afresh (the
        # conversation caches those requests held are dropped: their state is unknown).
        log.exception("a batched cycle failed")
        held = {id(f.cache) for f in self.flights.values()}
        self.caches.entries = [entry for entry in self.caches.entries if id(entry[0]) not in held]
        error = APIError(500, f"{type(e).__name__}: {e}", type="server_error")
        for flight in self.flights.values():
            flight.job.events.put(("error", error))
            self.completed += 1
        self.flights.clear()
        self.running = None
        self.engine = batch_engine(self.model, self.draft, max_batch=self.max_batch,
                                   prefill_step_size=self.prefill_step_size, costs=self.costs)  # fmt: skip
