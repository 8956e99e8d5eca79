"""Per-feature preconditioning of the drafter's ``fc`` while it trains.

Some targets have massive activations: SmolLM2's deeper taps reach 10^3-10^4 in a handful of
dimensions while the rest stay near 5. Adam moves every weight by about the learning rate,
whatever the scale of its input, so those few dimensions swamp the projected context and the
drafter learns from it slowly. Training ``W' = W / s`` on inputs ``x * s``, where ``s`` shrinks
only the outsized dimensions, is the same function under a better-conditioned optimizer. What
is saved is the folded ``W = W' * s``: the drafter stays a plain z-lab checkpoint.
"""

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

# The first positions of a sequence are attention sinks, with activations far beyond the rest.
SINK_POSITIONS = 4


class ScaledLinear(nn.Module):
    """``x @ (weight * scale).T`` with only ``weight`` trainable (``scale`` is frozen)."""

    def __init__(self, weight: mx.array, scale: mx.array):
        super().__init__()
        self.weight = weight
        self.scale = scale
        self.freeze(keys=["scale"], recurse=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale: mx.array) -> "ScaledLinear":
        return cls(linear.weight / scale, scale)

    def __call__(self, x: mx.array) -> mx.array:
        return (x * self.scale) @ self.weight.T

    def folded(self) -> nn.Linear:
        out_dims, in_dims = self.weight.shape
        linear = nn.Linear(in_dims, out_dims, bias=False)
        linear.weight = self.weight * self.scale
        return linear


def feature_scale(taps: list[mx.array]) -> mx.array:
    """``min(1, median RMS / RMS)`` per feature over the taps ``(1, L, D)`` of a few examples,
    leaving out their attention-sink positions: 1 for ordinary features, below 1 for outsized ones."""
    x = mx.concatenate([t[0, SINK_POSITIONS:] for t in taps], axis=0)
    rms = mx.sqrt(mx.mean(x.astype(mx.float32) ** 2, axis=0)) + 1e-6
    median = mx.sort(rms)[rms.size // 2]
    return mx.minimum(1.0, median / rms).astype(x.dtype)


@contextmanager
def folded_fc(draft):
    """The drafter with a plain ``fc`` (the folded weights) inside the block, e.g. to save it."""
    scaled = draft.fc
    if not isinstance(scaled, ScaledLinear):
        yield draft
        return
    draft.fc = scaled.folded()
    try:
        yield draft
    finally:
        draft.fc = scaled
