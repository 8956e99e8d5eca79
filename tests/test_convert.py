import dataclasses
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers.checkpoints import MASK_ID, VOCAB, draft_config, write_draft, write_target
from mlx_lm.generate import generate_step

from dflash_mlx import DFlashError, LoopOptions, dflash_generate_step, load
from dflash_mlx.convert import convert, find_draft, find_pair, known_targets
from dflash_mlx.convert.convert import main
from dflash_mlx.convert.weights import normalized_config
from dflash_mlx.loading.pairs import PAIR_MANIFEST, default_pair_path

# The package re-exports convert(), which shadows the module of the same name.
convert_mod = importlib.import_module("dflash_mlx.convert.convert")
NUM_TOKENS = 40
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """HF-format folders: a qwen3 target, its drafter, and a few wrong ones."""
    root = tmp_path_factory.mktemp("hf")
    write_target(root / "target")
    write_draft(root / "draft")
    write_draft(root / "draft-8-layers", num_target_layers=8, target_layer_ids=(1, 5))
    return root


def _prompt(n: int = 9) -> list[int]:
    return mx.random.randint(0, VOCAB - 4, (n,), key=mx.random.key(7)).tolist()


def _dflash(model, draft, prompt, n=NUM_TOKENS):
    out = []
    for step in dflash_generate_step(prompt, model, draft, LoopOptions(max_tokens=n)):
        out.extend(step.tokens)
    return out


