"""dflash-bench: plain decoding, mlx-lm speculative decoding, prompt lookup and DFlash, side by side.

Every method runs in this one process on the same prompts after a warm-up; each number is the
median of ``--runs`` runs. Greedy decoding is lossless, so all methods must emit the same tokens:
the benchmark checks that too.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...base.dtypes import DTYPES, dtype_name
from ...base.errors import DFlashError
from ...base.files import read_objects, write_text_atomic
from ...models import target as tgt
from ...text.chat_template import has_chat_template, render_chat
from ..cli.options import (
    ArgumentParser,
    InRange,
    add_blas_argument,
    add_kernels_argument,
    add_window_arguments,
    block_size_problem,
)
from .context import parse_lengths
from .report import markdown, plots, stamp
from .stats import summarize
from .timing import (
    DEFAULT_LOOKUP_FALLBACK,
    DEFAULT_MIN_CONFIDENCE,
    DEFAULT_TREE_BUDGET,
    DFLASH_METHODS,
    METHODS,
    RunResult,
    component_times,
    fastest_times,
    make_runner,
    median_run,
)

# The embedded pairs' autoregressive drafts stay out of the wheel: the recipes that rebuild them, in a source
# checkout (where the drafts are also committed).
AR_DRAFT_RECIPES = {
    "smollm2": "python recipes/rebuild/smollm2_ar_draft.py (assets/smollm2/DRAFT.md)",
    "dflash-tiny": "python recipes/rebuild/train_ar_draft.py (assets/dflash-tiny/AR_DRAFT.md)",
}


def _missing_ar_draft(pair: Path) -> str:
    """What to do when an embedded pair's ar-draft folder is absent, in one line."""
    recipe = AR_DRAFT_RECIPES.get(pair.name, "its recipe in recipes/rebuild/")
    return (f"the embedded pair has no ar-draft folder ({pair / 'ar-draft'}; the wheel leaves it out): pass "
            f"--ar-draft FOLDER, or rebuild it in a source checkout with {recipe}")  # fmt: skip


def load_prompts(path: Path, limit: int | None = None) -> list[dict]:
    """Prompts from JSONL: each line has ``prompt`` (text) or ``messages``, and optional ``category``."""
    prompts = []
    for n, row in read_objects(path, "--prompts", "prompts"):
        if not ("prompt" in row or "messages" in row):
            raise DFlashError(f"{path}:{n} has neither 'prompt' nor 'messages'; add one of them.")
        prompts.append(row)
    return prompts[:limit] if limit else prompts


def prompt_rows(prompts: str, limit: int | None) -> list[dict]:
    """A JSONL path, or comma-separated names of the paper's sets (gsm8k, math500, ...)."""
    from .datasets import DATASETS, load_prompt_set

    names = prompts.split(",")
    if all(n in DATASETS for n in names):
        return [row for n in names for row in load_prompt_set(n, limit)]
    return load_prompts(Path(prompts), limit)


def encode(tokenizer, row: dict) -> list[int]:
    if "ids" in row:  # long-context rows come encoded (bench_context)
        return row["ids"]
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    if has_chat_template(tokenizer) and not row.get("raw", False):
        return render_chat(tokenizer, messages)
    return tokenizer.encode(row.get("prompt") or messages[-1]["content"])


def estimate_seconds(num_prompts: int, num_settings: int, runs: int, max_tokens: int, step: float) -> float:
    """A rough run time before starting: every run of every setting on every prompt (and its warm-up)
    making all ``max_tokens`` at one plain decoding step each. Rough: drafting methods and early stops
    take less, while warm-ups, prefills and loading take more than it counts."""
    return num_prompts * num_settings * (runs + 1) * max_tokens * step


def eta_seconds(elapsed: float, done: int, total: int, tail: float = 0.0) -> float:
    """Seconds left when ``done`` of ``total`` equal units of work took ``elapsed``, plus ``tail``
    seconds of work after them."""
    return elapsed / done * (total - done) + tail if done else tail


