"""Magpie-style user prompts written by the target itself (SmolLM2-135M-Instruct, float32 MLX).

The chat template is rendered up to the start of a user turn (the default system prompt the
template adds, then ``<|im_start|>user\\n``) and the target continues it: what it writes up to
``<|im_end|>`` is a user message of the kind it expects to answer. Sampling: temperature 1.0,
top-p 0.95, at most 80 tokens, ``--batch`` samples per seed, decoded together by mlx-lm's
``BatchGenerator``. One line per seed is appended to ``--raw`` (``{"seed", "samples": [{"text",
"finish"}]}``), so a run stopped at any point resumes with the next seed (a torn line is redone).

Kept (written to ``--out``, rebuilt from the whole raw file on every run): ended with
``<|im_end|>``; 15-400 characters; English-looking; no template tokens or role names; not
ending mid-sentence; not a self-introduction of the assistant; new after lower-casing and
collapsing spaces. Category by keyword rules, first match wins: code (language names, code, function, algorithm,
```...), summarize (summarize, summary, key points...), math (calculate, solve, equation..., an
arithmetic expression, or how many / how much / average / percent... together with a digit),
writing (a request starting with write / compose / draft..., or poem, story, essay, email...),
else chat.
Source ``magpie:bNN`` with NN = sha1("magpie-<seed>") % 12; bucket b00 (about 8%) is held out.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
    OMP_NUM_THREADS=1 python recipes/rebuild/smollm2_magpie.py --model runs/smollm2/target --minutes 30
"""

import argparse
import hashlib
import json
import re
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUCKETS = 12
HELDOUT_BUCKETS = {0}
SENTINEL = "\x00MAGPIE\x00"

CODE = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|rust|golang|sql|html|css|bash|regex|regular expressions?|"
    r"code|coding|programming|algorithms?|debug(ging)?|compiler?|api|json|function|recursion|github)\b|```",
    re.I,
)
SUMMARIZE = re.compile(r"\b(summari[sz]e|summary|tl;?dr|main points|key points|key takeaways)\b", re.I)
MATH_STRONG = re.compile(
    r"\b(calculate|solve|equations?|probability|integral|derivative|algebra|geometry|arithmetic|math|"
    r"mathematics|square root|prime numbers?|fractions?)\b|\d+\s*[-+*/x×÷^=]\s*\d+",
    re.I,
)
MATH_WEAK = re.compile(
    r"\b(how many|how much|sum|average|percent(age)?|area|perimeter|volume|multiply|divide|total)\b|%", re.I
)
WRITING = re.compile(
    r"^(please\s+)?(can you\s+|could you\s+)?(write|compose|draft|rewrite|craft)\b|"
    r"\b(poem|story|essay|letter|e-?mail|blog post|haiku|lyrics|song|slogan|article|speech|limerick|sonnet|"
    r"tagline|cover letter)\b",
    re.I,
)
ENGLISH = {
    "the",
    "a",
    "an",
    "is",
    "are",
    "what",
    "how",
    "why",
    "can",
    "you",
    "i",
    "to",
    "of",
    "and",
    "in",
    "do",
    "does",
    "me",
    "my",
    "for",
    "with",
    "on",
    "be",
    "it",
    "this",
    "that",
    "your",
    "about",
    "please",
    "tell",
    "give",
    "write",
    "explain",
    "who",
    "where",
    "when",
    "which",
    "would",
    "should",
    "could",
}
SELF_INTRO = re.compile(r"\b(smollm|hugging ?face|as an ai|i am an ai|i'm an ai|ai assistant|language model)\b", re.I)
TEMPLATE_BITS = ("<|", "|>", "im_start", "im_end", "endoftext")
ROLE_LINE = re.compile(r"^(user|assistant|system)\s*[:\n]", re.I | re.M)


def bucket(seed: int) -> int:
    return int(hashlib.sha1(f"magpie-{seed}".encode()).hexdigest()[:8], 16) % BUCKETS


def norm_key(text: str) -> str:
    return " ".join(text.lower().split())


def category(text: str) -> str:
    if CODE.search(text):
        return "code"
    if SUMMARIZE.search(text):
        return "summarize"
    if MATH_STRONG.search(text) or (MATH_WEAK.search(text) and re.search(r"\d", text)):
        return "math"
    if WRITING.search(text):
        return "writing"
    return "chat"


