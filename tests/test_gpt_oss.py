"""gpt-oss targets (sliding-window and full attention layers with attention sinks, MoE MLP),
written as openai/gpt-oss-* are published (MXFP4 experts): mlx-lm against transformers, our
taps against HF's hidden states, the sliding window's rollback against a shorter pass, and
DFlash against mlx-lm's greedy decoding with prompts and contexts longer than the window."""

import json
import shutil

import mlx.core as mx
import pytest
from helpers import family
from helpers.checkpoints import VOCAB, draft_config, write_tokenizer
from helpers.decoding import run
from helpers.family import MAX_REF, prompt_ids, reference
from helpers.hf_checkpoints import GPT_OSS_WINDOW, hf_model
from helpers.oracles import ScriptedDraft
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache

from dflash_mlx import DFlashError, load, make_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftArgs, DraftModel
from dflash_mlx.models.sliding import SlidingKVCache

torch = pytest.importorskip("torch")

W = GPT_OSS_WINDOW
SLACK = family.SLIDING_SLACK


@pytest.fixture(autouse=True)
def small_sliding_caches(monkeypatch):
    family.small_sliding_caches(monkeypatch)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The target folder, its transformers model and a drafter folder."""
    return family.write_pair_folders(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss")


@pytest.fixture(scope="module")
def pair(folders):
    target, _, draft = folders
    return load(target, draft)


def test_the_checkpoint_is_the_published_layout(folders, pair):
    target, _, _ = folders
    config = json.loads((target / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4" and config["rope_scaling"]["rope_type"] == "yarn"
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"] and config["sliding_window"] == W
    model = pair[0]
    assert model.model_type == "gpt_oss" and type(model.model.layers[0].mlp.experts.gate_proj).__name__ == (
        "QuantizedSwitchLinear"
    )
    # The sliding layers' rotating buffers (mlx-lm's make_cache) become caches that roll back.
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, KVCache] * 2
    assert [type(c) for c in make_cache(model).target] == [SlidingKVCache, KVCache] * 2


@pytest.mark.parametrize("length", [3, 30])
def test_mlx_lm_greedy_matches_transformers(folders, pair, length):
    hf, model = folders[1], pair[0]
    prompt = prompt_ids(length, seed=5)
    family.check_greedy_matches_transformers(model, hf, prompt)


def test_taps_match_transformers_hidden_states(folders, pair):
    hf, model = folders[1], pair[0]
    prompt = prompt_ids(23)  # several windows long
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    tap_ids = [0, 1, 2, 3]
    logits, taps = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, tap_ids)
    assert mx.allclose(logits, model(mx.array([prompt])), atol=1e-5).item()
    H = tgt.hidden_size(model)
    for n, layer_id in enumerate(tap_ids):
        # HF's hidden_states[0] is the embedding output: layer i's output is [i + 1].
        expected = mx.array(hidden[layer_id + 1].numpy())
        err = mx.abs(taps[..., n * H : (n + 1) * H] - expected).max() / mx.abs(expected).max()
        # 5e-5, not the 1e-5 of dense targets: mlx-lm multiplies by the MXFP4 experts in its
        # quantized kernel, transformers by the dequantized matrices (another summation order).
        assert err.item() < 5e-5, layer_id


def test_taps_in_chunks_equal_one_pass(pair):
    """A prompt fed in chunks (the window cut between them) gives the taps of one pass."""
    model = pair[0]
    prompt = prompt_ids(29)
    _, whole = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, [0, 3])
    cache, parts = make_cache(model).target, []
    for a, b in ((0, 4), (4, 5), (5, 16), (16, 29)):
        parts.append(tgt.forward_with_taps(model, mx.array([prompt[a:b]]), cache, [0, 3])[1])
    # Passes of different lengths: OpenBLAS sums in another order.
    assert mx.allclose(mx.concatenate(parts, axis=1), whole, rtol=1e-4, atol=1e-3).item()
    assert all(c.stored <= W - 1 + SLACK + 8 + 13 for c in cache if isinstance(c, SlidingKVCache))


@pytest.mark.parametrize("prompt_len", [3, 11, 40])
def test_sliding_trim_equals_a_shorter_pass(pair, prompt_len):
    """After a pass of B tokens, trim(n) leaves what a pass of B - n tokens leaves, for every n:
    the next pass gives the same logits, also where the window has moved past the prompt."""
    model = pair[0]
    prompt, block = prompt_ids(prompt_len), prompt_ids(16, seed=7)
    for n in range(0, 17):
        cache = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), cache, [])
        tgt.forward_with_taps(model, mx.array([block]), cache, [])
        for c in cache:
            c.trim(n)
        straight = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), straight, [])
        if n < 16:
            tgt.forward_with_taps(model, mx.array([block[: 16 - n]]), straight, [])
        for c, s in zip(cache, straight):
            assert c.offset == s.offset == prompt_len + 16 - n
        for nxt in ([[5]], [[5, 6, 7, 8, 9, 10, 11, 12]]):  # a decoding step, a verify pass
            a, _ = tgt.forward_with_taps(model, mx.array(nxt), cache, [])
            b, _ = tgt.forward_with_taps(model, mx.array(nxt), straight, [])
            # Passes of different lengths: OpenBLAS sums in another order (measured up to 3e-4 on logits of ~14).
            assert mx.allclose(a, b, rtol=1e-4, atol=1e-3).item(), n
            for c in cache + straight:
                c.trim(len(nxt[0]))


def test_sliding_trim_past_what_the_window_keeps_is_refused(pair):
    """A trim back over the last pass and the slack before it is exact; one further is refused."""
    model = pair[0]
    cache = make_cache(model).target
    tgt.forward_with_taps(model, mx.array([prompt_ids(40)]), cache, [])
    tgt.forward_with_taps(model, mx.array([prompt_ids(3)]), cache, [])
    layer = cache[0]
    assert layer.stored == W - 1 + SLACK + 3 and layer.floor == 43 - SLACK - 3
    assert layer.can_trim(SLACK + 3) and not layer.can_trim(SLACK + 4)
    with pytest.raises(DFlashError, match=f"cannot go back to {layer.floor - 1} tokens: it keeps positions from 19 on"):
        layer.trim(SLACK + 4)


def test_plain_decoding_and_fallbacks_are_lossless(pair):
    """Plain decoding (pipelined: a step queued ahead is taken back), prompt lookup and the
    confidence cutoff through the same window cache."""
    model, draft, _ = pair
    for prompt_len in (1, 40):
        prompt = prompt_ids(prompt_len)
        ref = reference(model, prompt)
        assert run(model, None, prompt, max_tokens=MAX_REF)[0] == ref
        mixed = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3, unsure_every=4)
        for drafter, cutoff, fallback in ((draft, 0.5, 8), (mixed, 0.5, 0), (mixed, 0.0, 8)):
            out, _ = run(model, drafter, prompt, block_size=8, max_tokens=MAX_REF,
                         lookup_fallback=fallback, min_confidence=cutoff)  # fmt: skip
            assert out == ref, (prompt_len, cutoff, fallback)


def test_multi_turn_reuse_equals_a_fresh_run(pair):
    model, draft, _ = pair
    cache, oracle, prompt, follow, second = family.two_turns(model, draft)
    # A turn that rewrites the previous answer (as chat templates that drop old reasoning do)
    # returns to the window saved at the end of that turn's prompt.
    edited = follow + second[:3] + [1, 2] + prompt_ids(4, seed=11)
    edited_again = follow + second[:3] + [7, 7] + prompt_ids(4, seed=12)
    run(model, oracle, edited, max_tokens=20, prompt_cache=cache)
    reuse = cache.reusable_prefix(edited_again)
    assert reuse == len(follow) and "sliding window was saved" in cache.reuse_note
    family.check_turn(model, oracle, cache, edited_again)
    family.check_leaving_early(model, draft, cache, prompt)


def test_block_size_auto_is_lossless(pair):
    """block_size='auto' times verify passes on the live cache and trims each one off."""
    model, draft, _ = pair
    prompt = prompt_ids(30)
    out, _ = run(model, draft, prompt, block_size="auto", max_tokens=40, adaptive=False)
    assert out == reference(model, prompt, 40)


def test_a_drafter_shaped_like_the_published_one(folders, tmp_path):
    """z-lab/gpt-oss-20b-DFlash's config, scaled down: model_type gpt_oss, attention biases, blocks
    of 8, five taps, no num_target_layers and YaRN; it loads, pairs with the target and is lossless."""
    config = draft_config(block_size=8, target_layer_ids=(0, 1, 1, 2, 3))
    del config["num_target_layers"], config["auto_map"]
    config.update(model_type="gpt_oss", attention_bias=True, initial_context_length=4096, rope_theta=150000,
                  rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "original_max_position_embeddings": 4096})  # fmt: skip
    mx.random.seed(2)
    built = DraftModel(DraftArgs.from_dict(config))
    folder = tmp_path / "draft"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(built.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    model, draft, _ = load(folders[0], folder)
    assert draft.block_size == 8 and draft.target_layer_ids == [0, 1, 1, 2, 3]
    assert "layers.0.self_attn.q_proj.bias" in dict(tree_flatten(draft.parameters()))
    for prompt_len in (3, 25):
        prompt = prompt_ids(prompt_len)
        assert run(model, draft, prompt, max_tokens=40)[0] == reference(model, prompt, 40)


@pytest.mark.parametrize("q_bits", [None, 8])
def test_convert_load_generate(folders, tmp_path, capsys, q_bits):
    """dflash-convert -> load -> generate, for the MXFP4 checkpoint: the pair folder holds mlx-lm's
    own conversion, with the MXFP4 experts kept and (``q_bits``) the other layers quantized too,
    the layout of mlx-community's gpt-oss-*-MXFP4-Q8 repositories."""
    from dflash_mlx.convert import convert
    from dflash_mlx.tools.cli.generate import main as generate_main

    target, _, draft_folder = folders
    pair = tmp_path / "pair"
    quantize = dict(quantize=True, q_bits=q_bits, q_group_size=32) if q_bits else {}
    result = convert(str(target), str(pair), draft_hf_path=str(draft_folder), dtype="float32", check_tokens=16,
                     verbose=False, **quantize)  # fmt: skip
    assert result.check.tokens_match
    quantization = json.loads((pair / "target" / "config.json").read_text())["quantization"]
    assert quantization["mode"] == "mxfp4"
    if q_bits:
        assert quantization["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    model, draft, _ = load(pair)
    prompt = prompt_ids(19)
    assert run(model, draft, prompt, max_tokens=24)[0] == reference(model, prompt, 24)
    generate_main(["--model", str(pair), "--prompt", "t1 t2 t3", "--max-tokens", "8"])
    assert "Acceptance length" in capsys.readouterr().out


def test_transformers_own_save_is_refused_in_one_line(tmp_path):
    """transformers writes gpt-oss's experts dequantized as it holds them ((E, in, out), gate and up
    fused), which mlx-lm's loader reads as the MXFP4 layout's (E, out, in): refused, not misread."""
    model = hf_model("gpt_oss", layers=2)
    model.save_pretrained(str(tmp_path / "target"))
    write_tokenizer(tmp_path / "target")
    with pytest.raises(DFlashError, match=r"experts as transformers holds them .*openai/gpt-oss-20b") as e:
        load(tmp_path / "target")
    assert "\n" not in str(e.value)


def test_rope_parameters_without_rope_scaling_is_refused(folders, tmp_path):
    """A config with transformers 5's rope_parameters alone: mlx-lm's gpt_oss reads rope_theta and
    rope_scaling only, and would run without YaRN."""
    folder = tmp_path / "target"
    shutil.copytree(folders[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="rope_parameters but no rope_scaling"):
        load(folder)


def test_registry_knows_the_gpt_oss_pairs():
    from dflash_mlx.loading.registry import find_draft, find_pair

    assert find_draft("openai/gpt-oss-20b") == "z-lab/gpt-oss-20b-DFlash"
    assert find_draft("openai/gpt-oss-120b") == "z-lab/gpt-oss-120b-DFlash"
    assert find_draft("mlx-community/gpt-oss-20b-MXFP4-Q8") == "z-lab/gpt-oss-20b-DFlash"
    assert find_draft("mlx-community/gpt-oss-120b-MXFP4-Q4") == "z-lab/gpt-oss-120b-DFlash"
    assert find_draft("lmstudio-community/gpt-oss-120b-MLX-8bit") == "z-lab/gpt-oss-120b-DFlash"
    assert find_pair("openai/gpt-oss-20b").model_type == "gpt_oss"
    assert find_draft("openai/gpt-oss-20b-finetune") is None


def test_convert_lists_the_gpt_oss_pairs(capsys):
    from dflash_mlx.convert.convert import main

    main(["--list"])
    lines = capsys.readouterr().out.splitlines()
    for target, draft in (("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
                          ("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash")):  # fmt: skip
        assert any(line.split()[:3] == [target, "->", draft] for line in lines), (target, lines)


def _fake_hub(monkeypatch, tmp_path, files: dict[str, dict]):
    """The hub client: ``files[repo/filename]`` as JSON; a snapshot download fails the test."""
    import huggingface_hub

    fetched = []

    def hf_hub_download(repo_id, filename, revision=None, **kwargs):
        fetched.append(f"{repo_id}/{filename}")
        if f"{repo_id}/{filename}" not in files:
            from huggingface_hub.errors import EntryNotFoundError

            raise EntryNotFoundError(f"no {filename}")
        path = tmp_path / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(files[f"{repo_id}/{filename}"]))
        return str(path)

    def snapshot_download(*args, **kwargs):
        raise AssertionError("snapshot_download was called")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return fetched


def test_hub_layouts_mlx_lm_would_misread_are_refused_before_download(tmp_path, monkeypatch):
    config = {"model_type": "gpt_oss", "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}
    dequantized = {"weight_map": {"model.layers.0.mlp.experts.gate_up_proj": "model-00001.safetensors"}}
    mxfp4 = {"weight_map": {"model.layers.0.mlp.experts.gate_up_proj_blocks": "model-00001.safetensors"}}
    rope5 = {"model_type": "gpt_oss", "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000, "factor": 32.0}}
    fetched = _fake_hub(monkeypatch, tmp_path, {
        "someone/gpt-oss-bf16/config.json": config, "someone/gpt-oss-bf16/model.safetensors.index.json": dequantized,
        "someone/gpt-oss-rope5/config.json": rope5,
        "someone/gpt-oss-fine/config.json": config, "someone/gpt-oss-fine/model.safetensors.index.json": mxfp4,
    })  # fmt: skip
    for repo, message in (("someone/gpt-oss-bf16", "experts as transformers holds them"),
                          ("someone/gpt-oss-rope5", "rope_parameters but no rope_scaling")):  # fmt: skip
        with pytest.raises(DFlashError, match=message) as e:
            load(repo)
        assert f"{repo} (no weights were downloaded)" in str(e.value)
    # The published MXFP4 layout goes on to download its weights.
    with pytest.raises(DFlashError, match="snapshot_download was called"):
        load("someone/gpt-oss-fine")
    assert "someone/gpt-oss-fine/model.safetensors.index.json" in fetched
