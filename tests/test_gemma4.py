"""Gemma 4 targets (gemma4_text, gemma4), written by transformers' own classes: mlx-lm against
transformers, our taps against HF's hidden states, and DFlash against mlx-lm's greedy decoding
through every rollback length, with prompts longer than the sliding window."""

import json
import shutil

import mlx.core as mx
import pytest
from helpers import family
from helpers.checkpoints import MASK_ID
from helpers.decoding import run
from helpers.family import gemma_draft_config, prompt_ids, reference
from helpers.hf_checkpoints import GEMMA_KINDS, GEMMA_WINDOW
from mlx_lm.models.cache import KVCache

from dflash_mlx import DFlashError, load, make_cache
from dflash_mlx.models import sliding
from dflash_mlx.models import target as tgt
from dflash_mlx.models.drafter import DraftArgs

torch = pytest.importorskip("torch")

SLACK = family.SLIDING_SLACK


@pytest.fixture(autouse=True)
def small_sliding_caches(monkeypatch):
    family.small_sliding_caches(monkeypatch)


@pytest.fixture(scope="session")
def gemma_targets(tmp_path_factory):
    """{kind: (folder, transformers model)} and the drafter folder under "draft"."""
    return family.write_targets(tmp_path_factory.mktemp("gemma-targets"), GEMMA_KINDS, draft=gemma_draft_config())


@pytest.fixture(scope="session")
def gemma_pairs(gemma_targets):
    return {kind: load(gemma_targets[kind][0], gemma_targets["draft"][0]) for kind in GEMMA_KINDS}


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_mlx_lm_greedy_matches_transformers(gemma_targets, gemma_pairs, kind):
    hf, model = gemma_targets[kind][1], gemma_pairs[kind][0]
    prompt = prompt_ids(30, seed=5)
    assert len(prompt) > 4 * GEMMA_WINDOW
    family.check_greedy_matches_transformers(model, hf, prompt)


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_taps_embedding_and_head_match_transformers(gemma_targets, gemma_pairs, kind):
    hf, model = gemma_targets[kind][1], gemma_pairs[kind][0]
    prompt = prompt_ids(23)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        hf_embedding = hf.get_input_embeddings()(torch.tensor([prompt]))
    tap_ids = [0, 1, 2, 3]
    logits, taps = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, tap_ids)
    # The head the drafter borrows gives the target's own logits, softcap included.
    assert mx.allclose(logits, model(mx.array([prompt])), atol=1e-5).item()
    assert (mx.abs(logits - mx.array(out.logits.numpy())).max() / mx.abs(logits).max()).item() < 1e-4
    assert mx.abs(logits).max().item() < 5.0 < mx.abs(logits / 0.5).max().item()  # the softcap bends them
    # The drafter's input embedding is HF's (scaled by sqrt(hidden_size)), as z-lab's drafters were trained on.
    assert mx.allclose(tgt.embed(model, mx.array([prompt])), mx.array(hf_embedding.numpy()), atol=1e-5).item()
    H = tgt.hidden_size(model)
    for n, layer_id in enumerate(tap_ids):
        # HF's hidden_states[0] is the embedding output: layer i's output is [i + 1] (the last after the norm).
        expected = mx.array(out.hidden_states[layer_id + 1].numpy())
        err = mx.abs(taps[..., n * H : (n + 1) * H] - expected).max() / mx.abs(expected).max()
        assert err.item() < 1e-4, layer_id  # (the experts' sums round a little differently)


def test_a_draft_vocabulary_is_softcapped_like_the_head(gemma_targets):
    model, draft, _ = load(gemma_targets["gemma4"][0], gemma_targets["draft"][0])
    ids = mx.array([3, 17, 90, 5], dtype=mx.int32)
    draft.set_draft_vocab(ids)
    h = mx.random.normal((1, 3, tgt.hidden_size(model))) * 4
    assert mx.allclose(draft.logits(model, h), tgt.lm_head(model, h)[..., ids], atol=1e-5).item()


def test_the_training_loss_reads_the_head_without_its_softcap(gemma_pairs):
    """dflash-train's logit loss reads W^T off the head applied to the identity."""
    from dflash_mlx.tools.train.losses import head_gram

    model = gemma_pairs["gemma4"][0]
    w = model.language_model.model.embed_tokens.weight.T  # (H, V): the head is tied
    w = w - w.mean(axis=1, keepdims=True)
    assert mx.allclose(head_gram(model), (w @ w.T) / w.shape[1], atol=1e-6).item()


