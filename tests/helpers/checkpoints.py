"""Tiny random checkpoints written in the exact HF (target) and z-lab (drafter) formats.

Used by the tests to exercise the real loading code paths without any download.
"""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2, qwen3

from dflash_mlx.models.drafter import DraftArgs, DraftModel

VOCAB = 128
HIDDEN = 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOS_ID = VOCAB - 2  # <|im_end|>
MASK_ID = VOCAB - 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def target_config(kind: str = "qwen3", tied: bool = True, layers: int = 4) -> dict:
    common = {
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": tied,
        "bos_token_id": 0,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    if kind == "qwen3":
        return {
            **common,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "rope_theta": 10000.0,
            "attention_bias": False,
        }
    if kind == "qwen2":
        return {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "rope_theta": 10000.0,
        }
    if kind == "llama":
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
        }
    raise ValueError(kind)


def _module_for(config: dict):
    return {"qwen3": qwen3, "qwen2": qwen2, "llama": llama}[config["model_type"]]


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer: tokens 't0'..'t123' plus the chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - len(SPECIALS))}
    vocab.update({s: VOCAB - len(SPECIALS) + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIALS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def write_target(
    path: Path,
    kind: str = "qwen3",
    tied: bool = True,
    layers: int = 4,
    seed: int = 0,
    embed_scale: float = 0.5,
    layer_scale: float = 1.0,
):
    """An HF-format target folder (config.json, model.safetensors, tokenizer). Returns the model.

    ``layer_scale`` multiplies what each layer adds to the residual stream (its attention's and MLP's
    output projections): above 1 the layers outweigh the token's own embedding, which a tied head
    otherwise reads back as the next token (greedy text of one token repeated)."""
    config = target_config(kind, tied, layers)
    module = _module_for(config)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger embeddings than the default init, so logits are far from ties.
    model.model.embed_tokens.weight = mx.random.normal((VOCAB, HIDDEN)) * embed_scale
    # Sharp attention, so that outputs depend on the whole context and its positions:
    # a rollback or position bug must change the tokens.
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm"):
            attn.q_norm.weight = attn.q_norm.weight * 3.0
            attn.k_norm.weight = attn.k_norm.weight * 3.0
        else:
            attn.q_proj.weight = attn.q_proj.weight * 6.0
            attn.k_proj.weight = attn.k_proj.weight * 6.0
        if layer_scale != 1.0:
            attn.o_proj.weight = attn.o_proj.weight * layer_scale
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * layer_scale
    weights = dict(tree_flatten(model.parameters()))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return model


def draft_config(
    num_target_layers: int = 4,
    layers: int = 2,
    block_size: int = 16,
    target_layer_ids=(1, 2),
    nested: bool = True,
) -> dict:
    """A drafter config in the z-lab layout (``nested``) or with top-level DFlash fields."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "num_target_layers": num_target_layers,
        "block_size": block_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    dflash = {"mask_token_id": MASK_ID, "target_layer_ids": list(target_layer_ids)}
    if nested:
        config["dflash_config"] = dflash
        config["rope_theta"] = 10000.0
    else:
        config.update(dflash)
        config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    return config


def write_draft(path: Path, seed: int = 1, **kwargs) -> DraftModel:
    """A z-lab-format drafter folder (config.json + model.safetensors). Returns the model."""
    config = draft_config(**kwargs)
    mx.random.seed(seed)
    draft = DraftModel(DraftArgs.from_dict(config))
    weights = dict(tree_flatten(draft.parameters()))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return draft
