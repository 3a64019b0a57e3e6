"""Metric series and alarms out of metrics.jsonl rows and summary.json.

A row without a key, or with a non-finite value, simply contributes no point: the
metrics file mixes update rows, evaluation rows and one-off rows, and a diverging
run writes 'nan' / 'inf' that must not break a plot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhflab.report.runfolder import RunFolder, as_number


@dataclass(frozen=True)
class Series:
    steps: list[float]
    values: list[float]
    dropped: int  # rows that had the key but no finite value (or no finite step)


@dataclass(frozen=True)
class Alarm:
    name: str
    step: float | None
    reason: str
    source: str  # "summary.json" or "metrics.jsonl"


def series(rows: list[dict[str, Any]] | None, key: str) -> Series:
    steps, values, dropped = [], [], 0
    for row in rows or []:
        if key not in row:
            continue
        step, value = as_number(row.get("step")), as_number(row[key])
        if step is None or value is None:
            dropped += 1
            continue
        steps.append(step)
        values.append(value)
    return Series(steps, values, dropped)


def has_key(rows: list[dict[str, Any]] | None, key: str) -> bool:
    return any(key in row for row in rows or [])


def last_value(rows: list[dict[str, Any]] | None, key: str) -> float | None:
    values = series(rows, key).values
    return values[-1] if values else None


def rows_with_prefix(rows: list[dict[str, Any]] | None, prefix: str) -> list[dict[str, Any]]:
    return [row for row in rows or [] if any(k.startswith(prefix) for k in row)]


def _summary_alarms(summary: dict[str, Any]) -> list[Alarm]:
    found = []
    for item in summary.get("alarms") or []:
        if isinstance(item, dict):
            found.append(Alarm(str(item.get("name", "alarm")), as_number(item.get("step")),
                               str(item.get("reason", "")), "summary.json"))
    return found


def _fired(value: Any) -> bool:
    """An `alarm/<name>` metric counts as fired when it is true, non-zero or a non-empty text."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "none", "0.0")
    return bool(value) if value is not None else False


def _metric_alarms(rows: list[dict[str, Any]] | None) -> list[Alarm]:
    found = []
    for row in rows or []:
        for key, value in row.items():
            if key.startswith("alarm/") and _fired(value):
                name = key.removeprefix("alarm/")
                found.append(Alarm(name, as_number(row.get("step")), f"{key} = {value}", "metrics.jsonl"))
    return found


def collect_alarms(run: RunFolder) -> list[Alarm]:
    """Alarms from summary.json, then those only metrics.jsonl knows (same name and step = one alarm)."""
    alarms = _summary_alarms(run.summary)
    seen = {(a.name, a.step) for a in alarms}
    for alarm in _metric_alarms(run.metrics):
        if (alarm.name, alarm.step) not in seen:
            seen.add((alarm.name, alarm.step))
            alarms.append(alarm)
    return alarms


def alarm_steps(run: RunFolder) -> list[float]:
    return sorted({a.step for a in collect_alarms(run) if a.step is not None})


def stopped(run: RunFolder) -> tuple[float | None, str] | None:
    """(step, reason) when summary.json says the run was stopped early."""
    info = run.summary.get("stopped")
    if not info:
        return None
    if isinstance(info, dict):
        return as_number(info.get("step")), str(info.get("reason", ""))
    return None, str(info)
