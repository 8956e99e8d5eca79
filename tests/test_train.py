import json
import os
import shutil
import signal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB, write_draft, write_target
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load
from dflash_mlx.loading import casting
from dflash_mlx.loop.cache import make_draft_cache
from dflash_mlx.models import target as tgt
from dflash_mlx.tools.train import trainer as train_mod
from dflash_mlx.tools.train.checkpoint import check_out, latest_checkpoint
from dflash_mlx.tools.train.cli import main
from dflash_mlx.tools.train.config import TrainingArgs
from dflash_mlx.tools.train.data import (
    dataset_examples,
    generate_responses,
    make_batch,
    position_weights,
    read_cache,
    read_prompts,
    render_prompt,
    usable,
)
from dflash_mlx.tools.train.losses import block_logits, block_loss, head_gram, packed_block_mask
from dflash_mlx.tools.train.trainer import get_lr, train
from dflash_mlx.tools.train.vocab import LossVocab, coverage, token_counts, top_tokens


def _words(n: int, seed: int) -> str:
    ids = np.random.default_rng(seed).integers(0, VOCAB - 4, n)
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, a prompt file and a response cache generated once for the module."""
    root = tmp_path_factory.mktemp("train")
    write_target(root / "target", layers=4)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": _words(6 + i % 5, i)}]}) + "\n")
        f.write(json.dumps({"text": "a corpus line, skipped"}) + "\n")
    model, _, tokenizer = load(root / "target", dtype="float32")
    cache = root / "data.jsonl"
    generate_responses(model, tokenizer, read_prompts(prompts), cache, max_tokens=40, verbose=False)
    return root, prompts, cache


def _args(setup, out, **kwargs) -> TrainingArgs:
    root, prompts, cache = setup
    base = dict(
        model=str(root / "target"), data=str(prompts), cache=str(cache), out=str(out), block_size=4,
        num_layers=1, target_layer_ids=[1, 2], intermediate_size=64, iters=40, batch_size=2, blocks_per_seq=8,
        max_seq_len=64, learning_rate=3e-3, warmup=2, val_examples=2, eval_every=0, eval_prompts=2,
        eval_max_tokens=12, save_every=1000, log_every=1,
    )  # fmt: skip
    return TrainingArgs(**{**base, **kwargs})


def test_data_step_is_greedy_and_resumable(setup, tmp_path):
    root, prompts, _ = setup
    model, _, tokenizer = load(root / "target", dtype="float32")
    cache = tmp_path / "c.jsonl"
    first = generate_responses(model, tokenizer, read_prompts(prompts), cache, max_prompts=2, max_tokens=20)
    lines = cache.read_text().splitlines()
    assert len(first) == 2 and len(lines) == 2
    with open(cache, "a") as f:
        f.write('{"key": "torn')  # an interrupted write
    more = generate_responses(model, tokenizer, read_prompts(prompts), cache, max_prompts=4, max_tokens=20)
    assert len(more) == 4 and cache.read_text().splitlines()[:2] == lines
    assert len({ex["key"] for ex in more}) == 4
    # No time left: the cache is returned as is.
    same = generate_responses(model, tokenizer, read_prompts(prompts), cache, max_tokens=20, minutes=0)
    assert [ex["key"] for ex in same] == [ex["key"] for ex in more]
    ex = more[3]
    ref = [int(t) for t, _ in generate_step(mx.array(ex["prompt_ids"]), model, max_tokens=20)]
    stop = next((i for i, t in enumerate(ref) if t in tokenizer.eos_token_ids), len(ref) - 1)
    assert ex["response_ids"] == ref[: stop + 1]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_batched_generation_matches_plain_loop(setup, tmp_path, monkeypatch, kind):
    from dflash_mlx.tools.train import data as data_mod

    _, prompts, _ = setup
    # The module's tied target repeats its last token; an untied one gives a different response
    # per prompt, so a mixed-up or shifted batch shows.
    write_target(tmp_path / "target", kind=kind, layers=4, tied=False)
    model, _, tokenizer = load(tmp_path / "target", dtype="float32")
    # Attention-only targets take the slot engine, never mlx-lm's BatchGenerator.
    monkeypatch.setattr(data_mod, "_generate_batched", None)
    free = generate_responses(model, tokenizer, read_prompts(prompts), tmp_path / "free.jsonl", max_tokens=30)
    # It never emits its end token in 30 tokens: stop on a token it does emit, so some responses
    # stop early (the stop token kept, nothing after it) and others run to the length limit.
    stop = free[0]["response_ids"][10]
    tokenizer.eos_token_ids = {*tokenizer.eos_token_ids, stop}
    plain = generate_responses(model, tokenizer, read_prompts(prompts), tmp_path / "a.jsonl", max_tokens=30)
    batched = generate_responses(
        model, tokenizer, read_prompts(prompts), tmp_path / "b.jsonl", max_tokens=30, batch_size=4
    )
    by_key = {ex["key"]: ex for ex in batched}
    assert len(by_key) == len(plain) == 12 and len({tuple(ex["response_ids"]) for ex in free}) == 12
    for ex, full in zip(plain, free):
        ids = full["response_ids"]
        expected = ids[: ids.index(stop) + 1] if stop in ids else ids
        assert ex["response_ids"] == expected
        assert ex["finish_reason"] == ("stop" if stop in ids else "length")
        assert by_key[ex["key"]]["response_ids"] == ex["response_ids"]
        assert by_key[ex["key"]]["finish_reason"] == ex["finish_reason"]
    assert {ex["finish_reason"] for ex in plain} == {"stop", "length"}


def test_taps_with_fresh_cache_or_none(qwen3_pair):
    model, _, _ = qwen3_pair
    tokens = mx.array([[5, 9, 2, 77, 31, 8]])
    logits_a, taps_a = tgt.forward_with_taps(model, tokens, make_prompt_cache(model), [0, 2])
    logits_b, taps_b = tgt.forward_with_taps(model, tokens, [None] * tgt.num_layers(model), [0, 2])
    assert mx.allclose(taps_a, taps_b, atol=1e-5) and mx.allclose(logits_a, logits_b, atol=1e-5)


def test_make_batch_anchors_and_labels():
    rng = np.random.default_rng(0)
    examples = [
        {"prompt_ids": [1, 2, 3], "response_ids": [10, 11, 12, 13, 14, 15]},
        {"prompt_ids": [4, 5], "response_ids": [20, 21, 22]},
    ]
    w = position_weights(4, 2.0)
    assert w[0] == 1.0 and np.all(np.diff(w) < 0)
    b = make_batch(examples, rng, batch_size=3, blocks_per_seq=5, block_size=4, max_seq_len=64, mask_token_id=99,
                   weights=w, pad_to=8)  # fmt: skip
    L = b["tokens"].shape[1]
    longest = max(int((row != 0).sum()) for row in b["tokens"])
    assert L % 8 == 0 and longest <= L < longest + 8 and np.all(b["blocks"][:, 1:] == 99)
    for n in range(15):
        s, a = divmod(int(b["anchors"][n]), L)
        assert b["starts"][n] == s * L
        ids = b["tokens"][s]
        ex = next(e for e in examples if list(ids[: len(e["prompt_ids"])]) == e["prompt_ids"])
        T = len(ex["prompt_ids"]) + len(ex["response_ids"])
        assert len(ex["prompt_ids"]) <= a <= T - 2  # anchors inside the response
        assert b["blocks"][n, 0] == ids[a]
        k = min(3, T - 1 - a)
        assert list(b["labels"][n, :k]) == list(ids[a + 1 : a + 1 + k])
        assert np.all(b["weights"][n, k:] == 0) and np.allclose(b["weights"][n, :k], w[:k])


def test_lookup_hits_are_what_prompt_lookup_drafts_right():
    from dflash_mlx.drafts.lookup import PromptLookup
    from dflash_mlx.tools.train.data import lookup_hits

    rng = np.random.default_rng(1)
    settings = PromptLookup(9)
    for _ in range(30):
        ids = rng.integers(0, 4, size=int(rng.integers(1, 50))).tolist()
        hits = lookup_hits(ids)
        for a in range(len(ids)):
            drafts = settings.lookup(ids[: a + 1], 8)
            right = 0
            while right < len(drafts) and a + 1 + right < len(ids) and drafts[right] == ids[a + 1 + right]:
                right += 1
            assert hits[a] == right, (ids, a)


def test_make_batch_drops_anchors_that_lookup_predicts():
    loop = [7, 8, 9] * 10
    examples = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5, 6] + loop}]
    kwargs = dict(batch_size=1, blocks_per_seq=64, block_size=4, max_seq_len=64, mask_token_id=99,
                  weights=position_weights(4, 2.0), pad_to=8)  # fmt: skip
    every = make_batch(examples, np.random.default_rng(0), **kwargs)
    dropped = make_batch(examples, np.random.default_rng(0), **kwargs, drop_lookup=2)
    assert max(every["anchors"]) > 12  # anchors inside the loop are drawn without the filter
    # With it, only anchors before the loop has repeated are drawn: lookup drafts the rest.
    assert set(dropped["anchors"].tolist()) <= set(range(2, 10))


def test_packed_block_mask_isolates_blocks(qwen3_pair):
    model, draft, _ = qwen3_pair
    B, L, W = draft.block_size, 32, len(draft.target_layer_ids) * 64
    anchors, starts = mx.array([5, 20, 40, 50]), mx.array([0, 0, 32, 32])
    mask = packed_block_mask(anchors, starts, 2 * L, B)
    assert mask.shape == (4, 1, B, 2 * L + B)
    assert mask[2, 0, 0, :32].sum().item() == 0 and mask[2, 0, 3, 32:40].all().item()
    assert mask[2, 0, 0, 40:64].sum().item() == 0 and mask[2, 0, 0, 64:].all().item()

    taps = mx.random.normal((1, 2 * L, W))
    blocks = mx.random.randint(0, VOCAB, (4, B))
    ref = block_logits(draft, model, taps, blocks, anchors, starts)
    # Other blocks' tokens, context at or after the anchor, another sequence: no effect on block 1.
    other = blocks.at[0].add(1).at[2].add(1)
    later = taps.at[:, 20:].add(1.0)
    for t, bl in ((taps, other), (later, blocks)):
        out = block_logits(draft, model, t, bl, anchors, starts)
        assert mx.allclose(out[1], ref[1], atol=1e-5)
    # Its own context before the anchor does change it (so the test above can fail).
    earlier = block_logits(draft, model, taps.at[:, 19:20].add(1.0), blocks, anchors, starts)
    assert not mx.allclose(earlier[1], ref[1], atol=1e-3)
    assert mx.allclose(earlier[0], ref[0], atol=1e-5)


def test_training_layout_matches_inference(qwen3_pair):
    """A block trained in a packed slot sees exactly what propose() sees at generation time."""
    model, draft, _ = qwen3_pair
    ids = mx.random.randint(0, VOCAB - 4, (1, 30))
    a, L = 21, 32
    _, taps = tgt.forward_with_taps(model, ids, [None] * 4, draft.target_layer_ids)
    packed = mx.concatenate([mx.random.normal((1, L, taps.shape[-1])), taps, mx.zeros((1, 2, taps.shape[-1]))], 1)
    block = mx.array([[ids[0, a].item()] + [MASK_ID] * (draft.block_size - 1)])
    train_logits = block_logits(draft, model, packed, block, mx.array([L + a]), mx.array([L]))
    infer_logits = draft.propose(model, block, taps[:, :a], make_draft_cache(draft))
    assert mx.allclose(train_logits, infer_logits, atol=1e-4)
    # Off by one anywhere and the two differ: the taps given at generation time (one more or one
    # fewer), the anchor's position in training, or the packed slot's start.
    for shifted_taps in (taps[:, : a + 1], taps[:, : a - 1]):
        assert not mx.allclose(
            train_logits, draft.propose(model, block, shifted_taps, make_draft_cache(draft)), atol=1e-3
        )
    for anchor, start in ((L + a + 1, L), (L + a - 1, L), (L + a, L + 1)):
        shifted = block_logits(draft, model, packed, block, mx.array([anchor]), mx.array([start]))
        assert not mx.allclose(shifted, infer_logits, atol=1e-3), (anchor, start)


def test_loss_positions_trains_on_the_leading_positions_of_the_whole_block(qwen3_pair):
    model, draft, _ = qwen3_pair
    B, W = draft.block_size, len(draft.target_layer_ids) * 64
    taps, anchors, starts = mx.random.normal((1, 48, W)), mx.array([10, 30]), mx.array([0, 0])
    blocks = mx.random.randint(0, VOCAB, (2, B))
    full = block_logits(draft, model, taps, blocks, anchors, starts)
    lead = block_logits(draft, model, taps, blocks, anchors, starts, positions=3)
    assert lead.shape[1] == 3 and mx.allclose(lead, full[:, :3], atol=1e-5)
    labels = mx.random.randint(0, VOCAB, (2, B - 1))
    weights = mx.ones((2, B - 1)).at[:, 3:].multiply(5.0)  # heavy weights past position 3 are left out
    loss = block_loss(draft, model, taps, blocks, anchors, starts, labels, weights, positions=3)
    ce = nn.losses.cross_entropy(full[:, :3].astype(mx.float32), labels[:, :3], reduction="none")
    assert abs(loss.item() - ce.mean().item()) < 1e-4
    assert abs(block_loss(draft, model, taps, blocks, anchors, starts, labels, weights).item() - loss.item()) > 1e-3


def test_loss_over_a_token_subset_is_cross_entropy_of_its_columns(qwen3_pair):
    model, draft, _ = qwen3_pair
    B, W = draft.block_size, len(draft.target_layer_ids) * 64
    taps, anchors, starts = mx.random.normal((1, 48, W)), mx.array([10, 30]), mx.array([0, 0])
    blocks = mx.random.randint(0, VOCAB, (2, B))
    ids = [7, 3, 100, 64, 12, 5, 90, 33]  # not in id order
    vocab = LossVocab.for_target(model, mx.array(ids))
    full = block_logits(draft, model, taps, blocks, anchors, starts)
    assert mx.allclose(block_logits(draft, model, taps, blocks, anchors, starts, vocab=vocab), full[..., mx.array(ids)],
                       atol=1e-5)  # fmt: skip
    rng = np.random.default_rng(0)
    labels = np.where(rng.random((2, B - 1)) < 0.5, rng.choice(ids, (2, B - 1)), rng.choice([1, 2, 50], (2, B - 1)))
    weights = np.tile(position_weights(B, 7.0), (2, 1))
    weights[1, 12:] = 0  # past a sequence's end
    loss = block_loss(draft, model, taps, blocks, anchors, starts, mx.array(labels), mx.array(weights), vocab=vocab)
    # By hand: cross-entropy over the sliced logits, labels outside the subset weighted 0.
    sliced = np.array(full[..., mx.array(ids)], dtype=np.float64)
    inside = np.isin(labels, ids)
    index = np.where(inside, [[ids.index(t) if t in ids else 0 for t in row] for row in labels], 0)
    top = sliced.max(axis=-1)
    lse = top + np.log(np.exp(sliced - top[..., None]).sum(axis=-1))
    ce = lse - np.take_along_axis(sliced, index[..., None], axis=-1)[..., 0]
    w = weights * inside
    assert inside.any() and not inside.all()
    assert abs(loss.item() - (ce * w).sum() / w.sum()) < 1e-4
    # The distillation term is the same with the subset as without it.
    last, gram = mx.random.normal((1, 48, 64)), head_gram(model)
    args = (draft, model, taps, blocks, anchors, starts, mx.array(labels), mx.array(weights))
    with_subset = block_loss(*args, vocab=vocab, target_final=last, gram=gram, logit_mse=0.5).item() - loss.item()
    whole = block_loss(*args, target_final=last, gram=gram, logit_mse=0.5).item() - block_loss(*args).item()
    assert with_subset > 1e-3 and abs(with_subset - whole) < 1e-4


def test_loss_vocab_is_the_top_n_by_frequency():
    examples = [{"response_ids": [5, 5, 9, 2, 9, 7]}, {"response_ids": [7, 1]}]
    counts = token_counts(examples, 12)
    # Counts 2 (ids 5, 7, 9), then 1 (ids 1, 2): ties by id; ids never seen fill up by id.
    assert top_tokens(counts, 4).tolist() == [5, 7, 9, 1]
    assert top_tokens(counts, 7).tolist() == [5, 7, 9, 1, 2, 0, 3]
    assert coverage(counts, top_tokens(counts, 4)) == pytest.approx(7 / 8)


def test_loss_vocab_is_saved_for_resume_and_with_draft_vocab_in_the_drafter(setup, tmp_path, capsys):
    root, _, cache = setup
    n = 12
    examples = usable(read_cache(cache), 64)
    counts = token_counts(examples, VOCAB)
    ranked = sorted(range(VOCAB), key=lambda t: (-counts[t], t))[:n]
    share = sum(counts[t] for t in ranked) / counts.sum()
    out = tmp_path / "fr"
    train(_args(setup, out, iters=4, stop_at=2, loss_vocab=n, draft_vocab=True))
    log = capsys.readouterr().out
    assert (f"loss vocab: {n} of {VOCAB} token ids, {100 * share:.1f}% of the responses' tokens; the drafter "
            "drafts among them") in log  # fmt: skip
    assert mx.load(str(latest_checkpoint(out)[0] / "training_arrays.safetensors"))["loss_vocab"].tolist() == ranked
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == n
    assert mx.load(str(out / "model.safetensors"))["draft_vocab"].tolist() == ranked
    # A resumed run keeps the checkpoint's ids, even over other responses.
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(open(cache).readlines()[:5]))
    train(_args(setup, out, iters=4, resume=True, loss_vocab=n, draft_vocab=True, cache=str(fewer)))
    assert f"loss vocab: {n} of {VOCAB} token ids (the checkpoint's), " in capsys.readouterr().out
    assert mx.load(str(out / "model.safetensors"))["draft_vocab"].tolist() == ranked
    # ... and refuses another subset, or another choice of the drafter's.
    err = _one_line_error(_argv(_args(setup, out, iters=6, resume=True, loss_vocab=n + 1, draft_vocab=True)), capsys)
    assert (f"was trained with --loss-vocab {n}, but this run asks for --loss-vocab {n + 1}. Resume it with "
            f"--loss-vocab {n}, or start a new run with another --out.") in err  # fmt: skip
    err = _one_line_error(_argv(_args(setup, out, iters=6, resume=True, loss_vocab=n)), capsys)
    assert "was trained with --draft-vocab, but this run asks for --no-draft-vocab" in err
    model, draft, tokenizer = load(root / "target", out, dtype="float32")
    assert draft.draft_vocab.tolist() == ranked
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": _words(5, 99)}], add_generation_prompt=True)
    plain = [t for s in dflash_generate_step(prompt, model, None, LoopOptions(max_tokens=20)) for t in s.tokens]
    spec = [t for s in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=20)) for t in s.tokens]
    assert spec == plain
    # Without --draft-vocab the subset is the loss's alone: the drafter drafts over the whole vocabulary.
    train(_args(setup, tmp_path / "loss-only", iters=2, loss_vocab=n))
    assert "draft_vocab_size" not in json.loads((tmp_path / "loss-only" / "config.json").read_text())
    assert "draft_vocab" not in mx.load(str(tmp_path / "loss-only" / "model.safetensors"))


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["--draft-vocab"], 2, "--draft-vocab saves the --loss-vocab ids with the drafter: pass --loss-vocab N"),
        (["--loss-vocab", "0"], 2, "--loss-vocab must be at least 1 (got 0)"),
        (["--loss-vocab", "1000"], 1, f"--loss-vocab 1000 is more than the target's {VOCAB} token ids; pass at most"),
    ],
)
def test_bad_loss_vocab_is_one_line(setup, tmp_path, capsys, extra, code, message):
    with pytest.raises(SystemExit) as e:
        main([*_argv(_args(setup, tmp_path / "o")), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and message in err and "\n" not in err and err.startswith("dflash-train: error: ")


def test_no_target_features_ablation(setup, tmp_path):
    """--no-target-features trains and runs a drafter that never sees the target's taps."""
    root, _, _ = setup
    out = tmp_path / "blind"
    train(_args(setup, out, iters=4, target_features=False))
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["use_target_features"] is False
    model, draft, tokenizer = load(root / "target", out, dtype="float32")
    assert draft.args.use_target_features is False
    ids = mx.random.randint(0, VOCAB - 4, (1, 30))
    _, taps = tgt.forward_with_taps(model, ids, [None] * 4, draft.target_layer_ids)
    block = mx.array([[ids[0, 20].item()] + [MASK_ID] * (draft.block_size - 1)])
    blind = draft.propose(model, block, taps[:, :20], make_draft_cache(draft))
    for context in (taps[:, :5] * 3.0, None):
        assert mx.allclose(draft.propose(model, block, context, make_draft_cache(draft)), blind, atol=1e-5)
    # Training layout (context masked out) == inference, as for the full drafter.
    packed = mx.concatenate([taps, mx.zeros((1, 2, taps.shape[-1]))], 1)
    assert mx.allclose(block_logits(draft, model, packed, block, mx.array([20]), mx.array([0])), blind, atol=1e-4)
    # The same weights with the taps switched on do depend on them, so the checks above can fail.
    draft.args.use_target_features = True
    seeing = draft.propose(model, block, taps[:, :20], make_draft_cache(draft))
    assert not mx.allclose(seeing, blind, atol=1e-3)
    draft.args.use_target_features = False
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": _words(5, 7)}], add_generation_prompt=True)
    plain = [t for s in dflash_generate_step(prompt, model, None, LoopOptions(max_tokens=20)) for t in s.tokens]
    spec = [t for s in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=20)) for t in s.tokens]
    assert spec == plain


