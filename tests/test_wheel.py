"""A wheel that installs (issue 32 item 6). `python -m build` builds the sdist and then the wheel from that sdist, as
a release is built, offline (--no-isolation: this environment's setuptools), from a copy of the source so nothing
is written into the repository. The wheel is installed with `pip --no-deps --no-index` into a fresh virtualenv that
sees this environment's packages (torch installed first, as a user does) but not rlhflab, and used from a folder
outside the repository, so src/ cannot be imported by accident."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from bare_env import bare_python

from rlhflab import __version__

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env={**env, "OMP_WAIT_POLICY": "PASSIVE"},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", source / "dist", ".", cwd=source)
    [built] = (source / "dist").glob("rlhflab-*.whl")
    assert built.name == f"rlhflab-{__version__}-py3-none-any.whl"
    return built


def test_the_wheel_holds_every_file_of_the_package(wheel):
    package = ROOT / "src" / "rlhflab"
    files = {p.relative_to(package.parent).as_posix() for p in package.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}  # modules and any data file the package reads
    missing = files - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"not in the wheel (a folder without __init__.py, or package data not declared): {missing}"


def test_installed_from_the_wheel_alone_the_cli_and_the_api_run(wheel, tmp_path):
    python = bare_python(tmp_path / "env")
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", "--quiet", wheel, cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = python.parent / "rlhflab"  # the console script pip wrote
    assert "--max_new_tokens" in run(script, "demo", "--help", cwd=elsewhere).stdout
    assert run(script, "--version", cwd=elsewhere).stdout == f"rlhflab {__version__}\n"
    code = ("import importlib, pkgutil, rlhflab\nfrom rlhflab.config import GRPOConfig\n"
            "from rlhflab import GRPOConfig as Top, GRPOTrainer\nassert Top is GRPOConfig and callable(GRPOTrainer)\n"
            "for module in pkgutil.walk_packages(rlhflab.__path__, 'rlhflab.'):  # every module imports (~4 s)\n"
            "    importlib.import_module(module.name)\n"
            "print(rlhflab.__file__)")
    where = Path(run(python, "-c", code, cwd=elsewhere).stdout.strip())
    assert where.is_relative_to(tmp_path / "env" / "venv"), where  # the installed copy, not src/
