import http.server
import json
import logging
import shutil
import socket
import sys
import threading
import time
import types

import huggingface_hub.constants
import mlx.core as mx
import mlx_lm
import pytest
from helpers.checkpoints import EOS_ID, draft_config, write_draft

from dflash_mlx import DFlashError, generate, load, stream_generate
from dflash_mlx.loading import hub


@pytest.fixture()
def folders(tmp_path, pair_dirs):
    """Fresh copies of a tiny target and drafter that a test may damage."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(pair_dirs["qwen3-tied"], target)
    shutil.copytree(pair_dirs["draft"], draft)
    return target, draft


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            config["dflash_config"][key] = value
        elif value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def _error(*args, **kwargs) -> str:
    with pytest.raises(DFlashError) as e:
        load(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_loads_pair_from_local_folders(folders):
    model, draft, tokenizer = load(*folders)
    assert draft.block_size == 16 and draft.target_layer_ids == [1, 2]
    assert tokenizer.eos_token_ids == {EOS_ID}


def test_target_only_is_plain_decoding(pair_dirs):
    # The untied target: the tied one repeats its last token, which any decoding bug would too.
    model, draft, tokenizer = load(pair_dirs["qwen3-untied"])
    assert draft is None
    text = generate(model, None, tokenizer, "t1 t2 t3", max_tokens=5)
    expected = mlx_lm.generate(model, tokenizer, "t1 t2 t3", max_tokens=5)
    assert text == expected and len(text.split()) == 5 and len(set(text.split())) > 1


def test_hidden_size_mismatch(folders, tmp_path):
    config = draft_config()
    write_draft(tmp_path / "wide", **{})
    _edit_config(tmp_path / "wide", hidden_size=96, intermediate_size=128)
    # Rewrite the weights so the drafter itself is consistent, only the pair is wrong.
    from mlx.utils import tree_flatten

    from dflash_mlx.models.drafter import DraftArgs, DraftModel

    args = DraftArgs.from_dict({**config, "hidden_size": 96})
    mx.save_safetensors(str(tmp_path / "wide" / "model.safetensors"), dict(tree_flatten(DraftModel(args).parameters())))
    message = _error(folders[0], tmp_path / "wide")
    assert "hidden_size=96" in message and "hidden_size=64" in message and "--draft" in message


def test_vocab_mismatch(folders):
    _edit_config(folders[1], vocab_size=1000)
    assert "vocab_size=1000" in _error(*folders)


def test_num_target_layers_mismatch(folders):
    _edit_config(folders[1], num_target_layers=36)
    assert "num_target_layers=36" in _error(*folders)


def test_target_layer_ids_beyond_depth(folders):
    _edit_config(folders[1], num_target_layers=None, target_layer_ids=[1, 9])
    message = _error(*folders)
    assert "[1, 9]" in message and "only 4 layers" in message


def test_mask_token_outside_vocab(folders):
    _edit_config(folders[1], mask_token_id=5000)
    assert "mask_token_id=5000 is outside" in _error(*folders)


def test_mask_token_found_in_tokenizer_when_absent(folders):
    config = json.loads((folders[1] / "config.json").read_text())
    del config["dflash_config"]["mask_token_id"]
    (folders[1] / "config.json").write_text(json.dumps(config))
    _, draft, _ = load(*folders)
    assert draft.mask_token_id == 127  # <|mask|> in the tokenizer


def test_drafter_block_size_too_small(folders):
    _edit_config(folders[1], block_size=1)
    assert "block_size must be at least 2 (got 1)" in _error(*folders)


def test_missing_config(folders):
    (folders[1] / "config.json").unlink()
    assert "No config.json in" in _error(*folders)


def test_missing_weights(folders):
    (folders[0] / "model.safetensors").unlink()
    assert "No *.safetensors weights in" in _error(*folders)


def test_corrupt_weights(folders):
    path = folders[1] / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    message = _error(*folders)
    assert "corrupt or incomplete" in message and "model.safetensors" in message


def test_corrupt_config(folders):
    (folders[0] / "config.json").write_text("{not json")
    assert "is not valid JSON" in _error(*folders)


def test_non_dflash_folder_as_drafter(folders):
    message = _error(folders[0], folders[0])
    assert "is not a DFlash drafter" in message


def test_drafter_as_target(folders):
    message = _error(folders[1], folders[1])
    assert "holds a DFlash drafter, not a target" in message and "--draft" in message


def test_unsupported_target_architecture(folders):
    _edit_config(folders[0], model_type="mamba")
    assert "Unsupported target architecture model_type='mamba'" in _error(*folders)


def test_drafter_weights_that_do_not_match_config(folders):
    _edit_config(folders[1], num_hidden_layers=3)
    message = _error(*folders)
    assert "do not match its config" in message and "layers.2" in message and "\n" not in message


def test_missing_folder_and_bad_id():
    assert "neither an existing folder nor a Hugging Face id" in _error("./no/such/folder")


def test_an_unknown_name_says_that_leaving_the_model_out_gives_the_default_pair():
    message = _error("smollm3")
    assert message == (
        "The target 'smollm3' is neither an existing folder, a Hugging Face id like 'org/name', nor an embedded "
        "pair (smollm2, dflash-tiny). Check the path; leaving --model out gives the default pair, "
        "SmolLM2-135M-Instruct."
    )


def test_hub_id_not_in_cache_fails_cleanly():
    message = _error("some-org/some-model")
    assert "Could not get the target 'some-org/some-model' from the Hugging Face hub" in message


def _cache_tiny_pair(pair_dirs, tmp_path):
    import huggingface_hub.constants as hf

    for repo, src in (("acme/tiny", pair_dirs["qwen3-tied"]), ("acme/tiny-DFlash", pair_dirs["draft"])):
        root = tmp_path / "hf-cache" / f"models--{repo.replace('/', '--')}"
        shutil.copytree(src, root / "snapshots" / ("0" * 40))
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0" * 40)
    assert hf.HF_HUB_CACHE == str(tmp_path / "hf-cache")


def test_hub_id_loads_from_local_cache(pair_dirs, tmp_path):
    """The real huggingface_hub path, resolved offline from an HF cache layout."""
    _cache_tiny_pair(pair_dirs, tmp_path)
    model, draft, _ = load("acme/tiny", "acme/tiny-DFlash")
    assert draft is not None and model.model_type == "qwen3"


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub client online, at a local port where nothing listens; any other host is refused."""
    import huggingface_hub.constants as hf

    endpoint = "http://127.0.0.1:9"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub, "_DOWN", {})
    elsewhere, getaddrinfo = [], socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            elsewhere.append(host)
            raise socket.gaierror(f"{host}: this test reaches no other host")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    yield endpoint
    assert not elsewhere, f"the hub client looked up {elsewhere}"


