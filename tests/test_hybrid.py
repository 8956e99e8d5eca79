"""MoE (qwen3_moe) and hybrid (qwen3_5, qwen3_5_moe, qwen3_next) targets, written by
transformers' own classes: mlx-lm against transformers, our taps against HF's hidden states,
and DFlash against mlx-lm's greedy decoding, through every rollback length of the recurrent
state."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import family
from helpers.checkpoints import VOCAB
from helpers.decoding import run
from helpers.family import MAX_REF, prompt_ids, reference
from helpers.hf_checkpoints import HF_KINDS
from helpers.oracles import ScriptedDraft, SecondChoiceDraft

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load, make_cache
from dflash_mlx.models import hybrid, linear_attention
from dflash_mlx.models import target as tgt
from dflash_mlx.models.hybrid import RecurrentCache

torch = pytest.importorskip("torch")

HYBRID = [k for k in HF_KINDS if k != "qwen3_moe"]


@pytest.fixture(scope="session")
def hf_targets(tmp_path_factory):
    """{kind: (folder, transformers model)} and the drafter folder under "draft"."""
    return family.write_targets(tmp_path_factory.mktemp("hf-targets"), HF_KINDS)


@pytest.fixture(scope="session")
def pairs(hf_targets):
    return {kind: load(hf_targets[kind][0], hf_targets["draft"][0]) for kind in HF_KINDS}


@pytest.mark.parametrize("kind", HF_KINDS)
def test_mlx_lm_greedy_matches_transformers(hf_targets, pairs, kind):
    hf, model = hf_targets[kind][1], pairs[kind][0]
    prompt = prompt_ids(30, seed=5)
    family.check_greedy_matches_transformers(model, hf, prompt)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_taps_match_transformers_hidden_states(hf_targets, pairs, kind):
    hf, model = hf_targets[kind][1], pairs[kind][0]
    prompt = prompt_ids(23)
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    tap_ids = [0, 1, 2, 3]
    logits, taps = tgt.forward_with_taps(model, mx.array([prompt]), make_cache(model).target, tap_ids)
    assert mx.allclose(logits, model(mx.array([prompt])), atol=1e-5).item()
    H = tgt.hidden_size(model)
    for n, layer_id in enumerate(tap_ids):
        # HF's hidden_states[0] is the embedding output: layer i's output is [i + 1].
        expected = mx.array(hidden[layer_id + 1].numpy())
        err = mx.abs(taps[..., n * H : (n + 1) * H] - expected).max() / mx.abs(expected).max()
        assert err.item() < 1e-5, layer_id


@pytest.mark.parametrize("kind", HYBRID)
def test_recorded_linear_attention_equals_the_layer(pairs, kind):
    """Our forward of each Gated DeltaNet layer (the verify pass's) gives the layer's output and
    state, and its state after each position is the state of a pass that stops there."""
    model = pairs[kind][0]
    layers = [layer for layer in model.model.layers if layer.is_linear]
    assert linear_attention.supports(layers[0].linear_attn, None, RecurrentCache())
    before = mx.random.normal((1, 9, layers[0].linear_attn.hidden_size), key=mx.random.key(1))
    x = mx.random.normal((1, 16, layers[0].linear_attn.hidden_size), key=mx.random.key(2))
    for layer in layers:
        attn = layer.linear_attn
        ours, theirs = RecurrentCache(), RecurrentCache()
        for c in (ours, theirs):
            attn(before, None, c)
        out, conv_input, states = linear_attention.linear_attention(attn, x, ours)
        assert mx.allclose(out, attn(x, None, theirs), rtol=1e-5, atol=1e-6).item()
        assert ours.offset == theirs.offset == 25
        assert all(mx.array_equal(a, b).item() for a, b in zip(ours.cache, theirs.cache))
        for keep in (1, 7, 16):
            short = RecurrentCache()
            attn(before, None, short)
            attn(x[:, :keep], None, short)
            width = attn.conv_kernel_size - 1
            # A BLAS may round a projection of 16 rows and of `keep` rows apart in the last bit.
            assert mx.allclose(conv_input[:, keep : keep + width], short[0], rtol=1e-5, atol=1e-6).item()
            assert mx.allclose(states[keep - 1], short[1], rtol=1e-5, atol=1e-6).item()
    # And the decoder layer around it (what a verify pass runs): the layer's own output.
    for layer in layers:
        ours, theirs = RecurrentCache(), RecurrentCache()
        assert mx.allclose(hybrid.recorded_layer(layer, x, ours), layer(x, None, theirs), rtol=1e-5, atol=1e-6).item()
        assert ours._steps is not None


@pytest.mark.parametrize("kind", HYBRID)
def test_trim_after_a_verify_pass_selects_the_replayed_state(pairs, kind, monkeypatch):
    """trim after a verify pass selects the kept length's state without running the layer, and
    it is the state the replay (what a longer pass still does) gives."""
    import types

    model = pairs[kind][0]
    prompt, block = prompt_ids(11), prompt_ids(16, seed=7)

    def verified(record: bool):
        monkeypatch.setattr(hybrid, "RECORD_POSITIONS", 16 if record else 0)
        cache = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), cache, [])
        tgt.forward_with_taps(model, mx.array([block]), cache, [])
        return cache

    for n in (1, 8, 15):
        selected, replayed = verified(True), verified(False)
        recurrent = [c for c in selected if isinstance(c, RecurrentCache)]
        assert all(c._steps is not None for c in recurrent)
        assert all(c._steps is None for c in replayed if isinstance(c, RecurrentCache))
        for c in recurrent:
            c._layer = types.SimpleNamespace()  # a replay would fail: it has no linear_attn
        for a, b in zip(selected, replayed):
            a.trim(n)
            b.trim(n)
            assert a.offset == b.offset == len(prompt) + 16 - n
            if isinstance(a, RecurrentCache):
                assert mx.allclose(a.cache[0], b.cache[0], rtol=1e-5, atol=1e-6).item()
                assert mx.allclose(a.cache[1], b.cache[1], rtol=1e-5, atol=1e-6).item(), n


def test_generation_with_the_emulated_recurrence_kernel_is_lossless(pairs, monkeypatch, tmp_path):
    """Every verify pass's recurrence through the Metal kernel's own source (run here by the CPU
    harness, enabled by its dispatcher's check), every rollback selecting the kernel's states:
    still mlx-lm's greedy output, at every kind of acceptance."""
    from helpers.emulated import emulated_dispatcher

    from dflash_mlx.kernels import gdn, harness

    if harness.compiler_missing():
        pytest.skip(harness.compiler_missing())
    dispatcher, calls = emulated_dispatcher(
        "gated_delta_states", gdn.gated_delta_states_kernel, gdn.gated_delta_states_ops, tmp_path,
        shape_class=gdn.shape_class, example=gdn.example, close=gdn.close, supports=gdn.supports,
    )  # fmt: skip
    monkeypatch.setattr(linear_attention, "gated_delta_states", dispatcher)
    model, draft, _ = pairs["qwen3_5"]
    prompt = prompt_ids(7)
    ref = reference(model, prompt, 40)
    mixed = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3)
    seen = set()
    for drafter in (draft, mixed):
        calls.clear()
        out, cycles = run(model, drafter, prompt, block_size=8, max_tokens=40)
        assert out == ref
        assert calls.count("kernel") > calls.count("twin")
        seen |= {c.num_accepted for c in cycles[1:]}
    assert dispatcher.verdicts and all(v.enabled for v in dispatcher.verdicts.values())
    assert 0 in seen and len(seen) >= 3


def test_draft_trees_with_the_emulated_tree_kernel_are_lossless(pairs, monkeypatch, tmp_path):
    """Every tree pass's recurrence through the tree kernel's own Metal source (run here by the CPU
    harness, enabled by its dispatcher's check), every accepted path's state the kernel's: still
    mlx-lm's greedy output, with trees that branch and paths that follow a branch."""
    from helpers.emulated import emulated_dispatcher

    from dflash_mlx.kernels import gdn_tree, harness

    if harness.compiler_missing():
        pytest.skip(harness.compiler_missing())
    dispatcher, calls = emulated_dispatcher(
        "gated_delta_tree", gdn_tree.gated_delta_tree_kernel, gdn_tree.gated_delta_tree_ops, tmp_path,
        shape_class=gdn_tree.shape_class, example=gdn_tree.example, close=gdn_tree.close, supports=gdn_tree.supports,
    )  # fmt: skip
    monkeypatch.setattr(linear_attention, "gated_delta_tree", dispatcher)
    model, draft, _ = pairs["qwen3_5"]
    prompt = prompt_ids(9)
    ref = reference(model, prompt, 16)
    # The drafter's first choice at the first position is always wrong: the target follows a branch.
    branching = SecondChoiceDraft(draft, prompt + ref, VOCAB)
    out, _ = run(model, branching, prompt, tree_budget=16, max_tokens=16, adaptive=False)
    assert out == ref
    assert calls.count("kernel") > calls.count("twin")
    assert dispatcher.verdicts and all(v.enabled for v in dispatcher.verdicts.values())


@pytest.mark.parametrize("record", [True, False], ids=["selected", "replayed"])
@pytest.mark.parametrize("kind", HYBRID)
def test_recurrent_trim_equals_a_shorter_pass(pairs, kind, record, monkeypatch):
    """After a pass of B tokens, trim(n) leaves the state a pass of B - n tokens leaves, whether
    trim selects a recorded state (a verify pass) or replays the kept tokens (a longer one)."""
    monkeypatch.setattr(hybrid, "RECORD_POSITIONS", 16 if record else 0)
    model = pairs[kind][0]
    prompt, block = prompt_ids(11), prompt_ids(16, seed=7)
    for n in range(0, 17):
        cache = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), cache, [])
        tgt.forward_with_taps(model, mx.array([block]), cache, [])
        for c in cache:
            c.trim(n)
        straight = make_cache(model).target
        tgt.forward_with_taps(model, mx.array([prompt]), straight, [])
        if n < 16:
            tgt.forward_with_taps(model, mx.array([block[: 16 - n]]), straight, [])
        for c, s in zip(cache, straight):
            assert c.offset == s.offset == len(prompt) + 16 - n
            if isinstance(c, RecurrentCache):
                assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(c.cache, s.cache)), n
        # And the next pass continues exactly.
        nxt = mx.array([[5, 6, 7]])
        a, _ = tgt.forward_with_taps(model, nxt, cache, [])
        b, _ = tgt.forward_with_taps(model, nxt, straight, [])
        assert mx.allclose(a, b, atol=1e-4).item(), n


