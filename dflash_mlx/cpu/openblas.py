"""A fast BLAS for MLX's Linux CPU backend: OpenBLAS, or MKL on Intel CPUs where it is installed.

MLX's Linux CPU wheel calls a bundled reference BLAS; OpenBLAS preloaded with ``LD_PRELOAD`` is
many times faster, and on an Intel CPU MKL (``pip install mkl``, :mod:`dflash_mlx.cpu.mkl`) ran the
default pair's one-token pass 1.7x faster again. OpenBLAS builds with ``DYNAMIC_ARCH`` (Debian's,
Fedora's) pick their kernels for the CPU when they load, and a release that does not know the CPU
(0.3.21 on some recent Xeon and EPYC parts) falls back to its generic "Prescott" kernels, about 5x
slower on a 1024 fp32 matmul. ``OPENBLAS_CORETYPE`` names the kernels to use instead.
"""

import ctypes
import ctypes.util
import logging
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..base.errors import DFlashError
from . import mkl

BLAS_CHOICES = ("auto", "mkl", "openblas", "bundled")
INSTALL = (
    "install OpenBLAS (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread; Fedora: sudo dnf install "
    "openblas-threads) and every dflash tool preloads it by itself"
)
# Measured on the default pair (2-core Linux, float32): 3-10x slower than OpenBLAS in prompt and decoding speed.
REFERENCE_NOTE = f"MLX is running on its bundled reference BLAS, 3-10x slower on this CPU than OpenBLAS: {INSTALL}."
_noted = False

# Threaded builds first. Debian/Ubuntu keep one folder per variant plus an alternatives link;
# Fedora names its pthreads build libopenblasp and its OpenMP build libopenblaso (plain is serial).
KNOWN_LOCATIONS = (
    "/usr/lib/{triplet}/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{triplet}/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{triplet}/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblaso.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
# How ldconfig -p names each machine's libraries, e.g. "(libc6,x86-64)".
LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}
# OpenBLAS cores whose single-precision kernels use AVX-512, or at least AVX2.
AVX512_CORES = frozenset({"SkylakeX", "Cooperlake", "SapphireRapids"})
AVX2_CORES = AVX512_CORES | {"Haswell", "Zen"}


