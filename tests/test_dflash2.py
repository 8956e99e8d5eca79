"""DFlash2 drafters: loading their published layout, parity with the authors' PyTorch class
(z-lab's ``dflash`` package, saved with ``save_pretrained``), and lossless generation.

The targets are written by transformers' own classes (tests/helpers/hf_checkpoints.py):
``qwen3_5``, the family of Qwen3.8-27B (the published DFlash2 pair's target), and
``qwen3_moe``, whose plain attention cache the authors' own loop can roll back."""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB, write_target
from helpers.decoding import greedy, run
from helpers.dflash2_checkpoints import (
    BLOCK,
    authors_draft,
    dflash2_config,
    train_authors_draft,
    write_dflash2_draft,
)
from helpers.hf_checkpoints import write_hf_target
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load, make_cache
from dflash_mlx.drafts.proposer import SelectorProposer
from dflash_mlx.loading import registry
from dflash_mlx.models import drafter2
from dflash_mlx.sampling import make_sampler

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_TOKENS = 64
KINDS = ("qwen3_5", "qwen3_moe")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The drafter's folder under "draft", each target's under its kind, and the targets'
    transformers models under "hf"."""
    root = tmp_path_factory.mktemp("dflash2")
    write_dflash2_draft(root / "draft")
    hf = {kind: write_hf_target(root / kind, kind) for kind in KINDS}
    return {"draft": root / "draft", "hf": hf, **{kind: root / kind for kind in KINDS}}


@pytest.fixture(scope="module", params=KINDS)
def pair(request, folders):
    return load(folders[request.param], folders["draft"])


def _prompt(length: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB - 4, length).tolist()


def _reference(model, prompt, max_tokens=MAX_TOKENS):
    return greedy(model, prompt, max_tokens)


def test_published_layout_loads_unchanged(folders, pair):
    """The config is read as published (fields nested in dflash_config, bare codebook tensors)
    and left as it was on disk."""
    before = (folders["draft"] / "config.json").read_text()
    _, draft, _ = pair
    assert isinstance(draft, drafter2.DraftModel)
    a = draft.args
    assert (a.block_size, a.mask_token_id, a.target_layer_ids) == (BLOCK, MASK_ID, [1, 2])
    assert (a.conv_kernel_size, a.conv_group_size, a.selector_rank, a.selector_top_k) == (3, 16, 8, 6)
    assert (a.output_multiplier, a.final_logit_softcapping, a.input_embedding_scale) == (1.5, 20.0, 0.7)
    assert [layer.self_attn.window for layer in draft.layers] == [2048, 2048]
    assert not any(layer.self_attn.causal for layer in draft.layers)
    assert draft.candidate_selector.predecessor_codebook.weight.shape == (VOCAB, 8)
    assert draft.layers[0].attention_conv.base_kernel.shape == (2, 3, HIDDEN)
    assert (folders["draft"] / "config.json").read_text() == before


@pytest.mark.parametrize(
    "change, message",
    [
        ({"conv_kernel_size": None}, "lacks conv_kernel_size"),
        ({"selector_rank": 0}, r"\{'selector_rank': 0\}; each must be a positive integer"),
        ({"conv_group_size": 24}, "conv_group_size=24 does not divide its hidden_size=64"),
        ({"selector_top_k": VOCAB + 1}, f"selector_top_k={VOCAB + 1} exceeds its vocab_size={VOCAB}"),
    ],
)
def test_configs_we_cannot_run_are_refused(folders, tmp_path, change, message):
    write_dflash2_draft(tmp_path / "draft")
    config = dflash2_config()
    config["dflash_config"].update(change)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=message):
        load(folders["qwen3_5"], tmp_path / "draft")


def test_settings_that_need_confidences_are_refused(pair):
    model, draft, _ = pair
    for kwargs in ({"block_size": "auto"}, {"min_confidence": 0.5}):
        with pytest.raises(DFlashError, match="A DFlash2 drafter verifies whole blocks"):
            next(dflash_generate_step([1, 2, 3], model, draft, LoopOptions(**kwargs)))


def test_registry_pairs():
    """Qwen3.8-27B's drafter is found for the target and its MLX conversions; GLM-5.3-Flash's
    pair is known but refused, with what is missing, before anything is fetched."""
    for name in ("Qwen/Qwen3.8-27B", "mlx-community/Qwen3.8-27B-4bit", "mlx-community/Qwen3.8-27B-8bit"):
        assert registry.find_draft(name) == "z-lab/Qwen3.8-27B-DFlash2"
    assert "Qwen/Qwen3.8-27B" in registry.known_targets()
    assert "zai-org/GLM-5.3-Flash" not in registry.known_targets()
    with pytest.raises(DFlashError, match=r"pairs with the drafter incoai/GLM-5.3-Flash-DFlash2, but DFlash cannot "
                       r"run it yet: .*glm5_next.*No weights were downloaded"):  # fmt: skip
        load("zai-org/GLM-5.3-Flash", "auto")


@pytest.mark.parametrize("block_size", [2, BLOCK])
@pytest.mark.parametrize("prompt_len", [1, 19])
def test_greedy_is_lossless(pair, block_size, prompt_len):
    model, draft, _ = pair
    prompt = _prompt(prompt_len)
    ref = _reference(model, prompt)
    for max_tokens in (1, block_size + 1, MAX_TOKENS):
        out, _ = run(model, draft, prompt, block_size=block_size, max_tokens=max_tokens, adaptive=False)
        assert out == ref[:max_tokens], (block_size, prompt_len, max_tokens)


def test_rows_batched_with_a_dflash2_drafter_equal_each_request_alone(folders):
    """Several requests at once on the Qwen3-MoE target: each row's DFlash2 drafter context and drafts are its own."""
    from dflash_mlx import batch_generate

    model, draft, tok = load(folders["qwen3_moe"], folders["draft"])
    prompts, limits = [_prompt(9, 1), _prompt(30, 2), _prompt(1, 3)], [40, 25, 33]
    result = batch_generate(model, draft, tok, prompts, max_tokens=limits, max_batch=3, block_size=BLOCK,
                            prefill_step_size=8)  # fmt: skip
    for got, prompt, limit in zip(result.tokens, prompts, limits):
        ref = _reference(model, prompt, limit)
        assert got == ref[: len(got)] and (len(got) == limit or ref[len(got)] in tok.eos_token_ids)
    assert sum(a.drafting_cycles for a in result.acceptance) > 0


