"""The adaptive policy on injected time: a clock it reads, and a drafter whose pass costs time on it."""

from helpers.checkpoints import VOCAB
from helpers.oracles import ScriptedDraft


class Clock:
    """Seconds that move only when told to, plus ``step`` on every reading."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = 0.0, step

    def __call__(self):
        now, self.now = self.now, self.now + self.step
        return now


class CostlyDraft(ScriptedDraft):
    """A scripted drafter (an oracle, or always wrong) whose every pass costs ``seconds`` on
    ``clock``, the clock the policy reads."""

    def __init__(self, base, sequence, clock, seconds, wrong_every=0):
        super().__init__(base, sequence, VOCAB, wrong_every=wrong_every)
        self.clock, self.seconds = clock, seconds

    def propose(self, *args, **kwargs):
        self.clock.now += self.seconds
        return super().propose(*args, **kwargs)
