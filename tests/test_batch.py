"""Several requests at once: every row equals its request decoded alone, whatever else is in the batch."""

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import VOCAB
from helpers.decoding import greedy, run
from helpers.oracles import ScriptedDraft
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_sampling import CONTROL_RUNS, DEPTH, PROMPT, RUNS, _tv, _tv_bound
from test_sampling import exact as exact  # noqa: F401 (fixtures)
from test_sampling import pair as pair  # noqa: F401

from dflash_mlx import DFlashError, LoopOptions, batch_generate, load, make_cache
from dflash_mlx.drafts.datastore import Datastore
from dflash_mlx.drafts.lookup import PromptLookup
from dflash_mlx.generation import batch_engine, batch_request
from dflash_mlx.loop import batch
from dflash_mlx.models.rows import RowsKVCache, RowsRecurrentCache
from dflash_mlx.models.tree import DraftTree
from dflash_mlx.sampling import make_sampler, speculative_accept
from dflash_mlx.tuning.batch import BatchCosts

# Prompts of different lengths, some repetitive (prompt lookup finds drafts there), and reply lengths.
PROMPTS = [[1, 5, 9, 3] * 2 + [7], [11, 12, 13, 14, 15, 11, 12, 13] * 4, [40, 41] * 30 + [42], [2, 90, 7]]
LIMITS = [40, 25, 60, 33]


@pytest.fixture(scope="module", params=["llama", "qwen3-untied", "qwen2"])
def kind_pair(request, pair_dirs):
    return load(pair_dirs[request.param], pair_dirs["draft"])


def _references(model, prompts=PROMPTS, limits=LIMITS):
    return [greedy(model, p, m) for p, m in zip(prompts, limits)]


def _same_as_alone(result, refs, stop_tokens):
    # Each row is the target's own greedy reply, up to its limit or through its first stop token.
    for got, ref, finish in zip(result.tokens, refs, result.finish_reasons):
        if finish == "stop":
            assert got == ref[: len(got)] and ref[len(got)] in stop_tokens
        else:
            assert finish == "length" and got == ref


@pytest.mark.parametrize(("drafter", "block_size", "max_batch"), [(True, 16, 4), (True, 4, 2), (False, None, 3)])
def test_greedy_rows_equal_each_request_alone(kind_pair, drafter, block_size, max_batch):
    model, draft, tok = kind_pair
    kwargs = {} if block_size is None else {"block_size": block_size}
    result = batch_generate(model, draft if drafter else None, tok, PROMPTS, max_tokens=LIMITS, max_batch=max_batch,
                            prefill_step_size=8, **kwargs)  # fmt: skip
    _same_as_alone(result, _references(model), frozenset(tok.eos_token_ids))


def test_a_moe_targets_rows_equal_each_request_alone(tmp_path):
    """Qwen3-MoE (its experts routed per token, whatever row the token is in), written by transformers."""
    pytest.importorskip("torch")
    from helpers.family import write_pair_folders

    target, _, drafter = write_pair_folders(tmp_path, "qwen3_moe")
    model, draft, tok = load(target, drafter)
    result = batch_generate(model, draft, tok, PROMPTS, max_tokens=LIMITS, max_batch=4, block_size=4,
                            prefill_step_size=8)  # fmt: skip
    _same_as_alone(result, _references(model), frozenset(tok.eos_token_ids))


