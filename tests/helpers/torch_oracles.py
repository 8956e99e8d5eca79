"""PyTorch drafters that agree with the target often, so that acceptance lengths > 1 get compared."""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dflash_mlx.reference import ReferenceDraft
from dflash_mlx.reference.generate import forward_with_taps


class ScriptedReferenceDraft(ReferenceDraft):
    """tests/helpers/oracles.py's ScriptedDraft in PyTorch: proposes a fixed continuation (the target's
    own greedy tokens), corrupted every ``wrong_every`` positions, after a real drafter pass."""

    def __init__(self, base: ReferenceDraft, sequence: list[int], vocab: int, wrong_every: int = 0):
        super().__init__(base.args)
        self.load_state_dict(base.state_dict())
        self.to(base.fc.weight.device)
        self.sequence, self.vocab, self.wrong_every = sequence, vocab, wrong_every

    def propose(self, target, block, taps, cache):
        super().propose(target, block, taps, cache)  # keeps the context cache real
        start = cache[0].offset  # absolute position of block[0]
        ids = []
        for pos in range(start + 1, start + block.shape[1]):
            tok = self.sequence[pos] if pos < len(self.sequence) else 0
            if self.wrong_every == 1 or (self.wrong_every and pos % self.wrong_every == 0):
                tok = (tok + 1) % self.vocab
            ids.append(tok)
        return torch.eye(self.vocab, device=block.device)[ids][None] * 10.0


def fit_to_sequence(draft, block_logits, sequence: list[int], *, steps: int, lr: float, seed: int, device=None):
    """Fit ``draft`` (in place) to denoise blocks of ``sequence``, the target's own greedy text.

    Each anchor ``p`` is trained exactly as it is used: context = taps of positions ``< p``,
    block = ``[sequence[p], mask, ...]`` at position ``p``, labels ``sequence[p+1 : p+B]``;
    ``block_logits(p, block)`` runs the drafter that way and returns ``(B - 1, vocab)`` logits.
    """
    B, mask_id = draft.block_size, draft.mask_token_id
    anchors = list(range(1, len(sequence) - B))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    draft.train()
    for _ in range(steps):
        loss = 0.0
        for i in torch.randperm(len(anchors), generator=gen)[:4].tolist():
            p = anchors[i]
            block = torch.tensor([[sequence[p]] + [mask_id] * (B - 1)], device=device)
            labels = torch.tensor(sequence[p + 1 : p + B], device=device)
            loss = loss + F.cross_entropy(block_logits(p, block), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.zero_grad(set_to_none=True)
    return draft.eval()


def train_agreeing_draft(
    draft: ReferenceDraft, target, sequence: list[int], *, steps: int = 60, lr: float = 3e-3, seed: int = 0
) -> ReferenceDraft:
    """Our PyTorch reference drafter fitted to ``sequence`` (:func:`fit_to_sequence`)."""
    device = draft.fc.weight.device
    with torch.no_grad():
        _, taps = forward_with_taps(
            target, torch.tensor([sequence], device=device), DynamicCache(config=target.config), draft.target_layer_ids
        )
        embed = target.get_input_embeddings()
        head_weight = target.get_output_embeddings().weight.detach()

    def block_logits(p, block):
        with torch.no_grad():
            noise = embed(block)
        return F.linear(draft(noise, taps[:, :p])[0, 1:], head_weight)

    return fit_to_sequence(draft, block_logits, sequence, steps=steps, lr=lr, seed=seed, device=device)
