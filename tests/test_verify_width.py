"""block_size="auto": measured pass costs, the width policy, and exactness."""

import json

import pytest
from helpers.decoding import run
from test_generate import _prompt, reference

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, make_cache
from dflash_mlx.tools.bench.benchmark import run_benchmark
from dflash_mlx.tools.cli.generate import main as generate_main
from dflash_mlx.tuning import widths as verify_width
from dflash_mlx.tuning.widths import CostStore, PassCosts, VerifyWidth, bucket, timed_widths


def test_buckets_widths_and_interpolation():
    assert [bucket(n) for n in (0, 1, 256, 257, 1000, 1024, 1025, 7000)] == [256, 256, 256, 512, 1024, 1024, 2048,
                                                                              8192]  # fmt: skip
    assert timed_widths(16) == [1, 2, 3, 4, 6, 8, 12, 16] and timed_widths(5) == [1, 2, 3, 4, 5]
    costs = PassCosts(0.001, {1: 0.010, 4: 0.016, 8: 0.030})
    assert costs.verify_at(4) == 0.016 and costs.verify_at(6) == pytest.approx(0.023)
    assert costs.verify_at(12) == 0.030  # past the widest measured: its cost


class _Fixed(VerifyWidth):
    """The policy alone, with given costs."""

    def __init__(self, costs: PassCosts):
        self.memo, self.accepted, self.expected, self.pending_taps = {}, 4.0, 4.0, None
        self._costs = costs

    def costs(self):
        return self._costs


def test_choose_nodes_maximizes_expected_tokens_per_second_and_calibrates():
    """A draft tree's first n nodes yield 1 + the sum of their path chances (tree_budget="auto")."""
    flat = _Fixed(PassCosts(0.002, {1: 0.01, 65: 0.01}))
    flat.tree = True
    assert flat.choose_nodes([0.6, 0.4, 0.3, 0.2]) == 4  # a bigger tree costs nothing more
    steep = _Fixed(PassCosts(0.02, {1: 0.01, 65: 0.65}))  # 10 ms a row: a node pays only if nearly sure
    steep.tree = True
    assert steep.choose_nodes([0.99, 0.98, 0.3, 0.2]) == 2
    steep.update(0)  # expected 1.97 accepted, got 0: trust the drafter less
    assert steep.ratio < 1


def test_choose_maximizes_expected_tokens_per_second():
    flat = _Fixed(PassCosts(0.002, {1: 0.01, 16: 0.01}))
    assert flat.choose([0.9] * 15) == 15  # a wider verify costs nothing more: verify everything
    steep = _Fixed(PassCosts(0.0, {1: 0.01, 16: 0.16}))  # 10 ms a token: only sure drafts pay
    # n drafts at confidence 0.5: (2 - 0.5^n) tokens / (n + 1) passes-worth: best at n = 1.
    assert steep.choose([0.5] * 15) == 1
    # Certain drafts up to the 6th, then unsure ones: stop after the certain run (a draft pass
    # to pay for makes longer cycles better).
    steep_draft = _Fixed(PassCosts(0.005, {1: 0.01, 16: 0.16}))
    assert steep_draft.choose([1.0] * 6 + [0.1] * 9) == 6
    mid = _Fixed(PassCosts(0.004, {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.020, 16: 0.040}))
    conf = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]

    def rate(n):
        alive, tokens = 1.0, 1.0
        for c in conf[:n]:
            alive *= c
            tokens += alive
        return tokens / (0.004 + mid._costs.verify_at(n + 1))

    assert mid.choose(conf) == max(range(1, 16), key=rate)


def test_calibration_learns_how_far_to_trust_the_drafter():
    policy = _Fixed(PassCosts(0.005, {1: 0.01, 16: 0.16}))
    sure = [1.0] * 6 + [0.1] * 9
    assert policy.choose(sure) == 6
    for _ in range(20):  # the "certain" drafts are wrong at once, every time
        policy.choose(sure)
        policy.update(0)
    assert policy.ratio < 0.3 and policy.choose(sure) == 1
    policy.update(1)
    assert policy.pending_taps is None
    policy.update(3)  # no cycle pending (a lookup or plain cycle): nothing learnt
    ratio = policy.ratio
    policy.update(5)
    assert policy.ratio == ratio