def test_train_end_to_end(setup, tmp_path):
    root, _, _ = setup
    out = tmp_path / "draft"
    train(_args(setup, out, eval_every=20))
    losses = [r["loss"] for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
    assert np.mean(losses[-5:]) < 0.8 * losses[0]
    evals = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "acceptance" in r]
    # The tied target repeats its last token, which the drafter learns by step 20: it accepts every
    # draft, so each 12-token eval is the first token, then cycles of 4, 4 and 3 (max_tokens cuts the last).
    assert [(r["step"], r["acceptance"], r["hist"]) for r in evals] == [
        (step, pytest.approx(11 / 3), {"3": 2, "4": 4}) for step in (20, 40)
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2]}
    model, draft, tokenizer = load(root / "target", out, dtype="float32")
    assert draft.block_size == 4 and draft.args.num_hidden_layers == 1
    # One checkpoint, no temporary files; the drafter on top is the checkpoint's.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.jsonl", "model.safetensors", STATE]
    assert [p.name for p in (out / STATE).iterdir()] == ["step-00000040"]
    saved = out / STATE / "step-00000040" / "draft" / "model.safetensors"
    assert (out / "model.safetensors").read_bytes() == saved.read_bytes()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": _words(5, 99)}], add_generation_prompt=True)
    plain = [t for s in dflash_generate_step(prompt, model, None, LoopOptions(max_tokens=20)) for t in s.tokens]
    spec = [t for s in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=20)) for t in s.tokens]
    assert spec == plain


