import os
import subprocess
import sys

import pytest

from dflash_mlx.cpu import mkl
from dflash_mlx.cpu import openblas as blas
from dflash_mlx.cpu.openblas import core_type_for, cpu_flags, fast_blas_env, find_openblas, openblas_core, preload_env

DEBIAN = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibopenblaso.so.0 (libc6,x86-64) => /opt/ob/lib64/libopenblaso.so.0
\tlibopenblasp.so.0 (libc6) => /opt/ob/lib/libopenblasp.so.0
\tlibopenblasp.so.0 (libc6,x86-64) => /opt/ob/lib64/libopenblasp.so.0
\tlibopenblas.so.0 (libc6,x86-64) => /opt/ob/lib64/libopenblas.so.0
\tlibblas.so.3 (libc6,x86-64) => /lib/x86_64-linux-gnu/libblas.so.3
"""
EPYC = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
    "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl\n"
)
XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 fma avx512f avx512dq avx512bw avx512vl\n"
HASWELL = "processor\t: 0\nflags\t\t: fpu sse2 sse4_2 avx avx2 fma\n"
KNL = "processor\t: 0\nflags\t\t: fpu avx avx2 fma avx512f avx512cd avx512er\n"  # no BW/DQ/VL
OLD = "processor\t: 0\nflags\t\t: fpu sse2 sse4_2 avx\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


def _find(files, ldconfig="", found=None, machine="x86_64"):
    return find_openblas(ldconfig=ldconfig, exists=set(files).__contains__, find_library=lambda name: found,
                         machine=machine)  # fmt: skip


@pytest.mark.parametrize(
    "files, machine, expected",
    [
        # Debian/Ubuntu: the pthread variant's folder before the alternatives link.
        ([DEBIAN, "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"], "x86_64", DEBIAN),
        (["/usr/lib/x86_64-linux-gnu/libopenblas.so.0"], "x86_64", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"),
        (
            ["/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0", DEBIAN],
            "aarch64",
            "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
        ),
        # Fedora: the pthreads build, not the serial one.
        (["/usr/lib64/libopenblas.so.0", "/usr/lib64/libopenblasp.so.0"], "x86_64", "/usr/lib64/libopenblasp.so.0"),
        (["/usr/lib64/libopenblas.so.0"], "x86_64", "/usr/lib64/libopenblas.so.0"),
    ],
)
def test_finds_openblas_in_known_locations(files, machine, expected):
    assert _find(files, machine=machine) == expected


def test_finds_openblas_through_ldconfig_then_the_linker():
    everything = ["/opt/ob/lib64/libopenblaso.so.0", "/opt/ob/lib/libopenblasp.so.0",
                  "/opt/ob/lib64/libopenblasp.so.0", "/opt/ob/lib64/libopenblas.so.0"]  # fmt: skip
    # This machine's pthreads build; the 32-bit one is skipped.
    assert _find(everything, LDCONFIG) == "/opt/ob/lib64/libopenblasp.so.0"
    assert _find(everything[:1], LDCONFIG) == "/opt/ob/lib64/libopenblaso.so.0"
    # ldconfig's cache names a file that is gone: the linker's own search is the last resort.
    assert _find([], LDCONFIG, found="libopenblas.so.0") == "libopenblas.so.0"
    assert _find([], LDCONFIG) is None and _find([], "") is None


@pytest.mark.parametrize(
    "cpuinfo, core", [(EPYC, "SkylakeX"), (HASWELL, "Haswell"), (KNL, "Haswell"), (OLD, None), (ARM, None), ("", None)]
)
def test_core_type_from_cpu_flags(cpuinfo, core):
    assert core_type_for(cpu_flags(cpuinfo)) == core


def test_preload_env_names_the_core_only_when_openblas_would_pick_a_slower_one():
    env = {"PATH": "/bin", "LD_PRELOAD": "libfoo.so"}
    out = preload_env(env, DEBIAN, cpu_flags(EPYC), "Prescott")
    assert out["LD_PRELOAD"] == f"{DEBIAN}:libfoo.so" and out["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert out["PATH"] == "/bin" and "OPENBLAS_CORETYPE" not in env
    assert preload_env({}, DEBIAN, cpu_flags(EPYC), "Haswell")["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert preload_env({}, DEBIAN, cpu_flags(HASWELL), None)["OPENBLAS_CORETYPE"] == "Haswell"
    # Already AVX-512 (or AVX2) kernels, no AVX2 at all, or the user's own choice: left alone.
    for flags, detected in ((EPYC, "Cooperlake"), (EPYC, "SkylakeX"), (HASWELL, "Zen"), (OLD, "Prescott")):
        assert "OPENBLAS_CORETYPE" not in preload_env({}, DEBIAN, cpu_flags(flags), detected)
    mine = preload_env({"OPENBLAS_CORETYPE": "Zen"}, DEBIAN, cpu_flags(EPYC), "Prescott")
    assert mine["OPENBLAS_CORETYPE"] == "Zen" and mine["LD_PRELOAD"] == DEBIAN


def test_blas_in_use_names_the_core_openblas_runs():
    """What dflash-bench's stamp and header print, in a process started with OpenBLAS preloaded."""
    library = find_openblas()
    if library is None or openblas_core(library) is None:
        pytest.skip("OpenBLAS is not installed")
    code = [
        sys.executable,
        "-c",
        "import mlx.core; from dflash_mlx.cpu.openblas import blas_in_use; print(blas_in_use())",
    ]
    env = {**os.environ, "LD_PRELOAD": library, "OPENBLAS_CORETYPE": "Haswell"}
    out = subprocess.run(code, env=env, capture_output=True, text=True, check=True).stdout
    version = openblas_core(library)[0]
    assert out.strip() == f"OpenBLAS {version} (preloaded), core Haswell (OPENBLAS_CORETYPE=Haswell)"
    env.pop("LD_PRELOAD")
    out = subprocess.run(code, env=env, capture_output=True, text=True, check=True).stdout
    assert "OpenBLAS" not in out


