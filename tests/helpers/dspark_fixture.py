"""The trained DSpark fixture's drafts per block as the authors' code makes them, saved beside it
(tests/fixtures/families/dspark_blocks.npz, written by recipes/rebuild/dspark_fixture_blocks.py), so that
a test sees the slot layout against the authors' numbers without their code on the path."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx import load, make_cache
from dflash_mlx.models import target as tgt

from .decoding import greedy

FIXTURES = Path(__file__).parent.parent / "fixtures" / "families"
SAVED = FIXTURES / "dspark_blocks.npz"
PROMPTS = Path(__file__).parent.parent.parent / "dflash_mlx" / "assets" / "dflash-tiny" / "prompts.jsonl"
TOP = 16  # logits kept per slot: each slot's most likely ids by the authors' base logits
ANCHORS = 6


def toy_pair():
    """The toy target (float32) and the trained DSpark fixture on it, and the first prompt's ids."""
    model, draft, tokenizer = load("dflash-tiny", FIXTURES / "dspark", dtype="float32")
    row = json.loads(PROMPTS.read_text().splitlines()[0])
    prompt = (
        tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True)
        if "messages" in row
        else tokenizer.encode(row["prompt"])
    )
    return model, draft, prompt


def sequence_and_taps(model, draft, prompt: list[int]) -> tuple[list[int], mx.array, list[int]]:
    """The prompt and the target's greedy reply, its taps, and the anchors (spread over the reply)."""
    sequence = prompt + greedy(model, prompt, 24)
    _, taps = tgt.forward_with_taps(model, mx.array([sequence]), make_cache(model).target, draft.target_layer_ids)
    last = len(sequence) - draft.args.block_size - 1
    anchors = np.linspace(len(prompt) - 1, last, ANCHORS).astype(int).tolist()
    return sequence, taps, anchors


def authors_blocks(deepspec_src: str) -> dict[str, np.ndarray]:
    """Per anchor, the authors' ``Qwen3DSparkModel`` (from ``deepspec_src``) on the fixture's weights: each
    slot's top ``TOP`` ids by base logits, those base logits, the Markov-corrected logits there and the
    greedy drafts (their ``sample_draft_tokens``)."""
    import sys

    import torch

    sys.path.insert(0, deepspec_src)
    try:
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    finally:
        sys.path.remove(deepspec_src)
    model, draft, prompt = toy_pair()
    sequence, taps, anchors = sequence_and_taps(model, draft, prompt)
    theirs = Qwen3DSparkModel.from_pretrained(str(FIXTURES / "dspark"), torch_dtype=torch.float32).eval()
    vocab = tgt.vocab_size(model)
    embedding = torch.nn.Embedding.from_pretrained(torch.tensor(np.array(tgt.embed(model, mx.arange(vocab)))))
    head = torch.nn.Linear(tgt.hidden_size(model), vocab, bias=False)
    head.weight.data = torch.tensor(np.array(tgt.head_weight(model).astype(mx.float32)))
    theirs.initialize_embeddings_and_head(embed_tokens=embedding, lm_head=head)
    B, out = draft.args.block_size, {"sequence": np.array(sequence), "anchors": np.array(anchors)}
    ids, base, corrected, drafts = [], [], [], []
    torch_taps = torch.tensor(np.array(taps))
    for p in anchors:
        block = torch.tensor([[sequence[p]] + [draft.mask_token_id] * (B - 1)])
        with torch.no_grad():
            h = theirs._forward_backbone(position_ids=torch.arange(p + B)[None], noise_embedding=theirs.embed_tokens(block),
                                         target_hidden_states=torch_taps[:, :p], is_causal=False)  # fmt: skip
            logits = theirs.compute_logits(h)
            tokens, step = theirs.sample_draft_tokens(logits, first_prev_token_ids=block[:, 0], hidden_states=h)
        top = torch.topk(logits[0], TOP, dim=-1).indices
        ids.append(top.numpy())
        base.append(torch.gather(logits[0], -1, top).numpy())
        corrected.append(torch.gather(step[0], -1, top).numpy())
        drafts.append(tokens[0].numpy())
    out.update(ids=np.stack(ids), base=np.stack(base), corrected=np.stack(corrected), drafts=np.stack(drafts))
    return out


def our_blocks(model, draft, sequence: list[int], taps: mx.array, anchors: list[int]) -> dict[str, np.ndarray]:
    """Per anchor, our drafter as the loop drafts with it (the context in its cache, then ``draft_steps``):
    the base and Markov-corrected logits of every slot, and the greedy drafts."""
    B, base, corrected, drafts = draft.args.block_size, [], [], []
    for p in anchors:
        cache = make_cache(model, draft)
        draft.extend_context(taps[:, :p], cache.draft)
        block = mx.array([[sequence[p]] + [draft.mask_token_id] * B])  # the loop's block: B + 1 ids
        d, _, logits, _ = draft.draft_steps(model, block, None, cache.draft, B)
        base.append(np.array(draft.propose(model, block, None, cache.draft)[0]))
        corrected.append(np.array(logits))
        drafts.append(np.array(d))
    return {"base": np.stack(base), "corrected": np.stack(corrected), "drafts": np.stack(drafts)}