def _argv(args: TrainingArgs) -> list[str]:
    """The command line of ``args`` (only the fields the tests set)."""
    argv = []
    for key, value in vars(args).items():
        default = TrainingArgs.__dataclass_fields__[key].default
        if value == default:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def test_resume_matches_uninterrupted(setup, tmp_path, monkeypatch, capsys):
    straight, split, stopped = tmp_path / "a", tmp_path / "b", tmp_path / "ctrl-c"
    train(_args(setup, straight, iters=6, stop_at=None))
    train(_args(setup, split, iters=6, stop_at=3))
    state = json.loads((latest_checkpoint(split)[0] / "state.json").read_text())
    assert state["step"] == 3
    train(_args(setup, split, iters=6, resume=True))
    a = mx.load(str(straight / "model.safetensors"))
    b = mx.load(str(split / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)

    # Ctrl+C during step 3: the step ends, is saved, and the run exits 130 saying where.
    real_get_lr = train_mod.get_lr

    def get_lr(it, args, elapsed=None):
        if it == 2 and not os.environ.get("_SENT"):
            monkeypatch.setenv("_SENT", "1")
            os.kill(os.getpid(), signal.SIGINT)
        return real_get_lr(it, args, elapsed)

    monkeypatch.setattr(train_mod, "get_lr", get_lr)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in a background job
    with pytest.raises(SystemExit) as e:
        main(_argv(_args(setup, stopped, iters=6)))
    assert e.value.code == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"dflash-train: interrupted at step 3; saved to {stopped}; rerun with --resume to continue"
    assert json.loads((latest_checkpoint(stopped)[0] / "state.json").read_text())["step"] == 3
    assert signal.getsignal(signal.SIGINT) is before  # the run's handler is gone
    main(_argv(_args(setup, stopped, iters=6, resume=True)))
    c = mx.load(str(stopped / "model.safetensors"))
    assert all(mx.array_equal(a[k], c[k]).item() for k in a)
    # A fresh run with another seed differs, so the comparison above can fail.
    train(_args(setup, tmp_path / "c", iters=6, seed=1))
    c = mx.load(str(tmp_path / "c" / "model.safetensors"))
    assert not all(mx.array_equal(a[k], c[k]).item() for k in a)


STATE = "training_state"


def _one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("dflash-train: error: ") and "\n" not in err
    return err


def test_out_is_never_spoiled(setup, tmp_path, capsys):
    """A folder of other files, a file, or --resume without a checkpoint: refused before anything runs."""
    root, _, _ = setup
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("mine")
    base = _argv(_args(setup, docs))
    err = _one_line_error(base, capsys)
    # No saved state there, so --resume is not what to suggest (it would be refused next).
    assert f"--out {docs} already holds files (notes.txt) and no saved training state. Pass a new folder" in err
    assert "Pass --resume" not in err and "--init-draft" in err
    err = _one_line_error([*base, "--resume"], capsys)
    assert f"--resume: there is no saved training state in {docs}" in err
    err = _one_line_error(_argv(_args(setup, docs / "notes.txt")), capsys)
    assert err.endswith(f"--out {docs / 'notes.txt'} is a file; pass a folder for the drafter.")
    assert [p.name for p in docs.iterdir()] == ["notes.txt"] and (docs / "notes.txt").read_text() == "mine"
    # A drafter given as the target: what to pass instead, in flags dflash-train has.
    drafter = tmp_path / "drafter"
    write_draft(drafter)
    err = _one_line_error(_argv(_args(setup, tmp_path / "new", model=str(drafter))), capsys)
    assert "holds a DFlash drafter, not a target model. Pass the target it drafts for with --model" in err
    assert "--draft" not in err and "--init-draft" in err and not (tmp_path / "new").exists()
    # The response cache of a --data-only run is no reason to refuse.
    (tmp_path / "cached").mkdir()
    (tmp_path / "cached" / "data.jsonl").write_text("")
    assert check_out(tmp_path / "cached", resume=False) is None


def test_resume_refuses_other_settings_and_logs_the_loaded_ones(setup, tmp_path, capsys):
    root, _, _ = setup
    out = tmp_path / "run"
    train(_args(setup, out, iters=4, stop_at=2, val_examples=0, eval_every=1))
    log = capsys.readouterr().out
    assert f"stopped at step 2 of 4 (--stop-at); saved to {out}; rerun with --resume to continue" in log
    assert "no held-out set for a validation loss (--val-examples 0; pass --val-examples N for one)" in log
    assert "eval step 1: no val loss (no held-out set), acceptance" in log and "None" not in log
    other_target = tmp_path / "other-target"
    shutil.copytree(root / "target", other_target)
    cases = [
        (dict(num_layers=2), "trained with --num-layers 1, but this run asks for --num-layers 2. Pass --num-layers 1"),
        (dict(block_size=8), "trained with --block-size 4, but this run asks for --block-size 8"),
        (dict(target_layer_ids=[0, 3]), "with --target-layer-ids 1 2, but this run asks for --target-layer-ids 0 3"),
        (dict(model=str(other_target)), f"trained on the target {(root / 'target').resolve()}, but this run gives "
                                        f"{other_target.resolve()}. Pass --model {(root / 'target').resolve()}"),
    ]  # fmt: skip
    for change, message in cases:
        err = _one_line_error(_argv(_args(setup, out, iters=4, resume=True, **change)), capsys)
        assert message in err and "to resume it, or start a new run with another --out" in err
    err = _one_line_error(_argv(_args(setup, out)), capsys)  # a run folder without --resume
    assert "already holds files" in err and "Pass --resume to continue its training" in err
    main(_argv(_args(setup, out, iters=4, resume=True)))
    captured = capsys.readouterr()
    log = captured.out
    assert f"resumed from {out / STATE / 'step-00000002'} at step 2" in log
    assert "run settings: --iters 4, --learning-rate" in log and "note: resuming with" not in captured.err
    assert "None" not in log
    assert "drafter: 1 layers, block size 4," in log and "taps [1, 2]" in log
    assert json.loads((latest_checkpoint(out)[0] / "state.json").read_text())["step"] == 4
    # Other run settings are taken (a new --iters moves the schedule's end) but said.
    main(_argv(_args(setup, out, iters=6, resume=True, learning_rate=0.01)))
    err = capsys.readouterr().err
    assert "note: resuming with --iters 6 (was 4); --learning-rate 0.01 (was " in err
    assert "no longer repeats an uninterrupted run" in err


def test_checkpoint_is_one_rename(setup, tmp_path, monkeypatch):
    """A save that dies halfway leaves the previous checkpoint whole, and the drafter on top loadable."""
    root, _, _ = setup
    out = tmp_path / "run"
    train(_args(setup, out, iters=4, stop_at=2))
    before = (out / "model.safetensors").read_bytes()
    real_save = mx.save_safetensors

    def save(path, arrays, metadata=None):
        if "optimizer" in str(path):
            raise OSError("disk full")
        real_save(path, arrays, metadata) if metadata else real_save(path, arrays)

    monkeypatch.setattr(mx, "save_safetensors", save)
    with pytest.raises(OSError, match="disk full"):
        train(_args(setup, out, iters=4, resume=True))
    assert [p.name for p in (out / STATE).iterdir()] == ["step-00000002"]
    assert (out / "model.safetensors").read_bytes() == before
    assert load(root / "target", out)[1] is not None
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_resumes_a_checkpoint_of_the_earlier_layout(setup, tmp_path, capsys):
    """State files straight in training_state/, the drafter only at the top: still resumed, then replaced."""
    out = tmp_path / "run"
    train(_args(setup, out, iters=4, stop_at=2))
    step = out / STATE / "step-00000002"
    for name in ("optimizer.safetensors", "state.json"):
        (step / name).rename(out / STATE / name)
    shutil.rmtree(step)
    capsys.readouterr()
    train(_args(setup, out, iters=4, resume=True))
    assert f"resumed from {out / STATE} at step 2" in capsys.readouterr().out
    assert sorted(p.name for p in (out / STATE).iterdir()) == ["step-00000004"]


def test_ctrl_c_before_training_is_one_line(setup, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "generate_responses", interrupted)
    with pytest.raises(SystemExit) as e:
        main(_argv(_args(setup, tmp_path / "run")))
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == (
        "dflash-train: interrupted; no checkpoint saved (the response cache keeps the responses generated so far)"
    )


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    blocks = text.split("\n  --")[1:]
    assert len(blocks) > 40
    for block in blocks:
        assert block.count("default") <= 1, block
    assert "(default: None)" not in text and "(default: 1000)" in text


def test_get_lr_schedule():
    args = TrainingArgs(learning_rate=1.0, warmup=10, iters=110, min_lr_ratio=0.1)
    lrs = [get_lr(i, args) for i in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)
    # With --minutes the decay follows the time trained, whatever the step.
    timed = TrainingArgs(learning_rate=1.0, warmup=10, iters=110, min_lr_ratio=0.1, minutes=2.0)
    assert get_lr(5, timed, 0.0) == lrs[5]  # warmup by steps still
    assert get_lr(20, timed, 60.0) == pytest.approx(0.55) and get_lr(20, timed, 0.0) == pytest.approx(1.0)
    assert get_lr(20, timed, 500.0) == pytest.approx(0.1)


def test_minutes_stops_the_run_and_saves_it(setup, tmp_path, capsys):
    out = tmp_path / "timed"
    train(_args(setup, out, iters=10_000, minutes=0.002, eval_prompts=0))
    step = json.loads((latest_checkpoint(out)[0] / "state.json").read_text())["step"]
    assert 1 <= step < 10_000 and (out / "model.safetensors").exists()
    assert f"stopped after 0.002 minutes at step {step}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--block-size", "1"], "--block-size must be at least 2"),
        (["--minutes", "0"], "--minutes must be greater than 0"),
        (["--tap-cache-gb", "0"], "--tap-cache-gb must be greater than 0 (got 0)"),
        (["--minutes", "5", "--resume"], "--minutes schedules one uninterrupted run and cannot be resumed"),
        (["--target-layer-ids", "1", "7"], "--target-layer-ids 1 7 must be distinct layers"),
        (["--data", "missing.jsonl"], "does not exist"),
        (["--iters", "0"], "--iters must be at least 1 (got 0)"),
        (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
        (["--max-seq-len", "4"], "--max-seq-len 4 must be at least --block-size 16"),
        (["--learning-rate", "0"], "--learning-rate must be greater than 0 (got 0)"),
        (["--loss-decay", "-1"], "--loss-decay must be at least 0"),
        (["--seed", "-1"], "--seed must be from 0 to 18446744073709551615 (got -1)"),
        (["--seed", str(2**64)], f"--seed must be from 0 to 18446744073709551615 (got {2**64})"),
        (["--loss-positions", "16"], "--loss-positions must be from 1 to --block-size minus 1 = 15 (got 16)"),
        (["--log-every", "0"], "--log-every must be at least 1 (got 0)"),
        (["--save-every", "-1"], "--save-every must be at least 1 (got -1)"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio must be from 0 to 1 (got 2)"),
        (["--warmup", "-1"], "--warmup must be at least 0 (got -1)"),
        (["--grad-clip", "-1"], "--grad-clip must be at least 0 (got -1)"),
        (["--weight-decay", "-1"], "--weight-decay must be at least 0 (got -1)"),
        (["--val-examples", "-1"], "--val-examples must be at least 0 (got -1)"),
        (["--eval-every", "-1"], "--eval-every must be at least 0 (got -1)"),
        (["--intermediate-size", "0"], "--intermediate-size must be at least 1 (got 0)"),
    ],
)
def test_bad_arguments_one_line_errors(setup, tmp_path, capsys, extra, message):
    root, prompts, cache = setup
    argv = [
        "--model",
        str(root / "target"),
        "--data",
        str(prompts),
        "--cache",
        str(cache),
        "--target-layer-ids",
        "1",
        "2",
    ]
    argv += ["--out", str(tmp_path / "o"), *extra]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    # A value no run can take exits 2 before anything loads, as in the other tools; one the
    # target or the files refuse exits 1.
    code = 1 if extra[0] in ("--target-layer-ids", "--data") else 2
    assert e.value.code == code and message in err and "\n" not in err and err.startswith("dflash-train: error: ")


