"""Build the English chat prompts the SmolLM2 drafter is trained and evaluated on, offline.

Three kinds of source, none downloaded:

- ``stdlib:<package>``: the Python standard library's docstrings turned into questions ("What does
  `textwrap.dedent` do?", "Explain what a `collections.deque` is...", "Write a Python function ...
  that does the following: <its docstring's first sentence>") and its documentation paragraphs to
  summarize. Read with ``ast``, nothing is imported.
- ``topics:<group>``: seed topics we wrote, crossed with instruction templates (explain, list,
  compare, tips, how-to, story, poem, email).
- ``math:<template>``: arithmetic word problems from templates with seeded numbers.

Held out BY SOURCE: whole topic groups, whole math templates and a hash-chosen share of stdlib
packages appear only in the held-out file, so acceptance there measures prompts of a kind the
drafter never saw. Each line is ``{"messages": [{"role": "user", ...}], "category", "source"}``;
categories are chat, writing, code, summarize and math. The training file is ordered so that any
prefix is a balanced sample (categories by fixed shares, sources in turn within a category):
the data step only reaches a prefix of it.

    python recipes/rebuild/smollm2_prompts.py --out assets/smollm2/data
"""

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
from collections import Counter, defaultdict
from pathlib import Path

SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "ensurepip",
    "__pycache__",
    "turtledemo",
    "pydoc_data",
    "encodings",
    "distutils",
    "__phello__",
}
HELDOUT_TOPIC_GROUPS = {"nature", "arts"}
HELDOUT_MATH = {"train_arrival", "two_numbers"}
PER_MODULE = 14  # prompts per stdlib module at most, so big modules do not crowd out the rest
SHARES = {"chat": 0.34, "code": 0.24, "writing": 0.16, "math": 0.12, "summarize": 0.14}

