"""Tiny random MoE, hybrid and Gemma 4 targets, written by transformers' own classes (exact HF format).

``qwen3_moe`` is a Qwen3MoeForCausalLM; ``qwen3_5`` and ``qwen3_5_moe`` are the
ForConditionalGeneration classes the published Qwen3.5 / Qwen3.6 checkpoints use, with a
one-block vision tower that mlx-lm drops on load; ``qwen3_next`` is a Qwen3NextForCausalLM
(Qwen3-Next / Qwen3-Coder-Next: linear attention, gated full attention every 4th layer, and
experts with a gated shared expert in every layer). ``gpt_oss`` is a GptOssForCausalLM
(sliding-window and full attention layers with attention sinks, MoE MLP) saved as
openai/gpt-oss-* are published: expert weights in MXFP4 (``*_blocks`` / ``*_scales``).

``gemma4_text`` is a Gemma4ForCausalLM with the small Gemma 4 models' features (per-layer
inputs, layers that reuse an earlier layer's keys and values, double-wide MLPs); ``gemma4``
is a Gemma4ForConditionalGeneration with the large ones' (experts, keys equal to values on
full attention layers). Both mix sliding-window layers (a window of ``GEMMA_WINDOW``) with
full attention layers of a wider head, and softcap their logits.

``kimi_k25`` is a Kimi_K25ForConditionalGeneration (a DeepSeek-V3 text model: multi-head latent
attention, a dense first layer and then experts with a shared one, under a one-block vision tower)
saved as moonshotai/Kimi-K2.5 is published: ``language_model.``-prefixed names, the routed experts in
compressed-tensors' INT4 (``weight_packed`` / ``weight_scale`` / ``weight_shape``), YaRN RoPE.
"""

import json
from pathlib import Path

import numpy as np

from helpers.checkpoints import EOS_ID, HIDDEN, VOCAB, write_tokenizer

HF_KINDS = ("qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")
GEMMA_KINDS = ("gemma4_text", "gemma4")
GEMMA_WINDOW = 6
# gpt-oss's sliding window: shorter than most test prompts, so the window is exercised.
GPT_OSS_WINDOW = 6
# MXFP4's 4-bit values (e2m1); a code's top bit is the sign.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": EOS_ID,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_LINEAR = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_GEMMA = {
    **{k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"},
    "intermediate_size": 64,
    "global_head_dim": 32,
    "sliding_window": GEMMA_WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    # Small enough to bend the logits of these tiny models, so a head without it shows.
    "final_logit_softcapping": 5.0,
    "pad_token_id": 0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
}
_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": HIDDEN,
    "num_position_embeddings": 16,
}


_KIMI_TEXT = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    # Tiny MLA ranks; the published model has q_lora_rank 1536, kv_lora_rank 512, heads 128 + 64 (RoPE).
    "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_theta": 50000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": EOS_ID,
    # The published YaRN settings (the 256K context of Kimi K2.5).
    "rope_scaling": {"type": "yarn", "factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
}  # fmt: skip
# compressed-tensors' INT4 groups, as moonshotai/Kimi-K2.5 quantizes its routed experts.
KIMI_INT4_GROUP = 32
KIMI_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": KIMI_INT4_GROUP, "dynamic": False, "actorder": None, "observer": "minmax"},
    }},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
               "re:.*mlp\\.gate$", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}  # fmt: skip


