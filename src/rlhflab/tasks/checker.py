"""The family registry and the one exact checker every stage uses.

Evaluation, verifiable rewards and the reward-model diagnostics all call
`check`, so "passed" means the same thing everywhere: the answer equals the
reference byte for byte (trailing whitespace included) and it ended with EOS.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from rlhflab.errors import UserInputError
from rlhflab.tasks.base import VIOLATION_KINDS, Family, TaskItem, Verdict
from rlhflab.tasks.families_content import NUMBER_ONLY, YES_NO
from rlhflab.tasks.families_format import JSON_OBJECT, LOWERCASE, REPEAT_WORD, SUM_RESULT, UPPERCASE
from rlhflab.tasks.families_lists import COMMA_LIST, FIRST_ITEM, KEEP_ORDER, LAST_ITEM

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        SUM_RESULT, COMMA_LIST, LOWERCASE, UPPERCASE, JSON_OBJECT, YES_NO,
        NUMBER_ONLY, KEEP_ORDER, REPEAT_WORD, FIRST_ITEM, LAST_ITEM,
    )
}  # fmt: skip


def family_of(item: TaskItem) -> Family:
    try:
        return FAMILIES[item.family]
    except KeyError:
        raise UserInputError(
            f"unknown task family {item.family!r}", fix=f"use one of {sorted(FAMILIES)}"
        ) from None


def check(item: TaskItem, answer: str, ended_with_eos: bool = True) -> Verdict:
    """Pass iff `answer == item.reference` and the answer ended; else name the violation."""
    if not ended_with_eos:
        return Verdict(False, "missing_eos", "no EOS: the answer hit the length cap")
    return family_of(item).diagnose(item, answer)


def violations(item: TaskItem, rng: random.Random) -> dict[str, str]:
    """Every violation kind the item's family supports -> one answer that violates it so."""
    family = family_of(item)
    return {kind: family.violate(item, kind, rng) for kind in family.kinds}


def validate_kinds(kinds: Sequence[str]) -> None:
    unknown = [k for k in kinds if k not in VIOLATION_KINDS]
    if unknown:
        raise UserInputError(f"unknown violation kinds {unknown}", fix=f"use some of {list(VIOLATION_KINDS)}")


def pass_rate_table(verdicts: Sequence[tuple[str, Verdict]]) -> dict:
    """Summarise (family, verdict) pairs: overall and per-family pass rate, failure kinds.

    `violations` lists every kind (zero when unseen) so tables and plots keep fixed columns.
    """
    counts = Counter(family for family, _ in verdicts)
    passes = Counter(family for family, v in verdicts if v.passed)
    failed = Counter(v.kind for _, v in verdicts if not v.passed)
    total = len(verdicts)
    return {
        "overall": sum(passes.values()) / total if total else 0.0,
        "per_family": {f: passes[f] / n for f, n in sorted(counts.items())},
        "counts": dict(sorted(counts.items())),
        "violations": {k: failed[k] for k in VIOLATION_KINDS},
    }
