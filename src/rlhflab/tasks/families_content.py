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
    "How many words are in this list: {items}? Reply with the number only.\n",
    "Count the words in {items}. Answer with just the number.\n",
    "Give the number of words in {items}, and nothing else.\n",
)
NUMBER_CHATTER = ("There are {r} words.", "The list has {r} words.", "Sure! {r}")


def _make_number(rng: random.Random, pool: ContentPool) -> Draw:
    """A count of 2-6 content words: the answer is a number, the content is words.

    (An earlier "what number comes after n" stayed at 0 % for the tiny model: with
    numbers split across train/test it never learnt to copy digits and add one.)
    """
    words = rng.sample(pool.words, rng.randint(2, 6))
    return Draw({"items": " ".join(words)}, str(len(words)), tuple(words))


NUMBER_ONLY = Family(
    name="number_only",
    templates=NUMBER_TEMPLATES,
    frames=tuple(map(blank, NUMBER_CHATTER)),
    kinds=("extra_chatter", "wrong_content", "extra_space", "missing_eos"),
    maker=_make_number,
    violators={
        "extra_chatter": lambda item, rng: phrase(rng, NUMBER_CHATTER, r=item.reference),
        "wrong_content": lambda item, rng: str(int(item.reference) + rng.choice((-1, 1))),
        "extra_space": lambda item, rng: phrase(rng, (" {r}", "{r} "), r=item.reference),
    },
    rules=standard_rules(),
)
