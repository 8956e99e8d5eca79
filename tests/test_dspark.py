"""DSpark drafters: loading their published layout, lossless generation on the target families, sampling
exact in distribution, the confidence cut, and parity with the authors' PyTorch code (deepseek-ai/DeepSpec)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import family
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB, write_target
from helpers.decoding import run
from helpers.dspark_checkpoints import BLOCK, dspark_config, write_dspark_draft
from mlx.utils import tree_flatten

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load, make_cache
from dflash_mlx.models import dspark
from dflash_mlx.sampling import make_sampler

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    write_target(root / "qwen3")
    write_dspark_draft(root / "draft")
    write_dspark_draft(root / "plain", dspark_config(markov_rank=0, enable_confidence_head=False), seed=2)
    write_dspark_draft(root / "community", head=False, seed=3)
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders / "qwen3", folders / "draft")


def test_published_layout_loads_unchanged(folders, pair):
    before = (folders / "draft" / "config.json").read_text()
    _, draft, _ = pair
    assert isinstance(draft, dspark.DraftModel)
    a = draft.args
    assert (a.block_size, draft.block_size, a.mask_token_id, a.target_layer_ids) == (BLOCK, BLOCK + 1, MASK_ID, [1, 2])
    assert draft.markov_head.markov_w1.weight.shape == (VOCAB, 8)
    assert draft.confidence_head.proj.weight.shape == (1, HIDDEN + 8) and "bias" in draft.confidence_head.proj
    assert a.own_head and draft.lm_head.weight.shape == (VOCAB, HIDDEN)
    assert (folders / "draft" / "config.json").read_text() == before
    _, community, _ = load(folders / "qwen3", folders / "community")
    assert not community.args.own_head and "lm_head" not in dict(tree_flatten(community.parameters()))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"markov_rank": None}, "DSpark drafter config lacks markov_rank"),
        ({"markov_head_type": "rnn"}, "Unsupported DSpark markov_head_type='rnn'"),
        ({"confidence_head_with_markov": None}, "lacks confidence_head_with_markov"),
        ({"architectures": ["Gemma4DSparkModel"]}, "Unsupported DSpark architecture 'Gemma4DSparkModel'"),
    ],
)
def test_layouts_we_cannot_run_are_refused(folders, tmp_path, change, message):
    write_dspark_draft(tmp_path / "draft")
    config = dspark_config(**change)
    (tmp_path / "draft" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(DFlashError, match=message):
        load(folders / "qwen3", tmp_path / "draft")


@pytest.mark.parametrize("block_size", [2, BLOCK + 1])
@pytest.mark.parametrize("prompt_len", [1, 19])
def test_greedy_is_lossless(folders, pair, block_size, prompt_len):
    """Markov and plain DSpark drafters, and a community head on the target's embedding and head."""
    model = pair[0]
    for name in ("draft", "plain", "community"):
        draft = load(folders / "qwen3", folders / name)[1]
        family.check_lossless(model, draft, block_size, prompt_len)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5", "gemma4_text"])
def test_greedy_is_lossless_on_the_target_families(tmp_path, folders, kind):
    from helpers.hf_checkpoints import write_hf_target

    write_hf_target(tmp_path / "target", kind)
    model, draft, _ = load(tmp_path / "target", folders / "community")
    family.check_lossless(model, draft, BLOCK + 1, 9)
    _check_stop_then_continue(model, draft)


def _check_stop_then_continue(model, draft):
    """A stop token ends the reply right after it; the next turn goes on from that cache."""
    prompt = family.prompt_ids(7)
    ref = family.reference(model, prompt)
    stop_index = next(i for i in range(5, 40) if ref[i] not in ref[:i])
    cache = make_cache(model, draft)
    out, _ = run(model, draft, prompt, max_tokens=MAX_TOKENS, stop_tokens={ref[stop_index]}, prompt_cache=cache)
    assert out == ref[: stop_index + 1] and cache.offset == len(cache.tokens) == len(prompt) + stop_index
    follow = prompt + out + family.prompt_ids(4, seed=9)
    again, _ = run(model, draft, follow, max_tokens=30, prompt_cache=cache)
    assert again == family.reference(model, follow, 30)


def test_every_slot_drafts_and_the_markov_bias_follows_the_drafts(pair):
    """B drafts from one pass; each is the argmax of its slot's logits plus the bias of the draft before it."""
    model, draft, _ = pair
    cache = make_cache(model, draft)
    block = mx.array([[5] + [MASK_ID] * (BLOCK - 1)])
    taps = mx.random.normal((1, 6, 2 * HIDDEN), key=mx.random.key(1))
    drafts, q, logits, confidence = draft.draft_steps(model, block, taps, cache.draft, BLOCK)
    assert drafts.shape == (BLOCK,) and q is None and confidence.shape == (BLOCK,)
    h = draft(draft.embed_tokens(block), taps)[0]
    prev = [5] + drafts[:-1].tolist()
    expected = draft.lm_head(h) + draft.markov_head(mx.array(prev))
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-5)
    assert drafts.tolist() == mx.argmax(expected, -1).tolist()
    assert drafts.tolist() != mx.argmax(draft.lm_head(h), -1).tolist(), "the bias never changed a draft"