@pytest.mark.parametrize("prompt_len", [1, 7, 130])
def test_auto_is_lossless_and_varies_the_width(qwen3_pair, prompt_len, tmp_path):
    model, draft, _ = qwen3_pair
    prompt = _prompt(prompt_len)
    ref = reference(model, prompt, max_tokens=80)
    out, cycles = run(model, draft, prompt, block_size="auto", max_tokens=80, adaptive=False)
    assert out == ref
    widths = [c.num_draft for c in cycles[1:]]
    assert all(1 <= w <= draft.block_size - 1 for w in widths[:-1])


def test_auto_measures_once_on_the_live_cache_and_keeps_it_on_disk(qwen3_pair, tmp_path, monkeypatch):
    model, draft, _ = qwen3_pair
    store = CostStore(tmp_path / "costs.json")
    cache = make_cache(model, draft)
    run(model, draft, _prompt(20), max_tokens=4, prompt_cache=cache, adaptive=False)
    offset, tokens = cache.offset, list(cache.tokens)
    width = VerifyWidth(model, draft, cache, store=store)
    costs = width.costs()
    # The timed passes were trimmed off: the caches are where they were.
    assert cache.offset == offset and cache.tokens == tokens
    assert sorted(costs.verify) == timed_widths(draft.block_size) and costs.draft > 0
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert len(saved) == 1 and next(iter(saved)).endswith("bucket 256")

    def no_measure(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(verify_width, "measure", no_measure)
    again = VerifyWidth(model, draft, cache, store=store).costs()
    assert again == costs
    # Another context bucket is measured anew.
    run(model, draft, _prompt(300), max_tokens=2, prompt_cache=cache, adaptive=False)
    with pytest.raises(AssertionError, match="measured again"):
        VerifyWidth(model, draft, cache, store=store).costs()


def test_auto_refusals(qwen3_pair):
    model, draft, _ = qwen3_pair
    from dflash_mlx.drafts.lookup import PromptLookup

    for kwargs, message in ((dict(min_confidence=0.5), "leave min_confidence at 0"),):
        with pytest.raises(DFlashError, match=message):
            next(dflash_generate_step([1, 2, 3], model, draft, LoopOptions(block_size="auto", **kwargs)))
    for proposer in (None, PromptLookup(4)):
        with pytest.raises(DFlashError, match="pass a DFlash drafter"):
            next(dflash_generate_step([1, 2, 3], model, proposer, LoopOptions(block_size="auto")))


def test_generate_cli_block_size_auto(pair_dirs, capsys):
    argv = ["--model", str(pair_dirs["qwen3-tied"]), "--draft", str(pair_dirs["draft"]), "--prompt", "t1 t2",
            "--max-tokens", "12", "--dtype", "float32", "--ignore-chat-template"]  # fmt: skip
    generate_main(argv)
    plain = capsys.readouterr().out.split("=" * 10)[1]
    generate_main(argv + ["--block-size", "auto"])
    assert capsys.readouterr().out.split("=" * 10)[1] == plain
    for bad, message in ((["--block-size", "big"], "is not a block size"),
                         (["--block-size", "auto", "--no-draft"], "no drafter is loaded"),
                         (["--block-size", "auto", "--min-confidence", "0.5"], "leave min_confidence")):  # fmt: skip
        with pytest.raises(SystemExit):
            generate_main(argv + bad)
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_bench_dflash_auto_row(pair_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "t1 t2 t3 t1 t2"}) + "\n")
    result = run_benchmark(model=str(pair_dirs["qwen3-tied"]), draft=str(pair_dirs["draft"]), prompts=str(prompts),
                           max_tokens=12, block_sizes=(4, 8), runs=1, methods=("baseline", "dflash", "dflash-auto"),
                           progress=False)  # fmt: skip
    rows = {(r["method"], r["block_size"]): r for r in result["rows"]}
    # dflash-auto verifies up to the drafter's block size (16), whose passes are timed too.
    assert set(rows) == {("baseline", 1), ("dflash", 4), ("dflash", 8), ("dflash-auto", 16)}
    auto = rows[("dflash-auto", 16)]
    assert 1 <= auto["verify_size"] <= 16 and auto["limit"] > 0 and result["mismatches"] == []
    assert 16 in result["times"]["verify"]