TOPICS = {
    "science": [
        "photosynthesis",
        "gravity",
        "the water cycle",
        "black holes",
        "DNA",
        "volcanoes",
        "earthquakes",
        "magnetism",
        "the speed of light",
        "atoms",
        "electricity",
        "the immune system",
        "climate change",
        "the greenhouse effect",
        "evolution",
        "the periodic table",
        "sound waves",
        "the moon's phases",
        "solar eclipses",
        "chemical reactions",
        "friction",
        "renewable energy",
        "the human heart",
        "bacteria and viruses",
        "the solar system",
        "rainbows",
        "tides",
        "nuclear energy",
        "plate tectonics",
        "the ozone layer",
    ],
    "history": [
        "the Roman Empire",
        "the Industrial Revolution",
        "ancient Egypt",
        "the printing press",
        "the French Revolution",
        "the Renaissance",
        "World War I",
        "the Cold War",
        "the Silk Road",
        "the invention of the telephone",
        "the Moon landing",
        "ancient Greece",
        "the Vikings",
        "the fall of the Berlin Wall",
        "the Great Depression",
        "the history of the internet",
        "the Ottoman Empire",
        "the American Civil War",
        "the Aztec Empire",
        "the Black Death",
        "the history of writing",
        "the Age of Exploration",
        "the Meiji Restoration",
        "the history of democracy",
        "the building of the pyramids",
    ],
    "cooking": [
        "baking bread",
        "making pasta from scratch",
        "cooking rice",
        "making a vegetable soup",
        "grilling vegetables",
        "making pancakes",
        "storing fresh herbs",
        "seasoning a cast iron pan",
        "making a salad dressing",
        "roasting a chicken",
        "cooking with lentils",
        "making pizza dough",
        "meal prepping for a week",
        "baking cookies",
        "making scrambled eggs",
        "cooking fish",
        "making a smoothie",
        "using leftovers",
        "making tomato sauce",
        "brewing tea",
        "making homemade yogurt",
        "knife skills",
        "baking a simple cake",
        "cooking on a budget",
    ],
    "travel": [
        "visiting Japan",
        "a weekend in Paris",
        "packing for a long flight",
        "traveling on a budget",
        "backpacking in South America",
        "a road trip across the United States",
        "visiting Italy",
        "traveling with kids",
        "camping for the first time",
        "dealing with jet lag",
        "learning basic phrases before a trip",
        "visiting national parks",
        "traveling by train in Europe",
        "staying safe while traveling alone",
        "visiting Iceland",
        "choosing a travel insurance",
        "a city break in London",
        "visiting Mexico",
        "traveling with a pet",
        "planning a honeymoon",
    ],
    "health": [
        "getting better sleep",
        "drinking enough water",
        "starting to run",
        "reducing stress",
        "eating more vegetables",
        "stretching",
        "good posture at a desk",
        "strength training for beginners",
        "meditation",
        "healthy snacks",
        "reducing screen time",
        "walking every day",
        "eating less sugar",
        "keeping your teeth healthy",
        "protecting your skin from the sun",
        "staying active at work",
        "building a morning routine",
        "mindful eating",
        "taking breaks while studying",
        "preventing a cold",
    ],
    "programming": [
        "recursion",
        "a hash table",
        "object-oriented programming",
        "version control with git",
        "a linked list",
        "big O notation",
        "unit testing",
        "an API",
        "a binary search",
        "garbage collection",
        "a database index",
        "functional programming",
        "a REST API",
        "sorting algorithms",
        "a stack and a queue",
        "regular expressions",
        "exceptions",
        "multithreading",
        "a compiler",
        "an interpreter",
        "variables and types",
        "JSON",
        "a closure",
        "caching",
        "code review",
        "debugging",
        "dynamic programming",
        "SQL joins",
        "encryption",
        "a virtual environment in Python",
    ],
    "everyday": [
        "saving money on groceries",
        "organizing a closet",
        "writing a to-do list",
        "learning a new language",
        "public speaking",
        "keeping houseplants alive",
        "cleaning a kitchen",
        "making friends in a new city",
        "preparing for a job interview",
        "time management",
        "writing a resume",
        "studying for an exam",
        "reading more books",
        "decluttering a home",
        "fixing a leaky faucet",
        "choosing a laptop",
        "starting a journal",
        "hosting a dinner party",
        "being a good listener",
        "setting goals",
    ],
    "money": [
        "making a monthly budget",
        "an emergency fund",
        "compound interest",
        "paying off debt",
        "saving for retirement",
        "credit scores",
        "inflation",
        "index funds",
        "renting versus buying a home",
        "avoiding impulse purchases",
        "taxes",
        "the stock market",
        "saving for a holiday",
        "comparing bank accounts",
        "insurance",
    ],
    "nature": [
        "honeybees",
        "the Amazon rainforest",
        "coral reefs",
        "migrating birds",
        "wolves",
        "octopuses",
        "deserts",
        "mushrooms",
        "whales",
        "the changing colors of autumn leaves",
        "elephants",
        "mountains",
        "rivers",
        "butterflies",
        "penguins",
        "the Arctic",
        "ants",
        "forests",
        "owls",
        "sharks",
    ],
    "arts": [
        "impressionist painting",
        "learning the guitar",
        "jazz music",
        "photography for beginners",
        "writing poetry",
        "classical music",
        "street art",
        "sculpture",
        "the history of cinema",
        "drawing portraits",
        "ballet",
        "opera",
        "making pottery",
        "graphic design",
        "theater",
        "composing a song",
        "watercolor painting",
        "architecture",
        "comic books",
        "origami",
    ],
    "sports": [
        "football",
        "swimming",
        "tennis",
        "cycling",
        "the Olympic Games",
        "basketball",
        "yoga",
        "rock climbing",
        "chess",
        "marathon running",
        "skiing",
        "surfing",
        "martial arts",
        "golf",
        "table tennis",
    ],
}
COMPARE = {
    "science": [
        ("weather", "climate"),
        ("a virus", "a bacterium"),
        ("mass", "weight"),
        ("solar power", "wind power"),
        ("an atom", "a molecule"),
        ("speed", "velocity"),
    ],
    "history": [
        ("ancient Athens", "ancient Sparta"),
        ("World War I", "World War II"),
        ("the Roman Republic", "the Roman Empire"),
    ],
    "cooking": [
        ("baking", "roasting"),
        ("butter", "olive oil"),
        ("white rice", "brown rice"),
        ("a gas stove", "an induction stove"),
    ],
    "travel": [
        ("traveling by train", "traveling by plane"),
        ("hotels", "hostels"),
        ("a beach holiday", "a city break"),
    ],
    "health": [("running", "swimming"), ("yoga", "pilates"), ("coffee", "tea")],
    "programming": [
        ("a list", "a tuple in Python"),
        ("Python", "JavaScript"),
        ("SQL", "NoSQL databases"),
        ("a process", "a thread"),
        ("compiled", "interpreted languages"),
        ("git merge", "git rebase"),
        ("an array", "a linked list"),
        ("TCP", "UDP"),
    ],
    "everyday": [("e-books", "paper books"), ("working from home", "working in an office")],
    "money": [("a debit card", "a credit card"), ("stocks", "bonds"), ("saving", "investing")],
    "nature": [("frogs", "toads"), ("alligators", "crocodiles"), ("bees", "wasps")],
    "arts": [("oil painting", "acrylic painting"), ("a novel", "a short story"), ("jazz", "blues")],
    "sports": [("tennis", "badminton"), ("running outdoors", "running on a treadmill")],
}
# Templates per group kind; {t} is the topic.
KNOWLEDGE = [
    "Explain {t} in simple terms.",
    "What should I know about {t}?",
    "Can you explain {t} to a 10-year-old?",
    "List five interesting facts about {t}.",
    "Why is {t} important?",
    "Give me a short overview of {t}.",
]
PRACTICAL = [
    "Give me some tips for {t}.",
    "How do I get started with {t}?",
    "What are common mistakes people make with {t}?",
    "List the steps for {t}.",
    "What are the benefits of {t}?",
    "Explain {t} to a complete beginner.",
]
PROGRAMMING = [
    "Explain {t} in programming.",
    "What is {t} and when should I use it?",
    "Explain {t} with a short Python example.",
    "What are common mistakes with {t}?",
    "Give me a simple analogy for {t}.",
    "What are the advantages and disadvantages of {t}?",
]
WRITING = [
    "Write a short story about {t}.",
    "Write a short poem about {t}.",
    "Write a friendly email to a friend about {t}.",
    "Write a haiku about {t}.",
    "Write a short blog post introduction about {t}.",
]
COMPARE_TEMPLATES = ["Compare {a} and {b}.", "What is the difference between {a} and {b}?"]
GROUP_KIND = {
    "science": KNOWLEDGE,
    "history": KNOWLEDGE,
    "nature": KNOWLEDGE,
    "arts": KNOWLEDGE,
    "sports": KNOWLEDGE,
    "money": PRACTICAL,
    "cooking": PRACTICAL,
    "travel": PRACTICAL,
    "health": PRACTICAL,
    "everyday": PRACTICAL,
    "programming": PROGRAMMING,
}
MATH = {
    "pencils": "A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars?",
    "apples": "Tom has {c} apples and gives {a} of them to his friend. How many apples does he have left?",
    "speed": "A car travels {c} km in {b} hours. What is its average speed?",
    "rectangle": "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "recipe": "A recipe needs {a} eggs for {b} people. How many eggs are needed for {d} people?",
    "discount": "A jacket costs ${c}. It is on sale for {p}% off. What is the sale price?",
    "reading": "Sara reads {a} pages a day. How many days does she need to finish a {c}-page book?",
    "tank": "A tank holds {c} liters and fills at {a} liters per minute. How long does it take to fill it?",
    "class": "There are {c} students in a class and {p}% of them are girls. How many boys are there?",
    "wages": "Mark earns ${a} per hour and works {b} hours a week. How much does he earn in {d} weeks?",
    "train_arrival": "A train leaves at {h}:00 and the trip takes {b} hours and {m} minutes. When does it arrive?",
    "two_numbers": "The sum of two numbers is {c} and their difference is {a}. What are the two numbers?",
}
MATH_PER_TEMPLATE = 30


