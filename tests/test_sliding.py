"""The sliding-window cache of gpt-oss, Llama sliding layers and Gemma 4 on its own: keys that
are their positions show what each pass sees after any trim, checkpoint and restore."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from dflash_mlx import DFlashError
from dflash_mlx.models.sliding import SlidingKVCache

W, SLACK, STEP = 6, 5, 4


def _cache() -> SlidingKVCache:
    c = SlidingKVCache(W, slack=SLACK)
    c.step = STEP
    return c


def _pass(c: SlidingKVCache, n: int):
    """A pass of ``n`` positions: (the positions it sees, its mask)."""
    mask = c.make_mask(n, window_size=W)
    pos = mx.arange(c.offset, c.offset + n, dtype=mx.float32).reshape(1, 1, n, 1)
    keys, values = c.update_and_fetch(pos, pos + 0.5)
    assert mx.array_equal(values, keys + 0.5).item()
    return [int(p) for p in keys[0, 0, :, 0].tolist()], mask


def _visible(offset: int, n: int) -> list[int]:
    # What a pass of n at offset may see: the window - 1 positions before it and itself.
    return list(range(max(0, offset - (W - 1)), offset + n))


def _dense(mask, N: int, L: int) -> mx.array:
    if mask is None:
        return mx.ones((N, L), dtype=mx.bool_)
    if isinstance(mask, str):
        return create_causal_mask(N, L - N)
    return mask


@pytest.mark.parametrize("prefix", [0, 3, 11, 40])
def test_trim_equals_a_shorter_pass_at_every_n(prefix):
    """After a prefix and a block of 8, trim(n) for every n the cache keeps (the block and the
    slack before it) leaves what a shorter run leaves: the next passes see the same positions."""
    block = 8
    for n in range(0, min(block + SLACK, prefix + block) + 1):
        c = _cache()
        if prefix:
            _pass(c, prefix)
        _pass(c, block)
        assert c.can_trim(n) and c.trim(n) == n and c.offset == prefix + block - n
        straight = _cache()
        if c.offset:
            _pass(straight, c.offset)
        for nxt in (1, 5):
            other = straight.make_mask(nxt, window_size=W)
            seen, mask = _pass(c, nxt)
            assert seen == _visible(c.offset - nxt, nxt) == _pass(straight, nxt)[0], (prefix, n)
            assert mx.array_equal(_dense(mask, nxt, len(seen)), _dense(other, nxt, len(seen))).item()
            c.trim(nxt), straight.trim(nxt)


def test_random_passes_and_trims_see_the_window():
    """Passes of any length and trims of any length the cache allows: each pass sees exactly the
    window before it, and a refused trim changes nothing."""
    rng = random.Random(0)
    c = _cache()
    for _ in range(300):
        if rng.random() < 0.6:
            n = rng.choice([1, 1, 2, 3, 7, 16])
            offset = c.offset
            seen, _ = _pass(c, n)
            assert seen == _visible(offset, n)
        else:
            n = rng.randrange(0, 25)
            before = (c.offset, c.start)
            if c.can_trim(n):
                c.trim(n)
            else:
                with pytest.raises(DFlashError):
                    c.trim(n)
                assert (c.offset, c.start) == before


def test_a_trim_past_what_it_keeps_is_refused():
    c = _cache()
    _pass(c, 40)
    _pass(c, 3)
    assert c.start == 40 - (W - 1 + SLACK) and c.floor == c.start + W - 1 == 43 - SLACK - 3
    assert c.restorable_lengths() == {0} | set(range(c.floor, 44))
    assert not c.can_trim(SLACK + 4) and not c.can_trim(43 - 1)
    with pytest.raises(DFlashError, match=f"cannot go back to {c.floor - 1} tokens: it keeps positions from 30 on"):
        c.trim(SLACK + 4)
    assert c.offset == 43
    # Back to the empty cache is always possible.
    assert c.can_trim(43) and c.trim(43) == 43 and c.offset == c.start == c.stored == 0 and c.empty()
    assert _pass(c, 2)[0] == [0, 1]


def test_memory_stays_bounded():
    """At most the window, the slack, a step and the pass are stored, and a long pass's buffer is
    renewed at the next one."""
    c = _cache()
    for i in range(200):
        n = 1 + i % 9
        _pass(c, n)
        assert c.stored <= W - 1 + SLACK + STEP + n
        assert c.keys.shape[2] <= W - 1 + SLACK + 3 * STEP + n
    _pass(c, 100)
    assert c.stored >= 100 + W - 1 + SLACK  # all of the pass and the slack can still be trimmed
    _pass(c, 1)
    assert c.stored == W - 1 + SLACK + 1 and c.keys.shape[2] <= W - 1 + SLACK + 1 + STEP
    assert c.keys_and_values()[0].shape[2] == c.stored


def test_restore_to_checkpoints():
    """Passes with no trim between them are a prefill: its end is kept and restored exactly, also
    after the window has moved far past it; checkpoints past a trim's end are dropped."""
    c = _cache()
    _pass(c, 30)
    _pass(c, 12)  # a prefill in two chunks: the first one's end is saved
    assert set(c.checkpoints) == {30}
    for _ in range(40):  # decoding: one pass and a trim each; the prefill's end is saved at the first
        _pass(c, 4)
        c.trim(3)
    assert set(c.checkpoints) == {30, 42} and c.floor > 42 and {30, 42} <= c.restorable_lengths()
    c.restore(30)
    assert (c.offset, c.start, c.floor) == (30, 30 - (W - 1), 30)
    assert c.restorable_lengths() == {0, 30} | set(c.checkpoints)
    assert _pass(c, 3)[0] == _visible(30, 3)
    c.checkpoint()
    for _ in range(10):  # writes into the renewed buffer leave the saved state alone
        _pass(c, 5)
        c.trim(4)
    c.restore(33)
    assert _pass(c, 2)[0] == _visible(33, 2)
    c.restore(30)
    assert _pass(c, 2)[0] == _visible(30, 2) and set(c.checkpoints) == {30}
    # A trim to before a checkpoint: the positions after it will be other tokens.
    c.checkpoint()
    assert 32 in c.checkpoints
    c.trim(1)
    assert 32 not in c.checkpoints and 32 not in c.restorable_lengths() - set(range(c.floor, c.offset + 1))
    c.restore(0)
    assert c.empty() and c.offset == 0 and not c.checkpoints


