"""dflash-bench --base-url: the load a server takes, measured at the client.

For each concurrency level N, N client threads send the prompts (streaming chat or text
completions) until all are answered, and we report requests per minute, aggregate and
per-request tok/s, time to first token, per-request latency (p50 and p95) and tau. With a join
prompt (``--join-tokens``: a long document as a chat prompt), each level then also has N clients
stream one reply each while that prompt joins once all of them are streaming, and reports the
running streams' longest gap between two chunks from the moment the long prompt is sent until its
first token is out (the time a long prompt freezes the others), and that prompt's time to first token. Tau is pooled over the drafting cycles of what
each response reports (``AcceptanceStats``; see ``dflash_mlx.tools.client``), and also taken
from the change in the server's spec-decode counters over the whole level when it exposes them
(vLLM, dflash-serve), so a Mac running dflash-serve and a cluster running vLLM or SGLang are
measured the same way.
"""

import threading
import time
from dataclasses import dataclass, field

from ...text.responses import AcceptanceStats
from ..client import DFLASH_ACCEPTED, DFLASH_DRAFTS, VLLM_ACCEPTED, VLLM_DRAFTS, RemoteClient


@dataclass
class RequestResult:
    tokens: int
    seconds: float
    ttft: float
    acceptance: AcceptanceStats  # as the responses counted it (no cycles: the server gave no tau)
    times: list[float] = field(default_factory=list)  # when each chunk with text arrived
    text: str = ""


