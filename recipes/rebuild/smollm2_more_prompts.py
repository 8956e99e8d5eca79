"""More English chat prompts for the SmolLM2 drafter: prompts_train2.jsonl and prompts_heldout2.jsonl.

Three kinds of source, all offline (assets/smollm2/DATA.md has the counts and licences):

- ``chitchat:bNN``: the Chit-Chat Challenge conversations of the PyPI package ``chitchat-dataset``
  (MIT). Per two-speaker conversation, windows of 3, 5 or 7 consecutive turns become
  user/assistant/.../user prompts (the dataset's own second speaker stands in for the
  assistant), and per conversation up to two question turns become single-turn prompts; the
  conversation-starter questions are single-turn prompts of source ``chitchat:starters``.
  NN = sha1("chitchat-<conversation id>") % 12; bucket b00 (about 8% of the conversations) is
  held out.
- ``followup:<template>``: [user, assistant, user] prompts: a training prompt of
  ``prompts_train.jsonl``, the target's own greedy answer to it from the response cache (only
  answers that ended with ``<|im_end|>``), and a follow-up request from the templates below,
  chosen by the first prompt's category. Three templates (``HELDOUT_TEMPLATES``) are held out;
  they are applied only to the answers whose cache key hashes into bucket 0 of 12, and those
  answers are never used by a training follow-up. An answer to a held-out prompt (if a cache
  has one) only ever makes held-out follow-ups.
- ``magpie:bNN``: user messages the target wrote itself (``magpie.py``, its output file).

Every prompt is rendered with the target's chat template and dropped if it is longer than
``--max-prompt-tokens`` (default 384, the default of dflash-train's --max-prompt-tokens).
Deduplicated on the lower-cased, space-collapsed text of all turns: against the existing
prompt files (both), within the new prompts, and held-out against training (a held-out
prompt that also appears in training is dropped from the held-out file). Ordered so that
every prefix is a balanced sample: the kinds by fixed shares (chitchat 50%, magpie 30%, followup
20%; once one runs out, the others keep their relative shares), and within a kind its sources in
proportion to their sizes, each source shuffled.

    python recipes/rebuild/smollm2_more_prompts.py --target runs/smollm2/target
"""

import argparse
import gzip
import hashlib
import json
import random
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2_prompts import write_jsonl  # noqa: E402  (the first prompt set's writer)

HERE = Path(__file__).resolve().parent
BUCKETS = 12
CHITCHAT_HELDOUT_BUCKETS = {0}
MAGPIE_HELDOUT_BUCKETS = {0}
FOLLOWUP_RESERVED_BUCKETS = {0}
CATEGORIES = ("chat", "code", "writing", "math", "summarize")

# id: (text, categories of the first prompt it fits, category of the new prompt or None: the first one's)
TEMPLATES = {
    "example": ("Can you give a concrete example?", {"chat", "code", "summarize"}, None),
    "simpler": ("Explain that more simply.", {"chat", "code", "summarize", "math"}, None),
    "two_sentences": ("Summarize that in two sentences.", {"chat", "code", "writing", "summarize"}, "summarize"),
    "mistakes": ("What are common mistakes with this?", {"chat", "code", "math"}, None),
    "why": ("Why is that? Explain your reasoning.", {"chat", "math"}, None),
    "bullets": ("Can you turn that into a short bulleted list?", {"chat", "summarize"}, None),
    "more_detail": ("Tell me more about the most important point.", {"chat", "summarize"}, None),
    "pros_cons": ("What are the pros and cons?", {"chat"}, None),
    "learn_more": ("What should I read or practice next to learn more about this?", {"chat", "code"}, None),
    "quiz": (
        "Write three quiz questions to check that I understood this.",
        {"chat", "code", "summarize", "math"},
        None,
    ),
    "code_comments": ("Add comments to the code that explain each step.", {"code"}, "code"),
    "code_tests": ("How would I test this? Write a few test cases.", {"code"}, "code"),
    "code_js": ("How would the same thing look in JavaScript?", {"code"}, "code"),
    "code_faster": ("Is there a simpler or faster way to do this?", {"code"}, "code"),
    "formal": ("Rewrite it in a more formal tone.", {"writing"}, "writing"),
    "shorter": ("Make it half as long.", {"writing"}, "writing"),
    "funnier": ("Make it funnier.", {"writing"}, "writing"),
    "continue": ("Continue it with one more paragraph.", {"writing"}, "writing"),
    "steps": ("Show the calculation step by step.", {"math"}, "math"),
    "doubled": ("Now solve the same problem with all the numbers doubled.", {"math"}, "math"),
    "check": ("How can I check that this answer is right?", {"math"}, "math"),
    # held out
    "kid": ("How would you explain that to a ten-year-old?", {"chat", "code", "summarize", "math"}, None),
    "edge_cases": ("What edge cases should I watch out for?", {"code"}, "code"),
    "titles": ("Suggest three titles for it.", {"writing"}, "writing"),
}
HELDOUT_TEMPLATES = {"kid", "edge_cases", "titles"}
FOLLOWUPS_PER_ANSWER = 4
KIND_SHARES = {"chitchat": 0.5, "magpie": 0.3, "followup": 0.2}


