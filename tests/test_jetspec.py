"""JetSpec heads: the z-lab layout with ``dflash_config.causal_head`` (a block-causal mask inside the block)
and an optional hidden-size adapter; lossless on the target families, with draft trees, sampling exact in
distribution, and parity with the authors' head (hao-ai-lab/JetSpec)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import family, sampled
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB, write_target
from helpers.family_drafters import BLOCK, jetspec_config, write_jetspec

from dflash_mlx import DFlashError, load, make_cache
from dflash_mlx.loading.draft_loader import load_draft
from dflash_mlx.models.drafter import block_mask
from dflash_mlx.sampling import make_sampler


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("jetspec")
    write_target(root / "qwen3")
    write_jetspec(root / "draft")
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders / "qwen3", folders / "draft")


def test_causal_head_makes_every_layer_block_causal(pair):
    """Each block slot sees the context and the slots up to its own, as the authors' mask: a slot's
    hidden state does not change when a later slot's input does."""
    model, draft, _ = pair
    assert all(layer.self_attn.causal for layer in draft.layers)
    taps = mx.random.normal((1, 5, 2 * HIDDEN), key=mx.random.key(0))
    block = mx.array([[7] + [MASK_ID] * (BLOCK - 1)])
    other = mx.array([[7, MASK_ID, MASK_ID, 3] + [MASK_ID] * (BLOCK - 4)])
    a, b = (draft(draft.embed(model, x), taps) for x in (block, other))
    assert mx.allclose(a[:, :3], b[:, :3], atol=1e-6) and not mx.allclose(a[:, 3:], b[:, 3:], atol=1e-3)
    assert block_mask(5, 3, True, None).tolist() == [[k <= 5 + q for k in range(8)] for q in range(3)]


@pytest.mark.parametrize("block_size, prompt_len", [(2, 19), (BLOCK, 1)])
def test_greedy_is_lossless(pair, block_size, prompt_len):
    model, draft, _ = pair
    family.check_lossless(model, draft, block_size, prompt_len)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4_text"])  # hybrid and sliding; dense: the qwen3 pair
def test_greedy_is_lossless_on_the_target_families(tmp_path, folders, kind):
    from helpers.hf_checkpoints import write_hf_target

    write_hf_target(tmp_path / "target", kind)
    model, draft, _ = load(tmp_path / "target", folders / "draft")
    family.check_lossless(model, draft, BLOCK, 9)
    family.check_every_acceptance_length(model, draft, BLOCK)
    family.check_stop_mid_block_then_continue(model, draft)


def test_draft_trees(tmp_path, folders):
    """The causal head's slots are still one distribution per depth from one pass: DDTree's trees
    (the authors' accum_logp construction) run on them."""
    from helpers.varied import write_varied_target

    write_varied_target(tmp_path / "target")  # a target whose text does not repeat: a wrong branch shows
    model, draft, _ = load(tmp_path / "target", folders / "draft")
    family.check_tree_lossless(model, draft)


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory, folders):
    """A target with smaller logits, so that sampling has real choices, and its exact marginals."""
    folder = tmp_path_factory.mktemp("sampling") / "target"
    write_target(folder, embed_scale=0.2)
    model, draft, _ = load(folder, folders / "draft")
    return model, draft, sampled.marginals(model, make_sampler(1.0), depth=2)


@pytest.mark.parametrize("broken", [None, "accept", "q"])
def test_sampled_drafts_keep_the_targets_distribution(sampling_pair, monkeypatch, broken):
    """The JetSpec drafter's sampled drafts keep the target's distribution; negative controls: every
    draft accepted, or each draft's q stated from the slot before its own."""
    sampled.check_with_controls(*sampling_pair, 1.0, broken, monkeypatch)


def test_hidden_size_adapter(tmp_path, folders):
    """A head whose taps come from a narrower target: a shared linear map per tap before fc. It loads
    alone; with a target of another width, a one-line refusal."""
    write_jetspec(tmp_path / "draft", jetspec_config(target_hidden_size=32))
    draft = load_draft(tmp_path / "draft")
    assert draft.hidden_dim_adapter.proj.weight.shape == (HIDDEN, 32) and draft.tap_blocks() is None
    taps = mx.random.normal((1, 4, 64), key=mx.random.key(1))
    expected = mx.concatenate(
        [draft.hidden_dim_adapter.proj(taps[..., :32]), draft.hidden_dim_adapter.proj(taps[..., 32:])], -1
    )
    assert mx.allclose(draft.adapt(taps), expected, atol=1e-6)
    with pytest.raises(DFlashError, match="made for a target of hidden_size=32, but this target has hidden_size=64"):
        load(folders / "qwen3", tmp_path / "draft")