def test_prompt_kinds_and_dataset_answers(setup, tmp_path):
    root, _, _ = setup
    _, _, tokenizer = load(root / "target")
    path = tmp_path / "p.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "t1 t2"}, {"role": "assistant", "content": "t3 t4"}]},
        {"prompt": "t5 t6", "raw": True},
        {"prompt": "t7"},
        {"text": "t8\nt9\nt10 t11\n"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_prompts(path)) == 3
    chat, raw, user, text = read_prompts(path, text_prompt_lines=2)
    assert chat.answer == "t3 t4" and raw.text == "t5 t6" and user.messages[0]["content"] == "t7"
    assert text.text == "t8\nt9\n" and text.answer == "t10 t11\n"
    assert render_prompt(tokenizer, raw) == tokenizer.encode("t5 t6")
    assert render_prompt(tokenizer, user)[-2:] == tokenizer.encode("<|im_start|> assistant")[-2:]
    examples = dataset_examples(tokenizer, [chat, raw, user, text], max_prompt_tokens=64)
    assert len(examples) == 2  # only the prompts with an answer
    assert tokenizer.decode(examples[0]["response_ids"]).split() == ["t3", "t4", "<|im_end|>"]
    text_ids = render_prompt(tokenizer, text)
    assert text_ids == tokenizer.encode("t8\nt9\n")
    assert text_ids + examples[1]["response_ids"] == tokenizer.encode("t8\nt9\nt10 t11\n")


