"""``block_size="auto"``: each cycle, verify the number of drafts that gives the most tokens per second
(and ``tree_budget="auto"``: the number of draft tree nodes).

A cycle that verifies ``n`` drafts costs one draft pass plus a target pass of ``n + 1`` tokens,
and yields ``1 + sum_k P(the first k drafts are all accepted)`` tokens. The pass costs are
measured once per (machine, target shape and dtype, context bucket, widths), on the live
cache where the loop runs (a few timed target passes, each trimmed off again), and kept on
disk. The acceptance chances come from the drafter's own confidences, scaled by how often
its confident drafts were really accepted so far in this generation. Verifying any prefix
of the drafts is exact, so the output never depends on the choice.

A draft tree's nodes come best first, so its first ``n`` nodes are the tree of budget ``n``; such
a cycle yields ``1 + sum over its nodes of P(the node's path is accepted)`` tokens, each chance
the drafter's probability of the path, scaled the same way, and its verify pass is a tree pass of
``n + 1`` rows, timed as such (:func:`dflash_mlx.models.tree.chain`).
"""

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..base.errors import DFlashError
from ..base.store import JsonStore
from ..models import target as tgt
from ..models.families import family
from ..models.tree import chain

MIN_BUCKET = 256  # contexts up to this many tokens share one measurement


def bucket(context: int) -> int:
    """The context bucket of a position: the next power of two, at least ``MIN_BUCKET``."""
    return max(MIN_BUCKET, 1 << max(0, context - 1).bit_length())


def timed_widths(block_size: int) -> list[int]:
    """The verify widths timed (the others are interpolated): dense where a width's cost bends."""
    return sorted({w for w in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if w <= block_size} | {block_size})


@dataclass
class PassCosts:
    """Seconds of a draft pass and of verify passes of the ``verify`` widths."""

    draft: float
    verify: dict[int, float]

    def verify_at(self, width: int) -> float:
        """A verify pass of ``width`` tokens, linear between the measured widths."""
        if width in self.verify:
            return self.verify[width]
        widths = sorted(self.verify)
        lo = max((w for w in widths if w < width), default=widths[0])
        hi = min((w for w in widths if w > width), default=widths[-1])
        if lo == hi:
            return self.verify[lo]
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (width - lo) / (hi - lo)


def machine_key() -> str:
    """What a timing depends on besides the model: CPU or GPU, and the BLAS in use."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        blas = "openblas" if "libopenblas" in Path("/proc/self/maps").read_text() else "bundled"
    except OSError:
        blas = "system"
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "")
    core = os.environ.get("OPENBLAS_CORETYPE", "")
    return f"{cpu}|{os.cpu_count()} cores|{mx.default_device()}|{blas}{threads}{core}"


def model_key(model: nn.Module) -> str:
    """The target's shape, dtype and quantization: what its passes cost depends on, not its weights."""
    args = {k: v for k, v in sorted(vars(tgt.text_args(model)).items()) if isinstance(v, (int, float, str, bool, list))}
    quantized = any(hasattr(m, "scales") for _, m in model.named_modules())
    text = json.dumps([model.model_type, args, str(tgt.compute_dtype(model)), quantized], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CostStore(JsonStore):
    """Measured pass costs on disk: one JSON object keyed by machine, model, bucket and widths."""

    def __init__(self, path: str | Path | None = None):
        super().__init__("pass-costs.json", path)

    def get(self, key: str) -> PassCosts | None:
        entry = self.read().get(key)
        if not entry:
            return None
        return PassCosts(entry["draft"], {int(k): v for k, v in entry["verify"].items()})

    def put(self, key: str, costs: PassCosts) -> None:
        self.write(key, {"draft": costs.draft, "verify": {str(k): v for k, v in costs.verify.items()}})


def measure(
    model, draft, cache, tap_ids: list[int], widths: list[int], speedups, repeats: int = 2, tree: bool = False
) -> PassCosts:
    """Time a draft pass and a target pass of each width where the loop is (the fastest of
    ``repeats``); each pass is trimmed off again, so the caches end as they began. With ``tree``,
    each target pass is a draft tree's of ``width`` rows."""

    def fastest(fn) -> float:
        fn()  # compiled and warm
        best = math.inf
        for _ in range(repeats):
            tic = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - tic)
        return best

    def target_pass(width: int):
        shape = chain(width - 1) if tree else None

        def run():
            logits, taps = tgt.forward_with_taps(model, mx.ones((1, width), dtype=mx.uint32), cache.target,
                                                 tap_ids, speedups, tree=shape)  # fmt: skip
            mx.eval(logits, taps)
            cache.trim_target(width)

        return run

    verify = {w: fastest(target_pass(w)) for w in widths}
    block = mx.array([[0] * draft.block_size], dtype=mx.uint32)
    # No new taps: the pass reads the drafter's cache and leaves it as it is.
    drafted = fastest(lambda: mx.eval(draft.propose(model, block, None, cache.draft, speedups)))
    return PassCosts(drafted, verify)