@pytest.mark.parametrize("prompt_len", [11, 40])
@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_caches_roll_back_at_every_length(gemma_pairs, kind, prompt_len):
    """Sliding layers keep a SlidingKVCache, the others a KVCache, the layers that reuse keys and
    values none; after a pass of 16 tokens, trim(n) leaves what a pass of 16 - n tokens leaves,
    also once the sliding caches have dropped their oldest positions."""
    model = gemma_pairs[kind][0]
    cache = make_cache(model).target
    own = 2 if kind == "gemma4_text" else 4
    assert [type(c) for c in cache] == [sliding.SlidingKVCache, KVCache] * (own // 2)
    prompt, block = prompt_ids(prompt_len), prompt_ids(16, seed=7)
    nxt = mx.array([[5, 6, 7]])
    for n in range(0, 17):
        cache = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), cache, [])
        tgt.forward_with_taps(model, mx.array([block]), cache, [])
        assert (cache[0].start > 0) == (prompt_len == 40)
        for c in cache:
            c.trim(n)
        straight = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt + block[: 16 - n]]), straight, [])
        assert all(c.offset == s.offset == len(prompt) + 16 - n for c, s in zip(cache, straight))
        a, taps_a = tgt.forward_with_taps(model, nxt, cache, [0, 2])
        b, taps_b = tgt.forward_with_taps(model, nxt, straight, [0, 2])
        # Passes of different lengths: OpenBLAS sums in another order (measured up to 3e-4 on logits of ~14).
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-3).item(), n
        assert mx.allclose(taps_a, taps_b, rtol=1e-4, atol=2e-3).item(), n


def test_a_sliding_cache_keeps_its_window_and_slack(gemma_pairs):
    model = gemma_pairs["gemma4"][0]
    cache = make_cache(model).target
    for passes in range(1, 21):
        tgt.forward_with_taps(model, mx.array([prompt_ids(7)]), cache, [])
        sliding = cache[0]
        assert GEMMA_WINDOW - 1 + SLACK + 7 <= sliding.stored <= GEMMA_WINDOW - 1 + SLACK + 8 + 7 or sliding.start == 0
        assert sliding.keys_and_values()[0].shape[2] == sliding.stored
        assert cache[1].offset == sliding.offset == 7 * passes
    floor = sliding.floor
    assert floor == sliding.start + GEMMA_WINDOW - 1 and floor <= sliding.offset - SLACK - 7
    with pytest.raises(DFlashError, match=f"cannot go back to {floor - 1} tokens: it keeps positions from "):
        sliding.trim(sliding.offset - floor + 1)
    sliding.trim(sliding.offset)
    assert sliding.offset == sliding.start == sliding.stored == 0


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_multi_turn_reuse_equals_a_fresh_run(gemma_pairs, kind):
    model, draft, _ = gemma_pairs[kind]
    cache, oracle, prompt, follow, second = family.two_turns(model, draft)
    # A turn that rewrites the end of the previous answer: the sliding layers go back that far.
    edited = follow + second[:30] + [1, 2] + prompt_ids(4, seed=11)
    assert cache.reusable_prefix(edited) == len(follow) + 30 and cache.reuse_note is None
    family.check_turn(model, draft, cache, edited)
    # One that rewrites it from its start, further back than the sliding layers keep: they return to
    # the window saved at the end of that turn's prompt.
    again = follow + second[:3] + [1, 2] + prompt_ids(4, seed=12)
    assert cache.reusable_prefix(again) == len(follow) and "sliding window was saved" in cache.reuse_note
    family.check_turn(model, draft, cache, again)
    family.check_leaving_early(model, draft, cache, prompt)


