"""`write_comparison(run_dirs, out_path)`: several runs on one page.

Comparing runs is how a setting is judged, so the page answers three questions: which
run ended better on held-out prompts (and at what KL, with how many alarms, in how
much time), how their curves differ (one line per run), and what exactly was different
between them (every config key whose value is not the same in all runs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhflab.report.details import total_seconds
from rlhflab.report.html import Markup, join, note, page, section, table
from rlhflab.report.plots import Line, grid, panel
from rlhflab.report.runfolder import RunFolder, as_number, load_run
from rlhflab.report.series import collect_alarms, has_key, last_value, series
from rlhflab.report.single import write_atomic
from rlhflab.report.verdict import held_out_checks, rate_text

COMPARE_PANELS: tuple[tuple[str, str], ...] = (
    ("reward (objective/scores)", "objective/scores"),
    ("KL to the reference (objective/kl)", "objective/kl"),
    ("RLHF reward (objective/rlhf_reward)", "objective/rlhf_reward"),
    ("validation pass rate", "val/pass_rate"),
    ("entropy (objective/entropy)", "objective/entropy"),
    ("response length (tokens)", "response/length_mean"),
    ("value loss (loss/value_avg)", "loss/value_avg"),
    ("SFT loss (loss/sft)", "loss/sft"),
    ("validation loss (val/loss)", "val/loss"),
    ("reward-model loss (loss/rm)", "loss/rm"),
)
ABSENT = "(absent)"


def run_labels(runs: list[RunFolder]) -> list[str]:
    """Folder names, or parent/name where two runs share a name."""
    names = [run.name for run in runs]
    return [f"{run.path.parent.name}/{run.name}" if names.count(run.name) > 1 else run.name for run in runs]


def curve_sources(run: RunFolder, label: str) -> list[tuple[str, RunFolder]]:
    """The run itself, plus each stage sub-folder (a demo's curves live in sft/, ppo/ ...)."""
    return [(label, run)] + [(f"{label}/{name}", stage) for name, stage in run.stages.items()]


def curves(runs: list[RunFolder], labels: list[str]) -> Markup | None:
    sources = [src for run, label in zip(runs, labels) for src in curve_sources(run, label)]
    panels = []
    for title, key in COMPARE_PANELS:
        lines = [Line(label, series(run.metrics, key)) for label, run in sources if has_key(run.metrics, key)]
        if lines:
            panels.append(panel(title, lines))
    return grid(panels) if panels else None


def final_held_out(run: RunFolder) -> str:
    checks = held_out_checks(run)
    if not checks:
        return "—"
    if len(checks) > 1:  # the demo: one check per model against the SFT model
        first = checks[0]
        return " · ".join([f"{first.before_label} {rate_text(first.before, first.before_interval)}"] +
                          [f"{c.after_label} {rate_text(c.after, c.after_interval)}" for c in checks])
    return f"{rate_text(checks[0].after, checks[0].after_interval)} ({checks[0].what})"


def final_kl(run: RunFolder) -> str:
    final = as_number((run.summary.get("final") or {}).get("objective/kl"))
    if final is not None:
        return f"{final:.3g}"
    per_stage = {k: as_number(v) for k, v in (run.summary.get("kl_to_reference") or {}).items()}
    if any(v is not None for v in per_stage.values()):
        return " · ".join(f"{k} {v:.3g}" for k, v in per_stage.items() if v is not None)
    last = last_value(run.metrics, "objective/kl")
    return "—" if last is None else f"{last:.3g}"


def overview(runs: list[RunFolder], labels: list[str]) -> Markup:
    rows = []
    for run, label in zip(runs, labels):
        alarms = len(collect_alarms(run)) + sum(len(collect_alarms(s)) for s in run.stages.values())
        wall = total_seconds(run.summary.get("wall_time_s") or {})
        rows.append([label, run.summary.get("stage", "—"), final_held_out(run), final_kl(run), alarms,
                     "—" if wall is None else round(wall, 1), str(run.path)])
    headers = ["run", "stage", "final held-out pass rate", "final KL (nats)", "alarms", "wall time (s)", "folder"]
    return table(headers, rows, row_headers=True)


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config mappings as dotted keys, so a difference deep inside still shows."""
    flat = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_differences(configs: list[dict[str, Any]]) -> list[str]:
    """Every key whose value is not identical in all configs (a key missing from one counts)."""
    flats = [flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for flat in flats for k in flat))
    canon = [{k: json.dumps(v, sort_keys=True, default=str) for k, v in flat.items()} for flat in flats]
    return [k for k in keys if len({c.get(k, ABSENT) for c in canon}) > 1]


def _shown(value: Any) -> str:
    return value if isinstance(value, str) and value else json.dumps(value, default=str)


def config_section(runs: list[RunFolder], labels: list[str]) -> Markup:
    have = [(run, label) for run, label in zip(runs, labels) if run.config]
    missing = [label for run, label in zip(runs, labels) if not run.config]
    parts = [note(f"No readable config.yaml in {', '.join(missing)}: not compared.")] if missing else []
    if len(have) < 2:
        return join(parts + [note("Fewer than two configs to compare.")])
    keys = config_differences([run.config for run, _ in have])
    if not keys:
        return join(parts + [note("The configs are identical.")])
    flats = [flatten(run.config) for run, _ in have]
    rows = [[key, *(_shown(flat[key]) if key in flat else ABSENT for flat in flats)] for key in keys]
    parts.append(note(f"{len(keys)} config key(s) differ."))
    parts.append(table(["config key", *(label for _, label in have)], rows, row_headers=True, id="config-diff"))
    return join(parts)


def render_comparison(runs: list[RunFolder]) -> str:
    labels = run_labels(runs)
    parts = [section("Runs", overview(runs, labels))]
    plotted = curves(runs, labels)
    if plotted:
        parts.append(section("Curves, one line per run", plotted))
    parts.append(section("Config differences", config_section(runs, labels)))
    for run, label in zip(runs, labels):
        if run.notes:
            parts.append(note(f"{label}: " + " ".join(run.notes)))
    return page(f"rlhflab comparison: {', '.join(labels)}", join(parts))


def write_comparison(run_dirs: list[str | Path], out_path: str | Path) -> Path:
    """Write one HTML page comparing the runs and return its path.

    Raises UserInputError when any path is not a run folder.
    """
    runs = [load_run(path) for path in run_dirs]
    return write_atomic(Path(out_path), render_comparison(runs))