def test_trim_forgets_states_kept_past_the_new_end(pairs):
    """A checkpoint of dropped tokens is never offered for reuse (it is another continuation)."""
    model = pairs["qwen3_5"][0]
    cache = make_cache(model).target
    tgt.forward_with_taps(model, mx.array([prompt_ids(11)]), cache, [])
    tgt.forward_with_taps(model, mx.array([prompt_ids(16, seed=7)]), cache, [])
    recurrent = [c for c in cache if isinstance(c, RecurrentCache)]
    for c in recurrent:
        c.checkpoint()
        assert 27 in c.checkpoints
        c.trim(5)
        assert max(c.checkpoints) <= 22 and 27 not in c.restorable_lengths()


@pytest.mark.parametrize("kind", HYBRID)
def test_recurrent_trim_past_the_last_pass_is_refused(pairs, kind):
    model = pairs[kind][0]
    cache = make_cache(model).target
    tgt.forward_with_taps(model, mx.array([prompt_ids(5)]), cache, [])
    tgt.forward_with_taps(model, mx.array([prompt_ids(3)]), cache, [])
    with pytest.raises(DFlashError, match="cannot drop 4 tokens: only the last pass \\(3 tokens\\)"):
        cache[0].trim(4)


@pytest.mark.parametrize("kind", HYBRID)
def test_min_confidence_and_lookup_fallback(pairs, kind):
    model, draft, _ = pairs[kind]
    for prompt_len in (1, 40):
        prompt = prompt_ids(prompt_len)
        ref = reference(model, prompt)
        mixed = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3, unsure_every=4)
        for drafter, cutoff, fallback in ((draft, 0.5, 8), (mixed, 0.5, 0), (mixed, 0.0, 8)):
            out, _ = run(model, drafter, prompt, block_size=8, max_tokens=MAX_REF,
                         lookup_fallback=fallback, min_confidence=cutoff)  # fmt: skip
            assert out == ref, (prompt_len, cutoff, fallback)


