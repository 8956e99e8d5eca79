"""Timing the benchmark's methods: one runner per method, each run drained and clocked, and the
loop's passes (AR step, verify, draft) timed alone for the physical limit."""

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ...cpu.speedups import choose_speedups
from ...drafts.lookup import PromptLookup
from ...generation import stream_generate
from ...models import hybrid
from ...models import target as tgt
from ...models.caches import trim_to
from ...sampling import make_sampler
from ...text.responses import AcceptanceStats
from ...tuning.policy import PolicyState

METHODS = (
    "baseline", "mlx-spec", "lookup", "dflash", "dflash-cut", "dflash-fallback", "dflash-auto", "dflash-default",
    "dflash-tree",
)  # fmt: skip
# DFlash methods: the paper's fixed block, the block cut at the drafter's first unsure draft,
# the fixed block with prompt-lookup cycles after the drafter's first-draft misses,
# block_size="auto" (up to the largest block size: each cycle's width chosen from the passes' costs),
# generate's defaults (the adaptive policy, which pauses the drafter while it loses), and draft
# trees (DDTree: the drafter's most likely continuations, up to its block size deep, in one pass).
DFLASH_METHODS = ("dflash", "dflash-cut", "dflash-fallback", "dflash-auto", "dflash-default", "dflash-tree")
DEFAULT_MIN_CONFIDENCE = 0.5  # dflash-cut's cutoff
DEFAULT_LOOKUP_FALLBACK = 4  # dflash-fallback's most lookup cycles in a row
DEFAULT_TREE_BUDGET = 16  # dflash-tree's nodes a cycle


