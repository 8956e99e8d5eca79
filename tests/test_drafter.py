import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers.checkpoints import draft_config

from dflash_mlx.loop.cache import make_draft_cache
from dflash_mlx.models.drafter import DraftArgs, DraftModel, default_target_layer_ids


def test_paper_rule_for_target_layer_ids():
    # The official Qwen3-8B drafter: 5 taps on a 36-layer target.
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(12, 1) == [6]
    assert default_target_layer_ids(12, 4) == [1, 4, 6, 9]


def test_both_config_layouts_parse_the_same():
    nested = DraftArgs.from_dict(draft_config(nested=True))
    flat = DraftArgs.from_dict(draft_config(nested=False))
    for args in (nested, flat):
        assert args.target_layer_ids == [1, 2]
        assert args.mask_token_id == 127
        assert args.block_size == 16
        assert args.rope_theta == 10000.0
        assert args.head_dim == 16


def test_missing_layer_ids_follow_the_paper_rule():
    config = draft_config(layers=3, num_target_layers=12)
    del config["dflash_config"]["target_layer_ids"]
    args = DraftArgs.from_dict(config)
    assert args.target_layer_ids == default_target_layer_ids(12, 3)
    assert DraftModel(args).fc.weight.shape == (64, 3 * 64)


def _draft():
    mx.random.seed(4)
    return DraftModel(DraftArgs.from_dict(draft_config()))


def test_context_cache_equals_full_context():
    draft = _draft()
    context = mx.random.normal((1, 9, 2 * 64))
    noise1, noise2 = mx.random.normal((1, 16, 64)), mx.random.normal((1, 16, 64))
    cache = make_draft_cache(draft)
    draft(noise1, context[:, :5], cache)
    assert cache[0].offset == 5  # the noisy block is never cached
    cached = draft(noise2, context[:, 5:], cache)
    full = draft(noise2, context, None)
    assert cache[0].offset == 9
    assert mx.abs(cached - full).max().item() < 1e-5


def test_block_attention_is_bidirectional():
    draft = _draft()
    context = mx.random.normal((1, 4, 2 * 64))
    noise = mx.random.normal((1, 8, 64))
    changed = noise.at[:, 7].add(1.0)
    a, b = draft(noise, context), draft(changed, context)
    # Changing the last block position changes the first one: no causal mask in the block.
    assert mx.abs(a[:, 0] - b[:, 0]).max().item() > 1e-4


def test_per_row_block_offsets_match_single_rows():
    draft = _draft()
    context = mx.random.normal((1, 6, 2 * 64))
    noise = mx.random.normal((2, 4, 64))
    out = draft(noise, context, block_offset=mx.array([6, 9]))
    assert mx.allclose(out[1:], draft(noise[1:], context, block_offset=9), atol=1e-5).item()
    assert mx.allclose(out[:1], draft(noise[:1], context), atol=1e-5).item()


def test_sanitize_drops_borrowed_weights():
    draft = _draft()
    weights = {
        "model.fc.weight": mx.zeros((1,)),
        "embed_tokens.weight": mx.zeros((1,)),
        "lm_head.weight": mx.zeros((1,)),
    }
    assert list(draft.sanitize(weights)) == ["fc.weight"]


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers"])
def test_config_without_required_field_fails(field):
    config = draft_config()
    del config[field]
    with pytest.raises(TypeError):
        DraftArgs.from_dict(config)


def test_cached_drafting_through_the_compiled_steps_matches_the_layers(monkeypatch):
    from dflash_mlx.cpu import compiled_layers
    from dflash_mlx.cpu.speedups import CPU_SPEEDUPS

    draft = _draft()
    context = mx.random.normal((1, 8, 2 * 64))
    noise = [mx.random.normal((1, 16, 64)) for _ in range(3)]

    def cycles(speedups):
        cache = make_draft_cache(draft)
        # New context rows per cycle: 5, none (the taps stayed pending), then 3.
        parts = (context[:, :5], context[:, 5:5], context[:, 5:])
        return [draft(n, c, cache, speedups=speedups) for n, c in zip(noise, parts)]

    calls = []
    after = compiled_layers.after
    monkeypatch.setattr(compiled_layers, "after", lambda *a: calls.append(1) or after(*a))
    compiled = cycles(CPU_SPEEDUPS)
    assert len(calls) == 3 * len(draft.layers)
    # The portable path (no speedups) runs the layers as written.
    for ours, theirs in zip(compiled, cycles(None)):
        assert mx.abs(ours - theirs).max().item() < 1e-5
    assert len(calls) == 3 * len(draft.layers)