def _stable_hash(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16)


def _message(text: str, category: str, source: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "category": category, "source": source}


# ---- the standard library ----


def _first_sentence(doc: str) -> str | None:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    sentence = m.group(1) if m else para
    if not 20 <= len(sentence) <= 200 or ">>>" in sentence or not sentence[0].isupper():
        return None
    return sentence


def _prose_paragraphs(doc: str) -> list[str]:
    """Paragraphs of running text (no code, tables or lists) worth summarizing."""
    out = []
    for para in doc.split("\n\n"):
        lines = [ln for ln in para.strip().splitlines()]
        if not lines or any(ln.startswith((" ", "\t", ">>>", "-", "*", "+", "|", "=")) for ln in lines):
            continue
        text = " ".join(" ".join(lines).split())
        if 250 <= len(text) <= 1200 and text.count("(") < 8 and text[-1] in ".!?":
            out.append(text)
    return out


def _signature(node: ast.FunctionDef) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if node.args.vararg:
        args.append("*" + node.args.vararg.arg)
    if node.args.kwarg:
        args.append("**" + node.args.kwarg.arg)
    return f"{node.name}({', '.join(args)})"


def module_prompts(module: str, source: str) -> list[tuple[str, str]]:
    """``(category, text)`` prompts from one module's docstrings, in a fixed order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    doc = ast.get_docstring(tree)
    if doc and _first_sentence(doc):
        found.append(("code", f"What is the Python `{module}` module used for?"))
    for para in _prose_paragraphs(doc or "")[:2]:
        found.append(("summarize", f"Summarize this paragraph from the Python documentation:\n\n{para}"))

    def function(node, owner: str) -> None:
        fdoc = ast.get_docstring(node)
        if node.name.startswith("_") or not fdoc:
            return
        name = f"{owner}.{node.name}"
        sentence = _first_sentence(fdoc)
        if sentence is None:
            return
        h = _stable_hash(name) % 3
        if h == 0:
            found.append(("code", f"What does `{name}` do in Python?"))
        elif h == 1:
            found.append(("code", f"How do I use `{name}` in Python? Show a short example."))
        else:
            found.append(("code", f"Write a Python function `{_signature(node)}` that does the following: {sentence}"))
        for para in _prose_paragraphs(fdoc)[:1]:
            found.append(("summarize", f"Summarize this paragraph from the Python documentation:\n\n{para}"))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function(node, module)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            cdoc = ast.get_docstring(node)
            if cdoc and _first_sentence(cdoc):
                found.append(("code", f"Explain what a `{module}.{node.name}` is in Python and when to use it."))
                for para in _prose_paragraphs(cdoc)[:1]:
                    found.append(("summarize", f"Summarize this paragraph from the Python documentation:\n\n{para}"))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    function(item, f"{module}.{node.name}")
    return found


def stdlib_prompts(stdlib: Path, heldout_per_mille: int) -> tuple[list[dict], list[dict]]:
    train, heldout = [], []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(p in SKIP_DIRS for p in rel.parts[:-1]) or any(p.startswith("_") for p in rel.parts[:-1]):
            continue
        if rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join(parts)
        top = parts[0]
        found = module_prompts(module, path.read_text(encoding="utf-8", errors="replace"))
        # A fixed, name-hashed choice per module, so the set never moves between runs.
        found.sort(key=lambda ct: _stable_hash(ct[1]))
        split = heldout if _stable_hash(top) % 1000 < heldout_per_mille else train
        split.extend(_message(text, cat, f"stdlib:{top}") for cat, text in found[:PER_MODULE])
    return train, heldout


# ---- topics and math ----


def topic_prompts() -> list[dict]:
    out = []
    for group, topics in TOPICS.items():
        source = f"topics:{group}"
        category = "code" if group == "programming" else "chat"
        for t in topics:
            for template in GROUP_KIND[group]:
                out.append(_message(template.format(t=t), category, source))
            for template in WRITING:
                out.append(_message(template.format(t=t), "writing", source))
        for a, b in COMPARE.get(group, []):
            for template in COMPARE_TEMPLATES:
                out.append(_message(template.format(a=a, b=b), category, source))
    return out


def math_prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for name, template in MATH.items():
        for _ in range(MATH_PER_TEMPLATE):
            a, b = rng.randint(2, 12), rng.randint(2, 9)
            values = dict(
                a=a,
                b=b,
                c=a * rng.randint(3, 30),
                d=b * rng.randint(2, 6),
                p=rng.choice([10, 15, 20, 25, 30, 40, 50]),
                h=rng.randint(6, 18),
                m=rng.randint(5, 55),
            )
            if name == "two_numbers":
                values["c"] = a + 2 * rng.randint(3, 40)  # same parity as a: whole-number answers
            out.append(_message(template.format(**values), "math", f"math:{name}"))
    return out


# ---- dedup, split, order ----


def dedup(records: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in records:
        key = " ".join(r["messages"][-1]["content"].lower().split())
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def balanced_order(records: list[dict], seed: int) -> list[dict]:
    """Categories by SHARES, and within a category its sources in turn, each source shuffled.

    So the first N lines hold each category in proportion and each source about equally.
    """
    rng = random.Random(seed)
    by_cat = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_cat[r["category"]][r["source"]].append(r)
    queues = {}
    for cat, sources in by_cat.items():
        lists = [sources[s] for s in sorted(sources)]
        for items in lists:
            rng.shuffle(items)
        rng.shuffle(lists)
        merged = []
        for i in range(max(len(x) for x in lists)):
            merged.extend(x[i] for x in lists if i < len(x))
        queues[cat] = merged
    taken, out = Counter(), []
    while any(taken[c] < len(q) for c, q in queues.items()):
        live = [c for c, q in queues.items() if taken[c] < len(q)]
        c = min(live, key=lambda c: ((taken[c] + 1) / SHARES.get(c, 0.1), c))
        out.append(queues[c][taken[c]])
        taken[c] += 1
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name("." + path.name + ".partial")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for prompts_{train,heldout}.jsonl.")
    parser.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="Standard library root (default: this Python's).",
    )
    parser.add_argument("--heldout-per-mille", type=int, default=80, help="Share of stdlib packages held out.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the math numbers and the order.")
    args = parser.parse_args()

    std_train, std_heldout = stdlib_prompts(args.stdlib, args.heldout_per_mille)
    other = topic_prompts() + math_prompts(args.seed)
    held = lambda r: (
        r["source"].split(":")[1] in HELDOUT_TOPIC_GROUPS
        if r["source"].startswith("topics:")
        else r["source"].split(":")[1] in HELDOUT_MATH
    )
    records = dedup(std_train + std_heldout + other)
    heldout_sources = {r["source"] for r in std_heldout + [r for r in other if held(r)]}
    train = balanced_order([r for r in records if r["source"] not in heldout_sources], args.seed)
    heldout = balanced_order([r for r in records if r["source"] in heldout_sources], args.seed)

    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "prompts_train.jsonl", train)
    write_jsonl(args.out / "prompts_heldout.jsonl", heldout)
    for name, recs in (("train", train), ("heldout", heldout)):
        cats = Counter(r["category"] for r in recs)
        kinds = Counter(r["source"].split(":")[0] for r in recs)
        print(f"{name}: {len(recs)} prompts; {dict(sorted(cats.items()))}; {dict(sorted(kinds.items()))}")
    print(f"held-out sources: {', '.join(sorted(heldout_sources))}")
    print(f"python {sys.version.split()[0]} stdlib")


if __name__ == "__main__":
    main()