def test_rows_roll_back_alone_with_drafts_that_are_often_right(qwen3_pair):
    """A datastore holding the replies drafts them: rows keep different numbers of drafts every cycle."""
    model, draft, tok = qwen3_pair
    refs = _references(model)
    store = Datastore(None, VOCAB, min_count=1, learns=True)
    for ref, prompt in zip(refs, PROMPTS):
        store.add(prompt + ref[: len(ref) // 2] + [(ref[len(ref) // 2] + 1) % VOCAB] + ref[len(ref) // 2 + 1 :])
    store.learns = False
    result = batch_generate(model, None, tok, PROMPTS, max_tokens=LIMITS, max_batch=4, datastore=store,
                            block_size=8, prefill_step_size=16)  # fmt: skip
    _same_as_alone(result, refs, frozenset(tok.eos_token_ids))
    drafted = sum(a.accepted_drafts for a in result.acceptance)
    assert drafted > 20, "the datastore's drafts were hardly accepted: the test exercises no rollback"
    lookup = batch_generate(model, PromptLookup(6), tok, PROMPTS, max_tokens=LIMITS, max_batch=3, block_size=6)
    _same_as_alone(lookup, refs, frozenset(tok.eos_token_ids))


def count_batched_trees(monkeypatch) -> list[int]:
    """Per shared pass given trees, how many of its rows' blocks branch (a tree that is no line)."""
    branching = []
    forward_rows = batch.rows_model.forward_rows

    def counted(model, block, caches, tap_ids, speedups=None, trees=None):
        if trees is not None:
            W = block.shape[1]
            line = mx.tril(mx.ones((W, W), dtype=mx.bool_))
            branching.append(int((trees[0] != line).any(axis=(1, 2)).sum()))
        return forward_rows(model, block, caches, tap_ids, speedups, trees)

    monkeypatch.setattr(batch.rows_model, "forward_rows", counted)
    return branching


def count_cut_trees(monkeypatch) -> list[int]:
    """The sizes of the draft trees a shared pass verifies as their likeliest line."""
    cut, first_path = [], DraftTree.first_path

    def counted(self):
        cut.append(self.size)
        return first_path(self)

    monkeypatch.setattr(DraftTree, "first_path", counted)
    return cut


@pytest.mark.parametrize("cpu_speedups", [None, False])
def test_text_trees_are_verified_whole_alone_and_batched(qwen3_pair, monkeypatch, cpu_speedups):
    """A datastore with branches makes draft trees (the tools' defaults): a row alone verifies the tree, rows
    together too where the pass can place each node (the compiled float32 steps), else its first line; either
    way every reply is the target's own."""
    from test_text_trees import _branchy_store, _count_tree_passes, _tree_policy

    model, _, _ = qwen3_pair
    prompts = PROMPTS[:3]
    refs = _references(model, prompts, [40, 40, 40])
    store = _branchy_store(model, prompts)
    trees, batched, cut = (
        _count_tree_passes(monkeypatch),
        count_batched_trees(monkeypatch),
        count_cut_trees(monkeypatch),
    )
    for max_batch in (1, 3):
        engine = batch_engine(model, None, max_batch=max_batch, costs=Widest(), cpu_speedups=cpu_speedups)
        options = LoopOptions(max_tokens=40, block_size=8, datastore=store, policy=_tree_policy())
        ids = [engine.add(batch_request(model, None, p, options), lambda: make_cache(model, None)) for p in prompts]
        out, _ = _drain(engine, ids)
        assert [out[i] for i in ids] == refs, max_batch
    assert trees and max(trees) > 1, "no row running alone verified a tree"
    if cpu_speedups is None:
        assert engine.trees and max(batched) > 0 and not cut, "no shared pass verified a branching tree"
    else:
        assert not engine.trees and cut and max(cut) > 1 and not batched, "no batched row was given a tree"


def _drain(engine, ids):
    out = {i: [] for i in ids}
    finish = {}
    while not engine.idle:
        for e in engine.step():
            out[e.id].extend(e.tokens)
            if e.finish:
                finish[e.id] = e.finish
    return out, finish


def test_requests_join_and_leave_mid_reply_and_cancel(qwen3_pair):
    model, draft, tok = qwen3_pair
    refs = _references(model)
    engine = batch_engine(model, draft, max_batch=3, prefill_step_size=4)

    def request(i, **kwargs):
        options = LoopOptions(max_tokens=LIMITS[i], block_size=5, **kwargs)
        return engine.add(batch_request(model, draft, PROMPTS[i], options), lambda: make_cache(model, draft))

    first = request(0)
    out = {first: []}
    for _ in range(6):
        for e in engine.step():
            out[e.id].extend(e.tokens)
    assert out[first], "the first request produced nothing before the others joined"
    doomed, second, third = request(1), request(2), request(3)
    for _ in range(3):
        for e in engine.step():
            out.setdefault(e.id, []).extend(e.tokens)
    engine.cancel(doomed)
    rest, finish = _drain(engine, [first, doomed, second, third])
    for i, rid in ((0, first), (2, second), (3, third)):
        assert out.get(rid, []) + rest[rid] == refs[i][: LIMITS[i]], i
    assert finish[doomed] == "cancelled"
    got = out.get(doomed, []) + rest[doomed]
    assert got == refs[1][: len(got)]
    assert engine.active == 0 and all(c.rows == 0 for c in engine.target)


def test_logits_processors_and_conversation_caches_per_row(qwen3_pair):
    """Each row applies its own repetition penalty, and a row that leaves gives its conversation cache back."""
    model, draft, tok = qwen3_pair
    penalty = make_logits_processors(repetition_penalty=1.3)
    alone = [run(model, draft, p, max_tokens=m, logits_processors=penalty, block_size=6)[0]
             for p, m in zip(PROMPTS, LIMITS)]  # fmt: skip
    engine = batch_engine(model, draft, max_batch=4, prefill_step_size=8)
    caches = [make_cache(model, draft) for _ in PROMPTS]
    ids = []
    for i, (p, m) in enumerate(zip(PROMPTS, LIMITS)):
        processors = penalty if i % 2 == 0 else None
        options = LoopOptions(max_tokens=m, block_size=6, logits_processors=processors)
        ids.append(engine.add(batch_request(model, draft, p, options, prompt_cache=caches[i]), None))
    out, _ = _drain(engine, ids)
    refs = _references(model)
    for i in range(len(PROMPTS)):
        assert out[ids[i]] == (alone[i] if i % 2 == 0 else refs[i]), i
        # The cache holds the conversation: the prompt and all but the newest token of the reply.
        assert caches[i].tokens == PROMPTS[i] + out[ids[i]][:-1] and caches[i].offset == len(caches[i].tokens)
    # The next turn reuses the cache and still equals the target's own reply.
    turn = PROMPTS[1] + out[ids[1]] + [3, 4]
    engine.add(batch_request(model, draft, turn, LoopOptions(max_tokens=12), prompt_cache=caches[1]), None)
    held = len(caches[1].tokens)
    events = []
    while not engine.idle:
        events += engine.step()
    assert events[0].cached == held
    assert [t for e in events for t in e.tokens] == greedy(model, turn, 12)


def test_rows_cache_rolls_back_each_row_alone():
    cache = RowsKVCache()
    for n in (3, 5):
        c = make_cache_layer(n)
        cache.add(c)
    k = mx.ones((2, 1, 4, 2))
    keys, _ = cache.update_and_fetch(k, k)
    assert cache.lengths == [7, 9] and keys.shape[2] == 9
    cache.trim_rows([3, 1])
    assert cache.lengths == [4, 8]


@pytest.mark.parametrize("kind", ["llama", "qwen3-untied"])
def test_a_rows_pass_runs_the_compiled_cpu_steps_and_matches_each_row_alone(pair_dirs, kind, monkeypatch):
    """Rows of different lengths in one compiled pass give each row's own logits (one pass of that row)."""
    from mlx_lm.models.cache import KVCache

    from dflash_mlx.cpu.speedups import CpuSpeedups
    from dflash_mlx.models import rows, target

    model, _, _ = load(pair_dirs[kind])
    prompts = [PROMPTS[0], PROMPTS[1][:13]]
    block = mx.array([[5, 6, 7], [8, 9, 10]])
    alone = []
    caches = rows.make_rows_cache(model)
    for p, b in zip(prompts, block.tolist()):
        single = [KVCache() for _ in model.model.layers]
        model(mx.array([p]), cache=single)
        for r, c in zip(caches, single):
            r.add(c)
        alone.append(model(mx.array([b]), cache=single)[0])
    used = []
    cpu_block = target.cpu_block
    monkeypatch.setattr(target, "cpu_block", lambda *a: used.append(1) or cpu_block(*a))
    logits, _ = rows.forward_rows(model, block, caches, [], CpuSpeedups())
    assert len(used) == len(model.model.layers), "the rows pass did not run the compiled steps"
    for i in range(2):
        assert mx.allclose(logits[i], alone[i], atol=1e-4).item(), i


@pytest.mark.parametrize("kind", ["llama", "qwen3-untied"])
def test_a_rows_pass_of_draft_trees_gives_every_node_its_own_trees_logits(pair_dirs, kind):
    """Rows of different lengths, two with branching trees and one with a line, in one pass: every node's logits
    are those of that row's tree pass alone (mlx-lm's layers, each node at its own depth), and keeping a row's
    accepted path leaves its entries as the single-stream cache keeps them (a node at the wrong position, or one
    seeing a sibling, fails here)."""
    from mlx_lm.models.cache import KVCache

    from dflash_mlx.cpu.speedups import CpuSpeedups
    from dflash_mlx.loop.proposal import Proposal
    from dflash_mlx.models import rows, target
    from dflash_mlx.models.caches import keep_path

    model, _, _ = load(pair_dirs[kind])
    prompts = [PROMPTS[0], PROMPTS[1][:13], PROMPTS[2][:5]]
    shapes = [
        DraftTree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3, 2], [1, 1, 2, 3, 2]),
        DraftTree([10, 11], [-1, 0, 1], [1, 2]),
        DraftTree([12, 13, 14, 15], [-1, 0, 0, 0, 2], [1, 1, 1, 2]),
    ]
    paths = [[0, 1, 3, 4], [0, 1], [0, 2, 4]]
    caches = rows.make_rows_cache(model)
    assert rows.trees_supported(model, caches, CpuSpeedups())
    alone, kept = [], []
    for p, tree, path in zip(prompts, shapes, paths):
        single = [KVCache() for _ in model.model.layers]
        model(mx.array([p]), cache=single)
        for r, c in zip(caches, single):
            r.add(c)
        start = single[0].offset
        block = mx.array([[p[-1], *tree.tokens]])
        alone.append(target.forward_with_taps(model, block, single, [], tree=tree)[0][0])
        keep_path(single, start, path)
        kept.append(single)
    proposals = [Proposal(mx.array(t.tokens), tree=t) for t in shapes]
    W = 1 + max(t.size for t in shapes)
    block = mx.array([[p[-1], *t.tokens] + [p[-1]] * (W - 1 - t.size) for p, t in zip(prompts, shapes)])
    starts = list(caches[0].lengths)
    logits, _ = rows.forward_rows(model, block, caches, [], CpuSpeedups(), batch._tree_layout(proposals, W))
    for i, tree in enumerate(shapes):
        assert mx.allclose(logits[i, : tree.size + 1], alone[i], atol=1e-4).item(), i
    for i, path in enumerate(paths):
        for c in caches:
            c.keep(i, starts[i], path)
    for c in caches:
        c.trim_rows([W - len(path) for path in paths])
    for i, single in enumerate(kept):
        for r, c in zip(caches, single):
            n = r.lengths[i]
            assert n == c.offset
            assert mx.allclose(r.keys[i, :, :n], c.keys[0, :, :n], atol=1e-5).item(), i
            assert mx.allclose(r.values[i, :, :n], c.values[0, :, :n], atol=1e-5).item(), i


