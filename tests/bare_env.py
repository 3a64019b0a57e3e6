"""A fresh virtualenv made without network that sees this environment's packages except some: how the tests check
that something runs where rlhflab is not installed from src/ (tests/test_gpu_check.py) or is installed from its
wheel alone (tests/test_wheel.py)."""

import subprocess
import sys
import sysconfig
from pathlib import Path

# rlhflab's own installation: its dist-info and the editable install's finder (a .pth file is never linked anyway)
RLHFLAB = ("rlhflab", "__editable__")


def bare_python(folder: Path, absent: tuple[str, ...] = RLHFLAB) -> Path:
    """The python of a new virtualenv in `folder` that sees this one's packages but none whose top-level entry starts
    with one of `absent` (lower case): each kept top-level entry of this environment's site-packages linked into one
    folder, which the new environment's only .pth file names (no other .pth file is read there, so rlhflab's
    editable install is not either). Installing into it (`python -m pip install`, pip seen through that folder)
    writes into its own site-packages."""
    kept = folder / "site-packages"
    kept.mkdir(parents=True)
    paths = sysconfig.get_paths()
    for site in dict.fromkeys(Path(paths[key]).resolve() for key in ("purelib", "platlib")):
        for entry in site.iterdir():
            if entry.suffix == ".pth" or entry.name.lower().startswith(absent) or (kept / entry.name).exists():
                continue
            (kept / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], check=True)
    site = next((folder / "venv" / "lib").glob("python*/site-packages"))
    (site / "kept.pth").write_text(f"{kept}\n")
    return folder / "venv" / "bin" / "python"