def test_confidence_cut(pair):
    """The drafts stop before the first slot under the threshold (possibly at none); the text is the same."""
    model, draft, _ = pair
    scores = mx.array([2.0, 1.0, -0.5, 3.0])
    assert [dspark.confident_count(scores, t) for t in (0.0, 0.5, 0.75, 0.9)] == [4, 2, 1, 0]
    prompt = family.prompt_ids(9)
    ref = family.reference(model, prompt, MAX_TOKENS)
    lengths = set()
    for threshold in (0.3, 0.5, 0.7):
        out, cycles = run(model, draft, prompt, max_tokens=MAX_TOKENS, adaptive=False, confidence_threshold=threshold)
        assert out == ref
        lengths |= {s.num_draft for s in cycles[1:]}
    assert 0 in lengths and max(lengths) > 1, lengths
    with pytest.raises(DFlashError, match="confidence_threshold must be a probability"):
        LoopOptions(confidence_threshold=1.5)


def test_trees(folders, pair):
    """Without a Markov head DSpark's slots are DFlash's per-position distributions: trees run; with one, a refusal."""
    model = pair[0]
    plain = load(folders / "qwen3", folders / "plain")[1]
    for budget, prompt_len in ((1, 1), (4, 9), (16, 30)):
        prompt = family.prompt_ids(prompt_len)
        cache = make_cache(model, plain)
        out, _ = run(model, plain, prompt, tree_budget=budget, max_tokens=24, prompt_cache=cache, adaptive=False)
        assert out == family.reference(model, prompt, 24), budget
        assert all(c.offset == len(cache.tokens) for c in cache.target)
    with pytest.raises(DFlashError, match="Markov head drafts one path"):
        next(dflash_generate_step([1, 2, 3], model, pair[1], LoopOptions(tree_budget=4)))


# ---- Sampling: exact in distribution, with a negative control ----


class _FirstRight(dspark.DraftModel):
    """Sure of the target's likeliest next token at its first slot, flat logits after it: its later
    drafts are the Markov bias alone, so each depends strongly on the draft drawn before it."""

    def __init__(self, base, prompt):
        super().__init__(base.args)
        self.update(base.parameters())
        self.target_text = list(prompt)

    def block_hidden(self, model, block, taps, cache, speedups=None):
        h = super().block_hidden(model, block, taps, cache, speedups)
        self.target_text = self.target_text[: cache[0].offset] + [block[0, 0].item()]
        return h

    def logits(self, model, h):
        first = model(mx.array([self.target_text]))[0, -1:] * 10.0
        return mx.concatenate([first, mx.zeros((h.shape[0] - 1, first.shape[-1]))], axis=0)


class _Unconditioned(_FirstRight):
    """Broken on purpose: draws along the Markov chain as it should, but states each draft's
    distribution as if the anchor came right before it."""

    def draft_steps(self, model, block, taps, cache, num_drafts, probs=None, speedups=None):
        drafts, q, logits, confidence = super().draft_steps(model, block, taps, cache, num_drafts, probs, speedups)
        h = self.block_hidden(model, block, taps, cache)[0, :num_drafts]
        wrong = self.logits(model, h) + self.markov_head(block[0, :1].astype(mx.int32))
        return drafts, probs(wrong), logits, confidence


@pytest.fixture(scope="module")
def untied_pair(tmp_path_factory, folders):
    from test_sampling import _exact_marginals

    folder = tmp_path_factory.mktemp("untied") / "target"
    write_target(folder, tied=False, embed_scale=1.0)
    model, draft, _ = load(folder, folders / "draft")
    return model, draft, _exact_marginals(model, make_sampler(0.1))


@pytest.mark.parametrize("broken", [False, True])
def test_a_q_that_ignores_the_markov_chain_fails_the_same_check(untied_pair, broken):
    """Sampled drafts keep the target's distribution, and a q not conditioned on the draft drawn at
    k - 1 fails the same check (negative control). The setting has teeth: the first draft is
    accepted often and the second one's distribution depends on it."""
    from test_sampling import CONTROL_RUNS, PROMPT, RUNS, _excess

    model, draft, exact = untied_pair
    assert all(p.max() < 0.6 for p in exact)  # no near-certain token: the check has teeth
    drafter = (_Unconditioned if broken else _FirstRight)(draft, PROMPT)
    excess = _excess((model, drafter, None), exact, "sample", sampler=make_sampler(0.1), drafter=drafter,
                     runs=CONTROL_RUNS if broken else RUNS)  # fmt: skip
    assert (max(excess) > 0) == broken, excess