def make_cache_layer(n):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
    return c


def test_refusals_say_what_to_do(qwen3_pair, pair_dirs):
    model, draft, tok = qwen3_pair
    with pytest.raises(DFlashError, match="tree_budget='auto' is not batched"):
        batch_generate(model, draft, tok, PROMPTS[:2], tree_budget="auto")
    with pytest.raises(DFlashError, match="block_size='auto' is not batched"):
        batch_generate(model, draft, tok, PROMPTS[:2], block_size="auto")
    with pytest.raises(DFlashError, match="max_tokens has 1 entries for 2 prompts"):
        batch_generate(model, draft, tok, PROMPTS[:2], max_tokens=[3])


class Widest(BatchCosts):
    """Every row verifies all the drafts it may: drafts that never pay on a tiny model are still checked."""

    def width(self, rows, sizes):
        return 1 + max(sizes, default=0)


def _batched_counts(pair, proposal, runs):
    # ``runs`` sampled rows of PROMPT, decoded eight at a time beside greedy rows of other prompts.
    model, draft, tok = pair
    if proposal == "greedy":
        continuation = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=DEPTH)]
        draft = ScriptedDraft(draft, PROMPT + continuation, VOCAB)
    engine = batch_engine(model, draft, max_batch=8, costs=Widest())
    batched = []
    step = engine.step

    def counted():
        events = step()
        batched.append(sum(e.num_draft > 0 for e in events))
        return events

    engine.step = counted
    sampled = []
    for r in range(runs):
        options = LoopOptions(max_tokens=DEPTH, block_size=DEPTH, sampler=make_sampler(1.0), proposal=proposal)
        sampled.append(engine.add(batch_request(model, draft, PROMPT, options), lambda: make_cache(model, draft)))
        if r % 4 == 0:
            engine.add(batch_request(model, draft, PROMPTS[r % 3], LoopOptions(max_tokens=5, block_size=3)),
                       lambda: make_cache(model, draft))  # fmt: skip
    out, _ = _drain(engine, range(engine._next_id))
    # Most rows' drafts were verified in passes with other rows' drafts.
    assert sum(n for n in batched if n > 1) > 0.8 * runs, batched
    counts = np.zeros((DEPTH, VOCAB))
    for rid in sampled:
        for pos, t in enumerate(out[rid]):
            counts[pos, t] += 1
    return counts


