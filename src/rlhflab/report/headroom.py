"""Report section "Headroom before RL": what the starting model gave an on-policy reward to reinforce.

Reads RUN/headroom.json (written by trainers/headroom.py: the online loop for its starting
policy, the demo for its SFT model, `rlhflab eval --samples_per_prompt k`) and, in a demo,
summary.json's `headroom_verdict`: each family's gain read against its headroom.
"""

from __future__ import annotations

import json
from typing import Any

from rlhflab.report.html import Markup, join, note, pct, table, tag
from rlhflab.report.runfolder import RunFolder, as_number

FILE = "headroom.json"  # trainers/headroom.py FILE (the report imports no trainer: no torch here)
STATUS = {"none": "no headroom", "ceiling": "already passes", "room": "headroom"}


def read_probe(run: RunFolder) -> tuple[dict[str, Any] | None, str | None]:
    """The probe, or None with the reason when the file is damaged (absent: None, None)."""
    path = run.path / FILE
    if not path.is_file():
        return None, None
    try:
        probe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        return None, f"{FILE} could not be read ({err}): the headroom section is omitted."
    if not isinstance(probe, dict) or not isinstance(probe.get("per_family"), dict):
        return None, f"{FILE} holds no per-family probe: the headroom section is omitted."
    return probe, None


def _row(name: str, h: Any) -> list[Any]:
    h = h if isinstance(h, dict) else {}
    rates = [pct(as_number(h.get(k))) for k in ("greedy_pass_at_1", "sampled_pass_at_1", "pass_at_k")]
    prompts = h.get("prompts")
    with_pass = f"{h.get('prompts_with_pass')} of {prompts}" if prompts is not None else "—"
    return [name, *rates, with_pass, STATUS.get(h.get("status"), "")]


def headroom_section(run: RunFolder) -> Markup | None:
    probe, problem = read_probe(run)
    if probe is None:
        return note(problem) if problem else None
    k, thresholds = probe.get("samples_per_prompt"), probe.get("thresholds") or {}
    families = probe["per_family"]
    intro = note(
        f"Before RL, on {probe.get('prompts')} {probe.get('split', '')} prompts: each prompt answered greedily and "
        f"{k} times sampled at temperature {probe.get('temperature')} (full softmax, as rollouts; "
        f"{probe.get('seconds')} s). On-policy RL can only reinforce answers the model already samples: a family "
        f"whose pass@{k} is below {pct(as_number(thresholds.get('min_pass_at_k')))} or with fewer than "
        f"{thresholds.get('min_prompts_with_pass')} prompts having any passing sample has nothing to reinforce.")
    headers = ["family", "greedy pass@1", "sampled pass@1", f"pass@{k}", "prompts with a passing sample", ""]
    rows = [_row(name, h) for name, h in families.items()] + [_row("overall", probe.get("overall"))]
    flagged = [families[f]["words"] for f in probe.get("no_headroom", []) if isinstance(families.get(f), dict)]
    parts = [intro]
    if flagged:
        parts.append(tag("ul", join(tag("li", words, class_="bad") for words in flagged)))
    else:
        parts.append(tag("p", "Every family has at least one passing sample on several prompts: RL has something "
                              "to reinforce everywhere.", class_="good"))
    parts.append(table(headers, rows, row_headers=True, id="headroom"))
    verdict = run.summary.get("headroom_verdict")
    if isinstance(verdict, list) and verdict:
        parts += [tag("h4", "each family's test gain against its headroom"),
                  tag("ul", join(tag("li", str(line)) for line in verdict))]
    return join(parts)
