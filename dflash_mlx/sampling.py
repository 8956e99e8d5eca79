"""Sampling for speculative decoding that keeps the target's exact output distribution.

Two ways to propose a block:
  * ``"greedy"``: the drafter's argmax. Verification samples each position from the target
    with the caller's sampler and keeps the prefix that matches. This is speculative sampling
    with a one-hot proposal, so it works with any mlx-lm sampler.
  * ``"sample"``: tokens drawn from the drafter's own distribution q, accepted with probability
    min(1, p/q); on rejection the token comes from normalize(max(p - q, 0))
    (Leviathan et al. 2023; Chen et al. 2023). This needs the target distribution p, which a
    :class:`Sampler` from :func:`make_sampler` provides.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler
from mlx_lm.sample_utils import make_sampler as _mlx_lm_make_sampler

from .base.errors import DFlashError
from .cpu import fast_math

PROPOSALS = ("greedy", "sample")
# Top-p keeps the smallest set of likeliest tokens with the mass asked for; where those are among a row's
# NUCLEUS_TOP likeliest, it is found from them alone, without sorting the vocabulary (a sort of 49,152
# logits a row costs a verify pass of 16 rows more than the target's own layers do on a 2-core CPU).
NUCLEUS_TOP = 256


@dataclass(frozen=True)
class Sampler:
    """mlx-lm's sampler (``logprobs -> ids``) that also exposes the distribution it draws from.

    XTC ("exclude top choices") is a random filter: with probability ``xtc_probability`` a
    token's draw leaves out every candidate above ``xtc_threshold`` but the least likely of
    them. Its distribution is the mixture of the two cases, which ``probs`` gives; ``__call__``
    draws each row from it on its own, as mlx-lm's one-token steps do (mlx-lm's sampler would
    toss one coin for all the rows of a verified block).
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()
    _sample: Callable = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self,
            "_sample",
            _mlx_lm_make_sampler(self.temp, self.top_p, self.min_p, self.min_tokens_to_keep, self.top_k),
        )

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.xtc_probability > 0 and not self.greedy:
            return sample_rows(self.probs(logprobs))
        return self._sample(logprobs)

    def filtered(self, logprobs: mx.array, xtc: bool = False) -> mx.array:
        """The logprobs with the filtered-out tokens at -inf, in mlx-lm's order; ``xtc`` for the
        draws where XTC's cut applies."""
        if 0 < self.top_p < 1.0:
            logprobs = top_p_filter(logprobs, self.top_p, NUCLEUS_TOP)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if xtc:
            logprobs = self._xtc_cut(logprobs)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def _xtc_cut(self, logprobs: mx.array) -> mx.array:
        # mlx-lm's apply_xtc with its coin always landing on "cut".
        probs = mx.softmax(logprobs, axis=-1)
        cut = probs > mx.where(probs > self.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        if self.xtc_special_tokens:
            cut[..., list(self.xtc_special_tokens)] = False
        return mx.where(cut, -mx.inf, logprobs)

    def probs(self, logits: mx.array, fast_exp: bool = False) -> mx.array:
        """The distribution ``__call__`` samples from, ``(..., vocab)``.

        ``logits`` may be the logprobs or the raw logits: every filter and the softmax give
        the same answer for any shift of a row, so no logsumexp is needed (on MLX's CPU
        backend each pass over the vocabulary is mostly exp). ``fast_exp`` (the CPU
        speedups) takes the softmax's exp as the fused polynomial.
        """
        logits = logits.astype(mx.float32)
        if 0 < self.top_p < 1.0:
            # mlx-lm's top-p exponentiates its input: keep it at most 0.
            logits = logits - mx.max(logits, axis=-1, keepdims=True)
        probs = fast_math.softmax(self.filtered(logits) * (1.0 / self.temp), fast_exp)
        if self.xtc_probability <= 0:
            return probs
        cut = fast_math.softmax(self.filtered(logits, xtc=True) * (1.0 / self.temp), fast_exp)
        return (1 - self.xtc_probability) * probs + self.xtc_probability * cut


def _nucleus_threshold(logits: mx.array, top_p: float, k: int) -> tuple[mx.array, mx.array]:
    # mlx-lm's rule on a row's k likeliest tokens, ascending as it sorts them: drop the tokens
    # with at least top_p of the mass above them. Exact where those tokens hold top_p of the mass, as the
    # tokens below them then all have it above them.
    top = mx.sort(mx.topk(logits, k, axis=-1), axis=-1)  # (..., k) ascending
    probs = mx.exp(top)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    needed = top_p * mx.sum(mx.exp(logits), axis=-1, keepdims=True)
    dropped = (mass_above >= needed).sum(axis=-1, keepdims=True)
    fits = mass_above[..., :1] + probs[..., :1] >= needed
    return mx.take_along_axis(top, dropped, axis=-1), fits


def top_p_filter(logprobs: mx.array, top_p: float, top: int = NUCLEUS_TOP) -> mx.array:
    """mlx-lm's ``apply_top_p`` (the same tokens kept, ties included) over every row at once, from each
    row's ``top`` likeliest tokens (a partial selection, not a sort of the vocabulary); rows whose
    nucleus is larger take mlx-lm's own sort. ``logprobs`` may be any shift of a row's logprobs at most 0.

    Reads whether every row fits on the host (one wait for the rows' logits), so that the sort is paid
    only when some row needs it."""
    if logprobs.shape[-1] <= top:
        return apply_top_p(logprobs, top_p)
    threshold, fits = _nucleus_threshold(logprobs, top_p, top)
    if not mx.all(fits).item():
        threshold = mx.where(fits, threshold, _mlx_lm_threshold(logprobs, top_p))
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def _mlx_lm_threshold(logprobs: mx.array, top_p: float) -> mx.array:
    # The least logprob mlx-lm's apply_top_p keeps in each row: its sort.
    kept = apply_top_p(logprobs, top_p)
    return mx.min(mx.where(kept == -mx.inf, mx.inf, kept), axis=-1, keepdims=True)


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    top_k: int = 0,
    min_tokens_to_keep: int = 1,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: list[int] | None = None,
) -> Sampler:
    """Make a sampler with mlx-lm's settings and semantics (``temp=0`` is greedy).

    Raises:
        DFlashError: For settings outside their ranges.
    """
    if not 0 <= xtc_probability <= 1:
        raise DFlashError(f"xtc_probability must be in [0, 1] (got {xtc_probability}); 0 turns XTC off.")
    if not 0 <= xtc_threshold <= 0.5:
        raise DFlashError(f"xtc_threshold must be in [0, 0.5] (got {xtc_threshold}).")
    if temp < 0:
        raise DFlashError(f"temp must be >= 0 (got {temp}).")
    if not 0 <= top_p <= 1:
        raise DFlashError(f"top_p must be in [0, 1] (got {top_p}); 0 or 1 turns it off.")
    if not 0 <= min_p <= 1:
        raise DFlashError(f"min_p must be in [0, 1] (got {min_p}); 0 turns it off.")
    if not isinstance(top_k, int) or top_k < 0:
        raise DFlashError(f"top_k must be a non-negative integer (got {top_k!r}); 0 turns it off.")
    special = tuple(xtc_special_tokens or ())
    return Sampler(temp, top_p, min_p, top_k, min_tokens_to_keep, xtc_probability, xtc_threshold, special)