@dataclass
class RunResult:
    """One method on one prompt: medians over runs."""

    method: str
    block_size: int
    prompt: int
    category: str
    tokens: int
    generation_tps: float
    prompt_tps: float
    acceptance_lengths: list[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    verify_sizes: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # what proposed each cycle's drafts ("": not said)

    @property
    def acceptance(self) -> AcceptanceStats:
        """Its cycles counted as every tool counts them: those that verified more than one token
        drafted; the rest decoded plainly. Without sizes, each cycle verified ``block_size``."""
        stats, lengths = AcceptanceStats(), self.acceptance_lengths
        sources = self.sources or [""] * len(lengths)
        for length, size, source in zip(lengths, self.verify_sizes or [self.block_size] * len(lengths), sources):
            stats.add(size - 1, length, source)
        return stats


def time_stream(
    responses: Iterator, get_tokens: Callable, num_draft: int = 0
) -> tuple[list[int], float, float, list[int], list[int], list[str]]:
    """Drain a stream: (ids, seconds after the first token, seconds to the first token, acceptances,
    tokens verified per cycle, what drafted each cycle). mlx-lm's streams say only which tokens
    were drafted: their cycles verified ``num_draft`` drafts each (0: plain decoding)."""
    ids, accept, first, tic, drafted, sizes, sources = [], [], None, time.perf_counter(), 0, [], []
    for r in responses:
        if first is None:
            first = time.perf_counter()
        elif hasattr(r, "from_draft"):
            # mlx-lm marks drafted tokens; the target's own token closes each cycle.
            if r.from_draft:
                drafted += 1
            else:
                accept.append(drafted + 1)
                sizes.append(num_draft + 1)
                drafted = 0
        ids.extend(get_tokens(r))
        if getattr(r, "cycle", 0) > 0:
            accept.append(r.acceptance_length)
            sizes.append(r.num_draft + 1)
            sources.append(r.draft_source)
    end = time.perf_counter()
    if drafted:
        accept.append(drafted)
        sizes.append(num_draft + 1)
    return ids, end - (first or end), (first or end) - tic, accept, sizes, sources


def make_runner(
    method: str,
    model,
    draft,
    ar_draft,
    tokenizer,
    block_size: int,
    num_draft: int,
    max_tokens: int,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    lookup_fallback: int = DEFAULT_LOOKUP_FALLBACK,
    draft_window: int | None = None,
    draft_sinks: int = 4,
    kernels: str = "auto",
    datastore=None,
    tree_budget: int = DEFAULT_TREE_BUDGET,
    temp: float = 0.0,
    top_p: float = 0.0,
):
    """A function ``prompt ids -> (ids, gen seconds, prompt seconds, acceptances)`` for one method;
    the DFlash methods' drafter sees ``draft_window`` positions (None: all) and their loop runs
    the Metal kernels as ``kernels`` says (the target's own layers were chosen at load).
    ``datastore`` drafts in dflash-default's paused cycles, as generate's defaults do;
    dflash-tree's trees have up to ``tree_budget`` nodes. ``temp`` above 0 samples, with ``top_p``:
    mlx-lm's sampler for mlx-lm's methods, ours (the same distribution) for the others."""
    if method in ("baseline", "mlx-spec"):
        from mlx_lm.generate import stream_generate as mlx_lm_stream
        from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

        kwargs = {"draft_model": ar_draft, "num_draft_tokens": num_draft} if method == "mlx-spec" else {}
        if temp > 0:
            kwargs["sampler"] = mlx_lm_sampler(temp, top_p)
        # mlx-lm's last response carries the stop token; ours leave it out of the text and tokens.
        return lambda ids: time_stream(
            mlx_lm_stream(model, tokenizer, ids, max_tokens=max_tokens, **kwargs),
            lambda r: [] if r.finish_reason == "stop" else [r.token],
            num_draft=num_draft if method == "mlx-spec" else 0,
        )
    proposer = PromptLookup(block_size) if method == "lookup" else draft
    cutoff = min_confidence if method == "dflash-cut" else 0.0
    fallback = lookup_fallback if method == "dflash-fallback" else 0
    width = "auto" if method == "dflash-auto" else block_size
    # Each method as published, a draft every cycle; dflash-default as generate runs it, with one
    # policy for all of the method's runs, warm-up first, as a chat or a server keeps it.
    default = method == "dflash-default"
    policy = PolicyState() if default else None
    return lambda ids: time_stream(
        stream_generate(
            model,
            proposer,
            tokenizer,
            ids,
            max_tokens=max_tokens,
            block_size=width,
            min_confidence=cutoff,
            lookup_fallback=fallback,
            adaptive=default,
            policy=policy,
            datastore=datastore if default else None,
            tree_budget=tree_budget if method == "dflash-tree" else 0,
            draft_window=draft_window if method != "lookup" else None,
            draft_sinks=draft_sinks,
            kernels=kernels,
            sampler=make_sampler(temp, top_p) if temp > 0 else None,
        ),
        lambda r: r.tokens,
    )


def median_run(results: list[tuple]) -> tuple[list[int], float, float, list[int], list[int], list[str]]:
    """Several runs of one method on one prompt: the first run's tokens and counts, median times."""
    out, _, _, accept, sizes, *sources = results[0]  # a runner may not say what drafted
    sources = sources[0] if sources else []
    gen = statistics.median(r[1] for r in results)
    first = statistics.median(r[2] for r in results)
    return out, gen, first, accept, sizes, sources


def component_times(
    model, draft, block_sizes: list[int], context: int = 64, repeats: int = 10,
    draft_window: int | None = None, draft_sinks: int = 4,
) -> dict:  # fmt: skip
    """Seconds of one AR step, one verify pass of B tokens and one draft pass, at ``context``, and
    (``verify_by_size``) of a verify pass of every size up to the largest B: the fastest of
    ``repeats``, since other work on the machine only ever slows a pass down.

    On a hybrid target, also ``rollback[B][k]``: the rewind after a B-token verify pass that
    accepted ``k`` drafts, at ``k`` in :func:`rollback_points`. The loop rewinds an attention
    layer by lowering an offset, which costs nothing, so other targets have no ``rollback``.
    """
    from ...loop.cache import make_cache

    def timed(fn, setup=None) -> float:
        if setup:
            setup()
        fn()
        samples = []
        for _ in range(repeats):
            if setup:
                setup()
            tic = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - tic)
        return min(samples)

    cache = make_cache(model, draft, draft_window=draft_window, draft_sinks=draft_sinks)
    prompt = mx.array([[1] * context])
    taps_ids = draft.target_layer_ids if draft is not None else []
    # The passes as the loop runs them, with the same CPU speedups.
    speedups = choose_speedups(tgt.compute_dtype(model))
    _, taps = tgt.forward_with_taps(model, prompt, cache.target, taps_ids, speedups)
    mx.eval(taps, [c.state for c in cache.target])

    def target_pass(n):
        def run():
            out, t = tgt.forward_with_taps(model, mx.array([[1] * n]), cache.target, taps_ids, speedups)
            mx.eval(out, t)
            for c in cache.target:
                c.trim(n)

        return run

    times = {"context": context, "ar": timed(target_pass(1)), "verify": {}, "draft": {}}
    if draft is not None:
        for c in cache.draft:
            c.update_and_fetch(*[mx.zeros((1, draft.args.num_key_value_heads, context, draft.args.head_dim))] * 2)
    times["verify_by_size"] = {1: times["ar"]}
    for k in range(2, max(block_sizes) + 1):
        times["verify_by_size"][k] = timed(target_pass(k))
    for b in block_sizes:
        times["verify"][b] = times["verify_by_size"][b]
        if draft is not None:
            block = mx.array([[1] * draft.block_size])
            times["draft"][b] = timed(
                lambda block=block: mx.eval(draft.propose(model, block, None, cache.draft, speedups))
            )
    recurrent = [c for c in cache.target if isinstance(c, hybrid.RecurrentCache)]
    if recurrent:

        def rollback(b, k):
            def verify():
                # Back to `context` (through its checkpoint), then the pass the rewind undoes.
                trim_to(cache.target, context)
                out, t = tgt.forward_with_taps(model, mx.array([[1] * b]), cache.target, taps_ids, speedups)
                mx.eval(out, t, [c.state for c in cache.target])

            def rewind():
                # The loop's own rewind. It runs lazily inside the next pass there; evaluating the
                # recurrent states alone here (not the K/V caches' views) times just its work.
                cache.trim_target(b - 1 - k)
                mx.eval([c.state for c in recurrent])

            return rewind, verify

        times["rollback"] = {b: {k: timed(*rollback(b, k)) for k in rollback_points(b)} for b in block_sizes}
    return times


