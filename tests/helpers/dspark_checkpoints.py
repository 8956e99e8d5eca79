"""Tiny DSpark drafters: their config in the published layout (the target's config with the DSpark
fields at the top level, as the authors' ``build_draft_config`` writes it), written from MLX or by the
authors' own PyTorch class (deepseek-ai/DeepSpec) with ``save_pretrained``."""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.models import dspark
from helpers.checkpoints import HIDDEN, MASK_ID, VOCAB

BLOCK = 7


def dspark_config(**change) -> dict:
    """A DSpark drafter config for the 4-layer tiny targets: a Markov head of rank 8 and a
    confidence head that sees it, unless ``change`` says otherwise."""
    config = {
        "architectures": [dspark.ARCHITECTURE],
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
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "num_target_layers": 4,
        "block_size": BLOCK,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * 2,
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 2],
        "num_anchors": 16,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "torch_dtype": "float32",
    }
    config.update(change)
    return config


def write_dspark_draft(path: Path, config: dict | None = None, seed: int = 1, head: bool = True) -> None:
    """A DSpark folder written from MLX; ``head=False`` leaves out ``embed_tokens``/``lm_head``
    (a community head that borrows the target's). The Markov weights are drawn large enough to
    change the drafts."""
    config = config or dspark_config()
    mx.random.seed(seed)
    draft = dspark.DraftModel(dspark.DraftArgs.from_dict(config))
    weights = {}
    for name, value in tree_flatten(draft.parameters()):
        if not head and name.startswith(("embed_tokens.", "lm_head.")):
            continue
        if name.startswith("markov_head."):
            value = value * 4.0
        weights[name] = value
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