def can_sample_proposals(sampler) -> bool:
    return isinstance(sampler, Sampler) and not sampler.greedy


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def sample_rows(weights: mx.array) -> mx.array:
    """One draw per row of ``(..., vocab)`` non-negative weights (not necessarily normalised).

    By the inverse CDF: one uniform per row against the running sum, no log or exp over the
    vocabulary (a Gumbel draw costs two logs an element). A token of weight 0 is never drawn.
    """
    cdf = mx.cumsum(weights.astype(mx.float32), axis=-1)
    total = cdf[..., -1:]
    u = mx.random.uniform(shape=total.shape) * total
    # The first index whose running sum passes u; ``cdf < total`` keeps a u rounded up to
    # the total on the last token of positive weight.
    return mx.sum((cdf <= u) & (cdf < total), axis=-1).astype(mx.uint32)


def accept_one_hot(draft_tokens: mx.array, target_tokens: mx.array) -> mx.array:
    """The acceptance test for one-hot (greedy) proposals: the target's own sample must match.

    Accepting with probability p(d) and otherwise taking the target's sample (which is then
    drawn from p without d) is exactly speculative sampling with q one-hot at d.
    """
    return draft_tokens == target_tokens[: draft_tokens.shape[0]]


def speculative_accept(draft_tokens: mx.array, q: mx.array, p: mx.array) -> tuple[mx.array, mx.array]:
    """The speculative-sampling acceptance test for one block, all on device.

    Args:
        draft_tokens: ``(k,)`` proposed ids, drawn from ``q``.
        q: ``(k, vocab)`` the drafter's distribution at each proposed position.
        p: ``(k + 1, vocab)`` the target's distribution at each position, the last one
          for the bonus token.

    Returns:
        ``(accepted, replacement)``: ``(k,)`` booleans (draft i passes its test) and
        ``(k + 1,)`` ids: at ``i < k`` a sample of normalize(max(p_i - q_i, 0)) to use if
        draft i is the first rejected one, at ``k`` the bonus token drawn from p_k.
    """
    k = draft_tokens.shape[0]
    rows = mx.arange(k)
    p_d, q_d = p[rows, draft_tokens], q[rows, draft_tokens]
    # Accept with probability min(1, p/q): u < p/q, written without dividing by q.
    accepted = mx.random.uniform(shape=(k,)) * q_d < p_d
    residual = mx.maximum(p[:k] - q, 0.0)
    # p == q leaves no residual; then p itself is the right fallback. The draw normalises.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[:k])
    return accepted, sample_rows(mx.concatenate([residual, p[k:]], axis=0))


