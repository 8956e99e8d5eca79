"""A kernel's dispatcher as it behaves on a Mac, with the kernel's Metal source run by the CPU harness.

The kernel is timed faster than its twin on a fake clock, so the dispatcher's own check enables it wherever it
matches; ``calls`` records which of the two each call ran.
"""

from functools import partial

from dflash_mlx.kernels import harness
from dflash_mlx.kernels.dispatch import KernelStore, SelfChecked


def emulated_dispatcher(name, kernel, twin, folder, **checks) -> tuple[SelfChecked, list[str]]:
    """``kernel(*args, factory=)`` built by the harness and ``twin`` behind a :class:`SelfChecked` named
    ``name`` (its verdicts kept in ``folder``); ``checks`` are its ``shape_class``, ``example``, ``close``...
    Returns the dispatcher and the list of ``"kernel"`` / ``"twin"`` calls."""
    ticks, calls = [0.0], []

    def timed(fn, cost, label):
        def call(*args):
            ticks[0] += cost
            calls.append(label)
            return fn(*args)

        return call

    dispatcher = SelfChecked(
        name,
        timed(partial(kernel, factory=harness.cpu_metal_kernel), 1.0, "kernel"),
        timed(twin, 2.0, "twin"),
        store=KernelStore(folder / "kernels.json"), clock=lambda: ticks[0], metal=True, machine="emulated", repeats=1,
        **checks,
    )  # fmt: skip
    return dispatcher, calls