def test_the_head_runs_only_for_the_drafts_asked_for(qwen3_pair, monkeypatch):
    """num_drafts=n: the first n rows of the full pass, with the head applied to n rows only."""
    from dflash_mlx.drafts.proposer import DFlashProposer
    from dflash_mlx.loop.cache import make_cache
    from dflash_mlx.models import target as tgt

    model, draft, _ = qwen3_pair
    block = mx.array([[3] + [draft.mask_token_id] * (draft.block_size - 1)])
    taps = mx.random.normal((1, 9, len(draft.target_layer_ids) * draft.args.hidden_size))
    full = draft.propose(model, block, taps, make_draft_cache(draft))
    rows, head = [], tgt.lm_head
    monkeypatch.setattr(tgt, "lm_head", lambda m, h: rows.append(h.shape[-2]) or head(m, h))
    part = draft.propose(model, block, taps, make_draft_cache(draft), num_drafts=3)
    assert rows == [3] and part.shape[1] == 3
    assert mx.allclose(part, full[:, :3], atol=1e-5)
    # The proposer asks for the drafts it will verify.
    cache = make_cache(model, draft)
    cache.append_pending(taps)
    rows.clear()
    DFlashProposer(model, draft, cache).propose(3, 2)
    assert rows == [2]


def _joined_attention(attn, q, k, v, k_ctx, v_ctx):
    # The reference: the whole context copied and joined to the block, then attended to.
    rows = q.shape[0]
    k_ctx = mx.broadcast_to(k_ctx, (rows, *k_ctx.shape[1:]))
    v_ctx = mx.broadcast_to(v_ctx, (rows, *v_ctx.shape[1:]))
    keys, values = mx.concatenate([k_ctx, k], axis=2), mx.concatenate([v_ctx, v], axis=2)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale)


@pytest.mark.parametrize("kind", ["full", "windowed"])
# Cached and new context positions, block rows: empty caches, a buffer filled to its end (256) and
# grown by the block, a window overflowing, and a block of more rows than the context.
@pytest.mark.parametrize("cached,new,rows", [(0, 0, 1), (0, 5, 1), (37, 0, 1), (250, 3, 1), (256, 9, 1), (40, 2, 3)])
@pytest.mark.parametrize("fast_exp", [False, True])
def test_the_block_is_read_after_the_cached_context_without_joining(kind, cached, new, rows, fast_exp):
    """attend equals attention over the joined context and block (fp32), leaves the cache
    holding the context alone, and a second pass over the same cache gives the same output."""
    from mlx_lm.models.cache import KVCache

    from dflash_mlx.loop.cache import WindowedKVCache

    attn = _draft().layers[0].self_attn
    h, d = attn.n_kv_heads, attn.head_dim
    cache = KVCache() if kind == "full" else WindowedKVCache(64, sinks=4)
    old_k, old_v = mx.random.normal((1, h, cached, d)), mx.random.normal((1, h, cached, d))
    if cached:
        cache.update_and_fetch(old_k, old_v)
    k_ctx, v_ctx = mx.random.normal((1, h, new, d)), mx.random.normal((1, h, new, d))
    q = mx.random.normal((rows, attn.n_heads, 16, d))
    k, v = mx.random.normal((rows, h, 16, d)), mx.random.normal((rows, h, 16, d))

    out = attn.attend(q, k, v, k_ctx, v_ctx, cache, None, fast_exp)
    all_k, all_v = mx.concatenate([old_k, k_ctx], axis=2), mx.concatenate([old_v, v_ctx], axis=2)
    if kind == "windowed" and all_k.shape[2] > 68:
        all_k = mx.concatenate([all_k[..., :4, :], all_k[..., -64:, :]], axis=2)
        all_v = mx.concatenate([all_v[..., :4, :], all_v[..., -64:, :]], axis=2)
    expected = _joined_attention(attn, q, k, v, all_k, all_v)
    assert out.shape == expected.shape
    assert mx.abs(out - expected).max().item() < 1e-5
    assert cache.offset == cached + new
    stored_k, stored_v = cache.keys_and_values() if cache.offset else (all_k[..., :0, :], all_v[..., :0, :])
    assert mx.array_equal(stored_k, all_k).item() and mx.array_equal(stored_v, all_v).item()
    # The block was not kept: the next pass (no new context) reads the same context.
    again = attn.attend(q, k, v, k_ctx[..., :0, :], v_ctx[..., :0, :], cache, None, fast_exp)
    assert mx.array_equal(again, out).item() and cache.offset == cached + new


