"""DFlare drafters (Tencent AngelSlim): per-layer fusion of the taps and the context's own key/value projections;
loading their published layout, lossless generation on the target families, draft trees, sampling exact in
distribution, and parity with the authors' ``qwen_dflare.py``."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import family, family_suite, sampled
from helpers.checkpoints import HIDDEN, MASK_ID
from helpers.family_drafters import BLOCK, TAPS, dflare_config, write_dflare

from dflash_mlx import load, make_cache
from dflash_mlx.models import dflare


@pytest.fixture(scope="module")
def folders(tmp_path_factory, pair_dirs):
    draft = tmp_path_factory.mktemp("dflare") / "draft"
    write_dflare(draft)
    return {"target": pair_dirs["qwen3-tied"], "draft": draft}


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders["target"], folders["draft"])


def test_published_layout_loads_unchanged(folders, pair):
    before = (folders["draft"] / "config.json").read_text()
    _, draft, _ = pair
    assert isinstance(draft, dflare.DraftModel) and "fc" not in draft
    assert draft.layer_fusion_weights.shape == (3, len(TAPS)) and draft.tap_blocks() is None
    assert draft.layers[0].self_attn.k_proj_target.weight.shape == (32, HIDDEN)
    assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (BLOCK, MASK_ID, TAPS)
    assert (folders["draft"] / "config.json").read_text() == before


def test_each_layer_sees_its_own_fusion_of_the_taps(pair):
    """Layer i's context is hidden_norm of the taps mixed by softmax(layer_fusion_weights[i]), its keys
    and values from the target projections: checked against the sum written out."""
    _, draft, _ = pair
    taps = mx.random.normal((1, 5, len(TAPS) * HIDDEN), key=mx.random.key(2))
    contexts = draft.contexts(taps)
    weights = mx.softmax(draft.layer_fusion_weights, axis=-1)
    for i, context in enumerate(contexts):
        mixed = sum(weights[i, t] * taps[..., t * HIDDEN : (t + 1) * HIDDEN] for t in range(len(TAPS)))
        assert mx.allclose(context, draft.hidden_norm(mixed), atol=1e-5)
    assert not mx.allclose(contexts[0], contexts[1], atol=1e-3)


@pytest.mark.parametrize("block_size, prompt_len", [(2, 19), (BLOCK, 1)])
def test_greedy_is_lossless(pair, block_size, prompt_len):
    model, draft, _ = pair
    family.check_lossless(model, draft, block_size, prompt_len)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4_text"])  # hybrid and sliding; dense: the qwen3 pair
def test_greedy_is_lossless_on_the_target_families(hf_target_dirs, folders, kind):
    family_suite.check_target_families(hf_target_dirs[kind], folders["draft"], BLOCK)


def test_draft_trees(varied_dirs, folders):
    family_suite.check_trees(varied_dirs["qwen3-tied"], folders["draft"])


@pytest.fixture(scope="module")
def sampling_pair(sampling_target, folders):
    return family_suite.sampling_pair(sampling_target, folders["draft"])


@pytest.mark.parametrize("broken", [None, "accept", "q"])
def test_sampled_drafts_keep_the_targets_distribution(sampling_pair, monkeypatch, broken):
    """The DFlare drafter's sampled drafts keep the target's distribution; negative controls: every
    draft accepted, or each draft's q stated from the slot before its own."""
    sampled.check_with_controls(*sampling_pair, 1.0, broken, monkeypatch)


# ---- Parity with the authors' qwen_dflare.py (Tencent/AngelSlim, checked at 67394ce55f6b6cfae702575fbc3c7a05c13fdd74) ----
# AngelSlim's package needs more than these tests have (datasets, ...): the file and the factory beside it are
# loaded alone from DFLASH_DFLARE_SRC, a checkout of Tencent/AngelSlim.


@pytest.fixture(scope="module")
def angelslim():
    """The authors' ``qwen_dflare`` module and a cache that crops as theirs expects, or a skip."""
    import importlib
    import sys
    import types
    from pathlib import Path

    with family_suite.authors_code("DFLASH_DFLARE_SRC", "Tencent/AngelSlim") as src:
        package = types.ModuleType("angelslim_drafts")
        package.__path__ = [str(Path(src) / "angelslim/compressor/speculative/train/models/draft")]
        sys.modules["angelslim_drafts"] = package
        try:
            module = importlib.import_module("angelslim_drafts.qwen_dflare")
            yield types.SimpleNamespace(module=module, Cache=family_suite.crop_to_length_cache())
        finally:
            for name in [n for n in sys.modules if n.startswith("angelslim_drafts")]:
                del sys.modules[name]


