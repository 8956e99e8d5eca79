import json

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import VOCAB
from test_train import _args, setup  # noqa: F401  (the module's tiny target and response cache)

from dflash_mlx import DFlashError
from dflash_mlx.models import target as tgt
from dflash_mlx.tools.train.losses import block_hidden, block_loss, head_gram, logit_error
from dflash_mlx.tools.train.taps import TapStore
from dflash_mlx.tools.train.trainer import train


def _examples(n: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"key": f"k{i}", "prompt_ids": rng.integers(0, VOCAB - 4, 5).tolist(),
         "response_ids": rng.integers(0, VOCAB - 4, 9 + i).tolist()}
        for i in range(n)
    ]  # fmt: skip


def test_head_gram_is_the_mean_squared_centred_logit_difference(qwen3_pair):
    model, _, _ = qwen3_pair
    h, h_star = mx.random.normal((5, 64)), mx.random.normal((5, 64))
    z, z_star = tgt.lm_head(model, h), tgt.lm_head(model, h_star)
    diff = (z - z.mean(-1, keepdims=True)) - (z_star - z_star.mean(-1, keepdims=True))
    explicit = (diff * diff).mean(-1)
    d = h - h_star
    via_gram = ((d @ head_gram(model)) * d).sum(-1)
    assert mx.allclose(via_gram, explicit, rtol=1e-4, atol=1e-4)
    # Uncentred logits differ by the shift, which the softmax ignores; the centring matters.
    raw = ((z - z_star) ** 2).mean(-1)
    assert not mx.allclose(raw, explicit, rtol=1e-2)


def test_logit_error_pairs_each_position_with_the_hidden_state_that_predicted_its_token():
    H, n = 8, 3
    gram = mx.eye(H)
    last = mx.random.normal((1, 20, H))
    anchors = mx.array([4, 11])
    # Block position k drafts token anchor + k, predicted from the state at anchor + k - 1.
    h = mx.stack([last[0, a : a + n] for a in (4, 11)])
    weights = mx.ones((2, n))
    assert logit_error(h, last, anchors, gram, weights).item() < 1e-10
    shifted = mx.stack([last[0, a + 1 : a + 1 + n] for a in (4, 11)])
    assert logit_error(shifted, last, anchors, gram, weights).item() > 0.1
    # Weight 0 (past a sequence's end) leaves a position out.
    spoiled = h.at[1, 2].add(5.0)
    assert logit_error(spoiled, last, anchors, gram, weights.at[1, 2].multiply(0.0)).item() < 1e-10


def test_block_loss_adds_the_weighted_distillation_term(qwen3_pair):
    model, draft, _ = qwen3_pair
    B, W = draft.block_size, len(draft.target_layer_ids) * 64
    taps, last = mx.random.normal((1, 48, W)), mx.random.normal((1, 48, 64))
    anchors, starts = mx.array([10, 30]), mx.array([0, 0])
    blocks, labels = mx.random.randint(0, VOCAB, (2, B)), mx.random.randint(0, VOCAB, (2, B - 1))
    weights = mx.ones((2, B - 1))
    ce = block_loss(draft, model, taps, blocks, anchors, starts, labels, weights, positions=2)
    gram = head_gram(model)
    both = block_loss(draft, model, taps, blocks, anchors, starts, labels, weights, positions=2,
                      target_final=last, gram=gram, logit_mse=0.5)  # fmt: skip
    h = block_hidden(draft, model, taps, blocks, anchors, starts)
    expected = ce.item() + 0.5 * logit_error(h[:, 1:], last, anchors, gram, weights).item()
    assert both.item() == pytest.approx(expected, rel=1e-5) and both.item() > ce.item() + 1e-3


