"""Fast greedy responses of the target for drafter training, in the cache format of dflash-train.

dflash-train's own data step (``dflash_mlx.tools.train.batch_decode``, one process) in several worker
processes, with mlx-lm's own model (float32, ``mlx_lm.load``):

* Prompts are taken in file order in windows of ``4 * batch`` prompts, sorted by length inside
  a window (so the answered set stays close to a prefix of the file) and cut into groups.
* Each worker keeps ``--batch-size`` decode rows (slots). Free slots are refilled once
  ``--group`` of them are free: the new prompts are prefilled together (mlx-lm's
  ``BatchKVCache``, left-padded, all but the last prompt token, as ``generate_step`` does) and
  their keys/values are written into the free slots of the running batch (``SlotBatch``); the
  last prompt token is the row's next decode input. Nothing else is copied: no per-row
  filter/extend of the whole cache as mlx-lm's ``BatchGenerator`` does.
* One decode step runs all rows (one token each, greedy argmax of the float32 logits); the next
  step is queued (``mx.async_eval``) before the current tokens are read.
* ``--workers`` spawned processes (default 2, each ``--threads`` OpenBLAS threads, default 1)
  decode side by side: MLX runs its non-BLAS CPU ops on one thread, so two single-threaded
  workers use both cores for everything. The parent renders prompts, hands out groups and is
  the only writer of the cache.

The cache line is exactly dflash-train's: ``{"key", "prompt_ids", "response_ids",
"finish_reason"}`` with the key of ``dflash_mlx.tools.train.data.prompt_key``; the stop token is kept in the response,
``finish_reason`` is ``stop`` when the response ends with an EOS id, else ``length``. Lines are
appended and flushed one by one (a kill loses only unfinished responses); a rerun skips keys
already cached and ignores a torn last line. ``--minutes``: no new prompts after that time,
running rows finish. Exit code 10: nothing left to answer.

Run with OpenBLAS preloaded (MLX's Linux wheel links a slow reference BLAS):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    .venv/bin/python recipes/rebuild/smollm2_responses.py --model runs/smollm2/target \\
        --prompts assets/smollm2/data/prompts_train.jsonl --cache runs/smollm2/data/responses.jsonl \\
        --batch-size 128 --minutes 20
"""

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/smollm2/target", help="mlx-lm model folder (float32).")
    p.add_argument("--prompts", nargs="+", required=True, help="Prompt JSONL file(s), read in order.")
    p.add_argument("--cache", required=True, help="Response cache (JSONL), appended to.")
    p.add_argument("--batch-size", type=int, default=64, help="Rows decoded together per worker.")
    p.add_argument(
        "--group",
        type=int,
        default=8,
        help="Free rows are refilled once this many are free, with prompts prefilled together.",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="Most new tokens per response.")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="Longer prompts are skipped (as dflash-train does)."
    )
    p.add_argument("--minutes", type=float, default=None, help="Hand out no new work after this many minutes.")
    p.add_argument("--limit", type=int, default=None, help="Answer at most this many new prompts.")
    p.add_argument("--workers", type=int, default=2, help="Decoding processes.")
    p.add_argument("--threads", type=int, default=1, help="OpenBLAS threads per worker.")
    p.add_argument(
        "--coretype",
        default="SkylakeX",
        help="OPENBLAS_CORETYPE of the workers (AVX-512 SkylakeX kernels measured faster than the Haswell default "
        "on this EPYC); '' keeps the environment's.",
    )
    p.add_argument("--report-every", type=int, default=64, help="Print throughput every this many responses.")
    p.add_argument(
        "--tick-steps", type=int, default=0, help="Print each worker's decode rate every this many steps (0: off)."
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- worker


def worker_main(wid, args, task_q, result_q, stop_event):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from mlx_lm import load

    from dflash_mlx.tools.train.batch_decode import decode_slots

    model, tokenizer = load(args.model)
    eos = frozenset(tokenizer.eos_token_ids)

    spill = []  # items of a group taken but not yet used

    def take_group(n):
        while len(spill) < n and not stop_event.is_set():
            try:
                g = task_q.get(timeout=1)
            except queue.Empty:
                break
            if g is None:  # end of work
                break
            spill.extend(g)
        taken = spill[:n]
        del spill[:n]
        return taken

    tick = {"steps": 0, "tokens": 0, "rows": 0, "t": time.perf_counter(), "cpu": time.process_time()}

    def on_step(useful, rows):
        tick["steps"] += 1
        tick["tokens"] += useful
        tick["rows"] += rows
        if tick["steps"] == args.tick_steps:
            now, now_cpu = time.perf_counter(), time.process_time()
            result_q.put(
                ("tick", wid, tick["steps"], tick["tokens"], tick["rows"], now - tick["t"], now_cpu - tick["cpu"])
            )
            tick.update(steps=0, tokens=0, rows=0, t=now, cpu=now_cpu)

    tic, cpu, tokens, n = time.perf_counter(), time.process_time(), 0, 0
    for (key, prompt_ids), response, finish in decode_slots(
        model,
        take_group,
        batch_size=args.batch_size,
        group=args.group,
        max_tokens=args.max_tokens,
        eos=eos,
        on_step=on_step if args.tick_steps else None,
    ):
        result_q.put(("resp", key, prompt_ids, response, finish))
        tokens += len(response)
        n += 1
    result_q.put(("exit", wid, n, tokens, time.perf_counter() - tic, time.process_time() - cpu))


# ----------------------------------------------------------------------------------------- parent


def load_todo(args):
    from mlx_lm.utils import load_tokenizer

    from dflash_mlx.tools.train.data import prompt_key, read_cache, read_prompts, render_prompt

    tokenizer = load_tokenizer(Path(args.model))
    done = {ex["key"] for ex in read_cache(args.cache)}
    n_cached = len(done)
    todo = []
    for path in args.prompts:
        for prompt in read_prompts(path):
            ids = render_prompt(tokenizer, prompt)
            key = prompt_key(ids)
            if key not in done and len(ids) <= args.max_prompt_tokens:
                done.add(key)
                todo.append((key, ids))
    if args.limit is not None:
        todo = todo[: args.limit]
    return todo, n_cached


def make_groups(todo, batch_size, group):
    """Windows of 4 * batch prompts in file order, length-sorted inside, cut into groups."""
    window = 4 * batch_size
    groups = []
    for w in range(0, len(todo), window):
        part = sorted(todo[w : w + window], key=lambda it: len(it[1]))
        groups += [part[i : i + group] for i in range(0, len(part), group)]
    return groups


def main(argv=None):
    args = parse_args(argv)
    args.group = min(args.group, args.batch_size)
    if "openblas" not in os.environ.get("LD_PRELOAD", ""):
        print("warning: OpenBLAS is not preloaded; MLX will use its slow reference BLAS", file=sys.stderr)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # inherited by the spawned workers
    if args.coretype:
        os.environ["OPENBLAS_CORETYPE"] = args.coretype  # read by the workers' preloaded OpenBLAS at exec

    todo, n_cached = load_todo(args)
    groups = make_groups(todo, args.batch_size, args.group)
    print(
        f"gen: {n_cached} cached, {len(todo)} to answer in {len(groups)} groups of <= {args.group}; "
        f"batch {args.batch_size}, {args.workers} workers x {args.threads} BLAS threads "
        f"(OPENBLAS_CORETYPE {os.environ.get('OPENBLAS_CORETYPE', 'auto')}), "
        f"max tokens {args.max_tokens}, minutes {args.minutes}",
        flush=True,
    )
    if not todo:
        sys.exit(10)  # nothing left to answer (run_loop.sh stops on this code)

    context = mp.get_context("spawn")
    task_q, result_q, stop_event = context.Queue(), context.Queue(), context.Event()
    for g in groups:
        task_q.put(g)
    for _ in range(args.workers):
        task_q.put(None)
    workers = [
        context.Process(target=worker_main, args=(w, args, task_q, result_q, stop_event), daemon=True)
        for w in range(args.workers)
    ]

    def on_term(signum, frame):
        for p in workers:
            if p.is_alive():
                p.terminate()
        os._exit(128 + signum)  # lines are flushed one by one; skip the queue feeder's flush

    signal.signal(signal.SIGTERM, on_term)
    for p in workers:
        p.start()

    cache_path = Path(args.cache)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    n_new = tokens = stops = 0
    cpu_total, batch_tokens = 0.0, 0
    last_t, last_tokens = tic, 0
    alive = args.workers
    with open(cache_path, "a") as f:
        if f.tell() > 0 and not cache_path.read_bytes().endswith(b"\n"):
            f.write("\n")  # end a line torn by an interrupted run
            f.flush()
        while alive:
            if args.minutes is not None and not stop_event.is_set() and time.perf_counter() - tic > 60 * args.minutes:
                stop_event.set()
                print(f"gen: {args.minutes} min reached, finishing the running batches", flush=True)
            try:
                msg = result_q.get(timeout=5)
            except queue.Empty:
                if not any(p.is_alive() for p in workers):
                    break
                continue
            kind = msg[0]
            if kind == "resp":
                _, key, prompt_ids, response, finish = msg
                ex = {"key": key, "prompt_ids": prompt_ids, "response_ids": response, "finish_reason": finish}
                f.write(json.dumps(ex) + "\n")
                f.flush()
                n_new += 1
                tokens += len(response)
                stops += finish == "stop"
                if n_new % args.report_every == 0:
                    now = time.perf_counter()
                    print(
                        f"gen: {n_cached + n_new} cached (+{n_new}), {tokens} new tokens; "
                        f"last {args.report_every}: {(tokens - last_tokens) / (now - last_t):.1f} tok/s; "
                        f"overall {tokens / (now - tic):.1f} tok/s; {(now - tic) / 60:.1f} min; "
                        f"load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
                    last_t, last_tokens = now, tokens
            elif kind == "tick":
                _, wid, steps, t, rows, secs, cpu = msg
                print(
                    f"tick: worker {wid} {steps} steps, mean rows {rows / steps:.1f}, {t} tokens in {secs:.1f} s = "
                    f"{t / secs:.1f} tok/s, {t / max(cpu, 1e-9):.1f} tok per CPU-s; load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
            elif kind in ("batch", "exit"):
                _, wid, n, t, secs, cpu = msg
                cpu_total += cpu
                batch_tokens += t
                if n:
                    print(
                        f"gen: worker {wid} batch: {n} responses, {t} tokens in {secs:.0f} s = "
                        f"{t / secs:.1f} tok/s (this worker), {t / max(cpu, 1e-9):.1f} tok per CPU-s; "
                        f"load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
                if kind == "exit":
                    alive -= 1
    for p in workers:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
    task_q.cancel_join_thread()  # groups never handed out must not block the exit
    wall = time.perf_counter() - tic
    print(
        f"gen: done: +{n_new} responses ({stops} stop, {n_new - stops} length), {tokens} tokens in "
        f"{wall:.0f} s = {tokens / max(wall, 1e-9):.1f} tok/s overall (from start, incl. model load); "
        f"{n_cached + n_new} cached; workers' CPU {cpu_total:.0f} s = {batch_tokens / max(cpu_total, 1e-9):.1f} tok per "
        f"CPU-s (batches only, model load excluded); load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