def _load_ar_draft(path: str | None, target: nn.Module, *, given: bool, dtype: str | None) -> nn.Module:
    """mlx-spec's small autoregressive draft, with one line for what it cannot use."""
    from mlx_lm.utils import load_model

    from ...loading.folders import is_drafter_config, read_config
    from ...loading.hub import local_folder, looks_like_hub_id

    if path is None:
        raise DFlashError("The mlx-spec method needs a small autoregressive draft: pass --ar-draft FOLDER.")
    if given and not path.strip():
        raise DFlashError("--ar-draft is empty: pass a small mlx-lm model's folder or Hugging Face id.")
    folder = Path(path).expanduser()
    if given and not folder.exists() and looks_like_hub_id(path):
        folder = local_folder(path, what="--ar-draft model")  # a Hugging Face id like Qwen/Qwen3-0.6B
    if not folder.is_dir():
        if not given:
            raise DFlashError(f"mlx-spec needs a small autoregressive draft, but {_missing_ar_draft(folder.parent)}.")
        raise DFlashError(
            f"--ar-draft {path} is not a folder: pass a small mlx-lm model's folder or Hugging Face id, "
            "or leave out the mlx-spec method."
        )
    config = read_config(folder, "--ar-draft model")
    if is_drafter_config(config):
        raise DFlashError(
            f"--ar-draft {path} is a DFlash drafter; mlx-spec needs a small autoregressive model with the "
            "target's tokenizer (the DFlash drafter goes to --draft)."
        )
    borrowed = config.get("dflash_borrowed", [])
    try:
        ar, _ = load_model(folder, strict=not borrowed)
    except Exception as e:  # mlx-lm raises many types for a folder that is not a model it knows
        raise DFlashError(
            f"--ar-draft {path} is not a model mlx-lm can load ({type(e).__name__}: {str(e).splitlines()[0]})."
        ) from e
    if dtype:
        ar.set_dtype(getattr(mx, dtype))
    for name in borrowed:
        _borrow(ar, target, name, path)
    return ar


