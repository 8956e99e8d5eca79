"""dflash-bench: plain decoding, mlx-lm speculative decoding, prompt lookup and DFlash, side by side.

Every method runs in this one process on the same prompts after a warm-up; each number is the
median of ``--runs`` runs. Greedy decoding is lossless, so all methods must emit the same tokens:
the benchmark checks that too.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from . import __version__
from . import target as tgt
from .backend import cpu_speedups
from .blas import blas_in_use, cpu_flags, find_openblas, openblas_core, preload_env, read_cpuinfo
from .chat_template import has_chat_template, render_chat
from .cli import DTYPE_CHOICES, ArgumentParser, InRange, block_size_problem
from .errors import DFlashError
from .generate import stream_generate
from .lookup import PromptLookup

METHODS = ("baseline", "mlx-spec", "lookup", "dflash", "dflash-cut", "dflash-fallback")
# DFlash methods: the paper's fixed block, the block cut at the drafter's first unsure draft, and
# the fixed block with prompt-lookup cycles after the drafter's first-draft misses.
DFLASH_METHODS = ("dflash", "dflash-cut", "dflash-fallback")
# Those whose every cycle is one drafter pass and one verify, so the physical limit applies.
LIMIT_METHODS = ("dflash", "dflash-cut")
DEFAULT_MIN_CONFIDENCE = 0.5  # dflash-cut's cutoff
DEFAULT_LOOKUP_FALLBACK = 4  # dflash-fallback's most lookup cycles in a row


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


def physical_limit(tau: float, t_ar: float, t_draft: float, t_verify: float) -> float:
    """The best speedup a loop can reach: tau tokens per (draft + verify) against one AR step each."""
    return tau * t_ar / (t_draft + t_verify)


def efficiency(speedup: float, limit: float) -> float:
    """The measured speedup over the baseline against the physical limit."""
    return speedup / limit if limit > 0 else 0.0


def loop_efficiency(tps: float, tau: float, t_draft: float, t_verify: float) -> float:
    """Measured tok/s over the loop's ideal, ``tau / (t_draft + t_verify)``: the loop against its own
    passes timed alone. It differs from :func:`efficiency` by the baseline's real step against a
    lone AR pass (mlx-lm builds its next step's graph while the current one runs)."""
    return tps * (t_draft + t_verify) / tau if tau > 0 else 0.0


def git_commit(path: str | Path) -> str:
    """The short commit of the checkout holding ``path``, "+changes" when tracked files differ from it.

    Returns "" outside a git checkout (an installed wheel) or without git.
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=path
        ).stdout.strip()
        if commit and subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=path
        ).stdout.strip():
            # A result measured on edited files (say, new weights) must not pass for the commit's.
            commit += "+changes"
    except OSError:
        commit = ""
    return commit


def stamp() -> dict:
    """Machine, versions, commit and BLAS: every result carries them."""
    import mlx_lm

    commit = git_commit(Path(__file__).parent)
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "dflash_mlx": __version__,
        "commit": commit or "unknown",
        "blas": blas_in_use(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def load_prompts(path: Path, limit: int | None = None) -> list[dict]:
    """Prompts from JSONL: each line has ``prompt`` (text) or ``messages``, and optional ``category``."""
    if not path.is_file():
        raise DFlashError(f"No prompts file at {path}; pass a JSONL file with --prompts.")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be one JSON object.")
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise DFlashError(f"{path}:{n} has neither 'prompt' nor 'messages'; add one of them.")
        prompts.append(row)
    if not prompts:
        raise DFlashError(f"{path} holds no prompts.")
    return prompts[:limit] if limit else prompts


def _prompt_rows(prompts: str, limit: int | None) -> list[dict]:
    """A JSONL path, or comma-separated names of the paper's sets (gsm8k, math500, ...)."""
    from .bench_datasets import DATASETS, load_prompt_set

    names = prompts.split(",")
    if all(n in DATASETS for n in names):
        return [row for n in names for row in load_prompt_set(n, limit)]
    return load_prompts(Path(prompts), limit)


def encode(tokenizer, row: dict) -> list[int]:
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    if has_chat_template(tokenizer) and not row.get("raw", False):
        return render_chat(tokenizer, messages)
    return tokenizer.encode(row.get("prompt") or messages[-1]["content"])


def _time_stream(responses: Iterator, get_tokens: Callable) -> tuple[list[int], float, float, list[int], list[int]]:
    """Drain a stream: (ids, seconds after the first token, seconds to the first token, acceptances,
    tokens verified per cycle)."""
    ids, accept, first, tic, drafted, sizes = [], [], None, time.perf_counter(), 0, []
    for r in responses:
        if first is None:
            first = time.perf_counter()
        elif hasattr(r, "from_draft"):
            # mlx-lm marks drafted tokens; the target's own token closes each cycle.
            if r.from_draft:
                drafted += 1
            else:
                accept.append(drafted + 1)
                drafted = 0
        ids.extend(get_tokens(r))
        if getattr(r, "cycle", 0) > 0:
            accept.append(r.acceptance_length)
            sizes.append(r.num_draft + 1)
    end = time.perf_counter()
    if drafted:
        accept.append(drafted)
    return ids, end - (first or end), (first or end) - tic, accept, sizes


def make_runner(
    method: str, model, draft, ar_draft, tokenizer, block_size: int, num_draft: int, max_tokens: int,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    lookup_fallback: int = DEFAULT_LOOKUP_FALLBACK,
):
    """A function ``prompt ids -> (ids, gen seconds, prompt seconds, acceptances)`` for one method."""
    if method in ("baseline", "mlx-spec"):
        from mlx_lm.generate import stream_generate as mlx_lm_stream

        kwargs = {"draft_model": ar_draft, "num_draft_tokens": num_draft} if method == "mlx-spec" else {}
        # mlx-lm's last response carries the stop token; ours leave it out of the text and tokens.
        return lambda ids: _time_stream(
            mlx_lm_stream(model, tokenizer, ids, max_tokens=max_tokens, **kwargs),
            lambda r: [] if r.finish_reason == "stop" else [r.token],
        )
    proposer = PromptLookup(block_size) if method == "lookup" else draft
    cutoff = min_confidence if method == "dflash-cut" else 0.0
    fallback = lookup_fallback if method == "dflash-fallback" else 0
    return lambda ids: _time_stream(
        stream_generate(
            model, proposer, tokenizer, ids, max_tokens=max_tokens, block_size=block_size, min_confidence=cutoff,
            lookup_fallback=fallback, adaptive=False,  # each method as published: a draft every cycle
        ),
        lambda r: r.tokens,
    )


def median_run(results: list[tuple]) -> tuple[list[int], float, float, list[int], list[int]]:
    """Several runs of one method on one prompt: the first run's tokens and counts, median times."""
    out, _, _, accept, sizes = results[0]
    gen = statistics.median(r[1] for r in results)
    first = statistics.median(r[2] for r in results)
    return out, gen, first, accept, sizes


def component_times(model, draft, block_sizes: list[int], context: int = 64, repeats: int = 10) -> dict:
    """Seconds of one AR step, one verify pass of B tokens and one draft pass, at ``context``, and
    (``verify_by_size``) of a verify pass of every size up to the largest B: the fastest of
    ``repeats``, since other work on the machine only ever slows a pass down."""
    from .cache import make_cache

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            tic = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - tic)
        return min(samples)

    cache = make_cache(model, draft)
    prompt = mx.array([[1] * context])
    taps_ids = draft.target_layer_ids if draft is not None else []
    # The passes as the loop runs them, with the same CPU speedups.
    speedups = cpu_speedups(tgt.compute_dtype(model))
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
            times["draft"][b] = timed(lambda: mx.eval(draft.propose(model, block, None, cache.draft, speedups)))
    return times


