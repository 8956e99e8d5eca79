import mlx.core as mx
import pytest
from helpers.checkpoints import VOCAB
from helpers.decoding import greedy, run
from helpers.oracles import ScriptedDraft
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, make_cache, stream_generate
from dflash_mlx.kernels.dispatch import on_metal

MAX_REF = 200


def _prompt(length: int, seed: int = 3) -> list[int]:
    return mx.random.randint(0, VOCAB - 4, (length,), key=mx.random.key(seed)).tolist()


def reference(model, prompt: list[int], max_tokens: int = MAX_REF) -> list[int]:
    """mlx-lm's own greedy decoding of the target."""
    return greedy(model, prompt, max_tokens)


def lossless_length(prompt_len: int) -> int:
    """Tokens to decode in the lossless sweeps: from the long prompt past 256 positions, where mlx-lm's
    KVCache grows its buffers (so rollbacks cross a growth); from the short ones, 64 (dozens of
    cycles at every block size, each with its rollback)."""
    return MAX_REF if prompt_len >= 100 else 64


def _truncate_at_stop(tokens, stop):
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("prompt_len", [1, 7, 130])
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_lossless_random_drafter(tiny_pair, block_size, prompt_len):
    model, draft, _ = tiny_pair
    prompt = _prompt(prompt_len)
    length = lossless_length(prompt_len)
    ref = reference(model, prompt, length)
    for max_tokens in sorted({1, 2, block_size - 1, block_size, block_size + 1, length}):
        out, _ = run(model, draft, prompt, block_size=block_size, max_tokens=max_tokens)
        assert out == ref[:max_tokens], (block_size, prompt_len, max_tokens)


@pytest.mark.parametrize("block_size", [2, 16])
def test_lossless_on_the_portable_path(tiny_pair, block_size, monkeypatch):
    """With the CPU speedups off, the loop takes the path an Apple GPU takes (mlx-lm's layers,
    MLX's native ops): still the target's own output, and none of the CPU code runs."""
    from dflash_mlx.cpu import compiled_layers, fast_math

    model, draft, _ = tiny_pair
    used = []
    for name in ("before", "after", "key_values"):
        monkeypatch.setattr(compiled_layers, name, lambda *a, name=name: used.append(name))
    monkeypatch.setattr(fast_math, "_swiglu_cpu", lambda *a: used.append("swiglu"))
    monkeypatch.setattr(fast_math, "_shifted_exp", lambda *a: used.append("softmax"))
    for prompt_len in (1, 130):
        prompt = _prompt(prompt_len)
        ref = reference(model, prompt)
        mixed = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3, unsure_every=4)
        for drafter, extra in ((draft, {}), (mixed, {"lookup_fallback": 4, "min_confidence": 0.5})):
            out, _ = run(model, drafter, prompt, block_size=block_size, max_tokens=MAX_REF, cpu_speedups=False, **extra)
            assert out == ref, (prompt_len, extra)
    assert used == []


@pytest.mark.parametrize("wrong_every", [0, 1, 3, 5])
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_lossless_scripted_drafters(qwen3_pair, block_size, wrong_every):
    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    ref = reference(model, prompt)
    oracle = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=wrong_every)
    for max_tokens in (1, block_size - 1, block_size + 1, MAX_REF):
        # adaptive=False: every cycle is the scripted drafter's (no policy probe, no looked-up draft).
        out, cycles = run(model, oracle, prompt, block_size=block_size, max_tokens=max(max_tokens, 1), adaptive=False)
        assert out == ref[: len(out)] and len(out) == max(max_tokens, 1)
    for step in cycles[1:]:
        if wrong_every == 0:
            # An oracle has every draft accepted: acceptance length == block size.
            assert step.num_accepted == step.num_draft
        if wrong_every == 1:
            assert step.num_accepted == 0 and len(step.tokens) == 1
    if wrong_every == 0:
        assert max(s.num_accepted + 1 for s in cycles[1:]) == block_size