def test_tap_store_keeps_features_on_disk_and_reuses_them(qwen3_pair, tmp_path, monkeypatch):
    model, draft, _ = qwen3_pair
    ids, examples = draft.target_layer_ids, _examples()
    store = TapStore(model, ids, 12, folder=tmp_path / "taps", identity={"path": "t"})
    for ex in examples:
        store.get(ex)
    assert (store.read, store.computed) == (0, 3) and store.memory == {}
    seq = examples[2]["prompt_ids"] + examples[2]["response_ids"]
    _, ref = tgt.forward_with_taps(model, mx.array([seq[:12]]), [None] * 4, ids + [3])
    taps, last = store.get(examples[2])
    assert taps.shape == (1, 12, len(ids) * 64) and last.shape == (1, 12, 64)
    assert taps.dtype == mx.float32
    # Kept in bfloat16: equal to the target's own to bf16 precision.
    assert mx.allclose(mx.concatenate([taps, last], -1), ref, rtol=1e-2, atol=1e-2)
    assert sorted(p.name for p in (tmp_path / "taps").iterdir()) == ["k0.safetensors", "k1.safetensors",
                                                                     "k2.safetensors", "meta.json"]  # fmt: skip

    # A later run reads them without running the target.
    def no_target(*a, **k):
        raise AssertionError("the target ran")

    monkeypatch.setattr(tgt, "forward_with_taps", no_target)
    again = TapStore(model, ids, 12, folder=tmp_path / "taps", identity={"path": "t"})
    assert mx.array_equal(again.get(examples[2])[0], taps)
    assert again.served() == "taps 100% from disk"
    with pytest.raises(AssertionError, match="the target ran"):
        again.get({"key": "new", "prompt_ids": [1, 2], "response_ids": [3, 4]})


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(tap_ids=[0, 2]), "another tap ids"),
        (dict(max_seq_len=13), "another max seq len"),
        (dict(identity={"path": "other"}), "another target"),
    ],
)
def test_tap_store_refuses_features_made_otherwise(qwen3_pair, tmp_path, change, message):
    model, draft, _ = qwen3_pair
    base = dict(tap_ids=draft.target_layer_ids, max_seq_len=12, identity={"path": "t"})
    TapStore(model, folder=tmp_path / "taps", **base).get(_examples(1)[0])
    with pytest.raises(DFlashError, match=message):
        TapStore(model, folder=tmp_path / "taps", **{**base, **change})


def test_tap_store_writes_up_to_its_size_limit_then_computes(qwen3_pair, tmp_path):
    model, draft, _ = qwen3_pair
    ids, examples = draft.target_layer_ids, _examples(4)
    first = TapStore(model, ids, 12, folder=tmp_path / "taps")
    first.get(examples[0])
    one = first.bytes
    assert one == (tmp_path / "taps" / "k0.safetensors").stat().st_size
    # A later store counts what is already there: room for one more file under this limit.
    store = TapStore(model, ids, 12, folder=tmp_path / "taps", max_bytes=one + 1)
    assert store.bytes == one
    got = [store.get(ex)[0] for ex in examples[1:]]
    assert sorted(p.name for p in (tmp_path / "taps").glob("*.safetensors")) == ["k0.safetensors", "k1.safetensors"]
    # Past the limit an example is computed each time it is drawn, to the same bfloat16 values.
    assert mx.array_equal(store.get(examples[3])[0], got[2]) and store.computed == 4 and store.read == 0
    assert store.get(examples[1])[0].shape == got[0].shape and store.read == 1
    assert store.served() == "taps 20% from disk"


def test_tap_store_refuses_a_file_or_a_folder_of_other_files(qwen3_pair, tmp_path):
    model, draft, _ = qwen3_pair
    (tmp_path / "notes.txt").write_text("mine")
    for folder, message in ((tmp_path / "notes.txt", "is a file"), (tmp_path, "a folder of other files")):
        with pytest.raises(DFlashError, match=message):
            TapStore(model, draft.target_layer_ids, 12, folder=folder)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_train_with_a_tap_cache_and_the_distillation_term(setup, tmp_path, monkeypatch):  # noqa: F811
    taps = tmp_path / "taps"
    first = train(_args(setup, tmp_path / "a", iters=6, tap_cache=str(taps), logit_mse=0.05, loss_positions=1))
    meta = json.loads((taps / "meta.json").read_text())
    assert meta["tap_ids"] == [1, 2] and meta["max_seq_len"] == 64
    # Written as drawn: the examples the 6 steps, the validation batches and fc's scale used.
    n_files = len(list(taps.glob("*.safetensors")))
    assert n_files >= 8
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "a" / "metrics.jsonl")) if "loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses))

    # A second run on the same data trains from the files alone, to the same weights.
    def no_target(*a, **k):
        raise AssertionError("the target ran for the taps")

    monkeypatch.setattr(TapStore, "_compute", no_target)
    second = train(_args(setup, tmp_path / "b", iters=6, tap_cache=str(taps), logit_mse=0.05, loss_positions=1))
    assert len(list(taps.glob("*.safetensors"))) == n_files
    a, b = dict(first.parameters()["layers"][0]["mlp"]), dict(second.parameters()["layers"][0]["mlp"])
    assert all(mx.array_equal(a[k]["weight"], b[k]["weight"]) for k in a)