def test_extended_context_equals_the_context_taken_in_by_the_pass():
    """Taps taken in chunk by chunk (the prefill's way) leave the caches as one pass taking
    them all in, and the next pass drafts the same, with and without the compiled steps."""
    from dflash_mlx.cpu.speedups import CPU_SPEEDUPS

    draft = _draft()
    taps = mx.random.normal((1, 300, 2 * 64))
    noise = mx.random.normal((1, 16, 64))
    for speedups in (None, CPU_SPEEDUPS):
        joined, chunked = make_draft_cache(draft), make_draft_cache(draft)
        expected = draft(noise, taps, joined, speedups=speedups)
        for start in range(0, 300, 128):
            draft.extend_context(taps[:, start : start + 128], chunked, speedups)
        out = draft(noise, taps[:, :0], chunked, speedups=speedups)
        assert mx.abs(out - expected).max().item() < 1e-5
        for a, b in zip(joined, chunked):
            assert a.offset == b.offset == 300
            for x, y in zip(a.keys_and_values(), b.keys_and_values()):
                assert mx.abs(x - y).max().item() < 1e-5


def test_the_prefill_leaves_no_taps_pending_and_the_drafts_unchanged(qwen3_pair):
    """A prefill with the drafter takes each chunk's taps into its cache: nothing stays pending,
    and the first draft pass proposes what it proposed when it took the whole prompt in."""
    from dflash_mlx.drafts.proposer import DFlashProposer
    from dflash_mlx.loop.cache import make_cache
    from dflash_mlx.loop.verify import Verifier
    from dflash_mlx.models import target as tgt

    model, draft, _ = qwen3_pair
    prompt = [int(t) for t in mx.random.randint(0, 100, (37,)).tolist()]
    logits = []
    for feeds in (False, True):
        cache = make_cache(model, draft)
        verifier = Verifier(
            model, cache, sampler=None, logits_processors=None, tap_ids=draft.target_layer_ids, speedups=None
        )
        last = verifier.prefill(prompt, 8, DFlashProposer(model, draft, cache) if feeds else None)
        if not feeds:  # the reference: the whole prompt's raw taps, left pending
            _, taps = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, draft.target_layer_ids)
            cache.append_pending(taps)
        assert cache.pending_length == (0 if feeds else 37)
        assert cache.draft_offset + cache.pending_length == len(cache.tokens) == 37
        block = mx.array([[last] + [draft.mask_token_id] * (draft.block_size - 1)])
        logits.append(draft.propose(model, block, cache.take_pending(), cache.draft))
        assert cache.draft_offset == 37
    assert mx.abs(logits[0] - logits[1]).max().item() < 1e-4


def test_a_prefill_after_pending_taps_takes_them_in_first(qwen3_pair):
    """Taps left pending by an earlier turn's last block are raw, the prefill's own are folded by
    the target: the caches take the pending ones first, and the drafts are those of a prefill that
    took the whole prompt raw."""
    from dflash_mlx.drafts.proposer import DFlashProposer
    from dflash_mlx.loop.cache import make_cache
    from dflash_mlx.loop.verify import Verifier
    from dflash_mlx.models import target as tgt

    model, draft, _ = qwen3_pair
    prompt = [int(t) for t in mx.random.randint(0, 100, (37,)).tolist()]
    logits = []
    for pending in (0, 20):
        cache = make_cache(model, draft)
        if pending:
            _, taps = tgt.forward_with_taps(model, mx.array([prompt[:pending]]), cache.target, draft.target_layer_ids)
            cache.append_pending(taps)
            cache.tokens.extend(prompt[:pending])
        verifier = Verifier(
            model, cache, sampler=None, logits_processors=None, tap_ids=draft.target_layer_ids, speedups=None
        )
        last = verifier.prefill(prompt[pending:], 8, DFlashProposer(model, draft, cache) if pending else None)
        if not pending:  # the reference: the whole prompt's raw taps, left pending
            _, taps = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, draft.target_layer_ids)
            cache.append_pending(taps)
        assert cache.pending_length == (0 if pending else 37)
        block = mx.array([[last] + [draft.mask_token_id] * (draft.block_size - 1)])
        logits.append(draft.propose(model, block, cache.take_pending(), cache.draft))
        assert cache.draft_offset == len(cache.tokens) == 37
    assert mx.abs(logits[0] - logits[1]).max().item() < 1e-4


def test_only_a_plain_linear_fc_is_folded():
    draft = _draft()
    blocks = draft.tap_blocks()
    assert sorted(blocks) == [1, 2] and all(b.shape == (64, 64) for b in blocks.values())
    assert mx.array_equal(mx.concatenate([blocks[1], blocks[2]], axis=1), draft.fc.weight).item()
    nn.quantize(draft, group_size=32, bits=8, class_predicate=lambda path, m: path == "fc")
    assert draft.tap_blocks() is None  # its taps go through the quantized fc as they are
    ablation = DraftModel(DraftArgs.from_dict({**draft_config(), "use_target_features": False}))
    assert ablation.tap_blocks() is None