def _borrow(ar: nn.Module, target: nn.Module, name: str, path: str) -> None:
    """Share the target's module ``name`` (say ``model.embed_tokens``) with the AR draft.

    A draft cut from the target and fine-tuned in its layers only leaves the embedding and final
    norm as the target's; its folder names them in ``dflash_borrowed`` instead of storing a copy.
    """
    *parents, leaf = name.split(".")
    src, dst = target, ar
    try:
        for part in parents:
            src, dst = getattr(src, part), getattr(dst, part)
        module, mine = getattr(src, leaf), getattr(dst, leaf)
    except AttributeError:
        raise DFlashError(
            f"--ar-draft {path} borrows {name} from the target, which has no such module; "
            "pass the target it was cut from."
        ) from None
    shapes = [v.shape for _, v in tree_flatten(module.parameters())]
    if shapes != [v.shape for _, v in tree_flatten(mine.parameters())]:
        raise DFlashError(
            f"--ar-draft {path} borrows {name} from the target, but the target's has other shapes; "
            "pass the target it was cut from."
        )
    setattr(dst, leaf, module)


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
    methods: tuple[str, ...] | None = None,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    lookup_fallback: int = DEFAULT_LOOKUP_FALLBACK,
    dtype: str | None = None,
    context: list[int] | None = None,
    documents: str | None = None,
    draft_window: int | None = None,
    draft_sinks: int = 4,
    kernels: str = "auto",
    progress: bool = True,
    datastore: str | None = "auto",
    tree_budget: int = DEFAULT_TREE_BUDGET,
    temp: float = 0.0,
    top_p: float = 0.0,
) -> dict:
    """Run the methods on the prompts and return ``{"meta", "times", "rows", "runs"}``.

    ``methods=None`` runs every method that applies: mlx-spec only with an AR draft to use
    (``ar_draft``, or the embedded pair's own). With ``context`` (prompt lengths in tokens),
    the prompts are ``documents`` cut to each length (:mod:`dflash_mlx.tools.bench.context`), each
    length a category of its own with its own component times (``times_by_category``).
    ``draft_window`` / ``draft_sinks``: the drafter's context window of the DFlash methods.
    ``kernels``: the Metal kernels (``"auto"``, ``"on"``, ``"off"``; :mod:`dflash_mlx.kernels`)
    of the target's quantized layers and of the DFlash loop; the results record it, and what
    each kernel's dispatcher ran (``kernel_verdicts``). ``datastore`` (``--datastore``): what
    dflash-default drafts from in its paused cycles besides prompt lookup; it learns nothing from
    the runs, so no run drafts from another's answer to the same prompt. ``tree_budget``: dflash-tree's nodes a cycle
    (its trees are as deep as the drafter's block; it runs only when named in ``methods``). ``temp`` above 0
    samples (with ``top_p``), every method with the same settings; outputs then differ by chance and are not
    compared.
    """
    from ...loading.pairs import DEFAULT_PAIR, embedded_pair_path, is_embedded_pair
    from ...loop.options import LoopOptions
    from ...models.families import family
    from ..session import Session
    from .context import context_rows, label, load_documents

    if runs < 1:
        raise DFlashError(f"--runs must be at least 1 (got {runs}).")
    if num_prompts is not None and num_prompts < 1:
        raise DFlashError(f"--num-prompts must be at least 1 (got {num_prompts}); leave it out to use every prompt.")
    # The loop's own checks of these settings, before anything is loaded.
    LoopOptions(max_tokens=max_tokens, min_confidence=min_confidence, lookup_fallback=lookup_fallback,
                draft_window=draft_window, draft_sinks=draft_sinks, kernels=kernels)  # fmt: skip
    if num_draft_tokens < 1:
        raise DFlashError(f"--num-draft-tokens must be at least 1 (got {num_draft_tokens}).")
    pair_name = (model or DEFAULT_PAIR) if is_embedded_pair(model) else None
    pair = embedded_pair_path(pair_name or DEFAULT_PAIR)
    ar_path = ar_draft if ar_draft is not None else (str(pair / "ar-draft") if pair_name else None)
    defaults = methods is None
    if methods is None:
        has_ar = ar_draft is not None or (ar_path is not None and Path(ar_path).is_dir())
        # dflash-tree runs when asked for: its row is another setting of the same drafter.
        methods = tuple(m for m in METHODS if (m != "mlx-spec" or has_ar) and m != "dflash-tree")
        if not has_ar and progress:
            why = (
                _missing_ar_draft(pair)
                if pair_name
                else "no small autoregressive draft for this target (pass --ar-draft FOLDER to include it)"
            )
            print(f"dflash-bench: mlx-spec left out: {why}", file=sys.stderr)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise DFlashError(f"Unknown method {bad[0]!r}; choose from {', '.join(METHODS)}.")
    session = Session.open(model, draft, known_draft=False, dtype=dtype, kernels=kernels)
    target, drafter, tokenizer = session.model, session.draft, session.tokenizer
    # None: what load chose (float32 on a CPU, the checkpoint's dtype on a GPU), named for the AR
    # draft, which must compute in it too, and for the results.
    dtype = dtype or dtype_name(tgt.compute_dtype(target))
    if any(m in DFLASH_METHODS for m in methods) and drafter is None:
        raise DFlashError("The dflash method needs a drafter: pass --draft.")
    if drafter is not None:
        for b in block_sizes:
            if problem := block_size_problem(b, drafter.block_size, flag="--block-sizes"):
                raise DFlashError(problem)
    ar = _load_ar_draft(ar_path, target, given=ar_draft is not None, dtype=dtype) if "mlx-spec" in methods else None
    if defaults and family(target).recurrent:
        methods = tuple(m for m in methods if m != "dflash-auto")  # auto times passes it cannot trim cheaply
    # The verify passes of every width a method may run: dflash-auto's go up to the drafter's block size.
    timed_sizes = sorted(set(block_sizes) | ({drafter.block_size} if drafter and "dflash-auto" in methods else set()))
    # The DFlash passes are timed only for a DFlash method's limit and efficiency.
    timed_drafter = drafter if any(m in DFLASH_METHODS for m in methods) else None
    window = {"draft_window": draft_window, "draft_sinks": draft_sinks}
    if context:
        limit = getattr(target.args, "max_position_embeddings", None)
        if limit and max(context) + max_tokens > limit:
            raise DFlashError(
                f"--context {label(max(context))} plus --max-tokens {max_tokens} is more than the target's "
                f"{limit}-token context; pass shorter lengths or fewer tokens."
            )
        docs = load_documents(Path(documents) if documents else pair / "long_context.jsonl")
        rows_in = context_rows(tokenizer, docs[:num_prompts] if num_prompts else docs, list(context))
    else:
        rows_in = prompt_rows(prompts or str(pair / "prompts.jsonl"), num_prompts)
    # Attention grows with the context, and more for a B-token verify than for one token: time
    # the components at the mean context of a generated token (prompt + half the new tokens).
    # They are timed before and after the runs; the faster of the two is kept.
    mean_context = max(1, round(statistics.mean(len(encode(tokenizer, row)) for row in rows_in) + max_tokens / 2))
    tic = time.perf_counter()
    first_times = (
        component_times(target, drafter, timed_sizes, context=mean_context, **window)
        if timed_drafter is not None else {}
    )  # fmt: skip
    # Each context length's own passes, once (a pass at 7k tokens is slow enough to time few times).
    times_by_category = {
        label(n): component_times(
            target, drafter, timed_sizes, context=n + max_tokens // 2, repeats=3, **window
        )  # fmt: skip
        for n in (context or [])
        if timed_drafter is not None
    }
    timing_seconds = time.perf_counter() - tic  # the component times are taken again at the end

    def sizes(m: str) -> tuple[int, ...]:
        # dflash-auto picks each cycle's width up to the drafter's block size; dflash-default runs at it.
        if m in ("dflash-auto", "dflash-default", "dflash-tree"):
            return (drafter.block_size,)
        return block_sizes if m in (*DFLASH_METHODS, "lookup") else (1,)

    plan = [(m, b) for m in methods for b in sizes(m)]
    if progress:
        step = first_times.get("ar") or component_times(target, None, [1], context=mean_context, repeats=3)["ar"]
        seconds = estimate_seconds(len(rows_in), len(plan), runs, max_tokens, step) + timing_seconds
        print(
            f"Estimated run time: about {seconds:.0f} s ({len(rows_in)} prompts x {len(plan)} method/block "
            f"settings x ({runs} runs + a warm-up) x up to {max_tokens} tokens at a measured "
            f"{1e3 * step:.1f} ms plain step, and {timing_seconds:.0f} s of component timing)",
            file=sys.stderr,
        )
    store = session.open_datastore(datastore, learns=False) if "dflash-default" in methods else None
    runners = {
        (m, b): make_runner(m, target, drafter, ar, tokenizer, b, num_draft_tokens, max_tokens,
                            min_confidence, lookup_fallback, **window, kernels=kernels, datastore=store,
                            tree_budget=tree_budget, temp=temp, top_p=top_p)
        for m, b in plan
    }  # fmt: skip
    results, total, done, start = [], len(plan) * len(rows_in) * runs, 0, time.perf_counter()
    # The ETA counts the warm-ups as runs too (each prompt's come first) and the component timing
    # the end repeats: counted from timed runs alone, the first ETA was twice the estimate.
    units = len(plan) * len(rows_in) * (runs + 1)
    warmed = 0
    mismatches = []
    for i, row in enumerate(rows_in):
        ids = encode(tokenizer, row)
        for runner in runners.values():
            runner(ids)  # warm-up
            warmed += 1
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
                    eta = eta_seconds(time.perf_counter() - start, done + warmed, units, timing_seconds)
                    print(
                        f"\r[{done}/{total}] prompt {i + 1}, run {r + 1}: {key[0]} B={key[1]}, ETA {eta:.0f}s   ",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
        for method, b in plan:
            out, gen_s, first_s, accept, sizes, sources = median_run(samples[(method, b)])
            # Losslessness check: every method must emit the first method's tokens.
            if temp == 0 and out != samples[plan[0]][0][0]:
                mismatches.append(f"{method} B={b} prompt {i}")
            results.append(
                RunResult(
                    method,
                    b,
                    i,
                    row.get("category", "all"),
                    len(out),
                    max(len(out) - 1, 0) / gen_s if gen_s > 0 else 0.0,
                    len(ids) / first_s if first_s > 0 else 0.0,
                    accept,
                    peaks[(method, b)],
                    out,
                    sizes,
                    sources,
                )
            )
    if progress:
        print(file=sys.stderr)
    times = (
        component_times(target, drafter, timed_sizes, context=mean_context, **window)
        if timed_drafter is not None else {}
    )  # fmt: skip
    times = fastest_times(first_times, times)
    categories = list(dict.fromkeys(r.category for r in results)) if context else sorted({r.category for r in results})
    by_category = {
        c: summarize([r for r in results if r.category == c], times_by_category.get(c, times)) for c in categories
    }
    return {
        "meta": {
            **stamp(),
            "max_tokens": max_tokens,
            "runs": runs,
            "prompts": len(rows_in),
            "dtype": dtype,
            "model": f"{pair_name} (embedded)" if pair_name else model,
            "draft": draft or (f"{pair_name} drafter (embedded)" if pair_name else None),
            "draft_family": getattr(drafter, "family", None),
            "ar_draft": (ar_draft if ar_draft is not None else f"{pair_name} ar-draft (embedded)")
            if "mlx-spec" in methods
            else None,
            "prompt_set": (documents or f"{pair_name or DEFAULT_PAIR} long-context documents (embedded)")
            if context
            else prompts or f"{pair_name or DEFAULT_PAIR} held-out prompts (embedded)",
            "min_confidence": min_confidence,
            "lookup_fallback": lookup_fallback,
            "datastore": None
            if store is None
            else (f"{len(store.fixed):,} tokens" if store.fixed is not None else "empty"),
            "tree_budget": tree_budget if "dflash-tree" in methods else None,
            "temp": temp,
            "top_p": top_p,
            "context": [label(n) for n in context] if context else None,
            **window,
            "kernels": kernels,
            "kernel_verdicts": kernel_verdicts(),
        },
        "times": times,
        "times_by_category": times_by_category,
        "rows": summarize(results, times),
        "mismatches": mismatches,
        "by_category": by_category if len(categories) > 1 else {},
        "runs": [asdict(r) for r in results],
    }


def kernel_verdicts() -> list[dict]:
    """What each Metal kernel's dispatcher decided in this process, per shape class (none off Metal)."""
    from ...kernels import DISPATCHERS

    rows = []
    for d in DISPATCHERS:
        rows += [{"kernel": d.name, "shape": shape, **asdict(v)} for shape, v in d.verdicts.items()]
        rows += [{"kernel": d.name, "shape": shape, "enabled": True, "reason": "forced (kernels on); matches its twin",
                  "kernel_s": None, "twin_s": None} for shape in sorted(d.forced)]  # fmt: skip
    return rows


def _lengths(spec: str) -> list[int]:
    try:
        return parse_lengths(spec)
    except DFlashError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def setup_arg_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dflash-bench", description="Benchmark DFlash against its alternatives.")
    p.add_argument(
        "--model",
        default=None,
        help="Target: a local folder, or dflash-tiny for the toy pair (default: the default pair, "
        "SmolLM2-135M-Instruct, also named smollm2).",
    )
    p.add_argument("--draft", default=None, help="DFlash drafter (default: the pair's own).")
    p.add_argument(
        "--ar-draft",
        default=None,
        help="Folder of a small autoregressive mlx-lm model with the target's tokenizer, for mlx-lm "
        "speculative decoding (default: the embedded pair's ar-draft).",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL prompts, or prompt sets from the hub: gsm8k, math500, humaneval, mbpp, mt-bench "
        "(comma-separated). Default: the embedded pair's held-out prompts.",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="Use only the first N prompts (with --context: the first N documents).",
    )
    p.add_argument(
        "--context",
        type=_lengths,
        default=None,
        metavar="LENGTHS",
        help="Long-context mode: prompts of these lengths in tokens (e.g. 1k,2k,4k,7k; k = 1024), each a "
        "document cut to fit and a question after it, with tau, speedup, prefill tok/s, peak memory and "
        "the passes' times per length.",
    )
    p.add_argument(
        "--documents",
        default=None,
        help="JSONL documents for --context ('document', 'question'; default: the embedded pair's).",
    )
    add_window_arguments(p)
    p.add_argument(
        "--max-tokens",
        type=int,
        action=InRange,
        low=1,
        default=128,
        help="Most tokens per prompt and run (default: 128).",
    )
    p.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        action=InRange,
        low=1,
        default=[4, 8, 16],
        help="Block sizes for the DFlash and lookup methods, each 1 to the drafter's (default: 4 8 16).",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        action=InRange,
        low=1,
        default=3,
        help="Draft tokens per cycle for mlx-lm speculative decoding (default: 3).",
    )
    p.add_argument(
        "--runs",
        type=int,
        action=InRange,
        low=1,
        default=3,
        help="Timed runs per measurement, after one warm-up; the median is reported (default: 3).",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=None,
        metavar="METHOD",
        help=f"Methods to run, of {', '.join(METHODS)} (default: all but dflash-tree, which runs when named; "
        "mlx-spec only with an AR draft: --ar-draft, or the embedded pair's).",
    )
    p.add_argument(
        "--min-confidence",
        type=float,
        action=InRange,
        low=0.0,
        high=1.0,
        default=DEFAULT_MIN_CONFIDENCE,
        help="dflash-cut: verify only the drafts the drafter gives at least this probability "
        f"(default: {DEFAULT_MIN_CONFIDENCE:g}; 0 cuts nothing).",
    )
    p.add_argument(
        "--lookup-fallback",
        type=int,
        action=InRange,
        low=0,
        default=DEFAULT_LOOKUP_FALLBACK,
        help="dflash-fallback: the most prompt-lookup cycles after the drafter misses its first draft "
        f"(default: {DEFAULT_LOOKUP_FALLBACK}; 0 never falls back).",
    )
    p.add_argument(
        "--datastore",
        default="auto",
        metavar="auto|none|FILE",
        help="dflash-default's datastore, as dflash-generate's --datastore (default: auto, the default "
        "pair's shipped answers); it learns nothing from the benchmark's own replies.",
    )
    p.add_argument(
        "--tree-budget",
        type=int,
        action=InRange,
        low=1,
        default=DEFAULT_TREE_BUDGET,
        help=f"dflash-tree: the most draft tree nodes a cycle (default: {DEFAULT_TREE_BUDGET}).",
    )
    p.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="Sample at this temperature, every method alike (default: 0, greedy, where every method's "
        "tokens are checked against the first's).",
    )
    p.add_argument("--top-p", type=float, default=0.0, help="Top-p when sampling (default: 0, off).")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="Compute dtype of the models (default: the one dflash-generate uses: float32 on a CPU, "
        "where greedy output is the same for every method, as the benchmark checks; the checkpoint's "
        "on a GPU, what users run there).",
    )
    add_blas_argument(p)
    add_kernels_argument(p)
    p.add_argument(
        "--scaling",
        nargs="+",
        default=None,
        metavar="SHAPE",
        help="Scaling mode on random-weight targets of these shapes (qwen3-0.6b, qwen3-1.7b).",
    )
    p.add_argument("--replay", default=None, help="Results JSON of a normal run whose acceptance --scaling replays.")
    p.add_argument(
        "--base-url",
        default=None,
        help="Measure an OpenAI-compatible server instead (dflash-serve, vLLM, SGLang), e.g. "
        "http://host:8000/v1: requests/min, tok/s and tau per --concurrency; --model names its model.",
    )
    p.add_argument("--api-key", default=None, help="The server's API key (with --base-url).")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        action=InRange,
        low=1,
        default=[1, 4, 8],
        help="With --base-url: clients sending at once, one level after another (default: 1 4 8).",
    )
    p.add_argument(
        "--join-tokens",
        type=int,
        action=InRange,
        low=1,
        default=None,
        help="With --base-url: per level, also send a chat prompt of about this many tokens once every client "
        "streams, and report the longest gap it leaves in their streams (e.g. 3000).",
    )
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
    if plots_dir is not None and importlib.util.find_spec("matplotlib") is None:
        # matplotlib comes only with the [bench] extra: say so before the run, not in a traceback after it.
        raise DFlashError(
            f"--plots {plots_dir} needs matplotlib, which is not installed; "
            "run pip install 'mlx-dflash[bench]' or leave out --plots."
        )


