"""Parity of the MLX port with the PyTorch reference and with transformers, in fp32.

Both sides load the same checkpoint folders (tests/helpers/checkpoints.py; the MoE and hybrid targets
from tests/helpers/hf_checkpoints.py, written by transformers' own classes). The reference runs on CUDA
when available, else on CPU; MLX runs on its default device.
"""

import ast
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mlx.core as mx  # noqa: E402
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB, write_draft  # noqa: E402
from helpers.hf_checkpoints import write_hf_target  # noqa: E402
from helpers.oracles import ScriptedDraft  # noqa: E402
from helpers.torch_oracles import ScriptedReferenceDraft, train_agreeing_draft  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DynamicCache, GenerationConfig  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load, make_cache  # noqa: E402
from dflash_mlx.models import target as tgt  # noqa: E402
from dflash_mlx.reference import default_device, forward_with_taps, load_draft, load_reference, reference_generate  # noqa: E402

DEVICE = default_device()
ATOL = 1e-4
DENSE = ["qwen3-tied", "qwen3-untied", "llama"]
# A MoE target, hybrid ones (Qwen3.5's layout and Qwen3-Next's) whose recurrent state the
# reference loop rolls back its own way, gpt-oss (sliding-window layers, a window shorter than
# the prompts; MXFP4 experts) and Kimi K2.5 (latent attention; its experts unpacked, as transformers
# reads compressed-tensors' INT4 only with that package).
KINDS = DENSE + ["qwen3_moe", "qwen3_5", "qwen3_next", "gpt_oss", "kimi_k25"]
# Each kind end to end at one block size in one test and at the other in the next (the loop's
# code does not depend on the kind and the block size together), which halves those tests.
ALTERNATE_BLOCKS = [(kind, (4, 16)[i % 2]) for i, kind in enumerate(KINDS)]
HF = ("qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "kimi_k25")
MAX_TOKENS = 48


@pytest.fixture(scope="module", autouse=True)
def _torch_settings():
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    # Tiny models: extra CPU threads only contend; and no TF32 on CUDA, parity is in true fp32.
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(precision)


@pytest.fixture(scope="module")
def dirs(pair_dirs, tmp_path_factory):
    """conftest's folders, plus a drafter made for blocks of 4 and drafters fitted to each target."""
    root = tmp_path_factory.mktemp("parity")
    write_draft(root / "draft4", block_size=4)
    for kind in HF:
        write_hf_target(root / kind, kind, int4=False)
    hf = {kind: root / kind for kind in HF}
    return {**pair_dirs, **hf, "draft16": pair_dirs["draft"], "draft4": root / "draft4", "root": root}


@pytest.fixture(scope="module")
def pairs(dirs):
    """``pairs(kind, draft) -> (model, mlx_draft, target, ref_draft)``, each loaded once."""
    loaded = {}

    def get(kind: str, draft: str = "draft16"):
        if (kind, draft) not in loaded:
            model, mlx_draft, _ = load(dirs[kind], dirs[draft])
            target, ref_draft, _ = load_reference(dirs[kind], dirs[draft], device=DEVICE)
            loaded[kind, draft] = model, mlx_draft, target, ref_draft
        return loaded[kind, draft]

    return get


@pytest.fixture(scope="module")
def trained(dirs, pairs):
    """``trained(kind)``: ``pairs`` with a drafter fitted (in PyTorch) to the target's greedy text,
    so that it agrees often; saved in the z-lab format and loaded back by both sides."""

    def get(kind: str):
        name = f"trained-{kind}"
        if name not in dirs:
            model, _, target, _ = pairs(kind)
            prompt = _prompt(9)
            # The target's greedy text, decoded by mlx-lm: a plain PyTorch loop takes far longer on the
            # hybrid targets, and only how well the drafter fits depends on these tokens.
            sequence = prompt + [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=100)]
            fitted = train_agreeing_draft(load_draft(dirs["draft16"], device=DEVICE), target, sequence, steps=40)
            path = dirs["root"] / name
            path.mkdir()
            weights = {k: v.detach().cpu().contiguous() for k, v in fitted.state_dict().items()}
            save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
            (path / "config.json").write_text((dirs["draft16"] / "config.json").read_text())
            dirs[name] = path
        return pairs(kind, name)

    return get


def _prompt(length: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB - 4, length).tolist()


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.array(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float32)


def _max_diff(a, b) -> float:
    return float(np.abs(_numpy(a) - _numpy(b)).max())