def test_no_prompts_and_help(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "only corpus"}\n')
    with pytest.raises(DFlashError, match="has no prompts"):
        read_prompts(bad)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--blocks-per-seq" in capsys.readouterr().out


def test_init_draft_starts_from_a_drafter_with_a_fresh_optimizer(setup, tmp_path):
    root = setup[0]
    first = train(_args(setup, tmp_path / "first", iters=6))
    # A learning rate so small that the new run's weights stay the init's; a fresh init would not match.
    again = train(_args(setup, tmp_path / "again", iters=1, warmup=1, learning_rate=1e-9,
                        init_draft=str(tmp_path / "first")))  # fmt: skip
    fresh = train(_args(setup, tmp_path / "fresh", iters=1, warmup=1, learning_rate=1e-9))
    w = dict(tree_flatten(first.parameters()))
    for name, value in tree_flatten(again.parameters()):
        assert mx.allclose(value, w[name], atol=1e-6), name
    assert not mx.allclose(dict(tree_flatten(fresh.parameters()))["fc.weight"], w["fc.weight"], atol=1e-3)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["num_hidden_layers"] == 1
    # Another shape, or both ways of starting at once: one line, before any training.
    with pytest.raises(DFlashError, match=r"--init-draft .* was trained with --intermediate-size 64, but this run "
                                          r"asks for --intermediate-size 32\. Pass --intermediate-size 64 to start "
                                          r"from it\."):  # fmt: skip
        train(_args(setup, tmp_path / "other", intermediate_size=32, init_draft=str(tmp_path / "first")))
    with pytest.raises(DFlashError, match="Pass one of them"):
        train(_args(setup, tmp_path / "first", resume=True, init_draft=str(tmp_path / "first")))
    assert (root / "target").is_dir()


