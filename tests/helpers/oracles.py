"""Drafters with known behaviour, built on the real DraftModel so the caches stay real."""

import mlx.core as mx

from dflash_mlx.models.drafter import DraftModel


class ScriptedDraft(DraftModel):
    """Proposes a fixed continuation: the target's own greedy tokens (an oracle), optionally
    corrupted at some positions, or always wrong. With ``unsure_every`` the drafts at those
    positions stay right but get a low probability (a weak peak instead of a sharp one)."""

    def __init__(self, base: DraftModel, sequence: list[int], vocab: int, wrong_every: int = 0, unsure_every: int = 0):
        super().__init__(base.args)
        self.update(base.parameters())
        self.sequence, self.vocab, self.wrong_every = sequence, vocab, wrong_every
        self.unsure_every = unsure_every

    def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
        # A real pass first: it keeps the context cache real.
        mx.eval(super().propose(model, block, taps, cache, speedups=speedups, num_drafts=num_drafts))
        start = cache[0].offset  # absolute position of block[0]
        ids, peaks = [], []
        for pos in range(start + 1, start + block.shape[1]):
            peaks.append(0.5 if self.unsure_every and pos % self.unsure_every == 0 else 10.0)
            tok = self.sequence[pos] if pos < len(self.sequence) else 0
            if self.wrong_every == 1 or (self.wrong_every and pos % self.wrong_every == 0):
                tok = (tok + 1) % self.vocab
            ids.append(tok)
        return mx.eye(self.vocab)[mx.array(ids)][None] * mx.array(peaks)[None, :, None]


class AcceptExactlyDraft(ScriptedDraft):
    """Right for exactly ``schedule[i % len(schedule)]`` drafts in its i-th pass, then wrong:
    the target keeps exactly that many, so every rollback length can be exercised."""

    def __init__(self, base: DraftModel, sequence: list[int], vocab: int, schedule: list[int]):
        super().__init__(base, sequence, vocab)
        self.schedule, self.passes = schedule, 0

    def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
        right = self.schedule[self.passes % len(self.schedule)]
        self.passes += 1
        logits = super().propose(model, block, taps, cache, speedups, num_drafts)
        ids = mx.argmax(logits[0], axis=-1)
        wrong = mx.arange(ids.shape[0]) >= right
        ids = mx.where(wrong, (ids + 1) % self.vocab, ids)
        return mx.eye(self.vocab)[ids][None] * 10.0


class SecondChoiceDraft(ScriptedDraft):
    """The target's own continuation, except that at the block's first position a wrong token is
    the first choice (probability about 0.6) and the right one the second (about 0.4): a path is
    always rejected at once, a draft tree with a branch there is accepted down that branch."""

    def propose(self, model, block, taps, cache, speedups=None, num_drafts=None):
        logits = super().propose(model, block, taps, cache, speedups, num_drafts)
        right = mx.argmax(logits[0, 0]).item()
        wrong = (right + 1) % self.vocab
        first = mx.zeros((self.vocab,)).at[mx.array([right, wrong])].add(mx.array([9.6, 10.0]))
        return mx.concatenate([first[None, None], logits[:, 1:]], axis=1)