class _AcceptExactly(drafter2.DraftModel):
    """Right for exactly ``schedule[i % len(schedule)]`` drafts in its i-th pass, then wrong,
    after a real drafter pass (so that its context cache stays real)."""

    def __init__(self, base, sequence, schedule):
        super().__init__(base.args)
        self.update(base.parameters())
        self.sequence, self.schedule, self.passes = sequence, schedule, 0

    def draft_tokens(self, model, block, taps, cache, speedups=None):
        mx.eval(super().draft_tokens(model, block, taps, cache, speedups))
        start = cache[0].offset  # the position of block[0]
        right = self.schedule[self.passes % len(self.schedule)]
        self.passes += 1
        ids = [self.sequence[p] if p < len(self.sequence) else 0 for p in range(start + 1, start + block.shape[1])]
        return mx.array([[t if i < right else (t + 1) % VOCAB for i, t in enumerate(ids)]])


def test_every_acceptance_length(pair):
    model, draft, _ = pair
    prompt = _prompt(7)
    # Two rounds of the schedule need 72 tokens; past ~150 the tiny MoE target meets an fp32 near-tie that a
    # block pass and a one-token step can break differently under OpenBLAS.
    ref = _reference(model, prompt, 100)
    schedule = list(range(BLOCK))
    out, cycles = run(model, _AcceptExactly(draft, prompt + ref, schedule), prompt, max_tokens=100, adaptive=False)
    assert out == ref
    drafted = [s for s in cycles[1:] if s.num_draft == BLOCK - 1]
    assert [s.num_accepted for s in drafted][: 2 * BLOCK] == schedule * 2


def test_stop_token_inside_a_block_then_continue(pair):
    model, draft, _ = pair
    prompt = _prompt(9)
    ref = _reference(model, prompt, 100)
    stop = next(t for t in ref[3:] if t not in ref[:3])
    cut = ref.index(stop) + 1
    cache = make_cache(model, draft)
    oracle = _AcceptExactly(draft, prompt + ref, [BLOCK - 1])  # whole blocks: the stop falls inside one
    out, cycles = run(model, oracle, prompt, stop_tokens={stop}, prompt_cache=cache, adaptive=False)
    assert out == ref[:cut] and len(cycles[-1].tokens) < BLOCK and cycles[-1].tokens[-1] == stop
    # The next call continues the same conversation from the cache.
    more, _ = run(model, draft, prompt + out, prompt_cache=cache, max_tokens=20, adaptive=False)
    assert more == _reference(model, prompt + out, 20)


