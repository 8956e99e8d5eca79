import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.tools.train.precondition import SINK_POSITIONS, ScaledLinear, feature_scale, folded_fc


def test_scaled_linear_is_the_same_function_and_folds_back():
    linear = nn.Linear(12, 5, bias=False)
    scale = mx.array([1.0] * 10 + [0.01, 0.001])
    scaled = ScaledLinear.from_linear(linear, scale)
    x = mx.random.normal((3, 12)) * mx.array([1.0] * 10 + [100.0, 1000.0])
    assert mx.allclose(scaled(x), linear(x), rtol=1e-4, atol=1e-3)
    assert mx.allclose(scaled.folded().weight, linear.weight, atol=1e-6)
    # Only the weight trains; the outsized features' weights are scaled up for the optimizer.
    assert set(dict(nn.utils.tree_flatten(scaled.trainable_parameters()))) == {"weight"}
    assert mx.allclose(scaled.weight[:, 11], linear.weight[:, 11] * 1000, rtol=1e-5)


def test_feature_scale_shrinks_only_the_outsized_features():
    x = mx.random.normal((1, 40, 8))
    x = x.at[:, :, 3].multiply(500.0)  # a massive activation
    x = x.at[:, :SINK_POSITIONS, 5].multiply(1e4)  # a sink: its first positions are left out
    s = feature_scale([x, x * 1.1])
    assert s[3].item() < 0.01 and all(abs(s[i].item() - 1.0) < 0.6 for i in (0, 1, 2, 4, 5, 6, 7))
    assert mx.all(s <= 1.0).item()


def test_folded_fc_swaps_a_plain_fc_in_and_back():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = ScaledLinear.from_linear(nn.Linear(4, 2, bias=False), mx.array([1.0, 1.0, 0.5, 0.1]))

    holder = Holder()
    with folded_fc(holder) as h:
        assert type(h.fc) is nn.Linear and set(dict(nn.utils.tree_flatten(h.parameters()))) == {"fc.weight"}
    assert isinstance(holder.fc, ScaledLinear)
