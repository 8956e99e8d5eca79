"""A quantized target's verify passes through ``verify_qmm``: the layer that dispatches them, the
swap that puts it in (on a Metal device only), and the same tokens with it as without. Off a
Mac, the kernel itself runs through the CPU harness on a tiny layer and one verify pass."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers.decoding import run
from mlx.utils import tree_flatten

from dflash_mlx import DFlashError, load
from dflash_mlx.kernels import harness, qmm
from dflash_mlx.kernels.dispatch import KernelStore, SelfChecked, on_metal
from dflash_mlx.models import target as tgt
from dflash_mlx.models.quantized import VerifyQuantizedLinear, can_use_verify_qmm, use_verify_qmm

needs_compiler = pytest.mark.skipif(harness.compiler_missing() is not None, reason=str(harness.compiler_missing()))
off_metal = pytest.mark.skipif(on_metal(), reason="off Metal only: on a Mac load swaps the layers in")


class Recording:
    """A dispatcher that runs the twin and records each call's rows and mode."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, w, scales, biases, group_size, bits, mode="auto"):
        self.calls.append((x.shape[0], mode))
        return qmm.verify_qmm_ops(x, w, scales, biases, group_size, bits)


def _harness_dispatcher(tmp_path) -> SelfChecked:
    """verify_qmm as on a Mac, its kernel's Metal source run on the CPU by the harness."""
    d = qmm.verify_qmm.with_store(KernelStore(tmp_path / "kernels.json"))
    d.kernel = partial(qmm.verify_qmm_kernel, factory=harness.cpu_metal_kernel)
    d._metal = True
    return d


@pytest.fixture
def quantized_pair(pair_dirs):
    """A fresh tiny Qwen3 pair whose target is 4-bit, groups of 32 (the session's pair stays float)."""
    model, draft, tokenizer = load(pair_dirs["qwen3-tied"], pair_dirs["draft"])
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, draft, tokenizer


def test_layer_keeps_the_parameters_and_dispatches_verify_rows():
    layer = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    rec = Recording()
    ours = VerifyQuantizedLinear.from_quantized(layer, "on", rec)
    assert [k for k, _ in tree_flatten(ours.parameters())] == [k for k, _ in tree_flatten(layer.parameters())]
    assert ours.weight is layer.weight and ours.trainable_parameters() == {}
    for rows in (1, 2, 16, 17, 40):
        x = mx.random.normal((1, rows, 64))
        assert mx.allclose(ours(x), layer(x), atol=1e-5).item()
    # One row is MLX's own matrix-vector kernel, more than 16 a prefill chunk's matmul.
    assert rec.calls == [(2, "on"), (16, "on")]


def test_swap_is_done_only_on_metal_and_not_for_off(quantized_pair):
    model = quantized_pair[0]
    before = [type(m) for _, m in model.named_modules()]
    assert use_verify_qmm(model, "auto", metal=False) == 0
    assert use_verify_qmm(model, "off", metal=True) == 0
    assert [type(m) for _, m in model.named_modules()] == before
    with pytest.raises(DFlashError, match="kernels 'on' needs a Metal device"):
        use_verify_qmm(model, "on", metal=False)
    # 4 layers of q, k, v, o, gate, up and down; the tied embedding stays mlx-lm's.
    assert use_verify_qmm(model, "auto", metal=True) == 28
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert use_verify_qmm(model, "auto", metal=True) == 0  # already swapped


@off_metal
def test_off_metal_nothing_is_swapped_and_on_is_an_error(quantized_pair, pair_dirs):
    model = quantized_pair[0]
    assert use_verify_qmm(model) == use_verify_qmm(model, "off") == 0  # what load does here
    assert not any(isinstance(m, VerifyQuantizedLinear) for _, m in model.named_modules())
    with pytest.raises(DFlashError, match="kernels 'on' needs a Metal device"):
        load(pair_dirs["qwen3-tied"], pair_dirs["draft"], kernels="on")


def test_only_affine_4_and_8_bit_layers_of_32_and_64_are_swapped():
    assert can_use_verify_qmm(nn.QuantizedLinear(64, 8, group_size=64, bits=8))
    assert not can_use_verify_qmm(nn.QuantizedLinear(64, 8, group_size=64, bits=3))
    assert not can_use_verify_qmm(nn.QuantizedLinear(128, 8, group_size=128, bits=4))
    assert not can_use_verify_qmm(nn.QuantizedLinear(64, 8, mode="mxfp4"))
    assert not can_use_verify_qmm(nn.Linear(64, 8))


@pytest.mark.parametrize("adaptive", [False, True])
def test_same_greedy_tokens_with_the_layers_forced_on(quantized_pair, adaptive):
    model, draft, _ = quantized_pair
    prompt = list(range(5, 30))
    want, _ = run(model, draft, prompt, block_size=16, max_tokens=40, adaptive=adaptive)
    # The library's own dispatcher, as load would swap it in on a Mac with kernels 'on': here,
    # with no Metal device, its twin runs.
    assert use_verify_qmm(model, "on", metal=True) == 28
    got, _ = run(model, draft, prompt, block_size=16, max_tokens=40, adaptive=adaptive)
    assert got == want


def test_verify_rows_reach_the_dispatcher_with_the_mode(quantized_pair):
    model, draft, _ = quantized_pair
    prompt = list(range(5, 30))
    want, _ = run(model, draft, prompt, block_size=8, max_tokens=24, adaptive=False)
    rec = Recording()
    use_verify_qmm(model, "on", metal=True, dispatcher=rec)
    got, _ = run(model, draft, prompt, block_size=8, max_tokens=24, adaptive=False)
    assert got == want
    # Every verify pass of the 8-token block went through it, and nothing else did.
    assert rec.calls and {c for c in rec.calls} == {(8, "on")}


@needs_compiler
@pytest.mark.parametrize("bits, group_size, rows", [(4, 32, 3), (8, 64, 16)])
def test_layer_runs_the_metal_source_where_metal_is_faked(tmp_path, bits, group_size, rows):
    layer = nn.QuantizedLinear(128, 64, bias=False, group_size=group_size, bits=bits)
    ours = VerifyQuantizedLinear.from_quantized(layer, "on", _harness_dispatcher(tmp_path))
    x = mx.random.normal((1, rows, 128))
    assert mx.allclose(ours(x), layer(x), rtol=1e-4, atol=1e-4).item()
    assert ours.dispatcher.forced  # the kernel ran, after its comparison with the twin


@needs_compiler
def test_verify_pass_through_the_metal_source_matches_mlx_lm(quantized_pair, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    model = quantized_pair[0]
    prompt, block = mx.array([list(range(3, 20))]), mx.array([list(range(40, 48))])
    theirs_cache, ours_cache = make_prompt_cache(model), make_prompt_cache(model)
    model(prompt, cache=theirs_cache)
    model(prompt, cache=ours_cache)
    want, _ = tgt.forward_with_taps(model, block, theirs_cache, [1], None)
    # One layer's matmuls through the harness keeps the test short (each call runs 32 lanes a column).
    dispatcher = _harness_dispatcher(tmp_path)
    assert use_verify_qmm(model.model.layers[1], "on", metal=True, dispatcher=dispatcher) == 7
    got, _ = tgt.forward_with_taps(model, block, ours_cache, [1], None)
    assert mx.abs(got - want).max().item() < 1e-3
    assert len(dispatcher.forced) == 4  # q/o, k/v, gate/up and down: each shape class compared once
