import importlib.util
import os

import mlx.core as mx
import pytest
from helpers.checkpoints import write_draft, write_target
from helpers.varied import write_varied_target

from dflash_mlx import load

TARGET_KINDS = {
    "qwen3-tied": ("qwen3", True),
    "qwen3-untied": ("qwen3", False),
    "llama": ("llama", False),
    "qwen2": ("qwen2", True),
}


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory):
    """Folders of tiny random targets (one per kind) and a drafter made for them."""
    root = tmp_path_factory.mktemp("pairs")
    dirs = {}
    for name, (kind, tied) in TARGET_KINDS.items():
        write_target(root / name, kind=kind, tied=tied)
        dirs[name] = root / name
    write_draft(root / "draft")
    dirs["draft"] = root / "draft"
    return dirs


@pytest.fixture(scope="session", params=list(TARGET_KINDS))
def tiny_pair(request, pair_dirs):
    """(model, draft, tokenizer) loaded through load(), for each target kind."""
    return load(pair_dirs[request.param], pair_dirs["draft"])


@pytest.fixture(scope="session")
def qwen3_pair(pair_dirs):
    return load(pair_dirs["qwen3-tied"], pair_dirs["draft"])


class _VariedDirs(dict):
    """Target folders by kind, each written (its seed chosen) the first time a test asks for it."""

    def __init__(self, root, draft):
        super().__init__(draft=draft)
        self.root = root

    def __missing__(self, name):
        kind, tied = TARGET_KINDS[name]
        write_varied_target(self.root / name, kind=kind, tied=tied)
        self[name] = self.root / name
        return self[name]


@pytest.fixture(scope="session")
def varied_dirs(tmp_path_factory, pair_dirs):
    """Folders of tiny targets (one per kind) whose greedy text depends on its context
    (helpers/varied.py), with ``pair_dirs``' drafter."""
    return _VariedDirs(tmp_path_factory.mktemp("varied"), pair_dirs["draft"])


@pytest.fixture(scope="session", params=list(TARGET_KINDS))
def varied_pair(request, varied_dirs):
    """(model, draft, tokenizer) of a varied target, for each target kind."""
    return load(varied_dirs[request.param], varied_dirs["draft"])


@pytest.fixture(scope="session")
def varied_qwen3_pair(varied_dirs):
    return load(varied_dirs["qwen3-tied"], varied_dirs["draft"])


class _HFTargetDirs(dict):
    """HF-layout target folders by kind (helpers/hf_checkpoints.py, seed 0), each written the first time a
    test asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, kind):
        from helpers.hf_checkpoints import write_hf_target

        write_hf_target(self.root / kind, kind)
        self[kind] = self.root / kind
        return self[kind]


@pytest.fixture(scope="session")
def hf_target_dirs(tmp_path_factory):
    return _HFTargetDirs(tmp_path_factory.mktemp("hf-targets"))


@pytest.fixture(scope="session")
def sampling_target(tmp_path_factory):
    """A tiny target with smaller logits than the shared ones, so that sampling has real choices."""
    folder = tmp_path_factory.mktemp("sampling") / "target"
    write_target(folder, embed_scale=0.2)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _default_pair_cache(tmp_path_factory):
    """The default pair's target is converted (at most once per session) into a temporary
    cache, never into the user's ~/.cache/dflash-mlx."""
    from dflash_mlx.base import store
    from dflash_mlx.loading import gguf

    root = tmp_path_factory.mktemp("dflash-mlx-cache")
    # The converted target in a folder every test worker of this run shares (the conversion installs its
    # folder atomically, so workers may race): one conversion a run, not one a worker. The saved rates and
    # the datastore index stay the worker's own.
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "default_cache_root", lambda: shared / "dflash-mlx-targets")
        mp.setattr(store, "default_cache_root", lambda: root)
        yield root


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """PyTorch on one thread in each test process: the test workers already take every core, and
    PyTorch's own threads on top only contend (SmolLM2's forward pass in transformers runs about 4x
    slower with two threads than with one on two busy cores), as the parity tests already run it."""
    if importlib.util.find_spec("torch") is None:
        return
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


@pytest.fixture(autouse=True)
def _offline_hub(monkeypatch, tmp_path):
    """No test may reach the network: the hub client runs offline on an empty cache."""
    import huggingface_hub.constants as hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