def sha_bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) % BUCKETS


def norm(text: str) -> str:
    return " ".join(text.lower().split())


def key_of(messages: list[dict]) -> str:
    """The dedup key: the text alone for one user turn, else every turn with its role."""
    if len(messages) == 1:
        return norm(messages[0]["content"])
    return "\n".join(f"{m['role']}: {norm(m['content'])}" for m in messages)


def record(messages: list[dict], category: str, source: str) -> dict:
    return {"messages": messages, "category": category, "source": source}


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of an interrupted cache
    return out


# ---- chitchat ----

URL_OR_EMAIL = re.compile(r"https?://|www\.|\S+@\S+\.\w")
WORD = re.compile(r"[A-Za-z']+")


def clean_turn(utterances: list[dict]) -> str:
    lines = [" ".join(u["text"].split()) for u in utterances]
    return "\n".join(ln for ln in lines if ln)


def usable(text: str, min_words: int) -> bool:
    return (
        bool(text)
        and len(WORD.findall(text)) >= min_words
        and not URL_OR_EMAIL.search(text)
        and sum(ord(c) < 128 for c in text) >= 0.97 * len(text)
    )


QUESTION_START = re.compile(
    r"^(what|whats|what's|how|why|who|where|when|which|do|does|did|have|has|is|are|was|were|can|could|would|"
    r"should|will|if)\b",
    re.I,
)
BACK_REFERENCE = re.compile(r"\b(about you|and you|how about|what about|you too|that one|same here)\b", re.I)


def self_contained_question(turn: str) -> bool:
    """A turn whose last line is a question of six words or more, not one that only points back."""
    last = turn.splitlines()[-1]
    sentence = re.split(r"(?<=[.!?])\s+", last.strip())[-1]
    return (
        sentence.endswith("?")
        and len(WORD.findall(sentence)) >= 6
        and bool(QUESTION_START.match(sentence))
        and not BACK_REFERENCE.search(sentence)
    )


def chitchat_prompts() -> list[tuple[dict, bool]]:
    """``(record, held_out)`` from every conversation, in a fixed order."""
    import chitchat_dataset

    data = chitchat_dataset.Dataset()
    out, starters = [], set()
    for cid in sorted(data):
        conv = data[cid]
        if conv.get("prompt"):
            starters.add(" ".join(conv["prompt"].split()))
        b = sha_bucket(f"chitchat-{cid}")
        source, held = f"chitchat:b{b:02d}", b in CHITCHAT_HELDOUT_BUCKETS
        turns = [clean_turn(m) for m in conv["messages"]]
        rng = random.Random(f"chitchat-{cid}")
        # Single turns: questions of some substance, at most two per conversation.
        questions = [t for t in turns if 25 <= len(t) <= 600 and usable(t, 5) and self_contained_question(t)]
        for t in rng.sample(questions, min(2, len(questions))):
            out.append((record([{"role": "user", "content": t}], "chat", source), held))
        # Windows of 3, 5 or 7 turns (user first and last), only where two people talk.
        if len({m[0]["sender"] for m in conv["messages"]}) < 2:
            continue
        i, n_windows = rng.randrange(3), 0
        while n_windows < 4:
            length = rng.choice((3, 3, 5, 5, 7))
            if i + length > len(turns):
                break
            window = turns[i : i + length]
            if (
                all(usable(t, 1) for t in window)
                and usable(window[-1], 3)
                and len(window[-1]) >= 12
                and sum(map(len, window)) <= 1500
            ):
                roles = ["user" if k % 2 == 0 else "assistant" for k in range(length)]
                msgs = [{"role": r, "content": t} for r, t in zip(roles, window)]
                out.append((record(msgs, "chat", source), held))
                n_windows += 1
                i += length + rng.randrange(1, 5)
            else:
                i += 1
    for s in sorted(starters):
        out.append((record([{"role": "user", "content": s}], "chat", "chitchat:starters"), False))
    return out


