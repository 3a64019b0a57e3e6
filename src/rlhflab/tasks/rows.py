"""Items -> the row dictionaries other stages read (TRL's prompt/completion and pair columns).

SFT rows deliberately mix in violating demonstrations: the seeds' SFT model is
imperfect in a known, mostly-dominant way, which gives reward modelling and RL
something real to fix and lets a run show whether they fixed it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlhflab.errors import UserInputError
from rlhflab.tasks.base import TaskItem
from rlhflab.tasks.checker import family_of, validate_kinds


def _fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise UserInputError(f"{name} must be in [0, 1], got {value}")


def sft_rows(
    items: Sequence[TaskItem], violation_fraction: float = 0.6, dominant_share: float = 0.75, seed: int = 0
) -> list[dict]:
    """One demonstration per item: {"prompt", "completion", "family", "violation"}.

    Exactly round(violation_fraction * n) rows violate; round(dominant_share * that)
    of them with their family's dominant kind, the rest with another kind of the
    family. `missing_eos` is never a demonstration: EOS is the tokenizer's to add.
    """
    _fraction("violation_fraction", violation_fraction)
    _fraction("dominant_share", dominant_share)
    rng = random.Random(f"rlhflab.tasks.sft:{seed}")
    order = list(range(len(items)))
    rng.shuffle(order)
    n_violating = round(violation_fraction * len(items))
    n_dominant = round(dominant_share * n_violating)
    kind_of = {i: "dominant" for i in order[:n_dominant]} | {i: "other" for i in order[n_dominant:n_violating]}
    rows = []
    for i, item in enumerate(items):
        family = family_of(item)
        kinds = [k for k in family.kinds if k != "missing_eos"]
        kind, completion = "none", item.reference
        if i in kind_of:
            kind = kinds[0] if kind_of[i] == "dominant" or len(kinds) == 1 else rng.choice(kinds[1:])
            completion = family.violate(item, kind, rng)
        rows.append({"prompt": item.prompt, "completion": completion, "family": item.family, "violation": kind})
    return rows


def pair_rows(
    items: Sequence[TaskItem], kinds: Sequence[str] | None = None, pairs_per_prompt: int = 3, seed: int = 0,
    always: Sequence[str] = (),
) -> list[dict]:
    """Preference pairs {"prompt", "chosen", "rejected", "family", "violation"}; chosen = reference.

    Each prompt gets up to `pairs_per_prompt` different rejected kinds: its family's
    dominant kind first when allowed, then the `always` kinds it has (e.g. wrong_content,
    the errors a reward model finds hardest), then random others. `kinds` restricts the
    rejected kinds (a narrow set makes a deliberately weak reward model); families with
    none are skipped.
    """
    if kinds is not None:
        validate_kinds(kinds)
    validate_kinds(always)
    if pairs_per_prompt < 1:
        raise UserInputError(f"pairs_per_prompt must be >= 1, got {pairs_per_prompt}")
    rng = random.Random(f"rlhflab.tasks.pairs:{seed}")
    rows = []
    for item in items:
        family = family_of(item)
        allowed = [k for k in family.kinds if kinds is None or k in kinds]
        if not allowed:
            continue
        first = allowed[:1] + [k for k in allowed[1:] if k in always]
        rest = [k for k in allowed if k not in first]
        picked = first[:pairs_per_prompt] + rng.sample(rest, max(0, min(len(rest), pairs_per_prompt - len(first))))
        for kind in picked:
            rejected = family.violate(item, kind, rng)
            rows.append(
                {"prompt": item.prompt, "chosen": item.reference, "rejected": rejected,
                 "family": item.family, "violation": kind}
            )  # fmt: skip
    return rows


def prompt_rows(items: Sequence[TaskItem]) -> list[dict]:
    """RL / evaluation prompts: {"prompt", "family", "reference"}."""
    return [{"prompt": item.prompt, "family": item.family, "reference": item.reference} for item in items]
