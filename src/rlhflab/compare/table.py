"""The console table of a comparison's summary.json (`rlhflab compare`, `rlhflab demo --compare`)."""

from __future__ import annotations

import math
from typing import Any


def _cell(value: Any, kind: str) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "—"
    return {"pct": f"{value:.1%}", "pts": f"{100 * value:+.1f} pts", "kl": f"{value:.3g}", "s": f"{value:.0f}",
            "eps": f"{value:.1f}"}[kind]


def format_compare_table(summary: dict) -> str:
    """method | test pass | gain | KL | wall s | episodes/s, one line per model (the start first), aligned."""
    lines = [["method", "test pass", "gain", "KL", "wall s", "episodes/s"],
             ["start", _cell(summary["test_pass_rate"]["start"], "pct"), "", "0", "", ""]]
    for name, m in summary["methods"].items():
        if "error" in m:
            lines.append([name, f"failed: {m['error'][:70]}", "", "", _cell(m.get("wall_s"), "s"), ""])
            continue
        lines.append([name, _cell(m["test_pass_rate"], "pct"), _cell(m["gain"], "pts"), _cell(m["kl_to_reference"], "kl"),
                      _cell(m["wall_s"], "s"), _cell(m["episodes_per_s"], "eps")])
    widths = [max(len(line[i]) for line in lines if not line[1].startswith("failed") or i != 1) for i in range(6)]
    text = ["  ".join(c.ljust(w) if i == 0 or c.startswith("failed") else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:]])
