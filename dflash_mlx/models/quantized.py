"""A quantized target's verify passes through the ``verify_qmm`` kernel, on an Apple GPU.

A verify pass multiplies a few rows (the block, 2..16 tokens) by every weight of the target.
:class:`VerifyQuantizedLinear` is mlx-lm's ``nn.QuantizedLinear`` with the same parameters and
state-dict keys, whose calls of that many rows go to :data:`dflash_mlx.kernels.verify_qmm`'s
dispatcher; every other call (a prefill chunk, a one-token step) is mlx-lm's own. ``load``
swaps the layers in with :func:`use_verify_qmm`, as ``nn.quantize`` swaps in quantized ones,
and only where the kernel can run: a Metal device, kernels not ``"off"``. Elsewhere the target
keeps mlx-lm's layers unchanged.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..kernels import SelfChecked, check_kernels, verify_qmm
from ..kernels.dispatch import on_metal
from ..kernels.qmm import BITS, GROUP_SIZES, MAX_ROWS

MIN_ROWS = 2  # one row is a plain decoding step: MLX's own matrix-vector kernel is made for it


class VerifyQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose verify-pass matmuls go to the ``verify_qmm`` dispatcher.

    Build it with :meth:`from_quantized`: it takes the layer's own arrays, so the weights are
    shared, not copied, and ``parameters()`` has the same keys.

    Args:
        kernels: The dispatch mode, ``"auto"``, ``"on"`` or ``"off"``
          (:mod:`dflash_mlx.kernels.dispatch`).
        dispatcher: The kernel and its twin (tests pass one that runs the Metal source on a CPU).
    """

    def __init__(self, kernels: str = "auto", dispatcher: SelfChecked = verify_qmm):
        # Not QuantizedLinear.__init__, which draws and quantizes random weights of its own.
        nn.Module.__init__(self)
        self.kernels, self.dispatcher = kernels, dispatcher

    @classmethod
    def from_quantized(
        cls, layer: nn.QuantizedLinear, kernels: str = "auto", dispatcher: SelfChecked = verify_qmm
    ) -> "VerifyQuantizedLinear":
        """The same layer, its arrays shared, dispatching its verify-pass matmuls."""
        new = cls(kernels, dispatcher)
        new.group_size, new.bits, new.mode = layer.group_size, layer.bits, layer.mode
        for name, array in layer.items():  # weight, scales, biases and bias, whichever it has
            new[name] = array
        new.freeze()
        return new

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not MIN_ROWS <= rows <= MAX_ROWS:
            return super().__call__(x)
        out = self.dispatcher(
            x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self["biases"],
            self.group_size, self.bits, mode=self.kernels,
        )  # fmt: skip
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if "bias" in self:
            out = out + self["bias"]
        return out


def can_use_verify_qmm(layer: nn.Module) -> bool:
    """Whether ``layer`` is one the kernel computes: mlx-lm's affine ``QuantizedLinear`` with
    4 or 8 bits and groups of 32 or 64 (not an embedding, nor an expert bank)."""
    return (
        type(layer) is nn.QuantizedLinear
        and layer.mode == "affine"
        and layer.bits in BITS
        and layer.group_size in GROUP_SIZES
        and layer.get("biases") is not None
    )


def use_verify_qmm(
    model: nn.Module, kernels: str = "auto", *, metal: bool | None = None, dispatcher: SelfChecked = verify_qmm
) -> int:
    """Swap ``model``'s quantized linear layers for :class:`VerifyQuantizedLinear`, in place.

    Only where the kernel can run: on a Metal device (``metal``, None: :func:`on_metal`) and
    with ``kernels`` not ``"off"``; elsewhere nothing changes.

    Args:
        model: A loaded target.
        kernels: ``"auto"``, ``"on"`` or ``"off"``, kept by every swapped layer.
        metal: Whether kernels can run (None: ask MLX).
        dispatcher: The kernel and its twin.

    Returns:
        How many layers were swapped.

    Raises:
        DFlashError: On a bad ``kernels``, or ``"on"`` without a Metal device.
    """
    metal = on_metal() if metal is None else metal
    check_kernels(kernels, metal=metal)
    if kernels == "off" or not metal:
        return 0
    swapped = 0

    def swap(_, layer):
        nonlocal swapped
        if not can_use_verify_qmm(layer):
            return layer
        swapped += 1
        return VerifyQuantizedLinear.from_quantized(layer, kernels, dispatcher)

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return swapped