def _no_preload() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def test_use_fast_blas_restarts_the_process_with_it_preloaded(monkeypatch):
    monkeypatch.setattr(blas, "find_openblas", lambda: DEBIAN)
    monkeypatch.setattr(mkl, "find_mkl", lambda: None)
    monkeypatch.setattr(blas, "openblas_core", lambda library: ("0.3.21", "Prescott"))
    monkeypatch.setattr(blas, "read_cpuinfo", lambda: EPYC)
    monkeypatch.setattr(sys, "platform", "linux")
    calls = []
    blas.use_fast_blas("dflash-x", environ={"PATH": "/bin"}, execv=lambda *a: calls.append(a))
    ((exe, argv, env),) = calls
    # The same command line again (script, -m or -c, and its arguments), in the new environment.
    assert exe == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env == {"PATH": "/bin", "LD_PRELOAD": DEBIAN, "OPENBLAS_CORETYPE": "SkylakeX"}
    # Already preloaded, or MLX's own BLAS asked for: nothing to do.
    blas.use_fast_blas("dflash-x", environ={"LD_PRELOAD": DEBIAN}, execv=lambda *a: calls.append(a))
    blas.use_fast_blas("dflash-x", "bundled", environ={}, execv=lambda *a: calls.append(a))
    assert len(calls) == 1