def _scaled_diff(a, b) -> float:
    # Relative to b's largest entry where that exceeds 1: the MoE and hybrid targets' hidden
    # states reach tens (their weights are scaled up so that greedy text varies).
    return _max_diff(a, b) / max(1.0, float(np.abs(_numpy(b)).max()))


def _tensor(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), device=DEVICE)


# (target, tokens) by (id(target), prompt, max_tokens, stop); the target is kept so that its id is not reused.
_HF_GREEDY: dict = {}


def _hf_greedy(target, prompt: list[int], max_tokens: int, stop: int | None = None, **kwargs) -> list[int]:
    """transformers' own greedy ``generate``, stopping only on ``stop``; without other arguments,
    generated once per target, prompt and length (several tests check against the same text)."""
    if kwargs:
        return _hf_generate(target, prompt, max_tokens, stop, **kwargs)
    key = (id(target), tuple(prompt), max_tokens, stop)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = target, _hf_generate(target, prompt, max_tokens, stop)
    return list(_HF_GREEDY[key][1])


def _hf_generate(target, prompt: list[int], max_tokens: int, stop: int | None = None, **kwargs) -> list[int]:
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        # [] stops on nothing; None would stop on the model's own EOS (the HF targets have one).
        eos_token_id=[] if stop is None else stop,
        pad_token_id=0,
        **kwargs.pop("config", {}),
    )
    out = target.generate(_tensor([prompt]), generation_config=config, **kwargs)
    return out[0, len(prompt) :].tolist()


def _mlx_steps(prompt, model, draft, **kwargs) -> list[tuple]:
    # Every cycle drafted, as in the reference loop; the steps' first three fields are compared.
    steps = dflash_generate_step(prompt, model, draft, LoopOptions(adaptive=False, **kwargs))
    return [tuple(step)[:3] for step in steps]


def _ref_steps(prompt, target, draft, **kwargs) -> list[tuple]:
    return [tuple(step)[:3] for step in reference_generate(prompt, target, draft, **kwargs).steps]


# --- drafter and target parity ---------------------------------------------------------------


@pytest.mark.parametrize("kind", DENSE)  # the target lends the drafter only its embedding and head
@pytest.mark.parametrize("block_size", [4, 16])
def test_drafter_logits_match(pairs, kind, block_size, record_property):
    model, draft, target, ref = pairs(kind, f"draft{block_size}")
    assert draft.block_size == ref.block_size == block_size
    width = len(draft.target_layer_ids) * HIDDEN
    rng = np.random.default_rng(block_size)
    mx_cache, pt_cache = make_cache(model, draft).draft, ref.make_cache()
    seen, worst = [], 0.0
    # An empty context cache, then one context chunk, then several more.
    for chunk in (0, 7, 1, 5, 12):
        taps = (2 * rng.standard_normal((1, chunk, width))).astype(np.float32)
        seen.append(taps)
        block = [[int(rng.integers(VOCAB - 4))] + [MASK_ID] * (block_size - 1)]
        a = draft.propose(model, mx.array(block), mx.array(taps) if chunk else None, mx_cache)
        b = ref.propose(target, _tensor(block), _tensor(taps) if chunk else None, pt_cache)
        assert a.shape == tuple(b.shape) == (1, block_size - 1, VOCAB)
        diff = _max_diff(a, b)
        assert diff <= ATOL, f"context {sum(t.shape[1] for t in seen)}: max |diff| {diff}"
        assert mx_cache[0].offset == pt_cache[0].offset == sum(t.shape[1] for t in seen)
        worst = max(worst, diff)

    # Without a cache, the whole context at once: the block sits right after it in both.
    taps = np.concatenate(seen, axis=1)
    a = draft(tgt.embed(model, mx.array(block)), mx.array(taps))
    with torch.no_grad():
        b = ref(target.get_input_embeddings()(_tensor(block)), _tensor(taps))
    worst = max(worst, _max_diff(a, b))
    assert _max_diff(a, b) <= ATOL
    record_property("max_abs_diff", worst)