# ---- Sampled drafts: the selector's distribution as the proposal (tests/test_sampling.py's check) ----


def test_sampled_drafts_state_the_distribution_given_the_drafts_before(pair):
    """Each draft is in its distribution's support, which is its position's candidates, and
    q[k] is the selector's distribution after the draft drawn at k - 1; greedy drafts stay
    certain and are the selector's path."""
    model, draft, _ = pair
    cache, sampler = make_cache(model, draft), make_sampler(0.8, top_p=0.95)
    # No context: every pass over the same block sees the same (empty) draft cache.
    block = mx.array([[7] + [MASK_ID] * (BLOCK - 1)])
    h = draft.block_hidden(model, block, None, cache.draft)[:, 1:]
    logits = draft.logits(model, h)
    proposal = SelectorProposer(model, draft, cache, sampler=sampler).propose(7, BLOCK - 2)
    drafts, q = proposal.tokens.tolist(), proposal.q
    assert q.shape == (BLOCK - 2, VOCAB) and np.allclose(np.array(q.sum(axis=-1)), 1.0, atol=1e-5)
    _, candidates = draft.candidate_selector(h, logits, block[:, 0])
    previous = [7] + drafts[:-1]
    for k, d in enumerate(drafts):
        support = set(np.nonzero(np.array(q[k]))[0].tolist())
        assert d in support and support <= set(np.array(candidates[0, k]).tolist())
        slot = h[:, k : k + 1], logits[:, k : k + 1], mx.array([previous[k]])
        _, alone = draft.candidate_selector.sample(*slot, sampler.probs)
        np.testing.assert_allclose(np.array(alone[0, 0]), np.array(q[k]), atol=1e-6)
    greedy = SelectorProposer(model, draft, cache).propose(7, BLOCK - 1)
    assert greedy.q is None
    assert greedy.tokens.tolist() == draft.draft_tokens(model, block, None, cache.draft)[0].tolist()


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory, folders):
    """tests/test_sampling.py's target (small logits, so that sampling has real choices) with the DFlash2 drafter."""
    folder = tmp_path_factory.mktemp("sampling") / "target"
    write_target(folder, embed_scale=0.2)
    return load(folder, folders["draft"])


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9, "xtc_probability": 0.5, "xtc_threshold": 0.05}])
def test_sampled_drafts_keep_the_targets_distribution(sampling_pair, filters):
    """The random drafter's drafts are rarely accepted, so most tokens come from the residual
    normalize(max(p - q, 0)): a wrong q shows there too. The filters apply to the selector's
    scores as to the target's logits."""
    from test_sampling import TEMP, _exact_marginals, _excess

    model, draft, _ = sampling_pair
    sampler = make_sampler(TEMP, **filters)
    excess = _excess(sampling_pair, _exact_marginals(model, sampler), "sample", sampler=sampler, drafter=draft)
    assert max(excess) < 0, excess


class _FirstRight(drafter2.DraftModel):
    """Sure of the target's likeliest next token at its first draft (there its logits are the
    target's, sharpened), with flat logits after it: its later drafts are the selector's pair
    scores alone, so each depends strongly on the draft drawn before it."""

    def __init__(self, base, prompt):
        super().__init__(base.args)
        self.update(base.parameters())
        self.text = list(prompt)  # the committed tokens, as far as the drafter has seen them

    def block_hidden(self, model, block, taps, cache, speedups=None):
        h = super().block_hidden(model, block, taps, cache, speedups)
        self.text = self.text[: cache[0].offset] + [block[0, 0].item()]  # offset: the position of block[0]
        return h

    def logits(self, model, h):
        first = model(mx.array([self.text]))[:, -1:] * 10.0
        return mx.concatenate([first, mx.zeros((1, h.shape[1] - 1, first.shape[-1]))], axis=1)


