"""Newer drafter configs, and unsupported targets refused before anything is downloaded."""

import json

import mlx.core as mx
import pytest
from helpers.checkpoints import draft_config, write_draft, write_target
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load
from dflash_mlx.loading import loading, registry
from dflash_mlx.models.drafter import DraftArgs, DraftModel


def test_rope_parameters_many_taps_and_layers(tmp_path):
    """A Qwen3.5-style drafter config: rope_parameters, full_attention layer_types, 7 taps,
    6 layers; it loads with those settings and stays lossless."""
    write_target(tmp_path / "target", layers=8)
    config = draft_config(num_target_layers=8, layers=6, target_layer_ids=(0, 1, 2, 3, 4, 5, 7), nested=True)
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    config["layer_types"] = ["full_attention"] * 6
    config["use_sliding_window"] = False
    config["sliding_window"] = None
    (tmp_path / "draft").mkdir()
    write_draft(tmp_path / "draft", num_target_layers=8, layers=6, target_layer_ids=(0, 1, 2, 3, 4, 5, 7))
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    model, draft, _ = load(tmp_path / "target", tmp_path / "draft")
    assert len(draft.layers) == 6 and draft.target_layer_ids == [0, 1, 2, 3, 4, 5, 7]
    assert draft.fc.weight.shape == (64, 7 * 64) and draft.args.rope_theta == 5000.0
    prompt = [5, 9, 2, 77, 31]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
    out = [t for s in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=40)) for t in s.tokens]
    assert out == ref


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["linear_attention", "full_attention"]},
         r"Unsupported drafter layer_types \['linear_attention'\]"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention layers but sliding_window=None"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"is_causal": "yes"}, "Unsupported drafter is_causal='yes'"),
        ({"architectures": ["DFlash3DraftModel"]}, "Unsupported drafter architecture 'DFlash3DraftModel'"),
        ({"selector_rank": 256}, r"Unsupported drafter fields \['selector_rank'\]"),
        ({"input_embedding_scale": 0.5}, "Unsupported drafter input_embedding_scale=0.5"),
    ],
)  # fmt: skip
def test_fields_we_cannot_honour_are_refused(tmp_path, pair_dirs, change, message):
    config = draft_config()
    if "selector_rank" in change or "input_embedding_scale" in change:
        config["dflash_config"].update(change)  # where DFlash2 checkpoints keep them
    else:
        config.update(change)
    with pytest.raises(DFlashError, match=message):
        DraftArgs.from_dict(config)
    write_draft(tmp_path / "draft")
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=message):
        load(pair_dirs["qwen3-tied"], tmp_path / "draft")


def test_a_dflash2_config_goes_to_its_own_drafter(tmp_path, pair_dirs):
    """DFlash DraftModel refuses the architecture; load() reads it as DFlash2 (tests/test_dflash2.py),
    which names the fields a DFlash drafter's config lacks."""
    config = {**draft_config(), "architectures": ["DFlash2DraftModel"]}
    with pytest.raises(DFlashError, match="Unsupported drafter architecture 'DFlash2DraftModel'"):
        DraftArgs.from_dict(config)
    write_draft(tmp_path / "draft")
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="The DFlash2 drafter config lacks conv_kernel_size, conv_group_size"):
        load(pair_dirs["qwen3-tied"], tmp_path / "draft")


def _no_downloads(monkeypatch, configs: dict):
    """The hub client: config.json from ``configs``; any snapshot download fails the test."""
    import huggingface_hub

    fetched = []

    def hf_hub_download(repo_id, filename, revision=None, **kwargs):
        assert filename == "config.json"
        fetched.append(repo_id)
        path = configs["dir"] / repo_id.replace("/", "--")
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(configs[repo_id]))
        return str(path / "config.json")

    def snapshot_download(*args, **kwargs):
        raise AssertionError(f"snapshot_download{args} was called")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return fetched


def test_unsupported_hub_target_is_refused_before_download(tmp_path, monkeypatch):
    fetched = _no_downloads(monkeypatch, {"dir": tmp_path, "someone/mamba-1b": {"model_type": "mamba"}})
    message = r"model_type='mamba' for someone/mamba-1b \(from its config.json\).*No weights"
    with pytest.raises(DFlashError, match=message):
        load("someone/mamba-1b")
    assert fetched == ["someone/mamba-1b"]