def fastest_times(a: dict, b: dict) -> dict:
    """Two component timings merged entry by entry, keeping the faster of each."""
    if not a or not b:
        return a or b
    out = {"context": a["context"], "ar": min(a["ar"], b["ar"])}
    for key in ("verify", "draft", "verify_by_size"):
        out[key] = {k: min(a[key][k], b[key][k]) for k in a.get(key, {})}
    return out


def summarize(results: list[RunResult], times: dict, baseline: str = "baseline") -> list[dict]:
    """Per method and block size: tok/s, speedup, tau, histogram, limit and efficiency."""
    rows = []
    def pooled_tps(group: list[RunResult]) -> float:
        # Tokens over time summed across prompts, the same pooling as tau's mean over all cycles.
        tokens = sum(max(r.tokens - 1, 0) for r in group)
        seconds = sum(max(r.tokens - 1, 0) / r.generation_tps for r in group if r.generation_tps > 0)
        return tokens / seconds if seconds > 0 else 0.0

    base = [r for r in results if r.method == baseline]
    base_tps = pooled_tps(base) if base else 0.0
    keys = sorted({(r.method, r.block_size) for r in results}, key=lambda k: (METHODS.index(k[0]), k[1]))
    for method, b in keys:
        group = [r for r in results if (r.method, r.block_size) == (method, b)]
        tps = pooled_tps(group)
        accept = [a for r in group for a in r.acceptance_lengths]
        tau = statistics.mean(accept) if accept else 1.0
        row = {
            "method": method,
            "block_size": b,
            "generation_tps": tps,
            "prompt_tps": statistics.mean(r.prompt_tps for r in group),
            # None without a baseline run (--methods without "baseline"): nothing to compare to.
            "speedup": tps / base_tps if base_tps else None,
            "tau": tau,
            "histogram": {k: accept.count(k) for k in sorted(set(accept))},
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
            limit = physical_limit(tau, times["ar"], t_draft, t_verify)
            row.update(
                verify_size=statistics.mean(sizes),
                limit=limit,
                # None without a baseline run, like the speedup it divides.
                efficiency=efficiency(row["speedup"], limit) if row["speedup"] is not None else None,
                loop_efficiency=loop_efficiency(tps, tau, t_draft, t_verify),
            )
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict, times: dict) -> str:
    lines = [
        f"Machine: {meta['machine']} ({meta['device']}); BLAS: {meta['blas']}; mlx {meta['mlx']}, "
        f"mlx-lm {meta['mlx_lm']}; commit {meta['commit']}; {meta['date']}",
        "",
        "| method | block | gen tok/s | speedup | tau | verified | prompt tok/s | limit | efficiency | loop eff. "
        "| peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        limit = f"{r['limit']:.2f}x" if "limit" in r else ""
        eff = f"{100 * r['efficiency']:.0f}%" if r.get("efficiency") is not None else ""
        loop = f"{100 * r['loop_efficiency']:.0f}%" if "loop_efficiency" in r else ""
        verified = f"{r['verify_size']:.2f}" if "verify_size" in r else ""
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else ""
        lines.append(
            f"| {r['method']} | {r['block_size']} | {r['generation_tps']:.1f} | {speedup} | "
            f"{r['tau']:.2f} | {verified} | {r['prompt_tps']:.0f} | {limit} | {eff} | {loop} | "
            f"{r['peak_memory_gb']:.2f} |"
        )
    lines += [
        "",
        "speedup: generation tok/s over the baseline's. tau: mean acceptance length. verified: tokens the "
        "target checked per cycle (dflash-cut stops at the drafter's first draft under --min-confidence). "
        "limit: tau x t_AR / (t_draft + t_verify), with each cycle's verify at its size, the best speedup "
        "over a bare AR step. efficiency: speedup / limit. loop eff.: measured tok/s over the ideal "
        "tau / (t_draft + t_verify), the loop against its own passes timed alone; it differs from efficiency "
        "by the baseline's real step against a lone AR pass (below). "
        "dflash-fallback has no limit: its prompt-lookup cycles run no drafter pass.",
    ]
    if times.get("verify"):
        at = f" at a {times['context']}-token context" if "context" in times else ""
        base = next((r for r in rows if r["method"] == "baseline" and r["generation_tps"] > 0), None)
        own = f" (the baseline's own step: {1e3 / base['generation_tps']:.2f})" if base else ""
        lines += ["", f"Component times (ms){at}: AR step {1e3 * times['ar']:.2f}{own}"]
        for b in sorted(times["verify"]):
            d = times["draft"].get(b)
            lines.append(f"- B={b}: verify {1e3 * times['verify'][b]:.2f}" + (f", draft {1e3 * d:.2f}" if d else ""))
    return "\n".join(lines) + "\n"


def plot_caption(meta: dict) -> str:
    """What a plot measured: the model, the drafter and the prompt set."""
    return (f"target {meta.get('model')} · drafter {meta.get('draft')} · prompts {meta.get('prompt_set')} "
            f"({meta.get('prompts')}) · {meta.get('dtype')}")


def plots(rows: list[dict], out: Path, meta: dict | None = None) -> list[Path]:
    """Speedup and acceptance against block size, and the acceptance histogram, as PNG files,
    captioned with ``meta``'s model, drafter and prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    caption = plot_caption(meta) if meta else None

    out.mkdir(parents=True, exist_ok=True)
    dflash = [r for r in rows if r["method"] == "dflash"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    lines = (
        ("dflash", "DFlash"),
        ("dflash-cut", "DFlash, cut block"),
        ("dflash-fallback", "DFlash, lookup fallback"),
        ("lookup", "prompt lookup"),
    )
    for i, (method, label) in enumerate(lines):
        mine = [r for r in rows if r["method"] == method]
        if mine:
            style = dict(color=f"C{i}", label=label, ls="-" if method in DFLASH_METHODS else ":")
            if mine[0]["speedup"] is not None:
                ax[0].plot([r["block_size"] for r in mine], [r["speedup"] for r in mine], "o", **style)
            ax[1].plot([r["block_size"] for r in mine], [r["tau"] for r in mine], "o", **style)
    refs = (r for r in rows if r["method"] in ("baseline", "mlx-spec") and r["speedup"] is not None)
    for i, r in enumerate(refs):
        ax[0].axhline(r["speedup"], ls="--", lw=1, color=f"C{len(lines) + i}", label=r["method"])
    ax[0].set(xlabel="block size", ylabel="speedup vs baseline", title="Speedup")
    if ax[0].get_legend_handles_labels()[0]:
        ax[0].legend(fontsize=7)
    else:
        ax[0].text(0.5, 0.5, "no baseline run", ha="center", va="center", transform=ax[0].transAxes)
    ax[1].legend(fontsize=7)
    ax[1].set(xlabel="block size", ylabel="mean acceptance length", title="Acceptance")
    for a in ax:  # block sizes are whole numbers
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if caption:
        fig.suptitle(caption, fontsize=7)
    fig.tight_layout()
    paths = [out / "speedup.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    if dflash:
        best = max(dflash, key=lambda r: r["block_size"])
        fig, ax = plt.subplots(figsize=(5, 3.5))
        hist = best["histogram"]
        ax.bar(list(hist), list(hist.values()))
        ax.set(xlabel="acceptance length (tokens per cycle)", ylabel="cycles", title=f"DFlash B={best['block_size']}")
        # Both axes count things: whole tokens and whole cycles.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if caption:
            fig.suptitle(caption, fontsize=7)
        fig.tight_layout()
        paths.append(out / "acceptance_histogram.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def estimate_seconds(num_prompts: int, num_settings: int, runs: int, max_tokens: int, step: float) -> float:
    """A rough run time before starting: every run of every setting on every prompt (and its warm-up)
    making all ``max_tokens`` at one plain decoding step each. Rough: drafting methods and early stops
    take less, while warm-ups, prefills and loading take more than it counts."""
    return num_prompts * num_settings * (runs + 1) * max_tokens * step


def _load_ar_draft(path: str | None, *, given: bool, dtype: str | None) -> nn.Module:
    """mlx-spec's small autoregressive draft, with one line for what it cannot use."""
    from mlx_lm.utils import load_model

    from .loading import is_drafter_config, read_config

    if path is None:
        raise DFlashError("The mlx-spec method needs a small autoregressive draft: pass --ar-draft FOLDER.")
    if not Path(path).is_dir():
        what = f"--ar-draft {path} is not a folder" if given else f"The embedded pair has no ar-draft folder ({path})"
        raise DFlashError(f"{what}: pass a small mlx-lm model's folder, or leave out the mlx-spec method.")
    config = read_config(Path(path), "--ar-draft model")
    if is_drafter_config(config):
        raise DFlashError(
            f"--ar-draft {path} is a DFlash drafter; mlx-spec needs a small autoregressive model with the "
            "target's tokenizer (the DFlash drafter goes to --draft)."
        )
    try:
        ar, _ = load_model(Path(path))
    except Exception as e:  # mlx-lm raises many types for a folder that is not a model it knows
        raise DFlashError(
            f"--ar-draft {path} is not a model mlx-lm can load ({type(e).__name__}: {str(e).splitlines()[0]})."
        ) from e
    if dtype:
        ar.set_dtype(getattr(mx, dtype))
    return ar


def run_benchmark(
    model: str | None = None,
    draft: str | None = None,
    ar_draft: str | None = None,
    prompts: str | None = None,
    num_prompts: int | None = None,
    max_tokens: int = 128,
    block_sizes: tuple[int, ...] = (4, 8, 16),
    num_draft_tokens: int = 3,
    runs: int = 3,
    methods: tuple[str, ...] = METHODS,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    lookup_fallback: int = DEFAULT_LOOKUP_FALLBACK,
    dtype: str | None = "float32",
    progress: bool = True,
) -> dict:
    """Run the methods on the prompts and return ``{"meta", "times", "rows", "runs"}``."""
    from .loading import DEFAULT_PAIR, default_pair_path, load

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise DFlashError(f"Unknown method {bad[0]!r}; choose from {', '.join(METHODS)}.")
    if runs < 1 or max_tokens < 1:
        raise DFlashError(f"--runs and --max-tokens must be at least 1 (got {runs} and {max_tokens}).")
    if num_prompts is not None and num_prompts < 1:
        raise DFlashError(f"--num-prompts must be at least 1 (got {num_prompts}); leave it out to use every prompt.")
    if not 0.0 < min_confidence <= 1.0:
        raise DFlashError(f"--min-confidence must be in (0, 1] (got {min_confidence}).")
    if lookup_fallback < 1:
        raise DFlashError(f"--lookup-fallback must be at least 1 (got {lookup_fallback}).")
    target, drafter, tokenizer = load(model, draft, dtype=dtype)
    if any(m in DFLASH_METHODS for m in methods) and drafter is None:
        raise DFlashError("The dflash method needs a drafter: pass --draft.")
    if drafter is not None:
        for b in block_sizes:
            if problem := block_size_problem(b, drafter.block_size, flag="--block-sizes"):
                raise DFlashError(problem)
    pair = default_pair_path()
    ar_path = ar_draft or (str(pair / "ar-draft") if model is None else None)
    ar = _load_ar_draft(ar_path, given=ar_draft is not None, dtype=dtype) if "mlx-spec" in methods else None
    rows_in = _prompt_rows(prompts or str(pair / "prompts.jsonl"), num_prompts)
    # Attention grows with the context, and more for a B-token verify than for one token: time
    # the components at the mean context of a generated token (prompt + half the new tokens).
    # They are timed before and after the runs; the faster of the two is kept.
    context = max(1, round(statistics.mean(len(encode(tokenizer, row)) for row in rows_in) + max_tokens / 2))
    tic = time.perf_counter()
    first_times = component_times(target, drafter, list(block_sizes), context=context) if drafter is not None else {}
    timing_seconds = time.perf_counter() - tic  # the component times are taken again at the end
    plan = [(m, b) for m in methods for b in (block_sizes if m in (*DFLASH_METHODS, "lookup") else (1,))]
    if progress:
        step = first_times.get("ar") or component_times(target, None, [1], context=context, repeats=3)["ar"]
        seconds = estimate_seconds(len(rows_in), len(plan), runs, max_tokens, step) + timing_seconds
        print(f"Estimated run time: about {seconds:.0f} s ({len(rows_in)} prompts x {len(plan)} method/block "
              f"settings x ({runs} runs + a warm-up) x up to {max_tokens} tokens at a measured "
              f"{1e3 * step:.1f} ms plain step, and {timing_seconds:.0f} s of component timing)", file=sys.stderr)
    runners = {
        (m, b): make_runner(m, target, drafter, ar, tokenizer, b, num_draft_tokens, max_tokens,
                            min_confidence, lookup_fallback)
        for m, b in plan
    }  # fmt: skip
    results, total, done, start = [], len(plan) * len(rows_in) * runs, 0, time.perf_counter()
    mismatches = []
    for i, row in enumerate(rows_in):
        ids = encode(tokenizer, row)
        for runner in runners.values():
            runner(ids)  # warm-up
        # Round robin: a slow spell of the machine hits one run of every method, not all runs of one.
        samples = {key: [] for key in plan}
        peaks = {key: 0.0 for key in plan}
        for r in range(runs):
            for key in plan:
                mx.reset_peak_memory()
                samples[key].append(runners[key](ids))
                peaks[key] = max(peaks[key], mx.get_peak_memory() / 1e9)
                done += 1
                if progress:
                    eta = (time.perf_counter() - start) / done * (total - done)
                    print(f"\r[{done}/{total}] prompt {i + 1}, run {r + 1}: {key[0]} B={key[1]}, ETA {eta:.0f}s   ",
                          end="", file=sys.stderr, flush=True)
        for method, b in plan:
            out, gen_s, first_s, accept, sizes = median_run(samples[(method, b)])
            # Losslessness check: every method must emit the first method's tokens.
            if out != samples[plan[0]][0][0]:
                mismatches.append(f"{method} B={b} prompt {i}")
            results.append(
                RunResult(method, b, i, row.get("category", "all"), len(out),
                          max(len(out) - 1, 0) / gen_s if gen_s > 0 else 0.0,
                          len(ids) / first_s if first_s > 0 else 0.0, accept, peaks[(method, b)], out, sizes)
            )
    if progress:
        print(file=sys.stderr)
    times = component_times(target, drafter, list(block_sizes), context=context) if drafter is not None else {}
    times = fastest_times(first_times, times)
    categories = sorted({r.category for r in results})
    by_category = {c: summarize([r for r in results if r.category == c], times) for c in categories}
    return {
        "meta": {**stamp(), "max_tokens": max_tokens, "runs": runs, "prompts": len(rows_in), "dtype": dtype,
                 "model": model or f"{DEFAULT_PAIR} (embedded)", "draft": draft or (f"{DEFAULT_PAIR} drafter (embedded)" if model is None else None),
                 "ar_draft": ar_path if "mlx-spec" in methods else None,
                 "prompt_set": prompts or f"{DEFAULT_PAIR} held-out prompts (embedded)",
                 "min_confidence": min_confidence, "lookup_fallback": lookup_fallback},
        "times": times,
        "rows": summarize(results, times),
        "mismatches": mismatches,
        "by_category": by_category if len(categories) > 1 else {},
        "runs": [asdict(r) for r in results],
    }


def setup_arg_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dflash-bench", description="Benchmark DFlash against its alternatives.")
    p.add_argument("--model", default=None, help="Target (default: the embedded pair).")
    p.add_argument("--draft", default=None, help="DFlash drafter (default: the embedded pair's).")
    p.add_argument("--ar-draft", default=None, help="Small autoregressive draft for mlx-lm speculative decoding.")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL prompts, or prompt sets from the hub: gsm8k, math500, humaneval, mbpp, mt-bench "
        "(comma-separated). Default: the embedded pair's held-out prompts.",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="Use only the first N prompts.")
    p.add_argument("--max-tokens", type=int, action=InRange, low=1, default=128,
                   help="Most tokens per prompt and run (default: 128).")
    p.add_argument("--block-sizes", type=int, nargs="+", action=InRange, low=1, default=[4, 8, 16],
                   help="Block sizes for the DFlash and lookup methods, each 1 to the drafter's (default: 4 8 16).")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="Draft tokens for mlx-lm speculative decoding.")
    p.add_argument("--runs", type=int, default=3, help="Timed runs per measurement (median).")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), metavar="METHOD",
                   help=f"Methods to run, of {', '.join(METHODS)} (default: all).")
    p.add_argument("--min-confidence", type=float, default=DEFAULT_MIN_CONFIDENCE,
                   help="dflash-cut: verify only the drafts the drafter gives at least this probability.")
    p.add_argument("--lookup-fallback", type=int, default=DEFAULT_LOOKUP_FALLBACK,
                   help="dflash-fallback: the most prompt-lookup cycles after the drafter misses its first draft.")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="Compute dtype of the models (default: float32, in which greedy output is the same for "
                   "every method, as the benchmark checks; generate and chat default to the checkpoint's dtype on "
                   "a GPU).")
    p.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto",
                   help="Linux CPU: preload OpenBLAS when installed (auto), require it, or keep MLX's own.")
    p.add_argument("--scaling", nargs="+", default=None, metavar="SHAPE",
                   help="Scaling mode on random-weight targets of these shapes (qwen3-0.6b, qwen3-1.7b).")
    p.add_argument("--replay", default=None, help="Results JSON of a normal run whose acceptance --scaling replays.")
    p.add_argument("--base-url", default=None,
                   help="Measure an OpenAI-compatible server instead (dflash-serve, vLLM, SGLang), e.g. "
                   "http://host:8000/v1: requests/min, tok/s and tau per --concurrency; --model names its model.")
    p.add_argument("--api-key", default=None, help="The server's API key (with --base-url).")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8],
                   help="With --base-url: clients sending at once, one level after another.")
    p.add_argument("--json", default=None, help="Write the results as JSON here.")
    p.add_argument("--markdown", default=None, help="Write the Markdown table here.")
    p.add_argument("--plots", default=None, help="Write PNG plots into this folder.")
    return p


