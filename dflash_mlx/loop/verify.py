"""The target's side of a cycle: prefill, then verify a proposal in one pass and accept.

Every emitted token is a sample of the target under the caller's sampler (its argmax when
greedy): one-hot proposals keep the drafts that the target's own samples match, sampled
ones pass the speculative-sampling test (``dflash_mlx.sampling``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..cpu.speedups import CpuSpeedups
from ..kernels import greedy_accept
from ..models import target as tgt
from ..models.caches import fed_as_mlx_lm, keep_path
from ..models.families import family
from ..models.stages import own_split
from ..models.tree import DraftTree
from ..sampling import Sampler, accept_one_hot, sample_rows, speculative_accept
from .cache import DFlashCache
from .proposal import ContextTaker, Proposal

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Verdict:
    """The target's answer to one proposal.

    Args:
        num_accepted: How many leading drafts the target kept (0..n).
        tokens: The kept drafts and then the target's own token after them (the bonus).
        taps: ``(1, n + 1, n_taps * H)`` taps of the verified block ``[last, drafts...]``
          (of a tree: of the root and the accepted path), or None when no proposer needs them.
        cached: Positions the pass left in the target's cache (the block; of a tree, the root
          and the accepted path, the rest already dropped).
    """

    num_accepted: int
    tokens: list[int]
    taps: mx.array | None
    cached: int


class Verifier:
    """Runs the target for one generation: the prompt, then one pass per proposal.

    Args:
        model: The target.
        cache: The pair's cache; its target part grows by every pass, the loop rewinds it.
        sampler: ``logprobs -> ids``, or None for greedy. A :class:`Sampler`'s draws come
          from its ``probs`` (which sampled proposals need).
        logits_processors: mlx-lm logits processors, applied at every verified position
          with that position's preceding tokens.
        tap_ids: Target layers whose taps the proposer needs.
        speedups: The CPU speedups, or None.
        kernels: The Metal kernels' mode, ``"auto"``, ``"on"`` or ``"off"``
          (:mod:`dflash_mlx.kernels.dispatch`).
        run_ahead: Queue the next plain step before the host reads this one, where it can be
          taken back (never on a sharded target: every rank must run the same passes).
    """

    def __init__(
        self,
        model: nn.Module,
        cache: DFlashCache,
        *,
        sampler,
        logits_processors: list[LogitsProcessor] | None,
        tap_ids: list[int],
        speedups: CpuSpeedups | None,
        kernels: str = "auto",
        run_ahead: bool = True,
    ):
        self.model, self.cache, self.tap_ids, self.speedups = model, cache, tap_ids, speedups
        self.kernels = kernels
        self.run_ahead = run_ahead and not family(model).recurrent
        self._ahead: tuple[mx.array, mx.array | None] | None = None  # a queued plain step
        self.greedy, self.sampler = sampler is None, sampler
        fast_exp = speedups is not None and speedups.fast_exp
        self.probs = partial(sampler.probs, fast_exp=fast_exp) if isinstance(sampler, Sampler) else None
        self.logits_processors = logits_processors or []

    @cached_property
    def rotating(self) -> bool:
        """Whether the target's cache is mlx-lm's rotating window (:func:`~dflash_mlx.models.caches.fed_as_mlx_lm`)."""
        return fed_as_mlx_lm(self.cache.target)

    @property
    def can_run_ahead(self) -> bool:
        """A step may run ahead of the host only where one step can be taken back exactly (a stop token read
        late): not a rotating window, not a recurrent state, not on a sharded target."""
        return self.run_ahead and not self.rotating

    def _logits(self, logits: mx.array, block: mx.array | None = None, seen: list[int] | None = None) -> mx.array:
        # Row i of a verified block sees the cached tokens (or ``seen``) plus block[: i + 1].
        if not self.logits_processors:
            return logits
        seen = mx.array(self.cache.tokens if seen is None else seen, dtype=mx.uint32)
        rows = []
        for i in range(logits.shape[0]):
            tokens = seen if block is None else mx.concatenate([seen, block[0, : i + 1]])
            row = logits[i : i + 1]
            for processor in self.logits_processors:
                row = processor(tokens, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def _sample(self, logits: mx.array) -> mx.array:
        # The target's own draw at each row. Greedy takes the argmax of the logits: normalising
        # 16 rows would cost a verify pass about a millisecond on MLX's CPU backend, whose exp
        # is slow. A Sampler draws from its distribution, computed once from the logits.
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        if self.probs is not None:
            return sample_rows(self.probs(logits))
        return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def prefill(
        self,
        tokens: list[int],
        step_size: int,
        drafter: ContextTaker | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Feed ``tokens`` in chunks of ``step_size``; returns the target's next token.
        ``progress(done, total)`` is called after each chunk.

        Each chunk's taps go to ``drafter`` (:meth:`~dflash_mlx.loop.proposal.ContextTaker.take_context`)
        as the chunk is done, projected by its ``fold`` as each tapped layer is done.
        A cache that cannot be trimmed (mlx-lm's rotating window, plain decoding only) is fed as
        ``mlx_lm generate`` feeds it, all but the last token in chunks and then the last alone:
        there the chunks change what the window keeps, and so the output.
        """
        n, rotating = len(tokens), self.rotating
        fold = drafter.fold if drafter is not None and not rotating else None
        starts = list(range(0, n - 1, step_size)) + [n - 1] if rotating and n > 1 else list(range(0, n, step_size))
        for i, end in zip(starts, starts[1:] + [n]):
            chunk = tokens[i:end]
            # Only the last chunk's last position needs the head; the others' logits are never computed.
            logits, taps = self._forward(mx.array(chunk)[None], last_logits=True, fold=fold)
            drafter_state = drafter.take_context(taps, n - i) if drafter is not None else []
            del taps  # handed over: not held while the next chunk makes its own
            self.cache.tokens.extend(chunk)
            mx.eval(logits if end == n else [], [c.state for c in self.cache.target], drafter_state)
            if end < n:
                mx.clear_cache()  # as mlx-lm's prefill: a long prompt's chunk buffers are not kept
            if progress is not None:
                progress(end, n)
        return self._sample(self._logits(logits[0, -1:])).item()

    def _forward(
        self, tokens: mx.array, last_logits: bool = False, fold: dict[int, mx.array] | None = None
    ) -> tuple[mx.array, mx.array | None]:
        if self.rotating:
            # A rotating window (plain decoding only, so no taps): mlx-lm's own pass, as
            # mlx_lm generate runs it, since the window's state depends on how it is fed.
            if own_split(tgt.decoder(self.model)):
                raise DFlashError(
                    "A rotating window cache (--max-kv-size) is fed by mlx-lm's own pass, which cannot run a "
                    "target split as a pipeline by DFlash (not mlx-lm): leave --max-kv-size out."
                )
            return self.model(tokens, cache=self.cache.target), None
        return tgt.forward_with_taps(
            self.model, tokens, self.cache.target, self.tap_ids, self.speedups, last_logits, fold
        )

    def _queue(self, token: mx.array, seen: Callable[[], list[int]]) -> None:
        # One plain step after ``token`` (1,), itself possibly unevaluated, started now and read
        # later: (the next token (1,), the taps of ``token``'s position or None). ``seen()`` gives
        # the tokens before ``token`` (called only with logits processors).
        block = token.astype(mx.uint32).reshape(1, 1)
        logits, taps = self._forward(block)
        logits = self._logits(logits[0], block, seen() if self.logits_processors else None)
        next_token = self._sample(logits).astype(mx.uint32)
        mx.async_eval(next_token)
        self._ahead = (next_token, taps)

    def _plain(self, last: int, queue_next: bool) -> Verdict:
        if self._ahead is None:
            self._queue(mx.array([last]), lambda: self.cache.tokens)
        (token, taps), self._ahead = self._ahead, None
        if queue_next:
            self._queue(token, lambda: self.cache.tokens + [last])
        return Verdict(0, [token.item()], taps, 1)

    def _take_back(self) -> None:
        # A step queued for a plain cycle that did not come (the cycle drafts after all).
        if self._ahead is not None:
            self.cache.trim_target(1)
            self._ahead = None

    def finish(self) -> None:
        """The generation is over: the target forgets what it holds past the committed tokens (a
        step queued ahead, a cycle cut short)."""
        self._ahead = None
        self.cache.drop_uncommitted()

    def verify(self, last: int, proposal: Proposal, plain_next: bool = False) -> Verdict:
        """One target pass over ``[last, drafts...]``, then the acceptance test.

        A proposal of no drafts is a plain step. Where a step can be taken back exactly, it is
        pipelined as mlx-lm's ``generate_step`` pipelines plain decoding: with ``plain_next`` (the
        next cycle is known to be plain too) the step after it is queued before the host reads
        this one; a queued step that is not used is taken back.
        """
        if proposal.size == 0 and self.can_run_ahead:
            return self._plain(last, plain_next)
        self._take_back()
        if proposal.tree is not None:
            return self._verify_tree(last, proposal)
        block = mx.concatenate([mx.array([last], dtype=mx.uint32), proposal.tokens])[None]
        logits, taps = self._forward(block)
        logits = self._logits(logits[0], block)
        if proposal.q is None and self.greedy:
            # On an Apple GPU one kernel, where it checked itself here; elsewhere its MLX-ops twin.
            accepted = greedy_accept(logits, proposal.tokens, mode=self.kernels)  # (2,): num_accepted, bonus
            mx.eval(block, accepted)
            n, bonus = accepted.tolist()
            return Verdict(n, block.tolist()[0][1 : n + 1] + [bonus], taps, block.shape[1])
        if proposal.q is None:
            target_tokens = self._sample(logits)  # (n + 1,)
            passed = accept_one_hot(block[0, 1:], target_tokens)
        else:
            passed, target_tokens = speculative_accept(block[0, 1:], proposal.q, self.probs(logits))
        # The one host synchronisation of the cycle.
        mx.eval(block, passed, target_tokens)
        drafted, passed, posterior = block.tolist()[0][1:], passed.tolist(), target_tokens.tolist()
        n = 0
        while n < len(drafted) and passed[n]:
            n += 1
        return Verdict(n, drafted[:n] + [posterior[n]], taps, block.shape[1])

    def _verify_tree(self, last: int, proposal: Proposal) -> Verdict:
        # DDTree: one pass over the root and every node, the target's own token at each, then the
        # walk down the children that match them. Sampled, each node's draw is the target's sample
        # given its path, so following the matching child emits target samples only.
        tree, start = proposal.tree, self.cache.offset
        block = mx.concatenate([mx.array([last], dtype=mx.uint32), proposal.tokens])[None]
        logits, taps = tgt.forward_with_taps(self.model, block, self.cache.target, self.tap_ids, tree=tree)
        logits = self._tree_logits(logits[0], tree, last)
        target_tokens = self._sample(logits)  # (n + 1,)
        path, bonus = tree.walk(target_tokens.tolist())
        keep_path(self.cache.target, start, path)
        if taps is not None:
            taps = taps[:, mx.array(path)]
        return Verdict(len(path) - 1, tree.path_tokens(path) + [bonus], taps, len(path))

    def _tree_logits(self, logits: mx.array, tree: DraftTree, last: int) -> mx.array:
        # Row i sees the cached tokens, the root and the tokens on the path to node i.
        if not self.logits_processors:
            return logits
        rows = []
        for i in range(tree.size + 1):
            path = []
            while i > 0:
                path.append(tree.tokens[i - 1])
                i = tree.parents[i]
            rows.append(self.cache.tokens + [last] + path[::-1])
        return mx.concatenate([self._logits(logits[i : i + 1], None, seen) for i, seen in enumerate(rows)], axis=0)