@pytest.mark.parametrize("prompt_len", [1, 7, 130])
@pytest.mark.parametrize("block_size", [4, 16])
def test_min_confidence_verifies_the_confident_prefix(qwen3_pair, block_size, prompt_len):
    """Each cycle verifies exactly the drafts up to the first unsure one; the output is unchanged."""
    model, draft, _ = qwen3_pair
    prompt = _prompt(prompt_len)
    ref = reference(model, prompt)
    oracle = ScriptedDraft(draft, prompt + ref, VOCAB, unsure_every=5)
    # adaptive=False: every cycle drafts, so that each one's block can be checked.
    full, full_cycles = run(model, oracle, prompt, block_size=block_size, max_tokens=MAX_REF, adaptive=False)
    cut, cut_cycles = run(
        model, oracle, prompt, block_size=block_size, max_tokens=MAX_REF, min_confidence=0.5, adaptive=False
    )
    assert full == cut == ref
    generated = 1  # the prefill's token
    for step in cut_cycles[1:]:
        position = len(prompt) + generated  # absolute position of the cycle's first draft
        budget = min(block_size, MAX_REF - generated) - 1
        unsure = next((k for k in range(budget) if (position + k) % 5 == 0), budget)
        assert step.num_draft == min(max(1, unsure), budget) == step.num_accepted
        generated += len(step.tokens)
    assert {s.num_draft for s in full_cycles[1:-1]} == {block_size - 1}
    assert sum(s.num_draft for s in cut_cycles) < sum(s.num_draft for s in full_cycles)
    # Nothing confident: one draft is still verified per cycle.
    unsure = ScriptedDraft(draft, prompt + ref, VOCAB, unsure_every=1)
    out, cycles = run(model, unsure, prompt, block_size=block_size, max_tokens=MAX_REF, min_confidence=0.5,
                      adaptive=False)  # fmt: skip
    assert out == ref and {s.num_draft for s in cycles[1:-1]} == {1}


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_min_confidence_lossless_every_target_kind(tiny_pair, block_size):
    """Wrong and unsure drafts mixed, on each target kind: cut blocks, same output."""
    model, draft, _ = tiny_pair
    prompt = _prompt(7)
    ref = reference(model, prompt)
    drafter = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3, unsure_every=4)
    out, cycles = run(
        model, drafter, prompt, block_size=block_size, max_tokens=MAX_REF, min_confidence=0.5, adaptive=False
    )
    assert out == ref
    if block_size > 2:
        assert max(s.num_draft for s in cycles) < block_size - 1


class CountingDraft(ScriptedDraft):
    """A scripted drafter that counts its passes and notes where each one drafted from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes, self.drafted_at = 0, set()

    def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
        self.passes += 1
        logits = super().propose(model, block, taps, cache, speedups, num_drafts)
        # After the pass the context cache holds every committed token before block[0].
        self.drafted_at.add(cache[0].offset)
        return logits


@pytest.mark.parametrize("block_size", [4, 16])
def test_lookup_fallback_schedule(qwen3_pair, block_size):
    """After each first-draft miss the drafter sits out 1, 2, 4, ... (up to the cap) cycles."""
    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    ref = reference(model, prompt)
    cap = 4
    wrong = CountingDraft(draft, prompt + ref, VOCAB, wrong_every=1)
    out, ran = [], []
    options = LoopOptions(block_size=block_size, max_tokens=60, lookup_fallback=cap, adaptive=False)
    steps = dflash_generate_step(prompt, model, wrong, options)
    for step in steps:
        # Whether the drafter drafted this cycle: a cycle starts with len(prompt) + len(out) - 1
        # tokens cached (the newest one is not yet through the target).
        ran.append(len(prompt) + len(out) - 1 in wrong.drafted_at)
        out.extend(step.tokens)
    assert out == ref[:60]
    expected, span = [], 1
    while len(expected) < len(ran):
        expected += [True] + [False] * span
        span = min(2 * span, cap)
    # ran[0] is the prefill; the last cycle has no room for drafts.
    assert ran[1:-1] == expected[: len(ran) - 2]
    assert ran[1:-1].count(True) < len(ran) // 3
    # A drafter that is never wrong never gives way.
    oracle = CountingDraft(draft, prompt + ref, VOCAB)
    out, cycles = run(model, oracle, prompt, block_size=block_size, max_tokens=60, lookup_fallback=cap, adaptive=False)
    assert out == ref[:60] and oracle.passes == len(cycles) - 1 - (cycles[-1].num_draft == 0)


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_lookup_fallback_lossless_every_target_kind(tiny_pair, block_size):
    """Random, wrong and unsure drafts, with and without the cutoff: the target's own output."""
    model, draft, _ = tiny_pair
    for prompt_len in (1, 40):
        prompt = _prompt(prompt_len)
        ref = reference(model, prompt)
        mixed = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=3, unsure_every=4)
        for drafter in (draft, mixed):
            for cutoff in (0.0, 0.5):
                out, _ = run(model, drafter, prompt, block_size=block_size, max_tokens=MAX_REF,
                             lookup_fallback=8, min_confidence=cutoff)  # fmt: skip
                assert out == ref, (block_size, prompt_len, cutoff)


