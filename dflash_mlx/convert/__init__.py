"""dflash-convert: Hugging Face checkpoints to MLX, targets and DFlash drafters."""

from ..loading.registry import KNOWN_PAIRS, KnownPair, find_draft, find_pair, known_targets
from .convert import CheckResult, ConvertResult, check_converted, convert

__all__ = [
    "CheckResult",
    "ConvertResult",
    "KNOWN_PAIRS",
    "KnownPair",
    "check_converted",
    "convert",
    "find_draft",
    "find_pair",
    "known_targets",
]
