"""The headline: did the model get better on prompts it was not trained on?

Training curves can rise while the model gets worse at the task (reward hacking, a
reward model that likes the wrong thing), so the first thing a report states is the
held-out check — test or validation pass rate before and after — read from summary.json,
or from the validation rows of metrics.jsonl when the summary has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhflab.report.html import Markup, join, pct, table, tag
from rlhflab.report.runfolder import RunFolder, as_number
from rlhflab.report.series import rows_with_prefix, series, stopped

FAMILY_PREFIX = "val/pass_rate/"
OVERALL = "overall"


@dataclass(frozen=True)
class Check:
    what: str  # "held-out test pass rate"
    after_label: str
    after: float
    before_label: str = ""
    before: float | None = None
    is_rate: bool = True  # a pass rate or accuracy (shown in %); False: a reward mean (shown as is)

    @property
    def delta(self) -> float | None:
        return None if self.before is None else self.after - self.before


def _demo_checks(summary: dict[str, Any]) -> list[Check]:
    rates = {name: as_number(v) for name, v in (summary.get("test_pass_rate") or {}).items()}
    rates = {name: v for name, v in rates.items() if v is not None}
    if not rates:
        return []
    (base, base_rate), *others = rates.items()
    if not others:
        return [Check("held-out test pass rate", base, base_rate)]
    return [Check("held-out test pass rate", name, rate, base, base_rate) for name, rate in others]


def _summary_checks(summary: dict[str, Any]) -> list[Check]:
    """Checks that summary.json states directly, for each kind of run folder."""
    checks = _demo_checks(summary)
    val = summary.get("validation_pass_rate") or {}
    start, end = as_number(val.get("start")), as_number(val.get("end"))
    if end is not None:
        checks.append(Check("held-out validation pass rate", "end", end, "start", start))
    reward = summary.get("validation_reward") or {}
    start, end = as_number(reward.get("start")), as_number(reward.get("end"))
    if end is not None:
        checks.append(Check("validation reward (the reward's own opinion, no verifier)", "end", end, "start", start,
                            is_rate=False))
    overall = as_number((summary.get("pass_rate") or {}).get("overall"))
    if overall is not None:
        checks.append(Check(f"held-out {summary.get('split', 'eval')} pass rate", "", overall))
    test_pairs = as_number(((summary.get("pairs") or {}).get("test") or {}).get("accuracy"))
    if test_pairs is not None:
        checks.append(Check("held-out test pairwise accuracy of the reward model (chance 50%)", "", test_pairs))
    return checks


def _metric_checks(run: RunFolder) -> list[Check]:
    """First and last validation pass rate in metrics.jsonl (SFT, or a run killed before its summary)."""
    curve = series(run.metrics, "val/pass_rate")
    if not curve.values:
        return []
    last = Check("held-out validation pass rate", f"step {curve.steps[-1]:g}", curve.values[-1])
    if len(curve.values) == 1:
        return [last]
    return [Check(last.what, last.after_label, last.after, f"step {curve.steps[0]:g}", curve.values[0])]


def held_out_checks(run: RunFolder) -> list[Check]:
    return _summary_checks(run.summary) or _metric_checks(run)


def describe(check: Check) -> str:
    """'held-out test pass rate 49.0% → 67.0% (+18.0 points, sft → ppo)'."""
    show = pct if check.is_rate else (lambda x: f"{x:.3f}")
    if check.before is None:
        where = f" ({check.after_label})" if check.after_label else ""
        return f"{check.what} {show(check.after)}{where}"
    labels = f", {check.before_label} → {check.after_label}" if check.before_label else ""
    change = f"{check.delta * 100:+.1f} points" if check.is_rate else f"{check.delta:+.3f}"
    return f"{check.what} {show(check.before)} → {show(check.after)} ({change}{labels})"


def overall_verdict(checks: list[Check]) -> tuple[str, str]:
    """(sentence, css class) summing up every before/after check."""
    deltas = [c.delta for c in checks if c.delta is not None]
    if not checks:
        return "No held-out check in this run: nothing says whether the model got better.", "neutral"
    if not deltas:
        return "One held-out measurement, nothing to compare it with.", "neutral"
    if all(d > 0 for d in deltas):
        return "Better on the held-out check.", "good"
    if all(d < 0 for d in deltas):
        return "Worse on the held-out check.", "bad"
    if all(d == 0 for d in deltas):
        return "No change on the held-out check.", "neutral"
    return "Mixed: better on some held-out checks, not on others.", "neutral"


def _check_line(check: Check) -> Markup:
    delta = check.delta
    kind = "neutral" if not delta else ("good" if delta > 0 else "bad")
    return tag("li", describe(check), class_=kind)


def verdict_html(run: RunFolder) -> Markup:
    checks = held_out_checks(run)
    sentence, kind = overall_verdict(checks)
    parts = [tag("p", tag("strong", sentence), class_=f"verdict {kind}")]
    if checks:
        parts.append(tag("ul", join(_check_line(c) for c in checks)))
    held_out = run.summary.get("held_out")
    if isinstance(held_out, dict) and held_out.get("verifier") is None and held_out.get("note"):
        parts.append(tag("p", "⚠ No verifier in this run: the held-out number is the training reward's own opinion "
                              "of answers to validation prompts, not an independent check. A reward that can be "
                              "gamed rises here too; read it with the KL to the reference, and pass --verifier "
                              "to measure what the model really gets right.", class_="banner"))
    halt = stopped(run)
    if halt:
        step, reason = halt
        at = f" at step {step:g}" if step is not None else ""
        parts.append(tag("p", f"⚠ The run was stopped early{at}: {reason}", class_="banner"))
    best = run.summary.get("best")
    if isinstance(best, dict) and best.get("restored"):
        rate = as_number(best.get("val/pass_rate"))
        value = f"validation pass rate {pct(rate)}" if rate is not None else \
            f"validation reward {as_number(best.get('val/reward')) or float('nan'):.3f}"
        parts.append(tag("p", f"The saved policy is the best one seen, from step {best.get('step')} "
                              f"({value}), not the last one.", class_="banner"))
    return join(parts)


def family_columns(run: RunFolder) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """({column: {family: rate}}, {family: n}): demo test tables, an eval, or first/last validation rows."""
    summary = run.summary
    if summary.get("test_tables"):
        tables = summary["test_tables"]
        counts = next(iter(tables.values()), {}).get("counts") or {}
        return {name: {**(t.get("per_family") or {}), OVERALL: t.get("overall")} for name, t in tables.items()}, counts
    if isinstance(summary.get("pass_rate"), dict) and summary["pass_rate"].get("per_family"):
        rate = summary["pass_rate"]
        return {summary.get("split", "eval"): {**rate["per_family"], OVERALL: rate.get("overall")}}, rate.get("counts") or {}
    rows = rows_with_prefix(run.metrics, FAMILY_PREFIX)
    picked = [rows[0], rows[-1]] if len(rows) > 1 else rows
    columns = {}
    for row in picked:
        label = f"step {as_number(row.get('step')) or 0:g}"
        columns[label] = {k.removeprefix(FAMILY_PREFIX): v for k, v in row.items() if k.startswith(FAMILY_PREFIX)}
        columns[label][OVERALL] = row.get("val/pass_rate")
    return columns, {}


def family_table(run: RunFolder) -> Markup | None:
    """Pass rate per family, one column per model / step, plus the change from first to last."""
    columns, counts = family_columns(run)
    if not columns:
        return None
    names = list(columns)
    families = sorted({f for col in columns.values() for f in col} - {OVERALL}) + [OVERALL]
    headers = ["family", *names] + (["change"] if len(names) > 1 else []) + (["n"] if counts else [])
    rows = []
    for family in families:
        rates = [as_number(columns[n].get(family)) for n in names]
        row = [family, *(pct(r) for r in rates)]
        if len(names) > 1:
            first, last = rates[0], rates[-1]
            row.append("—" if first is None or last is None else f"{(last - first) * 100:+.1f} pts")
        n = sum(v for v in counts.values() if isinstance(v, int)) if family == OVERALL else counts.get(family, "—")
        rows.append(row + ([n] if counts else []))
    return table(headers, rows, row_headers=True, class_="families")