def authors_dflare(angelslim, config: dict, seed: int = 0):
    def build():
        return angelslim.module.QwenDFlareDraftModel(family_suite.qwen3_config(config))

    return family_suite.randomize(build, seed, {"layer_fusion_weights": lambda p: p.normal_(0.0, 1.5)})


def test_blocks_match_the_authors(angelslim, folders, tmp_path):
    """Three drafting cycles over a context that grows and is cropped between them, as in the authors'
    spec_generate: the same hidden states every cycle."""
    import torch

    draft_torch = authors_dflare(angelslim, dflare_config())
    draft_torch.save_pretrained(str(tmp_path / "draft"))
    model, draft, _ = load(folders["target"], tmp_path / "draft")
    cache, their_cache = make_cache(model, draft), angelslim.Cache()
    rng = np.random.default_rng(0)
    start, taps = 10, rng.standard_normal((1, 10, len(TAPS) * HIDDEN)).astype(np.float32)
    for _ in range(3):
        noise = rng.standard_normal((1, BLOCK, HIDDEN)).astype(np.float32)
        with torch.no_grad():
            positions = torch.arange(their_cache.get_seq_length(), start + BLOCK)[None]
            h = draft_torch(target_hidden=torch.tensor(taps), noise_embedding=torch.tensor(noise), position_ids=positions,
                            past_key_values=their_cache, use_cache=True, is_causal=False)  # fmt: skip
            their_cache.crop(start)
        ours = draft(mx.array(noise), mx.array(taps), cache.draft)
        np.testing.assert_allclose(np.array(ours), h.numpy(), atol=1e-4)
        kept = int(rng.integers(1, BLOCK))
        start, taps = start + kept, rng.standard_normal((1, kept, len(TAPS) * HIDDEN)).astype(np.float32)


def test_cycles_match_the_authors_generate(angelslim, tmp_path, monkeypatch):
    """The authors' spec_generate and ours, greedy on the same target with a drafter fitted to agree with
    it: the same tokens, and the same tokens per cycle (theirs read from where each verify pass starts)."""
    import torch
    import torch.nn.functional as F
    from helpers.decoding import greedy, run
    from helpers.hf_checkpoints import write_hf_target
    from helpers.torch_oracles import fit_to_sequence

    monkeypatch.setattr(angelslim.module, "DynamicCache", angelslim.Cache)
    target = write_hf_target(tmp_path / "target", "qwen3_moe")
    model = load(tmp_path / "target")[0]
    prompt, max_tokens = family.prompt_ids(11, seed=5), 40
    sequence = prompt + greedy(model, prompt, max_tokens)
    draft_torch = authors_dflare(angelslim, dflare_config())
    with torch.no_grad():
        out = target(torch.tensor([sequence]), output_hidden_states=True)
        taps = angelslim.module.extract_context_feature(out.hidden_states, TAPS)
    embedding, head = target.get_input_embeddings(), target.get_output_embeddings()

    def block_logits(p, block):
        h = draft_torch(position_ids=torch.arange(p + BLOCK)[None], noise_embedding=embedding(block),
                        target_hidden=taps[:, :p])  # fmt: skip
        return F.linear(h[0, 1:], head.weight)

    fit_to_sequence(draft_torch, block_logits, sequence, steps=80, lr=1e-2, seed=0)
    draft_torch.save_pretrained(str(tmp_path / "draft"))

    starts = []

    class Recorded(torch.nn.Module):
        # The target, noting where each of its passes starts.
        def __init__(self):
            super().__init__()
            self.inner = target
            self.model, self.lm_head, self.device = target.model, target.lm_head, target.device

        def forward(self, input_ids, position_ids, **kwargs):
            starts.append(int(position_ids[0, 0]))
            return self.inner(input_ids, position_ids=position_ids, **kwargs)

    with torch.no_grad():
        theirs = draft_torch.spec_generate(Recorded(), torch.tensor([prompt]), max_tokens, None, 0.0)
    their_cycles = np.diff(starts[1:]).tolist()  # tokens kept per verify pass, but the last's
    _, draft, _ = load(tmp_path / "target", tmp_path / "draft")
    ours, cycles = run(model, draft, prompt, max_tokens=max_tokens, adaptive=False)
    assert ours == theirs[0, len(prompt) :].tolist() == sequence[len(prompt) :]
    assert [len(s.tokens) for s in cycles[1:]][: len(their_cycles)] == their_cycles
    assert max(their_cycles) >= 4, their_cycles
