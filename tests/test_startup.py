"""Startup: the package imports no model library, and a Ctrl+C while a tool imports them is one line."""

import importlib
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import dflash_mlx

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HEAVY = ("mlx.core", "mlx_lm", "transformers")


def _scripts() -> dict[str, str]:
    """pyproject.toml's console scripts: {name: "module:function"}."""
    if not PYPROJECT.is_file():
        return {}
    section = PYPROJECT.read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.M))


def test_importing_the_package_and_the_entry_points_loads_no_model_library():
    code = "import sys, dflash_mlx, dflash_mlx.tools.cli.entry; print([m for m in sys.argv[1:] if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code, *HEAVY], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"


def test_public_names_load_on_first_use():
    assert set(dflash_mlx.__all__) <= set(dir(dflash_mlx))
    for name in dflash_mlx.__all__:
        assert getattr(dflash_mlx, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = dflash_mlx.nope


def test_generate_is_the_function_whatever_was_imported_before():
    # The loop's module is dflash_mlx.generation and the CLI's dflash_mlx.tools.cli.generate, so no
    # submodule is bound to the package's name ``generate``.
    importlib.import_module("dflash_mlx.generation")
    importlib.import_module("dflash_mlx.tools.cli.generate")
    assert callable(dflash_mlx.generate) and not isinstance(dflash_mlx.generate, ModuleType)
    assert dflash_mlx.generate is importlib.import_module("dflash_mlx.generation").generate


def test_every_console_script_goes_through_an_entry_point():
    from dflash_mlx.tools.cli import entry

    scripts = _scripts()
    if not scripts:
        pytest.skip("needs the source tree")
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert module == "dflash_mlx.tools.cli.entry" and callable(getattr(entry, function))


# The tool's process sends itself a SIGINT as it starts importing its first heavy library, so the
# Ctrl+C lands inside the imports every time, however fast the machine.
SIGINT_ON_IMPORT = """
import os, signal, sys

class SigintOnImport:
    sent = False

    def find_spec(self, name, path=None, target=None):
        if name in ("mlx", "textual") and not self.sent:
            self.sent = True
            print("SIGINT importing", name, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintOnImport())
from dflash_mlx.tools.cli.entry import {function}
{function}()
"""


@pytest.mark.parametrize("script", list(_scripts()) or ["dflash-generate"])
def test_ctrl_c_while_a_tool_imports_is_one_line(script):
    function = _scripts().get(script, "dflash_mlx.tools.cli.entry:generate_main").partition(":")[2]
    out = subprocess.run(
        [sys.executable, "-c", SIGINT_ON_IMPORT.format(function=function), "--help"], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60,
        # A shell may start the tests with SIGINT ignored, and a child would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert out.stdout.startswith("SIGINT importing") and "usage:" not in out.stdout
    assert (out.returncode, out.stderr) == (130, f"{script}: interrupted\n")
