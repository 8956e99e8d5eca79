import copy

import mlx.core as mx
import mlx.nn as nn
from helpers import family
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.models import target as tgt


def _mlx_lm_hidden_after(model, tokens, layer_id):
    """mlx-lm's own decoder, cut after ``layer_id`` and with the final norm removed."""
    inner = copy.copy(model.model)
    inner.layers = model.model.layers[: layer_id + 1]
    inner.norm = nn.Identity()
    return inner(tokens)


def test_taps_match_mlx_lm_hidden_states(tiny_pair):
    model, _, _ = tiny_pair
    tokens = mx.array([[5, 9, 2, 77, 31, 8, 100]])
    tap_ids = [0, 1, 3]
    logits, taps = tgt.forward_with_taps(model, tokens, make_prompt_cache(model), tap_ids)
    assert mx.allclose(logits, model(tokens), atol=1e-5).item()
    H = tgt.hidden_size(model)
    assert taps.shape == (1, 7, len(tap_ids) * H)
    for n, layer_id in enumerate(tap_ids):
        expected = _mlx_lm_hidden_after(model, tokens, layer_id)
        if layer_id == len(model.model.layers) - 1:
            expected = model.model.norm(expected)  # HF's hidden_states[-1] is normed
        assert mx.abs(taps[..., n * H : (n + 1) * H] - expected).max().item() < 1e-5


def test_taps_with_cache_and_trim_match_a_straight_run(tiny_pair):
    model, _, _ = tiny_pair
    tokens = mx.array([[5, 9, 2, 77, 31, 8, 100, 3, 4]])
    straight_logits, straight = tgt.forward_with_taps(model, tokens, make_prompt_cache(model), [1, 2])
    cache = make_prompt_cache(model)
    tgt.forward_with_taps(model, tokens[:, :4], cache, [1, 2])
    tgt.forward_with_taps(model, mx.array([[1, 1, 1]]), cache, [1, 2])  # a rejected block
    for c in cache:
        c.trim(3)
    logits, taps = tgt.forward_with_taps(model, tokens[:, 4:], cache, [1, 2])
    assert mx.allclose(taps, straight[:, 4:], atol=1e-5).item()
    assert mx.allclose(logits, straight_logits[:, 4:], atol=1e-5).item()


def test_no_taps(tiny_pair):
    model, _, _ = tiny_pair
    logits, taps = tgt.forward_with_taps(model, mx.array([[1, 2]]), make_prompt_cache(model), [])
    assert taps is None and logits.shape[:2] == (1, 2)


def test_taps_folded_as_made_equal_fc_of_the_taps(tiny_pair):
    model, _, _ = tiny_pair
    family.check_folded_taps(model)


def test_folded_taps_keep_the_taps_dtype_and_their_precision():
    mx.random.seed(2)
    taps = [mx.random.normal((1, 9, 32)).astype(mx.bfloat16) for _ in range(3)]
    weight = mx.random.normal((16, 3 * 32)).astype(mx.bfloat16)
    folded = tgt.FoldedTaps({k: weight[:, k * 32 : (k + 1) * 32] for k in range(3)}, last=7)
    for k, h in enumerate(taps):
        folded[k] = h
    total = folded.total()
    exact = mx.concatenate(taps, axis=-1).astype(mx.float32) @ weight.astype(mx.float32).T
    one_matmul = mx.concatenate(taps, axis=-1) @ weight.T
    assert total.dtype == mx.bfloat16
    # No further from the exact sum than the single bfloat16 matmul over the concatenated taps, within a rounding.
    err = mx.abs(total.astype(mx.float32) - exact).max().item()
    assert err <= 2 * mx.abs(one_matmul.astype(mx.float32) - exact).max().item() + 1e-6
