"""Tiny fp32 targets built the same on every rank, and the program each rank of a multi-rank test
runs: ``python sharded.py KIND:MODE[:SEED] ...`` prints, for each case, one JSON line with this
rank's DFlash tokens on the sharded target and (rank 0's) an unsharded run's: plain greedy, or with
a SEED DFlash sampling at temperature 1 from that seed. ``KIND:tree`` runs a draft tree's target pass
on a pipeline instead (:func:`tree_pass`)."""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_mlx.generation import dflash_generate_step  # noqa: E402
from dflash_mlx.loading.sharding import pipeline  # noqa: E402
from dflash_mlx.loop.options import LoopOptions  # noqa: E402
from dflash_mlx.models.drafter import DraftArgs, DraftModel  # noqa: E402
from dflash_mlx.sampling import make_sampler  # noqa: E402
from helpers.checkpoints import HIDDEN, VOCAB, draft_config  # noqa: E402

LAYERS = 4
COMMON = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
    "num_hidden_layers": LAYERS, "rope_theta": 10000.0,
}  # fmt: skip
CONFIGS = {
    "qwen3": {**COMMON, "model_type": "qwen3", "tie_word_embeddings": True},
    # Heads, KV heads and MLP width that split 3 ways as well as 2 (the tied head is not split).
    "qwen3_6h": {**COMMON, "model_type": "qwen3", "tie_word_embeddings": True, "num_attention_heads": 6,
                 "num_key_value_heads": 3, "intermediate_size": 96},
    "qwen3_moe": {**COMMON, "model_type": "qwen3_moe", "tie_word_embeddings": False, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True},
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {
        **COMMON, "model_type": "qwen3_5_text", "tie_word_embeddings": False, "full_attention_interval": 2,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0]}}},
    # Alternating sliding window (of fewer positions than the prompt) and full attention layers.
    "llama": {**COMMON, "model_type": "llama", "tie_word_embeddings": False, "sliding_window": 3,
              "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2)},
    "gpt_oss": {**COMMON, "model_type": "gpt_oss", "intermediate_size": 96, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 3,
                "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2)},
    # Per-layer inputs; with kv, the last layer reuses layer 1's keys and values (rank 0 runs layers 1..3).
    "gemma4": {**COMMON, "model_type": "gemma4_text", "global_head_dim": 32, "sliding_window": 3,
               "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2), "num_kv_shared_layers": 0,
               "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "final_logit_softcapping": 5.0},
    "kimi_k25": {"model_type": "kimi_k25", "text_config": {
        **COMMON, "model_type": "deepseek_v3", "num_key_value_heads": 4, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}},
}  # fmt: skip
CONFIGS["gemma4_kv"] = {**CONFIGS["gemma4"], "num_kv_shared_layers": 1}
TAP_IDS = (0, 2, 3)  # on every stage of a 2- or 3-rank pipeline, and the last layer
PROMPT = [5, 17, 42, 9, 88, 3, 61, 27]


def build_target(kind: str, seed: int = 0):
    """The same random target on every rank (larger embeddings, sharper attention: far from ties)."""
    from mlx_lm.utils import _get_classes

    config = CONFIGS[kind]
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    inner = model.model
    gemma = kind.startswith("gemma")
    # Gemma scales its embedding up by sqrt(hidden) and norms each block's output: a smaller
    # embedding and larger block outputs, or the blocks would be drowned by the token's own.
    inner.embed_tokens.weight = mx.random.normal(inner.embed_tokens.weight.shape) * (0.15 if gemma else 0.5)
    post = 4.0 if gemma else 1.0

    # Layers that change the residual stream more than mlx-lm's init does, so that the tokens
    # depend on the whole context (a tied head would otherwise echo the last token).
    def scaled(k: str, w: mx.array) -> mx.array:
        if k.endswith("weight") and w.ndim >= 2:
            return w * 3.0
        return w * post if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")) else w

    layers = tree_map_with_path(scaled, inner.layers)
    inner.update({"layers": layers})
    mx.eval(model.parameters())
    return model


def build_draft(seed: int = 1) -> DraftModel:
    mx.random.seed(seed)
    draft = DraftModel(
        DraftArgs.from_dict(draft_config(num_target_layers=LAYERS, block_size=4, target_layer_ids=TAP_IDS))
    )
    mx.eval(draft.parameters())
    return draft


def write_pair(root: Path, kind: str) -> tuple[Path, Path]:
    """``build_target(kind)`` saved as an MLX target folder with a tokenizer, and a drafter for it."""
    from mlx.utils import tree_flatten

    from helpers.checkpoints import write_draft, write_tokenizer

    target = root / kind
    target.mkdir(parents=True)
    weights = dict(tree_flatten(build_target(kind).parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    (target / "config.json").write_text(json.dumps({**CONFIGS[kind], "torch_dtype": "float32"}, indent=2))
    write_tokenizer(target)
    write_draft(root / "draft", num_target_layers=LAYERS, block_size=4, target_layer_ids=TAP_IDS)
    return target, root / "draft"


def split_weights(folder: Path) -> list[str]:
    """``folder``'s model.safetensors as a sharded checkpoint: the tensors of no layer in its first
    file, then one file per layer, with the index. Returns the file names, in that order."""
    import re

    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    groups = [{}] + [{} for _ in range(LAYERS)]
    for name, w in weights.items():
        m = re.search(r"\.layers\.(\d+)\.", name)
        groups[0 if m is None else int(m.group(1)) + 1][name] = w
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for file, group in zip(files, groups):
        mx.save_safetensors(str(folder / file), group, metadata={"format": "mlx"})
    weight_map = {name: file for file, group in zip(files, groups) for name in group}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def tokens(model, draft, max_tokens: int, started: str | None = None, **kwargs) -> list[int]:
    out = []
    for step in dflash_generate_step(PROMPT, model, draft, LoopOptions(max_tokens=max_tokens, **kwargs)):
        if started is not None and not out:
            print(started, flush=True)  # the first cycle is done: the generation is under way on every rank
        out += step.tokens
    return out


def tree_pass(model) -> list[int]:
    """A draft tree's pass after the prompt (the model's side of a tree cycle): each node's greedy
    token, then the largest entry of each node's taps."""
    from dflash_mlx.models.families import make_target_cache
    from dflash_mlx.models.target import forward_with_taps
    from dflash_mlx.models.tree import DraftTree

    cache = make_target_cache(model)
    # Evaluated whole, as the loop does: a pipeline's hand-offs are in the graph of what the pass returns.
    mx.eval(forward_with_taps(model, mx.array([PROMPT[:-1]]), cache, list(TAP_IDS)))
    tree = DraftTree(tokens=[7, 9, 11, 13, 15], parents=[-1, 0, 0, 1, 1, 3], depths=[1, 1, 2, 2, 3])
    logits, taps = forward_with_taps(model, mx.array([PROMPT[-1:] + tree.tokens]), cache, list(TAP_IDS), tree=tree)
    return mx.argmax(logits[0], axis=-1).tolist() + mx.argmax(taps[0], axis=-1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+", help="KIND:MODE[:SEED], e.g. qwen3_5:tensor, qwen3_5:pipeline:7 or "
                        "llama:tree (a draft tree's pass on a pipeline)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-reference", action="store_true", help="skip the unsharded run")
    args = parser.parse_args()
    group = mx.distributed.init(strict=True)
    for case in args.cases:
        kind, mode, *seed = case.split(":")
        oracle = seed == ["oracle"]
        seed = [] if oracle else seed
        sampler = make_sampler(1.0) if seed else None
        run = dict(sampler=sampler, seed=int(seed[0]) if seed else None, adaptive=False)
        # The unsharded reference first: plain greedy, or DFlash with the same seed when sampling. Rank 0's
        # alone (the others' tokens are checked against it), but for an oracle, which every rank drafts from.
        reference = None
        if not args.no_reference and (group.rank() == 0 or oracle):
            if mode == "tree":
                reference = tree_pass(build_target(kind))
            else:
                reference = tokens(build_target(kind), build_draft() if sampler else None, args.max_tokens, **run)
        model = build_target(kind)
        if mode == "tensor":
            model.shard(group)
        else:
            pipeline(model, group)
        if mode == "tree":  # a pipeline's
            print(json.dumps({"case": case, "rank": group.rank(), "reference": reference, "tokens": tree_pass(model)}))
            continue
        started = json.dumps({"case": case, "rank": group.rank(), "started": True})
        draft = build_draft()
        if oracle:
            from helpers.oracles import ScriptedDraft

            draft = ScriptedDraft(draft, PROMPT + reference, VOCAB)
        out = tokens(model, draft, args.max_tokens, started=started, **run)
        print(json.dumps({"case": case, "rank": group.rank(), "reference": reference, "tokens": out}), flush=True)


if __name__ == "__main__":
    main()
