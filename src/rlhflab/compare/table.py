"""The console table of a comparison's summary.json (`rlhflab compare`, `rlhflab demo --compare`).

Every test pass rate shows its 95 % interval and every gain the 95 % interval of its paired
difference from the start (rlhflab.intervals): "better" only where that interval excludes 0.
"""

from __future__ import annotations

import math
from typing import Any

from rlhflab.intervals import difference_from_dict, percent, points, rate_from_dict, verdict


def _cell(value: Any, kind: str) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "—"
    return {"pct": f"{value:.1%}", "pts": f"{100 * value:+.1f} pts", "kl": f"{value:.3g}", "s": f"{value:.0f}",
            "eps": f"{value:.1f}"}[kind]


def _rate(summary: dict, name: str) -> str:
    """'36.3% [31.1–41.9]': a model's test pass rate with its interval (as plain % for an older summary)."""
    interval = rate_from_dict(((summary.get("test_tables") or {}).get(name) or {}).get("intervals", {}).get("overall"))
    return percent(interval) if interval is not None else _cell(summary["test_pass_rate"].get(name), "pct")


def _gain(m: dict) -> str:
    """'+6.7 pts [+1.3, +11.3] better': the gain over the start, paired over the test prompts."""
    diff = difference_from_dict(m.get("vs_start"))
    return f"{points(diff)} {verdict(diff)}" if diff is not None else _cell(m["gain"], "pts")


def _versus(m: dict) -> str:
    """'vs grpo: -1.2 pts [-6.0, +3.6] within noise': a variant against its method, paired over the test prompts."""
    found = m.get("vs_method")
    diff = difference_from_dict(found)
    return f"vs {found['method']}: {points(diff)} {verdict(diff)}" if diff is not None else ""


def format_compare_table(summary: dict) -> str:
    """method | test pass [95 % interval] | gain [95 % interval] | KL | wall s | episodes/s, one line per model (the
    start first), aligned; where a method generated more answers than it trained on (+dynamic, +filter) a
    `generated` column; with variants (grpo-async, grpo+dynamic ...) a last column pairs each with its method."""
    methods = summary["methods"]
    versus = any("vs_method" in m for m in methods.values())
    # answers generated beyond those trained (--dynamic_sampling, --filter_prompts): a column of their own
    extra = any(m.get("episodes_generated") not in (None, m.get("episodes")) for m in methods.values())
    lines = [["method", "test pass", "gain", "KL", "wall s", "episodes/s"] + (["generated"] if extra else [])
             + (["variant vs its method"] if versus else []),
             ["start", _rate(summary, "start"), "", "0", "", ""] + [""] * (extra + versus)]
    for name, m in methods.items():
        if "error" in m:
            lines.append([name, f"failed: {m['error'][:70]}", "", "", _cell(m.get("wall_s"), "s"), ""]
                         + [""] * (extra + versus))
            continue
        lines.append([name, _rate(summary, name), _gain(m), _cell(m["kl_to_reference"], "kl"), _cell(m["wall_s"], "s"),
                      _cell(m["episodes_per_s"], "eps")] + ([_cell(m.get("episodes_generated"), "s")] if extra else [])
                     + ([_versus(m)] if versus else []))
    columns = len(lines[0])
    widths = [max(len(line[i]) for line in lines if not line[1].startswith("failed") or i != 1) for i in range(columns)]
    text = ["  ".join(c.ljust(w) if i == 0 or (versus and i == columns - 1) or c.startswith("failed") else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    footer = ("[low–high]: 95 % intervals; a gain is paired over the test prompts (Agresti-Min) and called better "
              "or worse only where its interval excludes 0")
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:], footer])
