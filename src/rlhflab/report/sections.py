"""Report sections about what the run learnt: curves, alarms, the reward model, sample answers.

Each function takes a RunFolder and returns HTML, or None when the run has nothing for
that section (the caller then leaves the section out).
"""

from __future__ import annotations

from typing import Any

from rlhflab.report.html import Markup, join, key_value_table, note, number, pct, pre, table, tag
from rlhflab.report.plots import Line, grid, panel
from rlhflab.report.runfolder import RunFolder, as_number
from rlhflab.report.series import alarm_steps, collect_alarms, has_key, series

# (title, metric keys drawn in one panel); a panel appears when the metrics hold any of its keys
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (objective/scores)", ("objective/scores",)),
    ("KL to the reference (objective/kl, nats)", ("objective/kl",)),
    ("RLHF reward: scores − β·KL (objective/rlhf_reward)", ("objective/rlhf_reward",)),
    ("ratio π/π_old (val/ratio, min, max)", ("val/ratio", "policy/ratio_min", "policy/ratio_max")),
    ("clip fraction (policy / value)", ("policy/clipfrac_avg", "val/clipfrac_avg")),
    ("value loss (loss/value_avg)", ("loss/value_avg",)),
    ("explained variance of the values", ("val/explained_variance",)),
    ("entropy (objective/entropy, nats/token)", ("objective/entropy",)),
    ("entropy bonus coefficient (entropy_coef)", ("entropy_coef",)),
    ("response length (tokens)", ("response/length_mean",)),
    ("response diversity and length cap", ("response/distinct_2", "response/duplicate_share", "response/capped_share")),
    ("validation pass rate (held-out)", ("val/pass_rate",)),
    ("approx. KL per update (policy/approxkl_avg)", ("policy/approxkl_avg",)),
    ("policy loss (loss/policy_avg)", ("loss/policy_avg",)),
    ("SFT loss (loss/sft)", ("loss/sft",)),
    ("validation loss (val/loss)", ("val/loss",)),
    ("reward-model loss (loss/rm)", ("loss/rm",)),
    ("reward-model pair accuracy (rm/accuracy)", ("rm/accuracy",)),
    ("gradient norm before clipping", ("grad_norm",)),
    ("learning rate", ("lr",)),
)
MAX_PROMPTS = 12  # sample prompts shown side by side; the rest are counted in a note


def curves_section(run: RunFolder) -> Markup | None:
    marks = alarm_steps(run)
    panels = []
    for title, keys in PANELS:
        present = [k for k in keys if has_key(run.metrics, k)]
        if present:
            panels.append(panel(title, [Line(k, series(run.metrics, k)) for k in present], marks))
    if not panels:
        return None
    legend = note("Red dashed lines mark alarm steps.") if marks else Markup("")
    return legend + grid(panels)


def alarms_section(run: RunFolder) -> Markup | None:
    alarms = collect_alarms(run)
    if not alarms:
        return None
    rows = [[a.name, "—" if a.step is None else f"{a.step:g}", a.reason, a.source] for a in alarms]
    return table(["alarm", "step", "reason", "from"], rows, row_headers=True)


def _pairs_table(pairs: dict[str, Any]) -> Markup:
    keys = ("accuracy", "margin", "pairs", "chosen_mean", "rejected_mean")
    rows = [[split, *(m.get(k) for k in keys)] for split, m in pairs.items() if isinstance(m, dict)]
    return table(["split", *keys], rows, row_headers=True)


def _pairs_per_family(pairs: dict[str, Any], field: str) -> Markup | None:
    splits = {s: m.get(field) or {} for s, m in pairs.items() if isinstance(m, dict) and m.get(field)}
    if not splits:
        return None
    names = sorted({n for col in splits.values() for n in col})
    rows = [[name, *(pct(as_number(col.get(name))) for col in splits.values())] for name in names]
    return table([field.replace("_", " "), *splits], rows, row_headers=True)


