"""The adaptive policy: draft while drafting gives tokens faster than decoding without the
drafter, pause the drafter while it does not, judged on measured time. While paused, a cycle
verifies what prompt lookup finds (a draft that costs nothing to propose) or is a plain step.

:class:`PolicyState` holds what the policy has measured and where it is in its schedule; the
:class:`~dflash_mlx.drafts.proposer.AdaptiveProposer` of one generation times each cycle and asks it
whether the next one drafts. The state outlives a call: a ``DFlashCache`` carries one, and
``policy=`` passes one to every call for a pair (a chat's replies, a server's requests), so a
new reply starts where the last one left off instead of drafting again to find out.
:class:`PolicyStore` keeps it on disk between processes (dflash-generate's one-shot runs).
Plain Python only.
"""

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import DFlashError
from ..base.store import JsonStore

# Saved timings older than this (seconds) are not trusted: the machine's load has changed since.
SAVED_MAX_AGE = 6 * 3600.0


@dataclass
class FreeStats:
    """What free drafts taught so far: their chances and their cost, in plain steps.

    Kept by the pair's policy state, so a chat's next reply starts from what the last one learned.

    Args:
        first: A verify cycle's cost beyond a plain step's for its first draft, in plain steps.
        each: Each further draft's.
        prior: Pseudo-counts behind the starting chances and costs.
    """

    first: float = 0.15
    each: float = 0.06
    prior: float = 4.0
    # A tree pass's cost beyond a path pass of as many drafts, in plain steps: its nodes run as a batch of
    # one-token rows under an ancestor mask, not through a path's compiled steps (the default pair, MKL:
    # 3 to 16 nodes about 0.3-0.6 of a step more than a path of the same length).
    tree_extra: float = 0.4
    step: float | None = None  # seconds of a plain cycle, a running mean (None: not timed yet)
    # Drafting cycles' costs beyond a plain step against their number of drafts, recent cycles weighing most:
    # sums of 1, x, y, x * x and x * y with x = drafts - 1 and y = the cost in plain steps.
    fit: list = field(default_factory=lambda: [0.0] * 5, repr=False)
    # Drafts -> (weight, summed cost in plain steps) of each size's own cycles, recent ones weighing most:
    # a BLAS's cost by size has steps the line misses (MKL on the default pair, cycles timed in the loop:
    # 1 to 4 drafts cost about 0.1, 0.2, 0.45 and 0.45 of a step more than a plain one).
    sizes: dict = field(default_factory=dict, repr=False)
    start: tuple = field(default=(), init=False, repr=False)  # (first, each) as given: the fit's prior
    # Nodes -> (weight, summed cost in plain steps) of each size's tree cycles, as ``sizes`` for paths.
    tree_sizes: dict = field(default_factory=dict, repr=False)
    # (kind, position) -> [right, judged]: how often a draft there was right, given the ones before.
    hits: dict = field(default_factory=lambda: defaultdict(lambda: [1.0, 2.0]))
    # kind -> [right, expected]: the datastore's drafts right against the sum of their shares.
    trust: dict = field(default_factory=lambda: defaultdict(lambda: [4.0, 4.0]))

    def __post_init__(self):
        self.start = (self.first, self.each)

    def chances(self, kind: str, count: int, shares: list[float] | None = None) -> list[float]:
        """Each draft's chance of being right given the ones before it."""
        if shares is not None:
            right, expected = self.trust[kind]
            return [min(1.0, s * right / expected) for s in shares[:count]]
        return [self.hits[(kind, i)][0] / self.hits[(kind, i)][1] for i in range(count)]

    def cost(self, k: int) -> float:
        """A cycle of ``k`` drafts, in plain steps: what cycles of that size cost, held to the cost line
        with the weight of ``prior`` / 2 cycles."""
        if k == 0:
            return 1.0
        weight, total = self.sizes.get(k, (0.0, 0.0))
        line = self.first + self.each * (k - 1)
        return 1.0 + (total + self.prior / 2 * line) / (weight + self.prior / 2)

    def tree_cost(self, n: int) -> float:
        """A tree cycle of ``n`` nodes, in plain steps: what tree cycles of that size cost, held to a path's
        cost of as many drafts plus ``tree_extra`` with the weight of ``prior`` / 2 cycles."""
        weight, total = self.tree_sizes.get(n, (0.0, 0.0))
        line = self.cost(n) - 1.0 + self.tree_extra
        return 1.0 + (total + self.prior / 2 * line) / (weight + self.prior / 2)

    def best(self, chances: list[float]) -> tuple[int, float]:
        """The number of drafts to verify (0: none) and its tokens per plain step."""
        best_k, best_rate, alive, expected = 0, 1.0, 1.0, 1.0
        for k, c in enumerate(chances, 1):
            alive *= c
            expected += alive
            rate = expected / self.cost(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def judged(self, kind: str, accepted: int, chances: list[float], shares: list[float] | None) -> None:
        """The target kept ``accepted`` of a cycle's drafts, which had these chances."""
        judged = min(accepted + 1, len(chances))
        if shares is not None:
            trust = self.trust[kind]
            trust[0] += accepted
            trust[1] += sum(shares[:judged])
            return
        for i in range(judged):
            hit = self.hits[(kind, i)]
            hit[1] += 1
            hit[0] += i < accepted

    def timed_tree(self, seconds: float, nodes: int) -> None:
        """A tree cycle of ``nodes`` nodes took ``seconds``: a cost of its size (paths' costs are not touched)."""
        if self.step is None:
            return
        weight, total = self.tree_sizes.get(nodes, (0.0, 0.0))
        self.tree_sizes[nodes] = (0.98 * weight + 1.0, 0.98 * total + seconds / self.step - 1.0)

    def timed(self, seconds: float, drafts: int) -> None:
        """A cycle of ``drafts`` drafts took ``seconds``: the plain step's time, or a cost of its size
        and a point of the drafting cycles' cost line, ``first + each * (drafts - 1)`` beyond a plain
        step, fitted by least squares to the last ~50 cycles and held to the starting costs with the
        weight of ``prior`` / 2 cycles (what a further draft adds differs several-fold between machines)."""
        if drafts == 0:
            self.step = seconds if self.step is None else 0.9 * self.step + 0.1 * seconds
            return
        if self.step is None:
            return
        x, y = drafts - 1.0, seconds / self.step - 1.0
        weight, total = self.sizes.get(drafts, (0.0, 0.0))
        self.sizes[drafts] = (0.98 * weight + 1.0, 0.98 * total + y)
        self.fit = [0.98 * s + v for s, v in zip(self.fit, (1.0, x, y, x * x, x * y))]
        n, sx, sy, sxx, sxy = self.fit
        (first, each), weight = self.start, self.prior / 2
        # The normal equations with a ridge towards the starting costs (the slope's in units of a
        # cycle of four drafts, so both hold alike when the cycles' sizes do not vary).
        a, b, d = n + weight, sx, sxx + 9 * weight
        u, v = sy + weight * first, sxy + 9 * weight * each
        det = a * d - b * b
        self.each = min(max((a * v - b * u) / det, 0.0), 1.0)
        self.first = min(max((u - b * self.each) / a, 0.0), 4.0)


@dataclass
class PolicyState:
    """Measured seconds per token of paused and drafting cycles, and the schedule they set.

    A paused cycle runs no drafter pass: it verifies up to ``lookup`` prompt-lookup drafts, or
    is a plain decoding step when lookup finds nothing (always with ``lookup`` 0). The policy
    compares seconds per token, so drafting must beat what the paused cycles give, lookup's
    accepted drafts included. ("Plain" below means paused.) It runs ``probe`` plain cycles
    early on and one every ``refresh`` drafting cycles to know the plain cost. When a window of
    ``window`` drafting cycles (or three at a third of plain decoding's speed or less; after a
    loss, at half) gives tokens more slowly, it decodes plainly
    for a run of cycles, then drafts again: a re-probe. Each further losing window doubles the
    run, up to ``max_run``, and a winning one resets it to one ``window``. A run is never
    shorter than what keeps the losing window's extra time (beyond what plain decoding would
    have taken for its tokens) within ``probe_cost`` of the run's own time, so re-probing
    costs at most that fraction of plain decoding however slow drafting is.

    Args:
        window: Drafting cycles per judged window.
        probe: Plain cycles run first, to time a plain step.
        refresh: Drafting cycles between two plain ones that keep that time current.
        max_run: The longest run of plain cycles that doubling reaches.
        probe_cost: The most a losing window may cost, as a fraction of the plain run after it.
        lookup: Prompt-lookup drafts verified in a paused cycle (0: plain steps). On a small
          CPU target a verify of two tokens costs about one step, so the default 1 draft
          makes paused cycles faster than plain decoding wherever the text repeats itself.
        clock: Seconds; ``time.perf_counter`` by default (tests inject their own).
    """

    window: int = 8
    probe: int = 2
    refresh: int = 64
    max_run: int = 256
    probe_cost: float = 0.03
    lookup: int = 1
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)
    # What it measured.
    # Running means of a paused cycle's seconds and tokens (None before the first one).
    plain_sums: tuple[float, float] | None = field(default=None, init=False)
    draft_time: float | None = field(default=None, init=False)  # seconds a token, last judged window
    # Where it is.
    plain_left: int = field(default=0, init=False)  # plain cycles to run before drafting again
    run: int = field(default=0, init=False)  # the plain run after the next loss
    since_plain: int = field(default=0, init=False)  # drafting cycles since the last plain one
    warm: bool = field(default=False, init=False)  # the first cycle (graphs compiled) is not timed
    cold_drafter: bool = field(default=False, init=False)  # restored: the next drafting cycle is not timed
    cold_extra: float = field(default=0.0, init=False)  # what that cycle cost beyond a plain step's tokens
    # Why the drafter is paused (None: it is not), and the plain cycles it was paused for in this
    # process, so the stats can say so plainly.
    paused_why: str | None = field(default=None, init=False)
    paused_cycles: int = field(default=0, init=False)
    window_seconds: float = field(default=0.0, init=False)
    window_tokens: int = field(default=0, init=False)
    window_cycles: int = field(default=0, init=False)
    # What draft-free cycles learned (dflash_mlx.drafts.free), kept with the rest for the next call.
    free: FreeStats = field(default_factory=FreeStats, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("window", "refresh", "max_run"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DFlashError(f"PolicyState {name} must be a positive number of cycles (got {value!r}).")
        if not isinstance(self.lookup, int) or isinstance(self.lookup, bool) or self.lookup < 0:
            raise DFlashError(f"PolicyState lookup must be a number of drafts, 0 or more (got {self.lookup!r}).")
        if not isinstance(self.probe, int) or self.probe < 0:
            raise DFlashError(f"PolicyState probe must be a number of cycles, 0 or more (got {self.probe!r}).")
        if not isinstance(self.probe_cost, (int, float)) or self.probe_cost <= 0:
            raise DFlashError(f"PolicyState probe_cost must be a fraction above 0 (got {self.probe_cost!r}).")
        self.plain_left, self.run = self.probe, self.window

    @property
    def plain_time(self) -> float | None:
        """Seconds a paused token: the ratio of the running means (a lookup hit's two tokens
        weigh twice a miss's one, as they do in the time the cycles take)."""
        return self.plain_sums[0] / self.plain_sums[1] if self.plain_sums else None

    @plain_time.setter
    def plain_time(self, seconds: float) -> None:  # a measurement restored as one token's time
        self.plain_sums = (seconds, 1.0)

    @property
    def plain_tps(self) -> float | None:
        """Paused cycles' measured tokens per second (None before the first plain cycle)."""
        return 1.0 / self.plain_time if self.plain_time else None

    @property
    def draft_tps(self) -> float | None:
        """Drafting cycles' tokens per second over the last judged window (None before one)."""
        return 1.0 / self.draft_time if self.draft_time else None

    def drafts_next(self) -> bool:
        """Whether the next cycle drafts (the first one always does: it warms the drafter up)."""
        return not self.warm or (self.plain_left == 0 and self.since_plain < self.refresh)

    # What a later process starts from (the rest, a window under way, starts afresh).
    _SAVED = ("plain_time", "draft_time", "plain_left", "run", "since_plain")

    def saved(self) -> dict:
        """What it measured and where its schedule stands, as plain JSON values."""
        return {name: getattr(self, name) for name in self._SAVED}

    @classmethod
    def restored(cls, saved: dict, **settings) -> "PolicyState":
        """A state that goes on from :meth:`saved`'s values (unusable ones are left fresh).

        Saved timings are re-checked rather than trusted: a pause carried over is cut to one
        ``window`` of plain cycles, after which the drafter is timed again in this process, so a
        run timed on a busy machine pauses the drafter of a later one for a few cycles at most.
        The first drafting cycle is not timed, since a new process compiles the drafter's graphs.
        """
        state = cls(**settings)
        for name in cls._SAVED:
            value = saved.get(name)
            if name.endswith("_time"):
                if isinstance(value, (int, float)) and value > 0:
                    setattr(state, name, float(value))
            elif isinstance(value, int) and 0 <= value <= (10**6 if name == "plain_left" else state.max_run):
                setattr(state, name, value)  # a plain run may outgrow max_run (see _drafting_cycle)
        # Re-probe soon: this process times the drafter itself after at most one window.
        state.plain_left = min(state.plain_left, state.window)
        if state.plain_left and state.draft_time and state.plain_time and state.draft_time > state.plain_time:
            state.paused_why = (
                f"an earlier run measured drafting at {state.draft_tps:.1f} tokens-per-sec against "
                f"{state.plain_tps:.1f} for plain decoding; drafting is timed again after {state.plain_left} cycles"
            )
        # Measured before: no warm-up cycle that drafts whatever the schedule says.
        state.warm = state.cold_drafter = state.plain_time is not None
        return state

    def plain_follows(self) -> bool:
        """During a plain cycle: whether the next one is plain too, once this one is recorded."""
        return self.warm and self.plain_left > 1

    def record(self, seconds: float, tokens: int, drafted: bool) -> None:
        """A cycle took ``seconds`` and gave ``tokens``; ``drafted``: it verified drafts."""
        if not self.warm:
            self.warm = True
        elif drafted:
            self._drafting_cycle(seconds, tokens)
        else:
            self._plain_cycle(seconds, tokens)

    def _plain_cycle(self, seconds: float, tokens: int) -> None:
        if self.plain_sums is None:
            self.plain_sums = (seconds, float(tokens))
        else:
            before = self.plain_sums
            self.plain_sums = (0.75 * before[0] + 0.25 * seconds, 0.75 * before[1] + 0.25 * tokens)
        if self.paused_why is not None and self.plain_left > 0:
            self.paused_cycles += 1
        self.plain_left = max(self.plain_left - 1, 0)
        if self.plain_left == 0:
            self.paused_why = None
        self.since_plain = 0
        # A new window; its first cycle takes in the plain cycles' taps, a cost of resuming.
        self.window_seconds, self.window_tokens, self.window_cycles = 0.0, 0, 0

    def _drafting_cycle(self, seconds: float, tokens: int) -> None:
        self.since_plain += 1
        if self.cold_drafter:
            # Not judged (it compiles the drafter's graphs), but paid: a losing probe counts its
            # cost, so runs between probes grow long enough to cover a new process's start too.
            self.cold_drafter = False
            self.cold_extra = max(seconds - tokens * (self.plain_time or 0.0), 0.0)
            return
        self.window_cycles += 1
        self.window_seconds += seconds
        self.window_tokens += tokens
        per_token = self.window_seconds / self.window_tokens
        # Judge a full window; three cycles already twice as slow as the paused cycles settle
        # it too, so a probe of a drafter that loses badly (sampling at block 16) need not cost
        # a whole window. Before the first loss, three times as slow: a few hard cycles in a row
        # are common where drafting wins overall, but not that hard (the first window falls in
        # a chat's first reply, where 8 losing cycles cost the default pair a third of it).
        lost_before = self.run > self.window
        factor = 2 if lost_before else 3
        # (Nothing is settled before a plain cycle was timed: a state that only ever drafted has nothing to beat.)
        clear_loss = self.plain_time is not None and self.window_cycles >= 3 and per_token > factor * self.plain_time
        if self.window_cycles < self.window and not clear_loss:
            return
        extra = self.window_seconds - self.window_tokens * (self.plain_time or 0.0) + self.cold_extra
        self.cold_extra = 0.0
        self.draft_time = per_token
        self.window_seconds, self.window_tokens, self.window_cycles = 0.0, 0, 0
        if self.plain_time is None:
            return
        if self.draft_time > self.plain_time:
            # Long enough that this window's extra time is at most probe_cost of the run's.
            bound = math.ceil(extra / (self.probe_cost * self.plain_time)) if self.plain_time > 0 else 0
            self.plain_left, self.run = max(self.run, bound), min(2 * self.run, self.max_run)
            self.paused_why = (
                f"drafting measured {self.draft_tps:.1f} tokens-per-sec in this run against {self.plain_tps:.1f} "
                f"for plain decoding; drafting is timed again after {self.plain_left} cycles"
            )
        else:
            self.run = self.window


class PolicyStore(JsonStore):
    """Policy states on disk, one JSON object keyed by machine, pair and drafting setup, so that
    a new process starts where the last one left off instead of drafting again to find out.

    Args:
        path: The JSON file (None: ``policy.json`` in dflash-mlx's cache folder).
    """

    def __init__(self, path: str | Path | None = None):
        super().__init__("policy.json", path)

    def get(self, key: str, *, now: float | None = None, **settings) -> PolicyState:
        """The saved state for ``key``, or a fresh one, with ``settings`` (PolicyState's). A state
        saved over ``SAVED_MAX_AGE`` ago (``now``: seconds since the epoch, the clock's by default),
        or with no time, is not trusted: the machine's load has changed since."""
        saved = self.read().get(key)
        now = time.time() if now is None else now
        at = saved.get("saved_at") if isinstance(saved, dict) else None
        if not isinstance(at, (int, float)) or not 0 <= now - at <= SAVED_MAX_AGE:
            return PolicyState(**settings)
        return PolicyState.restored(saved, **settings)

    def put(self, key: str, state: PolicyState) -> None:
        self.write(key, {**state.saved(), "saved_at": time.time()})


def policy_key(model, draft, setup: dict) -> str:
    """What the adaptive policy's verdict depends on, as :class:`PolicyStore`'s key: the machine,
    the target's shape and dtype, the drafter's weights (a checksum) and the drafting ``setup``."""
    # The one function here that reads arrays: imported when a key is made, so the rest stays plain Python.
    import mlx.core as mx

    from .widths import machine_key, model_key

    weights = mx.sum((draft.fc if "fc" in draft else draft.norm).weight.astype(mx.float32)).item()
    drafter = json.dumps([vars(draft.args), round(weights, 6)], sort_keys=True, default=str)
    ident = json.dumps([machine_key(), model_key(model), drafter, setup], sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:24]
