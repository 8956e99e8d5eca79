"""Several conversations at once: one engine that drafts for and verifies many sequences in one target pass.

Design. The engine owns one copy of the pair and a list of rows, one per sequence. A row keeps what a
single-stream generation keeps: its committed tokens and drafter context (a ``DFlashCache`` whose target part
is idle while the row runs), its proposer (the drafter, prompt lookup, the datastore, the adaptive policy's
pauses: whatever the caller's factory builds for it), its sampler and logits processors, its stop tokens and
token budget. The target's keys and values of every running row live in one :class:`RowsKVCache` per layer,
each row as long as its own sequence (:mod:`dflash_mlx.models.rows`).

Each :meth:`BatchEngine.step` is one cycle:

1. Requests that joined are prefilled by themselves, in arrival order, ``prefill_step_size`` prompt tokens a
   cycle in all, so a long prompt does not stop the running rows for long; when its last chunk is done its first token is out and its
   cache is copied in as a new row.
2. Every running row proposes what it would alone, and all proposals are cut to ``W - 1`` drafts, ``W`` the
   width :class:`~dflash_mlx.tuning.batch.BatchCosts` finds best for this batch size from timed passes, the
   rows' acceptance so far and what each proposed. Width 1 is plain batched decoding. The rows whose proposal
   runs the DFlash drafter this cycle (asked first, :meth:`~dflash_mlx.loop.proposal.Proposer.drafter_pass`)
   draft in one drafter pass over all of them (:func:`~dflash_mlx.models.draft_rows.propose_rows`), each row
   from its own context caches; each proposer then drafts from its row's logits as from a pass of its own.
3. One target pass over ``[last, drafts..., padding]`` of every row, each at its own positions and seeing only
   its own entries (:func:`~dflash_mlx.models.rows.forward_rows`).
4. Each row accepts with the single-stream rules (greedy: the drafts the target's argmax agrees with; sampled:
   one-hot drafts against the target's own sample, drawn drafts by the speculative-sampling test), emits the
   kept drafts and the bonus token cut to its budget and stop tokens, and rolls back alone: its length in the
   rows cache drops by what it did not keep. A row that finished, or was cancelled, leaves between cycles;
   with a conversation cache its entries are copied back there, so its next turn reuses them.

Every row's tokens are the target's own samples given that row's tokens only, so a greedy row equals the same
request decoded alone token for token, whatever else is in the batch (up to float rounding of a batched pass
against a single one, as a verify pass against a one-token step).
A seeded row draws its random numbers from its own generator and verifies its whole block every cycle, even
alone, so its sampled reply is the same whatever else is in the batch (up to the same rounding).

While one row runs (and others at most prefill), it runs alone on its own cache with the single-stream
:class:`~dflash_mlx.loop.verify.Verifier`: the compiled CPU steps, a plain step queued ahead, every family. It
moves into the rows cache when a second row is ready, and out again when it is the last (a copy each way).
A hybrid target's Gated DeltaNet layers keep a state per row and each row's state after every position of
the pass, so a row rolls back alone by selecting (:class:`~dflash_mlx.models.rows.RowsRecurrentCache`).
A sliding-window layer's rows keep their positions where they are and a mask shows each query its window.
Targets :func:`~dflash_mlx.models.rows.rows_supported` refuses (a family it does not know, Gated DeltaNet layers
it does not walk itself) run with ``max_batch=1`` only (the engine refuses more in one line). A row running
alone verifies a proposer's draft tree whole (the text's trees, the drafter's own with ``tree_budget``), and so
does a shared pass where each node can sit at its own position (float32 Qwen3 and Llama targets through the
compiled CPU steps, :func:`~dflash_mlx.models.rows.trees_supported`: every row's nodes see only their ancestors);
elsewhere a shared pass verifies each tree's likeliest line. ``"auto"`` widths and trees are refused per request:
they time the row's own passes.
"""

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..cpu.speedups import CpuSpeedups
from ..models import draft_rows
from ..models import rows as rows_model
from ..sampling import Sampler, accept_one_hot, is_greedy, sample_rows, speculative_accept
from ..tuning.batch import BatchCosts, RowAcceptance
from .cache import DFlashCache
from .options import Budget
from .proposal import DrafterPass, Proposal, Proposer
from .verify import LogitsProcessor, Verifier

# A stream for the engine on whichever thread runs it (a server's worker).
batch_stream = mx.new_thread_local_stream(mx.default_device())


