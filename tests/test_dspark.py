"""DSpark drafters: loading their published layout, lossless generation on the target families, sampling
exact in distribution, the confidence cut, and parity with the authors' PyTorch code (deepseek-ai/DeepSpec)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import family, family_suite, sampled
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB, write_target
from helpers.decoding import run
from helpers.dspark_checkpoints import BLOCK, dspark_config, write_dspark_draft
from mlx.utils import tree_flatten

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load, make_cache
from dflash_mlx.models import dspark
from dflash_mlx.sampling import make_sampler

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def folders(tmp_path_factory, pair_dirs):
    root = tmp_path_factory.mktemp("dspark")
    (root / "qwen3").symlink_to(pair_dirs["qwen3-tied"], target_is_directory=True)
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


@pytest.mark.parametrize("block_size, prompt_len", [(2, 19), (BLOCK + 1, 1)])
def test_greedy_is_lossless(folders, pair, block_size, prompt_len):
    """Markov and plain DSpark drafters, and a community head on the target's embedding and head."""
    model = pair[0]
    for name in ("draft", "plain", "community"):
        draft = load(folders / "qwen3", folders / name)[1]
        family.check_lossless(model, draft, block_size, prompt_len)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4_text"])  # hybrid and sliding; dense: the qwen3 pair
def test_greedy_is_lossless_on_the_target_families(hf_target_dirs, folders, kind):
    model, draft, _ = load(hf_target_dirs[kind], folders / "community")
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


def test_trees(folders, pair, varied_dirs):
    """Without a Markov head DSpark's slots are DFlash's per-position distributions: trees run (on a target whose
    text does not repeat, so that a wrong branch shows); with one, a refusal."""
    model, plain, _ = load(varied_dirs["qwen3-tied"], folders / "plain")
    for budget, prompt_len in ((1, 1), (4, 9), (16, 30)):
        prompt = family.prompt_ids(prompt_len)
        cache = make_cache(model, plain)
        out, _ = run(model, plain, prompt, tree_budget=budget, max_tokens=24, prompt_cache=cache, adaptive=False)
        assert out == family.reference(model, prompt, 24), budget
        assert all(c.offset == len(cache.tokens) for c in cache.target)
    with pytest.raises(DFlashError, match="Markov head drafts one path"):
        next(dflash_generate_step([1, 2, 3], pair[0], pair[1], LoopOptions(tree_budget=4)))


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
    folder = tmp_path_factory.mktemp("untied") / "target"
    write_target(folder, tied=False, embed_scale=1.0)
    model, draft, _ = load(folder, folders / "draft")
    return model, draft, sampled.marginals(model, make_sampler(0.1))


@pytest.mark.parametrize("broken", [False, True])
def test_a_q_that_ignores_the_markov_chain_fails_the_same_check(untied_pair, broken):
    """Sampled drafts keep the target's distribution, and a q not conditioned on the draft drawn at
    k - 1 fails the same check (negative control). The setting has teeth: the first draft is
    accepted often and the second one's distribution depends on it. (The control is off by 0.5 of TV beyond
    the bound at 100 runs: it needs no more.)"""
    model, draft, exact = untied_pair
    assert all(p.max() < 0.6 for p in exact)  # no near-certain token: the check has teeth
    drafter = (_Unconditioned if broken else _FirstRight)(draft, sampled.PROMPT)
    excess = sampled.excess(model, drafter, exact, 0.1, runs=sampled.CONTROL_RUNS if broken else sampled.RUNS)
    assert (max(excess) > 0) == broken, excess


# ---- Parity with the authors' code (deepseek-ai/DeepSpec, checked at afdfa7c9382a3341a3e6f17756dd816da79f132c) ----
# DeepSpec is not on the package index: point DFLASH_DSPARK_SRC at a checkout of it to run these.


@pytest.fixture(scope="module")
def deepspec():
    """The authors' drafting ops (``deepspec.eval.dspark.draft_ops``) and a cache that crops as theirs
    expects, or a skip that says where to get them."""
    from types import SimpleNamespace

    with family_suite.authors_code("DFLASH_DSPARK_SRC", "deepseek-ai/DeepSpec"):
        from deepspec.eval.dspark import draft_ops

        yield SimpleNamespace(ops=draft_ops, Cache=family_suite.crop_to_length_cache())


def authors_dspark(config: dict, seed: int = 0):
    """The authors' ``Qwen3DSparkModel`` for ``config`` (fp32, eval), each weight drawn at a scale where
    it counts: the Markov bias large enough to change drafts, the confidence scores spread around 0."""
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel

    def confidence(p):
        p.normal_(0.0, 0.5 if p.ndim == 1 else 3.0 * p.shape[-1] ** -0.5)

    scales = {
        "confidence_head": confidence,
        "markov_head.markov_w1": lambda p: p.normal_(0.0, 2.0),
        "markov_head.markov_w2": lambda p: p.normal_(0.0, 1.0),
    }
    return family_suite.randomize(lambda: Qwen3DSparkModel(family_suite.qwen3_config(config)), seed, scales)