# ---- Parity with the authors' head (hao-ai-lab/JetSpec, checked at 2c7b3fae75690dfe9a188a37d7fdfd43ee0e032f) ----
# JetSpec is not on the package index: point DFLASH_JETSPEC_SRC at a checkout of it to run these.


@pytest.fixture(scope="module")
def jetspec():
    """The authors' head class and drafting helper, or a skip that says where to get them."""
    import os
    import sys
    from types import SimpleNamespace

    src = os.environ.get("DFLASH_JETSPEC_SRC")
    if not src:
        pytest.skip(
            "the JetSpec parity tests need the authors' code: DFLASH_JETSPEC_SRC=<checkout of hao-ai-lab/JetSpec>"
        )
    torch = pytest.importorskip("torch")
    sys.path.insert(0, src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from jetspec import draft_head_adapter
        from jetspec.models.draft_head import DFlashDraftModel

        yield SimpleNamespace(adapter=draft_head_adapter, Head=DFlashDraftModel)
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(src)


def authors_head(jetspec, config: dict, seed: int = 0):
    import torch
    from transformers import Qwen3Config

    skip = ("model_type", "architectures", "torch_dtype", "auto_map")
    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k not in skip})
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    head = jetspec.Head(hf_config)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return head.float().eval()


@pytest.mark.parametrize("causal", [True, False])
def test_blocks_match_the_authors(jetspec, tmp_path, monkeypatch, causal):
    """Three drafting cycles through the authors' ``_DraftHeadForward`` (their KV-cached head pass, cropped
    to the context after each block) on the same target: the same draft logits every cycle."""
    import torch
    from helpers.hf_checkpoints import write_hf_target
    from transformers import DynamicCache

    class CropToLength(DynamicCache):
        # JetSpec crops its caches to a length, as transformers 4 did; transformers 5 crops by a count.
        def crop(self, length):
            if length < self.get_seq_length():
                super().crop(length - self.get_seq_length())

    monkeypatch.setattr(jetspec.adapter, "DynamicCache", CropToLength)
    target = write_hf_target(tmp_path / "target", "qwen3_moe")
    head = authors_head(jetspec, jetspec_config(causal_head=causal))
    head.save_pretrained(str(tmp_path / "draft"))
    model, draft, _ = load(tmp_path / "target", tmp_path / "draft")
    assert all(layer.self_attn.causal == causal for layer in draft.layers)
    theirs = jetspec.adapter._DraftHeadForward(head, target, BLOCK, draft.target_layer_ids)
    cache = make_cache(model, draft)
    rng = np.random.default_rng(0)
    context = rng.integers(0, VOCAB - 4, 10).tolist()
    taps = rng.standard_normal((1, 9, 2 * HIDDEN)).astype(np.float32)  # the taps of all but the anchor
    done = 0
    for _ in range(3):
        with torch.no_grad():
            logits = theirs._forward_head(torch.tensor([context]), torch.tensor(taps), BLOCK - 1)
        block = mx.array([[context[-1]] + [MASK_ID] * (BLOCK - 1)])
        ours = draft.propose(model, block, mx.array(taps[:, done:]), cache.draft)
        np.testing.assert_allclose(np.array(ours), logits.numpy(), atol=1e-4)
        done = taps.shape[1]
        kept = int(rng.integers(1, BLOCK))
        context += rng.integers(0, VOCAB - 4, kept).tolist()
        taps = np.concatenate([taps, rng.standard_normal((1, kept, 2 * HIDDEN)).astype(np.float32)], axis=1)


def test_adapter_matches_the_authors(jetspec, tmp_path):
    """The adapter's layout and output: the authors' head on taps of a narrower target."""
    import torch

    head = authors_head(jetspec, jetspec_config(target_hidden_size=32))
    head.save_pretrained(str(tmp_path / "draft"))
    draft = load_draft(tmp_path / "draft")
    rng = np.random.default_rng(1)
    taps = rng.standard_normal((1, 6, 64)).astype(np.float32)
    noise = rng.standard_normal((1, BLOCK, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        h = head(position_ids=torch.arange(6 + BLOCK)[None], noise_embedding=torch.tensor(noise),
                 target_hidden=torch.tensor(taps), is_causal=True)  # fmt: skip
    np.testing.assert_allclose(np.array(draft(mx.array(noise), mx.array(taps))), h.numpy(), atol=1e-4)