def _one(client: RemoteClient, row: dict, max_tokens: int, temperature: float,
         started: threading.Event | None = None) -> RequestResult:  # fmt: skip
    tic = time.perf_counter()
    first, tokens, acceptance, times, text = None, 0, AcceptanceStats(), [], []
    params = {"max_tokens": max_tokens, "temperature": temperature}
    if row.get("raw") and "prompt" in row:
        responses = client.stream_completion(row["prompt"], **params)
    else:
        responses = client.stream_chat(row.get("messages") or [{"role": "user", "content": row["prompt"]}], **params)
    for r in responses:
        if r.text:
            text.append(r.text)
            times.append(time.perf_counter())
            if first is None:
                first = times[-1]
                if started is not None:
                    started.set()
        tokens = r.generation_tokens
        if r.cycle > 0:
            acceptance = AcceptanceStats.from_totals(r.mean_acceptance_length, r.drafting_cycles, r.plain_cycles)
    end = time.perf_counter()
    return RequestResult(tokens, end - tic, (first or end) - tic, acceptance, times, "".join(text))


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; 0 for none."""
    if not values:
        return 0.0
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def join_row(document: str, tokens: int) -> dict:
    """A chat prompt of about ``tokens`` tokens (four characters a token) from ``document``."""
    text = (document * (1 + 4 * tokens // max(len(document), 1)))[: 4 * tokens]
    return {"messages": [{"role": "user", "content": f"Summarize this document:\n\n{text}"}]}


def run_join(client: RemoteClient, rows: list[dict], concurrency: int, max_tokens: int, join: dict,
             temperature: float = 0.0) -> dict:  # fmt: skip
    """``concurrency`` clients stream one reply each; once all are streaming, ``join`` is sent. Returns the
    running streams' longest gap between chunks while it is prefilled, and its time to first token."""
    started = [threading.Event() for _ in range(concurrency)]
    results: list[RequestResult | None] = [None] * concurrency

    def stream(i):
        results[i] = _one(client, rows[i % len(rows)], max_tokens, temperature, started[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(timeout=600)
    sent = time.perf_counter()
    joined = _one(client, join, 4, temperature)
    first = sent + joined.ttft
    for t in threads:
        t.join()
    gap = 0.0
    for r in results:
        if r is None:
            continue
        for a, b in zip(r.times, r.times[1:]):
            if b > sent and a < first:  # a gap that overlaps the join's prefill
                gap = max(gap, b - a)
    return {"join_gap_s": gap, "join_ttft_s": joined.ttft}


def _counters(client: RemoteClient) -> tuple[float, float] | None:
    values = client.scrape()
    if not values:
        return None
    for drafts, accepted in ((VLLM_DRAFTS, VLLM_ACCEPTED), (DFLASH_DRAFTS, DFLASH_ACCEPTED)):
        if drafts in values:
            return values[drafts], values.get(accepted, 0.0)
    return None


def run_level(
    client: RemoteClient, rows: list[dict], concurrency: int, max_tokens: int, temperature: float = 0.0
) -> dict:
    """Send every row once with ``concurrency`` clients; the numbers of that level."""
    pending = list(enumerate(rows))
    results: list[RequestResult] = []
    texts: list[str | None] = [None] * len(rows)
    errors: list[str] = []
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                i, row = pending.pop(0)
            try:
                result = _one(client, row, max_tokens, temperature)
            except Exception as e:  # a failed request is reported, not fatal to the level
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                results.append(result)
                texts[i] = result.text

    before = _counters(client)
    tic = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    after = _counters(client)
    tokens = sum(r.tokens for r in results)
    pooled = AcceptanceStats()
    for r in results:
        pooled.merge(r.acceptance)
    counter_tau = None
    if before and after and after[0] > before[0]:
        counter_tau = 1 + (after[1] - before[1]) / (after[0] - before[0])
    n = len(results)
    return {
        "concurrency": concurrency,
        "requests": n,
        "errors": errors,
        "wall_s": wall,
        "requests_per_min": 60 * n / wall if wall > 0 else 0.0,
        "tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "tok_s_per_request": sum(r.tokens / r.seconds for r in results) / n if n else 0.0,
        "ttft_s": sum(r.ttft for r in results) / n if n else 0.0,
        "latency_p50_s": _percentile([r.seconds for r in results], 0.5),
        "latency_p95_s": _percentile([r.seconds for r in results], 0.95),
        "tau": pooled.tau if pooled.drafting_cycles else None,
        "drafting_cycles": pooled.drafting_cycles,
        "plain_cycles": pooled.plain_cycles,
        "tau_counters": counter_tau,
        "texts": texts,  # each row's reply (None: it failed), in the order of ``rows``
    }


def run_load(
    base_url: str,
    rows: list[dict],
    *,
    api_key: str | None = None,
    model: str | None = None,
    concurrency: tuple[int, ...] = (1, 4, 8),
    max_tokens: int = 128,
    temperature: float = 0.0,
    join: dict | None = None,
) -> dict:
    """Warm the server with one request, then measure each concurrency level in turn (and with ``join``, a
    long chat prompt, the gap it leaves in the running streams: :func:`run_join`).

    Raises:
        DFlashError: When the server cannot be reached or lacks the model.
    """
    # Counters are read around each level, not around each request (other requests overlap).
    client = RemoteClient(base_url, api_key=api_key, model=model, counter_deltas=False)
    info = client.server_info()
    _one(client, rows[0], min(max_tokens, 8), temperature)
    levels = []
    for n in concurrency:
        level = run_level(client, rows, n, max_tokens, temperature)
        if join is not None:
            level.update(run_join(client, rows, n, max_tokens, join, temperature))
        levels.append(level)
    return {
        "server": info.describe(),
        "kind": info.kind,
        "model": info.model,
        "tau_reason": info.tau_reason,
        "max_tokens": max_tokens,
        "prompts": len(rows),
        "levels": levels,
    }


def load_markdown(result: dict) -> str:
    def tau(level):
        if level["tau"] is not None:
            return f"{level['tau']:.2f}"
        if level["tau_counters"] is not None:
            return f"{level['tau_counters']:.2f} (counters)"
        return "n/a"

    lines = [
        f"Server: {result['server']}; {result['prompts']} prompts, max {result['max_tokens']} tokens each.",
        "",
        "| clients | requests | wall s | requests/min | tok/s (all) | tok/s per request | TTFT s "
        "| latency p50 / p95 s | longest gap while a long prompt joins s (its TTFT) | tau |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        join = f"{lv['join_gap_s']:.2f} ({lv['join_ttft_s']:.1f})" if "join_gap_s" in lv else "-"
        lines.append(
            f"| {lv['concurrency']} | {lv['requests']} | {lv['wall_s']:.1f} | {lv['requests_per_min']:.1f} "
            f"| {lv['tok_s']:.1f} | {lv['tok_s_per_request']:.1f} | {lv['ttft_s']:.2f} "
            f"| {lv.get('latency_p50_s', 0.0):.1f} / {lv.get('latency_p95_s', 0.0):.1f} | {join} | {tau(lv)} |"
        )
        if lv["errors"]:
            lines.append(f"| | {len(lv['errors'])} failed: {lv['errors'][0]} | | | | | | | | |")
    if all(lv["tau"] is None and lv["tau_counters"] is None for lv in result["levels"]) and result["tau_reason"]:
        lines.append(f"\ntau n/a: {result['tau_reason']}")
    return "\n".join(lines) + "\n"
