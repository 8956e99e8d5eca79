"""The benchmark's statistics: per method and block size, pooled tok/s, speedup, acceptance,
and how close the loop comes to the best speedup its passes allow."""

import statistics

from ...text.responses import AcceptanceStats
from .timing import DFLASH_METHODS, METHODS, RunResult

# Those whose every cycle is one drafter pass and one verify, so the physical limit applies.
LIMIT_METHODS = ("dflash", "dflash-cut", "dflash-auto")


def physical_limit(tau: float, t_ar: float, t_draft: float, t_verify: float, t_rollback: float = 0.0) -> float:
    """The best speedup a loop can reach: tau tokens per (draft + verify + rollback) against one AR
    step each. The rollback costs time on hybrid targets only (``bench_timing.component_times``)."""
    return tau * t_ar / (t_draft + t_verify + t_rollback)


def efficiency(speedup: float, limit: float) -> float:
    """The measured speedup over the baseline against the physical limit."""
    return speedup / limit if limit > 0 else 0.0


def loop_efficiency(tps: float, tau: float, t_draft: float, t_verify: float, t_rollback: float = 0.0) -> float:
    """Measured tok/s over the loop's ideal, ``tau / (t_draft + t_verify + t_rollback)``: the loop
    against its own passes timed alone. It differs from :func:`efficiency` by the baseline's real
    step against a lone AR pass (mlx-lm builds its next step's graph while the current one runs)."""
    return tps * (t_draft + t_verify + t_rollback) / tau if tau > 0 else 0.0


def mean_rollback(by_k: dict, block_size: int, cycles: list[tuple[int, int]]) -> float:
    """The mean rollback of ``cycles`` (acceptance length, tokens verified) of one block size,
    from its rollback times measured at a few accepted-draft counts ``k`` (``by_k``).

    A cycle that kept all it verified trims nothing: the ``k = B - 1`` time. Any other keeps
    ``acceptance length`` tokens and replays them, whatever it verified: the time at
    ``k = acceptance length - 1``, linear between the measured ``k``.
    """
    if not cycles:
        return 0.0
    points = sorted((int(k), t) for k, t in by_k.items())

    def at(k: int) -> float:
        for (k0, t0), (k1, t1) in zip(points, points[1:]):
            if k <= k1:
                return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return points[-1][1]

    return statistics.mean(at(block_size - 1 if a >= s else a - 1) for a, s in cycles)


def summarize(results: list[RunResult], times: dict, baseline: str = "baseline") -> list[dict]:
    """Per method and block size: tok/s, speedup, tau, histogram, limit and efficiency."""
    rows = []

    def pooled_tps(group: list[RunResult]) -> float:
        # Tokens over time summed across prompts, as tau pools the cycles of every prompt.
        tokens = sum(max(r.tokens - 1, 0) for r in group)
        seconds = sum(max(r.tokens - 1, 0) / r.generation_tps for r in group if r.generation_tps > 0)
        return tokens / seconds if seconds > 0 else 0.0

    base = [r for r in results if r.method == baseline]
    base_tps = pooled_tps(base) if base else 0.0
    keys = sorted({(r.method, r.block_size) for r in results}, key=lambda k: (METHODS.index(k[0]), k[1]))
    for method, b in keys:
        group = [r for r in results if (r.method, r.block_size) == (method, b)]
        tps = pooled_tps(group)
        acceptance = AcceptanceStats()
        for r in group:
            acceptance.merge(r.acceptance)
        tau = acceptance.tau
        row = {
            "method": method,
            "block_size": b,
            "generation_tps": tps,
            "prompt_tps": statistics.mean(r.prompt_tps for r in group),
            # None without a baseline run (--methods without "baseline"): nothing to compare to.
            "speedup": tps / base_tps if base_tps else None,
            # Over drafting cycles only (AcceptanceStats); plain cycles are counted apart.
            "tau": tau,
            "drafting_cycles": acceptance.drafting_cycles,
            "plain_cycles": acceptance.plain_cycles,
            "histogram": acceptance.lengths,
            "shares": acceptance.shares,
            "depths": acceptance.depths,
            "peak_memory_gb": max(r.peak_memory_gb for r in group),
        }
        sizes = [k for r in group for k in r.verify_sizes]
        if method in DFLASH_METHODS and sizes:
            row["verify_size"] = statistics.mean(sizes)
        if method in LIMIT_METHODS and b in times.get("draft", {}):
            # Each cycle's verify at the size it had (B, or less when cut or at the end).
            by_size = {int(k): v for k, v in times.get("verify_by_size", {}).items()}
            if not (by_size and sizes):
                sizes, by_size = [b], {b: times["verify"][b]}
            t_draft, t_verify = times["draft"][b], statistics.mean(by_size[k] for k in sizes)
            t_rollback = 0.0
            if b in times.get("rollback", {}):
                # A hybrid target: each cycle's rollback, at the acceptance it had.
                cycles = [
                    (a, s)
                    for r in group
                    for a, s in zip(r.acceptance_lengths, r.verify_sizes or [b] * len(r.acceptance_lengths))
                ]
                t_rollback = row["rollback"] = mean_rollback(times["rollback"][b], b, cycles)
            limit = physical_limit(tau, times["ar"], t_draft, t_verify, t_rollback)
            row.update(
                verify_size=statistics.mean(sizes),
                limit=limit,
                # None without a baseline run, like the speedup it divides.
                efficiency=efficiency(row["speedup"], limit) if row["speedup"] is not None else None,
                loop_efficiency=loop_efficiency(tps, tau, t_draft, t_verify, t_rollback),
            )
        rows.append(row)
    return rows
