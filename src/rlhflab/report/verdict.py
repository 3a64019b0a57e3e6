"""The headline: did the model get better on prompts it was not trained on — by more than noise?

Training curves can rise while the model gets worse at the task (reward hacking, a
reward model that likes the wrong thing), so the first thing a report states is the
held-out check — test or validation pass rate before and after — read from summary.json,
or from the validation rows of metrics.jsonl when the summary has none.

Every rate carries its 95 % interval and every change the interval of the difference
(rlhflab.intervals): paired over the same prompts (Agresti-Min) where the run kept each
prompt's verdict (the demo's and a comparison's test answers), otherwise unpaired (Newcombe),
which is conservative. A change is called better or worse only when that interval excludes 0;
otherwise the report says it is within noise and gives the interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhflab.intervals import (BETTER, WITHIN_NOISE, WORSE, Interval, difference_from_dict, paired_counts, percent,
                               points, rate_from_dict, rate_interval, unpaired_difference, verdict)
from rlhflab.report.html import Markup, join, note, pct, table, tag
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
    after_interval: Interval | None = None  # 95 % interval of `after`
    before_interval: Interval | None = None
    difference: Interval | None = None  # 95 % interval of after - before
    paired: bool = False  # difference paired over the same prompts (else unpaired: conservative)

    @property
    def delta(self) -> float | None:
        return None if self.before is None else self.after - self.before

    @property
    def outcome(self) -> str | None:
        """better / worse / within noise by the interval of the difference; higher / lower / no change without one."""
        if self.delta is None:
            return None
        if self.difference is not None:
            return verdict(self.difference)
        return "higher" if self.delta > 0 else "lower" if self.delta < 0 else "no change"


def prompt_count(config: dict[str, Any], found: dict[str, Any] | None = None) -> int | None:
    """Prompts behind a validation pass rate: `n` in the summary's entry (`found`) when written, else from the
    config (the first eval_prompts of the suite's validation split); None for a user's prompt file of unknown size."""
    n = as_number((found or {}).get("n"))
    if n is not None:
        return int(n)
    eval_prompts = as_number(config.get("eval_prompts"))
    if eval_prompts is None or any(config.get(k) for k in ("validation_file", "train_file", "prompts_file")):
        return None
    validation = as_number(config.get("num_validation_prompts"))
    return int(min(eval_prompts, validation)) if validation is not None else None


def held_out_prompt_count(run: RunFolder, found: dict[str, Any] | None = None) -> int | None:
    return prompt_count(run.config or {}, found)


def rate_check(what: str, after_label: str, after: float, n: int | None, before_label: str = "",
               before: float | None = None) -> Check:
    """A check on rates with n prompts each and no per-prompt verdicts: Wilson intervals, unpaired difference."""
    if not n:
        return Check(what, after_label, after, before_label, before)
    after_iv = rate_interval(after, n)
    before_iv = rate_interval(before, n) if before is not None else None
    diff = unpaired_difference(before_iv, after_iv) if before_iv is not None else None
    return Check(what, after_label, after, before_label, before, True, after_iv, before_iv, diff)


# --- the demo's and a comparison's test answers, prompt by prompt ---------------------------------------------


def answers_by_model(run: RunFolder, names: list[str]) -> dict[str, dict[Any, tuple[str, bool]]]:
    """samples.jsonl's checked test answers of each named model ('stage' in the demo, 'model' in a comparison):
    {name: {prompt key: (family, passed)}}, the key being prompt_index where written, else the prompt."""
    found: dict[str, dict[Any, tuple[str, bool]]] = {}
    for row in run.samples or []:
        name = row.get("stage", row.get("model"))
        if name not in names or "passed" not in row or "step" in row:
            continue
        key = row["prompt_index"] if isinstance(row.get("prompt_index"), int) else row.get("prompt")
        found.setdefault(str(name), {})[key] = (str(row.get("family", "all")), bool(row["passed"]))
    return found


def paired_differences(answers: dict[str, dict[Any, tuple[str, bool]]], before: str, after: str) -> dict[str, Interval]:
    """{family | overall: interval of after - before} over the prompts both answered; {} without both."""
    if before not in answers or after not in answers:
        return {}
    shared = [k for k in answers[before] if k in answers[after]]
    if not shared:
        return {}
    groups: dict[str, list] = {OVERALL: shared}
    for key in shared:
        groups.setdefault(answers[before][key][0], []).append(key)
    out = {}
    for group, keys in groups.items():
        counts = paired_counts([answers[before][k][1] for k in keys], [answers[after][k][1] for k in keys])
        out[group] = difference_from_dict(counts)
    return out


def _demo_checks(run: RunFolder) -> list[Check]:
    summary = run.summary
    rates = {name: as_number(v) for name, v in (summary.get("test_pass_rate") or {}).items()}
    rates = {name: v for name, v in rates.items() if v is not None}
    if not rates:
        return []
    tables = summary.get("test_tables") or {}
    intervals = {name: table_interval(tables.get(name) or {}, OVERALL) for name in rates}
    (base, base_rate), *others = rates.items()
    if not others:
        return [Check("held-out test pass rate", base, base_rate, after_interval=intervals[base])]
    answers = answers_by_model(run, list(rates))
    checks = []
    for name, rate in others:
        paired = paired_differences(answers, base, name).get(OVERALL)
        diff = paired
        if diff is None and intervals[base] is not None and intervals[name] is not None:
            diff = unpaired_difference(intervals[base], intervals[name])
        checks.append(Check("held-out test pass rate", name, rate, base, base_rate, True, intervals[name],
                            intervals[base], diff, paired is not None))
    return checks


def _summary_checks(run: RunFolder) -> list[Check]:
    """Checks that summary.json states directly, for each kind of run folder."""
    summary = run.summary
    checks = _demo_checks(run)
    val = summary.get("validation_pass_rate") or {}
    start, end = as_number(val.get("start")), as_number(val.get("end"))
    if end is not None:
        checks.append(rate_check("held-out validation pass rate", "end", end, held_out_prompt_count(run, val),
                                 "start", start))
    reward = summary.get("validation_reward") or {}
    start, end = as_number(reward.get("start")), as_number(reward.get("end"))
    if end is not None:
        checks.append(Check("validation reward (the reward's own opinion, no verifier)", "end", end, "start", start,
                            is_rate=False))
    rate = summary.get("pass_rate") or {}
    overall = as_number(rate.get("overall"))
    if overall is not None:
        checks.append(Check(f"held-out {summary.get('split', 'eval')} pass rate", "", overall,
                            after_interval=table_interval(rate, OVERALL)))
    test_pairs = (summary.get("pairs") or {}).get("test") or {}
    accuracy, pairs = as_number(test_pairs.get("accuracy")), as_number(test_pairs.get("pairs"))
    if accuracy is not None:
        checks.append(rate_check("held-out test pairwise accuracy of the reward model (chance 50%)", "", accuracy,
                                 int(pairs) if pairs else None))
    return checks


def _metric_checks(run: RunFolder) -> list[Check]:
    """First and last validation pass rate in metrics.jsonl (SFT, or a run killed before its summary)."""
    curve = series(run.metrics, "val/pass_rate")
    if not curve.values:
        return []
    n = held_out_prompt_count(run)
    last = rate_check("held-out validation pass rate", f"step {curve.steps[-1]:g}", curve.values[-1], n)
    if len(curve.values) == 1:
        return [last]
    return [rate_check(last.what, last.after_label, last.after, n, f"step {curve.steps[0]:g}", curve.values[0])]


def held_out_checks(run: RunFolder) -> list[Check]:
    return _summary_checks(run) or _metric_checks(run)


def rate_text(value: float, interval: Interval | None) -> str:
    return percent(interval) if interval is not None else pct(value)


def describe(check: Check) -> str:
    """'held-out test pass rate 49.0% [43.4–54.6] → 67.0% [61.5–72.1] (+18.0 pts [+10.3, +25.4], better, paired
    over 300 prompts; sft → ppo)'."""
    if check.before is None:
        where = f" ({check.after_label})" if check.after_label else ""
        shown = rate_text(check.after, check.after_interval) if check.is_rate else f"{check.after:.3f}"
        return f"{check.what} {shown}{where}"
    labels = f"; {check.before_label} → {check.after_label}" if check.before_label else ""
    if not check.is_rate:
        return f"{check.what} {check.before:.3f} → {check.after:.3f} ({check.delta:+.3f}, no interval: a mean " \
               f"reward{labels})"
    if check.difference is None:
        change = f"{check.delta * 100:+.1f} points, no interval: prompt count unknown"
    else:
        how = f"paired over {check.difference.n} prompts" if check.paired else \
            f"unpaired over {check.difference.n} prompts each"
        change = f"{points(check.difference)}, {check.outcome}, {how}"
    return f"{check.what} {rate_text(check.before, check.before_interval)} → {rate_text(check.after, check.after_interval)} " \
           f"({change}{labels})"