def test_registry_types_are_refused_without_any_request(monkeypatch, tmp_path):
    fetched = _no_downloads(monkeypatch, {"dir": tmp_path})
    pair = registry.KnownPair("Org/Strange-7B", "z-lab/Strange-7B-DFlash", "strange")
    monkeypatch.setattr(registry, "KNOWN_PAIRS", (pair,))
    with pytest.raises(DFlashError, match=r"model_type='strange' for Org/Strange-7B \(from the registry"):
        load("Org/Strange-7B", "auto")
    assert fetched == []


def test_every_known_pair_is_supported():
    from dflash_mlx.models import target as tgt

    runs = [p for p in registry.KNOWN_PAIRS if p.needs is None]
    assert {p.model_type for p in runs} <= set(tgt.SUPPORTED_MODEL_TYPES)
    # A pair said not to run yet is one whose target DFlash cannot tap.
    assert all(p.model_type not in tgt.SUPPORTED_MODEL_TYPES for p in registry.KNOWN_PAIRS if p.needs)
    for kind in ("qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        assert any(p.model_type == kind for p in registry.KNOWN_PAIRS)


def test_qwen3_coder_next_pair():
    pair = registry.find_pair("mlx-community/Qwen3-Coder-Next-4bit")
    assert (pair.target, pair.draft, pair.model_type) == (
        "Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash", "qwen3_next"
    )  # fmt: skip


def _qwen3_next_config(**change) -> dict:
    """A config with every field mlx-lm's qwen3_next needs (the published ones' values where it
    matters here); ``None`` in ``change`` drops a field."""
    from dataclasses import MISSING, fields

    from mlx_lm.models import qwen3_next

    config = {f.name: 1 for f in fields(qwen3_next.ModelArgs) if f.default is MISSING}
    config.update(model_type="qwen3_next", num_hidden_layers=48, full_attention_interval=4, rope_theta=5000000,
                  partial_rotary_factor=0.25, mlp_only_layers=[])  # fmt: skip
    config.update(change)
    return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize(
    "change, message",
    [
        # As Qwen/Qwen3-Coder-Next-FP8 is quantized.
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
         r"FP8 checkpoint \(weight_block_size=\[128, 128\]\), which mlx-lm cannot load for qwen3_next"),
        ({"layer_types": ["linear_attention", "full_attention"] * 24}, "differ from the layers mlx-lm builds"),
        # As transformers 5 saves a Qwen3-Next config.
        ({"rope_parameters": {"rope_theta": 5000000, "partial_rotary_factor": 0.25}, "rope_theta": None,
          "partial_rotary_factor": None}, "lacks rope_theta, partial_rotary_factor, which mlx-lm needs"),
    ],
)  # fmt: skip
def test_a_hybrid_hub_target_mlx_lm_cannot_load_is_refused_before_download(tmp_path, monkeypatch, change, message):
    repo = "someone/qwen3-next-x"
    fetched = _no_downloads(monkeypatch, {"dir": tmp_path, repo: _qwen3_next_config(**change)})
    with pytest.raises(DFlashError, match=f"^{repo}: .*{message}.* No weights were downloaded") as e:
        load(repo)
    assert fetched == [repo] and "\n" not in str(e.value)
    # As published, the same target goes on to the download.
    _no_downloads(monkeypatch, {"dir": tmp_path, repo: _qwen3_next_config()})
    with pytest.raises(DFlashError, match="snapshot_download"):
        load(repo)


def test_supported_hub_target_goes_on_to_download(tmp_path, monkeypatch):
    fetched = _no_downloads(monkeypatch, {"dir": tmp_path, "someone/qwen35-tiny": {"model_type": "qwen3_5"}})
    message = r"Could not get the target 'someone/qwen35-tiny' .*\(AssertionError: snapshot_download"
    with pytest.raises(DFlashError, match=message):
        loading.load("someone/qwen35-tiny")  # the snapshot download was reached
    assert fetched == ["someone/qwen35-tiny"]


def test_block_mask_follows_the_published_rule():
    """z-lab's rule, written out: query at position p sees key j if (not causal or j <= p)
    and (no window or p - j < w) and (causal or no window or j - p < w)."""
    from dflash_mlx.models.drafter import block_mask

    assert block_mask(5, 3, causal=False, window=None) is None
    for causal in (False, True):
        for window in (None, 1, 3, 100):
            if not causal and window is None:
                continue
            got = block_mask(6, 4, causal, window).tolist()
            for i in range(4):
                p = 6 + i
                want = [
                    (not causal or j <= p) and (window is None or p - j < window)
                    and (causal or window is None or j - p < window)
                    for j in range(10)
                ]  # fmt: skip
                assert got[i] == want, (causal, window, i)