def test_gemma4_unified_is_built_by_mlx_lms_gemma4_module(gemma_targets, gemma_pairs, tmp_path):
    """The 12B's model_type: mlx-lm builds it with its gemma4 module; the pair runs as gemma4's."""
    folder = tmp_path / "unified"
    shutil.copytree(gemma_targets["gemma4"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gemma4_unified"
    (folder / "config.json").write_text(json.dumps(config))
    model, draft, _ = load(folder, gemma_targets["draft"][0])
    assert model.model_type == "gemma4_unified"
    prompt = prompt_ids(20)
    ref = reference(gemma_pairs["gemma4"][0], prompt, 40)
    assert reference(model, prompt, 40) == ref and run(model, draft, prompt, max_tokens=40)[0] == ref


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_layouts_mlx_lm_cannot_build_are_refused_in_one_line(gemma_targets, kind, tmp_path):
    from dflash_mlx.convert import convert

    def refused(change, message):
        folder = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        shutil.copytree(gemma_targets[kind][0], folder)
        config = json.loads((folder / "config.json").read_text())
        change(config, config.get("text_config", config))
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(DFlashError, match=message) as e:
            load(folder)
        assert "\n" not in str(e.value)
        with pytest.raises(DFlashError, match=message):  # dflash-convert refuses it before writing anything
            convert(str(folder), str(tmp_path / "pair"), draft_hf_path=str(gemma_targets["draft"][0]))
        assert not (tmp_path / "pair").exists()

    def per_layer_config(config, text):
        # As transformers 5.24 saves the published layout.
        head_dim = text.pop("global_head_dim")
        text["per_layer_config"] = {str(i): {"head_dim": head_dim} for i in (1, 3)}

    refused(per_layer_config, r"per_layer_config gives layer 1 head_dim=32, which mlx-lm does not read: .* "
                              r"Set global_head_dim=32")  # fmt: skip
    refused(lambda c, t: t.update(use_bidirectional_attention="all"), "use_bidirectional_attention='all'")
    refused(lambda c, t: t.pop("num_kv_shared_layers"), "no num_kv_shared_layers: transformers reads that as 0, mlx")
    refused(
        lambda c, t: t.pop("final_logit_softcapping"), "no final_logit_softcapping: transformers reads that as None"
    )
    if kind == "gemma4":
        message = r"text_config has vocab_size=128, but mlx-lm builds .* vocab_size=262144"
        refused(lambda c, t: c.pop("vocab_size"), message)


def test_the_published_gemma_pairs_are_known():
    from dflash_mlx.loading import registry

    assert registry.find_pair("mlx-community/gemma-4-31B-it-4bit").draft == "z-lab/gemma-4-31B-it-DFlash"
    assert registry.find_pair("google/gemma-4-26B-A4B-it").draft == "z-lab/gemma-4-26B-A4B-it-DFlash"
    assert registry.find_pair("google/gemma-4-12B-it").model_type == "gemma4_unified"
    assert registry.find_pair("google/gemma-4-E4B-it") is None


def test_published_drafter_configs_load(gemma_targets, gemma_pairs, tmp_path):
    """z-lab's Gemma 4 drafter config: rope_theta at the top level, as published, or only under
    rope_parameters, as transformers 5 writes it; its softcap is the target's."""
    published = gemma_draft_config()
    assert published["rope_theta"] == 10000.0 and published["final_logit_softcapping"] == 5.0
    v5 = {k: v for k, v in published.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    a, b = DraftArgs.from_dict(published), DraftArgs.from_dict(v5)
    assert a.rope_theta == b.rope_theta == 10000.0 and a.rope_scaling is b.rope_scaling is None
    scaled = dict(v5, rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0})
    c = DraftArgs.from_dict(scaled)
    assert c.rope_theta == 5e5 and c.rope_scaling["factor"] == 2.0
    folder = tmp_path / "draft"
    shutil.copytree(gemma_targets["draft"][0], folder)
    (folder / "config.json").write_text(json.dumps(v5))
    model, draft, _ = load(gemma_targets["gemma4"][0], folder)
    assert draft.layers[0].self_attn.window == 8 and draft.args.final_logit_softcapping == 5.0
    assert draft.mask_token_id == MASK_ID
    prompt = prompt_ids(30)
    assert run(model, draft, prompt, max_tokens=40)[0] == reference(model, prompt, 40)
    (folder / "config.json").write_text(json.dumps(dict(v5, final_logit_softcapping=30.0)))
    with pytest.raises(DFlashError, match="final_logit_softcapping=30.0, but this target's is 5.0"):
        load(gemma_targets["gemma4"][0], folder)
    per_type = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    with pytest.raises(DFlashError, match=r"rope_parameters per layer type \['full_attention', 'sliding_attention'\]"):
        DraftArgs.from_dict(dict(v5, rope_parameters=per_type))


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_convert_load_generate_chat(gemma_targets, kind, tmp_path, capsys):
    """dflash-convert -> load -> dflash-generate -> the chat engine's turns; the chat's second
    turn (reusing the cache) equals a fresh run of it."""
    from dflash_mlx.convert import convert
    from dflash_mlx.tools.cli.generate import main as generate_main
    from dflash_mlx.tui.commands import Settings
    from dflash_mlx.tui.engine import MLXEngine

    pair = tmp_path / "pair"
    result = convert(str(gemma_targets[kind][0]), str(pair), draft_hf_path=str(gemma_targets["draft"][0]),
                     dtype="float32", check_tokens=16, verbose=False)  # fmt: skip
    assert result.check.tokens_match
    model, draft, _ = load(pair)
    prompt = prompt_ids(20)
    assert run(model, draft, prompt, max_tokens=24)[0] == reference(model, prompt, 24)
    generate_main(["--model", str(pair), "--prompt", "t1 t2 t3", "--max-tokens", "8"])
    assert "Acceptance length" in capsys.readouterr().out

    def reply(engine, messages):
        return "".join(r.text for r in engine(messages, Settings(max_tokens=10)))

    chat = MLXEngine(str(pair))
    chat.load()
    turns = [{"role": "user", "content": "t1 t2 t3"}]
    turns.append({"role": "assistant", "content": reply(chat, turns)})
    turns.append({"role": "user", "content": "t4 t5"})
    second = reply(chat, turns)
    fresh = MLXEngine(str(pair))
    fresh.load()
    assert second == reply(fresh, turns)
    chat.close()
    fresh.close()