# ---- follow-ups on the target's own answers ----

USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def followup_prompts(
    tokenizer, responses: list[dict], train: list[dict], heldout: list[dict]
) -> tuple[list[tuple[dict, bool]], Counter]:
    by_text = {}
    for recs, held in ((train, False), (heldout, True)):
        for r in recs:
            if len(r["messages"]) == 1:
                by_text[norm(r["messages"][0]["content"])] = (r, held)
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    out, why, seen = [], Counter(), set()
    for ex in responses:
        if ex.get("finish_reason") != "stop" or ex["key"] in seen:
            why["not_stop_or_repeat"] += 1
            continue
        seen.add(ex["key"])
        users = USER_TURN.findall(tokenizer.decode(ex["prompt_ids"]))
        if len(users) != 1 or norm(users[0]) not in by_text:
            why["prompt_not_found"] += 1
            continue
        base, base_held = by_text[norm(users[0])]
        ids = list(ex["response_ids"])
        while ids and ids[-1] in eos:
            ids.pop()
        answer = tokenizer.decode(ids).strip()
        if not answer or "<|im_" in answer:
            why["bad_answer"] += 1
            continue
        cat = base["category"]
        reserved = base_held or sha_bucket(f"followup-{ex['key']}") in FOLLOWUP_RESERVED_BUCKETS
        if reserved:
            chosen = [t for t in sorted(HELDOUT_TEMPLATES) if cat in TEMPLATES[t][1]]
        else:
            fits = [t for t in TEMPLATES if t not in HELDOUT_TEMPLATES and cat in TEMPLATES[t][1]]
            chosen = random.Random(f"followup-{ex['key']}").sample(fits, min(FOLLOWUPS_PER_ANSWER, len(fits)))
        why["reserved" if reserved else "train"] += 1
        for t in chosen:
            text, _, new_cat = TEMPLATES[t]
            msgs = [
                dict(base["messages"][0]),
                {"role": "assistant", "content": answer},
                {"role": "user", "content": text},
            ]
            out.append((record(msgs, new_cat or cat, f"followup:{t}"), reserved))
    return out, why


# ---- length, dedup, order ----


def n_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def proportional_merge(lists: list[list]) -> list:
    """All items, so that every prefix holds each list in proportion to its length."""
    lists = [x for x in lists if x]
    taken, out = [0] * len(lists), []
    while len(out) < sum(map(len, lists)):
        k = min(
            (i for i in range(len(lists)) if taken[i] < len(lists[i])),
            key=lambda i: ((taken[i] + 1) / len(lists[i]), i),
        )
        out.append(lists[k][taken[k]])
        taken[k] += 1
    return out


def balanced_order(records: list[dict], seed: int) -> list[dict]:
    """Kinds by KIND_SHARES (the rest in proportion once one runs out), within a kind its sources
    in proportion to their sizes, each source shuffled."""
    rng = random.Random(seed)
    by_kind = defaultdict(lambda: defaultdict(list))
    for r in records:
        kind = r["source"].split(":")[0]
        by_kind[kind][r["source"]].append(r)
    merged = []
    for kind in sorted(by_kind):
        lists = [by_kind[kind][s] for s in sorted(by_kind[kind])]
        for x in lists:
            rng.shuffle(x)
        merged.append((kind, proportional_merge(lists)))
    taken, out = Counter(), []
    while len(out) < len(records):
        live = [(k, q) for k, q in merged if taken[k] < len(q)]
        k, q = min(live, key=lambda kq: ((taken[kq[0]] + 1) / KIND_SHARES.get(kq[0], 0.1), kq[0]))
        out.append(q[taken[k]])
        taken[k] += 1
    return out