def _ldconfig_candidates(text: str, machine: str) -> list[str]:
    """OpenBLAS paths in ``ldconfig -p`` output for this machine, threaded builds first."""
    arch = LDCONFIG_ARCH.get(machine)
    found = []
    for line in text.splitlines():
        m = re.match(r"\s*(libopenblas(p|o)?\.so\S*)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if m and (arch is None or arch in m.group(3)):
            found.append(({"p": 0, "o": 1}.get(m.group(2), 2), m.group(4)))
    return [path for _, path in sorted(found)]


def find_openblas(
    *,
    ldconfig: str | None = None,
    exists: Callable[[str], bool] = os.path.exists,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
    machine: str | None = None,
) -> str | None:
    """The OpenBLAS library to preload: a known location, else ``ldconfig -p``, else the linker's search.

    Args:
        ldconfig: The output of ``ldconfig -p``; run when None.
        exists: Whether a file exists (tests pass a fake).
        find_library: ``ctypes.util.find_library`` (tests pass a fake).
        machine: ``platform.machine()`` when None.

    Returns:
        A path, a library name the dynamic loader finds by itself, or None when none is installed.
    """
    machine = machine or platform.machine()
    for pattern in KNOWN_LOCATIONS:
        path = pattern.format(triplet=f"{machine}-linux-gnu")
        if exists(path):
            return path
    if ldconfig is None:
        ldconfig = ""
        for exe in ("ldconfig", "/sbin/ldconfig"):
            try:
                ldconfig = subprocess.run([exe, "-p"], capture_output=True, text=True).stdout
                break
            except OSError:
                continue
    for path in _ldconfig_candidates(ldconfig, machine):
        if exists(path):
            return path
    return find_library("openblas")


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The x86 feature flags of the first CPU in ``/proc/cpuinfo`` text (empty on other CPUs)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def core_type_for(flags: set[str]) -> str | None:
    """The ``OPENBLAS_CORETYPE`` whose kernels this CPU runs: SkylakeX with AVX-512, Haswell with AVX2."""
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def openblas_core(library: str) -> tuple[str, str] | None:
    """``(version, core)`` of the OpenBLAS ``library``, loaded into this process to ask it.

    Returns the library's own answer (``openblas_get_config``, ``openblas_get_corename``), or None
    when it cannot be loaded or is not OpenBLAS.
    """
    try:
        lib = ctypes.CDLL(library)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        core, config = lib.openblas_get_corename().decode(), lib.openblas_get_config().decode()
    except (OSError, AttributeError):
        return None
    m = re.match(r"OpenBLAS\s+(\S+)", config)
    return (m.group(1) if m else "", core)


def preload_env(environ: dict[str, str], library: str, flags: set[str], detected_core: str | None) -> dict[str, str]:
    """The environment that preloads ``library``, with the core type named when OpenBLAS would pick worse.

    ``OPENBLAS_CORETYPE`` is set only when the user has not set it, the CPU has AVX2 or AVX-512, and
    the core OpenBLAS detects by itself (``detected_core``; None when unknown) has slower kernels.
    """
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    want = core_type_for(flags)
    good_enough = AVX512_CORES if want == "SkylakeX" else AVX2_CORES
    if want and "OPENBLAS_CORETYPE" not in environ and detected_core not in good_enough:
        env["OPENBLAS_CORETYPE"] = want
    return env


def blas_in_use() -> str:
    """Which BLAS this process's MLX calls; for OpenBLAS its version and the core whose kernels run, for MKL
    its version and threading."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    intel = sorted(set(re.findall(r"/\S*libmkl_rt\.so\S*", maps)))
    if intel:
        return mkl.describe(intel[0], dict(os.environ))
    openblas = sorted(set(re.findall(r"/\S*libopenblas\S*\.so\S*", maps)))
    if openblas:
        info = openblas_core(openblas[0])
        if info is None:
            return "OpenBLAS (preloaded)"
        version, core = info
        asked = os.environ.get("OPENBLAS_CORETYPE")
        how = f"OPENBLAS_CORETYPE={asked}" if asked else "detected"
        return f"OpenBLAS {version} (preloaded), core {core} ({how})"
    libs = sorted(set(re.findall(r"/\S*lib\S*blas\S*\.so\S*", maps)))
    return f"reference BLAS bundled with MLX ({Path(libs[0]).name})" if libs else "unknown"


def _preloaded(environ: dict[str, str]) -> bool:
    preload = environ.get("LD_PRELOAD", "")
    return "libopenblas" in preload or _is_mkl(preload)


def _is_mkl(library: str) -> bool:
    return "libmkl_rt" in library


def _auto_library() -> str | None:
    # What --blas auto preloads: MKL on an Intel CPU where it is installed, else OpenBLAS where it is.
    return (mkl.find_mkl() if mkl.is_intel(read_cpuinfo()) else None) or find_openblas()


def fast_blas_env(environ: dict[str, str], choice: str = "auto") -> dict[str, str] | None:
    """The environment that preloads the BLAS ``choice`` asks for, or None when there is none to preload.

    ``auto``: MKL on an Intel CPU where it is installed, else OpenBLAS where it is installed;
    ``mkl`` and ``openblas``: that one only.

    Raises:
        DFlashError: The BLAS named is not installed.
    """
    library = {"auto": _auto_library, "mkl": mkl.find_mkl, "openblas": find_openblas}[choice]()
    if library is None:
        if choice == "mkl":
            raise DFlashError(f"--blas mkl: MKL is not installed: {mkl.INSTALL}; or pass --blas auto.")
        if choice == "openblas":
            raise DFlashError(f"--blas openblas: OpenBLAS is not installed: {INSTALL}; or pass --blas bundled.")
        return None
    if _is_mkl(library):
        return mkl.mkl_env(environ, library)
    # Ask the library which kernels it picks by itself, to name better ones for this CPU if needed.
    detected = openblas_core(library) if "OPENBLAS_CORETYPE" not in environ else None
    return preload_env(environ, library, cpu_flags(read_cpuinfo()), detected and detected[1])


def use_fast_blas(
    prog: str,
    choice: str = "auto",
    *,
    environ: dict[str, str] | None = None,
    execv: Callable[[str, list[str], dict[str, str]], None] = os.execve,
) -> None:
    """Re-run this process with a fast BLAS preloaded (Linux: :func:`fast_blas_env`), else say what it costs.

    ``LD_PRELOAD`` takes effect only at process start, so the process starts again with the same
    command line (``sys.orig_argv``) and the new environment; it never returns then. A process that
    already preloads OpenBLAS or MKL, ``choice="bundled"`` and other systems return at once.

    Args:
        prog: The tool's name, for the one line printed when no fast BLAS is installed.
        choice: ``auto`` (the fastest installed), ``mkl`` or ``openblas`` (required), or ``bundled``
          (MLX's own BLAS).

    Raises:
        DFlashError: ``choice`` names a BLAS that is not installed.
    """
    global _noted
    environ = dict(os.environ if environ is None else environ)
    if choice == "bundled":
        _noted = True  # asked for by name: load() need not say that it is slower
    if sys.platform != "linux" or choice == "bundled" or _preloaded(environ):
        return
    env = fast_blas_env(environ, choice)
    if env is None:
        print(f"{prog}: note: {REFERENCE_NOTE}", file=sys.stderr)
        _noted = True
        return
    sys.stdout.flush()
    sys.stderr.flush()
    execv(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def note_reference_blas() -> None:
    """Say once, on the ``dflash_mlx`` logger, when this process's MLX runs on its reference BLAS (Linux)."""
    global _noted
    if _noted or sys.platform != "linux":
        return
    _noted = True
    if not blas_in_use().startswith("reference BLAS"):
        return
    library = _auto_library()
    if library is None:
        logging.getLogger("dflash_mlx").warning(REFERENCE_NOTE)
    else:
        # LD_PRELOAD acts only at process start: the fix is a new start, which the tools make by themselves.
        argv0 = sys.argv[0] if sys.argv else ""
        script = argv0 if argv0.endswith(".py") and not argv0.endswith("__main__.py") else "your_script.py"
        name = "MKL" if _is_mkl(library) else "OpenBLAS"
        logging.getLogger("dflash_mlx").warning(
            f"MLX is running on its bundled reference BLAS, 3-10x slower on this CPU than the {name} "
            f"installed here: run python -m dflash_mlx.cpu.openblas python {script} (or start Python with "
            f"LD_PRELOAD={library})."
        )


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dflash_mlx.cpu.openblas COMMAND...``: run a command with the fastest installed BLAS preloaded."""
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        sys.exit("usage: python -m dflash_mlx.cpu.openblas COMMAND [ARG ...]")
    env = dict(os.environ)
    if sys.platform == "linux" and not _preloaded(env):
        fast = fast_blas_env(env)
        if fast is None:
            print(f"note: {REFERENCE_NOTE}", file=sys.stderr)
        env = fast or env
    sys.stdout.flush()
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
