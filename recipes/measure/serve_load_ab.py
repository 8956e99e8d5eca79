"""dflash-serve against mlx_lm.server on the same target, prompts and BLAS, N clients at once, levels taking turns.

Starts both servers (the default pair; mlx_lm.server on the converted target alone, batching plain decoding), then
for each round and each level N: N clients at once send the same ``--prompts`` prompts (8: one at a time at
N = 1, all at once at N = 8) to dflash-serve, then to mlx_lm.server (aggregate tok/s, p50/p95 latency), then N clients stream while a long chat prompt (``--join-tokens``)
joins, with each server in turn (the running streams' longest gap while it is prefilled). Greedy, the default
pair's held-out English chat prompts. Before the levels each server answers every prompt alone, one request at a
time: every reply of a level is compared with that one (``same as alone``; dflash-serve's must all be). Since the
levels send the same prompts again, dflash-serve runs with ``--frozen-datastore``: its datastore (the default
pair's shipped answers) does not learn the replies, or a later reply would draft from an earlier one. Prints
one Markdown table per round and the ratio per level.

    python recipes/measure/serve_load_ab.py --rounds 2 --levels 1 2 4 8 --max-tokens 128 --join-tokens 3000
    python recipes/measure/serve_load_ab.py --model dflash-tiny --levels 1 2 4 8    # the toy pair

Both servers run with OpenBLAS preloaded (``--blas``: the library either way), since MLX's CPU speed depends on it
most. The machine may be shared: the levels take turns so that both servers see the same load.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

from dflash_mlx.loading.gguf import prepare_default_target
from dflash_mlx.loading.pairs import DEFAULT_PAIR, default_pair_path, embedded_pair_path
from dflash_mlx.tools.bench.server_load import join_row, run_join, run_level
from dflash_mlx.tools.client import RemoteClient, ServerInfo

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=DEFAULT_PAIR, help="An embedded pair: the default one or dflash-tiny.")
parser.add_argument("--rounds", type=int, default=1)
parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
parser.add_argument("--prompts", type=int, default=8, help="Prompts every level sends (N clients at a time).")
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--join-tokens", type=int, default=3000)
parser.add_argument("--join-stream-tokens", type=int, default=48, help="Tokens each running stream asks for then.")
parser.add_argument("--blas", default=OPENBLAS, help="The BLAS library both servers preload.")
parser.add_argument("--json", default=None)
args = parser.parse_args()

env = {**os.environ, "LD_PRELOAD": args.blas}
pair = embedded_pair_path(args.model)
target = str(prepare_default_target() if pair == default_pair_path() else pair / "target")
servers = {
    "dflash-serve": [
        sys.executable,
        "-m",
        "dflash_mlx.tools.server.app",
        "--model",
        args.model,
        "--port",
        "8731",
        "--blas",
        "openblas",
        "--frozen-datastore",  # the levels send the same prompts again: no reply may draft from an earlier one
    ],  # fmt: skip
    "mlx_lm.server": [sys.executable, "-m", "mlx_lm", "server", "--model", target, "--port", "8732"],
}
urls = {"dflash-serve": "http://127.0.0.1:8731/v1", "mlx_lm.server": "http://127.0.0.1:8732/v1"}
logs = {name: open(f"/tmp/{name}.log", "w") for name in servers}  # noqa: SIM115 (closed with the servers)
procs = {name: subprocess.Popen(cmd, env=env, stderr=logs[name], stdout=logs[name]) for name, cmd in servers.items()}


def wait_up(url: str) -> None:
    for _ in range(600):
        try:
            # /health: mlx_lm.server's /v1/models scans the hub cache (and fails without one).
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2)
            return
        except Exception:
            time.sleep(1)
    raise SystemExit(f"{url} did not come up")


try:
    for url in urls.values():
        wait_up(url)
    rows = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines()]
    document = json.loads((default_pair_path() / "long_context.jsonl").read_text().splitlines()[0])["document"]
    join = join_row(document, args.join_tokens)
    clients = {name: RemoteClient(url, counter_deltas=False) for name, url in urls.items()}
    # mlx_lm.server's /v1/models scans the hub cache: name its model ("default_model": the one it loaded) here.
    clients["mlx_lm.server"].info = ServerInfo(urls["mlx_lm.server"], "default_model", "openai", has_metrics=False)
    for client in clients.values():  # a warm-up request each (compiles, loads the datastore)
        run_level(client, rows[:1], 1, 8)
    # Each prompt served alone, one request at a time: what every reply of a level must equal.
    wanted = sorted({(r * args.prompts + i) % len(rows) for r in range(args.rounds) for i in range(args.prompts)})
    alone = {name: {i: run_level(client, [rows[i]], 1, args.max_tokens)["texts"][0] for i in wanted}
             for name, client in clients.items()}  # fmt: skip
    results = []
    for r in range(args.rounds):
        for n in args.levels:
            first = (r * args.prompts) % len(rows)
            picked = [rows[(first + i) % len(rows)] for i in range(args.prompts)]
            for name, client in clients.items():
                level = run_level(client, picked, n, args.max_tokens)
                level["same_as_alone"] = sum(
                    t == alone[name][(first + i) % len(rows)] for i, t in enumerate(level["texts"])
                )
                # A prompt neither server has seen: a cached one would be no join at all.
                fresh = {"messages": [{"role": "user", "content": f"({name}, round {r}, {n} clients) "
                                       + join["messages"][0]["content"]}]}  # fmt: skip
                level.update(run_join(client, picked[:n], n, args.join_stream_tokens, fresh))
                level.update(server=name, round=r)
                results.append(level)
                print(
                    f"round {r} clients {n} {name}: {level['tok_s']:.1f} tok/s, latency p50 {level['latency_p50_s']:.1f}"
                    f" p95 {level['latency_p95_s']:.1f} s, gap while joining {level['join_gap_s']:.2f} s "
                    f"(join TTFT {level['join_ttft_s']:.1f} s), {level['tokens']} tokens, errors {len(level['errors'])}, "
                    f"same as alone {level['same_as_alone']}/{len(picked)}",
                    flush=True,
                )
    print("\n| round | clients | mlx_lm.server tok/s | dflash-serve tok/s | ratio | p50 / p95 s (mlx_lm) "
          f"| p50 / p95 s (dflash) | longest gap s while {args.join_tokens} tokens join (mlx_lm) | (dflash) "
          "| dflash replies as alone |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for r in range(args.rounds):
        for n in args.levels:
            d, m = (next(x for x in results if x["round"] == r and x["concurrency"] == n and x["server"] == s)
                    for s in ("dflash-serve", "mlx_lm.server"))  # fmt: skip
            print(f"| {r + 1} | {n} | {m['tok_s']:.1f} | {d['tok_s']:.1f} | {d['tok_s'] / m['tok_s']:.2f}x "
                  f"| {m['latency_p50_s']:.1f} / {m['latency_p95_s']:.1f} | {d['latency_p50_s']:.1f} / "
                  f"{d['latency_p95_s']:.1f} | {m['join_gap_s']:.2f} | {d['join_gap_s']:.2f} | {d['same_as_alone']}/{args.prompts} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
finally:
    for p in procs.values():
        p.terminate()
    for name, p in procs.items():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        logs[name].close()
        print(f"{name} said: {open(logs[name].name).read()[-600:]}", file=sys.stderr)
