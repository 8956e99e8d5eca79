"""Draft-free cycles with and without text trees, side by side in one process with mlx-lm's decoding: the
tools' defaults (drafter, adaptive policy, prompt lookup and the shipped datastore) verifying one path a
draft-free cycle (``tree_nodes=0``) against a tree of both sources' continuations. The default pair, the
first ``--prompts`` of its chat and held-out prompts, rounds taking turns after a short warm-up; prints each arm's
cumulative tokens per second and its ratio to mlx-lm's, and checks every arm's tokens against mlx-lm's
when greedy. ``--temp``/``--top-p`` sample, on both sides alike.

    python -m dflash_mlx.cpu.openblas python recipes/measure/text_trees_ab.py --prompts 8 --max-tokens 256
    python -m dflash_mlx.cpu.openblas python recipes/measure/text_trees_ab.py --nodes 6 12 24   # a sweep of sizes
    python -m dflash_mlx.cpu.openblas python recipes/measure/text_trees_ab.py --tree-extra 0 0.4 0.8
"""

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_lm_stream
from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

import dflash_mlx.drafts.build as g
from dflash_mlx import load, stream_generate
from dflash_mlx.cpu.openblas import blas_in_use
from dflash_mlx.drafts.free import TREE_NODES, FreeDrafts
from dflash_mlx.loading.pairs import DEFAULT_PAIR, embedded_pair_path
from dflash_mlx.sampling import make_sampler
from dflash_mlx.tools.session import open_datastore
from dflash_mlx.tuning.policy import PolicyState

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--temp", type=float, default=0.0)
parser.add_argument("--top-p", type=float, default=0.0)
parser.add_argument("--nodes", type=int, nargs="+", default=[TREE_NODES], help="Tree sizes, one arm each.")
parser.add_argument(
    "--tree-extra",
    type=float,
    nargs="+",
    default=[],
    help="Instead: trees of the first --nodes, one arm per tree_extra.",
)
args = parser.parse_args()

model, draft, tok = load()
store = open_datastore("auto", DEFAULT_PAIR, 49152, learns=False)
rows = [json.loads(line) for line in open(embedded_pair_path() / "prompts.jsonl")][: args.prompts]
prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
made = g.free_sources
nodes = {"paths": 0, **{f"trees {n}": n for n in args.nodes}}
extras = {}  # arm -> the policy's tree_extra (the cost it adds to a tree pass over a path pass of as many drafts)
if args.tree_extra:
    nodes = {"paths": 0, **{f"extra {x:g}": args.nodes[0] for x in args.tree_extra}}
    extras = {f"extra {x:g}": x for x in args.tree_extra}
arm = {"name": "paths"}


def free_sources(*a, **k):
    proposer = made(*a, **k)
    if isinstance(proposer, FreeDrafts):
        proposer.tree_nodes = nodes[arm["name"]]
    return proposer


g.free_sources = free_sources
policies = {name: PolicyState() for name in nodes}
for name, x in extras.items():
    policies[name].free.tree_extra = x
sampled = args.temp > 0


def run(name: str, ids: list[int], seed: int) -> list[int]:
    mx.random.seed(seed)
    if name == "mlx-lm":
        sampler = mlx_lm_sampler(args.temp, args.top_p)
        return [r.token for r in mlx_lm_stream(model, tok, ids, max_tokens=args.max_tokens, sampler=sampler)]
    arm["name"] = name
    sampler = make_sampler(args.temp, args.top_p) if sampled else None
    out = []
    for r in stream_generate(
        model, draft, tok, ids, max_tokens=args.max_tokens, datastore=store, policy=policies[name], sampler=sampler
    ):
        out.extend(r.tokens)
    return out


print(f"BLAS: {blas_in_use()}; {len(prompts)} prompts, {args.max_tokens} tokens, temp {args.temp} top-p {args.top_p}")
totals = {name: [0.0, 0] for name in ("mlx-lm", *nodes)}
max_tokens, args.max_tokens = args.max_tokens, 32
for name in totals:  # warm-up: every arm's graphs compiled, the policies' first cycles run
    run(name, prompts[0], seed=0)
args.max_tokens = max_tokens
for rnd in range(1, args.rounds + 1):
    for i, ids in enumerate(prompts):
        outs = {}
        for name in totals:
            tic = time.perf_counter()
            outs[name] = run(name, ids, seed=rnd * 1000 + i)
            if rnd:
                totals[name][0] += time.perf_counter() - tic
                totals[name][1] += len(outs[name])
        if not sampled:
            for name in nodes:  # mlx-lm's text keeps its stop token, ours leave it out
                assert outs[name] == outs["mlx-lm"][: len(outs[name])], (name, i)
    if rnd:
        tps = {name: n / s for name, (s, n) in totals.items()}
        ratios = ", ".join(f"{name} {tps[name]:.2f} tok/s {tps[name] / tps['mlx-lm']:.3f}x" for name in nodes)
        print(f"round {rnd}: mlx-lm {tps['mlx-lm']:.2f} tok/s; {ratios}", flush=True)
