"""The page of `rlhflab compare`: methods side by side, from one starting model, on one test set.

It answers, in this order: which method gained most on the held-out test prompts, at what
KL to the starting model and in what wall time, and is its lead more than noise; the test
pass rate per family of every method; the validation curves on shared axes (episodes, so
methods with different batch sizes line up); what failed; and how the methods' configs
differ. It reads the comparison folder only (summary.json, samples.jsonl, DIR/<method>/).

Noise: every model answers the same test prompts, so two models are compared prompt by
prompt. The prompts one model passes and the other fails ("fixed" / "broken") give the 95 %
interval of the difference in pass rate (rlhflab.intervals: Agresti-Min, McNemar p beside it); a difference is
called real only when that interval excludes 0, anything else is within noise, with its
interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhflab.intervals import Interval, difference_from_dict, paired_counts, points, verdict
from rlhflab.report import details
from rlhflab.report.compare import config_section
from rlhflab.report.html import Markup, details as collapsible, join, note, page, pct, section, table, tag
from rlhflab.report.plots import Line, grid, panel
from rlhflab.report.runfolder import RunFolder, as_number, load_run
from rlhflab.report.series import Series
from rlhflab.report.single import write_atomic
from rlhflab.report.verdict import (OVERALL, answers_by_model, family_columns, family_intervals, paired_differences,
                                    rate_text, table_interval)

# (title, candidate metric names: the first one a method logs is its line); x = episodes
CURVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("validation pass rate", ("val/pass_rate",)),
    ("validation reward (no verifier)", ("val/reward",)),
    ("training reward", ("objective/scores", "reward")),
    ("KL to the reference during training (nats)", ("objective/kl", "kl")),
    ("response length (tokens)", ("response/length_mean", "completions/mean_length")),
)


# --- paired statistics over the test prompts --------------------------------------------------------


def passed_by_model(samples: list[dict] | None) -> dict[str, list[bool]]:
    """samples.jsonl rows of a comparison -> each model's verdicts in test-prompt order."""
    found: dict[str, dict[int, bool]] = {}
    for row in samples or []:
        if "model" in row and isinstance(row.get("prompt_index"), int):
            found.setdefault(str(row["model"]), {})[row["prompt_index"]] = bool(row.get("passed"))
    return {model: [v for _, v in sorted(rows.items())] for model, rows in found.items()}


# --- the verdict in words ------------------------------------------------------------------------------


def _noise(counts: dict[str, Any]) -> str:
    """'beyond noise: +6.7 pts [+1.3, +11.3] (paired over the test prompts: 40 better, 20 worse, McNemar p = 0.013)'."""
    diff = difference_from_dict(counts) or Interval(float("nan"), -1.0, 1.0, 0)
    said = "within noise" if verdict(diff) == "within noise" else "beyond noise"
    return (f"{said}: {points(diff)} (paired over the test prompts: {counts['fixed']} better, {counts['broken']} "
            f"worse, McNemar p = {counts['p_value']:.2g})")


def _test_rate(summary: dict[str, Any], name: str) -> str:
    """A model's test pass rate with its 95 % interval (summary.json's test_tables)."""
    table = (summary.get("test_tables") or {}).get(name) or {}
    return rate_text(as_number((summary.get("test_pass_rate") or {}).get(name)), table_interval(table, OVERALL))


def _gain_words(name: str, m: dict[str, Any], summary: dict[str, Any]) -> str:
    kl, wall, eps = (as_number(m.get(k)) for k in ("kl_to_reference", "wall_s", "episodes_per_s"))
    cost = ", ".join(x for x in (f"KL to the start {kl:.2f} nats" if kl is not None else "",
                                 f"{wall:.0f} s" if wall is not None else "",
                                 f"{eps:.0f} episodes/s" if eps is not None else "") if x)
    return f"{name}: {_test_rate(summary, name)} ({100 * m['gain']:+.1f} pts; {cost})"


