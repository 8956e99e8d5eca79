"""Kimi K2.5 targets (kimi_k25: a DeepSeek-V3 text model with multi-head latent attention and
experts, under a vision wrapper), written as moonshotai/Kimi-K2.5 is published (INT4 experts in
compressed-tensors' layout): mlx-lm against transformers, our taps against HF's hidden states, the
latent cache's rollback against a shorter pass, and DFlash against mlx-lm's greedy decoding."""

import json
import shutil

import mlx.core as mx
import pytest
from helpers import family
from helpers.checkpoints import draft_config
from helpers.decoding import run
from helpers.family import MAX_REF, prompt_ids, reference
from helpers.hf_checkpoints import KIMI_QUANTIZATION
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from dflash_mlx import DFlashError, load, make_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftArgs, DraftModel

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The target folder, its transformers model and a drafter folder."""
    return family.write_pair_folders(tmp_path_factory.mktemp("kimi"), "kimi_k25")


@pytest.fixture(scope="module")
def pair(folders):
    target, _, draft = folders
    return load(target, draft)


def test_the_checkpoint_is_the_published_layout(folders, pair):
    target, _, _ = folders
    config = json.loads((target / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "kimi_k25" and text["quantization_config"]["format"] == "pack-quantized"
    assert text["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in text
    names = mx.load(str(target / "model.safetensors")).keys()
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in names
    assert any(n.startswith("vision_tower.") for n in names) and "language_model.lm_head.weight" in names
    model = pair[0]
    assert model.model_type == "kimi_k25"
    assert type(model.language_model.model.layers[1].mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert [type(c) for c in make_cache(model).target] == [KVCache] * 4
    assert tgt.num_layers(model) == 4 and tgt.hidden_size(model) == 64


def test_mlx_lm_greedy_matches_transformers(folders, pair):
    hf, model = folders[1], pair[0]
    prompt = prompt_ids(30, seed=5)
    family.check_greedy_matches_transformers(model, hf, prompt)


def test_taps_embedding_and_head_match_transformers(folders, pair):
    hf, model = folders[1], pair[0]
    prompt = prompt_ids(23)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        hf_embedding = hf.get_input_embeddings()(torch.tensor([prompt]))
    tap_ids = [0, 1, 2, 3]
    logits, taps = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, tap_ids)
    assert mx.allclose(logits, model(mx.array([prompt])), atol=1e-5).item()
    assert (mx.abs(logits - mx.array(out.logits.numpy())).max() / mx.abs(logits).max()).item() < 1e-4
    assert mx.allclose(tgt.embed(model, mx.array([prompt])), mx.array(hf_embedding.numpy()), atol=1e-6).item()
    H = tgt.hidden_size(model)
    for n, layer_id in enumerate(tap_ids):
        # HF's hidden_states[0] is the embedding output: layer i's output is [i + 1] (the last after the norm).
        expected = mx.array(out.hidden_states[layer_id + 1].numpy())
        err = mx.abs(taps[..., n * H : (n + 1) * H] - expected).max() / mx.abs(expected).max()
        # The INT4 experts: mlx-lm multiplies in its quantized kernel, transformers by the dequantized matrices.
        assert err.item() < 5e-5, layer_id


@pytest.mark.parametrize("prompt_len", [1, 11])
def test_latent_cache_trim_equals_a_shorter_pass(pair, prompt_len):
    """After a pass of 16 tokens, trim(n) leaves what a pass of 16 - n tokens leaves, for every n: the
    latent keys and the shared RoPE keys go back together, and the next pass gives the same logits."""
    model = pair[0]
    prompt, block = prompt_ids(prompt_len), prompt_ids(16, seed=7)
    for n in range(0, 17):
        cache = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), cache, [])
        tgt.forward_with_taps(model, mx.array([block]), cache, [])
        for c in cache:
            c.trim(n)
        straight = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt + block[: 16 - n]]), straight, [])
        assert all(c.offset == s.offset == prompt_len + 16 - n for c, s in zip(cache, straight))
        for nxt in ([[5]], [[5, 6, 7, 8, 9]]):  # a decoding step (absorbed attention), a verify pass
            a, taps_a = tgt.forward_with_taps(model, mx.array(nxt), cache, [0, 2])
            b, taps_b = tgt.forward_with_taps(model, mx.array(nxt), straight, [0, 2])
            # Passes of different lengths: OpenBLAS sums in another order.
            assert mx.allclose(a, b, rtol=1e-4, atol=1e-3).item(), n
            assert mx.allclose(taps_a, taps_b, rtol=1e-4, atol=2e-3).item(), n
            for c in cache + straight:
                c.trim(len(nxt[0]))


def test_plain_decoding_is_lossless(pair):
    model = pair[0]
    for prompt_len in (1, 30):
        prompt = prompt_ids(prompt_len)
        assert run(model, None, prompt, max_tokens=MAX_REF)[0] == reference(model, prompt)


def test_multi_turn_reuse_equals_a_fresh_run(pair):
    model, draft, _ = pair
    cache, oracle, prompt, follow, second = family.two_turns(model, draft)
    # A turn that rewrites the previous answer (as chat templates that drop old reasoning do): the
    # latent cache goes back to any length.
    edited = follow + second[:3] + [1, 2] + prompt_ids(4, seed=11)
    assert cache.reusable_prefix(edited) == len(follow) + 3 and cache.reuse_note is None
    family.check_turn(model, draft, cache, edited)
    other = prompt[:5] + prompt_ids(9, seed=13)
    assert cache.reusable_prefix(other) == 5
    family.check_turn(model, draft, cache, other)


def test_a_drafter_shaped_like_the_published_one(folders, tmp_path):
    """z-lab/Kimi-K2.5-DFlash's config, scaled down: a qwen3 drafter with blocks of 8, six taps
    spread over the target's layers and the target's YaRN; it loads, pairs and is lossless."""
    config = draft_config(block_size=8, layers=2, target_layer_ids=(0, 1, 1, 2, 2, 3))
    config.update(rope_theta=50000.0, max_position_embeddings=262144,
                  rope_scaling={"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096})  # fmt: skip
    mx.random.seed(2)
    built = DraftModel(DraftArgs.from_dict(config))
    folder = tmp_path / "draft"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(built.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    model, draft, _ = load(folders[0], folder)
    assert draft.block_size == 8 and draft.target_layer_ids == [0, 1, 1, 2, 2, 3]
    for prompt_len in (3, 25):
        prompt = prompt_ids(prompt_len)
        assert run(model, draft, prompt, max_tokens=40)[0] == reference(model, prompt, 40)


@pytest.mark.parametrize("q_bits", [None, 8])
def test_convert_load_generate(folders, tmp_path, capsys, q_bits):
    """dflash-convert -> load -> generate: the pair folder holds mlx-lm's own conversion, the INT4
    experts kept and (``q_bits``) the other layers quantized too."""
    from dflash_mlx.convert import convert
    from dflash_mlx.tools.cli.generate import main as generate_main

    target, _, draft_folder = folders
    pair = tmp_path / "pair"
    quantize = dict(quantize=True, q_bits=q_bits, q_group_size=32) if q_bits else {}
    result = convert(str(target), str(pair), draft_hf_path=str(draft_folder), dtype="float32", check_tokens=16,
                     verbose=False, **quantize)  # fmt: skip
    assert result.check.tokens_match
    quantization = json.loads((pair / "target" / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)
    if q_bits:
        assert quantization["language_model.model.layers.0.self_attn.o_proj"]["bits"] == 8
    model, draft, _ = load(pair)
    prompt = prompt_ids(19)
    assert run(model, draft, prompt, max_tokens=24)[0] == reference(model, prompt, 24)
    generate_main(["--model", str(pair), "--prompt", "t1 t2 t3", "--max-tokens", "8"])
    assert "Acceptance length" in capsys.readouterr().out


def test_bfloat16_keeps_the_router_bias_in_float32(folders):
    """A cast keeps what mlx-lm's cast_predicate keeps: the score bias that picks a token's experts."""
    model, _, _ = load(folders[0], dtype="bfloat16")
    mlp = model.language_model.model.layers[1].mlp
    assert mlp.gate.e_score_correction_bias.dtype == mx.float32 and mlp.gate.weight.dtype == mx.bfloat16
    assert tgt.compute_dtype(model) == mx.bfloat16


def _refused(folders, tmp_path, change, message):
    folder = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folders[0], folder)
    config = json.loads((folder / "config.json").read_text())
    change(config, config["text_config"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=message) as e:
        load(folder)
    assert "\n" not in str(e.value)


def _int8_groups(config, text):
    text["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8


def _rope_parameters(config, text):
    text["rope_parameters"] = {**text.pop("rope_scaling"), "rope_theta": text.pop("rope_theta")}


LAYOUTS_MLX_LM_MISREADS = [
    (lambda c, t: c.update(tie_word_embeddings=True), "config has tie_word_embeddings=true"),
    (_rope_parameters, "gives its RoPE as rope_parameters only"),
    (_int8_groups, "compressed-tensors group_0.weights.num_bits=8, which mlx-lm cannot read"),
    (lambda c, t: t["quantization_config"].update(format="float-quantized"), "format='float-quantized'"),
    (lambda c, t: t.update(quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32]}),
     r"FP8 checkpoint with weight_block_size=\[32, 32\], which mlx-lm dequantizes as 128x128 blocks"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", LAYOUTS_MLX_LM_MISREADS)
def test_layouts_mlx_lm_misreads_are_refused_in_one_line(folders, tmp_path, change, message):
    _refused(folders, tmp_path, change, message)


def test_hub_layouts_are_refused_before_download(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    published = {"model_type": "kimi_k25", "tie_word_embeddings": False,
                 "text_config": {"rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0},
                                 "quantization_config": KIMI_QUANTIZATION}}  # fmt: skip
    nvfp4 = json.loads(json.dumps(published))
    nvfp4["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    files = {"someone/kimi-nvfp4": nvfp4, "someone/kimi-mirror": published, "someone/Kimi-K2.5-NVFP4": nvfp4}

    def hf_hub_download(repo_id, filename, revision=None, **kwargs):
        if filename != "config.json":
            raise EntryNotFoundError(f"no {filename}")
        path = tmp_path / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(files[repo_id]))
        return str(path)

    def snapshot_download(*args, **kwargs):
        raise AssertionError("snapshot_download was called")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(DFlashError, match="format='nvfp4-pack-quantized'.*No weights were downloaded") as e:
        load("someone/kimi-nvfp4")
    assert "\n" not in str(e.value)
    # Named like the known pair's target, it is still read first.
    with pytest.raises(DFlashError, match="format='nvfp4-pack-quantized'.*No weights were downloaded"):
        load("someone/Kimi-K2.5-NVFP4", None)
    # The published layout goes on to download its weights.
    with pytest.raises(DFlashError, match="snapshot_download was called"):
        load("someone/kimi-mirror")


def test_registry_knows_the_kimi_pair(capsys):
    from dflash_mlx.convert.convert import main
    from dflash_mlx.loading.registry import find_draft, find_pair, known_targets

    assert find_draft("moonshotai/Kimi-K2.5") == "z-lab/Kimi-K2.5-DFlash"
    assert find_draft("mlx-community/Kimi-K2.5-4bit") == "z-lab/Kimi-K2.5-DFlash"
    assert find_pair("moonshotai/Kimi-K2.5").model_type == "kimi_k25" and "moonshotai/Kimi-K2.5" in known_targets()
    assert find_draft("moonshotai/Kimi-K2-Instruct") is None
    main(["--list"])
    lines = capsys.readouterr().out.splitlines()
    line = next(line for line in lines if line.split()[:3] == ["moonshotai/Kimi-K2.5", "->", "z-lab/Kimi-K2.5-DFlash"])
    assert "needs" not in line