def test_use_fast_blas_without_it_says_what_it_costs_and_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    monkeypatch.setattr(mkl, "find_mkl", lambda: None)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "_noted", False)
    blas.use_fast_blas("dflash-generate", environ={}, execv=lambda *a: pytest.fail("restarted without OpenBLAS"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "dflash-generate: note: MLX is running on its bundled reference BLAS"
    )
    assert "sudo apt-get install libopenblas0-pthread" in err
    with pytest.raises(blas.DFlashError, match="--blas openblas: OpenBLAS is not installed"):
        blas.use_fast_blas("dflash-generate", "openblas", environ={})
    with pytest.raises(blas.DFlashError, match="--blas mkl: MKL is not installed: pip install mkl"):
        blas.use_fast_blas("dflash-generate", "mkl", environ={})


def test_blas_choice_is_read_before_the_tool_parses_its_arguments():
    from dflash_mlx.tools.cli.entry import _blas_choice

    assert _blas_choice(["--prompt", "hi"]) == "auto"
    assert _blas_choice(["--blas", "bundled", "-p", "x"]) == "bundled"
    assert _blas_choice(["--blas=openblas"]) == "openblas"
    # --help loads nothing, and a bad value is the tool's parser's to refuse.
    assert _blas_choice(["--blas", "bundled", "--help"]) is None and _blas_choice(["--blas", "atlas"]) is None
    assert _blas_choice(["--blas", "mkl"]) == "mkl"


PROBE = "import mlx.core\nfrom dflash_mlx.cpu.openblas import blas_in_use\n\ndef main():\n    print(blas_in_use())\n"


@pytest.mark.parametrize("args, expected", [([], None), (["--blas", "openblas"], "OpenBLAS"),
                                            (["--blas", "bundled"], "reference BLAS")])  # fmt: skip
def test_a_console_script_runs_on_a_fast_blas_by_itself(tmp_path, args, expected):
    """The console scripts' entry restarts the tool with a fast BLAS preloaded, with no LD_PRELOAD set by hand:
    by default MKL where it is installed on an Intel CPU, else OpenBLAS."""
    library = find_openblas()
    if library is None or openblas_core(library) is None:
        pytest.skip("OpenBLAS is not installed")
    if expected is None:
        expected = "MKL" if mkl.find_mkl() and mkl.is_intel(blas.read_cpuinfo()) else "OpenBLAS"
    (tmp_path / "probe_tool.py").write_text(PROBE)
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from dflash_mlx.tools.cli.entry import _entry; _entry('probe', 'probe_tool')()"
    out = subprocess.run([sys.executable, "-c", code, *args], env=_no_preload(), capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.startswith(expected) and out.stderr == ""


def test_the_python_api_says_once_when_mlx_runs_on_its_reference_blas(pair_dirs, monkeypatch, caplog):
    from dflash_mlx import load

    monkeypatch.setattr(blas, "_noted", False)
    monkeypatch.setattr(blas, "blas_in_use", lambda: "reference BLAS bundled with MLX (libblas.so.3)")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    monkeypatch.setattr(mkl, "find_mkl", lambda: None)
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        load(pair_dirs["qwen3-tied"])
        load(pair_dirs["qwen3-tied"])
    notes = [r.getMessage() for r in caplog.records if "reference BLAS" in r.getMessage()]
    assert len(notes) == 1 and "libopenblas0-pthread" in notes[0]
    # Installed but not preloaded in this process: the note says how to preload it.
    monkeypatch.setattr(blas, "_noted", False)
    monkeypatch.setattr(blas, "find_openblas", lambda: DEBIAN)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        load(pair_dirs["qwen3-tied"])
    (note,) = [r.getMessage() for r in caplog.records if "reference BLAS" in r.getMessage()]
    assert f"LD_PRELOAD={DEBIAN}" in note and "than the OpenBLAS installed here" in note
    # MKL installed on an Intel CPU: that one.
    monkeypatch.setattr(blas, "_noted", False)
    monkeypatch.setattr(mkl, "find_mkl", lambda: "/venv/lib/libmkl_rt.so.3")
    monkeypatch.setattr(blas, "read_cpuinfo", lambda: XEON)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        load(pair_dirs["qwen3-tied"])
    (note,) = [r.getMessage() for r in caplog.records if "reference BLAS" in r.getMessage()]
    assert "LD_PRELOAD=/venv/lib/libmkl_rt.so.3" in note and "than the MKL installed here" in note


def test_finds_mkl_where_pip_puts_it():
    files = {"/venv/lib/libmkl_rt.so.2", "/usr/lib/libmkl_rt.so.3"}
    assert mkl.find_mkl(["/venv", "/usr"], files.__contains__) == "/venv/lib/libmkl_rt.so.2"
    assert mkl.find_mkl(["/opt", "/usr"], files.__contains__) == "/usr/lib/libmkl_rt.so.3"
    assert mkl.find_mkl(["/opt"], files.__contains__) is None


@pytest.mark.parametrize("cpuinfo, intel", [(XEON, True), (EPYC, False), (HASWELL, False), (ARM, False), ("", False)])
def test_mkl_is_chosen_by_cpu_vendor(cpuinfo, intel):
    assert mkl.is_intel(cpuinfo) is intel


def test_mkl_env_threads_with_intel_openmp_only_where_it_is_installed():
    lib = "/venv/lib/libmkl_rt.so.3"
    env = mkl.mkl_env({"PATH": "/bin", "LD_PRELOAD": "libfoo.so"}, lib, {"/venv/lib/libiomp5.so"}.__contains__)
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{lib}:libfoo.so", "MKL_THREADING_LAYER": "INTEL"}
    # Without Intel's OpenMP beside it, MKL's default threading would fail to load: one thread instead.
    assert mkl.mkl_env({}, lib, lambda path: False)["MKL_THREADING_LAYER"] == "SEQUENTIAL"
    assert mkl.mkl_env({"MKL_THREADING_LAYER": "GNU"}, lib, lambda path: True)["MKL_THREADING_LAYER"] == "GNU"


@pytest.mark.parametrize(
    "cpuinfo, mkl_at, choice, expected",
    [
        (XEON, "/venv/lib/libmkl_rt.so.3", "auto", "mkl"),
        (EPYC, "/venv/lib/libmkl_rt.so.3", "auto", "openblas"),  # installed, but not measured faster there
        (EPYC, "/venv/lib/libmkl_rt.so.3", "mkl", "mkl"),  # asked for by name
        (XEON, "/venv/lib/libmkl_rt.so.3", "openblas", "openblas"),
        (XEON, None, "auto", "openblas"),
    ],
)
def test_auto_picks_mkl_on_intel_cpus_where_installed_else_openblas(monkeypatch, cpuinfo, mkl_at, choice, expected):
    monkeypatch.setattr(blas, "read_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(mkl, "find_mkl", lambda: mkl_at)
    monkeypatch.setattr(blas, "find_openblas", lambda: DEBIAN)
    monkeypatch.setattr(blas, "openblas_core", lambda library: ("0.3.21", "SkylakeX"))
    env = fast_blas_env({}, choice)
    assert env["LD_PRELOAD"] == (mkl_at if expected == "mkl" else DEBIAN)
    assert ("MKL_THREADING_LAYER" in env) is (expected == "mkl")


def test_blas_in_use_names_mkl_and_its_threading():
    library = mkl.find_mkl()
    if library is None:
        pytest.skip("MKL is not installed (pip install mkl)")
    code = [
        sys.executable,
        "-c",
        "import mlx.core; from dflash_mlx.cpu.openblas import blas_in_use; print(blas_in_use())",
    ]
    env = mkl.mkl_env(_no_preload(), library)
    out = subprocess.run(code, env=env, capture_output=True, text=True, check=True).stdout.strip()
    version = mkl.mkl_version(library)
    assert version and version[:2] == "20"
    assert (
        out == f"MKL {version} (preloaded, {os.path.basename(library)}, threading {env['MKL_THREADING_LAYER'].lower()})"
    )
