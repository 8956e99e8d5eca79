"""Newer drafter configs, and unsupported targets refused before anything is downloaded."""

import json

import mlx.core as mx
import pytest
from checkpoints import VOCAB, draft_config, write_draft, write_target
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashError, dflash_generate_step, load
from dflash_mlx import loading, registry
from dflash_mlx.drafter import ModelArgs


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
    out = [t for s in dflash_generate_step(prompt, model, draft, max_tokens=40) for t in s.tokens]
    assert out == ref


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048},
         r"Unsupported drafter layer_types \['sliding_attention'\] \(sliding_window=2048\)"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"is_causal": True}, "Unsupported drafter is_causal=True"),
        ({"architectures": ["DFlash2DraftModel"]}, "Unsupported drafter architecture 'DFlash2DraftModel'"),
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
        ModelArgs.from_dict(config)
    write_draft(tmp_path / "draft")
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=message):
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
    with pytest.raises(DFlashError, match=r"model_type='mamba' for someone/mamba-1b \(from its config.json\).*No weights"):
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
    from dflash_mlx import target as tgt

    assert {p.model_type for p in registry.KNOWN_PAIRS} <= set(tgt.SUPPORTED_MODEL_TYPES)
    for kind in ("qwen3_moe", "qwen3_5", "qwen3_5_moe"):
        assert any(p.model_type == kind for p in registry.KNOWN_PAIRS)


def test_supported_hub_target_goes_on_to_download(tmp_path, monkeypatch):
    fetched = _no_downloads(monkeypatch, {"dir": tmp_path, "someone/qwen35-tiny": {"model_type": "qwen3_5"}})
    with pytest.raises(DFlashError, match=r"Could not get the target 'someone/qwen35-tiny' .*\(AssertionError\)"):
        loading.load("someone/qwen35-tiny")  # the snapshot download was reached
    assert fetched == ["someone/qwen35-tiny"]