def _target_only(model, prompt, n=NUM_TOKENS):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _leftovers(folder):
    """Hidden temporary or backup folders next to the destination."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _convert(hf, out, **kwargs):
    kwargs.setdefault("draft_hf_path", str(hf / "draft"))
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("check_tokens", 16)
    return convert(str(hf / "target"), str(out), **kwargs)


def test_convert_fp32_matches_hf_folders(hf, tmp_path):
    result = _convert(hf, tmp_path / "pair", dtype="float32")
    assert result.check.tokens_match and result.check.num_tokens == 16
    manifest = json.loads((tmp_path / "pair" / PAIR_MANIFEST).read_text())
    assert (manifest["target"], manifest["draft"], manifest["block_size"]) == ("target", "draft", 16)
    assert manifest["source"]["draft"] == str(hf / "draft")
    assert manifest["check"]["tokens_match"] is True

    model, draft, _ = load(tmp_path / "pair")
    ref_model, ref_draft, _ = load(hf / "target", hf / "draft")
    assert draft is not None and draft.target_layer_ids == ref_draft.target_layer_ids
    prompt = _prompt()
    expected = _target_only(ref_model, prompt)
    assert _target_only(model, prompt) == expected
    assert _dflash(model, draft, prompt) == _dflash(ref_model, ref_draft, prompt) == expected
    assert _leftovers(tmp_path) == []


def test_convert_bf16_matches_hf_folders_cast(hf, tmp_path):
    _convert(hf, tmp_path / "pair", dtype="bfloat16", check=False)
    # Stored in bf16; load() would compute in float32 on a CPU by default, so ask for the stored dtype.
    model, draft, _ = load(tmp_path / "pair", dtype="bfloat16")
    stored = mx.load(str(tmp_path / "pair" / "target" / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for k, v in stored.items() if k.endswith("weight"))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert draft.fc.weight.dtype == mx.bfloat16
    config = json.loads((tmp_path / "pair" / "draft" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    ref_model, ref_draft, _ = load(hf / "target", hf / "draft", dtype="bfloat16")
    prompt = _prompt()
    assert _dflash(model, draft, prompt) == _dflash(ref_model, ref_draft, prompt)
    assert _target_only(model, prompt) == _target_only(ref_model, prompt)


@pytest.mark.parametrize("q_bits,draft_q_bits", [(8, None), (4, None), (None, 8), (4, 4)])
def test_convert_quantized_is_lossless(hf, tmp_path, q_bits, draft_q_bits):
    result = _convert(hf, tmp_path / "pair", quantize=q_bits is not None, q_bits=q_bits, draft_q_bits=draft_q_bits)
    assert result.check.tokens_match
    model, draft, _ = load(tmp_path / "pair")
    attn, draft_attn = model.model.layers[0].self_attn, draft.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) == (q_bits is not None)
    assert isinstance(draft_attn.q_proj, nn.QuantizedLinear) == (draft_q_bits is not None)
    if q_bits is not None:
        assert attn.q_proj.bits == q_bits
    if draft_q_bits is not None:
        assert draft_attn.q_proj.bits == draft.fc.bits == draft_q_bits
    manifest = json.loads((tmp_path / "pair" / PAIR_MANIFEST).read_text())
    assert (manifest["quantization"]["target"] or {}).get("bits") == q_bits
    assert (manifest["quantization"]["draft"] or {}).get("bits") == draft_q_bits
    # Lossless against the quantized target itself.
    prompt = _prompt()
    assert _dflash(model, draft, prompt) == _target_only(model, prompt)
    if q_bits is not None:
        ref_model, _, _ = load(hf / "target")
        # The quantized target really is another model: its logits moved.
        x = mx.array([prompt])
        assert not mx.allclose(model(x), ref_model(x), atol=1e-4)


def test_quantized_drafter_converts_again_as_it_is(hf, tmp_path):
    _convert(hf, tmp_path / "q8", draft_q_bits=8, check=False)
    source = str(tmp_path / "q8" / "draft")
    result = _convert(hf, tmp_path / "pair", draft_hf_path=source)
    assert result.check.tokens_match
    draft = load(tmp_path / "pair")[1]
    assert draft.fc.bits == 8
    assert mx.array_equal(draft.fc.weight, load(tmp_path / "q8")[1].fc.weight)
    with pytest.raises(DFlashError, match="is already quantized; drop --draft-q-bits"):
        _convert(hf, tmp_path / "again", draft_hf_path=source, draft_q_bits=4)


def test_drafter_config_is_normalized_keeping_original_fields(hf, tmp_path):
    # A top-level layout without mask_token_id: the tokenizer's mask token gets written.
    src = tmp_path / "flat-draft"
    write_draft(src, nested=False)
    config = json.loads((src / "config.json").read_text())
    del config["mask_token_id"]
    (src / "config.json").write_text(json.dumps(config))
    _convert(hf, tmp_path / "pair", draft_hf_path=str(src), check=False)
    out = json.loads((tmp_path / "pair" / "draft" / "config.json").read_text())
    assert out["mask_token_id"] == out["dflash_config"]["mask_token_id"] == MASK_ID
    assert out["target_layer_ids"] == out["dflash_config"]["target_layer_ids"] == [1, 2]
    assert out["rope_parameters"] == config["rope_parameters"] and out["rope_theta"] == 10000.0
    assert out["architectures"] == ["DFlashDraftModel"] and out["auto_map"] == config["auto_map"]
    assert "quantization" not in out


def test_normalized_config_fills_nested_and_quantization(hf):
    _, draft, _ = load(hf / "target", hf / "draft")
    source = draft_config()
    out = normalized_config(source, draft, dtype="float16", quantization={"group_size": 64, "bits": 4})
    assert out["dflash_config"]["block_size"] == out["block_size"] == 16
    assert out["quantization"] == out["quantization_config"] == {"group_size": 64, "bits": 4}
    assert out["torch_dtype"] == "float16"
    assert source["torch_dtype"] == "float32" and "block_size" not in source["dflash_config"]


def _write_hub_cache(root, repo_id, src):
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    shutil.copytree(src, repo / "snapshots" / REV)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)


@pytest.fixture
def hub_cache(hf, tmp_path, monkeypatch):
    """An offline Hugging Face cache holding a known target and its official drafter."""
    cache = tmp_path / "hub"
    _write_hub_cache(cache, "Qwen/Qwen3-4B", hf / "target")
    _write_hub_cache(cache, "z-lab/Qwen3-4B-DFlash-b16", hf / "draft")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads both once, at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_convert_known_hub_target_without_drafter(hub_cache, tmp_path):
    result = convert("Qwen/Qwen3-4B", str(tmp_path / "pair"), verbose=False, check_tokens=8)
    assert result.draft == "z-lab/Qwen3-4B-DFlash-b16" and result.check.tokens_match
    manifest = json.loads((tmp_path / "pair" / PAIR_MANIFEST).read_text())
    assert manifest["source"] == {
        "target": "Qwen/Qwen3-4B",
        "draft": "z-lab/Qwen3-4B-DFlash-b16",
        "revision": None,
    }


def test_convert_known_mlx_community_target(hf, hub_cache, tmp_path):
    # An already quantized MLX conversion of a known target, as published by mlx-community.
    _convert(hf, tmp_path / "q4", quantize=True, q_bits=4, check=False)
    _write_hub_cache(hub_cache, "mlx-community/Qwen3-4B-4bit", tmp_path / "q4" / "target")
    result = convert("mlx-community/Qwen3-4B-4bit", str(tmp_path / "pair"), verbose=False, check_tokens=8)
    assert result.draft == "z-lab/Qwen3-4B-DFlash-b16" and result.check.tokens_match
    model, draft, _ = load(tmp_path / "pair")
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear) and draft is not None
    with pytest.raises(DFlashError, match="is already quantized; drop -q/--quantize"):
        convert("mlx-community/Qwen3-4B-4bit", str(tmp_path / "again"), quantize=True, verbose=False)
    assert load("mlx-community/Qwen3-4B-4bit", draft="auto")[1] is not None


def test_load_draft_auto_from_hub_cache(hub_cache):
    model, draft, _ = load("Qwen/Qwen3-4B", draft="auto")
    assert draft is not None
    # Without "auto" a plain target still means plain decoding.
    assert load("Qwen/Qwen3-4B")[1] is None
    snapshot = hub_cache / "models--Qwen--Qwen3-4B" / "snapshots" / REV
    assert load(snapshot, draft="auto")[1] is not None
    # A known target whose drafter is not in the offline cache fails through the hub client, in one line.
    _write_hub_cache(hub_cache, "Qwen/Qwen3-8B", snapshot)
    with pytest.raises(DFlashError, match="Could not get the drafter 'z-lab/Qwen3-8B-DFlash-b16' from the"):
        load("Qwen/Qwen3-8B", draft="auto")


def test_load_pair_folder(hf, tmp_path):
    _convert(hf, tmp_path / "pair", check=False)
    pair = tmp_path / "pair"
    assert load(pair)[1] is not None and load(pair, draft="auto")[1] is not None
    # An explicit drafter overrides the pair's; a pair folder as drafter gives its drafter.
    other = tmp_path / "other-draft"
    write_draft(other, seed=5)
    explicit = load(pair, draft=other)[1]
    assert mx.array_equal(explicit.fc.weight, load(hf / "target", other)[1].fc.weight)
    assert mx.array_equal(load(hf / "target", pair)[1].fc.weight, load(pair)[1].fc.weight)


def test_load_pair_folder_bad_manifest(hf, tmp_path):
    _convert(hf, tmp_path / "pair", check=False)
    manifest = tmp_path / "pair" / PAIR_MANIFEST
    manifest.write_text(json.dumps({"target": "target", "draft": "missing"}))
    with pytest.raises(DFlashError, match="incomplete: its draft folder 'missing' is missing"):
        load(tmp_path / "pair")
    manifest.write_text(json.dumps({"target": "../elsewhere", "draft": "draft"}))
    with pytest.raises(DFlashError, match="does not name its target subfolder"):
        load(tmp_path / "pair")
    manifest.write_text("{not json")
    with pytest.raises(DFlashError, match="is not valid JSON"):
        load(tmp_path / "pair")


def test_load_auto_unknown_target(hf):
    with pytest.raises(DFlashError, match="No known DFlash drafter for the target .*--draft"):
        load(hf / "target", draft="auto")


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("fail_at", [1, 2], ids=["target-writer", "draft-writer"])
def test_interrupted_conversion_leaves_nothing(hf, tmp_path, monkeypatch, fail_at):
    real_save, calls = mx.save_safetensors, []

    def save(path, arrays, metadata=None):
        calls.append(path)
        if len(calls) == fail_at:
            # Die halfway through the file, as a crash or a full disk would.
            real_save(path, dict(list(arrays.items())[: len(arrays) // 2]), metadata=metadata)
            raise _Boom("disk full")
        real_save(path, arrays, metadata=metadata)

    monkeypatch.setattr(mx, "save_safetensors", save)
    with pytest.raises(_Boom):
        _convert(hf, tmp_path / "pair")
    assert len(calls) == fail_at
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _old_pair(hf, dest):
    """An earlier pair at ``dest``, marked so that a test sees whether it was replaced."""
    _convert(hf, dest, check=False)
    (dest / "draft" / "old.txt").write_text("old")
    return dest


def test_interrupt_during_check_keeps_old_folder(hf, tmp_path, monkeypatch):
    dest = _old_pair(hf, tmp_path / "pair")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_mod, "check_converted", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _convert(hf, dest, force=True)
    assert (dest / "draft" / "old.txt").read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_existing_destination_refused_then_forced(hf, tmp_path):
    dest = _old_pair(hf, tmp_path / "pair")
    with pytest.raises(DFlashError, match=r"pair already exists\. .*--force"):
        _convert(hf, dest)
    assert (dest / "draft" / "old.txt").read_text() == "old"
    _convert(hf, dest, force=True, check=False)
    assert sorted(p.name for p in dest.iterdir()) == [PAIR_MANIFEST, "draft", "target"]
    assert not (dest / "draft" / "old.txt").exists()
    assert _leftovers(tmp_path) == []
    assert load(dest)[1] is not None


def _no_conversion(*args, **kwargs):
    raise AssertionError("converted before checking --mlx-path")


@pytest.mark.parametrize(
    "kind", ["folder-of-files", "file", "current-folder", "parent-is-a-file", "stub-manifest", "pair-with-notes"]
)
def test_force_only_replaces_a_pair_folder(hf, tmp_path, monkeypatch, capsys, kind):
    """--force never deletes what dflash-convert did not write, and says so before converting."""
    docs = tmp_path / "mydocs"
    docs.mkdir()
    (docs / "notes.txt").write_text("mine")
    if kind == "stub-manifest":  # a dflash_pair.json that dflash-convert did not write
        (docs / PAIR_MANIFEST).write_text("{}")
    if kind == "pair-with-notes":  # a real pair, with the user's own file put in it
        old = _old_pair(hf, tmp_path / "old")
        for name in ("target", "draft"):
            shutil.copytree(old / name, docs / name)
        shutil.copy(tmp_path / "old" / PAIR_MANIFEST, docs / PAIR_MANIFEST)
        shutil.rmtree(tmp_path / "old")
    before = sorted(p.name for p in docs.iterdir())
    paths = {"folder-of-files": docs, "file": docs / "notes.txt", "current-folder": Path("."),
             "parent-is-a-file": docs / "notes.txt" / "pair", "stub-manifest": docs, "pair-with-notes": docs}  # fmt: skip
    monkeypatch.chdir(docs)
    monkeypatch.setattr(convert_mod, "mlx_lm_convert", _no_conversion)
    with pytest.raises(SystemExit) as e:
        main(["--hf-path", str(hf / "target"), "--draft", str(hf / "draft"), "--mlx-path", str(paths[kind]),
              "--force"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("dflash-convert: error: ") and "--mlx-path" in err and "\n" not in err
    assert "never replaced" in err or "current folder" in err or "is not a folder" in err
    assert sorted(p.name for p in docs.iterdir()) == before and (docs / "notes.txt").read_text() == "mine"
    assert _leftovers(tmp_path) == []


def _failed_check(*args, **kwargs):
    return convert_mod.CheckResult(False, 16, 3, 1.5, 0.1, 0.1)


def test_failed_check_keeps_the_old_pair(hf, tmp_path, monkeypatch, capsys):
    dest = _old_pair(hf, tmp_path / "pair")
    monkeypatch.setattr(convert_mod, "check_converted", _failed_check)
    with pytest.raises(DFlashError, match=r"failed its check .* from token 3\), so the pair in .* was kept\. "
                                          r"Pass --allow-failed-check"):  # fmt: skip
        _convert(hf, dest, force=True)
    assert (dest / "draft" / "old.txt").read_text() == "old" and _leftovers(tmp_path) == []
    # Asked for: the failed pair replaces the old one.
    _convert(hf, dest, force=True, allow_failed_check=True)
    assert not (dest / "draft" / "old.txt").exists()
    assert json.loads((dest / PAIR_MANIFEST).read_text())["check"]["tokens_match"] is False
    # Nothing to lose: a new folder gets the pair, with a warning that says it failed.
    main(["--hf-path", str(hf / "target"), "--draft", str(hf / "draft"), "--mlx-path", str(tmp_path / "new")])
    assert (tmp_path / "new" / PAIR_MANIFEST).is_file()
    assert "the pair was written, but it failed its check" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_leaves_nothing(hf, tmp_path, monkeypatch, capsys):
    def interrupted(hf_path, mlx_path, **kwargs):
        Path(mlx_path).mkdir(parents=True)
        (Path(mlx_path) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_mod, "mlx_lm_convert", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["--hf-path", str(hf / "target"), "--draft", str(hf / "draft"), "--mlx-path", str(tmp_path / "pair")])
    assert e.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dflash-convert: interrupted; nothing written"
    assert list(tmp_path.iterdir()) == []


def _broken_target(hf, tmp_path, kind):
    bad = tmp_path / kind
    shutil.copytree(hf / "target", bad)
    if kind == "no-layer-count":
        config = json.loads((bad / "config.json").read_text())
        del config["num_hidden_layers"]
        (bad / "config.json").write_text(json.dumps(config))
    else:
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    return bad


@pytest.mark.parametrize(
    "kind, message",
    [
        ("no-layer-count", r"config\.json lacks num_hidden_layers, which a qwen3 model needs"),
        ("truncated", r"Could not read .*incomplete download or corrupt file.*[Rr]e-download or re-convert the target"),
    ],
)
def test_broken_target_is_one_line_in_convert_and_generate(hf, tmp_path, capsys, kind, message):
    from dflash_mlx.tools.cli.generate import main as generate_main

    bad = _broken_target(hf, tmp_path, kind)
    runs = [
        (main, ["--hf-path", str(bad), "--draft", str(hf / "draft"), "--mlx-path", str(tmp_path / "out")]),
        (generate_main, ["--model", str(bad), "--prompt", "t1", "--max-tokens", "2"]),
    ]
    for tool, argv in runs:
        with pytest.raises(SystemExit) as e:
            tool(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1 and len(err[-1:]) == 1
        assert re.search(message, err[-1]) and err[-1].startswith(("dflash-convert: error:", "dflash-generate: error:"))
        assert not any(line.startswith("Traceback") for line in err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name,draft",
    [
        ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
        ("qwen/qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mlx-community/Qwen3-4B-4bit", "z-lab/Qwen3-4B-DFlash-b16"),
        ("mlx-community/Qwen3-8B-MLX-8bit", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mlx-community/Qwen3-8B-bf16", "z-lab/Qwen3-8B-DFlash-b16"),
        ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
        ("mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit-DWQ", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
        ("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
        ("mlx-community/Qwen3.5-35B-A3B-4bit", "z-lab/Qwen3.5-35B-A3B-DFlash"),
        ("Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash"),
        ("mlx-community/Qwen3-Coder-Next-4bit", "z-lab/Qwen3-Coder-Next-DFlash"),
        ("mlx-community/Qwen3-Coder-Next-mxfp4", "z-lab/Qwen3-Coder-Next-DFlash"),
        ("/cache/models--Qwen--Qwen3-Coder-Next/snapshots/abc123", "z-lab/Qwen3-Coder-Next-DFlash"),
        ("/cache/models--Qwen--Qwen3-4B/snapshots/abc123", "z-lab/Qwen3-4B-DFlash-b16"),
        # Fine-tunes and other sizes are different models.
        ("Qwen/Qwen3-4B-Instruct-2507", None),
        ("mlx-community/Qwen3-4B-Instruct-2507-4bit", None),
        ("mlx-community/Qwen3.5-27B-heretic-8bit", None),
        ("Qwen/Qwen3-14B", None),
        ("Qwen/Qwen3.5-4B-Base", None),
        # The base model, and an FP8 checkpoint mlx-lm cannot load (refused from its config).
        ("Qwen/Qwen3-Coder-Next-Base", None),
        ("Qwen/Qwen3-Coder-Next-FP8", None),
        ("./Qwen3-4B", None),
        ("/models/Qwen3-4B", None),
    ],
)
def test_registry_lookup(name, draft):
    assert find_draft(name) == draft


def test_registry_lists_the_official_pairs():
    targets = known_targets()
    for t in ("Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3.5-27B",
              "Qwen/Qwen3-Coder-Next"):  # fmt: skip
        assert t in targets
    assert len(set(targets)) == len(targets)
    # Every listed MLX conversion maps back to its own pair.
    for t in targets:
        pair = find_pair(t)
        assert pair.target == t and all(find_pair(m) is pair for m in pair.mlx_ids)


def test_help_smoke(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--hf-path", "--mlx-path", "--quantize", "--q-bits", "--q-group-size", "--dtype", "--draft"):
        assert flag in text
    for flag in ("--draft-q-bits", "--force", "--no-check", "--list"):
        assert flag in text


def test_help_of_the_console_script():
    script = shutil.which("dflash-convert", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the package is not installed with its console scripts")
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: dflash-convert" in out.stdout and out.stderr == ""


def test_list_known_pairs(capsys):
    main(["--list"])
    out = capsys.readouterr().out
    assert "Qwen/Qwen3-4B" in out and "z-lab/Qwen3-4B-DFlash-b16" in out
    # The default pair first: its drafter ships in the package.
    first = out.splitlines()[0]
    assert first.startswith("HuggingFaceTB/SmolLM2-135M-Instruct") and "-> smollm2 (the default pair;" in first
    # Named as a user passes it, never by this clone's or install's path.
    assert str(default_pair_path()) not in out and "/" not in first.split("->")[1]


def _bad_inputs(hf, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(hf / "target" / "config.json", no_weights / "config.json")
    return {
        "no-weights": (
            dict(hf_path=str(no_weights)),
            r"No \*\.safetensors weights in .*no-weights: the target",
        ),
        "not-a-model-folder": (
            dict(hf_path=str(empty)),
            r"No config\.json in .*empty: the target must be a model folder",
        ),
        "no-such-path": (
            dict(hf_path="./nowhere/at/all"),
            "neither an existing folder nor a Hugging Face id",
        ),
        "drafter-as-target": (
            dict(hf_path=str(hf / "draft")),
            r"holds a DFlash drafter, not a target model\. Pass it with --draft-hf-path",
        ),
        "target-as-drafter": (
            dict(draft_hf_path=str(hf / "target")),
            r"is not a DFlash drafter .*it looks like a target model",
        ),
        "mismatched-pair": (
            dict(draft_hf_path=str(hf / "draft-8-layers")),
            r"num_target_layers=8, but this target has 4 layers\. Pass the drafter trained for this target",
        ),
        "unknown-target": (dict(draft_hf_path=None), r"No known DFlash drafter for the target .*--draft"),
        "dtype": (
            dict(dtype="float64"),
            r"Unsupported dtype 'float64'; use one of float32, bfloat16, float16",
        ),
        "bits": (
            dict(quantize=True, q_bits=7),
            r"Unsupported target quantization bits=7; use one of 2, 3, 4, 5, 6, 8",
        ),
        "group-size": (dict(quantize=True, q_group_size=48), r"Unsupported quantization group size 48"),
        "draft-bits": (dict(draft_q_bits=3), r"Unsupported drafter quantization bits=3; use one of 4, 8"),
        "bits-without-q": (dict(q_bits=4), r"--q-bits/--q-group-size were given without -q/--quantize"),
        "check-tokens": (dict(check_tokens=0), r"--check-tokens must be a positive integer \(got 0\)"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "not-a-model-folder",
        "no-weights",
        "no-such-path",
        "drafter-as-target",
        "target-as-drafter",
        "mismatched-pair",
        "unknown-target",
        "dtype",
        "bits",
        "group-size",
        "draft-bits",
        "bits-without-q",
        "check-tokens",
    ],
)
def test_bad_input_messages(hf, tmp_path, case):
    kwargs, message = _bad_inputs(hf, tmp_path)[case]
    kwargs = {"hf_path": str(hf / "target"), "draft_hf_path": str(hf / "draft"), **kwargs}
    with pytest.raises(DFlashError, match=message) as e:
        convert(mlx_path=str(tmp_path / "out"), verbose=False, **kwargs)
    assert "\n" not in str(e.value)
    # Nothing was written: only the fixture's own folders are there.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "no-weights"]


def test_converted_pair_as_target_is_refused(hf, tmp_path):
    _convert(hf, tmp_path / "pair", check=False)
    with pytest.raises(DFlashError, match="already a converted DFlash pair"):
        convert(str(tmp_path / "pair"), str(tmp_path / "again"), verbose=False)


def test_cli_errors_are_one_line(hf, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hf-path", str(hf / "draft"), "--mlx-path", str(tmp_path / "out")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dflash-convert: error: ") and "holds a DFlash drafter, not a target model" in err
    with pytest.raises(SystemExit) as e:
        main(["--mlx-path", str(tmp_path / "out")])
    assert e.value.code == 2 and "--hf-path is required" in capsys.readouterr().err


def test_cli_converts_and_reports(hf, tmp_path, capsys):
    main(
        [
            "--hf-path",
            str(hf / "target"),
            "--draft",
            str(hf / "draft"),
            "--mlx-path",
            str(tmp_path / "pair"),
            "-q",
            "--q-bits",
            "8",
            "--check-tokens",
            "8",
        ]
    )
    captured = capsys.readouterr()
    assert "Wrote the DFlash pair to" in captured.out
    assert "Check: 8 greedy tokens, DFlash vs target-only identical" in captured.out
    # Progress goes to stderr, with the stages in order.
    assert captured.err.index("converting the target") < captured.err.index("converting the drafter")
    assert "6/6 done" in captured.err


def test_generate_cli_runs_a_pair_folder(hf, tmp_path, capsys):
    from dflash_mlx.tools.cli.generate import main as generate_main

    _convert(hf, tmp_path / "pair", check=False)
    generate_main(["--model", str(tmp_path / "pair"), "--prompt", "t1 t2 t3", "--max-tokens", "8"])
    assert "Acceptance length" in capsys.readouterr().out


def test_pair_folder_permissions_follow_umask(hf, tmp_path):
    _convert(hf, tmp_path / "pair", check=False)
    probe = tmp_path / "probe"
    probe.mkdir()
    assert (tmp_path / "pair").stat().st_mode == probe.stat().st_mode


def test_target_without_tokenizer_is_refused_before_converting(hf, tmp_path):
    """The error names the user's folder (not a temporary one) and comes before any conversion."""
    bare = tmp_path / "bare"
    shutil.copytree(hf / "target", bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    with pytest.raises(DFlashError, match=f"No usable tokenizer files in {re.escape(str(bare))} ") as e:
        convert(str(bare), str(tmp_path / "out"), draft_hf_path=str(hf / "draft"), verbose=False)
    assert ".partial" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]