_LOG2_E = 1.4426950408889634
_LN_2 = 0.6931471805599453


@mx.compile
def _exp_nonpositive(x: mx.array) -> mx.array:
    # 2^k * 2^f with f in [0, 1): the fraction by a degree-7 series (relative error < 4e-6),
    # 2^k written straight into the float's exponent bits. Below e^-87 it flushes to e^-87.
    y = mx.maximum(x, -87.0) * _LOG2_E
    k = mx.floor(y)
    t = (y - k) * _LN_2
    poly = 1 + t * (1 + t * (1 / 2 + t * (1 / 6 + t * (1 / 24 + t * (1 / 120 + t * (1 / 720 + t / 5040))))))
    return poly * mx.view(mx.left_shift(k.astype(mx.int32) + 127, 23), mx.float32)


def top_probability(logits: mx.array, fast_exp: bool = False) -> mx.array:
    """The probability of the most likely token, ``(..., vocab) -> (...)``.

    With ``fast_exp`` (the CPU speedups), exp is a polynomial, good to a few parts in 1e6,
    plenty for a confidence threshold: MLX's CPU exp costs about 12 ns an element (an add
    0.2 ns), so an exact softmax over 15 x 4096 logits took ~0.8 ms, on the critical path of
    a cycle; this takes ~0.3 ms.
    """
    logits = logits.astype(mx.float32)
    shifted = logits - mx.max(logits, axis=-1, keepdims=True)
    if not fast_exp:
        return 1.0 / mx.sum(mx.exp(shifted), axis=-1)
    return 1.0 / mx.sum(_exp_nonpositive(shifted), axis=-1)


def check_proposal(proposal: str) -> None:
    if proposal not in PROPOSALS:
        raise DFlashError(f"proposal must be one of {', '.join(PROPOSALS)} (got {proposal!r}).")


def is_greedy(sampler: Sampler | None) -> bool:
    """True for samplers that take the argmax: None, ours at temperature 0, mlx-lm's own."""
    return sampler is None or sampler is greedy_sampler or getattr(sampler, "greedy", False) is True