def _name(check: Check) -> str:
    return check.after_label if check.before_label and check.what.endswith("test pass rate") else check.what


def overall_verdict(checks: list[Check]) -> tuple[str, str]:
    """(sentence, css class) summing up every before/after check: "better" only where the interval of the
    difference excludes 0."""
    compared = [c for c in checks if c.delta is not None]
    if not checks:
        return "No held-out check in this run: nothing says whether the model got better.", "neutral"
    if not compared:
        return "One held-out measurement, nothing to compare it with.", "neutral"
    outcomes = {c.outcome for c in compared}
    if outcomes == {BETTER}:
        return "Better on the held-out check.", "good"
    if outcomes == {WORSE}:
        return "Worse on the held-out check.", "bad"
    if outcomes == {WITHIN_NOISE}:
        spans = "; ".join(f"{_name(c)} {points(c.difference)}" for c in compared)
        return f"Within noise on the held-out check: the 95 % interval of the difference includes 0 ({spans}).", \
            "neutral"
    if outcomes == {"no change"}:
        return "No change on the held-out check.", "neutral"
    if outcomes <= {"higher", "no change"}:
        return "Higher on the held-out check, but with no interval (a reward mean, or no prompt count): not shown " \
               "to be more than noise.", "neutral"
    if outcomes <= {"lower", "no change"}:
        return "Lower on the held-out check, but with no interval: not shown to be more than noise.", "neutral"
    parts = []
    for outcome in (BETTER, WITHIN_NOISE, WORSE, "higher", "lower", "no change"):
        names = [_name(c) for c in compared if c.outcome == outcome]
        if names:
            parts.append(f"{outcome} on {', '.join(names)}")
    return f"Mixed: {'; '.join(parts)}.", "neutral"