def test_init_draft_at_a_smaller_block_size(setup, tmp_path, capsys):
    train(_args(setup, tmp_path / "first", iters=2))
    smaller = train(_args(setup, tmp_path / "smaller", iters=2, block_size=2, drop_lookup_anchors=2,
                          init_draft=str(tmp_path / "first")))  # fmt: skip
    assert smaller.block_size == 2 and json.loads((tmp_path / "smaller" / "config.json").read_text())["block_size"] == 2
    assert "at block size 2" in capsys.readouterr().out
    with pytest.raises(DFlashError, match="was trained with --block-size 2, but this run asks for --block-size 4"):
        train(_args(setup, tmp_path / "larger", iters=1, init_draft=str(tmp_path / "smaller")))


def test_a_deeper_init_draft_run_grows_the_drafter_and_drafts_as_it_did(setup, tmp_path, capsys):
    first = train(_args(setup, tmp_path / "first", iters=6))
    grown = train(_args(setup, tmp_path / "grown", iters=1, warmup=1, learning_rate=1e-9, num_layers=3,
                        init_draft=str(tmp_path / "first")))  # fmt: skip
    assert "growing" in capsys.readouterr().out
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["num_hidden_layers"] == 3
    w = dict(tree_flatten(grown.parameters()))
    for name, value in tree_flatten(first.parameters()):
        assert mx.allclose(value, w[name], atol=1e-6), name
    # The added layers add (almost) nothing yet: the same block hidden states, hence the same drafts.
    assert float(mx.abs(w["layers.1.mlp.down_proj.weight"]).max()) < 1e-6
    model, _, _ = load(setup[0] / "target", dtype="float32")
    reloaded = load(setup[0] / "target", tmp_path / "grown", dtype="float32")[1]
    block = mx.array([[5] + [reloaded.mask_token_id] * 3])
    taps = mx.random.normal((1, 7, 2 * HIDDEN))
    a = first.block_hidden(model, block, taps, make_draft_cache(first))
    b = reloaded.block_hidden(model, block, taps, make_draft_cache(reloaded))
    assert mx.allclose(a, b, atol=1e-5)
    # Growing is the only change of shape allowed: a shallower run is refused in one line.
    with pytest.raises(DFlashError, match=r"was trained with --num-layers 3, but this run asks for --num-layers 2"):
        train(_args(setup, tmp_path / "less", num_layers=2, init_draft=str(tmp_path / "grown")))


