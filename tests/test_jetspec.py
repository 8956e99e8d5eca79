"""JetSpec heads: the z-lab layout with ``dflash_config.causal_head`` (a block-causal mask inside the block)
and an optional hidden-size adapter; lossless on the target families, with draft trees, sampling exact in
distribution, and parity with the authors' head (hao-ai-lab/JetSpec)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import family, family_suite, sampled
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB
from helpers.family_drafters import BLOCK, jetspec_config, write_jetspec

from dflash_mlx import DFlashError, LoopOptions, load, make_cache
from dflash_mlx.loading.draft_loader import load_draft
from dflash_mlx.models.drafter import block_mask


@pytest.fixture(scope="module")
def folders(tmp_path_factory, pair_dirs):
    draft = tmp_path_factory.mktemp("jetspec") / "draft"
    write_jetspec(draft)
    return {"target": pair_dirs["qwen3-tied"], "draft": draft}


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders["target"], folders["draft"])


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
def test_greedy_is_lossless_on_the_target_families(hf_target_dirs, folders, kind):
    family_suite.check_target_families(hf_target_dirs[kind], folders["draft"], BLOCK)


def test_draft_trees(varied_dirs, folders):
    """The causal head's slots are still one distribution per depth from one pass: DDTree's trees run on them."""
    family_suite.check_trees(varied_dirs["qwen3-tied"], folders["draft"])


def test_jetspec_trees_are_lossless(varied_dirs, folders):
    """JetSpec's own tree construction (``tree_width``: each expanded node's k likeliest children at once):
    the target's greedy tokens at every width, the trees as wide as asked."""
    from helpers.decoding import run

    from dflash_mlx.drafts.tree import build_fanout_tree

    model, draft, _ = load(varied_dirs["qwen3-tied"], folders["draft"])
    for width, budget, prompt_len in ((1, 6, 1), (3, 12, 9), (4, 40, 30)):
        prompt = family.prompt_ids(prompt_len)
        out, cycles = run(model, draft, prompt, tree_budget=budget, tree_width=width, max_tokens=24, adaptive=False)
        assert out == family.reference(model, prompt, 24), (width, budget)
        # num_draft: the tree's nodes, counted up to the tokens still to come (23 at the first cycle).
        assert cycles[1].num_draft == min(budget, 22) and all(c.num_draft <= budget for c in cycles)
    tree = build_fanout_tree([[-0.1, -2.0, -3.0]] * 3, [[5, 6, 7]] * 3, 7)
    assert (tree.tokens, tree.parents) == ([5, 6, 7, 5, 6, 7, 5], [-1, 0, 0, 0, 1, 1, 1, 4])
    with pytest.raises(DFlashError, match="tree_width=2 shapes a draft tree of a fixed size"):
        LoopOptions(tree_width=2)
    with pytest.raises(DFlashError, match="tree_width must be a positive integer"):
        LoopOptions(tree_budget=8, tree_width=0)


@pytest.fixture(scope="module")
def sampling_pair(sampling_target, folders):
    return family_suite.sampling_pair(sampling_target, folders["draft"])


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
        load(folders["target"], tmp_path / "draft")


# ---- Parity with the authors' head (hao-ai-lab/JetSpec, checked at 2c7b3fae75690dfe9a188a37d7fdfd43ee0e032f) ----
# JetSpec is not on the package index: point DFLASH_JETSPEC_SRC at a checkout of it to run these.


@pytest.fixture(scope="module")
def jetspec():
    """The authors' head class, drafting helper, tree builder and HuggingFace decoding loop."""
    from types import SimpleNamespace

    with family_suite.authors_code("DFLASH_JETSPEC_SRC", "hao-ai-lab/JetSpec"):
        from jetspec import draft_head_adapter
        from jetspec.core import llm
        from jetspec.core.model_runner import ModelRunner
        from jetspec.models.draft_head import DFlashDraftModel
        from jetspec.tree.baselines import accum_logp

        yield SimpleNamespace(adapter=draft_head_adapter, Head=DFlashDraftModel, llm=llm, Runner=ModelRunner,
                              accum_logp=accum_logp)  # fmt: skip


def authors_head(jetspec, config: dict, seed: int = 0):
    return family_suite.randomize(lambda: jetspec.Head(family_suite.qwen3_config(config)), seed)


def _crop_to_length(jetspec, monkeypatch):
    monkeypatch.setattr(jetspec.adapter, "DynamicCache", family_suite.crop_to_length_cache())