@pytest.mark.parametrize("block_size", [4, 16])
def test_stop_tokens_inside_accepted_block(qwen3_pair, block_size):
    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    ref = reference(model, prompt)
    oracle = ScriptedDraft(draft, prompt + ref, VOCAB)
    # Stop on a token deep inside the first fully accepted block, and on a later one.
    for stop_index in (3, 2 * block_size + 1):
        stop = {ref[stop_index]}
        expected = _truncate_at_stop(ref, stop)
        for drafter in (oracle, draft):
            out, cycles = run(model, drafter, prompt, block_size=block_size, max_tokens=MAX_REF, stop_tokens=stop)
            assert out == expected
            assert out[-1] in stop


def test_stop_on_first_token(qwen3_pair):
    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    first = reference(model, prompt, 1)
    out, cycles = run(model, draft, prompt, stop_tokens={first[0]})
    assert out == first and len(cycles) == 1


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_cache_offsets_track_committed_tokens(qwen3_pair, wrong_every):
    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    ref = reference(model, prompt)
    oracle = ScriptedDraft(draft, prompt + ref, VOCAB, wrong_every=wrong_every)
    cache = make_cache(model, oracle)
    emitted = 0
    for step in dflash_generate_step(prompt, model, oracle, LoopOptions(max_tokens=100), prompt_cache=cache):
        emitted += len(step.tokens)
        committed = len(prompt) + emitted - 1  # the newest token is not yet run through the target
        assert len(cache.tokens) == committed
        # Between plain cycles the next plain step may already be queued (mlx-lm's pipelining).
        ahead = cache.offset - committed
        assert ahead in (0, 1) and (ahead == 0 or step.num_draft == 0)
        assert all(c.offset == committed + ahead for c in cache.target)
        assert cache.draft_offset + cache.pending_length == committed
        assert all(c.offset == cache.draft_offset for c in cache.draft)
    assert cache.offset == committed  # taken back at the end
    assert cache.tokens == (prompt + ref)[:committed]


def test_plain_decoding_without_drafter(tiny_pair):
    model, _, _ = tiny_pair
    prompt = _prompt(7)
    out, cycles = run(model, None, prompt, max_tokens=50)
    assert out == reference(model, prompt, 50)
    assert all(s.num_draft == 0 for s in cycles)


def test_plain_decoding_queues_each_step_before_reading_the_last(qwen3_pair, monkeypatch):
    # mlx-lm's generate_step overlaps the next step with the host; ours must too: when the
    # caller gets a token, the step after it is already queued.
    from dflash_mlx.loop.verify import Verifier

    model, _, _ = qwen3_pair
    calls = []
    real = Verifier._queue
    monkeypatch.setattr(Verifier, "_queue", lambda self, *a: calls.append(1) or real(self, *a))
    steps = dflash_generate_step(_prompt(7), model, None, LoopOptions(max_tokens=5))
    seen = [len(calls) for _ in steps]
    # The prefill's token (no step), then each token with the step after it queued, but none
    # past the budget.
    assert seen == [0, 2, 3, 4, 4]