def test_preconditioned_fc_is_saved_folded_as_a_plain_drafter(setup, tmp_path):
    out = tmp_path / "pre"
    trained = train(_args(setup, out, iters=3, save_every=2))
    saved = mx.load(str(out / "model.safetensors"))
    assert "fc.scale" not in saved and type(trained.fc) is nn.Linear
    assert mx.allclose(saved["fc.weight"], trained.fc.weight, atol=1e-6)
    # The training-time form is kept for --resume, next to the optimizer state.
    extra = mx.load(str(latest_checkpoint(out)[0] / "training_arrays.safetensors"))
    assert mx.allclose(extra["fc.weight"] * extra["fc.scale"], saved["fc.weight"], atol=1e-6)
    plain = train(_args(setup, tmp_path / "plain", iters=3, precondition_fc=False))
    assert not (latest_checkpoint(tmp_path / "plain")[0] / "training_arrays.safetensors").exists()
    assert type(plain.fc) is nn.Linear


def test_the_target_keeps_what_load_would_and_the_drafter_trains_in_float32(setup, tmp_path, monkeypatch):
    """Without --dtype the target computes as dflash-generate would (on a GPU: the checkpoint's
    bfloat16, faked here), while the drafter's weights stay float32; --dtype sets both."""
    seen = {}
    real = train_mod.block_loss

    def spy(draft, target, *args, **kwargs):
        seen["target"] = tgt.compute_dtype(target)
        return real(draft, target, *args, **kwargs)

    monkeypatch.setattr(train_mod, "block_loss", spy)
    monkeypatch.setattr(casting, "default_dtype", lambda *models: ("bfloat16", None))
    draft = train(_args(setup, tmp_path / "gpu", iters=2))
    assert seen["target"] == mx.bfloat16
    assert {v.dtype for _, v in tree_flatten(draft.trainable_parameters())} == {mx.float32}
    draft = train(_args(setup, tmp_path / "both", iters=2, dtype="bfloat16"))
    assert seen["target"] == mx.bfloat16
    assert {v.dtype for _, v in tree_flatten(draft.trainable_parameters())} == {mx.bfloat16}
