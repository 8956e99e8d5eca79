"""DFlash block-diffusion speculative decoding for MLX."""

from importlib import import_module

__version__ = "0.1.0"

# Each public name and the module that defines it. They load on first use: importing mlx,
# mlx-lm and transformers takes seconds, and the console scripts must handle Ctrl+C before that.
_EXPORTS = {
    "DFlashCache": "loop.cache",
    "make_cache": "loop.cache",
    "DraftModel": "models.drafter",
    "DraftArgs": "models.drafter",
    "DFlashError": "base.errors",
    "AcceptanceStats": "text.responses",
    "GenerationResponse": "text.responses",
    "PolicyState": "tuning.policy",
    "StepOutput": "generation",
    "dflash_generate_step": "generation",
    "LoopOptions": "loop.options",
    "generate": "generation",
    "batch_generate": "generation",
    "BatchResponse": "generation",
    "stream_generate": "generation",
    "check_pair": "loading.draft_loader",
    "load": "loading.loading",
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
