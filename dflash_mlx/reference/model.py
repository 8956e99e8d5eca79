"""A plain-PyTorch DFlash drafter and its loader, for parity checks against the MLX port.

Same checkpoint format and the same semantics as ``dflash_mlx.models.drafter``: the taps are
projected by ``fc`` + ``hidden_norm`` into context keys/values (k_norm and RoPE at their
absolute positions), the block ``[last, mask, ...]`` sits right after the context, attention
is bidirectional, and only the context is cached.
"""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from ..base.errors import DFlashError

# Keys of the published checkpoints that may live under "dflash_config".
_DFLASH_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "num_target_layers",
    "input_embedding_scale",
)
# Tokens that stand for the mask when a drafter config has no mask_token_id.
_MASK_TOKENS = ("<|MASK|>", "<|mask|>", "<mask>")


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class DraftArgs:
    """The drafter's config; field names are the ``config.json`` keys."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    rope_theta: float | None = None
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None
    attention_bias: bool = False
    vocab_size: int | None = None
    num_target_layers: int | None = None
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int | None = None
    layer_types: list[str] | None = None
    input_embedding_scale: float = 1.0

    @classmethod
    def from_dict(cls, config: dict) -> "DraftArgs":
        config = dict(config)
        nested = config.get("dflash_config") or {}
        for key in _DFLASH_KEYS:
            if nested.get(key) is not None:
                config[key] = nested[key]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        rope = self.rope_parameters or {}
        if self.rope_theta is None:
            self.rope_theta = rope.get("rope_theta", 1_000_000.0)
        scaling = self.rope_scaling or rope
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise DFlashError(
                f"The PyTorch reference implements plain RoPE only, but the drafter config asks for "
                f"rope_type={scaling.get('rope_type', scaling.get('type'))!r}. Use the MLX drafter for it."
            )
        # Later drafter variants add sliding/causal layers or a scaled noise embedding; the MLX
        # drafter implements neither, so refuse them instead of computing something else.
        if any(t != "full_attention" for t in self.layer_types or []) or self.input_embedding_scale != 1.0:
            raise DFlashError(
                f"The PyTorch reference implements full-attention DFlash drafters only (got "
                f"layer_types={self.layer_types}, input_embedding_scale={self.input_embedding_scale}). "
                "Use a v1 drafter such as z-lab/Qwen3-8B-DFlash-b16."
            )
        self.target_layer_ids = list(self.target_layer_ids or [])
        if not self.target_layer_ids and self.num_target_layers:
            # The paper's rule, as in dflash_mlx.models.drafter: taps spread evenly over layers 1..L-3.
            n, start, end = self.num_hidden_layers, 1, self.num_target_layers - 3
            if n == 1:
                self.target_layer_ids = [self.num_target_layers // 2]
            else:
                self.target_layer_ids = [round(start + i * (end - start) / (n - 1)) for i in range(n)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the MLX fast kernel, then scale in the input dtype.
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope(x: torch.Tensor, offset: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``(B, heads, L, D)`` at absolute positions ``offset..offset+L-1``."""
    L, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    pos = torch.arange(offset, offset + L, device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # (L, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ContextCache:
    """One layer's context keys/values. The noisy block is never stored here."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def offset(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` context positions."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


class Attention(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        dim, hd, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim, self.theta = hd, args.rope_theta
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, args.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cache: ContextCache | None = None) -> torch.Tensor:
        B, L, _ = x.shape
        ctx_offset = cache.offset if cache is not None else 0
        # The block sits right after the whole context: [ctx..., last, mask, ...].
        block_offset = ctx_offset + ctx.shape[1]

        q = rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), block_offset, self.theta)
        k = rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), block_offset, self.theta)
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        k_ctx = rope(self.k_norm(self._heads(self.k_proj(ctx), self.n_kv_heads)), ctx_offset, self.theta)
        v_ctx = self._heads(self.v_proj(ctx), self.n_kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.update_and_fetch(k_ctx, v_ctx)
        keys = torch.cat([k_ctx.expand(B, -1, -1, -1), k], dim=2)  # (B, n_kv, Lc + L, D)
        values = torch.cat([v_ctx.expand(B, -1, -1, -1), v], dim=2)
        # Grouped-query attention: query head h reads kv head h // (n_heads / n_kv_heads).
        rep = self.n_heads // self.n_kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        # No mask: the block attends to the whole context and to itself both ways.
        out = F.scaled_dot_product_attention(q, keys, values)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, cache: ContextCache | None = None) -> torch.Tensor:
        # The context enters every layer as it comes out of hidden_norm, not re-normed.
        h = h + self.self_attn(self.input_layernorm(h), ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class ReferenceDraft(nn.Module):
    """The DFlash drafter in plain PyTorch; parameter names are the checkpoint keys."""

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        n_taps = len(args.target_layer_ids) or args.num_hidden_layers
        self.layers = nn.ModuleList([DecoderLayer(args) for _ in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids

    @property
    def mask_token_id(self) -> int | None:
        return self.args.mask_token_id

    def make_cache(self) -> list[ContextCache]:
        """Empty per-layer context caches."""
        return [ContextCache() for _ in self.layers]

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        cache: list[ContextCache] | None = None,
    ) -> torch.Tensor:
        """Run the drafter on one block per batch row.

        Args:
            noise_embedding: ``(B, L, H)`` target embeddings of ``[last, mask, ...]``.
            target_hidden: ``(1 or B, Lc, n_taps * H)`` taps of the context positions not
              yet in ``cache`` (all of them when ``cache`` is None).
            cache: Per-layer context caches; they grow by ``Lc``.

        Returns:
            ``(B, L, H)`` normed hidden states of the block.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))  # (B, Lc, H)
        h = noise_embedding
        for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, ctx, c)
        return self.norm(h)

    @torch.no_grad()
    def propose(
        self,
        target: nn.Module,
        block: torch.Tensor,
        target_hidden: torch.Tensor | None,
        cache: list[ContextCache],
    ) -> torch.Tensor:
        """Draft logits for a block, through the target's embedding and LM head.

        Args:
            target: The transformers causal LM whose embedding and head the drafter borrows.
            block: ``(1, B)`` ids ``[last, mask, ..., mask]``.
            target_hidden: Taps of context positions not yet in ``cache`` (or None).
            cache: The drafter's per-layer context caches.

        Returns:
            ``(1, B - 1, vocab)`` logits for block positions ``1..B-1``.
        """
        if target_hidden is None:
            width = len(self.target_layer_ids) * self.args.hidden_size
            target_hidden = self.fc.weight.new_zeros((1, 0, width))
        h = self(target.get_input_embeddings()(block), target_hidden, cache)
        return target.get_output_embeddings()(h[:, 1:])