def _check_line(check: Check) -> Markup:
    kind = {BETTER: "good", WORSE: "bad"}.get(check.outcome or "", "neutral")
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


def table_interval(table: dict[str, Any], key: str) -> Interval | None:
    """A pass-rate table's interval for `key` (overall or a family): as stored, else Wilson from rate and count."""
    stored = rate_from_dict((table.get("intervals") or {}).get(key))
    if stored is not None:
        return stored
    counts = {f: n for f, n in (table.get("counts") or {}).items() if isinstance(n, int)}
    rate = as_number(table.get("overall") if key == OVERALL else (table.get("per_family") or {}).get(key))
    n = sum(counts.values()) if key == OVERALL else counts.get(key)
    return rate_interval(rate, n) if rate is not None and n else None


def family_intervals(run: RunFolder) -> dict[str, dict[str, Interval]]:
    """{column: {family | overall: 95 % interval}} for the columns of `family_columns` that have counts."""
    summary = run.summary
    if summary.get("test_tables"):
        tables = summary["test_tables"]
    elif isinstance(summary.get("pass_rate"), dict) and summary["pass_rate"].get("per_family"):
        tables = {summary.get("split", "eval"): summary["pass_rate"]}
    else:
        return {}  # validation rows in metrics.jsonl: per-family counts not recorded
    out = {}
    for name, t in tables.items():
        keys = [*(t.get("per_family") or {}), OVERALL]
        out[name] = {k: iv for k in keys if (iv := table_interval(t, k)) is not None}
    return out


def _change(first: float | None, last: float | None, diff: Interval | None) -> str:
    if diff is not None:
        return f"{points(diff)} {verdict(diff)}"
    return "—" if first is None or last is None else f"{(last - first) * 100:+.1f} pts"


def family_table(run: RunFolder) -> Markup | None:
    """Pass rate per family with its 95 % interval, one column per model / step, plus the change from first to
    last with the interval of the difference (paired over the same prompts where the run kept each verdict)."""
    columns, counts = family_columns(run)
    if not columns:
        return None
    names = list(columns)
    intervals = family_intervals(run)
    paired = paired_differences(answers_by_model(run, names), names[0], names[-1]) if len(names) > 1 else {}
    families = sorted({f for col in columns.values() for f in col} - {OVERALL}) + [OVERALL]
    headers = ["family", *names] + (["change"] if len(names) > 1 else []) + (["n"] if counts else [])
    rows = []
    for family in families:
        rates = [as_number(columns[n].get(family)) for n in names]
        spans = [intervals.get(n, {}).get(family) for n in names]
        row = [family, *(rate_text(r, iv) if r is not None else "—" for r, iv in zip(rates, spans))]
        if len(names) > 1:
            diff = paired.get(family)
            if diff is None and spans[0] is not None and spans[-1] is not None:
                diff = unpaired_difference(spans[0], spans[-1])
            row.append(_change(rates[0], rates[-1], diff))
        n = sum(v for v in counts.values() if isinstance(v, int)) if family == OVERALL else counts.get(family, "—")
        rows.append(row + ([n] if counts else []))
    how = "paired over the same prompts (Agresti-Min)" if paired else "unpaired (Newcombe; conservative)"
    change = f" Change: {names[0]} → {names[-1]} with the 95 % interval of the difference, {how}; better or worse " \
             f"only where it excludes 0." if len(names) > 1 else ""
    said = note(f"[low–high]: 95 % interval of each rate (Wilson).{change}") if intervals else Markup("")
    return join([table(headers, rows, row_headers=True, class_="families"), said])
