"""What the later drafter families' tests (tests/test_dspark.py, test_jetspec.py, test_dflare.py) share: the
checks every family passes on the shared targets (tests/conftest.py writes each once a session), and the
authors' code put on the path for the parity tests, or a skip that says where to get it."""

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from dflash_mlx import load
from dflash_mlx.sampling import make_sampler

from . import family, sampled


def check_target_families(target: Path, draft: Path, block_size: int) -> None:
    """Lossless on a target family (hybrid, sliding) through every acceptance length and a stop mid-block."""
    model, drafter, _ = load(target, draft)
    family.check_lossless(model, drafter, block_size, 9)
    family.check_every_acceptance_length(model, drafter, block_size)
    family.check_stop_mid_block_then_continue(model, drafter)


def check_trees(varied_target: Path, draft: Path) -> None:
    """DDTree's trees from the drafter's one pass, on a target whose text does not repeat (a wrong branch shows)."""
    family.check_tree_lossless(*load(varied_target, draft)[:2])


def sampling_pair(sampling_target: Path, draft: Path) -> tuple:
    """``(model, draft, exact marginals at temperature 1)`` on the target with real choices to sample."""
    model, drafter, _ = load(sampling_target, draft)
    return model, drafter, sampled.marginals(model, make_sampler(1.0), depth=2)


@contextmanager
def authors_code(variable: str, repository: str, folder: str = ""):
    """The authors' checkout (from ``variable``), its ``folder`` on ``sys.path`` while the block runs, or a
    skip that names the variable and the repository. Tests only: the authors' code never ships with ours."""
    src = os.environ.get(variable)
    if not src:
        pytest.skip(f"these parity tests need the authors' code: {variable}=<checkout of {repository}>")
    pytest.importorskip("torch")
    path = str(Path(src) / folder)
    sys.path.insert(0, path)
    try:
        yield src
    finally:
        sys.path.remove(path)


def crop_to_length_cache():
    """transformers' ``DynamicCache`` cropping to a length, as transformers 4 did and the authors' loops
    expect (transformers 5 crops by a count)."""
    from transformers import DynamicCache

    class CropToLength(DynamicCache):
        def crop(self, length):
            if length < self.get_seq_length():
                super().crop(length - self.get_seq_length())

    return CropToLength


def randomize(build, seed: int = 0, scales: dict | None = None):
    """The authors' module that ``build()`` makes, seeded, (fp32, eval) with every weight drawn where it counts:
    norms near 1, matrices at 1/sqrt(fan-in); ``scales`` maps a parameter name's start to its own draw."""
    import torch

    torch.manual_seed(seed)
    module = build()
    with torch.no_grad():
        for name, p in module.named_parameters():
            special = next((draw for start, draw in (scales or {}).items() if name.startswith(start)), None)
            if special is not None:
                special(p)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return module.float().eval()


def qwen3_config(config: dict, skip=("model_type", "architectures", "torch_dtype", "auto_map")):
    """A drafter config as the authors' classes take it: transformers' ``Qwen3Config``, SDPA attention."""
    from transformers import Qwen3Config

    hf_config = Qwen3Config(**{k: v for k, v in config.items() if k not in skip})
    hf_config._attn_implementation = "sdpa"
    return hf_config
