"""The dispatcher: a kernel runs only where it has checked itself against its twin and won.

On a Metal device, the first call of a :class:`SelfChecked` kernel at a shape class runs the
kernel and its MLX-ops twin on random inputs of that class, compares them, times both, and
enables the kernel only if it matches and is faster. The verdict is kept per machine, MLX
version and shape class in ``kernels.json`` (dflash-mlx's cache folder), so a later process
does not measure again. Anywhere else, and wherever a kernel lost, the twin runs.

Every call takes a ``mode`` (``KERNEL_MODES``), passed down from the ``kernels`` argument of
``load`` and the generation functions (``--kernels`` on the command line): ``"auto"`` is the
above; ``"on"`` runs the kernel wherever it can run, untimed, after one comparison with its twin
per shape class, and raises if it fails to build or differs; ``"off"`` runs the twins only.
"""

import copy
import logging
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from ..base.errors import DFlashError
from ..base.store import JsonStore

logger = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Verdict:
    """What the check found for one shape class.

    Args:
        enabled: The kernel runs at this shape class.
        reason: Why (it matched and was faster, it differed, it failed, it was slower).
        kernel_s: Median seconds of a kernel call, when timed.
        twin_s: Median seconds of a twin call, when timed.
    """

    enabled: bool
    reason: str
    kernel_s: float | None = None
    twin_s: float | None = None


class KernelStore(JsonStore):
    """Verdicts on disk, one JSON object keyed by machine, MLX version, kernel and shape class.

    Args:
        path: The JSON file (None: ``kernels.json`` in dflash-mlx's cache folder).
    """

    def __init__(self, path: str | Path | None = None):
        super().__init__("kernels.json", path)

    def get(self, key: str) -> Verdict | None:
        saved = self.read().get(key)
        if not isinstance(saved, dict) or not isinstance(saved.get("enabled"), bool):
            return None
        try:
            return Verdict(**saved)
        except TypeError:
            return None

    def put(self, key: str, verdict: Verdict) -> None:
        self.write(key, asdict(verdict))