def reject_reason(text: str, finish: str) -> str | None:
    """Why a sample is not kept, or None."""
    if finish != "stop":
        return "no_stop"
    if not 15 <= len(text) <= 400:
        return "length"
    if any(b in text for b in TEMPLATE_BITS) or ROLE_LINE.search(text):
        return "template"
    if sum(ord(c) < 128 for c in text) < 0.97 * len(text):
        return "non_ascii"
    words = re.findall(r"[a-z']+", text.lower())
    if (
        len(words) < 3
        or not ENGLISH.intersection(words)
        or sum(len(w) for w in words) < 0.6 * len(text.replace(" ", ""))
    ):
        return "not_english"
    if text[-1] not in ".?!\"')`*]" and not text.endswith("```"):
        return "mid_sentence"
    if SELF_INTRO.search(text):
        return "self_intro"
    return None


def read_raw(path: Path) -> dict[int, list[dict]]:
    done = {}
    if path.is_file():
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    done[int(rec["seed"])] = rec["samples"]
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
    return done


def kept_prompts(raw: dict[int, list[dict]]) -> tuple[list[dict], Counter]:
    seen, out, why = set(), [], Counter()
    for seed in sorted(raw):
        for s in raw[seed]:
            text = s["text"].strip()
            reason = reject_reason(text, s["finish"])
            if reason is None and norm_key(text) in seen:
                reason = "duplicate"
            why[reason or "kept"] += 1
            if reason is None:
                seen.add(norm_key(text))
                out.append(
                    {
                        "messages": [{"role": "user", "content": text}],
                        "category": category(text),
                        "source": f"magpie:b{bucket(seed):02d}",
                    }
                )
    return out, why


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the template up to the content of a first user turn."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    prefix = rendered[: rendered.index(SENTINEL)]
    return tokenizer.encode(prefix, add_special_tokens=False)


def generate(args) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(args.model))
    prefix = user_turn_prefix(tokenizer)
    print(f"prefix ({len(prefix)} tokens): {tokenizer.decode(prefix)!r}", flush=True)
    stop = sorted(set(tokenizer.eos_token_ids) | {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    raw = read_raw(args.raw)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    tic, n_tok, seed = time.perf_counter(), 0, args.first_seed
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    with open(args.raw, "a") as f:
        if f.tell() > 0 and not args.raw.read_bytes().endswith(b"\n"):
            f.write("\n")
        while time.perf_counter() - tic < 60 * args.minutes and (
            args.seeds is None or seed < args.first_seed + args.seeds
        ):
            if seed in raw:
                seed += 1
                continue
            mx.random.seed(seed)
            gen = BatchGenerator(
                model,
                max_tokens=args.max_tokens,
                stop_tokens=[[t] for t in stop],
                sampler=sampler,
                completion_batch_size=args.batch,
                prefill_batch_size=8,
            )
            try:
                uids = gen.insert([list(prefix)] * args.batch, [args.max_tokens] * args.batch)
                toks = {u: [] for u in uids}
                finish = {}
                while responses := gen.next_generated():
                    for r in responses:
                        if r.finish_reason is None or int(r.token) not in stop:
                            toks[r.uid].append(int(r.token))
                        if r.finish_reason is not None:
                            finish[r.uid] = r.finish_reason
            finally:
                gen.close()
            samples = [{"text": tokenizer.decode(toks[u]), "finish": finish.get(u, "length")} for u in uids]
            n_tok += sum(len(toks[u]) + (finish.get(u) == "stop") for u in uids)
            f.write(json.dumps({"seed": seed, "samples": samples}, ensure_ascii=False) + "\n")
            f.flush()
            raw[seed] = samples
            dt = time.perf_counter() - tic
            print(f"seed {seed}: {len(raw)} seeds, {n_tok} tokens this run, {n_tok / dt:.1f} tok/s", flush=True)
            seed += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("runs/smollm2/target"))
    parser.add_argument("--raw", type=Path, default=Path("runs/smollm2/magpie_raw.jsonl"), help="Samples, appended.")
    parser.add_argument(
        "--out", type=Path, default=Path("assets/smollm2/data/magpie.jsonl"), help="Kept prompts (rewritten)."
    )
    parser.add_argument("--minutes", type=float, default=0.0, help="Generate for this long (0: only filter).")
    parser.add_argument("--seeds", type=int, default=None, help="Or stop after this many seeds.")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32, help="Samples per seed, decoded together.")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--temp", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    args = parser.parse_args()
    if args.minutes > 0:
        generate(args)
    raw = read_raw(args.raw)
    kept, why = kept_prompts(raw)
    tmp = args.out.with_name("." + args.out.name + ".partial")
    with open(tmp, "w") as f:
        for r in kept:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    held = sum(r["source"] in {f"magpie:b{b:02d}" for b in HELDOUT_BUCKETS} for r in kept)
    print(f"{len(raw)} seeds, {sum(why.values())} samples: {dict(why.most_common())}")
    print(f"kept {len(kept)} ({held} held out): {dict(Counter(r['category'] for r in kept).most_common())}")


if __name__ == "__main__":
    main()
