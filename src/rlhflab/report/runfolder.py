"""Read a run folder robustly: a missing or damaged file drops its section, with a note.

A report is often wanted most for a run that went wrong (killed mid-way, a NaN, a
half-written line), so nothing here raises on content: only a path that is not a run
folder at all is a user mistake (`check_run_folder`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhflab.errors import UserInputError
from rlhflab.tracking import RUN_MARKERS

# the demo's stage sub-folders, in pipeline order; any other sub-folder run comes after
STAGE_ORDER = ("sft", "ppo", "rm", "rm_diagnosis", "ppo_rm")
RUN_FOLDER_HINT = (
    "pass a folder written by an rlhflab command (sft, ppo, rm, eval, demo ...): "
    f"it holds at least one of {', '.join(RUN_MARKERS)}"
)


@dataclass
class RunFolder:
    """Everything a report shows, read once. None means the file was absent or unreadable."""

    path: Path
    config_text: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] | None = None
    samples: list[dict[str, Any]] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    worst_cases: str | None = None
    notes: list[str] = field(default_factory=list)
    stages: dict[str, "RunFolder"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in RUN_MARKERS)


def check_run_folder(path: str | Path) -> Path:
    """The path as a Path if it is a run folder; otherwise a UserInputError saying what one is."""
    folder = Path(path)
    if not folder.exists():
        raise UserInputError("run folder not found", str(folder), RUN_FOLDER_HINT)
    if not is_run_folder(folder):
        raise UserInputError("not a run folder", str(folder), RUN_FOLDER_HINT)
    return folder


def _read_text(path: Path, notes: list[str], why: str) -> str | None:
    if not path.is_file():
        notes.append(f"{path.name} not found: {why} omitted.")
        return None
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        notes.append(f"{path.name} could not be read ({err}): {why} omitted.")
        return None


def _read_json(path: Path, notes: list[str], why: str) -> Any:
    text = _read_text(path, notes, why)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        notes.append(f"{path.name} is not valid JSON ({err}): {why} omitted.")
        return None


def _read_jsonl(path: Path, notes: list[str], why: str) -> list[dict[str, Any]] | None:
    """Rows that parse as JSON objects; bad lines (e.g. cut by a kill) are counted in a note."""
    text = _read_text(path, notes, why)
    if text is None:
        return None
    rows, bad = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    if bad:
        notes.append(f"{path.name}: {len(bad)} malformed line(s) skipped (first at line {bad[0]}).")
    return rows


def _read_yaml(text: str | None, notes: list[str]) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        notes.append(f"config.yaml is not valid YAML ({err}); it is shown as text only.")
        return {}
    return values if isinstance(values, dict) else {}


def _stage_folders(path: Path) -> list[Path]:
    found = [p for p in sorted(path.iterdir()) if is_run_folder(p)] if path.is_dir() else []
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    return sorted(found, key=lambda p: (rank.get(p.name, len(rank)), p.name))


def load_run(path: str | Path, with_stages: bool = True) -> RunFolder:
    """Read every file a report uses; stage sub-folders (a demo's sft/, ppo/ ...) are read too."""
    folder = check_run_folder(path)
    run = RunFolder(path=folder)
    run.config_text = _read_text(folder / "config.yaml", run.notes, "the config section")
    run.config = _read_yaml(run.config_text, run.notes)
    run.versions = _read_json(folder / "versions.json", run.notes, "versions and hardware")
    run.metrics = _read_jsonl(folder / "metrics.jsonl", run.notes, "training curves")
    run.samples = _read_jsonl(folder / "samples.jsonl", run.notes, "sample answers")
    summary = _read_json(folder / "summary.json", run.notes, "the headline figures")
    run.summary = summary if isinstance(summary, dict) else {}
    if (folder / "worst_cases.md").is_file():
        run.worst_cases = _read_text(folder / "worst_cases.md", run.notes, "the worst cases")
    if with_stages:
        run.stages = {p.name: load_run(p, with_stages=False) for p in _stage_folders(folder)}
    return run


def as_number(value: Any) -> float | None:
    """A finite float, or None: NaN, inf, 'nan' strings (how tracking writes them), bools, text."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