def table(train: list[dict], heldout: list[dict]) -> str:
    lines = ["| kind | file | " + " | ".join(CATEGORIES) + " | total |", "|---" * (len(CATEGORIES) + 3) + "|"]
    for kind in sorted({r["source"].split(":")[0] for r in train + heldout}) + ["all"]:
        for name, recs in (("train", train), ("held-out", heldout)):
            sel = [r for r in recs if kind == "all" or r["source"].split(":")[0] == kind]
            c = Counter(r["category"] for r in sel)
            lines.append(f"| {kind} | {name} | " + " | ".join(f"{c[k]:,}" for k in CATEGORIES) + f" | {len(sel):,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=Path("runs/smollm2/target"), help="Tokenizer + chat template.")
    parser.add_argument(
        "--existing",
        type=Path,
        nargs="+",
        default=[Path("assets/smollm2/data/prompts_train.jsonl"), Path("assets/smollm2/data/prompts_heldout.jsonl")],
        help="The prompt files there already: training first, then held-out.",
    )
    parser.add_argument(
        "--responses",
        type=Path,
        nargs="+",
        default=[Path("assets/smollm2/data/responses.jsonl.gz")],
        help="Response caches (JSONL or .gz) of dflash-train --data-only.",
    )
    parser.add_argument(
        "--magpie", type=Path, default=Path("assets/smollm2/data/magpie.jsonl"), help="magpie.py's kept prompts."
    )
    parser.add_argument("--out", type=Path, default=Path("assets/smollm2/data"))
    parser.add_argument(
        "--base",
        type=Path,
        nargs=2,
        default=None,
        metavar=("TRAIN", "HELDOUT"),
        help="Prompt files whose answered single-turn prompts get follow-ups (default: --existing).",
    )
    parser.add_argument(
        "--also-existing",
        type=Path,
        nargs="*",
        default=[],
        help="More prompt files whose prompts are not repeated (e.g. the second set's, for a third).",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["chitchat", "followup", "magpie"],
        choices=["chitchat", "followup", "magpie"],
        help="Which kinds of prompt to make.",
    )
    parser.add_argument("--name", default="2", help="Write prompts_train<NAME>.jsonl and prompts_heldout<NAME>.jsonl.")
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    old_train, old_heldout = read_jsonl(args.existing[0]), read_jsonl(args.existing[1])
    also = [r for p in args.also_existing for r in read_jsonl(p)]
    existing = {key_of(r["messages"]) for r in old_train + old_heldout + also}
    base_train, base_heldout = (read_jsonl(p) for p in args.base) if args.base else (old_train, old_heldout)

    candidates = []  # (record, held_out)
    cc = chitchat_prompts() if "chitchat" in args.kinds else []
    candidates += cc
    fu, fu_why = [], Counter()
    if "followup" in args.kinds:
        responses = [ex for p in args.responses for ex in read_jsonl(p)]
        fu, fu_why = followup_prompts(tokenizer, responses, base_train, base_heldout)
    candidates += fu
    magpie = read_jsonl(args.magpie) if "magpie" in args.kinds and args.magpie.is_file() else []
    candidates += [(r, int(r["source"].split(":b")[1]) in MAGPIE_HELDOUT_BUCKETS) for r in magpie]
    print(f"candidates: chitchat {len(cc)}, followup {len(fu)} ({dict(fu_why)}), magpie {len(magpie)}")

    drops, lengths = Counter(), []
    train, heldout, train_keys, held_keys = [], [], set(), set()
    for rec, held in candidates:
        k = key_of(rec["messages"])
        if k in existing:
            drops["in_existing_files"] += 1
            continue
        if k in (held_keys if held else train_keys):
            drops["duplicate"] += 1
            continue
        n = n_tokens(tokenizer, rec["messages"])
        lengths.append(n)
        if n > args.max_prompt_tokens:
            drops[f"over_{args.max_prompt_tokens}_tokens"] += 1
            continue
        (held_keys if held else train_keys).add(k)
        (heldout if held else train).append(rec)
    before = len(heldout)
    heldout = [r for r in heldout if key_of(r["messages"]) not in train_keys]
    drops["held_out_also_in_train"] += before - len(heldout)
    print(f"dropped: {dict(drops)}")
    lengths.sort()
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]
    print(
        f"rendered tokens of the candidates: p10 {q(0.1)}, median {q(0.5)}, p90 {q(0.9)}, p99 {q(0.99)}, "
        f"max {lengths[-1]}; over 384: {sum(n > 384 for n in lengths)}, over 600: {sum(n > 600 for n in lengths)}"
    )

    train, heldout = balanced_order(train, args.seed), balanced_order(heldout, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / f"prompts_train{args.name}.jsonl", train)
    write_jsonl(args.out / f"prompts_heldout{args.name}.jsonl", heldout)
    print(table(train, heldout))
    for name, recs in (("train", train), ("held-out", heldout)):
        src = Counter(r["source"] for r in recs)
        print(f"{name} sources: " + ", ".join(f"{s} {n}" for s, n in sorted(src.items())))
    for name, recs in (("train", train), ("held-out", heldout)):
        turns = Counter(len(r["messages"]) for r in recs)
        print(f"{name} turns per prompt: {dict(sorted(turns.items()))}")


if __name__ == "__main__":
    main()