def test_block_size_auto_is_refused_in_one_line(pairs):
    model, draft, _ = pairs[HYBRID[0]]
    with pytest.raises(DFlashError, match="hybrid target's recurrent state"):
        next(dflash_generate_step([1, 2, 3], model, draft, LoopOptions(block_size="auto")))


@pytest.mark.parametrize("kind", HYBRID)
def test_multi_turn_reuse_equals_a_fresh_run(pairs, kind):
    model, draft, _ = pairs[kind]
    cache, oracle, prompt, follow, second = family.two_turns(model, draft)
    # A turn that rewrites the previous answer (as chat templates that drop old reasoning
    # do) returns to the state saved at the end of that turn's prompt.
    edited = follow + second[:3] + [1, 2] + prompt_ids(4, seed=11)
    edited_again = follow + second[:3] + [7, 7] + prompt_ids(4, seed=12)
    run(model, oracle, edited, max_tokens=20, prompt_cache=cache)
    reuse = cache.reusable_prefix(edited_again)
    assert reuse == len(follow) and "recurrent state was saved" in cache.reuse_note
    family.check_turn(model, oracle, cache, edited_again)
    family.check_leaving_early(model, draft, cache, prompt)


@pytest.mark.parametrize("kind", HYBRID)
def test_generation_left_early_then_continue(pairs, kind):
    model, draft, _ = pairs[kind]
    prompt = prompt_ids(20)
    cache = make_cache(model, draft)
    steps = dflash_generate_step(
        prompt, model, draft, LoopOptions(max_tokens=60, lookup_fallback=4), prompt_cache=cache
    )
    taken = [t for _, step in zip(range(4), steps) for t in step.tokens]
    steps.close()
    assert cache.tokens == (prompt + taken)[:-1] and cache.offset == len(cache.tokens)
    follow = prompt + taken + prompt_ids(5, seed=9)
    again, _ = run(model, draft, follow, max_tokens=40, prompt_cache=cache)
    assert again == reference(model, follow, 40)


