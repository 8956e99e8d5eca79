"""DFlash block-diffusion speculative decoding for MLX."""

__version__ = "0.1.0"

from .cache import DFlashCache, make_cache
from .drafter import DraftModel, ModelArgs
from .errors import DFlashError
from .generate import (
    GenerationResponse,
    StepOutput,
    dflash_generate_step,
    generate,
    stream_generate,
)
from .loading import check_pair, load

__all__ = [
    "DFlashCache",
    "DFlashError",
    "DraftModel",
    "GenerationResponse",
    "ModelArgs",
    "StepOutput",
    "__version__",
    "check_pair",
    "dflash_generate_step",
    "generate",
    "load",
    "make_cache",
    "stream_generate",
]