def main(argv: list[str] | None = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.runs < 1:
        parser.error("--max-tokens and --runs must be at least 1.")
    try:
        _check_outputs(args.json, args.markdown, args.plots)
        if args.scaling:
            return _scaling_main(args)
        if args.base_url:
            return _remote_main(args)
        result = run_benchmark(
            model=args.model,
            draft=args.draft,
            ar_draft=args.ar_draft,
            prompts=args.prompts,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            block_sizes=tuple(args.block_sizes),
            num_draft_tokens=args.num_draft_tokens,
            runs=args.runs,
            methods=tuple(args.methods) if args.methods else None,
            min_confidence=args.min_confidence,
            lookup_fallback=args.lookup_fallback,
            dtype=args.dtype,
            context=args.context,
            documents=args.documents,
            draft_window=args.draft_window,
            draft_sinks=args.draft_sinks,
            kernels=args.kernels,
            datastore=args.datastore,
            tree_budget=args.tree_budget,
            temp=args.temp,
            top_p=args.top_p,
        )
    except DFlashError as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        sys.exit(1)
    table = markdown(result["rows"], result["meta"], result["times"])
    if result["mismatches"]:
        table += (
            "\nOutputs that differ from the first method's (not lossless): " + ", ".join(result["mismatches"]) + "\n"
        )
    for category, rows in result["by_category"].items():
        own = result["times_by_category"].get(category, {})
        table += f"\n### {category}\n\n" + "\n".join(markdown(rows, result["meta"], own).splitlines()[2:]) + "\n"
    print(table)
    if args.markdown:
        write_text_atomic(args.markdown, table)
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1))
    if args.plots:
        for path in plots(result["rows"], Path(args.plots), result["meta"]):
            print(f"wrote {path}")


