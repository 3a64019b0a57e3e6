"""`write_report(run_dir)`: one self-contained HTML page about one run folder.

The page reads top-down for someone who did not run it: the held-out verdict first,
then per-family pass rates, alarms, curves, the reward model, sample answers, and at
the end what is needed to reproduce it (config, versions, seed, wall time). A demo
folder gets the same sections once more for each stage sub-folder it holds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from rlhflab.report import details, sections
from rlhflab.report.headroom import headroom_section
from rlhflab.report.html import Markup, details as collapsible, join, page, section, tag
from rlhflab.report.runfolder import RunFolder, load_run
from rlhflab.report.verdict import family_table, verdict_html

Section = tuple[str, Callable[[RunFolder], Markup | None]]

SECTIONS: tuple[Section, ...] = (
    ("Did the model get better on held-out prompts?", verdict_html),
    ("Missing or damaged files", details.notes_section),
    ("Pass rate per family", family_table),
    ("Headroom before RL", headroom_section),
    ("Train prompts filtered out before RL", details.prompt_filter_section),
    ("Alarms", sections.alarms_section),
    ("Rows your reward and verifier functions lost", details.reward_errors_section),
    ("Training curves", sections.curves_section),
    ("Reward model", sections.reward_model_section),
    ("Sample answers to fixed prompts", sections.samples_section),
    ("The run", details.facts_table),
    ("Final update", details.final_section),
    ("Wall time", details.wall_time_section),
)
# long reference material: open on the run's own page, collapsed inside each stage
REFERENCE: tuple[Section, ...] = (
    ("Config (config.yaml)", details.config_section),
    ("Versions and hardware (versions.json)", details.versions_section),
)


def run_sections(run: RunFolder, level: int, expand_reference: bool) -> list[Markup]:
    """Every section that has content for this run; empty ones are left out."""
    parts = []
    for title, build in SECTIONS:
        body = build(run)
        if body:
            parts.append(section(title, body, level))
    for title, build in REFERENCE:
        body = build(run)
        if body:
            parts.append(collapsible(title, body, open_=expand_reference))
    return parts


def stage_index(run: RunFolder) -> Markup:
    links = [tag("a", name, href=f"#stage-{name}") for name in run.stages]
    return tag("p", "Stages in this run: " + join(links, ", ")) if links else Markup("")


def render_report(run: RunFolder) -> str:
    parts = [stage_index(run), *run_sections(run, level=2, expand_reference=True)]
    for name, stage in run.stages.items():
        body = join(run_sections(stage, level=3, expand_reference=False))
        parts.append(section(f"Stage: {name}", body, level=2, id_=f"stage-{name}"))
    return page(f"rlhflab report: {run.name}", join(parts))


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def write_atomic(path: Path, text: str) -> Path:
    """Write via a temporary file so a reader never sees half a report. A lone surrogate (text a model or a data
    file produced from undecodable bytes, kept by JSON) has no UTF-8 form: it is written as U+FFFD."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(LONE_SURROGATE.sub("\ufffd", text), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write `run_dir/report.html` (or `out_path`) and return its path.

    Raises UserInputError when `run_dir` is not a run folder.
    """
    run = load_run(run_dir)
    if run.summary.get("stage") == "compare":  # `rlhflab compare`'s folder: its own page, methods side by side
        from rlhflab.report.method_compare import render_method_comparison  # it builds on this module

        return write_atomic(Path(out_path) if out_path else run.path / "report.html", render_method_comparison(run))
    return write_atomic(Path(out_path) if out_path else run.path / "report.html", render_report(run))