@pytest.mark.parametrize("kind", KINDS)
def test_taps_match_hidden_states(pairs, kind, record_property):
    model, draft, target, _ = pairs(kind)
    n = tgt.num_layers(model)
    prompt, more = _prompt(13), _prompt(4, seed=5)
    # MLX in two calls, so the second runs at cached positions 13..16.
    cache = make_prompt_cache(model)
    chunks = [tgt.forward_with_taps(model, mx.array([ids]), cache, list(range(n))) for ids in (prompt, more)]
    logits = mx.concatenate([c[0] for c in chunks], axis=1)
    taps = mx.concatenate([c[1] for c in chunks], axis=1).reshape(1, len(prompt) + len(more), n, HIDDEN)
    with torch.no_grad():
        out = target(_tensor([prompt + more]), output_hidden_states=True)

    # Every tap, the last one included (transformers norms it, and so does forward_with_taps).
    diffs = [_scaled_diff(taps[:, :, i], out.hidden_states[i + 1]) for i in range(n)]
    diffs.append(_scaled_diff(logits, out.logits))
    assert max(diffs) <= ATOL, diffs

    # The reference's own taps, also in two calls with a cache, for the drafter's tap ids.
    ids = draft.target_layer_ids
    pt_cache = DynamicCache(config=target.config)
    pt = [forward_with_taps(target, _tensor([c]), pt_cache, ids)[1] for c in (prompt, more)]
    mx_cache = make_prompt_cache(model)
    ml = [tgt.forward_with_taps(model, mx.array([c]), mx_cache, ids)[1] for c in (prompt, more)]
    diffs += [_scaled_diff(a, b) for a, b in zip(ml, pt)]
    assert max(diffs) <= ATOL, diffs
    record_property("max_abs_diff", max(diffs))


# --- end to end at temperature 0 -------------------------------------------------------------


@pytest.mark.parametrize("kind, block_size", ALTERNATE_BLOCKS)
def test_end_to_end_random_drafter(pairs, kind, block_size):
    model, draft, target, ref = pairs(kind, f"draft{block_size}")
    prompt = _prompt(9)
    expected = _hf_greedy(target, prompt, MAX_TOKENS)
    for max_tokens in (1, block_size + 1, MAX_TOKENS):
        steps = _mlx_steps(prompt, model, draft, max_tokens=max_tokens)
        assert steps == _ref_steps(prompt, target, ref, max_tokens=max_tokens), max_tokens
        assert [t for s in steps for t in s[0]] == expected[:max_tokens]


