"""How many drafts each row of a batched pass may verify: measured pass costs against expected acceptance.

A batched target pass over ``B`` rows of width ``W`` (each row's last token and up to ``W - 1`` drafts, shorter
rows padded) costs about ``a + b * B * W`` seconds on a CPU, and more per row at a larger batch than at one:
a draft that pays at one request can cost the others more than it gives once several run. Each cycle every row
proposes what it would alone (its proposer sizes its own drafts, prompt lookup's and the datastore's as long as
the text goes on), and the engine asks :meth:`BatchCosts.width` for the width, the one cut of all of them, that
gives the most expected tokens per second over all rows, from

* the seconds of the passes it timed, by batch size and width (a running mean each, held to a line fitted over
  all of them, recent passes weighing most, so a width never run is costed from the line), and
* each row's expected acceptance: the chance that its next draft is right given the ones before were
  (:class:`RowAcceptance`, learned per row from its verdicts; a new row starts from what finished rows
  taught).

* what each row proposed: a row with fewer drafts than a width verifies only those, and one with none takes a
  plain step in the pass.

Width 1 is plain batched decoding. Drafts are verified exactly whatever the width, so the choice changes speed,
never output. Plain Python only.
"""

from dataclasses import dataclass, field

# Widths tried: plain, then up to a drafter's block.
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
# Starting cost line, seconds = A + B_TOKEN * tokens: the default pair on a 2-core CPU with OpenBLAS
# (one token about 60 ms, each further token of the pass about 5 ms), until passes are timed.
A_PRIOR, B_PRIOR = 0.055, 0.005
DECAY = 0.97  # weight of past passes in the fit and the means, per pass
PRIOR_WEIGHT = 2.0  # passes' worth of weight the line has against a size's own mean


@dataclass
class RowAcceptance:
    """A row's drafts so far: how often a draft was right given the ones before it (successes, trials)."""

    right: float = 1.0
    tried: float = 2.0

    @property
    def chance(self) -> float:
        return self.right / self.tried

    def judged(self, drafted: int, accepted: int) -> None:
        """A cycle verified ``drafted`` drafts and kept the first ``accepted``."""
        if drafted == 0:
            return
        self.right += accepted
        self.tried += accepted + (accepted < drafted)

    def expected(self, drafts: int) -> float:
        """Tokens a cycle of ``drafts`` drafts gives on average: ``1 + c + c^2 + ...``."""
        c, alive, total = self.chance, 1.0, 1.0
        for _ in range(drafts):
            alive *= c
            total += alive
        return total


@dataclass
class BatchCosts:
    """Seconds of batched target passes, learned as they are timed, and the width they make best."""

    # Weighted sums of 1, x, y, x * x and x * y with x = tokens in the pass (B * W) and y = seconds.
    fit: list = field(default_factory=lambda: [0.0] * 5)
    means: dict = field(default_factory=dict)  # (B, W) -> (weight, weighted seconds)
    passes: int = 0

    def line(self, tokens: int) -> float:
        w, sx, sy, sxx, sxy = self.fit
        # The prior as PRIOR_WEIGHT passes at one token and as many at 16 tokens, its shape scaled to the passes
        # timed so far: a machine or model k times as fast is k times as fast at every size until passes of
        # other sizes say otherwise (a prior in seconds would keep a fast model from ever trying a wide pass).
        scale = sy / (A_PRIOR * w + B_PRIOR * sx) if w > 0 else 1.0
        a0, b0 = A_PRIOR * scale, B_PRIOR * scale
        pw = PRIOR_WEIGHT
        x1, x2 = 1.0, 16.0
        w, sx, sy = w + 2 * pw, sx + pw * (x1 + x2), sy + pw * (2 * a0 + b0 * (x1 + x2))
        sxx = sxx + pw * (x1 * x1 + x2 * x2)
        sxy = sxy + pw * (x1 * (a0 + b0 * x1) + x2 * (a0 + b0 * x2))
        det = w * sxx - sx * sx
        b = (w * sxy - sx * sy) / det if det > 0 else b0
        b = max(b, 0.0)
        a = (sy - b * sx) / w
        return a + b * tokens

    def seconds(self, rows: int, width: int) -> float:
        """Expected seconds of a pass over ``rows`` rows of ``width`` tokens."""
        line = self.line(rows * width)
        weight, total = self.means.get((rows, width), (0.0, 0.0))
        return (total + PRIOR_WEIGHT * line) / (weight + PRIOR_WEIGHT)

    def timed(self, rows: int, width: int, seconds: float) -> None:
        """A pass over ``rows`` rows of ``width`` tokens took ``seconds``."""
        x = float(rows * width)
        self.fit = [DECAY * v for v in self.fit]
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            self.fit[i] += v
        weight, total = self.means.get((rows, width), (0.0, 0.0))
        self.means[(rows, width)] = (DECAY * weight + 1.0, DECAY * total + seconds)
        self.passes += 1

    def width(self, rows: list[RowAcceptance], sizes: list[int]) -> int:
        """The width with the most expected tokens per second over ``rows``, row ``i`` verifying the first
        ``width - 1`` of the ``sizes[i]`` drafts it proposed (all of them if fewer)."""
        best, best_rate = 1, 0.0
        for w in WIDTHS:
            if w > 1 + max(sizes, default=0):
                break
            tokens = sum(r.expected(min(s, w - 1)) for r, s in zip(rows, sizes))
            rate = tokens / self.seconds(len(rows), w)
            if rate > best_rate:
                best, best_rate = w, rate
        return best