def on_metal() -> bool:
    """Whether kernels can run: MLX's default device is an Apple GPU."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def check_kernels(kernels: str, *, metal: bool | None = None) -> str:
    """Check a ``kernels`` choice at a boundary (``load``, the generation functions, a CLI).

    Args:
        kernels: ``"auto"``, ``"on"`` or ``"off"`` (see the module's docstring).
        metal: Whether kernels can run (None: :func:`on_metal`).

    Returns:
        ``kernels``, unchanged.

    Raises:
        DFlashError: On another value, or on ``"on"`` without a Metal device: there every
          kernel's twin would run, and a run asked to measure the kernels would measure none.
    """
    if kernels not in KERNEL_MODES:
        raise DFlashError(f"kernels must be one of {', '.join(KERNEL_MODES)} (got {kernels!r}).")
    if kernels == "on" and not (on_metal() if metal is None else metal):
        raise DFlashError(
            f"kernels 'on' needs a Metal device (an Apple GPU), and there is none here (MLX's device is "
            f"{mx.default_device()}): the kernels' MLX-ops twins run. Use 'auto' (the default) or 'off'."
        )
    return kernels


def machine_name() -> str:
    """The machine a verdict holds for: the GPU's name where MLX gives it, and the CPU's kind."""
    name = ""
    if on_metal():
        name = str(mx.metal.device_info().get("device_name", ""))
    return f"{name or 'unknown gpu'} ({platform.machine()})"


class SelfChecked:
    """A kernel and its twin behind one call; the kernel runs only where its check passed.

    Args:
        name: The kernel's name (in keys and log lines).
        kernel: The kernel, ``(*arrays) -> array``.
        twin: The MLX-ops twin, the same signature: the source of truth.
        shape_class: ``(*arrays) -> str``, what the kernel's speed and correctness depend on.
        example: ``(*arrays) -> tuple``: random inputs of the same shape class as these.
        close: ``(kernel_out, twin_out) -> bool``: whether the kernel matched its twin.
        reference: What the check compares the kernel with (None: the twin), for a twin whose
          own rounding in a half dtype is coarser than the kernel's.
        supports: ``(*arrays) -> bool``: inputs the kernel handles at all (None: all); the
          twin runs the rest without a check.
        store: Where verdicts are kept (None: :class:`KernelStore`'s default file).
        clock: Seconds (tests inject their own).
        metal: Whether kernels can run (None: :func:`on_metal`).
        machine: The machine's name in keys (None: :func:`machine_name`).
        repeats: Timed calls of each side.
    """

    def __init__(
        self,
        name: str,
        kernel: Callable[..., mx.array],
        twin: Callable[..., mx.array],
        *,
        shape_class: Callable[..., str],
        example: Callable[..., tuple],
        close: Callable[[mx.array, mx.array], bool],
        reference: Callable[..., mx.array] | None = None,
        supports: Callable[..., bool] | None = None,
        store: KernelStore | None = None,
        clock: Callable[[], float] = time.perf_counter,
        metal: bool | None = None,
        machine: str | None = None,
        repeats: int = 10,
    ):
        self.name, self.kernel, self.twin = name, kernel, twin
        self.shape_class, self.example, self.close, self.supports = shape_class, example, close, supports
        self._store, self.clock, self._metal, self._machine = store, clock, metal, machine
        self.repeats, self.reference = repeats, reference or twin
        self.verdicts: dict[str, Verdict] = {}
        self.forced: set[str] = set()  # shape classes that mode "on" compared with the twin

    def with_store(self, store: KernelStore) -> "SelfChecked":
        """The same kernel and twin, judged afresh against ``store``."""
        other = copy.copy(self)
        other._store, other.verdicts, other.forced = store, {}, set()
        return other

    @property
    def metal(self) -> bool:
        return on_metal() if self._metal is None else self._metal

    @property
    def store(self) -> KernelStore:
        if self._store is None:
            self._store = KernelStore()
        return self._store

    def __call__(self, *args, mode: str = "auto") -> mx.array:
        """The kernel's result where ``mode`` and the device let it run, else the twin's.

        ``mode``: ``"auto"`` runs the kernel where it is enabled for these inputs' shape class;
        ``"on"`` wherever it can run (a Metal device, inputs it supports), raising
        :class:`DFlashError` if it fails to build or differs from its twin; ``"off"`` never.
        """
        if mode == "off" or not self.metal or (self.supports is not None and not self.supports(*args)):
            return self.twin(*args)
        if mode == "on":
            self._check_forced(*args)
            return self.kernel(*args)
        if self.verdict(*args).enabled:
            return self.kernel(*args)
        return self.twin(*args)

    def _check_forced(self, *args: mx.array) -> None:
        # Untimed and not kept on disk: forcing a kernel is for measuring it, never for wrong output.
        shape_class = self.shape_class(*args)
        if shape_class in self.forced:
            return
        failed = self._compare(self.example(*args))
        if failed is not None:
            raise DFlashError(
                f"Kernel {self.name} at {shape_class}: {failed.reason}, so kernels 'on' cannot run it. "
                "Use 'auto', which runs its MLX-ops twin there, and please report it."
            )
        self.forced.add(shape_class)

    def key(self, shape_class: str) -> str:
        machine = self._machine if self._machine is not None else machine_name()
        return f"{machine}|mlx {mx.__version__}|{self.name}|{shape_class}"

    def verdict(self, *args: mx.array) -> Verdict:
        """The verdict for ``args``' shape class: remembered, read from the store, or measured now."""
        shape_class = self.shape_class(*args)
        if shape_class in self.verdicts:
            return self.verdicts[shape_class]
        key = self.key(shape_class)
        verdict = self.store.get(key)
        if verdict is None:
            verdict = self._check(self.example(*args))
            self.store.put(key, verdict)
            if not verdict.enabled:
                logger.info(
                    "Kernel %s at %s: %s; its MLX-ops twin runs instead.", self.name, shape_class, verdict.reason
                )
        self.verdicts[shape_class] = verdict
        return verdict

    def _compare(self, inputs: tuple) -> Verdict | None:
        # None when the kernel ran and matched its twin; else the verdict against it.
        try:
            got = self.kernel(*inputs)
            mx.eval(got)
        except Exception as e:  # a kernel that does not build or run here is a verdict too
            return Verdict(False, f"failed ({type(e).__name__}: {e})")
        want = self.reference(*inputs)
        mx.eval(want)
        if not self.close(got, want):
            return Verdict(False, "differs from its twin")
        return None

    def _check(self, inputs: tuple) -> Verdict:
        if (failed := self._compare(inputs)) is not None:
            return failed
        kernel_s, twin_s = self._time(self.kernel, inputs), self._time(self.twin, inputs)
        times = f"{kernel_s * 1e6:.1f} vs {twin_s * 1e6:.1f} us"
        if kernel_s >= twin_s:
            return Verdict(False, f"slower than its twin ({times})", kernel_s, twin_s)
        return Verdict(True, f"matches its twin, faster ({times})", kernel_s, twin_s)

    def _time(self, fn: Callable[..., mx.array], inputs: tuple) -> float:
        mx.eval(fn(*inputs))  # warm: builds the kernel or the graph
        times = []
        for _ in range(self.repeats):
            start = self.clock()
            mx.eval(fn(*inputs))
            times.append(self.clock() - start)
        return statistics.median(times)