def hf_model(kind: str, layers: int = 4, seed: int = 0):
    """A seeded fp32 transformers model of ``kind`` with tiny shapes."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **_COMMON,
            **_MOE,
            num_hidden_layers=layers,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = tf.Qwen3MoeForCausalLM(config)
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        text = {
            **_COMMON,
            **_LINEAR,
            "num_hidden_layers": layers,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        }
        if kind == "qwen3_5":
            config = tf.Qwen3_5Config(text_config=text, vision_config=_VISION, tie_word_embeddings=True)
            model = tf.Qwen3_5ForConditionalGeneration(config)
        else:
            text.update(_MOE, shared_expert_intermediate_size=32)
            config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=_VISION, tie_word_embeddings=True)
            model = tf.Qwen3_5MoeForConditionalGeneration(config)
    elif kind == "qwen3_next":
        config = tf.Qwen3NextConfig(
            **_COMMON, **_MOE, **_LINEAR, num_hidden_layers=layers, decoder_sparse_step=1, norm_topk_prob=True,
            shared_expert_intermediate_size=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )  # fmt: skip
        model = tf.Qwen3NextForCausalLM(config)
    elif kind == "gemma4_text":
        config = tf.Gemma4TextConfig(
            **_GEMMA,
            num_hidden_layers=layers,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=layers // 2,
            use_double_wide_mlp=True,
        )
        model = tf.Gemma4ForCausalLM(config)
    elif kind == "gemma4":
        text = {
            **_GEMMA,
            "num_hidden_layers": layers,
            "hidden_size_per_layer_input": 0,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 16,
        }
        model = tf.Gemma4ForConditionalGeneration(tf.Gemma4Config(text_config=text, vision_config=None))
    elif kind == "gpt_oss":
        return _gpt_oss_model(layers)
    elif kind == "kimi_k25":
        return _kimi_model(layers)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        # transformers' init (std 0.02) leaves the layers' outputs small next to the
        # embedding, and greedy decoding then repeats a token: give every projection a
        # 1/sqrt(fan_in) scale (4x in the attention and linear attention), larger embeddings
        # (logits far from ties) and sharper attention, so that the output depends on the
        # whole context and a rollback bug shows.
        model.get_input_embeddings().weight.normal_(0.0, 0.15 if kind in GEMMA_KINDS else 0.5)
        for name, p in model.named_parameters():
            if "visual" in name or "embed_tokens" in name or "lm_head" in name:
                continue
            if name.endswith(("proj.weight", "gate_up_proj", "down_proj", "gate.weight", "proj")) and p.ndim >= 2:
                sharp = 4.0 if "attn" in name else 1.0
                p.normal_(0.0, sharp * p.shape[-1] ** -0.5)
            elif name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")) and (
                kind in GEMMA_KINDS
            ):
                # Gemma norms each block's output, and scales its embedding up by sqrt(hidden):
                # larger outputs keep the blocks from being drowned by the token's own embedding.
                p.mul_(4.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(3.0) if kind == "qwen3_moe" else p.add_(2.0)
    return model.float().eval()


def _gpt_oss_model(layers: int):
    import torch
    import transformers as tf

    config = tf.GptOssConfig(
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, intermediate_size=96,
        num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2, sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        # The published YaRN settings, but with transformers' default truncate=True: mlx-lm's YaRN
        # always rounds the correction range, as truncate=True does.
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096},
    )  # fmt: skip
    config.tie_word_embeddings = False
    model = tf.GptOssForCausalLM(config)
    with torch.no_grad():
        # As hf_model's scales (see there), an untied head whose logits are far from ties, and
        # sinks far from zero so that they matter.
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
        model.lm_head.weight.normal_(0.0, 4.0 * HIDDEN**-0.5)
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name or "norm" in name:
                continue
            if name.endswith(("gate_up_proj", "down_proj")):
                # (E, in, out): quantized to MXFP4 values, as the published experts are.
                p.normal_(0.0, p.shape[-2] ** -0.5)
                p.copy_(torch.from_numpy(_mxfp4_round(p.numpy().swapaxes(-1, -2)).swapaxes(-1, -2).copy()))
            elif name.endswith("proj.weight") or name.endswith("router.weight"):
                p.normal_(0.0, (4.0 if "attn" in name else 1.0) * p.shape[-1] ** -0.5)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.float().eval()


def _kimi_model(layers: int):
    import torch
    import transformers as tf

    vision = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    text = {**_KIMI_TEXT, "num_hidden_layers": layers, "model_type": "deepseek_v3"}
    config = tf.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                               tie_word_embeddings=False)  # fmt: skip
    model = tf.Kimi_K25ForConditionalGeneration(config)
    with torch.no_grad():
        # As hf_model's scales (see there), an untied head far from ties, and router biases that
        # change which experts a token gets (their rounding would show).
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
        model.lm_head.weight.normal_(0.0, 4.0 * HIDDEN**-0.5)
        for name, p in model.named_parameters():
            if "language_model" not in name or "embed_tokens" in name or "norm" in name:
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # (E, out, in): on the INT4 grid, as the published experts are.
                p.normal_(0.0, p.shape[-1] ** -0.5)
                p.copy_(_int4_round(p))
            elif name.endswith(("proj.weight", "mqa.weight", "gate.weight")):
                p.normal_(0.0, (2.0 if "attn" in name else 1.0) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.float().eval()


def _int4(w):
    """``w`` (..., out, in) as compressed-tensors' symmetric INT4 groups: (codes int8, scales bf16).
    Idempotent: the dequantized values give back the same codes and scales."""
    import torch

    groups = w.reshape(*w.shape[:-1], -1, KIMI_INT4_GROUP).float()
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 7).clamp(min=1e-8).to(torch.bfloat16)
    codes = torch.clamp(torch.round(groups / scale.float()), -8, 7).to(torch.int8)
    return codes.reshape(w.shape), scale[..., 0]


def _int4_round(w):
    codes, scale = _int4(w)
    groups = codes.reshape(*w.shape[:-1], -1, KIMI_INT4_GROUP).float() * scale.float()[..., None]
    return groups.reshape(w.shape)


def _int4_tensors(name: str, w) -> dict:
    # compressed-tensors' pack-quantized layout: eight codes a little-endian int32 word, each
    # stored plus 8 (unsigned), the first in the lowest bits; a bf16 scale a group; the shape.
    import torch

    codes, scale = _int4(w)
    nibbles = (codes.to(torch.int64) + 8).reshape(*w.shape[:-1], -1, 8)
    words = (nibbles << (4 * torch.arange(8))).sum(dim=-1)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    base = name.removesuffix("weight")
    return {f"{base}weight_packed": packed, f"{base}weight_scale": scale.contiguous(),
            f"{base}weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}  # fmt: skip


def _write_kimi(path: Path, model, int4: bool) -> None:
    import re

    from safetensors.torch import load_file, save_file

    # transformers writes the published names back, except that it renames the text model's
    # layers as the vision tower's "blocks" and leaves the projector's norm under "model.".
    model.save_pretrained(str(path))
    weights = {}
    for k, v in load_file(str(path / "model.safetensors")).items():
        k = k.replace("language_model.model.blocks.", "language_model.model.layers.")
        k = re.sub(r"^model\.mm_projector\.", "mm_projector.", k)
        if int4 and re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", k):
            weights.update(_int4_tensors(k, v))
        else:
            weights[k] = v.contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    # The published config's names (and mlx-lm's): rope_theta and rope_scaling, not rope_parameters.
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_type"}
    text["model_type"] = "kimi_k2"
    if int4:
        text["quantization_config"] = KIMI_QUANTIZATION
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` (..., out, in) in MXFP4: (codes (..., out, in) uint8, exponents (..., out, in // 32) int)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = np.abs(groups) / np.exp2(exp)
    codes = np.abs(scaled[..., None] - _E2M1).argmin(axis=-1).astype(np.uint8)
    codes |= (groups < 0).astype(np.uint8) << 3
    return codes.reshape(w.shape), exp[..., 0]


def _mxfp4_round(w: np.ndarray) -> np.ndarray:
    codes, exp = _mxfp4(w)
    values = _E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return (values.reshape(*exp.shape, 32) * np.exp2(exp)[..., None]).reshape(w.shape).astype(np.float32)


def _mxfp4_tensors(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    # openai/gpt-oss-*'s layout: (E, out, in // 32, 16) bytes, two values a byte (the even one in
    # the low nibble), and one power-of-two scale a group of 32 stored as exponent + 127.
    codes, exp = _mxfp4(w)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # (save_file writes an array's buffer as it lies in memory: make both C-ordered.)
    return {
        f"{name}_blocks": np.ascontiguousarray(packed.reshape(*w.shape[:-1], -1, 16)),
        f"{name}_scales": np.ascontiguousarray(exp + 127, dtype=np.uint8),
    }


def _write_gpt_oss(path: Path, model) -> None:
    from safetensors.numpy import save_file

    model.config.save_pretrained(str(path))
    weights = {}
    for k, v in model.state_dict().items():
        v = v.detach().numpy()
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            weights.update(_mxfp4_tensors(k, v.swapaxes(-1, -2)))  # transformers holds (E, in, out)
        else:
            weights[k] = np.ascontiguousarray(v)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    # The published config's names (and mlx-lm's): rope_theta and rope_scaling, not rope_parameters.
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))


def write_hf_target(path: Path, kind: str, layers: int = 4, seed: int = 0, int4: bool = True):
    """``kind``'s HF folder (config.json, safetensors, tokenizer) via ``save_pretrained``.
    ``int4=False`` stores kimi_k25's experts unpacked (the same values), which transformers reads
    without the compressed-tensors package. Returns the transformers model."""
    model = hf_model(kind, layers, seed)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3_5_moe":
        # The published Qwen3.5 MoE checkpoints keep each layer's experts fused
        # (``experts.gate_up_proj``), as transformers holds them in memory; its
        # save_pretrained would split them per expert.
        from safetensors.torch import save_file

        model.config.save_pretrained(str(path))
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    elif kind == "gpt_oss":
        _write_gpt_oss(path, model)
    elif kind == "kimi_k25":
        _write_kimi(path, model, int4)
    else:
        model.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = "float32"
    if kind in GEMMA_KINDS:
        # transformers 5.24 saves the full attention layers' head size and key/value heads
        # as a per_layer_config; the published Gemma 4 configs (and mlx-lm) use
        # global_head_dim and num_global_key_value_heads, and mlx-lm reads the vocabulary
        # size of a gemma4 checkpoint from its top level.
        text = config.get("text_config", config)
        text.pop("per_layer_config")
        text["global_head_dim"] = _GEMMA["global_head_dim"]
        if text.get("attention_k_eq_v"):
            text["num_global_key_value_heads"] = 1
        config["vocab_size"] = VOCAB
    if kind == "qwen3_moe":
        # transformers 5 saves its own names; the published Qwen3 MoE configs (and mlx-lm)
        # use the older ones.
        config["num_experts"] = config.pop("num_local_experts")
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    elif kind == "qwen3_next":
        # As the published Qwen3-Next configs have them (and mlx-lm reads them): the RoPE
        # fields at the top and the interval of full attention layers.
        rope = config.pop("rope_parameters")
        config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                      full_attention_interval=4)  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return model