def _join_row(tokens: int) -> dict:
    # The default pair's first long document (the standard library's source), as a chat prompt of that size.
    from ...loading.pairs import default_pair_path
    from .server_load import join_row

    document = json.loads((default_pair_path() / "long_context.jsonl").read_text().splitlines()[0])["document"]
    return join_row(document, tokens)


def _remote_main(args) -> None:
    from ...loading.pairs import default_pair_path
    from .server_load import load_markdown, run_load

    if any(n < 1 for n in args.concurrency):
        raise DFlashError(f"--concurrency levels must be at least 1 (got {args.concurrency}).")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise DFlashError(
            f"--num-prompts must be at least 1 (got {args.num_prompts}); leave it out to use every prompt."
        )
    rows = prompt_rows(args.prompts or str(default_pair_path() / "prompts.jsonl"), args.num_prompts)
    result = run_load(
        args.base_url,
        rows,
        api_key=args.api_key,
        model=args.model,
        concurrency=tuple(args.concurrency),
        max_tokens=args.max_tokens,
        join=_join_row(args.join_tokens) if args.join_tokens else None,
    )
    result["meta"] = stamp()
    table = load_markdown(result)
    print(table)
    if args.markdown:
        write_text_atomic(args.markdown, table)
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1))


def _scaling_main(args) -> None:
    from .scaling import SHAPES, measure_shape, scaling_markdown

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
        write_text_atomic(args.markdown, table)
    if args.json:
        write_text_atomic(args.json, json.dumps({"meta": meta, "scaling": rows}, indent=1))


if __name__ == "__main__":
    main()