def _excess(counts, exact_marginals, runs):
    return [_tv(counts[p], exact_marginals[p]) - _tv_bound(exact_marginals[p], runs) for p in range(DEPTH)]


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_sampled_rows_batched_with_others_follow_the_target(pair, exact, proposal):  # noqa: F811
    excess = _excess(_batched_counts(pair, proposal, RUNS), exact, RUNS)
    assert max(excess) < 0, excess


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_a_broken_acceptance_rule_fails_the_batched_check(pair, exact, proposal, monkeypatch):  # noqa: F811
    """Negative control: an always-accept rule in the engine must fail the same check."""
    monkeypatch.setattr(batch, "accept_one_hot", lambda d, t: mx.ones(d.shape, dtype=mx.bool_))
    monkeypatch.setattr(
        batch, "speculative_accept", lambda d, q, p: (mx.ones(d.shape, dtype=mx.bool_), speculative_accept(d, q, p)[1])
    )
    excess = _excess(_batched_counts(pair, proposal, CONTROL_RUNS), exact, CONTROL_RUNS)
    assert max(excess) > 0, excess


def test_the_server_decodes_concurrent_requests_together_each_as_alone(qwen3_pair):
    from test_server import PROMPTS as TEXTS
    from test_server import _chat_ids, _post, _request, _stream, _stream_text

    from dflash_mlx import generate
    from dflash_mlx.tools.server.app import DFlashServer
    from dflash_mlx.tools.server.batch_worker import BatchWorker

    model, draft, tokenizer = qwen3_pair
    srv = DFlashServer(model, draft, tokenizer, model_name="tiny", port=0, max_batch=4).start()
    assert isinstance(srv.worker, BatchWorker) and "up to 4 requests together" in srv.batch_note
    expected = [generate(model, draft, tokenizer, _chat_ids(tokenizer, t), max_tokens=20) for t in TEXTS]
    results, rows_seen, answered = {}, [], threading.Event()

    def ask(i):
        body = {"messages": [{"role": "user", "content": TEXTS[i]}], "max_tokens": 20, "temperature": 0}
        try:
            if i % 2:
                results[i] = _stream_text(_stream(srv.url, "/v1/chat/completions", body))
            else:
                status, full, _ = _post(srv.url, "/v1/chat/completions", body)
                results[i] = full["choices"][0]["message"]["content"] if status == 200 else f"HTTP {status}"
        except Exception as e:  # reported by the comparison below
            results[i] = repr(e)

    def watch():
        while not answered.is_set():
            conn, resp = _request(srv.url, "GET", "/metrics")
            lines = resp.read().decode().splitlines()
            conn.close()
            rows_seen.extend(float(line.split()[-1]) for line in lines if line.startswith("dflash:batch_rows"))
            time.sleep(0.01)

    try:
        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TEXTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        answered.set()
        watcher.join()
        assert [results[i] for i in range(len(TEXTS))] == expected
        assert max(rows_seen) > 1, "no two requests were ever decoded together"
        # A stop string ends a batched reply where its text starts.
        cut = expected[4][4:8]
        body = {"messages": [{"role": "user", "content": TEXTS[4]}], "max_tokens": 20, "stop": [cut]}
        status, full, _ = _post(srv.url, "/v1/chat/completions", body)
        assert full["choices"][0]["message"]["content"] == expected[4][: expected[4].index(cut)]
        assert full["choices"][0]["finish_reason"] == "stop"
    finally:
        answered.set()
        srv.close()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_targets_rows_roll_back_each_alone(tmp_path, kind, monkeypatch):
    """Gated DeltaNet layers keep a state per row; each row goes back to its own kept length every cycle."""
    pytest.importorskip("torch")
    from helpers.family import write_pair_folders

    target, _, drafter = write_pair_folders(tmp_path, kind)
    model, draft, tok = load(target, drafter)
    refs = _references(model)
    store = Datastore(None, VOCAB, min_count=1, learns=True)
    for ref, prompt in zip(refs, PROMPTS):  # right for the first half of each reply, then wrong once
        store.add(prompt + ref[: len(ref) // 2] + [(ref[len(ref) // 2] + 1) % VOCAB] + ref[len(ref) // 2 + 1 :])
    store.learns = False
    rollbacks = []
    trim_rows = RowsRecurrentCache.trim_rows
    monkeypatch.setattr(
        RowsRecurrentCache, "trim_rows", lambda self, counts: rollbacks.append(counts) or trim_rows(self, counts)
    )
    accepted = []
    for drafting in ({"datastore": store, "block_size": 8}, {"block_size": 4}):
        result = batch_generate(model, None if "datastore" in drafting else draft, tok, PROMPTS, max_tokens=LIMITS,
                                max_batch=4, prefill_step_size=8, **drafting)  # fmt: skip
        _same_as_alone(result, refs, frozenset(tok.eos_token_ids))
        accepted.append(sum(a.accepted_drafts for a in result.acceptance))
    assert accepted[0] > 20, "the datastore's drafts were hardly accepted: no row kept part of a block"
    # Rows of one pass went back by different numbers of tokens.
    assert any(len(set(c)) > 1 for c in rollbacks), rollbacks[:5]


def test_hybrid_rows_keep_each_rows_own_state_after_a_rollback(tmp_path):
    """After one batched pass and a different rollback per row, each row's states are those of its kept
    tokens decoded alone (greedy outputs alone could miss a wrong state on a tiny random target)."""
    pytest.importorskip("torch")
    from helpers.hf_checkpoints import write_hf_target

    from dflash_mlx.models import hybrid, rows

    write_hf_target(tmp_path, "qwen3_5")
    model, _, _ = load(tmp_path)
    prompts, blocks, drops = (
        [PROMPTS[0], PROMPTS[1][:13], PROMPTS[3]],
        [[5, 6, 7, 8], [9, 10, 11, 12], [13] * 4],
        [3, 0, 1],
    )
    caches = rows.make_rows_cache(model)
    for p in prompts:
        single = hybrid.make_cache(model)
        model(mx.array([p]), cache=single)
        for r, c in zip(caches, single):
            r.add(c)
    rows.forward_rows(model, mx.array(blocks), caches, [])
    for c in caches:
        c.trim_rows(drops)
    for i, (p, b, n) in enumerate(zip(prompts, blocks, drops)):
        alone = hybrid.make_cache(model)
        model(mx.array([p + b[: len(b) - n]]), cache=alone)
        for r, c in zip(caches, alone):
            if isinstance(r, RowsRecurrentCache):
                assert r.offsets[i] == c.offset
                for ours, theirs in zip(r.cache, c.cache):
                    assert mx.allclose(ours[i], theirs[0], atol=1e-4).item(), (i, n)
            else:
                assert r.lengths[i] == c.offset


def _llama_with_sliding_layers(path):
    import json

    from helpers.checkpoints import write_target

    write_target(path, kind="llama", layers=4)
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["gpt_oss", "llama-sliding"])
def test_sliding_window_rows_equal_each_request_alone(tmp_path, kind, monkeypatch):
    """Sliding-window layers (a window of 6, caches that drop old positions within these runs): each row sees
    its own last positions only, and goes back to a single-sequence window cache when it runs alone."""
    from helpers.checkpoints import write_draft
    from helpers.family import small_sliding_caches

    small_sliding_caches(monkeypatch)
    if kind == "gpt_oss":
        pytest.importorskip("torch")
        from helpers.hf_checkpoints import write_hf_target

        write_hf_target(tmp_path / "target", kind)
    else:
        _llama_with_sliding_layers(tmp_path / "target")
    write_draft(tmp_path / "draft")
    model, draft, tok = load(tmp_path / "target", tmp_path / "draft")
    assert any(getattr(c, "window", None) for c in batch.rows_model.make_rows_cache(model))
    refs = _references(model)
    for drafter, block_size in ((draft, 4), (PromptLookup(6), 6)):
        result = batch_generate(model, drafter, tok, PROMPTS, max_tokens=LIMITS, max_batch=4, block_size=block_size,
                                prefill_step_size=8)  # fmt: skip
        _same_as_alone(result, refs, frozenset(tok.eos_token_ids))


# Not "gemma4" (the large models' layout, with experts): on its tiny random target a router near-tie sends
# one position to other experts in a batched pass than in a single one (the batched pass agrees with a full
# forward of the sequence, mlx-lm's one-token steps do not), so its greedy text may part at float rounding.
@pytest.mark.parametrize("kind", ["gemma4_text", "kimi_k25"])
def test_gemma_and_kimi_rows_equal_each_request_alone(tmp_path, kind, monkeypatch):
    """Gemma 4 (sliding layers, per-layer inputs, layers reusing others' keys) and Kimi K2.5 (latent attention)."""
    pytest.importorskip("torch")
    from helpers.family import gemma_draft_config, small_sliding_caches, write_targets

    small_sliding_caches(monkeypatch)
    draft = gemma_draft_config() if kind.startswith("gemma") else None
    folders = write_targets(tmp_path, [kind], draft=draft)
    model, drafter, tok = load(folders[kind][0], folders["draft"][0])
    refs = _references(model)
    result = batch_generate(model, drafter, tok, PROMPTS, max_tokens=LIMITS, max_batch=4, block_size=4,
                            prefill_step_size=8)  # fmt: skip
    _same_as_alone(result, refs, frozenset(tok.eos_token_ids))
