"""The draft-free cycles' two rules side by side in one process, with plain decoding through the same loop:
the fixed order (prompt lookup on a 2+ token match, else the datastore, else one lookup draft) against
``FreeDrafts`` (as many drafts as pay, by learned chances and measured cycle costs). Greedy, the default pair,
two held-out prompts, rounds taking turns (the first is warm-up); prints cumulative tokens per second.

    python -m dflash_mlx.cpu.openblas python recipes/measure/free_drafts_ab.py
"""

import json
import time

import dflash_mlx.drafts.build as g
from dflash_mlx import load, stream_generate
from dflash_mlx.drafts.datastore import DatastoreProposer
from dflash_mlx.drafts.lookup import LookupProposer, PromptLookup
from dflash_mlx.drafts.proposer import FirstOf
from dflash_mlx.loading.pairs import DEFAULT_PAIR
from dflash_mlx.tools.session import open_datastore
from dflash_mlx.tuning.policy import PolicyState

model, draft, tok = load()
ds = open_datastore("auto", DEFAULT_PAIR, 49152, learns=False)
new = g.free_sources


def old(cache, datastore, lookup, state, width=7):
    if not lookup:
        return None
    any_match = LookupProposer(PromptLookup(lookup + 1), cache.tokens)
    if datastore is None:
        return any_match
    return FirstOf(
        LookupProposer(PromptLookup(width + 1, min_ngram=2), cache.tokens),
        DatastoreProposer(datastore, cache.tokens, width + 1),
        any_match,
    )


prompts = [json.loads(line) for line in open("runs/heldout/prompts.jsonl")][:2]
texts = [tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False) for p in prompts]
policies = {"old": PolicyState(), "new": PolicyState()}
tot = {k: [0.0, 0] for k in ("plain", "old", "new")}
for rnd in range(4):
    for name in ("plain", "old", "new"):
        for t in texts:
            if name != "plain":
                g.free_sources = old if name == "old" else new
            tic = time.perf_counter()
            n = 0
            for r in stream_generate(
                model,
                None if name == "plain" else draft,
                tok,
                t,
                max_tokens=160,
                datastore=None if name == "plain" else ds,
                policy=policies.get(name),
            ):
                n += len(r.tokens)
            if rnd:
                tot[name][0] += time.perf_counter() - tic
                tot[name][1] += n
    if rnd:
        print(
            rnd,
            {k: round(v[1] / v[0], 2) for k, v in tot.items()},
            "new first-cost {:.2f}".format(policies["new"].free.first),
            flush=True,
        )
