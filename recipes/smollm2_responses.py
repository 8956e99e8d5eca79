"""Fast greedy responses of the target for drafter training, in the cache format of dflash-train.

Continuous batched greedy decoding with mlx-lm's own model (float32, ``mlx_lm.load``):

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
"finish_reason"}`` with the key of ``train_data._key``; the stop token is kept in the response,
``finish_reason`` is ``stop`` when the response ends with an EOS id, else ``length``. Lines are
appended and flushed one by one (a kill loses only unfinished responses); a rerun skips keys
already cached and ignores a torn last line. ``--minutes``: no new prompts after that time,
running rows finish. Exit code 10: nothing left to answer.

Run with OpenBLAS preloaded (MLX's Linux wheel links a slow reference BLAS):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    .venv/bin/python recipes/smollm2_responses.py --model runs/smollm2/target \\
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
    p.add_argument("--group", type=int, default=8, help="Free rows are refilled once this many are free, with prompts prefilled together.")
    p.add_argument("--max-tokens", type=int, default=256, help="Most new tokens per response.")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="Longer prompts are skipped (as dflash-train does).")
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
    p.add_argument("--tick-steps", type=int, default=0, help="Print each worker's decode rate every this many steps (0: off).")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- worker


class _SlotLayer:
    """One layer's KV cache of a :class:`SlotBatch`, with the interface mlx-lm's llama uses."""

    def __init__(self, batch):
        self.batch = batch
        self.keys = self.values = None

    @property
    def offset(self):  # per-row RoPE position of the token being decoded
        return self.batch.offset

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        assert N == 1 and window_size is None
        return self.batch.mask

    def update_and_fetch(self, keys, values):
        b = self.batch
        self.keys[..., b.idx : b.idx + 1, :] = keys
        self.values[..., b.idx : b.idx + 1, :] = values
        return self.keys[..., b.start : b.idx + 1, :], self.values[..., b.start : b.idx + 1, :]

    @property
    def state(self):
        return self.keys, self.values


class SlotBatch:
    """A fixed set of ``B`` decode rows sharing one write column, refilled in place.

    Like mlx-lm's ``BatchKVCache`` the rows are right-aligned: every step writes column
    ``idx`` of every row and row ``b`` holds valid keys from column ``lp[b]`` on (the mask
    hides the rest). A finished row's slot is reused by writing a new prompt's prefilled keys
    into it, ending at ``idx``; nothing else is copied. Attention reads the window
    ``[start, idx]``, ``start`` the oldest live row's first column. When the buffer is full,
    the window is copied to the front of a new one (once every ``step`` decode steps).
    """

    step = 256

    def __init__(self, model, batch_size):
        import numpy as np

        self.B = batch_size
        self.layers = [_SlotLayer(self) for _ in model.layers]
        self.idx = self.start = self.cap = 0
        self.lp = np.zeros(batch_size, np.int64)
        self.live = np.zeros(batch_size, bool)
        self.offset = self.mask = None

    def _compact(self, extra_left=0):
        import mlx.core as mx

        width = self.idx - self.start
        new_cap = extra_left + width + self.step
        for layer in self.layers:
            k, v = layer.keys, layer.values
            shape = (self.B, self.kv_heads, new_cap, self.head_dim)
            nk, nv = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
            if k is not None and width > 0:
                nk[..., extra_left : extra_left + width, :] = k[..., self.start : self.idx, :]
                nv[..., extra_left : extra_left + width, :] = v[..., self.start : self.idx, :]
            layer.keys, layer.values = nk, nv
        shift = self.start - extra_left
        self.lp -= shift
        self.idx, self.start, self.cap = extra_left + width, extra_left, new_cap
        mx.eval([layer.state for layer in self.layers])

    def insert(self, slots, group_cache, group_pad, width):
        """Put a prefilled group (a BatchKVCache per layer, ``width`` columns) into ``slots``."""
        import mlx.core as mx

        k0 = group_cache[0].keys
        self.kv_heads, self.head_dim, self.dtype = k0.shape[1], k0.shape[3], k0.dtype
        if self.layers[0].keys is None or self.idx < width:
            self._compact(extra_left=max(0, width - (self.idx - self.start)))
        c0 = self.idx - width
        index = mx.array(slots)
        for layer, src in zip(self.layers, group_cache):
            layer.keys[index, :, c0 : self.idx, :] = src.keys[..., :width, :]
            layer.values[index, :, c0 : self.idx, :] = src.values[..., :width, :]
        self.lp[slots] = c0 + group_pad
        self.live[slots] = True
        self.start = min(self.start, c0)

    def prepare_step(self):
        import mlx.core as mx
        import numpy as np

        if self.idx + 1 > self.cap:
            self._compact()
        self.start = int(self.lp[self.live].min()) if self.live.any() else self.idx
        self.start = max(self.start, 0)
        self.offset = mx.array(self.idx - self.lp, dtype=mx.int32)
        cols = np.arange(self.start, self.idx + 1)
        self.mask = mx.array((cols[None, :] >= self.lp[:, None])[:, None, None, :])


def decode_slots(model, take_group, *, batch_size, group, max_tokens, eos, on_step=None):
    """Continuous greedy batching: yield ``(item, response_ids, finish_reason)`` as rows finish.

    ``take_group(n)`` returns up to ``n`` items ``(key, prompt_ids)`` (length-sorted) or ``[]``.
    Free slots are refilled, ``group`` at a time, with new prompts prefilled together.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache

    def prefill(items):
        """Caches holding all but the last token of each prompt (left-padded), and the pads."""
        heads = [ids[:-1] for _, ids in items]
        width = max(len(h) for h in heads)
        pad = [width - len(h) for h in heads]
        cache = [BatchKVCache(pad) for _ in model.layers]
        x = mx.array([[0] * p + h for p, h in zip(pad, heads)], dtype=mx.uint32)
        model(x, cache=cache)
        mx.eval([c.state for c in cache])
        return cache, pad, width

    batch = SlotBatch(model, batch_size)
    state = ["free"] * batch_size  # free | first (input is the prompt's last token) | live
    item = [None] * batch_size
    out = [None] * batch_size
    y = mx.zeros((batch_size,), mx.uint32)
    more = True
    while True:
        free = [s for s in range(batch_size) if state[s] == "free"]
        if more and len(free) >= min(group, batch_size):
            while more and free:
                items = take_group(min(group, len(free)))
                if not items:
                    more = False
                    break
                slots, free = free[: len(items)], free[len(items) :]
                if min(len(ids) for _, ids in items) < 2:
                    raise ValueError("prompts need at least 2 tokens")
                cache, pad, width = prefill(items)
                batch.insert(slots, cache, np.array(pad), width)
                y[mx.array(slots)] = mx.array([ids[-1] for _, ids in items], dtype=mx.uint32)
                for s, it in zip(slots, items):
                    state[s], item[s], out[s] = "first", it, []
        if not batch.live.any():
            return
        batch.prepare_step()
        y_next = mx.argmax(model(y[:, None], cache=batch.layers)[:, -1, :], axis=-1).astype(mx.uint32)
        batch.idx += 1
        mx.async_eval(y_next)
        toks = y.tolist()
        useful = 0
        for s, t in enumerate(toks):
            if state[s] == "first":
                state[s] = "live"
            elif state[s] == "live":
                out[s].append(t)
                useful += 1
                if t in eos or len(out[s]) >= max_tokens:
                    yield item[s], out[s], "stop" if t in eos else "length"
                    state[s], item[s], out[s] = "free", None, None
                    batch.live[s] = False
        if on_step is not None:
            on_step(useful, int(batch.live.sum()))
        y = y_next


def worker_main(wid, args, task_q, result_q, stop_event):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import mlx.core as mx
    from mlx_lm import load

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
            result_q.put(("tick", wid, tick["steps"], tick["tokens"], tick["rows"], now - tick["t"], now_cpu - tick["cpu"]))
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

    from dflash_mlx.train.data import _key, read_cache, read_prompts, render_prompt

    tokenizer = load_tokenizer(Path(args.model))
    done = {ex["key"] for ex in read_cache(args.cache)}
    n_cached = len(done)
    todo = []
    for path in args.prompts:
        for prompt in read_prompts(path):
            ids = render_prompt(tokenizer, prompt)
            key = _key(ids)
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

    ctx = mp.get_context("spawn")
    task_q, result_q, stop_event = ctx.Queue(), ctx.Queue(), ctx.Event()
    for g in groups:
        task_q.put(g)
    for _ in range(args.workers):
        task_q.put(None)
    workers = [
        ctx.Process(target=worker_main, args=(w, args, task_q, result_q, stop_event), daemon=True)
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