@pytest.mark.parametrize("seen_before", [0, 2, 5, 9, 30])
@pytest.mark.parametrize("N", [1, 3, 6, 16])
def test_mask_and_attention_equal_mlx_lms_window(seen_before, N):
    """The mask for the keys a pass sees equals mlx-lm's windowed causal mask over those keys, and
    attention with it equals attention over every key with mlx-lm's mask."""
    c = _cache()
    if seen_before:
        _pass(c, seen_before)
    offset = c.offset
    mask = c.make_mask(N, window_size=W)
    seen, _ = _pass(c, N)
    start = seen[0]
    expected = create_causal_mask(N, offset, window_size=W)[:, start:]
    assert mx.array_equal(_dense(mask, N, len(seen)), expected).item()
    assert (mask is None) == (N == 1) and isinstance(c.make_mask(N, return_array=True), mx.array)
    # Real attention: the cache's keys and mask against all keys and mlx-lm's mask.
    k_all = mx.random.normal((1, 2, offset + N, 8), key=mx.random.key(1))
    v_all = mx.random.normal((1, 2, offset + N, 8), key=mx.random.key(2))
    q = mx.random.normal((1, 2, N, 8), key=mx.random.key(3))
    c = _cache()
    if offset:
        c.update_and_fetch(k_all[..., :offset, :], v_all[..., :offset, :])
    mask = c.make_mask(N, window_size=W)
    k, v = c.update_and_fetch(k_all[..., offset:, :], v_all[..., offset:, :])
    ours = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    full = create_causal_mask(N, offset, window_size=W)
    theirs = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=0.3, mask=full)
    assert mx.allclose(ours, theirs, atol=1e-5).item()
