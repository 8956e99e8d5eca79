"""PyTorch reference implementation of DFlash (optional extra: ``mlx-dflash[reference]``).

A plain-PyTorch drafter and speculative loop on a transformers target, loaded from the
same folders as the MLX side. It exists to check the MLX port: same weights, same inputs,
same tokens. Runs on CUDA when available, else on CPU. The core library never imports it.
"""

from .generate import ReferenceOutput, ReferenceStep, forward_with_taps, reference_generate, reference_generate_step
from .model import DraftArgs, ReferenceDraft, default_device, load_draft, load_reference

__all__ = [
    "DraftArgs",
    "ReferenceDraft",
    "ReferenceOutput",
    "ReferenceStep",
    "default_device",
    "forward_with_taps",
    "load_draft",
    "load_reference",
    "reference_generate",
    "reference_generate_step",
]
