"""What proposes a DSpark drafter's drafts: every slot of one pass, through the Markov steps, cut
by the confidence head (:mod:`dflash_mlx.models.dspark`)."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..loop.cache import DFlashCache
from ..loop.proposal import Proposal
from ..models import dspark
from .proposer import DFlashProposer


class DSparkProposer(DFlashProposer):
    """A DSpark drafter's drafts: one pass over ``[last, MASK x (B-1)]``, then each slot's draft
    from its logits plus the Markov bias of the draft before it (the argmax, or with ``sampler`` a
    draw from the filtered distribution, which ``q`` then states given the drafts before).

    The drafts stop before the first slot whose confidence is under ``threshold`` (0: never, the
    reference's default), possibly at none: the cut depends on the drafter alone, so verifying
    the shorter block is still exact. ``min_confidence`` and ``width`` then act on the
    Markov-corrected distributions, as on DFlash's.
    """

    def __init__(self, model: nn.Module, draft: dspark.DraftModel, cache: DFlashCache, *, threshold: float = 0.0,
                 **kwargs):  # fmt: skip
        super().__init__(model, draft, cache, **kwargs)
        self.threshold = threshold

    def propose(self, last: int, n: int) -> Proposal:
        block = mx.array([[last] + [self.draft.mask_token_id] * (self.draft.args.block_size - 1)], dtype=mx.uint32)
        if self.width is not None:
            self.width.costs()  # measured before this pass's taps leave pending, if the bucket is new
        taps = self.cache.take_pending()
        probs = None if self.sampler is None else partial(self.sampler.probs, fast_exp=self._fast_exp)
        drafts, q, logits, confidence = self.draft.draft_steps(
            self.model, block, taps, self.cache.draft, n, probs, self.speedups
        )
        if confidence is not None and self.threshold > 0:
            k = dspark.confident_count(confidence, self.threshold)
            drafts, q, logits = drafts[:k], None if q is None else q[:k], logits[:k]
        if self.width is not None and drafts.shape[0] > 1:
            k = self.width.choose(self._confidences(logits, drafts, q).tolist())
            drafts, q = drafts[:k], None if q is None else q[:k]
        elif self.min_confidence > 0 and drafts.shape[0] > 1:
            drafts, q = self._confident_prefix(logits, drafts, q)
        mx.async_eval(drafts)
        return Proposal(drafts, q, "drafter")
