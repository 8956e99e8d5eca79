"""Topic questions on thousands of topics: the kind of prompt dflash-bench and most chat users send.

The first prompt set crossed its templates with 230 topics we wrote; the drafter's data then grew
mostly with chitchat, Magpie and follow-up prompts, and the topic questions (8% of the cache) are
where its acceptance moved least. This writes open questions ("Explain ...", "How does ...",
"What is ...") about the nouns of WordNet 3.0 (Debian's ``wordnet-base``; licence: the WordNet
licence, BSD-like, in ``/usr/share/doc/wordnet-base/copyright``) that annotated text uses at least
once (the index's tagged-sense count), two templates per noun.

Held out: nouns whose sha1 bucket (of 12) is 0 go to ``prompts_heldout4.jsonl``; a noun that is a
word of any held-out prompt of the earlier files (the nature and arts topics dflash-bench asks
about) is left out of both, so the bench's questions stay unseen.

    apt-get install wordnet-base
    python recipes/rebuild/smollm2_topic_prompts.py
"""

import argparse
import hashlib
import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "assets" / "smollm2" / "data"
INDEX = Path("/usr/share/wordnet/index.noun")
HELDOUT_FILES = ["prompts_heldout.jsonl", "prompts_heldout2.jsonl", "prompts_heldout3.jsonl", "../prompts.jsonl"]
TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "How does {t} work?",
    "Tell me about {t}.",
    "What should I know about {t}?",
    "Why is {t} important?",
    "Give me a short overview of {t}.",
    "What are some interesting facts about {t}?",
    "Explain {t} to a beginner.",
    "How is {t} used in everyday life?",
    "What is the history of {t}?",
    "Can you explain {t} to a 10-year-old?",
    "Write a short paragraph about {t}.",
    "What are the main types of {t}?",
]
BUCKETS, HELDOUT_BUCKET = 12, 0


def _bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) % BUCKETS


def nouns(index: Path, min_tagged: int) -> list[str]:
    """WordNet nouns, lower-case letters only, tagged in annotated text at least ``min_tagged`` times."""
    out = []
    for line in index.read_text().splitlines():
        if line.startswith(" "):
            continue
        f = line.split()
        pointers = int(f[3])
        tagged = int(f[4 + pointers + 1])
        lemma = f[0]
        if tagged >= min_tagged and lemma.replace("_", "").isalpha() and lemma.islower():
            out.append(lemma.replace("_", " "))
    return out


def heldout_words() -> set[str]:
    words = set()
    for name in HELDOUT_FILES:
        path = DATA / name
        for line in path.read_text().splitlines():
            for m in json.loads(line)["messages"]:
                words.update(re.findall(r"[a-z]+", m["content"].lower()))
    return words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-topic", type=int, default=2, help="Templates drawn per noun.")
    p.add_argument("--min-tagged", type=int, default=1, help="Least tagged-sense count of a noun.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DATA))
    args = p.parse_args()
    if not INDEX.exists():
        raise SystemExit("smollm2_topic_prompts: error: install WordNet first (apt-get install wordnet-base).")
    unseen = heldout_words()
    rng = random.Random(args.seed)
    train, heldout = [], []
    for noun in nouns(INDEX, args.min_tagged):
        if any(w in unseen for w in noun.split()):
            continue
        for template in rng.sample(TEMPLATES, args.per_topic):
            record = {
                "messages": [{"role": "user", "content": template.format(t=noun)}],
                "category": "chat",
                "source": f"topics:wordnet:b{_bucket(noun):02d}",
            }
            (heldout if _bucket(noun) == HELDOUT_BUCKET else train).append(record)
    rng.shuffle(train)
    rng.shuffle(heldout)
    out = Path(args.out)
    for name, records in (("prompts_train4.jsonl", train), ("prompts_heldout4.jsonl", heldout)):
        with open(out / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"wrote {out / name}: {len(records)} prompts")


if __name__ == "__main__":
    main()
