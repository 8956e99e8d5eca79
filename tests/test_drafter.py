import mlx.core as mx
import pytest
from helpers.checkpoints import draft_config

from dflash_mlx.cache import make_draft_cache
from dflash_mlx.models.drafter import DraftModel, DraftArgs, default_target_layer_ids


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
    ctx = mx.random.normal((1, 9, 2 * 64))
    noise1, noise2 = mx.random.normal((1, 16, 64)), mx.random.normal((1, 16, 64))
    cache = make_draft_cache(draft)
    draft(noise1, ctx[:, :5], cache)
    assert cache[0].offset == 5  # the noisy block is never cached
    cached = draft(noise2, ctx[:, 5:], cache)
    full = draft(noise2, ctx, None)
    assert cache[0].offset == 9
    assert mx.abs(cached - full).max().item() < 1e-5


def test_block_attention_is_bidirectional():
    draft = _draft()
    ctx = mx.random.normal((1, 4, 2 * 64))
    noise = mx.random.normal((1, 8, 64))
    changed = noise.at[:, 7].add(1.0)
    a, b = draft(noise, ctx), draft(changed, ctx)
    # Changing the last block position changes the first one: no causal mask in the block.
    assert mx.abs(a[:, 0] - b[:, 0]).max().item() > 1e-4


def test_per_row_block_offsets_match_single_rows():
    draft = _draft()
    ctx = mx.random.normal((1, 6, 2 * 64))
    noise = mx.random.normal((2, 4, 64))
    out = draft(noise, ctx, block_offset=mx.array([6, 9]))
    assert mx.allclose(out[1:], draft(noise[1:], ctx, block_offset=9), atol=1e-5).item()
    assert mx.allclose(out[:1], draft(noise[:1], ctx), atol=1e-5).item()


def test_sanitize_drops_borrowed_weights():
    draft = _draft()
    weights = {"model.fc.weight": mx.zeros((1,)), "embed_tokens.weight": mx.zeros((1,)), "lm_head.weight": mx.zeros((1,))}
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
    ctx = mx.random.normal((1, 8, 2 * 64))
    noise = [mx.random.normal((1, 16, 64)) for _ in range(3)]

    def cycles(speedups):
        cache = make_draft_cache(draft)
        # New context rows per cycle: 5, none (the taps stayed pending), then 3.
        return [draft(n, c, cache, speedups=speedups) for n, c in zip(noise, (ctx[:, :5], ctx[:, 5:5], ctx[:, 5:]))]

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
    from dflash_mlx.models import target as tgt
    from dflash_mlx.cache import make_cache
    from dflash_mlx.proposer import DFlashProposer

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
