"""The documentation site builds with `mkdocs build --strict`: a broken link or anchor, a page missing from the
nav, or an API object the reference names that the code no longer has fails it (mkdocs.yml, docs/)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    site = tmp_path / "site"
    for page in sorted((ROOT / "docs").glob("*.md")):  # every page became a page of the site
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} was not built"
    api = (site / "api" / "index.html").read_text()
    for name in ("GRPOTrainer", "PPOTrainer", "DPOTrainer", "OnlineDPOTrainer", "on_train_end", "RunResult",
                 "compare_methods", "num_generations"):  # the reference holds the objects, not only headings
        assert name in api, name