@pytest.mark.parametrize("kind", KINDS)
def test_end_to_end_without_drafter(pairs, kind):
    model, _, target, _ = pairs(kind)
    prompt = _prompt(9)
    steps = _mlx_steps(prompt, model, None, max_tokens=MAX_TOKENS)
    assert steps == _ref_steps(prompt, target, None, max_tokens=MAX_TOKENS)
    assert [t for s in steps for t in s[0]] == _hf_greedy(target, prompt, MAX_TOKENS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wrong_every", [0, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_end_to_end_scripted_drafters(pairs, kind, wrong_every, block_size):
    model, draft, target, ref = pairs(kind)
    prompt = _prompt(9)
    expected = _hf_greedy(target, prompt, MAX_TOKENS)
    mlx_oracle = ScriptedDraft(draft, prompt + expected, VOCAB, wrong_every=wrong_every)
    ref_oracle = ScriptedReferenceDraft(ref, prompt + expected, VOCAB, wrong_every=wrong_every)
    kwargs = dict(max_tokens=MAX_TOKENS, block_size=block_size)
    steps = _mlx_steps(prompt, model, mlx_oracle, **kwargs)
    assert steps == _ref_steps(prompt, target, ref_oracle, **kwargs)
    assert [t for s in steps for t in s[0]] == expected
    lengths = [s[1] + 1 for s in steps[1:]]
    if wrong_every:
        assert 1 < max(lengths) and min(lengths) < block_size
    else:
        assert max(lengths) == block_size


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_end_to_end_stop_token_mid_block(pairs, kind, block_size):
    model, draft, target, ref = pairs(kind)
    prompt = _prompt(9)
    expected = _hf_greedy(target, prompt, MAX_TOKENS)
    index = block_size + block_size // 2  # inside the second block, fully accepted by the oracle
    stop = expected[index]
    truncated = expected[: expected.index(stop) + 1]
    assert _hf_greedy(target, prompt, MAX_TOKENS, stop=stop) == truncated
    mlx_oracle = ScriptedDraft(draft, prompt + expected, VOCAB)
    ref_oracle = ScriptedReferenceDraft(ref, prompt + expected, VOCAB)
    kwargs = dict(max_tokens=MAX_TOKENS, block_size=block_size, stop_tokens={stop})
    steps = _mlx_steps(prompt, model, mlx_oracle, **kwargs)
    assert steps == _ref_steps(prompt, target, ref_oracle, **kwargs)
    assert [t for s in steps for t in s[0]] == truncated


# The other block size for each kind than the random drafter's; the hybrid MoE too, at both.
@pytest.mark.parametrize(
    "kind, block_size", [(k, 20 - b) for k, b in ALTERNATE_BLOCKS] + [("qwen3_5_moe", 4), ("qwen3_5_moe", 16)]
)
def test_end_to_end_trained_drafter(trained, kind, block_size, record_property):
    model, draft, target, ref = trained(kind)
    prompt = _prompt(9)
    expected = _hf_greedy(target, prompt, MAX_TOKENS)
    for max_tokens in (block_size + 1, MAX_TOKENS):
        kwargs = dict(max_tokens=max_tokens, block_size=block_size)
        reference_steps = _ref_steps(prompt, target, ref, **kwargs)
        # A prefill in chunks of 4 hands the drafter its first context in several pieces (the
        # reference prefills whole either way, so its steps are run once for both).
        for chunk in (512, 4) if max_tokens == MAX_TOKENS else (512,):
            steps = _mlx_steps(prompt, model, draft, prefill_step_size=chunk, **kwargs)
            assert steps == reference_steps, chunk
            assert [t for s in steps for t in s[0]] == expected[:max_tokens]
    # The real drafter network agrees often, so acceptance lengths > 1 are compared.
    lengths = [s[1] + 1 for s in steps[1:]]
    assert max(lengths) > 1
    record_property("acceptance_lengths", lengths)


# --- transformers' own DFlash ----------------------------------------------------------------


def _transformers_drafter(ref):
    """Our drafter's weights in transformers' DFlash drafter class, or a skip saying why not."""
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
        from transformers.generation import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        pytest.skip(
            f"transformers {transformers.__version__} has no DFlash drafter model "
            "(MuseGlimmerAssistantModel + speculation_type='dflash'), so it cannot run our pair."
        )
    a = ref.args
    config = MuseGlimmerAssistantConfig(
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        layer_types=["full_attention"] * a.num_hidden_layers,
        block_size=a.block_size,
        mask_token_id=a.mask_token_id,
        target_layer_ids=a.target_layer_ids,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    # Same layers and names, except that fc + hidden_norm live under "encoder" there.
    renames = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model = MuseGlimmerAssistantModel(config)
    model.load_state_dict({renames.get(k, k): v for k, v in ref.state_dict().items()}, strict=True)
    return model.to(DEVICE).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_dflash_matches(trained, kind, record_property):
    model, draft, target, ref = trained(kind)
    assistant = _transformers_drafter(ref)

    # One drafter pass on the same context and block: transformers' block states vs ours.
    rng = np.random.default_rng(0)
    taps = _tensor((2 * rng.standard_normal((1, 11, len(ref.target_layer_ids) * HIDDEN))).astype(np.float32))
    noise = target.get_input_embeddings()(_tensor([[5] + [MASK_ID] * (ref.block_size - 1)]))
    with torch.no_grad():
        ours = ref(noise, taps)
        states = assistant(noise_embeds=noise, context_hidden_states=taps).last_hidden_state
    mlx_states = draft(mx.array(_numpy(noise)), mx.array(_numpy(taps)))
    diffs = [_max_diff(states, ours), _max_diff(mlx_states, states)]
    assert max(diffs) <= ATOL, diffs

    # Greedy generation: transformers' DFlash loop gives our tokens, cycle for cycle. The target
    # cache length at each target call tells how many tokens each cycle committed.
    committed = []

    def _record(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        cache = kwargs.get("cache") if cache is None else cache
        # int(): a linear attention layer's length is a tensor that the cache updates in place.
        committed.append(0 if cache is None else int(cache.get_seq_length()))

    prompt = _prompt(9)
    handle = target.register_forward_pre_hook(_record, with_kwargs=True)
    try:
        theirs = _hf_greedy(
            target, prompt, MAX_TOKENS, config={"speculation_type": "dflash"}, assistant_model=assistant
        )
    except ValueError as e:
        # Its loop crops the target's cache, which a recurrent state could not do before transformers
        # 5.25; from 5.25 this test compares its tokens and cycles to ours on the hybrid targets too.
        if "stateful" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} runs no DFlash on a hybrid target: {e}")
    finally:
        handle.remove()
    result = reference_generate(prompt, target, ref, max_tokens=MAX_TOKENS)
    mlx_tokens = [t for s in _mlx_steps(prompt, model, draft, max_tokens=MAX_TOKENS) for t in s[0]]
    assert theirs == result.tokens == mlx_tokens
    # Compare the cycles where we drafted a full block (transformers drafts full blocks to the end).
    full = [s.num_draft == ref.block_size - 1 for s in result.steps[1:]]
    n = full.index(False) if False in full else len(full)
    their_lengths = np.diff(committed[1:]).tolist()
    assert their_lengths[:n] == result.acceptance_lengths[:n]
    assert max(result.acceptance_lengths[:n]) > 1
    record_property("max_abs_diff", max(diffs))


# --- the authors' DDTree loop ----------------------------------------------------------------


@pytest.mark.parametrize("budget", [4, 16])
def test_ddtree_matches_the_authors_loop(dirs, trained, monkeypatch, budget):
    """Our draft trees (node tokens and parents) and acceptance lengths, cycle for cycle, equal those of
    ``ddtree_generate`` in the authors' ddtree.py (github.com/liranringel/ddtree) with the same fitted
    drafter in their drafter class. It is on no package index: this runs where it is on PYTHONPATH."""
    ddtree = pytest.importorskip("ddtree", reason="the authors' ddtree.py is not on PyPI; put it on PYTHONPATH")
    from model import DFlashDraftModel  # their drafter class, beside ddtree.py

    from dflash_mlx.drafts import proposer

    class CropToLength(DynamicCache):
        # ddtree.py crops its caches to a length, as transformers 4 did; transformers 5 crops by a count.
        def crop(self, length):
            if length < self.get_seq_length():
                super().crop(length - self.get_seq_length())

    monkeypatch.setattr(ddtree, "DynamicCache", CropToLength)
    monkeypatch.setattr(ddtree, "cuda_time", time.perf_counter)  # its stage clock syncs CUDA
    model, draft, target, _ = trained("qwen3-tied")
    theirs = DFlashDraftModel.from_pretrained(dirs["trained-qwen3-tied"], dtype=torch.float32).to(DEVICE).eval()
    prompt = _prompt(9)
    # Past its buffer's end their last blocks are cut short: only the cycles before that are compared.
    result = ddtree.ddtree_generate(
        theirs, target, _tensor([prompt]), mask_token_id=draft.mask_token_id, max_new_tokens=2 * MAX_TOKENS,
        block_size=draft.block_size, stop_token_ids=None, temperature=0.0, tree_budget=budget, save_tree_traces=True,
    )  # fmt: skip
    trees = []
    build = proposer.build_tree
    monkeypatch.setattr(proposer, "build_tree", lambda *args: trees.append(build(*args)) or trees[-1])
    steps = _mlx_steps(prompt, model, draft, max_tokens=MAX_TOKENS, tree_budget=budget)
    assert [t for s in steps for t in s[0]] == result.output_ids[0, len(prompt) :].tolist()[:MAX_TOKENS]
    n = len(steps) - 2  # the last cycle is cut to max_tokens
    lengths = [s[1] + 1 for s in steps[1:]][:n]
    assert lengths == result.acceptance_lengths[:n]
    assert max(lengths) > 1
    theirs_trees = [(r["tree"]["node_token_ids"], r["tree"]["parents"]) for r in result.round_trees[:n]]
    assert [(t.tokens, t.parents) for t in trees[:n]] == theirs_trees


# --- the reference's own input checks --------------------------------------------------------


def test_reference_rejects_bad_input(dirs, pairs, tmp_path):
    _, _, target, ref = pairs("qwen3-tied")
    with pytest.raises(DFlashError, match="block_size must be an integer from 1 to .* 16 \\(got 17\\)"):
        reference_generate([1, 2], target, ref, block_size=17)
    with pytest.raises(DFlashError, match="max_tokens must be a positive integer \\(got 0\\)"):
        reference_generate([1, 2], target, ref, max_tokens=0)
    with pytest.raises(DFlashError, match="prompt is empty"):
        reference_generate([], target, ref)
    with pytest.raises(DFlashError, match="No config.json in"):
        load_reference(tmp_path, dirs["draft16"], device=DEVICE)

    # A later drafter variant with sliding layers is refused, not silently run as full attention.
    config = json.loads((dirs["draft16"] / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(dirs["draft16"] / "model.safetensors", tmp_path)
    with pytest.raises(DFlashError, match="full-attention DFlash drafters only"):
        load_draft(tmp_path, device=DEVICE)
    del config["layer_types"]
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="do not fit its config \\(size mismatch for layers"):
        load_draft(tmp_path, device=DEVICE)


def test_core_never_imports_torch():
    # mlx-lm pulls in transformers (and so torch, when installed), so check our own sources.
    root = Path(dflash_mlx.__file__).parent
    sources = [p for p in root.rglob("*.py") if "reference" not in p.relative_to(root).parts]
    offenders = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any("torch" in n.split(".") for n in names):  # torch itself or safetensors.torch
                offenders.append(f"{path.name}:{node.lineno}")
    assert len(sources) > 5 and not offenders, offenders