def _sliding_draft(window, layer_types=("sliding_attention", "sliding_attention"), is_causal=None):
    config = draft_config(block_size=8)
    config.update(layer_types=list(layer_types), sliding_window=window, is_causal=is_causal)
    mx.random.seed(1)
    return DraftModel(DraftArgs.from_dict(config))


def test_sliding_layers_see_only_their_window():
    from dflash_mlx.loop.cache import make_draft_cache

    draft = _sliding_draft(window=4)
    context = mx.random.normal((1, 20, 2 * 64))
    noise = mx.random.normal((1, 8, 64))

    def run(context, noise):
        cache = make_draft_cache(draft)
        draft(noise, context[:, :12], cache)  # part of the context cached first
        return draft(noise, context[:, 12:], cache)

    out = run(context, noise)
    # Context older than the window of every query (positions < 20 - 3) changes nothing.
    far = mx.concatenate([context[:, :16] * 5.0 + 1.0, context[:, 16:]], axis=1)
    assert mx.allclose(run(far, noise), out, atol=1e-5).item()
    near = mx.concatenate([context[:, :17], context[:, 17:18] + 1.0, context[:, 18:]], axis=1)
    assert not mx.allclose(run(near, noise), out, atol=1e-3).item()
    # Causal: a later block position never changes an earlier one's output.
    later = mx.concatenate([noise[:, :5], noise[:, 5:] + 1.0], axis=1)
    changed = run(context, later)
    assert mx.allclose(changed[:, :5], out[:, :5], atol=1e-5).item()
    assert not mx.allclose(changed[:, 5:], out[:, 5:], atol=1e-3).item()


def test_wide_bidirectional_window_equals_full_attention():
    full = _sliding_draft(None, layer_types=("full_attention", "full_attention"))
    wide = _sliding_draft(1000, is_causal=False)
    wide.update(full.parameters())
    context, noise = mx.random.normal((1, 9, 2 * 64)), mx.random.normal((1, 8, 64))
    assert mx.allclose(wide(noise, context), full(noise, context), atol=1e-5).item()
    with pytest.raises(DFlashError, match="Training or batching a drafter with causal or sliding"):
        wide(noise, context, mask=mx.ones((8, 17), dtype=mx.bool_))


def test_sliding_drafter_is_lossless(tmp_path, pair_dirs):
    config = draft_config()
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    write_draft(tmp_path / "draft")
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    model, draft, _ = load(pair_dirs["qwen3-tied"], tmp_path / "draft")
    assert [layer.self_attn.window for layer in draft.layers] == [6, None]
    prompt = [5, 9, 2, 77, 31, 8, 1, 2, 3, 4, 5, 6, 7]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=50)]
    out = [t for s in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=50)) for t in s.tokens]
    assert out == ref


def test_sliding_layers_keep_a_bounded_cache_with_the_same_output():
    """A sliding layer's cache holds its window only, and the drafter's output equals a full cache's."""
    from mlx_lm.models.cache import KVCache

    from dflash_mlx.loop.cache import WindowedKVCache, make_draft_cache

    draft = _sliding_draft(window=5, layer_types=("sliding_attention", "full_attention"))
    context = mx.random.normal((1, 40, 2 * 64))
    noise = mx.random.normal((1, 8, 64))
    bounded, full = make_draft_cache(draft), [KVCache(), KVCache()]
    assert isinstance(bounded[0], WindowedKVCache) and isinstance(bounded[1], KVCache)
    for lo, hi in ((0, 3), (3, 4), (4, 17), (17, 18), (18, 40)):  # chunks smaller and larger than the window
        got, want = draft(noise, context[:, lo:hi], bounded), draft(noise, context[:, lo:hi], full)
        assert mx.allclose(got, want, atol=1e-5).item(), (lo, hi)
        assert bounded[0].stored <= 5 and bounded[0].offset == full[0].offset == hi


def test_dflash_convert_refuses_such_a_hub_target_before_download(tmp_path, monkeypatch):
    from dflash_mlx.convert import convert

    repo = "someone/qwen3-next-fp8"
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    fetched = _no_downloads(monkeypatch, {"dir": tmp_path, repo: _qwen3_next_config(quantization_config=fp8)})
    with pytest.raises(DFlashError, match=f"^{repo}: The target is an FP8 checkpoint.* No weights were downloaded"):
        convert(repo, str(tmp_path / "out"), draft_hf_path="z-lab/Qwen3-Coder-Next-DFlash", verbose=False)
    assert fetched == [repo] and not (tmp_path / "out").exists()
