import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.cpu import fast_math
from dflash_mlx.cpu.speedups import CPU_SPEEDUPS, CpuSpeedups
from dflash_mlx.models import target as tgt


def _relative_error(ours: mx.array, reference: np.ndarray) -> float:
    ours = np.array(ours, dtype=np.float64)
    return float(np.max(np.abs(ours - reference) / reference))


@pytest.mark.parametrize("fn, low, high", [(fast_math._exp, -87.0, 88.0), (fast_math._exp_nonpositive, -43.0, 0.0)])
def test_exp_is_as_accurate_as_mlx(fn, low, high):
    x = mx.linspace(low, high, 100_001)
    reference = np.exp(np.array(x, dtype=np.float64))
    ours = mx.compile(fn)(x)
    # Both are limited by the rounding of x itself (|x| ulps of relative error).
    assert _relative_error(ours, reference) <= 1.05 * _relative_error(mx.exp(x), reference)
    assert _relative_error(ours, reference) < 5e-6


def test_exp_is_zero_below_its_range():
    x = mx.array([-mx.inf, -1000.0, -88.0])
    assert mx.compile(fast_math._exp)(x).tolist() == [0.0, 0.0, 0.0]
    y = mx.array([-mx.inf, -100.0, -43.5])
    assert mx.compile(fast_math._exp_nonpositive)(y).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("shape", [(1, 3, 3, 16, 1024), (2, 5, 70), (400,)])
def test_shifted_exp_in_two_kernels_is_the_one_piece_exp(shape):
    # The attention's exp runs as two compiled kernels to hold fewer score-sized arrays; it
    # must give what the one-piece version gives, to the bit (below -43 included).
    mx.random.seed(0)
    scores = mx.random.normal(shape) * 20
    top = mx.max(scores, axis=-1, keepdims=True)
    one_piece = mx.compile(lambda s, t: fast_math._exp_nonpositive(s - t), shapeless=True)
    assert mx.array_equal(fast_math._shifted_exp(scores, top), one_piece(scores, top)).item()
    assert (scores - top < -43).any().item() and (scores - top > -0.5).any().item()


@pytest.mark.parametrize("shape", [(16, 96), (1, 5, 40), (3,)])
def test_swiglu_matches_mlx_lm(shape):
    gate = mx.random.normal(shape) * 8
    up = mx.random.normal(shape)
    # A float32 ulp or two of each output.
    assert mx.allclose(fast_math.swiglu(gate, up, fast_exp=True), mlx_lm_swiglu(gate, up), rtol=3e-7, atol=1e-6).item()


def test_swiglu_gradient_matches_mlx_lm():
    gate, up = mx.random.normal((4, 32)) * 4, mx.random.normal((4, 32))
    weights = mx.random.normal((4, 32))

    def loss(fn):
        return lambda g, u: (fn(g, u) * weights).sum()

    ours = mx.grad(loss(lambda g, u: fast_math.swiglu(g, u, fast_exp=True)), argnums=(0, 1))(gate, up)
    theirs = mx.grad(loss(mlx_lm_swiglu), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, theirs):
        assert mx.abs(a - b).max().item() < 1e-5


def _mask(shape):
    if shape is None:
        return None
    mask = mx.random.uniform(shape=shape) > 0.4
    mask[..., 0] = True  # every query sees a key
    return mask


@pytest.mark.parametrize(
    "mask_shape", [None, (16, 40), (1, 40), (2, 1, 16, 40), (2, 4, 16, 40), (2, 40), (4, 40), (2, 4, 2, 40)]
)
def test_attention_matches_mlx_fast_with_its_gradient(mask_shape):
    # One mask for all heads (None, 2-D) takes a KV group's heads as one matrix, per-head masks
    # broadcast over the group; with 16 queries and with a verify pass's 2 or 4.
    length = mask_shape[-2] if mask_shape is not None and mask_shape[-2] in (2, 4) else 16
    q = mx.random.normal((2, 4, length, 8)) * 3
    k, v = mx.random.normal((2, 2, 40, 8)), mx.random.normal((2, 2, 40, 8))
    mask = _mask(mask_shape)
    weights = mx.random.normal((2, 4, length, 8))

    def ours(q, k, v):
        return fast_math.attention(q, k, v, 0.35, mask, fast_exp=True)

    def theirs(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)

    assert mx.abs(ours(q, k, v) - theirs(q, k, v)).max().item() < 2e-6
    grads = [mx.grad(lambda *a, f=f: (f(*a) * weights).sum(), argnums=(0, 1, 2))(q, k, v) for f in (ours, theirs)]
    for a, b in zip(*grads):
        assert mx.abs(a - b).max().item() < 2e-5


