"""Report sections that let someone else reproduce or cost the run: facts, time, config, versions."""

from __future__ import annotations

from typing import Any

from rlhflab.report.html import Markup, join, key_value_table, note, pre, table, tag
from rlhflab.report.runfolder import RunFolder, as_number
from rlhflab.report.series import series

TIME_KEYS = ("time/generation", "time/scoring", "time/training")
FACT_KEYS = ("stage", "model", "policy", "reward_model", "reward", "split", "decoding", "parameters",
             "updates", "episodes", "steps", "final_loss")


def facts_table(run: RunFolder) -> Markup:
    """What was run: stage, seed, model, reward ... from summary.json, falling back to config.yaml."""
    facts: dict[str, Any] = {"folder": str(run.path)}
    for key in FACT_KEYS:
        value = run.summary.get(key, run.config.get(key))
        if value not in (None, "", {}, []):
            facts[key] = value
    if "seed" in run.config:
        facts["seed"] = run.config["seed"]
    if "split_seed" in run.config:
        facts["split seed (train / validation / test)"] = run.config["split_seed"]
    return key_value_table(facts)


def final_section(run: RunFolder) -> Markup | None:
    final = run.summary.get("final")
    return key_value_table(final) if isinstance(final, dict) and final else None


def total_seconds(wall: dict[str, Any]) -> float | None:
    """wall_time_s['total'] when written, else the sum of the parts."""
    if as_number(wall.get("total")) is not None:
        return as_number(wall["total"])
    parts = [v for v in (as_number(x) for x in wall.values()) if v is not None]
    return sum(parts) if parts else None


def _split_rows(parts: dict[str, float], total: float | None) -> list[list[Any]]:
    rows = []
    for name, seconds in parts.items():
        share = f"{seconds / total:.0%}" if total else "—"
        rows.append([name, round(seconds, 1), share])
    return rows


def wall_time_section(run: RunFolder) -> Markup | None:
    """Stage wall times from summary.json and, for PPO, where the update time went."""
    parts = []
    wall = run.summary.get("wall_time_s")
    if isinstance(wall, dict) and wall:
        seconds = {k: v for k, v in ((k, as_number(v)) for k, v in wall.items()) if v is not None and k != "total"}
        total = total_seconds(wall)
        rows = _split_rows(seconds, total) + ([["total", round(total, 1), "100%"]] if total else [])
        parts.append(table(["part", "seconds", "share"], rows, row_headers=True))
    for name, own in (run.summary.get("side_by_side") or {}).items():  # the demo's checker PPO in a second process
        if as_number(own) is not None:
            parts.append(note(f"{name} ran in a second process beside the stages after it: {as_number(own):.0f} s of "
                              f"its own; its row above is only the wait for it once they were done."))
    per_update = {k.removeprefix("time/"): sum(series(run.metrics, k).values) for k in TIME_KEYS}
    per_update = {k: v for k, v in per_update.items() if v > 0}
    if per_update:
        total = sum(per_update.values())
        parts.append(note("Time inside the updates, summed over metrics.jsonl:"))
        parts.append(table(["phase", "seconds", "share"], _split_rows(per_update, total), row_headers=True))
    return join(parts) if parts else None


def reward_errors_section(run: RunFolder) -> Markup | None:
    """summary.json's `reward_errors`: the rows each user reward / verifier function raised or timed out on."""
    errors = run.summary.get("reward_errors")
    lost = errors.get("lost_rows") if isinstance(errors, dict) else None
    if not isinstance(lost, dict) or not lost:
        return None
    rows = []
    for name, counts in lost.items():
        counts = counts if isinstance(counts, dict) else {}
        raised, timed_out = (as_number(counts.get(k)) or 0 for k in ("raised", "timed_out"))
        rows.append([name, int(raised), int(timed_out), int(raised + timed_out)])
    timeout = as_number(errors.get("timeout_s"))
    limit = f"{timeout:g} s per call" if timeout else "no time limit"
    mode = errors.get("mode")
    what = ("left out of the update (a verifier's: counted as failed)" if mode == "invalid"
            else "none: a failure stops the run")
    return join([table(["function", "rows it raised on", "rows it timed out on", "rows lost"], rows, row_headers=True),
                 note(f"--reward_errors {mode}, {limit}; rows lost: {what}. Counted since the process started "
                      "(a resumed run: since the resume), training and validation calls alike.")])


def prompt_filter_section(run: RunFolder) -> Markup | None:
    """summary.json's `prompt_filter`: the train prompts --filter_prompts left out before RL, per family."""
    found = run.summary.get("prompt_filter")
    families = found.get("per_family") if isinstance(found, dict) else None
    if not isinstance(families, dict) or not families:
        return None
    rows = [[name, *(int(as_number(counts.get(k)) or 0) for k in ("prompts", "always_solved", "never_solved", "kept"))]
            for name, counts in families.items() if isinstance(counts, dict)]
    k, low, high = (as_number(found.get(key)) for key in ("samples_per_prompt", "low", "high"))
    return join([table(["family", "train prompts", "always solved (dropped)", "never solved (dropped)", "kept"], rows,
                       row_headers=True),
                 note(f"Each train prompt answered {k:g} times by the starting policy; dropped where the verified pass "
                      f"rate was <= {low:g} or >= {high:g} (its groups would all score the same). The probe sampled "
                      f"{as_number(found.get('generated')) or 0:g} answers in {as_number(found.get('seconds')) or 0:g} s.")])


def config_section(run: RunFolder) -> Markup | None:
    return pre(run.config_text) if run.config_text is not None else None


def versions_section(run: RunFolder) -> Markup | None:
    if not isinstance(run.versions, dict):
        return None
    shown = {k: ("none" if v in ([], "", None) else v) for k, v in run.versions.items()}
    return key_value_table(shown)


def notes_section(run: RunFolder) -> Markup | None:
    if not run.notes:
        return None
    return tag("ul", join(tag("li", n) for n in run.notes), class_="note")
