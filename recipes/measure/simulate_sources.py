"""Which draft source to verify each cycle, measured offline on the target's own held-out answers.

Greedy decoding is deterministic, so a cycle's acceptance can be read off the cached greedy
response: at each point of it, a source proposes drafts from the text so far, the longest prefix
equal to the response is accepted, plus the target's own token, and the next cycle starts after
them. This replays the generation loop's paused cycles (no drafter pass) for prompt lookup, the
datastore and their combinations, and prices each cycle with a verify cost per draft measured on
the target (``--draft-cost``: one draft's share of a plain step; ``--first-cost``: the first
draft's, where it differs). The last setups replay the loop's own sizing (FreeDrafts: learned
chances, the costs held where they start).

    python recipes/measure/simulate_sources.py --heldout runs/heldout/responses.jsonl \\
        --prompts runs/heldout/prompts.jsonl --store assets/smollm2/data/responses.jsonl.gz
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_mlx.drafts.datastore import Datastore, Draft, SuffixIndex, read_responses  # noqa: E402
from dflash_mlx.drafts.free import FreeDrafts  # noqa: E402
from dflash_mlx.drafts.lookup import PromptLookup  # noqa: E402
from dflash_mlx.tuning.policy import FreeStats  # noqa: E402


class LongestOnlyDatastore(Datastore):
    """The datastore's rule before it backed off: the longest suffix of the text it holds decides,
    even where its continuation is too rare or unsure to draft."""

    def draft(self, text, n):
        indexes = self._indexes()
        for order in range(min(self.max_order, len(text)), self.min_order - 1, -1):
            pattern = [int(t) for t in text[-order:]]
            matched = False
            for index in indexes:
                lo, hi = index.find(pattern)
                if hi > lo:
                    matched = True
                    tokens, shares = self._walk(index, lo, hi, order, n)
                    if tokens:
                        return Draft(tokens, order, shares)
            if matched:
                return Draft([], order)
        return Draft([], 0)


def accepted(drafts: list[int], truth: list[int]) -> int:
    k = 0
    while k < len(drafts) and k < len(truth) and drafts[k] == truth[k]:
        k += 1
    return k


def replay(prompt: list[int], response: list[int], propose, draft_cost: float, first_cost: float):
    """(cycles, drafting cycles, their tokens, steps' worth of time, tokens, {source: accepted
    drafts}) of one answer."""
    history = list(prompt) + response[:1]  # the prefill's token comes alone
    i, cycles, drafting, drafting_tokens, time_, shares = 1, 0, 0, 0, 0.0, defaultdict(int)
    while i < len(response):
        source, drafts = propose(history)
        k = accepted(drafts, response[i:])
        if hasattr(propose, "judged"):
            propose.judged(k)
        take = min(k + 1, len(response) - i)
        history += response[i : i + take]
        i += take
        cycles += 1
        if drafts:
            drafting += 1
            drafting_tokens += take
        time_ += 1.0 + (first_cost + draft_cost * (len(drafts) - 1) if drafts else 0.0)
        shares[source] += k
    return cycles, drafting, drafting_tokens, time_, len(response) - 1, shares


class FixedCosts(FreeStats):
    """The loop's learned chances with the verify costs held at their starting values (a replay has
    no clock)."""

    def timed(self, seconds, drafts):
        pass


class MatchOnlyLookup(FreeDrafts):
    """The draft-free cycles as they were before prompt lookup's drafts were told apart by what the
    match's earlier occurrence did: one kind per match length."""

    def _candidates(self, text, n):
        for kind, tokens, chances, shares in super()._candidates(text, n):
            if kind.startswith("lookup"):
                kind = " ".join(kind.split()[:2])
                chances = self.stats.chances(kind, len(tokens))
            yield kind, tokens, chances, shares