class _Unconditioned(_FirstRight):
    """Broken on purpose: draws along the path as it should, but states each draft's
    distribution as if the anchor came right before it, not the draft drawn before it."""

    def sample_tokens(self, model, block, taps, cache, probs, speedups=None, num_drafts=None):
        h = self.block_hidden(model, block, taps, cache, speedups)[:, 1 : 1 + num_drafts]
        logits, selector = self.logits(model, h), self.candidate_selector
        path, _ = selector.sample(h, logits, block[:, 0], probs)
        slots = [(h[:, i : i + 1], logits[:, i : i + 1], block[:, 0]) for i in range(h.shape[1])]
        return path, mx.concatenate([selector.sample(*slot, probs)[1] for slot in slots], axis=1)


@pytest.fixture(scope="module")
def untied_pair(tmp_path_factory, folders):
    """A target whose text does not repeat (untied head), the DFlash2 drafter, and the target's
    exact marginals at a low temperature."""
    from test_sampling import _exact_marginals

    folder = tmp_path_factory.mktemp("untied") / "target"
    write_target(folder, tied=False, embed_scale=1.0)
    model, draft, _ = load(folder, folders["draft"])
    return model, draft, _exact_marginals(model, make_sampler(0.1))


@pytest.mark.parametrize("broken", [False, True])
def test_a_q_that_ignores_the_drafts_before_fails_the_same_check(untied_pair, broken):
    """Negative control: q[k] must be conditioned on the draft drawn at k - 1. The check shows it
    where the first draft is accepted often and the second one's distribution depends on it: a
    target whose text does not repeat (untied head) at a low temperature, and :class:`_FirstRight`.
    The same setting is also checked with the right q."""
    from test_sampling import CONTROL_RUNS, PROMPT, RUNS, _excess

    model, draft, exact = untied_pair
    sampler = make_sampler(0.1)
    assert all(p.max() < 0.6 for p in exact)  # no near-certain token: the check has teeth
    drafter = (_Unconditioned if broken else _FirstRight)(draft, PROMPT)
    # The broken q on half the runs: a bias that fails the check there fails it at RUNS too.
    excess = _excess((model, drafter, None), exact, "sample", sampler=sampler, drafter=drafter,
                     runs=CONTROL_RUNS if broken else RUNS)  # fmt: skip
    assert (max(excess) > 0) == broken, excess


# ---- Parity with the authors' PyTorch class (z-lab's dflash package) ----


@pytest.fixture(scope="module")
def authors():
    """The authors' module (``dflash.model``), or a skip that says how to install it."""
    reason = "the DFlash2 parity tests need z-lab's package: pip install --no-deps dflash==0.1.0"
    module = pytest.importorskip("dflash.model", reason=reason)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only contend
    yield module
    torch.set_num_threads(threads)


def _authors_folder(path, config, seed=0):
    draft = authors_draft(config, seed)
    draft.save_pretrained(str(path))
    return draft