@pytest.mark.parametrize("stop_at", [0, 3, 9])
def test_plain_decoding_stop_and_next_turn(qwen3_pair, stop_at):
    # A step queued past a stop token is taken back: the cache holds what the loop emitted
    # (all but its last token) and the next turn continues exactly.
    model, _, _ = qwen3_pair
    prompt = _prompt(11)
    ref = reference(model, prompt, 40)
    cache = make_cache(model, None)
    out, _ = run(model, None, prompt, max_tokens=40, prompt_cache=cache, stop_tokens={ref[stop_at]})
    assert out == _truncate_at_stop(ref, {ref[stop_at]})
    assert cache.tokens == (prompt + out)[:-1] and cache.offset == len(cache.tokens)
    follow = prompt + out + _prompt(4, seed=5)
    again, _ = run(model, None, follow, max_tokens=30, prompt_cache=cache)
    assert again == reference(model, follow, 30)


def test_plain_decoding_left_early_continues_exactly(qwen3_pair):
    model, _, _ = qwen3_pair
    prompt = _prompt(20)
    cache = make_cache(model, None)
    steps = dflash_generate_step(prompt, model, None, LoopOptions(max_tokens=60), prompt_cache=cache)
    taken = [t for _, step in zip(range(6), steps) for t in step.tokens]
    steps.close()
    assert cache.tokens == (prompt + taken)[:-1] and cache.offset == len(cache.tokens)
    follow = prompt + taken + _prompt(5, seed=9)
    again, _ = run(model, None, follow, max_tokens=30, prompt_cache=cache)
    assert again == reference(model, follow, 30)


def test_plain_decoding_with_logits_processors(qwen3_pair):
    # A queued step's processors see every token before it, the unread one included.
    model, _, _ = qwen3_pair
    prompt = _prompt(9)

    def two_back(tokens, logits):
        # Forces the token after the one two back: any token missing from ``tokens`` shows.
        return logits + 1e4 * (mx.arange(logits.shape[-1]) == (tokens[-2] + 1) % logits.shape[-1])

    processors = [two_back]
    out, _ = run(model, None, prompt, max_tokens=40, logits_processors=processors)
    steps = generate_step(mx.array(prompt), model, max_tokens=40, logits_processors=processors)
    assert out == [int(tok) for tok, _ in steps]


def test_block_size_one_with_drafter(qwen3_pair):
    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    out, cycles = run(model, draft, prompt, block_size=1, max_tokens=30)
    assert out == reference(model, prompt, 30)
    assert all(len(s.tokens) == 1 for s in cycles)


def test_prompt_cache_reuse_across_turns(qwen3_pair):
    model, draft, _ = qwen3_pair
    prompt = _prompt(20)
    cache = make_cache(model, draft)
    first, _ = run(model, draft, prompt, max_tokens=30, prompt_cache=cache)
    follow = prompt + first + _prompt(5, seed=9)
    second, _ = run(model, draft, follow, max_tokens=40, prompt_cache=cache)
    assert second == reference(model, follow, 40)
    # A prompt that diverges early is recomputed from the divergence point.
    other = prompt[:5] + _prompt(9, seed=11)
    third, _ = run(model, draft, other, max_tokens=40, prompt_cache=cache)
    assert third == reference(model, other, 40)


