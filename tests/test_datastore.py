"""The datastore: drafts from the target's own past text, lossless in the loop."""

import random

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import VOCAB
from helpers.decoding import greedy, run
from helpers.policy import Clock, CostlyDraft

from dflash_mlx import DFlashError, stream_generate
from dflash_mlx.drafts.datastore import (
    Datastore,
    DatastoreProposer,
    SuffixIndex,
    load_datastore,
    read_responses,
    suffix_array,
)
from dflash_mlx.drafts.lookup import PromptLookup
from dflash_mlx.tools.session import default_pair_answers, open_datastore
from dflash_mlx.tuning.policy import PolicyState


def reference(model, prompt, max_tokens=120):
    return greedy(model, prompt, max_tokens)


def _prompt(length, seed):
    return mx.random.randint(0, VOCAB - 4, (length,), key=mx.random.key(seed)).tolist()


@pytest.mark.parametrize("alphabet", [2, 3, 50])
def test_suffix_array_is_the_sorted_suffixes(alphabet):
    rng = random.Random(alphabet)
    for _ in range(60):
        tokens = np.array([rng.randrange(alphabet) for _ in range(rng.randint(1, 60))])
        expected = sorted(range(len(tokens)), key=lambda i: tokens[i:].tolist())
        assert suffix_array(tokens).tolist() == expected
        # Sorted by the first 4 tokens, ties in text order.
        assert suffix_array(tokens, 4).tolist() == sorted(
            range(len(tokens)), key=lambda i: (tokens[i : i + 4].tolist(), i)
        )


def test_draft_follows_the_longest_match_and_the_most_frequent_continuation():
    docs = [[1, 2, 3, 4, 5], [7, 2, 3, 4, 6], [8, 2, 3, 4, 6], [9, 1, 2, 3, 9]]
    store = Datastore(SuffixIndex.build(docs, 10), 10, min_count=1, min_step=0.0, min_path=0.0)
    # "2 3" is followed by 4 three times out of four, then 6 twice of three.
    assert store.draft([0, 2, 3], 4).tokens == [4, 6]
    # The longer match "1 2 3" has two continuations, 4 and 9, once each; 4 sorts first.
    found = store.draft([0, 1, 2, 3], 4)
    assert found.match == 3 and found.tokens[0] in (4, 9)
    # Nothing crosses a document's end.
    assert store.draft([4, 5], 4).tokens == []
    # No match of min_order tokens: no drafts.
    assert store.draft([5, 5, 5], 4) == store.draft([], 4)


def test_draft_stops_where_the_continuation_is_unsure():
    docs = [[1, 2, 3, 4]] * 3 + [[1, 2, 3, 5]] * 3 + [[1, 2, 9]]
    strict = Datastore(SuffixIndex.build(docs, 10), 10, min_step=0.6, min_path=0.0, min_count=1)
    assert strict.draft([1, 2], 4).tokens == [3]  # 3 follows "1 2" 6 times of 7; then 4 or 5 at 1/2
    loose = Datastore(SuffixIndex.build(docs, 10), 10, min_step=0.4, min_path=0.0, min_count=1)
    assert loose.draft([1, 2], 4).tokens == [3, 4]
    counted = Datastore(SuffixIndex.build(docs, 10), 10, min_step=0.0, min_path=0.0, min_count=7)
    assert counted.draft([1, 2], 4).tokens == []


def test_a_longer_match_too_rare_to_draft_backs_off_to_a_shorter_one():
    # "1 2 3" occurred once (too few), "2 3" three times, always followed by 4.
    docs = [[1, 2, 3, 9], [7, 2, 3, 4], [8, 2, 3, 4], [6, 2, 3, 4]]
    store = Datastore(SuffixIndex.build(docs, 10), 10, min_count=2)
    found = store.draft([1, 2, 3], 2)
    assert found.tokens == [4] and found.match == 2 and found.shares == [0.75]
    assert Datastore(SuffixIndex.build(docs, 10), 10, min_count=2, min_order=3).draft([1, 2, 3], 2).tokens == []


def test_session_replies_are_searched_first_and_bounded():
    store = Datastore(SuffixIndex.build([[1, 2, 3]], 10), 10, min_count=1, session_tokens=8)
    assert store.draft([1, 2], 3).tokens == [3]
    store.add([1, 2, 7, 7])
    assert store.draft([1, 2], 3).tokens[0] == 7  # the session's own text wins a tie
    store.add([4, 4, 4, 4, 4])  # over the cap: the oldest reply goes
    assert store.session_length == 5 and store.draft([1, 2], 3).tokens == [3]
    assert store.nbytes > 0