def sized_source(proposer_class, index, vocab):
    """The loop's draft-free cycles (FreeDrafts: each cycle the prefix of lookup's or the datastore's
    drafts that its learned chances price best, or none), one stats object across the answers as a
    chat keeps it; returns ``propose(history)``, whose ``judged(k)`` attribute :func:`replay` calls
    with each cycle's accepted drafts."""
    stats, store = FixedCosts(), Datastore(index, vocab)
    state = {}

    def propose(history):
        free = proposer_class(history[:-1], store, 7, stats)
        proposal = free.propose(history[-1], 7)
        state["free"] = free
        source = {"datastore": "store", "": "none"}.get(proposal.source, proposal.source)
        return source, [int(t) for t in proposal.tokens.tolist()]

    def judged(k):
        state.pop("free").accept(k, None)

    propose.judged = judged
    return propose


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heldout", required=True, help="Response cache of the held-out prompts.")
    p.add_argument("--prompts", required=True, help="The held-out prompts (for their category and source).")
    p.add_argument("--store", required=True, help="The datastore's response cache.")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-cost", type=float, default=0.06, help="One draft's verify cost, in plain steps.")
    p.add_argument(
        "--first-cost",
        type=float,
        default=None,
        help="The first draft's, if it differs (0.15 measured on 2-core CPUs: the host waits for the verdict).",
    )
    p.add_argument("--index", default=None, help="Keep the store's index here (.npz) between runs.")
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="TEXT",
        help="Replay only the setups whose name holds one of these texts.",
    )
    args = p.parse_args()

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash_mlx.tools.train.data import prompt_key, read_cache, read_prompts, render_prompt

    tokenizer = load_tokenizer(Path("runs/smollm2/target"))
    records = [json.loads(line) for line in open(args.prompts) if line.strip()]
    group = {}
    for rec, prompt in zip(records, read_prompts(args.prompts)):
        source = rec.get("source", "?")
        kind = "topics:wordnet" if source.startswith("topics:wordnet") else source.split(":")[0]
        group[prompt_key(render_prompt(tokenizer, prompt))] = f"{rec.get('category', 'all')}/{kind}"
    examples = [ex for ex in read_cache(args.heldout) if ex["key"] in group]
    groups = sorted({group[ex["key"]] for ex in examples})
    tic = time.perf_counter()
    index = SuffixIndex.load(Path(args.index)) if args.index and Path(args.index).exists() else None
    if index is None:
        index = SuffixIndex.build(read_responses(args.store), args.vocab)
        if args.index:
            index.save(Path(args.index))
    print(f"store: {len(index):,} tokens, ready in {time.perf_counter() - tic:.1f} s; {len(examples)} answers")

    def lookup_source(width, min_match=1):
        settings = PromptLookup(width + 1, max_ngram=3, min_ngram=min_match)
        return lambda history: ("lookup", settings.lookup(history, width))

    def store_source(width, longest_only=False, **kw):
        store = (LongestOnlyDatastore if longest_only else Datastore)(index, args.vocab, **kw)
        return lambda history: ("store", store.draft(history, width).tokens)

    def first_of(*sources):
        def propose(history):
            for s in sources:
                name, drafts = s(history)
                if drafts:
                    return name, drafts
            return "none", []

        return propose

    def lookup_long(width, min_match):  # lookup only on a match of min_match tokens or more
        return lookup_source(width, min_match)

    def combined(longest_only=False, **kw):  # the loop's default
        return first_of(lookup_long(7, 2), store_source(7, longest_only, **kw), lookup_source(1))

    def extended(width):  # a long lookup match's drafts, continued by the datastore past where they end
        lookup, store = PromptLookup(width + 1, max_ngram=3, min_ngram=2), Datastore(index, args.vocab)

        def propose(history):
            drafts = lookup.lookup(history, width)
            if drafts:
                more = store.draft(history + drafts, width - len(drafts)).tokens if len(drafts) < width else []
                return "lookup", drafts + more
            return "store", store.draft(history, width).tokens

        return first_of(propose, lookup_source(1))

    def longest(width):  # the longer of a long lookup match's drafts and the datastore's
        lookup, store = PromptLookup(width + 1, max_ngram=3, min_ngram=2), Datastore(index, args.vocab)

        def propose(history):
            a, b = lookup.lookup(history, width), store.draft(history, width).tokens
            return ("lookup", a) if len(a) >= len(b) and a else ("store", b)

        return first_of(propose, lookup_source(1))

    setups = {
        "plain": lambda h: ("none", []),
        "lookup 1 (before: the paused cycles' drafts)": lookup_source(1),
        "lookup 7": lookup_source(7),
        "store 7": store_source(7),
        "lookup>=2 7, else store 7, else lookup 1 (the default)": combined(),
        "  the same, store stopping at the longest suffix it holds (before)": combined(True),
        "  the same, store order <= 8": combined(max_order=8),
        "  the same, store order <= 16": combined(max_order=16),
        "  the same, store min count 4": combined(min_count=4),
        "  the same, store step .4": combined(min_step=0.4),
        "lookup>=3 7, else store 7, else lookup 1": first_of(lookup_long(7, 3), store_source(7), lookup_source(1)),
        "store 7, else lookup 7": first_of(store_source(7), lookup_source(7)),
        "lookup>=2 7 continued by the store, else store 7, else lookup 1": extended(7),
        "the longer of lookup>=2 7 and store 7, else lookup 1": longest(7),
        "lookup>=2 15, else store 15, else lookup 1": first_of(lookup_long(15, 2), store_source(15), lookup_source(1)),
        "sized by the loop's chances (lookup told apart by its match's earlier occurrence)": sized_source(
            FreeDrafts, index, args.vocab
        ),
        "sized by the loop's chances (lookup by match length only, before)": sized_source(
            MatchOnlyLookup, index, args.vocab
        ),
    }
    print(f"draft cost {args.draft_cost} of a step; speed = tokens per step-time against plain decoding")
    print(
        "| setup | tokens per cycle (per drafting cycle) | speed | " + " | ".join(groups) + " | shares (lookup/store) |"
    )
    for name, propose in setups.items():
        if args.only and not any(t in name for t in args.only):
            continue
        tic = time.perf_counter()
        per = defaultdict(lambda: [0, 0, 0, 0.0, 0])
        shares = defaultdict(int)
        for ex in examples:
            got = replay(
                ex["prompt_ids"],
                ex["response_ids"],
                propose,
                args.draft_cost,
                args.draft_cost if args.first_cost is None else args.first_cost,
            )
            for g in ("all", group[ex["key"]]):
                for j in range(5):
                    per[g][j] += got[j]
            for k, v in got[5].items():
                shares[k] += v
        tau = {g: v[4] / max(v[0], 1) for g, v in per.items()}  # tokens per cycle, every cycle counted
        drafting_tau = per["all"][2] / max(per["all"][1], 1)
        speed = per["all"][4] / per["all"][3]
        cols = " | ".join(f"{tau[g]:.2f}" for g in groups)
        total = max(sum(shares.values()), 1)
        print(
            f"| {name} | {tau['all']:.2f} ({drafting_tau:.2f}) | {speed:.2f}x | {cols} | "
            f"{shares['lookup'] / total:.0%}/{shares['store'] / total:.0%} | ({time.perf_counter() - tic:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
