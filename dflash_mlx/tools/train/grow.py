"""A deeper drafter grown from a trained one, drafting exactly as it did until training moves it.

On a CPU a drafter's depth is bought with hours of training; growing keeps what the shallower
drafter learned instead of starting the deeper one from random weights. The added layers go
after the trained ones with their attention's and MLP's output projections at zero: each adds
nothing to the residual stream, so the grown drafter's hidden states, and its drafts, are the
trained one's at step 0 (the pre-norm layers need no other change).
"""

import dataclasses

import mlx.core as mx
from mlx.utils import tree_flatten

from ...base.errors import DFlashError
from ...models.drafter import DraftModel


def deepen(draft: DraftModel, num_layers: int) -> DraftModel:
    """``draft`` with layers added after its own up to ``num_layers``, each an identity at first."""
    have = len(draft.layers)
    if type(draft) is not DraftModel:
        raise DFlashError("Only a DFlash (v1) drafter can be grown; train this one at its own --num-layers.")
    if num_layers < have:
        raise DFlashError(
            f"The starting drafter has {have} layers and --num-layers asks for {num_layers}: a drafter can only "
            f"be grown. Pass --num-layers {have} or more."
        )
    if draft.args.layer_types is not None:
        raise DFlashError(
            "The starting drafter names a type for each of its layers (layer_types); grow only drafters without."
        )
    grown = DraftModel(dataclasses.replace(draft.args, num_hidden_layers=num_layers))
    # Its trained weights in place (the added layers keep their fresh ones), then the added
    # layers' outputs switched off.
    grown.load_weights(tree_flatten(draft.parameters()), strict=False)
    for layer in grown.layers[have:]:
        for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
            out.update({name: mx.zeros_like(value) for name, value in out.parameters().items()})
    grown.set_dtype(draft.fc.weight.dtype)
    return grown