def test_a_phrase_the_session_said_once_does_not_hide_the_cache():
    # The cache continues [1, 2] with 3 every time; the session said [1, 2, 9] once, too few to draft.
    store = Datastore(SuffixIndex.build([[1, 2, 3, 4]] * 3, 10), 10, min_count=2)
    assert store.draft([1, 2], 2).tokens == [3, 4]
    store.add([5, 1, 2, 9])
    draft = store.draft([1, 2], 2)
    assert draft.tokens == [3, 4] and draft.match == 2 and draft.shares == [1.0, 1.0]
    store.add([6, 1, 2, 9])  # twice now: the session's own continuation wins
    assert store.draft([1, 2], 2).tokens == [9]


def test_built_once_and_kept(tmp_path):
    cache = tmp_path / "responses.jsonl"
    cache.write_text(
        '{"key": "a", "prompt_ids": [1], "response_ids": [5, 6, 7, 8], "finish_reason": "stop"}\n'
        '{"key": "b", "prompt_ids": [1], "response_ids": [5, 6, 7, 9], "finish_reason": "stop"}\n'
    )
    first = load_datastore(cache, 10, cache_dir=tmp_path / "kept", min_count=1)
    assert len(list((tmp_path / "kept").iterdir())) == 1
    again = load_datastore(cache, 10, cache_dir=tmp_path / "kept", min_count=1)
    assert np.array_equal(first.fixed.sa, again.fixed.sa) and again.draft([5, 6], 2).tokens == [
        7,
        8,
    ]  # a tie goes to the smaller id
    assert read_responses(cache) == [[5, 6, 7, 8], [5, 6, 7, 9]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(DFlashError, match="Cannot read the response cache"):
        load_datastore(bad, 10, cache_dir=tmp_path / "kept")


def test_the_proposer_queries_the_text_up_to_the_last_committed_token():
    """The drafts follow ``history + [last]``: "5 6 7" goes on "1 2", while "4 5 6" (one token early) would
    draft "7 8". (Querying without ``last`` fails it.)"""
    docs = [[4, 5, 6, 7, 8, 9], [3, 5, 6, 7, 1, 2, 0]]
    store = Datastore(SuffixIndex.build(docs, 10), 10, min_count=1, min_step=0.0, min_path=0.0)
    history = [9, 4, 5, 6]
    assert DatastoreProposer(store, history, 8).propose(7, 4).tokens.tolist() == [8, 9]
    history = [3, 5, 6]
    assert DatastoreProposer(store, history, 8).propose(7, 4).tokens.tolist() == [1, 2, 0]


def _stores(model):
    """Datastores over the target's own greedy text, over a corrupted copy of it, and over noise."""
    texts = [reference(model, _prompt(n, seed), 120) for n, seed in ((7, 3), (30, 4), (1, 5))]
    rng = random.Random(0)
    corrupted = [[t if rng.random() > 0.2 else rng.randrange(VOCAB) for t in text] for text in texts]
    noise = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(3)]
    return {
        name: Datastore(SuffixIndex.build(docs, VOCAB), VOCAB, min_count=1)
        for name, docs in (("exact", texts), ("corrupted", corrupted), ("noise", noise))
    }


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_lossless_with_a_datastore_alone(varied_qwen3_pair, block_size):
    model, _, _ = varied_qwen3_pair
    stores = _stores(model)
    for prompt in (_prompt(7, 3), _prompt(30, 4), _prompt(1, 5)):
        ref = reference(model, prompt)
        for name, store in stores.items():
            out, cycles = run(model, None, prompt, block_size=block_size, max_tokens=len(ref), datastore=store)
            assert out == ref, (name, block_size, len(prompt))
            if name == "exact" and len(prompt) > 1:
                # The target's own text: most drafts are right (a query one token early gets few).
                drafted = sum(c.num_draft for c in cycles if c.source == "datastore")
                accepted = sum(c.num_accepted for c in cycles if c.source == "datastore")
                assert drafted and accepted >= 0.8 * drafted, (accepted, drafted)


def test_lossless_with_prompt_lookup_and_a_datastore(varied_qwen3_pair):
    model, _, _ = varied_qwen3_pair
    store = _stores(model)["corrupted"]
    for prompt in (_prompt(7, 3), _prompt(30, 4)):
        ref = reference(model, prompt)
        out, cycles = run(model, PromptLookup(8), prompt, max_tokens=len(ref), datastore=store)
        assert out == ref
        assert {c.source for c in cycles[1:]} <= {"lookup", "datastore", ""}


@pytest.mark.parametrize("block_size", [4, 16])
def test_lossless_in_the_adaptive_policys_paused_cycles(varied_qwen3_pair, block_size):
    """A drafter that always loses is paused; its paused cycles verify the datastore's drafts."""
    model, draft, _ = varied_qwen3_pair
    store = _stores(model)["exact"]
    prompt = _prompt(1, 5)  # the text repeats no two tokens before the first paused cycle
    ref = reference(model, prompt)
    clock = Clock(step=0.01)
    losing = CostlyDraft(draft, prompt + ref, clock, seconds=1.0, wrong_every=1)
    # Measured before, so the first cycle is a paused one: the text repeats no two tokens yet, so
    # the datastore drafts before prompt lookup's one-token match.
    policy = PolicyState.restored({"plain_time": 0.01}, clock=clock)
    passes = []
    propose = CostlyDraft.propose
    with pytest.MonkeyPatch.context() as m:
        m.setattr(CostlyDraft, "propose", lambda self, *a, **k: passes.append(1) or propose(self, *a, **k))
        out, cycles = run(model, losing, prompt, block_size=block_size, max_tokens=len(ref), policy=policy,
                          datastore=store)  # fmt: skip
    assert out == ref
    # The drafter ran (its cycles merge its drafts with the datastore's, whose exact ones win), and paused.
    assert "datastore" in {c.source for c in cycles[1:] if c.num_draft}
    assert 0 < len(passes) < len(cycles) - 1


