"""The one switch for the speedups that pay only on MLX's CPU backend.

On a CPU, MLX's exp costs about 12 ns an element (an add 0.2 ns) and every operation has a
fixed cost of a few microseconds, so dflash-mlx computes some passes differently there: exp
as a fused polynomial (``fast_exp``), layers compiled around their attention (``steps``), and a
verify pass started while its graph is still being built. On an Apple GPU none of this pays,
and the portable path (mlx-lm's own layers, MLX's native ops) runs instead. The choice is made
once, by :func:`cpu_speedups`, and passed down as an argument; nothing below it looks at the
device itself.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class CpuSpeedups:
    """Which CPU speedups a pass uses. Every combination gives the same tokens.

    Args:
        fast_exp: SwiGLU, the attention softmax and the drafter's top probability with the
          fused polynomial exp (``dflash_mlx.cpu.fast_math``).
        compiled_steps: Qwen3 and Llama layers (target passes of ``min_tokens`` or more, drafter
          passes) as compiled graphs around their attention (``dflash_mlx.cpu.compiled_layers``).
        start_every: Start evaluating a verify pass after every this many target layers,
          while the rest of its graph is still being built in Python (0: at the end).
        min_tokens: Target passes shorter than this stay mlx-lm's own layers: a one-token
          step is what plain decoding runs, the baseline that speedups are measured against.
    """

    fast_exp: bool = True
    compiled_steps: bool = True
    start_every: int = 3
    min_tokens: int = 2


# Building a verify pass's graph in Python took longer than the drafter pass it overlaps
# takes to run on MLX's CPU backend; starting it every 1-3 layers measured the same.
CPU_SPEEDUPS = CpuSpeedups()


def choose_speedups(dtype: mx.Dtype, choice: "CpuSpeedups | bool | None" = None) -> CpuSpeedups | None:
    """Resolve the speedups for passes computed in ``dtype``.

    Args:
        dtype: The models' compute dtype.
        choice: None (default) picks them: on for float32 on MLX's CPU backend, off
          elsewhere (bf16/fp16 and quantized passes are compute-bound there, and a GPU
          gains nothing). False forces the portable path, True the default speedups, and a
          ``CpuSpeedups`` is used as given.

    Returns:
        The speedups to pass down, or None for the portable path.
    """
    if choice is False:
        return None
    if isinstance(choice, CpuSpeedups):
        return choice
    if choice is True:
        return CPU_SPEEDUPS
    on_cpu = mx.default_device().type == mx.cpu
    return CPU_SPEEDUPS if on_cpu and dtype == mx.float32 else None