@pytest.mark.parametrize("window, causal", [(2048, False), (6, False), (4, True)])
def test_block_logits_and_selector_path_match_the_authors(authors, folders, tmp_path, window, causal):
    """Three drafting cycles over a context that grows (longer than a small window) and is
    cropped between them, as in the authors' loop: hidden states, logits, the selector's
    candidates and its path agree, and so does each position's sampling distribution after the
    authors' draw before it."""
    reference = authors
    ours, theirs = tmp_path / "saved", tmp_path / "published"
    torch_draft = _authors_folder(ours, dflash2_config(window, causal))
    # The published layout: the same tensors, the codebooks without ".weight".
    weights = load_file(ours / "model.safetensors")
    weights = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in weights.items()}
    theirs.mkdir()
    save_file(weights, str(theirs / "model.safetensors"), metadata={"format": "pt"})
    (theirs / "config.json").write_text((ours / "config.json").read_text())
    model, draft, _ = load(folders["qwen3_moe"], ours)
    _, published, _ = load(folders["qwen3_moe"], theirs)
    a, b = dict(tree_flatten(draft.parameters())), dict(tree_flatten(published.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)

    target = folders["hf"]["qwen3_moe"]
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    torch_cache, cache = reference._make_cache(torch_draft.config), make_cache(model, draft)
    rng = np.random.default_rng(window)
    start, taps = 10, rng.standard_normal((1, 10, 2 * HIDDEN)).astype(np.float32)
    off_argmax = 0
    for _ in range(3):
        block = [int(rng.integers(0, VOCAB - 4))] + [MASK_ID] * (BLOCK - 1)
        with torch.no_grad():
            noise = torch.nn.functional.embedding(torch.tensor([block]), embedding) * 0.7
            positions = torch.arange(start - taps.shape[1], start + BLOCK)[None]
            h = torch_draft(target_hidden=torch.tensor(taps), noise_embedding=noise, position_ids=positions,
                            past_key_values=torch_cache, use_cache=True)[:, 1:]  # fmt: skip
            reference._crop_to(torch_cache, start)
            logits = torch_draft.compute_logits(h, head)
            path, candidates, _ = torch_draft.propose(h, torch.tensor(block[:1]), head, 0.0)
        our_h = draft.block_hidden(model, mx.array([block]), mx.array(taps), cache.draft)[:, 1:]
        our_logits = draft.logits(model, our_h)
        our_path, our_candidates = draft.candidate_selector(our_h, our_logits, mx.array(block[:1]))
        np.testing.assert_allclose(np.array(our_h), h.numpy(), atol=1e-4)
        np.testing.assert_allclose(np.array(our_logits), logits.numpy(), atol=1e-4)
        assert np.array_equal(np.sort(np.array(our_candidates), -1), np.sort(candidates.numpy(), -1))
        assert np.array(our_path).tolist() == path.tolist()
        assert mx.array_equal(draft.draft_tokens(model, mx.array([block]), None, cache.draft), our_path)
        # Sampling: each position's distribution, after the authors' own draw before it.
        with torch.no_grad():
            drawn, _, their_q = torch_draft.propose(h, torch.tensor(block[:1]), head, 0.7)
        previous = block[:1] + drawn[0, :-1].tolist()
        for i in range(BLOCK - 1):
            their_row = np.zeros(VOCAB, dtype=np.float32)
            their_row[candidates[0, i].numpy()] = their_q[0, i].numpy()
            slot = our_h[:, i : i + 1], our_logits[:, i : i + 1], mx.array(previous[i : i + 1])
            _, our_row = draft.candidate_selector.sample(*slot, make_sampler(0.7).probs)
            np.testing.assert_allclose(np.array(our_row[0, 0]), their_row, atol=1e-5)
        off_argmax += int((path != logits.argmax(-1)).sum())
        # The next cycle: the taps of the positions the target kept.
        kept = int(rng.integers(1, BLOCK))
        start, taps = start + kept, rng.standard_normal((1, kept, 2 * HIDDEN)).astype(np.float32)
    assert off_argmax > 0, "the pair scores never changed a draft: the selector went untested"


def test_cycles_match_the_authors_generate(authors, folders, tmp_path, monkeypatch):
    """The authors' dflash_generate and ours, greedy at block 8 on the same tiny target and a
    drafter fitted to agree with it: the same tokens, and the same tokens per cycle."""
    reference = authors
    target = folders["hf"]["qwen3_moe"]
    model = load(folders["qwen3_moe"])[0]
    prompt, max_tokens = _prompt(11, seed=5), 40
    sequence = prompt + _reference(model, prompt, max_tokens)
    torch_draft = train_authors_draft(authors_draft(dflash2_config()), target, sequence, steps=70, lr=2e-2)
    with torch.no_grad():
        for name in ("predecessor_codebook", "successor_codebook"):
            getattr(torch_draft.candidate_selector, name).weight.mul_(0.3)  # the selector still counts
    torch_draft.save_pretrained(str(tmp_path / "draft"))
    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)  # its timer assumes CUDA
    theirs = reference.dflash_generate(
        torch_draft, target, torch.tensor([prompt]), max_new_tokens=max_tokens, stop_token_ids=None, return_stats=True
    )
    their_tokens = theirs.output_ids[0, len(prompt) :].tolist()

    model, draft, _ = load(folders["qwen3_moe"], tmp_path / "draft")
    out, cycles = run(model, draft, prompt, max_tokens=max_tokens, adaptive=False)
    assert out == their_tokens == sequence[len(prompt) :]
    # Their last cycles draft shorter blocks near max_new_tokens; ours always the whole block.
    full, start = [], len(prompt)
    for produced in theirs.acceptance_lengths:
        if start + BLOCK > len(prompt) + max_tokens:
            break
        full.append(produced)
        start += produced
    ours = [len(s.tokens) for s in cycles[1:]]
    assert ours[: len(full)] == full
    assert max(full) >= 4 and min(full) == 1, full