@pytest.mark.parametrize("causal", [True, False])
def test_blocks_match_the_authors(jetspec, tmp_path, monkeypatch, causal):
    """Three drafting cycles through the authors' ``_DraftHeadForward`` (their KV-cached head pass, cropped
    to the context after each block) on the same target: the same draft logits every cycle."""
    import torch
    from helpers.hf_checkpoints import write_hf_target

    _crop_to_length(jetspec, monkeypatch)
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


def test_trees_equal_the_authors_builder(jetspec):
    """JetSpec's tree construction (their ``accum_logp``'s ``_build_from_topk``) and ours on the same
    top-k per depth: the same node tokens and parents, in the same order (their budget counts the root)."""
    from dflash_mlx.drafts.tree import build_fanout_tree, top_log_probs

    rng = np.random.default_rng(0)
    for width, budget, depth in ((1, 8, 6), (3, 12, 6), (4, 40, 15), (7, 128, 15)):
        logits = mx.array(rng.standard_normal((depth, VOCAB)).astype(np.float32) * 3)
        log_probs, ids = top_log_probs(logits, width)
        theirs = jetspec.accum_logp._build_from_topk(0, ids, log_probs, budget + 1, "cpu")
        ours = build_fanout_tree(log_probs, ids, budget)
        assert theirs.token_ids[1:].tolist() == ours.tokens and theirs.parent_indices.tolist() == ours.parents


@pytest.mark.parametrize("width, budget", [(1, 15), (3, 11), (4, 32)])
def test_tree_cycles_match_the_authors(jetspec, tmp_path, monkeypatch, width, budget):
    """The authors' tree decoding loop (``LLM.generate_tree`` of their HuggingFace core, SDPA tree masks, on
    the CPU) and ours with ``tree_width``, greedy on the same target with their head fitted to agree with it:
    the same tokens, and per cycle the same tree size and the same tokens kept."""
    import torch
    import torch.nn.functional as F
    from helpers.decoding import greedy, run
    from helpers.hf_checkpoints import write_hf_target
    from helpers.torch_oracles import fit_to_sequence

    _crop_to_length(jetspec, monkeypatch)
    target = write_hf_target(tmp_path / "target", "qwen3_moe")
    model = load(tmp_path / "target")[0]
    prompt, max_tokens = family.prompt_ids(11, seed=5), 40
    sequence = prompt + greedy(model, prompt, max_tokens)
    head = authors_head(jetspec, jetspec_config())
    taps_ids = head.target_layer_ids
    with torch.no_grad():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        taps = torch.cat([hidden[i + 1] for i in taps_ids], dim=-1)
    embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    def block_logits(p, block):
        h = head(position_ids=torch.arange(p + BLOCK)[None], noise_embedding=embedding(block),
                 target_hidden=taps[:, :p], is_causal=True)  # fmt: skip
        return F.linear(h[0, 1:], lm_head.weight)

    fit_to_sequence(head, block_logits, sequence, steps=80, lr=1e-2, seed=0)
    head.save_pretrained(str(tmp_path / "draft"))
    # Their LLM made around our target (its constructor loads one by name, on CUDA).
    llm = jetspec.llm.LLM.__new__(jetspec.llm.LLM)
    llm.model, llm.runner, llm.device, llm.dtype = target, jetspec.Runner(target), "cpu", torch.float32
    llm.eos_token_ids, llm.tokenizer = set(), None
    drafter = jetspec.adapter.DraftHeadTreeDrafter(head, target, BLOCK, taps_ids)
    theirs = llm.generate_tree(torch.tensor([prompt]), drafter, block_size=BLOCK, tree_width=width, budget=budget + 1,
                               target_layer_ids=taps_ids, sampling_params=jetspec.llm.SamplingParams(0.0, max_tokens),
                               return_stats=True, return_text=False)  # fmt: skip
    _, draft, _ = load(tmp_path / "target", tmp_path / "draft")
    out, cycles = run(model, draft, prompt, tree_budget=budget, tree_width=width, max_tokens=max_tokens, adaptive=False)
    assert out == theirs["token_ids"] == sequence[len(prompt) :]
    # Per cycle (ours after the prefill's): tokens kept, and nodes with the root. Our last cycle counts only
    # the tokens within max_tokens, and num_draft the nodes up to the tokens still to come.
    kept = [len(c.tokens) for c in cycles[1:]]
    assert len(kept) == len(theirs["accept_lengths"]) and kept[:-1] == theirs["accept_lengths"][:-1], kept
    room = max_tokens - np.cumsum([len(c.tokens) for c in cycles])[:-1]
    assert [c.num_draft for c in cycles[1:]] == [min(size - 1, r - 1) for size, r in zip(theirs["tree_sizes"], room)]
    assert max(theirs["tree_sizes"]) == budget + 1
    assert max(theirs["accept_lengths"]) >= 5, theirs["accept_lengths"]