def _check_outputs(json_path: str | None, markdown_path: str | None, plots_dir: str | None) -> None:
    """Refuse an output path that cannot be written before anything runs, not after the whole benchmark."""
    for flag, value, is_file in (("--json", json_path, True), ("--markdown", markdown_path, True),
                                 ("--plots", plots_dir, False)):  # fmt: skip
        if value is None:
            continue
        path = Path(value).expanduser().absolute()
        if is_file and path.is_dir():
            raise DFlashError(f"{flag} {value} is a folder; pass a file name.")
        if not is_file and path.exists() and not path.is_dir():
            raise DFlashError(f"{flag} {value} is a file; pass a folder.")
        # A file goes into an existing folder; the plots folder is created, with its parents.
        where = path.parent if is_file else next(p for p in (path, *path.parents) if p.exists())
        if not where.exists():
            raise DFlashError(f"{flag} {value}: the folder {where} does not exist; create it or pass another path.")
        if not where.is_dir():
            raise DFlashError(f"{flag} {value}: {where} is a file, not a folder; pass another path.")
        if not os.access(where, os.W_OK | os.X_OK):
            raise DFlashError(f"{flag} {value}: the folder {where} is not writable; pass another path.")


def _write_text(path: str, text: str) -> None:
    # A temporary sibling renamed into place: an interrupted write never leaves half a file.
    tmp = Path(path).with_name(f".{Path(path).name}.partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _maybe_reexec_with_openblas(choice: str) -> None:
    # LD_PRELOAD only takes effect at process start, so re-run ourselves with it set.
    if sys.platform != "linux" or choice == "bundled" or "libopenblas" in os.environ.get("LD_PRELOAD", ""):
        return
    library = find_openblas()
    if library is None:
        if choice == "openblas":
            raise DFlashError(
                "OpenBLAS is not installed (not in the usual folders nor in ldconfig -p): install "
                "libopenblas0-pthread (Debian/Ubuntu) or openblas-threads (Fedora), or pass --blas bundled."
            )
        return
    # Ask the library which kernels it picks by itself, to name better ones for this CPU if needed.
    detected = openblas_core(library) if "OPENBLAS_CORETYPE" not in os.environ else None
    env = preload_env(dict(os.environ), library, cpu_flags(read_cpuinfo()), detected and detected[1])
    os.execve(sys.executable, [sys.executable, "-m", "dflash_mlx.benchmark", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.runs < 1:
        parser.error("--max-tokens and --runs must be at least 1.")
    try:
        _check_outputs(args.json, args.markdown, args.plots)
        if argv is None:
            _maybe_reexec_with_openblas(args.blas)
        if args.scaling:
            return _scaling_main(args)
        if args.base_url:
            return _remote_main(args)
        result = run_benchmark(
            model=args.model, draft=args.draft, ar_draft=args.ar_draft, prompts=args.prompts,
            num_prompts=args.num_prompts, max_tokens=args.max_tokens, block_sizes=tuple(args.block_sizes),
            num_draft_tokens=args.num_draft_tokens, runs=args.runs, methods=tuple(args.methods),
            min_confidence=args.min_confidence, lookup_fallback=args.lookup_fallback, dtype=args.dtype,
        )
    except DFlashError as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        sys.exit(1)
    table = markdown(result["rows"], result["meta"], result["times"])
    if result["mismatches"]:
        table += "\nOutputs that differ from the first method's (not lossless): " + ", ".join(result["mismatches"]) + "\n"
    for category, rows in result["by_category"].items():
        table += f"\n### {category}\n\n" + "\n".join(markdown(rows, result["meta"], {}).splitlines()[2:]) + "\n"
    print(table)
    if args.markdown:
        _write_text(args.markdown, table)
    if args.json:
        _write_text(args.json, json.dumps(result, indent=1))
    if args.plots:
        for path in plots(result["rows"], Path(args.plots), result["meta"]):
            print(f"wrote {path}")


def _remote_main(args) -> None:
    from .bench_remote import load_markdown, run_load
    from .loading import default_pair_path

    if any(n < 1 for n in args.concurrency):
        raise DFlashError(f"--concurrency levels must be at least 1 (got {args.concurrency}).")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise DFlashError(f"--num-prompts must be at least 1 (got {args.num_prompts}); leave it out to use every prompt.")
    rows = _prompt_rows(args.prompts or str(default_pair_path() / "prompts.jsonl"), args.num_prompts)
    result = run_load(args.base_url, rows, api_key=args.api_key, model=args.model,
                      concurrency=tuple(args.concurrency), max_tokens=args.max_tokens)
    result["meta"] = stamp()
    table = load_markdown(result)
    print(table)
    if args.markdown:
        _write_text(args.markdown, table)
    if args.json:
        _write_text(args.json, json.dumps(result, indent=1))


def _scaling_main(args) -> None:
    from .bench_scaling import SHAPES, measure_shape, scaling_markdown

    unknown = [s for s in args.scaling if s not in SHAPES]
    if unknown:
        raise DFlashError(f"Unknown shape {unknown[0]!r} for --scaling; choose from {', '.join(SHAPES)}.")
    if not args.replay or not Path(args.replay).is_file():
        raise DFlashError("--scaling needs --replay RESULTS.json, written by a normal run with --json.")
    recorded = json.loads(Path(args.replay).read_text())
    taus = {r["block_size"]: r["tau"] for r in recorded.get("rows", []) if r["method"] == "dflash"}
    if not taus:
        raise DFlashError(f"{args.replay} has no dflash rows to replay; run the benchmark with the dflash method.")
    rows = [row for shape in args.scaling for row in measure_shape(shape, taus)]
    meta = stamp()
    table = f"Machine: {meta['machine']}; BLAS: {meta['blas']}; mlx {meta['mlx']}; commit {meta['commit']}\n\n"
    table += scaling_markdown(rows)
    print(table)
    if args.markdown:
        _write_text(args.markdown, table)
    if args.json:
        _write_text(args.json, json.dumps({"meta": meta, "scaling": rows}, indent=1))


if __name__ == "__main__":
    main()
