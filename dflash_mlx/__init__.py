"""DFlash block-diffusion speculative decoding for MLX."""

import sys
from importlib import import_module
from types import ModuleType

__version__ = "0.1.0"

# Each public name and the module that defines it. They load on first use: importing mlx,
# mlx-lm and transformers takes seconds, and the console scripts must handle Ctrl+C before that.
_EXPORTS = {
    "DFlashCache": "cache",
    "make_cache": "cache",
    "DraftModel": "models.drafter",
    "DraftArgs": "models.drafter",
    "DFlashError": "errors",
    "AcceptanceStats": "responses",
    "GenerationResponse": "responses",
    "PolicyState": "adaptive",
    "StepOutput": "generate",
    "dflash_generate_step": "generate",
    "generate": "generate",
    "stream_generate": "generate",
    "check_pair": "weights.loading",
    "load": "weights.loading",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(ModuleType):
    # The import system binds a submodule to its name in the package when it first loads it,
    # which would make dflash_mlx.generate the module instead of the function generate().
    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
