"""Intel's oneMKL for MLX's Linux CPU backend, where it is installed with pip (``pip install mkl``).

On an Intel Xeon (2 cores, float32) the default pair's one-token pass took 35 ms with MKL against
59 with OpenBLAS 0.3.21, and plain decoding and the drafting loop both ran 1.4x as fast
(BENCHMARKS.md, "Linux BLAS"). The pip wheels put ``libmkl_rt`` and Intel's OpenMP runtime in the
environment's ``lib`` folder, where ``libmkl_rt`` finds its kernels by itself.
"""

import ctypes
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

# mkl_rt's soname carries MKL's major interface version (2024 and later: .so.2, 2025.3 on: .so.3).
LIBRARY_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
OPENMP = "libiomp5.so"
INSTALL = "pip install mkl (into the environment dflash-mlx runs from)"


def prefixes() -> list[str]:
    """Where pip installs shared libraries for this Python: the environment's prefix, then the base one."""
    return list(dict.fromkeys([sys.prefix, sys.base_prefix]))


def find_mkl(roots: Iterable[str] | None = None, exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """The ``libmkl_rt`` in ``<root>/lib`` of the first root that has one (default: :func:`prefixes`), or None."""
    for root in prefixes() if roots is None else roots:
        for name in LIBRARY_NAMES:
            path = os.path.join(root, "lib", name)
            if exists(path):
                return path
    return None


def is_intel(cpuinfo: str) -> bool:
    """True on Intel CPUs (``vendor_id`` in ``/proc/cpuinfo`` text): MKL's own kernels are picked by
    vendor, and only Intel parts were measured faster with it."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip() == "GenuineIntel"
    return False


def mkl_env(environ: dict[str, str], library: str, exists: Callable[[str], bool] = os.path.exists) -> dict[str, str]:
    """The environment that preloads MKL's ``library``.

    MKL's default threading needs Intel's OpenMP runtime: named when it sits beside MKL (pip's
    ``intel-openmp``, which ``mkl`` depends on), else MKL runs single-threaded rather than fail to
    load (a one-token pass of the default pair then took 1.3x as long as with its threads). What the
    user set stays as set.
    """
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    openmp = os.path.join(os.path.dirname(library), OPENMP)
    env.setdefault("MKL_THREADING_LAYER", "INTEL" if exists(openmp) else "SEQUENTIAL")
    return env


def mkl_version(library: str) -> str | None:
    """MKL's version (``"2026.2"``) from the loaded ``library``, or None when it is not MKL."""
    try:
        lib = ctypes.CDLL(library)
        buf = ctypes.create_string_buffer(256)
        lib.mkl_get_version_string(buf, len(buf))
    except (OSError, AttributeError):
        return None
    words = buf.value.decode(errors="replace").split()
    return words[words.index("Version") + 1] if "Version" in words[:-1] else ""


def threading_layer(environ: dict[str, str]) -> str:
    return environ.get("MKL_THREADING_LAYER", "INTEL").upper()


def describe(library: str, environ: dict[str, str]) -> str:
    """What :func:`dflash_mlx.cpu.openblas.blas_in_use` says of a process running on MKL."""
    version = mkl_version(library)
    name = f"MKL {version}" if version else "MKL"
    return f"{name} (preloaded, {Path(library).name}, threading {threading_layer(environ).lower()})"