@pytest.mark.parametrize("mask_shape", [None, (16, 40), (2, 4, 16, 40), "late"])
def test_attention_over_chunks_of_keys_matches_mlx_fast(monkeypatch, mask_shape):
    # Past CHUNK_ABOVE keys the scores are taken a chunk at a time (an online softmax): 40 keys in
    # chunks of 14, 14 and 12. "late": rows that see no key of the first chunk, or of the first two.
    monkeypatch.setattr(fast_math, "CHUNK_ABOVE", 32)
    monkeypatch.setattr(fast_math, "KEY_CHUNK", 16)
    q = mx.random.normal((2, 4, 16, 8)) * 3
    k, v = mx.random.normal((2, 2, 40, 8)), mx.random.normal((2, 2, 40, 8))
    if mask_shape == "late":
        first_seen = mx.array([0, 20, 30, 39] * 4)[:, None]
        mask = mx.arange(40)[None] >= first_seen
    else:
        mask = _mask(mask_shape)
    ours = fast_math.attention(q, k, v, 0.35, mask, fast_exp=True)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)
    assert not mx.isnan(ours).any().item()
    assert mx.abs(ours - theirs).max().item() < 2e-6


def test_causal_mask_lets_each_query_see_the_context_and_itself():
    mask = fast_math.causal_mask(offset=3, length=2)
    assert mask.tolist() == [[True] * 4 + [False], [True] * 5]


def test_other_inputs_go_to_mlx_unchanged():
    q = mx.random.normal((1, 4, 16, 8)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, 2, 20, 8)).astype(mx.bfloat16) for _ in range(2))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    assert mx.array_equal(fast_math.attention(q, k, v, 0.5, "causal", fast_exp=True), expected).item()
    g = mx.random.normal((2, 8)).astype(mx.bfloat16)
    assert mx.array_equal(fast_math.swiglu(g, g, fast_exp=True), mlx_lm_swiglu(g, g)).item()


def test_qwen3_verify_through_the_kernels_matches_mlx_lm(qwen3_pair):
    model, _, _ = qwen3_pair
    prompt, block = mx.array([list(range(3, 40))]), mx.array([list(range(50, 66))])
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    tgt.forward_with_taps(model, prompt, ours, [1], CPU_SPEEDUPS)
    model(prompt, cache=theirs)
    h = model.model.embed_tokens(block)
    assert tgt._cpu_steps(model, h, ours, tgt._layer_masks(model, h, ours), CPU_SPEEDUPS) is not None
    logits, _ = tgt.forward_with_taps(model, block, ours, [1], CPU_SPEEDUPS)
    assert mx.abs(logits - model(block, cache=theirs)).max().item() < 1e-4
    assert ours[0].offset == theirs[0].offset == 53