LAYOUTS = {
    "markov": {},  # the released DSpark heads
    "confidence": {"markov_rank": 0, "confidence_head_with_markov": False},
    "plain": {"markov_rank": 0, "enable_confidence_head": False},  # DeepSeek's dflash_*_block7
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_match_the_authors(deepspec, folders, tmp_path, layout):
    """Three drafting cycles over a context that grows and is cropped between them, as in the authors'
    loop: each slot's logits before and after the Markov bias, the drafts, the confidence scores, the
    cut at each threshold, and each slot's sampling distribution after the authors' own draw before it."""
    import torch

    ops = deepspec.ops
    config, markov = dspark_config(**LAYOUTS[layout]), layout == "markov"
    torch_draft = authors_dspark(config)
    torch_draft.save_pretrained(str(tmp_path / "draft"))
    model, draft, _ = load(folders / "qwen3", tmp_path / "draft")
    assert (draft.markov_head is not None) == markov
    cache, their_cache = make_cache(model, draft), deepspec.Cache()
    rng = np.random.default_rng(int(markov))
    start, taps = 10, rng.standard_normal((1, 10, 2 * HIDDEN)).astype(np.float32)
    positions = torch.arange(64)[None]
    cuts, changed = set(), 0
    for _ in range(3):
        block = [int(rng.integers(0, VOCAB - 4))] + [MASK_ID] * (BLOCK - 1)
        ids = torch.tensor([block])
        with torch.no_grad():
            h = ops.forward_dspark_draft_block(torch_draft, draft_input_ids=ids, position_ids=positions,
                                                    past_key_values_draft=their_cache, target_hidden_states=torch.tensor(taps),
                                                    start=start, block_size=BLOCK)  # fmt: skip
            base = torch_draft.compute_logits(h)
            tokens, corrected = torch_draft.sample_draft_tokens(base, first_prev_token_ids=ids[:, 0], hidden_states=h)
            whole = ops.build_dspark_proposal(torch_draft, draft_input_ids=ids, block_hidden=h, block_size=BLOCK,
                                                   temperature=0.0, confidence_threshold=0.0)  # fmt: skip
        drafts, _, logits, confidence = draft.draft_steps(model, mx.array([block]), mx.array(taps), cache.draft, BLOCK)
        our_base = draft.logits(model, draft.block_hidden(model, mx.array([block]), None, cache.draft))[0]
        np.testing.assert_allclose(np.array(our_base), base[0].numpy(), atol=1e-4)
        np.testing.assert_allclose(np.array(logits), corrected[0].numpy(), atol=1e-4)
        assert drafts.tolist() == tokens[0].tolist() == whole.verify_input_ids[0, 1:].tolist()
        changed += int((base[0].argmax(-1) != tokens[0]).sum())
        if layout != "plain":
            np.testing.assert_allclose(np.array(confidence), whole.confidence_logits[0].numpy(), atol=1e-4)
            for threshold in (0.2, 0.5, 0.8):
                with torch.no_grad():
                    cut = ops.build_dspark_proposal(torch_draft, draft_input_ids=ids, block_hidden=h, block_size=BLOCK,
                                                         temperature=0.0, confidence_threshold=threshold)  # fmt: skip
                assert dspark.confident_count(confidence, threshold) == cut.draft_token_count
                cuts.add(cut.draft_token_count)
        else:
            assert confidence is None and whole.confidence_logits is None
        # Sampling: each slot's distribution, after the authors' own draw before it.
        with torch.no_grad():
            drawn, their_logits = torch_draft.sample_draft_tokens(base, first_prev_token_ids=ids[:, 0], temperature=0.7,
                                                                  hidden_states=h)  # fmt: skip
        previous = mx.array(block[:1] + drawn[0, :-1].tolist())
        step = our_base + (draft.markov_head(previous) if markov else 0)
        their_q = torch.softmax(their_logits[0] / 0.7, -1).numpy()
        np.testing.assert_allclose(np.array(make_sampler(0.7).probs(step)), their_q, atol=1e-5)
        kept = int(rng.integers(1, BLOCK + 1))
        start, taps = start + kept, rng.standard_normal((1, kept, 2 * HIDDEN)).astype(np.float32)
    assert changed > 0 or not markov, "the Markov bias never changed a draft: it went untested"
    assert layout == "plain" or (len(cuts) > 1 and 0 in cuts), cuts


def test_saved_fixture_blocks_are_the_authors(deepspec):
    """The trained fixture's per-block numbers that tests/test_family_fixtures.py checks ours against are
    what the authors' code gives now (recipes/rebuild/dspark_fixture_blocks.py wrote them)."""
    import os

    from helpers import dspark_fixture

    fresh, saved = dspark_fixture.authors_blocks(os.environ["DFLASH_DSPARK_SRC"]), np.load(dspark_fixture.SAVED)
    assert sorted(fresh) == sorted(saved.files)
    for name, value in fresh.items():
        np.testing.assert_allclose(value, saved[name], atol=1e-5, err_msg=name)


def fit_authors_dspark(draft, target, sequence: list[int], *, steps: int = 80, lr: float = 1e-2, seed: int = 0):
    """The authors' drafter fitted (in place) to ``sequence``, the target's greedy text, as it drafts: the
    context the taps of positions before each anchor ``p``, the block ``[sequence[p], MASK...]`` at ``p``,
    slot ``k``'s label ``sequence[p + k + 1]``, the Markov bias from the true token before it. The
    embedding and head are the target's, frozen, as the authors train them."""
    import torch
    import torch.nn.functional as F
    from deepspec.modeling.dspark.common import extract_context_feature

    B, mask = draft.block_size, draft.mask_token_id
    with torch.no_grad():
        out = target(torch.tensor([sequence]), output_hidden_states=True)
        taps = extract_context_feature(out.hidden_states, draft.target_layer_ids)
    embedding = target.get_input_embeddings()
    draft.initialize_embeddings_and_head(embed_tokens=embedding, lm_head=target.get_output_embeddings())
    anchors = list(range(1, len(sequence) - B))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    draft.train()
    for _ in range(steps):
        loss = 0.0
        for i in torch.randperm(len(anchors), generator=gen)[:4].tolist():
            p = anchors[i]
            block = torch.tensor([[sequence[p]] + [mask] * (B - 1)])
            h = draft._forward_backbone(position_ids=torch.arange(p + B)[None], noise_embedding=draft.embed_tokens(block),
                                        target_hidden_states=taps[:, :p])  # fmt: skip
            logits = draft.compute_logits(h[0])
            if draft.markov_head is not None:
                prev = torch.tensor(sequence[p : p + B])
                logits = draft.markov_head.apply_step_logits(logits, token_ids=prev, hidden_states=None)
            loss = loss + F.cross_entropy(logits, torch.tensor(sequence[p + 1 : p + B + 1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.mark.parametrize("threshold, stop", [(0.0, False), (0.0, True), (0.6, True)])
def test_cycles_match_the_authors_loop(deepspec, tmp_path, monkeypatch, threshold, stop):
    """The authors' decoding loop (``generate_decoding_sample`` with their evaluator's propose and update)
    and ours, greedy on the same target with a drafter fitted to agree with it: the same tokens, and per
    cycle the same number of drafts and of accepted ones; with a confidence threshold that leaves some
    cycles no draft at all, and a stop token inside an accepted block."""
    from functools import partial
    from types import SimpleNamespace

    import torch
    from deepspec.eval import base_evaluator
    from deepspec.eval.dspark import evaluator
    from helpers.decoding import greedy
    from helpers.hf_checkpoints import write_hf_target

    for module in (base_evaluator, evaluator):
        monkeypatch.setattr(module, "DynamicCache", deepspec.Cache)
    target = write_hf_target(tmp_path / "target", "qwen3_moe")
    model = load(tmp_path / "target")[0]
    prompt, max_tokens = family.prompt_ids(11, seed=5), 40
    text = greedy(model, prompt, max_tokens)
    torch_draft = fit_authors_dspark(authors_dspark(dspark_config()), target, prompt + text)
    torch_draft.save_pretrained(str(tmp_path / "draft"))
    stop_tokens = None
    if stop:
        stop_tokens = [next(t for i, t in enumerate(text) if i > 12 and t not in text[:i])]
    E = evaluator.Qwen3DSparkEvaluator
    state = SimpleNamespace(draft_model=torch_draft, max_proposal_tokens=BLOCK,
                            args=SimpleNamespace(temperature=0.0, confidence_threshold=threshold))  # fmt: skip
    theirs = base_evaluator.generate_decoding_sample(
        target_model=target, input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, max_proposal_tokens=BLOCK,
        temperature=0.0, stop_token_ids=stop_tokens, init_context=partial(E._init_context, state),
        propose=partial(E._propose, state), update=partial(E._update, state),
    )  # fmt: skip
    their_tokens = theirs.output_ids[0, len(prompt) :].tolist()

    _, draft, _ = load(tmp_path / "target", tmp_path / "draft")
    out, cycles = run(model, draft, prompt, max_tokens=max_tokens, adaptive=False, confidence_threshold=threshold,
                      stop_tokens=set(stop_tokens or ()))  # fmt: skip
    assert out == their_tokens == text[: len(out)]
    # Per cycle: the drafts and the accepted ones; our last cycle counts only those within max_tokens.
    ours = [(s.num_draft, s.num_accepted) for s in cycles[1:]]
    pairs = list(zip(theirs.proposal_lengths, theirs.accepted_draft_lengths))
    assert len(ours) == len(pairs) and ours[:-1] == pairs[:-1], (ours, pairs)
    if stop:
        # A stop among the drafts: theirs counts the drafts up to it, ours the block's, then emits up to it.
        assert out[-1] == stop_tokens[0] and len(cycles[-1].tokens) == theirs.acceptance_lengths[-1], pairs
        assert threshold or theirs.acceptance_lengths[-1] == pairs[-1][1], "the stop token was no draft"
    else:
        assert ours[-1] <= pairs[-1]
    if threshold:
        assert 0 in theirs.proposal_lengths and max(theirs.accepted_draft_lengths) >= 2, pairs
    else:
        assert min(theirs.accepted_draft_lengths[:-1]) >= 4, pairs


# ---- The confidence threshold in the chat and the server ----


@pytest.mark.parametrize("max_batch", [1, 2])
def test_the_server_takes_the_confidence_threshold_per_request_and_as_a_default(pair, max_batch):
    """A request's ``confidence_threshold`` (or the server's ``--confidence-threshold`` where it gives none)
    cuts the drafts as ``LoopOptions(confidence_threshold=)`` does, on the one-at-a-time and the batching
    worker; out of range, a 400."""
    import urllib.error
    import urllib.request

    from dflash_mlx.tools.server.app import DFlashServer
    from dflash_mlx.tools.server.protocol import Defaults

    model, draft, tokenizer = pair
    prompt = family.prompt_ids(9)

    def drafted(threshold):
        _, cycles = run(model, draft, prompt, max_tokens=MAX_TOKENS, seed=0, confidence_threshold=threshold,
                        stop_tokens=set(tokenizer.eos_token_ids))  # fmt: skip
        return sum(c.num_draft for c in cycles)

    def post(srv, **body):
        data = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "seed": 0, **body}).encode()
        request = urllib.request.Request(srv.url + "/v1/completions", data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    srv = DFlashServer(model, draft, tokenizer, model_name="tiny", port=0, max_batch=max_batch,
                       defaults=Defaults(confidence_threshold=0.5)).start()  # fmt: skip
    try:
        counts, texts = {}, set()
        for threshold in (None, 0.0, 0.7):
            status, body = post(srv, **({} if threshold is None else {"confidence_threshold": threshold}))
            assert status == 200, body
            counts[threshold] = body["metrics"]["speculative_decoding"]["num_draft_tokens"]
            texts.add(body["choices"][0]["text"])
        assert len(texts) == 1  # the same greedy text whatever is drafted
        if max_batch == 1:
            assert counts == {None: drafted(0.5), 0.0: drafted(0.0), 0.7: drafted(0.7)}
        # The batching engine sizes each pass's drafts itself; the threshold still cuts them.
        assert counts[0.0] > counts[None] > counts[0.7], counts
        status, body = post(srv, confidence_threshold=1.5)
        assert status == 400 and "confidence_threshold" in body["error"]["message"]
    finally:
        srv.close()


def test_the_chat_takes_the_confidence_threshold(folders):
    """``dflash-chat --confidence-threshold`` reaches its settings, what it shows and the loop's options
    (a local pair), and a dflash-serve it chats with gets it per request."""
    from dflash_mlx.tui import app
    from dflash_mlx.tui.engine import MLXEngine, RemoteEngine

    args = app.setup_arg_parser().parse_args(["--model", str(folders / "qwen3"), "--confidence-threshold", "0.6"])
    chat = app.make_app(**{k: v for k, v in vars(args).items() if k != "blas"})
    settings = chat.settings
    assert settings.confidence_threshold == 0.6 and "threshold 0.6" in settings.describe(8)
    seen = {}

    class Session:  # the loaded pair, as far as a reply's options go
        draft, tokenizer = object(), None

        def stream(self, prompt, **options):
            seen.update(options)

    engine = MLXEngine.__new__(MLXEngine)
    engine.session, engine.cache = Session(), None
    engine._prompt = lambda messages, settings: []
    engine._start([], settings)
    assert seen["confidence_threshold"] == 0.6
    remote = RemoteEngine.__new__(RemoteEngine)
    remote.client = type("Client", (), {"info": type("Info", (), {"kind": "dflash"})(),
                                         "stream_chat": lambda self, messages, **kw: kw})()  # fmt: skip
    assert remote([], settings)["confidence_threshold"] == 0.6