def rollback_points(block_size: int) -> list[int]:
    """The accepted-draft counts ``k`` whose rollback :func:`component_times` measures.

    After a verify pass (at most ``hybrid.RECORD_POSITIONS`` tokens) a rollback selects the
    state the pass kept for the ``k + 1`` kept tokens, about the same cost at every ``k``;
    after a longer pass it restores the state from before it and replays the kept tokens
    through each linear attention layer (``RecurrentCache.trim``), a cost that grows with
    ``k``. A cycle that keeps its whole block (``k = B - 1``) does neither. So: both ends (0
    and ``B - 2``), the middle, and the free case; ``bench_stats.mean_rollback``
    interpolates between them for every cycle a run made.
    """
    return sorted({0, block_size // 2, max(block_size - 2, 0), block_size - 1})


def fastest_times(a: dict, b: dict) -> dict:
    """Two component timings merged entry by entry, keeping the faster of each."""
    if not a or not b:
        return a or b
    out = {"context": a["context"], "ar": min(a["ar"], b["ar"])}
    for key in ("verify", "draft", "verify_by_size"):
        out[key] = {k: min(a[key][k], b[key][k]) for k in a.get(key, {})}
    if "rollback" in a:
        out["rollback"] = {
            n: {k: min(t, b["rollback"][n][k]) for k, t in by_k.items()} for n, by_k in a["rollback"].items()
        }
    return out