# Qwen3-Next's check runs with -m slow: its rollback and acceptance are the code Qwen3.5's check
# covers, and each takes about a minute.
@pytest.fixture(scope="module", params=["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def hybrid_marginals(pairs, request):
    """A hybrid pair of each layout and the exact marginals of its first sampled tokens."""
    from test_sampling import _exact_marginals

    exact = _exact_marginals(pairs[request.param][0])
    assert all(p.max() < 0.5 for p in exact)  # no near-certain token: the check has teeth
    return pairs[request.param], exact


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_sampling_keeps_the_hybrid_targets_distribution(hybrid_marginals, proposal):
    from test_sampling import _excess

    pair, exact = hybrid_marginals
    excess = _excess(pair, exact, proposal)
    assert max(excess) < 0, excess


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5", "qwen3_next"])
def test_convert_load_generate_chat(hf_targets, kind, tmp_path, capsys):
    """dflash-convert -> load -> dflash-generate -> the chat engine's turns, for an MoE pair and
    a hybrid pair of each layout; the chat's second turn (reusing the cache) equals a fresh run."""
    from dflash_mlx.convert import convert
    from dflash_mlx.tools.cli.generate import main as generate_main
    from dflash_mlx.tui.commands import Settings
    from dflash_mlx.tui.engine import MLXEngine

    pair = tmp_path / "pair"
    result = convert(str(hf_targets[kind][0]), str(pair), draft_hf_path=str(hf_targets["draft"][0]),
                     dtype="float32", check_tokens=16, verbose=False)  # fmt: skip
    assert result.check.tokens_match
    model, draft, _ = load(pair)
    prompt = prompt_ids(9)
    assert run(model, draft, prompt, max_tokens=24)[0] == reference(model, prompt, 24)
    generate_main(["--model", str(pair), "--prompt", "t1 t2 t3", "--max-tokens", "8"])
    assert "Acceptance length" in capsys.readouterr().out

    def reply(engine, messages):
        return "".join(r.text for r in engine(messages, Settings(max_tokens=10)))

    chat = MLXEngine(str(pair))
    chat.load()
    turns = [{"role": "user", "content": "t1 t2 t3"}]
    turns.append({"role": "assistant", "content": reply(chat, turns)})
    turns.append({"role": "user", "content": "t4 t5"})
    second = reply(chat, turns)
    fresh = MLXEngine(str(pair))
    fresh.load()
    assert second == reply(fresh, turns)
    chat.close()
    fresh.close()


def test_quantized_mlx_conversion_of_qwen3_next(hf_targets, tmp_path):
    """A 4-bit conversion in mlx-lm's layout (as mlx-community publishes Qwen3-Coder-Next: experts
    stacked, norms shifted, quantized weights): it loads as it is and DFlash stays lossless
    against the quantized target's own greedy decoding."""
    import mlx.nn as nn

    from dflash_mlx.convert import convert

    pair = tmp_path / "pair"
    result = convert(str(hf_targets["qwen3_next"][0]), str(pair), draft_hf_path=str(hf_targets["draft"][0]),
                     quantize=True, q_bits=4, q_group_size=32, check_tokens=16, verbose=False)  # fmt: skip
    assert result.check.tokens_match
    stored = mx.load(str(pair / "target" / "model.safetensors"))
    assert "model.layers.0.mlp.switch_mlp.up_proj.scales" in stored
    assert not any(".experts." in k for k in stored)
    model, draft, _ = load(pair)
    layer = model.model.layers[0]
    assert isinstance(layer.linear_attn.in_proj_qkvz, nn.QuantizedLinear)
    assert isinstance(model.model.layers[3].self_attn.q_proj, nn.QuantizedLinear)
    for prompt_len in (7, 40):
        prompt = prompt_ids(prompt_len)
        ref = reference(model, prompt)
        for block_size in (4, 16):
            assert run(model, draft, prompt, block_size=block_size, max_tokens=MAX_REF)[0] == ref


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_component_times_include_the_rollback(pairs, kind):
    """dflash-bench times the loop's own rewind of a hybrid target per block size, and its limit
    counts it; a MoE target (attention only) has none to time."""
    from dflash_mlx.tools.bench.report import markdown
    from dflash_mlx.tools.bench.stats import physical_limit, summarize
    from dflash_mlx.tools.bench.timing import RunResult, component_times

    model, draft, _ = pairs[kind]
    times = component_times(model, draft, [4, 8], context=12, repeats=2)
    assert {b: sorted(by_k) for b, by_k in times["rollback"].items()} == {4: [0, 2, 3], 8: [0, 4, 6, 7]}
    assert all(t > 0 for by_k in times["rollback"].values() for t in by_k.values())
    row = summarize([RunResult("dflash", 8, 0, "code", 10, 100.0, 500.0, [1, 8], verify_sizes=[8, 8])], times)[0]
    t_rollback = (times["rollback"][8][0] + times["rollback"][8][7]) / 2
    assert row["rollback"] == pytest.approx(t_rollback)
    limit = physical_limit(4.5, times["ar"], times["draft"][8], times["verify"][8], t_rollback)
    assert row["limit"] == pytest.approx(limit)
    assert ", rollback " in markdown([row], {"machine": "m", "device": "d", "blas": "b", "mlx": "1", "mlx_lm": "1",
                                             "commit": "c", "date": "now"}, times)  # fmt: skip
    assert "rollback" not in component_times(*pairs["qwen3_moe"][:2], [4], context=12, repeats=1)


def _edited(hf_targets, kind, tmp_path, edit) -> Path:
    """A copy of ``kind``'s folder with ``edit`` applied to its (text) config."""
    folder = tmp_path / "target"
    shutil.copytree(hf_targets[kind][0], folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config.get("text_config") or config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_a_layer_layout_mlx_lm_would_not_build_is_refused(hf_targets, kind, tmp_path):
    alternating = ["linear_attention", "full_attention"] * 2
    folder = _edited(hf_targets, kind, tmp_path, lambda c: c.update(layer_types=alternating))
    with pytest.raises(DFlashError, match=r"layer_types \['linear_attention', 'full_attention', .* differ from"):
        load(folder)


@pytest.mark.parametrize(
    "kind, edit, message",
    [
        ("qwen3_5", lambda c: c.update(num_hidden_layers=3, layer_types=["linear_attention"] * 3),
         "has 3 layers and full_attention_interval=4: mlx-lm builds no full attention layer"),
        ("qwen3_next", lambda c: c.update(num_hidden_layers=3, layer_types=["linear_attention"] * 3),
         "has 3 layers and full_attention_interval=4: mlx-lm builds no full attention layer"),
        # As transformers 5 saves a Qwen3-Next config: its RoPE fields under rope_parameters.
        ("qwen3_next", lambda c: c.update(rope_parameters={"rope_theta": c.pop("rope_theta"), "rope_type": "default",
                                                           "partial_rotary_factor": c.pop("partial_rotary_factor")}),
         "lacks rope_theta, partial_rotary_factor, which mlx-lm needs: copy rope_theta and partial_rotary_factor "
         "out of its rope_parameters"),
        ("qwen3_next", lambda c: c.pop("mlp_only_layers"), "lacks mlp_only_layers, which mlx-lm needs: re-download"),
        ("qwen3_next", lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         r"FP8 checkpoint \(weight_block_size=\[128, 128\]\), which mlx-lm cannot load for qwen3_next"),
    ],
)  # fmt: skip
def test_a_config_mlx_lm_cannot_load_is_refused_in_one_line(hf_targets, kind, edit, message, tmp_path):
    folder = _edited(hf_targets, kind, tmp_path, edit)
    with pytest.raises(DFlashError, match=message) as e:
        load(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_data_step_refills_rows_only_without_recurrent_layers(pairs, kind):
    # The data step's slot engine refills key/value rows; recurrent targets go to mlx-lm's
    # BatchGenerator instead.
    from dflash_mlx.tools.train import batch_decode

    model, _, _ = pairs[kind]
    assert batch_decode.supports(model) == (kind not in HYBRID)


def test_tree_recurrence_equals_each_path_alone():
    """gated_delta_tree_ops: every node's output and state equal the sequential recurrence over its path."""
    from dflash_mlx.kernels.gdn import gated_delta_states_ops
    from dflash_mlx.kernels.gdn_tree import gated_delta_tree_ops

    parents = [-1, 0, 0, 1, 1, 2, 3]
    N, Hk, Hv, Dk, Dv = len(parents), 2, 4, 8, 6
    keys = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((N, Hk, Dk), key=keys[0]) * 0.3
    k = mx.random.normal((N, Hk, Dk), key=keys[1]) * 0.3
    v = mx.random.normal((N, Hv, Dv), key=keys[2])
    g = mx.random.uniform(0.5, 1.0, (N, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (N, Hv), key=keys[4])
    state = mx.random.normal((1, Hv, Dv, Dk), key=keys[5])
    y, states = gated_delta_tree_ops(q, k, v, g, beta, state, parents)
    for i in range(N):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        at = mx.array(path[::-1])
        ys, last, _ = gated_delta_states_ops(q[at][None], k[at][None], v[at][None], g[at][None], beta[at][None], state)
        assert mx.allclose(y[i], ys[0, -1], atol=1e-5).item() and mx.allclose(states[i], last, atol=1e-5).item()


def test_auto_tree_budget_on_a_recurrent_target_is_refused_in_one_line(pairs):
    model, draft, _ = pairs["qwen3_5"]
    with pytest.raises(DFlashError, match="tree_budget='auto' times tree passes"):
        run(model, draft, prompt_ids(5), tree_budget="auto", max_tokens=4)


@pytest.mark.parametrize("kind", ["qwen3_5"])
def test_text_trees_are_lossless(pairs, kind, monkeypatch):
    """Draft-free cycles' trees of the datastore's continuations: each node follows its own path through
    the recurrent state, and the accepted path's state is the one kept."""
    from test_text_trees import _branchy_store, _count_tree_passes, _tree_policy

    model, _, _ = pairs[kind]
    prompts = [prompt_ids(7), prompt_ids(20)]
    store = _branchy_store(model, prompts)
    sizes = _count_tree_passes(monkeypatch)
    for prompt in prompts:
        out, _ = run(model, None, prompt, block_size=4, max_tokens=60, datastore=store, policy=_tree_policy())
        assert out == reference(model, prompt, 60)
    assert sizes and max(sizes) > 1
