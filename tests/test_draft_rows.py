"""Several rows' drafter passes in one: each row's logits are its own pass's, and batched rows stay lossless."""

import mlx.core as mx
import numpy as np
import pytest
from test_batch import LIMITS, PROMPTS, Widest, _drain, _references

from dflash_mlx import LoopOptions, make_cache
from dflash_mlx.cpu import compiled_layers
from dflash_mlx.cpu.speedups import CpuSpeedups
from dflash_mlx.generation import batch_engine, batch_request
from dflash_mlx.loop import batch
from dflash_mlx.loop.cache import make_draft_cache
from dflash_mlx.models import draft_rows


def _taps(draft, n, seed):
    width = len(draft.target_layer_ids) * (draft.args.target_hidden_size or draft.args.hidden_size)
    return mx.random.normal((1, n, width), key=mx.random.key(seed))


def _context(draft, n, seed):
    caches = make_draft_cache(draft)
    draft.extend_context(_taps(draft, n, seed), caches)
    return caches


@pytest.mark.parametrize(("num_drafts", "compiled"), [(15, False), (4, False), (15, True)])
def test_a_batched_drafter_pass_gives_every_row_its_own_passs_logits(qwen3_pair, num_drafts, compiled, monkeypatch):
    """Rows of different context lengths, some with taps still pending: the rows' logits and grown contexts
    equal each row's pass alone (a mask that lets a row see another's padding, or a block at the wrong
    position, fails here)."""
    model, draft, _ = qwen3_pair
    speedups = CpuSpeedups() if compiled else None  # the compiled CPU steps, alone and batched
    lengths, pending, lasts = [5, 23, 1], [3, None, 7], [4, 17, 9]
    alone, alone_caches = [], []
    for r, (n, p, last) in enumerate(zip(lengths, pending, lasts)):
        caches = _context(draft, n, r)
        taps = None if p is None else _taps(draft, p, 10 + r)
        block = mx.array([[last] + [draft.mask_token_id] * (draft.block_size - 1)], dtype=mx.uint32)
        alone.append(draft.propose(model, block, taps, caches, speedups, num_drafts=num_drafts)[0])
        alone_caches.append(caches)
    contexts = [_context(draft, n, r) for r, n in enumerate(lengths)]
    taps = [None if p is None else _taps(draft, p, 10 + r) for r, p in enumerate(pending)]
    assert all(draft_rows.batchable(model, draft, c) for c in contexts)
    steps, before = [], compiled_layers.before
    monkeypatch.setattr(compiled_layers, "before", lambda *a, **k: steps.append(1) or before(*a, **k))
    batched = draft_rows.propose_rows(model, draft, lasts, contexts, taps, num_drafts, speedups)
    assert len(steps) == (len(draft.layers) if compiled else 0)
    assert batched.shape[:2] == (3, num_drafts)
    for r in range(3):
        np.testing.assert_allclose(np.array(batched[r]), np.array(alone[r]), atol=1e-4, rtol=1e-4)
        for got, want in zip(contexts[r], alone_caches[r]):
            assert got.offset == want.offset
            np.testing.assert_allclose(np.array(got.keys[..., : got.offset, :]),
                                       np.array(want.keys[..., : want.offset, :]), atol=1e-5)  # fmt: skip


def test_other_drafters_and_windowed_contexts_draft_row_by_row(qwen3_pair):
    model, draft, _ = qwen3_pair
    assert not draft_rows.batchable(model, draft, make_draft_cache(draft, window=8))
    assert not draft_rows.batchable(model, draft, make_draft_cache(draft))  # an empty context: no prefill yet


@pytest.mark.parametrize("block_size", [16, 5])
def test_rows_draft_together_and_each_reply_equals_it_alone(qwen3_pair, block_size, monkeypatch):
    """The drafter drafts every cycle (no adaptive pauses): batched cycles run the rows' passes as one (a row
    drafts alone there only in a cycle where it is the one row with room for drafts)."""
    model, draft, _ = qwen3_pair
    refs = _references(model)
    engine = batch_engine(model, draft, max_batch=4, prefill_step_size=16, costs=Widest())
    in_cycle, own_passes = [False], []
    cycle, propose = batch.BatchEngine._cycle, type(draft).propose

    def batched_cycle(self):
        in_cycle[0] = True
        try:
            return cycle(self)
        finally:
            in_cycle[0] = False

    def counted(self, *args, **kwargs):
        if in_cycle[0]:
            own_passes.append(1)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(batch.BatchEngine, "_cycle", batched_cycle)
    monkeypatch.setattr(type(draft), "propose", counted)
    ids = []
    for prompt, limit in zip(PROMPTS, LIMITS):
        options = LoopOptions(max_tokens=limit, block_size=block_size, adaptive=False)
        ids.append(engine.add(batch_request(model, draft, prompt, options), lambda: make_cache(model, draft)))
    out, finish = _drain(engine, ids)
    assert [out[i] for i in ids] == refs
    assert engine.drafted_together > 2 * len(PROMPTS), engine.drafted_together
    assert len(own_passes) * 10 < engine.drafted_together, (len(own_passes), engine.drafted_together)


def test_the_drafters_trees_are_verified_whole_alone_and_batched(qwen3_pair, monkeypatch):
    """``tree_budget``: the drafter's trees, drafted in one pass for the rows, are verified whole by a row alone
    and by rows together; every reply is the target's own."""
    from test_batch import count_batched_trees
    from test_text_trees import _count_tree_passes

    model, draft, _ = qwen3_pair
    prompts, limits = PROMPTS[:3], LIMITS[:3]
    refs = _references(model, prompts, limits)
    trees, batched = _count_tree_passes(monkeypatch), count_batched_trees(monkeypatch)
    for max_batch in (1, 3):
        engine = batch_engine(model, draft, max_batch=max_batch, costs=Widest())
        options = [LoopOptions(max_tokens=m, block_size=8, tree_budget=6, adaptive=False) for m in limits]
        ids = [engine.add(batch_request(model, draft, p, o), lambda: make_cache(model, draft))
               for p, o in zip(prompts, options)]  # fmt: skip
        out, _ = _drain(engine, ids)
        assert [out[i] for i in ids] == refs, max_batch
    assert trees and max(trees) > 1, "no row running alone verified a tree"
    assert batched and max(batched) > 0, "no shared pass verified a branching tree"
    assert engine.drafted_together > 0