def test_replies_join_the_datastore(varied_qwen3_pair):
    model, draft, tokenizer = varied_qwen3_pair
    # min_count=1: a reply of varied text says each phrase once, and it is drafted from all the same.
    store = Datastore(None, VOCAB, min_count=1)
    prompt = _prompt(7, 3)
    responses = list(stream_generate(model, None, tokenizer, prompt, max_tokens=20, datastore=store))
    assert store.session_length == responses[-1].generation_tokens == 20
    # The same prompt again: the reply is drafted from the first one, and is the same text.
    again = list(stream_generate(model, None, tokenizer, prompt, max_tokens=20, datastore=store))
    assert [t for r in again for t in r.tokens] == [t for r in responses for t in r.tokens]
    assert again[-1].accepted_by_source.get("datastore", 0) > 0


def test_block_size_with_a_datastore_alone(varied_qwen3_pair):
    model, _, _ = varied_qwen3_pair
    with pytest.raises(DFlashError, match="from 1 to 64 with a datastore alone"):
        run(model, None, [1, 2, 3], block_size=0, datastore=Datastore(None, VOCAB))


def test_open_datastore_as_the_tools_ask(tmp_path, monkeypatch):
    from dflash_mlx.drafts import datastore as ds

    assert open_datastore("none", None, 10) is None
    other = open_datastore("auto", str(tmp_path), 10)  # not the default pair: its replies only
    assert other.fixed is None and other.session_length == 0
    with pytest.raises(DFlashError, match="--datastore missing.jsonl: no such file"):
        open_datastore("missing.jsonl", None, 10)
    built = []
    monkeypatch.setattr(ds, "load_datastore", lambda path, vocab, **kw: built.append(path) or "store")
    assert open_datastore("auto", None, 10) == "store" and built == [default_pair_answers()]
    assert open_datastore(None, "smollm2", 10) == "store"
    assert default_pair_answers().is_file()  # it ships with the package
    given = tmp_path / "mine.jsonl"
    given.write_text("")
    assert open_datastore(str(given), "dflash-tiny", 10) == "store" and built[-1] == given


def test_the_python_apis_default_datastore_is_the_default_pairs_answers_for_its_drafter_alone(
    pair_dirs, tmp_path, monkeypatch
):
    # stream_generate's datastore="auto" (its default): the tools' default store when the drafter is
    # the default pair's (the tiny drafter stands in for it here), nothing for any other pair.
    import json

    from dflash_mlx import batch_generate, generate, load
    from dflash_mlx.drafts import datastore as ds

    model, draft, tokenizer = load(str(pair_dirs["qwen3-tied"]), str(pair_dirs["draft"]))
    assert draft.folder == pair_dirs["draft"]
    monkeypatch.setattr(ds, "_PAIR_STORES", {})
    prompt = _prompt(7, 3)

    def tokens(**kwargs):
        return [t for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=24, **kwargs) for t in r.tokens]

    alone = tokens(datastore=None)
    assert alone == reference(model, prompt, 24)[: len(alone)]
    # Not the default pair's drafter: as before, no datastore opened (the tests' tiny pairs).
    assert tokens() == alone and ds._PAIR_STORES == {}
    answers = tmp_path / "responses.jsonl"
    answers.write_text("\n".join(json.dumps({"response_ids": alone}) for _ in range(2)))
    monkeypatch.setattr(ds, "default_pair_draft", lambda: pair_dirs["draft"])
    monkeypatch.setattr(ds, "default_pair_answers", lambda: answers)
    assert tokens() == alone  # lossless
    (store,) = ds._PAIR_STORES.values()
    assert store.fixed is not None and store.session_length == len(alone)  # the answers, and the reply joined
    generate(model, draft, tokenizer, prompt, max_tokens=24)
    assert list(ds._PAIR_STORES.values()) == [store] and store.session_length == 2 * len(alone)  # opened once
    assert batch_generate(model, draft, tokenizer, [prompt], max_tokens=24).tokens == [alone]
    assert list(ds._PAIR_STORES.values()) == [store] and store.session_length == 3 * len(alone)
    assert ds.pair_datastore(model, None) is None  # plain decoding stays plain
    with pytest.raises(DFlashError, match="datastore must be 'auto', None or a Datastore"):
        tokens(datastore="none")
