"""Families whose difficulty is the content of a one-token answer: yes/no, the next number.

The answer is so short that the tiny model's typical failure is talking around
it ("The number is 42.") or getting the fact wrong, not its layout.
"""

from __future__ import annotations

import random

from rlhflab.tasks.base import Draw, Family, TaskItem, blank, phrase
from rlhflab.tasks.pools import ContentPool
from rlhflab.tasks.rules import standard_rules

# --- yes_no -------------------------------------------------------------------------

YES_NO_TEMPLATES = (
    "Is {a} greater than {b}? Answer yes or no.\n",
    "Is {a} bigger than {b}? Reply with yes or no.\n",
    "Question: is {a} larger than {b}? Answer with yes or no only.\n",
)
YES_NO_CHATTER = ("The answer is {r}.", "{r}, because {hi} is greater than {lo}.")


def _make_yes_no(rng: random.Random, pool: ContentPool) -> Draw:
    """Half yes, half no: the larger number goes first for "yes"."""
    low, high = sorted(rng.sample(pool.numbers, 2))
    a, b = (high, low) if rng.random() < 0.5 else (low, high)
    answer = "yes" if a > b else "no"
    return Draw({"a": str(a), "b": str(b)}, answer, (str(a), str(b)))


def _yes_no_chatter(item: TaskItem, rng: random.Random) -> str:
    low, high = sorted(int(n) for n in item.content)
    return phrase(rng, YES_NO_CHATTER, r=item.reference, hi=high, lo=low)


YES_NO = Family(
    name="yes_no",
    templates=YES_NO_TEMPLATES,
    frames=("yes", "no", *map(blank, YES_NO_CHATTER)),
    kinds=("wrong_content", "wrong_case", "extra_chatter", "extra_space", "missing_eos"),
    maker=_make_yes_no,
    violators={
        "wrong_content": lambda item, rng: "no" if item.reference == "yes" else "yes",
        "wrong_case": lambda item, rng: rng.choice((item.reference.capitalize(), item.reference.upper())),
        "extra_chatter": _yes_no_chatter,
        "extra_space": lambda item, rng: phrase(rng, (" {r}", "{r} "), r=item.reference),
    },
    rules=standard_rules(),
)

# --- number_only --------------------------------------------------------------------

NUMBER_TEMPLATES = (
    "What number comes after {n}? Reply with the number only.\n",
    "Which number follows {n}? Answer with just the number.\n",
    "Give the number that comes right after {n}, and nothing else.\n",
)
NUMBER_CHATTER = ("The number is {r}.", "{r} comes after {n}.", "Sure! {r}")


def _make_number(rng: random.Random, pool: ContentPool) -> Draw:
    """Numbers ending in 9 are left out: their successor needs a carry."""
    n = rng.choice([m for m in pool.numbers if m % 10 != 9])
    return Draw({"n": str(n)}, str(n + 1), (str(n),))


NUMBER_ONLY = Family(
    name="number_only",
    templates=NUMBER_TEMPLATES,
    frames=tuple(map(blank, NUMBER_CHATTER)),
    kinds=("extra_chatter", "wrong_content", "extra_space", "missing_eos"),
    maker=_make_number,
    violators={
        "extra_chatter": lambda item, rng: phrase(rng, NUMBER_CHATTER, r=item.reference, n=item.content[0]),
        "wrong_content": lambda item, rng: str(int(item.content[0]) + rng.choice((0, 2))),
        "extra_space": lambda item, rng: phrase(rng, (" {r}", "{r} "), r=item.reference),
    },
    rules=standard_rules(),
)
