"""Tiny JetSpec and DFlare drafters in their published layouts, written from MLX (DSpark's are in
dspark_checkpoints.py)."""

import json

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.models import dflare
from dflash_mlx.models.drafter import DraftArgs, DraftModel

from .checkpoints import HIDDEN, MASK_ID, VOCAB, draft_config

BLOCK = 16
TAPS = [0, 1, 2, 3]  # DFlare's


def jetspec_config(**dflash) -> dict:
    """A JetSpec head's config as its authors' class saves it: z-lab's, with causal_head."""
    config = draft_config(block_size=BLOCK)
    config["dflash_config"].update({"causal_head": True, **dflash})
    return config


def write_jetspec(path, config=None, seed: int = 1) -> DraftModel:
    config = config or jetspec_config()
    mx.random.seed(seed)
    draft = DraftModel(DraftArgs.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return draft


def dflare_config(**change) -> dict:
    """A DFlare config as AngelSlim's configs/qwen3_dflare.json lays it out, for the 4-layer tiny targets."""
    config = {
        "architectures": ["QwenDFlareDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "layer_types": ["full_attention"] * 3,
        "max_position_embeddings": 2048,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_target_layers": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "vocab_size": VOCAB,
        "num_anchors": 512,
        "torch_dtype": "float32",
    }
    config.update(change)
    return config


def write_dflare(path, config=None, seed: int = 1) -> None:
    config = config or dflare_config()
    mx.random.seed(seed)
    draft = dflare.DraftModel(dflare.DraftArgs.from_dict(config))
    weights = dict(tree_flatten(draft.parameters()))
    weights["layer_fusion_weights"] = mx.random.normal(weights["layer_fusion_weights"].shape)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