def reward_model_section(run: RunFolder) -> Markup | None:
    """Pairwise accuracy of an rm run, the diagnosis on the policy's own answers, worst cases."""
    summary, parts = run.summary, []
    if isinstance(summary.get("pairs"), dict):
        parts += [tag("h4", "pairwise accuracy per split"), _pairs_table(summary["pairs"])]
        parts += [t for t in (_pairs_per_family(summary["pairs"], f) for f in ("per_family", "per_violation")) if t]
    if isinstance(summary.get("rm"), dict) and summary["rm"]:
        parts += [tag("h4", "reward model (demo headline)"), key_value_table(summary["rm"])]
    if isinstance(summary.get("rm_diagnosis"), dict):
        parts += [tag("h4", "diagnosis on the policy's own answers"), key_value_table(summary["rm_diagnosis"])]
    if isinstance(summary.get("length_bias"), dict):
        parts += [tag("h4", "length-bias probe: reward for filler alone, score(padded) − score(plain)"),
                  _length_bias_table(summary["length_bias"])]
    if run.worst_cases is not None:
        parts += [tag("h4", "worst cases (worst_cases.md)"), pre(run.worst_cases)]
    return join(parts) if parts else None


def _length_bias_table(probe: dict[str, Any]) -> Markup:
    """One row per filler and one for all: a positive change means the RM pays for length."""
    per_filler = probe.get("per_filler") if isinstance(probe.get("per_filler"), dict) else {}
    named = [(name, row) for name, row in per_filler.items() if isinstance(row, dict)] + [("all fillers", probe)]
    rows = [[name, number(as_number(row.get("mean_change"))), pct(as_number(row.get("share_raised"))),
             number(as_number(row.get("mean_added_tokens"))), number(as_number(row.get("change_per_token")))]
            for name, row in named]
    headers = ["filler", "mean score change", "pairs raised", "tokens added", "change per token"]
    return table(headers, rows, row_headers=True, id="length-bias")


def _sample_columns(rows: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """Group by step (start, middle, end) or, for the demo's test answers, by stage."""
    steps = sorted({s for r in rows if (s := as_number(r.get("step"))) is not None})
    if steps:
        picked = [steps[0], steps[len(steps) // 2], steps[-1]]
        return "step", list(dict.fromkeys(picked))
    stages = list(dict.fromkeys(r["stage"] for r in rows if isinstance(r.get("stage"), str)))
    return ("stage", stages) if stages else ("", [None])  # an eval: one column of answers


def _column_of(row: dict[str, Any], key: str) -> Any:
    """The row's column value: its step as a float, its stage name, or None (one column)."""
    if key == "step":
        return as_number(row.get("step"))
    value = row.get(key) if key else None
    return value if isinstance(value, str) else None


def _answer_cell(row: dict[str, Any] | None) -> Markup:
    if row is None:
        return tag("td", "—")
    passed = row.get("passed")
    verdict = "✓ pass" if passed is True else f"✗ {row.get('kind', 'fail')}: {row.get('reason', '')}"
    kind = "good" if passed is True else "bad"
    return tag("td", pre(str(row.get("answer", "")), class_="answer") + tag("span", verdict, class_=kind))


def samples_section(run: RunFolder) -> Markup | None:
    """The same fixed prompts' answers at start, middle and end, prompts whose verdict changed first."""
    if run.samples is None:
        return None
    if not run.samples:
        return note("samples.jsonl is empty: this run saved no answers.")
    key, columns = _sample_columns(run.samples)
    by_column = {c: {} for c in columns}
    for row in run.samples:
        value = _column_of(row, key)
        if value in by_column:
            by_column[value].setdefault(str(row.get("prompt", "")), row)
    prompts = list(dict.fromkeys(p for c in columns for p in by_column[c]))
    prompts.sort(key=lambda p: len({(by_column[c].get(p) or {}).get("passed") for c in columns}) == 1)
    labels = [f"step {c:g}" if key == "step" else str(c or "answer") for c in columns]
    body = [tag("tr", join([tag("th", "prompt"), tag("th", "reference"), *(tag("th", lab) for lab in labels)]))]
    for prompt in prompts[:MAX_PROMPTS]:
        first = next(by_column[c][prompt] for c in columns if prompt in by_column[c])
        cells = [tag("td", pre(prompt, class_="answer")), tag("td", pre(str(first.get("reference", "")), class_="answer"))]
        body.append(tag("tr", join(cells + [_answer_cell(by_column[c].get(prompt)) for c in columns])))
    order = "those whose verdict changed first" if len(columns) > 1 else "in file order"
    shown = note(f"{min(len(prompts), MAX_PROMPTS)} of {len(prompts)} prompts shown, {order}.")
    return shown + tag("table", join(body), class_="samples")