@pytest.mark.parametrize("lookup_fallback", [0, 4])
def test_prompt_cache_after_a_generation_left_early(qwen3_pair, lookup_fallback):
    # Each cycle starts the next drafter pass before handing out its tokens; a caller that
    # stops reading leaves that pass behind, and the cache must still continue exactly.
    model, draft, _ = qwen3_pair
    prompt = _prompt(20)
    cache = make_cache(model, draft)
    options = LoopOptions(max_tokens=60, lookup_fallback=lookup_fallback)
    steps = dflash_generate_step(prompt, model, draft, options, prompt_cache=cache)
    taken = [t for _, step in zip(range(4), steps) for t in step.tokens]
    steps.close()
    assert cache.tokens == (prompt + taken)[:-1]
    assert cache.draft_offset + cache.pending_length == len(cache.tokens) == cache.offset
    follow = prompt + taken + _prompt(5, seed=9)
    again, _ = run(model, draft, follow, max_tokens=40, prompt_cache=cache, lookup_fallback=lookup_fallback)
    assert again == reference(model, follow, 40)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer (got 0)"),
        ({"block_size": 17}, "block_size must be an integer from 1 to the drafter's trained block size 16 (got 17)"),
        ({"block_size": 0}, "(got 0)"),
        ({"min_confidence": 1.5}, "min_confidence must be a probability from 0 to 1 (got 1.5)"),
        ({"min_confidence": -0.1}, "(got -0.1)"),
        ({"lookup_fallback": -1}, "lookup_fallback must be a non-negative integer of cycles (got -1)"),
        ({"lookup_fallback": 2.5}, "(got 2.5)"),
        ({"kernels": "yes"}, "kernels must be one of auto, on, off (got 'yes')"),
    ],
)
def test_bad_arguments(qwen3_pair, kwargs, message):
    model, draft, _ = qwen3_pair
    with pytest.raises(DFlashError) as e:
        run(model, draft, [1, 2, 3], **kwargs)
    assert message in str(e.value)


@pytest.mark.skipif(on_metal(), reason="off Metal only: on a Mac kernels='on' runs the kernels")
def test_kernels_on_without_metal_is_an_error(qwen3_pair):
    model, draft, _ = qwen3_pair
    with pytest.raises(DFlashError, match="kernels 'on' needs a Metal device"):
        run(model, draft, [1, 2, 3], kernels="on")


@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_kernels_mode_reaches_the_acceptance_dispatcher(qwen3_pair, monkeypatch, kernels):
    from dflash_mlx.loop import verify

    model, draft, _ = qwen3_pair
    modes, twin = [], verify.greedy_accept.twin

    def recording(logits, drafts, mode="auto"):
        modes.append(mode)
        return twin(logits, drafts)

    prompt = _prompt(7)
    monkeypatch.setattr(verify, "greedy_accept", recording)
    out, _ = run(model, draft, prompt, block_size=8, max_tokens=20, adaptive=False, kernels=kernels)
    assert out == reference(model, prompt, 20) and modes and set(modes) == {kernels}


def test_empty_prompt(qwen3_pair):
    model, draft, _ = qwen3_pair
    with pytest.raises(DFlashError, match="The prompt is empty"):
        run(model, draft, [])


def test_block_size_without_drafter(qwen3_pair):
    model, _, _ = qwen3_pair
    with pytest.raises(DFlashError, match="block_size=4 needs a drafter"):
        run(model, None, [1, 2], block_size=4)


def test_runs_on_another_thread(qwen3_pair):
    """The generation stream is thread-local, so a worker thread (the chat app's) can drive the loop."""
    import threading

    model, draft, _ = qwen3_pair
    prompt = _prompt(7)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", run(model, draft, prompt, max_tokens=40)[0]))
    thread.start()
    thread.join()
    assert result["out"] == reference(model, prompt, 40)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_a_seed_mlx_cannot_take_is_one_line(qwen3_pair, seed):
    model, draft, tokenizer = qwen3_pair
    with pytest.raises(DFlashError, match=r"seed must be an integer from 0 to 18446744073709551615"):
        list(stream_generate(model, draft, tokenizer, [1, 2, 3], max_tokens=2, seed=seed))


def test_generation_runs_under_mlx_lm_wired_limit_and_prefill_frees_chunks(qwen3_pair, monkeypatch):
    # On a Mac, mlx-lm keeps the weights wired while it generates and frees each prefill
    # chunk's buffers; the same calls run here (no-ops or cheap on a CPU).
    import contextlib
    import importlib

    gen_mod = importlib.import_module("dflash_mlx.generation")

    model, draft, tokenizer = qwen3_pair
    entered, cleared = [], []

    @contextlib.contextmanager
    def wired(m, streams):
        entered.append(m)
        yield

    monkeypatch.setattr(gen_mod, "wired_limit", wired)
    real_clear = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1) or real_clear())
    list(stream_generate(model, draft, tokenizer, _prompt(20), max_tokens=5, prefill_step_size=8))
    assert entered == [model]
    assert len(cleared) == 2  # between the 3 chunks of 20 prompt tokens, not after the last