def test_cli_prints_both_speeds_and_warns_when_dflash_is_slower(hf, tmp_path, capsys, monkeypatch):
    module = importlib.import_module("dflash_mlx.convert.convert")

    real = module.check_converted

    def slower(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), target_seconds=1.0, dflash_seconds=2.0)

    monkeypatch.setattr(module, "check_converted", slower)
    main(["--hf-path", str(hf / "target"), "--draft", str(hf / "draft"), "--mlx-path", str(tmp_path / "pair"),
          "--check-tokens", "8"])  # fmt: skip
    out, err = capsys.readouterr()
    assert "Speed in the check: target-only 8.0 tokens-per-sec, DFlash 4.0 tokens-per-sec (0.50x)" in out
    assert "warning: DFlash was slower than the target alone" in err and "--dtype float32" in err
    monkeypatch.setattr(module, "check_converted", real)
    main(["--hf-path", str(hf / "target"), "--draft", str(hf / "draft"), "--mlx-path", str(tmp_path / "pair2"),
          "--check-tokens", "8"])  # fmt: skip
    out, err = capsys.readouterr()
    assert "Speed in the check: target-only" in out
    assert ("warning: DFlash was slower" in err) == ("(0." in out.split("Speed in the check")[1].splitlines()[0])


def _bf16_folder(write, path):
    """A drafter folder written by ``write``, stored in bfloat16 as published."""
    write(path)
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["dspark", "jetspec", "dflare"])
def test_convert_each_drafter_family(hf, tmp_path, family):
    """A DSpark, JetSpec or DFlare drafter published in bf16 converts with the target, as float32 for a CPU
    or as bf16, and the pair loads as that family and passes its check."""
    from helpers.dspark_checkpoints import write_dspark_draft
    from helpers.family_drafters import write_dflare, write_jetspec

    from dflash_mlx.models import dflare, dspark
    from dflash_mlx.models.drafter import DraftModel

    write, cls = {"dspark": (write_dspark_draft, dspark.DraftModel), "jetspec": (write_jetspec, DraftModel),
                  "dflare": (write_dflare, dflare.DraftModel)}[family]  # fmt: skip
    _bf16_folder(write, tmp_path / "src")
    result = _convert(hf, tmp_path / "pair", draft_hf_path=str(tmp_path / "src"), dtype="float32")
    assert result.check.tokens_match
    model, draft, _ = load(tmp_path / "pair")
    assert type(draft) is cls and draft.norm.weight.dtype == mx.float32
    assert family != "jetspec" or all(layer.self_attn.causal for layer in draft.layers)
    ref_model, ref_draft, _ = load(hf / "target", tmp_path / "src", dtype="float32")
    prompt = _prompt()
    assert _dflash(model, draft, prompt) == _dflash(ref_model, ref_draft, prompt) == _target_only(model, prompt)
    _convert(hf, tmp_path / "bf16", draft_hf_path=str(tmp_path / "src"), dtype="bfloat16", check=False)
    stored = mx.load(str(tmp_path / "bf16" / "draft" / "model.safetensors"))
    assert {v.dtype for v in stored.values() if mx.issubdtype(v.dtype, mx.floating)} == {mx.bfloat16}
    assert type(load(tmp_path / "bf16")[1]) is cls