@dataclass
class RowRequest:
    """One sequence for the engine.

    Args:
        ids: The prompt's token ids (the chat template already applied).
        cache: The pair's cache to continue (its common prefix with ``ids`` is reused and, when the row leaves,
          it holds the conversation again), or None for a fresh one.
        max_tokens: The most tokens to emit.
        stop_tokens: Tokens that end the reply (emitted, then the row leaves).
        sampler: ``logprobs -> ids``; None or a greedy one takes the argmax.
        logits_processors: mlx-lm logits processors, applied at every verified position.
        block_size: The most tokens a cycle verifies for this row (drafts + 1).
        proposer: Builds the row's proposer from its cache, once the cache is known.
        seed: Draw this row's random numbers from its own generator, seeded so: its reply is then the same
          whatever else is in the batch (up to float rounding of a batched pass). Such a row verifies its whole
          block every cycle and runs as a row even alone, so that its draws never depend on the load.
    """

    ids: list[int]
    proposer: Callable[[DFlashCache], Proposer]
    cache: DFlashCache | None = None
    max_tokens: int = 256
    stop_tokens: frozenset[int] = frozenset()
    sampler: Callable | None = None
    logits_processors: list[LogitsProcessor] | None = None
    block_size: int = 16
    seed: int | None = None


@dataclass
class RowEvent:
    """What one row emitted in a cycle: ``tokens`` (ending with a stop token when it stopped), the drafts it
    verified and kept, and ``finish`` ("stop", "length", "cancelled") on its last event."""

    id: int
    tokens: list[int]
    num_draft: int = 0
    num_accepted: int = 0
    finish: str | None = None
    source: str = ""
    prompt_tokens: int = 0  # prefilled (the first event only)
    cached: int = 0  # reused from the conversation cache (the first event only)


@dataclass
class _Row:
    id: int
    request: RowRequest
    cache: DFlashCache
    proposer: Proposer | None = None
    verifier: Verifier | None = None  # the prefill's, then a row running alone's
    in_rows: bool = False  # its target entries are in the rows cache (else in its own cache)
    prefilled: int = 0  # prompt tokens fed so far (reused ones included)
    reused: int = 0
    last: int = 0
    budget: Budget = field(init=False)
    acceptance: RowAcceptance = field(default_factory=RowAcceptance)
    cancelled: bool = False
    seed: int | None = None  # a seeded row's generator: the seed its next draws start from

    def __post_init__(self):
        self.budget = Budget(self.request.max_tokens, frozenset(self.request.stop_tokens))
        self.seed = self.request.seed

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """MLX's random draws made inside come from this row's own generator when it is seeded. MLX's generator
        can be seeded but not set back, so each scope starts from a seed and ends by drawing the next one; the
        shared generator goes on from a seed drawn from it first. (A draw takes its key as its graph is built, so
        evaluating it later is fine.)"""
        if self.seed is None:
            yield
            return
        resume = _next_seed()
        mx.random.seed(self.seed)
        try:
            yield
        finally:
            self.seed = _next_seed()
            mx.random.seed(resume)

    @property
    def room(self) -> int:
        return self.budget.room

    def emit(self, tokens: list[int]) -> tuple[list[int], str | None]:
        tokens = self.budget.emit(tokens)
        return tokens, self.budget.finish(tokens)


def _tree_layout(proposals: list[Proposal], width: int) -> tuple[mx.array, mx.array] | None:
    """``(ancestors (B, W, W), depths (B, W))`` of the rows' blocks when any is a draft tree (a path's nodes each
    see the ones before, as do the padding's), else None."""
    if all(p.tree is None for p in proposals):
        return None
    ancestors, depths = [], []
    for p in proposals:
        line = [[k <= q for k in range(width)] for q in range(width)]
        level = list(range(width))
        if p.tree is not None:
            n = p.tree.size + 1
            tree = p.tree.ancestors().tolist()
            for q in range(n):
                line[q][:n] = tree[q]
            level[:n] = [0, *p.tree.depths]
            # Padding after a tree: each sits one further than the deepest node, seeing only itself and the root.
            for q in range(n, width):
                line[q] = [k in (0, q) for k in range(width)]
                level[q] = 1 + max(level[:n]) + q - n
        ancestors.append(line)
        depths.append(level)
    return mx.array(ancestors), mx.array(depths, dtype=mx.int32)


def _next_seed() -> int:
    # A seed for what comes next, drawn from MLX's generator as it stands.
    high, low = mx.random.randint(0, 2**31 - 1, (2,)).tolist()
    return high << 31 | low