def test_an_unreachable_hub_fails_fast_in_one_line(unreachable_hub, caplog):
    # The hub client alone retries five times with backoff: about 25 s of "Retrying in 8s" lines.
    tic = time.monotonic()
    message = _error("someorg/no-such-repo")
    assert time.monotonic() - tic < 5, f"took {time.monotonic() - tic:.0f} s"
    assert message == (
        "Could not get the target 'someorg/no-such-repo' from the Hugging Face hub: cannot reach "
        f"{unreachable_hub} ([Errno 111] Connection refused), and it is not in the local hub cache "
        f"{huggingface_hub.constants.HF_HUB_CACHE}. Connect to the network, or pass a local folder."
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_hub_without_the_repository_says_so_in_one_line(unreachable_hub, monkeypatch):
    import huggingface_hub.constants as hf

    class NoSuchRepo(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoSuchRepo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    monkeypatch.setattr(hf, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    try:
        assert _error("someorg/no-such-repo") == (
            f"Could not get the target 'someorg/no-such-repo' from the Hugging Face hub: {endpoint} has no model "
            "'someorg/no-such-repo', or it is private (log in with `hf auth login`). Check the id, or pass a local "
            "folder."
        )
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_unreachable_hub_falls_back_to_the_cache_and_says_so_once(pair_dirs, tmp_path, unreachable_hub, caplog):
    _cache_tiny_pair(pair_dirs, tmp_path)
    tic = time.monotonic()
    model, draft, _ = load("acme/tiny", "acme/tiny-DFlash")
    assert time.monotonic() - tic < 10 and draft is not None
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [
        f"The Hugging Face hub is unreachable (cannot reach {unreachable_hub} ([Errno 111] Connection "
        "refused)); using the cached target acme/tiny."
    ]


def test_remote_code_is_never_executed(folders, tmp_path):
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'w').write('x')\n"
    (folders[1] / "dflash.py").write_text(code)
    (folders[0] / "custom.py").write_text(code)
    _, draft, _ = load(*folders)  # the drafter's auto_map points at dflash.py
    assert draft is not None and not marker.exists()
    _edit_config(folders[0], model_file="custom.py")
    _error(*folders)
    assert not marker.exists()


def test_bad_dtype(folders):
    assert "Unsupported dtype 'float8'" in _error(*folders, dtype="float8")


def test_dtype_cast(folders):
    model, draft, _ = load(*folders, dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert draft.fc.weight.dtype == mx.bfloat16


def _as_bfloat16(folder):
    """Store a checkpoint in bfloat16, as published checkpoints usually are."""
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    _edit_config(folder, torch_dtype="bfloat16")


def test_default_dtype_rule(folders):
    from dflash_mlx.loading.casting import default_dtype

    model, draft, _ = load(*folders, dtype="bfloat16")
    cpu, gpu = mx.Device(mx.cpu), mx.Device(mx.gpu)
    # float32 weights: the target 4 layers of hidden 64 and a 128-token vocabulary, well under 1 MB.
    assert default_dtype(model, draft, device=cpu, available=10**9) == ("float32", None)
    dtype, hint = default_dtype(model, draft, device=cpu, available=0)
    assert dtype is None and hint.startswith("Computing in bfloat16, the checkpoint's dtype: float32 weights")
    assert "pass --dtype float32" in hint and "\n" not in hint
    assert default_dtype(model, draft, device=gpu, available=10**9) == (None, None)
    # float32 checkpoints need nothing.
    model32, draft32, _ = load(*folders, dtype="float32")
    assert default_dtype(model32, draft32, device=cpu, available=0) == (None, None)


def test_dtype_rule_at_half_the_memory_at_hand(folders):
    from mlx.utils import tree_flatten

    from dflash_mlx.loading.casting import default_dtype

    model, _, _ = load(folders[0], dtype="bfloat16")
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    # bfloat16 to float32 doubles the weights: 2 * loaded must fit in half of (available + loaded).
    cpu = mx.Device(mx.cpu)
    assert default_dtype(model, device=cpu, available=3 * loaded)[0] == "float32"
    assert default_dtype(model, device=cpu, available=3 * loaded - 1)[0] is None


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the default dtype on MLX's CPU backend")
def test_load_computes_in_float32_on_cpu_unless_told_or_short_of_memory(folders, monkeypatch, caplog):
    from dflash_mlx.loading import casting

    _as_bfloat16(folders[0])
    model, draft, _ = load(*folders)
    assert model.model.embed_tokens.weight.dtype == draft.fc.weight.dtype == mx.float32
    model, draft, _ = load(*folders, dtype="bfloat16")  # an explicit dtype always wins
    assert model.model.embed_tokens.weight.dtype == draft.fc.weight.dtype == mx.bfloat16
    assert not caplog.records
    monkeypatch.setattr(casting, "available_memory", lambda: 0)
    model, draft, _ = load(*folders)
    # The checkpoint's dtype, the drafter in the target's, and one line that says why.
    assert model.model.embed_tokens.weight.dtype == draft.fc.weight.dtype == mx.bfloat16
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["Computing in bfloat16, the checkpoint's dtype"]


def test_stream_generate_response_fields(qwen3_pair, monkeypatch):
    model, draft, tokenizer = qwen3_pair
    responses = list(stream_generate(model, draft, tokenizer, "t1 t2 t3", max_tokens=20))
    last = responses[-1]
    assert last.finish_reason in ("stop", "length")
    assert sum(len(r.tokens) for r in responses) <= 20
    assert last.prompt_tokens == 3 and 0 < last.peak_memory <= mx.get_peak_memory() / 1e9
    # A clock one second later at each reading: the 3 prompt tokens take the 1 s before the first
    # token, then plain decoding makes one token a second.
    ticks = iter(range(100))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(sys.modules["dflash_mlx.generation"], "time", clock)
    plain = list(stream_generate(model, None, tokenizer, "t1 t2 t3", max_tokens=6))
    assert [(r.prompt_tps, r.generation_tps) for r in plain] == [(3.0, 0.0)] + [(3.0, 1.0)] * 5
    assert all(isinstance(t, int) for r in responses for t in r.tokens)
    assert [r.cycle for r in responses] == list(range(len(responses)))
    for bad, message in (("", "The prompt is empty"), ([], "The prompt is empty")):
        with pytest.raises(DFlashError, match=message):
            list(stream_generate(model, draft, tokenizer, bad))
    with pytest.raises(DFlashError, match="max_tokens must be a positive integer"):
        list(stream_generate(model, draft, tokenizer, "t1", max_tokens=-1))


def test_llama_and_untied_targets_load(pair_dirs):
    for name in ("llama", "qwen3-untied"):
        model, draft, _ = load(pair_dirs[name], pair_dirs["draft"])
        assert draft is not None


def test_draft_for_cli():
    from dflash_mlx.loading.pairs import AUTO_DRAFT
    from dflash_mlx.loading.registry import draft_for_cli

    assert draft_for_cli("Qwen/Qwen3-8B", None) == AUTO_DRAFT
    assert draft_for_cli("Qwen/Qwen3-8B", None, no_draft=True) is None
    assert draft_for_cli("acme/unknown", None) is None
    assert draft_for_cli("Qwen/Qwen3-8B", "my/draft") == "my/draft"
    assert draft_for_cli(None, None) is None
