"""Train the byte-level BPE tokenizer of the tiny target on the train split.

python recipes/rebuild/train_tokenizer.py --data runs/data --out assets/dflash-tiny/target
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Fixed order, so the ids are 0..3 and stable across rebuilds.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def iter_texts(path: Path):
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            if "text" in ex:
                yield ex["text"]
            else:
                for m in ex["messages"]:
                    yield m["content"]


def main():
    parser = argparse.ArgumentParser(description="Train the tiny target's BPE tokenizer.")
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("runs/data"),
        help="Folder with train.jsonl.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("assets/dflash-tiny/target"),
        help="Output folder.",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="Vocabulary size, special tokens included.",
    )
    args = parser.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(args.data / "train.jsonl"), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    args.out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(args.out)

    # Keep the template inside tokenizer_config.json, where older loaders look for it.
    config_path = args.out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    # The generic fast class loads under both transformers 4.x and 5.x.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = ["<|im_start|>", "<|mask|>"]
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (args.out / "chat_template.jinja").unlink(missing_ok=True)
    # Newer transformers no longer writes special_tokens_map.json; mlx-lm and older loaders still read it.
    special_map = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|mask|>"],
    }
    (args.out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")

    print({t: tok.token_to_id(t) for t in SPECIAL_TOKENS}, "vocab", tok.get_vocab_size())


if __name__ == "__main__":
    main()
