"""The suite's data types: one prompt (`TaskItem`), one judgement (`Verdict`), one family.

A family bundles what a task needs to be used for SFT, reward modelling and
evaluation alike: prompt templates, a generator of fresh items, a generator of
answers that break the instruction in one named way, and an exact checker that
names the way an answer broke it. Keeping the generator and the checker side by
side is what lets the tests prove that every generated violation is diagnosed
as exactly the kind it was generated as.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rlhflab.errors import UserInputError
from rlhflab.tasks.pools import ContentPool

# Every way an answer can fail. `missing_eos` is special: a generated answer that
# never ended (the length cap cut it); in text form it is a run-on that repeats itself.
VIOLATION_KINDS: tuple[str, ...] = (
    "wrong_content",  # wrong arithmetic, wrong item, wrong yes/no
    "fenced_json",  # JSON wrapped in a Markdown code fence
    "wrong_case",  # right letters, wrong capitalisation
    "numbered_list",  # "1. red\n2. fox" instead of the asked-for layout
    "reordered_items",  # the right items in another order
    "missing_space",  # e.g. "RESULT:43"
    "extra_space",  # e.g. "red, fox" where no spaces were asked for, or trailing space
    "extra_chatter",  # the right answer wrapped in words nobody asked for
    "wrong_count",  # too many / too few items or repetitions
    "missing_eos",  # the answer never ended
)


@dataclass(frozen=True)
class TaskItem:
    """One prompt with its single correct answer."""

    family: str
    prompt: str  # ends with "\n"; the completion is appended directly after it
    reference: str  # the one correct answer, without EOS
    content: tuple[str, ...]  # content words / numbers shown in the prompt (split disjointness)


@dataclass(frozen=True)
class Verdict:
    """The checker's judgement on one answer."""

    passed: bool
    kind: str  # "pass" or one of VIOLATION_KINDS
    reason: str  # short, human-readable


PASS = Verdict(True, "pass", "exact match")


@dataclass(frozen=True)
class Draw:
    """What a family's generator picked: template fields, the answer, the content shown."""

    fields: Mapping[str, str]
    reference: str
    content: tuple[str, ...]


Maker = Callable[[random.Random, ContentPool], Draw]
Violator = Callable[[TaskItem, random.Random], str]
Rule = Callable[[TaskItem, str], "str | None"]  # returns a reason when the rule matches


def blank(template: str) -> str:
    """A template with its {slots} removed (literal braces kept): what the tokenizer should merge."""
    return "".join(literal for literal, *_ in string.Formatter().parse(template))


def phrase(rng: random.Random, options: Sequence[str], **fields: object) -> str:
    """One of several phrasings of the same answer frame, filled in."""
    return rng.choice(options).format(**fields)


def misspell(word: str) -> str:
    """A near miss: the word without its last letter (content words have >= 3 letters)."""
    return word[:-1]


def rotate(items: Sequence[str]) -> list[str]:
    """The items in another order (first moved to the end); differs for >= 2 distinct items."""
    return list(items[1:]) + [items[0]]


def run_on(reference: str, rng: random.Random) -> str:
    """An answer that never stopped: the reference repeated, cut mid-copy by a length cap."""
    copies = rng.randint(2, 3)
    cut = rng.randint(0, max(0, len(reference) - 1))
    return "\n".join([reference] * copies) + "\n" + reference[:cut]


def is_run_on(reference: str, answer: str) -> bool:
    """True for at least two full copies of the reference, then more of the same."""
    if not reference or not answer.startswith(reference + "\n" + reference):
        return False
    copies = len(answer) // (len(reference) + 1) + 2
    return "\n".join([reference] * copies).startswith(answer)


@dataclass(frozen=True)
class Family:
    """One task family: templates, item generator, violation generators, checker rules."""

    name: str
    templates: tuple[str, ...]  # str.format templates; each ends with "\n"
    frames: tuple[str, ...]  # answer frames and violation phrasings with content removed (tokenizer corpus)
    kinds: tuple[str, ...]  # violation kinds this family produces, dominant first
    maker: Maker
    violators: Mapping[str, Violator]  # kind -> generator, for every kind except missing_eos
    rules: tuple[tuple[str, Rule], ...]  # (kind, rule) tried in order by `diagnose`

    def __post_init__(self) -> None:
        expected = set(self.kinds) - {"missing_eos"}
        if set(self.violators) != expected:
            raise ValueError(f"family {self.name}: violators {sorted(self.violators)} != kinds {sorted(expected)}")
        if not all(t.endswith("\n") for t in self.templates):
            raise ValueError(f"family {self.name}: every template must end with a newline")

    @property
    def dominant(self) -> str:
        return self.kinds[0]

    def make(self, rng: random.Random, pool: ContentPool) -> TaskItem:
        """A fresh item whose content comes only from `pool`."""
        draw = self.maker(rng, pool)
        template = rng.choice(self.templates)
        return TaskItem(self.name, template.format(**draw.fields), draw.reference, draw.content)

    def violate(self, item: TaskItem, kind: str, rng: random.Random) -> str:
        """An answer to `item` that breaks the instruction in exactly the way `kind` names."""
        if kind not in self.kinds:
            raise UserInputError(
                f"family {self.name!r} cannot produce violation {kind!r}", fix=f"use one of {list(self.kinds)}"
            )
        if kind == "missing_eos":
            return run_on(item.reference, rng)
        return self.violators[kind](item, rng)

    def diagnose(self, item: TaskItem, answer: str) -> Verdict:
        """Exact check of a finished answer; on failure, name the first matching violation."""
        if answer == item.reference:
            return PASS
        if is_run_on(item.reference, answer):
            return Verdict(False, "missing_eos", "run-on answer: repeats itself instead of ending")
        for kind, rule in self.rules:
            reason = rule(item, answer)
            if reason is not None:
                return Verdict(False, kind, reason)
        return Verdict(False, "wrong_content", f"does not match the reference {item.reference!r}")
