"""Tiny DFlash2 drafters: their config in the published layout, written from MLX or by the
authors' own PyTorch class (z-lab's ``dflash`` package) with ``save_pretrained``."""

import copy
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.models import drafter2
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB

BLOCK = 8


def dflash2_config(window: int = 2048, causal: bool = False, **dflash) -> dict:
    """A DFlash2 drafter config as the authors' ``save_pretrained`` writes it (fields nested
    under ``dflash_config``, every layer ``sliding_attention``), for the 4-layer tiny targets."""
    nested = {
        "block_size": BLOCK,
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 2],
        "conv_kernel_size": 3,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 6,
        "output_multiplier": 1.5,
        "final_logit_softcapping": 20.0,
        "input_embedding_scale": 0.7,
        **dflash,
    }
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "num_target_layers": 4,
        "layer_types": ["sliding_attention"] * 2,
        "use_sliding_window": True,
        "sliding_window": window,
        "is_causal": causal,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "dtype": "float32",
        "dflash_config": nested,
    }


def write_dflash2_draft(path: Path, config: dict | None = None, seed: int = 1) -> None:
    """A DFlash2 folder written from MLX, its codebooks stored as bare tensors as published."""
    config = config or dflash2_config()
    mx.random.seed(seed)
    draft = drafter2.DraftModel(drafter2.DraftArgs.from_dict(config))
    weights = {}
    for name, value in tree_flatten(draft.parameters()):
        if name.endswith("_codebook.weight"):
            name, value = name[: -len(".weight")], value * 3.0  # pair scores comparable with the logits
        elif name.endswith("base_kernel"):
            value = mx.random.normal(value.shape) * 0.5  # its init is zeros
        weights[name] = value
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))


def authors_draft(config: dict, seed: int = 0):
    """The authors' ``DFlash2DraftModel`` for ``config`` (fp32, eval), every weight drawn at a
    scale where each part counts: unit-ish norms, 1/sqrt(fan_in) projections, a convolution
    base and selector codebooks large enough to move the output and the path."""
    import torch
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    config = copy.deepcopy(config)
    for key in ("dtype", "model_type"):
        config.pop(key, None)
    torch.manual_seed(seed)
    model = DFlash2DraftModel(Qwen3Config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "codebook" in name:
                p.normal_(0.0, 1.0)
            elif "base_kernel" in name:
                p.normal_(0.0, 0.5)  # torch.empty: uninitialised until here
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.float().eval()


def train_authors_draft(draft, target, sequence: list[int], *, steps: int = 60, lr: float = 3e-3, seed: int = 0):
    """The authors' drafter fitted to ``sequence``, the target's greedy text (:func:`fit_to_sequence`)."""
    import torch
    import torch.nn.functional as F
    from dflash.model import extract_context_feature

    from .torch_oracles import fit_to_sequence

    scale = float(draft.config.dflash_config.get("input_embedding_scale", 1.0))
    with torch.no_grad():
        out = target(torch.tensor([sequence]), output_hidden_states=True)
        taps = extract_context_feature(out.hidden_states, draft.target_layer_ids)
        embedding = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings()

    def block_logits(p, block):
        noise = F.embedding(block, embedding) * scale
        h = draft(
            position_ids=torch.arange(p + draft.block_size)[None], noise_embedding=noise, target_hidden=taps[:, :p]
        )
        return draft.compute_logits(h[0, 1:], head)

    return fit_to_sequence(draft, block_logits, sequence, steps=steps, lr=lr, seed=seed)
