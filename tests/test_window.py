"""The drafter's context window: the first sinks plus the latest W positions of the taps."""

import mlx.core as mx
import pytest
from helpers.checkpoints import MASK_ID, VOCAB
from helpers.decoding import run
from test_generate import _prompt, reference

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, make_cache
from dflash_mlx.loop.cache import WindowedKVCache, make_draft_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.tools.cli.generate import main as generate_main


def _positions(cache: WindowedKVCache) -> list[int]:
    return [] if cache.keys is None else [int(p) for p in cache.keys[0, 0, :, 0].tolist()]


def _add(cache: WindowedKVCache, n: int) -> list[int]:
    pos = mx.arange(cache.offset, cache.offset + n, dtype=mx.float32).reshape(1, 1, n, 1)
    keys, _ = cache.update_and_fetch(pos, pos)
    return [int(p) for p in keys[0, 0, :, 0].tolist()]


def test_windowed_cache_keeps_the_sinks_and_the_latest_positions():
    c = WindowedKVCache(window=5, sinks=2)
    assert _add(c, 4) == [0, 1, 2, 3]  # shorter than sinks + window: everything
    # What a pass sees is what is kept: the sinks and the latest five.
    assert _add(c, 6) == [0, 1, 5, 6, 7, 8, 9] == _positions(c) and c.offset == 10
    assert _add(c, 1) == [0, 1, 6, 7, 8, 9, 10]
    # A rollback inside the window drops the latest entries...
    c.trim(2)
    assert _positions(c) == [0, 1, 6, 7, 8] and c.offset == 9
    assert _add(c, 3) == [0, 1, 7, 8, 9, 10, 11]
    assert _add(c, 1) == [0, 1, 8, 9, 10, 11, 12]
    assert _add(c, 1) == [0, 1, 9, 10, 11, 12, 13]
    # ...one past it keeps what is left of the sinks, then grows back from there.
    c.trim(9)
    assert _positions(c) == [0, 1] and c.offset == 5
    assert _add(c, 7) == [0, 1, 7, 8, 9, 10, 11]
    c.trim(11)
    assert _positions(c) == [0] and c.offset == 1
    assert _add(c, 3) == [0, 1, 2, 3]
    assert _add(c, 5) == [0, 1, 4, 5, 6, 7, 8]
    no_sinks = WindowedKVCache(window=3, sinks=0)
    assert _add(no_sinks, 5) == [2, 3, 4] and _add(no_sinks, 1) == [3, 4, 5]


def test_windowed_drafter_equals_the_full_one_with_the_rest_of_the_context_masked(qwen3_pair):
    model, draft, _ = qwen3_pair
    B, W, S = draft.block_size, 9, 3
    ids = mx.random.randint(0, VOCAB - 4, (1, 60))
    _, taps = tgt.forward_with_taps(model, ids, [None] * 4, draft.target_layer_ids)
    windowed, full = make_draft_cache(draft, W, S), make_draft_cache(draft)
    start, differs = 0, False
    for n in (5, 10, 1, 7, 16, 3, 12):  # chunks of committed positions, as cycles add them
        chunk = taps[:, start : start + n]
        start += n
        block = mx.array([[int(ids[0, start].item())] + [MASK_ID] * (B - 1)])
        got = draft.propose(model, block, chunk, windowed)
        visible = mx.array([p < S or p >= start - W for p in range(start)] + [True] * B)
        mask = mx.broadcast_to(visible[None, None, None], (1, 1, B, start + B))
        h = draft(tgt.embed(model, block), chunk, full, mask=mask)
        assert mx.allclose(got, tgt.lm_head(model, h[:, 1:]), atol=1e-4), start
        assert windowed[0].stored == min(start, S + W) and windowed[0].offset == full[0].offset == start
        # The full context (no mask) gives other drafts once the window drops positions.
        if start > S + W:
            everything = draft.propose(model, block, None, [_copy(c) for c in full])
            differs |= not mx.allclose(everything, got, atol=1e-3)
    assert differs


def _copy(cache):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.keys, c.values, c.offset = cache.keys, cache.values, cache.offset
    return c


@pytest.mark.parametrize("prompt_len", [1, 7, 130])
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_windowed_drafting_is_lossless(qwen3_pair, block_size, prompt_len):
    """Windows smaller than the prompt, and windows whose edge falls inside a verified block."""
    model, draft, _ = qwen3_pair
    prompt = _prompt(prompt_len)
    ref = reference(model, prompt, max_tokens=60)
    for window, sinks in ((5, 2), (13, 0), (200, 4)):
        cache = make_cache(model, draft, draft_window=window, draft_sinks=sinks)
        out, _ = run(model, draft, prompt, block_size=block_size, max_tokens=60, prompt_cache=cache, adaptive=False)
        assert out == ref, (window, sinks)
        assert cache.draft[0].stored <= sinks + window
        assert cache.draft[0].offset + cache.pending_length == len(cache.tokens)
    again, _ = run(model, draft, prompt, block_size=block_size, max_tokens=60, draft_window=5, draft_sinks=2)
    assert again == ref


def test_a_reused_windowed_cache_rolls_back_exactly(qwen3_pair):
    """A second turn that shares a prefix trims the windowed cache and stays exact."""
    model, draft, _ = qwen3_pair
    first, second = _prompt(40, seed=1), _prompt(40, seed=1)[:30] + _prompt(12, seed=2)
    cache = make_cache(model, draft, draft_window=6, draft_sinks=2)
    run(model, draft, first, max_tokens=20, prompt_cache=cache, adaptive=False)
    out, _ = run(model, draft, second, max_tokens=30, prompt_cache=cache, adaptive=False)
    assert out == reference(model, second, max_tokens=30)
    assert cache.draft[0].offset + cache.pending_length == len(cache.tokens)


@pytest.mark.parametrize("window, sinks", [(0, 4), (-3, 4), (2.5, 4), (True, 4), (8, -1)])
def test_bad_windows_are_refused(qwen3_pair, window, sinks):
    model, draft, _ = qwen3_pair
    with pytest.raises(DFlashError, match="draft_window|draft_sinks"):
        next(dflash_generate_step([1, 2, 3], model, draft, LoopOptions(draft_window=window, draft_sinks=sinks)))


def test_generate_cli_window_flags(pair_dirs, capsys):
    argv = ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--prompt", "t1 t2",
            "--max-tokens", "12", "--dtype", "float32", "--ignore-chat-template"]  # fmt: skip

    def text(out: str) -> str:  # the reply, without the timing lines
        return out.split("=" * 10)[1]

    generate_main(argv)
    plain = text(capsys.readouterr().out)
    generate_main(argv + ["--draft-window", "3", "--draft-sinks", "1"])
    assert text(capsys.readouterr().out) == plain and plain.strip()
    with pytest.raises(SystemExit):
        generate_main(argv + ["--draft-window", "0"])
    assert "--draft-window" in capsys.readouterr().err
