"""Checker rules that name how an answer broke the instruction.

`Family.diagnose` tries a family's rules in order after the exact comparison
failed. The order matters: a fenced or numbered answer is named for its layout
before its case or spacing is looked at, and "the right answer plus words" is
the last guess before the fallback `wrong_content`.
"""

from __future__ import annotations

import re

from rlhflab.tasks.base import Rule, TaskItem

_NUMBERED_LINE = re.compile(r"^\s*\d+[.)]\s+\S")


def fenced(item: TaskItem, answer: str) -> str | None:
    if "```" in answer:
        return "wrapped in a Markdown code fence"
    return None


def numbered(item: TaskItem, answer: str) -> str | None:
    lines = [line for line in answer.split("\n") if line.strip()]
    if lines and all(_NUMBERED_LINE.match(line) for line in lines):
        return "numbered list instead of the asked-for layout"
    return None


def case(item: TaskItem, answer: str) -> str | None:
    if answer.lower() == item.reference.lower():
        return f"wrong letter case: expected {item.reference!r}"
    return None


def _spaces(text: str) -> int:
    return sum(c.isspace() for c in text)


def _squeeze(text: str) -> str:
    return "".join(c for c in text if not c.isspace())


def spacing_missing(item: TaskItem, answer: str) -> str | None:
    if _squeeze(answer) == _squeeze(item.reference) and _spaces(answer) < _spaces(item.reference):
        if "RESULT:" in answer and "RESULT: " not in answer:
            return "missing space after 'RESULT:'"
        return "missing space"
    return None


def spacing_extra(item: TaskItem, answer: str) -> str | None:
    if _squeeze(answer) == _squeeze(item.reference) and _spaces(answer) > _spaces(item.reference):
        if answer.strip() != answer:
            return "extra whitespace at the start or end"
        return "extra space"
    return None


def reordered(sep: str) -> Rule:
    """The reference's items, split on `sep`, in another order."""

    def rule(item: TaskItem, answer: str) -> str | None:
        got, want = answer.split(sep), item.reference.split(sep)
        if len(want) > 1 and sorted(got) == sorted(want) and got != want:
            return "items not in the given order"
        return None

    return rule


def count_changed(sep: str) -> Rule:
    """Only allowed items (reference or prompt content), but too many or too few."""

    def rule(item: TaskItem, answer: str) -> str | None:
        got = [part.strip() for part in answer.split(sep)]
        want = item.reference.split(sep)
        allowed = set(want) | set(item.content)
        if all(part in allowed for part in got) and len(got) != len(want):
            return f"{len(got)} items instead of {len(want)}"
        return None

    return rule


def chatter(item: TaskItem, answer: str) -> str | None:
    """The reference, as a whole token, inside words nobody asked for."""
    pattern = r"(?<![A-Za-z0-9])" + re.escape(item.reference) + r"(?![A-Za-z0-9])"
    match = re.search(pattern, answer)
    if match is None:
        return None
    rest = answer[: match.start()] + answer[match.end() :]
    if re.search(r"[A-Za-z]", rest):
        return "correct answer wrapped in extra words"
    return None


def standard_rules(sep: str | None = None) -> tuple[tuple[str, Rule], ...]:
    """The canonical order; `sep` (item separator) enables the list rules."""
    head: tuple[tuple[str, Rule], ...] = (
        ("fenced_json", fenced),
        ("numbered_list", numbered),
        ("wrong_case", case),
        ("missing_space", spacing_missing),
        ("extra_space", spacing_extra),
    )
    lists: tuple[tuple[str, Rule], ...] = ()
    if sep is not None:
        lists = (("reordered_items", reordered(sep)), ("wrong_count", count_changed(sep)))
    return head + lists + (("extra_chatter", chatter),)