class BatchEngine:
    """Continuous batching of DFlash generations on one pair (module docstring).

    Args:
        model: The target (a family :func:`~dflash_mlx.models.rows.rows_supported` accepts).
        tap_ids: Target layers whose taps the rows' drafter needs (empty without a drafter).
        max_batch: The most rows decoded at once; more requests wait.
        prefill_step_size: Prompt tokens a joining request prefills per cycle.
        speedups: The CPU speedups for prefills, or None.
        kernels: The Metal kernels' mode for prefills.
        costs: What earlier engines timed of the pair's passes (a fresh one when None).

    Raises:
        DFlashError: For a target the rows cannot run.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tap_ids: list[int] = (),
        max_batch: int = 8,
        prefill_step_size: int = 512,
        speedups: CpuSpeedups | None = None,
        kernels: str = "auto",
        costs: BatchCosts | None = None,
    ):
        why = rows_model.rows_supported(model)
        if why is not None and max_batch > 1:
            raise DFlashError(f"Several requests at once: {why}; serve them one at a time (--max-batch 1).")
        if max_batch < 1:
            raise DFlashError(f"max_batch must be at least 1 (got {max_batch}).")
        self.model, self.tap_ids, self.max_batch = model, list(tap_ids), max_batch
        self.prefill_step_size, self.speedups, self.kernels = prefill_step_size, speedups, kernels
        self.costs = costs if costs is not None else BatchCosts()
        self.target = rows_model.make_rows_cache(model, kernels)
        # Whether a shared pass verifies draft trees whole (else each as its likeliest line).
        self.trees = rows_model.trees_supported(model, self.target, speedups)
        self.waiting: deque[_Row] = deque()
        self.joining: list[_Row] = []  # prefilling, in arrival order
        self.running: list[_Row] = []  # in the order of the rows cache
        self._next_id = 0
        self.last_width = 0
        self.drafted_together = 0  # rows' drafter passes run batched, so far

    # ---- requests ------------------------------------------------------------------------

    def add(self, request: RowRequest, make_cache: Callable[[], DFlashCache]) -> int:
        """Queue ``request``; returns its row id. ``make_cache`` makes a fresh pair cache when it brings none."""
        if not request.ids:
            raise DFlashError("The prompt is empty: pass at least one token.")
        row = _Row(self._next_id, request, request.cache if request.cache is not None else make_cache())
        self._next_id += 1
        self.waiting.append(row)
        return row.id

    def cancel(self, row_id: int) -> None:
        """Stop ``row_id`` at the next cycle (its last event says "cancelled")."""
        for row in (*self.waiting, *self.joining, *self.running):
            if row.id == row_id:
                row.cancelled = True

    @property
    def active(self) -> int:
        """Rows joining or running."""
        return len(self.joining) + len(self.running)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.joining or self.running)

    def acceptance(self) -> dict[int, float]:
        """Each running row's learned chance that a draft is right."""
        return {row.id: row.acceptance.chance for row in self.running}

    # ---- one cycle -----------------------------------------------------------------------

    def step(self) -> list[RowEvent]:
        """One cycle: a prefill chunk of a joining request, then one pass over every running row."""
        with mx.stream(batch_stream):
            events = self._leave_cancelled()
            while self.waiting and self.active < self.max_batch:
                self._join(self.waiting.popleft())
            budget = self.prefill_step_size  # prompt tokens this cycle, over the joining requests in order
            while self.joining and budget > 0:
                row = self.joining[0]
                n = min(budget, len(row.request.ids) - row.prefilled)
                events += self._prefill_chunk(row, n)
                budget -= n
            if len(self.running) == 1 and not self.running[0].seeded:
                events += self._solo_cycle(self.running[0])
            elif self.running:
                self._to_rows()
                events += self._cycle()
            return events

    def _join(self, row: _Row) -> None:
        req = row.request
        row.reused = row.cache.resume(req.ids)
        row.prefilled = row.reused
        row.proposer = req.proposer(row.cache)
        row.verifier = self._verifier(row, run_ahead=False)
        self.joining.append(row)

    def _verifier(self, row: _Row, run_ahead: bool) -> Verifier:
        # The single-stream verifier on the row's own cache: its prefill, or its cycles while it runs alone.
        req = row.request
        return Verifier(
            self.model, row.cache, sampler=None if is_greedy(req.sampler) else req.sampler,
            logits_processors=req.logits_processors, tap_ids=row.proposer.tap_ids, speedups=self.speedups,
            kernels=self.kernels, run_ahead=run_ahead,
        )  # fmt: skip

    def _prefill_chunk(self, row: _Row, n: int) -> list[RowEvent]:
        ids = row.request.ids
        chunk = ids[row.prefilled : row.prefilled + n]
        with row.drawing():
            first = row.verifier.prefill(chunk, len(chunk), row.proposer.drafter)
        row.prefilled += len(chunk)
        if row.prefilled < len(ids):
            return []
        # The prompt is in: the row's first token is out and its cache joins the rows.
        self.joining.remove(row)
        row.verifier.finish()
        row.verifier = None
        row.last = first
        tokens, finish = row.emit([first])
        event = RowEvent(row.id, tokens, finish=finish, prompt_tokens=len(ids) - row.reused, cached=row.reused)
        if finish is None:
            self.running.append(row)
        return [event]

    def _to_rows(self) -> None:
        # Rows that ran alone or just joined move into the rows cache, in running order (those already
        # there come first: a row runs alone only while no other runs, and joiners are appended).
        for row in self.running:
            if row.in_rows:
                continue
            if row.verifier is not None:
                row.verifier.finish()  # forgets a plain step queued ahead
                row.verifier = None
            for rows, c in zip(self.target, row.cache.target):
                rows.add(c)
                rows_model.release(c)  # held by the rows until the row runs alone or leaves
            row.in_rows = True

    def _alone(self, row: _Row) -> None:
        # The one running row leaves the rows cache for its own, and runs the single-stream verifier on it.
        if row.in_rows:
            for rows, c in zip(self.target, row.cache.target):
                rows.take(0, c)
            row.in_rows = False
        if row.verifier is None:
            row.verifier = self._verifier(row, run_ahead=True)

    def _leave(self, index: int) -> None:
        row = self.running.pop(index)
        if row.in_rows:
            for rows, c in zip(self.target, row.cache.target):
                rows.take(index, c)
        elif row.verifier is not None:
            row.verifier.finish()

    def _leave_cancelled(self) -> list[RowEvent]:
        events = []
        for queue in (self.waiting, self.joining):
            for row in [r for r in queue if r.cancelled]:
                queue.remove(row)
                if row.verifier is not None:
                    row.cache.drop_uncommitted()
                events.append(RowEvent(row.id, [], finish="cancelled"))
        for i in reversed(range(len(self.running))):
            if self.running[i].cancelled:
                events.append(RowEvent(self.running[i].id, [], finish="cancelled"))
                self._leave(i)
        return events

    def _solo_cycle(self, row: _Row) -> list[RowEvent]:
        # One row: the single-stream cycle on its own cache (the compiled CPU steps, a plain step queued
        # ahead), so one request runs as fast as dflash_generate_step runs it.
        self._alone(row)
        self.last_width = 0
        n = min(row.request.block_size, row.room) - 1
        p = row.proposer.propose(row.last, n) if n > 0 else Proposal(mx.zeros((0,), dtype=mx.uint32))
        # A tree's acceptance is judged along its depth, as a path's is along its drafts.
        num_draft = min(p.depth, max(n, 0))
        verdict = row.verifier.verify(row.last, p, plain_next=row.room > 1 and row.proposer.plain_next())
        emitted, finish = row.emit(verdict.tokens)
        row.cache.commit(row.last, emitted, verdict.cached)
        row.proposer.accept(len(emitted) - 1, verdict.taps)
        row.acceptance.judged(num_draft, min(verdict.num_accepted, num_draft))
        row.last = emitted[-1]
        event = RowEvent(row.id, emitted, num_draft, min(verdict.num_accepted, len(emitted) - 1), finish, p.source)
        if finish is not None:
            self._leave(0)
        return [event]

    def _cycle(self) -> list[RowEvent]:
        rows = self.running
        # A seeded row verifies its whole block (cut to its budget after), so its draws never depend on the load.
        wanted = [r.request.block_size - 1 if r.seeded else min(r.request.block_size, r.room) - 1 for r in rows]
        self._draft_together([row.proposer.drafter_pass(row.last, n) for row, n in zip(rows, wanted) if n > 0])
        proposals = [self._proposal(row, n) for row, n in zip(rows, wanted)]
        width = self.costs.width([r.acceptance for r in rows], [p.size for p in proposals])
        proposals = [p if row.seeded else p.first(width - 1) for row, p in zip(rows, proposals)]
        self.last_width = W = 1 + max(p.size for p in proposals)
        blocks = []
        for row, p in zip(rows, proposals):
            pad = mx.full((W - 1 - p.size,), row.last, dtype=mx.uint32)
            blocks.append(mx.concatenate([mx.array([row.last], dtype=mx.uint32), p.tokens.astype(mx.uint32), pad]))
        block = mx.stack(blocks)  # (B, W)
        trees = _tree_layout(proposals, W)
        starts = list(self.target[0].lengths) if trees is not None else None
        tic = perf_counter()
        logits, taps = rows_model.forward_rows(self.model, block, self.target, self.tap_ids, self.speedups, trees)
        verdicts = []
        for i, (row, p) in enumerate(zip(rows, proposals)):
            with row.drawing():
                verdicts.append(self._judge(row, p, block[i], logits[i]))
        mx.eval(block, verdicts)
        self.costs.timed(len(rows), W, perf_counter() - tic)
        host = block.tolist()
        events, trims, done = [], [], []
        for i, (row, p, (passed, target_tokens)) in enumerate(zip(rows, proposals, verdicts)):
            posterior, path = target_tokens.tolist(), None
            if p.tree is not None:
                # The target's own token at every node picks the child to follow, as a tree alone is walked.
                path, bonus = p.tree.walk(posterior)
                n, drafted, num_draft = len(path) - 1, p.tree.path_tokens(path), p.depth
            else:
                passed, n = passed.tolist(), 0
                while n < p.size and passed[n]:
                    n += 1
                drafted, bonus, num_draft = host[i][1 : n + 1], posterior[n], p.size
            emitted, finish = row.emit(drafted + [bonus])
            kept = len(emitted)
            row_taps = None if taps is None else taps[i : i + 1]
            if path is not None and path[:kept] != list(range(kept)):
                for c in self.target:
                    c.keep(i, starts[i], path[:kept])
                row_taps = None if row_taps is None else row_taps[:, mx.array(path[:kept])]
            trims.append(W - kept)
            row.cache.tokens.append(row.last)
            row.cache.tokens.extend(emitted[:-1])
            row.proposer.accept(kept - 1, row_taps)
            row.acceptance.judged(num_draft, min(n, num_draft))
            row.last = emitted[-1]
            events.append(RowEvent(row.id, emitted, num_draft, min(n, kept - 1), finish, p.source))
            if finish is not None:
                done.append(i)
        for c in self.target:
            c.trim_rows(trims)
        for i in reversed(done):
            self._leave(i)
        return events

    def _proposal(self, row: _Row, n: int) -> Proposal:
        # Row ``row``'s proposal of at most ``n`` drafts (or tree nodes) for a shared pass.
        if n <= 0:
            return Proposal(mx.zeros((0,), dtype=mx.uint32))
        with row.drawing():
            p = row.proposer.propose(row.last, n)
        if not self.trees or row.request.logits_processors:
            # A pass that cannot place a tree's nodes verifies its likeliest line; the proposer learns from the
            # tokens the target kept, whatever it proposed.
            p = p.line()
        return p.first(n)  # drafts past the budget are never verified

    def _draft_together(self, passes: list[DrafterPass | None]) -> None:
        # The rows' drafter passes of this cycle in one pass; each proposer then drafts from its row's logits.
        passes = [p for p in passes if p is not None]
        if len(passes) < 2:
            return
        first = passes[0].proposer
        logits = draft_rows.propose_rows(
            first.model, first.draft, [p.last for p in passes], [p.proposer.cache.draft for p in passes],
            [p.proposer.cache.take_pending() for p in passes], max(p.n for p in passes), first.speedups,
        )  # fmt: skip
        for i, p in enumerate(passes):
            p.proposer.given = logits[i]
        self.drafted_together += len(passes)

    def _judge(self, row: _Row, p: Proposal, block: mx.array, logits: mx.array) -> tuple[mx.array, mx.array]:
        # (passed (k,), the target's own token at each of the k + 1 positions) for one row's block.
        req, k = row.request, p.size
        logits = logits[: k + 1]
        if req.logits_processors:
            seen = mx.array(row.cache.tokens, dtype=mx.uint32)
            out = []
            for j in range(k + 1):
                r = logits[j : j + 1]
                tokens = mx.concatenate([seen, block[: j + 1]])
                for processor in req.logits_processors:
                    r = processor(tokens, r)
                out.append(r)
            logits = mx.concatenate(out, axis=0)
        drafts = block[1 : k + 1]
        sampler = req.sampler
        if is_greedy(sampler):
            target_tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
            return accept_one_hot(drafts, target_tokens), target_tokens
        fast_exp = self.speedups is not None and self.speedups.fast_exp
        if p.q is not None:
            return speculative_accept(drafts, p.q, partial(sampler.probs, fast_exp=fast_exp)(logits))
        if isinstance(sampler, Sampler):
            target_tokens = sample_rows(sampler.probs(logits, fast_exp=fast_exp))
        else:
            target_tokens = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        target_tokens = target_tokens.astype(mx.uint32)
        return accept_one_hot(drafts, target_tokens), target_tokens