def _tiny_qwen3(**overrides):
    from mlx_lm.models import qwen3

    args = dict(
        model_type="qwen3",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        vocab_size=100,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    args.update(overrides)
    model = qwen3.Model(qwen3.ModelArgs(**args))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _tiny_llama(**overrides):
    from mlx_lm.models import llama

    args = dict(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=100,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    args.update(overrides)
    model = llama.Model(llama.ModelArgs(**args))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _verify_matches_mlx_lm(
    model, expect_kernels: bool, speedups: CpuSpeedups = CPU_SPEEDUPS, lengths: tuple = (12, 12)
) -> None:
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    prompt = mx.array([list(range(3, 30))])
    tgt.forward_with_taps(model, prompt, ours, [0], speedups)
    model(prompt, cache=theirs)
    # Passes in a row: each starts where the one before left the cache.
    for start, length in zip((40, 60, 80), lengths):
        block = mx.array([list(range(start, start + length))])
        h = model.model.embed_tokens(block)
        assert (
            tgt._cpu_steps(model, h, ours, tgt._layer_masks(model, h, ours), speedups) is not None
        ) == expect_kernels
        logits, _ = tgt.forward_with_taps(model, block, ours, [0], speedups)
        assert mx.abs(logits - model(block, cache=theirs)).max().item() < 1e-4


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_compiled_qwen3_step_matches_mlx_lm_with_each_rope(rope_scaling):
    # Plain and linear RoPE run inside the compiled step; Llama 3's, outside it.
    model = _tiny_qwen3(rope_scaling=rope_scaling)
    assert (tgt.compiled_layers.rope_key(model.model.layers[0].self_attn.rope) is None) == (
        rope_scaling is not None and rope_scaling["rope_type"] == "llama3"
    )
    _verify_matches_mlx_lm(model, expect_kernels=True)


@pytest.mark.parametrize(
    "speedups",
    [CpuSpeedups(fast_exp=False), CpuSpeedups(compiled_steps=False), CpuSpeedups(fast_exp=False, compiled_steps=False)],
)
def test_each_speedup_alone_matches_mlx_lm(speedups):
    _verify_matches_mlx_lm(_tiny_qwen3(), expect_kernels=True, speedups=speedups)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_compiled_llama_step_matches_mlx_lm(rope_scaling):
    # The default pair's family: its verify passes (2 tokens and up) run the compiled steps too.
    _verify_matches_mlx_lm(_tiny_llama(rope_scaling=rope_scaling), expect_kernels=True, lengths=(2, 4, 12))


def test_a_llama_with_sliding_window_layers_keeps_mlx_lm_layers():
    model = _tiny_llama(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    h = model.model.embed_tokens(mx.array([[5, 6]]))
    cache = make_prompt_cache(model)
    assert tgt._cpu_steps(model, h, cache, tgt._layer_masks(model, h, cache), CPU_SPEEDUPS) is None


def test_a_plain_step_keeps_mlx_lm_layers():
    # One token is plain decoding's step, the baseline speedups are measured against.
    model = _tiny_llama()
    h = model.model.embed_tokens(mx.array([[5]]))
    cache = make_prompt_cache(model)
    assert tgt._cpu_steps(model, h, cache, tgt._layer_masks(model, h, cache), CPU_SPEEDUPS) is None


def test_quantized_qwen3_keeps_mlx_lm_layers():
    import mlx.nn as nn

    model = _tiny_qwen3()
    nn.quantize(model, group_size=32, bits=8)
    _verify_matches_mlx_lm(model, expect_kernels=False)


def test_layer_steps_found_once_are_looked_for_again_after_quantizing_and_go_with_the_model():
    import gc

    import mlx.nn as nn

    model = _tiny_qwen3()
    h = model.model.embed_tokens(mx.array([[5, 6, 7]]))
    cache = make_prompt_cache(model)
    masks = tgt._layer_masks(model, h, cache)
    steps = tgt._cpu_steps(model, h, cache, masks, CPU_SPEEDUPS)
    assert steps is not None and len(steps) == len(model.model.layers)
    assert tgt._cpu_steps(model, h, cache, masks, CPU_SPEEDUPS) is steps
    key = (id(model), CPU_SPEEDUPS)
    assert key in tgt._CPU_STEPS
    # A cut list of layers is looked at again.
    model.model.layers = model.model.layers[:1]
    assert len(tgt._cpu_steps(model, h, cache[:1], masks[:1], CPU_SPEEDUPS)) == 1
    # Quantized in place after a pass: its layers are no longer what the steps compute.
    nn.quantize(model, group_size=32, bits=8)
    assert tgt._cpu_steps(model, h, cache, masks, CPU_SPEEDUPS) is None
    del model, cache, masks, steps
    gc.collect()
    assert key not in tgt._CPU_STEPS


def test_a_pass_started_layer_by_layer_equals_a_lazy_one(qwen3_pair):
    model, draft, _ = qwen3_pair
    prompt, block = mx.array([list(range(3, 40))]), mx.array([list(range(50, 66))])
    outs = []
    for start_every in (0, 1, 3):
        cache = make_prompt_cache(model)
        speedups = CpuSpeedups(start_every=start_every)
        tgt.forward_with_taps(model, prompt, cache, draft.target_layer_ids, speedups)
        outs.append(tgt.forward_with_taps(model, block, cache, draft.target_layer_ids, speedups))
    for logits, taps in outs[1:]:
        assert mx.array_equal(logits, outs[0][0]).item() and mx.array_equal(taps, outs[0][1]).item()


def test_softmax_kernel_matches_mlx():
    """The sampling softmax with the fused exp: as mx.softmax, filtered (-inf) tokens exactly 0."""
    rng = np.random.default_rng(0)
    rows = np.stack([rng.normal(0, scale, 4096) for scale in (0.1, 1.0, 5.0, 30.0)]).astype(np.float32)
    rows[1, :100] = -np.inf
    x = mx.array(rows)
    ours, ref = fast_math.softmax(x, fast_exp=True), mx.softmax(x, axis=-1)
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-9).item()
    assert mx.all(ours[1, :100] == 0).item()
    assert mx.array_equal(fast_math.softmax(x), ref).item()  # the portable path is MLX's own