def verdict_lines(summary: dict[str, Any], passed: dict[str, list[bool]]) -> list[str]:
    """Which method gained most, at what KL and wall time, and whether the differences are more than noise.

    `passed`: each model's test verdicts in prompt order ("start" and every method that finished).
    Methods rank by test pass rate, then lower KL to the start.
    """
    methods = {n: m for n, m in (summary.get("methods") or {}).items() if "error" not in m and n in passed}
    start = as_number((summary.get("test_pass_rate") or {}).get("start"))
    lines = []
    if not methods:
        lines.append("No method finished, so there is nothing to compare.")
    else:
        ranked = sorted(methods, key=lambda n: (-methods[n]["test_pass_rate"], as_number(methods[n].get(
            "kl_to_reference")) or 0.0, n))
        best = ranked[0]
        vs_start = _noise(paired_counts(passed["start"], passed[best]))
        if methods[best]["gain"] > 0:
            lines.append(f"Most gain on the {len(passed['start'])} held-out test prompts: "
                         f"{_gain_words(best, methods[best], summary)}, from {_test_rate(summary, 'start')} at the start; the gain is {vs_start}.")
        else:
            lines.append(f"No method raised the test pass rate above the start's {pct(start)} on the "
                         f"{len(passed['start'])} held-out test prompts; the best was {_gain_words(best, methods[best], summary)}, "
                         f"{vs_start}.")
        if len(ranked) > 1:
            second = ranked[1]
            versus = _noise(paired_counts(passed[second], passed[best]))
            if methods[second]["test_pass_rate"] == methods[best]["test_pass_rate"]:
                lines.append(f"{best} ties with {_gain_words(second, methods[second], summary)} (listed first for its lower KL); "
                             f"prompt by prompt they differ {versus}.")
            else:
                lines.append(f"Runner-up {_gain_words(second, methods[second], summary)}; {best}'s lead over it is {versus}.")
        for name in ranked[2:]:
            lines.append(f"Then {_gain_words(name, methods[name], summary)}; vs the start "
                         f"{_noise(paired_counts(passed['start'], passed[name]))}.")
    for name in summary.get("failed") or []:
        lines.append(f"{name} failed: {(summary['methods'].get(name) or {}).get('error', 'no error recorded')}")
    return lines


# --- the page ------------------------------------------------------------------------------------------


def _versus(vs: dict[str, Any]) -> str:
    """'+6.7 pts [+1.3, +11.3] better (40 / 20, p 0.013)' from summary.json's methods.<name>.vs_start."""
    if not vs:
        return "—"
    diff = difference_from_dict(vs)
    head = f"{points(diff)} {verdict(diff)} " if diff is not None else ""
    return f"{head}({vs.get('fixed', '—')} / {vs.get('broken', '—')}, p {vs['p_value']:.2g})"


def overview_table(summary: dict[str, Any]) -> Markup:
    rows = [["start", _test_rate(summary, "start"), "—", "—", 0.0, "—", "—", "—", "—", "—", summary.get("model", "")]]
    for name, m in (summary.get("methods") or {}).items():
        if "error" in m:
            rows.append([name, "failed", "—", "—", "—", as_number(m.get("wall_s")) or "—", "—", "—", "—",
                         m["error"][:200], m.get("run_dir", "")])
            continue
        vs = m.get("vs_start") or {}
        alarms = ", ".join(f"{a.get('name')}@{a.get('step')}" for a in m.get("alarms") or [] if isinstance(a, dict))
        stopped = m.get("stopped")
        rows.append([name, _test_rate(summary, name), f"{100 * m['gain']:+.1f} pts", _versus(vs),
                     as_number(m.get("kl_to_reference")), as_number(m.get("wall_s")), m.get("episodes"),
                     as_number(m.get("episodes_per_s")),
                     f"at {stopped.get('step')}: {stopped.get('reason')}" if isinstance(stopped, dict) else "no",
                     alarms or "none", tag("a", "report", href=f"{name}/report.html")])
    headers = ["method", "test pass rate [95 % interval]", "gain", "vs start: difference [95 % interval] (better / "
               "worse prompts, McNemar p)", "KL to start (nats)", "wall s",
               "episodes", "episodes/s", "stopped early", "alarms", "run"]
    return table(headers, rows, row_headers=True, id="methods")


def family_side_by_side(run: RunFolder) -> Markup | None:
    """Pass rate per family with its 95 % interval: the start, then every method with its change from the start,
    marked * where the paired interval of that change excludes 0."""
    columns, counts = family_columns(run)
    if "start" not in columns:
        return None
    intervals = family_intervals(run)
    answers = answers_by_model(run, list(columns))
    changes = {name: paired_differences(answers, "start", name) for name in list(columns)[1:]}
    families = sorted({f for col in columns.values() for f in col} - {OVERALL}) + [OVERALL]
    rows = []
    for family in families:
        start = as_number(columns["start"].get(family))
        row = [family, counts.get(family, sum(counts.values())) if counts else "—",
               rate_text(start, intervals.get("start", {}).get(family))]
        for name in list(columns)[1:]:
            rate = as_number(columns[name].get(family))
            diff = changes[name].get(family)
            mark = "*" if diff is not None and verdict(diff) != "within noise" else ""
            delta = "" if rate is None or start is None else f" ({100 * (rate - start):+.0f}{mark})"
            row.append(f"{rate_text(rate, intervals.get(name, {}).get(family))}{delta}")
        rows.append(row)
    return join([table(["family", "n", "start", *list(columns)[1:]], rows, row_headers=True, class_="families",
                       id="families"),
                 note("[low–high]: 95 % interval of each rate (Wilson). (+x*): a change from the start beyond noise, "
                      "its paired 95 % interval over the family's prompts excluding 0; without * it is within noise.")])