class VerifyWidth:
    """Chooses each cycle's number of drafts, and learns how far to trust the drafter.

    Args:
        model: The target.
        draft: The drafter.
        cache: The pair's cache (costs are measured on it when a context bucket is new).
        speedups: The CPU speedups the loop runs with.
        store: Where measured costs are kept (None: ``~/.cache/dflash-mlx/pass-costs.json``).
        prior: Pseudo-counts of the calibration ratio's prior of 1 (trust the confidences).
        tree_nodes: Choose a draft tree's number of nodes, up to this many, instead (0: drafts).
    """

    tree = False  # choosing a draft tree's nodes, not a number of drafts

    def __init__(
        self, model, draft, cache, speedups=None, store: CostStore | None = None, prior: float = 4.0,
        tree_nodes: int = 0,
    ):  # fmt: skip
        if family(model).recurrent:
            raise DFlashError(
                "block_size='auto' times verify passes on the live cache and trims them off, which a hybrid "
                "target's recurrent state cannot do cheaply; pass a fixed block size."
            )
        self.model, self.draft, self.cache, self.speedups = model, draft, cache, speedups
        self.store = store or CostStore()
        self.tree = tree_nodes > 0
        self.widths = timed_widths(tree_nodes + 1 if self.tree else draft.block_size)
        kind = "tree widths" if self.tree else "widths"
        self.prefix = f"{machine_key()}|{model_key(model)}|{kind} {','.join(map(str, self.widths))}"
        self.memo: dict[int, PassCosts] = {}
        self.accepted, self.expected = prior, prior  # calibration: accepted drafts / sum of confidences
        self.pending_taps: list[float] | None = None  # confidences of the drafts verified this cycle

    @property
    def ratio(self) -> float:
        return self.accepted / self.expected

    def costs(self) -> PassCosts:
        """The pass costs at the cache's context (measured now if new to this machine and model)."""
        b = bucket(self.cache.offset)
        if b not in self.memo:
            key = f"{self.prefix}|bucket {b}"
            costs = self.store.get(key)
            if costs is None:
                tap_ids = self.draft.target_layer_ids
                costs = measure(self.model, self.draft, self.cache, tap_ids, self.widths, self.speedups,
                                tree=self.tree)  # fmt: skip
                self.store.put(key, costs)
            self.memo[b] = costs
        return self.memo[b]

    def choose(self, confidences: list[float]) -> int:
        """How many of the drafts (with these confidences) to verify: at least one."""
        costs = self.costs()
        best_n, best_rate, alive, expected = 1, -1.0, 1.0, 1.0
        for n, c in enumerate(confidences, 1):
            alive *= min(1.0, self.ratio * c)
            expected += alive
            rate = expected / (costs.draft + costs.verify_at(n + 1))
            if rate >= best_rate * (1 - 1e-9):  # a tie goes to the longer cycle: fewer cycles, less overhead
                best_n, best_rate = n, rate
        self.pending_taps = confidences[:best_n]
        return best_n

    def choose_nodes(self, path_probs: list[float]) -> int:
        """How many of a draft tree's nodes (best first, with these path probabilities) to verify."""
        costs = self.costs()
        best_n, best_rate, expected = 1, -1.0, 1.0
        for n, p in enumerate(path_probs, 1):
            expected += min(1.0, self.ratio * p)
            rate = expected / (costs.draft + costs.verify_at(n + 1))
            if rate >= best_rate * (1 - 1e-9):
                best_n, best_rate = n, rate
        # Calibrated as for drafts: the accepted path's length against the chances summed.
        self.pending_taps = [sum(path_probs[:best_n])]
        return best_n

    def update(self, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` of this cycle's drafts: each draft it judged counts
        (those up to and including the first miss)."""
        if self.pending_taps is None:
            return
        if self.tree:
            self.accepted += num_accepted
            self.expected += self.pending_taps[0]
            self.pending_taps = None
            return
        judged = self.pending_taps[: num_accepted + 1]
        self.accepted += min(num_accepted, len(judged))
        self.expected += sum(judged)
        self.pending_taps = None