def _read_config(path: Path, what: str) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise DFlashError(f"No config.json in {path}: the {what} must be a model folder.")
    return json.loads(file.read_text())


def load_draft(path: str | Path, *, device: str | torch.device | None = None, dtype=torch.float32) -> ReferenceDraft:
    """Load a z-lab-format drafter folder (config.json + *.safetensors) into a ``ReferenceDraft``.

    Raises:
        DFlashError: If the folder has no config or weights, the weights do not fit the config, or the
          drafter has a draft vocabulary (``draft_vocab_size``), which the reference does not implement.
    """
    path = Path(path)
    config = _read_config(path, "drafter")
    if config.get("draft_vocab_size") is not None:
        raise DFlashError(
            f"The drafter in {path} drafts among draft_vocab_size={config['draft_vocab_size']} token ids; the "
            "PyTorch reference drafts over the whole vocabulary only. Compare a drafter without a draft vocabulary."
        )
    draft = ReferenceDraft(DraftArgs.from_dict(config))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"No *.safetensors weights in {path}. Re-download or re-convert the drafter.")
    weights = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            k = k.removeprefix("model.")
            # Exports may carry the target's embedding or head; the drafter borrows them.
            if not k.startswith(("embed_tokens.", "lm_head.")) and "rotary_emb" not in k:
                weights[k] = v
    try:
        missing, unexpected = draft.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise DFlashError(
            f"The drafter weights in {path} do not fit its config ({str(e).splitlines()[-1].strip()}). "
            "The config and the weights do not belong together."
        ) from e
    if missing or unexpected:
        raise DFlashError(
            f"The drafter weights in {path} do not match its config: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}. Re-download or re-convert the drafter."
        )
    return draft.to(device=device or default_device(), dtype=dtype).eval()


def load_reference(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
):
    """Load a target with transformers and its drafter with the PyTorch reference.

    Only local folders are read; nothing is fetched from the hub.

    Args:
        model: The HF-format target folder.
        draft: The z-lab-format drafter folder, or None for the target alone.
        device: ``"cuda"``, ``"cpu"``, ... (default: CUDA when available, else CPU).
        dtype: The dtype of both models (fp32 by default, for parity checks).

    Returns:
        ``(target, draft, tokenizer)``: a transformers ``AutoModelForCausalLM`` (or, for a target with
        no causal-LM class, ``AutoModelForImageTextToText``) in eval mode,
        a ``ReferenceDraft`` (or None) and the target's tokenizer (or None if it has none).

    Raises:
        DFlashError: On a missing folder, or a drafter made for another target.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    device = torch.device(device) if device is not None else default_device()
    model = Path(model)
    config = _read_config(model, "target")
    # Kimi K2.5 has a vision-language class only; a text prompt goes through its text model.
    causal = config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    # use_kernels=False: transformers' own PyTorch layers, never hub kernels fetched at load time (the
    # default from transformers 5.25), so the reference stays offline and independent of other code.
    target = auto.from_pretrained(model, dtype=dtype, local_files_only=True, use_kernels=False)
    # Inference only: no gradients for the target, even when a drafter is trained against it.
    target = target.to(device).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    if draft is None:
        return target, None, tokenizer
    ref = load_draft(draft, device=device, dtype=dtype)
    # Qwen3.5's checkpoints nest the language model's fields under text_config.
    text = config.get("text_config") or config
    n_layers, a = text["num_hidden_layers"], ref.args
    if a.hidden_size != text["hidden_size"]:
        raise DFlashError(
            f"The drafter has hidden_size={a.hidden_size}, but the target has "
            f"hidden_size={text['hidden_size']}. Pass the drafter trained for this target."
        )
    if not a.target_layer_ids or not all(0 <= i < n_layers for i in a.target_layer_ids):
        raise DFlashError(
            f"The drafter taps target layers {a.target_layer_ids}, but the target has {n_layers} "
            "layers. Pass the drafter trained for this target."
        )
    if a.mask_token_id is None and tokenizer is not None:
        vocab = tokenizer.get_vocab()
        a.mask_token_id = next((vocab[t] for t in _MASK_TOKENS if t in vocab), None)
    if a.mask_token_id is None:
        raise DFlashError(
            "The drafter config has no mask_token_id and the tokenizer has no mask token; "
            "add dflash_config.mask_token_id to the drafter's config.json."
        )
    return target, ref, tokenizer