def x_key(run: RunFolder) -> tuple[str, float]:
    """What puts a run's rows on the shared axis: `episode` (online methods log it with every row), else
    step x batch_size (a pair method's step takes batch_size pairs: its `episodes` are pairs)."""
    if any("episode" in row for row in run.metrics or []):
        return "episode", 1.0
    return "step", as_number(run.config.get("batch_size")) or 1.0


def episode_series(run: RunFolder, key: str) -> Series:
    """`key` against episodes sampled (or pairs trained on), so every method shares the x-axis."""
    axis, scale = x_key(run)
    xs, ys, dropped = [], [], 0
    for row in run.metrics or []:
        if key not in row:
            continue
        x, y = as_number(row.get(axis)), as_number(row[key])
        if x is None or y is None:
            dropped += 1
            continue
        xs.append(x * scale)
        ys.append(y)
    return Series(xs, ys, dropped)


def curves(methods: dict[str, RunFolder]) -> Markup | None:
    panels = []
    for title, keys in CURVES:
        lines = []
        for name, run in methods.items():
            key = next((k for k in keys if any(k in row for row in run.metrics or [])), None)
            if key is not None:
                lines.append(Line(name, episode_series(run, key)))
        if any(line.series.values for line in lines):
            panels.append(panel(title, lines, xlabel="episodes (DPO: pairs)"))
    return grid(panels) if panels else None


def method_runs(run: RunFolder) -> dict[str, RunFolder]:
    """The methods' run folders that exist, in the comparison's order."""
    found = {}
    for name in run.summary.get("methods") or {}:
        folder = run.path / name
        if folder.is_dir() and any((folder / m).is_file() for m in ("metrics.jsonl", "summary.json")):
            found[name] = load_run(folder, with_stages=False)
    return found


def render_method_comparison(run: RunFolder) -> str:
    summary = run.summary
    test = summary.get("test") or {}
    budget = summary.get("budget") or {}
    lines = summary.get("verdict") or verdict_lines(summary, passed_by_model(run.samples))
    how = (f"Every method started from {summary.get('model', 'the same model')} with the same prompts, seed, reward and "
           f"budget ({budget.get('kind')}={budget.get('amount')}); test: {test.get('prompts')} prompts of "
           f"{test.get('source')}, checked by {test.get('verifier')}, {test.get('decoding')} decoding; KL: "
           f"{test.get('kl')}.")
    parts = [section("Which method helped most?", join([tag("ul", join(tag("li", line) for line in lines),
                                                             class_="verdict"), note(how)])),
             section("Methods side by side", overview_table(summary))]
    families = family_side_by_side(run)
    if families:
        parts.append(section("Test pass rate per family (change from the start in points)", families))
    methods = method_runs(run)
    plotted = curves(methods)
    if plotted:
        parts.append(section("Curves on shared axes (x: episodes sampled)", plotted))
    if len(methods) >= 2:
        parts.append(collapsible("How the methods' configs differ",
                                 config_section(list(methods.values()), list(methods))))
    for title, build in (("The comparison's config (config.yaml)", details.config_section),
                         ("Versions and hardware (versions.json)", details.versions_section)):
        body = build(run)
        if body:
            parts.append(collapsible(title, body))
    if run.notes:
        parts.append(note(" ".join(run.notes)))
    return page(f"rlhflab compare: {', '.join(summary.get('methods') or {})}", join(parts))


def is_method_comparison(run: RunFolder) -> bool:
    return run.summary.get("stage") == "compare"


def write_method_comparison(compare_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write `compare_dir/report.html` (or `out_path`) for a folder written by `rlhflab compare`."""
    run = load_run(compare_dir, with_stages=False)
    return write_atomic(Path(out_path) if out_path else run.path / "report.html", render_method_comparison(run))
